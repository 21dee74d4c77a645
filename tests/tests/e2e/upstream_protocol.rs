//! Issue 46 item 2: the broker speaks 2026-07-28 to the servers that support it (`server/discover`,
//! falling back to `initialize` 2025-11-25), stdio and Streamable HTTP (stateful and stateless),
//! and a server's `input_required` result is put to the person behind the call through the same
//! path a forwarded `elicitation/create` takes (the call's harness), the answers sent back in the
//! call's retry, each round on record. The server is the PyPI `mcp` SDK's `MCPServer`
//! (tests/python/asks_2026.py); the harness is the PyPI `mcp` SDK client
//! (tests/python/elicit_client.py), at 2025-11-25 and at 2026-07-28.

use std::path::Path;

use serde_json::{Value, json};

use crate::elicitation::{harness, report_of};
use crate::kit::{Options, TestBroker};
use crate::remote::{providers, python};

const POLICY: &str = r#"
@id("alice-asks")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "a.*" };
"#;

fn q(s: &str) -> String {
    serde_json::to_string(s).expect("quote")
}

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/asks_2026.py");

/// How the broker reaches `asks_2026.py`.
#[derive(Clone, Copy, Debug)]
enum Transport {
    Stdio,
    Http,
    HttpStateless,
}

/// A running HTTP `asks_2026.py` (its port), kept for the test's length.
struct HttpServer {
    child: tokio::process::Child,
    url: String,
    port: u16,
}

/// `asks_2026.py` over Streamable HTTP on `port` (0: any).
async fn http_server(python: &str, log: &Path, stateless: bool, port: u16) -> HttpServer {
    use tokio::io::AsyncBufReadExt;
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(SCRIPT)
        .arg("--http")
        .arg("--port")
        .arg(port.to_string());
    if stateless {
        cmd.arg("--stateless");
    }
    let mut child = cmd
        .env("ASKS_LOG", log)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python server");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(std::time::Duration::from_secs(30), lines.next_line())
        .await
        .expect("server says its port in time")
        .expect("read")
        .expect("a line");
    let port: u16 = first
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("not a port line: {first}"));
    HttpServer {
        child,
        url: format!("http://127.0.0.1:{port}/mcp"),
        port,
    }
}

/// A broker with `asks_2026.py` as provider `a` over `transport`, `more` in its entry; the
/// server's log at the returned path.
async fn broker(
    python: &str,
    transport: Transport,
    more: &str,
) -> (TestBroker, std::path::PathBuf, Option<HttpServer>) {
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    let log = b.dir.path().join("asks.log");
    let (entry, server) = match transport {
        Transport::Stdio => (
            format!(
                "command = {}\nargs = [{}]\nsandbox = \"none\"\nenv = {{ ASKS_LOG = {} }}\n",
                q(python),
                q(SCRIPT),
                q(&log.display().to_string())
            ),
            None,
        ),
        Transport::Http | Transport::HttpStateless => {
            let s = http_server(
                python,
                &log,
                matches!(transport, Transport::HttpStateless),
                0,
            )
            .await;
            (format!("url = {}\n", q(&s.url)), Some(s))
        }
    };
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        format!(
            "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"a\"\ncall_timeout_seconds = 60\nstartup_timeout_seconds = 30\n{entry}{more}\n"
        ),
    )
    .expect("w");
    b.restart().await;
    (b, log, server)
}

