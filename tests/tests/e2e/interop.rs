//! The interop suite: the MCP column with the real harness CLIs (Claude Code, Codex, pi with
//! pi-mcp-adapter, Qwen Code, opencode, Gemini CLI, Cline), each driven offline by the scripted model
//! provider on 127.0.0.1.
//!
//! `.ci/install-harnesses` installs the pinned CLIs and writes `harnesses.env`. If the registry
//! could not be reached it leaves a SKIPPED marker and these tests say they are skipped; under
//! CI=true a missing install without that marker fails. Every column also needs the PyPI
//! mcp-server-time from `.ci/install-mcp-servers` (the brokered provider of the `long-name` row),
//! skipped and failed the same way. One test runs Claude Code interactively in tmux, as a person
//! at a terminal, and answers the approval question it shows (`interop/terminal.rs`).

use std::collections::BTreeMap;

use serde_json::{Value, json};
use sharedos_column::scripted_model::{self, Script};
use tokio_util::sync::CancellationToken;

use crate::kit::{Options, TestBroker, run};

mod terminal;

/// The installed harnesses, or None (with the reason printed) when the suite is skipped.
fn harnesses() -> Option<BTreeMap<String, String>> {
    crate::kit::installed("harnesses", ".ci/install-harnesses")
}

/// The kit's policy, and two folders whose reads need a person (issue 36): `/asks` only its
/// principal, asked in the harness (`@approval("principal")`); `/held` its principal, or an
/// operator over `control.sock` when the harness cannot ask (`@approval("principal_or_operator")`).
const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("bob-private")
permit(principal == SharedOS::User::"bob",
       action in [SharedOS::Action::"read", SharedOS::Action::"write"],
       resource is SharedOS::File)
when { resource.path like "/private/*" };

