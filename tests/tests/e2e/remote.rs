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

pub(crate) fn python() -> Option<String> {
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

    /// Kills the server and waits until it is gone (its port is free again).
    pub async fn stop(mut self) {
        let _ = self._child.kill().await;
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

pub(crate) async fn call(raw: &mut Raw, id: i64, tool: &str, args: Value) -> Value {
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
    for n in ["r.echo", "r.add_note", "r.slow", "r.huge", "r.traced"] {
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

/// The broker started on `b`'s config as it is now: the start's error (the running broker is
/// stopped first).
async fn start_error(b: &mut TestBroker) -> String {
    b.stop().await;
    let config = sharedos_broker::Config::from_file(&b.config_path).expect("config");
    let stop = tokio_util::sync::CancellationToken::new();
    let r = sharedos_broker::start(config, b.runtime.clone(), stop.clone()).await;
    stop.cancel();
    match r {
        Ok(_) => panic!("the broker started"),
        Err(e) => e.to_string(),
    }
}

/// `b`'s config with `extra` appended.
fn append(b: &TestBroker, extra: &str) {
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(&b.config_path, format!("{cfg}{extra}")).expect("w");
}

/// A hostile helper (`tests/python/hostile_http.py MODE`), and its port.
pub async fn hostile(python: &str, mode: &str, log: &Path) -> (tokio::process::Child, u16) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/hostile_http.py");
    let mut child = tokio::process::Command::new(python)
        .arg(script)
        .arg(mode)
        .arg(log)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python");
    let stdout = child.stdout.take().expect("stdout");
    let first = BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .expect("read")
        .expect("line");
    let port = first
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .expect("port");
    (child, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn hostile_remote_servers_are_bounded() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    // A 100 MiB result: refused at the response limit, the broker does not buffer it, the
    // session goes on.
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    // Time for Python to make and send 100 MiB: the limit, not the clock, must end the call.
    let broker = broker_with(
        &provider(&server.url(), "")
            .replace("call_timeout_seconds = 3", "call_timeout_seconds = 60"),
    )
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let started = std::time::Instant::now();
    let r = call(&mut raw, 1, "r.huge", json!({"mib": 100})).await;
    eprintln!("100 MiB result refused after {:?}", started.elapsed());
    assert_eq!(meta(&r)["outcome"], "failed", "{r}");
    // Over the SSE event limit rmcp's worker ends the session ("Transport closed"):
    // `upstream_unavailable`; over the JSON limit, `too_large`.
    let code = meta(&r)["code"].as_str().unwrap_or_default().to_owned();
    assert!(code == "too_large" || code == "upstream_unavailable", "{r}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    let r = call(&mut raw, 2, "r.echo", json!({"text": "still here"})).await;
    assert_eq!(text(&r), "echo: still here", "{r}");
    drop(raw);
    drop(broker);

    // A server that never answers: the start fails in the startup time limit, naming it.
    let (_silent, port) = hostile(&py, "silent", &dir.path().join("silent.log")).await;
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    append(
        &b,
        &provider(&format!("http://127.0.0.1:{port}/mcp"), "").replace(
            "startup_timeout_seconds = 10",
            "startup_timeout_seconds = 2",
        ),
    );
    let started = std::time::Instant::now();
    let e = start_error(&mut b).await;
    let took = started.elapsed();
    assert!(e.contains("did not finish initialize in time"), "{e}");
    assert!(took < Duration::from_secs(15), "{took:?}");

    // A redirect to another host is not followed.
    let log = dir.path().join("redirect.log");
    let (_redirect, port) = hostile(&py, "redirect", &log).await;
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    append(&b, &provider(&format!("http://127.0.0.1:{port}/mcp"), ""));
    let e = start_error(&mut b).await;
    assert!(e.contains("another origin: not followed"), "{e}");
    // The server writes its line after sending the redirect: it may come after the error.
    eventually("the redirecting server logs the request", || {
        !std::fs::read_to_string(&log).unwrap_or_default().is_empty()
    })
    .await;
    let seen = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !seen.is_empty() && seen.lines().all(|l| l.contains("127.0.0.1")),
        "only the configured host was asked: {seen}"
    );
}

/// A test CA and a server certificate for `san` (a host name or an IP address) signed by it,
/// made with rcgen and written to `dir`: (ca, cert, key) PEM files.
pub(crate) fn test_pki(dir: &Path, san: &str) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "sharedos test ca");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().expect("ca key");
    let ca_cert = ca.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca, ca_key);
    let mut server = CertificateParams::new(vec![san.to_owned()]).expect("server params");
    server
        .distinguished_name
        .push(DnType::CommonName, "test server");
    let server_key = KeyPair::generate().expect("server key");
    let server_cert = server.signed_by(&server_key, &issuer).expect("server cert");
    let paths = (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    );
    std::fs::write(&paths.0, ca_cert.pem()).expect("w");
    std::fs::write(&paths.1, server_cert.pem()).expect("w");
    std::fs::write(&paths.2, server_key.serialize_pem()).expect("w");
    // A client certificate from the same CA, for mutual TLS (client.pem, client.key).
    let mut client = CertificateParams::new(Vec::<String>::new()).expect("client params");
    client
        .distinguished_name
        .push(DnType::CommonName, "sharedos broker");
    let client_key = KeyPair::generate().expect("client key");
    let client_cert = client.signed_by(&client_key, &issuer).expect("client cert");
    std::fs::write(dir.join("client.pem"), client_cert.pem()).expect("w");
    std::fs::write(dir.join("client.key"), client_key.serialize_pem()).expect("w");
    paths
}

/// Mutual TLS: a server that requires a client certificate from its CA accepts the provider's
/// `client_cert`/`client_key`; without them the start fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn mutual_tls_with_a_client_certificate() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let (ca, cert, key) = test_pki(dir.path(), "127.0.0.1");
    let server = Server::start(
        &py,
        &dir.path().join("server.log"),
        &[
            "--tls".into(),
            cert.display().to_string(),
            key.display().to_string(),
            "--client-ca".into(),
            ca.display().to_string(),
        ],
    )
    .await;
    let https = format!("https://127.0.0.1:{}/mcp", server.port);
    let path = |f: &str| q(&dir.path().join(f).display().to_string());
    let with_cert = format!(
        "ca_file = {}\nclient_cert = {}\nclient_key = {}\n",
        q(&ca.display().to_string()),
        path("client.pem"),
        path("client.key")
    );
    let broker = broker_with(&provider(&https, &with_cert)).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = call(&mut raw, 1, "r.echo", json!({"text": "mutual"})).await;
    assert_eq!(text(&r), "echo: mutual", "{r}");
    drop(raw);
    drop(broker);

    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    append(
        &b,
        &provider(
            &https,
            &format!("ca_file = {}\n", q(&ca.display().to_string())),
        ),
    );
    let e = start_error(&mut b).await;
    // TLS 1.3: the server checks the (absent) client certificate after the handshake and
    // closes the connection.
    assert!(
        e.contains("provider `r`") && e.contains("MCP initialize") && e.contains("TLS"),
        "{e}"
    );
    assert_eq!(
        server.lines("echo").len(),
        1,
        "only the call with the certificate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn tls_with_a_test_ca() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let (ca, cert, key) = test_pki(dir.path(), "127.0.0.1");
    let server = Server::start(
        &py,
        &dir.path().join("server.log"),
        &[
            "--tls".into(),
            cert.display().to_string(),
            key.display().to_string(),
        ],
    )
    .await;
    let https = format!("https://127.0.0.1:{}/mcp", server.port);
    // With ca_file: it connects, and calls go through.
    let ca_line = format!("ca_file = {}\n", q(&ca.display().to_string()));
    let broker = broker_with(&provider(&https, &ca_line)).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = call(&mut raw, 1, "r.echo", json!({"text": "over tls"})).await;
    assert_eq!(text(&r), "echo: over tls", "{r}");
    let p = remote_of(&providers(&broker).await);
    assert_eq!(
        p["tls"],
        format!("rustls (system roots + ca_file {})", ca.display()),
        "{p}"
    );
    assert_eq!(p["insecureHttp"], false, "{p}");
    let states: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "provider_state" && l["provider"] == "r")
        .collect();
    assert!(!states.is_empty());
    for l in &states {
        assert_eq!(l["remote"]["url"], https, "{l}");
        assert_eq!(l["remote"]["tls"], p["tls"], "{l}");
        assert_eq!(l["remote"]["insecureHttp"], false, "{l}");
    }
    drop(raw);
    drop(broker);

    // Without it: the start fails naming the certificate problem.
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    append(&b, &provider(&https, ""));
    let e = start_error(&mut b).await;
    assert!(
        e.contains("invalid peer certificate") && e.contains("UnknownIssuer"),
        "{e}"
    );

    // A certificate for another name: refused.
    let other = tempfile::tempdir().expect("tmp");
    let (ca2, cert2, key2) = test_pki(other.path(), "elsewhere.test");
    let wrong = Server::start(
        &py,
        &dir.path().join("wrong.log"),
        &[
            "--tls".into(),
            cert2.display().to_string(),
            key2.display().to_string(),
        ],
    )
    .await;
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    append(
        &b,
        &provider(
            &format!("https://127.0.0.1:{}/mcp", wrong.port),
            &format!("ca_file = {}\n", q(&ca2.display().to_string())),
        ),
    );
    let e = start_error(&mut b).await;
    assert!(
        e.contains("invalid peer certificate")
            && e.contains("certificate not valid for name \"127.0.0.1\""),
        "{e}"
    );

    // Plain http:// to a host that is not loopback is refused by the config check.
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    b.stop().await;
    append(&b, &provider("http://192.0.2.1/mcp", ""));
    let e = sharedos_broker::Config::from_file(&b.config_path)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("not loopback") && e.contains("insecure_http"),
        "{e}"
    );
    // With `insecure_http = true` the same entry is accepted.
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        cfg.replace(
            "url = \"http://192.0.2.1/mcp\"",
            "url = \"http://192.0.2.1/mcp\"\ninsecure_http = true",
        ),
    )
    .expect("w");
    let accepted = sharedos_broker::Config::from_file(&b.config_path);
    assert!(
        accepted.is_ok(),
        "{:?}",
        accepted.err().map(|e| e.to_string())
    );
}

