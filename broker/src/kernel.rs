//! The kernel: the tool registry, the per-context catalogue, and `invoke`, the single call path.
//!
//! Every call from every bridge goes through [`Kernel::invoke`], which refuses or runs it and
//! writes exactly one record line before returning the answer. The order is fixed (ARCHITECTURE,
//! "invoke"): name valid → published in this turn (and, for a brokered tool, its upstream not
//! drifted since) → arguments valid → requirement resolved from the arguments → Cedar →
//! provider. Authority (requirement resolution, handlers) lives only in the registrations held
//! here; what leaves is a [`CallAnswer`].

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use sharedos_proto::ipc::{CallAnswer, PendingApproval, Question};
use sharedos_proto::record::{
    self, Arguments, BY_HARNESS_SESSION, BY_OPERATOR, BY_PRINCIPAL, Event,
};
use sharedos_proto::{
    CancelCode, CatalogHash, DenyCode, FailCode, Outcome, PublishedToolDefinition, Requirement,
    SystemIdentity, ToolCall, ToolDefinition, ToolName,
};
use tokio_util::sync::CancellationToken;

use crate::approval::{Approvals, Decision as Approval, approval_id};
use crate::budget::{Budgets, Exhausted, TurnUse, returned_bytes};
use crate::evidence::record::Recorder;
use crate::pins::Pins;
use crate::policy::PolicyEngine;
use crate::provider::{
    CallEnv, Failure, Job, Names, Provider, Published, ReadCheck, Resolution as Resolved, Success,
    ToolHandler,
};
use crate::resource::{Object, Resource};
use crate::telemetry::{CallSpan, Telemetry, bounded};

pub use crate::config::DEFAULT_CALL_TIMEOUT;

/// What a shim's per-call deadline adds to the longest call timeout (see
/// [`Kernel::answer_deadline`]).
pub const ANSWER_MARGIN: Duration = Duration::from_secs(5);

/// How a call ended, before its answer is made: outcome, message, requirement, policies, and
/// the provider's content (its error's content on a failure).
type Ending = (
    Outcome,
    Option<String>,
    Option<Requirement>,
    Vec<String>,
    Option<Result<Success, Vec<Value>>>,
);

/// `tool`'s [`Published`] form, made on first use.
fn published(tool: &Registered) -> &Published {
    tool.authority.published.get_or_init(|| {
        let definition = Arc::new(tool.publish());
        let canonical = match sharedos_proto::catalog::canonical_projection(&definition) {
            Ok(text) => Some(text),
            Err(e) => {
                tracing::error!(tool = %tool.name, error = %e, "tool definition cannot be canonicalized");
                None
            }
        };
        Published {
            definition,
            canonical,
        }
    })
}

pub use crate::provider::{Authority, Registered};

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(
        "provider `{provider}`: tool `{name}` is already registered by provider `{by}`; registrations are never merged"
    )]
    Duplicate {
        provider: String,
        name: String,
        by: String,
    },
    #[error("provider `{provider}`: tool `{name}` has an invalid inputSchema: {detail}")]
    Schema {
        provider: String,
        name: String,
        detail: String,
    },
}

/// All registered tools: the built-in ones (fixed at start) and the brokered providers (whose
/// tools come and go with their upstreams). Shared by every turn; a turn's catalogue is a
/// snapshot computed from it, never a change to it.
#[derive(Default)]
pub struct Registry {
    tools: Vec<Arc<Registered>>,
    /// Every registered name → its provider, across built-in and brokered providers.
    pub names: Arc<Names>,
    pub providers: Vec<Arc<dyn Provider>>,
    /// The brokered providers' pin file, if any provider can be pinned.
    pub pins: Option<Arc<Pins>>,
    /// Bumped when a brokered provider's tools change (part of the catalogue cache key).
    pub generation: Arc<AtomicU64>,
}

impl Registry {
    /// The argument types of every tool, per action: built-in tools and each brokered
    /// provider's listed ones; a provider that has not listed leaves every action open.
    pub fn argument_types(&self) -> crate::policy::ArgumentTypes {
        let mut types = crate::policy::ArgumentTypes::known();
        let mut add = |t: &Registered| {
            types.add_tool(t.authority.handler.shape().0, t.input_schema.as_ref());
        };
        self.tools.iter().for_each(|t| add(t));
        let mut open = false;
        for p in &self.providers {
            match p.listed() {
                Some(tools) => tools.iter().for_each(|t| add(t)),
                None => open = true,
            }
        }
        if open {
            types.open_all();
        }
        types
    }

    /// What `context.arguments` leaves out of each tool's arguments (a fraction, a value of no
    /// single type, ...), by tool name; tools that lose nothing are not named.
    pub fn arguments_left_out(&self) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        let mut note = |t: &Registered| {
            let left = crate::policy::arguments::typing(t.input_schema.as_ref()).left_out;
            if !left.is_empty() {
                out.push((t.name.to_string(), left));
            }
        };
        self.tools.iter().for_each(|t| note(t));
        for p in &self.providers {
            p.listed().unwrap_or_default().iter().for_each(|t| note(t));
        }
        out
    }
}

impl Registry {
    /// Registers one built-in provider's tools. A name already taken, or an inputSchema that
    /// does not compile, is an error naming the tool.
    pub fn register(
        &mut self,
        namespace: &str,
        tools: Vec<ToolDefinition<Arc<dyn ToolHandler>>>,
    ) -> Result<(), RegistryError> {
        for def in tools {
            if let Err(by) = self.names.claim(def.name.as_str(), namespace) {
                return Err(RegistryError::Duplicate {
                    provider: namespace.to_owned(),
                    name: def.name.to_string(),
                    by,
                });
            }
            let validator =
                match &def.input_schema {
                    Some(schema) => Some(jsonschema::validator_for(schema).map_err(|e| {
                        RegistryError::Schema {
                            provider: namespace.to_owned(),
                            name: def.name.to_string(),
                            detail: e.to_string(),
                        }
                    })?),
                    None => None,
                };
            let handler = def.authority.clone();
            self.tools.push(Arc::new(
                def.with_authority(Authority::new(handler, validator)),
            ));
        }
        Ok(())
    }

    /// Built-in tools plus the ready providers' tools in scope for this context.
    fn tools_for(&self, context: &AccessContext) -> Vec<Arc<Registered>> {
        let mut out = self.tools.clone();
        for p in &self.providers {
            out.extend(p.tools_for(context));
        }
        out
    }

    pub fn len(&self) -> usize {
        self.tools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

pub use crate::policy::AccessContext;

/// A turn's effective catalogue. Immutable once computed; shared between turns of the same
/// context and policy version (sharing derived data mutates nothing).
pub struct Catalog {
    /// Shared with the registrations: a catalogue copies no definition.
    pub tools: Vec<Arc<PublishedToolDefinition>>,
    pub hash: CatalogHash,
    by_name: HashMap<String, Arc<Registered>>,
    pub policy_version: u64,
}

impl Catalog {
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Each tool's name and its provider's namespace (what budgets apply to).
    pub fn namespaces(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.by_name
            .iter()
            .map(|(n, t)| (n.as_str(), t.authority.handler.namespace()))
    }
}

/// A refusal or a permission, before execution.
pub enum Verdict {
    Refused {
        outcome: Outcome,
        message: String,
        requirement: Option<Requirement>,
        policies: Vec<String>,
    },
    Permitted {
        tool: Arc<Registered>,
        resolved: Box<Resolved>,
        arguments: Map<String, Value>,
        policies: Vec<String>,
        /// A deciding permit asks for a person's approval (`@approval(...)`): who may give it.
        approval: Option<crate::policy::Approver>,
    },
}

/// Bound on cached catalogues (per context and policy version).
const CATALOG_CACHE_MAX: usize = 4096;

pub struct Kernel {
    registry: Registry,
    pub policy: PolicyEngine,
    pub recorder: Recorder,
    /// Record arguments as their SHA-256 instead of as given.
    redact_arguments: bool,
    /// Arguments longer than this (JSON text) are recorded as `argumentsDigest`.
    pub record_max_argument_bytes: usize,
    call_timeout: Duration,
    /// The longest any provider may run one call (the built-in timeout or an upstream's own).
    longest_call_timeout: Duration,
    catalogs: Mutex<HashMap<(AccessContext, u64, u64), Arc<Catalog>>>,
    /// OpenTelemetry export (off unless configured): fed after each call's line is written.
    pub telemetry: Telemetry,
    /// The config's `[[budgets]]` (none by default).
    pub budgets: Budgets,
    /// The calls waiting for a person's approval, and how long they wait.
    pub approvals: Approvals,
    /// The registry generation the policy set was last validated against (argument types).
    typed_generation: AtomicU64,
    /// The secret values given to upstream instances, by principal: replaced by
    /// `[redacted: NAME]` in what a call returns and in what the record keeps of its arguments.
    pub known_secrets: Arc<crate::secrets::Known>,
    /// People's sign-ins to remote servers (`grant = "authorization_code"`; with `[page]`).
    pub signins: Option<Arc<crate::upstream::signin::SignIns>>,
    /// The subject tokens hosts handed in at turn open, by principal (`grant = "token_exchange"`).
    pub subject_tokens: Arc<crate::upstream::exchange::SubjectTokens>,
}

fn requirement_of(resolved: &Resolved) -> Requirement {
    resolved.resource.requirement(&resolved.action)
}

/// How a wait for a person ended: the approval's id, a word for how (`approved`, `denied`,
/// `timeout`, `cancelled`, or `failed` when the broker could not record it; the call's span
/// carries both), and `Ok` to run the call or how it ends instead.
struct Held {
    id: String,
    ended: &'static str,
    result: Result<(), Box<Ending>>,
}

/// What a call site is told when its call starts waiting for a person: the pending approval and
/// the longest it will wait.
pub type OnWait<'a> = &'a (dyn Fn(&PendingApproval, Duration) + Sync);

/// How a call site asks the call's principal (`@approval("principal")`): the bridge connection
/// it came on (the one connection whose answer is taken) and how the question reaches its shim.
pub struct Ask<'a> {
    pub bridge: u64,
    pub send: &'a (dyn Fn(&PendingApproval, Question) + Sync),
}

/// Everything `invoke` needs to know about where a call came from.
pub struct CallSite<'a> {
    pub turn: &'a str,
    pub call_id: String,
    pub context: &'a AccessContext,
    pub catalog: &'a Catalog,
    /// The turn's column identity, last on the call's record lines.
    pub identity: Option<&'a SystemIdentity>,
    /// The turn's places for blocking work (list, search, write), if it has a bound.
    pub blocking: Option<&'a Arc<tokio::sync::Semaphore>>,
    /// What the turn has used of its per-turn budgets (`None`: budgets are not counted).
    pub budget: Option<&'a TurnUse>,
    /// Told when the call starts waiting for a person's approval, and for how long at most.
    pub on_wait: Option<OnWait<'a>>,
    /// How to ask the call's principal in the harness; `None`: there is no harness to ask.
    pub ask: Option<Ask<'a>>,
}

