//! The most naive brokered upstream there is: an MCP server on stdio with one tool, `read_file`,
//! that does a plain `open(path)` of whatever path it is sent, links, `..` and all.
//! Newline-delimited JSON-RPC by hand, so nothing in it resolves paths on its own.
#![allow(
    clippy::expect_used,
    reason = "a test helper: failing loudly is the point"
)]

use std::io::{BufRead, Write};

use serde_json::{Value, json};

fn main() {
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
        let result = match msg["method"].as_str().unwrap_or_default() {
            "initialize" => json!({
                "protocolVersion": msg["params"]["protocolVersion"].as_str().unwrap_or("2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "open-upstream", "version": "1"}
            }),
            "tools/list" => json!({"tools": [{
                "name": "read_file",
                "description": "open(path) and return its text",
                "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}},
                                "required": ["path"]}
            }]}),
            "tools/call" => {
                let path = msg["params"]["arguments"]["path"]
                    .as_str()
                    .unwrap_or_default();
                match std::fs::read_to_string(path) {
                    Ok(text) => json!({"content": [{"type": "text", "text": text}]}),
                    Err(e) => json!({"content": [{"type": "text", "text": format!("{path}: {e}")}],
                                     "isError": true}),
                }
            }
            "ping" => json!({}),
            other => {
                let reply = json!({"jsonrpc": "2.0", "id": id,
                    "error": {"code": -32601, "message": format!("no method {other}")}});
                writeln!(out, "{reply}").expect("stdout");
                out.flush().expect("stdout");
                continue;
            }
        };
        writeln!(
            out,
            "{}",
            json!({"jsonrpc": "2.0", "id": id, "result": result})
        )
        .expect("stdout");
        out.flush().expect("stdout");
    }
}
