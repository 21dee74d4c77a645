//! Per-principal instances of a `per_principal` provider: one upstream process per principal,
//! with that principal's secrets, spawned at their first call (not at turn open: a turn that
//! never calls the provider costs no process), reused across their turns, stopped after
//! `instance_idle_seconds` unused, at most `max_instances` at once. The catalogue stays the
//! provider's own listing (its supervised upstream, checked against the pin): an instance whose
//! own listing differs is stopped and its call refused `failed/provider_drifted`, recorded with
//! the principal. An instance that dies is forgotten; the principal's next call spawns another.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::service::{Peer, RoleClient};
use serde::{Deserialize, Serialize};
use sharedos_proto::record::ProviderDetail;
use sharedos_proto::{CatalogHash, FailCode};
use tokio_util::sync::CancellationToken;

use super::{McpProvider, Session};
use crate::config::{DEFAULT_INSTANCE_IDLE_SECONDS, DEFAULT_MAX_INSTANCES, McpProviderConfig};
use crate::provider::Failure;
use crate::trusted::TrustedDir;

/// One principal's place: its running instance, if any. Held while the instance is spawned, so
/// concurrent first calls of one principal spawn one process.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Instance>>>>;

/// Uids given to per-principal instances from one range (`instance_uids`, a provider's or the
/// broker's): one per provider and principal, given at the principal's first instance and kept
/// for good in the broker's [`UidMap`] (a restarted instance, or broker, gives the same), never
/// another's.
pub struct UidPool {
    first: u32,
    last: u32,
    /// The setting the range comes from, for messages.
    setting: String,
    map: Arc<UidMap>,
}

impl UidPool {
    pub fn new([first, last]: [u32; 2], setting: &str, map: Arc<UidMap>) -> Arc<Self> {
        Arc::new(Self {
            first,
            last,
            setting: setting.to_owned(),
            map,
        })
    }

    pub fn range(&self) -> [u32; 2] {
        [self.first, self.last]
    }

    /// `principal`'s uid for `provider`'s instances: the one the map gives them, else the lowest
    /// of the range no one was ever given (written to the map before it is used).
    fn uid(&self, provider: &str, principal: &str) -> Result<u32, String> {
        self.map
            .uid(provider, principal, [self.first, self.last])
            .map_err(|e| format!("{} = [{}, {}]: {e}", self.setting, self.first, self.last))
    }
}

/// Where the uids given to per-principal instances are kept: `<record>.instance-uids.json`,
/// beside the record and its key.
pub fn uid_map_path(record: &Path) -> PathBuf {
    PathBuf::from(format!("{}.instance-uids.json", record.display()))
}

/// One uid given: to `principal`'s instances of `provider`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Given {
    provider: String,
    principal: String,
    uid: u32,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct UidMapFile {
    uids: Vec<Given>,
}

/// The uids given to per-principal instances, kept across restarts in a file of the broker's
/// (`0600`, in a folder checked like the record's key's, never through a link): a uid once given
/// to a principal's instances of a provider is theirs for good, so what an instance left on disk
/// under its uid is never another principal's to read after a restart. A uid is written to the
/// file before an instance runs under it; an entry is never reused, also once its range changed.
pub struct UidMap {
    path: PathBuf,
    given: Mutex<Vec<Given>>,
}