/// What a call's span carries besides its answer: the approval it waited for (its id and how
/// that ended), and the span's ids chosen as the call started (what an upstream was told).
struct SpanNotes {
    approval: Option<(String, &'static str)>,
    ids: Option<(opentelemetry::trace::TraceId, opentelemetry::trace::SpanId)>,
}

impl SpanNotes {
    fn new(
        approval: Option<(String, &'static str)>,
        ids: Option<(opentelemetry::trace::TraceId, opentelemetry::trace::SpanId)>,
    ) -> Self {
        Self { approval, ids }
    }
}

impl Kernel {
    pub fn new(
        registry: Registry,
        policy: PolicyEngine,
        recorder: Recorder,
        redact_arguments: bool,
        call_timeout: Duration,
    ) -> Self {
        let longest_call_timeout = registry
            .providers
            .iter()
            .map(|p| p.call_timeout())
            .fold(call_timeout, Duration::max);
        Self {
            registry,
            policy,
            recorder,
            redact_arguments,
            record_max_argument_bytes: crate::config::DEFAULT_RECORD_MAX_ARGUMENT_BYTES,
            call_timeout,
            longest_call_timeout,
            catalogs: Mutex::new(HashMap::new()),
            telemetry: Telemetry::off(),
            budgets: Budgets::default(),
            approvals: Approvals::new(crate::config::DEFAULT_APPROVAL_TIMEOUT),
            typed_generation: AtomicU64::new(u64::MAX),
            known_secrets: Arc::new(crate::secrets::Known::default()),
            signins: None,
            subject_tokens: Arc::default(),
        }
    }

    /// How long a shim should wait for any answer before it gives up on it: the longest call
    /// timeout plus [`ANSWER_MARGIN`] for the decision and the record's sync.
    pub fn answer_deadline(&self) -> Duration {
        self.longest_call_timeout + ANSWER_MARGIN
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The policy set validated against the tools' argument types, when the tools changed since
    /// the last time (at start, and when an upstream's tools drift). `Err` names policies that
    /// read an argument no tool has: refused at start; later the set stays in force and the
    /// error is logged as a warning (the caller says so).
    pub fn validate_arguments(&self) -> Result<Vec<String>, crate::policy::PolicyError> {
        let generation = self
            .registry
            .generation
            .load(std::sync::atomic::Ordering::Relaxed);
        if self
            .typed_generation
            .swap(generation, std::sync::atomic::Ordering::Relaxed)
            == generation
        {
            return Ok(self.policy.argument_warnings());
        }
        self.policy
            .set_argument_types(self.registry.argument_types())
    }

    /// [`validate_arguments`](Self::validate_arguments) while serving: what it finds is logged.
    fn revalidate_arguments(&self) {
        let generation = self
            .registry
            .generation
            .load(std::sync::atomic::Ordering::Relaxed);
        if self
            .typed_generation
            .load(std::sync::atomic::Ordering::Relaxed)
            == generation
        {
            return;
        }
        match self.validate_arguments() {
            Ok(warnings) => {
                for w in warnings {
                    tracing::warn!(policy = %self.policy.policy_path().display(), "{}", w.trim());
                }
            }
            Err(e) => tracing::warn!(
                policy = %self.policy.policy_path().display(),
                "the tools changed and the policy set in force no longer validates against their arguments (it stays in force; fix it and `policy reload`): {e}"
            ),
        }
    }

    /// What `providers` shows: built-in providers, then brokered ones with their state.
    pub fn provider_statuses(&self) -> Vec<Value> {
        self.revalidate_arguments();
        let mut builtin: Vec<(&str, &str, Vec<String>)> = Vec::new();
        for t in &self.registry.tools {
            let h = &t.authority.handler;
            match builtin.iter_mut().find(|(ns, _, _)| *ns == h.namespace()) {
                Some((_, _, names)) => names.push(t.name.to_string()),
                None => builtin.push((h.namespace(), h.kind(), vec![t.name.to_string()])),
            }
        }
        let mut out: Vec<Value> = builtin
            .into_iter()
            .map(|(ns, kind, tools)| json!({"namespace": ns, "type": kind, "state": "ready", "tools": tools, "rejected": []}))
            .collect();
        out.extend(self.registry.providers.iter().map(|p| p.status()));
        // What policies cannot see of each tool's arguments (`context.arguments`), and what the
        // last validation of the policy set against the tools' arguments found (on each brokered
        // provider: their tools come and go).
        let left_out = self.registry.arguments_left_out();
        let warnings = self.policy.argument_warnings();
        for status in &mut out {
            if !warnings.is_empty()
                && status.get("type").and_then(Value::as_str) == Some("mcp")
                && let Some(o) = status.as_object_mut()
            {
                o.insert("policy_warnings".into(), json!(warnings));
            }
            let Some(tools) = status.get("tools").and_then(Value::as_array).cloned() else {
                continue;
            };
            let notes: Map<String, Value> = left_out
                .iter()
                .filter(|(name, _)| tools.iter().any(|t| t.as_str() == Some(name)))
                .map(|(name, notes)| (name.clone(), json!(notes)))
                .collect();
            if !notes.is_empty()
                && let Some(o) = status.as_object_mut()
            {
                o.insert("arguments_left_out".into(), Value::Object(notes));
            }
        }
        out
    }

    /// The effective catalogue for a context: every registered tool that some call could be
    /// permitted, decided once per requirement shape (action, resource type), not per tool.
    pub fn catalog(&self, context: &AccessContext) -> Arc<Catalog> {
        self.revalidate_arguments();
        let pv = self.policy.current();
        let generation = self
            .registry
            .generation
            .load(std::sync::atomic::Ordering::Relaxed);
        let key = (context.clone(), pv.version, generation);
        if let Ok(cache) = self.catalogs.lock()
            && let Some(c) = cache.get(&key)
        {
            return c.clone();
        }
        // File tools: per (action, type, namespace), the namespace being known before the call
        // (where some policy reads it: otherwise every namespace is answered alike); and, when
        // a policy reads the arguments, per argument names too (a tool's only part of
        // `context.arguments` known before the call is which arguments it can have).
        let mut shapes: HashMap<(&str, &str, &str, String), bool> = HashMap::new();
        let per_arguments = pv.reads_any_arguments();
        let per_namespace = pv.reads_resource_attribute("namespace");
        // For tools whose resource is the tool itself: one type-level answer per action, and
        // a per-tool evaluation only where the answer depends on which tool it is.
        let mut tool_shapes: HashMap<&str, Option<bool>> = HashMap::new();
        // Tools whose answer depends on the tool, per action: decided together below.
        let mut per_tool: HashMap<&str, Vec<Arc<Registered>>> = HashMap::new();
        let mut visible_tools: Vec<Arc<Registered>> = Vec::new();
        let registered = self.registry.tools_for(context);
        for tool in &registered {
            let shape = tool.authority.handler.shape();
            let visible = if shape.1 == "Tool" {
                let per_type = *tool_shapes.entry(shape.0).or_insert_with(|| {
                    self.policy.permit_for_every(&pv, context, shape.0, shape.1)
                });
                match per_type {
                    Some(answer) => answer,
                    None => {
                        per_tool.entry(shape.0).or_default().push(tool.clone());
                        continue;
                    }
                }
            } else {
                let namespace = if shape.1 == "File" && per_namespace {
                    tool.authority.handler.namespace()
                } else {
                    ""
                };
                let typing = per_arguments
                    .then(|| crate::policy::arguments::typing(tool.input_schema.as_ref()));
                let which = typing
                    .as_ref()
                    .map(|t| {
                        t.fields
                            .keys()
                            .map(String::as_str)
                            .collect::<Vec<_>>()
                            .join("\0")
                    })
                    .unwrap_or_default();
                *shapes
                    .entry((shape.0, shape.1, namespace, which))
                    .or_insert_with(|| {
                        let known = if namespace.is_empty() {
                            vec![]
                        } else {
                            vec![("namespace", json!(namespace))]
                        };
                        self.policy.could_permit_known(
                            &pv,
                            context,
                            shape.0,
                            shape.1,
                            &known,
                            typing.as_ref(),
                        )
                    })
            };
            if visible {
                visible_tools.push(tool.clone());
            }
        }
        for (action, tools) in per_tool {
            let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
            let typings: Vec<crate::policy::arguments::Typing> = if per_arguments {
                tools
                    .iter()
                    .map(|t| crate::policy::arguments::typing(t.input_schema.as_ref()))
                    .collect()
            } else {
                vec![]
            };
            let answers = self
                .policy
                .permitted_tools_with(&pv, context, action, &names, &typings);
            visible_tools.extend(
                tools
                    .iter()
                    .zip(answers)
                    .filter(|(_, visible)| *visible)
                    .map(|(t, _)| t.clone()),
            );
        }
        // Names are unique and ASCII: byte order is the hash's order.
        visible_tools.sort_by(|a, b| a.name.cmp(&b.name));
        let parts: Option<Vec<&str>> = visible_tools
            .iter()
            .map(|t| published(t).canonical.as_deref())
            .collect();
        // Published definitions are plain JSON values; canonicalization cannot fail on them.
        // If it ever did, an empty catalogue is the safe answer.
        let (tools, hash, by_name) = match parts {
            Some(parts) => (
                visible_tools
                    .iter()
                    .map(|t| published(t).definition.clone())
                    .collect(),
                sharedos_proto::catalog::catalog_hash_of_sorted(parts),
                visible_tools
                    .iter()
                    .map(|t| (t.name.to_string(), t.clone()))
                    .collect(),
            ),
            None => (
                Vec::new(),
                sharedos_proto::catalog::hash_canonical("[]"),
                HashMap::new(),
            ),
        };
        let catalog = Arc::new(Catalog {
            tools,
            hash,
            by_name,
            policy_version: pv.version,
        });
        if let Ok(mut cache) = self.catalogs.lock() {
            if cache.len() >= CATALOG_CACHE_MAX {
                cache.clear();
            }
            cache.insert(key, catalog.clone());
        }
        catalog
    }

    /// Does a turn's context fit the schema for every requirement shape the registry has? See
    /// [`PolicyEngine::check_context`].
    pub fn check_context(&self, context: &AccessContext) -> Result<(), String> {
        let mut shapes: Vec<(String, String)> = Vec::new();
        for tool in self.registry.tools_for(context) {
            let (action, ty) = tool.authority.handler.shape();
            if !shapes.iter().any(|(a, t)| a == action && t == ty) {
                shapes.push((action.to_owned(), ty.to_owned()));
            }
        }
        let shapes: Vec<(&str, &str)> = shapes
            .iter()
            .map(|(a, t)| (a.as_str(), t.as_str()))
            .collect();
        self.policy
            .check_context(&self.policy.current(), context, &shapes)
    }

    /// The context a call of `tool` with `arguments` is decided in, as JSON (`policy check`
    /// prints it): `agent`, `turn` and the typed `arguments`. `None` when the tool is not in
    /// the catalogue or its arguments are not an object.
    pub fn seen_context(
        &self,
        context: &AccessContext,
        catalog: &Catalog,
        tool: &str,
        arguments: Option<&Value>,
    ) -> Option<Value> {
        let registered = catalog.by_name.get(tool)?;
        let empty = Map::new();
        let arguments = match arguments {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(_) => return None,
        };
        let typed = crate::policy::arguments::typed(registered.input_schema.as_ref(), arguments);
        Some(PolicyEngine::context_shown(context, Some(&typed)))
    }

    /// Everything before execution: the refusals, or the permission with its requirement.
    pub fn check(
        &self,
        context: &AccessContext,
        catalog: &Catalog,
        tool: &str,
        arguments: Option<&Value>,
    ) -> Verdict {
        self.check_rejecting(context, catalog, tool, arguments, None)
    }

    /// [`Kernel::check`], for a call whose arguments could not be passed on (`rejected`): it is
    /// refused `failed/invalid_arguments` once its name and publication are checked.
    fn check_rejecting(
        &self,
        context: &AccessContext,
        catalog: &Catalog,
        tool: &str,
        arguments: Option<&Value>,
        rejected: Option<&str>,
    ) -> Verdict {
        // Nothing a caller sends may take the call path down: a panic in the check (a bug) is
        // contained here and becomes `failed/internal`, answered and recorded like any outcome.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.check_contained(context, catalog, tool, arguments, rejected)
        }))
        .unwrap_or_else(|_| {
            tracing::error!(tool = %sharedos_proto::name::shown(tool), "the kernel's check panicked; the call fails as internal");
            Verdict::Refused {
                outcome: Outcome::Failed(FailCode::Internal),
                message: format!(
                    "failed: {} — an internal error in the broker stopped the check; it was recorded",
                    sharedos_proto::name::shown(tool)
                ),
                requirement: None,
                policies: vec![],
            }
        })
    }

