//! The reference in `docs/`, checked the way the README is (`readme.rs`). Every shell block in a
//! chapter (```sh, ```bash, ```shell) is marked `<!-- docs-test: NAME -->` and run by bash as
//! written, from the clone's folder, with `sharedos-broker` and `sharedos-mcp-shim` on `PATH`,
//! `WORK` a fresh folder and `HOME` an empty one that must stay empty; each test then checks what
//! its block claims. `docs/SUMMARY.md` (the mdBook) lists every chapter, every link between the
//! README and the chapters resolves (anchors included), and the README stays a front door of at
//! most 700 lines. When a block stops working, or a chapter or link goes missing, these fail.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::kit::bin;

/// Every marked shell block of `docs/`, by name. A block added to a chapter needs a name here and
/// a test that runs it.
const BLOCKS: [&str; 6] = [
    "approvals",
    "approvals-setup",
    "benchmarks",
    "deployment",
    "host-commands",
    "secrets",
];

/// The chapters the README must point to (the issue's reference list).
const REFERENCE: [&str; 8] = [
    "configuration.md",
    "sandbox.md",
    "credentials.md",
    "remote-servers.md",
    "evidence.md",
    "approvals-and-budgets.md",
    "interop.md",
    "trust-model.md",
];

const README_MAX_LINES: usize = 700;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `docs/*.md`, sorted.
fn chapters() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    out.sort();
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fenced block: where it is, its language, the marker on the line before it, and its body.
struct Fenced {
    at: String,
    lang: String,
    name: Option<String>,
    body: String,
}

/// The fenced blocks of a markdown text, and the markers not followed by a block.
fn fenced(file: &str, text: &str) -> (Vec<Fenced>, Vec<String>) {
    let lines: Vec<&str> = text.lines().collect();
    let (mut out, mut dangling) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if let Some(name) = marker(line)
            && !lines.get(i + 1).is_some_and(|l| l.starts_with("```"))
        {
            dangling.push(format!("{file}:{}: `{name}`", i + 1));
        }
        if let Some(lang) = line.strip_prefix("```") {
            let start = i;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].starts_with("```") {
                body.push(lines[i]);
                i += 1;
            }
            let name = start
                .checked_sub(1)
                .and_then(|p| marker(lines[p]))
                .map(str::to_owned);
            out.push(Fenced {
                at: format!("{file}:{}", start + 1),
                lang: lang.trim().to_owned(),
                name,
                body: body.join("\n"),
            });
        }
        i += 1;
    }
    (out, dangling)
}

fn marker(line: &str) -> Option<&str> {
    line.trim()
        .strip_prefix("<!-- docs-test: ")
        .and_then(|r| r.strip_suffix(" -->"))
}

fn is_shell(lang: &str) -> bool {
    matches!(lang, "sh" | "bash" | "shell" | "console" | "zsh")
}

/// The shell blocks of `docs/` by name.
fn blocks() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for chapter in chapters() {
        let file = format!(
            "docs/{}",
            chapter.file_name().expect("name").to_string_lossy()
        );
        let (found, dangling) = fenced(&file, &read(&chapter));
        assert!(
            dangling.is_empty(),
            "a docs-test marker must stand right before its ```sh block: {dangling:?}"
        );
        for b in found {
            match (&b.name, is_shell(&b.lang)) {
                (Some(name), true) => assert!(
                    out.insert(name.clone(), b.body).is_none(),
                    "two docs blocks are named `{name}` ({})",
                    b.at
                ),
                (None, true) => panic!(
                    "{}: a ```{} block in docs/ must be run by the tests: mark it `<!-- docs-test: NAME -->` and add NAME to docs.rs, or make it ```text if it is not a command",
                    b.at, b.lang
                ),
                (Some(name), false) => panic!(
                    "{}: `{name}` marks a ```{} block; only shell blocks are run",
                    b.at, b.lang
                ),
                (None, false) => {}
            }
        }
    }
    out
}

