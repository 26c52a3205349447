//! The stores shared through Redis: every replica pointed at one Redis serves any engine,
//! session and run.
//!
//! A replica holds two connections, whatever its load: one multiplexed connection for
//! commands (pipelined; the engine, session, run and event stores share it) and one for
//! subscriptions (stop requests, and the "new events" notices that wake the readers of a
//! run on this replica). Both reconnect by themselves; while Redis cannot be reached,
//! every call fails at once with [`StateError::Unavailable`], naming Redis.
//!
//! Keys, under a prefix (`agentrt` unless set), each with a time to live:
//! - `P:engine:ID`: the engine (JSON), for the engine TTL after its last use;
//! - `P:session:ID`: the session's exchanges (a list of JSON), for the session TTL after
//!   its last turn, the oldest beyond the bound trimmed;
//! - `P:run:ID`: the run's record (a hash: `i` what never changes, its ids, query and
//!   start, written with the saves of the whole record; `h` the rest, written with every
//!   save; `s:N` each round; `!turn` once the run's turn is in its session's history), and
//!   `P:msg:LEN:SESSION:MESSAGE` the run a message id names; while the run runs and for the
//!   retention after;
//! - `P:events:ID`: the run's event log (a stream whose entry ids are the sequence
//!   numbers), at most `events_per_run` entries, kept as long as the record;
//! - `P:owner:ID`: the lease token of the replica executing the run (kept as long as the
//!   record, so that a replica that lost the run cannot write it, even after it ended);
//!   `P:leases:all`: the running runs, scored by when their lease lapses (0: let go);
//!   `P:resume:ID`: what another replica needs to continue the run (its spec, its step
//!   machine's state, the turn's messages), dropped when it ends;
//! - `P:agent:DIGEST`: an agent's config and tools (JSON), one copy for all the runs of
//!   every engine that runs it (named by a digest of the JSON, the `a` field of their
//!   `P:resume:ID`), kept as long as the longest-lived of them may be continued;
//! - `P:wait:ID`: a waiting run's answers (`c:CALL`), and digests of its earlier waits'
//!   (`e:CALL`); `P:waiting:of:PRINCIPAL`: a named principal's
//!   waiting runs, scored by when each wait ends, which bounds them
//!   (`runs.max_waiting_per_principal`), left when a wait is answered, cancelled or over.
//!
//! Every write of a run's events and record is a script that first checks the writer's
//! token against the run's owner (a fence): a replica paused past its lease writes
//! nothing once another took the run over. A run's checkpoint (`RunStore::checkpoint`)
//! writes its events and its record in one script: one round trip per tool round.
//! Events that may wait (text deltas, and what a run publishes just before it calls the
//! model) are written at most 10 ms later by one task per replica, or earlier with the
//! run's next write.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard, PoisonError, Weak},
    time::{Duration, SystemTime},
};

use agentrt_context::{Exchange, SessionStore};
use agentrt_core::{StateError, StateResult};
use agentrt_events::{BusError, EventBus, EventKind, EventStream, Resumed, RunEvent, RunPublisher};
use async_trait::async_trait;
use redis::{
    AsyncCommands, Client, ProtocolVersion, PushInfo, PushKind, Value,
    aio::{ConnectionManager, ConnectionManagerConfig},
};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, warn};

use crate::{
    EngineStore, RunError, RunRecord, RunStatus, StepRecord, StopReason, StoredEngine, TokenUsage,
    runs::{
        AgentIds, Answered, Answers, CheckpointError, Claim, Lease, LeaseRenewer, Progress,
        Resumable, RunStore, StopRequest, StopRequests, checkpoint_apart, end_apart,
    },
};

/// How long one connection attempt may take, and a subscription.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one command may wait for its answer before it fails. Commands share one
/// multiplexed connection, so under load an answer waits behind everyone's: at 50,000
/// runs in flight on two cores, 2 s failed a third of the runs although Redis answered
/// every command (`agentrt-bench --scale --state redis://...`). A Redis that is down or
/// unreachable fails commands at once, whatever this is.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a reader waits for a notice before it looks for new events anyway, while
/// Redis has not confirmed that this process follows the run's notices (the subscription
/// is being made, or remade after the connection was lost).
const READ_POLL: Duration = Duration::from_secs(2);
/// The same once Redis confirmed it: notices then come as events are written, and those
/// written while the connection was lost are read when the subscription is confirmed
/// again. A reader still looks now and then, for a run that ended without a word (its
/// state lost in Redis: nobody writes its end); thousands of readers on one replica cost
/// Redis a command each per poll.
const READ_POLL_FOLLOWED: Duration = Duration::from_secs(10);
/// How long a running run's keys live (then the retention follows): no run outlasts its
/// timeout, and no timeout is longer.
const RUNNING_TTL: Duration = agentrt_core::limits::MAX_RUN_TIMEOUT;
/// Events a reader takes from the log at once.
const READ_BATCH: usize = 256;

/// The bounds of what is kept in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisLimits {
    /// How long an engine lives after its last use.
    pub engine_ttl: Duration,
    /// How long a session lives after its last turn.
    pub session_ttl: Duration,
    /// Exchanges kept per session.
    pub max_exchanges: usize,
    /// Bytes of one session's exchanges (as stored, JSON); beyond, its oldest go (its
    /// newest stays).
    pub max_history_bytes: usize,
    /// How long an ended run (record and events) stays readable.
    pub run_retention: Duration,
    /// Events kept per run.
    pub events_per_run: usize,
    /// Events kept, all runs together, in this replica's copies of the logs of the runs
    /// it executed (see [`Redis::bus`]).
    pub retained_events: usize,
    /// How long a run's lease lasts without being renewed: after it, another replica
    /// takes the run over.
    pub lease: Duration,
    /// Most runs of one named principal waiting for answers at once, all replicas
    /// together (`runs.max_waiting_per_principal`).
    pub max_waiting_per_principal: usize,
}

/// A connection to the Redis every replica shares.
#[derive(Clone)]
pub struct Redis {
    shared: Arc<Shared>,
}

struct Shared {
    /// For connections made apart from the two shared ones (a replica's lease renewals).
    client: Client,
    commands: ConnectionManager,
    subscriptions: ConnectionManager,
    prefix: String,
    /// The URL without credentials, for messages.
    target: String,
    limits: RedisLimits,
    listeners: Arc<Mutex<Listeners>>,
    /// Held while this process subscribes to or unsubscribes from a run's notices, and
    /// decides to: an unsubscribe by a last reader never lands after the subscribe of a
    /// new first one (whose reader would then hear no notices). Striped by channel, so
    /// that readers of different runs subscribe at once.
    subscribing: Arc<[tokio::sync::Mutex<()>]>,
    /// This replica's copies of the logs of the runs it executes.
    local: agentrt_events::InMemoryBus,
    /// Writes the events that publishers let wait.
    flusher: Arc<Flusher>,
    agent_ids: AgentIds,
}

#[derive(Default)]
struct Listeners {
    /// Per event channel, the readers here that follow it.
    events: HashMap<String, Followed>,
    /// Stop requests, to every run manager of this process.
    stops: Option<broadcast::Sender<StopRequest>>,
    stop_channel: String,
    /// Whether Redis confirmed the subscription to stop requests (once asked for, the
    /// replica is not ready until it has: a `Cancel` through another replica would not
    /// reach its runs at once).
    stops_subscribed: bool,
}

/// One run's notices, as this process follows them.
struct Followed {
    /// The last sequence announced; also changed, to the same value, when the readers
    /// should look again (the subscription was confirmed again after a reconnect).
    notices: watch::Sender<u64>,
    /// Readers here.
    readers: usize,
    /// Whether Redis confirmed the subscription since the connection was last lost.
    confirmed: bool,
}

fn lock(listeners: &Mutex<Listeners>) -> MutexGuard<'_, Listeners> {
    // Each critical section leaves the maps consistent before anything can panic.
    listeners.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Redis {
    /// Connects to `url` (`redis://` or `rediss://`), keeping keys under `prefix`.
    /// Connections are made lazily and remade as needed: a Redis that is down now makes
    /// calls fail until it is up, not the start-up.
    pub fn connect(url: &str, prefix: &str, limits: RedisLimits) -> StateResult<Self> {
        let target = agentrt_core::mask_url_credentials(url);
        let invalid = |e: redis::RedisError| {
            StateError::Unavailable(format!("the Redis URL {target} is not valid: {e}"))
        };
        let client = Client::open(url).map_err(invalid)?;
        let config = connection_config(RESPONSE_TIMEOUT);
        let commands = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(invalid)?;
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let subscriber = Client::open(info.set_redis_settings(settings)).map_err(invalid)?;
        let listeners = Arc::new(Mutex::new(Listeners {
            stop_channel: format!("{prefix}:stop"),
            ..Listeners::default()
        }));
        let dispatch = {
            let listeners = listeners.clone();
            move |push: PushInfo| -> Result<(), ()> {
                dispatch(&listeners, push);
                Ok(())
            }
        };
        let subscriptions = ConnectionManager::new_lazy_with_config(
            subscriber,
            config
                .set_push_sender(dispatch)
                .set_automatic_resubscription(),
        )
        .map_err(invalid)?;
        Ok(Self {
            shared: Arc::new(Shared {
                client,
                commands,
                subscriptions,
                prefix: prefix.to_owned(),
                target,
                limits,
                listeners,
                subscribing: (0..SUBSCRIBE_STRIPES)
                    .map(|_| tokio::sync::Mutex::new(()))
                    .collect(),
                local: agentrt_events::InMemoryBus::new(agentrt_events::BusLimits {
                    events_per_run: limits.events_per_run,
                    retention: limits.run_retention,
                    retained_events: limits.retained_events,
                    ..agentrt_events::BusLimits::default()
                }),
                flusher: Arc::default(),
                agent_ids: AgentIds::default(),
            }),
        })
    }

    /// Checks that both connections reach Redis (and reconnects them if needed).
    pub async fn ping(&self) -> StateResult<()> {
        let mut commands = self.shared.commands.clone();
        let mut subscriptions = self.shared.subscriptions.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut commands)
            .await
            .map_err(|e| self.shared.unavailable(&e))?;
        let _: Value = redis::cmd("PING")
            .query_async(&mut subscriptions)
            .await
            .map_err(|e| self.shared.unavailable(&e))?;
        // Stop requests asked for and not yet subscribed to (Redis was down when the
        // replica started): subscribe now, rather than at the background task's next try.
        let channel = {
            let listeners = lock(&self.shared.listeners);
            (listeners.stops.is_some() && !listeners.stops_subscribed)
                .then(|| listeners.stop_channel.clone())
        };
        if let Some(channel) = channel {
            subscriptions
                .subscribe(&channel)
                .await
                .map_err(|e| self.shared.unavailable(&e))?;
            lock(&self.shared.listeners).stops_subscribed = true;
            info!("subscribed to stop requests");
        }
        Ok(())
    }

    /// The engine store.
    pub fn engines(&self) -> Arc<dyn EngineStore> {
        self.engines_within(usize::MAX, usize::MAX)
    }

    /// The engine store, keeping at most `max_engines` engines (beyond, the least
    /// recently used is dropped) and at most `max_per_principal` of one named principal
    /// (beyond, inserting is refused), as the in-memory store does.
    pub fn engines_within(
        &self,
        max_engines: usize,
        max_per_principal: usize,
    ) -> Arc<dyn EngineStore> {
        Arc::new(RedisEngines {
            shared: self.shared.clone(),
            max_engines,
            max_per_principal,
            parsed: Mutex::default(),
        })
    }

    /// The session store.
    pub fn sessions(&self) -> Arc<dyn SessionStore> {
        Arc::new(RedisSessions(self.shared.clone()))
    }

    /// The run store.
    pub fn runs(&self) -> Arc<dyn RunStore> {
        Arc::new(RedisRuns(self.shared.clone()))
    }

    /// The event bus. The replica executing a run also keeps its log in memory, as the
    /// in-memory bus does, and its own readers read that copy: only readers on other
    /// replicas read Redis.
    pub fn bus(&self) -> Arc<dyn EventBus> {
        Arc::new(RedisBus(self.shared.clone()))
    }
}

/// Hands a message of a subscription to the readers or run managers of this process.
fn dispatch(listeners: &Mutex<Listeners>, push: PushInfo) {
    match push.kind {
        PushKind::Message => {
            let mut data = push.data.into_iter();
            let (Some(channel), Some(payload)) = (data.next(), data.next()) else {
                return;
            };
            let (Some(channel), Some(payload)) = (text(channel), text(payload)) else {
                return;
            };
            let listeners = lock(listeners);
            if channel == listeners.stop_channel {
                if let Some((reason, run_id)) = payload.split_once(' ')
                    && let Some(reason) = StopReason::from_name(reason)
                    && let Some(stops) = &listeners.stops
                {
                    let _ = stops.send(StopRequest {
                        run_id: run_id.to_owned(),
                        reason,
                    });
                }
            } else if let Some(followed) = listeners.events.get(&channel)
                && let Ok(sequence) = payload.parse::<u64>()
            {
                followed.notices.send_if_modified(|last| {
                    let newer = sequence > *last;
                    *last = (*last).max(sequence);
                    newer
                });
            }
        }
        // Redis confirmed a subscription: the first one, or one the connection made again
        // after it was lost. Notices of events written while it was lost never came: the
        // readers look for them now.
        PushKind::Subscribe => {
            let Some(channel) = push.data.into_iter().next().and_then(text) else {
                return;
            };
            if let Some(followed) = lock(listeners).events.get_mut(&channel) {
                followed.confirmed = true;
                followed.notices.send_modify(|_| {});
            }
        }
        PushKind::Disconnection => {
            // Until the connection is back and has subscribed again, readers poll.
            debug!("redis subscription connection lost");
            for followed in lock(listeners).events.values_mut() {
                followed.confirmed = false;
            }
        }
        _ => {}
    }
}

