//! The messages carried in frames ([`crate::frame`]) on the two local sockets.
//!
//! - Bridge (`bridge.sock`, shim ↔ broker): the shim opens with [`BridgeRequest::Hello`] carrying
//!   its turn token and the protocol version; the broker answers [`BridgeEvent::Welcome`] with
//!   the published catalogue, or [`BridgeEvent::Refused`].
//! - Control (`control.sock`, host ↔ broker): the host opens with [`ControlRequest::Hello`]; then
//!   one response per request, in order.
//!
//! Nothing here carries authority: the shim can only present a token and forward calls; who the
//! principal is, and what the catalogue holds, the broker decides.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::call::{Outcome, Requirement, ToolCall};
use crate::catalog::CatalogHash;
use crate::declaration::{SystemIdentity, ToolPolicy};
use crate::definition::PublishedToolDefinition;

/// The IPC protocol version, carried in the first frame of each connection.
pub const PROTOCOL_VERSION: u32 = 1;

/// The `_meta` key under which an MCP result carries the machine form of an outcome.
pub const META_KEY: &str = "sharedos";

/// A turn's bearer token. Its `Debug` never shows the secret; there is no `Display`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TurnToken(String);

impl TurnToken {
    pub fn new(secret: String) -> Self {
        Self(secret)
    }
    /// The secret text, for the few places that must send or compare it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for TurnToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TurnToken(<redacted>)")
    }
}

/// The person's own token a host hands in at turn open (`--subject-token-file`), for the broker
/// to exchange (RFC 8693) at a remote server's authorization server. Its `Debug` never shows it;
/// there is no `Display`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SubjectToken(String);

impl SubjectToken {
    pub fn new(token: String) -> Self {
        Self(token)
    }
    /// The token text, for the broker to exchange and nowhere else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SubjectToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SubjectToken(<redacted>)")
    }
}

/// What the shim knows about the client that spawned it (for diagnostics on `bridge_connected`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShimInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shim_version: Option<String>,
}

/// Shim → broker.
///
/// Decoded in one pass when it is a call (see `TaggedVisitor`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", remote = "Self")]
pub enum BridgeRequest {
    Hello {
        protocol: u32,
        token: TurnToken,
        #[serde(default)]
        client: ShimInfo,
    },
    /// A `tools/call`. `id` is the shim's own, unique on this connection.
    Call { id: u64, call: ToolCall },
    /// The client cancelled call `id`.
    Cancel { id: u64 },
    /// The person's answer to [`BridgeEvent::Ask`] for `approval`, as the MCP client returned
    /// it from `elicitation/create` (or why it could not ask). The broker takes one answer per
    /// asked id, from the connection it asked, and only while the call waits.
    Decide {
        approval: String,
        answer: PrincipalAnswer,
        /// Why the client could not ask ([`PrincipalAnswer::Unable`]), for the record.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// How the person was asked: `elicitation/create` (a request to the client, up to
        /// 2025-11-25) or `input_required` (a 2026-07-28 result the client retried with the
        /// answer).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        via: Option<String>,
    },
    /// The MCP client's result for [`BridgeEvent::Relay`] `relay` (an elicitation result:
    /// `action`, `content`), or `error`: why it could not ask.
    Relayed {
        relay: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// The MCP client introduced itself (after `initialize`): recorded for diagnostics only.
    ClientInfo {
        name: String,
        version: String,
        #[serde(default)]
        protocol_version: Option<String>,
        /// The capabilities the client declared (`initialize`, or a 2026-07-28 request's
        /// `_meta`), for the record: whether it said it can be asked.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        capabilities: Option<Value>,
    },
    /// Lines on the shim's stdin that were not JSON at all since the last report (the shim
    /// reports at most once a second): the last one's size and SHA-256, and how many.
    MalformedFrame {
        bytes: u64,
        sha256: String,
        count: u64,
    },
}

/// Why the broker refused a bridge connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    ProtocolVersion,
    BadToken,
    TurnClosed,
    NotHello,
    Busy,
}

