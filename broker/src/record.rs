//! The record: append-only JSON Lines, one object per event.
//!
//! Every line has `seq` (strictly increasing, also across restarts), `at` (UTC, RFC 3339),
//! `kind` and `turn`. [`Recorder::append`] returns only once the line is written, and with
//! [`RecordSync::Always`] once it is on disk (fdatasync). Concurrent appends share one sync
//! (group commit): each appender writes its own line under a lock, and one of the waiting
//! appenders runs a single fdatasync covering every line written so far. With
//! [`RecordSync::Batch`] a line is acknowledged once written to the OS (it survives a broker
//! crash) and synced within [`BATCH_SYNC_INTERVAL`].
//!
//! On open, a torn last line (a crash mid-write) is detected, reported, moved aside to
//! `<record>.torn` and cut off, never parsed as if whole. The file is created 0600 and locked
//! (`flock`) while open: a second broker on the same record refuses to start, naming the pid that
//! holds it. This module never drops a line: an
//! append that returns `Ok` has written its line, and one that cannot write says so.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::sync::{Notify, watch};

/// Longest time a line may stay unsynced with `record_sync = "batch"`.
pub const BATCH_SYNC_INTERVAL: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RecordSync {
    /// fdatasync before a call's answer leaves the broker (group commit).
    #[default]
    Always,
    /// Written before the answer; synced at least every 50 ms.
    Batch,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("record `{path}`: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("record `{path}` line {line} is not a record object: {detail}")]
    Corrupt {
        path: String,
        line: usize,
        detail: String,
    },
    #[error("the record writer has stopped")]
    Stopped,
    #[error("a `{kind}` line could not be encoded: {detail}")]
    Encode { kind: &'static str, detail: String },
    #[error(
        "record `{path}` is in use by another process ({holder}); two brokers never append to one record"
    )]
    Locked { path: String, holder: String },
}

/// What opening an existing record found.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// The last `seq` in the file (0 for a new record).
    pub last_seq: u64,
    pub lines: usize,
    /// Bytes of a torn last line that were cut off and saved to `torn_saved_to`.
    pub torn_bytes: usize,
    pub torn_saved_to: Option<PathBuf>,
    /// `intent` lines with no `call` line of the same `callId` after them: calls that could
    /// change state and whose outcome the last broker never recorded (it stopped first).
    pub open_intents: Vec<Intent>,
    /// Turns opened and never closed (`turn_opened` without `turn_closed`), in order.
    pub open_turns: Vec<String>,
}

struct State {
    next_seq: u64,
    /// File length after the last whole line.
    len: u64,
    /// `batch`: lines written since the last sync.
    dirty: bool,
    /// `always`: an append is running fdatasync for everything written before it started.
    sync_in_flight: bool,
    /// `always`: the last seq known to be on disk.
    synced: u64,
    /// `always`: an fdatasync failed; nothing more is acknowledged.
    failed: Option<String>,
}

struct Shared {
    file: Arc<File>,
    path: PathBuf,
    sync: RecordSync,
    state: Mutex<State>,
    /// Publishes the last synced seq (or a failed sync) to waiting appends.
    synced_tx: watch::Sender<u64>,
    /// `batch`: wakes the syncer when the first unsynced line is written.
    dirty: Arc<Notify>,
}

/// A handle to the record. Cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    shared: Arc<Shared>,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> RecordError + '_ {
    move |source| RecordError::Io {
        path: path.display().to_string(),
        source,
    }
}

pub use sharedos_proto::record::{Event, now_rfc3339};
use sharedos_proto::record::{Intent, RecordLine};

/// An `intent` line read back; what it lacks (an older or hand-made line) is left empty.
fn open_intent(obj: Map<String, Value>) -> Intent {
    let text = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_owned);
    let fallback = || Intent {
        turn: text("turn").unwrap_or_default(),
        call_id: text("callId").unwrap_or_default(),
        request_id: text("requestId"),
        tool: text("tool").unwrap_or_default(),
        arguments: None,
        requirement: obj
            .get("requirement")
            .and_then(|r| serde_json::from_value(r.clone()).ok()),
        system_identity: None,
    };
    match serde_json::from_value::<RecordLine>(Value::Object(obj.clone())) {
        Ok(RecordLine {
            event: Event::Intent(i),
            ..
        }) => i,
        _ => fallback(),
    }
}

