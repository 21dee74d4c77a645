//! The scripted model provider: SharedOS in the model provider's seat, so that real harness CLIs
//! (Claude Code, Codex, pi, Qwen Code, opencode, Gemini CLI) run offline, against a script
//! instead of a model.
//!
//! Owns a small loopback HTTP server (`sharedos-broker scripted-model`) that speaks just enough of
//! three wire APIs, streamed as SSE when the request asks for `"stream": true` and as plain JSON
//! otherwise:
//! - Anthropic Messages: `POST /v1/messages` (+ a `count_tokens` stub), for Claude Code;
//! - OpenAI Responses: `POST /v1/responses`, for Codex (MCP tools offered as a `namespace`);
//! - Chat Completions: `POST /v1/chat/completions`, for pi, Qwen Code and opencode;
//! - Gemini API: `POST /v1beta/models/MODEL:generateContent` and `:streamGenerateContent`
//!   (`?alt=sse` streams), with function calls, for Gemini CLI (+ a `:countTokens` stub).
//!
//! plus `GET /v1/models` in a shape both SDK families accept. Any other path is answered 404 and
//! logged.
//!
//! A reply is chosen statelessly, from the request alone: the tool results already in the
//! conversation are counted (Anthropic `tool_result` blocks, Responses `*_output` items, chat
//! `role: tool` messages); N results play step N (0-based) of the [`Script`], and once the steps
//! are used up the script's final text is sent. A step names a canonical tool (`files.read`),
//! which is mapped to the name the harness offered by its normalized alphanumeric suffix (see
//! [`match_tool`]); a step whose tool was not offered is answered with plain text saying so.
//!
//! The optional log (JSON Lines, appended, one flushed line at a time) is how tests see what the
//! model saw: one `request` line per model request and one `tool_result` line per tool result the
//! first time it appears (deduplicated by call id). Namespaced tools (Codex) are shown as
//! `namespace/name` in the log. `column run --model-log` reads the `request` lines back
//! ([`LoggedRequest`]) to see what the harness offered its model and the model it asked for.
//!
//! Must never: listen on anything but a loopback address, reach the network, keep conversation
//! state (the log's dedupe set is the only memory), or touch the broker's kernel, turns or record.
//! It is a test fixture with no authority.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::lock;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Largest request body accepted (long conversations with big tool lists).
pub const MAX_BODY: usize = 64 * 1024 * 1024;
/// Characters of a tool result's text kept in the log.
pub const LOGGED_TEXT_CHARS: usize = 2000;
/// The model named in replies when the request names none, and listed by `GET /v1/models`.
pub const DEFAULT_MODEL: &str = "sharedos-scripted";

#[derive(Debug, thiserror::Error)]
pub enum ScriptedModelError {
    #[error(
        "refusing to listen on `{0}`: the scripted model listens on loopback only (e.g. `127.0.0.1:0`)"
    )]
    NotLoopback(SocketAddr),
    #[error("cannot listen on `{addr}`")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot read script `{path}`")]
    ReadScript {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("script `{path}` is not a valid script")]
    ParseScript {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot open log `{path}`")]
    OpenLog {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write to stdout: {0}")]
    Stdout(std::io::Error),
    #[error("cannot wait for signals: {0}")]
    Signal(std::io::Error),
    #[error("the server failed: {0}")]
    Serve(std::io::Error),
}

/// What the scripted model does, turn after turn.
///
/// ```json
/// {"steps": [{"tool": "files.read", "arguments": {"path": "/public/hello.txt"}}],
///  "final": "All attempts made."}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// Tool calls, one per model turn, in order.
    #[serde(default)]
    pub steps: Vec<Step>,
    /// The text sent once every step has its result.
    #[serde(rename = "final", default = "default_final")]
    pub final_text: String,
}

/// One scripted tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// The canonical tool name, e.g. `files.read`; matched against the offered names.
    pub tool: String,
    /// The call's arguments (a JSON object).
    #[serde(default)]
    pub arguments: Map<String, Value>,
    /// Milliseconds the model "thinks" before answering with this call: the reply waits that
    /// long (e.g. so that a column can close the turn between the previous call and this one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
}

fn default_final() -> String {
    "Done.".to_owned()
}

impl Script {
    /// Parses a script from JSON text.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Reads and parses a script file.
    pub fn from_file(path: &Path) -> Result<Self, ScriptedModelError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ScriptedModelError::ReadScript {
                path: path.to_owned(),
                source,
            })?;
        Self::from_json(&text).map_err(|source| ScriptedModelError::ParseScript {
            path: path.to_owned(),
            source,
        })
    }
}

/// Binds a listener for [`serve`]; anything but a loopback address is refused.
pub async fn bind(listen: SocketAddr) -> Result<TcpListener, ScriptedModelError> {
    if !listen.ip().is_loopback() {
        return Err(ScriptedModelError::NotLoopback(listen));
    }
    TcpListener::bind(listen)
        .await
        .map_err(|source| ScriptedModelError::Bind {
            addr: listen,
            source,
        })
}

/// Serves the script on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    script: Script,
    log: Option<PathBuf>,
    shutdown: CancellationToken,
) -> Result<(), ScriptedModelError> {
    let log = log.as_deref().map(Log::open).transpose()?;
    let shared = Arc::new(Shared { script, log });
    let app = Router::new()
        .route("/v1/messages", post(anthropic))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1beta/models/{*rest}", post(gemini))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(shared);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(ScriptedModelError::Serve)
}

/// `sharedos-broker scripted-model`: binds, prints `listening on http://ADDR` as the first stdout
/// line, and serves until SIGINT or SIGTERM.
pub async fn run(
    listen: SocketAddr,
    script: &Path,
    log: Option<PathBuf>,
) -> Result<(), ScriptedModelError> {
    let script = Script::from_file(script)?;
    if let Some(path) = &log {
        // Fail before announcing the address, not after.
        Log::open(path)?;
    }
    let listener = bind(listen).await?;
    let addr = listener
        .local_addr()
        .map_err(|source| ScriptedModelError::Bind {
            addr: listen,
            source,
        })?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{addr}")
            .and_then(|()| out.flush())
            .map_err(ScriptedModelError::Stdout)?;
    }
    let shutdown = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(ScriptedModelError::Signal)?;
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        on_signal.cancel();
    });
    serve(listener, script, log, shutdown).await
}

/// A tool the harness offered the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferedTool {
    /// Codex's MCP namespace (`mcp__sharedos`), else `None`.
    pub namespace: Option<String>,
    pub name: String,
}

impl OfferedTool {
    /// The name as shown in the log: `name`, or `namespace/name`.
    pub fn display(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.name),
            None => self.name.clone(),
        }
    }

    /// The tool shown as `shown` in a log line of `api`: `namespace/name` for Responses (whose
    /// function names cannot hold a `/`), else a flat name.
    pub fn from_display(api: &str, shown: &str) -> Self {
        match shown.split_once('/') {
            Some((ns, name)) if api == Api::Responses.as_str() => OfferedTool {
                namespace: Some(ns.to_owned()),
                name: name.to_owned(),
            },
            _ => OfferedTool {
                namespace: None,
                name: shown.to_owned(),
            },
        }
    }

    fn normalized(&self) -> String {
        let mut s = self.namespace.as_deref().map(normalize).unwrap_or_default();
        s.push_str(&normalize(strip_hash_suffix(&self.name)));
        s
    }
}

/// One model request as the log has it: what the harness offered its model and the model it
/// asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedRequest {
    /// `anthropic`, `responses`, `chat` or `gemini`.
    pub api: String,
    pub model: Option<String>,
    pub offered: Vec<OfferedTool>,
}

impl LoggedRequest {
    /// A `request` line of the log, else `None` (tool results, 404s, bad requests).
    pub fn from_log_line(line: &Value) -> Option<Self> {
        if line.get("kind").and_then(Value::as_str) != Some("request") {
            return None;
        }
        let api = line.get("api").and_then(Value::as_str)?.to_owned();
        let offered = array(line.get("offered"))
            .iter()
            .filter_map(Value::as_str)
            .map(|shown| OfferedTool::from_display(&api, shown))
            .collect();
        Some(LoggedRequest {
            model: string(line.get("model")),
            offered,
            api,
        })
    }
}

