//! What the kernel knows of a provider, and nothing more: a registration is a published
//! definition plus an [`Authority`] whose handler is a [`ToolHandler`] (rmcp's tool route: the
//! definition and a boxed handler). The kernel calls handlers through this trait and never names
//! a concrete provider; the composition root (`assemble`) alone does.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};
use sharedos_proto::{FailCode, PublishedToolDefinition, ToolDefinition};

use crate::policy::AccessContext;
use crate::resource::{Object, Resource};

/// A permitted call's execution, boxed so every handler fits one `select!`.
pub type Job = Pin<Box<dyn Future<Output = Result<Success, Failure>> + Send>>;

/// A failed execution: the code, the sentence after `failed: `, and any content a provider
/// returned with its error (passed through after that sentence).
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: FailCode,
    pub message: String,
    pub content: Vec<Value>,
}

impl Failure {
    pub fn new(code: FailCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            content: vec![],
        }
    }

    pub fn with_content(mut self, content: Vec<Value>) -> Self {
        self.content = content;
        self
    }
}

/// A successful execution: MCP content blocks and structured content, as the provider gave them.
#[derive(Debug, Clone)]
pub struct Success {
    pub content: Vec<Value>,
    pub structured: Option<Value>,
}

impl Success {
    pub fn text(text: String) -> Self {
        Self {
            content: vec![json!({"type": "text", "text": text})],
            structured: None,
        }
    }

    pub fn content(content: Vec<Value>, structured: Option<Value>) -> Self {
        Self {
            content,
            structured,
        }
    }

    /// The text of the first block (tests, tables).
    pub fn first_text(&self) -> &str {
        self.content
            .first()
            .and_then(|c| c["text"].as_str())
            .unwrap_or_default()
    }
}

/// The kernel's answer to "may this principal read this file?", for `search` hits.
pub trait ReadCheck: Send + Sync {
    fn may_read(&self, virtual_path: &str) -> bool;
}

/// A call's resolved requirement, plus what its handler needs to run exactly what was decided.
pub struct Resolution {
    /// The Cedar action.
    pub action: String,
    pub resource: Resource,
    /// What is sent instead of the call's own arguments, when it differs (a brokered
    /// `file_root` path is sent as what it resolved to).
    pub forwarded: Option<Map<String, Value>>,
    /// The file or folder the resource resolved to, for a resource resolved on a filesystem:
    /// an approved call runs only if it resolves to the same object again.
    pub object: Option<Object>,
    /// The handler's own part (the files provider's descriptor), handed back to
    /// [`ToolHandler::execute`].
    pub detail: Option<Box<dyn Any + Send>>,
}

/// What the kernel lends a call it runs.
pub struct CallEnv {
    /// The principal the call runs for (a per-principal upstream instance is theirs).
    pub principal: String,
    /// The kernel's read decision in this call's context (`search` asks it for each hit).
    pub read_check: Box<dyn ReadCheck>,
    /// The turn's places for blocking work, if it has a bound.
    pub blocking: Option<Arc<tokio::sync::Semaphore>>,
    /// The trace context to send on to an upstream server (`params._meta`), if any.
    pub trace: Option<crate::telemetry::Outgoing>,
}

/// How one registered tool resolves and runs. Never leaves the broker.
pub trait ToolHandler: Send + Sync {
    /// The provider's namespace (a file's space; `providers`).
    fn namespace(&self) -> &str;
    /// The provider kind `providers` shows (`files`, `mcp`).
    fn kind(&self) -> &'static str;
    /// The requirement shape (action, resource type): tools of one shape share the catalogue
    /// answer.
    fn shape(&self) -> (&str, &str);
    /// Can a call change state? Such calls are written ahead of running.
    fn changes_state(&self, annotations: Option<&Value>) -> bool;
    /// Why calls are refused before anything else is checked, if they are now (a brokered
    /// upstream that drifted since the catalogue was made).
    fn unavailable(&self) -> Option<Failure> {
        None
    }
    /// The requirement from the call's arguments.
    fn resolve(&self, tool: &str, arguments: &Map<String, Value>) -> Result<Resolution, String>;
    /// Runs a permitted call on what [`ToolHandler::resolve`] resolved.
    fn execute(&self, resolution: Resolution, arguments: Map<String, Value>, env: CallEnv) -> Job;
    /// The call's time limit, given the broker's default.
    fn timeout(&self, default: Duration) -> Duration {
        default
    }
}

/// A brokered provider, as the registry and the host's commands see it.
pub trait Provider: Send + Sync {
    fn namespace(&self) -> &str;
    /// Its registrations in scope for this context (none unless ready).
    fn tools_for(&self, context: &AccessContext) -> Vec<Arc<Registered>>;
    /// What `providers` shows.
    fn status(&self) -> Value;
    /// The longest a call may run.
    fn call_timeout(&self) -> Duration;
    /// The catalogHash of the upstream's own tool list, once listed.
    fn upstream_hash(&self) -> Option<String>;
    /// Checks the pin again (after `providers pin`).
    fn repin(self: Arc<Self>) -> Pin<Box<dyn Future<Output = ()> + Send>>;
    /// Every tool it lists now, whoever it is for (what policies that read arguments are
    /// validated against); `None` while it has not listed them (its tool set is open).
    fn listed(&self) -> Option<Vec<Arc<Registered>>> {
        None
    }
}

/// What a registration carries besides its published surface. Never leaves the broker.
pub struct Authority {
    pub handler: Arc<dyn ToolHandler>,
    /// The compiled inputSchema.
    pub(crate) validator: Option<jsonschema::Validator>,
    /// What catalogues take from this registration, made on first use (a registration never
    /// changes).
    pub(crate) published: std::sync::OnceLock<Published>,
}

impl Authority {
    pub fn new(handler: Arc<dyn ToolHandler>, validator: Option<jsonschema::Validator>) -> Self {
        Self {
            handler,
            validator,
            published: std::sync::OnceLock::new(),
        }
    }
}

/// A registration's published definition, shared by every catalogue, and the RFC 8785 text of
/// its projection, which catalogue hashes are made of (`None` if it cannot be canonicalized).
pub(crate) struct Published {
    pub(crate) definition: Arc<PublishedToolDefinition>,
    pub(crate) canonical: Option<String>,
}

pub type Registered = ToolDefinition<Authority>;

/// Name ownership across every provider: two registrations of one name are refused.
#[derive(Default)]
pub struct Names {
    owners: Mutex<HashMap<String, String>>,
}

impl Names {
    /// Claims `name` for `owner`; Err(current owner) if someone else has it.
    pub fn claim(&self, name: &str, owner: &str) -> Result<(), String> {
        let mut m = self
            .owners
            .lock()
            .map_err(|_| "name table poisoned".to_owned())?;
        match m.get(name) {
            Some(o) if o != owner => Err(o.clone()),
            _ => {
                m.insert(name.to_owned(), owner.to_owned());
                Ok(())
            }
        }
    }

    pub fn release_all(&self, owner: &str) {
        if let Ok(mut m) = self.owners.lock() {
            m.retain(|_, o| o != owner);
        }
    }
}
