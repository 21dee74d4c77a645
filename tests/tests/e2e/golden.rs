//! The record's bytes, pinned: one scenario touching every kind of line the broker writes, its
//! record normalized (times, durations, turn ids, pids, the temp dir) and compared line by line,
//! key order included, with `tests/tests/e2e/golden/record.jsonl`.
//!
//! The record is a product contract (operators read it, `column run` grades from it): a change
//! to a line's fields or their order must be a decision, made by regenerating the file with
//! `SHAREDOS_GOLDEN_UPDATE=1 cargo test -p sharedos-tests --test e2e golden` and reviewing the diff.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn};
use sharedos_proto::record::RecordLine;

use crate::kit::{Options, Raw, TestBroker};

const GOLDEN: &str = "tests/e2e/golden/record.jsonl";
/// The turn a "stopped" broker left open in the restart scenario (a hand-made line).
const LEFT_OPEN: &str = "t-00000000000000aa";
const GOLDEN_PROVIDERS: &str = "tests/e2e/golden/record-providers.jsonl";

/// Replaces what differs from run to run; keeps every key where it is.
struct Normalizer {
    dir: String,
    turns: HashMap<String, String>,
}

impl Normalizer {
    fn turn(&mut self, id: &str) -> String {
        let n = self.turns.len() + 1;
        self.turns
            .entry(id.to_owned())
            .or_insert_with(|| format!("T{n}"))
            .clone()
    }

    fn text(&mut self, s: &str) -> String {
        let mut out = s.replace(&self.dir, "DIR");
        // Turn ids are `t-` and 16 hex digits.
        while let Some(i) = out.find("t-").filter(|&i| {
            out.get(i + 2..i + 18)
                .is_some_and(|h| h.chars().all(|c| c.is_ascii_hexdigit()))
        }) {
            let id = out[i..i + 18].to_owned();
            let t = self.turn(&id);
            out.replace_range(i..i + 18, &t);
        }
        out
    }

    fn value(&mut self, key: &str, v: &mut Value) {
        match v {
            Value::String(s) => {
                *s = match key {
                    "at" | "openedAt" | "expiresAt" => "AT".to_owned(),
                    // The chain: each hash covers a line's time; the genesis and key are random.
                    "prev" => "PREV".to_owned(),
                    "genesis" => "GENESIS".to_owned(),
                    "publicKey" => "KEY".to_owned(),
                    "signature" => "SIG".to_owned(),
                    // A hash of arguments that name the temp dir.
                    "forwardedArgumentsSha256" => "SHA256".to_owned(),
                    _ => self.text(s),
                }
            }
            Value::Number(_) if matches!(key, "durationUs" | "pid" | "uid") => *v = json!(0),
            Value::Array(items) => items.iter_mut().for_each(|i| self.value(key, i)),
            Value::Object(m) => {
                for (k, v) in m.iter_mut() {
                    self.value(k, v);
                }
            }
            _ => {}
        }
    }
}

fn normalized(record: &Path, dir: &Path) -> Vec<String> {
    let mut n = Normalizer {
        dir: dir.display().to_string(),
        turns: HashMap::new(),
    };
    std::fs::read_to_string(record)
        .expect("record")
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).expect("json");
            // The upstream's arguments name the temp dir: so does their hash.
            if v["tool"] == "plain.read_file" && v.get("argumentsSha256").is_some() {
                v["argumentsSha256"] = json!("SHA256");
            }
            // The sandbox's paths name this machine's folders and the build tree; whether it
            // has a network namespace, a user namespace, a uid of its own (root's default),
            // and its gid, depend on running as root.
            if let Some(sb) = v.get_mut("sandbox").and_then(Value::as_object_mut) {
                for k in ["read", "write"] {
                    sb.insert(k.to_owned(), json!("PATHS"));
                }
                sb.insert("netns".to_owned(), json!("NETNS"));
                sb.insert("userns".to_owned(), json!("USERNS"));
                sb.insert("ownUid".to_owned(), json!("OWNUID"));
                sb.insert("gid".to_owned(), json!(0));
                // Which defaults exist differs by machine; what kinds of rule there are does not.
                if let Some(rules) = sb.get("rules").and_then(Value::as_array) {
                    let kinds: std::collections::BTreeSet<String> = rules
                        .iter()
                        .map(|r| {
                            format!(
                                "{}: {}",
                                r["access"].as_str().unwrap_or("?"),
                                r["origin"].as_str().unwrap_or("?")
                            )
                        })
                        .collect();
                    sb.insert("rules".to_owned(), json!(kinds));
                }
            }
            n.value("", &mut v);
            v.to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_bytes_are_pinned() {
    let mut broker = TestBroker::start(Options::default()).await;
    // alice: a read allowed, one denied, an unpublished tool, a malformed name, bad arguments.
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    for (id, tool, args) in [
        (1, "files.read", json!({"path": "/public/hello.txt"})),
        (2, "files.read", json!({"path": "/private/secret.txt"})),
        (3, "files.delete", json!({"path": "/public/hello.txt"})),
        (4, "files read", json!({})),
        (5, "files.read", json!({"path": 7})),
    ] {
        raw.call(id, tool, args).await;
    }
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    // bob, with a column's identity stamped on every line: a write (intent, then call).
    let bob = broker
        .open(OpenTurn {
            principal: "bob".into(),
            agent: Some("a1".into()),
            harness: Some("claude-code".into()),
            system_identity: Some(
                serde_json::from_value(
                    json!({"harness": "claude-code", "harnessVersion": "2.1.332",
                    "mcpSupport": "native", "declaredModel": "scripted"}),
                )
                .expect("identity"),
            ),
            ..Default::default()
        })
        .await;
    let mut raw = Raw::spawn(broker.shim_command(bob.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.call(
        1,
        "files.write",
        json!({"path": "/private/new.txt", "content": "x"}),
    )
    .await;
    drop(raw.close_stdin().await);
    match broker
        .host()
        .await
        .call(&ControlRequest::PolicyReload)
        .await
        .expect("reload")
    {
        ControlResponse::PolicyReloaded { .. } => {}
        other => panic!("{other:?}"),
    }
    // bob's turn is closed by the broker's shutdown.
    broker.stop().await;

    assert_golden(&broker, GOLDEN);
}

/// Compares the broker's normalized record with a golden file (or rewrites it), and checks that
/// every line the broker wrote reads as a typed event and writes back to the same bytes.
fn assert_golden(broker: &TestBroker, file: &str) {
    let raw = std::fs::read_to_string(broker.record_path()).expect("record");
    for line in raw.lines() {
        let Ok(typed) = serde_json::from_str::<RecordLine>(line) else {
            // Only the hand-made turn of the restart scenario is not a whole event.
            assert!(line.contains(LEFT_OPEN), "not a record event: {line}");
            continue;
        };
        assert_eq!(serde_json::to_string(&typed).expect("ser"), line);
    }
    let dir = std::fs::canonicalize(broker.dir.path()).expect("dir");
    let mut got = normalized(&broker.record_path(), &dir);
    // The same temp dir may be named through a link (/tmp vs its real path).
    if got
        .iter()
        .any(|l| l.contains(&broker.dir.path().display().to_string()))
    {
        got = normalized(&broker.record_path(), broker.dir.path());
    }
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    if std::env::var_os("SHAREDOS_GOLDEN_UPDATE").is_some() {
        std::fs::create_dir_all(golden.parent().expect("dir")).expect("mkdir");
        std::fs::write(&golden, got.join("\n") + "\n").expect("write golden");
        return;
    }
    let want: Vec<String> = std::fs::read_to_string(&golden)
        .expect("the golden record (regenerate with SHAREDOS_GOLDEN_UPDATE=1)")
        .lines()
        .map(str::to_owned)
        .collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "record line {} differs from {file}", i + 1);
    }
    assert_eq!(got.len(), want.len(), "{got:#?}");
}

