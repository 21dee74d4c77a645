//! The broker process: has the kernel built from the config ([`crate::assemble`]), owns the
//! runtime directory and its two sockets, and runs the accept loops until shutdown. Nothing
//! imports this module but the crate root.
//!
//! Owns the cancellation tree root → turn → bridge → call. On shutdown every turn is closed
//! (reason `broker_shutdown`), so every in-flight call ends recorded, then the sockets are removed.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use interprocess::local_socket::tokio::{Listener, Stream};
use interprocess::local_socket::traits::StreamCommon as _;
use interprocess::local_socket::traits::tokio::Listener as _;
use interprocess::local_socket::{GenericFilePath, ListenerOptions, ToFsName};
use sharedos_ipc::runtime;
use sharedos_proto::record::{BrokerStarted, Event};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::admission::{HelloGate, RateLimitedLog};
use crate::assemble::{build, close_out};
use crate::config::Config;
use crate::error::StartError;
use crate::state::Broker;
use crate::trusted::TrustedDir;
use crate::turn::Turns;

/// Connections served at once per socket; further ones wait in the kernel's backlog.
pub const MAX_CONNECTIONS: usize = 1024;

/// Makes the runtime dir (0700), or checks an existing one, before anything is made, read or
/// written in it: it is this broker's uid's (not root's, not another's), no other uid can write
/// in it, it is not reached through a link another uid can change, and the folders above it are
/// checked up to one only the broker or root can write ([`TrustedDir`]). `serve` calls this
/// before it lays out the embedded default in it; [`start`] calls it first.
pub fn check_runtime_dir(dir: &Path) -> Result<TrustedDir, StartError> {
    use std::os::unix::fs::MetadataExt;
    let uid = crate::trusted::broker_uid();
    // Said as the runtime dir's own error when it is plainly someone else's.
    if let Ok(meta) = std::fs::metadata(dir)
        && meta.is_dir()
        && meta.uid() != uid
    {
        return Err(StartError::NotOurs {
            path: dir.display().to_string(),
            owner: meta.uid(),
            uid,
        });
    }
    let held = TrustedDir::open(dir, true)?;
    let st = rustix::fs::fstat(&held)
        .map_err(|e| StartError::io("cannot read runtime dir", dir)(e.into()))?;
    if st.st_uid != uid {
        return Err(StartError::NotOurs {
            path: dir.display().to_string(),
            owner: st.st_uid,
            uid,
        });
    }
    if st.st_mode & 0o022 != 0 {
        return Err(StartError::OpenToOthers {
            path: dir.display().to_string(),
            mode: st.st_mode & 0o7777,
        });
    }
    Ok(held)
}