/// Lowercase ASCII letters and digits only: `mcp__sharedos__files_read` → `mcpsharedosfilesread`.
pub fn normalize(name: &str) -> String {
    name.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// The length of the hash suffix Qwen Code adds to a name it had to rewrite (`_` + 7 base-36
/// digits, `mcp__sharedos__files_read_1rtbejb`).
const HASH_SUFFIX_DIGITS: usize = 7;

/// The length of the hash suffix Cline adds to a name it had to rewrite (`_` + the first 8 hex
/// digits of a SHA-1, `sharedos__files_read_5f40265d`).
const CLINE_HASH_DIGITS: usize = 8;

/// `name` without a Qwen Code hash suffix (`_` + [`HASH_SUFFIX_DIGITS`] lowercase base-36 digits
/// with at least one digit) or a Cline one (`_` + [`CLINE_HASH_DIGITS`] lowercase hex digits),
/// else `name` unchanged.
fn strip_hash_suffix(name: &str) -> &str {
    let strip = |len: usize, digit: fn(char) -> bool| -> Option<&str> {
        let n = name.len();
        if n <= len + 1 || !name.is_ascii() {
            return None;
        }
        let (head, tail) = name.split_at(n - len - 1);
        let digits = &tail[1..];
        (tail.starts_with('_')
            && digits.chars().all(digit)
            && digits.chars().any(|c| c.is_ascii_digit()))
        .then_some(head)
    };
    strip(HASH_SUFFIX_DIGITS, |c| {
        c.is_ascii_digit() || c.is_ascii_lowercase()
    })
    .or_else(|| strip(CLINE_HASH_DIGITS, |c| matches!(c, '0'..='9' | 'a'..='f')))
    .unwrap_or(name)
}

/// The offered tool whose normalized (namespace and) name, less a Qwen Code hash suffix, ends
/// with the normalized canonical name; among several, the shortest (so an exact match wins), then the first offered.
pub fn match_tool<'a>(canonical: &str, offered: &'a [OfferedTool]) -> Option<&'a OfferedTool> {
    let want = normalize(canonical);
    if want.is_empty() {
        return None;
    }
    offered
        .iter()
        .map(|t| (t, t.normalized()))
        .filter(|(_, n)| n.ends_with(&want))
        .min_by_key(|(_, n)| n.len())
        .map(|(t, _)| t)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Anthropic,
    Responses,
    Chat,
    Gemini,
}

impl Api {
    fn as_str(self) -> &'static str {
        match self {
            Api::Anthropic => "anthropic",
            Api::Responses => "responses",
            Api::Chat => "chat",
            Api::Gemini => "gemini",
        }
    }
}

/// A tool result found in a request.
#[derive(Debug, Clone, PartialEq)]
struct ToolResult {
    call_id: Option<String>,
    /// Anthropic's `is_error` (absent means false); Responses and chat have no flag.
    is_error: Option<bool>,
    text: String,
}

/// What a request tells: everything the reply depends on.
#[derive(Debug, Default)]
struct Conversation {
    model: Option<String>,
    stream: bool,
    offered: Vec<OfferedTool>,
    results: Vec<ToolResult>,
}

impl Conversation {
    fn read(api: Api, body: &Value) -> Self {
        let mut c = Conversation {
            model: body.get("model").and_then(Value::as_str).map(str::to_owned),
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            ..Default::default()
        };
        let tools = array(body.get("tools"));
        match api {
            Api::Anthropic => {
                c.offered = tools.iter().filter_map(flat_tool("name")).collect();
                for message in array(body.get("messages")) {
                    if message.get("role").and_then(Value::as_str) != Some("user") {
                        continue;
                    }
                    for block in array(message.get("content")) {
                        if block.get("type").and_then(Value::as_str) == Some("tool_result") {
                            c.results.push(ToolResult {
                                call_id: string(block.get("tool_use_id")),
                                is_error: Some(
                                    block
                                        .get("is_error")
                                        .and_then(Value::as_bool)
                                        .unwrap_or(false),
                                ),
                                text: content_text(block.get("content")),
                            });
                        }
                    }
                }
            }
            Api::Responses => {
                for tool in tools {
                    match tool.get("type").and_then(Value::as_str) {
                        Some("function") => c.offered.extend(flat_tool("name")(tool)),
                        // Codex's freeform tools (`apply_patch`) and the built-in ones a model
                        // is offered by type (`web_search`, `local_shell`): tools the harness
                        // offered too, shown by name, else by type.
                        Some(kind) if kind != "namespace" => {
                            c.offered
                                .extend(flat_tool("name")(tool).or(Some(OfferedTool {
                                    namespace: None,
                                    name: kind.to_owned(),
                                })));
                        }
                        Some("namespace") => {
                            let Some(ns) = tool.get("name").and_then(Value::as_str) else {
                                continue;
                            };
                            c.offered
                                .extend(array(tool.get("tools")).iter().filter_map(|t| {
                                    let is_function = matches!(
                                        t.get("type").and_then(Value::as_str),
                                        None | Some("function")
                                    );
                                    let name = t.get("name").and_then(Value::as_str)?;
                                    is_function.then(|| OfferedTool {
                                        namespace: Some(ns.to_owned()),
                                        name: name.to_owned(),
                                    })
                                }));
                        }
                        _ => {}
                    }
                }
                for item in array(body.get("input")) {
                    let is_output = item
                        .get("type")
                        .and_then(Value::as_str)
                        .is_some_and(|t| t.ends_with("_output"));
                    if is_output {
                        c.results.push(ToolResult {
                            call_id: string(item.get("call_id")),
                            is_error: None,
                            text: content_text(item.get("output")),
                        });
                    }
                }
            }
            Api::Gemini => {
                c.offered = tools
                    .iter()
                    .flat_map(|t| array(t.get("functionDeclarations")).iter())
                    .filter_map(flat_tool("name"))
                    .collect();
                for content in array(body.get("contents")) {
                    for part in array(content.get("parts")) {
                        if let Some(r) = part.get("functionResponse") {
                            c.results.push(ToolResult {
                                call_id: string(r.get("id")),
                                is_error: None,
                                text: gemini_response_text(r.get("response")),
                            });
                        }
                    }
                }
            }
            Api::Chat => {
                c.offered = tools
                    .iter()
                    .filter_map(|t| t.get("function").and_then(flat_tool("name")))
                    .collect();
                for message in array(body.get("messages")) {
                    if message.get("role").and_then(Value::as_str) == Some("tool") {
                        c.results.push(ToolResult {
                            call_id: string(message.get("tool_call_id")),
                            is_error: None,
                            text: content_text(message.get("content")),
                        });
                    }
                }
            }
        }
        c
    }
}

fn array(v: Option<&Value>) -> &[Value] {
    v.and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

fn flat_tool(key: &'static str) -> impl Fn(&Value) -> Option<OfferedTool> {
    move |t| {
        t.get(key).and_then(Value::as_str).map(|name| OfferedTool {
            namespace: None,
            name: name.to_owned(),
        })
    }
}

/// The text of a Gemini `functionResponse.response`: its `output` (or `error`, or `content`)
/// string when it has one, else the object as JSON.
fn gemini_response_text(v: Option<&Value>) -> String {
    for key in ["output", "error", "content"] {
        if let Some(inner) = v.and_then(|r| r.get(key))
            && !inner.is_null()
        {
            return content_text(Some(inner));
        }
    }
    content_text(v)
}

/// The text of a tool result's content: a string, or the `text` of each part, one per line.
fn content_text(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.clone()),
                _ => p.get("text").and_then(Value::as_str).map(str::to_owned),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Some(Value::Object(o)) => match o.get("text").and_then(Value::as_str) {
            Some(s) => s.to_owned(),
            None => Value::Object(o.clone()).to_string(),
        },
        Some(other) => other.to_string(),
    }
}

