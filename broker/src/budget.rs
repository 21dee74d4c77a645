//! Budgets: "not more than this" as a kernel outcome (`denied/budget_exhausted`).
//!
//! The config's `[[budgets]]` tables, each on one tool or one provider's namespace, with any of
//! three limits: calls per turn and bytes returned per turn (counted in the turn's own
//! [`TurnUse`], which lives with the turn), and calls per minute per principal (a token bucket
//! per principal, held here, across turns). The kernel asks [`Budgets::take`] after the policy
//! permitted a call (and a person approved it, where one must), right before it runs: a call
//! refused before that point uses nothing. A call that runs has used its call, whatever its
//! outcome; its bytes are added when its answer is made ([`Budgets::add_bytes`], counted from
//! the answer that is sent).
//!
//! Bytes are known only when a call ends, so a byte limit lets one call of a turn run at a time
//! ([`Budgets::settle`], a gate per limit held from the check until the bytes are added): a call
//! is admitted only when the bytes of every call before it are counted, and at most one call,
//! the one that crosses the limit, ends a turn past it, however many are sent at once.
//!
//! With no budget configured nothing here is reached: the kernel tests
//! [`Budgets::is_empty`] first (no lock, no allocation on the call path).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sharedos_proto::ipc::BudgetLeft;

use crate::config::BudgetConfig;
use crate::lock;

/// Bucket entries kept before full buckets are dropped (a full bucket is the same as none).
const MAX_BUCKETS: usize = 16_384;

/// The three kinds of limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    CallsPerTurn,
    CallsPerMinute,
    BytesPerTurn,
}

impl Kind {
    fn key(self) -> &'static str {
        match self {
            Kind::CallsPerTurn => "calls_per_turn",
            Kind::CallsPerMinute => "calls_per_minute_per_principal",
            Kind::BytesPerTurn => "bytes_per_turn",
        }
    }
}

/// One limit of one budget table.
#[derive(Debug)]
struct Limit {
    /// Its place in a turn's [`TurnUse`] and in the bucket table.
    slot: usize,
    kind: Kind,
    limit: u64,
    /// `files.read calls_per_turn=3`: how refusals, `turn list` and `catalog` name it.
    label: String,
    /// A tool's full name, or a namespace.
    tool: Option<String>,
    namespace: Option<String>,
}

impl Limit {
    fn applies(&self, tool: &str, namespace: &str) -> bool {
        match (&self.tool, &self.namespace) {
            (Some(t), _) => t == tool,
            (None, Some(ns)) => ns == namespace,
            (None, None) => false,
        }
    }
}

/// A per-principal token bucket: `limit` calls at once, refilled at `limit` per minute.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(self, limit: u64, now: Instant) -> Bucket {
        let rate = limit as f64 / 60.0;
        let tokens = (self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * rate)
            .min(limit as f64);
        Bucket { tokens, at: now }
    }

    /// Time until one whole token is back.
    fn refill_in(self, limit: u64) -> Duration {
        let rate = limit as f64 / 60.0;
        Duration::from_secs_f64(((1.0 - self.tokens).max(0.0) / rate).max(0.0))
    }
}

/// What a turn has used of each per-turn limit, by slot: calls or bytes; and, by slot, the gate
/// a call counting bytes against that limit holds while it runs.
#[derive(Debug, Default)]
pub struct TurnUse {
    used: Mutex<Vec<u64>>,
    gates: Vec<tokio::sync::Semaphore>,
}

impl TurnUse {
    /// Nothing used yet of `slots` limits.
    pub fn new(slots: usize) -> Self {
        Self {
            used: Mutex::new(vec![0; slots]),
            gates: (0..slots).map(|_| tokio::sync::Semaphore::new(1)).collect(),
        }
    }
}

/// Held by a call from its budget check until its bytes are added: no other call counting
/// against the same byte limits of the turn runs meanwhile.
#[derive(Debug, Default)]
pub struct Settled<'a> {
    _held: Vec<tokio::sync::SemaphorePermit<'a>>,
}

