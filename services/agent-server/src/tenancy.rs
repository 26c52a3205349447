//! Which principal owns what.
//!
//! An engine belongs to the principal that created it, and its session is kept under a
//! key that names that principal (`PRINCIPAL/SESSION`; the bare session id for the
//! anonymous principal of a server without authentication). Everything a run writes is
//! keyed by that session (its record, its idempotency key, the session's history), so
//! two principals that choose one session id get two sessions, and a run's owner is the
//! principal its session key names. Clients only ever see their own session id.
//!
//! Another principal's engine or run is answered as unknown (`NOT_FOUND`, the same as an
//! id that does not exist); an operator principal acts on everyone's.

use agentrt_grpc::security::Principal;

use crate::error::Error;

/// The key the session `session_id` of `owner`'s engines is kept under.
pub fn session_key(owner: &str, session_id: &str) -> String {
    if owner.is_empty() {
        session_id.to_owned()
    } else {
        format!("{owner}/{session_id}")
    }
}

/// The principal that owns the session kept under `key` (principal names and session ids
/// have no `/`).
pub fn owner(key: &str) -> &str {
    key.split_once('/').map_or("", |(owner, _)| owner)
}

/// The session id clients know, of the session kept under `key`.
pub fn client_session(key: &str) -> &str {
    key.split_once('/').map_or(key, |(_, session)| session)
}

/// Whether `caller` may see and act on an engine or run of the session kept under `key`.
pub fn may_act(caller: &Principal, key: &str) -> bool {
    caller.may_act_on(owner(key))
}

/// The owner an engine looked up for `caller` must have: none for an operator, who may
/// act on every principal's (see [`agentrt_state::EngineStore::get`]).
pub fn owner_filter(caller: &Principal) -> Option<&str> {
    (!caller.operator).then_some(&*caller.name)
}

/// `found` when `caller` may act on it, else the error an unknown id gets.
pub fn visible<T>(
    caller: &Principal,
    key: &str,
    found: T,
    unknown: impl FnOnce() -> Error,
) -> Result<T, Error> {
    if may_act(caller, key) {
        Ok(found)
    } else {
        Err(unknown())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(name: &str, operator: bool) -> Principal {
        Principal {
            name: name.into(),
            operator,
        }
    }

    #[test]
    fn session_keys_name_their_owner_and_clients_see_their_own_id() {
        let key = session_key("alice", "chat-1");
        assert_eq!(key, "alice/chat-1");
        assert_eq!((owner(&key), client_session(&key)), ("alice", "chat-1"));
        // Without authentication: the bare id, owned by the anonymous principal.
        assert_eq!(session_key("", "chat-1"), "chat-1");
        assert_eq!((owner("chat-1"), client_session("chat-1")), ("", "chat-1"));
    }

    #[test]
    fn only_the_owner_or_an_operator_may_act() {
        let key = session_key("alice", "chat-1");
        assert!(may_act(&principal("alice", false), &key));
        assert!(!may_act(&principal("bob", false), &key));
        assert!(!may_act(&Principal::default(), &key));
        assert!(may_act(&principal("ops", true), &key));
        assert!(may_act(&Principal::default(), "chat-1"));
        assert!(!may_act(&principal("bob", false), "chat-1"));
    }
}
