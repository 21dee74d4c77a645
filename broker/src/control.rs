//! The control socket: the host's requests (open and close turns, catalogue, records, policy).
//!
//! Whoever may connect here may name any principal: only host uids get in. One response per
//! request, in order. Malformed input gets an `error` response naming the problem.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use interprocess::local_socket::tokio::Stream;
use interprocess::local_socket::traits::StreamCommon as _;
use serde_json::Value;
use sharedos_ipc::{FrameReader, IpcError, write_frame};
use sharedos_proto::alias::{self, Harness, PortableNames, SERVER_NAME};
use sharedos_proto::ipc::{
    ControlRequest, ControlResponse, OpenTurn, PROTOCOL_VERSION, TurnOpened,
};
use sharedos_proto::record::{self, Event};
use sharedos_proto::{DenyCode, Identifier, Outcome};

use crate::config::MAX_TTL;
use crate::evidence::record::rfc3339;
use crate::evidence::record::{PageBounds, read_records_page};
use crate::kernel::{AccessContext, Verdict};
use crate::state::Broker;
use crate::turn::{NewTurn, TokenFileTemplate, opened_record};

/// Most record lines returned by one `records` request.
pub const RECORDS_PAGE_MAX: u32 = 1000;
/// Most bytes of record lines returned by one `records` request: half the frame limit, so a page
/// always fits in its frame (a page stops before the line that would pass this; a longer line
/// is carried as a stand-in with its size and SHA-256, `lineDigest`).
pub const RECORDS_PAGE_MAX_BYTES: usize = sharedos_proto::frame::MAX_FRAME_BYTES / 2;
/// Deepest nesting a record line is carried at as it is: deeper, it is carried as a stand-in
/// (`lineDigest`), since its page must still decode in the reader (serde_json stops at 128). The
/// broker writes no line deeper than `MAX_ARGUMENT_DEPTH` + 1; an older record may hold one.
pub const RECORDS_LINE_MAX_DEPTH: usize = 100;

fn error(code: &str, message: impl Into<String>) -> ControlResponse {
    ControlResponse::Error {
        code: code.to_owned(),
        message: message.into(),
    }
}

type Reader = FrameReader<tokio::io::ReadHalf<Stream>>;
type Sender = tokio::io::WriteHalf<Stream>;

/// One host connection: a peer that is not a host is refused; a host says hello (with the
/// control key when it shares the broker's uid), then its requests are answered in order.
pub async fn serve(broker: Arc<Broker>, stream: Stream, pending: crate::admission::PendingHello) {
    let creds = stream.peer_creds().ok();
    let uid = creds.as_ref().and_then(|c| c.euid());
    let pid = creds.as_ref().and_then(|c| c.pid());
    let (recv, mut send) = tokio::io::split(stream);
    let mut reader = FrameReader::new(recv);
    let gate = pending.gate();
    let refused = |reason: &'static str| gate.refused(reason, uid, pid);
    if !broker.host_allowed(uid, pid.map(|p| p as u32)) {
        refused(crate::admission::refusal_reason(pid));
        tracing::warn!(
            ?uid,
            ?pid,
            "control connection from a uid that is not a host uid, or from a brokered upstream: refused"
        );
        refuse_non_host(&mut reader, &mut send, &pending).await;
        return;
    }
    // A newcomer may take this connection's place while it is silent: it is then closed.
    let hello = tokio::select! {
        h = tokio::time::timeout(pending.within(Duration::from_secs(10)), reader.next::<ControlRequest>()) => h,
        () = pending.evicted() => {
            refused("cap_reached");
            return;
        }
    };
    let greeted = match hello {
        Ok(Ok(ControlRequest::Hello { protocol, key })) => {
            greet(&broker, protocol, key.as_ref(), uid, pid)
        }
        Ok(Ok(_)) => Err((
            "not_hello",
            Refusal("not_hello", "the first frame must be hello".into()),
        )),
        Ok(Err(IpcError::Closed)) => return,
        Ok(Err(e)) => {
            if let Some(reason) = crate::admission::hello_error_reason(&e) {
                refused(reason);
            }
            let _ = write_frame(&mut send, &error("bad_frame", e.to_string())).await;
            return;
        }
        Err(_) => {
            refused("hello_too_slow");
            return;
        }
    };
    match greeted {
        Ok(welcome) => {
            drop(pending);
            if write_frame(&mut send, &welcome).await.is_ok() {
                answer(&broker, &mut reader, &mut send, uid).await;
            }
        }
        Err((reason, response)) => {
            refused(reason);
            let _ = write_frame(&mut send, &ControlResponse::from(response)).await;
        }
    }
}

