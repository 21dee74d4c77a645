//! A folder held open by descriptor, and paths resolved beneath it with no check-then-use gap.
//!
//! Owns: turning a path below a root into a descriptor of the file it names *now*, and the
//! virtual path that descriptor names, so the policy decides on the very object that execution
//! then works through. Nothing here re-resolves a path after it was decided on: every later use
//! goes through the descriptor (`openat` relative to it, or a reopen of it through
//! `/proc/self/fd`).
//!
//! Resolution is the kernel's first: `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`,
//! which follows links only while they stay below the root. Where that refuses (an absolute link,
//! a missing component, a kernel or sandbox without `openat2`), a component-by-component walk
//! takes over: each component opened relative to its parent's descriptor with `O_NOFOLLOW`, each
//! link read from the descriptor of the link itself and resolved here (an absolute target counts
//! when it names a place below the root's own path), `..` taken physically, never above the root.
//!
//! Why not cap-std: it resolves the same way, but it does not say which path a descriptor names,
//! and the policy must decide on exactly that. The system calls come from rustix (no `unsafe`).
//!
//! Hard links are outside what a path can tell: a hard link to a private file placed in a public
//! folder (which Linux's `protected_hardlinks` refuses unless the linker owns or may write the
//! file) names the file by its public path. Writes refuse files with more than one link.

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;

use crate::resource::Object;

/// Most symbolic links one resolution follows (the kernel's own limit is 40).
pub const MAX_LINKS: usize = 40;
/// Deepest folder nesting one resolution walks (each level holds a descriptor while it is walked).
pub const MAX_DEPTH: usize = 255;

/// How [`Root`] resolves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// `openat2(RESOLVE_BENEATH)` first, the walk where it refuses.
    Kernel,
    /// The component-by-component walk only (kernels without `openat2`; tests of the walk).
    Walk,
}

impl Strategy {
    /// From `SHAREDOS_RESOLVE` (`walk` forces the walk; anything else, or unset, is `Kernel`).
    pub fn from_env() -> Self {
        match std::env::var("SHAREDOS_RESOLVE").as_deref() {
            Ok("walk") => Strategy::Walk,
            _ => Strategy::Kernel,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("it leads outside the root")]
    Outside,
    #[error("it goes through a symbolic link that points nowhere")]
    Dangling,
    #[error("it goes through more than {MAX_LINKS} symbolic links")]
    TooManyLinks,
    #[error("it is more than {MAX_DEPTH} folders deep")]
    TooDeep,
    #[error("a component of it is not a folder")]
    NotDir,
    #[error("it names a file whose name is not UTF-8")]
    NotUtf8,
    #[error("it cannot be resolved: {0}")]
    Io(#[source] std::io::Error),
}

impl From<Errno> for ResolveError {
    fn from(e: Errno) -> Self {
        ResolveError::Io(e.into())
    }
}

/// A file reached by resolution: its descriptor (`O_PATH`), what it is, and where it is.
#[derive(Debug)]
pub struct Found {
    pub fd: OwnedFd,
    pub stat: Stat,
    /// The path below the root that the descriptor names, `/`-rooted (`/` is the root itself).
    pub virtual_path: String,
    /// The host path the descriptor names.
    pub host_path: PathBuf,
}

impl Found {
    pub fn file_type(&self) -> FileType {
        FileType::from_raw_mode(self.stat.st_mode)
    }
}

/// What a path names below a root.
#[derive(Debug)]
pub enum Resolution {
    /// An existing file or folder (a final symbolic link inside the root is followed).
    Exists(Found),
    /// Nothing by that name yet. `parent` is the folder it would be created in when only the last
    /// component is missing, `None` when a folder on the way is missing too.
    Missing {
        parent: Option<(Found, String)>,
        virtual_path: String,
        host_path: PathBuf,
    },
}

impl Resolution {
    /// The object this resolution landed on (see [`Object`]).
    pub fn object(&self) -> Object {
        let of = |stat: &Stat| (stat.st_dev, stat.st_ino);
        match self {
            Resolution::Exists(f) => {
                let (dev, ino) = of(&f.stat);
                Object::Existing { dev, ino }
            }
            Resolution::Missing { parent, .. } => Object::Missing {
                parent: parent.as_ref().map(|(f, _)| of(&f.stat)),
            },
        }
    }

    pub fn virtual_path(&self) -> &str {
        match self {
            Resolution::Exists(f) => &f.virtual_path,
            Resolution::Missing { virtual_path, .. } => virtual_path,
        }
    }

    pub fn host_path(&self) -> &Path {
        match self {
            Resolution::Exists(f) => &f.host_path,
            Resolution::Missing { host_path, .. } => host_path,
        }
    }
}

/// A folder held open: every resolution starts from this descriptor, so a root replaced by a
/// link after start is never followed, and a root renamed is still the root it was.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    /// The canonical host path of the root when it was opened.
    path: PathBuf,
    strategy: Strategy,
}

/// One pending component of a walk, and whether it came from a link's target.
struct Pending<'a> {
    name: std::borrow::Cow<'a, [u8]>,
    from_link: bool,
}

