//! Approvals: "ask a person" as a kernel outcome.
//!
//! A call permitted by a policy annotated `@approval("required")` waits in the kernel, on the
//! call path, for a host's `approvals approve|deny ID` (over `control.sock`). This module holds
//! the calls waiting (one oneshot each, in the broker's shared state) and nothing else: the
//! kernel records, waits, times out and cancels; `control` lists and decides.
//!
//! An approval id is the hex SHA-256 of the RFC 8785 JSON of `{turn, callId, principal, tool,
//! arguments, requirement}`: bound to the exact call (another call, with other arguments, has
//! another id), to what the policy decided on (the resource the arguments resolved to, which the
//! person sees in `approvals`), and to one attempt (the same call made again is a new attempt,
//! with a new `callId` and id). An id is decided once: deciding it again, or an id that never
//! existed, is an error naming it. The kernel holds the object the resource resolved to (device
//! and inode) beside the wait, and runs an approved call only on that object.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{Value, json};
use sharedos_proto::Requirement;
use sharedos_proto::ipc::{HarnessSession, PendingApproval, PrincipalAnswer, Question};
use tokio::sync::oneshot;

use crate::lock;
use crate::policy::Approver;

/// Decided ids remembered, so a second decision gets "already decided", not "no such id".
const DECIDED_MAX: usize = 4096;

/// Longest arguments (JSON text) an `approvals` entry shows; longer ones are listed as their
/// size and SHA-256 (`argumentsDigest`), and `approvals show ID` prints them whole.
pub const APPROVALS_MAX_ARGUMENT_BYTES: usize = 4096;
/// Most bytes of entries one `approvals` answer carries (half the frame limit): the newest calls
/// beyond it are counted (`notShown`), not listed.
pub const APPROVALS_LIST_MAX_BYTES: usize = sharedos_proto::frame::MAX_FRAME_BYTES / 2;
/// Most bytes of a call's arguments (JSON text) one `approvals show` answer carries: escaped
/// in the answer, at most six times as many, which stays within a frame.
pub const APPROVAL_ARGUMENTS_PART_BYTES: usize = 1024 * 1024;

/// Longest string (bytes) of an argument the principal's question shows: longer ones are cut
/// there and marked with how long they were.
pub const QUESTION_MAX_STRING_BYTES: usize = 200;
/// Most bytes of arguments (JSON text) the principal's question shows; beyond it, their size
/// and SHA-256 only.
pub const QUESTION_MAX_ARGUMENT_BYTES: usize = 2048;
/// Argument keys whose values the principal's question never shows (`[redacted]`): a key
/// containing any of these, in any case.
pub const QUESTION_REDACTED_KEYS: &[&str] = &[
    "password",
    "passwd",
    "secret",
    "token",
    "apikey",
    "api_key",
    "authorization",
    "credential",
    "private_key",
    "cookie",
];

/// A person's answer: an operator's from `control.sock`, or the principal's from the harness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub approve: bool,
    /// The peer uid on `control.sock`.
    pub by: Option<u32>,
    pub reason: Option<String>,
    /// The principal answered in the harness, in this session.
    pub principal: Option<HarnessSession>,
    /// The harness could not ask and the policy lets nobody else answer: refused
    /// `denied/approval_unavailable`, `reason` saying why.
    pub unavailable: bool,
    /// The person decided on the person's page, signed in with the operator's identity
    /// provider: the provider's subject (`sub`) of the ID token.
    pub page: Option<PageDecider>,
}

/// Who decided on the person's page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageDecider {
    /// The identity provider's `sub` of the signed-in person.
    pub subject: String,
}

impl Decision {
    /// An operator's decision over `control.sock`.
    pub fn operator(approve: bool, by: Option<u32>, reason: Option<String>) -> Self {
        Self {
            approve,
            by,
            reason,
            principal: None,
            unavailable: false,
            page: None,
        }
    }
}

/// Why a decision could not be given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    #[error("approval `{0}` was already decided (an approval id is used once)")]
    AlreadyDecided(String),
    #[error("no call is waiting for approval `{0}` (see `sharedos-broker approvals`)")]
    Unknown(String),
    #[error(
        "approval `{0}` is for the call's principal to give, in the harness (`@approval(\"principal\")`); an operator cannot give it"
    )]
    PrincipalOnly(String),
    #[error(
        "approval `{0}` was not asked on this bridge connection, or was already answered there; only the harness session asked may answer it, once"
    )]
    NotAsked(String),
}

