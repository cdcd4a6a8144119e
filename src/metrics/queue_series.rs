//! The queues' series, kept beside the exporter's registry rather than in it.
//!
//! A queue exports about 32 series, so a host of a thousand queues exports 32 000. The
//! exporter's registry keeps each series as a hashed key with its own label list and an
//! `Arc`, about 370 bytes, and copies every label set again at each scrape: 12 MiB of a
//! 42 MiB host at that size. Here a queue's series are the atomics behind its handles and a
//! catalogue index each (about 2 KiB a queue), and a scrape walks them once, in catalogue
//! order, writing the text the exporter would.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use metrics::{Counter, Gauge, GaugeFn, Histogram, HistogramFn};
use metrics_exporter_prometheus::formatting::{sanitize_description, sanitize_label_value};

use super::catalogue::{Kind, METRICS};
use super::{PREFIX, is_defined};

/// Every exported queue's series, by queue name (so a scrape lists queues in name order).
#[derive(Default)]
pub(super) struct QueueSeries {
    queues: RwLock<BTreeMap<Arc<str>, Vec<Series>>>,
}

/// One series of a queue: which metric, its one extra label if any, and its value.
struct Series {
    /// Index of the metric in [`METRICS`].
    metric: u16,
    extra: Option<(&'static str, &'static str)>,
    value: Value,
}

enum Value {
    Counter(Arc<AtomicU64>),
    /// An `f64`'s bits, as `metrics` keeps a gauge in an `AtomicU64`.
    Gauge(Arc<AtomicU64>),
    Histogram(Arc<Buckets>),
}

impl QueueSeries {
    /// The queue's series, for making its handles: those it has, and any asked for the first
    /// time (a queue asked for again, say after a reload, keeps counting where it was).
    pub(super) fn of<T>(&self, queue: &str, make: impl FnOnce(&mut Cells<'_>) -> T) -> T {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        let series = match queues.get_mut(queue) {
            Some(series) => series,
            None => queues.entry(Arc::from(queue)).or_default(),
        };
        make(&mut Cells { series })
    }

    /// Appends every queue's series to `out` in the Prometheus text format, a metric's series
    /// together under its `# HELP` and `# TYPE` lines.
    pub(super) fn render(&self, out: &mut String) {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        let mut lines = vec![String::new(); METRICS.len()];
        for (queue, series) in queues.iter() {
            let queue = sanitize_label_value(queue);
            for s in series {
                s.write(&mut lines[usize::from(s.metric)], &queue);
            }
        }
        for (def, lines) in METRICS.iter().zip(lines).filter(|(_, l)| !l.is_empty()) {
            let kind = match def.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            let help = sanitize_description(def.help);
            let _ = writeln!(out, "# HELP {PREFIX}{} {help}", def.name);
            let _ = writeln!(out, "# TYPE {PREFIX}{} {kind}", def.name);
            out.push_str(&lines);
            out.push('\n');
        }
    }
}

/// A queue's series while its handles are made.
pub(super) struct Cells<'a> {
    series: &'a mut Vec<Series>,
}

impl Cells<'_> {
    /// The counter `name`, with its one extra label (`outcome`, `result`, `kind`) if it has one.
    pub(super) fn counter(
        &mut self,
        name: &'static str,
        extra: Option<(&'static str, &'static str)>,
    ) -> Counter {
        match self.cell(
            name,
            Kind::Counter,
            extra,
            || Value::Counter(Arc::default()),
        ) {
            Value::Counter(v) => Counter::from_arc(v.clone()),
            _ => unreachable!("a counter's cell holds a counter"),
        }
    }

    pub(super) fn gauge(&mut self, name: &'static str) -> Gauge {
        match self.cell(name, Kind::Gauge, None, || Value::Gauge(Arc::default())) {
            Value::Gauge(v) => Gauge::from_arc(v.clone()),
            _ => unreachable!("a gauge's cell holds a gauge"),
        }
    }

    pub(super) fn histogram(&mut self, name: &'static str, bounds: &'static [f64]) -> Histogram {
        let make = || Value::Histogram(Arc::new(Buckets::new(bounds)));
        match self.cell(name, Kind::Histogram, None, make) {
            Value::Histogram(v) => Histogram::from_arc(v.clone()),
            _ => unreachable!("a histogram's cell holds a histogram"),
        }
    }

    fn cell(
        &mut self,
        name: &'static str,
        kind: Kind,
        extra: Option<(&'static str, &'static str)>,
        make: impl FnOnce() -> Value,
    ) -> &Value {
        debug_assert!(
            is_defined(name, kind, &[&[("queue", "")], extra.as_slice()].concat()),
            "{name} is not in the catalogue with these labels"
        );
        let metric = METRICS
            .iter()
            .position(|m| m.name == name)
            .and_then(|i| u16::try_from(i).ok())
            .expect("every queue metric is in the catalogue");
        let at = match self
            .series
            .iter()
            .position(|s| s.metric == metric && s.extra == extra)
        {
            Some(at) => at,
            None => {
                self.series.push(Series {
                    metric,
                    extra,
                    value: make(),
                });
                self.series.len() - 1
            }
        };
        &self.series[at].value
    }
}

