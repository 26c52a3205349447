use std::{future::Future, time::Duration};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{service::Routes, transport::Server};
use tonic_health::ServingStatus;
use tracing::{info, warn};

use crate::{
    config::{ConfigError, ServerSettings},
    listener::{self, Limits},
    security::AuthLayer,
};

/// Why a server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listener failed.
    #[error("listener error: {0}")]
    Io(#[from] std::io::Error),
    /// A side port (health, metrics) could not be bound.
    #[error("cannot listen on {addr} (server.{setting}): {source}")]
    Listen {
        /// The setting that names the address.
        setting: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The gRPC transport failed.
    #[error("grpc transport error: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The reflection service could not be built from the descriptors.
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// A security setting is unusable (a file that cannot be read, a bad token entry).
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A gRPC server around a binary's own services, adding what every server here has:
/// `grpc.health.v1` for `""` and each service, reflection v1 and v1alpha, HTTP/2 limits,
/// and a drain with a grace period on shutdown.
pub struct GrpcServer {
    name: &'static str,
    settings: ServerSettings,
    services: Vec<&'static str>,
    readiness: Option<(ReadinessCheck, std::time::Duration)>,
}

/// A check of what the services need (a shared store): true when they can serve.
type ReadinessCheck =
    Box<dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync + 'static>;

impl GrpcServer {
    /// A server called `name` in logs, with the given settings.
    pub fn new(name: &'static str, settings: ServerSettings) -> Self {
        Self {
            name,
            settings,
            services: Vec::new(),
            readiness: None,
        }
    }

    /// Makes health follow `check`, run every `every`: the reported services are
    /// NOT_SERVING while it says false (`""` stays SERVING: the process is alive).
    pub fn ready_while<F, Fut>(mut self, check: F, every: std::time::Duration) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        self.readiness = Some((Box::new(move || Box::pin(check())), every));
        self
    }

    /// Names a service served by the routes, so that health reports it.
    pub fn reporting(mut self, service_name: &'static str) -> Self {
        self.services.push(service_name);
        self
    }

    /// Serves `routes` on `listener` until `shutdown` resolves, then drains:
    /// health turns NOT_SERVING, `drain` is cancelled (so that long-running streams can end
    /// themselves properly), new connections are refused, and running calls get
    /// `drain_grace` to finish before the remaining connections are closed.
    pub async fn serve(
        mut self,
        routes: Routes,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
        drain: CancellationToken,
    ) -> Result<(), ServerError> {
        let addr = listener.local_addr()?;
        // Metrics and the health listener outlive the drain, so that the last calls are
        // counted and scraped and probes see NOT_SERVING.
        let metrics_stop = CancellationToken::new();
        let _metrics_stop = metrics_stop.clone().drop_guard();
        let health = tonic_health::server::HealthReporter::new();
        let health_service = crate::health::service(health.clone(), drain.clone());
        // A server whose readiness follows a check (agent-server's Redis) is not ready
        // until the check has passed once: a new pod that cannot reach its state must not
        // count as available (and let a rollout stop an old one).
        let initially = if self.readiness.is_some() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        };
        for service in &self.services {
            health.set_service_status(*service, initially).await;
        }
        let readiness_stop = CancellationToken::new();
        let _readiness_stop = readiness_stop.clone().drop_guard();
        let mut readiness_task = None;
        if let Some((check, every)) = self.readiness.take() {
            let health = health.clone();
            let services = self.services.clone();
            let stop = readiness_stop.clone();
            // A check that does not answer in time (Redis hung, its connection open) is a
            // failed one: readiness follows within a period, not after the client's own
            // timeouts.
            let patience = every.max(Duration::from_secs(1));
            readiness_task = Some(tokio::spawn(async move {
                let mut ready = false;
                loop {
                    let now_ready = tokio::select! {
                        () = stop.cancelled() => return,
                        ready = tokio::time::timeout(patience, check()) => ready.unwrap_or(false),
                    };
                    if now_ready != ready {
                        ready = now_ready;
                        let status = if ready {
                            ServingStatus::Serving
                        } else {
                            ServingStatus::NotServing
                        };
                        info!(ready, "readiness changed");
                        for service in &services {
                            health.set_service_status(*service, status).await;
                        }
                    }
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(every) => {}
                    }
                }
            }));
        }

        // Advertise exactly what this server serves: the descriptors of the whole
        // `agent.v1` package would otherwise list services another binary serves.
        let advertised: Vec<&'static str> = self
            .services
            .iter()
            .copied()
            .chain([
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
            ])
            .collect();
        let tokens = self.settings.auth.load()?;
        if let Some(tokens) = &tokens {
            let unknown = tokens.unknown_services(&advertised);
            if !unknown.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "server.auth",
                    message: format!(
                        "tokens grant services this server does not serve: {}; it serves {}",
                        unknown.join(", "),
                        advertised.join(", ")
                    ),
                }
                .into());
            }
            info!(
                service = self.name,
                auth = "bearer tokens",
                tokens = tokens.len(),
                "authentication: every call but health needs a bearer token"
            );
        } else {
            warn!(
                service = self.name,
                auth = "none",
                "authentication: none; every call is let in (set server.auth to require tokens)"
            );
        }

        // The health and metrics ports take few connections each, counted in the
        // descriptors the gRPC port leaves free, so that they answer while it is full.
        let side_port = |max_connections| Limits {
            handshake_timeout: self.settings.handshake_timeout,
            max_connections,
            max_handshaking: max_connections / 4,
            max_per_ip: max_connections,
            preface: true,
        };
        if let Some(health_addr) = self.settings.health_listen {
            let listener =
                TcpListener::bind(health_addr)
                    .await
                    .map_err(|source| ServerError::Listen {
                        setting: "health_listen",
                        addr: health_addr,
                        source,
                    })?;
            info!(service = self.name, health_addr = %listener.local_addr()?, "health listener ready");
            serve_health_apart(
                listener.into_std()?,
                health_service.clone(),
                side_port(128),
                metrics_stop.clone(),
            )?;
        }

        let mut routes = routes.add_service(health_service);
        if self.settings.reflection {
            let descriptors = || {
                advertised.iter().fold(
                    tonic_reflection::server::Builder::configure()
                        .include_reflection_service(false)
                        .register_encoded_file_descriptor_set(agentrt::FILE_DESCRIPTOR_SET)
                        .register_encoded_file_descriptor_set(agentrt::ERROR_DETAILS_DESCRIPTOR_SET)
                        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                        .register_encoded_file_descriptor_set(
                            tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
                        )
                        .register_encoded_file_descriptor_set(
                            tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
                        ),
                    |builder, name| builder.with_service_name(*name),
                )
            };
            routes = routes
                .add_service(descriptors().build_v1()?)
                .add_service(descriptors().build_v1alpha()?);
        }

        let stop_accepting = CancellationToken::new();
        if let Some(metrics_addr) = self.settings.metrics_listen {
            let listener =
                TcpListener::bind(metrics_addr)
                    .await
                    .map_err(|source| ServerError::Listen {
                        setting: "metrics_listen",
                        addr: metrics_addr,
                        source,
                    })?;
            tokio::spawn(crate::metrics::serve_metrics(
                listener,
                Limits {
                    preface: false,
                    ..side_port(64)
                },
                metrics_stop,
            ));
        }
        let mut builder = Server::builder();
        if !self.settings.max_connection_age.is_zero() {
            // No grace: calls in flight on an old connection finish as they would have
            // (each has its own deadline); only new calls move.
            builder = builder.max_connection_age(self.settings.max_connection_age);
        }
        let mut client_names = None;
        let mut acceptor = None;
        if let Some(tls) = &self.settings.tls {
            acceptor = Some(tls.acceptor()?);
            client_names = tls.client_names()?;
            info!(
                service = self.name,
                mutual = tls.client_ca_file.is_some(),
                allowed_client_names = %client_names.as_ref().map_or_else(String::new, |n| n.describe()),
                "TLS on"
            );
            if tls.client_ca_file.is_some() && client_names.is_none() {
                warn!(
                    service = self.name,
                    "mutual TLS lets in every certificate the client CA issued; set \
                     server.tls.allowed_client_names to name the clients"
                );
            }
        }
        let server = builder
            .tcp_nodelay(true)
            .max_concurrent_streams(self.settings.max_concurrent_streams)
            .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
            // Thousands of streams opening at once on one connection exhaust h2's default
            // 1 MiB connection window and make it send GOAWAY; give it room.
            .initial_connection_window_size(16 * 1024 * 1024)
            .initial_stream_window_size(1024 * 1024)
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .layer(crate::metrics::RpcMetricsLayer::new(
                crate::metrics::registered_methods(
                    &[
                        agentrt::FILE_DESCRIPTOR_SET,
                        tonic_health::pb::FILE_DESCRIPTOR_SET,
                        tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
                        tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
                    ],
                    &advertised,
                ),
            ))
            .layer(crate::trace::RpcSpanLayer)
            .layer(AuthLayer::new(tokens).with_client_names(client_names))
            .add_routes(routes);
        let limits = Limits {
            handshake_timeout: self.settings.handshake_timeout,
            max_connections: self.settings.max_connections,
            max_handshaking: self.settings.max_handshaking_connections,
            max_per_ip: match self.settings.max_connections_per_ip {
                0 => usize::MAX,
                most => most,
            },
            preface: true,
        }
        .within_descriptor_limit("grpc", listener::RESERVED_DESCRIPTORS);
        info!(
            service = self.name,
            max_connections = limits.max_connections,
            max_handshaking = limits.max_handshaking,
            max_connections_per_ip = limits.max_per_ip.min(limits.max_connections),
            handshake_timeout = ?limits.handshake_timeout,
            "connection limits"
        );
        let stopped = stop_accepting.clone().cancelled_owned();
        let server: std::pin::Pin<
            Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
        > = match acceptor {
            Some(tls) => Box::pin(server.serve_with_incoming_shutdown(
                listener::admit(
                    "grpc",
                    listener,
                    limits,
                    move |tcp| tls.accept(agentrt_coalesce::Coalesced::new(tcp)),
                    stop_accepting.clone(),
                ),
                stopped,
            )),
            None => Box::pin(server.serve_with_incoming_shutdown(
                listener::admit(
                    "grpc",
                    listener,
                    limits,
                    |tcp| async move { Ok(agentrt_coalesce::Coalesced::new(tcp)) },
                    stop_accepting.clone(),
                ),
                stopped,
            )),
        };
        tokio::pin!(server);
        info!(service = self.name, %addr, "listening");

        tokio::select! {
            result = &mut server => return result.map_err(Into::into),
            () = shutdown => {}
        }

        let grace = self.settings.drain_grace;
        info!(service = self.name, grace = ?grace, "draining");
        readiness_stop.cancel();
        // Ended before the drain's NOT_SERVING: a check that was setting SERVING must not
        // set it after.
        if let Some(task) = readiness_task {
            task.abort();
            let _ = task.await;
        }
        health
            .set_service_status("", ServingStatus::NotServing)
            .await;
        for service in &self.services {
            health
                .set_service_status(*service, ServingStatus::NotServing)
                .await;
        }
        drain.cancel();
        stop_accepting.cancel();
        match tokio::time::timeout(grace, &mut server).await {
            Ok(result) => {
                info!(service = self.name, "drained");
                result.map_err(Into::into)
            }
            Err(_) => {
                warn!(
                    service = self.name,
                    "drain grace elapsed; closing the remaining calls"
                );
                Ok(())
            }
        }
    }
}