/// Scans an existing record: the last seq, and a torn tail if any (cut off and saved aside).
fn recover(path: &Path, file: &mut File) -> Result<Recovery, RecordError> {
    let err = io_err(path);
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(0)).map_err(&err)?;
    file.read_to_end(&mut bytes).map_err(&err)?;
    let mut recovery = Recovery::default();
    // Open intents and turns by id, with the seq that opened them (for their order).
    let mut intents: std::collections::HashMap<String, (u64, Intent)> = Default::default();
    let mut turns: std::collections::HashMap<String, u64> = Default::default();
    let mut good_end = 0usize;
    let mut start = 0usize;
    let mut line_no = 0usize;
    while start < bytes.len() {
        let Some(nl) = bytes[start..].iter().position(|b| *b == b'\n') else {
            break; // no newline: a torn tail
        };
        let line = &bytes[start..start + nl];
        line_no += 1;
        let parsed: Result<Map<String, Value>, _> = serde_json::from_slice(line);
        match parsed {
            Ok(obj) => {
                let seq =
                    obj.get("seq")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| RecordError::Corrupt {
                            path: path.display().to_string(),
                            line: line_no,
                            detail: "no numeric `seq`".into(),
                        })?;
                if seq <= recovery.last_seq {
                    return Err(RecordError::Corrupt {
                        path: path.display().to_string(),
                        line: line_no,
                        detail: format!(
                            "seq {seq} does not increase (after {})",
                            recovery.last_seq
                        ),
                    });
                }
                recovery.last_seq = seq;
                recovery.lines += 1;
                let text = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_owned);
                match (
                    obj.get("kind").and_then(Value::as_str),
                    text("callId"),
                    text("turn"),
                ) {
                    (Some("intent"), Some(id), _) => {
                        intents.insert(id, (seq, open_intent(obj)));
                    }
                    (Some("call"), Some(id), _) => {
                        intents.remove(&id);
                    }
                    (Some("turn_opened"), _, Some(turn)) => {
                        turns.insert(turn, seq);
                    }
                    (Some("turn_closed"), _, Some(turn)) => {
                        turns.remove(&turn);
                    }
                    _ => {}
                }
            }
            Err(e) => {
                // A complete line that does not parse is corruption, not a torn write, unless it
                // is the last one (a crash can leave a newline-terminated partial JSON only if the
                // writer wrote the newline, which it does in the same write as the line).
                return Err(RecordError::Corrupt {
                    path: path.display().to_string(),
                    line: line_no,
                    detail: e.to_string(),
                });
            }
        }
        start += nl + 1;
        good_end = start;
    }
    let mut intents: Vec<(u64, Intent)> = intents.into_values().collect();
    intents.sort_by_key(|(seq, _)| *seq);
    recovery.open_intents = intents.into_iter().map(|(_, line)| line).collect();
    let mut turns: Vec<(String, u64)> = turns.into_iter().collect();
    turns.sort_by_key(|(_, seq)| *seq);
    recovery.open_turns = turns.into_iter().map(|(turn, _)| turn).collect();
    if good_end < bytes.len() {
        let torn = &bytes[good_end..];
        let aside = PathBuf::from(format!("{}.torn", path.display()));
        let mut saved = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&aside)
            .map_err(io_err(&aside))?;
        saved.write_all(torn).map_err(io_err(&aside))?;
        saved.write_all(b"\n").map_err(io_err(&aside))?;
        saved.sync_data().map_err(io_err(&aside))?;
        file.set_len(good_end as u64).map_err(&err)?;
        file.sync_data().map_err(&err)?;
        recovery.torn_bytes = torn.len();
        recovery.torn_saved_to = Some(aside);
    }
    Ok(recovery)
}

