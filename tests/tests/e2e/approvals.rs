//! Approvals: a call a permit annotated `@approval("required")` decides waits for a person. It
//! is recorded `approval_requested`, listed by `sharedos-broker approvals`, and decided from
//! another process (`approvals approve|deny ID`, over control.sock); it then runs (approved),
//! is refused `denied/approval_denied` or `denied/approval_timeout`, or ends `cancelled` when
//! the client cancels it. Real broker, shim (as the MCP client's server) and CLI processes.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use serde_json::{Value, json};

use crate::kit::{Options, Raw, TestBroker, WAIT, eventually, meta, run, text};

const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-private-ask")
@approval("required")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;

async fn broker(top: &str) -> TestBroker {
    let broker = TestBroker::start(Options {
        policy: POLICY,
        top: top.to_owned(),
        ..Options::default()
    })
    .await;
    std::fs::write(
        broker.dir.path().join("data/private/other.txt"),
        "another secret\n",
    )
    .expect("write");
    broker
}

fn outcome(result: &Value) -> String {
    let m = meta(result);
    format!(
        "{}/{}",
        m["outcome"].as_str().unwrap_or("?"),
        m["code"].as_str().unwrap_or("?")
    )
}

/// Sends a `tools/call` without waiting for its answer.
async fn send_read(raw: &mut Raw, id: i64, path: &str, progress: Option<&str>) {
    let mut params = json!({"name": "files.read", "arguments": {"path": path}});
    if let Some(token) = progress {
        params["_meta"] = json!({"progressToken": token});
    }
    raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}))
        .await;
}

/// `approvals --json`, from its own process.
async fn pending(broker: &TestBroker) -> Vec<Value> {
    let mut list = broker.cli();
    list.args(["approvals", "--json"]);
    let (code, out, err) = run(list).await;
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("approvals --json is a JSON array")
}

