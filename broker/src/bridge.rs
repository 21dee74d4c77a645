//! One bridge connection: a shim presents a turn token, receives the turn's catalogue, and
//! forwards calls and cancellations.
//!
//! Owns the connection's loop (one `select!` over frames in, the turn's end) and its bounded
//! in-flight set. The shim cannot widen anything: the principal and the catalogue come from the
//! turn the token names, and every call goes through `Kernel::invoke`.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use interprocess::local_socket::tokio::Stream;
use interprocess::local_socket::traits::StreamCommon as _;
use sharedos_ipc::{Conn, FrameReader, IpcError, write_encoded, write_frame};
use sharedos_proto::ipc::{
    BridgeEvent, BridgeRequest, HarnessSession, PROTOCOL_VERSION, PendingApproval, PrincipalAnswer,
    RefusalCode,
};
use sharedos_proto::record;
use sharedos_proto::{CancelCode, ToolCall};
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::evidence::record::rfc3339;
use crate::kernel::{Ask, CallSite};
use crate::state::Broker;
use crate::turn::Turn;

/// How long a new connection has to say hello (a shim sends it at once).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest hello frame: a token and a few client fields. Nothing larger is buffered for a
/// connection that has not said who it is.
pub const HELLO_MAX_BYTES: usize = 4096;
/// Calls in flight per bridge, counted until their answers are written; the reader waits beyond
/// it (backpressure, nothing dropped). It also bounds what a client that never reads can make the
/// broker hold: this many answers, each as its encoded bytes only (with 1 MiB reads, 8 MiB).
pub const MAX_INFLIGHT_PER_BRIDGE: usize = 8;

/// Refused hellos are logged at most once a second (with how many there were): a peer that
/// keeps trying does not fill the log.
fn refused_hello(log: impl FnOnce(u64)) {
    static REFUSED: Mutex<crate::admission::RateLimitedLog> =
        Mutex::new(crate::admission::RateLimitedLog::new());
    REFUSED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .note(log);
}

/// A bridge's unparsable stdin lines not yet on record (see `MalformedFrame`).
#[derive(Default)]
struct Malformed {
    held: u64,
    bytes: u64,
    sha256: String,
    last: Option<std::time::Instant>,
}

impl Malformed {
    fn note(&mut self, broker: &Broker, turn: &str, bytes: u64, sha256: String, count: u64) {
        self.held = self.held.saturating_add(count.max(1));
        self.bytes = bytes;
        // What the shim says is kept to the shape of a SHA-256.
        self.sha256 = if sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            sha256
        } else {
            String::new()
        };
        if self
            .last
            .is_none_or(|l| l.elapsed() >= crate::admission::REFUSAL_RECORD_INTERVAL)
        {
            self.write(broker, turn);
        }
    }

    fn write(&mut self, broker: &Broker, turn: &str) {
        if self.held == 0 {
            return;
        }
        let line = record::Event::MalformedFrame(record::MalformedFrame {
            turn: turn.to_owned(),
            bytes: self.bytes,
            sha256: std::mem::take(&mut self.sha256),
            count: std::mem::take(&mut self.held),
        });
        self.last = Some(std::time::Instant::now());
        if let Err(e) = broker.kernel.recorder.append_written(&line) {
            tracing::error!(%turn, error = %e, "malformed_frame not recorded");
        }
    }
}

/// What a bridge's MCP client said of itself (`client_info`), on record once, and again only
/// when it changes, at most once per `REFUSAL_RECORD_INTERVAL`. Frames without a line of their
/// own are counted into the bridge's next `bridge_client` line (`suppressed`): a change after
/// the interval, a roll-up once the interval is over when more than one is held, or the last
/// one when the bridge ends.
#[derive(Default)]
struct Clients {
    /// The client as the bridge's last line shows it.
    shown: Option<record::ClientInfo>,
    /// The latest frame, not yet on a line, with its cuts.
    latest: Option<(record::ClientInfo, Option<record::Cuts>)>,
    /// Frames since the last line.
    held: u64,
    last: Option<std::time::Instant>,
}

impl Clients {
    fn note(
        &mut self,
        broker: &Broker,
        turn: &Turn,
        client: record::ClientInfo,
        cut: Option<record::Cuts>,
    ) {
        self.held = self.held.saturating_add(1);
        let changed = self.shown.as_ref() != Some(&client);
        self.latest = Some((client, cut));
        let due = self
            .last
            .is_none_or(|l| l.elapsed() >= crate::admission::REFUSAL_RECORD_INTERVAL);
        if due && (changed || self.held > 1) {
            self.write(broker, turn);
        }
    }

    fn write(&mut self, broker: &Broker, turn: &Turn) {
        let Some((client, cut)) = self.latest.take() else {
            return;
        };
        let suppressed = std::mem::take(&mut self.held).saturating_sub(1);
        tracing::info!(turn = %turn.id, name = %client.name, version = %client.version, protocol_version = ?client.protocol_version, suppressed, "MCP client on bridge");
        self.shown = Some(client.clone());
        self.last = Some(std::time::Instant::now());
        let line = record::Event::BridgeClient(record::BridgeClient {
            turn: turn.id.clone(),
            client,
            cut,
            suppressed: (suppressed > 0).then_some(suppressed),
            system_identity: turn.system_identity.clone(),
        });
        if let Err(e) = broker.kernel.recorder.append_written(&line) {
            tracing::error!(turn = %turn.id, error = %e, "bridge_client not recorded");
        }
    }
}

