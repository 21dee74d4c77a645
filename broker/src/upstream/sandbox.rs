//! The sandbox of a brokered upstream: what it sees (a mount namespace of its own whose root
//! holds only what its rules name, so no named Unix socket outside them can be reached, whatever
//! its uid), what it may read and write there (Landlock), which TCP it may open (Landlock), an
//! IPC namespace of its own (no SysV shared memory, semaphores or message queues of the host),
//! with `network = false` a network namespace of its own (the namespaces are made inside a user
//! namespace of its own when the broker is not root), its environment
//! (only what the provider declares, plus `PATH`/`HOME`/`LANG`), its limits (rlimits), its uid
//! (`run_as`, `upstream_uids`, or one of its own from [`DEFAULT_UPSTREAM_UIDS`]: never root's),
//! no new privileges, death with the broker, and its own
//! process group, killed whole when its session ends.
//!
//! The broker plans it ([`plan`], at spawn: fail closed, naming what is missing) and shows it;
//! the launcher applies it ([`launch`]): the broker's own executable, run as
//! `sharedos-broker sandbox-exec PLAN COMMAND ARGS...`, single-threaded, applies every wall to
//! itself and then `exec`s the upstream, which inherits them all. (`pre_exec` would do it in
//! the forked child, but it is `unsafe`, which this workspace forbids.)

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, NetPort, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope as LandlockScope,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::config::{NetworkSetting, SandboxConfig, parse_run_as};

/// The hidden subcommand of `sharedos-broker` that is the launcher.
pub const SUBCOMMAND: &str = "sandbox-exec";
/// The hidden subcommand that tells whether this kernel lets a process that is not root make a
/// user namespace and a network namespace in it (exit 0), or why not (stderr, exit 1).
pub const PROBE_SUBCOMMAND: &str = "sandbox-probe-userns";
/// How the launcher's error line starts on the upstream's stderr.
pub const LAUNCHER_ERROR: &str = "sharedos-broker sandbox-exec: error: ";
/// How long a failed start waits for the launcher's error line.
pub const LAUNCHER_ERROR_WAIT: std::time::Duration = std::time::Duration::from_millis(500);
/// Where the launcher is when the broker is embedded in another program (tests, benches): the
/// path of a `sharedos-broker` binary.
pub const LAUNCHER_ENV: &str = "SHAREDOS_SANDBOX_LAUNCHER";
/// The environment every sandboxed upstream gets, before its declared `env` (which may replace
/// them).
/// (The same as every helper program's: [`crate::child`].)
pub const SANDBOX_PATH: &str = crate::child::CLEAN_PATH;
pub const SANDBOX_LANG: &str = crate::child::CLEAN_LANG;
pub const DEFAULT_HOME: &str = crate::child::CLEAN_HOME;
/// Default limits (each configurable in `[providers.sandbox]`).
/// (The config checks and fills it: defined there, below this floor.)
pub use crate::config::DEFAULT_MEMORY_MB;
pub const DEFAULT_PROCESSES: u64 = 512;
pub const DEFAULT_OPEN_FILES: u64 = 1024;
/// Read-only by default (those that exist): the system's programs and libraries, and from
/// `/etc` only what a program needs to load libraries, resolve names and check certificates.
/// Not `/etc` as a whole (`/etc/shadow`), not `/proc` (the broker's `environ`), not `/home`,
/// `/root`, `/tmp` or `/run`.
pub const DEFAULT_READ: &[&str] = &[
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/bin",
    "/sbin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/passwd",
    "/etc/group",
    "/etc/alternatives",
    "/dev/urandom",
    "/dev/random",
    "/dev/zero",
];
/// (Defined with the config, which assigns them at load.)
pub use crate::config::DEFAULT_UPSTREAM_UIDS;
/// Read-write by default.
pub const DEFAULT_WRITE: &[&str] = &["/dev/null"];
/// The Landlock ABI the filesystem rules need (truncate is ABI 3), and the TCP rules (ABI 4).
pub const LANDLOCK_FS_ABI: u32 = 3;
pub const LANDLOCK_NET_ABI: u32 = 4;
/// The highest ABI [`kernel_abi`] tells apart (ABI 7 and 8 add no access right to probe).
const PROBED_ABI: u32 = 6;

