//! The shim as the README deploys it: relinked statically (`cargo rustc -p sharedos-mcp-shim
//! --bin sharedos-mcp-shim -- -C target-feature=+crt-static`), it is a static-pie executable and
//! serves a turn as the dynamically linked one does: the same catalogue, an allowed and a denied
//! call, one record line each.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "links the shim a second time, statically, in its own target folder (about a minute the first time): cargo test -- --include-ignored, or bash .ci/run"]
async fn the_statically_linked_shim_serves_a_turn() {
    use rmcp::model::CallToolRequestParams;
    use serde_json::{Value, json};
    use sharedos_host::shim_path::{Linking, linking};

    use crate::kit::{Options, TestBroker, meta, target_dir};

    // Its own target folder: relinking in place would swap the shim under the other tests.
    let profile_dir = target_dir();
    let release = profile_dir.ends_with("release");
    let target = profile_dir
        .parent()
        .expect("target folder")
        .join("static-shim");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.args([
        "rustc",
        "--quiet",
        "-p",
        "sharedos-mcp-shim",
        "--bin",
        "sharedos-mcp-shim",
    ])
    .env("CARGO_TARGET_DIR", &target);
    if release {
        cmd.arg("--release");
    }
    cmd.args(["--", "-C", "target-feature=+crt-static"]);
    let status = tokio::task::spawn_blocking(move || cmd.status())
        .await
        .expect("join")
        .expect("run cargo rustc");
    assert!(status.success(), "the README's static link failed");
    let shim = target
        .join(if release { "release" } else { "debug" })
        .join("sharedos-mcp-shim");
    assert_eq!(linking(&shim).expect("an ELF file"), Linking::Static);

    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let client = broker
        .client_of(broker.shim_command_at(&shim, turn.token.expose()))
        .await;
    let tools: Vec<String> = client
        .list_all_tools()
        .await
        .expect("tools/list")
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    assert_eq!(tools, ["files.list", "files.read", "files.search"]);
    for (path, outcome) in [
        ("/public/hello.txt", "succeeded"),
        ("/private/secret.txt", "denied"),
    ] {
        let result = client
            .call_tool(
                CallToolRequestParams::new("files.read")
                    .with_arguments(json!({ "path": path }).as_object().cloned().expect("obj")),
            )
            .await
            .expect("a result, refusals included");
        let result: Value = serde_json::to_value(&result).expect("json");
        assert_eq!(meta(&result)["outcome"], outcome, "{result}");
        assert_eq!(result["isError"], json!(outcome != "succeeded"));
    }
    client.cancel().await.expect("client stops");
    let calls = broker.calls_of(&turn.turn);
    let outcomes: Vec<&str> = calls.iter().filter_map(|c| c["outcome"].as_str()).collect();
    assert_eq!(outcomes, ["succeeded", "denied"]);
}
