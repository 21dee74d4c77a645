//! An HTTP upstream's error and its causes, as one line: what `http` classifies and reports and
//! `oauth` quotes from a token endpoint. Below both: `http` uses `oauth`, never the other way round.

use std::error::Error as StdError;

use rmcp::transport::streamable_http_client::StreamableHttpError;

/// The cause of `e`: its `source()`, or the error rmcp holds without naming it as the source
/// (the transport error of a failed initialize, the worker's fatal error, the HTTP client's
/// error), so that rustls's certificate errors under reqwest's are reached.
pub(super) fn cause<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a (dyn StdError + 'static)> {
    type Http = StreamableHttpError<super::wire::WireError>;
    if let Some(rmcp::service::ClientInitializeError::TransportError { error, .. }) =
        e.downcast_ref()
    {
        return Some(error);
    }
    if let Some(rmcp::transport::worker::WorkerQuitReason::<Http>::Fatal { error, .. }) =
        e.downcast_ref()
    {
        return Some(error);
    }
    if let Some(StreamableHttpError::Client(inner)) = e.downcast_ref::<Http>() {
        return Some(inner);
    }
    e.source()
}

/// An error and its causes, `: `-joined (rustls's certificate errors are causes of reqwest's).
pub fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut text = e.to_string();
    let mut current = cause(e);
    while let Some(err) = current {
        let s = err.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        current = cause(err);
    }
    text
}