impl UidMap {
    /// Reads the map at `path` (none there: empty), checked like the record's signing key: its
    /// folder the broker's (or root's) and nobody else's to write, the file a plain file of the
    /// broker's uid (a looser mode is made `0600`).
    pub fn load(path: &Path) -> Result<Arc<Self>, String> {
        use std::io::Read as _;
        use std::os::unix::fs::PermissionsExt as _;
        let shown = path.display();
        let (dir, name) = crate::trusted::split(path).map_err(|e| e.to_string())?;
        let folder = TrustedDir::open(dir, true).map_err(|e| e.to_string())?;
        let mut given = Vec::new();
        if folder
            .check_file(name)
            .map_err(|e| e.to_string())?
            .is_some()
        {
            let mut file = folder
                .open_file(name, rustix::fs::OFlags::RDONLY, 0)
                .map_err(|e| e.to_string())?;
            let mode = file
                .metadata()
                .map_err(|e| format!("cannot read `{shown}`: {e}"))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                tracing::warn!(file = %shown, mode = format!("{:o}", mode & 0o777), "the instance uid map was readable by others: made 0600");
                rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(0o600))
                    .map_err(|e| format!("cannot make `{shown}` 0600: {e}"))?;
            }
            let mut text = String::new();
            file.read_to_string(&mut text)
                .map_err(|e| format!("cannot read `{shown}`: {e}"))?;
            let parsed: UidMapFile = serde_json::from_str(&text).map_err(|e| {
                format!(
                    "`{shown}` (the uids given to per-principal instances) is not valid: {e}; restore it from a backup (removing it gives principals new uids, and what their instances left on disk to others)"
                )
            })?;
            given = parsed.uids;
        }
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            given: Mutex::new(given),
        }))
    }

    /// The principals given a uid for `provider`'s instances.
    fn principals(&self, provider: &str) -> Vec<String> {
        crate::lock(&self.given)
            .iter()
            .filter(|g| g.provider == provider)
            .map(|g| g.principal.clone())
            .collect()
    }

    /// `principal`'s uid for `provider`'s instances in `[first, last]`: kept, or the lowest one
    /// never given, written to the file first (an unwritten uid is never used).
    fn uid(&self, provider: &str, principal: &str, [first, last]: [u32; 2]) -> Result<u32, String> {
        let mut given = crate::lock(&self.given);
        if let Some(g) = given
            .iter()
            .find(|g| g.provider == provider && g.principal == principal)
        {
            if (first..=last).contains(&g.uid) {
                return Ok(g.uid);
            }
            return Err(format!(
                "principal `{principal}`'s instances of `{provider}` were given uid {} (kept in `{}`), which is outside the range now; put the range back, or give them another uid there by hand (and their files with it)",
                g.uid,
                self.path.display()
            ));
        }
        let Some(uid) = (first..=last).find(|u| !given.iter().any(|g| g.uid == *u)) else {
            return Err(format!(
                "its {} uids are given to other principals' instances (each keeps its uid for good, kept in `{}`); principal `{principal}`'s instance of `{provider}` gets none",
                u64::from(last - first) + 1,
                self.path.display()
            ));
        };
        given.push(Given {
            provider: provider.to_owned(),
            principal: principal.to_owned(),
            uid,
        });
        if let Err(e) = self.write(&given) {
            given.pop();
            return Err(format!(
                "cannot keep uid {uid} for principal `{principal}` in `{}`: {e}; no instance runs under a uid that is not kept",
                self.path.display()
            ));
        }
        Ok(uid)
    }

    fn write(&self, given: &[Given]) -> Result<(), String> {
        let (dir, name) = crate::trusted::split(&self.path).map_err(|e| e.to_string())?;
        let text = serde_json::to_string_pretty(&UidMapFile {
            uids: given.to_vec(),
        })
        .map_err(|e| e.to_string())?;
        TrustedDir::open(dir, false)
            .and_then(|d| d.replace(name, format!("{text}\n").as_bytes(), 0o600))
            .map_err(|e| e.to_string())
    }
}

/// The folder of `principal`'s instance (under `uid`) in the write rule `rule`:
/// `<rule>/<principal>`, made `0700` and given to `uid` (= gid), never through a link. One that
/// is there already must be a folder of `uid`'s (or the broker's, left by a start cut short).
pub(super) fn own_folder(rule: &Path, principal: &str, uid: u32) -> Result<PathBuf, String> {
    use rustix::fs::{Mode, OFlags};
    crate::secrets::check_name("principal", principal)?;
    let path = rule.join(principal);
    let shown = path.display();
    let dir = rustix::fs::open(
        rule,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("cannot open the write rule `{}`: {e}", rule.display()))?;
    match rustix::fs::mkdirat(&dir, principal, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(format!("cannot make `{shown}`: {e}")),
    }
    let own = rustix::fs::openat(
        &dir,
        principal,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => format!(
            "`{shown}` is a link or not a folder: a principal's instance writes only in a folder of its own; remove it"
        ),
        e => format!("cannot open `{shown}`: {e}"),
    })?;
    let st = rustix::fs::fstat(&own).map_err(|e| format!("cannot look at `{shown}`: {e}"))?;
    let me = crate::trusted::broker_uid();
    if st.st_uid != uid && st.st_uid != me {
        return Err(format!(
            "`{shown}` belongs to uid {}, not to principal `{principal}`'s instance uid {uid}: it is another's; remove it, or `chown -R {uid}:{uid}` it if it is theirs",
            st.st_uid
        ));
    }
    let (u, g) = (
        Some(rustix::process::Uid::from_raw(uid)),
        Some(rustix::process::Gid::from_raw(uid)),
    );
    rustix::fs::fchown(&own, u, g)
        .map_err(|e| format!("cannot give `{shown}` to uid {uid}: {e}"))?;
    rustix::fs::fchmod(&own, Mode::from_raw_mode(0o700))
        .map_err(|e| format!("cannot make `{shown}` 0700: {e}"))?;
    Ok(path)
}

