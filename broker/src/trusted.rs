//! Folders and files the broker writes, held so that no other uid can redirect a write.
//!
//! A folder the broker writes in is opened once (its last component never through a link) and
//! checked on the descriptor before anything in it is created, read or written: it belongs to the
//! broker's uid or root, and no other uid can write in it (a world-writable folder with the
//! sticky bit, as `/tmp`, is accepted: others cannot rename or remove what is in it). The
//! folders above it are checked the same way, through `..` of the descriptor held, up to the
//! first one the broker or root owns and nobody else can write; a link on the way to it must
//! sit in such a folder too. Missing folders are made (0700) relative to the checked one above.
//!
//! A file in a checked folder is looked at without following links: a link, something not a
//! plain file, or a file of another uid is refused by name. Files are created with
//! `O_CREAT | O_EXCL | O_NOFOLLOW` relative to the folder's descriptor, and opened with
//! `O_NOFOLLOW`; a replaced file is written under a new name and renamed into place.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};

/// Why a folder or file the broker writes was refused or could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("refused `{path}`: {detail}")]
    Refused { path: String, detail: String },
    #[error("cannot use `{path}`: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl TrustError {
    fn refused(path: &Path, detail: impl Into<String>) -> Self {
        Self::Refused {
            path: path.display().to_string(),
            detail: detail.into(),
        }
    }

    fn io(path: &Path) -> impl FnOnce(rustix::io::Errno) -> Self + '_ {
        move |e| Self::Io {
            path: path.display().to_string(),
            source: e.into(),
        }
    }
}

/// The broker's uid (effective).
pub fn broker_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The absolute form of `path` (relative to the working directory), `.` and `..` left as they are.
fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(path)
    }
}

/// Whether a folder with this owner and mode keeps other uids from changing what is in it:
/// `Ok(true)` when nobody else can write it at all, `Ok(false)` when others can but the sticky bit
/// keeps them to their own names; refused otherwise.
/// `group`: (the folder's group, a group whose members may write it: the operator's
/// `admin_group`, for the folders of the broker's settings).
fn folder_rule_for(
    path: &Path,
    owner: u32,
    mode: u32,
    group: Option<(u32, u32)>,
    uid: u32,
) -> Result<bool, TrustError> {
    let mode = match group {
        Some((gid, allowed)) if gid == allowed => mode & !0o020,
        _ => mode,
    };
    if owner != uid && owner != 0 {
        return Err(TrustError::refused(
            path,
            format!(
                "the folder belongs to uid {owner}, not to this broker's uid {uid} or root: another uid could put links or files of its own where the broker writes"
            ),
        ));
    }
    let writable_by_others = mode & 0o022 != 0;
    if writable_by_others && mode & 0o1000 == 0 {
        return Err(TrustError::refused(
            path,
            format!(
                "the folder (mode {:04o}) can be written by other uids and has no sticky bit: another uid could put links or files of its own where the broker writes",
                mode & 0o7777
            ),
        ));
    }
    Ok(!writable_by_others)
}

/// A folder the broker writes in, open and checked (see the module docs).
#[derive(Debug)]
pub struct TrustedDir {
    path: PathBuf,
    fd: OwnedFd,
    uid: u32,
    /// A group whose members may write the folder (the broker's settings' `admin_group`).
    group: Option<u32>,
}

impl TrustedDir {
    /// Opens and checks the folder `path` for the broker's uid, making it (and the folders
    /// missing above it, 0700) when `create`.
    pub fn open(path: &Path, create: bool) -> Result<Self, TrustError> {
        Self::open_for(path, broker_uid(), create)
    }

    /// [`TrustedDir::open`] for `uid`.
    pub fn open_for(path: &Path, uid: u32, create: bool) -> Result<Self, TrustError> {
        Self::open_with(path, uid, None, create)
    }

    /// [`TrustedDir::open_for`], members of `group` being allowed to write the folders.
    fn open_with(
        path: &Path,
        uid: u32,
        group: Option<u32>,
        create: bool,
    ) -> Result<Self, TrustError> {
        let path = absolute(path);
        check_links_on_the_way(&path, uid, group)?;
        let dir = Self::open_checked(&path, uid, group, create, true)?;
        dir.check_above()?;
        Ok(dir)
    }

