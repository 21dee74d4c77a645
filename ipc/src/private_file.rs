//! Private files written safely beside other uids: config and token files for harnesses, the
//! broker's pin file.
//!
//! A file is written under a random temporary name created with `O_CREAT | O_EXCL | O_NOFOLLOW`
//! relative to a folder opened once and checked (ours or root's, and writable by no other uid
//! unless sticky), then renamed into place relative to that same folder: a link or file planted
//! at any name cannot redirect the write, and nothing is ever written through a link.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum PrivateFileError {
    #[error("refused to write `{path}`: {detail}")]
    Refused { path: String, detail: String },
    #[error("cannot write `{path}`: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// Who a written file is given to (`turn open --file-owner`): a harness that runs under its own
/// uid must be able to read its config and token, and no other harness may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileOwner {
    pub uid: u32,
    pub gid: Option<u32>,
}

impl std::str::FromStr for FileOwner {
    type Err = String;

    /// `UID` or `UID:GID` (numbers).
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |part: &str, what: &str| {
            part.parse::<u32>()
                .map_err(|_| format!("`{s}`: {what} `{part}` is not a number (use UID or UID:GID)"))
        };
        match s.split_once(':') {
            Some((u, g)) => Ok(Self {
                uid: num(u, "uid")?,
                gid: Some(num(g, "gid")?),
            }),
            None => Ok(Self {
                uid: num(s, "uid")?,
                gid: None,
            }),
        }
    }
}

