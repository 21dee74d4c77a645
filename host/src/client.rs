//! A control-socket client: what the CLI (and tests, and the demo) use to talk to a broker.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use interprocess::local_socket::tokio::Stream;
use tokio::io::{ReadHalf, WriteHalf};

use sharedos_ipc::{FrameReader, runtime, write_frame};
use sharedos_proto::ipc::{ControlRequest, ControlResponse, PROTOCOL_VERSION};

pub struct ControlClient {
    reader: FrameReader<ReadHalf<Stream>>,
    send: WriteHalf<Stream>,
}

impl ControlClient {
    /// Connects to the broker whose runtime dir is `runtime_dir` and says hello.
    pub async fn connect(runtime_dir: &Path) -> anyhow::Result<Self> {
        let path: PathBuf = runtime::control_socket(runtime_dir);
        let stream = sharedos_ipc::connect(&path).await.with_context(|| {
            format!(
                "no broker is listening at `{}` (start one with `sharedos-broker serve`, or name its --runtime-dir)",
                path.display()
            )
        })?;
        let (recv, send) = tokio::io::split(stream);
        let mut client = Self {
            reader: FrameReader::new(recv),
            send,
        };
        match client
            .request(&ControlRequest::Hello {
                protocol: PROTOCOL_VERSION,
            })
            .await?
        {
            ControlResponse::Welcome { .. } => Ok(client),
            ControlResponse::Error { code, message } => bail!("broker refused: {message} ({code})"),
            other => bail!("unexpected answer to hello: {other:?}"),
        }
    }

    /// Sends one request and waits for its response.
    pub async fn request(&mut self, req: &ControlRequest) -> anyhow::Result<ControlResponse> {
        write_frame(&mut self.send, req)
            .await
            .context("sending to the broker")?;
        self.reader
            .next::<ControlResponse>()
            .await
            .context("reading the broker's answer")
    }

    /// Like `request`, but an `error` response becomes an `Err` with its message.
    pub async fn call(&mut self, req: &ControlRequest) -> anyhow::Result<ControlResponse> {
        match self.request(req).await? {
            ControlResponse::Error { code, message } => bail!("{message} ({code})"),
            other => Ok(other),
        }
    }
}
