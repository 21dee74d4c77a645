//! Secret stores: where a provider's `{ secret = "name" }` references get their values, per
//! principal, at spawn time; and what the broker keeps to redact those values from what leaves it.
//!
//! Owns: the [`SecretStore`] trait and its two stores, the folder ([`FolderStore`]:
//! `secrets_dir/<principal>/<name>`, `secrets_dir/_shared/<name>`, each file a plain file of the
//! broker's uid, mode 0600 or stricter, opened without following a link and checked on its
//! descriptor) and the helper command ([`CommandStore`]: `secret_command`, stdout is the secret,
//! a non-zero exit is "not found", bounded in time and bytes); [`Known`], the values given to
//! instances, by principal, and their redaction (`[redacted: NAME]`).
//! A value never appears in an error, a log line or a `Debug` output: [`Secret`] prints as its
//! length only.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustix::fd::AsFd;
use rustix::fs::{AtFlags, OFlags};
use serde_json::Value;

use crate::trusted::{TrustError, TrustedDir};

/// The folder of `secrets_dir` whose secrets are one value for every principal.
pub const SHARED: &str = "_shared";
/// Longest secret value, in bytes (a file or a helper's stdout); longer is refused.
pub const MAX_SECRET_BYTES: usize = 64 * 1024;
/// How long a `secret_command` helper may run for one secret.
pub const SECRET_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest principal or secret name a store accepts (bytes).
pub const MAX_SECRET_NAME_BYTES: usize = 128;

/// A secret's value. Its `Debug` shows the length, never the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Self {
        Self(value)
    }

    /// The value, to hand to the upstream (its env or args) and nowhere else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

/// Why a secret could not be had. Messages name the secret, the principal and the file or
/// helper, never a value.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("no secret `{name}` for principal `{principal}` in {store}")]
    Missing {
        principal: String,
        name: String,
        store: String,
    },
    #[error("secret `{name}` for principal `{principal}`: {detail}")]
    Refused {
        principal: String,
        name: String,
        detail: String,
    },
}

impl SecretError {
    /// The secret's name.
    pub fn name(&self) -> &str {
        match self {
            SecretError::Missing { name, .. } | SecretError::Refused { name, .. } => name,
        }
    }
}

pub type SecretFuture<'a> = Pin<Box<dyn Future<Output = Result<Secret, SecretError>> + Send + 'a>>;

/// A place secrets are read from, by principal and name.
pub trait SecretStore: Send + Sync {
    /// The secret `name` of `principal` ([`SHARED`] for the one value for everyone).
    fn get<'a>(&'a self, principal: &'a str, name: &'a str) -> SecretFuture<'a>;
    /// The store, for messages (`the folder store /etc/sharedos/secrets`).
    fn describe(&self) -> String;
}

/// A principal or secret name a store accepts: 1 to [`MAX_SECRET_NAME_BYTES`] bytes of letters,
/// digits, `_ - . @ +`, not starting with `.` (never a path).
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SECRET_NAME_BYTES
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.@+".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} `{}` is not usable as a secret store name: 1 to {MAX_SECRET_NAME_BYTES} letters, digits, `_ - . @ +`, not starting with `.`",
            sharedos_proto::name::shown(name)
        ))
    }
}

/// A value as stored: one trailing newline (`\n` or `\r\n`) is not part of it.
fn trimmed(mut bytes: Vec<u8>) -> Result<String, String> {
    if bytes.ends_with(b"\n") {
        bytes.pop();
        if bytes.ends_with(b"\r") {
            bytes.pop();
        }
    }
    String::from_utf8(bytes).map_err(|_| "the value is not UTF-8 text".to_owned())
}

/// One stored file as [`FolderStore::identity`] tells it apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity(u64, u64, i64, i64);

/// The folder store: `dir/<principal>/<name>`, `dir/_shared/<name>`.
pub struct FolderStore {
    pub dir: PathBuf,
}