/// Waits until `n` calls wait for approval; returns them.
pub(crate) async fn wait_pending(broker: &TestBroker, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let p = pending(broker).await;
        if p.len() == n {
            return p;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} pending approvals expected, have {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn decide(broker: &TestBroker, args: &[&str]) -> (i32, String, String) {
    let mut cmd = broker.cli();
    cmd.arg("approvals").args(args);
    run(cmd).await
}

fn lines_of(broker: &TestBroker, turn: &str, kind: &str) -> Vec<Value> {
    broker
        .records()
        .into_iter()
        .filter(|l| l["turn"] == turn && l["kind"] == kind)
        .collect()
}

fn my_uid(broker: &TestBroker) -> u32 {
    std::fs::metadata(broker.dir.path()).expect("stat").uid()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_held_call_is_approved_from_a_second_process_and_then_runs() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    // An ordinary call is not held.
    let public = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(outcome(&public["result"]), "succeeded/ok");
    send_read(&mut raw, 2, "/private/secret.txt", Some("tok-2")).await;
    // The client asked for progress: it hears that the call waits, and for which approval.
    let note = raw.recv().await;
    assert_eq!(note["method"], "notifications/progress", "{note}");
    assert_eq!(note["params"]["progressToken"], "tok-2");
    assert_eq!(note["params"]["progress"], 1);
    let listed = wait_pending(&broker, 1).await;
    let a = &listed[0];
    let id = a["id"].as_str().expect("id").to_owned();
    assert_eq!(id.len(), 64);
    assert!(
        note["params"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&id)),
        "{note}"
    );
    assert_eq!(a["turn"], turn.turn.as_str());
    assert_eq!(a["principal"], "alice");
    assert_eq!(a["tool"], "files.read");
    assert_eq!(a["arguments"], json!({"path": "/private/secret.txt"}));
    assert_eq!(
        a["requirement"],
        json!({"action": "read", "resource": "SharedOS::File::\"/private/secret.txt\"",
            "namespace": "files"})
    );
    assert!(
        a["requestedAt"].is_string() && a["expiresAt"].is_string(),
        "{a}"
    );
    // The id is the hash of the call it is bound to, and of what it was decided on.
    let bound = json!({"turn": turn.turn, "callId": a["callId"], "principal": "alice",
        "tool": "files.read", "arguments": {"path": "/private/secret.txt"},
        "requirement": a["requirement"]});
    let canonical = sharedos_proto::catalog::canonical_json(&bound).expect("canonical");
    assert_eq!(
        id,
        sharedos_proto::catalog::sha256_hex(canonical.as_bytes())
    );

    let (code, out, err) = decide(&broker, &["approve", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("approved {id}"));
    let r = raw.response(2).await;
    assert_eq!(outcome(&r["result"]), "succeeded/ok", "{r}");
    assert_eq!(text(&r["result"]), "the secret\n");

    // An id is used once: deciding it again, or an id that never existed, fails naming it.
    let (code, _, err) = decide(&broker, &["approve", &id]).await;
    assert_ne!(code, 0);
    assert!(
        err.contains(&id) && err.contains("already decided"),
        "{err}"
    );
    let never = "0".repeat(64);
    let (code, _, err) = decide(&broker, &["deny", &never]).await;
    assert_ne!(code, 0);
    assert!(
        err.contains(&never) && err.contains("no call is waiting"),
        "{err}"
    );
    assert!(pending(&broker).await.is_empty());
    let (code, out, _) = decide(&broker, &[]).await;
    assert_eq!((code, out.trim()), (0, "no calls are waiting for approval"));

    // On record: requested, decided (by whom), then the call's one line.
    let requested = lines_of(&broker, &turn.turn, "approval_requested");
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    let calls = broker.calls_of(&turn.turn);
    assert_eq!((requested.len(), decided.len(), calls.len()), (1, 1, 2));
    assert_eq!(requested[0]["approval"], id.as_str());
    assert_eq!(requested[0]["policies"], json!(["alice-private-ask"]));
    assert_eq!(
        requested[0]["arguments"],
        json!({"path": "/private/secret.txt"})
    );
    assert_eq!(decided[0]["decision"], "approved");
    assert_eq!(decided[0]["decidedBy"], my_uid(&broker));
    assert_eq!(calls[1]["callId"], requested[0]["callId"]);
    assert_eq!(calls[1]["outcome"], "succeeded");
    let seq = |l: &Value| l["seq"].as_u64().expect("seq");
    assert!(seq(&requested[0]) < seq(&decided[0]) && seq(&decided[0]) < seq(&calls[1]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_denied_call_is_refused_with_the_reason_the_model_reads() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    send_read(&mut raw, 1, "/private/secret.txt", None).await;
    let listed = wait_pending(&broker, 1).await;
    let id = listed[0]["id"].as_str().expect("id").to_owned();
    let (code, out, err) =
        decide(&broker, &["deny", &id, "--reason", "not before the audit"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("denied {id}"));
    let r = raw.response(1).await;
    assert_eq!(outcome(&r["result"]), "denied/approval_denied", "{r}");
    assert_eq!(r["result"]["isError"], true);
    let why = text(&r["result"]);
    assert!(
        why.starts_with("denied: files.read of /private/secret.txt — a person denied this call")
            && why.contains("not before the audit")
            && why.contains(&id),
        "{why}"
    );
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0]["decision"], "denied");
    assert_eq!(decided[0]["reason"], "not before the audit");
    assert_eq!(decided[0]["decidedBy"], my_uid(&broker));
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0]["outcome"].as_str(), calls[0]["code"].as_str()),
        (Some("denied"), Some("approval_denied"))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_nobody_decides_is_refused_when_its_time_is_up() {
    let broker = broker("approval_timeout_seconds = 1\n").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let started = std::time::Instant::now();
    let r = raw
        .call(1, "files.read", json!({"path": "/private/secret.txt"}))
        .await;
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(outcome(&r["result"]), "denied/approval_timeout", "{r}");
    let why = text(&r["result"]);
    assert!(why.contains("nobody gave it within 1 s"), "{why}");
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0]["decision"], "timeout");
    assert_eq!(decided[0]["decidedBy"], Value::Null);
    assert!(pending(&broker).await.is_empty());
    let id = decided[0]["approval"].as_str().expect("id").to_owned();
    let (code, _, err) = decide(&broker, &["approve", &id]).await;
    assert_ne!(code, 0, "a timed-out id cannot be approved late");
    assert!(err.contains("already decided"), "{err}");
    assert_eq!(broker.calls_of(&turn.turn)[0]["code"], "approval_timeout");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_cancelled_while_it_waits_stops_waiting_and_is_recorded_cancelled() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    send_read(&mut raw, 7, "/private/secret.txt", None).await;
    let listed = wait_pending(&broker, 1).await;
    let id = listed[0]["id"].as_str().expect("id").to_owned();
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 7, "reason": "the user pressed Esc"}}),
    )
    .await;
    eventually("the cancelled call is recorded", || {
        broker.calls_of(&turn.turn).len() == 1
    })
    .await;
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(
        (calls[0]["outcome"].as_str(), calls[0]["code"].as_str()),
        (Some("cancelled"), Some("client_cancelled"))
    );
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0]["decision"], "cancelled");
    assert!(pending(&broker).await.is_empty(), "it no longer waits");
    let (code, _, err) = decide(&broker, &["approve", &id]).await;
    assert_ne!(code, 0);
    assert!(err.contains(&id), "{err}");
    // No answer for the cancelled call; the session goes on.
    let next = raw
        .call(8, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(outcome(&next["result"]), "succeeded/ok", "{next}");
}

