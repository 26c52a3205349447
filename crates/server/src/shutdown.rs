//! Turning process signals into a drain.

use tracing::{info, warn};

/// Resolves on the first SIGTERM or SIGINT. From then on a second signal ends the process
/// at once with status 130, for an operator who does not want to wait for the drain.
pub async fn signal() {
    first_signal().await;
    info!("shutdown signal received, draining; send it again to exit at once");
    tokio::spawn(async {
        first_signal().await;
        warn!("second shutdown signal, exiting without waiting for the drain");
        std::process::exit(130);
    });
}

#[cfg(unix)]
async fn first_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            warn!(error = %e, "cannot listen for SIGTERM/SIGINT; falling back to Ctrl-C");
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

#[cfg(not(unix))]
async fn first_signal() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}