/// Broker → shim.
///
/// Decoded by hand (see the `Deserialize` impl below) so that an answer, the frame on every
/// call, is not buffered first: serde's derive for an internally tagged enum reads the whole
/// frame into a tree of its own to find the tag.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", remote = "Self")]
pub enum BridgeEvent {
    Welcome {
        protocol: u32,
        turn: String,
        catalog_hash: CatalogHash,
        tools: Vec<std::sync::Arc<PublishedToolDefinition>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at: Option<String>,
        /// The turn asked for portable names: the shim presents `.`-free names and maps them back.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        portable_names: bool,
        /// How long the shim waits for any one answer before it answers `failed/timeout` itself
        /// (the broker's longest call timeout plus a margin), in milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer_deadline_ms: Option<u64>,
    },
    Refused {
        code: RefusalCode,
        message: String,
    },
    Answer {
        id: u64,
        answer: CallAnswer,
    },
    /// The turn closed: the shim must stop serving.
    TurnClosed {
        reason: String,
    },
    /// Call `id` waits for a person's approval (`approval`, its id) until `expires_at`: its
    /// answer comes later, at most `timeout_ms` from now (the shim waits that much longer, and
    /// keeps a client that asked for progress informed).
    Waiting {
        id: u64,
        approval: String,
        expires_at: String,
        timeout_ms: u64,
    },
    /// Call `id` waits for its principal's own approval (`@approval("principal")`): the shim
    /// asks the person through the MCP client (`elicitation/create`) and answers with
    /// [`BridgeRequest::Decide`] for `approval`. Follows the call's [`BridgeEvent::Waiting`].
    Ask {
        id: u64,
        approval: String,
        question: Question,
    },
    /// A [`BridgeRequest::Decide`] the broker did not take (not asked on this connection,
    /// already answered, no longer waiting): the call it names is not decided by it.
    DecideRefused {
        approval: String,
        message: String,
    },
    /// A brokered server asks a question while call `id` is in flight on its session, and its
    /// provider forwards questions (`elicitation = "forward"`): the shim puts `request` (the
    /// server's `elicitation/create` params, with `provider` named) to the person and answers
    /// with [`BridgeRequest::Relayed`] for `relay`.
    Relay {
        id: u64,
        relay: u64,
        provider: String,
        request: Value,
        /// The question is the broker's own, not the server's: SharedOS asks the person to sign
        /// in to `provider` (a URL-mode `request` whose link is the person's page). The shim
        /// shows it as SharedOS's, with an `elicitationId` of its own, and tells the client
        /// when the call it held ends (`notifications/elicitation/complete`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        sign_in: bool,
    },
}

/// What the person is asked about a call held for the principal's approval. Made by the broker
/// (the shim only shows it): the tool, the resource the kernel decided on, and the arguments
/// bounded and with secret-looking values redacted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Question {
    /// The whole text shown to the person.
    pub message: String,
    pub tool: String,
    /// The resource the arguments resolved to (`SharedOS::File::"/public/a.txt"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// The arguments as shown: each string clipped, secret-looking keys redacted, the whole
    /// bounded.
    pub arguments: Value,
    pub expires_at: String,
    /// The person's page is configured: the one-time link where the person decides this call
    /// (asked with a URL-mode elicitation; no answer through the harness is taken).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// The person's answer to an [`BridgeEvent::Ask`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrincipalAnswer {
    /// `accept` with `decision: approve`.
    Approve,
    /// `accept` with `decision: deny`.
    Deny,
    /// The person declined to answer (`decline`).
    Decline,
    /// The person dismissed the question (`cancel`).
    Cancel,
    /// The client cannot ask (no `elicitation` capability, or a protocol the shim cannot ask
    /// in); `reason` says which.
    Unable,
}

impl PrincipalAnswer {
    /// The MCP elicitation action it came from (`unable` for none).
    pub fn action(self) -> &'static str {
        match self {
            PrincipalAnswer::Approve | PrincipalAnswer::Deny => "accept",
            PrincipalAnswer::Decline => "decline",
            PrincipalAnswer::Cancel => "cancel",
            PrincipalAnswer::Unable => "unable",
        }
    }
}