/// What the launcher applies, and what `providers` shows and `provider_state` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// The uid and gid the upstream runs as.
    pub uid: u32,
    pub gid: u32,
    /// Whether the launcher changes its uid (`run_as`), or keeps the broker's (root's
    /// capabilities are then dropped).
    pub own_uid: bool,
    /// Read-only (and execute) beneath these; read-write beneath `write`.
    pub read: Vec<String>,
    pub write: Vec<String>,
    /// Each of those rules with where it came from, as `providers` shows them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
    /// `off`, `all`, or `ports`.
    pub network: String,
    /// TCP ports it may connect to (`network = "ports"`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// A network namespace of its own (only loopback, down).
    pub netns: bool,
    /// The namespaces are made inside a user namespace of its own (the broker is not root), in
    /// which its uid and gid are mapped to themselves.
    #[serde(default)]
    pub userns: bool,
    /// A mount namespace of its own, whose root holds only its rules' paths (read ones
    /// read-only): nothing else, named Unix sockets included, is there to be opened.
    #[serde(default)]
    pub mount_ns: bool,
    /// An IPC namespace of its own: the host's SysV shared memory, semaphores and message
    /// queues are not there.
    #[serde(default)]
    pub ipc_ns: bool,
    pub memory_bytes: u64,
    pub processes: u64,
    pub open_files: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<u64>,
    /// A `per_principal` provider's instances: each under a uid of its own, or the provider's
    /// (and why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_uids: Option<InstanceUids>,
    /// The Landlock ABI the rules need (the kernel has at least this).
    pub landlock_abi: u32,
    /// The broker's pid: the launcher exits if its parent is already another.
    pub parent: u32,
}

/// One read or write rule of a sandbox, and where it came from: `default` (the system's
/// folders), `command folder` (the command's own folder, or the prefix of its `bin` folder),
/// `interpreter` (a script's `#!` interpreter's), `file_root` (a template's), or `config`
/// (`[providers.sandbox] read`/`write`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub path: String,
    /// `read` or `write`.
    pub access: String,
    pub origin: String,
}

/// The uids of a `per_principal` provider's instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum InstanceUids {
    /// Each principal's instance under its own uid (= gid) from `[first, last]` (`setting`: the
    /// setting it comes from).
    Own {
        first: u32,
        last: u32,
        setting: String,
    },
    /// Every instance under the provider's uid, in the provider's sandbox.
    Shared { why: String },
}

impl Plan {
    /// The plan as shown and recorded (the broker's pid left out).
    pub fn shown(&self) -> Value {
        let mut v = json!(self);
        if let Some(o) = v.as_object_mut() {
            o.remove("parent");
        }
        v
    }

    /// The plan of one principal's instance under `uid` (= gid), its own.
    pub fn as_instance(&self, uid: u32) -> Plan {
        Plan {
            uid,
            gid: uid,
            own_uid: true,
            instance_uids: None,
            ..self.clone()
        }
    }

    /// Adds how a `per_principal` provider's instances get their uids: from `range` (the
    /// provider's `instance_uids`, or the top-level one: `setting` says which), which needs the
    /// broker to be root; without a range, or without root, the provider's own uid, said so.
    pub fn with_instances(
        mut self,
        namespace: &str,
        range: Option<[u32; 2]>,
        setting: &str,
    ) -> Result<Plan, String> {
        let me = rustix::process::geteuid().as_raw();
        self.instance_uids = Some(match range {
            Some([first, last]) if me == 0 => InstanceUids::Own {
                first,
                last,
                setting: setting.to_owned(),
            },
            Some([first, last]) => {
                return Err(format!(
                    "provider `{namespace}`: the sandbox cannot be applied: {setting} = [{first}, {last}] needs the broker to run as root (it runs as uid {me}); without it each instance keeps the provider's sandbox and uid"
                ));
            }
            None if me == 0 => InstanceUids::Shared {
                why: format!(
                    "no instance_uids: every instance runs under the provider's uid {}",
                    self.uid
                ),
            },
            None => InstanceUids::Shared {
                why: format!(
                    "the broker is not root (uid {me}): every instance runs under its uid, in the provider's sandbox"
                ),
            },
        });
        Ok(self)
    }
}

/// The kernel's Landlock ABI as far as this broker uses it (0: Landlock unavailable), found by
/// asking for each ABI's rights as a hard requirement, highest first.
pub fn kernel_abi() -> u32 {
    for n in (1..=PROBED_ABI).rev() {
        let abi = ABI::from(n as i32);
        let made = (|| {
            let mut r = Ruleset::default()
                .set_compatibility(CompatLevel::HardRequirement)
                .handle_access(AccessFs::from_all(abi))?;
            if n >= LANDLOCK_NET_ABI {
                r = r.handle_access(AccessNet::from_all(abi))?;
            }
            if n >= 6 {
                r = r.scope(LandlockScope::from_all(abi))?;
            }
            r.create()
        })();
        if made.is_ok() {
            return n;
        }
    }
    0
}

/// The upstream's command as the launcher will find it: a path with `/` relative to the config's
/// folder, else looked up in the `PATH` the upstream gets (its declared one, or
/// [`SANDBOX_PATH`]), not the broker's.
fn command_path(command: &str, base: &Path, path: Option<&str>) -> Option<PathBuf> {
    if command.contains('/') {
        let p = Path::new(command);
        return Some(if p.is_absolute() {
            p.to_path_buf()
        } else {
            base.join(p)
        });
    }
    std::env::split_paths(path.unwrap_or(SANDBOX_PATH))
        .map(|d| d.join(command))
        .find(|p| p.is_file())
}

