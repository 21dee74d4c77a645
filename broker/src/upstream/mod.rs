//! Brokered MCP providers: an existing stdio MCP server the broker spawns, keeps and restarts,
//! whose tools enter the catalogue as `<namespace>.<upstream name>` and whose every call goes
//! through the kernel like a built-in one.
//!
//! Owns: the upstream process and its MCP client session (supervised, restarted with backoff),
//! the provider's current registrations (names validated and checked for collisions across all
//! providers, and listed once by the upstream; rejects are kept with their reason, never renamed
//! or merged), drift pinning (an upstream whose tools no longer match its pin, at start or when it
//! announces `notifications/tools/list_changed`, is held back from every catalogue and its calls
//! from turns opened before are refused), and forwarding calls (cancellation and timeouts reach
//! the upstream as `notifications/cancelled`).
//! It never decides authority: requirement templates only say what a call touches.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use rmcp::ClientHandler;
use rmcp::model::{CallToolRequestParams, CallToolResponse};
use rmcp::service::{NotificationContext, Peer, RoleClient, RunningService};
use serde::Serialize;
use serde_json::{Map, Value, json};
use sharedos_proto::record::{self, Event, ProviderDetail};
use sharedos_proto::{CatalogHash, FailCode, ToolDefinition, ToolMetadata, ToolName};
use tokio_util::sync::CancellationToken;

use crate::config::{ConfigValue, Instances};
pub use crate::config::{McpProviderConfig, Scope, TemplateConfig};
use crate::evidence::record::Recorder;
use crate::files::beneath::{Root, Strategy};
use crate::files::vpath;
use crate::pins::Pins;
use crate::policy::AccessContext;
use crate::provider::{
    Authority, CallEnv, Failure, Job, Names, Provider, Resolution, Success, ToolHandler,
};
use crate::resource::{Object, Resource};
use crate::secrets::{Known, SHARED, Secret, SecretError, SecretStore};

mod cause;
mod drain;
pub mod exchange;
mod http;
mod instances;
mod log;
mod oauth;
pub mod relay;
pub mod sandbox;
pub mod signin;
mod stdio;
mod template;
mod token;
mod wire;
mod wire_mcp;

pub use http::{DEFAULT_IDLE_CONNECTION_SECONDS, DEFAULT_MAX_CONNECTIONS, MAX_CONNECTIONS};
pub use instances::{UidMap, UidPool, uid_map_path};
pub use log::UpstreamLog;
use log::upstream_text;
use template::fill_template;
pub use template::template_args;

/// How long the broker waits at start for an upstream's first tool list.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Of a call's time limit, what a held sign-in leaves for the call itself.
pub const SIGN_IN_CALL_MARGIN: Duration = Duration::from_secs(5);
/// Restart backoff: first and longest delay.
pub const BACKOFF_MIN: Duration = Duration::from_millis(200);
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// First wait before a 2026-07-28 server's ended `subscriptions/listen` stream is opened again.
const LISTEN_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Largest upstream result passed through (serialized); larger ones fail `too_large`.
pub const MAX_UPSTREAM_RESULT_BYTES: usize = 4 * 1024 * 1024;
/// Most `input_required` rounds one call of a 2026-07-28 server may take (the SDKs' own cap):
/// a server that asks again after this many ends the call.
pub const MAX_INPUT_ROUNDS: u32 = 10;
/// Most questions one `input_required` round may put to the person.
pub const MAX_INPUT_REQUESTS: usize = 8;
/// Lines an upstream can cause in the broker's log (its `notifications/message`, its stderr,
/// its `tools/list_changed` announcements, the tools it lists that are rejected), per provider
/// per [`UPSTREAM_LOG_WINDOW`]; past them, one line says lines are held back, and the next line
/// written counts them (`held_back`).
pub const UPSTREAM_LOG_LINES: u32 = 20;
pub const UPSTREAM_LOG_WINDOW: Duration = Duration::from_secs(10);
/// Bytes of an upstream's text one log line carries (escaped first, so it cannot start a line of
/// its own, then cut, marked `…`).
pub const MAX_UPSTREAM_LOG_BYTES: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Starting,
    Ready,
    Restarting,
    Drifted,
    Failed,
}

impl State {
    /// The state's name, as in `providers` and on `provider_state` lines.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Ready => "ready",
            State::Restarting => "restarting",
            State::Drifted => "drifted",
            State::Failed => "failed",
        }
    }
}

/// Where a provider's secret references are read, and where the values given are remembered for
/// redaction.
#[derive(Clone)]
pub struct Secrets {
    pub store: Arc<dyn SecretStore>,
    pub known: Arc<Known>,
}

impl Secrets {
    /// A folder store at `dir` (tests, and providers without secrets).
    pub fn folder(dir: impl Into<PathBuf>) -> Self {
        Self {
            store: Arc::new(crate::secrets::FolderStore::new(dir)),
            known: Arc::new(Known::default()),
        }
    }
}

/// One instance's command line and environment, secret references resolved. Never logged (no
/// `Debug`).
pub struct Launch {
    pub args: Vec<String>,
    pub env: Vec<(String, Secret)>,
    /// A remote provider's headers.
    pub headers: Vec<(String, Secret)>,
    /// A remote provider's OAuth client secret (`[providers.oauth]`), and whose it is.
    pub oauth_secret: Option<(String, Secret)>,
    /// The secrets given (name, value): redacted from what the instance writes to the log.
    pub given: Arc<[(String, Secret)]>,
    /// A principal's instance under a uid (= gid) of its own, instead of the provider's.
    pub run_as: Option<u32>,
    /// With `run_as`: each write rule (as the plan has it) and the instance's own folder in it,
    /// its write rule instead (and its `HOME`, the first, unless `home` is set).
    pub write_folders: Vec<(String, String)>,
    /// Whose instance this is (`None`: the provider's own session).
    pub principal: Option<String>,
}

/// One upstream tool this provider could not register, and why (a record type).
pub use sharedos_proto::record::Rejected;

/// What a brokered call requires, and what is sent upstream when it is not the call's own
/// arguments (a `file_root` path is sent as what it resolved to).
#[derive(Debug)]
pub struct Requirement {
    pub action: String,
    pub resource: Resource,
    pub forwarded: Option<Map<String, Value>>,
    /// What a `file_root` path resolved to (an approval is bound to it).
    pub object: Option<Object>,
}

/// How one attempt of a brokered call failed: `Expired` when a remote server had ended the
/// session before answering (the request may or may not have reached it: only a read-only call
/// is sent again).
pub(super) enum Attempt {
    Failed(Failure),
    Expired(Failure),
}

impl Attempt {
    fn into_failure(self) -> Failure {
        match self {
            Self::Failed(f) | Self::Expired(f) => f,
        }
    }
}

impl From<Failure> for Attempt {
    fn from(f: Failure) -> Self {
        Self::Failed(f)
    }
}

/// The plan of one principal's instance under `uid`, its own: each write rule in `folders`
/// replaced by the instance's own folder in it.
fn instance_plan(plan: &sandbox::Plan, uid: u32, folders: &[(String, String)]) -> sandbox::Plan {
    let mut p = plan.as_instance(uid);
    for (rule, own) in folders {
        for w in p.write.iter_mut().filter(|w| *w == rule) {
            w.clone_from(own);
        }
    }
    p
}

/// At most this many characters of an upstream's error message go into the call's message.
pub const MAX_UPSTREAM_MESSAGE_CHARS: usize = 500;

/// An upstream's error message as a call's message carries it: control characters as spaces,
/// at most [`MAX_UPSTREAM_MESSAGE_CHARS`] characters (`...` when cut). Secrets are redacted
/// later, by the kernel, with the rest of the answer.
pub(super) fn bounded_message(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(MAX_UPSTREAM_MESSAGE_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.chars().nth(MAX_UPSTREAM_MESSAGE_CHARS).is_some() {
        out.push_str("...");
    }
    out
}

/// A registered upstream tool's authority.
pub struct McpHandler {
    pub namespace: String,
    pub provider: Weak<McpProvider>,
    pub upstream: String,
    pub template: Option<TemplateConfig>,
    /// Annotated `readOnlyHint: true` upstream: a call the server's ended session lost is sent
    /// again once, on a new session.
    pub read_only: bool,
}

/// What `providers` shows for one provider.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub namespace: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub state: State,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
    pub tools: Vec<String>,
    pub rejected: Vec<Rejected>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_hash: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_hash: Option<String>,
    pub restarts: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The sandbox its upstream runs in (`"none"`, or the plan), as recorded.
    pub sandbox: Value,
    /// What becomes of its server's questions: `refuse` or `forward`.
    pub elicitation: &'static str,
    /// The MCP revision its server speaks on the provider's session (`2026-07-28`,
    /// `2025-11-25`, …), when one is open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// A `per_principal` provider's running instances.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instances: Option<Vec<instances::InstanceStatus>>,
    /// A remote provider's URL, TLS state, session and latency.
    #[serde(flatten)]
    pub remote: Option<http::RemoteStatus>,
}

pub use crate::provider::Registered;

struct Inner {
    state: State,
    tools: Vec<Arc<Registered>>,
    rejected: Vec<Rejected>,
    upstream_hash: Option<String>,
    last_error: Option<String>,
    peer: Option<Peer<RoleClient>>,
}

pub struct McpProvider {
    pub config: McpProviderConfig,
    /// Folder relative paths in the config resolve against.
    base: PathBuf,
    inner: RwLock<Inner>,
    restarts: AtomicU64,
    names: Arc<Names>,
    pins: Arc<Pins>,
    /// Bumped whenever any provider's published tools change (catalogue cache key).
    generation: Arc<AtomicU64>,
    recorder: Recorder,
    default_timeout: Duration,
    /// Set when a restart is wanted by a re-pin.
    shutdown: CancellationToken,
    /// Template `file_root` folders, held open (see [`crate::files::beneath`]).
    roots: Mutex<HashMap<String, Arc<Root>>>,
    /// Held while the upstream's tools are listed again and published (a re-pin, a
    /// `notifications/tools/list_changed`): one re-list at a time, so the last list wins.
    relisting: tokio::sync::Mutex<()>,
    /// The log lines this upstream can cause, bounded.
    log: Arc<UpstreamLog>,
    /// The sandbox planned at start (`None`: `sandbox = "none"`, or a remote provider; `Err`:
    /// it cannot be applied, and the upstream is not started).
    sandbox: Option<Result<sandbox::Plan, String>>,
    /// Where secret references are resolved.
    secrets: Secrets,
    /// A `per_principal` provider's instances (its supervised upstream only lists the tools).
    instances: Option<instances::Pool>,
    /// A remote provider's session bookkeeping.
    remote: http::Remote,
    /// `[providers.oauth]` tokens, per client secret owner.
    oauth: oauth::TokenCaches,
    /// Calls in flight with a route to their person (`elicitation = "forward"` only).
    in_flight: Arc<relay::InFlight>,
    /// People's sign-ins (`grant = "authorization_code"`), set before the provider starts.
    pub signins: std::sync::OnceLock<Arc<signin::SignIns>>,
    /// Token exchanges (`grant = "token_exchange"`), set before the provider starts.
    pub exchanger: std::sync::OnceLock<Arc<exchange::Exchanger>>,
    /// Set when the server answered `server/discover` with something other than its result or
    /// an error (a server that answers every unknown method `{}`): its sessions open with
    /// `initialize` from then on.
    discover_misanswered: std::sync::atomic::AtomicBool,
}

