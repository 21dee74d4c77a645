//! Asking the person in the harness: a call held for its principal's approval
//! (`@approval("principal")`) becomes a question to the MCP client in the form the call's
//! protocol has, and the client's answer becomes the one the shim sends the broker
//! ([`BridgeRequest::Decide`](sharedos_proto::ipc::BridgeRequest)):
//!
//! - up to 2025-11-25, an `elicitation/create` request to a client that declared the capability
//!   in `initialize`; its response is matched by the shim's own request id;
//! - from 2026-07-28 (no server-to-client requests), the call itself is answered with an
//!   `input_required` result carrying the same elicitation and a `requestState` of 128 random
//!   bits ([`Round`]); the held call goes on waiting in the broker, and the client's retry of
//!   the same call with that state and its `inputResponses` answers the question and gets the
//!   held call's own answer. A retry for another call (tool or arguments differ), a state the
//!   shim never gave, or one already used takes no round: it is a new call, asked anew.
//!
//! Only the client's side of the session answers: a tool call cannot (the guard refers every
//! `tools/call` to the kernel, which knows no such tool, and a model names a tool and its
//! arguments, never a `requestState`), and a response with an id the shim did not send, or a
//! second one for the same id, is dropped. The broker binds each question to the bridge
//! connection it asked, once, besides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use sharedos_proto::ipc::{CallAnswer, PrincipalAnswer, Question};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::link::{Answer, LinkDown};

/// How a question is asked, as `approval_decided` records it.
pub const VIA_REQUEST: &str = "elicitation/create";
pub const VIA_INPUT_REQUIRED: &str = "input_required";
/// The question carried a link of the person's page (kept with the link, which reads it).
pub use crate::link::VIA_PAGE;

/// The key of the shim's question in an `input_required` result's `inputRequests`.
pub const INPUT_KEY: &str = "sharedos-approval";
/// The key of a brokered server's question forwarded in an `input_required` result.
pub const RELAY_KEY: &str = "sharedos-question";

/// What the held call behind a round ends with (its task's result).
pub type Held = tokio::task::JoinHandle<Option<Result<CallAnswer, LinkDown>>>;

/// Where a held call's `input_required` results go (its state and the result), to whoever
/// waits on the held call: the call's own request first, then each retry.
pub type Raise = mpsc::Sender<(String, Value)>;
pub type Raised = mpsc::Receiver<(String, Value)>;

/// A question put to a 2026-07-28 client in an `input_required` result, waiting for the retry
/// that answers it.
struct Round {
    /// The call it asks about: SHA-256 of the tool as sent and its arguments.
    call: [u8; 32],
    /// Its key in `inputRequests` (and the retry's `inputResponses`).
    key: &'static str,
    /// Where the client's response goes (to the held call's question); `None`: the retry
    /// carried none.
    answer: oneshot::Sender<Option<Value>>,
    /// The held call's task, and where its further results are raised, once the
    /// `input_required` result is on its way to the client.
    held: Option<(Held, Raised)>,
    /// Stops the held call (the retry is cancelled).
    cancel: CancellationToken,
    /// When the question stopped waiting without a retry (the held call ended: timed out,
    /// decided by an operator, turn closed): a late retry still gets the held call's answer,
    /// for [`LATE_RETRY_KEEP`].
    ended: Option<std::time::Instant>,
}

/// How long the answer of a held call whose question ended unanswered is kept for a late
/// retry (which then gets it, `denied/approval_timeout` say, instead of being asked anew).
pub const LATE_RETRY_KEEP: std::time::Duration = std::time::Duration::from_secs(300);

/// A round taken by the retry that answers it: the held call, to wait on (it may raise
/// another round).
pub struct Resumed {
    pub held: Held,
    pub raised: Raised,
    pub cancel: CancellationToken,
}

/// How a held call asks in `input_required` rounds: the call they bind to, what stops it, and
/// where its results go.
pub struct RoundCtx {
    pub call: [u8; 32],
    /// What the call's client declared on it: form-mode and URL-mode elicitation.
    pub form: bool,
    pub url: bool,
    pub cancel: CancellationToken,
    pub raise: Raise,
}

/// The digest that binds a round to its call: the tool as sent and the arguments' canonical
/// JSON (so that a client that re-sends the same object in another key order still matches).
pub fn call_digest(tool: &str, arguments: Option<&Value>) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(tool.as_bytes());
    h.update([0]);
    if let Some(a) = arguments {
        let text = sharedos_proto::catalog::canonical_json(a).unwrap_or_else(|_| a.to_string());
        h.update(text.as_bytes());
    }
    h.finalize().into()
}

/// The URL-mode elicitations one held call showed a 2025-11-25 client and the client took
/// (`accept`), by `elicitationId`: each is completed (`notifications/elicitation/complete`)
/// once, when the call's answer comes ([`Asker::complete`]).
pub type Shown = Arc<Mutex<Vec<String>>>;

/// The prefix of the `elicitationId` of a link to the person's page for an approval.
pub const PAGE_ELICITATION: &str = "sharedos-page-";
/// The prefix of the `elicitationId` of a sign-in to a remote server.
pub const SIGN_IN_ELICITATION: &str = "sharedos-signin-";

