//! The agent-server service: `agent.v1.AgentService` (validate configs, manage engines)
//! and `agent.v1.AgentEngine` (run user turns).
//!
//! [`serve`] is the whole server; `main.rs` only parses settings, starts logging, binds
//! and calls it, so tests and the local stack run exactly what production runs.

mod agent_engine;
mod agent_service;
mod convert;
mod error;
mod runs;
mod settings;
mod tenancy;
mod tool_client;
mod validate;

use std::{future::Future, sync::Arc};

use agentrt::{
    service_names,
    v1::{agent_engine_server::AgentEngineServer, agent_service_server::AgentServiceServer},
};
use agentrt_engine::StopReason;
use agentrt_grpc::{GrpcServer, ServerError};
use agentrt_models::{ChatModels, ProviderError, ProviderRegistry, RetryPolicy};
use agentrt_state::{
    BusLimits, EngineBudgets, EngineStore, EventBus, InMemoryBus, InMemorySessionStore,
    MemoryEngineStore, MemoryRunStore, RunRetention, RunStore, SessionLimits, SessionStore,
    StateError,
    redis::{Redis, RedisLimits},
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

pub use error::{Error, Result};
pub use settings::{Cli, EngineSettings, RunSettings, SessionSettings, Settings, StateSetting};

/// How much of the drain grace is kept, at most, for the streams of runs stopped at its
/// end to deliver their last event.
const RUN_STOP_MARGIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The provider settings are wrong.
    #[error(transparent)]
    Providers(#[from] ProviderError),
    /// A model client could not be built.
    #[error("cannot set up the model providers: {0}")]
    Models(String),
    /// The tool executor URL is wrong.
    #[error("{0}")]
    ToolExecutor(String),
    /// The gRPC server failed.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// The state setting is wrong, or the store refused to start.
    #[error("state: {0}")]
    State(String),
}

/// The stores of the server's state.
struct Stores {
    engines: Arc<dyn EngineStore>,
    sessions: Arc<dyn SessionStore>,
    runs: Arc<dyn RunStore>,
    bus: Arc<dyn EventBus>,
    /// The shared Redis, when the state is there.
    redis: Option<Redis>,
}

fn stores(settings: &Settings) -> std::result::Result<Stores, StartError> {
    let state = settings
        .state()
        .map_err(|e| StartError::State(e.to_string()))?;
    Ok(match state {
        StateSetting::Memory => {
            tracing::info!("state: in memory (this process only)");
            Stores {
                engines: Arc::new(
                    MemoryEngineStore::new(settings.engines.ttl, settings.engines.max_engines)
                        .with_budgets(EngineBudgets {
                            max_bytes: settings.engines.max_bytes,
                            max_per_principal: settings.engines.max_per_principal,
                        }),
                ),
                sessions: Arc::new(InMemorySessionStore::new(SessionLimits {
                    ttl: settings.sessions.ttl,
                    max_sessions: settings.sessions.max_sessions,
                    max_exchanges: settings.sessions.max_turns,
                    max_bytes: settings.sessions.max_bytes,
                    max_history_bytes: settings.sessions.max_history_bytes,
                })),
                runs: Arc::new(MemoryRunStore::new(RunRetention {
                    ended: settings.runs.retention,
                    lease: settings.runs.takeover_after,
                    max_bytes: settings.runs.retained_bytes,
                    max_waiting_bytes: settings.runs.max_waiting_bytes,
                    max_waiting_per_principal: settings.runs.max_waiting_per_principal,
                })),
                bus: Arc::new(InMemoryBus::new(BusLimits {
                    events_per_run: settings.runs.events_per_run,
                    retention: settings.runs.retention,
                    retained_events: settings.runs.retained_events,
                    // Ended runs' logs are part of what `runs.retained_bytes` bounds.
                    retained_bytes: settings.runs.retained_bytes,
                })),
                redis: None,
            }
        }
        StateSetting::Redis(url) => {
            let redis = Redis::connect(
                &url,
                &settings.state_key_prefix,
                RedisLimits {
                    engine_ttl: settings.engines.ttl,
                    session_ttl: settings.sessions.ttl,
                    max_exchanges: settings.sessions.max_turns,
                    max_history_bytes: settings.sessions.max_history_bytes,
                    run_retention: settings.runs.retention,
                    events_per_run: settings.runs.events_per_run,
                    retained_events: settings.runs.retained_events,
                    lease: settings.runs.takeover_after,
                    max_waiting_per_principal: settings.runs.max_waiting_per_principal,
                },
            )
            .map_err(|e| StartError::State(e.to_string()))?;
            tracing::info!(redis = %agentrt_core::mask_url_credentials(&url), prefix = %settings.state_key_prefix, "state: shared through Redis");
            Stores {
                engines: redis.engines_within(
                    settings.engines.max_engines,
                    settings.engines.max_per_principal,
                ),
                sessions: redis.sessions(),
                runs: redis.runs(),
                bus: redis.bus(),
                redis: Some(redis),
            }
        }
    })
}

/// How often readiness checks that Redis answers.
const STATE_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The providers the settings and the environment configure.
pub fn providers(settings: &Settings) -> std::result::Result<ProviderRegistry, ProviderError> {
    ProviderRegistry::new(
        settings.providers.clone(),
        settings.default_provider.clone(),
        |name| std::env::var(name).ok(),
    )
}

/// Serves `AgentService` and `AgentEngine` on `listener` until `shutdown` resolves, then
/// drains.
pub async fn serve(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::result::Result<(), StartError> {
    agentrt_metrics::Metrics::serve_as(agentrt_metrics::Role::AgentServer);
    // The tokenizer's tables are built before the first run needs them: built on first
    // use, they held that run's task (and its cancellation) for up to a second.
    let _ = tokio::task::spawn_blocking(agentrt_context::TokenCounter::shared).await;
    let providers = Arc::new(providers(&settings)?);
    match providers.names().collect::<Vec<_>>() {
        names if names.is_empty() => tracing::warn!(
            "no model provider is configured: every run will fail; set OPENAI_BASE_URL \
             and/or OPENAI_API_KEY, or declare [providers.NAME] in the config file"
        ),
        names => {
            tracing::info!(providers = %names.join(", "), default = providers.default_provider().unwrap_or("none"), "model providers")
        }
    }
    for (name, provider) in providers.settings() {
        if let Some(var) = provider
            .api_key_env
            .as_ref()
            .filter(|_| provider.api_key.is_empty())
        {
            // Its calls go without a key, and a provider that needs one refuses every
            // run: said at start, not first by a failing run.
            tracing::warn!(
                provider = %name,
                api_key_env = %var,
                "the provider's api_key_env names a variable that is not set (or is empty): its calls carry no key"
            );
        }
    }
    let models = ChatModels::from_providers(&providers, RetryPolicy::default())
        .map_err(|e| StartError::Models(e.to_string()))?;
    let tools = Arc::new(
        tool_client::GrpcToolClient::new(
            &settings.tool_executor,
            tool_client::ToolClientOptions {
                timeout: settings.tool_executor_timeout,
                connections: settings.tool_executor_connections,
                max_message_bytes: settings.server.max_message_bytes,
                tls: if settings.tool_executor.starts_with("https://") {
                    Some(
                        settings
                            .tool_executor_tls
                            .client_config("tool_executor_tls")
                            .map_err(|e| StartError::ToolExecutor(e.to_string()))?,
                    )
                } else {
                    None
                },
                token: settings
                    .tool_executor_token()
                    .map_err(|e| StartError::ToolExecutor(e.to_string()))?,
            },
        )
        .map_err(StartError::ToolExecutor)?,
    );
    let validator = validate::ConfigValidator::new(providers, tools.clone());
    let Stores {
        engines,
        sessions,
        runs: run_store,
        bus,
        redis,
    } = stores(&settings)?;
    // With shared state, runs outlive this replica: they are leased, taken over when
    // their replica dies, and handed over when it shuts down.
    let shared = redis.is_some();
    let runs = runs::RunManager::new(
        agentrt_engine::Engine::new(models, tools, sessions)
            .with_max_tool_output_bytes(settings.runs.max_tool_output_bytes),
        bus,
        run_store,
        runs::RunLimits {
            max_active: settings.runs.max_active,
            takeover_after: shared.then_some(settings.runs.takeover_after),
            lease: settings.runs.takeover_after,
            max_active_per_principal: settings.runs.max_active_per_principal,
            max_active_bytes: settings.runs.max_active_bytes,
        },
    )
    .await
    .map_err(|e: StateError| StartError::State(e.to_string()))?;
    let max = settings.server.max_message_bytes;
    let routes = Routes::new(
        AgentServiceServer::new(agent_service::AgentServiceImpl::new(
            validator,
            engines.clone(),
            max,
        ))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max),
    )
    .add_service(
        AgentEngineServer::new(agent_engine::AgentEngineImpl::new(
            engines,
            runs.clone(),
            agent_engine::RequestLimits::from(&settings),
        ))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max),
    );
    // On shutdown, runs in progress get most of the drain grace to finish; those still
    // running then end with an ERROR event (stop reason shutdown), leaving the rest of the
    // grace for their streams to deliver it.
    let drain = CancellationToken::new();
    let grace = settings.server.drain_grace;
    // With shared state the runs go on elsewhere: the replica hands them over at once
    // (the streams it serves end, and their clients resume on another replica), and
    // exits once they are handed over.
    let handover = shared.then(|| {
        let drain = drain.clone();
        let runs = runs.clone();
        tokio::spawn(async move {
            drain.cancelled().await;
            runs.hand_over_all().await;
        })
    });
    let stopper = {
        let drain = drain.clone();
        async move {
            drain.cancelled().await;
            if shared {
                std::future::pending::<()>().await;
            }
            // Runs that wait for a person or for the caller's tools cannot go on after the
            // process: they end at once, and their streams have the grace to say so. So
            // do those that begin to wait while the others finish.
            let finish_within = grace.saturating_sub((grace / 4).min(RUN_STOP_MARGIN));
            let deadline = tokio::time::Instant::now() + finish_within;
            loop {
                runs.end_waiting(StopReason::Shutdown).await;
                if tokio::time::timeout_at(deadline, runs.all_ended())
                    .await
                    .is_err()
                {
                    tracing::info!(?finish_within, "drain: stopping the runs still in progress");
                    runs.stop_all(StopReason::Shutdown);
                    // A run stopped as it began to wait waits still: it ends too.
                    let _ = tokio::time::timeout(RUN_STOP_MARGIN / 2, runs.all_ended()).await;
                    runs.end_waiting(StopReason::Shutdown).await;
                    break;
                }
                if !runs.any_waiting() {
                    break;
                }
            }
            std::future::pending::<()>().await;
        }
    };
    let mut server = GrpcServer::new("agent-server", settings.server)
        .reporting(service_names::AGENT_SERVICE)
        .reporting(service_names::AGENT_ENGINE);
    if let Some(redis) = redis {
        // Readiness follows Redis: the services are NOT_SERVING while it cannot be
        // reached, and SERVING again once it answers.
        server = server.ready_while(
            move || {
                let redis = redis.clone();
                async move {
                    match redis.ping().await {
                        Ok(()) => true,
                        Err(error) => {
                            tracing::warn!(%error, "readiness: the shared state is unreachable");
                            false
                        }
                    }
                }
            },
            STATE_CHECK_EVERY,
        );
    }
    let server = server.serve(routes, listener, shutdown, drain);
    tokio::select! {
        result = server => result?,
        () = stopper => {}
    }
    if let Some(handover) = handover
        && tokio::time::timeout(grace, handover).await.is_err()
    {
        tracing::warn!("drain: the runs were not all handed over within the grace period");
    }
    Ok(())
}
