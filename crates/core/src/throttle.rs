//! Warnings a client can cause on every call, logged at most once a period: a loop of
//! bad calls cannot flood the log, and the line says how many it stands for.

use std::{
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

/// When a warning may be logged again.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    /// When one was last logged, and how many were left out since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    /// At most one warning every `every`.
    pub const fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some` with how many were left out since the last one when a warning is to be
    /// logged now; `None` (counted) when it is left out.
    pub fn take(&self) -> Option<u64> {
        self.take_at(Instant::now())
    }

    fn take_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (last, left_out) = &mut *state;
        if last.is_some_and(|at| now.duration_since(at) < self.every) {
            *left_out += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(left_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_a_period_saying_how_many_were_left_out() {
        let throttle = Throttle::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(throttle.take_at(start), Some(0));
        for n in 1..=5 {
            assert_eq!(throttle.take_at(start + Duration::from_secs(n)), None);
        }
        assert_eq!(throttle.take_at(start + Duration::from_secs(10)), Some(5));
        assert_eq!(throttle.take_at(start + Duration::from_secs(11)), None);
    }
}