/// The folders a program needs to run, readable by default: its own folder, the prefix of a
/// `bin` folder (a virtualenv's or a package's libraries beside it), the same for the file it
/// links to, and, for a script, the same for its `#!` interpreter (a virtualenv's `python` leads
/// to the Python it was made from); each with its origin (`command folder`, `interpreter`).
fn program_dirs(program: &Path) -> Vec<(String, &'static str)> {
    fn dirs_of(p: &Path, origin: &'static str, out: &mut Vec<(String, &'static str)>) {
        let Some(dir) = p.parent() else { return };
        out.push((dir.display().to_string(), origin));
        if dir.file_name().is_some_and(|n| n == "bin")
            && let Some(prefix) = dir.parent()
            && prefix != Path::new("/")
            && prefix != Path::new("/usr")
        {
            out.push((prefix.display().to_string(), origin));
        }
    }
    let mut out = Vec::new();
    let mut programs = vec![(program.to_path_buf(), ORIGIN_COMMAND)];
    let mut head = [0u8; 256];
    let n = std::fs::File::open(program)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .unwrap_or(0);
    if let Some(line) = head[..n].strip_prefix(b"#!")
        && let Some(line) = line.split(|b| *b == b'\n').next()
        && let Ok(line) = std::str::from_utf8(line)
        && let Some(interpreter) = line.split_whitespace().next()
    {
        programs.push((PathBuf::from(interpreter), ORIGIN_INTERPRETER));
    }
    for (p, origin) in programs {
        dirs_of(&p, origin, &mut out);
        if let Ok(real) = std::fs::canonicalize(&p) {
            dirs_of(&real, origin, &mut out);
        }
    }
    out
}

/// Where a rule came from (see [`Rule`]).
pub const ORIGIN_DEFAULT: &str = "default";
pub const ORIGIN_COMMAND: &str = "command folder";
pub const ORIGIN_INTERPRETER: &str = "interpreter";
pub const ORIGIN_FILE_ROOT: &str = "file_root";
pub const ORIGIN_CONFIG: &str = "config";

/// A provider's read and write rules with their origins (`roots`: its templates' `file_root`
/// folders, and whether a template writes there), each path once per access (its first
/// origin): fails, naming it, where a configured path does not exist.
pub fn rules(
    namespace: &str,
    config: &SandboxConfig,
    command: &str,
    base: &Path,
    path: Option<&str>,
    roots: &[(PathBuf, bool)],
) -> Result<Vec<Rule>, String> {
    let at = format!("provider `{namespace}`: the sandbox cannot be applied");
    let mut out: Vec<Rule> = Vec::new();
    let mut add = |path: String, access: &str, origin: &str| {
        if !out.iter().any(|r| r.path == path && r.access == access) {
            out.push(Rule {
                path,
                access: access.to_owned(),
                origin: origin.to_owned(),
            });
        }
    };
    for p in DEFAULT_READ.iter().filter(|p| Path::new(p).exists()) {
        add((*p).to_owned(), "read", ORIGIN_DEFAULT);
    }
    if let Some(cmd) = command_path(command, base, path) {
        for (dir, origin) in program_dirs(&cmd) {
            add(dir, "read", origin);
        }
    }
    // The folders its templates name as `file_root`: the broker sends it host paths there.
    for (root, writes) in roots {
        if !*writes && root.exists() {
            add(root.display().to_string(), "read", ORIGIN_FILE_ROOT);
        }
    }
    for p in &config.read {
        if !p.exists() {
            return Err(format!("{at}: read path `{}` does not exist", p.display()));
        }
        add(p.display().to_string(), "read", ORIGIN_CONFIG);
    }
    for p in DEFAULT_WRITE.iter().filter(|p| Path::new(p).exists()) {
        add((*p).to_owned(), "write", ORIGIN_DEFAULT);
    }
    for (root, writes) in roots {
        if *writes && root.exists() {
            add(root.display().to_string(), "write", ORIGIN_FILE_ROOT);
        }
    }
    for p in &config.write {
        if !p.exists() {
            return Err(format!("{at}: write path `{}` does not exist", p.display()));
        }
        add(p.display().to_string(), "write", ORIGIN_CONFIG);
    }
    Ok(out)
}

/// `path` with its links resolved and `..` removed; a path that does not exist (yet) is
/// resolved as far as it exists, the rest appended.
pub fn canonical(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let mut rest = Vec::new();
    let mut at = path;
    loop {
        match at.parent() {
            Some(parent) => {
                if let Some(name) = at.file_name() {
                    rest.push(name.to_owned());
                }
                at = parent;
                if at.as_os_str().is_empty() {
                    at = Path::new(".");
                }
                if let Ok(mut p) = std::fs::canonicalize(at) {
                    for name in rest.iter().rev() {
                        p.push(name);
                    }
                    return p;
                }
            }
            None => return path.to_path_buf(),
        }
    }
}

