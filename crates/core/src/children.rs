//! The process groups of child processes this process started and runs (stdio MCP
//! servers), so that an exit that skips the orderly shutdown (a second SIGTERM) stops them
//! too rather than leave them running: each group is killed before such an exit.

use std::{
    collections::BTreeSet,
    sync::{Mutex, PoisonError},
};

static GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Notes process group `id` as this process's to stop.
pub fn started(id: i32) {
    GROUPS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(id);
}

/// Forgets process group `id` (stopped, or gone).
pub fn ended(id: i32) {
    GROUPS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&id);
}

/// The process groups to stop, taken (each is stopped once).
pub fn take() -> Vec<i32> {
    std::mem::take(&mut *GROUPS.lock().unwrap_or_else(PoisonError::into_inner))
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn groups_are_noted_forgotten_and_taken_once() {
        super::started(7);
        super::started(9);
        super::ended(7);
        assert!(super::take().contains(&9));
        assert!(!super::take().contains(&9));
    }
}
