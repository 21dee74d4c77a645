//! Bad input, faults and isolation through real processes (issue 6): malformed JSON-RPC on the
//! shim's stdin, garbage and hostile frames on the broker's sockets, a broker killed mid-call,
//! and many concurrent turns.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sharedos_ipc::{FrameReader, write_frame};
use sharedos_proto::ipc::{
    BridgeEvent, BridgeRequest, PROTOCOL_VERSION, RefusalCode, ShimInfo, TurnToken,
};
use tokio::io::AsyncWriteExt;

use crate::kit::{Options, Raw, TestBroker, eventually, meta};

async fn ping(raw: &mut Raw, id: i64) {
    raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "ping"}))
        .await;
    let pong = raw.recv().await;
    assert_eq!(pong["id"], id, "the shim still serves: {pong}");
    assert!(pong.get("result").is_some(), "{pong}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_rpc_on_stdin_is_answered_and_the_shim_survives() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let cases: Vec<(&str, Vec<u8>, i64)> = vec![
        ("not JSON", b"hello there".to_vec(), -32700),
        (
            "truncated JSON",
            br#"{"jsonrpc":"2.0","id":1,"method":"pi"#.to_vec(),
            -32700,
        ),
        (
            "invalid UTF-8",
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"\xff\xfe\"}".to_vec(),
            -32700,
        ),
        (
            "a batch array",
            br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#.to_vec(),
            -32600,
        ),
        (
            "wrong jsonrpc",
            br#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#.to_vec(),
            -32600,
        ),
        (
            "a non-string method",
            br#"{"jsonrpc":"2.0","id":1,"method":42}"#.to_vec(),
            -32600,
        ),
        (
            "an object id",
            br#"{"jsonrpc":"2.0","id":{"x":1},"method":"ping"}"#.to_vec(),
            -32600,
        ),
        (
            "string params",
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":"all"}"#.to_vec(),
            -32602,
        ),
        (
            "an unknown method",
            br#"{"jsonrpc":"2.0","id":1,"method":"no/such/method"}"#.to_vec(),
            -32601,
        ),
    ];
    for (i, (what, line, code)) in cases.iter().enumerate() {
        raw.send_raw(line).await;
        let answer = raw.recv().await;
        assert_eq!(answer["error"]["code"], *code, "{what}: {answer}");
        ping(&mut raw, 1000 + i as i64).await;
    }
    // A response sent to the server is ignored (JSON-RPC never answers a response).
    raw.send(json!({"jsonrpc": "2.0", "id": 99, "result": {}}))
        .await;
    ping(&mut raw, 2000).await;
    // A call on a line over the limit is never buffered whole, but it is still an attempt:
    // refused without its arguments and recorded; the next line is read normally.
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{{"name":"files.read","arguments":{{"path":"{}"}}}}}}"#,
        "a".repeat(5 << 20)
    );
    raw.send_raw(big.as_bytes()).await;
    let answer = raw.recv().await;
    assert_eq!(
        meta(&answer["result"])["code"],
        "invalid_arguments",
        "{}",
        answer.to_string().chars().take(200).collect::<String>()
    );
    ping(&mut raw, 2001).await;
    // A 1 MiB argument is a call like any other: it reaches the kernel, is refused, and recorded.
    let r = raw
        .call(
            6,
            "files.read",
            json!({"path": format!("/public/{}", "b".repeat(1 << 20))}),
        )
        .await;
    assert_eq!(
        meta(&r["result"])["outcome"],
        "denied",
        "{}",
        r.to_string().chars().take(300).collect::<String>()
    );
    ping(&mut raw, 2002).await;
    assert_eq!(broker.calls_of(&turn.turn).len(), 2);
}

