//! The person's page (`[page]`, issue 45): where the person an agent acts for signs in with the
//! operator's OpenID Connect provider and decides the calls held for their own approval
//! (`@approval("principal")`), out of the agent's reach.
//!
//! Served by the broker itself, on a TCP listener of its own (HTTPS with the operator's
//! certificate; plain HTTP only on a loopback address), beside `bridge.sock` and
//! `control.sock` and reachable through neither. In the broker because the waiting calls are
//! in its memory: a companion process would need a channel of its own into the approvals
//! table, one more door to guard, for nothing the page needs.
//!
//! - Sign-in: the authorization code flow with PKCE S256, `state` and `nonce`, the ID token
//!   verified ([`oidc`]); the configured claim names the principal. The session is a cookie of
//!   256 random bits (`HttpOnly`, `SameSite=Strict`, `Secure` and the `__Host-` prefix under
//!   HTTPS) naming a session kept here, never a token of the provider.
//! - Every form carries the session's CSRF token (compared in constant time), and a POST whose
//!   `Origin` is not the page's is refused.
//! - A link carries a one-time id only (128 random bits), bound to one waiting approval; it
//!   decides once, and only for the principal the call names.
//! - Every refused decision is recorded (`approval_answer_refused`, `via: page`), and every
//!   sign-in to a remote server that does not finish (`provider_state` `sign_in_refused`, with
//!   its code), at most [`REFUSALS_RECORDED_PER_MINUTE`] lines a minute together (the rest are
//!   counted in the log).

pub mod oidc;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::get;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sharedos_proto::record::{ApprovalAnswerRefused, Event};
use subtle::ConstantTimeEq as _;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::approval::{LinkError, OnPage, PageDecider};
use crate::config::PageConfig;
use crate::error::StartError;
use crate::lock;
use crate::state::Broker;

/// How long a session lasts after sign-in.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// How long a started sign-in waits for the provider to send the person back.
pub const LOGIN_LIFETIME: Duration = Duration::from_secs(600);
/// Most sessions and started sign-ins kept at once (the oldest go first).
pub const MAX_SESSIONS: usize = 4096;
/// Most refusals recorded per minute; the rest are counted in the log.
pub const REFUSALS_RECORDED_PER_MINUTE: u32 = 120;
/// Time for a TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest form body read.
const MAX_FORM_BYTES: usize = 8 * 1024;

struct Session {
    principal: String,
    subject: String,
    csrf: String,
    until: Instant,
}

struct Login {
    nonce: String,
    verifier: String,
    next: String,
    until: Instant,
}

/// The page's state.
pub struct Page {
    broker: Arc<Broker>,
    config: PageConfig,
    oidc: oidc::Oidc,
    https: bool,
    /// The page's origin as browsers send it in `Origin`.
    origin: String,
    sessions: Mutex<HashMap<String, Session>>,
    logins: Mutex<HashMap<String, Login>>,
    refusals: Mutex<(Instant, u32)>,
}

type Shared = Arc<Page>;

/// Where a refused request came from, and what it named.
struct Refusal<'a> {
    code: &'static str,
    reason: String,
    approval: Option<&'a OnPage>,
    approval_named: Option<String>,
    session: Option<(&'a str, &'a str)>,
    peer: SocketAddr,
}

/// The session cookie's name: under HTTPS with the `__Host-` prefix (the browser then keeps it
/// only `Secure`, for this host alone, on path `/`).
fn cookie_name(https: bool) -> &'static str {
    if https {
        "__Host-sharedos-page"
    } else {
        "sharedos-page"
    }
}

/// The `Set-Cookie` of a session (`max_age` 0: its end).
fn cookie_header(https: bool, value: &str, max_age: u64) -> String {
    let secure = if https { "; Secure" } else { "" };
    format!(
        "{}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}",
        cookie_name(https)
    )
}

