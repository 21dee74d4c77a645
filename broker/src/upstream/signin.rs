//! Signing people in to remote servers (`[providers.oauth] grant = "authorization_code"`,
//! issue 45): each principal's instance of the provider sends that person's own access token,
//! got by the OAuth authorization code flow with PKCE S256 on the person's page.
//!
//! - Discovery, from the server itself: its 401's `WWW-Authenticate: Bearer
//!   resource_metadata="…"` (else the RFC 9728 well-known path) gives its protected resource
//!   metadata: its `resource` and authorization server, whose RFC 8414 (or OpenID) metadata
//!   gives the endpoints. The client is the configured `client_id` (and shared secret), else
//!   one the broker registers (RFC 7591) as a public client.
//! - A principal's call without a token is held: the person is sent a link to their page (a
//!   URL-mode elicitation through the harness) carrying a one-time id only; the page, with the
//!   person signed in as that principal, sends the browser to the authorization server (`state`:
//!   random, single use, expiring, bound to principal, provider and the browser's sign-in
//!   cookie; `resource`, RFC 8707); the callback exchanges the code and stores the tokens; the
//!   held call then goes on. Without a harness that shows links, the call fails
//!   `sign_in_required` with the link. Every refusal ([`LinkRefused`]) has a code the page
//!   records; a used link or `state` is remembered for a while, so that a replay is told apart.
//! - The tokens are stored in a folder of the broker's own, `<record>.oauth/<principal>/<provider>`
//!   (0600 JSON files in 0700 folders, checked like the secret store's): written by the broker,
//!   kept across restarts so a person signs in once, never another principal's. Every token read
//!   or written is added to the redaction list; none is logged, recorded or shown.
//! - An access token about to expire, or refused by the server (401), is refreshed once with the
//!   refresh token; a refused refresh deletes the tokens, and the person is asked again.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Digest as _;

use crate::config::OAuthConfig;
use crate::secrets::{FileIdentity, FolderStore, Known, SHARED, Secret, SecretStore};

/// How long a sign-in link, and a started sign-in, stay usable.
pub const SIGN_IN_LIFETIME: Duration = Duration::from_secs(600);
/// Most sign-in links and started sign-ins kept at once (the oldest go first).
const MAX_PENDING: usize = 4096;
/// Time limit of one request to the server's metadata or the authorization server.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest metadata or token response read.
const MAX_RESPONSE_BYTES: usize = 256 * 1024;
/// A token is refreshed this long before it expires (at most half its lifetime).
const REFRESH_BEFORE: Duration = Duration::from_secs(30);
/// Metadata is discovered again after this long.
const DISCOVERY_TTL: Duration = Duration::from_secs(3600);

/// Why no token could be had.
#[derive(Debug)]
pub enum SignInError {
    /// The person has to sign in (no tokens, or the refresh was refused).
    Required(String),
    /// The server or its authorization server could not be used.
    Unavailable(String),
}

impl std::fmt::Display for SignInError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SignInError::Required(s) | SignInError::Unavailable(s) => f.write_str(s),
        }
    }
}

/// One principal's tokens for one provider, as stored.
#[derive(Clone, Serialize, Deserialize)]
struct Stored {
    access_token: String,
    #[serde(default)]
    refresh_token: Option<String>,
    /// Seconds since the epoch.
    #[serde(default)]
    expires_at: Option<u64>,
    /// The client the tokens were issued to (a registered client's id survives a restart).
    client_id: String,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Stored {
    /// Due for a refresh: within [`REFRESH_BEFORE`] (at most half its life) of expiring.
    fn due(&self, issued_life: Option<u64>) -> bool {
        let Some(at) = self.expires_at else {
            return false;
        };
        let margin = issued_life.map_or(REFRESH_BEFORE.as_secs(), |l| {
            (l / 2).min(REFRESH_BEFORE.as_secs())
        });
        now_secs() + margin >= at
    }
}

/// `n` random bytes as URL-safe base64.
fn random(n: usize) -> Result<String, String> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness: {e}"))?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// A link id: 128 random bits, 32 hex digits (the page's link shape).
fn link_id() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn challenge(verifier: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sha2::Sha256::digest(verifier))
}

/// What discovery found: the endpoints, the resource and the client.
struct Found {
    authorize: url::Url,
    token: url::Url,
    resource: String,
    scopes: Vec<String>,
    client_id: String,
    client_secret: Option<Secret>,
    registration: Registration,
    at: Instant,
}

/// How the broker came to be a client of the authorization server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// `oauth.client_id`, registered by the operator.
    Configured,
    /// Its client ID metadata document's URL is its client id.
    MetadataDocument,
    /// Registered by the broker (RFC 7591).
    Dynamic,
}

impl Registration {
    pub fn as_str(self) -> &'static str {
        match self {
            Registration::Configured => "configured",
            Registration::MetadataDocument => "metadata_document",
            Registration::Dynamic => "dynamic",
        }
    }
}

/// Discovery from a remote server (RFC 9728, then RFC 8414 or OpenID metadata): shared by the
/// sign-ins and the token exchange ([`super::exchange`]).
pub struct Discovery {
    pub ns: String,
    pub url: String,
    pub insecure_http: bool,
    pub http: reqwest::Client,
}

impl Discovery {
    /// An endpoint's URL, https unless loopback (or the provider's `insecure_http`).
    pub(super) fn endpoint(&self, what: &str, u: &str) -> Result<url::Url, String> {
        let ns = &self.ns;
        let url = url::Url::parse(u)
            .map_err(|e| format!("provider `{ns}`: the {what} `{u}` is not a URL: {e}"))?;
        match url.scheme() {
            "https" => Ok(url),
            "http" if self.insecure_http || crate::config::host_is_loopback(&url) => Ok(url),
            _ => Err(format!(
                "provider `{ns}`: the {what} `{u}` is not https (plain http only on loopback, or with insecure_http)"
            )),
        }
    }