/// A `tools/call` rmcp cannot parse (no name, a name that is not a string, arguments that are
/// not an object) is still an attempt: the kernel refuses it as an MCP result and records it.
/// One sent as a notification (no id) is decided and recorded too, and never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_with_a_malformed_name_or_arguments_reach_the_kernel_and_the_record() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let cases: [(&[u8], &str, &str, &str); 4] = [
        (
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}"#,
            "",
            "denied",
            "malformed_tool_name",
        ),
        (
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":5}}"#,
            // A number's text is a well-formed name that no turn publishes.
            "5",
            "denied",
            "unpublished_tool",
        ),
        (
            br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":["files.read"],"arguments":{"path":"/public/hello.txt"}}}"#,
            r#"["files.read"]"#,
            "denied",
            "malformed_tool_name",
        ),
        (
            br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"files.read","arguments":["/public/hello.txt"]}}"#,
            "files.read",
            "failed",
            "invalid_arguments",
        ),
    ];
    for (i, (line, tool, outcome, code)) in cases.iter().enumerate() {
        let id = i as i64 + 1;
        raw.send_raw(line).await;
        let answer = raw.response(id).await;
        let result = &answer["result"];
        assert_eq!(result["isError"], true, "{answer}");
        assert_eq!(meta(result)["outcome"], *outcome, "{answer}");
        assert_eq!(meta(result)["code"], *code, "{answer}");
        let calls = broker.calls_of(&turn.turn);
        assert_eq!(calls.len(), i + 1, "one record line per attempt: {calls:?}");
        let line = &calls[i];
        assert_eq!(line["tool"], *tool, "{line}");
        assert_eq!(line["outcome"], *outcome, "{line}");
        assert_eq!(line["code"], *code, "{line}");
        assert_eq!(line["requestId"], id.to_string(), "{line}");
        ping(&mut raw, 100 + id).await;
    }
    // Sent as notifications (no id): decided and recorded like any call, never answered.
    for path in ["/private/secret.txt", "/public/hello.txt"] {
        raw.send(json!({"jsonrpc": "2.0", "method": "tools/call",
            "params": {"name": "files.read", "arguments": {"path": path}}}))
            .await;
    }
    ping(&mut raw, 200).await;
    eventually("both notification calls are recorded", || {
        broker.calls_of(&turn.turn).len() == cases.len() + 2
    })
    .await;
    let calls = broker.calls_of(&turn.turn);
    let outcomes: Vec<_> = calls[cases.len()..]
        .iter()
        .map(|l| {
            assert!(l["requestId"].is_null(), "{l}");
            (
                l["outcome"].as_str().unwrap_or_default().to_owned(),
                l["code"].clone(),
            )
        })
        .collect();
    assert!(
        outcomes.contains(&("denied".into(), json!("no_permit"))),
        "{outcomes:?}"
    );
    assert!(
        outcomes.contains(&("succeeded".into(), json!("ok"))),
        "{outcomes:?}"
    );
    // Nothing was answered for them: the next line on stdout answers the next request.
    ping(&mut raw, 201).await;
}