/// `sharedos-broker secrets set --config CFG --principal P NAME`, the value on stdin.
fn set_secret(config: &Path, principal: &str, name: &str, value: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(crate::kit::bin("sharedos-broker"))
        .args(["secrets", "set", "--config"])
        .arg(config)
        .args(["--principal", principal, name])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("cli");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{value}\n").as_bytes())
        .expect("value");
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success(), "{out:?}");
}

/// Per-principal bearer tokens: the server (a token verifier) sees alice's token on alice's calls
/// and bob's on bob's; carol, without the secret, is refused before anything is sent; dave's
/// wrong token is `upstream_unauthorized` naming the provider, and not retried in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn per_principal_bearer_tokens_reach_the_remote_server() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(
        &py,
        &dir.path().join("server.log"),
        &["--tokens".into(), "alice=tok-alice,bob=tok-bob".into()],
    )
    .await;
    let mut b = TestBroker::start(Options {
        policy: r#"
@id("all-remote")
permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "r.*" };
"#,
        ..Options::default()
    })
    .await;
    for (who, token) in [
        ("alice", "Bearer tok-alice"),
        ("bob", "Bearer tok-bob"),
        ("dave", "Bearer revoked"),
    ] {
        set_secret(&b.config_path, who, "token", token);
    }
    append(
        &b,
        &provider(
            &server.url(),
            "instances = \"per_principal\"\nlist_as = \"alice\"\nheaders = { Authorization = { secret = \"token\" } }\n",
        ),
    );
    b.restart().await;
    let mut shims = Vec::new();
    for who in ["alice", "bob", "carol", "dave"] {
        let turn = b.open_turn(who).await;
        let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        shims.push(raw);
    }
    for round in 0..3 {
        for (i, who) in ["alice", "bob"].iter().enumerate() {
            let r = call(&mut shims[i], 10 + round, "r.whoami", json!({})).await;
            assert_eq!(
                text(&r),
                *who,
                "{r}\nserver: {:?}\nrecords: {:?}",
                std::fs::read_to_string(&server.log),
                b.records()
                    .iter()
                    .filter(|l| l["kind"] == "provider_state")
                    .collect::<Vec<_>>()
            );
        }
    }
    assert_eq!(server.lines("whoami alice").len(), 3);
    // One instance each, kept across the rounds: starting bob's does not end alice's, nor the
    // provider's own session.
    let states = b.records();
    let states: Vec<_> = states
        .iter()
        .filter(|l| l["kind"] == "provider_state")
        .collect();
    for who in ["alice", "bob"] {
        let started = states
            .iter()
            .filter(|l| l["state"] == "instance_started" && l["principal"] == who)
            .count();
        assert_eq!(started, 1, "{who}: {states:?}");
    }
    assert!(
        !states
            .iter()
            .any(|l| l["state"] == "instance_stopped" || l["state"] == "restarting"),
        "{states:?}"
    );
    assert_eq!(server.lines("whoami bob").len(), 3);

    let r = call(&mut shims[2], 1, "r.whoami", json!({})).await;
    assert_eq!(meta(&r)["code"], "missing_credential", "{r}");
    assert!(text(&r).contains("`carol`"), "{r}");

    let refused_before = server.lines("token refused").len();
    let r = call(&mut shims[3], 1, "r.whoami", json!({})).await;
    assert_eq!(meta(&r)["outcome"], "failed", "{r}");
    assert_eq!(meta(&r)["code"], "upstream_unauthorized", "{r}");
    assert!(text(&r).contains("`r`"), "{r}");
    assert!(
        !r.to_string().contains("revoked"),
        "the token is not shown: {r}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refused = server.lines("token refused").len() - refused_before;
    eprintln!("dave's wrong token: {refused} refused request(s) at the server");
    assert!((1..=2).contains(&refused), "retried in a loop: {refused}");
    assert_eq!(server.lines("whoami dave").len(), 0);
    // alice goes on.
    let r = call(&mut shims[0], 20, "r.whoami", json!({})).await;
    assert_eq!(text(&r), "alice", "{r}");
}

