//! The processes the benchmark starts: real `sharedos-broker serve` brokers, shims and direct
//! servers spawned as an MCP client spawns them, and their memory from `/proc/<pid>/status`.
//!
//! Every wait is bounded by [`WAIT`]; every process is stopped (SIGTERM for a broker, stdin
//! closed for an MCP server, `kill_on_drop` as the last resort). Sockets are Unix sockets in a
//! private temporary runtime dir; nothing listens on the network.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rmcp::ServiceExt;
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::TokioChildProcess;
use sharedos_host::client::ControlClient;
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn, TurnOpened};
use tokio::process::{Child, Command};

/// Every wait on a process or a socket is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);

/// The file every round trip reads.
pub const HELLO_PATH: &str = "/public/hello.txt";
const HELLO_TEXT: &str = "Hello from SharedOS. This file is public.\n";

/// The binaries under test, all from the same profile as this benchmark.
pub struct Bins {
    pub broker: PathBuf,
    pub shim: PathBuf,
    pub direct: PathBuf,
    /// The thin relay (stdio ↔ Unix socket, no parsing): the floor of one extra process hop.
    pub relay: PathBuf,
    /// The smallest rmcp stdio server, built as the shim is: the floor under the shim's memory.
    pub rmcp_floor: PathBuf,
    pub release: bool,
}

/// The binaries spawned once per server (the shim) and the floors it is compared with, linked as
/// the README deploys the shim: statically (static-pie: the C library's code only as far as it is
/// used, no dynamic loader, ASLR kept). A dynamically linked process counts every page of libc,
/// libm and ld.so it touches in its own RSS: 4.8 MiB a shim, against 3.7 MiB static. Cargo
/// cannot set a target feature for one binary of a build, so each is relinked on its own with
/// `cargo rustc` after the build (which resolves its package's features alone: the shim then
/// has serde_json without the `preserve_order` that cedar asks for in the workspace build).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub const STATIC_BINS: &[(&str, &str)] = &[
    ("sharedos-mcp-shim", "sharedos-mcp-shim"),
    ("sharedos-bench-rmcp-floor", "rmcp-floor"),
    ("sharedos-bench-relay", "relay"),
];
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub const STATIC_BINS: &[(&str, &str)] = &[];

impl Bins {
    /// How each binary under test is linked, for the report: "shim static, broker dynamic, …".
    pub fn linking(&self) -> anyhow::Result<String> {
        let mut parts = Vec::new();
        for (name, path) in [
            ("shim", &self.shim),
            ("broker", &self.broker),
            ("direct server", &self.direct),
            ("relay", &self.relay),
            ("rmcp-floor", &self.rmcp_floor),
        ] {
            parts.push(format!(
                "{name} {}",
                sharedos_host::shim_path::linking(path)?.as_str()
            ));
        }
        Ok(parts.join(", "))
    }

