//! The Streamable HTTP transport: the upstream is a remote MCP server at `url`, reached through
//! rmcp's Streamable HTTP client over the broker's own HTTP client (`wire`: hyper-util, with
//! connections that acknowledge at once; its note says why not reqwest) with rustls (ring; the
//! system's roots, plus the provider's `ca_file`, and its client certificate when one is
//! configured). OAuth token requests and sign-ins use reqwest (`McpProvider::http_client`).
//!
//! Only how bytes reach the server differs from the stdio transport: the session returned here
//! goes through the same registration, templates, pins, drift handling and call path.
//! Bounded: a connect time limit, a maximum response size (as for stdio upstreams), redirects
//! followed only on the same scheme, host and port. Outbound authorization is the provider's own
//! headers; nothing the harness sends is passed through.
//!
//! Connections are kept and reused, per session (so per principal where instances are per
//! principal): at most `max_connections` requests in flight at once (a request waits for a
//! place), so at most that many connections over HTTP/1.1 besides the session's listening
//! stream, and one over HTTP/2 (offered by ALPN over TLS); an idle connection is closed by the
//! broker after `idle_connection_seconds`, before the 5 s keep-alive common to uvicorn and Node
//! servers closes it under a request. Every response body is read to its end before its
//! connection is given back (`drain::Drained`): a body left unread would close the connection, and a
//! reused connection with an unread body stalls on the server's delayed ACK. TLS sessions are
//! resumed from one store per provider; `TCP_NODELAY` is set. A request is only sent again by
//! the HTTP client where it cannot have reached the server: a pooled HTTP/1.1 connection found
//! closed before the request was written, an HTTP/2 stream the server refused (`REFUSED_STREAM`)
//! or that a graceful `GOAWAY` left unprocessed; never a request the server may have read.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use reqwest::header::{HeaderName, HeaderValue};
use rmcp::ClientServiceExt;
use rmcp::service::ServiceError;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Serialize;
use sharedos_proto::FailCode;
use tokio_util::sync::CancellationToken;

use sharedos_proto::record::ProviderDetail;

use super::cause::{cause, chain};
use super::{Launch, MAX_UPSTREAM_RESULT_BYTES, McpProvider, Session, State};
use crate::config::host_is_loopback;
use crate::provider::Failure;

/// How long the TCP connection and TLS handshake to a remote server may take (per request).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of one HTTP response (a JSON body or one SSE event) beyond the result limit: room for
/// the JSON-RPC envelope. A larger response is refused before it is decoded.
pub const MAX_HTTP_ENVELOPE_BYTES: usize = 64 * 1024;
/// Redirects followed, each only to the same scheme, host and port.
pub const MAX_REDIRECTS: usize = 5;
/// Requests in flight to a remote server at once per session, by default (`max_connections`):
/// over HTTP/1.1 the most connections open, besides the session's listening stream.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8;
pub use crate::config::MAX_CONNECTIONS;
/// An idle connection is closed after this many seconds, by default (`idle_connection_seconds`):
/// under the 5 s keep-alive of uvicorn and Node servers, so the broker closes it first, and a
/// request never goes out on a connection the server is closing.
pub const DEFAULT_IDLE_CONNECTION_SECONDS: u64 = 4;
/// TLS sessions remembered per provider, for resumption.
const TLS_SESSIONS: usize = 64;

/// What `providers` shows of a remote provider.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RemoteStatus {
    pub url: String,
    /// `rustls (system roots)`, `rustls (system roots + ca_file …)`, `none (loopback http)`,
    /// `none (insecure_http)`.
    pub tls: String,
    pub insecure_http: bool,
    /// `open` while a session is up, `none` otherwise.
    pub session: &'static str,
    /// Sessions opened since the broker started (a restart or a session the server ended opens
    /// another).
    pub sessions: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_latency_ms: Option<f64>,
    /// Requests in flight at once per session (`max_connections`).
    pub max_connections: usize,
    /// How long an idle connection is kept (`idle_connection_seconds`; 0: none).
    pub idle_connection_seconds: u64,
    /// With `[providers.oauth]`: its token endpoint, and the token requests made so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth_token_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth_token_fetches: Option<u64>,
    /// With `grant = "authorization_code"`: the refreshes of people's sign-ins so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth_sign_in_refreshes: Option<u64>,
    /// With `grant = "authorization_code"`, once discovered: how the broker is the
    /// authorization server's client (`configured`, `metadata_document`, `dynamic`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth_client_registration: Option<&'static str>,
    /// Token exchanges made (`grant = "token_exchange"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth_token_exchanges: Option<u64>,
}

