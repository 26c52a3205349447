//! `agent.v1.AgentEngine`: runs of user turns, streamed from the event bus.

use std::{pin::Pin, sync::Arc, time::Duration};

use agentrt::v1::{self, agent_engine_server::AgentEngine};
use agentrt_core::Violation;
use agentrt_engine::{RunSpec, ToolAnswer};
use agentrt_events::{BusError, EventStream};
use agentrt_grpc::security::Principal;
use agentrt_models::ChatMessage;
use agentrt_state::{EngineStore, RunRecord};
use futures_util::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::{
    convert,
    error::Error,
    runs::{RunManager, Started},
    tenancy,
};

/// Longest client-chosen message id.
const MESSAGE_ID_MAX_CHARS: usize = 128;
/// How long `Cancel` waits for the run to end before answering.
const CANCEL_WAIT: Duration = Duration::from_secs(2);

type EventResponseStream = Pin<Box<dyn Stream<Item = Result<v1::AgentStreamEvent, Status>> + Send>>;

/// `agent.v1.AgentEngine` over the engine store and the run manager.
pub struct AgentEngineImpl {
    engines: Arc<dyn EngineStore>,
    runs: Arc<RunManager>,
    limits: RequestLimits,
    streams: Arc<Streams>,
}

/// The open `Execute` and `Subscribe` streams of each named principal on this replica.
#[derive(Debug, Default)]
struct Streams {
    open: std::sync::Mutex<std::collections::HashMap<Arc<str>, usize>>,
    max_per_principal: usize,
}

/// One open stream of a principal, counted until it is dropped (with its stream).
struct StreamTicket {
    streams: Arc<Streams>,
    principal: Arc<str>,
}

impl Streams {
    /// A ticket for one more stream of `caller`: `None` for the anonymous principal, which
    /// only the server's own bounds limit.
    fn open(self: &Arc<Self>, caller: &Principal) -> Result<Option<StreamTicket>, Status> {
        if caller.name.is_empty() {
            return Ok(None);
        }
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = open.entry(caller.name.clone()).or_default();
        if *count >= self.max_per_principal {
            return Err(Error::State(agentrt_core::StateError::OverBudget {
                budget: "runs.max_streams_per_principal",
                message: format!(
                    "this principal has {count} Execute and Subscribe streams open here, its \
                     most; close one, or retry later"
                ),
            })
            .into());
        }
        *count += 1;
        Ok(Some(StreamTicket {
            streams: self.clone(),
            principal: caller.name.clone(),
        }))
    }
}

impl Drop for StreamTicket {
    fn drop(&mut self) {
        let mut open = self
            .streams
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.principal) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.principal);
            }
        }
    }
}

/// The size limits of an `Execute` request.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// Longest query, in characters.
    pub query_chars: usize,
    /// Most `llm_context` messages.
    pub context_messages: usize,
    /// Most `llm_context` characters, all messages together.
    pub context_chars: usize,
    /// Largest response message, in bytes (`GetRun` answers stay within it).
    pub max_message_bytes: usize,
    /// Most open `Execute` and `Subscribe` streams of one principal.
    pub max_streams_per_principal: usize,
}

impl From<&crate::settings::Settings> for RequestLimits {
    fn from(settings: &crate::settings::Settings) -> Self {
        Self {
            query_chars: settings.runs.max_query_chars,
            context_messages: settings.runs.max_context_messages,
            context_chars: settings.runs.max_context_chars,
            max_message_bytes: settings.server.max_message_bytes,
            max_streams_per_principal: settings.runs.max_streams_per_principal,
        }
    }
}

impl AgentEngineImpl {
    pub fn new(
        engines: Arc<dyn EngineStore>,
        runs: Arc<RunManager>,
        limits: RequestLimits,
    ) -> Self {
        Self {
            engines,
            runs,
            limits,
            streams: Arc::new(Streams {
                open: std::sync::Mutex::default(),
                max_per_principal: limits.max_streams_per_principal,
            }),
        }
    }