fn log_lines(log: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

fn asked(b: &TestBroker, turn: &str) -> Vec<Value> {
    b.records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request" && l["turn"] == turn)
        .collect()
}

async fn protocol_of(b: &TestBroker) -> Value {
    providers(b)
        .await
        .into_iter()
        .find(|p| p["namespace"] == "a")
        .map(|p| p["protocol"].clone())
        .unwrap_or_default()
}

/// A 2026-07-28 server asks twice in one call (`input_required`, two rounds): each question
/// reaches the person in their harness (a 2025-11-25 client through `elicitation/create`, a
/// 2026-07-28 client in an `input_required` round of its own call), the server gets each
/// answer in the call's retry, and the record has one `forwarded` line per round, numbered;
/// one call on record. The same over stdio, Streamable HTTP and stateless Streamable HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_2026_servers_rounds_reach_the_person_and_the_answers_the_server() {
    let Some(python) = python() else { return };
    for transport in [Transport::Stdio, Transport::Http, Transport::HttpStateless] {
        let (b, log, _server) = broker(&python, transport, "elicitation = \"forward\"").await;
        assert_eq!(protocol_of(&b).await, "2026-07-28", "{transport:?}");
        for (n, (mode, client_protocol)) in [("legacy", "2025-11-25"), ("auto", "2026-07-28")]
            .into_iter()
            .enumerate()
        {
            let turn = b.open_turn("alice").await;
            let report = report_of(harness(
                &python,
                &b,
                turn.token.expose(),
                mode,
                "approve",
                &json!([["a.deploy", {"service": "api"}]]),
            ))
            .await;
            let at = format!("{transport:?} {mode}");
            assert_eq!(report["protocol"], client_protocol, "{at}: {report}");
            assert_eq!(
                report["calls"][0],
                json!([false, "deployed api to staging", "ok"]),
                "{at}: {report}"
            );
            let questions = report["questions"].as_array().expect("questions");
            assert_eq!(questions.len(), 2, "{at}: {report}");
            let first = questions[0]["message"].as_str().unwrap_or_default();
            assert!(
                first.contains("`a`, a server SharedOS runs for you, asks")
                    && first.contains("Deploy api?"),
                "{at}: {first}"
            );
            assert!(
                questions[1]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("Which target?")),
                "{at}: {report}"
            );
            // The server got each answer in the call's retry.
            let answers = log_lines(&log, "answer deploy");
            assert_eq!(
                answers[2 * n..],
                [
                    "answer deploy r1 confirm accept {\"confirm\": true}".to_owned(),
                    "answer deploy r2 target accept {\"target\": \"staging\"}".to_owned()
                ],
                "{at}: {answers:?}"
            );
            let calls = log_lines(&log, "call deploy 2026-07-28");
            assert_eq!(calls.len(), 3 * (n + 1), "{at}: {calls:?}");
            // Each round on record, like a forwarded question, never the form's values.
            let lines = asked(&b, &turn.turn);
            assert_eq!(lines.len(), 2, "{at}: {lines:?}");
            for (i, l) in lines.iter().enumerate() {
                assert_eq!(
                    (
                        &l["provider"],
                        &l["method"],
                        &l["mode"],
                        &l["action"],
                        &l["answer"],
                        &l["round"]
                    ),
                    (
                        &json!("a"),
                        &json!("elicitation/create"),
                        &json!("form"),
                        &json!("forwarded"),
                        &json!("accept"),
                        &json!(i + 1)
                    ),
                    "{at}: {l}"
                );
            }
            assert_eq!(
                lines[0]["schema"]["properties"]["confirm"]["type"], "boolean",
                "{at}"
            );
            assert_eq!(b.calls_of(&turn.turn).len(), 1, "{at}: one call on record");
            assert_eq!(b.calls_of(&turn.turn)[0]["outcome"], "succeeded", "{at}");
            let text = serde_json::to_string(&b.records()).expect("json");
            assert!(
                !text.contains("\"target\":\"staging\"") && !text.contains("\"confirm\":true"),
                "a form value is on record"
            );
            b.close_turn(&turn.turn).await;
        }
    }
}

