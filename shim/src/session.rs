//! The session: the one loop between the transport and the handlers. It waits on three things,
//! a line from stdin, a call's answer and the end of the broker link (and on rmcp's end), and
//! owns the table of calls in flight.
//!
//! Every stdin line is checked by the [`guard`] first. A `tools/call` is taken here, whatever its
//! shape: it runs on its own task ([`call`], then [`render`]), so a slow call holds up nothing
//! else, and its answer comes back to this loop to go to stdout; one without an id (a
//! notification) is decided and recorded but its answer is dropped. A `notifications/cancelled`
//! naming a call in flight fires that call's token, and goes on to rmcp like every other line the
//! guard passes ([`server`] answers `initialize` and `tools/list`). Malformed JSON-RPC gets the
//! guard's answer.
//!
//! The route of a call: `stdio` → `guard` → `session` → `call` → `link` → … → `call` →
//! `render` → `session` → the `stdio` writer.

use crate::error::ShimError;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sharedos_proto::alias::PortableNames;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::task::{JoinError, JoinSet};

use crate::guard::{self, Referral, Verdict};
use crate::link::{Link, LinkDown, Welcome};
use crate::stdio::{self, Read};
use crate::{call, render, server};

/// The token that cancels a call, as [`Calls::answer`] gets it.
pub use tokio_util::sync::CancellationToken;

/// How long calls still in flight when the client closes stdin may run on before the shim exits
/// (then the broker records them as cancelled: the shim went away).
const CALL_GRACE: Duration = Duration::from_secs(5);

/// How long the writer may take to put everything answered on stdout once the session is over.
const WRITER_GRACE: Duration = Duration::from_secs(2);

/// Bytes buffered between the session and rmcp, each way.
const PIPE_BYTES: usize = 1 << 20;

/// How the shim's session ended.
pub enum End {
    ClientClosed,
    TurnEnded(String),
    Error(ShimError),
}

/// Answers a referred call: the whole JSON-RPC response for it, one line without its newline,
/// or `None` when nothing is to be answered (the client cancelled the call: `cancel` fired).
/// Each answer runs on its own task.
pub trait Calls: Send + 'static {
    fn answer(
        &self,
        referral: Referral,
        cancel: CancellationToken,
    ) -> impl Future<Output = Option<Vec<u8>>> + Send + 'static;

    /// Where the calls may put notifications for the client (whole lines, newline included):
    /// the session's stdout queue, given once before the first call.
    fn notify_to(&mut self, _out: &tokio::sync::mpsc::Sender<Vec<u8>>) {}

    /// Tells the broker of stdin lines that were not JSON at all (the last one's size and
    /// SHA-256, and how many since the last report), to be recorded; never waits.
    fn malformed(&self, _bytes: u64, _sha256: String, _count: u64) {}
    /// A response from the client to one of the shim's own requests (a question to the
    /// person); `false` when no question waits for it.
    fn response(&self, _message: Value) -> bool {
        false
    }
}

/// Lines on stdin that are not JSON at all are reported to the broker at most once per this
/// interval (the ones between are counted into the next report).
pub const MALFORMED_REPORT_INTERVAL: Duration = Duration::from_secs(1);

impl<F, A> Calls for F
where
    F: Fn(Referral, CancellationToken) -> A + Send + 'static,
    A: Future<Output = Option<Vec<u8>>> + Send + 'static,
{
    fn answer(
        &self,
        referral: Referral,
        cancel: CancellationToken,
    ) -> impl Future<Output = Option<Vec<u8>>> + Send + 'static {
        self(referral, cancel)
    }
}

/// The shim's calls: forwarded to the broker ([`call`]), answered in the wire shape of the
/// call's protocol ([`render`]).
struct Forward {
    caller: call::Caller,
    protocol: server::Negotiated,
    asker: Arc<crate::ask::Asker>,
}

impl Calls for Forward {
    fn notify_to(&mut self, out: &tokio::sync::mpsc::Sender<Vec<u8>>) {
        self.caller.set_notes(out);
    }

    fn malformed(&self, bytes: u64, sha256: String, count: u64) {
        let caller = self.caller.clone();
        tokio::spawn(async move { caller.malformed(bytes, sha256, count).await });
    }

    fn response(&self, message: Value) -> bool {
        self.asker.response(message)
    }