impl FolderStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    fn refused(principal: &str, name: &str, e: impl std::fmt::Display) -> SecretError {
        SecretError::Refused {
            principal: principal.to_owned(),
            name: name.to_owned(),
            detail: e.to_string(),
        }
    }

    /// The principal's folder, opened and checked; `None` when it does not exist.
    fn principal_dir(&self, principal: &str, create: bool) -> Result<Option<TrustedDir>, String> {
        check_name("principal", principal)?;
        let base = match TrustedDir::open(&self.dir, create) {
            Ok(b) => b,
            // No store yet: no secret in it.
            Err(TrustError::Io { source, .. })
                if !create && source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e.to_string()),
        };
        if !create {
            match rustix::fs::statat(base.as_fd(), principal, AtFlags::SYMLINK_NOFOLLOW) {
                Err(rustix::io::Errno::NOENT) => return Ok(None),
                Err(e) => {
                    return Err(format!(
                        "cannot use `{}`: {e}",
                        base.join(principal).display()
                    ));
                }
                Ok(_) => {}
            }
        }
        base.subdir(principal, create)
            .map(Some)
            .map_err(|e| e.to_string())
    }

    /// Reads one secret file: a plain file of the broker's uid, not a link, mode 0600 or
    /// stricter, at most [`MAX_SECRET_BYTES`].
    pub fn read(&self, principal: &str, name: &str) -> Result<Secret, SecretError> {
        check_name("secret", name).map_err(|e| Self::refused(principal, name, e))?;
        let missing = || SecretError::Missing {
            principal: principal.to_owned(),
            name: name.to_owned(),
            store: self.describe(),
        };
        let dir = self
            .principal_dir(principal, false)
            .map_err(|e| Self::refused(principal, name, e))?
            .ok_or_else(missing)?;
        let file = match dir.open_file(name, OFlags::RDONLY, 0) {
            Ok(f) => f,
            Err(TrustError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Err(missing());
            }
            Err(e) => return Err(Self::refused(principal, name, e)),
        };
        let path = dir.join(name);
        let meta = file
            .metadata()
            .map_err(|e| Self::refused(principal, name, format!("`{}`: {e}", path.display())))?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(Self::refused(
                principal,
                name,
                format!(
                    "refused `{}`: its mode is {mode:04o}; a secret file must be 0600 (readable by the broker's uid only)",
                    path.display()
                ),
            ));
        }
        use std::io::Read;
        let mut bytes = Vec::new();
        file.take(MAX_SECRET_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Self::refused(principal, name, format!("`{}`: {e}", path.display())))?;
        if bytes.len() > MAX_SECRET_BYTES {
            return Err(Self::refused(
                principal,
                name,
                format!("`{}` is over {MAX_SECRET_BYTES} bytes", path.display()),
            ));
        }
        let value = trimmed(bytes)
            .map_err(|e| Self::refused(principal, name, format!("`{}`: {e}", path.display())))?;
        if value.is_empty() {
            return Err(missing());
        }
        Ok(Secret(value))
    }

    /// Writes (or replaces) a secret, 0600, in a folder made 0700 when missing.
    pub fn set(&self, principal: &str, name: &str, value: &[u8]) -> Result<PathBuf, String> {
        check_name("secret", name)?;
        if value.len() > MAX_SECRET_BYTES {
            return Err(format!("the value is over {MAX_SECRET_BYTES} bytes"));
        }
        let dir = self
            .principal_dir(principal, true)?
            .ok_or_else(|| "the principal's folder could not be made".to_owned())?;
        dir.replace(name, value, 0o600).map_err(|e| e.to_string())?;
        Ok(dir.join(name))
    }

    /// The names of a principal's secrets (never their values), sorted.
    pub fn list(&self, principal: &str) -> Result<Vec<String>, String> {
        let Some(dir) = self.principal_dir(principal, false)? else {
            return Ok(vec![]);
        };
        let fd = rustix::fs::openat(
            dir.as_fd(),
            ".",
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| format!("cannot read `{}`: {e}", dir.path().display()))?;
        let entries = rustix::fs::Dir::read_from(fd)
            .map_err(|e| format!("cannot read `{}`: {e}", dir.path().display()))?;
        let mut names = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| format!("cannot read `{}`: {e}", dir.path().display()))?;
            let n = entry.file_name().to_string_lossy().into_owned();
            if check_name("secret", &n).is_ok() && !n.ends_with(".new") {
                names.push(n);
            }
        }
        names.sort();
        Ok(names)
    }

    /// What tells one stored file from another, without reading it: its inode, size and
    /// modification time (`None` when there is none, or the names are not a store's). A reader
    /// that keeps a value uses it while this stays the same, so a value removed or replaced
    /// behind its back (`secrets delete`, another writer) is read again.
    pub fn identity(&self, principal: &str, name: &str) -> Option<FileIdentity> {
        check_name("principal", principal).ok()?;
        check_name("secret", name).ok()?;
        std::fs::symlink_metadata(self.dir.join(principal).join(name))
            .ok()
            .map(|m| FileIdentity(m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
    }

    /// Removes a secret; Ok(false) when there was none.
    pub fn delete(&self, principal: &str, name: &str) -> Result<bool, String> {
        check_name("secret", name)?;
        let Some(dir) = self.principal_dir(principal, false)? else {
            return Ok(false);
        };
        match rustix::fs::unlinkat(dir.as_fd(), name, AtFlags::empty()) {
            Ok(()) => {
                dir.sync();
                Ok(true)
            }
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(format!("cannot remove `{}`: {e}", dir.join(name).display())),
        }
    }
}

impl SecretStore for FolderStore {
    fn get<'a>(&'a self, principal: &'a str, name: &'a str) -> SecretFuture<'a> {
        Box::pin(async move { self.read(principal, name) })
    }

    fn describe(&self) -> String {
        format!("the folder store `{}`", self.dir.display())
    }
}