    pub(super) async fn read(
        &self,
        mut response: reqwest::Response,
        what: &str,
    ) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| format!("{what}: {}", super::cause::chain(&e)))?
        {
            if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                return Err(format!("{what}: more than {MAX_RESPONSE_BYTES} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// A JSON document at `url`: `None` when the server says 404.
    pub(super) async fn get_json(
        &self,
        url: &url::Url,
        what: &str,
    ) -> Result<Option<Value>, String> {
        let response = self
            .http
            .get(url.clone())
            .timeout(REQUEST_TIMEOUT)
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| format!("{what} `{url}`: {}", super::cause::chain(&e)))?;
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let body = self.read(response, what).await?;
        if !status.is_success() {
            return Err(format!("{what} `{url}` answered HTTP {}", status.as_u16()));
        }
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| format!("{what} `{url}` is not JSON: {e}"))
    }

    /// The server's protected resource metadata URL: from its 401's `WWW-Authenticate`
    /// (`resource_metadata`), else the RFC 9728 well-known paths.
    pub(super) async fn metadata_urls(&self) -> Result<Vec<url::Url>, String> {
        let ns = &self.ns;
        let server = self.endpoint("server url", &self.url)?;
        let response = self
            .http
            .post(server.clone())
            .timeout(REQUEST_TIMEOUT)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(r#"{"jsonrpc":"2.0","id":0,"method":"ping"}"#)
            .send()
            .await
            .map_err(|e| {
                format!(
                    "provider `{ns}`: the server `{}` could not be reached: {}",
                    self.url,
                    super::cause::chain(&e)
                )
            })?;
        let named = response
            .headers()
            .get_all(reqwest::header::WWW_AUTHENTICATE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(resource_metadata_of);
        let _ = self.read(response, "the server's 401").await;
        if let Some(u) = named {
            return Ok(vec![self.endpoint("resource_metadata", &u)?]);
        }
        let path = server.path().trim_end_matches('/');
        let mut out = Vec::new();
        for p in [
            format!("/.well-known/oauth-protected-resource{path}"),
            "/.well-known/oauth-protected-resource".to_owned(),
        ] {
            let mut u = server.clone();
            u.set_path(&p);
            u.set_query(None);
            out.push(u);
        }
        Ok(out)
    }

    /// The server's protected resource metadata, its `resource` (or `configured`, checked),
    /// its first authorization server and that server's metadata (issuer checked).
    pub async fn authorization_server(
        &self,
        configured: &Option<String>,
    ) -> Result<(Value, String, String, Value), String> {
        let ns = &self.ns;
        let mut prm = None;
        for u in self.metadata_urls().await? {
            if let Some(v) = self.get_json(&u, "protected resource metadata").await? {
                prm = Some(v);
                break;
            }
        }
        let prm = prm.ok_or_else(|| {
            format!(
                "provider `{ns}`: the server publishes no protected resource metadata (RFC 9728): it does not say where to sign in"
            )
        })?;
        let resource = match &configured {
            Some(r) => r.clone(),
            None => prm
                .get("resource")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("provider `{ns}`: the server's protected resource metadata has no `resource`"))?
                .to_owned(),
        };
        if configured.is_none() && resource.trim_end_matches('/') != self.url.trim_end_matches('/')
        {
            return Err(format!(
                "provider `{ns}`: the server's metadata names resource `{resource}`, not its url `{}` (RFC 9728 §3.3): refused; set oauth.resource if that is right",
                self.url
            ));
        }
        let issuer = prm
            .get("authorization_servers")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| {
                format!("provider `{ns}`: the server's protected resource metadata names no authorization server")
            })?
            .to_owned();
        let issuer_url = self.endpoint("authorization server", &issuer)?;
        let path = issuer_url.path().trim_end_matches('/').to_owned();
        let mut candidates = Vec::new();
        for well_known in [
            "/.well-known/oauth-authorization-server",
            "/.well-known/openid-configuration",
        ] {
            let mut u = issuer_url.clone();
            u.set_path(&format!("{well_known}{path}"));
            candidates.push(u);
        }
        if !path.is_empty() {
            let mut u = issuer_url.clone();
            u.set_path(&format!("{path}/.well-known/openid-configuration"));
            candidates.push(u);
        }
        let mut meta = None;
        for u in &candidates {
            if let Some(v) = self.get_json(u, "authorization server metadata").await? {
                meta = Some(v);
                break;
            }
        }
        let meta = meta.ok_or_else(|| {
            format!("provider `{ns}`: the authorization server `{issuer}` publishes no metadata (RFC 8414 or OpenID)")
        })?;
        let said = meta.get("issuer").and_then(Value::as_str).unwrap_or("");
        if said.trim_end_matches('/') != issuer.trim_end_matches('/') {
            return Err(format!(
                "provider `{ns}`: the authorization server's metadata says issuer `{said}`, not `{issuer}`: refused"
            ));
        }
        Ok((prm, resource, issuer, meta))
    }
}

/// The OAuth client of one provider: discovery, registration, the code exchange and refresh.
pub struct AuthCodeClient {
    ns: String,
    d: Discovery,
    config: OAuthConfig,
    http: reqwest::Client,
    redirect: url::Url,
    /// The broker's client ID metadata document on its page (`oauth/client.json`), when the
    /// page is served over HTTPS: the client id where the authorization server takes one.
    metadata_document: Option<url::Url>,
    store: Arc<dyn SecretStore>,
    found: tokio::sync::Mutex<Option<Arc<Found>>>,
    refreshes: AtomicU64,
}

use super::token::TokenResponse;

/// A token endpoint's answer: tokens, or a refusal with the OAuth error code.
enum Answer {
    Tokens(TokenResponse),
    Refused(String),
}

impl AuthCodeClient {
    /// The client of provider `ns` at `url`, for the sign-ins of `signins`' page (its redirect
    /// URI and, on HTTPS, its client ID metadata document).
    pub fn new(
        ns: &str,
        url: &str,
        config: OAuthConfig,
        insecure_http: bool,
        http: reqwest::Client,
        signins: &SignIns,
        store: Arc<dyn SecretStore>,
    ) -> Result<Self, String> {
        Ok(Self {
            ns: ns.to_owned(),
            d: Discovery {
                ns: ns.to_owned(),
                url: url.to_owned(),
                insecure_http,
                http: http.clone(),
            },
            config,
            http,
            redirect: signins.redirect()?,
            metadata_document: signins.metadata_document(),
            store,
            found: tokio::sync::Mutex::new(None),
            refreshes: AtomicU64::new(0),
        })
    }

    /// Refreshes made so far (for `providers`).
    pub fn refreshes(&self) -> u64 {
        self.refreshes.load(Ordering::Relaxed)
    }

    /// How the broker is this server's client, once discovered (`None` while discovery runs).
    pub fn registration(&self) -> Option<Registration> {
        self.found
            .try_lock()
            .ok()
            .and_then(|f| f.as_ref().map(|f| f.registration))
    }

    /// Discovers (or returns the discovered) endpoints, resource and client.
    async fn found(&self) -> Result<Arc<Found>, String> {
        let mut found = self.found.lock().await;
        if let Some(f) = found.as_ref()
            && f.at.elapsed() < DISCOVERY_TTL
        {
            return Ok(f.clone());
        }
        // A client the broker registered is kept when the metadata is read again.
        let registered = found
            .as_ref()
            .filter(|f| f.registration == Registration::Dynamic)
            .map(|f| f.client_id.clone());
        let fresh = Arc::new(self.discover(registered).await?);
        *found = Some(fresh.clone());
        Ok(fresh)
    }

