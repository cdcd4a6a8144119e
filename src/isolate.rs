//! Work that must keep its timing while handlers saturate the host's worker threads: the
//! throttling controller's ticks and the admin endpoint. Each runs on a thread of its own with
//! a single-threaded runtime; anything that touches the transport is sent back to the host's
//! runtime ([`on_host`]), so database connections and their driver tasks all live there.

use std::future::Future;

use tokio::runtime::Handle;

/// Runs `future` on a thread of its own with a single-threaded runtime, so it keeps its
/// timing while the host's worker threads are saturated. Inside a single-threaded runtime
/// (tests under paused time) it runs on the current runtime instead, so the test's clock
/// drives it. The returned task ends when the future does.
pub(crate) fn spawn_isolated<F>(name: &str, future: F) -> tokio::task::JoinHandle<()>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    use tokio::runtime::{Handle, RuntimeFlavor};
    if Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::CurrentThread) {
        return tokio::spawn(future);
    }
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(future),
                Err(e) => tracing::error!(error = %e, "cannot start an isolated runtime"),
            }
            let _ = done_tx.send(());
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a thread; running on the shared runtime");
    }
    tokio::spawn(async move {
        let _ = done_rx.await;
    })
}

/// Runs `future` on the host's runtime and waits for it from wherever the caller runs (the
/// admin thread). Transport calls go through here: a connection a pool opens is driven by the
/// runtime that opened it, and that must be the host's, which outlives the admin thread.
pub(crate) async fn on_host<T, F>(host: &Handle, future: F) -> Option<T>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    host.spawn(future).await.ok()
}