/// Who holds the lock on `file`, from `/proc/locks` (the pid that took it).
fn lock_holder(file: &File) -> String {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return "holder unknown".into();
    };
    let dev = meta.dev();
    let id = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
        meta.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    locks
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // `1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`
            (f.len() >= 6 && f[5] == id).then(|| format!("pid {}", f[4]))
        })
        .unwrap_or_else(|| "holder unknown".into())
}

impl Recorder {
    /// Opens (or creates) the record. With `batch`, starts the task that syncs within
    /// [`BATCH_SYNC_INTERVAL`] (needs a Tokio runtime).
    pub fn open(path: &Path, sync: RecordSync) -> Result<(Self, Recovery), RecordError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            // It holds every call's arguments: readable by the broker's uid only.
            .mode(0o600)
            .open(path)
            .map_err(io_err(path))?;
        // One writer per record, whatever path names it (the lock is on the file itself).
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(RecordError::Locked {
                    path: path.display().to_string(),
                    holder: lock_holder(&file),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_err(path)(e)),
        }
        let meta = file.metadata().map_err(io_err(path))?;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(record = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "the record was readable by others: made 0600");
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(io_err(path))?;
        }
        let recovery = recover(path, &mut file)?;
        let len = file.metadata().map_err(io_err(path))?.len();
        let (synced_tx, _) = watch::channel(recovery.last_seq);
        let shared = Arc::new(Shared {
            file: Arc::new(file),
            path: path.to_path_buf(),
            sync,
            state: Mutex::new(State {
                next_seq: recovery.last_seq + 1,
                len,
                dirty: false,
                sync_in_flight: false,
                synced: recovery.last_seq,
                failed: None,
            }),
            synced_tx,
            dirty: Arc::new(Notify::new()),
        });
        if sync == RecordSync::Batch {
            tokio::spawn(batch_syncer(Arc::downgrade(&shared), shared.dirty.clone()));
        }
        Ok((Self { shared }, recovery))
    }

    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Releases the record's lock at shutdown (exiting releases it too).
    pub fn release(&self) {
        if let Err(e) = self.shared.file.unlock() {
            tracing::warn!(record = %self.shared.path.display(), error = %e, "could not release the record's lock");
        }
    }

    /// Appends one event (`kind`, `turn` and the rest; `seq` and `at` are added in front). Returns its seq once the line is as durable as the sync mode promises.
    ///
    /// The caller serializes its own line, and writes it under the record's lock, where its seq
    /// and time are taken (so both follow file order). With `always` it then waits until an
    /// fdatasync covers the line: the first waiter finding none in flight runs one for
    /// everything written so far, the others wait for it (group commit, no writer task).
    pub async fn append(&self, event: &Event) -> Result<u64, RecordError> {
        let seq = self.append_written(event)?;
        if self.shared.sync == RecordSync::Always {
            self.wait_synced(seq).await?;
        }
        Ok(seq)
    }

    /// Writes one event in order and returns its seq without waiting for fdatasync: for lines no
    /// answer waits on (a bridge connecting). The next `always` append's sync covers it, and
    /// `batch` syncs it within [`BATCH_SYNC_INTERVAL`].
    pub fn append_written(&self, event: &Event) -> Result<u64, RecordError> {
        // An event is an object whose text starts with `{"kind":`.
        let body = serde_json::to_vec(event).map_err(|e| RecordError::Encode {
            kind: event.kind(),
            detail: e.to_string(),
        })?;
        self.write_line(&body)
    }

    fn write_line(&self, body: &[u8]) -> Result<u64, RecordError> {
        let shared = &*self.shared;
        let mut st = shared.lock();
        if let Some(e) = &st.failed {
            return Err(shared.failed_error(e));
        }
        let seq = st.next_seq;
        let mut line = Vec::with_capacity(body.len() + 64);
        line.extend_from_slice(b"{\"seq\":");
        line.extend_from_slice(seq.to_string().as_bytes());
        line.extend_from_slice(b",\"at\":\"");
        line.extend_from_slice(now_rfc3339().as_bytes());
        line.push(b'"');
        match body.get(1..) {
            Some(rest) if rest.len() > 1 => {
                line.push(b',');
                line.extend_from_slice(rest);
            }
            _ => line.push(b'}'),
        }
        line.push(b'\n');
        // One write(2) of one line; the file is opened for append.
        if let Err(e) = (&*shared.file).write_all(&line) {
            // Cut a partial line off so that the next line does not follow a fragment.
            let _ = shared.file.set_len(st.len);
            tracing::error!(path = %shared.path.display(), error = %e, "record write failed");
            return Err(RecordError::Io {
                path: shared.path.display().to_string(),
                source: e,
            });
        }
        st.len += line.len() as u64;
        st.next_seq += 1;
        if shared.sync == RecordSync::Batch && !st.dirty {
            st.dirty = true;
            shared.dirty.notify_one();
        }
        Ok(seq)
    }

    async fn wait_synced(&self, seq: u64) -> Result<(), RecordError> {
        let shared = &*self.shared;
        let mut synced = shared.synced_tx.subscribe();
        loop {
            let target = {
                let mut st = shared.lock();
                if let Some(e) = &st.failed {
                    return Err(shared.failed_error(e));
                }
                if st.synced >= seq {
                    return Ok(());
                }
                if st.sync_in_flight {
                    None
                } else {
                    st.sync_in_flight = true;
                    Some(st.next_seq - 1)
                }
            };
            let Some(target) = target else {
                // Another append leads a sync; it publishes when done (or when it gives up).
                if synced.changed().await.is_err() {
                    return Err(RecordError::Stopped);
                }
                continue;
            };
            // With two or more runtime threads, the leader syncs on its own thread: handing the
            // fdatasync to the blocking pool cost two thread wake-ups per sync (there and back,
            // plus a sibling worker woken to run the resumed task), 7 context switches per
            // `always` call instead of 3.6 and fewer calls/s at 64 bridges (bench/NOTES.md).
            // Group commit bounds the blocking: one sync at a time, so at most one runtime
            // thread waits for the disk while the others serve. With a single runtime thread
            // that would stop everything for every sync (measured: 2,000 instead of 5,600
            // calls/s at 64 bridges), so there the pool does it.
            let mut lead = Leader {
                shared,
                done: false,
            };
            let pool = tokio::runtime::Handle::try_current()
                .ok()
                .filter(|h| h.metrics().num_workers() < 2);
            let failure = match pool {
                None => shared.file.sync_data().err().map(|e| e.to_string()),
                Some(pool) => {
                    let file = shared.file.clone();
                    match pool.spawn_blocking(move || file.sync_data()).await {
                        Ok(r) => r.err().map(|e| e.to_string()),
                        Err(e) => Some(e.to_string()),
                    }
                }
            };
            {
                let mut st = shared.lock();
                st.sync_in_flight = false;
                match failure {
                    // After a failed fdatasync the kernel may have dropped the dirty pages: no
                    // later sync can vouch for these lines, so the record stops taking lines.
                    Some(e) => {
                        tracing::error!(path = %shared.path.display(), error = %e, "record sync failed");
                        st.failed = Some(e);
                    }
                    None => st.synced = st.synced.max(target),
                }
            }
            lead.done = true;
            shared.synced_tx.send_replace(target);
        }
    }
}

