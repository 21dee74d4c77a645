//! One `tools/call`: the referred call as the client sent it → a [`ToolCall`] (a portable name
//! mapped back to the canonical one) → the broker over the [`Link`] → its [`CallAnswer`], or the
//! shim's own answer ([`render::local_answer`]) when the broker cannot give one.

use std::sync::Arc;

use serde_json::Value;
use sharedos_proto::ToolCall;
use sharedos_proto::alias::PortableNames;
use sharedos_proto::ipc::CallAnswer;
use tokio_util::sync::CancellationToken;

use crate::guard::Referral;
use crate::link::Link;
use crate::render;

/// Forwards calls to the broker. Cheap to clone: one per call task.
#[derive(Clone)]
pub struct Caller {
    link: Arc<Link>,
    /// Portable ↔ canonical names, when the client cannot carry a dot.
    portable: Option<Arc<PortableNames>>,
}

impl Caller {
    pub fn new(link: Arc<Link>, portable: Option<Arc<PortableNames>>) -> Self {
        Self { link, portable }
    }

    /// Sends a referred call to the broker; resolves with its answer (or the shim's own, when the
    /// broker cannot give one), or `None` when the client cancelled it (`cancel` fired). The one
    /// path for every `tools/call`, whatever the shape of its name and arguments.
    pub async fn call(&self, referral: Referral, cancel: &CancellationToken) -> Option<CallAnswer> {
        let Referral {
            id,
            tool: sent,
            arguments,
            rejected: rejected_arguments,
            protocol: _,
            trace,
        } = referral;
        // A portable name is mapped back to the canonical one; any other string goes as sent.
        let tool = match &self.portable {
            Some(p) => p.canonical(&sent).to_owned(),
            None => sent,
        };
        let call = ToolCall {
            tool: tool.clone(),
            arguments,
            request_id: id.and_then(request_id_text),
            rejected_arguments,
            traceparent: trace.parent,
            tracestate: trace.state,
        };
        match self.link.call(call, cancel).await {
            Some(Ok(answer)) => Some(answer),
            Some(Err(why)) => Some(render::local_answer(&tool, &why)),
            None => None,
        }
    }
}

/// A JSON-RPC request id as the record carries it: a string as is, a number as its text.
fn request_id_text(id: Value) -> Option<String> {
    match id {
        Value::String(s) => Some(s),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}
