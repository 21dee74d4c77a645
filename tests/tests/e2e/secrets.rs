//! Issue 33: secret references, secret stores, per-principal upstream instances, redaction.
//! The upstream is tests/python/whoami_token.py (PyPI mcp 2.3.0's `MCPServer`): it tells which
//! token it holds (its SHA-256) and its pid, or leaks the token itself (`echo_token`).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sharedos_proto::ipc::{ControlRequest, ControlResponse};

use crate::kit::{Options, Raw, TestBroker, WAIT, bin, eventually, run};

const POLICY: &str = r#"
@id("who")
permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "who.*" || resource.name like "whos.*" };
"#;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/whoami_token.py");
/// Its sandbox (issue 32): the script's folder is read besides the defaults (the venv's Python).
const SANDBOX: &str = concat!(
    "[providers.sandbox]\nread = [\"",
    env!("CARGO_MANIFEST_DIR"),
    "/python\"]\n"
);

/// The Python with PyPI mcp 2.3.0 (`.ci/run` sets SHAREDOS_PYTHON; else its venv), or `None`
/// (skipped, failing under CI).
fn python() -> Option<String> {
    if let Ok(p) = std::env::var("SHAREDOS_PYTHON")
        && !p.is_empty()
    {
        return Some(p);
    }
    let venv = PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
        .join(".cache/sharedos-ci/venv-mcp-2.3.0/bin/python");
    if venv.is_file() {
        return Some(venv.display().to_string());
    }
    assert!(
        std::env::var("CI").is_err(),
        "CI must set SHAREDOS_PYTHON (see .ci/run)"
    );
    eprintln!("SKIPPED: no Python with PyPI mcp 2.3.0 (run .ci/run)");
    None
}

fn sha(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A token no other test run has.
fn token(who: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    format!("tok-{who}-{nanos:x}-{}", std::process::id())
}

/// The `who` provider: per-principal, $TOKEN and argv[1] from secret `token`, plus `extra`.
fn provider(python: &str, extra: &str) -> String {
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"who\"\ncommand = {}\nargs = [{}, {{ secret = \"token\" }}]\nenv = {{ TOKEN = {{ secret = \"token\" }} }}\ninstances = \"per_principal\"\n{extra}{}",
        json!(python),
        json!(SCRIPT),
        SANDBOX
    )
}

async fn broker(python: &str, top: &str, extra: &str) -> TestBroker {
    TestBroker::start(Options {
        policy: POLICY,
        top: top.to_owned(),
        tables: provider(python, extra),
        ..Options::default()
    })
    .await
}

/// `sharedos-broker secrets set --config CFG --principal P NAME`, the value on stdin.
pub(crate) fn set_secret(config: &Path, principal: &str, name: &str, value: &str) {
    let mut child = std::process::Command::new(bin("sharedos-broker"))
        .args(["secrets", "set", "--config"])
        .arg(config)
        .args(["--principal", principal, name])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("cli");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{value}\n").as_bytes())
        .expect("value");
    let out = child.wait_with_output().expect("wait");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!said.contains(value), "the CLI printed the value: {said}");
}

async fn shim(b: &TestBroker, principal: &str) -> (Raw, String) {
    let turn = b.open_turn(principal).await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    (raw, turn.turn)
}

/// What `whoami` said: (pid, token SHA-256, argv[1] SHA-256).
fn whoami(result: &Value) -> (i32, String, String) {
    let text = result["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {result}"));
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (
        v["pid"].as_i64().expect("pid") as i32,
        v["token_sha256"].as_str().expect("sha").to_owned(),
        v["arg_sha256"].as_str().expect("sha").to_owned(),
    )
}

fn code(result: &Value) -> String {
    let m = &result["result"]["_meta"]["sharedos"];
    format!(
        "{}/{}",
        m["outcome"].as_str().unwrap_or("?"),
        m["code"].as_str().unwrap_or("?")
    )
}