pub(super) struct Pool {
    slots: Mutex<HashMap<String, Slot>>,
    /// Where each principal's instance gets a uid of its own (`None`: the provider's uid).
    uids: Option<Arc<UidPool>>,
    /// Whether the secret values of the principals in the uid map were learned for redaction
    /// (once per broker run, at the first instance's start).
    learned: tokio::sync::OnceCell<()>,
    /// Instances running or being spawned (the cap counts both).
    running: Arc<AtomicUsize>,
    max: usize,
    idle: Duration,
}

/// One principal's running upstream.
pub(super) struct Instance {
    principal: String,
    /// Its own uid (= gid), if the broker gave it one.
    uid: Option<u32>,
    pub(super) peer: Peer<RoleClient>,
    /// Calls in flight on it (an instance is stopped for idleness only at zero).
    busy: AtomicUsize,
    last_used: Mutex<Instant>,
    started: Instant,
    alive: AtomicBool,
    /// Cancelled to end it now (the server ended its session): its keeper stops it.
    ended: CancellationToken,
}

/// What `providers` shows of one instance.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    pub principal: String,
    /// Its own uid (= gid); absent: the provider's (`sandbox.instanceUids` says why).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    pub calls_in_flight: usize,
    pub idle_seconds: u64,
    pub up_seconds: u64,
}

impl Instance {
    fn last_used(&self) -> Instant {
        *crate::lock(&self.last_used)
    }

    /// Ends this instance (its session is gone): no further call is given it, and its keeper
    /// stops it; the principal's next call spawns another.
    pub(super) fn end(&self) {
        self.alive.store(false, Ordering::Release);
        self.ended.cancel();
    }
}

/// A call's hold on an instance: counted busy until dropped (the call ended, or its future was
/// dropped on cancellation or timeout), then the instance's idle time starts again.
pub(super) struct InUse(pub(super) Arc<Instance>);