/// The lines the first scenario cannot reach: a brokered provider's state and pins, arguments
/// rewritten for an upstream, arguments too long to keep, redacted arguments, and what a restart
/// writes for a call and a turn the last broker left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_bytes_are_pinned_for_providers_and_restarts() {
    let mut broker = TestBroker::start(Options::default()).await;
    let data = std::fs::canonicalize(broker.dir.path().join("data")).expect("data");
    std::os::unix::fs::symlink("hello.txt", data.join("public/alias")).expect("ln");
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    let q = |s: &str| serde_json::to_string(s).expect("quote");
    let provider = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"plain\"\ncommand = {}\n\
         [providers.tools.read_file]\naction = \"read\"\nfile = \"{{path}}\"\nfile_root = {}\n",
        q(env!("CARGO_BIN_EXE_open-upstream")),
        q(&data.display().to_string()),
    );
    std::fs::write(
        &broker.config_path,
        format!("pins = \"pins.toml\"\nrecord_max_argument_bytes = 64\n{cfg}{provider}"),
    )
    .expect("w");
    broker.restart().await;
    let alias = data.join("public/alias").display().to_string();
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    // Rewritten for the upstream: forwardedArguments.
    raw.call(1, "plain.read_file", json!({"path": alias})).await;
    // Longer than record_max_argument_bytes: argumentsDigest.
    let long = format!("/public/{}", "a".repeat(80));
    raw.call(2, "files.read", json!({"path": long})).await;
    drop(raw.close_stdin().await);
    match broker
        .host()
        .await
        .call(&ControlRequest::PinProviders)
        .await
        .expect("pin")
    {
        ControlResponse::Pinned { .. } => {}
        other => panic!("{other:?}"),
    }
    broker.close_turn(&alice.turn).await;
    broker.stop().await;

    // Redacted: argumentsSha256 and forwardedArgumentsSha256.
    std::fs::write(
        &broker.config_path,
        format!("pins = \"pins.toml\"\nredact_arguments = true\n{cfg}{provider}"),
    )
    .expect("w");
    broker.restart().await;
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    raw.call(2, "plain.read_file", json!({"path": alias})).await;
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    broker.stop().await;

    // A broker that stopped between a call's intent and its outcome, with its turn open.
    let record = broker.record_path();
    let text = std::fs::read_to_string(&record).expect("record");
    let last: Value = serde_json::from_str(text.lines().last().expect("a line")).expect("json");
    let seq = last["seq"].as_u64().expect("seq");
    let turn = LEFT_OPEN;
    let left = [
        json!({"seq": seq + 1, "at": "2026-12-03T00:00:00.000000Z", "kind": "turn_opened",
               "turn": turn, "accessContext": {"principal": "bob"}}),
        json!({"seq": seq + 2, "at": "2026-12-03T00:00:00.000001Z", "kind": "intent",
               "turn": turn, "callId": format!("{turn}.1"), "requestId": "1",
               "tool": "files.write", "arguments": {"path": "/private/n.txt", "content": "x"},
               "requirement": {"action": "write", "resource": "SharedOS::File::\"/private/n.txt\""}}),
    ];
    let mut appended = text;
    for l in left {
        appended.push_str(&format!("{l}\n"));
    }
    std::fs::write(&record, appended).expect("w");
    broker.restart().await;
    broker.stop().await;
    assert_golden(&broker, GOLDEN_PROVIDERS);
}
