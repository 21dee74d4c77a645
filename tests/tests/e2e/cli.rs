//! The `sharedos-broker` command line, run as a user runs it.

use serde_json::{Value, json};

use crate::kit::{Options, TestBroker, bin, run};

fn vectors() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/catalog-hash.json");
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("vectors")).expect("json");
    v["vectors"].as_array().expect("array").clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_hash_matches_every_vector() {
    let dir = tempfile::tempdir().expect("tmp");
    for v in vectors() {
        let file = dir.path().join("tools.json");
        std::fs::write(&file, v["tools"].to_string()).expect("w");
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.args(["catalog", "hash"]).arg(&file);
        let (code, out, err) = run(cmd).await;
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            out.trim_end(),
            v["catalogHash"].as_str().expect("hash"),
            "{}",
            v["name"]
        );
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.args(["catalog", "hash", "--canonical"]).arg(&file);
        let (code, out, _) = run(cmd).await;
        assert_eq!(code, 0);
        assert_eq!(
            out.trim_end_matches('\n'),
            v["canonical"].as_str().expect("canonical")
        );
    }
    // `-` reads stdin.
    let mut cmd = tokio::process::Command::new(bin("sharedos-broker"));
    cmd.args(["catalog", "hash", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"[]").await.expect("write");
    drop(stdin);
    let out = child.wait_with_output().await.expect("out");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_hash_rejects_the_whole_input_for_one_bad_name() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("tools.json");
    std::fs::write(
        &file,
        json!([{"name": "files.read"}, {"name": "files read"}]).to_string(),
    )
    .expect("w");
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["catalog", "hash"]).arg(&file);
    let (code, out, err) = run(cmd).await;
    assert_ne!(code, 0);
    assert!(out.is_empty());
    assert!(err.contains("files read"), "{err}");
    std::fs::write(&file, "{\"not\": \"an array\"}").expect("w");
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["catalog", "hash"]).arg(&file);
    let (code, _, err) = run(cmd).await;
    assert_ne!(code, 0);
    assert!(err.contains("array"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_commands_against_a_running_broker() {
    let broker = TestBroker::start(Options::default()).await;
    let mut open = broker.cli();
    open.args(["turn", "open", "--principal", "alice", "--json"]);
    let (code, out, err) = run(open).await;
    assert_eq!(code, 0, "{err}");
    let opened: Value = serde_json::from_str(&out).expect("turn open --json is JSON");
    let turn = opened["turn"].as_str().expect("turn").to_owned();
    let token = opened["token"].as_str().expect("token").to_owned();
    assert_eq!(token.len(), 43, "256 bits, URL-safe base64 without padding");
    assert_eq!(opened["tools"].as_array().map(Vec::len), Some(3));

    let mut list = broker.cli();
    list.args(["turn", "list"]);
    let (code, out, _) = run(list).await;
    assert_eq!(code, 0);
    assert!(out.contains(&turn) && !out.contains(&token), "{out}");

    let mut catalog = broker.cli();
    catalog.args(["catalog", "--principal", "alice", "--json"]);
    let (code, out, _) = run(catalog).await;
    assert_eq!(code, 0);
    let c: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(c["catalogHash"], opened["catalogHash"]);

    let mut allowed = broker.cli();
    allowed.args([
        "policy",
        "check",
        "--principal",
        "alice",
        "--tool",
        "files.read",
        "--args",
        r#"{"path":"/public/hello.txt"}"#,
    ]);
    let (code, out, _) = run(allowed).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("alice-public"), "{out}");
    let mut denied = broker.cli();
    denied.args([
        "policy",
        "check",
        "--principal",
        "alice",
        "--tool",
        "files.read",
        "--args",
        r#"{"path":"/public/../private/secret.txt"}"#,
    ]);
    let (code, out, _) = run(denied).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("denied: files.read of /private/secret.txt"),
        "{out}"
    );
    let mut bad = broker.cli();
    bad.args([
        "policy",
        "check",
        "--principal",
        "alice",
        "--tool",
        "files.read",
        "--args",
        "{not json",
    ]);
    let (code, _, err) = run(bad).await;
    assert_eq!(code, 1);
    assert!(err.contains("--args"), "{err}");

    let mut records = broker.cli();
    records.args(["records", "--turn", &turn, "--json"]);
    let (code, out, _) = run(records).await;
    assert_eq!(code, 0);
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines[0]["kind"], "turn_opened");

    let mut close = broker.cli();
    close.args(["turn", "close", &turn]);
    assert_eq!(run(close).await.0, 0);
    let mut again = broker.cli();
    again.args(["turn", "close", &turn]);
    let (code, _, err) = run(again).await;
    assert_eq!(code, 1);
    assert!(err.contains("no open turn"), "{err}");
    // Nothing the host commands printed or logged carries the token, except `turn open` itself.
    let record = std::fs::read_to_string(broker.record_path()).expect("record");
    assert!(!record.contains(&token));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_reload_refuses_a_bad_file_and_keeps_the_old_set() {
    let broker = TestBroker::start(Options::default()).await;
    let policy = broker.dir.path().join("policy.cedar");
    let check = || {
        let mut c = broker.cli();
        c.args([
            "policy",
            "check",
            "--principal",
            "alice",
            "--tool",
            "files.read",
            "--args",
            r#"{"path":"/public/hello.txt"}"#,
        ]);
        c
    };
    std::fs::write(
        &policy,
        "permit(principal, action, resource)\nwhen { resource.nope == 1 };\n",
    )
    .expect("w");
    let mut reload = broker.cli();
    reload.args(["policy", "reload"]);
    let (code, _, err) = run(reload).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("policy.cedar:2:"),
        "names file and line: {err}"
    );
    assert!(err.contains("previous policy set stays"), "{err}");
    assert_eq!(run(check()).await.0, 0, "the old set is still in force");
    std::fs::write(&policy, "permit(principal, action, resource\n").expect("w");
    let mut reload = broker.cli();
    reload.args(["policy", "reload"]);
    let (code, _, err) = run(reload).await;
    assert_eq!(code, 1);
    assert!(err.contains("policy.cedar:"), "{err}");
    std::fs::write(
        &policy,
        "@id(\"nothing\") forbid(principal, action, resource);\n",
    )
    .expect("w");
    let mut reload = broker.cli();
    reload.args(["policy", "reload"]);
    let (code, out, err) = run(reload).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("version 2"), "{out}");
    assert_eq!(run(check()).await.0, 3, "the new set is in force");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_to_start_on_bad_config_naming_file_and_line() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = crate::kit::write_config(dir.path(), &Options::default());
    std::fs::write(
        dir.path().join("policy.cedar"),
        "permit(principal, action, resource);\nforbid(principal action);\n",
    )
    .expect("w");
    let mut serve = std::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(dir.path().join("run"))
        .arg("--config")
        .arg(&cfg);
    let (code, _, err) = run(serve).await;
    assert_eq!(code, 1);
    assert!(err.contains("policy.cedar:2:"), "{err}");
    // An unknown provider type.
    let text = std::fs::read_to_string(&cfg)
        .expect("cfg")
        .replace("type = \"files\"", "type = \"ftp\"");
    std::fs::write(&cfg, text).expect("w");
    let mut serve = std::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(dir.path().join("run"))
        .arg("--config")
        .arg(&cfg);
    let (code, _, err) = run(serve).await;
    assert_eq!(code, 1);
    assert!(err.contains("broker.toml") && err.contains("ftp"), "{err}");
    // A missing config file.
    let mut serve = std::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--config"])
        .arg(dir.path().join("missing.toml"));
    let (code, _, err) = run(serve).await;
    assert_eq!(code, 1);
    assert!(err.contains("missing.toml"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_until_sigterm_with_private_sockets() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tmp");
    let run_dir = dir.path().join("run");
    let mut serve = tokio::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(&run_dir)
        .kill_on_drop(true)
        .env_remove("NO_COLOR")
        .stderr(std::process::Stdio::piped());
    let child = serve.spawn().expect("serve");
    let control = run_dir.join("control.sock");
    crate::kit::eventually("sockets exist", || {
        control.exists() && run_dir.join("bridge.sock").exists()
    })
    .await;
    let mode =
        |p: &std::path::Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&run_dir), 0o700);
    assert_eq!(mode(&control), 0o600);
    assert_eq!(mode(&run_dir.join("bridge.sock")), 0o600);
    // A second broker on the same runtime dir refuses instead of stealing the sockets.
    let mut second = std::process::Command::new(bin("sharedos-broker"));
    second.args(["serve", "--runtime-dir"]).arg(&run_dir);
    let (code, _, err) = run(second).await;
    assert_eq!(code, 1);
    assert!(err.contains("already listening"), "{err}");
    // The embedded default: alice may read /public.
    let mut open = std::process::Command::new(bin("sharedos-broker"));
    open.args(["turn", "open", "--principal", "alice", "--runtime-dir"])
        .arg(&run_dir);
    let (code, out, _) = run(open).await;
    assert_eq!(code, 0);
    assert!(out.contains("files.read"), "{out}");
    // A principal no policy gives a tool: the turn opens, with a warning.
    let mut open = std::process::Command::new(bin("sharedos-broker"));
    open.args(["turn", "open", "--principal", "bob", "--runtime-dir"])
        .arg(&run_dir);
    let (code, _, err) = run(open).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning: the catalogue of bob is empty"),
        "{err}"
    );
    // files.search says it searches from / when no path is given: the default lets alice do so.
    let mut check = std::process::Command::new(bin("sharedos-broker"));
    check
        .args([
            "policy",
            "check",
            "--principal",
            "alice",
            "--tool",
            "files.search",
        ])
        .args(["--args", r#"{"query":"hello"}"#, "--runtime-dir"])
        .arg(&run_dir);
    let (code, out, err) = run(check).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("alice-search-from-root"), "{out}");
    // Without a turn, a check speaks of the principal's catalogue, and a call that would fail
    // is not called a default deny.
    let check = |tool: &str, args: &str| {
        let mut c = std::process::Command::new(bin("sharedos-broker"));
        c.args([
            "policy",
            "check",
            "--principal",
            "alice",
            "--tool",
            tool,
            "--args",
            args,
        ])
        .arg("--runtime-dir")
        .arg(&run_dir);
        c
    };
    let (code, out, _) = run(check("files.delete", "{}")).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("catalogue of alice") && !out.contains("this turn"),
        "{out}"
    );
    assert!(out.contains("denied by default"), "{out}");
    let (code, out, _) = run(check("files.read", r#"{"path":7}"#)).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("would fail") && !out.contains("default"),
        "{out}"
    );
    let pid = child.id().expect("pid").to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    let out = tokio::time::timeout(crate::kit::WAIT, child.wait_with_output())
        .await
        .expect("exits")
        .expect("wait");
    assert_eq!(out.status.code(), Some(0));
    // Logs to a pipe carry no colour codes.
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("broker ready"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "escape codes in a redirected log: {log:?}"
    );
    assert!(!control.exists(), "sockets are removed on shutdown");
    let record = std::fs::read_to_string(run_dir.join("default/record.jsonl")).expect("record");
    assert!(
        record.contains("\"reason\":\"broker_shutdown\""),
        "{record}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_and_exits_zero() {
    let mut demo = std::process::Command::new(bin("sharedos-broker"));
    demo.arg("demo")
        .env("SHAREDOS_SHIM", bin("sharedos-mcp-shim"));
    let (code, out, err) = run(demo).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("every outcome was the expected one"), "{out}");
    assert!(
        out.contains("denied/malformed_tool_name") && out.contains("denied/unpublished_tool"),
        "{out}"
    );
}

