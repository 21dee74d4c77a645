//! The shim's stdin and stdout: lines from the client go through the [`crate::guard`] before
//! rmcp sees them; rmcp's output and the guard's answers share one writer, whole lines only.
//!
//! Owns stdout: nothing else in the shim writes to it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;

use crate::guard::{self, Referral, Verdict};

/// Answers a [`Verdict::Refer`]red call: the whole JSON-RPC response for it.
pub type Refer =
    Arc<dyn Fn(Referral) -> Pin<Box<dyn Future<Output = serde_json::Value> + Send>> + Send + Sync>;

/// Bytes buffered between the guard and rmcp, each way.
const PIPE_BYTES: usize = 1 << 20;
/// Guard answers queued to the writer.
const ANSWER_QUEUE: usize = 64;

/// Reads one line (without its newline), bounded: a longer line is consumed and reported by its
/// length instead. `Ok(None)` at end of input.
async fn next_line<R: AsyncRead + Unpin>(
    input: &mut BufReader<R>,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<Result<(), usize>>> {
    buf.clear();
    let mut overflow = 0usize;
    loop {
        let chunk = input.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(if buf.is_empty() && overflow == 0 {
                None
            } else if overflow > 0 {
                Some(Err(overflow))
            } else {
                Some(Ok(()))
            });
        }
        let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        if overflow == 0 && buf.len() + take <= guard::MAX_LINE_BYTES {
            buf.extend_from_slice(&chunk[..take]);
        } else {
            overflow = overflow.max(buf.len()) + take;
            buf.clear();
        }
        input.consume(take + usize::from(done));
        if done {
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
            return Ok(Some(if overflow > 0 { Err(overflow) } else { Ok(()) }));
        }
    }
}

/// Wires stdin and stdout to rmcp through the guard. Returns rmcp's transport ends and the task
/// that owns stdout (await it after the session ends, so everything written is flushed).
///
/// A referred call with an id is answered by `refer` before the next line is read: the kernel
/// refuses such a call before anything runs, and the answers keep the order of the lines. One
/// without an id (a notification) runs on its own task and its answer is dropped.
pub fn guarded<R, W>(
    stdin: R,
    stdout: W,
    refer: Refer,
) -> ((DuplexStream, DuplexStream), tokio::task::JoinHandle<()>)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (mut to_rmcp, rmcp_in) = tokio::io::duplex(PIPE_BYTES);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let (answers, mut answers_rx) = mpsc::channel::<Vec<u8>>(ANSWER_QUEUE);
    tokio::spawn(async move {
        let mut input = BufReader::new(stdin);
        let mut line = Vec::new();
        loop {
            let verdict = match next_line(&mut input, &mut line).await {
                Ok(None) | Err(_) => break,
                Ok(Some(Err(len))) => Verdict::Answer(guard::error(
                    serde_json::Value::Null,
                    guard::INVALID_REQUEST,
                    format!(
                        "message of {len} bytes exceeds the {}-byte limit",
                        guard::MAX_LINE_BYTES
                    ),
                )),
                Ok(Some(Ok(()))) if line.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(Some(Ok(()))) => guard::check_line(&line),
            };
            match verdict {
                Verdict::Pass => {
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
                Verdict::Refer(referral) if referral.id.is_none() => {
                    // Nobody waits for it, and it may run as long as any call: on its own task.
                    tracing::info!(tool = %referral.tool, "tools/call sent as a notification: decided and recorded, not answered");
                    tokio::spawn(refer(referral));
                }
                Verdict::Refer(referral) => {
                    tracing::info!(tool = %referral.tool, "malformed tools/call referred to the kernel");
                    let mut bytes = refer(referral).await.to_string().into_bytes();
                    bytes.push(b'\n');
                    if answers.send(bytes).await.is_err() {
                        break;
                    }
                }
                Verdict::Ignore(why) => tracing::info!("ignored input: {why}"),
            }
        }
        // End of stdin: rmcp sees the end of its input and the session closes.
        let _ = to_rmcp.shutdown().await;
    });
    let writer = tokio::spawn(async move {
        let mut out = stdout;
        let mut from_rmcp = BufReader::new(from_rmcp);
        let mut line = Vec::new();
        let mut rmcp_open = true;
        let mut answers_open = true;
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
                else => return,
            };
            if let Some(bytes) = bytes
                && (out.write_all(&bytes).await.is_err() || out.flush().await.is_err())
            {
                return;
            }
            if !rmcp_open {
                // The session is over: flush the answers already queued, then stop.
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
    ((rmcp_in, rmcp_out), writer)
}