impl Drop for InUse {
    fn drop(&mut self) {
        *crate::lock(&self.0.last_used) = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A place under the cap, given back when dropped unless the instance it was taken for runs
/// (a spawn cancelled midway, failed or drifted gives it back).
struct Place(Option<Arc<AtomicUsize>>);

impl Place {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(running) = self.0.take() {
            running.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Pool {
    pub(super) fn new(config: &McpProviderConfig, uids: Option<Arc<UidPool>>) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            uids,
            learned: tokio::sync::OnceCell::new(),
            running: Arc::new(AtomicUsize::new(0)),
            max: config.max_instances.unwrap_or(DEFAULT_MAX_INSTANCES),
            idle: Duration::from_secs(
                config
                    .instance_idle_seconds
                    .unwrap_or(DEFAULT_INSTANCE_IDLE_SECONDS),
            ),
        }
    }

    fn slot(&self, principal: &str) -> Slot {
        crate::lock(&self.slots)
            .entry(principal.to_owned())
            .or_default()
            .clone()
    }

    pub(super) fn status(&self) -> Vec<InstanceStatus> {
        let slots: Vec<Slot> = crate::lock(&self.slots).values().cloned().collect();
        let mut out: Vec<InstanceStatus> = slots
            .iter()
            .filter_map(|s| s.try_lock().ok().and_then(|g| g.clone()))
            .filter(|i| i.alive.load(Ordering::Acquire))
            .map(|i| InstanceStatus {
                principal: i.principal.clone(),
                uid: i.uid,
                calls_in_flight: i.busy.load(Ordering::Acquire),
                idle_seconds: i.last_used().elapsed().as_secs(),
                up_seconds: i.started.elapsed().as_secs(),
            })
            .collect();
        out.sort_by(|a, b| a.principal.cmp(&b.principal));
        out
    }

    /// The principal's instance, spawned if it has none running, counted busy until
    /// [`Instance::done`].
    pub(super) async fn get(
        &self,
        provider: &Arc<McpProvider>,
        principal: &str,
    ) -> Result<InUse, Failure> {
        let ns = provider.config.namespace.clone();
        let slot = self.slot(principal);
        let mut held = slot.lock().await;
        if let Some(i) = held.as_ref()
            && i.alive.load(Ordering::Acquire)
        {
            i.busy.fetch_add(1, Ordering::AcqRel);
            return Ok(InUse(i.clone()));
        }
        *held = None;
        // The secrets first: a principal without them gets a refusal, and nothing is spawned.
        let mut launch = provider.launch(Some(principal)).await.map_err(|e| {
            Failure::new(
                FailCode::MissingCredential,
                format!(
                    "the upstream server of `{ns}` cannot be started for principal `{principal}`: {e}; nothing was started"
                ),
            )
        })?;
        let place = Place(Some(self.running.clone()));
        if self.running.fetch_add(1, Ordering::AcqRel) >= self.max {
            drop(place);
            return Err(Failure::new(
                FailCode::UpstreamUnavailable,
                format!(
                    "provider `{ns}` already runs {} instances, its max_instances; principal `{principal}`'s instance cannot start until one stops (idle ones stop after instance_idle_seconds = {})",
                    self.max,
                    self.idle.as_secs()
                ),
            ));
        }
        if let Some(uids) = &self.uids {
            // Its uid, kept for good, and its own folder in each write rule: what it leaves
            // there is its principal's alone, across restarts.
            let own = uids.uid(&ns, principal).and_then(|uid| {
                provider
                    .own_folders(principal, uid)
                    .map(|folders| (uid, folders))
            });
            match own {
                Ok((uid, folders)) => {
                    launch.run_as = Some(uid);
                    launch.write_folders = folders;
                }
                Err(e) => {
                    drop(place);
                    return Err(Failure::new(
                        FailCode::UpstreamUnavailable,
                        format!(
                            "the upstream server of `{ns}`: principal `{principal}`'s instance cannot start: {e}"
                        ),
                    ));
                }
            }
            // Every principal's values are redacted from every answer, also those of principals
            // who had instances before this broker started (their files may still be there).
            self.learned
                .get_or_init(|| async {
                    for other in uids.map.principals(&ns) {
                        if other != principal {
                            let _ = provider.launch(Some(&other)).await;
                        }
                    }
                })
                .await;
        }
        let uid = launch.run_as;
        let sandbox = provider.instance_sandbox(uid, &launch.write_folders);
        let session = match provider.connect_any(&launch, Some(principal)).await {
            Ok(s) => s,
            Err(e) => {
                drop(place);
                let why = format!("principal `{principal}`'s instance could not start: {e}");
                provider
                    .record_sandboxed(
                        "instance_stopped",
                        Some(principal),
                        sandbox,
                        ProviderDetail::Reason {
                            reason: why.clone(),
                        },
                    )
                    .await;
                return Err(Failure::new(
                    if e.sign_in {
                        FailCode::SignInRequired
                    } else if e.missing {
                        FailCode::MissingCredential
                    } else if e.unauthorized {
                        FailCode::UpstreamUnauthorized
                    } else {
                        FailCode::UpstreamUnavailable
                    },
                    format!("the upstream server of `{ns}`: {why}"),
                ));
            }
        };
        let Session {
            service,
            tools,
            group,
            ..
        } = session;
        // The catalogue is the provider's listing, whoever asks: an instance listing other
        // tools is held back for this principal.
        let hash = sharedos_proto::catalog::raw_catalog_hash(&tools)
            .map(|h: CatalogHash| h.to_string())
            .ok();
        let expected = provider.pins.get(&ns).or_else(|| provider.upstream_hash());
        if hash.is_none() || hash != expected {
            let _ = service.cancel().await;
            drop(place);
            let why = format!(
                "principal `{principal}`'s instance of `{ns}` lists other tools (catalogHash {}) than the provider's pinned listing ({}); it was stopped and its calls are refused",
                hash.as_deref().unwrap_or("(none)"),
                expected.as_deref().unwrap_or("(none)")
            );
            provider
                .record_sandboxed(
                    "drifted",
                    Some(principal),
                    sandbox,
                    ProviderDetail::Reason {
                        reason: why.clone(),
                    },
                )
                .await;
            return Err(Failure::new(FailCode::ProviderDrifted, why));
        }
        let instance = Arc::new(Instance {
            principal: principal.to_owned(),
            uid,
            peer: service.peer().clone(),
            busy: AtomicUsize::new(1),
            last_used: Mutex::new(Instant::now()),
            started: Instant::now(),
            alive: AtomicBool::new(true),
            ended: CancellationToken::new(),
        });
        provider
            .record_sandboxed(
                "instance_started",
                Some(principal),
                sandbox.clone(),
                ProviderDetail::Listed {
                    upstream_hash: hash,
                    pinned_hash: provider.pins.get(&ns),
                    tools: vec![],
                    rejected: vec![],
                },
            )
            .await;
        tracing::info!(provider = %ns, principal, uid, "per-principal instance started");
        *held = Some(instance.clone());
        drop(held);
        // From here the keeper gives the place back when the instance ends.
        place.keep();
        // Its keeper: stops it when idle or at shutdown, and forgets it when it ends.
        let (stop, shutdown) = (service.cancellation_token(), provider.shutdown.clone());
        // The instance's process group lives as long as its session: killed whole when it ends.
        let mut waiter = tokio::spawn(async move {
            let ended = service.waiting().await;
            drop(group);
            ended
        });
        let (keeper, idle, running) = (instance.clone(), self.idle, self.running.clone());
        let provider = provider.clone();
        tokio::spawn(async move {
            let why = loop {
                // While a call runs past the idle time, looked at again every quarter second.
                let deadline =
                    (keeper.last_used() + idle).max(Instant::now() + Duration::from_millis(250));
                tokio::select! {
                    r = &mut waiter => {
                        break match r {
                            Ok(Ok(reason)) => format!("the instance's session ended ({reason:?})"),
                            Ok(Err(e)) => format!("the instance's session failed: {e}"),
                            Err(e) => format!("the instance's task failed: {e}"),
                        };
                    }
                    _ = shutdown.cancelled() => {
                        stop.cancel();
                        let _ = (&mut waiter).await;
                        break "the broker is stopping".to_owned();
                    }
                    _ = keeper.ended.cancelled() => {
                        stop.cancel();
                        let _ = (&mut waiter).await;
                        break "the server ended the instance's session".to_owned();
                    }
                    () = tokio::time::sleep_until(deadline.into()) => {
                        // Decided under the slot's lock: no call takes it meanwhile.
                        let mut held = slot.lock().await;
                        if keeper.busy.load(Ordering::Acquire) == 0
                            && keeper.last_used().elapsed() >= idle
                        {
                            keeper.alive.store(false, Ordering::Release);
                            if held.as_ref().is_some_and(|i| Arc::ptr_eq(i, &keeper)) {
                                *held = None;
                            }
                            drop(held);
                            stop.cancel();
                            let _ = (&mut waiter).await;
                            break format!("unused for instance_idle_seconds = {}", idle.as_secs());
                        }
                    }
                }
            };
            keeper.alive.store(false, Ordering::Release);
            {
                let mut held = slot.lock().await;
                if held.as_ref().is_some_and(|i| Arc::ptr_eq(i, &keeper)) {
                    *held = None;
                }
            }
            running.fetch_sub(1, Ordering::AcqRel);
            tracing::info!(provider = %provider.config.namespace, principal = %keeper.principal, reason = %why, "per-principal instance stopped");
            provider
                .record_sandboxed(
                    "instance_stopped",
                    Some(&keeper.principal),
                    sandbox,
                    ProviderDetail::Reason { reason: why },
                )
                .await;
        });
        Ok(InUse(instance))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uids are given lowest-first, kept across a reload of the file (a broker restart) whatever
    /// order principals come in, never given twice; a full range and a kept uid outside a
    /// changed range are refused, naming the file.
    #[test]
    fn uids_are_kept_across_a_reload_and_never_given_twice() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tmp");
        let path = uid_map_path(&dir.path().join("record.jsonl"));
        let map = UidMap::load(&path).expect("load");
        assert_eq!(map.uid("p", "bob", [100, 101]), Ok(100));
        assert_eq!(map.uid("p", "bob", [100, 101]), Ok(100));
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // A restart, alice first: not bob's uid.
        let map = UidMap::load(&path).expect("reload");
        assert_eq!(map.uid("p", "alice", [100, 101]), Ok(101));
        assert_eq!(map.uid("p", "bob", [100, 101]), Ok(100));
        let full = map.uid("q", "carol", [100, 101]).expect_err("full");
        assert!(full.contains("given to other principals"), "{full}");
        assert!(full.contains(&path.display().to_string()), "{full}");
        let moved = map.uid("p", "bob", [200, 210]).expect_err("outside");
        assert!(moved.contains("outside the range"), "{moved}");
        assert_eq!(map.principals("p"), ["bob", "alice"]);
        // A looser file is made 0600 at load; a broken one is refused naming it.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        UidMap::load(&path).expect("load");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(&path, "{").expect("w");
        let err = UidMap::load(&path).err().expect("refused");
        assert!(err.contains("is not valid"), "{err}");
    }
}
