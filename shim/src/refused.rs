//! What the harness hears when the shim refused the listener at its socket path: every request
//! it sends (`initialize`, `tools/list`, ...) is answered with a JSON-RPC error that says why, for
//! [`ANSWER_WINDOW`] or until stdin ends, and then the shim exits. A harness that only saw the
//! shim exit would report a server that crashed, not a broker that is not the broker.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt as _;

use crate::guard;
use crate::stdio::{Lines, Read};

/// How long a refused shim keeps answering its harness before it exits.
pub const ANSWER_WINDOW: Duration = Duration::from_secs(10);

/// The JSON-RPC error code of the refusal (in the range JSON-RPC leaves to servers).
pub const UNTRUSTED_BROKER: i64 = -32001;

/// The error response to a request with id `id`.
pub fn response(id: Value, why: &str) -> Value {
    let mut e = guard::error(id, UNTRUSTED_BROKER, format!("sharedos-mcp-shim: {why}"));
    e["error"]["data"] = json!({"sharedos": {"code": "untrusted_broker"}});
    e
}

/// The id of a request line (a JSON object with a `method` and a string or integer `id`);
/// `None` for a notification, a response or anything that is not JSON.
fn request_id(line: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(line).ok()?;
    v.get("method")?;
    let id = v.get("id")?;
    (id.is_string() || id.is_i64() || id.is_u64()).then(|| id.clone())
}

/// Answers every request on stdin with the refusal, until stdin ends or [`ANSWER_WINDOW`].
pub async fn answer(why: &str) {
    let _ = tokio::time::timeout(ANSWER_WINDOW, answer_all(why)).await;
}

async fn answer_all(why: &str) {
    let mut lines = Lines::new(tokio::io::stdin());
    let mut out = tokio::io::stdout();
    while let Ok(Some(read)) = lines.next().await {
        let Read::Line = read else { continue };
        let Some(id) = request_id(lines.line()) else {
            continue;
        };
        let Ok(mut bytes) = serde_json::to_vec(&response(id, why)) else {
            continue;
        };
        bytes.push(b'\n');
        if out.write_all(&bytes).await.is_err() || out.flush().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_answered_and_nothing_else() {
        assert_eq!(
            request_id(br#"{"jsonrpc":"2.0","id":1,"method":"initialize"}"#),
            Some(json!(1))
        );
        assert_eq!(
            request_id(br#"{"jsonrpc":"2.0","id":"a","method":"tools/list"}"#),
            Some(json!("a"))
        );
        assert_eq!(
            request_id(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            None
        );
        assert_eq!(request_id(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#), None);
        assert_eq!(request_id(b"not json"), None);
        let r = response(json!(7), "refusing the process");
        assert_eq!(r["id"], 7);
        assert_eq!(r["error"]["code"], UNTRUSTED_BROKER);
        assert_eq!(
            r["error"]["message"],
            "sharedos-mcp-shim: refusing the process"
        );
        assert_eq!(r["error"]["data"]["sharedos"]["code"], "untrusted_broker");
    }
}