/// The helper-command store: `secret_command`, each `{principal}` and `{name}` in it replaced;
/// stdout is the secret, a non-zero exit is "not found". The helper runs in its own process
/// group, killed whole past [`SECRET_COMMAND_TIMEOUT`] or [`MAX_SECRET_BYTES`] of output, with
/// none of the broker's environment: `PATH`, `LANG`, the broker's `HOME`, and `env`
/// (`secret_env`), which may replace those three.
pub struct CommandStore {
    pub command: Vec<String>,
    pub timeout: Duration,
    pub env: std::collections::BTreeMap<String, String>,
}

impl CommandStore {
    pub fn new(command: Vec<String>) -> Self {
        Self {
            command,
            timeout: SECRET_COMMAND_TIMEOUT,
            env: std::collections::BTreeMap::new(),
        }
    }

    async fn run(&self, principal: &str, name: &str) -> Result<Secret, SecretError> {
        let refused = |detail: String| SecretError::Refused {
            principal: principal.to_owned(),
            name: name.to_owned(),
            detail,
        };
        check_name("principal", principal).map_err(refused)?;
        check_name("secret", name).map_err(refused)?;
        let argv: Vec<String> = self
            .command
            .iter()
            .map(|a| a.replace("{principal}", principal).replace("{name}", name))
            .collect();
        let Some((program, args)) = argv.split_first() else {
            return Err(refused("secret_command is empty".to_owned()));
        };
        let mut cmd = std::process::Command::new(program);
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        // The broker's HOME: a helper's store lives there (`pass`, `gpg`); nothing else of its
        // environment (its tokens, OTEL headers) reaches the helper.
        let home = std::env::var("HOME").unwrap_or_else(|_| crate::child::CLEAN_HOME.to_owned());
        crate::child::clean_env(
            &mut cmd,
            &home,
            self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        );
        crate::child::own_group(&mut cmd);
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| refused(format!("cannot start the secret helper `{program}`: {e}")))?;
        let pid = child.id();
        let Some(stdout) = child.stdout.take() else {
            return Err(refused("the secret helper has no stdout".to_owned()));
        };
        let read = async {
            use tokio::io::AsyncReadExt;
            let mut bytes = Vec::new();
            let mut limited = stdout.take(MAX_SECRET_BYTES as u64 + 1);
            limited.read_to_end(&mut bytes).await?;
            if bytes.len() > MAX_SECRET_BYTES {
                return Ok::<_, std::io::Error>((bytes, None));
            }
            let status = child.wait().await?;
            Ok((bytes, Some(status)))
        };
        let outcome = tokio::time::timeout(self.timeout, read).await;
        let kill_group = || {
            if let Some(pid) = pid {
                crate::child::kill_group(pid);
            }
        };
        match outcome {
            Err(_) => {
                kill_group();
                Err(refused(format!(
                    "the secret helper `{program}` did not finish within {} s; it was killed",
                    self.timeout.as_secs_f64()
                )))
            }
            Ok(Err(e)) => {
                kill_group();
                Err(refused(format!(
                    "cannot read the secret helper `{program}`: {e}"
                )))
            }
            Ok(Ok((_, None))) => {
                kill_group();
                Err(refused(format!(
                    "the secret helper `{program}` printed more than {MAX_SECRET_BYTES} bytes; it was killed"
                )))
            }
            Ok(Ok((bytes, Some(status)))) => {
                // What the helper left behind in its group goes with it.
                kill_group();
                if !status.success() {
                    return Err(SecretError::Missing {
                        principal: principal.to_owned(),
                        name: name.to_owned(),
                        store: format!("the secret helper `{program}` ({status})"),
                    });
                }
                let value = trimmed(bytes)
                    .map_err(|e| refused(format!("the secret helper `{program}`: {e}")))?;
                if value.is_empty() {
                    return Err(SecretError::Missing {
                        principal: principal.to_owned(),
                        name: name.to_owned(),
                        store: format!("the secret helper `{program}` (it printed nothing)"),
                    });
                }
                Ok(Secret(value))
            }
        }
    }
}

