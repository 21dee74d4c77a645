//! OpenTelemetry export against real OTLP receivers started here on loopback ports.
//!
//! Spans: Arize Phoenix (PyPI `arize-phoenix`, installed by `.ci/install-phoenix`), its spans
//! read back from its REST API. Then the backend is killed: every call is still answered and
//! recorded, and the dropped-span count rises.
//!
//! Metrics: Phoenix keeps traces only, so they go to OtelTap (PyPI `oteltap`, installed by
//! `.ci/install-oteltap`), a receiver for OTLP/HTTP-protobuf traces, logs and metrics whose CLI
//! prints each item it decoded as one JSON line.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::kit::{Options, Raw, TestBroker, bin, installed, meta, run};

/// Alice reads /public; /private/ask.txt only with a person's approval; the rest of /private
/// is denied.
const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-ask")
@approval("required")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path == "/private/ask.txt" };
"#;

/// A free loopback port (bound, read, released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// `GET path` over HTTP/1.0 (so the body ends with the connection): (status, body).
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

pub(crate) struct Phoenix {
    pub(crate) child: tokio::process::Child,
    pub(crate) port: u16,
    _dir: tempfile::TempDir,
}

impl Phoenix {
    pub(crate) async fn start(script: &Path) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let port = free_port();
        let child = Command::new(script)
            .arg("serve")
            .env("PHOENIX_HOST", "127.0.0.1")
            .env("PHOENIX_PORT", port.to_string())
            .env("PHOENIX_GRPC_PORT", free_port().to_string())
            .env("PHOENIX_WORKING_DIR", dir.path())
            .env("PHOENIX_TELEMETRY_ENABLED", "false")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("phoenix.log")).expect("log"))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn phoenix");
        let p = Self {
            child,
            port,
            _dir: dir,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            if let Some((200, _)) = get(port, "/healthz").await {
                return p;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "phoenix did not come up within 180 s: {}",
                std::fs::read_to_string(p._dir.path().join("phoenix.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every span of the default project.
    pub(crate) async fn spans(&self) -> Vec<Value> {
        let mut all = vec![];
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(c) => format!("/v1/projects/default/spans?limit=100&cursor={c}"),
                None => "/v1/projects/default/spans?limit=100".to_owned(),
            };
            let Some((200, body)) = get(self.port, &path).await else {
                return all;
            };
            let v: Value = serde_json::from_str(&body).expect("spans JSON");
            all.extend(v["data"].as_array().cloned().unwrap_or_default());
            match v["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_owned()),
                None => return all,
            }
        }
    }
}

/// A W3C traceparent for the n-th call: trace `..0n`, parent span `..0n`.
fn parent(n: u8) -> (String, String, String) {
    let trace = format!("4bf92f3577b34da6a3ce929d0e0e47{n:02x}");
    let span = format!("00f067aa0ba902{n:02x}");
    (format!("00-{trace}-{span}-01"), trace, span)
}

async fn stats(broker: &TestBroker) -> Value {
    let mut cmd = broker.cli();
    cmd.args(["telemetry", "--json"]);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "telemetry --json: {err}");
    serde_json::from_str(&out).expect("telemetry JSON")
}

