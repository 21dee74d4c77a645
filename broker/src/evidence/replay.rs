//! `policy replay`: the record's calls decided again under another policy set, offline.
//!
//! Reads record files in order (a rotated record is several, oldest first), rebuilds each turn's
//! [`AccessContext`] from its `turn_opened` line and each call's [`Resource`] from its recorded
//! requirement, and asks [`PolicyEngine::decide`] what the other set says. What is compared is the
//! Cedar decision alone: a call that never reached it (a malformed name, a tool not in the turn's
//! catalogue, invalid arguments, an unresolvable requirement, a provider held back) is counted and
//! skipped, and whether a tool would still be in a turn's catalogue under the other set is not
//! asked (a call the set now denies would be refused either way).
//!
//! It never writes and never runs a tool. Every line is read as JSON first and only the kinds a
//! decision needs (`turn_opened`, `call`) are read further, through views of just the fields it
//! uses: lines of other kinds, and fields it does not know, are skipped, so a record that grows
//! new ones still replays.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sharedos_proto::Requirement;
use sharedos_proto::record::RecordedAccessContext;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::policy::{AccessContext, PolicyEngine, PolicyVersion};
use crate::resource::{RequirementError, Resource};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot read record `{path}`: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("record `{path}` line {line}: {detail}")]
    Line {
        path: String,
        line: usize,
        detail: String,
    },
    #[error("`{given}` is not an RFC 3339 time (like 2026-12-03T16:00:00Z): {detail}")]
    Time { given: String, detail: String },
}

/// An RFC 3339 time, as `--since` takes it and record lines carry it (`at`).
pub fn parse_time(given: &str) -> Result<OffsetDateTime, ReplayError> {
    OffsetDateTime::parse(given, &Rfc3339).map_err(|e| ReplayError::Time {
        given: sharedos_proto::name::shown(given),
        detail: e.to_string(),
    })
}

/// Why a call the policy decided cannot be decided again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum NotReplayable {
    /// Its turn's `turn_opened` line is not in the files read.
    NoTurn,
    /// The `turn_opened` line's context cannot be rebuilt.
    BadContext,
    /// A file requirement written before requirements carried the file's namespace.
    NoNamespace,
    /// A resource of a type this version does not know.
    UnknownResource,
    /// An outcome this version does not know.
    UnknownOutcome,
    /// The set reads `context.arguments`, and the line keeps only their SHA-256
    /// (`redact_arguments = true`).
    ArgumentsRedacted,
    /// The set reads `context.arguments`, and the line keeps only their size and SHA-256
    /// (longer than `record_max_argument_bytes`).
    ArgumentsDigested,
}

impl NotReplayable {
    fn why(self) -> &'static str {
        match self {
            NotReplayable::NoTurn => "its turn's turn_opened line is not in the record read",
            NotReplayable::BadContext => "its turn's recorded context cannot be rebuilt",
            NotReplayable::NoNamespace => {
                "the line does not say the file's namespace (written before requirements carried it)"
            }
            NotReplayable::UnknownResource => {
                "its resource is of a kind this version does not know"
            }
            NotReplayable::UnknownOutcome => "its outcome is one this version does not know",
            NotReplayable::ArgumentsRedacted => {
                "the policy reads context.arguments, and the record was written with redact_arguments = true (it keeps their SHA-256 only): it cannot be replayed on arguments"
            }
            NotReplayable::ArgumentsDigested => {
                "the policy reads context.arguments, and the line keeps only the digest of arguments longer than record_max_argument_bytes: it cannot be replayed on arguments"
            }
        }
    }
}

/// A call's decision as the record has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recorded {
    /// The policy permitted it (it went on to run, whatever its outcome then).
    pub allowed: bool,
    pub outcome: String,
    pub code: String,
    /// The deciding policies, as recorded (absent on an `unknown` line).
    pub policies: Option<Vec<String>>,
    /// It was held for a person's approval (an `approval_requested` line of its callId). Left out
    /// when not.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
}

