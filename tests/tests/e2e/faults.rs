//! Faults through real processes: a broker killed at random points under load (every answered
//! call must be on disk), lifecycle ends that must leak nothing, and hostile upstreams.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::kit::{Options, Raw, bin, eventually, meta, run};

struct Proc {
    dir: tempfile::TempDir,
    cfg: PathBuf,
    run_dir: PathBuf,
}

impl Proc {
    fn new(opts: &Options) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let cfg = crate::kit::write_config(dir.path(), opts);
        let run_dir = dir.path().join("run");
        Self { dir, cfg, run_dir }
    }

    fn record(&self) -> PathBuf {
        self.dir.path().join("record.jsonl")
    }

    /// The whole record's text: its rotated files, then the record.
    fn text(&self) -> String {
        crate::races::record_texts(&self.record()).concat()
    }

    /// Starts `sharedos-broker serve` and waits until it has recorded its start.
    async fn serve(&self) -> tokio::process::Child {
        // Its start is on record once serving (the chain's first line comes before the sockets).
        let started = || self.text().matches("\"kind\":\"broker_started\"").count();
        let before = started();
        let mut c = tokio::process::Command::new(bin("sharedos-broker"));
        c.args(["serve", "--runtime-dir"])
            .arg(&self.run_dir)
            .arg("--config")
            .arg(&self.cfg)
            .kill_on_drop(true)
            .stderr(std::process::Stdio::null());
        let child = c.spawn().expect("serve");
        eventually("broker started", || started() > before).await;
        child
    }

    async fn open(&self, principal: &str, extra: &[&str]) -> (String, String) {
        let mut open = std::process::Command::new(bin("sharedos-broker"));
        open.args([
            "turn",
            "open",
            "--principal",
            principal,
            "--json",
            "--runtime-dir",
        ])
        .arg(&self.run_dir)
        .args(extra);
        let (code, out, err) = run(open).await;
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(&out).expect("json");
        (
            v["turn"].as_str().expect("turn").to_owned(),
            v["token"].as_str().expect("token").to_owned(),
        )
    }

    fn shim(&self, token: &str) -> Raw {
        let mut c = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        c.env("SHAREDOS_TURN_TOKEN", token)
            .env("SHAREDOS_BROKER", self.run_dir.join("bridge.sock"))
            .kill_on_drop(true);
        Raw::spawn(c)
    }

    /// Every whole line. A SIGKILL can land inside a write(2) and leave its line cut at a page
    /// boundary: that torn tail (the end of the text, with no newline) is left out, as the next
    /// start cuts it off and records the cut. Any other line must be whole JSON.
    fn lines(&self) -> Vec<Value> {
        let text = self.text();
        let whole = match text.rfind('\n') {
            Some(end) => &text[..=end],
            None => "",
        };
        if whole.len() < text.len() {
            eprintln!(
                "a torn write of {} bytes at the end, left out",
                text.len() - whole.len()
            );
        }
        whole
            .lines()
            .map(|l| serde_json::from_str(l).expect("every line is whole JSON"))
            .collect()
    }

    /// `sharedos-broker records verify --config` on this record: exit status and output.
    async fn verify(&self) -> (i32, String) {
        crate::kit::verify_record(&self.cfg).await
    }
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn children(pid: u32) -> usize {
    let me = pid.to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()
                        .and_then(|r| r.split_whitespace().nth(1))
                        .map(|p| p == me)
                })
                .unwrap_or(false)
        })
        .count()
}