/// The first of `rules` that reaches one of the broker's own files (`protected`: what it is, and
/// where), on canonical paths in both directions (a rule that is the file, a folder above it,
/// or a folder inside a protected folder): what it would expose and how to fix it.
pub fn exposure(rules: &[Rule], protected: &[(String, PathBuf)]) -> Option<String> {
    let protected: Vec<(&String, PathBuf)> = protected
        .iter()
        .map(|(what, p)| (what, canonical(p)))
        .collect();
    for rule in rules {
        let at = canonical(Path::new(&rule.path));
        for (what, file) in &protected {
            if !file.starts_with(&at) && !at.starts_with(file) {
                continue;
            }
            let fix = match rule.origin.as_str() {
                ORIGIN_COMMAND => {
                    "move the upstream's command (and what it needs) to a folder of its own that holds none of the broker's files"
                }
                ORIGIN_INTERPRETER => {
                    "use an interpreter in a folder that holds none of the broker's files"
                }
                ORIGIN_FILE_ROOT => {
                    "give the template a file_root that holds none of the broker's files"
                }
                ORIGIN_CONFIG => {
                    "name in [providers.sandbox] a narrower folder that holds none of the broker's files"
                }
                _ => "keep the broker's files out of the folders its sandbox reads by default",
            };
            return Some(format!(
                "its sandbox's {} rule `{}` ({}) would expose {what} `{}` to the upstream: a rule reaches everything beneath it, and Landlock cannot carve a file or folder out of it; {fix} (or keep the broker's files elsewhere)",
                rule.access,
                rule.path,
                rule.origin,
                file.display(),
            ));
        }
    }
    None
}

/// Plans a provider's sandbox (`roots`: its templates' `file_root` folders, and whether a
/// template writes there): fails (naming what is missing) where it cannot be applied.
pub fn plan(
    namespace: &str,
    config: &SandboxConfig,
    command: &str,
    base: &Path,
    path: Option<&str>,
    roots: &[(PathBuf, bool)],
    kernel_abi: u32,
) -> Result<Plan, String> {
    let at = format!("provider `{namespace}`: the sandbox cannot be applied");
    let restricted = !matches!(config.network, NetworkSetting::All(true));
    let need = LANDLOCK_FS_ABI
        .max(if restricted { LANDLOCK_NET_ABI } else { 0 })
        .max(config.min_landlock_abi.unwrap_or(0));
    if kernel_abi == 0 {
        return Err(format!(
            "{at}: Landlock is not available in this kernel (not built in, or not enabled at boot: add `lsm=...,landlock` to the kernel command line); set `sandbox = \"none\"` to run it without one"
        ));
    }
    if kernel_abi < need {
        return Err(format!(
            "{at}: it needs Landlock ABI {need} (filesystem rules {LANDLOCK_FS_ABI}, TCP rules {LANDLOCK_NET_ABI}{}), this kernel offers ABI {kernel_abi}; set `sandbox = \"none\"` to run it without one",
            config
                .min_landlock_abi
                .map(|m| format!(", min_landlock_abi {m}"))
                .unwrap_or_default()
        ));
    }
    let me = rustix::process::geteuid().as_raw();
    let my_gid = rustix::process::getegid().as_raw();
    let (uid, gid, own_uid) = match &config.run_as {
        Some(r) => {
            let (uid, gid) = parse_run_as(r).map_err(|e| format!("{at}: {e}"))?;
            if me != 0 {
                return Err(format!(
                    "{at}: run_as = `{r}` needs the broker to run as root (it runs as uid {me})"
                ));
            }
            if uid == me {
                return Err(format!("{at}: run_as = `{r}` is the broker's own uid"));
            }
            (uid, gid, true)
        }
        None => (me, my_gid, false),
    };
    let rules = rules(namespace, config, command, base, path, roots)?;
    let of = |access: &str| -> Vec<String> {
        rules
            .iter()
            .filter(|r| r.access == access)
            .map(|r| r.path.clone())
            .collect()
    };
    let (read, write) = (of("read"), of("write"));
    let netns = matches!(config.network, NetworkSetting::All(false));
    // Only root can make namespaces without a user namespace; a broker that is not root makes
    // them inside one, where the kernel allows it, or refuses the provider (the mount namespace
    // is what keeps named Unix sockets out: no sandbox without it).
    let userns = me != 0;
    if userns && let Err(why) = userns_available() {
        let net = if netns {
            "network = false needs a network namespace of its own, and "
        } else {
            ""
        };
        return Err(format!(
            "{at}: {net}the sandbox shows the upstream only its rules' paths in a mount namespace of its own, which a broker that is not root (uid {me}) makes inside a user namespace, which this machine refuses: {why} (unprivileged user namespaces are off: see sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns); run the broker as root, or set `sandbox = \"none\"` to run it without one"
        ));
    }
    let (network, ports) = match &config.network {
        NetworkSetting::All(true) => ("all", vec![]),
        NetworkSetting::All(false) => ("off", vec![]),
        NetworkSetting::Allow(list) => {
            let mut ports: Vec<u16> = list
                .iter()
                .filter_map(|e| e.rsplit_once(':').and_then(|(_, p)| p.parse().ok()))
                .collect();
            ports.sort_unstable();
            ports.dedup();
            ("ports", ports)
        }
    };
    Ok(Plan {
        uid,
        gid,
        own_uid,
        read,
        write,
        rules,
        network: network.to_owned(),
        ports,
        netns,
        userns,
        mount_ns: true,
        ipc_ns: true,
        // Checked at load (`memory_mb` fits in bytes); saturating all the same.
        memory_bytes: config
            .memory_mb
            .unwrap_or(DEFAULT_MEMORY_MB)
            .saturating_mul(1024 * 1024),
        processes: config.processes.unwrap_or(DEFAULT_PROCESSES),
        open_files: config.open_files.unwrap_or(DEFAULT_OPEN_FILES),
        cpu_seconds: config.cpu_seconds.filter(|s| *s > 0),
        instance_uids: None,
        landlock_abi: need,
        parent: std::process::id(),
    })
}