/// A call's decision under the other set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Redecided {
    pub allowed: bool,
    /// The policies deciding now: the permits of an allow, the forbids of a deny (none for a
    /// default deny).
    pub policies: Vec<String>,
    /// Evaluation errors (a policy that errs cannot permit; the call is denied).
    pub errors: Vec<String>,
    /// Allowed, and a deciding permit asks for approval (`@approval`): it would wait for a person.
    /// Left out when not.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
}

impl Redecided {
    /// What decides the call now, for people and for grouping.
    pub fn deciding(&self) -> String {
        let ids = self.policies.join(", ");
        match (self.allowed, ids.is_empty(), self.errors.is_empty()) {
            (true, _, _) if self.held => {
                format!("permitted by {ids}, held for approval (@approval(\"required\"))")
            }
            (true, _, _) => format!("permitted by {ids}"),
            (false, false, _) => format!("forbidden by {ids}"),
            (false, true, true) => "default deny (no policy permits it)".to_owned(),
            (false, true, false) => "denied on evaluation errors".to_owned(),
        }
    }
}

/// A call whose decision the other set changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Change {
    pub seq: u64,
    pub at: String,
    pub call_id: String,
    pub turn: String,
    pub principal: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub tool: String,
    pub action: String,
    pub resource: String,
    pub old: Recorded,
    pub new: Redecided,
}

/// What a replay found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// `call` lines read (those at or after `since`).
    pub calls: u64,
    /// Calls refused before the policy was asked: there is no decision to compare.
    pub not_decided_by_policy: u64,
    /// Calls the policy decided that cannot be decided again ...
    pub not_replayable: u64,
    /// ... by reason.
    pub not_replayable_why: BTreeMap<String, u64>,
    /// Calls decided again.
    pub replayable: u64,
    pub unchanged: u64,
    pub allowed_to_denied: u64,
    pub denied_to_allowed: u64,
    /// Allowed before and now, but now held for approval where it was not.
    pub now_held: u64,
    /// Allowed before and now, held for approval before and no longer.
    pub no_longer_held: u64,
    /// A last line cut off mid-write (a record being written): skipped.
    pub torn_lines: u64,
    /// In record order.
    pub changes: Vec<Change>,
}

impl Report {
    /// The changes by tool, then by what decides them now; each group in record order.
    pub fn groups(&self) -> BTreeMap<&str, BTreeMap<String, Vec<&Change>>> {
        let mut out: BTreeMap<&str, BTreeMap<String, Vec<&Change>>> = BTreeMap::new();
        for c in &self.changes {
            out.entry(c.tool.as_str())
                .or_default()
                .entry(c.new.deciding())
                .or_default()
                .push(c);
        }
        out
    }

    fn skip(&mut self, why: NotReplayable) {
        self.not_replayable += 1;
        *self
            .not_replayable_why
            .entry(why.why().to_owned())
            .or_default() += 1;
    }
}

/// What a `turn_opened` line says that a decision needs.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TurnView {
    turn: String,
    access_context: RecordedAccessContext,
}

/// What a `call` line says that a replay needs.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CallView {
    turn: String,
    call_id: String,
    tool: String,
    #[serde(default)]
    requirement: Option<Requirement>,
    outcome: String,
    code: String,
    #[serde(default)]
    policies: Option<Vec<String>>,
    /// The arguments as given (absent when redacted or too long, see below).
    #[serde(default)]
    arguments: Option<Value>,
    #[serde(default)]
    arguments_sha256: Option<String>,
    #[serde(default)]
    arguments_digest: Option<Value>,
}

/// A replay in progress: feed it the record's files in order, then take its [`Report`].
pub struct Replay<'a> {
    engine: &'a PolicyEngine,
    pv: Arc<PolicyVersion>,
    since: Option<OffsetDateTime>,
    /// Every turn opened so far → its context (`None`: recorded, but not rebuildable). Turns are
    /// not forgotten at `turn_closed`: a call that outlived its turn's close grace is recorded
    /// after it.
    turns: HashMap<String, Option<Arc<AccessContext>>>,
    /// The distinct contexts (most turns share one): each is held once.
    contexts: HashSet<Arc<AccessContext>>,
    /// The callIds of `approval_requested` lines not yet matched by their `call` line.
    held: HashSet<String>,
    report: Report,
}