/// What the model says this turn.
#[derive(Debug, Clone, PartialEq)]
enum Reply {
    ToolCall {
        step: usize,
        tool: OfferedTool,
        arguments: Map<String, Value>,
        call_id: String,
    },
    Text {
        text: String,
        /// The step's canonical tool name when the reply is text because it was not offered.
        not_offered: Option<String>,
    },
}

fn decide(script: &Script, api: Api, conversation: &Conversation) -> Reply {
    let n = conversation.results.len();
    let Some(step) = script.steps.get(n) else {
        return Reply::Text {
            text: script.final_text.clone(),
            not_offered: None,
        };
    };
    match match_tool(&step.tool, &conversation.offered) {
        Some(tool) => {
            let prefix = match api {
                Api::Anthropic => "toolu",
                Api::Responses | Api::Chat | Api::Gemini => "call",
            };
            Reply::ToolCall {
                step: n,
                tool: tool.clone(),
                arguments: step.arguments.clone(),
                call_id: format!("{prefix}_{n}_{}", random_hex()),
            }
        }
        None => {
            let offered: Vec<String> = conversation.offered.iter().map(|t| t.display()).collect();
            Reply::Text {
                text: format!(
                    "scripted model: step {n} calls `{}`, but no offered tool matches it (offered: {})",
                    step.tool,
                    if offered.is_empty() {
                        "none".to_owned()
                    } else {
                        offered.join(", ")
                    }
                ),
                not_offered: Some(step.tool.clone()),
            }
        }
    }
}

/// 16 hex digits from the OS's randomness; falls back to the clock (ids need only be unique).
fn random_hex() -> String {
    let mut buf = [0u8; 8];
    if getrandom::fill(&mut buf).is_err() {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        buf = (nanos as u64).to_le_bytes();
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

struct Shared {
    script: Script,
    log: Option<Log>,
}

/// The JSON Lines log and the call ids of the tool results already in it.
struct Log {
    path: PathBuf,
    file: Mutex<File>,
    seen: Mutex<HashSet<String>>,
}

impl Log {
    fn open(path: &Path) -> Result<Self, ScriptedModelError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| ScriptedModelError::OpenLog {
                path: path.to_owned(),
                source,
            })?;
        Ok(Log {
            path: path.to_owned(),
            file: Mutex::new(file),
            seen: Mutex::new(HashSet::new()),
        })
    }

    fn write(&self, line: &Value) {
        let mut text = line.to_string();
        text.push('\n');
        let mut file = lock(&self.file);
        if let Err(e) = file.write_all(text.as_bytes()).and_then(|()| file.flush()) {
            tracing::warn!(
                "cannot write to the scripted model log `{}`: {e}",
                self.path.display()
            );
        }
    }

    fn tool_results(&self, api: Api, results: &[ToolResult]) {
        for (i, r) in results.iter().enumerate() {
            let key = match &r.call_id {
                Some(id) => format!("{}:{id}", api.as_str()),
                None => format!("{}:#{i}", api.as_str()),
            };
            if !lock(&self.seen).insert(key) {
                continue;
            }
            self.write(&json!({
                "kind": "tool_result",
                "api": api.as_str(),
                "callId": r.call_id,
                "isError": r.is_error,
                "text": r.text.chars().take(LOGGED_TEXT_CHARS).collect::<String>(),
            }));
        }
    }
}

impl Shared {
    fn log(&self, line: &Value) {
        if let Some(log) = &self.log {
            log.write(line);
        }
    }
}

async fn anthropic(State(s): State<Arc<Shared>>, uri: Uri, body: Bytes) -> Response {
    turn(&s, Api::Anthropic, &uri, &body).await
}

async fn responses(State(s): State<Arc<Shared>>, uri: Uri, body: Bytes) -> Response {
    turn(&s, Api::Responses, &uri, &body).await
}

async fn chat(State(s): State<Arc<Shared>>, uri: Uri, body: Bytes) -> Response {
    turn(&s, Api::Chat, &uri, &body).await
}

/// Waits the step's `delay_ms` before a reply that plays it.
async fn think(script: &Script, reply: &Reply) {
    if let Reply::ToolCall { step, .. } = reply
        && let Some(ms) = script.steps.get(*step).and_then(|s| s.delay_ms)
    {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}

/// `POST /v1beta/models/MODEL:METHOD`: `generateContent`, `streamGenerateContent` (SSE when
/// `alt=sse`, else a JSON array of one chunk) and a `countTokens` stub.
async fn gemini(State(s): State<Arc<Shared>>, uri: Uri, body: Bytes) -> Response {
    let rest = uri
        .path()
        .strip_prefix("/v1beta/models/")
        .unwrap_or_default();
    let Some((model, method)) = rest.rsplit_once(':') else {
        return not_found(State(s), Method::POST, uri).await;
    };
    match method {
        "countTokens" => json_response(
            StatusCode::OK,
            &json!({"totalTokens": estimate_tokens(body.len())}),
        ),
        "generateContent" | "streamGenerateContent" => {
            let sse = uri
                .query()
                .is_some_and(|q| q.split('&').any(|kv| kv == "alt=sse"));
            let mode = match (method, sse) {
                ("generateContent", _) => GeminiMode::Json,
                (_, true) => GeminiMode::Sse,
                (_, false) => GeminiMode::JsonArray,
            };
            gemini_turn(&s, &uri, &body, model, mode).await
        }
        _ => not_found(State(s), Method::POST, uri).await,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GeminiMode {
    Json,
    JsonArray,
    Sse,
}

async fn count_tokens(body: Bytes) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"input_tokens": estimate_tokens(body.len())}),
    )
}

async fn models() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": DEFAULT_MODEL,
                "object": "model",
                "type": "model",
                "created": 0,
                "created_at": "1970-01-01T00:00:00Z",
                "owned_by": "sharedos",
                "display_name": "SharedOS scripted model",
            }],
            "has_more": false,
            "first_id": DEFAULT_MODEL,
            "last_id": DEFAULT_MODEL,
        }),
    )
}

async fn not_found(State(s): State<Arc<Shared>>, method: Method, uri: Uri) -> Response {
    tracing::warn!("scripted model: no route for {method} `{uri}`");
    s.log(&json!({"kind": "not_found", "method": method.as_str(), "path": uri.to_string()}));
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"error": {"type": "not_found_error", "message": format!("no route for {method} `{uri}`")}}),
    )
}