/// Two calls wait at once, with different arguments, so with different approval ids. An id is
/// the hash of the exact call (its turn, callId, principal, tool and arguments), so:
/// approving call A's id releases A and leaves B waiting; A's id, once used, releases nothing;
/// and an id made for B's attempt with A's arguments names no waiting call and is refused.
/// B then ends as decided for it, and each call has its own record lines.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_id_releases_only_the_call_it_was_made_for() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    send_read(&mut raw, 1, "/private/secret.txt", None).await;
    wait_pending(&broker, 1).await;
    send_read(&mut raw, 2, "/private/other.txt", None).await;
    let listed = wait_pending(&broker, 2).await;
    let by_path = |p: &str| {
        listed
            .iter()
            .find(|a| a["arguments"]["path"] == p)
            .cloned()
            .expect("listed")
    };
    let (a, b) = (
        by_path("/private/secret.txt"),
        by_path("/private/other.txt"),
    );
    let (id_a, id_b) = (
        a["id"].as_str().expect("id").to_owned(),
        b["id"].as_str().expect("id").to_owned(),
    );
    assert_ne!(id_a, id_b);
    // B's attempt with A's arguments: not B's id, and no call waits for it.
    let forged = json!({"turn": turn.turn, "callId": b["callId"], "principal": "alice",
        "tool": "files.read", "arguments": {"path": "/private/secret.txt"},
        "requirement": a["requirement"]});
    let forged = sharedos_proto::catalog::sha256_hex(
        sharedos_proto::catalog::canonical_json(&forged)
            .expect("canonical")
            .as_bytes(),
    );
    assert_ne!(forged, id_b);
    let (code, _, err) = decide(&broker, &["approve", &forged]).await;
    assert_ne!(code, 0, "an id for other arguments is refused");
    assert!(
        err.contains(&forged) && err.contains("no call is waiting"),
        "{err}"
    );
    // A's id releases A, and only A.
    let (code, _, err) = decide(&broker, &["approve", &id_a]).await;
    assert_eq!(code, 0, "{err}");
    let ra = raw.response(1).await;
    assert_eq!(outcome(&ra["result"]), "succeeded/ok");
    assert_eq!(text(&ra["result"]), "the secret\n");
    let still = pending(&broker).await;
    assert_eq!(still.len(), 1);
    assert_eq!(still[0]["id"], id_b.as_str(), "B still waits");
    // A's id again (for B, say): used, refused, and B still waits.
    let (code, _, err) = decide(&broker, &["approve", &id_a]).await;
    assert_ne!(code, 0);
    assert!(err.contains("already decided"), "{err}");
    assert_eq!(pending(&broker).await.len(), 1);
    assert!(
        broker
            .calls_of(&turn.turn)
            .iter()
            .all(|c| c["arguments"]["path"] != "/private/other.txt"),
        "B has not run"
    );
    let (code, _, err) = decide(&broker, &["deny", &id_b]).await;
    assert_eq!(code, 0, "{err}");
    let rb = raw.response(2).await;
    assert_eq!(outcome(&rb["result"]), "denied/approval_denied");
    let calls = broker.calls_of(&turn.turn);
    let of = |p: &str| {
        calls
            .iter()
            .find(|c| c["arguments"]["path"] == p)
            .map(|c| c["code"].as_str().unwrap_or("?").to_owned())
    };
    assert_eq!(of("/private/secret.txt").as_deref(), Some("ok"));
    assert_eq!(of("/private/other.txt").as_deref(), Some("approval_denied"));
    let decided: Vec<(String, String)> = lines_of(&broker, &turn.turn, "approval_decided")
        .iter()
        .map(|l| {
            (
                l["approval"].as_str().unwrap_or("?").to_owned(),
                l["decision"].as_str().unwrap_or("?").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        decided,
        [(id_a, "approved".to_owned()), (id_b, "denied".to_owned())]
    );
}

/// Approved, the call is decided again under the policy in force then: a policy reloaded while
/// it waited that no longer permits it refuses it.
#[tokio::test(flavor = "multi_thread")]
async fn an_approved_call_is_checked_again_under_the_current_policy() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    send_read(&mut raw, 1, "/private/secret.txt", None).await;
    let listed = wait_pending(&broker, 1).await;
    let id = listed[0]["id"].as_str().expect("id").to_owned();
    // The approval policy goes away while the call waits.
    std::fs::write(
        broker.dir.path().join("policy.cedar"),
        POLICY
            .split("@id(\"alice-private-ask\")")
            .next()
            .expect("first policy"),
    )
    .expect("write policy");
    let mut reload = broker.cli();
    reload.args(["policy", "reload"]);
    let (code, _, err) = run(reload).await;
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = decide(&broker, &["approve", &id]).await;
    assert_eq!(code, 0, "{err}");
    let r = raw.response(1).await;
    assert_eq!(outcome(&r["result"]), "denied/no_permit", "{r}");
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    assert_eq!(decided[0]["decision"], "approved");
}