impl Page {
    fn cookie_name(&self) -> &'static str {
        cookie_name(self.https)
    }

    /// The signed-in person of this request's cookie: principal, subject, CSRF token.
    fn session(&self, headers: &HeaderMap) -> Option<(String, String, String)> {
        let name = self.cookie_name();
        let id = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())?;
        let mut sessions = lock(&self.sessions);
        match sessions.get(&id) {
            Some(s) if s.until > Instant::now() => {
                Some((s.principal.clone(), s.subject.clone(), s.csrf.clone()))
            }
            Some(_) => {
                sessions.remove(&id);
                None
            }
            None => None,
        }
    }

    fn new_session(&self, person: oidc::Person) -> Result<String, String> {
        let id = oidc::random(32)?;
        let csrf = oidc::random(32)?;
        let mut sessions = lock(&self.sessions);
        let now = Instant::now();
        sessions.retain(|_, s| s.until > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.until)
                .map(|(k, _)| k.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            id.clone(),
            Session {
                principal: person.principal,
                subject: person.subject,
                csrf,
                until: now + SESSION_LIFETIME,
            },
        );
        Ok(id)
    }

    fn cookie(&self, value: &str, max_age: u64) -> String {
        cookie_header(self.https, value, max_age)
    }

    /// Counts a refusal: whether it may be recorded (at most
    /// [`REFUSALS_RECORDED_PER_MINUTE`] a minute; the rest are in the log only).
    fn count_refusal(&self) -> bool {
        let mut n = lock(&self.refusals);
        if n.0.elapsed() >= Duration::from_secs(60) {
            *n = (Instant::now(), 0);
        }
        n.1 += 1;
        n.1 <= REFUSALS_RECORDED_PER_MINUTE
    }

    /// Records a refusal (bounded per minute) and logs it.
    async fn refuse(&self, r: Refusal<'_>) {
        tracing::warn!(code = r.code, reason = %r.reason, peer = %r.peer, "the person's page refused a request");
        if !self.count_refusal() {
            return;
        }
        let mut named = r.approval_named;
        if let Some(a) = named.as_mut() {
            sharedos_proto::name::clip(a, 80);
        }
        let line = Event::ApprovalAnswerRefused(ApprovalAnswerRefused {
            approval: r.approval.map(|a| a.info.id.clone()).or(named),
            turn: r.approval.map(|a| a.info.turn.clone()),
            via: "page".into(),
            code: r.code.into(),
            reason: r.reason,
            principal: r.session.map(|s| s.0.to_owned()),
            subject: r.session.map(|s| s.1.to_owned()),
            bridge: None,
            peer: Some(r.peer.to_string()),
        });
        if let Err(e) = self.broker.kernel.recorder.append(&line).await {
            tracing::error!(error = %e, "a refusal of the person's page not recorded");
        }
    }
}

/// HTML-escapes `s`.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn page(title: &str, body: &str) -> Html<String> {
    Html(format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{t}</title>\
         <meta name=\"referrer\" content=\"same-origin\"></head>\
         <body><h1>{t}</h1>{body}</body></html>",
        t = esc(title)
    ))
}

/// A response no cache keeps, framed by nobody.
fn guarded(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'none'; form-action 'self'; frame-ancestors 'none'"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    r
}

fn status_page(status: StatusCode, title: &str, text: &str) -> Response {
    guarded(
        (
            status,
            page(title, &format!("<p id=\"message\">{}</p>", esc(text))),
        )
            .into_response(),
    )
}