fn text(value: Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes).ok(),
        Value::SimpleString(text) => Some(text),
        _ => None,
    }
}

impl Shared {
    fn unavailable(&self, error: &redis::RedisError) -> StateError {
        StateError::Unavailable(format!("Redis at {} is unavailable: {error}", self.target))
    }

    fn key(&self, kind: &str, id: &str) -> String {
        // Made for every write: built directly, without the formatting machinery.
        let mut key = String::with_capacity(self.prefix.len() + kind.len() + id.len() + 2);
        key.push_str(&self.prefix);
        key.push(':');
        key.push_str(kind);
        key.push(':');
        key.push_str(id);
        key
    }

    fn connection(&self) -> ConnectionManager {
        self.commands.clone()
    }
}

/// How the connections to Redis are made and kept: remade when lost, a command failing
/// after `response_timeout` without its answer.
fn connection_config(response_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(COMMAND_TIMEOUT))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_secs(1))
}

/// `duration` in whole milliseconds, at least 1 (Redis refuses a time to live of 0).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn corrupt(what: &'static str, error: &dyn std::fmt::Display) -> StateError {
    StateError::Corrupt {
        what,
        detail: error.to_string(),
    }
}

/// Lease renewals on a connection of their own.
struct RedisRenewer {
    shared: Arc<Shared>,
    connection: ConnectionManager,
}

#[async_trait::async_trait]
impl LeaseRenewer for RedisRenewer {
    async fn renew(&self, leases: &[Lease]) -> StateResult<Vec<String>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let shared = &self.shared;
        let mut script = ScriptCall::new(renew_script(), 1);
        script
            .key(shared.key("leases", "all"))
            .arg(&shared.prefix)
            .arg(millis(shared.limits.lease));
        for lease in leases {
            script.arg(&lease.run_id).arg(&lease.token);
        }
        let (lost, stopped): (Vec<String>, Vec<(String, String)>) = script
            .invoke(&mut self.connection.clone())
            .await
            .map_err(|e| shared.unavailable(&e))?;
        // Stop requests are announced once, to the replicas subscribed then: one made
        // while this replica's subscription was being remade (Redis restarted, the
        // connection dropped) never reached its run. The renewal finds it, within a third
        // of a lease, and hands it to the run managers here as if it had just come (a
        // run already stopping ignores it).
        if !stopped.is_empty() {
            let listeners = lock(&shared.listeners);
            if let Some(stops) = &listeners.stops {
                for (run_id, reason) in stopped {
                    if let Some(reason) = StopReason::from_name(&reason) {
                        let _ = stops.send(StopRequest { run_id, reason });
                    }
                }
            }
        }
        Ok(lost)
    }
}

/// Engines, each under its own key, with two sorted sets of their ids scored by when
/// they expire: all of them (`engines:lru`, also the order of last use) and each named
/// principal's (`engines:of:PRINCIPAL`), so that the store's bounds hold across replicas.
struct RedisEngines {
    shared: Arc<Shared>,
    max_engines: usize,
    max_per_principal: usize,
    /// Engines as last read or written here: the runs of an engine whose JSON is
    /// unchanged take it without parsing it again (and share its config and tools).
    parsed: Mutex<Parsed>,
}

/// Engines kept parsed, by id, with the JSON Redis holds for them: at most about
/// [`PARSED_BYTES`] in all, an engine counting as its JSON twice (the JSON, and the engine
/// parsed from it) and its id.
#[derive(Default)]
struct Parsed {
    engines: HashMap<String, (String, StoredEngine)>,
    bytes: usize,
}

/// How much [`Parsed`] holds at most.
const PARSED_BYTES: usize = 8 << 20;

impl Parsed {
    /// What an engine of `id` read from `json` counts for.
    fn size(id: &str, json: &str) -> usize {
        2 * json.len() + id.len()
    }

    fn remove(&mut self, id: &str) {
        if let Some((json, _)) = self.engines.remove(id) {
            self.bytes -= Self::size(id, &json);
        }
    }

    fn keep(&mut self, json: String, engine: &StoredEngine) {
        self.remove(&engine.id);
        let size = Self::size(&engine.id, &json);
        if size > PARSED_BYTES / 4 {
            return;
        }
        while self.bytes + size > PARSED_BYTES {
            // Any one makes room: a miss costs a parse, no more.
            let Some(id) = self.engines.keys().next().cloned() else {
                break;
            };
            self.remove(&id);
        }
        self.bytes += size;
        self.engines
            .insert(engine.id.clone(), (json, engine.clone()));
    }
}

impl RedisEngines {
    /// Engine `id`, read from `json`.
    fn parse(&self, id: &str, json: String) -> StateResult<StoredEngine> {
        if let Some((known, engine)) = self.parsed().engines.get(id)
            && *known == json
        {
            return Ok(engine.clone());
        }
        let engine: StoredEngine =
            serde_json::from_str(&json).map_err(|e| corrupt("engine", &e))?;
        self.keep(json, &engine);
        Ok(engine)
    }

    fn parsed(&self) -> MutexGuard<'_, Parsed> {
        self.parsed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `engine`, as Redis holds it (`json`), parsed.
    fn keep(&self, json: String, engine: &StoredEngine) {
        self.parsed().keep(json, engine);
    }
}

/// The principal of an engine as stored (`{"id":...,"session_id":"PRINCIPAL/..."`), in
/// Lua: empty for the anonymous one (its engines have a set too, under the bare prefix).
const ENGINE_PRINCIPAL: &str = r#"
local function principal_of(json)
  return string.match(json, '"session_id":"([^"/]*)/') or ''
end
"#;

/// Keeps an engine within the bounds: `KEYS[1]` the engine, `KEYS[2]` the set of all,
/// `KEYS[3]` its principal's set; `ARGV`: id, engine, time to live (ms), most engines,
/// most of one principal (0 for the anonymous one: no bound of its own), prefix of engine
/// keys, prefix of principals' sets. -1 when kept; the principal's count of engines when
/// it has its most already. A full store drops the least recently used engine when its
/// principal has more engines than the caller, else the caller's own least recently used
/// (one principal never drops another's engines to hold more than it).
const ENGINE_INSERT: &str = r"
local now = now_ms()
local ttl = tonumber(ARGV[3])
local expires = now + ttl
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local function count(set)
  redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
  return redis.call('ZCARD', set)
end
local owned = count(KEYS[3])
if ARGV[5] ~= '0' and owned >= tonumber(ARGV[5]) then return owned end
local most = tonumber(ARGV[4])
while redis.call('ZCARD', KEYS[2]) >= most do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  local victim = oldest[1]
  local json = redis.call('GET', ARGV[6] .. victim)
  local set = json and (ARGV[7] .. principal_of(json))
  if set and set ~= KEYS[3] and count(set) <= count(KEYS[3]) then
    local own = redis.call('ZRANGE', KEYS[3], 0, 0)
    if #own > 0 then
      victim = own[1]
      json = redis.call('GET', ARGV[6] .. victim)
      set = KEYS[3]
    end
  end
  redis.call('ZREM', KEYS[2], victim)
  if set then redis.call('ZREM', set, victim) end
  redis.call('DEL', ARGV[6] .. victim)
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], expires, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[3], expires, ARGV[1])
redis.call('PEXPIRE', KEYS[3], ttl)
return -1
";

/// Reads an engine and extends its life, in the sets too: `KEYS[1]` the engine, `KEYS[2]`
/// the set of all; `ARGV`: id, time to live (ms), prefix of principals' sets, `1` when only
/// an engine of principal `ARGV[5]` is wanted (another's is neither read nor extended, and
/// answered as `''`). Nothing when there is none.
const ENGINE_GET: &str = r"
local json = redis.call('GET', KEYS[1])
if not json then return false end
if ARGV[4] == '1' and principal_of(json) ~= ARGV[5] then return '' end
local ttl = tonumber(ARGV[2])
local expires = now_ms() + ttl
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], 'XX', expires, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ttl)
local set = ARGV[3] .. principal_of(json)
redis.call('ZADD', set, 'XX', expires, ARGV[1])
redis.call('PEXPIRE', set, ttl)
return json
";

/// Drops an engine, from the sets too: `KEYS[1]` the engine, `KEYS[2]` the set of all;
/// `ARGV`: id, prefix of principals' sets. 1 when there was one.
const ENGINE_REMOVE: &str = r"
local json = redis.call('GET', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if not json then return 0 end
redis.call('ZREM', ARGV[2] .. principal_of(json), ARGV[1])
redis.call('DEL', KEYS[1])
return 1
";

#[async_trait]
impl EngineStore for RedisEngines {
    async fn insert(&self, mut engine: StoredEngine) -> StateResult<StoredEngine> {
        let shared = &self.shared;
        let ttl = shared.limits.engine_ttl;
        engine.expire_time = SystemTime::now() + ttl;
        let json = serde_json::to_string(&engine).map_err(|e| corrupt("engine", &e))?;
        let principal = crate::principal_of(&engine.session_id);
        let most_owned = if principal.is_empty() {
            0
        } else {
            self.max_per_principal.max(1)
        };
        let owned: i64 = ScriptCall::new(engine_insert_script(), 3)
            .key(shared.key("engine", &engine.id))
            .key(shared.key("engines", "lru"))
            .key(shared.key("engines:of", principal))
            .arg(&engine.id)
            .arg(&json)
            .arg(millis(ttl))
            .arg(self.max_engines.max(1))
            .arg(most_owned)
            .arg(shared.key("engine", ""))
            .arg(shared.key("engines:of", ""))
            .invoke(&mut shared.connection())
            .await
            .map_err(|e| shared.unavailable(&e))?;
        if owned >= 0 {
            return Err(StateError::OverBudget {
                budget: "engines.max_per_principal",
                message: format!(
                    "this principal has {owned} engines, its most; delete engines, or wait \
                     for unused ones to expire"
                ),
            });
        }
        self.keep(json, &engine);
        Ok(engine)
    }

    async fn get(&self, id: &str, owner: Option<&str>) -> StateResult<Option<StoredEngine>> {
        let shared = &self.shared;
        let ttl = shared.limits.engine_ttl;
        let json: Option<String> = ScriptCall::new(engine_get_script(), 2)
            .key(shared.key("engine", id))
            .key(shared.key("engines", "lru"))
            .arg(id)
            .arg(millis(ttl))
            .arg(shared.key("engines:of", ""))
            .arg(u8::from(owner.is_some()))
            .arg(owner.unwrap_or_default())
            .invoke(&mut shared.connection())
            .await
            .map_err(|e| shared.unavailable(&e))?;
        let Some(json) = json else {
            self.parsed().remove(id);
            return Ok(None);
        };
        // Another principal's: it stays parsed for its owner.
        if json.is_empty() {
            return Ok(None);
        }
        let mut engine = self.parse(id, json)?;
        engine.expire_time = SystemTime::now() + ttl;
        Ok(Some(engine))
    }

    async fn remove(&self, id: &str) -> StateResult<bool> {
        let shared = &self.shared;
        let removed: u8 = ScriptCall::new(engine_remove_script(), 2)
            .key(shared.key("engine", id))
            .key(shared.key("engines", "lru"))
            .arg(id)
            .arg(shared.key("engines:of", ""))
            .invoke(&mut shared.connection())
            .await
            .map_err(|e| shared.unavailable(&e))?;
        self.parsed().remove(id);
        Ok(removed == 1)
    }
}

struct RedisSessions(Arc<Shared>);

/// Extends session `KEYS[1]`'s time to live to `ARGV[1]` ms when it has less left (never
/// shortens it: a run of it may wait longer).
const SESSION_KEEP: &str = r"
local left = redis.call('PTTL', KEYS[1])
if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 0
";

/// Session `KEYS[1]`'s exchanges, keeping it as [`SESSION_KEEP`] does for `ARGV[1]` ms.
const SESSION_READ: &str = r"
local left = redis.call('PTTL', KEYS[1])
if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return {redis.call('LRANGE', KEYS[1], 0, -1)}
";

/// Appends `exchange` to session history `key`, keeping its last `keep` exchanges and, of
/// those, the newest within `max_bytes` (at least the last one).
const SESSION_PUSH: &str = r"
local function push_exchange(key, exchange, keep, max_bytes)
  redis.call('RPUSH', key, exchange)
  redis.call('LTRIM', key, -tonumber(keep), -1)
  local items = redis.call('LRANGE', key, 0, -1)
  local total = 0
  for i = 1, #items do total = total + #items[i] end
  local first = 1
  while total > tonumber(max_bytes) and first < #items do
    total = total - #items[first]
    first = first + 1
  end
  if first > 1 then redis.call('LTRIM', key, first - 1, -1) end
end
";

/// Appends exchange `ARGV[1]` to session `KEYS[1]` as [`SESSION_PUSH`] does (`ARGV[2]`
/// exchanges, `ARGV[4]` bytes), for at least `ARGV[3]` ms from now (a longer time to
/// live it has is kept).
const SESSION_APPEND: &str = r"
push_exchange(KEYS[1], ARGV[1], ARGV[2], ARGV[4])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 0
";

fn session_append_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(&format!("{SESSION_PUSH}{SESSION_APPEND}")))
}

fn session_keep_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(SESSION_KEEP))
}

fn session_read_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(SESSION_READ))
}

#[async_trait]
impl SessionStore for RedisSessions {
    async fn history(&self, session_id: &str) -> StateResult<Vec<Arc<Exchange>>> {
        // Read, and kept for its time to live from now (a run of it is under way), in
        // one round trip.
        let (items,): (Vec<String>,) = ScriptCall::new(session_read_script(), 1)
            .key(self.0.key("session", session_id))
            .arg(millis(self.0.limits.session_ttl))
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        items
            .iter()
            .map(|json| {
                serde_json::from_str(json)
                    .map(Arc::new)
                    .map_err(|e| corrupt("session exchange", &e))
            })
            .collect()
    }

