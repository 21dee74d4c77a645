//! Remote MCP servers (Streamable HTTP) behind the kernel (issue 34): the PyPI `mcp` SDK's
//! `MCPServer` (tests/python/remote_server.py, not our protocol code) started on 127.0.0.1 by
//! each test. A remote tool goes through the same catalogue, templates, policy, time limits,
//! cancellation and record as a spawned one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use sharedos_proto::ipc::{ControlRequest, ControlResponse};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::kit::{Options, Raw, TestBroker, eventually, meta, text};

fn python() -> Option<String> {
    match std::env::var("SHAREDOS_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must set SHAREDOS_PYTHON (see .ci/run)"
            );
            eprintln!(
                "SKIPPED: SHAREDOS_PYTHON is not set (run .ci/run to install PyPI mcp 2.3.0)"
            );
            None
        }
    }
}

fn q(s: &str) -> String {
    serde_json::to_string(s).expect("quote")
}

/// A running `remote_server.py`: its port and the log of what it did.
pub struct Server {
    _child: tokio::process::Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Server {
    pub async fn start(python: &str, log: &Path, args: &[String]) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/remote_server.py");
        let mut child = tokio::process::Command::new(python)
            .arg(script)
            .args(args)
            .env("REMOTE_LOG", log)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python server");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("server says its port in time")
            .expect("read")
            .expect("a line");
        let port = first
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("not a port line: {first}"));
        Self {
            _child: child,
            port,
            log: log.to_path_buf(),
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Lines of the server's log that start with `prefix`.
    pub fn lines(&self, prefix: &str) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(prefix))
            .map(str::to_owned)
            .collect()
    }
}

pub const POLICY: &str = r#"
@id("alice-remote")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "r.*" };

@id("alice-notes")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"write", resource is SharedOS::File)
when { resource.path like "/public/*" };
"#;

/// A `[[providers]]` entry for the remote server at `url`, `more` appended.
pub fn provider(url: &str, more: &str) -> String {
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = {}\ncall_timeout_seconds = 3\nstartup_timeout_seconds = 10\n{more}\n[providers.tools.add_note]\naction = \"write\"\nfile = \"{{path}}\"\n",
        q(url)
    )
}

pub async fn broker_with(extra: &str) -> TestBroker {
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(&b.config_path, format!("{cfg}{extra}")).expect("w");
    b.restart().await;
    b
}

pub async fn providers(b: &TestBroker) -> Vec<Value> {
    match b
        .host()
        .await
        .call(&ControlRequest::Providers)
        .await
        .expect("providers")
    {
        ControlResponse::Providers { providers } => providers,
        other => panic!("{other:?}"),
    }
}

pub fn remote_of(list: &[Value]) -> Value {
    list.iter()
        .find(|p| p["namespace"] == "r")
        .cloned()
        .unwrap_or_default()
}

async fn call(raw: &mut Raw, id: i64, tool: &str, args: Value) -> Value {
    raw.call(id, tool, args).await["result"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn python_streamable_http_server_behind_the_kernel() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let broker = broker_with(&provider(&server.url(), "")).await;
    let turn = broker.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    for n in ["r.echo", "r.add_note", "r.slow", "r.huge"] {
        assert!(names.contains(&n.to_owned()), "{n} in {names:?}");
    }
    let source = turn
        .tools
        .iter()
        .find(|t| t.name.as_str() == "r.echo")
        .and_then(|t| t.metadata.clone())
        .and_then(|m| m.source);
    assert_eq!(source.as_deref(), Some("mcp:r"));

    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    // Allowed.
    let r = call(&mut raw, 1, "r.echo", json!({"text": "hi"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "echo: hi");
    // A template on the arguments: /public/* may be written, /private/* not; the denied call
    // never reaches the server.
    let r = call(
        &mut raw,
        2,
        "r.add_note",
        json!({"path": "/public/n1", "text": "one"}),
    )
    .await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    let r = call(
        &mut raw,
        3,
        "r.add_note",
        json!({"path": "/private/n2", "text": "two"}),
    )
    .await;
    assert_eq!(meta(&r)["outcome"], "denied", "{r}");
    assert_eq!(meta(&r)["code"], "no_permit", "{r}");
    assert_eq!(
        server.lines("effect"),
        ["effect add_note /public/n1 one"],
        "one effect: the denied call was not sent"
    );

    // Cancelled by the client: the server sees the cancel.
    raw.send(json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
        "params": {"name": "r.slow", "arguments": {"seconds": 20}}}))
        .await;
    eventually("the slow call reaches the server", || {
        server.lines("start slow").len() == 1
    })
    .await;
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 4}}),
    )
    .await;
    eventually("the server sees the cancel", || {
        server.lines("cancelled slow").len() == 1
    })
    .await;
    // Timed out (the provider's 3 s): the call fails `timeout`, and the server sees the cancel.
    let started = std::time::Instant::now();
    let r = call(&mut raw, 5, "r.slow", json!({"seconds": 20})).await;
    let took = started.elapsed();
    assert_eq!(meta(&r)["code"], "timeout", "{r}");
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(10),
        "{took:?}"
    );
    eventually("the server sees the timeout's cancel", || {
        server.lines("cancelled slow").len() == 2
    })
    .await;
    assert!(server.lines("done slow").is_empty());
    let r = call(&mut raw, 6, "r.echo", json!({"text": "after"})).await;
    assert_eq!(text(&r), "echo: after");

    // Recorded like a stdio call: each call, with its outcome and code.
    let t = turn.turn.clone();
    eventually("the cancelled call is recorded", || {
        broker
            .calls_of(&t)
            .iter()
            .any(|c| c["outcome"] == "cancelled")
    })
    .await;
    let calls = broker.calls_of(&turn.turn);
    let outcomes: Vec<String> = calls
        .iter()
        .map(|c| {
            format!(
                "{} {}",
                c["tool"].as_str().unwrap_or(""),
                c["outcome"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(calls.len(), 6, "{outcomes:?}");
    for want in [
        "r.echo succeeded",
        "r.add_note succeeded",
        "r.add_note denied",
        "r.slow cancelled",
        "r.slow failed",
    ] {
        assert!(
            outcomes.contains(&want.to_owned()),
            "{want} in {outcomes:?}"
        );
    }
    let lines = broker.records();
    assert!(
        lines.iter().any(|l| {
            l["kind"] == "provider_state"
                && l["provider"] == "r"
                && l["reason"].as_str().is_some_and(|r| {
                    r.contains("connecting to") && r.contains("insecure_http: false")
                })
        }),
        "the transport is recorded on provider_state"
    );

    // `providers` shows the URL, TLS state, session and latency.
    let p = remote_of(&providers(&broker).await);
    assert_eq!(p["state"], "ready", "{p}");
    assert_eq!(p["url"], server.url(), "{p}");
    assert_eq!(p["tls"], "none (plain HTTP to loopback)", "{p}");
    assert_eq!(p["insecureHttp"], false, "{p}");
    assert_eq!(p["session"], "open", "{p}");
    assert_eq!(p["sessions"], 1, "{p}");
    assert!(p["lastLatencyMs"].as_f64().is_some_and(|l| l > 0.0), "{p}");
}
