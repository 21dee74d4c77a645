//! The shim's stdin and stdout: lines from the client go through the [`crate::guard`] first.
//! Every `tools/call` is answered here (by a [`Refer`] function, on its own task); the rest goes
//! on to rmcp. rmcp's output and the calls' answers share one writer, whole lines only.
//!
//! Owns stdout: nothing else in the shim writes to it.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::guard::{self, Referral, Verdict};

/// Answers a [`Verdict::Refer`]red call: the whole JSON-RPC response for it, one line without its
/// newline, or `None` when nothing is to be answered (the client cancelled the call: the token
/// it is given fired).
pub type Refer = Arc<
    dyn Fn(Referral, CancellationToken) -> Pin<Box<dyn Future<Output = Option<Vec<u8>>> + Send>>
        + Send
        + Sync,
>;

/// How long the writer waits for itself to drain once everything else is over.
const WRITER_GRACE: Duration = Duration::from_secs(2);

/// Bytes buffered between the guard and rmcp, each way.
const PIPE_BYTES: usize = 1 << 20;
/// Guard answers queued to the writer.
const ANSWER_QUEUE: usize = 64;

/// A line over [`guard::MAX_LINE_BYTES`]: never buffered whole, but its length, its first
/// [`guard::OVERSIZE_PREFIX_BYTES`] and the SHA-256 of all of it are kept, so that a call it
/// carries can still be recorded.
struct Oversize {
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

    fn verdict(self) -> Verdict {
        use sha2::Digest;
        let sha = sharedos_proto::catalog::hex(&self.sha.finalize());
        guard::check_oversize(self.len, &self.prefix, &sha)
    }
}

/// Reads one line (without its newline), bounded: a longer line is consumed and reported as an
/// [`Oversize`] instead. `Ok(None)` at end of input.
async fn next_line<R: AsyncRead + Unpin>(
    input: &mut BufReader<R>,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<Result<(), Oversize>>> {
    buf.clear();
    let mut over: Option<Oversize> = None;
    loop {
        let chunk = input.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(match over {
                Some(o) => Some(Err(o)),
                None if buf.is_empty() => None,
                None => Some(Ok(())),
            });
        }
        let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        match over.as_mut() {
            None if buf.len() + take <= guard::MAX_LINE_BYTES => {
                buf.extend_from_slice(&chunk[..take]);
            }
            None => {
                let mut o = Oversize {
                    len: 0,
                    prefix: Vec::new(),
                    sha: sha2::Digest::new(),
                };
                o.add(buf);
                o.add(&chunk[..take]);
                buf.clear();
                over = Some(o);
            }
            Some(o) => o.add(&chunk[..take]),
        }
        input.consume(take + usize::from(done));
        if done {
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
            return Ok(Some(match over {
                Some(o) => Err(o),
                None => Ok(()),
            }));
        }
    }
}

/// Calls in flight by request id (its JSON text, so `7` and `"7"` stay apart), each with a serial
/// so that a finished call does not remove a later one that reused its id.
type InFlight = Arc<Mutex<HashMap<String, (u64, CancellationToken)>>>;

/// What [`guarded`] leaves running besides rmcp's transport.
pub struct Session {
    writer: JoinHandle<()>,
    calls: TaskTracker,
    done: CancellationToken,
}

impl Session {
    /// Ends the session once rmcp's has ended: waits up to `grace` for the calls still in
    /// flight, then for the writer to put every answer on stdout. A call still running after
    /// `grace` is left to the broker, which records it as cancelled when the shim goes away.
    pub async fn finish(self, grace: Duration) {
        self.calls.close();
        if tokio::time::timeout(grace, self.calls.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                calls = self.calls.len(),
                "calls still in flight at exit are left unanswered"
            );
        }
        self.done.cancel();
        let _ = tokio::time::timeout(WRITER_GRACE, self.writer).await;
    }
}

