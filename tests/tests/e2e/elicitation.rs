//! Issue 36: a call a permit annotated `@approval("principal")` decides is asked of the person
//! in the harness, through MCP elicitation (`elicitation/create` to the shim's client), and only
//! that person's answer, bound to the call's approval id, decides it. The harness here is the
//! Python MCP SDK client (PyPI `mcp` 2.3.0, `tests/python/elicit_client.py`) with a real
//! `elicitation_callback`; the crafted-frame and replay cases drive the bridge socket directly.

use std::time::Duration;

use serde_json::{Value, json};
use sharedos_proto::ipc::{BridgeEvent, BridgeRequest, PrincipalAnswer};

use crate::kit::{Options, TestBroker, WAIT, bin, run};

const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-write-asks-alice")
@approval("principal")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"write",
       resource is SharedOS::File)
when { resource.path like "/public/*" };

@id("alice-private-asks-alice-or-operator")
@approval("principal_or_operator")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;

async fn broker(timeout_seconds: u64) -> TestBroker {
    TestBroker::start(Options {
        policy: POLICY,
        top: format!("approval_timeout_seconds = {timeout_seconds}\n"),
        ..Options::default()
    })
    .await
}

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

/// The Python SDK client as the harness: one session, `calls` in order, the person answering
/// every question with `answer`.
pub(crate) fn harness(
    python: &str,
    broker: &TestBroker,
    token: &str,
    mode: &str,
    answer: &str,
    calls: &Value,
) -> std::process::Command {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/elicit_client.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script)
        .env("SHAREDOS_SHIM", bin("sharedos-mcp-shim"))
        .env("SHAREDOS_TURN_TOKEN", token)
        .env("SHAREDOS_BROKER", broker.bridge())
        .env("ELICIT_MODE", mode)
        .env("ELICIT_ANSWER", answer)
        .env("ELICIT_SLOW_SECONDS", "6")
        .env("ELICIT_CALLS", calls.to_string());
    cmd
}

pub(crate) async fn report_of(cmd: std::process::Command) -> Value {
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "python harness failed:\n{out}\n{err}");
    serde_json::from_str(out.lines().last().unwrap_or("{}")).expect("report json")
}

fn lines_of(broker: &TestBroker, turn: &str, kind: &str) -> Vec<Value> {
    broker
        .records()
        .into_iter()
        .filter(|l| l["turn"] == turn && l["kind"] == kind)
        .collect()
}

fn writes_succeeded(broker: &TestBroker, turn: &str) -> usize {
    broker
        .calls_of(turn)
        .iter()
        .filter(|c| c["tool"] == "files.write" && c["outcome"] == "succeeded")
        .count()
}

const BIG: usize = 5000;

/// Approve: the person is asked once, sees the tool, the resource the kernel decided on and the
/// arguments within the bound (a long content cut, a secret-looking key redacted), and the call
/// runs exactly once; `approval_decided` says `by: harness_session` (a form answered in the
/// harness is not the person's word: issue 45), with the harness session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn the_person_approves_in_the_harness_and_the_call_runs_once() {
    let Some(python) = python() else { return };
    let broker = broker(30).await;
    for (mode, protocol, via) in [
        ("legacy", "2025-11-25", "elicitation/create"),
        ("auto", "2026-07-28", "input_required"),
    ] {
        let turn = broker.open_turn("alice").await;
        let content = "x".repeat(BIG);
        let path = format!("/public/new-{mode}.txt");
        let calls = json!([["files.write", {"path": path, "content": content}]]);
        let report = report_of(harness(
            &python,
            &broker,
            turn.token.expose(),
            mode,
            "approve",
            &calls,
        ))
        .await;
        assert_eq!(report["protocol"], protocol, "{report}");
        assert_eq!(report["calls"][0][0], false, "{report}");
        assert_eq!(
            std::fs::read_to_string(broker.dir.path().join(format!("data{path}")))
                .expect("written"),
            content
        );
        let questions = report["questions"].as_array().expect("questions");
        assert_eq!(questions.len(), 1, "asked once: {report}");
        let message = questions[0]["message"].as_str().expect("message");
        assert!(message.contains("`files.write`"), "{message}");
        assert!(message.contains(&path), "{message}");
        assert!(
            !message
                .contains(&"x".repeat(sharedos_broker::approval::QUESTION_MAX_STRING_BYTES + 1)),
            "the question carries an argument over the bound: {} bytes",
            message.len()
        );
        assert!(
            message.contains(&format!("({BIG} bytes in all)")),
            "{message}"
        );
        assert_eq!(
            questions[0]["requestedSchema"]["properties"]["decision"]["enum"],
            json!(["approve", "deny"])
        );
        assert_eq!(writes_succeeded(&broker, &turn.turn), 1);
        let decided = lines_of(&broker, &turn.turn, "approval_decided");
        assert_eq!(decided.len(), 1, "{decided:?}");
        assert_eq!(decided[0]["decision"], "approved");
        assert_eq!(decided[0]["by"], "harness_session");
        assert_eq!(decided[0]["decidedBy"], Value::Null);
        assert_eq!(decided[0]["session"]["action"], "accept");
        assert!(
            decided[0]["session"]["bridge"].as_u64().is_some(),
            "{decided:?}"
        );
        assert!(
            decided[0]["session"]["client"]
                .as_str()
                .is_some_and(|c| !c.is_empty()),
            "{decided:?}"
        );
        assert_eq!(decided[0]["session"]["via"], via, "{mode}: {decided:?}");
        // One attempt on record, however many requests the rounds took.
        assert_eq!(broker.calls_of(&turn.turn).len(), 1, "{mode}");
        assert_eq!(lines_of(&broker, &turn.turn, "approval_requested").len(), 1);
        // The client's declared capabilities are on record: it said it can be asked.
        let clients = lines_of(&broker, &turn.turn, "bridge_client");
        assert_eq!(clients.len(), 1, "{clients:?}");
        assert!(
            clients[0]["client"]["capabilities"]["elicitation"].is_array(),
            "{mode}: {clients:?}"
        );
        broker.close_turn(&turn.turn).await;
    }
}

