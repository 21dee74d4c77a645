//! The shim under an outside client: the Python MCP SDK (PyPI `mcp` 2.3.0), not our code.
//! `.ci/run` installs it and sets SHAREDOS_PYTHON; without it the test says it is skipped, and
//! fails under CI=true.

use serde_json::Value;

use crate::kit::{Options, TestBroker, bin, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 in SHAREDOS_PYTHON: bash .ci/run installs it and runs this"]
async fn python_mcp_sdk_client_drives_the_shim() {
    let python = match std::env::var("SHAREDOS_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must set SHAREDOS_PYTHON (see .ci/run)"
            );
            eprintln!(
                "SKIPPED: SHAREDOS_PYTHON is not set (run .ci/run to install PyPI mcp 2.3.0)"
            );
            return;
        }
    };
    let broker = TestBroker::start(Options {
        latency_ms: None,
        ..Options::default()
    })
    .await;
    let turn = broker.open_turn("alice").await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/outside_client.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script)
        .env("SHAREDOS_SHIM", bin("sharedos-mcp-shim"))
        .env("SHAREDOS_TURN_TOKEN", turn.token.expose())
        .env("SHAREDOS_BROKER", broker.bridge());
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "python client failed:\n{out}\n{err}");
    let report: Value =
        serde_json::from_str(out.lines().last().unwrap_or("{}")).expect("report json");
    // `auto` opens with `server/discover` (2026-07-28); `legacy` with `initialize`.
    assert_eq!(report["auto"]["protocol"], "2026-07-28", "{report}");
    assert_eq!(report["legacy"]["protocol"], "2025-11-25", "{report}");
    for mode in ["legacy", "auto"] {
        let r = &report[mode];
        assert_eq!(
            r["tools"],
            serde_json::json!(["files.list", "files.read", "files.search"]),
            "{mode}: {r}"
        );
        assert_eq!(
            r["public"],
            serde_json::json!([false, "hello, public world\n"]),
            "{mode}"
        );
        assert_eq!(r["private"][0], true, "{mode}");
        assert!(
            r["private"][1]
                .as_str()
                .is_some_and(|t| t.starts_with("denied:")),
            "{mode}: {r}"
        );
        assert!(
            r["traversal"][1]
                .as_str()
                .is_some_and(|t| t.starts_with("denied:")),
            "{mode}"
        );
        assert!(
            r["unpublished"][1]
                .as_str()
                .is_some_and(|t| t.starts_with("denied:")),
            "{mode}"
        );
        assert!(
            r["malformed"][1]
                .as_str()
                .is_some_and(|t| t.starts_with("denied:")),
            "{mode}"
        );
        assert_eq!(r["meta_code"], "no_permit", "{mode}");
    }
    // Both sessions' calls reached the record: 5 each.
    assert_eq!(broker.calls_of(&turn.turn).len(), 10);
}
