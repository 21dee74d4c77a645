//! rmcp's Streamable HTTP client requests over [`Wire`]: what rmcp 3.11 does with a
//! `reqwest::Client` (its `transport::common::reqwest::streamable_http_client`, MIT), the same
//! requests and the same reading of their responses, with the request sent by the broker's own
//! client (`wire`, whose module note says why). The helpers rmcp keeps private to its crate are
//! restated here as rmcp writes them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures::stream::{BoxStream, Stream, StreamExt as _, TryStreamExt as _};
use hyper::Method;
use hyper::body::Bytes;
use reqwest::header::{
    ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER,
    WWW_AUTHENTICATE,
};
use reqwest::{Response, StatusCode};
use rmcp::model::{ClientJsonRpcMessage, ClientRequest, ErrorData, ServerJsonRpcMessage};
use rmcp::transport::common::http_header::{
    EVENT_STREAM_MIME_TYPE, HEADER_LAST_EVENT_ID, HEADER_MCP_PROTOCOL_VERSION, HEADER_SESSION_ID,
    JSON_MIME_TYPE,
};
use rmcp::transport::streamable_http_client::{
    AuthRequiredError, HttpStatusError, InsufficientScopeError, SseError, StreamableHttpClient,
    StreamableHttpError, StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use sse_stream::{Sse, SseStream};

use super::wire::{Outgoing, Wire, WireError};

type HttpResult<T> = Result<T, StreamableHttpError<WireError>>;
type SseResponse = BoxStream<'static, Result<Sse, SseError>>;

/// rmcp's default bound of one SSE event (where a caller gives none).
const DEFAULT_MAX_SSE_EVENT_SIZE: usize = 16 * 1024 * 1024;
const MAX_RETRY_AFTER_BYTES: usize = 128;
const JSON_RPC_BODY_PREVIEW_LEN: usize = 256;
const BODY_READ_FAILURE: &str = "<failed to read response body>";

impl From<WireError> for StreamableHttpError<WireError> {
    fn from(e: WireError) -> Self {
        StreamableHttpError::Client(e)
    }
}

impl Wire {
    /// A request with rmcp's headers: the provider's own (reserved names refused), the bearer,
    /// and `Accept` for both SSE and JSON.
    fn outgoing(
        method: Method,
        uri: &str,
        auth: Option<String>,
        custom: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<Outgoing> {
        let url = reqwest::Url::parse(uri).map_err(|e| {
            StreamableHttpError::Client(WireError::Request(format!("`{uri}`: {e}")))
        })?;
        let mut headers = HeaderMap::new();
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("text/event-stream, application/json"),
        );
        if let Some(token) = auth {
            let mut v = HeaderValue::try_from(format!("Bearer {token}")).map_err(|_| {
                StreamableHttpError::Client(WireError::Request("an invalid bearer token".into()))
            })?;
            v.set_sensitive(true);
            headers.insert(AUTHORIZATION, v);
        }
        for (name, value) in custom {
            validate_custom_header(&name).map_err(StreamableHttpError::ReservedHeaderConflict)?;
            headers.append(name, value);
        }
        Ok(Outgoing {
            method,
            url,
            headers,
            body: None,
        })
    }
}

fn header(value: &str) -> HttpResult<HeaderValue> {
    HeaderValue::try_from(value).map_err(|_| {
        StreamableHttpError::Client(WireError::Request(format!(
            "`{value}` is not a valid header value"
        )))
    })
}

/// rmcp's reserved custom headers: `Accept`, the session id, the last event id (its protocol
/// version header is let through: rmcp's worker sets it so).
fn validate_custom_header(name: &HeaderName) -> Result<(), String> {
    let reserved = ["accept", HEADER_SESSION_ID, HEADER_LAST_EVENT_ID];
    if name
        .as_str()
        .eq_ignore_ascii_case(HEADER_MCP_PROTOCOL_VERSION)
    {
        return Ok(());
    }
    if reserved
        .iter()
        .any(|r| name.as_str().eq_ignore_ascii_case(r))
    {
        return Err(name.to_string());
    }
    Ok(())
}

fn extract_scope_from_header(header: &str) -> Option<String> {
    let lower = header.to_ascii_lowercase();
    let start = lower.find("scope=")? + "scope=".len();
    let value = &header[start..];
    if let Some(stripped) = value.strip_prefix('"') {
        return stripped.find('"').map(|end| stripped[..end].to_owned());
    }
    let end = value
        .find(|c: char| c == ',' || c == ';' || c.is_whitespace())
        .unwrap_or(value.len());
    (end > 0).then(|| value[..end].to_owned())
}

fn media_type_is(value: &[u8], expected: &str) -> bool {
    value
        .split(|byte| *byte == b';')
        .next()
        .and_then(|essence| std::str::from_utf8(essence).ok())
        .is_some_and(|essence| {
            essence
                .trim_matches([' ', '\t'])
                .eq_ignore_ascii_case(expected)
        })
}

fn body_stream(
    response: Response,
) -> impl Stream<Item = Result<Bytes, WireError>> + Send + 'static {
    response.bytes_stream().map_err(WireError::Body)
}

