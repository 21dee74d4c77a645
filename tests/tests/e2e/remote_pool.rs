//! Issue 46 item 1: a remote provider's connections are kept and reused. Counted where the server
//! sees them: a TCP relay in front of the real server (PyPI `mcp` `MCPServer`, npm
//! server-everything) counts the connections the broker opens, how many are open at once, and,
//! under TLS, the handshakes the server completed in full or by resuming a session; it can close
//! a connection idle for a while, as a server's keep-alive timeout does.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use crate::kit::{Raw, TestBroker, meta, text};
use crate::remote::{Server, broker_with, hostile, provider, providers, python, remote_of};

/// What the relay saw.
#[derive(Default)]
struct Counts {
    accepted: AtomicUsize,
    open: AtomicUsize,
    most_open: AtomicUsize,
    idle_closed: AtomicUsize,
    /// TLS: ServerHellos that accepted the client's pre-shared key (a resumed session), and
    /// those that did not (a full handshake).
    resumed: AtomicUsize,
    full: AtomicUsize,
}

struct Relay {
    port: u16,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    /// A relay on 127.0.0.1 to `target`; with `idle_close`, a connection that carried no byte
    /// either way for that long is closed (both sides).
    async fn start(target: u16, idle_close: Option<Duration>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let port = listener.local_addr().expect("addr").port();
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                c.accepted.fetch_add(1, Ordering::SeqCst);
                let now = c.open.fetch_add(1, Ordering::SeqCst) + 1;
                c.most_open.fetch_max(now, Ordering::SeqCst);
                let c = c.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await {
                        pipe(client, server, idle_close, &c).await;
                    }
                    c.open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self { port, counts, task }
    }

    fn accepted(&self) -> usize {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    /// Starts counting the most connections open at once anew (from those open now).
    fn reset_most_open(&self) {
        let now = self.counts.open.load(Ordering::SeqCst);
        self.counts.most_open.store(now, Ordering::SeqCst);
    }

    fn most_open(&self) -> usize {
        self.counts.most_open.load(Ordering::SeqCst)
    }

    fn open(&self) -> usize {
        self.counts.open.load(Ordering::SeqCst)
    }
}

/// Copies both ways until either side closes, or until no byte moved for `idle_close`. The
/// server's first TLS record (its ServerHello) is read for the handshake counts.
async fn pipe(client: TcpStream, server: TcpStream, idle_close: Option<Duration>, c: &Counts) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let (moved_tx, mut moved) = tokio::sync::mpsc::unbounded_channel::<()>();
    let up_moved = moved_tx.clone();
    let up = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let _ = up_moved.send(());
                    if sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = sw.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0u8; 16 * 1024];
        let mut first: Vec<u8> = Vec::new();
        let mut hello_read = false;
        loop {
            // The relay acknowledges what the server sends at once, as the broker does: the
            // relay's own delayed ACK would otherwise stall the server's answer (see
            // `calls_on_a_kept_connection_do_not_wait_for_a_delayed_ack`).
            let _ = rustix::net::sockopt::set_tcp_quickack(sr.as_ref(), true);
            match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let _ = moved_tx.send(());
                    if !hello_read {
                        first.extend_from_slice(&buf[..n]);
                        if let Some(resumed) = server_hello_resumed(&first) {
                            hello_read = true;
                            let counter = if resumed { &c.resumed } else { &c.full };
                            counter.fetch_add(1, Ordering::SeqCst);
                        } else if first.first() != Some(&0x16) || first.len() > 64 * 1024 {
                            hello_read = true;
                        }
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = cw.shutdown().await;
    };
    let idle = async {
        let Some(limit) = idle_close else {
            return std::future::pending::<()>().await;
        };
        loop {
            match tokio::time::timeout(limit, moved.recv()).await {
                Ok(Some(())) => continue,
                Ok(None) => return std::future::pending::<()>().await,
                Err(_) => return,
            }
        }
    };
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        () = idle => { c.idle_closed.fetch_add(1, Ordering::SeqCst); }
    }
}

