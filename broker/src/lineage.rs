//! The processes the broker spawned for its brokered upstreams, and whether a socket's peer is
//! one of them or descends from one: the sockets refuse such a peer whatever its uid (an
//! upstream under the broker's own uid must not drive `control.sock` or `bridge.sock`).
//!
//! Kept here, below both the upstream providers (which add and remove their processes) and the
//! socket handlers (which ask), so that neither names the other.

use std::collections::BTreeSet;
use std::sync::Mutex;

/// How many parents a peer's ancestry is followed through.
pub const MAX_ANCESTRY: usize = 64;

static SPAWNED: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

fn spawned() -> std::sync::MutexGuard<'static, BTreeSet<u32>> {
    SPAWNED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An upstream process (its pid is also its process group and session: the launcher made them).
pub fn add(pid: u32) {
    spawned().insert(pid);
}

pub fn remove(pid: u32) {
    spawned().remove(&pid);
}

/// `(ppid, pgrp, session)` of a process, from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(u32, u32, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields start after the last `)`.
    let mut f = text.rsplit_once(')')?.1.split_whitespace().skip(1);
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    let session = f.next()?.parse().ok()?;
    Some((ppid, pgrp, session))
}

/// Whether `pid` is an upstream process, or in an upstream's process group or session, or a
/// descendant of one. A peer whose pid is unknown is not judged here (the uid rule decides).
pub fn from_upstream(pid: Option<u32>) -> bool {
    let Some(mut pid) = pid else { return false };
    let set = spawned().clone();
    if set.is_empty() {
        return false;
    }
    let me = std::process::id();
    for _ in 0..MAX_ANCESTRY {
        if set.contains(&pid) {
            return true;
        }
        let Some((ppid, pgrp, session)) = stat(pid) else {
            return false;
        };
        if set.contains(&pgrp) || set.contains(&session) {
            return true;
        }
        if ppid <= 1 || ppid == me {
            return false;
        }
        pid = ppid;
    }
    false
}