type Reader = FrameReader<tokio::io::ReadHalf<Conn>>;
type Sender = tokio::io::WriteHalf<Conn>;

/// One bridge connection, as its steps: a peer that is not a harness is refused; a harness says
/// hello with a turn token; the turn gives the bridge a place; the shim is welcomed with the
/// turn's catalogue and the bridge recorded; then its frames are served until it or the turn
/// ends, and its place is given back.
pub async fn serve(broker: Arc<Broker>, stream: Stream, pending: crate::admission::PendingHello) {
    let creds = stream.peer_creds().ok();
    let uid = creds.as_ref().and_then(|c| c.euid());
    let pid = creds.as_ref().and_then(|c| c.pid());
    let stream = match Conn::new(stream) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "bridge connection could not be set up");
            return;
        }
    };
    let hang_up = watch_hang_up(&stream);
    let (recv, mut send) = tokio::io::split(stream);
    let mut reader = FrameReader::with_limit(recv, HELLO_MAX_BYTES);
    let gate = pending.gate();
    let refused = |reason: &'static str| gate.refused(reason, uid, pid);
    if !broker.harness_allowed(uid, pid.map(|p| p as u32)) {
        refused(crate::admission::refusal_reason(pid));
        refuse_non_harness(&mut reader, &mut send, &pending, uid).await;
        return;
    }
    let hello = hello(
        &broker,
        &mut reader,
        &mut send,
        &pending,
        &refused,
        (uid, pid),
    )
    .await;
    let Some((turn, client)) = hello else {
        return;
    };
    // Past hello: the connection's place at the gate is given back, and its frames may be as
    // large as the protocol's.
    drop(pending);
    reader.set_limit(sharedos_proto::frame::MAX_FRAME_BYTES);
    if !take_place(&broker, &turn, &mut send, &refused, pid).await {
        return;
    }
    if !welcome(&broker, &turn, &mut send).await {
        turn.bridges.fetch_sub(1, Ordering::Relaxed);
        return;
    }
    record_connected(&broker, &turn, client, record::Peer { pid, uid });
    run_connection(
        broker.clone(),
        turn.clone(),
        reader,
        send,
        hang_up,
        pid.and_then(|p| u32::try_from(p).ok()),
    )
    .await;
    turn.bridges.fetch_sub(1, Ordering::Relaxed);
}

/// Watches for the shim closing its end, even with calls it sent still unread.
fn watch_hang_up(stream: &Conn) -> Option<sharedos_ipc::HangUp> {
    match stream.hang_up_watch() {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(error = %e, "bridge connection cannot be watched for its end: its unread calls are cancelled only once read");
            None
        }
    }
}

/// Tells the shim why it is refused (a write that fails is not an error: it is refused anyway).
async fn tell_refused(send: &mut Sender, code: RefusalCode, message: &str) {
    let _ = write_frame(
        send,
        &BridgeEvent::Refused {
            code,
            message: message.to_owned(),
        },
    )
    .await;
}

/// A peer that is not a harness (its refusal already counted at the gate): logged at a bounded
/// rate; its hello is read first (bounded), so the refusal is not lost to a reset on close.
async fn refuse_non_harness(
    reader: &mut Reader,
    send: &mut Sender,
    pending: &crate::admission::PendingHello,
    uid: Option<u32>,
) {
    refused_hello(|n| {
        tracing::warn!(
            ?uid,
            refused = n,
            "bridge connection from a uid that is not a harness uid: refused"
        );
    });
    tokio::select! {
        _ = tokio::time::timeout(
            pending.within(std::time::Duration::from_secs(1)),
            reader.next::<BridgeRequest>(),
        ) => {}
        () = pending.evicted() => return,
    }
    tell_refused(
        send,
        RefusalCode::BadToken,
        "this uid may not use the bridge socket",
    )
    .await;
}

