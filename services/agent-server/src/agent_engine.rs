//! `agent.v1.AgentEngine`: runs of user turns. The engine loop is not built yet; every
//! RPC says so precisely instead of pretending.

use std::pin::Pin;

use agentrt::v1::{self, agent_engine_server::AgentEngine};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// `agent.v1.AgentEngine`, answering UNIMPLEMENTED until the engine loop lands.
pub struct AgentEngineImpl;

type EventStream = Pin<Box<dyn Stream<Item = Result<v1::AgentStreamEvent, Status>> + Send>>;

fn not_yet(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "AgentEngine.{rpc} is not implemented by this server version yet"
    ))
}

#[tonic::async_trait]
impl AgentEngine for AgentEngineImpl {
    type ExecuteStream = EventStream;
    type SubscribeStream = EventStream;

    async fn execute(
        &self,
        _request: Request<v1::ExecuteRequest>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        Err(not_yet("Execute"))
    }

    async fn subscribe(
        &self,
        _request: Request<v1::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        Err(not_yet("Subscribe"))
    }

    async fn cancel(
        &self,
        _request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        Err(not_yet("Cancel"))
    }

    async fn get_run(
        &self,
        _request: Request<v1::GetRunRequest>,
    ) -> Result<Response<v1::AgentState>, Status> {
        Err(not_yet("GetRun"))
    }
}
