//! The stdin guard: every line a client writes is checked before it goes anywhere, so that
//! malformed JSON-RPC gets the answer JSON-RPC prescribes (and the shim keeps serving) instead of
//! being dropped silently, which leaves a client waiting for its timeout.
//!
//! [`check_line`] is a pure function (fuzzed: `fuzz/fuzz_targets/shim_stdin.rs`). It never
//! decides anything about authority. Every `tools/call`, whatever tool it names and whatever the
//! shape of its name and arguments, is [`Verdict::Refer`]red to the kernel, which decides and
//! records it (ADR 0014: an attempt that leaves no trace is the one outcome the boundary must not
//! produce); the shim answers it itself, in rmcp's wire shape, so a call does not pay for rmcp's
//! parse, dispatch and serialization on top of the guard's own parse. That includes a call rmcp
//! could not parse (its name not a string or missing, its arguments not an object) or would drop
//! (sent as a notification). A `notifications/cancelled` passes on to rmcp and also names the
//! referred call to cancel ([`Verdict::Cancel`]). Everything else passes to rmcp.

use serde_json::{Value, json};
use sharedos_proto::nesting::{MAX_ARGUMENT_DEPTH, MAX_LINE_DEPTH, json_depth};

/// Longest line accepted. Tool arguments travel to the broker in one frame, so this stays below
/// the frame limit.
pub const MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;

/// What to do with one line.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Hand it to the MCP server unchanged.
    Pass,
    /// A `notifications/cancelled`: hand it to the MCP server unchanged (it may name one of
    /// rmcp's requests), and cancel the referred call with this request id if one is in flight.
    Cancel(Value),
    /// Answer with this JSON-RPC error response; the line goes no further.
    Answer(Value),
    /// A `tools/call`: send it to the kernel as it is, and answer what it says if it has an id.
    Refer(Referral),
    /// A response or notification nobody waits for: nothing to answer (JSON-RPC never answers a
    /// response); note why.
    Ignore(&'static str),
    /// A response (`result` or `error`, no `method`) with a string id: the answer to one of the
    /// shim's own requests to the client (`elicitation/create`) if the id is one it is waiting
    /// for, else ignored like any other.
    Response(Value),
}

/// A `tools/call` as the kernel gets it, whatever the shape of its name and arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Referral {
    /// The request id, to answer with; `None` for a call sent as a notification, which is
    /// decided and recorded but never answered.
    pub id: Option<Value>,
    /// The name as a string: as sent when it is one, its JSON text when it is another value
    /// (`5`, `null`), empty when it is missing. The kernel refuses it as malformed or
    /// unpublished.
    pub tool: String,
    /// The arguments as sent, whatever their type; `None` when missing or null (rmcp's "no
    /// arguments").
    pub arguments: Option<Value>,
    /// The protocol version the call states for itself (2026-07-28 clients put it in
    /// `params._meta["io.modelcontextprotocol/protocolVersion"]` on every request, and never
    /// send `initialize`): its answer takes that version's wire shape.
    pub protocol: Option<String>,
    /// Why the arguments were not passed on (the line is nested deeper than
    /// [`MAX_LINE_DEPTH`]): the kernel refuses and records the call without them.
    pub rejected: Option<String>,
    /// The W3C trace context the call carries in `params._meta` (`traceparent`, `tracestate`),
    /// passed to the broker for the call's span.
    pub trace: TraceContext,
    /// The rarer parts of a call: a progress token, declared capabilities, a retry. `None` when
    /// it has none of them (most calls). Boxed: a referral stays small.
    pub extras: Option<Box<Extras>>,
}

/// The rarer parts of a `tools/call` (see [`Referral::extras`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Extras {
    /// `params._meta.progressToken` (a string or a number): the client asked for
    /// `notifications/progress` about this call (sent while it waits for a person's approval).
    pub progress: Option<Value>,
    /// What a 2026-07-28 client says it can do, on the request itself
    /// (`params._meta["io.modelcontextprotocol/clientCapabilities"]`): `Some(true)` when it
    /// declares form-mode elicitation, `None` when the request declares nothing.
    pub elicit: Option<bool>,
    /// The same capabilities declare URL-mode elicitation (`elicitation: {url: {}}`): the
    /// client can show the person a link in an `input_required` round.
    pub elicit_url: bool,
    /// A retry after an `input_required` result: the `requestState` the shim gave and the
    /// client's `inputResponses`.
    pub resume: Option<Resume>,
}

impl Referral {
    /// The progress token the client gave the call.
    pub fn progress(&self) -> Option<&Value> {
        self.extras.as_ref().and_then(|r| r.progress.as_ref())
    }