    async fn discover(&self, registered: Option<String>) -> Result<Found, String> {
        let ns = &self.ns;
        let (prm, resource, issuer, meta) =
            self.d.authorization_server(&self.config.resource).await?;
        let s256 = meta
            .get("code_challenge_methods_supported")
            .and_then(Value::as_array)
            .is_some_and(|m| m.iter().any(|m| m == "S256"));
        if !s256 {
            return Err(format!(
                "provider `{ns}`: the authorization server `{issuer}` does not offer PKCE S256 (code_challenge_methods_supported): refused"
            ));
        }
        let field = |k: &str| {
            meta.get(k).and_then(Value::as_str).ok_or_else(|| {
                format!("provider `{ns}`: the authorization server's metadata has no `{k}`")
            })
        };
        let authorize = self
            .d
            .endpoint("authorization_endpoint", field("authorization_endpoint")?)?;
        let token = self
            .d
            .endpoint("token_endpoint", field("token_endpoint")?)?;
        let scopes = if self.config.scopes.is_empty() {
            prm.get("scopes_supported")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        } else {
            self.config.scopes.clone()
        };
        // Which client the broker is, in the order the 2025-11-25 specification gives: one the
        // operator registered; else its client ID metadata document, where the authorization
        // server fetches those (`client_id_metadata_document_supported`) and the page is on
        // HTTPS; else one it registers itself (RFC 7591).
        let takes_documents = meta
            .get("client_id_metadata_document_supported")
            .and_then(Value::as_bool)
            == Some(true);
        let (client_id, client_secret, registration) = if !self.config.client_id.is_empty() {
            let secret = match &self.config.client_secret {
                Some(crate::config::ConfigValue::Plain(s)) => Some(Secret::new(s.clone())),
                Some(crate::config::ConfigValue::Secret(r)) => Some(
                    self.store
                        .get(SHARED, &r.secret)
                        .await
                        .map_err(|e| format!("provider `{ns}`: oauth.client_secret: {e}"))?,
                ),
                None => None,
            };
            (
                self.config.client_id.clone(),
                secret,
                Registration::Configured,
            )
        } else if let Some(document) = self.metadata_document.as_ref().filter(|_| takes_documents) {
            (document.to_string(), None, Registration::MetadataDocument)
        } else {
            let registration = meta
                .get("registration_endpoint")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    let document = if !takes_documents {
                        "no client ID metadata documents (client_id_metadata_document_supported)"
                    } else {
                        "client ID metadata documents, which need the page on HTTPS ([page] cert and key)"
                    };
                    format!(
                        "provider `{ns}`: the authorization server `{issuer}` takes {document} and offers no dynamic client registration: set oauth.client_id (and the redirect URI `{}` there)",
                        self.redirect
                    )
                })?;
            let registration = self.d.endpoint("registration_endpoint", registration)?;
            let id = match registered {
                Some(id) => id,
                None => self.register(&registration).await?,
            };
            (id, None, Registration::Dynamic)
        };
        tracing::info!(provider = %ns, %issuer, %resource, client_id = %client_id, registration = registration.as_str(), "the server's authorization server discovered");
        Ok(Found {
            authorize,
            token,
            resource,
            scopes,
            client_id,
            client_secret,
            registration,
            at: Instant::now(),
        })
    }

    /// Registers the broker as a public client (RFC 7591): its id.
    async fn register(&self, at: &url::Url) -> Result<String, String> {
        let ns = &self.ns;
        let body = serde_json::json!({
            "client_name": format!("SharedOS broker ({ns})"),
            "redirect_uris": [self.redirect.as_str()],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        });
        let response = self
            .http
            .post(at.clone())
            .timeout(REQUEST_TIMEOUT)
            .json(&body)
            .send()
            .await
            .map_err(|e| {
                format!(
                    "provider `{ns}`: client registration at `{at}`: {}",
                    super::cause::chain(&e)
                )
            })?;
        let status = response.status();
        let bytes = self.d.read(response, "client registration").await?;
        if !status.is_success() {
            return Err(format!(
                "provider `{ns}`: client registration at `{at}` answered HTTP {} ({})",
                status.as_u16(),
                oauth_error(&bytes)
            ));
        }
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("provider `{ns}`: client registration answered no JSON: {e}"))?;
        let id = v
            .get("client_id")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("provider `{ns}`: client registration answered no client_id"))?;
        tracing::info!(provider = %ns, client_id = %id, "registered at the authorization server (RFC 7591)");
        Ok(id.to_owned())
    }

    /// The authorization URL a person's browser is sent to.
    async fn authorize_url(&self, state: &str, verifier: &str) -> Result<url::Url, String> {
        let found = self.found().await?;
        let mut url = found.authorize.clone();
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("response_type", "code")
                .append_pair("client_id", &found.client_id)
                .append_pair("redirect_uri", self.redirect.as_str())
                .append_pair("state", state)
                .append_pair("code_challenge", &challenge(verifier))
                .append_pair("code_challenge_method", "S256")
                .append_pair("resource", &found.resource);
            if !found.scopes.is_empty() {
                q.append_pair("scope", &found.scopes.join(" "));
            }
        }
        Ok(url)
    }

    /// One request to the token endpoint.
    async fn token_request(
        &self,
        found: &Found,
        client_id: &str,
        form: &[(&str, &str)],
    ) -> Result<Answer, String> {
        let ns = &self.ns;
        let mut form = form.to_vec();
        form.push(("resource", &found.resource));
        let mut request = self
            .http
            .post(found.token.clone())
            .timeout(REQUEST_TIMEOUT)
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json");
        match &found.client_secret {
            Some(secret) if client_id == found.client_id => {
                let enc =
                    |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
                request = request.basic_auth(enc(client_id), Some(enc(secret.expose())));
            }
            _ => form.push(("client_id", client_id)),
        }
        let body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&form)
            .finish();
        let response = request.body(body).send().await.map_err(|e| {
            format!(
                "provider `{ns}`: the token endpoint `{}` could not be reached: {}",
                found.token,
                super::cause::chain(&e)
            )
        })?;
        let status = response.status();
        let bytes = self.d.read(response, "the token endpoint").await?;
        if status.is_client_error() {
            return Ok(Answer::Refused(format!(
                "HTTP {}, {}",
                status.as_u16(),
                oauth_error(&bytes)
            )));
        }
        if !status.is_success() {
            return Err(format!(
                "provider `{ns}`: the token endpoint `{}` answered HTTP {}",
                found.token,
                status.as_u16()
            ));
        }
        let t = super::token::bearer_of(&bytes).map_err(|why| format!("provider `{ns}`: {why}"))?;
        Ok(Answer::Tokens(t))
    }

    fn stored(t: TokenResponse, client_id: &str, old_refresh: Option<String>) -> Stored {
        Stored {
            access_token: t.access_token,
            refresh_token: t.refresh_token.or(old_refresh),
            expires_at: t.expires_in.map(|s| now_secs() + s),
            client_id: client_id.to_owned(),
        }
    }

    /// The code the person's browser brought back, exchanged for tokens.
    async fn exchange(&self, code: &str, verifier: &str) -> Result<Stored, String> {
        let found = self.found().await?;
        let redirect = self.redirect.to_string();
        let answer = self
            .token_request(
                &found,
                &found.client_id,
                &[
                    ("grant_type", "authorization_code"),
                    ("code", code),
                    ("redirect_uri", &redirect),
                    ("code_verifier", verifier),
                ],
            )
            .await?;
        match answer {
            Answer::Tokens(t) => Ok(Self::stored(t, &found.client_id, None)),
            Answer::Refused(why) => Err(format!(
                "provider `{}`: the authorization server refused the sign-in's code ({why})",
                self.ns
            )),
        }
    }

    /// New tokens for `old` by its refresh token: `Required` when there is none or the
    /// authorization server refuses it (revoked, expired).
    async fn refresh(&self, old: &Stored) -> Result<Stored, SignInError> {
        let ns = &self.ns;
        let Some(refresh) = old.refresh_token.clone() else {
            return Err(SignInError::Required(format!(
                "the access token for `{ns}` expired and came with no refresh token"
            )));
        };
        let found = self.found().await.map_err(SignInError::Unavailable)?;
        self.refreshes.fetch_add(1, Ordering::Relaxed);
        let answer = self
            .token_request(
                &found,
                &old.client_id,
                &[("grant_type", "refresh_token"), ("refresh_token", &refresh)],
            )
            .await
            .map_err(SignInError::Unavailable)?;
        match answer {
            Answer::Tokens(t) => {
                tracing::info!(provider = %ns, "oauth access token refreshed");
                Ok(Self::stored(t, &old.client_id, Some(refresh)))
            }
            Answer::Refused(why) => {
                tracing::warn!(provider = %ns, %why, "the refresh token was refused: the person signs in again");
                Err(SignInError::Required(format!(
                    "the authorization server refused the refresh of the sign-in to `{ns}` ({why})"
                )))
            }
        }
    }
}