    async fn keep(&self, session_id: &str, wait: Duration) -> StateResult<()> {
        let ttl = millis(self.0.limits.session_ttl.saturating_add(wait));
        let _: u8 = ScriptCall::new(session_keep_script(), 1)
            .key(self.0.key("session", session_id))
            .arg(ttl)
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(())
    }

    async fn append(&self, session_id: &str, exchange: Arc<Exchange>) -> StateResult<()> {
        let key = self.0.key("session", session_id);
        let json = serde_json::to_string(&exchange).map_err(|e| corrupt("exchange", &e))?;
        let keep = isize::try_from(self.0.limits.max_exchanges.max(1)).unwrap_or(isize::MAX);
        // One script: the push lands whole, in the order appends reach Redis, and the
        // trim and the time to live with it.
        let _: u8 = ScriptCall::new(session_append_script(), 1)
            .key(&key)
            .arg(json)
            .arg(keep)
            .arg(millis(self.0.limits.session_ttl))
            .arg(self.0.limits.max_history_bytes.max(1))
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(())
    }

    fn as_any(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        Some(self)
    }
}

struct RedisRuns(Arc<Shared>);

/// Sets the key to the run when it is free or held by the run it replaces.
const CLAIM: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder == false or (ARGV[2] ~= '' and holder == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return ''
end
return holder
";

/// The claim script, hashed once: Redis runs it by its hash after the first call.
fn claim_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(CLAIM))
}

/// `may_write(record, owner_key, owner, opening, claim_key, run)` answers 1 when `owner` may write the run:
/// it holds the lease, or the run has no owner, or this is the run's opening save (the one
/// that takes the lease) and nothing of the run is written yet. It answers 0 when another
/// replica holds the lease (the writer stops its copy, fenced off), and 2 when the run is
/// gone: its owner key is not there although the run was opened (Redis lost its data,
/// restarted empty or failed over to an empty replica, or evicted the keys). A gone run
/// is not written back piece by piece (keys without a time to live, a record that fences
/// off its own writer): its writer stops it, and its readers find it unknown. An opening
/// save is refused (0) when its message id (`claim_key`) names another run than `run`: a
/// retry elsewhere took the claim over while this opening write was on its way, and the
/// message id makes one run, the other's.
const FENCE: &str = r"
local function may_write(record, owner_key, owner, opening, claim_key, run)
  if owner == '' then return 1 end
  local holder = redis.call('GET', owner_key)
  if holder then
    if holder == owner then return 1 end
    return 0
  end
  if opening and redis.call('EXISTS', record) == 0 then
    local claimed = redis.call('GET', claim_key)
    if claimed and claimed ~= run then return 0 end
    return 1
  end
  return 2
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- 3 when run `run` would begin to wait (`wait_ms` set) while its principal has `most`
-- runs waiting already (`waiting`: their set, scored by when their wait ends; `most`
-- '0': no bound), else 1.
local function may_wait(run, waiting, wait_ms, most)
  if wait_ms == '' or most == '0' then return 1 end
  redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now_ms())
  if redis.call('ZSCORE', waiting, run) then return 1 end
  if redis.call('ZCARD', waiting) >= tonumber(most) then return 3 end
  return 1
end
";

/// Whether the save may write (see [`FENCE`]): `KEYS[1]` the record, `KEYS[2]` the
/// owner key, flag `o` in `ARGV[5]` for a save of the whole run (its opening); and, for a
/// save that begins a wait, whether its principal has room for one more (`KEYS[9]`, the
/// bound `ARGV[8]`; 3 when not).
const SAVE_FENCE: &str = r"
local allowed = may_write(KEYS[1], KEYS[2], ARGV[2], string.find(ARGV[5], 'o', 1, true), KEYS[5], ARGV[1])
if allowed ~= 1 then return allowed end
allowed = may_wait(ARGV[1], KEYS[9], ARGV[7], ARGV[8])
if allowed ~= 1 then return allowed end
";

/// Saves run `ARGV[1]` for owner `ARGV[2]` once [`SAVE_FENCE`] let it: record fields,
/// progress fields (`KEYS[6]`), times to live, and the lease taken with the first record
/// (`KEYS[3]`, scored by when it lapses, by Redis's clock) or dropped with the last.
/// `ARGV`: run, owner, time to live, lease (ms), flags (`f` first, `e` ended, `o` a save
/// of the whole run, `a` with the agent, `t` with the run's turn), record field count, wait
/// (ms, or empty when the run does not wait), most runs of its principal waiting at once
/// (`0`: no bound; its waiting runs are `KEYS[9]`), the number of pending call ids, the
/// ids, then record fields and progress fields, with flag `a` the agent of the run's
/// engine, and with flag `t` last the turn kept in the session's history (`KEYS[10]`,
/// as `RedisSessions::append` keeps it, once per run: the record's `!turn` field marks
/// it kept): the exchange, how many the session keeps, its time to live (ms), and the
/// bytes it keeps. A run that waits
/// has no owner (`KEYS[2]` empty), its lease lapses when the wait ends, and its answers
/// are kept in `KEYS[7]` (`c:<call id>` fields, empty until answered; `!done`, `!cancel`
/// and `!taken` marks). The agent is one key for all its runs (`KEYS[8]`, given with it;
/// else `KEYS[8]` is the agent keys' prefix and its id is the run's `a` progress field),
/// kept as long as the longest-lived run that uses it.
const SAVE: &str = r"
local fields = tonumber(ARGV[6])
local waits = tonumber(ARGV[9])
local base = 9 + waits
local first = string.find(ARGV[5], 'f', 1, true)
local ended = string.find(ARGV[5], 'e', 1, true)
local last = #ARGV
if string.find(ARGV[5], 't', 1, true) then
  last = last - 4
  -- Once per run: a write that timed out after Redis ran it, sent again, keeps no
  -- second turn.
  if redis.call('HSETNX', KEYS[1], '!turn', '1') == 1 then
    push_exchange(KEYS[10], ARGV[last + 1], ARGV[last + 2], ARGV[last + 4])
    -- Never shorter than it was kept for (a run of it may wait).
    if redis.call('PTTL', KEYS[10]) < tonumber(ARGV[last + 3]) then
      redis.call('PEXPIRE', KEYS[10], ARGV[last + 3])
    end
  end
end
local agent = nil
if string.find(ARGV[5], 'a', 1, true) then
  last = last - 1
  agent = KEYS[8]
  redis.call('SET', agent, ARGV[last + 1], 'NX', 'PX', ARGV[3])
end
local record = {}
for i = base + 1, base + 2 * fields do record[#record + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(record))
if not ended and last > base + 2 * fields then
  local progress = {}
  for i = base + 1 + 2 * fields, last do progress[#progress + 1] = ARGV[i] end
  redis.call('HSET', KEYS[6], unpack(progress))
  -- Progress saved after a wait holds what the run was told: later take-overs are told
  -- nothing (until then, each is, as the replica that took it over may have died).
  if ARGV[7] == '' and redis.call('HEXISTS', KEYS[7], '!taken') == 1 then
    redis.call('HSET', KEYS[7], '!past', '1')
    redis.call('ZREM', KEYS[9], ARGV[1])
  end
end
local function keep_agent()
  if not agent then
    local id = redis.call('HGET', KEYS[6], 'a')
    if not id then return end
    agent = KEYS[8] .. id
  end
  if redis.call('PTTL', agent) < tonumber(ARGV[3]) then
    redis.call('PEXPIRE', agent, ARGV[3])
  end
end
if first then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[6], ARGV[3])
  keep_agent()
  if ARGV[2] ~= '' then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
    redis.call('ZADD', KEYS[3], now_ms() + tonumber(ARGV[4]), ARGV[1])
  end
end
if ARGV[7] ~= '' then
  -- The run waits: nobody executes it (no owner may write it) until it is answered,
  -- cancelled or out of time; its keys live as long as the wait may.
  redis.call('SET', KEYS[2], '', 'PX', ARGV[3])
  redis.call('ZADD', KEYS[3], now_ms() + tonumber(ARGV[7]), ARGV[1])
  -- The answers of its earlier waits stay known, as digests ('e:ID'): the same answer
  -- again is a repeat, another conflicts.
  -- An id's latest answer stands (ids may repeat across waits).
  local digests = {}
  local old = redis.call('HGETALL', KEYS[7])
  for i = 1, #old, 2 do
    if string.sub(old[i], 1, 2) == 'e:' and not digests[old[i]] then
      digests[old[i]] = old[i + 1]
    end
  end
  for i = 1, #old, 2 do
    if string.sub(old[i], 1, 2) == 'c:' and old[i + 1] ~= '' then
      digests['e:' .. string.sub(old[i], 3)] = redis.sha1hex(old[i + 1])
    end
  end
  redis.call('DEL', KEYS[7])
  for field, digest in pairs(digests) do redis.call('HSET', KEYS[7], field, digest) end
  if ARGV[8] ~= '0' then
    redis.call('ZADD', KEYS[9], now_ms() + tonumber(ARGV[7]), ARGV[1])
    if redis.call('PTTL', KEYS[9]) < tonumber(ARGV[3]) then
      redis.call('PEXPIRE', KEYS[9], ARGV[3])
    end
  end
  local pending = {}
  for i = 10, 9 + waits do
    pending[#pending + 1] = 'c:' .. ARGV[i]
    pending[#pending + 1] = ''
  end
  redis.call('HSET', KEYS[7], unpack(pending))
  -- Where the run is counted among its principal's waiting runs: answered or cancelled,
  -- it leaves the count at once (not when a replica next saves it).
  if ARGV[8] ~= '0' then redis.call('HSET', KEYS[7], '!of', KEYS[9]) end
  for _, i in ipairs({1, 4, 5, 6, 7}) do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
  keep_agent()
end
if ended then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
  redis.call('PEXPIRE', KEYS[5], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('DEL', KEYS[6])
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[9], ARGV[1])
  if redis.call('EXISTS', KEYS[7]) == 1 then
    redis.call('HSET', KEYS[7], '!taken', '1')
    redis.call('PEXPIRE', KEYS[7], ARGV[3])
  end
end
return 1
";

/// Renews the leases `ARGV[3..]` (run, token pairs) held under prefix `ARGV[1]` for
/// `ARGV[2]` ms; answers the runs whose lease is lost.
const RENEW: &str = r"
local lapses = now_ms() + tonumber(ARGV[2])
local lost = {}
local stopped = {}
for i = 3, #ARGV, 2 do
  local run, token = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[1], run)
  -- A lease let go (scored 0) stays let go: renewing it would keep the run from the
  -- replicas it was handed to.
  if redis.call('GET', ARGV[1] .. ':owner:' .. run) == token
      and score and tonumber(score) > 0 then
    redis.call('ZADD', KEYS[1], 'XX', lapses, run)
    local stop = redis.call('GET', ARGV[1] .. ':stop:' .. run)
    if stop then
      stopped[#stopped + 1] = run
      stopped[#stopped + 1] = stop
    end
  else
    lost[#lost + 1] = run
  end
end
return {lost, stopped}
";

/// Lets the leases `ARGV[2..]` (run, token pairs) go: they lapse now (scored 0, which
/// says that they were let go).
const RELEASE: &str = r"
for i = 2, #ARGV, 2 do
  local run, token = ARGV[i], ARGV[i + 1]
  if redis.call('GET', ARGV[1] .. ':owner:' .. run) == token then
    redis.call('ZADD', KEYS[1], 'XX', 0, run)
  end
end
return 0
";

/// Lets run `ARGV[2]`'s lease go `ARGV[4]` ms from now when its owner is `ARGV[3]`
/// (`KEYS[1]` the leases, `ARGV[1]` the owner keys' prefix).
const DEFER: &str = r"
if redis.call('GET', ARGV[1] .. ':owner:' .. ARGV[2]) == ARGV[3] then
  redis.call('ZADD', KEYS[1], 'XX', now_ms() + tonumber(ARGV[4]), ARGV[2])
end
return 0
";

/// Runs whose lease lapsed, at most `ARGV[1]`.
const LAPSED: &str = r"
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[1]))
";

/// Of the runs whose lease lapsed (`KEYS[1]` the leases; the first `ARGV[1]` times
/// `ARGV[3]`), at most `ARGV[1]` whose wait (`ARGV[2]` the prefix of keys) is over without
/// all its answers: neither completed nor taken over (out of time, or cancelled).
const LAPSED_WAITS: &str = r"
local most = tonumber(ARGV[1])
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0,
  most * tonumber(ARGV[3]))
local over = {}
for _, run in ipairs(lapsed) do
  local wait = ARGV[2] .. ':wait:' .. run
  if redis.call('EXISTS', wait) == 1 and redis.call('HEXISTS', wait, '!done') == 0
      and redis.call('HEXISTS', wait, '!taken') == 0 then
    over[#over + 1] = run
    if #over >= most then break end
  end
end
return over
";

/// Takes run `ARGV[1]` over for token `ARGV[2]` (lease of `ARGV[3]` ms) when its lease
/// lapsed and its progress is kept; answers the previous owner and whether it let the
/// run go, or nothing.
const TAKE_OVER: &str = r"
local lapses = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lapses then return {} end
local now = now_ms()
if tonumber(lapses) > now then return {} end
if redis.call('EXISTS', KEYS[3]) == 0 then
  -- Nothing to continue from (its keys expired): not a run any more.
  redis.call('ZREM', KEYS[1], ARGV[1])
  return {}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
local previous = redis.call('GET', KEYS[2]) or ''
if previous == '' and redis.call('EXISTS', KEYS[2]) == 0 then
  -- The owner key alone was lost (evicted): made again as long-lived as the progress.
  redis.call('SET', KEYS[2], ARGV[2], 'PX', math.max(redis.call('PTTL', KEYS[3]), 1))
else
  redis.call('SET', KEYS[2], ARGV[2], 'KEEPTTL')
end
local taken = {previous, '0'}
if tonumber(lapses) == 0 then taken[2] = '1' end
-- A run that waited: what it was told (it waits no more), until it saves progress past it.
if redis.call('EXISTS', KEYS[4]) == 1 and redis.call('HEXISTS', KEYS[4], '!past') == 0 then
  local told = redis.call('HGETALL', KEYS[4])
  redis.call('HSET', KEYS[4], '!taken', '1')
  for i = 1, #told do taken[#taken + 1] = told[i] end
end
return taken
";

/// Keeps answers for waiting run `ARGV[1]` (`KEYS[1]` its wait, `KEYS[2]` the leases),
/// unless its wait ran out: `ARGV[2..]` are call id and answer pairs. Answers `{'a', completed, left...}`, `{'n'}`
/// (not waiting), `{'p', id}` (not pending) or `{'c', id}` (answered otherwise before). A
/// call of an earlier wait ('e:ID', its answer's digest) takes the same answer again.
const ANSWER: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return {'n'} end
-- Whether answer `i` is the one an earlier wait received: true, false, or nil when the
-- call is of no earlier wait.
local function earlier(i)
  local digest = redis.call('HGET', KEYS[1], 'e:' .. ARGV[i])
  if not digest then return nil end
  return digest == redis.sha1hex(ARGV[i + 1])
end
-- Out of time (`timeouts.action`) when its lease lapsed: the replica that takes the run
-- over ends it, however soon that is.
local lapses = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '0')
if redis.call('HEXISTS', KEYS[1], '!taken') == 1 or redis.call('HEXISTS', KEYS[1], '!done') == 1
    or redis.call('HEXISTS', KEYS[1], '!cancel') == 1 or (lapses > 0 and lapses <= now_ms()) then
  -- A repeat of answers it received is accepted (cancelled, the run still publishes
  -- them); anything else is late.
  for i = 2, #ARGV, 2 do
    local answer = redis.call('HGET', KEYS[1], 'c:' .. ARGV[i])
    if not answer or answer == '' then
      local same = earlier(i)
      if same == nil then return {'n'} end
      if not same then return {'c', ARGV[i]} end
    elseif answer ~= ARGV[i + 1] then
      return {'c', ARGV[i]}
    end
  end
  return {'a', '0'}
end
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], 'c:' .. ARGV[i]) == 0 and earlier(i) == nil then
    return {'p', ARGV[i]}
  end