/// A peer that is not a host: its hello is read first (bounded), so the refusal is not lost to
/// a reset on close.
async fn refuse_non_host(
    reader: &mut Reader,
    send: &mut Sender,
    pending: &crate::admission::PendingHello,
) {
    tokio::select! {
        _ = tokio::time::timeout(
            pending.within(std::time::Duration::from_secs(1)),
            reader.next::<ControlRequest>(),
        ) => {}
        () = pending.evicted() => return,
    }
    let _ = write_frame(
        send,
        &error(
            "forbidden",
            "this uid may not use the control socket (or this process is a brokered upstream's)",
        ),
    )
    .await;
}

/// A host's hello: the welcome, or why not (the admission reason and the `error` response).
fn greet(
    broker: &Broker,
    protocol: u32,
    key: Option<&sharedos_proto::ipc::TurnToken>,
    uid: Option<u32>,
    pid: Option<i32>,
) -> Result<ControlResponse, (&'static str, Refusal)> {
    if protocol != PROTOCOL_VERSION {
        let msg = format!(
            "protocol version {protocol} is not supported; this broker speaks {PROTOCOL_VERSION}"
        );
        return Err(("protocol_version", Refusal("protocol_version", msg)));
    }
    if !broker.control_key_ok(uid, key) {
        tracing::warn!(
            ?uid,
            ?pid,
            "control connection under the broker's uid without the control key: refused"
        );
        let msg = "a peer under the broker's uid must present the key in the runtime dir's control.key: this process may not read it";
        return Err(("bad_control_key", Refusal("forbidden", msg.into())));
    }
    Ok(ControlResponse::Welcome {
        protocol: PROTOCOL_VERSION,
        broker_version: env!("CARGO_PKG_VERSION").into(),
    })
}

/// The host's requests, answered in order until it closes or sends a bad frame.
async fn answer(broker: &Arc<Broker>, reader: &mut Reader, send: &mut Sender, uid: Option<u32>) {
    loop {
        let response = match reader.next::<ControlRequest>().await {
            Ok(req) => handle(broker, req, uid).await,
            Err(IpcError::Closed) => return,
            Err(e) => {
                let _ = write_frame(send, &error("bad_frame", e.to_string())).await;
                return;
            }
        };
        if write_frame(send, &response).await.is_err() {
            return;
        }
    }
}

