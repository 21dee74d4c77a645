//! Token exchange (RFC 8693) for hosts that already hold the person's token
//! (`[providers.oauth] grant = "token_exchange"`, issue 45 item 4): the host hands the person's
//! own token in at turn open (`turn open --subject-token-file`, `subjectToken` of `open_turn`);
//! each principal's instance of the provider sends a token the authorization server issued for
//! that server in exchange (`grant_type=urn:ietf:params:oauth:grant-type:token-exchange`,
//! `subject_token`, `subject_token_type`, `resource` per RFC 8707 and `audience` if configured,
//! the broker's client authenticated as configured).
//!
//! - The token endpoint is `oauth.token_url`, else discovered from the server as the sign-ins do
//!   ([`super::signin::Discovery`]: RFC 9728, then RFC 8414 or OpenID metadata).
//! - The exchanged token is cached per principal until shortly before it expires (30 s, at most
//!   half its life), exchanged again then, or once when the server refuses it (401), from the
//!   subject token of the principal's latest turn that brought one.
//! - A call from a turn opened without a subject token is refused before anything is sent
//!   (`missing_credential`); a subject token the authorization server refuses is forgotten, and
//!   the call refused the same way, naming the OAuth error code only.
//! - Subject and exchanged tokens are added to the redaction list as they are learned; none is
//!   logged, recorded or shown.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::config::{OAuthAuthMethod, OAuthConfig};
use crate::secrets::{Known, SHARED, Secret, SecretStore};

/// RFC 8693 §2.1's grant type.
pub const GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
/// What is asked for: an access token (RFC 8693 §3).
const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";
/// The longest a turn's open waits for providers to list their tools as its principal.
const LISTING_WAIT: Duration = Duration::from_secs(20);
/// A token is exchanged again this long before it expires (at most half its lifetime).
const RENEW_BEFORE: Duration = Duration::from_secs(30);
/// Time limit of one request to the token endpoint.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// The token endpoint is discovered again after this long.
const DISCOVERY_TTL: Duration = Duration::from_secs(3600);