/// Whether a process under the broker's uid can make a user namespace with a network namespace
/// in it, asked once per broker of a launcher run as [`PROBE_SUBCOMMAND`] (the broker is
/// multi-threaded: the kernel lets only a single-threaded process make a user namespace).
fn userns_available() -> Result<(), String> {
    static PROBED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    PROBED
        .get_or_init(|| {
            let out = std::process::Command::new(launcher()?)
                .arg(PROBE_SUBCOMMAND)
                .env_clear()
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .output()
                .map_err(|e| format!("cannot run the sandbox launcher to find out: {e}"))?;
            if out.status.success() {
                return Ok(());
            }
            let said = String::from_utf8_lossy(&out.stderr);
            let said = said.trim();
            Err(said
                .strip_prefix(LAUNCHER_ERROR)
                .unwrap_or(if said.is_empty() {
                    "the probe failed"
                } else {
                    said
                })
                .to_owned())
        })
        .clone()
}

/// The probe's work ([`PROBE_SUBCOMMAND`]): makes what the launcher would (a user namespace, the
/// mount, IPC and network namespaces in it, its uid and gid mapped) in this process, which then
/// exits.
pub fn probe_userns() -> Result<(), String> {
    single_threaded()?;
    enter_userns(namespaces(true, true, true))
}

/// The namespaces the launcher makes (besides the user namespace).
fn namespaces(mount: bool, ipc: bool, net: bool) -> rustix::thread::UnshareFlags {
    use rustix::thread::UnshareFlags;
    let mut flags = UnshareFlags::empty();
    for (on, flag) in [
        (mount, UnshareFlags::NEWNS),
        (ipc, UnshareFlags::NEWIPC),
        (net, UnshareFlags::NEWNET),
    ] {
        if on {
            flags |= flag;
        }
    }
    flags
}

/// Credentials, limits, namespaces and Landlock are per thread in the kernel: they hold for the
/// program only if this is its only thread.
fn single_threaded() -> Result<(), String> {
    let threads = std::fs::read_dir("/proc/self/task")
        .map_err(|e| format!("cannot count the launcher's threads: {e}"))?
        .count();
    if threads != 1 {
        return Err(format!(
            "the launcher has {threads} threads; it must have one"
        ));
    }
    Ok(())
}

/// A user namespace and the namespaces `flags` names owned by it, for a process that is not
/// root: its uid and gid are mapped to themselves (files keep their owners, and the upstream sees
/// its own uid), `setgroups` is denied in it (the kernel's condition for an unprivileged gid
/// map), and the capabilities the namespace's creator holds in it are dropped by the caller
/// before exec.
fn enter_userns(flags: rustix::thread::UnshareFlags) -> Result<(), String> {
    let uid = rustix::process::geteuid().as_raw();
    let gid = rustix::process::getegid().as_raw();
    unshare(rustix::thread::UnshareFlags::NEWUSER | flags).map_err(|e| {
        format!(
            "cannot make a user namespace with mount, IPC and network namespaces (unshare): {e}"
        )
    })?;
    let write = |file: &str, text: String| {
        std::fs::write(format!("/proc/self/{file}"), text)
            .map_err(|e| format!("cannot write /proc/self/{file} in the new user namespace: {e}"))
    };
    write("setgroups", "deny".to_owned())?;
    write("uid_map", format!("{uid} {uid} 1\n"))?;
    write("gid_map", format!("{gid} {gid} 1\n"))?;
    if rustix::process::geteuid().as_raw() != uid {
        return Err(format!(
            "the uid is not mapped to {uid} in the user namespace"
        ));
    }
    Ok(())
}

/// The launcher: the path of a `sharedos-broker` binary (this program if it is one; else
/// [`LAUNCHER_ENV`]; else one beside this program or in its parent folder, as in Cargo's
/// `target/debug` for tests).
pub fn launcher() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(LAUNCHER_ENV) {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe()
        .map_err(|e| format!("cannot find the sandbox launcher (this program's path: {e})"))?;
    if me.file_name().is_some_and(|n| n == "sharedos-broker") {
        return Ok(me);
    }
    let dir = me.parent().unwrap_or(Path::new("/"));
    [dir.join("sharedos-broker"), dir.join("../sharedos-broker")]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "cannot find the sandbox launcher: no `sharedos-broker` beside `{}`; set {LAUNCHER_ENV}",
                me.display()
            )
        })
}

