//! Admission before hello: bounds on connections that have not said who they are, and a
//! rate-limited log for refusals. Used by the accept loops and both connection handlers.
//!
//! The places before hello are shared by uid, and by process within a uid: when every place is
//! taken, a newcomer from a uid (or, within the uid holding the most, a process) that holds
//! fewer than the largest holder takes the place of that holder's oldest connection, which is
//! closed. One local user's idle connections therefore cannot keep another user's shims out, nor
//! one process's another's; and a connection that has waited past [`HELLO_IDLE_EVICTABLE`] (a
//! shim says hello at once) gives its place to any newcomer.
//!
//! When the gate is full and no place can be taken that way (e.g. one uid's many processes each
//! holding one place and renewing it before it is idle), a newcomer still gets a place in a small
//! fast lane ([`MAX_FAST_HELLO`]) with a short time to say hello ([`FAST_HELLO_WITHIN`]): a shim
//! sends its hello as soon as it has connected, so it is read and answered long before that, and
//! the lane's places turn over quickly (a full lane gives its oldest place to the newcomer).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// Most connections one peer process may have open before hello.
pub const MAX_PENDING_HELLO_PER_PEER: usize = 16;
/// Most connections before hello on one socket, from all peers together.
pub const MAX_PENDING_HELLO: usize = 256;
/// A connection still silent after this long gives its place to a newcomer when the gate is
/// full (a shim sends its hello as soon as it has connected).
pub const HELLO_IDLE_EVICTABLE: Duration = Duration::from_secs(1);
/// Places beyond [`MAX_PENDING_HELLO`] for newcomers that find the gate full: each must say hello
/// within [`FAST_HELLO_WITHIN`], and a full lane gives its oldest place to the next newcomer.
pub const MAX_FAST_HELLO: usize = 64;
/// The time a connection in the fast lane has to send its whole hello.
pub const FAST_HELLO_WITHIN: Duration = Duration::from_millis(250);

/// One connection waiting for its hello.
struct Entry {
    uid: u32,
    pid: i32,
    since: Instant,
    evict: CancellationToken,
    /// In the fast lane: not counted in the gate's places nor shared by uid.
    fast: bool,
}

#[derive(Default)]
struct State {
    next: u64,
    entries: HashMap<u64, Entry>,
    per_uid: HashMap<u32, usize>,
    per_pid: HashMap<i32, usize>,
    /// Entries in the fast lane.
    fast: usize,
}

impl State {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        decrement(&mut self.per_pid, e.pid);
        if e.fast {
            self.fast -= 1;
        } else {
            decrement(&mut self.per_uid, e.uid);
        }
        Some(e)
    }

    /// The connection to close so that a newcomer from `uid`/`pid` gets a place in a full gate:
    /// the oldest of the largest holder when the newcomer's uid (or, within that uid, its
    /// process) holds at least two fewer, else the oldest connection of all when it has been
    /// silent past [`HELLO_IDLE_EVICTABLE`].
    fn victim(&self, uid: u32, pid: i32, now: Instant) -> Option<u64> {
        let (top_uid, top_n) = self
            .per_uid
            .iter()
            .max_by_key(|(u, n)| (**n, std::cmp::Reverse(**u)))
            .map(|(u, n)| (*u, *n))?;
        let oldest_of = |keep: &dyn Fn(&Entry) -> bool| {
            self.entries
                .iter()
                .filter(|(_, e)| !e.fast && keep(e))
                .min_by_key(|(id, e)| (e.since, **id))
                .map(|(id, _)| *id)
        };
        if top_uid != uid && self.per_uid.get(&uid).copied().unwrap_or(0) + 1 < top_n {
            // Another uid holds more: the largest of its processes gives up its oldest.
            let pid_top = self.top_pid_of(top_uid)?;
            return oldest_of(&|e| e.pid == pid_top);
        }
        if let Some(pid_top) = self.top_pid_of(uid) {
            let held = self.per_pid.get(&pid_top).copied().unwrap_or(0);
            let own = self.per_pid.get(&pid).copied().unwrap_or(0);
            if pid_top != pid && own + 1 < held {
                return oldest_of(&|e| e.pid == pid_top);
            }
        }
        let oldest = oldest_of(&|_| true)?;
        let idle = self
            .entries
            .get(&oldest)
            .is_some_and(|e| now.duration_since(e.since) >= HELLO_IDLE_EVICTABLE);
        idle.then_some(oldest)
    }

    /// The process of `uid` holding the most places.
    /// The fast lane's oldest entry.
    fn oldest_fast(&self) -> Option<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| e.fast)
            .min_by_key(|(id, e)| (e.since, **id))
            .map(|(id, _)| *id)
    }

    fn top_pid_of(&self, uid: u32) -> Option<i32> {
        let mut counts: HashMap<i32, usize> = HashMap::new();
        for e in self.entries.values().filter(|e| !e.fast && e.uid == uid) {
            *counts.entry(e.pid).or_default() += 1;
        }
        counts
            .into_iter()
            .max_by_key(|(p, n)| (*n, std::cmp::Reverse(*p)))
            .map(|(p, _)| p)
    }
}

