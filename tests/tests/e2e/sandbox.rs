//! Issue 32: brokered upstreams run sandboxed. A real broker (`sharedos-broker serve`, with a
//! canary variable in its own environment) starts `tests/python/hostile_upstream.py`, whose
//! tools try every escape and report what happened; each wall is asserted from that report, the
//! record and `providers`.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::kit::{Raw, bin, eventually, meta, run, text};

const CANARY: &str = "SHAREDOS_TEST_CANARY";

const POLICY: &str = r#"
@id("alice-tools")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call",
       resource is SharedOS::Tool);
@id("bob-tools")
permit(principal == SharedOS::User::"bob", action == SharedOS::Action::"call",
       resource is SharedOS::Tool);
"#;

fn q(s: &str) -> String {
    serde_json::to_string(s).expect("quote")
}

fn script() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/python/hostile_upstream.py")
}

fn python_dir() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/python")
}

/// A hostile provider entry; `sandbox` is the rest of its `[providers.sandbox]` table (or a
/// `sandbox = "none"` line when it starts with `sandbox`).
fn hostile(ns: &str, sandbox: &str) -> String {
    let head = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{ns}\"\ncommand = \"python3\"\nargs = [{}]\nenv = {{ DECLARED = \"yes\" }}\ncall_timeout_seconds = 20\n",
        q(script())
    );
    if sandbox.starts_with("sandbox") {
        format!("{head}{sandbox}\n")
    } else {
        format!(
            "{head}[providers.sandbox]\nread = [{}]\n{sandbox}\n",
            q(python_dir())
        )
    }
}

/// The same as [`hostile`], with `instances = "per_principal"`.
fn hostile_per_principal(ns: &str, sandbox: &str) -> String {
    hostile(ns, sandbox).replacen(
        "call_timeout_seconds = 20\n",
        "call_timeout_seconds = 20\ninstances = \"per_principal\"\n",
        1,
    )
}

/// A broker served from its own binary, on a config in a temp dir, with a canary variable in
/// its environment.
struct Served {
    dir: tempfile::TempDir,
    run: PathBuf,
    child: tokio::process::Child,
    stderr: PathBuf,
    /// The broker's uid when the test made it another one.
    uid: Option<u32>,
}

fn write_config(dir: &Path, top: &str, providers: &str) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("private")).expect("mkdir");
    std::fs::create_dir_all(data.join("public")).expect("mkdir");
    std::fs::create_dir_all(dir.join("rw")).expect("mkdir");
    std::fs::write(data.join("private/secret.txt"), "the secret\n").expect("w");
    std::fs::write(data.join("public/hello.txt"), "hello\n").expect("w");
    std::fs::write(dir.join("policy.cedar"), POLICY).expect("w");
    let cfg = dir.join("broker.toml");
    std::fs::write(
        &cfg,
        format!(
            "record = \"record.jsonl\"\nrecord_sync = \"always\"\npolicy = \"policy.cedar\"\n{top}\
             [[providers]]\ntype = \"files\"\nnamespace = \"files\"\nroot = \"data\"\n{providers}"
        ),
    )
    .expect("w");
    cfg
}

impl Served {
    fn spawn(dir: tempfile::TempDir, cfg: &Path) -> Self {
        Self::spawn_as(dir, cfg, None)
    }

    /// `uid`: the broker runs under it (by `setpriv`, from a copy of its binary other uids can
    /// reach), its folder that uid's.
    fn spawn_as(dir: tempfile::TempDir, cfg: &Path, uid: Option<u32>) -> Self {
        let run = dir.path().join("run");
        let stderr = dir.path().join("broker.stderr");
        let mut serve = match uid {
            None => tokio::process::Command::new(bin("sharedos-broker")),
            Some(uid) => {
                let (_, broker) = crate::deploy::public_bins(dir.path());
                let mut chown = std::process::Command::new("chown");
                chown.arg("-R").arg(format!("{uid}:{uid}")).arg(dir.path());
                assert!(chown.status().expect("chown").success());
                crate::deploy::as_uid(uid, uid, &broker)
            }
        };
        serve
            .args(["serve", "--runtime-dir"])
            .arg(&run)
            .arg("--config")
            .arg(cfg)
            .env(CANARY, "the-broker-only-canary")
            .kill_on_drop(true)
            .stderr(std::fs::File::create(&stderr).expect("stderr"));
        let child = serve.spawn().expect("serve");
        Self {
            dir,
            run,
            child,
            stderr,
            uid,
        }
    }

    async fn start(top: &str, providers: &str) -> Self {
        Self::start_as(top, providers, None).await
    }