/// Kills the broker (SIGKILL) at pseudo-random points while 4 clients call as fast as they can;
/// every call whose answer a client saw must be in the record, which stays whole JSON lines (but
/// for a write the kill tore, at the very end, which the next start cuts off and records), and
/// whose hash chain verifies after every restart, across rotations (64 KiB files).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answered_call_is_on_disk_when_the_broker_is_killed() {
    let p = Proc::new(&Options::default());
    let cfg = std::fs::read_to_string(&p.cfg).expect("cfg");
    let cfg = cfg.replace(
        "record_checkpoint_seconds = 0",
        "record_checkpoint_seconds = 1",
    );
    std::fs::write(&p.cfg, format!("record_rotate_bytes = 65536\n{cfg}")).expect("cfg");
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut answered_total = 0;
    for round in 0..4 {
        let mut broker = p.serve().await;
        if round > 0 {
            // Started again: a write the kill tore is cut off and recorded; the chain verifies.
            let (code, out) = p.verify().await;
            assert_eq!(
                code, 0,
                "round {round}: the record verifies once the broker is back after a kill: {out}"
            );
        }
        let mut clients = Vec::new();
        for c in 0..4 {
            let (_, token) = p.open("alice", &[]).await;
            let mut raw = p.shim(&token);
            clients.push(tokio::spawn(async move {
                raw.initialize("2025-06-18").await;
                let mut answered = Vec::new();
                for n in 0..100_000i64 {
                    let path = if n % 3 == 0 { "/private/secret.txt" } else { "/public/hello.txt" };
                    // The shim exits once its broker is gone: a failed send ends this client.
                    if !raw.try_send(json!({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "files.read", "arguments": {"path": path}}})).await {
                        break;
                    }
                    let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(5), raw.next_line()).await else { break };
                    let v: Value = serde_json::from_str(&line).expect("json");
                    let m = &v["result"]["_meta"]["sharedos"];
                    if m["code"] == "broker_unavailable" || v.get("error").is_some() {
                        break;
                    }
                    answered.push(m["callId"].as_str().expect("callId").to_owned());
                }
                let _ = c;
                answered
            }));
        }
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let delay = 150 + (seed >> 33) % 600;
        tokio::time::sleep(Duration::from_millis(delay)).await;
        broker.start_kill().expect("kill -9");
        let _ = broker.wait().await;
        let mut answered = Vec::new();
        for c in clients {
            answered.extend(c.await.expect("client"));
        }
        let recorded: HashSet<String> = p
            .lines()
            .iter()
            .filter_map(|l| l["callId"].as_str().map(str::to_owned))
            .collect();
        let missing: Vec<&String> = answered
            .iter()
            .filter(|id| !recorded.contains(*id))
            .collect();
        assert!(
            missing.is_empty(),
            "round {round} (killed after {delay} ms): answered but not recorded: {missing:?}"
        );
        answered_total += answered.len();
    }
    // A clean stop signs everything; a broker up for a while signs at its interval too.
    let mut broker = p.serve().await;
    eventually("an interval checkpoint", || {
        p.text()
            .contains("\"kind\":\"checkpoint\",\"reason\":\"interval\"")
    })
    .await;
    let pid = broker.id().expect("pid");
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
    let _ = broker.wait().await;
    let (code, out) = p.verify().await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("verified"), "{out}");
    assert!(
        !out.contains("not yet signed"),
        "the last checkpoint covers all: {out}"
    );
    let files = sharedos_broker::evidence::record::record_files(&p.record()).expect("files");
    assert!(files.len() > 2, "the record rotated: {files:?}");
    // One byte changed in the middle of a rotated file: verify fails and names that line's seq.
    let victim = &files[1];
    let text = std::fs::read_to_string(victim).expect("read");
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let i = lines.len() / 2;
    let seq = serde_json::from_str::<Value>(&lines[i]).expect("json")["seq"]
        .as_u64()
        .expect("seq");
    lines[i] = lines[i].replacen("\"kind\":\"", "\"kind\": \"", 1);
    std::fs::write(victim, lines.join("\n") + "\n").expect("write");
    let (code, out) = p.verify().await;
    assert_eq!(code, 3, "{out}");
    assert!(out.contains(&format!("BROKEN at seq {seq}:")), "{out}");
    assert!(answered_total > 0, "the clients made calls");
    println!("durability: {answered_total} answered calls over 4 kills, all on disk");
    // The record is whole lines with strictly increasing seq.
    let seqs: Vec<u64> = p
        .lines()
        .iter()
        .map(|l| l["seq"].as_u64().expect("seq"))
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
}

