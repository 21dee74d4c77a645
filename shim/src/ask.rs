//! Asking the person in the harness: a call held for its principal's approval
//! (`@approval("principal")`) becomes an `elicitation/create` request to the MCP client, and
//! the client's response, matched by the shim's own request id, becomes the answer the shim
//! sends the broker ([`BridgeRequest::Decide`](sharedos_proto::ipc::BridgeRequest)).
//!
//! Only the client's response to the shim's own request counts: a tool call cannot answer
//! (the guard refers every `tools/call` to the kernel, which knows no such tool), and a
//! response with an id the shim did not send, or a second one for the same id, is dropped.
//! The broker binds each question to the bridge connection it asked, once, besides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use sharedos_proto::ipc::{PrincipalAnswer, Question};
use tokio::sync::{mpsc, oneshot};

/// What the client said it can do, from `initialize`.
#[derive(Clone, Default)]
pub struct ClientCan {
    /// The client declared the `elicitation` capability with form mode (an empty
    /// `elicitation: {}` is form mode, as the 2025-11-25 revision says).
    form: Arc<AtomicBool>,
}

impl ClientCan {
    /// Reads the client's `capabilities` from `initialize`.
    pub fn settle(&self, capabilities: &Value) {
        let form = match capabilities.get("elicitation") {
            Some(Value::Object(e)) => {
                e.contains_key("form") || (!e.contains_key("url") && !e.contains_key("form"))
            }
            _ => false,
        };
        self.form.store(form, Ordering::Relaxed);
    }

    pub fn form(&self) -> bool {
        self.form.load(Ordering::Relaxed)
    }
}

/// The prefix of the shim's own request ids (a client's requests never reach this table).
const ID_PREFIX: &str = "sharedos-approval-";

/// The form the person answers: one choice, approve or deny.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "decision": {
                "type": "string",
                "title": "Your decision",
                "description": "approve runs this call once; deny refuses it",
                "enum": ["approve", "deny"],
            }
        },
        "required": ["decision"],
    })
}

/// The shim's questions to the client in flight, by request id.
#[derive(Default)]
pub struct Asker {
    out: Mutex<Option<mpsc::WeakSender<Vec<u8>>>>,
    pending: Mutex<HashMap<String, oneshot::Sender<Value>>>,
    next: AtomicU64,
    pub can: ClientCan,
}

/// Takes a question out of the table when its asker stops waiting (answered, or the call
/// ended first: then the client is told the request is cancelled).
struct Outstanding<'a> {
    asker: &'a Asker,
    id: String,
    answered: bool,
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        let was = self
            .asker
            .pending
            .lock()
            .ok()
            .and_then(|mut p| p.remove(&self.id));
        if was.is_some() && !self.answered {
            let note = json!({
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": self.id, "reason": "the call was decided or ended before an answer came"},
            });
            self.asker.write(&note);
        }
    }
}

impl Asker {
    pub fn new(can: ClientCan) -> Self {
        Self {
            can,
            ..Self::default()
        }
    }

    /// Where requests to the client go (the session's stdout queue).
    pub fn set_out(&self, out: &mpsc::Sender<Vec<u8>>) {
        if let Ok(mut o) = self.out.lock() {
            *o = Some(out.downgrade());
        }
    }

    fn write(&self, message: &Value) -> bool {
        let out = self.out.lock().ok().and_then(|o| o.clone());
        let Some(out) = out.and_then(|o| o.upgrade()) else {
            return false;
        };
        let mut bytes = message.to_string().into_bytes();
        bytes.push(b'\n');
        out.try_send(bytes).is_ok()
    }

    /// A response from the client: handed to the question it answers. `false` when no
    /// question waits for its id (never asked, or already answered).
    pub fn response(&self, message: Value) -> bool {
        let Some(id) = message.get("id").and_then(Value::as_str) else {
            return false;
        };
        if !id.starts_with(ID_PREFIX) {
            return false;
        }
        let tx = self.pending.lock().ok().and_then(|mut p| p.remove(id));
        match tx {
            Some(tx) => tx.send(message).is_ok(),
            None => false,
        }
    }