end
for i = 2, #ARGV, 2 do
  local answer = redis.call('HGET', KEYS[1], 'c:' .. ARGV[i])
  if (answer and answer ~= '' and answer ~= ARGV[i + 1]) or (not answer and not earlier(i)) then
    return {'c', ARGV[i]}
  end
end
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], 'c:' .. ARGV[i]) == '' then
    redis.call('HSET', KEYS[1], 'c:' .. ARGV[i], ARGV[i + 1])
  end
end
local all = redis.call('HGETALL', KEYS[1])
local answered = {'a', '0'}
for i = 1, #all, 2 do
  if all[i + 1] == '' then answered[#answered + 1] = string.sub(all[i], 3) end
end
if #answered == 2 then
  answered[2] = '1'
  redis.call('HSET', KEYS[1], '!done', '1')
  redis.call('ZADD', KEYS[2], 'XX', 0, ARGV[1])
  local of = redis.call('HGET', KEYS[1], '!of')
  if of then redis.call('ZREM', of, ARGV[1]) end
end
return answered
";

/// Cancels waiting run `ARGV[1]` (`KEYS[1]` its wait, `KEYS[2]` the leases): 1 when it
/// waited.
const CANCEL_WAITING: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], '!taken') == 1
    or redis.call('HEXISTS', KEYS[1], '!cancel') == 1 then
  return 0
end
redis.call('HSET', KEYS[1], '!cancel', '1')
redis.call('ZADD', KEYS[2], 'XX', 0, ARGV[1])
local of = redis.call('HGET', KEYS[1], '!of')
if of then redis.call('ZREM', of, ARGV[1]) end
return 1
";

/// A call of one of the scripts: its keys and arguments are written once, into the
/// command that goes to Redis (redis-rs's `ScriptInvocation` copies each into a buffer of
/// its own, then all into the command, for every call). Redis that lost the script
/// (restarted, flushed) is given it again, and the call repeated.
struct ScriptCall {
    script: &'static redis::Script,
    command: redis::Cmd,
    /// Keys still to come before the arguments.
    keys_left: usize,
    /// Whether more keys came than the script was told.
    overflow: bool,
}

impl ScriptCall {
    /// A call of `script` with `keys` keys, given first by [`ScriptCall::key`].
    fn new(script: &'static redis::Script, keys: usize) -> Self {
        Self::with_room(script, keys, 0, 0)
    }

    /// [`ScriptCall::new`], with room made for `args` keys and arguments of `bytes` in
    /// all.
    fn with_room(script: &'static redis::Script, keys: usize, args: usize, bytes: usize) -> Self {
        let mut command = redis::Cmd::with_capacity(args + 3, bytes + 64);
        command.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        Self {
            script,
            command,
            keys_left: keys,
            overflow: false,
        }
    }

    fn key(&mut self, key: impl redis::ToRedisArgs) -> &mut Self {
        debug_assert!(self.keys_left > 0, "more keys than the script was told");
        self.overflow |= self.keys_left == 0;
        self.keys_left = self.keys_left.saturating_sub(1);
        self.command.arg(key);
        self
    }

    fn arg(&mut self, arg: impl redis::ToRedisArgs) -> &mut Self {
        debug_assert_eq!(self.keys_left, 0, "an argument before the last key");
        self.command.arg(arg);
        self
    }

    /// The next argument, written as it is made.
    fn next_arg(&mut self) -> impl std::io::Write + '_ {
        debug_assert_eq!(self.keys_left, 0, "an argument before the last key");
        redis::RedisWrite::writer_for_next_arg(&mut self.command)
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        connection: &mut ConnectionManager,
    ) -> redis::RedisResult<T> {
        if self.keys_left != 0 || self.overflow {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a script call with other keys than it was told (a bug)",
            )));
        }
        match self.command.query_async(connection).await {
            Err(error)
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                self.script.load_async(connection).await?;
                self.command.query_async(connection).await
            }
            answer => answer,
        }
    }
}

/// The id of event `sequence` in its run's stream: `SEQUENCE-1`.
struct StreamId(u64);

impl redis::ToRedisArgs for StreamId {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        let mut id = Decimal::new(self.0);
        id.append(b"-1");
        out.write_arg(id.as_bytes());
    }
}

/// A field name: `prefix` (`s:`, `m:`) followed by an index.
struct Numbered(&'static str, usize);

impl redis::ToRedisArgs for Numbered {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        let digits = Decimal::new(self.1 as u64);
        let mut name = [0u8; 32];
        let (prefix, digits) = (self.0.as_bytes(), digits.as_bytes());
        let len = prefix.len() + digits.len();
        if len > name.len() {
            out.write_arg_fmt(format_args!("{}{}", self.0, self.1));
            return;
        }
        name[..prefix.len()].copy_from_slice(prefix);
        name[prefix.len()..len].copy_from_slice(digits);
        out.write_arg(&name[..len]);
    }
}

/// A number's decimal digits, made on the stack, with room for two bytes more.
struct Decimal {
    bytes: [u8; 22],
    len: usize,
}

impl Decimal {
    fn new(mut n: u64) -> Self {
        // At most 20 digits, made from the last.
        let mut digits = [0u8; 20];
        let mut start = digits.len();
        loop {
            start -= 1;
            digits[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        let len = digits.len() - start;
        let mut bytes = [0u8; 22];
        bytes[..len].copy_from_slice(&digits[start..]);
        Self { bytes, len }
    }

    /// Appends `suffix` (at most 2 bytes).
    fn append(&mut self, suffix: &[u8]) {
        self.bytes[self.len..self.len + suffix.len()].copy_from_slice(suffix);
        self.len += suffix.len();
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The arguments of a script call, written into one buffer as they are made (rather than
/// into a `String` each), then copied once into the command.
#[derive(Default)]
struct Args {
    data: Vec<u8>,
    /// Where each argument ends in `data`.
    ends: Vec<usize>,
}

impl Args {
    fn push(&mut self, arg: impl redis::ToRedisArgs) {
        arg.write_redis_args(self);
    }

    /// Pushes `value` as JSON; on an error, nothing.
    fn push_json(&mut self, value: &impl serde::Serialize) -> serde_json::Result<()> {
        let start = self.data.len();
        match serde_json::to_writer(&mut self.data, value) {
            Ok(()) => {
                self.ends.push(self.data.len());
                Ok(())
            }
            Err(error) => {
                self.data.truncate(start);
                Err(error)
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let arg = &self.data[start..end];
            start = end;
            arg
        })
    }
}

impl redis::RedisWrite for Args {
    fn write_arg(&mut self, arg: &[u8]) {
        self.data.extend_from_slice(arg);
        self.ends.push(self.data.len());
    }

    fn writer_for_next_arg(&mut self) -> impl std::io::Write + '_ {
        /// Ends the argument when dropped.
        struct Next<'a>(&'a mut Args);
        impl Drop for Next<'_> {
            fn drop(&mut self) {
                self.0.ends.push(self.0.data.len());
            }
        }
        impl std::io::Write for Next<'_> {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.data.extend_from_slice(buf);
                Ok(buf.len())
            }

            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        Next(self)
    }
}

impl redis::ToRedisArgs for Args {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.reserve_space_for_args(self.iter().map(<[u8]>::len));
        for arg in self.iter() {
            out.write_arg(arg);
        }
    }
}

/// A script made of the fence's functions and `parts`, hashed once.
fn fenced_script(
    cell: &'static std::sync::OnceLock<redis::Script>,
    parts: &[&str],
) -> &'static redis::Script {
    cell.get_or_init(|| redis::Script::new(&format!("{FENCE}{}", parts.concat())))
}

macro_rules! script {
    ($name:ident, $($part:expr),+) => {
        fn $name() -> &'static redis::Script {
            static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
            fenced_script(&SCRIPT, &[$($part),+])
        }
    };
}

script!(save_script, SESSION_PUSH, SAVE_FENCE, SAVE);
script!(renew_script, RENEW);
script!(release_script, RELEASE);
script!(defer_script, DEFER);
script!(lapsed_script, LAPSED);
script!(lapsed_waits_script, LAPSED_WAITS);
script!(take_over_script, TAKE_OVER);
script!(answer_script, ANSWER);
script!(cancel_waiting_script, CANCEL_WAITING);
script!(engine_insert_script, ENGINE_PRINCIPAL, ENGINE_INSERT);
script!(engine_get_script, ENGINE_PRINCIPAL, ENGINE_GET);
script!(engine_remove_script, ENGINE_PRINCIPAL, ENGINE_REMOVE);

impl RedisRuns {
    fn message_key(&self, session_id: &str, message_id: &str) -> String {
        let mut id = session_id.len().to_string();
        id.reserve(session_id.len() + message_id.len() + 2);
        id.push(':');
        id.push_str(session_id);
        id.push(':');
        id.push_str(message_id);
        self.0.key("msg", &id)
    }

    /// The keys and arguments of [`SAVE`] that write `record` (see [`RunStore::save`]).
    fn save_call(
        &self,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
        turn: Option<&Exchange>,
    ) -> StateResult<SaveCall> {
        let progress = progress.filter(|_| !record.ended());
        // Times to live: set when the record is made (the run's other keys have theirs
        // already) and when it ends; a run cannot outlive the first.
        let mut flags = match (record.steps.is_empty(), record.ended()) {
            (_, true) => "e",
            (true, false) => "f",
            (false, false) => "",
        }
        .to_owned();
        // The save that opens the run (all of it: no steps yet, every message) may write
        // a run that has nothing written yet; any other finds the run gone then (see
        // [`FENCE`]), for it would write a part of it.
        if !record.ended()
            && record.steps.is_empty()
            && from_step == 0
            && progress.is_none_or(|p| p.first_message == 0)
        {
            flags.push('o');
        }
        let agent = progress
            .and_then(|p| p.agent.as_ref())
            .map(|json| (self.0.agent_ids.of(json), json));
        if agent.is_some() {
            flags.push('a');
        }
        if turn.is_some() {
            flags.push('t');
        }
        let wait = progress
            .and_then(|p| p.wait)
            .filter(|_| record.waiting() && !record.pending.is_empty());
        let principal = crate::principal_of(&record.session_id);
        // The anonymous principal's waiting runs are bound by nothing of their own.
        let most_waiting =
            if principal.is_empty() || self.0.limits.max_waiting_per_principal == usize::MAX {
                0
            } else {
                self.0.limits.max_waiting_per_principal.max(1)
            };
        let mut args = Args::default();
        args.push(&record.run_id);
        args.push(&record.owner);
        args.push(millis(self.ttl(record, wait)));
        args.push(millis(self.0.limits.lease));
        args.push(&flags);
        let (identity, head) = split(record);
        // The fields written whole: the record's identity with a save of the whole record
        // (what never changes), its head, then each step from `from_step` on.
        let whole = from_step == 0;
        args.push(usize::from(whole) + 1 + record.steps.len().saturating_sub(from_step));
        args.push(wait.map_or_else(String::new, |w| millis(w).to_string()));
        args.push(most_waiting);
        if wait.is_some() {
            args.push(record.pending.len());
            for pending in &record.pending {
                args.push(&pending.id);
            }
        } else {
            args.push(0);
        }
        if whole {
            args.push("i");
            args.push_json(&identity)
                .map_err(|e| corrupt("run record", &e))?;
        }
        args.push("h");
        args.push_json(&head)
            .map_err(|e| corrupt("run record", &e))?;
        for (index, step) in record.steps.iter().enumerate().skip(from_step) {
            args.push(Numbered("s:", index));
            args.push_json(step).map_err(|e| corrupt("run step", &e))?;
        }
        if let Some(progress) = progress {
            if let Some(spec) = &progress.spec {
                args.push("spec");
                args.push(spec);
            }
            args.push("st");
            args.push(&progress.state);
            for (offset, message) in progress.messages.iter().enumerate() {
                args.push(Numbered("m:", progress.first_message + offset));
                args.push(message);
            }
        }
        if let Some((id, json)) = &agent {
            args.push("a");
            args.push(id);
            args.push(json);
        }
        let session = match turn {
            Some(exchange) => {
                args.push_json(exchange)
                    .map_err(|e| corrupt("exchange", &e))?;
                args.push(self.0.limits.max_exchanges.max(1));
                args.push(millis(self.0.limits.session_ttl));
                args.push(self.0.limits.max_history_bytes.max(1));
                Some(self.0.key("session", &record.session_id))
            }
            None => None,
        };
        Ok(SaveCall {
            keys: [
                self.0.key("run", &record.run_id),
                self.0.key("owner", &record.run_id),
                self.0.key("leases", "all"),
                self.0.key("events", &record.run_id),
                self.message_key(&record.session_id, &record.message_id),
                self.0.key("resume", &record.run_id),
                self.0.key("wait", &record.run_id),
                self.0.key("agent", agent.as_ref().map_or("", |(id, _)| id)),
                self.0.key("waiting:of", principal),
            ],
            session,
            args,
        })
    }

