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

use crate::kit::{Options, Raw, TestBroker};

const GOLDEN: &str = "tests/e2e/golden/record.jsonl";

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

    let dir = std::fs::canonicalize(broker.dir.path()).expect("dir");
    let mut got = normalized(&broker.record_path(), &dir);
    // The same temp dir may be named through a link (/tmp vs its real path).
    if got
        .iter()
        .any(|l| l.contains(&broker.dir.path().display().to_string()))
    {
        got = normalized(&broker.record_path(), broker.dir.path());
    }
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
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
        assert_eq!(g, w, "record line {} differs from {GOLDEN}", i + 1);
    }
    assert_eq!(got.len(), want.len(), "{got:#?}");
}