#[derive(Default)]
struct RemoteState {
    sessions: u64,
    open: Option<CancellationToken>,
    last_latency: Option<Duration>,
}

/// A remote provider's session bookkeeping, and its TLS sessions (resumed by every session and
/// instance of the provider).
pub struct Remote {
    state: Mutex<RemoteState>,
    tls_sessions: rustls::client::Resumption,
}

impl Default for Remote {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            tls_sessions: rustls::client::Resumption::in_memory_sessions(TLS_SESSIONS),
        }
    }
}

impl Remote {
    fn lock(&self) -> std::sync::MutexGuard<'_, RemoteState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The round trip of one call, for `providers`.
    pub fn latency(&self, took: Duration) {
        self.lock().last_latency = Some(took);
    }

    /// Ends the current session (the supervisor then opens a new one).
    pub fn end_session(&self) {
        if let Some(stop) = &self.lock().open {
            stop.cancel();
        }
    }
}

/// How a call through the HTTP transport failed, from rmcp's error.
enum HttpFailure {
    Unauthorized(String),
    /// The OAuth token endpoint refused the provider's client: the whole message.
    TokenRefused(String),
    /// The person has to sign in (`authorization_code`): why.
    SignIn(String),
    /// The turn lacks the person's token (`token_exchange`), or it was refused: why.
    Missing(String),
    SessionExpired,
    TooLarge(usize),
    Other,
}

fn classify(e: &ServiceError) -> HttpFailure {
    classify_any(e)
}

/// Why a session could not be opened: `unauthorized` when the server refused the broker's
/// credentials (HTTP 401/403 at initialize), which is answered `upstream_unauthorized`.
#[derive(Debug)]
pub struct ConnectError {
    pub unauthorized: bool,
    /// The person behind the session has to sign in first (`authorization_code`).
    pub sign_in: bool,
    /// The turn brought no subject token, or it was refused (`token_exchange`).
    pub missing: bool,
    pub message: String,
}

