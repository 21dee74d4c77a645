//! The record: append-only JSON Lines, one object per event, hash-chained and signed.
//!
//! Every line has `seq` (strictly increasing by one, also across restarts and files), `at` (UTC,
//! RFC 3339), `prev` (the SHA-256 of the previous line's bytes: the hash chain), `kind` and
//! `turn`. A new record starts with a `chain_started` line (the recorded genesis, with the
//! public key); a record written before chaining gets one that chains to its last line. With a
//! signing key, the broker appends a signed `checkpoint` line (Ed25519 over seq, chain hash, time
//! and reason) at an interval, at shutdown and before each rotation; the chain module checks all of
//! it.
//!
//! [`Recorder::append`] returns only once the line is written, and with [`RecordSync::Always`]
//! once it is on disk (fdatasync). Concurrent appends share one sync (group commit): each
//! appender writes its own line under a lock, and one of the waiting appenders runs a single
//! fdatasync covering every line written so far (when the last sync covered more than one line,
//! it first yields once, so that every task ready to run writes its line before the sync rather
//! than after it). With [`RecordSync::Batch`] a line is
//! acknowledged once written to the OS (it survives a broker crash) and synced within
//! [`BATCH_SYNC_INTERVAL`].
//!
//! Rotation (by size and by age, both off by default) renames the record to
//! `<record>.<first seq in it>` and starts an empty file under the record's name; the chain and
//! `seq` continue across files, and [`record_files`] lists them in order.
//!
//! On open, a torn last line (a crash mid-write) is detected, reported, moved aside to
//! `<record>.torn` and cut off, never parsed as if whole; a `torn_tail_cut` line records the cut
//! and the chain continues from the last whole line. The file is created 0600 and locked
//! (`flock`) while open: a second broker on the same record refuses to start, naming the pid that
//! holds it. This module never drops a line: an append that returns `Ok` has written its line,
//! and one that cannot write says so.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ed25519_dalek::{Signer, SigningKey};
use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::{Digest as _, Sha256};
use sharedos_proto::catalog::hex;
use tokio::sync::{Notify, watch};

use crate::trusted::{TrustError, TrustedDir};

/// Longest time a line may stay unsynced with `record_sync = "batch"`.
pub const BATCH_SYNC_INTERVAL: Duration = Duration::from_millis(50);

/// Bytes reserved for a record line's event before it is serialized (a call line is 300-500).
const LINE_CAPACITY: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RecordSync {
    /// fdatasync before a call's answer leaves the broker (group commit).
    #[default]
    Always,
    /// Written before the answer; synced at least every 50 ms.
    Batch,
}

/// How a record is written, beyond where.
#[derive(Clone, Default)]
pub struct RecordOptions {
    pub sync: RecordSync,
    /// Signs checkpoints. Without one the record is chained but carries no signatures.
    pub signing_key: Option<SigningKey>,
    /// Rotate before a line would be written to a file already this long.
    pub rotate_bytes: Option<u64>,
    /// Rotate before a line would be written to a file opened (or begun) this long ago.
    pub rotate_age: Option<Duration>,
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
    #[error("signing key `{path}`: {detail}")]
    Key { path: String, detail: String },
    /// A folder or file of the record's that another uid could have put there (a link, a file
    /// of another uid, a folder others can write).
    #[error(transparent)]
    Untrusted(#[from] TrustError),
}

/// What opening an existing record found.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// The last `seq` in the record (0 for a new record).
    pub last_seq: u64,
    /// Whole lines found, in every file of the record.
    pub lines: usize,
    /// Bytes of a torn last line that were cut off and saved to `torn_saved_to`.
    pub torn_bytes: usize,
    pub torn_saved_to: Option<PathBuf>,
    /// The SHA-256 (hex) of the torn bytes.
    pub torn_sha256: Option<String>,
    /// `intent` lines with no `call` line of the same `callId` after them: calls that could
    /// change state and whose outcome the last broker never recorded (it stopped first).
    pub open_intents: Vec<Intent>,
    /// Turns opened and never closed (`turn_opened` without `turn_closed`), in order.
    pub open_turns: Vec<String>,
    /// SHA-256 of the last whole line (the chain's head), if there is one.
    last_hash: Option<[u8; 32]>,
    /// A `chain_started` line was found.
    chained: bool,
    /// The first seq in the active file, and the lines after the last checkpoint.
    first_seq_in_file: Option<u64>,
    /// The `at` of the active file's first line (its age, for rotation by age).
    first_at_in_file: Option<String>,
    unsigned: u64,
}

struct State {
    /// The active file (a rotation swaps it).
    file: Arc<File>,
    next_seq: u64,
    /// File length after the last whole line.
    len: u64,
    /// SHA-256 of the last line written: the next line's `prev`.
    prev: Option<[u8; 32]>,
    /// Lines since the last checkpoint.
    unsigned: u64,
    /// The first seq in the active file (names it when it is rotated).
    first_seq: u64,
    /// When the active file was begun: its first line's time, or now for a new file (for
    /// rotation by age).
    begun: Instant,
    /// After a failed rotation, when to try again (not on every line meanwhile).
    retry_rotation_at: Option<Instant>,
    /// `batch`: lines written since the last sync.
    dirty: bool,
    /// `always`: an append is running fdatasync for everything written before it started.
    sync_in_flight: bool,
    /// `always`: the last seq known to be on disk.
    synced: u64,
    /// `always`: how many group-commit fdatasyncs have finished (each covering one or more lines).
    syncs: u64,
    /// `always`: the last fdatasync covered more than one line (appends are arriving together),
    /// so the next leader yields before it syncs; `true` until a sync says otherwise.
    shared_last: bool,
    /// `always`: an fdatasync failed; nothing more is acknowledged.
    failed: Option<String>,
}

struct Shared {
    path: PathBuf,
    sync: RecordSync,
    signer: Option<(SigningKey, String)>,
    rotate_bytes: Option<u64>,
    rotate_age: Option<Duration>,
    state: Mutex<State>,
    /// Publishes the last synced seq (or a failed sync) to waiting appends.
    synced_tx: watch::Sender<u64>,
    /// `batch`: wakes the syncer when the first unsynced line is written.
    dirty: Arc<Notify>,
    /// Where each checkpoint line also goes (set once, at start).
    witness: std::sync::OnceLock<crate::evidence::witness::Witness>,
    /// Where every line also goes, and whether it is a checkpoint (the OpenTelemetry log
    /// export; set once, at start). Called under the record's lock, in file order: it must only
    /// hand the line on, never wait.
    export: std::sync::OnceLock<LineExport>,
}

/// A hook every written line is handed to (see [`Recorder::export_lines_to`]).
pub type LineExport = Box<dyn Fn(&[u8], bool) + Send + Sync>;

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

use sharedos_proto::record::{ChainStarted, Checkpoint, Intent, RecordLine, TornTailCut};
pub use sharedos_proto::record::{Event, now_rfc3339};

/// A time as the host sees it (`turn list`, `approvals`, token expiry): RFC 3339 UTC.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let t: time::OffsetDateTime = t.into();
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// The record's files in order: rotated ones (`<record>.<first seq>`, by that seq), then the
/// record itself (if it exists). A rotation cut short between its link and its rename leaves
/// the record's file under its rotated name too ([`same_file`]): that name is left out, so no
/// reader takes its lines twice.
pub fn record_files(path: &Path) -> Result<Vec<PathBuf>, RecordError> {
    let mut files = rotated_files(path)?;
    if path.exists() {
        if files.last().is_some_and(|newest| same_file(path, newest)) {
            files.pop();
        }
        files.push(path.to_path_buf());
    }
    Ok(files)
}