#[tokio::test]
#[ignore = "needs Arize Phoenix from .ci/install-phoenix: bash .ci/run installs it and runs this"]
async fn spans_reach_a_real_backend_and_a_dead_one_costs_no_call() {
    let Some(env) = installed("phoenix", ".ci/install-phoenix") else {
        return;
    };
    let mut phoenix = Phoenix::start(Path::new(&env["PHOENIX"])).await;
    let broker = TestBroker::start(Options {
        policy: POLICY,
        // Slow enough that a call can be cancelled while it runs.
        latency_ms: Some(400),
        tables: format!(
            "[otel]\nendpoint = \"http://127.0.0.1:{}\"\nmetrics = false\ntimeout_seconds = 2\n",
            phoenix.port
        ),
        ..Options::default()
    })
    .await;
    let s = stats(&broker).await;
    assert_eq!(s["enabled"], true, "{s}");
    std::fs::write(
        broker.dir.path().join("data/private/ask.txt"),
        "ask first\n",
    )
    .expect("w");
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;

    // Allowed, denied, failed: each answered; each carries its own client trace context.
    let calls = [
        (1, json!({"path": "/public/hello.txt"}), "succeeded", "ok"),
        (
            2,
            json!({"path": "/private/secret.txt"}),
            "denied",
            "no_permit",
        ),
        (
            3,
            json!({"path": "/public/missing.txt"}),
            "failed",
            "not_found",
        ),
    ];
    for (id, args, outcome, code) in &calls {
        let (tp, _, _) = parent(*id as u8);
        raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "files.read", "arguments": args,
                       "_meta": {"traceparent": tp, "tracestate": "vendor=x"}}}))
            .await;
        let r = raw.response(*id).await;
        assert_eq!(meta(&r["result"])["outcome"], *outcome, "{r}");
        assert_eq!(meta(&r["result"])["code"], *code, "{r}");
    }
    // Cancelled while it runs: no answer, one `cancelled` line.
    let (tp, _, _) = parent(4);
    raw.send(json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
        "params": {"name": "files.read", "arguments": {"path": "/public/hello.txt"},
                   "_meta": {"traceparent": tp}}}))
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 4, "reason": "test"}}),
    )
    .await;
    crate::kit::eventually("the cancelled call's line", || {
        broker.calls_of(&alice.turn).len() == 4
    })
    .await;
    // Held for a person, approved from another process, then run.
    let (tp, _, _) = parent(5);
    raw.send(json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "files.read", "arguments": {"path": "/private/ask.txt"},
                   "_meta": {"traceparent": tp}}}))
        .await;
    let approval = crate::approvals::wait_pending(&broker, 1).await[0]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let mut approve = broker.cli();
    approve.args(["approvals", "approve", &approval]);
    let (code, _, err) = run(approve).await;
    assert_eq!(code, 0, "{err}");
    let r = raw.response(5).await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    let outcomes: Vec<Value> = broker
        .calls_of(&alice.turn)
        .iter()
        .map(|c| c["outcome"].clone())
        .collect();
    assert_eq!(
        outcomes,
        vec![
            json!("succeeded"),
            json!("denied"),
            json!("failed"),
            json!("cancelled"),
            json!("succeeded")
        ]
    );

    // The four spans arrive, with the conventions' attributes, the decision and their parents.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let spans = loop {
        let spans = phoenix.spans().await;
        if spans.len() >= 5 {
            break spans;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} spans reached phoenix: {spans:?}",
            spans.len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(spans.len(), 5, "{spans:#?}");
    let record = broker.calls_of(&alice.turn);
    for (n, (outcome, code, error_type)) in [
        ("succeeded", "ok", None),
        ("denied", "no_permit", Some("tool_error")),
        ("failed", "not_found", Some("tool_error")),
        ("cancelled", "client_cancelled", Some("cancelled")),
        ("succeeded", "ok", None),
    ]
    .into_iter()
    .enumerate()
    {
        let (_, trace, parent_span) = parent(n as u8 + 1);
        let line = &record[n];
        let span = spans
            .iter()
            .find(|s| s["attributes"]["sharedos.call_id"] == line["callId"])
            .unwrap_or_else(|| panic!("no span for {line}: {spans:#?}"));
        let a = &span["attributes"];
        assert_eq!(span["name"], "tools/call files.read", "{span}");
        // Phoenix shows its own OpenInference kind here (TOOL, from gen_ai.operation.name), not
        // the OTLP span kind.
        assert_eq!(span["span_kind"], "TOOL", "{span}");
        assert_eq!(span["context"]["trace_id"], trace, "{span}");
        assert_eq!(span["parent_id"], parent_span, "{span}");
        assert_eq!(a["mcp.method.name"], "tools/call", "{span}");
        assert_eq!(a["gen_ai.tool.name"], "files.read", "{span}");
        assert_eq!(a["gen_ai.operation.name"], "execute_tool", "{span}");
        assert_eq!(a["network.transport"], "pipe", "{span}");
        assert_eq!(a["jsonrpc.request.id"], (n + 1).to_string(), "{span}");
        assert_eq!(a["sharedos.outcome"], outcome, "{span}");
        assert_eq!(a["sharedos.code"], line["code"], "{span}");
        if outcome != "cancelled" {
            assert_eq!(a["sharedos.code"], code, "{span}");
        }
        assert_eq!(a["sharedos.turn"], alice.turn, "{span}");
        assert_eq!(a["sharedos.principal"], "alice", "{span}");
        assert_eq!(a["sharedos.policies"], line["policies"], "{span}");
        if n == 4 {
            assert_eq!(a["sharedos.approval.id"], approval.as_str(), "{span}");
            assert_eq!(a["sharedos.approval.decision"], "approved", "{span}");
        } else {
            assert!(a.get("sharedos.approval.id").is_none(), "{span}");
        }
        match error_type {
            Some(e) => {
                assert_eq!(a["error.type"], e, "{span}");
                assert_eq!(span["status_code"], "ERROR", "{span}");
            }
            None => {
                assert!(a.get("error.type").is_none(), "{span}");
                assert_ne!(span["status_code"], "ERROR", "{span}");
            }
        }
    }
    let s = stats(&broker).await;
    assert_eq!(
        (s["queued"].as_u64(), s["exported"].as_u64()),
        (Some(5), Some(5)),
        "{s}"
    );

    // The backend goes away: every call is still answered and recorded; the spans are dropped
    // and counted.
    phoenix.child.kill().await.expect("kill phoenix");
    for id in 10..15 {
        let r = raw
            .call(id, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    }
    assert_eq!(broker.calls_of(&alice.turn).len(), 10);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let s = loop {
        let s = stats(&broker).await;
        if s["droppedExportFailed"].as_u64() == Some(5) {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "drops not counted: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (
            s["queued"].as_u64(),
            s["exported"].as_u64(),
            s["droppedQueueFull"].as_u64()
        ),
        (Some(10), Some(5), Some(0)),
        "{s}"
    );
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
}