/// What the client said it can do, from `initialize`.
#[derive(Clone, Default)]
pub struct ClientCan {
    /// The client declared the `elicitation` capability with form mode (an empty
    /// `elicitation: {}` is form mode, as the 2025-11-25 revision says).
    form: Arc<AtomicBool>,
    /// It declared URL mode (`elicitation: {url: {}}`).
    url: Arc<AtomicBool>,
}

impl ClientCan {
    /// Reads the client's `capabilities` from `initialize`.
    pub fn settle(&self, capabilities: &Value) {
        let form = crate::guard::declares_form_elicitation(capabilities);
        self.form.store(form, Ordering::Relaxed);
        let url = capabilities
            .get("elicitation")
            .and_then(|e| e.get("url"))
            .is_some();
        self.url.store(url, Ordering::Relaxed);
    }

    pub fn url(&self) -> bool {
        self.url.load(Ordering::Relaxed)
    }

    pub fn form(&self) -> bool {
        self.form.load(Ordering::Relaxed)
    }
}

/// The prefix of the shim's own request ids (a client's requests never reach this table).
const ID_PREFIX: &str = "sharedos-approval-";

/// The form the person answers: one choice, approve or deny.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "decision": {
                "type": "string",
                "title": "Your decision",
                "description": "approve runs this call once; deny refuses it",
                "enum": ["approve", "deny"],
            }
        },
        "required": ["decision"],
    })
}

/// The shim's questions to the client in flight, by request id.
#[derive(Default)]
pub struct Asker {
    out: Mutex<Option<mpsc::WeakSender<Vec<u8>>>>,
    pending: Mutex<HashMap<String, oneshot::Sender<Value>>>,
    next: AtomicU64,
    pub can: ClientCan,
    /// `input_required` questions waiting for their retry, by `requestState`.
    rounds: Mutex<HashMap<String, Round>>,
}

/// Marks a round ended when its question stops waiting without a retry (the held call ended
/// first); one never returned to the client is taken out.
struct OpenRound<'a> {
    asker: &'a Asker,
    state: String,
}

impl Drop for OpenRound<'_> {
    fn drop(&mut self) {
        if let Ok(mut rounds) = self.asker.rounds.lock() {
            match rounds.get_mut(&self.state) {
                Some(r) if r.held.is_some() => r.ended = Some(std::time::Instant::now()),
                Some(_) => {
                    rounds.remove(&self.state);
                }
                None => {}
            }
        }
    }
}

/// Takes a question out of the table when its asker stops waiting (answered, or the call
/// ended first: then the client is told the request is cancelled).
struct Outstanding<'a> {
    asker: &'a Asker,
    id: String,
    answered: bool,
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        let was = self
            .asker
            .pending
            .lock()
            .ok()
            .and_then(|mut p| p.remove(&self.id));
        if was.is_some() && !self.answered {
            let note = json!({
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": self.id, "reason": "the call was decided or ended before an answer came"},
            });
            self.asker.write(&note);
        }
    }
}

impl Asker {
    pub fn new(can: ClientCan) -> Self {
        Self {
            can,
            ..Self::default()
        }
    }

    /// Where requests to the client go (the session's stdout queue).
    pub fn set_out(&self, out: &mpsc::Sender<Vec<u8>>) {
        if let Ok(mut o) = self.out.lock() {
            *o = Some(out.downgrade());
        }
    }

    fn write(&self, message: &Value) -> bool {
        let out = self.out.lock().ok().and_then(|o| o.clone());
        let Some(out) = out.and_then(|o| o.upgrade()) else {
            return false;
        };
        let mut bytes = message.to_string().into_bytes();
        bytes.push(b'\n');
        out.try_send(bytes).is_ok()
    }

    /// A response from the client: handed to the question it answers. `false` when no
    /// question waits for its id (never asked, or already answered).
    pub fn response(&self, message: Value) -> bool {
        let Some(id) = message.get("id").and_then(Value::as_str) else {
            return false;
        };
        if !id.starts_with(ID_PREFIX) {
            return false;
        }
        let tx = self.pending.lock().ok().and_then(|mut p| p.remove(id));
        match tx {
            Some(tx) => tx.send(message).is_ok(),
            None => false,
        }
    }

    /// Puts one question (`params` of an `elicitation/create`, under `key`) to a 2026-07-28
    /// client in an `input_required` round of the held call `ctx` names: the result (with a
    /// fresh `requestState`) is raised for whoever waits on the held call; resolves with the
    /// response the retry carries (`None`: it carried none), or why there is none (no retry
    /// before the held call ended: the future is dropped then).
    async fn open_round(
        &self,
        ctx: &RoundCtx,
        key: &'static str,
        params: Value,
    ) -> Result<Option<Value>, Unraised> {
        let state = request_state()
            .map_err(|e| Unraised::NotRaised(format!("no random requestState: {e}")))?;
        let (tx, rx) = oneshot::channel();
        if let Ok(mut r) = self.rounds.lock() {
            r.retain(|_, round| round.ended.is_none_or(|e| e.elapsed() < LATE_RETRY_KEEP));
            r.insert(
                state.clone(),
                Round {
                    call: ctx.call,
                    key,
                    answer: tx,
                    held: None,
                    cancel: ctx.cancel.clone(),
                    ended: None,
                },
            );
        }
        let _open = OpenRound {
            asker: self,
            state: state.clone(),
        };
        let result = json!({
            "resultType": "input_required",
            "inputRequests": {key: {"method": "elicitation/create", "params": params}},
            "requestState": state,
        });
        if ctx.raise.send((state, result)).await.is_err() {
            return Err(Unraised::NotRaised(
                "the call ended before its question could be returned".into(),
            ));
        }
        rx.await.map_err(|_| Unraised::NoRetry)
    }

