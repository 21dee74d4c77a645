//! Sign-in on the person's page with the operator's OpenID Connect provider: the authorization
//! code flow with PKCE (S256), `state` and `nonce`, and the ID token verified (its signature by
//! the provider's JWKS, its issuer, audience, expiry and nonce) before the configured claim is
//! taken as the principal.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;
use serde::Deserialize;
use serde_json::Value;
use sha2::Digest as _;

use crate::config::PageConfig;

/// How long the provider's metadata and keys are kept before they are fetched again.
const METADATA_TTL: Duration = Duration::from_secs(3600);
/// Time limit of one request to the provider.
const PROVIDER_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response read from the provider.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Clock skew allowed on the ID token's times.
const LEEWAY_SECONDS: u64 = 60;

/// Why a sign-in failed: said on the page (never a token) and logged.
#[derive(Debug, thiserror::Error)]
pub enum SignInError {
    #[error("the identity provider could not be reached or answered badly: {0}")]
    Provider(String),
    #[error("the identity provider refused the sign-in: {0}")]
    Refused(String),
    #[error("the ID token is not valid: {0}")]
    Token(String),
    #[error("the ID token has no string claim `{0}` to name the principal")]
    NoClaim(String),
}

/// The provider's metadata (OpenID Connect Discovery 1.0), the part used here.
#[derive(Debug, Deserialize)]
struct Metadata {
    issuer: String,
    authorization_endpoint: String,
    token_endpoint: String,
    jwks_uri: String,
    #[serde(default)]
    code_challenge_methods_supported: Option<Vec<String>>,
}

struct Known {
    authorize: url::Url,
    token: url::Url,
    keys: jsonwebtoken::jwk::JwkSet,
    fetched: Instant,
}

/// The page's OpenID Connect client.
pub struct Oidc {
    issuer: String,
    client_id: String,
    client_secret: Option<String>,
    redirect: url::Url,
    claim: String,
    scopes: String,
    http: reqwest::Client,
    known: tokio::sync::Mutex<Option<Arc<Known>>>,
}

/// What a started sign-in keeps until the provider sends the person back.
pub struct Started {
    /// Where to send the person's browser.
    pub url: url::Url,
    pub state: String,
    pub nonce: String,
    pub verifier: String,
}

/// The person the provider vouched for.
#[derive(Debug, Clone)]
pub struct Person {
    pub principal: String,
    pub subject: String,
}

/// `n` random bytes as URL-safe base64 (no padding).
pub fn random(n: usize) -> Result<String, String> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness: {e}"))?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// The PKCE S256 challenge of `verifier` (RFC 7636 §4.2).
pub fn challenge(verifier: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sha2::Sha256::digest(verifier))
}

impl Oidc {
    pub fn new(config: &PageConfig, client_secret: Option<String>) -> Result<Self, String> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        if let Some(ca) = &config.issuer_ca_file {
            let shown = ca.display();
            for cert in CertificateDer::pem_file_iter(ca)
                .map_err(|e| format!("[page] issuer_ca_file `{shown}`: {e}"))?
            {
                let cert = cert.map_err(|e| format!("[page] issuer_ca_file `{shown}`: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("[page] issuer_ca_file `{shown}`: {e}"))?;
            }
        }
        #[expect(
            deprecated,
            reason = "ring has no post-quantum key exchange; aws-lc-rs would need a C build on every CI machine"
        )]
        let provider = rustls::crypto::ring::default_provider();
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("[page]: TLS setup failed: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(PROVIDER_TIMEOUT)
            .build()
            .map_err(|e| format!("[page]: HTTP client: {e}"))?;
        let redirect = config
            .public_url
            .join("callback")
            .map_err(|e| format!("[page] public_url: {e}"))?;
        Ok(Self {
            issuer: config.issuer.clone(),
            client_id: config.client_id.clone(),
            client_secret,
            redirect,
            claim: config.principal_claim.clone(),
            scopes: config.scopes.join(" "),
            http,
            known: tokio::sync::Mutex::new(None),
        })
    }

