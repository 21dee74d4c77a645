//! An upstream whose tool list is the test's to shape: an MCP server on stdio (newline-delimited
//! JSON-RPC by hand), with
//! - `listing-upstream --duplicate`: `echo`, and `dup` listed twice with different schemas;
//! - `listing-upstream`: `echo` and `change`; a call of `change` answers, then switches to a second
//!   list (`echo` described otherwise, `change`, and `added`) and sends
//!   `notifications/tools/list_changed`, as an upstream that changes its tools at run time would.
#![allow(
    clippy::expect_used,
    reason = "a test helper: failing loudly is the point"
)]

use std::io::{BufRead, Write};

use serde_json::{Value, json};

fn object(properties: Value) -> Value {
    json!({"type": "object", "properties": properties})
}

fn tools(duplicate: bool, changed: bool) -> Value {
    let echo = |description: &str| {
        json!({"name": "echo", "description": description,
               "inputSchema": object(json!({"message": {"type": "string"}}))})
    };
    let list = if duplicate {
        vec![
            echo("say it back"),
            json!({"name": "dup", "description": "the first copy",
                   "inputSchema": object(json!({"a": {"type": "string"}}))}),
            json!({"name": "dup", "description": "the second copy",
                   "inputSchema": object(json!({"b": {"type": "number"}}))}),
        ]
    } else if changed {
        vec![
            echo("say it back, changed"),
            json!({"name": "change", "description": "change the tool list",
                   "inputSchema": object(json!({}))}),
            json!({"name": "added", "description": "a tool of the changed list",
                   "inputSchema": object(json!({}))}),
        ]
    } else {
        vec![
            echo("say it back"),
            json!({"name": "change", "description": "change the tool list",
                   "inputSchema": object(json!({}))}),
        ]
    };
    json!({ "tools": list })
}

fn send(out: &mut impl Write, v: &Value) {
    writeln!(out, "{v}").expect("stdout");
    out.flush().expect("stdout");
}

fn main() {
    let duplicate = std::env::args().any(|a| a == "--duplicate");
    let mut changed = false;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let Some(id) = msg.get("id").cloned() else {
            continue; // a notification
        };
        let mut announce = false;
        let result = match msg["method"].as_str().unwrap_or_default() {
            "initialize" => json!({
                "protocolVersion": msg["params"]["protocolVersion"].as_str().unwrap_or("2025-06-18"),
                "capabilities": {"tools": {"listChanged": true}},
                "serverInfo": {"name": "listing-upstream", "version": "1"}
            }),
            "tools/list" => tools(duplicate, changed),
            "tools/call" => match msg["params"]["name"].as_str().unwrap_or_default() {
                "echo" => {
                    let m = msg["params"]["arguments"]["message"]
                        .as_str()
                        .unwrap_or_default();
                    json!({"content": [{"type": "text", "text": format!("echo: {m}")}]})
                }
                "change" => {
                    announce = !changed;
                    changed = true;
                    json!({"content": [{"type": "text", "text": "changed"}]})
                }
                "added" => json!({"content": [{"type": "text", "text": "added"}]}),
                other => json!({"content": [{"type": "text", "text": format!("no tool {other}")}],
                                "isError": true}),
            },
            "ping" => json!({}),
            other => {
                send(
                    &mut out,
                    &json!({"jsonrpc": "2.0", "id": id,
                        "error": {"code": -32601, "message": format!("no method {other}")}}),
                );
                continue;
            }
        };
        send(
            &mut out,
            &json!({"jsonrpc": "2.0", "id": id, "result": result}),
        );
        if announce {
            send(
                &mut out,
                &json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}),
            );
        }
    }
}
