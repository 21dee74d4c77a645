//! One `tools/call`: the referred call as the client sent it → a [`ToolCall`] (a portable name
//! mapped back to the canonical one) → the broker over the [`Link`] → its [`CallAnswer`], or the
//! shim's own answer ([`render::local_answer`]) when the broker cannot give one.

use std::sync::Arc;

use serde_json::Value;
use sharedos_proto::ToolCall;
use sharedos_proto::alias::PortableNames;
use sharedos_proto::ipc::CallAnswer;
use tokio_util::sync::CancellationToken;

use crate::ask::RoundCtx;
use crate::guard::Referral;
use crate::link::{Link, LinkDown, Waiting};
use crate::render;

/// Forwards calls to the broker. Cheap to clone: one per call task.
#[derive(Clone)]
pub struct Caller {
    link: Arc<Link>,
    /// Portable ↔ canonical names, when the client cannot carry a dot.
    portable: Option<Arc<PortableNames>>,
    /// Whole lines for stdout (newline included): the progress notifications of calls that
    /// wait for a person's approval. Weak: it never keeps stdout's writer from finishing.
    notes: Option<tokio::sync::mpsc::WeakSender<Vec<u8>>>,
    /// Asks the person in the harness about calls held for their approval.
    asker: Arc<crate::ask::Asker>,
    /// The protocol `initialize` settled on (a 2026-07-28 client cannot be asked by request).
    protocol: crate::server::Negotiated,
}