fn text(result: &Value) -> String {
    result["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `n` calls of `tool` sent at once on one shim, answered in any order.
async fn at_once(raw: &mut Raw, first_id: i64, n: i64, tool: &str) -> Vec<Value> {
    for id in first_id..first_id + n {
        raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": {}}}))
            .await;
    }
    let mut answers = Vec::new();
    while answers.len() < n as usize {
        let v = raw.recv().await;
        if v.get("id").is_some() && v.get("method").is_none() {
            answers.push(v);
        }
    }
    answers
}

fn instance_lines(b: &TestBroker, state: &str, principal: &str) -> Vec<Value> {
    b.records()
        .into_iter()
        .filter(|l| {
            l["kind"] == "provider_state" && l["state"] == state && l["principal"] == principal
        })
        .collect()
}

/// The upstream processes (whoami_token.py) whose parent is `parent`.
fn upstreams_of(parent: u32) -> Vec<i32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let Some(after) = stat.rsplit_once(") ") else {
            continue;
        };
        let fields: Vec<&str> = after.1.split(' ').collect();
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if fields.get(1) == Some(&parent.to_string().as_str())
            && fields.first() != Some(&"Z")
            && String::from_utf8_lossy(&cmdline).contains("whoami_token.py")
        {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

/// Whether `pid` is gone (or a zombie waiting to be reaped).
fn gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
        .unwrap_or(true)
}

/// Every file under `dir` but the folder store, as bytes, with its path.
fn files_under(dir: &Path, skip: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
    for e in std::fs::read_dir(dir).expect("dir").flatten() {
        let p = e.path();
        let ft = e.file_type().expect("type");
        if p == skip || ft.is_symlink() {
            continue;
        }
        if ft.is_dir() {
            files_under(&p, skip, out);
        } else if ft.is_file() {
            out.push((p.clone(), std::fs::read(&p).unwrap_or_default()));
        }
    }
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// The real broker process (`serve`, logging at trace to a file) on a TestBroker's config and
/// runtime dir: alice's and bob's calls to the same tool run in their own instances with their
/// own tokens, also 32 at once from each; carol, without the secret, is refused and nothing is
/// spawned; a leaked token comes back redacted; and the tokens are in no record file, not in the
/// trace log, not in `providers`, not in the broker's /proc cmdline or environ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn each_principal_gets_their_own_instance_and_token_and_no_token_leaks() {
    let Some(py) = python() else { return };
    let mut b = broker(&py, "", "").await;
    let (ta, tb) = (token("alice"), token("bob"));
    set_secret(&b.config_path, "alice", "token", &ta);
    set_secret(&b.config_path, "bob", "token", &tb);
    b.stop().await;
    let log = b.dir.path().join("broker.log");
    let mut serve = tokio::process::Command::new(bin("sharedos-broker"));
    serve
        .arg("--runtime-dir")
        .arg(&b.runtime)
        .args(["serve", "--config"])
        .arg(&b.config_path)
        .arg("--log-file")
        .arg(&log)
        .env("SHAREDOS_LOG", "trace")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let mut server = serve.spawn().expect("serve");
    let broker_pid = server.id().expect("pid");
    let deadline = Instant::now() + WAIT;
    while sharedos_host::client::ControlClient::connect(&b.runtime)
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the broker did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Only the provider's listing instance runs before anyone calls.
    assert_eq!(upstreams_of(broker_pid).len(), 1);

    let (mut alice, alice_turn) = shim(&b, "alice").await;
    let (mut bob, _) = shim(&b, "bob").await;
    let (mut carol, carol_turn) = shim(&b, "carol").await;
    let started = Instant::now();
    let (pa, ha, arg_a) = whoami(&alice.call(1, "who.whoami", json!({})).await);
    let first_call = started.elapsed();
    let (pb, hb, arg_b) = whoami(&bob.call(1, "who.whoami", json!({})).await);
    assert_eq!(
        (ha.as_str(), arg_a.as_str()),
        (sha(&ta).as_str(), sha(&ta).as_str())
    );
    assert_eq!(
        (hb.as_str(), arg_b.as_str()),
        (sha(&tb).as_str(), sha(&tb).as_str())
    );
    assert_ne!(pa, pb, "alice and bob share a process");
    eprintln!("first call on a new per-principal instance: {first_call:?}");

    // 32 calls at once from each: every answer from their own process with their own token.
    let (a32, b32) = tokio::join!(
        at_once(&mut alice, 100, 32, "who.whoami"),
        at_once(&mut bob, 100, 32, "who.whoami")
    );
    assert_eq!((a32.len(), b32.len()), (32, 32));
    for r in &a32 {
        let (p, h, _) = whoami(r);
        assert_eq!((p, h.as_str()), (pa, sha(&ta).as_str()), "{r}");
    }
    for r in &b32 {
        let (p, h, _) = whoami(r);
        assert_eq!(
            (p, h.as_str()),
            (pb, sha(&tb).as_str()),
            "bob got another token: {r}"
        );
    }

    // carol has no secret: refused, recorded, nothing spawned.
    let r = carol.call(1, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "failed/missing_credential", "{r}");
    assert!(
        text(&r).contains("`token`") && text(&r).contains("`carol`"),
        "{r}"
    );
    assert_eq!(upstreams_of(broker_pid).len(), 3, "listing + alice + bob");

    // A leaking upstream: the harness sees the name, not the token; the line says so.
    let r = alice.call(2, "who.echo_token", json!({})).await;
    assert_eq!(code(&r), "succeeded/ok", "{r}");
    let shown = r.to_string();
    assert!(!shown.contains(&ta), "{shown}");
    assert!(text(&r).contains("my token is [redacted: token]"), "{r}");
    // A model pasting the token into a call: not in the record.
    let r = alice
        .call(3, "who.echo", json!({"text": format!("here: {ta}")}))
        .await;
    assert_eq!(text(&r), "here: [redacted: token]", "{r}");

    // `providers`, table and JSON.
    let mut providers = String::new();
    for json_flag in [false, true] {
        let mut cmd = b.cli();
        cmd.arg("providers");
        if json_flag {
            cmd.arg("--json");
        }
        let (c, out, err) = run(cmd).await;
        assert_eq!(c, 0, "{err}");
        providers.push_str(&out);
    }
    assert!(
        providers.contains("alice"),
        "instances are listed: {providers}"
    );
    let cmdline = std::fs::read(format!("/proc/{broker_pid}/cmdline")).expect("cmdline");
    let environ = std::fs::read(format!("/proc/{broker_pid}/environ")).expect("environ");

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(broker_pid as i32).expect("pid"),
        rustix::process::Signal::TERM,
    )
    .expect("term");
    tokio::time::timeout(WAIT, server.wait())
        .await
        .expect("broker stops")
        .expect("wait");

    let calls = b.calls_of(&carol_turn);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["code"], "missing_credential");
    assert!(instance_lines(&b, "instance_started", "carol").is_empty());
    assert_eq!(instance_lines(&b, "instance_started", "alice").len(), 1);
    assert_eq!(instance_lines(&b, "instance_started", "bob").len(), 1);
    let calls = b.calls_of(&alice_turn);
    let redacted: Vec<&Value> = calls
        .iter()
        .filter(|c| c.get("redacted").is_some())
        .collect();
    assert_eq!(redacted.len(), 2, "{calls:?}");
    assert!(redacted.iter().all(|c| c["redacted"] == json!(["token"])));
    assert_eq!(
        redacted[1]["arguments"]["text"], "here: [redacted: token]",
        "{:?}",
        redacted[1]
    );

    let log_text = std::fs::read_to_string(&log).expect("log");
    // The log was written (at trace: every target the broker's filter lets through).
    assert!(
        log_text.contains("per-principal instance started") && log_text.contains("broker ready"),
        "{log_text}"
    );
    // The upstream's own stderr line with its token: the name only.
    assert!(
        log_text.contains("upstream stderr: starting with token [redacted: token]"),
        "{log_text}"
    );
    let mut files = vec![];
    files_under(b.dir.path(), &b.dir.path().join("secrets"), &mut files);
    assert!(files.iter().any(|(p, _)| p.ends_with("record.jsonl")));
    assert!(files.iter().any(|(p, _)| p.ends_with("broker.log")));
    for t in [&ta, &tb] {
        for (path, bytes) in &files {
            assert!(!contains(bytes, t), "token in {}", path.display());
        }
        assert!(!providers.contains(t.as_str()), "token in providers");
        assert!(!contains(&cmdline, t), "token in the broker's cmdline");
        assert!(!contains(&environ, t), "token in the broker's environ");
    }
    eprintln!(
        "grepped {} files ({} bytes), providers output ({} bytes), /proc cmdline and environ: no token",
        files.len(),
        files.iter().map(|(_, b)| b.len()).sum::<usize>(),
        providers.len()
    );
}

