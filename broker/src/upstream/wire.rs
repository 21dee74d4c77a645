//! The HTTP client under a remote provider's Streamable HTTP session: hyper-util's pooled client
//! (HTTP/1.1, and HTTP/2 where the server offers it by ALPN) over TCP connections that
//! acknowledge what they receive at once, TLS by rustls (`hyper-rustls`).
//!
//! Why not reqwest, as everywhere else in the broker: a server that writes its answer in several
//! small writes with Nagle's algorithm on (the PyPI `mcp` server under uvicorn writes an SSE
//! answer's headers, its event and the end of its chunked body apart, and asyncio sets no
//! `TCP_NODELAY` on connections of a listening socket handed to it ready-made) holds each write after the first until the client acknowledges
//! the one before. A client's kernel acknowledges at once on a new connection, but on a
//! connection past its start that both sends and receives (a kept one) it delays the ACK, up to
//! 40 ms on Linux: every call on a kept connection waited that long. `TCP_QUICKACK`, set before
//! each read ([`QuickAck`]), makes the kernel send the pending ACK now; it is not sticky (the
//! kernel returns to delayed ACKs by itself), hence before every read. reqwest 0.13 makes its
//! TCP streams itself and lets no one wrap them (its connector layers see a sealed connection
//! type; seanmonstar/reqwest#2633), so the session's requests go through this client instead;
//! nothing system-wide (sysctl, route `quickack`) is touched.
//!
//! What reqwest did here, this does the same way: connections pooled per origin (at most
//! `max_idle` idle, closed after `idle`), `TCP_NODELAY`, a connect limit over TCP and TLS
//! together, the provider's rustls configuration (its roots, its client certificate, its TLS
//! session store), redirects followed only to the same scheme, host and port, and a request sent
//! again only where it cannot have reached the server: hyper-util's own retry of a request on a
//! pooled HTTP/1.1 connection found closed before the request was written, and (as reqwest's
//! default retry rule) an HTTP/2 stream the server refused (`REFUSED_STREAM`) or that a graceful
//! `GOAWAY` left unprocessed.

use std::error::Error as StdError;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::{Method, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use reqwest::header::HeaderMap;
use tokio::net::TcpStream;

type BoxError = Box<dyn StdError + Send + Sync>;

/// How a request through [`Wire`] failed before a response came.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("error sending request for url ({url})")]
    Send {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("{0}")]
    Redirect(String),
    #[error("invalid request: {0}")]
    Request(String),
    /// Reading a response body failed.
    #[error(transparent)]
    Body(#[from] reqwest::Error),
}

/// A TCP connection that acknowledges at once what it receives: `TCP_QUICKACK` before each read
/// (see the module's note on why).
pub struct QuickAck(TokioIo<TcpStream>);

impl Read for QuickAck {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        // Not sticky: the kernel goes back to delayed ACKs after the next exchange. A failure
        // (not a TCP socket any more) only costs the delay.
        let _ = rustix::net::sockopt::set_tcp_quickack(self.0.inner(), true);
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl Write for QuickAck {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl Connection for QuickAck {
    fn connected(&self) -> Connected {
        self.0.connected()
    }
}

/// hyper-util's TCP connector, its streams wrapped in [`QuickAck`].
#[derive(Clone)]
pub struct QuickAckConnector(HttpConnector);

type Connecting<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

impl tower_service::Service<Uri> for QuickAckConnector {
    type Response = QuickAck;
    type Error = BoxError;
    type Future = Connecting<QuickAck>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move { Ok(QuickAck(connecting.await?)) })
    }
}

/// A connector whose whole connection (TCP and TLS) must be made within `limit`.
#[derive(Clone)]
pub struct Limited<C> {
    inner: C,
    limit: Duration,
}

impl<C> tower_service::Service<Uri> for Limited<C>
where
    C: tower_service::Service<Uri> + Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Connecting<C::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.inner.call(dst);
        let limit = self.limit;
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(r) => r.map_err(Into::into),
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no connection within {} s", limit.as_secs_f64()),
                )
                .into()),
            }
        })
    }
}

type Pooled = Client<Limited<HttpsConnector<QuickAckConnector>>, reqwest::Body>;

/// What makes a [`Wire`].
pub struct WireConfig {
    pub tls: rustls::ClientConfig,
    pub connect_timeout: Duration,
    /// Idle connections kept per origin (0: none kept).
    pub max_idle: usize,
    pub idle: Duration,
    pub max_redirects: usize,
}

/// One request: sent again as it is (a retry, a 307 or 308 redirect) or as a GET (a 301, 302
/// or 303 redirect of a POST), so its body is kept.
#[derive(Clone)]
pub struct Outgoing {
    pub method: Method,
    pub url: reqwest::Url,
    pub headers: HeaderMap,
    pub body: Option<Vec<u8>>,
}

/// The pooled HTTP client of one remote session (see the module's note).
#[derive(Clone)]
pub struct Wire {
    client: Pooled,
    max_redirects: usize,
}

