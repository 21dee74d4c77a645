//! What a token holder sends cannot grow the record by its size, nor break the host's own views
//! (issue 31, items 6 and 7). A raw client on `bridge.sock` (no shim, so no shim limit helps),
//! a real broker, and the real CLI binary reading what it recorded.

use serde_json::{Value, json};
use sharedos_ipc::{FrameReader, write_frame};
use sharedos_proto::ToolCall;
use sharedos_proto::ipc::{BridgeEvent, BridgeRequest};
use sharedos_proto::record::RECORD_MAX_STRING_BYTES;

use crate::kit::{Options, TestBroker, WAIT, eventually, run};

/// What one frame may add to the record (besides arguments, which have their own bound).
const GROWTH_BOUND: u64 = 8 * 1024;
const MIB: usize = 1024 * 1024;

fn call(id: u64, tool: &str, arguments: Value, request_id: Option<String>) -> BridgeRequest {
    BridgeRequest::Call {
        id,
        call: ToolCall {
            tool: tool.into(),
            arguments: Some(arguments),
            request_id,
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        },
    }
}

/// The answer to frame `id` (other events, such as `waiting`, are skipped).
async fn answer_code(
    reader: &mut FrameReader<impl tokio::io::AsyncRead + Unpin>,
    id: u64,
) -> String {
    loop {
        let event = tokio::time::timeout(WAIT, reader.next::<BridgeEvent>())
            .await
            .expect("answered in time")
            .expect("answer");
        if let BridgeEvent::Answer { id: got, answer } = event {
            assert_eq!(got, id);
            return format!("{}/{}", answer.outcome.word(), answer.outcome.code());
        }
    }
}

fn record_bytes(b: &TestBroker) -> u64 {
    std::fs::metadata(b.record_path()).expect("record").len()
}

fn sha256(bytes: &[u8]) -> String {
    sharedos_proto::catalog::sha256_hex(bytes)
}

/// Three calls with a 7 MiB tool name, one with a 7 MiB request id, three `client_info` frames
/// with a 7 MiB name: each grows the record by less than 8 KiB (the same client twice more within
/// the interval gets no line until the bridge ends, then one that counts them), and each cut
/// string is on record with its whole size and SHA-256.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_token_holder_sends_grows_the_record_by_a_bound() {
    let b = TestBroker::start(Options::default()).await;
    let turn = b.open_turn("alice").await;
    let (mut reader, mut w) = crate::kit::raw_bridge(&b.bridge(), turn.token.expose()).await;
    let huge = "a".repeat(7 * MIB);
    let mut growth = Vec::new();
    for id in 1..=3u64 {
        let before = record_bytes(&b);
        write_frame(&mut w, &call(id, &huge, json!({}), None))
            .await
            .expect("call");
        assert_eq!(
            answer_code(&mut reader, id).await,
            "denied/malformed_tool_name"
        );
        growth.push(("7 MiB tool name", record_bytes(&b) - before));
    }
    let before = record_bytes(&b);
    write_frame(
        &mut w,
        &call(
            4,
            "files.read",
            json!({"path": "/public/hello.txt"}),
            Some(huge.clone()),
        ),
    )
    .await
    .expect("call");
    assert_eq!(answer_code(&mut reader, 4).await, "succeeded/ok");
    growth.push(("7 MiB requestId", record_bytes(&b) - before));
    let clients = |b: &TestBroker| {
        b.records()
            .iter()
            .filter(|l| l["kind"] == "bridge_client")
            .count()
    };
    for n in 1..=3usize {
        let before = record_bytes(&b);
        write_frame(
            &mut w,
            &BridgeRequest::ClientInfo {
                name: huge.clone(),
                version: "1.0".into(),
                protocol_version: Some("p".repeat(64 * 1024)),
                capabilities: None,
            },
        )
        .await
        .expect("client info");
        if n == 1 {
            eventually("bridge_client recorded", || clients(&b) == 1).await;
        } else {
            // The same client again within the interval: held for the bridge's next line.
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            assert_eq!(
                clients(&b),
                1,
                "frame {n} of the same client got a line of its own"
            );
        }
        growth.push(("client_info, 7 MiB name", record_bytes(&b) - before));
    }
    // The bridge's end writes the held frames as one line, counting what it stands for.
    let before = record_bytes(&b);
    drop(w);
    drop(reader);
    eventually("held bridge_client recorded at close", || clients(&b) == 2).await;
    growth.push(("the held client_info frames", record_bytes(&b) - before));
    eprintln!("record growth per frame (bytes): {growth:?}");
    for (what, bytes) in &growth {
        assert!(
            *bytes < GROWTH_BOUND,
            "{what}: the record grew {bytes} bytes"
        );
    }
    let whole = json!({"bytes": huge.len(), "sha256": sha256(huge.as_bytes())});
    let lines = b.records();
    let calls: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "call").collect();
    assert_eq!(calls.len(), 4);
    for c in &calls[..3] {
        assert_eq!(c["cut"]["tool"], whole, "{c}");
        let kept = c["tool"].as_str().expect("tool");
        assert!(kept.len() <= RECORD_MAX_STRING_BYTES && kept.ends_with('…'));
    }
    assert_eq!(calls[3]["tool"], "files.read");
    assert_eq!(calls[3]["cut"]["requestId"], whole, "{}", calls[3]);
    let infos: Vec<&Value> = lines
        .iter()
        .filter(|l| l["kind"] == "bridge_client")
        .collect();
    assert_eq!(infos.len(), 2);
    assert!(
        infos[0].get("suppressed").is_none_or(Value::is_null),
        "{}",
        infos[0]
    );
    assert_eq!(infos[1]["suppressed"], 1, "{}", infos[1]);
    for i in &infos {
        assert_eq!(i["cut"]["client.name"], whole, "{i}");
        assert_eq!(
            i["cut"]["client.protocolVersion"]["bytes"],
            64 * 1024,
            "{i}"
        );
        assert_eq!(i["client"]["version"], "1.0");
        assert!(i["cut"].get("client.version").is_none());
    }
    b.close_turn(&turn.turn).await;
}