/// Turn closed mid-call, TTL expiry, shim killed mid-call, harness closing stdin: each ends in a
/// recorded outcome, and the broker is left with the file descriptors it started with and no
/// child process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_ends_are_recorded_and_leak_nothing() {
    let p = Proc::new(&Options {
        latency_ms: Some(3_000),
        ..Options::default()
    });
    let broker = p.serve().await;
    let pid = broker.id().expect("pid");
    // One throwaway turn first so lazily created state (caches, threads) exists at the baseline.
    let (t0, tok0) = p.open("alice", &[]).await;
    let mut warm = p.shim(&tok0);
    warm.initialize("2025-06-18").await;
    drop(warm.close_stdin().await);
    let _ = t0;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = fd_count(pid);

    async fn call(raw: &mut Raw, id: i64) {
        raw.send(json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                        "params": {"name": "files.read", "arguments": {"path": "/public/hello.txt"}}}))
            .await;
    }
    // 1. Turn closed mid-call.
    let (t1, tok1) = p.open("alice", &[]).await;
    let mut s1 = p.shim(&tok1);
    s1.initialize("2025-06-18").await;
    call(&mut s1, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut close = std::process::Command::new(bin("sharedos-broker"));
    close
        .args(["turn", "close", &t1, "--runtime-dir"])
        .arg(&p.run_dir);
    assert_eq!(run(close).await.0, 0);
    assert_eq!(
        meta(&s1.response(1).await["result"])["outcome"],
        "cancelled"
    );
    assert_eq!(s1.exit_code().await, Some(3));
    // 2. TTL expiry mid-call.
    let (t2, tok2) = p.open("alice", &["--ttl", "1"]).await;
    let mut s2 = p.shim(&tok2);
    s2.initialize("2025-06-18").await;
    call(&mut s2, 1).await;
    assert_eq!(s2.exit_code().await, Some(3));
    // 3. The shim killed mid-call.
    let (t3, tok3) = p.open("alice", &[]).await;
    let mut s3 = p.shim(&tok3);
    s3.initialize("2025-06-18").await;
    call(&mut s3, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    s3.child.start_kill().expect("kill shim");
    // 4. The harness closes stdin mid-call.
    let (t4, tok4) = p.open("alice", &[]).await;
    let mut s4 = p.shim(&tok4);
    s4.initialize("2025-06-18").await;
    call(&mut s4, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut child = s4.close_stdin().await;
    let _ = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the shim exits after stdin closes");

    let outcome_of = |turn: &str| {
        p.lines()
            .into_iter()
            .find(|l| l["kind"] == "call" && l["turn"] == turn)
            .map(|l| {
                format!(
                    "{}/{}",
                    l["outcome"].as_str().unwrap_or(""),
                    l["code"].as_str().unwrap_or("")
                )
            })
    };
    let (t1c, t2c, t3c, t4c) = (t1.clone(), t2.clone(), t3.clone(), t4.clone());
    eventually("all four calls recorded", || {
        [&t1c, &t2c, &t3c, &t4c]
            .iter()
            .all(|t| outcome_of(t).is_some())
    })
    .await;
    assert_eq!(outcome_of(&t1).as_deref(), Some("cancelled/turn_closed"));
    assert_eq!(outcome_of(&t2).as_deref(), Some("cancelled/turn_closed"));
    assert_eq!(outcome_of(&t3).as_deref(), Some("cancelled/disconnected"));
    // Closing stdin lets the shim finish in-flight calls (up to 5 s), so the call may complete.
    assert!(
        matches!(
            outcome_of(&t4).as_deref(),
            Some("succeeded/ok") | Some("cancelled/disconnected")
        ),
        "{:?}",
        outcome_of(&t4)
    );
    let ttl_closed = p
        .lines()
        .into_iter()
        .any(|l| l["kind"] == "turn_closed" && l["turn"] == t2.as_str() && l["reason"] == "ttl");
    assert!(ttl_closed);
    // Nothing leaked: the broker's descriptors return to the baseline; it has no children.
    eventually("file descriptors back to the baseline", || {
        fd_count(pid) <= baseline
    })
    .await;
    assert_eq!(children(pid), 0);
}

fn write_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).expect("script");
    path
}

