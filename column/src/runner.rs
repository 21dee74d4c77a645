//! The MCP conformance column: run an installed harness CLI natively against one turn's
//! permission-filtered catalogue, then grade declared attempts from the record.
//!
//! Owns: the host config (the harness command, args and env — opaque, passed through — the
//! declared model, MCP support), the rows, the prompt, running the harness with a time limit, and
//! grading. It never manufactures a call: a row the harness did not attempt is graded
//! `not_exercised`. Attempts are matched on tool + resource (a live harness mints its own ids).
//! It talks to the broker only as a host does, over the control socket.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sharedos_ipc::runtime;
use sharedos_proto::alias::Harness;
use sharedos_proto::declaration::{SystemIdentityError, ToolPolicyError};
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn};
use sharedos_proto::record::{self, Event, RecordLine};
use sharedos_proto::{McpSupport, PolicyMode, SystemIdentity, ToolPolicy};

use sharedos_host::client::{ClientError, ControlClient};
use sharedos_host::harness_config::{self, HarnessConfigError, ShimLaunch, TokenSource};
use sharedos_host::shim_path::ShimPathError;

pub use crate::grade::Grade;
use crate::observed::{self, Expectation, Observed};
use crate::scripted_model::LoggedRequest;

/// Exit status of `column run` when some row did not pass.
pub const EXIT_NOT_ALL_PASSED: u8 = 4;

