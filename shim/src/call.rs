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
use crate::link::{Link, Waiting};
use crate::render;

/// Forwards calls to the broker. Cheap to clone: one per call task.
#[derive(Clone)]
pub struct Caller {
    link: Arc<Link>,
    /// Portable ↔ canonical names, when the client cannot carry a dot.
    portable: Option<Arc<PortableNames>>,
    /// Whole lines for stdout (newline included): the progress notifications of calls that
    /// wait for a person's approval. Weak: it never keeps stdout's writer from finishing.
    notes: Option<tokio::sync::mpsc::WeakSender<Vec<u8>>>,
    /// Asks the person in the harness about calls held for their approval.
    asker: Arc<crate::ask::Asker>,
    /// The protocol `initialize` settled on (a 2026-07-28 client cannot be asked by request).
    protocol: crate::server::Negotiated,
}

/// The `notifications/progress` line (newline included) of a call waiting for approval.
pub fn progress_line(token: &Value, waiting: &Waiting, n: u64) -> Vec<u8> {
    let line = serde_json::json!({
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {
            "progressToken": token,
            "progress": n,
            "message": format!(
                "waiting for a person to approve this call (approval {}); refused at {} unless approved",
                waiting.approval, waiting.expires_at
            ),
        },
    });
    let mut bytes = line.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

impl Caller {
    pub fn new(
        link: Arc<Link>,
        portable: Option<Arc<PortableNames>>,
        asker: Arc<crate::ask::Asker>,
        protocol: crate::server::Negotiated,
    ) -> Self {
        Self {
            link,
            portable,
            notes: None,
            asker,
            protocol,
        }
    }

    /// Reports unparsable stdin lines to the broker (recorded as `malformed_frame`).
    pub async fn malformed(&self, bytes: u64, sha256: String, count: u64) {
        self.link.malformed(bytes, sha256, count).await;
    }

    /// Where progress notifications and questions to the person go (the session's stdout
    /// queue).
    pub fn set_notes(&mut self, notes: &tokio::sync::mpsc::Sender<Vec<u8>>) {
        self.notes = Some(notes.downgrade());
        self.asker.set_out(notes);
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
            protocol: stated,
            trace,
            progress: token,
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
        let notes = self.notes.as_ref();
        let shown = tool.clone();
        let mut progress = |w: &Waiting, n: u64| {
            if n == 1 {
                tracing::info!(tool = %shown, approval = %w.approval, expires_at = %w.expires_at, "the call waits for a person's approval");
            }
            if let (Some(token), Some(notes)) = (&token, notes.and_then(|n| n.upgrade())) {
                // A progress note that finds stdout's queue full is dropped, not waited for.
                let _ = notes.try_send(progress_line(token, w, n));
            }
        };
        let current = self.protocol.is_current(stated.as_deref());
        let asker = self.asker.clone();
        let ask = move |q: sharedos_proto::ipc::Question| {
            let asker = asker.clone();
            Box::pin(async move { asker.ask(&q, current).await })
                as std::pin::Pin<Box<dyn std::future::Future<Output = crate::link::Answer> + Send>>
        };
        match self.link.call(call, cancel, &mut progress, &ask).await {
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
