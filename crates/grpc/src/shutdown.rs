//! Turning process signals into a drain.

use std::future::Future;

use tracing::{info, warn};

/// Installs the SIGTERM and SIGINT handlers now, and returns a future that resolves on the
/// first of them. From then on a second signal ends the process at once with status 130,
/// for an operator who does not want to wait for the drain.
///
/// The handlers are installed when this is called, not when the future is first polled,
/// so that a signal arriving while the server starts is not lost (call it before binding).
pub fn signal() -> impl Future<Output = ()> {
    let mut signals = Signals::install();
    async move {
        signals.recv().await;
        info!("shutdown signal received, draining; send it again to exit at once");
        tokio::spawn(async move {
            signals.recv().await;
            warn!("second shutdown signal, exiting without waiting for the drain");
            // What it started (stdio MCP servers, in groups of their own) goes with it.
            for group in agentrt_core::children::take() {
                if let Some(group) = rustix::process::Pid::from_raw(group) {
                    let _ =
                        rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
                }
            }
            std::process::exit(130);
        });
    }
}

#[cfg(unix)]
struct Signals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

#[cfg(unix)]
impl Signals {
    fn install() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Self(Some((term, int))),
            (Err(e), _) | (_, Err(e)) => {
                warn!(error = %e, "cannot listen for SIGTERM/SIGINT; falling back to Ctrl-C");
                Self(None)
            }
        }
    }

    async fn recv(&mut self) {
        match &mut self.0 {
            Some((term, int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            None => {
                if tokio::signal::ctrl_c().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn install() -> Self {
        Self
    }

    async fn recv(&mut self) {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