/// Always runs: every shell block of `docs/` is marked, and the marks are the blocks this file
/// runs, no more and no fewer.
#[test]
fn every_docs_shell_block_is_marked_and_run() {
    let b = blocks();
    let names: Vec<&str> = b.keys().map(String::as_str).collect();
    assert_eq!(names, BLOCKS.to_vec());
    for (name, body) in &b {
        assert!(!body.trim().is_empty(), "docs block `{name}` is empty");
    }
}

/// Always runs: every ```toml block of the README and the chapters is TOML as the broker's parser
/// reads it (a config or a part of one, pasted as it stands).
#[test]
fn every_docs_toml_block_parses() {
    let mut files = vec![root().join("README.md")];
    files.extend(chapters());
    let mut parsed = 0;
    for file in &files {
        let (found, _) = fenced(&file.display().to_string(), &read(file));
        for b in found.iter().filter(|b| b.lang == "toml") {
            if let Err(e) = toml::from_str::<toml::Table>(&b.body) {
                panic!("{}: not TOML: {e}", b.at);
            }
            parsed += 1;
        }
    }
    assert!(parsed >= 9, "only {parsed} toml blocks");
}

/// Always runs: `docs/` is an mdBook. `book.toml` takes the chapters from `docs/` itself, and
/// `SUMMARY.md` lists every chapter once, each link to a file that exists.
#[test]
fn the_docs_are_an_mdbook_listing_every_chapter() {
    let docs = root().join("docs");
    let book = read(&docs.join("book.toml"));
    let book: toml::Value = toml::from_str(&book).expect("book.toml is TOML");
    assert_eq!(book["book"]["src"].as_str(), Some("."), "{book}");
    assert!(
        book["book"]["title"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    );
    let summary = read(&docs.join("SUMMARY.md"));
    let listed: Vec<String> = links(&summary)
        .into_iter()
        .map(|l| l.split('#').next().unwrap_or_default().to_owned())
        .collect();
    let unique: BTreeSet<&String> = listed.iter().collect();
    assert_eq!(
        unique.len(),
        listed.len(),
        "a chapter listed twice: {listed:?}"
    );
    for l in &listed {
        assert!(
            docs.join(l).is_file(),
            "SUMMARY.md lists `{l}`, which does not exist"
        );
    }
    let files: BTreeSet<String> = chapters()
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .filter(|n| n != "SUMMARY.md")
        .collect();
    let listed: BTreeSet<String> = listed.into_iter().collect();
    assert_eq!(
        files, listed,
        "SUMMARY.md must list every docs/*.md chapter"
    );
    for chapter in REFERENCE {
        assert!(listed.contains(chapter), "no chapter {chapter}");
    }
}

/// Always runs: the README is a front door of at most 700 lines, with the two set-up commands
/// first, and it points to each chapter of the reference.
#[test]
fn the_readme_is_a_front_door_to_the_docs() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move reference text to docs/"
    );
    let (found, _) = fenced("README.md", &readme);
    let setup = found
        .iter()
        .find(|b| is_shell(&b.lang))
        .expect("the README's first shell block");
    let commands: Vec<&str> = setup
        .body
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(
        commands,
        [
            "cargo run --release --bin sharedos-broker -- demo",
            "bash .ci/run"
        ],
        "the README's first shell block is the two set-up commands"
    );
    let targets: BTreeSet<String> = links(&readme)
        .into_iter()
        .filter_map(|l| l.strip_prefix("docs/").map(str::to_owned))
        .map(|l| l.split('#').next().unwrap_or_default().to_owned())
        .collect();
    for chapter in REFERENCE {
        assert!(
            targets.contains(chapter),
            "the README does not point to docs/{chapter}"
        );
    }
    for t in &targets {
        assert!(
            root().join("docs").join(t).is_file(),
            "the README points to docs/{t}, which does not exist"
        );
    }
}