/// The shim's hello, within the gate's bound: the turn its token names and what the shim says
/// of itself, or `None` once the connection is refused (and told why, unless its place went
/// to a newcomer).
async fn hello(
    broker: &Broker,
    reader: &mut Reader,
    send: &mut Sender,
    pending: &crate::admission::PendingHello,
    refused: &impl Fn(&'static str),
    (uid, pid): (Option<u32>, Option<i32>),
) -> Option<(Arc<Turn>, sharedos_proto::ipc::ShimInfo)> {
    // A newcomer may take this connection's place while it is silent: it is then closed.
    let hello = tokio::select! {
        h = tokio::time::timeout(pending.within(HELLO_TIMEOUT), reader.next::<BridgeRequest>()) => h,
        () = pending.evicted() => {
            refused("cap_reached");
            refused_hello(|n| {
                tracing::info!(?uid, ?pid, closed = n, "bridge connection silent before hello gave its place to another: closed");
            });
            return None;
        }
    };
    match hello {
        Ok(Ok(BridgeRequest::Hello {
            protocol,
            token,
            client,
        })) => {
            let turn = turn_named(broker, send, refused, protocol, &token, pid).await?;
            Some((turn, client))
        }
        Ok(Ok(_)) => {
            refused("not_hello");
            tell_refused(send, RefusalCode::NotHello, "the first frame must be hello").await;
            None
        }
        Ok(Err(e)) => {
            if let Some(reason) = crate::admission::hello_error_reason(&e) {
                refused(reason);
            }
            tracing::info!(error = %e, "bridge connection ended before hello");
            tell_refused(send, RefusalCode::NotHello, &format!("bad hello: {e}")).await;
            None
        }
        Err(_) => {
            refused("hello_too_slow");
            let within = pending.within(HELLO_TIMEOUT).as_millis();
            let msg = format!("no hello within {within} ms");
            tell_refused(send, RefusalCode::NotHello, &msg).await;
            None
        }
    }
}

/// A hello's protocol, then its token: the open turn the token names, or `None` once refused.
async fn turn_named(
    broker: &Broker,
    send: &mut Sender,
    refused: &impl Fn(&'static str),
    protocol: u32,
    token: &sharedos_proto::ipc::TurnToken,
    pid: Option<i32>,
) -> Option<Arc<Turn>> {
    if protocol != PROTOCOL_VERSION {
        refused("protocol_version");
        let msg = format!(
            "protocol version {protocol} is not supported; this broker speaks {PROTOCOL_VERSION}"
        );
        tell_refused(send, RefusalCode::ProtocolVersion, &msg).await;
        return None;
    }
    if let Some(turn) = broker.turns.by_token(token.expose()) {
        return Some(turn);
    }
    refused("bad_token");
    let msg = "the turn token is unknown, expired or closed";
    tell_refused(send, RefusalCode::BadToken, msg).await;
    refused_hello(|n| {
        tracing::info!(
            ?pid,
            refused = n,
            "bridge hello with an unknown or closed token: refused"
        );
    });
    None
}

/// The turn's place for this bridge: one token holds a bounded number of bridges, and makes a
/// bounded number of connections over time (a loop of connections is refused and counted on
/// `bridge_refused`, not recorded one line each). `true`: the bridge counts on the turn until
/// its caller gives the place back; `false`: refused, the shim told why, no place held.
async fn take_place(
    broker: &Broker,
    turn: &Turn,
    send: &mut Sender,
    refused: &impl Fn(&'static str),
    pid: Option<i32>,
) -> bool {
    let max = broker.config.max_bridges_per_turn;
    if turn.bridges.fetch_add(1, Ordering::Relaxed) >= max {
        turn.bridges.fetch_sub(1, Ordering::Relaxed);
        refused("cap_reached");
        let msg = format!(
            "turn {} already has {max} bridges open (max_bridges_per_turn); close one first",
            turn.id
        );
        tell_refused(send, RefusalCode::Busy, &msg).await;
        refused_hello(|n| {
            tracing::info!(turn = %turn.id, ?pid, refused = n, "bridge refused: the turn has max_bridges_per_turn bridges");
        });
        return false;
    }
    let rate = broker.config.max_bridge_connects_per_minute;
    let admitted = turn
        .connects
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .admit(rate, std::time::Instant::now());
    if !admitted {
        turn.bridges.fetch_sub(1, Ordering::Relaxed);
        refused("connect_rate");
        let msg = format!(
            "turn {} made {rate} bridge connections within a minute (max_bridge_connects_per_minute); connect again in a few seconds",
            turn.id
        );
        tell_refused(send, RefusalCode::Busy, &msg).await;
        refused_hello(|n| {
            tracing::warn!(turn = %turn.id, ?pid, refused = n, "bridge refused: the turn is over max_bridge_connects_per_minute");
        });
        return false;
    }
    true
}

/// The turn's catalogue to the shim; `false` when it could not be written.
async fn welcome(broker: &Broker, turn: &Turn, send: &mut Sender) -> bool {
    let welcome = BridgeEvent::Welcome {
        protocol: PROTOCOL_VERSION,
        turn: turn.id.clone(),
        catalog_hash: turn.catalog.hash.clone(),
        tools: turn.catalog.tools.clone(),
        expires_at: Some(rfc3339(turn.expires_at)),
        portable_names: turn.portable_names,
        answer_deadline_ms: Some(broker.kernel.answer_deadline().as_millis() as u64),
    };
    write_frame(send, &welcome).await.is_ok()
}

/// The welcomed bridge on record (`bridge_connected`). Harness aliases are recorded here, on the
/// turn's first bridge, and never on a call; later bridges of the turn name the same catalogue
/// by its hash.
fn record_connected(
    broker: &Broker,
    turn: &Turn,
    shim: sharedos_proto::ipc::ShimInfo,
    peer: record::Peer,
) {
    let first = !turn.aliases_recorded.swap(true, Ordering::Relaxed);
    let connected = record::Event::BridgeConnected(record::BridgeConnected {
        turn: turn.id.clone(),
        peer,
        shim,
        catalog_hash: turn.catalog.hash.clone(),
        aliases: first.then(|| turn.aliases.clone()),
        system_identity: turn.system_identity.clone(),
    });
    // Written in order, not waited on: the next call's sync covers it.
    if let Err(e) = broker.kernel.recorder.append_written(&connected) {
        tracing::error!(turn = %turn.id, error = %e, "bridge_connected not recorded");
    }
}

/// The bridge's write half, shared by the tasks that answer: each writes its own frame.
struct Out {
    send: tokio::io::WriteHalf<Conn>,
    /// `turn_closed` was sent (or writing failed): nothing follows it.
    closed: bool,
}

async fn send_event(out: &tokio::sync::Mutex<Out>, event: BridgeEvent) {
    // Encoded before taking the lock; a frame that cannot encode is a bug, logged. The event is
    // dropped once encoded: an answer waiting for a slow client is held as its bytes only.
    let last = matches!(event, BridgeEvent::TurnClosed { .. });
    let bytes = match sharedos_proto::frame::encode(&event) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "bridge frame does not encode");
            return;
        }
    };
    drop(event);
    let mut out = out.lock().await;
    if out.closed {
        return;
    }
    if write_encoded(&mut out.send, &bytes).await.is_err() || last {
        out.closed = true;
    }
}