/// The rotated files (`<record>.<first seq>`), by that seq.
fn rotated_files(path: &Path) -> Result<Vec<PathBuf>, RecordError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(Vec::new());
    };
    let prefix = format!("{name}.");
    let mut rotated: Vec<(u64, PathBuf)> = Vec::new();
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            for entry in entries {
                let entry = entry.map_err(io_err(&dir))?;
                let file_name = entry.file_name();
                let Some(n) = file_name.to_str() else {
                    continue;
                };
                if let Some(seq) = n
                    .strip_prefix(&prefix)
                    .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|d| d.parse::<u64>().ok())
                {
                    rotated.push((seq, dir.join(n)));
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&dir)(e)),
    }
    rotated.sort();
    Ok(rotated.into_iter().map(|(_, p)| p).collect())
}

/// Whether `a` and `b` name the same file. A rotation links the active file to its rotated
/// name, then renames a fresh file over the record's name; a broker killed between the two
/// leaves one file under both (and the rotated name is the newest: the active file's first
/// seq).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Undoes a rotation cut short between its link and its rename (see [`same_file`]); called with
/// the record's lock held. The second name goes (the lines stay under the record's name, and
/// the next line rotates again), and so does the fresh file that was to take the record's name.
fn undo_half_rotation(path: &Path) -> Result<(), RecordError> {
    let fresh = fresh_name(path);
    if let Some(second) = rotated_files(path)?
        .pop()
        .filter(|newest| same_file(path, newest))
    {
        std::fs::remove_file(&second).map_err(io_err(&second))?;
        tracing::warn!(record = %path.display(), second_name = %second.display(), "a rotation was cut short (the broker stopped between its link and its rename): undone; the lines stay under the record's name and the next line rotates again");
    }
    match std::fs::remove_file(&fresh) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(&fresh)(e)),
        _ => Ok(()),
    }
}

/// The name of the fresh file a rotation renames over the record's name.
fn fresh_name(path: &Path) -> PathBuf {
    PathBuf::from(format!("{}.new", path.display()))
}

/// Syncs the folder holding `path`, so that a name made or moved there is on disk (best effort:
/// the data itself was synced before).
fn sync_parent(path: &Path) {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
}

/// The name a rotation gives the active file whose first line has `first_seq`.
fn rotated_name(path: &Path, first_seq: u64) -> PathBuf {
    PathBuf::from(format!("{}.{first_seq}", path.display()))
}

/// SHA-256 of a line's bytes (without its newline): what the next line's `prev` holds.
pub fn line_hash(line: &[u8]) -> [u8; 32] {
    Sha256::digest(line).into()
}

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
        cut: None,
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

/// What a scan of the record's files has found so far.
#[derive(Default)]
struct Scan {
    recovery: Recovery,
    /// Open intents and turns by id, with the seq that opened them (for their order).
    intents: std::collections::HashMap<String, (u64, Intent)>,
    turns: std::collections::HashMap<String, u64>,
}

impl Scan {
    /// Takes in the whole lines of one file's `bytes`; returns where they end (a torn tail, if
    /// any, starts there).
    fn file(&mut self, path: &Path, bytes: &[u8]) -> Result<usize, RecordError> {
        let recovery = &mut self.recovery;
        let mut good_end = 0usize;
        let mut start = 0usize;
        let mut line_no = 0usize;
        while start < bytes.len() {
            let Some(nl) = bytes[start..].iter().position(|b| *b == b'\n') else {
                break; // no newline: a torn tail
            };
            let line = &bytes[start..start + nl];
            line_no += 1;
            // A complete line that does not parse is corruption, not a torn write (the writer
            // writes a line and its newline in one write).
            let obj: Map<String, Value> =
                serde_json::from_slice(line).map_err(|e| RecordError::Corrupt {
                    path: path.display().to_string(),
                    line: line_no,
                    detail: e.to_string(),
                })?;
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
                    detail: format!("seq {seq} does not increase (after {})", recovery.last_seq),
                });
            }
            recovery.last_seq = seq;
            recovery.lines += 1;
            recovery.last_hash = Some(line_hash(line));
            if recovery.first_seq_in_file.is_none() {
                recovery.first_seq_in_file = Some(seq);
                recovery.first_at_in_file =
                    obj.get("at").and_then(Value::as_str).map(str::to_owned);
            }
            recovery.unsigned += 1;
            // A chained line: the chain began, perhaps in a file start-up did not need to read.
            if obj.contains_key("prev") {
                recovery.chained = true;
            }
            let text = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_owned);
            match (
                obj.get("kind").and_then(Value::as_str),
                text("callId"),
                text("turn"),
            ) {
                (Some("intent"), Some(id), _) => {
                    self.intents.insert(id, (seq, open_intent(obj)));
                }
                // A call held for approval is open until its `call` line, like an intent (an
                // approved call that changes state writes its intent later, same callId).
                (Some("approval_requested"), Some(id), _) => {
                    self.intents
                        .entry(id)
                        .or_insert_with(|| (seq, open_intent(obj)));
                }
                (Some("call"), Some(id), _) => {
                    self.intents.remove(&id);
                }
                (Some("turn_opened"), _, Some(turn)) => {
                    self.turns.insert(turn, seq);
                }
                (Some("turn_closed"), _, Some(turn)) => {
                    self.turns.remove(&turn);
                }
                (Some("chain_started"), _, _) => recovery.chained = true,
                (Some("checkpoint"), _, _) => recovery.unsigned = 0,
                _ => {}
            }
            start += nl + 1;
            good_end = start;
        }
        Ok(good_end)
    }

    fn finish(mut self) -> Recovery {
        let mut intents: Vec<(u64, Intent)> = self.intents.into_values().collect();
        intents.sort_by_key(|(seq, _)| *seq);
        self.recovery.open_intents = intents.into_iter().map(|(_, line)| line).collect();
        let mut turns: Vec<(String, u64)> = self.turns.into_iter().collect();
        turns.sort_by_key(|(_, seq)| *seq);
        self.recovery.open_turns = turns.into_iter().map(|(turn, _)| turn).collect();
        self.recovery
    }
}

/// Scans an existing record (its rotated files, then the active `file`): the last seq, the
/// chain's head, what was left open, and a torn tail of the active file if any (cut off and
/// saved aside).
///
/// Only the files from the newest one that holds a finished start are read: a `broker_started`
/// line followed (in its file or a later one) by a line that is not part of closing out the
/// broker before it (`unknown` calls, `broker_restart` closes, checkpoints). Such a start closed
/// out everything left open before it, and every rotated file ends signed, so nothing before
/// that file is needed to go on. A start cut short before its close-out finished is passed over
/// for an earlier one. Start-up does not grow with the record's history; `records verify` reads
/// it all.
fn recover(path: &Path, file: &mut File) -> Result<Recovery, RecordError> {
    let err = io_err(path);
    let mut scan = Scan::default();
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(0)).map_err(&err)?;
    file.read_to_end(&mut bytes).map_err(&err)?;
    let mut needed: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    let (found, mut activity) = finished_start(&bytes, false);
    if !found {
        for rotated in record_files(path)?
            .into_iter()
            .filter(|f| f.as_path() != path)
            .rev()
        {
            let old = read_own(&rotated)?;
            let (found, later) = finished_start(&old, activity);
            activity = later;
            needed.push((rotated, old));
            if found {
                break;
            }
        }
    }
    for (rotated, old) in needed.iter().rev() {
        scan.file(rotated, old)?;
    }
    scan.recovery.first_seq_in_file = None;
    scan.recovery.first_at_in_file = None;
    let good_end = scan.file(path, &bytes)?;
    let mut recovery = scan.finish();
    if good_end < bytes.len() {
        let torn = &bytes[good_end..];
        let aside = torn_name(path);
        let (dir, name) = crate::trusted::split(&aside)?;
        let mut saved = TrustedDir::open(dir, false)?.open_file(
            name,
            rustix::fs::OFlags::CREATE | rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::APPEND,
            0o600,
        )?;
        saved.write_all(torn).map_err(io_err(&aside))?;
        saved.write_all(b"\n").map_err(io_err(&aside))?;
        saved.sync_data().map_err(io_err(&aside))?;
        file.set_len(good_end as u64).map_err(&err)?;
        file.sync_data().map_err(&err)?;
        recovery.torn_bytes = torn.len();
        recovery.torn_saved_to = Some(aside);
        recovery.torn_sha256 = Some(hex(&line_hash(torn)));
    }
    Ok(recovery)
}