/// Always runs: every relative link in the README and the chapters names a file that exists and,
/// with a `#fragment`, a heading of that file (GitHub's and mdBook's anchors).
#[test]
fn every_link_between_the_readme_and_the_docs_resolves() {
    let mut files = vec![root().join("README.md")];
    files.extend(chapters());
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in &files {
        let text = read(file);
        let dir = file.parent().expect("folder");
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            checked += 1;
            if !target.exists() {
                broken.push(format!("{}: `{link}`: no such file", file.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let anchors = anchors(&read(&target));
                if !anchors.contains(anchor) {
                    broken.push(format!(
                        "{}: `{link}`: no heading with that anchor in {}",
                        file.display(),
                        target.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked >= 40, "only {checked} links checked");
}

/// The targets of the inline links `[text](target)` outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Inline code can hold `](`; leave it out.
        let plain: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

/// The anchors of a markdown file's headings, as GitHub and mdBook make them: lower case, letters,
/// digits, `-` and `_` kept, spaces made `-`, the rest dropped.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        out.insert(slug);
    }
    out
}

/// What a run of blocks left: its output and its `WORK`.
struct Ran {
    stdout: String,
    stderr: String,
    work: tempfile::TempDir,
}

/// Runs the named blocks in order in one bash, as `readme.rs` runs the README's: from the clone's
/// folder, `set -euo pipefail`, `sharedos-broker` on `PATH`, `WORK` fresh, `HOME` empty (and
/// still empty after), within `limit`. Whatever a block left running in the background is
/// stopped when the script ends. Output goes to files, so a process that outlives the script
/// cannot hold the test.
async fn run_blocks(names: &[&str], limit: Duration) -> Ran {
    let b = blocks();
    let mut script =
        String::from("set -euo pipefail\ntrap 'set +e; kill $(jobs -p) 2>/dev/null; wait' EXIT\n");
    for name in names {
        script.push_str(&b[*name]);
        script.push('\n');
    }
    let work = tempfile::tempdir().expect("work");
    let home = tempfile::tempdir().expect("home");
    let out = tempfile::tempdir().expect("out");
    let bins = bin("sharedos-broker")
        .parent()
        .expect("bin dir")
        .to_path_buf();
    assert!(bins.join("sharedos-mcp-shim").is_file());
    let path = format!(
        "{}:{}",
        bins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // Cargo and rustup keep their homes under the real HOME; the blocks get an empty one.
    let real_home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let cargo_home =
        std::env::var_os("CARGO_HOME").map_or_else(|| real_home.join(".cargo"), PathBuf::from);
    let rustup_home =
        std::env::var_os("RUSTUP_HOME").map_or_else(|| real_home.join(".rustup"), PathBuf::from);
    let stdout_file = out.path().join("stdout");
    let stderr_file = out.path().join("stderr");
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg("-c")
        .arg(&script)
        .current_dir(root())
        .env("PATH", path)
        .env("WORK", work.path())
        .env("HOME", home.path())
        .env("CARGO_HOME", cargo_home)
        .env("RUSTUP_HOME", rustup_home)
        .env_remove("SHAREDOS_RUNTIME_DIR")
        .env_remove("SHAREDOS_BROKER")
        .env_remove("SHAREDOS_BROKER_UID")
        .env_remove("SHAREDOS_TURN_TOKEN")
        .env_remove("SHAREDOS_SHIM")
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&stdout_file).expect("stdout file"))
        .stderr(std::fs::File::create(&stderr_file).expect("stderr file"))
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("bash");
    let status = tokio::time::timeout(limit, child.wait())
        .await
        .unwrap_or_else(|_| panic!("the docs blocks {names:?} did not finish in {limit:?}"))
        .expect("wait");
    let stdout = std::fs::read_to_string(&stdout_file).unwrap_or_default();
    let stderr = std::fs::read_to_string(&stderr_file).unwrap_or_default();
    let broker_log = std::fs::read_to_string(work.path().join("broker.log")).unwrap_or_default();
    assert!(
        status.success(),
        "the docs blocks {names:?} failed ({status}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- broker log\n{broker_log}"
    );
    let written = crate::kit::names_in(home.path());
    assert!(
        written.is_empty(),
        "the docs blocks {names:?} wrote outside WORK, into HOME: {written:?}"
    );
    Ran {
        stdout,
        stderr,
        work,
    }
}

fn record(path: &Path) -> Vec<Value> {
    read(path)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a record line is JSON"))
        .collect()
}

fn of_kind<'a>(lines: &'a [Value], kind: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["kind"] == kind).collect()
}

/// `docs/running.md`: host commands on the embedded default: the catalogue without a turn, a
/// decision allowed and one refused (exit 3), a turn with a context attribute listed and closed,
/// and the record verified once the broker stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_host_commands_block_runs_as_written() {
    let ran = run_blocks(&["host-commands"], Duration::from_secs(60)).await;
    for said in [
        "catalogHash: ",
        "allow: files.read of /public/hello.txt — permitted by alice-public",
        "denied: files.read of /private/secret.txt — no policy permits read on this file",
        "verified: chain from seq 1 whole",
    ] {
        assert_eq!(
            ran.stdout.matches(said).count(),
            1,
            "`{said}` once in:\n{}",
            ran.stdout
        );
    }
    let lines = record(&ran.work.path().join("run/default/record.jsonl"));
    let opened = of_kind(&lines, "turn_opened");
    assert_eq!(opened.len(), 1, "{opened:?}");
    assert!(
        opened[0].to_string().contains(r#""project":"x""#),
        "the turn's context: {}",
        opened[0]
    );
    assert_eq!(of_kind(&lines, "turn_closed").len(), 1);
    assert_eq!(
        of_kind(&lines, "call").len(),
        0,
        "a policy check runs nothing"
    );
}

/// `docs/credentials.md`: the folder store managed with the CLI, by config and by folder; the
/// listing names the secret, the delete removes it, and no value is ever printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_secrets_block_runs_as_written() {
    let ran = run_blocks(&["secrets"], Duration::from_secs(60)).await;
    let store = ran.work.path().join("secrets");
    assert_eq!(
        ran.stdout.lines().filter(|l| *l == "github_token").count(),
        1,
        "`secrets list` names alice's secret once:\n{}",
        ran.stdout
    );
    assert!(
        !store.join("alice/github_token").exists(),
        "`secrets delete` removed it"
    );
    let shared = store.join("_shared/github_host");
    assert_eq!(read(&shared), "github.com");
    let mode = std::fs::metadata(&shared)
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    for out in [&ran.stdout, &ran.stderr] {
        assert!(
            !out.contains("ghp_an_example_value"),
            "a value printed:\n{out}"
        );
    }
}