/// Every configured limit, and the per-principal buckets.
#[derive(Debug, Default)]
pub struct Budgets {
    limits: Vec<Limit>,
    buckets: Mutex<HashMap<(String, usize), Bucket>>,
}

/// Why a call may not run: the sentence a model can act on (after `denied: <call> — `).
#[derive(Debug, Clone, PartialEq)]
pub struct Exhausted(pub String);

/// The limits a call that may run counts against, to add its bytes to afterwards.
#[derive(Debug, Default)]
pub struct Taken {
    bytes_slots: Vec<usize>,
}

impl Taken {
    /// Does any of the call's budgets count bytes?
    pub fn counts_bytes(&self) -> bool {
        !self.bytes_slots.is_empty()
    }
}

fn label(b: &BudgetConfig, kind: Kind, limit: u64) -> String {
    format!("{} {}={limit}", b.target(), kind.key())
}

impl Budgets {
    /// The limits of the config's `[[budgets]]` tables (already checked at load).
    pub fn new(configs: &[BudgetConfig]) -> Self {
        let mut limits = Vec::new();
        for b in configs {
            for (kind, value) in [
                (Kind::CallsPerTurn, b.calls_per_turn),
                (Kind::CallsPerMinute, b.calls_per_minute_per_principal),
                (Kind::BytesPerTurn, b.bytes_per_turn),
            ] {
                if let Some(limit) = value {
                    limits.push(Limit {
                        slot: limits.len(),
                        kind,
                        limit,
                        label: label(b, kind, limit),
                        tool: b.tool.clone(),
                        namespace: b.namespace.clone(),
                    });
                }
            }
        }
        Self {
            limits,
            buckets: Mutex::default(),
        }
    }

    /// No budget is configured: the kernel skips every step below.
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Slots a turn's [`TurnUse`] needs.
    pub fn slots(&self) -> usize {
        self.limits.len()
    }