    fn answer(
        &self,
        referral: Referral,
        cancel: CancellationToken,
    ) -> impl Future<Output = Option<Vec<u8>>> + Send + 'static {
        let (caller, protocol) = (self.caller.clone(), self.protocol.clone());
        async move {
            let id = referral.id.clone().unwrap_or(Value::Null);
            let stated = referral.protocol.clone();
            // A retry that answers a question the shim asked takes up the held call; any
            // other call (a retry that names no question of it included) goes to the broker.
            // The call's future is boxed: inline, every layer below kept its own copy of the
            // call it was handed, and this future came to 3,376 bytes, moved whole several
            // times a call (see the spawn below); boxed, 1,104.
            let reply = match caller.resume(&referral, &cancel).await {
                Some(reply) => reply?,
                None => Box::pin(caller.call(referral, &cancel)).await?,
            };
            let current = protocol.is_current(stated.as_deref());
            Some(match reply {
                call::Reply::Answer(answer) => render::response(id, &answer, current),
                call::Reply::InputRequired(result) => {
                    serde_json::json!({"jsonrpc": "2.0", "id": id, "result": result})
                        .to_string()
                        .into_bytes()
                }
            })
        }
    }
}

/// One shim's session: the turn's MCP handler and its calls.
pub struct Session {
    link: Arc<Link>,
    handler: server::Shim,
    calls: Forward,
}

impl Session {
    /// The session for a turn. Fails when portable names were asked for and would collide.
    pub fn new(link: Arc<Link>, welcome: &Welcome) -> Result<Self, ShimError> {
        let portable = if welcome.portable_names {
            let map = PortableNames::new(welcome.tools.iter().map(|t| &t.name))?;
            Some(Arc::new(map))
        } else {
            None
        };
        let protocol = server::Negotiated::default();
        let asker = Arc::new(crate::ask::Asker::default());
        let handler = server::Shim::new(
            link.clone(),
            welcome,
            portable.as_deref(),
            protocol.clone(),
            asker.can.clone(),
        );
        Ok(Self {
            calls: Forward {
                caller: call::Caller::new(link.clone(), portable, asker.clone(), protocol.clone()),
                protocol,
                asker,
            },
            link,
            handler,
        })
    }

    /// Serves MCP on stdin/stdout until the client leaves or the turn ends.
    pub async fn serve(self) -> End {
        // rmcp's stdio pipes: faster than tokio's, and their reads can be cancelled, so the
        // process can exit while the client is still connected (turn closed, broker gone).
        let (stdin, stdout) = rmcp::transport::stdio_pipes();
        let Self {
            link,
            handler,
            calls,
        } = self;
        let ended = link.ended.clone().cancelled_owned();
        let ct = link.ended.child_token();
        run(
            stdin,
            stdout,
            calls,
            ended,
            move |transport| serve_rmcp(handler, transport, ct, link),
            CALL_GRACE,
        )
        .await
    }
}

/// rmcp's session on its transport ends, until the client leaves or `ct` fires.
async fn serve_rmcp(
    shim: server::Shim,
    transport: (DuplexStream, DuplexStream),
    ct: CancellationToken,
    link: Arc<Link>,
) -> End {
    use rmcp::ServiceExt;
    let service = match shim.serve_with_ct(transport, ct).await {
        Ok(s) => s,
        Err(e) => {
            if let Some(why) = link.end_reason.lock().ok().and_then(|r| r.clone()) {
                return end_of(why);
            }
            return End::Error(ShimError::SessionStart(Box::new(e)));
        }
    };
    let quit = service.waiting().await;
    if let Some(why) = link.end_reason.lock().ok().and_then(|r| r.clone()) {
        return end_of(why);
    }
    match quit {
        Ok(_) => End::ClientClosed,
        Err(e) => End::Error(ShimError::Session(e)),
    }
}

fn end_of(why: LinkDown) -> End {
    match why {
        LinkDown::TurnClosed(r) | LinkDown::BrokerGone(r) => End::TurnEnded(r),
        LinkDown::NoAnswer(waited) => End::TurnEnded(format!(
            "no answer from the broker within {} s",
            waited.as_secs_f64()
        )),
    }
}

/// A call's task is over.
struct Done {
    /// Its key in the in-flight table; `None` for a call sent as a notification.
    key: Option<(String, u64)>,
    answer: Option<Vec<u8>>,
}

/// What the loop woke up for.
enum Event<T> {
    Stdin(std::io::Result<Option<Read>>),
    Answered(Result<Done, JoinError>),
    LinkEnded,
    RmcpEnded(Result<T, JoinError>),
    GraceOver,
}