/// An instance unused for `instance_idle_seconds` is stopped; a killed one is started again at
/// its principal's next call; over `max_instances`, a call is refused naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn instances_stop_when_idle_restart_when_killed_and_are_capped() {
    let Some(py) = python() else { return };
    let mut b = broker(&py, "", "instance_idle_seconds = 2\nmax_instances = 1\n").await;
    let ta = token("alice");
    set_secret(&b.config_path, "alice", "token", &ta);
    set_secret(&b.config_path, "bob", "token", &token("bob"));
    b.restart().await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (mut bob, bob_turn) = shim(&b, "bob").await;
    let (p1, h1, _) = whoami(&alice.call(1, "who.whoami", json!({})).await);
    assert_eq!(h1, sha(&ta));

    // The cap: one instance runs (alice's); bob is refused, naming the setting.
    let r = bob.call(1, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "failed/upstream_unavailable", "{r}");
    assert!(text(&r).contains("max_instances"), "{r}");
    assert!(instance_lines(&b, "instance_started", "bob").is_empty());
    assert_eq!(b.calls_of(&bob_turn)[0]["code"], "upstream_unavailable");

    // Killed: forgotten, and the next call starts another.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(p1).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill");
    eventually("the killed instance is seen stopped", || {
        !instance_lines(&b, "instance_stopped", "alice").is_empty()
    })
    .await;
    let (p2, h2, _) = whoami(&alice.call(2, "who.whoami", json!({})).await);
    assert_ne!(p1, p2);
    assert_eq!(h2, sha(&ta));
    let last_call = Instant::now();

    // Idle: stopped after 2 s unused.
    eventually("the idle instance stops", || gone(p2)).await;
    let idle = last_call.elapsed();
    // Its place under the cap is given back (and recorded) right after.
    eventually("the idle stop is recorded", || {
        instance_lines(&b, "instance_stopped", "alice").len() == 2
    })
    .await;
    assert!(
        idle >= Duration::from_millis(1900) && idle < Duration::from_secs(5),
        "stopped after {idle:?}"
    );
    let stopped = instance_lines(&b, "instance_stopped", "alice");
    assert_eq!(stopped.len(), 2, "{stopped:?}");
    assert!(
        stopped[1]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("instance_idle_seconds = 2"),
        "{stopped:?}"
    );
    eprintln!("idle instance stopped {idle:?} after its last call (instance_idle_seconds = 2)");
    // With alice's stopped, bob fits under the cap.
    let r = bob.call(2, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "succeeded/ok", "{r}");
}