    /// The events of a run the server knows, after `after_sequence`.
    async fn events(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, Status> {
        self.runs
            .events(run_id, after_sequence)
            .await
            .map_err(|error| match error {
                // The run is known, so it ended and its log was dropped early to keep the
                // ended runs' events within `runs.retained_events`.
                BusError::UnknownRun(_) => Error::EventsExpired(run_id.to_owned()).into(),
                error => stream_error(run_id, error, after_sequence).into(),
            })
    }

    /// Run `run_id`'s record, when `caller` may see it.
    async fn run(&self, caller: &Principal, run_id: &str) -> Result<RunRecord, Status> {
        if run_id.is_empty() {
            return Err(Error::InvalidRequest(vec![Violation::new("run_id", "required")]).into());
        }
        let unknown = || Error::RunNotFound(run_id.to_owned());
        let record = self
            .runs
            .record(run_id)
            .await
            .map_err(Error::from)?
            .ok_or_else(unknown)?;
        let key = record.session_id.clone();
        Ok(tenancy::visible(caller, &key, record, unknown)?)
    }
}

impl AgentEngineImpl {
    async fn answer(
        &self,
        caller: &Principal,
        run_id: &str,
        answers: Vec<(String, ToolAnswer)>,
    ) -> Result<Response<v1::ToolAnswersResponse>, Status> {
        let record = self.run(caller, run_id).await?;
        let outcome = self.runs.answer(record, answers).await?;
        Ok(Response::new(v1::ToolAnswersResponse {
            status: convert::run_status_to_wire(outcome.status) as i32,
            pending_tool_call_ids: outcome.left,
        }))
    }
}

/// Most answers in one request (a round has at most this many calls that wait).
const MAX_ANSWERS: usize = 128;
/// Longest output of a client tool accepted, in bytes (the model is given at most the
/// server's tool output limit of it).
const MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// Longest call id accepted in an answer, in bytes (the ids of a run's calls are shorter).
const MAX_CALL_ID_BYTES: usize = 256;

/// Checks the form of an answer request: a run id, one to [`MAX_ANSWERS`] answers, each
/// with a call id, each call once. Too many answers are refused before any is read.
fn check_answers<'a>(
    run_id: &str,
    field: &str,
    answers: impl ExactSizeIterator<Item = (&'a str, ToolAnswer)>,
) -> Result<Vec<(String, ToolAnswer)>, Status> {
    let mut violations = Vec::new();
    if run_id.is_empty() {
        violations.push(Violation::new("run_id", "required"));
    }
    if answers.len() == 0 {
        violations.push(Violation::new(field, "at least one is required"));
    } else if answers.len() > MAX_ANSWERS {
        violations.push(Violation::new(
            field,
            format!("at most {MAX_ANSWERS}, got {}", answers.len()),
        ));
        return Err(Error::InvalidRequest(violations).into());
    }
    let mut checked: Vec<(String, ToolAnswer)> = Vec::with_capacity(answers.len());
    for (index, (call_id, answer)) in answers.enumerate() {
        if call_id.is_empty() {
            violations.push(Violation::new(
                format!("{field}[{index}].tool_call_id"),
                "required",
            ));
        } else if call_id.len() > MAX_CALL_ID_BYTES {
            violations.push(Violation::new(
                format!("{field}[{index}].tool_call_id"),
                format!(
                    "at most {MAX_CALL_ID_BYTES} bytes, got {}: no call of a run has such an id",
                    call_id.len()
                ),
            ));
        } else if let Some(first) = checked.iter().position(|(id, _)| id == call_id) {
            violations.push(Violation::new(
                format!("{field}[{index}].tool_call_id"),
                format!("duplicate of {field}[{first}] ({call_id:?}): answer each call once"),
            ));
        }
        let size = match &answer {
            ToolAnswer::Output { output, .. } => output.len(),
            ToolAnswer::Decision { reason, .. } => reason.len(),
        };
        if size > MAX_OUTPUT_BYTES {
            let what = match &answer {
                ToolAnswer::Output { .. } => "output",
                ToolAnswer::Decision { .. } => "reason",
            };
            violations.push(Violation::new(
                format!("{field}[{index}].{what}"),
                format!("at most {MAX_OUTPUT_BYTES} bytes, got {size}"),
            ));
        }
        checked.push((call_id.to_owned(), answer));
    }
    if violations.is_empty() {
        Ok(checked)
    } else {
        Err(Error::InvalidRequest(violations).into())
    }
}

/// Cancels the run when the `Execute` stream that started it, and every retry of it
/// attached meanwhile, is dropped before the run ended: the client went away. Disarmed
/// when the stream ends for another reason (the client fell behind the replay log: it is
/// told so, and resumes with `Subscribe`).
struct CancelOnDisconnect {
    runs: Arc<RunManager>,
    run_id: String,
    armed: bool,
}

impl CancelOnDisconnect {
    /// The guard of an `Execute` stream of `run_id`, when the run executes here and its
    /// client going away is to cancel it (see [`RunManager::attach`]).
    fn attach(runs: &Arc<RunManager>, run_id: &str, first: bool) -> Option<Self> {
        runs.attach(run_id, first).then(|| Self {
            runs: runs.clone(),
            run_id: run_id.to_owned(),
            armed: true,
        })
    }
}

impl Drop for CancelOnDisconnect {
    fn drop(&mut self) {
        self.runs.detach(&self.run_id, self.armed);
    }
}

/// What names a run in each event of its stream.
struct RunIds {
    run_id: String,
    /// The session as stored (see `tenancy::client_session`).
    session_id: String,
    message_id: String,
}

impl RunIds {
    fn of(record: &RunRecord) -> Self {
        Self {
            run_id: record.run_id.clone(),
            session_id: record.session_id.clone(),
            message_id: record.message_id.clone(),
        }
    }
}

/// `after`: the sequence the stream starts after (a `Subscribe`'s `after_sequence`).
fn stream_events(
    events: EventStream,
    run: RunIds,
    mut guard: Option<CancelOnDisconnect>,
    draining: Option<tokio_util::sync::CancellationToken>,
    ticket: Option<StreamTicket>,
    after: u64,
) -> EventResponseStream {
    let run_id = run.run_id.clone();
    let ids = Arc::new((
        run.run_id,
        tenancy::client_session(&run.session_id).to_owned(),
        run.message_id,
    ));
    // The last event sent: where a client resumes from.
    let mut sent = after;
    let events = events.map(move |event| {
        // The stream counts as its principal's while it is open.
        let _open = &ticket;
        stream_event(event, &mut guard, &ids, &mut sent)
    });
    let Some(draining) = draining else {
        return Box::pin(events);
    };
    // With shared state, a replica that shuts down ends its streams (its runs go on
    // elsewhere): the client resumes with `Subscribe` on another replica.
    Box::pin(futures_util::stream::unfold(
        (Box::pin(events), Some(draining), after, run_id),
        |(mut events, draining, mut last, run_id)| async move {
            let draining = draining?;
            tokio::select! {
                biased;
                next = events.next() => {
                    let next = next?;
                    if let Ok(event) = &next {
                        last = event.sequence;
                    }
                    Some((next, (events, Some(draining), last, run_id)))
                }
                () = draining.cancelled() => {
                    let status = Error::ShuttingDown { run_id: run_id.clone(), after: last }.into();
                    Some((Err(status), (events, None, last, run_id)))
                }
            }
        },
    ))
}

/// One event of a run's stream, as the client gets it; the end of the stream disarms the
/// guard that cancels an abandoned run.
fn stream_event(
    event: Result<Arc<agentrt_events::RunEvent>, BusError>,
    guard: &mut Option<CancelOnDisconnect>,
    ids: &(String, String, String),
    sent: &mut u64,
) -> Result<v1::AgentStreamEvent, Status> {
    match event {
        Ok(event) => {
            if event.done
                && let Some(guard) = guard.as_mut()
            {
                guard.armed = false;
            }
            *sent = event.sequence;
            Ok(convert::event_to_wire(&event, &ids.0, &ids.1, &ids.2))
        }
        Err(error) => {
            if let Some(guard) = guard.as_mut() {
                guard.armed = false;
            }
            Err(stream_error(&ids.0, error, *sent).into())
        }
    }
}

/// `error` of a stream of run `run_id` that sent events up to `sent`, naming where the
/// client resumes when it can.
fn stream_error(run_id: &str, error: BusError, sent: u64) -> Error {
    match error {
        BusError::Lagged { from, to } => Error::EventsLagged {
            run_id: run_id.to_owned(),
            from,
            to,
        },
        BusError::Moved { after } => Error::RunMoved {
            run_id: run_id.to_owned(),
            after,
        },
        BusError::Fenced(_) => Error::RunMoved {
            run_id: run_id.to_owned(),
            after: sent,
        },
        error => Error::Bus(error),
    }
}

fn check_execute(
    request: &v1::ExecuteRequest,
    limits: RequestLimits,
) -> Result<Option<Vec<ChatMessage>>, Vec<Violation>> {
    let mut violations = Vec::new();
    if request.engine_id.is_empty() {
        violations.push(Violation::new("engine_id", "required"));
    }
    if request.query.trim().is_empty() {
        violations.push(Violation::new("query", "required"));
    } else if request.query.chars().count() > limits.query_chars {
        violations.push(Violation::new(
            "query",
            format!(
                "must be at most {} characters (runs.max_query_chars)",
                limits.query_chars
            ),
        ));
    }
    if request.llm_context.len() > limits.context_messages {
        violations.push(Violation::new(
            "llm_context",
            format!(
                "has {} messages; at most {} are accepted (runs.max_context_messages)",
                request.llm_context.len(),
                limits.context_messages
            ),
        ));
        return Err(violations);
    }
    // Their text, and their tool calls' (ids, names and arguments): all of it goes to the
    // model. Arguments count by their encoded size (each is at least a character).
    let context_chars: usize = request
        .llm_context
        .iter()
        .map(|m| {
            let calls: usize = m
                .tool_calls
                .iter()
                .map(|c| {
                    c.id.chars().count()
                        + c.name.chars().count()
                        + c.arguments.as_ref().map_or(0, prost::Message::encoded_len)
                })
                .sum();
            m.content.chars().count() + m.tool_call_id.chars().count() + calls
        })
        .sum();
    if context_chars > limits.context_chars {
        violations.push(Violation::new(
            "llm_context",
            format!(
                "has {context_chars} characters of content and tool calls; at most {} are \
                 accepted (runs.max_context_chars)",
                limits.context_chars
            ),
        ));
        return Err(violations);
    }
    if request.message_id.chars().count() > MESSAGE_ID_MAX_CHARS {
        violations.push(Violation::new(
            "message_id",
            format!("must be at most {MESSAGE_ID_MAX_CHARS} characters"),
        ));
    } else if let Some(control) = request.message_id.chars().find(|c| c.is_control()) {
        // A key that logs, Redis keys and clients print: no line ends or other controls.
        violations.push(Violation::new(
            "message_id",
            format!("may not hold control characters (it holds {control:?})"),
        ));
    }
    let mut context = Vec::with_capacity(request.llm_context.len());
    // A tool message answers a call of the assistant message before it (with only tool
    // messages between), and each call is answered once before the next other message,
    // as providers require: they refuse the whole request otherwise, which failed the run
    // at its first model call instead of refusing the input.
    let mut open_calls: Vec<(usize, usize, &str)> = Vec::new();
    let unanswered = |open_calls: &mut Vec<(usize, usize, &str)>,
                      violations: &mut Vec<Violation>| {
        for (index, call, id) in open_calls.drain(..) {
            violations.push(Violation::new(
                format!("llm_context[{index}].tool_calls[{call}].id"),
                format!(
                    "has no ROLE_TOOL answer before the next message: {:?}",
                    agentrt_grpc::status::bounded(id, 128)
                ),
            ));
        }
    };
    for (index, message) in request.llm_context.iter().enumerate() {
        match convert::message_from_wire(index, message) {
            Ok(ChatMessage::Tool { call_id, content }) => {
                if let Some(at) = open_calls.iter().position(|(_, _, id)| *id == call_id) {
                    open_calls.remove(at);
                } else {
                    violations.push(Violation::new(
                        format!("llm_context[{index}].tool_call_id"),
                        format!(
                            "answers no tool call of the ROLE_ASSISTANT message before it \
                             (or answers one twice): {:?}",
                            agentrt_grpc::status::bounded(&call_id, 128)
                        ),
                    ));
                }
                context.push(ChatMessage::Tool { call_id, content });
            }
            Ok(message) => {
                unanswered(&mut open_calls, &mut violations);
                open_calls.extend(
                    request.llm_context[index]
                        .tool_calls
                        .iter()
                        .enumerate()
                        .map(|(call, c)| (index, call, c.id.as_str())),
                );
                context.push(message);
            }
            Err(violation) => violations.push(violation),
        }
    }
    // The query follows the context: calls still open have no answer.
    unanswered(&mut open_calls, &mut violations);
    if !violations.is_empty() {
        return Err(violations);
    }
    Ok((!context.is_empty()).then_some(context))
}

#[tonic::async_trait]
impl AgentEngine for AgentEngineImpl {
    type ExecuteStream = EventResponseStream;
    type SubscribeStream = EventResponseStream;

