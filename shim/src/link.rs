//! The bridge connection to the broker: hello with the token, then calls out and answers in.
//!
//! Owns the pending-call table. When the turn closes or the broker goes away, every pending
//! call is answered (never left hanging) and `ended` fires so the MCP side stops.

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use interprocess::local_socket::traits::StreamCommon as _;
use sharedos_ipc::{Conn, FrameReader, write_encoded, write_frame};
use sharedos_proto::ToolCall;
use sharedos_proto::ipc::{
    BridgeEvent, BridgeRequest, CallAnswer, PROTOCOL_VERSION, PrincipalAnswer, Question, ShimInfo,
    TurnToken,
};
use sharedos_proto::{CatalogHash, PublishedToolDefinition};
use tokio::io::WriteHalf;
use tokio::sync::oneshot;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

use crate::error::ShimError;
use crate::trust;

/// The question carried a link of the person's page (URL mode): the person decides there, and
/// the shim sends the broker no answer.
pub const VIA_PAGE: &str = "page";

/// How long the shim waits for the broker to accept and answer hello.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What the broker gave this shim.
pub struct Welcome {
    pub turn: String,
    pub catalog_hash: CatalogHash,
    pub tools: Vec<PublishedToolDefinition>,
    /// The turn asked for portable names.
    pub portable_names: bool,
}

/// How long a call waits for its answer when the broker names no deadline.
const DEFAULT_ANSWER_DEADLINE: Duration = Duration::from_secs(300);

/// Why a pending call got no answer from the broker.
#[derive(Debug, Clone)]
pub enum LinkDown {
    TurnClosed(String),
    BrokerGone(String),
    /// No answer within the deadline the broker gave (the answer was lost, or the broker hangs).
    NoAnswer(Duration),
}

/// A call the broker holds for a person's approval.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    /// The approval id (`sharedos-broker approvals approve ID`).
    pub approval: String,
    pub expires_at: String,
    /// The longest the broker waits for the person: the shim waits that much longer.
    pub timeout: Duration,
}

/// The longest a broker may ask the shim to wait for a person (its `approval_timeout_seconds`
/// is at most a turn's longest life, 7 days).
const MAX_WAIT: Duration = Duration::from_secs(8 * 24 * 3600);

/// How often a client that asked for progress hears that its call is still waiting.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// A question to the person in flight, with its approval id.
type Asking = Pin<Box<dyn std::future::Future<Output = (String, Answer)> + Send>>;

/// The person's answer to the question in flight; never, without one.
async fn asked(asking: &mut Option<Asking>) -> (String, Answer) {
    match asking {
        Some(a) => a.as_mut().await,
        None => std::future::pending().await,
    }
}

/// The progress timer's next tick; never, without one.
async fn next_tick(tick: &mut Option<Pin<Box<Sleep>>>) {
    match tick {
        Some(t) => t.as_mut().await,
        None => std::future::pending().await,
    }
}

/// What a pending call hears from the reader: its answer, or that it waits for a person (and
/// where its answer will come instead).
enum Reply {
    Answer(CallAnswer),
    Waiting(Waiting, oneshot::Receiver<Result<Reply, LinkDown>>),
    /// The broker asks the call's principal (`approval`, `question`).
    Ask(
        String,
        Box<Question>,
        oneshot::Receiver<Result<Reply, LinkDown>>,
    ),
    /// A brokered server asks the call's person (`relay`, `provider`, `request`, and whether
    /// it is the broker's own sign-in question).
    Relay(
        u64,
        String,
        serde_json::Value,
        bool,
        oneshot::Receiver<Result<Reply, LinkDown>>,
    ),
}

/// The person's answer to a question, or why there is none, and how they were asked
/// (`elicitation/create` or `input_required`; `None` when they were not).
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub answer: PrincipalAnswer,
    pub reason: Option<String>,
    pub via: Option<&'static str>,
}

impl Answer {
    /// The client cannot be asked, and why.
    pub fn unable(why: impl Into<String>) -> Self {
        Self {
            answer: PrincipalAnswer::Unable,
            reason: Some(why.into()),
            via: None,
        }
    }
}

/// Puts a brokered server's question (its provider, its `elicitation/create` params) to the
/// person; resolves with the client's result or why not (the session's
/// [`crate::ask::Asker::relay`]).
pub type RelayFn<'a> = &'a (
        dyn Fn(
    String,
    serde_json::Value,
    bool,
) -> Pin<
    Box<dyn std::future::Future<Output = Result<serde_json::Value, String>> + Send>,
> + Sync
    );

/// A brokered server's question in flight, with its relay serial.
type Relaying =
    Pin<Box<dyn std::future::Future<Output = (u64, Result<serde_json::Value, String>)> + Send>>;