    /// `publisher`, when it writes to this store's Redis (then a checkpoint writes its
    /// events and the record in one script).
    fn ours<'a>(&self, publisher: &'a dyn RunPublisher) -> Option<&'a RedisPublisher> {
        publisher
            .as_any()
            .and_then(|any| any.downcast_ref::<RedisPublisher>())
            .filter(|p| Arc::ptr_eq(&p.core.shared, &self.0))
    }

    fn ttl(&self, record: &RunRecord, wait: Option<Duration>) -> Duration {
        if record.ended() {
            self.0.limits.run_retention
        } else {
            // A waiting run's keys outlive its wait, then what is left of its run.
            RUNNING_TTL + wait.unwrap_or_default() + self.0.limits.run_retention
        }
    }
}

#[async_trait]
impl RunStore for RedisRuns {
    async fn claim(
        &self,
        session_id: &str,
        message_id: &str,
        run_id: &str,
        replacing: Option<&str>,
    ) -> StateResult<Claim> {
        let holder: String = ScriptCall::new(claim_script(), 1)
            .key(self.message_key(session_id, message_id))
            .arg(run_id)
            .arg(replacing.unwrap_or(""))
            .arg(millis(RUNNING_TTL + self.0.limits.run_retention))
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(if holder.is_empty() {
            Claim::Claimed
        } else {
            Claim::Taken(holder)
        })
    }

    async fn holder(&self, session_id: &str, message_id: &str) -> StateResult<Option<String>> {
        redis::cmd("GET")
            .arg(self.message_key(session_id, message_id))
            .query_async(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))
    }

    async fn save(
        &self,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> StateResult<()> {
        self.save_call(record, from_step, progress, None)?
            .write(&self.0, &record.run_id)
            .await
    }

    async fn checkpoint(
        &self,
        publisher: &dyn RunPublisher,
        events: Vec<RunEvent>,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> Result<(), CheckpointError> {
        let Some(publisher) = self.ours(publisher) else {
            return checkpoint_apart(self, publisher, events, record, from_step, progress).await;
        };
        match self.save_call(record, from_step, progress, None) {
            Ok(save) => publisher.checkpoint(events, save).await,
            // A record that cannot be encoded does not keep its events from the log.
            Err(error) => {
                publisher
                    .publish(events)
                    .await
                    .map_err(CheckpointError::Events)?;
                Err(CheckpointError::Record(error))
            }
        }
    }

    async fn end(
        &self,
        publisher: &dyn RunPublisher,
        events: Vec<RunEvent>,
        record: &RunRecord,
        from_step: usize,
        (sessions, turn): (&dyn SessionStore, &mut Option<Arc<Exchange>>),
    ) -> Result<(), CheckpointError> {
        let ours = self.ours(publisher);
        let same_sessions = sessions
            .as_any()
            .and_then(|any| any.downcast_ref::<RedisSessions>())
            .is_some_and(|s| Arc::ptr_eq(&s.0, &self.0));
        let (Some(publisher), true, Some(exchange)) = (ours, same_sessions, turn.as_ref()) else {
            return end_apart(self, publisher, events, record, from_step, (sessions, turn)).await;
        };
        match self.save_call(record, from_step, None, Some(exchange)) {
            Ok(save) => {
                publisher.checkpoint(events, save).await?;
                *turn = None;
                Ok(())
            }
            // Nothing can be written with the turn: the end goes as any, and the turn is
            // kept apart.
            Err(_) => end_apart(self, publisher, events, record, from_step, (sessions, turn)).await,
        }
    }

    async fn load(&self, run_id: &str) -> StateResult<Option<RunRecord>> {
        let fields: HashMap<String, String> = self
            .0
            .connection()
            .hgetall(self.0.key("run", run_id))
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        let Some(head) = fields.get("h") else {
            return Ok(None);
        };
        let mut record = joined(fields.get("i").map(String::as_str), head)
            .map_err(|e| corrupt("run record", &e))?;
        let mut steps: Vec<(usize, StepRecord)> = Vec::with_capacity(fields.len());
        for (name, json) in &fields {
            if let Some(index) = name.strip_prefix("s:").and_then(|i| i.parse().ok()) {
                let step = serde_json::from_str(json).map_err(|e| corrupt("run step", &e))?;
                steps.push((index, step));
            }
        }
        steps.sort_by_key(|(index, _)| *index);
        record.steps = steps.into_iter().map(|(_, step)| step).collect();
        if record.waiting() {
            let told: HashMap<String, String> = self
                .0
                .connection()
                .hgetall(self.0.key("wait", run_id))
                .await
                .map_err(|e| self.0.unavailable(&e))?;
            for call in &mut record.pending {
                call.answered = told
                    .get(&format!("c:{}", call.id))
                    .is_some_and(|answer| !answer.is_empty());
            }
        }
        Ok(Some(record))
    }

    async fn answer(&self, run_id: &str, answers: &[(String, String)]) -> StateResult<Answered> {
        let mut script = ScriptCall::new(answer_script(), 2);
        script
            .key(self.0.key("wait", run_id))
            .key(self.0.key("leases", "all"))
            .arg(run_id);
        for (id, answer) in answers {
            script.arg(id).arg(answer);
        }
        let reply: Vec<String> = script
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(match reply.as_slice() {
            [kind, completed, left @ ..] if kind == "a" => Answered::Accepted {
                left: left.to_vec(),
                completed: completed == "1",
            },
            [kind, id] if kind == "p" => Answered::NotPending(id.clone()),
            [kind, id] if kind == "c" => Answered::Conflict(id.clone()),
            _ => Answered::NotWaiting,
        })
    }

    async fn cancel_waiting(&self, run_id: &str) -> StateResult<bool> {
        let cancelled: u8 = ScriptCall::new(cancel_waiting_script(), 2)
            .key(self.0.key("wait", run_id))
            .key(self.0.key("leases", "all"))
            .arg(run_id)
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(cancelled == 1)
    }

    fn lease_renewer(self: Arc<Self>) -> StateResult<Box<dyn LeaseRenewer>> {
        // A renewal answered after the lease is too late anyway: the next one is sent.
        let config = connection_config(self.0.limits.lease.min(RESPONSE_TIMEOUT));
        let connection = ConnectionManager::new_lazy_with_config(self.0.client.clone(), config)
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(Box::new(RedisRenewer {
            shared: self.0.clone(),
            connection,
        }))
    }

    async fn release(&self, leases: &[Lease]) -> StateResult<()> {
        if leases.is_empty() {
            return Ok(());
        }
        let mut script = ScriptCall::new(release_script(), 1);
        script.key(self.0.key("leases", "all")).arg(&self.0.prefix);
        for lease in leases {
            script.arg(&lease.run_id).arg(&lease.token);
        }
        let _: i64 = script
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(())
    }

    async fn defer(&self, lease: &Lease, by: Duration) -> StateResult<()> {
        let _: i64 = ScriptCall::new(defer_script(), 1)
            .key(self.0.key("leases", "all"))
            .arg(&self.0.prefix)
            .arg(&lease.run_id)
            .arg(&lease.token)
            .arg(millis(by))
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(())
    }

    async fn lapsed(&self, limit: usize) -> StateResult<Vec<String>> {
        ScriptCall::new(lapsed_script(), 1)
            .key(self.0.key("leases", "all"))
            .arg(limit)
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))
    }

    async fn lapsed_waits(&self, limit: usize) -> StateResult<Vec<String>> {
        ScriptCall::new(lapsed_waits_script(), 1)
            .key(self.0.key("leases", "all"))
            .arg(limit)
            .arg(&self.0.prefix)
            .arg(crate::runs::LAPSED_WAITS_SCAN)
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))
    }

    async fn take_over(&self, run_id: &str, token: &str) -> StateResult<Option<Resumable>> {
        let taken: Vec<String> = ScriptCall::new(take_over_script(), 4)
            .key(self.0.key("leases", "all"))
            .key(self.0.key("owner", run_id))
            .key(self.0.key("resume", run_id))
            .key(self.0.key("wait", run_id))
            .arg(run_id)
            .arg(token)
            .arg(millis(self.0.limits.lease))
            .invoke(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        let [previous_owner, handed_over, told @ ..] = taken.as_slice() else {
            return Ok(None);
        };
        let waited = (!told.is_empty()).then(|| {
            let mut waited = Answers::default();
            for pair in told.chunks_exact(2) {
                match (pair[0].strip_prefix("c:"), pair[1].as_str()) {
                    (Some(_), "") => {}
                    (Some(id), answer) => {
                        waited.answers.insert(id.to_owned(), answer.to_owned());
                    }
                    (None, _) if pair[0] == "!cancel" => waited.cancelled = true,
                    (None, _) => {}
                }
            }
            waited
        });
        let (fields, stop): (HashMap<String, String>, Option<String>) = redis::pipe()
            .hgetall(self.0.key("resume", run_id))
            .get(self.0.key("stop", run_id))
            .query_async(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        let Some(mut record) = self.load(run_id).await? else {
            return Ok(None);
        };
        token.clone_into(&mut record.owner);
        let agent: Option<String> = match fields.get("a") {
            Some(id) => self
                .0
                .connection()
                .get(self.0.key("agent", id))
                .await
                .map_err(|e| self.0.unavailable(&e))?,
            None => None,
        };
        let (Some(spec), Some(state)) = (fields.get("spec"), fields.get("st")) else {
            return Err(corrupt("run progress", &"the spec or the state is missing"));
        };
        let mut messages: Vec<(usize, &String)> = fields
            .iter()
            .filter_map(|(name, json)| {
                let index = name.strip_prefix("m:")?.parse().ok()?;
                Some((index, json))
            })
            .collect();
        messages.sort_by_key(|(index, _)| *index);
        Ok(Some(Resumable {
            record,
            spec: spec.clone(),
            agent: agent.unwrap_or_default(),
            state: state.clone(),
            messages: messages.into_iter().map(|(_, m)| m.clone()).collect(),
            previous_owner: previous_owner.clone(),
            handed_over: handed_over == "1",
            waited,
            stop: stop.as_deref().and_then(StopReason::from_name),
        }))
    }

    async fn request_stop(&self, run_id: &str, reason: StopReason) -> StateResult<()> {
        let channel = lock(&self.0.listeners).stop_channel.clone();
        // Kept as long as a running run's keys, for a replica that takes the run over
        // after its owner died without seeing the request.
        let _: () = redis::pipe()
            .set_ex(
                self.0.key("stop", run_id),
                reason.as_str(),
                (RUNNING_TTL + self.0.limits.run_retention).as_secs(),
            )
            .ignore()
            .publish(channel, format!("{} {run_id}", reason.as_str()))
            .ignore()
            .query_async(&mut self.0.connection())
            .await
            .map_err(|e| self.0.unavailable(&e))?;
        Ok(())
    }

    async fn stop_requests(&self) -> StateResult<StopRequests> {
        let (receiver, channel, first) = {
            let mut listeners = lock(&self.0.listeners);
            let first = listeners.stops.is_none();
            let sender = listeners
                .stops
                .get_or_insert_with(|| broadcast::channel(1024).0);
            (sender.subscribe(), listeners.stop_channel.clone(), first)
        };
        if first {
            // Subscribed once per process; the connection subscribes again by itself
            // after a reconnect. Until Redis answers, keep trying in the background.
            let mut subscriptions = self.0.subscriptions.clone();
            let listeners = self.0.listeners.clone();
            tokio::spawn(async move {
                let mut wait = Duration::from_millis(100);
                loop {
                    if lock(&listeners).stops_subscribed {
                        return;
                    }
                    match subscriptions.subscribe(&channel).await {
                        Ok(()) => {
                            lock(&listeners).stops_subscribed = true;
                            info!("subscribed to stop requests");
                            return;
                        }
                        Err(error) => {
                            warn!(%error, "cannot subscribe to stop requests yet");
                            tokio::time::sleep(wait).await;
                            wait = (wait * 2).min(Duration::from_secs(5));
                        }
                    }
                }
            });
        }
        Ok(crate::runs::stop_stream(receiver))
    }
}

struct RedisBus(Arc<Shared>);

fn bus_error(shared: &Shared, error: &redis::RedisError) -> BusError {
    BusError::Unavailable(shared.unavailable(error).to_string())
}

/// The sequence number of a stream entry id (`SEQ-0`).
fn sequence_of(id: &str) -> u64 {
    id.split('-')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

type Entries = Vec<(String, Vec<Vec<u8>>)>;

/// The last event of the log at `key`, if it has any.
async fn last_event(shared: &Shared, key: &str) -> Result<Option<Arc<RunEvent>>, BusError> {
    let last: Entries = redis::cmd("XREVRANGE")
        .arg(key)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut shared.connection())
        .await
        .map_err(|e| bus_error(shared, &e))?;
    Ok(decode(last)?.pop())
}

fn decode(entries: Entries) -> Result<Vec<Arc<RunEvent>>, BusError> {
    entries
        .into_iter()
        .map(|(id, fields)| {
            let json = fields.get(1).ok_or_else(|| {
                BusError::Unavailable(format!("event {id} in Redis has no payload"))
            })?;
            let mut event: RunEvent = serde_json::from_slice(json)
                .map_err(|e| BusError::Unavailable(format!("event {id} in Redis: {e}")))?;
            event.sequence = sequence_of(&id);
            Ok(Arc::new(event))
        })
        .collect()
}

#[async_trait]
impl EventBus for RedisBus {
    /// Opens a run's log without asking Redis: an id this replica holds is refused here
    /// (its copy of the log); one another replica holds, by the new run's first write
    /// when both have owners, as every run of replicas sharing Redis has (the fence finds
    /// the run another's, [`FENCE`]). Run ids are the server's, a new one for each run it
    /// claims: a round trip per run to look for a clash would cost every run for none.
    async fn open(&self, run_id: &str, owner: &str) -> Result<Box<dyn RunPublisher>, BusError> {
        let local = self.0.local.open(run_id, owner).await?;
        Ok(Box::new(RedisPublisher::new(
            self.0.clone(),
            run_id,
            owner,
            1,
            Some(local),
        )))
    }

    async fn resume(&self, run_id: &str, owner: &str, after: u64) -> Result<Resumed, BusError> {
        let key = self.0.key("events", run_id);
        let mut tail = Vec::new();
        let mut cursor = after;
        loop {
            let entries: Entries = redis::cmd("XRANGE")
                .arg(&key)
                .arg(format!("{}-0", cursor.saturating_add(1)))
                .arg("+")
                .arg("COUNT")
                .arg(READ_BATCH)
                .query_async(&mut self.0.connection())
                .await
                .map_err(|e| bus_error(&self.0, &e))?;
            let events = decode(entries)?;
            let Some(last) = events.last() else { break };
            cursor = last.sequence;
            tail.extend(events);
        }
        let mut ended = tail.iter().any(|e| e.done);
        if tail.is_empty() {
            // Nothing after `after`: the log must still hold it.
            match last_event(&self.0, &key).await? {
                Some(last) => {
                    cursor = cursor.max(last.sequence);
                    ended = last.done;
                }
                None => return Err(BusError::UnknownRun(run_id.to_owned())),
            }
        }
        // Readers here read Redis: this replica's copy would miss the log's beginning.
        let publisher = RedisPublisher::new(self.0.clone(), run_id, owner, cursor + 1, None);
        {
            let mut state = publisher.core.state();
            state.expiring = true;
            // A log that holds its `done` has ended: dropped unused (the run is not
            // continued), its publisher must not end it a second time.
            state.done = ended;
        }
        Ok(Resumed {
            tail,
            publisher: Box::new(publisher),
        })
    }

    async fn subscribe(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, BusError> {
        if let Ok(local) = self.0.local.subscribe(run_id, after_sequence).await {
            return Ok(self.then_shared(run_id, local));
        }
        self.shared_log(run_id, after_sequence).await
    }
}

/// A reader of this replica's copy of a run's log, then of the shared log from where the
/// copy stopped (see [`RedisBus::then_shared`]).
struct ThenShared {
    bus: RedisBus,
    run_id: String,
    source: Source,
}

enum Source {
    Local(EventStream),
    /// The shared log being opened after the copy stopped.
    Opening(std::pin::Pin<Box<dyn Future<Output = Result<EventStream, BusError>> + Send>>),
    Shared(EventStream),
    Done,
}

impl futures_util::Stream for ThenShared {
    type Item = Result<Arc<RunEvent>, BusError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            match &mut this.source {
                Source::Local(local) => match std::task::ready!(local.as_mut().poll_next(cx)) {
                    Some(Err(BusError::Moved { after })) => {
                        let bus = RedisBus(this.bus.0.clone());
                        let run_id = this.run_id.clone();
                        this.source = Source::Opening(Box::pin(async move {
                            bus.shared_log(&run_id, after).await
                        }));
                    }
                    None => {
                        this.source = Source::Done;
                        return Poll::Ready(None);
                    }
                    item => return Poll::Ready(item),
                },
                Source::Opening(opening) => match std::task::ready!(opening.as_mut().poll(cx)) {
                    Ok(shared) => this.source = Source::Shared(shared),
                    Err(error) => {
                        this.source = Source::Done;
                        return Poll::Ready(Some(Err(error)));
                    }
                },
                Source::Shared(shared) => {
                    let item = std::task::ready!(shared.as_mut().poll_next(cx));
                    if item.is_none() {
                        this.source = Source::Done;
                    }
                    return Poll::Ready(item);
                }
                Source::Done => return Poll::Ready(None),
            }
        }
    }
}