    /// The decision itself, in its order: the tool looked up in the turn's catalogue, the
    /// arguments checked against its input schema, the requirement resolved from them, and the
    /// policy's decision on it. Each step either hands on or refuses.
    fn check_contained(
        &self,
        context: &AccessContext,
        catalog: &Catalog,
        tool: &str,
        arguments: Option<&Value>,
        rejected: Option<&str>,
    ) -> Verdict {
        let checked = look_up(catalog, tool, rejected).and_then(|registered| {
            let arguments = checked_arguments(registered, tool, arguments)?;
            let resolved = self.resolve_requirement(registered, tool, &arguments)?;
            Ok(self.decide_on(context, registered, tool, arguments, resolved))
        });
        checked.unwrap_or_else(|(outcome, message)| refused(outcome, message))
    }

    /// The requirement resolved from the arguments; an operator's entity whose attributes (from
    /// the arguments) do not fit its schema cannot be decided on: said so, rather than a deny
    /// for no visible reason.
    fn resolve_requirement(
        &self,
        registered: &Registered,
        tool: &str,
        arguments: &Map<String, Value>,
    ) -> Result<Resolved, Refusal> {
        let unresolvable = |why: String| {
            (
                Outcome::Denied(DenyCode::UnresolvableRequirement),
                format!("denied: {tool} could not resolve the resource it would touch: {why}"),
            )
        };
        let resolved = resolve(registered, arguments).map_err(unresolvable)?;
        if matches!(resolved.resource, Resource::Entity { .. })
            && let Err(why) = self.policy.check_resource(&resolved.resource)
        {
            return Err(unresolvable(format!(
                "{} does not fit the schema: {why}",
                resolved.resource.display()
            )));
        }
        Ok(resolved)
    }

    /// The policy's decision on a resolved requirement, with `context.arguments` (what the
    /// policy sees of the arguments, typed by the tool's own schema, which they passed) made
    /// only when the policy set reads them.
    fn decide_on(
        &self,
        context: &AccessContext,
        registered: &Arc<Registered>,
        tool: &str,
        arguments: Map<String, Value>,
        resolved: Resolved,
    ) -> Verdict {
        let pv = self.policy.current();
        let typed = pv
            .reads_any_arguments()
            .then(|| crate::policy::arguments::typed(registered.input_schema.as_ref(), &arguments));
        let decision = self.policy.decide_with(
            &pv,
            context,
            &resolved.action,
            &resolved.resource,
            typed.as_ref(),
        );
        if decision.allowed {
            return Verdict::Permitted {
                tool: registered.clone(),
                resolved: Box::new(resolved),
                arguments,
                policies: decision.policies,
                approval: decision.approval,
            };
        }
        if !decision.errors.is_empty() {
            tracing::warn!(tool, errors = ?decision.errors, "policy evaluation errors (treated as deny)");
        }
        let (code, why) = if decision.forbidden {
            (
                DenyCode::Forbidden,
                format!("forbidden by policy {}", decision.policies.join(", ")),
            )
        } else {
            (
                DenyCode::NoPermit,
                format!(
                    "no policy permits {} on this {}",
                    resolved.action,
                    resource_noun(&resolved.resource)
                ),
            )
        };
        Verdict::Refused {
            outcome: Outcome::Denied(code),
            message: format!("denied: {tool} of {} — {why}", resolved.resource.short()),
            requirement: Some(requirement_of(&resolved)),
            policies: decision.policies,
        }
    }

    /// The single call path, as the ADR's steps. Returns once the call's record line is as
    /// durable as configured.
    ///
    /// 1. [`admit`](Self::admit): the broker's own bounds on what any client sends;
    /// 2. [`decide`](Self::decide): the requirement resolved from the arguments, and Cedar's
    ///    decision on it;
    /// 3. a permitted call cancelled before it started is recorded so, never run;
    /// 4. [`hold_for_approval`](Self::hold_for_approval): a permit that asks for a person waits
    ///    for one, and is decided again;
    /// 5. [`run_permitted`](Self::run_permitted): budgets, the write-ahead intent, the run;
    /// 6. [`finish`](Self::finish): redaction and the record line, before the answer leaves;
    ///    then the bytes it returned count against its byte budgets.
    pub async fn invoke(
        self: &Arc<Self>,
        site: CallSite<'_>,
        mut call: ToolCall,
        cancel: CancellationToken,
        cancel_cause: impl Fn() -> CancelCode,
    ) -> CallAnswer {
        let started = Instant::now();
        let (trace, span_ids) = self.admit(&mut call);
        let mut verdict = self.decide(&site, &call);
        if cancel.is_cancelled()
            && let Some(ending) = cancelled_before_start(&call, &verdict, cancel_cause())
        {
            let notes = SpanNotes::new(None, span_ids);
            return self
                .finish(&site, &call, started, ending, None, notes)
                .await;
        }
        // For the call's span: the approval it waited for, and how that ended.
        let approval = match self
            .approve_if_asked(&site, &call, &mut verdict, &cancel, &cancel_cause)
            .await
        {
            Ok(approval) => approval,
            Err((approval, ending)) => {
                let notes = SpanNotes::new(Some(approval), span_ids);
                return self
                    .finish(&site, &call, started, *ending, None, notes)
                    .await;
            }
        };
        let mut ran = Ran::default();
        let ending = self
            .run_verdict(
                &site,
                &call,
                verdict,
                trace,
                &cancel,
                &cancel_cause,
                &mut ran,
            )
            .await;
        let notes = SpanNotes::new(approval, span_ids);
        let answer = self
            .finish(&site, &call, started, ending, ran.forwarded, notes)
            .await;
        self.count_returned(ran.counting, &answer);
        answer
    }