    /// The client declares form-mode elicitation on the request (2026-07-28).
    pub fn elicit(&self) -> Option<bool> {
        self.extras.as_ref().and_then(|r| r.elicit)
    }

    /// The client declares URL-mode elicitation on the request (2026-07-28).
    pub fn elicit_url(&self) -> bool {
        self.extras.as_ref().is_some_and(|r| r.elicit_url)
    }

    /// The retry the request is, after an `input_required` result.
    pub fn resume(&self) -> Option<&Resume> {
        self.extras.as_ref().and_then(|r| r.resume.as_ref())
    }
}

/// A 2026-07-28 retry of a call the shim answered `input_required`: `params.requestState` (a
/// string of at most [`MAX_REQUEST_STATE_BYTES`]) and `params.inputResponses` (an object).
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    pub state: String,
    pub responses: Option<Value>,
}

/// Longest `requestState` read from a retry (the shim's own are 32 hex digits); a longer one is
/// none the shim gave, and the call goes as a new one.
pub const MAX_REQUEST_STATE_BYTES: usize = 128;

/// Where a 2026-07-28 request declares its client's capabilities.
pub const CAPABILITIES_META_KEY: &str = "io.modelcontextprotocol/clientCapabilities";

/// Client capabilities declare form-mode elicitation: `elicitation` with `form`, or an empty
/// `elicitation: {}` (form mode, as the 2025-11-25 revision says); `url` alone is not form mode.
pub fn declares_form_elicitation(capabilities: &Value) -> bool {
    match capabilities.get("elicitation") {
        Some(Value::Object(e)) => {
            e.contains_key("form") || (!e.contains_key("url") && !e.contains_key("form"))
        }
        _ => false,
    }
}

/// The elicitation a request's `_meta` declares, if it declares capabilities at all.
fn declared_elicitation(meta: Option<&Value>) -> Option<bool> {
    meta.and_then(|m| m.get(CAPABILITIES_META_KEY))
        .map(declares_form_elicitation)
}

/// The retry a call's params carry, if any (see [`Resume`]).
fn resume_of(state: Option<&Value>, responses: Option<&Value>) -> Option<Resume> {
    let state = state?
        .as_str()
        .filter(|s| s.len() <= MAX_REQUEST_STATE_BYTES)?;
    Some(Resume {
        state: state.to_owned(),
        responses: responses.filter(|r| r.is_object()).cloned(),
    })
}

/// A call's [`Extras`], when its request has any.
fn extras_of(
    meta: Option<&Value>,
    state: Option<&Value>,
    responses: Option<&Value>,
) -> Option<Box<Extras>> {
    let extras = Extras {
        progress: progress_token(meta),
        elicit: declared_elicitation(meta),
        elicit_url: meta
            .and_then(|m| m.get(CAPABILITIES_META_KEY))
            .and_then(|c| c.get("elicitation"))
            .is_some_and(|e| e.get("url").is_some()),
        resume: resume_of(state, responses),
    };
    (extras != Extras::default()).then(|| Box::new(extras))
}

/// `params._meta.traceparent` and `tracestate`, when they are strings of a sane length (the W3C
/// limits: a traceparent is 55 characters, a tracestate at most 512).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext {
    pub parent: Option<String>,
    pub state: Option<String>,
}

impl TraceContext {
    fn of(meta: Option<&Value>) -> Self {
        let text = |key: &str, most: usize| {
            meta.and_then(|m| m.get(key))
                .and_then(Value::as_str)
                .filter(|s| s.len() <= most)
                .map(str::to_owned)
        };
        match text("traceparent", 64) {
            Some(parent) => Self {
                parent: Some(parent),
                state: text("tracestate", 512),
            },
            None => Self::default(),
        }
    }
}

/// Where a request states its own protocol version.
pub const PROTOCOL_META_KEY: &str = "io.modelcontextprotocol/protocolVersion";

/// The protocol version a request's `_meta` states, if it is a string.
fn stated_protocol(meta: Option<&Value>) -> Option<String> {
    meta.and_then(|m| m.get(PROTOCOL_META_KEY))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// The progress token a request's `_meta` carries, if it is a string or a number.
fn progress_token(meta: Option<&Value>) -> Option<Value> {
    meta.and_then(|m| m.get("progressToken"))
        .filter(|t| t.is_string() || t.is_number())
        .cloned()
}

/// A call's `name` as the kernel gets it (see [`Referral::tool`]).
fn tool_text(name: Option<Value>) -> String {
    match name {
        Some(Value::String(name)) => name,
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

/// A JSON-RPC error response.
pub fn error(id: Value, code: i64, message: impl Into<String>) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message.into()}})
}

