//! The files tools under a racing attacker, with real processes: a broker (`sharedos-broker
//! serve`), a real shim, and a separate process (`flip-entries`) that exchanges entries of a public
//! folder with links to `/private` and to a folder outside the data root
//! (`renameat2(RENAME_EXCHANGE)`) while thousands of calls run. Each test counts: calls made,
//! swaps made, each state of the race met, and zero private or outside bytes or names in any
//! answer, zero writes anywhere but `/public`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::kit::{Raw, bin, eventually, meta, run};

/// How long each attack runs.
const ATTACK: Duration = Duration::from_secs(5);
/// Calls kept in flight on the shim.
const IN_FLIGHT: i64 = 16;

/// Bytes and names that must never reach an answer.
const SECRETS: [&str; 4] = ["SECRET-7f3a", "hidden-7f3a", "OUTSIDE-9c1d", "outside-9c1d"];

const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list",
                  SharedOS::Action::"search", SharedOS::Action::"write"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };
"#;

/// A broker process on a tree laid out for attacks:
/// `data/public/{hello.txt, flip.txt, d/{f.txt, public-d.txt}, wd/, w.txt}`,
/// `data/private/{secret.txt, f.txt, hidden-7f3a.txt, target.txt}`,
/// `outside/{outside.txt, f.txt, outside-9c1d.txt, target.txt}`, and in `data/public` the
/// links an attacker swaps in: `x-priv`, `x-out`, `x-absout`, `x-privdir`, `x-outdir`,
/// `x-privtarget`, `x-outtarget`.
pub struct Served {
    dir: tempfile::TempDir,
    pub run_dir: PathBuf,
    child: tokio::process::Child,
}

impl Served {
    pub async fn start(env: &[(&str, &str)]) -> Self {
        Self::start_with(env, "").await
    }

    /// A broker started under `prlimit --nofile=N:N` (soft and hard limit on open files).
    pub async fn start_limited(open_files: u32) -> Self {
        let limit = format!("--nofile={open_files}:{open_files}");
        Self::start_wrapped(&[], "", &["prlimit", &limit, "--"]).await
    }

    /// A broker with `config` added to the top of its config (before the providers).
    pub async fn start_with(env: &[(&str, &str)], config: &str) -> Self {
        Self::start_wrapped(env, config, &[]).await
    }