/// Hands leadership on if a leading append is dropped while the blocking pool syncs for it.
struct Leader<'a> {
    shared: &'a Shared,
    done: bool,
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.shared.lock().sync_in_flight = false;
            self.shared.synced_tx.send_modify(|_| {});
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::lock(&self.state)
    }

    fn failed_error(&self, e: &str) -> RecordError {
        RecordError::Io {
            path: self.path.display().to_string(),
            source: std::io::Error::other(format!("an earlier fdatasync failed: {e}")),
        }
    }

    fn sync_now(&self) {
        if let Err(e) = self.file.sync_data() {
            tracing::error!(path = %self.path.display(), error = %e, "record sync failed");
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.lock().dirty {
            self.sync_now();
        }
        // Ends the batch syncer (it finds no recorder left).
        self.dirty.notify_one();
    }
}

/// `batch`: syncs within [`BATCH_SYNC_INTERVAL`] of the first unsynced line; ends with the
/// last `Recorder` (whose drop syncs what is left, and wakes this task to end).
async fn batch_syncer(shared: Weak<Shared>, dirty: Arc<Notify>) {
    loop {
        dirty.notified().await;
        tokio::time::sleep(BATCH_SYNC_INTERVAL).await;
        let Some(s) = shared.upgrade() else { return };
        s.lock().dirty = false;
        let _ = tokio::task::spawn_blocking(move || s.sync_now()).await;
    }
}