/// Runs a session on `stdin` and `stdout`: rmcp (`rmcp`, given its transport ends and run on its
/// own task) gets every line the guard passes, `calls` answers every `tools/call`. Reads stdin
/// until it ends, `ended` fires (the broker link is over) or rmcp ends; then waits up to `grace`
/// for the calls still in flight, and for the writer to put every answer on stdout. A call still
/// running after `grace` is left unanswered (the broker records it as cancelled when the shim
/// goes away). Returns what rmcp's task returned.
pub async fn run<R, W, C, E, F, T>(
    stdin: R,
    stdout: W,
    mut calls: C,
    ended: E,
    rmcp: F,
    grace: Duration,
) -> T::Output
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
    C: Calls,
    E: Future<Output = ()>,
    F: FnOnce((DuplexStream, DuplexStream)) -> T,
    T: Future + Send + 'static,
    T::Output: Send + 'static,
{
    let (mut to_rmcp, rmcp_in) = tokio::io::duplex(PIPE_BYTES);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let (out, writer) = stdio::writer(stdout, from_rmcp);
    calls.notify_to(&out);
    let mut rmcp = tokio::spawn(rmcp((rmcp_in, rmcp_out)));
    let mut rmcp_end = None;

    let mut lines = stdio::Lines::new(stdin);
    // Calls in flight by request id (its JSON text, so `7` and `"7"` stay apart), each with a
    // serial so that a finished call does not remove a later one that reused its id.
    let mut in_flight: HashMap<String, (u64, CancellationToken)> = HashMap::new();
    let mut serial = 0u64;
    // Unparsable lines not yet reported, the last one's size and SHA-256, the last report.
    let mut malformed: (u64, u64, String) = (0, 0, String::new());
    let mut malformed_last: Option<std::time::Instant> = None;
    let mut tasks = JoinSet::new();
    let mut reading = true;
    let mut link_open = true;
    let mut ended = std::pin::pin!(ended);
    // Armed when the session stops reading: how long the calls in flight may still run.
    let mut grace_over = std::pin::pin!(tokio::time::sleep(grace));

    loop {
        if !reading && tasks.is_empty() {
            break;
        }
        let event = tokio::select! {
            r = lines.next(), if reading => Event::Stdin(r),
            Some(done) = tasks.join_next(), if !tasks.is_empty() => Event::Answered(done),
            () = &mut ended, if reading && link_open => Event::LinkEnded,
            r = &mut rmcp, if rmcp_end.is_none() => Event::RmcpEnded(r),
            () = &mut grace_over, if !reading => Event::GraceOver,
        };
        let go_on = match event {
            Event::Stdin(Ok(Some(read))) => {
                let verdict = match read {
                    Read::Oversize(o) => {
                        let (len, prefix, sha) = o.parts();
                        guard::check_oversize(len, &prefix, &sha)
                    }
                    Read::Line if lines.line().iter().all(u8::is_ascii_whitespace) => continue,
                    Read::Line => guard::check_line(lines.line()),
                };
                match verdict {
                    Verdict::Pass => pass(&mut to_rmcp, lines.terminated()).await,
                    // A cancellation fires the referred call's token, then goes on to rmcp like
                    // any line it passes (the id may name one of rmcp's requests).
                    Verdict::Cancel(id) => {
                        if let Some((_, token)) = in_flight.remove(&id.to_string()) {
                            tracing::debug!(%id, "call cancelled by the client");
                            token.cancel();
                        }
                        pass(&mut to_rmcp, lines.terminated()).await
                    }
                    Verdict::Answer(v) => {
                        tracing::info!(answer = %v, "malformed input answered by the shim");
                        if v["error"]["code"] == guard::PARSE_ERROR {
                            use sha2::Digest as _;
                            let line = lines.line();
                            malformed = (
                                malformed.0 + 1,
                                line.len() as u64,
                                sharedos_proto::catalog::hex(&sha2::Sha256::digest(line)),
                            );
                            if malformed_last
                                .is_none_or(|l| l.elapsed() >= MALFORMED_REPORT_INTERVAL)
                            {
                                let (n, bytes, sha) = std::mem::take(&mut malformed);
                                calls.malformed(bytes, sha, n);
                                malformed_last = Some(std::time::Instant::now());
                            }
                        }
                        let mut bytes = v.to_string().into_bytes();
                        bytes.push(b'\n');
                        out.send(bytes).await.is_ok()
                    }
                    Verdict::Refer(referral) => {
                        let token = CancellationToken::new();
                        let key = referral.id.as_ref().map(|id| {
                            serial += 1;
                            in_flight.insert(id.to_string(), (serial, token.clone()));
                            (id.to_string(), serial)
                        });
                        if key.is_none() {
                            // JSON-RPC forbids an answer, not the work: decided and recorded.
                            tracing::info!(tool = %referral.tool, "tools/call sent as a notification: decided and recorded, not answered");
                        }
                        let answer = calls.answer(referral, token);
                        // Boxed: tokio moves a spawned future by value into its task cell and
                        // moves its stage again when it ends, byte by byte at opt-level "z";
                        // the task now holds a pointer. Shim instructions per call under
                        // callgrind (bench/cpu-probe.py, 8 callers): 177,800 before the two
                        // boxes, 114,529 after (bench/NOTES.md).
                        tasks.spawn(Box::pin(async move {
                            Done {
                                key,
                                answer: answer.await,
                            }
                        }));
                        true
                    }
                    Verdict::Ignore(why) => {
                        tracing::info!("ignored input: {why}");
                        true
                    }
                    Verdict::Response(message) => {
                        if !calls.response(message) {
                            tracing::info!(
                                "ignored input: a response to no question the shim asked (or one already answered)"
                            );
                        }
                        true
                    }
                }
            }
            // End of stdin: rmcp sees the end of its input and its session closes.
            Event::Stdin(Ok(None) | Err(_)) => false,
            Event::Answered(Ok(Done { key, answer })) => {
                if let Some((key, serial)) = key {
                    if in_flight.get(&key).is_some_and(|(s, _)| *s == serial) {
                        in_flight.remove(&key);
                    }
                    if let Some(mut bytes) = answer {
                        bytes.push(b'\n');
                        let _ = out.send(bytes).await;
                    }
                }
                continue;
            }
            // A call's task that panicked answers nothing.
            Event::Answered(Err(_)) => continue,
            // The link has answered every call in flight; rmcp's session is cancelled.
            Event::LinkEnded => {
                link_open = false;
                reading = false;
                grace_over
                    .as_mut()
                    .reset(tokio::time::Instant::now() + grace);
                continue;
            }
            Event::RmcpEnded(r) => {
                rmcp_end = Some(r);
                true
            }
            Event::GraceOver => {
                tracing::warn!(
                    calls = tasks.len(),
                    "calls still in flight at exit are left unanswered"
                );
                break;
            }
        };
        if !go_on && reading {
            reading = false;
            grace_over
                .as_mut()
                .reset(tokio::time::Instant::now() + grace);
            let _ = to_rmcp.shutdown().await;
        }
        if rmcp_end.is_some() && reading {
            reading = false;
            grace_over
                .as_mut()
                .reset(tokio::time::Instant::now() + grace);
        }
    }
    // Calls still running are left to run on until the process exits.
    tasks.detach_all();
    drop(to_rmcp);
    let end = match rmcp_end {
        Some(end) => end,
        None => rmcp.await,
    };
    // Everything answered reaches stdout before the session returns.
    drop(out);
    let _ = tokio::time::timeout(WRITER_GRACE, writer).await;
    match end {
        Ok(end) => end,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Hands a line (newline included) to rmcp; `false` once rmcp no longer reads.
async fn pass(to_rmcp: &mut DuplexStream, line: &[u8]) -> bool {
    to_rmcp.write_all(line).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

    /// The loop on its own, with a fake kernel and a fake rmcp (as the fuzz target drives it):
    /// calls are answered by the kernel, other lines reach rmcp and its replies stdout, malformed
    /// lines get the guard's answer, and everything is on stdout when the session returns.
    #[tokio::test(flavor = "current_thread")]
    async fn one_loop_routes_every_line() {
        let (mut client_in, shim_in) = tokio::io::duplex(64 * 1024);
        let (shim_out, mut client_out) = tokio::io::duplex(64 * 1024);
        client_in
            .write_all(
                concat!(
                    r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
                    "\r\n\n   \n",
                    r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"files.read","arguments":{}}}"#,
                    "\n{oops\n",
                    r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"files.read"}}"#,
                    "\n",
                )
                .as_bytes(),
            )
            .await
            .expect("write stdin");
        drop(client_in);
        let fake_rmcp = |(rmcp_in, mut rmcp_out): (DuplexStream, DuplexStream)| async move {
            let mut input = BufReader::new(rmcp_in);
            let mut passed = Vec::new();
            let mut line = Vec::new();
            while input.read_until(b'\n', &mut line).await.expect("read") > 0 {
                rmcp_out
                    .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n")
                    .await
                    .expect("write");
                passed.push(std::mem::take(&mut line));
            }
            passed
        };
        let passed = run(
            shim_in,
            shim_out,
            |r: Referral, _cancel: CancellationToken| async move {
                tokio::task::yield_now().await;
                Some(
                    serde_json::json!({"jsonrpc": "2.0", "id": r.id, "result": {"referred": r.tool}})
                        .to_string()
                        .into_bytes(),
                )
            },
            std::future::pending::<()>(),
            fake_rmcp,
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(
            passed,
            vec![b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\"}\n".to_vec()]
        );
        let mut out = String::new();
        client_out.read_to_string(&mut out).await.expect("stdout");
        let mut lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        lines.sort_by_key(|v| v["id"].to_string());
        assert_eq!(lines.len(), 3, "{out}");
        assert_eq!(lines[0]["result"], serde_json::json!({}));
        assert_eq!(lines[1]["result"]["referred"], "files.read");
        assert_eq!(lines[2]["error"]["code"], guard::PARSE_ERROR);
    }
}