/// The `resource_metadata` parameter of a `WWW-Authenticate: Bearer …` value.
fn resource_metadata_of(header: &str) -> Option<String> {
    let rest = header.trim_start();
    let params = rest
        .get(..6)
        .filter(|s| s.eq_ignore_ascii_case("bearer"))
        .map(|_| &rest[6..])?;
    let key = "resource_metadata=";
    let at = params.find(key)? + key.len();
    let value = &params[at..];
    let value = match value.strip_prefix('"') {
        Some(quoted) => quoted.split('"').next()?,
        None => value.split([',', ' ']).next()?,
    };
    (!value.is_empty()).then(|| value.to_owned())
}

/// An OAuth error code (RFC 6749 §5.2) from a body, bounded; never the body itself.
fn oauth_error(bytes: &[u8]) -> String {
    serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned))
        .map(|e| e.chars().filter(char::is_ascii_graphic).take(64).collect())
        .unwrap_or_else(|| "no OAuth error code".to_owned())
}

/// A sign-in link: the person it is for, the provider, until when.
struct Link {
    principal: String,
    provider: String,
    until: Instant,
}

/// A started sign-in, by its `state`: bound to the principal and provider, and to the browser
/// that started it (the value of its sign-in cookie).
struct Flow {
    principal: String,
    provider: String,
    verifier: String,
    browser: String,
    until: Instant,
}

/// A used link or `state`, kept for [`SIGN_IN_LIFETIME`] so that a replay is told (and
/// recorded) as one, with whose it was.
struct Used {
    principal: String,
    provider: String,
    until: Instant,
}

/// Whose a refused link or sign-in was: its principal and provider.
#[derive(Debug, Clone)]
pub struct Whose {
    pub principal: String,
    pub provider: String,
}

/// Why a sign-in link or callback was refused. None carries a token, a code or a `state`.
#[derive(Debug, thiserror::Error)]
pub enum LinkRefused {
    #[error("no sign-in has this link: call again for a new one")]
    Unknown,
    #[error("this sign-in link of `{}` to `{}` was used already: a link works once; call again for a new one", .0.principal, .0.provider)]
    Used(Whose),
    #[error("this sign-in link of `{}` to `{}` is too old (links last {} s): call again for a new one", .0.principal, .0.provider, SIGN_IN_LIFETIME.as_secs())]
    Expired(Whose),
    #[error("this sign-in is for principal `{}`; you are signed in as `{signed_in}`", .whose.principal)]
    NotYours { whose: Whose, signed_in: String },
    #[error("no provider `{0}` signs people in")]
    NoProvider(String),
    #[error("{0}")]
    Failed(String),
    #[error("the authorization server sent back a sign-in this page never started: start again")]
    StateUnknown,
    #[error("this sign-in of `{}` to `{}` was finished or refused already: a sign-in is used once; start again", .0.principal, .0.provider)]
    StateUsed(Whose),
    #[error("this sign-in of `{}` to `{}` is too old (sign-ins last {} s): start again", .0.principal, .0.provider, SIGN_IN_LIFETIME.as_secs())]
    StateExpired(Whose),
    #[error("this sign-in of `{}` to `{}` was started in another browser: it is refused here; start again from your own page", .0.principal, .0.provider)]
    OtherBrowser(Whose),
    #[error("this sign-in to `{}` is for principal `{}`, and this browser is signed in to the page as `{signed_in}`: refused", .whose.provider, .whose.principal)]
    OtherPrincipal { whose: Whose, signed_in: String },
    #[error("the authorization server refused the sign-in of `{}` to `{}` ({error})", .whose.principal, .whose.provider)]
    Denied { whose: Whose, error: String },
    #[error("the sign-in of `{}` to `{}` could not be finished: {why}", .whose.principal, .whose.provider)]
    TokenFailed { whose: Whose, why: String },
}