/// Creates the runtime dir (or checks an existing one is ours) and sets its access: 0700 when
/// only this uid uses the sockets; 0710 and the one group that needs to reach a socket
/// (`harness_group` or `host_group`); 0711 when both do and differ (each socket's own mode
/// and group then decide who can connect).
fn prepare_runtime_dir(dir: &Path, uid: u32, config: &Config) -> Result<(), StartError> {
    std::fs::create_dir_all(dir).map_err(StartError::io("cannot create runtime dir", dir))?;
    let meta =
        std::fs::symlink_metadata(dir).map_err(StartError::io("cannot read runtime dir", dir))?;
    if !meta.is_dir() {
        return Err(StartError::NotAFolder {
            path: dir.display().to_string(),
        });
    }
    let owner = std::os::unix::fs::MetadataExt::uid(&meta);
    if owner != uid {
        return Err(StartError::NotOurs {
            path: dir.display().to_string(),
            owner,
            uid,
        });
    }
    let (mode, group) = match (config.harness_group, config.host_group) {
        (None, None) => (0o700, None),
        (Some(g), None) | (None, Some(g)) => (0o710, Some(g)),
        (Some(a), Some(b)) if a == b => (0o710, Some(a)),
        (Some(_), Some(_)) => (0o711, None),
    };
    if let Some(g) = group {
        chgrp(dir, g)?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .map_err(StartError::io("cannot set the mode of runtime dir", dir))?;
    if let Some(g) = config.harness_group {
        warn_unreachable(dir, g);
    }
    Ok(())
}

/// Gives `path` to group `gid` (keeping its owner).
fn chgrp(path: &Path, gid: u32) -> Result<(), StartError> {
    rustix::fs::chown(path, None, Some(rustix::fs::Gid::from_raw(gid))).map_err(|e| {
        StartError::Group {
            path: path.display().to_string(),
            gid,
            source: e.into(),
        }
    })
}

/// Says so when a folder above the runtime dir keeps members of `gid` (and everyone but its
/// owner) from reaching the sockets: a common mistake is `$XDG_RUNTIME_DIR`, which is 0700.
fn warn_unreachable(dir: &Path, gid: u32) {
    use std::os::unix::fs::MetadataExt;
    let Ok(full) = std::fs::canonicalize(dir) else {
        return;
    };
    for ancestor in full.ancestors().skip(1) {
        let Ok(m) = std::fs::metadata(ancestor) else {
            continue;
        };
        let searchable = m.mode() & 0o001 != 0 || (m.gid() == gid && m.mode() & 0o010 != 0);
        if !searchable {
            tracing::warn!(folder = %ancestor.display(), "harness uids cannot reach the runtime dir through this folder");
            eprintln!(
                "warning: `{}` (mode {:04o}, group {}) is not searchable by harness_group {gid}: harness uids cannot reach `{}`; use a --runtime-dir they can reach",
                ancestor.display(),
                m.mode() & 0o7777,
                m.gid(),
                dir.display()
            );
            return;
        }
    }
}

/// Refuses a socket path another broker is listening on.
async fn refuse_if_listening(path: &Path) -> Result<(), StartError> {
    if path.exists() && sharedos_ipc::connect(path).await.is_ok() {
        return Err(StartError::AlreadyListening {
            path: path.display().to_string(),
        });
    }
    Ok(())
}

/// Listens on `path`: mode 0600, or 0660 with `group` when one is given.
async fn bind(path: &Path, group: Option<u32>) -> Result<Listener, StartError> {
    if path.exists() {
        refuse_if_listening(path).await?;
        std::fs::remove_file(path).map_err(StartError::io("cannot remove stale socket", path))?;
    }
    let name = path
        .to_fs_name::<GenericFilePath>()
        .map_err(StartError::io("cannot name the socket", path))?;
    let listener = ListenerOptions::new()
        .name(name)
        .create_tokio()
        .map_err(StartError::io("cannot listen on", path))?;
    if let Some(g) = group {
        chgrp(path, g)?;
    }
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(StartError::io("cannot set the mode of", path))?;
    Ok(listener)
}

/// A broker started in this process.
pub struct Running {
    pub broker: Arc<Broker>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Waits until the broker has shut down (after its `shutdown` token was cancelled).
    pub async fn wait(self) -> Result<(), StartError> {
        self.task.await.map_err(|e| StartError::Task(e.to_string()))
    }
}

/// Starts the broker: everything is ready to serve when this returns.
pub async fn start(
    config: Config,
    runtime_dir: PathBuf,
    shutdown: CancellationToken,
) -> Result<Running, StartError> {
    let uid = runtime::current_uid();
    // Before anything is made, read or written in it (the record and key may live there).
    let dir = check_runtime_dir(&runtime_dir)?;
    // No upstream's sandbox may reach the broker's files, the runtime dir among them.
    crate::assemble::check_sandboxes(&config, Some(&runtime_dir))?;
    raise_open_files_limit();
    let root = CancellationToken::new();
    // Until the broker is up, a failure stops the providers already started.
    let stop_on_error = root.clone().drop_guard();
    // A broker already on this runtime dir is the likelier mistake than a shared record: say so
    // before the record's lock says the other.
    refuse_if_listening(&runtime::control_socket(&runtime_dir)).await?;
    let (kernel, recovery) = build(&config, &root).await?;
    let kernel = Arc::new(kernel);
    prepare_runtime_dir(&runtime_dir, uid, &config)?;
    let control_key = crate::turn::new_secret().map_err(|e| {
        StartError::io("no randomness for the control key", &runtime_dir)(std::io::Error::other(
            e.to_string(),
        ))
    })?;
    dir.replace(runtime::CONTROL_KEY, control_key.expose().as_bytes(), 0o600)?;
    let control = bind(&runtime::control_socket(&runtime_dir), config.host_group).await?;
    let bridge = bind(&runtime::bridge_socket(&runtime_dir), config.harness_group).await?;
    let broker = Arc::new(Broker {
        kernel,
        turns: Turns::default(),
        config,
        root,
        runtime_dir: runtime_dir.clone(),
        uid,
        control_key,
    });
    stop_on_error.disarm();
    let weak = Arc::downgrade(&broker);
    broker
        .kernel
        .telemetry
        .count_turns_with(move || weak.upgrade().map_or(0, |b| b.turns.len() as u64));
    let started = Event::BrokerStarted(BrokerStarted {
        version: env!("CARGO_PKG_VERSION").into(),
        tools: broker.kernel.registry().len(),
        config: broker.config.source.clone(),
        policy_digest: Some(broker.kernel.policy.current().digest()),
        turn: None,
    });
    broker.kernel.recorder.append(&started).await?;
    // Before the first call is taken: what the last broker left open.
    close_out(&broker.kernel.recorder, &recovery).await?;
    tracing::info!(runtime_dir = %runtime_dir.display(), tools = broker.kernel.registry().len(), "broker ready");
    // The person's page, on a listener of its own (none of it through the two sockets).
    if let Some(addr) = crate::page::start(broker.clone(), broker.root.child_token()).await? {
        eprintln!("page listening on {addr}");
    }
    let b = broker.clone();
    let interval = broker.config.record_checkpoint_interval;
    let task = tokio::spawn(async move {
        let checkpoints = checkpoint_loop(b.kernel.recorder.clone(), interval);
        let control_loop = accept_loop(b.clone(), control, Kind::Control);
        let bridge_loop = accept_loop(b.clone(), bridge, Kind::Bridge);
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = control_loop => {}
            _ = bridge_loop => {}
            _ = checkpoints => {}
        }
        for turn in b.turns.list() {
            b.close_turn(&turn.id, "broker_shutdown").await;
        }
        // The last line: everything this broker wrote, signed.
        if let Err(e) = b.kernel.recorder.checkpoint("shutdown").await {
            tracing::error!(error = %e, "could not sign the record at shutdown");
        }
        b.root.cancel();
        // The witness gets the last checkpoint before the process exits.
        if let Some(witness) = b.kernel.recorder.witness().cloned() {
            let within = witness.command_timeout() + Duration::from_secs(1);
            let _ = tokio::task::spawn_blocking(move || witness.drain(within)).await;
        }
        // Telemetry last: every call's span is queued by now; the thread exports what is left.
        let kernel = b.kernel.clone();
        let _ = tokio::task::spawn_blocking(move || kernel.telemetry.shutdown()).await;
        let _ = std::fs::remove_file(runtime::control_socket(&b.runtime_dir));
        let _ = std::fs::remove_file(runtime::bridge_socket(&b.runtime_dir));
        // Give the record writer a moment to finish the last lines, then let the record go (a
        // process that exits releases it anyway; a broker restarted in the same process needs it).
        tokio::time::sleep(Duration::from_millis(10)).await;
        b.kernel.recorder.release();
    });
    Ok(Running { broker, task })
}