    async fn start_as(top: &str, providers: &str, uid: Option<u32>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-sandbox-")
            .tempdir()
            .expect("tmp");
        let cfg = write_config(dir.path(), top, providers);
        let s = Self::spawn_as(dir, &cfg, uid);
        let record = s.path("record.jsonl");
        let control = s.run.join("control.sock");
        eventually("the broker serves", || {
            control.exists()
                && std::fs::read_to_string(&record)
                    .unwrap_or_default()
                    .contains("\"kind\":\"broker_started\"")
        })
        .await;
        s
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn cli(&self, args: &[&str]) -> std::process::Command {
        let mut c = std::process::Command::new(bin("sharedos-broker"));
        c.args(args).arg("--runtime-dir").arg(&self.run);
        if let Some(uid) = self.uid {
            c.env("SHAREDOS_BROKER_UID", uid.to_string());
        }
        c
    }

    async fn raw(&self) -> Raw {
        self.raw_as("alice").await
    }

    async fn raw_as(&self, principal: &str) -> Raw {
        let (code, out, err) =
            run(self.cli(&["turn", "open", "--principal", principal, "--json"])).await;
        assert_eq!(code, 0, "turn open: {err}");
        let opened: Value = serde_json::from_str(&out).expect("json");
        let mut shim = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        shim.env(
            "SHAREDOS_TURN_TOKEN",
            opened["token"].as_str().expect("token"),
        )
        .env("SHAREDOS_BROKER", self.run.join("bridge.sock"))
        .kill_on_drop(true);
        if let Some(uid) = self.uid {
            shim.env("SHAREDOS_BROKER_UID", uid.to_string());
        }
        let mut raw = Raw::spawn(shim);
        raw.initialize("2025-06-18").await;
        raw
    }

    async fn providers(&self) -> Vec<Value> {
        let (code, out, err) = run(self.cli(&["providers", "--json"])).await;
        assert_eq!(code, 0, "providers: {err}");
        serde_json::from_str(&out).expect("json")
    }

    fn records(&self) -> Vec<Value> {
        std::fs::read_to_string(self.path("record.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn provider_states(&self, ns: &str) -> Vec<Value> {
        self.records()
            .into_iter()
            .filter(|r| r["kind"] == "provider_state" && r["provider"] == ns)
            .collect()
    }
}

/// The escape report of one call (its text result, parsed).
async fn escape(raw: &mut Raw, id: i64, tool: &str, args: Value) -> Value {
    let whole = raw.call(id, tool, args).await;
    let r = whole["result"].clone();
    assert_eq!(meta(&r)["outcome"], "succeeded", "{whole}");
    serde_json::from_str(&text(&r)).expect("report")
}

/// Refused by the sandbox: Landlock's `PermissionError`, `FileNotFoundError` where the path is
/// not in its mount namespace at all (only its rules' paths are), or a read-only file system
/// (a folder on the way to a rule's path, in its read-only root).
fn denied(report: &Value, kind: &str, key: &str) {
    let got = report[kind][key].as_str().unwrap_or("(missing)");
    assert!(
        got.starts_with("error: PermissionError")
            || got.starts_with("error: FileNotFoundError")
            || got.starts_with("error: OSError: [Errno 30] Read-only file system"),
        "{kind} {key} must be refused by the sandbox, got: {got}"
    );
}

/// Not in its view at all (its mount namespace holds only its rules' paths).
fn unseen(report: &Value, kind: &str, key: &str) {
    let got = report[kind][key].as_str().unwrap_or("(missing)");
    assert!(
        got.starts_with("error: FileNotFoundError"),
        "{kind} {key} must not be in the upstream's view, got: {got}"
    );
}

/// Makes `path` the upstream's (its `sandbox.uid`, as `providers` shows it) when the broker is
/// root and gave it a uid of its own: a write rule's folder, as an operator would.
async fn give_to_upstream(b: &Served, ns: &str, path: &Path) {
    let list = b.providers().await;
    let p = list.iter().find(|p| p["namespace"] == ns).expect(ns);
    if p["sandbox"]["ownUid"] == true {
        let uid = p["sandbox"]["uid"].as_u64().expect("uid") as u32;
        std::os::unix::fs::chown(path, Some(uid), Some(uid)).expect("chown");
    }
}

fn allowed(report: &Value, kind: &str, key: &str) {
    let got = report[kind][key].as_str().unwrap_or("(missing)");
    assert!(
        got.starts_with("ok: "),
        "{kind} {key} must work, got: {got}"
    );
}

/// A Unix socket of the broker: unreachable, or the broker refuses this peer at its first word.
fn refused_socket(report: &Value, sock: &str) {
    let got = report["unix"][sock].as_str().unwrap_or("(missing)");
    if got.starts_with("error: ") {
        return;
    }
    let frames: Vec<String> = serde_json::from_str(got.trim_start_matches("ok: ")).expect("frames");
    assert!(
        frames[0].contains("forbidden")
            || frames[0].contains("may not")
            || frames[0].contains("\"type\":\"refused\"")
            || frames[0] == "(closed)",
        "{sock}: the broker must refuse an upstream, it answered: {frames:?}"
    );
    assert!(
        !frames[1].contains("\"turns\""),
        "{sock}: the broker listed its turns to an upstream: {frames:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_upstream_stays_in_its_sandbox() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let other = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let other_port = other.local_addr().expect("addr").port();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    udp.set_nonblocking(true).expect("nonblocking");
    let udp_port = udp.local_addr().expect("addr").port();
    let providers = format!(
        "{}{}",
        hostile("up", "memory_mb = 256\nwrite = [\"rw\"]"),
        hostile("net", &format!("network = [\"127.0.0.1:{port}\"]")),
    );
    let b = Served::start("", &providers).await;
    give_to_upstream(&b, "up", &b.path("rw")).await;
    let dir = b.dir.path().display().to_string();
    let mut raw = b.raw().await;
    let broker_pid = b.child.id().expect("pid");
    let r = escape(
        &mut raw,
        1,
        "up.escape",
        json!({
            "read": [
                format!("{dir}/record.jsonl"), format!("{dir}/record.jsonl.key"),
                format!("{dir}/policy.cedar"), format!("{dir}/broker.toml"),
                format!("{dir}/data/private/secret.txt"), format!("{dir}/data/public/hello.txt"),
                "/etc/shadow", format!("/proc/{broker_pid}/environ"), script(),
            ],
            "write": [format!("{dir}/rw"), dir.clone(), "/tmp".to_owned()],
            "unix": [format!("{dir}/run/control.sock"), format!("{dir}/run/bridge.sock")],
            "escaped_unix": [format!("{dir}/run/control.sock"), format!("{dir}/run/bridge.sock")],
            "tcp": [["127.0.0.1", port]],
            "udp": [["127.0.0.1", udp_port]],
            "signal": [broker_pid],
        }),
    )
    .await;
    eprintln!(
        "escape report: unix {} tcp {} signal {} limits {}",
        r["unix"], r["tcp"], r["signal"], r["limits"]
    );
    for f in [
        "record.jsonl",
        "record.jsonl.key",
        "policy.cedar",
        "broker.toml",
        "data/private/secret.txt",
        "data/public/hello.txt",
    ] {
        denied(&r, "read", &format!("{dir}/{f}"));
    }
    denied(&r, "read", "/etc/shadow");
    denied(&r, "read", &format!("/proc/{broker_pid}/environ"));
    allowed(&r, "read", script());
    allowed(&r, "write", &format!("{dir}/rw"));
    assert_eq!(
        std::fs::read_dir(b.path("rw")).expect("rw").count(),
        1,
        "its one file, in its rw folder"
    );
    denied(&r, "write", &dir);
    denied(&r, "write", "/tmp");
    refused_socket(&r, &format!("{dir}/run/control.sock"));
    refused_socket(&r, &format!("{dir}/run/bridge.sock"));
    // Not even there: the runtime dir is not in its mount namespace.
    unseen(&r, "unix", &format!("{dir}/run/control.sock"));
    unseen(&r, "unix", &format!("{dir}/run/bridge.sock"));
    // The same from a grandchild that left its lineage (own session, re-parented): the lineage
    // rule no longer knows it (and under the broker's uid the uid rule would admit it), but the
    // sockets are not in the mount namespace it inherited and cannot leave.
    for sock in ["control.sock", "bridge.sock"] {
        let path = format!("{dir}/run/{sock}");
        let e = &r["escaped_unix"][&path];
        assert_ne!(e["ppid"], r["pid"], "the grandchild was re-parented: {e}");
        assert_ne!(
            e["sid"], r["sid"],
            "the grandchild has a session of its own: {e}"
        );
        let nested = json!({ "unix": { path.clone(): e["answer"].clone() } });
        refused_socket(&nested, &path);
        unseen(&nested, "unix", &path);
    }
    let keyless = b
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "control_refused")
        .count();
    assert_eq!(keyless, 0, "no hello of the grandchild reached the broker");
    let tcp = r["tcp"][format!("127.0.0.1:{port}")].as_str().unwrap_or("");
    assert!(tcp.starts_with("error: "), "network off: {tcp}");
    let sent = r["udp"][format!("127.0.0.1:{udp_port}")]
        .as_str()
        .unwrap_or("(missing)");
    assert!(sent.starts_with("error: "), "network off: {sent}");
    assert_eq!(datagrams(&udp), 0, "no datagram left its namespace");
    let sig = r["signal"][broker_pid.to_string()].as_str().unwrap_or("");
    assert!(sig.starts_with("error: "), "signals the broker: {sig}");
    // Exactly the declared variable and the minimal three: nothing of the broker's.
    let mut env: Vec<&str> = r["env"]
        .as_object()
        .expect("env")
        .keys()
        .map(String::as_str)
        .collect();
    env.sort_unstable();
    assert_eq!(env, ["DECLARED", "HOME", "LANG", "PATH"], "{}", r["env"]);
    assert!(!r["env"].to_string().contains("canary"));
    assert_eq!(r["limits"]["RLIMIT_DATA"], json!([268435456, 268435456]));
    assert_eq!(r["limits"]["RLIMIT_NOFILE"], json!([1024, 1024]));
    // Its own process group and session.
    let first_pid = r["pid"].clone();
    assert_eq!(r["pgid"], r["pid"]);
    assert_eq!(r["sid"], r["pid"]);

    // The port allowlist: that port, not another.
    let r = escape(
        &mut raw,
        2,
        "net.escape",
        json!({"tcp": [["127.0.0.1", port], ["127.0.0.1", other_port]]}),
    )
    .await;
    assert_eq!(
        r["tcp"][format!("127.0.0.1:{port}")],
        "ok: connected",
        "{r}"
    );
    let o = r["tcp"][format!("127.0.0.1:{other_port}")]
        .as_str()
        .unwrap_or("");
    assert!(o.starts_with("error: PermissionError"), "{o}");

    // Memory: an allocation past the limit fails, well below the host's memory.
    let r = escape(&mut raw, 3, "up.hog", json!({"mode": "memory_report"})).await;
    let mib = r["mib_before_memory_error"].as_u64().expect("mib");
    eprintln!("memory: MemoryError after {mib} MiB (limit 256 MiB)");
    assert!(
        (16..256).contains(&mib),
        "{mib} MiB before the limit of 256"
    );
    // A server that does not catch it dies of it: the call fails upstream_unavailable, the
    // broker lives on and restarts it.
    let r = raw.call(4, "up.hog", json!({"mode": "memory"})).await["result"].clone();
    assert_eq!(meta(&r)["outcome"], "failed", "{r}");
    assert_eq!(meta(&r)["code"], "upstream_unavailable", "{r}");
    let recorded = b.records().into_iter().any(|l| {
        l["kind"] == "call" && l["outcome"] == "failed" && l["code"] == "upstream_unavailable"
    });
    assert!(recorded, "the failed call is recorded upstream_unavailable");
    eventually("the upstream is restarted", || {
        b.provider_states("up")
            .iter()
            .any(|l| l["state"] == "restarting")
    })
    .await;
    let mut back = false;
    for _ in 0..80 {
        let list = b.providers().await;
        let up = list.iter().find(|p| p["namespace"] == "up").expect("up");
        if up["state"] == "ready" && up["restarts"].as_u64() >= Some(1) {
            back = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert!(back, "the broker lives on and restarts the upstream");
    let mut raw = b.raw().await;
    let r = escape(&mut raw, 10, "up.escape", json!({})).await;
    assert_ne!(r["pid"], first_pid, "a new process");
    // Shown and recorded.
    let list = b.providers().await;
    let up = list.iter().find(|p| p["namespace"] == "up").expect("up");
    assert_eq!(up["sandbox"]["network"], "off", "{up}");
    assert_eq!(up["sandbox"]["memoryBytes"], 268435456);
    assert!(
        up["sandbox"]["write"]
            .as_array()
            .expect("write")
            .iter()
            .any(|w| w.as_str().is_some_and(|w| w.ends_with("/rw")))
    );
    let states = b.provider_states("up");
    assert!(states.len() >= 3, "ready, restarting, ready: {states:?}");
    for s in &states {
        assert_eq!(s["sandbox"]["memoryBytes"], 268435456, "{s}");
    }
    let (code, out, _) = run(b.cli(&["providers"])).await;
    assert_eq!(code, 0);
    assert!(out.contains("sandbox: uid"), "{out}");
    assert!(out.contains("memory 256 MiB"), "{out}");
    drop(listener);
    drop(other);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_none_is_shown_and_recorded_and_really_is_none() {
    let b = Served::start("", &hostile("bare", "sandbox = \"none\"")).await;
    let list = b.providers().await;
    let p = list
        .iter()
        .find(|p| p["namespace"] == "bare")
        .expect("bare");
    assert_eq!(p["sandbox"], "none");
    let states = b.provider_states("bare");
    assert!(!states.is_empty());
    assert!(states.iter().all(|s| s["sandbox"] == "none"), "{states:?}");
    let (code, out, _) = run(b.cli(&["providers"])).await;
    assert_eq!(code, 0);
    assert!(out.contains("sandbox: none"), "{out}");
    // Without a sandbox it has the broker's environment: the canary shows the difference.
    let mut raw = b.raw().await;
    let r = escape(&mut raw, 1, "bare.escape", json!({})).await;
    assert_eq!(r["env"][CANARY], "the-broker-only-canary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_the_kernel_cannot_give_refuses_the_provider() {
    let dir = tempfile::Builder::new()
        .prefix("sharedos-sandbox-")
        .tempdir()
        .expect("tmp");
    let cfg = write_config(dir.path(), "", &hostile("old", "min_landlock_abi = 99"));
    let mut s = Served::spawn(dir, &cfg);
    let status = tokio::time::timeout(crate::kit::WAIT, s.child.wait())
        .await
        .expect("the broker stops")
        .expect("wait");
    assert!(!status.success());
    let err = std::fs::read_to_string(&s.stderr).expect("stderr");
    assert!(
        err.contains("provider `old`: the sandbox cannot be applied: it needs Landlock ABI 99"),
        "{err}"
    );
    assert!(
        err.contains("sandbox = \\\"none\\\"") || err.contains("sandbox = \"none\""),
        "{err}"
    );
    let states = s.provider_states("old");
    assert_eq!(states.len(), 1, "{states:?}");
    assert_eq!(states[0]["state"], "failed");
    assert!(
        states[0]["sandbox"]["unavailable"]
            .as_str()
            .is_some_and(|e| e.contains("Landlock ABI 99")),
        "{states:?}"
    );
}

/// As root: the upstream runs under its own uid and gid (no other group), a process limit
/// stops its fork loop, and a `run_as` inside `host_uids` is refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (CI runs --include-ignored as root): the upstream gets a uid of its own"]
async fn as_root_the_upstream_has_a_uid_of_its_own() {
    if !crate::deploy::need_root("as_root_the_upstream_has_a_uid_of_its_own") {
        return;
    }
    let b = Served::start(
        "",
        &hostile(
            "own",
            "run_as = \"64210:64211\"\nprocesses = 20\nwrite = [\"rw\"]",
        ),
    )
    .await;
    let dir = b.dir.path().display().to_string();
    let mut raw = b.raw().await;
    let r = escape(
        &mut raw,
        1,
        "own.escape",
        json!({
            "read": ["/etc/shadow", format!("{dir}/record.jsonl.key")],
            "unix": [format!("{dir}/run/control.sock")],
        }),
    )
    .await;
    assert_eq!(r["uid"], 64210, "{r}");
    assert_eq!(r["euid"], 64210);
    assert_eq!(r["gid"], 64211);
    assert_eq!(r["groups"], json!([64211]));
    denied(&r, "read", "/etc/shadow");
    denied(&r, "read", &format!("{dir}/record.jsonl.key"));
    refused_socket(&r, &format!("{dir}/run/control.sock"));
    let r = escape(&mut raw, 2, "own.hog", json!({"mode": "fork"})).await;
    let forked = r["forked"].as_u64().expect("forked");
    eprintln!("fork loop: {forked} children, then {}", r["error"]);
    assert!(forked < 20, "the process limit stops the fork loop: {r}");
    assert!(
        r["error"]
            .as_str()
            .is_some_and(|e| e.contains("BlockingIOError")),
        "{r}"
    );
    let list = b.providers().await;
    let p = list.iter().find(|p| p["namespace"] == "own").expect("own");
    assert_eq!(p["sandbox"]["uid"], 64210);
    assert_eq!(p["sandbox"]["ownUid"], true);
    assert_eq!(p["sandbox"]["processes"], 20);

    // A uid the control socket admits is never an upstream's.
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = write_config(
        dir.path(),
        "host_uids = [0, 64212]\n",
        &hostile("host", "run_as = \"64212\""),
    );
    let err = sharedos_broker::Config::from_file(&cfg)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("uid 64212 is in host_uids"), "{err}");
    // The same when the uid comes from the range.
    let cfg = write_config(
        dir.path(),
        "host_uids = [0, 64212]\nupstream_uids = [64212, 64212]\n",
        &hostile("host", ""),
    );
    let err = sharedos_broker::Config::from_file(&cfg)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("uid 64212 is in host_uids"), "{err}");

    // Uids from the range, in config order, skipping one a provider names itself.
    let b = Served::start(
        "upstream_uids = [64230, 64239]\n",
        &format!(
            "{}{}",
            hostile("named", "run_as = \"64230\""),
            hostile("ranged", "")
        ),
    )
    .await;
    let mut raw = b.raw().await;
    let named = escape(&mut raw, 1, "named.escape", json!({})).await;
    let ranged = escape(&mut raw, 2, "ranged.escape", json!({})).await;
    assert_eq!(named["uid"], 64230);
    assert_eq!(ranged["uid"], 64231, "{ranged}");
    assert_eq!(ranged["gid"], 64231);
}

/// Datagrams waiting on `socket` (non-blocking), counted and drained.
fn datagrams(socket: &std::net::UdpSocket) -> usize {
    let mut buf = [0u8; 512];
    let mut n = 0;
    while socket.recv(&mut buf).is_ok() {
        n += 1;
    }
    n
}

/// TCP connections waiting on `listener` (non-blocking), counted and accepted.
fn connections(listener: &std::net::TcpListener) -> usize {
    let mut n = 0;
    while listener.accept().is_ok() {
        n += 1;
    }
    n
}

/// A broker that is not root (uid 64220, started by root for the test): no uid change, but with
/// `network = false` a user namespace and a network namespace of its own (only a loopback, down),
/// so neither TCP nor UDP leaves it; Landlock, the limits and the clean environment hold, and the
/// sockets refuse the upstream although its uid is the broker's own and is listed in `host_uids`
/// and `harness_uids`. With `network = true` it reaches the test's listeners; with a port list,
/// TCP to that port only, and UDP is not walled (Landlock rules TCP only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to start the broker under another uid (CI runs --include-ignored as root)"]
async fn without_root_landlock_and_the_sockets_still_hold() {
    if !crate::deploy::need_root("without_root_landlock_and_the_sockets_still_hold") {
        return;
    }
    const UID: u32 = 64220;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    udp.set_nonblocking(true).expect("nonblocking");
    let udp_port = udp.local_addr().expect("addr").port();
    let b = Served::start_as(
        &format!("host_uids = [0, {UID}]\nharness_uids = [0, {UID}]\n"),
        &format!(
            "{}{}{}{}",
            hostile("up", ""),
            hostile("open", "network = true"),
            hostile("ports", &format!("network = [\"127.0.0.1:{port}\"]")),
            hostile_per_principal("pp", ""),
        ),
        Some(UID),
    )
    .await;
    let dir = b.dir.path().display().to_string();
    let mut raw = b.raw().await;
    let r = escape(
        &mut raw,
        1,
        "up.escape",
        json!({
            "read": [format!("{dir}/record.jsonl.key"), format!("{dir}/broker.toml"),
                     format!("{dir}/data/private/secret.txt")],
            "write": [dir.clone()],
            "unix": [format!("{dir}/run/control.sock"), format!("{dir}/run/bridge.sock")],
            "tcp": [["127.0.0.1", port]],
            "udp": [["127.0.0.1", udp_port]],
        }),
    )
    .await;
    eprintln!("network off, not root: tcp {} udp {}", r["tcp"], r["udp"]);
    assert_eq!(r["uid"], UID, "the broker's own uid, mapped to itself: {r}");
    assert_eq!(r["gid"], UID, "{r}");
    for f in ["record.jsonl.key", "broker.toml", "data/private/secret.txt"] {
        denied(&r, "read", &format!("{dir}/{f}"));
    }
    denied(&r, "write", &dir);
    for sock in ["control.sock", "bridge.sock"] {
        // Same uid, and Landlock before ABI 9 does not rule connecting to a named socket: the
        // mount namespace does (the runtime dir is not in it).
        unseen(&r, "unix", &format!("{dir}/run/{sock}"));
        refused_socket(&r, &format!("{dir}/run/{sock}"));
    }
    // TCP: Landlock refuses the connect before the (down) loopback is reached.
    let tcp = r["tcp"][format!("127.0.0.1:{port}")].as_str().unwrap_or("");
    assert!(
        tcp.starts_with("error: PermissionError"),
        "landlock's TCP rule: {tcp}"
    );
    // UDP: Landlock does not rule it; its own network namespace has no way out.
    let sent = r["udp"][format!("127.0.0.1:{udp_port}")]
        .as_str()
        .unwrap_or("(missing)");
    assert!(
        sent.starts_with("error: OSError") && sent.contains("unreachable"),
        "network off: a datagram must not leave its namespace: {sent}"
    );
    assert_eq!(datagrams(&udp), 0, "no datagram reached the test's socket");
    assert_eq!(connections(&listener), 0, "no connection reached the test");
    let mut env: Vec<&str> = r["env"]
        .as_object()
        .expect("env")
        .keys()
        .map(String::as_str)
        .collect();
    env.sort_unstable();
    assert_eq!(env, ["DECLARED", "HOME", "LANG", "PATH"]);

    // The network allowed: both reach the test, once each.
    let r = escape(
        &mut raw,
        2,
        "open.escape",
        json!({"tcp": [["127.0.0.1", port]], "udp": [["127.0.0.1", udp_port]]}),
    )
    .await;
    assert_eq!(
        r["tcp"][format!("127.0.0.1:{port}")],
        "ok: connected",
        "{r}"
    );
    assert_eq!(
        r["udp"][format!("127.0.0.1:{udp_port}")],
        "ok: sent 16 bytes",
        "{r}"
    );
    assert_eq!(connections(&listener), 1);
    assert_eq!(datagrams(&udp), 1);
    // A port list: TCP to the listed port; UDP is not walled without root's namespace.
    let r = escape(
        &mut raw,
        3,
        "ports.escape",
        json!({"tcp": [["127.0.0.1", port]], "udp": [["127.0.0.1", udp_port]]}),
    )
    .await;
    assert_eq!(
        r["tcp"][format!("127.0.0.1:{port}")],
        "ok: connected",
        "{r}"
    );
    assert_eq!(
        r["udp"][format!("127.0.0.1:{udp_port}")],
        "ok: sent 16 bytes",
        "{r}"
    );
    assert_eq!(connections(&listener), 1);
    assert_eq!(datagrams(&udp), 1);

    let list = b.providers().await;
    let up = list.iter().find(|p| p["namespace"] == "up").expect("up");
    assert_eq!(up["sandbox"]["netns"], true, "{up}");
    assert_eq!(up["sandbox"]["userns"], true, "{up}");
    assert_eq!(up["sandbox"]["ownUid"], false);
    assert_eq!(up["sandbox"]["uid"], UID);
    for ns in ["open", "ports"] {
        let p = list.iter().find(|p| p["namespace"] == ns).expect(ns);
        assert_eq!(p["sandbox"]["netns"], false, "{p}");
        // The user namespace its mount and IPC namespaces are made in.
        assert_eq!(p["sandbox"]["userns"], true, "{p}");
        assert_eq!(p["sandbox"]["mountNs"], true, "{p}");
    }
    // Per-principal instances: without root, the provider's uid and sandbox, said so.
    let pp = list.iter().find(|p| p["namespace"] == "pp").expect("pp");
    assert!(
        pp["sandbox"]["instanceUids"]["shared"]["why"]
            .as_str()
            .is_some_and(|w| w.contains("the broker is not root")),
        "{pp}"
    );
    let r = escape(&mut raw, 4, "pp.escape", json!({})).await;
    assert_eq!(r["uid"], UID, "{r}");
    let states = b.provider_states("up");
    assert!(!states.is_empty());
    assert!(
        states.iter().all(|s| s["sandbox"]["userns"] == true),
        "{states:?}"
    );
    let (code, out, _) = run(b.cli(&["providers"])).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("network off (own network namespace, in its own user namespace)"),
        "{out}"
    );
    assert!(
        out.contains("instances: the provider's uid and sandbox (the broker is not root"),
        "{out}"
    );
}

/// As root, each principal's instance of a `per_principal` provider runs under a uid (= gid) of
/// its own from `instance_uids`: alice's and bob's differ, neither is the broker's (0) nor the
/// provider's shared uid (`run_as`), bob's is the same after his instance is killed and
/// restarted, and alice's instance cannot read a file only bob's uid can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (CI runs --include-ignored as root): instances get uids of their own"]
async fn as_root_each_principals_instance_has_a_uid_of_its_own() {
    use std::os::unix::fs::PermissionsExt as _;
    if !crate::deploy::need_root("as_root_each_principals_instance_has_a_uid_of_its_own") {
        return;
    }
    const SHARED: u32 = 64250;
    // A folder every uid may enter (the broker's own temp dir is 0700), in the sandbox's `read`.
    let walled = tempfile::Builder::new()
        .prefix("sharedos-walled-")
        .tempdir()
        .expect("tmp");
    std::fs::set_permissions(walled.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bobs = walled.path().join("bob.txt");
    std::fs::write(&bobs, "bob's only\n").expect("w");
    let b = Served::start(
        "",
        &hostile_per_principal(
            "who",
            &format!("run_as = \"{SHARED}\"\ninstance_uids = [64251, 64259]"),
        )
        .replace(
            &format!("read = [{}]", q(python_dir())),
            &format!(
                "read = [{}, {}]",
                q(python_dir()),
                q(&walled.path().display().to_string())
            ),
        ),
    )
    .await;
    // Bob's instance first: its uid, then the file made his only.
    let mut bob = b.raw_as("bob").await;
    let first = escape(&mut bob, 1, "who.escape", json!({})).await;
    let bob_uid = first["uid"].as_u64().expect("uid") as u32;
    std::os::unix::fs::chown(&bobs, Some(bob_uid), Some(bob_uid)).expect("chown");
    std::fs::set_permissions(&bobs, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let path = bobs.display().to_string();
    let r = escape(&mut bob, 2, "who.escape", json!({"read": [path]})).await;
    assert_eq!(r["pid"], first["pid"], "the same instance: {r}");
    allowed(&r, "read", &path);
    let mut alice = b.raw_as("alice").await;
    let a = escape(&mut alice, 1, "who.escape", json!({"read": [path]})).await;
    denied(&a, "read", &path);
    let alice_uid = a["uid"].as_u64().expect("uid") as u32;
    eprintln!("instances: bob uid {bob_uid}, alice uid {alice_uid}, shared {SHARED}");
    assert_ne!(a["pid"], r["pid"], "two processes");
    assert_ne!(alice_uid, bob_uid);
    for (who, rep, uid) in [("alice", &a, alice_uid), ("bob", &r, bob_uid)] {
        assert!((64251..=64259).contains(&uid), "{who}: {uid}");
        assert_ne!(uid, 0, "{who}: not the broker's");
        assert_ne!(uid, SHARED, "{who}: not the shared instance's");
        assert_eq!(rep["euid"], uid, "{who}");
        assert_eq!(rep["gid"], uid, "{who}");
        assert_eq!(rep["groups"], json!([uid]), "{who}: no other group");
    }
    // Shown: the provider's own uid, the range, each running instance's uid.
    let list = b.providers().await;
    let p = list.iter().find(|p| p["namespace"] == "who").expect("who");
    assert_eq!(p["sandbox"]["uid"], SHARED, "{p}");
    assert_eq!(p["sandbox"]["instanceUids"]["own"]["first"], 64251, "{p}");
    let mut shown: Vec<(String, u64)> = p["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .map(|i| {
            (
                i["principal"].as_str().unwrap_or("").to_owned(),
                i["uid"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    shown.sort();
    assert_eq!(
        shown,
        [
            ("alice".to_owned(), u64::from(alice_uid)),
            ("bob".to_owned(), u64::from(bob_uid))
        ]
    );
    let (code, out, _) = run(b.cli(&["providers"])).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("instances: each principal's under a uid of its own"),
        "{out}"
    );
    assert!(
        out.contains(&format!("instance of bob: uid {bob_uid}")),
        "{out}"
    );
    // Recorded: one instance_started line per principal, with its instance's uid.
    let started: Vec<Value> = b
        .provider_states("who")
        .into_iter()
        .filter(|l| l["state"] == "instance_started")
        .collect();
    assert_eq!(started.len(), 2, "{started:?}");
    for (who, uid) in [("alice", alice_uid), ("bob", bob_uid)] {
        let l = started
            .iter()
            .find(|l| l["principal"] == who)
            .expect("started");
        assert_eq!(l["sandbox"]["uid"], uid, "{l}");
        assert_eq!(l["sandbox"]["ownUid"], true, "{l}");
    }
    // Bob's instance killed: his next instance has his uid again.
    let pid = r["pid"].as_i64().expect("pid") as i32;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill");
    let mut again = None;
    for id in 10..90 {
        let whole = bob.call(id, "who.escape", json!({})).await;
        let res = whole["result"].clone();
        if meta(&res)["outcome"] == "succeeded" {
            let rep: Value = serde_json::from_str(&text(&res)).expect("report");
            if rep["pid"] != r["pid"] {
                again = Some(rep);
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    let again = again.expect("bob's instance restarted");
    assert_eq!(
        again["uid"], bob_uid,
        "stable while the broker runs: {again}"
    );
    let started = b
        .provider_states("who")
        .into_iter()
        .filter(|l| l["state"] == "instance_started" && l["principal"] == "bob")
        .count();
    assert_eq!(started, 2, "bob's two instances");
}

/// An `instance_uids` range that would give an instance a host's, a harness's, root's or a
/// provider's own uid, or that overlaps another range, is refused at load, naming the setting.
#[test]
fn instance_uids_that_meet_another_uid_are_refused_at_load() {
    let dir = tempfile::tempdir().expect("tmp");
    let refused = |top: &str, sandbox: &str| {
        let cfg = write_config(dir.path(), top, &hostile_per_principal("who", sandbox));
        sharedos_broker::Config::from_file(&cfg)
            .expect_err("refused")
            .to_string()
    };
    let err = refused("host_uids = [64262]\ninstance_uids = [64260, 64269]\n", "");
    assert!(
        err.contains("instance_uids = [64260, 64269]: uid 64262 is in host_uids"),
        "{err}"
    );
    let err = refused("harness_uids = [64265]\n", "instance_uids = [64260, 64269]");
    assert!(
        err.contains(
            "provider `who`: [providers.sandbox] instance_uids = [64260, 64269]: uid 64265 is in harness_uids"
        ),
        "{err}"
    );
    let err = refused("", "run_as = \"64261\"\ninstance_uids = [64260, 64269]");
    assert!(err.contains("uid 64261 is provider `who`'s own"), "{err}");
    let err = refused(
        "instance_uids = [64268, 64270]\n",
        "instance_uids = [64260, 64269]",
    );
    assert!(
        err.contains("overlaps instance_uids = [64268, 64270]"),
        "{err}"
    );
    let err = refused("instance_uids = [0, 10]\n", "");
    assert!(err.contains("0 < first <= last"), "{err}");
    // A range for a shared provider is refused, and a good one loads.
    let cfg = write_config(
        dir.path(),
        "",
        &hostile("one", "instance_uids = [64260, 64269]"),
    );
    let err = sharedos_broker::Config::from_file(&cfg)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("instances = \"per_principal\""), "{err}");
    let cfg = write_config(
        dir.path(),
        "host_uids = [0]\ninstance_uids = [64270, 64279]\n",
        &hostile_per_principal("who", "instance_uids = [64260, 64269]"),
    );
    sharedos_broker::Config::from_file(&cfg).expect("loads");
}

/// A broker that is not root on a machine that gives it no user namespace (the test makes one
/// where `user.max_user_namespaces` is 0): a provider with `network = false` is refused at start,
/// naming what is missing, and recorded `failed` with the sandbox `unavailable`; with the network
/// allowed (no namespace needed) it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to start the broker under another uid in a user namespace (CI runs --include-ignored as root)"]
async fn without_root_and_without_user_namespaces_network_off_is_refused() {
    if !crate::deploy::need_root("without_root_and_without_user_namespaces_network_off_is_refused")
    {
        return;
    }
    const UID: u32 = 64221;
    let start = |sandbox: &'static str| async move {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-sandbox-")
            .tempdir()
            .expect("tmp");
        let cfg = write_config(dir.path(), "", &hostile("up", sandbox));
        let (_, broker) = crate::deploy::public_bins(dir.path());
        let mut chown = std::process::Command::new("chown");
        chown.arg("-R").arg(format!("{UID}:{UID}")).arg(dir.path());
        assert!(chown.status().expect("chown").success());
        let stderr = dir.path().join("broker.stderr");
        let mut serve = tokio::process::Command::new("python3");
        serve
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/python/no_userns.py"))
            .arg(&broker)
            .args(["serve", "--runtime-dir"])
            .arg(dir.path().join("run"))
            .arg("--config")
            .arg(&cfg)
            .env("AS", UID.to_string())
            .kill_on_drop(true)
            .stderr(std::fs::File::create(&stderr).expect("stderr"));
        (dir, serve.spawn().expect("serve"), stderr)
    };
    let (dir, mut child, stderr) = start("").await;
    let status = tokio::time::timeout(crate::kit::WAIT, child.wait())
        .await
        .expect("the broker stops")
        .expect("wait");
    assert!(!status.success());
    let err = std::fs::read_to_string(&stderr).expect("stderr");
    assert!(
        err.contains("provider `up`: the sandbox cannot be applied: network = false needs a network namespace of its own, and the sandbox shows the upstream only its rules' paths in a mount namespace of its own, which a broker that is not root (uid 64221) makes inside a user namespace, which this machine refuses"),
        "{err}"
    );
    assert!(
        err.contains("No space left on device"),
        "the kernel's reason: {err}"
    );
    let states: Vec<Value> = std::fs::read_to_string(dir.path().join("record.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "provider_state" && l["provider"] == "up")
        .collect();
    assert_eq!(states.len(), 1, "{states:?}");
    assert_eq!(states[0]["state"], "failed");
    assert!(
        states[0]["sandbox"]["unavailable"]
            .as_str()
            .is_some_and(|e| e.contains("user namespace")),
        "{states:?}"
    );
    // With the network allowed it still needs the mount namespace: refused the same way.
    let (_dir, mut child, stderr) = start("network = true").await;
    let status = tokio::time::timeout(crate::kit::WAIT, child.wait())
        .await
        .expect("the broker stops")
        .expect("wait");
    assert!(!status.success());
    let err = std::fs::read_to_string(&stderr).expect("stderr");
    assert!(
        err.contains("provider `up`: the sandbox cannot be applied: the sandbox shows the upstream only its rules' paths in a mount namespace of its own, which a broker that is not root (uid 64221) makes inside a user namespace, which this machine refuses"),
        "{err}"
    );
    // Without a sandbox (the operator's explicit choice) it starts.
    let (dir, mut child, stderr) = start("sandbox = \"none\"").await;
    let record = dir.path().join("record.jsonl");
    eventually("the broker serves", || {
        std::fs::read_to_string(&record)
            .unwrap_or_default()
            .contains("\"kind\":\"broker_started\"")
    })
    .await;
    assert!(
        child.try_wait().expect("wait").is_none(),
        "{}",
        std::fs::read_to_string(&stderr).unwrap_or_default()
    );
    child.kill().await.expect("kill");
}

/// SysV IPC canaries of the uid `uid` (the test's own when `None`): a `0600` shared-memory
/// segment and message queue made by `tests/python/sysv_canary.py`, which reports on exit what
/// they still hold.
struct SysvCanary {
    child: tokio::process::Child,
    /// `{"shm": [key, id], "msg": [key, id]}`.
    ids: Value,
    rest: tokio::task::JoinHandle<Vec<String>>,
}

impl SysvCanary {
    async fn make(uid: Option<u32>) -> Self {
        use tokio::io::AsyncBufReadExt as _;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/sysv_canary.py");
        let mut cmd = match uid {
            None => tokio::process::Command::new("python3"),
            Some(uid) => crate::deploy::as_uid(uid, uid, Path::new("/usr/bin/python3")),
        };
        cmd.arg(script)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("sysv canary");
        let out = child.stdout.take().expect("stdout");
        let mut lines = tokio::io::BufReader::new(out).lines();
        let first = tokio::time::timeout(crate::kit::WAIT, lines.next_line())
            .await
            .expect("the canary reports")
            .expect("read")
            .expect("a line");
        let ids: Value = serde_json::from_str(&first).expect("ids");
        let rest = tokio::spawn(async move {
            let mut all = Vec::new();
            while let Ok(Some(l)) = lines.next_line().await {
                all.push(l);
            }
            all
        });
        Self { child, ids, rest }
    }

    /// What the canaries still held when they were removed: `{"shm": text, "queued": n}`.
    async fn left(mut self) -> Value {
        drop(self.child.stdin.take());
        let lines = tokio::time::timeout(crate::kit::WAIT, self.rest)
            .await
            .expect("the canary ends")
            .expect("join");
        let _ = self.child.wait().await;
        serde_json::from_str(lines.last().expect("a report")).expect("json")
    }
}

/// A listening named Unix socket at `path`, owned by `uid` with `mode` (non-blocking: see
/// [`accepted`]).
fn canary_socket(path: &Path, uid: u32, mode: u32) -> std::os::unix::net::UnixListener {
    use std::os::unix::fs::PermissionsExt as _;
    let l = std::os::unix::net::UnixListener::bind(path).expect("bind");
    l.set_nonblocking(true).expect("nonblocking");
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).expect("chown");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    l
}

/// The connections waiting on `l`, counted and accepted.
fn accepted(l: &std::os::unix::net::UnixListener) -> usize {
    let mut n = 0;
    while l.accept().is_ok() {
        n += 1;
    }
    n
}

/// Issue 42 items 2 and 3, under a root broker (`broker_uid` `None`) or one under `broker_uid`:
/// a default-sandboxed upstream cannot reach a named Unix socket outside its write rules,
/// whatever its uid lets it open: a root-only `0600` socket and a world-connectable `0666` one
/// in a folder of `/run` (systemd's, docker's, the system bus's shape), and a `0600` socket of
/// the broker's uid in a `0700` folder (a session bus, ssh-agent, gpg-agent); one in its write
/// folder it reaches. The broker uid's SysV shared-memory segment and message queue (`0600`)
/// are not in its IPC namespace: not read, not drained. As root it runs under a uid of its own.
async fn walls_keep_sockets_and_sysv_ipc_out(broker_uid: Option<u32>) {
    use std::os::unix::fs::PermissionsExt as _;
    let owner = broker_uid.unwrap_or(0);
    let sysv = SysvCanary::make(broker_uid).await;
    // Root's sockets in a folder of /run.
    let run_dir = tempfile::Builder::new()
        .prefix("sharedos-canary-")
        .tempdir_in("/run")
        .expect("tmp in /run");
    std::fs::set_permissions(run_dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let root_only = run_dir.path().join("root-only.sock");
    let world = run_dir.path().join("world.sock");
    let root_only_l = canary_socket(&root_only, 0, 0o600);
    let world_l = canary_socket(&world, 0, 0o666);
    // The broker uid's socket in a 0700 folder of its own.
    let agent_dir = tempfile::Builder::new()
        .prefix("sharedos-agent-")
        .tempdir_in("/run")
        .expect("tmp in /run");
    std::os::unix::fs::chown(agent_dir.path(), Some(owner), Some(owner)).expect("chown");
    std::fs::set_permissions(agent_dir.path(), std::fs::Permissions::from_mode(0o700))
        .expect("chmod");
    let agent = agent_dir.path().join("agent.sock");
    let agent_l = canary_socket(&agent, owner, 0o600);
    // The test (root) drives a broker under another uid as a listed host and harness.
    let top = broker_uid
        .map(|u| format!("host_uids = [0, {u}]\nharness_uids = [0, {u}]\n"))
        .unwrap_or_default();
    let b = Served::start_as(&top, &hostile("up", "write = [\"rw\"]"), broker_uid).await;
    give_to_upstream(&b, "up", &b.path("rw")).await;
    // One in its write folder, which it may reach (0666: whatever uid it has).
    let mine = b.path("rw/mine.sock");
    let mine_l = canary_socket(&mine, owner, 0o666);
    let mut raw = b.raw().await;
    let paths: Vec<String> = [&root_only, &world, &agent, &mine]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let r = escape(
        &mut raw,
        1,
        "up.escape",
        json!({"connect": paths, "sysv": sysv.ids.clone()}),
    )
    .await;
    eprintln!(
        "uid {} connect {} sysv {}",
        r["uid"], r["connect"], r["sysv"]
    );
    for p in &paths[..3] {
        unseen(&r, "connect", p);
    }
    assert_eq!(r["connect"][&paths[3]], "ok: connected", "{r}");
    let got: Vec<usize> = [&root_only_l, &world_l, &agent_l, &mine_l]
        .into_iter()
        .map(accepted)
        .collect();
    assert_eq!(got, [0, 0, 0, 1], "connections each canary socket got");
    // SysV IPC: four attempts (by key and by id, for each), four refusals.
    let tried = r["sysv"].as_object().expect("sysv");
    assert_eq!(tried.len(), 4, "{r}");
    let refused = tried
        .values()
        .filter(|v| v.as_str().is_some_and(|v| v.starts_with("error: ")))
        .count();
    assert_eq!(refused, 4, "every SysV attempt refused: {}", r["sysv"]);
    let left = sysv.left().await;
    assert_eq!(left["shm"], "the shm canary", "{left}");
    assert_eq!(
        left["queued"], 1,
        "the message queue was not drained: {left}"
    );
    // Its uid: as root, one of its own from the default range, never 0; shown so.
    let list = b.providers().await;
    let up = list.iter().find(|p| p["namespace"] == "up").expect("up");
    assert_eq!(up["sandbox"]["mountNs"], true, "{up}");
    assert_eq!(up["sandbox"]["ipcNs"], true, "{up}");
    let uid = r["uid"].as_u64().expect("uid");
    match broker_uid {
        None => {
            let [first, last] = sharedos_broker::upstream::sandbox::DEFAULT_UPSTREAM_UIDS;
            assert!(
                (u64::from(first)..=u64::from(last)).contains(&uid),
                "as root, a uid of its own from the default range: {uid}"
            );
            assert_eq!(r["gid"], uid, "{r}");
            assert_eq!(r["groups"], json!([uid]), "{r}");
            assert_eq!(up["sandbox"]["uid"], uid, "{up}");
            assert_eq!(up["sandbox"]["ownUid"], true, "{up}");
        }
        Some(u) => {
            assert_eq!(uid, u64::from(u), "the broker's own uid: {r}");
            assert_eq!(up["sandbox"]["userns"], true, "{up}");
        }
    }
    let (code, out, _) = run(b.cli(&["providers"])).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("namespaces of its own: mount (only its rules' paths), ipc, network"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (CI runs --include-ignored as root): root's sockets in /run and root's SysV IPC"]
async fn as_root_named_sockets_and_sysv_ipc_stay_out() {
    if !crate::deploy::need_root("as_root_named_sockets_and_sysv_ipc_stay_out") {
        return;
    }
    walls_keep_sockets_and_sysv_ipc_out(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to start the broker under another uid (CI runs --include-ignored as root)"]
async fn without_root_named_sockets_and_sysv_ipc_stay_out() {
    if !crate::deploy::need_root("without_root_named_sockets_and_sysv_ipc_stay_out") {
        return;
    }
    walls_keep_sockets_and_sysv_ipc_out(Some(64150)).await;
}

/// As root, a sandboxed provider without `run_as` or `upstream_uids` gets a uid (= gid) of its
/// own from the default range, derived from its namespace: the same whatever the config's order
/// or other providers, never root's, and moved off a uid another setting claims.
#[test]
#[ignore = "needs root (CI runs --include-ignored as root): the default uids are root's"]
fn as_root_default_uids_are_stable_and_never_root() {
    use sharedos_broker::config::{ProviderConfig, SandboxSetting};
    if !crate::deploy::need_root("as_root_default_uids_are_stable_and_never_root") {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let uids = |top: &str, providers: &[&str]| -> std::collections::BTreeMap<String, String> {
        let list: String = providers.iter().map(|ns| hostile(ns, "")).collect();
        let cfg = write_config(dir.path(), top, &list);
        sharedos_broker::Config::from_file(&cfg)
            .expect("loads")
            .providers
            .into_iter()
            .filter_map(|p| match p {
                ProviderConfig::Mcp(m) => match m.sandbox {
                    SandboxSetting::On(sb) => Some((m.namespace, sb.run_as.expect("a uid"))),
                    SandboxSetting::Off(_) => None,
                },
                ProviderConfig::Files { .. } => None,
            })
            .collect()
    };
    let one = uids("", &["alpha", "beta"]);
    let two = uids("", &["gamma", "beta", "alpha"]);
    assert_eq!(one.len(), 2);
    assert_eq!(one["alpha"], two["alpha"], "{one:?} {two:?}");
    assert_eq!(one["beta"], two["beta"], "{one:?} {two:?}");
    let [first, last] = sharedos_broker::upstream::sandbox::DEFAULT_UPSTREAM_UIDS;
    for (ns, uid) in &two {
        let uid: u32 = uid.parse().expect("uid");
        assert!((first..=last).contains(&uid), "{ns}: {uid}");
    }
    assert_eq!(
        two.values()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        3,
        "one uid per provider: {two:?}"
    );
    // A host's uid is never an upstream's: alpha moves off it, beta keeps its own.
    let alpha = one["alpha"].clone();
    let moved = uids(&format!("host_uids = [0, {alpha}]\n"), &["alpha", "beta"]);
    assert_ne!(moved["alpha"], alpha);
    assert_eq!(moved["beta"], one["beta"]);
}

/// Issue 42 item 14: a `memory_mb` whose bytes do not fit (2^44 + 1 MiB) is refused at load,
/// naming the setting; the largest that fits loads.
#[test]
fn a_memory_limit_that_overflows_is_refused_at_load() {
    let dir = tempfile::tempdir().expect("tmp");
    let load = |mb: u64| {
        let cfg = write_config(
            dir.path(),
            "",
            &hostile("big", &format!("memory_mb = {mb}")),
        );
        sharedos_broker::Config::from_file(&cfg).map_err(|e| e.to_string())
    };
    let err = load((1 << 44) + 1).expect_err("refused");
    assert!(
        err.contains("provider `big`: [providers.sandbox]: memory_mb = 17592186044417: give a size in MiB from 1 to 17592186044415"),
        "{err}"
    );
    let err = load(0).expect_err("refused");
    assert!(err.contains("memory_mb = 0: give a size in MiB"), "{err}");
    load((1 << 44) - 1).expect("the largest that fits loads");
}

impl Served {
    /// Stops this broker: SIGTERM, waited for (20 s at most), then killed.
    async fn stop(&mut self) {
        let pid = self.child.id().expect("pid") as i32;
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).expect("pid"),
            rustix::process::Signal::TERM,
        )
        .expect("term");
        let _ = tokio::time::timeout(std::time::Duration::from_secs(20), self.child.wait()).await;
        let _ = self.child.start_kill();
    }

    /// Stops this broker (SIGTERM, waited for) and starts another on the same config, runtime
    /// dir and record, served once its `broker_started` line is on record.
    async fn restarted(mut self) -> Self {
        self.stop().await;
        let started = |s: &Served| {
            s.records()
                .iter()
                .filter(|l| l["kind"] == "broker_started")
                .count()
        };
        let before = started(&self);
        let cfg = self.path("broker.toml");
        let uid = self.uid;
        let s = Self::spawn_as(self.dir, &cfg, uid);
        eventually("the broker serves again", || started(&s) > before).await;
        s
    }
}

/// Issue 42, item 4. As root, a `per_principal` provider with `instance_uids` and a `write` rule:
/// bob's instance (a real Python upstream, `tests/python/token_cache.py`) writes its token cache
/// (0600) in its `HOME`, which is bob's own folder in the write rule (`<rule>/bob`, 0700, his
/// uid's). The broker restarts, and alice calls first: her instance gets a uid of her own, not
/// bob's former one (the uids are kept in `<record>.instance-uids.json`, 0600), her own folder,
/// and reads nothing of bob's (his folder, his file, the write rule itself); bob's token, sent
/// back by her upstream, reaches her agent redacted, and is nowhere in her answers or on
/// record. Bob, after the restart, has his uid and his cache back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (CI runs --include-ignored as root): instances get uids of their own"]
async fn as_root_a_principals_uid_and_files_stay_theirs_across_a_restart() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    if !crate::deploy::need_root("as_root_a_principals_uid_and_files_stay_theirs_across_a_restart")
    {
        return;
    }
    const SHARED: u32 = 64280;
    // The write rule: a folder other uids may enter (the broker's temp dir is 0700).
    let rule = tempfile::Builder::new()
        .prefix("sharedos-caches-")
        .tempdir()
        .expect("tmp");
    std::fs::set_permissions(rule.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let w = rule.path().display().to_string();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/token_cache.py");
    let provider = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"tc\"\ncommand = \"python3\"\nargs = [{}]\nenv = {{ TOKEN = {{ secret = \"token\" }} }}\ninstances = \"per_principal\"\ncall_timeout_seconds = 20\n[providers.sandbox]\nread = [{}]\nwrite = [{}]\nrun_as = \"{SHARED}\"\ninstance_uids = [64281, 64289]\n",
        q(script),
        q(python_dir()),
        q(&w)
    );
    let b = Served::start("", &provider).await;
    let cfg = b.path("broker.toml");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let bob_token = format!("tok-bob-{nanos:x}");
    let alice_token = format!("tok-alice-{nanos:x}");
    crate::secrets::set_secret(&cfg, "bob", "token", &bob_token);
    crate::secrets::set_secret(&cfg, "alice", "token", &alice_token);

    // Bob first: his cache, in his own folder, his only.
    let mut bob = b.raw_as("bob").await;
    let first = escape(&mut bob, 1, "tc.cache", json!({})).await;
    let bob_uid = first["uid"].as_u64().expect("uid") as u32;
    let bob_home = rule.path().join("bob");
    assert_eq!(first["home"], bob_home.display().to_string(), "{first}");
    let cache = bob_home.join("cache.json");
    assert_eq!(
        first["wrote"],
        format!("ok: {}", cache.display()),
        "{first}"
    );
    assert!((64281..=64289).contains(&bob_uid), "{bob_uid}");
    let meta_of = |p: &Path| std::fs::symlink_metadata(p).expect("meta");
    assert_eq!(
        (meta_of(&bob_home).uid(), meta_of(&bob_home).mode() & 0o7777),
        (bob_uid, 0o700)
    );
    assert_eq!(
        (meta_of(&cache).uid(), meta_of(&cache).mode() & 0o777),
        (bob_uid, 0o600)
    );
    assert!(
        std::fs::read_to_string(&cache)
            .expect("cache")
            .contains(&bob_token)
    );
    drop(bob);

    // The broker restarts; alice calls first.
    let b = b.restarted().await;
    let mut alice = b.raw_as("alice").await;
    let mine = escape(&mut alice, 1, "tc.cache", json!({})).await;
    let alice_uid = mine["uid"].as_u64().expect("uid") as u32;
    eprintln!("bob uid {bob_uid}, alice uid {alice_uid} after the restart");
    assert_ne!(alice_uid, bob_uid, "alice got bob's former uid: {mine}");
    assert!((64281..=64289).contains(&alice_uid), "{alice_uid}");
    assert_eq!(
        mine["home"],
        rule.path().join("alice").display().to_string(),
        "{mine}"
    );
    assert_eq!(mine["previous"], Value::Null, "{mine}");
    let paths = [
        cache.display().to_string(),
        bob_home.display().to_string(),
        w.clone(),
    ];
    let whole = alice.call(2, "tc.peek", json!({ "paths": paths })).await;
    let peek: Value = serde_json::from_str(&text(&whole["result"])).expect("report");
    // Bob's cache and folder: refused (Landlock, other uid) or not in her view at all (the
    // mount namespace binds only her own folder). The write rule itself: refused, or in her
    // view only as the folder that holds her own (nothing of bob's in it).
    for p in &paths[..2] {
        let got = peek[p].as_str().unwrap_or("(missing)");
        assert!(
            got.starts_with("error: PermissionError")
                || got.starts_with("error: FileNotFoundError"),
            "alice's instance read {p}: {got}"
        );
        assert!(Path::new(p).exists(), "{p} is there for the broker");
    }
    let got = peek[&paths[2]].as_str().unwrap_or("(missing)");
    assert!(
        got.starts_with("error: PermissionError")
            || (got.starts_with("ok: ") && !got.contains("bob") && !got.contains("cache.json")),
        "alice's instance read {}: {got}",
        paths[2]
    );
    // An upstream that hands alice bob's token (whatever way it got it): redacted.
    let echoed = alice
        .call(
            3,
            "tc.echo",
            json!({ "text": format!("found {bob_token}") }),
        )
        .await;
    assert_eq!(
        text(&echoed["result"]),
        "found [redacted: token]",
        "{echoed}"
    );
    let seen = [&mine.to_string(), &whole.to_string(), &echoed.to_string()]
        .iter()
        .any(|s| s.contains(&bob_token));
    assert!(!seen, "bob's token reached alice's agent");

    // Bob after the restart: his uid, his folder and what his instance left there.
    let mut bob = b.raw_as("bob").await;
    let again = escape(&mut bob, 1, "tc.cache", json!({})).await;
    assert_eq!(again["uid"], bob_uid, "{again}");
    assert_eq!(again["home"], bob_home.display().to_string(), "{again}");
    let sha = |s: &str| -> String {
        use sha2::Digest as _;
        sha2::Sha256::digest(s.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    assert_eq!(
        again["previous"],
        sha(&format!("{{\"token\": \"{bob_token}\"}}")),
        "{again}"
    );

    // Kept with the broker's state: 0600, the broker's; both principals in it.
    let map = b.path("record.jsonl.instance-uids.json");
    assert_eq!(meta_of(&map).mode() & 0o777, 0o600);
    assert_eq!(meta_of(&map).uid(), 0);
    let kept: Value =
        serde_json::from_str(&std::fs::read_to_string(&map).expect("map")).expect("json");
    let mut given: Vec<(String, u64)> = kept["uids"]
        .as_array()
        .expect("uids")
        .iter()
        .map(|g| {
            assert_eq!(g["provider"], "tc", "{g}");
            (
                g["principal"].as_str().unwrap_or("").to_owned(),
                g["uid"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    given.sort();
    assert_eq!(
        given,
        [
            ("alice".to_owned(), u64::from(alice_uid)),
            ("bob".to_owned(), u64::from(bob_uid))
        ]
    );
    // Recorded: alice's instance's write rule is her own folder, not the shared one.
    let started: Vec<Value> = b
        .provider_states("tc")
        .into_iter()
        .filter(|l| l["state"] == "instance_started")
        .collect();
    assert_eq!(started.len(), 3, "{started:?}");
    let alices = started
        .iter()
        .find(|l| l["principal"] == "alice")
        .expect("alice's");
    let write = alices["sandbox"]["write"].to_string();
    assert!(write.contains(&format!("{w}/alice")), "{write}");
    assert!(!write.contains(&format!("{}\"", w)), "{write}");
    // Bob's token is nowhere on record (alice's call's argument was redacted too).
    let record = std::fs::read_to_string(b.path("record.jsonl")).expect("record");
    assert!(!record.contains(&bob_token), "bob's token is on record");
    let echo_line = b
        .records()
        .into_iter()
        .find(|l| l["kind"] == "call" && l["tool"] == "tc.echo")
        .expect("echo call");
    assert_eq!(echo_line["redacted"], json!(["token"]), "{echo_line}");

    // A principal's folder planted as a link (here to /etc) is refused by name, never followed:
    // carol's instance does not start and nothing is written through the link.
    let carol_token = format!("tok-carol-{nanos:x}");
    crate::secrets::set_secret(&cfg, "carol", "token", &carol_token);
    let policy = b.path("policy.cedar");
    let mut text = std::fs::read_to_string(&policy).expect("policy");
    text.push_str(
        "@id(\"carol-tools\")\npermit(principal == SharedOS::User::\"carol\", action == SharedOS::Action::\"call\",\n       resource is SharedOS::Tool);\n",
    );
    std::fs::write(&policy, text).expect("policy");
    let reload = b.cli(&["policy", "reload"]).output().expect("reload");
    assert!(reload.status.success(), "{reload:?}");
    std::os::unix::fs::symlink("/etc", rule.path().join("carol")).expect("plant a link");
    let mut carol = b.raw_as("carol").await;
    let r = carol.call(1, "tc.cache", json!({})).await;
    let said = r.to_string();
    assert!(
        said.contains("is a link or not a folder") && said.contains("carol"),
        "{said}"
    );
    assert!(!Path::new("/etc/cache.json").exists());
    assert!(
        !b.provider_states("tc")
            .iter()
            .any(|l| l["state"] == "instance_started" && l["principal"] == "carol"),
        "carol's instance started through a planted link"
    );
    drop(carol);

    // A broken uid map stops the start, naming the file and what removing it would cost.
    let mut b = b;
    b.stop().await;
    std::fs::write(&map, "{\"uids\": [{\"provider\": \"tc\"").expect("break the map");
    let mut serve = tokio::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(&b.run)
        .arg("--config")
        .arg(&cfg)
        .kill_on_drop(true)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        serve.spawn().expect("serve").wait_with_output(),
    )
    .await
    .expect("serve exits on a broken map")
    .expect("serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("instance-uids.json")
            && err.contains("is not valid")
            && err.contains("restore it from a backup"),
        "{err}"
    );
}

/// Issue 42 item 1: the hostile upstream as `./up.py` (with a `#!` line), `at` being its path
/// relative to the config's folder; its sandbox table has nothing of its own.
fn local_hostile(dir: &Path, at: &str) -> String {
    let file = dir.join(at);
    std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
    let body = std::fs::read_to_string(script()).expect("script");
    std::fs::write(&file, format!("#!/usr/bin/env python3\n{body}")).expect("w");
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"up\"\ncommand = \"./{at}\"\ncall_timeout_seconds = 20\n"
    )
}

/// A secret of alice's in the folder store (`secrets/alice/token`), as the broker keeps them.
fn alice_secret(dir: &Path) {
    let alice = dir.join("secrets/alice");
    std::fs::create_dir_all(&alice).expect("mkdir");
    std::fs::write(alice.join("token"), "alice-token-value").expect("w");
    for (p, mode) in [
        (dir.join("secrets"), 0o700),
        (alice.clone(), 0o700),
        (alice.join("token"), 0o600),
    ] {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .expect("chmod");
    }
}

/// The layout the issue saw (`command = "./up.py"` beside `broker.toml`): the broker refuses it
/// before starting anything, naming the rule, its origin and a file of the broker's it would
/// expose; nothing of the upstream ran.
async fn beside_the_config_is_refused(uid: Option<u32>) {
    let dir = tempfile::Builder::new()
        .prefix("sharedos-sandbox-")
        .tempdir()
        .expect("tmp");
    alice_secret(dir.path());
    let provider = local_hostile(dir.path(), "up.py");
    let cfg = write_config(dir.path(), "", &provider);
    let real = std::fs::canonicalize(dir.path()).expect("canonical");
    let mut s = Served::spawn_as(dir, &cfg, uid);
    let status = tokio::time::timeout(crate::kit::WAIT, s.child.wait())
        .await
        .expect("the broker stops")
        .expect("wait");
    assert!(!status.success(), "the broker must refuse the layout");
    let err = std::fs::read_to_string(&s.stderr).expect("stderr");
    let want = format!(
        "provider `up` (config `{}`): its sandbox's read rule `{}` (command folder) would expose ",
        cfg.display(),
        cfg.parent().expect("dir").display()
    );
    assert!(err.contains(&want), "want {want:?} in: {err}");
    // The first of the broker's files under that rule: the config itself.
    assert!(
        err.contains(&format!("the config `{}/broker.toml`", real.display())),
        "{err}"
    );
    assert!(
        err.contains("Landlock cannot carve") && err.contains("folder of its own"),
        "{err}"
    );
    assert_eq!(
        err.matches("would expose").count(),
        1,
        "one error, said once: {err}"
    );
    // Refused before the record was opened and before any upstream ran.
    assert!(!s.path("record.jsonl").exists(), "nothing was started");
    assert!(!s.run.join("control.key").exists(), "nothing was started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_beside_the_config_is_refused_at_load() {
    beside_the_config_is_refused(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to start the broker under another uid (CI runs --include-ignored as root)"]
async fn without_root_an_upstream_beside_the_config_is_refused_at_load() {
    if !crate::deploy::need_root("without_root_an_upstream_beside_the_config_is_refused_at_load") {
        return;
    }
    beside_the_config_is_refused(Some(64231)).await;
}

/// The same upstream in a folder of its own (`up/up.py`) starts; `providers` shows each rule
/// with its origin, and it reads none of the broker's files: the config, the policy, the
/// record, its key, alice's secret, the control key.
async fn in_a_folder_of_its_own_reads_none(uid: Option<u32>) {
    let dir = tempfile::Builder::new()
        .prefix("sharedos-sandbox-")
        .tempdir()
        .expect("tmp");
    alice_secret(dir.path());
    let provider = local_hostile(dir.path(), "up/up.py");
    let top = match uid {
        Some(u) => format!("host_uids = [0, {u}]\nharness_uids = [0, {u}]\n"),
        None => String::new(),
    };
    let cfg = write_config(dir.path(), &top, &provider);
    let s = Served::spawn_as(dir, &cfg, uid);
    let record = s.path("record.jsonl");
    let control = s.run.join("control.sock");
    eventually("the broker serves", || {
        control.exists()
            && std::fs::read_to_string(&record)
                .unwrap_or_default()
                .contains("\"kind\":\"broker_started\"")
    })
    .await;
    let d = s.dir.path().display().to_string();
    let files = [
        format!("{d}/broker.toml"),
        format!("{d}/policy.cedar"),
        format!("{d}/record.jsonl"),
        format!("{d}/record.jsonl.key"),
        format!("{d}/secrets/alice/token"),
        format!("{d}/run/control.key"),
    ];
    let mut raw = s.raw().await;
    let r = escape(
        &mut raw,
        1,
        "up.escape",
        json!({ "read": files, "write": [format!("{d}/up"), d.clone()] }),
    )
    .await;
    let refused = files
        .iter()
        .filter(|f| {
            r["read"][f.as_str()].as_str().is_some_and(|g| {
                // Refused by Landlock, or not in its view at all (the mount namespace).
                g.starts_with("error: PermissionError") || g.starts_with("error: FileNotFoundError")
            })
        })
        .count();
    assert_eq!(refused, files.len(), "every attempt refused: {}", r["read"]);
    for f in &files {
        assert!(Path::new(f).exists(), "{f} is there for the broker");
    }
    assert!(
        !r.to_string().contains("alice-token-value"),
        "alice's secret reached the upstream"
    );
    denied(&r, "write", &format!("{d}/up"));
    denied(&r, "write", &d);
    let list = s.providers().await;
    let up = list.iter().find(|p| p["namespace"] == "up").expect("up");
    assert_eq!(up["state"], "ready", "{up}");
    let rules = up["sandbox"]["rules"].as_array().expect("rules");
    let own = std::fs::canonicalize(s.path("up")).expect("up");
    let origin_of = |path: &str| {
        rules
            .iter()
            .find(|r| r["path"] == path && r["access"] == "read")
            .map(|r| r["origin"].clone())
    };
    assert_eq!(
        origin_of(&s.path("up").display().to_string())
            .or_else(|| origin_of(&own.display().to_string())),
        Some(json!("command folder")),
        "{rules:?}"
    );
    assert_eq!(origin_of("/usr"), Some(json!("default")), "{rules:?}");
    assert_eq!(
        origin_of("/usr/bin"),
        Some(json!("interpreter")),
        "{rules:?}"
    );
    assert!(
        rules
            .iter()
            .all(|r| r["origin"].is_string() && r["path"].is_string()),
        "{rules:?}"
    );
    let (code, out, _) = run(s.cli(&["providers"])).await;
    assert_eq!(code, 0);
    assert!(out.contains("/usr (default)"), "{out}");
    assert!(out.contains("/usr/bin (interpreter)"), "{out}");
    assert!(out.contains("/up (command folder)"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_in_a_folder_of_its_own_reads_none_of_the_brokers_files() {
    in_a_folder_of_its_own_reads_none(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to start the broker under another uid (CI runs --include-ignored as root)"]
async fn without_root_an_upstream_in_a_folder_of_its_own_reads_none_of_the_brokers_files() {
    if !crate::deploy::need_root(
        "without_root_an_upstream_in_a_folder_of_its_own_reads_none_of_the_brokers_files",
    ) {
        return;
    }
    in_a_folder_of_its_own_reads_none(Some(64232)).await;
}

/// Issue 42 item 13: a script in a folder no rule names (`python3 hidden/up.py`): the start
/// fails naming the upstream's exit status, its own `Permission denied` line, that the sandbox
/// was on, and the `read` rule to add; the same on the provider's failed line in the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_the_sandbox_may_not_read_says_the_rule_to_add() {
    let dir = tempfile::Builder::new()
        .prefix("sharedos-sandbox-")
        .tempdir()
        .expect("tmp");
    let hidden = dir.path().join("hidden");
    std::fs::create_dir_all(&hidden).expect("mkdir");
    let up = hidden.join("up.py");
    std::fs::copy(script(), &up).expect("copy");
    let provider = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"hid\"\ncommand = \"python3\"\nargs = [{}]\n",
        q(&up.display().to_string())
    );
    let cfg = write_config(dir.path(), "", &provider);
    let mut s = Served::spawn(dir, &cfg);
    let status = tokio::time::timeout(crate::kit::WAIT, s.child.wait())
        .await
        .expect("the broker stops")
        .expect("wait");
    assert!(!status.success());
    let err = std::fs::read_to_string(&s.stderr).expect("stderr");
    let real = std::fs::canonicalize(&hidden).expect("canonical");
    for want in [
        "provider `hid`".to_owned(),
        "MCP initialize with the upstream failed".to_owned(),
        "the upstream exited with status 2".to_owned(),
        format!("can't open file '{}'", up.display()),
        // Outside every rule, the file is not in the upstream's view at all (the mount
        // namespace): Python says it is not there; the broker sees it is, and names the rule.
        "No such file or directory".to_owned(),
        "the sandbox was on".to_owned(),
        format!("it was refused `{}`", up.display()),
        format!("add `read = [\"{}\"]`", real.display()),
    ] {
        let found = err.contains(&want) || err.contains(&want.replace('"', "\\\""));
        assert!(found, "want {want:?} in: {err}");
    }
    let states = s.provider_states("hid");
    let failed: Vec<&Value> = states.iter().filter(|l| l["state"] == "failed").collect();
    assert_eq!(failed.len(), 1, "{states:?}");
    let reason = failed[0]["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains(&format!("read = [\"{}\"]", real.display())),
        "{reason}"
    );
    assert!(reason.contains("No such file or directory"), "{reason}");
}