fn estimate_tokens(bytes: usize) -> u64 {
    (bytes / 4).max(1) as u64
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn sse_response(body: String) -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn error_response(api: Api, status: StatusCode, message: String) -> Response {
    let body = match api {
        Api::Anthropic => {
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
        }
        Api::Responses | Api::Chat => {
            json!({"error": {"type": "invalid_request_error", "message": message, "code": null, "param": null}})
        }
        Api::Gemini => {
            json!({"error": {"code": status.as_u16(), "message": message, "status": "INVALID_ARGUMENT"}})
        }
    };
    json_response(status, &body)
}

/// One Gemini model request: the model comes from the path, streaming from the method.
async fn gemini_turn(
    s: &Shared,
    uri: &Uri,
    body: &[u8],
    model: &str,
    mode: GeminiMode,
) -> Response {
    let (conversation, reply) = match understand(s, Api::Gemini, uri, body, |c| {
        c.model = Some(model.to_owned());
        c.stream = mode != GeminiMode::Json;
    }) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    think(&s.script, &reply).await;
    let usage = Usage {
        input: estimate_tokens(body.len()),
        output: estimate_tokens(reply_len(&reply)),
    };
    let model = conversation.model.as_deref().unwrap_or(DEFAULT_MODEL);
    let chunk = gemini_response(model, &reply, usage);
    match mode {
        GeminiMode::Json => json_response(StatusCode::OK, &chunk),
        GeminiMode::JsonArray => json_response(StatusCode::OK, &json!([chunk])),
        GeminiMode::Sse => {
            let mut out = String::new();
            push_data(&mut out, &chunk.to_string());
            sse_response(out)
        }
    }
}

/// Reads a request, logs it and its tool results, and decides the reply (or answers 400).
fn understand(
    s: &Shared,
    api: Api,
    uri: &Uri,
    body: &[u8],
    adjust: impl FnOnce(&mut Conversation),
) -> Result<(Conversation, Reply), Box<Response>> {
    let value: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        other => {
            let message = match other {
                Err(e) => format!("the body is not JSON: {e}"),
                Ok(_) => "the body is not a JSON object".to_owned(),
            };
            return Err(Box::new(bad_request(s, api, uri, message)));
        }
    };
    let mut conversation = Conversation::read(api, &value);
    adjust(&mut conversation);
    if let Some(log) = &s.log {
        log.tool_results(api, &conversation.results);
    }
    let reply = decide(&s.script, api, &conversation);
    let (kind, tool, step, not_offered) = match &reply {
        Reply::ToolCall { tool, step, .. } => {
            ("tool_call", Some(tool.display()), Some(*step), None)
        }
        Reply::Text { not_offered, .. } => ("text", None, None, not_offered.clone()),
    };
    if let Some(missing) = &not_offered {
        tracing::warn!(
            "scripted model: step calls `{missing}`, which the {} request did not offer",
            api.as_str()
        );
    }
    s.log(&json!({
        "kind": "request",
        "api": api.as_str(),
        "path": uri.path(),
        "model": conversation.model,
        "stream": conversation.stream,
        "offered": conversation.offered.iter().map(OfferedTool::display).collect::<Vec<_>>(),
        "toolResults": conversation.results.len(),
        "reply": kind,
        "tool": tool,
        "step": step,
        "notOffered": not_offered,
    }));
    Ok((conversation, reply))
}

/// One model request: read it, log it, answer it.
async fn turn(s: &Shared, api: Api, uri: &Uri, body: &[u8]) -> Response {
    let (conversation, reply) = match understand(s, api, uri, body, |_| {}) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    think(&s.script, &reply).await;
    let model = conversation
        .model
        .clone()
        .unwrap_or_else(|| DEFAULT_MODEL.to_owned());
    let usage = Usage {
        input: estimate_tokens(body.len()),
        output: estimate_tokens(reply_len(&reply)),
    };
    match (api, conversation.stream) {
        (Api::Anthropic, true) => sse_response(anthropic_sse(&model, &reply, usage)),
        (Api::Anthropic, false) => {
            json_response(StatusCode::OK, &anthropic_message(&model, &reply, usage))
        }
        (Api::Responses, true) => sse_response(responses_sse(&model, &reply, usage)),
        (Api::Responses, false) => {
            let ids = ResponseIds::new();
            json_response(
                StatusCode::OK,
                &responses_object(
                    &ids,
                    &model,
                    "completed",
                    vec![responses_item(&ids, &reply, "completed")],
                    Some(usage),
                ),
            )
        }
        (Api::Chat, true) => sse_response(chat_sse(&model, &reply, usage)),
        (Api::Chat, false) => {
            json_response(StatusCode::OK, &chat_completion(&model, &reply, usage))
        }
        (Api::Gemini, _) => json_response(StatusCode::OK, &gemini_response(&model, &reply, usage)),
    }
}

fn bad_request(s: &Shared, api: Api, uri: &Uri, message: String) -> Response {
    tracing::warn!("scripted model: bad {} request: {message}", api.as_str());
    s.log(&json!({"kind": "bad_request", "api": api.as_str(), "path": uri.path(), "message": message}));
    error_response(api, StatusCode::BAD_REQUEST, message)
}

#[derive(Debug, Clone, Copy)]
struct Usage {
    input: u64,
    output: u64,
}

fn reply_len(reply: &Reply) -> usize {
    match reply {
        Reply::ToolCall { arguments, .. } => Value::Object(arguments.clone()).to_string().len(),
        Reply::Text { text, .. } => text.len(),
    }
}

fn arguments_json(arguments: &Map<String, Value>) -> String {
    Value::Object(arguments.clone()).to_string()
}

fn push_event(out: &mut String, event: &str, data: &Value) {
    out.push_str("event: ");
    out.push_str(event);
    out.push_str("\ndata: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
}

fn push_data(out: &mut String, data: &str) {
    out.push_str("data: ");
    out.push_str(data);
    out.push_str("\n\n");
}

// ---- Anthropic Messages ----

fn anthropic_stop_reason(reply: &Reply) -> &'static str {
    match reply {
        Reply::ToolCall { .. } => "tool_use",
        Reply::Text { .. } => "end_turn",
    }
}

fn anthropic_usage(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.input,
        "output_tokens": usage.output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    })
}

fn anthropic_message(model: &str, reply: &Reply, usage: Usage) -> Value {
    let content = match reply {
        Reply::ToolCall {
            tool,
            arguments,
            call_id,
            ..
        } => json!({"type": "tool_use", "id": call_id, "name": tool.name, "input": arguments}),
        Reply::Text { text, .. } => json!({"type": "text", "text": text}),
    };
    json!({
        "id": format!("msg_{}", random_hex()),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [content],
        "stop_reason": anthropic_stop_reason(reply),
        "stop_sequence": null,
        "usage": anthropic_usage(usage),
    })
}

fn anthropic_sse(model: &str, reply: &Reply, usage: Usage) -> String {
    let mut out = String::new();
    push_event(
        &mut out,
        "message_start",
        &json!({
            "type": "message_start",
            "message": {
                "id": format!("msg_{}", random_hex()),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": anthropic_usage(Usage { input: usage.input, output: 1 }),
            },
        }),
    );
    let (block, delta) = match reply {
        Reply::ToolCall {
            tool,
            arguments,
            call_id,
            ..
        } => (
            json!({"type": "tool_use", "id": call_id, "name": tool.name, "input": {}}),
            json!({"type": "input_json_delta", "partial_json": arguments_json(arguments)}),
        ),
        Reply::Text { text, .. } => (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": text}),
        ),
    };
    push_event(
        &mut out,
        "content_block_start",
        &json!({"type": "content_block_start", "index": 0, "content_block": block}),
    );
    push_event(
        &mut out,
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": 0, "delta": delta}),
    );
    push_event(
        &mut out,
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
    );
    push_event(
        &mut out,
        "message_delta",
        &json!({
            "type": "message_delta",
            "delta": {"stop_reason": anthropic_stop_reason(reply), "stop_sequence": null},
            "usage": anthropic_usage(usage),
        }),
    );
    push_event(&mut out, "message_stop", &json!({"type": "message_stop"}));
    out
}

// ---- OpenAI Responses ----

struct ResponseIds {
    response: String,
    item: String,
    created_at: u64,
}

impl ResponseIds {
    fn new() -> Self {
        ResponseIds {
            response: format!("resp_{}", random_hex()),
            item: random_hex(),
            created_at: unix_now(),
        }
    }
}

fn responses_item(ids: &ResponseIds, reply: &Reply, status: &str) -> Value {
    match reply {
        Reply::ToolCall {
            tool,
            arguments,
            call_id,
            ..
        } => {
            let mut item = json!({
                "type": "function_call",
                "id": format!("fc_{}", ids.item),
                "call_id": call_id,
                "name": tool.name,
                "arguments": arguments_json(arguments),
                "status": status,
            });
            if let (Some(ns), Value::Object(o)) = (&tool.namespace, &mut item) {
                o.insert("namespace".to_owned(), Value::String(ns.clone()));
            }
            item
        }
        Reply::Text { text, .. } => {
            let content = if status == "completed" {
                json!([{"type": "output_text", "text": text, "annotations": []}])
            } else {
                json!([])
            };
            json!({
                "type": "message",
                "id": format!("msg_{}", ids.item),
                "role": "assistant",
                "status": status,
                "content": content,
            })
        }
    }
}

