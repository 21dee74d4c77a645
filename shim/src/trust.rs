//! Whom the shim gives its token to: only a listener that runs as the broker's uid, at a socket
//! in a folder no other uid can write.
//!
//! The default socket path (`/tmp/sharedos-$UID/bridge.sock`) sits in a folder anyone may create
//! first, and `SHAREDOS_BROKER` may name any path: a listener there is not the broker because of
//! where it listens. Before hello (the first byte the shim writes), [`check`] settles the uid the
//! broker must run as ([`expected_uid`]), checks the socket's folder ([`check_folder`]) and the
//! credentials of the process at the other end of the connected socket (`SO_PEERCRED`).

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use crate::error::ShimError;

/// Group or other write permission on a folder.
const WRITABLE_BY_OTHERS: u32 = 0o022;

/// Who may own the socket's folder: the broker's uid, or root.
fn may_own(owner: u32, broker: u32) -> bool {
    owner == broker || owner == 0
}

/// The uid the broker must run as. `explicit` (`SHAREDOS_BROKER_UID`, `--broker-uid`) when given;
/// else the owner of the socket's folder when that owner is this process's uid or root, or when
/// no other uid could have made the folder (every folder above it is root's or the owner's and
/// writable by neither group nor others; a sticky `/tmp` does not count: anyone may make a folder
/// there first).
pub fn expected_uid(explicit: Option<u32>, folder: &Path, me: u32) -> Result<u32, ShimError> {
    if let Some(uid) = explicit {
        return Ok(uid);
    }
    let owner = metadata(folder)?.uid();
    if owner == me || owner == 0 {
        return Ok(owner);
    }
    for above in folder.ancestors().skip(1) {
        let m = metadata(above)?;
        if !may_own(m.uid(), owner) || m.mode() & WRITABLE_BY_OTHERS != 0 {
            return Err(ShimError::UnknownBrokerUid {
                folder: folder.to_path_buf(),
                owner,
                me,
                above: above.to_path_buf(),
            });
        }
    }
    Ok(owner)
}

/// The socket's folder is the broker's or root's, and neither its group nor others may write it
/// (else another uid could have put its own listener there).
pub fn check_folder(folder: &Path, broker: u32) -> Result<(), ShimError> {
    let m = metadata(folder)?;
    if !may_own(m.uid(), broker) {
        return Err(ShimError::FolderOwner {
            folder: folder.to_path_buf(),
            owner: m.uid(),
            broker,
        });
    }
    if m.mode() & WRITABLE_BY_OTHERS != 0 {
        return Err(ShimError::FolderWritable {
            folder: folder.to_path_buf(),
            mode: m.mode() & 0o7777,
        });
    }
    Ok(())
}

/// The process listening at `socket` runs as `broker` (its `SO_PEERCRED` uid is `peer`).
pub fn check_peer(socket: &Path, peer: Option<u32>, broker: u32) -> Result<(), ShimError> {
    match peer {
        Some(uid) if uid == broker => Ok(()),
        peer => Err(ShimError::PeerUid {
            socket: socket.to_path_buf(),
            peer,
            broker,
        }),
    }
}

/// The folder that holds the socket, with every link resolved (the socket itself may be a link
/// to another folder's socket).
pub fn socket_folder(socket: &Path) -> Result<PathBuf, ShimError> {
    let real = std::fs::canonicalize(socket).map_err(|source| ShimError::FolderUnreadable {
        folder: socket.to_path_buf(),
        source,
    })?;
    Ok(real
        .parent()
        .map_or_else(|| PathBuf::from("/"), Path::to_path_buf))
}

/// Every check, on a connected socket whose listener runs as `peer`: `Ok` only when the token may
/// be sent to it.
pub fn check(
    socket: &Path,
    peer: Option<u32>,
    explicit: Option<u32>,
    me: u32,
) -> Result<(), ShimError> {
    let folder = socket_folder(socket)?;
    let broker = expected_uid(explicit, &folder, me)?;
    check_folder(&folder, broker)?;
    check_peer(socket, peer, broker)
}

fn metadata(folder: &Path) -> Result<std::fs::Metadata, ShimError> {
    std::fs::metadata(folder).map_err(|source| ShimError::FolderUnreadable {
        folder: folder.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn me() -> u32 {
        sharedos_ipc::runtime::current_uid()
    }

    /// A fresh folder of this uid (0700), removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let p =
                std::env::temp_dir().join(format!("sharedos-trust-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir(&p).expect("mkdir");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).expect("chmod");
            Self(p)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_folder_of_this_uid_names_this_uid() {
        let dir = Dir::new("mine");
        assert_eq!(expected_uid(None, dir.path(), me()).expect("uid"), me());
        assert_eq!(
            expected_uid(Some(4242), dir.path(), me()).expect("uid"),
            4242
        );
    }

    #[test]
    fn a_folder_others_may_write_is_refused() {
        let dir = Dir::new("others");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777))
            .expect("chmod");
        let e = check_folder(dir.path(), me()).expect_err("writable");
        assert_eq!(
            e.to_string(),
            format!(
                "refusing the broker socket's folder `{}`: mode 1777 lets other uids write it, so another uid could listen there; no token sent",
                dir.path().display()
            )
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o710))
            .expect("chmod");
        check_folder(dir.path(), me()).expect("0710 is fine");
    }

    /// A folder of a uid that is neither the broker's nor root's is refused (root's is not: as
    /// root this test's folder is root's, and passes).
    #[test]
    fn a_folder_of_another_uid_is_refused() {
        let dir = Dir::new("theirs");
        let other = me().wrapping_add(1).max(1);
        if me() == 0 {
            check_folder(dir.path(), other).expect("root's folder");
            return;
        }
        let e = check_folder(dir.path(), other).expect_err("not the broker's");
        assert!(
            e.to_string().contains(&format!(
                "belongs to uid {}, not to the broker's uid {other} or root",
                me()
            )),
            "{e}"
        );
    }

    #[test]
    fn a_listener_of_another_uid_is_refused() {
        let e = check_peer(Path::new("/run/s/bridge.sock"), Some(1001), 1000).expect_err("peer");
        assert_eq!(
            e.to_string(),
            "refusing the process listening at `/run/s/bridge.sock`: it runs as uid 1001, not as the broker's uid 1000 (set SHAREDOS_BROKER_UID if the broker runs as another uid); no token sent"
        );
        assert!(check_peer(Path::new("/s"), None, 1000).is_err());
        check_peer(Path::new("/s"), Some(1000), 1000).expect("same uid");
    }
}