/// A call frame the broker cannot decode (arguments nested past serde_json's limit, a field of
/// the wrong type) is still an attempt: its id and, when readable, its tool are salvaged and it
/// goes to the kernel without arguments, to be refused and recorded; the bridge stays open. Any
/// other undecodable frame ends the connection, as before.
fn salvage_call(u: sharedos_ipc::Undecodable) -> Result<BridgeRequest, IpcError> {
    #[derive(serde::Deserialize)]
    struct Shallow {
        #[serde(rename = "type")]
        kind: String,
        id: u64,
        #[serde(default)]
        call: Option<ShallowCall>,
    }
    #[derive(serde::Deserialize)]
    struct ShallowCall {
        #[serde(default)]
        tool: Option<serde_json::Value>,
        #[serde(default, rename = "requestId")]
        request_id: Option<serde_json::Value>,
    }
    let malformed = || {
        IpcError::Frame(sharedos_proto::frame::FrameError::Malformed(
            u.error.clone(),
        ))
    };
    // Everything but `type`, `id`, `call.tool` and `call.requestId` is skipped, at any depth.
    let shallow: Shallow = serde_json::from_slice(&u.body).map_err(|_| malformed())?;
    if shallow.kind != "call" {
        return Err(malformed());
    }
    let text = |v: Option<serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) => Some(s),
        Some(other) => Some(other.to_string()),
        None => None,
    };
    let (tool, request_id) = match shallow.call {
        Some(c) => (text(c.tool).unwrap_or_default(), text(c.request_id)),
        None => (String::new(), None),
    };
    let mut why = u.error;
    sharedos_proto::name::clip(&mut why, 200);
    Ok(BridgeRequest::Call {
        id: shallow.id,
        call: sharedos_proto::ToolCall {
            tool,
            arguments: None,
            request_id,
            rejected_arguments: Some(format!("the broker could not decode the call: {why}")),
            traceparent: None,
            tracestate: None,
        },
    })
}

/// Cancels the in-flight (or place-waiting) call with this frame id, if there is one.
fn cancel_inflight(inflight: &Mutex<HashMap<u64, CancellationToken>>, id: u64) {
    if let Some(t) = inflight.lock().ok().and_then(|m| m.get(&id).cloned()) {
        t.cancel();
    }
}

/// Ends when the shim has closed its end (never without a watch).
async fn hung_up(watch: Option<&sharedos_ipc::HangUp>) {
    match watch {
        Some(w) => w.wait().await,
        None => std::future::pending().await,
    }
}

/// Bridge connections served since the broker started: each one's serial names the harness
/// session a principal's answer came from, and binds each question to the connection asked.
static BRIDGE_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How long a closing turn's bridge waits for its calls in flight to send their answers before
/// it tells the shim the turn closed.
const CLOSE_ANSWERS_WAIT: Duration = Duration::from_secs(2);

/// Longest elicitation `reason` kept from a shim (why its client could not ask).
const DECIDE_REASON_MAX_BYTES: usize = 512;

/// Who the harness on one bridge connection is, for the record of a principal's answer.
struct Harness {
    serial: u64,
    pid: Option<u32>,
    client: Mutex<Option<String>>,
}

/// Questions forwarded from brokered servers to this connection's shim
/// ([`crate::upstream::relay`]), waiting for its [`BridgeRequest::Relayed`], by serial.
#[derive(Default)]
struct Relays {
    waiting: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<Result<serde_json::Value, String>>>>,
    next: std::sync::atomic::AtomicU64,
}

/// Takes a forwarded question out of the table when its asker stops waiting.
struct RelayWait {
    relays: Arc<Relays>,
    relay: u64,
}

impl Drop for RelayWait {
    fn drop(&mut self) {
        if let Ok(mut w) = self.relays.waiting.lock() {
            w.remove(&self.relay);
        }
    }
}

impl Relays {
    /// The shim's answer to forwarded question `relay`; one not waited for is dropped.
    fn answer(&self, relay: u64, result: Option<serde_json::Value>, error: Option<String>) {
        let tx = self.waiting.lock().ok().and_then(|mut w| w.remove(&relay));
        let Some(tx) = tx else {
            tracing::info!(
                relay,
                "an answer to no forwarded question in flight: ignored"
            );
            return;
        };
        let answer = match (result, error) {
            (Some(r), _) => Ok(r),
            (None, Some(mut e)) => {
                sharedos_proto::name::clip(&mut e, DECIDE_REASON_MAX_BYTES);
                Err(e)
            }
            (None, None) => Err("the shim answered with neither a result nor an error".into()),
        };
        let _ = tx.send(answer);
    }