    /// Step 4 when the permit asks for a person: waits ([`hold_for_approval`](Self::hold_for_approval))
    /// and puts the new verdict in `verdict`. `Ok` with the approval's notes for the call's span
    /// (`None`: nobody was asked), `Err` with them and how the call ended instead.
    async fn approve_if_asked(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        verdict: &mut Verdict,
        cancel: &CancellationToken,
        cancel_cause: &impl Fn() -> CancelCode,
    ) -> Result<Option<(String, &'static str)>, ((String, &'static str), Box<Ending>)> {
        let Verdict::Permitted {
            approval: Some(by),
            resolved,
            policies,
            ..
        } = &*verdict
        else {
            return Ok(None);
        };
        let subject = Subject::of(call, resolved, policies);
        let by = *by;
        match self
            .hold_for_approval(site, call, subject, by, cancel, cancel_cause)
            .await
        {
            (notes, Ok(now)) => {
                *verdict = now;
                Ok(Some(notes))
            }
            (notes, Err(ending)) => Err((notes, ending)),
        }
    }

    /// Step 5 for whatever the verdict is now: a refusal ends as decided; a permit runs
    /// ([`run_permitted`](Self::run_permitted)).
    #[allow(clippy::too_many_arguments)]
    async fn run_verdict<'s>(
        self: &Arc<Self>,
        site: &CallSite<'s>,
        call: &ToolCall,
        verdict: Verdict,
        trace: Option<crate::telemetry::Outgoing>,
        cancel: &CancellationToken,
        cancel_cause: &impl Fn() -> CancelCode,
        ran: &mut Ran<'s>,
    ) -> Ending {
        match verdict {
            Verdict::Refused {
                outcome,
                message,
                requirement,
                policies,
            } => (outcome, Some(message), requirement, policies, None),
            Verdict::Permitted {
                tool,
                resolved,
                arguments,
                policies,
                approval: _,
            } => {
                let permit = Permit {
                    tool,
                    resolved,
                    arguments,
                    policies,
                    trace,
                };
                self.run_permitted(site, call, permit, cancel, cancel_cause, ran)
                    .await
            }
        }
    }

    /// The bytes are counted from the answer that leaves, then the gate opens for the next.
    fn count_returned(&self, counting: Option<Counting<'_>>, answer: &CallAnswer) {
        if let Some((settled, used, Some(taken))) = counting {
            let bytes = returned_bytes(
                &answer.content,
                answer.structured_content.as_ref(),
                answer.message.as_deref(),
            );
            self.budgets.add_bytes(used, &taken, bytes);
            drop(settled);
        }
    }

    /// Step 1: the broker's own bounds, whoever sent the call (a client that bypasses the shim
    /// too). A trace context past the W3C limits is dropped now, not held while the call runs;
    /// arguments nested deeper than the limit are refused and recorded without them. Returns
    /// what an upstream server is told of the trace, and the call span's own ids.
    fn admit(
        &self,
        call: &mut ToolCall,
    ) -> (
        Option<crate::telemetry::Outgoing>,
        Option<(opentelemetry::trace::TraceId, opentelemetry::trace::SpanId)>,
    ) {
        crate::telemetry::bound_trace_context(&mut call.traceparent, &mut call.tracestate);
        let trace = self
            .telemetry
            .outgoing(call.traceparent.as_deref(), call.tracestate.as_deref());
        if let Some(args) = &call.arguments {
            let depth = sharedos_proto::nesting::value_depth(args);
            if depth > sharedos_proto::nesting::MAX_ARGUMENT_DEPTH {
                call.arguments = None;
                call.rejected_arguments = Some(format!(
                    "the arguments are nested {depth} levels deep; tool arguments may be nested at most {} levels",
                    sharedos_proto::nesting::MAX_ARGUMENT_DEPTH
                ));
            }
        }
        trace
    }

    /// Step 2: the call's requirement resolved from its own arguments, and the policy's decision
    /// on it (see [`check_rejecting`](Self::check_rejecting)).
    fn decide(&self, site: &CallSite<'_>, call: &ToolCall) -> Verdict {
        self.check_rejecting(
            site.context,
            site.catalog,
            &call.tool,
            call.arguments.as_ref(),
            call.rejected_arguments.as_deref(),
        )
    }

    /// Step 4: a permitted call whose permit asks for a person waits for one
    /// ([`approval`](Self::approval)). Approved, it is decided again under the policy in force
    /// now (a permit that still asks for approval has it), and runs only if its arguments
    /// resolve to exactly what was approved (a link re-pointed meanwhile does not carry the
    /// approval). Returns the approval's id and how it ended, and the new verdict or how the
    /// call ends instead.
    async fn hold_for_approval(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        subject: Subject,
        by: crate::policy::Approver,
        cancel: &CancellationToken,
        cancel_cause: &impl Fn() -> CancelCode,
    ) -> ((String, &'static str), Result<Verdict, Box<Ending>>) {
        let Subject {
            what,
            requirement,
            policies,
            approved,
        } = subject;
        let held = self
            .approval(
                site,
                call,
                &what,
                requirement.clone(),
                policies.clone(),
                cancel,
                by,
            )
            .await;
        let notes = (held.id.clone(), held.ended);
        if let Err(mut ending) = held.result {
            if ending.0 == Outcome::Cancelled(CancelCode::ClientCancelled) {
                ending.0 = Outcome::Cancelled(cancel_cause());
            }
            return (notes, Err(ending));
        }
        let verdict = self.decide(site, call);
        let why = changed_since_approval(&approved, requirement.as_ref(), &verdict);
        let Some(why) = why else {
            return (notes, Ok(verdict));
        };
        let ending = (
            Outcome::Denied(DenyCode::ApprovalStale),
            Some(format!(
                "denied: {what} — a person approved it (approval {}), but {why} while it waited, so the approval does not cover it and nothing was run; call it again to ask for an approval of what it names now",
                held.id
            )),
            requirement,
            policies,
            None,
        );
        (notes, Err(Box::new(ending)))
    }

    /// Step 5: a permitted call's budgets, its write-ahead intent, and its run under its time
    /// limit; a cancellation that comes first wins (the job is then never polled: not run).
    async fn run_permitted<'s>(
        self: &Arc<Self>,
        site: &CallSite<'s>,
        call: &ToolCall,
        permit: Permit,
        cancel: &CancellationToken,
        cancel_cause: &impl Fn() -> CancelCode,
        ran: &mut Ran<'s>,
    ) -> Ending {
        let Permit {
            tool,
            resolved,
            arguments,
            policies,
            trace,
        } = permit;
        let requirement = Some(requirement_of(&resolved));
        let what = format!("{} of {}", call.tool, resolved.resource.short());
        let before = if cancel.is_cancelled() {
            Err(not_started(&what, cancel_cause()))
        } else {
            self.take_budget(site, &tool, &what, cancel, cancel_cause, &mut ran.counting)
                .await
        };
        let before = match before {
            Ok(()) => {
                self.record_intent(site, call, &tool, &requirement, &what)
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err((outcome, message)) = before {
            return (outcome, message, requirement, policies, None);
        }
        // Only a call that runs has forwarded arguments on its line.
        ran.forwarded.clone_from(&resolved.forwarded);
        let context = site.context.clone();
        let (job, timeout) = self.job(
            tool,
            *resolved,
            arguments,
            context,
            site.blocking.cloned(),
            trace,
        );
        let (outcome, message, content) =
            run_under_limit(job, timeout, cancel, cancel_cause, &what).await;
        (outcome, message, requirement, policies, content)
    }

    /// Budgets, last before the call runs: a call refused before here uses none. A call counting
    /// bytes first waits until the calls ahead of it on the same byte limit have counted theirs
    /// (at most the call's own time limit), so at most one call crosses it, and keeps its place
    /// (`counting`) until its answer's bytes are added.
    async fn take_budget<'s>(
        &self,
        site: &CallSite<'s>,
        tool: &Registered,
        what: &str,
        cancel: &CancellationToken,
        cancel_cause: &impl Fn() -> CancelCode,
        counting: &mut Option<Counting<'s>>,
    ) -> Result<(), (Outcome, Option<String>)> {
        let Some(used) = site.budget.filter(|_| !self.budgets.is_empty()) else {
            return Ok(());
        };
        let (name, namespace) = (tool.name.as_str(), tool.authority.handler.namespace());
        if self.budgets.counts_bytes(name, namespace) {
            let wait = tool.authority.handler.timeout(self.call_timeout);
            tokio::select! {
                s = self.budgets.settle(used, name, namespace) => *counting = Some((s, used, None)),
                _ = cancel.cancelled() => return Err((Outcome::Cancelled(cancel_cause()), None)),
                _ = tokio::time::sleep(wait) => return Err((
                    Outcome::Failed(FailCode::Timeout),
                    Some(format!(
                        "failed: {what} — the calls ahead of it on the same byte budget did not finish within {} s; it was not run",
                        wait.as_secs_f64()
                    )),
                )),
            }
        }
        match self
            .budgets
            .take(used, &site.context.principal, name, namespace)
        {
            Ok(t) => {
                if let Some((_, _, taken)) = counting.as_mut() {
                    *taken = t.counts_bytes().then_some(t);
                }
                Ok(())
            }
            Err(Exhausted(why)) => Err((
                Outcome::Denied(DenyCode::BudgetExhausted),
                Some(format!("denied: {what} — {why}")),
            )),
        }
    }

    /// Write-ahead: a call that can change state is on record, as durable as the record is,
    /// before it runs; its outcome line follows. A crash in between leaves the intent, which the
    /// next start closes as `unknown`. A call whose intent cannot be recorded is not run.
    async fn record_intent(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        tool: &Registered,
        requirement: &Option<Requirement>,
        what: &str,
    ) -> Result<(), (Outcome, Option<String>)> {
        if !tool
            .authority
            .handler
            .changes_state(tool.annotations.as_ref())
        {
            return Ok(());
        }
        let intent = self.intent_record(site, call, requirement);
        self.recorder.append(&intent).await.map(|_| ()).map_err(|e| {
            tracing::error!(error = %e, call_id = %site.call_id, "intent not recorded: the call is not run");
            (
                Outcome::Failed(FailCode::Internal),
                Some(format!(
                    "failed: {what} — the broker could not record the call before running it ({e}); it was not run"
                )),
            )
        })
    }

    /// Holds a permitted call for a person: records `approval_requested`, waits for a decision
    /// (see [`wait_for_person`](Self::wait_for_person)), and records `approval_decided`.
    /// The result is `Ok` when approved; otherwise how the call ends (a cancellation as
    /// `client_cancelled`, which the caller replaces with the real cause).
    #[allow(
        clippy::too_many_arguments,
        reason = "the call, what it resolved to, and who may answer"
    )]
    async fn approval(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        what: &str,
        requirement: Option<Requirement>,
        policies: Vec<String>,
        cancel: &CancellationToken,
        by: crate::policy::Approver,
    ) -> Held {
        let info = pending_approval(site, call, requirement.as_ref(), self.approvals.timeout);
        let id = info.id.clone();
        let internal = |why: String| Held {
            id: id.clone(),
            ended: "failed",
            result: Err(Box::new((
                Outcome::Failed(FailCode::Internal),
                Some(format!("failed: {what} — {why}; it was not run")),
                requirement.clone(),
                policies.clone(),
                None,
            ))),
        };
        // On record before anyone can see it waiting.
        if let Err(e) = self
            .record_approval_requested(site, call, &info, &policies)
            .await
        {
            tracing::error!(error = %e, call_id = %site.call_id, "approval_requested not recorded");
            return internal(format!(
                "the broker could not record the approval request ({e})"
            ));
        }
        let Some(ticket) = self.approvals.wait(info.clone(), by) else {
            return internal(format!("approval {id} is already taken"));
        };
        if let Some(on_wait) = site.on_wait {
            on_wait(&info, self.approvals.timeout);
        }
        let waited = self
            .wait_for_person(site, call, &info, (by, &policies), ticket, cancel)
            .await;
        if let Err(e) = self.record_approval_decided(site, &id, &waited).await {
            tracing::error!(error = %e, call_id = %site.call_id, "approval_decided not recorded");
            return internal(format!(
                "the broker could not record the approval decision ({e})"
            ));
        }
        let ask = AskedAbout {
            what,
            id: &id,
            timeout: self.approvals.timeout,
        };
        let (ended, result) = approval_ending(waited, &ask, requirement, policies);
        Held { id, ended, result }
    }

    async fn record_approval_requested(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        info: &PendingApproval,
        policies: &[String],
    ) -> Result<(), crate::evidence::record::RecordError> {
        let (tool, request_id, cut) = recorded_strings(call);
        let arguments = self.without_secrets(
            &info.principal,
            info.arguments.clone(),
            &mut BTreeSet::new(),
        );
        let requested = Event::ApprovalRequested(record::ApprovalRequested {
            turn: site.turn.to_owned(),
            call_id: site.call_id.clone(),
            request_id,
            approval: info.id.clone(),
            principal: info.principal.clone(),
            tool,
            arguments: Some(self.recorded(arguments)),
            requirement: info.requirement.clone(),
            policies: policies.to_vec(),
            expires_at: info.expires_at.clone(),
            cut,
            system_identity: site.identity.cloned(),
        });
        self.recorder.append(&requested).await.map(|_| ())
    }

    /// The wait itself: the principal is asked (see [`Self::ask_person`]); a `principal`
    /// approval that cannot be asked is refused now. Otherwise the first of a decision, the
    /// call's cancellation and the time limit.
    async fn wait_for_person(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        info: &PendingApproval,
        (by, policies): (crate::policy::Approver, &[String]),
        mut ticket: crate::approval::Ticket<'_>,
        cancel: &CancellationToken,
    ) -> Waited {
        if let Err(why) = self.ask_person(site, call, info, (by, policies)) {
            ticket.withdraw();
            return Waited::Decided(Approval {
                approve: false,
                by: None,
                reason: Some(why),
                principal: None,
                unavailable: true,
                page: None,
            });
        }
        let timeout = self.approvals.timeout;
        tokio::select! {
            d = &mut ticket.answer => d.map_or(Waited::TimedOut, Waited::Decided),
            _ = cancel.cancelled() => Waited::Cancelled(ticket.withdraw()),
            _ = tokio::time::sleep(timeout) => ticket.withdraw().map_or(Waited::TimedOut, Waited::Decided),
        }
    }

    /// Puts the question where the person answers it: in the harness the call came from; with
    /// the person's page configured, on the page with a one-time link, the harness getting the
    /// link to show (a URL-mode elicitation) and no answer through the harness taken (a call
    /// from no harness waits on the page too). `Err` with why when a `principal` approval
    /// cannot be asked at all (no page, and the call came from no harness).
    fn ask_person(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        info: &PendingApproval,
        (by, policies): (crate::policy::Approver, &[String]),
    ) -> Result<(), String> {
        if !by.asks_principal() {
            return Ok(());
        }
        let question = || {
            crate::approval::question(
                &call.tool,
                info.requirement.as_ref().map(|r| r.resource.as_str()),
                &info.arguments,
                self.redact_arguments,
                &info.expires_at,
            )
        };
        if self.approvals.page().is_some() {
            let link =
                self.approvals
                    .put_on_page(&info.id, site.context.agent.clone(), policies.to_vec());
            if let (Some(link), Some(ask)) = (link, &site.ask) {
                let mut q = question();
                q.message = format!(
                    "An agent acting for you asks to run `{}`. Open this link to see the call and approve or deny it (unanswered by {}, it is refused).",
                    q.tool, info.expires_at
                );
                q.url = Some(link.to_string());
                (ask.send)(info, q);
            }
            return Ok(());
        }
        match &site.ask {
            Some(ask) => {
                if self.approvals.ask(&info.id, ask.bridge) {
                    (ask.send)(info, question());
                }
                Ok(())
            }
            None if by.operator_may() => Ok(()),
            None => Err("the call came from no harness session".to_owned()),
        }
    }

    async fn record_approval_decided(
        &self,
        site: &CallSite<'_>,
        id: &str,
        waited: &Waited,
    ) -> Result<(), crate::evidence::record::RecordError> {
        let (decision, uid, reason, answerer, session) = match waited {
            Waited::Decided(d) | Waited::Cancelled(Some(d)) => (
                if d.unavailable {
                    "unavailable"
                } else if d.approve {
                    "approved"
                } else {
                    "denied"
                },
                d.by,
                d.reason.clone(),
                match (&d.principal, d.unavailable, &d.page) {
                    (_, true, _) => None,
                    // The person, signed in on the page with the identity provider.
                    (_, false, Some(_)) => Some(BY_PRINCIPAL.to_owned()),
                    // A form answered through the harness proves only that the turn token's
                    // holder answered, not that the person did (issue 45).
                    (Some(_), false, None) => Some(BY_HARNESS_SESSION.to_owned()),
                    (None, false, None) => Some(BY_OPERATOR.to_owned()),
                },
                d.principal.clone(),
            ),
            Waited::TimedOut => ("timeout", None, None, None, None),
            Waited::Cancelled(None) => ("cancelled", None, None, None, None),
        };
        let page = match waited {
            Waited::Decided(d) | Waited::Cancelled(Some(d)) => d.page.as_ref(),
            _ => None,
        };
        let decided = Event::ApprovalDecided(record::ApprovalDecided {
            turn: site.turn.to_owned(),
            call_id: site.call_id.clone(),
            approval: id.to_owned(),
            decision: decision.to_owned(),
            decided_by: uid,
            reason,
            by: answerer,
            session,
            via: page.map(|_| "page".to_owned()),
            subject: page.map(|p| p.subject.clone()),
            system_identity: site.identity.cloned(),
        });
        self.recorder.append(&decided).await.map(|_| ())
    }
    /// Makes a call's answer, and its record line, which must be written before it leaves.
    async fn finish(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        started: Instant,
        (outcome, message, requirement, policies, content): Ending,
        forwarded: Option<Map<String, Value>>,
        SpanNotes { approval, ids }: SpanNotes,
    ) -> CallAnswer {
        let duration = started.elapsed();
        let mut answer = CallAnswer {
            outcome,
            call_id: site.call_id.clone(),
            tool: call.tool.clone(),
            message,
            content: vec![],
            structured_content: None,
            requirement,
            policies,
        };
        match content {
            Some(Ok(success)) => {
                answer.content = success.content;
                answer.structured_content = success.structured;
            }
            // Content a provider returned with its error is passed through after the message.
            Some(Err(content)) => answer.content = content,
            None => {}
        }
        // A secret given to this principal's upstream never leaves in a result or a message.
        let mut redacted = BTreeSet::new();
        if !self.known_secrets.is_empty() {
            let principal = &site.context.principal;
            for block in &mut answer.content {
                self.known_secrets
                    .redact_value(principal, block, &mut redacted);
            }
            if let Some(s) = answer.structured_content.as_mut() {
                self.known_secrets.redact_value(principal, s, &mut redacted);
            }
            if let Some(m) = answer.message.as_mut() {
                self.known_secrets.redact_text(principal, m, &mut redacted);
            }
        }
        let line = self.call_record(site, call, &answer, duration, forwarded, redacted);
        if let Err(e) = self.recorder.append(&line).await {
            // The answer must not leave unrecorded: report the call as failed instead.
            tracing::error!(error = %e, call_id = %answer.call_id, "record write failed");
            answer.outcome = Outcome::Failed(FailCode::Internal);
            answer.content.clear();
            answer.structured_content = None;
            answer.message = Some(format!(
                "failed: {} — the broker could not record the call ({e}); it was not answered",
                call.tool
            ));
        }
        if self.telemetry.enabled() {
            let mut span = self.call_span(site, call, &answer, duration);
            span.approval = approval;
            span.ids = ids;
            self.telemetry.call(span);
        }
        answer
    }

    /// What the export thread needs of a finished call (export on only).
    fn call_span(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        answer: &CallAnswer,
        duration: Duration,
    ) -> CallSpan {
        let end = std::time::SystemTime::now();
        // Each string cut to the span's limit here, never copied whole.
        CallSpan {
            tool: bounded(&call.tool),
            turn: site.turn.to_owned(),
            call_id: site.call_id.clone(),
            request_id: call.request_id.as_deref().map(bounded),
            principal: self
                .telemetry
                .principal_on()
                .then(|| site.context.principal.clone()),
            outcome: answer.outcome.word(),
            code: answer.outcome.code(),
            policies: answer.policies.clone(),
            start: end.checked_sub(duration).unwrap_or(end),
            end,
            traceparent: call.traceparent.clone(),
            tracestate: call.tracestate.clone(),
            approval: None,
            ids: None,
        }
    }

    /// The execution of a permitted call, and its time limit.
    fn job(
        self: &Arc<Self>,
        tool: Arc<Registered>,
        resolved: Resolved,
        arguments: Map<String, Value>,
        context: AccessContext,
        blocking: Option<Arc<tokio::sync::Semaphore>>,
        trace: Option<crate::telemetry::Outgoing>,
    ) -> (Job, Duration) {
        let handler = &tool.authority.handler;
        let env = CallEnv {
            principal: context.principal.clone(),
            read_check: Box::new(KernelReadCheck {
                kernel: self.clone(),
                context,
                namespace: handler.namespace().to_owned(),
            }),
            blocking,
            trace,
        };
        (
            handler.execute(resolved, arguments, env),
            handler.timeout(self.call_timeout),
        )
    }

    /// Arguments as the record keeps them: as they are, or their SHA-256 (`redact_arguments`),
    /// or their size and SHA-256 when they are longer than `record_max_argument_bytes`.
    fn recorded(&self, args: Value) -> Arguments {
        Arguments::recorded(args, self.redact_arguments, self.record_max_argument_bytes)
    }

    /// `args` with every secret value known for `principal` replaced by `[redacted: NAME]` (a
    /// model that pastes a token into a call does not put it in the record).
    fn without_secrets(
        &self,
        principal: &str,
        mut args: Value,
        names: &mut BTreeSet<String>,
    ) -> Value {
        self.known_secrets.redact_value(principal, &mut args, names);
        args
    }

    /// The write-ahead line of a call that can change state.
    fn intent_record(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        requirement: &Option<Requirement>,
    ) -> Event {
        let (tool, request_id, cut) = recorded_strings(call);
        Event::Intent(record::Intent {
            turn: site.turn.to_owned(),
            call_id: site.call_id.clone(),
            request_id,
            tool,
            arguments: Some(self.recorded(self.without_secrets(
                &site.context.principal,
                call.arguments.clone().unwrap_or(Value::Null),
                &mut BTreeSet::new(),
            ))),
            requirement: requirement.clone(),
            cut,
            system_identity: site.identity.cloned(),
        })
    }

    /// A call's outcome line. `forwarded`: what the upstream was sent instead of the call's own
    /// arguments, recorded under the same rule as the arguments.
    fn call_record(
        &self,
        site: &CallSite<'_>,
        call: &ToolCall,
        answer: &CallAnswer,
        duration: Duration,
        forwarded: Option<Map<String, Value>>,
        mut redacted: BTreeSet<String>,
    ) -> Event {
        let (tool, request_id, mut cut) = recorded_strings(call);
        let principal = &site.context.principal;
        let arguments = self.without_secrets(
            principal,
            call.arguments.clone().unwrap_or(Value::Null),
            &mut redacted,
        );
        let forwarded = forwarded
            .map(|sent| self.without_secrets(principal, Value::Object(sent), &mut redacted));
        let message = answer
            .message
            .as_deref()
            .map(|m| record::bounded(m, record::RECORD_MAX_MESSAGE_BYTES, "message", &mut cut));
        Event::Call(record::Call {
            turn: site.turn.to_owned(),
            call_id: site.call_id.clone(),
            request_id,
            tool,
            arguments: Some(self.recorded(arguments)),
            requirement: answer.requirement.clone(),
            outcome: answer.outcome.word().to_owned(),
            code: answer.outcome.code(),
            policies: Some(answer.policies.clone()),
            duration_us: Some(duration.as_micros() as u64),
            message,
            cut,
            system_identity: site.identity.cloned(),
            forwarded_arguments: forwarded.map(|sent| self.recorded(sent).into()),
            redacted: (!redacted.is_empty()).then(|| redacted.into_iter().collect()),
        })
    }
}