/// An upstream that prints garbage, and one that never answers: `serve` refuses to start with
/// an error naming the provider, within its startup limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_upstreams_stop_serve_with_an_error_naming_the_provider() {
    let p = Proc::new(&Options::default());
    // The scripts in a folder of their own: a sandbox rule on the config's folder would reach
    // the broker's files and be refused at load (issue 42).
    let scripts = p.dir.path().join("scripts");
    std::fs::create_dir_all(&scripts).expect("mkdir");
    let garbage = write_script(
        &scripts,
        "garbage.py",
        "import sys\nprint('this is not JSON-RPC', flush=True)\nsys.stdin.read()\n",
    );
    let hang = write_script(&scripts, "hang.py", "import sys, time\nsys.stdin.read()\n");
    for (ns, script) in [("garbage", &garbage), ("hang", &hang)] {
        let cfg = std::fs::read_to_string(&p.cfg).expect("cfg");
        let extra = format!(
            "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{ns}\"\ncommand = \"python3\"\nargs = [{}]\nstartup_timeout_seconds = 2\n\
             [providers.sandbox]\nread = [{}]\n",
            serde_json::to_string(&script.display().to_string()).expect("q"),
            serde_json::to_string(&scripts.display().to_string()).expect("q")
        );
        let path = p.dir.path().join(format!("{ns}.toml"));
        std::fs::write(&path, format!("{cfg}{extra}")).expect("w");
        // Relative paths in the copied config resolve against its own folder (the same one).
        let mut serve = std::process::Command::new(bin("sharedos-broker"));
        serve
            .args(["serve", "--runtime-dir"])
            .arg(p.dir.path().join(format!("run-{ns}")))
            .arg("--config")
            .arg(&path);
        let started = std::time::Instant::now();
        let (code, _, err) = run(serve).await;
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(&format!("provider `{ns}`")), "{err}");
        assert!(!err.contains("would expose"), "{err}");
        assert!(err.contains("the sandbox was on"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(15));
    }
}

/// Rotation under a watcher in another process: a file is under the record's name at every
/// moment (a separate `sh` stats it in a loop, as a log shipper would, while the record rotates
/// every 4 KiB), a second broker is refused after rotations (the new file is locked too), and
/// the rotated files and the record verify as one chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_leaves_no_gap_and_keeps_the_lock() {
    let p = Proc::new(&Options::default());
    let cfg = std::fs::read_to_string(&p.cfg).expect("cfg");
    std::fs::write(&p.cfg, format!("record_rotate_bytes = 4096\n{cfg}")).expect("cfg");
    let mut broker = p.serve().await;
    let record = p.record();
    // The watcher: stats the record's name as fast as it can; prints one line per miss, and
    // its count of looks when it is stopped.
    let script = r#"looks=0; trap 'echo "looks $looks"; exit 0' TERM
while :; do [ -e "$1" ] || echo miss; looks=$((looks+1)); done"#;
    let watcher = tokio::process::Command::new("sh")
        .args(["-c", script, "watcher"])
        .arg(&record)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("watcher");
    let (turn, token) = p.open("alice", &[]).await;
    let mut raw = p.shim(&token);
    raw.initialize("2025-06-18").await;
    for id in 1..=300 {
        let r = raw
            .call(id, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    }
    let files = sharedos_broker::evidence::record::record_files(&record).expect("files");
    assert!(
        files.len() > 20,
        "the record rotated often: {} files",
        files.len()
    );
    // A second broker on the same record, after the rotations: refused, naming the holder.
    let mut second = std::process::Command::new(bin("sharedos-broker"));
    second
        .args(["serve", "--runtime-dir"])
        .arg(p.dir.path().join("run2"))
        .arg("--config")
        .arg(&p.cfg);
    let (code, _, err) = run(second).await;
    assert_ne!(code, 0, "a second broker started on a rotated record");
    assert!(
        err.contains(&format!("pid {}", broker.id().expect("pid"))),
        "{err}"
    );
    let watcher_pid = watcher.id().expect("pid");
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &watcher_pid.to_string()])
        .status();
    let out = tokio::time::timeout(Duration::from_secs(10), watcher.wait_with_output())
        .await
        .expect("watcher stops")
        .expect("watcher output");
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let looks: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("looks "))
        .and_then(|n| n.parse().ok())
        .expect("the watcher's count");
    assert!(looks > 1000, "the watcher looked {looks} times");
    assert_eq!(
        out.matches("miss").count(),
        0,
        "the record's name was missing: {out}"
    );
    drop(raw.close_stdin().await);
    let lines = p.lines();
    assert_eq!(
        lines
            .iter()
            .filter(|l| l["kind"] == "call" && l["turn"] == turn.as_str())
            .count(),
        300
    );
    let _ = broker.kill().await;
    let (code, out) = p.verify().await;
    assert_eq!(code, 0, "{out}");
}