/// Deny (accept with `deny`), decline and cancel each refuse the call `denied/approval_denied`,
/// recorded `by: harness_session` with the action; nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn deny_decline_and_cancel_refuse_the_call() {
    let Some(python) = python() else { return };
    let broker = broker(30).await;
    for (mode, answer, action) in [
        ("legacy", "deny", "accept"),
        ("legacy", "decline", "decline"),
        ("legacy", "cancel", "cancel"),
        ("auto", "deny", "accept"),
        ("auto", "decline", "decline"),
        ("auto", "cancel", "cancel"),
    ] {
        let turn = broker.open_turn("alice").await;
        let path = format!("/public/{answer}-{mode}.txt");
        let calls = json!([["files.write", {"path": path, "content": "no"}]]);
        let report = report_of(harness(
            &python,
            &broker,
            turn.token.expose(),
            mode,
            answer,
            &calls,
        ))
        .await;
        assert_eq!(report["calls"][0][0], true, "{answer}: {report}");
        assert_eq!(
            report["calls"][0][2], "approval_denied",
            "{answer}: {report}"
        );
        assert_eq!(report["questions"].as_array().map(Vec::len), Some(1));
        assert!(!broker.dir.path().join(format!("data{path}")).exists());
        assert_eq!(writes_succeeded(&broker, &turn.turn), 0);
        let decided = lines_of(&broker, &turn.turn, "approval_decided");
        assert_eq!(decided.len(), 1, "{decided:?}");
        assert_eq!(
            (&decided[0]["decision"], &decided[0]["by"]),
            (&json!("denied"), &json!("harness_session")),
            "{answer}"
        );
        assert_eq!(decided[0]["session"]["action"], action, "{answer}");
        let calls = broker.calls_of(&turn.turn);
        assert_eq!(calls.len(), 1);
        assert_eq!(
            (&calls[0]["outcome"], &calls[0]["code"]),
            (&json!("denied"), &json!("approval_denied"))
        );
        broker.close_turn(&turn.turn).await;
    }
}

/// Nobody answers in time (the person takes 6 s, the timeout is 2 s): `denied/approval_timeout`,
/// and the call never runs, not even when the late answer comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn no_answer_in_time_is_approval_timeout() {
    let Some(python) = python() else { return };
    let broker = broker(2).await;
    // In 2026-07-28 the late answer comes as a retry after the held call ended: it gets the
    // held call's answer (`approval_timeout`), and the person is not asked again.
    for mode in ["legacy", "auto"] {
        let turn = broker.open_turn("alice").await;
        let calls = json!([
            ["files.write", {"path": "/public/late.txt", "content": "late"}],
            ["files.read", {"path": "/public/hello.txt"}],
        ]);
        let started = std::time::Instant::now();
        let report = report_of(harness(
            &python,
            &broker,
            turn.token.expose(),
            mode,
            "slow",
            &calls,
        ))
        .await;
        assert_eq!(
            report["questions"].as_array().map(Vec::len),
            Some(1),
            "{mode}: {report}"
        );
        assert_eq!(report["calls"][0][2], "approval_timeout", "{report}");
        // The session goes on: the next call is answered.
        assert_eq!(report["calls"][1][0], false, "{report}");
        assert!(started.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!broker.dir.path().join("data/public/late.txt").exists());
        assert_eq!(writes_succeeded(&broker, &turn.turn), 0);
        let decided = lines_of(&broker, &turn.turn, "approval_decided");
        assert_eq!(decided.len(), 1);
        assert_eq!(decided[0]["decision"], "timeout");
        assert_eq!(broker.calls_of(&turn.turn).len(), 2, "{mode}");
        broker.close_turn(&turn.turn).await;
    }
}