impl From<String> for ConnectError {
    fn from(message: String) -> Self {
        Self {
            unauthorized: false,
            sign_in: false,
            missing: false,
            message,
        }
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn classify_any(e: &(dyn StdError + 'static)) -> HttpFailure {
    let mut current: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = current {
        if let Some(h) = err.downcast_ref::<StreamableHttpError<super::wire::WireError>>() {
            return match h {
                StreamableHttpError::AuthRequired(a)
                    if a.www_authenticate_header
                        .starts_with(super::oauth::SIGN_IN_MARK) =>
                {
                    HttpFailure::SignIn(
                        a.www_authenticate_header[super::oauth::SIGN_IN_MARK.len()..].to_owned(),
                    )
                }
                StreamableHttpError::AuthRequired(a)
                    if a.www_authenticate_header
                        .starts_with(super::oauth::MISSING_MARK) =>
                {
                    HttpFailure::Missing(
                        a.www_authenticate_header[super::oauth::MISSING_MARK.len()..].to_owned(),
                    )
                }
                StreamableHttpError::AuthRequired(a) => match a
                    .www_authenticate_header
                    .strip_prefix(super::oauth::REFUSED_MARK)
                {
                    Some(why) => HttpFailure::TokenRefused(format!(
                        "{why}; check `[providers.oauth]` and its client secret"
                    )),
                    None => {
                        HttpFailure::Unauthorized(format!("401, {}", a.www_authenticate_header))
                    }
                },
                StreamableHttpError::InsufficientScope(a) => {
                    HttpFailure::Unauthorized(format!("403, {}", a.www_authenticate_header))
                }
                StreamableHttpError::HttpStatus(s) if matches!(s.status, 401 | 403) => {
                    HttpFailure::Unauthorized(s.status.to_string())
                }
                StreamableHttpError::SessionExpired => HttpFailure::SessionExpired,
                StreamableHttpError::ResponseBodyTooLarge { max_size } => {
                    HttpFailure::TooLarge(*max_size)
                }
                _ => HttpFailure::Other,
            };
        }
        current = cause(err);
    }
    HttpFailure::Other
}

impl McpProvider {
    /// Whether this provider reaches its server over HTTP.
    pub fn is_remote(&self) -> bool {
        self.config.url.is_some()
    }

    fn tls_shown(&self, url: &str) -> (String, bool) {
        let https = url
            .get(..8)
            .is_some_and(|s| s.eq_ignore_ascii_case("https://"));
        if https {
            let mut t = "rustls (system roots".to_owned();
            if let Some(ca) = &self.config.ca_file {
                t.push_str(&format!(" + ca_file {}", ca.display()));
            }
            t.push(')');
            if self.config.client_cert.is_some() {
                t.push_str(", client certificate");
            }
            return (t, false);
        }
        if reqwest::Url::parse(url).is_ok_and(|u| host_is_loopback(&u)) {
            ("none (plain HTTP to loopback)".into(), false)
        } else {
            ("none (insecure_http = true)".into(), true)
        }
    }

    /// What `provider_state` lines record of a remote provider's connection (None for stdio):
    /// its url, its TLS and whether `insecure_http` lets it send calls unencrypted.
    pub fn remote_shown(&self) -> Option<serde_json::Value> {
        let url = self.config.url.as_ref()?;
        let (tls, insecure_http) = self.tls_shown(url);
        Some(serde_json::json!({ "url": url, "tls": tls, "insecureHttp": insecure_http }))
    }

    /// What `providers` shows of this provider's remote connection (None for stdio).
    pub fn remote_status(&self, connected: bool) -> Option<RemoteStatus> {
        let url = self.config.url.as_ref()?;
        let (tls, insecure_http) = self.tls_shown(url);
        let state = self.remote.lock();
        Some(RemoteStatus {
            url: url.clone(),
            tls,
            insecure_http,
            session: if connected && state.open.as_ref().is_some_and(|t| !t.is_cancelled()) {
                "open"
            } else {
                "none"
            },
            sessions: state.sessions,
            last_latency_ms: state
                .last_latency
                .map(|d| (d.as_secs_f64() * 1e5).round() / 100.0),
            max_connections: self.max_connections(),
            idle_connection_seconds: self.idle_connection().as_secs(),
            oauth_token_url: self
                .config
                .oauth
                .as_ref()
                .filter(|o| o.grant == crate::config::OAuthGrant::ClientCredentials)
                .map(|o| o.token_url.clone()),
            oauth_token_fetches: self
                .config
                .oauth
                .as_ref()
                .filter(|o| o.grant == crate::config::OAuthGrant::ClientCredentials)
                .map(|_| self.oauth.fetches()),
            oauth_sign_in_refreshes: self
                .signins
                .get()
                .filter(|s| s.has_provider(&self.config.namespace))
                .map(|s| s.refreshes(&self.config.namespace)),
            oauth_client_registration: self
                .signins
                .get()
                .and_then(|s| s.registration(&self.config.namespace))
                .map(super::signin::Registration::as_str),
            oauth_token_exchanges: self.exchanger.get().map(|x| x.exchanges()),
        })
    }

    /// The rustls configuration: ring, the system's roots and the provider's `ca_file`, its
    /// client certificate if any.
    fn tls_config(&self) -> Result<rustls::ClientConfig, String> {
        let ns = &self.config.namespace;
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        if let Some(ca) = &self.config.ca_file {
            let mut n = 0;
            for cert in CertificateDer::pem_file_iter(ca)
                .map_err(|e| format!("provider `{ns}`: ca_file `{}`: {e}", ca.display()))?
            {
                let cert =
                    cert.map_err(|e| format!("provider `{ns}`: ca_file `{}`: {e}", ca.display()))?;
                roots.add(cert).map_err(|e| {
                    format!(
                        "provider `{ns}`: ca_file `{}` holds a certificate rustls cannot use: {e}",
                        ca.display()
                    )
                })?;
                n += 1;
            }
            if n == 0 {
                return Err(format!(
                    "provider `{ns}`: ca_file `{}` holds no PEM certificate",
                    ca.display()
                ));
            }
        }
        #[expect(
            deprecated,
            reason = "ring has no post-quantum key exchange; aws-lc-rs would need a C build on every CI machine"
        )]
        let provider = rustls::crypto::ring::default_provider();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("provider `{ns}`: TLS setup failed: {e}"))?
            .with_root_certificates(roots);
        let mut config = match (&self.config.client_cert, &self.config.client_key) {
            (Some(cert), Some(key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| {
                        format!("provider `{ns}`: client_cert `{}`: {e}", cert.display())
                    })?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("provider `{ns}`: client_key `{}`: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("provider `{ns}`: client certificate: {e}"))?
            }
            _ => builder.with_no_client_auth(),
        };
        // HTTP/2 where the server offers it, else HTTP/1.1.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config.resumption = self.remote.tls_sessions.clone();
        Ok(config)
    }

    /// Requests in flight at once per session (`max_connections`).
    pub fn max_connections(&self) -> usize {
        self.config
            .max_connections
            .unwrap_or(DEFAULT_MAX_CONNECTIONS)
    }

    /// How long an idle connection is kept (`idle_connection_seconds`; 0: none is kept).
    pub fn idle_connection(&self) -> Duration {
        Duration::from_secs(
            self.config
                .idle_connection_seconds
                .unwrap_or(DEFAULT_IDLE_CONNECTION_SECONDS),
        )
    }

    /// The session's own HTTP client (`wire`: connections that acknowledge at once): the
    /// provider's rustls configuration, the connect time limit, redirects only to the same
    /// origin, idle connections kept for reuse (at most `max_connections`, each for
    /// `idle_connection_seconds`).
    fn wire(&self) -> Result<super::wire::Wire, String> {
        let idle = self.idle_connection();
        Ok(super::wire::Wire::new(super::wire::WireConfig {
            tls: self.tls_config()?,
            connect_timeout: self
                .config
                .connect_timeout_seconds
                .map_or(CONNECT_TIMEOUT, Duration::from_secs),
            max_idle: if idle.is_zero() {
                0
            } else {
                self.max_connections()
            },
            idle,
            max_redirects: MAX_REDIRECTS,
        }))
    }

    /// The HTTP client of the provider's OAuth token requests and sign-ins (the session's
    /// requests go through [`Self::wire`]): rustls, no proxy from the environment, the connect time limit,
    /// redirects only to the same origin, and idle connections kept for reuse (at most
    /// `max_connections`, each for `idle_connection_seconds`).
    pub(super) fn http_client(&self) -> Result<reqwest::Client, String> {
        let policy = reqwest::redirect::Policy::custom(|attempt| {
            let origin = |u: &reqwest::Url| {
                (
                    u.scheme().to_owned(),
                    u.host_str().map(str::to_owned),
                    u.port_or_known_default(),
                )
            };
            let first = attempt.previous().first().map(origin);
            if attempt.previous().len() > MAX_REDIRECTS {
                let n = attempt.previous().len();
                attempt.error(format!("more than {n} redirects"))
            } else if first.as_ref() != Some(&origin(attempt.url())) {
                let to = attempt.url().to_string();
                attempt.error(format!(
                    "the server redirected to `{to}`, another origin: not followed"
                ))
            } else {
                attempt.follow()
            }
        });
        let idle = self.idle_connection();
        reqwest::Client::builder()
            .tls_backend_preconfigured(self.tls_config()?)
            .no_proxy()
            // Reused: every response body is read to its end first (`drain::Drained`).
            .pool_max_idle_per_host(if idle.is_zero() {
                0
            } else {
                self.max_connections()
            })
            .pool_idle_timeout(idle)
            .tcp_nodelay(true)
            .redirect(policy)
            .connect_timeout(
                self.config
                    .connect_timeout_seconds
                    .map_or(CONNECT_TIMEOUT, Duration::from_secs),
            )
            .build()
            .map_err(|e| {
                format!(
                    "provider `{}`: cannot make the HTTP client: {}",
                    self.config.namespace,
                    chain(&e)
                )
            })
    }

    /// The provider's configured headers, secret references resolved for this session (the
    /// value never appears in an error).
    fn headers(&self, launch: &Launch) -> Result<HashMap<HeaderName, HeaderValue>, String> {
        let ns = &self.config.namespace;
        let mut out = HashMap::new();
        for (name, value) in &launch.headers {
            let n = HeaderName::try_from(name.as_str())
                .map_err(|e| format!("provider `{ns}`: header name `{name}`: {e}"))?;
            let mut v = HeaderValue::try_from(value.expose()).map_err(|_| {
                format!("provider `{ns}`: the value of header `{name}` is not a valid header value")
            })?;
            v.set_sensitive(true);
            out.insert(n, v);
        }
        Ok(out)
    }

    /// Opens a Streamable HTTP session with the remote server, initializes, lists its tools.
    pub(super) async fn connect_http(
        &self,
        url: &str,
        launch: &Launch,
        principal: Option<&str>,
    ) -> Result<Session, ConnectError> {
        let (tls, insecure_http) = self.tls_shown(url);
        self.record_as(
            State::Starting.as_str(),
            principal,
            ProviderDetail::Reason {
                reason: format!(
                    "connecting to `{url}`; TLS: {tls}; insecure_http: {insecure_http}"
                ),
            },
        )
        .await;
        let client = self.http_client()?;
        let config = StreamableHttpClientTransportConfig::with_uri(url.to_owned())
            .custom_headers(self.headers(launch)?)
            .max_json_response_size(MAX_UPSTREAM_RESULT_BYTES + MAX_HTTP_ENVELOPE_BYTES)
            .max_sse_event_size(MAX_UPSTREAM_RESULT_BYTES + MAX_HTTP_ENVELOPE_BYTES)
            // A session the server ended is not re-opened under a call: the call path decides
            // whether the call may be sent again (read-only tools only).
            .reinit_on_expired_session(false);
        let signing_in = self
            .config
            .oauth
            .as_ref()
            .is_some_and(|o| o.grant == crate::config::OAuthGrant::AuthorizationCode);
        let tokens = match (&self.config.oauth, &launch.oauth_secret) {
            _ if signing_in => {
                let who = principal.or(self.config.list_as.as_deref()).unwrap_or("");
                let signins = self.signins.get().ok_or_else(|| {
                    format!(
                        "provider `{}`: its sign-ins are not set up (the person's page is needed)",
                        self.config.namespace
                    )
                })?;
                Some(super::oauth::Source::Person(Arc::new(
                    super::signin::PersonTokens::new(signins.clone(), &self.config.namespace, who),
                )))
            }
            _ if self.exchanger.get().is_some() => {
                let who = principal.or(self.config.list_as.as_deref()).unwrap_or("");
                self.exchanger.get().map(|x| {
                    super::oauth::Source::Exchange(Arc::new(super::exchange::PersonExchange {
                        exchanger: x.clone(),
                        principal: who.to_owned(),
                    }))
                })
            }
            (Some(o), Some((owner, secret))) => Some(super::oauth::Source::Client(self.oauth.get(
                owner,
                secret,
                || {
                    super::oauth::Tokens::new(
                        client.clone(),
                        o.clone(),
                        &self.config.namespace,
                        o.resource.clone().unwrap_or_else(|| url.to_owned()),
                        owner.clone(),
                        secret.clone(),
                        self.secrets.known.clone(),
                    )
                },
            ))),
            _ => None,
        };
        let client = super::oauth::TokenClient {
            inner: self.wire()?,
            tokens,
            places: Arc::new(Semaphore::new(self.max_connections())),
        };
        let transport = StreamableHttpClientTransport::with_client(client, config);
        let limit = self.startup_timeout();
        let changed = Arc::new(tokio::sync::Notify::new());
        let listener = self.listener(changed.clone(), launch);
        let service = tokio::time::timeout(limit, listener.serve_with_lifecycle(transport, self.lifecycle()))
            .await
            .map_err(|_| format!("the remote server `{url}` did not finish initialize in time"))?
            .inspect_err(|e| self.note_discover(e))
            .map_err(|e| match classify_any(&e) {
                HttpFailure::Unauthorized(status) => ConnectError {
                    unauthorized: true,
                    sign_in: false,
                    missing: false,
                    message: format!(
                        "the remote server of `{}` refused the broker's credentials (HTTP {status}) at initialize; check the provider's headers",
                        self.config.namespace
                    ),
                },
                HttpFailure::SignIn(message) => ConnectError {
                    unauthorized: true,
                    sign_in: true,
                    missing: false,
                    message,
                },
                HttpFailure::Missing(message) => ConnectError {
                    unauthorized: false,
                    sign_in: false,
                    missing: true,
                    message,
                },
                HttpFailure::TokenRefused(message) => ConnectError {
                    unauthorized: true,
                    sign_in: false,
                    missing: false,
                    message,
                },
                _ => format!("MCP initialize with `{url}` failed: {}", chain(&e)).into(),
            })?;
        let tools = self.list(service.peer()).await?;
        self.listen_for_changes(service.peer(), changed.clone());
        self.remote.lock().sessions += 1;
        if principal.is_some() {
            // An instance's session is its own: its keeper ends it (idle, 404, shutdown), and
            // it never ends the provider's session or another principal's.
            return Ok(Session {
                service,
                tools,
                changed,
                group: super::stdio::Group::none(),
            });
        }
        // `end_session` stops this session through `ended` (rmcp's own token cannot be kept
        // beside the service); a new session's token replaces and ends the task of the last.
        let ended = CancellationToken::new();
        let stop = service.cancellation_token();
        let waiting = ended.clone();
        tokio::spawn(async move {
            waiting.cancelled().await;
            stop.cancel();
        });
        {
            let mut state = self.remote.lock();
            if let Some(old) = state.open.replace(ended) {
                old.cancel();
            }
        }
        Ok(Session {
            service,
            tools,
            changed,
            // No process of ours: nothing to kill.
            group: super::stdio::Group::none(),
        })
    }

    /// The failure of a call whose request did not get a result: a JSON-RPC error the server
    /// answered with is `upstream_error` with its code and message (bounded; the kernel redacts
    /// it): the server is up and said no, nothing restarts. Without an answer: a remote server's
    /// refusal of the broker's credentials is `upstream_unauthorized` (never retried), a
    /// response over the limit `too_large`, anything else `upstream_unavailable`. A session the
    /// server ended is ended here too, so the supervisor (or, for `instance`, the principal's
    /// next call) opens a new one.
    pub(super) fn call_failure(
        &self,
        e: &ServiceError,
        instance: Option<&super::instances::Instance>,
    ) -> super::Attempt {
        let ns = &self.config.namespace;
        if let ServiceError::McpError(error) = e {
            // Redacted before it is cut: a value cut in two would no longer be found.
            let mut message = error.message.to_string();
            self.secrets
                .known
                .redact_text("", &mut message, &mut Default::default());
            return super::Attempt::Failed(Failure::new(
                FailCode::UpstreamError,
                format!(
                    "the upstream server of `{ns}` answered the call with JSON-RPC error {}: {}",
                    error.code.0,
                    super::bounded_message(&message)
                ),
            ));
        }
        super::Attempt::Failed(match self.is_remote().then(|| classify(e)) {
            Some(HttpFailure::Unauthorized(status)) => Failure::new(
                FailCode::UpstreamUnauthorized,
                format!(
                    "the remote server of `{ns}` refused the broker's credentials (HTTP {status}); check the provider's headers"
                ),
            ),
            Some(HttpFailure::SignIn(message)) => Failure::new(FailCode::SignInRequired, message),
            Some(HttpFailure::Missing(message)) => {
                Failure::new(FailCode::MissingCredential, message)
            }
            Some(HttpFailure::TokenRefused(message)) => {
                Failure::new(FailCode::UpstreamUnauthorized, message)
            }
            Some(HttpFailure::TooLarge(max)) => Failure::new(
                FailCode::TooLarge,
                format!("the upstream's response is over {max} bytes"),
            ),
            Some(HttpFailure::SessionExpired) => {
                match instance {
                    Some(i) => i.end(),
                    None => self.remote.end_session(),
                }
                return super::Attempt::Expired(Failure::new(
                    FailCode::UpstreamUnavailable,
                    format!(
                        "the remote server of `{ns}` ended its session (HTTP 404) before answering; the call was not sent again, as it may change state; a new session is being opened"
                    ),
                ));
            }
            _ => Failure::new(
                FailCode::UpstreamUnavailable,
                format!(
                    "the upstream server of `{ns}` went away during the call ({}); it is being restarted",
                    if self.is_remote() {
                        chain(e)
                    } else {
                        e.to_string()
                    }
                ),
            ),
        })
    }
}