/// OtelTap's CLI (PyPI `oteltap`, installed by `.ci/install-oteltap`): a real OTLP/HTTP-protobuf
/// receiver that prints every span, log record and metric it receives as one JSON line.
struct OtelTap {
    child: tokio::process::Child,
    port: u16,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl OtelTap {
    async fn start(script: &Path) -> Self {
        use tokio::io::AsyncBufReadExt;
        let port = free_port();
        let mut child = Command::new(script)
            .args(["--port", &port.to_string()])
            .env("PYTHONUNBUFFERED", "1")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn oteltap");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut out = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let sink = lines.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                sink.lock().expect("lines").push(line);
            }
        });
        let tap = Self { child, port, lines };
        crate::kit::eventually("oteltap listening", || {
            tap.lines
                .lock()
                .expect("lines")
                .iter()
                .any(|l| l.starts_with("Listening"))
        })
        .await;
        tap
    }

    /// The newest export of metric `name` that satisfies `wanted`, waiting up to 30 s for one.
    async fn last_with(&self, name: &str, wanted: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let found = self
                .lines
                .lock()
                .expect("lines")
                .iter()
                .rev()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|m| m["name"] == name && wanted(m));
            if let Some(m) = found {
                return m;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {name} export as wanted within 30 s; received:\n{}",
                self.lines.lock().expect("lines").join("\n")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[tokio::test]
#[ignore = "needs OtelTap from .ci/install-oteltap: bash .ci/run installs it and runs this"]
async fn metrics_reach_a_real_receiver() {
    let Some(env) = installed("oteltap", ".ci/install-oteltap") else {
        return;
    };
    let mut tap = OtelTap::start(Path::new(&env["OTELTAP"])).await;
    let broker = TestBroker::start(Options {
        policy: POLICY,
        tables: format!(
            "[otel]\nendpoint = \"http://127.0.0.1:{}\"\nmetrics_interval_seconds = 1\ntimeout_seconds = 2\n",
            tap.port
        ),
        ..Options::default()
    })
    .await;
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    for (id, tool, args) in [
        (1, "files.read", json!({"path": "/public/hello.txt"})),
        (2, "files.read", json!({"path": "/public/hello.txt"})),
        (3, "files.read", json!({"path": "/private/secret.txt"})),
        (4, "files.read", json!({"path": "/public/missing.txt"})),
    ] {
        raw.call(id, tool, args).await;
    }
    // A hostile client invents names: 50 unpublished, 50 malformed. Each is recorded; together
    // they add two series, not a hundred.
    for i in 0..50 {
        raw.call(100 + i, &format!("x.invented_{i}"), json!({}))
            .await;
        raw.call(200 + i, &format!("bad name {i}"), json!({})).await;
    }
    assert_eq!(broker.calls_of(&alice.turn).len(), 104);

    // The receiver's view once an export has seen every call (cumulative counters).
    let calls = tap
        .last_with("sharedos.tool.calls", |m| total(m) == 104)
        .await;
    let mut series = std::collections::BTreeMap::new();
    for p in points(&calls, "sum") {
        let a = attrs(&p);
        let key = (
            a["gen_ai.tool.name"].clone(),
            a["sharedos.outcome"].clone(),
            a["sharedos.code"].clone(),
        );
        series.insert(key, int(&p["asInt"]));
    }
    let s = |t: &str, o: &str, c: &str| (t.to_owned(), o.to_owned(), c.to_owned());
    assert_eq!(
        series,
        std::collections::BTreeMap::from([
            (s("files.read", "succeeded", "ok"), 2),
            (s("files.read", "denied", "no_permit"), 1),
            (s("files.read", "failed", "not_found"), 1),
            (s("(unpublished)", "denied", "unpublished_tool"), 50),
            (s("(unpublished)", "denied", "malformed_tool_name"), 50),
        ]),
        "{calls}"
    );
    assert_eq!(calls["sum"]["isMonotonic"], true, "{calls}");

    // The duration histogram: one point per tool and outcome, in seconds, with the MCP
    // conventions' bucket boundaries, `error.type` on refusals and failures.
    let duration = tap
        .last_with("mcp.server.operation.duration", |m| total(m) == 104)
        .await;
    assert_eq!(duration["unit"], "s", "{duration}");
    let mut counts = std::collections::BTreeMap::new();
    for p in points(&duration, "histogram") {
        let a = attrs(&p);
        assert_eq!(a["mcp.method.name"], "tools/call", "{p}");
        assert_eq!(
            a.get("error.type").map(String::as_str),
            (a["sharedos.outcome"] != "succeeded").then_some("tool_error"),
            "{p}"
        );
        assert_eq!(
            p["explicitBounds"],
            json!([
                0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0
            ]),
            "{p}"
        );
        let sum = p["sum"].as_f64().expect("sum");
        assert!(sum > 0.0 && sum < 60.0, "seconds, not ms or ns: {p}");
        counts.insert(
            (a["gen_ai.tool.name"].clone(), a["sharedos.outcome"].clone()),
            int(&p["count"]),
        );
    }
    let o = |t: &str, o: &str| (t.to_owned(), o.to_owned());
    assert_eq!(
        counts,
        std::collections::BTreeMap::from([
            (o("files.read", "succeeded"), 2),
            (o("files.read", "denied"), 1),
            (o("files.read", "failed"), 1),
            (o("(unpublished)", "denied"), 100),
        ]),
        "{duration}"
    );

    // Turns open: 1 now, 0 once the turn is closed.
    let open = tap.last_with("sharedos.turns.open", |_| true).await;
    assert_eq!(int(&points(&open, "gauge")[0]["asInt"]), 1, "{open}");
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    let seen = tap.lines.lock().expect("lines").len();
    let open = tap
        .last_with("sharedos.turns.open", |m| {
            int(&points(m, "gauge")[0]["asInt"]) == 0
        })
        .await;
    assert!(tap.lines.lock().expect("lines").len() > seen, "{open}");
    let s = stats(&broker).await;
    assert_eq!(s["droppedExportFailed"].as_u64(), Some(0), "{s}");

    // The receiver goes away: metric exports fail (every second), and still every call of a new
    // turn is answered and recorded, and the broker's CLI answers.
    tap.child.kill().await.expect("kill oteltap");
    let second = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(second.token.expose()));
    raw.initialize("2025-06-18").await;
    for id in 1..=20 {
        let r = raw
            .call(id, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
        if id == 10 {
            // Across at least one failed metric export.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
    }
    assert_eq!(broker.calls_of(&second.turn).len(), 20);
    let s = stats(&broker).await;
    assert_eq!(s["enabled"], true, "{s}");
    drop(raw.close_stdin().await);
    broker.close_turn(&second.turn).await;
}

/// A metric's data points (`kind`: `sum`, `gauge` or `histogram`).
fn points(metric: &Value, kind: &str) -> Vec<Value> {
    metric[kind]["dataPoints"]
        .as_array()
        .unwrap_or_else(|| panic!("no {kind} points: {metric}"))
        .clone()
}

/// A data point's attributes, as strings.
fn attrs(point: &Value) -> std::collections::BTreeMap<String, String> {
    point["attributes"]
        .as_array()
        .expect("attributes")
        .iter()
        .map(|kv| {
            let v = kv["value"]["stringValue"].as_str().expect("a string value");
            (kv["key"].as_str().expect("key").to_owned(), v.to_owned())
        })
        .collect()
}

/// An OTLP 64-bit integer, which protobuf's JSON writes as a string or a number.
fn int(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("not an integer: {v}"))
}

/// Calls counted by a counter (its points' values) or a histogram (its points' counts).
fn total(metric: &Value) -> u64 {
    if metric.get("histogram").is_some() {
        points(metric, "histogram")
            .iter()
            .map(|p| int(&p["count"]))
            .sum()
    } else {
        points(metric, "sum").iter().map(|p| int(&p["asInt"])).sum()
    }
}

/// The broker's resident memory (VmRSS), in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A collector that accepts every connection and reads what it is sent, and never answers:
/// each export waits for its timeout. Its tasks end with the test's runtime.
async fn stalled_collector() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    port
}