/// A refused control request: the code and the message of its `error` response.
struct Refusal(&'static str, String);

impl From<Refusal> for ControlResponse {
    fn from(r: Refusal) -> Self {
        error(r.0, r.1)
    }
}

fn context(principal: &str, agent: Option<&str>) -> Result<AccessContext, Refusal> {
    let principal = Identifier::new(principal)
        .map_err(|e| Refusal("invalid_principal", format!("principal: {e}")))?;
    let agent = agent
        .map(|a| Identifier::new(a).map_err(|e| Refusal("invalid_agent", format!("agent: {e}"))))
        .transpose()?;
    Ok(AccessContext::new(
        &principal.to_string(),
        agent.map(|a| a.to_string()).as_deref(),
    ))
}

/// Most attributes one turn may carry, and the longest their canonical JSON may be.
pub const MAX_TURN_ATTRIBUTES: usize = 32;
pub const MAX_TURN_ATTRIBUTES_BYTES: usize = 4096;

/// The whole context of a turn: principal, agent, the agent's owner and the turn's attributes.
fn turn_context(open: &OpenTurn) -> Result<AccessContext, Refusal> {
    let mut ctx = context(&open.principal, open.agent.as_deref())?;
    if let Some(owner) = &open.agent_owner {
        if open.agent.is_none() {
            return Err(Refusal(
                "invalid_agent_owner",
                "an agent owner needs an agent: give --agent too".into(),
            ));
        }
        let owner = Identifier::new(owner)
            .map_err(|e| Refusal("invalid_agent_owner", format!("agent owner: {e}")))?;
        ctx.agent_owner = Some(owner.to_string());
    }
    if let Some(attrs) = &open.attributes {
        let bad = |m: String| Refusal("invalid_attributes", m);
        if attrs.len() > MAX_TURN_ATTRIBUTES {
            return Err(bad(format!(
                "{} attributes; a turn may carry at most {MAX_TURN_ATTRIBUTES}",
                attrs.len()
            )));
        }
        if let Some(k) = attrs
            .keys()
            .find(|k| k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return Err(bad(format!(
                "attribute name `{}` is not an identifier (ASCII letters, digits and `_`)",
                sharedos_proto::name::shown(k)
            )));
        }
        let text = sharedos_proto::catalog::canonical_json(&Value::Object(attrs.clone()))
            .map_err(|e| bad(e.to_string()))?;
        if text.len() > MAX_TURN_ATTRIBUTES_BYTES {
            return Err(bad(format!(
                "the attributes are {} bytes as JSON; at most {MAX_TURN_ATTRIBUTES_BYTES}",
                text.len()
            )));
        }
        if !attrs.is_empty() {
            ctx.turn = Some(text);
        }
    }
    Ok(ctx)
}

/// Longest reason a host may give with `approvals deny` (recorded, and shown to the model).
pub const MAX_APPROVAL_REASON_BYTES: usize = 500;

/// `uid`: the peer, a host uid (recorded as who decided an approval).
///
/// One function per request kind; this only dispatches.
async fn handle(broker: &Arc<Broker>, req: ControlRequest, uid: Option<u32>) -> ControlResponse {
    match req {
        ControlRequest::Hello { .. } => error("hello_again", "hello was already said"),
        ControlRequest::OpenTurn(open) => match open_turn(broker, *open).await {
            Ok(r) => r,
            Err(r) => r.into(),
        },
        ControlRequest::CloseTurn { turn } => close_turn(broker, turn).await,
        ControlRequest::ListTurns => list_turns(broker),
        ControlRequest::Catalog { principal, agent } => catalog(broker, &principal, agent),
        ControlRequest::Records {
            turn,
            after_seq,
            limit,
        } => records(broker, turn, after_seq, limit).await,
        ControlRequest::PolicyCheck {
            principal,
            agent,
            tool,
            arguments,
        } => policy_check(
            broker,
            &principal,
            agent.as_deref(),
            &tool,
            arguments.as_ref(),
        ),
        ControlRequest::Telemetry => telemetry(broker),
        ControlRequest::Approvals => {
            let (approvals, not_shown) = broker.kernel.approvals.listed();
            ControlResponse::Approvals {
                approvals,
                not_shown,
            }
        }
        ControlRequest::ApprovalArguments { id, offset } => approval_arguments(broker, id, offset),
        ControlRequest::DecideApproval {
            id,
            approve,
            reason,
        } => decide_approval(broker, id, approve, reason, uid),
        ControlRequest::Providers => ControlResponse::Providers {
            providers: broker.kernel.provider_statuses(),
        },
        ControlRequest::PinProviders => pin_providers(broker).await,
        ControlRequest::PolicyReload => policy_reload(broker).await,
    }
}

async fn close_turn(broker: &Arc<Broker>, turn: String) -> ControlResponse {
    if let Some(closed) = broker.close_turn(&turn, "host").await {
        ControlResponse::TurnClosed {
            turn,
            token_file: closed.token_file.as_ref().map(|p| p.display().to_string()),
        }
    } else {
        error(
            "no_such_turn",
            format!("no open turn `{}`", sharedos_proto::name::shown(&turn)),
        )
    }
}

fn list_turns(broker: &Arc<Broker>) -> ControlResponse {
    ControlResponse::Turns {
        turns: broker
            .turns
            .list()
            .iter()
            .map(|t| t.summary(&broker.kernel.budgets))
            .collect(),
    }
}

fn catalog(broker: &Arc<Broker>, principal: &str, agent: Option<String>) -> ControlResponse {
    match context(principal, agent.as_deref()) {
        Ok(ctx) => {
            let c = broker.kernel.catalog(&ctx);
            ControlResponse::Catalog {
                catalog_hash: c.hash.clone(),
                tools: c.tools.clone(),
                budgets: broker
                    .kernel
                    .budgets
                    .left(None, &ctx.principal, c.namespaces()),
            }
        }
        Err(e) => e.into(),
    }
}

/// One page of the record, read off the runtime's threads.
async fn records(
    broker: &Arc<Broker>,
    turn: Option<String>,
    after_seq: u64,
    limit: Option<u32>,
) -> ControlResponse {
    let limit = limit.unwrap_or(RECORDS_PAGE_MAX).clamp(1, RECORDS_PAGE_MAX) as usize;
    let path = broker.kernel.recorder.path().to_path_buf();
    let bounds = PageBounds {
        lines: limit,
        bytes: RECORDS_PAGE_MAX_BYTES,
        depth: RECORDS_LINE_MAX_DEPTH,
    };
    let read = tokio::task::spawn_blocking(move || {
        read_records_page(&path, turn.as_deref(), after_seq, &bounds)
    })
    .await;
    match read {
        Ok(Ok((lines, more))) => {
            let last_seq = lines
                .last()
                .and_then(|l| l.get("seq"))
                .and_then(Value::as_u64)
                .unwrap_or(after_seq);
            ControlResponse::Records {
                lines,
                last_seq,
                more,
            }
        }
        Ok(Err(e)) => error("record", e.to_string()),
        Err(e) => error("internal", e.to_string()),
    }
}

/// `policy check`: the decision a call would get, without running it. A check has no turn: the
/// catalogue is the principal's.
fn policy_check(
    broker: &Arc<Broker>,
    principal: &str,
    agent: Option<&str>,
    tool: &str,
    arguments: Option<&Value>,
) -> ControlResponse {
    let ctx = match context(principal, agent) {
        Ok(c) => c,
        Err(e) => return e.into(),
    };
    let catalog = broker.kernel.catalog(&ctx);
    let seen = broker.kernel.seen_context(&ctx, &catalog, tool, arguments);
    match broker.kernel.check(&ctx, &catalog, tool, arguments) {
        Verdict::Refused {
            outcome,
            message,
            requirement,
            policies,
        } => ControlResponse::Decision {
            decision: if matches!(outcome, Outcome::Denied(_)) {
                "deny"
            } else {
                "not_decided"
            }
            .into(),
            message: if outcome == Outcome::Denied(DenyCode::UnpublishedTool) {
                unpublished_message(principal, agent, tool)
            } else {
                message
            },
            outcome,
            requirement,
            policies,
            context: seen,
        },
        Verdict::Permitted {
            resolved,
            policies,
            approval,
            ..
        } => ControlResponse::Decision {
            decision: "allow".into(),
            outcome: Outcome::Succeeded,
            message: format!(
                "allow: {tool} of {} — permitted by {}{}",
                resolved.resource.short(),
                policies.join(", "),
                approval_words(approval)
            ),
            requirement: Some(resolved.resource.requirement(&resolved.action)),
            policies,
            context: seen,
        },
    }
}

fn unpublished_message(principal: &str, agent: Option<&str>, tool: &str) -> String {
    format!(
        "denied: `{}` is not a tool in the catalogue of {principal}{}; `sharedos-broker catalog --principal {principal}` lists what is",
        sharedos_proto::name::shown(tool),
        agent
            .map(|a| format!(" with agent {a}"))
            .unwrap_or_default(),
    )
}

/// What a permit that holds the call for approval adds to `policy check`'s answer.
fn approval_words(approval: Option<crate::policy::Approver>) -> &'static str {
    match approval {
        Some(crate::policy::Approver::Operator) => {
            ", once a person approves it (@approval(\"required\"))"
        }
        Some(crate::policy::Approver::Principal) => {
            ", once its principal approves it in the harness (@approval(\"principal\"))"
        }
        Some(crate::policy::Approver::PrincipalOrOperator) => {
            ", once its principal (in the harness) or an operator approves it (@approval(\"principal_or_operator\"))"
        }
        None => "",
    }
}

