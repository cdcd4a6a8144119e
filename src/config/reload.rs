//! Telling a running host to re-read its configuration: SIGHUP, or a change of the file.
//!
//! The file's directory is watched rather than the file, because editors and config managers
//! replace files by renaming a new one over them. Events are debounced: a burst of writes is
//! one reload.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// Quiet time after the last file event before a reload is signalled.
const DEBOUNCE: Duration = Duration::from_millis(250);

/// Why a reload was requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// SIGHUP.
    Signal,
    /// The file changed.
    FileChanged,
}

/// Starts watching `path` and SIGHUP (on Unix). The receiver yields one trigger per reload to
/// do; keep the returned guard alive as long as watching should go on.
///
/// Each source stands alone: when the file cannot be watched (no inotify watches left, a
/// directory that is not there yet), SIGHUP still reloads, and the reason is logged and kept
/// in [`WatchGuard::problems`].
pub fn watch(path: &Path) -> (mpsc::Receiver<Trigger>, WatchGuard) {
    let (tx, rx) = mpsc::channel(8);
    let mut guard = WatchGuard {
        watcher: None,
        tasks: Vec::new(),
        problems: Vec::new(),
    };
    match watch_file(path, tx.clone()) {
        Ok((watcher, debouncer)) => {
            guard.watcher = Some(watcher);
            guard.tasks.push(debouncer);
        }
        Err(e) => {
            let problem = format!(
                "cannot watch {} for changes ({e}); reload with SIGHUP",
                path.display()
            );
            tracing::warn!("{problem}");
            guard.problems.push(problem);
        }
    }
    match watch_hangup(tx) {
        Ok(Some(task)) => guard.tasks.push(task),
        Ok(None) => {}
        Err(e) => {
            let problem = format!("cannot listen for SIGHUP ({e}); reload by changing the file");
            tracing::warn!("{problem}");
            guard.problems.push(problem);
        }
    }
    (rx, guard)
}

type Task = tokio::task::JoinHandle<()>;

/// Watches the file's directory and sends one debounced trigger per burst of changes.
fn watch_file(
    path: &Path,
    tx: mpsc::Sender<Trigger>,
) -> Result<(Box<dyn Watcher + Send>, Task), notify::Error> {
    let file = path.to_path_buf();
    let name = file.file_name().map(|n| n.to_os_string());
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let relevant = matches!(event.kind, EventKind::Modify(_) | EventKind::Create(_))
            && event
                .paths
                .iter()
                .any(|p| p.file_name().map(|n| n.to_os_string()) == name);
        if relevant {
            let _ = raw_tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    let debouncer = tokio::spawn(async move {
        while raw_rx.recv().await.is_some() {
            loop {
                match tokio::time::timeout(DEBOUNCE, raw_rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            if tx.send(Trigger::FileChanged).await.is_err() {
                return;
            }
        }
    });
    Ok((Box::new(watcher), debouncer))
}

/// Sends a trigger per SIGHUP; `None` where there are no signals (not Unix).
#[cfg(unix)]
fn watch_hangup(tx: mpsc::Sender<Trigger>) -> std::io::Result<Option<Task>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = signal(SignalKind::hangup())?;
    Ok(Some(tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            if tx.send(Trigger::Signal).await.is_err() {
                return;
            }
        }
    })))
}

#[cfg(not(unix))]
fn watch_hangup(_tx: mpsc::Sender<Trigger>) -> std::io::Result<Option<Task>> {
    Ok(None)
}

/// Keeps the watcher alive; dropping it stops watching.
pub struct WatchGuard {
    watcher: Option<Box<dyn Watcher + Send>>,
    tasks: Vec<Task>,
    problems: Vec<String>,
}

impl WatchGuard {
    /// Whether the file itself is watched (SIGHUP may still be the only trigger).
    pub fn watches_file(&self) -> bool {
        self.watcher.is_some()
    }

    /// Why a trigger source is missing, one line each (empty when both work).
    pub fn problems(&self) -> &[String] {
        &self.problems
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_rewrite_of_the_file_is_one_trigger() {
        let dir = std::env::temp_dir().join(format!("th-reload-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("host.toml");
        std::fs::write(&file, "a").unwrap();
        let (mut rx, guard) = watch(&file);
        assert!(guard.watches_file(), "{:?}", guard.problems());
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::write(&file, "b").unwrap();
        std::fs::write(&file, "c").unwrap();
        std::fs::write(dir.join("other.toml"), "x").unwrap();
        let first = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap();
        assert_eq!(first, Some(Trigger::FileChanged));
        assert!(
            tokio::time::timeout(Duration::from_millis(600), rx.recv())
                .await
                .is_err(),
            "debounced into one"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