impl LinkRefused {
    /// The refusal's code, as the record has it.
    pub fn code(&self) -> &'static str {
        match self {
            LinkRefused::Unknown => "link_unknown",
            LinkRefused::Used(_) => "link_used",
            LinkRefused::Expired(_) => "link_expired",
            LinkRefused::NotYours { .. } => "link_not_yours",
            LinkRefused::NoProvider(_) => "no_provider",
            LinkRefused::Failed(_) => "start_failed",
            LinkRefused::StateUnknown => "state_unknown",
            LinkRefused::StateUsed(_) => "state_used",
            LinkRefused::StateExpired(_) => "state_expired",
            LinkRefused::OtherBrowser(_) => "other_browser",
            LinkRefused::OtherPrincipal { .. } => "not_yours",
            LinkRefused::Denied { .. } => "authorization_refused",
            LinkRefused::TokenFailed { .. } => "token_failed",
        }
    }

    /// Whose link or sign-in it was, when the page knows.
    pub fn whose(&self) -> Option<&Whose> {
        match self {
            LinkRefused::Used(w)
            | LinkRefused::Expired(w)
            | LinkRefused::StateUsed(w)
            | LinkRefused::StateExpired(w)
            | LinkRefused::OtherBrowser(w)
            | LinkRefused::NotYours { whose: w, .. }
            | LinkRefused::OtherPrincipal { whose: w, .. }
            | LinkRefused::Denied { whose: w, .. }
            | LinkRefused::TokenFailed { whose: w, .. } => Some(w),
            LinkRefused::Unknown
            | LinkRefused::NoProvider(_)
            | LinkRefused::Failed(_)
            | LinkRefused::StateUnknown => None,
        }
    }
}

/// Keeps `id` as used (bounded, the oldest go first).
fn tombstone(used: &mut HashMap<String, Used>, id: String, principal: &str, provider: &str) {
    let now = Instant::now();
    used.retain(|_, u| u.until > now);
    if used.len() >= MAX_PENDING
        && let Some(oldest) = used
            .iter()
            .min_by_key(|(_, u)| u.until)
            .map(|(k, _)| k.clone())
    {
        used.remove(&oldest);
    }
    used.insert(
        id,
        Used {
            principal: principal.to_owned(),
            provider: provider.to_owned(),
            until: now + SIGN_IN_LIFETIME,
        },
    );
}

/// A used id's owner, if it was used recently.
fn used_by(used: &HashMap<String, Used>, id: &str) -> Option<Whose> {
    used.get(id)
        .filter(|u| u.until > Instant::now())
        .map(|u| Whose {
            principal: u.principal.clone(),
            provider: u.provider.clone(),
        })
}

/// An OAuth error code from the authorization server's redirect, as shown and recorded:
/// printable ASCII, at most 64 characters.
pub fn error_code(error: &str) -> String {
    error
        .chars()
        .filter(char::is_ascii_graphic)
        .take(64)
        .collect()
}

/// The sign-ins of every `authorization_code` provider: the clients, the links and started
/// flows, the token store, and who signed in (watched by held calls).
pub struct SignIns {
    page: url::Url,
    store: FolderStore,
    known: Arc<Known>,
    clients: std::sync::Mutex<HashMap<String, Arc<AuthCodeClient>>>,
    links: std::sync::Mutex<HashMap<String, Link>>,
    flows: std::sync::Mutex<HashMap<String, Flow>>,
    used_links: std::sync::Mutex<HashMap<String, Used>>,
    used_states: std::sync::Mutex<HashMap<String, Used>>,
    signed_in: tokio::sync::watch::Sender<u64>,
    /// Bumped for a principal and provider when their sign-in is forgotten: a session's
    /// cached token of an older epoch is not sent again.
    epochs: std::sync::Mutex<HashMap<(String, String), u64>>,
}

/// Where a broker whose record is `record` keeps people's sign-ins: `<record>.oauth`, a folder
/// store of its own (`<principal>/<provider>`), which `secrets list|delete --sign-in` also reads.
pub fn store_beside(record: &std::path::Path) -> FolderStore {
    FolderStore::new(format!("{}.oauth", record.display()))
}

impl SignIns {
    /// The sign-ins of a broker whose page is at `page` and whose record is `record`: tokens in
    /// `<record>.oauth`.
    pub fn new(page: url::Url, record: &std::path::Path, known: Arc<Known>) -> Arc<Self> {
        Arc::new(Self {
            page,
            store: store_beside(record),
            known,
            clients: std::sync::Mutex::default(),
            links: std::sync::Mutex::default(),
            flows: std::sync::Mutex::default(),
            used_links: std::sync::Mutex::default(),
            used_states: std::sync::Mutex::default(),
            signed_in: tokio::sync::watch::Sender::new(0),
            epochs: std::sync::Mutex::default(),
        })
    }

    /// The broker's client ID metadata document: its URL, when the page is served over HTTPS
    /// (a document's URL, which is the client id, must be `https`).
    pub fn metadata_document(&self) -> Option<url::Url> {
        (self.page.scheme() == "https")
            .then(|| self.page.join("oauth/client.json").ok())
            .flatten()
    }

    /// The client ID metadata document itself (draft-ietf-oauth-client-id-metadata-document,
    /// as the 2025-11-25 MCP specification uses it): a public client (PKCE, no secret) whose
    /// only redirect URI is the page's `oauth/callback`; `None` without HTTPS.
    pub fn metadata(&self) -> Option<Value> {
        let id = self.metadata_document()?;
        let redirect = self.redirect().ok()?;
        Some(serde_json::json!({
            "client_id": id.as_str(),
            "client_name": "SharedOS broker",
            "client_uri": self.page.as_str(),
            "redirect_uris": [redirect.as_str()],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        }))
    }

    /// The redirect URI of every provider's sign-in: the page's `oauth/callback`.
    pub fn redirect(&self) -> Result<url::Url, String> {
        self.page
            .join("oauth/callback")
            .map_err(|e| format!("[page] public_url: {e}"))
    }

    pub fn add(&self, ns: &str, client: Arc<AuthCodeClient>) {
        crate::lock(&self.clients).insert(ns.to_owned(), client);
    }

    fn client(&self, ns: &str) -> Option<Arc<AuthCodeClient>> {
        crate::lock(&self.clients).get(ns).cloned()
    }

    /// Whether `ns` is a provider people sign in to.
    pub fn has_provider(&self, ns: &str) -> bool {
        self.client(ns).is_some()
    }