fn telemetry(broker: &Arc<Broker>) -> ControlResponse {
    let mut stats = broker.kernel.telemetry.stats();
    if let Some(w) = broker.kernel.recorder.witness()
        && w.enabled()
    {
        let (queued, witnessed, failed, dropped) = w.counts();
        stats.witness = sharedos_proto::ipc::WitnessCounts {
            enabled: true,
            queued,
            witnessed,
            failed,
            dropped,
        };
    }
    ControlResponse::Telemetry(stats)
}

fn no_such_approval(shown: &str) -> ControlResponse {
    error(
        "no_such_approval",
        format!(
            "no call is waiting for approval `{shown}` (`sharedos-broker approvals` lists those that are)"
        ),
    )
}

/// A part of a waiting call's arguments, from `offset`, cut at a character boundary.
fn approval_arguments(broker: &Arc<Broker>, id: String, offset: usize) -> ControlResponse {
    let shown = sharedos_proto::name::shown(&id);
    let Some(text) = broker.kernel.approvals.arguments_text(&id) else {
        return no_such_approval(&shown);
    };
    if offset > text.len() || !text.is_char_boundary(offset) {
        return error(
            "bad_offset",
            format!(
                "offset {offset} is not where a part of approval `{shown}`'s arguments starts ({} bytes)",
                text.len()
            ),
        );
    }
    let mut end = (offset + crate::approval::APPROVAL_ARGUMENTS_PART_BYTES).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ControlResponse::ApprovalArguments {
        id,
        offset,
        text: text[offset..end].to_owned(),
        bytes: text.len(),
        sha256: sharedos_proto::catalog::sha256_hex(text.as_bytes()),
        more: end < text.len(),
    }
}

