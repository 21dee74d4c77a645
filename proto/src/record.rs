//! The record's lines, typed: one [`Event`] per line, tagged by `kind`.
//!
//! The record is a product contract: operators read it, `column run` grades from it, and
//! `sharedos-broker records` prints it. The broker writes `seq` and `at` in front of an event's
//! own fields ([`RecordLine`] reads the whole line back). Field order is the order of the struct
//! fields below, and it is part of the contract (a golden test holds the bytes).
//!
//! Every line has a `turn`: a turn's id, or `null` on the lines of the broker as a whole
//! (`broker_started`, `policy_reloaded`, `providers_pinned`, `provider_state`). A turn opened with
//! a column's [`SystemIdentity`] carries it on every line of that turn, last.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::alias::AliasReport;
use crate::call::Requirement;
use crate::catalog::CatalogHash;
use crate::declaration::{SystemIdentity, ToolPolicy};
use crate::ipc::ShimInfo;

/// Now, as a record line's `at`: RFC 3339 UTC with microseconds
/// (`2026-12-03T16:05:05.123456Z`).
pub fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    now.format(&format)
        .unwrap_or_else(|_| now.unix_timestamp().to_string())
}

/// One whole record line as read back: `seq`, `at`, and the event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordLine {
    /// Strictly increasing, also across restarts.
    pub seq: u64,
    /// UTC, RFC 3339 with microseconds.
    pub at: String,
    /// The SHA-256 (hex) of the previous line's bytes (without its newline): the hash chain.
    /// Absent on the line that starts a new record's chain and on lines written before the
    /// record was chained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev: Option<String>,
    #[serde(flatten)]
    pub event: Event,
}

/// What a record line says, by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    BrokerStarted(BrokerStarted),
    TurnOpened(TurnOpened),
    BridgeConnected(BridgeConnected),
    BridgeClient(BridgeClient),
    /// A call that can change state, written before it runs (write-ahead).
    Intent(Intent),
    /// A call's outcome: every `tools/call` attempt has exactly one.
    Call(Call),
    TurnClosed(TurnClosed),
    PolicyReloaded(PolicyReloaded),
    ProvidersPinned(ProvidersPinned),
    ProviderState(ProviderState),
    /// The record's hash chain starts here (a new record, or one written before chaining).
    ChainStarted(ChainStarted),
    /// The broker signed the chain up to here.
    Checkpoint(Checkpoint),
    /// A torn last line (a crash mid-write) was cut off when the broker opened the record.
    TornTailCut(TornTailCut),
    /// A permitted call waits for a person (`@approval("required")` on a deciding policy).
    ApprovalRequested(ApprovalRequested),
    /// The wait of an `approval_requested` call ended: approved, denied, timeout or cancelled.
    ApprovalDecided(ApprovalDecided),
    /// Connections to `bridge.sock` refused before they reached a turn, per peer and reason,
    /// aggregated (at most one line per peer and reason per interval, with the count).
    BridgeRefused(ConnectionRefused),
    /// Connections to `control.sock` refused, aggregated as `bridge_refused`.
    ControlRefused(ConnectionRefused),
    /// Lines on a shim's stdin that were not JSON at all, aggregated per bridge.
    MalformedFrame(MalformedFrame),
    /// A brokered (upstream) server asked the broker's client side something: a question for
    /// the person (`elicitation/create`), a model completion (`sampling/createMessage`) or the
    /// client's roots (`roots/list`); what it asked and what the broker did.
    UpstreamRequest(UpstreamRequest),
    /// An answer to a waiting approval refused (see [`ApprovalAnswerRefused`]).
    ApprovalAnswerRefused(ApprovalAnswerRefused),
}