/// The server restarting mid-session (its sessions are gone: HTTP 404 on the old session id):
/// a read-only call is sent again once on a new session and succeeds; a state-changing call is
/// refused `failed/upstream_unavailable`, recorded, and has no second effect on the server.
/// Sessions exist up to 2025-11-25 only, so the provider is opened at that revision (at
/// 2026-07-28 a restart loses nothing: `upstream_protocol.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_server_restart_retries_read_only_calls_only() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("server.log");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let args = ["--port".to_owned(), port.to_string()];
    let mut server = Server::start(&py, &log, &args).await;
    let broker = broker_with(&provider(&server.url(), "protocol = \"2025-11-25\"")).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let note = |n: &str| json!({"path": format!("/public/{n}"), "text": n});
    let r = call(&mut raw, 1, "r.add_note", note("before")).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");

    // Restarted under a read-only call: sent again once, on a new session.
    server.stop().await;
    server = Server::start(&py, &log, &args).await;
    let r = call(&mut raw, 2, "r.echo", json!({"text": "again"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "echo: again");
    assert_eq!(
        server.lines("echo again").len(),
        1,
        "sent once to the new server"
    );

    // Restarted under a state-changing call: refused, never sent twice.
    server.stop().await;
    server = Server::start(&py, &log, &args).await;
    let r = call(&mut raw, 3, "r.add_note", note("during")).await;
    assert_eq!(meta(&r)["outcome"], "failed", "{r}");
    assert_eq!(meta(&r)["code"], "upstream_unavailable", "{r}");
    assert!(text(&r).contains("not sent again"), "{r}");
    // The next call, once the new session is open, goes to it.
    let mut opened = false;
    for _ in 0..100 {
        let p = remote_of(&providers(&broker).await);
        if p["state"] == "ready" && p["session"] == "open" {
            opened = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(opened, "a new session in 5 s");
    let r = call(&mut raw, 4, "r.add_note", note("after")).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(
        server.lines("effect"),
        [
            "effect add_note /public/before before",
            "effect add_note /public/after after"
        ],
        "no effect for the refused call, and none twice"
    );

    let records = broker.records();
    let retried: Vec<_> = records
        .iter()
        .filter(|l| l["kind"] == "provider_state" && l["state"] == "call_retried")
        .collect();
    assert_eq!(retried.len(), 1, "{retried:?}");
    assert!(
        retried[0]["reason"]
            .as_str()
            .unwrap_or("")
            .contains("`echo`")
    );
    let calls: Vec<_> = records
        .iter()
        .filter(|l| l["kind"] == "call")
        .map(|l| {
            (
                l["tool"].as_str().unwrap_or("").to_owned(),
                l["outcome"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            ("r.add_note".to_owned(), "succeeded".to_owned()),
            ("r.echo".to_owned(), "succeeded".to_owned()),
            ("r.add_note".to_owned(), "failed".to_owned()),
            ("r.add_note".to_owned(), "succeeded".to_owned()),
        ]
    );
    server.stop().await;
}

/// OAuth 2.0 client credentials against a token endpoint the test runs (the `mcp` server's own
/// `/token`): one token request for many calls, a new one once the token expired (and only
/// then), the token and the client secret in no record line and no answer; a client the
/// endpoint refuses is `upstream_unauthorized` at start, naming the token endpoint, and asked
/// once, not in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn oauth_client_credentials_are_fetched_once_and_renewed() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(
        &py,
        &dir.path().join("server.log"),
        &[
            "--oauth".into(),
            "sharedos-broker=s3cret-client".into(),
            "--expires".into(),
            "4".into(),
        ],
    )
    .await;
    let mut b = TestBroker::start(Options {
        policy: r#"
@id("all-remote")
permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "r.*" };
"#,
        ..Options::default()
    })
    .await;
    set_secret(&b.config_path, "_shared", "oauth_client", "s3cret-client");
    let oauth = |method: &str| {
        format!(
            "[providers.oauth]\ntoken_url = \"http://127.0.0.1:{}/token\"\nclient_id = \"sharedos-broker\"\nclient_secret = {{ secret = \"oauth_client\", shared = true }}\nscopes = [\"tools:read\", \"tools:call\"]\nauth_method = \"{method}\"\n",
            server.port
        )
    };
    append(&b, &provider(&server.url(), &oauth("client_secret_basic")));
    b.restart().await;
    let turn = b.open_turn("alice").await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    for i in 0..5 {
        let r = call(&mut raw, 10 + i, "r.whoami", json!({})).await;
        assert_eq!(text(&r), "sharedos-broker", "{r}");
    }
    let issued = server.lines("token-issued");
    assert_eq!(
        issued.len(),
        1,
        "one token for the start and five calls: {issued:?}"
    );
    assert!(
        issued[0].contains("scope=tools:read tools:call")
            && issued[0].contains(&format!("resource={}", server.url())),
        "{issued:?}"
    );
    let p = remote_of(&providers(&b).await);
    assert_eq!(p["oauthTokenFetches"], 1, "{p}");
    // Past its lifetime (4 s, renewed 2 s before): one new token, then cached again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for i in 0..3 {
        let r = call(&mut raw, 20 + i, "r.whoami", json!({})).await;
        assert_eq!(text(&r), "sharedos-broker", "{r}");
    }
    assert_eq!(server.lines("token-issued").len(), 2);
    assert_eq!(
        server.lines("token refused").len(),
        0,
        "no expired token was sent"
    );
    assert_eq!(server.lines("whoami sharedos-broker").len(), 8);
    // A server that echoes the bearer token it got: the harness sees it redacted.
    let tokens: Vec<String> = server
        .lines("token-issued")
        .iter()
        .filter_map(|l| l.split("token=").nth(1).map(|t| t.trim().to_owned()))
        .collect();
    assert_eq!(tokens.len(), 2, "{tokens:?}");
    let r = call(&mut raw, 30, "r.bearer", json!({})).await;
    assert_eq!(text(&r), "bearer [redacted: oauth access token]", "{r}");
    let record = std::fs::read_to_string(b.record_path()).expect("record");
    for secret in [&"s3cret-client".to_owned(), &tokens[0], &tokens[1]] {
        assert!(
            !record.contains(secret.as_str()),
            "`{secret}` in the record"
        );
        assert!(
            !r.to_string().contains(secret.as_str()),
            "`{secret}` reached the harness"
        );
    }
    drop(raw);

    // client_secret_post, with a secret the endpoint refuses: the start fails naming the
    // endpoint and the client, after one request.
    let mut b2 = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    set_secret(&b2.config_path, "_shared", "oauth_client", "wrong");
    append(&b2, &provider(&server.url(), &oauth("client_secret_post")));
    let e = start_error(&mut b2).await;
    assert!(
        e.contains("token endpoint")
            && e.contains("refused client `sharedos-broker`")
            && e.contains("invalid_client"),
        "{e}"
    );
    assert!(!e.contains("wrong"), "the secret is not shown: {e}");
    assert_eq!(server.lines("token-endpoint-refused").len(), 1);
}

/// With OpenTelemetry export off, the client's W3C trace context goes on to the server as it
/// came (`params._meta.traceparent`); a call without one sends none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn the_clients_trace_context_reaches_the_server() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let broker = broker_with(&provider(&server.url(), "")).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "r.traced", "arguments": {}, "_meta": {"traceparent": tp}}}))
        .await;
    let r = raw.response(1).await;
    assert_eq!(text(&r["result"]), tp, "{r}");
    let r = call(&mut raw, 2, "r.traced", json!({})).await;
    assert_eq!(text(&r), "none", "{r}");
    assert_eq!(
        server.lines("traceparent"),
        [format!("traceparent {tp}"), "traceparent none".to_owned()]
    );
}

