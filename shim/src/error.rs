//! Why the shim could not start serving, or stopped: each message is what `main` prints after
//! `sharedos-mcp-shim: ` on stderr before it exits (2 before serving, 3 once serving).

use std::path::PathBuf;

use sharedos_ipc::IpcError;
use sharedos_proto::alias::PortableCollision;
use sharedos_proto::ipc::{BridgeEvent, PROTOCOL_VERSION, RefusalCode};

#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// Neither `SHAREDOS_TURN_TOKEN` nor `--turn-token-file`.
    #[error("no turn token: set SHAREDOS_TURN_TOKEN or pass --turn-token-file FILE")]
    NoToken,
    #[error("cannot read the turn token file `{}`: {source}", path.display())]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the turn token is empty")]
    EmptyToken,
    #[error("timed out connecting to the SharedOS broker at `{}`", socket.display())]
    ConnectTimeout { socket: PathBuf },
    #[error(
        "cannot reach the SharedOS broker at `{}`: {source} (is `sharedos-broker serve` running? set SHAREDOS_BROKER)",
        socket.display()
    )]
    Connect {
        socket: PathBuf,
        source: std::io::Error,
    },
    /// The socket's folder (or the socket) cannot be looked at: nothing is sent.
    #[error(
        "cannot check the broker socket's folder `{}`: {source}; no token sent",
        folder.display()
    )]
    FolderUnreadable {
        folder: PathBuf,
        source: std::io::Error,
    },
    /// No uid was named for the broker and the socket's folder could have been made by anyone.
    #[error(
        "refusing the broker socket's folder `{}`: it belongs to uid {owner} (not this uid {me} or root) and `{}` above it may be written by other uids, so any uid could have made it; set SHAREDOS_BROKER_UID to the broker's uid; no token sent",
        folder.display(),
        above.display()
    )]
    UnknownBrokerUid {
        folder: PathBuf,
        owner: u32,
        me: u32,
        above: PathBuf,
    },
    #[error(
        "refusing the broker socket's folder `{}`: it belongs to uid {owner}, not to the broker's uid {broker} or root; no token sent",
        folder.display()
    )]
    FolderOwner {
        folder: PathBuf,
        owner: u32,
        broker: u32,
    },
    #[error(
        "refusing the broker socket's folder `{}`: mode {mode:o} lets other uids write it, so another uid could listen there; no token sent",
        folder.display()
    )]
    FolderWritable { folder: PathBuf, mode: u32 },
    /// The process at the other end of the socket is not the broker's uid (`SO_PEERCRED`).
    #[error(
        "refusing the process listening at `{}`: it runs as {}, not as the broker's uid {broker} (set SHAREDOS_BROKER_UID if the broker runs as another uid); no token sent",
        socket.display(),
        peer.map_or_else(|| "an unknown uid".to_owned(), |u| format!("uid {u}"))
    )]
    PeerUid {
        socket: PathBuf,
        peer: Option<u32>,
        broker: u32,
    },
    #[error("cannot set up the connection to the SharedOS broker: {0}")]
    Setup(#[source] std::io::Error),
    /// Hello could not be written.
    #[error("cannot talk to the SharedOS broker: {0}")]
    Hello(#[source] IpcError),
    #[error("the SharedOS broker did not answer hello")]
    HelloTimeout,
    /// The connection ended (or carried garbage) before the broker answered hello.
    #[error("the SharedOS broker closed the connection: {0}")]
    Closed(#[source] IpcError),
    /// The broker welcomed the shim in a protocol version it does not speak.
    #[error("the broker speaks protocol {broker}; this shim speaks {PROTOCOL_VERSION}")]
    Protocol { broker: u32 },
    /// The broker refused hello (bad token, closed turn, a uid it does not serve, ...).
    #[error(
        "the SharedOS broker refused this shim: {message} ({})",
        wire_word(code)
    )]
    Refused { code: RefusalCode, message: String },
    #[error("unexpected first answer from the broker: {0:?}")]
    Unexpected(Box<BridgeEvent>),
    /// The turn asked for portable names, and two of its tools would share one.
    #[error(transparent)]
    PortableNames(#[from] PortableCollision),
    #[error("MCP session did not start: {0}")]
    SessionStart(#[source] Box<rmcp::service::ServerInitializeError>),
    #[error("MCP session ended with an error: {0}")]
    Session(#[source] tokio::task::JoinError),
}

impl ShimError {
    /// The shim refused the listener at its socket path (not the broker's uid, or a folder
    /// others can write): the harness hears it as a JSON-RPC error too.
    pub fn is_untrusted_broker(&self) -> bool {
        matches!(
            self,
            Self::FolderUnreadable { .. }
                | Self::UnknownBrokerUid { .. }
                | Self::FolderOwner { .. }
                | Self::FolderWritable { .. }
                | Self::PeerUid { .. }
        )
    }
}

/// A refusal code as the wire spells it (`bad_token`).
fn wire_word(code: &RefusalCode) -> String {
    serde_json::to_value(code)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_as_before() {
        let refused = ShimError::Refused {
            code: RefusalCode::BadToken,
            message: "this uid may not use the bridge socket".into(),
        };
        assert_eq!(
            refused.to_string(),
            "the SharedOS broker refused this shim: this uid may not use the bridge socket (bad_token)"
        );
        assert_eq!(
            ShimError::Protocol { broker: 99 }.to_string(),
            format!("the broker speaks protocol 99; this shim speaks {PROTOCOL_VERSION}")
        );
        let connect = ShimError::Connect {
            socket: "/run/b.sock".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        let text = connect.to_string();
        assert!(
            text.starts_with("cannot reach the SharedOS broker at `/run/b.sock`: ")
                && text.ends_with(" (is `sharedos-broker serve` running? set SHAREDOS_BROKER)"),
            "{text}"
        );
    }
}
