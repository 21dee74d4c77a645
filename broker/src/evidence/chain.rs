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
//! signed content ([`signed_content`]: RFC 8785 canonical JSON of what the signature covers, so
//! a witness that re-spaced or re-ordered the line still matches), and that the record does not
//! end before the newest of them. With a trusted key, witness lines not signed by it are
//! skipped and reported ([`Witness::read`]): a line anyone appended vetoes nothing.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use serde_json::{Map, Value};
use sharedos_proto::catalog::{canonical_json, hex};
use sharedos_proto::record::checkpoint_message;

use crate::evidence::record::{RecordError, line_hash, parse_hex32, record_files};

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
/// Skipped witness lines reported one by one; the rest are counted.
pub const MAX_SKIPPED_REPORTED: usize = 20;

/// One checkpoint as a witness holds it: its signed content and the witness lines holding it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Witnessed {
    /// [`signed_content`] of the line: the same checkpoint however it was spaced or ordered.
    pub content: String,
    /// 1-based line numbers in the witness file (a checkpoint handed on twice is held twice).
    pub lines: Vec<usize>,
}

/// A witness line passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// 1-based line number in the witness file.
    pub line: usize,
    pub reason: String,
}

/// Checkpoints as a witness holds them: by seq, each different checkpoint at that seq with the
/// lines holding it (more than one is a conflict, judged against the record by
/// [`verify_files`]).
#[derive(Debug, Clone, Default)]
pub struct Witness {
    pub checkpoints: std::collections::BTreeMap<u64, Vec<Witnessed>>,
    /// Lines passed over (the first [`MAX_SKIPPED_REPORTED`]): not JSON, not a checkpoint, and
    /// with a trusted key, unsigned or not signed by it.
    pub skipped: Vec<Skipped>,
    /// How many lines were passed over in all.
    pub skipped_count: u64,
    /// Whether each line's signature was checked against a trusted key. Without one, a line
    /// anyone appended cannot be told from a genuine one.
    pub checked: bool,
}

/// The signed content of a checkpoint line, as RFC 8785 canonical JSON: the `seq`, `prev`, `at`
/// and `reason` its signature covers ([`checkpoint_message`]). Two lines are the same checkpoint
/// when this is equal, whatever spacing or key order a system that carried them gave them.
/// `None`: the line lacks one of them.
pub fn signed_content(obj: &Map<String, Value>) -> Option<(u64, String)> {
    let seq = obj.get("seq").and_then(Value::as_u64)?;
    let text = |k: &str| obj.get(k).and_then(Value::as_str);
    let content = serde_json::json!({
        "seq": seq,
        "prev": text("prev")?,
        "at": text("at")?,
        "reason": text("reason")?,
    });
    canonical_json(&content).ok().map(|c| (seq, c))
}

/// Why `obj` (a checkpoint line) is not signed by `key`, if it is not.
fn not_signed_by(obj: &Map<String, Value>, key: &VerifyingKey) -> Option<String> {
    let text = |k: &str| obj.get(k).and_then(Value::as_str);
    let want = hex(key.as_bytes());
    let Some(signature) = text("signature") else {
        return Some("unsigned (no `signature`)".into());
    };
    let named = text("publicKey").unwrap_or("");
    if named != want {
        return Some(format!(
            "signed with key `{named}`, not the trusted key ({want})"
        ));
    }
    let message = checkpoint_message(
        obj.get("seq").and_then(Value::as_u64).unwrap_or(0),
        text("prev").unwrap_or(""),
        text("at").unwrap_or(""),
        text("reason").unwrap_or(""),
    );
    let good = parse_hex64(signature)
        .map(|b| Signature::from_bytes(&b))
        .is_some_and(|sig| key.verify(&message, &sig).is_ok());
    (!good).then(|| "its signature does not verify under the trusted key".to_owned())
}

