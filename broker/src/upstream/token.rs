//! A token endpoint's answer as every OAuth client of the remote transport reads it (client
//! credentials in `oauth`, sign-in in `signin`, token exchange in `exchange`): a leaf they all
//! import, so none of them imports another for it.

use serde::Deserialize;

/// A token endpoint's answer (RFC 6749 §5.1), as client credentials, sign-in and token exchange
/// read it.
#[derive(Deserialize)]
pub(super) struct TokenResponse {
    pub access_token: String,
    pub token_type: String,
    #[serde(default)]
    pub expires_in: Option<u64>,
    #[serde(default)]
    pub refresh_token: Option<String>,
}

/// The Bearer token in a token endpoint's answer; `Err` ends "the token endpoint …" for the
/// caller to say whose: no token in it, or one of another type or empty (only a non-empty Bearer
/// token can be sent).
pub(super) fn bearer_of(bytes: &[u8]) -> Result<TokenResponse, String> {
    let t: TokenResponse = serde_json::from_slice(bytes)
        .map_err(|e| format!("the token endpoint answered no token: {e}"))?;
    if !t.token_type.eq_ignore_ascii_case("bearer") || t.access_token.is_empty() {
        return Err(format!(
            "the token endpoint answered a `{}` token; only a non-empty Bearer token can be sent",
            t.token_type.chars().take(32).collect::<String>()
        ));
    }
    Ok(t)
}
