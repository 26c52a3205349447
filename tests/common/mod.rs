//! Fixtures the end-to-end tests share.

// Each test binary compiles this module and uses a part of it.
#![allow(dead_code)]

use agentrt::v1::{self, agent_service_client::AgentServiceClient};
use tonic::transport::Channel;

/// An agent named `name` on the simulator's `model`, with the calculator tool.
pub fn calculator_agent(name: &str, model: &str) -> v1::AgentConfig {
    v1::AgentConfig {
        name: name.into(),
        model: Some(v1::ModelConfig {
            name: model.into(),
            ..Default::default()
        }),
        tools: vec![v1::ToolRef {
            name: "calculator".into(),
        }],
        ..Default::default()
    }
}

/// Creates an engine for `config`, in a new session, and returns its id.
pub async fn create_engine(
    service: &mut AgentServiceClient<Channel>,
    config: v1::AgentConfig,
) -> String {
    service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(config),
            session_id: String::new(),
        })
        .await
        .unwrap_or_else(|status| panic!("CreateAgentEngine failed: {status:?}"))
        .into_inner()
        .engine_id
}