impl Witness {
    /// Reads a witness file: one JSON object per line, either a checkpoint's record line itself
    /// (what the broker appends to `witness_file`, hands to `witness_command` and exports as an
    /// OpenTelemetry log body, and what `records checkpoint --json` prints), or an exported log
    /// record whose `body` (a string, or `{"stringValue": ...}`) is that line (exported lines of
    /// other kinds are passed over silently). Blank lines are passed over.
    ///
    /// With `trusted` (the caller's own copy of the public key), each line must be signed by it;
    /// a line that is not JSON, not a checkpoint, unsigned or signed otherwise is skipped and
    /// reported by its line number, never counted against the record. Without it, every
    /// checkpoint line counts (lines that are not checkpoints are still skipped and reported).
    pub fn read(path: &Path, trusted: Option<&VerifyingKey>) -> Result<Self, RecordError> {
        let text = std::fs::read(path).map_err(|source| RecordError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut out = Self {
            checked: trusted.is_some(),
            ..Self::default()
        };
        for (i, raw) in text.split(|b| *b == b'\n').enumerate() {
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            if raw.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match Self::judge(raw, trusted) {
                Ok(None) => {}
                Ok(Some((seq, content))) => {
                    let held = out.checkpoints.entry(seq).or_default();
                    match held.iter_mut().find(|h| h.content == content) {
                        Some(h) => h.lines.push(i + 1),
                        None => held.push(Witnessed {
                            content,
                            lines: vec![i + 1],
                        }),
                    }
                }
                Err(reason) => {
                    out.skipped_count += 1;
                    if out.skipped.len() < MAX_SKIPPED_REPORTED {
                        out.skipped.push(Skipped {
                            line: i + 1,
                            reason,
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// One witness line: its checkpoint (seq, signed content), `None` for an exported line of
    /// another kind, or why it is skipped.
    fn judge(raw: &[u8], trusted: Option<&VerifyingKey>) -> Result<Option<(u64, String)>, String> {
        if raw.len() > MAX_WITNESS_LINE {
            return Err(format!(
                "longer than {MAX_WITNESS_LINE} bytes: not a witnessed checkpoint"
            ));
        }
        let obj: Map<String, Value> =
            serde_json::from_slice(raw).map_err(|e| format!("not a JSON object: {e}"))?;
        let body = match obj.get("body") {
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Object(o)) => o.get("stringValue").and_then(Value::as_str),
            _ => None,
        };
        let exported = body.is_some();
        let obj: Map<String, Value> = match body {
            Some(b) => serde_json::from_str(b)
                .map_err(|e| format!("its `body` is not a JSON object: {e}"))?,
            None => obj,
        };
        if obj.get("kind").and_then(Value::as_str) != Some("checkpoint") {
            // An export of every record line holds the checkpoints among the rest.
            if exported {
                return Ok(None);
            }
            return Err("not a `checkpoint` line".into());
        }
        let (seq, content) = signed_content(&obj).ok_or_else(|| {
            "a checkpoint without a numeric `seq` and string `prev`, `at` and `reason`".to_owned()
        })?;
        if let Some(key) = trusted
            && let Some(why) = not_signed_by(&obj, key)
        {
            return Err(format!("the checkpoint at seq {seq}: {why}"));
        }
        Ok(Some((seq, content)))
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
    let mut walk = Walk {
        report: Report::new(files.clone(), key.as_ref(), witness),
        given: key.map(|(k, _)| *k),
        recorded: None,
        prev: None,
    };
    let mut lines = Lines {
        files,
        current: None,
        next_file: 0,
    };
    let mut next = lines.next_line()?;
    while let Some(line) = next.take() {
        next = lines.next_line()?;
        if let Err((seq, reason)) = walk.line(&line, next.as_ref(), witness) {
            walk.report.broken = Some(Broken {
                seq,
                file: lines.files[line.file].clone(),
                line: line.number,
                reason,
            });
            break;
        }
    }
    Ok(walk.report)
}

impl Report {
    /// A report of nothing checked yet.
    fn new(
        files: Vec<PathBuf>,
        key: Option<&(&VerifyingKey, String)>,
        witness: Option<&Witness>,
    ) -> Self {
        Self {
            files,
            lines: 0,
            first_seq: None,
            last_seq: None,
            unchained: 0,
            chain_start: None,
            checkpoints: 0,
            last_checkpoint: None,
            unsigned_tail: 0,
            torn_cuts: 0,
            key: key.map(|(k, _)| hex(k.as_bytes())),
            key_source: match key {
                Some((_, from)) => KeySource::Given(from.clone()),
                None => KeySource::None,
            },
            broken: None,
            witnessed: 0,
            witness_newest: witness.and_then(|w| w.checkpoints.keys().next_back().copied()),
        }
    }
}

/// The walk along the record: what is known so far, and the key checkpoints are checked with
/// (the one given, else the one the chain's start recorded). A line that breaks the record is
/// an `Err((seq, why))`.
struct Walk {
    report: Report,
    given: Option<VerifyingKey>,
    recorded: Option<VerifyingKey>,
    /// The hash and seq of the line before.
    prev: Option<([u8; 32], u64)>,
}

type Fault = (u64, String);

impl Walk {
    /// One line: read and in order, as the witness holds it, then before the chain or chained
    /// (its link, its checkpoint's signature).
    fn line(
        &mut self,
        line: &Line,
        next: Option<&Line>,
        witness: Option<&Witness>,
    ) -> Result<(), Fault> {
        let (obj, seq) = read_line(line, self.prev.map(|(_, s)| s))?;
        self.report.lines += 1;
        self.report.first_seq.get_or_insert(seq);
        self.report.last_seq = Some(seq);
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        let hash = line_hash(&line.bytes);
        if let Some(w) = witness
            && let Some(held) = w.checkpoints.get(&seq)
        {
            if let Some(reason) = witness_fault(w, held, seq, &obj, kind) {
                return Err((seq, reason));
            }
            self.report.witnessed += 1;
        }
        if self.report.chain_start.is_none() {
            self.before_chain(seq, kind, &obj)?;
        } else {
            link_fault(seq, &obj, self.prev, &hash, next)?;
            self.chained(seq, kind, &obj)?;
        }
        self.prev = Some((hash, seq));
        Ok(())
    }

    /// A line before the chain began: the chain's start (chained to what comes before it, its
    /// key recorded), or a line written before chaining (which may not carry a `prev`).
    fn before_chain(
        &mut self,
        seq: u64,
        kind: &str,
        obj: &Map<String, Value>,
    ) -> Result<(), Fault> {
        let text = |k: &str| obj.get(k).and_then(Value::as_str);
        let line_prev = text("prev");
        if kind != "chain_started" {
            if line_prev.is_some() {
                return Err((
                    seq,
                    format!(
                        "seq {seq} is chained but no `chain_started` line comes before it: the chain's start was removed or changed"
                    ),
                ));
            }
            self.report.unchained += 1;
            return Ok(());
        }
        let want = self.prev.map(|(h, _)| hex(&h));
        if line_prev.map(str::to_owned) != want {
            return Err((
                seq,
                if want.is_some() {
                    format!(
                        "the chain's start does not chain to seq {} before it",
                        seq - 1
                    )
                } else {
                    "the chain's first line has a `prev`, but nothing comes before it".into()
                },
            ));
        }
        self.report.chain_start = Some(seq);
        self.report.unsigned_tail = 1;
        self.recorded = text("publicKey")
            .and_then(parse_hex32)
            .and_then(|b| VerifyingKey::from_bytes(&b).ok());
        Ok(())
    }

    /// A chained line whose link holds: a checkpoint's signature checked, the unsigned tail
    /// and torn-tail cuts counted, a second chain start refused.
    fn chained(&mut self, seq: u64, kind: &str, obj: &Map<String, Value>) -> Result<(), Fault> {
        if kind == "checkpoint" {
            self.checkpoint(seq, obj)?;
        } else {
            self.report.unsigned_tail += 1;
        }
        if kind == "torn_tail_cut" {
            self.report.torn_cuts += 1;
        }
        if kind == "chain_started" {
            return Err((
                seq,
                format!("a second `chain_started` at seq {seq}: a chain starts once"),
            ));
        }
        Ok(())
    }

    /// A checkpoint: it names the key it is checked with, and its signature verifies.
    fn checkpoint(&mut self, seq: u64, obj: &Map<String, Value>) -> Result<(), Fault> {
        let text = |k: &str| obj.get(k).and_then(Value::as_str);
        let Some(k) = self.given.or(self.recorded) else {
            return Err((
                seq,
                "a checkpoint, but no key to check it: the chain recorded none and none was given"
                    .into(),
            ));
        };
        if self.report.key.is_none() {
            self.report.key = Some(hex(k.as_bytes()));
            self.report.key_source = KeySource::Recorded;
        }
        let named = text("publicKey").unwrap_or("");
        if named != hex(k.as_bytes()) {
            return Err((
                seq,
                format!(
                    "the checkpoint at seq {seq} names key {named}, not the key it is checked with ({})",
                    hex(k.as_bytes())
                ),
            ));
        }
        let message = checkpoint_message(
            seq,
            text("prev").unwrap_or(""),
            text("at").unwrap_or(""),
            text("reason").unwrap_or(""),
        );
        let good = text("signature")
            .and_then(parse_hex64)
            .map(|b| Signature::from_bytes(&b))
            .is_some_and(|sig| k.verify(&message, &sig).is_ok());
        if !good {
            return Err((
                seq,
                format!("the signature of the checkpoint at seq {seq} does not verify"),
            ));
        }
        self.report.checkpoints += 1;
        self.report.last_checkpoint = Some(seq);
        self.report.unsigned_tail = 0;
        Ok(())
    }
}

/// A line read: whole, a JSON object, with a numeric `seq` that follows `prev_seq`.
fn read_line(line: &Line, prev_seq: Option<u64>) -> Result<(Map<String, Value>, u64), Fault> {
    let expected = prev_seq.map(|s| s + 1);
    let fallback_seq = expected.unwrap_or(1);
    let after = match prev_seq {
        Some(s) => format!("the line after seq {s}"),
        None => "the first line".to_owned(),
    };
    if !line.whole {
        return Err((
            fallback_seq,
            format!(
                "{after} is cut off ({} bytes, no newline): a torn write or a truncation",
                line.bytes.len()
            ),
        ));
    }
    let obj: Map<String, Value> = serde_json::from_slice(&line.bytes).map_err(|e| {
        (
            fallback_seq,
            format!("{after} is not a JSON object ({e}): it was changed"),
        )
    })?;
    let Some(seq) = obj.get("seq").and_then(Value::as_u64) else {
        return Err((fallback_seq, format!("{after} has no numeric `seq`")));
    };
    if let Some(want) = expected
        && seq != want
    {
        let why = if seq > want {
            "a line was deleted, moved or its seq changed"
        } else {
            "lines out of order, repeated or renumbered"
        };
        return Err((
            want,
            format!(
                "seq {want} is missing: seq {seq} follows seq {} ({why})",
                want - 1
            ),
        ));
    }
    Ok((obj, seq))
}

/// A chained line's link: its `prev` is the hash of the line before. When it is not, which of
/// the two changed? If the next line chains to this one, this one is as written, and the line
/// before it is not.
fn link_fault(
    seq: u64,
    obj: &Map<String, Value>,
    prev: Option<([u8; 32], u64)>,
    hash: &[u8; 32],
    next: Option<&Line>,
) -> Result<(), Fault> {
    let line_prev = obj.get("prev").and_then(Value::as_str);
    let want = prev.map(|(h, _)| hex(&h)).unwrap_or_default();
    if line_prev == Some(want.as_str()) {
        return Ok(());
    }
    let next_chains = next.is_some_and(|n| {
        n.whole
            && serde_json::from_slice::<Map<String, Value>>(&n.bytes)
                .ok()
                .and_then(|o| o.get("prev").and_then(Value::as_str).map(str::to_owned))
                == Some(hex(hash))
    });
    let before = seq - 1;
    Err(if line_prev.is_none() {
        (
            seq,
            format!("seq {seq} has no `prev`: the chain breaks here"),
        )
    } else if next_chains || next.is_none() {
        (
            before,
            format!(
                "seq {before} was changed: its bytes no longer hash to the `prev` of seq {seq}"
            ),
        )
    } else {
        (
            seq,
            format!("seq {seq} was changed: its `prev` is not the hash of seq {before}"),
        )
    })
}

/// Whether the record's line at `seq` (`obj`, of `kind`) is the checkpoint the witness holds
/// at `seq` (`held`: each different one, by signed content), and if not, why not.
fn witness_fault(
    witness: &Witness,
    held: &[Witnessed],
    seq: u64,
    obj: &Map<String, Value>,
    kind: &str,
) -> Option<String> {
    let mine = (kind == "checkpoint")
        .then(|| signed_content(obj))
        .flatten()
        .map(|(_, c)| c);
    let matching = held.iter().find(|h| Some(&h.content) == mine.as_ref());
    let named = |h: &Witnessed| {
        let lines: Vec<String> = h.lines.iter().map(usize::to_string).collect();
        format!(
            "witness line{} {}",
            if lines.len() == 1 { "" } else { "s" },
            lines.join(", ")
        )
    };
    match held {
        [_] if matching.is_some() => None,
        [one] => Some(format!(
            "seq {seq} differs from the witnessed checkpoint at seq {seq} ({}): the record was rewritten up to here (and re-signed, if its signatures verify)",
            named(one)
        )),
        _ => {
            let all: Vec<String> = held.iter().map(named).collect();
            let whose = if witness.checked {
                "each signed by the trusted key: that key signed two histories (it was used by someone else)"
            } else {
                "not checked against a key (no trusted --public-key): a line anyone appended cannot be told from the genuine one; pass --public-key with a copy of the key kept elsewhere"
            };
            let record = match matching {
                Some(h) => format!("the record's line matches {}", named(h)),
                None => "the record's line matches none of them".to_owned(),
            };
            Some(format!(
                "the witness holds {} different checkpoints at seq {seq} ({}), {whose}; {record}",
                held.len(),
                all.join("; ")
            ))
        }
    }
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
    use crate::evidence::record::{RecordOptions, RecordSync, Recorder};
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

    /// The record's checkpoint lines, re-serialized (keys sorted, other spacing) as a JSON
    /// pipeline would hand them on.
    fn reserialized_checkpoints(path: &Path) -> Vec<String> {
        lines(path)
            .iter()
            .filter(|l| l.contains("\"kind\":\"checkpoint\""))
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("json");
                let sorted: std::collections::BTreeMap<String, Value> =
                    serde_json::from_value(v).expect("object");
                serde_json::to_string_pretty(&sorted)
                    .expect("json")
                    .replace('\n', " ")
            })
            .collect()
    }

    #[tokio::test]
    async fn forged_witness_lines_are_skipped_with_the_key_and_re_serialized_ones_match() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = written(dir.path(), None).await;
        let mut witness_lines = reserialized_checkpoints(&path);
        assert_eq!(witness_lines.len(), 2);
        assert!(!lines(&path).contains(&witness_lines[0]), "re-serialized");
        // Forged: seq 8 with another `at`, unsigned; signed by another key; and garbage.
        let genuine: Value = serde_json::from_str(&witness_lines[0]).expect("json");
        let mut forged = genuine.clone();
        forged["at"] = Value::String("1999-01-01T00:00:00Z".into());
        forged["signature"] = Value::String("00".repeat(64));
        witness_lines.push(forged.to_string());
        let other = key(8);
        let mut foreign = genuine.clone();
        foreign["publicKey"] = Value::String(hex(other.verifying_key().as_bytes()));
        witness_lines.push(foreign.to_string());
        witness_lines.push("not json".into());
        let witness_path = dir.path().join("w.jsonl");
        write(&witness_path, &witness_lines);
        let k = given(&key(7));
        let w = Witness::read(&witness_path, Some(&k)).expect("read");
        assert!(w.checked);
        assert_eq!(w.skipped_count, 3, "{:?}", w.skipped);
        assert_eq!(
            w.skipped.iter().map(|s| s.line).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert!(
            w.skipped[0].reason.contains("does not verify"),
            "{:?}",
            w.skipped
        );
        assert!(
            w.skipped[1].reason.contains("not the trusted key"),
            "{:?}",
            w.skipped
        );
        let r = verify_witnessed(&path, Some((&k, "k.pub".into())), Some(&w)).expect("verify");
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.witnessed, 2);
        // Without the key, the forged line counts: a conflict at seq 8, fail closed, naming
        // the line the record matches.
        let w = Witness::read(&witness_path, None).expect("read");
        assert!(!w.checked);
        assert_eq!(w.skipped_count, 1, "only the garbage: {:?}", w.skipped);
        let r = verify_witnessed(&path, None, Some(&w)).expect("verify");
        let b = r.broken.expect("conflict");
        assert_eq!(b.seq, 8, "{b:?}");
        assert!(
            b.reason.contains("2 different checkpoints at seq 8")
                && b.reason
                    .contains("the record's line matches witness lines 1, 4")
                && b.reason.contains("witness line 3")
                && b.reason.contains("--public-key"),
            "{b:?}"
        );
        // Two lines both signed by the trusted key that differ: the key signed two histories.
        let sk = key(7);
        let mut resigned = genuine.clone();
        resigned["at"] = Value::String("2000-01-01T00:00:00Z".into());
        let message = checkpoint_message(
            8,
            genuine["prev"].as_str().expect("prev"),
            "2000-01-01T00:00:00Z",
            genuine["reason"].as_str().expect("reason"),
        );
        resigned["signature"] =
            Value::String(hex(&ed25519_dalek::Signer::sign(&sk, &message).to_bytes()));
        write(
            &witness_path,
            &[witness_lines[0].clone(), resigned.to_string()],
        );
        let w = Witness::read(&witness_path, Some(&k)).expect("read");
        assert_eq!(w.skipped_count, 0);
        let r = verify_witnessed(&path, Some((&k, "k.pub".into())), Some(&w)).expect("verify");
        let b = r.broken.expect("two histories");
        assert!(
            b.reason.contains("signed two histories")
                && b.reason
                    .contains("the record's line matches witness line 1"),
            "{b:?}"
        );
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