/// The query's `key`.
fn query(uri: &Uri, key: &str) -> Option<String> {
    form_urlencoded::parse(uri.query()?.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

fn form(body: &Bytes) -> HashMap<String, String> {
    form_urlencoded::parse(body).into_owned().collect()
}

/// A link id as the page makes them: 32 hex digits.
fn link_shape(link: &str) -> bool {
    link.len() == 32 && link.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Sends the person to sign in, back to `next` after.
fn to_sign_in(next: &str) -> Response {
    let mut to = String::from("/login?next=");
    to.extend(form_urlencoded::byte_serialize(next.as_bytes()));
    guarded(Redirect::to(&to).into_response())
}

async fn home(State(p): State<Shared>, headers: HeaderMap) -> Response {
    let Some((principal, _, csrf)) = p.session(&headers) else {
        return guarded(
            page(
                "SharedOS approvals",
                "<p>Sign in to see the calls waiting for your approval.</p>\
                 <p><a id=\"sign-in\" href=\"/login?next=/\">Sign in</a></p>",
            )
            .into_response(),
        );
    };
    let waiting = p.broker.kernel.approvals.on_page_for(&principal);
    let mut body = format!(
        "<p>Signed in as <b id=\"principal\">{}</b>.</p>",
        esc(&principal)
    );
    if waiting.is_empty() {
        body.push_str("<p id=\"none\">No call waits for your approval.</p>");
    } else {
        body.push_str("<ul id=\"waiting\">");
        for w in &waiting {
            body.push_str(&format!(
                "<li><a href=\"/approval/{}\">{}</a> (turn {}, until {})</li>",
                esc(&w.link),
                esc(&w.info.tool),
                esc(&w.info.turn),
                esc(&w.info.expires_at)
            ));
        }
        body.push_str("</ul>");
    }
    if let Some(signins) = &p.broker.kernel.signins {
        // The remote servers people sign in to: this person's sign-in to each, and its end.
        body.push_str("<h2>Remote servers</h2><ul id=\"servers\">");
        for ns in signins.providers() {
            if signins.signed_in(&principal, &ns) {
                body.push_str(&format!(
                    "<li id=\"server-{ns}\"><code>{ns}</code>: signed in \
                     <form method=\"post\" action=\"/connect/{ns}/signout\">\
                     <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
                     <button type=\"submit\">Sign out of {ns}</button></form></li>",
                    esc(&csrf),
                    ns = esc(&ns)
                ));
            } else {
                body.push_str(&format!(
                    "<li id=\"server-{ns}\"><code>{ns}</code>: not signed in \
                     (<a href=\"/connect/{ns}\">sign in</a>)</li>",
                    ns = esc(&ns)
                ));
            }
        }
        body.push_str("</ul>");
    }
    body.push_str(&format!(
        "<form method=\"post\" action=\"/logout\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
         <button type=\"submit\">Sign out</button></form>",
        esc(&csrf)
    ));
    guarded(page("Waiting for your approval", &body).into_response())
}

async fn login(State(p): State<Shared>, uri: Uri) -> Response {
    // Only a path of this page: never another site.
    let next = query(&uri, "next")
        .filter(|n| {
            n == "/"
                || (n.starts_with("/approval/") && link_shape(&n[10..]))
                || (n.starts_with("/signin/") && link_shape(&n[8..]))
                || n.strip_prefix("/connect/")
                    .is_some_and(|ns| crate::secrets::check_name("provider", ns).is_ok())
        })
        .unwrap_or_else(|| "/".into());
    let started = match p.oidc.start().await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "sign-in could not start");
            return status_page(StatusCode::BAD_GATEWAY, "Sign-in failed", &e.to_string());
        }
    };
    {
        let mut logins = lock(&p.logins);
        let now = Instant::now();
        logins.retain(|_, l| l.until > now);
        if logins.len() >= MAX_SESSIONS {
            return status_page(
                StatusCode::SERVICE_UNAVAILABLE,
                "Sign-in failed",
                "too many sign-ins are under way; try again in a few minutes",
            );
        }
        logins.insert(
            started.state.clone(),
            Login {
                nonce: started.nonce,
                verifier: started.verifier,
                next,
                until: now + LOGIN_LIFETIME,
            },
        );
    }
    guarded(Redirect::to(started.url.as_str()).into_response())
}

async fn callback(State(p): State<Shared>, uri: Uri) -> Response {
    if let Some(error) = query(&uri, "error") {
        return status_page(
            StatusCode::FORBIDDEN,
            "Sign-in failed",
            &format!("the identity provider said: {error}"),
        );
    }
    let (Some(code), Some(state)) = (query(&uri, "code"), query(&uri, "state")) else {
        return status_page(
            StatusCode::BAD_REQUEST,
            "Sign-in failed",
            "the identity provider sent no code and state",
        );
    };
    // A state is used once, and only while its sign-in is young.
    let login = lock(&p.logins)
        .remove(&state)
        .filter(|l| l.until > Instant::now());
    let Some(login) = login else {
        return status_page(
            StatusCode::BAD_REQUEST,
            "Sign-in failed",
            "this sign-in is unknown, used or too old: start again",
        );
    };
    let person = match p.oidc.finish(&code, &login.verifier, &login.nonce).await {
        Ok(person) => person,
        Err(e) => {
            tracing::warn!(error = %e, "sign-in refused");
            return status_page(StatusCode::FORBIDDEN, "Sign-in failed", &e.to_string());
        }
    };
    tracing::info!(principal = %person.principal, subject = %person.subject, "signed in on the person's page");
    let id = match p.new_session(person) {
        Ok(id) => id,
        Err(e) => {
            return status_page(StatusCode::INTERNAL_SERVER_ERROR, "Sign-in failed", &e);
        }
    };
    // A page, not a redirect: a browser does not send a SameSite=Strict cookie on a redirect
    // chain that a cross-site navigation (the provider's) started; it does on this page's own.
    let next = esc(&login.next);
    let mut r = Html(format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Signed in</title>\
         <meta http-equiv=\"refresh\" content=\"0;url={next}\"></head>\
         <body><p>Signed in. <a href=\"{next}\">Continue</a></p></body></html>"
    ))
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&p.cookie(&id, SESSION_LIFETIME.as_secs())) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    guarded(r)
}