    async fn execute(
        &self,
        request: Request<v1::ExecuteRequest>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        let caller = Principal::of(&request);
        let request = request.into_inner();
        let llm_context = check_execute(&request, self.limits).map_err(Error::InvalidRequest)?;
        let unknown = || Error::EngineNotFound(request.engine_id.clone());
        let engine = self
            .engines
            .get(&request.engine_id, tenancy::owner_filter(&caller))
            .await
            .map_err(Error::from)?
            .ok_or_else(unknown)?;
        let session = tenancy::client_session(&engine.session_id);
        if !request.session_id.is_empty() && request.session_id != session {
            return Err(Error::InvalidRequest(vec![Violation::new(
                "session_id",
                format!(
                    "engine {:?} belongs to session {session:?}; leave it empty or send that one",
                    engine.id
                ),
            )])
            .into());
        }
        let ticket = self.streams.open(&caller)?;
        let message_id = if request.message_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            request.message_id
        };
        let new = RunIds {
            run_id: uuid::Uuid::new_v4().to_string(),
            session_id: engine.session_id.clone(),
            message_id,
        };
        let spec = RunSpec {
            run_id: new.run_id.clone(),
            engine_id: engine.id.clone(),
            session_id: new.session_id.clone(),
            message_id: new.message_id.clone(),
            query: request.query,
            llm_context,
            config: engine.config.clone(),
            tools: engine.tools.clone(),
        };
        let (run, events, first) = match self.runs.start(spec).await.map_err(Error::from)? {
            // A run started here exists already, and the caller may see it (it may act
            // on its engine): no need to read its record back.
            Started::New(run_id) => {
                let events = self.events(&run_id, 0).await?;
                (new, events, true)
            }
            Started::Existing(run_id) => {
                let record = self.run(&caller, &run_id).await?;
                let events = self.events(&record.run_id, 0).await?;
                (RunIds::of(&record), events, false)
            }
        };
        let guard = if request.detach {
            // A retry with `detach` of a run started without: it now outlives its clients.
            if !first {
                self.runs.keep(&run.run_id);
            }
            None
        } else {
            CancelOnDisconnect::attach(&self.runs, &run.run_id, first)
        };
        Ok(Response::new(stream_events(
            events,
            run,
            guard,
            self.runs.draining(),
            ticket,
            0,
        )))
    }