/// Signs the record every `interval` (when something was written since the last checkpoint).
/// With a zero interval, never ends and signs nothing (shutdown and rotation still sign).
async fn checkpoint_loop(recorder: crate::evidence::record::Recorder, interval: Duration) {
    if interval.is_zero() {
        return std::future::pending().await;
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = recorder.checkpoint("interval").await {
            tracing::error!(error = %e, "could not sign the record");
        }
    }
}

/// Runs the broker until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    runtime_dir: PathBuf,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    start(config, runtime_dir, shutdown).await?.wait().await
}

#[derive(Clone, Copy)]
enum Kind {
    Control,
    Bridge,
}

async fn accept_loop(broker: Arc<Broker>, listener: Listener, kind: Kind) {
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let gate = Arc::new(HelloGate::recorded(
        broker.kernel.recorder.clone(),
        match kind {
            Kind::Control => crate::admission::Socket::Control,
            Kind::Bridge => crate::admission::Socket::Bridge,
        },
    ));
    // Refusals held back are written once their interval is over, while the loop lives (and
    // the rest when the gate goes).
    let weak = Arc::downgrade(&gate);
    tokio::spawn(async move {
        let every = crate::admission::REFUSAL_RECORD_INTERVAL;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            let Some(gate) = weak.upgrade() else { return };
            gate.flush_refusals(false);
        }
    });
    let mut refusals = RateLimitedLog::default();
    let mut failures = RateLimitedLog::default();
    // The host's reserve: descriptors held back so that control.sock can still take the host
    // when everything else has used the process's open-files limit up.
    // It is let go when an accept fails for want of descriptors, and taken back each time a
    // host connection ends.
    let reserve = Arc::new(std::sync::Mutex::new(match kind {
        Kind::Control => FdReserve::hold(CONTROL_RESERVE_FDS),
        Kind::Bridge => FdReserve::default(),
    }));
    loop {
        let Ok(permit) = limit.clone().acquire_owned().await else {
            return;
        };
        let stream: Stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                let released = out_of_fds
                    && reserve
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .release();
                if released {
                    // The reserve goes to this connection (and the work its command needs).
                    continue;
                }
                failures.note(|n| tracing::warn!(error = %e, failed = n, "accept failed"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Until it says hello, a connection is bounded per peer process and in all, and the
        // places are shared by uid and by process within a uid (see `admission`): idle
        // connections cannot keep anyone else out. Over a bound it is closed at once.
        let creds = stream.peer_creds().ok();
        let pid = creds.as_ref().and_then(|c| c.pid());
        let uid = creds.as_ref().and_then(|c| c.euid());
        let Some(pending) = gate.admit(uid, pid) else {
            gate.refused("cap_reached", uid, pid);
            refusals.note(|n| {
                tracing::warn!(
                    ?pid,
                    ?uid,
                    refused = n,
                    "connections not yet past hello over the bound: closed at once"
                );
            });
            continue;
        };
        let broker = broker.clone();
        let reserve = reserve.clone();
        tokio::spawn(async move {
            match kind {
                Kind::Control => {
                    crate::control::serve(broker, stream, pending).await;
                    reserve
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .refill(CONTROL_RESERVE_FDS);
                }
                Kind::Bridge => crate::bridge::serve(broker, stream, pending).await,
            }
            drop(permit);
        });
    }
}

/// Descriptors the control socket keeps in reserve (see [`FdReserve`]).
pub const CONTROL_RESERVE_FDS: usize = 16;

/// Open descriptors held back (of `/dev/null`), to be let go when the process is out of them, so
/// that the host can still connect and close turns.
#[derive(Default)]
struct FdReserve(Vec<std::fs::File>);

impl FdReserve {
    fn hold(n: usize) -> Self {
        let mut r = Self(Vec::with_capacity(n));
        r.refill(n);
        r
    }

    /// Takes back up to `n` descriptors (as many as the process can spare).
    fn refill(&mut self, n: usize) {
        while self.0.len() < n {
            match std::fs::File::open("/dev/null") {
                Ok(f) => self.0.push(f),
                Err(_) => break,
            }
        }
    }

    /// Lets the reserve go; `false` if there was none to let go.
    fn release(&mut self) -> bool {
        let had = !self.0.is_empty();
        self.0.clear();
        had
    }
}

/// Raises the soft limit on open files to the hard one: every connection and every file a call
/// opens is a descriptor, and systemd's default soft limit (1,024) is easily reached.
pub fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let Some(max) = limit.maximum
        && limit.current != Some(max)
    {
        let raised = rustix::process::Rlimit {
            current: Some(max),
            maximum: Some(max),
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(from = ?limit.current, to = max, "raised the open-files limit")
            }
            Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
        }
    }
}