/// A column manifest as `column run` writes it (the fields `column compare` reads).
fn column_manifest(hash: &str, tools: &[&str], denied: (&str, &str, &str)) -> Value {
    json!({
        "kind": "sharedos.mcp-column",
        "version": 1,
        "systemIdentity": {"harness": "pi", "harnessVersion": "0.86.1", "mcpSupport": "extension",
                           "extension": "pi-mcp-adapter@2.36.0"},
        "catalogHash": hash,
        "catalogue": tools,
        "rows": [
            {"id": "allowed-read", "grade": "pass", "outcome": "succeeded", "code": "ok"},
            {"id": "denied-read", "grade": denied.0, "outcome": denied.1, "code": denied.2},
        ],
        "checks": [{"id": "offered-catalogue", "grade": "pass", "detail": "d"},
                   {"id": "tool-policy", "grade": "pass", "detail": "d"}],
        "offered": {"boundary": {}, "missing": [], "extra": [], "renamed": [], "others": []},
        "model": {"declared": "fake/fake-model", "asked": ["fake-model"], "same": true},
        "summary": {"pass": 4, "fail": 0, "notExercised": 0, "allPassed": true},
    })
}

/// `column compare`: 0 when every row is the same, 4 naming the row that differs, 5 with the
/// tool-set difference (and no row compared) when the catalogue hashes differ; a file that is
/// not a manifest is refused by name. `column summary` and `column matrix` read the same files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_compare_matrix_and_summary() {
    let dir = tempfile::tempdir().expect("tmp");
    let write = |name: &str, v: &Value| {
        let p = dir.path().join(name);
        std::fs::write(&p, v.to_string()).expect("write");
        p
    };
    let a = write(
        "a.json",
        &column_manifest(
            "h1",
            &["files.list", "files.read"],
            ("pass", "denied", "no_permit"),
        ),
    );
    let same = write(
        "same.json",
        &column_manifest(
            "h1",
            &["files.list", "files.read"],
            ("pass", "denied", "no_permit"),
        ),
    );
    let differs = write(
        "differs.json",
        &column_manifest(
            "h1",
            &["files.list", "files.read"],
            ("fail", "succeeded", "ok"),
        ),
    );
    let other = write(
        "other.json",
        &column_manifest(
            "h2",
            &["files.read", "files.write"],
            ("pass", "denied", "no_permit"),
        ),
    );
    let compare = |x: &std::path::Path, y: &std::path::Path| {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.args(["column", "compare"]).arg(x).arg(y);
        run(cmd)
    };
    let (code, out, err) = compare(&a, &same).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("every row the same"), "{out}");

    let (code, out, _) = compare(&a, &differs).await;
    assert_eq!(code, 4, "{out}");
    let row = out
        .lines()
        .find(|l| l.starts_with("denied-read"))
        .expect("the row");
    assert!(
        row.contains("pass denied/no_permit")
            && row.contains("fail succeeded/ok")
            && row.ends_with("DIFFERS"),
        "{row}"
    );
    assert!(out.contains("1 row(s) differ"), "{out}");

    let (code, out, _) = compare(&a, &other).await;
    assert_eq!(code, 5, "{out}");
    assert!(
        out.contains("catalogue hashes differ (A h1, B h2): refusal behaviour is not compared"),
        "{out}"
    );
    assert!(out.contains("tools only in A: `files.list`"), "{out}");
    assert!(out.contains("tools only in B: `files.write`"), "{out}");
    assert!(!out.contains("denied-read"), "no row compared: {out}");

    let bad = write("bad.json", &json!({"kind": "something else"}));
    let (code, _, err) = compare(&a, &bad).await;
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!("`{}` is neither a column manifest", bad.display())),
        "{err}"
    );
    let (code, _, err) = compare(&a, &dir.path().join("missing.json")).await;
    assert_eq!(code, 1);
    assert!(err.contains("missing.json"), "{err}");

    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["column", "summary"]).arg(&differs);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "{err}");
    let summary: Value = serde_json::from_str(&out).expect("summary json");
    assert_eq!(summary["kind"], "sharedos.mcp-column-summary");
    assert_eq!(
        summary["rows"][1],
        json!({"id": "denied-read", "grade": "fail", "outcome": "succeeded/ok"})
    );
    let summaries = dir.path().join("matrix");
    std::fs::create_dir(&summaries).expect("mkdir");
    std::fs::write(summaries.join("pi.json"), &out).expect("write");
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["column", "matrix"]).arg(&summaries).arg(&a);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    assert_eq!(
        lines[2],
        "| pi | 0.86.1 (declared; not measured) + pi-mcp-adapter@2.36.0 | `h1` | pass | fail | pass | pass | `fake-model` (the declared one) |"
    );
    assert!(
        lines[3].contains("| `h1` | pass | pass | pass | pass |"),
        "{out}"
    );
    assert_eq!(
        lines[5],
        "Every column was given the same catalogue: catalogHash `h1`."
    );
    // A column of another catalogue is refused, naming it, unless asked to show it anyway.
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["column", "matrix"])
        .arg(&summaries)
        .arg(&a)
        .arg(&other);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 1, "{out}");
    assert!(
        err.contains("pi has catalogHash h2 (most carry h1)") && err.contains("--show-anyway"),
        "{err}"
    );
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["column", "matrix", "--show-anyway"])
        .arg(&summaries)
        .arg(&a)
        .arg(&other);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("| `h2` DIFFERS |"), "{out}");
    assert!(
        out.contains("NOT the same catalogue: pi has catalogHash h2 (shown anyway)."),
        "{out}"
    );
    // A summary without a catalogue hash is never taken for the same catalogue.
    let mut bare: Value =
        serde_json::from_str(&std::fs::read_to_string(summaries.join("pi.json")).expect("read"))
            .expect("json");
    bare["systemIdentity"]
        .as_object_mut()
        .expect("identity")
        .remove("catalogHash");
    let lone = dir.path().join("lone");
    std::fs::create_dir(&lone).expect("mkdir");
    std::fs::write(lone.join("pi.json"), bare.to_string()).expect("write");
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["column", "matrix"]).arg(&lone);
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1);
    assert!(err.contains("pi has no catalogHash"), "{err}");
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["column", "matrix"]).arg(dir.path().join("empty"));
    std::fs::create_dir(dir.path().join("empty")).expect("mkdir");
    let (code, _, err) = run(cmd).await;
    assert_eq!(code, 1);
    assert!(err.contains("no summaries or manifests"), "{err}");
}

