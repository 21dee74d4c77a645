//! Turn lifecycle through real processes: isolation between turns, close, TTL, cancellation,
//! timeouts, restarts, and the shim's start-up errors.

use std::time::Duration;

use serde_json::json;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn};

use crate::kit::{Options, Raw, TestBroker, eventually, meta, text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_principals_see_different_catalogues_and_tokens_do_not_cross() {
    let broker = TestBroker::start(Options::default()).await;
    let (alice, bob) = tokio::join!(broker.open_turn("alice"), broker.open_turn("bob"));
    assert_ne!(alice.catalog_hash, bob.catalog_hash);
    let alice_names: Vec<String> = alice.tools.iter().map(|t| t.name.to_string()).collect();
    let bob_names: Vec<String> = bob.tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(alice_names, ["files.list", "files.read", "files.search"]);
    assert_eq!(bob_names, ["files.read", "files.write"]);
    // The catalogue without a turn agrees with the turn's.
    match broker
        .host()
        .await
        .call(&ControlRequest::Catalog {
            principal: "bob".into(),
            agent: None,
        })
        .await
    {
        Ok(ControlResponse::Catalog { catalog_hash, .. }) => {
            assert_eq!(catalog_hash, bob.catalog_hash)
        }
        other => panic!("{other:?}"),
    }

    let mut a = Raw::spawn(broker.shim_command(alice.token.expose()));
    let mut b = Raw::spawn(broker.shim_command(bob.token.expose()));
    a.initialize("2025-06-18").await;
    b.initialize("2025-11-25").await;
    // Concurrent calls on both turns.
    let (ra, rb) = tokio::join!(
        a.call(1, "files.read", json!({"path": "/private/secret.txt"})),
        b.call(1, "files.read", json!({"path": "/private/secret.txt"})),
    );
    assert_eq!(meta(&ra["result"])["code"], "no_permit");
    assert_eq!(meta(&rb["result"])["outcome"], "succeeded");
    assert_eq!(text(&rb["result"]), "the secret\n");
    let r = a
        .call(
            2,
            "files.write",
            json!({"path": "/public/x", "content": "x"}),
        )
        .await;
    assert_eq!(meta(&r["result"])["code"], "unpublished_tool");
    let r = b
        .call(
            2,
            "files.write",
            json!({"path": "/private/new.txt", "content": "from bob"}),
        )
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    let r = b
        .call(3, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["code"], "no_permit");

    // Each record line belongs to the turn whose shim made the call.
    let a_calls = broker.calls_of(&alice.turn);
    let b_calls = broker.calls_of(&bob.turn);
    assert_eq!(a_calls.len(), 2);
    assert_eq!(b_calls.len(), 3);
    assert!(a_calls.iter().all(|c| {
        c["callId"]
            .as_str()
            .is_some_and(|id| id.starts_with(&alice.turn))
    }));

    // A token that names no turn gets nothing.
    let mut forged = Raw::spawn(broker.shim_command("forged-token-that-names-no-turn"));
    assert_eq!(forged.exit_code().await, Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_turn_ends_its_shim_and_kills_its_token() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    broker.close_turn(&turn.turn).await;
    assert_eq!(
        raw.exit_code().await,
        Some(3),
        "the shim exits when its turn closes"
    );
    // The token is dead: a new shim is refused before serving, with one clear line.
    let out = crate::kit::run({
        let mut c = std::process::Command::new(crate::kit::bin("sharedos-mcp-shim"));
        c.env("SHAREDOS_TURN_TOKEN", turn.token.expose())
            .env("SHAREDOS_BROKER", broker.bridge());
        c
    })
    .await;
    assert_eq!(out.0, 2);
    assert!(out.1.is_empty(), "nothing on stdout: {:?}", out.1);
    assert!(out.2.contains("refused"), "{}", out.2);
    assert!(
        !out.2.contains(turn.token.expose()),
        "the token is never echoed"
    );
    let closed = broker
        .records()
        .into_iter()
        .find(|l| l["kind"] == "turn_closed")
        .expect("turn_closed");
    assert_eq!(closed["reason"], "host");
    match broker.host().await.call(&ControlRequest::ListTurns).await {
        Ok(ControlResponse::Turns { turns }) => assert!(turns.is_empty()),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_of_a_slow_call_is_recorded_as_cancelled() {
    let broker = TestBroker::start(Options {
        latency_ms: Some(5_000),
        ..Options::default()
    })
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.send(json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                    "params": {"name": "files.read", "arguments": {"path": "/public/hello.txt"}}}))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The slow call holds up nothing else: a ping is answered while it runs.
    raw.send(json!({"jsonrpc": "2.0", "id": 6, "method": "ping"}))
        .await;
    assert_eq!(raw.recv().await["id"], 6, "ping answered during the call");
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                    "params": {"requestId": 7, "reason": "test"}}),
    )
    .await;
    let t = turn.turn.clone();
    eventually("the cancelled call is recorded", || {
        !broker.calls_of(&t).is_empty()
    })
    .await;
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls[0]["outcome"], "cancelled");
    assert_eq!(calls[0]["code"], "client_cancelled");
    assert!(
        calls[0]["durationUs"]
            .as_u64()
            .is_some_and(|d| d < 4_000_000)
    );
    // The session goes on, and no answer to the cancelled request arrives.
    raw.send(json!({"jsonrpc": "2.0", "id": 8, "method": "ping"}))
        .await;
    let pong = raw.recv().await;
    assert_eq!(
        pong["id"], 8,
        "no response for the cancelled request: {pong}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_time_limit_fails_with_timeout() {
    let broker = TestBroker::start(Options {
        latency_ms: Some(3_000),
        call_timeout_seconds: Some(1),
        ..Options::default()
    })
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "failed");
    assert_eq!(meta(&r["result"])["code"], "timeout");
    assert!(text(&r["result"]).starts_with("failed: "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_closed_mid_call_answers_the_call_and_records_it() {
    let broker = TestBroker::start(Options {
        latency_ms: Some(10_000),
        ..Options::default()
    })
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.send(json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                    "params": {"name": "files.read", "arguments": {"path": "/public/hello.txt"}}}))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    broker.close_turn(&turn.turn).await;
    let r = raw.response(3).await;
    assert_eq!(r["result"]["isError"], true, "{r}");
    assert_eq!(meta(&r["result"])["outcome"], "cancelled");
    assert_eq!(raw.exit_code().await, Some(3));
    let lines: Vec<_> = broker
        .records()
        .into_iter()
        .filter(|l| l["turn"] == turn.turn.as_str())
        .collect();
    let call = lines
        .iter()
        .position(|l| l["kind"] == "call")
        .expect("call line");
    let closed = lines
        .iter()
        .position(|l| l["kind"] == "turn_closed")
        .expect("closed line");
    assert_eq!(lines[call]["code"], "turn_closed");
    assert!(
        call < closed,
        "the call is recorded before the turn's close"
    );
    // The harness got the broker's answer, the one on record (not the shim's own "the turn
    // closed" for a call it never heard the end of).
    assert_eq!(meta(&r["result"])["callId"], lines[call]["callId"], "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_turn_closes_itself() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker
        .open(OpenTurn {
            principal: "alice".into(),
            ttl_seconds: Some(1),
            ..Default::default()
        })
        .await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    assert_eq!(raw.exit_code().await, Some(3));
    let closed = broker
        .records()
        .into_iter()
        .find(|l| l["kind"] == "turn_closed")
        .expect("closed");
    assert_eq!(closed["reason"], "ttl");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_survives_a_restart_and_seq_continues() {
    let mut broker = TestBroker::start(Options::default()).await;
    let first = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(first.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    broker.restart().await;
    // The old turn did not survive the restart: its shim ends.
    assert_eq!(raw.exit_code().await, Some(3));
    let second = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(second.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.call(1, "files.read", json!({"path": "/private/secret.txt"}))
        .await;
    let all = broker.records();
    let seqs: Vec<u64> = all
        .iter()
        .map(|l| l["seq"].as_u64().expect("seq"))
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert_eq!(
        all.iter().filter(|l| l["kind"] == "broker_started").count(),
        2
    );
    assert_eq!(broker.calls_of(&first.turn).len(), 1);
    assert_eq!(broker.calls_of(&second.turn).len(), 1);
    let closed = all
        .iter()
        .find(|l| l["kind"] == "turn_closed")
        .expect("closed");
    assert_eq!(closed["reason"], "broker_shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shim_refuses_to_start_without_a_usable_broker_or_token() {
    let broker = TestBroker::start(Options::default()).await;
    let shim = || std::process::Command::new(crate::kit::bin("sharedos-mcp-shim"));
    // No token.
    let mut c = shim();
    c.env_remove("SHAREDOS_TURN_TOKEN")
        .env("SHAREDOS_BROKER", broker.bridge());
    let (code, out, err) = crate::kit::run(c).await;
    assert_eq!((code, out.as_str()), (2, ""));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("SHAREDOS_TURN_TOKEN"), "{err}");
    // No broker.
    let mut c = shim();
    c.env("SHAREDOS_TURN_TOKEN", "x")
        .env("SHAREDOS_BROKER", broker.dir.path().join("nope.sock"));
    let (code, out, err) = crate::kit::run(c).await;
    assert_eq!((code, out.as_str()), (2, ""));
    assert!(err.contains("nope.sock"), "{err}");
    // Token from a file.
    let turn = broker.open_turn("alice").await;
    let token_file = broker.dir.path().join("token");
    std::fs::write(&token_file, format!("{}\n", turn.token.expose())).expect("w");
    let mut c = tokio::process::Command::new(crate::kit::bin("sharedos-mcp-shim"));
    c.arg("--turn-token-file")
        .arg(&token_file)
        .arg("--broker")
        .arg(broker.bridge())
        .env_remove("SHAREDOS_TURN_TOKEN")
        .kill_on_drop(true);
    let mut raw = Raw::spawn(c);
    let init = raw.initialize("2025-06-18").await;
    assert_eq!(init["result"]["serverInfo"]["name"], "sharedos-mcp-shim");
}

/// The shim gives its token only to a listener that runs as the broker's uid (`SO_PEERCRED`):
/// with `SHAREDOS_BROKER_UID` naming another uid, the real broker gets no hello (no bridge on
/// record), the harness gets a JSON-RPC error for `initialize` and `tools/list`, and stderr says
/// why; with the broker's own uid named, or none (the socket's folder is this uid's), it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shim_gives_its_token_only_to_the_brokers_uid() {
    use sharedos_ipc::runtime;
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let me = runtime::current_uid();
    let other = if me == 0 { 64199 } else { 0 };
    let mut cmd = broker.shim_command(turn.token.expose());
    cmd.env(runtime::BROKER_UID_ENV, other.to_string());
    let mut raw = Raw::spawn(cmd);
    raw.send(json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}}}))
        .await;
    let init = raw.response(0).await;
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .await;
    let list = raw.response(1).await;
    let says = format!("it runs as uid {me}, not as the broker's uid {other}");
    for r in [&init, &list] {
        assert_eq!(r["error"]["code"], -32001, "{r}");
        let m = r["error"]["message"].as_str().expect("message");
        assert!(m.contains(&says) && m.contains("no token sent"), "{m}");
    }
    let out = tokio::time::timeout(crate::kit::WAIT, raw.close_stdin().await.wait_with_output())
        .await
        .expect("shim exits")
        .expect("wait");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&says), "{stderr}");
    assert!(!stderr.contains(turn.token.expose()));
    let bridges = || {
        broker
            .records()
            .iter()
            .filter(|l| l["kind"] == "bridge_connected")
            .count()
    };
    assert_eq!(bridges(), 0, "the broker heard no hello");

    // The broker's own uid, named or found from the socket's folder: served.
    for named in [Some(me), None] {
        let mut cmd = broker.shim_command(turn.token.expose());
        cmd.env_remove(runtime::BROKER_UID_ENV);
        if let Some(uid) = named {
            cmd.env(runtime::BROKER_UID_ENV, uid.to_string());
        }
        let mut raw = Raw::spawn(cmd);
        raw.initialize("2025-06-18").await;
        let r = raw
            .call(1, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    }
    eventually("both bridges on record", || bridges() == 2).await;
}