impl RedisBus {
    /// Follows this replica's copy of a run's log, then, when the run goes on elsewhere
    /// (it waited and another replica continues it, or another replica took it over),
    /// the shared log from where the copy stopped: a reader here never misses the rest.
    fn then_shared(&self, run_id: &str, local: EventStream) -> EventStream {
        Box::pin(ThenShared {
            bus: RedisBus(self.0.clone()),
            run_id: run_id.to_owned(),
            source: Source::Local(local),
        })
    }

    /// Follows the shared log of `run_id` from `after_sequence`.
    async fn shared_log(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, BusError> {
        let key = self.0.key("events", run_id);
        let Some(last) = last_event(&self.0, &key).await? else {
            return Err(BusError::UnknownRun(run_id.to_owned()));
        };
        let follow = Follow::start(&self.0, &key).await;
        let reader = RedisReader {
            shared: self.0.clone(),
            run_id: run_id.to_owned(),
            key,
            cursor: after_sequence,
            batch: Vec::new(),
            finished: false,
            owes_done: !last.done,
            end: last.done.then_some(last.sequence),
            follow,
        };
        Ok(Box::pin(futures_util::stream::unfold(
            reader,
            RedisReader::next,
        )))
    }
}

/// How long text deltas (and events published soon) may wait to be written together: a
/// model streams a token at a time, and one write per token would cost Redis a command
/// per token.
const DELTA_LINGER: Duration = Duration::from_millis(10);
/// After the flusher's write of a publisher's events failed, it tries again after this
/// wait, doubled each time up to the most.
const FLUSH_RETRY_FIRST: Duration = Duration::from_millis(100);
const FLUSH_RETRY_MOST: Duration = Duration::from_secs(2);
/// Writes the flusher tries for one batch (about a minute in all); the run's own next
/// write tries again after that.
const FLUSH_RETRIES: usize = 32;
/// Deltas buffered at most before they are written at once.
const DELTA_BUFFER: usize = 128;

/// Whether the publish may write (see [`FENCE`]; never an opening save).
const PUBLISH_FENCE: &str = r"
local allowed = may_write(KEYS[3], KEYS[2], ARGV[2], false, nil, nil)
if allowed ~= 1 then return allowed end
";

/// Writes events once [`PUBLISH_FENCE`] let it: `KEYS[1]` the log, `KEYS[2]` the run's
/// owner, `KEYS[3]` its record; `ARGV`: run, owner, bound of the log, time to live (0:
/// unchanged), last sequence, then id and event of each entry.
const PUBLISH: &str = r"
for i = 6, #ARGV, 2 do
  redis.call('XADD', KEYS[1], 'MAXLEN', '=', ARGV[3], ARGV[i], 'e', ARGV[i + 1])
end
if ARGV[4] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
redis.call('PUBLISH', KEYS[1], ARGV[5])
return 1
";

script!(publish_script, PUBLISH_FENCE, PUBLISH);

/// A checkpoint in one call: the events of [`PUBLISH`], then the record of [`SAVE`], both
/// or neither (one fence). `KEYS`: the publish's 3 then the save's; `ARGV[1]`: how many
/// arguments the publish has, then its arguments, then the save's.
fn checkpoint_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| {
        redis::Script::new(&format!(
            "{FENCE}{SESSION_PUSH}
local function publish(KEYS, ARGV)
{PUBLISH}
end
local function save(KEYS, ARGV)
{SAVE}
end
local published = tonumber(ARGV[1])
local publish_keys, publish_args, save_keys, save_args = {{}}, {{}}, {{}}, {{}}
for i = 1, #KEYS do
  if i <= 3 then publish_keys[i] = KEYS[i] else save_keys[i - 3] = KEYS[i] end
end
for i = 2, #ARGV do
  if i <= published + 1 then publish_args[i - 1] = ARGV[i] else save_args[i - published - 1] = ARGV[i] end
end
local allowed = may_write(save_keys[1], save_keys[2], save_args[2], string.find(save_args[5], 'o', 1, true), save_keys[5], save_args[1])
if allowed ~= 1 then return allowed end
allowed = may_wait(save_args[1], save_keys[9], save_args[7], save_args[8])
if allowed ~= 1 then return allowed end
publish(publish_keys, publish_args)
return save(save_keys, save_args)
"
        ))
    })
}

/// What of a run's record never changes once the run is made (field `i` of its hash,
/// written with the saves of the whole record).
#[derive(serde::Serialize)]
struct RecordIdentity<'a> {
    run_id: &'a str,
    engine_id: &'a str,
    session_id: &'a str,
    message_id: &'a str,
    query: &'a str,
    create_time: SystemTime,
}

/// The rest of a run's record but its steps (field `h`, written with every save).
#[derive(serde::Serialize)]
struct RecordHead<'a> {
    status: RunStatus,
    stop_reason: Option<StopReason>,
    final_answer: &'a str,
    usage: TokenUsage,
    error: Option<&'a RunError>,
    last_sequence: u64,
    update_time: SystemTime,
    abandoned: bool,
    owner: &'a str,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pending: &'a [agentrt_events::PendingCall],
}

/// A record's identity and head: each of its fields is in one of them (or is its steps,
/// kept apart), which the compiler checks.
fn split(record: &RunRecord) -> (RecordIdentity<'_>, RecordHead<'_>) {
    let RunRecord {
        run_id,
        engine_id,
        session_id,
        message_id,
        query,
        status,
        stop_reason,
        steps: _,
        final_answer,
        usage,
        error,
        last_sequence,
        create_time,
        update_time,
        abandoned,
        owner,
        pending,
    } = record;
    (
        RecordIdentity {
            run_id,
            engine_id,
            session_id,
            message_id,
            query,
            create_time: *create_time,
        },
        RecordHead {
            status: *status,
            stop_reason: *stop_reason,
            final_answer,
            usage: *usage,
            error: error.as_ref(),
            last_sequence: *last_sequence,
            update_time: *update_time,
            abandoned: *abandoned,
            owner,
            pending,
        },
    )
}

/// A record (without its steps) from its identity and head as [`split`] wrote them (or
/// from a head that holds the whole record, as records were once kept).
fn joined(identity: Option<&str>, head: &str) -> serde_json::Result<RunRecord> {
    let mut fields: serde_json::Map<String, serde_json::Value> = serde_json::from_str(head)?;
    if let Some(identity) = identity {
        let identity: serde_json::Map<String, serde_json::Value> = serde_json::from_str(identity)?;
        fields.extend(identity);
    }
    serde_json::from_value(serde_json::Value::Object(fields))
}

/// The keys and arguments of a [`SAVE`].
struct SaveCall {
    keys: [String; 9],
    /// The session's history, with a turn to keep.
    session: Option<String>,
    args: Args,
}

impl SaveCall {
    fn keys(&self) -> impl Iterator<Item = &String> {
        self.keys.iter().chain(&self.session)
    }
}

impl SaveCall {
    /// Runs the save alone (with no events to go with it).
    async fn write(self, shared: &Shared, run_id: &str) -> StateResult<()> {
        let mut script = ScriptCall::new(save_script(), self.keys().count());
        for key in self.keys() {
            script.key(key);
        }
        let written: u8 = script
            .arg(&self.args)
            .invoke(&mut shared.connection())
            .await
            .map_err(|e| shared.unavailable(&e))?;
        if written == OVER_WAITING_BUDGET {
            return Err(shared.waiting_budget());
        }
        if refused(written, run_id) {
            return Err(StateError::Fenced(run_id.to_owned()));
        }
        Ok(())
    }
}

/// The answer of a save refused as the run would begin to wait past its principal's
/// budget of waiting runs (see `may_wait` in [`FENCE`]).
const OVER_WAITING_BUDGET: u8 = 3;

impl Shared {
    fn waiting_budget(&self) -> StateError {
        StateError::OverBudget {
            budget: "runs.max_waiting_per_principal",
            message: format!(
                "this principal has {} runs waiting for answers, its most; answer or cancel \
                 some",
                self.limits.max_waiting_per_principal
            ),
        }
    }
}

/// Whether the answer of a fenced write (see [`FENCE`]) refused it: 0, another replica
/// has the run; 2, the run is gone from Redis, which is logged (its writer then
/// stops it as it stops a run another replica took, and its readers find it unknown).
fn refused(written: u8, run_id: &str) -> bool {
    if written == 2 {
        warn!(
            %run_id,
            "the run is gone from Redis (restarted empty, failed over to an empty replica, \
             or its keys evicted): it stops here, and its readers are told it is not found"
        );
    }
    written != 1
}

/// Writes the events publishers let wait, once they have waited [`DELTA_LINGER`]: one
/// task for all the runs of a replica, rather than a task and a timer per run.
#[derive(Default)]
struct Flusher {
    /// Publishers with events waiting, in the order their time comes (with stale entries
    /// of publishers whose events were written before their time).
    due: Mutex<VecDeque<(tokio::time::Instant, Weak<PublisherCore>)>>,
    /// Wakes the task when the first publisher is queued.
    wake: tokio::sync::Notify,
    started: std::sync::OnceLock<()>,
}

/// How long the flusher's task waits for work before it looks whether its Redis is still
/// used.
const FLUSHER_IDLE: Duration = Duration::from_secs(1);