    async fn subscribe(
        &self,
        request: Request<v1::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let caller = Principal::of(&request);
        let request = request.into_inner();
        let record = self.run(&caller, &request.run_id).await?;
        let ticket = self.streams.open(&caller)?;
        let events = self.events(&record.run_id, request.after_sequence).await?;
        Ok(Response::new(stream_events(
            events,
            RunIds::of(&record),
            None,
            self.runs.draining(),
            ticket,
            request.after_sequence,
        )))
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let caller = Principal::of(&request);
        let run_id = request.into_inner().run_id;
        self.run(&caller, &run_id).await?;
        let record = self
            .runs
            .cancel(&run_id, CANCEL_WAIT)
            .await
            .map_err(Error::from)?
            .ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
        let status = convert::run_status_to_wire(record.status);
        Ok(Response::new(v1::CancelResponse {
            status: status as i32,
        }))
    }

    async fn submit_tool_outputs(
        &self,
        request: Request<v1::SubmitToolOutputsRequest>,
    ) -> Result<Response<v1::ToolAnswersResponse>, Status> {
        let caller = Principal::of(&request);
        let request = request.into_inner();
        let answers = check_answers(
            &request.run_id,
            "outputs",
            request.outputs.iter().map(|o| {
                (
                    o.tool_call_id.as_str(),
                    ToolAnswer::Output {
                        output: o.output.clone(),
                        is_error: o.is_error,
                    },
                )
            }),
        )?;
        self.answer(&caller, &request.run_id, answers).await
    }