impl SecretStore for CommandStore {
    fn get<'a>(&'a self, principal: &'a str, name: &'a str) -> SecretFuture<'a> {
        Box::pin(self.run(principal, name))
    }

    fn describe(&self) -> String {
        format!(
            "the secret helper `{}`",
            self.command.first().map(String::as_str).unwrap_or_default()
        )
    }
}

/// The secret values given to instances, by principal ([`SHARED`]: given to a shared instance),
/// for redaction of what leaves the broker and what it records. Every principal's values are
/// redacted from every answer, whoever asked: an upstream that read another principal's value
/// (a file an instance left, a value it kept) cannot hand it to this caller. The list redacted
/// is made when a value is learned, not per call.
#[derive(Default)]
pub struct Known {
    by_principal: RwLock<HashMap<String, Vec<(String, Secret)>>>,
    /// Every value known, longest first (each with its name), rebuilt by [`Known::add`].
    all: RwLock<Arc<[(String, Secret)]>>,
}

impl Known {
    /// Remembers that `principal`'s instances were given `value` as secret `name`.
    pub fn add(&self, principal: &str, name: &str, value: &Secret) {
        let mut m = self
            .by_principal
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let list = m.entry(principal.to_owned()).or_default();
        if !list.iter().any(|(n, v)| n == name && v == value) {
            list.push((name.to_owned(), value.clone()));
            let mut all: Vec<(String, Secret)> = m.values().flatten().cloned().collect();
            // Longest first: a value inside another is replaced after it.
            all.sort_by_key(|(_, v)| std::cmp::Reverse(v.0.len()));
            all.dedup_by(|a, b| a.1 == b.1);
            *self
                .all
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = all.into();
        }
    }