impl Flusher {
    /// Has `core`'s buffered events written in [`DELTA_LINGER`], unless events buffered
    /// before them wait already (then they go out together, sooner).
    fn schedule(self: &Arc<Self>, core: &Arc<PublisherCore>) {
        let at = tokio::time::Instant::now() + DELTA_LINGER;
        {
            let mut state = core.state();
            if state.due.is_some() {
                return;
            }
            state.due = Some(at);
        }
        let first = {
            let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
            due.push_back((at, Arc::downgrade(core)));
            due.len() == 1
        };
        self.started.get_or_init(|| {
            tokio::spawn(Self::run(Arc::downgrade(self)));
        });
        if first {
            self.wake.notify_one();
        }
    }

    /// The task: writes each queued publisher's events when their time comes (those that
    /// a checkpoint or a later publish wrote meanwhile have nothing left to write). It
    /// ends with the connection to Redis.
    async fn run(flusher: Weak<Self>) {
        loop {
            let Some(this) = flusher.upgrade() else {
                return;
            };
            let next = this
                .due
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .front()
                .map(|(at, _)| *at);
            match next {
                None => {
                    let _ = tokio::time::timeout(FLUSHER_IDLE, this.wake.notified()).await;
                    continue;
                }
                Some(at) => tokio::time::sleep_until(at).await,
            }
            let now = tokio::time::Instant::now();
            loop {
                let (at, core) = {
                    let mut due = this.due.lock().unwrap_or_else(PoisonError::into_inner);
                    match due.front() {
                        Some((at, _)) if *at <= now => match due.pop_front() {
                            Some(entry) => entry,
                            None => break,
                        },
                        _ => break,
                    }
                };
                let Some(core) = core.upgrade() else {
                    continue;
                };
                let waiting = {
                    let mut state = core.state();
                    // An entry whose events were written meanwhile is stale: events
                    // buffered since have an entry of their own.
                    if state.due != Some(at) {
                        continue;
                    }
                    state.due = None;
                    !state.buffer.is_empty() && !state.fenced
                };
                if waiting {
                    // Each write on its own: one that waits for Redis holds up no other.
                    tokio::spawn(core.write_until_written());
                }
            }
        }
    }
}

struct PublisherState {
    /// When the flusher writes the events buffered to wait, if any wait.
    due: Option<tokio::time::Instant>,
    /// The sequence the next event gets.
    next: u64,
    /// Whether the `done` event was accepted.
    done: bool,
    /// Events numbered but not yet written, as JSON.
    buffer: Vec<(u64, RunEvent)>,
    /// Whether the log's time to live was set.
    expiring: bool,
    /// Why a background write failed; the next publish reports it.
    failed: Option<BusError>,
    /// Whether the run is another replica's now, or was let go to one: nothing more is
    /// written, and nothing ends the run here.
    fenced: bool,
    /// Whether this replica's copy of the log was let go, its readers sent to Redis,
    /// after a write failed (the copy is fed only what Redis holds, in order).
    local_gone: bool,
}

/// What the publisher and the flusher share.
struct PublisherCore {
    shared: Arc<Shared>,
    key: String,
    run_id: String,
    /// The lease token the run is written with.
    owner: String,
    /// This replica's copy of the log (not kept for a run taken over: it would lack the
    /// log's beginning).
    local: Option<Box<dyn RunPublisher>>,
    state: Mutex<PublisherState>,
    /// Serializes writes, so that they reach Redis in sequence order.
    writer: tokio::sync::Mutex<()>,
}

impl PublisherCore {
    /// The flusher's write of the events a run let wait. After a failure they stay
    /// buffered and are written again after a while (and with the run's next write, if that
    /// comes first), not left for the run's next event, which may be a long model call
    /// away; it stops once they were written, the run was fenced or let its publisher go,
    /// or after [`FLUSH_RETRIES`] tries.
    async fn write_until_written(self: Arc<Self>) {
        let mut wait = FLUSH_RETRY_FIRST;
        for _ in 0..FLUSH_RETRIES {
            let error = match self.write().await {
                Ok(()) | Err(BusError::Fenced(_)) => return,
                Err(error) => error,
            };
            debug!(run_id = %self.run_id, %error, ?wait, "events waiting to be written could not be; trying again");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(FLUSH_RETRY_MOST);
            let state = self.state();
            // Written meanwhile, due to be anyway, or let go by its run (this task holds
            // the last reference).
            if state.buffer.is_empty()
                || state.fenced
                || state.due.is_some()
                || Arc::strong_count(&self) == 1
            {
                return;
            }
        }
    }

    fn state(&self) -> MutexGuard<'_, PublisherState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Numbers `events` and buffers them; true when they may wait for the flusher (text
    /// deltas only, or anything but the end when `soon`, and not too many).
    fn buffer(&self, events: Vec<RunEvent>, soon: bool) -> bool {
        let may_wait = soon || events.iter().all(|e| e.data.is_none() && !e.done);
        let mut state = self.state();
        // After a failed write its events are still buffered: they go first, now.
        let retry = state.failed.take().is_some();
        for event in events {
            if state.done {
                break;
            }
            let sequence = state.next;
            state.next += 1;
            state.done = event.done;
            state.buffer.push((sequence, event));
        }
        // The first batch is written at once: it makes the log exist for readers.
        !retry && state.expiring && may_wait && !state.done && state.buffer.len() < DELTA_BUFFER
    }

    /// Writes what is buffered, in one script (whole or not at all), then gives it to
    /// this replica's copy of the log: readers here see only what Redis holds, so a
    /// replica that lost the run never shows them events its new owner does not have.
    async fn write(&self) -> Result<(), BusError> {
        self.write_with(None).await.map_err(|error| match error {
            CheckpointError::Events(error) | CheckpointError::EventsAfterRecord(error) => error,
            CheckpointError::Record(error) | CheckpointError::Turn(error) => error.into(),
        })
    }

    /// [`PublisherCore::write`], with `save` (the run's record) in the same script when
    /// given.
    /// Writes `events` (none, with a save) and `save`, in one script; the log's last
    /// sequence is then `last`. Redis's answer: 1 written, 0 fenced, 2 gone (see [`FENCE`]),
    /// 3 over the principal's budget of waiting runs (nothing written).
    async fn invoke(
        &self,
        events: &[(u64, RunEvent)],
        save: Option<&SaveCall>,
        ttl: u64,
        last: u64,
    ) -> Result<Result<u8, redis::RedisError>, CheckpointError> {
        // Room for the keys and arguments, an event's taking about 400 bytes.
        let (args, bytes) = (12 + 2 * events.len(), 400 * events.len() + 256);
        let mut script = match save {
            Some(save) => ScriptCall::with_room(
                checkpoint_script(),
                3 + save.keys().count(),
                args + save.keys().count() + save.args.ends.len(),
                bytes + save.keys().map(String::len).sum::<usize>() + save.args.data.len(),
            ),
            None => ScriptCall::with_room(publish_script(), 3, args, bytes),
        };
        script
            .key(&self.key)
            .key(self.shared.key("owner", &self.run_id))
            .key(self.shared.key("run", &self.run_id));
        if let Some(save) = save {
            for key in save.keys() {
                script.key(key);
            }
            // The publish's arguments: 5, then 2 per event.
            script.arg(5 + 2 * events.len());
        }
        script
            .arg(&self.run_id)
            .arg(&self.owner)
            .arg(self.shared.limits.events_per_run.max(1))
            .arg(ttl)
            .arg(last);
        for (sequence, event) in events {
            script.arg(StreamId(*sequence));
            // Encoded into the command itself.
            serde_json::to_writer(script.next_arg(), event).map_err(|e| {
                CheckpointError::Events(BusError::Unavailable(format!(
                    "cannot encode an event: {e}"
                )))
            })?;
        }
        if let Some(save) = save {
            script.arg(&save.args);
        }
        Ok(script.invoke(&mut self.shared.connection()).await)
    }

    async fn write_with(&self, save: Option<SaveCall>) -> Result<(), CheckpointError> {
        let _writing = self.writer.lock().await;
        let (batch, set_ttl) = {
            let mut state = self.state();
            let batch = std::mem::take(&mut state.buffer);
            // Nothing waits for the flusher any more.
            state.due = None;
            let ended = batch.last().is_some_and(|(_, event)| event.done);
            let set_ttl = !state.expiring || ended;
            state.expiring = true;
            (batch, set_ttl.then_some(ended))
        };
        // A caller may give up on the write part way (a run stopped or timed out while it
        // wrote): the batch then goes back to the buffer, first, for the next write, which
        // finds what of it Redis holds already (below). Lost instead, it would never reach
        // this replica's copy of the log, which would number the run's later events
        // otherwise than Redis.
        let mut pending = Unwritten {
            core: self,
            batch: Some(batch),
            set_ttl: set_ttl.is_some(),
        };
        let batch: &[(u64, RunEvent)] = pending.batch.as_deref().unwrap_or_default();
        let Some((last, _)) = batch.last() else {
            return match save {
                Some(save) => save
                    .write(&self.shared, &self.run_id)
                    .await
                    .map_err(CheckpointError::Record),
                None => Ok(()),
            };
        };
        let last = *last;
        let ttl = set_ttl.map_or(0, |ended| {
            millis(if ended {
                self.shared.limits.run_retention
            } else {
                RUNNING_TTL + self.shared.limits.run_retention
            })
        });
        let mut written = match self.invoke(batch, save.as_ref(), ttl, last).await {
            Ok(written) => written,
            Err(error) => {
                // An event that cannot be encoded fails its batch for good (as it would
                // again).
                pending.batch = None;
                return Err(error);
            }
        };
        // Events of the batch that are in the log already: a write that timed out (Redis
        // hung) may have run all the same, and its events are not written twice (Redis
        // refuses the repeated ids, and would for ever).
        let mut logged = 0;
        if let Err(error) = &written
            && error
                .to_string()
                .contains("equal or smaller than the target stream top item")
            && let Ok(Some(top)) = last_event(&self.shared, &self.key).await
        {
            logged = batch
                .iter()
                .take_while(|(sequence, _)| *sequence <= top.sequence)
                .count();
            if logged > 0 {
                debug!(run_id = %self.run_id, logged, "events of a write that timed out were written");
                written = match (&batch[logged..], &save) {
                    ([], None) => Ok(1),
                    (rest, save) => self.invoke(rest, save.as_ref(), ttl, last).await?,
                };
            }
        }
        // Whatever happens now happens whole: the write is no longer given up part way.
        let batch = pending.batch.take().unwrap_or_default();
        if written
            .as_ref()
            .is_ok_and(|&written| written == OVER_WAITING_BUDGET)
        {
            // Nothing was written: the events wait, with their numbers, for the run's
            // next write (its end, as it cannot wait), which sets the log's time to live
            // if this one was to.
            let mut state = self.state();
            if set_ttl.is_some() {
                state.expiring = false;
            }
            // The wait was refused, so the run does not wait: its ACTION_REQUIRED would have
            // the client act for a run that cannot be answered. It goes, and the events
            // after it are numbered again, so that the log stays gapless (none was shown).
            let mut unwritten: Vec<(u64, RunEvent)> = batch.into_iter().skip(logged).collect();
            if let Some(&(first, _)) = unwritten.first() {
                unwritten.retain(|(_, event)| event.kind != EventKind::ActionRequired);
                let buffered = std::mem::take(&mut state.buffer);
                let mut next = first;
                for (_, event) in unwritten.into_iter().chain(buffered) {
                    state.buffer.push((next, event));
                    next += 1;
                }
                state.next = next;
            }
            return Err(CheckpointError::Record(self.shared.waiting_budget()));
        }
        if written
            .as_ref()
            .is_ok_and(|&written| refused(written, &self.run_id))
        {
            // Another replica has the run, or nobody has any more (it is gone from Redis):
            // these events are not this replica's to write.
            self.state().fenced = true;
            return Err(CheckpointError::Events(BusError::Fenced(
                self.run_id.clone(),
            )));
        }
        if let Err(e) = written {
            let error = bus_error(&self.shared, &e);
            // Readers see an event only once Redis holds it: should another replica take
            // the run over meanwhile, it numbers its events from what Redis holds. So the
            // readers of this replica's copy go on reading from Redis (which tells them
            // when it cannot be reached), and the copy is fed no more.
            let release = {
                let mut state = self.state();
                !std::mem::replace(&mut state.local_gone, true)
            };
            if release && let Some(local) = &self.local {
                let _ = local.release().await;
            }
            // Kept, with its numbers, for the next publish to write again: a batch is
            // written whole or not at all, so nothing is lost or numbered twice.
            let mut state = self.state();
            state.buffer.splice(0..0, batch.into_iter().skip(logged));
            state.failed = Some(error.clone());
            return Err(CheckpointError::Events(error));
        }
        let local_gone = self.state().local_gone;
        if let Some(local) = self.local.as_ref().filter(|_| !local_gone) {
            // The copy numbers the same events the same way: it gets all of them, in order.
            local
                .publish(batch.into_iter().map(|(_, event)| event).collect())
                .await
                .map_err(CheckpointError::Events)?;
        }
        Ok(())
    }
}

/// A batch taken from a publisher's buffer for a write, put back first if the write is
/// dropped before it is done.
struct Unwritten<'a> {
    core: &'a PublisherCore,
    batch: Option<Vec<(u64, RunEvent)>>,
    /// Whether the write was to set the log's time to live (set again by the next one).
    set_ttl: bool,
}

impl Drop for Unwritten<'_> {
    fn drop(&mut self) {
        let Some(batch) = self.batch.take() else {
            return;
        };
        let mut state = self.core.state();
        state.buffer.splice(0..0, batch);
        if self.set_ttl {
            state.expiring = false;
        }
    }
}

struct RedisPublisher {
    core: Arc<PublisherCore>,
}

