//! OAuth 2.0 client credentials (RFC 6749 §4.4) for a remote provider: the broker asks the
//! token endpoint for an access token with the provider's client id and secret (a secret
//! reference, so per principal where the provider is `per_principal`), caches it until shortly
//! before it expires, and sends it on every request of the session as `Authorization: Bearer`.
//! A token the server refuses (401) is fetched anew once and the request sent again once; a
//! token endpoint that refuses the client is `upstream_unauthorized`, never retried in a loop.
//!
//! Why not rmcp's `auth` feature: its client-credentials flow starts from the server's
//! authorization-server metadata (RFC 8414 discovery) and renews only through a refresh token,
//! which client-credentials servers do not issue; what is needed here is one form POST to a
//! configured endpoint and a cache, so the token goes through [`TokenClient`], a thin wrapper
//! of the session's HTTP client (`wire`) that supplies the current token per request.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use futures::stream::BoxStream;
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::ClientJsonRpcMessage;
use rmcp::transport::streamable_http_client::{
    AuthRequiredError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};
use serde::Deserialize;

use crate::config::{OAuthAuthMethod, OAuthConfig};
use crate::secrets::{Known, Secret};

/// Most bytes of a token endpoint's response that are read.
const MAX_TOKEN_RESPONSE_BYTES: usize = 64 * 1024;
/// A token is renewed this long before it expires (at most half its lifetime).
const RENEW_BEFORE: Duration = Duration::from_secs(30);
/// The token request's time limit, besides the connect limit.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(15);
/// Marks a token endpoint's refusal in the error rmcp carries (see `http::classify_any`).
pub const REFUSED_MARK: &str = "oauth token endpoint refused: ";

/// One client's tokens: the provider's (shared secret) or one principal's.
pub struct Tokens {
    client: reqwest::Client,
    config: OAuthConfig,
    namespace: String,
    resource: String,
    /// Whose client secret this is (a principal, or `_shared`): the token is redacted from
    /// what that principal's calls return, as the secrets themselves are.
    owner: String,
    secret: Secret,
    known: Arc<Known>,
    cached: tokio::sync::Mutex<Option<Cached>>,
    fetches: AtomicU64,
}

struct Cached {
    token: Secret,
    renew_at: Option<Instant>,
}

/// Why no token could be had.
pub enum TokenError {
    /// The endpoint refused the client (HTTP 4xx): `upstream_unauthorized`.
    Refused(String),
    /// It could not be reached, failed, or answered something that is not a token.
    Unavailable(String),
}

use super::token::bearer_of;

#[derive(Deserialize)]
struct ErrorResponse {
    error: String,
}

impl Tokens {
    pub fn new(
        client: reqwest::Client,
        config: OAuthConfig,
        namespace: &str,
        resource: String,
        owner: String,
        secret: Secret,
        known: Arc<Known>,
    ) -> Self {
        Self {
            client,
            config,
            namespace: namespace.to_owned(),
            resource,
            owner,
            secret,
            known,
            cached: tokio::sync::Mutex::new(None),
            fetches: AtomicU64::new(0),
        }
    }