/// The broker's side of one upstream session: it hears the upstream's
/// `notifications/tools/list_changed` and wakes the supervisor, which lists the tools again, and
/// takes its `notifications/message` as what it is, the server's log: written as the broker's
/// own line, attributed to the provider, bounded ([`UpstreamLog`]).
///
/// An upstream's requests to its client are answered on record (`upstream_request`), never
/// silently declined: a question for the person (`elicitation/create`, form or URL mode; the
/// broker declares the capability so that the question reaches it) is forwarded to the person
/// behind the call in flight when the provider says `elicitation = "forward"` ([`relay`]), else
/// refused; a model completion (`sampling/createMessage`) and the client's roots (`roots/list`)
/// are refused.
struct Listener {
    changed: Arc<tokio::sync::Notify>,
    log: Arc<UpstreamLog>,
    /// The secrets given to this instance, redacted from its log messages.
    secrets: Arc<[(String, Secret)]>,
    /// Where refused upstream requests are recorded, and whose they are.
    requests: UpstreamRequests,
    /// Progress notifications this session sent (the broker asks for none): the first is
    /// recorded, the rest counted in the log.
    progress: Arc<std::sync::atomic::AtomicU64>,
    /// `elicitation = "forward"`: where the session's questions go.
    forward: Option<Forward>,
}

/// How one session's questions reach the person ([`relay`]).
struct Forward {
    in_flight: Arc<relay::InFlight>,
    /// The principal whose instance this session is (`None`: the provider's shared session).
    principal: Option<String>,
    /// How long a question waits for the person (the provider's call time limit, at most
    /// [`relay::FORWARD_WAIT`]).
    wait: Duration,
}

/// Records an upstream's requests to the broker's client side.
#[derive(Clone)]
struct UpstreamRequests {
    provider: String,
    recorder: Recorder,
}

/// Largest form schema (JSON text) an `upstream_request` line keeps; a larger one is kept as
/// its size and SHA-256.
pub const UPSTREAM_REQUEST_MAX_SCHEMA_BYTES: usize = 4096;

impl UpstreamRequests {
    /// Appends one `upstream_request` line (a failed append is logged: the upstream's answer
    /// does not wait on it).
    async fn append(&self, line: record::UpstreamRequest) {
        if let Err(e) = self.recorder.append(&Event::UpstreamRequest(line)).await {
            tracing::error!(provider = %self.provider, error = %e, "upstream_request not recorded");
        }
    }

    /// Records a notification the broker did not pass on (`action`: `not_forwarded`).
    async fn not_forwarded(&self, method: &str, reason: String) {
        tracing::info!(provider = %self.provider, method, reason, "an upstream's notification not forwarded");
        self.append(record::UpstreamRequest {
            provider: self.provider.clone(),
            method: method.to_owned(),
            mode: None,
            schema: None,
            host: None,
            action: "not_forwarded".into(),
            reason,
            turn: None,
            answer: None,
            round: None,
        })
        .await;
    }

    /// Records the refusal of `method` (`turn`: the call in flight it was refused in, when
    /// one is known) and returns the error the upstream gets.
    #[expect(
        clippy::too_many_arguments,
        reason = "the fields of the line, each of its own kind"
    )]
    async fn refuse(
        &self,
        method: &str,
        mode: Option<&str>,
        schema: Option<Value>,
        host: Option<String>,
        reason: String,
        turn: Option<String>,
        round: Option<u32>,
    ) -> rmcp::ErrorData {
        let schema = schema.map(bounded_schema);
        self.append(record::UpstreamRequest {
            provider: self.provider.clone(),
            method: method.to_owned(),
            mode: mode.map(str::to_owned),
            schema,
            host,
            action: "refused".into(),
            reason: reason.clone(),
            turn,
            answer: None,
            round,
        })
        .await;
        tracing::warn!(provider = %self.provider, method, reason, "an upstream's request to the client refused");
        rmcp::ErrorData::invalid_request(format!("refused by the SharedOS broker: {reason}"), None)
    }
}

impl UpstreamRequests {
    /// Records a question forwarded to the person behind `turn`, and what they did with it
    /// (`answer`: the elicitation action; never the values of the form).
    async fn forwarded(
        &self,
        mode: &str,
        schema: Option<Value>,
        host: Option<String>,
        turn: String,
        answer: String,
        round: Option<u32>,
    ) {
        self.append(record::UpstreamRequest {
            provider: self.provider.clone(),
            method: "elicitation/create".into(),
            mode: Some(mode.to_owned()),
            schema: schema.map(bounded_schema),
            host,
            action: "forwarded".into(),
            reason: match round {
                None => "asked the person behind the call in flight, in their harness".into(),
                Some(n) => format!(
                    "asked the person behind the call, in their harness (input_required round {n} of the call)"
                ),
            },
            turn: Some(turn),
            answer: Some(answer),
            round,
        })
        .await;
    }

    /// Puts a server's question (`elicitation/create` params, `value`) to the person behind
    /// `route` (`forward`: the route, or why there is none, and how long the person has; `None`:
    /// the provider does not forward questions) and returns their answer; each outcome is on
    /// record (`forwarded`, or `refused` with why: then the error is what the server is told).
    /// `round`: the call's `input_required` round it came in (2026-07-28).
    async fn ask_person(
        &self,
        forward: Option<(Result<relay::Route, String>, Duration)>,
        value: Value,
        redact: &(dyn Fn(&mut String) + Send + Sync),
        round: Option<u32>,
    ) -> Result<rmcp::model::ElicitResult, rmcp::ErrorData> {
        let url = value.get("mode").and_then(Value::as_str) == Some("url");
        let (mode, schema, host, not_https) = if url {
            let link = value.get("url").and_then(Value::as_str).unwrap_or_default();
            let (host, not_https) = url_host(link);
            ("url", None, host, not_https)
        } else {
            ("form", value.get("requestedSchema").cloned(), None, None)
        };
        let refuse = |reason: String, turn: Option<&str>| {
            self.refuse(
                "elicitation/create",
                Some(mode),
                schema.clone(),
                host.clone(),
                reason,
                turn.map(str::to_owned),
                round,
            )
        };
        let Some((route, wait)) = forward else {
            let mut reason = "this provider does not forward its questions to the person (`elicitation = \"forward\"` does): refused and recorded".to_owned();
            if let Some(why) = not_https {
                reason.push_str("; ");
                reason.push_str(why);
            }
            return Err(refuse(reason, None).await);
        };
        // The call it belongs to first: a refusal during a call is on record with its turn.
        if let Some(why) = not_https {
            return Err(refuse(
                format!("{why}: a URL-mode question is forwarded only for https"),
                route.as_ref().ok().map(|r| r.turn.as_str()),
            )
            .await);
        }
        let route = match route {
            Ok(r) => r,
            Err(why) => return Err(refuse(why, None).await),
        };
        let turn = Some(route.turn.as_str());
        // A secret given to this server never reaches the person through its question.
        let mut text = value.to_string();
        redact(&mut text);
        let value = serde_json::from_str(&text).unwrap_or(value);
        tracing::info!(provider = %self.provider, turn = %route.turn, principal = %route.principal, mode, ?round, "an upstream's question forwarded to the person");
        let asked =
            tokio::time::timeout(wait, (route.ask)(self.provider.clone(), value, false)).await;
        let result = match asked {
            Err(_) => {
                return Err(refuse(
                    format!("the person did not answer within {} s", wait.as_secs()),
                    turn,
                )
                .await);
            }
            Ok(Err(why)) => return Err(refuse(why, turn).await),
            Ok(Ok(result)) => result,
        };
        let parsed: Result<rmcp::model::ElicitResult, _> = serde_json::from_value(result);
        match parsed {
            Ok(answer) => {
                let action = serde_json::to_value(&answer.action)
                    .ok()
                    .and_then(|a| a.as_str().map(str::to_owned))
                    .unwrap_or_default();
                self.forwarded(mode, schema, host, route.turn.clone(), action, round)
                    .await;
                Ok(answer)
            }
            Err(e) => Err(refuse(
                format!("the harness's answer is not an elicitation result: {e}"),
                turn,
            )
            .await),
        }
    }
}

/// A form's schema as an `upstream_request` line keeps it: whole up to
/// [`UPSTREAM_REQUEST_MAX_SCHEMA_BYTES`], else its size and SHA-256.
fn bounded_schema(s: Value) -> Value {
    let text = s.to_string();
    if text.len() > UPSTREAM_REQUEST_MAX_SCHEMA_BYTES {
        let d = record::Digest::of(text.as_bytes());
        serde_json::json!({"schemaDigest": {"bytes": d.bytes, "sha256": d.sha256}})
    } else {
        s
    }
}

/// The host of an elicitation URL, and why it is refused: an https URL's host, or a note that
/// it is not https (then the URL would be refused even if questions were forwarded).
fn url_host(url: &str) -> (Option<String>, Option<&'static str>) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = authority.rsplit('@').next().unwrap_or_default();
    let mut host = host.to_owned();
    sharedos_proto::name::clip(&mut host, 255);
    let https = scheme.eq_ignore_ascii_case("https");
    (
        (!host.is_empty()).then_some(host),
        (!https).then_some("the URL is not https"),
    )
}

impl ClientHandler for Listener {
    fn get_info(&self) -> rmcp::model::ClientConfig {
        // Elicitation is declared so that an upstream's question reaches the broker and is
        // refused on record instead of failing unseen inside the upstream.
        let capabilities = serde_json::from_value(serde_json::json!({
            "elicitation": {"form": {}, "url": {}}
        }))
        .unwrap_or_default();
        // `initialize` names the newest revision that has it (rmcp's default would name
        // 2026-07-28, which a server echoing it back would take for a handshake it has not).
        rmcp::model::ClientConfig::new(
            capabilities,
            rmcp::model::Implementation::new("sharedos-broker", env!("CARGO_PKG_VERSION")),
        )
        .with_protocol_version(rmcp::model::ProtocolVersion::LATEST_WITH_INITIALIZE)
    }

    async fn create_elicitation(
        &self,
        request: rmcp::model::ElicitRequestParams,
        _context: rmcp::service::RequestContext<RoleClient>,
    ) -> Result<rmcp::model::ElicitResult, rmcp::ErrorData> {
        let value = serde_json::to_value(&request).unwrap_or_default();
        // The call it belongs to: up to 2025-11-25 a question is tied to a call only by what is
        // in flight on the session.
        let forward = self
            .forward
            .as_ref()
            .map(|f| (f.in_flight.route_for(f.principal.as_deref()), f.wait));
        let secrets = self.secrets.clone();
        let redact = move |text: &mut String| {
            crate::secrets::redact_with(&secrets, text, &mut Default::default());
        };
        self.requests
            .ask_person(forward, value, &redact, None)
            .await
    }