/// The answer to the question in flight; never, without one.
async fn relayed(relaying: &mut Option<Relaying>) -> (u64, Result<serde_json::Value, String>) {
    match relaying {
        Some(r) => r.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Asks the person a question (the session's [`crate::ask::Asker`]).
pub type AskFn<'a> =
    &'a (dyn Fn(Question) -> Pin<Box<dyn std::future::Future<Output = Answer> + Send>> + Sync);

/// Where the reader tells a call what it heard of it.
type ToCall = oneshot::Sender<Result<Reply, LinkDown>>;
/// Where a call hears it.
type FromReader = oneshot::Receiver<Result<Reply, LinkDown>>;

type Pending = Arc<Mutex<HashMap<u64, ToCall>>>;

/// Call `id`'s place for what the reader hears of it, handed on: the sender to tell it now, and
/// the receiver its next news (its answer, or a question) will come on. `None` when the call is
/// no longer waiting.
fn hand_on(pending: &Pending, id: u64) -> Option<(ToCall, FromReader)> {
    let (next, later) = oneshot::channel();
    let mut m = pending.lock().ok()?;
    let tx = m.remove(&id)?;
    m.insert(id, next);
    Some((tx, later))
}

pub struct Link {
    /// The write half; each caller writes its own frame under the lock. `None` once the link
    /// has ended or a write failed.
    out: tokio::sync::Mutex<Option<WriteHalf<Conn>>>,
    pending: Pending,
    next_id: AtomicU64,
    /// Fires when the link is over (turn closed or broker gone); holds why.
    pub ended: CancellationToken,
    pub end_reason: Arc<Mutex<Option<LinkDown>>>,
    /// How long one call waits for its answer.
    deadline: Duration,
}

impl Link {
    /// Connects to `socket` and, once [`trust::check`] finds that its listener runs as the
    /// broker's uid (`broker_uid` when given), says hello with `token`.
    pub async fn connect(
        socket: &Path,
        token: String,
        broker_uid: Option<u32>,
    ) -> Result<(Arc<Link>, Welcome), ShimError> {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, sharedos_ipc::connect(socket))
            .await
            .map_err(|_| ShimError::ConnectTimeout {
                socket: socket.to_path_buf(),
            })?
            .map_err(|source| ShimError::Connect {
                socket: socket.to_path_buf(),
                source,
            })?;
        // Nothing is written before this: a listener of another uid gets no byte.
        let peer = stream.peer_creds().ok().and_then(|c| c.euid());
        trust::check(
            socket,
            peer,
            broker_uid,
            sharedos_ipc::runtime::current_uid(),
        )?;
        let stream = Conn::new(stream).map_err(ShimError::Setup)?;
        let (recv, mut send) = tokio::io::split(stream);
        let mut reader = FrameReader::new(recv);
        let hello = BridgeRequest::Hello {
            protocol: PROTOCOL_VERSION,
            token: TurnToken::new(token),
            client: ShimInfo {
                pid: Some(std::process::id()),
                shim_version: Some(env!("CARGO_PKG_VERSION").into()),
            },
        };
        write_frame(&mut send, &hello)
            .await
            .map_err(ShimError::Hello)?;
        let first = tokio::time::timeout(CONNECT_TIMEOUT, reader.next::<BridgeEvent>())
            .await
            .map_err(|_| ShimError::HelloTimeout)?
            .map_err(ShimError::Closed)?;
        let deadline;
        let welcome = match first {
            BridgeEvent::Welcome {
                protocol,
                turn,
                catalog_hash,
                tools,
                portable_names,
                answer_deadline_ms,
                ..
            } if protocol == PROTOCOL_VERSION => {
                deadline =
                    answer_deadline_ms.map_or(DEFAULT_ANSWER_DEADLINE, Duration::from_millis);
                Welcome {
                    turn,
                    catalog_hash,
                    // Freshly decoded: each Arc is the only one, so this moves, not copies.
                    tools: tools.into_iter().map(Arc::unwrap_or_clone).collect(),
                    portable_names,
                }
            }
            BridgeEvent::Welcome { protocol, .. } => {
                return Err(ShimError::Protocol { broker: protocol });
            }
            BridgeEvent::Refused { code, message } => {
                return Err(ShimError::Refused { code, message });
            }
            other => return Err(ShimError::Unexpected(Box::new(other))),
        };
        let link = Arc::new(Link {
            out: tokio::sync::Mutex::new(Some(send)),
            pending: Arc::default(),
            next_id: AtomicU64::new(1),
            ended: CancellationToken::new(),
            end_reason: Arc::default(),
            deadline,
        });
        // Reader: answers and the turn's end.
        let l = link.clone();
        tokio::spawn(async move {
            let why = loop {
                match reader.next::<BridgeEvent>().await {
                    Ok(BridgeEvent::Answer { id, answer }) => {
                        let tx = l.pending.lock().ok().and_then(|mut m| m.remove(&id));
                        if let Some(tx) = tx {
                            let _ = tx.send(Ok(Reply::Answer(answer)));
                        }
                    }
                    // The call's answer will come later: it goes to a new place, and the call
                    // hears where.
                    Ok(BridgeEvent::Waiting {
                        id,
                        approval,
                        expires_at,
                        timeout_ms,
                    }) => {
                        if let Some((tx, later)) = hand_on(&l.pending, id) {
                            let waiting = Waiting {
                                approval,
                                expires_at,
                                timeout: Duration::from_millis(timeout_ms),
                            };
                            let _ = tx.send(Ok(Reply::Waiting(waiting, later)));
                        }
                    }
                    Ok(BridgeEvent::Ask {
                        id,
                        approval,
                        question,
                    }) => {
                        if let Some((tx, later)) = hand_on(&l.pending, id) {
                            let _ = tx.send(Ok(Reply::Ask(approval, Box::new(question), later)));
                        }
                    }
                    // A brokered server's question for the person behind call `id`: the call
                    // asks it (in the form its protocol has); a call no longer here cannot.
                    Ok(BridgeEvent::Relay {
                        id,
                        relay,
                        provider,
                        request,
                        sign_in,
                    }) => match hand_on(&l.pending, id) {
                        Some((tx, later)) => {
                            let _ =
                                tx.send(Ok(Reply::Relay(relay, provider, request, sign_in, later)));
                        }
                        None => {
                            let l = l.clone();
                            tokio::spawn(async move {
                                let error = Some("the call it belongs to has ended".to_owned());
                                let _ = l
                                    .send(&BridgeRequest::Relayed {
                                        relay,
                                        result: None,
                                        error,
                                    })
                                    .await;
                            });
                        }
                    },
                    Ok(BridgeEvent::DecideRefused { approval, message }) => {
                        tracing::warn!(%approval, %message, "the broker refused an answer");
                    }
                    Ok(BridgeEvent::TurnClosed { reason }) => {
                        break LinkDown::TurnClosed(format!("the turn closed ({reason})"));
                    }
                    Ok(other) => tracing::warn!(?other, "unexpected frame from the broker"),
                    Err(e) => {
                        break LinkDown::BrokerGone(format!(
                            "the connection to the SharedOS broker ended: {e}"
                        ));
                    }
                }
            };
            l.finish(why);
        });
        Ok((link, welcome))
    }

    /// Writes one frame to the broker. `false` if the link is closed or the write failed.
    async fn send(&self, msg: &BridgeRequest) -> bool {
        let Ok(bytes) = sharedos_proto::frame::encode(msg) else {
            tracing::error!("a bridge frame does not encode");
            return false;
        };
        if self.ended.is_cancelled() {
            return false;
        }
        let mut out = self.out.lock().await;
        let Some(send) = out.as_mut() else {
            return false;
        };
        if write_encoded(send, &bytes).await.is_err() {
            *out = None;
            return false;
        }
        true
    }

    /// Ends the link: answers every pending call with `why` and fires `ended`.
    fn finish(&self, why: LinkDown) {
        if let Ok(mut r) = self.end_reason.lock() {
            r.get_or_insert(why.clone());
        }
        let pending: Vec<_> = self
            .pending
            .lock()
            .map(|mut m| m.drain().collect())
            .unwrap_or_default();
        for (_, tx) in pending {
            let _ = tx.send(Err(why.clone()));
        }
        self.ended.cancel();
    }

    /// Forwards one call; resolves with the broker's answer, or why there is none.
    /// Cancelling `cancel` sends a cancel frame and resolves `None`. While the broker holds the
    /// call for a person's approval, `progress` is told so at once and every
    /// [`PROGRESS_EVERY`] (with a count from 1), and the answer is awaited that much longer.
    pub async fn call(
        &self,
        call: ToolCall,
        cancel: &CancellationToken,
        progress: &mut (dyn FnMut(&Waiting, u64) + Send),
        ask: AskFn<'_>,
        relay: RelayFn<'_>,
    ) -> Option<Result<CallAnswer, LinkDown>> {
        if let Some(why) = self.end_reason.lock().ok().and_then(|r| r.clone()) {
            return Some(Err(why));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        if let Ok(mut m) = self.pending.lock() {
            m.insert(id, tx);
        }
        if !self.send(&BridgeRequest::Call { id, call }).await {
            self.finish(LinkDown::BrokerGone(
                "the connection to the SharedOS broker is closed".into(),
            ));
        }
        let mut deadline = self.deadline;
        let no_answer = tokio::time::sleep(deadline);
        tokio::pin!(no_answer);
        // Made only once the call waits for a person: an ordinary call sets up one timer.
        let mut waiting: Option<(Waiting, u64)> = None;
        let mut tick: Option<Pin<Box<Sleep>>> = None;
        // The question to the person in flight, with its approval id; dropped (and withdrawn
        // from the client) when the answer comes first.
        let mut asking: Option<Asking> = None;
        // A brokered server's question in flight (one at a time).
        let mut relaying: Option<Relaying> = None;
        loop {
            tokio::select! {
                // An answer (or the link's end) wins over a cancellation that arrives with it: the
                // call gets its answer rather than nothing.
                biased;
                r = &mut rx => match r {
                    Ok(Ok(Reply::Answer(answer))) => return Some(Ok(answer)),
                    Ok(Ok(Reply::Waiting(w, later))) => {
                        rx = later;
                        deadline = w.timeout.min(MAX_WAIT).saturating_add(self.deadline);
                        no_answer.as_mut().reset(tokio::time::Instant::now() + deadline);
                        progress(&w, 1);
                        tick = Some(Box::pin(tokio::time::sleep(PROGRESS_EVERY)));
                        waiting = Some((w, 1));
                    }
                    Ok(Ok(Reply::Ask(approval, question, later))) => {
                        rx = later;
                        let answer = ask(*question);
                        asking = Some(Box::pin(async move { (approval, answer.await) }));
                    }
                    Ok(Ok(Reply::Relay(serial, provider, request, sign_in, later))) => {
                        rx = later;
                        if relaying.is_some() {
                            let error = Some("the person is already being asked another question of this call".to_owned());
                            let _ = self.send(&BridgeRequest::Relayed { relay: serial, result: None, error }).await;
                        } else {
                            let answer = relay(provider, request, sign_in);
                            relaying = Some(Box::pin(async move { (serial, answer.await) }));
                        }
                    }
                    Ok(Err(why)) => return Some(Err(why)),
                    Err(_) => return Some(Err(LinkDown::BrokerGone("the broker link dropped the call".into()))),
                },
                (serial, answer) = relayed(&mut relaying), if relaying.is_some() => {
                    relaying = None;
                    let (result, error) = match answer {
                        Ok(r) => (Some(r), None),
                        Err(e) => (None, Some(e)),
                    };
                    let _ = self.send(&BridgeRequest::Relayed { relay: serial, result, error }).await;
                }
                (approval, Answer { answer, reason, via }) = asked(&mut asking), if asking.is_some() => {
                    asking = None;
                    // A question of the person's page is decided there: no answer goes back.
                    if via != Some(VIA_PAGE) {
                        let via = via.map(str::to_owned);
                        let _ = self.send(&BridgeRequest::Decide { approval, answer, reason, via }).await;
                    }
                }
                _ = self.ended.cancelled() => {
                    let why = self.end_reason.lock().ok().and_then(|r| r.clone());
                    return Some(Err(why.unwrap_or_else(|| LinkDown::BrokerGone("the broker link ended".into()))));
                }
                _ = cancel.cancelled() => {
                    if let Ok(mut m) = self.pending.lock() { m.remove(&id); }
                    let _ = self.send(&BridgeRequest::Cancel { id }).await;
                    return None;
                }
                // A lost answer, or a broker that hangs: the call is answered anyway, and the
                // broker is told to stop it.
                _ = &mut no_answer => {
                    if let Ok(mut m) = self.pending.lock() { m.remove(&id); }
                    let _ = self.send(&BridgeRequest::Cancel { id }).await;
                    return Some(Err(LinkDown::NoAnswer(deadline)));
                }
                _ = next_tick(&mut tick), if waiting.is_some() => {
                    if let Some((w, n)) = waiting.as_mut() {
                        *n += 1;
                        progress(w, *n);
                    }
                    if let Some(t) = tick.as_mut() {
                        t.as_mut().reset(tokio::time::Instant::now() + PROGRESS_EVERY);
                    }
                }
            }
        }
    }

    /// Tells the broker of stdin lines that were not JSON at all (it records them).
    pub async fn malformed(&self, bytes: u64, sha256: String, count: u64) {
        let _ = self
            .send(&BridgeRequest::MalformedFrame {
                bytes,
                sha256,
                count,
            })
            .await;
    }

    /// Tells the broker which MCP client is on the other side (diagnostics only).
    pub async fn client_info(
        &self,
        name: String,
        version: String,
        protocol_version: Option<String>,
        capabilities: Option<serde_json::Value>,
    ) {
        let _ = self
            .send(&BridgeRequest::ClientInfo {
                name,
                version,
                protocol_version,
                capabilities,
            })
            .await;
    }
}