/// The subject tokens hosts handed in at turn open: each principal's latest, and which
/// providers wait for one to list their tools.
pub struct SubjectTokens {
    by_principal: std::sync::Mutex<HashMap<String, Secret>>,
    /// Provider → the principal (`list_as`) whose subject token it waits for to list its tools.
    listing: std::sync::Mutex<HashMap<String, String>>,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Default for SubjectTokens {
    fn default() -> Self {
        Self {
            by_principal: std::sync::Mutex::default(),
            listing: std::sync::Mutex::default(),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl SubjectTokens {
    /// A turn of `principal` brought `token`: it is theirs from now on. Providers waiting to
    /// list their tools as `principal` get a bounded time to, so the turn's catalogue has them.
    pub async fn give(&self, principal: &str, token: &Secret) {
        self.set(principal, token);
        let mut rx = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + LISTING_WAIT;
        while crate::lock(&self.listing).values().any(|p| p == principal) {
            tokio::select! {
                r = rx.changed() => if r.is_err() { return; },
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// `principal`'s subject token is `token` (a call of a turn that brought it).
    pub fn set(&self, principal: &str, token: &Secret) {
        let fresh = crate::lock(&self.by_principal).insert(principal.to_owned(), token.clone());
        if fresh.as_ref() != Some(token) {
            self.changed.send_modify(|n| *n += 1);
        }
    }

    fn get(&self, principal: &str) -> Option<Secret> {
        crate::lock(&self.by_principal).get(principal).cloned()
    }

    /// Forgets `token` as `principal`'s (the authorization server refused it).
    fn forget(&self, principal: &str, token: &Secret) {
        let mut m = crate::lock(&self.by_principal);
        if m.get(principal) == Some(token) {
            m.remove(principal);
        }
    }

    /// Provider `ns` waits for `principal`'s subject token to list its tools.
    pub fn waiting(&self, ns: &str, principal: &str) {
        crate::lock(&self.listing).insert(ns.to_owned(), principal.to_owned());
        self.changed.send_modify(|n| *n += 1);
    }

    /// Provider `ns` listed its tools (or failed to): turns need not wait for it.
    pub fn listed(&self, ns: &str) {
        if crate::lock(&self.listing).remove(ns).is_some() {
            self.changed.send_modify(|n| *n += 1);
        }
    }

    /// Waits until `principal` has a subject token (or the broker stops).
    pub async fn wait_given(&self, principal: &str) {
        let mut rx = self.changed.subscribe();
        while self.get(principal).is_none() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Why no exchanged token could be had.
pub enum ExchangeError {
    /// No subject token, or the authorization server refused it: `missing_credential`.
    Missing(String),
    /// The authorization server refused the broker's client or request: `upstream_unauthorized`.
    Refused(String),
    /// It could not be reached, or answered something that is not a token.
    Unavailable(String),
}

/// The token endpoint, the `resource` and the client's secret.
struct Endpoint {
    token: url::Url,
    resource: String,
    secret: Option<Secret>,
    at: Instant,
}

struct Cached {
    token: Secret,
    renew_at: Option<Instant>,
}

/// One provider's token exchanges: its endpoint and each principal's exchanged token.
pub struct Exchanger {
    d: super::signin::Discovery,
    config: OAuthConfig,
    store: Arc<dyn SecretStore>,
    known: Arc<Known>,
    subjects: Arc<SubjectTokens>,
    endpoint: tokio::sync::Mutex<Option<Arc<Endpoint>>>,
    cached: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<Cached>>>>>,
    exchanges: AtomicU64,
}

impl Exchanger {
    pub fn new(
        d: super::signin::Discovery,
        config: OAuthConfig,
        store: Arc<dyn SecretStore>,
        known: Arc<Known>,
        subjects: Arc<SubjectTokens>,
    ) -> Self {
        Self {
            d,
            config,
            store,
            known,
            subjects,
            endpoint: tokio::sync::Mutex::new(None),
            cached: std::sync::Mutex::default(),
            exchanges: AtomicU64::new(0),
        }
    }

    /// Exchanges made so far (for `providers`).
    pub fn exchanges(&self) -> u64 {
        self.exchanges.load(Ordering::Relaxed)
    }

    /// The subject tokens this provider exchanges.
    pub fn subjects(&self) -> &Arc<SubjectTokens> {
        &self.subjects
    }

    fn slot(&self, principal: &str) -> Arc<tokio::sync::Mutex<Option<Cached>>> {
        crate::lock(&self.cached)
            .entry(principal.to_owned())
            .or_default()
            .clone()
    }

    /// `principal`'s exchanged token: the cached one unless it is about to expire.
    async fn current(&self, principal: &str) -> Result<Secret, ExchangeError> {
        let slot = self.slot(principal);
        let mut cached = slot.lock().await;
        if let Some(c) = cached.as_ref()
            && c.renew_at.is_none_or(|at| Instant::now() < at)
        {
            return Ok(c.token.clone());
        }
        let fresh = self.exchange(principal).await?;
        let token = fresh.token.clone();
        *cached = Some(fresh);
        Ok(token)
    }

    /// A new token after the server refused `rejected` (unless another request renewed it).
    async fn renew(&self, principal: &str, rejected: &str) -> Result<Secret, ExchangeError> {
        let slot = self.slot(principal);
        let mut cached = slot.lock().await;
        if let Some(c) = cached.as_ref()
            && c.token.expose() != rejected
        {
            return Ok(c.token.clone());
        }
        cached.take();
        let fresh = self.exchange(principal).await?;
        let token = fresh.token.clone();
        *cached = Some(fresh);
        Ok(token)
    }

    /// The token endpoint: configured, or discovered from the server.
    async fn endpoint(&self) -> Result<Arc<Endpoint>, ExchangeError> {
        let mut found = self.endpoint.lock().await;
        if let Some(e) = found.as_ref()
            && e.at.elapsed() < DISCOVERY_TTL
        {
            return Ok(e.clone());
        }
        let ns = &self.d.ns;
        let (token, resource) = if self.config.token_url.is_empty() {
            let (_, resource, issuer, meta) = self
                .d
                .authorization_server(&self.config.resource)
                .await
                .map_err(ExchangeError::Unavailable)?;
            if let Some(grants) = meta.get("grant_types_supported").and_then(Value::as_array)
                && !grants.iter().any(|g| g == GRANT)
            {
                return Err(ExchangeError::Unavailable(format!(
                    "provider `{ns}`: the authorization server `{issuer}` does not list token exchange (RFC 8693) in grant_types_supported: refused; set oauth.token_url if it offers it anyway"
                )));
            }
            let token = meta
                .get("token_endpoint")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ExchangeError::Unavailable(format!(
                        "provider `{ns}`: the authorization server's metadata has no `token_endpoint`"
                    ))
                })?;
            (token.to_owned(), resource)
        } else {
            let resource = self.config.resource.clone().unwrap_or(self.d.url.clone());
            (self.config.token_url.clone(), resource)
        };
        let token = self
            .d
            .endpoint("token_endpoint", &token)
            .map_err(ExchangeError::Unavailable)?;
        let secret = self.client_secret().await?;
        tracing::info!(provider = %ns, token_endpoint = %token, %resource, "token exchange endpoint set");
        let e = Arc::new(Endpoint {
            token,
            resource,
            secret,
            at: Instant::now(),
        });
        *found = Some(e.clone());
        Ok(e)
    }

    async fn client_secret(&self) -> Result<Option<Secret>, ExchangeError> {
        Ok(match &self.config.client_secret {
            Some(crate::config::ConfigValue::Plain(s)) => Some(Secret::new(s.clone())),
            Some(crate::config::ConfigValue::Secret(r)) => {
                Some(self.store.get(SHARED, &r.secret).await.map_err(|e| {
                    ExchangeError::Unavailable(format!(
                        "provider `{}`: oauth.client_secret: {e}",
                        self.d.ns
                    ))
                })?)
            }
            None => None,
        })
    }

    /// The token request's form and client authentication.
    fn request(&self, e: &Endpoint, subject: &Secret) -> reqwest::RequestBuilder {
        let scope = self.config.scopes.join(" ");
        let mut form: Vec<(&str, &str)> = vec![
            ("grant_type", GRANT),
            ("subject_token", subject.expose()),
            ("subject_token_type", self.config.subject_token_type.urn()),
            ("requested_token_type", ACCESS_TOKEN_TYPE),
            ("resource", &e.resource),
        ];
        if let Some(a) = &self.config.audience {
            form.push(("audience", a));
        }
        if !scope.is_empty() {
            form.push(("scope", &scope));
        }
        let mut request = self
            .d
            .http
            .post(e.token.clone())
            .timeout(REQUEST_TIMEOUT)
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json");
        let id = &self.config.client_id;
        match (&e.secret, self.config.auth_method) {
            (Some(secret), OAuthAuthMethod::ClientSecretBasic) => {
                // RFC 6749 §2.3.1: the id and secret are form-urlencoded before Basic.
                let enc =
                    |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
                request = request.basic_auth(enc(id), Some(enc(secret.expose())));
            }
            (Some(secret), OAuthAuthMethod::ClientSecretPost) => {
                form.push(("client_id", id));
                form.push(("client_secret", secret.expose()));
            }
            (None, _) => form.push(("client_id", id)),
        }
        let body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&form)
            .finish();
        request.body(body)
    }

    /// One exchange of `principal`'s subject token.
    async fn exchange(&self, principal: &str) -> Result<Cached, ExchangeError> {
        let ns = &self.d.ns;
        let subject = self.subjects.get(principal).ok_or_else(|| {
            ExchangeError::Missing(format!(
                "no turn of principal `{principal}` brought a subject token, which `{ns}` exchanges (grant = \"token_exchange\"): the host hands one in at turn open (`--subject-token-file`)"
            ))
        })?;
        let e = self.endpoint().await?;
        self.exchanges.fetch_add(1, Ordering::Relaxed);
        let response = self.request(&e, &subject).send().await.map_err(|err| {
            ExchangeError::Unavailable(format!(
                "provider `{ns}`: the token endpoint `{}` could not be reached: {}",
                e.token,
                super::cause::chain(&err)
            ))
        })?;
        let status = response.status();
        let bytes = self
            .d
            .read(response, "the token endpoint")
            .await
            .map_err(ExchangeError::Unavailable)?;
        if status.is_client_error() {
            return Err(self.refused(principal, &subject, status.as_u16(), &bytes));
        }
        if !status.is_success() {
            return Err(ExchangeError::Unavailable(format!(
                "provider `{ns}`: the token endpoint `{}` answered HTTP {}",
                e.token,
                status.as_u16()
            )));
        }
        self.issued(principal, &bytes)
    }

    /// A refusal: of the broker's client or request (`upstream_unauthorized`), else of the
    /// subject token, which is forgotten (`missing_credential`). The OAuth error code only.
    fn refused(
        &self,
        principal: &str,
        subject: &Secret,
        status: u16,
        body: &[u8],
    ) -> ExchangeError {
        let ns = &self.d.ns;
        let code = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned))
            .map(|e| e.chars().filter(char::is_ascii_graphic).take(64).collect())
            .unwrap_or_else(|| "no OAuth error code".to_owned());
        tracing::warn!(provider = %ns, %principal, status, error = %code, "the token exchange was refused");
        if matches!(
            code.as_str(),
            "invalid_client" | "unauthorized_client" | "unsupported_grant_type" | "invalid_target"
        ) {
            return ExchangeError::Refused(format!(
                "the token endpoint refused the token exchange of client `{}` for provider `{ns}` (HTTP {status}, {code})",
                self.config.client_id
            ));
        }
        self.subjects.forget(principal, subject);
        ExchangeError::Missing(format!(
            "the authorization server refused to exchange the subject token of principal `{principal}` for `{ns}` (HTTP {status}, {code}): the host hands in a fresh one at the next turn open"
        ))
    }

    /// The exchanged token in a token endpoint's answer, learned for redaction.
    fn issued(&self, principal: &str, bytes: &[u8]) -> Result<Cached, ExchangeError> {
        let ns = &self.d.ns;
        let t = super::token::bearer_of(bytes)
            .map_err(|why| ExchangeError::Unavailable(format!("provider `{ns}`: {why}")))?;
        let token = Secret::new(t.access_token);
        self.known.add(principal, "exchanged token", &token);
        let renew_at = t.expires_in.map(|s| {
            let life = Duration::from_secs(s);
            Instant::now() + life - RENEW_BEFORE.min(life / 2)
        });
        tracing::info!(provider = %ns, %principal, expires_in = ?t.expires_in, "subject token exchanged (RFC 8693)");
        Ok(Cached { token, renew_at })
    }
}

/// One principal's exchanged tokens, as a session sends them.
pub struct PersonExchange {
    pub exchanger: Arc<Exchanger>,
    pub principal: String,
}

impl PersonExchange {
    pub async fn current(&self) -> Result<Secret, ExchangeError> {
        self.exchanger.current(&self.principal).await
    }

    pub async fn renew(&self, rejected: &str) -> Result<Secret, ExchangeError> {
        self.exchanger.renew(&self.principal, rejected).await
    }
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_turn_waits_for_the_providers_listing_as_its_principal_only() {
        let s = Arc::new(SubjectTokens::default());
        let token = Secret::new("t".into());
        // Nobody waits: given at once.
        s.give("bob", &token).await;
        assert!(s.get("bob").is_some());
        s.waiting("r", "alice");
        let given = {
            let s = s.clone();
            tokio::spawn(async move { s.give("alice", &Secret::new("a".into())).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!given.is_finished(), "alice's turn waits for r's listing");
        s.listed("r");
        tokio::time::timeout(Duration::from_secs(5), given)
            .await
            .expect("in time")
            .expect("given");
        s.forget("alice", &Secret::new("other".into()));
        assert!(
            s.get("alice").is_some(),
            "only the refused token is forgotten"
        );
        s.forget("alice", &Secret::new("a".into()));
        assert!(s.get("alice").is_none());
    }
}