/// 2026-07-28 rounds driven by hand, as a client that keeps, replays or misuses `requestState`
/// would: an answer counts only on a retry of the very call it was asked about, once. A replayed
/// state (already answered) and another call's state are new calls, asked anew; the held call
/// the misused state names is untouched and still decided by its own retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn an_input_required_answer_counts_once_and_only_for_its_call() {
    let Some(python) = python() else { return };
    let broker = broker(30).await;
    let turn = broker.open_turn("alice").await;
    let a = json!(["files.write", {"path": "/public/a.txt", "content": "a"}]);
    let b = json!(["files.write", {"path": "/public/b.txt", "content": "b"}]);
    let steps = json!([
        {"call": a, "save": "a"},
        // Another call retried with a's state and an approval: not a's answer, a new question.
        {"call": b, "state": "a", "answer": "approve", "save": "b"},
        // a's own retry approves a: written once.
        {"call": a, "state": "a", "answer": "approve"},
        // Replayed: a's used state and approval on the same call again: asked anew.
        {"call": a, "state": "a", "answer": "approve", "save": "a2"},
        {"call": a, "state": "a2", "answer": "deny"},
        // b's question is still b's.
        {"call": b, "state": "b", "answer": "deny"},
    ]);
    let mut cmd = harness(
        &python,
        &broker,
        turn.token.expose(),
        "auto",
        "approve",
        &json!([]),
    );
    cmd.env("ELICIT_ROUNDS", steps.to_string());
    let report = report_of(cmd).await;
    let kinds: Vec<(&str, Option<&str>)> = report["rounds"]
        .as_array()
        .expect("rounds")
        .iter()
        .map(|r| (r["kind"].as_str().unwrap_or("?"), r["code"].as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("input_required", None),
            ("input_required", None),
            ("result", Some("ok")),
            ("input_required", None),
            ("result", Some("approval_denied")),
            ("result", Some("approval_denied")),
        ],
        "{report}"
    );
    assert_eq!(report["rounds"][0]["keys"], json!(["sharedos-approval"]));
    assert_eq!(
        std::fs::read_to_string(broker.dir.path().join("data/public/a.txt")).expect("a"),
        "a"
    );
    assert!(!broker.dir.path().join("data/public/b.txt").exists());
    assert_eq!(writes_succeeded(&broker, &turn.turn), 1);
    // Three calls on record (a, b, a again), each asked once and decided by its own retry.
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert_eq!(lines_of(&broker, &turn.turn, "approval_requested").len(), 3);
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    let decisions: Vec<(&str, &str)> = decided
        .iter()
        .map(|d| {
            (
                d["decision"].as_str().unwrap_or("?"),
                d["session"]["via"].as_str().unwrap_or("?"),
            )
        })
        .collect();
    assert_eq!(
        decisions,
        [
            ("approved", "input_required"),
            ("denied", "input_required"),
            ("denied", "input_required"),
        ]
    );
    broker.close_turn(&turn.turn).await;
}

