//! Witnessed checkpoints: each signed checkpoint line, as written to the record, is also handed
//! to somewhere the broker's uid cannot rewrite afterwards, so that `records verify --witness`
//! can tell a record cut at the end, or rewritten and re-signed with a stolen key, from the
//! record as it was.
//!
//! Two routes, either or both (the OpenTelemetry log export is a third, in `telemetry`):
//! - `witness_file`: the line is appended (`O_APPEND`, then fdatasync) to a file the broker
//!   opens anew for every checkpoint. The operator makes it append-only for the broker
//!   (`chattr +a`, or a file on a filesystem or host the broker's uid cannot rewrite): the
//!   broker can add lines but not change or remove them.
//! - `witness_command`: the program (argv, no shell) runs once per checkpoint with the line on
//!   its stdin (e.g. a script posting it to object storage or a transparency log); exit 0 is
//!   success. It gets a clean environment (`PATH`, `LANG`, `HOME` and what `witness_env`
//!   declares: none of the broker's own) and a process group of its own, killed whole after
//!   `witness_command_timeout_seconds` (default [`WITNESS_COMMAND_TIMEOUT`]) and when it exits
//!   (what it left running goes with it); see [`crate::child`]. Its output is discarded.
//!
//! Neither is on the call path: the record hands the line to a bounded queue
//! ([`WITNESS_QUEUE`] lines, `try_send`) and a thread of its own does the rest. A full queue,
//! a failed append, a command that fails or hangs: each is counted ([`WitnessStats`], shown by
//! `sharedos-broker telemetry`) and logged, and never delays or fails a call or a line.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

/// Checkpoint lines waiting for the witness thread; one more is dropped (and counted).
pub const WITNESS_QUEUE: usize = 256;
/// A `witness_command` still running after this long is killed and counted as failed (the
/// default of `witness_command_timeout_seconds`).
pub const WITNESS_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the witness thread looks whether a running command has ended.
const COMMAND_POLL: Duration = Duration::from_millis(10);

/// What happened to the checkpoints handed to the witness.
#[derive(Debug, Default)]
pub struct WitnessStats {
    /// Checkpoints handed to the queue.
    pub queued: AtomicU64,
    /// Checkpoints every configured route took.
    pub witnessed: AtomicU64,
    /// Appends to `witness_file` or runs of `witness_command` that failed (or timed out).
    pub failed: AtomicU64,
    /// Checkpoints dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Checkpoints the thread is done with (witnessed or failed).
    pub done: AtomicU64,
}

/// The witness's handle; off (nothing done per checkpoint) unless a route is configured.
#[derive(Clone, Default)]
pub struct Witness {
    inner: Option<(SyncSender<Vec<u8>>, Arc<WitnessStats>)>,
    timeout: Duration,
}

/// `witness_command` as configured: its argv, its declared environment, its time limit.
#[derive(Debug, Clone, Default)]
pub struct WitnessCommand {
    pub argv: Vec<String>,
    /// `witness_env`: all the environment it gets besides `PATH`, `LANG` and `HOME`.
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
}

struct Worker {
    rx: Receiver<Vec<u8>>,
    file: Option<PathBuf>,
    command: WitnessCommand,
    stats: Arc<WitnessStats>,
}