    async fn approve_tool_calls(
        &self,
        request: Request<v1::ApproveToolCallsRequest>,
    ) -> Result<Response<v1::ToolAnswersResponse>, Status> {
        let caller = Principal::of(&request);
        let request = request.into_inner();
        let answers = check_answers(
            &request.run_id,
            "decisions",
            request.decisions.iter().map(|d| {
                (
                    d.tool_call_id.as_str(),
                    ToolAnswer::Decision {
                        approved: d.approved,
                        // Only a denial's reason is read (by the model): an approval
                        // repeated with another reason is the same answer.
                        reason: if d.approved {
                            String::new()
                        } else {
                            d.reason.clone()
                        },
                    },
                )
            }),
        )?;
        self.answer(&caller, &request.run_id, answers).await
    }

    async fn get_run(
        &self,
        request: Request<v1::GetRunRequest>,
    ) -> Result<Response<v1::AgentState>, Status> {
        let caller = Principal::of(&request);
        let record = self.run(&caller, &request.into_inner().run_id).await?;
        let state = convert::record_to_wire(&record, self.limits.max_message_bytes)?;
        Ok(Response::new(state))
    }
}

#[cfg(test)]
mod tests {
    /// Every status a stream ends with that a client resumes from names the run and
    /// the sequence to resume after.
    #[test]
    fn a_stream_that_ends_to_resume_says_where() {
        for (error, reason, after) in [
            (BusError::Moved { after: 7 }, "RUN_MOVED", "7"),
            (BusError::Fenced("r".into()), "RUN_MOVED", "5"),
            (BusError::Lagged { from: 3, to: 9 }, "EVENTS_LAGGED", "9"),
        ] {
            let status: Status = stream_error("r", error, 5).into();
            let info = tonic_types::StatusExt::get_details_error_info(&status).unwrap();
            assert_eq!(info.reason, reason);
            assert_eq!(info.metadata["run"], "r");
            assert_eq!(info.metadata["after_sequence"], after, "{reason}");
        }
    }

