//! A connected local socket registered with the runtime for readable readiness only.
//!
//! Tokio registers a Unix stream for readable and writable readiness. Then every read on one
//! end runs the other end's wait-queue callback for write space (`unix_write_space`), which
//! wakes a peer sleeping in `epoll_wait` for nothing; on a VM a wake-up is expensive (see
//! `bench/NOTES.md`). A [`Conn`] asks only for readable readiness and writes directly; only
//! when the socket buffer is full does it register, for that one write, for writable
//! readiness.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use interprocess::local_socket::tokio::Stream;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// See the module docs.
pub struct Conn {
    read: AsyncFd<UnixStream>,
    /// A second descriptor of the same socket, registered for writable readiness only while a
    /// write waits for buffer space.
    write: Option<AsyncFd<UnixStream>>,
}

impl Conn {
    /// Takes over a connected stream: its descriptor leaves the runtime's registration and is
    /// registered again for readable readiness only.
    pub fn new(stream: Stream) -> io::Result<Self> {
        let Stream::UdSocket(uds) = stream;
        let socket = UnixStream::from(OwnedFd::try_from(uds)?);
        socket.set_nonblocking(true)?;
        Ok(Self {
            read: register(socket, Interest::READABLE)?,
            write: None,
        })
    }
}

impl Conn {
    /// A watch on this connection's peer going away, on a second descriptor of the socket: it
    /// sees the peer close its end even while frames the peer sent before closing are unread.
    pub fn hang_up_watch(&self) -> io::Result<HangUp> {
        let dup = self.read.get_ref().try_clone()?;
        Ok(HangUp(register(dup, Interest::PRIORITY)?))
    }
}

/// See [`Conn::hang_up_watch`]. Registered for priority readiness only, which a local stream
/// never has: it wakes only when the kernel reports the hang-up (`EPOLLHUP`, both directions
/// shut: the peer closed its end) or an error. A peer that only shut its writing half is not
/// gone (it can still read answers).
pub struct HangUp(AsyncFd<UnixStream>);

impl HangUp {
    /// Ends once the peer has closed its end.
    pub async fn wait(&self) {
        loop {
            match self.0.ready(Interest::PRIORITY).await {
                Ok(mut guard) => {
                    if self.now() {
                        return;
                    }
                    guard.clear_ready();
                }
                // The registration is gone: nothing more can be learnt from it.
                Err(_) => return std::future::pending().await,
            }
        }
    }

    /// Whether the peer has closed its end, at this moment (one `poll(2)` that does not wait).
    pub fn now(&self) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(self.0.get_ref(), PollFlags::empty())];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(n) if n > 0 => fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR),
            _ => false,
        }
    }
}

/// Registers a socket with the runtime for `interest` only.
///
/// `AsyncFd::with_interest` is deprecated because an arbitrary `AsRawFd` type may close or
/// swap its descriptor while registered; its replacement is `unsafe`, which this workspace
/// forbids. A `std` `UnixStream` owns its descriptor from creation to drop and never changes it,
/// which is exactly the invariant the replacement asks callers to promise.
#[allow(deprecated)]
fn register(socket: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    AsyncFd::with_interest(socket, interest)
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.read.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let len = unfilled.len();
            match guard.try_io(|s| s.get_ref().read(unfilled)) {
                Ok(Ok(n)) => {
                    // A short read drained the socket: the next read would only find EAGAIN
                    // (one wasted recvfrom per frame, seen under strace), so wait for the next
                    // readiness event instead. Tokio's own streams do the same; a newer event
                    // than the one this read answered is not lost (readiness carries a tick).
                    if n > 0 && n < len {
                        guard.clear_ready();
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write.is_none() {
            match this.read.get_ref().write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let dup = this.read.get_ref().try_clone()?;
                    this.write = Some(register(dup, Interest::WRITABLE)?);
                }
                done => return Poll::Ready(done),
            }
        }
        let Some(write) = this.write.as_ref() else {
            return Poll::Ready(Err(io::Error::other("no write registration")));
        };
        loop {
            let mut guard = ready!(write.poll_write_ready(cx))?;
            match guard.try_io(|s| s.get_ref().write(buf)) {
                Ok(done) => {
                    // Buffer space again: stop asking for write readiness.
                    this.write = None;
                    return Poll::Ready(done);
                }
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.read.get_ref().shutdown(Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use interprocess::local_socket::tokio::prelude::*;
    use interprocess::local_socket::{GenericFilePath, ListenerOptions, ToFsName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A frame far larger than a socket buffer crosses intact (the write waits for space), and
    /// the end of the stream is seen.
    #[tokio::test]
    async fn large_writes_wait_for_space_and_close_is_seen() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.sock");
        let name = path.clone().to_fs_name::<GenericFilePath>().expect("name");
        let listener = ListenerOptions::new()
            .name(name)
            .create_tokio()
            .expect("listen");
        let big: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let server = tokio::spawn(async move {
            let stream = listener.accept().await.expect("accept");
            let mut conn = Conn::new(stream).expect("conn");
            conn.write_all(&sent).await.expect("write");
            conn.shutdown().await.expect("shutdown");
        });
        let stream = crate::connect(&path).await.expect("connect");
        let mut conn = Conn::new(stream).expect("conn");
        let mut got = Vec::new();
        conn.read_to_end(&mut got).await.expect("read");
        assert_eq!(got.len(), big.len());
        assert!(got == big, "bytes differ");
        server.await.expect("server");
    }
}