impl Witness {
    /// Starts the witness thread if `file` or a command is set.
    pub fn start(file: Option<PathBuf>, command: WitnessCommand) -> std::io::Result<Self> {
        if file.is_none() && command.argv.is_empty() {
            return Ok(Self::default());
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(WITNESS_QUEUE);
        let stats = Arc::new(WitnessStats::default());
        let timeout = command.timeout;
        let worker = Worker {
            rx,
            file,
            command,
            stats: stats.clone(),
        };
        std::thread::Builder::new()
            .name("witness".into())
            .spawn(move || worker.run())?;
        Ok(Self {
            inner: Some((tx, stats)),
            timeout,
        })
    }

    /// How long one run of the command may take (zero without a command).
    pub fn command_timeout(&self) -> Duration {
        self.timeout
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Hands a checkpoint line (without its newline) to the witness thread; never waits.
    pub fn checkpoint(&self, line: &[u8]) {
        let Some((tx, stats)) = &self.inner else {
            return;
        };
        match tx.try_send(line.to_vec()) {
            Ok(()) => {
                stats.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    queue = WITNESS_QUEUE,
                    "witness queue full: a checkpoint was not witnessed"
                );
            }
        }
    }

    /// Waits (blocking, at most `within`) until every queued checkpoint has been handled: at
    /// shutdown, so that the last checkpoint is witnessed before the process exits. Says
    /// whether it was.
    pub fn drain(&self, within: Duration) -> bool {
        let Some((_, stats)) = &self.inner else {
            return true;
        };
        let deadline = Instant::now() + within;
        loop {
            if stats.done.load(Ordering::Acquire) >= stats.queued.load(Ordering::Relaxed) {
                return true;
            }
            if Instant::now() >= deadline {
                tracing::error!(
                    waited_s = within.as_secs(),
                    "the witness did not finish with the last checkpoints before shutdown"
                );
                return false;
            }
            std::thread::sleep(COMMAND_POLL);
        }
    }

    /// (queued, witnessed, failed, dropped) so far.
    pub fn counts(&self) -> (u64, u64, u64, u64) {
        match &self.inner {
            None => (0, 0, 0, 0),
            Some((_, s)) => (
                s.queued.load(Ordering::Relaxed),
                s.witnessed.load(Ordering::Relaxed),
                s.failed.load(Ordering::Relaxed),
                s.dropped.load(Ordering::Relaxed),
            ),
        }
    }
}

impl Worker {
    fn run(self) {
        // Ends when every sender is gone (the recorder dropped).
        while let Ok(line) = self.rx.recv() {
            let mut ok = true;
            if let Some(path) = &self.file
                && let Err(e) = append(path, &line)
            {
                ok = false;
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::error!(witness_file = %path.display(), error = %e, "could not append a checkpoint to the witness file");
            }
            if !self.command.argv.is_empty()
                && let Err(e) = run_command(&self.command, &line)
            {
                ok = false;
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::error!(witness_command = ?self.command.argv, error = %e, "the witness command failed");
            }
            if ok {
                self.stats.witnessed.fetch_add(1, Ordering::Relaxed);
            }
            self.stats.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// Appends `line` and a newline in one write, and syncs it.
fn append(path: &std::path::Path, line: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)?;
    let mut whole = Vec::with_capacity(line.len() + 1);
    whole.extend_from_slice(line);
    whole.push(b'\n');
    file.write_all(&whole)?;
    file.sync_data()
}

/// Runs the command with `line` and a newline on its stdin, in a clean environment and a
/// process group of its own; waits at most its timeout for it to exit 0. The group is killed
/// whole when the command ends or times out: nothing it started outlives the run.
fn run_command(command: &WitnessCommand, line: &[u8]) -> std::io::Result<()> {
    let (program, args) = command
        .argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("empty witness_command"))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    crate::child::clean_env(
        &mut cmd,
        crate::child::CLEAN_HOME,
        command.env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
    );
    crate::child::own_group(&mut cmd);
    let mut child = cmd.spawn()?;
    let pgid = child.id();
    let end = |child: &mut std::process::Child| {
        crate::child::kill_group(pgid);
        let _ = child.wait();
    };
    let deadline = Instant::now() + command.timeout;
    // The line is small (well under a pipe's buffer): this write does not wait for the reader.
    if let Some(mut stdin) = child.stdin.take() {
        let mut whole = Vec::with_capacity(line.len() + 1);
        whole.extend_from_slice(line);
        whole.push(b'\n');
        if let Err(e) = stdin.write_all(&whole) {
            end(&mut child);
            return Err(e);
        }
    }
    loop {
        let status = match child.try_wait() {
            Ok(s) => s,
            Err(e) => {
                end(&mut child);
                return Err(e);
            }
        };
        if let Some(status) = status {
            // What it left running in its group goes with it.
            crate::child::kill_group(pgid);
            return if status.success() {
                Ok(())
            } else {
                Err(std::io::Error::other(format!("exited with {status}")))
            };
        }
        if Instant::now() >= deadline {
            end(&mut child);
            return Err(std::io::Error::other(format!(
                "still running after {} s: killed with its process group",
                command.timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(COMMAND_POLL);
    }
}