impl Series {
    /// Writes the series' line (a histogram's lines) for `queue`, an escaped label value.
    fn write(&self, out: &mut String, queue: &str) {
        let name = METRICS[usize::from(self.metric)].name;
        let start = |out: &mut String| {
            let _ = write!(out, "{PREFIX}{name}{{queue=\"{queue}\"");
            if let Some((key, value)) = self.extra {
                let _ = write!(out, ",{key}=\"{value}\"");
            }
            out.push_str("} ");
        };
        let _ = match &self.value {
            Value::Counter(v) => {
                start(out);
                writeln!(out, "{}", v.load(Ordering::Acquire))
            }
            Value::Gauge(v) => {
                start(out);
                writeln!(out, "{}", f64::from_bits(v.load(Ordering::Acquire)))
            }
            Value::Histogram(h) => h.write(out, name, queue),
        };
    }
}

/// A histogram's buckets, counted as samples come (the exporter's histograms buffer samples
/// until a scrape or the upkeep drains them).
struct Buckets {
    /// Upper bounds, ascending; `+Inf` is implied.
    bounds: &'static [f64],
    /// Samples per bucket, not cumulative: `counts[i]` holds those in `(bounds[i-1], bounds[i]]`.
    counts: Box<[AtomicU64]>,
    /// Every sample, `+Inf` included.
    count: AtomicU64,
    /// An `f64`'s bits.
    sum: AtomicU64,
}

impl Buckets {
    fn new(bounds: &'static [f64]) -> Self {
        Buckets {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    fn write(&self, out: &mut String, name: &str, queue: &str) -> std::fmt::Result {
        let mut below = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            below += n.load(Ordering::Acquire);
            writeln!(
                out,
                "{PREFIX}{name}_bucket{{queue=\"{queue}\",le=\"{bound}\"}} {below}"
            )?;
        }
        let count = self.count.load(Ordering::Acquire);
        let sum = f64::from_bits(self.sum.load(Ordering::Acquire));
        writeln!(
            out,
            "{PREFIX}{name}_bucket{{queue=\"{queue}\",le=\"+Inf\"}} {count}"
        )?;
        writeln!(out, "{PREFIX}{name}_sum{{queue=\"{queue}\"}} {sum}")?;
        writeln!(out, "{PREFIX}{name}_count{{queue=\"{queue}\"}} {count}")
    }
}

impl HistogramFn for Buckets {
    fn record(&self, value: f64) {
        // The count first: a scrape reads the buckets before the count, so every sample it
        // sees in a bucket is in the count too, and no bucket shows more than `+Inf`.
        self.count.fetch_add(1, Ordering::AcqRel);
        let at = self.bounds.partition_point(|bound| *bound < value);
        if let Some(n) = self.counts.get(at) {
            n.fetch_add(1, Ordering::AcqRel);
        }
        GaugeFn::increment(&self.sum, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.01, 0.1, 1.0];

    #[test]
    fn a_histogram_counts_each_sample_in_its_bucket_and_renders_them_cumulative() {
        let series = QueueSeries::default();
        let h = series.of("q", |c| c.histogram("handler_duration_seconds", BOUNDS));
        for sample in [0.005, 0.01, 0.5, 3.0] {
            h.record(sample);
        }
        let mut text = String::new();
        series.render(&mut text);
        let bucket = |le: &str, n: u64| {
            format!("{PREFIX}handler_duration_seconds_bucket{{queue=\"q\",le=\"{le}\"}} {n}\n")
        };
        for line in [
            bucket("0.01", 2),
            bucket("0.1", 2),
            bucket("1", 3),
            bucket("+Inf", 4),
        ] {
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(
            text.contains(&format!(
                "{PREFIX}handler_duration_seconds_sum{{queue=\"q\"}} 3.515\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "{PREFIX}handler_duration_seconds_count{{queue=\"q\"}} 4\n"
            )),
            "{text}"
        );
    }

    #[test]
    fn a_metric_is_listed_once_with_every_queues_series_under_it() {
        let series = QueueSeries::default();
        series.of("b", |c| c.gauge("queue_depth")).set(2.0);
        series.of("a", |c| c.gauge("queue_depth")).set(1.5);
        let mut text = String::new();
        series.render(&mut text);
        assert_eq!(
            text.matches("# TYPE throttlehost_queue_depth gauge")
                .count(),
            1,
            "{text}"
        );
        let a = text
            .find("queue_depth{queue=\"a\"} 1.5")
            .expect("a's depth");
        let b = text.find("queue_depth{queue=\"b\"} 2").expect("b's depth");
        assert!(a < b, "queues in name order: {text}");
    }

    #[test]
    fn a_queue_asked_for_again_keeps_its_values() {
        let series = QueueSeries::default();
        series
            .of("q", |c| {
                c.counter("lock_conflicts_total", Some(("kind", "deadlock")))
            })
            .increment(2);
        series
            .of("q", |c| {
                c.counter("lock_conflicts_total", Some(("kind", "deadlock")))
            })
            .increment(1);
        let _never_counted = series.of("q", |c| {
            c.counter("lock_conflicts_total", Some(("kind", "lock_timeout")))
        });
        let mut text = String::new();
        series.render(&mut text);
        assert!(
            text.contains("lock_conflicts_total{queue=\"q\",kind=\"deadlock\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("lock_conflicts_total{queue=\"q\",kind=\"lock_timeout\"} 0\n"),
            "{text}"
        );
    }

    #[test]
    fn a_queue_name_is_escaped_in_its_label() {
        let series = QueueSeries::default();
        series.of("say \"hi\"\\", |c| c.gauge("in_flight")).set(1.0);
        let mut text = String::new();
        series.render(&mut text);
        assert!(
            text.contains(r#"in_flight{queue="say \"hi\"\\"} 1"#),
            "{text}"
        );
    }
}