/// Why a column could not run (a row that fails is a grade, not an error).
///
/// A context chain: each message says what failed and names the file or input, and the
/// underlying error, if any, is the `source` (the CLI prints the whole chain).
#[derive(Debug, thiserror::Error)]
pub enum ColumnError {
    #[error("record line seq {seq} is not a record event")]
    RecordLine { seq: u64, source: serde_json::Error },
    #[error("cannot read host config `{}`", path.display())]
    HostConfigRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("host config `{}`", path.display())]
    HostConfigParse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("host config `{}`: {detail}", path.display())]
    HostConfigInvalid { path: PathBuf, detail: String },
    #[error("host config `{}`: harness_local", path.display())]
    HarnessLocal {
        path: PathBuf,
        source: ToolPolicyError,
    },
    #[error("host config `{}`", path.display())]
    SystemIdentity {
        path: PathBuf,
        source: SystemIdentityError,
    },
    #[error("cannot read rows `{}`", path.display())]
    RowsRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("rows `{}`", path.display())]
    RowsParse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("rows `{}`: {detail}", path.display())]
    RowsInvalid { path: PathBuf, detail: String },
    /// A folder (the workdir, the harness's cwd) or a harness log file.
    #[error("cannot create `{}`", path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot make `{}` absolute", path.display())]
    Absolute {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create a temporary workdir")]
    TempDir(#[source] std::io::Error),
    /// Talking to the broker (including an answer of the wrong kind).
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot read config_base `{}`", path.display())]
    ConfigBase {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Writing the harness's MCP config or an extra file.
    #[error(transparent)]
    Config(#[from] HarnessConfigError),
    #[error(transparent)]
    Shim(#[from] ShimPathError),
    #[error("cannot start the harness `{command}`")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("cannot wait for the harness `{command}`")]
    Wait {
        command: String,
        source: std::io::Error,
    },
    #[error("cannot read the model log `{}`", path.display())]
    ModelLog {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the harness config `{}` back", path.display())]
    ConfigReadBack {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write manifest `{}`", path.display())]
    Manifest {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// `std::path::absolute`, naming the path when it fails.
fn absolute(path: impl AsRef<Path>) -> Result<PathBuf, ColumnError> {
    let path = path.as_ref();
    std::path::absolute(path).map_err(|source| ColumnError::Absolute {
        path: path.to_path_buf(),
        source,
    })
}

/// The host's description of one column (TOML).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// The harness, as recorded in SystemIdentity (`claude-code`, `codex`, `pi`, ...).
    pub harness: String,
    #[serde(default)]
    pub harness_version: Option<String>,
    /// The model the host configured the harness with. Recorded, never selected.
    pub declared_model: String,
    pub mcp_support: McpSupport,
    /// Required exactly when mcp_support = "extension".
    #[serde(default)]
    pub extension: Option<String>,
    /// Which MCP config to write: claude-code, codex, pi, cordis, qwen-code, opencode,
    /// gemini-cli or cline.
    pub config_format: String,
    /// Where to write it (placeholders allowed). Default `{workdir}/sharedos-mcp-config`.
    #[serde(default)]
    pub config_path: Option<String>,
    /// A file whose content the config is merged into (e.g. Codex's config.toml with the model
    /// provider); relative to the host config.
    #[serde(default)]
    pub config_base: Option<PathBuf>,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub env_remove: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default = "default_timeout")]
    pub timeout_seconds: u64,
    pub principal: String,
    #[serde(default)]
    pub agent: Option<String>,
    /// The harness's own tools, named one by one.
    pub harness_local: Vec<String>,
    /// The ToolPolicy's mode: `strict` (the default: every tool the harness offers is the
    /// boundary's or declared harness-local) or `open` (tools of servers configured in the
    /// harness outside SharedOS may be declared in `external_direct`).
    #[serde(default)]
    pub tool_policy: PolicyMode,
    /// Tools the harness reaches outside SharedOS, each an offered tool name or the name of a
    /// server in its config (all that server's tools). Only under `tool_policy = "open"`: a
    /// strict policy with external entries is refused. Graded by the `external-direct` check:
    /// offered as declared, never called through the boundary.
    #[serde(default)]
    pub external_direct: Vec<String>,
    /// The arguments after `command` that print the harness's version (default `["--version"]`;
    /// placeholders allowed, e.g. `["{pi}", "--version"]` where the command is an interpreter).
    /// The column runs it itself and records what it printed beside the declared version.
    #[serde(default)]
    pub version_args: Option<Vec<String>>,
    #[serde(default)]
    pub portable_names: bool,
    /// Extra files to write before the run (e.g. pi's models.json).
    #[serde(default)]
    pub files: Vec<ExtraFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtraFile {
    pub path: String,
    pub content: String,
}

fn default_timeout() -> u64 {
    180
}

/// What a row expects the kernel to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    Allowed,
    Denied,
    /// The column closes the turn while the harness runs, once the record shows a call for
    /// every row before this one; the call is then attempted in a closed turn. It passes when
    /// no call runs after the close and the harness exits by itself (see [`grade_turn_closed`]).
    /// Only the last row may expect it.
    TurnClosed,
}

/// One declared attempt.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    pub id: String,
    pub tool: String,
    #[serde(default)]
    pub arguments: serde_json::Map<String, Value>,
    pub expect: Expect,
    /// The outcome code the recorded call must carry too (`budget_exhausted`, `ok`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

pub fn read_host_config(path: &Path) -> Result<HostConfig, ColumnError> {
    let text = std::fs::read_to_string(path).map_err(|source| ColumnError::HostConfigRead {
        path: path.to_path_buf(),
        source,
    })?;
    let mut cfg: HostConfig = toml::from_str(&text).map_err(|e| ColumnError::HostConfigParse {
        path: path.to_path_buf(),
        source: Box::new(e),
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    cfg.config_base = cfg
        .config_base
        .map(|p| if p.is_absolute() { p } else { base.join(p) });
    config_format(path, &cfg)?;
    if cfg.timeout_seconds == 0 {
        return Err(ColumnError::HostConfigInvalid {
            path: path.to_path_buf(),
            detail: "timeout_seconds must be at least 1".into(),
        });
    }
    Ok(cfg)
}

/// The host config's `config_format`, refused naming the host config.
fn config_format(path: &Path, cfg: &HostConfig) -> Result<Harness, ColumnError> {
    harness_config::parse_format(&cfg.config_format).map_err(|e| ColumnError::HostConfigInvalid {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

pub fn read_rows(path: &Path) -> Result<Vec<Row>, ColumnError> {
    let invalid = |detail: String| ColumnError::RowsInvalid {
        path: path.to_path_buf(),
        detail,
    };
    let text = std::fs::read_to_string(path).map_err(|source| ColumnError::RowsRead {
        path: path.to_path_buf(),
        source,
    })?;
    let rows: Vec<Row> = serde_json::from_str(&text).map_err(|source| ColumnError::RowsParse {
        path: path.to_path_buf(),
        source,
    })?;
    if rows.is_empty() {
        return Err(invalid("no rows".into()));
    }
    let mut ids = std::collections::HashSet::new();
    for (i, r) in rows.iter().enumerate() {
        if !ids.insert(r.id.as_str()) {
            return Err(invalid(format!("row id `{}` appears twice", r.id)));
        }
        if r.expect == Expect::TurnClosed {
            if i + 1 != rows.len() {
                return Err(invalid(format!(
                    "row `{}` expects turn_closed but is not the last row (nothing can be called after the close)",
                    r.id
                )));
            }
            if r.code.is_some() {
                return Err(invalid(format!(
                    "row `{}` expects turn_closed, which records no call: it cannot name a code",
                    r.id
                )));
            }
        }
    }
    Ok(rows)
}

/// The prompt: the declared attempts, in words a model can follow.
pub fn prompt(rows: &[Row]) -> String {
    let mut p = String::from(
        "You are being tested on tool use. Use the SharedOS MCP tools to make exactly the following \
         tool calls, in this order, one at a time. Make every call even if an earlier one is refused \
         or fails; do not use any other tool; do not retry. After the last call, reply with the \
         word DONE.\n",
    );
    for (i, r) in rows.iter().enumerate() {
        p.push_str(&format!(
            "{}. call `{}` with arguments {}{}\n",
            i + 1,
            r.tool,
            Value::Object(r.arguments.clone()),
            if r.expect == Expect::TurnClosed {
                " (the turn may have been closed by then: make the call anyway)"
            } else {
                ""
            }
        ));
    }
    p
}

fn expand(s: &str, vars: &[(&str, &str)]) -> String {
    let mut out = s.to_owned();
    for (k, v) in vars {
        out = out.replace(&format!("{{{k}}}"), v);
    }
    out
}

/// Options of one run.
pub struct RunOptions {
    pub runtime_dir: PathBuf,
    pub host_config: PathBuf,
    pub rows: PathBuf,
    pub out: PathBuf,
    /// Keep the harness's work dir (its logs and config) here instead of a temp dir.
    pub workdir: Option<PathBuf>,
    /// The scripted model's log (`scripted-model --log`): the lines it gains during the run
    /// show what the harness offered its model and the model it asked for.
    pub model_log: Option<PathBuf>,
}

/// The length of the model log before the run (0 when it does not exist yet).
fn log_offset(path: &Path) -> Result<u64, ColumnError> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(source) => Err(ColumnError::ModelLog {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The model requests logged after `offset`. A line cut short by a writer still running, or
/// not JSON, is no request.
#[cfg(test)]
fn logged_requests(path: &Path, offset: u64) -> Result<Vec<LoggedRequest>, ColumnError> {
    Ok(log_lines(path, offset)?
        .iter()
        .filter_map(LoggedRequest::from_log_line)
        .collect())
}

/// The model log's lines after `offset`, each as JSON (a cut or non-JSON line is left out).
fn log_lines(path: &Path, offset: u64) -> Result<Vec<Value>, ColumnError> {
    use std::io::{Read as _, Seek as _};
    let error = |source| ColumnError::ModelLog {
        path: path.to_path_buf(),
        source,
    };
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(error(e)),
    };
    file.seek(std::io::SeekFrom::Start(offset)).map_err(error)?;
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(error)?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect())
}

/// A recorded call against what its row expects: `allowed` wants `succeeded`, `denied` wants
/// `denied`, and a row's `code`, when it names one, must be the recorded code too (a refusal for
/// another reason is a `fail`). No recorded call can meet `turn_closed`.
pub fn grade_call(expect: Expect, code: Option<&str>, outcome: &str, recorded_code: &str) -> Grade {
    let outcome_ok = match expect {
        Expect::Allowed => outcome == "succeeded",
        Expect::Denied => outcome == "denied",
        Expect::TurnClosed => false,
    };
    if outcome_ok && code.is_none_or(|c| c == recorded_code) {
        Grade::Pass
    } else {
        Grade::Fail
    }
}

/// All the record lines of `turn` after `after_seq`, and the last seq seen.
async fn turn_records(
    host: &mut ControlClient,
    turn: &str,
    mut after_seq: u64,
) -> Result<(Vec<Value>, u64), ColumnError> {
    let mut lines = Vec::new();
    loop {
        match host
            .call(&ControlRequest::Records {
                turn: Some(turn.to_owned()),
                after_seq,
                limit: None,
            })
            .await?
        {
            ControlResponse::Records {
                lines: page,
                last_seq,
                more,
            } => {
                lines.extend(page);
                after_seq = after_seq.max(last_seq);
                if !more {
                    return Ok((lines, after_seq));
                }
            }
            other => return Err(ClientError::unexpected("records", other).into()),
        }
    }
}

/// How often the column reads the record while it waits to close the turn mid-run.
const CLOSE_POLL: Duration = Duration::from_millis(50);

/// The turn, closed by the column while the harness was still running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosedMidRun {
    /// The `call` lines the record showed when the column closed the turn.
    pub after_calls: usize,
}

/// Reads the turn's record (over a connection of its own) until it shows `calls` `call` lines
/// and, with a model log, until the log shows the model asked for step `calls` (the harness has
/// the last answer: a `call` line is written before its answer reaches the harness, and a close
/// in between would cut that answer off), then closes the turn. Runs until then; the caller
/// stops it when the harness ends first.
async fn close_after_calls(
    runtime_dir: &Path,
    turn: &str,
    calls: usize,
    model_log: Option<(&Path, u64)>,
) -> Result<ClosedMidRun, ColumnError> {
    let mut host = ControlClient::connect(runtime_dir).await?;
    let (mut seen, mut after_seq) = (0, 0);
    loop {
        let (lines, last) = turn_records(&mut host, turn, after_seq).await?;
        after_seq = last;
        seen += lines.iter().filter(|l| l["kind"] == "call").count();
        let asked = match model_log {
            Some((path, offset)) => step_seen(&log_lines(path, offset)?, calls)
                .attempted
                .is_some(),
            None => true,
        };
        if seen >= calls && asked {
            match host
                .call(&ControlRequest::CloseTurn {
                    turn: turn.to_owned(),
                })
                .await?
            {
                ControlResponse::TurnClosed { .. } => {
                    return Ok(ClosedMidRun { after_calls: seen });
                }
                other => return Err(ClientError::unexpected("close_turn", other).into()),
            }
        }
        tokio::time::sleep(CLOSE_POLL).await;
    }
}

/// The model log cut after the request line that played step `step` (the one answered with the
/// call a `turn_closed` row makes): the lines up to it, and those after it, logged once the
/// turn had closed. With no such line, all of it is before.
pub fn split_at_step(log: &[Value], step: usize) -> (&[Value], &[Value]) {
    match log.iter().position(|l| {
        l["kind"] == "request"
            && l["reply"] == "tool_call"
            && l["step"].as_u64() == Some(step as u64)
    }) {
        Some(at) => log.split_at(at + 1),
        None => (log, &[]),
    }
}

/// What the model log shows of the scripted step `step`: whether the model was answered with
/// that step's call (an attempt), and the text of the first tool result the harness sent back
/// after it (what it told the model of that call), if it sent one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSeen {
    pub attempted: Option<String>,
    pub model_saw: Option<String>,
}

/// Looks `step` up in the model log's lines (in log order).
pub fn step_seen(log: &[Value], step: usize) -> StepSeen {
    let at = log.iter().position(|l| {
        l["kind"] == "request"
            && l["reply"] == "tool_call"
            && l["step"].as_u64() == Some(step as u64)
    });
    let Some(at) = at else {
        return StepSeen {
            attempted: None,
            model_saw: None,
        };
    };
    StepSeen {
        attempted: log[at]["tool"].as_str().map(str::to_owned),
        model_saw: log[at + 1..]
            .iter()
            .find(|l| l["kind"] == "tool_result")
            .and_then(|l| l["text"].as_str())
            .map(str::to_owned),
    }
}

/// What grades a `turn_closed` row besides the row itself.
pub struct TurnClosedEvidence<'a> {
    /// The column's close while the harness ran, if it came to that.
    pub closed: Option<&'a ClosedMidRun>,
    /// The seq of the turn's `turn_closed` line.
    pub closed_seq: Option<u64>,
    /// The call matched to the row (tool + resource), with its seq.
    pub call: Option<(&'a record::Call, u64)>,
    /// Calls recorded after `turn_closed` that succeeded (none can).
    pub ran_after: usize,
    pub timed_out: bool,
    pub exit_code: Option<i32>,
    /// From the model log, when there is one.
    pub seen: Option<StepSeen>,
}

/// Grades a `turn_closed` row, with a detail saying why. `fail`: a call ran after the close, or
/// the harness did not exit by itself within its time limit (it hung). `not exercised`: the turn
/// was not closed mid-run, the call reached the broker before the close, or the model log does
/// not show the attempt after the close (no log, or the model was never answered with it).
/// Otherwise `pass`, saying what the harness told the model.
pub fn grade_turn_closed(e: &TurnClosedEvidence) -> (Grade, String) {
    let Some(closed) = e.closed else {
        return (
            Grade::NotExercised,
            "the turn was not closed mid-run: the harness ended before the record showed a call for every row before this one".into(),
        );
    };
    let exit = match e.exit_code {
        Some(c) => format!("exit {c}"),
        None => "no exit code".into(),
    };
    if let (Some((call, seq)), Some(closed_seq)) = (e.call, e.closed_seq)
        && seq < closed_seq
    {
        return (
            Grade::NotExercised,
            format!(
                "the call reached the broker before the close ({}/{}): nothing was attempted in a closed turn",
                call.outcome, call.code
            ),
        );
    }
    if e.ran_after > 0 {
        return (
            Grade::Fail,
            format!("{} call(s) ran after the turn closed", e.ran_after),
        );
    }
    if e.timed_out {
        return (
            Grade::Fail,
            format!(
                "the turn closed after {} call(s) and the harness did not exit by itself within its time limit (it hung)",
                closed.after_calls
            ),
        );
    }
    let Some(seen) = &e.seen else {
        return (
            Grade::NotExercised,
            format!(
                "the turn closed after {} call(s); without --model-log the attempt after the close is not seen ({exit})",
                closed.after_calls
            ),
        );
    };
    let Some(tool) = &seen.attempted else {
        return (
            Grade::NotExercised,
            format!(
                "the turn closed after {} call(s); the model was never answered with the call (the harness sent no request for it, or no longer offered the tool); {exit}",
                closed.after_calls
            ),
        );
    };
    let saw = match &seen.model_saw {
        Some(t) => format!("the harness told the model {t:?}"),
        None => "the harness sent the model no result for it".into(),
    };
    (
        Grade::Pass,
        format!(
            "the turn closed after {} call(s); the model called `{tool}`; no call ran; {saw}; {exit}",
            closed.after_calls
        ),
    )
}

struct HarnessRun {
    exit_code: Option<i32>,
    timed_out: bool,
    duration: Duration,
}

async fn run_harness(
    cfg: &HostConfig,
    vars: &[(&str, &str)],
    workdir: &Path,
) -> Result<HarnessRun, ColumnError> {
    let command = expand(&cfg.command, vars);
    let mut cmd = tokio::process::Command::new(&command);
    cmd.args(cfg.args.iter().map(|a| expand(a, vars)));
    for k in &cfg.env_remove {
        cmd.env_remove(k);
    }
    for (k, v) in &cfg.env {
        cmd.env(k, expand(v, vars));
    }
    let cwd = cfg
        .cwd
        .as_deref()
        .map_or_else(|| workdir.to_path_buf(), |c| PathBuf::from(expand(c, vars)));
    std::fs::create_dir_all(&cwd).map_err(|source| ColumnError::Create {
        path: cwd.clone(),
        source,
    })?;
    let log = |name: &str| {
        let path = workdir.join(name);
        std::fs::File::create(&path).map_err(|source| ColumnError::Create { path, source })
    };
    let stdout = log("harness.stdout.log")?;
    let stderr = log("harness.stderr.log")?;
    cmd.current_dir(&cwd)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .kill_on_drop(true)
        .process_group(0);
    let started = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(source) => return Err(ColumnError::Spawn { command, source }),
    };
    let pid = child.id();
    let waited = tokio::time::timeout(Duration::from_secs(cfg.timeout_seconds), child.wait()).await;
    let (exit_code, timed_out) = match waited {
        Ok(status) => (
            status
                .map_err(|source| ColumnError::Wait { command, source })?
                .code(),
            false,
        ),
        Err(_) => {
            // The whole process group: harnesses start helpers (and the shim) of their own.
            if let Some(pid) = pid {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &format!("-{pid}")])
                    .status();
            }
            let _ = child.kill().await;
            (None, true)
        }
    };
    Ok(HarnessRun {
        exit_code,
        timed_out,
        duration: started.elapsed(),
    })
}

/// The host config's ToolPolicy, checked: a strict one with `external_direct` entries is refused
/// naming the host config.
pub fn tool_policy(path: &Path, cfg: &HostConfig) -> Result<ToolPolicy, ColumnError> {
    let policy = ToolPolicy {
        mode: cfg.tool_policy,
        harness_local: cfg.harness_local.clone(),
        external_direct: cfg.external_direct.clone(),
    };
    policy
        .validate(true)
        .map_err(|source| ColumnError::HarnessLocal {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(policy)
}

/// The version a harness printed: the first word of its output's first non-empty line that
/// starts with a digit and holds a dot (`2.1.332 (Claude Code)`, `codex-cli 0.171.0`), a leading
/// `v` dropped.
pub fn version_in(output: &str) -> Option<String> {
    let line = output.lines().find(|l| !l.trim().is_empty())?;
    line.split_whitespace()
        .map(|w| w.strip_prefix('v').unwrap_or(w))
        .map(|w| w.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '.' && c != '-'))
        .find(|w| w.starts_with(|c: char| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_owned)
}

/// Runs the harness's version command (`command` + `version_args`, the run's env and cwd, 30 s
/// at most) and says what it printed: `{"version", "output", "exitCode", "args"}`, `version`
/// null (with `error`) when it printed none. Measured, never used to correct the declaration.
async fn measure_version(cfg: &HostConfig, vars: &[(&str, &str)], cwd: &Path) -> Value {
    let args: Vec<String> = cfg
        .version_args
        .clone()
        .unwrap_or_else(|| vec!["--version".to_owned()])
        .iter()
        .map(|a| expand(a, vars))
        .collect();
    let mut cmd = tokio::process::Command::new(expand(&cfg.command, vars));
    cmd.args(&args);
    for k in &cfg.env_remove {
        cmd.env_remove(k);
    }
    for (k, v) in &cfg.env {
        cmd.env(k, expand(v, vars));
    }
    cmd.current_dir(cwd)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .process_group(0);
    let shown = args.join(" ");
    match tokio::time::timeout(Duration::from_secs(30), cmd.output()).await {
        Ok(Ok(o)) => {
            let stdout = String::from_utf8_lossy(&o.stdout);
            let stderr = String::from_utf8_lossy(&o.stderr);
            let text = if stdout.trim().is_empty() {
                stderr
            } else {
                stdout
            };
            let mut first = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
                .to_owned();
            sharedos_proto::name::clip(&mut first, 200);
            let version = version_in(&first);
            let mut v = json!({"args": shown, "exitCode": o.status.code(), "output": first, "version": version});
            if version.is_none() {
                v["error"] = json!("it printed no version");
            }
            v
        }
        Ok(Err(e)) => {
            json!({"args": shown, "version": null, "error": format!("cannot start it: {e}")})
        }
        Err(_) => json!({"args": shown, "version": null, "error": "no answer within 30 s"}),
    }
}

/// What a row's approval came to, in words a matrix cell can hold: `asked, approved`,
/// `declined by the client`, `cancelled by the client`, `no question shown: operator approved`,
/// `no question shown: the harness cannot ask`, `asked, no answer (timed out)`, ... From the
/// `approval_decided` line of the row's call.
pub fn approval_said(d: &record::ApprovalDecided) -> String {
    let by = d.by.as_deref();
    let action = d.session.as_ref().map(|s| s.action.as_str());
    // A form answered in the harness: `harness_session` (records before issue 45 said
    // `principal` for it, with the harness `session`).
    let by = match (by, &d.session) {
        (Some("principal"), Some(_)) => Some(record::BY_HARNESS_SESSION),
        (by, _) => by,
    };
    match (d.decision.as_str(), by, action) {
        ("approved", Some("harness_session"), _) => "asked, approved".to_owned(),
        ("approved", Some("principal"), _) => "approved on the person's page".to_owned(),
        ("approved", Some("operator"), _) => "no question shown: operator approved".to_owned(),
        ("denied", Some("harness_session"), Some("decline")) => "declined by the client".to_owned(),
        ("denied", Some("harness_session"), Some("cancel")) => "cancelled by the client".to_owned(),
        ("denied", Some("harness_session"), _) => "asked, denied".to_owned(),
        ("denied", Some("principal"), _) => "denied on the person's page".to_owned(),
        ("denied", Some("operator"), _) => "no question shown: operator denied".to_owned(),
        ("unavailable", _, _) => "no question shown: the harness cannot ask".to_owned(),
        ("timeout", _, _) => "nobody answered (timed out)".to_owned(),
        ("cancelled", _, _) => "cancelled before an answer".to_owned(),
        (other, by, _) => format!("{other} (by {})", by.unwrap_or("nobody")),
    }
}

/// Runs the column; returns the manifest and whether every row passed.
pub async fn run(opts: &RunOptions) -> Result<(Value, bool), ColumnError> {
    let cfg = read_host_config(&opts.host_config)?;
    let rows = read_rows(&opts.rows)?;
    let format = config_format(&opts.host_config, &cfg)?;
    let tool_policy = tool_policy(&opts.host_config, &cfg)?;
    let identity = SystemIdentity {
        harness: cfg.harness.clone(),
        harness_version: cfg.harness_version.clone(),
        mcp_support: cfg.mcp_support,
        extension: cfg.extension.clone(),
        declared_model: cfg.declared_model.clone(),
        catalog_hash: None,
        broker_version: None,
    };
    identity
        .validate()
        .map_err(|source| ColumnError::SystemIdentity {
            path: opts.host_config.clone(),
            source,
        })?;

    let temp;
    let workdir = match &opts.workdir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|source| ColumnError::Create {
                path: d.clone(),
                source,
            })?;
            // The harness runs inside the workdir: every path handed to it must be absolute,
            // or `{config}` names nothing from there.
            absolute(d)?
        }
        None => {
            temp = tempfile::Builder::new()
                .prefix("sharedos-column-")
                .tempdir()
                .map_err(ColumnError::TempDir)?;
            temp.path().to_path_buf()
        }
    };
    let mut host = ControlClient::connect(&opts.runtime_dir).await?;
    let open = OpenTurn {
        principal: cfg.principal.clone(),
        agent: cfg.agent.clone(),
        tool_policy: Some(tool_policy.clone()),
        system_identity: Some(identity),
        ttl_seconds: Some(cfg.timeout_seconds + 60),
        harness: Some(format.as_str().to_owned()),
        portable_names: cfg.portable_names,
        ..Default::default()
    };
    let turn = match host.call(&ControlRequest::OpenTurn(Box::new(open))).await? {
        ControlResponse::TurnOpened(t) => t,
        other => return Err(ClientError::unexpected("open_turn", other).into()),
    };
    let started_at = sharedos_proto::record::now_rfc3339();
    let close_at = rows.iter().position(|r| r.expect == Expect::TurnClosed);
    let log_start = opts.model_log.as_deref().map(log_offset).transpose()?;
    let result = async {
        let workdir_s = workdir.display().to_string();
        let pre = [("workdir", workdir_s.as_str())];
        let config_path = absolute(expand(
            cfg.config_path
                .as_deref()
                .unwrap_or("{workdir}/sharedos-mcp-config"),
            &pre,
        ))?;
        if let Some(base) = &cfg.config_base {
            let text = std::fs::read_to_string(base).map_err(|source| ColumnError::ConfigBase {
                path: base.clone(),
                source,
            })?;
            harness_config::write_private(&config_path, &expand(&text, &pre), None)
                .map_err(HarnessConfigError::from)?;
        }
        let launch = ShimLaunch {
            shim: sharedos_host::shim_path::locate_shim()?,
            bridge: absolute(runtime::bridge_socket(&opts.runtime_dir))?,
            token: TokenSource::Env(turn.token.expose().to_owned()),
            broker_uid: host.broker_uid(),
        };
        harness_config::write(format, &launch, &config_path, None)?;
        for f in &cfg.files {
            let path = absolute(expand(&f.path, &pre))?;
            harness_config::write_private(&path, &expand(&f.content, &pre), None)
                .map_err(HarnessConfigError::from)?;
        }
        let prompt = prompt(&rows);
        let config_s = config_path.display().to_string();
        let vars = [
            ("workdir", workdir_s.as_str()),
            ("config", config_s.as_str()),
            ("prompt", prompt.as_str()),
        ];
        let written = std::fs::read_to_string(&config_path).map_err(|source| {
            ColumnError::ConfigReadBack {
                path: config_path.clone(),
                source,
            }
        })?;
        let others = harness_config::other_servers(format, &written);
        let cwd = cfg
            .cwd
            .as_deref()
            .map_or_else(|| workdir.clone(), |c| PathBuf::from(expand(c, &vars)));
        std::fs::create_dir_all(&cwd).map_err(|source| ColumnError::Create {
            path: cwd.clone(),
            source,
        })?;
        let measured = measure_version(&cfg, &vars, &cwd).await;
        let harness = run_harness(&cfg, &vars, &workdir);
        let Some(before) = close_at else {
            return Ok::<_, ColumnError>((harness.await?, others, None, measured));
        };
        // A `turn_closed` row: close the turn once the rows before it have their calls, while
        // the harness runs on; if it ends first, nothing is closed mid-run.
        tokio::pin!(harness);
        let log = opts.model_log.as_deref().zip(log_start);
        let watch = close_after_calls(&opts.runtime_dir, &turn.turn, before, log);
        tokio::pin!(watch);
        tokio::select! {
            run = &mut harness => Ok((run?, others, None, measured)),
            closed = &mut watch => {
                let closed = closed?;
                Ok((harness.await?, others, Some(closed), measured))
            }
        }
    }
    .await;
    // Close the turn whatever happened: the shim exits, the token dies.
    let _ = host
        .call(&ControlRequest::CloseTurn {
            turn: turn.turn.clone(),
        })
        .await;
    let (harness_run, other_servers, closed_mid_run, measured) = result?;
    let finished_at = sharedos_proto::record::now_rfc3339();

    // The record of the turn.
    let (lines, _) = turn_records(&mut host, &turn.turn, 0).await?;
    let mut identity: Option<SystemIdentity> = None;
    let mut catalogue: Vec<String> = Vec::new();
    let mut calls: Vec<(record::Call, bool, u64)> = Vec::new();
    let mut closed_seq: Option<u64> = None;
    let mut decided: BTreeMap<String, record::ApprovalDecided> = BTreeMap::new();
    for line in lines {
        let seq = line.get("seq").and_then(Value::as_u64).unwrap_or(0);
        let line: RecordLine =
            serde_json::from_value(line).map_err(|e| ColumnError::RecordLine { seq, source: e })?;
        match line.event {
            Event::TurnOpened(o) => {
                identity = o.system_identity;
                catalogue = o.tools;
            }
            Event::Call(c) => calls.push((c, false, seq)),
            Event::TurnClosed(_) => closed_seq = closed_seq.or(Some(seq)),
            Event::ApprovalDecided(d) => {
                decided.insert(d.call_id.clone(), d);
            }
            _ => {}
        }
    }
    let model_lines = match (&opts.model_log, log_start) {
        (Some(path), Some(offset)) => Some(log_lines(path, offset)?),
        _ => None,
    };

    // Calls that ran after the turn closed (none can).
    let ran_after = match closed_seq {
        Some(closed) => calls
            .iter()
            .filter(|(c, _, seq)| *seq > closed && c.outcome == "succeeded")
            .count(),
        None => 0,
    };
    // What each row requires, as the kernel resolves it (for matching on tool + resource).
    let mut graded = Vec::new();
    let (mut pass, mut fail, mut not_exercised) = (0, 0, 0);
    for row in &rows {
        let check = ControlRequest::PolicyCheck {
            principal: cfg.principal.clone(),
            agent: cfg.agent.clone(),
            tool: row.tool.clone(),
            arguments: Some(Value::Object(row.arguments.clone())),
        };
        let requirement = match host.call(&check).await? {
            ControlResponse::Decision { requirement, .. } => requirement,
            other => return Err(ClientError::unexpected("policy check", other).into()),
        };
        let resource = requirement.as_ref().map(|r| r.resource.clone());
        let found = calls.iter_mut().find(|(c, used, _)| {
            !*used
                && c.tool == row.tool
                && c.requirement.as_ref().map(|r| r.resource.as_str()) == resource.as_deref()
        });
        let mut detail: Option<String> = None;
        let (grade, outcome, code, call_ids) = match (row.expect, found) {
            (Expect::TurnClosed, found) => {
                let call = found.map(|(c, used, seq)| {
                    *used = true;
                    (&*c, *seq)
                });
                let (outcome, code, ids) = match call {
                    Some((c, _)) => (
                        Some(c.outcome.clone()),
                        Some(c.code.clone()),
                        vec![c.call_id.clone()],
                    ),
                    None => (None, None, vec![]),
                };
                let step = graded.len();
                let (grade, why) = grade_turn_closed(&TurnClosedEvidence {
                    closed: closed_mid_run.as_ref(),
                    closed_seq,
                    call,
                    ran_after,
                    timed_out: harness_run.timed_out,
                    exit_code: harness_run.exit_code,
                    seen: model_lines.as_deref().map(|l| step_seen(l, step)),
                });
                detail = Some(why);
                (grade, outcome, code, ids)
            }
            (_, None) => (Grade::NotExercised, None, None, vec![]),
            (expect, Some((call, used, _))) => {
                *used = true;
                (
                    grade_call(expect, row.code.as_deref(), &call.outcome, &call.code),
                    Some(call.outcome.clone()),
                    Some(call.code.clone()),
                    vec![call.call_id.clone()],
                )
            }
        };
        match grade {
            Grade::Pass => pass += 1,
            Grade::Fail => fail += 1,
            Grade::NotExercised => not_exercised += 1,
        }
        let mut line = json!({
            "id": row.id, "tool": row.tool, "arguments": row.arguments, "expect": row.expect,
            "requirement": requirement, "grade": grade, "outcome": outcome, "code": code,
            "matchedCallIds": call_ids, "systemIdentity": identity,
        });
        if let Some(c) = &row.code {
            line["expectCode"] = json!(c);
        }
        if let Some(d) = detail {
            line["detail"] = json!(d);
        }
        if let Some(d) = call_ids.first().and_then(|id| decided.get(id)) {
            line["approval"] = json!({
                "said": approval_said(d), "decision": d.decision, "by": d.by,
                "via": d.session.as_ref().and_then(|s| s.via.clone()),
                "action": d.session.as_ref().map(|s| s.action.clone()),
            });
        }
        graded.push(line);
    }
    let calls_tools: Vec<String> = calls.iter().map(|(c, _, _)| c.tool.clone()).collect();
    let extra: Vec<Value> = calls
        .into_iter()
        .filter(|(_, used, _)| !used)
        .map(|(c, _, _)| {
            json!({"callId": c.call_id, "tool": c.tool, "arguments": c.kept_arguments(),
                   "requirement": c.requirement, "outcome": c.outcome, "code": c.code})
        })
        .collect();
    // What the harness offered its model, where the scripted model's log shows it.
    // A harness rightly stops offering a server's tools once the turn closed under it: the
    // requests after the close are counted apart, not held against the catalogue.
    let (before_close, after_close) = match (&model_lines, closed_mid_run.as_ref(), close_at) {
        (Some(lines), Some(_), Some(step)) => {
            let (before, after) = split_at_step(lines, step);
            (Some(before), after)
        }
        (Some(lines), _, _) => (Some(lines.as_slice()), &[][..]),
        (None, _, _) => (None, &[][..]),
    };
    let after_close: Vec<LoggedRequest> = after_close
        .iter()
        .filter_map(LoggedRequest::from_log_line)
        .collect();
    let mut observed: Option<Observed> = match before_close {
        Some(lines) => {
            let requests: Vec<LoggedRequest> = lines
                .iter()
                .filter_map(LoggedRequest::from_log_line)
                .collect();
            Some(observed::observe(
                &Expectation {
                    harness: format,
                    catalogue: &catalogue,
                    portable_names: cfg.portable_names,
                    tool_policy: &tool_policy,
                    other_servers: &other_servers,
                    declared_model: &cfg.declared_model,
                },
                &requests,
            ))
        }
        _ => None,
    };
    if let Some(o) = observed.as_mut()
        && let Some(c) = observed::external_check(&o.offered, &tool_policy, &calls_tools)
    {
        o.checks.push(c);
    }
    for check in observed.iter().flat_map(|o| &o.checks) {
        match check.grade {
            Grade::Pass => pass += 1,
            Grade::Fail => fail += 1,
            Grade::NotExercised => not_exercised += 1,
        }
    }
    let all_passed = fail == 0 && not_exercised == 0;
    let manifest = json!({
        "kind": "sharedos.mcp-column",
        "version": 1,
        "reportedSeparately": "an MCP column is reported apart from committed manifests: its calls are the harness's and its model's choices, matched on tool + resource",
        "systemIdentity": identity,
        "harnessVersionMeasured": measured,
        "toolPolicy": tool_policy,
        "turn": turn.turn,
        "catalogHash": turn.catalog_hash,
        "catalogue": catalogue,
        "principal": cfg.principal,
        "startedAt": started_at,
        "finishedAt": finished_at,
        "harnessRun": {
            "command": cfg.command, "exitCode": harness_run.exit_code, "timedOut": harness_run.timed_out,
            "durationMs": harness_run.duration.as_millis() as u64,
            "turnClosedMidRun": closed_mid_run.as_ref().map(|c| json!({"afterCalls": c.after_calls})),
            "stdout": workdir.join("harness.stdout.log"), "stderr": workdir.join("harness.stderr.log"),
        },
        "rows": graded,
        "checks": observed.as_ref().map(|o| &o.checks),
        "offered": observed.as_ref().map(|o| json!(o.offered)),
        "model": observed.as_ref().map_or_else(
            || json!({"declared": cfg.declared_model, "asked": null, "same": null}),
            |o| json!(o.model),
        ),
        "modelLog": opts.model_log,
        "afterClose": closed_mid_run.as_ref().map(|_| json!({
            "requests": after_close.len(),
            "withBoundaryTools": after_close.iter().filter(|r| observed::offers_boundary(format, r)).count(),
        })),
        "extraCalls": extra,
        "summary": {"pass": pass, "fail": fail, "notExercised": not_exercised, "allPassed": all_passed},
    });
    let manifest_error = |source| ColumnError::Manifest {
        path: opts.out.clone(),
        source,
    };
    let text =
        serde_json::to_string_pretty(&manifest).map_err(|e| manifest_error(e.into()))? + "\n";
    std::fs::write(&opts.out, text).map_err(manifest_error)?;
    Ok((manifest, all_passed))
}

/// The readable table of a manifest.
pub fn table(manifest: &Value) -> String {
    let id = &manifest["systemIdentity"];
    let mut out = format!(
        "MCP column: harness {} {} ({}{}), declared model {:?}, catalogHash {}\n",
        id["harness"].as_str().unwrap_or("?"),
        id["harnessVersion"].as_str().unwrap_or(""),
        id["mcpSupport"].as_str().unwrap_or("?"),
        id["extension"]
            .as_str()
            .map(|e| format!(": {e}"))
            .unwrap_or_default(),
        id["declaredModel"].as_str().unwrap_or("?"),
        manifest["catalogHash"].as_str().unwrap_or("?"),
    );
    out.push_str(&format!(
        "{:<22} {:<14} {:<40} {:<8} {:<28} {}\n",
        "row", "tool", "arguments", "expect", "outcome", "grade"
    ));
    for r in manifest["rows"].as_array().into_iter().flatten() {
        let outcome = match (r["outcome"].as_str(), r["code"].as_str()) {
            (Some(o), Some(c)) => format!("{o}/{c}"),
            _ => "-".into(),
        };
        let mut args = r["arguments"].to_string();
        sharedos_proto::name::clip(&mut args, 40);
        let grade = grade_word(&r["grade"]);
        out.push_str(&format!(
            "{:<22} {:<14} {:<40} {:<8} {:<28} {}\n",
            r["id"].as_str().unwrap_or(""),
            r["tool"].as_str().unwrap_or(""),
            args,
            r["expect"].as_str().unwrap_or(""),
            outcome,
            grade
        ));
        if let Some(d) = r["detail"].as_str() {
            out.push_str(&format!("{:<22} {d}\n", ""));
        }
    }
    out.push_str(&observed_lines(manifest));
    let s = &manifest["summary"];
    out.push_str(&format!(
        "{} pass, {} fail, {} not exercised; {} extra call(s); harness exit {} {}\n",
        s["pass"],
        s["fail"],
        s["notExercised"],
        manifest["extraCalls"].as_array().map_or(0, Vec::len),
        manifest["harnessRun"]["exitCode"],
        if manifest["harnessRun"]["timedOut"] == true {
            "(timed out)"
        } else {
            ""
        },
    ));
    out
}

/// The word for a grade as serialized (`not_exercised` → `not exercised`).
pub fn grade_word(v: &Value) -> &'static str {
    serde_json::from_value::<Grade>(v.clone()).map_or("-", Grade::word)
}

/// The table's lines for the checks, what was offered and the model asked for.
fn observed_lines(manifest: &Value) -> String {
    let mut out = String::new();
    let model = &manifest["model"];
    let Some(checks) = manifest["checks"].as_array() else {
        out.push_str(&format!(
            "offered to the model: not observed (no --model-log); declared model {}\n",
            model["declared"]
        ));
        return out;
    };
    out.push_str(&format!("{:<22} {:<14} {}\n", "check", "grade", "detail"));
    for c in checks {
        out.push_str(&format!(
            "{:<22} {:<14} {}\n",
            c["id"].as_str().unwrap_or(""),
            grade_word(&c["grade"]),
            c["detail"].as_str().unwrap_or("")
        ));
    }
    let o = &manifest["offered"];
    let others = o["others"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let count = |f: &dyn Fn(&Value) -> bool| others.iter().filter(|t| f(t)).count();
    let servers: Vec<&str> = others
        .iter()
        .filter_map(|t| t["server"].as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    out.push_str(&format!(
        "offered to the model: {} boundary tool(s) in {} of {} request(s); {} other(s): {} declared harness-local, {} undeclared harness-local, {} from other server(s){}\n",
        o["boundary"].as_object().map_or(0, serde_json::Map::len),
        o["requestsWithTools"],
        o["requests"],
        others.len(),
        count(&|t| t["declared"] == true),
        count(&|t| t["declared"] != true && t["origin"] == "harness-local"),
        count(&|t| t["origin"] == "other-server"),
        if servers.is_empty() {
            String::new()
        } else {
            format!(" ({})", servers.join(", "))
        },
    ));
    let asked: Vec<String> = model["asked"]
        .as_array()
        .map(|a| a.iter().map(ToString::to_string).collect())
        .unwrap_or_default();
    out.push_str(&format!(
        "model: declared {}, asked {}{}\n",
        model["declared"],
        if asked.is_empty() {
            "none named".to_owned()
        } else {
            asked.join(", ")
        },
        match model["same"].as_bool() {
            Some(true) => " (the same)",
            Some(false) => " (MISMATCH: shown, not corrected)",
            None => "",
        }
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_prompt() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("rows.json");
        std::fs::write(&p, r#"[{"id":"a","tool":"files.read","arguments":{"path":"/public/x"},"expect":"allowed"}]"#).expect("w");
        let rows = read_rows(&p).expect("rows");
        assert!(
            prompt(&rows).contains("call `files.read` with arguments {\"path\":\"/public/x\"}")
        );
        std::fs::write(
            &p,
            r#"[{"id":"a","tool":"t","expect":"allowed"},{"id":"a","tool":"t","expect":"denied"}]"#,
        )
        .expect("w");
        assert!(
            read_rows(&p)
                .expect_err("dup")
                .to_string()
                .contains("twice")
        );
        std::fs::write(&p, r#"[{"id":"a","tool":"t","expect":"maybe"}]"#).expect("w");
        assert!(read_rows(&p).is_err());
    }

    /// A row's code is asserted beside its outcome: a refusal for another reason fails.
    #[test]
    fn a_row_code_must_match_the_recorded_one() {
        use Expect::*;
        assert_eq!(grade_call(Denied, None, "denied", "no_permit"), Grade::Pass);
        assert_eq!(
            grade_call(
                Denied,
                Some("budget_exhausted"),
                "denied",
                "budget_exhausted"
            ),
            Grade::Pass
        );
        assert_eq!(
            grade_call(Denied, Some("budget_exhausted"), "denied", "no_permit"),
            Grade::Fail
        );
        assert_eq!(
            grade_call(Denied, Some("budget_exhausted"), "succeeded", "ok"),
            Grade::Fail
        );
        assert_eq!(
            grade_call(Allowed, Some("ok"), "succeeded", "ok"),
            Grade::Pass
        );
        assert_eq!(
            grade_call(Allowed, None, "denied", "no_permit"),
            Grade::Fail
        );
        assert_eq!(
            grade_call(TurnClosed, None, "cancelled", "turn_closed"),
            Grade::Fail
        );
    }

    /// A `turn_closed` row is the last, names no code, and is said so in the prompt.
    #[test]
    fn turn_closed_rows() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("rows.json");
        std::fs::write(&p, r#"[{"id":"a","tool":"files.read","expect":"allowed"},{"id":"late","tool":"files.read","expect":"turn_closed"}]"#).expect("w");
        let rows = read_rows(&p).expect("rows");
        assert_eq!(rows[1].expect, Expect::TurnClosed);
        assert!(prompt(&rows).contains("2. call `files.read` with arguments {} (the turn may have been closed by then: make the call anyway)"));
        std::fs::write(&p, r#"[{"id":"late","tool":"files.read","expect":"turn_closed"},{"id":"a","tool":"files.read","expect":"allowed"}]"#).expect("w");
        assert_eq!(
            read_rows(&p).expect_err("not last").to_string(),
            format!(
                "rows `{}`: row `late` expects turn_closed but is not the last row (nothing can be called after the close)",
                p.display()
            )
        );
        std::fs::write(
            &p,
            r#"[{"id":"late","tool":"files.read","expect":"turn_closed","code":"turn_closed"}]"#,
        )
        .expect("w");
        assert!(
            read_rows(&p)
                .expect_err("code")
                .to_string()
                .contains("cannot name a code")
        );
        std::fs::write(
            &p,
            r#"[{"id":"b","tool":"files.search","expect":"denied","code":"budget_exhausted"}]"#,
        )
        .expect("w");
        assert_eq!(
            read_rows(&p).expect("rows")[0].code.as_deref(),
            Some("budget_exhausted")
        );
    }

    /// The attempt of a step and what the harness told the model of it, from the model log.
    #[test]
    fn a_step_as_the_model_log_shows_it() {
        let log: Vec<Value> = [
            r#"{"kind":"request","reply":"tool_call","tool":"mcp__s__files_read","step":0}"#,
            r#"{"kind":"tool_result","callId":"c0","text":"hello"}"#,
            r#"{"kind":"request","reply":"tool_call","tool":"mcp__s__files_read","step":1}"#,
            r#"{"kind":"tool_result","callId":"c1","text":"MCP error -32000: Connection closed"}"#,
            r#"{"kind":"request","reply":"text","tool":null,"step":null}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
        assert_eq!(
            step_seen(&log, 1),
            StepSeen {
                attempted: Some("mcp__s__files_read".into()),
                model_saw: Some("MCP error -32000: Connection closed".into())
            }
        );
        assert_eq!(
            step_seen(&log[..3], 1),
            StepSeen {
                attempted: Some("mcp__s__files_read".into()),
                model_saw: None
            }
        );
        assert_eq!(
            step_seen(&log, 2),
            StepSeen {
                attempted: None,
                model_saw: None
            }
        );
        let (before, after) = split_at_step(&log, 1);
        assert_eq!((before.len(), after.len()), (3, 2));
        assert_eq!(split_at_step(&log, 2), (&log[..], &[][..]));
    }

    /// Every way a `turn_closed` row is graded, each with its reason.
    #[test]
    fn turn_closed_grades() {
        let closed = ClosedMidRun { after_calls: 8 };
        let seen = StepSeen {
            attempted: Some("t".into()),
            model_saw: Some("cancelled: gone".into()),
        };
        let base = || TurnClosedEvidence {
            closed: Some(&closed),
            closed_seq: Some(40),
            call: None,
            ran_after: 0,
            timed_out: false,
            exit_code: Some(0),
            seen: Some(seen.clone()),
        };
        let (g, d) = grade_turn_closed(&base());
        assert_eq!(g, Grade::Pass);
        assert_eq!(
            d,
            "the turn closed after 8 call(s); the model called `t`; no call ran; the harness told the model \"cancelled: gone\"; exit 0"
        );
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            closed: None,
            ..base()
        });
        assert_eq!(g, Grade::NotExercised);
        assert!(d.starts_with("the turn was not closed mid-run"), "{d}");
        let call: record::Call = serde_json::from_value(json!({"turn": "t", "callId": "c", "requestId": null, "tool": "files.read", "requirement": null, "outcome": "succeeded", "code": "ok"})).expect("call");
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            call: Some((&call, 39)),
            ..base()
        });
        assert_eq!(g, Grade::NotExercised);
        assert!(d.contains("before the close (succeeded/ok)"), "{d}");
        // A call line after the close (the broker's own cancel) is no reason to fail.
        assert_eq!(
            grade_turn_closed(&TurnClosedEvidence {
                call: Some((&call, 41)),
                ..base()
            })
            .0,
            Grade::Pass
        );
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            ran_after: 1,
            ..base()
        });
        assert_eq!(
            (g, d.as_str()),
            (Grade::Fail, "1 call(s) ran after the turn closed")
        );
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            timed_out: true,
            exit_code: None,
            ..base()
        });
        assert_eq!(g, Grade::Fail);
        assert!(d.contains("(it hung)"), "{d}");
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            seen: None,
            ..base()
        });
        assert_eq!(g, Grade::NotExercised);
        assert!(d.contains("without --model-log"), "{d}");
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            seen: Some(StepSeen {
                attempted: None,
                model_saw: None,
            }),
            exit_code: Some(1),
            ..base()
        });
        assert_eq!(g, Grade::NotExercised);
        assert!(
            d.contains("never answered with the call") && d.ends_with("exit 1"),
            "{d}"
        );
        let (g, d) = grade_turn_closed(&TurnClosedEvidence {
            seen: Some(StepSeen {
                attempted: Some("t".into()),
                model_saw: None,
            }),
            ..base()
        });
        assert_eq!(g, Grade::Pass);
        assert!(d.contains("sent the model no result for it"), "{d}");
    }

    /// Each failure names its file, and its cause as the CLI prints the chain.
    #[test]
    fn errors_name_the_file_and_chain_the_cause() {
        let dir = tempfile::tempdir().expect("tmp");
        let missing = dir.path().join("missing.toml");
        let e = read_host_config(&missing).expect_err("missing");
        assert!(matches!(e, ColumnError::HostConfigRead { .. }), "{e:?}");
        let text = format!("{:#}", anyhow::Error::from(e));
        assert!(
            text.starts_with(&format!(
                "cannot read host config `{}`: ",
                missing.display()
            )),
            "{text}"
        );
        let p = dir.path().join("host.toml");
        std::fs::write(&p, "harness = \"pi\"\ndeclared_model = \"m\"\nmcp_support = \"native\"\nconfig_format = \"pi\"\ncommand = \"pi\"\nprincipal = \"alice\"\nharness_local = []\ntimeout_seconds = 0\n").expect("w");
        assert_eq!(
            read_host_config(&p).expect_err("timeout").to_string(),
            format!(
                "host config `{}`: timeout_seconds must be at least 1",
                p.display()
            )
        );
        let rows = dir.path().join("rows.json");
        std::fs::write(&rows, "[]").expect("w");
        assert_eq!(
            read_rows(&rows).expect_err("empty").to_string(),
            format!("rows `{}`: no rows", rows.display())
        );
        std::fs::write(&rows, "[").expect("w");
        let e = read_rows(&rows).expect_err("parse");
        assert!(matches!(e, ColumnError::RowsParse { .. }), "{e:?}");
        assert!(std::error::Error::source(&e).is_some());
    }

    /// Only the requests logged after the run began count; other lines and a cut line do not.
    #[test]
    fn model_log_from_the_offset() {
        let dir = tempfile::tempdir().expect("tmp");
        let log = dir.path().join("model.jsonl");
        assert_eq!(log_offset(&log).expect("absent"), 0);
        assert!(logged_requests(&log, 0).expect("absent").is_empty());
        let before = r#"{"kind":"request","api":"chat","model":"old","offered":["x"]}"#;
        std::fs::write(&log, format!("{before}\n")).expect("w");
        let offset = log_offset(&log).expect("offset");
        let during = [
            r#"{"kind":"request","api":"responses","model":"m","offered":["shell","mcp__sharedos/files_read"]}"#,
            r#"{"kind":"tool_result","api":"responses","callId":"c","text":"t"}"#,
            r#"{"kind":"request","api":"chat","model":"m","offe"#,
        ];
        std::fs::write(&log, format!("{before}\n{}", during.join("\n"))).expect("w");
        let requests = logged_requests(&log, offset).expect("read");
        assert_eq!(requests.len(), 1, "{requests:?}");
        assert_eq!(requests[0].model.as_deref(), Some("m"));
        assert_eq!(
            requests[0].offered[1].namespace.as_deref(),
            Some("mcp__sharedos")
        );
        let e = logged_requests(dir.path(), 0).expect_err("a folder");
        assert!(
            e.to_string().starts_with(&format!(
                "cannot read the model log `{}`",
                dir.path().display()
            )),
            "{e}"
        );
    }

    /// Issue 47: `external_direct` entries under an open ToolPolicy; strict with them refused,
    /// naming the host config and the entry.
    #[test]
    fn external_direct_only_under_an_open_tool_policy() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("host.toml");
        let base = "harness = \"claude-code\"\ndeclared_model = \"m\"\nmcp_support = \"native\"\nconfig_format = \"claude-code\"\ncommand = \"claude\"\nprincipal = \"alice\"\nharness_local = [\"Bash\"]\nexternal_direct = [\"time\"]\n";
        std::fs::write(&p, format!("{base}tool_policy = \"open\"\n")).expect("w");
        let c = read_host_config(&p).expect("config");
        let policy = tool_policy(&p, &c).expect("open with external entries");
        assert_eq!(policy.mode, PolicyMode::Open);
        assert_eq!(policy.external_direct, ["time"]);
        std::fs::write(&p, base).expect("w");
        let c = read_host_config(&p).expect("config");
        assert_eq!(c.tool_policy, PolicyMode::Strict);
        let e = tool_policy(&p, &c).expect_err("strict with external");
        assert_eq!(
            format!("{:#}", anyhow::Error::from(e)),
            format!(
                "host config `{}`: harness_local: a strict tool policy cannot list externalDirect tools (`time`)",
                p.display()
            )
        );
    }

    #[test]
    fn version_as_printed() {
        for (out, v) in [
            ("2.1.332 (Claude Code)\n", Some("2.1.332")),
            ("codex-cli 0.171.0\n", Some("0.171.0")),
            ("\nv22.23.5\n", Some("22.23.5")),
            ("0.61.0", Some("0.61.0")),
            ("usage: x [--help]\n", None),
            ("", None),
        ] {
            assert_eq!(version_in(out).as_deref(), v, "{out:?}");
        }
    }

    #[test]
    fn what_an_approval_came_to() {
        let d =
            |v: Value| -> record::ApprovalDecided { serde_json::from_value(v).expect("decided") };
        let base = json!({"turn": "t", "callId": "c", "approval": "a", "decidedBy": null});
        let with = |extra: Value| {
            let mut v = base.clone();
            for (k, x) in extra.as_object().expect("obj") {
                v[k] = x.clone();
            }
            d(v)
        };
        assert_eq!(
            approval_said(&with(
                json!({"decision": "approved", "by": "harness_session", "session": {"bridge": 1, "action": "accept"}})
            )),
            "asked, approved"
        );
        assert_eq!(
            approval_said(&with(
                json!({"decision": "denied", "by": "harness_session", "session": {"bridge": 1, "action": "decline", "via": "elicitation/create"}})
            )),
            "declined by the client"
        );
        assert_eq!(
            approval_said(&with(
                json!({"decision": "denied", "by": "principal", "session": {"bridge": 1, "action": "cancel"}})
            )),
            "cancelled by the client"
        );
        assert_eq!(
            approval_said(&with(
                json!({"decision": "approved", "by": "principal", "session": {"bridge": 1, "action": "accept"}})
            )),
            "asked, approved",
            "a record written before `harness_session` reads the same"
        );
        assert_eq!(
            approval_said(&with(
                json!({"decision": "approved", "by": "operator", "decidedBy": 0})
            )),
            "no question shown: operator approved"
        );
        assert_eq!(
            approval_said(&with(json!({"decision": "unavailable"}))),
            "no question shown: the harness cannot ask"
        );
        assert_eq!(
            approval_said(&with(json!({"decision": "timeout"}))),
            "nobody answered (timed out)"
        );
    }

    #[test]
    fn host_config_rules() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("host.toml");
        std::fs::write(&p, "harness = \"pi\"\ndeclared_model = \"m\"\nmcp_support = \"extension\"\nextension = \"pi-mcp-adapter@2.36.0\"\nconfig_format = \"pi\"\ncommand = \"pi\"\nprincipal = \"alice\"\nharness_local = [\"bash\"]\nconfig_base = \"base.json\"\n").expect("w");
        let c = read_host_config(&p).expect("config");
        assert_eq!(c.config_base, Some(dir.path().join("base.json")));
        assert_eq!(c.timeout_seconds, 180);
        std::fs::write(&p, "harness = \"pi\"\ndeclared_model = \"m\"\nmcp_support = \"native\"\nconfig_format = \"vim\"\ncommand = \"pi\"\nprincipal = \"alice\"\nharness_local = []\n").expect("w");
        assert!(
            read_host_config(&p)
                .expect_err("format")
                .to_string()
                .contains("vim")
        );
        assert_eq!(
            expand(
                "{workdir}/x {prompt}",
                &[("workdir", "/w"), ("prompt", "p")]
            ),
            "/w/x p"
        );
    }
}