/// The harness session a principal's answer came from, as `approval_decided` records it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HarnessSession {
    /// The bridge connection (a serial, per broker run) the question went out on and the
    /// answer came back on.
    pub bridge: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shim_pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// The elicitation action (`accept`, `decline`, `cancel`).
    pub action: String,
    /// How the person was asked (`elicitation/create` or `input_required`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
}

impl Serialize for BridgeEvent {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The derived serializer (`remote = "Self"` makes it an inherent function).
        BridgeEvent::serialize(self, serializer)
    }
}

impl<'de> Deserialize<'de> for BridgeEvent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(TaggedVisitor {
            what: "a bridge event object",
            fast_tag: "answer",
            fast: |rest: AnswerRest| BridgeEvent::Answer {
                id: rest.id,
                answer: rest.answer,
            },
            slow: BridgeEvent::deserialize,
            payload: std::marker::PhantomData,
        })
    }
}

impl Serialize for BridgeRequest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        BridgeRequest::serialize(self, serializer)
    }
}

impl<'de> Deserialize<'de> for BridgeRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(TaggedVisitor {
            what: "a bridge request object",
            fast_tag: "call",
            fast: |rest: CallRest| BridgeRequest::Call {
                id: rest.id,
                call: rest.call,
            },
            slow: BridgeRequest::deserialize,
            payload: std::marker::PhantomData,
        })
    }
}

/// The rest of an answer frame after its `type`.
#[derive(Deserialize)]
struct AnswerRest {
    id: u64,
    answer: CallAnswer,
}

/// The rest of a call frame after its `type`.
#[derive(Deserialize)]
struct CallRest {
    id: u64,
    call: ToolCall,
}

/// Decodes an internally tagged frame (`type` names the variant) in one pass when `type` comes
/// first, as this crate writes it, and names `fast_tag`: the rest of the map goes straight to
/// `fast`'s payload. Any other frame is buffered and handed to `slow`, the derived decoder,
/// which is what serde's derive does for every frame (it reads the whole map into a tree of its
/// own to find the tag: for an answer or a call, the frame on every call, a fifth of the shim's
/// CPU).
struct TaggedVisitor<P, F, S> {
    what: &'static str,
    fast_tag: &'static str,
    fast: F,
    slow: S,
    payload: std::marker::PhantomData<fn() -> P>,
}

impl<'de, T, P, F, S> serde::de::Visitor<'de> for TaggedVisitor<P, F, S>
where
    P: Deserialize<'de>,
    F: FnOnce(P) -> T,
    S: FnOnce(Value) -> Result<T, serde_json::Error>,
{
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        use serde::de::Error;
        let mut buffered = Map::new();
        if let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let value: Value = map.next_value()?;
            if key == "type" && value == self.fast_tag {
                let rest = P::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                return Ok((self.fast)(rest));
            }
            buffered.insert(key.into_owned(), value);
        }
        while let Some((key, value)) = map.next_entry::<String, Value>()? {
            buffered.insert(key, value);
        }
        (self.slow)(Value::Object(buffered)).map_err(A::Error::custom)
    }
}

/// The broker's answer to one call: the kernel outcome in the one form both sides share.
///
/// On the wire the outcome's two keys sit beside the others (`flatten`). Decoding goes through
/// `AnswerFields` instead of serde's `flatten`, which buffers the whole answer into a tree of
/// its own first (a tenth of the shim's CPU per call, measured by profiling the benchmarks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", try_from = "AnswerFields")]
pub struct CallAnswer {
    #[serde(flatten)]
    pub outcome: Outcome,
    pub call_id: String,
    /// The tool string as the harness sent it.
    pub tool: String,
    /// For denied and failed: the sentence a model can act on, starting with the outcome word.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// For succeeded: MCP content blocks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content: Vec<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_content: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirement: Option<Requirement>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<String>,
}

