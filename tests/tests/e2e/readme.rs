//! The README's harness sections, run exactly as written: the blocks marked
//! `<!-- readme-test: NAME -->` are extracted from README.md and run by bash, `setup`, then one
//! harness's block, then `teardown`, with `sharedos-broker` on `PATH` and `WORK` set to a fresh
//! folder. Each run must leave a succeeded `files.read` of `/public/hello.txt` and its client on
//! record, and write nothing outside `WORK` (the shell's `HOME` is an empty folder that must stay
//! empty). When the README and the commands drift apart, these tests fail.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::kit::bin;

const NAMES: [&str; 9] = [
    "setup",
    "claude-code",
    "codex",
    "pi",
    "qwen-code",
    "opencode",
    "gemini-cli",
    "cline",
    "teardown",
];

/// The README's marked blocks by name.
fn blocks() -> BTreeMap<String, String> {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let text = std::fs::read_to_string(&readme).expect("README.md");
    let mut out = BTreeMap::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line
            .trim()
            .strip_prefix("<!-- readme-test: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        assert_eq!(
            lines.next().map(str::trim),
            Some("```sh"),
            "the README block `{name}` must start right after its marker with ```sh"
        );
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        assert!(
            out.insert(name.to_owned(), body.join("\n")).is_none(),
            "two README blocks are named `{name}`"
        );
    }
    out
}

/// Always runs: the README has every block the harness tests run, and nothing else is marked.
#[test]
fn the_readme_marks_its_runnable_blocks() {
    let b = blocks();
    let names: Vec<&str> = b.keys().map(String::as_str).collect();
    let mut want = NAMES.to_vec();
    want.sort_unstable();
    assert_eq!(names, want);
    for (name, body) in &b {
        assert!(!body.trim().is_empty(), "README block `{name}` is empty");
    }
}

/// Always runs: the interop matrix the README points to (in `docs/interop.md`, between
/// `<!-- column-matrix: begin -->` and `<!-- column-matrix: end -->`) is exactly what
/// `sharedos-broker column matrix tests/interop/matrix` renders from the committed summaries, and
/// it has a line for every harness the README runs.
#[test]
fn the_readme_matrix_is_rendered_from_the_committed_summaries() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("docs/interop.md")).expect("docs/interop.md");
    let (begin, end) = (
        "<!-- column-matrix: begin -->\n",
        "<!-- column-matrix: end -->",
    );
    let start = text.find(begin).expect("docs/interop.md marks its matrix") + begin.len();
    let stop = start + text[start..].find(end).expect("the matrix's end marker");
    let out = std::process::Command::new(bin("sharedos-broker"))
        .args(["column", "matrix", "tests/interop/matrix"])
        .current_dir(&root)
        .output()
        .expect("column matrix");
    let rendered = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        &text[start..stop],
        rendered,
        "the interop matrix in docs/interop.md is out of date with tests/interop/matrix: paste the output of `sharedos-broker column matrix tests/interop/matrix` between its markers"
    );
    let harnesses: Vec<&str> = rendered
        .lines()
        .skip(2)
        .filter_map(|l| l.split('|').nth(1).map(str::trim))
        .collect();
    let mut want: Vec<&str> = NAMES
        .iter()
        .copied()
        .filter(|n| !matches!(*n, "setup" | "teardown"))
        .collect();
    want.sort_unstable();
    assert_eq!(harnesses, want);
}

fn ci_cache() -> PathBuf {
    match std::env::var_os("SHAREDOS_CI_CACHE") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sharedos-ci")
        }
    }
}

async fn run_section(harness: &str) {
    if crate::kit::installed("harnesses", ".ci/install-harnesses").is_none() {
        return;
    }
    let b = blocks();
    let work = tempfile::tempdir().expect("work");
    let home = tempfile::tempdir().expect("home");
    let script = format!(
        "set -euo pipefail\n{}\n{}\nset +e\n{}\n",
        b["setup"], b[harness], b["teardown"]
    );
    let bins = bin("sharedos-broker")
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg("-c")
        .arg(&script)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env("PATH", path)
        .env("WORK", work.path())
        .env("HOME", home.path())
        .env("SHAREDOS_CI_CACHE", ci_cache())
        .env_remove("SHAREDOS_RUNTIME_DIR")
        .env_remove("SHAREDOS_BROKER")
        .env_remove("SHAREDOS_TURN_TOKEN")
        .env_remove("ANTHROPIC_AUTH_TOKEN")
        .env_remove("CLAUDE_CODE_OAUTH_TOKEN")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("bash");
    let out = tokio::time::timeout(Duration::from_secs(300), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("the README's {harness} section did not finish in 300 s"))
        .expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let broker_log = std::fs::read_to_string(work.path().join("broker.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "the README's {harness} section failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- broker log\n{broker_log}",
        out.status
    );
    let record = std::fs::read_to_string(work.path().join("run/default/record.jsonl"))
        .expect("the broker's record in WORK");
    let lines: Vec<Value> = record
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let read = lines
        .iter()
        .find(|l| l["kind"] == "call" && l["tool"] == "files.read")
        .unwrap_or_else(|| panic!("no files.read call on record:\n{record}\n--- stdout\n{stdout}"));
    assert_eq!(read["outcome"], "succeeded", "{read}");
    assert_eq!(read["arguments"]["path"], "/public/hello.txt", "{read}");
    let turn = read["turn"].clone();
    assert!(
        lines
            .iter()
            .any(|l| l["kind"] == "bridge_client" && l["turn"] == turn),
        "the harness's MCP client is not on record:\n{record}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["kind"] == "turn_closed" && l["turn"] == turn && l["reason"] == "host"),
        "the section's turn close is not on record:\n{record}"
    );
    // The table `records --turn` printed.
    assert!(
        stdout.contains("files.read") && stdout.contains("succeeded/ok"),
        "{stdout}"
    );
    let written = crate::kit::names_in(home.path());
    assert!(
        written.is_empty(),
        "the README's {harness} section wrote outside WORK, into HOME: {written:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_claude_code_section_runs_as_written() {
    run_section("claude-code").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_codex_section_runs_as_written() {
    run_section("codex").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_pi_section_runs_as_written() {
    run_section("pi").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_qwen_code_section_runs_as_written() {
    run_section("qwen-code").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_opencode_section_runs_as_written() {
    run_section("opencode").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_gemini_cli_section_runs_as_written() {
    run_section("gemini-cli").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real harness CLIs: run bash .ci/install-harnesses, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn readme_cline_section_runs_as_written() {
    run_section("cline").await;
}
