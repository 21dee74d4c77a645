//! A control-socket client: what the CLI (and tests, and the demo) use to talk to a broker.
//!
//! Its errors read as a context chain: each variant's message says what failed and names the
//! input, and the underlying error (if any) is its `source`, so the CLI, which prints the whole
//! chain, shows `what failed: why`.

use std::path::{Path, PathBuf};

use interprocess::local_socket::tokio::Stream;
use interprocess::local_socket::traits::StreamCommon as _;
use tokio::io::{ReadHalf, WriteHalf};

use sharedos_ipc::{FrameReader, IpcError, runtime, write_frame};
use sharedos_proto::ipc::{ControlRequest, ControlResponse, PROTOCOL_VERSION, TurnToken};

/// Why a request over `control.sock` got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing accepts connections at the control socket.
    #[error(
        "no broker is listening at `{}` (start one with `sharedos-broker serve`, or name its --runtime-dir)",
        path.display()
    )]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The broker answered hello with an error (e.g. a protocol version it does not speak).
    #[error("broker refused: {message} ({code})")]
    Refused { code: String, message: String },
    /// A request frame could not be written.
    #[error("sending to the broker")]
    Send(#[source] IpcError),
    /// The answer frame could not be read.
    #[error("reading the broker's answer")]
    Receive(#[source] IpcError),
    /// The broker answered a request with an `error` response.
    #[error("{message} ({code})")]
    Broker { code: String, message: String },
    /// The broker answered with a response of the wrong kind for the request.
    #[error("unexpected answer to {request}: {answer:?}")]
    Unexpected {
        /// The request, as the message names it (`hello`, `open_turn`, ...).
        request: &'static str,
        answer: Box<ControlResponse>,
    },
}

impl ClientError {
    /// `answer` was not what `request` expects.
    pub fn unexpected(request: &'static str, answer: ControlResponse) -> Self {
        Self::Unexpected {
            request,
            answer: Box::new(answer),
        }
    }
}

pub struct ControlClient {
    reader: FrameReader<ReadHalf<Stream>>,
    send: WriteHalf<Stream>,
    /// The uid of the process listening at `control.sock` (`SO_PEERCRED`): the broker's.
    broker_uid: Option<u32>,
}

impl ControlClient {
    /// Connects to the broker whose runtime dir is `runtime_dir` and says hello.
    pub async fn connect(runtime_dir: &Path) -> Result<Self, ClientError> {
        let path: PathBuf = runtime::control_socket(runtime_dir);
        let stream = match sharedos_ipc::connect(&path).await {
            Ok(s) => s,
            Err(source) => return Err(ClientError::Connect { path, source }),
        };
        let broker_uid = stream.peer_creds().ok().and_then(|c| c.euid());
        let (recv, send) = tokio::io::split(stream);
        let mut client = Self {
            reader: FrameReader::new(recv),
            send,
            broker_uid,
        };
        match client
            .request(&ControlRequest::Hello {
                protocol: PROTOCOL_VERSION,
                // Readable by the broker's uid (and root) only; another host uid sends none.
                key: std::fs::read_to_string(runtime::control_key(runtime_dir))
                    .ok()
                    .map(|k| TurnToken::new(k.trim().to_owned())),
            })
            .await?
        {
            ControlResponse::Welcome { .. } => Ok(client),
            ControlResponse::Error { code, message } => Err(ClientError::Refused { code, message }),
            other => Err(ClientError::unexpected("hello", other)),
        }
    }

    /// The uid the broker runs as, as the kernel reports it for this connection (what a harness
    /// config gives the shim as `SHAREDOS_BROKER_UID`).
    pub fn broker_uid(&self) -> Option<u32> {
        self.broker_uid
    }

    /// Sends one request and waits for its response.
    pub async fn request(&mut self, req: &ControlRequest) -> Result<ControlResponse, ClientError> {
        write_frame(&mut self.send, req)
            .await
            .map_err(ClientError::Send)?;
        self.reader
            .next::<ControlResponse>()
            .await
            .map_err(ClientError::Receive)
    }

    /// Like `request`, but an `error` response becomes [`ClientError::Broker`] with its code
    /// and message.
    pub async fn call(&mut self, req: &ControlRequest) -> Result<ControlResponse, ClientError> {
        match self.request(req).await? {
            ControlResponse::Error { code, message } => Err(ClientError::Broker { code, message }),
            other => Ok(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_as_before() {
        let broker = ClientError::Broker {
            code: "invalid_attributes".into(),
            message: "attribute `color` is not in the schema".into(),
        };
        assert_eq!(
            broker.to_string(),
            "attribute `color` is not in the schema (invalid_attributes)"
        );
        let refused = ClientError::Refused {
            code: "protocol".into(),
            message: "protocol version 9 is not supported".into(),
        };
        assert_eq!(
            refused.to_string(),
            "broker refused: protocol version 9 is not supported (protocol)"
        );
        let connect = ClientError::Connect {
            path: "/run/x/control.sock".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert!(
            connect
                .to_string()
                .starts_with("no broker is listening at `/run/x/control.sock`")
        );
        assert!(std::error::Error::source(&connect).is_some());
    }

    #[tokio::test]
    async fn connecting_where_no_broker_listens_names_the_socket() {
        let dir = tempfile::tempdir().expect("tmp");
        let Err(e) = ControlClient::connect(dir.path()).await else {
            panic!("connected to nothing")
        };
        assert!(
            matches!(&e, ClientError::Connect { path, .. } if path == &runtime::control_socket(dir.path())),
            "{e:?}"
        );
    }
}
