//! Brokered MCP providers with real third-party servers (installed by
//! `.ci/install-mcp-servers`): npm server-everything and server-filesystem, PyPI mcp-server-time.
//! Their calls go through the kernel exactly like a built-in one: catalogue, arguments,
//! requirement from the arguments, Cedar, record.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use sharedos_proto::ipc::{ControlRequest, ControlResponse};

use crate::kit::{Options, Raw, TestBroker, eventually, meta, run, text};

pub(crate) fn servers() -> Option<BTreeMap<String, String>> {
    crate::kit::installed("mcp-servers", ".ci/install-mcp-servers")
}

pub(crate) fn q(s: &str) -> String {
    serde_json::to_string(s).expect("quote")
}

/// A temp folder that is an upstream's write folder made writable by any uid: under a root
/// broker the upstream runs under a uid of its own (issue 42), not root's.
pub(crate) fn open_to_every_uid(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
}

/// A `[providers.sandbox]` table (issue 32): what the upstream may read and write besides the
/// defaults (the system, the command's own folder, its templates' `file_root`s).
pub(crate) fn sandboxed(read: &[&str], write: &[&str]) -> String {
    let list = |l: &[&str]| l.iter().map(|p| q(p)).collect::<Vec<_>>().join(", ");
    format!(
        "[providers.sandbox]\nread = [{}]\nwrite = [{}]\n",
        list(read),
        list(write)
    )
}

/// An npm server's package folder (its `node_modules` and everything it loads), from the path
/// of its entry file.
pub(crate) fn package(entry: &str) -> &str {
    entry.split("/node_modules/").next().unwrap_or(entry)
}

const PYTHON_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python");

fn everything(s: &BTreeMap<String, String>, ns: &str) -> String {
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{ns}\"\ncommand = {}\nargs = [{}, {}]\ncall_timeout_seconds = 3\n{}",
        q(&s["EVERYTHING_CMD"]),
        q(&s["EVERYTHING_ARGS"]),
        q(&s["EVERYTHING_ARG2"]),
        sandboxed(&[package(&s["EVERYTHING_ARGS"])], &[])
    )
}

fn time(s: &BTreeMap<String, String>, ns: &str, scope: Option<&str>) -> String {
    let mut t = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{ns}\"\ncommand = {}\nargs = [{}]\n",
        q(&s["TIME_CMD"]),
        q(&s["TIME_ARGS"])
    );
    if let Some(p) = scope {
        t.push_str(&format!("scope = {{ principal = \"{p}\" }}\n"));
    }
    // Its virtualenv is the command's folder's parent: readable by default.
    t
}

fn filesystem(s: &BTreeMap<String, String>, data: &str) -> String {
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"fs\"\ncommand = {cmd}\nargs = [{args}, {data}]\n\
         [providers.tools.read_text_file]\naction = \"read\"\nfile = \"{{path}}\"\nfile_root = {data}\n\
         [providers.tools.list_directory]\naction = \"list\"\nfile = \"{{path}}\"\nfile_root = {data}\n{sb}",
        cmd = q(&s["FILESYSTEM_CMD"]),
        args = q(&s["FILESYSTEM_ARGS"]),
        data = q(data),
        sb = sandboxed(&[package(&s["FILESYSTEM_ARGS"])], &[]),
    )
}

const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-tools")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name == "everything.echo" || resource.name == "everything.get-sum"
    || resource.name == "everything.trigger-long-running-operation"
    || resource.name == "everything.get-structured-content"
    || resource.name == "a.get_current_time" || resource.name like "t.*"
    || resource.name like "alice_time.*" };

@id("bob-time")
permit(principal == SharedOS::User::"bob", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "*get_current_time" };
"#;