/// A referred call's answer has the wire shape rmcp gives every other result for the protocol
/// version the client negotiated (`resultType` only from 2026-07-28 on, which `initialize` does
/// not reach: the newest it settles on is 2025-11-25).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn referred_answers_have_the_negotiated_wire_shape() {
    let broker = TestBroker::start(Options::default()).await;
    for version in ["2025-06-18", "2025-11-25"] {
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        let init = raw.initialize(version).await;
        assert_eq!(init["result"]["protocolVersion"], version, "{init}");
        let ordinary = raw.call(1, "no.such.tool", json!({})).await;
        raw.send_raw(br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":7}}"#)
            .await;
        let referred = raw.response(2).await;
        let keys = |v: &Value| {
            let mut k: Vec<String> = v["result"]
                .as_object()
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default();
            k.sort();
            k
        };
        assert_eq!(
            keys(&referred),
            keys(&ordinary),
            "{version}: {referred} vs {ordinary}"
        );
        assert!(
            referred["result"].get("resultType").is_none(),
            "{version}: {referred}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_argument_values_are_refused_cleanly() {
    let broker = TestBroker::start(Options::default()).await;
    let link = broker.dir.path().join("data/public/escape");
    std::os::unix::fs::symlink("/etc/passwd", &link).expect("ln");
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let mut nested = json!("x");
    for _ in 0..100 {
        nested = json!({"a": nested});
    }
    let cases = [
        (json!({"path": ["/public/hello.txt"]}), "invalid_arguments"),
        (
            json!({"path": "/public/hello.txt", "extra": 1}),
            "invalid_arguments",
        ),
        (json!({"path": nested}), "invalid_arguments"),
        (
            json!({"path": "/public/a\u{0}b"}),
            "unresolvable_requirement",
        ),
        (
            json!({"path": "/public/../../etc/passwd"}),
            "unresolvable_requirement",
        ),
        (
            json!({"path": "//public//..//private//secret.txt"}),
            "no_permit",
        ),
        (
            json!({"path": "/public/escape"}),
            "unresolvable_requirement",
        ),
        (
            json!({"path": "public/hello.txt"}),
            "unresolvable_requirement",
        ),
    ];
    for (i, (args, code)) in cases.iter().enumerate() {
        let r = raw.call(i as i64 + 1, "files.read", args.clone()).await;
        assert_eq!(meta(&r["result"])["code"], *code, "{args}: {r}");
    }
    // Nesting past the one limit (sharedos_proto::nesting), even past what the JSON parser
    // accepts: the call is still an attempt, refused without its arguments and recorded, and the
    // shim goes on.
    let mut deep = json!("x");
    for _ in 0..200 {
        deep = json!({"a": deep});
    }
    raw.send_raw(
        format!(
            r#"{{"jsonrpc":"2.0","id":50,"method":"tools/call","params":{{"name":"files.read","arguments":{{"path":{deep}}}}}}}"#
        )
        .as_bytes(),
    )
    .await;
    let r = raw.response(50).await;
    assert_eq!(meta(&r["result"])["code"], "invalid_arguments", "{r}");
    ping(&mut raw, 51).await;
    assert_eq!(broker.calls_of(&turn.turn).len(), cases.len() + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_on_the_bridge_socket_get_nothing_and_the_broker_keeps_serving() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    // Garbage.
    let mut s = sharedos_ipc::connect(&broker.bridge())
        .await
        .expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.expect("write");
    drop(s);
    // A frame claiming 4 GiB: refused from the header, nothing allocated.
    let mut s = sharedos_ipc::connect(&broker.bridge())
        .await
        .expect("connect");
    s.write_all(&[0xff, 0xff, 0xff, 0xff, b'{'])
        .await
        .expect("write");
    let (r, _w) = tokio::io::split(s);
    let answer = tokio::time::timeout(crate::kit::WAIT, FrameReader::new(r).next::<BridgeEvent>())
        .await
        .expect("answer in time");
    assert!(
        matches!(
            answer,
            Ok(BridgeEvent::Refused {
                code: RefusalCode::NotHello,
                ..
            })
        ),
        "{answer:?}"
    );
    // A valid hello with a wrong token, and one with the wrong protocol version.
    for (protocol, token, code) in [
        (
            PROTOCOL_VERSION,
            "not-a-token".to_owned(),
            RefusalCode::BadToken,
        ),
        (
            99,
            turn.token.expose().to_owned(),
            RefusalCode::ProtocolVersion,
        ),
    ] {
        let s = sharedos_ipc::connect(&broker.bridge())
            .await
            .expect("connect");
        let (r, mut w) = tokio::io::split(s);
        write_frame(
            &mut w,
            &BridgeRequest::Hello {
                protocol,
                token: TurnToken::new(token),
                client: ShimInfo::default(),
            },
        )
        .await
        .expect("hello");
        let answer = FrameReader::new(r)
            .next::<BridgeEvent>()
            .await
            .expect("answer");
        match answer {
            BridgeEvent::Refused { code: c, message } => {
                assert_eq!(c, code);
                assert!(!message.contains(turn.token.expose()));
            }
            other => panic!("{other:?}"),
        }
    }
    // A client that connects and never says hello, and one that never reads: the broker still
    // serves everyone else.
    let _silent = sharedos_ipc::connect(&broker.bridge())
        .await
        .expect("connect");
    let slow = sharedos_ipc::connect(&broker.bridge())
        .await
        .expect("connect");
    let (_slow_r, mut slow_w) = tokio::io::split(slow);
    write_frame(
        &mut slow_w,
        &BridgeRequest::Hello {
            protocol: PROTOCOL_VERSION,
            token: turn.token.clone(),
            client: ShimInfo::default(),
        },
    )
    .await
    .expect("hello");
    for id in 0..2000u64 {
        let call = sharedos_proto::ToolCall {
            tool: "files.read".into(),
            arguments: Some(json!({"path": "/public/hello.txt"})),
            request_id: None,
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        };
        if tokio::time::timeout(
            Duration::from_millis(200),
            write_frame(&mut slow_w, &BridgeRequest::Call { id, call }),
        )
        .await
        .is_err()
        {
            break; // backpressure: the broker stopped reading a client that does not read
        }
    }
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_mid_call_leaves_no_hang_and_a_continuing_record() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = crate::kit::write_config(
        dir.path(),
        &Options {
            latency_ms: Some(5_000),
            ..Options::default()
        },
    );
    let run_dir = dir.path().join("run");
    let serve = || {
        let mut c = tokio::process::Command::new(crate::kit::bin("sharedos-broker"));
        c.args(["serve", "--runtime-dir"])
            .arg(&run_dir)
            .arg("--config")
            .arg(&cfg)
            .kill_on_drop(true)
            .stderr(std::process::Stdio::null());
        c
    };
    let mut broker = serve().spawn().expect("serve");
    eventually("broker up", || run_dir.join("bridge.sock").exists()).await;
    let mut open = std::process::Command::new(crate::kit::bin("sharedos-broker"));
    open.args([
        "turn",
        "open",
        "--principal",
        "alice",
        "--json",
        "--runtime-dir",
    ])
    .arg(&run_dir);
    let (_, out, _) = crate::kit::run(open).await;
    let token = serde_json::from_str::<Value>(&out).expect("json")["token"]
        .as_str()
        .expect("token")
        .to_owned();
    let mut shim = tokio::process::Command::new(crate::kit::bin("sharedos-mcp-shim"));
    shim.env("SHAREDOS_TURN_TOKEN", &token)
        .env("SHAREDOS_BROKER", run_dir.join("bridge.sock"))
        .kill_on_drop(true);
    let mut raw = Raw::spawn(shim);
    raw.initialize("2025-06-18").await;
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "files.read", "arguments": {"path": "/public/hello.txt"}}})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    broker.start_kill().expect("kill -9");
    let _ = broker.wait().await;
    let r = raw.response(1).await;
    assert_eq!(r["result"]["isError"], true, "{r}");
    assert_eq!(meta(&r["result"])["code"], "broker_unavailable");
    assert_eq!(raw.exit_code().await, Some(3), "the shim exits");
    assert!(started.elapsed() < Duration::from_secs(5), "no hang");
    let before: Vec<Value> = std::fs::read_to_string(dir.path().join("record.jsonl"))
        .expect("record")
        .lines()
        .map(|l| serde_json::from_str(l).expect("whole lines"))
        .collect();
    // A new broker on the same record continues seq (its first line is broker_started).
    let mut again = serve().spawn().expect("serve again");
    let record = dir.path().join("record.jsonl");
    let n = before.len();
    eventually("the new broker records its start", || {
        std::fs::read_to_string(&record)
            .map(|t| t.lines().count() > n)
            .unwrap_or(false)
    })
    .await;
    let after: Vec<Value> = std::fs::read_to_string(&record)
        .expect("record")
        .lines()
        .map(|l| serde_json::from_str(l).expect("whole lines"))
        .collect();
    assert_eq!(after[n]["kind"], "broker_started");
    assert_eq!(
        after[n]["seq"].as_u64(),
        before.last().and_then(|l| l["seq"].as_u64()).map(|s| s + 1)
    );
    again.start_kill().expect("kill");
    let _ = again.wait().await;
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// 64 concurrent turns for different principals, each with its own shim, 200 calls each mixing
/// allowed and denied: every answer matches the policy and every record line its turn. Prints
/// calls/s and peak RSS (figures, not assertions on speed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_turns_stay_isolated() {
    let mut policy = String::new();
    for i in 0..64 {
        policy.push_str(&format!(
            "@id(\"u{i}\") permit(principal == SharedOS::User::\"user{i}\", action == SharedOS::Action::\"read\", resource is SharedOS::File) when {{ resource.path == \"/public/u{i}.txt\" }};\n"
        ));
    }
    let policy: &'static str = Box::leak(policy.into_boxed_str());
    let broker = TestBroker::start(Options {
        policy,
        record_sync: "always",
        ..Options::default()
    })
    .await;
    for i in 0..64 {
        std::fs::write(
            broker.dir.path().join(format!("data/public/u{i}.txt")),
            format!("file of user{i}\n"),
        )
        .expect("w");
    }
    let mut turns = Vec::new();
    for i in 0..64 {
        turns.push((i, broker.open_turn(&format!("user{i}")).await));
    }
    let hashes: std::collections::HashSet<_> =
        turns.iter().map(|(_, t)| t.catalog_hash.clone()).collect();
    assert_eq!(hashes.len(), 1, "same tool set (read only), so one hash");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, turn) in turns.clone() {
        let cmd = broker.shim_command(turn.token.expose());
        tasks.push(tokio::spawn(async move {
            let mut raw = Raw::spawn(cmd);
            raw.initialize("2025-06-18").await;
            for n in 0..200i64 {
                // Own file: allowed. Someone else's: denied.
                let other = (i + 1 + (n as usize % 63)) % 64;
                let (path, expect) = if n % 2 == 0 {
                    (format!("/public/u{i}.txt"), "succeeded")
                } else {
                    (format!("/public/u{other}.txt"), "denied")
                };
                let r = raw.call(n, "files.read", json!({"path": path})).await;
                assert_eq!(
                    meta(&r["result"])["outcome"],
                    expect,
                    "user{i} call {n}: {r}"
                );
                if expect == "succeeded" {
                    assert_eq!(
                        r["result"]["content"][0]["text"],
                        format!("file of user{i}\n")
                    );
                }
            }
            raw.child.id().map_or(0, |pid| rss_kib(pid, "VmRSS:"))
        }));
    }
    let mut shim_rss = Vec::new();
    for t in tasks {
        shim_rss.push(t.await.expect("turn task"));
    }
    let elapsed = started.elapsed();
    let calls = 64 * 200;
    let me = std::process::id();
    println!(
        "load: {calls} calls over 64 turns in {:.2} s = {:.0} calls/s (record_sync always, debug build, 64 shims and the broker on 2 cores); peak RSS of this test process (broker in-process + test harness) {} KiB; shim RSS max {} KiB",
        elapsed.as_secs_f64(),
        calls as f64 / elapsed.as_secs_f64(),
        rss_kib(me, "VmHWM:"),
        shim_rss.iter().max().copied().unwrap_or(0),
    );
    for (i, turn) in &turns {
        let lines = broker.calls_of(&turn.turn);
        assert_eq!(lines.len(), 200, "user{i}");
        for l in &lines {
            let p = l["arguments"]["path"].as_str().expect("path");
            assert_eq!(
                l["outcome"] == "succeeded",
                p == format!("/public/u{i}.txt"),
                "{l}"
            );
        }
    }
}
