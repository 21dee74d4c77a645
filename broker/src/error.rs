//! Why a broker could not start: every case names what it could not use.

use std::path::Path;

use crate::evidence::record::RecordError;
use crate::files::FilesConfigError;
use crate::kernel::RegistryError;
use crate::pins::PinError;
use crate::policy::PolicyError;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Pins(#[from] PinError),
    #[error(transparent)]
    Files(#[from] FilesConfigError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Trust(#[from] crate::trusted::TrustError),
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::TelemetryError),
    #[error("provider `{namespace}` (config `{config}`): {detail}")]
    Provider {
        namespace: String,
        config: String,
        detail: String,
    },
    #[error("provider `{namespace}` (config `{config}`) did not start in time")]
    ProviderTimeout { namespace: String, config: String },
    #[error("a broker is already listening on `{path}`; stop it or use another --runtime-dir")]
    AlreadyListening { path: String },
    #[error("runtime dir `{path}` belongs to uid {owner}, not to this broker's uid {uid}")]
    NotOurs { path: String, owner: u32, uid: u32 },
    #[error(
        "runtime dir `{path}` (mode {mode:04o}) can be written by other uids: make it 0700 (or remove it and let the broker make it)"
    )]
    OpenToOthers { path: String, mode: u32 },
    #[error("runtime dir `{path}` is not a folder")]
    NotAFolder { path: String },
    #[error(
        "cannot give `{path}` to group {gid}: the broker's uid must be a member of that group (or root): {source}"
    )]
    Group {
        path: String,
        gid: u32,
        source: std::io::Error,
    },
    /// An operation on a path failed: `what` says which (`cannot listen on`, ...).
    #[error("{what} `{path}`: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    /// The uids given to per-principal instances (`instance_uids`) could not be read or kept.
    #[error("instance_uids: {0}")]
    InstanceUids(String),
    #[error("the broker task failed: {0}")]
    Task(String),
    /// The person's page (`[page]`) could not start: its certificate, key, client secret or
    /// address.
    #[error("[page]: {0}")]
    Page(String),
}

impl StartError {
    /// `map_err` for an IO failure on `path`.
    pub(crate) fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.display().to_string();
        move |source| Self::Io { what, path, source }
    }
}
