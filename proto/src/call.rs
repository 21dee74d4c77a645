//! A call as the harness made it ([`ToolCall`]) and what became of it ([`Outcome`]).
//!
//! `ToolCall.tool` is deliberately a plain string, not a [`crate::ToolName`]: a guess at a
//! malformed or unpublished name must reach the kernel to be refused and recorded. This module
//! never decides anything; it only names the outcomes.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One `tools/call`, exactly as the harness sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    /// The raw tool string. Not validated here.
    pub tool: String,
    /// The arguments as given (absent when the harness sent none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Value>,
    /// The MCP request id, rendered as text (numbers and strings both occur).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Why the arguments could not be passed on (nested deeper than
    /// [`crate::nesting::MAX_ARGUMENT_DEPTH`], a frame that could not be decoded): the kernel
    /// refuses the call `failed/invalid_arguments` and records it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_arguments: Option<String>,
    /// The client's W3C trace context (`params._meta.traceparent`, `tracestate`), when it sent
    /// one as a string: the parent of the call's span when OpenTelemetry export is on. One longer
    /// than [`MAX_TRACEPARENT_CHARS`] / [`MAX_TRACESTATE_CHARS`] (the W3C limits) is dropped as
    /// the frame is decoded, never copied out of it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "trace_header::<MAX_TRACEPARENT_CHARS, _>"
    )]
    pub traceparent: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "trace_header::<MAX_TRACESTATE_CHARS, _>"
    )]
    pub tracestate: Option<String>,
}

/// The longest `traceparent` a call keeps (version 00 is 55 characters; later versions may add
/// fields).
pub const MAX_TRACEPARENT_CHARS: usize = 64;
/// The longest `tracestate` a call keeps: the W3C Trace Context limit.
pub const MAX_TRACESTATE_CHARS: usize = 512;

/// A trace header as a call keeps it: a string of at most `MAX` bytes, else `None`. A longer
/// one is looked at where it lies in the frame (borrowed) and never allocated.
fn trace_header<'de, const MAX: usize, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<String>, D::Error> {
    struct Header<const MAX: usize>;
    impl<'de, const MAX: usize> serde::de::Visitor<'de> for Header<MAX> {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string or null")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok((v.len() <= MAX).then(|| v.to_owned()))
        }
        fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok((v.len() <= MAX).then_some(v))
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: serde::Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_str(self)
        }
    }
    d.deserialize_option(Header::<MAX>)
}

/// Why a call was denied: the kernel processed it and the answer is no.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenyCode {
    /// The tool string is not a valid ToolName.
    MalformedToolName,
    /// The tool is not in this turn's catalogue.
    UnpublishedTool,
    /// The arguments do not name a resource the kernel can decide on (e.g. a path escaping the
    /// root).
    UnresolvableRequirement,
    /// No policy permits the request.
    NoPermit,
    /// A `forbid` policy applies.
    Forbidden,
    /// A `[[budgets]]` limit of the config is used up (calls per turn, calls per minute per
    /// principal, bytes returned per turn).
    BudgetExhausted,
    /// The policy that permitted the call asks for a person's approval (`@approval("required")`)
    /// and the person said no.
    ApprovalDenied,
    /// ... and nobody decided within `approval_timeout_seconds`.
    ApprovalTimeout,
    /// ... and a person approved it, but what the call names changed while it waited (another
    /// resource, or the same path now naming another file or folder): the approval does not
    /// cover it, and it was not run.
    ApprovalStale,
    /// The policy asks the call's principal (`@approval("principal")`), in the harness, and the
    /// harness cannot ask (its MCP client declared no elicitation, or speaks a revision the shim
    /// cannot ask in): refused, with the reason recorded.
    ApprovalUnavailable,
}

/// Why a call failed: it was permitted (or could not be checked) and then did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailCode {
    /// The arguments do not satisfy the tool's inputSchema.
    InvalidArguments,
    /// The resource does not exist.
    NotFound,
    /// The result would exceed the output bound.
    TooLarge,
    /// The resource is not of the kind the tool works on (a folder given to read, ...).
    WrongKind,
    /// The provider reported an error (I/O, ...).
    ProviderError,
    /// The upstream MCP server answered with `isError`.
    UpstreamError,
    /// The upstream MCP server is not available.
    UpstreamUnavailable,
    /// A remote upstream MCP server refused the broker's credentials (HTTP 401/403): the
    /// provider's configured authorization is wrong, expired or revoked. Never retried in a loop.
    UpstreamUnauthorized,
    /// The upstream MCP server's tools no longer match its pin: its calls are refused until
    /// `sharedos-broker providers pin` accepts the new list.
    ProviderDrifted,
    /// The upstream needs a secret the principal does not have (or whose store refused it):
    /// nothing was spawned or sent.
    MissingCredential,
    /// The remote server needs the principal to sign in (`grant = "authorization_code"`) and
    /// they have not (yet): the answer carries the link to their page; nothing was sent.
    SignInRequired,
    /// The call ran past its time limit.
    Timeout,
    /// The broker could not process the call (it went away, an internal error).
    BrokerUnavailable,
    Internal,
}