    /// Token requests made so far (for `providers`).
    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }

    /// Whether this cache was made with `secret` (a rotated secret gets a new cache).
    pub fn made_with(&self, secret: &Secret) -> bool {
        self.secret == *secret
    }

    /// The current token: the cached one unless it is about to expire.
    pub async fn current(&self) -> Result<Secret, TokenError> {
        let mut cached = self.cached.lock().await;
        if let Some(c) = cached.as_ref()
            && c.renew_at.is_none_or(|at| Instant::now() < at)
        {
            return Ok(c.token.clone());
        }
        let fresh = self.fetch().await?;
        let token = fresh.token.clone();
        *cached = Some(fresh);
        Ok(token)
    }

    /// A new token after the server refused `rejected` (unless another request renewed it
    /// meanwhile).
    pub async fn renew(&self, rejected: &str) -> Result<Secret, TokenError> {
        let mut cached = self.cached.lock().await;
        if let Some(c) = cached.as_ref()
            && c.token.expose() != rejected
        {
            return Ok(c.token.clone());
        }
        let fresh = self.fetch().await?;
        let token = fresh.token.clone();
        *cached = Some(fresh);
        Ok(token)
    }

    async fn fetch(&self) -> Result<Cached, TokenError> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        let url = &self.config.token_url;
        let ns = &self.namespace;
        let mut form: Vec<(&str, &str)> = vec![("grant_type", "client_credentials")];
        let scope = self.config.scopes.join(" ");
        if !scope.is_empty() {
            form.push(("scope", &scope));
        }
        form.push(("resource", &self.resource));
        let mut request = self.client.post(url).timeout(TOKEN_TIMEOUT);
        match self.config.auth_method {
            OAuthAuthMethod::ClientSecretBasic => {
                // RFC 6749 §2.3.1: the id and secret are form-urlencoded before Basic.
                let enc =
                    |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
                request = request
                    .basic_auth(enc(&self.config.client_id), Some(enc(self.secret.expose())));
            }
            OAuthAuthMethod::ClientSecretPost => {
                form.push(("client_id", &self.config.client_id));
                form.push(("client_secret", self.secret.expose()));
            }
        }
        let body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&form)
            .finish();
        let sent = request
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .header(reqwest::header::ACCEPT, "application/json")
            .body(body)
            .send()
            .await;
        let mut response = sent.map_err(|e| {
            TokenError::Unavailable(format!(
                "the token endpoint `{url}` of provider `{ns}` could not be reached: {}",
                super::cause::chain(&e)
            ))
        })?;
        let status = response.status();
        let mut bytes = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    if bytes.len() + chunk.len() > MAX_TOKEN_RESPONSE_BYTES {
                        return Err(TokenError::Unavailable(format!(
                            "the token endpoint `{url}` of provider `{ns}` answered more than {MAX_TOKEN_RESPONSE_BYTES} bytes"
                        )));
                    }
                    bytes.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(TokenError::Unavailable(format!(
                        "the token endpoint `{url}` of provider `{ns}` broke off its answer: {}",
                        super::cause::chain(&e)
                    )));
                }
            }
        }
        if status.is_client_error() {
            // The OAuth error code only (RFC 6749 §5.2), never the body: it could echo the
            // request.
            let code = serde_json::from_slice::<ErrorResponse>(&bytes)
                .ok()
                .map(|e| {
                    e.error
                        .chars()
                        .filter(char::is_ascii_graphic)
                        .take(64)
                        .collect::<String>()
                })
                .unwrap_or_else(|| "no OAuth error code".to_owned());
            return Err(TokenError::Refused(format!(
                "the token endpoint `{url}` refused client `{}` of provider `{ns}` (HTTP {}, {code})",
                self.config.client_id,
                status.as_u16()
            )));
        }
        if !status.is_success() {
            return Err(TokenError::Unavailable(format!(
                "the token endpoint `{url}` of provider `{ns}` answered HTTP {}",
                status.as_u16()
            )));
        }
        let t = bearer_of(&bytes)
            .map_err(|why| TokenError::Unavailable(format!("provider `{ns}` (`{url}`): {why}")))?;
        let token = Secret::new(t.access_token);
        self.known.add(&self.owner, "oauth access token", &token);
        let renew_at = t.expires_in.map(|s| {
            let life = Duration::from_secs(s);
            Instant::now() + life - RENEW_BEFORE.min(life / 2)
        });
        tracing::info!(provider = %ns, expires_in = ?t.expires_in, "oauth access token fetched");
        Ok(Cached { token, renew_at })
    }
}

/// The provider's token caches, one per client secret owner.
#[derive(Default)]
pub struct TokenCaches(std::sync::Mutex<HashMap<String, Arc<Tokens>>>);

impl TokenCaches {
    /// `owner`'s cache, made (or made again, when the secret changed) by `make`.
    pub fn get(&self, owner: &str, secret: &Secret, make: impl FnOnce() -> Tokens) -> Arc<Tokens> {
        let mut m = crate::lock(&self.0);
        if let Some(t) = m.get(owner)
            && t.made_with(secret)
        {
            return t.clone();
        }
        let t = Arc::new(make());
        m.insert(owner.to_owned(), t.clone());
        t
    }

