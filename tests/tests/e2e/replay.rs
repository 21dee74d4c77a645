//! `policy replay`: a record made by a real run (broker, shim, calls) decided again under other
//! policy files by the real CLI, which reads the record file itself (the broker is stopped).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sharedos_broker::config::DEFAULT_POLICY;

use crate::kit::{Options, Raw, TestBroker, bin, meta, run};

/// Forbids alice's allowed read (by the file's namespace too: the record must carry it).
const STRICTER: &str = r#"
@id("no-public-a")
forbid(principal, action == SharedOS::Action::"read", resource is SharedOS::File)
when { resource.namespace == "files" && resource.path == "/public/a.txt" };
"#;

/// Permits alice's denied read.
const LOOSER: &str = r#"
@id("alice-private-read")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;

/// A stopped broker's record of one turn of alice's under the embedded default policy:
/// request id → (seq, callId) of each call.
async fn recorded_run() -> (TestBroker, BTreeMap<String, (u64, String)>) {
    let mut broker = TestBroker::start(Options {
        policy: DEFAULT_POLICY,
        ..Options::default()
    })
    .await;
    let data = broker.dir.path().join("data");
    std::fs::write(data.join("public/a.txt"), "a\n").expect("w");
    std::fs::write(data.join("private/a.txt"), "secret a\n").expect("w");
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    let expected = [
        (
            1,
            "files.read",
            json!({"path": "/public/a.txt"}),
            "succeeded",
        ),
        (2, "files.read", json!({"path": "/private/a.txt"}), "denied"),
        // Not in alice's catalogue: refused before the policy is asked.
        (
            3,
            "files.write",
            json!({"path": "/public/a.txt", "content": "x"}),
            "denied",
        ),
        (4, "files.list", json!({"path": "/public"}), "succeeded"),
    ];
    for (id, tool, args, outcome) in expected {
        let r = raw.call(id, tool, args).await;
        assert_eq!(meta(&r["result"])["outcome"], outcome, "{r}");
    }
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    broker.stop().await;
    let calls: BTreeMap<String, (u64, String)> = broker
        .calls_of(&alice.turn)
        .iter()
        .map(|c| {
            (
                c["requestId"].as_str().expect("requestId").to_owned(),
                (
                    c["seq"].as_u64().expect("seq"),
                    c["callId"].as_str().expect("callId").to_owned(),
                ),
            )
        })
        .collect();
    let codes: Vec<String> = broker
        .calls_of(&alice.turn)
        .iter()
        .map(|c| c["code"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(codes, ["ok", "no_permit", "unpublished_tool", "ok"]);
    (broker, calls)
}

/// Writes `policy` beside the broker's files and gives the command replaying its record under it.
fn replay(broker: &TestBroker, name: &str, policy: &str) -> std::process::Command {
    let path = broker.dir.path().join(name);
    std::fs::write(&path, policy).expect("w");
    let mut cmd = broker.cli();
    cmd.args(["policy", "replay", "--config"])
        .arg(&broker.config_path)
        .arg("--policy")
        .arg(&path);
    cmd
}

fn json_of(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// The changes' (seq, callId).
fn changed(report: &Value) -> Vec<(u64, String)> {
    report["changes"]
        .as_array()
        .expect("changes")
        .iter()
        .map(|c| {
            (
                c["seq"].as_u64().expect("seq"),
                c["callId"].as_str().expect("callId").to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reports_exactly_the_calls_a_policy_change_would_change() {
    let (broker, calls) = recorded_run().await;
    let record = std::fs::read_to_string(broker.record_path()).expect("record");
    assert!(
        record.contains(r#""namespace":"files""#),
        "a file requirement carries its namespace"
    );

    // (a) Stricter: alice's allowed read of /public/a.txt would be denied, nothing else.
    let mut cmd = replay(
        &broker,
        "stricter.cedar",
        &format!("{DEFAULT_POLICY}{STRICTER}"),
    );
    cmd.arg("--json");
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 3, "{out}{err}");
    let r = json_of(&out);
    assert_eq!(changed(&r), [calls["1"].clone()]);
    assert_eq!(
        (&r["calls"], &r["replayable"], &r["notDecidedByPolicy"]),
        (&json!(4), &json!(3), &json!(1)),
        "{r:#}"
    );
    assert_eq!(
        (&r["allowedToDenied"], &r["deniedToAllowed"]),
        (&json!(1), &json!(0))
    );
    let c = &r["changes"][0];
    assert_eq!(c["principal"], "alice");
    assert_eq!(c["tool"], "files.read");
    assert_eq!(c["action"], "read");
    assert_eq!(c["resource"], "SharedOS::File::\"/public/a.txt\"");
    assert_eq!(
        c["old"],
        json!({"allowed": true, "outcome": "succeeded", "code": "ok", "policies": ["alice-public"]})
    );
    assert_eq!(
        c["new"],
        json!({"allowed": false, "policies": ["no-public-a"], "errors": []})
    );

    // The same for people: grouped by tool, then by the policy deciding now.
    let (code, out, _) = run(replay(
        &broker,
        "stricter.cedar",
        &format!("{DEFAULT_POLICY}{STRICTER}"),
    ))
    .await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("4 calls read: 3 replayable, 1 not decided by policy"),
        "{out}"
    );
    assert!(
        out.contains("would change: 1 (1 allowed → denied, 0 denied → allowed)"),
        "{out}"
    );
    let (seq, _) = &calls["1"];
    let group = out
        .split("\nfiles.read\n  forbidden by no-public-a\n    ")
        .nth(1)
        .unwrap_or_else(|| panic!("no files.read group: {out}"));
    assert!(
        group.starts_with(&format!("seq {seq}  turn t-"))
            && group.lines().next().is_some_and(|l| l.ends_with(
                "alice  read SharedOS::File::\"/public/a.txt\"  allowed (succeeded/ok by alice-public) → denied"
            )),
        "{out}"
    );

    // (b) Looser: alice's denied read of /private/a.txt would be allowed, nothing else.
    let mut cmd = replay(
        &broker,
        "looser.cedar",
        &format!("{DEFAULT_POLICY}{LOOSER}"),
    );
    cmd.arg("--json");
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 3, "{out}{err}");
    let r = json_of(&out);
    assert_eq!(changed(&r), [calls["2"].clone()]);
    assert_eq!(
        (&r["allowedToDenied"], &r["deniedToAllowed"]),
        (&json!(0), &json!(1))
    );
    assert_eq!(
        r["changes"][0]["old"],
        json!({"allowed": false, "outcome": "denied", "code": "no_permit", "policies": []})
    );
    assert_eq!(
        r["changes"][0]["new"],
        json!({"allowed": true, "policies": ["alice-private-read"], "errors": []})
    );

    // (c) The same policy: nothing changes, status 0.
    let mut cmd = replay(&broker, "same.cedar", DEFAULT_POLICY);
    cmd.arg("--json");
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "{out}{err}");
    let r = json_of(&out);
    assert!(changed(&r).is_empty(), "{r:#}");
    assert_eq!(r["unchanged"], 3);
    let (code, out, _) = run(replay(&broker, "same.cedar", DEFAULT_POLICY)).await;
    assert_eq!(code, 0);
    assert!(out.contains("no call would change"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_finds_its_record_and_names_what_it_cannot_read() {
    let (broker, calls) = recorded_run().await;
    let stricter = broker.dir.path().join("stricter.cedar");
    std::fs::write(&stricter, format!("{DEFAULT_POLICY}{STRICTER}")).expect("w");
    let cli = |runtime: &Path| {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.arg("--runtime-dir").arg(runtime);
        cmd.args(["policy", "replay", "--json", "--policy"])
            .arg(&stricter);
        cmd
    };

    // Without --config or --record: the embedded default's record in the runtime dir.
    let runtime = broker.dir.path().join("other-run");
    std::fs::create_dir_all(runtime.join("default")).expect("mkdir");
    std::fs::copy(broker.record_path(), runtime.join("default/record.jsonl")).expect("copy");
    let (code, out, err) = run(cli(&runtime)).await;
    assert_eq!(code, 3, "{out}{err}");
    assert_eq!(changed(&json_of(&out)), [calls["1"].clone()]);

    // --record, and --since after every call: nothing to compare.
    let mut cmd = cli(&runtime);
    cmd.arg("--record")
        .arg(broker.record_path())
        .args(["--since", "2999-01-01T00:00:00Z"]);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(json_of(&out)["calls"], 0);

    // What it cannot read is named, status 1.
    let missing: PathBuf = broker.dir.path().join("nope.jsonl");
    let mut cmd = cli(&runtime);
    cmd.arg("--record").arg(&missing);
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("nope.jsonl"), "{err}");

    let mut cmd = cli(&runtime);
    cmd.args(["--since", "last tuesday"]);
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--since") && err.contains("last tuesday"),
        "{err}"
    );

    let bad = broker.dir.path().join("bad.cedar");
    std::fs::write(
        &bad,
        "permit(principal, action, resource)\nwhen { resource.nope == 1 };\n",
    )
    .expect("w");
    let mut cmd = broker.cli();
    cmd.args(["policy", "replay", "--policy"]).arg(&bad);
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("bad.cedar:2:"), "names file and line: {err}");

    let mut cmd = broker.cli();
    cmd.args(["policy", "replay", "--policy"])
        .arg(broker.dir.path().join("absent.cedar"));
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("absent.cedar"), "{err}");

    // A record line that is not JSON is named by file and line.
    let torn = broker.dir.path().join("broken.jsonl");
    std::fs::write(&torn, "{\"seq\":1,\n{}\n").expect("w");
    let mut cmd = cli(&runtime);
    cmd.arg("--record").arg(&torn);
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("broken.jsonl") && err.contains("line 1"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reports_the_calls_a_policy_would_now_hold_for_approval() {
    let (broker, calls) = recorded_run().await;
    // The same set, with alice's public permit now asking for a person's approval.
    let held = DEFAULT_POLICY.replacen(
        "@id(\"alice-public\")",
        "@id(\"alice-public\")\n@approval(\"required\")",
        1,
    );
    assert_ne!(held, DEFAULT_POLICY);
    let mut cmd = replay(&broker, "held.cedar", &held);
    cmd.arg("--json");
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 3, "{out}{err}");
    let r = json_of(&out);
    let changes = changed(&r);
    assert!(changes.contains(&calls["1"]), "{r:#}");
    assert!(
        !changes.contains(&calls["2"]),
        "the denied read stays denied: {r:#}"
    );
    assert_eq!(r["nowHeld"], changes.len() as u64, "{r:#}");
    assert_eq!(
        (
            &r["allowedToDenied"],
            &r["deniedToAllowed"],
            &r["noLongerHeld"]
        ),
        (&json!(0), &json!(0), &json!(0))
    );
    let c = r["changes"]
        .as_array()
        .expect("changes")
        .iter()
        .find(|c| c["callId"] == calls["1"].1.as_str())
        .expect("call 1");
    assert_eq!(c["old"]["allowed"], true);
    assert!(c["old"].get("held").is_none(), "{c}");
    assert_eq!(c["new"]["allowed"], true);
    assert_eq!(c["new"]["held"], true);
    // For people: said in the summary and on the row.
    let (code, out, _) = run(replay(&broker, "held.cedar", &held)).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(&format!(
            "{} would now be held for approval, 0 no longer held for approval",
            changes.len()
        )),
        "{out}"
    );
    assert!(
        out.contains("held for approval (@approval(\"required\"))")
            && out.contains("→ allowed, held for approval"),
        "{out}"
    );
}
