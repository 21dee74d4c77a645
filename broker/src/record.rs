//! The record: append-only JSON Lines, one object per event, owned by one writer task.
//!
//! Every line has `seq` (strictly increasing, also across restarts), `at` (UTC, RFC 3339),
//! `kind` and `turn`. [`Recorder::append`] returns only once the line is written, and with
//! [`RecordSync::Always`] once it is on disk (fdatasync). Concurrent appends share one sync
//! (group commit): the writer drains everything queued, writes it, syncs once, then acknowledges
//! all of it. With [`RecordSync::Batch`] a line is acknowledged once written to the OS (it survives
//! a broker crash) and synced within [`BATCH_SYNC_INTERVAL`].
//!
//! On open, a torn last line (a crash mid-write) is detected, reported, moved aside to
//! `<record>.torn` and cut off, never parsed as if whole. This module never drops a line: the
//! queue is bounded and producers wait.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::sync::{mpsc, oneshot};

/// Lines queued to the writer at most; producers wait beyond it.
pub const RECORD_QUEUE: usize = 8192;
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
}

struct Entry {
    event: Map<String, Value>,
    ack: oneshot::Sender<Result<u64, String>>,
}

/// A handle to the writer. Cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::Sender<Entry>,
    path: Arc<PathBuf>,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> RecordError + '_ {
    move |source| RecordError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Adds a turn's stamp (e.g. a column's system identity) to a record line; fields the line
/// already has win.
pub fn apply_stamp(line: &mut Map<String, Value>, stamp: Option<&Map<String, Value>>) {
    for (k, v) in stamp.into_iter().flatten() {
        line.entry(k.clone()).or_insert_with(|| v.clone());
    }
}

/// RFC 3339 UTC time with microseconds.
pub fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    now.format(&format)
        .unwrap_or_else(|_| now.unix_timestamp().to_string())
}

/// Scans an existing record: the last seq, and a torn tail if any (cut off and saved aside).
fn recover(path: &Path, file: &mut File) -> Result<Recovery, RecordError> {
    let err = io_err(path);
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(0)).map_err(&err)?;
    file.read_to_end(&mut bytes).map_err(&err)?;
    let mut recovery = Recovery::default();
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
    if good_end < bytes.len() {
        let torn = &bytes[good_end..];
        let aside = PathBuf::from(format!("{}.torn", path.display()));
        let mut saved = OpenOptions::new()
            .create(true)
            .append(true)
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

impl Recorder {
    /// Opens (or creates) the record and starts its writer task.
    pub fn open(path: &Path, sync: RecordSync) -> Result<(Self, Recovery), RecordError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io_err(path))?;
        let recovery = recover(path, &mut file)?;
        let (tx, rx) = mpsc::channel(RECORD_QUEUE);
        let writer = Writer {
            file: Arc::new(file),
            path: path.to_path_buf(),
            next_seq: recovery.last_seq + 1,
            sync,
        };
        tokio::spawn(writer.run(rx));
        Ok((
            Self {
                tx,
                path: Arc::new(path.to_path_buf()),
            },
            recovery,
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event (`kind`, `turn` and the rest; `seq` and `at` are added). Returns its seq
    /// once the line is as durable as the sync mode promises.
    pub async fn append(&self, event: Map<String, Value>) -> Result<u64, RecordError> {
        let (ack, done) = oneshot::channel();
        self.tx
            .send(Entry { event, ack })
            .await
            .map_err(|_| RecordError::Stopped)?;
        match done.await {
            Ok(Ok(seq)) => Ok(seq),
            Ok(Err(e)) => Err(RecordError::Io {
                path: self.path.display().to_string(),
                source: std::io::Error::other(e),
            }),
            Err(_) => Err(RecordError::Stopped),
        }
    }
}

struct Writer {
    file: Arc<File>,
    path: PathBuf,
    next_seq: u64,
    sync: RecordSync,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Entry>) {
        let mut batch: Vec<Entry> = Vec::new();
        let mut dirty_since: Option<Instant> = None;
        let mut tick = tokio::time::interval(BATCH_SYNC_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                n = rx.recv_many(&mut batch, RECORD_QUEUE) => {
                    if n == 0 {
                        break;
                    }
                    self.commit(&mut batch, &mut dirty_since).await;
                }
                _ = tick.tick(), if dirty_since.is_some() => {
                    self.sync_now().await;
                    dirty_since = None;
                }
            }
        }
        if dirty_since.is_some() {
            self.sync_now().await;
        }
    }

    async fn sync_now(&self) {
        let file = self.file.clone();
        match tokio::task::spawn_blocking(move || file.sync_data()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(path = %self.path.display(), error = %e, "record sync failed")
            }
            Err(e) => tracing::error!(error = %e, "record sync task failed"),
        }
    }

    async fn commit(&mut self, batch: &mut Vec<Entry>, dirty_since: &mut Option<Instant>) {
        let mut text = Vec::with_capacity(batch.len() * 256);
        let at = now_rfc3339();
        let first_seq = self.next_seq;
        for entry in batch.iter_mut() {
            let mut line = Map::new();
            line.insert("seq".into(), Value::from(self.next_seq));
            line.insert("at".into(), Value::from(at.clone()));
            line.append(&mut entry.event);
            if !line.contains_key("turn") {
                line.insert("turn".into(), Value::Null);
            }
            // A Map of JSON values always serializes.
            if serde_json::to_writer(&mut text, &line).is_err() {
                text.extend_from_slice(b"{}");
            }
            text.push(b'\n');
            self.next_seq += 1;
        }
        let file = self.file.clone();
        let sync = self.sync == RecordSync::Always;
        let result = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            (&*file).write_all(&text)?;
            if sync {
                file.sync_data()?;
            }
            Ok(())
        })
        .await;
        let result = match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = &result {
            tracing::error!(path = %self.path.display(), error = %e, "record write failed");
        } else if !sync && dirty_since.is_none() {
            *dirty_since = Some(Instant::now());
        }
        for (i, entry) in batch.drain(..).enumerate() {
            let _ = entry
                .ack
                .send(result.clone().map(|()| first_seq + i as u64));
        }
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
    use serde_json::json;

    fn event(kind: &str, turn: &str) -> Map<String, Value> {
        json!({"kind": kind, "turn": turn})
            .as_object()
            .cloned()
            .expect("object")
    }

    #[tokio::test]
    async fn seq_continues_across_reopen_and_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        {
            let (rec, recovery) = Recorder::open(&path, RecordSync::Always).expect("open");
            assert_eq!(recovery.last_seq, 0);
            assert_eq!(rec.append(event("a", "t1")).await.expect("1"), 1);
            assert_eq!(rec.append(event("b", "t2")).await.expect("2"), 2);
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
        assert_eq!(rec.append(event("c", "t1")).await.expect("3"), 3);
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
                rec.append(event("call", &format!("t{}", i % 4))).await
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