/// Why a link of the person's page decides nothing. Each is refused, and recorded, by the page.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("no approval has this link")]
    Unknown,
    #[error("this link was used already: an approval link decides once")]
    Used,
    #[error(
        "the call this link was for is no longer waiting (it timed out, was cancelled, or an operator decided it)"
    )]
    Ended,
    #[error("this link is for another call than the one the form names")]
    OtherCall,
    #[error("this call is for principal `{owner}` to approve; you are signed in as `{signed_in}`")]
    NotYours { owner: String, signed_in: String },
}

impl LinkError {
    /// The word the record keeps for it.
    pub fn code(&self) -> &'static str {
        match self {
            LinkError::Unknown => "link_unknown",
            LinkError::Used => "link_used",
            LinkError::Ended => "link_ended",
            LinkError::OtherCall => "other_call",
            LinkError::NotYours { .. } => "not_the_principal",
        }
    }
}

/// What the page shows of a waiting call: the call, and what only the page needs (the agent,
/// the policies that asked for approval, its link).
#[derive(Debug, Clone)]
pub struct OnPage {
    pub info: PendingApproval,
    pub agent: Option<String>,
    pub policies: Vec<String>,
    pub link: String,
}

/// What became of a page link: the approval it asks about while the call waits, then how it
/// ended (bounded like the decided ids).
#[derive(Debug, Clone, PartialEq, Eq)]
enum LinkState {
    Waiting(String),
    Used,
    Ended,
}

#[derive(Default)]
struct Links {
    state: HashMap<String, LinkState>,
    /// Links no longer waiting, oldest first, for the bound.
    ended: VecDeque<String>,
}

impl Links {
    fn end(&mut self, link: &str, how: LinkState) {
        if let Some(s) = self.state.get_mut(link) {
            *s = how;
            self.ended.push_back(link.to_owned());
            if self.ended.len() > DECIDED_MAX
                && let Some(old) = self.ended.pop_front()
            {
                self.state.remove(&old);
            }
        }
    }
}

/// What a principal's answer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// It decided the call.
    Decided,
    /// The harness could not ask: the call waits on for an operator
    /// (`@approval("principal_or_operator")`).
    ToOperator,
}

struct Waiting {
    info: PendingApproval,
    answer: oneshot::Sender<Decision>,
    by: Approver,
    /// The bridge connection the principal was asked on, until it answers.
    asked: Option<u64>,
    /// Asked on the person's page: the call's agent, deciding policies and link.
    page: Option<(Option<String>, Vec<String>, String)>,
    /// An answer through a bridge was refused (and recorded) for this page approval already.
    bridge_refused: bool,
}

#[derive(Default)]
struct Decided {
    order: VecDeque<String>,
    set: HashSet<String>,
}

/// The calls waiting for a person, by approval id.
pub struct Approvals {
    pub timeout: Duration,
    waiting: Mutex<HashMap<String, Waiting>>,
    decided: Mutex<Decided>,
    /// The person's page (`[page]`): its public URL. With it, a principal's approval is asked
    /// there, never through the harness.
    page: Option<url::Url>,
    links: Mutex<Links>,
}

/// The approval id of one call attempt.
pub fn approval_id(
    turn: &str,
    call_id: &str,
    principal: &str,
    tool: &str,
    arguments: &Value,
    requirement: Option<&Requirement>,
) -> String {
    let bound = json!({
        "turn": turn,
        "callId": call_id,
        "principal": principal,
        "tool": tool,
        "arguments": arguments,
        "requirement": requirement,
    });
    let text =
        sharedos_proto::catalog::canonical_json(&bound).unwrap_or_else(|_| bound.to_string());
    sharedos_proto::catalog::sha256_hex(text.as_bytes())
}

/// A call's place in the table; leaving it (dropped or [`Ticket::withdraw`]n) takes it out.
pub struct Ticket<'a> {
    approvals: &'a Approvals,
    id: String,
    pub answer: oneshot::Receiver<Decision>,
}