/// A broker whose config has the given provider entries (after the files provider).
async fn broker_with(extra: &str) -> TestBroker {
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

async fn call(raw: &mut Raw, id: i64, tool: &str, args: Value) -> Value {
    raw.call(id, tool, args).await["result"].clone()
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

fn state_of(list: &[Value], ns: &str) -> String {
    list.iter()
        .find(|p| p["namespace"] == ns)
        .map(|p| p["state"].as_str().unwrap_or("").to_owned())
        .unwrap_or_default()
}

/// The pid of an upstream process (a child of this test process whose command line has `needle`).
fn upstream_pid(needle: &str) -> Option<i32> {
    let me = std::process::id().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if pid.parse::<i32>().is_err() {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(1))
            .unwrap_or("");
        let cmd = std::fs::read_to_string(entry.path().join("cmdline")).unwrap_or_default();
        if ppid == me && cmd.contains(needle) {
            return pid.parse().ok();
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn everything_server_behind_the_kernel() {
    let Some(s) = servers() else { return };
    let broker = broker_with(&everything(&s, "everything")).await;
    let turn = broker.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    // Shown: exactly the upstream tools some call could be permitted (plus the files tools).
    for n in [
        "everything.echo",
        "everything.get-sum",
        "everything.trigger-long-running-operation",
        "files.read",
    ] {
        assert!(names.contains(&n.to_owned()), "{n} in {names:?}");
    }
    assert!(
        !names.contains(&"everything.get-env".to_owned()),
        "no permit applies: hidden"
    );
    let meta_ns = turn
        .tools
        .iter()
        .find(|t| t.name.as_str() == "everything.echo")
        .and_then(|t| t.metadata.clone())
        .expect("meta");
    assert_eq!(meta_ns.source.as_deref(), Some("mcp:everything"));

    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let r = call(&mut raw, 1, "everything.echo", json!({"message": "hi"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "Echo: hi");
    let r = call(&mut raw, 2, "everything.get-sum", json!({"a": 2, "b": 3})).await;
    assert_eq!(text(&r), "The sum of 2 and 3 is 5.");
    let r = call(
        &mut raw,
        3,
        "everything.get-structured-content",
        json!({"location": "Chicago"}),
    )
    .await;
    assert!(
        r["structuredContent"]["temperature"].is_number(),
        "structuredContent passes through: {r}"
    );
    let r = call(&mut raw, 4, "everything.get-env", json!({})).await;
    assert_eq!(meta(&r)["code"], "unpublished_tool");
    let r = call(&mut raw, 5, "everything.get-sum", json!({"a": "x", "b": 1})).await;
    assert_eq!(
        meta(&r)["code"],
        "invalid_arguments",
        "checked against the upstream's own inputSchema"
    );

    // A call past the provider's time limit (3 s) fails with timeout, and the session goes on.
    let r = call(
        &mut raw,
        6,
        "everything.trigger-long-running-operation",
        json!({"duration": 8, "steps": 2}),
    )
    .await;
    assert_eq!(meta(&r)["code"], "timeout", "{r}");

    // Client cancellation is forwarded and recorded.
    raw.send(json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "everything.trigger-long-running-operation", "arguments": {"duration": 2, "steps": 2}}})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}),
    )
    .await;
    let t = turn.turn.clone();
    eventually("the cancelled call is recorded", || {
        broker
            .calls_of(&t)
            .iter()
            .any(|c| c["outcome"] == "cancelled")
    })
    .await;
    let r = call(&mut raw, 8, "everything.echo", json!({"message": "after"})).await;
    assert_eq!(text(&r), "Echo: after");

    // The upstream dies mid-call: the call fails with a clear code, and the next call works once
    // it has been restarted.
    raw.send(json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
        "params": {"name": "everything.trigger-long-running-operation", "arguments": {"duration": 2, "steps": 1}}})).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = upstream_pid("server-everything").expect("upstream pid");
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    let r = raw.response(9).await["result"].clone();
    assert_eq!(meta(&r)["code"], "upstream_unavailable", "{r}");
    let mut state = String::new();
    for _ in 0..100 {
        state = state_of(&providers(&broker).await, "everything");
        if state == "ready" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, "ready");
    let r = call(
        &mut raw,
        10,
        "everything.echo",
        json!({"message": "restarted"}),
    )
    .await;
    assert_eq!(text(&r), "Echo: restarted");
    assert!(upstream_pid("server-everything").is_some_and(|p| p != pid));
    let lines = broker.records();
    assert!(
        lines
            .iter()
            .any(|l| l["kind"] == "provider_state" && l["state"] == "restarting")
    );
    // Every call above, refused or not, is recorded with the name the harness sent.
    assert_eq!(broker.calls_of(&turn.turn).len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn cancellation_reaches_the_upstream_as_notifications_cancelled() {
    let Some(s) = servers() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    open_to_every_uid(dir.path());
    let tap_log = dir.path().join("tap.jsonl");
    let tap = concat!(env!("CARGO_MANIFEST_DIR"), "/python/tap.py");
    let extra = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"everything\"\ncommand = \"python3\"\nargs = [{}, {}, {}, {}]\nenv = {{ TAP_LOG = {} }}\n{}",
        q(tap),
        q(&s["EVERYTHING_CMD"]),
        q(&s["EVERYTHING_ARGS"]),
        q(&s["EVERYTHING_ARG2"]),
        q(&tap_log.display().to_string()),
        sandboxed(
            &[PYTHON_DIR, package(&s["EVERYTHING_ARGS"])],
            &[&dir.path().display().to_string()]
        )
    );
    let broker = broker_with(&extra).await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "everything.trigger-long-running-operation", "arguments": {"duration": 2, "steps": 2}}})).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    raw.send(json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1, "reason": "test"}})).await;
    eventually("the upstream receives notifications/cancelled", || {
        std::fs::read_to_string(&tap_log)
            .unwrap_or_default()
            .contains("notifications/cancelled")
    })
    .await;
    let log = std::fs::read_to_string(&tap_log).expect("tap log");
    let call_line = log
        .lines()
        .find(|l| l.contains("trigger-long-running-operation"))
        .expect("call went upstream");
    let call: Value = serde_json::from_str(call_line).expect("json");
    assert_eq!(
        call["params"]["name"], "trigger-long-running-operation",
        "the upstream's own name"
    );
    let cancel: Value = serde_json::from_str(
        log.lines()
            .find(|l| l.contains("notifications/cancelled"))
            .expect("cancel"),
    )
    .expect("json");
    assert_eq!(
        cancel["params"]["requestId"], call["id"],
        "the cancel names the upstream request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn filesystem_server_authorized_from_its_arguments() {
    let Some(s) = servers() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let data = std::fs::canonicalize(dir.path())
        .expect("canon")
        .join("fsdata");
    std::fs::create_dir_all(data.join("public")).expect("mk");
    std::fs::create_dir_all(data.join("private")).expect("mk");
    std::fs::write(data.join("public/a.txt"), "hello public\n").expect("w");
    std::fs::write(data.join("private/b.txt"), "private\n").expect("w");
    std::os::unix::fs::symlink(data.join("private/b.txt"), data.join("public/link")).expect("ln");
    let d = data.display().to_string();
    let broker = broker_with(&filesystem(&s, &d)).await;
    let turn = broker.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    assert!(
        names.contains(&"fs.read_text_file".to_owned())
            && names.contains(&"fs.list_directory".to_owned()),
        "{names:?}"
    );
    assert!(
        !names.contains(&"fs.write_file".to_owned()),
        "no permit for call on fs.write_file: hidden"
    );
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let cases = [
        (format!("{d}/public/a.txt"), "succeeded", "ok"),
        (format!("{d}/private/b.txt"), "denied", "no_permit"),
        (
            format!("{d}/public/../private/b.txt"),
            "denied",
            "no_permit",
        ),
        (format!("{d}/public/link"), "denied", "no_permit"),
        (
            "/etc/passwd".to_owned(),
            "denied",
            "unresolvable_requirement",
        ),
        (
            "public/a.txt".to_owned(),
            "denied",
            "unresolvable_requirement",
        ),
        (
            format!("{d}/public/missing.txt"),
            "failed",
            "upstream_error",
        ),
    ];
    for (i, (path, outcome, code)) in cases.iter().enumerate() {
        let r = call(
            &mut raw,
            i as i64 + 1,
            "fs.read_text_file",
            json!({"path": path}),
        )
        .await;
        assert_eq!(
            (meta(&r)["outcome"].as_str(), meta(&r)["code"].as_str()),
            (Some(*outcome), Some(*code)),
            "{path}: {r}"
        );
    }
    let r = call(
        &mut raw,
        20,
        "fs.read_text_file",
        json!({"path": format!("{d}/public/a.txt")}),
    )
    .await;
    assert_eq!(text(&r), "hello public\n");
    assert_eq!(r["structuredContent"]["content"], "hello public\n");
    let r = call(
        &mut raw,
        21,
        "fs.list_directory",
        json!({"path": format!("{d}/private")}),
    )
    .await;
    assert_eq!(meta(&r)["code"], "no_permit");
    let r = call(
        &mut raw,
        22,
        "fs.read_text_file",
        json!({"path": format!("{d}/public/missing.txt")}),
    )
    .await;
    assert!(text(&r).starts_with("failed: fs.read_text_file of /public/missing.txt — the upstream server reported an error"), "{r}");
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(
        calls[0]["requirement"]["resource"],
        "SharedOS::File::\"/public/a.txt\""
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn a_template_naming_a_missing_argument_stops_the_broker_at_start() {
    let Some(s) = servers() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = crate::kit::write_config(dir.path(), &Options::default());
    // The server's folder holds none of the broker's files (a rule on the config's folder is
    // refused at load for that alone).
    let files = dir.path().join("files");
    std::fs::create_dir(&files).expect("mkdir");
    let files = files.display().to_string();
    let extra = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"fs\"\ncommand = {}\nargs = [{}, {}]\n[providers.tools.read_text_file]\naction = \"read\"\nfile = \"{{nope}}\"\n{}",
        q(&s["FILESYSTEM_CMD"]),
        q(&s["FILESYSTEM_ARGS"]),
        q(&files),
        sandboxed(&[package(&s["FILESYSTEM_ARGS"]), &files], &[])
    );
    let text = std::fs::read_to_string(&cfg).expect("cfg");
    std::fs::write(&cfg, format!("{text}{extra}")).expect("w");
    let mut serve = std::process::Command::new(crate::kit::bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(dir.path().join("run"))
        .arg("--config")
        .arg(&cfg);
    let (code, _, err) = run(serve).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("`nope`") && err.contains("read_text_file"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn two_providers_with_one_upstream_name_and_a_policy_for_one() {
    let Some(s) = servers() else { return };
    let broker = broker_with(&format!("{}{}", time(&s, "a", None), time(&s, "b", None))).await;
    let turn = broker.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    assert!(names.contains(&"a.get_current_time".to_owned()));
    assert!(
        !names.contains(&"b.get_current_time".to_owned()),
        "{names:?}"
    );
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = call(
        &mut raw,
        1,
        "a.get_current_time",
        json!({"timezone": "UTC"}),
    )
    .await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(
        r["structuredContent"]["timezone"], "UTC",
        "the Python server's structuredContent passes through"
    );
    let r = call(
        &mut raw,
        2,
        "b.get_current_time",
        json!({"timezone": "UTC"}),
    )
    .await;
    assert_eq!(meta(&r)["code"], "unpublished_tool");
    let r = call(
        &mut raw,
        3,
        "a.get_current_time",
        json!({"timezone": "Bad/Zone"}),
    )
    .await;
    assert_eq!(meta(&r)["code"], "upstream_error", "{r}");
    // Both registrations exist, separately.
    let list = providers(&broker).await;
    assert_eq!(
        list.iter()
            .filter(|p| p["tools"].to_string().contains("get_current_time"))
            .count(),
        2
    );
    let mut cli = broker.cli();
    cli.arg("providers");
    let (code, out, _) = run(cli).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("a (mcp) ready") && out.contains("b (mcp) ready"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn a_per_context_provider_exists_only_in_its_contexts() {
    let Some(s) = servers() else { return };
    let broker = broker_with(&time(&s, "alice_time", Some("alice"))).await;
    let (a1, a2, b) = tokio::join!(
        broker.open_turn("alice"),
        broker.open_turn("alice"),
        broker.open_turn("bob")
    );
    let has = |t: &sharedos_proto::ipc::TurnOpened| {
        t.tools
            .iter()
            .any(|x| x.name.as_str().starts_with("alice_time."))
    };
    assert!(has(&a1) && has(&a2));
    assert!(
        !has(&b),
        "another principal never sees it, though its policy would permit the name"
    );
    assert_eq!(a1.catalog_hash, a2.catalog_hash);
    assert_ne!(a1.catalog_hash, b.catalog_hash);
    // Concurrent calls from both principals.
    let mut ra = Raw::spawn(broker.shim_command(a1.token.expose()));
    let mut rb = Raw::spawn(broker.shim_command(b.token.expose()));
    ra.initialize("2025-06-18").await;
    rb.initialize("2025-06-18").await;
    let (x, y) = tokio::join!(
        call(
            &mut ra,
            1,
            "alice_time.get_current_time",
            json!({"timezone": "UTC"})
        ),
        call(
            &mut rb,
            1,
            "alice_time.get_current_time",
            json!({"timezone": "UTC"})
        ),
    );
    assert_eq!(meta(&x)["outcome"], "succeeded", "{x}");
    assert_eq!(meta(&y)["code"], "unpublished_tool", "{y}");
    // Bob's catalogue (and its hash) is what it would be without the scoped provider.
    let plain = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    assert_eq!(plain.open_turn("bob").await.catalog_hash, b.catalog_hash);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn a_drifted_upstream_is_held_back_until_re_pinned() {
    let Some(s) = servers() else { return };
    // Namespace `t` first runs the time server; it is pinned; then the same namespace runs a
    // server with other tools (as an upgrade would), and must be held back.
    let pins = "pins = \"pins.toml\"\n";
    let mut broker = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    let base = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!("{pins}{base}{}", time(&s, "t", None)),
    )
    .expect("w");
    broker.restart().await;
    let mut pin = broker.cli();
    pin.args(["providers", "pin"]);
    let (code, out, err) = run(pin).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("t = "), "{out}");
    assert!(
        broker
            .open_turn("alice")
            .await
            .tools
            .iter()
            .any(|t| t.name.as_str() == "t.get_current_time")
    );
    // The upstream changes under the pin.
    let drifted = everything(&s, "t");
    std::fs::write(&broker.config_path, format!("{pins}{base}{drifted}")).expect("w");
    broker.restart().await;
    let list = providers(&broker).await;
    assert_eq!(state_of(&list, "t"), "drifted", "{list:#?}");
    let turn = broker.open_turn("alice").await;
    assert!(
        turn.tools
            .iter()
            .all(|t| !t.name.as_str().starts_with("t.")),
        "held back from every catalogue"
    );
    assert!(
        broker
            .records()
            .iter()
            .any(|l| l["kind"] == "provider_state" && l["state"] == "drifted")
    );
    let mut cli = broker.cli();
    cli.arg("providers");
    let (_, out, _) = run(cli).await;
    assert!(
        out.contains("t (mcp) drifted") && out.contains("held back"),
        "{out}"
    );
    // Re-pinning accepts the new tool list.
    let mut pin = broker.cli();
    pin.args(["providers", "pin"]);
    assert_eq!(run(pin).await.0, 0);
    assert_eq!(state_of(&providers(&broker).await, "t"), "ready");
    assert!(
        broker
            .open_turn("alice")
            .await
            .tools
            .iter()
            .any(|t| t.name.as_str() == "t.echo")
    );
}

/// A provider entry for `listing-upstream` (tests/src/bin) under namespace `ns`.
fn listing(ns: &str, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| q(a)).collect();
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{ns}\"\ncommand = {}\nargs = [{}]\n",
        q(env!("CARGO_BIN_EXE_listing-upstream")),
        args.join(", ")
    )
}

/// What `sharedos-broker providers --json` shows.
async fn providers_json(b: &TestBroker) -> Vec<Value> {
    let mut cli = b.cli();
    cli.args(["providers", "--json"]);
    let (code, out, err) = run(cli).await;
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("providers --json: {e}: {out}"))
}

fn provider<'a>(list: &'a [Value], ns: &str) -> &'a Value {
    list.iter()
        .find(|p| p["namespace"] == ns)
        .unwrap_or_else(|| panic!("no provider {ns} in {list:#?}"))
}

