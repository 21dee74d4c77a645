//! Where the broker's runtime directory and sockets are.
//!
//! Default runtime dir: `$XDG_RUNTIME_DIR/sharedos`, else `/tmp/sharedos-$UID`. The broker
//! creates it 0700 with `control.sock` (the host's) and `bridge.sock` (the harnesses') inside.

use std::path::{Path, PathBuf};

pub const CONTROL_SOCKET: &str = "control.sock";
/// The key a peer under the broker's uid presents at `control.sock` (0600, the broker's).
pub const CONTROL_KEY: &str = "control.key";
pub const BRIDGE_SOCKET: &str = "bridge.sock";
/// Environment variable naming the runtime dir for host commands.
pub const RUNTIME_DIR_ENV: &str = "SHAREDOS_RUNTIME_DIR";
/// Environment variable naming the bridge socket for the shim.
pub const BROKER_ENV: &str = "SHAREDOS_BROKER";
/// Environment variable carrying the turn token to the shim.
pub const TOKEN_ENV: &str = "SHAREDOS_TURN_TOKEN";
/// Environment variable naming the uid the broker runs as: the shim gives its token only to a
/// bridge socket whose listener runs as this uid (`turn open --write-config` writes it).
pub const BROKER_UID_ENV: &str = "SHAREDOS_BROKER_UID";

/// The effective uid of this process.
pub fn current_uid() -> u32 {
    // Reading our own /proc entry's owner avoids unsafe libc calls.
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap_or(u32::MAX)
}

/// The default runtime dir (see module docs).
pub fn default_runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("sharedos"),
        _ => PathBuf::from(format!("/tmp/sharedos-{}", current_uid())),
    }
}

/// The runtime dir from an explicit value, else `SHAREDOS_RUNTIME_DIR`, else the default.
pub fn resolve_runtime_dir(explicit: Option<&Path>) -> PathBuf {
    if let Some(dir) = explicit {
        return dir.to_path_buf();
    }
    match std::env::var_os(RUNTIME_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => default_runtime_dir(),
    }
}

pub fn control_socket(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join(CONTROL_SOCKET)
}

/// The control key's file in a runtime dir (see `ControlRequest::Hello`).
pub fn control_key(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join(CONTROL_KEY)
}

pub fn bridge_socket(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join(BRIDGE_SOCKET)
}