/// A call that times out (its future dropped) gives its instance back: the instance still stops
/// when idle, and its place under the cap is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn a_timed_out_call_does_not_keep_its_instance_busy() {
    let Some(py) = python() else { return };
    let mut b = broker(
        &py,
        "",
        // Long enough for bob's instance to start within his call's limit.
        "instance_idle_seconds = 1\nmax_instances = 1\ncall_timeout_seconds = 4\n",
    )
    .await;
    set_secret(&b.config_path, "alice", "token", &token("alice"));
    set_secret(&b.config_path, "bob", "token", &token("bob"));
    b.restart().await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (mut bob, _) = shim(&b, "bob").await;
    let (pa, _, _) = whoami(&alice.call(1, "who.whoami", json!({})).await);
    let r = alice.call(2, "who.slow", json!({"seconds": 8})).await;
    assert_eq!(code(&r), "failed/timeout", "{r}");
    eventually("alice's instance stops once idle", || {
        gone(pa) && !instance_lines(&b, "instance_stopped", "alice").is_empty()
    })
    .await;
    let r = bob.call(1, "who.whoami", json!({})).await;
    assert_eq!(
        code(&r),
        "succeeded/ok",
        "the cap's place was not given back: {r}"
    );
}

/// An instance whose own listing differs from the provider's is held back for that principal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn an_instance_listing_other_tools_is_held_back_for_its_principal() {
    let Some(py) = python() else { return };
    let mut b = broker(&py, "", "").await;
    set_secret(&b.config_path, "alice", "token", &token("alice"));
    set_secret(
        &b.config_path,
        "bob",
        "token",
        &format!("drift-{}", token("bob")),
    );
    b.restart().await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (mut bob, _) = shim(&b, "bob").await;
    assert_eq!(
        code(&alice.call(1, "who.whoami", json!({})).await),
        "succeeded/ok"
    );
    let r = bob.call(1, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "failed/provider_drifted", "{r}");
    assert!(text(&r).contains("`bob`"), "{r}");
    assert_eq!(instance_lines(&b, "drifted", "bob").len(), 1);
    assert!(instance_lines(&b, "instance_started", "bob").is_empty());
}

