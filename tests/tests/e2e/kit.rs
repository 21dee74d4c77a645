//! The test kit: a broker started in-process on a temp runtime dir, the real shim binary spawned
//! as an MCP client would, a raw JSON-RPC probe, and the real CLI. Every wait is bounded; every
//! child is killed on drop.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::TokioChildProcess;
use serde_json::Value;
use sharedos_broker::Config;
use sharedos_broker::server::Running;
use sharedos_host::client::ControlClient;
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn, TurnOpened};
use sharedos_proto::record::RecordLine;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio_util::sync::CancellationToken;

/// Every wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);

pub const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("bob-private")
permit(principal == SharedOS::User::"bob",
       action in [SharedOS::Action::"read", SharedOS::Action::"write"],
       resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;

/// The workspace's target dir for this profile (tests run from target/<profile>/deps).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// Path of a workspace binary. The binaries are (re)built once per test process: when only
/// this package's tests are asked for, cargo does not build other packages' binaries, and a
/// stale shim would test old code.
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let release = target_dir().ends_with("release");
        let mut cmd = std::process::Command::new(cargo);
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "sharedos-broker-cli",
            "-p",
            "sharedos-mcp-shim",
        ]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building the binaries failed");
    });
    let path = target_dir().join(name);
    assert!(path.is_file(), "{} is missing", path.display());
    path
}

pub struct Options {
    pub policy: &'static str,
    pub writable: bool,
    pub latency_ms: Option<u64>,
    pub call_timeout_seconds: Option<u64>,
    pub record_sync: &'static str,
    /// More top-level config keys (`key = value` lines).
    pub top: String,
    /// More tables, after `[[providers]]` (`[[budgets]]`, ...).
    pub tables: String,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            policy: POLICY,
            writable: true,
            latency_ms: None,
            call_timeout_seconds: None,
            record_sync: "always",
            top: String::new(),
            tables: String::new(),
        }
    }
}

pub struct TestBroker {
    pub dir: tempfile::TempDir,
    pub runtime: PathBuf,
    pub config_path: PathBuf,
    shutdown: CancellationToken,
    running: Option<Running>,
}

/// Lays out data, policy and config in `dir` (existing files are kept).
pub fn write_config(dir: &Path, opts: &Options) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("public")).expect("mkdir");
    std::fs::create_dir_all(data.join("private")).expect("mkdir");
    std::fs::write(data.join("public/hello.txt"), "hello, public world\n").expect("write");
    std::fs::write(data.join("private/secret.txt"), "the secret\n").expect("write");
    std::fs::write(dir.join("policy.cedar"), opts.policy).expect("write");
    let mut toml = format!(
        // Checkpoints only at shutdown (and rotation): an interval's would land anywhere.
        "record = \"record.jsonl\"\nrecord_sync = \"{}\"\nrecord_checkpoint_seconds = 0\npolicy = \"policy.cedar\"\n",
        opts.record_sync
    );
    if let Some(t) = opts.call_timeout_seconds {
        toml.push_str(&format!("call_timeout_seconds = {t}\n"));
    }
    toml.push_str(&opts.top);
    toml.push_str(&format!(
        "[[providers]]\ntype = \"files\"\nnamespace = \"files\"\nroot = \"data\"\nwritable = {}\n",
        opts.writable
    ));
    if let Some(l) = opts.latency_ms {
        toml.push_str(&format!("latency_ms = {l}\n"));
    }
    toml.push_str(&opts.tables);
    let path = dir.join("broker.toml");
    std::fs::write(&path, toml).expect("write config");
    path
}