    /// Asks the person about a held call in a 2026-07-28 `input_required` round (see
    /// [`Asker::open_round`]).
    pub async fn ask_in_round(&self, question: &Question, ctx: &RoundCtx) -> Answer {
        if let Some(url) = &question.url {
            return self.link_in_round(question, url, ctx).await;
        }
        if !ctx.form {
            return Answer::unable(
                "the client speaks MCP 2026-07-28 and declared only URL-mode elicitation in the call's clientCapabilities, so it cannot be asked a question with a form",
            );
        }
        tracing::info!(tool = %question.tool, "asking the person through the MCP client (an input_required result)");
        let params = json!({"message": question.message, "requestedSchema": schema()});
        let (answer, reason) = match self.open_round(ctx, INPUT_KEY, params).await {
            Ok(Some(result)) => read_answer(&json!({"result": result})),
            Ok(None) => (
                PrincipalAnswer::Cancel,
                Some(format!(
                    "the retry carried no response for the question ({INPUT_KEY})"
                )),
            ),
            Err(Unraised::NotRaised(why)) => return Answer::unable(why),
            Err(Unraised::NoRetry) => (
                PrincipalAnswer::Cancel,
                Some("no retry answered the question".into()),
            ),
        };
        Answer {
            answer,
            reason,
            via: Some(VIA_INPUT_REQUIRED),
        }
    }

    /// Puts a brokered server's question to a 2026-07-28 client in an `input_required` round of
    /// the held call (see [`Asker::relay`] for what the person is shown).
    pub async fn relay_in_round(
        &self,
        provider: &str,
        request: Value,
        ctx: &RoundCtx,
        sign_in: bool,
    ) -> Result<Value, String> {
        let params = if sign_in {
            sign_in_params(provider, request, self.elicitation_id(SIGN_IN_ELICITATION))?
        } else {
            relay_params(provider, request)?
        };
        tracing::info!(
            provider,
            "asking the person a brokered server's question (an input_required result)"
        );
        match self.open_round(ctx, RELAY_KEY, params).await {
            Ok(Some(result)) => Ok(result),
            Ok(None) => Err(format!(
                "the retry carried no response for the question ({RELAY_KEY})"
            )),
            Err(Unraised::NotRaised(why)) => Err(why),
            Err(Unraised::NoRetry) => Err("no retry answered the question".into()),
        }
    }

    /// The held call of a round now on its way to the client as an `input_required` result,
    /// with where it raises further rounds.
    pub fn attach(&self, state: &str, held: Held, raised: Raised) -> Result<(), (Held, Raised)> {
        match self
            .rounds
            .lock()
            .ok()
            .as_mut()
            .and_then(|r| r.get_mut(state))
        {
            Some(round) => {
                round.held = Some((held, raised));
                Ok(())
            }
            None => Err((held, raised)),
        }
    }

    /// A retry with `state`: the round it answers, taken (once), when it asked about this very
    /// call (`call`: [`call_digest`]); the client's response from `responses` goes to the held
    /// call's question. `None` leaves the table as it was: the retry is a new call.
    pub fn resume(
        &self,
        state: &str,
        call: [u8; 32],
        responses: Option<&Value>,
    ) -> Option<Resumed> {
        let round = {
            let mut rounds = self.rounds.lock().ok()?;
            let r = rounds.get(state)?;
            if r.call != call || r.held.is_none() {
                return None;
            }
            rounds.remove(state)?
        };
        let response = responses.and_then(|r| r.get(round.key)).cloned();
        let _ = round.answer.send(response);
        let (held, raised) = round.held?;
        Some(Resumed {
            held,
            raised,
            cancel: round.cancel,
        })
    }

    /// Asks the person about a held call with an `elicitation/create` request (a 2025-11-25
    /// client that declared the capability); resolves with their answer, or why the client
    /// cannot be asked. `current`: the call came in the 2026-07-28 revision, which has no
    /// server-to-client requests (there, [`Asker::ask_in_round`] asks, when it can).
    pub async fn ask(&self, question: &Question, current: bool, shown: &Shown) -> Answer {
        if let Some(url) = &question.url {
            return self.ask_on_page(question, url, current, shown).await;
        }
        if current {
            return Answer::unable(
                "the client speaks MCP 2026-07-28 and did not declare form-mode elicitation in the call's clientCapabilities (or sent the call as a notification), so it cannot be asked with an input_required result",
            );
        }
        if !self.can.form() {
            return Answer::unable(
                "the MCP client did not declare the elicitation capability (form mode)",
            );
        }
        let params = json!({"message": question.message, "requestedSchema": schema()});
        tracing::info!(tool = %question.tool, "asking the person through the MCP client (elicitation/create)");
        match self.request_client(params).await {
            Err(Unasked::NotWritten) => {
                Answer::unable("the question could not be written to the MCP client")
            }
            Err(Unasked::NoAnswer) => Answer {
                answer: PrincipalAnswer::Cancel,
                reason: Some("no answer".into()),
                via: Some(VIA_REQUEST),
            },
            Ok(reply) => {
                let (answer, reason) = read_answer(&reply);
                Answer {
                    answer,
                    reason,
                    via: Some(VIA_REQUEST),
                }
            }
        }
    }