    /// Where to send `principal` to sign in to `ns`: a one-time link to the page.
    pub fn link(&self, principal: &str, ns: &str) -> Result<url::Url, String> {
        let id = link_id()?;
        let url = self
            .page
            .join(&format!("signin/{id}"))
            .map_err(|e| format!("[page] public_url: {e}"))?;
        let mut links = crate::lock(&self.links);
        let now = Instant::now();
        links.retain(|_, l| l.until > now);
        if links.len() >= MAX_PENDING
            && let Some(oldest) = links
                .iter()
                .min_by_key(|(_, l)| l.until)
                .map(|(k, _)| k.clone())
        {
            links.remove(&oldest);
        }
        links.insert(
            id,
            Link {
                principal: principal.to_owned(),
                provider: ns.to_owned(),
                until: now + SIGN_IN_LIFETIME,
            },
        );
        Ok(url)
    }

    /// Takes link `id` for the signed-in `principal` (used once) and starts the sign-in in the
    /// browser whose sign-in cookie is `browser`: the authorization server URL to send it to.
    /// A link of another principal is refused and stays usable by its own.
    pub async fn start_link(
        &self,
        id: &str,
        principal: &str,
        browser: &str,
    ) -> Result<url::Url, LinkRefused> {
        let link = {
            let mut links = crate::lock(&self.links);
            let whose = |l: &Link| Whose {
                principal: l.principal.clone(),
                provider: l.provider.clone(),
            };
            match links.get(id) {
                None => {
                    return Err(match used_by(&crate::lock(&self.used_links), id) {
                        Some(w) => LinkRefused::Used(w),
                        None => LinkRefused::Unknown,
                    });
                }
                Some(l) if l.until <= Instant::now() => {
                    let w = whose(l);
                    links.remove(id);
                    return Err(LinkRefused::Expired(w));
                }
                Some(l) if l.principal != principal => {
                    return Err(LinkRefused::NotYours {
                        whose: whose(l),
                        signed_in: principal.to_owned(),
                    });
                }
                Some(_) => links.remove(id).ok_or(LinkRefused::Unknown)?,
            }
        };
        tombstone(
            &mut crate::lock(&self.used_links),
            id.to_owned(),
            &link.principal,
            &link.provider,
        );
        self.start(principal, &link.provider, browser).await
    }

    /// Starts `principal`'s sign-in to `ns` in the browser whose sign-in cookie is `browser`: a
    /// fresh `state` (single use, expiring, bound to all three) and PKCE verifier; the
    /// authorization URL.
    pub async fn start(
        &self,
        principal: &str,
        ns: &str,
        browser: &str,
    ) -> Result<url::Url, LinkRefused> {
        let client = self
            .client(ns)
            .ok_or_else(|| LinkRefused::NoProvider(ns.to_owned()))?;
        let (state, verifier) = (
            random(32).map_err(LinkRefused::Failed)?,
            random(48).map_err(LinkRefused::Failed)?,
        );
        let url = client
            .authorize_url(&state, &verifier)
            .await
            .map_err(LinkRefused::Failed)?;
        let mut flows = crate::lock(&self.flows);
        let now = Instant::now();
        flows.retain(|_, f| f.until > now);
        if flows.len() >= MAX_PENDING {
            return Err(LinkRefused::Failed(
                "too many sign-ins are under way; try again in a few minutes".into(),
            ));
        }
        flows.insert(
            state,
            Flow {
                principal: principal.to_owned(),
                provider: ns.to_owned(),
                verifier,
                browser: browser.to_owned(),
                until: now + SIGN_IN_LIFETIME,
            },
        );
        tracing::info!(provider = %ns, %principal, "sign-in to a remote server started");
        Ok(url)
    }

    /// Takes the started sign-in of `state` (once: whatever becomes of it, it is used).
    fn take(&self, state: &str) -> Result<(Flow, Whose), LinkRefused> {
        let Some(flow) = crate::lock(&self.flows).remove(state) else {
            return Err(match used_by(&crate::lock(&self.used_states), state) {
                Some(w) => LinkRefused::StateUsed(w),
                None => LinkRefused::StateUnknown,
            });
        };
        tombstone(
            &mut crate::lock(&self.used_states),
            state.to_owned(),
            &flow.principal,
            &flow.provider,
        );
        let whose = Whose {
            principal: flow.principal.clone(),
            provider: flow.provider.clone(),
        };
        if flow.until <= Instant::now() {
            return Err(LinkRefused::StateExpired(whose));
        }
        Ok((flow, whose))
    }

    /// The authorization server sent the browser back with an error (`access_denied`, say)
    /// for `state`: the sign-in is over, refused.
    pub fn deny(&self, state: &str, error: &str) -> LinkRefused {
        match self.take(state) {
            Ok((_, whose)) => LinkRefused::Denied {
                whose,
                error: error_code(error),
            },
            Err(e) => e,
        }
    }

    /// The authorization server sent the browser back with `code` for `state`: in the browser
    /// that started it (`browser`, its sign-in cookie) and, if that browser is signed in to
    /// the page (`session`), as the same principal, the code is exchanged and the tokens
    /// stored for the state's principal and provider (returned).
    pub async fn finish(
        &self,
        state: &str,
        code: &str,
        browser: Option<&str>,
        session: Option<&str>,
    ) -> Result<(String, String), LinkRefused> {
        use subtle::ConstantTimeEq as _;
        let (flow, whose) = self.take(state)?;
        if let Some(signed_in) = session.filter(|p| *p != flow.principal) {
            return Err(LinkRefused::OtherPrincipal {
                whose,
                signed_in: signed_in.to_owned(),
            });
        }
        if !browser.is_some_and(|b| bool::from(b.as_bytes().ct_eq(flow.browser.as_bytes()))) {
            return Err(LinkRefused::OtherBrowser(whose));
        }
        let client = self
            .client(&flow.provider)
            .ok_or_else(|| LinkRefused::NoProvider(flow.provider.clone()))?;
        let failed = |why: String| LinkRefused::TokenFailed {
            whose: whose.clone(),
            why,
        };
        let stored = client
            .exchange(code, &flow.verifier)
            .await
            .map_err(failed)?;
        self.save(&flow.principal, &flow.provider, &stored)
            .map_err(failed)?;
        tracing::info!(provider = %flow.provider, principal = %flow.principal, "signed in to a remote server");
        self.signed_in.send_modify(|n| *n += 1);
        Ok((flow.principal, flow.provider))
    }

    fn learn(&self, principal: &str, s: &Stored) {
        self.known.add(
            principal,
            "oauth access token",
            &Secret::new(s.access_token.clone()),
        );
        if let Some(r) = &s.refresh_token {
            self.known
                .add(principal, "oauth refresh token", &Secret::new(r.clone()));
        }
    }

    fn save(&self, principal: &str, ns: &str, s: &Stored) -> Result<(), String> {
        self.learn(principal, s);
        let text = serde_json::to_vec(s).map_err(|e| e.to_string())?;
        self.store
            .set(principal, ns, &text)
            .map(|_| ())
            .map_err(|e| format!("cannot store the sign-in of `{principal}` to `{ns}`: {e}"))
    }