/// An upstream server's request to the broker (as its MCP client), and what became of it. The
/// question's schema is kept, never values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpstreamRequest {
    /// The provider's namespace.
    pub provider: String,
    /// `elicitation/create`, `sampling/createMessage` or `roots/list`; or a notification the
    /// broker does not pass on (`notifications/progress`).
    pub method: String,
    /// Elicitation: `form` or `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Elicitation, form mode: the requested schema (bounded: longer ones as their digest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
    /// Elicitation, URL mode: the URL's host only (and whether it is https).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// `refused` (a request), `forwarded` (a question put to the person behind a call), or
    /// `not_forwarded` (a notification).
    pub action: String,
    pub reason: String,
    /// The turn of the call whose person was asked (`forwarded`); `null` otherwise: an
    /// upstream's refused request belongs to no turn the broker can name.
    pub turn: Option<String>,
    /// `forwarded`: what the person did (`accept`, `decline`, `cancel`); never the form's
    /// values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// A question a 2026-07-28 server asked in an `input_required` result of a call (not a
    /// request of its own): the call's round it came in, from 1. Absent: `elicitation/create`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
}

impl Event {
    /// The line's `kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::BrokerStarted(_) => "broker_started",
            Event::TurnOpened(_) => "turn_opened",
            Event::BridgeConnected(_) => "bridge_connected",
            Event::BridgeClient(_) => "bridge_client",
            Event::Intent(_) => "intent",
            Event::Call(_) => "call",
            Event::TurnClosed(_) => "turn_closed",
            Event::PolicyReloaded(_) => "policy_reloaded",
            Event::ProvidersPinned(_) => "providers_pinned",
            Event::ProviderState(_) => "provider_state",
            Event::ChainStarted(_) => "chain_started",
            Event::Checkpoint(_) => "checkpoint",
            Event::TornTailCut(_) => "torn_tail_cut",
            Event::ApprovalRequested(_) => "approval_requested",
            Event::ApprovalDecided(_) => "approval_decided",
            Event::BridgeRefused(_) => "bridge_refused",
            Event::ControlRefused(_) => "control_refused",
            Event::MalformedFrame(_) => "malformed_frame",
            Event::UpstreamRequest(_) => "upstream_request",
            Event::ApprovalAnswerRefused(_) => "approval_answer_refused",
        }
    }

    /// The turn the line belongs to, if any.
    pub fn turn(&self) -> Option<&str> {
        match self {
            Event::TurnOpened(e) => Some(&e.turn),
            Event::BridgeConnected(e) => Some(&e.turn),
            Event::BridgeClient(e) => Some(&e.turn),
            Event::Intent(e) => Some(&e.turn),
            Event::Call(e) => Some(&e.turn),
            Event::TurnClosed(e) => Some(&e.turn),
            Event::BrokerStarted(e) => e.turn.as_deref(),
            Event::PolicyReloaded(e) => e.turn.as_deref(),
            Event::ProvidersPinned(e) => e.turn.as_deref(),
            Event::ProviderState(e) => e.turn.as_deref(),
            Event::ChainStarted(e) => e.turn.as_deref(),
            Event::Checkpoint(e) => e.turn.as_deref(),
            Event::TornTailCut(e) => e.turn.as_deref(),
            Event::ApprovalRequested(e) => Some(&e.turn),
            Event::ApprovalDecided(e) => Some(&e.turn),
            Event::BridgeRefused(e) | Event::ControlRefused(e) => e.turn.as_deref(),
            Event::MalformedFrame(e) => Some(&e.turn),
            Event::UpstreamRequest(e) => e.turn.as_deref(),
            Event::ApprovalAnswerRefused(e) => e.turn.as_deref(),
        }
    }
}

/// The broker started serving.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BrokerStarted {
    pub version: String,
    /// Tools registered.
    pub tools: usize,
    /// Where the configuration came from (a path, or `<embedded default>`).
    pub config: String,
    /// The SHA-256 (hex) of the policy file's bytes the broker started with: which policies
    /// decided the calls that follow (until a `policy_reloaded` names another).
    #[serde(
        rename = "policyDigest",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub policy_digest: Option<String>,
    /// Always `null`: this line belongs to no turn.
    pub turn: Option<String>,
}

/// The access context a turn was opened with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedAccessContext {
    pub principal: String,
    pub agent: Option<String>,
    pub agent_owner: Option<String>,
    /// The host's turn attributes (Cedar's `context.turn`), in RFC 8785 key order.
    pub turn: Option<Value>,
}