    /// [`Served::start_with`], the broker started by `wrapper` (a command and its arguments
    /// that then run the broker's command line) when one is given.
    async fn start_wrapped(env: &[(&str, &str)], config: &str, wrapper: &[&str]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-races-")
            .tempdir()
            .expect("tmp");
        let d = std::fs::canonicalize(dir.path()).expect("canon");
        let data = d.join("data");
        let outside = d.join("outside");
        let files: &[(&str, &str)] = &[
            ("data/public/hello.txt", "hello, public world\n"),
            ("data/public/flip.txt", "PUBLIC-FLIP MARK\n"),
            ("data/public/d/f.txt", "PUBLIC-D MARK\n"),
            ("data/public/d/public-d.txt", "public\n"),
            ("data/public/w.txt", "public w\n"),
            ("data/private/secret.txt", "SECRET-7f3a MARK\n"),
            ("data/private/f.txt", "SECRET-7f3a MARK in a folder\n"),
            ("data/private/hidden-7f3a.txt", "SECRET-7f3a\n"),
            ("data/private/target.txt", "PRIVATE-ORIGINAL\n"),
            ("outside/outside.txt", "OUTSIDE-9c1d MARK\n"),
            ("outside/f.txt", "OUTSIDE-9c1d MARK in a folder\n"),
            ("outside/outside-9c1d.txt", "OUTSIDE-9c1d\n"),
            ("outside/target.txt", "OUTSIDE-ORIGINAL\n"),
        ];
        for (path, text) in files {
            let p = d.join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, text).expect("write");
        }
        std::fs::create_dir_all(data.join("public/wd")).expect("mkdir");
        let public = data.join("public");
        let links: &[(&str, String)] = &[
            ("x-priv", "../private/secret.txt".into()),
            ("x-out", "../../outside/outside.txt".into()),
            (
                "x-absout",
                outside.join("outside.txt").display().to_string(),
            ),
            ("x-privdir", "../private".into()),
            ("x-outdir", "../../outside".into()),
            ("x-privtarget", "../private/target.txt".into()),
            (
                "x-outtarget",
                outside.join("target.txt").display().to_string(),
            ),
        ];
        for (name, target) in links {
            std::os::unix::fs::symlink(target, public.join(name)).expect("link");
        }
        std::fs::write(d.join("policy.cedar"), POLICY).expect("policy");
        std::fs::write(
            d.join("broker.toml"),
            format!(
                "record = \"record.jsonl\"\npolicy = \"policy.cedar\"\n{sync}\
                 {config}\n\
                 [[providers]]\ntype = \"files\"\nnamespace = \"files\"\nroot = \"data\"\nwritable = true\n",
                config = if config.is_empty() { "call_timeout_seconds = 10" } else { config },
                sync = if config.contains("record_sync") { "" } else { "record_sync = \"batch\"\n" },
            ),
        )
        .expect("config");
        let run_dir = d.join("run");
        let child = Self::serve(&d, &run_dir, env, wrapper).await;
        Self {
            dir,
            run_dir,
            child,
        }
    }

    /// Starts `sharedos-broker serve` on the laid-out folder and waits until it serves.
    async fn serve(
        d: &Path,
        run_dir: &Path,
        env: &[(&str, &str)],
        wrapper: &[&str],
    ) -> tokio::process::Child {
        let control = run_dir.join("control.sock");
        let record = d.join("record.jsonl");
        // Counted across the rotated files: a start may rotate the record at its first line.
        let starts = || record_count(&record, "\"kind\":\"broker_started\"");
        let before = starts();
        let child = Self::spawn(d, run_dir, env, wrapper);
        eventually("broker started", || control.exists() && starts() > before).await;
        child
    }

    /// Starts `sharedos-broker serve` on the laid-out folder, without waiting for anything.
    fn spawn(
        d: &Path,
        run_dir: &Path,
        env: &[(&str, &str)],
        wrapper: &[&str],
    ) -> tokio::process::Child {
        let mut serve = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = tokio::process::Command::new(program);
                c.args(args).arg(bin("sharedos-broker"));
                c
            }
            None => tokio::process::Command::new(bin("sharedos-broker")),
        };
        serve
            .args(["serve", "--runtime-dir"])
            .arg(run_dir)
            .arg("--config")
            .arg(d.join("broker.toml"))
            .arg("--log-file")
            .arg(d.join("broker.log"))
            .envs(env.iter().copied())
            .kill_on_drop(true)
            .stderr(std::fs::File::create(d.join("broker.stderr")).expect("stderr"));
        serve.spawn().expect("serve")
    }

    /// Kills the broker (SIGKILL: no shutdown, no last lines) if it runs, and starts it again
    /// on the same config, runtime dir and record.
    pub async fn kill_and_restart(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        let d = std::fs::canonicalize(self.dir.path()).expect("canon");
        let _ = std::fs::remove_file(self.run_dir.join("control.sock"));
        self.child = Self::serve(&d, &self.run_dir, &[], &[]).await;
    }

    /// Kills the broker (SIGKILL) if it runs, and starts it again without waiting for it: the
    /// caller watches the record for what it wants to see.
    pub async fn kill_and_spawn(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        let d = std::fs::canonicalize(self.dir.path()).expect("canon");
        let _ = std::fs::remove_file(self.run_dir.join("control.sock"));
        self.child = Self::spawn(&d, &self.run_dir, &[], &[]);
    }

    /// Kills the broker with SIGKILL.
    pub async fn kill(&mut self) {
        self.child.start_kill().expect("kill");
        let _ = self.child.wait().await;
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        std::fs::canonicalize(self.dir.path())
            .expect("canon")
            .join(rel)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("broker running")
    }

    /// Opens a turn of alice with the CLI: (turn, token).
    pub async fn open_turn(&self) -> (String, String) {
        let mut open = std::process::Command::new(bin("sharedos-broker"));
        open.args([
            "turn",
            "open",
            "--principal",
            "alice",
            "--json",
            "--runtime-dir",
        ])
        .arg(&self.run_dir);
        let (code, out, err) = run(open).await;
        assert_eq!(code, 0, "turn open: {err}");
        let opened: Value = serde_json::from_str(&out).expect("json");
        let text = |k: &str| {
            opened[k]
                .as_str()
                .expect("turn open --json field")
                .to_owned()
        };
        (text("turn"), text("token"))
    }

    /// Closes a turn with the CLI, as the host does.
    pub async fn close_turn(&self, turn: &str) {
        let mut close = std::process::Command::new(bin("sharedos-broker"));
        close
            .args(["turn", "close", turn, "--runtime-dir"])
            .arg(&self.run_dir);
        let (code, _, err) = run(close).await;
        assert_eq!(code, 0, "turn close {turn}: {err}");
    }

    /// A fresh turn's shim is served: the broker still lets others in.
    pub async fn serves_another_turn(&self) {
        let mut other = self.shim().await;
        let r = other
            .call(1, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
    }

    /// A connection straight to `bridge.sock` (no shim) that has said hello with `token` and
    /// read the broker's welcome.
    pub async fn raw_bridge(
        &self,
        token: &str,
    ) -> (
        sharedos_ipc::FrameReader<impl tokio::io::AsyncRead + Unpin + Send + use<>>,
        impl tokio::io::AsyncWrite + Unpin + Send + use<>,
    ) {
        crate::kit::raw_bridge(&self.run_dir.join("bridge.sock"), token).await
    }

    /// A shim on a fresh turn of alice, initialized.
    pub async fn shim(&self) -> Raw {
        let (_, token) = self.open_turn().await;
        let mut c = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        c.env("SHAREDOS_TURN_TOKEN", token)
            .env("SHAREDOS_BROKER", self.run_dir.join("bridge.sock"))
            .kill_on_drop(true);
        let mut raw = Raw::spawn(c);
        raw.initialize("2025-06-18").await;
        raw
    }

    /// Starts `flip-entries` on `data/public` for the attack's length.
    fn flip(&self, args: &[&str]) -> std::process::Child {
        std::process::Command::new(env!("CARGO_BIN_EXE_flip-entries"))
            .arg(format!("{}", ATTACK.as_secs_f64() + 0.5))
            .arg(self.path("data/public"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("flip-entries")
    }

    /// The broker's threads now.
    fn threads(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .expect("task dir")
            .count()
    }

    /// The broker's peak resident memory (VmHWM), in KiB.
    fn peak_kib(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }

    /// The record's call lines.
    pub fn calls(&self) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|l| l["kind"] == "call")
            .collect()
    }

    /// Every whole line of the record (a torn last line, after a kill, is left out).
    pub fn lines(&self) -> Vec<Value> {
        std::fs::read_to_string(self.path("record.jsonl"))
            .expect("record")
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .collect()
    }
}