async fn logout(State(p): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let fields = form(&body);
    if let Some((_, _, csrf)) = p.session(&headers)
        && origin_ok(&p, &headers)
        && fields
            .get("csrf")
            .is_some_and(|c| bool::from(c.as_bytes().ct_eq(csrf.as_bytes())))
    {
        lock(&p.sessions).retain(|_, s| s.csrf != csrf);
    }
    let mut r = Redirect::to("/").into_response();
    if let Ok(v) = HeaderValue::from_str(&p.cookie("", 0)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    guarded(r)
}

/// A POST's `Origin`, when the browser sent one, is the page's own.
fn origin_ok(p: &Page, headers: &HeaderMap) -> bool {
    match headers.get(header::ORIGIN) {
        None => true,
        Some(o) => o.to_str().is_ok_and(|o| o == p.origin),
    }
}

fn link_status(e: &LinkError) -> StatusCode {
    match e {
        LinkError::Unknown => StatusCode::NOT_FOUND,
        LinkError::Used | LinkError::Ended => StatusCode::GONE,
        LinkError::OtherCall => StatusCode::BAD_REQUEST,
        LinkError::NotYours { .. } => StatusCode::FORBIDDEN,
    }
}

async fn show(
    State(p): State<Shared>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    Path(link): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !link_shape(&link) {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such approval",
            "no approval has this link",
        );
    }
    let Some((principal, subject, csrf)) = p.session(&headers) else {
        return to_sign_in(&format!("/approval/{link}"));
    };
    let on = match p.broker.kernel.approvals.on_page(&link) {
        Ok(on) => on,
        Err(e) => {
            p.refuse(Refusal {
                code: e.code(),
                reason: e.to_string(),
                approval: None,
                approval_named: None,
                session: Some((principal.as_str(), subject.as_str())),
                peer,
            })
            .await;
            return status_page(link_status(&e), "This link decides nothing", &e.to_string());
        }
    };
    if on.info.principal != principal {
        let e = LinkError::NotYours {
            owner: on.info.principal.clone(),
            signed_in: principal.clone(),
        };
        p.refuse(Refusal {
            code: e.code(),
            reason: e.to_string(),
            approval: Some(&on),
            approval_named: None,
            session: Some((principal.as_str(), subject.as_str())),
            peer,
        })
        .await;
        return status_page(link_status(&e), "Not yours to decide", &e.to_string());
    }
    let arguments = serde_json::to_string_pretty(&on.info.arguments).unwrap_or_else(|_| "?".into());
    let resource = on
        .info
        .requirement
        .as_ref()
        .map(|r| format!("{} on {}", r.action, r.resource))
        .unwrap_or_else(|| "(none)".into());
    let body = format!(
        "<p>An agent acting for you, <b id=\"principal\">{principal}</b>, asks to run this call. \
         Nothing runs unless you approve it here before {expires}.</p>\
         <table>\
         <tr><th>tool</th><td id=\"tool\">{tool}</td></tr>\
         <tr><th>arguments</th><td><pre id=\"arguments\">{arguments}</pre></td></tr>\
         <tr><th>resource</th><td id=\"resource\">{resource}</td></tr>\
         <tr><th>policy</th><td id=\"policy\">{policies}</td></tr>\
         <tr><th>turn</th><td id=\"turn\">{turn}</td></tr>\
         <tr><th>agent</th><td id=\"agent\">{agent}</td></tr>\
         <tr><th>approval</th><td id=\"approval\">{id}</td></tr>\
         </table>\
         <form method=\"post\" action=\"/approval/{link}\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
         <input type=\"hidden\" name=\"approval\" value=\"{id}\">\
         <button id=\"approve\" type=\"submit\" name=\"decision\" value=\"approve\">Approve</button> \
         <button id=\"deny\" type=\"submit\" name=\"decision\" value=\"deny\">Deny</button>\
         </form>",
        principal = esc(&principal),
        expires = esc(&on.info.expires_at),
        tool = esc(&on.info.tool),
        arguments = esc(&arguments),
        resource = esc(&resource),
        policies = esc(&on.policies.join(", ")),
        turn = esc(&on.info.turn),
        agent = esc(on.agent.as_deref().unwrap_or("(none)")),
        id = esc(&on.info.id),
        link = esc(&on.link),
        csrf = esc(&csrf),
    );
    guarded(page("Approve this call?", &body).into_response())
}