impl Ticket<'_> {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Stops waiting (time out, cancellation). `None`: the call was still waiting and is out
    /// now; `Some`: a decision took it first, and here it is.
    pub fn withdraw(&mut self) -> Option<Decision> {
        let removed = lock(&self.approvals.waiting).remove(&self.id);
        match removed {
            Some(w) => {
                self.approvals.remember(&self.id);
                self.approvals.end_link(&w, LinkState::Ended);
                None
            }
            None => self.answer.try_recv().ok(),
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let removed = lock(&self.approvals.waiting).remove(&self.id);
        if let Some(w) = removed {
            self.approvals.remember(&self.id);
            self.approvals.end_link(&w, LinkState::Ended);
        }
    }
}

impl Approvals {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            waiting: Mutex::default(),
            decided: Mutex::default(),
            page: None,
            links: Mutex::default(),
        }
    }

    /// Principals' approvals are asked on the person's page at `public_url`.
    pub fn with_page(mut self, public_url: Option<url::Url>) -> Self {
        self.page = public_url;
        self
    }

    /// The person's page, when one is configured.
    pub fn page(&self) -> Option<&url::Url> {
        self.page.as_ref()
    }

    /// Puts waiting call `id` on the person's page: a one-time link (128 random bits, hex),
    /// bound to that approval (and so to its call, principal and decided object), with what
    /// the page shows besides the call. Returns the link's URL; `None` without a page, or when
    /// `id` no longer waits.
    pub fn put_on_page(
        &self,
        id: &str,
        agent: Option<String>,
        policies: Vec<String>,
    ) -> Option<url::Url> {
        let base = self.page.as_ref()?;
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).ok()?;
        let link: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let url = base.join(&format!("approval/{link}")).ok()?;
        let mut waiting = lock(&self.waiting);
        let w = waiting.get_mut(id)?;
        w.page = Some((agent, policies, link.clone()));
        lock(&self.links)
            .state
            .insert(link, LinkState::Waiting(id.to_owned()));
        Some(url)
    }

    /// An answer through a bridge for `id`, a call asked on the page: `true` the first time
    /// (the refusal is then recorded; later ones only logged, so a bridge cannot grow the
    /// record with them).
    pub fn first_bridge_answer(&self, id: &str) -> bool {
        match lock(&self.waiting).get_mut(id) {
            Some(w) if w.page.is_some() && !w.bridge_refused => {
                w.bridge_refused = true;
                true
            }
            _ => false,
        }
    }

    /// The waiting call link `link` is for, as the page shows it.
    pub fn on_page(&self, link: &str) -> Result<OnPage, LinkError> {
        let id = match lock(&self.links).state.get(link) {
            None => return Err(LinkError::Unknown),
            Some(LinkState::Used) => return Err(LinkError::Used),
            Some(LinkState::Ended) => return Err(LinkError::Ended),
            Some(LinkState::Waiting(id)) => id.clone(),
        };
        let waiting = lock(&self.waiting);
        let w = waiting.get(&id).ok_or(LinkError::Ended)?;
        let (agent, policies, link) = w.page.clone().ok_or(LinkError::Unknown)?;
        Ok(OnPage {
            info: w.info.clone(),
            agent,
            policies,
            link,
        })
    }

    /// The calls waiting on the page for `principal`, oldest first.
    pub fn on_page_for(&self, principal: &str) -> Vec<OnPage> {
        let mut all: Vec<OnPage> = lock(&self.waiting)
            .values()
            .filter(|w| w.info.principal == principal)
            .filter_map(|w| {
                let (agent, policies, link) = w.page.clone()?;
                Some(OnPage {
                    info: w.info.clone(),
                    agent,
                    policies,
                    link,
                })
            })
            .collect();
        all.sort_by(|a, b| {
            (a.info.requested_at.as_str(), a.info.id.as_str())
                .cmp(&(b.info.requested_at.as_str(), b.info.id.as_str()))
        });
        all
    }

    /// The signed-in person's decision through `link` on the page: taken only while the call
    /// waits, for the approval the form names (`approval`: the link's own), from the principal
    /// the call names; the link is used up by it.
    pub fn decide_on_page(
        &self,
        link: &str,
        approval: &str,
        principal: &str,
        approve: bool,
        decider: PageDecider,
    ) -> Result<PendingApproval, LinkError> {
        // Locks in the order every path takes them: the table, then the links.
        let state = lock(&self.links).state.get(link).cloned();
        let id = match state {
            None => return Err(LinkError::Unknown),
            Some(LinkState::Used) => return Err(LinkError::Used),
            Some(LinkState::Ended) => return Err(LinkError::Ended),
            Some(LinkState::Waiting(id)) => id,
        };
        if id != approval {
            return Err(LinkError::OtherCall);
        }
        let mut waiting = lock(&self.waiting);
        let owner = match waiting.get(&id) {
            None => return Err(LinkError::Ended),
            Some(w) => w.info.principal.clone(),
        };
        if owner != principal {
            return Err(LinkError::NotYours {
                owner,
                signed_in: principal.to_owned(),
            });
        }
        let decision = Decision {
            approve,
            by: None,
            reason: None,
            principal: None,
            unavailable: false,
            page: Some(decider),
        };
        let info = waiting.get(&id).map(|w| w.info.clone());
        self.settle(&mut waiting, &id, decision)
            .map_err(|_| LinkError::Ended)?;
        lock(&self.links).end(link, LinkState::Used);
        info.ok_or(LinkError::Ended)
    }

    /// A call leaving the table ends its link (used when the page decided it: see
    /// [`Approvals::decide_on_page`]).
    fn end_link(&self, w: &Waiting, how: LinkState) {
        if let Some((_, _, link)) = &w.page {
            let mut links = lock(&self.links);
            if links.state.get(link) == Some(&LinkState::Waiting(w.info.id.clone())) {
                links.end(link, how);
            }
        }
    }

    /// Puts a call in the table. `None` if its id is already there (which cannot happen for two
    /// attempts: each has its own `callId`).
    pub fn wait(&self, info: PendingApproval, by: Approver) -> Option<Ticket<'_>> {
        let (tx, rx) = oneshot::channel();
        let id = info.id.clone();
        let mut waiting = lock(&self.waiting);
        if waiting.contains_key(&id) || lock(&self.decided).set.contains(&id) {
            return None;
        }
        waiting.insert(
            id.clone(),
            Waiting {
                info,
                answer: tx,
                by,
                asked: None,
                page: None,
                bridge_refused: false,
            },
        );
        Some(Ticket {
            approvals: self,
            id,
            answer: rx,
        })
    }

    /// An operator's decision on `id` (over `control.sock`): taken out of the table and handed
    /// to the waiting call. A call for its principal alone is not the operator's to decide.
    pub fn decide(&self, id: &str, decision: Decision) -> Result<(), DecideError> {
        let mut waiting = lock(&self.waiting);
        if waiting.get(id).is_some_and(|w| !w.by.operator_may()) {
            return Err(DecideError::PrincipalOnly(id.to_owned()));
        }
        self.settle(&mut waiting, id, decision)
    }

    /// The principal is asked about `id` on bridge connection `bridge`: from now on that
    /// connection, and no other, may answer it, once. `false` if `id` no longer waits.
    pub fn ask(&self, id: &str, bridge: u64) -> bool {
        match lock(&self.waiting).get_mut(id) {
            Some(w) if w.by.asks_principal() => {
                w.asked = Some(bridge);
                true
            }
            _ => false,
        }
    }

    /// The principal's answer to `id`, from bridge connection `bridge`: taken only from the
    /// connection that was asked, once, while the call waits. An answer that the harness
    /// could not ask sends a `principal_or_operator` call on to the operator queue and refuses
    /// a `principal` one.
    pub fn answer(
        &self,
        id: &str,
        bridge: u64,
        answer: PrincipalAnswer,
        reason: Option<String>,
        session: HarnessSession,
    ) -> Result<Answered, DecideError> {
        let mut waiting = lock(&self.waiting);
        let Some(w) = waiting.get_mut(id) else {
            return Err(if lock(&self.decided).set.contains(id) {
                DecideError::AlreadyDecided(id.to_owned())
            } else {
                DecideError::Unknown(id.to_owned())
            });
        };
        if w.asked != Some(bridge) {
            return Err(DecideError::NotAsked(id.to_owned()));
        }
        // One answer per question, whatever it says.
        w.asked = None;
        let unable = answer == PrincipalAnswer::Unable;
        if unable && w.by.operator_may() {
            return Ok(Answered::ToOperator);
        }
        let decision = Decision {
            approve: answer == PrincipalAnswer::Approve,
            by: None,
            reason,
            principal: Some(session),
            unavailable: unable,
            page: None,
        };
        self.settle(&mut waiting, id, decision)
            .map(|()| Answered::Decided)
    }

    /// Takes `id` out of the table and hands `decision` to its waiting call.
    fn settle(
        &self,
        waiting: &mut std::sync::MutexGuard<'_, HashMap<String, Waiting>>,
        id: &str,
        decision: Decision,
    ) -> Result<(), DecideError> {
        let Some(w) = waiting.remove(id) else {
            return Err(if lock(&self.decided).set.contains(id) {
                DecideError::AlreadyDecided(id.to_owned())
            } else {
                DecideError::Unknown(id.to_owned())
            });
        };
        self.remember(id);
        if decision.page.is_none() {
            self.end_link(&w, LinkState::Ended);
        }
        // Sent under the lock: a call that withdraws after this finds the decision waiting.
        w.answer
            .send(decision)
            .map_err(|_| DecideError::Unknown(id.to_owned()))
    }

    /// The calls waiting now, oldest first.
    pub fn list(&self) -> Vec<PendingApproval> {
        let mut all: Vec<PendingApproval> = lock(&self.waiting)
            .values()
            .map(|w| w.info.clone())
            .collect();
        all.sort_by(|a, b| a.requested_at.cmp(&b.requested_at).then(a.id.cmp(&b.id)));
        all
    }

    /// The calls waiting now, oldest first, as `approvals` lists them: each entry's arguments
    /// bounded (longer than [`APPROVALS_MAX_ARGUMENT_BYTES`]: `null`, with `argumentsDigest`),
    /// and no more entries than fit in [`APPROVALS_LIST_MAX_BYTES`]. Returns the entries and how
    /// many waiting calls were left out.
    pub fn listed(&self) -> (Vec<PendingApproval>, usize) {
        let mut all: Vec<PendingApproval> = lock(&self.waiting)
            .values()
            .map(|w| bounded(&w.info))
            .collect();
        all.sort_by(|a, b| a.requested_at.cmp(&b.requested_at).then(a.id.cmp(&b.id)));
        let mut bytes = 0usize;
        let mut shown = 0usize;
        for entry in &all {
            let size = serde_json::to_vec(entry).map_or(usize::MAX, |v| v.len());
            if bytes.saturating_add(size) > APPROVALS_LIST_MAX_BYTES {
                break;
            }
            bytes += size;
            shown += 1;
        }
        let not_shown = all.len() - shown;
        all.truncate(shown);
        (all, not_shown)
    }

    /// A waiting call's arguments as JSON text, whole (`None`: no call waits for `id`).
    pub fn arguments_text(&self, id: &str) -> Option<String> {
        lock(&self.waiting)
            .get(id)
            .map(|w| w.info.arguments.to_string())
    }

    fn remember(&self, id: &str) {
        let mut d = lock(&self.decided);
        if d.set.insert(id.to_owned()) {
            d.order.push_back(id.to_owned());
            if d.order.len() > DECIDED_MAX
                && let Some(old) = d.order.pop_front()
            {
                d.set.remove(&old);
            }
        }
    }
}