/// A policy where writes to /public wait for a person.
const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-write-ask")
@approval("required")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"write",
       resource is SharedOS::File)
when { resource.path like "/public/*" };
"#;

/// Runs the CLI against `b` with `args`; returns its stdout, after checking it exited 0.
async fn cli(b: &TestBroker, args: &[&str]) -> String {
    let mut cmd = b.cli();
    cmd.args(args);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "sharedos-broker {args:?}: {err}");
    out
}

/// A record holding what a config allows (arguments kept whole up to 16 MiB: lines of 3 MiB, and
/// of 4.5 MiB, past what one page carries), arguments nested 125 deep from a raw client, and two
/// calls waiting for approval with 4.5 MiB of content beside a small one: `records`,
/// `records --json`, `records --turn`, `approvals` and `approvals --json` (the real CLI) all
/// answer and show the rest; `approvals show ID` prints the whole arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_holder_cannot_break_the_hosts_views() {
    let b = TestBroker::start(Options {
        policy: POLICY,
        top: "record_max_argument_bytes = 16777216\napproval_timeout_seconds = 900\n".into(),
        ..Options::default()
    })
    .await;
    let turn = b.open_turn("alice").await;
    let (mut reader, mut w) = crate::kit::raw_bridge(&b.bridge(), turn.token.expose()).await;
    // Nested 125 deep: the broker refuses it itself, and records it without its arguments.
    let deep: Value =
        serde_json::from_str(&format!("{}{}", "[".repeat(124), "]".repeat(124))).expect("deep");
    write_frame(
        &mut w,
        &call(1, "files.read", json!({ "path": deep }), None),
    )
    .await
    .expect("deep call");
    assert_eq!(
        answer_code(&mut reader, 1).await,
        "failed/invalid_arguments"
    );
    // Three refused calls whose 3 MiB arguments the record keeps whole (as configured).
    for id in 2..=4u64 {
        let args = json!({"path": "/public/hello.txt", "extra": "e".repeat(3 * MIB)});
        write_frame(&mut w, &call(id, "files.read", args, None))
            .await
            .expect("call");
        assert_eq!(
            answer_code(&mut reader, id).await,
            "failed/invalid_arguments"
        );
    }
    // Two writes of 4.5 MiB and a small one, all waiting for a person.
    let big = "c".repeat(9 * MIB / 2);
    let big_args: Vec<Value> = (1..=2)
        .map(|i| json!({"path": format!("/public/big-{i}.txt"), "content": big}))
        .collect();
    for (id, args) in [(5u64, &big_args[0]), (6, &big_args[1])] {
        write_frame(&mut w, &call(id, "files.write", args.clone(), None))
            .await
            .expect("write");
    }
    let small = json!({"path": "/public/small.txt", "content": "small"});
    write_frame(&mut w, &call(7, "files.write", small.clone(), None))
        .await
        .expect("write");
    let waiting = || {
        std::fs::read_to_string(b.record_path())
            .unwrap_or_default()
            .matches(r#""kind":"approval_requested""#)
            .count()
    };
    eventually("three calls waiting", || waiting() == 3).await;
    let record_size = record_bytes(&b);
    let file_lines: Vec<String> = std::fs::read_to_string(b.record_path())
        .expect("record")
        .lines()
        .map(str::to_owned)
        .collect();
    eprintln!(
        "record: {record_size} bytes, {} lines, longest {} bytes",
        file_lines.len(),
        file_lines.iter().map(String::len).max().unwrap_or(0)
    );
    assert!(record_size > 16 * MIB as u64, "{record_size}");
    let deep_line: Value = file_lines
        .iter()
        .find(|l| l.contains("nested 125 levels"))
        .map(|l| serde_json::from_str(l).expect("record line"))
        .expect("the deep call's line");
    assert_eq!(deep_line["code"], "invalid_arguments", "{deep_line}");
    assert_eq!(deep_line["arguments"], Value::Null, "{deep_line}");
    assert!(
        deep_line["message"]
            .as_str()
            .is_some_and(|m| m.contains("nested 125 levels")),
        "{deep_line}"
    );

    // `records --json`: every line of the record, in order; a line longer than a page carries
    // comes as its stand-in, with the line's size and SHA-256.
    let out = cli(&b, &["records", "--json"]).await;
    let shown: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("records --json line"))
        .collect();
    assert!(shown.len() >= file_lines.len(), "{} lines", shown.len());
    let mut stand_ins = 0;
    for (line, text) in shown.iter().zip(&file_lines) {
        let on_file: Value = serde_json::from_str(text).expect("record line");
        assert_eq!(line["seq"], on_file["seq"]);
        if let Some(d) = line.get("lineDigest") {
            stand_ins += 1;
            assert_eq!(d["bytes"], text.len());
            assert_eq!(d["sha256"], sha256(text.as_bytes()));
            assert_eq!(line["kind"], on_file["kind"]);
        } else {
            assert_eq!(line, &on_file);
        }
    }
    eprintln!(
        "records --json: {} lines, {stand_ins} carried as stand-ins",
        shown.len()
    );
    assert_eq!(stand_ins, 2, "the two 4.5 MiB approval_requested lines");
    let small_requested = shown
        .iter()
        .find(|l| l["kind"] == "approval_requested" && l["arguments"] == small)
        .expect("the small call's approval_requested line");
    let small_id = small_requested["approval"].as_str().expect("id").to_owned();

    // `records` and `records --turn T`: every line has its row, the small call's too.
    for args in [
        vec!["records"],
        vec!["records", "--turn", turn.turn.as_str()],
    ] {
        let out = cli(&b, &args).await;
        let rows = out.lines().count();
        eprintln!("{args:?}: {rows} rows, {} bytes", out.len());
        assert!(rows > file_lines.len().min(shown.len()) - 3, "{rows} rows");
        assert!(out.contains(&small_id), "{args:?} shows the small call");
    }

    // `approvals --json`: three entries, each bounded; the whole arguments by id.
    let out = cli(&b, &["approvals", "--json"]).await;
    assert!(out.len() < 64 * 1024, "{} bytes", out.len());
    let listed: Vec<Value> = serde_json::from_str(&out).expect("approvals --json");
    assert_eq!(listed.len(), 3, "{listed:#?}");
    let small_entry = listed
        .iter()
        .find(|a| a["id"] == small_id.as_str())
        .expect("the small call is listed");
    assert_eq!(small_entry["arguments"], small);
    let mut big_ids = Vec::new();
    for a in listed.iter().filter(|a| a["id"] != small_id.as_str()) {
        assert_eq!(a["arguments"], Value::Null, "{a}");
        let text = big_args
            .iter()
            .map(Value::to_string)
            .find(|t| a["argumentsDigest"]["sha256"] == sha256(t.as_bytes()))
            .expect("the digest is of one big call's arguments");
        assert_eq!(a["argumentsDigest"]["bytes"], text.len());
        big_ids.push((a["id"].as_str().expect("id").to_owned(), text));
    }
    assert_eq!(big_ids.len(), 2);
    let out = cli(&b, &["approvals"]).await;
    eprintln!("approvals: {} bytes", out.len());
    assert!(
        out.contains(&small_id) && out.contains("\"small\""),
        "{out}"
    );
    for (id, _) in &big_ids {
        assert!(out.contains(id.as_str()), "{out}");
    }
    let (id, text) = &big_ids[0];
    let out = cli(&b, &["approvals", "show", id]).await;
    assert_eq!(
        out.trim_end(),
        text,
        "approvals show prints the whole arguments"
    );
    eprintln!("approvals show: {} bytes", out.len());

    // The small call can still be decided from what was shown.
    let _ = cli(&b, &["approvals", "approve", &small_id]).await;
    assert_eq!(answer_code(&mut reader, 7).await, "succeeded/ok");
    b.close_turn(&turn.turn).await;
}