async fn decide(
    State(p): State<Shared>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    Path(link): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let fields = form(&body);
    let named = fields.get("approval").cloned();
    let signed_in = p.session(&headers);
    let session = signed_in.as_ref().map(|(a, b, _)| (a.as_str(), b.as_str()));
    let on = p.broker.kernel.approvals.on_page(&link).ok();
    let refused = |code: &'static str, reason: String| Refusal {
        code,
        reason,
        approval: on.as_ref(),
        approval_named: named.clone(),
        session,
        peer,
    };
    if !origin_ok(&p, &headers) {
        let why = format!(
            "a form posted from another origin ({}) decides nothing",
            headers
                .get(header::ORIGIN)
                .and_then(|o| o.to_str().ok())
                .unwrap_or("?")
        );
        p.refuse(refused("cross_origin", why.clone())).await;
        return status_page(StatusCode::FORBIDDEN, "Refused", &why);
    }
    let Some((principal, subject, csrf)) = signed_in.clone() else {
        let why = "no signed-in session: sign in, open the link again, then decide".to_owned();
        p.refuse(refused("no_session", why.clone())).await;
        return status_page(StatusCode::UNAUTHORIZED, "Refused", &why);
    };
    let csrf_ok = fields
        .get("csrf")
        .is_some_and(|c| bool::from(c.as_bytes().ct_eq(csrf.as_bytes())));
    if !csrf_ok {
        let why = "the form's CSRF token is missing or not this session's".to_owned();
        p.refuse(refused("csrf", why.clone())).await;
        return status_page(StatusCode::FORBIDDEN, "Refused", &why);
    }
    let approve = match fields.get("decision").map(String::as_str) {
        Some("approve") => true,
        Some("deny") => false,
        _ => {
            return status_page(
                StatusCode::BAD_REQUEST,
                "Refused",
                "the form names no decision (approve or deny)",
            );
        }
    };
    let decided = p.broker.kernel.approvals.decide_on_page(
        &link,
        named.as_deref().unwrap_or(""),
        &principal,
        approve,
        PageDecider {
            subject: subject.clone(),
        },
    );
    match decided {
        Ok(info) => {
            tracing::info!(approval = %info.id, %principal, %subject, approve, "decided on the person's page");
            let word = if approve { "approved" } else { "denied" };
            guarded(
                page(
                    "Decided",
                    &format!(
                        "<p id=\"message\">You {word} <code>{}</code> (approval {}).</p><p><a href=\"/\">Back</a></p>",
                        esc(&info.tool),
                        esc(&info.id)
                    ),
                )
                .into_response(),
            )
        }
        Err(e) => {
            let r = Refusal {
                code: e.code(),
                reason: e.to_string(),
                approval: on.as_ref(),
                approval_named: named.clone(),
                session: Some((principal.as_str(), subject.as_str())),
                peer,
            };
            p.refuse(r).await;
            status_page(link_status(&e), "This link decides nothing", &e.to_string())
        }
    }
}

/// Why a sign-in to a remote server was refused, as the page says it.
fn sign_in_refused(e: &crate::upstream::signin::LinkRefused) -> Response {
    use crate::upstream::signin::LinkRefused;
    let status = match e {
        LinkRefused::Unknown
        | LinkRefused::Used(_)
        | LinkRefused::Expired(_)
        | LinkRefused::StateUsed(_)
        | LinkRefused::StateExpired(_) => StatusCode::GONE,
        LinkRefused::NotYours { .. }
        | LinkRefused::OtherPrincipal { .. }
        | LinkRefused::OtherBrowser(_)
        | LinkRefused::Denied { .. } => StatusCode::FORBIDDEN,
        LinkRefused::StateUnknown => StatusCode::BAD_REQUEST,
        LinkRefused::NoProvider(_) => StatusCode::NOT_FOUND,
        LinkRefused::Failed(_) | LinkRefused::TokenFailed { .. } => StatusCode::BAD_GATEWAY,
    };
    status_page(status, "Sign-in refused", &e.to_string())
}

/// The sign-in cookie's name: it binds a sign-in to a remote server to the browser that
/// started it (`SameSite=Lax`, so that the authorization server's redirect back brings it).
fn sign_in_cookie_name(https: bool) -> &'static str {
    if https {
        "__Host-sharedos-signin"
    } else {
        "sharedos-signin"
    }
}