    /// Waits until no other call of `turn` counting against the byte limits that apply to
    /// `tool` (of provider `namespace`) is in flight, and holds them until the result is dropped
    /// (after [`add_bytes`](Self::add_bytes)). Gates are taken in slot order, each first come
    /// first served; a tool with no byte limit waits for nothing.
    pub async fn settle<'a>(&self, turn: &'a TurnUse, tool: &str, namespace: &str) -> Settled<'a> {
        let mut held = Vec::new();
        for l in &self.limits {
            if l.kind == Kind::BytesPerTurn
                && l.applies(tool, namespace)
                && let Some(gate) = turn.gates.get(l.slot)
                && let Ok(permit) = gate.acquire().await
            {
                held.push(permit);
            }
        }
        Settled { _held: held }
    }

    /// Does any byte limit apply to `tool` (of provider `namespace`)?
    pub fn counts_bytes(&self, tool: &str, namespace: &str) -> bool {
        self.limits
            .iter()
            .any(|l| l.kind == Kind::BytesPerTurn && l.applies(tool, namespace))
    }

    /// Takes one call from every limit that applies to `tool` (of provider `namespace`), or
    /// takes nothing and says which limit is used up (the first, in config order).
    pub fn take(
        &self,
        turn: &TurnUse,
        principal: &str,
        tool: &str,
        namespace: &str,
    ) -> Result<Taken, Exhausted> {
        let applying: Vec<&Limit> = self
            .limits
            .iter()
            .filter(|l| l.applies(tool, namespace))
            .collect();
        if applying.is_empty() {
            return Ok(Taken::default());
        }
        let now = Instant::now();
        let mut used = lock(&turn.used);
        let mut buckets = applying
            .iter()
            .any(|l| l.kind == Kind::CallsPerMinute)
            .then(|| lock(&self.buckets));
        // Check every limit first: a refused call takes nothing from any.
        for l in &applying {
            let have = used.get(l.slot).copied().unwrap_or(0);
            match l.kind {
                Kind::CallsPerTurn if have >= l.limit => {
                    return Err(Exhausted(format!(
                        "budget \"{}\" exhausted ({have} of {} calls used in this turn); it does not refill in this turn",
                        l.label, l.limit
                    )));
                }
                Kind::BytesPerTurn if have >= l.limit => {
                    return Err(Exhausted(format!(
                        "budget \"{}\" exhausted ({have} bytes of {} returned in this turn); it does not refill in this turn",
                        l.label, l.limit
                    )));
                }
                Kind::CallsPerMinute => {
                    let bucket = buckets
                        .as_ref()
                        .and_then(|b| b.get(&(principal.to_owned(), l.slot)).copied())
                        .map(|b| b.refilled(l.limit, now));
                    if let Some(b) = bucket.filter(|b| b.tokens < 1.0) {
                        let wait = b.refill_in(l.limit);
                        return Err(Exhausted(format!(
                            "budget \"{}\" exhausted for {principal}; it refills one call every {:.1} s, the next in {:.1} s",
                            l.label,
                            60.0 / l.limit as f64,
                            wait.as_secs_f64()
                        )));
                    }
                }
                _ => {}
            }
        }
        let mut taken = Taken::default();
        for l in &applying {
            match l.kind {
                Kind::CallsPerTurn => {
                    if let Some(u) = used.get_mut(l.slot) {
                        *u += 1;
                    }
                }
                Kind::BytesPerTurn => taken.bytes_slots.push(l.slot),
                Kind::CallsPerMinute => {
                    if let Some(buckets) = buckets.as_mut() {
                        if buckets.len() >= MAX_BUCKETS {
                            buckets.retain(|(_, slot), b| {
                                let limit = self.limits.get(*slot).map_or(1, |l| l.limit);
                                b.refilled(limit, now).tokens < limit as f64
                            });
                        }
                        let b = buckets
                            .entry((principal.to_owned(), l.slot))
                            .or_insert(Bucket {
                                tokens: l.limit as f64,
                                at: now,
                            });
                        let mut refilled = b.refilled(l.limit, now);
                        refilled.tokens -= 1.0;
                        *b = refilled;
                    }
                }
            }
        }
        Ok(taken)
    }

    /// Adds the bytes a call returned to the per-turn byte limits it counts against.
    pub fn add_bytes(&self, turn: &TurnUse, taken: &Taken, bytes: u64) {
        let mut used = lock(&turn.used);
        for slot in &taken.bytes_slots {
            if let Some(u) = used.get_mut(*slot) {
                *u = u.saturating_add(bytes);
            }
        }
    }

    /// What is left for one turn (per-turn limits from `turn`, or whole when `None`) and its
    /// principal, of the limits that apply to any of `tools` (`(name, namespace)`).
    pub fn left<'a>(
        &self,
        turn: Option<&TurnUse>,
        principal: &str,
        tools: impl Iterator<Item = (&'a str, &'a str)> + Clone,
    ) -> Vec<BudgetLeft> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        let used: Vec<u64> = turn.map(|t| lock(&t.used).clone()).unwrap_or_default();
        let buckets = lock(&self.buckets);
        self.limits
            .iter()
            .filter(|l| tools.clone().any(|(t, ns)| l.applies(t, ns)))
            .map(|l| {
                let (scope, left, refills) = match l.kind {
                    Kind::CallsPerTurn | Kind::BytesPerTurn => (
                        "turn",
                        l.limit
                            .saturating_sub(used.get(l.slot).copied().unwrap_or(0)),
                        None,
                    ),
                    Kind::CallsPerMinute => {
                        match buckets
                            .get(&(principal.to_owned(), l.slot))
                            .map(|b| b.refilled(l.limit, now))
                        {
                            Some(b) if b.tokens < l.limit as f64 => (
                                "principal",
                                b.tokens.floor() as u64,
                                Some((b.refill_in(l.limit).as_secs_f64() * 10.0).ceil() / 10.0),
                            ),
                            _ => ("principal", l.limit, None),
                        }
                    }
                };
                BudgetLeft {
                    budget: l.label.clone(),
                    scope: scope.into(),
                    limit: l.limit,
                    left,
                    refills_in_seconds: refills.map(|s: f64| if s < 0.1 { 0.1 } else { s }),
                }
            })
            .collect()
    }
}