    use super::*;

    /// Small limits for the requests the tests check.
    const LIMITS: RequestLimits = RequestLimits {
        query_chars: 100,
        context_messages: 10,
        context_chars: 1000,
        max_message_bytes: 1 << 20,
        max_streams_per_principal: 10,
    };

    #[test]
    fn message_ids_are_bounded_and_printable() {
        let request = |message_id: &str| v1::ExecuteRequest {
            engine_id: "e".into(),
            query: "q".into(),
            message_id: message_id.into(),
            ..Default::default()
        };
        assert!(check_execute(&request("msg-1 (retry)"), LIMITS).is_ok());
        for (id, says) in [
            ("a\nb", "control characters (it holds '\\n')"),
            (&"m".repeat(129), "at most 128"),
        ] {
            let violations = check_execute(&request(id), LIMITS).unwrap_err();
            assert_eq!(violations[0].field, "message_id");
            assert!(violations[0].description.contains(says), "{violations:?}");
        }
    }

    #[test]
    fn a_tool_message_in_the_context_answers_a_call_before_it() {
        let message = |role: v1::Role, calls: &[&str], answers: &str| v1::ChatMessage {
            role: role as i32,
            content: "x".into(),
            tool_calls: calls
                .iter()
                .map(|id| v1::ToolCall {
                    id: (*id).into(),
                    name: "calculator".into(),
                    arguments: None,
                })
                .collect(),
            tool_call_id: answers.into(),
        };
        let request = |llm_context| v1::ExecuteRequest {
            engine_id: "e".into(),
            query: "q".into(),
            llm_context,
            ..Default::default()
        };
        let answered = vec![
            message(v1::Role::User, &[], ""),
            message(v1::Role::Assistant, &["c1", "c2"], ""),
            message(v1::Role::Tool, &[], "c2"),
            message(v1::Role::Tool, &[], "c1"),
            message(v1::Role::Assistant, &[], ""),
        ];
        assert_eq!(
            check_execute(&request(answered), LIMITS)
                .unwrap()
                .unwrap()
                .len(),
            5
        );
        // Rounds one after another, calls answered in any order.
        let rounds = vec![
            message(v1::Role::User, &[], ""),
            message(v1::Role::Assistant, &["c1", "c2"], ""),
            message(v1::Role::Tool, &[], "c2"),
            message(v1::Role::Tool, &[], "c1"),
            message(v1::Role::Assistant, &["c3"], ""),
            message(v1::Role::Tool, &[], "c3"),
        ];
        assert!(check_execute(&request(rounds), LIMITS).is_ok());
        let answers_nothing = "answers no tool call";
        let unanswered = "has no ROLE_TOOL answer";
        for (context, field, says) in [
            (
                vec![message(v1::Role::Tool, &[], "zz")],
                "llm_context[0].tool_call_id",
                answers_nothing,
            ),
            (
                vec![
                    message(v1::Role::Assistant, &["c1"], ""),
                    message(v1::Role::User, &[], ""),
                    message(v1::Role::Tool, &[], "c1"),
                ],
                "llm_context[2].tool_call_id",
                answers_nothing,
            ),
            (
                vec![
                    message(v1::Role::Assistant, &["c1"], ""),
                    message(v1::Role::Tool, &[], "c1"),
                    message(v1::Role::Tool, &[], "c1"),
                ],
                "llm_context[2].tool_call_id",
                answers_nothing,
            ),
            (
                vec![
                    message(v1::Role::User, &[], ""),
                    message(v1::Role::Assistant, &["c1", "c2"], ""),
                    message(v1::Role::Tool, &[], "c1"),
                    message(v1::Role::User, &[], ""),
                ],
                "llm_context[1].tool_calls[1].id",
                unanswered,
            ),
            (
                vec![v1::ChatMessage {
                    tool_calls: vec![v1::ToolCall {
                        id: "c1".into(),
                        ..Default::default()
                    }],
                    ..message(v1::Role::Assistant, &[], "")
                }],
                "llm_context[0].tool_calls[0].name",
                "required",
            ),
            (
                vec![message(v1::Role::Assistant, &["c1", ""], "")],
                "llm_context[0].tool_calls[1].id",
                "required",
            ),
            (
                vec![
                    message(v1::Role::Assistant, &["c1", "c1"], ""),
                    message(v1::Role::Tool, &[], "c1"),
                    message(v1::Role::Tool, &[], "c1"),
                ],
                "llm_context[0].tool_calls[1].id",
                "duplicate of tool_calls[0]",
            ),
            (
                // Calls the model would be sent with no assistant message making them.
                vec![
                    message(v1::Role::User, &["c1"], ""),
                    message(v1::Role::Tool, &[], "c1"),
                ],
                "llm_context[0].tool_calls",
                "only a ROLE_ASSISTANT message",
            ),
            (
                vec![message(v1::Role::User, &[], "c1")],
                "llm_context[0].tool_call_id",
                "only a ROLE_TOOL message",
            ),
            (
                // The query comes next: a call left open at the end has no answer either.
                vec![message(v1::Role::Assistant, &["c1"], "")],
                "llm_context[0].tool_calls[0].id",
                unanswered,
            ),
        ] {
            let violations = check_execute(&request(context), LIMITS).unwrap_err();
            assert!(
                violations
                    .iter()
                    .any(|v| v.field == field && v.description.starts_with(says)),
                "{field}: {violations:?}"
            );
        }
    }