impl<'a> Replay<'a> {
    /// A replay under `engine`'s current set, of the calls at or after `since`.
    pub fn new(engine: &'a PolicyEngine, since: Option<OffsetDateTime>) -> Self {
        Self {
            pv: engine.current(),
            engine,
            since,
            turns: HashMap::new(),
            contexts: HashSet::new(),
            held: HashSet::new(),
            report: Report::default(),
        }
    }

    /// Reads one record file.
    pub fn read_file(&mut self, path: &Path) -> Result<(), ReplayError> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|source| ReplayError::Read {
            path: shown.clone(),
            source,
        })?;
        self.read(&shown, BufReader::new(file))
    }

    /// Reads record lines from `reader` (`shown` names it in errors). A line that is not JSON is
    /// an error naming it, unless it is the last and has no newline: a line being written.
    pub fn read(&mut self, shown: &str, mut reader: impl BufRead) -> Result<(), ReplayError> {
        let mut buf = Vec::new();
        let mut line = 0;
        loop {
            buf.clear();
            let n = reader
                .read_until(b'\n', &mut buf)
                .map_err(|source| ReplayError::Read {
                    path: shown.to_owned(),
                    source,
                })?;
            if n == 0 {
                return Ok(());
            }
            line += 1;
            let at_line = |detail: String| ReplayError::Line {
                path: shown.to_owned(),
                line,
                detail,
            };
            let value: Value = match serde_json::from_slice(&buf) {
                Ok(v) => v,
                Err(_) if buf.last() != Some(&b'\n') => {
                    self.report.torn_lines += 1;
                    return Ok(());
                }
                Err(e) => return Err(at_line(format!("not JSON: {e}"))),
            };
            self.line(value).map_err(at_line)?;
        }
    }

    /// The report, once every file is read.
    pub fn finish(self) -> Report {
        self.report
    }

    fn line(&mut self, line: Value) -> Result<(), String> {
        match line.get("kind").and_then(Value::as_str) {
            Some("turn_opened") => {
                let t: TurnView = serde_json::from_value(line)
                    .map_err(|e| format!("a turn_opened line that does not read: {e}"))?;
                let context = AccessContext::from_recorded(&t.access_context)
                    .ok()
                    .map(|c| self.intern(c));
                self.turns.insert(t.turn, context);
            }
            Some("approval_requested") => {
                if let Some(id) = line.get("callId").and_then(Value::as_str) {
                    self.held.insert(id.to_owned());
                }
            }
            Some("call") => {
                let seq = line
                    .get("seq")
                    .and_then(Value::as_u64)
                    .ok_or("a call line without a numeric `seq`")?;
                let at = line
                    .get("at")
                    .and_then(Value::as_str)
                    .ok_or("a call line without `at`")?
                    .to_owned();
                if let Some(since) = self.since {
                    let when = parse_time(&at).map_err(|e| e.to_string())?;
                    if when < since {
                        return Ok(());
                    }
                }
                let call: CallView = serde_json::from_value(line)
                    .map_err(|e| format!("a call line that does not read: {e}"))?;
                self.call(seq, at, call);
            }
            _ => {}
        }
        Ok(())
    }

    fn intern(&mut self, context: AccessContext) -> Arc<AccessContext> {
        if let Some(c) = self.contexts.get(&context) {
            return c.clone();
        }
        let c = Arc::new(context);
        self.contexts.insert(c.clone());
        c
    }

    fn call(&mut self, seq: u64, at: String, call: CallView) {
        self.report.calls += 1;
        // Held only when the record says a person was asked (`approval_requested`): a code alone
        // (`approval_stale`, ...) does not say the set asked for it.
        let held = self.held.remove(&call.call_id);
        // Only a call the policy decided has a requirement: every refusal before the decision
        // is recorded without one.
        let Some(requirement) = call.requirement else {
            self.report.not_decided_by_policy += 1;
            return;
        };
        let allowed = match (call.outcome.as_str(), call.code.as_str()) {
            ("denied", "no_permit" | "forbidden") => false,
            // Permitted by the policy, then held for a person or over a budget.
            (
                "denied",
                "approval_denied"
                | "approval_timeout"
                | "approval_stale"
                | "approval_unavailable"
                | "budget_exhausted",
            ) => true,
            ("denied", _) => {
                self.report.not_decided_by_policy += 1;
                return;
            }
            // Permitted, then ran: whatever became of it, the policy said yes. `unknown` is a
            // call whose intent was written (after the decision) and its outcome never was.
            ("succeeded" | "failed" | "cancelled" | "unknown", _) => true,
            _ => return self.report.skip(NotReplayable::UnknownOutcome),
        };
        let context = match self.turns.get(&call.turn) {
            Some(Some(c)) => c.clone(),
            Some(None) => return self.report.skip(NotReplayable::BadContext),
            None => return self.report.skip(NotReplayable::NoTurn),
        };
        let resource = match Resource::from_requirement(&requirement) {
            Ok(r) => r,
            Err(RequirementError::NoNamespace) => {
                return self.report.skip(NotReplayable::NoNamespace);
            }
            Err(RequirementError::Unknown) => {
                return self.report.skip(NotReplayable::UnknownResource);
            }
        };
        // `context.arguments`, typed from the recorded arguments (the record does not keep the
        // tools' schemas: see `arguments::typed_from_values`).
        let typed = match &call.arguments {
            Some(Value::Object(m)) => crate::policy::arguments::typed_from_values(m),
            _ if !self.pv.reads_any_arguments() => crate::policy::arguments::empty(),
            _ if call.arguments_sha256.is_some() => {
                return self.report.skip(NotReplayable::ArgumentsRedacted);
            }
            _ if call.arguments_digest.is_some() => {
                return self.report.skip(NotReplayable::ArgumentsDigested);
            }
            _ => crate::policy::arguments::empty(),
        };
        self.report.replayable += 1;
        let decision = self.engine.decide_with(
            &self.pv,
            &context,
            &requirement.action,
            &resource,
            Some(&typed),
        );
        let now_held = decision.allowed && decision.approval.is_some();
        if decision.allowed == allowed && (!allowed || now_held == held) {
            self.report.unchanged += 1;
            return;
        }
        match (allowed, decision.allowed) {
            (true, false) => self.report.allowed_to_denied += 1,
            (false, true) => self.report.denied_to_allowed += 1,
            _ if now_held => self.report.now_held += 1,
            _ => self.report.no_longer_held += 1,
        }
        self.report.changes.push(Change {
            seq,
            at,
            call_id: call.call_id,
            turn: call.turn,
            principal: context.principal.clone(),
            agent: context.agent.clone(),
            tool: call.tool,
            action: requirement.action,
            resource: requirement.resource,
            old: Recorded {
                allowed,
                outcome: call.outcome,
                code: call.code,
                policies: call.policies,
                held,
            },
            new: Redecided {
                allowed: decision.allowed,
                policies: decision.policies,
                errors: decision.errors,
                held: now_held,
            },
        });
    }
}