/// The `notifications/progress` line (newline included) of a call waiting for approval.
pub fn progress_line(token: &Value, waiting: &Waiting, n: u64) -> Vec<u8> {
    let line = serde_json::json!({
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {
            "progressToken": token,
            "progress": n,
            "message": format!(
                "waiting for a person to approve this call (approval {}); refused at {} unless approved",
                waiting.approval, waiting.expires_at
            ),
        },
    });
    let mut bytes = line.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

impl Caller {
    pub fn new(
        link: Arc<Link>,
        portable: Option<Arc<PortableNames>>,
        asker: Arc<crate::ask::Asker>,
        protocol: crate::server::Negotiated,
    ) -> Self {
        Self {
            link,
            portable,
            notes: None,
            asker,
            protocol,
        }
    }

    /// Reports unparsable stdin lines to the broker (recorded as `malformed_frame`).
    pub async fn malformed(&self, bytes: u64, sha256: String, count: u64) {
        self.link.malformed(bytes, sha256, count).await;
    }

    /// Where progress notifications and questions to the person go (the session's stdout
    /// queue).
    pub fn set_notes(&mut self, notes: &tokio::sync::mpsc::Sender<Vec<u8>>) {
        self.notes = Some(notes.downgrade());
        self.asker.set_out(notes);
    }

    /// Sends a referred call to the broker; resolves with its answer (or the shim's own, when the
    /// broker cannot give one), or `None` when the client cancelled it (`cancel` fired). The one
    /// path for every `tools/call`, whatever the shape of its name and arguments.
    ///
    /// A 2026-07-28 call from a client that declares form- or URL-mode elicitation may instead resolve
    /// with an `input_required` result ([`Reply::InputRequired`]) when the broker asks its
    /// person: the held call goes on in a task of its own, which the client's retry takes up
    /// ([`Caller::resume`]).
    pub async fn call(&self, referral: Referral, cancel: &CancellationToken) -> Option<Reply> {
        let current = self.protocol.is_current(referral.protocol.as_deref());
        let asks = referral.elicit() == Some(true) || referral.elicit_url();
        if current && asks && referral.id.is_some() {
            return self.call_in_rounds(referral, cancel).await;
        }
        let call = self.held_call(referral, current, None);
        call.run(cancel).await.map(Reply::Answer)
    }

    /// A call whose person may be asked in `input_required` rounds: the held call runs on its
    /// own task, so that this call can be answered with a question while it goes on.
    async fn call_in_rounds(
        &self,
        referral: Referral,
        cancel: &CancellationToken,
    ) -> Option<Reply> {
        let digest = crate::ask::call_digest(&referral.tool, referral.arguments.as_ref());
        let (raise, raised) = tokio::sync::mpsc::channel(4);
        let held_cancel = CancellationToken::new();
        let round = RoundCtx {
            call: digest,
            form: referral.elicit() == Some(true),
            url: referral.elicit_url(),
            cancel: held_cancel.clone(),
            raise,
        };
        let call = self.held_call(referral, true, Some(round));
        let tool = call.tool.clone();
        let token = held_cancel.clone();
        let held = tokio::spawn(async move { call.run_to_end(&token).await });
        self.wait_held(&tool, held, raised, cancel, &held_cancel)
            .await
    }

    /// Waits on a held call for the request waiting on it (the call's own, or a retry): its
    /// answer, or the next `input_required` result it raises (the held call then waits for the
    /// retry that answers it), or `None` when the request is cancelled (and the held call with
    /// it).
    async fn wait_held(
        &self,
        tool: &str,
        mut held: crate::ask::Held,
        mut raised: crate::ask::Raised,
        cancel: &CancellationToken,
        held_cancel: &CancellationToken,
    ) -> Option<Reply> {
        let answer = |r: Result<Option<Result<CallAnswer, LinkDown>>, tokio::task::JoinError>| {
            r.ok().flatten().map(|r| {
                Reply::Answer(match r {
                    Ok(answer) => answer,
                    Err(why) => render::local_answer(tool, &why),
                })
            })
        };
        tokio::select! {
            biased;
            done = &mut held => answer(done),
            Some((state, result)) = raised.recv() => {
                match self.asker.attach(&state, held, raised) {
                    Ok(()) => Some(Reply::InputRequired(result)),
                    // The question ended before it could be returned (the held call ended
                    // with it): the call's own answer, then.
                    Err((held, _)) => answer(held.await),
                }
            }
            () = cancel.cancelled() => {
                held_cancel.cancel();
                None
            }
        }
    }

    /// A 2026-07-28 retry that answers a round: the client's response goes to the held call's
    /// question, and the held call's answer (or its next question) answers the retry. `None`
    /// (in the outer option) when the retry names no round of this call: it is a new call.
    pub async fn resume(
        &self,
        referral: &Referral,
        cancel: &CancellationToken,
    ) -> Option<Option<Reply>> {
        let resume = referral.resume()?;
        let digest = crate::ask::call_digest(&referral.tool, referral.arguments.as_ref());
        let Some(resumed) = self
            .asker
            .resume(&resume.state, digest, resume.responses.as_ref())
        else {
            tracing::info!(tool = %referral.tool, "a retry whose requestState names no question of this call (never asked, already answered, ended, or another call's): a new call");
            return None;
        };
        let tool = match &self.portable {
            Some(p) => p.canonical(&referral.tool).to_owned(),
            None => referral.tool.clone(),
        };
        Some(
            self.wait_held(&tool, resumed.held, resumed.raised, cancel, &resumed.cancel)
                .await,
        )
    }

    /// A referred call, ready to go to the broker.
    fn held_call(&self, referral: Referral, current: bool, round: Option<RoundCtx>) -> HeldCall {
        let Referral {
            id,
            tool: sent,
            arguments,
            rejected: rejected_arguments,
            protocol: _,
            trace,
            extras,
        } = referral;
        let token = extras.and_then(|e| e.progress);
        // A portable name is mapped back to the canonical one; any other string goes as sent.
        let tool = match &self.portable {
            Some(p) => p.canonical(&sent).to_owned(),
            None => sent,
        };
        let call = ToolCall {
            tool: tool.clone(),
            arguments,
            request_id: id.and_then(request_id_text),
            rejected_arguments,
            traceparent: trace.parent,
            tracestate: trace.state,
        };
        HeldCall {
            link: self.link.clone(),
            call,
            tool,
            progress: token.and_then(|t| Some((t, self.notes.clone()?))),
            asker: self.asker.clone(),
            current,
            round: round.map(Arc::new),
        }
    }
}

/// What a call resolves with.
#[allow(
    clippy::large_enum_variant,
    reason = "an answer is the common item: boxing it would cost every call an allocation"
)]
pub enum Reply {
    /// The broker's answer (or the shim's own).
    Answer(CallAnswer),
    /// An `input_required` result (2026-07-28): the person is asked; the held call waits for
    /// the retry.
    InputRequired(Value),
}