    #[test]
    fn an_llm_context_is_bounded_by_its_calls_too() {
        let calls = |n: usize, arguments: Option<prost_types::Struct>| v1::ChatMessage {
            role: v1::Role::Assistant as i32,
            tool_calls: (0..n)
                .map(|i| v1::ToolCall {
                    id: format!("c{i}"),
                    name: "calculator".into(),
                    arguments: arguments.clone(),
                })
                .collect(),
            ..Default::default()
        };
        let request = |llm_context| v1::ExecuteRequest {
            engine_id: "e".into(),
            query: "q".into(),
            llm_context,
            ..Default::default()
        };
        // More calls in a message than a model's reply may hold: one violation, read
        // without a look at each call.
        let violations = check_execute(
            &request(vec![calls(100_000, None)]),
            RequestLimits {
                context_chars: usize::MAX,
                ..LIMITS
            },
        )
        .unwrap_err();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!(violations[0].field, "llm_context[0].tool_calls");
        assert!(
            violations[0].description.contains("at most 128"),
            "{violations:?}"
        );
        // Their arguments count as characters of the context (1000 here).
        let large = prost_types::Struct {
            fields: [(
                "expression".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue("9".repeat(600))),
                },
            )]
            .into(),
        };
        let violations = check_execute(&request(vec![calls(2, Some(large))]), LIMITS).unwrap_err();
        assert_eq!(violations[0].field, "llm_context");
        assert!(
            violations[0].description.contains("runs.max_context_chars"),
            "{violations:?}"
        );
    }

    #[test]
    fn answers_are_bounded_before_they_are_read() {
        use tonic::Code;
        let output = |id: String| {
            (
                id,
                ToolAnswer::Output {
                    output: "42".into(),
                    is_error: false,
                },
            )
        };
        let check = |answers: Vec<(String, ToolAnswer)>| {
            check_answers(
                "run-1",
                "outputs",
                answers.iter().map(|(id, a)| (id.as_str(), a.clone())),
            )
        };
        assert!(check((0..128).map(|i| output(format!("c{i}"))).collect()).is_ok());
        // Too many: refused as a whole, with one violation (not one per duplicate).
        let status = check((0..100_000).map(|_| output("c".into())).collect()).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "invalid request: outputs: at most 128, got 100000"
        );
        // An id no call of a run has: refused, and not echoed back whole.
        let status = check(vec![output("c".repeat(100_000))]).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains("at most 256 bytes, got 100000"),
            "{}",
            status.message()
        );
        assert!(status.message().len() < 1200);
    }
}