/// What the principal is asked about a held call: the tool, the resource the kernel decided
/// on, and the arguments (`arguments`, or their digest when `digest_only`: the config records
/// arguments as digests) with secret-looking keys redacted, each string cut at
/// [`QUESTION_MAX_STRING_BYTES`], and the whole at most [`QUESTION_MAX_ARGUMENT_BYTES`].
pub fn question(
    tool: &str,
    resource: Option<&str>,
    arguments: &Value,
    digest_only: bool,
    expires_at: &str,
) -> Question {
    let full = arguments.to_string();
    let digest = || {
        let d = sharedos_proto::record::Digest::of(full.as_bytes());
        json!({"argumentsDigest": {"bytes": d.bytes, "sha256": d.sha256}})
    };
    let shown = if digest_only {
        digest()
    } else {
        let s = shown_value(arguments, 0);
        if s.to_string().len() > QUESTION_MAX_ARGUMENT_BYTES {
            digest()
        } else {
            s
        }
    };
    let mut text = String::new();
    let mut tool_shown = tool.to_owned();
    sharedos_proto::name::clip(&mut tool_shown, QUESTION_MAX_STRING_BYTES);
    text.push_str(&format!(
        "An agent acting for you asks to run `{tool_shown}`"
    ));
    if let Some(r) = resource {
        let mut r = r.to_owned();
        sharedos_proto::name::clip(&mut r, QUESTION_MAX_STRING_BYTES);
        text.push_str(&format!(" on {r}"));
    }
    text.push_str(&format!(
        " with arguments {shown}. Approve it? (Unanswered by {expires_at}, it is refused.)"
    ));
    Question {
        message: text,
        tool: tool_shown,
        resource: resource.map(|r| {
            let mut r = r.to_owned();
            sharedos_proto::name::clip(&mut r, QUESTION_MAX_STRING_BYTES);
            r
        }),
        arguments: shown,
        expires_at: expires_at.to_owned(),
        url: None,
    }
}

