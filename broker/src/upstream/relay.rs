//! Forwarding an upstream's question to the person (`elicitation = "forward"`): a brokered
//! server that asks its client (`elicitation/create`) while a call is in flight on its session
//! has the question put to the person behind that call, in their harness, through the call's
//! bridge connection and shim; the answer goes back to the server.
//!
//! Which person: the call the question belongs to. MCP up to 2025-11-25 does not tie a
//! server's request to the client request it serves over stdio, so the broker ties it by what
//! is in flight on that session: a per-principal instance asks only its principal's calls, and
//! a question is forwarded only when exactly one call is in flight where it came from (several
//! would make the person a guess: then it is refused, and recorded with why).
//!
//! The route to a call's shim is set by the bridge around the call ([`ROUTE`], a task-local the
//! upstream call reads where it runs), so nothing between them carries it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;

/// How the broker reaches the person behind a call: the bridge connection the call came on.
#[derive(Clone)]
pub struct Route {
    pub turn: String,
    pub principal: String,
    /// The person's own token the turn was opened with, if any (`grant = "token_exchange"`).
    pub subject_token: Option<crate::secrets::Secret>,
    /// Puts one question from a provider (its namespace, and the `elicitation/create` params
    /// as the server sent them) to the person and resolves with the client's result
    /// (`action`, `content`), or why not. The flag: the question is the broker's own (a
    /// sign-in to that provider), shown as SharedOS's rather than the server's.
    pub ask: std::sync::Arc<dyn Fn(String, Value, bool) -> AskFuture + Send + Sync>,
}

/// What a question resolves with: the client's `ElicitResult` as JSON, or why there is none.
pub type AskFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Value, String>> + Send>>;

tokio::task_local! {
    /// The route of the call the current task serves (set by the bridge around each call).
    pub static ROUTE: Route;
}

/// The longest a forwarded question waits for the person.
pub const FORWARD_WAIT: Duration = Duration::from_secs(600);

/// The calls in flight on one provider's sessions that have a route, each with a serial.
#[derive(Default)]
pub struct InFlight {
    calls: Mutex<Vec<(u64, Route)>>,
    next: AtomicU64,
}

/// A call's place in [`InFlight`], taken out when the call ends (or is dropped).
pub struct Entered<'a> {
    table: &'a InFlight,
    serial: u64,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if let Ok(mut calls) = self.table.calls.lock() {
            calls.retain(|(s, _)| *s != self.serial);
        }
    }
}

impl InFlight {
    /// Enters the current task's call, if it has a route (a call from a bridge).
    pub fn enter(&self) -> Option<Entered<'_>> {
        let route = ROUTE.try_with(Route::clone).ok()?;
        let serial = self.next.fetch_add(1, Ordering::Relaxed);
        self.calls.lock().ok()?.push((serial, route));
        Some(Entered {
            table: self,
            serial,
        })
    }

    /// The one call a question from a session of `principal`'s instance (`None`: the
    /// provider's shared session) belongs to, or why there is not exactly one.
    pub fn route_for(&self, principal: Option<&str>) -> Result<Route, String> {
        let calls = self
            .calls
            .lock()
            .map_err(|_| "the table of calls in flight is unusable".to_owned())?;
        let mut candidates = calls
            .iter()
            .filter(|(_, r)| principal.is_none_or(|p| r.principal == p));
        match (candidates.next(), candidates.next()) {
            (Some((_, route)), None) => Ok(route.clone()),
            (None, _) => Err(
                "no call of a person is in flight on this server's session (a question outside a call has nobody to ask)".into(),
            ),
            (Some(_), Some(_)) => Err(format!(
                "{} calls are in flight on this server's session, so the question cannot be tied to one person",
                calls
                    .iter()
                    .filter(|(_, r)| principal.is_none_or(|p| r.principal == p))
                    .count()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(principal: &str) -> Route {
        Route {
            turn: "t".into(),
            principal: principal.into(),
            subject_token: None,
            ask: std::sync::Arc::new(|_, _, _| Box::pin(async { Ok(Value::Null) })),
        }
    }

    #[tokio::test]
    async fn exactly_one_call_of_the_session_gets_the_question() {
        let table = InFlight::default();
        assert!(table.enter().is_none(), "no route outside a bridge call");
        assert!(table.route_for(None).is_err());
        let alice = ROUTE
            .scope(route("alice"), async { table.enter() })
            .await
            .expect("entered");
        assert_eq!(table.route_for(None).expect("one").principal, "alice");
        let bob = ROUTE.scope(route("bob"), async { table.enter() }).await;
        // Two in flight on a shared session: nobody is guessed.
        let why = table.route_for(None).err().expect("ambiguous");
        assert!(why.contains("2 calls"), "{why}");
        // A per-principal instance asks only its principal's call.
        assert_eq!(table.route_for(Some("bob")).expect("bob").principal, "bob");
        assert!(table.route_for(Some("carol")).is_err());
        drop(bob);
        drop(alice);
        assert!(table.route_for(None).is_err());
    }
}