/// One call on its way to the broker, owning all it needs (it may run on a task of its own).
struct HeldCall {
    link: Arc<Link>,
    call: ToolCall,
    /// The canonical tool name, for the shim's own answer.
    tool: String,
    /// The client's progress token and where notes go, when it asked for progress.
    progress: Option<(Value, tokio::sync::mpsc::WeakSender<Vec<u8>>)>,
    asker: Arc<crate::ask::Asker>,
    current: bool,
    /// Its `input_required` rounds (a 2026-07-28 client that declares elicitation).
    round: Option<Arc<RoundCtx>>,
}

impl HeldCall {
    /// The broker's answer, or the shim's own when the broker cannot give one; `None` when
    /// `cancel` fired.
    async fn run(self, cancel: &CancellationToken) -> Option<CallAnswer> {
        let tool = self.tool.clone();
        match self.run_to_end(cancel).await {
            Some(Ok(answer)) => Some(answer),
            Some(Err(why)) => Some(render::local_answer(&tool, &why)),
            None => None,
        }
    }

    async fn run_to_end(self, cancel: &CancellationToken) -> Option<Result<CallAnswer, LinkDown>> {
        let HeldCall {
            link,
            call,
            tool,
            progress: token,
            asker,
            current,
            round,
        } = self;
        // Progress notes go to the call the client is waiting on: not once it was answered
        // with a question (its retry is another request).
        let in_round = round.is_some();
        let mut progress = |w: &Waiting, n: u64| {
            if n == 1 {
                tracing::info!(tool = %tool, approval = %w.approval, expires_at = %w.expires_at, "the call waits for a person's approval");
            }
            if let Some((token, notes)) = &token
                && !in_round
                && let Some(notes) = notes.upgrade()
            {
                // A progress note that finds stdout's queue full is dropped, not waited for.
                let _ = notes.try_send(progress_line(token, w, n));
            }
        };
        // The URL elicitations the client took for this call: completed when it ends.
        let shown = crate::ask::Shown::default();
        let ask = {
            let (asker, round, shown) = (asker.clone(), round.clone(), shown.clone());
            move |q: sharedos_proto::ipc::Question| {
                let (asker, round, shown) = (asker.clone(), round.clone(), shown.clone());
                Box::pin(async move {
                    match &round {
                        Some(round) => asker.ask_in_round(&q, round).await,
                        None => asker.ask(&q, current, &shown).await,
                    }
                })
                    as std::pin::Pin<
                        Box<dyn std::future::Future<Output = crate::link::Answer> + Send>,
                    >
            }
        };
        let relay = {
            let (asker, shown) = (asker.clone(), shown.clone());
            move |provider: String, request: Value, sign_in: bool| {
                let (asker, round, shown) = (asker.clone(), round.clone(), shown.clone());
                Box::pin(async move {
                    match &round {
                        Some(round) => {
                            asker
                                .relay_in_round(&provider, request, round, sign_in)
                                .await
                        }
                        None => asker.relay(&provider, request, sign_in, &shown).await,
                    }
                })
                    as std::pin::Pin<
                        Box<dyn std::future::Future<Output = Result<Value, String>> + Send>,
                    >
            }
        };
        let ended = link.call(call, cancel, &mut progress, &ask, &relay).await;
        if matches!(ended, Some(Ok(_))) {
            asker.complete(&shown);
        }
        ended
    }
}

/// A JSON-RPC request id as the record carries it: a string as is, a number as its text.
fn request_id_text(id: Value) -> Option<String> {
    match id {
        Value::String(s) => Some(s),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}