/// A client that cannot be asked (no elicitation capability declared, in `initialize` or on a
/// 2026-07-28 call): `@approval("principal")` is refused
/// `denied/approval_unavailable` with the reason recorded; `@approval("principal_or_operator")`
/// goes to the operator queue, and an operator's approval runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_client_that_cannot_be_asked_falls_back_as_the_policy_says() {
    let Some(python) = python() else { return };
    let broker = broker(30).await;
    for (mode, answer, why) in [
        (
            "legacy",
            "none",
            "did not declare the elicitation capability",
        ),
        (
            "auto",
            "none",
            "did not declare form-mode elicitation in the call's clientCapabilities",
        ),
    ] {
        let turn = broker.open_turn("alice").await;
        let calls = json!([
            ["files.write", {"path": "/public/unasked.txt", "content": "no"}],
            ["files.read", {"path": "/private/secret.txt"}],
        ]);
        let mut child = tokio::process::Command::from(harness(
            &python,
            &broker,
            turn.token.expose(),
            mode,
            answer,
            &calls,
        ));
        child
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let child = child.spawn().expect("python");
        // The second call waits for an operator: approve it from another process.
        let id = {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let mut list = broker.cli();
                list.args(["approvals", "--json"]);
                let (code, out, err) = run(list).await;
                assert_eq!(code, 0, "{err}");
                let p: Vec<Value> = serde_json::from_str(&out).expect("json");
                // The read's: the write's approval may still be listed for the moment between
                // its request and its `unavailable` decision.
                if let Some(a) = p
                    .iter()
                    .find(|a| a["turn"] == turn.turn.as_str() && a["tool"] == "files.read")
                {
                    break a["id"].as_str().expect("id").to_owned();
                }
                assert!(tokio::time::Instant::now() < deadline, "nothing waits");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let mut approve = broker.cli();
        approve.args(["approvals", "approve", &id]);
        let (code, _, err) = run(approve).await;
        assert_eq!(code, 0, "{mode}: {err}");
        let out = tokio::time::timeout(WAIT, child.wait_with_output())
            .await
            .expect("the harness ends")
            .expect("output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{mode}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value =
            serde_json::from_str(stdout.lines().last().unwrap_or("{}")).expect("report");
        assert_eq!(
            report["calls"][0][2], "approval_unavailable",
            "{mode}: {report}"
        );
        assert!(
            report["calls"][0][1]
                .as_str()
                .is_some_and(|t| t.contains(why)),
            "{mode}: {report}"
        );
        assert_eq!(report["calls"][1][0], false, "{mode}: {report}");
        assert_eq!(report["calls"][1][1], "the secret\n", "{mode}: {report}");
        assert_eq!(report["questions"], json!([]), "{mode}: nobody was asked");
        let decided = lines_of(&broker, &turn.turn, "approval_decided");
        assert_eq!(decided.len(), 2, "{decided:?}");
        assert_eq!(decided[0]["decision"], "unavailable");
        assert!(
            decided[0]["reason"]
                .as_str()
                .is_some_and(|r| r.contains(why)),
            "{decided:?}"
        );
        assert_eq!(
            (&decided[1]["decision"], &decided[1]["by"]),
            (&json!("approved"), &json!("operator"))
        );
        assert!(!broker.dir.path().join("data/public/unasked.txt").exists());
        broker.close_turn(&turn.turn).await;
    }
}

/// Reads the next frame that is not `waiting`.
async fn next_event(
    reader: &mut sharedos_ipc::FrameReader<impl tokio::io::AsyncRead + Unpin>,
) -> BridgeEvent {
    loop {
        let e = tokio::time::timeout(WAIT, reader.next::<BridgeEvent>())
            .await
            .expect("a frame in time")
            .expect("frame");
        if !matches!(e, BridgeEvent::Waiting { .. }) {
            return e;
        }
    }
}

fn write_call(id: u64, path: &str, extra: Value) -> BridgeRequest {
    let mut arguments = json!({"path": path, "content": "y".repeat(BIG)});
    if let (Some(a), Value::Object(more)) = (arguments.as_object_mut(), extra) {
        a.extend(more);
    }
    BridgeRequest::Call {
        id,
        call: sharedos_proto::ToolCall {
            tool: "files.write".into(),
            arguments: Some(arguments),
            request_id: None,
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        },
    }
}

/// Only the connection asked can answer, once: an answer from another bridge connection of the
/// same turn (a model that got hold of the token and crafts a `decide` frame), a tool call that
/// tries to approve, an answer replayed after the decision, and an earlier call's answer on a
/// later question are all refused, and none of them runs or decides anything. The question
/// itself stays within its bounds (redaction of secret-looking keys: the unit test
/// `approval::tests::a_question_is_bounded_and_redacted`, as a files tool refuses extra keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_asked_session_answers_once() {
    let broker = broker(30).await;
    let turn = broker.open_turn("alice").await;
    let token = turn.token.expose();
    let (mut reader, mut writer) = crate::kit::raw_bridge(&broker.bridge(), token).await;
    let (mut model_reader, mut model_writer) =
        crate::kit::raw_bridge(&broker.bridge(), token).await;
    sharedos_ipc::write_frame(&mut writer, &write_call(1, "/public/once.txt", json!({})))
        .await
        .expect("call");
    let event = next_event(&mut reader).await;
    let BridgeEvent::Ask {
        id: 1,
        approval,
        question,
    } = event
    else {
        panic!("no question for call 1: {event:?}");
    };
    let shown = serde_json::to_string(&question).expect("json");
    assert!(
        !shown.contains(&"y".repeat(sharedos_broker::approval::QUESTION_MAX_STRING_BYTES + 1)),
        "an argument over the bound: {} bytes",
        shown.len()
    );
    assert!(question.message.len() < 2 * sharedos_broker::approval::QUESTION_MAX_ARGUMENT_BYTES);
    assert_eq!(
        question.resource.as_deref(),
        Some("SharedOS::File::\"/public/once.txt\"")
    );
    // Another connection of the same turn answers: refused.
    let decide = |approval: &str, answer| BridgeRequest::Decide {
        approval: approval.to_owned(),
        answer,
        reason: None,
        via: None,
    };
    sharedos_ipc::write_frame(
        &mut model_writer,
        &decide(&approval, PrincipalAnswer::Approve),
    )
    .await
    .expect("crafted");
    match next_event(&mut model_reader).await {
        BridgeEvent::DecideRefused { message, .. } => {
            assert!(
                message.contains("not asked on this bridge connection"),
                "{message}"
            );
        }
        other => panic!("the crafted answer was not refused: {other:?}"),
    }
    // A tool call that tries to approve: refused as unpublished, and decides nothing.
    sharedos_ipc::write_frame(
        &mut model_writer,
        &BridgeRequest::Call {
            id: 7,
            call: sharedos_proto::ToolCall {
                tool: "approvals.approve".into(),
                arguments: Some(json!({"id": approval})),
                request_id: None,
                rejected_arguments: None,
                traceparent: None,
                tracestate: None,
            },
        },
    )
    .await
    .expect("tool call");
    match next_event(&mut model_reader).await {
        BridgeEvent::Answer { id: 7, answer } => {
            assert_eq!(
                answer.outcome,
                sharedos_proto::Outcome::Denied(sharedos_proto::DenyCode::UnpublishedTool)
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!broker.dir.path().join("data/public/once.txt").exists());
    assert!(lines_of(&broker, &turn.turn, "approval_decided").is_empty());
    // The asked connection answers: the call runs.
    sharedos_ipc::write_frame(&mut writer, &decide(&approval, PrincipalAnswer::Approve))
        .await
        .expect("answer");
    match next_event(&mut reader).await {
        BridgeEvent::Answer { id: 1, answer } => {
            assert_eq!(
                answer.outcome,
                sharedos_proto::Outcome::Succeeded,
                "{answer:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Replayed: refused.
    sharedos_ipc::write_frame(&mut writer, &decide(&approval, PrincipalAnswer::Approve))
        .await
        .expect("replay");
    match next_event(&mut reader).await {
        BridgeEvent::DecideRefused { message, .. } => {
            assert!(message.contains("already decided"), "{message}");
        }
        other => panic!("the replay was not refused: {other:?}"),
    }
    // A second call: the first call's answer does not decide it; its own does.
    sharedos_ipc::write_frame(&mut writer, &write_call(2, "/public/twice.txt", json!({})))
        .await
        .expect("call");
    let BridgeEvent::Ask {
        id: 2,
        approval: second,
        ..
    } = next_event(&mut reader).await
    else {
        panic!("no question for call 2");
    };
    assert_ne!(second, approval);
    sharedos_ipc::write_frame(&mut writer, &decide(&approval, PrincipalAnswer::Approve))
        .await
        .expect("old answer");
    assert!(matches!(
        next_event(&mut reader).await,
        BridgeEvent::DecideRefused { .. }
    ));
    sharedos_ipc::write_frame(&mut writer, &decide(&second, PrincipalAnswer::Deny))
        .await
        .expect("answer");
    match next_event(&mut reader).await {
        BridgeEvent::Answer { id: 2, answer } => {
            assert_eq!(
                answer.outcome,
                sharedos_proto::Outcome::Denied(sharedos_proto::DenyCode::ApprovalDenied)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(writes_succeeded(&broker, &turn.turn), 1);
    assert!(!broker.dir.path().join("data/public/twice.txt").exists());
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    assert_eq!(decided.len(), 2, "{decided:?}");
    assert!(
        decided.iter().all(|d| d["by"] == "harness_session"),
        "{decided:?}"
    );
    // An operator cannot decide a `principal` approval.
    sharedos_ipc::write_frame(&mut writer, &write_call(3, "/public/op.txt", json!({})))
        .await
        .expect("call");
    let BridgeEvent::Ask {
        approval: third, ..
    } = next_event(&mut reader).await
    else {
        panic!("no question for call 3");
    };
    let mut approve = broker.cli();
    approve.args(["approvals", "approve", &third]);
    let (code, _, err) = run(approve).await;
    assert_ne!(code, 0);
    assert!(err.contains("principal"), "{err}");
    drop(writer);
    drop(model_writer);
    broker.close_turn(&turn.turn).await;
}

const UPSTREAM_POLICY: &str = r#"
@id("alice-py")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "py.*" };
"#;

/// An upstream that asks its client (a PyPI `mcp` MCPServer tool calling `ctx.elicit`, one that
/// asks through URL mode with a plain-http URL, one that asks for roots): the broker refuses
/// each with an MCP error the upstream sees (never a silent decline) and records it
/// (`upstream_request`: the form's schema, a URL's host only, the reason). Without
/// `elicitation = "forward"` on the provider, nothing reaches the person.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn an_upstreams_questions_are_refused_and_recorded() {
    let Some(python) = python() else { return };
    let mut broker = TestBroker::start(Options {
        policy: UPSTREAM_POLICY,
        ..Options::default()
    })
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/elicits.py");
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!("{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"py\"\ncommand = {python:?}\nargs = [{script:?}]\nprotocol = \"2025-11-25\"\n[providers.sandbox]\nread = [{:?}]\n", concat!(env!("CARGO_MANIFEST_DIR"), "/python")),
    )
    .expect("w");
    broker.restart().await;
    let turn = broker.open_turn("alice").await;
    let mut raw = crate::kit::Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let mut texts = Vec::new();
    for (id, tool) in [(1, "py.ask"), (2, "py.ask_url"), (3, "py.roots")] {
        let r = raw.call(id, tool, json!({})).await;
        texts.push(crate::kit::text(&r["result"]));
    }
    for t in &texts {
        assert!(
            t.contains("refused") && t.contains("SharedOS broker"),
            "the upstream did not see a refusal: {texts:?}"
        );
    }
    let lines: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request")
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    let form = &lines[0];
    assert_eq!(
        (
            &form["provider"],
            &form["method"],
            &form["mode"],
            &form["action"]
        ),
        (
            &json!("py"),
            &json!("elicitation/create"),
            &json!("form"),
            &json!("refused")
        )
    );
    assert_eq!(
        form["schema"]["properties"]["confirm"]["type"], "boolean",
        "{form}"
    );
    let url = &lines[1];
    assert_eq!(url["mode"], "url");
    assert_eq!(url["host"], "login.example.test", "{url}");
    assert!(url.get("url").is_none(), "{url}");
    assert!(
        url["reason"]
            .as_str()
            .is_some_and(|r| r.contains("not https")),
        "{url}"
    );
    assert_eq!(lines[2]["method"], "roots/list");
    // Nothing of the questions reached the harness: the shim sent no elicitation.
    broker.close_turn(&turn.turn).await;
}

/// A broker with the PyPI `MCPServer` of `elicits.py` as the shared provider `py`, forwarding
/// its questions, with the shared secret `py_key` = `key` in its environment. Its tools ask
/// with `ctx.elicit` (a request of the server's, which 2026-07-28 forbids), so the provider is
/// opened at 2025-11-25 (`protocol`); a 2026-07-28 server's questions: `upstream_protocol.rs`.
async fn forwarding_broker(python: &str, key: &str) -> TestBroker {
    let mut broker = TestBroker::start(Options {
        policy: UPSTREAM_POLICY,
        ..Options::default()
    })
    .await;
    crate::secrets::set_secret(&broker.config_path, "_shared", "py_key", key);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/elicits.py");
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!("{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"py\"\ncommand = {python:?}\nargs = [{script:?}]\nelicitation = \"forward\"\nprotocol = \"2025-11-25\"\nenv = {{ PY_API_KEY = {{ secret = \"py_key\", shared = true }} }}\n[providers.sandbox]\nread = [{:?}]\n", concat!(env!("CARGO_MANIFEST_DIR"), "/python")),
    )
    .expect("w");
    broker.restart().await;
    broker
}

/// `elicitation = "forward"`: the same upstream's questions reach the person behind the call, in
/// the harness (the PyPI `mcp` SDK client's elicitation callback), named as the server's, and the
/// answer goes back to the server: accept with the form's values (the server reads
/// `confirm=True`), decline, and a URL-mode question for an https page. Each is recorded
/// `upstream_request` `action: forwarded` with the turn, the schema or host and the person's
/// action, never the form's values. A secret given to the server never reaches the person in
/// its question. A 2026-07-28 client is asked in an `input_required` round of the call. A
/// plain-http URL is still refused, on record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_forwarded_upstream_question_reaches_the_person_and_the_answer_the_server() {
    let Some(python) = python() else { return };
    let key = "pk-3f9a1c77e2b54d0e9a";
    let broker = forwarding_broker(&python, key).await;
    let forwarded = |broker: &TestBroker, turn: &str| -> Vec<Value> {
        broker
            .records()
            .into_iter()
            .filter(|l| l["kind"] == "upstream_request" && l["turn"] == turn)
            .collect()
    };
    for (answer, expected) in [
        ("approve", "answered: accept confirm=True"),
        ("decline", "answered: decline"),
    ] {
        let turn = broker.open_turn("alice").await;
        let calls = json!([
            ["py.ask", {}],
            ["py.ask_https_url", {}],
            ["py.ask_secret", {}]
        ]);
        let report = report_of(harness(
            &python,
            &broker,
            turn.token.expose(),
            "legacy",
            answer,
            &calls,
        ))
        .await;
        assert_eq!(report["calls"][0][1], expected, "{answer}: {report}");
        let questions = report["questions"].as_array().expect("questions");
        assert_eq!(questions.len(), 3, "{answer}: {report}");
        let message = questions[0]["message"].as_str().unwrap_or("");
        assert!(
            message.contains("`py`, a server SharedOS runs for you, asks")
                && message.contains("Delete the staging database?"),
            "{message}"
        );
        assert_eq!(
            questions[0]["requestedSchema"]["properties"]["confirm"]["type"],
            "boolean"
        );
        assert_eq!(questions[1]["mode"], "url");
        assert_eq!(
            questions[1]["url"],
            "https://login.example.test/authorize?state=2"
        );
        // The server's key is not in the question the person saw.
        let secret_question = questions[2]["message"].as_str().unwrap_or("");
        assert!(!secret_question.contains(key), "{secret_question}");
        assert!(
            secret_question.contains("[redacted: py_key]"),
            "{secret_question}"
        );
        let action = if answer == "approve" {
            "accept"
        } else {
            "decline"
        };
        let lines = forwarded(&broker, &turn.turn);
        assert_eq!(lines.len(), 3, "{lines:?}");
        for l in &lines {
            assert_eq!(
                (&l["action"], &l["answer"], &l["provider"]),
                (&json!("forwarded"), &json!(action), &json!("py")),
                "{l}"
            );
        }
        assert_eq!(
            lines[0]["schema"]["properties"]["confirm"]["type"],
            "boolean"
        );
        assert_eq!(lines[1]["host"], "login.example.test");
        let text = serde_json::to_string(&broker.records()).expect("json");
        assert!(!text.contains(key), "the key is on record");
        assert!(
            !text.contains("\"confirm\":true"),
            "a form value is on record"
        );
        broker.close_turn(&turn.turn).await;
    }
    // Still refused: a plain-http URL.
    let turn = broker.open_turn("alice").await;
    let report = report_of(harness(
        &python,
        &broker,
        turn.token.expose(),
        "legacy",
        "approve",
        &json!([["py.ask_url", {}]]),
    ))
    .await;
    assert!(
        report["calls"][0][1]
            .as_str()
            .is_some_and(|t| t.starts_with("refused") && t.contains("not https")),
        "{report}"
    );
    assert_eq!(report["questions"], json!([]));
    // Its refusal is on record with the turn of the call it came in (issue 42, item 14).
    let refused: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| {
            l["kind"] == "upstream_request" && l["action"] == "refused" && l["mode"] == "url"
        })
        .collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["turn"], turn.turn.as_str(), "{}", refused[0]);
    assert_eq!(refused[0]["host"], "login.example.test", "{}", refused[0]);
    broker.close_turn(&turn.turn).await;
    // A 2026-07-28 client is asked in an input_required round of the call, and its retry's
    // response is the server's answer.
    let turn = broker.open_turn("alice").await;
    let report = report_of(harness(
        &python,
        &broker,
        turn.token.expose(),
        "auto",
        "approve",
        &json!([["py.ask", {}]]),
    ))
    .await;
    assert_eq!(report["protocol"], "2026-07-28", "{report}");
    assert_eq!(
        report["calls"][0][1], "answered: accept confirm=True",
        "{report}"
    );
    assert_eq!(report["questions"].as_array().map(Vec::len), Some(1));
    let lines = forwarded(&broker, &turn.turn);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (&lines[0]["action"], &lines[0]["answer"]),
        (&json!("forwarded"), &json!("accept"))
    );
    assert_eq!(
        broker.calls_of(&turn.turn).len(),
        1,
        "one attempt on record"
    );
    broker.close_turn(&turn.turn).await;
    let refused: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request" && l["action"] == "refused")
        .collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
}