    /// Every value known (any principal's), longest first.
    fn every(&self) -> Arc<[(String, Secret)]> {
        self.all
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn is_empty(&self) -> bool {
        self.every().is_empty()
    }

    /// Replaces every literal value known (for any principal: `_principal` is the caller) in
    /// `text` by `[redacted: NAME]`; the names replaced are added to `names`.
    pub fn redact_text(&self, _principal: &str, text: &mut String, names: &mut BTreeSet<String>) {
        let known = self.every();
        if !known.is_empty() {
            redact_with(&known, text, names);
        }
    }

    /// The same in every string (and key) of a JSON value.
    pub fn redact_value(&self, _principal: &str, value: &mut Value, names: &mut BTreeSet<String>) {
        let known = self.every();
        if !known.is_empty() {
            redact_json(&known, value, names);
        }
    }
}

/// Replaces each of `known`'s values in `text` by `[redacted: NAME]`, adding the names replaced.
pub fn redact_with(known: &[(String, Secret)], text: &mut String, names: &mut BTreeSet<String>) {
    for (name, value) in known {
        if !value.0.is_empty() && text.contains(value.0.as_str()) {
            *text = text.replace(value.0.as_str(), &format!("[redacted: {name}]"));
            names.insert(name.clone());
        }
    }
}

fn redact_json(known: &[(String, Secret)], value: &mut Value, names: &mut BTreeSet<String>) {
    match value {
        Value::String(s) => redact_with(known, s, names),
        Value::Array(a) => a.iter_mut().for_each(|v| redact_json(known, v, names)),
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            for k in keys {
                let mut shown = k.clone();
                redact_with(known, &mut shown, names);
                if shown != k
                    && let Some(v) = o.remove(&k)
                {
                    o.insert(shown, v);
                }
            }
            o.values_mut().for_each(|v| redact_json(known, v, names));
        }
        _ => {}
    }
}

/// Where the folder store is unless the config says: `<config folder>/secrets`.
pub fn default_dir(base: &Path) -> PathBuf {
    base.join("secrets")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn folder_store_reads_0600_and_refuses_looser_modes_and_links() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = FolderStore::new(dir.path().join("s"));
        store.set("alice", "tok", b"abc123\n").expect("set");
        assert_eq!(store.read("alice", "tok").expect("read").expose(), "abc123");
        assert_eq!(store.list("alice").expect("list"), ["tok"]);
        let file = dir.path().join("s/alice/tok");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = store.read("alice", "tok").expect_err("0644").to_string();
        assert!(
            e.contains("0644") && e.contains(&file.display().to_string()),
            "{e}"
        );
        assert!(!e.contains("abc123"), "{e}");
        std::fs::remove_file(&file).expect("rm");
        std::os::unix::fs::symlink("/etc/hostname", &file).expect("link");
        let e = store.read("alice", "tok").expect_err("link").to_string();
        assert!(
            e.contains("link") && e.contains(&file.display().to_string()),
            "{e}"
        );
        assert!(matches!(
            store.read("bob", "tok"),
            Err(SecretError::Missing { .. })
        ));
        assert!(store.read("../x", "tok").is_err());
        assert!(store.delete("alice", "tok").expect("delete"));
    }

    #[test]
    fn redaction_replaces_the_longest_value_first_and_names_it() {
        let k = Known::default();
        k.add("alice", "short", &Secret::new("abc".into()));
        k.add("alice", "long", &Secret::new("xxabcxx".into()));
        k.add(SHARED, "shared", &Secret::new("SHAREDVAL".into()));
        let mut v = serde_json::json!({"a": ["xxabcxx and abc", {"SHAREDVAL": 1}]});
        let mut names = BTreeSet::new();
        k.redact_value("alice", &mut v, &mut names);
        assert_eq!(
            v,
            serde_json::json!({"a": ["[redacted: long] and [redacted: short]", {"[redacted: shared]": 1}]})
        );
        assert_eq!(names.len(), 3);
        // Another principal's values are redacted from bob's answers too.
        let mut names = BTreeSet::new();
        let mut t = "xxabcxx and plain".to_owned();
        k.redact_text("bob", &mut t, &mut names);
        assert_eq!(t, "[redacted: long] and plain");
        assert_eq!(names.len(), 1);
        assert_eq!(
            format!("{:?}", Secret::new("abc".into())),
            "Secret(3 bytes)"
        );
    }
}
