//! `sharedos-ipc`: the async side of the IPC contract, shared by broker and shim.
//!
//! Owns reading and writing [`sharedos_proto::frame`] frames on any tokio stream, and the rule
//! that says where the runtime directory and its sockets are. Holds no authority and makes no
//! decision: it moves bytes.
//!
//! # Layout
//! - [`FrameReader`] / [`write_frame`] / [`write_encoded`]: frames over `AsyncRead` / `AsyncWrite`.
//! - [`Conn`]: a connected socket registered for readable readiness only.
//! - [`runtime`]: the runtime directory rule and socket names.
//! - [`connect`]: connect to a socket path.

use std::io;
use std::path::Path;

use interprocess::local_socket::tokio::Stream;
use interprocess::local_socket::tokio::prelude::*;
use interprocess::local_socket::{GenericFilePath, ToFsName};
use serde::{Serialize, de::DeserializeOwned};
use sharedos_proto::frame::{self, FrameError, HEADER_BYTES, MAX_FRAME_BYTES};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub mod conn;
pub mod private_file;
pub mod runtime;

pub use conn::{Conn, HangUp};

/// Bytes read from the socket at a time. The buffer grows only as bytes actually arrive, never
/// to the length a header claims.
const READ_CHUNK: usize = 64 * 1024;

/// Bytes asked for at least by each read, so that a small frame (most are a few hundred bytes)
/// arrives in one read(2) instead of a header read and a body read: one system call less per
/// frame on the call path. What it reads beyond the frame stays in the buffer for the next one.
const READ_AHEAD: usize = 4096;

/// A buffer grown past this for a large frame shrinks back to it once the frame is consumed: a
/// connection that sent one 7 MiB frame does not keep 8 MiB for the rest of its life.
const KEEP_CAPACITY: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error("connection closed")]
    Closed,
    #[error("connection closed in the middle of a frame ({0} bytes pending)")]
    Truncated(usize),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}

/// A whole frame whose body is not a message of the expected type.
#[derive(Debug)]
pub struct Undecodable {
    pub body: Vec<u8>,
    pub error: String,
}

/// Reads frames from a stream, one message at a time.
pub struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// Largest frame body this reader takes (at most the protocol's `MAX_FRAME_BYTES`).
    limit: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        Self::with_limit(inner, MAX_FRAME_BYTES)
    }

    /// A reader that refuses frames longer than `limit` bytes from their header (a connection
    /// that has not said hello yet gets a small one: nothing large is buffered for it).
    pub fn with_limit(inner: R, limit: usize) -> Self {
        Self {
            inner,
            buf: Vec::with_capacity(4096),
            limit: limit.min(MAX_FRAME_BYTES),
        }
    }

    /// Changes the frame limit (after hello, to the protocol's).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.min(MAX_FRAME_BYTES);
    }

    /// Drops the first `used` bytes (a frame read), and the room a large frame needed.
    fn consume(&mut self, used: usize) {
        self.buf.drain(..used);
        if self.buf.capacity() > KEEP_CAPACITY {
            self.buf.shrink_to(KEEP_CAPACITY.max(self.buf.len()));
        }
    }

    /// The next message. `Err(IpcError::Closed)` on a clean end of stream between frames.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<T, IpcError> {
        match self.next_or_undecodable().await? {
            Ok(msg) => Ok(msg),
            Err(u) => Err(IpcError::Frame(FrameError::Malformed(u.error))),
        }
    }

    /// Like [`FrameReader::next`], but a whole frame whose body does not decode as `T` is
    /// consumed and handed back (so that a reader can salvage what it can say about it and go
    /// on with the next frame). Cancel-safe: a future dropped before it completes has consumed
    /// no frame, and the next call goes on from the same bytes.
    pub async fn next_or_undecodable<T: DeserializeOwned>(
        &mut self,
    ) -> Result<Result<T, Undecodable>, IpcError> {
        loop {
            if let Some(len) = frame::body_len(&self.buf)?
                && len > self.limit
            {
                return Err(FrameError::Oversized {
                    len,
                    max: self.limit,
                }
                .into());
            }
            match frame::decode::<T>(&self.buf) {
                Ok(Some((msg, used))) => {
                    self.consume(used);
                    return Ok(Ok(msg));
                }
                Ok(None) => {}
                Err(FrameError::Malformed(error)) => {
                    let len = frame::body_len(&self.buf)?.unwrap_or(0);
                    let body = self
                        .buf
                        .get(HEADER_BYTES..HEADER_BYTES + len)
                        .unwrap_or_default()
                        .to_vec();
                    self.consume((HEADER_BYTES + len).min(self.buf.len()));
                    return Ok(Err(Undecodable { body, error }));
                }
                Err(e) => return Err(e.into()),
            }
            // Read what the current frame still needs (or a header), at least READ_AHEAD and at
            // most a chunk: the buffer never grows to the length a header claims.
            let want = match frame::body_len(&self.buf)? {
                Some(len) => HEADER_BYTES + len - self.buf.len(),
                None => HEADER_BYTES - self.buf.len(),
            }
            .clamp(READ_AHEAD.min(self.limit + HEADER_BYTES), READ_CHUNK);
            // `read_buf` into the buffer's spare room: the buffer grows only by what was read,
            // in the poll that read it, so dropping this future between polls loses nothing
            // (the bridge reads on while a call waits for a place; see `bridge.rs`).
            self.buf.reserve(want);
            let n = (&mut self.inner)
                .take(want as u64)
                .read_buf(&mut self.buf)
                .await?;
            if n == 0 {
                return Err(if self.buf.is_empty() {
                    IpcError::Closed
                } else {
                    IpcError::Truncated(self.buf.len())
                });
            }
            debug_assert!(self.buf.len() <= HEADER_BYTES + MAX_FRAME_BYTES + READ_AHEAD);
        }
    }
}

