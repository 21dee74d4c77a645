//! Admission before hello: bounds on connections that have not said who they are, and a
//! rate-limited log for refusals. Used by the accept loops and both connection handlers.

use std::sync::Arc;
use std::time::Duration;

/// Most connections one peer process may have open before hello.
pub const MAX_PENDING_HELLO_PER_PEER: usize = 16;
/// Most connections before hello on one socket, from all peers together.
pub const MAX_PENDING_HELLO: usize = 256;

/// Counts connections that have not said hello yet, per peer process and in all.
#[derive(Default)]
pub struct HelloGate {
    state: std::sync::Mutex<(usize, std::collections::HashMap<i32, usize>)>,
}

impl HelloGate {
    /// A place for one more connection from `pid`, or `None` over a bound.
    pub fn admit(self: &Arc<Self>, pid: Option<i32>) -> Option<PendingHello> {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = pid.unwrap_or(-1);
        let per_peer = s.1.get(&key).copied().unwrap_or(0);
        if s.0 >= MAX_PENDING_HELLO || per_peer >= MAX_PENDING_HELLO_PER_PEER {
            return None;
        }
        s.0 += 1;
        *s.1.entry(key).or_default() += 1;
        Some(PendingHello {
            gate: self.clone(),
            key,
        })
    }
}

/// A connection's place at the [`HelloGate`]: given back when dropped (after hello, or when the
/// connection ends first).
pub struct PendingHello {
    gate: Arc<HelloGate>,
    key: i32,
}

impl Drop for PendingHello {
    fn drop(&mut self) {
        let mut s = self
            .gate
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.0 = s.0.saturating_sub(1);
        if let Some(n) = s.1.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                s.1.remove(&self.key);
            }
        }
    }
}

/// A warning at most once a second, saying how many were held back.
#[derive(Default)]
pub struct RateLimitedLog {
    last: Option<std::time::Instant>,
    held: u64,
}

impl RateLimitedLog {
    pub const fn new() -> Self {
        Self {
            last: None,
            held: 0,
        }
    }

    /// Counts one event, and calls `log` with the count since the last call when a second has
    /// passed.
    pub fn note(&mut self, log: impl FnOnce(u64)) {
        self.held += 1;
        if self
            .last
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            log(self.held);
            self.held = 0;
            self.last = Some(std::time::Instant::now());
        }
    }
}