    /// Opens `path` (made when missing and `create`, relative to its checked parent) and checks
    /// the folder itself. `follow`: `path` itself may be a link (one [`check_links_on_the_way`]
    /// let through).
    fn open_checked(
        path: &Path,
        uid: u32,
        group: Option<u32>,
        create: bool,
        follow: bool,
    ) -> Result<Self, TrustError> {
        let mut flags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
        if !follow {
            flags |= OFlags::NOFOLLOW;
        }
        match rustix::fs::open(path, flags, Mode::empty()) {
            Ok(fd) => {
                let dir = Self {
                    path: path.to_path_buf(),
                    fd,
                    uid,
                    group,
                };
                dir.check_self()?;
                Ok(dir)
            }
            Err(rustix::io::Errno::NOENT) if create => {
                let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                    return Err(TrustError::refused(path, "no such folder"));
                };
                let parent = Self::open_checked(parent, uid, group, true, true)?;
                parent.subdir(name, true)
            }
            Err(e) => Err(not_a_folder(path, e)),
        }
    }

    /// The folder `name` in this one, made (0700) when missing and `create`, opened without
    /// following a link and checked.
    pub fn subdir(&self, name: impl AsRef<Path>, create: bool) -> Result<Self, TrustError> {
        let name = name.as_ref();
        let path = self.path.join(name);
        if create {
            match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(TrustError::io(&path)(e)),
            }
        }
        let flags = OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::empty())
            .map_err(|e| not_a_folder(&path, e))?;
        let dir = Self {
            path,
            fd,
            uid: self.uid,
            group: self.group,
        };
        dir.check_self()?;
        Ok(dir)
    }

    fn check_self(&self) -> Result<(), TrustError> {
        let st = rustix::fs::fstat(&self.fd).map_err(TrustError::io(&self.path))?;
        self.rule(&self.path, &st).map(|_| ())
    }

    /// [`folder_rule_for`] with this folder's uid and group.
    fn rule(&self, path: &Path, st: &rustix::fs::Stat) -> Result<bool, TrustError> {
        let group = self.group.map(|g| (st.st_gid, g));
        folder_rule_for(path, st.st_uid, st.st_mode, group, self.uid)
    }

    /// Checks the folders above the one held, through `..` of its descriptor, up to the first one
    /// nobody but its owner (the broker or root) can write.
    fn check_above(&self) -> Result<(), TrustError> {
        let flags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
        let st = rustix::fs::fstat(&self.fd).map_err(TrustError::io(&self.path))?;
        if self.rule(&self.path, &st)? {
            return Ok(());
        }
        let mut shown = self.path.clone();
        let mut here = rustix::fs::openat(&self.fd, "..", flags, Mode::empty())
            .map_err(TrustError::io(&self.path))?;
        let mut below = (st.st_dev, st.st_ino);
        loop {
            shown = shown
                .parent()
                .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
            let st = rustix::fs::fstat(&here).map_err(TrustError::io(&shown))?;
            // `..` of `/` is `/`: the top.
            if self.rule(&shown, &st)? || (st.st_dev, st.st_ino) == below {
                return Ok(());
            }
            below = (st.st_dev, st.st_ino);
            here = rustix::fs::openat(&here, "..", flags, Mode::empty())
                .map_err(TrustError::io(&shown))?;
        }
    }

    /// The folder's path, as given (absolute).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in this folder, for messages.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }

    /// What is at `name`, looked at without following a link: `None` when nothing is; a link,
    /// anything but a plain file, or a file another uid owns is refused by name.
    pub fn check_file(
        &self,
        name: impl AsRef<Path>,
    ) -> Result<Option<rustix::fs::Stat>, TrustError> {
        let name = name.as_ref();
        let path = self.join(name);
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                self.file_rule(&path, &st)?;
                Ok(Some(st))
            }
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(TrustError::io(&path)(e)),
        }
    }

    fn file_rule(&self, path: &Path, st: &rustix::fs::Stat) -> Result<(), TrustError> {
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Symlink => {
                return Err(TrustError::refused(
                    path,
                    "it is a link: the broker never reads or writes its files through a link",
                ));
            }
            FileType::RegularFile => {}
            other => {
                return Err(TrustError::refused(
                    path,
                    format!("it is not a plain file ({other:?})"),
                ));
            }
        }
        if st.st_uid != self.uid {
            return Err(TrustError::refused(
                path,
                format!(
                    "the file belongs to uid {}, not to this broker's uid {}",
                    st.st_uid, self.uid
                ),
            ));
        }
        Ok(())
    }

    /// Opens the file `name` with `flags` (plus `O_NOFOLLOW`), creating it with `mode` when
    /// `flags` say so, and checks what was opened: a plain file of the broker's uid.
    pub fn open_file(
        &self,
        name: impl AsRef<Path>,
        flags: OFlags,
        mode: u32,
    ) -> Result<std::fs::File, TrustError> {
        let name = name.as_ref();
        let path = self.join(name);
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| match e {
            rustix::io::Errno::LOOP => TrustError::refused(
                &path,
                "it is a link: the broker never reads or writes its files through a link",
            ),
            e => TrustError::io(&path)(e),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(TrustError::io(&path))?;
        self.file_rule(&path, &st)?;
        Ok(std::fs::File::from(fd))
    }

    /// Creates `name` with `text` (mode `mode`), whole or not at all: under a new name first, then
    /// linked into place (never over something already there: `Ok(false)` then, and the new
    /// text is dropped).
    pub fn create_whole(&self, name: &str, text: &[u8], mode: u32) -> Result<bool, TrustError> {
        let tmp = self.write_temporary(name, text, mode)?;
        let path = self.join(name);
        let linked = rustix::fs::linkat(&self.fd, tmp.as_str(), &self.fd, name, AtFlags::empty());
        let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
        match linked {
            Ok(()) => {
                self.sync();
                Ok(true)
            }
            Err(rustix::io::Errno::EXIST) => Ok(false),
            Err(e) => Err(TrustError::io(&path)(e)),
        }
    }

    /// Writes `name` with `text` (mode `mode`), replacing what is there by a rename (never
    /// written through).
    pub fn replace(&self, name: &str, text: &[u8], mode: u32) -> Result<(), TrustError> {
        let tmp = self.write_temporary(name, text, mode)?;
        let path = self.join(name);
        if let Err(e) = rustix::fs::renameat(&self.fd, tmp.as_str(), &self.fd, name) {
            let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
            return Err(TrustError::io(&path)(e));
        }
        self.sync();
        Ok(())
    }

    /// `text` in a new file `<name>.<pid>.new` of this folder (created exclusively), synced.
    fn write_temporary(&self, name: &str, text: &[u8], mode: u32) -> Result<String, TrustError> {
        let tmp = format!("{name}.{}.new", std::process::id());
        let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
        let flags = OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY;
        let written = self.open_file(tmp.as_str(), flags, mode).and_then(|mut f| {
            let path = self.join(&tmp);
            rustix::fs::fchmod(&f, Mode::from_raw_mode(mode)).map_err(TrustError::io(&path))?;
            f.write_all(text)
                .and_then(|()| f.sync_all())
                .map_err(|source| TrustError::Io {
                    path: path.display().to_string(),
                    source,
                })
        });
        if let Err(e) = written {
            let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
            return Err(e);
        }
        Ok(tmp)
    }

    /// Syncs the folder, so that a name made in it is on disk (best effort).
    pub fn sync(&self) {
        let _ = rustix::fs::fsync(&self.fd);
    }
}