fn valid_id(v: &Value) -> bool {
    v.is_string() || v.is_i64() || v.is_u64()
}

/// Checks one line (without its newline).
///
/// The common shapes are checked by [`check_line_fast`], which does not build a `Value` tree of
/// the whole message (with the broker in the same build, serde_json keeps key order, so every
/// object is a hash map: the tree cost a sixth of the shim's CPU per call); anything it does not
/// settle goes to [`check_line_full`]. Both give the same verdict wherever the fast one gives
/// one (fuzzed).
pub fn check_line(line: &[u8]) -> Verdict {
    if line.len() <= MAX_LINE_BYTES {
        // One nesting limit, checked here where a call enters, so that everything passed on
        // parses everywhere after (sharedos_proto::nesting).
        let depth = json_depth(line);
        if depth > MAX_LINE_DEPTH {
            return check_deep_line(line, depth);
        }
        if let Some(verdict) = check_line_fast(line) {
            return verdict;
        }
    }
    check_line_full(line)
}

/// How much of an over-size line is kept to see what it was.
pub const OVERSIZE_PREFIX_BYTES: usize = 64 * 1024;

/// The SHA-256 of `bytes`, in hex (the fuzz model digests an over-size line with it).
pub use sharedos_proto::catalog::sha256_hex;

/// A line over [`MAX_LINE_BYTES`], of which only its first [`OVERSIZE_PREFIX_BYTES`] were kept
/// (`prefix`), with its length and SHA-256: a `tools/call` the prefix reveals is still an attempt,
/// referred to the kernel without its arguments (refused and recorded with the size and digest);
/// anything else gets -32600, with the id if the prefix shows one.
pub fn check_oversize(len: usize, prefix: &[u8], sha256: &str) -> Verdict {
    let seen = reveal(prefix);
    let id = seen.id.filter(valid_id);
    if seen.method.as_deref() == Some("tools/call") {
        return Verdict::Refer(Referral {
            id,
            tool: seen.name.unwrap_or_default(),
            arguments: None,
            protocol: None,
            extras: None,
            rejected: Some(format!(
                "the message is {len} bytes (SHA-256 {sha256}); the limit is {MAX_LINE_BYTES} bytes"
            )),
            trace: TraceContext::default(),
        });
    }
    Verdict::Answer(error(
        id.unwrap_or(Value::Null),
        INVALID_REQUEST,
        format!("message of {len} bytes exceeds the {MAX_LINE_BYTES}-byte limit"),
    ))
}

/// What the start of a JSON-RPC message shows: `id`, `method` and `params.name`, when they are
/// whole within it.
#[derive(Debug, Default, PartialEq)]
pub struct Revealed {
    pub id: Option<Value>,
    pub method: Option<String>,
    pub name: Option<String>,
}