/// `docs/approvals-and-budgets.md`: two reads wait for a person; the operator approves one, which
/// runs, and denies the other with a reason, which the script's client is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_approvals_blocks_run_as_written() {
    let ran = run_blocks(&["approvals-setup", "approvals"], Duration::from_secs(120)).await;
    let lines = record(&ran.work.path().join("record.jsonl"));
    assert_eq!(of_kind(&lines, "approval_requested").len(), 2);
    let decided = of_kind(&lines, "approval_decided");
    assert_eq!(decided.len(), 2, "{decided:?}");
    assert_eq!(
        decided
            .iter()
            .filter(|l| l["decision"] == "approved")
            .count(),
        1
    );
    let denied: Vec<_> = decided
        .iter()
        .filter(|l| l["decision"] == "denied")
        .collect();
    assert_eq!(denied.len(), 1);
    assert_eq!(denied[0]["reason"], "not before the audit");
    let calls = of_kind(&lines, "call");
    assert_eq!(calls.len(), 2, "{calls:?}");
    for (path, outcome, code) in [
        ("/private/harmless.txt", "succeeded", "ok"),
        ("/private/other.txt", "denied", "approval_denied"),
    ] {
        let call = calls
            .iter()
            .find(|c| c["arguments"]["path"] == path)
            .unwrap_or_else(|| panic!("no call of {path}: {calls:?}"));
        assert_eq!(call["outcome"], outcome, "{call}");
        assert_eq!(call["code"], code, "{call}");
    }
    let shim = read(&ran.work.path().join("shim.out"));
    assert!(shim.contains("the plan"), "{shim}");
    assert!(
        shim.contains("denied: files.read of /private/other.txt")
            && shim.contains("a person denied this call"),
        "{shim}"
    );
    assert_eq!(
        ran.stdout
            .lines()
            .filter(|l| l.starts_with("approved "))
            .count(),
        1,
        "{}",
        ran.stdout
    );
    assert_eq!(
        ran.stdout
            .lines()
            .filter(|l| l.starts_with("denied "))
            .count(),
        1,
        "{}",
        ran.stdout
    );
}