/// The TypeScript SDK client (npm `@modelcontextprotocol/sdk`, the version installed with
/// server-everything) as the harness, with a real `elicitation/create` handler: it declares form
/// mode in `initialize`, is asked, and its answer decides: approve runs the call once, decline
/// refuses it `denied/approval_denied`, both `by: harness_session` via `elicitation/create`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs npm @modelcontextprotocol/sdk: bash .ci/install-mcp-servers installs it and .ci/run runs this"]
async fn the_typescript_sdk_client_is_asked_and_its_answer_decides() {
    let Some(servers) = crate::kit::installed("mcp-servers", ".ci/install-mcp-servers") else {
        return;
    };
    let everything = std::path::PathBuf::from(&servers["EVERYTHING_ARGS"]);
    // .../node_modules/@modelcontextprotocol/server-everything/dist/index.js → .../sdk
    let sdk = everything
        .ancestors()
        .nth(3)
        .expect("@modelcontextprotocol")
        .join("sdk");
    assert!(sdk.join("package.json").exists(), "{}", sdk.display());
    let broker = broker(30).await;
    for (answer, written, code) in [
        ("approve", true, "ok"),
        ("decline", false, "approval_denied"),
    ] {
        let turn = broker.open_turn("alice").await;
        let path = format!("/public/ts-{answer}.txt");
        let mut cmd = std::process::Command::new(&servers["EVERYTHING_CMD"]);
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/node/elicit_client.cjs"
        ))
        .env("MCP_SDK_DIR", &sdk)
        .env("SHAREDOS_SHIM", bin("sharedos-mcp-shim"))
        .env("SHAREDOS_TURN_TOKEN", turn.token.expose())
        .env("SHAREDOS_BROKER", broker.bridge())
        .env("ELICIT_ANSWER", answer)
        .env(
            "ELICIT_CALLS",
            json!([["files.write", {"path": path, "content": "from ts"}]]).to_string(),
        );
        let report = report_of(cmd).await;
        assert_eq!(report["calls"][0][2], code, "{answer}: {report}");
        assert_eq!(
            report["questions"].as_array().map(Vec::len),
            Some(1),
            "{report}"
        );
        assert!(
            report["questions"][0]["message"]
                .as_str()
                .is_some_and(|m| m.contains("`files.write`") && m.contains(&path)),
            "{report}"
        );
        assert_eq!(
            broker.dir.path().join(format!("data{path}")).exists(),
            written,
            "{answer}"
        );
        let decided = lines_of(&broker, &turn.turn, "approval_decided");
        assert_eq!(decided.len(), 1, "{decided:?}");
        assert_eq!(decided[0]["by"], "harness_session");
        assert_eq!(decided[0]["session"]["via"], "elicitation/create");
        let clients = lines_of(&broker, &turn.turn, "bridge_client");
        assert_eq!(
            clients[0]["client"]["name"], "ts-sdk-harness",
            "{clients:?}"
        );
        assert_eq!(
            clients[0]["client"]["capabilities"]["elicitation"],
            json!(["form"]),
            "{clients:?}"
        );
        println!(
            "MEASURED ts-sdk {} protocol {} answer {answer}: {}",
            servers["MCP_SDK_VERSION"],
            clients[0]["client"]["protocolVersion"],
            decided[0]["decision"],
        );
        broker.close_turn(&turn.turn).await;
    }
}