/// A tolerant scan of the start of a message (it may stop anywhere, mid-token): keys and scalar
/// values of the top-level object and of its `params` object. Never panics, no recursion.
pub fn reveal(prefix: &[u8]) -> Revealed {
    let mut seen = Revealed::default();
    // The open brackets, and the key read last at depths 1 and 2.
    let mut stack: Vec<u8> = Vec::new();
    let (mut key1, mut key2): (Option<String>, Option<String>) = (None, None);
    let mut expect_key = false;
    let mut i = 0;
    while let Some(&b) = prefix.get(i) {
        match b {
            b'{' | b'[' => {
                stack.push(b);
                expect_key = b == b'{';
                i += 1;
            }
            b'}' | b']' => {
                stack.pop();
                expect_key = false;
                i += 1;
            }
            b',' => {
                expect_key = stack.last() == Some(&b'{');
                i += 1;
            }
            b':' => {
                expect_key = false;
                i += 1;
            }
            b'"' => {
                // The string's end: the next quote not escaped.
                let mut j = i + 1;
                let mut escaped = false;
                let end = loop {
                    match prefix.get(j) {
                        None => break None,
                        Some(b'\\') if !escaped => escaped = true,
                        Some(b'"') if !escaped => break Some(j),
                        Some(_) => escaped = false,
                    }
                    j += 1;
                };
                let Some(end) = end else { break };
                let text: Option<String> = prefix
                    .get(i..=end)
                    .and_then(|t| serde_json::from_slice(t).ok());
                let top = stack.as_slice() == b"{";
                let in_params = stack.as_slice() == b"{{" && key1.as_deref() == Some("params");
                if expect_key {
                    if top {
                        key1 = text;
                    } else if in_params {
                        key2 = text;
                    }
                } else if top {
                    match key1.as_deref() {
                        Some("method") => seen.method = text,
                        Some("id") => seen.id = text.map(Value::String),
                        _ => {}
                    }
                } else if in_params && key2.as_deref() == Some("name") {
                    seen.name = text;
                }
                i = end + 1;
            }
            b'-' | b'0'..=b'9' => {
                let mut j = i;
                while prefix
                    .get(j)
                    .is_some_and(|c| c.is_ascii_digit() || b"-+.eE".contains(c))
                {
                    j += 1;
                }
                if j == prefix.len() {
                    break; // the number may go on past the prefix
                }
                if stack.as_slice() == b"{" && key1.as_deref() == Some("id") {
                    seen.id = prefix
                        .get(i..j)
                        .and_then(|t| serde_json::from_slice::<Value>(t).ok());
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    seen
}

/// `tools/call` params of a line nested too deep: the name if it is shallow enough to read;
/// everything else is skipped (serde_json skips without a depth limit).
#[derive(serde::Deserialize)]
struct DeepCallParams {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
}

/// A line nested deeper than [`MAX_LINE_DEPTH`]: a `tools/call` is referred without its
/// arguments (refused and recorded by the kernel), any other request gets -32600, a
/// notification is dropped with a note.
fn check_deep_line(line: &[u8], depth: usize) -> Verdict {
    let why = format!(
        "the message is nested {depth} levels deep; tool arguments may be nested at most {MAX_ARGUMENT_DEPTH} levels"
    );
    let message = std::str::from_utf8(line)
        .ok()
        .and_then(|text| serde_json::from_str::<Message>(text).ok());
    let Some(message) = message else {
        return Verdict::Answer(error(Value::Null, INVALID_REQUEST, why));
    };
    let id = message.id.filter(valid_id);
    match (message.method, id) {
        ("tools/call", id) => {
            let name = message
                .params
                .and_then(|p| serde_json::from_str::<DeepCallParams>(p.get()).ok())
                .and_then(|p| p.name);
            Verdict::Refer(Referral {
                id,
                tool: tool_text(name),
                arguments: None,
                protocol: None,
                extras: None,
                rejected: Some(why),
                trace: TraceContext::default(),
            })
        }
        (_, Some(id)) => Verdict::Answer(error(id, INVALID_REQUEST, why)),
        (_, None) => Verdict::Ignore("a notification nested too deep"),
    }
}

/// A message in one of the common shapes: `jsonrpc` and `method` plain strings, no key twice.
#[derive(serde::Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    jsonrpc: &'a str,
    #[serde(default, deserialize_with = "present")]
    id: Option<Value>,
    #[serde(borrow)]
    method: &'a str,
    #[serde(default, borrow, deserialize_with = "present_raw")]
    params: Option<&'a serde_json::value::RawValue>,
}

/// `tools/call` params given as an object.
#[derive(serde::Deserialize)]
struct CallParams {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
    /// Null is "none" (`Option` reads it so).
    #[serde(default)]
    arguments: Option<Value>,
    #[serde(default, rename = "_meta")]
    meta: Option<Value>,
    #[serde(default, rename = "requestState")]
    request_state: Option<Value>,
    #[serde(default, rename = "inputResponses")]
    input_responses: Option<Value>,
}

/// `notifications/cancelled` params given as an object.
#[derive(serde::Deserialize)]
struct CancelParams {
    #[serde(default, rename = "requestId", deserialize_with = "present")]
    request_id: Option<Value>,
}

/// A key that is present, even when its value is null (`Option` alone reads null as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    <Value as serde::Deserialize>::deserialize(d).map(Some)
}

fn present_raw<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'de serde_json::value::RawValue>, D::Error> {
    <&serde_json::value::RawValue as serde::Deserialize>::deserialize(d).map(Some)
}

/// The verdict for a line in one of the common shapes, without a `Value` tree of the whole
/// message; `None` for anything else (not JSON, not an object, a key twice, an escaped or
/// non-string `jsonrpc` or `method`, an unusable id, params that are not an object or array),
/// which [`check_line_full`] settles. Public for the fuzz target, which holds it to
/// [`check_line_full`].
pub fn check_line_fast(line: &[u8]) -> Option<Verdict> {
    // serde_json skips the keys and values a struct ignores without checking their strings'
    // UTF-8 or `\u` escapes (lone surrogates), where the full parse rejects both (found by the
    // fuzz target). So: valid UTF-8 only, and a line with a `\u` escape goes the full way.
    let text = std::str::from_utf8(line).ok()?;
    if text.contains("\\u") {
        return None;
    }
    let message: Message = serde_json::from_str(text).ok()?;
    if message.jsonrpc != "2.0" || message.id.as_ref().is_some_and(|id| !valid_id(id)) {
        return None;
    }
    let object = match message.params.map(|p| p.get().as_bytes().first()) {
        None => None,
        Some(Some(b'{')) => message.params,
        Some(Some(b'[')) => None,
        Some(_) => return None,
    };
    Some(match message.method {
        "tools/call" => {
            let Some(p) = object else {
                return Some(Verdict::Refer(Referral {
                    id: message.id,
                    tool: String::new(),
                    arguments: None,
                    protocol: None,
                    rejected: None,
                    trace: TraceContext::default(),
                    extras: None,
                }));
            };
            let p: CallParams = serde_json::from_str(p.get()).ok()?;
            let meta = p.meta.as_ref();
            Verdict::Refer(Referral {
                id: message.id,
                tool: tool_text(p.name),
                protocol: stated_protocol(meta),
                rejected: None,
                trace: TraceContext::of(meta),
                extras: extras_of(meta, p.request_state.as_ref(), p.input_responses.as_ref()),
                arguments: p.arguments,
            })
        }
        "notifications/cancelled" if message.id.is_none() => {
            let request = match object {
                Some(p) => {
                    serde_json::from_str::<CancelParams>(p.get())
                        .ok()?
                        .request_id
                }
                None => None,
            };
            match request.filter(valid_id) {
                Some(request) => Verdict::Cancel(request),
                None => Verdict::Pass,
            }
        }
        _ => Verdict::Pass,
    })
}

/// The verdict for any line, from a full parse into a `Value` tree.
pub fn check_line_full(line: &[u8]) -> Verdict {
    if line.len() > MAX_LINE_BYTES {
        return Verdict::Answer(error(
            Value::Null,
            INVALID_REQUEST,
            format!(
                "message of {} bytes exceeds the {MAX_LINE_BYTES}-byte limit",
                line.len()
            ),
        ));
    }
    let value: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            let what = if std::str::from_utf8(line).is_err() {
                "not valid UTF-8"
            } else {
                "not valid JSON"
            };
            return Verdict::Answer(error(
                Value::Null,
                PARSE_ERROR,
                format!("parse error: the message is {what} ({e})"),
            ));
        }
    };
    let Value::Object(obj) = &value else {
        let why = if value.is_array() {
            "JSON-RPC batches are not supported by MCP (since 2025-06-18): send one message per line"
        } else {
            "a JSON-RPC message must be an object"
        };
        return Verdict::Answer(error(Value::Null, INVALID_REQUEST, why));
    };
    let id = obj.get("id");
    let answer_id = id.filter(|v| valid_id(v)).cloned().unwrap_or(Value::Null);
    if obj.get("jsonrpc") != Some(&Value::from("2.0")) {
        return Verdict::Answer(error(
            answer_id,
            INVALID_REQUEST,
            "`jsonrpc` must be \"2.0\"",
        ));
    }
    if let Some(id) = id
        && !valid_id(id)
    {
        return Verdict::Answer(error(
            Value::Null,
            INVALID_REQUEST,
            "`id` must be a string or an integer",
        ));
    }
    let Some(method) = obj.get("method") else {
        if obj.contains_key("result") || obj.contains_key("error") {
            if id.is_some_and(Value::is_string) {
                return Verdict::Response(value);
            }
            return Verdict::Ignore("a response sent to the server, which made no request");
        }
        return Verdict::Answer(error(
            answer_id,
            INVALID_REQUEST,
            "a request needs a `method`",
        ));
    };
    let Some(method) = method.as_str() else {
        return Verdict::Answer(error(
            answer_id,
            INVALID_REQUEST,
            "`method` must be a string",
        ));
    };
    let params = obj.get("params");
    if let Some(p) = params
        && !(p.is_object() || p.is_array())
    {
        if id.is_none() {
            return Verdict::Ignore("a notification with malformed params");
        }
        return Verdict::Answer(error(
            answer_id,
            INVALID_PARAMS,
            "`params` must be an object",
        ));
    }
    if method == "tools/call" {
        let tool = tool_text(params.and_then(|p| p.get("name")).cloned());
        // Sent as a notification (no id), the call is still an attempt: JSON-RPC forbids an
        // answer but not the work, so the kernel decides and records it and nobody is answered.
        return Verdict::Refer(Referral {
            id: id.cloned(),
            tool,
            arguments: params
                .and_then(|p| p.get("arguments"))
                .filter(|a| !a.is_null())
                .cloned(),
            protocol: stated_protocol(params.and_then(|p| p.get("_meta"))),
            rejected: None,
            trace: TraceContext::of(params.and_then(|p| p.get("_meta"))),
            extras: extras_of(
                params.and_then(|p| p.get("_meta")),
                params.and_then(|p| p.get("requestState")),
                params.and_then(|p| p.get("inputResponses")),
            ),
        });
    }
    if method == "notifications/cancelled"
        && id.is_none()
        && let Some(request) = params
            .and_then(|p| p.get("requestId"))
            .filter(|r| valid_id(r))
    {
        return Verdict::Cancel(request.clone());
    }
    Verdict::Pass
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(v: &Verdict) -> Option<i64> {
        match v {
            Verdict::Answer(e) => e["error"]["code"].as_i64(),
            _ => None,
        }
    }

    #[test]
    fn malformed_lines_get_their_json_rpc_answer() {
        assert_eq!(code(&check_line(b"not json")), Some(PARSE_ERROR));
        assert_eq!(
            code(&check_line(
                b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"pi"
            )),
            Some(PARSE_ERROR)
        );
        assert_eq!(code(&check_line(b"\xff\xfe{}")), Some(PARSE_ERROR));
        assert_eq!(
            code(&check_line(
                b"[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}]"
            )),
            Some(INVALID_REQUEST)
        );
        assert_eq!(
            code(&check_line(
                b"{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"ping\"}"
            )),
            Some(INVALID_REQUEST)
        );
        assert_eq!(
            code(&check_line(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":5}")),
            Some(INVALID_REQUEST)
        );
        assert_eq!(
            code(&check_line(
                b"{\"jsonrpc\":\"2.0\",\"id\":{\"a\":1},\"method\":\"ping\"}"
            )),
            Some(INVALID_REQUEST)
        );
        assert_eq!(
            code(&check_line(
                b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\",\"params\":\"x\"}"
            )),
            Some(INVALID_PARAMS)
        );
        assert_eq!(
            check_line(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}"),
            Verdict::Ignore("a response sent to the server, which made no request")
        );
        let big = vec![b'x'; MAX_LINE_BYTES + 1];
        assert_eq!(code(&check_line(&big)), Some(INVALID_REQUEST));
    }

    #[test]
    fn well_formed_messages_pass_whatever_tool_they_name() {
        assert_eq!(
            check_line(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}"),
            Verdict::Pass
        );
        assert_eq!(
            check_line(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}"),
            Verdict::Pass
        );
        assert_eq!(
            check_line(br#"{"jsonrpc":"2.0","id":2,"method":"unknown/method"}"#),
            Verdict::Pass
        );
    }

    #[test]
    fn the_answer_keeps_a_usable_id() {
        let Verdict::Answer(e) =
            check_line(br#"{"jsonrpc":"2.0","id":"x7","method":"tools/list","params":5}"#)
        else {
            panic!("answered");
        };
        assert_eq!(e["id"], "x7");
    }

    #[test]
    fn the_start_of_an_over_size_line_shows_what_it_was() {
        let r = reveal(br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"files.write","arguments":{"name":"not this","content":"xxxx"#);
        assert_eq!(
            r,
            Revealed {
                id: Some(json!(7)),
                method: Some("tools/call".into()),
                name: Some("files.write".into()),
            }
        );
        let r = reveal(
            br#"{"params":{"arguments":{"a":[1,2]},"name":"x\"y"},"method":"tools/call","id":"s"}"#,
        );
        assert_eq!(r.name.as_deref(), Some("x\"y"));
        assert_eq!(r.id, Some(json!("s")));
        // Cut mid-token: nothing half-read is taken.
        assert_eq!(reveal(br#"{"id":12"#).id, None);
        assert_eq!(reveal(br#"{"method":"tools/ca"#).method, None);
        for junk in [&b""[..], b"\"", b"{{{{", b"]]]", b"\\\"", b"{\"id\":-"] {
            let _ = reveal(junk);
        }
        // A call is referred without arguments, with its size and digest; anything else answered.
        match check_oversize(5_000_000, br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"files.write","arguments":{"#, "ab12") {
            Verdict::Refer(r) => {
                assert_eq!((r.id, r.tool.as_str()), (Some(json!(3)), "files.write"));
                assert!(r.arguments.is_none());
                let why = r.rejected.expect("why");
                assert!(why.contains("5000000 bytes") && why.contains("ab12"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        let Verdict::Answer(e) = check_oversize(
            5_000_000,
            br#"{"jsonrpc":"2.0","id":4,"method":"ping","params":{"#,
            "ab12",
        ) else {
            panic!("a ping is answered");
        };
        assert_eq!(
            (e["id"].clone(), e["error"]["code"].clone()),
            (json!(4), json!(INVALID_REQUEST))
        );
    }

    #[test]
    fn lines_nested_too_deep_are_referred_without_arguments_or_answered() {
        let nest = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        // Arguments exactly at the limit pass as usual.
        let ok = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"files.read","arguments":{{"a":{}}}}}}}"#,
            nest(MAX_ARGUMENT_DEPTH - 1)
        );
        match check_line(ok.as_bytes()) {
            Verdict::Refer(r) => assert!(r.rejected.is_none() && r.arguments.is_some()),
            other => panic!("{other:?}"),
        }
        for n in [MAX_ARGUMENT_DEPTH, 125, 126, 127, 128, 129, 130, 10_000] {
            let call = format!(
                r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"files.read","arguments":{{"a":{}}}}}}}"#,
                nest(n)
            );
            match check_line(call.as_bytes()) {
                Verdict::Refer(r) => {
                    assert_eq!((r.id, r.tool.as_str()), (Some(json!(7)), "files.read"));
                    assert!(r.arguments.is_none());
                    assert!(
                        r.rejected.as_deref().is_some_and(|w| w.contains("nested")),
                        "{n}"
                    );
                }
                other => panic!("depth {n}: {other:?}"),
            }
            // A ping's params are one level shallower than a call's arguments.
            let ping = format!(
                r#"{{"jsonrpc":"2.0","id":8,"method":"ping","params":{{"x":{}}}}}"#,
                nest(n + 1)
            );
            let Verdict::Answer(e) = check_line(ping.as_bytes()) else {
                panic!("depth {n}: a deep ping must be answered");
            };
            assert_eq!(
                (e["id"].clone(), e["error"]["code"].clone()),
                (json!(8), json!(INVALID_REQUEST))
            );
            let note = format!(
                r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"x":{}}}}}"#,
                nest(n + 1)
            );
            assert!(matches!(check_line(note.as_bytes()), Verdict::Ignore(_)));
        }
    }

    #[test]
    fn every_call_is_referred_to_the_kernel() {
        let refer = |line: &[u8]| match check_line(line) {
            Verdict::Refer(r) => r,
            other => panic!("{other:?} for {}", String::from_utf8_lossy(line)),
        };
        let r = refer(br#"{"jsonrpc":"2.0","id":"x7","method":"tools/call","params":{}}"#);
        assert_eq!(
            r,
            Referral {
                id: Some(json!("x7")),
                tool: String::new(),
                arguments: None,
                protocol: None,
                rejected: None,
                trace: TraceContext::default(),
                extras: None,
            }
        );
        let r = refer(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":5}}"#);
        assert_eq!((r.id, r.tool.as_str()), (Some(json!(1)), "5"));
        let r = refer(
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":{"a":[1]},"arguments":{}}}"#,
        );
        assert_eq!(r.tool, r#"{"a":[1]}"#);
        assert_eq!(r.arguments, Some(json!({})));
        let r = refer(
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"files.read","arguments":[1]}}"#,
        );
        assert_eq!(r.tool, "files.read");
        assert_eq!(r.arguments, Some(json!([1])));
        // Without params at all.
        let r = refer(br#"{"jsonrpc":"2.0","id":3,"method":"tools/call"}"#);
        assert_eq!(r.tool, "");
        // A well-formed call sent as a notification: decided and recorded, never answered.
        let r = refer(
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"files.read","arguments":{"path":"/x"}}}"#,
        );
        assert_eq!((r.id, r.tool.as_str()), (None, "files.read"));
        // Well formed, whatever tool it names.
        let r = refer(
            br#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"files read","arguments":{"p":1}}}"#,
        );
        assert_eq!(
            r,
            Referral {
                id: Some(json!("a")),
                tool: "files read".into(),
                arguments: Some(json!({"p": 1})),
                protocol: None,
                rejected: None,
                trace: TraceContext::default(),
                extras: None,
            }
        );
        // A client that asks for progress about the call.
        let r = refer(
            br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"x","_meta":{"progressToken":"p-1"}}}"#,
        );
        assert_eq!(r.progress(), Some(&json!("p-1")));
        // A 2026-07-28 client states its version on the call itself.
        let r = refer(
            br#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"x","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}}"#,
        );
        assert_eq!(r.protocol.as_deref(), Some("2026-07-28"));
        assert_eq!(r.elicit(), None);
        // A 2026-07-28 retry after `input_required`: its capabilities, state and responses, by
        // both parses.
        let retry = br#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"x","_meta":{"io.modelcontextprotocol/clientCapabilities":{"elicitation":{}}},"requestState":"abc","inputResponses":{"k":{"action":"decline"}}}}"#;
        for r in [
            refer(retry),
            match check_line_full(retry) {
                Verdict::Refer(r) => r,
                other => panic!("{other:?}"),
            },
        ] {
            assert_eq!(r.elicit(), Some(true));
            let resume = r.resume().expect("a retry");
            assert_eq!(resume.state, "abc");
            assert_eq!(resume.responses, Some(json!({"k": {"action": "decline"}})));
        }
        // A state that is not a string, or too long, is no retry; url-only elicitation is not form.
        let long = "s".repeat(MAX_REQUEST_STATE_BYTES + 1);
        for params in [
            json!({"name": "x", "requestState": 5, "_meta": {CAPABILITIES_META_KEY: {"elicitation": {"url": {}}}}}),
            json!({"name": "x", "requestState": long, "_meta": {CAPABILITIES_META_KEY: {}}}),
        ] {
            let line = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params})
                .to_string();
            let r = refer(line.as_bytes());
            assert_eq!((r.elicit(), r.resume()), (Some(false), None), "{line}");
            assert_eq!(r.elicit_url(), line.contains("url"), "{line}");
        }
        // Null arguments are rmcp's "none".
        let r = refer(
            br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"x","arguments":null}}"#,
        );
        assert_eq!(r.arguments, None);
    }

    #[test]
    fn a_cancellation_names_the_call_and_still_passes() {
        assert_eq!(
            check_line(
                br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7,"reason":"x"}}"#
            ),
            Verdict::Cancel(json!(7))
        );
        assert_eq!(
            check_line(
                br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"r7"}}"#
            ),
            Verdict::Cancel(json!("r7"))
        );
        // No usable request id: rmcp gets it as it is.
        for line in [
            &br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1.5}}"#
                [..],
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{}}"#,
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled"}"#,
        ] {
            assert_eq!(check_line(line), Verdict::Pass);
        }
    }

    #[test]
    fn a_call_carries_its_trace_context() {
        let line = br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"x","_meta":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"k=v"}}}"#;
        for verdict in [check_line(line), check_line_full(line)] {
            let Verdict::Refer(r) = verdict else {
                panic!("not referred")
            };
            assert_eq!(
                r.trace,
                TraceContext {
                    parent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
                    state: Some("k=v".into()),
                }
            );
        }
        // Not a string, or too long to be one: none at all.
        let long = format!(
            r#"{{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{{"name":"x","_meta":{{"traceparent":"{}"}}}}}}"#,
            "0".repeat(65)
        );
        let Verdict::Refer(r) = check_line(long.as_bytes()) else {
            panic!("not referred")
        };
        assert_eq!(r.trace, TraceContext::default());
    }

    #[test]
    fn the_fast_check_agrees_with_the_full_one() {
        let settled = [
            &br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#[..],
            br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            br#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"files.read","arguments":{"path":"/x"},"_meta":{"progressToken":1}}}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":5,"arguments":[1]}}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":null,"arguments":null}}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":["files.read",{}]}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call"}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x","_meta":["2026-07-28"]}}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x","_meta":{"io.modelcontextprotocol/protocolVersion":7}}}"#,
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"x"}}"#,
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}"#,
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":null}}"#,
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":[7]}"#,
            br#"{"jsonrpc":"2.0","id":3,"method":"notifications/cancelled","params":{"requestId":7}}"#,
            br#" {"method":"tools/list","jsonrpc":"2.0","id":9,"result":1} "#,
            br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"x","_meta":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"k=v"}}}"#,
            br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"x","_meta":{"traceparent":7,"tracestate":"k=v"}}}"#,
        ];
        for line in settled {
            let fast = check_line_fast(line);
            assert!(fast.is_some(), "{}", String::from_utf8_lossy(line));
            assert_eq!(
                fast,
                Some(check_line_full(line)),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
        let unsettled = [
            &b"not json"[..],
            br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#,
            br#"{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}"#,
            br#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#,
            br#"{"jsonrpc":"\u0032.0","id":1,"method":"ping"}"#,
            br#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#,
            br#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":"x"}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","name":"b"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
            // Found by the fuzz target: invalid UTF-8 in a key nobody reads.
            b"{\"jsonrpc\":\"2.0\",\"method\":\"ping\",\"x\":\"\xff\"}",
            br#"{"jsonrpc":"2.0","method":"ping","x":"\ud800"}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":["\ud800"]}"#,
        ];
        for line in unsettled {
            assert_eq!(
                check_line_fast(line),
                None,
                "{}",
                String::from_utf8_lossy(line)
            );
            assert_eq!(check_line(line), check_line_full(line));
        }
    }
}