/// Issue 31, item 4. A collector that never answers, and 8 bridges of one turn sending permitted
/// calls whose trace context carries a 7 MiB `tracestate` and whose request id is 100,000
/// characters: a span keeps neither whole (the tracestate is past the W3C limits and dropped, the
/// request id is cut when the span is made), the queue is bounded in bytes (`queue_bytes`, here
/// its least), so the broker, a real process, grows by less than 64 MiB over its idle size;
/// every call is answered, and the spans past the queue's bytes are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_collector_and_huge_trace_contexts_cost_bounded_memory() {
    use sharedos_ipc::write_frame;
    use sharedos_proto::Outcome;
    use sharedos_proto::ipc::{BridgeEvent, BridgeRequest};
    /// Calls each bridge sends, and how many it keeps in flight.
    const CALLS: u64 = 16;
    const IN_FLIGHT: u64 = 8;
    const BRIDGES: usize = 8;
    /// The bound on the broker's growth (its peak over its idle size): the 8 bridges may each be
    /// reading one frame of up to 8 MiB (`MAX_FRAME_BYTES`: a frame is read whole), 64 MiB, and
    /// 32 MiB for the rest. Without the span bounds, 128 spans of 7 MiB: 900 MiB.
    const BOUND_MIB: u64 = 96;
    let port = stalled_collector().await;
    let b = crate::races::Served::start_with(
        &[],
        &format!(
            "call_timeout_seconds = 10\n[otel]\nendpoint = \"http://127.0.0.1:{port}\"\n\
             metrics = false\ntimeout_seconds = 600\nqueue_bytes = 65536\n"
        ),
    )
    .await;
    // Idle: started, one call answered (through a shim) so the first allocations are made.
    let mut warm = b.shim().await;
    let r = warm
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    let pid = b.pid();
    let idle = rss_kib(pid);
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(idle));
    let sampling = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while !sampling.is_cancelled() {
                peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let (_, token) = b.open_turn().await;
    let tracestate = std::sync::Arc::new(format!("vendor={}", "s".repeat(7 << 20)));
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let started = std::time::Instant::now();
    let mut bridges = Vec::new();
    for n in 0..BRIDGES {
        let (mut reader, mut w) = b.raw_bridge(&token).await;
        let tracestate = tracestate.clone();
        bridges.push(tokio::spawn(async move {
            let call = |id: u64| BridgeRequest::Call {
                id,
                call: sharedos_proto::ToolCall {
                    tool: "files.read".into(),
                    arguments: Some(json!({"path": "/public/hello.txt"})),
                    request_id: Some(format!("{n}-{id}-{}", "r".repeat(100_000))),
                    rejected_arguments: None,
                    traceparent: Some(traceparent.into()),
                    tracestate: Some(tracestate.as_str().into()),
                },
            };
            let (mut sent, mut succeeded) = (0, 0);
            while sent < IN_FLIGHT.min(CALLS) {
                write_frame(&mut w, &call(sent)).await.expect("call");
                sent += 1;
            }
            for _ in 0..CALLS {
                match tokio::time::timeout(Duration::from_secs(120), reader.next::<BridgeEvent>())
                    .await
                    .expect("an answer within 120 s")
                    .expect("answer")
                {
                    BridgeEvent::Answer { answer, .. } => {
                        if answer.outcome == Outcome::Succeeded {
                            succeeded += 1;
                        }
                    }
                    other => panic!("{other:?}"),
                }
                if sent < CALLS {
                    write_frame(&mut w, &call(sent)).await.expect("call");
                    sent += 1;
                }
            }
            succeeded
        }));
    }
    let mut succeeded = 0;
    for h in bridges {
        succeeded += h.await.expect("bridge task");
    }
    let took = started.elapsed();
    // Let the broker settle (the export thread is still waiting on the collector).
    tokio::time::sleep(Duration::from_secs(1)).await;
    sampling.cancel();
    sampler.await.expect("sampler");
    let after = rss_kib(pid);
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    let total = BRIDGES as u64 * CALLS;
    assert_eq!(succeeded, total, "every call answered and succeeded");
    // Still serving: a fresh turn's shim, and the warm one.
    b.serves_another_turn().await;
    let r = warm
        .call(2, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["telemetry", "--json", "--runtime-dir"])
        .arg(&b.run_dir);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "telemetry --json: {err}");
    let s: Value = serde_json::from_str(&out).expect("telemetry JSON");
    eprintln!(
        "{total} calls with a 7 MiB tracestate and a 100,000-character request id in {took:?}: \
         broker RSS idle {idle} KiB, peak {peak} KiB (+{} MiB), after {after} KiB; telemetry {s}",
        (peak - idle) / 1024
    );
    let (queued, dropped) = (
        s["queued"].as_u64().expect("queued"),
        s["droppedQueueFull"].as_u64().expect("droppedQueueFull"),
    );
    // Every span is counted: queued, or dropped when the queue's bytes were full (the warm
    // shim's two calls and another turn's one among them).
    assert_eq!(queued + dropped, total + 3, "{s}");
    assert!(dropped > 0, "no span was dropped: {s}");
    assert_eq!(s["exported"].as_u64(), Some(0), "{s}");
    assert!(
        peak - idle < BOUND_MIB * 1024,
        "the broker grew by {} MiB (idle {idle} KiB, peak {peak} KiB)",
        (peak - idle) / 1024
    );

    // The record's lines are whole: every call recorded.
    assert_eq!(
        b.calls().len() as u64,
        total + 3,
        "the warm-up's two calls, another turn's one and the flood's"
    );
}