/// An operator's decision (`approvals approve|deny`); `uid` is recorded as who decided.
fn decide_approval(
    broker: &Arc<Broker>,
    id: String,
    approve: bool,
    mut reason: Option<String>,
    uid: Option<u32>,
) -> ControlResponse {
    use crate::approval::DecideError;
    if let Some(r) = reason.as_mut() {
        sharedos_proto::name::clip(r, MAX_APPROVAL_REASON_BYTES);
    }
    let decision = crate::approval::Decision::operator(approve, uid, reason);
    let shown = sharedos_proto::name::shown(&id);
    match broker.kernel.approvals.decide(&id, decision) {
        Ok(()) => ControlResponse::ApprovalDecided {
            id,
            decision: if approve { "approved" } else { "denied" }.into(),
        },
        Err(DecideError::AlreadyDecided(_)) => error(
            "approval_decided",
            format!("approval `{shown}` was already decided: an approval id is used once"),
        ),
        Err(DecideError::PrincipalOnly(_)) => error(
            "principal_only",
            format!(
                "approval `{shown}` is for the call's principal to give in the harness (`@approval(\"principal\")`): an operator cannot decide it"
            ),
        ),
        Err(DecideError::Unknown(_) | DecideError::NotAsked(_)) => no_such_approval(&shown),
    }
}

