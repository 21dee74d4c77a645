//! The shim's transport: the bounded reader of stdin lines and the one writer that owns stdout.
//! It knows lines and bytes, not what they mean: [`crate::session`] checks each line and decides
//! where it goes.
//!
//! Owns stdout: nothing else in the shim writes to it.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::guard;

/// Whole lines queued to the writer (the session's own answers and the calls' answers).
const OUT_QUEUE: usize = 64;

/// A line over [`guard::MAX_LINE_BYTES`]: never buffered whole, but its length, its first
/// [`guard::OVERSIZE_PREFIX_BYTES`] and the SHA-256 of all of it are kept, so that a call it
/// carries can still be recorded.
pub struct Oversize {
    len: usize,
    prefix: Vec<u8>,
    sha: sha2::Sha256,
}

impl Oversize {
    fn add(&mut self, bytes: &[u8]) {
        use sha2::Digest;
        self.sha.update(bytes);
        self.len += bytes.len();
        let room = guard::OVERSIZE_PREFIX_BYTES.saturating_sub(self.prefix.len());
        self.prefix
            .extend_from_slice(&bytes[..room.min(bytes.len())]);
    }

    /// Its length, the bytes kept from its start, and the SHA-256 of all of it (hex).
    pub fn parts(self) -> (usize, Vec<u8>, String) {
        use sha2::Digest;
        let sha = sharedos_proto::catalog::hex(&self.sha.finalize());
        (self.len, self.prefix, sha)
    }
}

/// What [`Lines::next`] read.
pub enum Read {
    /// A line, without its newline (and one `\r` before it): see [`Lines::line`].
    Line,
    /// A line over [`guard::MAX_LINE_BYTES`], consumed but not kept.
    Oversize(Oversize),
}

/// Reads stdin one line at a time, bounded: a line longer than [`guard::MAX_LINE_BYTES`] is
/// consumed and reported as an [`Oversize`] instead of being buffered.
///
/// [`Lines::next`] is cancel-safe (the session waits on it in a `select!`): what was read of a
/// line stays here until the line is complete.
pub struct Lines<R> {
    input: BufReader<R>,
    line: Vec<u8>,
    over: Option<Oversize>,
    /// The last call returned a line: the next one starts a new one.
    returned: bool,
}

impl<R: AsyncRead + Unpin> Lines<R> {
    pub fn new(input: R) -> Self {
        Self {
            input: BufReader::new(input),
            line: Vec::new(),
            over: None,
            returned: false,
        }
    }

    /// The line the last [`Lines::next`] returned as [`Read::Line`].
    pub fn line(&self) -> &[u8] {
        &self.line
    }

    /// The same line with a newline after it, as it is passed on.
    pub fn terminated(&mut self) -> &[u8] {
        self.line.push(b'\n');
        &self.line
    }

    /// The next line; `Ok(None)` at the end of input.
    pub async fn next(&mut self) -> std::io::Result<Option<Read>> {
        if std::mem::take(&mut self.returned) {
            self.line.clear();
        }
        loop {
            // The only await: everything after it runs to the end of the iteration.
            let chunk = self.input.fill_buf().await?;
            if chunk.is_empty() {
                return Ok(match self.over.take() {
                    Some(o) => Some(Read::Oversize(o)),
                    None if self.line.is_empty() => None,
                    None => {
                        self.returned = true;
                        Some(Read::Line)
                    }
                });
            }
            let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
                Some(i) => (i, true),
                None => (chunk.len(), false),
            };
            match self.over.as_mut() {
                None if self.line.len() + take <= guard::MAX_LINE_BYTES => {
                    self.line.extend_from_slice(&chunk[..take]);
                }
                None => {
                    let mut o = Oversize {
                        len: 0,
                        prefix: Vec::new(),
                        sha: sha2::Digest::new(),
                    };
                    o.add(&self.line);
                    o.add(&chunk[..take]);
                    self.line.clear();
                    self.over = Some(o);
                }
                Some(o) => o.add(&chunk[..take]),
            }
            self.input.consume(take + usize::from(done));
            if done {
                return Ok(Some(match self.over.take() {
                    Some(o) => Read::Oversize(o),
                    None => {
                        if self.line.last() == Some(&b'\r') {
                            self.line.pop();
                        }
                        self.returned = true;
                        Read::Line
                    }
                }));
            }
        }
    }
}

/// Starts the one writer to stdout: it writes whole lines from two sources, the MCP server's
/// output (`from_rmcp`, read line by line) and the lines sent to the returned queue (each one
/// whole, newline included), as they come. It stops when both have ended (or stdout fails).
pub fn writer<W, F>(stdout: W, from_rmcp: F) -> (mpsc::Sender<Vec<u8>>, JoinHandle<()>)
where
    W: AsyncWrite + Unpin + Send + 'static,
    F: AsyncRead + Unpin + Send + 'static,
{
    let (lines, mut lines_rx) = mpsc::channel::<Vec<u8>>(OUT_QUEUE);
    let task = tokio::spawn(async move {
        let mut out = stdout;
        let mut from_rmcp = BufReader::new(from_rmcp);
        let mut line = Vec::new();
        let mut rmcp_open = true;
        let mut lines_open = true;
        loop {
            let bytes = tokio::select! {
                n = from_rmcp.read_until(b'\n', &mut line), if rmcp_open => match n {
                    Ok(0) | Err(_) => {
                        rmcp_open = false;
                        None
                    }
                    Ok(_) => Some(std::mem::take(&mut line)),
                },
                l = lines_rx.recv(), if lines_open => {
                    lines_open = l.is_some();
                    l
                }
                else => break,
            };
            if let Some(bytes) = bytes
                && (out.write_all(&bytes).await.is_err() || out.flush().await.is_err())
            {
                return;
            }
        }
        let _ = out.flush().await;
    });
    (lines, task)
}