/// What a person is asked to approve, taken from the verdict before the wait (a borrow of it
/// would not be `Send` across the wait): the call's words, its requirement and policies, and
/// what must be the same when it runs: this resource, sent upstream this way, on this object.
struct Subject {
    what: String,
    requirement: Option<Requirement>,
    policies: Vec<String>,
    approved: (Resource, Option<Map<String, Value>>, Option<Object>),
}

impl Subject {
    fn of(call: &ToolCall, resolved: &Resolved, policies: &[String]) -> Self {
        Self {
            what: format!("{} of {}", call.tool, resolved.resource.short()),
            requirement: Some(requirement_of(resolved)),
            policies: policies.to_vec(),
            approved: (
                resolved.resource.clone(),
                resolved.forwarded.clone(),
                resolved.object,
            ),
        }
    }
}

/// A permitted call's parts, as [`Verdict::Permitted`] holds them, and what an upstream server
/// is told of the trace.
struct Permit {
    tool: Arc<Registered>,
    resolved: Box<Resolved>,
    arguments: Map<String, Value>,
    policies: Vec<String>,
    trace: Option<crate::telemetry::Outgoing>,
}

/// A call counting bytes: the gate it holds, its turn's use, and the limits to add to.
type Counting<'s> = (
    crate::budget::Settled<'s>,
    &'s TurnUse,
    Option<crate::budget::Taken>,
);