    /// Shows the person the link of their page with a URL-mode `elicitation/create` (a client
    /// that declared `elicitation: {url: {}}`), and waits for the client to say it did; the
    /// decision is the page's, so nothing is sent to the broker. A client that cannot show a
    /// link is not asked: the call waits on the page, where the person's list shows it.
    async fn ask_on_page(
        &self,
        question: &Question,
        url: &str,
        current: bool,
        shown: &Shown,
    ) -> Answer {
        if current || !self.can.url() {
            tracing::info!(tool = %question.tool, "the person decides this call on their page; the MCP client cannot show a link (no URL-mode elicitation)");
            return page_answer();
        }
        let id = self.elicitation_id(PAGE_ELICITATION);
        let params = json!({
            "mode": "url",
            "message": question.message,
            "url": url,
            "elicitationId": id,
        });
        tracing::info!(tool = %question.tool, "showing the person the link of their page (URL-mode elicitation/create)");
        match self.request_client(params).await {
            Ok(reply) => {
                let action = reply
                    .pointer("/result/action")
                    .and_then(Value::as_str)
                    .unwrap_or("?");
                tracing::info!(action, "the MCP client answered the page link");
                if action == "accept" {
                    remember(shown, id);
                }
            }
            Err(_) => tracing::info!("the MCP client did not take the page link"),
        }
        page_answer()
    }