/// `providers pin`: the brokered providers' current upstream hashes written to the pins file,
/// each provider told, and the pins recorded.
async fn pin_providers(broker: &Arc<Broker>) -> ControlResponse {
    let registry = broker.kernel.registry();
    let pins: BTreeMap<String, String> = registry
        .providers
        .iter()
        .filter_map(|p| Some((p.namespace().to_owned(), p.upstream_hash()?)))
        .collect();
    let Some(pin_store) = registry.pins.as_ref() else {
        return error("no_providers", "no brokered providers are configured");
    };
    let pin_file = pin_store.path.clone();
    match pin_store.write(&pins) {
        Ok(all) => {
            for p in &registry.providers {
                p.clone().repin().await;
            }
            let line = Event::ProvidersPinned(record::ProvidersPinned {
                pins: all.clone(),
                turn: None,
            });
            if let Err(e) = broker.kernel.recorder.append(&line).await {
                tracing::error!(error = %e, "providers_pinned not recorded");
            }
            ControlResponse::Pinned {
                path: pin_file
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                pins: all,
            }
        }
        Err(e) => error("pins", e.to_string()),
    }
}

/// `policy reload`: a new policy set in force, recorded; an invalid one leaves the old in force.
async fn policy_reload(broker: &Arc<Broker>) -> ControlResponse {
    match broker.kernel.policy.reload() {
        Ok(pv) => {
            let line = Event::PolicyReloaded(record::PolicyReloaded {
                version: pv.version,
                policies: pv.count,
                path: broker.kernel.policy.policy_path().display().to_string(),
                policy_digest: Some(pv.digest()),
                turn: None,
            });
            if let Err(e) = broker.kernel.recorder.append(&line).await {
                tracing::error!(error = %e, "policy_reloaded not recorded");
            }
            ControlResponse::PolicyReloaded {
                version: pv.version,
                policies: pv.count,
            }
        }
        Err(e) => error(
            "policy_invalid",
            format!("{e}\nthe previous policy set stays in force"),
        ),
    }
}

/// `turn open`: the request checked, the turn's catalogue computed and named for its harness, the
/// turn inserted and recorded, its TTL armed.
async fn open_turn(broker: &Arc<Broker>, open: OpenTurn) -> Result<ControlResponse, Refusal> {
    let (ctx, token_file, ttl) = checked_open(broker, &open)?;
    let subject = open
        .subject_token
        .as_ref()
        .map(|t| crate::secrets::Secret::new(t.expose().to_owned()));
    if let Some(s) = &subject {
        // Redacted from here on, like a secret; the providers that exchange it hear of it (one
        // waiting to list its tools as this principal lists them first, so this turn has them).
        broker
            .kernel
            .known_secrets
            .add(&ctx.principal, "subject token", s);
        broker.kernel.subject_tokens.give(&ctx.principal, s).await;
    }
    let catalog = broker.kernel.catalog(&ctx);
    let mut identity = open.system_identity.clone();
    if let Some(id) = identity.as_mut() {
        id.catalog_hash = Some(catalog.hash.clone());
        id.broker_version = Some(env!("CARGO_PKG_VERSION").into());
    }
    let (aliases, warnings) = harness_names(broker, &open, &ctx, &catalog)?;
    let new = NewTurn {
        context: ctx,
        catalog,
        ttl,
        tool_policy: open.tool_policy,
        system_identity: identity,
        harness: open.harness,
        portable_names: open.portable_names,
        aliases,
        token_file,
        budget_slots: broker.kernel.budgets.slots(),
        subject_token: subject,
    };
    let turn = broker
        .turns
        .insert(new, &broker.root)
        .map_err(|e| Refusal("internal", format!("no randomness for a token: {e}")))?;
    if let Err(e) = broker.kernel.recorder.append(&opened_record(&turn)).await {
        broker.turns.remove(&turn.id);
        return Err(Refusal("record", format!("cannot record the turn: {e}")));
    }
    // TTL: the turn closes itself when it expires.
    let (b, id, cancel) = (broker.clone(), turn.id.clone(), turn.cancel.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(ttl) => { b.close_turn(&id, "ttl").await; }
            _ = cancel.cancelled() => {}
        }
    });
    Ok(ControlResponse::TurnOpened(TurnOpened {
        turn: turn.id.clone(),
        token: turn.token().clone(),
        catalog_hash: turn.catalog.hash.clone(),
        tools: turn.catalog.tools.clone(),
        expires_at: rfc3339(turn.expires_at),
        warnings,
        token_file: turn.token_file.as_ref().map(|p| p.display().to_string()),
    }))
}