    /// Builds (when run under cargo) and finds the broker, the shim and the direct server next
    /// to this executable. `cargo run` builds only the binary it runs, so the others would be
    /// missing or stale otherwise.
    pub fn build_and_locate() -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find this executable")?;
        let dir = exe
            .parent()
            .context("this executable has no folder")?
            .to_path_buf();
        let release = dir.file_name().is_some_and(|n| n == "release");
        if let Some(cargo) = std::env::var_os("CARGO") {
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
            let mut cmd = std::process::Command::new(&cargo);
            cmd.args(["build", "--quiet", "--bins", "--manifest-path"])
                .arg(&manifest)
                .args([
                    "-p",
                    "sharedos-broker-cli",
                    "-p",
                    "sharedos-mcp-shim",
                    "-p",
                    "sharedos-bench",
                    "-p",
                    "sharedos-bench-relay",
                    "-p",
                    "sharedos-bench-rmcp-floor",
                ]);
            if release {
                cmd.arg("--release");
            }
            eprintln!("bench: building the broker, the shim and the direct server…");
            let status = cmd.status().context("cannot run cargo build")?;
            if !status.success() {
                bail!("building the binaries under test failed");
            }
            for (package, bin) in STATIC_BINS {
                let mut cmd = std::process::Command::new(&cargo);
                cmd.args(["rustc", "--quiet", "--manifest-path"])
                    .arg(&manifest)
                    .args(["-p", package, "--bin", bin]);
                if release {
                    cmd.arg("--release");
                }
                cmd.args(["--", "-C", "target-feature=+crt-static"]);
                let status = cmd.status().context("cannot run cargo rustc")?;
                if !status.success() {
                    bail!("linking `{bin}` statically failed");
                }
            }
        }
        let bins = Self {
            broker: dir.join("sharedos-broker"),
            shim: dir.join("sharedos-mcp-shim"),
            direct: dir.join("direct-files-server"),
            relay: dir.join("relay"),
            rmcp_floor: dir.join("rmcp-floor"),
            release,
        };
        for p in [
            &bins.broker,
            &bins.shim,
            &bins.direct,
            &bins.relay,
            &bins.rmcp_floor,
        ] {
            if !p.is_file() {
                bail!(
                    "`{}` is missing: run `cargo build --release --bins -p sharedos-broker-cli -p sharedos-mcp-shim -p sharedos-bench -p sharedos-bench-relay -p sharedos-bench-rmcp-floor`, or the benchmark under `cargo run`",
                    p.display()
                );
            }
        }
        Ok(bins)
    }
}

/// The data folder every broker and direct server serves: `public/hello.txt`,
/// `private/secret.txt`.
pub fn write_data(dir: &Path) -> anyhow::Result<PathBuf> {
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("public"))?;
    std::fs::create_dir_all(data.join("private"))?;
    std::fs::write(data.join("public/hello.txt"), HELLO_TEXT)?;
    std::fs::write(
        data.join("private/secret.txt"),
        "This file is private: alice may not read it.\n",
    )?;
    Ok(data)
}

/// Writes `broker.toml` and `policy.cedar` in `dir`; `providers` is the TOML of the
/// `[[providers]]` entries. Returns the config path.
pub fn write_config(
    dir: &Path,
    record_sync: &str,
    policy: &str,
    providers: &str,
) -> anyhow::Result<PathBuf> {
    std::fs::write(dir.join("policy.cedar"), policy)?;
    let path = dir.join("broker.toml");
    std::fs::write(
        &path,
        format!(
            "record = \"record.jsonl\"\nrecord_sync = \"{record_sync}\"\npolicy = \"policy.cedar\"\n{providers}"
        ),
    )?;
    Ok(path)
}

/// One `[[providers]]` entry for the built-in files provider.
pub fn files_provider(namespace: &str, root: &Path, writable: bool) -> String {
    format!(
        "\n[[providers]]\ntype = \"files\"\nnamespace = \"{namespace}\"\nroot = {}\nwritable = {writable}\n",
        toml_string(&root.display().to_string())
    )
}

/// A policy that lets every principal call every tool (the sections of brokered and remote
/// upstreams measure the path, not the policy).
pub const PERMIT_CALLS: &str = r#"@id("bench-calls")
permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool);
"#;

/// A TOML basic string.
pub fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A real `sharedos-broker serve` process on the embedded default's policy and files, with the
/// given record mode, in its own temporary folder.
pub struct BrokerProc {
    child: Child,
    /// Config, policy, record and log; removed when the broker is dropped.
    _dir: tempfile::TempDir,
    pub runtime: PathBuf,
    pub pid: u32,
}

impl BrokerProc {
    pub async fn start(bins: &Bins, data: &Path, record_sync: &str) -> anyhow::Result<Self> {
        Self::start_with(
            bins,
            record_sync,
            sharedos_broker::config::DEFAULT_POLICY,
            &files_provider("files", data, false),
        )
        .await
    }