/// The bytes an answer returns, as budgets count them: the length of the compact JSON text of its
/// `content` blocks and, when present, its `structuredContent`, and of its message (a failure's
/// sentence). Counted without making the text.
pub fn returned_bytes(
    content: &[serde_json::Value],
    structured: Option<&serde_json::Value>,
    message: Option<&str>,
) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    let _ = serde_json::to_writer(&mut n, content);
    if let Some(s) = structured {
        let _ = serde_json::to_writer(&mut n, s);
    }
    n.0 + message.map_or(0, |m| m.len() as u64)
}

#[cfg(test)]
#[allow(clippy::expect_used, clippy::panic, reason = "test code")]
mod tests {
    use super::*;

    fn budget(tool: Option<&str>, ns: Option<&str>) -> BudgetConfig {
        BudgetConfig {
            tool: tool.map(Into::into),
            namespace: ns.map(Into::into),
            calls_per_turn: None,
            calls_per_minute_per_principal: None,
            bytes_per_turn: None,
        }
    }

    #[test]
    fn calls_per_turn_refuse_exactly_the_call_over_the_limit() {
        let b = Budgets::new(&[BudgetConfig {
            calls_per_turn: Some(2),
            ..budget(Some("files.read"), None)
        }]);
        let turn = TurnUse::new(b.slots());
        assert!(b.take(&turn, "alice", "files.read", "files").is_ok());
        assert!(b.take(&turn, "alice", "files.list", "files").is_ok());
        assert!(b.take(&turn, "alice", "files.read", "files").is_ok());
        let Err(Exhausted(why)) = b.take(&turn, "alice", "files.read", "files") else {
            panic!("third read allowed")
        };
        assert!(
            why.contains("\"files.read calls_per_turn=2\"") && why.contains("does not refill"),
            "{why}"
        );
        // Another turn starts whole.
        assert!(
            b.take(&TurnUse::new(b.slots()), "alice", "files.read", "files")
                .is_ok()
        );
    }

    #[test]
    fn a_refused_call_takes_from_no_budget_and_buckets_refill() {
        let b = Budgets::new(&[
            BudgetConfig {
                calls_per_minute_per_principal: Some(600),
                ..budget(None, Some("files"))
            },
            BudgetConfig {
                calls_per_turn: Some(1),
                ..budget(Some("files.read"), None)
            },
        ]);
        let turn = TurnUse::new(b.slots());
        assert!(b.take(&turn, "alice", "files.read", "files").is_ok());
        assert!(b.take(&turn, "alice", "files.read", "files").is_err());
        let left = b.left(Some(&turn), "alice", [("files.read", "files")].into_iter());
        assert_eq!(left[0].left, 599, "{left:?}");
        for _ in 0..599 {
            assert!(b.take(&turn, "alice", "files.list", "files").is_ok());
        }
        let Err(Exhausted(why)) = b.take(&turn, "alice", "files.list", "files") else {
            panic!("bucket not empty")
        };
        assert!(why.contains("refills one call every 0.1 s"), "{why}");
        assert!(
            b.take(&turn, "bob", "files.list", "files").is_ok(),
            "per principal"
        );
        std::thread::sleep(Duration::from_millis(120));
        assert!(b.take(&turn, "alice", "files.list", "files").is_ok());
    }

    #[test]
    fn bytes_count_after_the_call() {
        let b = Budgets::new(&[BudgetConfig {
            bytes_per_turn: Some(10),
            ..budget(None, Some("files"))
        }]);
        let turn = TurnUse::new(b.slots());
        let taken = b.take(&turn, "a", "files.read", "files").expect("first");
        assert!(taken.counts_bytes());
        let content = [serde_json::json!({"type": "text", "text": "hi"})];
        let n = returned_bytes(&content, None, None);
        assert_eq!(
            n,
            serde_json::to_string(&content).expect("ser").len() as u64
        );
        b.add_bytes(&turn, &taken, n);
        assert!(b.take(&turn, "a", "files.read", "files").is_err());
        assert!(b.take(&turn, "a", "other.read", "other").is_ok());
    }
}