    fn load(&self, principal: &str, ns: &str) -> Result<Option<Stored>, String> {
        match self.store.read(principal, ns) {
            Ok(v) => {
                let s: Stored = serde_json::from_str(v.expose()).map_err(|e| {
                    format!("the stored sign-in of `{principal}` to `{ns}` is not valid ({e}); it is replaced at the next sign-in")
                })?;
                self.learn(principal, &s);
                Ok(Some(s))
            }
            Err(crate::secrets::SecretError::Missing { .. }) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The identity of the file `principal`'s sign-in to `ns` is stored in, if there is one.
    fn stored_id(&self, principal: &str, ns: &str) -> Option<FileIdentity> {
        self.store.identity(principal, ns)
    }

    fn epoch(&self, principal: &str, ns: &str) -> u64 {
        crate::lock(&self.epochs)
            .get(&(principal.to_owned(), ns.to_owned()))
            .copied()
            .unwrap_or(0)
    }

    /// The providers people sign in to, by name.
    pub fn providers(&self) -> Vec<String> {
        let mut names: Vec<String> = crate::lock(&self.clients).keys().cloned().collect();
        names.sort();
        names
    }

    /// Forgets `principal`'s tokens for `ns` (a refused refresh, a sign-out): the next call
    /// asks them to sign in again.
    pub fn forget(&self, principal: &str, ns: &str) {
        *crate::lock(&self.epochs)
            .entry((principal.to_owned(), ns.to_owned()))
            .or_default() += 1;
        if let Err(e) = self.store.delete(principal, ns) {
            tracing::error!(provider = %ns, %principal, error = %e, "a refused sign-in could not be removed");
        }
    }

    /// Whether `principal` has tokens for `ns`.
    pub fn signed_in(&self, principal: &str, ns: &str) -> bool {
        matches!(self.load(principal, ns), Ok(Some(_)))
    }

    /// Waits until `principal` signed in to `ns`, at most `limit`.
    pub async fn wait(&self, principal: &str, ns: &str, limit: Duration) -> bool {
        let mut rx = self.signed_in.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.signed_in(principal, ns) {
                return true;
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return false; },
                () = tokio::time::sleep_until(deadline) => return self.signed_in(principal, ns),
            }
        }
    }

    /// How the broker is `ns`'s client, once discovered.
    pub fn registration(&self, ns: &str) -> Option<Registration> {
        self.client(ns)?.registration()
    }

    /// Refreshes made for `ns` so far.
    pub fn refreshes(&self, ns: &str) -> u64 {
        self.client(ns).map_or(0, |c| c.refreshes())
    }
}

struct Cached {
    stored: Stored,
    life: Option<u64>,
    epoch: u64,
    /// The stored file the tokens were read from or written to. A cached token is sent only
    /// while the file is still that one, so a sign-in removed or replaced behind the broker's
    /// back (`secrets delete --sign-in`) is not sent again.
    file: Option<FileIdentity>,
}

/// One principal's tokens for one provider, as a session sends them.
pub struct PersonTokens {
    pub signins: Arc<SignIns>,
    pub ns: String,
    pub principal: String,
    /// The tokens sent, their lifetime when read, the sign-in's epoch then, and the identity of
    /// the file they were read from or written to.
    cached: tokio::sync::Mutex<Option<Cached>>,
}

impl PersonTokens {
    pub fn new(signins: Arc<SignIns>, ns: &str, principal: &str) -> Self {
        Self {
            signins,
            ns: ns.to_owned(),
            principal: principal.to_owned(),
            cached: tokio::sync::Mutex::new(None),
        }
    }

    fn required(&self, why: &str) -> SignInError {
        SignInError::Required(format!(
            "principal `{}` is not signed in to `{}`: {why}",
            self.principal, self.ns
        ))
    }

    /// The stored tokens (read again when none are cached).
    fn load(&self) -> Result<(Stored, Option<u64>), SignInError> {
        match self.signins.load(&self.principal, &self.ns) {
            Ok(Some(s)) => {
                let life = s.expires_at.map(|at| at.saturating_sub(now_secs()));
                Ok((s, life))
            }
            Ok(None) => Err(self.required("no sign-in is stored")),
            Err(e) => Err(SignInError::Unavailable(e)),
        }
    }

    /// Refreshes `old` once; a refusal forgets the sign-in.
    async fn refresh(&self, old: &Stored) -> Result<(Stored, Option<u64>), SignInError> {
        let client = self.signins.client(&self.ns).ok_or_else(|| {
            SignInError::Unavailable(format!("no sign-in client for `{}`", self.ns))
        })?;
        match client.refresh(old).await {
            Ok(fresh) => {
                self.signins
                    .save(&self.principal, &self.ns, &fresh)
                    .map_err(SignInError::Unavailable)?;
                let life = fresh.expires_at.map(|at| at.saturating_sub(now_secs()));
                Ok((fresh, life))
            }
            Err(SignInError::Required(why)) => {
                self.signins.forget(&self.principal, &self.ns);
                Err(self.required(&why))
            }
            Err(e) => Err(e),
        }
    }

    /// Keeps what was sent, and the identity of the file it came from.
    fn keep(
        cached: &mut Option<Cached>,
        fresh: (Stored, Option<u64>),
        epoch: u64,
        file: Option<FileIdentity>,
    ) -> Secret {
        let token = Secret::new(fresh.0.access_token.clone());
        *cached = Some(Cached {
            stored: fresh.0,
            life: fresh.1,
            epoch,
            file,
        });
        token
    }

    /// The access token to send: refreshed first when it is about to expire. The cached one
    /// is used while the sign-in was not forgotten and its file is the one it came from (one
    /// `statx` per call); else the file is read again.
    pub async fn current(&self) -> Result<Secret, SignInError> {
        let mut cached = self.cached.lock().await;
        let epoch = self.signins.epoch(&self.principal, &self.ns);
        let mut file = self.signins.stored_id(&self.principal, &self.ns);
        let (stored, life) = match cached.take() {
            Some(c) if c.epoch == epoch && file.is_some() && c.file == file => (c.stored, c.life),
            _ => self.load()?,
        };
        let fresh = if stored.due(life) {
            let fresh = self.refresh(&stored).await?;
            // The refresh wrote the file anew.
            file = self.signins.stored_id(&self.principal, &self.ns);
            fresh
        } else {
            (stored, life)
        };
        Ok(Self::keep(&mut cached, fresh, epoch, file))
    }