/// Reads record lines with `seq > after_seq` (and of `turn`, if given), at most `limit`.
/// Returns the lines and whether more remain. A torn last line is skipped (it is being written).
pub fn read_records(
    path: &Path,
    turn: Option<&str>,
    after_seq: u64,
    limit: usize,
) -> Result<(Vec<Value>, bool), RecordError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((vec![], false)),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut out = Vec::new();
    let mut reader = BufReader::new(file);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).map_err(io_err(path))?;
        if n == 0 || !line.ends_with('\n') {
            break;
        }
        let Ok(value) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let seq = value.get("seq").and_then(Value::as_u64).unwrap_or(0);
        if seq <= after_seq {
            continue;
        }
        if let Some(t) = turn
            && value.get("turn").and_then(Value::as_str) != Some(t)
        {
            continue;
        }
        if out.len() == limit {
            return Ok((out, true));
        }
        out.push(value);
    }
    Ok((out, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    use sharedos_proto::record::{PolicyReloaded, TurnClosed};

    /// A turn's line whose `reason` tells appends apart.
    fn event(reason: &str, turn: &str) -> Event {
        Event::TurnClosed(TurnClosed {
            turn: turn.into(),
            reason: reason.into(),
            calls: None,
            system_identity: None,
        })
    }

    #[tokio::test]
    async fn seq_continues_across_reopen_and_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        {
            let (rec, recovery) = Recorder::open(&path, RecordSync::Always).expect("open");
            assert_eq!(recovery.last_seq, 0);
            assert_eq!(rec.append(&event("a", "t1")).await.expect("1"), 1);
            assert_eq!(rec.append(&event("b", "t2")).await.expect("2"), 2);
        }
        // Simulate a crash mid-write.
        let mut f = OpenOptions::new().append(true).open(&path).expect("open");
        f.write_all(b"{\"seq\":3,\"kind\":\"ca").expect("write");
        drop(f);
        let (rec, recovery) = Recorder::open(&path, RecordSync::Batch).expect("reopen");
        assert_eq!(recovery.last_seq, 2);
        assert_eq!(recovery.torn_bytes, 19);
        let aside = recovery.torn_saved_to.expect("saved");
        assert!(
            std::fs::read_to_string(aside)
                .expect("torn")
                .contains("\"ca")
        );
        assert_eq!(rec.append(&event("c", "t1")).await.expect("3"), 3);
        drop(rec);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (lines, more) = read_records(&path, Some("t1"), 0, 10).expect("read");
        assert!(!more);
        let seqs: Vec<u64> = lines
            .iter()
            .map(|l| l["seq"].as_u64().expect("seq"))
            .collect();
        assert_eq!(seqs, vec![1, 3]);
        assert!(
            lines
                .iter()
                .all(|l| l["at"].as_str().is_some_and(|a| a.ends_with('Z')))
        );
        let (page, more) = read_records(&path, None, 0, 2).expect("page");
        assert_eq!(page.len(), 2);
        assert!(more);
    }

    #[tokio::test]
    async fn concurrent_appends_get_distinct_increasing_seqs() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Always).expect("open");
        let mut tasks = Vec::new();
        for i in 0..200 {
            let rec = rec.clone();
            tasks.push(tokio::spawn(async move {
                rec.append(&event("call", &format!("t{}", i % 4))).await
            }));
        }
        let mut seqs = Vec::new();
        for t in tasks {
            seqs.push(t.await.expect("join").expect("append"));
        }
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=200).collect::<Vec<u64>>());
        let (lines, _) = read_records(&path, None, 0, 1000).expect("read");
        assert_eq!(lines.len(), 200);
    }

    /// On one runtime thread the blocking pool syncs, and a leader can be dropped mid-sync.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_dropped_sync_leader_hands_on_and_nothing_waits_forever() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Always).expect("open");
        // The first poll writes the line and starts leading a sync; the timeout drops it there
        // (unless the sync already finished within that poll: then try again).
        let mut tries = 0u64;
        loop {
            tries += 1;
            let r = tokio::time::timeout(Duration::ZERO, rec.append(&event("a", "t"))).await;
            if r.is_err() || tries == 1000 {
                break;
            }
        }
        assert!(tries < 1000, "no append was ever dropped mid-sync");
        let seq = tokio::time::timeout(Duration::from_secs(10), rec.append(&event("b", "t")))
            .await
            .expect("a later append is not stuck behind the dropped leader")
            .expect("append");
        assert_eq!(seq, tries + 1);
        let (lines, _) = read_records(&path, None, 0, 2000).expect("read");
        assert_eq!(
            lines.len() as u64,
            tries + 1,
            "every dropped append's line was written"
        );
        assert_eq!(lines[0]["reason"], "a");
        assert_eq!(lines[tries as usize]["reason"], "b");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn appends_dropped_while_waiting_for_the_sync_leave_nothing_stuck() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Always).expect("open");
        // Half the appends are dropped after their first poll (their line is written then),
        // mostly while another append leads the sync.
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let rec = rec.clone();
                tokio::spawn(async move {
                    let line = event("a", "t");
                    let append = rec.append(&line);
                    if i % 2 == 0 {
                        tokio::time::timeout(Duration::ZERO, append).await.ok();
                    } else {
                        append.await.expect("append");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        let seq = tokio::time::timeout(Duration::from_secs(10), rec.append(&event("b", "t")))
            .await
            .expect("a later append is not stuck behind the dropped ones")
            .expect("append");
        assert_eq!(seq, 65);
        let (lines, _) = read_records(&path, None, 0, 2000).expect("read");
        assert_eq!(lines.len(), 65, "every dropped append's line was written");
        assert_eq!(lines[64]["reason"], "b");
    }

    #[tokio::test]
    async fn batch_lines_are_whole_and_in_order_with_seq_and_at_first() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Batch).expect("open");
        assert_eq!(rec.append(&event("x", "t")).await.expect("1"), 1);
        let global = Event::PolicyReloaded(PolicyReloaded {
            version: 2,
            policies: 3,
            path: "p.cedar".into(),
            turn: None,
        });
        assert_eq!(rec.append(&global).await.expect("2"), 2);
        drop(rec);
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("whole JSON line"))
            .collect();
        assert_eq!(lines[0]["seq"], 1);
        assert_eq!(lines[1]["seq"], 2);
        assert_eq!(lines[1]["turn"], Value::Null);
        assert!(text.starts_with("{\"seq\":1,\"at\":"), "{text}");
        // Each line reads back as the event that was written.
        for (l, want) in text.lines().zip([event("x", "t"), global]) {
            let line: sharedos_proto::record::RecordLine = serde_json::from_str(l).expect("typed");
            assert_eq!(line.event, want);
        }
    }

    #[test]
    fn corrupt_middle_line_is_an_error() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        std::fs::write(&path, "{\"seq\":1}\nnot json\n{\"seq\":3}\n").expect("w");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        let _guard = rt.enter();
        let err = Recorder::open(&path, RecordSync::Always)
            .err()
            .expect("corrupt");
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}
