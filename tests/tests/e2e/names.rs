//! Presentation names through real processes: portable names for a client that cannot carry a
//! dot, alias problems reported at turn open, and `turn open --write-config`.

use std::os::unix::fs::PermissionsExt;

use serde_json::{Value, json};
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn};

use crate::kit::{Options, Raw, TestBroker, meta, run, text};

/// A probe that behaves like a client whose tool names may not contain a dot: it refuses the
/// catalogue if any name has one.
async fn dotless_client(raw: &mut Raw) -> Vec<String> {
    raw.initialize("2025-11-25").await;
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .await;
    let list = raw.response(1).await;
    let names: Vec<String> = list["result"]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| t["name"].as_str().expect("name").to_owned())
        .collect();
    for n in &names {
        assert!(!n.contains('.'), "this client cannot carry `{n}`");
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn portable_names_per_turn_and_per_shim() {
    let broker = TestBroker::start(Options::default()).await;
    // Per turn.
    let turn = broker
        .open(OpenTurn {
            principal: "alice".into(),
            portable_names: true,
            ..Default::default()
        })
        .await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    assert_eq!(
        dotless_client(&mut raw).await,
        ["files_list", "files_read", "files_search"]
    );
    let r = raw
        .call(2, "files_read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    let r = raw
        .call(3, "files_read", json!({"path": "/private/secret.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["code"], "no_permit");
    // The kernel saw (and recorded) the canonical name the portable one maps back to.
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls[0]["tool"], "files.read");
    // Per shim flag, on a turn that did not ask.
    let plain = broker.open_turn("alice").await;
    let mut cmd = broker.shim_command(plain.token.expose());
    cmd.arg("--portable-names");
    let mut raw = Raw::spawn(cmd);
    assert_eq!(dotless_client(&mut raw).await.len(), 3);
    let r = raw.call(2, "files_list", json!({"path": "/public"})).await;
    assert!(text(&r["result"]).contains("hello.txt"), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_aliases_are_reported_at_turn_open() {
    let broker = TestBroker::start(Options::default()).await;
    let long = format!("n{}", "x".repeat(60));
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    let extra =
        format!("\n[[providers]]\ntype = \"files\"\nnamespace = \"{long}\"\nroot = \"data\"\n");
    std::fs::write(&broker.config_path, format!("{cfg}{extra}")).expect("w");
    std::fs::write(
        broker.dir.path().join("policy.cedar"),
        "@id(\"all\") permit(principal, action, resource);\n",
    )
    .expect("w");
    let mut broker = broker;
    broker.restart().await;
    let opened = match broker
        .host()
        .await
        .call(&ControlRequest::OpenTurn(Box::new(OpenTurn {
            principal: "alice".into(),
            harness: Some("claude-code".into()),
            ..Default::default()
        })))
        .await
        .expect("open")
    {
        ControlResponse::TurnOpened(t) => t,
        other => panic!("{other:?}"),
    };
    assert!(
        opened
            .warnings
            .iter()
            .any(|w| w.contains(&long) && w.contains("64-character")),
        "{:?}",
        opened.warnings
    );
    // The CLI prints the warning.
    let mut cli = broker.cli();
    cli.args(["turn", "open", "--principal", "alice", "--harness", "codex"]);
    let (code, _, err) = run(cli).await;
    assert_eq!(code, 0);
    assert!(
        err.contains("warning:") && err.contains("over the 64-character limit"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_name_collision_is_refused_at_turn_open() {
    let broker = TestBroker::start(Options::default()).await;
    // Two namespaces whose tools collide once dots become underscores: namespace `x.y` gives
    // `x.y.read`, namespace `x_y` gives `x_y.read`; both become `x_y_read`.
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    let extra = "\n[[providers]]\ntype = \"files\"\nnamespace = \"x.y\"\nroot = \"data\"\n\n[[providers]]\ntype = \"files\"\nnamespace = \"x_y\"\nroot = \"data\"\n";
    std::fs::write(&broker.config_path, format!("{cfg}{extra}")).expect("w");
    let mut broker = broker;
    broker.restart().await;
    let r = broker
        .host()
        .await
        .call(&ControlRequest::OpenTurn(Box::new(OpenTurn {
            principal: "alice".into(),
            portable_names: true,
            ..Default::default()
        })))
        .await;
    let err = r.expect_err("collision refused").to_string();
    assert!(
        err.contains("x.y.list") && err.contains("x_y.list") && err.contains("portable"),
        "{err}"
    );
    // Without portable names the same catalogue opens fine.
    broker.open_turn("alice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_config_gives_a_harness_a_working_private_config() {
    let broker = TestBroker::start(Options::default()).await;
    let dir = broker.dir.path();
    // Token in the config.
    let cfg_path = dir.join("claude/sharedos.mcp.json");
    let mut cli = broker.cli();
    cli.args([
        "turn",
        "open",
        "--principal",
        "alice",
        "--json",
        "--write-config",
        "claude-code",
    ])
    .arg(&cfg_path);
    let (code, out, err) = run(cli).await;
    assert_eq!(code, 0, "{err}");
    let opened: Value = serde_json::from_str(&out).expect("json");
    let mode = std::fs::metadata(&cfg_path)
        .expect("meta")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the config holds a bearer token");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    let server = &cfg["mcpServers"]["sharedos"];
    assert_eq!(server["env"]["SHAREDOS_TURN_TOKEN"], opened["token"]);
    // Spawn the shim exactly as the config says, as Claude Code would.
    let mut cmd = tokio::process::Command::new(server["command"].as_str().expect("command"));
    for a in server["args"].as_array().expect("args") {
        cmd.arg(a.as_str().expect("arg"));
    }
    for (k, v) in server["env"].as_object().expect("env") {
        cmd.env(k, v.as_str().expect("value"));
    }
    cmd.env_remove("SHAREDOS_RUNTIME_DIR").kill_on_drop(true);
    let mut raw = Raw::spawn(cmd);
    raw.initialize("2025-11-25").await;
    let r = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded");

    // Token in a file the config points at; the Codex config merges into the host's file.
    let codex = dir.join("codex/config.toml");
    std::fs::create_dir_all(codex.parent().expect("dir")).expect("mkdir");
    std::fs::write(
        &codex,
        "model = \"m\"\n[mcp_servers.other]\ncommand = \"x\"\n",
    )
    .expect("w");
    // A token path two turns could share is refused: `{turn}` must be in its file name.
    let mut cli = broker.cli();
    cli.args(["turn", "open", "--principal", "alice", "--token-file"])
        .arg(dir.join("turn.token"));
    let (code, _, err) = run(cli).await;
    assert_ne!(code, 0);
    assert!(
        err.contains("{turn}") && err.contains("turn.token"),
        "{err}"
    );
    let mut cli = broker.cli();
    cli.args([
        "turn",
        "open",
        "--json",
        "--principal",
        "alice",
        "--write-config",
        "codex",
    ])
    .arg(&codex)
    .arg("--token-file")
    .arg(dir.join("tokens/{turn}.token"));
    let (code, out, err) = run(cli).await;
    assert_eq!(code, 0, "{err}");
    let opened: Value = serde_json::from_str(&out).expect("json");
    let turn = opened["turn"].as_str().expect("turn").to_owned();
    let token_file = dir.join(format!("tokens/{turn}.token"));
    assert_eq!(opened["tokenFile"], json!(token_file.display().to_string()));
    let text = std::fs::read_to_string(&codex).expect("read");
    let token = std::fs::read_to_string(&token_file).expect("token");
    assert!(
        !text.contains(token.trim()),
        "the config does not carry the token"
    );
    assert!(
        text.contains("[mcp_servers.other]") && text.contains("model = \"m\""),
        "{text}"
    );
    assert!(
        text.contains("--turn-token-file")
            && text.contains(&format!("{turn}.token"))
            && text.contains("required = true"),
        "{text}"
    );
    assert_eq!(
        std::fs::metadata(&token_file)
            .expect("meta")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    // The turn's token file goes when the turn does.
    let mut cli = broker.cli();
    cli.args(["turn", "close", &turn]);
    let (code, _, err) = run(cli).await;
    assert_eq!(code, 0, "{err}");
    assert!(!token_file.exists(), "removed at close");

    // Unknown formats are refused, naming the input.
    let mut cli = broker.cli();
    cli.args([
        "turn",
        "open",
        "--principal",
        "alice",
        "--write-config",
        "vim",
        "x",
    ]);
    let (code, _, err) = run(cli).await;
    assert_eq!(code, 1);
    assert!(err.contains("`vim`"), "{err}");
}

#[test]
fn committed_harness_configs_are_well_formed() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../harness-configs");
    let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).expect(f);
    for f in [
        "claude-code.mcp.json",
        "pi.mcp.json",
        "qwen-code.settings.json",
        "gemini-cli.settings.json",
    ] {
        let v: Value = serde_json::from_str(&read(f)).expect(f);
        let s = &v["mcpServers"]["sharedos"];
        assert!(
            s["command"]
                .as_str()
                .is_some_and(|c| c.ends_with("sharedos-mcp-shim")),
            "{f}"
        );
        assert_eq!(s["args"][0], "--turn-token-file", "{f}");
        assert!(s["env"]["SHAREDOS_BROKER"].is_string(), "{f}");
    }
    let qwen: Value = serde_json::from_str(&read("qwen-code.settings.json")).expect("qwen");
    assert_eq!(qwen["mcpServers"]["sharedos"]["trust"], true);
    assert_eq!(qwen["tools"]["toolSearch"]["enabled"], false);
    let opencode: Value = serde_json::from_str(&read("opencode.json")).expect("opencode");
    let s = &opencode["mcp"]["sharedos"];
    assert_eq!(s["type"], "local");
    assert!(
        s["command"][0]
            .as_str()
            .is_some_and(|c| c.ends_with("sharedos-mcp-shim")),
        "{s}"
    );
    assert_eq!(s["command"][1], "--turn-token-file");
    assert!(s["environment"]["SHAREDOS_BROKER"].is_string(), "{s}");
    let codex: toml::Table = toml::from_str(&read("codex.config.toml")).expect("codex");
    let s = &codex["mcp_servers"]["sharedos"];
    assert_eq!(s["required"].as_bool(), Some(true));
    assert_eq!(s["default_tools_approval_mode"].as_str(), Some("approve"));
    let cordis = read("cordis.yml");
    assert!(cordis.contains("UNTESTED") && cordis.contains("sharedos-mcp-shim"));
}
