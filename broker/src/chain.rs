//! Checking the record: its hash chain, its seqs and its signed checkpoints, across rotated
//! files (`sharedos-broker records verify`).
//!
//! Every line after `chain_started` must carry in `prev` the SHA-256 of the line before it, and
//! `seq` must grow by one from line to line. Each `checkpoint` must verify under the key: the one
//! given, else the one the chain recorded when it started. The first line that breaks a rule
//! ends the check, and the report names it: a changed line (found by the next line's `prev`), a
//! missing or reordered one (by `seq`), a partial line (a torn write or a truncation), a forged
//! or foreign signature. Lines after the last checkpoint are chained but unsigned: the report
//! counts them (a broker killed before its next checkpoint leaves some; the next checkpoint of
//! the next broker covers them).
//!
//! What the chain and the signatures cannot show is a clean cut at the end: lines removed after
//! the last checkpoint (or with the last checkpoints) leave a record that verifies. A witness
//! closes that: checkpoints the broker handed out as it signed them (a witness file, a witness
//! command, the OpenTelemetry log export), kept where the broker's uid cannot rewrite them.
//! [`verify_witnessed`] checks that every witnessed checkpoint is in the record with the same
//! bytes (the same SHA-256), and that the record does not end before the newest of them.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use serde_json::{Map, Value};
use sharedos_proto::catalog::hex;
use sharedos_proto::record::checkpoint_message;

use crate::record::{RecordError, line_hash, parse_hex32, record_files};

/// Where the key that checks the signatures came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// Given by the caller (a file it holds).
    Given(String),
    /// Read from the record's own `chain_started` line: it shows the record is whole under the
    /// key it names, not whose key that is.
    Recorded,
    /// No key: no checkpoint was met.
    None,
}

/// The first line that breaks the chain, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    /// The seq the fault is at (the missing seq, the changed line's seq, ...).
    pub seq: u64,
    pub file: PathBuf,
    /// 1-based line number in `file` where it was found.
    pub line: usize,
    pub reason: String,
}

/// What [`verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub files: Vec<PathBuf>,
    pub lines: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    /// Lines before the chain began (a record written before chaining).
    pub unchained: u64,
    /// The seq of the `chain_started` line.
    pub chain_start: Option<u64>,
    pub checkpoints: u64,
    pub last_checkpoint: Option<u64>,
    /// Chained lines after the last checkpoint (not yet signed).
    pub unsigned_tail: u64,
    /// `torn_tail_cut` lines: torn writes a broker cut off when it opened the record.
    pub torn_cuts: u64,
    /// The key the checkpoints were checked with (hex).
    pub key: Option<String>,
    pub key_source: KeySource,
    pub broken: Option<Broken>,
    /// With a witness: its checkpoints found in the record with the same hash.
    pub witnessed: u64,
    /// With a witness: the newest checkpoint it holds (its seq).
    pub witness_newest: Option<u64>,
}

impl Report {
    /// Everything verifies: a chain, whole, with every signature good.
    pub fn ok(&self) -> bool {
        self.broken.is_none() && self.chain_start.is_some()
    }
}