/// What running a call leaves for after its answer is made: the arguments sent upstream (only
/// a call that runs has them on its line) and the byte-budget place it holds.
#[derive(Default)]
struct Ran<'s> {
    forwarded: Option<Map<String, Value>>,
    counting: Option<Counting<'s>>,
}

/// Step 3: a permitted call cancelled before it started: how it ends (a refusal ends as
/// refused, whatever happened to its client).
fn cancelled_before_start(call: &ToolCall, verdict: &Verdict, cause: CancelCode) -> Option<Ending> {
    let Verdict::Permitted {
        resolved, policies, ..
    } = verdict
    else {
        return None;
    };
    let what = format!("{} of {}", call.tool, resolved.resource.short());
    let (outcome, message) = not_started(&what, cause);
    let requirement = Some(requirement_of(resolved));
    Some((outcome, message, requirement, policies.clone(), None))
}

/// A call cancelled before it started (its client went away with the call unread, say): not
/// run, not held for a person, no budget taken; recorded as cancelled.
fn not_started(what: &str, cause: CancelCode) -> (Outcome, Option<String>) {
    (
        Outcome::Cancelled(cause.before_start()),
        Some(format!(
            "cancelled: {what} — cancelled before it started; it was not run"
        )),
    )
}

/// How a wait for a person ended.
enum Waited {
    Decided(Approval),
    TimedOut,
    /// With the decision a person gave just before, if one did: the call is cancelled anyway,
    /// and the record keeps who decided what.
    Cancelled(Option<Approval>),
}