    async fn get_json(&self, url: &url::Url, what: &str) -> Result<Value, SignInError> {
        let response = self
            .http
            .get(url.clone())
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| SignInError::Provider(format!("{what} `{url}`: {e}")))?;
        read_json(response, what).await
    }

    /// The provider's metadata and keys, fetched when missing, old, or (`refresh`) when a token
    /// names a key they do not have.
    async fn known(&self, refresh: bool) -> Result<Arc<Known>, SignInError> {
        let mut known = self.known.lock().await;
        if let Some(k) = known.as_ref()
            && !refresh
            && k.fetched.elapsed() < METADATA_TTL
        {
            return Ok(k.clone());
        }
        let discovery = url::Url::parse(&format!(
            "{}/.well-known/openid-configuration",
            self.issuer.trim_end_matches('/')
        ))
        .map_err(|e| SignInError::Provider(format!("issuer `{}`: {e}", self.issuer)))?;
        let meta: Metadata = serde_json::from_value(self.get_json(&discovery, "discovery").await?)
            .map_err(|e| SignInError::Provider(format!("discovery `{discovery}`: {e}")))?;
        if meta.issuer != self.issuer {
            return Err(SignInError::Provider(format!(
                "discovery says issuer `{}`, the config says `{}`: they must be the same",
                meta.issuer, self.issuer
            )));
        }
        if let Some(methods) = &meta.code_challenge_methods_supported
            && !methods.iter().any(|m| m == "S256")
        {
            return Err(SignInError::Provider(
                "the provider does not support PKCE S256".into(),
            ));
        }
        let endpoint = |u: &str, what: &str| {
            url::Url::parse(u)
                .map_err(|e| SignInError::Provider(format!("discovery: {what} `{u}`: {e}")))
        };
        let jwks_uri = endpoint(&meta.jwks_uri, "jwks_uri")?;
        let keys = serde_json::from_value(self.get_json(&jwks_uri, "jwks").await?)
            .map_err(|e| SignInError::Provider(format!("jwks `{jwks_uri}`: {e}")))?;
        let fresh = Arc::new(Known {
            authorize: endpoint(&meta.authorization_endpoint, "authorization_endpoint")?,
            token: endpoint(&meta.token_endpoint, "token_endpoint")?,
            keys,
            fetched: Instant::now(),
        });
        *known = Some(fresh.clone());
        Ok(fresh)
    }

    /// Starts a sign-in: fresh `state`, `nonce` and PKCE verifier, and the provider's
    /// authorization URL carrying them (the verifier as its S256 challenge).
    pub async fn start(&self) -> Result<Started, SignInError> {
        let known = self.known(false).await?;
        let (state, nonce, verifier) = (
            random(32).map_err(SignInError::Provider)?,
            random(32).map_err(SignInError::Provider)?,
            random(48).map_err(SignInError::Provider)?,
        );
        let mut url = known.authorize.clone();
        url.query_pairs_mut()
            .append_pair("response_type", "code")
            .append_pair("client_id", &self.client_id)
            .append_pair("redirect_uri", self.redirect.as_str())
            .append_pair("scope", &self.scopes)
            .append_pair("state", &state)
            .append_pair("nonce", &nonce)
            .append_pair("code_challenge", &challenge(&verifier))
            .append_pair("code_challenge_method", "S256");
        Ok(Started {
            url,
            state,
            nonce,
            verifier,
        })
    }

    /// Finishes a sign-in: the code exchanged (with the verifier) for an ID token, which is
    /// verified against `nonce`; the configured claim names the principal.
    pub async fn finish(
        &self,
        code: &str,
        verifier: &str,
        nonce: &str,
    ) -> Result<Person, SignInError> {
        let known = self.known(false).await?;
        let form = form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", "authorization_code")
            .append_pair("code", code)
            .append_pair("redirect_uri", self.redirect.as_str())
            .append_pair("code_verifier", verifier)
            .append_pair("client_id", &self.client_id)
            .finish();
        let mut request = self
            .http
            .post(known.token.clone())
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json");
        if let Some(secret) = &self.client_secret {
            // client_secret_basic (RFC 6749 §2.3.1): each part form-encoded first.
            let enc = |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
            let basic = base64::engine::general_purpose::STANDARD.encode(format!(
                "{}:{}",
                enc(&self.client_id),
                enc(secret)
            ));
            request = request.header("authorization", format!("Basic {basic}"));
        }
        let response = request
            .body(form)
            .send()
            .await
            .map_err(|e| SignInError::Provider(format!("token endpoint: {e}")))?;
        let status = response.status();
        let body = read_json(response, "token endpoint").await;
        let body = match body {
            Ok(b) if status.is_success() => b,
            Ok(b) => {
                return Err(SignInError::Refused(format!(
                    "{status}: {}",
                    b.get("error")
                        .and_then(Value::as_str)
                        .unwrap_or("no error code")
                )));
            }
            Err(e) => return Err(e),
        };
        let id_token = body
            .get("id_token")
            .and_then(Value::as_str)
            .ok_or_else(|| SignInError::Refused("the token response has no id_token".into()))?;
        let claims = self.verify(id_token, &known).await?;
        if claims.get("nonce").and_then(Value::as_str) != Some(nonce) {
            return Err(SignInError::Token(
                "its nonce is not the one this sign-in sent".into(),
            ));
        }
        let subject = claims
            .get("sub")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| SignInError::Token("it has no subject (`sub`)".into()))?
            .to_owned();
        let principal = claims
            .get(&self.claim)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty() && s.len() <= 256)
            .ok_or_else(|| SignInError::NoClaim(self.claim.clone()))?
            .to_owned();
        Ok(Person { principal, subject })
    }

    /// The ID token's claims, once its signature (a key of the provider's JWKS, by `kid`),
    /// issuer, audience (this client) and times are good.
    async fn verify(
        &self,
        token: &str,
        known: &Arc<Known>,
    ) -> Result<serde_json::Map<String, Value>, SignInError> {
        use jsonwebtoken::Algorithm::*;
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| SignInError::Token(e.to_string()))?;
        if !matches!(
            header.alg,
            RS256 | RS384 | RS512 | PS256 | PS384 | PS512 | ES256 | ES384 | EdDSA
        ) {
            return Err(SignInError::Token(format!(
                "it is signed with {:?}, not a public-key algorithm",
                header.alg
            )));
        }
        let find = |keys: &jsonwebtoken::jwk::JwkSet| match &header.kid {
            Some(kid) => keys.find(kid).cloned(),
            None if keys.keys.len() == 1 => keys.keys.first().cloned(),
            None => None,
        };
        let jwk = match find(&known.keys) {
            Some(k) => k,
            // The provider may have rotated its keys since they were fetched.
            None => find(&self.known(true).await?.keys).ok_or_else(|| {
                SignInError::Token(format!(
                    "no key of the provider's JWKS has its kid {:?}",
                    header.kid
                ))
            })?,
        };
        let key = jsonwebtoken::DecodingKey::from_jwk(&jwk)
            .map_err(|e| SignInError::Token(format!("the provider's key: {e}")))?;
        let mut validation = jsonwebtoken::Validation::new(header.alg);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.client_id]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.leeway = LEEWAY_SECONDS;
        let data = jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &key, &validation)
            .map_err(|e| SignInError::Token(e.to_string()))?;
        Ok(data.claims)
    }
}

/// A response's JSON body, at most [`MAX_RESPONSE_BYTES`].
async fn read_json(mut response: reqwest::Response, what: &str) -> Result<Value, SignInError> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| SignInError::Provider(format!("{what}: {e}")))?
    {
        if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
            return Err(SignInError::Provider(format!(
                "{what}: the answer is larger than {MAX_RESPONSE_BYTES} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body)
        .map_err(|e| SignInError::Provider(format!("{what}: not JSON ({e})")))
}

#[cfg(test)]
#[allow(clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;

    #[test]
    fn the_challenge_is_rfc_7636s() {
        // RFC 7636 Appendix B.
        assert_eq!(
            challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        let a = random(32).expect("random");
        assert_eq!(a.len(), 43);
        assert_ne!(a, random(32).expect("random"));
    }
}