/// `secrets … --sign-in(s)` reads the broker's sign-ins (`<record>.oauth`), never the secret
/// store: without `--config` it is refused (a `--dir` is a secret store, not where sign-ins are),
/// and a sign-out of a provider named like a secret leaves that secret where it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_commands_never_touch_the_secret_store() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = crate::kit::write_config(dir.path(), &Options::default());
    crate::secrets::set_secret(&config, "alice", "gh", "a-secret-value");
    let secrets = dir.path().join("secrets");
    let cli = |args: &[&str], at: (&str, &std::path::Path)| {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.arg("secrets")
            .args(args)
            .arg(at.0)
            .arg(at.1)
            .args(["--principal", "alice"]);
        run(cmd)
    };
    for args in [
        &["list", "--sign-ins"][..],
        &["delete", "--sign-in", "gh"][..],
    ] {
        let (code, out, err) = cli(args, ("--dir", &secrets)).await;
        assert_eq!((code, out.as_str()), (1, ""), "{args:?}: {err}");
        assert!(
            err.contains("sign-ins are kept beside the broker's record (`<record>.oauth`): give --config FILE"),
            "{args:?}: {err}"
        );
    }
    let (code, out, err) = cli(&["list", "--sign-ins"], ("--config", &config)).await;
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    let (code, _, err) = cli(&["delete", "--sign-in", "gh"], ("--config", &config)).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("principal `alice` is not signed in to `gh`"),
        "{err}"
    );
    let (code, out, err) = cli(&["list"], ("--config", &config)).await;
    assert_eq!((code, out.as_str()), (0, "gh\n"), "the secret stays: {err}");
}