@id("alice-asks-alice")
@approval("principal")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/asks/*" };

@id("alice-long-name")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name == "a_namespace_near_limits.get_current_time" };

@id("alice-asks-alice-or-operator")
@approval("principal_or_operator")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/held/*" };
"#;

/// How long a held call waits for a decision (the broker's `approval_timeout_seconds`).
const APPROVAL_TIMEOUT_SECONDS: u64 = 15;

/// The text of `/held/plan.txt`, which the model sees once an operator approves its read.
const HELD: &str = "the held plan, read once an operator approved";

/// What a harness does, measured in `-p`/`exec` mode, when the shim would ask its person.
#[derive(Clone, Copy)]
enum Asked {
    /// The shim cannot ask it (the reason, as recorded): `/asks` is refused
    /// `denied/approval_unavailable`, `/held` goes to the operator, who approves it.
    Cannot(&'static str),
    /// It declared the elicitation capability and its client declines every question at once,
    /// with nobody shown it: both reads are refused `denied/approval_denied`, `by: harness_session`.
    /// How it was asked (`elicitation/create`, or `input_required` in 2026-07-28) and what its
    /// client answered (`decline`, `cancel`).
    Declines(&'static str, &'static str),
}

/// The shim's recorded reasons for not asking.
const NO_CAPABILITY: &str = "the MCP client did not declare the elicitation capability (form mode)";

/// The rows, the same for every harness: each row's expectation is its own claim, never set
/// per harness from what one was measured to do (issue 47). The two approval rows claim the
/// read runs once someone with the right approves it: `principal-approval` only when the
/// principal, asked in the harness, approves; `principal-or-operator` when the principal or an
/// operator does. In these non-interactive runs nobody can approve in the harness, so the first
/// fails everywhere and the second passes only where the operator was asked; the cell says what
/// happened (`fail: declined by the client`, `pass: no question shown: operator approved`).
fn rows() -> Value {
    json!([
        {"id": "allowed-read", "tool": "files.read", "arguments": {"path": "/public/hello.txt"}, "expect": "allowed"},
        {"id": "denied-read", "tool": "files.read", "arguments": {"path": "/private/secret.txt"}, "expect": "denied"},
        {"id": "traversal", "tool": "files.read", "arguments": {"path": "/public/../private/secret.txt"}, "expect": "denied"},
        {"id": "denied-list", "tool": "files.list", "arguments": {"path": "/private"}, "expect": "denied"},
        {"id": "principal-approval", "tool": "files.read", "arguments": {"path": "/asks/plan.txt"}, "expect": "allowed"},
        {"id": "principal-or-operator", "tool": "files.read", "arguments": {"path": "/held/plan.txt"}, "expect": "allowed"},
        {"id": "search", "tool": "files.search", "arguments": {"path": "/public", "query": "hello"}, "expect": "allowed"},
        {"id": "budget-refusal", "tool": "files.search", "arguments": {"path": "/public", "query": "world"}, "expect": "denied", "code": "budget_exhausted"},
        {"id": "long-name", "tool": LONG_NAME, "arguments": {"timezone": "UTC"}, "expect": "allowed"},
        {"id": "turn-closed", "tool": "files.read", "arguments": {"path": "/public/hello.txt"}, "expect": "turn_closed"},
    ])
}

/// The turn's budget: one `files.search` per turn, so the second (`budget-refusal`) is refused
/// `denied/budget_exhausted`.
const BUDGETS: &str = "[[budgets]]\ntool = \"files.search\"\ncalls_per_turn = 1\n";

/// How long the scripted model "thinks" before the `turn-closed` call: the column closes the
/// turn as soon as the record shows the calls before it (it reads the record every 50 ms), so
/// the call is made in a closed turn.
const CLOSE_DELAY_MS: u64 = 2000;

/// The rows that run while the turn is open (all but `turn-closed`), which every column passes.
const OPEN_ROWS: usize = 9;

/// The namespace of a brokered provider (the PyPI mcp-server-time), 23 characters: its
/// `get_current_time` is `mcp__sharedos__a_namespace_near_limits_get_current_time` (55 of Claude
/// Code's 64 characters) and, in Qwen Code, that name plus its 8-character hash suffix, 63: its
/// limit exactly (`proto::alias`). Longer, Qwen Code would cut the tool's own name short.
const LONG_NAMESPACE: &str = "a_namespace_near_limits";
const LONG_NAME: &str = "a_namespace_near_limits.get_current_time";

/// The turn's catalogue in every column: the files tools and the long-named one (only
/// `get_current_time` is permitted of the time server's two tools).
const CATALOGUE: [&str; 4] = [
    "a_namespace_near_limits.get_current_time",
    "files.list",
    "files.read",
    "files.search",
];

/// The `[[providers]]` table of the time server under [`LONG_NAMESPACE`].
fn long_named_provider(servers: &BTreeMap<String, String>) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("quote");
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{LONG_NAMESPACE}\"\ncommand = {}\nargs = [{}]\n",
        q(&servers["TIME_CMD"]),
        q(&servers["TIME_ARGS"])
    )
}

/// Approves, as an operator over `control.sock` (`sharedos-broker approvals approve`), every
/// held read of `/held/*` it sees, until stopped. Returns the approval ids it approved.
async fn operator(
    broker_cli: impl Fn() -> std::process::Command,
    stop: CancellationToken,
) -> Vec<String> {
    let mut approved: Vec<String> = Vec::new();
    while !stop.is_cancelled() {
        let mut list = broker_cli();
        list.args(["approvals", "--json"]);
        let (code, out, _) = run(list).await;
        let waiting: Vec<Value> = if code == 0 {
            serde_json::from_str(&out).unwrap_or_default()
        } else {
            vec![]
        };
        for a in waiting {
            let held = a["tool"] == "files.read"
                && a["arguments"]["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("/held/"));
            let Some(id) = a["id"].as_str() else { continue };
            if held && !approved.iter().any(|x| x == id) {
                let mut approve = broker_cli();
                approve.args(["approvals", "approve", id]);
                // Refused while the harness itself is still being asked: tried again next round.
                if run(approve).await.0 == 0 {
                    approved.push(id.to_owned());
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
        }
    }
    approved
}

/// Runs one column: broker, scripted model, `sharedos-broker column run --model-log`, which must
/// exit `exit` (`None`: 0 when every row and check passed, else 4, as its manifest says).
/// Returns the manifest, the model's log and the broker (for its record).
async fn column(
    exit: Option<i32>,
    host_config: impl FnOnce(u16, &BTreeMap<String, String>, &std::path::Path) -> String,
) -> Option<(Value, Vec<Value>, TestBroker)> {
    let h = harnesses()?;
    let servers = crate::kit::installed("mcp-servers", ".ci/install-mcp-servers")?;
    let broker = TestBroker::start(Options {
        policy: POLICY,
        top: format!("approval_timeout_seconds = {APPROVAL_TIMEOUT_SECONDS}\n"),
        tables: format!("{BUDGETS}{}", long_named_provider(&servers)),
        ..Options::default()
    })
    .await;
    let dir = broker.dir.path().to_path_buf();
    for (folder, text) in [("asks", "the asked plan"), ("held", HELD)] {
        std::fs::create_dir_all(dir.join("data").join(folder)).expect("mkdir");
        std::fs::write(dir.join("data").join(folder).join("plan.txt"), text).expect("write");
    }
    let rows = rows();
    let script: Script = serde_json::from_value(json!({
        "steps": rows.as_array().expect("rows").iter().map(|r| {
            let mut step = json!({"tool": r["tool"], "arguments": r["arguments"]});
            if r["expect"] == "turn_closed" {
                step["delay_ms"] = json!(CLOSE_DELAY_MS);
            }
            step
        }).collect::<Vec<_>>(),
        "final": "DONE",
    }))
    .expect("script");
    let listener = scripted_model::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let model_log = dir.join("model.jsonl");
    let stop = CancellationToken::new();
    let server = tokio::spawn(scripted_model::serve(
        listener,
        script,
        Some(model_log.clone()),
        stop.clone(),
    ));

    std::fs::write(dir.join("rows.json"), rows.to_string()).expect("rows");
    std::fs::write(dir.join("host.toml"), host_config(port, &h, &dir)).expect("host config");
    let mut cmd = broker.cli();
    cmd.args(["column", "run", "--host-config"])
        .arg(dir.join("host.toml"))
        .arg("--rows")
        .arg(dir.join("rows.json"))
        .arg("--out")
        .arg(dir.join("manifest.json"))
        .arg("--workdir")
        .arg(dir.join("work"))
        .arg("--model-log")
        .arg(&model_log);
    let stop_operator = CancellationToken::new();
    let approver = {
        let runtime = broker.runtime.clone();
        let stop = stop_operator.clone();
        tokio::spawn(operator(
            move || {
                let mut c = std::process::Command::new(crate::kit::bin("sharedos-broker"));
                c.arg("--runtime-dir").arg(&runtime);
                c
            },
            stop,
        ))
    };
    // Not kit::run: a harness with a held call may take up to the approval timeout more.
    let (code, out, err) = {
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true).stdin(std::process::Stdio::null());
        let o = tokio::time::timeout(std::time::Duration::from_secs(240), cmd.output())
            .await
            .expect("column run ended within 240 s")
            .expect("column run");
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    stop_operator.cancel();
    let approved = approver.await.expect("operator");
    println!("operator approved: {approved:?}");
    stop.cancel();
    let _ = server.await;
    let log: Vec<Value> = std::fs::read_to_string(&model_log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let stderr = std::fs::read_to_string(dir.join("work/harness.stderr.log")).unwrap_or_default();
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("manifest.json")).unwrap_or_else(|e| {
            panic!("manifest: {e}\ncolumn run:\n{out}\n{err}\nharness stderr:\n{stderr}")
        }),
    )
    .expect("json");
    let exit = exit.unwrap_or(if manifest["summary"]["allPassed"] == true {
        0
    } else {
        sharedos_column::runner::EXIT_NOT_ALL_PASSED.into()
    });
    assert_eq!(
        code, exit,
        "column run:\n{out}\n{err}\nharness stderr:\n{stderr}\nmodel log:\n{log:#?}"
    );
    println!("{out}");
    Some((manifest, log, broker))
}

/// Where each harness's matrix summary is committed (`tests/interop/matrix/<harness>.json`).
fn matrix_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("interop/matrix")
}

/// The run's summary (`column summary`, the README matrix's input) equals the committed one, so a
/// change in any grade fails here; `SHAREDOS_GOLDEN_UPDATE=1` writes it instead, from this real
/// run (the only way a summary is made).
fn matrix_summary(manifest: &Value, harness: &str) {
    let path = matrix_dir().join(format!("{harness}.json"));
    let summary = sharedos_column::matrix::summary(manifest);
    // The summary carries the column's SystemIdentity with the catalogue it was given.
    assert_eq!(
        summary["systemIdentity"]["catalogHash"], manifest["catalogHash"],
        "{summary:#}"
    );
    let text = serde_json::to_string_pretty(&summary).expect("json") + "\n";
    if std::env::var_os("SHAREDOS_GOLDEN_UPDATE").is_some() {
        std::fs::create_dir_all(matrix_dir()).expect("mkdir");
        std::fs::write(&path, text).expect("write summary");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (write it from a real run with SHAREDOS_GOLDEN_UPDATE=1)",
            path.display()
        )
    });
    let committed: Value = serde_json::from_str(&committed).expect("committed summary");
    assert_eq!(
        summary,
        committed,
        "{harness}'s column differs from its committed matrix summary {}: review, then rerun with SHAREDOS_GOLDEN_UPDATE=1 and regenerate the matrix in docs/interop.md",
        path.display()
    );
}

/// What every column must show: every row passed, the model saw each refusal as text it can act
/// on, the record carries the system identity on every line and aliases only on the bridge; the
/// harness offered its model exactly the turn's catalogue from the boundary and otherwise only its
/// declared tools; its summary matches the committed matrix.
fn check(
    manifest: &Value,
    log: &[Value],
    broker: &TestBroker,
    harness: &str,
    alias: &str,
    bridge_alias: &str,
    asked: Asked,
) {
    let rows = manifest["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), OPEN_ROWS + 1, "{manifest:#}");
    for row in rows {
        assert_eq!(row["systemIdentity"]["harness"], harness);
    }
    // Every row of the open turn but the two approval rows passes; `turn-closed` is graded from
    // what the harness did (its committed summary holds the grade) and checked against the record
    // in `turn_closed`.
    for (i, row) in rows[..OPEN_ROWS].iter().enumerate() {
        if i != 4 && i != 5 {
            assert_eq!(row["grade"], "pass", "{row}");
            assert!(row.get("approval").is_none(), "{row}");
        }
    }
    // The approval rows claim the read runs once approved: they pass only where it did, and say
    // what the approval came to.
    let (asks, held) = (&rows[4], &rows[5]);
    let said = |r: &Value| r["approval"]["said"].as_str().unwrap_or("").to_owned();
    assert_eq!(asks["grade"], "fail", "{asks}");
    match asked {
        Asked::Cannot(_) => {
            assert_eq!(said(asks), "no question shown: the harness cannot ask");
            assert_eq!(held["grade"], "pass", "{held}");
            assert_eq!(said(held), "no question shown: operator approved");
        }
        Asked::Declines(_, action) => {
            let words = match action {
                "decline" => "declined by the client",
                _ => "cancelled by the client",
            };
            for r in [asks, held] {
                assert_eq!(r["grade"], "fail", "{r}");
                assert_eq!(said(r), words, "{r}");
            }
        }
    }
    // The version the column measured (`--version`) is the one declared (pinned by the install).
    let measured = &manifest["harnessVersionMeasured"];
    assert_eq!(
        measured["version"], manifest["systemIdentity"]["harnessVersion"],
        "measured beside the declared one: {measured:#}"
    );
    assert_eq!(measured["exitCode"], 0, "{measured:#}");
    assert_eq!(rows[7]["code"], "budget_exhausted", "{:#}", rows[7]);
    assert_eq!(manifest["extraCalls"], json!([]), "{manifest:#}");
    let checks: Vec<(&str, &str)> = manifest["checks"]
        .as_array()
        .expect("checks: the column read the model log")
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap_or(""),
                c["grade"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        checks,
        [("offered-catalogue", "pass"), ("tool-policy", "pass")],
        "{:#}",
        manifest["checks"]
    );
    let catalogue: Vec<&str> = manifest["catalogue"]
        .as_array()
        .expect("catalogue")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(catalogue, CATALOGUE);
    let offered = &manifest["offered"];
    assert_eq!(
        offered["boundary"]
            .as_object()
            .expect("boundary")
            .keys()
            .collect::<Vec<_>>(),
        catalogue,
        "{offered:#}"
    );
    assert!(
        offered["boundary"]["files.read"]
            .as_str()
            .is_some_and(|a| a.contains(alias)),
        "{offered:#}"
    );
    assert_eq!(offered["missing"], json!([]));
    assert_eq!(offered["extra"], json!([]));
    assert!(
        offered["others"]
            .as_array()
            .expect("others")
            .iter()
            .all(|t| t["declared"] == true && t["origin"] == "harness-local"),
        "{offered:#}"
    );
    // The requests after the turn closed are counted apart (`afterClose`).
    let model_requests = log.iter().filter(|l| l["kind"] == "request").count();
    let after_close = manifest["afterClose"]["requests"].as_u64().unwrap_or(0);
    assert_eq!(
        offered["requests"].as_u64().map(|n| n + after_close),
        Some(model_requests as u64),
        "{offered:#}"
    );
    assert!(
        manifest["model"]["asked"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{:#}",
        manifest["model"]
    );
    assert!(
        manifest["systemIdentity"]["catalogHash"]
            .as_str()
            .is_some_and(|h| h.len() == 64)
    );
    let results: Vec<&Value> = log.iter().filter(|l| l["kind"] == "tool_result").collect();
    assert!(results.len() >= OPEN_ROWS, "{log:#?}");
    assert!(
        results[6]["text"]
            .as_str()
            .is_some_and(|t| t.contains("hello.txt")),
        "the search's hits: {:?}",
        results[6]
    );
    assert!(
        // Qwen Code passes it on inside a JSON text, its quotes escaped.
        results[7]["text"]
            .as_str()
            .is_some_and(|t| t.contains("denied: files.search of /public — budget")
                && t.contains("files.search calls_per_turn=1")
                && t.contains("exhausted (1 of 1 calls used in this turn)")),
        "the model sees the budget refusal: {:?}",
        results[7]
    );
    assert!(
        results[8]["text"]
            .as_str()
            .is_some_and(|t| t.contains("UTC") && !t.contains("denied:")),
        "the long-named tool's answer: {:?}",
        results[8]
    );
    assert!(
        results[0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("Hello") || t.contains("hello")),
        "{:?}",
        results[0]
    );
    for r in &results[1..5] {
        assert!(
            r["text"].as_str().is_some_and(|t| t.contains("denied:")),
            "the model sees the refusal: {r}"
        );
    }
    if let Asked::Cannot(_) = asked {
        assert!(
            results[5]["text"]
                .as_str()
                .is_some_and(|t| t.contains(HELD)),
            "the model sees what the operator let it read: {:?}",
            results[5]
        );
    }
    assert!(
        log.iter()
            .any(|l| l["tool"].as_str().is_some_and(|t| t.contains(alias))),
        "offered as {alias}: {log:#?}"
    );
    let turn = manifest["turn"].as_str().expect("turn");
    let lines: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["turn"] == turn)
        .collect();
    assert!(!lines.is_empty());
    for l in &lines {
        assert_eq!(l["systemIdentity"]["harness"], harness, "stamped: {l}");
        if l["kind"] == "call" {
            assert!(l.get("aliases").is_none(), "no alias on a call record");
        }
    }
    let bridge = lines
        .iter()
        .find(|l| l["kind"] == "bridge_connected")
        .expect("bridge_connected");
    assert!(
        bridge["aliases"].to_string().contains(bridge_alias),
        "{bridge}"
    );
    principal_approval(manifest, &results, &lines, harness, asked);
    turn_closed(manifest, log, &lines);
    matrix_summary(manifest, harness);
}

/// The `turn-closed` row against the record and the model log: the column closed the turn
/// (`turn_closed`, reason `host`) after the eight calls of the open turn, no call ran after it,
/// and the row's grade and detail agree with what the harness did. Prints what was measured.
fn turn_closed(manifest: &Value, log: &[Value], lines: &[Value]) {
    let row = &manifest["rows"][OPEN_ROWS];
    assert_eq!(row["id"], "turn-closed");
    let run = &manifest["harnessRun"];
    let closed = lines
        .iter()
        .position(|l| l["kind"] == "turn_closed")
        .expect("turn_closed");
    assert_eq!(lines[closed]["reason"], "host", "{}", lines[closed]);
    let calls_before = lines[..closed]
        .iter()
        .filter(|l| l["kind"] == "call")
        .count();
    assert_eq!(
        run["turnClosedMidRun"],
        json!({"afterCalls": OPEN_ROWS}),
        "{run:#}"
    );
    assert_eq!(calls_before, OPEN_ROWS, "{lines:#?}");
    assert!(
        lines[closed..]
            .iter()
            .all(|l| l["kind"] != "call" || l["outcome"] != "succeeded"),
        "nothing runs after the close: {lines:#?}"
    );
    let seen = sharedos_column::runner::step_seen(log, OPEN_ROWS);
    println!(
        "MEASURED turn-closed {}",
        json!({"grade": row["grade"], "detail": row["detail"], "exit": run["exitCode"],
               "afterClose": manifest["afterClose"],
               "timedOut": run["timedOut"], "ms": run["durationMs"], "attempted": seen.attempted,
               "modelSaw": seen.model_saw})
    );
    match row["grade"].as_str() {
        Some("pass") => {
            assert_eq!(run["timedOut"], false);
            assert!(seen.attempted.is_some(), "{row:#}");
        }
        Some("fail") => assert!(
            run["timedOut"] == true || row["detail"].to_string().contains("ran after"),
            "{row:#}"
        ),
        _ => assert!(
            seen.attempted.is_none() || row["detail"].to_string().contains("before the close"),
            "{row:#}"
        ),
    }
}

/// Milliseconds from one record line's `at` to another's (RFC 3339, UTC, the same day or the next).
fn ms_between(from: &Value, to: &Value) -> i64 {
    let ms = |l: &Value| -> i64 {
        let at = l["at"].as_str().expect("at");
        let clock = &at[at.find('T').expect("T") + 1..].trim_end_matches('Z');
        let (hms, frac) = clock.split_once('.').unwrap_or((clock, "0"));
        let mut parts = hms.split(':').map(|p| p.parse::<i64>().expect("clock"));
        let (h, m, s) = (
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
        );
        let frac_ms = format!("{frac:0<3}")[..3].parse::<i64>().expect("fraction");
        ((h * 60 + m) * 60 + s) * 1000 + frac_ms
    };
    (ms(to) - ms(from)).rem_euclid(86_400_000)
}

/// Issue 36, per harness, non-interactive: a read that needs the principal's own approval
/// (`/asks`, `@approval("principal")`) and one the principal or an operator may approve
/// (`/held`, `@approval("principal_or_operator")`). Where the client declared no elicitation
/// capability (as `bridge_client` records), the first is refused `denied/approval_unavailable`
/// at once with the reason recorded and in the model's text, and the second goes to the
/// operator queue, where the test approves it; where it declared one, the question is put and
/// the client's own answer is recorded, with how it was asked.
fn principal_approval(
    manifest: &Value,
    results: &[&Value],
    lines: &[Value],
    harness: &str,
    asked: Asked,
) {
    let of = |kind: &str, path: &str| -> Vec<&Value> {
        lines
            .iter()
            .filter(|l| l["kind"] == kind)
            .filter(|l| {
                let call = lines
                    .iter()
                    .find(|c| c["kind"] == "approval_requested" && c["callId"] == l["callId"]);
                call.is_some_and(|c| c["arguments"]["path"] == path)
            })
            .collect()
    };
    let client = lines
        .iter()
        .find(|l| l["kind"] == "bridge_client")
        .map(|l| l["client"].clone())
        .unwrap_or(Value::Null);
    let run = &manifest["harnessRun"];
    let mut measured = json!({"harness": harness, "version": manifest["systemIdentity"]["harnessVersion"],
        "client": client, "harnessExitCode": run["exitCode"], "harnessTimedOut": run["timedOut"],
        "harnessMs": run["durationMs"]});
    for (row, path) in [
        ("principal", "/asks/plan.txt"),
        ("principalOrOperator", "/held/plan.txt"),
    ] {
        let requested = of("approval_requested", path);
        let decided = of("approval_decided", path);
        let call = of("call", path);
        measured[row] = json!({
            "requested": requested.len(),
            "decided": decided.iter().map(|d| json!({"decision": d["decision"], "by": d["by"], "reason": d["reason"], "session": d["session"]})).collect::<Vec<_>>(),
            "call": call.iter().map(|c| format!("{}/{}", c["outcome"].as_str().unwrap_or("?"), c["code"].as_str().unwrap_or(""))).collect::<Vec<_>>(),
            "heldMs": match (requested.first(), decided.first()) { (Some(r), Some(d)) => json!(ms_between(r, d)), _ => Value::Null },
        });
    }
    measured["modelSaw"] = results[4]["text"].clone();
    println!("MEASURED {measured}");

    assert_eq!(run["timedOut"], false, "{measured:#}");
    let (p, o) = (&measured["principal"], &measured["principalOrOperator"]);
    assert_eq!(p["requested"], 1, "{measured:#}");
    assert_eq!(o["requested"], 1, "{measured:#}");
    // Refused, or declined, at once: nothing waits for the approval timeout.
    for row in [p, o] {
        assert!(
            row["heldMs"].as_i64().is_some_and(|ms| ms < 2000),
            "decided at once: {measured:#}"
        );
    }
    let asks_text = results[4]["text"].as_str().unwrap_or("");
    let held_text = results[5]["text"].as_str().unwrap_or("");
    let declared = measured["client"]["capabilities"]["elicitation"].is_array();
    match asked {
        Asked::Cannot(reason) => {
            assert!(!declared, "{measured:#}");
            assert_eq!(p["decided"][0]["decision"], "unavailable", "{measured:#}");
            assert!(
                p["decided"][0]["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with(reason)),
                "{measured:#}"
            );
            assert_eq!(
                p["call"],
                json!(["denied/approval_unavailable"]),
                "{measured:#}"
            );
            assert!(
                asks_text.contains("denied:")
                    && asks_text.contains("the harness cannot ask")
                    && asks_text.contains(reason),
                "the model is told why: {asks_text}"
            );
            assert_eq!(
                (&o["decided"][0]["decision"], &o["decided"][0]["by"]),
                (&json!("approved"), &json!("operator")),
                "{measured:#}"
            );
            assert_eq!(o["call"], json!(["succeeded/ok"]), "{measured:#}");
        }
        Asked::Declines(via, action) => {
            assert!(declared, "{measured:#}");
            for (row, text) in [(p, asks_text), (o, held_text)] {
                assert_eq!(row["decided"][0]["session"]["via"], via, "{measured:#}");
                assert_eq!(
                    row["decided"][0]["session"]["action"], action,
                    "{measured:#}"
                );
                assert_eq!(
                    (&row["decided"][0]["decision"], &row["decided"][0]["by"]),
                    (&json!("denied"), &json!("harness_session")),
                    "{measured:#}"
                );
                assert_eq!(
                    row["call"],
                    json!(["denied/approval_denied"]),
                    "{measured:#}"
                );
                assert!(
                    text.contains(&format!(
                        "the user did not approve this call when asked ({action})"
                    )),
                    "the model is told: {text}"
                );
            }
        }
    }
}

/// Claude Code's own tools as offered in `-p` mode (measured by the column from the scripted
/// model's log: 2.1.332 offers no Glob, Grep, Task or TodoWrite, which an earlier declaration
/// named, and fourteen tools it did not).
const CLAUDE_LOCAL: &str = r#"["Agent", "Bash", "CronCreate", "CronDelete", "CronList", "Edit", "EnterWorktree", "ExitWorktree", "ListAgents", "Monitor", "NotebookEdit", "Read", "ReportFindings", "ScheduleWakeup", "SendMessage", "Skill", "TaskStop", "WebFetch", "WebSearch", "Workflow", "Write"]"#;

/// Claude Code's host config; `config_base`: the host's own MCP config the column merges the
/// `sharedos` server into.
fn claude_host_config(
    port: u16,
    h: &BTreeMap<String, String>,
    config_base: Option<&std::path::Path>,
) -> String {
    format!(
        r#"harness = "claude-code"
harness_version = "{version}"
declared_model = "sharedos scripted-model on 127.0.0.1"
mcp_support = "native"
config_format = "claude-code"
config_path = "{{workdir}}/sharedos.mcp.json"
{base}command = "{bin}"
args = ["-p", "{{prompt}}", "--mcp-config", "{{config}}", "--strict-mcp-config", "--allowedTools", "mcp__sharedos__*", "--output-format", "stream-json", "--verbose"]
env_remove = ["ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN"]
timeout_seconds = 120
principal = "alice"
harness_local = {local}

[env]
HOME = "{{workdir}}"
CLAUDE_CONFIG_DIR = "{{workdir}}/claude"
ANTHROPIC_BASE_URL = "http://127.0.0.1:{port}"
ANTHROPIC_API_KEY = "sk-ant-dummy-offline"
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC = "1"
DISABLE_TELEMETRY = "1"
DISABLE_AUTOUPDATER = "1"
DISABLE_ERROR_REPORTING = "1"
DISABLE_BUG_COMMAND = "1"
DISABLE_NON_ESSENTIAL_MODEL_CALLS = "1"
ENABLE_TOOL_SEARCH = "false"
"#,
        version = h["CLAUDE_VERSION"],
        bin = h["CLAUDE_BIN"],
        local = CLAUDE_LOCAL,
        base = config_base
            .map(|b| format!("config_base = \"{}\"\n", b.display()))
            .unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn claude_code_column() {
    let Some((manifest, log, broker)) =
        column(None, |port, h, _| claude_host_config(port, h, None)).await
    else {
        return;
    };
    check(
        &manifest,
        &log,
        &broker,
        "claude-code",
        "mcp__sharedos__files_read",
        r#""files.read":"mcp__sharedos__files_read""#,
        Asked::Declines("input_required", "cancel"),
    );
}

/// Issue 37: the host's Claude Code config also has a second MCP server (the real PyPI
/// mcp-server-time), which the strict ToolPolicy does not declare. Every attempt still passes and
/// the boundary's tools still equal the catalogue, but the column sees the time server's tools
/// in what Claude Code offered its model, lists them as another server's, and grades the run
/// `misdeclared` (exit 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn claude_code_with_a_second_mcp_server_is_misdeclared() {
    let Some(servers) = crate::kit::installed("mcp-servers", ".ci/install-mcp-servers") else {
        return;
    };
    let Some((manifest, log, _broker)) = column(
        Some(sharedos_column::runner::EXIT_NOT_ALL_PASSED.into()),
        |port, h, dir| {
            let base = dir.join("claude-base.json");
            std::fs::write(
                &base,
                json!({"mcpServers": {"time": {"type": "stdio", "command": servers["TIME_CMD"],
                    "args": [servers["TIME_ARGS"]]}}})
                .to_string(),
            )
            .expect("base");
            claude_host_config(port, h, Some(&base))
        },
    )
    .await
    else {
        return;
    };
    let rows = manifest["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), OPEN_ROWS + 1);
    assert!(
        rows.iter()
            .enumerate()
            .all(|(i, r)| (r["grade"] == "pass") == (i != 4 && i != 5)),
        "{manifest:#}"
    );
    let checks = manifest["checks"].as_array().expect("checks");
    assert_eq!(checks[0]["id"], "offered-catalogue");
    assert_eq!(checks[0]["grade"], "pass", "{:#}", checks[0]);
    assert_eq!(checks[1]["id"], "tool-policy");
    assert_eq!(checks[1]["grade"], "fail", "{:#}", checks[1]);
    let detail = checks[1]["detail"].as_str().expect("detail");
    assert!(
        detail.starts_with("misdeclared: the strict ToolPolicy"),
        "{detail}"
    );
    let others = manifest["offered"]["others"].as_array().expect("others");
    let time: Vec<&str> = others
        .iter()
        .filter(|t| t["origin"] == "other-server")
        .map(|t| {
            assert_eq!(t["server"], "time", "{t}");
            assert_eq!(t["declared"], false, "{t}");
            t["name"].as_str().expect("name")
        })
        .collect();
    // mcp-server-time's two tools, under Claude Code's naming for a server called `time`.
    assert_eq!(
        time,
        ["mcp__time__convert_time", "mcp__time__get_current_time"],
        "{others:#?}"
    );
    for name in &time {
        assert!(
            detail.contains(&format!("`{name}` (server `time`)")),
            "{detail}"
        );
    }
    let local: Vec<String> = serde_json::from_str(CLAUDE_LOCAL).expect("local");
    assert_eq!(
        others.iter().filter(|t| t["declared"] == true).count(),
        local.len(),
        "{others:#?}"
    );
    // Claude Code's own MCP-resource tools, offered only once a server in its config has
    // resources (the time server's SDK declares the capability; SharedOS's shim does not):
    // harness-local, and undeclared too.
    let undeclared_local: Vec<&str> = others
        .iter()
        .filter(|t| t["origin"] == "harness-local" && t["declared"] == false)
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(
        undeclared_local,
        [
            "ListMcpResourcesTool",
            "ReadMcpResourceDirTool",
            "ReadMcpResourceTool"
        ],
        "{others:#?}"
    );
    assert!(
        detail.contains("offered its model 5 undeclared"),
        "{detail}"
    );
    assert_eq!(others.len(), local.len() + time.len() + 3, "{others:#?}");
    // The two approval rows fail (Claude Code's client cancels every question itself) and the
    // tool policy is misdeclared.
    assert_eq!(
        manifest["summary"],
        json!({"pass": 9, "fail": 3, "notExercised": 0, "allPassed": false})
    );
    // The model log agrees: every request with tools offered the time server's tools.
    for r in log.iter().filter(|l| {
        l["kind"] == "request" && l["offered"].as_array().is_some_and(|a| !a.is_empty())
    }) {
        let offered = r["offered"].to_string();
        assert!(offered.contains("mcp__time__get_current_time"), "{offered}");
    }
}

/// Issue 47: the same host config with the time server, but its ToolPolicy is open and declares
/// the server `externalDirect` (and Claude Code's three MCP-resource tools, which it offers once
/// a server has resources, harness-local): graded on it, the column passes its checks: the time
/// server's tools were offered as declared (`external-direct`), and no call reached the boundary
/// for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn claude_code_with_a_declared_external_server_passes_its_checks() {
    let Some(servers) = crate::kit::installed("mcp-servers", ".ci/install-mcp-servers") else {
        return;
    };
    let Some((manifest, _log, broker)) = column(None, |port, h, dir| {
        let base = dir.join("claude-base.json");
        std::fs::write(
            &base,
            json!({"mcpServers": {"time": {"type": "stdio", "command": servers["TIME_CMD"],
                "args": [servers["TIME_ARGS"]]}}})
            .to_string(),
        )
        .expect("base");
        let mut local: Vec<String> = serde_json::from_str(CLAUDE_LOCAL).expect("local");
        local.extend(
            [
                "ListMcpResourcesTool",
                "ReadMcpResourceDirTool",
                "ReadMcpResourceTool",
            ]
            .map(String::from),
        );
        let strict = format!("harness_local = {CLAUDE_LOCAL}\n");
        let text = claude_host_config(port, h, Some(&base));
        assert!(text.contains(&strict));
        text.replace(
            &strict,
            &format!(
                "harness_local = {}\ntool_policy = \"open\"\nexternal_direct = [\"time\"]\n",
                json!(local)
            ),
        )
    })
    .await
    else {
        return;
    };
    assert_eq!(
        manifest["toolPolicy"],
        json!({"mode": "open", "harnessLocal": manifest["toolPolicy"]["harnessLocal"], "externalDirect": ["time"]})
    );
    let checks: Vec<(&str, &str)> = manifest["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap_or(""),
                c["grade"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        checks,
        [
            ("offered-catalogue", "pass"),
            ("tool-policy", "pass"),
            ("external-direct", "pass")
        ],
        "{:#}",
        manifest["checks"]
    );
    let detail = manifest["checks"][2]["detail"].as_str().expect("detail");
    assert!(
        detail.contains(
            "(`time`) offered to the model as 2 tool(s), none called through the boundary"
        ),
        "{detail}"
    );
    let time: Vec<&Value> = manifest["offered"]["others"]
        .as_array()
        .expect("others")
        .iter()
        .filter(|t| t["origin"] == "other-server")
        .collect();
    assert_eq!(time.len(), 2, "{time:#?}");
    assert!(
        time.iter()
            .all(|t| t["server"] == "time" && t["declared"] == true)
    );
    // Only the two approval rows fail (nobody can approve in `-p` mode); the checks all pass.
    assert_eq!(
        manifest["summary"],
        json!({"pass": 11, "fail": 2, "notExercised": 0, "allPassed": false})
    );
    // Nothing of the time server went through the boundary: every recorded call is a catalogue
    // tool's.
    let turn = manifest["turn"].as_str().expect("turn");
    let calls: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["turn"] == turn && l["kind"] == "call")
        .collect();
    assert_eq!(calls.len(), OPEN_ROWS, "{calls:#?}");
    assert!(
        calls
            .iter()
            .all(|c| CATALOGUE.contains(&c["tool"].as_str().unwrap_or(""))),
        "{calls:#?}"
    );
}

/// Issue 47: a strict ToolPolicy with an `externalDirect` entry stays refused: `column run`
/// exits non-zero before it opens a turn, naming the host config and the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_tool_policy_with_an_external_server_is_refused() {
    let broker = TestBroker::start(Options::default()).await;
    let dir = broker.dir.path();
    let host = dir.join("host.toml");
    std::fs::write(
        &host,
        "harness = \"claude-code\"\ndeclared_model = \"m\"\nmcp_support = \"native\"\nconfig_format = \"claude-code\"\ncommand = \"/bin/true\"\nprincipal = \"alice\"\nharness_local = [\"Bash\"]\nexternal_direct = [\"time\"]\n",
    )
    .expect("host");
    std::fs::write(
        dir.join("rows.json"),
        json!([{"id": "a", "tool": "files.read", "arguments": {"path": "/public/hello.txt"}, "expect": "allowed"}]).to_string(),
    )
    .expect("rows");
    let mut cmd = broker.cli();
    cmd.args(["column", "run", "--host-config"])
        .arg(&host)
        .arg("--rows")
        .arg(dir.join("rows.json"))
        .arg("--out")
        .arg(dir.join("manifest.json"));
    let (code, out, err) = run(cmd).await;
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(
        err.contains(&format!("host config `{}`", host.display()))
            && err.contains("a strict tool policy cannot list externalDirect tools (`time`)"),
        "{err}"
    );
    assert!(!dir.join("manifest.json").exists());
    let turns = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "turn_opened")
        .count();
    assert_eq!(turns, 0, "no turn was opened");
}

/// Codex's own tools as `exec` offers them (measured by the column from the scripted model's
/// log; a namespaced one as `namespace/name`): 0.171.0 offers no `apply_patch`, `shell` or
/// `update_plan`, which an earlier declaration named, and `exec_command`, `web_search`, its
/// `multi_agent_v1` namespace and more that it did not.
const CODEX_LOCAL: &str = r#"["create_goal", "exec_command", "get_goal", "list_mcp_resource_templates", "list_mcp_resources", "multi_agent_v1/close_agent", "multi_agent_v1/resume_agent", "multi_agent_v1/send_input", "multi_agent_v1/spawn_agent", "multi_agent_v1/wait_agent", "read_mcp_resource", "request_user_input", "update_goal", "view_image", "web_search", "write_stdin"]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn codex_column() {
    let Some((manifest, log, broker)) = column(None, |port, h, dir| {
        let base = dir.join("codex-base.toml");
        std::fs::write(
            &base,
            format!(
                r#"check_for_update_on_startup = false
model = "fake-model"
model_provider = "fake"
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.fake]
name = "SharedOS scripted model"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "FAKE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 30000

[analytics]
enabled = false
"#
            ),
        )
        .expect("base");
        format!(
            r#"harness = "codex"
harness_version = "{version}"
declared_model = "fake-model (sharedos scripted-model on 127.0.0.1)"
mcp_support = "native"
config_format = "codex"
config_path = "{{workdir}}/codex/config.toml"
config_base = "{base}"
command = "{bin}"
args = ["exec", "--skip-git-repo-check", "--json", "--ephemeral", "{{prompt}}"]
env_remove = ["OPENAI_API_KEY", "OPENAI_BASE_URL", "RUST_BACKTRACE"]
timeout_seconds = 120
principal = "alice"
harness_local = {local}

[env]
HOME = "{{workdir}}"
CODEX_HOME = "{{workdir}}/codex"
FAKE_API_KEY = "dummy"
"#,
            version = h["CODEX_VERSION"],
            bin = h["CODEX_BIN"],
            base = base.display(),
            local = CODEX_LOCAL,
        )
    })
    .await
    else {
        return;
    };
    check(
        &manifest,
        &log,
        &broker,
        "codex",
        "mcp__sharedos/files_read",
        r#""namespace":"mcp__sharedos""#,
        Asked::Declines("elicitation/create", "decline"),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn pi_column() {
    let Some((manifest, log, broker)) = column(None, |port, h, _| {
        let path = format!("{}:{}", h["NODE22_BIN_DIR"], std::env::var("PATH").unwrap_or_default());
        let models = json!({"providers": {"fake": {
            "baseUrl": format!("http://127.0.0.1:{port}/v1"), "api": "openai-completions", "apiKey": "dummy-key",
            "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
            "models": [{"id": "fake-model", "reasoning": false, "input": ["text"], "contextWindow": 128000, "maxTokens": 4096,
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}]}}});
        format!(
            r#"harness = "pi"
harness_version = "{version}"
declared_model = "fake/fake-model (sharedos scripted-model on 127.0.0.1)"
mcp_support = "extension"
extension = "pi-mcp-adapter@{adapter_version}"
config_format = "pi"
config_path = "{{workdir}}/.mcp.json"
command = "{node}"
args = ["{pi}", "{flag}", "{adapter}", "-p", "--mode", "json", "--no-session", "--provider", "fake", "--model", "fake-model", "--approve", "{{prompt}}"]
version_args = ["{pi}", "--version"]
timeout_seconds = 120
principal = "alice"
harness_local = ["bash", "edit", "mcp", "mcpScript", "read", "write"]

[env]
PATH = "{path}"
HOME = "{{workdir}}"
PI_CODING_AGENT_DIR = "{{workdir}}/agent"
PI_OFFLINE = "1"
PI_TELEMETRY = "0"

[[files]]
path = "{{workdir}}/agent/models.json"
content = '''{models}'''
"#,
            version = h["PI_VERSION"],
            adapter_version = h["PI_MCP_ADAPTER_VERSION"],
            node = h["NODE22"],
            pi = h["PI_BIN"],
            flag = h["PI_MCP_ADAPTER_FLAG"],
            adapter = h["PI_MCP_ADAPTER"],
        )
    })
    .await
    else {
        return;
    };
    check(
        &manifest,
        &log,
        &broker,
        "pi",
        "sharedos_files_read",
        "\"files.read\":\"sharedos_files_read\"",
        Asked::Cannot(NO_CAPABILITY),
    );
    assert_eq!(manifest["systemIdentity"]["mcpSupport"], "extension");
    assert_eq!(
        manifest["systemIdentity"]["extension"],
        "pi-mcp-adapter@2.36.0"
    );
}

/// Qwen Code's own tools as offered in `-p --yolo` mode (measured from the scripted model's log).
const QWEN_LOCAL: &str = r#"["agent", "cron_create", "cron_delete", "cron_list", "edit", "enter_worktree", "exit_worktree", "get_goal", "glob", "grep_search", "list_agents", "loop_wakeup", "monitor", "notebook_edit", "read_file", "read_mcp_resource", "record_artifact", "report_findings", "run_shell_command", "send_message", "skill", "task_stop", "update_goal", "web_fetch", "write_file", "zoom_image"]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn qwen_code_column() {
    let Some((manifest, log, broker)) = column(None, |port, h, dir| {
        // The host's own settings, into which the column merges the `sharedos` server. Without
        // `tools.toolSearch.enabled = false`, Qwen Code offers MCP tools only behind its
        // tool_search/tool_call bridge (deferred), not by name.
        let base = dir.join("qwen-base.json");
        std::fs::write(
            &base,
            json!({
                "tools": {"toolSearch": {"enabled": false}},
                "privacy": {"usageStatisticsEnabled": false},
                "telemetry": {"enabled": false},
            })
            .to_string(),
        )
        .expect("base");
        format!(
            r#"harness = "qwen-code"
harness_version = "{version}"
declared_model = "fake-model (sharedos scripted-model on 127.0.0.1)"
mcp_support = "native"
config_format = "qwen-code"
config_path = "{{workdir}}/.qwen/settings.json"
config_base = "{base}"
command = "{node}"
args = ["{bin}", "-p", "{{prompt}}", "--yolo", "--output-format", "json"]
version_args = ["{bin}", "--version"]
env_remove = ["OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL", "DASHSCOPE_API_KEY"]
timeout_seconds = 120
principal = "alice"
harness_local = {local}

[env]
HOME = "{{workdir}}"
OPENAI_BASE_URL = "http://127.0.0.1:{port}/v1"
OPENAI_API_KEY = "dummy"
OPENAI_MODEL = "fake-model"
"#,
            version = h["QWEN_VERSION"],
            node = h["NODE22"],
            bin = h["QWEN_BIN"],
            base = base.display(),
            local = QWEN_LOCAL,
        )
    })
    .await
    else {
        return;
    };
    let sent = sharedos_proto::alias::Harness::QwenCode
        .alias("sharedos", "files.read")
        .expect("qwen alias");
    assert_eq!(sent, "mcp__sharedos__files_read_1rtbejb");
    // The long-named tool, as Qwen Code offered it: its rewritten name with the hash suffix is
    // exactly its 63-character limit, the tool's own name whole.
    let long = sharedos_proto::alias::Harness::QwenCode
        .alias("sharedos", LONG_NAME)
        .expect("qwen alias");
    assert_eq!(
        long,
        "mcp__sharedos__a_namespace_near_limits_get_current_time_0gfqgqp"
    );
    assert_eq!(long.len(), sharedos_proto::alias::QWEN_NAME_MAX);
    assert!(
        log.iter().any(|l| l["kind"] == "request"
            && l["reply"] == "tool_call"
            && l["tool"] == long.as_str()),
        "Qwen Code called it by that name: {log:#?}"
    );
    // What Qwen Code offered its model on the first request: the boundary's four tools under
    // their measured aliases, and exactly the declared harness-local tools besides.
    let first = log
        .iter()
        .find(|l| l["kind"] == "request")
        .expect("a model request");
    let offered: std::collections::BTreeSet<&str> = first["offered"]
        .as_array()
        .expect("offered")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let boundary: std::collections::BTreeSet<&str> = offered
        .iter()
        .copied()
        .filter(|t| t.starts_with("mcp__sharedos__"))
        .collect();
    let want: Vec<String> = CATALOGUE
        .iter()
        .map(|t| {
            sharedos_proto::alias::Harness::QwenCode
                .alias("sharedos", t)
                .expect("alias")
        })
        .collect();
    assert_eq!(
        boundary,
        want.iter().map(String::as_str).collect(),
        "{offered:?}"
    );
    let local: Vec<String> = serde_json::from_str(QWEN_LOCAL).expect("local");
    assert_eq!(
        offered.difference(&boundary).copied().collect::<Vec<_>>(),
        local.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert_eq!(first["model"], "fake-model");
    check(
        &manifest,
        &log,
        &broker,
        "qwen-code",
        &sent,
        &format!("\"files.read\":\"{sent}\""),
        Asked::Cannot(NO_CAPABILITY),
    );
}

/// opencode's own tools as offered by `opencode run` (measured from the scripted model's log).
const OPENCODE_LOCAL: &str = r#"["bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write"]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn opencode_column() {
    let Some((manifest, log, broker)) = column(None, |port, h, dir| {
        assert!(
            h.contains_key("OPENCODE_BIN"),
            "harnesses.env has no OPENCODE_BIN: run .ci/install-harnesses again"
        );
        // The host's own opencode.json (its provider: the scripted model, OpenAI-compatible),
        // into which the column merges the `sharedos` server under `mcp`. `--dir` because
        // opencode takes its project folder from $PWD, not from the cwd it is started in.
        let base = dir.join("opencode-base.json");
        std::fs::write(
            &base,
            json!({
                "$schema": "https://opencode.ai/config.json",
                "model": "scripted/fake-model",
                "autoupdate": false,
                "share": "disabled",
                "provider": {"scripted": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "SharedOS scripted model",
                    "options": {"baseURL": format!("http://127.0.0.1:{port}/v1"), "apiKey": "dummy"},
                    "models": {"fake-model": {"name": "fake-model"}},
                }},
            })
            .to_string(),
        )
        .expect("base");
        format!(
            r#"harness = "opencode"
harness_version = "{version}"
declared_model = "scripted/fake-model (sharedos scripted-model on 127.0.0.1)"
mcp_support = "native"
config_format = "opencode"
config_path = "{{workdir}}/opencode.json"
config_base = "{base}"
command = "{bin}"
args = ["run", "--dir", "{{workdir}}", "--format", "json", "{{prompt}}"]
env_remove = ["OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENCODE_CONFIG", "OPENCODE_CONFIG_CONTENT", "OPENCODE_CONFIG_DIR"]
timeout_seconds = 120
principal = "alice"
harness_local = {local}

[env]
HOME = "{{workdir}}/home"
OPENCODE_DISABLE_AUTOUPDATE = "1"
OPENCODE_DISABLE_MODELS_FETCH = "1"
OPENCODE_DISABLE_SHARE = "1"
OPENCODE_DISABLE_LSP_DOWNLOAD = "1"
npm_config_offline = "true"
"#,
            version = h["OPENCODE_VERSION"],
            bin = h["OPENCODE_BIN"],
            base = base.display(),
            local = OPENCODE_LOCAL,
        )
    })
    .await
    else {
        return;
    };
    let sent = sharedos_proto::alias::Harness::Opencode
        .alias("sharedos", "files.read")
        .expect("opencode alias");
    assert_eq!(sent, "sharedos_files_read");
    // The name opencode really called: the scripted model logs the offered name it played.
    let called: Vec<&str> = log
        .iter()
        .filter(|l| l["kind"] == "request" && l["reply"] == "tool_call")
        .filter_map(|l| l["tool"].as_str())
        .collect();
    assert_eq!(
        called,
        [
            sent.as_str(),
            &sent,
            &sent,
            "sharedos_files_list",
            &sent,
            &sent,
            "sharedos_files_search",
            "sharedos_files_search",
            "sharedos_a_namespace_near_limits_get_current_time",
            &sent
        ],
        "{log:#?}"
    );
    // opencode's first request is its own title request, with no tools; every other one until
    // the turn closed offers the boundary's four tools under their measured aliases and exactly
    // the declared harness-local tools besides.
    let (open, _) = sharedos_column::runner::split_at_step(&log, OPEN_ROWS);
    let requests: Vec<&Value> = open.iter().filter(|l| l["kind"] == "request").collect();
    let toolless = requests
        .iter()
        .filter(|l| l["offered"].as_array().is_some_and(Vec::is_empty))
        .count();
    assert!(toolless <= 1, "{log:#?}");
    let with_tools: Vec<&Value> = requests
        .iter()
        .copied()
        .filter(|l| l["offered"].as_array().is_some_and(|a| !a.is_empty()))
        .collect();
    assert_eq!(with_tools.len(), OPEN_ROWS + 1, "{log:#?}");
    offers_exactly(
        &with_tools,
        sharedos_proto::alias::Harness::Opencode,
        "sharedos_",
        OPENCODE_LOCAL,
        None,
    );
    check(
        &manifest,
        &log,
        &broker,
        "opencode",
        &sent,
        &format!("\"files.read\":\"{sent}\""),
        Asked::Cannot(NO_CAPABILITY),
    );
}

/// Gemini CLI's own tools as offered in `-p --yolo` mode (measured from the scripted model's log).
const GEMINI_LOCAL: &str = r#"["activate_skill", "enter_plan_mode", "glob", "google_web_search", "grep_search", "invoke_agent", "list_background_processes", "list_directory", "read_background_output", "read_file", "replace", "run_shell_command", "update_topic", "web_fetch", "write_file"]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn gemini_cli_column() {
    let Some((manifest, log, broker)) = column(None, |port, h, dir| {
        assert!(
            h.contains_key("GEMINI_BIN"),
            "harnesses.env has no GEMINI_BIN: run .ci/install-harnesses again"
        );
        // The host's own user settings, into which the column merges the `sharedos` server.
        // `selectedType`: with only GOOGLE_GEMINI_BASE_URL, Gemini CLI 0.61 picks its "gateway"
        // auth type, which `-p` mode refuses; with the API key type it still uses the base URL.
        let base = dir.join("gemini-base.json");
        std::fs::write(
            &base,
            json!({
                "security": {"auth": {"selectedType": "gemini-api-key"}},
                "privacy": {"usageStatisticsEnabled": false},
                "telemetry": {"enabled": false},
            })
            .to_string(),
        )
        .expect("base");
        format!(
            r#"harness = "gemini-cli"
harness_version = "{version}"
declared_model = "fake-model (sharedos scripted-model on 127.0.0.1)"
mcp_support = "native"
config_format = "gemini-cli"
config_path = "{{workdir}}/home/.gemini/settings.json"
config_base = "{base}"
command = "{node}"
args = ["{bin}", "-p", "{{prompt}}", "--yolo", "--skip-trust", "--output-format", "json", "-m", "fake-model"]
version_args = ["{bin}", "--version"]
env_remove = ["GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GEMINI_BASE_URL", "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_GENAI_USE_GCA", "GOOGLE_CLOUD_PROJECT"]
timeout_seconds = 120
principal = "alice"
harness_local = {local}

[env]
HOME = "{{workdir}}/home"
GOOGLE_GEMINI_BASE_URL = "http://127.0.0.1:{port}"
GEMINI_API_KEY = "dummy"
"#,
            version = h["GEMINI_VERSION"],
            node = h["NODE22"],
            bin = h["GEMINI_BIN"],
            base = base.display(),
            local = GEMINI_LOCAL,
        )
    })
    .await
    else {
        return;
    };
    let sent = sharedos_proto::alias::Harness::GeminiCli
        .alias("sharedos", "files.read")
        .expect("gemini alias");
    assert_eq!(sent, "mcp_sharedos_files.read");
    // The names Gemini CLI really called.
    let called: Vec<&str> = log
        .iter()
        .filter(|l| l["kind"] == "request" && l["reply"] == "tool_call")
        .filter_map(|l| l["tool"].as_str())
        .collect();
    assert_eq!(
        called,
        [
            sent.as_str(),
            &sent,
            &sent,
            "mcp_sharedos_files.list",
            &sent,
            &sent,
            "mcp_sharedos_files.search",
            "mcp_sharedos_files.search",
            "mcp_sharedos_a_namespace_near_limits.get_current_time",
            &sent
        ],
        "{log:#?}"
    );
    // Every request until the turn closed offers the boundary's four tools under their measured
    // aliases and exactly the declared harness-local tools besides, and asks for the declared model.
    let (open, _) = sharedos_column::runner::split_at_step(&log, OPEN_ROWS);
    let requests: Vec<&Value> = open.iter().filter(|l| l["kind"] == "request").collect();
    assert_eq!(requests.len(), OPEN_ROWS + 1, "{log:#?}");
    offers_exactly(
        &requests,
        sharedos_proto::alias::Harness::GeminiCli,
        "mcp_sharedos_",
        GEMINI_LOCAL,
        Some("gemini"),
    );
    check(
        &manifest,
        &log,
        &broker,
        "gemini-cli",
        &sent,
        &format!("\"files.read\":\"{sent}\""),
        Asked::Cannot(NO_CAPABILITY),
    );
}

/// Cline's own tools as offered by `cline --json` (measured from the scripted model's log).
const CLINE_LOCAL: &str = r#"["ask_question", "editor", "fetch_web_content", "read_files", "run_commands", "search_codebase", "spawn_agent", "team_attach_outcome_fragment", "team_await_runs", "team_broadcast", "team_cancel_run", "team_cleanup", "team_create_outcome", "team_finalize_outcome", "team_list_outcomes", "team_list_runs", "team_mission_log", "team_read_mailbox", "team_review_outcome_fragment", "team_run_task", "team_send_message", "team_shutdown_teammate", "team_spawn_teammate", "team_status", "team_task"]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn cline_column() {
    let Some((manifest, log, broker)) = column(None, |port, h, dir| {
        assert!(
            h.contains_key("CLINE_BIN"),
            "harnesses.env has no CLINE_BIN: run .ci/install-harnesses again"
        );
        // The host's provider settings, as `cline auth -p openai -k dummy -m fake-model -b URL`
        // writes them: the scripted model as Cline's OpenAI-compatible provider. Without
        // `updatedAt` Cline 3.0.65 ignores the entry and falls back to its own `cline` provider.
        let providers = dir.join("cline-providers.json");
        std::fs::write(
            &providers,
            json!({
                "version": 1,
                "lastUsedProvider": "openai-compatible",
                "modes": {},
                "providers": {"openai-compatible": {
                    "settings": {
                        "provider": "openai-compatible",
                        "apiKey": "dummy",
                        "model": "fake-model",
                        "baseUrl": format!("http://127.0.0.1:{port}/v1"),
                    },
                    "updatedAt": "2026-12-06T00:00:00.000Z",
                    "tokenSource": "manual",
                }},
            })
            .to_string(),
        )
        .expect("providers");
        format!(
            r#"harness = "cline"
harness_version = "{version}"
declared_model = "fake-model (sharedos scripted-model on 127.0.0.1)"
mcp_support = "native"
config_format = "cline"
config_path = "{{workdir}}/cline_mcp_settings.json"
command = "{bin}"
args = ["--json", "{{prompt}}"]
version_args = ["--version"]
env_remove = ["OPENAI_API_KEY", "OPENAI_BASE_URL", "CLINE_DATA_DIR", "CLINE_DIR", "CLINE_GLOBAL_SETTINGS_PATH"]
timeout_seconds = 120
principal = "alice"
harness_local = {local}

[env]
HOME = "{{workdir}}/home"
CLINE_SESSION_BACKEND_MODE = "local"
CLINE_PROVIDER_SETTINGS_PATH = "{providers}"
CLINE_MCP_SETTINGS_PATH = "{{workdir}}/cline_mcp_settings.json"
"#,
            version = h["CLINE_VERSION"],
            bin = h["CLINE_BIN"],
            providers = providers.display(),
            local = CLINE_LOCAL,
        )
    })
    .await
    else {
        return;
    };
    let sent = sharedos_proto::alias::Harness::Cline
        .alias("sharedos", "files.read")
        .expect("cline alias");
    assert_eq!(sent, "sharedos__files_read_5f40265d");
    // The names Cline really called: every dotted name with its hash suffix.
    let called: Vec<&str> = log
        .iter()
        .filter(|l| l["kind"] == "request" && l["reply"] == "tool_call")
        .filter_map(|l| l["tool"].as_str())
        .collect();
    let list = sharedos_proto::alias::cline_name("sharedos", "files.list");
    let search = sharedos_proto::alias::cline_name("sharedos", "files.search");
    let long = sharedos_proto::alias::cline_name("sharedos", LONG_NAME);
    assert_eq!(
        called,
        [
            sent.as_str(),
            &sent,
            &sent,
            &list,
            &sent,
            &sent,
            &search,
            &search,
            &long,
            &sent
        ],
        "{log:#?}"
    );
    // Every request until the turn closed offers the boundary's four tools under their measured
    // aliases and exactly the declared harness-local tools besides.
    let (open, _) = sharedos_column::runner::split_at_step(&log, OPEN_ROWS);
    let requests: Vec<&Value> = open.iter().filter(|l| l["kind"] == "request").collect();
    assert_eq!(requests.len(), OPEN_ROWS + 1, "{log:#?}");
    offers_exactly(
        &requests,
        sharedos_proto::alias::Harness::Cline,
        "sharedos__",
        CLINE_LOCAL,
        Some("chat"),
    );
    check(
        &manifest,
        &log,
        &broker,
        "cline",
        &sent,
        &format!("\"files.read\":\"{sent}\""),
        Asked::Cannot(NO_CAPABILITY),
    );
}

/// The text of `/asks/plan.txt` in the terminal test, which the model sees once the person approved.
const ASKED: &str = "the asked plan, read once the person at the terminal approved";

/// What the person types into Claude Code.
const PROMPT: &str = "Read /asks/plan.txt with files.read";

/// Claude Code at a real terminal, at its empty prompt (see [`claude_at_its_prompt`]).
struct AtPrompt {
    term: terminal::Terminal,
    turn: String,
    model_log: std::path::PathBuf,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<Result<(), scripted_model::ScriptedModelError>>,
    first_run: Vec<&'static str>,
}

/// Claude Code run interactively in tmux, as a person runs it, against `broker` for alice: the
/// scripted model answers with `script`; the turn opened as the README's Claude Code section
/// opens it; Claude Code's config the one a person has after its first-run screens; the
/// questions it still asks before its prompt answered as a person would; `/mcp` shows `sharedos`
/// connected with `tools` tools. `test` names the test in the transcript.
async fn claude_at_its_prompt(
    h: &BTreeMap<String, String>,
    tmux: &str,
    broker: &TestBroker,
    script: Value,
    test: &str,
    tools: usize,
) -> AtPrompt {
    use terminal::{Terminal, panel};
    use tokio::time::Duration;

    let script: Script = serde_json::from_value(script).expect("script");
    let dir = broker.dir.path().to_path_buf();
    let listener = scripted_model::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let model_log = dir.join("model.jsonl");
    let stop = CancellationToken::new();
    let server = tokio::spawn(scripted_model::serve(
        listener,
        script,
        Some(model_log.clone()),
        stop.clone(),
    ));

    // The turn, opened as the README's Claude Code section opens it.
    let mcp_config = dir.join("claude.mcp.json");
    let mut open = broker.cli();
    open.args([
        "turn",
        "open",
        "--principal",
        "alice",
        "--harness",
        "claude-code",
        "--json",
    ])
    .arg("--write-config")
    .arg("claude-code")
    .arg(&mcp_config);
    let (code, out, err) = run(open).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let opened: Value = serde_json::from_str(&out).expect("turn open --json");
    let turn = opened["turn"].as_str().expect("turn").to_owned();

    // A person's Claude Code config after its first-run screens (read from a first real run:
    // onboarding, then the theme, then "Do you trust the files in this folder?", default "No,
    // exit"): onboarding done, a theme, this folder trusted.
    let (home, work, config_dir) = (dir.join("home"), dir.join("work"), dir.join("claude"));
    for d in [&home, &work, &config_dir] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let mut projects = serde_json::Map::new();
    projects.insert(
        work.display().to_string(),
        json!({"hasTrustDialogAccepted": true}),
    );
    std::fs::write(
        config_dir.join(".claude.json"),
        json!({"hasCompletedOnboarding": true, "theme": "dark", "projects": projects}).to_string(),
    )
    .expect(".claude.json");
    let env: Vec<(&str, String)> = vec![
        ("PATH", "/usr/local/bin:/usr/bin:/bin".into()),
        ("LANG", "C.UTF-8".into()),
        ("HOME", home.display().to_string()),
        ("CLAUDE_CONFIG_DIR", config_dir.display().to_string()),
        ("ANTHROPIC_BASE_URL", format!("http://127.0.0.1:{port}")),
        ("ANTHROPIC_API_KEY", "sk-ant-dummy-offline".into()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".into()),
        ("DISABLE_TELEMETRY", "1".into()),
        ("DISABLE_AUTOUPDATER", "1".into()),
        ("DISABLE_ERROR_REPORTING", "1".into()),
        ("DISABLE_BUG_COMMAND", "1".into()),
        ("DISABLE_NON_ESSENTIAL_MODEL_CALLS", "1".into()),
        ("ENABLE_TOOL_SEARCH", "false".into()),
    ];
    let argv: Vec<String> = vec![
        h["CLAUDE_BIN"].clone(),
        "--mcp-config".into(),
        mcp_config.display().to_string(),
        "--strict-mcp-config".into(),
        "--allowedTools".into(),
        "mcp__sharedos__*".into(),
    ];
    println!("{tmux}, {}x{}", terminal::COLS, terminal::ROWS);
    let mut term = Terminal::start(&dir, &work, &env, &argv).await;
    term.note(
        format!("# Claude Code run interactively under tmux by {test} \
         (tests/tests/e2e/interop.rs): each screen it answered (its last panel), the keys sent, and what the record shows."),
    );
    term.note(format!(
        "$ claude --mcp-config {} --strict-mcp-config --allowedTools 'mcp__sharedos__*'   # Claude Code {}, {}x{}",
        mcp_config.display(),
        h["CLAUDE_VERSION"],
        terminal::COLS,
        terminal::ROWS
    ));

    // Until its prompt is ready (an empty input line), answer what it asks first, as a person
    // would.
    let ready = |s: &[String]| s.iter().any(|l| l.trim() == "❯");
    let asks_key = |s: &[String]| {
        s.iter()
            .any(|l| l.contains("Do you want to use this API key?"))
    };
    let asks_trust = |s: &[String]| {
        s.iter()
            .any(|l| l.trim_start().trim_start_matches('❯').trim() == "Yes, I trust this folder")
    };
    let mut first_run: Vec<&str> = Vec::new();
    loop {
        let screen = term
            .wait_for(
                "Claude Code's prompt, or a question before it",
                Duration::from_secs(90),
                |s| ready(s) || asks_key(s) || asks_trust(s),
            )
            .await;
        type Asks = fn(&[String]) -> bool;
        let (heading, option, asked): (&str, &str, Asks) = if asks_key(&screen) {
            (
                "Claude Code asks whether to use the API key in its environment",
                "Yes",
                asks_key,
            )
        } else if asks_trust(&screen) {
            (
                "Claude Code asks whether to trust this folder",
                "Yes, I trust this folder",
                asks_trust,
            )
        } else {
            break;
        };
        assert!(
            !first_run.contains(&heading) && first_run.len() < 4,
            "asked again: {heading}"
        );
        first_run.push(heading);
        term.answered(heading, &screen);
        term.choose(option).await;
        // The question goes before the next screen is read.
        term.wait_for("the question to close", crate::kit::WAIT, |s| !asked(s))
            .await;
    }

    // A person checks the server is there: `/mcp` lists it connected, with its tools.
    let typed =
        |text: &'static str| move |s: &[String]| s.iter().any(|l| l.trim() == format!("❯ {text}"));
    term.type_text("/mcp").await;
    term.wait_for("`/mcp` typed", crate::kit::WAIT, typed("/mcp"))
        .await;
    term.press(&["Enter"]).await;
    let screen = term
        .wait_for(
            "`sharedos` connected in `/mcp`",
            Duration::from_secs(60),
            |s| {
                panel(s)
                    .iter()
                    .any(|l| l.contains("✔ sharedos") && l.contains(&format!("{tools} tools")))
            },
        )
        .await;
    term.answered("/mcp: the MCP servers", &screen);
    term.press(&["Escape"]).await;
    term.wait_for("the prompt again", crate::kit::WAIT, ready)
        .await;

    AtPrompt {
        term,
        turn,
        model_log,
        stop,
        server,
        first_run,
    }
}

/// Issue 47: a person at a real terminal. Claude Code runs interactively in tmux (a private
/// server, 200x50), as a person runs it: no `-p`, the config `turn open --write-config
/// claude-code` wrote, the boundary's tools pre-allowed (`--allowedTools`, so Claude Code's own
/// permission prompt does not show). Its config is the one a person has after the first-run
/// screens (onboarding done, a theme, the folder trusted); the question it still asks (whether to
/// use the API key in its environment) the test reads off the screen and answers `Yes`. The test
/// checks with `/mcp` that `sharedos` is connected, types the prompt, and the scripted model asks
/// for `files.read` of `/asks/plan.txt` (`@approval("principal")`). Claude Code shows the
/// broker's question as its form (`MCP server “sharedos” requests your input`); the test
/// reads it, chooses `approve` and presses `Accept`. The record shows the question asked once,
/// decided `approved` `by: harness_session` (`via: input_required`, `action: accept`, no sooner than
/// the four keys at a person's pace allow), and exactly one call, `succeeded`; the model sees the file; `/exit` ends
/// Claude Code with 0. The screens answered and the keys sent are kept beside the matrix
/// summaries in `tests/interop/matrix/claude-code-terminal.txt` (compared like the summaries;
/// `SHAREDOS_GOLDEN_UPDATE=1` writes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the harness CLIs and tmux: run bash .ci/install-harnesses (and install tmux), then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn a_person_at_a_terminal_answers_the_approval() {
    use terminal::{normalized, panel};
    use tokio::time::Duration;

    let Some(h) = harnesses() else {
        return;
    };
    let Some(tmux) = terminal::tmux_version().await else {
        assert!(
            std::env::var("CI").is_err(),
            "CI must install tmux first (bash .ci/run does)"
        );
        eprintln!("SKIPPED: tmux is not installed (Debian: apt-get install tmux)");
        return;
    };
    let broker = TestBroker::start(Options {
        policy: POLICY,
        top: "approval_timeout_seconds = 120\n".into(),
        ..Options::default()
    })
    .await;
    let dir = broker.dir.path().to_path_buf();
    std::fs::create_dir_all(dir.join("data/asks")).expect("mkdir");
    std::fs::write(dir.join("data/asks/plan.txt"), ASKED).expect("write");

    let script = json!({
        "steps": [{"tool": "files.read", "arguments": {"path": "/asks/plan.txt"}}],
        "final": "DONE",
    });
    let AtPrompt {
        mut term,
        turn,
        model_log,
        stop,
        server,
        first_run,
    } = claude_at_its_prompt(
        &h,
        &tmux,
        &broker,
        script,
        "interop::a_person_at_a_terminal_answers_the_approval",
        3,
    )
    .await;
    let typed =
        |text: &'static str| move |s: &[String]| s.iter().any(|l| l.trim() == format!("❯ {text}"));

    // The prompt; the model asks for the read that needs the principal's approval.
    term.type_text(PROMPT).await;
    term.wait_for("the prompt typed", crate::kit::WAIT, typed(PROMPT))
        .await;
    term.press(&["Enter"]).await;
    let asks = |s: &[String]| {
        panel(s)
            .iter()
            .any(|l| l.contains("MCP server “sharedos” requests your input"))
    };
    let screen = term
        .wait_for(
            "the boundary's approval question",
            Duration::from_secs(60),
            asks,
        )
        .await;
    term.answered(
        "the boundary's approval question, as Claude Code shows it",
        &screen,
    );
    let question = panel(&screen).join("\n");
    assert!(
        question.contains(
            "An agent acting for you asks to run `files.read` on SharedOS::File::\"/asks/plan.txt\""
        ) && question.contains("Approve it?")
            && question.contains("Your decision")
            && question.contains("Accept"),
        "the question on the screen:\n{question}"
    );
    let lines_of = |kind: &str| -> Vec<Value> {
        broker
            .records()
            .into_iter()
            .filter(|l| l["turn"] == turn.as_str() && l["kind"] == kind)
            .collect()
    };
    assert_eq!(lines_of("approval_requested").len(), 1);
    assert!(
        lines_of("approval_decided").is_empty() && lines_of("call").is_empty(),
        "nothing decided or run while the question is on the screen"
    );
    // Open the decision, choose `approve`, go to `Accept`, press it.
    term.press(&["Right"]).await;
    let screen = term
        .wait_for("the decision's options", crate::kit::WAIT, |s| {
            panel(s).iter().any(|l| l.trim() == "❯ ◯ approve")
        })
        .await;
    term.shows(&panel(&screen));
    term.press(&["Space"]).await;
    let screen = term
        .wait_for("`approve` chosen", crate::kit::WAIT, |s| {
            panel(s)
                .iter()
                .any(|l| l.contains("✔ Your decision: ▸ approve"))
        })
        .await;
    term.shows(&panel(&screen));
    term.press(&["Down"]).await;
    let screen = term
        .wait_for("the cursor on Accept", crate::kit::WAIT, |s| {
            panel(s)
                .iter()
                .any(|l| l.trim_start().starts_with("❯ Accept"))
        })
        .await;
    term.shows(&panel(&screen));
    term.press(&["Enter"]).await;
    let screen = term
        .wait_for("the model's answer", Duration::from_secs(60), |s| {
            !asks(s) && s.iter().any(|l| l.trim() == "● DONE")
        })
        .await;
    // What the session shows from the prompt to the answer (less its "done in" timing line).
    let from = screen
        .iter()
        .rposition(|l| l.trim() == format!("❯ {PROMPT}"))
        .expect("the prompt on the screen");
    let shown: Vec<String> = terminal::shown(&screen[from..])
        .into_iter()
        .take_while(|l| !l.trim().starts_with('✻') && !l.trim().starts_with('─'))
        .collect();
    term.note("screen: the session after the answer".into());
    term.shows(&shown);
    term.screens.push(terminal::shown(&screen));
    assert!(
        shown.iter().any(|l| l.trim() == "Called sharedos"),
        "{shown:#?}"
    );

    // The person leaves: `/exit`, and Claude Code exits 0.
    term.type_text("/exit").await;
    term.wait_for("`/exit` typed", crate::kit::WAIT, typed("/exit"))
        .await;
    term.press(&["Enter"]).await;
    let deadline = tokio::time::Instant::now() + crate::kit::WAIT;
    let status = loop {
        if let Some(s) = term.ended().await {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Claude Code did not exit after /exit ({}):\n{}",
            term.pane().await,
            term.screen().await.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    term.note(format!("Claude Code {status}"));
    assert_eq!(status, "exited 0", "{}", term.screen().await.join("\n"));
    stop.cancel();
    let _ = server.await;

    // The record: asked once, approved by the principal after the time the person took, one
    // call, succeeded.
    let requested = lines_of("approval_requested");
    let decided = lines_of("approval_decided");
    let calls = lines_of("call");
    let held_ms = ms_between(&requested[0], &decided[0]);
    let measured = json!({
        "requested": requested.len(),
        "decided": decided.iter().map(|d| json!({"decision": d["decision"], "by": d["by"], "session": d["session"]})).collect::<Vec<_>>(),
        "calls": calls.iter().map(|c| json!({"tool": c["tool"], "arguments": c["arguments"], "outcome": c["outcome"], "code": c["code"]})).collect::<Vec<_>>(),
        "heldMs": held_ms,
        "firstRun": first_run,
        // Claude Code may connect the server more than once (each shim a bridge of the turn).
        "bridges": lines_of("bridge_connected").iter().map(|b| json!({"at": b["at"], "shimPid": b["shim"]["pid"]})).collect::<Vec<_>>(),
    });
    println!("MEASURED terminal {measured}");
    assert_eq!(requested.len(), 1, "{measured:#}");
    assert_eq!(requested[0]["tool"], "files.read");
    assert_eq!(decided.len(), 1, "{measured:#}");
    let d = &decided[0];
    assert_eq!(d["callId"], requested[0]["callId"]);
    assert_eq!(
        (
            &d["decision"],
            &d["by"],
            &d["session"]["via"],
            &d["session"]["action"]
        ),
        (
            &json!("approved"),
            &json!("harness_session"),
            &json!("input_required"),
            &json!("accept")
        ),
        "{measured:#}"
    );
    assert_eq!(
        d["session"]["client"],
        format!("claude-code {}", h["CLAUDE_VERSION"]),
        "{measured:#}"
    );
    // A person's answer, not a client's own (those come within 20 ms): the test read the
    // question and pressed four keys, each after a person's pause.
    assert!(
        held_ms >= 4 * i64::try_from(terminal::PAUSE.as_millis()).expect("ms"),
        "{measured:#}"
    );
    assert_eq!(calls.len(), 1, "exactly one call: {measured:#}");
    assert_eq!(
        (
            &calls[0]["tool"],
            &calls[0]["arguments"]["path"],
            &calls[0]["outcome"],
            &calls[0]["code"]
        ),
        (
            &json!("files.read"),
            &json!("/asks/plan.txt"),
            &json!("succeeded"),
            &json!("ok")
        ),
        "{measured:#}"
    );
    assert_eq!(calls[0]["callId"], d["callId"]);
    let client = lines_of("bridge_client");
    assert!(
        client[0]["client"]["capabilities"]["elicitation"]
            .as_array()
            .is_some_and(|a| a.contains(&json!("form"))),
        "{client:#?}"
    );
    // The model saw the file, once.
    let log: Vec<Value> = std::fs::read_to_string(&model_log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let results: Vec<&Value> = log.iter().filter(|l| l["kind"] == "tool_result").collect();
    assert_eq!(results.len(), 1, "{log:#?}");
    assert_eq!(results[0]["text"], ASKED, "{log:#?}");
    assert_eq!(results[0]["isError"], false, "{log:#?}");

    term.note(format!(
        "record: approval_requested x{}; approval_decided {} by {} (via {}, action {}); call {} {} {}/{} x{}",
        requested.len(),
        d["decision"].as_str().unwrap_or("?"),
        d["by"].as_str().unwrap_or("?"),
        d["session"]["via"].as_str().unwrap_or("?"),
        d["session"]["action"].as_str().unwrap_or("?"),
        calls[0]["tool"].as_str().unwrap_or("?"),
        calls[0]["arguments"]["path"].as_str().unwrap_or("?"),
        calls[0]["outcome"].as_str().unwrap_or("?"),
        calls[0]["code"].as_str().unwrap_or("?"),
        calls.len(),
    ));

    // The screens answered, kept beside the summaries.
    for (i, s) in term.screens.iter().enumerate() {
        println!("SCREEN {}:\n{}\n", i + 1, s.join("\n"));
    }
    let root = dir.display().to_string();
    let text: String = term
        .transcript
        .iter()
        .map(|l| normalized(l, &root) + "\n")
        .collect();
    println!("TRANSCRIPT:\n{text}");
    let path = matrix_dir().join("claude-code-terminal.txt");
    if std::env::var_os("SHAREDOS_GOLDEN_UPDATE").is_some() {
        std::fs::create_dir_all(matrix_dir()).expect("mkdir");
        std::fs::write(&path, &text).expect("write the screens");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (write it from a real run with SHAREDOS_GOLDEN_UPDATE=1)",
            path.display()
        )
    });
    assert_eq!(
        text,
        committed,
        "what Claude Code showed differs from {}: review, then rerun with SHAREDOS_GOLDEN_UPDATE=1",
        path.display()
    );
}

/// Each of `requests` (the scripted model's log lines) offers the boundary's four tools under
/// `harness`'s measured aliases (the offered names starting with `prefix`), exactly the declared
/// harness-local tools (`local`, a JSON list) besides, and asks for the declared model, over
/// `api` when one is given.
fn offers_exactly(
    requests: &[&Value],
    harness: sharedos_proto::alias::Harness,
    prefix: &str,
    local: &str,
    api: Option<&str>,
) {
    let want: std::collections::BTreeSet<String> = CATALOGUE
        .iter()
        .map(|t| harness.alias("sharedos", t).expect("alias"))
        .collect();
    let local: std::collections::BTreeSet<String> = serde_json::from_str(local).expect("local");
    for r in requests {
        let offered: std::collections::BTreeSet<String> =
            serde_json::from_value(r["offered"].clone()).expect("offered");
        let boundary: std::collections::BTreeSet<String> = offered
            .iter()
            .filter(|t| t.starts_with(prefix))
            .cloned()
            .collect();
        assert_eq!(boundary, want, "{offered:?}");
        assert_eq!(
            offered
                .difference(&boundary)
                .cloned()
                .collect::<std::collections::BTreeSet<_>>(),
            local
        );
        assert_eq!(r["model"], "fake-model");
        if let Some(api) = api {
            assert_eq!(r["api"], api);
        }
    }
}

/// Issue 45: a person at a real terminal approves on their own page. Claude Code (which declares
/// URL-mode elicitation) runs interactively in tmux against a broker whose person's page is
/// configured (npm oidc-provider signs people in); the scripted model asks for `files.read` of
/// `/private/secret.txt`, under `@approval("principal")`. Claude Code shows the link the broker
/// sends (a URL-mode elicitation); the test reads it off the screen, and the person opens it in
/// a real browser (headless chromium through selenium), signs in as alice, sees the call and
/// approves it there. Nothing typed into the terminal decides it: the record shows it decided
/// `by: principal`, `via: page`, and exactly one call, `succeeded`; the model sees the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the harness CLIs, tmux, chromium, selenium and oidc-provider: bash .ci/run installs them (.ci/install-harnesses, .ci/install-browser)"]
async fn a_person_at_a_terminal_approves_on_their_page() {
    use terminal::panel;
    use tokio::time::Duration;

    let Some(h) = harnesses() else {
        return;
    };
    let Some(tmux) = terminal::tmux_version().await else {
        assert!(
            std::env::var("CI").is_err(),
            "CI must install tmux first (bash .ci/run does)"
        );
        eprintln!("SKIPPED: tmux is not installed (Debian: apt-get install tmux)");
        return;
    };
    let Some(world) = crate::page::World::start(300).await else {
        return;
    };
    let broker = &world.broker;
    let script = json!({
        "steps": [{"tool": "files.read", "arguments": {"path": "/private/secret.txt"}}],
        "final": "DONE",
    });
    let AtPrompt {
        mut term,
        turn,
        model_log,
        stop,
        server,
        first_run: _,
    } = claude_at_its_prompt(
        &h,
        &tmux,
        broker,
        script,
        "interop::a_person_at_a_terminal_approves_on_their_page",
        3,
    )
    .await;
    let prompt = "Read /private/secret.txt with files.read";
    term.type_text(prompt).await;
    term.wait_for("the prompt typed", crate::kit::WAIT, |s| {
        s.iter().any(|l| l.trim() == format!("❯ {prompt}"))
    })
    .await;
    term.press(&["Enter"]).await;
    let link_prefix = format!("http://127.0.0.1:{}/approval/", world.page);
    let screen = term
        .wait_for("the link to the page", Duration::from_secs(90), |s| {
            s.iter().any(|l| l.contains(&link_prefix))
        })
        .await;
    term.answered(
        "the link to the person's page, as Claude Code shows it",
        &screen,
    );
    let url: String = screen
        .iter()
        .find_map(|l| {
            let at = l.find(&link_prefix)?;
            Some(
                l[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || "/:._-".contains(*c))
                    .collect(),
            )
        })
        .expect("the link");
    let lines_of = |kind: &str| -> Vec<Value> {
        broker
            .records()
            .into_iter()
            .filter(|l| l["turn"] == turn.as_str() && l["kind"] == kind)
            .collect()
    };
    assert_eq!(lines_of("approval_requested").len(), 1);
    assert!(
        lines_of("call").is_empty(),
        "nothing run before the person decides"
    );

    let question = panel(&screen).join("\n");
    assert!(
        question.contains("MCP server “sharedos” wants to open a URL")
            && question.contains("An agent acting for you asks to run `files.read`")
            && question.contains("I'm done, continue"),
        "the link on the screen:\n{question}"
    );

    // The person opens the link in their browser, signs in, reads the call, approves.
    let seen = world.person(&url, "alice", "approve").await;
    assert_eq!(
        (&seen["tool"], &seen["principal"], &seen["policy"]),
        (
            &json!("files.read"),
            &json!("alice"),
            &json!("alice-private-asks-alice")
        ),
        "{seen}"
    );
    assert!(
        seen["arguments"]
            .as_str()
            .is_some_and(|a| a.contains("/private/secret.txt")),
        "{seen}"
    );
    term.note(format!(
        "the person approved on the page: {}",
        seen["answer"].as_str().unwrap_or("?")
    ));
    // Back at the terminal: "I'm done, continue".
    term.press(&["Right"]).await;
    let screen = term
        .wait_for(
            "the cursor on \"I'm done, continue\"",
            crate::kit::WAIT,
            |s| panel(s).iter().any(|l| l.contains("❯ I'm done, continue")),
        )
        .await;
    term.shows(&panel(&screen));
    term.press(&["Enter"]).await;
    let screen = term
        .wait_for("the model's answer", Duration::from_secs(90), |s| {
            s.iter().any(|l| l.trim() == "● DONE")
        })
        .await;
    term.note("screen: the session after the answer".into());
    term.shows(&terminal::shown(&screen));
    stop.cancel();
    let _ = server.await;

    let decided = lines_of("approval_decided");
    let calls = lines_of("call");
    assert_eq!(decided.len(), 1, "{decided:#?}");
    assert_eq!(
        (
            &decided[0]["decision"],
            &decided[0]["by"],
            &decided[0]["via"]
        ),
        (&json!("approved"), &json!("principal"), &json!("page")),
        "{decided:#?}"
    );
    assert_eq!(calls.len(), 1, "exactly one call: {calls:#?}");
    assert_eq!(
        (&calls[0]["outcome"], &calls[0]["arguments"]["path"]),
        (&json!("succeeded"), &json!("/private/secret.txt"))
    );
    let client = lines_of("bridge_client");
    assert!(
        client[0]["client"]["capabilities"]["elicitation"]
            .as_array()
            .is_some_and(|a| a.contains(&json!("url"))),
        "{client:#?}"
    );
    let log: Vec<Value> = std::fs::read_to_string(&model_log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let results: Vec<&Value> = log.iter().filter(|l| l["kind"] == "tool_result").collect();
    assert_eq!(results.len(), 1, "{log:#?}");
    assert_eq!(results[0]["text"], "the secret\n", "{log:#?}");
    let root = broker.dir.path().display().to_string();
    let text: String = term
        .transcript
        .iter()
        .map(|l| terminal::normalized(l, &root) + "\n")
        .collect();
    println!("TRANSCRIPT:\n{text}");
}