/// Depth past which the question shows `…` instead of a value.
const QUESTION_MAX_DEPTH: usize = 8;

fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase().replace('-', "_");
    QUESTION_REDACTED_KEYS.iter().any(|s| k.contains(s))
}

fn shown_value(v: &Value, depth: usize) -> Value {
    if depth > QUESTION_MAX_DEPTH {
        return Value::String("…".into());
    }
    match v {
        Value::String(s) if s.len() > QUESTION_MAX_STRING_BYTES => {
            let mut cut = s.clone();
            sharedos_proto::name::clip(&mut cut, QUESTION_MAX_STRING_BYTES);
            Value::String(format!("{cut} ({} bytes in all)", s.len()))
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| shown_value(x, depth + 1)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| {
                    let mut key = k.clone();
                    sharedos_proto::name::clip(&mut key, QUESTION_MAX_STRING_BYTES);
                    let shown = if secret_key(k) {
                        Value::String("[redacted]".into())
                    } else {
                        shown_value(x, depth + 1)
                    };
                    (key, shown)
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A waiting call as `approvals` lists it: its arguments whole when their JSON text is at most
/// [`APPROVALS_MAX_ARGUMENT_BYTES`], else `null` with their size and SHA-256.
fn bounded(info: &PendingApproval) -> PendingApproval {
    let mut entry = info.clone();
    let text = info.arguments.to_string();
    if text.len() > APPROVALS_MAX_ARGUMENT_BYTES {
        entry.arguments = Value::Null;
        entry.arguments_digest = Some(sharedos_proto::record::Digest::of(text.as_bytes()));
    }
    entry
}

#[cfg(test)]
#[allow(clippy::expect_used, clippy::panic, reason = "test code")]
mod tests {
    use super::*;

    fn info(id: &str) -> PendingApproval {
        PendingApproval {
            id: id.into(),
            turn: "t".into(),
            call_id: "t.1".into(),
            principal: "alice".into(),
            tool: "files.read".into(),
            arguments: json!({}),
            requirement: None,
            arguments_digest: None,
            requested_at: "a".into(),
            expires_at: "b".into(),
        }
    }

    fn yes() -> Decision {
        Decision::operator(true, Some(1), None)
    }

    #[test]
    fn ids_are_bound_to_the_call_and_its_requirement() {
        let req = |path: &str| Requirement {
            action: "read".into(),
            resource: format!("SharedOS::File::{path:?}"),
            namespace: Some("files".into()),
            attributes: None,
        };
        let id = |call: &str, path: &str, decided: &str| {
            approval_id(
                "t",
                call,
                "alice",
                "files.read",
                &json!({"path": path}),
                Some(&req(decided)),
            )
        };
        let a = id("t.1", "/a", "/a");
        let b = id("t.1", "/b", "/b");
        let c = id("t.2", "/a", "/a");
        // The same arguments, resolved (through a link) to another file.
        let d = id("t.1", "/a", "/private/x");
        assert_eq!(a.len(), 64);
        assert!(a != b && a != c && a != d);
        assert_eq!(a, id("t.1", "/a", "/a"));
    }

    #[test]
    fn an_id_is_decided_once() {
        let approvals = Approvals::new(Duration::from_secs(1));
        let mut ticket = approvals
            .wait(info("x"), Approver::Operator)
            .expect("waits");
        assert_eq!(approvals.list().len(), 1);
        assert_eq!(
            approvals.decide("y", yes()),
            Err(DecideError::Unknown("y".into()))
        );
        approvals.decide("x", yes()).expect("decided");
        assert_eq!(
            approvals.decide("x", yes()),
            Err(DecideError::AlreadyDecided("x".into()))
        );
        assert_eq!(ticket.withdraw(), Some(yes()), "the decision won the race");
        assert!(approvals.list().is_empty());
        assert!(
            approvals.wait(info("x"), Approver::Operator).is_none(),
            "a decided id never waits again"
        );
    }

    #[test]
    fn a_listing_bounds_each_entry_and_shows_the_rest_whole() {
        let approvals = Approvals::new(Duration::from_secs(1));
        let big = json!({"content": "x".repeat(APPROVALS_MAX_ARGUMENT_BYTES)});
        let mut large = info("large");
        large.arguments = big.clone();
        let _t1 = approvals.wait(large, Approver::Operator).expect("waits");
        let _t2 = approvals
            .wait(info("small"), Approver::Operator)
            .expect("waits");
        let (listed, not_shown) = approvals.listed();
        assert_eq!((listed.len(), not_shown), (2, 0));
        let large = listed.iter().find(|a| a.id == "large").expect("listed");
        assert_eq!(large.arguments, Value::Null);
        let digest = large.arguments_digest.as_ref().expect("digest");
        assert_eq!(digest.bytes, big.to_string().len());
        let small = listed.iter().find(|a| a.id == "small").expect("listed");
        assert_eq!(
            (&small.arguments, &small.arguments_digest),
            (&json!({}), &None)
        );
        assert_eq!(approvals.arguments_text("large"), Some(big.to_string()));
        assert_eq!(approvals.arguments_text("gone"), None);
    }

    #[test]
    fn a_question_is_bounded_and_redacted() {
        let args = json!({
            "path": "/public/a",
            "content": "z".repeat(10_000),
            "nested": {"API-Token": "hunter2", "list": ["p".repeat(300)]},
            "Password": "swordfish",
        });
        let q = question(
            "files.write",
            Some("SharedOS::File::\"/public/a\""),
            &args,
            false,
            "2026-12-05T00:00:00Z",
        );
        let text = serde_json::to_string(&q).expect("json");
        for secret in ["hunter2", "swordfish"] {
            assert!(!text.contains(secret), "{text}");
        }
        assert_eq!(q.arguments["Password"], "[redacted]");
        assert_eq!(q.arguments["nested"]["API-Token"], "[redacted]");
        assert!(!text.contains(&"z".repeat(QUESTION_MAX_STRING_BYTES + 1)));
        assert!(!text.contains(&"p".repeat(QUESTION_MAX_STRING_BYTES + 1)));
        assert!(q.message.contains("(10000 bytes in all)"), "{}", q.message);
        assert!(q.message.contains("`files.write`") && q.message.contains("/public/a"));
        // Too many bytes even when cut: only the size and digest.
        let many: serde_json::Map<String, Value> = (0..100)
            .map(|i| (format!("k{i}"), json!("v".repeat(100))))
            .collect();
        let q = question("t.x", None, &Value::Object(many), false, "e");
        assert!(
            q.arguments.get("argumentsDigest").is_some(),
            "{}",
            q.arguments
        );
        assert!(q.message.len() < QUESTION_MAX_ARGUMENT_BYTES);
        // Arguments recorded as digests are shown as one.
        let q = question("t.x", None, &json!({"a": "visible?"}), true, "e");
        assert!(!q.message.contains("visible?"));
    }

    #[test]
    fn a_principal_answer_is_taken_once_from_the_connection_asked() {
        let approvals = Approvals::new(Duration::from_secs(1));
        let mut ticket = approvals
            .wait(info("p"), Approver::Principal)
            .expect("waits");
        let session = HarnessSession::default();
        let answer = |bridge, a| approvals.answer("p", bridge, a, None, session.clone());
        // Not asked yet: refused.
        assert_eq!(
            answer(1, PrincipalAnswer::Approve),
            Err(DecideError::NotAsked("p".into()))
        );
        assert!(approvals.ask("p", 1));
        assert_eq!(
            answer(2, PrincipalAnswer::Approve),
            Err(DecideError::NotAsked("p".into()))
        );
        assert_eq!(
            approvals.decide("p", yes()),
            Err(DecideError::PrincipalOnly("p".into()))
        );
        assert_eq!(answer(1, PrincipalAnswer::Decline), Ok(Answered::Decided));
        assert_eq!(
            answer(1, PrincipalAnswer::Approve),
            Err(DecideError::AlreadyDecided("p".into()))
        );
        let d = ticket.withdraw().expect("decided");
        assert!(!d.approve && d.principal.is_some());
        // principal_or_operator: a harness that cannot ask leaves it to an operator.
        let _t = approvals
            .wait(info("q"), Approver::PrincipalOrOperator)
            .expect("waits");
        assert!(approvals.ask("q", 3));
        assert_eq!(
            approvals.answer("q", 3, PrincipalAnswer::Unable, None, session.clone()),
            Ok(Answered::ToOperator)
        );
        assert_eq!(
            approvals.answer("q", 3, PrincipalAnswer::Approve, None, session.clone()),
            Err(DecideError::NotAsked("q".into()))
        );
        approvals.decide("q", yes()).expect("the operator decides");
    }

    #[test]
    fn a_page_link_decides_once_for_its_own_call_and_principal() {
        let base = url::Url::parse("https://approvals.example/").expect("url");
        let approvals = Approvals::new(Duration::from_secs(1)).with_page(Some(base));
        let mut ticket = approvals
            .wait(info("p"), Approver::Principal)
            .expect("waits");
        let other_ticket = approvals
            .wait(info("q"), Approver::Principal)
            .expect("waits");
        let url = approvals
            .put_on_page("p", Some("helper".into()), vec!["ask".into()])
            .expect("a link");
        let link = url.path().trim_start_matches("/approval/").to_owned();
        assert_eq!(link.len(), 32, "{url}");
        let other = approvals.put_on_page("q", None, vec![]).expect("a link");
        let other = other.path().trim_start_matches("/approval/").to_owned();
        assert_ne!(link, other);
        let shown = approvals.on_page(&link).expect("on the page");
        assert_eq!(
            (shown.info.id.as_str(), shown.agent.as_deref()),
            ("p", Some("helper"))
        );
        assert_eq!(approvals.on_page_for("alice").len(), 2);
        assert!(approvals.on_page_for("bob").is_empty());
        let me = || PageDecider {
            subject: "sub-alice".into(),
        };
        assert_eq!(
            approvals.decide_on_page(&other, "p", "alice", true, me()),
            Err(LinkError::OtherCall)
        );
        assert!(matches!(
            approvals.decide_on_page(&link, "p", "bob", true, me()),
            Err(LinkError::NotYours { .. })
        ));
        assert_eq!(
            approvals.decide_on_page("0000", "p", "alice", true, me()),
            Err(LinkError::Unknown)
        );
        // Not the harness's: a bridge answer is not taken, and is noted once.
        assert!(approvals.first_bridge_answer("p"));
        assert!(!approvals.first_bridge_answer("p"));
        approvals
            .decide_on_page(&link, "p", "alice", true, me())
            .expect("decided");
        assert_eq!(
            approvals.decide_on_page(&link, "p", "alice", true, me()),
            Err(LinkError::Used)
        );
        assert_eq!(approvals.on_page(&link).err(), Some(LinkError::Used));
        let d = ticket.withdraw().expect("decided");
        assert_eq!(d.page, Some(me()));
        assert!(d.approve && d.principal.is_none());
        // The other call times out: its link ends with it.
        drop(other_ticket);
        assert_eq!(approvals.on_page(&other).err(), Some(LinkError::Ended));
    }

    #[test]
    fn a_withdrawn_or_dropped_ticket_leaves_the_table() {
        let approvals = Approvals::new(Duration::from_secs(1));
        let mut ticket = approvals
            .wait(info("x"), Approver::Operator)
            .expect("waits");
        assert_eq!(ticket.withdraw(), None);
        assert!(approvals.decide("x", yes()).is_err());
        let ticket2 = approvals
            .wait(info("z"), Approver::Operator)
            .expect("waits");
        drop(ticket2);
        drop(ticket);
        assert!(approvals.list().is_empty());
        assert_eq!(
            approvals.decide("z", yes()),
            Err(DecideError::AlreadyDecided("z".into()))
        );
    }
}