    /// A fresh `elicitationId` with `prefix` (unique in the session; it says nothing secret).
    fn elicitation_id(&self, prefix: &str) -> String {
        format!("{prefix}{}", self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Tells the client that the out-of-band interaction of each URL elicitation in `shown` is
    /// over (`notifications/elicitation/complete`, MCP 2025-11-25), once each: the held call
    /// they were shown for has its answer (the page decided, or the person signed in, or the
    /// wait ended). Written before the call's own response, on the same queue.
    pub fn complete(&self, shown: &Shown) {
        let ids: Vec<String> = shown
            .lock()
            .map(|mut s| s.drain(..).collect())
            .unwrap_or_default();
        for id in ids {
            let note = json!({
                "jsonrpc": "2.0",
                "method": "notifications/elicitation/complete",
                "params": {"elicitationId": id},
            });
            if self.write(&note) {
                tracing::info!(elicitation = %id, "told the MCP client the URL elicitation is complete");
            }
        }
    }

    /// Shows the person the link of their page in a URL round of `input_required` (a 2026-07-28
    /// client that declared `elicitation: {url: {}}` on the call), and waits for the retry that
    /// says the client showed it; the decision is the page's, so nothing is sent to the broker
    /// and the retry then waits for the page's decision. A client that cannot show a link is not
    /// asked: the call waits on the page, where the person's list shows it.
    async fn link_in_round(&self, question: &Question, url: &str, ctx: &RoundCtx) -> Answer {
        if !ctx.url {
            tracing::info!(tool = %question.tool, "the person decides this call on their page; the MCP client cannot show a link (no URL-mode elicitation on the call)");
            return page_answer();
        }
        let params = json!({
            "mode": "url",
            "message": question.message,
            "url": url,
            "elicitationId": self.elicitation_id(PAGE_ELICITATION),
        });
        tracing::info!(tool = %question.tool, "showing the person the link of their page (a URL round of input_required)");
        match self.open_round(ctx, INPUT_KEY, params).await {
            Ok(response) => {
                let action = response
                    .as_ref()
                    .and_then(|r| r.get("action"))
                    .and_then(Value::as_str)
                    .unwrap_or("?");
                tracing::info!(action, "the MCP client answered the page link");
            }
            Err(_) => tracing::info!("the MCP client did not take the page link"),
        }
        page_answer()
    }

    /// Sends `elicitation/create` with `params` to the client; resolves with its whole
    /// response (withdrawn with `notifications/cancelled` if dropped first).
    async fn request_client(&self, params: Value) -> Result<Value, Unasked> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("{ID_PREFIX}{n}");
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = self.pending.lock() {
            p.insert(id.clone(), tx);
        }
        let mut outstanding = Outstanding {
            asker: self,
            id: id.clone(),
            answered: false,
        };
        let request = json!({
            "jsonrpc": "2.0",
            "id": id,
            "method": "elicitation/create",
            "params": params,
        });
        if !self.write(&request) {
            return Err(Unasked::NotWritten);
        }
        let reply = rx.await.map_err(|_| Unasked::NoAnswer)?;
        outstanding.answered = true;
        Ok(reply)
    }

    /// Puts a brokered server's question (`request`: its `elicitation/create` params) to the
    /// person, named as `provider`'s; resolves with the client's result (`action`, `content`),
    /// or why it could not ask. Only a client that declared the mode in `initialize` is asked
    /// this way (a 2026-07-28 client is asked in a round: [`Asker::relay_in_round`]).
    pub async fn relay(
        &self,
        provider: &str,
        request: Value,
        sign_in: bool,
        shown: &Shown,
    ) -> Result<Value, String> {
        let url = request.get("mode").and_then(Value::as_str) == Some("url");
        let can = if url { self.can.url() } else { self.can.form() };
        if !can {
            return Err(format!(
                "the MCP client did not declare elicitation ({} mode) in initialize",
                if url { "url" } else { "form" }
            ));
        }
        let id = sign_in.then(|| self.elicitation_id(SIGN_IN_ELICITATION));
        let request = match &id {
            Some(id) => sign_in_params(provider, request, id.clone())?,
            None => relay_params(provider, request)?,
        };
        tracing::info!(
            provider,
            url,
            sign_in,
            "asking the person a question for a brokered server (elicitation/create)"
        );
        let reply = self.request_client(request).await.map_err(|e| match e {
            Unasked::NotWritten => "the question could not be written to the MCP client".to_owned(),
            Unasked::NoAnswer => "the MCP client gave no answer".to_owned(),
        })?;
        if let Some(why) = client_error(&reply) {
            return Err(why);
        }
        if let Some(id) = id
            && reply.pointer("/result/action").and_then(Value::as_str) == Some("accept")
        {
            remember(shown, id);
        }
        reply
            .get("result")
            .cloned()
            .ok_or_else(|| "the MCP client's answer has no result".to_owned())
    }
}

fn remember(shown: &Shown, id: String) {
    if let Ok(mut s) = shown.lock() {
        s.push(id);
    }
}

/// The broker's own sign-in question (SharedOS asks the person to sign in to `provider`), as
/// the client is shown it: URL mode only, the broker's message and link, an `elicitationId` of
/// the shim's, and the server named in `_meta` as a sign-in (not as a server asking).
fn sign_in_params(provider: &str, request: Value, id: String) -> Result<Value, String> {
    let (Some("url"), Some(url), Some(message)) = (
        request.get("mode").and_then(Value::as_str),
        request.get("url").and_then(Value::as_str),
        request.get("message").and_then(Value::as_str),
    ) else {
        return Err("a sign-in question must be URL mode, with a message and a url".into());
    };
    Ok(json!({
        "mode": "url",
        "message": plain_message(message),
        "url": url,
        "elicitationId": id,
        "_meta": { SIGN_IN_META_KEY: provider },
    }))
}

/// The `_meta` key of SharedOS's own sign-in question: the server to sign in to.
pub const SIGN_IN_META_KEY: &str = "io.sharedos/sign-in";

/// A brokered server's question as the person is shown it: its own, named as the server's
/// (`provider`), its message bounded, its `_meta` left out. The server's name is a field of its
/// own (`_meta["io.sharedos/server"]`) besides the first line of the message, and the server's
/// message follows on lines of its own, cleaned ([`plain_message`]): it cannot push the name out
/// of view, nor start with what SharedOS's own questions say. A form that wears the approval
/// form's clothes ([`wears_the_approval_form`]) is refused, with why: the broker records it.
fn relay_params(provider: &str, mut request: Value) -> Result<Value, String> {
    if let Some(why) = request
        .get("requestedSchema")
        .and_then(wears_the_approval_form)
    {
        return Err(why);
    }
    let message = request
        .get("message")
        .and_then(Value::as_str)
        .map(plain_message)
        .unwrap_or_default();
    let mut shown = format!(
        "`{provider}`, a server SharedOS runs for you, asks (it is not SharedOS asking):\n\n{message}"
    );
    sharedos_proto::name::clip(&mut shown, RELAY_MESSAGE_MAX_BYTES);
    if let Some(m) = request.as_object_mut() {
        m.insert("message".into(), Value::String(shown));
        m.insert("_meta".into(), json!({ SERVER_META_KEY: provider }));
    }
    Ok(request)
}

/// The `_meta` key of a forwarded question that names the server asking.
pub const SERVER_META_KEY: &str = "io.sharedos/server";

/// A server's message as the person is shown it: no whitespace, control or invisible format
/// characters before it, none inside it but line breaks and spaces (a tab is a space), lines
/// trimmed at their end, at most one empty line in a row, nothing after it.
fn plain_message(message: &str) -> String {
    let invisible = |c: char| {
        c.is_control()
            || matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}' | '\u{00AD}')
    };
    let mut out = String::with_capacity(message.len());
    let mut empty_lines = 0;
    for line in message.split(['\n', '\r', '\u{2028}', '\u{2029}', '\u{85}']) {
        let line: String = line
            .chars()
            .map(|c| if c == '\t' { ' ' } else { c })
            .filter(|c| !invisible(*c))
            .collect();
        let line = line.trim_end();
        if line.trim_start().is_empty() {
            empty_lines += 1;
            continue;
        }
        if !out.is_empty() {
            out.push_str(if empty_lines > 0 { "\n\n" } else { "\n" });
        }
        empty_lines = 0;
        out.push_str(if out.is_empty() {
            line.trim_start()
        } else {
            line
        });
    }
    out
}