/// What `turn open` asks for, checked: the access context, the token file's template and the
/// TTL. Attributes the schema does not declare, or an owner it has no place for, are refused
/// here by name, rather than denying every call of the turn.
fn checked_open(
    broker: &Broker,
    open: &OpenTurn,
) -> Result<(AccessContext, Option<TokenFileTemplate>, Duration), Refusal> {
    let ctx = turn_context(open)?;
    let token_file = open
        .token_file
        .as_deref()
        .map(TokenFileTemplate::parse)
        .transpose()
        .map_err(|e| Refusal("invalid_token_file", e))?;
    if let Some(t) = &open.subject_token {
        let t = t.expose();
        if t.is_empty()
            || t.len() > 64 * 1024
            || t.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(Refusal(
                "invalid_subject_token",
                "the subject token is empty, over 64 KiB, or has whitespace or control characters in it (it is not shown)".into(),
            ));
        }
    }
    broker
        .kernel
        .check_context(&ctx)
        .map_err(|e| Refusal("invalid_attributes", e))?;
    if let Some(policy) = &open.tool_policy {
        policy
            .validate(open.harness.is_some() || open.system_identity.is_some())
            .map_err(|e| Refusal("invalid_tool_policy", e.to_string()))?;
    }
    if let Some(identity) = &open.system_identity {
        identity
            .validate()
            .map_err(|e| Refusal("invalid_system_identity", e.to_string()))?;
    }
    let ttl = match open.ttl_seconds {
        Some(0) => {
            return Err(Refusal(
                "invalid_ttl",
                "ttl must be at least 1 second".into(),
            ));
        }
        Some(s) => Duration::from_secs(s).min(MAX_TTL),
        None => broker.config.default_ttl,
    };
    Ok((ctx, token_file, ttl))
}

/// The catalogue's names as the turn's harness will show them (or every harness whose naming is
/// known), with what the host should hear about them.
fn harness_names(
    broker: &Broker,
    open: &OpenTurn,
    ctx: &AccessContext,
    catalog: &crate::kernel::Catalog,
) -> Result<(BTreeMap<String, alias::AliasReport>, Vec<String>), Refusal> {
    let names: Vec<&sharedos_proto::ToolName> = catalog.tools.iter().map(|t| &t.name).collect();
    if open.portable_names {
        PortableNames::new(names.iter().copied()).map_err(|e| {
            Refusal(
                "portable_names",
                format!("{e}; portable names cannot be used for this catalogue"),
            )
        })?;
    }
    let harnesses: Vec<Harness> = match open.harness.as_deref().map(Harness::parse) {
        Some(Some(h)) => vec![h],
        _ => Harness::ALL.to_vec(),
    };
    let mut aliases = BTreeMap::new();
    let mut warnings = Vec::new();
    if catalog.tools.is_empty() {
        warnings.push(format!(
            "the catalogue of {} is empty: no policy permits any of the {} registered tools, so the harness will see none",
            ctx.principal,
            broker.kernel.registry().len()
        ));
    }
    for h in harnesses {
        if h.alias(SERVER_NAME, "x").is_none() {
            continue;
        }
        let report = alias::aliases(h, SERVER_NAME, names.iter().copied());
        warnings.extend(report.problems.iter().cloned());
        aliases.insert(h.as_str().to_owned(), report);
    }
    Ok((aliases, warnings))
}