/// Attacks on forwarding: a question from the shared session while two people's calls are in
/// flight on it (the server waits until both are) is refused with why, and nobody is asked; a
/// server that asks two questions at once inside one call gets the first put to the person and
/// the second refused (one question at a time per call), each on record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_forwarded_question_is_never_a_guess_and_one_at_a_time() {
    let Some(python) = python() else { return };
    let broker = forwarding_broker(&python, "pk-unused-7e1d").await;
    let (first, second) = (
        broker.open_turn("alice").await,
        broker.open_turn("alice").await,
    );
    let calls = json!([["py.ask_when_two", {}]]);
    let (a, b) = tokio::join!(
        report_of(harness(
            &python,
            &broker,
            first.token.expose(),
            "legacy",
            "approve",
            &calls
        )),
        report_of(harness(
            &python,
            &broker,
            second.token.expose(),
            "legacy",
            "approve",
            &calls
        )),
    );
    for report in [&a, &b] {
        assert!(
            report["calls"][0][1]
                .as_str()
                .is_some_and(|t| t.starts_with("refused") && t.contains("2 calls are in flight")),
            "{report}"
        );
        assert_eq!(report["questions"], json!([]), "nobody is asked: {report}");
    }
    let refused: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request" && l["action"] == "refused")
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    broker.close_turn(&first.turn).await;
    broker.close_turn(&second.turn).await;

    let turn = broker.open_turn("alice").await;
    let mut cmd = harness(
        &python,
        &broker,
        turn.token.expose(),
        "legacy",
        "slow",
        &json!([["py.ask_twice", {}]]),
    );
    cmd.env("ELICIT_SLOW_SECONDS", "1");
    let report = report_of(cmd).await;
    let text = report["calls"][0][1].as_str().unwrap_or("");
    let answered = text.matches("answered: accept").count();
    let refused_here = text.matches("already being asked another question").count();
    assert_eq!((answered, refused_here), (1, 1), "{report}");
    assert_eq!(
        report["questions"].as_array().map(Vec::len),
        Some(1),
        "{report}"
    );
    let lines: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "upstream_request" && l["method"] == "elicitation/create")
        .skip(2)
        .collect();
    let actions: Vec<&str> = lines.iter().filter_map(|l| l["action"].as_str()).collect();
    assert_eq!(actions.len(), 2, "{lines:?}");
    assert!(
        actions.contains(&"forwarded") && actions.contains(&"refused"),
        "{lines:?}"
    );
    broker.close_turn(&turn.turn).await;
}