/// A turn was opened: who, with which catalogue, until when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnOpened {
    pub turn: String,
    pub access_context: RecordedAccessContext,
    pub token_file: Option<String>,
    pub tool_policy: Option<ToolPolicy>,
    pub system_identity: Option<SystemIdentity>,
    pub catalog_hash: CatalogHash,
    /// The published tools' names, in catalogue order.
    pub tools: Vec<String>,
    pub policy_version: u64,
    pub expires_at: String,
    pub harness: Option<String>,
    pub portable_names: bool,
}

/// The peer of a bridge connection, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Peer {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
}

/// A shim presented the turn's token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BridgeConnected {
    pub turn: String,
    pub peer: Peer,
    pub shim: ShimInfo,
    pub catalog_hash: CatalogHash,
    /// Each harness's aliases for this catalogue (recorded here, never on a call): on the turn's
    /// first `bridge_connected` line only. Later lines of the turn leave it out; their
    /// `catalogHash` names the same catalogue, whose aliases that first line carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aliases: Option<BTreeMap<String, AliasReport>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
}

/// The MCP client behind a shim, as it named itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientInfo {
    pub name: String,
    pub version: String,
    pub protocol_version: Option<String>,
    /// The capabilities the client declared, as names only: each capability with the names of
    /// its options (`{"elicitation": ["form"], "roots": []}`), bounded. Shows whether a client
    /// said it can be asked (a decline from one that cannot ask differs from a person's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Value>,
}

/// The MCP client behind a shim named itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BridgeClient {
    pub turn: String,
    pub client: ClientInfo,
    /// The client's strings cut to [`RECORD_MAX_STRING_BYTES`] (`client.name`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cuts>,
    /// `client_info` frames of this bridge since its previous `bridge_client` line that have no
    /// line of their own (repeats, or changes within `REFUSAL_RECORD_INTERVAL`): the bridge's
    /// frames are its lines plus the sum of their `suppressed`. Absent when none were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suppressed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
}

/// A call's arguments as the record keeps them, under `arguments`, `argumentsSha256` or
/// `argumentsDigest`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Arguments {
    /// As they are.
    #[serde(rename = "arguments")]
    Kept(Value),
    /// Redacted (`redact_arguments`): the SHA-256 of their JSON text, in hex.
    #[serde(rename = "argumentsSha256")]
    Redacted(String),
    /// Longer than `record_max_argument_bytes`: their size and SHA-256.
    #[serde(rename = "argumentsDigest")]
    Digest(Digest),
}

/// What the upstream was sent instead of a call's own arguments, under the same rule:
/// `forwardedArguments`, `forwardedArgumentsSha256` or `forwardedArgumentsDigest`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ForwardedArguments {
    #[serde(rename = "forwardedArguments")]
    Kept(Value),
    #[serde(rename = "forwardedArgumentsSha256")]
    Redacted(String),
    #[serde(rename = "forwardedArgumentsDigest")]
    Digest(Digest),
}

impl From<Arguments> for ForwardedArguments {
    fn from(a: Arguments) -> Self {
        match a {
            Arguments::Kept(v) => Self::Kept(v),
            Arguments::Redacted(h) => Self::Redacted(h),
            Arguments::Digest(d) => Self::Digest(d),
        }
    }
}

/// Kept here by name too: a record line's digests are the call's (see [`crate::call::Digest`]).
pub use crate::call::Digest;

/// Longest string a caller chooses (a tool name, a request id, a client's name or version) that
/// a record line keeps whole. A longer one is kept cut to this many bytes (ending in `…`), and the
/// line's `cut` names it with the whole string's size and SHA-256: the record does not grow with
/// what a caller sends.
pub const RECORD_MAX_STRING_BYTES: usize = 256;

/// Longest `message` a `call` line keeps whole (a refusal quotes the call; a failure may quote
/// what an upstream said); longer, it is cut the same way.
pub const RECORD_MAX_MESSAGE_BYTES: usize = 4096;