    /// Asks the person about a held call; resolves with their answer, or why the client cannot
    /// be asked. `current`: the call came in the 2026-07-28 revision, which has no
    /// server-to-client requests.
    pub async fn ask(
        &self,
        question: &Question,
        current: bool,
    ) -> (PrincipalAnswer, Option<String>) {
        if current {
            return (
                PrincipalAnswer::Unable,
                Some("the client speaks MCP 2026-07-28, in which this shim does not ask yet (no input_required rounds)".into()),
            );
        }
        if !self.can.form() {
            return (
                PrincipalAnswer::Unable,
                Some(
                    "the MCP client did not declare the elicitation capability (form mode)".into(),
                ),
            );
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("{ID_PREFIX}{n}");
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = self.pending.lock() {
            p.insert(id.clone(), tx);
        }
        let mut outstanding = Outstanding {
            asker: self,
            id: id.clone(),
            answered: false,
        };
        let request = json!({
            "jsonrpc": "2.0",
            "id": id,
            "method": "elicitation/create",
            "params": {
                "message": question.message,
                "requestedSchema": schema(),
            },
        });
        if !self.write(&request) {
            return (
                PrincipalAnswer::Unable,
                Some("the question could not be written to the MCP client".into()),
            );
        }
        tracing::info!(tool = %question.tool, request = %id, "asking the person through the MCP client (elicitation/create)");
        let Ok(reply) = rx.await else {
            return (PrincipalAnswer::Cancel, Some("no answer".into()));
        };
        outstanding.answered = true;
        drop(outstanding);
        read_answer(&reply)
    }
}

/// The person's answer in an `elicitation/create` response.
fn read_answer(reply: &Value) -> (PrincipalAnswer, Option<String>) {
    if let Some(e) = reply.get("error") {
        let mut why = format!(
            "the MCP client answered elicitation/create with error {}",
            e.get("code").map(Value::to_string).unwrap_or_default()
        );
        if let Some(m) = e.get("message").and_then(Value::as_str) {
            why.push_str(": ");
            why.push_str(m);
        }
        sharedos_proto::name::clip(&mut why, 300);
        return (PrincipalAnswer::Unable, Some(why));
    }
    let result = reply.get("result");
    match result.and_then(|r| r.get("action")).and_then(Value::as_str) {
        Some("accept") => {
            let decision = result
                .and_then(|r| r.get("content"))
                .and_then(|c| c.get("decision"))
                .and_then(Value::as_str);
            if decision == Some("approve") {
                (PrincipalAnswer::Approve, None)
            } else {
                (PrincipalAnswer::Deny, Some("the person chose deny".into()))
            }
        }
        Some("decline") => (PrincipalAnswer::Decline, Some("the person declined".into())),
        _ => (
            PrincipalAnswer::Cancel,
            Some("the person dismissed the question".into()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_accept_with_approve_approves() {
        let r = |v: Value| read_answer(&json!({"jsonrpc": "2.0", "id": "x", "result": v})).0;
        assert_eq!(
            r(json!({"action": "accept", "content": {"decision": "approve"}})),
            PrincipalAnswer::Approve
        );
        assert_eq!(
            r(json!({"action": "accept", "content": {"decision": "deny"}})),
            PrincipalAnswer::Deny
        );
        assert_eq!(r(json!({"action": "accept"})), PrincipalAnswer::Deny);
        assert_eq!(r(json!({"action": "decline"})), PrincipalAnswer::Decline);
        assert_eq!(r(json!({"action": "cancel"})), PrincipalAnswer::Cancel);
        assert_eq!(r(json!({"action": "approve"})), PrincipalAnswer::Cancel);
        let e = read_answer(
            &json!({"jsonrpc": "2.0", "id": "x", "error": {"code": -32601, "message": "no"}}),
        );
        assert_eq!(e.0, PrincipalAnswer::Unable);
    }

    #[test]
    fn capability_forms() {
        let can = ClientCan::default();
        for (caps, form) in [
            (json!({}), false),
            (json!({"elicitation": {}}), true),
            (json!({"elicitation": {"form": {}}}), true),
            (json!({"elicitation": {"url": {}}}), false),
            (json!({"elicitation": {"url": {}, "form": {}}}), true),
        ] {
            can.settle(&caps);
            assert_eq!(can.form(), form, "{caps}");
        }
    }
}