fn responses_object(
    ids: &ResponseIds,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Option<Usage>,
) -> Value {
    let usage = usage.map(|u| {
        json!({
            "input_tokens": u.input,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.input + u.output,
        })
    });
    json!({
        "id": ids.response,
        "object": "response",
        "created_at": ids.created_at,
        "status": status,
        "error": null,
        "incomplete_details": null,
        "model": model,
        "output": output,
        "parallel_tool_calls": false,
        "usage": usage,
    })
}

fn responses_sse(model: &str, reply: &Reply, usage: Usage) -> String {
    let ids = ResponseIds::new();
    let mut out = String::new();
    let mut seq = 0u64;
    let mut event = |out: &mut String, kind: &str, mut data: Value| {
        if let Value::Object(o) = &mut data {
            o.insert("type".to_owned(), Value::String(kind.to_owned()));
            o.insert("sequence_number".to_owned(), Value::from(seq));
        }
        seq += 1;
        push_event(out, kind, &data);
    };
    event(
        &mut out,
        "response.created",
        json!({"response": responses_object(&ids, model, "in_progress", vec![], None)}),
    );
    // An added function call already carries the whole arguments, so clients reading either
    // event agree (no `function_call_arguments.delta` events are sent).
    let added = responses_item(&ids, reply, "in_progress");
    event(
        &mut out,
        "response.output_item.added",
        json!({"output_index": 0, "item": added}),
    );
    if let Reply::Text { text, .. } = reply {
        event(
            &mut out,
            "response.output_text.delta",
            json!({"item_id": format!("msg_{}", ids.item), "output_index": 0, "content_index": 0, "delta": text}),
        );
    }
    let done = responses_item(&ids, reply, "completed");
    event(
        &mut out,
        "response.output_item.done",
        json!({"output_index": 0, "item": done.clone()}),
    );
    event(
        &mut out,
        "response.completed",
        json!({"response": responses_object(&ids, model, "completed", vec![done], Some(usage))}),
    );
    out
}

// ---- Gemini API ----

/// One `GenerateContentResponse` (a whole reply, or the only chunk of a stream).
fn gemini_response(model: &str, reply: &Reply, usage: Usage) -> Value {
    let part = match reply {
        Reply::ToolCall {
            tool,
            arguments,
            call_id,
            ..
        } => json!({"functionCall": {"id": call_id, "name": tool.name, "args": arguments}}),
        Reply::Text { text, .. } => json!({"text": text}),
    };
    json!({
        "candidates": [{
            "content": {"role": "model", "parts": [part]},
            "finishReason": "STOP",
            "index": 0,
        }],
        "usageMetadata": {
            "promptTokenCount": usage.input,
            "candidatesTokenCount": usage.output,
            "totalTokenCount": usage.input + usage.output,
        },
        "modelVersion": model,
        "responseId": random_hex(),
    })
}

// ---- Chat Completions ----

fn chat_finish_reason(reply: &Reply) -> &'static str {
    match reply {
        Reply::ToolCall { .. } => "tool_calls",
        Reply::Text { .. } => "stop",
    }
}

fn chat_usage(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.input,
        "completion_tokens": usage.output,
        "total_tokens": usage.input + usage.output,
    })
}

fn chat_tool_calls(reply: &Reply) -> Option<Value> {
    match reply {
        Reply::ToolCall {
            tool,
            arguments,
            call_id,
            ..
        } => Some(json!([{
            "index": 0,
            "id": call_id,
            "type": "function",
            "function": {"name": tool.name, "arguments": arguments_json(arguments)},
        }])),
        Reply::Text { .. } => None,
    }
}

fn chat_completion(model: &str, reply: &Reply, usage: Usage) -> Value {
    let message = match (reply, chat_tool_calls(reply)) {
        (_, Some(calls)) => json!({"role": "assistant", "content": null, "tool_calls": calls}),
        (Reply::Text { text, .. }, None) => json!({"role": "assistant", "content": text}),
        (Reply::ToolCall { .. }, None) => json!({"role": "assistant", "content": null}),
    };
    json!({
        "id": format!("chatcmpl-{}", random_hex()),
        "object": "chat.completion",
        "created": unix_now(),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": chat_finish_reason(reply)}],
        "usage": chat_usage(usage),
    })
}

