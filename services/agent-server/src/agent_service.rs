//! `agent.v1.AgentService`: config validation and the engine registry.

use std::{sync::Arc, time::SystemTime};

use agentrt::v1::{self, agent_service_server::AgentService};
use agentrt_core::Violation;
use agentrt_grpc::security::Principal;
use agentrt_state::{EngineStore, StoredEngine};
use prost::Message;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::{
    convert,
    error::{Error, Result},
    tenancy,
    validate::ConfigValidator,
};

/// Longest client-chosen session id.
const SESSION_ID_MAX_CHARS: usize = 128;

/// `agent.v1.AgentService` over a validator and an engine store.
pub struct AgentServiceImpl {
    validator: ConfigValidator,
    engines: Arc<dyn EngineStore>,
    /// `server.max_message_bytes`: the largest answer a client may be sent.
    max_message_bytes: usize,
}

/// Room left for what a stored engine's answer holds besides its config and ids: its
/// times as the store sets them may take a few bytes more than those measured.
const ANSWER_SLACK: usize = 16;

impl AgentServiceImpl {
    pub fn new(
        validator: ConfigValidator,
        engines: Arc<dyn EngineStore>,
        max_message_bytes: usize,
    ) -> Self {
        Self {
            validator,
            engines,
            max_message_bytes,
        }
    }

    /// Refuses an answer of `bytes` that could not be sent (`server.max_message_bytes`):
    /// said before anything is done, rather than after (an engine made whose id the
    /// client never gets).
    fn check_answer(&self, bytes: usize) -> Result<()> {
        if bytes > self.max_message_bytes {
            return Err(Error::AnswerTooLarge {
                bytes,
                max: self.max_message_bytes,
            });
        }
        Ok(())
    }

    async fn create(
        &self,
        caller: &Principal,
        request: v1::CreateAgentEngineRequest,
    ) -> Result<StoredEngine> {
        let checked = self.validator.check(request.config.as_ref()).await?;
        let mut violations = checked.violations;
        let config_violations = violations.len();
        let session_id = if request.session_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            if let Err(v) = check_session_id(&request.session_id) {
                violations.push(v);
            }
            request.session_id
        };
        if config_violations > 0 {
            return Err(Error::InvalidConfig(violations));
        }
        if !violations.is_empty() {
            // The session id is the request's, not the config's.
            return Err(Error::InvalidRequest(violations));
        }
        let config = convert::config_from_wire(&checked.effective);
        let now = SystemTime::now();
        let engine = StoredEngine {
            id: uuid::Uuid::new_v4().to_string(),
            session_id: tenancy::session_key(&caller.name, &session_id),
            config: Arc::new(config),
            tools: checked.tools.into(),
            create_time: now,
            expire_time: now,
        };
        self.check_answer(answer(&engine).encoded_len() + ANSWER_SLACK)?;
        let engine = self.engines.insert(engine).await?;
        info!(engine_id = %engine.id, session_id = %engine.session_id, agent = %engine.config.name, "engine created");
        Ok(engine)
    }

    /// Engine `engine_id`, when `caller` may see it.
    async fn engine(&self, caller: &Principal, engine_id: &str) -> Result<StoredEngine> {
        if engine_id.is_empty() {
            return Err(Error::InvalidRequest(vec![Violation::new(
                "engine_id",
                "required",
            )]));
        }
        // The store finds only an engine the caller may see.
        self.engines
            .get(engine_id, tenancy::owner_filter(caller))
            .await?
            .ok_or_else(|| Error::EngineNotFound(engine_id.to_owned()))
    }
}

/// What a client is told of `engine` when it is created.
fn answer(engine: &StoredEngine) -> v1::CreateAgentEngineResponse {
    v1::CreateAgentEngineResponse {
        session_id: tenancy::client_session(&engine.session_id).to_owned(),
        engine_id: engine.id.clone(),
        config: Some(convert::config_to_wire(&engine.config)),
        create_time: Some(convert::timestamp(engine.create_time)),
        expire_time: Some(convert::timestamp(engine.expire_time)),
    }
}

fn check_session_id(id: &str) -> std::result::Result<(), Violation> {
    if id.len() > SESSION_ID_MAX_CHARS {
        return Err(Violation::new(
            "session_id",
            format!(
                "must be at most {SESSION_ID_MAX_CHARS} characters (it has {})",
                id.len()
            ),
        ));
    }
    match id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
    {
        None => Ok(()),
        Some(bad) => Err(Violation::new(
            "session_id",
            format!("may hold only letters, digits, '_', '-', '.' or ':' (it holds {bad:?})"),
        )),
    }
}

#[tonic::async_trait]
impl AgentService for AgentServiceImpl {
    async fn validate_config(
        &self,
        request: Request<v1::ValidateConfigRequest>,
    ) -> std::result::Result<Response<v1::ValidateConfigResponse>, Status> {
        let request = request.into_inner();
        let checked = self
            .validator
            .check(request.config.as_ref())
            .await
            .map_err(Error::from)?;
        let response = v1::ValidateConfigResponse {
            valid: checked.violations.is_empty(),
            violations: checked
                .violations
                .into_iter()
                .map(|v| v1::ConfigViolation {
                    field: v.field,
                    description: v.description,
                })
                .collect(),
            effective_config: Some(checked.effective),
        };
        self.check_answer(response.encoded_len())?;
        Ok(Response::new(response))
    }

    async fn create_agent_engine(
        &self,
        request: Request<v1::CreateAgentEngineRequest>,
    ) -> std::result::Result<Response<v1::CreateAgentEngineResponse>, Status> {
        let caller = Principal::of(&request);
        let engine = self.create(&caller, request.into_inner()).await?;
        Ok(Response::new(answer(&engine)))
    }

    async fn get_agent_engine(
        &self,
        request: Request<v1::GetAgentEngineRequest>,
    ) -> std::result::Result<Response<v1::GetAgentEngineResponse>, Status> {
        let caller = Principal::of(&request);
        let engine = self
            .engine(&caller, &request.into_inner().engine_id)
            .await?;
        let created = answer(&engine);
        let response = v1::GetAgentEngineResponse {
            session_id: created.session_id,
            engine_id: created.engine_id,
            config: created.config,
            create_time: created.create_time,
            expire_time: created.expire_time,
        };
        self.check_answer(response.encoded_len())?;
        Ok(Response::new(response))
    }

    async fn delete_agent_engine(
        &self,
        request: Request<v1::DeleteAgentEngineRequest>,
    ) -> std::result::Result<Response<v1::DeleteAgentEngineResponse>, Status> {
        let caller = Principal::of(&request);
        let engine_id = request.into_inner().engine_id;
        // Another principal's engine is not there for this caller.
        self.engine(&caller, &engine_id).await?;
        if !self.engines.remove(&engine_id).await.map_err(Error::from)? {
            return Err(Error::EngineNotFound(engine_id).into());
        }
        info!(%engine_id, "engine deleted");
        Ok(Response::new(v1::DeleteAgentEngineResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_checked() {
        assert!(check_session_id("user-42:chat.7_a").is_ok());
        let spaced = check_session_id("a b/c").unwrap_err();
        assert!(spaced.description.contains("(it holds ' ')"), "{spaced:?}");
        let long = check_session_id(&"x".repeat(129)).unwrap_err();
        assert!(long.description.contains("at most 128"), "{long:?}");
    }
}