    /// The route to the person behind call `id` of this connection.
    fn route(
        self: &Arc<Self>,
        turn: &Turn,
        id: u64,
        out: &Arc<tokio::sync::Mutex<Out>>,
    ) -> crate::upstream::relay::Route {
        let (relays, out) = (self.clone(), out.clone());
        crate::upstream::relay::Route {
            turn: turn.id.clone(),
            principal: turn.context.principal.clone(),
            subject_token: turn.subject_token.clone(),
            ask: Arc::new(move |provider, request, sign_in| {
                let (relays, out) = (relays.clone(), out.clone());
                Box::pin(async move {
                    let relay = relays.next.fetch_add(1, Ordering::Relaxed);
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    if let Ok(mut w) = relays.waiting.lock() {
                        w.insert(relay, tx);
                    }
                    let _wait = RelayWait {
                        relays: relays.clone(),
                        relay,
                    };
                    let event = BridgeEvent::Relay {
                        id,
                        relay,
                        provider,
                        request,
                        sign_in,
                    };
                    send_event(&out, event).await;
                    rx.await
                        .unwrap_or_else(|_| Err("the harness's shim went away".into()))
                })
            }),
        }
    }
}

/// Most capabilities, and options of one, a `bridge_client` line names.
const CAPABILITY_NAMES_MAX: usize = 16;
/// Longest capability or option name kept.
const CAPABILITY_NAME_MAX_BYTES: usize = 64;