/// The word of an [`Outcome`], as `CallAnswer` carries it under `outcome`.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum OutcomeWord {
    Succeeded,
    Denied,
    Failed,
    Cancelled,
}

/// [`CallAnswer`] as decoded: the same keys, the outcome's word and code as plain fields.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AnswerFields {
    outcome: OutcomeWord,
    #[serde(default)]
    code: Option<String>,
    call_id: String,
    tool: String,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    content: Vec<Value>,
    #[serde(default)]
    structured_content: Option<Value>,
    #[serde(default)]
    requirement: Option<Requirement>,
    #[serde(default)]
    policies: Vec<String>,
}

impl TryFrom<AnswerFields> for CallAnswer {
    type Error = String;

    fn try_from(f: AnswerFields) -> Result<Self, String> {
        fn code<T: for<'a> Deserialize<'a>>(code: Option<&str>) -> Result<T, String> {
            use serde::de::IntoDeserializer;
            let code = code.ok_or("missing field `code`")?;
            T::deserialize(code.into_deserializer())
                .map_err(|e: serde::de::value::Error| format!("code: {e}"))
        }
        let c = f.code.as_deref();
        let outcome = match f.outcome {
            OutcomeWord::Succeeded => Outcome::Succeeded,
            OutcomeWord::Denied => Outcome::Denied(code(c)?),
            OutcomeWord::Failed => Outcome::Failed(code(c)?),
            OutcomeWord::Cancelled => Outcome::Cancelled(code(c)?),
        };
        Ok(CallAnswer {
            outcome,
            call_id: f.call_id,
            tool: f.tool,
            message: f.message,
            content: f.content,
            structured_content: f.structured_content,
            requirement: f.requirement,
            policies: f.policies,
        })
    }
}

impl CallAnswer {
    /// The machine form carried under `_meta[META_KEY]`:
    /// `{outcome, code, callId, tool, action?, resource?, policies?}`.
    pub fn meta(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("outcome".into(), Value::from(self.outcome.word()));
        m.insert("code".into(), Value::from(self.outcome.code()));
        m.insert("callId".into(), Value::from(self.call_id.clone()));
        m.insert("tool".into(), Value::from(self.tool.clone()));
        if let Some(req) = &self.requirement {
            m.insert("action".into(), Value::from(req.action.clone()));
            m.insert("resource".into(), Value::from(req.resource.clone()));
        }
        if !self.policies.is_empty() {
            m.insert("policies".into(), Value::from(self.policies.clone()));
        }
        m
    }
}

/// Host → broker: a request to open a turn (ADR step 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct OpenTurn {
    pub principal: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The agent's owner (a principal id): fills `Agent.owner` in every decision of the turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_owner: Option<String>,
    /// The turn's attributes: the context's `turn` record in every decision of the turn, typed
    /// by the Cedar schema, and recorded on `turn_opened`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<Map<String, Value>>,
    /// Where the host writes this turn's token: an absolute path with `{turn}` in its file
    /// name, which the broker replaces with the turn's id. The broker removes that file when
    /// the turn closes, for whatever reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_policy: Option<ToolPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identity: Option<SystemIdentity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub harness: Option<String>,
    /// Present `.`-free names to the harness (refused at open if two tools would collide).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub portable_names: bool,
    /// The person's own token (an OAuth access or ID token the host holds for them): remote
    /// providers with `grant = "token_exchange"` exchange it for a token of their server. Never
    /// recorded, logged or shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject_token: Option<SubjectToken>,
}

/// Broker → host: a turn was opened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnOpened {
    pub turn: String,
    pub token: TurnToken,
    pub catalog_hash: CatalogHash,
    /// Shared with the broker's catalogue (serialized as the definitions themselves).
    pub tools: Vec<std::sync::Arc<PublishedToolDefinition>>,
    pub expires_at: String,
    /// Problems a harness will have with this catalogue (names over its 64-character limit,
    /// aliases that collide). The turn is open; the host decides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// The token file the host asked for, with `{turn}` replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
}