    /// A new token after the server refused `rejected` (401): refreshed once, unless the
    /// stored one is another already.
    pub async fn renew(&self, rejected: &str) -> Result<Secret, SignInError> {
        let mut cached = self.cached.lock().await;
        cached.take();
        let epoch = self.signins.epoch(&self.principal, &self.ns);
        let (stored, _) = self.load()?;
        let fresh = if stored.access_token == rejected {
            self.refresh(&stored).await?
        } else {
            let life = stored.expires_at.map(|at| at.saturating_sub(now_secs()));
            (stored, life)
        };
        let file = self.signins.stored_id(&self.principal, &self.ns);
        Ok(Self::keep(&mut cached, fresh, epoch, file))
    }
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;

    #[test]
    fn the_resource_metadata_is_read_from_www_authenticate() {
        assert_eq!(
            resource_metadata_of(
                r#"Bearer error="invalid_token", resource_metadata="http://127.0.0.1:1/.well-known/oauth-protected-resource/mcp""#
            )
            .as_deref(),
            Some("http://127.0.0.1:1/.well-known/oauth-protected-resource/mcp")
        );
        assert_eq!(
            resource_metadata_of("Bearer resource_metadata=https://a/b, scope=x").as_deref(),
            Some("https://a/b")
        );
        assert_eq!(resource_metadata_of("Basic realm=x"), None);
        assert_eq!(resource_metadata_of("Bearer error=x"), None);
    }

    fn signins() -> Arc<SignIns> {
        let dir = std::env::temp_dir().join("sharedos-signin-unit");
        SignIns::new(
            url::Url::parse("http://127.0.0.1:1/").expect("url"),
            &dir.join("record.jsonl"),
            Arc::new(Known::default()),
        )
    }

    #[test]
    fn the_client_metadata_document_is_published_on_https_only() {
        assert_eq!(signins().metadata_document(), None, "plain HTTP: none");
        assert_eq!(signins().metadata(), None);
        let s = SignIns::new(
            url::Url::parse("https://page.example/people/").expect("url"),
            std::path::Path::new("/nonexistent/record.jsonl"),
            Arc::new(Known::default()),
        );
        let id = "https://page.example/people/oauth/client.json";
        assert_eq!(s.metadata_document().map(String::from).as_deref(), Some(id));
        let m = s.metadata().expect("a document");
        assert_eq!(m["client_id"], id, "the document names itself");
        assert_eq!(
            m["redirect_uris"],
            serde_json::json!(["https://page.example/people/oauth/callback"])
        );
        assert_eq!(m["token_endpoint_auth_method"], "none", "a public client");
        assert!(m.get("client_secret").is_none());
    }

    fn flow(s: &SignIns, state: &str, principal: &str, until: Instant) {
        crate::lock(&s.flows).insert(
            state.to_owned(),
            Flow {
                principal: principal.into(),
                provider: "r".into(),
                verifier: "v".into(),
                browser: "b".repeat(43),
                until,
            },
        );
    }

    /// Each way a link or a callback is refused has its own code; a used link or state is told
    /// as used (with whose), an old one as expired, and a refused callback uses its state up.
    #[tokio::test]
    async fn refusals_are_told_apart() {
        let s = signins();
        let link = s.link("alice", "r").expect("link");
        let id = link.path().rsplit('/').next().expect("id").to_owned();
        let code = |r: Result<url::Url, LinkRefused>| r.err().map(|e| e.code());
        let b = "b".repeat(43);
        assert_eq!(
            code(s.start_link(&id, "bob", &b).await),
            Some("link_not_yours")
        );
        // Still alice's: it starts (no client here), and is then used.
        assert_eq!(
            code(s.start_link(&id, "alice", &b).await),
            Some("no_provider")
        );
        assert_eq!(
            code(s.start_link(&id, "alice", &b).await),
            Some("link_used")
        );
        assert_eq!(
            code(s.start_link("0".repeat(32).as_str(), "alice", &b).await),
            Some("link_unknown")
        );
        let old = s.link("alice", "r").expect("link");
        let old = old.path().rsplit('/').next().expect("id").to_owned();
        if let Some(l) = crate::lock(&s.links).get_mut(&old) {
            l.until = Instant::now() - Duration::from_secs(1);
        }
        assert_eq!(
            code(s.start_link(&old, "alice", &b).await),
            Some("link_expired")
        );

        let finish =
            |state: &'static str, browser: Option<&'static str>, session: Option<&'static str>| {
                let s = s.clone();
                async move {
                    s.finish(state, "c", browser, session)
                        .await
                        .err()
                        .map(|e| e.code())
                }
            };
        let later = Instant::now() + SIGN_IN_LIFETIME;
        let b: &'static str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
        flow(&s, "s1", "alice", later);
        assert_eq!(finish("s1", Some(b), Some("bob")).await, Some("not_yours"));
        assert_eq!(finish("s1", Some(b), None).await, Some("state_used"));
        flow(&s, "s2", "alice", later);
        assert_eq!(finish("s2", None, None).await, Some("other_browser"));
        flow(&s, "s3", "alice", later);
        assert_eq!(
            finish("s3", Some("x"), Some("alice")).await,
            Some("other_browser")
        );
        flow(&s, "s4", "alice", Instant::now() - Duration::from_secs(1));
        assert_eq!(finish("s4", Some(b), None).await, Some("state_expired"));
        assert_eq!(finish("never", Some(b), None).await, Some("state_unknown"));
        flow(&s, "s5", "alice", later);
        let denied = s.deny("s5", "access_denied\u{7}<b>");
        assert_eq!(denied.code(), "authorization_refused");
        assert!(
            denied.to_string().contains("(access_denied<b>)"),
            "{denied}"
        );
        assert_eq!(finish("s5", Some(b), None).await, Some("state_used"));
        // The browser and principal match: on to the exchange (no client here).
        flow(&s, "s6", "alice", later);
        assert_eq!(
            finish("s6", Some(b), Some("alice")).await,
            Some("no_provider")
        );
    }

    #[test]
    fn a_token_is_due_near_its_end() {
        let s = |at: Option<u64>| Stored {
            access_token: "a".into(),
            refresh_token: None,
            expires_at: at,
            client_id: "c".into(),
        };
        assert!(!s(None).due(None));
        assert!(!s(Some(now_secs() + 3600)).due(Some(3600)));
        assert!(s(Some(now_secs() + 10)).due(Some(3600)));
        // A short life: refreshed in its second half.
        assert!(!s(Some(now_secs() + 8)).due(Some(10)));
        assert!(s(Some(now_secs() + 4)).due(Some(10)));
        assert_eq!(
            challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        assert_eq!(link_id().expect("id").len(), 32);
    }
}