/// Writes one message as a frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    out: &mut W,
    message: &T,
) -> Result<(), IpcError> {
    Ok(write_encoded(out, &frame::encode(message)?).await?)
}

/// Writes a frame already encoded with [`frame::encode`] (so that a writer can encode before
/// it takes a lock on a shared write half) and flushes it.
pub async fn write_encoded<W: AsyncWrite + Unpin>(out: &mut W, frame: &[u8]) -> io::Result<()> {
    out.write_all(frame).await?;
    out.flush().await
}

/// Connects to the local socket at `path`.
pub async fn connect(path: &Path) -> io::Result<Stream> {
    let name = path.to_fs_name::<GenericFilePath>()?;
    Stream::connect(name).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharedos_proto::ipc::{BridgeRequest, ControlRequest};

    #[tokio::test]
    async fn reads_frames_split_anywhere() {
        let a = frame::encode(&ControlRequest::ListTurns).expect("enc");
        let b = frame::encode(&ControlRequest::PolicyReload).expect("enc");
        let all = [a, b].concat();
        let (mut tx, rx) = tokio::io::duplex(3);
        let writer = tokio::spawn(async move {
            for chunk in all.chunks(5) {
                tx.write_all(chunk).await.expect("write");
            }
        });
        let mut reader = FrameReader::new(rx);
        assert_eq!(
            reader.next::<ControlRequest>().await.expect("1"),
            ControlRequest::ListTurns
        );
        assert_eq!(
            reader.next::<ControlRequest>().await.expect("2"),
            ControlRequest::PolicyReload
        );
        writer.await.expect("join");
        assert!(matches!(
            reader.next::<ControlRequest>().await,
            Err(IpcError::Closed)
        ));
    }

    #[tokio::test]
    async fn frames_read_ahead_together_come_out_one_by_one_in_order() {
        // 300 small frames in one write: each read takes several, and the tail of the last
        // frame in a read waits in the buffer for the next read.
        let frames: Vec<_> = (0..300u64)
            .map(|id| frame::encode(&BridgeRequest::Cancel { id }).expect("enc"))
            .collect();
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&frames.concat()).await.expect("write");
        drop(tx);
        let mut reader = FrameReader::new(rx);
        for id in 0..300u64 {
            assert_eq!(
                reader.next::<BridgeRequest>().await.expect("frame"),
                BridgeRequest::Cancel { id }
            );
        }
        assert!(matches!(
            reader.next::<BridgeRequest>().await,
            Err(IpcError::Closed)
        ));
    }

    #[tokio::test]
    async fn oversized_claim_fails_without_reading_the_body() {
        let (mut tx, rx) = tokio::io::duplex(64);
        tx.write_all(&[0xff, 0xff, 0xff, 0xff])
            .await
            .expect("write");
        let mut reader = FrameReader::new(rx);
        assert!(matches!(
            reader.next::<ControlRequest>().await,
            Err(IpcError::Frame(FrameError::Oversized { .. }))
        ));
    }

    #[tokio::test]
    async fn truncated_frame_is_reported() {
        let (mut tx, rx) = tokio::io::duplex(64);
        tx.write_all(&[0, 0, 0, 10, b'{']).await.expect("write");
        drop(tx);
        let mut reader = FrameReader::new(rx);
        assert!(matches!(
            reader.next::<ControlRequest>().await,
            Err(IpcError::Truncated(5))
        ));
    }
}