/// The folder store refuses a 0644 file and a link, naming them; the call is refused
/// `failed/missing_credential` and nothing is spawned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn the_folder_store_refuses_loose_modes_and_links_by_name() {
    use std::os::unix::fs::PermissionsExt;
    let Some(py) = python() else { return };
    let mut b = broker(&py, "", "").await;
    set_secret(&b.config_path, "alice", "token", &token("alice"));
    set_secret(&b.config_path, "bob", "token", &token("bob"));
    let secrets = b.dir.path().join("secrets");
    let alice_file = secrets.join("alice/token");
    assert_eq!(
        std::fs::metadata(&alice_file)
            .expect("meta")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    std::fs::set_permissions(&alice_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let bob_file = secrets.join("bob/token");
    std::fs::remove_file(&bob_file).expect("rm");
    std::os::unix::fs::symlink(&alice_file, &bob_file).expect("link");
    b.restart().await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (mut bob, _) = shim(&b, "bob").await;
    let r = alice.call(1, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "failed/missing_credential", "{r}");
    assert!(
        text(&r).contains(&alice_file.display().to_string()) && text(&r).contains("0644"),
        "{r}"
    );
    let r = bob.call(1, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "failed/missing_credential", "{r}");
    assert!(
        text(&r).contains(&bob_file.display().to_string()) && text(&r).contains("link"),
        "{r}"
    );
    assert!(instance_lines(&b, "instance_started", "alice").is_empty());
    assert!(instance_lines(&b, "instance_started", "bob").is_empty());
}

/// The helper-command store, with a shell-script helper: stdout is the secret, its environment
/// only `PATH`, `LANG`, `HOME` and `secret_env`, a non-zero exit is "not found", a helper that hangs is killed at `secret_command_timeout_seconds`, one that
/// prints 10 MiB is cut off at the size bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn the_helper_command_store_is_bounded_in_time_and_size() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let helper = dir.path().join("helper.sh");
    let ta = token("alice");
    let env_file = dir.path().join("helper.env");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n# $1 = principal, $2 = secret name\n[ \"$2\" = token ] || exit 2\ncase \"$1\" in\n  alice) env > {env_file}; echo '{ta}' ;;\n  hang) sleep 60 ;;\n  big) head -c 10485760 /dev/zero | tr '\\0' x ;;\n  *) exit 1 ;;\nesac\n",
            env_file = env_file.display()
        ),
    )
    .expect("helper");
    let top = format!(
        "secret_command = [\"/bin/sh\", {}, \"{{principal}}\", \"{{name}}\"]\nsecret_command_timeout_seconds = 1\nsecret_env = {{ VAULT_ADDR = \"declared\" }}\n",
        json!(helper.display().to_string())
    );
    let b = broker(&py, &top, "").await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (_, h, _) = whoami(&alice.call(1, "who.whoami", json!({})).await);
    assert_eq!(h, sha(&ta));
    // The helper got none of the broker's environment (this test process's, with its CI and
    // cargo variables): PATH, LANG, the broker's HOME and what secret_env declares.
    let mut env: Vec<String> = std::fs::read_to_string(&env_file)
        .expect("the helper's env")
        .lines()
        // The shell sets PWD itself (it names the broker's working folder, no secret).
        .filter(|l| !l.starts_with("PWD="))
        .map(str::to_owned)
        .collect();
    env.sort();
    let home = std::env::var("HOME").unwrap_or_else(|_| "/nonexistent".to_owned());
    assert_eq!(
        env,
        [
            format!("HOME={home}"),
            "LANG=C.UTF-8".to_owned(),
            "PATH=/usr/local/bin:/usr/bin:/bin".to_owned(),
            "VAULT_ADDR=declared".to_owned(),
        ],
        "only PATH, LANG, HOME and the declared environment"
    );
    let (mut bob, _) = shim(&b, "bob").await;
    let r = bob.call(1, "who.whoami", json!({})).await;
    assert_eq!(code(&r), "failed/missing_credential", "{r}");
    assert!(
        text(&r).contains("helper.sh") || text(&r).contains("/bin/sh"),
        "{r}"
    );

    let (mut hang, _) = shim(&b, "hang").await;
    let t = Instant::now();
    let r = hang.call(1, "who.whoami", json!({})).await;
    let took = t.elapsed();
    assert_eq!(code(&r), "failed/missing_credential", "{r}");
    assert!(text(&r).contains("did not finish within 1 s"), "{r}");
    assert!(took < Duration::from_secs(4), "{took:?}");

    let (mut big, _) = shim(&b, "big").await;
    let t = Instant::now();
    let r = big.call(1, "who.whoami", json!({})).await;
    let took_big = t.elapsed();
    assert_eq!(code(&r), "failed/missing_credential", "{r}");
    assert!(text(&r).contains("more than 65536 bytes"), "{r}");
    assert!(took_big < Duration::from_secs(4), "{took_big:?}");
    eprintln!("hanging helper refused after {took:?}; 10 MiB helper refused after {took_big:?}");
    for p in ["bob", "hang", "big"] {
        assert!(instance_lines(&b, "instance_started", p).is_empty(), "{p}");
    }
}