    /// A broker on `policy` (Cedar text) and `providers` (the TOML of its `[[providers]]`).
    pub async fn start_with(
        bins: &Bins,
        record_sync: &str,
        policy: &str,
        providers: &str,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-bench-broker-")
            .tempdir()?;
        let config = write_config(dir.path(), record_sync, policy, providers)?;
        let runtime = dir.path().join("run");
        let log = std::fs::File::create(dir.path().join("broker.log"))?;
        let mut cmd = Command::new(&bins.broker);
        cmd.arg("--runtime-dir")
            .arg(&runtime)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .env_remove(runtime::RUNTIME_DIR_ENV)
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("cannot start sharedos-broker serve")?;
        let pid = child.id().context("the broker has no pid")?;
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait()? {
                let log = std::fs::read_to_string(dir.path().join("broker.log"))?;
                bail!("the broker exited ({status}) before it was ready:\n{log}");
            }
            if ControlClient::connect(&runtime).await.is_ok() {
                break;
            }
            if Instant::now() > deadline {
                bail!("the broker was not ready within {WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(Self {
            child,
            _dir: dir,
            runtime,
            pid,
        })
    }

    pub fn bridge(&self) -> PathBuf {
        runtime::bridge_socket(&self.runtime)
    }

    pub async fn host(&self) -> anyhow::Result<ControlClient> {
        Ok(ControlClient::connect(&self.runtime).await?)
    }

    pub async fn open_turn(&self, principal: &str) -> anyhow::Result<TurnOpened> {
        open_turn(&mut self.host().await?, principal).await
    }

    pub fn memory(&self) -> anyhow::Result<Mem> {
        memory(self.pid)
    }

    /// SIGTERM (the broker closes every turn and records it), then a bounded wait, then kill.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .status();
        match tokio::time::timeout(WAIT, self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                self.child.kill().await?;
                bail!("the broker did not stop within {WAIT:?} of SIGTERM; killed");
            }
        }
        Ok(())
    }
}

pub async fn open_turn(host: &mut ControlClient, principal: &str) -> anyhow::Result<TurnOpened> {
    let open = OpenTurn {
        principal: principal.into(),
        ..Default::default()
    };
    match host.call(&ControlRequest::OpenTurn(Box::new(open))).await? {
        ControlResponse::TurnOpened(t) => Ok(t),
        other => bail!("unexpected answer to open_turn: {other:?}"),
    }
}

/// The shim as a harness config spawns it, for one turn.
pub fn shim_command(bins: &Bins, bridge: &Path, token: &str) -> Command {
    let mut cmd = Command::new(&bins.shim);
    cmd.env(runtime::TOKEN_ENV, token)
        .env(runtime::BROKER_ENV, bridge)
        .env_remove(runtime::RUNTIME_DIR_ENV)
        .env_remove("SHAREDOS_LOG");
    cmd
}

/// The baseline: the same tools served directly from `data`.
pub fn direct_command(bins: &Bins, data: &Path) -> Command {
    let mut cmd = Command::new(&bins.direct);
    cmd.arg("--root").arg(data);
    cmd
}

/// The relay in front of a listening direct server: what an MCP client spawns for the floor.
/// With `record`, the durable relay: it appends every answer to that file and fdatasyncs it
/// before passing it on.
pub fn relay_command(bins: &Bins, socket: &Path, record: Option<&Path>) -> Command {
    let mut cmd = Command::new(&bins.relay);
    cmd.arg(socket);
    if let Some(record) = record {
        cmd.arg(record);
    }
    cmd
}

/// A `direct-files-server --listen SOCKET`: one process, one MCP session per connection (what
/// the relay reaches, as the shims reach the broker).
pub struct DirectListener {
    child: Child,
    _dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub pid: u32,
}