/// The launcher's work: applies `plan` (JSON) to this process and becomes `command args`.
/// Returns only on failure.
pub fn launch(plan: &str, command: &OsString, args: &[OsString]) -> String {
    match apply(plan) {
        Ok(()) => {
            use std::os::unix::process::CommandExt;
            let e = std::process::Command::new(command).args(args).exec();
            format!("cannot run `{}`: {e}", command.to_string_lossy())
        }
        Err(e) => e,
    }
}

fn apply(plan: &str) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let plan: Plan =
        serde_json::from_str(plan).map_err(|e| format!("the sandbox plan is not valid: {e}"))?;
    single_threaded()?;
    // The namespaces first (before the limits and Landlock): a user namespace made after the
    // limits would take the lowered RLIMIT_NPROC as its own ceiling; mounts need the
    // capabilities the uid change and Landlock take away.
    let flags = namespaces(plan.mount_ns, plan.ipc_ns, plan.netns);
    if plan.userns {
        enter_userns(flags)?;
    } else if !flags.is_empty() {
        unshare(flags).map_err(|e| {
            format!("cannot make the sandbox's mount, IPC and network namespaces (unshare): {e}")
        })?;
    }
    if plan.mount_ns {
        enter_view(&plan)?;
    }
    rustix::process::setsid().map_err(|e| format!("setsid: {e}"))?;
    let mut limits = vec![
        (Resource::Data, plan.memory_bytes, "memory"),
        (Resource::Nproc, plan.processes, "processes"),
        (Resource::Nofile, plan.open_files, "open files"),
    ];
    if let Some(cpu) = plan.cpu_seconds {
        limits.push((Resource::Cpu, cpu, "cpu seconds"));
    }
    for (resource, value, name) in limits {
        let hard = getrlimit(resource).maximum;
        let v = hard.map_or(value, |h| h.min(value));
        setrlimit(
            resource,
            Rlimit {
                current: Some(v),
                maximum: Some(v),
            },
        )
        .map_err(|e| format!("cannot limit {name} to {v}: {e}"))?;
    }
    // The rules' folders are opened now, before the uid changes (a path the new uid cannot
    // reach still gets its rule; the file modes keep holding too).
    let ruleset = ruleset(&plan)?;
    let me = rustix::process::geteuid().as_raw();
    if plan.own_uid {
        use rustix::process::{Gid, Uid};
        let (uid, gid) = (Uid::from_raw(plan.uid), Gid::from_raw(plan.gid));
        rustix::thread::set_thread_groups(&[gid])
            .map_err(|e| format!("cannot drop supplementary groups: {e}"))?;
        rustix::thread::set_thread_res_gid(gid, gid, gid)
            .map_err(|e| format!("cannot set gid {}: {e}", plan.gid))?;
        rustix::thread::set_thread_res_uid(uid, uid, uid)
            .map_err(|e| format!("cannot set uid {}: {e}", plan.uid))?;
        if rustix::process::getuid() != uid
            || rustix::process::geteuid() != uid
            || rustix::process::getgid() != gid
        {
            return Err(format!("the uid did not change to {}", plan.uid));
        }
    } else if me == 0 || plan.userns {
        // Root keeps its uid: it keeps no capability (and with no_new_privs, exec gives none
        // back). The same for the capabilities a user namespace's creator holds in it.
        use rustix::thread::{CapabilitySet, CapabilitySets};
        rustix::thread::set_capabilities(
            None,
            CapabilitySets {
                effective: CapabilitySet::empty(),
                permitted: CapabilitySet::empty(),
                inheritable: CapabilitySet::empty(),
            },
        )
        .map_err(|e| format!("cannot drop root's capabilities: {e}"))?;
    }
    // After the uid change (a change of credentials clears it).
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("cannot set the parent-death signal: {e}"))?;
    if rustix::process::getppid().map(|p| p.as_raw_pid() as u32) != Some(plan.parent) {
        return Err("the broker is gone".into());
    }
    let status = ruleset
        .restrict_self()
        .map_err(|e| format!("landlock: {e}"))?;
    if status.ruleset == RulesetStatus::NotEnforced || !status.no_new_privs {
        return Err(format!("landlock was not enforced ({status:?})"));
    }
    Ok(())
}

fn ruleset(plan: &Plan) -> Result<landlock::RulesetCreated, String> {
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    let fs = ABI::from(LANDLOCK_FS_ABI as i32);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(fs))
        .map_err(err)?;
    if plan.network != "all" {
        ruleset = ruleset
            .handle_access(AccessNet::from_all(ABI::from(LANDLOCK_NET_ABI as i32)))
            .map_err(err)?;
    }
    // Abstract Unix sockets and signals outside the sandbox: where the kernel has it (ABI 6).
    let mut created = ruleset
        .set_compatibility(CompatLevel::BestEffort)
        .scope(LandlockScope::from_all(ABI::V6))
        .map_err(err)?
        .create()
        .map_err(err)?
        .set_compatibility(CompatLevel::HardRequirement);
    let rules = plan
        .read
        .iter()
        .map(|p| (p, AccessFs::from_read(fs)))
        .chain(plan.write.iter().map(|p| (p, AccessFs::from_all(fs))));
    for (path, access) in rules {
        let fd = PathFd::new(path).map_err(|e| format!("landlock: `{path}`: {e}"))?;
        let access = if Path::new(path).is_dir() {
            access
        } else {
            access & AccessFs::from_file(fs)
        };
        created = created
            .add_rule(PathBeneath::new(fd, access))
            .map_err(err)?;
    }
    for port in &plan.ports {
        created = created
            .add_rule(NetPort::new(*port, AccessNet::ConnectTcp))
            .map_err(err)?;
    }
    Ok(created)
}