impl Page {
    /// A cookie of this request by name.
    fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    }

    /// This browser's sign-in cookie, made when it has none (256 random bits).
    fn browser(&self, headers: &HeaderMap) -> Result<String, String> {
        match Self::cookie_value(headers, sign_in_cookie_name(self.https)) {
            Some(v) if v.len() == 43 => Ok(v),
            _ => oidc::random(32),
        }
    }

    /// The redirect to the authorization server, with the browser's sign-in cookie.
    fn to_authorization(&self, to: &url::Url, browser: &str) -> Response {
        let mut r = Redirect::to(to.as_str()).into_response();
        let secure = if self.https { "; Secure" } else { "" };
        let cookie = format!(
            "{}={browser}; Path=/; HttpOnly; SameSite=Lax; Max-Age={}{secure}",
            sign_in_cookie_name(self.https),
            crate::upstream::signin::SIGN_IN_LIFETIME.as_secs()
        );
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            r.headers_mut().insert(header::SET_COOKIE, v);
        }
        guarded(r)
    }

    /// Records a refused sign-in to a remote server (`provider_state`, `sign_in_refused`, with
    /// its code and why; bounded per minute with the page's other refusals) and logs it.
    async fn refuse_sign_in(
        &self,
        e: &crate::upstream::signin::LinkRefused,
        peer: SocketAddr,
    ) -> Response {
        use sharedos_proto::record::{ProviderDetail, ProviderState};
        let whose = e.whose();
        tracing::warn!(code = e.code(), error = %e, %peer, "the person's page refused a sign-in to a remote server");
        let provider = match e {
            crate::upstream::signin::LinkRefused::NoProvider(ns) => Some(ns.clone()),
            _ => whose.map(|w| w.provider.clone()),
        };
        if self.count_refusal() {
            let line = Event::ProviderState(ProviderState {
                provider: provider.unwrap_or_default(),
                state: "sign_in_refused".into(),
                sandbox: None,
                detail: ProviderDetail::Refused {
                    code: e.code().into(),
                    reason: e.to_string(),
                },
                turn: None,
                principal: whose.map(|w| w.principal.clone()),
                remote: None,
            });
            if let Err(err) = self.broker.kernel.recorder.append(&line).await {
                tracing::error!(error = %err, "a refused sign-in not recorded");
            }
        }
        sign_in_refused(e)
    }
}

/// A sign-in link (`/signin/<one-time id>`, sent to the person through the harness): the
/// signed-in person whose link it is is sent on to the server's authorization server.
async fn sign_in_link(
    State(p): State<Shared>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    Path(link): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(signins) = p.broker.kernel.signins.clone() else {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such sign-in",
            "no remote server signs people in here",
        );
    };
    if !link_shape(&link) {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such sign-in",
            "no sign-in has this link",
        );
    }
    let Some((principal, _, _)) = p.session(&headers) else {
        return to_sign_in(&format!("/signin/{link}"));
    };
    let browser = match p.browser(&headers) {
        Ok(b) => b,
        Err(e) => return status_page(StatusCode::INTERNAL_SERVER_ERROR, "Sign-in failed", &e),
    };
    match signins.start_link(&link, &principal, &browser).await {
        Ok(to) => p.to_authorization(&to, &browser),
        Err(e) => p.refuse_sign_in(&e, peer).await,
    }
}

/// `/connect/<provider>`: the signed-in person signs in to a remote server ahead of any call
/// (the `list_as` principal, before the provider can list its tools).
async fn connect(
    State(p): State<Shared>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    Path(ns): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(signins) = p.broker.kernel.signins.clone() else {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such server",
            "no remote server signs people in here",
        );
    };
    if crate::secrets::check_name("provider", &ns).is_err() || !signins.has_provider(&ns) {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such server",
            "no remote server of that name signs people in here",
        );
    }
    let Some((principal, _, _)) = p.session(&headers) else {
        return to_sign_in(&format!("/connect/{ns}"));
    };
    let browser = match p.browser(&headers) {
        Ok(b) => b,
        Err(e) => return status_page(StatusCode::INTERNAL_SERVER_ERROR, "Sign-in failed", &e),
    };
    match signins.start(&principal, &ns, &browser).await {
        Ok(to) => p.to_authorization(&to, &browser),
        Err(e) => p.refuse_sign_in(&e, peer).await,
    }
}