/// Whether a complete TLS ServerHello at the start of `bytes` accepted a pre-shared key
/// (extension 41: a resumed TLS 1.3 session); `None` until the record is complete.
fn server_hello_resumed(bytes: &[u8]) -> Option<bool> {
    if bytes.len() < 5 || bytes[0] != 0x16 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([bytes[3], bytes[4]]));
    let record = bytes.get(5..5 + len)?;
    // Handshake header (type 2 = ServerHello, 3-byte length), version, random.
    if record.first() != Some(&2) {
        return Some(false);
    }
    let mut at = 4 + 2 + 32;
    let sid = usize::from(*record.get(at)?);
    at += 1 + sid + 2 + 1;
    let ext_len = usize::from(u16::from_be_bytes([*record.get(at)?, *record.get(at + 1)?]));
    at += 2;
    let end = at + ext_len;
    while at + 4 <= end.min(record.len()) {
        let kind = u16::from_be_bytes([record[at], record[at + 1]]);
        let n = usize::from(u16::from_be_bytes([record[at + 2], record[at + 3]]));
        if kind == 41 {
            return Some(true);
        }
        at += 4 + n;
    }
    Some(false)
}

/// `n` `r.echo` calls one after the other on `raw`, ids from `first`; each must succeed.
async fn sequential(raw: &mut Raw, first: i64, n: i64) {
    for id in first..first + n {
        let r = raw
            .call(id, "r.echo", json!({"text": format!("seq {id}")}))
            .await;
        assert_eq!(text(&r["result"]), format!("echo: seq {id}"), "{r}");
    }
}

/// 64 calls at once: 8 shims of a turn of their own, 8 calls in flight on each (the most of a
/// turn and of a bridge), each a `slow` call of 20 ms, so they overlap at the server. Every one
/// must succeed; the turn is returned.
async fn concurrent(broker: &TestBroker) -> String {
    let turn = broker.open_turn("alice").await;
    let mut runs = tokio::task::JoinSet::new();
    for s in 0..8i64 {
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        runs.spawn(async move {
            let ids: Vec<i64> = (0..8).map(|i| 1000 + s * 10 + i).collect();
            for id in &ids {
                raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                    "params": {"name": "r.slow", "arguments": {"seconds": 0.02}}}))
                    .await;
            }
            let mut seen = Vec::new();
            while seen.len() < ids.len() {
                let v = raw.recv().await;
                let Some(id) = v["id"].as_i64() else { continue };
                assert!(ids.contains(&id), "{v}");
                assert_eq!(meta(&v["result"])["outcome"], "succeeded", "{v}");
                assert_eq!(text(&v["result"]), "slept", "{v}");
                seen.push(id);
            }
        });
    }
    while let Some(run) = runs.join_next().await {
        run.expect("a shim's calls");
    }
    turn.turn.clone()
}

/// The pool's bound for these tests.
const POOL: usize = 4;

/// A stateful, a stateless and a stateless JSON-answering `MCPServer`: 60 sequential calls open
/// at most 2 connections, 64 concurrent calls at most `max_connections` (4), never more open
/// at once than that (plus the `subscriptions/listen` stream); every call's effect happens
/// once at the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn connections_are_kept_and_reused() {
    let Some(py) = python() else { return };
    for (mode, args) in [
        ("stateful", &[][..]),
        ("stateless", &["--stateless"][..]),
        ("stateless json", &["--stateless", "--json"][..]),
    ] {
        let dir = tempfile::tempdir().expect("tmp");
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let server = Server::start(&py, &dir.path().join("server.log"), &args).await;
        let relay = Relay::start(server.port, None).await;
        let url = format!("http://127.0.0.1:{}/mcp", relay.port);
        let broker = broker_with(&provider(&url, &format!("max_connections = {POOL}\n"))).await;
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        sequential(&mut raw, 1, 2).await;
        let p = remote_of(&providers(&broker).await);
        assert_eq!(
            (&p["maxConnections"], &p["idleConnectionSeconds"]),
            (&json!(POOL), &json!(4)),
            "{p}"
        );
        // The broker speaks 2026-07-28 to this server (stateful or stateless alike): it keeps
        // its `subscriptions/listen` stream open besides (at 2025-11-25, a stateful session's
        // listening GET).
        assert_eq!(p["protocol"], "2026-07-28", "{p}");
        let listening = 1;

        let before = relay.accepted();
        sequential(&mut raw, 10, 60).await;
        let opened = relay.accepted() - before;
        assert!(
            opened <= 2,
            "{mode}: 60 sequential calls opened {opened} connections"
        );
        assert_eq!(server.lines("echo seq").len(), 62, "{mode}");

        // (Starting the burst's shims opens no upstream connection: each is a bridge.)
        let before = relay.accepted();
        relay.reset_most_open();
        let burst = concurrent(&broker).await;
        let opened = relay.accepted() - before;
        let most = relay.most_open();
        eprintln!(
            "{mode}: 64 concurrent calls opened {opened} connections, at most {most} open at once"
        );
        assert!(
            opened <= POOL,
            "{mode}: 64 concurrent calls opened {opened} connections, max_connections = {POOL}"
        );
        assert!(
            most <= POOL + listening,
            "{mode}: {most} connections open at once, max_connections = {POOL}"
        );
        assert!(
            most > 1 + listening,
            "{mode}: the calls overlapped on more than one connection ({most} open at once)"
        );
        each_call_once(&server, &broker, (&turn.turn, 62), &burst, mode);
    }
}