/// Text of a form compared with the approval form's: case, spacing and invisible characters
/// aside.
fn folded(text: &str) -> String {
    plain_message(text)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// Why a brokered server's form (`requestedSchema`) may not be put to the person: it reuses a
/// property name, a title or a description of the approval form ([`schema`]), or its
/// approve/deny choice, and so could pass for SharedOS's own question. Refused, not renamed: a
/// renamed copy would still look like the approval, and a refusal on record is plain to see.
fn wears_the_approval_form(requested: &Value) -> Option<String> {
    let approval = schema();
    let empty = serde_json::Map::new();
    let own = approval["properties"].as_object().unwrap_or(&empty);
    let names: Vec<String> = own.keys().map(|k| folded(k)).collect();
    let mut texts: Vec<String> = Vec::new();
    for p in own.values() {
        for key in ["title", "description"] {
            if let Some(t) = p.get(key).and_then(Value::as_str) {
                texts.push(folded(t));
            }
        }
    }
    let choice = |v: &Value| -> Vec<String> {
        let mut words: Vec<String> = v
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).map(folded).collect())
            .unwrap_or_default();
        words.sort();
        words
    };
    let approve_deny = vec!["approve".to_owned(), "deny".to_owned()];
    let mut found = None;
    visit(requested, &mut |key, value| {
        if found.is_some() {
            return;
        }
        match key {
            "properties" => {
                for name in value.as_object().into_iter().flat_map(|m| m.keys()) {
                    if names.contains(&folded(name)) {
                        found = Some(format!("property `{name}`"));
                        return;
                    }
                }
            }
            "title" | "description" => {
                if let Some(t) = value.as_str()
                    && texts.contains(&folded(t))
                {
                    found = Some(format!("{key} `{t}`"));
                }
            }
            "enum" if choice(value) == approve_deny => {
                found = Some("the approve/deny choice".to_owned());
            }
            _ => {}
        }
    });
    found.map(|what| {
        format!(
            "the server's form reuses the approval form's {what}: a person could take it for SharedOS asking to approve a call, so it is not put to them"
        )
    })
}

/// Calls `f` with every key and value of every object in `v`, depth first (bounded).
fn visit(v: &Value, f: &mut impl FnMut(&str, &Value)) {
    fn go(v: &Value, f: &mut impl FnMut(&str, &Value), depth: usize) {
        if depth > 32 {
            return;
        }
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    f(k, x);
                    go(x, f, depth + 1);
                }
            }
            Value::Array(a) => {
                for x in a {
                    go(x, f, depth + 1);
                }
            }
            _ => {}
        }
    }
    go(v, f, 0);
}

/// Longest message of a forwarded question, as the person is shown it.
pub const RELAY_MESSAGE_MAX_BYTES: usize = 2048;

/// Why an `input_required` round has no response: the question never went out, or no retry
/// came before the held call ended.
enum Unraised {
    NotRaised(String),
    NoRetry,
}

/// Why the client was not asked, or did not answer.
enum Unasked {
    NotWritten,
    NoAnswer,
}

/// A fresh `requestState`: 128 random bits in hex, unguessable, so that only the client the
/// shim answered can name the round.
fn request_state() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    Ok(sharedos_proto::catalog::hex(&bytes))
}

/// Why the client answered `elicitation/create` with a JSON-RPC error (its code and message,
/// bounded), if it did.
fn client_error(reply: &Value) -> Option<String> {
    let e = reply.get("error")?;
    let mut why = format!(
        "the MCP client answered elicitation/create with error {}",
        e.get("code").map(Value::to_string).unwrap_or_default()
    );
    if let Some(m) = e.get("message").and_then(Value::as_str) {
        why.push_str(": ");
        why.push_str(m);
    }
    sharedos_proto::name::clip(&mut why, 300);
    Some(why)
}

/// The answer of a question asked on the person's page: nothing for the broker.
fn page_answer() -> Answer {
    Answer {
        answer: PrincipalAnswer::Unable,
        reason: None,
        via: Some(VIA_PAGE),
    }
}