/// The call waiting for a person, as `approvals` shows it and the record keeps it.
fn pending_approval(
    site: &CallSite<'_>,
    call: &ToolCall,
    requirement: Option<&Requirement>,
    timeout: Duration,
) -> PendingApproval {
    let arguments = match &call.arguments {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(v) => v.clone(),
    };
    let principal = &site.context.principal;
    let id = approval_id(
        site.turn,
        &site.call_id,
        principal,
        &call.tool,
        &arguments,
        requirement,
    );
    let now = std::time::SystemTime::now();
    PendingApproval {
        id,
        turn: site.turn.to_owned(),
        call_id: site.call_id.clone(),
        principal: principal.clone(),
        tool: call.tool.clone(),
        arguments,
        requirement: requirement.cloned(),
        arguments_digest: None,
        requested_at: crate::evidence::record::rfc3339(now),
        expires_at: crate::evidence::record::rfc3339(now + timeout),
    }
}

/// A call's job run under its time limit; a cancellation that comes first wins (the job is then
/// never polled: not run). Dropping `job` on cancellation or timeout cancels it; for an upstream
/// call that sends `notifications/cancelled` upstream.
async fn run_under_limit(
    job: impl Future<Output = Result<Success, Failure>>,
    timeout: Duration,
    cancel: &CancellationToken,
    cancel_cause: &impl Fn() -> CancelCode,
    what: &str,
) -> (Outcome, Option<String>, Option<Result<Success, Vec<Value>>>) {
    let done = tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        r = job => Some(r),
        _ = tokio::time::sleep(timeout) => {
            let secs = timeout.as_secs_f64();
            Some(Err(Failure::new(FailCode::Timeout, format!("did not finish within {secs} s"))))
        }
    };
    match done {
        None => (Outcome::Cancelled(cancel_cause()), None, None),
        Some(Ok(success)) => (Outcome::Succeeded, None, Some(Ok(success))),
        Some(Err(failure)) => (
            Outcome::Failed(failure.code),
            Some(format!("failed: {what} — {}", failure.message)),
            Some(Err(failure.content)),
        ),
    }
}

/// What the words of a refused approval name: the call, the approval, its time limit.
struct AskedAbout<'a> {
    what: &'a str,
    id: &'a str,
    timeout: Duration,
}

/// How a wait ended, as a word for the call's span and `Ok` to run or the call's ending.
fn approval_ending(
    waited: Waited,
    asked: &AskedAbout<'_>,
    requirement: Option<Requirement>,
    policies: Vec<String>,
) -> (&'static str, Result<(), Box<Ending>>) {
    match refusal_of(waited, asked) {
        (word, None) => (word, Ok(())),
        (word, Some((outcome, message))) => (
            word,
            Err(Box::new((outcome, message, requirement, policies, None))),
        ),
    }
}

/// The word for a wait's end, and the outcome and words of a call it does not let run.
fn refusal_of(
    waited: Waited,
    asked: &AskedAbout<'_>,
) -> (&'static str, Option<(Outcome, Option<String>)>) {
    let AskedAbout { what, id, timeout } = asked;
    let denied = |code, message: String| Some((Outcome::Denied(code), Some(message)));
    match waited {
        Waited::Decided(d) if d.unavailable => (
            "unavailable",
            denied(
                DenyCode::ApprovalUnavailable,
                format!(
                    "denied: {what} — it needs its principal's own approval, asked in the harness, and the harness cannot ask ({}) (approval {id}); nothing was run: use a client that supports MCP elicitation, or ask for the policy to allow an operator (`@approval(\"principal_or_operator\")`)",
                    d.reason.unwrap_or_default()
                ),
            ),
        ),
        Waited::Decided(d) if d.approve => ("approved", None),
        Waited::Decided(d) if d.principal.is_some() => (
            "denied",
            denied(
                DenyCode::ApprovalDenied,
                format!(
                    "denied: {what} — the user did not approve this call when asked ({}) (approval {id}); do not retry it unchanged: ask the user what they want instead",
                    d.principal.as_ref().map_or("", |s| s.action.as_str())
                ),
            ),
        ),
        Waited::Decided(d) => (
            "denied",
            denied(
                DenyCode::ApprovalDenied,
                format!(
                    "denied: {what} — a person denied this call (approval {id}){}; do not retry it unchanged: tell the user, or do something else",
                    d.reason.map(|r| format!(": {r}")).unwrap_or_default()
                ),
            ),
        ),
        Waited::TimedOut => (
            "timeout",
            denied(
                DenyCode::ApprovalTimeout,
                format!(
                    "denied: {what} — it needs a person's approval and nobody gave it within {} s (approval {id}); ask the user to approve it, then try again",
                    timeout.as_secs()
                ),
            ),
        ),
        Waited::Cancelled(_) => (
            "cancelled",
            Some((Outcome::Cancelled(CancelCode::ClientCancelled), None)),
        ),
    }
}

/// Why a call decided again after its approval no longer matches what was approved, or `None`
/// when it does (or when it is refused now for a reason of its own, not a change).
fn changed_since_approval(
    approved: &(Resource, Option<Map<String, Value>>, Option<Object>),
    requirement: Option<&Requirement>,
    verdict: &Verdict,
) -> Option<String> {
    match verdict {
        Verdict::Permitted { resolved: now, .. } => stale(approved, now),
        // Refused now, on something else than what was approved: it is the change that the
        // caller has to know about.
        Verdict::Refused {
            outcome: Outcome::Denied(DenyCode::UnresolvableRequirement),
            ..
        } => Some("it no longer resolves to a resource".to_owned()),
        Verdict::Refused {
            requirement: Some(now),
            ..
        } if Some(now) != requirement => Some(format!("what it names changed to {}", now.resource)),
        Verdict::Refused { .. } => None,
    }
}

/// Why a call resolved again after its approval is not what was approved (`approved`: the
/// resource, what was to be sent upstream, the object it resolved to), or `None` when it is.
fn stale(
    approved: &(Resource, Option<Map<String, Value>>, Option<Object>),
    now: &Resolved,
) -> Option<String> {
    let (resource, forwarded, object) = approved;
    if now.resource != *resource {
        return Some(format!("what it names changed to {}", now.resource.short()));
    }
    if now.forwarded != *forwarded {
        return Some("what it would send the upstream changed".to_owned());
    }
    if now.object != *object {
        return Some(format!(
            "{} is now another file or folder than the one approved",
            now.resource.short()
        ));
    }
    None
}

/// A call's tool string and request id as its record lines keep them: each cut to
/// [`record::RECORD_MAX_STRING_BYTES`] when longer, and named with its whole size and SHA-256
/// in the line's `cut`.
fn recorded_strings(call: &ToolCall) -> (String, Option<String>, Option<record::Cuts>) {
    let max = record::RECORD_MAX_STRING_BYTES;
    let mut cut = None;
    let tool = record::bounded(&call.tool, max, "tool", &mut cut);
    let request_id = call
        .request_id
        .as_deref()
        .map(|r| record::bounded(r, max, "requestId", &mut cut));
    (tool, request_id, cut)
}

/// How a call is refused before any requirement was resolved, and the words said.
type Refusal = (Outcome, String);

/// A refusal before any requirement was resolved.
fn refused(outcome: Outcome, message: String) -> Verdict {
    Verdict::Refused {
        outcome,
        message,
        requirement: None,
        policies: vec![],
    }
}

/// The tool a call names, looked up in the turn's catalogue: a malformed name, a tool not
/// published this turn, a brokered tool whose upstream drifted after this catalogue was made
/// (the turn still holds the registration, its upstream no longer lists what was published), or
/// arguments the bridge already refused to pass on end the call here.
fn look_up<'c>(
    catalog: &'c Catalog,
    tool: &str,
    rejected: Option<&str>,
) -> Result<&'c Arc<Registered>, Refusal> {
    let shown = sharedos_proto::name::shown(tool);
    if let Err(e) = ToolName::new(tool) {
        return Err((
            Outcome::Denied(DenyCode::MalformedToolName),
            format!("denied: `{shown}` is not a valid tool name ({e}); nothing was run"),
        ));
    }
    let Some(registered) = catalog.by_name.get(tool) else {
        return Err((
            Outcome::Denied(DenyCode::UnpublishedTool),
            format!(
                "denied: `{shown}` is not a tool in this turn's catalogue; call one of the tools listed by tools/list"
            ),
        ));
    };
    if let Some(why) = registered.authority.handler.unavailable() {
        return Err((
            Outcome::Failed(why.code),
            format!("failed: {tool} — {}", why.message),
        ));
    }
    if let Some(why) = rejected {
        return Err((
            Outcome::Failed(FailCode::InvalidArguments),
            format!("failed: {tool} arguments were not passed on: {why}"),
        ));
    }
    Ok(registered)
}

/// A call's arguments as an object (absent or `null` is `{}`), checked against the tool's input
/// schema (the first three errors said, each clipped: they quote the call's own arguments).
fn checked_arguments(
    registered: &Registered,
    tool: &str,
    arguments: Option<&Value>,
) -> Result<Map<String, Value>, Refusal> {
    let invalid = |message| (Outcome::Failed(FailCode::InvalidArguments), message);
    let empty = Value::Object(Map::new());
    // The instance the input schema checks: the arguments as sent (no copy), or `{}`.
    let (instance, arguments) = match arguments {
        None | Some(Value::Null) => (&empty, Map::new()),
        Some(v @ Value::Object(m)) => (v, m.clone()),
        Some(other) => {
            return Err(invalid(format!(
                "failed: {tool} arguments must be a JSON object, not {}",
                json_kind(other)
            )));
        }
    };
    let Some(validator) = &registered.authority.validator else {
        return Ok(arguments);
    };
    let errors: Vec<String> = validator
        .iter_errors(instance)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            let at = if at.is_empty() {
                "arguments".to_owned()
            } else {
                format!("`{at}`")
            };
            let mut msg = e.to_string();
            sharedos_proto::name::clip(&mut msg, 200);
            format!("{at}: {msg}")
        })
        .collect();
    if errors.is_empty() {
        Ok(arguments)
    } else {
        Err(invalid(format!(
            "failed: {tool} arguments do not match its input schema: {}",
            errors.join("; ")
        )))
    }
}