/// A shared provider takes a shared secret (`shared = true`); a per-principal reference in a
/// shared provider is a config error naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn a_shared_provider_takes_shared_secrets_only() {
    let Some(py) = python() else { return };
    let shared = |secret: &str| {
        format!(
            "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"who\"\ncommand = {}\nargs = [{}]\nenv = {{ TOKEN = {secret} }}\n{}",
            json!(py),
            json!(SCRIPT),
            SANDBOX
        )
    };
    let dir = tempfile::tempdir().expect("tmp");
    let bad = crate::kit::write_config(
        dir.path(),
        &Options {
            policy: POLICY,
            tables: shared("{ secret = \"token\" }"),
            ..Options::default()
        },
    );
    let e = sharedos_broker::Config::from_file(&bad)
        .expect_err("per-principal secret in a shared provider")
        .to_string();
    assert!(e.contains("per_principal") && e.contains("`token`"), "{e}");

    let ts = token("shared");
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        ..Options::default()
    })
    .await;
    set_secret(&b.config_path, "_shared", "token", &ts);
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        format!("{cfg}{}", shared("{ secret = \"token\", shared = true }")),
    )
    .expect("w");
    b.restart().await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (mut bob, _) = shim(&b, "bob").await;
    let (pa, ha, _) = whoami(&alice.call(1, "who.whoami", json!({})).await);
    let (pb, hb, _) = whoami(&bob.call(1, "who.whoami", json!({})).await);
    assert_eq!((pa, ha.as_str()), (pb, sha(&ts).as_str()));
    assert_eq!(hb, sha(&ts));
    // Redacted for everyone: it was given to the instance everyone shares.
    let r = bob.call(2, "who.echo_token", json!({})).await;
    assert!(!r.to_string().contains(&ts), "{r}");
    assert!(text(&r).contains("[redacted: token]"), "{r}");
    let providers = match b
        .host()
        .await
        .call(&ControlRequest::Providers)
        .await
        .expect("providers")
    {
        ControlResponse::Providers { providers } => providers,
        other => panic!("{other:?}"),
    };
    assert!(
        !serde_json::to_string(&providers)
            .expect("json")
            .contains(&ts)
    );
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// 20 warm-up calls of `tool`, then 300 timed ones, one at a time: their times, sorted.
async fn steady(raw: &mut Raw, tool: &str) -> Vec<Duration> {
    for id in 0..20 {
        assert_eq!(code(&raw.call(id, tool, json!({})).await), "succeeded/ok");
    }
    let mut took = vec![];
    for id in 1000..1300 {
        let t = Instant::now();
        let r = raw.call(id, tool, json!({})).await;
        took.push(t.elapsed());
        assert_eq!(code(&r), "succeeded/ok", "{r}");
    }
    took.sort_unstable();
    took
}

