//! Typed arguments (issue 44): every call is decided on `context.arguments`, its arguments typed
//! from the tool's inputSchema. A real Python upstream (`tests/python/chatbank.py`) behind the
//! real broker and shim: alice may post to #public and not #exec, and transfer up to 100; a
//! misspelt argument in the policy is refused at start and at reload, naming file, line and
//! argument; the upstream renames an argument mid-run and the policy set is validated again.

use serde_json::{Value, json};
use sharedos_proto::ipc::{ControlRequest, ControlResponse};

use crate::kit::{Options, Raw, TestBroker, meta, run};

const POLICY: &str = r#"@id("alice-public")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool)
when { resource.name == "chat.post" && context has arguments
       && context.arguments has channel && context.arguments.channel == "public" };

@id("alice-transfers")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool)
when { resource.name == "chat.transfer"
       && context.arguments has amount && context.arguments.amount <= 100 };

@id("alice-rename")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool)
when { resource.name == "chat.rename" };
"#;

const PYTHON_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python");

fn q(s: &str) -> String {
    serde_json::to_string(s).expect("quote")
}

/// A broker with the chatbank upstream as `chat`, its calls logged to `<dir>/calls.log`. It is
/// first started without it (under the kit's policy: a policy reading `channel` would not start
/// before a tool has one), then with it and `policy`.
async fn broker(policy: &'static str, top: &str) -> TestBroker {
    let mut b = TestBroker::start(Options {
        top: top.to_owned(),
        ..Options::default()
    })
    .await;
    append_provider(&b);
    std::fs::write(b.dir.path().join("policy.cedar"), policy).expect("w");
    b.restart().await;
    b
}

fn append_provider(b: &TestBroker) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/chatbank.py");
    // The sandboxed upstream may run under a uid of its own: its log folder is open to it (the
    // broker's own folder must not be).
    let logs = b.dir.path().join("logs");
    std::fs::create_dir_all(&logs).expect("mkdir");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let log = logs.join("calls.log");
    std::fs::write(&log, "").expect("log");
    std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        format!(
            "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"chat\"\ncommand = \"python3\"\nargs = [{}]\nenv = {{ CHATBANK_LOG = {} }}\n[providers.sandbox]\nread = [{}]\nwrite = [{}]\n",
            q(script),
            q(&log.display().to_string()),
            q(PYTHON_DIR),
            q(&logs.display().to_string())
        ),
    )
    .expect("cfg");
}

fn calls_reached(b: &TestBroker) -> Vec<String> {
    std::fs::read_to_string(b.dir.path().join("logs/calls.log"))
        .expect("log")
        .lines()
        .map(str::to_owned)
        .collect()
}

fn outcome(r: &Value) -> String {
    let m = meta(&r["result"]);
    format!(
        "{}/{}",
        m["outcome"].as_str().unwrap_or("?"),
        m["code"].as_str().unwrap_or("?")
    )
}