/// The requirement of a call, from the registration's resolver and the call's arguments.
fn resolve(tool: &Registered, arguments: &Map<String, Value>) -> Result<Resolved, String> {
    tool.authority
        .handler
        .resolve(tool.name.as_str(), arguments)
}

fn resource_noun(r: &Resource) -> &'static str {
    match r {
        Resource::File { .. } => "file",
        Resource::Tool { .. } => "tool",
        Resource::Url(_) => "URL",
        Resource::Entity { .. } => "resource",
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `search` asks this before returning a hit: the same decision a `read` of that file gets.
struct KernelReadCheck {
    kernel: Arc<Kernel>,
    context: AccessContext,
    namespace: String,
}

impl ReadCheck for KernelReadCheck {
    fn may_read(&self, virtual_path: &str) -> bool {
        let pv = self.kernel.policy.current();
        self.kernel
            .policy
            .decide(
                &pv,
                &self.context,
                "read",
                &Resource::File {
                    namespace: self.namespace.clone(),
                    path: virtual_path.to_owned(),
                },
            )
            .allowed
    }
}

#[cfg(test)]
#[allow(clippy::expect_used, clippy::panic, reason = "test code")]
mod tests {
    //! The check path and the single call path with a fake handler: no files, no upstream.

    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::evidence::record::RecordSync;

    /// A tool whose requirement is `read` on `SharedOS::File {path}` from its `path` argument,
    /// counting its runs.
    struct Fake {
        runs: Arc<AtomicUsize>,
        writes: bool,
        unavailable: Option<FailCode>,
    }

    impl ToolHandler for Fake {
        fn namespace(&self) -> &str {
            "fake"
        }
        fn kind(&self) -> &'static str {
            "fake"
        }
        fn shape(&self) -> (&str, &str) {
            ("read", "File")
        }
        fn changes_state(&self, _annotations: Option<&Value>) -> bool {
            self.writes
        }
        fn unavailable(&self) -> Option<Failure> {
            self.unavailable.map(|c| Failure::new(c, "held back"))
        }
        fn resolve(&self, _tool: &str, args: &Map<String, Value>) -> Result<Resolved, String> {
            let path = args.get("path").and_then(Value::as_str).ok_or("no path")?;
            if path.contains("..") {
                return Err("not canonical".into());
            }
            Ok(Resolved {
                action: "read".into(),
                resource: Resource::File {
                    namespace: "fake".into(),
                    path: path.into(),
                },
                forwarded: None,
                object: None,
                detail: None,
            })
        }
        fn execute(&self, r: Resolved, _args: Map<String, Value>, _env: CallEnv) -> Job {
            self.runs.fetch_add(1, Ordering::SeqCst);
            let text = format!("ran on {}", r.resource.short());
            Box::pin(async move { Ok(Success::text(text)) })
        }
    }

    const POLICY: &str = r#"
@id("alice-public") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is SharedOS::File)
when { resource.path like "/public/*" };
@id("no-secrets") forbid(principal, action, resource is SharedOS::File)
when { resource.path like "*secret*" };
"#;

    struct Setup {
        _dir: tempfile::TempDir,
        kernel: Arc<Kernel>,
        runs: Arc<AtomicUsize>,
        record: std::path::PathBuf,
    }

    fn setup(writes: bool, unavailable: Option<FailCode>) -> Setup {
        let dir = tempfile::tempdir().expect("tmp");
        let policy_path = dir.path().join("p.cedar");
        std::fs::write(&policy_path, POLICY).expect("policy");
        let policy = PolicyEngine::load(None, &policy_path).expect("load");
        let record = dir.path().join("r.jsonl");
        let (recorder, _) = Recorder::open(&record, RecordSync::Always).expect("record");
        let runs = Arc::new(AtomicUsize::new(0));
        let handler: Arc<dyn ToolHandler> = Arc::new(Fake {
            runs: runs.clone(),
            writes,
            unavailable,
        });
        let def: ToolDefinition<Arc<dyn ToolHandler>> = ToolDefinition {
            name: ToolName::new("fake.read").expect("name"),
            description: None,
            input_schema: Some(
                json!({"type": "object", "properties": {"path": {"type": "string"}}}),
            ),
            output_schema: None,
            annotations: None,
            metadata: None,
            authority: handler,
        };
        let mut registry = Registry::default();
        registry.register("fake", vec![def]).expect("register");
        let kernel = Arc::new(Kernel::new(
            registry,
            policy,
            recorder,
            false,
            Duration::from_secs(5),
        ));
        Setup {
            _dir: dir,
            kernel,
            runs,
            record,
        }
    }

    fn verdict(s: &Setup, principal: &str, tool: &str, args: Value) -> (Option<Outcome>, String) {
        let ctx = AccessContext::new(principal, None);
        let catalog = s.kernel.catalog(&ctx);
        match s.kernel.check(&ctx, &catalog, tool, Some(&args)) {
            Verdict::Refused {
                outcome, message, ..
            } => (Some(outcome), message),
            Verdict::Permitted { policies, .. } => (None, policies.join(",")),
        }
    }

    #[test]
    fn the_check_refuses_in_order_and_permits_from_the_arguments() {
        let s = setup(false, None);
        let public = json!({"path": "/public/a"});
        assert_eq!(
            verdict(&s, "alice", "fake read", public.clone()).0,
            Some(Outcome::Denied(DenyCode::MalformedToolName))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.write", public.clone()).0,
            Some(Outcome::Denied(DenyCode::UnpublishedTool))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.read", json!({"path": 7})).0,
            Some(Outcome::Failed(FailCode::InvalidArguments))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.read", json!([1])).0,
            Some(Outcome::Failed(FailCode::InvalidArguments))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.read", json!({"path": "/public/../x"})).0,
            Some(Outcome::Denied(DenyCode::UnresolvableRequirement))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.read", json!({"path": "/private/a"})).0,
            Some(Outcome::Denied(DenyCode::NoPermit))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.read", json!({"path": "/public/secret"})).0,
            Some(Outcome::Denied(DenyCode::Forbidden))
        );
        assert_eq!(
            verdict(&s, "alice", "fake.read", public.clone()),
            (None, "alice-public".to_owned())
        );
        // bob has no permit at all: the tool is not even in his catalogue.
        assert_eq!(
            verdict(&s, "bob", "fake.read", public).0,
            Some(Outcome::Denied(DenyCode::UnpublishedTool))
        );
        assert_eq!(s.runs.load(Ordering::SeqCst), 0, "a check runs nothing");
    }

    #[test]
    fn an_unavailable_handler_is_refused_before_its_arguments_are_looked_at() {
        let s = setup(false, Some(FailCode::ProviderDrifted));
        let (outcome, message) = verdict(&s, "alice", "fake.read", json!({"path": 7}));
        assert_eq!(outcome, Some(Outcome::Failed(FailCode::ProviderDrifted)));
        assert!(message.contains("held back"), "{message}");
    }

    async fn invoke(s: &Setup, id: &str, args: Value) -> CallAnswer {
        let ctx = AccessContext::new("alice", None);
        let catalog = s.kernel.catalog(&ctx);
        let site = CallSite {
            turn: "t-test",
            call_id: format!("t-test.{id}"),
            context: &ctx,
            catalog: &catalog,
            identity: None,
            blocking: None,
            budget: None,
            on_wait: None,
            ask: None,
        };
        let call = ToolCall {
            tool: "fake.read".into(),
            arguments: Some(args),
            request_id: Some(id.into()),
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        };
        s.kernel
            .invoke(site, call, CancellationToken::new(), || {
                CancelCode::ClientCancelled
            })
            .await
    }

    fn lines(s: &Setup) -> Vec<Value> {
        s.kernel.recorder.release();
        std::fs::read_to_string(&s.record)
            .expect("record")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect()
    }

    #[tokio::test]
    async fn every_call_leaves_one_line_and_a_state_changing_one_its_intent_first() {
        let s = setup(true, None);
        let ok = invoke(&s, "1", json!({"path": "/public/a"})).await;
        assert_eq!(ok.outcome, Outcome::Succeeded);
        assert_eq!(ok.content[0]["text"], "ran on /public/a");
        let denied = invoke(&s, "2", json!({"path": "/private/a"})).await;
        assert_eq!(denied.outcome, Outcome::Denied(DenyCode::NoPermit));
        assert_eq!(s.runs.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let kinds: Vec<(String, String)> = lines(&s)
            .iter()
            .filter(|l| l["kind"] != "chain_started")
            .map(|l| {
                (
                    l["kind"].as_str().unwrap_or("?").to_owned(),
                    l["requestId"].as_str().unwrap_or("?").to_owned(),
                )
            })
            .collect();
        let want = [("intent", "1"), ("call", "1"), ("call", "2")]
            .map(|(k, r)| (k.to_owned(), r.to_owned()));
        assert_eq!(kinds, want);
    }
}