/// The debug measurement recorded in bench/NOTES.md ("Per-principal instances"; the release
/// figures are section 8 of `sharedos-bench`): the first call of 8 principals, each
/// spawning their instance, against the steady-state call on a running per-principal instance
/// and on a shared one (the same upstream script), sequential, through the real shim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PyPI mcp 2.3.0 (SHAREDOS_PYTHON or its .ci venv): bash .ci/run installs it"]
async fn per_principal_first_call_and_steady_state_cost() {
    let Some(py) = python() else { return };
    let shared = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"whos\"\ncommand = {}\nargs = [{}]\nenv = {{ TOKEN = {{ secret = \"token\", shared = true }} }}\n{}",
        json!(py),
        json!(SCRIPT),
        SANDBOX
    );
    let mut b = broker(&py, "", "").await;
    let principals: Vec<String> = (0..8).map(|i| format!("p{i}")).collect();
    for p in &principals {
        set_secret(&b.config_path, p, "token", &token(p));
    }
    set_secret(&b.config_path, "_shared", "token", &token("shared"));
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(&b.config_path, format!("{cfg}{shared}")).expect("w");
    b.restart().await;
    let mut first = vec![];
    let mut pids = std::collections::BTreeSet::new();
    for p in &principals {
        let (mut raw, _) = shim(&b, p).await;
        let t = Instant::now();
        let r = raw.call(1, "who.whoami", json!({})).await;
        first.push(t.elapsed());
        pids.insert(whoami(&r).0);
    }
    assert_eq!(pids.len(), 8, "one process per principal");
    let (mut raw, _) = shim(&b, "p0").await;
    let per_principal = steady(&mut raw, "who.whoami").await;
    let shared = steady(&mut raw, "whos.whoami").await;
    first.sort_unstable();
    eprintln!(
        "first call (spawn + initialize + tools/list + call), 8 principals: median {:?}, min {:?}, max {:?}",
        percentile(&first, 0.5),
        first[0],
        first[first.len() - 1]
    );
    for (what, t) in [("per-principal", &per_principal), ("shared", &shared)] {
        eprintln!(
            "steady state on a running {what} instance, 300 sequential calls: median {:?}, p99 {:?}",
            percentile(t, 0.5),
            percentile(t, 0.99)
        );
    }
    assert_eq!((per_principal.len(), shared.len()), (300, 300));
}

/// Telemetry spans (to a real Arize Phoenix, as the telemetry tests do) of calls that got a
/// token, leaked it, pasted it, or missed it: no span holds the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Arize Phoenix from .ci/install-phoenix and PyPI mcp 2.3.0: bash .ci/run installs them"]
async fn no_token_reaches_a_telemetry_span() {
    let Some(py) = python() else { return };
    let Some(env) = crate::kit::installed("phoenix", ".ci/install-phoenix") else {
        return;
    };
    let mut phoenix = crate::telemetry::Phoenix::start(Path::new(&env["PHOENIX"])).await;
    let mut b = TestBroker::start(Options {
        policy: POLICY,
        tables: format!(
            "{}\n[otel]\nendpoint = \"http://127.0.0.1:{}\"\nmetrics = false\nprincipal = true\ntimeout_seconds = 2\n",
            provider(&py, ""),
            phoenix.port
        ),
        ..Options::default()
    })
    .await;
    let ta = token("alice");
    set_secret(&b.config_path, "alice", "token", &ta);
    b.restart().await;
    let (mut alice, _) = shim(&b, "alice").await;
    let (mut carol, _) = shim(&b, "carol").await;
    assert_eq!(
        code(&alice.call(1, "who.whoami", json!({})).await),
        "succeeded/ok"
    );
    assert_eq!(
        code(&alice.call(2, "who.echo_token", json!({})).await),
        "succeeded/ok"
    );
    let r = alice.call(3, "who.echo", json!({"text": ta.clone()})).await;
    assert_eq!(text(&r), "[redacted: token]", "{r}");
    assert_eq!(
        code(&carol.call(1, "who.whoami", json!({})).await),
        "failed/missing_credential"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let spans = loop {
        let spans = phoenix.spans().await;
        if spans.len() >= 4 {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "only {} spans: {spans:?}",
            spans.len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let all = serde_json::to_string(&spans).expect("json");
    assert!(
        all.contains("who.echo_token") && all.contains("missing_credential"),
        "{all}"
    );
    assert!(!all.contains(&ta), "a span holds the token: {all}");
    eprintln!(
        "{} spans ({} bytes of JSON from Phoenix): no token",
        spans.len(),
        all.len()
    );
    phoenix.child.kill().await.expect("kill phoenix");
}
