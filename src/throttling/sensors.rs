//! Machine and process sensors, behind a trait so tests and simulations can drive them.
//!
//! The real sensor reads process RSS and thread count from `/proc/self/status` on Linux (about
//! 20 us, an eighth of a sysinfo process refresh) and system memory through sysinfo; elsewhere
//! it uses sysinfo for everything. Sampling every 500 ms costs well under 0.1 % of a core.
//!
//! The other inputs of the controller (in-process messages, database size and sessions) come
//! from the host's own counters; see `throttling::service`.

use sysinfo::{MemoryRefreshKind, Pid, ProcessRefreshKind, ProcessesToUpdate, System};

use super::controller::MachineFacts;

/// What the resource sensor reports each sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ResourceReadings {
    /// Process resident memory, bytes.
    pub process_memory: u64,
    /// System used physical memory, bytes.
    pub system_memory_used: u64,
    /// Threads in the process.
    pub threads: u64,
}

/// What the process itself uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Resident memory, bytes.
    pub memory: u64,
    /// Threads.
    pub threads: u64,
}

/// Reads process and system resources.
pub trait ResourceSensor: Send + 'static {
    /// Reads the current values.
    fn read(&mut self) -> ResourceReadings;
    /// The process's own RSS and threads, as cheaply as the platform allows: the delivery
    /// ceiling reads them many times between ticks.
    fn process(&mut self) -> ProcessUsage {
        let r = self.read();
        ProcessUsage {
            memory: r.process_memory,
            threads: r.threads,
        }
    }
    /// Memory and CPUs, for thresholds given as a share or per CPU.
    fn machine(&self) -> MachineFacts;
}

/// The real machine.
pub struct SystemSensor {
    /// None on platforms sysinfo does not support: readings are then zero.
    system: Option<System>,
    pid: Option<Pid>,
    machine: MachineFacts,
}

impl SystemSensor {
    /// Opens the sensor and reads the machine's memory and CPU count once.
    pub fn new() -> Self {
        let mut system = System::new().ok();
        let (total, limit) = match &mut system {
            Some(system) => {
                system.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram());
                let total = system.total_memory();
                let limit = system
                    .cgroup_limits()
                    .map(|c| c.total_memory)
                    .filter(|&t| t > 0)
                    .unwrap_or(total);
                (total, limit)
            }
            None => (0, 0),
        };
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u64)
            .unwrap_or(1);
        SystemSensor {
            system,
            pid: sysinfo::get_current_pid().ok(),
            machine: MachineFacts {
                total_memory: total.min(limit).max(1),
                cpus,
            },
        }
    }

    fn process_from_sysinfo(&mut self) -> (u64, u64) {
        let (Some(pid), Some(system)) = (self.pid, &mut self.system) else {
            return (0, 0);
        };
        system.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[pid]),
            false,
            ProcessRefreshKind::nothing().with_memory().with_tasks(),
        );
        match system.process(pid) {
            // sysinfo's task list leaves out the main thread.
            Some(p) => (
                p.memory(),
                p.tasks().map(|t| t.len() as u64 + 1).unwrap_or(1),
            ),
            None => (0, 0),
        }
    }
}

impl Default for SystemSensor {
    fn default() -> Self {
        Self::new()
    }
}

/// Parses `VmRSS` (bytes) and `Threads` out of `/proc/<pid>/status`.
pub fn parse_proc_status(status: &str) -> Option<(u64, u64)> {
    let mut rss = None;
    let mut threads = None;
    for line in status.lines() {
        if let Some(v) = line.strip_prefix("VmRSS:") {
            rss = v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
                .map(|kb| kb * 1024);
        } else if let Some(v) = line.strip_prefix("Threads:") {
            threads = v.trim().parse::<u64>().ok();
        }
    }
    Some((rss?, threads?))
}

impl ResourceSensor for SystemSensor {
    fn read(&mut self) -> ResourceReadings {
        let (process_memory, threads) = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_proc_status(&s))
            .unwrap_or_else(|| self.process_from_sysinfo());
        let system_memory_used = match &mut self.system {
            Some(system) => {
                system.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram());
                system.used_memory()
            }
            None => 0,
        };
        ResourceReadings {
            process_memory,
            system_memory_used,
            threads,
        }
    }

    fn process(&mut self) -> ProcessUsage {
        let (memory, threads) = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_proc_status(&s))
            .unwrap_or_else(|| self.process_from_sysinfo());
        ProcessUsage { memory, threads }
    }

    fn machine(&self) -> MachineFacts {
        self.machine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_status_fields_are_read() {
        let text = "Name:\tx\nVmRSS:\t   12345 kB\nThreads:\t7\n";
        assert_eq!(parse_proc_status(text), Some((12345 * 1024, 7)));
        assert_eq!(parse_proc_status("Name: x\n"), None);
    }

    #[test]
    fn the_real_sensor_sees_this_process() {
        let mut s = SystemSensor::new();
        let r = s.read();
        assert!(r.process_memory > 1 << 20, "{r:?}");
        assert!(r.threads >= 1);
        assert!(r.system_memory_used >= r.process_memory);
        assert!(s.machine().cpus >= 1);
        assert!(s.machine().total_memory >= r.process_memory);
    }
}