/// One open turn, as `turn list` shows it (never the token).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnSummary {
    pub turn: String,
    pub principal: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub catalog_hash: CatalogHash,
    pub tools: usize,
    pub opened_at: String,
    pub expires_at: String,
    pub bridges: usize,
    pub calls: u64,
    /// What is left of each budget that applies to this turn's tools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetLeft>,
}

/// What is left of one `[[budgets]]` limit, for a turn or a principal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetLeft {
    /// The budget as refusals name it: `files.read calls_per_turn=3`.
    pub budget: String,
    /// `turn` (calls or bytes per turn) or `principal` (calls per minute per principal).
    pub scope: String,
    pub limit: u64,
    pub left: u64,
    /// For a per-minute budget below its limit: seconds until one more call is allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refills_in_seconds: Option<f64>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A call waiting for a person's approval, as `approvals` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingApproval {
    /// The approval id: SHA-256 (hex) of the RFC 8785 JSON of {turn, callId, principal, tool,
    /// arguments, requirement}, bound to this one call attempt and what it was decided on.
    pub id: String,
    pub turn: String,
    pub call_id: String,
    pub principal: String,
    pub tool: String,
    /// The call's arguments as given; `null` in an `approvals` listing when they are longer
    /// than it shows (then `argumentsDigest` has their size and SHA-256, and
    /// [`ControlRequest::ApprovalArguments`] returns them whole).
    pub arguments: Value,
    /// What the policy decided on: the resource the arguments resolved to (a file as its links
    /// led when the call was held). The call runs only on that very resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirement: Option<Requirement>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments_digest: Option<crate::call::Digest>,
    pub requested_at: String,
    pub expires_at: String,
}

/// Host → broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlRequest {
    Hello {
        protocol: u32,
        /// The key the broker wrote to `control.key` (0600) in its runtime dir: a peer under
        /// the broker's own uid must present it, so that a process that can connect but cannot
        /// read the runtime dir (a brokered upstream in its sandbox, and whatever it forks) is
        /// refused whatever its lineage.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<TurnToken>,
    },
    OpenTurn(Box<OpenTurn>),
    CloseTurn {
        turn: String,
    },
    ListTurns,
    Catalog {
        principal: String,
        #[serde(default)]
        agent: Option<String>,
    },
    /// Record lines with `seq > after_seq`, at most `limit` of them.
    Records {
        #[serde(default)]
        turn: Option<String>,
        #[serde(default)]
        after_seq: u64,
        #[serde(default)]
        limit: Option<u32>,
    },
    PolicyCheck {
        principal: String,
        #[serde(default)]
        agent: Option<String>,
        tool: String,
        #[serde(default)]
        arguments: Option<Value>,
    },
    PolicyReload,
    /// Each provider, its state, tools and rejected registrations.
    Providers,
    /// Write each brokered provider's current upstream catalogHash to the pin file.
    PinProviders,
    /// What OpenTelemetry export did: spans queued, exported and dropped.
    Telemetry,
    /// The calls waiting for a person's approval.
    Approvals,
    /// A waiting call's arguments, whole, as JSON text: the part from byte `offset` on (an
    /// answer carries a bounded part; ask again from `offset` + its length while `more`).
    ApprovalArguments {
        id: String,
        #[serde(default)]
        offset: usize,
    },
    /// Approve (`approve: true`) or deny a waiting call by its approval id.
    DecideApproval {
        id: String,
        approve: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

/// OpenTelemetry export's counts since the broker started (`sharedos-broker telemetry`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TelemetryStats {
    pub enabled: bool,
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Spans handed to the export queue.
    pub queued: u64,
    /// Spans the backend accepted.
    pub exported: u64,
    /// Spans dropped because the queue was full (the call was answered and recorded anyway).
    pub dropped_queue_full: u64,
    /// Spans dropped because their export failed (backend down, refused, timed out).
    pub dropped_export_failed: u64,
    /// Record lines exported as OpenTelemetry log records (`[otel] logs = true`; checkpoints
    /// are exported whenever export is on), through the same bounded queue as spans.
    #[serde(default)]
    pub logs: LogStats,
    /// Checkpoints handed to `witness_file` / `witness_command`.
    #[serde(default)]
    pub witness: WitnessCounts,
}