/// The text of each of the record's files (its rotated files first), in order; a file that
/// went away while they were listed reads as empty.
pub fn record_texts(record: &Path) -> Vec<String> {
    sharedos_broker::evidence::record::record_files(record)
        .unwrap_or_default()
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap_or_default())
        .collect()
}

/// How many times `text` occurs in the record's files.
pub fn record_count(record: &Path, text: &str) -> usize {
    record_texts(record)
        .iter()
        .map(|t| t.matches(text).count())
        .sum()
}

/// The swaps a flipper made (it prints them when its time is up).
fn swaps(child: std::process::Child) -> u64 {
    let out = child.wait_with_output().expect("flip-entries ends");
    assert!(out.status.success(), "flip-entries failed");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("swap count")
}

/// What the attack saw: answers by outcome (`succeeded`, `denied/<code>`, `failed/<code>`).
#[derive(Default, Debug)]
struct Tally {
    calls: u64,
    by_outcome: BTreeMap<String, u64>,
    /// The texts of answers that succeeded, a few of each.
    samples: BTreeMap<String, String>,
}

impl Tally {
    /// The first text of an answer with this outcome.
    fn sample(&self, outcome: &str) -> &str {
        self.samples
            .iter()
            .find(|(k, _)| k.starts_with(outcome))
            .map_or("", |(_, t)| t.as_str())
    }