/// The burst's 64 `slow` calls each happened once at the server, and the turn's `sequential`
/// calls (their number given) and the burst's are all on record as succeeded.
fn each_call_once(
    server: &Server,
    broker: &TestBroker,
    (turn, sequential): (&str, usize),
    burst: &str,
    mode: &str,
) {
    assert_eq!(
        server.lines("done slow").len(),
        64,
        "{mode}: each call once"
    );
    let (calls, burst) = (broker.calls_of(turn), broker.calls_of(burst));
    assert_eq!((calls.len(), burst.len()), (sequential, 64), "{mode}");
    assert!(
        calls
            .iter()
            .chain(&burst)
            .all(|c| c["outcome"] == "succeeded"),
        "{mode}"
    );
}

/// A server that closes idle connections under the broker (the relay after 150 ms; then the
/// real server's own keep-alive, uvicorn's at 1 s): the next call opens a new connection and
/// succeeds, and each call's effect happens exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn idle_connections_the_server_closes_cost_a_new_connection_only() {
    let Some(py) = python() else { return };
    for (mode, args) in [
        ("stateless", &["--stateless", "--keep-alive", "1"][..]),
        ("stateful", &["--keep-alive", "1"][..]),
    ] {
        let dir = tempfile::tempdir().expect("tmp");
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let server = Server::start(&py, &dir.path().join("server.log"), &args).await;
        let relay = Relay::start(server.port, Some(Duration::from_millis(150))).await;
        let url = format!("http://127.0.0.1:{}/mcp", relay.port);
        let broker = broker_with(&provider(&url, "")).await;
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        let before = relay.accepted();
        for i in 0..12 {
            let r = raw
                .call(
                    100 + i,
                    "r.add_note",
                    json!({"path": format!("/public/{i}"), "text": "once"}),
                )
                .await;
            assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{mode}: {r}");
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        let opened = relay.accepted() - before;
        let closed = relay.counts.idle_closed.load(Ordering::SeqCst);
        // The first call may still ride the connection `initialize` opened (its idle close
        // can come after it); each of the 11 after an idle close opens its own.
        assert!(
            opened >= 11 && closed >= 11,
            "{mode}: each call after an idle close opens a connection ({opened} opened, {closed} closed idle)"
        );
        let effects = server.lines("effect add_note");
        assert_eq!(effects.len(), 12, "{mode}: each call once: {effects:?}");
        for i in 0..12 {
            assert!(
                effects.contains(&format!("effect add_note /public/{i} once")),
                "{mode}: {effects:?}"
            );
        }

        // The real server's own keep-alive (1 s), without the relay's: connections it closed
        // cost a new one, never an error.
        let direct = broker_with(&provider(&server.url(), "")).await;
        let t = direct.open_turn("alice").await;
        let mut raw = Raw::spawn(direct.shim_command(t.token.expose()));
        raw.initialize("2025-11-25").await;
        for i in 0..3 {
            let r = raw
                .call(
                    200 + i,
                    "r.add_note",
                    json!({"path": format!("/public/k{i}"), "text": "once"}),
                )
                .await;
            assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{mode}: {r}");
            tokio::time::sleep(Duration::from_millis(1300)).await;
        }
        assert_eq!(
            server.lines("effect add_note /public/k").len(),
            3,
            "{mode}: each call once"
        );
        let failed: Vec<Value> = direct
            .calls_of(&t.turn)
            .into_iter()
            .filter(|c| c["outcome"] != "succeeded")
            .collect();
        assert!(failed.is_empty(), "{mode}: {failed:?}");
    }
}