impl Wire {
    pub fn new(config: WireConfig) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(config.connect_timeout));
        // As reqwest's default: a dead peer is noticed on a kept connection.
        tcp.set_keepalive(Some(Duration::from_secs(15)));
        // hyper-rustls offers h2 and http/1.1 by ALPN itself, and wants none set before.
        let mut tls = config.tls;
        tls.alpn_protocols.clear();
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(QuickAckConnector(tcp));
        let connector = Limited {
            inner: https,
            limit: config.connect_timeout,
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(config.idle)
            .pool_max_idle_per_host(config.max_idle)
            .build(connector);
        Self {
            client,
            max_redirects: config.max_redirects,
        }
    }

    /// Sends `request`, following redirects to the same origin; the response as reqwest's, so
    /// that it is read as before (its body's size counted as it arrives, its charset decoded).
    pub async fn send(&self, request: Outgoing) -> Result<reqwest::Response, WireError> {
        let first = origin(&request.url);
        let mut request = request;
        let mut hops = 0;
        loop {
            let response = self.send_once(&request).await?;
            let Some(next) = redirected(&request, &response)? else {
                return Ok(reqwest::Response::from(response.map(reqwest::Body::wrap)));
            };
            hops += 1;
            if hops > self.max_redirects {
                return Err(WireError::Redirect(format!(
                    "more than {} redirects",
                    self.max_redirects
                )));
            }
            if origin(&next.url) != first {
                return Err(WireError::Redirect(format!(
                    "the server redirected to `{}`, another origin: not followed",
                    next.url
                )));
            }
            request = next;
        }
    }

    /// One exchange; sent once more only where the request cannot have reached the server.
    async fn send_once(&self, request: &Outgoing) -> Result<hyper::Response<Incoming>, WireError> {
        match self.client.request(to_http(request)?).await {
            Err(e) if not_processed(&e) => self.client.request(to_http(request)?).await,
            r => r,
        }
        .map_err(|source| WireError::Send {
            url: request.url.to_string(),
            source,
        })
    }
}

fn to_http(request: &Outgoing) -> Result<hyper::Request<reqwest::Body>, WireError> {
    let uri: Uri = request
        .url
        .as_str()
        .parse()
        .map_err(|e| WireError::Request(format!("`{}`: {e}", request.url)))?;
    let body = request
        .body
        .clone()
        .map_or_else(reqwest::Body::default, reqwest::Body::from);
    let mut http = hyper::Request::new(body);
    *http.method_mut() = request.method.clone();
    *http.uri_mut() = uri;
    *http.headers_mut() = request.headers.clone();
    Ok(http)
}

/// reqwest's default retry rule: an HTTP/2 stream the server refused, or that its graceful
/// `GOAWAY` left unprocessed, never reached the application.
fn not_processed(e: &hyper_util::client::legacy::Error) -> bool {
    let mut current: Option<&(dyn StdError + 'static)> = e.source();
    while let Some(err) = current {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.is_remote()
                && ((h2.is_go_away() && h2.reason() == Some(h2::Reason::NO_ERROR))
                    || (h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM)));
        }
        current = err.source();
    }
    false
}

fn origin(url: &reqwest::Url) -> (String, Option<String>, Option<u16>) {
    (
        url.scheme().to_owned(),
        url.host_str().map(str::to_owned),
        url.port_or_known_default(),
    )
}

/// The request a redirect asks for, as reqwest makes it: 307 and 308 repeat the request, 301
/// and 302 repeat it as a GET without its body when it was a POST, 303 asks for a GET.
fn redirected(
    request: &Outgoing,
    response: &hyper::Response<Incoming>,
) -> Result<Option<Outgoing>, WireError> {
    use hyper::StatusCode as S;
    let status = response.status();
    if !matches!(
        status,
        S::MOVED_PERMANENTLY
            | S::FOUND
            | S::SEE_OTHER
            | S::TEMPORARY_REDIRECT
            | S::PERMANENT_REDIRECT
    ) {
        return Ok(None);
    }
    let Some(location) = response.headers().get(hyper::header::LOCATION) else {
        return Ok(None);
    };
    let location = location
        .to_str()
        .map_err(|_| WireError::Redirect("a redirect to a location that is not text".into()))?;
    let url = request
        .url
        .join(location)
        .map_err(|e| WireError::Redirect(format!("a redirect to `{location}`: {e}")))?;
    let mut next = request.clone();
    next.url = url;
    let as_get = status == S::SEE_OTHER && request.method != Method::HEAD
        || matches!(status, S::MOVED_PERMANENTLY | S::FOUND) && request.method == Method::POST;
    if as_get {
        next.method = Method::GET;
        next.body = None;
        for h in [
            hyper::header::CONTENT_TYPE,
            hyper::header::CONTENT_LENGTH,
            hyper::header::CONTENT_ENCODING,
            hyper::header::TRANSFER_ENCODING,
        ] {
            next.headers.remove(h);
        }
    }
    Ok(Some(next))
}