fn decrement<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: K) {
    if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
}

/// A refused connection is written to the record at most once per peer (uid and pid) and
/// reason per this interval: the line carries how many refusals it stands for, so a flood of
/// refused connections costs the record a few lines, not one per connection.
pub const REFUSAL_RECORD_INTERVAL: Duration = Duration::from_secs(10);
/// Most (peer, reason) pairs whose refusals are held back for their next line; past it, the
/// refusals of new peers are counted under one pair with no pid and no uid.
pub const MAX_REFUSAL_PEERS: usize = 1024;
/// Processes of one uid whose refusals get lines of their own at once: a further process of
/// that uid (a uid forking a process per connection) is counted under one line for the uid
/// (`pid: null`, with `processes`), for as long as that line's refusals keep coming.
pub const MAX_REFUSAL_PIDS_PER_UID: usize = 4;
/// Distinct processes a uid's grouped line counts exactly; past it, `processes` is a lower bound.
pub const MAX_GROUPED_PIDS: usize = 4096;

/// The `reason` of a hello that could not be read: too large, or not a hello; `None` for a
/// connection that ended before it sent one (nothing was refused).
pub fn hello_error_reason(e: &sharedos_ipc::IpcError) -> Option<&'static str> {
    match e {
        sharedos_ipc::IpcError::Closed => None,
        sharedos_ipc::IpcError::Frame(sharedos_proto::frame::FrameError::Oversized { .. }) => {
            Some("hello_too_large")
        }
        _ => Some("not_hello"),
    }
}

/// Which socket's refusals: `bridge_refused` or `control_refused` lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Socket {
    Bridge,
    Control,
}