/// A wait longer than the shim's own answer deadline (the longest call timeout + 5 s, here
/// 1 + 5 s): the broker tells the shim the call waits, so the shim waits for the person too
/// instead of answering `failed/timeout`, and keeps a client that asked for progress informed
/// (at once, then every 5 s).
#[tokio::test(flavor = "multi_thread")]
async fn a_long_wait_outlasts_the_shims_answer_deadline_with_progress() {
    let broker = TestBroker::start(Options {
        policy: POLICY,
        call_timeout_seconds: Some(1),
        ..Options::default()
    })
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    send_read(&mut raw, 3, "/private/secret.txt", Some("t3")).await;
    let listed = wait_pending(&broker, 1).await;
    let id = listed[0]["id"].as_str().expect("id").to_owned();
    let first = raw.recv().await;
    assert_eq!(
        (
            first["params"]["progressToken"].as_str(),
            first["params"]["progress"].as_u64()
        ),
        (Some("t3"), Some(1)),
        "{first}"
    );
    let second = raw.recv().await;
    assert_eq!(second["params"]["progress"], 2, "{second}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (code, _, err) = decide(&broker, &["approve", &id]).await;
    assert_eq!(code, 0, "{err}");
    let r = raw.response(3).await;
    assert_eq!(outcome(&r["result"]), "succeeded/ok", "{r}");
}

/// A turn that closes while its call waits: the wait ends, the call is recorded
/// `cancelled/turn_closed`, and nothing waits any more.
#[tokio::test(flavor = "multi_thread")]
async fn closing_the_turn_ends_the_wait() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    send_read(&mut raw, 1, "/private/secret.txt", None).await;
    wait_pending(&broker, 1).await;
    broker.close_turn(&turn.turn).await;
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 1, "recorded before the close returned");
    // The answer on record is the one the harness got, before the turn's end.
    let r = raw.response(1).await;
    assert_eq!(
        r["result"]["_meta"]["sharedos"]["callId"], calls[0]["callId"],
        "{r}"
    );
    assert_eq!(
        (calls[0]["outcome"].as_str(), calls[0]["code"].as_str()),
        (Some("cancelled"), Some("turn_closed"))
    );
    assert_eq!(
        lines_of(&broker, &turn.turn, "approval_decided")[0]["decision"],
        "cancelled"
    );
    assert!(pending(&broker).await.is_empty());
    assert_eq!(
        raw.exit_code().await,
        Some(3),
        "the shim exits with its turn"
    );
}