/// `GET /oauth/client.json`: the broker's client ID metadata document, which authorization
/// servers that take such documents fetch to learn the client whose id is this URL. Public, like
/// any client's metadata: it names the page and its redirect URI, nothing of anyone. Only where
/// people sign in to remote servers and the page is on HTTPS.
async fn client_metadata(State(p): State<Shared>) -> Response {
    match p.broker.kernel.signins.as_ref().and_then(|s| s.metadata()) {
        Some(document) => (
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "max-age=3600"),
            ],
            document.to_string(),
        )
            .into_response(),
        None => status_page(
            StatusCode::NOT_FOUND,
            "No such page",
            "this page publishes no client metadata: no remote server signs people in here over HTTPS",
        ),
    }
}

/// `POST /connect/<provider>/signout`: the signed-in person's tokens for that server are
/// forgotten (the session's CSRF token and the page's own origin required); their next call to
/// it asks them to sign in again.
async fn sign_out(
    State(p): State<Shared>,
    Path(ns): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(signins) = p.broker.kernel.signins.clone() else {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such server",
            "no remote server signs people in here",
        );
    };
    let fields = form(&body);
    let Some((principal, _, csrf)) = p.session(&headers) else {
        return status_page(StatusCode::UNAUTHORIZED, "Refused", "no signed-in session");
    };
    let csrf_ok = fields
        .get("csrf")
        .is_some_and(|c| bool::from(c.as_bytes().ct_eq(csrf.as_bytes())));
    if !origin_ok(&p, &headers) || !csrf_ok {
        return status_page(
            StatusCode::FORBIDDEN,
            "Refused",
            "the form's CSRF token is missing or not this session's, or it came from another origin",
        );
    }
    if !signins.has_provider(&ns) {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such server",
            "no remote server of that name signs people in here",
        );
    }
    signins.forget(&principal, &ns);
    tracing::info!(provider = %ns, %principal, "signed out of a remote server on the person's page");
    guarded(
        page(
            "Signed out",
            &format!(
                "<p id=\"message\">You, <b id=\"principal\">{}</b>, are signed out of <code>{}</code>: the next call to it asks you to sign in again.</p><p><a href=\"/\">Back</a></p>",
                esc(&principal),
                esc(&ns)
            ),
        )
        .into_response(),
    )
}

/// The authorization server sends the browser back here: the code is exchanged for the
/// person's tokens, bound by `state` to the principal and server the sign-in started for, and
/// to the browser that started it (its `SameSite=Lax` sign-in cookie, which the authorization
/// server's redirect brings; the page's `SameSite=Strict` session cookie comes only when that
/// redirect is same-site, and then must be the same principal's). Every refusal is recorded.
async fn oauth_callback(
    State(p): State<Shared>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    use crate::upstream::signin::LinkRefused;
    let Some(signins) = p.broker.kernel.signins.clone() else {
        return status_page(
            StatusCode::NOT_FOUND,
            "No such sign-in",
            "no remote server signs people in here",
        );
    };
    let state = query(&uri, "state");
    if let Some(error) = query(&uri, "error") {
        let refused = match &state {
            Some(state) => signins.deny(state, &error),
            None => LinkRefused::StateUnknown,
        };
        return p.refuse_sign_in(&refused, peer).await;
    }
    let (Some(code), Some(state)) = (query(&uri, "code"), state) else {
        return p.refuse_sign_in(&LinkRefused::StateUnknown, peer).await;
    };
    let browser = Page::cookie_value(&headers, sign_in_cookie_name(p.https));
    let session = p.session(&headers).map(|(principal, _, _)| principal);
    match signins
        .finish(&state, &code, browser.as_deref(), session.as_deref())
        .await
    {
        Ok((principal, ns)) => guarded(
            page(
                "Signed in",
                &format!(
                    "<p id=\"message\">You, <b id=\"principal\">{}</b>, are signed in to <code id=\"server\">{}</code>. A call waiting for it goes on; you can close this page.</p>",
                    esc(&principal),
                    esc(&ns)
                ),
            )
            .into_response(),
        ),
        Err(e) => p.refuse_sign_in(&e, peer).await,
    }
}

/// The page's listener: TCP, with a TLS handshake (each on its own task, bounded in time)
/// when a certificate is configured.
struct Incoming {
    rx: tokio::sync::mpsc::Receiver<(Io, SocketAddr)>,
    local: SocketAddr,
}

type Io = tokio_util::either::Either<TcpStream, tokio_rustls::server::TlsStream<TcpStream>>;