/// The capabilities a client declared, as names only (`{"elicitation": ["form"]}`): what it
/// said it can do, bounded, never a value it sent inside one.
fn capability_names(declared: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let clipped = |k: &String| {
        let mut k = k.clone();
        sharedos_proto::name::clip(&mut k, CAPABILITY_NAME_MAX_BYTES);
        k
    };
    let Value::Object(caps) = declared else {
        return Value::Object(Default::default());
    };
    caps.iter()
        .take(CAPABILITY_NAMES_MAX)
        .map(|(name, options)| {
            let options: Vec<Value> = match options {
                Value::Object(o) => o
                    .keys()
                    .take(CAPABILITY_NAMES_MAX)
                    .map(|k| Value::String(clipped(k)))
                    .collect(),
                _ => Vec::new(),
            };
            (clipped(name), Value::Array(options))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// What a shim says the person answered, and how they were asked.
struct Principal {
    answer: PrincipalAnswer,
    reason: Option<String>,
    via: Option<String>,
}

/// A principal's answer from this bridge: taken by the approvals table only for a question it
/// asked on this very connection, once; anything else is refused back to the shim.
async fn decide(
    broker: &Broker,
    turn: &Turn,
    harness: &Harness,
    out: &tokio::sync::Mutex<Out>,
    approval: String,
    said: Principal,
) {
    let Principal {
        answer,
        mut reason,
        via,
    } = said;
    if let Some(r) = reason.as_mut() {
        sharedos_proto::name::clip(r, DECIDE_REASON_MAX_BYTES);
    }
    let session = HarnessSession {
        bridge: harness.serial,
        shim_pid: harness.pid,
        client: harness.client.lock().ok().and_then(|c| c.clone()),
        action: answer.action().to_owned(),
        // Only the two ways a shim asks are kept; anything else is not the shim's to say.
        via: via.filter(|v| v == "elicitation/create" || v == "input_required"),
    };
    match broker
        .kernel
        .approvals
        .answer(&approval, harness.serial, answer, reason.clone(), session)
    {
        Ok(crate::approval::Answered::Decided) => {
            tracing::info!(turn = %turn.id, %approval, ?answer, "the principal answered in the harness");
        }
        Ok(crate::approval::Answered::ToOperator) => {
            tracing::info!(turn = %turn.id, %approval, ?reason, "the harness cannot ask its principal: the call waits for an operator (`sharedos-broker approvals`)");
        }
        Err(e) => {
            tracing::warn!(turn = %turn.id, bridge = harness.serial, error = %e, "a principal's answer refused");
            let approval_id = approval.clone();
            let mut shown = approval;
            sharedos_proto::name::clip(&mut shown, 80);
            // With the person's page, the person decides there: an answer through the harness
            // (which the turn token's holder can give) is refused, and on record.
            if broker.kernel.approvals.first_bridge_answer(&approval_id) {
                let line = record::Event::ApprovalAnswerRefused(record::ApprovalAnswerRefused {
                    approval: Some(shown.clone()),
                    turn: Some(turn.id.clone()),
                    via: "bridge".into(),
                    code: "asked_on_page".into(),
                    reason: format!(
                        "{e}; with the person's page configured, a principal's approval is given only there, by the person signed in"
                    ),
                    principal: None,
                    subject: None,
                    bridge: Some(harness.serial),
                    peer: None,
                });
                if let Err(e) = broker.kernel.recorder.append(&line).await {
                    tracing::error!(error = %e, "a refused bridge answer not recorded");
                }
            }
            send_event(
                out,
                BridgeEvent::DecideRefused {
                    approval: shown,
                    message: e.to_string(),
                },
            )
            .await;
        }
    }
}

/// What wakes a bridge connection's loop.
enum Event {
    Frame(Result<BridgeRequest, IpcError>),
    TurnEnded,
    ClientGone,
}

/// What the steps of one welcomed bridge connection share.
struct Link {
    broker: Arc<Broker>,
    turn: Arc<Turn>,
    harness: Harness,
    out: Arc<tokio::sync::Mutex<Out>>,
    /// The connection's calls, cancelled when the shim goes or the connection ends.
    conn: CancellationToken,
    /// The shim is gone: its calls are recorded as cancelled by its going.
    disconnected: Arc<AtomicBool>,
    /// The calls in flight (or waiting for a place), by the shim's frame id.
    inflight: Arc<Mutex<HashMap<u64, CancellationToken>>>,
    relays: Arc<Relays>,
    /// The bridge's places for calls in flight (`MAX_INFLIGHT_PER_BRIDGE`).
    limit: Arc<Semaphore>,
    hang_up: Option<sharedos_ipc::HangUp>,
}

/// The connection's reading side.
struct Frames {
    reader: Reader,
    /// A frame read while a call waited for its place, handled next.
    held: Option<Result<BridgeRequest, IpcError>>,
}

/// A welcomed bridge: its loop (the next event, then one step per kind) until the shim or the
/// turn ends it, then its close.
async fn run_connection(
    broker: Arc<Broker>,
    turn: Arc<Turn>,
    reader: Reader,
    send: Sender,
    hang_up: Option<sharedos_ipc::HangUp>,
    pid: Option<u32>,
) {
    let link = Link {
        harness: Harness {
            serial: BRIDGE_SERIAL.fetch_add(1, Ordering::Relaxed),
            pid,
            client: Mutex::new(None),
        },
        out: Arc::new(tokio::sync::Mutex::new(Out {
            send,
            closed: false,
        })),
        conn: turn.cancel.child_token(),
        disconnected: Arc::new(AtomicBool::new(false)),
        inflight: Arc::default(),
        relays: Arc::default(),
        limit: Arc::new(Semaphore::new(MAX_INFLIGHT_PER_BRIDGE)),
        hang_up,
        broker,
        turn,
    };
    let mut frames = Frames { reader, held: None };
    // Unparsable stdin lines the shim reported: on record at most once per
    // `REFUSAL_RECORD_INTERVAL` (the rest counted into the next line, or the last at the end).
    let mut malformed = Malformed::default();
    // What the client said of itself: once, and again when it changes (see `Clients`).
    let mut clients = Clients::default();
    loop {
        match link.next_event(&mut frames).await {
            Event::ClientGone => link.gone(),
            Event::TurnEnded => {
                link.turn_ended().await;
                break;
            }
            Event::Frame(frame) => {
                let step = link.on_frame(frame, &mut frames, &mut malformed, &mut clients);
                if step.await.is_break() {
                    break;
                }
            }
        }
    }
    link.close(&mut malformed, &mut clients).await;
}

/// One call's task: what it needs of its connection, owned.
struct CallTask {
    broker: Arc<Broker>,
    turn: Arc<Turn>,
    out: Arc<tokio::sync::Mutex<Out>>,
    inflight: Arc<Mutex<HashMap<u64, CancellationToken>>>,
    disconnected: Arc<AtomicBool>,
    /// The bridge's serial, binding a question asked to this connection.
    serial: u64,
    /// The shim's frame id for the call.
    id: u64,
}

/// Why a call of a bridge was cancelled: the turn closed, the shim went away, or it cancelled.
fn cancel_cause(turn: &Turn, disconnected: &AtomicBool) -> CancelCode {
    if turn.cancel.is_cancelled() {
        CancelCode::TurnClosed
    } else if disconnected.load(Ordering::Relaxed) {
        CancelCode::Disconnected
    } else {
        CancelCode::ClientCancelled
    }
}

/// Writes `event` from a task of its own: a kernel callback does not wait for the shim.
fn send_soon(out: &Arc<tokio::sync::Mutex<Out>>, event: BridgeEvent) {
    let out = out.clone();
    tokio::spawn(async move { send_event(&out, event).await });
}

impl CallTask {
    /// The call through the kernel (the shim told when it waits for an approval, and asked to
    /// put a question to its principal), its answer to the shim, then its place given back.
    async fn run(self, call: ToolCall, token: CancellationToken, permit: OwnedSemaphorePermit) {
        let CallTask {
            broker,
            turn: turn2,
            out,
            inflight,
            disconnected: disc,
            serial,
            id,
        } = self;
        let t = turn2.clone();
        let cause = move || cancel_cause(&t, &disc);
        // A call held for approval: the shim hears of it (and waits that much longer).
        let on_wait = |p: &PendingApproval, wait: Duration| {
            let event = BridgeEvent::Waiting {
                id,
                approval: p.id.clone(),
                expires_at: p.expires_at.clone(),
                timeout_ms: wait.as_millis() as u64,
            };
            send_soon(&out, event);
        };
        // A call held for its principal: the shim asks the person (after `Waiting`,
        // which the same ordered queue of writes delivers first).
        let on_ask = |p: &PendingApproval, question| {
            let event = BridgeEvent::Ask {
                id,
                approval: p.id.clone(),
                question,
            };
            send_soon(&out, event);
        };
        let site = CallSite {
            turn: &turn2.id,
            call_id: turn2.next_call_id(),
            context: &turn2.context,
            catalog: &turn2.catalog,
            identity: turn2.system_identity.as_ref(),
            blocking: Some(&turn2.blocking),
            budget: Some(&turn2.budget),
            on_wait: Some(&on_wait),
            ask: Some(Ask {
                bridge: serial,
                send: &on_ask,
            }),
        };
        let answer = broker.kernel.invoke(site, call, token, cause).await;
        if let Ok(mut m) = inflight.lock() {
            m.remove(&id);
        }
        send_event(&out, BridgeEvent::Answer { id, answer }).await;
        drop(permit);
    }
}

impl Link {
    /// The next event: a frame held while a call waited for its place, else whichever comes
    /// first of a frame, the turn's end, and the shim closing its end.
    async fn next_event(&self, frames: &mut Frames) -> Event {
        match frames.held.take() {
            Some(f) => Event::Frame(f),
            None => tokio::select! {
                f = frames.reader.next_or_undecodable::<BridgeRequest>() => {
                    Event::Frame(f.and_then(|r| r.or_else(salvage_call)))
                }
                _ = self.turn.cancel.cancelled() => Event::TurnEnded,
                () = hung_up(self.hang_up.as_ref()), if !self.conn.is_cancelled() => Event::ClientGone,
            },
        }
    }

    /// The shim closed its end: calls running are cancelled (`disconnected`), as a cancel from
    /// it would; calls it sent before closing that are read after are recorded as cancelled
    /// (`client_gone`) and never run.
    fn gone(&self) {
        if !self.disconnected.swap(true, Ordering::Relaxed) {
            tracing::info!(turn = %self.turn.id, "bridge client gone: its running calls are cancelled, its unread calls will not run");
        }
        self.conn.cancel();
    }

    /// The turn ended. The calls in flight end with it (cancelled, or done just before): their
    /// answers go out first, so the harness gets what the record says, not "the turn closed" for
    /// a call already decided. Bounded: a call that does not end in time is answered by the shim
    /// when the link ends. Then the shim is told the turn closed.
    async fn turn_ended(&self) {
        let settled = tokio::time::timeout(
            CLOSE_ANSWERS_WAIT,
            self.limit.acquire_many(MAX_INFLIGHT_PER_BRIDGE as u32),
        )
        .await;
        drop(settled);
        let reason = self.turn.closed_reason().unwrap_or_else(|| "closed".into());
        send_event(&self.out, BridgeEvent::TurnClosed { reason }).await;
    }

    /// One frame from the shim, one step per kind; `Break` ends the connection.
    async fn on_frame(
        &self,
        frame: Result<BridgeRequest, IpcError>,
        frames: &mut Frames,
        malformed: &mut Malformed,
        clients: &mut Clients,
    ) -> ControlFlow<()> {
        match frame {
            Ok(BridgeRequest::Call { id, call }) => return self.call(id, call, frames).await,
            Ok(BridgeRequest::Relayed {
                relay,
                result,
                error,
            }) => self.relays.answer(relay, result, error),
            Ok(BridgeRequest::Cancel { id }) => cancel_inflight(&self.inflight, id),
            Ok(BridgeRequest::Decide {
                approval,
                answer,
                reason,
                via,
            }) => self.decide(approval, answer, reason, via).await,
            Ok(BridgeRequest::ClientInfo {
                name,
                version,
                protocol_version,
                capabilities,
            }) => self.client_info(clients, name, version, protocol_version, capabilities),
            Ok(BridgeRequest::MalformedFrame {
                bytes,
                sha256,
                count,
            }) => malformed.note(&self.broker, &self.turn.id, bytes, sha256, count),
            Ok(BridgeRequest::Hello { .. }) => {
                tracing::warn!(turn = %self.turn.id, "second hello on a bridge connection: closing it");
                return ControlFlow::Break(());
            }
            Err(IpcError::Closed) => return ControlFlow::Break(()),
            Err(e) => {
                tracing::warn!(turn = %self.turn.id, error = %e, "bad frame on bridge: closing it");
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }

    /// A principal's answer from this bridge (the function `decide`).
    async fn decide(
        &self,
        approval: String,
        answer: PrincipalAnswer,
        reason: Option<String>,
        via: Option<String>,
    ) {
        let said = Principal {
            answer,
            reason,
            via,
        };
        decide(
            &self.broker,
            &self.turn,
            &self.harness,
            &self.out,
            approval,
            said,
        )
        .await;
    }

    /// A call: known at once (so a cancel that comes while it waits reaches it), given its
    /// place among the bridge's calls in flight, then run as a task of the turn. `Break`: the
    /// places are gone.
    async fn call(&self, id: u64, call: ToolCall, frames: &mut Frames) -> ControlFlow<()> {
        let token = self.conn.child_token();
        if let Ok(mut m) = self.inflight.lock() {
            m.insert(id, token.clone());
        }
        let Ok(permit) = self.place(frames).await else {
            return ControlFlow::Break(());
        };
        // Checked again at the moment the call would start: a shim that has closed
        // its end gets no call started after it closed.
        if self.hang_up.as_ref().is_some_and(sharedos_ipc::HangUp::now) {
            self.gone();
        }
        let task = CallTask {
            broker: self.broker.clone(),
            turn: self.turn.clone(),
            out: self.out.clone(),
            inflight: self.inflight.clone(),
            disconnected: self.disconnected.clone(),
            serial: self.harness.serial,
            id,
        };
        let route = self.relays.route(&self.turn, id, &self.out);
        let run = task.run(call, token, permit);
        self.turn
            .tracker
            .spawn(crate::upstream::relay::ROUTE.scope(route, run));
        ControlFlow::Continue(())
    }

    /// A call's place. While every place is taken (calls held for a person, say), frames are
    /// still read: a cancel is acted on at once, so a waiting call can be cancelled; the first
    /// other frame is held, and reading stops until this call has its place.
    async fn place(&self, frames: &mut Frames) -> Result<OwnedSemaphorePermit, AcquireError> {
        loop {
            if frames.held.is_some() {
                return self.limit.clone().acquire_owned().await;
            }
            tokio::select! {
                biased;
                p = self.limit.clone().acquire_owned() => return p,
                () = hung_up(self.hang_up.as_ref()), if !self.conn.is_cancelled() => self.gone(),
                f = frames.reader.next_or_undecodable::<BridgeRequest>() => {
                    let frame = f.and_then(|r| r.or_else(salvage_call));
                    self.while_waiting(frame, &mut frames.held).await;
                }
            }
        }
    }

    /// A frame read while a call waits for its place: acted on at once, or held.
    async fn while_waiting(
        &self,
        frame: Result<BridgeRequest, IpcError>,
        held: &mut Option<Result<BridgeRequest, IpcError>>,
    ) {
        match frame {
            Ok(BridgeRequest::Cancel { id }) => cancel_inflight(&self.inflight, id),
            // An answer frees a held call's place: never left behind one.
            Ok(BridgeRequest::Decide {
                approval,
                answer,
                reason,
                via,
            }) => self.decide(approval, answer, reason, via).await,
            // So does the answer to a forwarded question.
            Ok(BridgeRequest::Relayed {
                relay,
                result,
                error,
            }) => self.relays.answer(relay, result, error),
            Ok(other) => *held = Some(Ok(other)),
            // The shim is gone (or sent what ends the connection): its calls end now, this one
            // too, each recorded as cancelled.
            Err(e) => {
                self.disconnected.store(true, Ordering::Relaxed);
                self.conn.cancel();
                *held = Some(Err(e));
            }
        }
    }

    /// What the client says of itself, kept (in the record and the log) to a bound, and named
    /// on this connection's answers of its principal.
    fn client_info(
        &self,
        clients: &mut Clients,
        mut name: String,
        mut version: String,
        mut protocol_version: Option<String>,
        capabilities: Option<serde_json::Value>,
    ) {
        let max = record::RECORD_MAX_STRING_BYTES;
        let mut cut = None;
        record::bound(&mut name, max, "client.name", &mut cut);
        record::bound(&mut version, max, "client.version", &mut cut);
        record::bound_opt(
            &mut protocol_version,
            max,
            "client.protocolVersion",
            &mut cut,
        );
        if let Ok(mut c) = self.harness.client.lock() {
            *c = Some(format!("{name} {version}"));
        }
        let client = record::ClientInfo {
            name,
            version,
            protocol_version,
            capabilities: capabilities.as_ref().map(capability_names),
        };
        clients.note(&self.broker, &self.turn, client, cut);
    }

    /// The connection's end: what it holds for the record is written, forwarded questions
    /// waiting for this shim end (their servers are told why), the calls in flight end as
    /// cancelled and are recorded, and each gives its place back (its answer sent, or dropped
    /// after close).
    async fn close(&self, malformed: &mut Malformed, clients: &mut Clients) {
        malformed.write(&self.broker, &self.turn.id);
        clients.write(&self.broker, &self.turn);
        if let Ok(mut w) = self.relays.waiting.lock() {
            w.clear();
        }
        self.disconnected.store(true, Ordering::Relaxed);
        self.conn.cancel();
        let _ = self
            .limit
            .acquire_many(MAX_INFLIGHT_PER_BRIDGE as u32)
            .await;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_turns_connections_are_a_burst_then_a_steady_rate() {
        use std::time::{Duration, Instant};
        let mut rate = crate::turn::ConnectRate::default();
        let t0 = Instant::now();
        let burst = (0..200).filter(|_| rate.admit(120, t0)).count();
        assert_eq!(burst, 120);
        // One more every 500 ms.
        assert!(!rate.admit(120, t0 + Duration::from_millis(499)));
        assert!(rate.admit(120, t0 + Duration::from_millis(500)));
        assert!(!rate.admit(120, t0 + Duration::from_millis(600)));
        let later = t0 + Duration::from_secs(10);
        assert_eq!((0..100).filter(|_| rate.admit(120, later)).count(), 19);
        // A quiet minute gives the whole burst back.
        let quiet = later + Duration::from_secs(70);
        assert_eq!((0..200).filter(|_| rate.admit(120, quiet)).count(), 120);
        let mut one = crate::turn::ConnectRate::default();
        assert!(one.admit(1, t0));
        assert!(!one.admit(1, t0 + Duration::from_secs(59)));
        assert!(one.admit(1, t0 + Duration::from_secs(60)));
    }

    #[test]
    fn capability_names_keep_names_only_and_are_bounded() {
        let declared = json!({
            "elicitation": {"form": {"secret": "x"}, "url": {}},
            "roots": {"listChanged": true},
            "sampling": {},
            "experimental": 5,
        });
        assert_eq!(
            super::capability_names(&declared),
            json!({"elicitation": ["form", "url"], "roots": ["listChanged"], "sampling": [], "experimental": []})
        );
        assert_eq!(super::capability_names(&json!([1, 2])), json!({}));
        let many: serde_json::Map<String, serde_json::Value> = (0..100)
            .map(|i| (format!("{i}{}", "k".repeat(200)), json!({})))
            .collect();
        let named = super::capability_names(&serde_json::Value::Object(many));
        let named = named.as_object().expect("object");
        assert_eq!(named.len(), super::CAPABILITY_NAMES_MAX);
        assert!(
            named
                .keys()
                .all(|k| k.len() <= super::CAPABILITY_NAME_MAX_BYTES)
        );
    }
}
