//! A response body read to its end before its connection is reused, and a request's place
//! among the session's `max_connections` given back once it is: the pieces of connection reuse
//! that the HTTP transport (`http`) and the OAuth-wrapped client (`oauth`) both use, below both.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::stream::{BoxStream, Stream, StreamExt as _};
use tokio::sync::OwnedSemaphorePermit;

/// A response stream the MCP client stopped reading (it had its answer, or the call was
/// cancelled) is read on for at most this long, to its end, so its connection can be reused;
/// a stream still open then is dropped, and its connection closed.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// A request's place is given back this long after its response ended: the HTTP client puts
/// the connection back in its pool on a task of its own, and a request let in before that would
/// open another connection.
const RETURN_GRACE: Duration = Duration::from_millis(2);

/// A request's place among the session's `max_connections`, given back [`RETURN_GRACE`] after
/// its response ended (at once outside a runtime).
pub(super) fn give_back(place: Option<OwnedSemaphorePermit>) {
    let Some(place) = place else { return };
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            tokio::time::sleep(RETURN_GRACE).await;
            drop(place);
        });
    }
}

type SseStream = BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>;

/// A response's SSE stream that is read to its end: its place is given back at the end, and a
/// stream dropped after it carried its answer (rmcp stops reading once it has it) is read on,
/// for at most [`DRAIN_LIMIT`], on a task of its own, so its connection goes back to the pool
/// rather than being closed. One dropped before its answer (the call was cancelled or timed out)
/// is closed at once: under 2026-07-28 closing the stream is how a server learns of the cancel.
pub(super) struct Drained {
    inner: Option<SseStream>,
    place: Option<OwnedSemaphorePermit>,
    answered: bool,
}

impl Drained {
    pub(super) fn new(inner: SseStream, place: Option<OwnedSemaphorePermit>) -> Self {
        Self {
            inner: Some(inner),
            place,
            answered: false,
        }
    }
}

/// Whether an SSE event's data is a JSON-RPC response or error (not a request or notification).
fn is_answer(data: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Shape {
        #[serde(default)]
        method: Option<serde::de::IgnoredAny>,
        #[serde(default)]
        result: Option<serde::de::IgnoredAny>,
        #[serde(default)]
        error: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_str::<Shape>(data)
        .is_ok_and(|s| s.method.is_none() && (s.result.is_some() || s.error.is_some()))
}

impl Stream for Drained {
    type Item = Result<sse_stream::Sse, sse_stream::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let next = inner.poll_next_unpin(cx);
        match &next {
            Poll::Ready(None) => {
                self.inner = None;
                give_back(self.place.take());
            }
            Poll::Ready(Some(Ok(event))) if !self.answered => {
                self.answered = event.data.as_deref().is_some_and(is_answer);
            }
            _ => {}
        }
        next
    }
}

impl Drop for Drained {
    fn drop(&mut self) {
        let place = self.place.take();
        let Some(mut inner) = self.inner.take() else {
            give_back(place);
            return;
        };
        if !self.answered {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let ended =
                tokio::time::timeout(DRAIN_LIMIT, async { while inner.next().await.is_some() {} })
                    .await
                    .is_ok();
            drop(inner);
            if ended {
                give_back(place);
            }
            // Not ended: the connection is closed with the stream, and the place is free now.
        });
    }
}