type PeerReason = (&'static str, Option<u32>, Option<i32>);

/// Refusals held back since their peer's last line.
#[derive(Default)]
struct Tally {
    held: u64,
    last: Option<Instant>,
    /// On a uid's grouped tally: the processes its held refusals came from.
    pids: std::collections::HashSet<i32>,
}

impl Tally {
    fn count(&mut self, pid: Option<i32>) {
        self.held += 1;
        if let Some(p) = pid
            && self.pids.len() < MAX_GROUPED_PIDS
        {
            self.pids.insert(p);
        }
    }

    /// The held refusals, and the processes they came from on a grouped tally, for a line.
    fn take(&mut self) -> (u64, Option<u64>) {
        let pids = std::mem::take(&mut self.pids);
        let processes = (!pids.is_empty()).then_some(pids.len() as u64);
        self.last = Some(Instant::now());
        (std::mem::take(&mut self.held), processes)
    }
}

/// The refused connections of one socket, on record: aggregated per peer and reason, at most
/// one line per [`REFUSAL_RECORD_INTERVAL`] (the first refusal at once, the rest held and
/// written by the next refusal after the interval, by [`HelloGate::flush_refusals`], or when the
/// gate goes at shutdown). A uid's processes past [`MAX_REFUSAL_PIDS_PER_UID`] share one peer
/// (the uid, no pid), so a uid forking a process per connection costs a few lines per interval.
struct Refusals {
    recorder: crate::evidence::record::Recorder,
    socket: Socket,
    tallies: std::sync::Mutex<HashMap<PeerReason, Tally>>,
}

impl Refusals {
    fn note(&self, reason: &'static str, uid: Option<u32>, pid: Option<i32>) {
        let mut t = self
            .tallies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut key = (reason, uid, pid);
        let mut grouped = false;
        if !t.contains_key(&key) && pid.is_some() && uid.is_some() {
            // A uid with more than a few refused processes (or already grouped for this reason)
            // is counted per uid: a process per connection costs a line per interval, not one
            // per process.
            let group = (reason, uid, None);
            let processes = t
                .keys()
                .filter(|(_, u, p)| *u == uid && p.is_some())
                .count();
            if t.contains_key(&group) || processes >= MAX_REFUSAL_PIDS_PER_UID {
                key = group;
                grouped = true;
            }
        }
        if !t.contains_key(&key) && t.len() >= MAX_REFUSAL_PEERS {
            key = (reason, None, None);
            grouped = false;
        }
        let tally = t.entry(key).or_default();
        tally.count(if grouped { pid } else { None });
        if tally
            .last
            .is_none_or(|l| l.elapsed() >= REFUSAL_RECORD_INTERVAL)
        {
            let (n, processes) = tally.take();
            self.write(key, n, processes);
        }
    }

    /// Writes the held refusals whose interval is over (all of them with `all`), and forgets
    /// peers with nothing held whose interval is over.
    fn flush(&self, all: bool) {
        let mut t = self
            .tallies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let due = |l: Option<Instant>| l.is_none_or(|l| l.elapsed() >= REFUSAL_RECORD_INTERVAL);
        let mut written = Vec::new();
        for (key, tally) in t.iter_mut() {
            if tally.held > 0 && (all || due(tally.last)) {
                let (n, processes) = tally.take();
                written.push((*key, n, processes));
            }
        }
        t.retain(|_, tally| tally.held > 0 || !due(tally.last));
        for (key, n, processes) in written {
            self.write(key, n, processes);
        }
    }

    fn write(&self, (reason, uid, pid): PeerReason, count: u64, processes: Option<u64>) {
        use sharedos_proto::record::{ConnectionRefused, Event};
        let line = ConnectionRefused {
            reason: reason.to_owned(),
            pid,
            uid,
            count,
            processes,
            turn: None,
        };
        let event = match self.socket {
            Socket::Bridge => Event::BridgeRefused(line),
            Socket::Control => Event::ControlRefused(line),
        };
        if let Err(e) = self.recorder.append_written(&event) {
            tracing::error!(error = %e, reason, count, "a refused connection could not be recorded");
        }
    }
}

/// Counts connections that have not said hello yet, per uid, per peer process and in all; and,
/// with a record, puts the refused ones on it.
#[derive(Default)]
pub struct HelloGate {
    state: std::sync::Mutex<State>,
    refusals: Option<Refusals>,
}

impl Drop for HelloGate {
    fn drop(&mut self) {
        if let Some(r) = &self.refusals {
            r.flush(true);
        }
    }
}

impl HelloGate {
    /// A gate whose refusals go on record as `bridge_refused` / `control_refused` lines.
    pub fn recorded(recorder: crate::evidence::record::Recorder, socket: Socket) -> Self {
        Self {
            state: std::sync::Mutex::default(),
            refusals: Some(Refusals {
                recorder,
                socket,
                tallies: std::sync::Mutex::default(),
            }),
        }
    }

    /// One refused connection of `uid`/`pid`, for `reason` (see [`Refusals`]).
    pub fn refused(&self, reason: &'static str, uid: Option<u32>, pid: Option<i32>) {
        if let Some(r) = &self.refusals {
            r.note(reason, uid, pid);
        }
    }

    /// Writes the refusals held back whose interval is over (all of them with `all`).
    pub fn flush_refusals(&self, all: bool) {
        if let Some(r) = &self.refusals {
            r.flush(all);
        }
    }

    /// A place for one more connection from `uid`/`pid`, or `None` over a bound. A full gate
    /// makes room by closing another connection when the newcomer's uid or process holds fewer
    /// places than the largest holder (see the module's documentation).
    pub fn admit(self: &Arc<Self>, uid: Option<u32>, pid: Option<i32>) -> Option<PendingHello> {
        self.admit_at(uid, pid, Instant::now())
    }

    fn admit_at(
        self: &Arc<Self>,
        uid: Option<u32>,
        pid: Option<i32>,
        now: Instant,
    ) -> Option<PendingHello> {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Unknown credentials share one key each (a socket pair always has them on Linux).
        let (uid, pid) = (uid.unwrap_or(u32::MAX), pid.unwrap_or(-1));
        if s.per_pid.get(&pid).copied().unwrap_or(0) >= MAX_PENDING_HELLO_PER_PEER {
            return None;
        }
        let mut fast = false;
        if s.entries.len() - s.fast >= MAX_PENDING_HELLO {
            let victim = match s.victim(uid, pid, now) {
                Some(v) => v,
                None => {
                    // The fast lane: a short time to say hello; when full, its oldest place.
                    fast = true;
                    if s.fast >= MAX_FAST_HELLO {
                        s.oldest_fast()?
                    } else {
                        u64::MAX
                    }
                }
            };
            if let Some(e) = s.remove(victim) {
                e.evict.cancel();
            }
        }
        let id = s.next;
        s.next += 1;
        let evict = CancellationToken::new();
        s.entries.insert(
            id,
            Entry {
                uid,
                pid,
                since: now,
                evict: evict.clone(),
                fast,
            },
        );
        if fast {
            s.fast += 1;
        } else {
            *s.per_uid.entry(uid).or_default() += 1;
        }
        *s.per_pid.entry(pid).or_default() += 1;
        Some(PendingHello {
            gate: self.clone(),
            id,
            evict,
            fast,
        })
    }
}

/// A connection's place at the [`HelloGate`]: given back when dropped (after hello, or when the
/// connection ends first), or taken by a newcomer (then [`PendingHello::evicted`] ends and the
/// connection is closed).
pub struct PendingHello {
    gate: Arc<HelloGate>,
    id: u64,
    evict: CancellationToken,
    fast: bool,
}

impl PendingHello {
    /// The time this connection has to send its hello: the socket's `ordinary` time, or at most
    /// [`FAST_HELLO_WITHIN`] for a place in the fast lane.
    pub fn within(&self, ordinary: Duration) -> Duration {
        if self.fast {
            ordinary.min(FAST_HELLO_WITHIN)
        } else {
            ordinary
        }
    }

    /// The gate this place is at (its refusals go on record there).
    pub fn gate(&self) -> Arc<HelloGate> {
        self.gate.clone()
    }

    /// Ends when the place was given to a newcomer: the connection is to be closed.
    pub async fn evicted(&self) {
        self.evict.cancelled().await;
    }
}

impl Drop for PendingHello {
    fn drop(&mut self) {
        let mut s = self
            .gate
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.remove(self.id);
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

/// Why a peer refused at a socket's door was refused, as its `*_refused` record line says it: a
/// brokered upstream (or a process of its lineage), or a uid the socket does not list.
pub fn refusal_reason(pid: Option<i32>) -> &'static str {
    if crate::lineage::from_upstream(pid.and_then(|p| u32::try_from(p).ok())) {
        "upstream_lineage"
    } else {
        "uid_not_listed"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills the gate with `per` places for each of `holders` (uid, pid), all admitted at `at`.
    fn fill(
        gate: &Arc<HelloGate>,
        holders: &[(u32, i32)],
        per: usize,
        at: Instant,
    ) -> Vec<PendingHello> {
        let mut out = Vec::new();
        for &(uid, pid) in holders {
            for _ in 0..per {
                out.push(gate.admit_at(Some(uid), Some(pid), at).expect("a place"));
            }
        }
        out
    }

    fn evicted(places: &[PendingHello]) -> usize {
        places.iter().filter(|p| p.evict.is_cancelled()).count()
    }

    #[test]
    fn one_process_holds_at_most_its_share() {
        let gate = Arc::new(HelloGate::default());
        let now = Instant::now();
        let held = fill(&gate, &[(1000, 7)], MAX_PENDING_HELLO_PER_PEER, now);
        assert!(gate.admit_at(Some(1000), Some(7), now).is_none());
        assert_eq!(evicted(&held), 0);
        assert!(gate.admit_at(Some(1000), Some(8), now).is_some());
    }

    #[test]
    fn a_uid_holding_fewer_takes_the_oldest_place_of_the_largest_uid() {
        let gate = Arc::new(HelloGate::default());
        let t0 = Instant::now();
        // 16 processes of uid 1000 fill the gate (16 x 16 = 256).
        let holders: Vec<(u32, i32)> = (0..16).map(|p| (1000, 100 + p)).collect();
        let held = fill(&gate, &holders, 16, t0);
        assert_eq!(gate.state.lock().unwrap().entries.len(), MAX_PENDING_HELLO);
        let later = t0 + Duration::from_millis(10);
        let newcomer = gate
            .admit_at(Some(2000), Some(500), later)
            .expect("another uid gets in");
        assert!(
            !newcomer.fast,
            "taken from the largest holder, not the fast lane"
        );
        assert_eq!(evicted(&held), 1);
        // The place taken is one of the largest holder's (uid 1000, every process holds 16).
        let s = gate.state.lock().unwrap();
        assert_eq!(s.per_uid.get(&1000), Some(&(MAX_PENDING_HELLO - 1)));
        assert_eq!(s.per_uid.get(&2000), Some(&1));
    }

    #[test]
    fn within_a_uid_a_process_holding_fewer_takes_from_the_largest_process() {
        let gate = Arc::new(HelloGate::default());
        let t0 = Instant::now();
        let holders: Vec<(u32, i32)> = (0..16).map(|p| (1000, 100 + p)).collect();
        let held = fill(&gate, &holders, 16, t0);
        let newcomer = gate
            .admit_at(Some(1000), Some(999), t0 + Duration::from_millis(1))
            .expect("a new process of the same uid gets in");
        assert!(!newcomer.fast);
        assert_eq!(evicted(&held), 1);
        // The oldest place of the process with the most (pid 100, first in, ties by pid).
        assert!(held[0].evict.is_cancelled());
    }

    #[test]
    fn a_place_silent_past_the_idle_time_goes_to_any_newcomer() {
        let gate = Arc::new(HelloGate::default());
        let t0 = Instant::now();
        // 256 processes of one uid with one place each: no holder holds two more than anyone.
        let holders: Vec<(u32, i32)> = (0..256).map(|p| (1000, 100 + p)).collect();
        let held = fill(&gate, &holders, 1, t0);
        let idle = t0 + HELLO_IDLE_EVICTABLE;
        let newcomer = gate
            .admit_at(Some(1000), Some(9999), idle)
            .expect("a place");
        assert!(!newcomer.fast);
        assert_eq!(evicted(&held), 1);
        assert!(held[0].evict.is_cancelled(), "the oldest gave its place");
    }

    #[test]
    fn a_full_gate_with_no_place_to_take_admits_to_the_fast_lane() {
        let gate = Arc::new(HelloGate::default());
        let t0 = Instant::now();
        let holders: Vec<(u32, i32)> = (0..256).map(|p| (1000, 100 + p)).collect();
        let held = fill(&gate, &holders, 1, t0);
        let soon = t0 + Duration::from_millis(100);
        let first = gate
            .admit_at(Some(1000), Some(5000), soon)
            .expect("the fast lane");
        assert!(first.fast);
        assert_eq!(first.within(Duration::from_secs(3)), FAST_HELLO_WITHIN);
        assert_eq!(evicted(&held), 0, "no ordinary place was taken");
        // The lane fills, then gives its oldest place to each newcomer.
        let lane: Vec<PendingHello> = (1..MAX_FAST_HELLO as i32)
            .map(|p| {
                gate.admit_at(Some(1000), Some(5000 + p), soon)
                    .expect("lane")
            })
            .collect();
        assert!(!first.evict.is_cancelled());
        let next = gate
            .admit_at(Some(1000), Some(6000), soon)
            .expect("the lane's oldest place");
        assert!(next.fast);
        assert!(
            first.evict.is_cancelled(),
            "the lane's oldest gave its place"
        );
        assert_eq!(evicted(&lane), 0);
        assert_eq!(evicted(&held), 0);
        let s = gate.state.lock().unwrap();
        assert_eq!(s.fast, MAX_FAST_HELLO);
        assert_eq!(s.entries.len(), MAX_PENDING_HELLO + MAX_FAST_HELLO);
    }

    /// The `bridge_refused` lines of a record: (pid, uid, count, processes).
    fn refused_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .expect("record")
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
            .filter(|l| l["kind"] == "bridge_refused")
            .collect()
    }

    #[test]
    fn a_uid_forking_a_process_per_connection_is_grouped_and_counted() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("record.jsonl");
        let (recorder, _) = crate::evidence::record::Recorder::open(
            &path,
            crate::evidence::record::RecordSync::Always,
        )
        .expect("open");
        let gate = Arc::new(HelloGate::recorded(recorder, Socket::Bridge));
        // 1,000 processes of uid 1001, one refused connection each; and one process of uid 1002.
        for pid in 0..1000 {
            gate.refused("uid_not_listed", Some(1001), Some(10_000 + pid));
        }
        gate.refused("uid_not_listed", Some(1002), Some(7));
        let lines = refused_lines(&path);
        // Four processes on lines of their own, then the uid's line (its first refusal at once),
        // and the other uid's process.
        assert_eq!(lines.len(), MAX_REFUSAL_PIDS_PER_UID + 2, "{lines:?}");
        let grouped: Vec<_> = lines.iter().filter(|l| l["pid"].is_null()).collect();
        assert_eq!(grouped.len(), 1);
        assert_eq!(grouped[0]["uid"], 1001);
        assert_eq!(grouped[0]["processes"], 1);
        gate.flush_refusals(true);
        let lines = refused_lines(&path);
        assert_eq!(lines.len(), MAX_REFUSAL_PIDS_PER_UID + 3, "{lines:?}");
        let last = lines.last().expect("the held refusals");
        assert_eq!(
            (last["uid"].as_u64(), last["pid"].is_null()),
            (Some(1001), true)
        );
        assert_eq!(
            last["processes"],
            1000 - MAX_REFUSAL_PIDS_PER_UID as u64 - 1
        );
        // Nothing lost: the counts add up to every refusal.
        let total: u64 = lines.iter().filter_map(|l| l["count"].as_u64()).sum();
        assert_eq!(total, 1001);
        // Individual lines name no `processes`.
        assert!(
            lines
                .iter()
                .filter(|l| !l["pid"].is_null())
                .all(|l| l.get("processes").is_none())
        );
    }

    #[test]
    fn places_are_given_back_when_dropped() {
        let gate = Arc::new(HelloGate::default());
        let t0 = Instant::now();
        let holders: Vec<(u32, i32)> = (0..256).map(|p| (1000, 100 + p)).collect();
        let held = fill(&gate, &holders, 1, t0);
        let fast = gate.admit_at(Some(1000), Some(5000), t0).expect("lane");
        drop(fast);
        drop(held);
        let s = gate.state.lock().unwrap();
        assert!(s.entries.is_empty() && s.per_uid.is_empty() && s.per_pid.is_empty());
        assert_eq!(s.fast, 0);
    }
}