/// npm server-everything (not written here) in its Streamable HTTP mode, behind the kernel as a
/// remote provider: allowed, unpublished, invalid arguments (its own inputSchema), timed out,
/// cancelled by the client; each recorded like a stdio call.
/// npm server-everything in its Streamable HTTP mode on a free loopback port, once it listens.
pub(crate) async fn everything_http(
    s: &std::collections::BTreeMap<String, String>,
) -> (tokio::process::Child, u16) {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let preload = concat!(env!("CARGO_MANIFEST_DIR"), "/node/loopback.cjs");
    let server = tokio::process::Command::new(&s["EVERYTHING_CMD"])
        .args(["-r", preload, &s["EVERYTHING_ARGS"], "streamableHttp"])
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("server-everything");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "server-everything did not listen"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (server, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs npm server-everything from .ci/install-mcp-servers: bash .ci/run installs it and runs this"]
async fn server_everything_over_streamable_http() {
    let Some(s) = crate::upstream::servers() else {
        return;
    };
    let (mut server, port) = everything_http(&s).await;
    let mut b = TestBroker::start(Options {
        policy: r#"
@id("alice-everything")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name == "ev.echo" || resource.name == "ev.get-sum"
    || resource.name == "ev.trigger-long-running-operation" };
"#,
        ..Options::default()
    })
    .await;
    append(
        &b,
        &format!(
            "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"ev\"\nurl = \"http://127.0.0.1:{port}/mcp\"\ncall_timeout_seconds = 3\n"
        ),
    );
    b.restart().await;
    let turn = b.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    assert!(
        names.contains(&"ev.echo".to_owned()) && !names.contains(&"ev.get-env".to_owned()),
        "{names:?}"
    );
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = call(&mut raw, 1, "ev.echo", json!({"message": "over http"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "Echo: over http");
    let r = call(&mut raw, 2, "ev.get-sum", json!({"a": 2, "b": 3})).await;
    assert_eq!(text(&r), "The sum of 2 and 3 is 5.", "{r}");
    let r = call(&mut raw, 3, "ev.get-env", json!({})).await;
    assert_eq!(meta(&r)["code"], "unpublished_tool", "{r}");
    let r = call(&mut raw, 4, "ev.get-sum", json!({"a": "x", "b": 1})).await;
    assert_eq!(meta(&r)["code"], "invalid_arguments", "{r}");
    let r = call(
        &mut raw,
        5,
        "ev.trigger-long-running-operation",
        json!({"duration": 8, "steps": 2}),
    )
    .await;
    assert_eq!(meta(&r)["code"], "timeout", "{r}");
    raw.send(json!({"jsonrpc": "2.0", "id": 6, "method": "tools/call",
        "params": {"name": "ev.trigger-long-running-operation", "arguments": {"duration": 2, "steps": 2}}}))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 6}}),
    )
    .await;
    let t = turn.turn.clone();
    eventually("the cancelled call is recorded", || {
        b.calls_of(&t).iter().any(|c| c["outcome"] == "cancelled")
    })
    .await;
    let r = call(&mut raw, 7, "ev.echo", json!({"message": "after"})).await;
    assert_eq!(text(&r), "Echo: after", "{r}");
    let outcomes: Vec<String> = b
        .calls_of(&turn.turn)
        .iter()
        .map(|c| {
            format!(
                "{}/{}",
                c["outcome"].as_str().unwrap_or(""),
                c["code"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            "succeeded/ok",
            "succeeded/ok",
            "denied/unpublished_tool",
            "failed/invalid_arguments",
            "failed/timeout",
            "cancelled/client_cancelled",
            "succeeded/ok"
        ],
        "{outcomes:?}"
    );
    let _ = server.kill().await;
}

/// The debug measurement recorded in bench/NOTES.md ("Remote providers"; the release figures,
/// with the floor of one relay hop and the connections counted, are section 9 of
/// `sharedos-bench`): one `echo` call to the PyPI `mcp` server over
/// Streamable HTTP on loopback, sent directly by an rmcp client, against the same call through the
/// shim, the broker's kernel and the broker's own HTTP session. 5 rounds of 60 sequential calls
/// each way, interleaved, after 20 warm-up calls each; medians and p99 printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn per_call_cost_through_the_broker_against_direct() {
    use rmcp::ServiceExt as _;
    use rmcp::model::CallToolRequestParams;
    use std::time::Instant;
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    sharedos_broker::telemetry::install_crypto_provider();
    let direct = ()
        .serve(rmcp::transport::StreamableHttpClientTransport::from_uri(
            server.url(),
        ))
        .await
        .expect("direct client");
    let broker = broker_with(&provider(&server.url(), "")).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let mut id = 0;
    let args = json!({"text": "x"});
    let params = CallToolRequestParams::new("echo")
        .with_arguments(args.as_object().cloned().unwrap_or_default());
    let (mut d, mut b) = (vec![], vec![]);
    for round in 0..6 {
        let n = if round == 0 { 20 } else { 60 };
        for _ in 0..n {
            let t = Instant::now();
            let r = direct.call_tool(params.clone()).await.expect("direct call");
            let took = t.elapsed();
            assert_ne!(r.is_error, Some(true));
            if round > 0 {
                d.push(took);
            }
        }
        for _ in 0..n {
            id += 1;
            let t = Instant::now();
            let r = call(&mut raw, id, "r.echo", args.clone()).await;
            let took = t.elapsed();
            assert_eq!(text(&r), "echo: x", "{r}");
            if round > 0 {
                b.push(took);
            }
        }
    }
    let _ = direct.cancel().await;
    let pct = |v: &mut Vec<Duration>, p: f64| {
        v.sort_unstable();
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    let (dm, bm) = (pct(&mut d, 0.5), pct(&mut b, 0.5));
    eprintln!(
        "remote echo, 300 sequential calls each: direct rmcp client median {dm:?} p99 {:?}; through the broker median {bm:?} p99 {:?}; ratio {:.2}, difference {:?}",
        pct(&mut d, 0.99),
        pct(&mut b, 0.99),
        bm.as_secs_f64() / dm.as_secs_f64(),
        bm.saturating_sub(dm)
    );
    assert_eq!((d.len(), b.len()), (300, 300));
}

/// Progress a server sends though the broker asked for none (no `progressToken`): not passed to
/// the harness, never silently dropped: the session's first is on record (`upstream_request`,
/// `not_forwarded`), and the call is answered as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn unasked_progress_is_recorded_not_forwarded() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let broker = broker_with(&provider(&server.url(), "")).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    for id in 1..=2 {
        raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "r.chatty", "arguments": {"steps": 5}}}))
            .await;
        let r = raw.response(id).await;
        assert_eq!(text(&r["result"]), "chatty done", "{r}");
    }
    assert_eq!(server.lines("progress sent 5").len(), 2);
    let lines: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request")
        .collect();
    assert_eq!(lines.len(), 1, "the session's first only: {lines:?}");
    assert_eq!(lines[0]["method"], "notifications/progress");
    assert_eq!(lines[0]["action"], "not_forwarded");
    assert_eq!(lines[0]["provider"], "r");
}