/// The strings of one line that were cut: the field's name (`tool`, `requestId`, `message`,
/// `client.name`, ...) → the whole string's size and SHA-256.
pub type Cuts = BTreeMap<String, Digest>;

/// Cuts `text` to `max` bytes (on a character boundary, ending in `…`) when it is longer, and
/// notes the whole string's size and SHA-256 under `field` in `cuts`.
pub fn bound(text: &mut String, max: usize, field: &str, cuts: &mut Option<Cuts>) {
    if text.len() <= max {
        return;
    }
    let whole = Digest::of(text.as_bytes());
    crate::name::clip(text, max);
    cuts.get_or_insert_with(Cuts::new)
        .insert(field.to_owned(), whole);
}

/// `text` as a record line keeps it: whole, or its first `max` bytes (as [`bound`] cuts it, with
/// the whole string's size and SHA-256 noted under `field`). Copies no more than it keeps.
pub fn bounded(text: &str, max: usize, field: &str, cuts: &mut Option<Cuts>) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    cuts.get_or_insert_with(Cuts::new)
        .insert(field.to_owned(), Digest::of(text.as_bytes()));
    let mut kept = String::with_capacity(end + '…'.len_utf8());
    kept.push_str(&text[..end]);
    kept.push('…');
    kept
}

/// [`bound`] for an optional string.
pub fn bound_opt(text: &mut Option<String>, max: usize, field: &str, cuts: &mut Option<Cuts>) {
    if let Some(t) = text.as_mut() {
        bound(t, max, field, cuts);
    }
}

impl Arguments {
    /// The record's form of arguments: redacted to a hash, or a digest when their JSON text is
    /// longer than `max_bytes`, else kept.
    pub fn recorded(value: Value, redact: bool, max_bytes: usize) -> Self {
        let text = value.to_string();
        if redact {
            Arguments::Redacted(crate::catalog::sha256_hex(text.as_bytes()))
        } else if text.len() > max_bytes {
            // The record does not grow with what a caller chooses to send.
            Arguments::Digest(Digest {
                bytes: text.len(),
                sha256: crate::catalog::sha256_hex(text.as_bytes()),
            })
        } else {
            Arguments::Kept(value)
        }
    }
}

/// A call that can change state, on record before it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Intent {
    pub turn: String,
    pub call_id: String,
    pub request_id: Option<String>,
    /// The tool string as the client sent it (which may be malformed).
    pub tool: String,
    #[serde(flatten)]
    pub arguments: Option<Arguments>,
    pub requirement: Option<Requirement>,
    /// The caller's strings this line keeps only the start of (`tool`, `requestId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cuts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
}

/// A permitted call that waits for a person's approval before it runs. Its `call` line follows
/// when the wait ends (one per attempt, as always), after an `approval_decided` line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRequested {
    pub turn: String,
    pub call_id: String,
    pub request_id: Option<String>,
    /// The approval id (hex SHA-256 of the RFC 8785 JSON of {turn, callId, principal, tool,
    /// arguments}): what `sharedos-broker approvals approve|deny` takes.
    pub approval: String,
    pub principal: String,
    pub tool: String,
    #[serde(flatten)]
    pub arguments: Option<Arguments>,
    pub requirement: Option<Requirement>,
    /// The policies that permitted the call (at least one asks for approval).
    pub policies: Vec<String>,
    /// When it is refused `denied/approval_timeout` if nobody decided.
    pub expires_at: String,
    /// The caller's strings this line keeps only the start of (`tool`, `requestId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cuts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
}

/// `approval_decided.by` for an operator's decision over `control.sock`.
pub const BY_OPERATOR: &str = "operator";
/// `approval_decided.by` for a form answered through the harness (MCP elicitation): it proves
/// only that the holder of the turn's token answered.
pub const BY_HARNESS_SESSION: &str = "harness_session";
/// `approval_decided.by` for the person's own decision on the person's page, signed in with the
/// operator's identity provider.
pub const BY_PRINCIPAL: &str = "principal";