impl AsFd for TrustedDir {
    fn as_fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The error for a folder that could not be opened as one: a link, a file, or an IO error.
fn not_a_folder(path: &Path, e: rustix::io::Errno) -> TrustError {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => TrustError::refused(
            path,
            "it is a link, not a folder: the broker never writes through a link",
        ),
        Ok(m) if !m.is_dir() => TrustError::refused(path, "it is not a folder"),
        _ => TrustError::io(path)(e),
    }
}

/// A link on the way to `path` (or `path` itself) is followed only when no other uid can replace
/// it: the folder holding it passes [`folder_rule_for`], and in a folder others may write (sticky,
/// as `/tmp`) the link is the broker's or root's own. Otherwise another uid could send the
/// broker's writes, now or later by path, to a folder of its choosing.
fn check_links_on_the_way(path: &Path, uid: u32, group: Option<u32>) -> Result<(), TrustError> {
    let mut at = PathBuf::new();
    for c in path.components() {
        at.push(c);
        if !matches!(c, Component::Normal(_)) {
            continue;
        }
        let Ok(m) = std::fs::symlink_metadata(&at) else {
            return Ok(()); // missing from here down: made by the broker, checked as it goes
        };
        if m.file_type().is_symlink()
            && let Some(holder) = at.parent()
        {
            let h = std::fs::metadata(holder).map_err(|source| TrustError::Io {
                path: holder.display().to_string(),
                source,
            })?;
            let group = group.map(|g| (h.gid(), g));
            let closed =
                folder_rule_for(holder, h.uid(), h.mode(), group, uid).map_err(|e| match e {
                    TrustError::Refused { detail, .. } => TrustError::refused(
                        &at,
                        format!(
                            "it is a link in folder `{}`, which another uid can change: {detail}",
                            holder.display()
                        ),
                    ),
                    e => e,
                })?;
            if !closed && m.uid() != uid && m.uid() != 0 {
                return Err(TrustError::refused(
                    &at,
                    format!(
                        "it is a link of uid {} (in folder `{}`, which others can write): the broker does not follow another uid's links",
                        m.uid(),
                        holder.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Reads a file the broker takes its settings from (`what`: the config, the policy, the schema,
/// the pins), checked as the broker's own files are before its text is used: links on the way
/// to it sit in folders no other uid can change; its folder, and those above it, pass the folder
/// rules of [`TrustedDir`]; the file itself is a plain file of the broker's uid or root that no
/// other uid can write. Members of `group` (the operator's `admin_group`) may write the file and
/// its folders when it is their group. `group_of` reads the group from the text itself (the
/// config names it); the text is used only once the checks pass. The error names the file and
/// the fix.
pub fn read_settings(
    path: &Path,
    what: &str,
    group_of: impl FnOnce(&str) -> Option<u32>,
) -> Result<String, TrustError> {
    use std::io::Read as _;
    let uid = broker_uid();
    let shown = absolute(path);
    let io = |source: std::io::Error| TrustError::Io {
        path: shown.display().to_string(),
        source,
    };
    let real = std::fs::canonicalize(&shown).map_err(io)?;
    let fd = rustix::fs::open(
        &real,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(e.into()))?;
    let mut file = std::fs::File::from(fd);
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io)?;
    let group = group_of(&text);
    check_links_on_the_way(&shown, uid, group)?;
    let (dir, _) = split(&real)?;
    TrustedDir::open_with(dir, uid, group, false)?;
    let st = rustix::fs::fstat(&file).map_err(|e| io(e.into()))?;
    settings_rule(&shown, what, &st, uid, group)?;
    Ok(text)
}

/// Who may own and write a settings file (see [`read_settings`]).
fn settings_rule(
    path: &Path,
    what: &str,
    st: &rustix::fs::Stat,
    uid: u32,
    group: Option<u32>,
) -> Result<(), TrustError> {
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(TrustError::refused(
            path,
            format!("the {what} is not a plain file"),
        ));
    }
    let shown = path.display();
    if st.st_uid != uid && st.st_uid != 0 {
        return Err(TrustError::refused(
            path,
            format!(
                "the {what} belongs to uid {}, not to this broker's uid {uid} or root: its owner could change what the broker does; give it to root or the broker's uid (`chown {uid} {shown}`)",
                st.st_uid
            ),
        ));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o002 != 0 {
        return Err(TrustError::refused(
            path,
            format!(
                "the {what} (mode {mode:04o}) can be written by every uid: any of them could change what the broker does; `chmod go-w {shown}`"
            ),
        ));
    }
    if mode & 0o020 != 0 && group != Some(st.st_gid) {
        return Err(TrustError::refused(
            path,
            format!(
                "the {what} (mode {mode:04o}) can be written by group {}: its members could change what the broker does; `chmod g-w {shown}`, or, if they are the broker's administrators, name the group in the config (`admin_group = {}`)",
                st.st_gid, st.st_gid
            ),
        ));
    }
    Ok(())
}

/// Splits a file's path into its folder (`.` when it has none) and its name.
pub fn split(path: &Path) -> Result<(&Path, &str), TrustError> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| TrustError::refused(path, "the path names no file (or not in UTF-8)"))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Ok((dir, name))
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn links_and_open_folders_are_refused_by_name() {
        let tmp = tempfile::tempdir().expect("tmp");
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "VICTIM").expect("w");
        let dir = TrustedDir::open(&tmp.path().join("a/b"), true).expect("made");
        assert!(tmp.path().join("a/b").is_dir());
        std::os::unix::fs::symlink(&victim, dir.join("f")).expect("ln");
        let e = dir.check_file("f").expect_err("a link").to_string();
        assert!(e.contains("/a/b/f") && e.contains("link"), "{e}");
        let e = dir
            .open_file("f", OFlags::CREATE | OFlags::WRONLY | OFlags::APPEND, 0o600)
            .expect_err("a link")
            .to_string();
        assert!(e.contains("link"), "{e}");
        dir.replace("g", b"new", 0o644).expect("replace");
        assert!(!dir.create_whole("g", b"other", 0o600).expect("kept"));
        assert_eq!(std::fs::read_to_string(dir.join("g")).expect("r"), "new");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
        // A folder others can write (no sticky bit), as the folder itself or above it.
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        std::fs::create_dir(open.join("in")).expect("mkdir");
        std::fs::set_permissions(open.join("in"), std::fs::Permissions::from_mode(0o1777))
            .expect("chmod");
        for p in [open.clone(), open.join("in")] {
            let e = TrustedDir::open(&p, false).expect_err("open").to_string();
            assert!(e.contains("`") && e.contains("0777"), "{e}");
        }
        // A link of the broker's in its own folder is followed; a folder inside a checked one
        // that is a link is refused.
        std::os::unix::fs::symlink(tmp.path().join("a"), tmp.path().join("l")).expect("ln");
        let l = TrustedDir::open(&tmp.path().join("l"), true).expect("followed");
        std::os::unix::fs::symlink(tmp.path().join("a"), l.join("sub")).expect("ln");
        let e = l.subdir("sub", true).expect_err("a link").to_string();
        assert!(e.contains("/l/sub`") && e.contains("link"), "{e}");
    }
}