impl DirectListener {
    pub async fn start(bins: &Bins, data: &Path) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-bench-direct-")
            .tempdir()?;
        let socket = dir.path().join("direct.sock");
        let mut child = direct_command(bins, data)
            .arg("--listen")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start direct-files-server --listen")?;
        let pid = child.id().context("the direct server has no pid")?;
        let deadline = Instant::now() + WAIT;
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Some(status) = child.try_wait()? {
                bail!("direct-files-server --listen exited ({status}) before it listened");
            }
            if Instant::now() > deadline {
                bail!("direct-files-server --listen did not listen within {WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(Self {
            child,
            _dir: dir,
            socket,
            pid,
        })
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}

/// An MCP client (rmcp) connected to a spawned stdio server.
pub struct Client {
    pub service: RunningService<RoleClient, ()>,
    pub pid: Option<u32>,
}

/// Spawns `cmd` as an MCP client spawns a server and initializes (bounded by [`WAIT`]).
pub async fn spawn_client(mut cmd: Command) -> anyhow::Result<Client> {
    cmd.kill_on_drop(true);
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::null())
        .spawn()
        .context("cannot spawn the MCP server")?;
    let pid = transport.id();
    let service = tokio::time::timeout(WAIT, ().serve(transport))
        .await
        .context("initialize did not finish in time")?
        .context("initialize failed")?;
    Ok(Client { service, pid })
}

impl Client {
    /// Closes stdin and waits (bounded, by rmcp) for the server to exit.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        tokio::time::timeout(WAIT, self.service.close())
            .await
            .context("the MCP server did not stop in time")?
            .context("closing the MCP session")?;
        Ok(())
    }
}

/// CPU time (user + system, all threads, including exited ones) a process has used so far,
/// from `/proc/<pid>/stat` (clock ticks of 10 ms).
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("cannot read /proc/{pid}/stat"))?;
    // The command name is in parentheses and may hold spaces: count fields after the last `)`.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc/<pid>/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After `)`: state is field 3 of the file, so utime (14) and stime (15) are at 11 and 12.
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .context("malformed /proc/<pid>/stat")
    };
    Ok(Duration::from_millis((ticks(11)? + ticks(12)?) * 10))
}

/// The summed CPU time of some processes (a process that is gone counts as zero).
pub fn cpu_of(pids: &[u32]) -> Duration {
    pids.iter().filter_map(|p| cpu_time(*p).ok()).sum()
}

/// Resident memory of a process, from `/proc/<pid>/status`, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mem {
    /// VmRSS: resident now.
    pub rss_kib: u64,
    /// VmHWM: the peak resident size.
    pub hwm_kib: u64,
}

pub fn memory(pid: u32) -> anyhow::Result<Mem> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(Mem {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// How many of the functions `shim/hot-functions.txt` lists are in `shim` (by `nm`), said as the
/// memory section says it. The list names functions with rustc's per-build hashes: after a new
/// toolchain, Cargo.lock or profile few are found, and the shim's code is laid out as if there
/// were none (`bench/shim-order.py` writes the list again).
pub fn hot_functions_found(shim: &Path) -> String {
    let list = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shim/hot-functions.txt");
    let Ok(text) = std::fs::read_to_string(&list) else {
        return "no list found at shim/hot-functions.txt".into();
    };
    let listed: std::collections::HashSet<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let out = match std::process::Command::new("nm")
        .arg("--defined-only")
        .arg(shim)
        .output()
    {
        Ok(out) if out.status.success() => out.stdout,
        _ => {
            return format!(
                "{} functions listed, not counted in this shim (`nm` did not run)",
                listed.len()
            );
        }
    };
    let text = String::from_utf8_lossy(&out);
    let found = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|name| listed.contains(name))
        .collect::<std::collections::HashSet<_>>()
        .len();
    let advice = if found * 10 < listed.len() * 9 {
        " — fewer than 90 %: run `bench/shim-order.py` to write the list for this build"
    } else {
        ""
    };
    format!(
        "{found} of its {} functions are in this shim{advice}",
        listed.len()
    )
}
