//! The broker's shared state, below every connection handler: the kernel, the turn table, the
//! config and the peer-uid rule, and what closing a turn means.
//!
//! Handlers import this, never `server` (mini-redis's `db.rs`): state stands below what uses it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sharedos_proto::ipc::TurnToken;
use sharedos_proto::record::{Event, TurnClosed};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::kernel::Kernel;
use crate::turn::Turns;

/// Everything a connection handler needs.
pub struct Broker {
    pub kernel: Arc<Kernel>,
    pub turns: Turns,
    pub config: Config,
    pub root: CancellationToken,
    pub runtime_dir: PathBuf,
    pub uid: u32,
    /// The key in `control.key`, which a control peer under the broker's own uid must present.
    pub control_key: TurnToken,
}

impl Broker {
    /// A host: a listed uid (or the broker's own), and not a brokered upstream's process or
    /// its descendant, whatever its uid ([`crate::lineage`]).
    /// A control peer's key is good: given and equal to `control.key`'s, or not needed (a peer
    /// under another uid, which `host_uids` decides on). Compared in constant time.
    pub fn control_key_ok(&self, uid: Option<u32>, key: Option<&TurnToken>) -> bool {
        if uid.is_some_and(|u| u != self.uid) {
            return true;
        }
        key.is_some_and(|k| {
            let (a, b) = (k.expose().as_bytes(), self.control_key.expose().as_bytes());
            a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
        })
    }

    pub fn host_allowed(&self, uid: Option<u32>, pid: Option<u32>) -> bool {
        peer_allowed(uid, &self.config.host_uids, self.uid) && !crate::lineage::from_upstream(pid)
    }

    /// A harness: the same rule, with `harness_uids`.
    pub fn harness_allowed(&self, uid: Option<u32>, pid: Option<u32>) -> bool {
        peer_allowed(uid, &self.config.harness_uids, self.uid)
            && !crate::lineage::from_upstream(pid)
    }

    /// Closes a turn: kills its token, cancels its tree, waits (bounded) for in-flight calls to
    /// record, records `turn_closed` and removes the turn's token file. `None` if no such open
    /// turn.
    pub async fn close_turn(&self, id: &str, reason: &str) -> Option<Arc<crate::turn::Turn>> {
        let turn = self.turns.remove(id)?;
        if let Ok(mut r) = turn.close_reason.write() {
            *r = Some(reason.to_owned());
        }
        turn.cancel.cancel();
        turn.tracker.close();
        if tokio::time::timeout(crate::turn::CLOSE_GRACE, turn.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(turn = %id, "in-flight calls did not finish within the close grace period");
        }
        let line = Event::TurnClosed(TurnClosed {
            turn: turn.id.clone(),
            reason: reason.to_owned(),
            calls: Some(turn.calls.load(std::sync::atomic::Ordering::Relaxed)),
            system_identity: turn.system_identity.clone(),
        });
        if let Err(e) = self.kernel.recorder.append(&line).await {
            tracing::error!(turn = %id, error = %e, "could not record turn_closed");
        }
        if let Some(path) = &turn.token_file {
            remove_token_file(path);
        }
        Some(turn)
    }
}

/// Removes a closed turn's token file: only a regular file or a link (never followed), and a
/// missing one is fine (the host may have removed it, or never written it). A folder this uid
/// cannot write in is logged: the host's `turn close` removes it then.
pub fn remove_token_file(path: &Path) {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() || m.file_type().is_symlink() => {
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(path = %path.display(), error = %e, "could not remove a closed turn's token file");
            }
        }
        Ok(_) => {
            tracing::warn!(path = %path.display(), "a closed turn's token file is not a file: left alone");
        }
        Err(_) => {}
    }
}

/// The peer-uid rule: listed uids, or only our own uid when none are listed.
pub fn peer_allowed(uid: Option<u32>, listed: &[u32], own: u32) -> bool {
    match uid {
        None => false,
        Some(uid) if listed.is_empty() => uid == own,
        Some(uid) => listed.contains(&uid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_rule() {
        assert!(peer_allowed(Some(1000), &[], 1000));
        assert!(!peer_allowed(Some(1001), &[], 1000));
        assert!(peer_allowed(Some(1001), &[1001], 1000));
        assert!(!peer_allowed(Some(1000), &[1001], 1000));
        assert!(!peer_allowed(None, &[], 1000));
    }
}