/// Decline and cancel go back to the server as the person's answer (as a forwarded
/// `elicitation/create`'s do): the server ends the call its own way, and the round is on
/// record with the action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn decline_and_cancel_go_back_to_the_server_and_end_the_call() {
    let Some(python) = python() else { return };
    let (b, log, _server) = broker(&python, Transport::Stdio, "elicitation = \"forward\"").await;
    for (n, answer) in ["decline", "cancel"].into_iter().enumerate() {
        let turn = b.open_turn("alice").await;
        let report = report_of(harness(
            &python,
            &b,
            turn.token.expose(),
            "auto",
            answer,
            &json!([["a.deploy", {"service": "db"}]]),
        ))
        .await;
        assert_eq!(
            report["calls"][0],
            json!([false, format!("deploy stopped: {answer}"), "ok"]),
            "{report}"
        );
        assert_eq!(report["questions"].as_array().map(Vec::len), Some(1));
        let answers = log_lines(&log, "answer deploy");
        assert_eq!(
            answers[n..],
            [format!("answer deploy r1 confirm {answer} null")],
            "{answers:?}"
        );
        let lines = asked(&b, &turn.turn);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(
            (&lines[0]["action"], &lines[0]["answer"], &lines[0]["round"]),
            (&json!("forwarded"), &json!(answer), &json!(1))
        );
        b.close_turn(&turn.turn).await;
    }
}

/// A server that asks again every round is stopped at 10 rounds: the call fails
/// `upstream_error` saying so, after ten questions, each on record; the server got ten answers
/// and no eleventh retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_server_that_keeps_asking_is_stopped_after_ten_rounds() {
    let Some(python) = python() else { return };
    let (b, log, _server) = broker(&python, Transport::Stdio, "elicitation = \"forward\"").await;
    let turn = b.open_turn("alice").await;
    let report = report_of(harness(
        &python,
        &b,
        turn.token.expose(),
        "legacy",
        "approve",
        &json!([["a.forever", {}]]),
    ))
    .await;
    assert_eq!(report["calls"][0][0], true, "{report}");
    assert!(
        report["calls"][0][1]
            .as_str()
            .is_some_and(|t| t.contains("after 10 rounds")),
        "{report}"
    );
    assert_eq!(report["calls"][0][2], "upstream_error", "{report}");
    assert_eq!(report["questions"].as_array().map(Vec::len), Some(10));
    assert_eq!(log_lines(&log, "call forever").len(), 11);
    assert_eq!(log_lines(&log, "answer forever").len(), 10);
    let lines = asked(&b, &turn.turn);
    assert_eq!(lines.len(), 10, "{lines:?}");
    assert_eq!(lines[9]["round"], 10);
    let calls = b.calls_of(&turn.turn);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["outcome"], "failed", "{}", calls[0]);
    b.close_turn(&turn.turn).await;
}

/// What the broker does not give in a round ends the call, on record, and the server sees no
/// retry: a model completion (sampling), and any question of a provider that does not forward
/// (`elicitation` unset). A round that only carries a `requestState` is sent back as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn what_the_broker_does_not_give_ends_the_call_on_record() {
    let Some(python) = python() else { return };
    let (b, log, _server) = broker(&python, Transport::Stdio, "").await;
    let turn = b.open_turn("alice").await;
    let report = report_of(harness(
        &python,
        &b,
        turn.token.expose(),
        "auto",
        "approve",
        &json!([["a.sample", {}], ["a.deploy", {"service": "x"}], ["a.state_only", {}]]),
    ))
    .await;
    assert_eq!(report["calls"][0][0], true, "{report}");
    assert!(
        report["calls"][0][1]
            .as_str()
            .is_some_and(|t| t.contains("sampling is refused")),
        "{report}"
    );
    assert_eq!(report["calls"][1][0], true, "{report}");
    assert!(
        report["calls"][1][1]
            .as_str()
            .is_some_and(|t| t.contains("does not forward its questions")),
        "{report}"
    );
    assert_eq!(
        report["calls"][2],
        json!([false, "state echoed", "ok"]),
        "{report}"
    );
    assert_eq!(report["questions"], json!([]), "nobody was asked");
    assert_eq!(log_lines(&log, "call sample").len(), 1);
    assert_eq!(log_lines(&log, "call deploy").len(), 1);
    assert_eq!(log_lines(&log, "answer").len(), 0);
    assert_eq!(log_lines(&log, "call state_only").len(), 2);
    let refused: Vec<Value> = b
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request")
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert_eq!(
        (
            &refused[0]["method"],
            &refused[0]["action"],
            &refused[0]["round"],
            &refused[0]["turn"]
        ),
        (
            &json!("sampling/createMessage"),
            &json!("refused"),
            &json!(1),
            &json!(turn.turn)
        )
    );
    assert_eq!(
        (
            &refused[1]["method"],
            &refused[1]["action"],
            &refused[1]["round"]
        ),
        (&json!("elicitation/create"), &json!("refused"), &json!(1))
    );
    b.close_turn(&turn.turn).await;
}