/// Behind TLS with the test CA: 60 sequential calls on kept connections make at most 2 full
/// handshakes; with `idle_connection_seconds = 0` (no connection kept) every call opens a
/// connection, and all but the first few resume a TLS session instead of a full handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn tls_connections_are_reused_and_sessions_resumed() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let (ca, cert, key) = crate::remote::test_pki(dir.path(), "127.0.0.1");
    let server = Server::start(
        &py,
        &dir.path().join("server.log"),
        &[
            "--stateless".into(),
            "--tls".into(),
            cert.display().to_string(),
            key.display().to_string(),
        ],
    )
    .await;
    let relay = Relay::start(server.port, None).await;
    let url = format!("https://127.0.0.1:{}/mcp", relay.port);
    let ca_line = format!("ca_file = {}\n", serde_json::to_string(&ca).expect("q"));
    for (kept, extra) in [(true, ""), (false, "idle_connection_seconds = 0\n")] {
        let (full0, resumed0) = (
            relay.counts.full.load(Ordering::SeqCst),
            relay.counts.resumed.load(Ordering::SeqCst),
        );
        let before = relay.accepted();
        let broker = broker_with(&provider(&url, &format!("{ca_line}{extra}"))).await;
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        sequential(&mut raw, 1, 60).await;
        let opened = relay.accepted() - before;
        let full = relay.counts.full.load(Ordering::SeqCst) - full0;
        let resumed = relay.counts.resumed.load(Ordering::SeqCst) - resumed0;
        eprintln!(
            "tls, connections kept: {kept}: {opened} connections, {full} full handshakes, {resumed} resumed"
        );
        if kept {
            assert!(opened <= 3, "{opened} connections for start and 60 calls");
            assert!(full <= 2, "{full} full handshakes");
        } else {
            assert!(opened >= 60, "{opened} connections: one per request");
            assert!(full <= 3, "{full} full handshakes, {resumed} resumed");
            assert!(resumed + full >= 60, "{full} full, {resumed} resumed");
        }
    }
}

/// HTTP/2 where the server offers it (ALPN): a stateful and a stateless `MCPServer` under
/// hypercorn behind TLS with the test CA. Every request the server sees, the listening stream's
/// included, is HTTP/2; 60 sequential calls and then 64 concurrent ones go over at most 2
/// connections (the concurrent ones multiplexed as streams, not a connection each), with one
/// full TLS handshake (a second connection resumes its session); every call's effect happens
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 and hypercorn in SHAREDOS_PYTHON: bash .ci/run installs them and runs this"]
async fn http2_is_spoken_where_the_server_offers_it() {
    let Some(py) = python() else { return };
    let has = std::process::Command::new(&py)
        .args(["-c", "import hypercorn"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has,
        "{py} has no hypercorn: install PyPI hypercorn==0.18.0 there (bash .ci/run does)"
    );
    for (mode, extra) in [("stateful", None), ("stateless", Some("--stateless"))] {
        let dir = tempfile::tempdir().expect("tmp");
        let (ca, cert, key) = crate::remote::test_pki(dir.path(), "127.0.0.1");
        let mut args = vec![
            "--http2".to_owned(),
            "--tls".to_owned(),
            cert.display().to_string(),
            key.display().to_string(),
        ];
        args.extend(extra.map(str::to_owned));
        let server = Server::start(&py, &dir.path().join("server.log"), &args).await;
        let relay = Relay::start(server.port, None).await;
        let url = format!("https://127.0.0.1:{}/mcp", relay.port);
        let ca_line = format!("ca_file = {}\n", serde_json::to_string(&ca).expect("q"));
        let broker = broker_with(&provider(
            &url,
            &format!("{ca_line}max_connections = {POOL}\n"),
        ))
        .await;
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        sequential(&mut raw, 1, 60).await;
        let burst = concurrent(&broker).await;
        let opened = relay.accepted();
        let full = relay.counts.full.load(Ordering::SeqCst);
        let versions = server.lines("http ");
        eprintln!(
            "http2 {mode}: {} requests, {opened} connections, {full} full handshakes, {} resumed",
            versions.len(),
            relay.counts.resumed.load(Ordering::SeqCst)
        );
        assert!(
            versions.len() >= 124,
            "{mode}: every call a request: {}",
            versions.len()
        );
        assert!(
            versions.iter().all(|v| v.starts_with("http 2 ")),
            "{mode}: a request not over HTTP/2: {:?}",
            versions.iter().find(|v| !v.starts_with("http 2 "))
        );
        assert!(opened <= 2, "{mode}: {opened} connections for 124 calls");
        let resumed = relay.counts.resumed.load(Ordering::SeqCst);
        assert_eq!(
            (full, full + resumed),
            (1, opened),
            "{mode}: one full TLS handshake, any other connection a resumed session"
        );
        assert_eq!(server.lines("echo seq").len(), 60, "{mode}");
        each_call_once(&server, &broker, (&turn.turn, 60), &burst, mode);
    }
}

/// npm server-everything in its Streamable HTTP mode: 40 sequential calls open at most 2
/// connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs npm server-everything from .ci/install-mcp-servers: bash .ci/run installs it and runs this"]
async fn server_everything_connections_are_reused() {
    let Some(s) = crate::upstream::servers() else {
        return;
    };
    let (_server, port) = crate::remote::everything_http(&s).await;
    let relay = Relay::start(port, None).await;
    let broker = broker_with(&format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = \"http://127.0.0.1:{}/mcp\"\ncall_timeout_seconds = 3\n",
        relay.port
    ))
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = raw.call(1, "r.echo", json!({"message": "warm"})).await;
    assert_eq!(text(&r["result"]), "Echo: warm", "{r}");
    let before = relay.accepted();
    for id in 2..42 {
        let r = raw
            .call(id, "r.echo", json!({"message": id.to_string()}))
            .await;
        assert_eq!(text(&r["result"]), format!("Echo: {id}"), "{r}");
    }
    let opened = relay.accepted() - before;
    assert!(
        opened <= 2,
        "40 sequential calls opened {opened} connections"
    );
}