impl Root {
    /// Opens `path` (links in it are followed once, here) as a root.
    pub fn open(path: &Path, strategy: Strategy) -> std::io::Result<Self> {
        let canonical = std::fs::canonicalize(path)?;
        let fd = rustix::fs::open(
            &canonical,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self {
            fd,
            path: canonical,
            strategy,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Resolves `components` (relative to the root; `.` and `..` are taken physically, empty ones
    /// skipped) to what they name now.
    pub fn resolve<'a>(
        &self,
        components: impl IntoIterator<Item = &'a str>,
    ) -> Result<Resolution, ResolveError> {
        let components: Vec<&str> = components
            .into_iter()
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        if components.len() > MAX_DEPTH {
            return Err(ResolveError::TooDeep);
        }
        if self.strategy == Strategy::Kernel {
            let rel = if components.is_empty() {
                ".".to_owned()
            } else {
                components.join("/")
            };
            // The common case first: no link and no `..` on the way, so the descriptor names
            // exactly the path as written (a rename of a folder on the way while the kernel walks
            // it can only move what was reachable, never put another folder's entry there). One
            // system call, no `/proc` read.
            if !components.contains(&"..")
                && let Some(fd) = self.open_beneath(&rel, ResolveFlags::NO_SYMLINKS)?
            {
                let stat = rustix::fs::fstat(&fd)?;
                let mut host_path = self.path.clone();
                host_path.extend(&components);
                return Ok(Resolution::Exists(Found {
                    fd,
                    stat,
                    virtual_path: if components.is_empty() {
                        "/".to_owned()
                    } else {
                        format!("/{rel}")
                    },
                    host_path,
                }));
            }
            // Links on the way: the kernel follows those that stay beneath the root, and the
            // path is read back from the descriptor.
            if let Some(fd) = self.open_beneath(&rel, ResolveFlags::empty())? {
                return self.found(fd).map(Resolution::Exists);
            }
        }
        self.walk(&components)
    }

    /// `openat2(O_PATH)` of `rel` beneath the root, with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`
    /// and `extra`. `None` leaves it to the next way of resolving: ELOOP (a link where
    /// `RESOLVE_NO_SYMLINKS` forbids one), EXDEV (an absolute link, or one leading out: the walk
    /// tells which), ENOENT (the walk tells a missing last component from a missing folder),
    /// EAGAIN, ENOSYS, EPERM (seccomp), E2BIG. A folder that may not be searched, or a file used
    /// as a folder, is final.
    fn open_beneath(
        &self,
        rel: &str,
        extra: ResolveFlags,
    ) -> Result<Option<OwnedFd>, ResolveError> {
        match rustix::fs::openat2(
            &self.fd,
            rel,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS | extra,
        ) {
            Ok(fd) => Ok(Some(fd)),
            Err(Errno::ACCESS) => Err(Errno::ACCESS.into()),
            Err(Errno::NOTDIR) => Err(ResolveError::NotDir),
            Err(_) => Ok(None),
        }
    }

    /// A resolution result for `fd`: what it is, and the path it names (which must be below the
    /// root's path).
    fn found(&self, fd: OwnedFd) -> Result<Found, ResolveError> {
        let stat = rustix::fs::fstat(&fd)?;
        let host_path = fd_path(fd.as_fd()).map_err(ResolveError::Io)?;
        let virtual_path = self.virtual_of(&host_path, &self.current_path()?)?;
        Ok(Found {
            fd,
            stat,
            virtual_path,
            host_path,
        })
    }

    /// Where the root is now (it is held by descriptor: renamed, it is still the root).
    pub fn current_path(&self) -> Result<PathBuf, ResolveError> {
        fd_path(self.fd.as_fd()).map_err(ResolveError::Io)
    }

    /// The virtual path of a host path below the root, which is now at `root` (see
    /// [`Root::current_path`]).
    pub fn virtual_of(&self, host: &Path, root: &Path) -> Result<String, ResolveError> {
        let rel = host.strip_prefix(root).map_err(|_| ResolveError::Outside)?;
        let mut v = String::with_capacity(host.as_os_str().len());
        for c in rel.components() {
            let Component::Normal(name) = c else {
                return Err(ResolveError::Outside);
            };
            v.push('/');
            v.push_str(name.to_str().ok_or(ResolveError::NotUtf8)?);
        }
        if v.is_empty() {
            v.push('/');
        }
        Ok(v)
    }

    /// The component-by-component walk (module docs).
    fn walk(&self, components: &[&str]) -> Result<Resolution, ResolveError> {
        // The folders from the root down to where the walk is (empty: at the root itself).
        let mut stack: Vec<OwnedFd> = Vec::new();
        let mut pending: std::collections::VecDeque<Pending<'_>> = components
            .iter()
            .map(|c| Pending {
                name: std::borrow::Cow::Borrowed(c.as_bytes()),
                from_link: false,
            })
            .collect();
        let mut links = 0usize;
        while let Some(next) = pending.pop_front() {
            let name = next.name;
            if name.as_ref() == b".." {
                if stack.pop().is_none() {
                    return Err(ResolveError::Outside);
                }
                continue;
            }
            if name.is_empty() || name.as_ref() == b"." {
                continue;
            }
            let dir = stack.last().map_or(self.fd.as_fd(), AsFd::as_fd);
            let name_os = OsStr::from_bytes(&name);
            let fd = match rustix::fs::openat(
                dir,
                name_os,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    if next.from_link {
                        return Err(ResolveError::Dangling);
                    }
                    return self.missing(dir, name_os, &pending);
                }
                Err(Errno::NOTDIR) => return Err(ResolveError::NotDir),
                Err(e) => return Err(e.into()),
            };
            let stat = rustix::fs::fstat(&fd)?;
            match FileType::from_raw_mode(stat.st_mode) {
                FileType::Symlink => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(ResolveError::TooManyLinks);
                    }
                    // Read from the link's own descriptor: the link that was opened, not
                    // whatever has that name now.
                    let target = rustix::fs::readlinkat(&fd, "", Vec::new())?;
                    let target = target.as_bytes();
                    let rest: &[u8] = if target.first() == Some(&b'/') {
                        // Absolute: it counts only when it names a place below the root's path.
                        let root = self.path.as_os_str().as_bytes();
                        let rest = target.strip_prefix(root).ok_or(ResolveError::Outside)?;
                        if !(rest.is_empty() || rest.first() == Some(&b'/')) {
                            return Err(ResolveError::Outside);
                        }
                        stack.clear();
                        rest
                    } else {
                        target
                    };
                    for part in rest.rsplit(|b| *b == b'/') {
                        pending.push_front(Pending {
                            name: std::borrow::Cow::Owned(part.to_vec()),
                            from_link: true,
                        });
                    }
                }
                FileType::Directory => {
                    if stack.len() >= MAX_DEPTH {
                        return Err(ResolveError::TooDeep);
                    }
                    stack.push(fd);
                }
                _ => {
                    if pending
                        .iter()
                        .any(|p| !(p.name.is_empty() || p.name.as_ref() == b"."))
                    {
                        return Err(ResolveError::NotDir);
                    }
                    return self.found(fd).map(Resolution::Exists);
                }
            }
        }
        match stack.pop() {
            Some(fd) => self.found(fd).map(Resolution::Exists),
            None => {
                let fd = rustix::fs::openat(
                    &self.fd,
                    ".",
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                self.found(fd).map(Resolution::Exists)
            }
        }
    }

    /// `name` does not exist in `dir`: where it would be, and the folder it would be created in
    /// when it is the last component.
    fn missing(
        &self,
        dir: BorrowedFd<'_>,
        name: &OsStr,
        rest: &std::collections::VecDeque<Pending<'_>>,
    ) -> Result<Resolution, ResolveError> {
        let parent_fd = rustix::fs::openat(
            dir,
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let parent = self.found(parent_fd)?;
        let name = name.to_str().ok_or(ResolveError::NotUtf8)?.to_owned();
        let mut virtual_path = parent.virtual_path.trim_end_matches('/').to_owned();
        let mut host_path = parent.host_path.clone();
        virtual_path.push('/');
        virtual_path.push_str(&name);
        host_path.push(&name);
        let rest: Vec<&[u8]> = rest
            .iter()
            .map(|p| p.name.as_ref())
            .filter(|n| !(n.is_empty() || *n == b"."))
            .collect();
        if rest.is_empty() {
            return Ok(Resolution::Missing {
                parent: Some((parent, name)),
                virtual_path,
                host_path,
            });
        }
        // A folder on the way is missing: nothing below it exists, and the rest is named as
        // written. A `..` after a missing folder could only be taken lexically, which would name
        // a place the walk never reached: refused.
        for part in rest {
            let part = std::str::from_utf8(part).map_err(|_| ResolveError::NotUtf8)?;
            if part == ".." {
                return Err(ResolveError::Io(std::io::ErrorKind::NotFound.into()));
            }
            virtual_path.push('/');
            virtual_path.push_str(part);
            host_path.push(part);
        }
        Ok(Resolution::Missing {
            parent: None,
            virtual_path,
            host_path,
        })
    }
}

/// The host path a descriptor names (`/proc/self/fd/N`).
pub fn fd_path(fd: BorrowedFd<'_>) -> std::io::Result<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Reopens the file behind `fd` (an `O_PATH` descriptor of a regular file) for IO with `flags`:
/// the same inode, whatever its name is now.
pub fn reopen(fd: BorrowedFd<'_>, flags: OFlags) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        flags | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens the folder behind `fd` (an `O_PATH` descriptor of a folder) for reading its entries.
pub fn open_dir(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        fd,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// root/{public/{a.txt, sub/, in -> ../private/s.txt, abs -> <root>/public/a.txt,
    /// out -> ../../outside.txt, absout -> <dir>/outside.txt, dangling -> ../private/nope,
    /// dl -> ../private/inner, loop -> loop}, private/{s.txt, inner/}}, outside.txt.
    fn tree() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().expect("tmp");
        let root = d.path().join("root");
        for p in ["public/sub", "private/inner"] {
            std::fs::create_dir_all(root.join(p)).expect("mkdir");
        }
        std::fs::write(root.join("public/a.txt"), "public").expect("w");
        std::fs::write(root.join("private/s.txt"), "private").expect("w");
        std::fs::write(d.path().join("outside.txt"), "outside").expect("w");
        let root = std::fs::canonicalize(&root).expect("canon");
        let p = root.join("public");
        symlink("../private/s.txt", p.join("in")).expect("ln");
        symlink(root.join("public/a.txt"), p.join("abs")).expect("ln");
        symlink("../../outside.txt", p.join("out")).expect("ln");
        symlink(d.path().join("outside.txt"), p.join("absout")).expect("ln");
        symlink("../private/nope", p.join("dangling")).expect("ln");
        symlink("../private/inner", p.join("dl")).expect("ln");
        symlink("loop", p.join("loop")).expect("ln");
        (d, root)
    }

    fn split(p: &str) -> Vec<&str> {
        p.split('/').collect()
    }

    fn virt(r: &Root, p: &str) -> Result<String, String> {
        r.resolve(split(p))
            .map(|x| match x {
                Resolution::Exists(f) => f.virtual_path,
                Resolution::Missing {
                    parent,
                    virtual_path,
                    ..
                } => format!("missing:{}:{virtual_path}", parent.is_some()),
            })
            .map_err(|e| e.to_string())
    }

    #[test]
    fn both_strategies_name_what_the_path_reaches() {
        let (_d, root) = tree();
        for strategy in [Strategy::Kernel, Strategy::Walk] {
            let r = Root::open(&root, strategy).expect("root");
            let ok = |p: &str| virt(&r, p).unwrap_or_else(|e| panic!("{strategy:?} {p}: {e}"));
            let err = |p: &str| virt(&r, p).expect_err(p);
            assert_eq!(ok(""), "/");
            assert_eq!(ok("public/a.txt"), "/public/a.txt");
            assert_eq!(ok("public/in"), "/private/s.txt");
            assert_eq!(ok("public/abs"), "/public/a.txt");
            assert_eq!(ok("public/sub"), "/public/sub");
            // `..` is physical: after the link it climbs from /private/inner.
            assert_eq!(ok("public/dl/../s.txt"), "/private/s.txt");
            assert_eq!(ok("public/./sub/.."), "/public");
            assert_eq!(ok("public/new.txt"), "missing:true:/public/new.txt");
            assert_eq!(
                ok("public/dl/new.txt"),
                "missing:true:/private/inner/new.txt"
            );
            assert_eq!(ok("public/nodir/x/y"), "missing:false:/public/nodir/x/y");
            assert!(err("public/out").contains("outside"), "{strategy:?}");
            assert!(err("public/absout").contains("outside"), "{strategy:?}");
            assert!(err("..").contains("outside"), "{strategy:?}");
            assert!(err("public/../../x").contains("outside"), "{strategy:?}");
            assert!(
                err("public/dangling").contains("points nowhere"),
                "{strategy:?}"
            );
            assert!(
                err("public/loop").contains("symbolic links"),
                "{strategy:?}"
            );
            assert!(
                err("public/a.txt/x").contains("not a folder"),
                "{strategy:?}"
            );
            assert!(
                err("public/nodir/../a.txt").contains("resolved"),
                "{strategy:?}"
            );
        }
    }

    #[test]
    fn a_root_renamed_after_it_was_opened_is_still_the_root() {
        let (d, root) = tree();
        for strategy in [Strategy::Kernel, Strategy::Walk] {
            let r = Root::open(&root, strategy).expect("root");
            std::fs::rename(&root, d.path().join("moved")).expect("mv");
            // Something else put where the root was is never reached.
            std::fs::create_dir_all(root.join("public")).expect("mkdir");
            std::fs::write(root.join("public/a.txt"), "impostor").expect("w");
            assert_eq!(virt(&r, "public/a.txt").as_deref(), Ok("/public/a.txt"));
            assert_eq!(virt(&r, "public/in").as_deref(), Ok("/private/s.txt"));
            let Ok(Resolution::Exists(f)) = r.resolve(["public", "a.txt"]) else {
                panic!("resolves");
            };
            let mut text = String::new();
            std::fs::File::from(reopen(f.fd.as_fd(), OFlags::RDONLY).expect("reopen"))
                .read_to_string(&mut text)
                .expect("read");
            assert_eq!(text, "public", "{strategy:?}");
            std::fs::remove_dir_all(&root).expect("rm");
            std::fs::rename(d.path().join("moved"), &root).expect("mv back");
        }
    }

    /// A thread exchanges `public/flip` with links to a private file and to a file outside the
    /// root while resolutions run: whatever a resolution names, the file behind its descriptor
    /// is that file.
    #[test]
    fn resolution_under_a_racing_exchange_names_the_file_it_holds() {
        let (d, root) = tree();
        std::fs::write(root.join("public/flip"), "public").expect("w");
        let public = std::fs::File::open(root.join("public")).expect("dir");
        let stop = Arc::new(AtomicBool::new(false));
        let flipper = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for other in ["in", "out", "absout"] {
                        let _ = rustix::fs::renameat_with(
                            &public,
                            "flip",
                            &public,
                            other,
                            rustix::fs::RenameFlags::EXCHANGE,
                        );
                        n += 1;
                    }
                }
                n
            })
        };
        let mut seen = std::collections::BTreeMap::<String, u64>::new();
        for strategy in [Strategy::Kernel, Strategy::Walk] {
            let r = Root::open(&root, strategy).expect("root");
            let until = std::time::Instant::now() + std::time::Duration::from_millis(700);
            while std::time::Instant::now() < until {
                match r.resolve(["public", "flip"]) {
                    Ok(Resolution::Exists(f)) => {
                        let mut text = String::new();
                        std::fs::File::from(reopen(f.fd.as_fd(), OFlags::RDONLY).expect("reopen"))
                            .read_to_string(&mut text)
                            .expect("read");
                        let expected = if f.virtual_path.starts_with("/public/") {
                            "public"
                        } else {
                            "private"
                        };
                        assert_eq!(
                            text, expected,
                            "{strategy:?}: {} held {text}",
                            f.virtual_path
                        );
                        *seen.entry(f.virtual_path).or_default() += 1;
                    }
                    Ok(other) => panic!("{other:?}"),
                    Err(e) => *seen.entry(e.to_string()).or_default() += 1,
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let flips = flipper.join().expect("flipper");
        assert!(flips > 100, "{flips} flips");
        // Every state of the race was met: the private file, a refusal, the public file.
        assert!(seen.contains_key("/private/s.txt"), "{seen:?}");
        assert!(seen.contains_key("it leads outside the root"), "{seen:?}");
        assert!(seen.keys().any(|k| k.starts_with("/public/")), "{seen:?}");
        drop(d);
    }
}