impl RedisPublisher {
    /// A publisher of `run_id` for `owner`, numbering from `next`, keeping a copy of the
    /// log here when given one.
    fn new(
        shared: Arc<Shared>,
        run_id: &str,
        owner: &str,
        next: u64,
        local: Option<Box<dyn RunPublisher>>,
    ) -> Self {
        let core = Arc::new(PublisherCore {
            key: shared.key("events", run_id),
            shared,
            run_id: run_id.to_owned(),
            owner: owner.to_owned(),
            local,
            state: Mutex::new(PublisherState {
                due: None,
                next,
                done: false,
                buffer: Vec::new(),
                expiring: false,
                failed: None,
                fenced: false,
                local_gone: false,
            }),
            writer: tokio::sync::Mutex::new(()),
        });
        Self { core }
    }

    /// Publishes `events` and writes `save` (the run's record) in one script.
    async fn checkpoint(
        &self,
        events: Vec<RunEvent>,
        save: SaveCall,
    ) -> Result<(), CheckpointError> {
        if self.core.state().fenced {
            return Err(CheckpointError::Events(BusError::Fenced(
                self.core.run_id.clone(),
            )));
        }
        self.core.buffer(events, false);
        let written = self.core.write_with(Some(save)).await;
        if let Err(
            CheckpointError::Events(BusError::Fenced(_))
            | CheckpointError::Record(StateError::Fenced(_)),
        ) = &written
        {
            self.let_go().await;
        }
        written
    }

    /// Ends the readers of this replica's copy: the run goes on elsewhere.
    async fn let_go(&self) {
        self.core.state().fenced = true;
        if let Some(local) = &self.core.local {
            let _ = local.release().await;
        }
    }
}

#[async_trait]
impl RunPublisher for RedisPublisher {
    async fn publish(&self, events: Vec<RunEvent>) -> Result<(), BusError> {
        self.publish_now_or_soon(events, false).await
    }

    async fn publish_soon(&self, events: Vec<RunEvent>) -> Result<(), BusError> {
        self.publish_now_or_soon(events, true).await
    }

    async fn release(&self) -> Result<(), BusError> {
        let written = self.core.write().await;
        self.let_go().await;
        written
    }

    fn as_any(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        Some(self)
    }
}

impl RedisPublisher {
    /// Publishes `events`, or buffers them for the flusher when they may wait
    /// (see [`PublisherCore::buffer`]).
    async fn publish_now_or_soon(&self, events: Vec<RunEvent>, soon: bool) -> Result<(), BusError> {
        if self.core.state().fenced {
            return Err(BusError::Fenced(self.core.run_id.clone()));
        }
        let deferred = self.core.buffer(events, soon);
        if deferred {
            self.core.shared.flusher.schedule(&self.core);
            return Ok(());
        }
        let written = self.core.write().await;
        if let Err(BusError::Fenced(_)) = &written {
            self.let_go().await;
        }
        written
    }
}

impl Drop for RedisPublisher {
    /// A run whose publisher goes away without a `done` event (a bug, or a panic in the
    /// run) still ends, so that no reader waits forever: what is buffered and the end are
    /// written in the background. A run let go, or taken by another replica, is left to
    /// its new owner.
    fn drop(&mut self) {
        let ended = {
            let state = self.core.state();
            state.fenced || (state.done && state.buffer.is_empty())
        };
        if ended {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let core = self.core.clone();
        runtime.spawn(async move {
            if !core.state().done {
                core.buffer(vec![RunEvent::ended_without_end()], false);
            }
            if let Err(error) = core.write().await {
                warn!(%error, "cannot end a run whose publisher went away");
            }
        });
    }
}

/// This process's interest in one run's notices, shared by its readers here.
/// Gates of [`Shared::subscribing`].
const SUBSCRIBE_STRIPES: usize = 64;

/// The gate of `channel` among `gates`.
fn gate_of<'a>(gates: &'a [tokio::sync::Mutex<()>], channel: &str) -> &'a tokio::sync::Mutex<()> {
    let hash = channel.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    &gates[(hash % gates.len() as u64) as usize]
}

struct Follow {
    listeners: Arc<Mutex<Listeners>>,
    subscribing: Arc<[tokio::sync::Mutex<()>]>,
    subscriptions: ConnectionManager,
    channel: String,
    notices: watch::Receiver<u64>,
}

impl Follow {
    /// Follows `channel`; the first follower here subscribes (waiting a moment for Redis
    /// to confirm, so that the notices of the next events are not missed).
    async fn start(shared: &Arc<Shared>, channel: &str) -> Self {
        let (notices, first) = {
            let mut listeners = lock(&shared.listeners);
            let followed = listeners
                .events
                .entry(channel.to_owned())
                .or_insert_with(|| Followed {
                    notices: watch::Sender::new(0),
                    readers: 0,
                    confirmed: false,
                });
            followed.readers += 1;
            (followed.notices.subscribe(), followed.readers == 1)
        };
        let follow = Self {
            listeners: shared.listeners.clone(),
            subscribing: shared.subscribing.clone(),
            subscriptions: shared.subscriptions.clone(),
            channel: channel.to_owned(),
            notices,
        };
        if first {
            let _gate = gate_of(&shared.subscribing, channel).lock().await;
            let mut subscriptions = shared.subscriptions.clone();
            match tokio::time::timeout(COMMAND_TIMEOUT, subscriptions.subscribe(channel)).await {
                Ok(Ok(())) => {}
                // The reader polls meanwhile.
                Ok(Err(error)) => debug!(%error, "cannot subscribe to a run's notices"),
                Err(_) => debug!("subscribing to a run's notices takes long"),
            }
        }
        follow
    }
}

impl Follow {
    /// How long to wait for a notice before looking anyway.
    fn poll(&self) -> Duration {
        let listeners = lock(&self.listeners);
        match listeners.events.get(&self.channel) {
            Some(followed) if followed.confirmed => READ_POLL_FOLLOWED,
            _ => READ_POLL,
        }
    }
}

impl Drop for Follow {
    fn drop(&mut self) {
        let last = {
            let mut listeners = lock(&self.listeners);
            match listeners.events.get_mut(&self.channel) {
                Some(followed) if followed.readers > 1 => {
                    followed.readers -= 1;
                    false
                }
                Some(_) => {
                    listeners.events.remove(&self.channel);
                    true
                }
                None => false,
            }
        };
        if last && let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut subscriptions = self.subscriptions.clone();
            let channel = std::mem::take(&mut self.channel);
            let listeners = self.listeners.clone();
            let gates = self.subscribing.clone();
            runtime.spawn(async move {
                // Until Redis confirms: the connection subscribes again, on reconnecting,
                // to every channel it was not confirmed to have left, and a channel left
                // while Redis was down would be followed by nobody for good.
                let mut pause = Duration::from_millis(100);
                loop {
                    {
                        let _gate = gate_of(&gates, &channel).lock().await;
                        // A reader that came meanwhile follows the channel again (and
                        // subscribed, or waits to): it stays subscribed.
                        if lock(&listeners).events.contains_key(&channel)
                            || subscriptions.unsubscribe(&channel).await.is_ok()
                        {
                            return;
                        }
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            });
        }
    }
}

struct RedisReader {
    shared: Arc<Shared>,
    run_id: String,
    key: String,
    cursor: u64,
    batch: Vec<Arc<RunEvent>>,
    finished: bool,
    /// Whether the reader attached while the run ran and has not been given its `done`.
    owes_done: bool,
    /// The sequence of the `done` of a run that had ended when the reader attached.
    end: Option<u64>,
    follow: Follow,
}

impl RedisReader {
    async fn read(&mut self) -> Result<bool, BusError> {
        loop {
            let wanted = self.cursor.saturating_add(1);
            let entries: Entries = redis::cmd("XRANGE")
                .arg(&self.key)
                .arg(format!("{wanted}-0"))
                .arg("+")
                .arg("COUNT")
                .arg(READ_BATCH)
                .query_async(&mut self.shared.connection())
                .await
                .map_err(|e| bus_error(&self.shared, &e))?;
            let mut events = decode(entries)?;
            if let Some(first) = events.first()
                && first.sequence > wanted
            {
                return Err(BusError::Lagged {
                    from: wanted,
                    to: first.sequence - 1,
                });
            }
            if events.is_empty() && self.owes_done {
                // Nothing after the cursor. A reader attached beyond the end of a running
                // run still gets its `done` event once the run has ended.
                match last_event(&self.shared, &self.key).await? {
                    // Written between the two reads: read them in order.
                    Some(last) if last.sequence > self.cursor => continue,
                    Some(last) if last.done => events.push(last),
                    Some(_) => {}
                    None => return Err(BusError::UnknownRun(self.run_id.clone())),
                }
            }
            events.reverse();
            let found = !events.is_empty();
            self.batch = events;
            return Ok(found);
        }
    }

    async fn next(mut self) -> Option<(Result<Arc<RunEvent>, BusError>, Self)> {
        loop {
            if let Some(event) = self.batch.pop() {
                self.cursor = self.cursor.max(event.sequence);
                if event.done {
                    self.owes_done = false;
                    self.finished = true;
                    self.batch.clear();
                }
                return Some((Ok(event), self));
            }
            if self.finished {
                return None;
            }
            self.follow.notices.borrow_and_update();
            match self.read().await {
                Ok(true) => continue,
                // The log of an ended run, gone before it was read to its `done`: it
                // expired (`runs.retention`) under a slow reader, which is told so rather
                // than ending as if the run had ended there.
                Ok(false) if self.end.is_some_and(|end| self.cursor < end) => {
                    self.finished = true;
                    return Some((Err(BusError::UnknownRun(self.run_id.clone())), self));
                }
                Ok(false) if !self.owes_done => return None,
                Ok(false) => {
                    let poll = self.follow.poll();
                    let notices = &mut self.follow.notices;
                    let _ = tokio::time::timeout(poll, notices.changed()).await;
                }
                Err(error) => {
                    self.finished = true;
                    return Some((Err(error), self));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use redis::ToRedisArgs;

    use super::{Args, Numbered, PARSED_BYTES, Parsed, StoredEngine, StreamId, joined, split};
    use crate::{RunError, RunRecord, RunStatus, StopReason, TokenUsage};

    /// A record kept as its identity and head reads back whole, every field set; and a
    /// record kept whole in its head (as records once were) reads back too.
    #[test]
    fn a_record_kept_in_two_parts_reads_back_whole() {
        let mut record = RunRecord::new("r", "e", "s", "m", "q");
        record.status = RunStatus::Failed;
        record.stop_reason = Some(StopReason::ModelError);
        record.final_answer = "a".into();
        record.usage = TokenUsage {
            prompt_tokens: 1,
            completion_tokens: 2,
            estimated: true,
        };
        record.error = Some(RunError {
            code: "C".into(),
            message: "m".into(),
            category: "model",
            retryable: true,
        });
        record.last_sequence = 9;
        record.update_time = record.create_time + std::time::Duration::from_secs(3);
        record.abandoned = true;
        record.owner = "o.1".into();
        record.pending = vec![agentrt_events::PendingCall {
            id: "c".into(),
            name: "n".into(),
            arguments: agentrt_events::JsonText::new(&serde_json::json!({"x": 1})),
            action: agentrt_events::Action::Approve,
            answered: false,
        }];
        let (identity, head) = split(&record);
        let (identity, head) = (
            serde_json::to_string(&identity).unwrap(),
            serde_json::to_string(&head).unwrap(),
        );
        assert!(
            !head.contains("\"q\""),
            "the head leaves the query out: {head}"
        );
        assert_eq!(joined(Some(&identity), &head).unwrap(), record);
        let whole = serde_json::to_string(&record).unwrap();
        assert_eq!(joined(None, &whole).unwrap(), record);
    }

    #[test]
    fn stream_ids_are_the_sequence_then_one() {
        for (sequence, id) in [
            (0, "0-1"),
            (7, "7-1"),
            (10, "10-1"),
            (u64::MAX, "18446744073709551615-1"),
        ] {
            assert_eq!(
                StreamId(sequence).to_redis_args(),
                vec![id.as_bytes().to_vec()]
            );
        }
    }

    #[test]
    fn engines_kept_parsed_stay_within_their_bytes() {
        let mut parsed = Parsed::default();
        let engine = |id: &str| StoredEngine {
            id: id.into(),
            session_id: "s".into(),
            config: std::sync::Arc::new(agentrt_test_support::conformance::sample_config()),
            tools: std::sync::Arc::new([]),
            create_time: std::time::SystemTime::UNIX_EPOCH,
            expire_time: std::time::SystemTime::UNIX_EPOCH,
        };
        // Each counts for an eighth of the bound (its JSON twice, and its id).
        let json = |id: &str| "x".repeat((PARSED_BYTES / 8 - id.len()) / 2);
        for n in 10..30 {
            let id = n.to_string();
            parsed.keep(json(&id), &engine(&id));
            assert!(parsed.bytes <= PARSED_BYTES);
            assert_eq!(
                parsed.bytes,
                parsed
                    .engines
                    .iter()
                    .map(|(id, (json, _))| Parsed::size(id, json))
                    .sum::<usize>()
            );
        }
        assert_eq!(parsed.engines.len(), 8);
        // Kept again, an engine replaces its JSON; too big, it is not kept.
        parsed.keep("y".repeat(PARSED_BYTES / 8), &engine("29"));
        assert!(!parsed.engines.contains_key("29"));
        assert_eq!(parsed.engines.len(), 7);
        for n in 10..30 {
            parsed.remove(&n.to_string());
        }
        assert_eq!((parsed.engines.len(), parsed.bytes), (0, 0));
    }

    #[test]
    fn arguments_made_in_one_buffer_read_back_one_by_one() {
        let mut args = Args::default();
        args.push("h");
        args.push(Numbered("s:", 0));
        args.push(Numbered("m:", 1234));
        args.push(7_u64);
        args.push("");
        args.push_json(&serde_json::json!({"a": [1, "two"]}))
            .unwrap();
        let expected: Vec<Vec<u8>> = ["h", "s:0", "m:1234", "7", "", r#"{"a":[1,"two"]}"#]
            .iter()
            .map(|arg| arg.as_bytes().to_vec())
            .collect();
        assert_eq!(args.to_redis_args(), expected);
    }
}