/// `docs/deployment.md`: as root, a harness uid in the harness group reaches its turn through the
/// config `turn open --write-config` wrote, reads a file, and its token file goes with the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (groupadd, useradd, a process under another uid): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn docs_deployment_block_runs_as_written() {
    if !crate::deploy::need_root("docs_deployment_block_runs_as_written") {
        return;
    }
    let ran = run_blocks(&["deployment"], Duration::from_secs(120)).await;
    let lines = record(&ran.work.path().join("record.jsonl"));
    let uid = std::process::Command::new("id")
        .args(["-u", "agent-alice"])
        .output()
        .expect("id");
    let uid: u64 = String::from_utf8_lossy(&uid.stdout)
        .trim()
        .parse()
        .expect("agent-alice's uid");
    assert_ne!(uid, 0);
    let connected = of_kind(&lines, "bridge_connected");
    assert_eq!(connected.len(), 1, "{connected:?}");
    assert_eq!(connected[0]["peer"]["uid"], uid, "{}", connected[0]);
    let turn = connected[0]["turn"].as_str().expect("turn").to_owned();
    let calls = of_kind(&lines, "call");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["outcome"], "succeeded", "{}", calls[0]);
    assert_eq!(calls[0]["arguments"]["path"], "/public/hello.txt");
    assert!(read(&ran.work.path().join("shim.out")).contains("hello from /public"));
    // The stand-in ran what the written config names.
    let config: Value = serde_json::from_str(&read(Path::new(&format!(
        "/run/sharedos-turns/{turn}.mcp.json"
    ))))
    .expect("the harness config");
    let server = &config["mcpServers"]["sharedos"];
    assert_eq!(server["command"], "/opt/sharedos/bin/sharedos-mcp-shim");
    assert_eq!(
        server["args"],
        serde_json::json!([
            "--turn-token-file",
            format!("/run/sharedos-turns/{turn}.token")
        ])
    );
    assert_eq!(
        server["env"]["SHAREDOS_BROKER"],
        "/run/sharedos/bridge.sock"
    );
    assert!(
        !Path::new(&format!("/run/sharedos-turns/{turn}.token")).exists(),
        "the token file outlived the turn"
    );
    let _ = std::fs::remove_file(format!("/run/sharedos-turns/{turn}.mcp.json"));
    assert!(
        of_kind(&lines, "turn_closed")
            .iter()
            .any(|l| l["turn"] == turn.as_str() && l["reason"] == "host"),
        "the turn close is not on record"
    );
}

/// `docs/benchmarks.md`: the benchmark suite's smoke run writes its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "builds the benchmark suite in release and runs every section once: minutes; cargo test -- --include-ignored, or bash .ci/run"]
async fn docs_benchmarks_block_runs_as_written() {
    let ran = run_blocks(&["benchmarks"], Duration::from_secs(1800)).await;
    let report = read(&ran.work.path().join("BENCHMARKS.md"));
    assert!(
        report.contains("--quick: a smoke run"),
        "not the smoke run's report:\n{report}"
    );
    // The sections of the sandbox, per-principal instances and remote providers ran too: each
    // heading once, and with a Python for the remote server, its rows measured.
    for section in ["\n## 7. ", "\n## 8. ", "\n## 9. "] {
        assert_eq!(report.matches(section).count(), 1, "{section:?}:\n{report}");
    }
    if std::env::var_os("SHAREDOS_PYTHON").is_some_and(|p| !p.is_empty()) {
        assert!(
            !report.contains("Not measured in this run") && report.contains("HTTPS (test CA)"),
            "the remote section did not run with SHAREDOS_PYTHON set:\n{report}"
        );
    }
}