    #[expect(
        deprecated,
        reason = "sampling is deprecated (SEP-2577), but upstreams may still ask: it must be refused on record"
    )]
    async fn create_message(
        &self,
        _params: rmcp::model::CreateMessageRequestParams,
        _context: rmcp::service::RequestContext<RoleClient>,
    ) -> Result<rmcp::model::CreateMessageResult, rmcp::ErrorData> {
        Err(self
            .requests
            .refuse(
                "sampling/createMessage",
                None,
                None,
                None,
                "a brokered server may not use the person's model (sampling is refused)".into(),
                None,
                None,
            )
            .await)
    }

    #[expect(
        deprecated,
        reason = "roots are deprecated (SEP-2577), but upstreams may still ask: refused on record"
    )]
    async fn list_roots(
        &self,
        _context: rmcp::service::RequestContext<RoleClient>,
    ) -> Result<rmcp::model::ListRootsResult, rmcp::ErrorData> {
        Err(self
            .requests
            .refuse(
                "roots/list",
                None,
                None,
                None,
                "the broker shows a brokered server no roots of the client (its files are the broker's to authorize)".into(),
                None,
                None,
            )
            .await)
    }

    /// The broker sends no `progressToken` upstream, so a progress notification answers nothing
    /// it asked (the spec lets a receiver ignore it): the session's first is recorded
    /// (`upstream_request`, `not_forwarded`), every one counted in the log; none reaches the
    /// harness.
    async fn on_progress(
        &self,
        params: rmcp::model::ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        let n = self
            .progress
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        tracing::debug!(provider = %self.requests.provider, progress = params.progress, notifications = n, "upstream progress not forwarded");
        if n == 1 {
            self.requests
                .not_forwarded(
                    "notifications/progress",
                    "the broker asked for no progress (it sends no progressToken); progress is not forwarded to the harness (only this session's first is recorded)".into(),
                )
                .await;
        }
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        // A permit is kept if the supervisor is busy: announcements made meanwhile are one
        // re-list, made after them.
        self.changed.notify_one();
    }

    #[expect(
        deprecated,
        reason = "MCP logging is deprecated (SEP-2577), but servers still send notifications/message: it must be bounded"
    )]
    async fn on_logging_message(
        &self,
        params: rmcp::model::LoggingMessageNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        use rmcp::model::LoggingLevel as L;
        self.log.line(|provider, held_back| {
            let mut data = params.data.to_string();
            crate::secrets::redact_with(&self.secrets, &mut data, &mut Default::default());
            let data = upstream_text(&data);
            let logger = params
                .logger
                .as_deref()
                .map(upstream_text)
                .unwrap_or_default();
            let level = format!("{:?}", params.level).to_lowercase();
            // The upstream's own level, at most WARN: an upstream never writes the broker's
            // errors.
            match params.level {
                L::Debug => {
                    tracing::debug!(%provider, level, logger, held_back, "upstream log: {data}")
                }
                L::Info | L::Notice => {
                    tracing::info!(%provider, level, logger, held_back, "upstream log: {data}")
                }
                _ => tracing::warn!(%provider, level, logger, held_back, "upstream log: {data}"),
            }
        });
    }
}

/// The folders a provider's templates name as `file_root`, and whether a template writes there.
fn file_roots(config: &McpProviderConfig, base: &Path) -> Vec<(PathBuf, bool)> {
    config
        .tools
        .values()
        .filter_map(|t| {
            let root = t.file_root.as_ref()?;
            let root = if root.is_absolute() {
                root.clone()
            } else {
                base.join(root)
            };
            Some((root, t.action == "write"))
        })
        .collect()
}

/// The `PATH` a provider declares for its upstream, if plain.
fn sandbox_path(config: &McpProviderConfig) -> Option<&str> {
    match config.env.get("PATH") {
        Some(ConfigValue::Plain(path)) => Some(path.as_str()),
        _ => None,
    }
}