/// Budgets come after the approval, right before the call runs: a call a person denied uses no
/// budget, and an approved call is still refused when the budget is used up meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn budgets_are_checked_after_the_approval() {
    let broker = TestBroker::start(Options {
        policy: POLICY,
        tables: "[[budgets]]\ntool = \"files.read\"\ncalls_per_turn = 1\n".to_owned(),
        ..Options::default()
    })
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    send_read(&mut raw, 1, "/private/secret.txt", None).await;
    let id = wait_pending(&broker, 1).await[0]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    assert_eq!(decide(&broker, &["deny", &id]).await.0, 0);
    assert_eq!(
        outcome(&raw.response(1).await["result"]),
        "denied/approval_denied"
    );
    // The denied call used nothing: the one call of the budget is still there.
    send_read(&mut raw, 2, "/private/secret.txt", None).await;
    let id = wait_pending(&broker, 1).await[0]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    // While it waits, another call uses the budget up.
    let public = raw
        .call(3, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(outcome(&public["result"]), "succeeded/ok");
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(2).await;
    assert_eq!(outcome(&r["result"]), "denied/budget_exhausted", "{r}");
    let codes: Vec<String> = broker
        .calls_of(&turn.turn)
        .iter()
        .map(|c| c["code"].as_str().unwrap_or("?").to_owned())
        .collect();
    assert_eq!(codes, ["approval_denied", "ok", "budget_exhausted"]);
}

/// Every place on the bridge taken by calls waiting for a person (8 of them), and a 9th call
/// behind them: a cancel for one of the waiting calls still reaches it at once (the bridge reads
/// on while a call waits for a place), the 9th call takes the place it frees and is answered,
/// and closing the turn ends the rest. One call line for each of the 9 attempts.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_reaches_a_waiting_call_when_every_place_is_taken() {
    let broker = broker("").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    for id in 1..=8 {
        send_read(&mut raw, id, "/private/secret.txt", None).await;
    }
    wait_pending(&broker, 8).await;
    send_read(&mut raw, 9, "/public/hello.txt", None).await;
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 3, "reason": "changed my mind"}}),
    )
    .await;
    // The 9th call is answered long before any approval could time out (120 s).
    let r = raw.response(9).await;
    assert_eq!(outcome(&r["result"]), "succeeded/ok", "{r}");
    assert_eq!(pending(&broker).await.len(), 7);
    let calls = broker.calls_of(&turn.turn);
    let cancelled: Vec<&Value> = calls
        .iter()
        .filter(|c| c["outcome"] == "cancelled")
        .collect();
    assert_eq!(cancelled.len(), 1, "{calls:?}");
    assert_eq!(cancelled[0]["requestId"], "3");
    assert_eq!(cancelled[0]["code"], "client_cancelled");
    broker.close_turn(&turn.turn).await;
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 9, "{calls:?}");
    let turn_closed = calls
        .iter()
        .filter(|c| c["outcome"] == "cancelled" && c["code"] == "turn_closed")
        .count();
    assert_eq!(turn_closed, 7, "{calls:?}");
}

/// Reads and lists of `/private/*` wait for a person; `/public/*` is free.
const LINK_POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-private-ask")
@approval("required")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list"],
       resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;