/// `unshare(2)` of namespaces only (never FILES), in the single-threaded launcher: the hazard
/// `unshare_unsafe` warns of (FILES splitting the descriptor table between threads) cannot
/// arise.
fn unshare(flags: rustix::thread::UnshareFlags) -> rustix::io::Result<()> {
    #[expect(
        deprecated,
        reason = "namespaces only, one thread: the FILES hazard behind the deprecation does not apply"
    )]
    rustix::thread::unshare(flags - rustix::thread::UnshareFlags::FILES)
}

/// One rule's path in the upstream's view: bound at `at` (in the new root) from `fd`.
struct Bind {
    at: PathBuf,
    fd: rustix::fd::OwnedFd,
    dir: bool,
    write: bool,
}

/// Where the new root is built, in the launcher's own mount namespace (it exists on every
/// system; what it held is covered only there).
const VIEW_BUILD: &str = "/tmp";

/// The upstream's view of the filesystem, in the mount namespace the launcher just made: a new
/// root (an empty tmpfs, read-only once built) holding a bind mount of each rule's path at the
/// same path (read rules read-only, write rules read-write; a path named through a symlink
/// also gets the symlink), made the root (`pivot_root`), the old root detached. Nothing else
/// is there to open, connect to or list: the host's named Unix sockets (`/run`, a session's
/// bus, an agent's socket) among it. Landlock applies on top.
fn enter_view(plan: &Plan) -> Result<(), String> {
    use rustix::fs::{CWD, Mode, OFlags};
    use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};
    let mount_err = |what: &str, e: rustix::io::Errno| format!("mount namespace: {what}: {e}");
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
    )
    .map_err(|e| mount_err("cannot make `/` private", e))?;
    // Every rule's path is opened before anything is covered (a rule under /tmp included).
    let mut binds: Vec<Bind> = Vec::new();
    let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
    let rules = plan
        .read
        .iter()
        .map(|p| (p, false))
        .chain(plan.write.iter().map(|p| (p, true)));
    for (path, write) in rules {
        let named = Path::new(path);
        let open = |p: &Path| {
            rustix::fs::openat(CWD, p, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| format!("mount namespace: `{}`: {e}", p.display()))
        };
        let real =
            std::fs::canonicalize(named).map_err(|e| format!("mount namespace: `{path}`: {e}"))?;
        let fd = open(&real)?;
        let dir = rustix::fs::fstat(&fd)
            .map(|st| {
                rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
            })
            .map_err(|e| format!("mount namespace: `{path}`: {e}"))?;
        if real != named && named.is_absolute() {
            let parent_real = named
                .parent()
                .and_then(|p| std::fs::canonicalize(p).ok())
                .is_some_and(|p| Some(p.as_path()) == named.parent());
            match std::fs::read_link(named) {
                // Only the last component is a link: the same link, to the bound target.
                Ok(to) if parent_real => links.push((named.to_path_buf(), to)),
                // A folder on the way is a link: the target bound at the named path too.
                _ => binds.push(Bind {
                    at: named.to_path_buf(),
                    fd: open(&real)?,
                    dir,
                    write,
                }),
            }
        }
        binds.push(Bind {
            at: real,
            fd,
            dir,
            write,
        });
    }
    // Outer paths first, so that an inner one is bound over them; a read rule beneath a bound
    // path (or a write rule beneath a write rule) is already there.
    binds.sort_by_key(|b| (b.at.components().count(), b.write));
    let new_root = Path::new(VIEW_BUILD);
    rustix::mount::mount(
        "sharedos-sandbox",
        new_root,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(c"mode=0755,size=1m"),
    )
    .map_err(|e| mount_err(&format!("cannot mount a tmpfs on {VIEW_BUILD}"), e))?;
    let mut bound: Vec<(PathBuf, bool)> = Vec::new();
    for b in &binds {
        if bound
            .iter()
            .any(|(at, write)| b.at.starts_with(at) && (*write || !b.write))
        {
            continue;
        }
        let Ok(rel) = b.at.strip_prefix("/") else {
            continue;
        };
        let target = new_root.join(rel);
        if std::fs::symlink_metadata(&target).is_err() {
            let made = if b.dir {
                std::fs::create_dir_all(&target)
            } else {
                target
                    .parent()
                    .map_or(Ok(()), std::fs::create_dir_all)
                    .and_then(|()| std::fs::File::create(&target).map(drop))
            };
            made.map_err(|e| {
                format!(
                    "mount namespace: cannot make the mount point of `{}`: {e}",
                    b.at.display()
                )
            })?;
        }
        let source = format!("/proc/self/fd/{}", rustix::fd::AsRawFd::as_raw_fd(&b.fd));
        rustix::mount::mount_bind_recursive(&source, &target)
            .map_err(|e| mount_err(&format!("cannot bind `{}`", b.at.display()), e))?;
        if !b.write {
            // Read-only, keeping the flags the kernel locks (nosuid, nodev, noexec, atime)
            // in a user namespace.
            let vfs = rustix::fs::fstatvfs(&b.fd)
                .map_err(|e| mount_err(&format!("cannot stat `{}`", b.at.display()), e))?;
            remount_read_only(&target, vfs.f_flag).map_err(|e| {
                mount_err(&format!("cannot make `{}` read-only", b.at.display()), e)
            })?;
        }
        bound.push((b.at.clone(), b.write));
    }
    for (at, to) in &links {
        let Ok(rel) = at.strip_prefix("/") else {
            continue;
        };
        let target = new_root.join(rel);
        if std::fs::symlink_metadata(&target).is_ok() {
            continue;
        }
        target
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::os::unix::fs::symlink(to, &target))
            .map_err(|e| {
                format!(
                    "mount namespace: cannot make the link `{}`: {e}",
                    at.display()
                )
            })?;
    }
    drop(binds);
    // The new root becomes `/`, the old one is stacked beneath it and detached.
    std::env::set_current_dir(new_root)
        .map_err(|e| format!("mount namespace: cannot enter the new root: {e}"))?;
    rustix::process::pivot_root(".", ".").map_err(|e| mount_err("pivot_root", e))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH)
        .map_err(|e| mount_err("cannot detach the old root", e))?;
    std::env::set_current_dir("/")
        .map_err(|e| format!("mount namespace: cannot enter the new root: {e}"))?;
    remount_read_only(
        Path::new("/"),
        rustix::fs::StatVfsMountFlags::NOSUID | rustix::fs::StatVfsMountFlags::NODEV,
    )
    .map_err(|e| mount_err("cannot make the new root read-only", e))?;
    Ok(())
}