impl TestBroker {
    pub async fn start(opts: Options) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-test-")
            .tempdir()
            .expect("tmp");
        let config_path = write_config(dir.path(), &opts);
        let runtime = dir.path().join("run");
        let mut b = Self {
            dir,
            runtime,
            config_path,
            shutdown: CancellationToken::new(),
            running: None,
        };
        b.restart().await;
        b
    }

    /// Starts (again) a broker on the same config, runtime dir and record.
    pub async fn restart(&mut self) {
        self.stop().await;
        let config = Config::from_file(&self.config_path).expect("config");
        self.shutdown = CancellationToken::new();
        let running = sharedos_broker::start(config, self.runtime.clone(), self.shutdown.clone())
            .await
            .expect("broker starts");
        self.running = Some(running);
    }

    pub async fn stop(&mut self) {
        self.shutdown.cancel();
        if let Some(r) = self.running.take() {
            tokio::time::timeout(WAIT, r.wait())
                .await
                .expect("broker stops in time")
                .expect("broker task");
        }
    }

    pub fn bridge(&self) -> PathBuf {
        runtime::bridge_socket(&self.runtime)
    }

    pub fn record_path(&self) -> PathBuf {
        self.dir.path().join("record.jsonl")
    }

    pub async fn host(&self) -> ControlClient {
        ControlClient::connect(&self.runtime)
            .await
            .expect("control connection")
    }

    pub async fn open_turn(&self, principal: &str) -> TurnOpened {
        self.open(OpenTurn {
            principal: principal.into(),
            ..Default::default()
        })
        .await
    }

    pub async fn open(&self, req: OpenTurn) -> TurnOpened {
        match self
            .host()
            .await
            .call(&ControlRequest::OpenTurn(Box::new(req)))
            .await
            .expect("open")
        {
            ControlResponse::TurnOpened(t) => t,
            other => panic!("unexpected {other:?}"),
        }
    }

    pub async fn close_turn(&self, turn: &str) {
        let r = self
            .host()
            .await
            .call(&ControlRequest::CloseTurn { turn: turn.into() })
            .await;
        assert!(matches!(r, Ok(ControlResponse::TurnClosed { .. })), "{r:?}");
    }

    /// All record lines, read from the file. Each must be a typed record event that writes
    /// back to the same bytes: what a test reads is what the contract says.
    pub fn records(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.record_path()).unwrap_or_default();
        text.lines()
            .map(|l| {
                let typed: RecordLine = serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("record line is not a record event ({e}): {l}"));
                assert_eq!(
                    serde_json::to_string(&typed).expect("ser"),
                    l,
                    "record line does not round-trip through its type"
                );
                serde_json::from_str(l).expect("record line is JSON")
            })
            .collect()
    }

    pub fn calls_of(&self, turn: &str) -> Vec<Value> {
        self.records()
            .into_iter()
            .filter(|l| l["kind"] == "call" && l["turn"] == turn)
            .collect()
    }

    /// The shim command for a turn token, as a harness config would spawn it.
    pub fn shim_command(&self, token: &str) -> Command {
        self.shim_command_at(&bin("sharedos-mcp-shim"), token)
    }

    /// The shim command with another shim binary (a statically linked one, say).
    pub fn shim_command_at(&self, shim: &Path, token: &str) -> Command {
        let mut cmd = Command::new(shim);
        cmd.env(runtime::TOKEN_ENV, token)
            .env(runtime::BROKER_ENV, self.bridge())
            .env_remove(runtime::RUNTIME_DIR_ENV)
            .kill_on_drop(true);
        cmd
    }

    /// A real MCP client (rmcp) connected to a freshly spawned shim.
    pub async fn client(&self, token: &str) -> RunningService<RoleClient, ()> {
        self.client_of(self.shim_command(token)).await
    }

    /// A real MCP client (rmcp) connected to the shim this command spawns.
    pub async fn client_of(&self, shim: Command) -> RunningService<RoleClient, ()> {
        let (transport, _) = TokioChildProcess::builder(shim)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn shim");
        tokio::time::timeout(WAIT, ().serve(transport))
            .await
            .expect("initialize in time")
            .expect("initialize")
    }

    /// The CLI against this broker.
    pub fn cli(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.arg("--runtime-dir").arg(&self.runtime);
        cmd
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A raw JSON-RPC probe on a shim's stdio: what a harness writes, line by line.
pub struct Raw {
    pub child: Child,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl Raw {
    pub fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn shim");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Self {
            child,
            stdin,
            stdout,
        }
    }

    pub async fn send(&mut self, v: Value) {
        let mut line = v.to_string();
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .await
            .expect("write to shim");
    }

    /// Like [`Raw::send`], but `false` instead of a panic when the shim is gone.
    pub async fn try_send(&mut self, v: Value) -> bool {
        let mut line = v.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.is_ok()
    }

    /// Writes raw bytes (plus a newline) to the shim's stdin.
    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stdin.write_all(bytes).await.expect("write to shim");
        self.stdin.write_all(b"\n").await.expect("write to shim");
    }

    /// The next raw line on stdout, `None` at its end.
    pub async fn next_line(&mut self) -> Option<String> {
        self.stdout.next_line().await.ok().flatten()
    }

    /// The next message on stdout (every line must be JSON-RPC).
    pub async fn recv(&mut self) -> Value {
        let line = tokio::time::timeout(WAIT, self.stdout.next_line())
            .await
            .expect("shim answered in time")
            .expect("read")
            .expect("shim stdout open");
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("non-JSON on shim stdout: {line:?}: {e}"))
    }

    /// Waits for the response with this id, skipping notifications.
    pub async fn response(&mut self, id: i64) -> Value {
        loop {
            let v = self.recv().await;
            if v["id"] == id {
                return v;
            }
            assert!(
                v.get("id").is_none() || v.get("method").is_some(),
                "unexpected response {v}"
            );
        }
    }

    /// initialize with a protocol version, then initialized.
    pub async fn initialize(&mut self, version: &str) -> Value {
        self.send(serde_json::json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw-probe", "version": "1"}}}))
            .await;
        let r = self.response(0).await;
        self.send(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        r
    }

    pub async fn call(&mut self, id: i64, tool: &str, args: Value) -> Value {
        self.send(
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": args}}),
        )
        .await;
        self.response(id).await
    }

    pub async fn exit_code(&mut self) -> Option<i32> {
        tokio::time::timeout(WAIT, self.child.wait())
            .await
            .expect("shim exits in time")
            .expect("wait")
            .code()
    }

    pub async fn close_stdin(self) -> Child {
        drop(self.stdin);
        self.child
    }
}

/// Runs a command with a bounded wait; returns (status code, stdout, stderr).
pub async fn run(cmd: std::process::Command) -> (i32, String, String) {
    let mut cmd = Command::from(cmd);
    cmd.kill_on_drop(true).stdin(Stdio::null());
    let out = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("command finished in time")
        .expect("run command");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The names in `dir` (what a run wrote into a `HOME` that must stay empty).
pub fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read_dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Polls `check` until it holds (bounded by WAIT).
pub async fn eventually<F: FnMut() -> bool>(what: &str, mut check: F) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `sharedos-broker records verify --config CONFIG`: its exit status, and its stdout and stderr.
pub async fn verify_record(config: &Path) -> (i32, String) {
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["records", "verify", "--config"]).arg(config);
    let (code, out, err) = run(cmd).await;
    (code, format!("{out}{err}"))
}

/// The `_meta.sharedos` object of a result (raw JSON or rmcp).
pub fn meta(result: &Value) -> &Value {
    &result["_meta"]["sharedos"]
}

pub fn text(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// What a `.ci/install-*` script installed: the `KEY=value` lines of
/// `$SHAREDOS_CI_CACHE/<folder>/<folder>.env` (default cache `~/.cache/sharedos-ci`). `None`, with
/// the reason printed, when the tests that need it are skipped: the install could not reach its
/// registry (a SKIPPED marker), or (outside CI) it was not run. Under CI=true a missing install
/// without the marker fails.
pub fn installed(folder: &str, script: &str) -> Option<std::collections::BTreeMap<String, String>> {
    let cache = match std::env::var_os("SHAREDOS_CI_CACHE") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sharedos-ci")
        }
    };
    let dir = cache.join(folder);
    let env_file = dir.join(format!("{folder}.env"));
    match std::fs::read_to_string(&env_file) {
        Ok(text) => Some(
            text.lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .collect(),
        ),
        Err(_) if dir.join("SKIPPED").exists() => {
            eprintln!("SKIPPED: {folder}: {script} could not reach the registry");
            note_registry_skip(folder);
            None
        }
        Err(_) => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must run {script} first ({} is missing)",
                env_file.display()
            );
            eprintln!("SKIPPED: {folder}: run {script} to install what these tests need");
            None
        }
    }
}