/// Why a call was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelCode {
    /// The client sent `notifications/cancelled`.
    ClientCancelled,
    /// The turn closed (host request, TTL, broker shutdown) while the call ran.
    TurnClosed,
    /// The bridge connection went away while the call ran.
    Disconnected,
    /// The bridge connection had gone away before the call started: it was not run.
    ClientGone,
}

impl CancelCode {
    /// The code for a call cancelled before it started: the client going away is then
    /// `client_gone` (the call was not run), any other cause stays as it is.
    pub fn before_start(self) -> Self {
        match self {
            CancelCode::Disconnected => CancelCode::ClientGone,
            other => other,
        }
    }
}

/// The kernel's outcome of one call. denied and failed are never merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "code", rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Denied(DenyCode),
    Failed(FailCode),
    Cancelled(CancelCode),
}

impl Outcome {
    /// `succeeded`, `denied`, `failed` or `cancelled`.
    pub fn word(&self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Denied(_) => "denied",
            Outcome::Failed(_) => "failed",
            Outcome::Cancelled(_) => "cancelled",
        }
    }

    /// The code in snake_case (`ok` for success).
    pub fn code(&self) -> String {
        let value = match self {
            Outcome::Succeeded => return "ok".to_owned(),
            Outcome::Denied(c) => serde_json::to_value(c),
            Outcome::Failed(c) => serde_json::to_value(c),
            Outcome::Cancelled(c) => serde_json::to_value(c),
        };
        match value {
            Ok(Value::String(s)) => s,
            _ => "unknown".to_owned(),
        }
    }

    pub fn is_error(&self) -> bool {
        !matches!(self, Outcome::Succeeded)
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.word(), self.code())
    }
}

/// What the kernel resolved a call to require: an action on a resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    /// Cedar action id (`read`, `list`, `search`, `write`, `call`, ...).
    pub action: String,
    /// The resource, as `Type::"id"` text for people (`SharedOS::File::"/public/a.txt"`).
    pub resource: String,
    /// For a `SharedOS::File`: its `namespace` attribute (the provider's namespace), which the
    /// text of `resource` does not show and a policy may test. With it the record holds every
    /// input of the decision (`policy replay` decides a recorded call again). Absent for other
    /// resources, and on lines written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// For an entity of the operator's own type (an `entity` template): its attributes, as
    /// JSON, which the text of `resource` does not show (present, perhaps empty, for every
    /// such entity; absent for the built-in types).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<Box<serde_json::Map<String, Value>>>,
}

/// Size and SHA-256 (hex) of arguments the record does not keep whole (on a `call` line, and in
/// the approvals a host lists).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Digest {
    pub bytes: usize,
    pub sha256: String,
}

impl Digest {
    /// The size and SHA-256 of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            bytes: bytes.len(),
            sha256: crate::catalog::sha256_hex(bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace header past its limit is dropped as the call is decoded; one within it is kept; a
    /// missing or null one is none, and one that is not a string fails the call's decoding, as
    /// before.
    #[test]
    fn trace_headers_past_their_limit_are_dropped_in_decoding() {
        let decode = |meta: &str| {
            serde_json::from_str::<ToolCall>(&format!(r#"{{"tool":"files.read"{meta}}}"#))
        };
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = decode(&format!(r#","traceparent":"{parent}","tracestate":"k=v""#)).expect("ok");
        assert_eq!(
            (c.traceparent.as_deref(), c.tracestate.as_deref()),
            (Some(parent), Some("k=v"))
        );
        let long = "s".repeat(MAX_TRACESTATE_CHARS + 1);
        let c = decode(&format!(
            r#","traceparent":"{parent}","tracestate":"{long}""#
        ))
        .expect("ok");
        assert_eq!(
            (c.traceparent.as_deref(), c.tracestate),
            (Some(parent), None)
        );
        let within = "s".repeat(MAX_TRACESTATE_CHARS);
        let c = decode(&format!(
            r#","traceparent":"{parent}","tracestate":"{within}""#
        ))
        .expect("ok");
        assert_eq!(c.tracestate.as_deref(), Some(within.as_str()));
        let c = decode(&format!(r#","traceparent":"{}""#, "0".repeat(65))).expect("ok");
        assert_eq!(c.traceparent, None);
        // Escaped (so not borrowed from the input): the same limit.
        let c = decode(&format!(
            r#","traceparent":"{parent}","tracestate":"\u0073{long}""#
        ))
        .expect("ok");
        assert_eq!(c.tracestate, None);
        let c = decode(r#","traceparent":null"#).expect("ok");
        assert_eq!((c.traceparent, c.tracestate), (None, None));
        assert!(decode(r#","tracestate":7"#).is_err());
    }

    #[test]
    fn outcome_wire_form() {
        let v = serde_json::to_value(Outcome::Denied(DenyCode::NoPermit)).expect("ser");
        assert_eq!(
            v,
            serde_json::json!({"outcome": "denied", "code": "no_permit"})
        );
        assert_eq!(
            Outcome::Failed(FailCode::InvalidArguments).code(),
            "invalid_arguments"
        );
        assert_eq!(Outcome::Succeeded.code(), "ok");
        assert_ne!(
            Outcome::Denied(DenyCode::NoPermit).word(),
            Outcome::Failed(FailCode::NotFound).word()
        );
    }
}