/// A broker on [`LINK_POLICY`], and its data folder (canonical).
async fn link_broker() -> (TestBroker, std::path::PathBuf) {
    let broker = TestBroker::start(Options {
        policy: LINK_POLICY,
        ..Options::default()
    })
    .await;
    let data = std::fs::canonicalize(broker.dir.path().join("data")).expect("data");
    std::fs::write(data.join("private/harmless.txt"), "harmless\n").expect("write");
    (broker, data)
}

/// Points the link `at` to `to`, in one rename (as an agent with a shell would re-point it).
fn point(at: &std::path::Path, to: &str) {
    let tmp = at.with_extension("relink");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(to, &tmp).expect("symlink");
    std::fs::rename(&tmp, at).expect("rename");
}

fn file_resource(path: &str) -> String {
    format!("SharedOS::File::{path:?}")
}

/// The one pending approval, checked to show `resource` (in `--json` and in the plain list);
/// its id.
async fn pending_on(broker: &TestBroker, action: &str, resource: &str) -> String {
    let listed = wait_pending(broker, 1).await;
    assert_eq!(listed[0]["requirement"]["action"], action, "{listed:?}");
    assert_eq!(listed[0]["requirement"]["resource"], resource, "{listed:?}");
    let (code, out, err) = decide(broker, &[]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("requirement: {action} on {resource}")),
        "{out}"
    );
    listed[0]["id"].as_str().expect("id").to_owned()
}

/// The call line of `request`, which must be the only one for it.
fn call_line(broker: &TestBroker, turn: &str, request: &str) -> Value {
    let lines: Vec<Value> = broker
        .calls_of(turn)
        .into_iter()
        .filter(|c| c["requestId"] == request)
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    lines[0].clone()
}