/// Record lines handed to the OpenTelemetry log export.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogStats {
    pub queued: u64,
    pub exported: u64,
    pub dropped_queue_full: u64,
    pub dropped_export_failed: u64,
}

/// Checkpoints handed to the witness (`witness_file`, `witness_command`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WitnessCounts {
    /// Whether a witness file or command is configured.
    pub enabled: bool,
    pub queued: u64,
    /// Taken by every configured route.
    pub witnessed: u64,
    /// Appends or command runs that failed or timed out.
    pub failed: u64,
    /// Dropped because the witness queue was full.
    pub dropped: u64,
}

/// Broker → host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlResponse {
    Welcome {
        protocol: u32,
        broker_version: String,
    },
    TurnOpened(TurnOpened),
    TurnClosed {
        turn: String,
        /// The turn's token file, if it had one (the host removes it too, if it is still there).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token_file: Option<String>,
    },
    Turns {
        turns: Vec<TurnSummary>,
    },
    Catalog {
        catalog_hash: CatalogHash,
        tools: Vec<std::sync::Arc<PublishedToolDefinition>>,
        /// What is left of each budget that applies to these tools (per-turn budgets at their
        /// full limit: a new turn starts with them whole).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        budgets: Vec<BudgetLeft>,
    },
    Records {
        lines: Vec<Value>,
        /// Pass as `after_seq` to continue.
        last_seq: u64,
        more: bool,
    },
    Decision {
        decision: String,
        outcome: Outcome,
        #[serde(default)]
        requirement: Option<Requirement>,
        policies: Vec<String>,
        message: String,
        /// The context the policy saw (`agent`, `turn`, the call's typed `arguments`), when the
        /// tool is in the principal's catalogue.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<Value>,
    },
    PolicyReloaded {
        version: u64,
        policies: usize,
    },
    Providers {
        providers: Vec<Value>,
    },
    Pinned {
        path: String,
        pins: std::collections::BTreeMap<String, String>,
    },
    Telemetry(TelemetryStats),
    Approvals {
        approvals: Vec<PendingApproval>,
        /// Calls waiting that the answer had no room for (the newest).
        #[serde(default, skip_serializing_if = "is_zero")]
        not_shown: usize,
    },
    /// Part of a waiting call's arguments (JSON text), from byte `offset`; `bytes` and `sha256`
    /// are the whole text's.
    ApprovalArguments {
        id: String,
        offset: usize,
        text: String,
        bytes: usize,
        sha256: String,
        more: bool,
    },
    /// The decision reached the waiting call (`approved` or `denied`).
    ApprovalDecided {
        id: String,
        decision: String,
    },
    Error {
        code: String,
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_debug_is_redacted() {
        let t = TurnToken::new("s3cr3t".into());
        assert!(!format!("{t:?}").contains("s3cr3t"));
        let hello = BridgeRequest::Hello {
            protocol: 1,
            token: t,
            client: ShimInfo::default(),
        };
        assert!(!format!("{hello:?}").contains("s3cr3t"));
    }

    #[test]
    fn answer_meta_has_the_machine_form() {
        let a = CallAnswer {
            outcome: Outcome::Denied(crate::call::DenyCode::NoPermit),
            call_id: "c1".into(),
            tool: "files.read".into(),
            message: Some("denied: ...".into()),
            content: vec![],
            structured_content: None,
            requirement: Some(Requirement {
                action: "read".into(),
                resource: "SharedOS::File::\"/private/a\"".into(),
                namespace: Some("files".into()),
                attributes: None,
            }),
            policies: vec![],
        };
        let m = a.meta();
        assert_eq!(m["outcome"], "denied");
        assert_eq!(m["code"], "no_permit");
        assert_eq!(m["action"], "read");
        // The harness's view is unchanged: the namespace is the record's, not `_meta`'s.
        assert!(!m.contains_key("namespace"));
        let wire = serde_json::to_value(&a).expect("ser");
        assert_eq!(wire["outcome"], "denied");
        assert_eq!(wire["code"], "no_permit");
    }

    #[test]
    fn frames_decode_as_they_were_encoded() {
        use crate::call::{CancelCode, DenyCode, FailCode};
        for outcome in [
            Outcome::Succeeded,
            Outcome::Denied(DenyCode::UnpublishedTool),
            Outcome::Failed(FailCode::InvalidArguments),
            Outcome::Cancelled(CancelCode::ClientCancelled),
        ] {
            let answer = CallAnswer {
                outcome,
                call_id: "t-1.2".into(),
                tool: "files.read".into(),
                message: outcome.is_error().then(|| "no".into()),
                content: vec![serde_json::json!({"type": "text", "text": "x"})],
                structured_content: Some(serde_json::json!({"a": 1})),
                requirement: None,
                policies: vec!["p1".into()],
            };
            let event = BridgeEvent::Answer { id: 9, answer };
            let bytes = serde_json::to_vec(&event).expect("encode");
            let back: BridgeEvent = serde_json::from_slice(&bytes).expect("decode");
            assert_eq!(back, event);
        }
        // Frames with `type` elsewhere, and the other events, take the buffered path.
        let answer: BridgeEvent = serde_json::from_str(
            r#"{"id":3,"answer":{"outcome":"succeeded","callId":"c","tool":"x"},"type":"answer"}"#,
        )
        .expect("decode");
        assert!(matches!(answer, BridgeEvent::Answer { id: 3, .. }));
        let closed = BridgeEvent::TurnClosed {
            reason: "ttl".into(),
        };
        let back: BridgeEvent =
            serde_json::from_slice(&serde_json::to_vec(&closed).expect("encode")).expect("decode");
        assert_eq!(back, closed);
        for bad in [
            r#"{"type":"answer","id":"x","answer":{}}"#,
            r#"{"type":"nope"}"#,
            r#"{}"#,
            r#"[]"#,
        ] {
            assert!(serde_json::from_str::<BridgeEvent>(bad).is_err(), "{bad}");
        }
        // Requests: a call in one pass, the others (and a call with `type` last) buffered.
        for request in [
            BridgeRequest::Call {
                id: 4,
                call: ToolCall {
                    tool: "files.read".into(),
                    arguments: Some(serde_json::json!({"path": "/public/a.txt"})),
                    request_id: Some("7".into()),
                    rejected_arguments: None,
                    traceparent: None,
                    tracestate: None,
                },
            },
            BridgeRequest::Hello {
                protocol: PROTOCOL_VERSION,
                token: TurnToken::new("t".into()),
                client: ShimInfo::default(),
            },
            BridgeRequest::Cancel { id: 4 },
        ] {
            let bytes = serde_json::to_vec(&request).expect("encode");
            let back: BridgeRequest = serde_json::from_slice(&bytes).expect("decode");
            assert_eq!(back, request);
        }
        let call: BridgeRequest =
            serde_json::from_str(r#"{"id":1,"call":{"tool":"x"},"type":"call"}"#).expect("decode");
        assert!(matches!(call, BridgeRequest::Call { id: 1, .. }));
        assert!(serde_json::from_str::<BridgeRequest>(r#"{"type":"call","id":1}"#).is_err());
        // Any key order; a code the shim does not know, or none where one is due, is an error.
        let answer: CallAnswer = serde_json::from_str(
            r#"{"tool":"x","callId":"c","code":"no_permit","outcome":"denied"}"#,
        )
        .expect("decode");
        assert_eq!(answer.outcome, Outcome::Denied(DenyCode::NoPermit));
        for bad in [
            r#"{"tool":"x","callId":"c","outcome":"denied","code":"nope"}"#,
            r#"{"tool":"x","callId":"c","outcome":"failed"}"#,
            r#"{"tool":"x","callId":"c","outcome":"maybe"}"#,
        ] {
            assert!(serde_json::from_str::<CallAnswer>(bad).is_err(), "{bad}");
        }
    }
}