/// The peer's address, for [`ConnectInfo`].
#[derive(Clone, Copy, Debug)]
struct Peer(SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Incoming>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Incoming>) -> Self {
        Peer(*stream.remote_addr())
    }
}

impl axum::serve::Listener for Incoming {
    type Io = Io;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(conn) => conn,
            // The accept task ended (shutdown): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cert `{}`: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "cert `{}` holds no PEM certificate",
            cert.display()
        ));
    }
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("key `{}`: {e}", key.display()))?;
    #[expect(
        deprecated,
        reason = "ring has no post-quantum key exchange; aws-lc-rs would need a C build on every CI machine"
    )]
    let provider = rustls::crypto::ring::default_provider();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("cert and key: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Starts the page when `[page]` is configured: binds its address and serves until `shutdown`.
/// Returns the address it listens on.
pub async fn start(
    broker: Arc<Broker>,
    shutdown: CancellationToken,
) -> Result<Option<SocketAddr>, StartError> {
    let Some(config) = broker.config.page.clone() else {
        return Ok(None);
    };
    let tls = match &config.tls {
        Some((cert, key)) => Some(tls_acceptor(cert, key).map_err(StartError::Page)?),
        None => None,
    };
    let secret = match &config.client_secret_file {
        Some(f) => Some(
            std::fs::read_to_string(f)
                .map_err(|e| {
                    StartError::Page(format!("client_secret_file `{}`: {e}", f.display()))
                })?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let oidc = oidc::Oidc::new(&config, secret).map_err(StartError::Page)?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| StartError::Page(format!("cannot listen on {}: {e}", config.listen)))?;
    let local = listener
        .local_addr()
        .map_err(|e| StartError::Page(format!("listen {}: {e}", config.listen)))?;
    let origin = config.public_url.origin().ascii_serialization();
    let page = Arc::new(Page {
        broker,
        https: tls.is_some(),
        config,
        oidc,
        origin,
        sessions: Mutex::default(),
        logins: Mutex::default(),
        refusals: Mutex::new((Instant::now(), 0)),
    });
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let accepting = shutdown.clone();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                _ = accepting.cancelled() => return,
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "the person's page: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            match &tls {
                None => {
                    if tx
                        .send((tokio_util::either::Either::Left(stream), peer))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Some(acceptor) => {
                    let (acceptor, tx) = (acceptor.clone(), tx.clone());
                    tokio::spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
                        {
                            Ok(Ok(s)) => {
                                let _ = tx.send((tokio_util::either::Either::Right(s), peer)).await;
                            }
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, %peer, "the person's page: TLS handshake failed")
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "the person's page: TLS handshake timed out")
                            }
                        }
                    });
                }
            }
        }
    });
    let router = axum::Router::new()
        .route("/", get(home))
        .route("/login", get(login))
        .route("/callback", get(callback))
        .route("/logout", axum::routing::post(logout))
        .route("/approval/{link}", get(show).post(decide))
        .route("/signin/{link}", get(sign_in_link))
        .route("/connect/{ns}", get(connect))
        .route("/connect/{ns}/signout", axum::routing::post(sign_out))
        .route("/oauth/callback", get(oauth_callback))
        .route("/oauth/client.json", get(client_metadata))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_FORM_BYTES))
        .with_state(page.clone());
    let incoming = Incoming { rx, local };
    tracing::info!(address = %local, public_url = %page.config.public_url, "the person's page listens");
    tokio::spawn(async move {
        let served = axum::serve(
            incoming,
            router.into_make_service_with_connect_info::<Peer>(),
        )
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the person's page stopped");
        }
    });
    Ok(Some(local))
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;

    #[test]
    fn html_is_escaped_and_links_have_one_shape() {
        assert_eq!(
            esc("<script>\"x\" & 'y'</script>"),
            "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/script&gt;"
        );
        assert!(link_shape("0123456789abcdef0123456789abcdef"));
        assert!(!link_shape("../../etc/passwd"));
        assert!(!link_shape("0123456789abcdef0123456789abcde"));
    }

    #[test]
    fn the_session_cookie_is_http_only_strict_and_secure_under_https() {
        assert_eq!(
            cookie_header(true, "v", 60),
            "__Host-sharedos-page=v; Path=/; HttpOnly; SameSite=Strict; Max-Age=60; Secure"
        );
        assert_eq!(
            cookie_header(false, "v", 60),
            "sharedos-page=v; Path=/; HttpOnly; SameSite=Strict; Max-Age=60"
        );
    }
}