/// Polls `providers --json` until `check` holds for provider `ns` (bounded).
async fn until_provider(b: &TestBroker, ns: &str, what: &str, check: impl Fn(&Value) -> bool) {
    for _ in 0..100 {
        if check(provider(&providers_json(b).await, ns)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "timed out waiting for {what}: {:#?}",
        provider(&providers_json(b).await, ns)
    );
}

fn names_of(t: &sharedos_proto::ipc::TurnOpened) -> Vec<String> {
    t.tools.iter().map(|x| x.name.to_string()).collect()
}

async fn pin_providers(b: &TestBroker) {
    let mut pin = b.cli();
    pin.args(["providers", "pin"]);
    let (code, out, err) = run(pin).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("t = "), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_listed_twice_by_one_upstream_is_rejected_in_every_copy() {
    let broker = broker_with(&listing("t", &["--duplicate"])).await;
    let list = providers_json(&broker).await;
    let t = provider(&list, "t");
    assert_eq!(t["state"], "ready", "{t:#}");
    assert_eq!(t["tools"], json!(["t.echo"]), "{t:#}");
    let reason = "listed 2 times by this upstream; no copy is registered";
    assert_eq!(
        t["rejected"],
        json!([{"upstream": "dup", "reason": reason}, {"upstream": "dup", "reason": reason}]),
        "{t:#}"
    );
    let mut cli = broker.cli();
    cli.arg("providers");
    let (_, out, _) = run(cli).await;
    assert_eq!(
        out.matches(&format!("rejected \"dup\": {reason}")).count(),
        2,
        "{out}"
    );
    let turn = broker.open_turn("alice").await;
    let names = names_of(&turn);
    assert!(names.contains(&"t.echo".to_owned()), "{names:?}");
    assert!(!names.iter().any(|n| n == "t.dup"), "{names:?}");
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = call(&mut raw, 1, "t.dup", json!({"a": "x"})).await;
    assert_eq!(meta(&r)["code"], "unpublished_tool", "{r}");
    let r = call(&mut raw, 2, "t.echo", json!({"message": "one"})).await;
    assert_eq!(text(&r), "echo: one", "{r}");
    assert_eq!(broker.calls_of(&turn.turn).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_drifts_at_run_time_is_held_back_and_refused_until_re_pinned() {
    let mut broker = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    let base = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!("pins = \"pins.toml\"\n{base}{}", listing("t", &[])),
    )
    .expect("w");
    broker.restart().await;
    pin_providers(&broker).await;
    let pinned = provider(&providers_json(&broker).await, "t").clone();
    assert_eq!(pinned["state"], "ready", "{pinned:#}");
    assert_eq!(pinned["upstreamHash"], pinned["pinnedHash"], "{pinned:#}");

    let old = broker.open_turn("alice").await;
    let names = names_of(&old);
    assert!(
        names.contains(&"t.echo".to_owned()) && names.contains(&"t.change".to_owned()),
        "{names:?}"
    );
    let mut raw = Raw::spawn(broker.shim_command(old.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = call(&mut raw, 1, "t.echo", json!({"message": "before"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "echo: before");
    // The upstream changes its list and says so.
    let r = call(&mut raw, 2, "t.change", json!({})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    until_provider(&broker, "t", "the provider to drift", |p| {
        p["state"] == "drifted"
    })
    .await;
    let drifted = provider(&providers_json(&broker).await, "t").clone();
    assert_eq!(drifted["tools"], json!([]), "{drifted:#}");
    assert_eq!(drifted["pinnedHash"], pinned["pinnedHash"], "{drifted:#}");
    assert_ne!(
        drifted["upstreamHash"], pinned["upstreamHash"],
        "{drifted:#}"
    );
    assert_eq!(
        broker
            .records()
            .iter()
            .filter(|l| l["kind"] == "provider_state"
                && l["provider"] == "t"
                && l["state"] == "drifted")
            .count(),
        1
    );

    // The turn opened before the drift still holds the tool: its call is refused, not run.
    let r = call(&mut raw, 3, "t.echo", json!({"message": "after drift"})).await;
    assert_eq!(
        (meta(&r)["outcome"].as_str(), meta(&r)["code"].as_str()),
        (Some("failed"), Some("provider_drifted")),
        "{r}"
    );
    assert_eq!(r["isError"], true, "{r}");
    assert!(
        text(&r).contains("providers pin") && !text(&r).contains("echo: after drift"),
        "{r}"
    );
    // A new turn does not get the provider's tools.
    let new = broker.open_turn("alice").await;
    let names = names_of(&new);
    assert!(
        names.iter().all(|n| !n.starts_with("t.")),
        "held back: {names:?}"
    );
    assert!(names.contains(&"files.read".to_owned()), "{names:?}");

    // Re-pinned: the new list is accepted, the old turn's calls work again, new turns see it.
    pin_providers(&broker).await;
    let repinned = provider(&providers_json(&broker).await, "t").clone();
    assert_eq!(repinned["state"], "ready", "{repinned:#}");
    assert_eq!(repinned["upstreamHash"], drifted["upstreamHash"]);
    assert_eq!(repinned["pinnedHash"], drifted["upstreamHash"]);
    let r = call(&mut raw, 4, "t.echo", json!({"message": "re-pinned"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "echo: re-pinned");
    let names = names_of(&broker.open_turn("alice").await);
    assert!(
        names.contains(&"t.echo".to_owned()) && names.contains(&"t.added".to_owned()),
        "{names:?}"
    );

    // Every call recorded once; the refused one once, with its code.
    let calls = broker.calls_of(&old.turn);
    assert_eq!(calls.len(), 4, "{calls:#?}");
    let refused: Vec<&Value> = calls
        .iter()
        .filter(|c| c["code"] == "provider_drifted")
        .collect();
    assert_eq!(refused.len(), 1, "{calls:#?}");
    assert_eq!(refused[0]["outcome"], "failed");
    assert_eq!(refused[0]["requestId"], "3", "{}", refused[0]);
    assert_eq!(
        calls.iter().filter(|c| c["outcome"] == "succeeded").count(),
        3,
        "{calls:#?}"
    );
    assert!(broker.calls_of(&new.turn).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpinned_upstream_that_changes_its_tools_is_listed_again() {
    let broker = broker_with(&listing("t", &[])).await;
    let old = broker.open_turn("alice").await;
    assert!(!names_of(&old).contains(&"t.added".to_owned()));
    let before = provider(&providers_json(&broker).await, "t").clone();
    let mut raw = Raw::spawn(broker.shim_command(old.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = call(&mut raw, 1, "t.change", json!({})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    until_provider(&broker, "t", "the new list", |p| {
        p["tools"].to_string().contains("t.added")
    })
    .await;
    let after = provider(&providers_json(&broker).await, "t").clone();
    assert_eq!(after["state"], "ready", "{after:#}");
    assert_ne!(after["upstreamHash"], before["upstreamHash"]);
    let new = broker.open_turn("alice").await;
    assert!(names_of(&new).contains(&"t.added".to_owned()));
    assert_ne!(new.catalog_hash, old.catalog_hash);
    // The turn opened before keeps its catalogue, and its calls go on.
    let r = call(&mut raw, 2, "t.echo", json!({"message": "still"})).await;
    assert_eq!(text(&r), "echo: still", "{r}");
    let r = call(&mut raw, 3, "t.added", json!({})).await;
    assert_eq!(meta(&r)["code"], "unpublished_tool", "{r}");
    assert_eq!(broker.calls_of(&old.turn).len(), 3);
    assert!(
        broker
            .records()
            .iter()
            .filter(|l| l["kind"] == "provider_state" && l["provider"] == "t")
            .any(|l| l["state"] == "ready" && l["tools"].to_string().contains("t.added"))
    );
}

/// Issue 31, item 11. A real Python upstream (`tests/python/noisy.py`, plain JSON-RPC) that
/// sends 20,000 `notifications/tools/list_changed`, 20,000 `notifications/message` (each with a
/// newline and a forged log line in it) and 20,000 stderr lines, at a broker run as a real
/// process with `SHAREDOS_LOG=info`: the MCP client library's own lines are off, the server's log
/// reaches the broker's log only as the broker's own lines, attributed to the provider, escaped,
/// cut and at most 20 per 10 s, and the broker goes on serving. Before: 40,000 lines, 13.5 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_flood_reaches_the_log_bounded() {
    /// The bounds asserted on the broker's whole stderr, its start and a turn included.
    const MAX_LINES: usize = 150;
    const MAX_BYTES: usize = 64 * 1024;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = crate::kit::write_config(
        dir.path(),
        &Options {
            policy: r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/public/*" };

@id("alice-echo")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool)
when { resource.name == "noisy.echo" };
"#,
            ..Options::default()
        },
    );
    let noisy = concat!(env!("CARGO_MANIFEST_DIR"), "/python/noisy.py");
    let base = std::fs::read_to_string(&cfg).expect("cfg");
    std::fs::write(
        &cfg,
        format!(
            "{base}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"noisy\"\ncommand = \"python3\"\nargs = [{}]\n{}",
            q(noisy),
            sandboxed(&[PYTHON_DIR], &[])
        ),
    )
    .expect("cfg");
    let run_dir = dir.path().join("run");
    let stderr_path = dir.path().join("broker.stderr");
    let mut serve = tokio::process::Command::new(crate::kit::bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(&run_dir)
        .arg("--config")
        .arg(&cfg)
        .env("SHAREDOS_LOG", "info")
        .kill_on_drop(true)
        .stderr(std::fs::File::create(&stderr_path).expect("stderr"));
    let mut broker = serve.spawn().expect("serve");
    let record = dir.path().join("record.jsonl");
    eventually("the broker serves", || {
        run_dir.join("control.sock").exists()
            && std::fs::read_to_string(&record)
                .unwrap_or_default()
                .contains("\"kind\":\"broker_started\"")
    })
    .await;
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
    let (code, out, err) = run(open).await;
    assert_eq!(code, 0, "turn open: {err}");
    let opened: Value = serde_json::from_str(&out).expect("json");
    let mut shim = tokio::process::Command::new(crate::kit::bin("sharedos-mcp-shim"));
    shim.env(
        "SHAREDOS_TURN_TOKEN",
        opened["token"].as_str().expect("token"),
    )
    .env("SHAREDOS_BROKER", run_dir.join("bridge.sock"))
    .kill_on_drop(true);
    let mut raw = Raw::spawn(shim);
    raw.initialize("2025-06-18").await;
    // The flood goes out once the broker has listed the tools; an answer from the upstream
    // comes after it on the same pipe, so the broker has read the flood once it has the answer.
    let started = std::time::Instant::now();
    let r = call(&mut raw, 1, "noisy.echo", json!({"text": "still here"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "still here");
    let read = started.elapsed();
    // Let the re-lists the announcements asked for and the stderr drain finish.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in 2..12 {
        let r = call(
            &mut raw,
            id,
            "noisy.echo",
            json!({"text": format!("call {id}")}),
        )
        .await;
        assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
        let r = call(
            &mut raw,
            100 + id,
            "files.read",
            json!({"path": "/public/hello.txt"}),
        )
        .await;
        assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    }
    assert!(
        broker.try_wait().expect("wait").is_none(),
        "the broker is running"
    );
    let log = std::fs::read_to_string(&stderr_path).expect("stderr");
    let lines: Vec<&str> = log.lines().collect();
    let relists = std::fs::read_to_string(&record)
        .unwrap_or_default()
        .matches("\"kind\":\"provider_state\"")
        .count();
    eprintln!(
        "the flood was read within {read:?}; the broker's stderr: {} lines, {} bytes; {relists} provider_state lines on record",
        lines.len(),
        log.len()
    );
    assert!(
        lines.len() <= MAX_LINES,
        "{} lines on the broker's stderr:\n{}",
        lines.len(),
        lines[..lines.len().min(60)].join("\n")
    );
    assert!(
        log.len() <= MAX_BYTES,
        "{} bytes on the broker's stderr",
        log.len()
    );
    // The library's own line for each notification is off.
    assert!(!log.contains("received notification"), "{log}");
    // The server's log, as the broker's own lines: attributed, escaped, bounded, counted.
    let upstream: Vec<&&str> = lines
        .iter()
        .filter(|l| l.contains("upstream log:"))
        .collect();
    assert!(!upstream.is_empty(), "{log}");
    assert!(
        upstream.len() <= 2 * 20,
        "{} upstream log lines",
        upstream.len()
    );
    for l in &upstream {
        assert!(l.contains("provider=noisy"), "{l}");
        assert!(l.contains("\\n"), "the newline is escaped: {l}");
        assert!(l.len() < 1024, "{} bytes: {l}", l.len());
        assert!(
            !l.contains(" ERROR "),
            "an upstream writes no ERROR line: {l}"
        );
    }
    assert!(
        lines
            .iter()
            .all(|l| !l.starts_with("ERROR FORGED") && !l.contains("FORGED-STDERR")),
        "{log}"
    );
    assert!(
        log.contains("log lines in 10 s: the rest are counted"),
        "the held-back lines are said: {log}"
    );
    // And counted: when the window ends, one line says how many (the 40,000 lines it was sent,
    // less the few written).
    let held_back = |log: &str| -> u64 {
        log.lines()
            .filter_map(|l| l.split_once("held_back=").map(|(_, n)| n))
            .filter_map(|n| n.split(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    eventually("the window's held-back count is said", || {
        held_back(&std::fs::read_to_string(&stderr_path).unwrap_or_default()) >= 39_900
    })
    .await;
    let log = std::fs::read_to_string(&stderr_path).expect("stderr");
    eprintln!("{log}");
    let lines = log.lines().count();
    assert!(lines <= MAX_LINES, "{lines} lines");
    assert!(log.len() <= MAX_BYTES, "{} bytes", log.len());
    drop(raw.close_stdin().await);
    let _ = broker.start_kill();
    let _ = broker.wait().await;
}

/// A two-argument template (`file = "{dir}/{name}"`, `file_root` set) in front of a real Python
/// upstream that opens `os.path.join(dir, name)`: an absolute `name` (which the join takes alone)
/// is refused even where the template's string names a decoy the agent made under `/public`,
/// and so is `/etc/hostname`, a `/` in `name` and a `..`; each refusal is recorded
/// `denied/unresolvable_requirement`, the upstream opens only what the policy decided on, and
/// the secret is in no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_argument_template_refuses_parts_a_join_would_read_otherwise() {
    let dir = tempfile::tempdir().expect("tmp");
    open_to_every_uid(dir.path());
    let data = std::fs::canonicalize(dir.path())
        .expect("canon")
        .join("pydata");
    let d = data.display().to_string();
    std::fs::create_dir_all(data.join("public")).expect("mk");
    std::fs::create_dir_all(data.join("private")).expect("mk");
    std::fs::write(data.join("public/a.txt"), "hello public\n").expect("w");
    std::fs::write(data.join("private/secret.txt"), "TOP-SECRET-42\n").expect("w");
    // The decoy: `/public/<root>/private/secret.txt`, what the template's string names.
    let decoy = data.join(format!("public{d}/private"));
    std::fs::create_dir_all(&decoy).expect("mk");
    std::fs::write(decoy.join("secret.txt"), "decoy\n").expect("w");
    let log = dir.path().join("opened.log");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/joiner.py");
    let broker = broker_with(&format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"py\"\ncommand = \"python3\"\nargs = [{}]\nenv = {{ JOINER_LOG = {} }}\n\
         [providers.tools.read_joined]\naction = \"read\"\nfile = \"{{dir}}/{{name}}\"\nfile_root = {}\n{}",
        q(script),
        q(&log.display().to_string()),
        q(&d),
        sandboxed(&[PYTHON_DIR], &[&dir.path().display().to_string()])
    ))
    .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let public = format!("{d}/public");
    let cases = [
        (public.clone(), "a.txt".to_owned(), "succeeded/ok"),
        (
            public.clone(),
            format!("{d}/private/secret.txt"),
            "denied/unresolvable_requirement",
        ),
        (
            public.clone(),
            "/etc/hostname".to_owned(),
            "denied/unresolvable_requirement",
        ),
        (
            d.clone(),
            "private/secret.txt".to_owned(),
            "denied/unresolvable_requirement",
        ),
        (
            public.clone(),
            "../private/secret.txt".to_owned(),
            "denied/unresolvable_requirement",
        ),
        (
            format!("{d}/public/../private"),
            "secret.txt".to_owned(),
            "denied/unresolvable_requirement",
        ),
        (
            public.clone(),
            "..".to_owned(),
            "denied/unresolvable_requirement",
        ),
    ];
    for (i, (dir_arg, name, want)) in cases.iter().enumerate() {
        let r = call(
            &mut raw,
            i as i64 + 1,
            "py.read_joined",
            json!({"dir": dir_arg, "name": name}),
        )
        .await;
        let m = meta(&r);
        assert_eq!(
            format!(
                "{}/{}",
                m["outcome"].as_str().unwrap_or("?"),
                m["code"].as_str().unwrap_or("?")
            ),
            *want,
            "{dir_arg} + {name}: {r}"
        );
        assert!(!r.to_string().contains("TOP-SECRET"), "{r}");
        if i == 0 {
            assert_eq!(text(&r), "hello public\n");
        }
    }
    let calls = broker.calls_of(&turn.turn);
    let count = |o: &str, c: &str| {
        calls
            .iter()
            .filter(|l| l["outcome"] == o && l["code"] == c)
            .count()
    };
    assert_eq!(calls.len(), cases.len(), "every call recorded");
    assert_eq!(count("succeeded", "ok"), 1);
    assert_eq!(count("denied", "unresolvable_requirement"), cases.len() - 1);
    let record = std::fs::read_to_string(broker.record_path()).expect("record");
    assert!(!record.contains("TOP-SECRET"));
    // The upstream was sent one call, and opened only the public file.
    let opened = std::fs::read_to_string(&log).expect("log");
    assert_eq!(opened, format!("{d}/public/a.txt\n"));
}

/// Issue 42, item 11. A real Python upstream (`tests/python/rpc_errors.py`) answers `tools/call`
/// with ordinary JSON-RPC errors: -32602 (invalid params) and -32000 (a server error whose
/// message carries the secret it was given, a newline and 2,000 more characters). Each is
/// `failed/upstream_error` with the code and the message, bounded and redacted, in the MCP
/// result the agent gets (`isError`) and on the call's record line; never
/// `upstream_unavailable`, no "is being restarted", and the server is not restarted: the next
/// call on the same process succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_json_rpc_error_is_an_upstream_error_with_its_code_not_an_outage() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/rpc_errors.py");
    let token = format!("tok-rpc-{}", std::process::id());
    let mut broker = TestBroker::start(Options {
        policy: r#"
@id("alice-rpc")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool)
when { resource.name like "rpc.*" };
"#,
        ..Options::default()
    })
    .await;
    crate::secrets::set_secret(&broker.config_path, "_shared", "token", &token);
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    std::fs::write(
        &broker.config_path,
        format!(
            "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"rpc\"\ncommand = \"python3\"\nargs = [{}]\nenv = {{ TOKEN = {{ secret = \"token\", shared = true }} }}\n{}",
            q(script),
            sandboxed(&[PYTHON_DIR], &[])
        ),
    )
    .expect("cfg");
    broker.restart().await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = call(&mut raw, 1, "rpc.bad_args", json!({"text": "x"})).await;
    assert_eq!(r["isError"], true, "{r}");
    assert_eq!(meta(&r)["outcome"], "failed", "{r}");
    assert_eq!(meta(&r)["code"], "upstream_error", "{r}");
    let said = text(&r);
    assert!(
        said.contains("JSON-RPC error -32602: Invalid params: `text` must be a number"),
        "{said}"
    );
    assert!(!said.contains("restarted"), "{said}");
    let r = call(&mut raw, 2, "rpc.busy", json!({})).await;
    assert_eq!(r["isError"], true, "{r}");
    assert_eq!(meta(&r)["code"], "upstream_error", "{r}");
    let said = text(&r);
    assert!(
        said.contains(
            "JSON-RPC error -32000: rate limited for token [redacted: token] retry later zzz"
        ),
        "{said}"
    );
    assert!(
        !said.contains(&token),
        "the secret reached the agent: {said}"
    );
    assert!(!said.contains("restarted"), "{said}");
    assert!(
        said.len() < 1000 && said.contains("zzz..."),
        "bounded ({} bytes): {said}",
        said.len()
    );
    // The same process goes on serving: nothing was restarted.
    let r = call(&mut raw, 3, "rpc.echo", json!({"text": "still here"})).await;
    assert_eq!(meta(&r)["outcome"], "succeeded", "{r}");
    assert_eq!(text(&r), "still here");
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), 3, "{calls:?}");
    for (line, code) in calls[..2].iter().zip(["-32602", "-32000"]) {
        assert_eq!(line["outcome"], "failed", "{line}");
        assert_eq!(line["code"], "upstream_error", "{line}");
        let message = line["message"].as_str().expect("message");
        assert!(
            message.contains(&format!("JSON-RPC error {code}: ")),
            "{message}"
        );
        assert!(message.len() < 1000, "{message}");
    }
    assert!(
        calls[1]["message"]
            .as_str()
            .is_some_and(|m| m.contains("[redacted: token]")),
        "{}",
        calls[1]
    );
    let record = std::fs::read_to_string(broker.record_path()).expect("record");
    assert!(!record.contains(&token), "the secret is on record");
    assert!(
        !record.contains("upstream_unavailable"),
        "an outage on record"
    );
    let states: Vec<String> = broker
        .records()
        .iter()
        .filter(|l| l["kind"] == "provider_state" && l["provider"] == "rpc")
        .map(|l| l["state"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(
        states.iter().filter(|s| *s == "ready").count(),
        1,
        "started once: {states:?}"
    );
    assert!(
        !states.iter().any(|s| s == "restarting" || s == "failed"),
        "{states:?}"
    );
}