/// How the wait for an approval ended. The line's `at` is when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalDecided {
    pub turn: String,
    pub call_id: String,
    pub approval: String,
    /// `approved` or `denied` (by a person), `timeout` or `cancelled`.
    pub decision: String,
    /// The uid on `control.sock` that approved or denied; `null` for timeout and cancelled,
    /// and for the principal's own answer.
    pub decided_by: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who answered: `operator` (over `control.sock`), `harness_session` (a form answered in the
    /// harness, through MCP elicitation: whoever holds the turn's token can give it, so it is not
    /// recorded as the person's), or `principal` (the person signed in on the person's page).
    /// Absent for timeout and cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// The principal's answer: the harness session it came from (the bridge connection of the
    /// turn, the shim's pid, the MCP client's name and version) and the elicitation action
    /// (`accept`, `decline`, `cancel`) with the value chosen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<crate::ipc::HarnessSession>,
    /// `page`: the person decided on the person's page (with `by: principal`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// The identity provider's subject (`sub`) of the person signed in on the page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
}

/// An answer to a waiting approval that decided nothing: a bridge's answer to a call asked on
/// the person's page, or a request to the page refused (no session, another person's, another
/// origin, a used, unknown or ended link, a link of another call).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalAnswerRefused {
    /// The approval it named, when it named one the broker knows (clipped otherwise).
    pub approval: Option<String>,
    pub turn: Option<String>,
    /// `bridge` (a shim's answer) or `page`.
    pub via: String,
    /// Why, as a word: `asked_on_page`, `no_session`, `csrf`, `cross_origin`, `link_unknown`,
    /// `link_used`, `link_ended`, `other_call`, `not_the_principal`.
    pub code: String,
    pub reason: String,
    /// The principal signed in on the page, and the identity provider's subject, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The bridge connection (`via: bridge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<u64>,
    /// The page's peer address (`via: page`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
}

/// One call attempt's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Call {
    pub turn: String,
    pub call_id: String,
    pub request_id: Option<String>,
    /// The tool string as the client sent it (which may be malformed).
    pub tool: String,
    /// Absent only on the `unknown` line a restart writes for an intent left open.
    #[serde(flatten)]
    pub arguments: Option<Arguments>,
    pub requirement: Option<Requirement>,
    /// `succeeded`, `denied`, `failed`, `cancelled`, or `unknown` (the broker stopped between a
    /// call's intent and its outcome).
    pub outcome: String,
    /// The outcome's code (`ok`, `no_permit`, `not_found`, ..., `broker_restart`).
    pub code: String,
    /// The ids of the policies that decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policies: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The strings this line keeps only the start of (`tool`, `requestId`, `message`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cuts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
    #[serde(flatten)]
    pub forwarded_arguments: Option<ForwardedArguments>,
    /// The names of the secrets whose values were replaced by `[redacted: NAME]` in the result,
    /// the message or the recorded arguments (never the values).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redacted: Option<Vec<String>>,
}

impl Call {
    /// The arguments as recorded, when they were kept whole.
    pub fn kept_arguments(&self) -> Option<&Value> {
        match &self.arguments {
            Some(Arguments::Kept(v)) => Some(v),
            _ => None,
        }
    }
}

/// A turn was closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnClosed {
    pub turn: String,
    /// `host`, `ttl`, `broker_shutdown`, `broker_restart`, ...
    pub reason: String,
    /// Calls the turn took (absent on a close a restart writes for the last broker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<u64>,
    #[serde(
        default,
        rename = "systemIdentity",
        skip_serializing_if = "Option::is_none"
    )]
    pub system_identity: Option<SystemIdentity>,
}

/// The host reloaded the policy set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyReloaded {
    pub version: u64,
    pub policies: usize,
    pub path: String,
    /// The SHA-256 (hex) of the policy file's bytes now in force (see `BrokerStarted`).
    #[serde(
        rename = "policyDigest",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub policy_digest: Option<String>,
    /// Always `null`.
    pub turn: Option<String>,
}

/// The host pinned the brokered providers' upstream catalogues.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProvidersPinned {
    /// namespace → upstream catalogHash.
    pub pins: BTreeMap<String, String>,
    /// Always `null`.
    pub turn: Option<String>,
}