async fn providers(b: &TestBroker) -> Vec<Value> {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brokered_call_is_decided_on_its_arguments() {
    let broker = broker(POLICY, "").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let cases = [
        (
            "chat.post",
            json!({"channel": "public", "text": "hi"}),
            "succeeded/ok",
        ),
        (
            "chat.post",
            json!({"channel": "exec", "text": "hi"}),
            "denied/no_permit",
        ),
        (
            "chat.post",
            json!({"channel": "PUBLIC", "text": "hi"}),
            "denied/no_permit",
        ),
        (
            "chat.transfer",
            json!({"amount": 100, "to": "bob"}),
            "succeeded/ok",
        ),
        (
            "chat.transfer",
            json!({"amount": 101, "to": "bob"}),
            "denied/no_permit",
        ),
        (
            "chat.transfer",
            json!({"amount": -5, "to": "bob", "memo": {"note": "x"}}),
            "succeeded/ok",
        ),
        // Fails the tool's schema: never reaches the policy.
        (
            "chat.transfer",
            json!({"amount": 1.5, "to": "bob"}),
            "failed/invalid_arguments",
        ),
        (
            "chat.transfer",
            json!({"amount": "50", "to": "bob"}),
            "failed/invalid_arguments",
        ),
    ];
    for (i, (tool, args, want)) in cases.iter().enumerate() {
        let r = raw.call(i as i64 + 1, tool, args.clone()).await;
        assert_eq!(outcome(&r), *want, "{tool} {args}: {r}");
    }
    let reached = calls_reached(&broker);
    assert_eq!(
        reached,
        vec![
            r#"post {"channel": "public", "text": "hi"}"#.to_owned(),
            r#"transfer {"amount": 100, "to": "bob"}"#.to_owned(),
            r#"transfer {"amount": -5, "memo": {"note": "x"}, "to": "bob"}"#.to_owned(),
        ],
        "only the permitted calls reached the upstream"
    );
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), cases.len(), "every call recorded");
    assert_eq!(calls.iter().filter(|c| c["code"] == "no_permit").count(), 3);
    // `policy check`: the decision, the policies and the context the policy saw.
    let mut check = broker.cli();
    check.args([
        "policy",
        "check",
        "--principal",
        "alice",
        "--tool",
        "chat.transfer",
        "--args",
        r#"{"amount": 7, "to": "bob", "rate": 0.5}"#,
        "--json",
    ]);
    let (code, out, err) = run(check).await;
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["decision"], "allow", "{v}");
    assert_eq!(v["policies"], json!(["alice-transfers"]), "{v}");
    // `rate` is a number: 0.5 is left out of what the policy sees.
    assert_eq!(
        v["context"]["arguments"],
        json!({"amount": 7, "to": "bob"}),
        "{v}"
    );
    let mut check = broker.cli();
    check.args([
        "policy",
        "check",
        "--principal",
        "alice",
        "--tool",
        "chat.post",
        "--args",
        r#"{"channel": "exec", "text": "x"}"#,
    ]);
    let (code, out, _) = run(check).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(r#""channel":"exec""#),
        "the context it saw: {out}"
    );
    // `providers` says what a policy cannot see of each tool's arguments.
    let list = providers(&broker).await;
    let chat = list
        .iter()
        .find(|p| p["namespace"] == "chat")
        .expect("chat");
    let left = chat["arguments_left_out"]["chat.transfer"].to_string();
    assert!(left.contains("`rate`"), "{chat}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_argument_is_refused_at_start_and_at_reload() {
    let typo: &'static str = POLICY
        .replace(
            "context.arguments has channel && context.arguments.channel",
            "context.arguments has chanel && context.arguments.chanel",
        )
        .leak();
    // At start: the upstream listed its tools, none has `chanel`.
    let mut b = TestBroker::start(Options::default()).await;
    append_provider(&b);
    std::fs::write(b.dir.path().join("policy.cedar"), typo).expect("w");
    b.stop().await;
    let config = sharedos_broker::Config::from_file(&b.config_path).expect("config");
    let err = sharedos_broker::start(
        config,
        b.runtime.clone(),
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .err()
    .expect("refused")
    .to_string();
    assert!(err.contains("policy.cedar:5:"), "file and line: {err}");
    assert!(
        err.contains("`context.arguments.chanel`"),
        "the argument: {err}"
    );
    assert!(err.contains("channel"), "what the tools have: {err}");
    // At reload: the set in force stays.
    std::fs::write(b.dir.path().join("policy.cedar"), POLICY).expect("w");
    b.restart().await;
    std::fs::write(b.dir.path().join("policy.cedar"), typo).expect("w");
    let mut reload = b.cli();
    reload.args(["policy", "reload"]);
    let (code, _, err) = run(reload).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("policy.cedar:5:") && err.contains("chanel"),
        "{err}"
    );
    assert!(err.contains("previous policy set stays"), "{err}");
    let turn = b.open_turn("alice").await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(1, "chat.post", json!({"channel": "public", "text": "hi"}))
        .await;
    assert_eq!(outcome(&r), "succeeded/ok", "the old set decides: {r}");
    // A set that loads: `policy_reloaded` names it by its file's SHA-256, as `broker_started`
    // does; the refused one left no line.
    let fixed = format!("{POLICY}// fixed\n");
    std::fs::write(b.dir.path().join("policy.cedar"), &fixed).expect("w");
    let mut reload = b.cli();
    reload.args(["policy", "reload"]);
    let (code, out, err) = run(reload).await;
    assert_eq!(code, 0, "{out}{err}");
    let reloaded: Vec<Value> = b
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "policy_reloaded")
        .collect();
    assert_eq!(reloaded.len(), 1, "{reloaded:?}");
    assert_eq!(
        reloaded[0]["policyDigest"],
        sha256_hex(fixed.as_bytes()),
        "{reloaded:?}"
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_renames_an_argument_has_the_policies_validated_again() {
    let broker = broker(POLICY, "").await;
    assert!(
        providers(&broker)
            .await
            .iter()
            .all(|p| p.get("policy_warnings").is_none()),
        "no warnings before the drift"
    );
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw.call(1, "chat.rename", json!({})).await;
    assert_eq!(outcome(&r), "succeeded/ok", "{r}");
    // The upstream lists `post {room, text}` now: the policy reading `channel` is named.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let warnings = loop {
        let list = providers(&broker).await;
        let chat = list.iter().find(|p| p["namespace"] == "chat").cloned();
        if let Some(w) = chat.and_then(|c| c.get("policy_warnings").cloned()) {
            break w.to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the policy set was not validated again: {list:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(warnings.contains("policy.cedar:5:"), "{warnings}");
    assert!(
        warnings.contains("`context.arguments.channel`"),
        "{warnings}"
    );
    assert!(warnings.contains("alice-public"), "{warnings}");
    // A new turn: `chat.post` now has no argument the permit could see, so no call of it can
    // be permitted, and the catalogue does not offer it.
    let later = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(later.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(1, "chat.post", json!({"room": "public", "text": "hi"}))
        .await;
    assert_eq!(outcome(&r), "denied/unpublished_tool", "{r}");
    assert_eq!(
        calls_reached(&broker).len(),
        1,
        "only the rename reached it"
    );
}

/// Forbids transfers over 50: alice's transfer of 100 would now be denied.
const OVER_50: &str = r#"
@id("over-50")
forbid(principal, action, resource)
when { context.arguments has amount && context.arguments.amount > 50 };
"#;

/// A stopped broker's record of alice's calls: a post to #public, one to #exec, a transfer of
/// 100.
async fn recorded(top: &str) -> TestBroker {
    let mut b = broker(POLICY, top).await;
    let turn = b.open_turn("alice").await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    for (i, (tool, args, want)) in [
        (
            "chat.post",
            json!({"channel": "public", "text": "a"}),
            "succeeded/ok",
        ),
        (
            "chat.post",
            json!({"channel": "exec", "text": "b"}),
            "denied/no_permit",
        ),
        (
            "chat.transfer",
            json!({"amount": 100, "to": "bob"}),
            "succeeded/ok",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let r = raw.call(i as i64 + 1, tool, args).await;
        assert_eq!(outcome(&r), want, "{r}");
    }
    drop(raw.close_stdin().await);
    b.close_turn(&turn.turn).await;
    b.stop().await;
    b
}

fn replay(b: &TestBroker, record: Option<&std::path::Path>) -> std::process::Command {
    let policy = b.dir.path().join("over50.cedar");
    std::fs::write(&policy, format!("{POLICY}{OVER_50}")).expect("w");
    let mut cmd = b.cli();
    cmd.args(["policy", "replay", "--json", "--config"])
        .arg(&b.config_path)
        .arg("--policy")
        .arg(&policy);
    if let Some(r) = record {
        cmd.arg("--record").arg(r);
    }
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_verifies_the_record_and_decides_again_on_the_recorded_arguments() {
    let b = recorded("").await;
    // The record names the policy set that decided: its file's SHA-256.
    let digest = {
        use sha2::Digest as _;
        sha2::Sha256::digest(POLICY.as_bytes())
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    };
    let started: Vec<Value> = b
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "broker_started")
        .collect();
    assert_eq!(started.len(), 2, "two starts: {started:?}");
    assert_eq!(started[1]["policyDigest"], digest.as_str(), "{started:?}");
    let (code, out, err) = run(replay(&b, None)).await;
    assert_eq!(code, 3, "{out}{err}");
    let report: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(report["replayable"], 3, "{report}");
    assert_eq!(report["allowedToDenied"], 1, "{report}");
    assert_eq!(report["deniedToAllowed"], 0, "{report}");
    let changes = report["changes"].as_array().expect("changes");
    assert_eq!(changes.len(), 1, "{report}");
    assert_eq!(changes[0]["tool"], "chat.transfer");
    assert_eq!(changes[0]["new"]["policies"], json!(["over-50"]));
    // A record changed after it was written is not replayed.
    let copy = b.dir.path().join("changed.jsonl");
    let text = std::fs::read_to_string(b.record_path()).expect("record");
    assert!(text.contains(r#""channel":"exec""#));
    std::fs::write(
        &copy,
        text.replace(r#""channel":"exec""#, r#""channel":"pub""#),
    )
    .expect("w");
    let (code, out, err) = run(replay(&b, Some(&copy))).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("does not verify") && err.contains("changed.jsonl"),
        "{err}"
    );
    assert!(out.is_empty(), "nothing replayed: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_redacted_arguments_cannot_be_replayed_on_them_and_says_so() {
    let b = recorded("redact_arguments = true\n").await;
    let (code, out, err) = run(replay(&b, None)).await;
    assert_eq!(code, 0, "{out}{err}");
    let report: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(report["calls"], 3, "{report}");
    assert_eq!(report["notReplayable"], 3, "{report}");
    assert_eq!(report["replayable"], 0, "{report}");
    let why = report["notReplayableWhy"].to_string();
    assert!(why.contains("redact_arguments = true"), "{why}");
    assert!(why.contains("cannot be replayed on arguments"), "{why}");
}

const PAY_POLICY: &str = r#"@id("alice-pays-small")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool)
when { resource.name == "r.pay"
       && context.arguments has amount && context.arguments.amount < 100
       && context.arguments has to && context.arguments.to has channel
       && ["public", "team"].contains(context.arguments.to.channel)
       && context.arguments has tags && ["ops", "docs", "travel"].containsAll(context.arguments.tags) };

@id("never-exec")
forbid(principal, action == SharedOS::Action::"call", resource)
when { context.arguments has to && context.arguments.to has channel
       && context.arguments.to.channel == "exec" };

@id("rate-cap")
forbid(principal, action == SharedOS::Action::"call", resource)
when { context.arguments has rate && context.arguments.rate > 2 };
"#;

/// A remote PyPI `MCPServer` over Streamable HTTP (tests/python/remote_server.py) whose `pay`
/// tool takes an integer `amount`, a nested model `to: {channel, name}` (the SDK writes it as a
/// `$ref` into `$defs`), an array of strings `tags` and a float `rate`. The policy permits
/// alice payments under 100 to #public or #team with tags from a set, and forbids #exec and a
/// rate over 2. Each call is decided on those typed arguments; the server logs exactly the
/// permitted payments (a denied call never reaches it). A fraction cannot be a Cedar value:
/// `rate = 2.5` is left out of `context.arguments`, so the policy decides as if no rate were
/// given (the `rate-cap` forbid does not see it and the call is permitted), and `providers` and
/// `catalog` say that `rate` is left out. An amount that is not an integer fails the tool's
/// schema and never reaches the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn a_remote_server_is_decided_on_integer_nested_and_set_arguments() {
    let Some(py) = crate::remote::python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let server = crate::remote::Server::start(&py, &dir.path().join("server.log"), &[]).await;
    let mut b = TestBroker::start(Options::default()).await;
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        format!(
            "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = {}\n",
            q(&server.url())
        ),
    )
    .expect("cfg");
    std::fs::write(b.dir.path().join("policy.cedar"), PAY_POLICY).expect("w");
    b.restart().await;
    let turn = b.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(names, ["r.pay"], "only pay can be permitted: {names:?}");
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let pay = |amount: Value, channel: &str, tags: Value, rate: Option<Value>| {
        let mut a =
            json!({"amount": amount, "to": {"channel": channel, "name": "bob"}, "tags": tags});
        if let Some(r) = rate {
            a["rate"] = r;
        }
        a
    };
    let cases = [
        (
            pay(json!(50), "public", json!(["ops"]), None),
            "succeeded/ok",
        ),
        (
            pay(json!(99), "team", json!(["ops", "docs"]), Some(json!(2))),
            "succeeded/ok",
        ),
        (
            pay(json!(100), "public", json!(["ops"]), None),
            "denied/no_permit",
        ),
        (
            pay(json!(-7), "private", json!(["ops"]), None),
            "denied/no_permit",
        ),
        (
            pay(json!(5), "public", json!(["ops", "payroll"]), None),
            "denied/no_permit",
        ),
        (
            pay(json!(5), "exec", json!(["ops"]), None),
            "denied/forbidden",
        ),
        (
            pay(json!(5), "public", json!(["ops"]), Some(json!(3))),
            "denied/forbidden",
        ),
        // Left out: the policy cannot see 2.5, and decides as if no rate were given.
        (
            pay(json!(5), "public", json!(["travel"]), Some(json!(2.5))),
            "succeeded/ok",
        ),
        (
            pay(json!(1.5), "public", json!(["ops"]), None),
            "failed/invalid_arguments",
        ),
    ];
    for (i, (args, want)) in cases.iter().enumerate() {
        let r = raw.call(i as i64 + 1, "r.pay", args.clone()).await;
        assert_eq!(outcome(&r), *want, "{args}: {r}");
    }
    assert_eq!(
        server.lines("effect pay"),
        [
            "effect pay 50 public/bob [ops] 1.0",
            "effect pay 99 team/bob [ops,docs] 2.0",
            "effect pay 5 public/bob [travel] 2.5",
        ],
        "exactly the permitted payments reached the server"
    );
    let calls = b.calls_of(&turn.turn);
    assert_eq!(calls.len(), cases.len(), "every call recorded");
    let count = |code: &str| calls.iter().filter(|c| c["code"] == code).count();
    assert_eq!(
        (count("ok"), count("no_permit"), count("forbidden")),
        (3, 3, 2),
        "{calls:?}"
    );
    assert_eq!(calls[5]["policies"], json!(["never-exec"]));
    assert_eq!(calls[6]["policies"], json!(["rate-cap"]));
    assert_eq!(calls[7]["policies"], json!(["alice-pays-small"]));
    // What the policy saw of the fraction: nothing.
    let mut check = b.cli();
    check.args([
        "policy",
        "check",
        "--principal",
        "alice",
        "--tool",
        "r.pay",
        "--json",
        "--args",
    ]);
    check.arg(pay(json!(5), "public", json!(["travel"]), Some(json!(2.5))).to_string());
    let (code, out, err) = run(check).await;
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        v["context"]["arguments"],
        json!({"amount": 5, "to": {"channel": "public", "name": "bob"}, "tags": ["travel"]}),
        "{v}"
    );
    // `providers` and `catalog` say which argument is left out.
    let list = providers(&b).await;
    let remote = list.iter().find(|p| p["namespace"] == "r").expect("r");
    let left = remote["arguments_left_out"]["r.pay"].to_string();
    assert!(
        left.contains("`rate`") && left.contains("not an integer"),
        "{remote}"
    );
    assert!(
        !left.contains("`amount`") && !left.contains("`to"),
        "{left}"
    );
    let mut catalog = b.cli();
    catalog.args(["catalog", "--principal", "alice", "--json"]);
    let (code, out, err) = run(catalog).await;
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    let left = v["argumentsLeftOut"]["r.pay"].to_string();
    assert!(left.contains("`rate`"), "{v}");
    let mut catalog = b.cli();
    catalog.args(["catalog", "--principal", "alice"]);
    let (code, out, _) = run(catalog).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("not in context.arguments: `rate`"),
        "the text form says it too: {out}"
    );
}