/// Whether a file's lines hold a finished start (see [`recover`]), given whether a line after
/// the file shows the broker got past its close-out (`later`); and whether such a line is in
/// this file or after it. Lines that do not parse are passed over here (the scan judges them).
fn finished_start(bytes: &[u8], later: bool) -> (bool, bool) {
    #[derive(serde::Deserialize)]
    struct Peek<'a> {
        #[serde(borrow)]
        kind: Option<&'a str>,
        #[serde(borrow)]
        outcome: Option<&'a str>,
        #[serde(borrow)]
        reason: Option<&'a str>,
    }
    let mut activity = later;
    for line in bytes.split(|b| *b == b'\n').rev() {
        let Ok(p) = serde_json::from_slice::<Peek<'_>>(line) else {
            continue;
        };
        match (p.kind, p.outcome, p.reason) {
            (Some("broker_started"), _, _) if activity => return (true, true),
            (Some("broker_started" | "checkpoint" | "chain_started" | "torn_tail_cut"), _, _)
            | (Some("call"), Some("unknown"), _)
            | (Some("turn_closed"), _, Some("broker_restart")) => {}
            _ => activity = true,
        }
    }
    (false, activity)
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

/// Where a torn tail of the record at `path` is saved.
fn torn_name(path: &Path) -> PathBuf {
    PathBuf::from(format!("{}.torn", path.display()))
}

/// Reads a file of the record's, refused if it is a link or another uid's.
fn read_own(path: &Path) -> Result<Vec<u8>, RecordError> {
    let (dir, name) = crate::trusted::split(path)?;
    let mut file = TrustedDir::open(dir, false)?.open_file(name, rustix::fs::OFlags::RDONLY, 0)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io_err(path))?;
    Ok(bytes)
}

/// Checks, before the broker makes, reads or writes any of them, the folders and names of the
/// record at `record` and of its signing key at `key`: each folder is checked as
/// [`TrustedDir`] says (made, 0700, when missing), and the record, its `.torn` file, its rotated
/// files, the key and its `.pub` are refused by name when one is a link, not a plain file, or
/// another uid's.
pub fn check_files(record: &Path, key: &Path) -> Result<(), RecordError> {
    let (dir, name) = crate::trusted::split(record)?;
    let folder = TrustedDir::open(dir, true)?;
    folder.check_file(name)?;
    folder.check_file(format!("{name}.torn"))?;
    for rotated in rotated_files(record)? {
        if let Some(n) = rotated.file_name() {
            folder.check_file(n)?;
        }
    }
    let (dir, name) = crate::trusted::split(key)?;
    let folder = TrustedDir::open(dir, true)?;
    folder.check_file(name)?;
    folder.check_file(format!("{name}.pub"))?;
    Ok(())
}

/// Opens `path` for appending (0600), and takes its lock. Never through a link, and never a
/// file another uid owns (its folder was checked by [`TrustedDir`] first).
fn open_locked(path: &Path, create_new: bool) -> Result<File, RecordError> {
    use rustix::fs::OFlags;
    let mut flags = OFlags::RDWR | OFlags::APPEND | OFlags::CREATE;
    if create_new {
        flags |= OFlags::EXCL;
    }
    let (dir, name) = crate::trusted::split(path)?;
    // It holds every call's arguments: readable by the broker's uid only.
    let file = TrustedDir::open(dir, false)?.open_file(name, flags, 0o600)?;
    // One writer per record, whatever path names it (the lock is on the file itself).
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(RecordError::Locked {
            path: path.display().to_string(),
            holder: lock_holder(&file),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_err(path)(e)),
    }
}

/// Reads the 32-byte Ed25519 seed (hex) at `path`, or makes one there (0600) and writes its
/// public key (hex) beside it, at `<path>.pub`. A key readable by others is made 0600. The
/// folder is checked first ([`TrustedDir`]), and a key or `.pub` that is a link or another uid's
/// is refused by name: nothing is ever read or written through a link.
pub fn load_or_create_signing_key(path: &Path) -> Result<SigningKey, RecordError> {
    use rustix::fs::{Mode, OFlags};
    let key_err = |detail: String| RecordError::Key {
        path: path.display().to_string(),
        detail,
    };
    let (dir, name) = crate::trusted::split(path)?;
    let folder = TrustedDir::open(dir, true)?;
    let public_name = format!("{name}.pub");
    folder.check_file(&public_name)?;
    if folder.check_file(name)?.is_none() {
        create_signing_key_in(&folder, name, path)?;
    }
    let mut file = folder.open_file(name, OFlags::RDONLY, 0)?;
    let mode = file.metadata().map_err(io_err(path))?.permissions().mode();
    if mode & 0o077 != 0 {
        tracing::warn!(key = %path.display(), mode = format!("{:o}", mode & 0o777), "the record's signing key was readable by others: made 0600");
        rustix::fs::fchmod(&file, Mode::from_raw_mode(0o600))
            .map_err(|e| io_err(path)(e.into()))?;
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io_err(path))?;
    let seed = parse_hex32(text.trim())
        .ok_or_else(|| key_err("not 64 hex digits (an Ed25519 seed)".into()))?;
    let key = SigningKey::from_bytes(&seed);
    let text = format!("{}\n", hex(key.verifying_key().as_bytes()));
    let current = match folder.check_file(&public_name)? {
        Some(_) => {
            let mut old = String::new();
            folder
                .open_file(&public_name, OFlags::RDONLY, 0)?
                .read_to_string(&mut old)
                .map_err(io_err(&folder.join(&public_name)))?;
            Some(old)
        }
        None => None,
    };
    if current.as_deref() != Some(text.as_str()) {
        folder.replace(&public_name, text.as_bytes(), 0o644)?;
    }
    Ok(key)
}

/// Creates a new signing key at `path`, whole or not at all (see [`create_signing_key_in`]).
#[cfg(test)]
fn create_signing_key(path: &Path) -> Result<(), RecordError> {
    let (dir, name) = crate::trusted::split(path)?;
    create_signing_key_in(&TrustedDir::open(dir, true)?, name, path)
}

/// Creates a new signing key `name` in `folder`, whole or not at all: the seed is written and
/// synced under a name of this process's own, then linked to its name (a link never replaces a
/// file: a key another broker made first is kept, and this one's seed is dropped). A broker
/// killed part way leaves no key file, or a whole one; never an empty one that would keep the
/// next start out.
fn create_signing_key_in(folder: &TrustedDir, name: &str, path: &Path) -> Result<(), RecordError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| RecordError::Key {
        path: path.display().to_string(),
        detail: format!("no randomness: {e}"),
    })?;
    folder.create_whole(name, format!("{}\n", hex(&seed)).as_bytes(), 0o600)?;
    Ok(())
}

/// Where the public half of the key at `key` is written.
pub fn public_key_path(key: &Path) -> PathBuf {
    PathBuf::from(format!("{}.pub", key.display()))
}