/// Issue 42 item 9: a provider's `url` and `oauth.token_url` are read by the parser the HTTP
/// client uses. `http://192.0.2.2:PORT\@127.0.0.1/mcp` (the client ends the host at `\` and
/// would send the bearer to 192.0.2.2 in clear text) and its cousins are refused at load by the
/// real broker binary, naming the key and the problem and never the bearer; `0x7f000001`, which
/// the client reads as 127.0.0.1, is loopback and the real server behind it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_urls_are_read_as_the_http_client_reads_them() {
    let dir = tempfile::tempdir().expect("tmp");
    let bearer = "headers = { Authorization = \"Bearer TOPSECRET-bearer-42\" }\n";
    let refused = [
        ("http://192.0.2.2:9\\@127.0.0.1/mcp", "contains `\\`"),
        ("http://127.0.0.1\\@evil.example/", "contains `\\`"),
        ("http://evil.example\\\\@127.0.0.1/", "contains `\\`"),
        ("http://user@127.0.0.1/", "has user info"),
        ("http://user:pa55word@127.0.0.1/mcp", "has user info"),
        ("http://evil%5C@127.0.0.1/", "has user info"),
        (
            "http://127.0.0.1.evil.example/mcp",
            "is plain HTTP to `127.0.0.1.evil.example`",
        ),
        ("http://127.0.0.1\t.evil.example/", "contains \\t"),
        ("http://evil.example\n@127.0.0.1/", "contains \\n"),
        ("file:///etc/passwd", "scheme `file`"),
    ];
    let mut checked = 0;
    for (url, problem) in refused {
        for key in ["url", "oauth.token_url"] {
            let entry = if key == "url" {
                provider(url, bearer)
            } else {
                provider(
                    "https://mcp.example.com/mcp",
                    &format!(
                        "[providers.oauth]\ntoken_url = {}\nclient_id = \"c\"\nclient_secret = {{ secret = \"s\", shared = true }}\n",
                        q(url)
                    ),
                )
            };
            let config = crate::kit::write_config(
                dir.path(),
                &Options {
                    policy: POLICY,
                    tables: entry,
                    ..Options::default()
                },
            );
            let mut cmd = std::process::Command::new(crate::kit::bin("sharedos-broker"));
            cmd.arg("--runtime-dir")
                .arg(dir.path().join("run"))
                .arg("serve")
                .arg("--config")
                .arg(&config);
            let (code, _, err) = crate::kit::run(cmd).await;
            assert_ne!(code, 0, "{key} = {url:?} was accepted: {err}");
            assert!(
                err.contains(&format!("provider `r`: {key} `")) && err.contains(problem),
                "{key} = {url:?}: {err}"
            );
            assert!(
                !err.contains("TOPSECRET") && !err.contains("pa55word"),
                "a credential in the error: {err}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 20);
    assert!(
        !dir.path().join("record.jsonl").exists(),
        "a refused config starts nothing"
    );

    // 0x7f000001 is 127.0.0.1 to the client: loopback, accepted, and the call goes through.
    let Some(py) = python() else { return };
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let b = broker_with(&provider(
        &format!("http://0x7f000001:{}/mcp", server.port),
        "",
    ))
    .await;
    let p = remote_of(&providers(&b).await);
    assert_eq!(p["tls"], "none (plain HTTP to loopback)", "{p}");
    let turn = b.open_turn("alice").await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = call(&mut raw, 1, "r.echo", json!({"text": "hex"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "echo: hex");
}