/// `protocol = "2025-11-25"` opens with `initialize` only (for a server whose tools still ask
/// through `elicitation/create`): `providers` says so, and the same server's legacy question is
/// forwarded as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_provider_pinned_to_2025_11_25_speaks_it() {
    let Some(python) = python() else { return };
    let (b, log, _server) = broker(
        &python,
        Transport::Http,
        "elicitation = \"forward\"\nprotocol = \"2025-11-25\"",
    )
    .await;
    assert_eq!(protocol_of(&b).await, "2025-11-25");
    let turn = b.open_turn("alice").await;
    let report = report_of(harness(
        &python,
        &b,
        turn.token.expose(),
        "auto",
        "approve",
        &json!([["a.deploy", {"service": "api"}]]),
    ))
    .await;
    assert_eq!(
        report["calls"][0],
        json!([false, "legacy answered: accept", "ok"]),
        "{report}"
    );
    assert_eq!(log_lines(&log, "call deploy 2025-11-25").len(), 1);
    let lines = asked(&b, &turn.turn);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["action"], "forwarded");
    assert_eq!(lines[0]["round"], Value::Null);
    b.close_turn(&turn.turn).await;
}

/// A 2026-07-28 server announces a changed tool list only on a `subscriptions/listen` stream:
/// the broker opens one per session, and the new tool is published as a 2025-11-25 server's
/// `notifications/tools/list_changed` would have it (stdio and Streamable HTTP). A remote server
/// restarted (its stream ended) is listened to again, and its list read again: the restarted
/// server's list has no `grown`, and its own announcement is heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_2026_servers_tool_list_change_is_heard() {
    let Some(python) = python() else { return };
    for transport in [Transport::Stdio, Transport::Http] {
        let (b, log, server) = broker(&python, transport, "").await;
        let tools = |list: Vec<Value>| -> Vec<Value> {
            list.into_iter()
                .find(|p| p["namespace"] == "a")
                .and_then(|p| p["tools"].as_array().cloned())
                .unwrap_or_default()
        };
        let before = tools(providers(&b).await);
        assert!(
            !before
                .iter()
                .any(|t| t.as_str().is_some_and(|t| t.ends_with("grown"))),
            "{transport:?}: {before:?}"
        );
        let turn = b.open_turn("alice").await;
        let report = report_of(harness(
            &python,
            &b,
            turn.token.expose(),
            "auto",
            "approve",
            &json!([["a.grow", {}]]),
        ))
        .await;
        assert_eq!(
            report["calls"][0],
            json!([false, "grew", "ok"]),
            "{transport:?}: {report}"
        );
        assert_eq!(log_lines(&log, "grew").len(), 1);
        let mut after = Vec::new();
        for _ in 0..100 {
            after = tools(providers(&b).await);
            if after.len() == before.len() + 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(after.len(), before.len() + 1, "{transport:?}: {after:?}");
        assert!(
            after
                .iter()
                .any(|t| t.as_str().is_some_and(|t| t.ends_with("grown"))),
            "{transport:?}: {after:?}"
        );
        b.close_turn(&turn.turn).await;
        let Some(mut server) = server else { continue };
        // Restarted: no `grown` on the new server; the broker hears it again.
        let port = server.port;
        let _ = server.child.kill().await;
        let _server = http_server(&python, &log, false, port).await;
        let mut now = Vec::new();
        for _ in 0..150 {
            now = tools(providers(&b).await);
            if now.len() == before.len() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(now, before, "the restarted server's list is read again");
        let turn = b.open_turn("alice").await;
        let report = report_of(harness(
            &python,
            &b,
            turn.token.expose(),
            "auto",
            "approve",
            &json!([["a.grow", {}]]),
        ))
        .await;
        assert_eq!(report["calls"][0], json!([false, "grew", "ok"]), "{report}");
        for _ in 0..100 {
            now = tools(providers(&b).await);
            if now.len() == before.len() + 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(now, after, "the restarted server's announcement is heard");
        b.close_turn(&turn.turn).await;
    }
}

/// At 2026-07-28 there is no session to lose: the broker's requests to a Streamable HTTP server
/// each stand alone, so a server restarted between two calls takes the next state-changing call
/// as it is, once, with no new session and no retry on record (a 2025-11-25 session's end:
/// `remote::a_server_restart_retries_read_only_calls_only`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_2026_server_restart_loses_nothing() {
    use crate::remote::{Server, broker_with, call, provider, remote_of};
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("server.log");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    for stateless in [false, true] {
        let mut args = vec!["--port".to_owned(), port.to_string()];
        if stateless {
            args.push("--stateless".to_owned());
        }
        let _ = std::fs::remove_file(&log);
        let mut server = Server::start(&py, &log, &args).await;
        let b = broker_with(&provider(&server.url(), "")).await;
        assert_eq!(remote_of(&providers(&b).await)["protocol"], "2026-07-28");
        let turn = b.open_turn("alice").await;
        let mut raw = crate::kit::Raw::spawn(b.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        let note = |n: &str| json!({"path": format!("/public/{n}"), "text": n});
        let r = call(&mut raw, 1, "r.add_note", note("before")).await;
        assert_eq!(crate::kit::meta(&r)["outcome"], "succeeded", "{r}");
        server.stop().await;
        server = Server::start(&py, &log, &args).await;
        let r = call(&mut raw, 2, "r.add_note", note("after")).await;
        assert_eq!(
            crate::kit::meta(&r)["outcome"],
            "succeeded",
            "stateless={stateless}: {r}"
        );
        assert_eq!(
            server.lines("effect"),
            [
                "effect add_note /public/before before",
                "effect add_note /public/after after"
            ],
            "stateless={stateless}: each once"
        );
        let retried = b
            .records()
            .into_iter()
            .filter(|l| l["kind"] == "provider_state" && l["state"] == "call_retried")
            .count();
        assert_eq!(retried, 0, "stateless={stateless}");
        b.close_turn(&turn.turn).await;
        server.stop().await;
    }
}

/// Servers that do not speak 2026-07-28 are opened with `initialize` 2025-11-25 and work as
/// before: one that answers `server/discover` with a JSON-RPC error (`listing-upstream`: -32601)
/// and one that answers every unknown method with an empty result (`rpc_errors.py`: its
/// session is opened again with `initialize`). `providers` names the revision of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn servers_without_2026_are_opened_at_2025_11_25() {
    let Some(python) = python() else { return };
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    let rpc = concat!(env!("CARGO_MANIFEST_DIR"), "/python/rpc_errors.py");
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        format!(
            "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"a\"\ncommand = {}\nsandbox = \"none\"\n\n[[providers]]\ntype = \"mcp\"\nnamespace = \"rpc\"\ncommand = {}\nargs = [{}]\nsandbox = \"none\"\n",
            q(env!("CARGO_BIN_EXE_listing-upstream")),
            q(&python),
            q(rpc)
        ),
    )
    .expect("w");
    b.restart().await;
    let list = providers(&b).await;
    for ns in ["a", "rpc"] {
        let p = list
            .iter()
            .find(|p| p["namespace"] == ns)
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            (&p["state"], &p["protocol"]),
            (&json!("ready"), &json!("2025-11-25")),
            "{ns}: {p}"
        );
    }
    let turn = b.open_turn("alice").await;
    let mut raw = crate::kit::Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = crate::remote::call(&mut raw, 1, "a.echo", json!({"message": "hi"})).await;
    assert_eq!(crate::kit::text(&r), "echo: hi", "{r}");
    b.close_turn(&turn.turn).await;
}