/// Refuses a sandboxed provider whose read or write rules (the defaults included) would reach
/// one of the broker's own files (`protected`: what it is, and where), naming the rule, its
/// origin and the file: Landlock cannot carve a file out of a rule.
pub fn check_exposure(
    config: &McpProviderConfig,
    base: &Path,
    protected: &[(String, PathBuf)],
) -> Result<(), String> {
    let crate::config::SandboxSetting::On(sb) = &config.sandbox else {
        return Ok(());
    };
    if config.url.is_some() {
        return Ok(());
    }
    // A configured path that does not exist is said at start, as before.
    let Ok(rules) = sandbox::rules(
        &config.namespace,
        sb,
        &config.command,
        base,
        sandbox_path(config),
        &file_roots(config, base),
    ) else {
        return Ok(());
    };
    match sandbox::exposure(&rules, protected) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// An upstream session, the tools it listed at start, and its list-changed announcements.
struct Session {
    service: RunningService<RoleClient, Listener>,
    tools: Vec<Value>,
    changed: Arc<tokio::sync::Notify>,
    /// The upstream's process group, killed whole when the session is let go.
    group: stdio::Group,
}

impl McpProvider {
    #[expect(
        clippy::too_many_arguments,
        reason = "the provider's shared handles, passed once at start"
    )]
    pub fn new(
        config: McpProviderConfig,
        base: PathBuf,
        names: Arc<Names>,
        pins: Arc<Pins>,
        generation: Arc<AtomicU64>,
        recorder: Recorder,
        default_timeout: Duration,
        shutdown: CancellationToken,
        secrets: Secrets,
        instance_uids: Option<Arc<instances::UidPool>>,
        uid_map: Option<Arc<instances::UidMap>>,
    ) -> Arc<Self> {
        let log = Arc::new(UpstreamLog::new(&config.namespace));
        let sandbox = match &config.sandbox {
            // A remote provider runs no process of its own: nothing to wall in.
            _ if config.url.is_some() => None,
            crate::config::SandboxSetting::Off(_) => None,
            crate::config::SandboxSetting::On(sb) => Some(sandbox::plan(
                &config.namespace,
                sb,
                &config.command,
                &base,
                sandbox_path(&config),
                &file_roots(&config, &base),
                sandbox::kernel_abi(),
            )),
        };
        // A per-principal provider's instances: each under a uid of its own from its range (or
        // the broker's), where the broker is root.
        let per_principal = config.instances == Instances::PerPrincipal;
        let mut uids = None;
        let sandbox = match (sandbox, &config.sandbox) {
            (Some(Ok(plan)), crate::config::SandboxSetting::On(sb)) if per_principal => {
                let (range, setting, pool) = match sb.instance_uids {
                    Some(r) => (
                        Some(r),
                        "[providers.sandbox] instance_uids",
                        uid_map.map(|map| {
                            instances::UidPool::new(
                                r,
                                &format!(
                                    "provider `{}`: [providers.sandbox] instance_uids",
                                    config.namespace
                                ),
                                map,
                            )
                        }),
                    ),
                    None => (
                        instance_uids.as_ref().map(|p| p.range()),
                        "instance_uids",
                        instance_uids,
                    ),
                };
                let mut plan = plan.with_instances(&config.namespace, range, setting);
                if matches!(
                    &plan,
                    Ok(sandbox::Plan {
                        instance_uids: Some(sandbox::InstanceUids::Own { .. }),
                        ..
                    })
                ) {
                    // Each instance gets a folder of its own in each `write` rule; a writing
                    // template's `file_root` is one folder the broker names to every instance,
                    // which would be every principal's at once.
                    if let Some((tool, root)) = config.tools.iter().find_map(|(name, t)| {
                        (t.action == "write")
                            .then_some(())
                            .and(t.file_root.as_ref().map(|r| (name, r)))
                    }) {
                        plan = Err(format!(
                            "provider `{}`: the sandbox cannot be applied: {setting} gives each principal's instance a uid of its own, and what an instance writes must be its principal's alone, but tool `{tool}` writes under file_root `{}`, one folder for every principal's instance; use a `write` rule (each instance gets its own folder in it) or drop {setting}",
                            config.namespace,
                            root.display()
                        ));
                    } else if pool.is_none() {
                        plan = Err(format!(
                            "provider `{}`: the sandbox cannot be applied: {setting} needs the broker's instance uid map, which this broker has not loaded",
                            config.namespace
                        ));
                    } else {
                        uids = pool;
                    }
                }
                Some(plan)
            }
            (other, _) => other,
        };
        let instances = per_principal.then(|| instances::Pool::new(&config, uids));
        Arc::new(Self {
            secrets,
            instances,
            log,
            sandbox,
            config,
            base,
            inner: RwLock::new(Inner {
                state: State::Starting,
                tools: vec![],
                rejected: vec![],
                upstream_hash: None,
                last_error: None,
                peer: None,
            }),
            restarts: AtomicU64::new(0),
            names,
            pins,
            generation,
            recorder,
            default_timeout,
            shutdown,
            roots: Mutex::new(HashMap::new()),
            relisting: tokio::sync::Mutex::new(()),
            remote: http::Remote::default(),
            oauth: oauth::TokenCaches::default(),
            signins: std::sync::OnceLock::new(),
            exchanger: std::sync::OnceLock::new(),
            in_flight: Arc::default(),
            discover_misanswered: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn namespace(&self) -> &str {
        &self.config.namespace
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        match self.inner.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        match self.inner.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The tools this provider publishes now (none unless ready and in scope).
    pub fn tools_in_scope(&self, principal: &str, agent: Option<&str>) -> Vec<Arc<Registered>> {
        if let Some(scope) = &self.config.scope
            && !scope.matches(principal, agent)
        {
            return vec![];
        }
        let inner = self.read();
        if inner.state == State::Ready {
            inner.tools.clone()
        } else {
            vec![]
        }
    }

    pub fn status(&self) -> Status {
        let inner = self.read();
        Status {
            namespace: self.config.namespace.clone(),
            kind: "mcp",
            state: inner.state,
            scope: self.config.scope.clone(),
            tools: inner.tools.iter().map(|t| t.name.to_string()).collect(),
            rejected: inner.rejected.clone(),
            upstream_hash: inner.upstream_hash.clone(),
            pinned_hash: self.pins.get(&self.config.namespace),
            restarts: self.restarts.load(Ordering::Relaxed),
            last_error: inner.last_error.clone(),
            sandbox: self.sandbox_shown(),
            elicitation: match self.config.elicitation {
                crate::config::ElicitationSetting::Refuse => "refuse",
                crate::config::ElicitationSetting::Forward => "forward",
            },
            protocol: inner
                .peer
                .as_ref()
                .and_then(Peer::peer_info)
                .map(|i| i.protocol_version.to_string()),
            instances: self.instances.as_ref().map(instances::Pool::status),
            remote: self.remote_status(inner.peer.is_some()),
        }
    }

    /// The sandbox as `providers` shows it and `provider_state` lines record it.
    pub fn sandbox_shown(&self) -> Value {
        match &self.sandbox {
            None if self.config.url.is_some() => json!("remote"),
            None => json!("none"),
            Some(Ok(plan)) => plan.shown(),
            Some(Err(e)) => json!({ "unavailable": e }),
        }
    }

    /// The instance's arguments and environment with secret references resolved: for
    /// `principal`'s instance, its per-principal secrets and the shared ones; for the provider's
    /// own upstream (`None`), the shared ones and, for a `per_principal` provider, those of
    /// `list_as` (or the empty string). Each value read is remembered for redaction.
    pub async fn launch(&self, principal: Option<&str>) -> Result<Launch, SecretError> {
        let owner = principal.or(self.config.list_as.as_deref());
        let mut cache: HashMap<(bool, String), Secret> = HashMap::new();
        let mut resolve = async |v: &ConfigValue| -> Result<Secret, SecretError> {
            let r = match v {
                ConfigValue::Plain(s) => return Ok(Secret::new(s.clone())),
                ConfigValue::Secret(r) => r,
            };
            if let Some(v) = cache.get(&(r.shared, r.secret.clone())) {
                return Ok(v.clone());
            }
            let whose = if r.shared { Some(SHARED) } else { owner };
            let Some(whose) = whose else {
                return Ok(Secret::new(String::new()));
            };
            let value = self.secrets.store.get(whose, &r.secret).await?;
            self.secrets.known.add(whose, &r.secret, &value);
            cache.insert((r.shared, r.secret.clone()), value.clone());
            Ok(value)
        };
        let mut args = Vec::with_capacity(self.config.args.len());
        for a in &self.config.args {
            args.push(resolve(a).await?.expose().to_owned());
        }
        let mut env = Vec::with_capacity(self.config.env.len());
        for (k, v) in &self.config.env {
            env.push((k.clone(), resolve(v).await?));
        }
        let mut headers = Vec::with_capacity(self.config.headers.len());
        for (k, v) in &self.config.headers {
            headers.push((k.clone(), resolve(v).await?));
        }
        let oauth_secret = match self
            .config
            .oauth
            .as_ref()
            .and_then(|o| o.client_secret.as_ref())
        {
            Some(secret) => {
                let who = match secret {
                    ConfigValue::Secret(r) if !r.shared => owner.unwrap_or(SHARED),
                    _ => SHARED,
                };
                Some((who.to_owned(), resolve(secret).await?))
            }
            None => None,
        };
        let given = cache
            .into_iter()
            .filter(|(_, v)| !v.expose().is_empty())
            .map(|((_, name), v)| (name, v))
            .collect();
        Ok(Launch {
            args,
            env,
            headers,
            oauth_secret,
            given,
            run_as: None,
            write_folders: Vec::new(),
            principal: principal.map(str::to_owned),
        })
    }

    /// A session with the upstream: the provider's own (`principal` None, the supervisor's) or
    /// one principal's instance.
    async fn connect_any(
        &self,
        launch: &Launch,
        principal: Option<&str>,
    ) -> Result<Session, http::ConnectError> {
        let misanswered = self.discover_misanswered.load(Ordering::Relaxed);
        let first = match &self.config.url {
            Some(url) => self.connect_http(url, launch, principal).await,
            None => self.connect(launch).await.map_err(Into::into),
        };
        if first.is_err() && !misanswered && self.discover_misanswered.load(Ordering::Relaxed) {
            tracing::info!(provider = %self.config.namespace, "the server answered server/discover with something other than its result: opening with initialize (2025-11-25) instead");
            return match &self.config.url {
                Some(url) => self.connect_http(url, launch, principal).await,
                None => self.connect(launch).await.map_err(Into::into),
            };
        }
        first
    }

    /// Notes a start that failed because the server answered `server/discover` with something
    /// other than its result (`e`): the next try opens with `initialize`.
    fn note_discover(&self, e: &rmcp::service::ClientInitializeError) {
        if matches!(
            e,
            rmcp::service::ClientInitializeError::ExpectedInitResult(_)
        ) && matches!(self.lifecycle(), rmcp::ClientLifecycleMode::Auto { .. })
        {
            self.discover_misanswered.store(true, Ordering::Relaxed);
        }
    }

    pub fn pins(&self) -> &Pins {
        &self.pins
    }

    pub fn pins_path(&self) -> Option<PathBuf> {
        self.pins.path.clone()
    }

    pub fn upstream_hash(&self) -> Option<String> {
        self.read().upstream_hash.clone()
    }

    /// Why this provider's calls are refused `failed/provider_drifted`, while its upstream's
    /// tools do not match the pin (`None` otherwise). Turns opened before the drift still hold
    /// its registrations: this is what stops their calls.
    pub fn drift(&self) -> Option<String> {
        let inner = self.read();
        (inner.state == State::Drifted).then(|| {
            format!(
                "the upstream server of `{}` changed its tools (catalogHash {} does not match the pin {}); its calls are refused until `sharedos-broker providers pin` accepts the new list",
                self.config.namespace,
                inner.upstream_hash.as_deref().unwrap_or("(none)"),
                self.pins.get(&self.config.namespace).as_deref().unwrap_or("(none)"),
            )
        })
    }

    async fn record(&self, state: State, detail: ProviderDetail) {
        self.record_as(state.as_str(), None, detail).await;
    }

    /// A `provider_state` line (`principal`: for one principal's instance).
    async fn record_as(&self, state: &str, principal: Option<&str>, detail: ProviderDetail) {
        self.record_sandboxed(state, principal, self.sandbox_shown(), detail)
            .await;
    }

    /// The sandbox of one principal's instance: the provider's, under the instance's own uid
    /// when it has one.
    fn instance_sandbox(&self, uid: Option<u32>, folders: &[(String, String)]) -> Value {
        match (&self.sandbox, uid) {
            (Some(Ok(plan)), Some(uid)) => instance_plan(plan, uid, folders).shown(),
            _ => self.sandbox_shown(),
        }
    }

    /// `principal`'s own folder (under `uid`) in each of the provider's `write` rules: (the
    /// rule as the plan has it, the folder).
    fn own_folders(&self, principal: &str, uid: u32) -> Result<Vec<(String, String)>, String> {
        let crate::config::SandboxSetting::On(sb) = &self.config.sandbox else {
            return Ok(Vec::new());
        };
        sb.write
            .iter()
            .map(|rule| {
                let own = instances::own_folder(rule, principal, uid)?;
                Ok((rule.display().to_string(), own.display().to_string()))
            })
            .collect()
    }

    /// A `provider_state` line with the sandbox it ran in (an instance's own).
    async fn record_sandboxed(
        &self,
        state: &str,
        principal: Option<&str>,
        sandbox: Value,
        detail: ProviderDetail,
    ) {
        let line = Event::ProviderState(record::ProviderState {
            provider: self.config.namespace.clone(),
            state: state.to_owned(),
            sandbox: Some(sandbox),
            detail,
            turn: None,
            principal: principal.map(str::to_owned),
            remote: self.remote_shown(),
        });
        if let Err(e) = self.recorder.append(&line).await {
            tracing::error!(provider = %self.config.namespace, error = %e, "cannot record provider state");
        }
    }

    /// How a session with the upstream opens: `protocol = "auto"` asks with `server/discover`
    /// for 2026-07-28 and falls back to `initialize` 2025-11-25 for a server that does not know
    /// it (or answers nothing within 10 s, or answered it with something else before);
    /// `"2025-11-25"` opens with `initialize` only.
    fn lifecycle(&self) -> rmcp::ClientLifecycleMode {
        match self.config.protocol {
            crate::config::ProtocolSetting::Auto
                if !self.discover_misanswered.load(Ordering::Relaxed) =>
            {
                rmcp::ClientLifecycleMode::Auto {
                    preferred_versions: vec![rmcp::model::ProtocolVersion::V_2026_07_28],
                    legacy_version: Some(rmcp::model::ProtocolVersion::V_2025_11_25),
                }
            }
            _ => rmcp::ClientLifecycleMode::Initialize,
        }
    }

    /// A 2026-07-28 server announces a changed tool list only on a `subscriptions/listen`
    /// stream its client opened: one is kept open for each such session (opened again, after
    /// 1 s doubling to 30 s, when the server ends it: a restarted server, a dropped
    /// connection; the list is then read again, as it may have changed unheard), and its
    /// announcements wake the supervisor as a 2025-11-25 server's
    /// `notifications/tools/list_changed` do. It ends with the session.
    fn listen_for_changes(&self, peer: &Peer<RoleClient>, changed: Arc<tokio::sync::Notify>) {
        let modern = peer
            .peer_info()
            .is_some_and(|i| !i.protocol_version.has_initialize());
        if !modern {
            return;
        }
        let peer = peer.clone();
        let provider = self.config.namespace.clone();
        tokio::spawn(async move {
            let mut backoff = LISTEN_BACKOFF_MIN;
            let mut first = true;
            while !peer.is_transport_closed() {
                let filter = rmcp::model::SubscriptionFilter::builder()
                    .tools_list_changed()
                    .build();
                match peer.listen(filter).await {
                    Ok(mut sub) => {
                        if sub.acknowledged().tools_list_changed != Some(true) {
                            tracing::info!(%provider, "the server announces no tool list changes");
                            return;
                        }
                        if !first {
                            changed.notify_one();
                        }
                        backoff = LISTEN_BACKOFF_MIN;
                        loop {
                            match sub.next().await {
                                Ok(Some(
                                    rmcp::model::ServerNotification::ToolListChangedNotification(_),
                                )) => changed.notify_one(),
                                Ok(Some(_)) => {}
                                Ok(None) => break,
                                Err(e) => {
                                    tracing::info!(%provider, error = %e, "the server's subscriptions/listen stream ended");
                                    break;
                                }
                            }
                        }
                    }
                    Err(rmcp::ServiceError::McpError(e)) => {
                        tracing::warn!(%provider, code = e.code.0, message = %e.message, "the server refused subscriptions/listen: its tool list changes go unheard");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(%provider, error = %e, "subscriptions/listen failed: the server's tool list changes go unheard until it is open again");
                    }
                }
                first = false;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        });
    }

    /// The client side the broker runs for one session with the upstream.
    fn listener(&self, changed: Arc<tokio::sync::Notify>, launch: &Launch) -> Listener {
        let forward =
            (self.config.elicitation == crate::config::ElicitationSetting::Forward).then(|| {
                Forward {
                    in_flight: self.in_flight.clone(),
                    principal: launch.principal.clone(),
                    wait: self.call_timeout().min(relay::FORWARD_WAIT),
                }
            });
        Listener {
            changed,
            log: self.log.clone(),
            secrets: launch.given.clone(),
            requests: UpstreamRequests {
                provider: self.config.namespace.clone(),
                recorder: self.recorder.clone(),
            },
            progress: Arc::default(),
            forward,
        }
    }

    /// The upstream's `tools/list` (every page), as raw JSON, bounded by the startup timeout.
    async fn list(&self, peer: &Peer<RoleClient>) -> Result<Vec<Value>, String> {
        let tools = tokio::time::timeout(self.startup_timeout(), peer.list_all_tools())
            .await
            .map_err(|_| "the upstream did not answer tools/list in time".to_owned())?
            .map_err(|e| format!("tools/list on the upstream failed: {e}"))?;
        Ok(tools
            .iter()
            .filter_map(|t| serde_json::to_value(t).ok())
            .collect())
    }

    /// Checks the templates against the upstream's tools: every templated tool exists and every
    /// `{arg}` is in its inputSchema.
    pub fn check_templates(&self, tools: &[Value]) -> Result<(), String> {
        for (name, template) in &self.config.tools {
            let Some(tool) = tools.iter().find(|t| t["name"] == name.as_str()) else {
                return Err(format!(
                    "provider `{}`: the template for `{name}` names a tool the upstream does not have",
                    self.config.namespace
                ));
            };
            let props = tool["inputSchema"]["properties"].as_object();
            for arg in template.args() {
                if !props.is_some_and(|p| p.contains_key(&arg)) {
                    return Err(format!(
                        "provider `{}`: the template for `{name}` uses argument `{arg}`, which the upstream's inputSchema does not have",
                        self.config.namespace
                    ));
                }
            }
        }
        Ok(())
    }

    /// Registers the upstream's tools (or holds them back when drifted).
    async fn publish(self: &Arc<Self>, tools: &[Value], peer: Peer<RoleClient>) {
        let ns = self.config.namespace.clone();
        let hash = sharedos_proto::catalog::raw_catalog_hash(tools)
            .map(|h: CatalogHash| h.to_string())
            .ok();
        let pinned = self.pins.get(&ns);
        let drifted = matches!((&pinned, &hash), (Some(p), Some(h)) if p != h);
        self.names.release_all(&ns);
        let (registered, rejected) = if drifted {
            (vec![], vec![])
        } else {
            register(self, tools)
        };
        for r in &rejected {
            self.log.line(|provider, held_back| {
                let (upstream, reason) = (upstream_text(&r.upstream), upstream_text(&r.reason));
                tracing::warn!(%provider, upstream, reason, held_back, "upstream tool rejected at registration");
            });
        }
        let state = if drifted {
            State::Drifted
        } else {
            State::Ready
        };
        {
            let mut inner = self.write();
            inner.state = state;
            inner.tools = registered;
            inner.rejected = rejected.clone();
            inner.upstream_hash = hash.clone();
            inner.peer = Some(peer);
            inner.last_error = drifted.then(|| {
                format!(
                    "the upstream's tools changed: catalogHash {} does not match the pin {}; held back until re-pinned",
                    hash.clone().unwrap_or_default(),
                    pinned.clone().unwrap_or_default()
                )
            });
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
        let detail = ProviderDetail::Listed {
            upstream_hash: hash,
            pinned_hash: pinned,
            tools: self.status().tools,
            rejected,
        };
        self.record(state, detail).await;
    }

    /// Re-checks the pin against the current upstream tools (after `providers pin`).
    pub async fn repin(self: &Arc<Self>) {
        let _one = self.relisting.lock().await;
        let peer = self.read().peer.clone();
        let Some(peer) = peer else { return };
        match self.list(&peer).await {
            Ok(tools) => self.publish(&tools, peer).await,
            Err(e) => {
                tracing::warn!(provider = %self.config.namespace, error = %e, "tools/list after re-pin failed")
            }
        }
    }

    /// After the upstream's `notifications/tools/list_changed`: lists its tools again, checks
    /// the templates and the pin, and publishes them (a drifted list is held back, and calls from
    /// turns opened before are refused). Err(reason) when the templates no longer fit the new
    /// list: the provider then fails, as it would at start.
    async fn relist(self: &Arc<Self>, peer: Peer<RoleClient>) -> Result<(), String> {
        let _one = self.relisting.lock().await;
        self.log.line(|provider, held_back| {
            tracing::info!(%provider, held_back, "the upstream's tool list changed; listing it again");
        });
        let tools = match self.list(&peer).await {
            Ok(tools) => tools,
            Err(e) => {
                // The session is likely going away: its end restarts the upstream, and the
                // restart lists and checks its tools.
                tracing::warn!(provider = %self.config.namespace, error = %e, "tools/list after tools/list_changed failed");
                return Ok(());
            }
        };
        self.check_templates(&tools)?;
        self.publish(&tools, peer).await;
        Ok(())
    }

    /// Starts the upstream and keeps it: restarts with backoff when it dies. Resolves `ready` on
    /// the first outcome (Ok once published, Err with the reason otherwise).
    pub async fn supervise(
        self: Arc<Self>,
        ready: tokio::sync::oneshot::Sender<Result<(), String>>,
    ) {
        let mut ready = Some(ready);
        let mut backoff = BACKOFF_MIN;
        loop {
            if self.shutdown.is_cancelled() {
                return;
            }
            let connected = match self.launch(None).await {
                Ok(launch) => self.connect_any(&launch, None).await,
                Err(e) => Err(http::ConnectError::from(e.to_string())),
            };
            let connected = match connected {
                Err(e) if e.sign_in => {
                    // The tools are listed with `list_as`'s sign-in: until that person signs
                    // in (on the page, /connect/<provider>), the provider waits, published
                    // with no tools; the broker starts meanwhile.
                    let who = self.config.list_as.clone().unwrap_or_default();
                    let ns = self.config.namespace.clone();
                    let why = format!(
                        "waiting for `{who}` (list_as) to sign in to `{ns}` on the person's page (/connect/{ns}) to list its tools: {}",
                        e.message
                    );
                    self.set_restarting(&why).await;
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(Ok(()));
                    }
                    if let Some(signins) = self.signins.get().cloned() {
                        tokio::select! {
                            _ = signins.wait(&who, &ns, Duration::from_secs(3600)) => {}
                            _ = self.shutdown.cancelled() => return,
                        }
                    }
                    continue;
                }
                Err(e) if e.missing && self.exchanger.get().is_some() => {
                    // Listed with `list_as`'s exchanged token: until a turn of theirs brings a
                    // subject token, the provider waits, published with no tools.
                    let who = self.config.list_as.clone().unwrap_or_default();
                    let ns = self.config.namespace.clone();
                    let why = format!(
                        "waiting for a turn of `{who}` (list_as) opened with a subject token to list the tools of `{ns}`: {}",
                        e.message
                    );
                    self.set_restarting(&why).await;
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(Ok(()));
                    }
                    if let Some(ex) = self.exchanger.get().cloned() {
                        ex.subjects().waiting(&ns, &who);
                        tokio::select! {
                            () = ex.subjects().wait_given(&who) => {}
                            _ = self.shutdown.cancelled() => return,
                        }
                    }
                    continue;
                }
                other => other.map_err(|e| e.message),
            };
            if let Some(ex) = self.exchanger.get()
                && connected.is_err()
            {
                ex.subjects().listed(&self.config.namespace);
            }
            match connected {
                Ok(Session {
                    service,
                    tools,
                    changed,
                    group: _group,
                }) => {
                    if let Err(e) = self.check_templates(&tools) {
                        self.set_failed(&e).await;
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(Err(e));
                        }
                        let _ = service.cancel().await;
                        return;
                    }
                    let peer = service.peer().clone();
                    self.publish(&tools, peer.clone()).await;
                    if let Some(ex) = self.exchanger.get() {
                        ex.subjects().listed(&self.config.namespace);
                    }
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(Ok(()));
                    }
                    backoff = BACKOFF_MIN;
                    let stop = service.cancellation_token();
                    let shutdown = self.shutdown.clone();
                    let mut waiter = tokio::spawn(async move { service.waiting().await });
                    loop {
                        tokio::select! {
                            _ = shutdown.cancelled() => { stop.cancel(); let _ = (&mut waiter).await; return; }
                            r = &mut waiter => {
                                let why = match r {
                                    Ok(Ok(reason)) => format!("the upstream session ended ({reason:?})"),
                                    Ok(Err(e)) => format!("the upstream session failed: {e}"),
                                    Err(e) => format!("the upstream task failed: {e}"),
                                };
                                self.set_restarting(&why).await;
                                break;
                            }
                            () = changed.notified() => {
                                let relisted = tokio::select! {
                                    r = self.relist(peer.clone()) => r,
                                    _ = shutdown.cancelled() => { stop.cancel(); let _ = (&mut waiter).await; return; }
                                };
                                if let Err(e) = relisted {
                                    self.set_failed(&e).await;
                                    stop.cancel();
                                    let _ = (&mut waiter).await;
                                    return;
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    if let Some(tx) = ready.take() {
                        self.set_failed(&e).await;
                        let _ = tx.send(Err(e));
                        return;
                    }
                    self.set_restarting(&e).await;
                }
            }
            self.restarts.fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    async fn set_restarting(&self, why: &str) {
        tracing::warn!(provider = %self.config.namespace, reason = %why, "upstream down; restarting");
        {
            let mut inner = self.write();
            inner.state = State::Restarting;
            inner.peer = None;
            inner.last_error = Some(why.to_owned());
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
        self.record(
            State::Restarting,
            ProviderDetail::Reason {
                reason: why.to_owned(),
            },
        )
        .await;
    }

    async fn set_failed(&self, why: &str) {
        tracing::error!(provider = %self.config.namespace, reason = %why, "upstream failed");
        {
            let mut inner = self.write();
            inner.state = State::Failed;
            inner.peer = None;
            inner.tools.clear();
            inner.last_error = Some(why.to_owned());
        }
        self.names.release_all(&self.config.namespace);
        self.generation.fetch_add(1, Ordering::Relaxed);
        self.record(
            State::Failed,
            ProviderDetail::Reason {
                reason: why.to_owned(),
            },
        )
        .await;
    }

    pub fn startup_timeout(&self) -> Duration {
        self.config
            .startup_timeout_seconds
            .map_or(STARTUP_TIMEOUT, Duration::from_secs)
    }

    pub fn call_timeout(&self) -> Duration {
        self.config
            .call_timeout_seconds
            .map_or(self.default_timeout, Duration::from_secs)
    }

    /// Forwards one call upstream under the upstream's own name. Dropping this future (the
    /// kernel does, on cancellation and timeout) sends `notifications/cancelled` upstream. A
    /// remote server that ended its session (HTTP 404) before answering gets a `read_only`
    /// call once more, on a new session; any other call is refused, never sent twice.
    pub async fn call(
        self: &Arc<Self>,
        principal: &str,
        upstream: &str,
        arguments: &Map<String, Value>,
        read_only: bool,
        trace: Option<&crate::telemetry::Outgoing>,
    ) -> Result<Success, Failure> {
        // Checked again here: the upstream may have drifted since the kernel's check.
        if let Some(why) = self.drift() {
            return Err(Failure::new(FailCode::ProviderDrifted, why));
        }
        let sessions = self.remote_sessions();
        match self
            .call_session(principal, upstream, arguments, trace)
            .await
        {
            Err(Attempt::Expired(failure)) if read_only => {
                tracing::info!(provider = %self.config.namespace, tool = upstream, principal, "session ended under a read-only call: sent again on a new session");
                self.record_as(
                    "call_retried",
                    Some(principal),
                    ProviderDetail::Reason {
                        reason: format!(
                            "the remote server ended its session (HTTP 404) under read-only `{upstream}`: sent once more on a new session"
                        ),
                    },
                )
                .await;
                if self.instances.is_none() {
                    self.await_new_session(sessions, &failure).await?;
                }
                self.call_session(principal, upstream, arguments, trace)
                    .await
                    .map_err(Attempt::into_failure)
            }
            r => r.map_err(Attempt::into_failure),
        }
    }

    /// The supervisor's restart count: it moves past the value read before a call once the
    /// provider's session has ended, so a new session is told from the old one.
    fn remote_sessions(&self) -> u64 {
        self.restarts.load(Ordering::Acquire)
    }

    /// Waits (bounded by the start time limit; the call's own limit still applies) for the
    /// supervisor to open the session that replaces the one the server ended.
    async fn await_new_session(&self, before: u64, failure: &Failure) -> Result<(), Failure> {
        let deadline = tokio::time::Instant::now() + self.startup_timeout();
        loop {
            if self.remote_sessions() > before && self.read().peer.is_some() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline || self.shutdown.is_cancelled() {
                return Err(failure.clone());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One attempt on the principal's instance or the provider's session.
    async fn call_session(
        self: &Arc<Self>,
        principal: &str,
        upstream: &str,
        arguments: &Map<String, Value>,
        trace: Option<&crate::telemetry::Outgoing>,
    ) -> Result<Success, Attempt> {
        if let Some(pool) = &self.instances
            && let Some(signins) = self.signing_in()
        {
            // A person's own sign-in: asked for first when there is none; a call refused for
            // want of one (its refresh refused, before anything was sent) asks once more.
            self.sign_in(&signins, principal).await?;
            let first = self
                .call_instance(pool, principal, upstream, arguments, trace)
                .await;
            return match first {
                Err(Attempt::Failed(f)) if f.code == FailCode::SignInRequired => {
                    self.sign_in(&signins, principal).await?;
                    self.call_instance(pool, principal, upstream, arguments, trace)
                        .await
                }
                r => r,
            };
        }
        if let Some(pool) = &self.instances {
            self.subject_given(principal)?;
            return self
                .call_instance(pool, principal, upstream, arguments, trace)
                .await;
        }
        let peer = self.read().peer.clone().ok_or_else(|| {
            Attempt::Failed(Failure::new(
                FailCode::UpstreamUnavailable,
                format!(
                    "the upstream server of `{}` is not running (it is being restarted); try again",
                    self.config.namespace
                ),
            ))
        })?;
        self.call_on(&peer, upstream, arguments, None, trace).await
    }

    /// One attempt on the principal's instance.
    async fn call_instance(
        self: &Arc<Self>,
        pool: &instances::Pool,
        principal: &str,
        upstream: &str,
        arguments: &Map<String, Value>,
        trace: Option<&crate::telemetry::Outgoing>,
    ) -> Result<Success, Attempt> {
        {
            let instance = pool.get(self, principal).await.map_err(Attempt::Failed)?;
            let peer = instance.0.peer.clone();
            // `instance` is held (busy) until the call ends or is dropped.
            self.call_on(&peer, upstream, arguments, Some(&instance.0), trace)
                .await
        }
    }

    /// The sign-ins of this provider, when people sign in to it (`authorization_code`).
    fn signing_in(&self) -> Option<Arc<signin::SignIns>> {
        self.config
            .oauth
            .as_ref()
            .filter(|o| o.grant == crate::config::OAuthGrant::AuthorizationCode)?;
        self.signins.get().cloned()
    }

    /// Sets up people's sign-ins to this provider (`grant = "authorization_code"`): its OAuth
    /// client, registered with `signins` (the page reaches it there).
    pub fn attach_signins(&self, signins: &Arc<signin::SignIns>) -> Result<(), String> {
        let Some(o) = self
            .config
            .oauth
            .as_ref()
            .filter(|o| o.grant == crate::config::OAuthGrant::AuthorizationCode)
        else {
            return Ok(());
        };
        let ns = &self.config.namespace;
        let url = self.config.url.clone().unwrap_or_default();
        let client = signin::AuthCodeClient::new(
            ns,
            &url,
            o.clone(),
            self.config.insecure_http,
            self.http_client()?,
            signins,
            self.secrets.store.clone(),
        )?;
        signins.add(ns, Arc::new(client));
        let _ = self.signins.set(signins.clone());
        Ok(())
    }

    /// Sets up token exchange for this provider (`grant = "token_exchange"`): its OAuth client,
    /// reading the subject tokens hosts hand in at turn open from `subjects`.
    pub fn attach_exchange(&self, subjects: &Arc<exchange::SubjectTokens>) -> Result<(), String> {
        let Some(o) = self
            .config
            .oauth
            .as_ref()
            .filter(|o| o.grant == crate::config::OAuthGrant::TokenExchange)
        else {
            return Ok(());
        };
        let d = signin::Discovery {
            ns: self.config.namespace.clone(),
            url: self.config.url.clone().unwrap_or_default(),
            insecure_http: self.config.insecure_http,
            http: self.http_client()?,
        };
        let exchanger = exchange::Exchanger::new(
            d,
            o.clone(),
            self.secrets.store.clone(),
            self.secrets.known.clone(),
            subjects.clone(),
        );
        let _ = self.exchanger.set(Arc::new(exchanger));
        Ok(())
    }

    /// A call of a `token_exchange` provider: refused before anything is sent unless its turn
    /// brought a subject token, which becomes its principal's.
    fn subject_given(&self, principal: &str) -> Result<(), Attempt> {
        let Some(ex) = self.exchanger.get() else {
            return Ok(());
        };
        let subject = relay::ROUTE
            .try_with(|r| r.subject_token.clone())
            .ok()
            .flatten();
        let Some(subject) = subject else {
            let ns = &self.config.namespace;
            return Err(Attempt::Failed(Failure::new(
                FailCode::MissingCredential,
                format!(
                    "`{ns}` ({}) takes the person's own token, exchanged (grant = \"token_exchange\"), and this turn of principal `{principal}` was opened without one: the host hands it in at turn open (`turn open --subject-token-file PATH`, or `subjectToken` in open_turn); nothing was sent to the server",
                    self.config.url.as_deref().unwrap_or_default()
                ),
            )));
        };
        ex.subjects().set(principal, &subject);
        Ok(())
    }

    /// Makes sure `principal` has signed in to this provider: when they have not, they are
    /// sent a link to their page (a URL-mode elicitation through the harness the call came
    /// from), and the call waits until they have signed in (within its own time limit). Without
    /// a harness that shows the link, or when the person declines, the call fails
    /// `sign_in_required` with the link (which carries a one-time id only).
    async fn sign_in(&self, signins: &signin::SignIns, principal: &str) -> Result<(), Attempt> {
        let ns = &self.config.namespace;
        // The wait is the call's: within its time limit (less a margin for the call itself),
        // ended with the link rather than by the limit; the sign-in goes on on the page.
        let started = tokio::time::Instant::now();
        let wait = self
            .call_timeout()
            .saturating_sub(SIGN_IN_CALL_MARGIN)
            .min(signin::SIGN_IN_LIFETIME);
        if signins.signed_in(principal, ns) {
            return Ok(());
        }
        let server = self.config.url.clone().unwrap_or_default();
        let link = signins.link(principal, ns).map_err(|e| {
            Attempt::Failed(Failure::new(
                FailCode::Internal,
                format!("the sign-in to `{ns}` could not be started: {e}"),
            ))
        })?;
        let failed = |why: &str| {
            Attempt::Failed(Failure::new(
                FailCode::SignInRequired,
                format!(
                    "principal `{principal}` has not signed in to `{ns}` ({server}): {why}; open {link} to sign in on your SharedOS page (the link is yours alone and works once, for {} s), then call again; nothing was sent to the server",
                    signin::SIGN_IN_LIFETIME.as_secs()
                ),
            ))
        };
        let route = relay::ROUTE.try_with(relay::Route::clone).ok();
        let asked = match &route {
            None => Err("the call came from no harness that could show the link".to_owned()),
            Some(route) => {
                // The link rides in `url` alone: the shim gives the question an
                // `elicitationId` of its own (never the link's one-time id).
                let params = json!({
                    "mode": "url",
                    "message": sign_in_message(principal, ns, &server, wait),
                    "url": link.as_str(),
                });
                match tokio::time::timeout(wait, (route.ask)(ns.clone(), params, true)).await {
                    Err(_) => Err("the harness did not show the link in time".to_owned()),
                    Ok(Err(why)) => Err(format!("the harness could not show the link ({why})")),
                    Ok(Ok(answer)) => match answer.get("action").and_then(Value::as_str) {
                        Some("accept") => Ok(()),
                        other => Err(format!(
                            "the person did not open the link (the harness answered `{}`)",
                            other.unwrap_or("?")
                        )),
                    },
                }
            }
        };
        self.record_as(
            "sign_in_asked",
            Some(principal),
            ProviderDetail::Reason {
                reason: match &asked {
                    Ok(()) => format!(
                        "principal `{principal}` was sent the link {link} to sign in to `{ns}`; the call waits"
                    ),
                    Err(why) => format!(
                        "principal `{principal}` has not signed in to `{ns}`; the call failed with the link {link}: {why}"
                    ),
                },
            },
        )
        .await;
        if let Err(why) = asked {
            return Err(failed(&why));
        }
        if signins
            .wait(principal, ns, wait.saturating_sub(started.elapsed()))
            .await
        {
            self.record_as(
                "signed_in",
                Some(principal),
                ProviderDetail::Reason {
                    reason: format!(
                        "principal `{principal}` signed in to `{ns}` on the person's page; the held call goes on"
                    ),
                },
            )
            .await;
            Ok(())
        } else {
            Err(failed(&format!(
                "the sign-in did not finish within the call's time limit ({} s, call_timeout_seconds less {} s); it can still be finished on the page",
                self.call_timeout().as_secs(),
                SIGN_IN_CALL_MARGIN.as_secs()
            )))
        }
    }

    /// One call on one upstream session: the provider's own, or `instance`'s.
    async fn call_on(
        &self,
        peer: &Peer<RoleClient>,
        upstream: &str,
        arguments: &Map<String, Value>,
        instance: Option<&instances::Instance>,
        trace: Option<&crate::telemetry::Outgoing>,
    ) -> Result<Success, Attempt> {
        let mut params =
            CallToolRequestParams::new(upstream.to_owned()).with_arguments(arguments.clone());
        if let Some(t) = trace {
            // The spec's OpenTelemetry keys (SEP-414): the server's spans join the trace.
            let mut meta = rmcp::model::MetaObject::new();
            meta.set_traceparent(t.traceparent.clone());
            if let Some(state) = &t.tracestate {
                meta.set_tracestate(state.clone());
            }
            params.meta = Some(meta.into());
        }
        // While it is in flight, a question the session asks may be this call's person's.
        let _entered = (self.config.elicitation == crate::config::ElicitationSetting::Forward)
            .then(|| self.in_flight.enter())
            .flatten();
        // A 2026-07-28 server asks in the call's own result (`input_required`): each round's
        // questions go to the call's person, and the call is sent again with the answers.
        let mut round = 0u32;
        let result = loop {
            let started = std::time::Instant::now();
            let response = peer
                .call_tool_once(params.clone())
                .await
                .map_err(|e| self.call_failure(&e, instance))?;
            self.remote.latency(started.elapsed());
            match response {
                CallToolResponse::Complete(r) => break r,
                CallToolResponse::InputRequired(asked) => {
                    round += 1;
                    if round > MAX_INPUT_ROUNDS {
                        return Err(Failure::new(
                            FailCode::UpstreamError,
                            format!(
                                "the upstream server of `{}` still asked for input after {MAX_INPUT_ROUNDS} rounds of `{upstream}`: the call is ended",
                                self.config.namespace
                            ),
                        )
                        .into());
                    }
                    let (responses, state) = self.answer_round(asked, round).await?;
                    params.input_responses = responses;
                    params.request_state = state;
                }
                _ => {
                    return Err(Failure::new(
                        FailCode::UpstreamError,
                        "the upstream answered with a task, which SharedOS does not broker",
                    )
                    .into());
                }
            }
        };
        let value = serde_json::to_value(&result).unwrap_or(Value::Null);
        if value.to_string().len() > MAX_UPSTREAM_RESULT_BYTES {
            return Err(Failure::new(
                FailCode::TooLarge,
                format!("the upstream's result is over {MAX_UPSTREAM_RESULT_BYTES} bytes"),
            )
            .into());
        }
        let content: Vec<Value> = value["content"].as_array().cloned().unwrap_or_default();
        if result.is_error == Some(true) {
            let first = content
                .first()
                .and_then(|c| c["text"].as_str())
                .unwrap_or("(no text)")
                .chars()
                .take(500)
                .collect::<String>();
            return Err(Failure::new(
                FailCode::UpstreamError,
                format!("the upstream server reported an error: {first}"),
            )
            .with_content(content)
            .into());
        }
        Ok(Success::content(content, result.structured_content))
    }

    /// One `input_required` round of a call (2026-07-28): each question put to the call's
    /// person in turn ([`UpstreamRequests::ask_person`], on record with the round), and what the
    /// retry carries: the answers by the server's keys and its `requestState`, echoed. A
    /// request the broker refuses (a model completion, the client's roots, a question not
    /// forwarded) ends the call: a 2026-07-28 retry has no way to say no to one request.
    async fn answer_round(
        &self,
        asked: rmcp::model::InputRequiredResult,
        round: u32,
    ) -> Result<(Option<rmcp::model::InputResponses>, Option<String>), Attempt> {
        let requests = asked.input_requests.unwrap_or_default();
        if requests.is_empty() && asked.request_state.is_none() {
            return Err(Failure::new(
                FailCode::UpstreamError,
                "the upstream answered `input_required` with neither a request nor a requestState",
            )
            .into());
        }
        if requests.len() > MAX_INPUT_REQUESTS {
            return Err(Failure::new(
                FailCode::UpstreamError,
                format!(
                    "the upstream asked {} questions in one round (at most {MAX_INPUT_REQUESTS} are put to the person): the call is ended",
                    requests.len()
                ),
            )
            .into());
        }
        let log = UpstreamRequests {
            provider: self.config.namespace.clone(),
            recorder: self.recorder.clone(),
        };
        let known = self.secrets.known.clone();
        let redact = move |text: &mut String| {
            known.redact_text("", text, &mut Default::default());
        };
        let ended = |why: String| -> Attempt {
            Failure::new(
                FailCode::UpstreamError,
                format!(
                    "the upstream server of `{}` asked for input the broker does not give: {why}",
                    self.config.namespace
                ),
            )
            .into()
        };
        let mut responses = rmcp::model::InputResponses::new();
        for (key, request) in requests {
            let value = serde_json::to_value(&request).unwrap_or_default();
            let method = value["method"].as_str().unwrap_or_default().to_owned();
            if method != "elicitation/create" {
                let (method, why) = match method.as_str() {
                    "sampling/createMessage" => (
                        "sampling/createMessage",
                        "a brokered server may not use the person's model (sampling is refused)",
                    ),
                    "roots/list" => (
                        "roots/list",
                        "the broker shows a brokered server no roots of the client (its files are the broker's to authorize)",
                    ),
                    _ => ("(unknown)", "not a request the broker answers"),
                };
                let route = relay::ROUTE.try_with(|r| r.turn.clone()).ok();
                let e = log
                    .refuse(method, None, None, None, why.into(), route, Some(round))
                    .await;
                return Err(ended(e.message.into_owned()));
            }
            let forward = (self.config.elicitation == crate::config::ElicitationSetting::Forward)
                .then(|| {
                    // The call this round belongs to is the one being served here.
                    let route = relay::ROUTE.try_with(relay::Route::clone).map_err(|_| {
                        "the call has no person to ask (it did not come from a harness)".to_owned()
                    });
                    (route, self.call_timeout().min(relay::FORWARD_WAIT))
                });
            let params = value.get("params").cloned().unwrap_or_default();
            match log.ask_person(forward, params, &redact, Some(round)).await {
                Ok(answer) => {
                    responses.insert(key, serde_json::to_value(answer).unwrap_or_default());
                }
                Err(e) => return Err(ended(e.message.into_owned())),
            }
        }
        Ok((
            (!responses.is_empty()).then_some(responses),
            asked.request_state,
        ))
    }

    /// The resource a call touches, from its template, and the arguments to send upstream when
    /// they are not the call's own (a `file_root` path, sent as what it was resolved to).
    pub fn resolve(
        &self,
        tool: &str,
        template: Option<&TemplateConfig>,
        args: &Map<String, Value>,
    ) -> Result<Requirement, String> {
        let Some(t) = template else {
            return Ok(Requirement {
                action: "call".into(),
                resource: Resource::Tool {
                    name: tool.to_owned(),
                },
                forwarded: None,
                object: None,
            });
        };
        if let Some(u) = &t.url {
            let (url, forwarded) = template::resolve_url(u, args)?;
            return Ok(Requirement {
                action: t.action.clone(),
                resource: Resource::Url(url),
                forwarded,
                object: None,
            });
        }
        if let Some(e) = &t.entity {
            return Ok(Requirement {
                action: t.action.clone(),
                resource: template::resolve_entity(e, args)?,
                forwarded: None,
                object: None,
            });
        }
        let Some(file) = &t.file else {
            return Err("the tool's template names no resource".into());
        };
        let path = fill_template(file, args)?;
        let Some(root) = &t.file_root else {
            let virtual_path = vpath::canonicalize(&path).map_err(|e| e.to_string())?;
            return Ok(Requirement {
                action: t.action.clone(),
                resource: Resource::File {
                    namespace: self.config.namespace.clone(),
                    path: virtual_path,
                },
                forwarded: None,
                object: None,
            });
        };
        let root = if root.is_absolute() {
            root.clone()
        } else {
            self.base.join(root)
        };
        let shown = || sharedos_proto::name::shown(&path);
        let root_c = vpath::canonicalize(&root.display().to_string()).map_err(|e| e.to_string())?;
        // The argument is checked against the root as configured, component by component, and
        // the rest is resolved physically beneath the root's descriptor, `..` and links as the
        // filesystem takes them: what the policy decides on is what a plain `open` of the
        // argument would reach, and the upstream is sent that, not the argument.
        if !path.starts_with('/') {
            return Err(format!("path `{}` is not absolute", shown()));
        }
        if path.contains('\0') || path.len() > vpath::MAX_PATH_BYTES {
            return Err(format!("path `{}` is not a usable path", shown()));
        }
        let mut parts = path.split('/').filter(|c| !c.is_empty() && *c != ".");
        for want in vpath::components(&root_c) {
            if parts.next() != Some(want) {
                return Err(format!(
                    "path `{}` is not under the provider's root",
                    shown()
                ));
            }
        }
        let beneath = self.root(&root_c)?;
        let resolved = beneath
            .resolve(parts)
            .map_err(|e| format!("path `{}`: {e}", shown()))?;
        // The upstream gets a host path: it must still lead where the descriptor is.
        if beneath.current_path().ok().as_deref() != Some(beneath.path()) {
            return Err(format!(
                "the provider's file_root `{root_c}` has been moved or replaced since the broker opened it"
            ));
        }
        let host = resolved
            .host_path()
            .to_str()
            .ok_or_else(|| format!("path `{}` resolves to a name that is not UTF-8", shown()))?
            .to_owned();
        let resource = Resource::File {
            namespace: self.config.namespace.clone(),
            path: resolved.virtual_path().to_owned(),
        };
        let forwarded = match template_args(file).as_slice() {
            [only] if *file == format!("{{{only}}}") => {
                if args.get(only).and_then(Value::as_str) == Some(host.as_str()) {
                    None
                } else {
                    let mut a = args.clone();
                    a.insert(only.clone(), Value::String(host));
                    Some(a)
                }
            }
            // A template with more than its path argument cannot be rewritten: the call goes on
            // only when what it names is already what it resolves to.
            _ if vpath::canonicalize(&path).ok().as_deref() == Some(host.as_str()) => None,
            _ => {
                return Err(format!(
                    "path `{}` resolves to another place through a link or `..`, and this tool's template cannot be sent that place",
                    shown()
                ));
            }
        };
        Ok(Requirement {
            action: t.action.clone(),
            resource,
            forwarded,
            object: Some(resolved.object()),
        })
    }

    /// The held-open root for a template's `file_root` (opened on first use).
    fn root(&self, root: &str) -> Result<Arc<Root>, String> {
        let mut roots = self
            .roots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = roots.get(root) {
            return Ok(r.clone());
        }
        let opened = Arc::new(
            Root::open(Path::new(root), Strategy::from_env())
                .map_err(|e| format!("the provider's file_root `{root}` cannot be opened: {e}"))?,
        );
        roots.insert(root.to_owned(), opened.clone());
        Ok(opened)
    }
}

/// Registers an upstream's tool list as `<namespace>.<upstream name>`: a name that is not a valid
/// ToolName, or that another registration already has, or that the upstream lists more than once
/// (every copy: which one a call meant cannot be known), is rejected with its reason (never
/// renamed, never merged).
pub fn register(
    provider: &Arc<McpProvider>,
    tools: &[Value],
) -> (Vec<Arc<Registered>>, Vec<Rejected>) {
    let ns = provider.config.namespace.clone();
    let name_of = |t: &Value| t["name"].as_str().unwrap_or_default().to_owned();
    let mut listed: HashMap<String, usize> = HashMap::new();
    for t in tools {
        *listed.entry(name_of(t)).or_default() += 1;
    }
    let mut registered = Vec::new();
    let mut rejected = Vec::new();
    for t in tools {
        let upstream = name_of(t);
        let copies = listed.get(&upstream).copied().unwrap_or(0);
        if copies > 1 {
            rejected.push(Rejected {
                upstream,
                reason: format!("listed {copies} times by this upstream; no copy is registered"),
            });
            continue;
        }
        let name = match ToolName::new(&format!("{ns}.{upstream}")) {
            Ok(n) => n,
            Err(e) => {
                rejected.push(Rejected {
                    upstream,
                    reason: e.to_string(),
                });
                continue;
            }
        };
        // A schema the broker cannot compile would let every call through unchecked: such a
        // tool is not published (before its name is claimed, so the name stays free).
        let input_schema = t.get("inputSchema").cloned();
        let validator = match input_schema.as_ref().map(jsonschema::validator_for) {
            None => None,
            Some(Ok(v)) => Some(v),
            Some(Err(e)) => {
                rejected.push(Rejected {
                    upstream,
                    reason: format!(
                        "its inputSchema is not a JSON Schema the broker can check: {e}"
                    ),
                });
                continue;
            }
        };
        if let Err(owner) = provider.names.claim(name.as_str(), &ns) {
            rejected.push(Rejected {
                upstream,
                reason: format!("`{name}` is already registered by provider `{owner}`; registrations are never merged"),
            });
            continue;
        }
        registered.push(Arc::new(ToolDefinition {
            name,
            description: t
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_owned),
            input_schema,
            output_schema: t.get("outputSchema").cloned(),
            annotations: t.get("annotations").cloned(),
            metadata: Some(ToolMetadata {
                namespace: Some(ns.clone()),
                source: Some(format!("mcp:{ns}")),
            }),
            authority: Authority::new(
                Arc::new(McpHandler {
                    namespace: ns.clone(),
                    provider: Arc::downgrade(provider),
                    upstream: upstream.clone(),
                    template: provider.config.tools.get(&upstream).cloned(),
                    read_only: t
                        .get("annotations")
                        .and_then(|a| a.get("readOnlyHint"))
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                }),
                validator,
            ),
        }));
    }
    (registered, rejected)
}

impl Provider for McpProvider {
    fn namespace(&self) -> &str {
        &self.config.namespace
    }

    fn tools_for(&self, context: &AccessContext) -> Vec<Arc<Registered>> {
        self.tools_in_scope(&context.principal, context.agent.as_deref())
    }

    fn status(&self) -> Value {
        json!(McpProvider::status(self))
    }

    fn call_timeout(&self) -> Duration {
        McpProvider::call_timeout(self)
    }

    fn upstream_hash(&self) -> Option<String> {
        McpProvider::upstream_hash(self)
    }

    fn repin(self: Arc<Self>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move { McpProvider::repin(&self).await })
    }

    fn listed(&self) -> Option<Vec<Arc<Registered>>> {
        let inner = self.read();
        (inner.state == State::Ready).then(|| inner.tools.clone())
    }
}

impl ToolHandler for McpHandler {
    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn kind(&self) -> &'static str {
        "mcp"
    }

    fn shape(&self) -> (&str, &str) {
        match &self.template {
            Some(t) => (t.action.as_str(), t.resource_type()),
            None => ("call", "Tool"),
        }
    }

    /// Every brokered tool not annotated `readOnlyHint: true` (MCP's default is "may change
    /// state").
    fn changes_state(&self, annotations: Option<&Value>) -> bool {
        !annotations
            .and_then(|a| a.get("readOnlyHint"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// A brokered tool whose upstream drifted after this catalogue was made: the turn still
    /// holds the registration, but its upstream no longer lists what was published.
    fn unavailable(&self) -> Option<Failure> {
        let why = self.provider.upgrade().and_then(|p| p.drift())?;
        Some(Failure::new(FailCode::ProviderDrifted, why))
    }

    fn resolve(&self, tool: &str, arguments: &Map<String, Value>) -> Result<Resolution, String> {
        let provider = self
            .provider
            .upgrade()
            .ok_or_else(|| "the provider is gone".to_owned())?;
        let r = provider.resolve(tool, self.template.as_ref(), arguments)?;
        Ok(Resolution {
            action: r.action,
            resource: r.resource,
            forwarded: r.forwarded,
            object: r.object,
            detail: None,
        })
    }

    fn execute(&self, resolution: Resolution, arguments: Map<String, Value>, env: CallEnv) -> Job {
        let provider = self.provider.upgrade();
        let upstream = self.upstream.clone();
        let arguments = resolution.forwarded.unwrap_or(arguments);
        let read_only = self.read_only;
        Box::pin(async move {
            match provider {
                Some(p) => {
                    p.call(
                        &env.principal,
                        &upstream,
                        &arguments,
                        read_only,
                        env.trace.as_ref(),
                    )
                    .await
                }
                None => Err(Failure::new(
                    FailCode::UpstreamUnavailable,
                    "the provider is gone",
                )),
            }
        })
    }

    fn timeout(&self, default: Duration) -> Duration {
        self.provider
            .upgrade()
            .map_or(default, |p| McpProvider::call_timeout(&p))
    }
}

/// What the person is told when SharedOS asks them to sign in to remote server `ns` at
/// `server`: SharedOS asks (not the server), for which principal, which server (its namespace
/// and host), that the link opens the person's own page, and how long the call waits. The link
/// itself is never in the text (it is the question's `url`).
fn sign_in_message(principal: &str, ns: &str, server: &str, wait: Duration) -> String {
    let host = url::Url::parse(server)
        .ok()
        .and_then(|u| {
            u.host_str().map(|h| {
                u.port()
                    .map_or_else(|| h.to_owned(), |p| format!("{h}:{p}"))
            })
        })
        .unwrap_or_else(|| "?".to_owned());
    format!(
        "SharedOS asks you, `{principal}`, to sign in to the remote MCP server `{ns}` ({host}), so that the agent's calls to it are made with your own access. The link opens your own SharedOS page (sign in there as `{principal}`), which sends you on to the server's sign-in; nothing you type there passes through the agent. The call waits until you have signed in (at most {} s).",
        wait.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sign-in question says SharedOS asks, whom, which server (namespace and host), that
    /// the link opens the person's own page; the link is not in it.
    #[test]
    fn the_sign_in_question_says_who_asks_and_where() {
        let m = sign_in_message(
            "alice",
            "gh",
            "https://mcp.example.com/mcp",
            Duration::from_secs(295),
        );
        assert!(
            m.starts_with("SharedOS asks you, `alice`, to sign in to the remote MCP server `gh` (mcp.example.com)"),
            "{m}"
        );
        assert!(m.contains("opens your own SharedOS page"), "{m}");
        assert!(m.contains("at most 295 s"), "{m}");
        assert!(!m.contains("http"), "{m}");
        assert!(
            sign_in_message("a", "r", "http://127.0.0.1:8080/mcp", Duration::ZERO)
                .contains("`r` (127.0.0.1:8080)")
        );
    }

    #[test]
    fn scopes() {
        let s = Scope {
            principal: Some("alice".into()),
            agent: None,
        };
        assert!(s.matches("alice", None));
        assert!(s.matches("alice", Some("x")));
        assert!(!s.matches("bob", None));
        let s = Scope {
            principal: None,
            agent: Some("helper".into()),
        };
        assert!(!s.matches("alice", None));
        assert!(s.matches("bob", Some("helper")));
    }

    /// A provider of namespace `gh` (never started) sharing `names`, recording in `dir`.
    fn provider_gh(dir: &Path, names: &Arc<Names>) -> Arc<McpProvider> {
        let (recorder, _) = Recorder::open(
            &dir.join("r.jsonl"),
            crate::evidence::record::RecordSync::Batch,
        )
        .expect("rec");
        let config: McpProviderConfig =
            toml::from_str("namespace = \"gh\"\ncommand = \"x\"").expect("cfg");
        McpProvider::new(
            config,
            dir.to_path_buf(),
            names.clone(),
            Arc::new(Pins::load(None, None).expect("pins")),
            Arc::new(AtomicU64::new(0)),
            recorder,
            Duration::from_secs(1),
            CancellationToken::new(),
            Secrets::folder(dir.join("secrets")),
            None,
            None,
        )
    }

    #[tokio::test]
    async fn registration_rejects_bad_and_taken_names_with_a_reason() {
        let dir = tempfile::tempdir().expect("tmp");
        let names = Arc::new(Names::default());
        names.claim("gh.read", "files-gh").expect("claim");
        let p = provider_gh(dir.path(), &names);
        let tools = vec![
            json!({"name": "search", "inputSchema": {"type": "object"}}),
            json!({"name": "read", "inputSchema": {"type": "object"}}),
            json!({"name": "list files", "inputSchema": {"type": "object"}}),
            json!({"name": "odd", "inputSchema": {"type": "no-such-type"}}),
        ];
        let (ok, rejected) = register(&p, &tools);
        assert_eq!(
            ok.iter().map(|t| t.name.to_string()).collect::<Vec<_>>(),
            ["gh.search"]
        );
        // The schema that does not compile leaves its name unclaimed.
        assert!(names.claim("gh.odd", "other").is_ok());
        assert_eq!(
            ok[0]
                .metadata
                .as_ref()
                .and_then(|m| m.source.clone())
                .as_deref(),
            Some("mcp:gh")
        );
        assert_eq!(rejected.len(), 3);
        assert!(
            rejected[2].upstream == "odd" && rejected[2].reason.contains("inputSchema"),
            "{:?}",
            rejected[2]
        );
        assert!(
            rejected[0]
                .reason
                .contains("already registered by provider `files-gh`"),
            "{:?}",
            rejected[0]
        );
        assert!(
            rejected[1].reason.contains("list files"),
            "{:?}",
            rejected[1]
        );
    }

    #[tokio::test]
    async fn a_name_listed_twice_by_one_upstream_is_rejected_in_every_copy() {
        let dir = tempfile::tempdir().expect("tmp");
        let names = Arc::new(Names::default());
        let p = provider_gh(dir.path(), &names);
        let tools = vec![
            json!({"name": "dup", "inputSchema": {"type": "object", "properties": {"a": {"type": "string"}}}}),
            json!({"name": "ok", "inputSchema": {"type": "object"}}),
            json!({"name": "dup", "inputSchema": {"type": "object", "properties": {"b": {"type": "number"}}}}),
            json!({"name": "dup", "inputSchema": {"type": "object"}}),
        ];
        let (ok, rejected) = register(&p, &tools);
        assert_eq!(
            ok.iter().map(|t| t.name.to_string()).collect::<Vec<_>>(),
            ["gh.ok"]
        );
        assert_eq!(rejected.len(), 3, "{rejected:?}");
        for r in &rejected {
            assert_eq!(r.upstream, "dup");
            assert_eq!(
                r.reason,
                "listed 3 times by this upstream; no copy is registered"
            );
        }
        // No copy claimed the name.
        assert!(names.claim("gh.dup", "other").is_ok());
    }

    #[test]
    fn names_are_never_merged() {
        let n = Names::default();
        assert!(n.claim("a.search", "a").is_ok());
        assert_eq!(n.claim("a.search", "b"), Err("a".into()));
        n.release_all("a");
        assert!(n.claim("a.search", "b").is_ok());
    }
}
