//! The single call path through real processes: catalogue, outcomes on the wire, the record.

use serde_json::{Value, json};

use crate::kit::{Options, Raw, TestBroker, meta, text};

fn names(tools: &[rmcp::model::Tool]) -> Vec<String> {
    tools.iter().map(|t| t.name.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_on_the_wire_and_in_the_record() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let client = broker.client(turn.token.expose()).await;
    let tools = client.list_all_tools().await.expect("tools/list");
    assert_eq!(names(&tools), ["files.list", "files.read", "files.search"]);

    // (tool, arguments, outcome, code, resource)
    let cases: Vec<(&str, Value, &str, &str, Option<&str>)> = vec![
        (
            "files.read",
            json!({"path": "/public/hello.txt"}),
            "succeeded",
            "ok",
            Some("/public/hello.txt"),
        ),
        (
            "files.read",
            json!({"path": "/private/secret.txt"}),
            "denied",
            "no_permit",
            Some("/private/secret.txt"),
        ),
        (
            "files.read",
            json!({"path": "/public/../private/secret.txt"}),
            "denied",
            "no_permit",
            Some("/private/secret.txt"),
        ),
        (
            "files.read",
            json!({"path": "//public/./hello.txt"}),
            "succeeded",
            "ok",
            Some("/public/hello.txt"),
        ),
        (
            "files.read",
            json!({"path": "/../etc/passwd"}),
            "denied",
            "unresolvable_requirement",
            None,
        ),
        (
            "files.read",
            json!({"path": "/public/nope.txt"}),
            "failed",
            "not_found",
            Some("/public/nope.txt"),
        ),
        (
            "files.read",
            json!({"path": 5}),
            "failed",
            "invalid_arguments",
            None,
        ),
        ("files.read", json!({}), "failed", "invalid_arguments", None),
        (
            "files.write",
            json!({"path": "/public/x", "content": "x"}),
            "denied",
            "unpublished_tool",
            None,
        ),
        (
            "files.delete",
            json!({"path": "/public/hello.txt"}),
            "denied",
            "unpublished_tool",
            None,
        ),
        (
            "files read",
            json!({"path": "/public/hello.txt"}),
            "denied",
            "malformed_tool_name",
            None,
        ),
        ("", json!({}), "denied", "malformed_tool_name", None),
        (
            "files.list",
            json!({"path": "/public"}),
            "succeeded",
            "ok",
            Some("/public"),
        ),
        (
            "files.list",
            json!({"path": "/"}),
            "denied",
            "no_permit",
            Some("/"),
        ),
    ];
    for (tool, args, outcome, code, resource) in &cases {
        let Value::Object(args) = args.clone() else {
            unreachable!()
        };
        let result = client
            .call_tool(
                rmcp::model::CallToolRequestParams::new(tool.to_string()).with_arguments(args),
            )
            .await
            .unwrap_or_else(|e| {
                panic!("{tool}: a refusal must be a result, not a JSON-RPC error: {e}")
            });
        let result = serde_json::to_value(&result).expect("result json");
        let m = meta(&result);
        assert_eq!(m["outcome"], *outcome, "{tool} {result}");
        assert_eq!(m["code"], *code, "{tool} {result}");
        assert_eq!(m["tool"], *tool);
        assert_eq!(
            result["isError"],
            json!(*outcome != "succeeded"),
            "{tool} {result}"
        );
        if *outcome != "succeeded" {
            assert!(
                text(&result).starts_with(&format!("{outcome}:")),
                "{}",
                text(&result)
            );
        }
        if let Some(r) = resource {
            assert_eq!(m["resource"], format!("SharedOS::File::{r:?}"));
        }
    }
    let read = client
        .call_tool(
            rmcp::model::CallToolRequestParams::new("files.read").with_arguments(
                json!({"path": "/public/hello.txt"})
                    .as_object()
                    .cloned()
                    .expect("obj"),
            ),
        )
        .await
        .expect("read");
    assert_eq!(
        text(&serde_json::to_value(&read).expect("json")),
        "hello, public world\n"
    );
    client.cancel().await.expect("client stops");

    // One record line per attempt, with the raw tool string, before the answer left.
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), cases.len() + 1);
    for ((tool, args, outcome, code, _), line) in cases.iter().zip(&calls) {
        assert_eq!(line["tool"], *tool);
        assert_eq!(line["arguments"], *args);
        assert_eq!(line["outcome"], *outcome);
        assert_eq!(line["code"], *code);
        assert!(
            line["callId"]
                .as_str()
                .is_some_and(|c| c.starts_with(&turn.turn))
        );
        assert!(line["durationUs"].is_u64());
    }
    assert_eq!(calls[0]["policies"], json!(["alice-public"]));
    let all = broker.records();
    let seqs: Vec<u64> = all
        .iter()
        .map(|l| l["seq"].as_u64().expect("seq"))
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    for line in &all {
        assert!(line["at"].as_str().is_some_and(|a| a.ends_with('Z')));
        assert!(line.get("kind").is_some() && line.get("turn").is_some());
    }
    let kinds: Vec<&str> = all.iter().filter_map(|l| l["kind"].as_str()).collect();
    assert!(kinds.contains(&"turn_opened") && kinds.contains(&"bridge_connected"));
    // The bearer token is never recorded.
    let raw = std::fs::read_to_string(broker.record_path()).expect("record");
    assert!(!raw.contains(turn.token.expose()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_returns_only_files_the_principal_may_read() {
    // Also runs the record in batch mode: every call is still recorded before its answer.
    let broker = TestBroker::start(Options {
        record_sync: "batch",
        ..Options::default()
    })
    .await;
    std::fs::write(
        broker.dir.path().join("data/public/notes.txt"),
        "a secret about the world\n",
    )
    .expect("w");
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(
            1,
            "files.search",
            json!({"query": "secret", "path": "/public"}),
        )
        .await;
    let found = text(&r["result"]);
    assert!(found.contains("/public/notes.txt"), "{found}");
    assert!(!found.contains("/private"), "{found}");
    // Searching from the root is a search on `/`, which alice may not do.
    let r = raw
        .call(2, "files.search", json!({"query": "secret"}))
        .await;
    assert_eq!(meta(&r["result"])["code"], "no_permit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_initialize_versions_and_the_rmcp_client() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    for version in ["2025-06-18", "2025-11-25"] {
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        let init = raw.initialize(version).await;
        assert_eq!(init["result"]["protocolVersion"], version);
        assert!(init["result"]["capabilities"]["tools"].is_object());
        raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
            .await;
        let list = raw.response(1).await;
        assert_eq!(list["result"]["tools"].as_array().map(Vec::len), Some(3));
        let r = raw
            .call(2, "files.read", json!({"path": "/private/secret.txt"}))
            .await;
        assert_eq!(r["result"]["isError"], true);
        let mut child = raw.close_stdin().await;
        let status = tokio::time::timeout(crate::kit::WAIT, child.wait())
            .await
            .expect("exit")
            .expect("wait");
        assert_eq!(status.code(), Some(0), "stdin closed: clean exit");
    }
    // rmcp's own client negotiates through initialize (the 2026-07-28 `server/discover`
    // opening is exercised by the Python SDK client in `auto` mode: outside_client.rs).
    let client = broker.client(turn.token.expose()).await;
    let info = client.peer_info().expect("server info");
    let version = serde_json::to_value(&info.protocol_version).expect("json");
    assert_eq!(version, "2025-11-25");
    assert_eq!(client.list_all_tools().await.expect("list").len(), 3);
    client.cancel().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redacted_arguments_are_hashed() {
    let broker = TestBroker::start(Options::default()).await;
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!("redact_arguments = true\n{cfg}"),
    )
    .expect("w");
    let mut broker = broker;
    broker.restart().await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    raw.call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 1);
    assert!(calls[0].get("arguments").is_none());
    assert_eq!(calls[0]["argumentsSha256"].as_str().map(str::len), Some(64));
    assert!(
        !std::fs::read_to_string(broker.record_path())
            .expect("r")
            .contains("hello.txt\"}")
    );
}

/// A client that opens with `server/discover` (2026-07-28, as Claude Code does) and never sends
/// `initialize` is still on record: the first request naming the client in `_meta` announces it,
/// and a `tools/list` announces even one that never names itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_opens_with_server_discover_is_recorded() {
    let broker = TestBroker::start(Options::default()).await;
    let meta = |named: bool| {
        let mut m = json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
        });
        if named {
            m["io.modelcontextprotocol/clientInfo"] =
                json!({"name": "discoverer", "version": "9.1"});
        }
        m
    };
    for (named, want) in [(true, "discoverer"), (false, "")] {
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.send(
            json!({"jsonrpc": "2.0", "id": 1, "method": "server/discover",
                        "params": {"_meta": meta(named)}}),
        )
        .await;
        let discovered = raw.response(1).await;
        assert!(discovered.get("result").is_some(), "{discovered}");
        raw.send(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list",
                        "params": {"_meta": meta(named)}}))
            .await;
        let listed = raw.response(2).await;
        assert_eq!(
            listed["result"]["tools"].as_array().map(Vec::len),
            Some(3),
            "{listed}"
        );
        drop(raw.close_stdin().await);
        let clients_of = || -> Vec<Value> {
            broker
                .records()
                .into_iter()
                .filter(|l| l["kind"] == "bridge_client" && l["turn"] == turn.turn.as_str())
                .collect()
        };
        crate::kit::eventually("bridge_client recorded", || !clients_of().is_empty()).await;
        broker.close_turn(&turn.turn).await;
        let clients = clients_of();
        assert_eq!(
            clients.len(),
            1,
            "exactly one bridge_client line: {clients:#?}"
        );
        assert_eq!(clients[0]["client"]["name"], want);
        assert_eq!(clients[0]["client"]["protocolVersion"], "2026-07-28");
    }
}