    fn count(&self, outcome: &str) -> u64 {
        self.by_outcome
            .iter()
            .filter(|(k, _)| k.starts_with(outcome))
            .map(|(_, n)| n)
            .sum()
    }
}

/// Runs `call(i)` on the shim for ATTACK, IN_FLIGHT at a time, and checks every answer: no
/// secret byte or name in it.
async fn hammer(raw: &mut Raw, call: impl Fn(i64) -> (&'static str, Value)) -> Tally {
    let mut tally = Tally::default();
    let until = Instant::now() + ATTACK;
    let mut next = 1i64;
    let mut pending = 0i64;
    loop {
        while pending < IN_FLIGHT && Instant::now() < until {
            let (tool, args) = call(next);
            raw.send(json!({"jsonrpc": "2.0", "id": next, "method": "tools/call",
                            "params": {"name": tool, "arguments": args}}))
                .await;
            next += 1;
            pending += 1;
        }
        if pending == 0 {
            break;
        }
        let msg = raw.recv().await;
        if msg.get("id").is_none() {
            continue;
        }
        pending -= 1;
        tally.calls += 1;
        let result = &msg["result"];
        let text = msg.to_string();
        for secret in SECRETS {
            assert!(!text.contains(secret), "an answer carries {secret}: {text}");
        }
        let m = meta(result);
        let outcome = match m["code"].as_str() {
            Some(code) => format!("{}/{code}", m["outcome"].as_str().unwrap_or("?")),
            None => m["outcome"].as_str().unwrap_or("?").to_owned(),
        };
        tally
            .samples
            .entry(outcome.clone())
            .or_insert_with(|| crate::kit::text(result));
        *tally.by_outcome.entry(outcome).or_default() += 1;
    }
    tally
}

/// The attack ran: thousands of calls, the flipper swapped, and both sides of the race were met.
fn assert_contested(what: &str, tally: &Tally, swapped: u64) {
    eprintln!(
        "{what}: {} calls, {swapped} swaps, {:?}",
        tally.calls, tally.by_outcome
    );
    assert!(tally.calls >= 1000, "{what}: only {} calls", tally.calls);
    assert!(swapped >= 1000, "{what}: only {swapped} swaps");
    assert!(
        tally.count("succeeded") > 0,
        "{what}: nothing succeeded: {tally:?}"
    );
    assert!(
        tally.calls > tally.count("succeeded"),
        "{what}: nothing was refused: {tally:?}"
    );
}

/// `/private` and the folder outside the root, as they were: an attack must leave both as they
/// are.
struct Untouched {
    folders: Vec<(PathBuf, BTreeMap<String, String>)>,
}

impl Untouched {
    fn now(b: &Served) -> Self {
        let folders = [b.path("data/private"), b.path("outside")]
            .into_iter()
            .map(|p| {
                let before = snapshot(&p);
                (p, before)
            })
            .collect();
        Self { folders }
    }

    fn assert_unchanged(&self) {
        for (path, before) in &self.folders {
            assert_eq!(&snapshot(path), before, "{} changed", path.display());
        }
    }
}

/// The files of a folder and their contents.
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(e.path()).unwrap_or_else(|_| "(not a file)".into());
            (name, text)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_under_a_swapped_file_never_returns_private_or_outside_bytes() {
    let b = Served::start(&[]).await;
    let mut raw = b.shim().await;
    let flipper = b.flip(&["flip.txt", "x-priv", "x-out", "x-absout"]);
    let tally = hammer(&mut raw, |_| {
        ("files.read", json!({"path": "/public/flip.txt"}))
    })
    .await;
    assert_contested("read", &tally, swaps(flipper));
    assert!(tally.count("denied") > 0, "{tally:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_through_a_swapped_folder_never_returns_private_or_outside_bytes() {
    let b = Served::start(&[]).await;
    let mut raw = b.shim().await;
    let flipper = b.flip(&["d", "x-privdir", "x-outdir"]);
    let tally = hammer(&mut raw, |_| {
        ("files.read", json!({"path": "/public/d/f.txt"}))
    })
    .await;
    assert_contested("read through a folder", &tally, swaps(flipper));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_of_a_swapped_folder_never_shows_private_or_outside_names() {
    let b = Served::start(&[]).await;
    let mut raw = b.shim().await;
    let flipper = b.flip(&["d", "x-privdir", "x-outdir"]);
    let tally = hammer(&mut raw, |_| ("files.list", json!({"path": "/public/d"}))).await;
    assert_contested("list (private and out of root)", &tally, swaps(flipper));
    let listed = tally.sample("succeeded");
    assert!(listed.contains("public-d.txt"), "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_under_a_swapped_file_never_returns_private_or_outside_hits() {
    let b = Served::start(&[]).await;
    let mut raw = b.shim().await;
    let flipper = b.flip(&["flip.txt", "x-priv", "x-out", "x-absout"]);
    let tally = hammer(&mut raw, |i| {
        // Alternate the search root between the folder and the swapped file itself.
        let path = if i % 2 == 0 {
            "/public"
        } else {
            "/public/flip.txt"
        };
        ("files.search", json!({"path": path, "query": "MARK"}))
    })
    .await;
    assert_contested("search (file swapped)", &tally, swaps(flipper));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_walking_a_swapped_folder_never_returns_private_or_outside_hits() {
    let b = Served::start(&[]).await;
    let mut raw = b.shim().await;
    let flipper = b.flip(&["d", "x-privdir", "x-outdir"]);
    let tally = hammer(&mut raw, |i| {
        let path = if i % 2 == 0 { "/public" } else { "/public/d" };
        ("files.search", json!({"path": path, "query": "MARK"}))
    })
    .await;
    assert_contested("search walk (folder swapped)", &tally, swaps(flipper));
}

/// Writes to `/public/w.txt` while it is swapped with links to a private file and to a file
/// outside the root, and while `/public/n.txt` and `/public/n2.txt` keep appearing as dangling
/// links into `/private` and out of the root: nothing outside `/public` changes or appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_under_swapped_files_touches_only_public() {
    let b = Served::start(&[]).await;
    let untouched = Untouched::now(&b);
    let outside = b.path("outside");
    let mut raw = b.shim().await;
    let flipper = b.flip(&["w.txt", "x-privtarget", "x-outtarget"]);
    let toggle_private = b.flip(&["--toggle", "n.txt", "../private/created.txt"]);
    let toggle_outside = b.flip(&[
        "--toggle",
        "n2.txt",
        &outside.join("created.txt").display().to_string(),
    ]);
    let tally = hammer(&mut raw, |i| {
        let path = match i % 3 {
            0 => "/public/w.txt",
            1 => "/public/n.txt",
            _ => "/public/n2.txt",
        };
        (
            "files.write",
            json!({"path": path, "content": "WRITTEN BY THE AGENT\n"}),
        )
    })
    .await;
    let swapped = swaps(flipper) + swaps(toggle_private) + swaps(toggle_outside);
    assert_contested("write (file swapped, dangling links)", &tally, swapped);
    untouched.assert_unchanged();
}

/// Writes to `/public/wd/w.txt` while `/public/wd` is swapped with links to `/private` and to a
/// folder outside the root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_a_swapped_folder_touches_only_public() {
    let b = Served::start(&[]).await;
    let untouched = Untouched::now(&b);
    let mut raw = b.shim().await;
    let flipper = b.flip(&["wd", "x-privdir", "x-outdir"]);
    let tally = hammer(&mut raw, |_| {
        (
            "files.write",
            json!({"path": "/public/wd/w.txt", "content": "WRITTEN\n"}),
        )
    })
    .await;
    assert_contested("write through the parent", &tally, swaps(flipper));
    untouched.assert_unchanged();
}

/// The same read and write attacks with the component-by-component walk forced (what kernels
/// without `openat2` get).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_walk_fallback_holds_the_same_line() {
    let b = Served::start(&[("SHAREDOS_RESOLVE", "walk")]).await;
    let private = b.path("data/private");
    let before = snapshot(&private);
    let mut raw = b.shim().await;
    let flipper = b.flip(&["flip.txt", "x-priv", "x-absout"]);
    let flip_dir = b.flip(&["wd", "x-privdir", "x-outdir"]);
    let tally = hammer(&mut raw, |i| match i % 3 {
        0 => ("files.read", json!({"path": "/public/flip.txt"})),
        1 => ("files.search", json!({"path": "/public", "query": "MARK"})),
        _ => (
            "files.write",
            json!({"path": "/public/wd/w.txt", "content": "W\n"}),
        ),
    })
    .await;
    assert_contested("walk fallback", &tally, swaps(flipper) + swaps(flip_dir));
    assert_eq!(snapshot(&private), before, "/private changed");
}

/// A public file swapped for a FIFO and for a link to `/dev/zero` while searches run: no broker
/// thread is left stuck (the thread count returns to where it was), memory stays bounded, and
/// every search is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_over_fifos_and_dev_zero_neither_hangs_nor_grows() {
    let b = Served::start(&[]).await;
    let public = b.path("data/public");
    let status = std::process::Command::new("mkfifo")
        .arg(public.join("d/fifo"))
        .arg(public.join("fifo-standing"))
        .status()
        .expect("mkfifo");
    assert!(status.success());
    std::os::unix::fs::symlink("/dev/zero", public.join("d/zero")).expect("link");
    let mut raw = b.shim().await;
    // Warm up, then count: the broker's threads at rest with this turn open.
    raw.call(0, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    let threads_before = b.threads();
    let flip_fifo = std::process::Command::new(env!("CARGO_BIN_EXE_flip-entries"))
        .arg(format!("{}", ATTACK.as_secs_f64() + 0.5))
        .arg(public.join("d"))
        .args(["f.txt", "fifo", "zero"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("flip-entries");
    let tally = hammer(&mut raw, |_| {
        ("files.search", json!({"path": "/public", "query": "MARK"}))
    })
    .await;
    let swapped = swaps(flip_fifo);
    eprintln!(
        "fifo/zero search: {} calls, {swapped} swaps, {:?}",
        tally.calls, tally.by_outcome
    );
    assert!(tally.calls >= 100, "{tally:?}");
    assert!(swapped >= 1000, "only {swapped} swaps");
    assert_eq!(tally.count("succeeded"), tally.calls, "{tally:?}");
    // Idle blocking threads retire after 10 s; a thread stuck in open() never does.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = b.threads();
        if now <= threads_before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "broker threads: {threads_before} before, {now} 30 s after the attack"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let peak_mib = b.peak_kib() / 1024;
    eprintln!("broker peak RSS {peak_mib} MiB");
    assert!(peak_mib < 256, "broker peak RSS {peak_mib} MiB");
    // And the broker still answers.
    let r = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["outcome"], "succeeded", "{r}");
}

/// Every call of an attack has exactly one record line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_raced_call_is_recorded_once() {
    let b = Served::start(&[]).await;
    let mut raw = b.shim().await;
    let flipper = b.flip(&["flip.txt", "x-priv", "x-out"]);
    let tally = hammer(&mut raw, |_| {
        ("files.read", json!({"path": "/public/flip.txt"}))
    })
    .await;
    swaps(flipper);
    drop(raw);
    let calls = b.calls();
    assert_eq!(calls.len() as u64, tally.calls, "record lines vs answers");
    let ids: std::collections::BTreeSet<_> =
        calls.iter().map(|c| c["callId"].to_string()).collect();
    assert_eq!(ids.len(), calls.len(), "a call id recorded twice");
}

/// A brokered tool with a `file` template over a naive upstream that does a plain `open(path)`:
/// the policy decides on what that open would reach (links and `..` taken as the filesystem
/// takes them), and the upstream is sent the resolved path, so `<dirlink>/../secret.txt` is never
/// served from `/private`. The record keeps both the call's argument and what was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brokered_file_template_decides_on_what_the_upstream_opens() {
    let mut b = crate::kit::TestBroker::start(crate::kit::Options::default()).await;
    let data = std::fs::canonicalize(b.dir.path().join("data")).expect("data");
    std::fs::create_dir_all(data.join("private/inner")).expect("mkdir");
    std::fs::write(
        data.join("public/secret.txt"),
        "the public file of that name\n",
    )
    .expect("w");
    let public = data.join("public");
    std::os::unix::fs::symlink("../private/inner", public.join("dl")).expect("ln");
    std::os::unix::fs::symlink("hello.txt", public.join("alias")).expect("ln");
    std::os::unix::fs::symlink("../private/secret.txt", public.join("lnk")).expect("ln");
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    let q = |s: &str| serde_json::to_string(s).expect("quote");
    std::fs::write(
        &b.config_path,
        format!(
            "{cfg}\n[[providers]]\ntype = \"mcp\"\nnamespace = \"plain\"\ncommand = {}\n\
             [providers.tools.read_file]\naction = \"read\"\nfile = \"{{path}}\"\nfile_root = {}\n",
            q(env!("CARGO_BIN_EXE_open-upstream")),
            q(&data.display().to_string()),
        ),
    )
    .expect("w");
    b.restart().await;
    let turn = b.open_turn("alice").await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let at = |rel: &str| data.join(rel).display().to_string();
    let mut call = async |id: i64, path: String| {
        let r = raw.call(id, "plain.read_file", json!({"path": path})).await;
        let result = r["result"].clone();
        (meta(&result).clone(), crate::kit::text(&result))
    };
    let (m, text) = call(1, at("public/hello.txt")).await;
    assert_eq!(m["outcome"], "succeeded", "{m} {text}");
    assert_eq!(text, "hello, public world\n");
    // Lexically this is /public/secret.txt; physically, /private/secret.txt.
    let (m, text) = call(2, at("public/dl/../secret.txt")).await;
    assert_eq!(m["outcome"], "denied", "{m} {text}");
    assert!(text.contains("/private/secret.txt"), "{text}");
    assert!(!text.contains("the secret"), "{text}");
    let (m, text) = call(3, at("public/alias")).await;
    assert_eq!(m["outcome"], "succeeded", "{m} {text}");
    assert_eq!(text, "hello, public world\n");
    let (m, text) = call(4, at("public/lnk")).await;
    assert_eq!(m["outcome"], "denied", "{m} {text}");
    let (m, _) = call(5, "/etc/passwd".into()).await;
    assert_eq!(m["code"], "unresolvable_requirement", "{m}");
    let (m, _) = call(6, at("public/../../x")).await;
    assert_eq!(m["code"], "unresolvable_requirement", "{m}");
    let calls = b.calls_of(&turn.turn);
    assert_eq!(calls.len(), 6, "{calls:#?}");
    assert_eq!(calls[1]["arguments"]["path"], at("public/dl/../secret.txt"));
    assert_eq!(
        calls[1]["requirement"]["resource"], "SharedOS::File::\"/private/secret.txt\"",
        "{}",
        calls[1]
    );
    assert_eq!(calls[2]["arguments"]["path"], at("public/alias"));
    assert_eq!(
        calls[2]["forwardedArguments"]["path"],
        at("public/hello.txt"),
        "{}",
        calls[2]
    );
    assert!(calls[0].get("forwardedArguments").is_none(), "{}", calls[0]);
}