/// A brokered provider changed state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderState {
    /// The provider's namespace.
    pub provider: String,
    /// `starting`, `ready`, `restarting`, `drifted` or `failed`; for one principal's instance of a
    /// `per_principal` provider, `instance_started`, `instance_stopped` or `drifted`; for a
    /// principal's sign-in to a remote server, `sign_in_asked`, `signed_in` or
    /// `sign_in_refused` (the provider empty when the refused request named none).
    pub state: String,
    /// The sandbox its upstream runs in: `"none"`, or {uid, gid, ownUid, read, write, network,
    /// ports, netns, memoryBytes, processes, openFiles, cpuSeconds, landlockAbi}; absent on lines
    /// written before sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<serde_json::Value>,
    #[serde(flatten)]
    pub detail: ProviderDetail,
    /// Always `null`.
    pub turn: Option<String>,
    /// The principal whose instance this is (a `per_principal` provider's `instance_started`,
    /// `instance_stopped` and `drifted` lines); absent for the provider itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// A remote provider's connection: {url, tls, insecureHttp}; absent for stdio providers and
    /// on lines written before remote providers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<serde_json::Value>,
}

/// What a provider state line says besides the state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ProviderDetail {
    /// The upstream listed its tools.
    #[serde(rename_all = "camelCase")]
    Listed {
        upstream_hash: Option<String>,
        pinned_hash: Option<String>,
        /// The tools registered from it.
        tools: Vec<String>,
        rejected: Vec<Rejected>,
    },
    /// A refusal with its code: `sign_in_refused` (a sign-in to a remote server that did not
    /// finish: `code` says which check refused it, `reason` why; never a token, a code or a
    /// `state`).
    Refused { code: String, reason: String },
    /// Why it is restarting or has failed.
    Reason { reason: String },
}

/// The start of the record's hash chain: every later line carries the SHA-256 of the line
/// before it in `prev`. On a new record this is line 1 and has no `prev`; on a record written
/// before chaining, it chains to the last line already there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainStarted {
    /// 32 random bytes (hex): no two chains start alike.
    pub genesis: String,
    /// The Ed25519 key (hex) the broker signs checkpoints with; `null` when it signs none.
    pub public_key: Option<String>,
    /// Lines already in the record, before the chain (0 on a new record).
    pub unchained_lines: u64,
    /// Always `null`.
    pub turn: Option<String>,
}

/// A signed checkpoint: Ed25519 over [`checkpoint_message`] of this line's `seq`, `prev` (the
/// chain's hash up to here), `at` and `reason`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// Why now: `interval`, `shutdown`, `rotation` or `start`.
    pub reason: String,
    /// The signing key (hex).
    pub public_key: String,
    /// The signature (hex, 64 bytes).
    pub signature: String,
    /// Always `null`.
    pub turn: Option<String>,
}

/// What a checkpoint signs: a fixed prefix, then the line's `seq`, `prev`, `at` and `reason`,
/// one per line. With the key that checks it, that covers every byte of the line but the
/// signature itself, so a checkpoint that is the record's last line is whole or detected.
pub fn checkpoint_message(seq: u64, prev: &str, at: &str, reason: &str) -> Vec<u8> {
    format!("sharedos-record-checkpoint-v1\n{seq}\n{prev}\n{at}\n{reason}\n").into_bytes()
}

/// Connections refused before hello was through: one line stands for `count` refusals of the
/// same peer for the same reason since the last such line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionRefused {
    /// `bad_token`, `uid_not_listed`, `bad_control_key`, `upstream_lineage`, `cap_reached`,
    /// `connect_rate`, `hello_too_large`, `hello_too_slow`, `not_hello`, `protocol_version`.
    pub reason: String,
    /// The peer process, as the kernel reported it for the connection (`SO_PEERCRED`); `null`
    /// on a line that stands for many processes of the uid (see `processes`).
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    /// Refusals this line stands for.
    pub count: u64,
    /// On a line grouped per uid (`pid: null`, a uid with more than a few refused processes at
    /// once): how many distinct processes its refusals came from (a lower bound past 4,096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<u64>,
    /// Always `null`.
    pub turn: Option<String>,
}