/// Remounts the bind mount at `target` read-only, keeping `flags` (the source's).
fn remount_read_only(
    target: &Path,
    flags: rustix::fs::StatVfsMountFlags,
) -> rustix::io::Result<()> {
    use rustix::fs::StatVfsMountFlags as V;
    use rustix::mount::MountFlags as M;
    let mut keep = M::BIND | M::RDONLY;
    for (v, m) in [
        (V::NOSUID, M::NOSUID),
        (V::NODEV, M::NODEV),
        (V::NOEXEC, M::NOEXEC),
        (V::NOATIME, M::NOATIME),
        (V::NODIRATIME, M::NODIRATIME),
        (V::RELATIME, M::RELATIME),
    ] {
        if flags.contains(v) {
            keep |= m;
        }
    }
    rustix::mount::mount_remount(target, keep, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(path: &Path, access: &str, origin: &str) -> Rule {
        Rule {
            path: path.display().to_string(),
            access: access.into(),
            origin: origin.into(),
        }
    }

    /// A rule reaches a protected file when it is the file, a folder above it (`/` too), or a
    /// folder inside a protected folder; links and `..` are resolved first; a sibling does not.
    #[test]
    fn a_rule_that_reaches_a_brokers_file_is_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let d = dir.path();
        std::fs::create_dir_all(d.join("conf/secrets/alice")).expect("mkdir");
        std::fs::create_dir_all(d.join("up")).expect("mkdir");
        std::fs::write(d.join("conf/broker.toml"), "").expect("w");
        std::os::unix::fs::symlink(d.join("conf"), d.join("link")).expect("link");
        let protected = vec![
            ("the config".to_owned(), d.join("conf/broker.toml")),
            ("the secrets folder".to_owned(), d.join("conf/secrets")),
            ("the record".to_owned(), d.join("conf/not-yet/record.jsonl")),
        ];
        let said = |p: PathBuf, origin: &str| exposure(&[rule(&p, "read", origin)], &protected);
        for (p, what) in [
            (d.join("conf/broker.toml"), "the config"),
            (d.join("conf"), "the config"),
            (PathBuf::from("/"), "the config"),
            (d.join("link"), "the config"),
            (d.join("up/../conf"), "the config"),
            (d.join("conf/secrets/alice"), "the secrets folder"),
            (d.join("conf/not-yet"), "the record"),
        ] {
            let e = said(p.clone(), ORIGIN_CONFIG).unwrap_or_default();
            assert!(
                e.contains(&format!(
                    "read rule `{}` (config) would expose {what}",
                    p.display()
                )),
                "{p:?}: {e}"
            );
        }
        assert_eq!(said(d.join("up"), ORIGIN_COMMAND), None);
        let e = said(d.join("conf"), ORIGIN_COMMAND).unwrap_or_default();
        assert!(
            e.contains("(command folder)") && e.contains("folder of its own"),
            "{e}"
        );
    }
}