/// 64 hex digits as 32 bytes.
pub fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// How long after a failed rotation the next is tried.
pub const ROTATION_RETRY: Duration = Duration::from_secs(60);

/// When a file whose first line was written at `first_at` (RFC 3339) was begun, on this
/// process's clock: now for a new file, or one whose time cannot be read.
fn begun_at(first_at: Option<&str>) -> Instant {
    let now = Instant::now();
    let Some(at) = first_at.and_then(|a| {
        time::OffsetDateTime::parse(a, &time::format_description::well_known::Rfc3339).ok()
    }) else {
        return now;
    };
    let age = time::OffsetDateTime::now_utc() - at;
    match std::time::Duration::try_from(age) {
        Ok(age) => now.checked_sub(age).unwrap_or(now),
        Err(_) => now,
    }
}

/// What a line to write is: an event already encoded, or a checkpoint (signed under the lock,
/// where its seq, time and chain hash are taken).
enum Body<'a> {
    Event(&'a [u8]),
    Checkpoint(&'static str),
}

impl Recorder {
    /// Opens (or creates) the record, chained, without signatures or rotation. With `batch`,
    /// starts the task that syncs within [`BATCH_SYNC_INTERVAL`] (needs a Tokio runtime).
    pub fn open(path: &Path, sync: RecordSync) -> Result<(Self, Recovery), RecordError> {
        Self::open_with(
            path,
            RecordOptions {
                sync,
                ..RecordOptions::default()
            },
        )
    }

    /// Opens (or creates) the record. A new record starts its chain; one written before
    /// chaining gets a `chain_started` line chained to its last line; a torn tail cut off is
    /// recorded.
    pub fn open_with(path: &Path, options: RecordOptions) -> Result<(Self, Recovery), RecordError> {
        let (dir, name) = crate::trusted::split(path)?;
        let folder = TrustedDir::open(dir, true)?;
        folder.check_file(name)?;
        folder.check_file(format!("{name}.torn"))?;
        let mut file = open_locked(path, false)?;
        undo_half_rotation(path)?;
        let meta = file.metadata().map_err(io_err(path))?;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(record = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "the record was readable by others: made 0600");
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(io_err(path))?;
        }
        let recovery = recover(path, &mut file)?;
        let len = file.metadata().map_err(io_err(path))?.len();
        let (synced_tx, _) = watch::channel(recovery.last_seq);
        let signer = options.signing_key.map(|k| {
            let public = hex(k.verifying_key().as_bytes());
            (k, public)
        });
        let public_key = signer.as_ref().map(|(_, p)| p.clone());
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            sync: options.sync,
            signer,
            rotate_bytes: options.rotate_bytes.filter(|b| *b > 0),
            rotate_age: options.rotate_age.filter(|a| !a.is_zero()),
            state: Mutex::new(State {
                file: Arc::new(file),
                next_seq: recovery.last_seq + 1,
                len,
                prev: recovery.last_hash,
                unsigned: recovery.unsigned,
                first_seq: recovery.first_seq_in_file.unwrap_or(recovery.last_seq + 1),
                begun: begun_at(recovery.first_at_in_file.as_deref()),
                retry_rotation_at: None,
                dirty: false,
                sync_in_flight: false,
                syncs: 0,
                shared_last: true,
                synced: recovery.last_seq,
                failed: None,
            }),
            synced_tx,
            dirty: Arc::new(Notify::new()),
            witness: std::sync::OnceLock::new(),
            export: std::sync::OnceLock::new(),
        });
        let recorder = Self { shared };
        if !recovery.chained {
            let mut genesis = [0u8; 32];
            getrandom::fill(&mut genesis).map_err(|e| RecordError::Io {
                path: path.display().to_string(),
                source: std::io::Error::other(format!("no randomness for the genesis: {e}")),
            })?;
            recorder.append_written(&Event::ChainStarted(ChainStarted {
                genesis: hex(&genesis),
                public_key,
                unchained_lines: recovery.lines as u64,
                turn: None,
            }))?;
        }
        if let (Some(saved), Some(sha256)) = (&recovery.torn_saved_to, &recovery.torn_sha256) {
            recorder.append_written(&Event::TornTailCut(TornTailCut {
                bytes: recovery.torn_bytes,
                sha256: sha256.clone(),
                saved_to: saved.display().to_string(),
                turn: None,
            }))?;
            // The cut was made durable a moment ago: its line is too, before anything else
            // (in `batch` it would otherwise wait for the next sync, and a power cut in between
            // would leave a cut no line accounts for).
            let shared = &recorder.shared;
            shared
                .sync_written(&mut shared.lock())
                .map_err(io_err(path))?;
        }
        if options.sync == RecordSync::Batch {
            tokio::spawn(batch_syncer(
                Arc::downgrade(&recorder.shared),
                recorder.shared.dirty.clone(),
            ));
        }
        Ok((recorder, recovery))
    }

    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The public key checkpoints are signed with (hex), if any.
    pub fn public_key(&self) -> Option<&str> {
        self.shared.signer.as_ref().map(|(_, p)| p.as_str())
    }

    /// Hands every checkpoint written from now on to `witness` (set once; later calls are
    /// ignored).
    pub fn witness_checkpoints(&self, witness: crate::evidence::witness::Witness) {
        let _ = self.shared.witness.set(witness);
    }

    /// The witness checkpoints go to, if one was set.
    pub fn witness(&self) -> Option<&crate::evidence::witness::Witness> {
        self.shared.witness.get()
    }

    /// Hands every line written from now on (without its newline) to `export`, with whether it
    /// is a checkpoint. `export` runs under the record's lock: it must not wait (set once).
    pub fn export_lines_to(&self, export: LineExport) {
        let _ = self.shared.export.set(export);
    }

    /// Releases the record's lock at shutdown (exiting releases it too).
    pub fn release(&self) {
        let file = self.shared.lock().file.clone();
        if let Err(e) = file.unlock() {
            tracing::warn!(record = %self.shared.path.display(), error = %e, "could not release the record's lock");
        }
    }

    /// Appends one event (`kind`, `turn` and the rest; `seq`, `at` and `prev` are added in
    /// front). Returns its seq once the line is as durable as the sync mode promises.
    ///
    /// The caller serializes its own line, and writes it under the record's lock, where its seq,
    /// time and chain hash are taken (so all follow file order). With `always` it then waits
    /// until an fdatasync covers the line: the first waiter finding none in flight runs one for
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
        // An event is an object whose text starts with `{"kind":`. A call line is 300-500 bytes:
        // room for one up front spares the doubling reallocations of an empty Vec.
        let mut body = Vec::with_capacity(LINE_CAPACITY);
        serde_json::to_writer(&mut body, event).map_err(|e| RecordError::Encode {
            kind: event.kind(),
            detail: e.to_string(),
        })?;
        self.write_line(Body::Event(&body))
    }

    /// Signs the chain up to here: appends a `checkpoint` line, unless there is no signing key
    /// or nothing was written since the last one. Returns its seq once durable (as
    /// [`Self::append`]).
    pub async fn checkpoint(&self, reason: &'static str) -> Result<Option<u64>, RecordError> {
        if self.shared.signer.is_none() || self.shared.lock().unsigned == 0 {
            return Ok(None);
        }
        let seq = self.write_line(Body::Checkpoint(reason))?;
        if self.shared.sync == RecordSync::Always {
            self.wait_synced(seq).await?;
        } else {
            self.shared.sync_now();
        }
        Ok(Some(seq))
    }

    fn write_line(&self, body: Body<'_>) -> Result<u64, RecordError> {
        let shared = &*self.shared;
        let mut st = shared.lock();
        if let Some(e) = &st.failed {
            return Err(shared.failed_error(e));
        }
        if matches!(body, Body::Event(_))
            && shared.due_for_rotation(&st)
            && let Err(e) = self.rotate(&mut st)
        {
            // The line still goes in, to the file it would have gone to without rotation; the
            // next try waits, so a name in the way does not cost every line a try.
            st.retry_rotation_at = Some(Instant::now() + ROTATION_RETRY);
            tracing::error!(record = %shared.path.display(), error = %e, retry_in_s = ROTATION_RETRY.as_secs(), "record rotation failed; writing on in the same file");
        }
        self.write_locked(&mut st, body)
    }

    /// Writes one line under the lock: seq, time and `prev` are taken here.
    fn write_locked(&self, st: &mut State, body: Body<'_>) -> Result<u64, RecordError> {
        let shared = &*self.shared;
        if let Some(e) = &st.failed {
            return Err(shared.failed_error(e));
        }
        let seq = st.next_seq;
        let at = now_rfc3339();
        let prev = st.prev.map(|h| hex(&h));
        let is_checkpoint = matches!(body, Body::Checkpoint(_));
        let signed;
        let body: &[u8] = match body {
            Body::Event(b) => b,
            Body::Checkpoint(reason) => {
                let Some((key, public)) = &shared.signer else {
                    return Err(RecordError::Encode {
                        kind: "checkpoint",
                        detail: "no signing key".into(),
                    });
                };
                let message = sharedos_proto::record::checkpoint_message(
                    seq,
                    prev.as_deref().unwrap_or(""),
                    &at,
                    reason,
                );
                let event = Event::Checkpoint(Checkpoint {
                    reason: reason.into(),
                    public_key: public.clone(),
                    signature: hex(&key.sign(&message).to_bytes()),
                    turn: None,
                });
                signed = serde_json::to_vec(&event).map_err(|e| RecordError::Encode {
                    kind: "checkpoint",
                    detail: e.to_string(),
                })?;
                &signed
            }
        };
        let mut line = Vec::with_capacity(body.len() + 150);
        line.extend_from_slice(b"{\"seq\":");
        line.extend_from_slice(seq.to_string().as_bytes());
        line.extend_from_slice(b",\"at\":\"");
        line.extend_from_slice(at.as_bytes());
        line.push(b'"');
        if let Some(prev) = &prev {
            line.extend_from_slice(b",\"prev\":\"");
            line.extend_from_slice(prev.as_bytes());
            line.push(b'"');
        }
        match body.get(1..) {
            Some(rest) if rest.len() > 1 => {
                line.push(b',');
                line.extend_from_slice(rest);
            }
            _ => line.push(b'}'),
        }
        let hash = line_hash(&line);
        line.push(b'\n');
        // One write(2) of one line; the file is opened for append.
        if let Err(e) = (&*st.file).write_all(&line) {
            // Cut a partial line off so that the next line does not follow a fragment.
            let _ = st.file.set_len(st.len);
            tracing::error!(path = %shared.path.display(), error = %e, "record write failed");
            return Err(RecordError::Io {
                path: shared.path.display().to_string(),
                source: e,
            });
        }
        st.len += line.len() as u64;
        st.next_seq += 1;
        st.prev = Some(hash);
        st.unsigned = if is_checkpoint { 0 } else { st.unsigned + 1 };
        let written = &line[..line.len() - 1];
        if is_checkpoint && let Some(w) = shared.witness.get() {
            w.checkpoint(written);
        }
        if let Some(export) = shared.export.get() {
            export(written, is_checkpoint);
        }
        if shared.sync == RecordSync::Batch && !st.dirty {
            st.dirty = true;
            shared.dirty.notify_one();
        }
        Ok(seq)
    }

    /// Closes the active file (signed, if there is a key, and synced), renames it to
    /// `<record>.<its first seq>`, and starts an empty, locked file under the record's name.
    fn rotate(&self, st: &mut State) -> Result<(), RecordError> {
        let shared = &*self.shared;
        let path = &shared.path;
        let rotated = rotated_name(path, st.first_seq);
        // Checked before anything is written: a rotation that cannot finish adds no checkpoint.
        if std::fs::symlink_metadata(&rotated).is_ok() {
            return Err(io_err(&rotated)(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "something already has the rotated file's name",
            )));
        }
        if shared.signer.is_some() && st.unsigned > 0 {
            self.write_locked(st, Body::Checkpoint("rotation"))?;
        }
        if let Err(e) = shared.sync_written(st) {
            st.failed = Some(e.to_string());
            return Err(io_err(path)(e));
        }
        let fresh = fresh_name(path);
        let _ = std::fs::remove_file(&fresh);
        let file = open_locked(&fresh, true)?;
        // The old file keeps its bytes under its new name; the record's name moves, in one
        // rename, to the new file: there is always a file under the record's name.
        std::fs::hard_link(path, &rotated).map_err(io_err(&rotated))?;
        std::fs::rename(&fresh, path).map_err(io_err(path))?;
        sync_parent(path);
        let _ = st.file.unlock();
        st.file = Arc::new(file);
        st.len = 0;
        st.first_seq = st.next_seq;
        st.begun = Instant::now();
        st.retry_rotation_at = None;
        tracing::info!(record = %path.display(), rotated = %rotated.display(), "record rotated");
        Ok(())
    }

    async fn wait_synced(&self, seq: u64) -> Result<(), RecordError> {
        let shared = &*self.shared;
        let mut synced = shared.synced_tx.subscribe();
        loop {
            let (leads, together) = {
                let mut st = shared.lock();
                if let Some(e) = &st.failed {
                    return Err(shared.failed_error(e));
                }
                if st.synced >= seq {
                    return Ok(());
                }
                (
                    !std::mem::replace(&mut st.sync_in_flight, true),
                    st.shared_last,
                )
            };
            if !leads {
                // Another append leads a sync; it publishes when done (or when it gives up).
                if synced.changed().await.is_err() {
                    return Err(RecordError::Stopped);
                }
                continue;
            }
            let mut lead = Leader {
                shared,
                done: false,
            };
            // When appends are arriving together (the last sync covered more than one line),
            // let every task that is ready to run (the runtime polls its sockets first: tokio
            // defers a yielded task until then) decide and write its line before syncing, so
            // that this one fdatasync covers them too. Under load each sync otherwise covered
            // about one line, and the syncs' own CPU (a third of the broker's) set the
            // throughput. For a lone caller the yield only cost: an empty poll that woke the
            // other runtime thread, 20-40 µs of a sequential `always` round trip (bench/NOTES.md).
            if together {
                tokio::task::yield_now().await;
            }
            let (target, file, from) = {
                let st = shared.lock();
                // Taken together: every line up to the target is in this file (a rotation
                // synced the earlier files before it swapped).
                (st.next_seq - 1, st.file.clone(), st.synced)
            };
            // With two or more runtime threads, the leader syncs on its own thread: handing the
            // fdatasync to the blocking pool cost two thread wake-ups per sync (there and back,
            // plus a sibling worker woken to run the resumed task), 7 context switches per
            // `always` call instead of 3.6 and fewer calls/s at 64 bridges (bench/NOTES.md).
            // Group commit bounds the blocking: one sync at a time, so at most one runtime
            // thread waits for the disk while the others serve. With a single runtime thread
            // that would stop everything for every sync (measured: 2,000 instead of 5,600
            // calls/s at 64 bridges), so there the pool does it.
            let pool = tokio::runtime::Handle::try_current()
                .ok()
                .filter(|h| h.metrics().num_workers() < 2);
            let failure = match pool {
                None => file.sync_data().err().map(|e| e.to_string()),
                Some(pool) => match pool.spawn_blocking(move || file.sync_data()).await {
                    Ok(r) => r.err().map(|e| e.to_string()),
                    Err(e) => Some(e.to_string()),
                },
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
                    None => {
                        st.synced = st.synced.max(target);
                        st.syncs += 1;
                        st.shared_last = target.saturating_sub(from) > 1;
                    }
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

    fn due_for_rotation(&self, st: &State) -> bool {
        st.len > 0
            && st.retry_rotation_at.is_none_or(|t| Instant::now() >= t)
            && (self.rotate_bytes.is_some_and(|b| st.len >= b)
                || self.rotate_age.is_some_and(|a| st.begun.elapsed() >= a))
    }

    /// Syncs every line written so far, under the lock, and says so to the waiting appenders.
    fn sync_written(&self, st: &mut State) -> std::io::Result<()> {
        st.file.sync_data()?;
        st.synced = st.next_seq - 1;
        st.dirty = false;
        self.synced_tx.send_replace(st.synced);
        Ok(())
    }

    fn sync_now(&self) {
        let file = self.lock().file.clone();
        if let Err(e) = file.sync_data() {
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

/// Reads record lines with `seq > after_seq` (and of `turn`, if given), at most `limit`, from
/// every file of the record in order. Returns the lines and whether more remain. A torn last
/// line is skipped (it is being written).
pub fn read_records(
    path: &Path,
    turn: Option<&str>,
    after_seq: u64,
    limit: usize,
) -> Result<(Vec<Value>, bool), RecordError> {
    let bounds = PageBounds {
        lines: limit,
        bytes: usize::MAX,
        depth: usize::MAX,
    };
    read_records_page(path, turn, after_seq, &bounds)
}

/// How much one page of record lines may carry.
#[derive(Debug, Clone, Copy)]
pub struct PageBounds {
    /// Lines.
    pub lines: usize,
    /// Bytes of line text, all lines together (a page always has at least one line).
    pub bytes: usize,
    /// Deepest nesting of `[` and `{` a line carried as it is may have.
    pub depth: usize,
}

/// What a page carries for a line it cannot carry as it is (longer than the page's bytes,
/// nested deeper than its depth, or not JSON that parses): the line's `seq`, `at`, `kind`,
/// `turn` and `callId` when they can be read, and `lineDigest` {bytes, sha256, reason}, the
/// SHA-256 of the line's bytes (what the next line's `prev` holds). `None` for a line without a
/// readable `seq` (not a record line).
fn stand_in(text: &str, reason: String) -> Option<Value> {
    #[derive(Deserialize)]
    struct Shallow {
        seq: u64,
        #[serde(default)]
        at: Option<String>,
        #[serde(default)]
        kind: Option<String>,
        #[serde(default)]
        turn: Option<String>,
        #[serde(default, rename = "callId")]
        call_id: Option<String>,
    }
    // Every other field is skipped, at any depth (serde_json skips without recursion).
    let shallow: Shallow = serde_json::from_str(text).ok()?;
    let mut line = Map::new();
    line.insert("seq".into(), shallow.seq.into());
    let mut put = |k: &str, v: Option<String>| {
        if let Some(mut v) = v {
            sharedos_proto::name::clip(&mut v, sharedos_proto::record::RECORD_MAX_STRING_BYTES);
            line.insert(k.into(), v.into());
        }
    };
    put("at", shallow.at);
    put("kind", shallow.kind);
    put("callId", shallow.call_id);
    line.insert(
        "turn".into(),
        shallow.turn.map_or(Value::Null, |mut t| {
            sharedos_proto::name::clip(&mut t, sharedos_proto::record::RECORD_MAX_STRING_BYTES);
            t.into()
        }),
    );
    line.insert(
        "lineDigest".into(),
        serde_json::json!({
            "bytes": text.len(),
            "sha256": hex(&line_hash(text.as_bytes())),
            "reason": reason,
        }),
    );
    Some(Value::Object(line))
}

/// [`read_records`], bounded in bytes and nesting too: a page stops before the line that would
/// take it past `bounds.bytes`, and a line no page could carry (see [`stand_in`]) is carried as
/// its stand-in, so every line of any record can be read, page by page.
pub fn read_records_page(
    path: &Path,
    turn: Option<&str>,
    after_seq: u64,
    bounds: &PageBounds,
) -> Result<(Vec<Value>, bool), RecordError> {
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for file_path in record_files(path)? {
        let file = match File::open(&file_path) {
            Ok(f) => f,
            // Rotated away between listing and opening: its lines are in the next name.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&file_path)(e)),
        };
        let mut reader = BufReader::new(file);
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader.read_line(&mut line).map_err(io_err(&file_path))?;
            if n == 0 || !line.ends_with('\n') {
                break;
            }
            let text = line.trim_end_matches('\n');
            let depth = sharedos_proto::nesting::json_depth(text.as_bytes());
            let parsed = if text.len() > bounds.bytes {
                Err(format!(
                    "the line is {} bytes, more than a page carries ({})",
                    text.len(),
                    bounds.bytes
                ))
            } else if depth > bounds.depth {
                Err(format!(
                    "the line is nested {depth} levels deep, deeper than a page carries ({})",
                    bounds.depth
                ))
            } else {
                serde_json::from_str::<Value>(text).map_err(|e| {
                    let mut why = format!("the line does not parse: {e}");
                    sharedos_proto::name::clip(&mut why, 200);
                    why
                })
            };
            let (value, size) = match parsed {
                Ok(v) => (v, text.len()),
                Err(why) => {
                    let Some(v) = stand_in(text, why) else {
                        continue;
                    };
                    let size = v.to_string().len();
                    (v, size)
                }
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
            if out.len() == bounds.lines || (!out.is_empty() && bytes + size > bounds.bytes) {
                return Ok((out, true));
            }
            bytes += size;
            out.push(value);
        }
    }
    Ok((out, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

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

    /// A page stops before the line that would take it past its bytes; a line too long or too
    /// deep for any page (an older broker kept arguments nested 126 deep) comes as its stand-in,
    /// with the SHA-256 the next line's `prev` holds, and the lines after it still come.
    #[test]
    fn pages_are_bounded_in_bytes_and_every_line_comes() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let deep = format!("{}{}", "[".repeat(126), "]".repeat(126));
        let lines = [
            r#"{"seq":1,"at":"A","kind":"turn_closed","turn":"t","reason":"a"}"#.to_owned(),
            format!(
                r#"{{"seq":2,"at":"A","kind":"call","turn":"t","callId":"t.1","tool":"x","arguments":{{"a":"{}"}}}}"#,
                "x".repeat(600)
            ),
            format!(
                r#"{{"seq":3,"at":"A","kind":"call","turn":"t","callId":"t.2","tool":"x","arguments":{{"a":"{}"}}}}"#,
                "x".repeat(2000)
            ),
            format!(
                r#"{{"seq":4,"at":"A","kind":"call","turn":"t","callId":"t.3","tool":"x","arguments":{deep}}}"#
            ),
            r#"{"seq":5,"at":"A","kind":"turn_closed","turn":"t","reason":"b"}"#.to_owned(),
        ];
        std::fs::write(&path, lines.join("\n") + "\n").expect("write");
        let bounds = PageBounds {
            lines: 100,
            bytes: 1000,
            depth: 100,
        };
        let (mut seen, mut after, mut pages) = (Vec::new(), 0, 0);
        loop {
            let (page, more) = read_records_page(&path, None, after, &bounds).expect("page");
            pages += 1;
            let bytes: usize = page.iter().map(|l| l.to_string().len()).sum();
            assert!(bytes <= 1000 || page.len() == 1, "{bytes} bytes");
            after = page.last().and_then(|l| l["seq"].as_u64()).expect("seq");
            seen.extend(page);
            if !more {
                break;
            }
        }
        let seqs: Vec<u64> = seen.iter().filter_map(|l| l["seq"].as_u64()).collect();
        assert_eq!(seqs, [1, 2, 3, 4, 5]);
        assert!(pages >= 2, "{pages} pages");
        for (i, seq) in [(2usize, 3u64), (3, 4)] {
            let line = &seen[i];
            assert_eq!(line["seq"], seq);
            assert_eq!(line["kind"], "call");
            assert!(line.get("arguments").is_none(), "{line}");
            let digest = &line["lineDigest"];
            assert_eq!(digest["bytes"], lines[i].len());
            assert_eq!(
                digest["sha256"],
                hex(&line_hash(lines[i].as_bytes())),
                "the hash the next line's prev holds"
            );
        }
        assert_eq!(seen[1]["arguments"]["a"].as_str().map(str::len), Some(600));
    }

    #[tokio::test]
    async fn seq_continues_across_reopen_and_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        {
            let (rec, recovery) = Recorder::open(&path, RecordSync::Always).expect("open");
            assert_eq!(recovery.last_seq, 0);
            // Line 1 starts the chain.
            assert_eq!(rec.append(&event("a", "t1")).await.expect("2"), 2);
            assert_eq!(rec.append(&event("b", "t2")).await.expect("3"), 3);
        }
        // Simulate a crash mid-write.
        let mut f = OpenOptions::new().append(true).open(&path).expect("open");
        f.write_all(b"{\"seq\":4,\"kind\":\"ca").expect("write");
        drop(f);
        let (rec, recovery) = Recorder::open(&path, RecordSync::Batch).expect("reopen");
        assert_eq!(recovery.last_seq, 3);
        assert_eq!(recovery.torn_bytes, 19);
        // The cut's line is synced at once, even in `batch`.
        assert_eq!(rec.shared.lock().synced, 4);
        let aside = recovery.torn_saved_to.expect("saved");
        assert!(
            std::fs::read_to_string(aside)
                .expect("torn")
                .contains("\"ca")
        );
        // The cut is on record (seq 4), and the chain goes on from the last whole line.
        assert_eq!(rec.append(&event("c", "t1")).await.expect("5"), 5);
        drop(rec);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (lines, more) = read_records(&path, Some("t1"), 0, 10).expect("read");
        assert!(!more);
        let seqs: Vec<u64> = lines
            .iter()
            .map(|l| l["seq"].as_u64().expect("seq"))
            .collect();
        assert_eq!(seqs, vec![2, 5]);
        let (all, _) = read_records(&path, None, 0, 10).expect("read");
        assert_eq!(all[3]["kind"], "torn_tail_cut");
        assert_eq!(all[3]["bytes"], 19);
        assert!(
            lines
                .iter()
                .all(|l| l["at"].as_str().is_some_and(|a| a.ends_with('Z')))
        );
        let (page, more) = read_records(&path, None, 0, 2).expect("page");
        assert_eq!(page.len(), 2);
        assert!(more);
    }

    /// Age counts from the active file's first line, not from when this broker opened it: a
    /// broker restarted every hour still rotates a daily record daily.
    #[tokio::test]
    async fn age_counts_from_the_files_first_line() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let options = |age: u64| RecordOptions {
            sync: RecordSync::Always,
            rotate_age: Some(Duration::from_secs(age)),
            ..RecordOptions::default()
        };
        {
            let (rec, _) = Recorder::open_with(&path, options(3600)).expect("open");
            rec.append(&event("a", "t1")).await.expect("a");
        }
        // The file's first line was written two hours ago.
        let text = std::fs::read_to_string(&path).expect("read");
        let two_hours_ago = (time::OffsetDateTime::now_utc() - time::Duration::hours(2))
            .format(&time::format_description::well_known::Rfc3339)
            .expect("fmt");
        let at = text
            .split("\"at\":\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .expect("at");
        std::fs::write(&path, text.replacen(at, &two_hours_ago, 1)).expect("write");
        let (rec, _) = Recorder::open_with(&path, options(3600)).expect("reopen");
        rec.append(&event("b", "t1")).await.expect("b");
        assert!(
            rotated_name(&path, 1).exists(),
            "an hour-old limit rotates a two-hour-old file"
        );
        // A young file is not rotated on reopen.
        drop(rec);
        let (rec, _) = Recorder::open_with(&path, options(3600)).expect("reopen");
        rec.append(&event("c", "t1")).await.expect("c");
        assert_eq!(record_files(&path).expect("files").len(), 2);
    }

    /// A rotation that cannot finish (something has the rotated file's name) writes the line
    /// anyway, adds no checkpoint, and is not tried again on every line.
    #[tokio::test]
    async fn a_failed_rotation_writes_the_line_and_backs_off() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let (rec, _) = Recorder::open_with(
            &path,
            RecordOptions {
                sync: RecordSync::Always,
                signing_key: Some(key),
                rotate_bytes: Some(1),
                ..RecordOptions::default()
            },
        )
        .expect("open");
        std::fs::create_dir(rotated_name(&path, 1)).expect("in the way");
        for i in 0..20 {
            rec.append(&event(&format!("r{i}"), "t1"))
                .await
                .expect("append");
        }
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            text.lines().count(),
            21,
            "the chain start and 20 lines, all here"
        );
        assert_eq!(text.matches("\"kind\":\"checkpoint\"").count(), 0);
    }

    /// Start-up reads back only to the newest file holding a broker start: a rotated file
    /// before it is not read (its damage is `records verify`'s to find), one after it is.
    #[tokio::test]
    async fn start_up_reads_from_the_last_start_only() {
        use sharedos_proto::record::BrokerStarted;
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let options = || RecordOptions {
            sync: RecordSync::Always,
            signing_key: Some(key.clone()),
            rotate_bytes: Some(600),
            ..RecordOptions::default()
        };
        let start = Event::BrokerStarted(BrokerStarted {
            version: "t".into(),
            tools: 1,
            config: "t".into(),
            policy_digest: None,
            turn: None,
        });
        let last = {
            let (rec, _) = Recorder::open_with(&path, options()).expect("open");
            rec.append(&start).await.expect("start");
            for i in 0..20 {
                rec.append(&event(&format!("first {i}"), "t1"))
                    .await
                    .expect("a");
            }
            rec.append(&start).await.expect("second start");
            let mut last = 0;
            for i in 0..5 {
                last = rec
                    .append(&event(&format!("second {i}"), "t2"))
                    .await
                    .expect("b");
            }
            last
        };
        let files = record_files(&path).expect("files");
        assert!(files.len() > 4, "{files:?}");
        // The oldest file, long before the last start, made unreadable JSON.
        std::fs::write(&files[0], "not json\n").expect("damage");
        let (rec, recovery) = Recorder::open_with(&path, options()).expect("reopen");
        assert_eq!(recovery.last_seq, last);
        // Chained already: no second chain start.
        let seq = rec.append(&event("after", "t3")).await.expect("c");
        assert_eq!(seq, last + 1);
        drop(rec);
        // The file holding the last start, damaged: start-up reads it, and refuses.
        let holding = files
            .iter()
            .rev()
            .find(|f| {
                String::from_utf8_lossy(&std::fs::read(f).expect("read"))
                    .contains("\"kind\":\"broker_started\"")
            })
            .expect("a file with the last start")
            .clone();
        std::fs::write(&holding, "not json\n").expect("damage");
        assert!(Recorder::open_with(&path, options()).is_err());
    }

    /// A new signing key is whole (64 hex digits, 0600) and kept across opens; a temporary file
    /// left by a creation that was killed does not get in the way and is cleaned up; an empty key
    /// file is not replaced (it may be the key of records already signed): it is an error.
    #[test]
    fn a_signing_key_is_made_whole_and_kept() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("k.key");
        std::fs::write(format!("{}.{}.new", path.display(), std::process::id()), "")
            .expect("stale temp");
        let made = load_or_create_signing_key(&path).expect("make");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text.len(), 65, "{text:?}");
        assert!(text.trim().bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(
            std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["k.key", "k.key.pub"]);
        let again = load_or_create_signing_key(&path).expect("load");
        assert_eq!(again.verifying_key(), made.verifying_key());
        // Another broker's creation that comes second (its link finds the key there) keeps the
        // first key, and leaves nothing behind.
        create_signing_key(&path).expect("a second creation");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), text);
        let after: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").collect();
        assert_eq!(after.len(), 2, "{after:?}");
        let empty = dir.path().join("empty.key");
        std::fs::write(&empty, "").expect("w");
        let e = load_or_create_signing_key(&empty).expect_err("an empty key");
        assert!(e.to_string().contains("not 64 hex digits"), "{e}");
    }

    /// A start whose close-out was cut short (only `unknown` calls and `broker_restart` closes
    /// after it) is not one to stop at: what it was closing out lies before it.
    #[test]
    fn a_start_cut_short_is_passed_over() {
        let start = r#"{"seq":5,"kind":"broker_started"}"#;
        let unknown = r#"{"seq":6,"kind":"call","outcome":"unknown"}"#;
        let restart = r#"{"seq":7,"kind":"turn_closed","reason":"broker_restart"}"#;
        let opened = r#"{"seq":8,"kind":"turn_opened"}"#;
        let file = |lines: &[&str]| lines.join("\n").into_bytes();
        assert_eq!(
            finished_start(&file(&[start, unknown, restart]), false),
            (false, false)
        );
        assert_eq!(
            finished_start(&file(&[start, unknown, restart, opened]), false),
            (true, true)
        );
        // The activity is in a later file.
        assert_eq!(finished_start(&file(&[start, unknown]), true), (true, true));
        // Activity before an unfinished start still counts for an earlier one.
        assert_eq!(
            finished_start(&file(&[opened, start, unknown]), false),
            (false, true)
        );
    }

    /// `n` appends spawned together, all awaited.
    async fn burst(rec: &Recorder, n: usize) {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let rec = rec.clone();
                tokio::spawn(async move { rec.append(&event("call", "t")).await })
            })
            .collect();
        for t in tasks {
            t.await.expect("join").expect("append");
        }
    }

    /// Appends ready to run together share one fdatasync: the leader yields before it syncs, so
    /// the others write their lines first. (Without the yield the leader synced its own line
    /// alone, and the other 63 needed a second sync; under load, about one sync per line.)
    #[tokio::test]
    async fn appends_ready_together_share_one_sync() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Always).expect("open");
        let before = rec.shared.lock().syncs;
        // Spawned on this one-thread runtime, all 64 are ready before any of them runs.
        burst(&rec, 64).await;
        assert_eq!(
            rec.shared.lock().syncs - before,
            1,
            "one fdatasync for 64 lines"
        );
        let (lines, _) = read_records(&path, Some("t"), 0, 100).expect("read");
        assert_eq!(lines.len(), 64);
    }

    /// A lone appender syncs without yielding (each sync covers its one line); a burst turns
    /// the yield back on after one sync, and the rest of the burst shares one or two more.
    #[tokio::test]
    async fn a_lone_appender_does_not_yield_and_a_burst_turns_it_back_on() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Always).expect("open");
        for _ in 0..3 {
            rec.append(&event("call", "t")).await.expect("append");
        }
        let before = {
            let st = rec.shared.lock();
            assert!(!st.shared_last, "one line per sync: no yield");
            st.syncs
        };
        burst(&rec, 64).await;
        // The first leader syncs its line alone; the next one finds the lines written meanwhile
        // and, from then on, leaders yield (how many lines the second sync finds depends on
        // when the blocking pool's sync returns, hence two or three).
        let syncs = rec.shared.lock().syncs - before;
        assert!((2..=3).contains(&syncs), "{syncs} syncs for a burst of 64");
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
        assert_eq!(seqs, (2..=201).collect::<Vec<u64>>());
        let (lines, _) = read_records(&path, None, 0, 1000).expect("read");
        assert_eq!(lines.len(), 201);
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
        assert_eq!(seq, tries + 2);
        let (lines, _) = read_records(&path, Some("t"), 0, 2000).expect("read");
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
        assert_eq!(seq, 66);
        let (lines, _) = read_records(&path, Some("t"), 0, 2000).expect("read");
        assert_eq!(lines.len(), 65, "every dropped append's line was written");
        assert_eq!(lines[64]["reason"], "b");
    }

    #[tokio::test]
    async fn batch_lines_are_whole_and_in_order_with_seq_and_at_first() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let (rec, _) = Recorder::open(&path, RecordSync::Batch).expect("open");
        assert_eq!(rec.append(&event("x", "t")).await.expect("2"), 2);
        let global = Event::PolicyReloaded(PolicyReloaded {
            version: 2,
            policies: 3,
            path: "p.cedar".into(),
            policy_digest: None,
            turn: None,
        });
        assert_eq!(rec.append(&global).await.expect("3"), 3);
        drop(rec);
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("whole JSON line"))
            .collect();
        assert_eq!(lines[0]["seq"], 1);
        assert_eq!(lines[0]["kind"], "chain_started");
        assert_eq!(lines[1]["seq"], 2);
        assert_eq!(lines[2]["seq"], 3);
        assert_eq!(lines[2]["turn"], Value::Null);
        assert!(text.starts_with("{\"seq\":1,\"at\":"), "{text}");
        // Then `prev`, the SHA-256 of the line before.
        let second = text.lines().nth(1).expect("line 2");
        let want = format!(
            "\"prev\":\"{}\",\"kind\":",
            hex(&line_hash(text.lines().next().expect("line 1").as_bytes()))
        );
        assert!(second.contains(&want), "{second}");
        // Each line reads back as the event that was written.
        for (l, want) in text.lines().skip(1).zip([event("x", "t"), global]) {
            let line: sharedos_proto::record::RecordLine = serde_json::from_str(l).expect("typed");
            assert_eq!(line.event, want);
        }
    }

    #[test]
    fn a_call_left_waiting_for_approval_is_open_until_its_call_line() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        let requested = |seq: u64, call: &str| {
            format!(
                r#"{{"seq":{seq},"at":"A","kind":"approval_requested","turn":"t","callId":"{call}","requestId":"1","approval":"ab","principal":"alice","tool":"files.read","arguments":{{}},"requirement":null,"policies":["ask"],"expiresAt":"B"}}"#
            )
        };
        let answered = r#"{"seq":3,"at":"A","kind":"call","turn":"t","callId":"t.1","requestId":"1","tool":"files.read","arguments":{},"requirement":null,"outcome":"denied","code":"approval_denied"}"#;
        std::fs::write(
            &path,
            format!(
                "{}\n{}\n{answered}\n",
                requested(1, "t.1"),
                requested(2, "t.2")
            ),
        )
        .expect("w");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        let _guard = rt.enter();
        let (_rec, recovery) = Recorder::open(&path, RecordSync::Always).expect("open");
        let open: Vec<&str> = recovery
            .open_intents
            .iter()
            .map(|i| i.call_id.as_str())
            .collect();
        assert_eq!(open, ["t.2"]);
        assert_eq!(recovery.open_intents[0].tool, "files.read");
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