async fn read_bounded_body(
    response: Response,
    content_length: Option<u64>,
    max_size: usize,
) -> HttpResult<Vec<u8>> {
    if content_length.is_some_and(|length| length > max_size as u64) {
        return Err(StreamableHttpError::ResponseBodyTooLarge { max_size });
    }
    let stream = body_stream(response);
    futures::pin_mut!(stream);
    let mut body = Vec::new();
    while let Some(chunk) = stream
        .try_next()
        .await
        .map_err(StreamableHttpError::Client)?
    {
        if chunk.len() > max_size - body.len() {
            return Err(StreamableHttpError::ResponseBodyTooLarge { max_size });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

async fn read_truncated_body(response: Response, max_size: usize) -> HttpResult<Vec<u8>> {
    let stream = body_stream(response);
    futures::pin_mut!(stream);
    let mut body = Vec::new();
    while body.len() < max_size {
        let Some(chunk) = stream
            .try_next()
            .await
            .map_err(StreamableHttpError::Client)?
        else {
            break;
        };
        let count = chunk.len().min(max_size - body.len());
        body.extend_from_slice(&chunk[..count]);
    }
    Ok(body)
}

/// rmcp's bound of one SSE event, counted on the raw bytes before they are parsed: the bytes
/// of an event's lines (comments not counted) since the blank line that ended the last one.
struct EventSizeLimiter {
    max_size: usize,
    retained_size: usize,
    line_size: usize,
    line_is_comment: bool,
    previous_was_cr: bool,
}

impl EventSizeLimiter {
    fn observe(&mut self, chunk: &[u8]) -> Result<(), ()> {
        for &byte in chunk {
            if self.previous_was_cr {
                self.previous_was_cr = false;
                if byte == b'\n' {
                    continue;
                }
            }
            match byte {
                b'\r' => {
                    self.finish_line()?;
                    self.previous_was_cr = true;
                }
                b'\n' => self.finish_line()?,
                _ => {
                    if self.line_size == 0 {
                        self.line_is_comment = byte == b':';
                    }
                    self.line_size = self.line_size.saturating_add(1);
                    self.check_limit()?;
                }
            }
        }
        Ok(())
    }

    fn finish_line(&mut self) -> Result<(), ()> {
        if self.line_size == 0 {
            self.retained_size = 0;
        } else if !self.line_is_comment {
            self.retained_size = self
                .retained_size
                .saturating_add(self.line_size)
                .saturating_add(1);
        }
        self.line_size = 0;
        self.line_is_comment = false;
        self.check_limit()
    }

    fn check_limit(&self) -> Result<(), ()> {
        if self.retained_size.saturating_add(self.line_size) > self.max_size {
            Err(())
        } else {
            Ok(())
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum BoundedSseError {
    #[error(transparent)]
    Source(WireError),
    #[error("SSE event exceeded the maximum size of {max_size} bytes")]
    EventTooLarge { max_size: usize },
}

struct BoundedSseBytes<S> {
    inner: S,
    limiter: EventSizeLimiter,
    failed: bool,
}

impl<S> Stream for BoundedSseBytes<S>
where
    S: Stream<Item = Result<Bytes, WireError>> + Unpin,
{
    type Item = Result<Bytes, BoundedSseError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.failed {
            return Poll::Ready(None);
        }
        match ready!(self.inner.poll_next_unpin(cx)) {
            Some(Ok(chunk)) => {
                if self.limiter.observe(&chunk).is_err() {
                    self.failed = true;
                    let max_size = self.limiter.max_size;
                    Poll::Ready(Some(Err(BoundedSseError::EventTooLarge { max_size })))
                } else {
                    Poll::Ready(Some(Ok(chunk)))
                }
            }
            Some(Err(error)) => {
                self.failed = true;
                Poll::Ready(Some(Err(BoundedSseError::Source(error))))
            }
            None => Poll::Ready(None),
        }
    }
}

/// A response's SSE events, each at most `max_event_size` bytes. (An event over the limit ends
/// the stream with an error that rmcp does not tell from a broken stream, as it tells its own:
/// it resumes such a stream where the server gave event ids, and ends it otherwise.)
fn bounded_sse_stream(response: Response, max_event_size: usize) -> SseResponse {
    let bytes = BoundedSseBytes {
        inner: Box::pin(body_stream(response)),
        limiter: EventSizeLimiter {
            max_size: max_event_size,
            retained_size: 0,
            line_size: 0,
            line_is_comment: false,
            previous_was_cr: false,
        },
        failed: false,
    };
    SseStream::from_bytes_stream(bytes).boxed()
}

fn truncated_read_failure(max_error_response_size: usize) -> String {
    BODY_READ_FAILURE[..BODY_READ_FAILURE.len().min(max_error_response_size)].to_owned()
}

/// A bounded, in-memory body as text, with reqwest's charset and BOM handling.
async fn decode_error_body(
    body: Vec<u8>,
    content_type: Option<HeaderValue>,
    max_error_response_size: usize,
) -> String {
    if body.is_empty() {
        return String::new();
    }
    let mut buffered = hyper::Response::new(body);
    if let Some(content_type) = content_type {
        buffered.headers_mut().insert(CONTENT_TYPE, content_type);
    }
    Response::from(buffered)
        .text()
        .await
        .unwrap_or_else(|_| truncated_read_failure(max_error_response_size))
}

fn parse_json_rpc_error(body: &str) -> Option<ServerJsonRpcMessage> {
    match serde_json::from_str::<ServerJsonRpcMessage>(body) {
        Ok(message @ ServerJsonRpcMessage::Error(_)) => Some(message),
        _ => None,
    }
}

/// Only the status and a bounded `Retry-After` of a 429 or a server error.
fn http_status_error(status: StatusCode, headers: &HeaderMap) -> Option<HttpStatusError> {
    if status != StatusCode::TOO_MANY_REQUESTS && !status.is_server_error() {
        return None;
    }
    let retry_after = headers
        .get(RETRY_AFTER)
        .filter(|value| value.as_bytes().len() <= MAX_RETRY_AFTER_BYTES)
        .and_then(|value| std::str::from_utf8(value.as_bytes()).ok())
        .map(str::to_owned);
    Some(HttpStatusError::new(status.as_u16(), retry_after))
}

fn json_rpc_parse_error_message(err: &serde_json::Error, body: &[u8]) -> String {
    let preview: Cow<'_, str> = if body.is_empty() {
        Cow::Borrowed("<empty>")
    } else {
        let lossy = String::from_utf8_lossy(body);
        let mut end = lossy.len().min(JSON_RPC_BODY_PREVIEW_LEN);
        while end > 0 && !lossy.is_char_boundary(end) {
            end -= 1;
        }
        Cow::Owned(lossy[..end].to_owned())
    };
    format!("could not parse JSON response as ServerJsonRpcMessage: {err}: {preview}")
}

/// rmcp's answer to a sessionless `server/discover` a server rejected with a 4xx (not 401 or
/// 403): the server's JSON-RPC error, or `invalid_request`, re-correlated to the request.
fn legacy_discover_response(
    message: &ClientJsonRpcMessage,
    session_was_attached: bool,
    status: StatusCode,
    body: &str,
) -> Option<StreamableHttpPostResponse> {
    if session_was_attached
        || !status.is_client_error()
        || matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
    {
        return None;
    }
    let ClientJsonRpcMessage::Request(request) = message else {
        return None;
    };
    if !matches!(request.request, ClientRequest::DiscoverRequest(_)) {
        return None;
    }
    let error = match serde_json::from_str::<ServerJsonRpcMessage>(body) {
        Ok(ServerJsonRpcMessage::Error(error)) => error.error,
        _ => ErrorData::invalid_request(
            format!("server/discover rejected with HTTP {status}: {body}"),
            None,
        ),
    };
    Some(StreamableHttpPostResponse::Json(
        ServerJsonRpcMessage::error(error, Some(request.id.clone())),
        None,
    ))
}

/// A 401 or 403 with a challenge, as rmcp reports it.
fn challenge(response: &Response) -> HttpResult<()> {
    let status = response.status();
    if !matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
        return Ok(());
    }
    let Some(header) = response.headers().get(WWW_AUTHENTICATE) else {
        return Ok(());
    };
    let header = header.to_str().map_err(|_| {
        StreamableHttpError::UnexpectedServerResponse(Cow::from(
            "invalid www-authenticate header value",
        ))
    })?;
    if status == StatusCode::UNAUTHORIZED {
        return Err(StreamableHttpError::AuthRequired(AuthRequiredError::new(
            header.to_owned(),
        )));
    }
    Err(StreamableHttpError::InsufficientScope(
        InsufficientScopeError::new(header.to_owned(), extract_scope_from_header(header)),
    ))
}

/// What a POST's response is read against.
struct Posted<'a> {
    message: &'a ClientJsonRpcMessage,
    session_was_attached: bool,
    limits: StreamableHttpResponseLimits,
}

impl Posted<'_> {
    /// A POST carrying only notifications, responses or errors leaves nothing outstanding.
    fn awaits_no_response(&self) -> bool {
        matches!(
            self.message,
            ClientJsonRpcMessage::Notification(_)
                | ClientJsonRpcMessage::Response(_)
                | ClientJsonRpcMessage::Error(_)
        )
    }

    /// rmcp's reading of a POST's response.
    async fn read(&self, response: Response) -> HttpResult<StreamableHttpPostResponse> {
        challenge(&response)?;
        let status = response.status();
        if matches!(status, StatusCode::ACCEPTED | StatusCode::NO_CONTENT) {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if status == StatusCode::NOT_FOUND && self.session_was_attached {
            return Err(StreamableHttpError::SessionExpired);
        }
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .map(|ct| String::from_utf8_lossy(ct.as_bytes()).to_string());
        let is_json = content_type
            .as_deref()
            .is_some_and(|ct| media_type_is(ct.as_bytes(), JSON_MIME_TYPE));
        // Rate limits and non-JSON failures return without reading the body.
        let status_error = match (http_status_error(status, response.headers()), is_json) {
            (Some(error), is_json) if !is_json || status == StatusCode::TOO_MANY_REQUESTS => {
                return Err(error.into());
            }
            (error, _) => error,
        };
        let session_id = response
            .headers()
            .get(HEADER_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // Some servers answer these with an empty 200 instead of 202.
        if status.is_success() && response.content_length() == Some(0) && self.awaits_no_response()
        {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if !status.is_success() {
            return self
                .failed(response, is_json, status_error, session_id)
                .await;
        }
        self.succeeded(response, content_type, session_id).await
    }

    /// A non-success response: a JSON-RPC error it carries, or its status and a prefix of it.
    async fn failed(
        &self,
        response: Response,
        is_json: bool,
        status_error: Option<HttpStatusError>,
        session_id: Option<String>,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let status = response.status();
        let content_type = response.headers().get(CONTENT_TYPE).cloned();
        let limit = self.limits.max_error_response_size;
        // A 401/403 without a challenge keeps its status.
        let is_auth_failure = matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN);
        let body = if is_json && !is_auth_failure {
            let length = response.content_length();
            match read_bounded_body(response, length, self.limits.max_json_response_size).await {
                Ok(raw) => match self.json_error(raw, content_type, status).await {
                    Ok(answer) => return Ok(answer.with_session(session_id)),
                    Err(text) => text,
                },
                Err(error @ StreamableHttpError::ResponseBodyTooLarge { .. }) => {
                    return Err(status_error.map(StreamableHttpError::from).unwrap_or(error));
                }
                Err(StreamableHttpError::Client(_)) => truncated_read_failure(limit),
                Err(error) => return Err(error),
            }
        } else {
            match read_truncated_body(response, limit).await {
                Ok(prefix) => decode_error_body(prefix, content_type, limit).await,
                Err(StreamableHttpError::Client(_)) => truncated_read_failure(limit),
                Err(error) => return Err(error),
            }
        };
        if let Some(response) =
            legacy_discover_response(self.message, self.session_was_attached, status, &body)
        {
            return Ok(response);
        }
        if let Some(error) = status_error {
            return Err(error.into());
        }
        Err(StreamableHttpError::UnexpectedServerResponse(Cow::Owned(
            format!("HTTP {status}: {body}"),
        )))
    }

    /// A non-success JSON body: the JSON-RPC error it holds (`Ok`, its session id still to be
    /// added), or its text for the failure's message.
    async fn json_error(
        &self,
        raw: Vec<u8>,
        content_type: Option<HeaderValue>,
        status: StatusCode,
    ) -> Result<Answer, String> {
        let limit = self.limits.max_error_response_size;
        let prefix = (raw.len() > limit).then(|| raw[..limit].to_vec());
        let full = decode_error_body(raw, content_type.clone(), limit).await;
        if let Some(error) = parse_json_rpc_error(&full) {
            // Before the raw error: a discover rejection's id would not correlate.
            if let Some(response) =
                legacy_discover_response(self.message, self.session_was_attached, status, &full)
            {
                return Ok(Answer::Ready(response));
            }
            return Ok(Answer::Error(error));
        }
        tracing::warn!("HTTP {status}: could not parse JSON body as a JSON-RPC error");
        match prefix {
            Some(prefix) => Err(decode_error_body(prefix, content_type, limit).await),
            None => Err(full),
        }
    }

    /// A success: its SSE stream, or its JSON message.
    async fn succeeded(
        &self,
        response: Response,
        content_type: Option<String>,
        session_id: Option<String>,
    ) -> HttpResult<StreamableHttpPostResponse> {
        match content_type.as_deref() {
            Some(ct) if media_type_is(ct.as_bytes(), EVENT_STREAM_MIME_TYPE) => {
                let events = bounded_sse_stream(response, self.limits.max_sse_event_size);
                Ok(StreamableHttpPostResponse::Sse(events, session_id))
            }
            Some(ct) if media_type_is(ct.as_bytes(), JSON_MIME_TYPE) => {
                let length = response.content_length();
                let body =
                    read_bounded_body(response, length, self.limits.max_json_response_size).await?;
                match serde_json::from_slice::<ServerJsonRpcMessage>(&body) {
                    Ok(parsed) => Ok(StreamableHttpPostResponse::Json(parsed, session_id)),
                    Err(e) if self.awaits_no_response() => {
                        tracing::warn!(
                            "an unusable JSON answer to a notification, taken as accepted: {e}"
                        );
                        Ok(StreamableHttpPostResponse::Accepted)
                    }
                    Err(e) => Err(StreamableHttpError::UnexpectedServerResponse(Cow::Owned(
                        json_rpc_parse_error_message(&e, &body),
                    ))),
                }
            }
            // Neither JSON nor SSE: a POST that awaits nothing accepts any 2xx.
            _ if self.awaits_no_response() => Ok(StreamableHttpPostResponse::Accepted),
            _ => Err(StreamableHttpError::UnexpectedContentType(content_type)),
        }
    }
}

/// A non-success JSON body's JSON-RPC error, or the whole answer (a discover rejection).
enum Answer {
    Error(ServerJsonRpcMessage),
    Ready(StreamableHttpPostResponse),
}

impl Answer {
    fn with_session(self, session_id: Option<String>) -> StreamableHttpPostResponse {
        match self {
            Answer::Error(error) => StreamableHttpPostResponse::Json(error, session_id),
            Answer::Ready(response) => response,
        }
    }
}

/// A GET stream's response: refused, or its (bounded) events.
fn stream_of(response: Response, max_sse_event_size: usize) -> HttpResult<SseResponse> {
    if response.status() == StatusCode::METHOD_NOT_ALLOWED {
        return Err(StreamableHttpError::ServerDoesNotSupportSse);
    }
    challenge(&response)?;
    if let Some(error) = http_status_error(response.status(), response.headers()) {
        return Err(error.into());
    }
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        return Err(StreamableHttpError::UnexpectedServerResponse(Cow::Owned(
            format!("HTTP {status}"),
        )));
    }
    match response.headers().get(CONTENT_TYPE) {
        Some(ct)
            if media_type_is(ct.as_bytes(), EVENT_STREAM_MIME_TYPE)
                || media_type_is(ct.as_bytes(), JSON_MIME_TYPE) =>
        {
            Ok(bounded_sse_stream(response, max_sse_event_size))
        }
        Some(ct) => Err(StreamableHttpError::UnexpectedContentType(Some(
            String::from_utf8_lossy(ct.as_bytes()).to_string(),
        ))),
        None => Err(StreamableHttpError::UnexpectedContentType(None)),
    }
}

impl StreamableHttpClient for Wire {
    type Error = WireError;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_token: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let limits = StreamableHttpResponseLimits::default();
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_token,
            custom_headers,
            limits,
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_token: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = max_sse_event_size;
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_token,
            custom_headers,
            limits,
        )
        .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_token: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let mut request = Self::outgoing(Method::POST, &uri, auth_token, custom_headers)?;
        let session_was_attached = session_id.is_some();
        if let Some(session_id) = session_id {
            request
                .headers
                .insert(HEADER_SESSION_ID, header(&session_id)?);
        }
        let body = serde_json::to_vec(&message).map_err(|e| {
            StreamableHttpError::Client(WireError::Request(format!("the message as JSON: {e}")))
        })?;
        request
            .headers
            .insert(CONTENT_TYPE, HeaderValue::from_static(JSON_MIME_TYPE));
        request.body = Some(body);
        let response = self.send(request).await?;
        Posted {
            message: &message,
            session_was_attached,
            limits,
        }
        .read(response)
        .await
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session: Arc<str>,
        auth_token: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<()> {
        let mut request = Self::outgoing(Method::DELETE, &uri, auth_token, custom_headers)?;
        request.headers.remove(ACCEPT);
        request.headers.insert(HEADER_SESSION_ID, header(&session)?);
        let response = self.send(request).await?;
        let status = response.status();
        if status == StatusCode::METHOD_NOT_ALLOWED {
            tracing::debug!("this server does not support deleting a session");
            return Ok(());
        }
        if status.is_client_error() || status.is_server_error() {
            return Err(StreamableHttpError::UnexpectedServerResponse(Cow::Owned(
                format!("HTTP {status} to the session's DELETE"),
            )));
        }
        Ok(())
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_token: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<SseResponse> {
        self.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_token,
            custom_headers,
            DEFAULT_MAX_SSE_EVENT_SIZE,
        )
        .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_token: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<SseResponse> {
        let mut request = Self::outgoing(Method::GET, &uri, auth_token, custom_headers)?;
        if let Some(session_id) = session_id {
            request
                .headers
                .insert(HEADER_SESSION_ID, header(&session_id)?);
        }
        if let Some(last_event_id) = last_event_id {
            request
                .headers
                .insert(HEADER_LAST_EVENT_ID, header(&last_event_id)?);
        }
        let response = self.send(request).await?;
        stream_of(response, max_sse_event_size)
    }
}