    /// Token requests made so far, over every owner.
    pub fn fetches(&self) -> u64 {
        crate::lock(&self.0).values().map(|t| t.fetches()).sum()
    }
}

/// Where a session's bearer comes from: the provider's client (client credentials), or one
/// person's sign-in (`authorization_code`, [`super::signin`]).
#[derive(Clone)]
pub enum Source {
    Client(Arc<Tokens>),
    Person(Arc<super::signin::PersonTokens>),
    /// One person's token, exchanged (`token_exchange`, [`super::exchange`]).
    Exchange(Arc<super::exchange::PersonExchange>),
}

/// Marks a credential the turn lacks in the error rmcp carries (see `http::classify_any`).
pub const MISSING_MARK: &str = "credential missing: ";

impl From<super::exchange::ExchangeError> for StreamableHttpError<super::wire::WireError> {
    fn from(e: super::exchange::ExchangeError) -> Self {
        use super::exchange::ExchangeError;
        match e {
            ExchangeError::Missing(why) => StreamableHttpError::AuthRequired(
                AuthRequiredError::new(format!("{MISSING_MARK}{why}")),
            ),
            ExchangeError::Refused(why) => StreamableHttpError::AuthRequired(
                AuthRequiredError::new(format!("{REFUSED_MARK}{why}")),
            ),
            ExchangeError::Unavailable(why) => {
                StreamableHttpError::UnexpectedServerResponse(why.into())
            }
        }
    }
}

/// Marks a sign-in that is needed in the error rmcp carries (see `http::classify_any`).
pub const SIGN_IN_MARK: &str = "sign-in required: ";

impl From<super::signin::SignInError> for StreamableHttpError<super::wire::WireError> {
    fn from(e: super::signin::SignInError) -> Self {
        match e {
            super::signin::SignInError::Required(why) => StreamableHttpError::AuthRequired(
                AuthRequiredError::new(format!("{SIGN_IN_MARK}{why}")),
            ),
            super::signin::SignInError::Unavailable(why) => {
                StreamableHttpError::UnexpectedServerResponse(why.into())
            }
        }
    }
}

impl Source {
    async fn current(&self) -> HttpResult<Secret> {
        match self {
            Source::Client(t) => Ok(t.current().await?),
            Source::Person(p) => Ok(p.current().await?),
            Source::Exchange(x) => Ok(x.current().await?),
        }
    }

    async fn renew(&self, rejected: &str) -> HttpResult<Secret> {
        match self {
            Source::Client(t) => Ok(t.renew(rejected).await?),
            Source::Person(p) => Ok(p.renew(rejected).await?),
            Source::Exchange(x) => Ok(x.renew(rejected).await?),
        }
    }
}

/// The session's own HTTP client (`wire`, for rmcp), with the current OAuth token (when the provider has one) as the
/// bearer of every request, and the session's places: at most `max_connections` requests in
/// flight at once, each holding its place until its response is read to its end
/// ([`super::drain::Drained`]).
#[derive(Clone)]
pub struct TokenClient {
    pub inner: super::wire::Wire,
    pub tokens: Option<Source>,
    pub places: Arc<tokio::sync::Semaphore>,
}

type HttpResult<T> = Result<T, StreamableHttpError<super::wire::WireError>>;

impl From<TokenError> for StreamableHttpError<super::wire::WireError> {
    fn from(e: TokenError) -> Self {
        match e {
            TokenError::Refused(why) => StreamableHttpError::AuthRequired(AuthRequiredError::new(
                format!("{REFUSED_MARK}{why}"),
            )),
            TokenError::Unavailable(why) => {
                StreamableHttpError::UnexpectedServerResponse(why.into())
            }
        }
    }
}

