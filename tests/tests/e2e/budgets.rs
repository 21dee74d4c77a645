//! Budgets (`[[budgets]]`): the call over a limit is refused `denied/budget_exhausted`, naming
//! the budget and when it refills, and recorded; a call the policy refuses uses none; per-turn
//! limits start whole in each turn, per-principal buckets span turns and refill on time;
//! `turn list` and `catalog --principal` show what is left. Real broker, shim and CLI.

use std::time::Duration;

use serde_json::{Value, json};

use crate::kit::{Options, Raw, TestBroker, meta, run, text};

async fn broker_with(tables: &str) -> TestBroker {
    TestBroker::start(Options {
        tables: tables.to_owned(),
        ..Options::default()
    })
    .await
}

fn outcome(r: &Value) -> String {
    let m = meta(&r["result"]);
    format!(
        "{}/{}",
        m["outcome"].as_str().unwrap_or("?"),
        m["code"].as_str().unwrap_or("?")
    )
}

async fn read(raw: &mut Raw, id: i64, path: &str) -> Value {
    raw.call(id, "files.read", json!({"path": path})).await
}

/// `turn list --json` for one turn: its `budgets`.
async fn turn_budgets(broker: &TestBroker, turn: &str) -> Vec<Value> {
    let mut list = broker.cli();
    list.args(["turn", "list", "--json"]);
    let (code, out, err) = run(list).await;
    assert_eq!(code, 0, "{err}");
    let turns: Vec<Value> = serde_json::from_str(&out).expect("json");
    let t = turns
        .iter()
        .find(|t| t["turn"] == turn)
        .expect("the turn is listed");
    t["budgets"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_per_turn_refuse_exactly_the_call_over_the_limit() {
    let broker = broker_with("[[budgets]]\ntool = \"files.read\"\ncalls_per_turn = 3\n").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    // Refused by policy first: it uses nothing of the budget.
    let private = read(&mut raw, 1, "/private/secret.txt").await;
    assert_eq!(outcome(&private), "denied/no_permit");
    for id in 2..=4 {
        let ok = read(&mut raw, id, "/public/hello.txt").await;
        assert_eq!(outcome(&ok), "succeeded/ok", "call {id}: {ok}");
    }
    let left = turn_budgets(&broker, &turn.turn).await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0]["budget"], "files.read calls_per_turn=3");
    assert_eq!(
        (left[0]["left"].as_u64(), left[0]["limit"].as_u64()),
        (Some(0), Some(3))
    );
    let mut table = broker.cli();
    table.args(["turn", "list"]);
    let (code, out, _) = run(table).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("  budget \"files.read calls_per_turn=3\": 0 of 3 left (per turn)"),
        "{out}"
    );
    let over = read(&mut raw, 5, "/public/hello.txt").await;
    assert_eq!(outcome(&over), "denied/budget_exhausted", "{over}");
    assert_eq!(over["result"]["isError"], true);
    let why = text(&over["result"]);
    assert!(
        why.starts_with("denied: files.read of /public/hello.txt — budget \"files.read calls_per_turn=3\" exhausted")
            && why.contains("does not refill in this turn"),
        "{why}"
    );
    // Another tool of the same provider is not under this budget.
    let list = raw.call(6, "files.list", json!({"path": "/public"})).await;
    assert_eq!(outcome(&list), "succeeded/ok", "{list}");
    // A new turn starts with the budget whole.
    let turn2 = broker.open_turn("alice").await;
    let mut raw2 = Raw::spawn(broker.shim_command(turn2.token.expose()));
    raw2.initialize("2025-11-25").await;
    assert_eq!(
        outcome(&read(&mut raw2, 1, "/public/hello.txt").await),
        "succeeded/ok"
    );

    let calls = broker.calls_of(&turn.turn);
    let outcomes: Vec<String> = calls
        .iter()
        .map(|c| {
            format!(
                "{}/{}",
                c["outcome"].as_str().unwrap_or("?"),
                c["code"].as_str().unwrap_or("?")
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            "denied/no_permit",
            "succeeded/ok",
            "succeeded/ok",
            "succeeded/ok",
            "denied/budget_exhausted",
            "succeeded/ok"
        ]
    );
    assert_eq!(
        calls[4]["message"].as_str(),
        Some(why.as_str()),
        "the record names the budget"
    );
    assert_eq!(calls[4]["policies"], json!(["alice-public"]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_principal_bucket_spans_turns_and_refills_on_time() {
    // 20 a minute: 20 at once, then one every 3 s (the bucket refills from the first call on,
    // so however slow the calls, at most one more than 20 goes through before it is empty).
    let broker =
        broker_with("[[budgets]]\nnamespace = \"files\"\ncalls_per_minute_per_principal = 20\n")
            .await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let mut ran = 0;
    for id in 1..=40 {
        let r = read(&mut raw, id, "/public/hello.txt").await;
        if outcome(&r) != "succeeded/ok" {
            assert_eq!(outcome(&r), "denied/budget_exhausted", "{r}");
            break;
        }
        ran += 1;
    }
    assert!((20..=21).contains(&ran), "{ran} calls ran");
    // The next, in another turn of the same principal: the bucket is the principal's.
    let turn2 = broker.open_turn("alice").await;
    let mut raw2 = Raw::spawn(broker.shim_command(turn2.token.expose()));
    raw2.initialize("2025-11-25").await;
    let over = read(&mut raw2, 1, "/public/hello.txt").await;
    assert_eq!(outcome(&over), "denied/budget_exhausted", "{over}");
    let why = text(&over["result"]);
    assert!(
        why.contains("budget \"files calls_per_minute_per_principal=20\" exhausted for alice")
            && why.contains("refills one call every 3.0 s, the next in"),
        "{why}"
    );
    // Another principal has a bucket of its own.
    let bob = broker.open_turn("bob").await;
    let mut raw3 = Raw::spawn(broker.shim_command(bob.token.expose()));
    raw3.initialize("2025-11-25").await;
    assert_eq!(
        outcome(&read(&mut raw3, 1, "/private/secret.txt").await),
        "succeeded/ok"
    );
    let mut table = broker.cli();
    table.args(["catalog", "--principal", "alice"]);
    let (code, out, _) = run(table).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("  budget \"files calls_per_minute_per_principal=20\": 0 of 20 left (per principal), one more in"),
        "{out}"
    );
    // `catalog --principal` shows what alice has left, and when it refills.
    let mut catalog = broker.cli();
    catalog.args(["catalog", "--principal", "alice", "--json"]);
    let (code, out, err) = run(catalog).await;
    assert_eq!(code, 0, "{err}");
    let c: Value = serde_json::from_str(&out).expect("json");
    let b = &c["budgets"][0];
    assert_eq!(
        b["budget"], "files calls_per_minute_per_principal=20",
        "{c}"
    );
    assert_eq!(b["scope"], "principal");
    assert_eq!(b["left"], 0, "{b}");
    let refill = b["refillsInSeconds"].as_f64().expect("refillsInSeconds");
    assert!(refill > 0.0 && refill <= 3.0, "{b}");
    // When it said, one call is back, and exactly one.
    tokio::time::sleep(Duration::from_secs_f64(refill + 0.2)).await;
    assert_eq!(
        outcome(&read(&mut raw2, 2, "/public/hello.txt").await),
        "succeeded/ok"
    );
    assert_eq!(
        outcome(&read(&mut raw2, 3, "/public/hello.txt").await),
        "denied/budget_exhausted"
    );
    let recorded: Vec<String> = broker
        .calls_of(&turn2.turn)
        .iter()
        .map(|c| c["code"].as_str().unwrap_or("?").to_owned())
        .collect();
    assert_eq!(recorded, ["budget_exhausted", "ok", "budget_exhausted"]);
    assert_eq!(broker.calls_of(&turn.turn).len(), ran + 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn bytes_per_turn_count_what_the_calls_returned() {
    let broker = broker_with("[[budgets]]\nnamespace = \"files\"\nbytes_per_turn = 60\n").await;
    let turn = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-11-25").await;
    let first = read(&mut raw, 1, "/public/hello.txt").await;
    assert_eq!(outcome(&first), "succeeded/ok");
    // Bytes returned: the compact JSON of the result's content (and structuredContent).
    let mut bytes = first["result"]["content"].to_string().len() as u64;
    if let Some(s) = first["result"].get("structuredContent") {
        bytes += s.to_string().len() as u64;
    }
    assert!(
        bytes < 60,
        "the first call starts and ends under the limit ({bytes})"
    );
    let left = turn_budgets(&broker, &turn.turn).await;
    assert_eq!(left[0]["budget"], "files bytes_per_turn=60");
    assert_eq!(left[0]["left"].as_u64(), Some(60 - bytes), "{left:?}");
    // The second starts under the limit and runs whole; the third is refused.
    assert_eq!(
        outcome(&read(&mut raw, 2, "/public/hello.txt").await),
        "succeeded/ok"
    );
    let over = read(&mut raw, 3, "/public/hello.txt").await;
    assert_eq!(outcome(&over), "denied/budget_exhausted");
    let why = text(&over["result"]);
    assert!(
        why.contains(&format!(
            "({} bytes of 60 returned in this turn)",
            2 * bytes
        )),
        "{why}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_budget_naming_no_tool_stops_serve_with_its_index_and_key() {
    let dir = tempfile::tempdir().expect("tmp");
    for (tables, says) in [
        (
            "[[budgets]]\ntool = \"files.read\"\ncalls_per_turn = 1\n[[budgets]]\nnamespace = \"nope\"\ncalls_per_turn = 1\n",
            "[[budgets]] #2 (budgets[1]): namespace = \"nope\" is no provider's namespace",
        ),
        (
            "[[budgets]]\ntool = \"files.raed\"\ncalls_per_turn = 1\n",
            "[[budgets]] #1 (budgets[0]): tool = \"files.raed\" is not a tool of files provider `files`",
        ),
        (
            "[[budgets]]\ntool = \"files.read\"\ncalls_per_turn = 0\n",
            "calls_per_turn = 0: a limit must be at least 1",
        ),
        (
            "[[budgets]]\ntool = \"files.read\"\n",
            "[[budgets]] #1 (budgets[0]): no limit",
        ),
    ] {
        let config = crate::kit::write_config(
            dir.path(),
            &Options {
                tables: tables.to_owned(),
                ..Options::default()
            },
        );
        let err = sharedos_broker::Config::from_file(&config)
            .expect_err("refused")
            .to_string();
        assert!(err.contains(says), "{err}");
        let mut serve = std::process::Command::new(crate::kit::bin("sharedos-broker"));
        serve
            .arg("--runtime-dir")
            .arg(dir.path().join("run"))
            .args(["serve", "--config"])
            .arg(&config);
        let (code, _, stderr) = run(serve).await;
        assert_ne!(code, 0);
        assert!(stderr.contains(says), "{stderr}");
    }
}

/// `bytes_per_turn = 2000` on `files`, 64 `files.list` sent at once on one token (one shim, all
/// in flight together): at most one call ends the turn past the limit. A listing far over the
/// limit: exactly one succeeds and 63 are `denied/budget_exhausted`; a listing of about a fifth
/// of it: the calls that fit, plus the one that crosses, and no more. Every call is recorded.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_calls_pass_a_byte_budget_by_one_call_at_most() {
    const LIMIT: usize = 2000;
    const CALLS: i64 = 64;
    let broker = broker_with(&format!(
        "[[budgets]]\nnamespace = \"files\"\nbytes_per_turn = {LIMIT}\n"
    ))
    .await;
    let public = broker.dir.path().join("data/public");
    std::fs::create_dir_all(public.join("big")).expect("mk");
    std::fs::create_dir_all(public.join("some")).expect("mk");
    for i in 0..1000 {
        std::fs::write(
            public.join(format!("big/a-rather-long-file-name-{i:04}.txt")),
            "x",
        )
        .expect("w");
    }
    for i in 0..20 {
        std::fs::write(public.join(format!("some/file-{i:02}.txt")), "x").expect("w");
    }
    for (folder, over_alone) in [("/public/big", true), ("/public/some", false)] {
        let turn = broker.open_turn("alice").await;
        let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
        raw.initialize("2025-11-25").await;
        for id in 1..=CALLS {
            raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                "params": {"name": "files.list", "arguments": {"path": folder}}}))
                .await;
        }
        let mut answers = Vec::new();
        while answers.len() < CALLS as usize {
            let v = raw.recv().await;
            if v.get("id").is_some() && v.get("method").is_none() {
                answers.push(v);
            }
        }
        let ok: Vec<&Value> = answers
            .iter()
            .filter(|a| outcome(a) == "succeeded/ok")
            .collect();
        let exhausted = answers
            .iter()
            .filter(|a| outcome(a) == "denied/budget_exhausted")
            .count();
        // The bytes one listing returns, as the broker counts them (its content blocks).
        let per_call = serde_json::to_string(&ok[0]["result"]["content"])
            .expect("json")
            .len();
        // The calls that start under the limit: 0, per_call, ... while below LIMIT.
        let fit = LIMIT.div_ceil(per_call);
        println!(
            "{folder}: {} succeeded, {exhausted} denied/budget_exhausted, {per_call} bytes each, {} returned in all",
            ok.len(),
            ok.len() * per_call
        );
        assert_eq!(ok.len(), fit, "{folder}: one call past the limit at most");
        assert_eq!(exhausted, CALLS as usize - fit, "{folder}");
        assert!((fit - 1) * per_call < LIMIT && fit * per_call >= LIMIT);
        if over_alone {
            assert_eq!(fit, 1, "a listing over the limit by itself: {per_call}");
        } else {
            assert!(fit >= 3, "several listings fit: {per_call}");
        }
        let calls = broker.calls_of(&turn.turn);
        let recorded = |o: &str, c: &str| {
            calls
                .iter()
                .filter(|l| l["outcome"] == o && l["code"] == c)
                .count()
        };
        assert_eq!(calls.len(), CALLS as usize, "every call recorded");
        assert_eq!(recorded("succeeded", "ok"), fit);
        assert_eq!(recorded("denied", "budget_exhausted"), CALLS as usize - fit);
        let left = turn_budgets(&broker, &turn.turn).await;
        assert_eq!(left[0]["left"].as_u64(), Some(0), "{left:?}");
    }
}