/// Serves `health` alone on `listener` from a thread and runtime of its own until `stop`,
/// so that probes are answered at once however busy the server's runtime is: under a load
/// that keeps every worker thread busy, a probe waiting its turn there took hundreds of
/// milliseconds, and a kubelet with a one-second timeout would restart a healthy pod.
/// How long a connection to the health-only port lasts, with [`HEALTH_CONNECTION_GRACE`]
/// after it: tonic, given both, drops the connection once both have passed (with any call
/// open on it: a `Watch` is made again by its client), sending no GOAWAY first.
const HEALTH_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// See [`HEALTH_CONNECTION_AGE`].
const HEALTH_CONNECTION_GRACE: Duration = Duration::from_secs(5);
/// Streams at once on one health connection (a probe makes one call).
const HEALTH_STREAMS: u32 = 16;
/// Streams the server may reset on one connection for errors of the client's (a frame a
/// stream may not carry, a window it overflows) before it closes the connection with
/// `ENHANCE_YOUR_CALM`: h2's guard against "MadeYouReset" (CVE-2025-8671). hyper keeps
/// 1024 by default, but tonic hands it "none", which turns the guard off.
const MAX_LOCAL_ERROR_RESETS: usize = 1024;

fn serve_health_apart<S>(
    listener: std::net::TcpListener,
    health: S,
    limits: Limits,
    stop: CancellationToken,
) -> std::io::Result<()>
where
    S: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("health".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(error) => return warn!(%error, "health listener failed"),
                };
                // Probes open a connection each: one that stays (silent, or answering
                // pings and calling nothing) is closed after a while, so that idle
                // connections cannot hold the port's slots for good.
                let served = Server::builder()
                    .tcp_nodelay(true)
                    .max_concurrent_streams(HEALTH_STREAMS)
                    .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
                    .http2_keepalive_interval(Some(Duration::from_secs(10)))
                    .http2_keepalive_timeout(Some(Duration::from_secs(5)))
                    .max_connection_age(HEALTH_CONNECTION_AGE)
                    .max_connection_age_grace(HEALTH_CONNECTION_GRACE)
                    .add_service(health)
                    .serve_with_incoming_shutdown(
                        listener::admit(
                            "health",
                            listener,
                            limits,
                            |tcp| async move { Ok(tcp) },
                            stop.clone(),
                        ),
                        stop.cancelled_owned(),
                    )
                    .await;
                if let Err(error) = served {
                    warn!(%error, "health listener failed");
                }
            });
        })?;
    Ok(())
}