/// The file `.ci/run` names in this variable: one line per test skipped because an install
/// could not reach its registry, counted at the end of the run (a green run says what it did
/// not run).
pub const SKIP_LOG_VAR: &str = "SHAREDOS_SKIP_LOG";

/// Appends `<test>\t<folder>` to the file named by [`SKIP_LOG_VAR`], when it is set. The test's
/// name is its thread's (libtest names each test's thread after it). Under CI=true the variable
/// must be set (`.ci/run` sets both), so no skip goes uncounted.
fn note_registry_skip(folder: &str) {
    use std::io::Write;
    let Some(path) = std::env::var_os(SKIP_LOG_VAR) else {
        assert!(
            std::env::var("CI").is_err(),
            "CI skips {folder} (registry unreachable) but {SKIP_LOG_VAR} is not set to count it: run .ci/run"
        );
        return;
    };
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed test")
        .to_owned();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{SKIP_LOG_VAR}={}: {e}", path.to_string_lossy()));
    // One write per line: appends from tests running at once do not interleave.
    f.write_all(format!("{test}\t{folder}\n").as_bytes())
        .unwrap_or_else(|e| panic!("{SKIP_LOG_VAR}={}: {e}", path.to_string_lossy()));
}

/// A connection straight to the bridge socket at `bridge` (no shim) that has said hello with
/// `token` and read the broker's welcome.
pub async fn raw_bridge(
    bridge: &Path,
    token: &str,
) -> (
    sharedos_ipc::FrameReader<impl tokio::io::AsyncRead + Unpin + Send + use<>>,
    impl tokio::io::AsyncWrite + Unpin + Send + use<>,
) {
    use sharedos_proto::ipc::{BridgeEvent, BridgeRequest, PROTOCOL_VERSION, ShimInfo, TurnToken};
    let stream = sharedos_ipc::connect(bridge).await.expect("connect");
    let (r, mut w) = tokio::io::split(stream);
    let mut reader = sharedos_ipc::FrameReader::new(r);
    sharedos_ipc::write_frame(
        &mut w,
        &BridgeRequest::Hello {
            protocol: PROTOCOL_VERSION,
            token: TurnToken::new(token.to_owned()),
            client: ShimInfo::default(),
        },
    )
    .await
    .expect("hello");
    let welcome = reader.next::<BridgeEvent>().await.expect("welcome");
    assert!(
        matches!(welcome, BridgeEvent::Welcome { .. }),
        "{welcome:?}"
    );
    (reader, w)
}