/// An approval covers the file the person was shown, not wherever a link points when the person
/// says yes. `/public/report.txt` links to `../private/harmless.txt`: the read is held and listed
/// on `/private/harmless.txt`; the agent re-points the link to `../private/secret.txt`; the
/// approval then refuses the call `denied/approval_stale` (recorded so) and the secret is never
/// read. The same when the path stays but its file is replaced (another inode), or the link is
/// re-pointed to a file no policy permits or to nothing; an approval with nothing changed runs on
/// the very file approved.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_does_not_follow_a_link_re_pointed_while_it_waits() {
    let (broker, data) = link_broker().await;
    let link = data.join("public/report.txt");
    point(&link, "../private/harmless.txt");
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let harmless = file_resource("/private/harmless.txt");

    send_read(&mut raw, 1, "/public/report.txt", None).await;
    let id = pending_on(&broker, "read", &harmless).await;
    let requested = lines_of(&broker, &turn.turn, "approval_requested");
    assert_eq!(requested[0]["requirement"]["resource"], harmless.as_str());
    assert_eq!(requested[0]["arguments"]["path"], "/public/report.txt");
    point(&link, "../private/secret.txt");
    let (code, out, err) = decide(&broker, &["approve", &id]).await;
    assert_eq!(
        (code, out.trim()),
        (0, format!("approved {id}").as_str()),
        "{err}"
    );
    let r = raw.response(1).await;
    assert_eq!(outcome(&r["result"]), "denied/approval_stale", "{r}");
    let why = text(&r["result"]);
    assert!(!why.contains("the secret"), "{why}");
    assert!(
        why.starts_with(&format!(
            "denied: files.read of /private/harmless.txt — a person approved it (approval {id}), but what it names changed to /private/secret.txt"
        )) && why.contains("call it again"),
        "{why}"
    );
    let line = call_line(&broker, &turn.turn, "1");
    assert_eq!(
        (line["outcome"].as_str(), line["code"].as_str()),
        (Some("denied"), Some("approval_stale"))
    );
    assert_eq!(line["requirement"]["resource"], harmless.as_str(), "{line}");
    assert_eq!(line["message"].as_str(), Some(why.as_str()));

    // The same path, another file: the approved one replaced by a rename while it waits.
    point(&link, "../private/harmless.txt");
    send_read(&mut raw, 2, "/public/report.txt", None).await;
    let id = pending_on(&broker, "read", &harmless).await;
    std::fs::write(data.join("private/harmless.new"), "replaced\n").expect("write");
    std::fs::rename(
        data.join("private/harmless.new"),
        data.join("private/harmless.txt"),
    )
    .expect("rename");
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(2).await;
    assert_eq!(outcome(&r["result"]), "denied/approval_stale", "{r}");
    let why = text(&r["result"]);
    assert!(
        why.contains("/private/harmless.txt is now another file or folder than the one approved"),
        "{why}"
    );
    assert!(!why.contains("replaced"), "{why}");
    assert_eq!(
        call_line(&broker, &turn.turn, "2")["code"],
        "approval_stale"
    );

    // Re-pointed to a file no policy permits, or to nothing: stale as well (what was approved
    // is gone), and still nothing read.
    std::fs::create_dir_all(data.join("other")).expect("mkdir");
    std::fs::write(data.join("other/x.txt"), "other\n").expect("write");
    for (request, to, said) in [
        (
            "3",
            "../other/x.txt",
            "what it names changed to SharedOS::File::\"/other/x.txt\"",
        ),
        ("4", "../private/nothing.txt", "it no longer resolves"),
    ] {
        point(&link, "../private/harmless.txt");
        let n: i64 = request.parse().expect("id");
        send_read(&mut raw, n, "/public/report.txt", None).await;
        let id = pending_on(&broker, "read", &harmless).await;
        point(&link, to);
        assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
        let r = raw.response(n).await;
        assert_eq!(outcome(&r["result"]), "denied/approval_stale", "{r}");
        let why = text(&r["result"]);
        assert!(why.contains(said), "{why}");
        assert!(
            !why.contains("other\n") && !why.contains("replaced"),
            "{why}"
        );
    }

    // Nothing changed while it waits: it runs, on that file.
    point(&link, "../private/harmless.txt");
    send_read(&mut raw, 5, "/public/report.txt", None).await;
    let id = pending_on(&broker, "read", &harmless).await;
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(5).await;
    assert_eq!(outcome(&r["result"]), "succeeded/ok", "{r}");
    assert_eq!(text(&r["result"]), "replaced\n");

    let codes: Vec<String> = broker
        .calls_of(&turn.turn)
        .iter()
        .map(|c| c["code"].as_str().unwrap_or("?").to_owned())
        .collect();
    assert_eq!(
        codes,
        ["approval_stale"; 4]
            .into_iter()
            .chain(["ok"])
            .collect::<Vec<_>>()
    );
    let decided = lines_of(&broker, &turn.turn, "approval_decided");
    assert_eq!(decided.len(), 5);
    assert!(
        decided.iter().all(|d| d["decision"] == "approved"),
        "{decided:?}"
    );
}

/// The same for a folder: `files.list /public/docs`, a link to `../private/a`, held on
/// `/private/a`; re-pointed to `../private/b` (or `/private/a` itself replaced by another
/// folder) before the approval: refused `denied/approval_stale`, and `b`'s names never shown.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_does_not_follow_a_folder_link_re_pointed_while_it_waits() {
    let (broker, data) = link_broker().await;
    for (dir, file) in [("a", "a-notes.txt"), ("b", "b-salaries.txt")] {
        std::fs::create_dir_all(data.join("private").join(dir)).expect("mkdir");
        std::fs::write(data.join("private").join(dir).join(file), "x\n").expect("write");
    }
    let link = data.join("public/docs");
    point(&link, "../private/a");
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let list = |id: i64| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "files.list", "arguments": {"path": "/public/docs"}}})
    };

    raw.send(list(1)).await;
    let id = pending_on(&broker, "list", &file_resource("/private/a")).await;
    point(&link, "../private/b");
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(1).await;
    assert_eq!(outcome(&r["result"]), "denied/approval_stale", "{r}");
    let why = text(&r["result"]);
    assert!(why.contains("what it names changed to /private/b"), "{why}");
    assert!(!why.contains("b-salaries"), "{why}");

    // The path the person saw, now another folder.
    point(&link, "../private/a");
    raw.send(list(2)).await;
    let id = pending_on(&broker, "list", &file_resource("/private/a")).await;
    std::fs::rename(data.join("private/a"), data.join("private/a-old")).expect("mv");
    std::fs::rename(data.join("private/b"), data.join("private/a")).expect("mv");
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(2).await;
    assert_eq!(outcome(&r["result"]), "denied/approval_stale", "{r}");
    assert!(!text(&r["result"]).contains("b-salaries"), "{r}");

    // Unchanged while it waits: listed.
    raw.send(list(3)).await;
    let id = pending_on(&broker, "list", &file_resource("/private/a")).await;
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(3).await;
    assert_eq!(outcome(&r["result"]), "succeeded/ok", "{r}");
    assert!(text(&r["result"]).contains("b-salaries.txt"), "{r}");

    let codes: Vec<String> = broker
        .calls_of(&turn.turn)
        .iter()
        .map(|c| c["code"].as_str().unwrap_or("?").to_owned())
        .collect();
    assert_eq!(codes, ["approval_stale", "approval_stale", "ok"]);
    let stale = call_line(&broker, &turn.turn, "1");
    assert_eq!(
        stale["requirement"]["resource"],
        file_resource("/private/a")
    );
}