/// Decides every call of `records` (read in this order) again under `engine`'s set.
pub fn replay(
    engine: &PolicyEngine,
    records: &[PathBuf],
    since: Option<OffsetDateTime>,
) -> Result<Report, ReplayError> {
    let mut replay = Replay::new(engine, since);
    for path in records {
        replay.read_file(path)?;
    }
    Ok(replay.finish())
}

#[cfg(test)]
#[allow(clippy::expect_used, clippy::panic, reason = "test code")]
mod tests {
    use super::*;
    use serde_json::json;

    /// alice reads /public; the embedded default's rule, for `read` alone.
    const BASE: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/public/*" };
"#;

    fn engine(policy: &str) -> PolicyEngine {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("p.cedar");
        std::fs::write(&path, policy).expect("write");
        PolicyEngine::load(None, &path).expect("policy")
    }

    fn with(extra: &str) -> String {
        format!("{BASE}\n{extra}")
    }

    fn opened(seq: u64, turn: &str, context: Value) -> Value {
        // A line as a later broker may write it: an unknown field (`prev`) first.
        json!({"prev": "abc", "seq": seq, "at": format!("2026-12-03T16:00:{seq:02}.000000Z"),
               "kind": "turn_opened", "turn": turn, "accessContext": context,
               "tokenFile": null, "catalogHash": "00", "tools": ["files.read"],
               "policyVersion": 1, "expiresAt": "2026-12-03T17:00:00.000000Z"})
    }

    fn alice() -> Value {
        json!({"principal": "alice", "agent": null, "agentOwner": null, "turn": null})
    }

    /// A `call` line: `read` of `path` in namespace `files`, with the recorded outcome.
    fn call(seq: u64, turn: &str, path: &str, outcome: &str, code: &str) -> Value {
        let policies: Vec<&str> = if outcome == "succeeded" {
            vec!["alice-public"]
        } else {
            vec![]
        };
        json!({"prev": "abc", "seq": seq, "at": format!("2026-12-03T16:00:{seq:02}.000000Z"),
               "kind": "call", "turn": turn, "callId": format!("{turn}.{seq}"), "requestId": "1",
               "tool": "files.read", "arguments": {"path": path},
               "requirement": {"action": "read", "resource": format!("SharedOS::File::{path:?}"),
                               "namespace": "files"},
               "outcome": outcome, "code": code, "policies": policies, "durationUs": 3})
    }

    /// A call refused before the policy: no requirement.
    fn refused(seq: u64, turn: &str) -> Value {
        json!({"seq": seq, "at": format!("2026-12-03T16:00:{seq:02}.000000Z"), "kind": "call",
               "turn": turn, "callId": format!("{turn}.{seq}"), "requestId": "1",
               "tool": "files.nope", "arguments": {}, "requirement": null, "outcome": "denied",
               "code": "unpublished_tool", "policies": [], "durationUs": 1})
    }

    fn text(lines: &[Value]) -> String {
        lines.iter().map(|l| format!("{l}\n")).collect()
    }

    /// A record: a turn of alice's with an allowed and a denied read, a refusal, and lines of
    /// kinds this version does not know.
    fn record() -> String {
        text(&[
            json!({"seq": 1, "at": "2026-12-03T16:00:00.000000Z", "kind": "chain_started",
                   "turn": null, "prev": null}),
            opened(2, "t-1", alice()),
            call(3, "t-1", "/public/a.txt", "succeeded", "ok"),
            call(4, "t-1", "/private/a.txt", "denied", "no_permit"),
            refused(5, "t-1"),
            json!({"seq": 6, "at": "2026-12-03T16:00:06.000000Z", "kind": "checkpoint",
                   "turn": null, "hash": "ff"}),
            json!({"seq": 7, "at": "2026-12-03T16:00:07.000000Z", "kind": "turn_closed",
                   "turn": "t-1", "reason": "host", "calls": 3}),
        ])
    }

    fn run(policy: &str, record: &str, since: Option<&str>) -> Report {
        let engine = engine(policy);
        let since = since.map(|s| parse_time(s).expect("time"));
        let mut r = Replay::new(&engine, since);
        r.read("record", record.as_bytes()).expect("replays");
        r.finish()
    }

    fn seqs(r: &Report) -> Vec<u64> {
        r.changes.iter().map(|c| c.seq).collect()
    }

    #[test]
    fn the_same_set_changes_nothing_and_unknown_lines_are_skipped() {
        let r = run(BASE, &record(), None);
        assert_eq!(
            (r.calls, r.replayable, r.not_decided_by_policy, r.unchanged),
            (3, 2, 1, 2)
        );
        assert!(r.changes.is_empty());
        assert_eq!(r.not_replayable, 0);
    }

    #[test]
    fn a_call_refused_after_the_policy_permitted_it_replays_as_allowed() {
        for code in [
            "budget_exhausted",
            "approval_denied",
            "approval_timeout",
            "approval_stale",
        ] {
            let record = text(&[
                opened(2, "t-1", alice()),
                call(3, "t-1", "/public/a.txt", "denied", code),
            ]);
            let r = run(BASE, &record, None);
            assert_eq!((r.replayable, r.unchanged), (1, 1), "{code}");
            assert!(r.changes.is_empty(), "{code}");
        }
    }

    /// Issue 44 item 2: a fetch decided on its URL is decided again on the recorded URL (its
    /// attributes read again from the canonical text); a URL not in that form is not one the
    /// broker recorded.
    #[test]
    fn a_url_call_is_decided_again_on_its_recorded_url() {
        let fetch = |seq: u64, url: &str| {
            json!({"seq": seq, "at": format!("2026-12-03T16:00:{seq:02}.000000Z"), "kind": "call",
                   "turn": "t-1", "callId": format!("t-1.{seq}"), "requestId": "1",
                   "tool": "web.fetch", "arguments": {"url": url},
                   "requirement": {"action": "fetch", "resource": format!("SharedOS::Url::{url:?}")},
                   "outcome": "succeeded", "code": "ok", "policies": ["web"], "durationUs": 3})
        };
        let record = text(&[
            opened(1, "t-1", alice()),
            fetch(2, "http://127.0.0.1:8080/"),
            fetch(3, "https://docs.example.com/a"),
            fetch(4, "HTTP://Docs.Example.COM./a"),
        ]);
        let r = run(
            r#"@id("web") permit(principal, action == SharedOS::Action::"fetch", resource is SharedOS::Url);
               @id("no-loopback") forbid(principal, action, resource is SharedOS::Url)
               when { resource has ip && resource.ip.isLoopback() };"#,
            &record,
            None,
        );
        assert_eq!(
            (
                r.calls,
                r.replayable,
                r.unchanged,
                r.allowed_to_denied,
                r.not_replayable
            ),
            (3, 2, 1, 1, 1)
        );
        assert_eq!(seqs(&r), [2]);
        assert_eq!(r.changes[0].new.deciding(), "forbidden by no-loopback");
    }

    #[test]
    fn a_stricter_set_denies_what_was_allowed() {
        let r = run(
            &with(
                r#"@id("no-a") forbid(principal, action, resource is SharedOS::File)
                   when { resource.path == "/public/a.txt" };"#,
            ),
            &record(),
            None,
        );
        assert_eq!(seqs(&r), [3]);
        assert_eq!((r.allowed_to_denied, r.denied_to_allowed), (1, 0));
        let c = &r.changes[0];
        assert_eq!(
            (c.call_id.as_str(), c.principal.as_str(), c.action.as_str()),
            ("t-1.3", "alice", "read")
        );
        assert_eq!(c.resource, "SharedOS::File::\"/public/a.txt\"");
        assert_eq!(
            c.old,
            Recorded {
                allowed: true,
                outcome: "succeeded".into(),
                code: "ok".into(),
                policies: Some(vec!["alice-public".into()]),
                held: false,
            }
        );
        assert_eq!(
            c.new,
            Redecided {
                allowed: false,
                policies: vec!["no-a".into()],
                errors: vec![],
                held: false,
            }
        );
        assert_eq!(c.new.deciding(), "forbidden by no-a");
    }

    #[test]
    fn a_looser_set_allows_what_was_denied() {
        let r = run(
            &with(
                r#"@id("alice-private") permit(principal == SharedOS::User::"alice",
                   action == SharedOS::Action::"read", resource is SharedOS::File)
                   when { resource.path like "/private/*" };"#,
            ),
            &record(),
            None,
        );
        assert_eq!(seqs(&r), [4]);
        assert_eq!((r.allowed_to_denied, r.denied_to_allowed), (0, 1));
        assert_eq!(r.changes[0].new.deciding(), "permitted by alice-private");
        assert!(!r.changes[0].old.allowed);
    }

    #[test]
    fn dropping_the_only_permit_is_a_default_deny() {
        let r = run(
            r#"@id("bob") permit(principal == SharedOS::User::"bob", action, resource);"#,
            &record(),
            None,
        );
        assert_eq!(seqs(&r), [3]);
        assert_eq!(
            r.changes[0].new.deciding(),
            "default deny (no policy permits it)"
        );
    }

    #[test]
    fn the_turns_whole_context_is_decided_again() {
        // Two turns of alice's reading the same private file: only the one opened with
        // project "x" through an agent she owns is permitted by the new rule.
        let record = text(&[
            opened(
                1,
                "t-x",
                json!({"principal": "alice", "agent": "helper", "agentOwner": "alice",
                       "turn": {"purpose": "p", "project": "x"}}),
            ),
            opened(
                2,
                "t-y",
                json!({"principal": "alice", "agent": "helper", "agentOwner": null,
                       "turn": {"project": "x"}}),
            ),
            opened(3, "t-z", alice()),
            call(4, "t-x", "/private/a.txt", "denied", "no_permit"),
            call(5, "t-y", "/private/a.txt", "denied", "no_permit"),
            call(6, "t-z", "/private/a.txt", "denied", "no_permit"),
        ]);
        let policy = with(
            r#"@id("x-through-own-agent") permit(principal, action == SharedOS::Action::"read",
                   resource is SharedOS::File)
               when { context has turn && context.turn has project && context.turn.project == "x"
                      && context has agent && context.agent has owner
                      && context.agent.owner == principal };"#,
        );
        let r = run(&policy, &record, None);
        assert_eq!(seqs(&r), [4]);
        assert_eq!(r.changes[0].agent.as_deref(), Some("helper"));
        assert_eq!(r.unchanged, 2);
    }

    #[test]
    fn the_files_namespace_is_decided_on() {
        let mut other = call(2, "t-1", "/public/a.txt", "succeeded", "ok");
        other["requirement"]["namespace"] = json!("other");
        let record = text(&[
            opened(1, "t-1", alice()),
            other,
            call(3, "t-1", "/public/a.txt", "succeeded", "ok"),
        ]);
        let r = run(
            &with(
                r#"@id("only-files") forbid(principal, action, resource is SharedOS::File)
                   when { resource.namespace != "files" };"#,
            ),
            &record,
            None,
        );
        assert_eq!(seqs(&r), [2]);
    }

    #[test]
    fn what_cannot_be_decided_again_is_counted_with_its_reason() {
        let mut old = call(3, "t-1", "/private/a.txt", "denied", "no_permit");
        old["requirement"]
            .as_object_mut()
            .expect("object")
            .remove("namespace");
        let mut odd = call(4, "t-1", "/public/a.txt", "succeeded", "ok");
        odd["requirement"]["resource"] = json!("SharedOS::Folder::\"/public\"");
        let mut new_outcome = call(5, "t-1", "/public/a.txt", "postponed", "later");
        new_outcome["policies"] = Value::Null;
        let mut unknown = call(6, "t-1", "/public/a.txt", "unknown", "broker_restart");
        unknown.as_object_mut().expect("object").remove("policies");
        let record = text(&[
            opened(1, "t-1", alice()),
            call(2, "t-gone", "/public/a.txt", "succeeded", "ok"),
            old,
            odd,
            new_outcome,
            unknown,
        ]);
        let r = run(
            r#"@id("nobody") permit(principal == SharedOS::User::"nobody", action, resource);"#,
            &record,
            None,
        );
        assert_eq!((r.calls, r.not_replayable, r.replayable), (5, 4, 1));
        assert_eq!(r.not_replayable_why.len(), 4, "{:?}", r.not_replayable_why);
        assert!(
            r.not_replayable_why
                .keys()
                .any(|k| k.contains("turn_opened"))
        );
        assert!(r.not_replayable_why.keys().any(|k| k.contains("namespace")));
        // The `unknown` line: permitted (its intent was written), denied now.
        assert_eq!(seqs(&r), [6]);
        assert_eq!(r.changes[0].old.policies, None);
    }

    #[test]
    fn since_keeps_the_later_calls_and_every_turn() {
        let strict =
            with(r#"@id("no-reads") forbid(principal, action, resource is SharedOS::File);"#);
        let r = run(&strict, &record(), Some("2026-12-03T16:00:04Z"));
        assert_eq!((r.calls, r.not_decided_by_policy), (2, 1));
        assert!(r.changes.is_empty(), "the allowed read is before --since");
        let r = run(&strict, &record(), Some("2026-12-03T17:00:03+01:00"));
        assert_eq!(seqs(&r), [3], "the same instant in another offset");
        let bad = parse_time("yesterday").expect_err("not a time").to_string();
        assert!(bad.contains("`yesterday`"), "{bad}");
    }

    #[test]
    fn a_rotated_record_is_read_file_after_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let lines: Vec<String> = record().lines().map(str::to_owned).collect();
        let (first, second) = (dir.path().join("r.1"), dir.path().join("r.2"));
        std::fs::write(&first, format!("{}\n{}\n", lines[0], lines[1])).expect("w");
        std::fs::write(&second, format!("{}\n", lines[2..].join("\n"))).expect("w");
        let strict =
            with(r#"@id("no-reads") forbid(principal, action, resource is SharedOS::File);"#);
        let engine = engine(&strict);
        let r = replay(&engine, &[first, second], None).expect("replays");
        assert_eq!(seqs(&r), [3]);
        let missing = dir.path().join("r.0");
        let e = replay(&engine, &[missing], None)
            .expect_err("missing")
            .to_string();
        assert!(e.contains("r.0"), "{e}");
    }

    #[test]
    fn a_broken_line_is_an_error_naming_it_but_a_torn_last_line_is_not() {
        let engine = engine(BASE);
        let mut broken = record();
        broken.insert_str(0, "{\"seq\": 0, \"kind\"\n");
        let e = Replay::new(&engine, None)
            .read("rec.jsonl", broken.as_bytes())
            .expect_err("broken")
            .to_string();
        assert!(e.contains("rec.jsonl") && e.contains("line 1"), "{e}");
        let mut bad_call = call(9, "t-1", "/a", "denied", "no_permit");
        bad_call.as_object_mut().expect("object").remove("outcome");
        let e = Replay::new(&engine, None)
            .read("rec.jsonl", text(&[bad_call]).as_bytes())
            .expect_err("no outcome")
            .to_string();
        assert!(e.contains("line 1") && e.contains("outcome"), "{e}");
        let mut torn = record();
        torn.push_str("{\"seq\": 8, \"kind\": \"ca");
        let mut r = Replay::new(&engine, None);
        r.read("rec.jsonl", torn.as_bytes()).expect("torn tail");
        let r = r.finish();
        assert_eq!((r.calls, r.torn_lines), (3, 1));
    }

    #[test]
    fn changes_are_grouped_by_tool_then_by_what_decides_now() {
        let mut list = call(5, "t-1", "/public", "succeeded", "ok");
        list["tool"] = json!("files.list");
        list["requirement"]["action"] = json!("list");
        let policy = r#"
@id("alice-private") permit(principal == SharedOS::User::"alice",
    action in [SharedOS::Action::"read", SharedOS::Action::"list"], resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;
        let record = text(&[
            opened(1, "t-1", alice()),
            call(2, "t-1", "/public/a.txt", "succeeded", "ok"),
            call(3, "t-1", "/private/a.txt", "denied", "no_permit"),
            call(4, "t-1", "/public/b.txt", "succeeded", "ok"),
            list,
        ]);
        let r = run(policy, &record, None);
        let groups: Vec<(&str, String, Vec<u64>)> = r
            .groups()
            .into_iter()
            .flat_map(|(tool, by)| {
                by.into_iter()
                    .map(move |(d, cs)| (tool, d, cs.iter().map(|c| c.seq).collect()))
            })
            .collect();
        let default_deny = "default deny (no policy permits it)".to_owned();
        assert_eq!(
            groups,
            [
                ("files.list", default_deny.clone(), vec![5]),
                ("files.read", default_deny, vec![2, 4]),
                (
                    "files.read",
                    "permitted by alice-private".to_owned(),
                    vec![3]
                ),
            ]
        );
        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["allowedToDenied"], 3);
        assert_eq!(json["changes"][1]["callId"], "t-1.3");
        assert_eq!(
            json["changes"][1]["new"]["policies"],
            json!(["alice-private"])
        );
        assert_eq!(json["changes"][1]["old"]["code"], "no_permit");
    }
}