impl TokenClient {
    /// `message`'s place among the session's `max_connections`: a request waits for one. A
    /// notification or an answer to the server does not: it may be what a call holding a place
    /// waits for (the answer to its server's question, a cancel), and its response is empty.
    async fn place(
        &self,
        message: &ClientJsonRpcMessage,
    ) -> HttpResult<Option<tokio::sync::OwnedSemaphorePermit>> {
        if !matches!(message, ClientJsonRpcMessage::Request(_)) {
            return Ok(None);
        }
        // A 2026-07-28 session's `subscriptions/listen` stream stays open for the session, as
        // a 2025-11-25 session's listening GET does: it takes no call's place.
        if let ClientJsonRpcMessage::Request(r) = message
            && matches!(
                r.request,
                rmcp::model::ClientRequest::SubscriptionsListenRequest(_)
            )
        {
            return Ok(None);
        }
        self.places
            .clone()
            .acquire_owned()
            .await
            .map(Some)
            .map_err(|_| {
                StreamableHttpError::UnexpectedServerResponse(
                    "the session's connections are closed".into(),
                )
            })
    }

    /// Runs `send` with the bearer to use; a 401 on a token of ours gets one new token and one
    /// more try (the server refused the request, so it had no effect).
    async fn with_token<T, F, Fut>(&self, given: Option<String>, send: F) -> HttpResult<T>
    where
        F: Fn(Option<String>) -> Fut,
        Fut: Future<Output = HttpResult<T>>,
    {
        let Some(tokens) = &self.tokens else {
            return send(given).await;
        };
        let token = tokens.current().await?;
        match send(Some(token.expose().to_owned())).await {
            Err(StreamableHttpError::AuthRequired(_)) => {
                let fresh = tokens.renew(token.expose()).await?;
                send(Some(fresh.expose().to_owned())).await
            }
            r => r,
        }
    }
}

impl StreamableHttpClient for TokenClient {
    type Error = super::wire::WireError;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let place = self.place(&message).await?;
        let response = self
            .with_token(auth_header, |token| {
                self.inner.post_message(
                    uri.clone(),
                    message.clone(),
                    session_id.clone(),
                    token,
                    custom_headers.clone(),
                )
            })
            .await;
        held(response, place)
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let place = self.place(&message).await?;
        let response = self
            .with_token(auth_header, |token| {
                self.inner.post_message_with_max_sse_event_size(
                    uri.clone(),
                    message.clone(),
                    session_id.clone(),
                    token,
                    custom_headers.clone(),
                    max_sse_event_size,
                )
            })
            .await;
        held(response, place)
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let place = self.place(&message).await?;
        let response = self
            .with_token(auth_header, |token| {
                self.inner.post_message_with_response_limits(
                    uri.clone(),
                    message.clone(),
                    session_id.clone(),
                    token,
                    custom_headers.clone(),
                    limits,
                )
            })
            .await;
        held(response, place)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<()> {
        self.with_token(auth_header, |token| {
            self.inner.delete_session(
                uri.clone(),
                session_id.clone(),
                token,
                custom_headers.clone(),
            )
        })
        .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>> {
        self.with_token(auth_header, |token| {
            self.inner.get_stream(
                uri.clone(),
                session_id.clone(),
                last_event_id.clone(),
                token,
                custom_headers.clone(),
            )
        })
        .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>> {
        self.with_token(auth_header, |token| {
            self.inner.get_stream_with_max_sse_event_size(
                uri.clone(),
                session_id.clone(),
                last_event_id.clone(),
                token,
                custom_headers.clone(),
                max_sse_event_size,
            )
        })
        .await
    }
}

/// A response with its place: an SSE stream keeps it until it is read to its end; anything
/// else was read whole (or failed) and gives it back.
fn held(
    response: HttpResult<StreamableHttpPostResponse>,
    place: Option<tokio::sync::OwnedSemaphorePermit>,
) -> HttpResult<StreamableHttpPostResponse> {
    match response {
        Ok(StreamableHttpPostResponse::Sse(stream, session)) => {
            Ok(StreamableHttpPostResponse::Sse(
                super::drain::Drained::new(stream, place).boxed(),
                session,
            ))
        }
        other => {
            super::drain::give_back(place);
            other
        }
    }
}