/// The folder a private file may be written in: ours or root's, and writable by nobody else
/// unless it has the sticky bit (as `/tmp`): otherwise another uid could swap what we write.
fn check_folder(dir: &Path, fd: impl rustix::fd::AsFd, uid: u32) -> Result<(), String> {
    let st = rustix::fs::fstat(fd).map_err(|e| e.to_string())?;
    let mode = st.st_mode;
    if st.st_uid != uid && st.st_uid != 0 {
        return Err(format!(
            "folder `{}` belongs to uid {}, not to this uid ({uid}) or root: another uid could replace what is written there",
            dir.display(),
            st.st_uid
        ));
    }
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !sticky {
        return Err(format!(
            "folder `{}` (mode {:04o}) can be written by other uids and has no sticky bit: another uid could replace what is written there",
            dir.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Writes `text` to `path` atomically with mode 0600, safely against other uids: the folder is
/// opened once and checked ([`check_folder`]); the text goes to a random temporary name created
/// there with `O_CREAT | O_EXCL | O_NOFOLLOW` (a name planted in advance, link or not, fails
/// the create and another one is tried), then is renamed into place relative to the same folder.
/// With `owner`, the file is given to that uid (and gid) before it is renamed into place.
pub fn write_private(
    path: &Path,
    text: &str,
    owner: Option<FileOwner>,
) -> Result<(), PrivateFileError> {
    write_private_named(path, text, owner, || {
        let mut rnd = [0u8; 12];
        getrandom::fill(&mut rnd).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(format!(
            ".sharedos-{}.tmp",
            sharedos_proto::catalog::hex(&rnd)
        ))
    })
}

/// Temporary names tried before giving up (each one already taken is skipped).
const TEMP_ATTEMPTS: usize = 8;

/// [`write_private`] with the temporary names from `next_name`.
fn write_private_named(
    path: &Path,
    text: &str,
    owner: Option<FileOwner>,
    mut next_name: impl FnMut() -> std::io::Result<String>,
) -> Result<(), PrivateFileError> {
    use rustix::fs::{Mode, OFlags};
    let shown = path.display().to_string();
    let err = |source: std::io::Error| PrivateFileError::Io {
        path: shown.clone(),
        source,
    };
    let refused = |detail: String| PrivateFileError::Refused {
        path: shown.clone(),
        detail,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| refused("the path names no file".into()))?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
    }
    let dirfd = rustix::fs::open(
        dir,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| err(e.into()))?;
    check_folder(dir, &dirfd, rustix::process::geteuid().as_raw()).map_err(refused)?;
    let mut attempts = 0;
    let (tmp, fd) = loop {
        let tmp = next_name().map_err(err)?;
        match rustix::fs::openat(
            &dirfd,
            tmp.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => break (tmp, fd),
            Err(rustix::io::Errno::EXIST) if attempts + 1 < TEMP_ATTEMPTS => attempts += 1,
            Err(e) => return Err(err(e.into())),
        }
    };
    let written = (|| -> std::io::Result<()> {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600))?;
        if let Some(o) = owner {
            rustix::fs::fchown(
                &fd,
                Some(rustix::fs::Uid::from_raw(o.uid)),
                o.gid.map(rustix::fs::Gid::from_raw),
            )?;
        }
        let mut f = std::fs::File::from(fd);
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        rustix::fs::renameat(&dirfd, tmp.as_str(), &dirfd, name)?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = rustix::fs::unlinkat(&dirfd, tmp.as_str(), rustix::fs::AtFlags::empty());
        return Err(err(e));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;

    /// Links planted at the temporary names the writer will use are skipped, never followed:
    /// the file they point at is untouched, and the write lands at the path asked for.
    #[test]
    fn planted_links_at_temporary_names_are_never_followed() {
        let dir = tempfile::tempdir().expect("tmp");
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "VICTIM").expect("w");
        let out = dir.path().join("out");
        std::fs::create_dir(&out).expect("mkdir");
        let names: Vec<String> = (0..TEMP_ATTEMPTS).map(|i| format!(".t{i}")).collect();
        // Every name but the last is taken by a link to the victim (or a FIFO, or a file).
        for (i, n) in names.iter().take(TEMP_ATTEMPTS - 1).enumerate() {
            let at = out.join(n);
            match i % 3 {
                0 => std::os::unix::fs::symlink(&victim, &at).expect("ln"),
                1 => std::os::unix::fs::symlink("../victim.txt", &at).expect("ln"),
                _ => std::fs::write(&at, "planted").expect("w"),
            }
        }
        let mut it = names.clone().into_iter();
        write_private_named(&out.join("cfg"), "SECRET", None, || {
            it.next()
                .ok_or_else(|| std::io::Error::other("no more names"))
        })
        .expect("write");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
        assert_eq!(
            std::fs::read_to_string(out.join("cfg")).expect("r"),
            "SECRET"
        );
        assert!(
            !out.join(&names[TEMP_ATTEMPTS - 1]).exists(),
            "renamed away"
        );
        // Every name taken: the write fails, and still touches nothing.
        std::os::unix::fs::symlink(&victim, out.join(&names[TEMP_ATTEMPTS - 1])).expect("ln");
        let mut it = names.clone().into_iter();
        let e = write_private_named(&out.join("cfg2"), "SECRET", None, || {
            it.next()
                .ok_or_else(|| std::io::Error::other("no more names"))
        })
        .expect_err("all taken");
        assert!(e.to_string().contains("cfg2"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
        assert!(!out.join("cfg2").exists());
        // A target that is itself a link is replaced, not written through.
        std::os::unix::fs::symlink(&victim, out.join("linked.json")).expect("ln");
        write_private(&out.join("linked.json"), "SECRET", None).expect("replaces the link");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
        assert!(
            !std::fs::symlink_metadata(out.join("linked.json"))
                .expect("meta")
                .file_type()
                .is_symlink()
        );
    }

    #[test]
    fn folders_other_uids_can_write_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = write_private(&open.join("t"), "x", None).expect_err("refused");
        assert!(
            e.to_string().contains("open") && e.to_string().contains("sticky"),
            "{e}"
        );
        assert!(!open.join("t").exists());
        // The same folder with the sticky bit (as /tmp) is fine.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        write_private(&open.join("t"), "x", None).expect("sticky is fine");
        let group = dir.path().join("group");
        std::fs::create_dir(&group).expect("mkdir");
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o770)).expect("chmod");
        assert!(write_private(&group.join("t"), "x", None).is_err());
    }
}