/// Issue 42 item 10: a forwarding server that copies the approval form (its property, title and
/// description, behind 40 blank lines and "SharedOS asks: approve…") is refused before the
/// person sees anything, and the refusal is recorded (`upstream_request` `action: refused`,
/// with why); a question of its own whose message starts with blank lines and control
/// characters reaches the person cleaned, the server's name first and as a field of its own
/// (`_meta["io.sharedos/server"]`). Both for a 2025-11-25 client (`elicitation/create`) and a
/// 2026-07-28 one (`input_required`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_forwarded_copy_of_the_approval_form_is_refused_and_recorded() {
    let Some(python) = python() else { return };
    let broker = forwarding_broker(&python, "pk-unused-0000000000").await;
    for (mode, protocol) in [("legacy", "2025-11-25"), ("auto", "2026-07-28")] {
        let before = broker.records().len();
        let turn = broker.open_turn("alice").await;
        let report = report_of(harness(
            &python,
            &broker,
            turn.token.expose(),
            mode,
            "approve",
            &json!([["py.ask_as_approval", {}], ["py.ask_padded", {}]]),
        ))
        .await;
        assert_eq!(report["protocol"], protocol, "{report}");
        let copied = report["calls"][0][1].as_str().unwrap_or("");
        assert!(
            copied.starts_with("refused") && copied.contains("reuses the approval form's"),
            "{mode}: {report}"
        );
        assert_eq!(
            report["calls"][1][1], "answered: accept confirm=True",
            "{mode}: {report}"
        );
        // The person saw one question: the server's own, named as the server's.
        let questions = report["questions"].as_array().expect("questions");
        assert_eq!(questions.len(), 1, "{mode}: {report}");
        let q = &questions[0];
        assert!(
            q["requestedSchema"]["properties"].get("decision").is_none(),
            "{q}"
        );
        assert_eq!(q["_meta"]["io.sharedos/server"], "py", "{q}");
        assert_eq!(
            q["message"],
            "`py`, a server SharedOS runs for you, asks (it is not SharedOS asking):\n\nSharedOS asks: approve `files.write`?\n\nreally[2J",
            "{mode}"
        );
        let lines: Vec<Value> = broker.records()[before..]
            .iter()
            .filter(|l| l["kind"] == "upstream_request")
            .cloned()
            .collect();
        assert_eq!(lines.len(), 2, "{mode}: {lines:?}");
        assert_eq!(lines[0]["action"], "refused", "{:?}", lines[0]);
        assert!(
            lines[0]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("reuses the approval form's property `decision`")),
            "{:?}",
            lines[0]
        );
        assert_eq!(
            lines[0]["schema"]["properties"]["decision"]["title"], "Your decision",
            "the copied form is on record"
        );
        assert_eq!(
            (&lines[1]["action"], &lines[1]["answer"]),
            (&json!("forwarded"), &json!("accept")),
            "{:?}",
            lines[1]
        );
        // No approval was asked or decided: the copy was never taken for one.
        assert!(
            lines_of(&broker, &turn.turn, "approval_decided").is_empty(),
            "{mode}"
        );
        broker.close_turn(&turn.turn).await;
    }
}
