//! `sharedos-broker demo`: the whole boundary in one command, on the embedded default.
//!
//! Starts a broker in this process on a temporary runtime dir, opens a turn for `alice` over the
//! real control socket, spawns the real `sharedos-mcp-shim` as an MCP client would (rmcp client
//! over stdio), makes five calls, prints what happened and the record, closes the turn and checks
//! the shim exited. It exits non-zero if any outcome is not the expected one.

use crate::output::outln;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn};
use sharedos_proto::record::{Event, RecordLine};
use tokio_util::sync::CancellationToken;

use sharedos_broker::Config;
use sharedos_host::client::ControlClient;

struct Step {
    tool: &'static str,
    arguments: Value,
    expect: &'static str,
}

fn first_text(result: &rmcp::model::CallToolResult) -> String {
    serde_json::to_value(result)
        .ok()
        .and_then(|v| {
            v.pointer("/content/0/text")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

fn meta_outcome(result: &rmcp::model::CallToolResult) -> (String, String) {
    let v = serde_json::to_value(result).unwrap_or(Value::Null);
    let get = |k: &str| {
        v.pointer(&format!("/_meta/sharedos/{k}"))
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned()
    };
    (get("outcome"), get("code"))
}

pub async fn run() -> anyhow::Result<ExitCode> {
    let tmp = tempfile::Builder::new()
        .prefix("sharedos-demo-")
        .tempdir()
        .context("cannot create a temporary folder")?;
    let runtime_dir = tmp.path().join("run");
    let config = Config::embedded(&tmp.path().join("default"))?;
    let shutdown = CancellationToken::new();
    let running =
        sharedos_broker::server::start(config, runtime_dir.clone(), shutdown.clone()).await?;
    let result = drive(&runtime_dir).await;
    shutdown.cancel();
    running.wait().await?;
    let ok = result?;
    outln!();
    if ok {
        outln!("demo: every outcome was the expected one.");
        Ok(ExitCode::SUCCESS)
    } else {
        outln!("demo: some outcome was NOT the expected one (see the table).");
        Ok(ExitCode::from(1))
    }
}

async fn drive(runtime_dir: &std::path::Path) -> anyhow::Result<bool> {
    let mut host = ControlClient::connect(runtime_dir).await?;
    let open = OpenTurn {
        principal: "alice".into(),
        harness: Some("demo".into()),
        ..Default::default()
    };
    let turn = match host.call(&ControlRequest::OpenTurn(Box::new(open))).await? {
        ControlResponse::TurnOpened(t) => t,
        other => bail!("unexpected answer to open_turn: {other:?}"),
    };
    outln!("SharedOS demo: broker on {}", runtime_dir.display());
    outln!(
        "turn {} for principal alice, catalogHash {}",
        turn.turn,
        turn.catalog_hash
    );

    let shim = sharedos_host::shim_path::locate_shim()?;
    let mut cmd = tokio::process::Command::new(&shim);
    cmd.env(runtime::TOKEN_ENV, turn.token.expose())
        .env(runtime::BROKER_ENV, runtime::bridge_socket(runtime_dir))
        .kill_on_drop(true);
    let (transport, _stderr) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start `{}`", shim.display()))?;
    let client = ().serve(transport).await.context("MCP initialize with the shim failed")?;
    let tools = client.list_all_tools().await.context("tools/list failed")?;
    let names: Vec<String> = tools.iter().map(|t| t.name.to_string()).collect();
    outln!("tools/list through the shim: {}", names.join(", "));
    outln!();

    let steps = [
        Step {
            tool: "files.read",
            arguments: json!({"path": "/public/hello.txt"}),
            expect: "succeeded",
        },
        Step {
            tool: "files.read",
            arguments: json!({"path": "/private/secret.txt"}),
            expect: "denied",
        },
        Step {
            tool: "files.read",
            arguments: json!({"path": "/public/../private/secret.txt"}),
            expect: "denied",
        },
        Step {
            tool: "files.delete",
            arguments: json!({"path": "/public/hello.txt"}),
            expect: "denied",
        },
        Step {
            tool: "files read",
            arguments: json!({"path": "/public/hello.txt"}),
            expect: "denied",
        },
    ];
    let mut all_ok = true;
    // Columns as wide as their widest cell.
    let tool_w = steps
        .iter()
        .map(|s| format!("{:?}", s.tool).chars().count())
        .max()
        .unwrap_or(0)
        .max("tool".len());
    let args_w = steps
        .iter()
        .map(|s| s.arguments.to_string().chars().count())
        .max()
        .unwrap_or(0)
        .max("arguments".len());
    outln!(
        "{:<3} {:<tool_w$} {:<args_w$} {:<30} {:<4} answer",
        "#",
        "tool",
        "arguments",
        "outcome",
        "ok"
    );
    for (i, step) in steps.iter().enumerate() {
        let Value::Object(args) = step.arguments.clone() else {
            continue;
        };
        let result = client
            .call_tool(CallToolRequestParams::new(step.tool).with_arguments(args))
            .await
            .with_context(|| format!("tools/call {} failed at the transport", step.tool))?;
        let (outcome, code) = meta_outcome(&result);
        let ok = outcome == step.expect && result.is_error == Some(step.expect != "succeeded");
        all_ok &= ok;
        let mut text = first_text(&result).trim().replace('\n', " ");
        if text.chars().count() > 90 {
            text = text.chars().take(89).collect::<String>() + "…";
        }
        outln!(
            "{:<3} {:<tool_w$} {:<args_w$} {:<30} {:<4} {}",
            i + 1,
            format!("{:?}", step.tool),
            step.arguments.to_string(),
            format!("{outcome}/{code}"),
            if ok { "yes" } else { "NO" },
            text
        );
    }

    host.call(&ControlRequest::CloseTurn {
        turn: turn.turn.clone(),
    })
    .await?;
    let ended = tokio::time::timeout(Duration::from_secs(10), client.waiting()).await;
    let shim_exited = matches!(ended, Ok(Ok(_)));
    outln!();
    outln!(
        "turn closed; the shim {}",
        if shim_exited {
            "exited"
        } else {
            "did NOT exit"
        }
    );

    outln!();
    outln!("record lines of turn {}:", turn.turn);
    match host
        .call(&ControlRequest::Records {
            turn: Some(turn.turn.clone()),
            after_seq: 0,
            limit: None,
        })
        .await?
    {
        ControlResponse::Records { lines, .. } => {
            for line in &lines {
                outln!("{}", serde_json::to_string(line)?);
            }
            let calls = lines
                .iter()
                .filter(|l| {
                    matches!(
                        serde_json::from_value::<RecordLine>((*l).clone()),
                        Ok(RecordLine {
                            event: Event::Call(_),
                            ..
                        })
                    )
                })
                .count();
            if calls != steps.len() {
                outln!("expected {} call lines, found {calls}", steps.len());
                all_ok = false;
            }
        }
        other => bail!("unexpected answer to records: {other:?}"),
    }
    Ok(all_ok && shim_exited)
}