/// A hostile server whose answer to a call is an SSE stream that never ends (the result, then a
/// comment every 200 ms, forever): each call is answered as soon as its result arrives, the
/// broker reads on for at most its drain limit (2 s) and then closes that connection rather than
/// keeping it (the server sees every such stream closed), the connections fall back to none
/// open, and a call after that opens a new one and succeeds. Each call's effect happens once.
/// (A stream being drained keeps its place among `max_connections` until it is closed: its
/// connection is still open, so the fifth call here waits for the first drain to end.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_stream_that_never_ends_is_closed_after_the_drain_limit() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("endless.log");
    let (_server, port) = hostile(&py, "endless", &log).await;
    let relay = Relay::start(port, None).await;
    let url = format!("http://127.0.0.1:{}/mcp", relay.port);
    let broker = broker_with(&format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = \"{url}\"\ncall_timeout_seconds = 3\nmax_connections = {POOL}\n"
    ))
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let lines = |prefix: &str| {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(prefix))
            .count()
    };
    sequential(&mut raw, 1, 5).await;
    assert_eq!(lines("CALL seq"), 5, "each call once at the server");
    // Every endless stream closed by the broker, and no connection left open (the one that
    // carried `initialize` closes on the pool's idle limit, 4 s).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while (lines("CLOSED") < 5 || relay.open() > 0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lines("CLOSED"), 5, "the broker closed each endless stream");
    assert_eq!(relay.open(), 0, "no connection left open");
    let opened = relay.accepted();
    sequential(&mut raw, 6, 1).await;
    assert_eq!(
        relay.accepted(),
        opened + 1,
        "the next call opened one connection"
    );
    assert_eq!(lines("CALL seq"), 6);
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 6);
    assert!(
        calls.iter().all(|c| c["outcome"] == "succeeded"),
        "{calls:?}"
    );
}

/// A call on a kept connection to a server that writes its answer in several small writes
/// with Nagle's algorithm on (the test server's uvicorn, handed a socket made with protocol 0,
/// sets no `TCP_NODELAY`; the relay in front of the stateful SSE `MCPServer` writes the same way)
/// does not wait for a delayed ACK:
/// the broker acknowledges each read at once (`TCP_QUICKACK`), where a kernel's delayed ACK on
/// a connection past its start holds the server's next write for up to 40 ms. 30 sequential
/// calls on one kept connection: the median well under 40 ms, and at most 2 connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn calls_on_a_kept_connection_do_not_wait_for_a_delayed_ack() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let server = Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let relay = Relay::start(server.port, None).await;
    let url = format!("http://127.0.0.1:{}/mcp", relay.port);
    let broker = broker_with(&provider(&url, "")).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    // Warm: the connection past its start (a new one acknowledges at once anyway).
    sequential(&mut raw, 1, 5).await;
    let before = relay.accepted();
    let mut took = Vec::new();
    for id in 10..40 {
        let started = std::time::Instant::now();
        sequential(&mut raw, id, 1).await;
        took.push(started.elapsed());
    }
    let opened = relay.accepted() - before;
    took.sort();
    let median = took[took.len() / 2];
    eprintln!("30 calls on a kept connection: median {median:?}, {opened} connections opened");
    assert!(
        opened <= 2,
        "30 sequential calls opened {opened} connections"
    );
    assert!(
        median < Duration::from_millis(20),
        "median per call {median:?}: a delayed ACK stalls the server's answer ({took:?})"
    );
    assert_eq!(server.lines("echo seq").len(), 35);
}