/// The person's answer in an `elicitation/create` response.
fn read_answer(reply: &Value) -> (PrincipalAnswer, Option<String>) {
    if let Some(why) = client_error(reply) {
        return (PrincipalAnswer::Unable, Some(why));
    }
    let result = reply.get("result");
    match result.and_then(|r| r.get("action")).and_then(Value::as_str) {
        Some("accept") => {
            let decision = result
                .and_then(|r| r.get("content"))
                .and_then(|c| c.get("decision"))
                .and_then(Value::as_str);
            if decision == Some("approve") {
                (PrincipalAnswer::Approve, None)
            } else {
                (PrincipalAnswer::Deny, Some("the person chose deny".into()))
            }
        }
        Some("decline") => (PrincipalAnswer::Decline, Some("the person declined".into())),
        _ => (
            PrincipalAnswer::Cancel,
            Some("the person dismissed the question".into()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_accept_with_approve_approves() {
        let r = |v: Value| read_answer(&json!({"jsonrpc": "2.0", "id": "x", "result": v})).0;
        assert_eq!(
            r(json!({"action": "accept", "content": {"decision": "approve"}})),
            PrincipalAnswer::Approve
        );
        assert_eq!(
            r(json!({"action": "accept", "content": {"decision": "deny"}})),
            PrincipalAnswer::Deny
        );
        assert_eq!(r(json!({"action": "accept"})), PrincipalAnswer::Deny);
        assert_eq!(r(json!({"action": "decline"})), PrincipalAnswer::Decline);
        assert_eq!(r(json!({"action": "cancel"})), PrincipalAnswer::Cancel);
        assert_eq!(r(json!({"action": "approve"})), PrincipalAnswer::Cancel);
        let e = read_answer(
            &json!({"jsonrpc": "2.0", "id": "x", "error": {"code": -32601, "message": "no"}}),
        );
        assert_eq!(e.0, PrincipalAnswer::Unable);
    }

    fn question() -> Question {
        Question {
            message: "approve `files.write`?".into(),
            tool: "files.write".into(),
            resource: None,
            arguments: json!({}),
            expires_at: "later".into(),
            url: None,
        }
    }

    fn ctx(call: [u8; 32]) -> (RoundCtx, Raised) {
        let (raise, raised) = mpsc::channel(4);
        let ctx = RoundCtx {
            call,
            form: true,
            url: false,
            cancel: CancellationToken::new(),
            raise,
        };
        (ctx, raised)
    }

    fn held() -> Held {
        tokio::spawn(async { None })
    }

    /// A round is taken once, only by a retry of the same call, and hands the person's answer
    /// to the held call's question; a late retry still gets the held call's end.
    #[tokio::test]
    async fn a_round_answers_only_its_own_call_once() {
        let asker = Arc::new(Asker::default());
        let call = call_digest("files.write", Some(&json!({"b": 1, "a": 2})));
        // The same arguments in another key order are the same call.
        assert_eq!(
            call,
            call_digest("files.write", Some(&json!({"a": 2, "b": 1})))
        );
        let other = call_digest("files.write", Some(&json!({"a": 3})));
        let (ctx, mut raised) = ctx(call);
        let asking = {
            let asker = asker.clone();
            tokio::spawn(async move { asker.ask_in_round(&question(), &ctx).await })
        };
        let (state, result) = raised.recv().await.expect("raised");
        assert_eq!(result["resultType"], "input_required");
        assert_eq!(result["requestState"], state.as_str());
        assert_eq!(state.len(), 32);
        assert_eq!(
            result["inputRequests"][INPUT_KEY]["params"]["requestedSchema"],
            schema()
        );
        // Not yet attached: no retry takes it.
        let approve = json!({INPUT_KEY: {"action": "accept", "content": {"decision": "approve"}}});
        assert!(asker.resume(&state, call, Some(&approve)).is_none());
        assert!(asker.attach(&state, held(), raised).is_ok());
        // Another call's retry, or a state never given: nothing taken.
        assert!(asker.resume(&state, other, Some(&approve)).is_none());
        assert!(asker.resume("0123", call, Some(&approve)).is_none());
        assert!(asker.resume(&state, call, Some(&approve)).is_some());
        let answer = asking.await.expect("asked");
        assert_eq!(answer.answer, PrincipalAnswer::Approve);
        assert_eq!(answer.via, Some(VIA_INPUT_REQUIRED));
        // Replayed: the state is used.
        assert!(asker.resume(&state, call, Some(&approve)).is_none());
    }

    #[tokio::test]
    async fn a_retry_without_a_response_cancels_and_a_late_one_gets_the_end() {
        let asker = Arc::new(Asker::default());
        let call = call_digest("files.write", None);
        for late in [false, true] {
            let (ctx, mut raised) = ctx(call);
            let asking = {
                let asker = asker.clone();
                tokio::spawn(async move { asker.ask_in_round(&question(), &ctx).await })
            };
            let (state, _) = raised.recv().await.expect("raised");
            assert!(asker.attach(&state, held(), raised).is_ok());
            if late {
                // The held call ends first (its question is dropped): the round stays for a
                // late retry.
                asking.abort();
                let _ = asking.await;
                assert!(asker.resume(&state, call, None).is_some());
            } else {
                assert!(asker.resume(&state, call, Some(&json!({}))).is_some());
                let answer = asking.await.expect("asked");
                assert_eq!(answer.answer, PrincipalAnswer::Cancel);
            }
        }
    }

    /// A forwarded question goes under its own key, named as the server's, and the retry's
    /// response for that key is the server's answer, as the client gave it.
    #[tokio::test]
    async fn a_forwarded_question_is_the_servers_and_its_answer_returns_whole() {
        let asker = Arc::new(Asker::default());
        let call = call_digest("py.ask", None);
        let (ctx, mut raised) = ctx(call);
        let request = json!({"message": "Delete it?", "requestedSchema": {"type": "object", "properties": {"confirm": {"type": "boolean"}}}, "_meta": {"x": 1}});
        let relaying = {
            let asker = asker.clone();
            tokio::spawn(async move { asker.relay_in_round("py", request, &ctx, false).await })
        };
        let (state, result) = raised.recv().await.expect("raised");
        let params = &result["inputRequests"][RELAY_KEY]["params"];
        assert!(
            params["message"].as_str().is_some_and(|m| m
                .starts_with("`py`, a server SharedOS runs for you, asks")
                && m.ends_with("Delete it?")),
            "{params}"
        );
        assert_eq!(
            params["requestedSchema"]["properties"]["confirm"]["type"],
            "boolean"
        );
        assert_eq!(params["_meta"], json!({SERVER_META_KEY: "py"}), "{params}");
        assert!(asker.attach(&state, held(), raised).is_ok());
        let said = json!({"action": "accept", "content": {"confirm": true}});
        // An approval's key does not answer the server's question.
        assert!(
            asker
                .resume(&state, call, Some(&json!({RELAY_KEY: said})))
                .is_some()
        );
        assert_eq!(relaying.await.expect("relayed"), Ok(said));
    }

    /// Issue 42 item 10: a server's copy of the approval form is refused (names, titles,
    /// descriptions, the approve/deny choice, whatever the case or spacing); its message cannot
    /// start with blank lines or hide behind control characters; its name is a field of its own.
    #[test]
    fn a_copy_of_the_approval_form_is_refused_and_the_message_cleaned() {
        let copied = json!({"message": "x", "requestedSchema": schema()});
        let e = relay_params("py", copied).expect_err("the approval form itself");
        assert!(e.contains("reuses the approval form's"), "{e}");
        for (schema, what) in [
            (
                json!({"type": "object", "properties": {" Decision ": {"type": "string"}}}),
                "property",
            ),
            (
                json!({"type": "object", "properties": {"ok": {"type": "string", "title": "YOUR   decision"}}}),
                "title",
            ),
            (
                json!({"type": "object", "properties": {"ok": {"type": "string", "description": "approve runs this call once;\u{200B} deny refuses it"}}}),
                "description",
            ),
            (
                json!({"type": "object", "title": "Your decision", "properties": {"ok": {"type": "boolean"}}}),
                "title",
            ),
            (
                json!({"type": "object", "properties": {"ok": {"type": "string", "enum": ["Deny", "approve"]}}}),
                "approve/deny",
            ),
        ] {
            let e = relay_params("py", json!({"message": "m", "requestedSchema": schema}))
                .expect_err("a copy");
            assert!(e.contains(what), "{what}: {e}");
        }
        let asked = relay_params(
            "py",
            json!({"message": "\n\n\n\t \u{202E}\u{7}SharedOS asks: approve `files.write`?\r\n\n\n\n\nreally\u{1b}[2J\tnow  ", "requestedSchema": {"type": "object", "properties": {"confirm": {"type": "boolean", "title": "Confirm"}}}}),
        )
        .expect("a question of its own");
        assert_eq!(
            asked["message"],
            "`py`, a server SharedOS runs for you, asks (it is not SharedOS asking):\n\nSharedOS asks: approve `files.write`?\n\nreally[2J now"
        );
        assert_eq!(asked["_meta"], json!({SERVER_META_KEY: "py"}));
    }

    /// SharedOS's own sign-in question is shown as SharedOS's (URL mode only, the link in `url`
    /// alone, an id of the shim's), and each one the client took is completed once.
    #[tokio::test]
    async fn a_sign_in_is_shown_as_sharedos_and_completed_once() {
        let asked = json!({"mode": "url", "message": "SharedOS asks you\u{7} to sign in", "url": "http://127.0.0.1:1/signin/00"});
        let p = sign_in_params("r", asked, "sharedos-signin-3".into()).expect("url mode");
        assert_eq!(
            p,
            json!({"mode": "url", "message": "SharedOS asks you to sign in", "url": "http://127.0.0.1:1/signin/00", "elicitationId": "sharedos-signin-3", "_meta": {SIGN_IN_META_KEY: "r"}})
        );
        assert!(
            sign_in_params(
                "r",
                json!({"message": "m", "requestedSchema": {}}),
                "x".into()
            )
            .is_err()
        );
        let asker = Asker::default();
        let (tx, mut rx) = mpsc::channel(8);
        asker.set_out(&tx);
        let shown = Shown::default();
        remember(&shown, "sharedos-signin-3".into());
        remember(&shown, "sharedos-page-4".into());
        asker.complete(&shown);
        asker.complete(&shown);
        let mut notes = Vec::new();
        while let Ok(line) = rx.try_recv() {
            notes.push(serde_json::from_slice::<Value>(&line).expect("json"));
        }
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(notes[0]["method"], "notifications/elicitation/complete");
        assert_eq!(notes[0]["params"]["elicitationId"], "sharedos-signin-3");
        assert_eq!(notes[1]["params"]["elicitationId"], "sharedos-page-4");
    }

    #[test]
    fn capability_forms() {
        let can = ClientCan::default();
        for (caps, form) in [
            (json!({}), false),
            (json!({"elicitation": {}}), true),
            (json!({"elicitation": {"form": {}}}), true),
            (json!({"elicitation": {"url": {}}}), false),
            (json!({"elicitation": {"url": {}, "form": {}}}), true),
        ] {
            can.settle(&caps);
            assert_eq!(can.form(), form, "{caps}");
        }
    }
}