fn chat_sse(model: &str, reply: &Reply, usage: Usage) -> String {
    let id = format!("chatcmpl-{}", random_hex());
    let created = unix_now();
    let chunk = |choices: Value, usage: Option<Value>| {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        });
        if let (Some(u), Value::Object(o)) = (usage, &mut c) {
            o.insert("usage".to_owned(), u);
        }
        c.to_string()
    };
    let delta = match (reply, chat_tool_calls(reply)) {
        (_, Some(calls)) => json!({"role": "assistant", "tool_calls": calls}),
        (Reply::Text { text, .. }, None) => json!({"role": "assistant", "content": text}),
        (Reply::ToolCall { .. }, None) => json!({"role": "assistant"}),
    };
    let mut out = String::new();
    push_data(
        &mut out,
        &chunk(
            json!([{"index": 0, "delta": delta, "finish_reason": null}]),
            None,
        ),
    );
    push_data(
        &mut out,
        &chunk(
            json!([{"index": 0, "delta": {}, "finish_reason": chat_finish_reason(reply)}]),
            None,
        ),
    );
    push_data(&mut out, &chunk(json!([]), Some(chat_usage(usage))));
    push_data(&mut out, "[DONE]");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn script() -> Script {
        Script::from_json(
            r#"{"steps": [
                {"tool": "files.read", "arguments": {"path": "/public/hello.txt"}},
                {"tool": "files.search", "arguments": {"query": "hello"}}
            ], "final": "All attempts made."}"#,
        )
        .unwrap()
    }

    struct Running {
        addr: SocketAddr,
        log: PathBuf,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<Result<(), ScriptedModelError>>,
        _dir: tempfile::TempDir,
    }

    impl Running {
        async fn start(script: Script) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("model.jsonl");
            let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let addr = listener.local_addr().unwrap();
            let shutdown = CancellationToken::new();
            let task = tokio::spawn(serve(listener, script, Some(log.clone()), shutdown.clone()));
            Running {
                addr,
                log,
                shutdown,
                task,
                _dir: dir,
            }
        }

        async fn stop(self) {
            self.shutdown.cancel();
            self.task.await.unwrap().unwrap();
        }

        fn log_lines(&self) -> Vec<Value> {
            std::fs::read_to_string(&self.log)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        }

        async fn post(&self, path: &str, body: &Value) -> (u16, String, String) {
            request(self.addr, "POST", path, Some(body)).await
        }
    }

    /// A minimal HTTP/1.1 client: one request per connection; returns status, headers, body.
    async fn request(
        addr: SocketAddr,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, String, String) {
        let body = body.map(Value::to_string).unwrap_or_default();
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        let headers = head.to_ascii_lowercase();
        let body = if headers.contains("transfer-encoding: chunked") {
            dechunk(body)
        } else {
            body.to_owned()
        };
        (status, headers, body)
    }

    fn dechunk(mut rest: &str) -> String {
        let mut out = String::new();
        loop {
            let (size, after) = rest.split_once("\r\n").unwrap();
            let size = usize::from_str_radix(size.trim(), 16).unwrap();
            if size == 0 {
                return out;
            }
            out.push_str(&after[..size]);
            rest = &after[size + 2..];
        }
    }

    /// SSE events as (event name or "", data).
    fn sse(body: &str) -> Vec<(String, String)> {
        body.split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut name = String::new();
                let mut data = String::new();
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_owned();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = d.to_owned();
                    }
                }
                (name, data)
            })
            .collect()
    }

    fn sse_json(body: &str) -> Vec<(String, Value)> {
        sse(body)
            .into_iter()
            .map(|(n, d)| (n, serde_json::from_str(&d).unwrap()))
            .collect()
    }

    fn requests(lines: &[Value]) -> Vec<&Value> {
        lines.iter().filter(|l| l["kind"] == "request").collect()
    }

    fn results(lines: &[Value]) -> Vec<&Value> {
        lines
            .iter()
            .filter(|l| l["kind"] == "tool_result")
            .collect()
    }

    // ---- Anthropic (Claude Code naming) ----

    fn claude_tools() -> Value {
        json!([
            {"name": "Read", "description": "read a file", "input_schema": {"type": "object"}},
            {"name": "mcp__sharedos__files_read", "input_schema": {"type": "object"}},
            {"name": "mcp__sharedos__files_search", "input_schema": {"type": "object"}}
        ])
    }

    fn claude_request(messages: Value) -> Value {
        json!({"model": "claude-opus-5-5", "max_tokens": 1024, "stream": true,
               "tools": claude_tools(), "messages": messages})
    }

    fn tool_use_of(events: &[(String, Value)]) -> (String, String, Value) {
        let start = &events[1].1["content_block"];
        assert_eq!(start["type"], "tool_use");
        assert_eq!(start["input"], json!({}));
        let partial = events[2].1["delta"]["partial_json"].as_str().unwrap();
        (
            start["id"].as_str().unwrap().to_owned(),
            start["name"].as_str().unwrap().to_owned(),
            serde_json::from_str(partial).unwrap(),
        )
    }

    #[tokio::test]
    async fn scripted_model_anthropic_plays_steps_then_final() {
        let m = Running::start(script()).await;
        let user = json!({"role": "user", "content": "read the file"});

        let (status, headers, body) = m
            .post("/v1/messages?beta=true", &claude_request(json!([user])))
            .await;
        assert_eq!(status, 200);
        assert!(headers.contains("content-type: text/event-stream"));
        let events = sse_json(&body);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for (name, data) in &events {
            assert_eq!(data["type"], name.as_str());
        }
        assert_eq!(events[0].1["message"]["content"], json!([]));
        let (id1, name, input) = tool_use_of(&events);
        assert_eq!(name, "mcp__sharedos__files_read");
        assert_eq!(input, json!({"path": "/public/hello.txt"}));
        assert_eq!(events[4].1["delta"]["stop_reason"], "tool_use");
        assert!(events[4].1["usage"]["output_tokens"].is_u64());

        // One result (an error, as Claude flattens it) → step 2.
        let call1 = json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": id1, "name": name, "input": input}]});
        let result1 = json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id1, "content": "EACCES: access denied", "is_error": true}]});
        let (_, _, body) = m
            .post(
                "/v1/messages",
                &claude_request(json!([user, call1, result1])),
            )
            .await;
        let events = sse_json(&body);
        let (id2, name, input) = tool_use_of(&events);
        assert_ne!(id1, id2);
        assert_eq!(name, "mcp__sharedos__files_search");
        assert_eq!(input, json!({"query": "hello"}));

        // All results → the final text.
        let call2 = json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": id2, "name": name, "input": input}]});
        let result2 = json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id2, "content": [{"type": "text", "text": "hello.txt: 1 match"}]}]});
        let (_, _, body) = m
            .post(
                "/v1/messages",
                &claude_request(json!([user, call1, result1, call2, result2])),
            )
            .await;
        let events = sse_json(&body);
        assert_eq!(
            events[1].1["content_block"],
            json!({"type": "text", "text": ""})
        );
        assert_eq!(
            events[2].1["delta"],
            json!({"type": "text_delta", "text": "All attempts made."})
        );
        assert_eq!(events[4].1["delta"]["stop_reason"], "end_turn");

        let lines = m.log_lines();
        let reqs = requests(&lines);
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0]["api"], "anthropic");
        assert_eq!(reqs[0]["path"], "/v1/messages");
        assert_eq!(reqs[0]["model"], "claude-opus-5-5");
        assert_eq!(
            reqs[0]["offered"],
            json!([
                "Read",
                "mcp__sharedos__files_read",
                "mcp__sharedos__files_search"
            ])
        );
        assert_eq!(reqs[0]["toolResults"], 0);
        assert_eq!(reqs[0]["reply"], "tool_call");
        assert_eq!(reqs[0]["tool"], "mcp__sharedos__files_read");
        assert_eq!(reqs[1]["toolResults"], 1);
        assert_eq!(reqs[1]["tool"], "mcp__sharedos__files_search");
        assert_eq!(reqs[2]["toolResults"], 2);
        assert_eq!(reqs[2]["reply"], "text");
        assert_eq!(reqs[2]["tool"], Value::Null);
        let res = results(&lines);
        assert_eq!(res.len(), 2, "each result is logged once: {res:?}");
        assert_eq!(res[0]["api"], "anthropic");
        assert_eq!(res[0]["callId"], id1.as_str());
        assert_eq!(res[0]["isError"], true);
        assert_eq!(res[0]["text"], "EACCES: access denied");
        assert_eq!(res[1]["callId"], id2.as_str());
        assert_eq!(res[1]["isError"], false);
        assert_eq!(res[1]["text"], "hello.txt: 1 match");
        m.stop().await;
    }

    #[tokio::test]
    async fn scripted_model_anthropic_plain_json_and_stubs() {
        let m = Running::start(script()).await;
        let mut req = claude_request(json!([{"role": "user", "content": "hi"}]));
        req["stream"] = json!(false);
        let (status, headers, body) = m.post("/v1/messages", &req).await;
        assert_eq!(status, 200);
        assert!(headers.contains("content-type: application/json"));
        let msg: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(msg["type"], "message");
        assert_eq!(msg["stop_reason"], "tool_use");
        assert_eq!(msg["content"][0]["name"], "mcp__sharedos__files_read");
        assert_eq!(
            msg["content"][0]["input"],
            json!({"path": "/public/hello.txt"})
        );

        let (status, _, body) = m.post("/v1/messages/count_tokens", &req).await;
        assert_eq!(status, 200);
        assert!(serde_json::from_str::<Value>(&body).unwrap()["input_tokens"].is_u64());

        let (status, _, body) = request(m.addr, "GET", "/v1/models", None).await;
        assert_eq!(status, 200);
        let list: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(list["object"], "list");
        assert_eq!(list["data"][0]["id"], DEFAULT_MODEL);

        let (status, _, _) = request(m.addr, "HEAD", "/api/hello", None).await;
        assert_eq!(status, 404);
        let (status, _, _) = request(m.addr, "GET", "/v1/messages", None).await;
        assert_eq!(status, 404);
        let (status, _, _) = m.post("/v1/messages", &json!([1, 2])).await;
        assert_eq!(status, 400);

        let lines = m.log_lines();
        let missing: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "not_found").collect();
        assert_eq!(missing.len(), 2);
        assert_eq!(missing[0]["path"], "/api/hello");
        assert_eq!(missing[0]["method"], "HEAD");
        assert_eq!(missing[1]["method"], "GET");
        assert!(lines.iter().any(|l| l["kind"] == "bad_request"));
        m.stop().await;
    }

    // ---- Responses (Codex naming: a namespace) ----

    fn codex_request(input: Value) -> Value {
        json!({
            "model": "fake-model",
            "stream": true,
            "instructions": "you are codex",
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object"}},
                {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
                {"type": "web_search"},
                {"type": "namespace", "name": "mcp__sharedos", "tools": [
                    {"type": "function", "name": "files_read", "parameters": {"type": "object"}},
                    {"type": "function", "name": "files_search", "parameters": {"type": "object"}}
                ]}
            ],
            "input": input,
        })
    }

    fn function_call_of(events: &[(String, Value)]) -> Value {
        let done = events
            .iter()
            .find(|(n, _)| n == "response.output_item.done")
            .unwrap();
        done.1["item"].clone()
    }

    #[tokio::test]
    async fn scripted_model_responses_uses_codex_namespace() {
        let m = Running::start(script()).await;
        let user = json!({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "read the file"}]});

        let (status, headers, body) = m.post("/v1/responses", &codex_request(json!([user]))).await;
        assert_eq!(status, 200);
        assert!(headers.contains("content-type: text/event-stream"));
        let events = sse_json(&body);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.output_item.added",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, (name, data)) in events.iter().enumerate() {
            assert_eq!(data["type"], name.as_str());
            assert_eq!(data["sequence_number"], i as u64);
        }
        let item = function_call_of(&events);
        assert_eq!(item["type"], "function_call");
        assert_eq!(item["namespace"], "mcp__sharedos");
        assert_eq!(item["name"], "files_read");
        let args: Value = serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"path": "/public/hello.txt"}));
        let call1 = item["call_id"].as_str().unwrap().to_owned();
        assert!(call1.starts_with("call_0_"));
        let completed = &events[3].1["response"];
        assert_eq!(completed["status"], "completed");
        assert_eq!(completed["output"][0], item);
        let usage = &completed["usage"];
        assert!(usage["input_tokens"].is_u64());
        assert!(usage["output_tokens"].is_u64());
        assert!(usage["total_tokens"].is_u64());
        assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
        assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);

        // Codex sends no error flag: the output looks like a success.
        let output1 = json!({"type": "function_call_output", "call_id": call1, "output": [
            {"type": "input_text", "text": "Wall time: 0.0045 seconds\nOutput:"},
            {"type": "input_text", "text": "EACCES: access denied"}]});
        let (_, _, body) = m
            .post(
                "/v1/responses",
                &codex_request(json!([user, item, output1])),
            )
            .await;
        let item2 = function_call_of(&sse_json(&body));
        assert_eq!(item2["namespace"], "mcp__sharedos");
        assert_eq!(item2["name"], "files_search");
        let call2 = item2["call_id"].as_str().unwrap().to_owned();
        assert_ne!(call1, call2);

        let output2 =
            json!({"type": "function_call_output", "call_id": call2, "output": "1 match"});
        let (_, _, body) = m
            .post(
                "/v1/responses",
                &codex_request(json!([user, item, output1, item2, output2])),
            )
            .await;
        let events = sse_json(&body);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.output_item.added",
                "response.output_text.delta",
                "response.output_item.done",
                "response.completed"
            ]
        );
        assert_eq!(events[2].1["delta"], "All attempts made.");
        let message = function_call_of(&events);
        assert_eq!(message["type"], "message");
        assert_eq!(message["content"][0]["type"], "output_text");
        assert_eq!(message["content"][0]["text"], "All attempts made.");

        let lines = m.log_lines();
        let reqs = requests(&lines);
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0]["api"], "responses");
        assert_eq!(
            reqs[0]["offered"],
            json!([
                "shell",
                "apply_patch",
                "web_search",
                "mcp__sharedos/files_read",
                "mcp__sharedos/files_search"
            ])
        );
        assert_eq!(reqs[0]["tool"], "mcp__sharedos/files_read");
        // The column reads the log back: the namespace is kept apart from the name.
        let back = LoggedRequest::from_log_line(reqs[0]).expect("a request line");
        assert_eq!(back.api, "responses");
        assert_eq!(back.model.as_deref(), Some("fake-model"));
        assert_eq!(
            back.offered[3],
            OfferedTool {
                namespace: Some("mcp__sharedos".into()),
                name: "files_read".into()
            }
        );
        assert_eq!(back.offered[0].namespace, None);
        assert!(LoggedRequest::from_log_line(&json!({"kind": "tool_result"})).is_none());
        assert_eq!(reqs[1]["toolResults"], 1);
        assert_eq!(reqs[1]["tool"], "mcp__sharedos/files_search");
        assert_eq!(reqs[2]["reply"], "text");
        let res = results(&lines);
        assert_eq!(res.len(), 2);
        assert_eq!(res[0]["callId"], call1.as_str());
        assert_eq!(res[0]["isError"], Value::Null);
        assert_eq!(
            res[0]["text"],
            "Wall time: 0.0045 seconds\nOutput:\nEACCES: access denied"
        );
        assert_eq!(res[1]["text"], "1 match");
        m.stop().await;
    }

    // ---- Chat Completions (pi naming) ----

    fn pi_request(messages: Value) -> Value {
        json!({
            "model": "fake-model",
            "stream": true,
            "stream_options": {"include_usage": true},
            "tools": [
                {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "mcp", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "sharedos_files_read", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "sharedos_files_search", "parameters": {"type": "object"}}}
            ],
            "messages": messages,
        })
    }

    /// Checks the chunk sequence and returns the first delta.
    fn chat_delta(body: &str, finish: &str) -> Value {
        let events = sse(body);
        assert_eq!(events.len(), 4, "{body}");
        assert!(events.iter().all(|(n, _)| n.is_empty()));
        assert_eq!(events[3].1, "[DONE]");
        let chunks: Vec<Value> = events[..3]
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect();
        assert!(
            chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk")
        );
        assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(chunks[1]["choices"][0]["delta"], json!({}));
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], finish);
        assert_eq!(chunks[2]["choices"], json!([]));
        assert!(chunks[2]["usage"]["prompt_tokens"].is_u64());
        assert!(chunks[2]["usage"]["completion_tokens"].is_u64());
        let delta = chunks[0]["choices"][0]["delta"].clone();
        assert_eq!(delta["role"], "assistant");
        delta
    }

    #[tokio::test]
    async fn scripted_model_chat_uses_pi_names() {
        let m = Running::start(script()).await;
        let system = json!({"role": "system", "content": "you are pi"});
        let user = json!({"role": "user", "content": "read the file"});

        let (status, _, body) = m
            .post("/v1/chat/completions", &pi_request(json!([system, user])))
            .await;
        assert_eq!(status, 200);
        let delta = chat_delta(&body, "tool_calls");
        let call = &delta["tool_calls"][0];
        assert_eq!(call["index"], 0);
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "sharedos_files_read");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"path": "/public/hello.txt"}));
        let id1 = call["id"].as_str().unwrap().to_owned();

        let assistant1 =
            json!({"role": "assistant", "content": null, "tool_calls": delta["tool_calls"]});
        let tool1 =
            json!({"role": "tool", "tool_call_id": id1, "content": "Error: EACCES: access denied"});
        let (_, _, body) = m
            .post(
                "/v1/chat/completions",
                &pi_request(json!([system, user, assistant1, tool1])),
            )
            .await;
        let delta2 = chat_delta(&body, "tool_calls");
        let call2 = &delta2["tool_calls"][0];
        assert_eq!(call2["function"]["name"], "sharedos_files_search");
        let id2 = call2["id"].as_str().unwrap().to_owned();
        assert_ne!(id1, id2);

        let assistant2 =
            json!({"role": "assistant", "content": null, "tool_calls": delta2["tool_calls"]});
        let tool2 = json!({"role": "tool", "tool_call_id": id2, "content": [{"type": "text", "text": "1 match"}]});
        let (_, _, body) = m
            .post(
                "/v1/chat/completions",
                &pi_request(json!([system, user, assistant1, tool1, assistant2, tool2])),
            )
            .await;
        let delta3 = chat_delta(&body, "stop");
        assert_eq!(delta3["content"], "All attempts made.");
        assert!(delta3.get("tool_calls").is_none());

        let lines = m.log_lines();
        let reqs = requests(&lines);
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0]["api"], "chat");
        assert_eq!(reqs[0]["tool"], "sharedos_files_read");
        assert_eq!(reqs[1]["tool"], "sharedos_files_search");
        assert_eq!(reqs[2]["reply"], "text");
        assert_eq!(reqs[2]["toolResults"], 2);
        let res = results(&lines);
        assert_eq!(res.len(), 2);
        assert_eq!(res[0]["api"], "chat");
        assert_eq!(res[0]["callId"], id1.as_str());
        assert_eq!(res[0]["isError"], Value::Null);
        assert_eq!(res[0]["text"], "Error: EACCES: access denied");
        assert_eq!(res[1]["text"], "1 match");

        // Plain JSON when not streamed.
        let mut req = pi_request(json!([system, user]));
        req["stream"] = json!(false);
        let (_, _, body) = m.post("/v1/chat/completions", &req).await;
        let completion: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(completion["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            completion["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "sharedos_files_read"
        );
        m.stop().await;
    }

    /// Gemini API: model from the path, SSE with `alt=sse`, a JSON array without, plain JSON
    /// for `generateContent`, function responses counted as tool results.
    #[tokio::test]
    async fn scripted_model_gemini_function_calls() {
        let m = Running::start(script()).await;
        let tools = json!([{"functionDeclarations": [
            {"name": "read_file"},
            {"name": "mcp_sharedos_files.read"},
            {"name": "mcp_sharedos_files.search"},
        ]}]);
        let user = json!({"role": "user", "parts": [{"text": "read the file"}]});
        let req = |contents: Value| json!({"contents": contents, "tools": tools});
        let path = "/v1beta/models/fake-model:streamGenerateContent?alt=sse";

        let (status, headers, body) = m.post(path, &req(json!([user]))).await;
        assert_eq!(status, 200);
        assert!(headers.contains("text/event-stream"), "{headers}");
        let chunk: Value =
            serde_json::from_str(body.trim().strip_prefix("data: ").expect("data")).unwrap();
        let part = &chunk["candidates"][0]["content"]["parts"][0];
        assert_eq!(part["functionCall"]["name"], "mcp_sharedos_files.read");
        assert_eq!(
            part["functionCall"]["args"],
            json!({"path": "/public/hello.txt"})
        );
        let id = part["functionCall"]["id"].as_str().unwrap().to_owned();
        assert_eq!(chunk["modelVersion"], "fake-model");

        let model_turn = json!({"role": "model", "parts": [part]});
        let response = json!({"role": "user", "parts": [{"functionResponse": {
            "id": id, "name": "mcp_sharedos_files.read", "response": {"output": "hello"}}}]});
        let (_, _, body) = m
            .post(
                "/v1beta/models/fake-model:streamGenerateContent",
                &req(json!([user, model_turn, response])),
            )
            .await;
        let chunks: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            chunks[0]["candidates"][0]["content"]["parts"][0]["functionCall"]["name"],
            "mcp_sharedos_files.search"
        );

        let (_, _, body) = m
            .post(
                "/v1beta/models/other-model:generateContent",
                &req(json!([user, model_turn, response, model_turn, response])),
            )
            .await;
        let whole: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            whole["candidates"][0]["content"]["parts"][0]["text"],
            "All attempts made."
        );
        let (status, _, body) = m
            .post("/v1beta/models/fake-model:countTokens", &req(json!([user])))
            .await;
        assert_eq!(status, 200);
        assert!(body.contains("totalTokens"), "{body}");

        let lines = m.log_lines();
        let reqs = requests(&lines);
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0]["api"], "gemini");
        assert_eq!(reqs[0]["model"], "fake-model");
        assert_eq!(reqs[0]["stream"], true);
        assert_eq!(reqs[2]["model"], "other-model");
        assert_eq!(reqs[2]["stream"], false);
        assert_eq!(reqs[2]["toolResults"], 2);
        let res = results(&lines);
        assert_eq!(res.len(), 1, "one call id, logged once");
        assert_eq!(res[0]["text"], "hello");
        assert_eq!(res[0]["callId"], id.as_str());
        m.stop().await;
    }

    #[tokio::test]
    async fn scripted_model_tool_not_offered_is_text() {
        let m = Running::start(script()).await;
        let req = json!({"model": "fake-model", "stream": true,
                         "tools": [{"type": "function", "function": {"name": "bash"}}],
                         "messages": [{"role": "user", "content": "hi"}]});
        let (_, _, body) = m.post("/v1/chat/completions", &req).await;
        let delta = chat_delta(&body, "stop");
        let text = delta["content"].as_str().unwrap();
        assert!(text.contains("`files.read`"), "{text}");
        assert!(text.contains("bash"), "{text}");
        let lines = m.log_lines();
        let reqs = requests(&lines);
        assert_eq!(reqs[0]["reply"], "text");
        assert_eq!(reqs[0]["notOffered"], "files.read");
        m.stop().await;
    }

    /// A step's `delay_ms` holds the reply that plays it, and only that one; the request is
    /// logged at once.
    #[tokio::test]
    async fn scripted_model_step_delay_holds_its_reply() {
        let m = Running::start(
            Script::from_json(
                r#"{"steps": [{"tool": "files.read", "arguments": {}, "delay_ms": 600}], "final": "F"}"#,
            )
            .unwrap(),
        )
        .await;
        let tools = json!([{"type": "function", "function": {"name": "sharedos_files_read"}}]);
        let first =
            json!({"model": "m", "tools": tools, "messages": [{"role": "user", "content": "hi"}]});
        let started = std::time::Instant::now();
        let (status, _, _) = m.post("/v1/chat/completions", &first).await;
        assert_eq!(status, 200);
        assert!(started.elapsed() >= std::time::Duration::from_millis(600));
        assert_eq!(requests(&m.log_lines())[0]["step"], 0);
        let done = json!({"model": "m", "tools": tools, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "sharedos_files_read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]});
        let started = std::time::Instant::now();
        m.post("/v1/chat/completions", &done).await;
        assert!(started.elapsed() < std::time::Duration::from_millis(600));
        m.stop().await;
    }

    #[tokio::test]
    async fn scripted_model_refuses_non_loopback() {
        for addr in ["0.0.0.0:0", "192.0.2.1:8080", "[::]:0"] {
            let err = bind(addr.parse().unwrap()).await.unwrap_err();
            assert!(matches!(err, ScriptedModelError::NotLoopback(_)), "{addr}");
            assert!(err.to_string().contains("loopback only"), "{err}");
        }
        assert!(bind("127.0.0.1:0".parse().unwrap()).await.is_ok());
    }

    #[test]
    fn scripted_model_matches_by_normalized_suffix() {
        let flat = |n: &str| OfferedTool {
            namespace: None,
            name: n.to_owned(),
        };
        let offered = vec![
            flat("Read"),
            flat("mcp__sharedos__files_read"),
            OfferedTool {
                namespace: Some("mcp__sharedos".to_owned()),
                name: "files_search".to_owned(),
            },
        ];
        assert_eq!(
            match_tool("files.read", &offered).unwrap().name,
            "mcp__sharedos__files_read"
        );
        assert_eq!(
            match_tool("files.search", &offered).unwrap().name,
            "files_search"
        );
        // The shortest match wins: an exact name beats a longer suffix match.
        assert_eq!(match_tool("read", &offered).unwrap().name, "Read");
        assert!(match_tool("files.write", &offered).is_none());
        assert!(match_tool("..", &offered).is_none());
        // Cline's rewritten names carry a SHA-1 suffix.
        let cline = vec![flat("read_files"), flat("sharedos__files_read_5f40265d")];
        assert_eq!(
            match_tool("files.read", &cline).unwrap().name,
            "sharedos__files_read_5f40265d"
        );
        // Qwen Code's rewritten names carry a hash suffix.
        let qwen = vec![flat("read_file"), flat("mcp__sharedos__files_read_1rtbejb")];
        assert_eq!(
            match_tool("files.read", &qwen).unwrap().name,
            "mcp__sharedos__files_read_1rtbejb"
        );
        assert_eq!(strip_hash_suffix("files_readers"), "files_readers");
        assert_eq!(strip_hash_suffix("a_bcdefgh"), "a_bcdefgh");
        assert_eq!(strip_hash_suffix("a_1rtbejb"), "a");
        assert_eq!(
            normalize("mcp__SharedOS__files.read"),
            "mcpsharedosfilesread"
        );
    }

    #[test]
    fn scripted_model_script_parses_and_rejects() {
        let s = script();
        assert_eq!(s.steps.len(), 2);
        assert_eq!(s.final_text, "All attempts made.");
        assert_eq!(Script::from_json(r#"{}"#).unwrap().final_text, "Done.");
        assert!(Script::from_json(r#"{"steps": [{"tool": "x", "arguments": [1]}]}"#).is_err());
        assert!(Script::from_json(r#"{"step": []}"#).is_err());
    }
}