/// Lines on a shim's stdin it could not parse at all (not JSON): the last one's size and
/// SHA-256, and how many this line stands for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MalformedFrame {
    pub turn: String,
    pub bytes: u64,
    pub sha256: String,
    pub count: u64,
}

/// A torn tail that opening the record cut off (and saved aside).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TornTailCut {
    /// Bytes cut off.
    pub bytes: usize,
    /// Their SHA-256 (hex).
    pub sha256: String,
    /// Where they were saved.
    pub saved_to: String,
    /// Always `null`.
    pub turn: Option<String>,
}

/// One upstream tool a provider could not register, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejected {
    pub upstream: String,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round_trip(line: &str) -> RecordLine {
        let parsed: RecordLine = serde_json::from_str(line).expect("parses");
        assert_eq!(serde_json::to_string(&parsed).expect("ser"), line);
        parsed
    }

    #[test]
    fn a_global_line_has_a_null_turn() {
        let l = round_trip(
            r#"{"seq":1,"at":"2026-12-03T16:05:05.123456Z","kind":"broker_started","version":"0.1.0","tools":4,"config":"<embedded default>","turn":null}"#,
        );
        assert_eq!(l.event.kind(), "broker_started");
        assert_eq!(l.event.turn(), None);
    }

    #[test]
    fn arguments_keep_their_key() {
        for (args, key) in [
            (r#""arguments":{"path":"/a"}"#, "arguments"),
            (r#""argumentsSha256":"ab""#, "argumentsSha256"),
            (
                r#""argumentsDigest":{"bytes":99,"sha256":"ab"}"#,
                "argumentsDigest",
            ),
        ] {
            let line = format!(
                r#"{{"seq":2,"at":"A","kind":"call","turn":"t","callId":"t.1","requestId":"1","tool":"files.read",{args},"requirement":null,"outcome":"denied","code":"no_permit","policies":[],"durationUs":3,"forwardedArgumentsSha256":"cd"}}"#
            );
            let l = round_trip(&line);
            let Event::Call(call) = &l.event else {
                panic!("{l:?}")
            };
            assert!(line.contains(key));
            assert_eq!(
                call.forwarded_arguments,
                Some(ForwardedArguments::Redacted("cd".into()))
            );
        }
    }

    #[test]
    fn an_unknown_outcome_line_has_no_arguments_policies_or_duration() {
        let l = round_trip(
            r#"{"seq":3,"at":"A","kind":"call","turn":"t","callId":"t.1","requestId":"1","tool":"files.write","requirement":{"action":"write","resource":"SharedOS::File::\"/a\""},"outcome":"unknown","code":"broker_restart","message":"m"}"#,
        );
        let Event::Call(call) = l.event else { panic!() };
        assert_eq!(call.arguments, None);
        assert_eq!(call.policies, None);
    }

    #[test]
    fn provider_details_of_both_shapes() {
        round_trip(
            r#"{"seq":4,"at":"A","kind":"provider_state","provider":"p","state":"ready","upstreamHash":"a","pinnedHash":null,"tools":["p.x"],"rejected":[{"upstream":"y","reason":"r"}],"turn":null}"#,
        );
        round_trip(
            r#"{"seq":5,"at":"A","kind":"provider_state","provider":"p","state":"failed","reason":"gone","turn":null}"#,
        );
    }

    #[test]
    fn recorded_arguments_follow_the_rule() {
        let v = json!({"path": "/public/a.txt"});
        assert_eq!(
            Arguments::recorded(v.clone(), false, 1000),
            Arguments::Kept(v.clone())
        );
        let Arguments::Digest(d) = Arguments::recorded(v.clone(), false, 4) else {
            panic!()
        };
        assert_eq!(d.bytes, v.to_string().len());
        let Arguments::Redacted(h) = Arguments::recorded(v, true, 4) else {
            panic!()
        };
        assert_eq!(h.len(), 64);
    }

    #[test]
    fn approval_lines_keep_their_field_order() {
        let l = round_trip(
            r#"{"seq":6,"at":"A","kind":"approval_requested","turn":"t","callId":"t.1","requestId":"1","approval":"ab","principal":"alice","tool":"files.read","arguments":{"path":"/private/a"},"requirement":{"action":"read","resource":"SharedOS::File::\"/private/a\"","namespace":"files"},"policies":["ask"],"expiresAt":"B"}"#,
        );
        assert_eq!(l.event.kind(), "approval_requested");
        assert_eq!(l.event.turn(), Some("t"));
        round_trip(
            r#"{"seq":7,"at":"A","kind":"approval_decided","turn":"t","callId":"t.1","approval":"ab","decision":"denied","decidedBy":1000,"reason":"no"}"#,
        );
        round_trip(
            r#"{"seq":8,"at":"A","kind":"approval_decided","turn":"t","callId":"t.1","approval":"ab","decision":"timeout","decidedBy":null}"#,
        );
    }

    #[test]
    fn long_strings_are_cut_and_named_with_size_and_hash() {
        let mut cuts = None;
        assert_eq!(bounded("files.read", 16, "tool", &mut cuts), "files.read");
        assert_eq!(cuts, None);
        let long = "é".repeat(1000);
        let kept = bounded(&long, 16, "tool", &mut cuts);
        assert!(kept.len() <= 16 && kept.ends_with('…'), "{kept}");
        let mut owned = long.clone();
        bound(&mut owned, 16, "requestId", &mut cuts);
        assert_eq!(owned, kept);
        let cuts = cuts.expect("cut");
        assert_eq!(cuts["tool"], Digest::of(long.as_bytes()));
        assert_eq!(cuts["requestId"].bytes, 2000);
        let line = serde_json::to_string(&Event::BridgeClient(BridgeClient {
            turn: "t".into(),
            client: ClientInfo {
                name: kept,
                version: "1".into(),
                protocol_version: None,
                capabilities: None,
            },
            cut: Some(cuts),
            suppressed: None,
            system_identity: None,
        }))
        .expect("ser");
        assert!(
            line.contains(r#""cut":{"requestId":{"bytes":2000,"sha256":""#),
            "{line}"
        );
    }

    #[test]
    fn flood_roll_ups_round_trip_and_old_lines_still_read() {
        // A turn's later bridge names its catalogue by hash only; its first carries the aliases.
        let l = round_trip(
            r#"{"seq":1,"at":"A","kind":"bridge_connected","turn":"t","peer":{"pid":7,"uid":0},"shim":{},"catalogHash":"h"}"#,
        );
        assert!(matches!(l.event, Event::BridgeConnected(ref b) if b.aliases.is_none()));
        let l = round_trip(
            r#"{"seq":2,"at":"A","kind":"bridge_connected","turn":"t","peer":{"pid":7,"uid":0},"shim":{},"catalogHash":"h","aliases":{}}"#,
        );
        assert!(
            matches!(l.event, Event::BridgeConnected(ref b) if b.aliases == Some(BTreeMap::new()))
        );
        let l = round_trip(
            r#"{"seq":3,"at":"A","kind":"bridge_client","turn":"t","client":{"name":"n","version":"1","protocolVersion":null},"suppressed":41}"#,
        );
        assert!(matches!(l.event, Event::BridgeClient(ref c) if c.suppressed == Some(41)));
        let l = round_trip(
            r#"{"seq":4,"at":"A","kind":"bridge_refused","reason":"uid_not_listed","pid":null,"uid":1001,"count":900,"processes":899,"turn":null}"#,
        );
        assert!(matches!(l.event, Event::BridgeRefused(ref r) if r.processes == Some(899)));
        round_trip(
            r#"{"seq":5,"at":"A","kind":"bridge_refused","reason":"connect_rate","pid":7,"uid":0,"count":3,"turn":null}"#,
        );
    }

    #[test]
    fn an_unknown_kind_is_an_error_not_a_guess() {
        assert!(
            serde_json::from_str::<RecordLine>(r#"{"seq":1,"at":"A","kind":"nope","turn":null}"#)
                .is_err()
        );
    }
}