/// The same for a brokered tool whose `file` template resolves beneath a `file_root`: a naive
/// upstream (a plain `open(path)`, its own process) is sent the path the approval was given for
/// or nothing. The link re-pointed while the call waits: `denied/approval_stale`, nothing sent.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_of_a_brokered_file_does_not_follow_a_re_pointed_link() {
    // The provider's `file_root` is the broker's data folder, known once the broker has made it.
    let (broker, data) = {
        let mut broker = TestBroker::start(Options {
            policy: LINK_POLICY,
            ..Options::default()
        })
        .await;
        let data = std::fs::canonicalize(broker.dir.path().join("data")).expect("data");
        let q = |s: &str| serde_json::to_string(s).expect("quote");
        let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
        std::fs::write(
            &broker.config_path,
            format!(
                "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"plain\"\ncommand = {}\n\
                 [providers.tools.read_file]\naction = \"read\"\nfile = \"{{path}}\"\nfile_root = {}\n",
                q(env!("CARGO_BIN_EXE_open-upstream")),
                q(&data.display().to_string()),
            ),
        )
        .expect("w");
        broker.restart().await;
        std::fs::write(data.join("private/harmless.txt"), "harmless\n").expect("write");
        (broker, data)
    };
    let link = data.join("public/report.txt");
    point(&link, "../private/harmless.txt");
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let read = |id: i64| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "plain.read_file",
                       "arguments": {"path": link.display().to_string()}}})
    };
    let harmless = file_resource("/private/harmless.txt");

    raw.send(read(1)).await;
    let id = pending_on(&broker, "read", &harmless).await;
    assert_eq!(
        wait_pending(&broker, 1).await[0]["requirement"]["namespace"],
        "plain"
    );
    point(&link, "../private/secret.txt");
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(1).await;
    assert_eq!(outcome(&r["result"]), "denied/approval_stale", "{r}");
    let why = text(&r["result"]);
    assert!(
        why.contains("what it names changed to /private/secret.txt"),
        "{why}"
    );
    assert!(!why.contains("the secret"), "{why}");
    let line = call_line(&broker, &turn.turn, "1");
    assert_eq!(line["code"], "approval_stale");
    assert_eq!(line["requirement"]["resource"], harmless.as_str());
    assert!(
        line.get("forwardedArguments").is_none(),
        "nothing was sent: {line}"
    );

    // Unchanged while it waits: the upstream is sent the approved file's path, and reads it.
    point(&link, "../private/harmless.txt");
    raw.send(read(2)).await;
    let id = pending_on(&broker, "read", &harmless).await;
    assert_eq!(decide(&broker, &["approve", &id]).await.0, 0);
    let r = raw.response(2).await;
    assert_eq!(outcome(&r["result"]), "succeeded/ok", "{r}");
    assert_eq!(text(&r["result"]), "harmless\n");
    let line = call_line(&broker, &turn.turn, "2");
    assert_eq!(
        line["forwardedArguments"]["path"],
        data.join("private/harmless.txt").display().to_string(),
        "{line}"
    );
}