/// File names with newlines (`notes.txt\nsalary-2027.xlsx`, `zz\n… 3 more entries not shown`) and
/// one shaped like the footer, listed and searched through a real shim: what the model sees has
/// one line per real entry (plus the listing's one real footer), the odd names quoted with
/// escapes, and no line a name could forge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_with_newlines_show_one_line_per_entry() {
    let broker = TestBroker::start(Options::default()).await;
    let public = broker.dir.path().join("data/public");
    let odd = [
        "notes.txt\nsalary-2027.xlsx",
        "zz\n… 3 more entries not shown",
        "… 2 more entries not shown",
    ];
    std::fs::create_dir_all(public.join("many")).expect("mk");
    for name in odd {
        std::fs::write(public.join(name), "needle\n").expect("w");
        std::fs::write(public.join("many").join(name), "x").expect("w");
    }
    // 1000 more in `many`: a listing of 1003 entries shows 1000 and a footer for 3.
    for i in 0..1000 {
        std::fs::write(public.join(format!("many/f{i:04}")), "x").expect("w");
    }
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let seen = |r: &Value| {
        assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
        text(&r["result"])
    };

    // hello.txt, many/ and the three odd names.
    let listing = seen(&raw.call(1, "files.list", json!({"path": "/public"})).await);
    let lines: Vec<&str> = listing.split('\n').collect();
    println!("/public: {} lines for 5 entries:\n{listing}", lines.len());
    assert_eq!(lines.len(), 5, "{listing}");
    for shown in [
        "hello.txt",
        "many/",
        r#""notes.txt\nsalary-2027.xlsx""#,
        r#""zz\n… 3 more entries not shown""#,
        r#""… 2 more entries not shown""#,
    ] {
        assert!(lines.contains(&shown), "{shown:?} in {listing}");
    }

    let many = seen(
        &raw.call(2, "files.list", json!({"path": "/public/many"}))
            .await,
    );
    let lines: Vec<&str> = many.split('\n').collect();
    let footers: Vec<&&str> = lines.iter().filter(|l| l.starts_with('…')).collect();
    println!(
        "/public/many: {} lines for 1003 entries, footers {footers:?}",
        lines.len()
    );
    assert_eq!(lines.len(), 1001, "1000 entries and the footer");
    assert_eq!(footers, [&"… 3 more entries not shown"]);
    assert_eq!(lines.last(), Some(&"… 3 more entries not shown"));
    assert!(!lines.contains(&"salary-2027.xlsx"));

    // Three hits, one line each.
    let found = seen(
        &raw.call(
            3,
            "files.search",
            json!({"path": "/public", "query": "needle"}),
        )
        .await,
    );
    let lines: Vec<&str> = found.split('\n').collect();
    println!("search: {} lines for 3 hits:\n{found}", lines.len());
    assert_eq!(lines.len(), 3, "{found}");
    for shown in [
        r#""/public/notes.txt\nsalary-2027.xlsx":1: needle"#,
        r#""/public/zz\n… 3 more entries not shown":1: needle"#,
        // A path starts with `/`: a footer-shaped name inside it forges nothing.
        "/public/… 2 more entries not shown:1: needle",
    ] {
        assert!(lines.contains(&shown), "{shown:?} in {found}");
    }
    // A quoted name as shown, unquoted, is the name files.read takes.
    let r = raw
        .call(
            4,
            "files.read",
            json!({"path": "/public/notes.txt\nsalary-2027.xlsx"}),
        )
        .await;
    assert_eq!(text(&r["result"]), "needle\n");
}