/// Wires stdin and stdout to rmcp through the guard. Returns rmcp's transport ends and the
/// [`Session`] to finish after rmcp's session ends, so everything answered reaches stdout.
///
/// Each `tools/call` runs on its own task and is answered when `refer` resolves, so a slow call
/// holds up nothing else; one without an id (a notification) is decided and recorded but its
/// answer is dropped. A `notifications/cancelled` naming a call in flight fires that call's
/// token (and still goes on to rmcp, which ignores ids it does not know).
pub fn guarded<R, W>(stdin: R, stdout: W, refer: Refer) -> ((DuplexStream, DuplexStream), Session)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (mut to_rmcp, rmcp_in) = tokio::io::duplex(PIPE_BYTES);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let (answers, mut answers_rx) = mpsc::channel::<Vec<u8>>(ANSWER_QUEUE);
    let calls = TaskTracker::new();
    let done = CancellationToken::new();
    let in_flight = InFlight::default();
    let serial = AtomicU64::new(0);
    let tracker = calls.clone();
    tokio::spawn(async move {
        let mut input = BufReader::new(stdin);
        let mut line = Vec::new();
        loop {
            let verdict = match next_line(&mut input, &mut line).await {
                Ok(None) | Err(_) => break,
                Ok(Some(Err(oversize))) => oversize.verdict(),
                Ok(Some(Ok(()))) if line.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(Some(Ok(()))) => guard::check_line(&line),
            };
            // A cancellation fires the referred call's token, then goes on to rmcp like any line
            // it passes (the id may name one of rmcp's requests).
            if let Verdict::Cancel(id) = &verdict {
                let cancelled = in_flight
                    .lock()
                    .ok()
                    .and_then(|mut m| m.remove(&id.to_string()));
                if let Some((_, token)) = cancelled {
                    tracing::debug!(%id, "call cancelled by the client");
                    token.cancel();
                }
            }
            match verdict {
                Verdict::Pass | Verdict::Cancel(_) => {
                    line.push(b'\n');
                    if to_rmcp.write_all(&line).await.is_err() {
                        break;
                    }
                }
                Verdict::Answer(v) => {
                    tracing::info!(answer = %v, "malformed input answered by the shim");
                    let mut bytes = v.to_string().into_bytes();
                    bytes.push(b'\n');
                    if answers.send(bytes).await.is_err() {
                        break;
                    }
                }
                Verdict::Refer(referral) => {
                    let token = CancellationToken::new();
                    let key = referral.id.as_ref().map(|id| {
                        let key = (id.to_string(), serial.fetch_add(1, Ordering::Relaxed));
                        if let Ok(mut m) = in_flight.lock() {
                            m.insert(key.0.clone(), (key.1, token.clone()));
                        }
                        key
                    });
                    if key.is_none() {
                        // JSON-RPC forbids an answer, not the work: decided and recorded.
                        tracing::info!(tool = %referral.tool, "tools/call sent as a notification: decided and recorded, not answered");
                    }
                    let answer = refer(referral, token);
                    let (answers, in_flight) = (answers.clone(), in_flight.clone());
                    tracker.spawn(async move {
                        let answer = answer.await;
                        let Some((key, serial)) = key else {
                            return;
                        };
                        if let Ok(mut m) = in_flight.lock()
                            && m.get(&key).is_some_and(|(s, _)| *s == serial)
                        {
                            m.remove(&key);
                        }
                        if let Some(mut bytes) = answer {
                            bytes.push(b'\n');
                            let _ = answers.send(bytes).await;
                        }
                    });
                }
                Verdict::Ignore(why) => tracing::info!("ignored input: {why}"),
            }
        }
        // End of stdin: rmcp sees the end of its input and the session closes.
        let _ = to_rmcp.shutdown().await;
    });
    let finishing = done.clone();
    let writer = tokio::spawn(async move {
        let mut out = stdout;
        let mut from_rmcp = BufReader::new(from_rmcp);
        let mut line = Vec::new();
        let mut rmcp_open = true;
        let mut answers_open = true;
        let mut finished = false;
        loop {
            let bytes = tokio::select! {
                n = from_rmcp.read_until(b'\n', &mut line), if rmcp_open => match n {
                    Ok(0) | Err(_) => {
                        rmcp_open = false;
                        None
                    }
                    Ok(_) => Some(std::mem::take(&mut line)),
                },
                a = answers_rx.recv(), if answers_open => {
                    answers_open = a.is_some();
                    a
                }
                () = finishing.cancelled(), if !finished => {
                    finished = true;
                    None
                }
                else => return,
            };
            if let Some(bytes) = bytes
                && (out.write_all(&bytes).await.is_err() || out.flush().await.is_err())
            {
                return;
            }
            if !rmcp_open && finished {
                // The session is over and the calls are done: write the answers already
                // queued, then stop.
                while let Ok(bytes) = answers_rx.try_recv() {
                    if out.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
                let _ = out.flush().await;
                return;
            }
        }
    });
    (
        (rmcp_in, rmcp_out),
        Session {
            writer,
            calls,
            done,
        },
    )
}