/// Reads a public key file: 64 hex digits (what the broker writes at `<key>.pub`).
pub fn read_public_key(path: &Path) -> Result<VerifyingKey, RecordError> {
    let err = |detail: String| RecordError::Key {
        path: path.display().to_string(),
        detail,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let bytes = parse_hex32(text.trim())
        .ok_or_else(|| err("not 64 hex digits (an Ed25519 public key)".into()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| err(format!("not an Ed25519 public key: {e}")))
}

/// One line of one file, as read.
struct Line {
    file: usize,
    number: usize,
    bytes: Vec<u8>,
    /// Ended by a newline.
    whole: bool,
}

/// The lines of `files`, in order.
struct Lines {
    files: Vec<PathBuf>,
    current: Option<(usize, BufReader<File>, usize)>,
    next_file: usize,
}

impl Lines {
    fn next_line(&mut self) -> Result<Option<Line>, RecordError> {
        loop {
            if self.current.is_none() {
                let Some(path) = self.files.get(self.next_file) else {
                    return Ok(None);
                };
                let file = File::open(path).map_err(|source| RecordError::Io {
                    path: path.display().to_string(),
                    source,
                })?;
                self.current = Some((self.next_file, BufReader::new(file), 0));
                self.next_file += 1;
            }
            let Some((index, reader, number)) = self.current.as_mut() else {
                continue;
            };
            let mut bytes = Vec::new();
            let n = reader
                .read_until(b'\n', &mut bytes)
                .map_err(|source| RecordError::Io {
                    path: self.files[*index].display().to_string(),
                    source,
                })?;
            if n == 0 {
                self.current = None;
                continue;
            }
            *number += 1;
            let whole = bytes.last() == Some(&b'\n');
            if whole {
                bytes.pop();
            }
            return Ok(Some(Line {
                file: *index,
                number: *number,
                bytes,
                whole,
            }));
        }
    }
}

/// Checks the record at `path` (its rotated files first): chain, seqs and signatures, with
/// `key` if given, else with the key its chain recorded.
pub fn verify(path: &Path, key: Option<(&VerifyingKey, String)>) -> Result<Report, RecordError> {
    verify_witnessed(path, key, None)
}

/// Most bytes of one witness line (a checkpoint line is about 400).
pub const MAX_WITNESS_LINE: usize = 64 * 1024;

/// Checkpoints as a witness holds them: seq to the SHA-256 of the checkpoint's record line.
#[derive(Debug, Clone, Default)]
pub struct Witness {
    pub checkpoints: std::collections::BTreeMap<u64, [u8; 32]>,
}

impl Witness {
    /// Reads a witness file: one JSON object per line, either a checkpoint's record line itself
    /// (what the broker appends to `witness_file`, hands to `witness_command` and exports as an
    /// OpenTelemetry log body, and what `records checkpoint --json` prints), or an exported log
    /// record whose `body` (a string, or `{"stringValue": ...}`) is that line (exported lines of
    /// other kinds are passed over). Blank lines are passed over; anything else is an error
    /// naming the line.
    pub fn read(path: &Path) -> Result<Self, RecordError> {
        let text = std::fs::read(path).map_err(|source| RecordError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut out = Self::default();
        for (i, raw) in text.split(|b| *b == b'\n').enumerate() {
            let corrupt = |detail: String| RecordError::Corrupt {
                path: path.display().to_string(),
                line: i + 1,
                detail,
            };
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            if raw.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if raw.len() > MAX_WITNESS_LINE {
                return Err(corrupt(format!(
                    "longer than {MAX_WITNESS_LINE} bytes: not a witnessed checkpoint"
                )));
            }
            let obj: Map<String, Value> =
                serde_json::from_slice(raw).map_err(|e| corrupt(format!("not JSON: {e}")))?;
            let body = match obj.get("body") {
                Some(Value::String(s)) => Some(s.as_str()),
                Some(Value::Object(o)) => o.get("stringValue").and_then(Value::as_str),
                _ => None,
            };
            let exported = body.is_some();
            let (line, obj): (&[u8], Map<String, Value>) = match body {
                Some(b) => (
                    b.as_bytes(),
                    serde_json::from_str(b)
                        .map_err(|e| corrupt(format!("its `body` is not a JSON object: {e}")))?,
                ),
                None => (raw, obj),
            };
            if obj.get("kind").and_then(Value::as_str) != Some("checkpoint") {
                // An export of every record line holds the checkpoints among the rest.
                if exported {
                    continue;
                }
                return Err(corrupt("not a `checkpoint` line".into()));
            }
            let seq = obj
                .get("seq")
                .and_then(Value::as_u64)
                .ok_or_else(|| corrupt("no numeric `seq`".into()))?;
            let hash = line_hash(line);
            if let Some(other) = out.checkpoints.insert(seq, hash)
                && other != hash
            {
                return Err(corrupt(format!(
                    "two different checkpoints at seq {seq}: the witness itself disagrees"
                )));
            }
        }
        Ok(out)
    }
}

/// [`verify`], and with a witness: every witnessed checkpoint must be in the record with the
/// same hash, and the record must reach the newest one.
pub fn verify_witnessed(
    path: &Path,
    key: Option<(&VerifyingKey, String)>,
    witness: Option<&Witness>,
) -> Result<Report, RecordError> {
    let files = record_files(path)?;
    if files.is_empty() {
        return Err(RecordError::Io {
            path: path.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no record here"),
        });
    }
    let mut report = verify_files(files, key, witness)?;
    if let Some(w) = witness
        && report.broken.is_none()
        && let Some((&newest, _)) = w.checkpoints.last_key_value()
        && report.last_seq.is_none_or(|last| last < newest)
    {
        let last = report.last_seq.unwrap_or(0);
        report.broken = Some(Broken {
            seq: newest,
            file: report.files.last().cloned().unwrap_or_default(),
            line: 0,
            reason: format!(
                "the record ends at seq {last}, before the witnessed checkpoint at seq {newest}: lines after seq {last} were cut"
            ),
        });
    }
    Ok(report)
}

/// [`verify`] over the given files, in order.
pub fn verify_files(
    files: Vec<PathBuf>,
    key: Option<(&VerifyingKey, String)>,
    witness: Option<&Witness>,
) -> Result<Report, RecordError> {
    let mut report = Report {
        files: files.clone(),
        lines: 0,
        first_seq: None,
        last_seq: None,
        unchained: 0,
        chain_start: None,
        checkpoints: 0,
        last_checkpoint: None,
        unsigned_tail: 0,
        torn_cuts: 0,
        key: key.as_ref().map(|(k, _)| hex(k.as_bytes())),
        key_source: match &key {
            Some((_, from)) => KeySource::Given(from.clone()),
            None => KeySource::None,
        },
        broken: None,
        witnessed: 0,
        witness_newest: witness.and_then(|w| w.checkpoints.keys().next_back().copied()),
    };
    let given = key.map(|(k, _)| *k);
    let mut recorded: Option<VerifyingKey> = None;
    let mut lines = Lines {
        files,
        current: None,
        next_file: 0,
    };
    let mut prev: Option<([u8; 32], u64)> = None;
    let mut next = lines.next_line()?;
    while let Some(line) = next.take() {
        next = lines.next_line()?;
        let expected = prev.map(|(_, s)| s + 1);
        let broken = |seq: u64, reason: String| Broken {
            seq,
            file: lines.files[line.file].clone(),
            line: line.number,
            reason,
        };
        let fallback_seq = expected.unwrap_or(1);
        let after = match prev {
            Some((_, s)) => format!("the line after seq {s}"),
            None => "the first line".to_owned(),
        };
        if !line.whole {
            report.broken = Some(broken(
                fallback_seq,
                format!(
                    "{after} is cut off ({} bytes, no newline): a torn write or a truncation",
                    line.bytes.len()
                ),
            ));
            break;
        }
        let obj: Map<String, Value> = match serde_json::from_slice(&line.bytes) {
            Ok(o) => o,
            Err(e) => {
                report.broken = Some(broken(
                    fallback_seq,
                    format!("{after} is not a JSON object ({e}): it was changed"),
                ));
                break;
            }
        };
        let Some(seq) = obj.get("seq").and_then(Value::as_u64) else {
            report.broken = Some(broken(
                fallback_seq,
                format!("{after} has no numeric `seq`"),
            ));
            break;
        };
        if let Some(want) = expected
            && seq != want
        {
            let reason = if seq > want {
                format!(
                    "seq {want} is missing: seq {seq} follows seq {} (a line was deleted, moved or its seq changed)",
                    want - 1
                )
            } else {
                format!(
                    "seq {want} is missing: seq {seq} follows seq {} (lines out of order, repeated or renumbered)",
                    want - 1
                )
            };
            report.broken = Some(broken(want, reason));
            break;
        }
        report.lines += 1;
        report.first_seq.get_or_insert(seq);
        report.last_seq = Some(seq);
        let text = |k: &str| obj.get(k).and_then(Value::as_str);
        let kind = text("kind").unwrap_or("");
        let line_prev = text("prev");
        let hash = line_hash(&line.bytes);
        if let Some(want) = witness.and_then(|w| w.checkpoints.get(&seq)) {
            if *want != hash {
                report.broken = Some(broken(
                    seq,
                    format!(
                        "seq {seq} differs from the witnessed checkpoint at seq {seq}: the record was rewritten up to here (and re-signed, if its signatures verify)"
                    ),
                ));
                break;
            }
            report.witnessed += 1;
        }
        if report.chain_start.is_none() {
            if kind == "chain_started" {
                let want = prev.map(|(h, _)| hex(&h));
                if line_prev.map(str::to_owned) != want {
                    report.broken = Some(broken(
                        seq,
                        match (&want, line_prev) {
                            (Some(_), _) => format!(
                                "the chain's start does not chain to seq {} before it",
                                seq - 1
                            ),
                            (None, _) => {
                                "the chain's first line has a `prev`, but nothing comes before it"
                                    .into()
                            }
                        },
                    ));
                    break;
                }
                report.chain_start = Some(seq);
                report.unsigned_tail = 1;
                recorded = text("publicKey")
                    .and_then(parse_hex32)
                    .and_then(|b| VerifyingKey::from_bytes(&b).ok());
            } else if line_prev.is_some() {
                report.broken = Some(broken(
                    seq,
                    format!(
                        "seq {seq} is chained but no `chain_started` line comes before it: the chain's start was removed or changed"
                    ),
                ));
                break;
            } else {
                report.unchained += 1;
            }
        } else {
            let want = prev.map(|(h, _)| hex(&h)).unwrap_or_default();
            if line_prev != Some(want.as_str()) {
                // Which of the two changed? If the next line chains to this one, this one is
                // as written, and the line before it is not.
                let next_chains = next.as_ref().is_some_and(|n| {
                    n.whole
                        && serde_json::from_slice::<Map<String, Value>>(&n.bytes)
                            .ok()
                            .and_then(|o| o.get("prev").and_then(Value::as_str).map(str::to_owned))
                            == Some(hex(&hash))
                });
                let before = seq - 1;
                report.broken = Some(if line_prev.is_none() {
                    broken(
                        seq,
                        format!("seq {seq} has no `prev`: the chain breaks here"),
                    )
                } else if next_chains || next.is_none() {
                    broken(
                        before,
                        format!(
                            "seq {before} was changed: its bytes no longer hash to the `prev` of seq {seq}"
                        ),
                    )
                } else {
                    broken(
                        seq,
                        format!(
                            "seq {seq} was changed: its `prev` is not the hash of seq {before}"
                        ),
                    )
                });
                break;
            }
            if kind == "checkpoint" {
                let Some(k) = given.or(recorded) else {
                    report.broken = Some(broken(
                        seq,
                        "a checkpoint, but no key to check it: the chain recorded none and none was given".into(),
                    ));
                    break;
                };
                if report.key.is_none() {
                    report.key = Some(hex(k.as_bytes()));
                    report.key_source = KeySource::Recorded;
                }
                let named = text("publicKey").unwrap_or("");
                if named != hex(k.as_bytes()) {
                    report.broken = Some(broken(
                        seq,
                        format!(
                            "the checkpoint at seq {seq} names key {named}, not the key it is checked with ({})",
                            hex(k.as_bytes())
                        ),
                    ));
                    break;
                }
                let message = checkpoint_message(
                    seq,
                    line_prev.unwrap_or(""),
                    text("at").unwrap_or(""),
                    text("reason").unwrap_or(""),
                );
                let good = text("signature")
                    .and_then(parse_hex64)
                    .map(|b| Signature::from_bytes(&b))
                    .is_some_and(|sig| k.verify(&message, &sig).is_ok());
                if !good {
                    report.broken = Some(broken(
                        seq,
                        format!("the signature of the checkpoint at seq {seq} does not verify"),
                    ));
                    break;
                }
                report.checkpoints += 1;
                report.last_checkpoint = Some(seq);
                report.unsigned_tail = 0;
            } else {
                report.unsigned_tail += 1;
            }
            if kind == "torn_tail_cut" {
                report.torn_cuts += 1;
            }
            if kind == "chain_started" {
                report.broken = Some(broken(
                    seq,
                    format!("a second `chain_started` at seq {seq}: a chain starts once"),
                ));
                break;
            }
        }
        prev = Some((hash, seq));
    }
    Ok(report)
}

/// The newest `checkpoint` line of the record at `path` (its rotated files too), as written:
/// what `records checkpoint --json` prints, for anchoring by hand. `None`: no checkpoint.
pub fn newest_checkpoint(path: &Path) -> Result<Option<String>, RecordError> {
    for file in record_files(path)?.iter().rev() {
        let bytes = std::fs::read(file).map_err(|source| RecordError::Io {
            path: file.display().to_string(),
            source,
        })?;
        // Only whole lines: a torn tail is not a checkpoint.
        let whole = match bytes.iter().rposition(|b| *b == b'\n') {
            Some(end) => &bytes[..end],
            None => continue,
        };
        for line in whole.split(|b| *b == b'\n').rev() {
            let Ok(obj) = serde_json::from_slice::<Map<String, Value>>(line) else {
                continue;
            };
            if obj.get("kind").and_then(Value::as_str) == Some("checkpoint") {
                return Ok(Some(String::from_utf8_lossy(line).into_owned()));
            }
        }
    }
    Ok(None)
}

/// 128 hex digits as 64 bytes (a signature).
fn parse_hex64(text: &str) -> Option<[u8; 64]> {
    let a = parse_hex32(text.get(..64)?)?;
    let b = parse_hex32(text.get(64..)?)?;
    let mut out = [0u8; 64];
    out[..32].copy_from_slice(&a);
    out[32..].copy_from_slice(&b);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RecordOptions, RecordSync, Recorder};
    use ed25519_dalek::SigningKey;
    use sharedos_proto::record::{Event, TurnClosed};

    fn event(reason: &str) -> Event {
        Event::TurnClosed(TurnClosed {
            turn: "t".into(),
            reason: reason.into(),
            calls: None,
            system_identity: None,
        })
    }

    fn key(byte: u8) -> SigningKey {
        SigningKey::from_bytes(&[byte; 32])
    }

    /// `always`, signed with key 7, rotating after `rotate` bytes if given.
    fn options(rotate: Option<u64>) -> RecordOptions {
        RecordOptions {
            sync: RecordSync::Always,
            signing_key: Some(key(7)),
            rotate_bytes: rotate,
            rotate_age: None,
        }
    }

    /// A record of a chain start, 6 lines, a checkpoint, 3 lines and a last checkpoint, with
    /// rotation after every ~600 bytes when `rotate` is given.
    async fn written(dir: &Path, rotate: Option<u64>) -> PathBuf {
        let path = dir.join("rec.jsonl");
        let (rec, _) = Recorder::open_with(&path, options(rotate)).expect("open");
        for i in 0..6 {
            rec.append(&event(&format!("a{i}"))).await.expect("append");
        }
        rec.checkpoint("interval").await.expect("cp");
        for i in 0..3 {
            rec.append(&event(&format!("b{i}"))).await.expect("append");
        }
        rec.checkpoint("shutdown").await.expect("cp");
        path
    }

    fn lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path)
            .expect("read")
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn write(path: &Path, lines: &[String]) {
        std::fs::write(path, lines.join("\n") + "\n").expect("write");
    }

    fn given(k: &SigningKey) -> VerifyingKey {
        k.verifying_key()
    }

    #[tokio::test]
    async fn an_untouched_record_verifies_with_the_recorded_and_the_given_key() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = written(dir.path(), None).await;
        let r = verify(&path, None).expect("verify");
        assert!(r.ok(), "{r:?}");
        assert_eq!((r.lines, r.checkpoints, r.unsigned_tail), (12, 2, 0));
        assert_eq!(r.key_source, KeySource::Recorded);
        let k = given(&key(7));
        let r = verify(&path, Some((&k, "k.pub".into()))).expect("verify");
        assert!(r.ok(), "{r:?}");
        // Another key: the first checkpoint fails, by seq.
        let other = given(&key(8));
        let r = verify(&path, Some((&other, "other.pub".into()))).expect("verify");
        let b = r.broken.expect("broken");
        assert_eq!(b.seq, 8, "{b:?}");
        assert!(b.reason.contains("names key"), "{b:?}");
    }

    #[tokio::test]
    async fn each_kind_of_tampering_names_the_first_bad_seq() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = written(dir.path(), None).await;
        let original = lines(&path);
        let check = |edit: &dyn Fn(&mut Vec<String>), want_seq: u64, want: &str| {
            let mut l = original.clone();
            edit(&mut l);
            write(&path, &l);
            let r = verify(&path, None).expect("verify");
            let b = r
                .broken
                .clone()
                .unwrap_or_else(|| panic!("not caught: {want}"));
            assert_eq!(b.seq, want_seq, "{want}: {b:?}");
            assert!(b.reason.contains(want), "{want}: {b:?}");
            assert!(!r.ok());
        };
        // One byte flipped in seq 4's reason: found at seq 5, named as seq 4.
        check(
            &|l| l[3] = l[3].replace("\"a2\"", "\"a3\""),
            4,
            "seq 4 was changed",
        );
        // Seq 5's prev changed: seq 5 named.
        check(
            &|l| {
                let p = l[4].find("\"prev\":\"").expect("prev") + 8;
                let c = if &l[4][p..=p] == "0" { "1" } else { "0" };
                l[4].replace_range(p..=p, c);
            },
            5,
            "its `prev`",
        );
        // A line deleted.
        check(&|l| drop(l.remove(3)), 4, "seq 4 is missing");
        // Two lines swapped.
        check(&|l| l.swap(2, 3), 3, "seq 3 is missing");
        // The last checkpoint's time changed: its signature fails.
        check(
            &|l| {
                let last = l.len() - 1;
                l[last] = l[last].replacen("\"at\":\"2", "\"at\":\"1", 1);
            },
            12,
            "does not verify",
        );
        // Truncated in the middle of a line.
        {
            let text = original.join("\n") + "\n";
            std::fs::write(&path, &text[..text.len() / 2]).expect("w");
            let r = verify(&path, None).expect("verify");
            let b = r.broken.expect("broken");
            assert!(b.reason.contains("cut off"), "{b:?}");
            assert_eq!(b.seq, r.last_seq.expect("some lines") + 1);
        }
        // The chain's start removed.
        check(&|l| drop(l.remove(0)), 2, "chain's start was removed");
        // Back as written: verifies.
        write(&path, &original);
        assert!(verify(&path, None).expect("verify").ok());
    }

    #[tokio::test]
    async fn the_chain_and_seq_continue_across_rotations_and_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = written(dir.path(), Some(600)).await;
        let files = record_files(&path).expect("files");
        assert!(files.len() >= 3, "{files:?}");
        let r = verify(&path, None).expect("verify");
        assert!(r.ok(), "{r:?}");
        // Each rotated file ends signed (a checkpoint before the rotation, unless one just was).
        for f in &files[..files.len() - 1] {
            let last = lines(f).pop().expect("a line");
            assert!(last.contains("\"kind\":\"checkpoint\""), "{f:?}: {last}");
        }
        assert!(
            files[..files.len() - 1].iter().any(|f| lines(f)
                .pop()
                .is_some_and(|l| l.contains("\"reason\":\"rotation\""))),
            "no rotation signed its file"
        );
        let before = r.lines;
        // Reopened: seq and chain go on; a torn tail is cut and recorded, and it all verifies.
        {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .expect("open");
            std::io::Write::write_all(&mut f, b"{\"seq\":99,\"kind\":\"ca").expect("w");
        }
        let (rec, recovery) = Recorder::open_with(&path, options(Some(600))).expect("reopen");
        assert_eq!(recovery.last_seq, before);
        rec.append(&event("c")).await.expect("append");
        rec.checkpoint("shutdown").await.expect("cp");
        drop(rec);
        let r = verify(&path, None).expect("verify");
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.torn_cuts, 1);
        assert_eq!(r.lines, before + 3);
        // Deleting a whole rotated file in the middle is a missing seq.
        let files = record_files(&path).expect("files");
        std::fs::remove_file(&files[1]).expect("rm");
        let r = verify(&path, None).expect("verify");
        assert!(r.broken.expect("broken").reason.contains("is missing"));
    }

    /// A broker killed inside a rotation, after the active file got its rotated name (a hard
    /// link) and before the fresh file took the record's name: the same file is under both
    /// names. The next open undoes the half rotation (the rotated name goes; the lines stay
    /// under the record's name), so nothing is read twice and the record goes on verifying.
    #[tokio::test]
    async fn a_rotation_cut_between_its_link_and_its_rename_is_undone_at_open() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tmp");
        let path = written(dir.path(), Some(600)).await;
        let before = verify(&path, None).expect("verify");
        assert!(before.ok(), "{before:?}");
        let first: u64 = serde_json::from_str::<serde_json::Value>(&lines(&path)[0]).expect("json")
            ["seq"]
            .as_u64()
            .expect("seq");
        let rotated = PathBuf::from(format!("{}.{first}", path.display()));
        std::fs::hard_link(&path, &rotated).expect("link");
        std::fs::write(format!("{}.new", path.display()), "").expect("new");
        // Read before any broker starts again: every line once.
        let cut = verify(&path, None).expect("verify the cut state");
        assert!(cut.ok(), "{cut:?}");
        assert_eq!(cut.lines, before.lines);
        let (rec, recovery) =
            Recorder::open_with(&path, options(Some(600))).expect("reopen after a cut rotation");
        assert_eq!(recovery.last_seq, before.lines);
        for i in 0..4 {
            rec.append(&event(&format!("c{i}"))).await.expect("append");
        }
        rec.checkpoint("shutdown").await.expect("cp");
        drop(rec);
        let r = verify(&path, None).expect("verify");
        assert!(r.ok(), "{r:?}");
        assert!(r.lines >= before.lines + 5, "{r:?}");
        assert!(!Path::new(&format!("{}.new", path.display())).exists());
        let ino = std::fs::metadata(&path).expect("meta").ino();
        for f in record_files(&path).expect("files") {
            if f != path {
                assert_ne!(std::fs::metadata(&f).expect("meta").ino(), ino, "{f:?}");
            }
        }
    }

    #[tokio::test]
    async fn a_record_written_before_chaining_is_chained_from_its_last_line() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rec.jsonl");
        std::fs::write(
            &path,
            "{\"seq\":1,\"at\":\"A\",\"kind\":\"turn_closed\",\"turn\":\"t\",\"reason\":\"x\"}\n",
        )
        .expect("w");
        let (rec, recovery) = Recorder::open(&path, RecordSync::Always).expect("open");
        assert_eq!(recovery.last_seq, 1);
        rec.append(&event("y")).await.expect("append");
        drop(rec);
        let r = verify(&path, None).expect("verify");
        assert!(r.ok(), "{r:?}");
        assert_eq!((r.unchained, r.chain_start), (1, Some(2)));
        // No key: chained, unsigned.
        assert_eq!((r.checkpoints, r.unsigned_tail), (0, 2));
    }
}