/// The body of an OtelTap line if it is a log record (OTLP JSON: `body.stringValue`).
fn log_body(line: &Value) -> Option<String> {
    line["body"]["stringValue"]
        .as_str()
        .or_else(|| line["body"].as_str())
        .map(str::to_owned)
}

/// A log record's attribute `key`, as a string (string or integer value).
fn log_attr(line: &Value, key: &str) -> Option<String> {
    line["attributes"].as_array()?.iter().find_map(|kv| {
        (kv["key"] == key).then(|| {
            let v = &kv["value"];
            v["stringValue"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| int(&v["intValue"]).to_string())
        })
    })
}

#[tokio::test]
#[ignore = "needs OtelTap from .ci/install-oteltap: bash .ci/run installs it and runs this"]
async fn record_lines_reach_a_real_receiver_as_logs_once_each() {
    let Some(env) = installed("oteltap", ".ci/install-oteltap") else {
        return;
    };
    let mut tap = OtelTap::start(Path::new(&env["OTELTAP"])).await;
    let mut broker = TestBroker::start(Options {
        policy: POLICY,
        tables: format!(
            "[otel]\nendpoint = \"http://127.0.0.1:{}\"\nmetrics = false\nlogs = true\ntimeout_seconds = 2\n",
            tap.port
        ),
        ..Options::default()
    })
    .await;
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    raw.call(2, "files.read", json!({"path": "/private/secret.txt"}))
        .await;
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    broker.stop().await;
    // Every line from broker_started on (the export starts after the chain's first line).
    let record: Vec<String> = std::fs::read_to_string(broker.record_path())
        .expect("record")
        .lines()
        .skip_while(|l| !l.contains("\"kind\":\"broker_started\""))
        .map(str::to_owned)
        .collect();
    assert!(record.len() >= 8, "{record:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let received = loop {
        let logs: Vec<Value> = tap
            .lines
            .lock()
            .expect("lines")
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| log_body(v).is_some())
            .collect();
        if logs.len() >= record.len() {
            break logs;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {} lines arrived; received:\n{}",
            logs.len(),
            record.len(),
            tap.lines.lock().expect("lines").join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(received.len(), record.len(), "each line once");
    for (line, log) in record.iter().zip(&received) {
        assert_eq!(log_body(log).as_deref(), Some(line.as_str()));
        let v: Value = serde_json::from_str(line).expect("json");
        assert_eq!(
            log_attr(log, "sharedos.kind").as_deref(),
            v["kind"].as_str()
        );
        assert_eq!(
            log_attr(log, "sharedos.seq"),
            Some(v["seq"].as_u64().expect("seq").to_string())
        );
        if v["kind"] == "call" {
            assert_eq!(
                log_attr(log, "sharedos.turn").as_deref(),
                Some(alice.turn.as_str())
            );
            assert_eq!(
                log_attr(log, "sharedos.outcome").as_deref(),
                v["outcome"].as_str()
            );
            assert_eq!(
                log_attr(log, "sharedos.code").as_deref(),
                v["code"].as_str()
            );
            assert_eq!(
                log_attr(log, "sharedos.principal").as_deref(),
                Some("alice")
            );
        }
    }
    assert!(
        received
            .iter()
            .any(|l| log_attr(l, "sharedos.kind").as_deref() == Some("checkpoint")),
        "the shutdown checkpoint is exported"
    );
    // What the collector received is a witness: the record verifies against it, and not
    // once its last line (the shutdown checkpoint) is cut.
    let witness = tempfile::NamedTempFile::new()
        .expect("tmp")
        .into_temp_path();
    std::fs::write(
        &witness,
        received
            .iter()
            .map(|v| v.to_string() + "\n")
            .collect::<String>(),
    )
    .expect("write witness");
    let verify = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.args(["records", "verify", "--record"])
            .arg(broker.record_path())
            .arg("--witness")
            .arg(&witness)
            .args(extra);
        cmd
    };
    let (code, out, err) = run(verify(&[])).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("1 of its 1 checkpoints found"), "{out}");
    let whole = std::fs::read_to_string(broker.record_path()).expect("record");
    let mut lines: Vec<&str> = whole.lines().collect();
    lines.pop();
    std::fs::write(broker.record_path(), lines.join("\n") + "\n").expect("cut");
    let (code, out, _) = run(verify(&[])).await;
    assert_eq!(code, 3, "{out}");
    std::fs::write(broker.record_path(), &whole).expect("restore");
    // The receiver down: calls still answer, and what could not go out is counted.
    tap.child.kill().await.expect("kill oteltap");
    let _ = tap.child.wait().await;
    broker.restart().await;
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    let started = std::time::Instant::now();
    for id in 1..=5 {
        let r = raw
            .call(id, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert!(r["result"].is_object(), "{r}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let mut host = broker.host().await;
    let mut last = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stats = match host
            .call(&sharedos_proto::ipc::ControlRequest::Telemetry)
            .await
            .expect("telemetry")
        {
            sharedos_proto::ipc::ControlResponse::Telemetry(s) => s,
            other => panic!("{other:?}"),
        };
        if stats.logs.dropped_export_failed >= 5 {
            assert!(stats.logs.queued >= 5, "{stats:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{last:?}");
        last = Some(stats);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(raw.close_stdin().await);
}

/// With export on, a brokered call to a remote server carries the broker's own span as the
/// server's parent: the server gets `00-<client's trace>-<broker span>-01`, and the span Phoenix
/// stores for the call has that id, in the client's trace, under the client's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Arize Phoenix and PyPI mcp 2.3.0: bash .ci/run installs them and runs this"]
async fn an_upstream_call_is_a_child_of_the_brokers_span() {
    let Some(env) = installed("phoenix", ".ci/install-phoenix") else {
        return;
    };
    let Some(py) = crate::remote::python() else {
        return;
    };
    let phoenix = Phoenix::start(Path::new(&env["PHOENIX"])).await;
    let dir = tempfile::tempdir().expect("tmp");
    let server = crate::remote::Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let mut broker = TestBroker::start(Options {
        policy: crate::remote::POLICY,
        tables: format!(
            "[otel]\nendpoint = \"http://127.0.0.1:{}\"\nmetrics = false\ntimeout_seconds = 2\n",
            phoenix.port
        ),
        ..Options::default()
    })
    .await;
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!("{cfg}{}", crate::remote::provider(&server.url(), "")),
    )
    .expect("w");
    broker.restart().await;
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-11-25").await;
    let (tp, trace, client_span) = parent(0x42);
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "r.traced", "arguments": {}, "_meta": {"traceparent": tp}}}))
        .await;
    let r = raw.response(1).await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    let sent = crate::kit::text(&r["result"]);
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts.len(), 4, "{sent}");
    assert_eq!(
        (parts[0], parts[1], parts[3]),
        ("00", trace.as_str(), "01"),
        "{sent}"
    );
    let broker_span = parts[2];
    assert_ne!(
        broker_span, client_span,
        "the server's parent is the broker's span"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let span = loop {
        let spans = phoenix.spans().await;
        if let Some(s) = spans
            .into_iter()
            .find(|s| s["name"] == "tools/call r.traced")
        {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no span for r.traced in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(span["context"]["span_id"], broker_span, "{span}");
    assert_eq!(span["context"]["trace_id"], trace, "{span}");
    assert_eq!(span["parent_id"], client_span, "{span}");
}
