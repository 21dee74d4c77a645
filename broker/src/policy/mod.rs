//! The policy engine: Cedar schema and policies, the call-time decision, and the catalogue
//! question "could this principal ever be permitted this action on this kind of resource?".
//!
//! Owns: loading and validating policies (strict mode, warnings are errors), atomic reload (a
//! set that fails keeps the old one), slicing the set per principal (Cedar does not index), and
//! the decision. It must never fail open: an internal error is a deny, and entities are validated
//! against the schema at every call (otherwise a `forbid` whose condition errors is skipped).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, RwLock};

use crate::lock;
use crate::resource::NAMESPACE;

pub mod arguments;
mod known;
mod never;
pub use arguments::{ArgumentTypes, Typed};

use cedar_policy::{
    ActionConstraint, AuthorizationError, Authorizer, Context, Decision as CedarDecision, Effect,
    Entities, Entity, EntityId, EntityTypeName, EntityUid, PartialEntities, PartialEntityUid,
    PartialRequest, Policy, PolicyId, PolicySet, PrincipalConstraint, Request, ResourceConstraint,
    RestrictedExpression, Schema, SchemaFragment, ValidationMode, Validator,
};

/// The schema that covers the built-in tools. A config may name its own (`schema = ...`).
pub const BUILTIN_SCHEMA: &str = r#"namespace SharedOS {
  entity User;
  entity Agent { owner?: User };
  entity File { path: String, namespace: String };
  entity Tool { name: String };
  entity Url { scheme: String, host: String, port: Long, path: String, ip?: ipaddr };
  type Turn = { tenant?: String, project?: String, purpose?: String };
  action read, list, search, write appliesTo {
    principal: [User],
    resource: [File],
    context: { agent?: Agent, turn?: Turn }
  };
  action call appliesTo {
    principal: [User],
    resource: [Tool],
    context: { agent?: Agent, turn?: Turn }
  };
  action fetch appliesTo {
    principal: [User],
    resource: [Url],
    context: { agent?: Agent, turn?: Turn }
  };
}
"#;

/// Who is asking, and in which turn: resolved by the host, trusted because the control socket
/// is the host's. Every decision of a turn is made in this context (`context.agent`,
/// `context.turn`, the agent's `owner`), and so is its catalogue.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct AccessContext {
    pub principal: String,
    pub agent: Option<String>,
    /// The agent's owner (`Agent.owner`), when the host names one.
    pub agent_owner: Option<String>,
    /// The turn's attributes (`context.turn`): RFC 8785 canonical JSON of an object.
    pub turn: Option<String>,
}

impl AccessContext {
    pub fn new(principal: &str, agent: Option<&str>) -> Self {
        Self {
            principal: principal.to_owned(),
            agent: agent.map(str::to_owned),
            ..Self::default()
        }
    }

    /// The turn's attributes as JSON, for the record.
    pub fn turn_attributes(&self) -> Option<serde_json::Value> {
        self.turn
            .as_deref()
            .and_then(|t| serde_json::from_str(t).ok())
    }

    /// The context a `turn_opened` line recorded: the inverse of what the record keeps of it
    /// (the attributes back to their canonical JSON text).
    pub fn from_recorded(
        recorded: &sharedos_proto::record::RecordedAccessContext,
    ) -> Result<Self, String> {
        let turn = recorded
            .turn
            .as_ref()
            .map(sharedos_proto::catalog::canonical_json)
            .transpose()
            .map_err(|e| format!("the turn's attributes: {e}"))?;
        Ok(Self {
            principal: recorded.principal.clone(),
            agent: recorded.agent.clone(),
            agent_owner: recorded.agent_owner.clone(),
            turn,
        })
    }
}

/// A JSON value of a turn attribute as a Cedar value: strings, booleans, integers, sets and
/// records. Cedar has no null and no fractions, so those are refused, naming the attribute.
fn restricted(key: &str, v: &serde_json::Value) -> Result<RestrictedExpression, String> {
    use serde_json::Value as J;
    Ok(match v {
        J::String(s) => RestrictedExpression::new_string(s.clone()),
        J::Bool(b) => RestrictedExpression::new_bool(*b),
        J::Number(n) => match n.as_i64() {
            Some(i) => RestrictedExpression::new_long(i),
            None => {
                return Err(format!(
                    "attribute `{key}`: {n} is not a 64-bit integer (Cedar has no fractions)"
                ));
            }
        },
        J::Array(items) => RestrictedExpression::new_set(
            items
                .iter()
                .map(|i| restricted(key, i))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        J::Object(m) => RestrictedExpression::new_record(
            m.iter()
                .map(|(k, v)| Ok((k.clone(), restricted(&format!("{key}.{k}"), v)?)))
                .collect::<Result<Vec<_>, String>>()?,
        )
        .map_err(|e| format!("attribute `{key}`: {e}"))?,
        J::Null => {
            return Err(format!(
                "attribute `{key}` is null: Cedar has no null; leave it out"
            ));
        }
    })
}

/// The shape of a JSON value (what schema conformance depends on), e.g. `{a:s,b:[l]}`.
fn type_signature(v: &serde_json::Value) -> String {
    use serde_json::Value as J;
    match v {
        J::String(_) => "s".into(),
        J::Bool(_) => "b".into(),
        J::Number(_) => "l".into(),
        J::Null => "n".into(),
        J::Array(items) => {
            let mut parts: Vec<String> = items.iter().map(type_signature).collect();
            parts.sort();
            parts.dedup();
            format!("[{}]", parts.join("|"))
        }
        J::Object(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{k:?}:{}", type_signature(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read `{path}`: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("schema `{path}` is invalid:\n{detail}")]
    Schema { path: String, detail: String },
    #[error("policy file `{path}` does not parse:\n{detail}")]
    Parse { path: String, detail: String },
    #[error("policy file `{path}` does not validate against the schema:\n{detail}")]
    Invalid { path: String, detail: String },
    /// Another uid could write the file (see `trusted::read_settings`).
    #[error("{0}")]
    Untrusted(String),
}

pub use crate::resource::Resource;

/// What the kernel learns from a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// A `forbid` decided the deny.
    pub forbidden: bool,
    /// Ids of the policies that decided (empty for a default deny).
    pub policies: Vec<String>,
    /// Evaluation errors (each makes the decision a deny if it could matter).
    pub errors: Vec<String>,
    /// Allowed, and a deciding permit is annotated `@approval(...)`: the call waits for a
    /// person before it runs, and this says who may answer.
    pub approval: Option<Approver>,
}

impl Decision {
    fn internal(error: String) -> Self {
        Decision {
            allowed: false,
            forbidden: false,
            policies: vec![],
            errors: vec![error],
            approval: None,
        }
    }
}

/// The annotation that makes a permit ask a person, and its one value.
pub const APPROVAL_ANNOTATION: &str = "approval";
pub const APPROVAL_REQUIRED: &str = "required";
/// `@approval("principal")`: the call's principal answers, in the harness (MCP elicitation).
pub const APPROVAL_PRINCIPAL: &str = "principal";
/// `@approval("principal_or_operator")`: the principal in the harness, or, when the harness
/// cannot ask, an operator over `control.sock`.
pub const APPROVAL_PRINCIPAL_OR_OPERATOR: &str = "principal_or_operator";

/// Who may answer a call held for approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Approver {
    /// `@approval("required")`: an operator, over `control.sock`.
    Operator,
    /// `@approval("principal")`: the principal, in the harness; refused when it cannot ask.
    Principal,
    /// `@approval("principal_or_operator")`: the principal in the harness; the operator queue
    /// when the harness cannot ask.
    PrincipalOrOperator,
}

impl Approver {
    fn of(value: &str) -> Option<Self> {
        match value {
            APPROVAL_REQUIRED => Some(Approver::Operator),
            APPROVAL_PRINCIPAL => Some(Approver::Principal),
            APPROVAL_PRINCIPAL_OR_OPERATOR => Some(Approver::PrincipalOrOperator),
            _ => None,
        }
    }

    /// The principal is asked in the harness.
    pub fn asks_principal(self) -> bool {
        self != Approver::Operator
    }

    /// An operator may decide over `control.sock` (for `principal_or_operator`, once the
    /// harness could not ask).
    pub fn operator_may(self) -> bool {
        self != Approver::Principal
    }

    /// Of two deciding permits' approvers, the narrower: the operator's own if either asks
    /// for it, else the principal alone if either does.
    fn narrower(self, other: Self) -> Self {
        use Approver::*;
        match (self, other) {
            (Operator, _) | (_, Operator) => Operator,
            (Principal, _) | (_, Principal) => Principal,
            _ => PrincipalOrOperator,
        }
    }
}

/// One loaded, validated policy set.
pub struct PolicyVersion {
    pub version: u64,
    set: PolicySet,
    pub count: usize,
    /// The policy file's text this set was made from (validated again when the tools' argument
    /// types change).
    source: String,
    /// Ids of the policies that read `context.arguments`: a catalogue question on a set holding
    /// one leaves the context unknown (the arguments are not known before the call).
    reads_arguments: HashSet<String>,
    /// The attributes some policy reads on `resource` (`None`: not known, so every one).
    reads_resource: Option<HashSet<String>>,
    /// Ids of the permits annotated `@approval("required")` (empty in most sets: then a
    /// decision does not look).
    approval: HashMap<String, Approver>,
    /// The set sliced per principal: only policies whose principal scope can match.
    sliced: Mutex<HashMap<String, Arc<PolicySet>>>,
    /// What every decision for one (principal, agent) shares, built and validated once.
    prepared: Mutex<HashMap<PrincipalKey, Arc<Prepared>>>,
}

impl PolicyVersion {
    /// Some policy of the set reads `context.arguments`.
    pub fn reads_any_arguments(&self) -> bool {
        !self.reads_arguments.is_empty()
    }

    /// Some policy of the set may read `resource.<attr>` (or `resource has <attr>`): if none
    /// does, the attribute's value cannot change a decision.
    pub fn reads_resource_attribute(&self, attr: &str) -> bool {
        self.reads_resource
            .as_ref()
            .is_none_or(|read| read.contains(attr))
    }

    /// The SHA-256 (hex) of the policy file's text this set was made from: what a record line
    /// names the set by.
    pub fn digest(&self) -> String {
        use sha2::Digest as _;
        sha2::Sha256::digest(self.source.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// A turn's whole context: principal, agent, its owner and the turn's attributes.
type PrincipalKey = AccessContext;

impl PolicyVersion {
    fn new(version: u64, set: PolicySet, source: String) -> Self {
        let count = set.policies().count();
        let reads_arguments = set
            .policies()
            .filter(|p| arguments::reads_arguments(p))
            .map(|p| p.id().to_string())
            .collect();
        let reads_resource = set
            .policies()
            .map(known::resource_attributes_read)
            .collect::<Option<Vec<_>>>()
            .map(|lists| lists.into_iter().flatten().collect());
        let approval = set
            .policies()
            .filter_map(|p| {
                let by = Approver::of(p.annotation(APPROVAL_ANNOTATION)?)?;
                Some((p.id().to_string(), by))
            })
            .collect();
        Self {
            version,
            set,
            count,
            source,
            reads_arguments,
            reads_resource,
            approval,
            sliced: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
        }
    }
}

/// The per-(principal, agent) part of a decision: uids, the principal and agent entities
/// (validated against the schema, with the schema's action entities), the context and the
/// principal's slice of the set. Only the resource entity is added per call.
struct Prepared {
    principal: EntityUid,
    /// The context's attributes (`agent`, `turn`): a call's `arguments` are added to them.
    pairs: Vec<(String, RestrictedExpression)>,
    /// What schema conformance of this context depends on (see [`Shape`]).
    signature: String,
    base: Entities,
    context: Context,
    set: Arc<PolicySet>,
    /// The slice narrowed to one (action, resource type): only policies whose action and
    /// resource scopes can match it. Cedar evaluates every policy it is given.
    narrowed: RwLock<Vec<(String, String, Arc<PolicySet>)>>,
}

/// Cached decision inputs are bounded: a broker serving many principals must not grow without
/// limit.
const CACHE_MAX: usize = 4096;

/// Entity type names and action uids, parsed once.
struct Names {
    types: HashMap<&'static str, EntityTypeName>,
    actions: HashMap<&'static str, EntityUid>,
}

impl Names {
    fn new() -> Self {
        let types = ["User", "Agent", "File", "Tool", "Url"]
            .into_iter()
            .filter_map(|t| type_name(t).ok().map(|n| (t, n)))
            .collect();
        let actions = ["read", "list", "search", "write", "call", "fetch"]
            .into_iter()
            .filter_map(|a| uid("Action", a).ok().map(|u| (a, u)))
            .collect();
        Self { types, actions }
    }

    fn type_name(&self, ty: &str) -> Result<EntityTypeName, String> {
        match self.types.get(ty) {
            Some(t) => Ok(t.clone()),
            None => type_name(ty),
        }
    }

    fn uid(&self, ty: &str, id: &str) -> Result<EntityUid, String> {
        Ok(EntityUid::from_type_name_and_id(
            self.type_name(ty)?,
            EntityId::new(id),
        ))
    }

    fn action(&self, action: &str) -> Result<EntityUid, String> {
        match self.actions.get(action) {
            Some(a) => Ok(a.clone()),
            None => uid("Action", action),
        }
    }
}

pub struct PolicyEngine {
    schema: Schema,
    policy_path: PathBuf,
    /// Whether (and with which `admin_group`) the policy file is checked at each reload.
    check: SettingsCheck,
    current: RwLock<Arc<PolicyVersion>>,
    names: Names,
    authorizer: Authorizer,
    /// The schema's action entities (for action groups); `None` keeps every action scope.
    action_entities: Option<Entities>,
    /// Request shapes whose resource entity and request have passed schema validation.
    conforming: RwLock<Vec<Shape>>,
    /// The entity store a catalogue's tools are decided against, for the last list of names.
    tool_store: Mutex<Option<Arc<ToolStore>>>,
    /// The schema in its JSON form, which the argument types are added to (`None` if it has
    /// none: then policies that read arguments cannot be validated, and fail to load).
    schema_json: Option<serde_json::Value>,
    /// The tools' argument types and the schema they make (see [`arguments`]).
    arguments: RwLock<Arc<ArgumentState>>,
}

/// What policies that read `context.arguments` are validated against, and what that found.
struct ArgumentState {
    types: ArgumentTypes,
    /// The engine's schema with each action's `context.arguments` declared by `types`.
    schema: Schema,
    /// Problems that do not refuse the set (see [`arguments::check`]).
    warnings: Vec<String>,
}

/// The schema's action entities and one `Tool` entity per name, built once per list of tool
/// names (the registry's tools rarely change) and shared by every principal. Principal and
/// agent entities are left out: they carry no attributes and no parents, and Cedar treats a
/// missing entity the same way (`in` holds only by equality, `has` is false, reading an
/// attribute is an error either way).
struct ToolStore {
    names: Vec<String>,
    uids: Vec<EntityUid>,
    entities: Entities,
}

/// (action, resource type, the context's signature). Whether the resource entity and the
/// request this module builds conform to the schema depends on nothing else: the principal is
/// always a `User` without attributes, the context holds at most `agent` (an `Agent`, with or
/// without an `owner`) and `turn` (whose value types make the signature), a `File` carries
/// exactly `path` and `namespace` and a `Tool` exactly `name`, all strings; ids and string
/// contents play no part in conformance. The schema never changes while the engine lives
/// (only policies reload), so a shape validated once stays valid. (A `Url`, whose `ip` comes
/// and goes, and an operator's entity, whose attributes come from arguments, are validated
/// at every call: see [`Resource::fixed_shape`].)
type Shape = (String, String, String);

/// A context's `agent` and `turn` as Cedar's JSON form of values (an entity as `__entity`).
fn context_json(ctx: &AccessContext) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    if let Some(agent) = &ctx.agent {
        m.insert(
            "agent".to_owned(),
            serde_json::json!({"__entity": {"type": format!("{NAMESPACE}::Agent"), "id": agent}}),
        );
    }
    if let Some(turn) = ctx.turn_attributes() {
        m.insert("turn".to_owned(), turn);
    }
    m
}

/// Does `set` hold a policy that reads `context.arguments`?
fn reads_arguments(pv: &PolicyVersion, set: &PolicySet) -> bool {
    !pv.reads_arguments.is_empty()
        && set
            .policies()
            .any(|p| pv.reads_arguments.contains(&p.id().to_string()))
}

/// `File` is `SharedOS::File`; a qualified name (`Github::Repo`) is taken as it is.
fn type_name(name: &str) -> Result<EntityTypeName, String> {
    let full = if name.contains("::") {
        name.to_owned()
    } else {
        format!("{NAMESPACE}::{name}")
    };
    EntityTypeName::from_str(&full).map_err(|e| e.to_string())
}

fn uid(ty: &str, id: &str) -> Result<EntityUid, String> {
    Ok(EntityUid::from_type_name_and_id(
        type_name(ty)?,
        EntityId::new(id),
    ))
}

/// `file:line:col: message` for each diagnostic, from miette labels.
fn render(diag: &dyn miette::Diagnostic, path: &str, src: &str) -> String {
    let mut out = String::new();
    let base = diag.to_string();
    let mut located = false;
    if let Some(labels) = diag.labels() {
        for label in labels {
            let offset = label.offset().min(src.len());
            let before = src.get(..offset).unwrap_or(src);
            let line = before.matches('\n').count() + 1;
            let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            let extra = label.label().map(|l| format!(" ({l})")).unwrap_or_default();
            out.push_str(&format!("  {path}:{line}:{col}: {base}{extra}\n"));
            located = true;
        }
    }
    if !located {
        out.push_str(&format!("  {path}: {base}\n"));
    }
    if let Some(help) = diag.help() {
        out.push_str(&format!("    help: {help}\n"));
    }
    out
}

/// Who may write the policy and schema files the broker loads: `None`, not checked (a policy
/// replayed or tried offline); `Some(group)`, checked as the broker's own files are
/// (`trusted::read_settings`), `group` being the config's `admin_group`.
pub type SettingsCheck = Option<Option<u32>>;

fn read(path: &Path, what: &str, check: SettingsCheck) -> Result<String, PolicyError> {
    let read_err = |source| PolicyError::Read {
        path: path.display().to_string(),
        source,
    };
    match check {
        None => std::fs::read_to_string(path).map_err(read_err),
        Some(group) => crate::trusted::read_settings(path, what, |_| group).map_err(|e| match e {
            crate::trusted::TrustError::Io { source, .. } => read_err(source),
            e => PolicyError::Untrusted(e.to_string()),
        }),
    }
}

/// Parses a schema (the built-in one when `path` is None).
pub fn load_schema(path: Option<&Path>) -> Result<Schema, PolicyError> {
    load_schema_checked(path, None).map(|(s, _)| s)
}

/// [`load_schema`], its file checked as `check` says; with its JSON form (what argument types
/// are added to).
fn load_schema_checked(
    path: Option<&Path>,
    check: SettingsCheck,
) -> Result<(Schema, Option<serde_json::Value>), PolicyError> {
    let (shown, src) = match path {
        Some(p) => (p.display().to_string(), read(p, "schema", check)?),
        None => ("<built-in schema>".to_owned(), BUILTIN_SCHEMA.to_owned()),
    };
    match Schema::from_cedarschema_str(&src) {
        Ok((schema, warnings)) => {
            let warnings: Vec<String> = warnings.map(|w| w.to_string()).collect();
            if !warnings.is_empty() {
                tracing::warn!(schema = %shown, ?warnings, "schema warnings");
            }
            let json = SchemaFragment::from_cedarschema_str(&src)
                .ok()
                .and_then(|(f, _)| f.to_json_value().ok());
            Ok((schema, json))
        }
        Err(e) => Err(PolicyError::Schema {
            detail: render(&e, &shown, &src),
            path: shown,
        }),
    }
}

/// Parses, re-ids (by `@id("...")`) and validates a policy text. Policies that read
/// `context.arguments` are validated once the tools' argument types are known
/// ([`PolicyEngine::set_argument_types`]).
pub fn compile_policies(schema: &Schema, path: &Path, src: &str) -> Result<PolicySet, PolicyError> {
    compile_with(schema, &ArgumentTypes::unknown(), path, src).map(|(set, _)| set)
}

/// [`compile_policies`] against `schema` with the argument types `types` (see
/// [`arguments::check`]): the set, and the warnings that do not refuse it.
fn compile_with(
    schema: &Schema,
    types: &ArgumentTypes,
    path: &Path,
    src: &str,
) -> Result<(PolicySet, Vec<String>), PolicyError> {
    let shown = path.display().to_string();
    let parsed = PolicySet::from_str(src).map_err(|errs| PolicyError::Parse {
        detail: errs
            .iter()
            .map(|e| render(e, &shown, src))
            .collect::<String>(),
        path: shown.clone(),
    })?;
    if parsed.templates().next().is_some() {
        return Err(PolicyError::Parse {
            path: shown,
            detail: "  policy templates are not supported: write static policies".into(),
        });
    }
    let mut renamed = Vec::new();
    for p in parsed.policies() {
        let policy = match p.annotation("id") {
            Some(id) => p.new_id(PolicyId::new(id)),
            None => p.clone(),
        };
        renamed.push(policy);
    }
    for p in &renamed {
        if let Some(value) = p.annotation(APPROVAL_ANNOTATION) {
            let problem = if Approver::of(value).is_none() {
                Some(format!(
                    "@{APPROVAL_ANNOTATION}(\"{value}\"): the values are \"{APPROVAL_REQUIRED}\" (an operator answers), \"{APPROVAL_PRINCIPAL}\" (the principal, in the harness) and \"{APPROVAL_PRINCIPAL_OR_OPERATOR}\""
                ))
            } else if p.effect() != Effect::Permit {
                Some(format!(
                    "@{APPROVAL_ANNOTATION} on a forbid: only a permit can ask for a person's approval"
                ))
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(PolicyError::Invalid {
                    path: shown.clone(),
                    detail: format!("  policy `{}`: {problem}\n", p.id()),
                });
            }
        }
    }
    let (mut errors, mut warnings) = (String::new(), Vec::new());
    let mut unvalidated = HashSet::new();
    for p in &renamed {
        let (e, w, skip) = arguments::check(p, types, &shown, src);
        for e in e {
            errors.push_str(&e);
            errors.push('\n');
        }
        warnings.extend(w);
        if skip {
            unvalidated.insert(p.id().clone());
        }
    }
    if !errors.is_empty() {
        return Err(PolicyError::Invalid {
            path: shown,
            detail: errors,
        });
    }
    let checked = renamed
        .iter()
        .filter(|p| !unvalidated.contains(p.id()))
        .cloned();
    let checked = PolicySet::from_policies(checked).map_err(|e| PolicyError::Parse {
        path: shown.clone(),
        detail: format!("  {shown}: {e}\n"),
    })?;
    let set = PolicySet::from_policies(renamed).map_err(|e| PolicyError::Parse {
        path: shown.clone(),
        detail: format!("  {shown}: {e}\n"),
    })?;
    let result = Validator::new(schema.clone()).validate(&checked, ValidationMode::Strict);
    if !result.validation_passed_without_warnings() {
        let mut detail = String::new();
        for e in result.validation_errors() {
            detail.push_str(&render(e, &shown, src));
        }
        for w in result.validation_warnings() {
            detail.push_str(&render(w, &shown, src));
        }
        return Err(PolicyError::Invalid {
            path: shown,
            detail,
        });
    }
    Ok((set, warnings))
}

impl PolicyEngine {
    /// Loads the schema and the policy file. Any problem is an error naming the file and line.
    pub fn load(schema_path: Option<&Path>, policy_path: &Path) -> Result<Self, PolicyError> {
        Self::load_checked(schema_path, policy_path, None)
    }

    /// [`PolicyEngine::load`], the files checked as `check` says, at load and at every reload
    /// (the broker's own load: `Some(admin_group)`).
    pub fn load_checked(
        schema_path: Option<&Path>,
        policy_path: &Path,
        check: SettingsCheck,
    ) -> Result<Self, PolicyError> {
        let (schema, schema_json) = load_schema_checked(schema_path, check)?;
        let src = read(policy_path, "policy", check)?;
        let types = ArgumentTypes::unknown();
        let (set, warnings) = compile_with(&schema, &types, policy_path, &src)?;
        Ok(Self {
            check,
            policy_path: policy_path.to_path_buf(),
            current: RwLock::new(Arc::new(PolicyVersion::new(1, set, src))),
            schema_json,
            arguments: RwLock::new(Arc::new(ArgumentState {
                types,
                schema: schema.clone(),
                warnings,
            })),
            names: Names::new(),
            authorizer: Authorizer::new(),
            action_entities: schema.action_entities().ok(),
            conforming: RwLock::new(Vec::new()),
            tool_store: Mutex::new(None),
            schema,
        })
    }

    pub fn policy_path(&self) -> &Path {
        &self.policy_path
    }

    /// The policy set in force now.
    pub fn current(&self) -> Arc<PolicyVersion> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Re-reads the policy file. On any error the old set stays in force.
    pub fn reload(&self) -> Result<Arc<PolicyVersion>, PolicyError> {
        let src = read(&self.policy_path, "policy", self.check)?;
        let state = self.argument_state();
        let (set, warnings) = compile_with(&state.schema, &state.types, &self.policy_path, &src)?;
        let mut guard = match self.current.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let next = Arc::new(PolicyVersion::new(guard.version + 1, set, src));
        *guard = next.clone();
        drop(guard);
        *self.arguments.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(ArgumentState {
            types: state.types.clone(),
            schema: state.schema.clone(),
            warnings,
        });
        Ok(next)
    }

    fn argument_state(&self) -> Arc<ArgumentState> {
        self.arguments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The tools' argument types are known (at start, once every provider listed its tools) or
    /// changed (an upstream's tools drifted): the policy set in force is validated again
    /// against them. `Err` names the policies that read an argument no tool has (at start,
    /// the broker refuses to start; later, the set stays in force and the caller says so);
    /// `Ok` carries the warnings. The types are kept either way: they are what the tools are.
    pub fn set_argument_types(&self, types: ArgumentTypes) -> Result<Vec<String>, PolicyError> {
        let schema = self
            .schema_json
            .clone()
            .and_then(|mut json| {
                arguments::augment(&mut json, &types);
                let fragment = SchemaFragment::from_json_value(json)
                    .inspect_err(|e| tracing::warn!(error = %e, "the schema with argument types does not load; arguments are not validated"))
                    .ok()?;
                Schema::from_schema_fragments([fragment])
                    .inspect_err(|e| tracing::warn!(error = %e, "the schema with argument types does not load; arguments are not validated"))
                    .ok()
            })
            .unwrap_or_else(|| self.schema.clone());
        let pv = self.current();
        let result = compile_with(&schema, &types, &self.policy_path, &pv.source);
        // An error here does not take the set out of force (the caller refuses a start, or says
        // so): it is what the operator must see, as a warning, until the set is fixed.
        let warnings = match &result {
            Ok((_, w)) => w.clone(),
            Err(e) => vec![e.to_string()],
        };
        *self.arguments.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(ArgumentState {
            types,
            schema,
            warnings: warnings.clone(),
        });
        result.map(|(_, w)| w)
    }

    /// What the last validation of the policy set found that does not refuse it.
    pub fn argument_warnings(&self) -> Vec<String> {
        self.argument_state().warnings.clone()
    }

    /// The policies that can apply to `principal`, cached per principal for this version.
    fn slice(&self, pv: &PolicyVersion, principal: &EntityUid) -> Arc<PolicySet> {
        let key = principal.to_string();
        let mut cache = lock(&pv.sliced);
        if let Some(set) = cache.get(&key) {
            return set.clone();
        }
        let keep = pv
            .set
            .policies()
            .filter(|p| match p.principal_constraint() {
                PrincipalConstraint::Eq(uid) => &uid == principal,
                PrincipalConstraint::Is(ty) => &ty == principal.type_name(),
                PrincipalConstraint::IsIn(ty, _) => &ty == principal.type_name(),
                // `in` can match through ancestors: keep it (over-approximation is safe).
                PrincipalConstraint::In(_) | PrincipalConstraint::Any => true,
            });
        let sliced = match PolicySet::from_policies(keep.cloned()) {
            Ok(set) => Arc::new(set),
            // Cannot happen (ids are unique in the source set); fall back to the whole set.
            Err(_) => Arc::new(pv.set.clone()),
        };
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(key, sliced.clone());
        sliced
    }

    /// The principal and (with its owner, when the host named one) the agent.
    fn base_entities(
        &self,
        principal: &EntityUid,
        agent: Option<&EntityUid>,
        owner: Option<&str>,
    ) -> Result<Vec<Entity>, String> {
        let mut out = vec![Entity::new_no_attrs(principal.clone(), HashSet::new())];
        if let Some(agent) = agent {
            let attrs = match owner {
                Some(o) => HashMap::from([(
                    "owner".to_owned(),
                    RestrictedExpression::new_entity_uid(self.names.uid("User", o)?),
                )]),
                None => HashMap::new(),
            };
            out.push(Entity::new(agent.clone(), attrs, HashSet::new()).map_err(|e| e.to_string())?);
        }
        Ok(out)
    }

    /// Can a template's requirement be decided under this schema: does it declare the
    /// resource type, and does `action` apply to it? Asked at start for every template, so a
    /// typo is an error naming it rather than a deny on every call.
    pub fn check_template(&self, action: &str, resource_type: &str) -> Result<(), String> {
        let ty = self.names.type_name(resource_type)?;
        if !self.schema.entity_types().any(|t| t == &ty) {
            return Err(format!("the schema declares no entity type `{ty}`"));
        }
        let a = self.names.action(action)?;
        let Some(types) = self.schema.resources_for_action(&a) else {
            let known: Vec<String> = self
                .schema
                .actions()
                .map(|a| format!("`{}`", a.id().unescaped()))
                .collect();
            return Err(format!(
                "the schema has no action `{action}` (it has {})",
                known.join(", ")
            ));
        };
        if !types.into_iter().any(|t| t == &ty) {
            let fits: Vec<String> = self
                .schema
                .actions()
                .filter(|a| {
                    self.schema
                        .resources_for_action(a)
                        .is_some_and(|mut ts| ts.any(|t| t == &ty))
                })
                .map(|a| format!("`{}`", a.id().unescaped()))
                .collect();
            return Err(format!(
                "the schema's action `{action}` does not apply to `{ty}` (actions that do: {})",
                if fits.is_empty() {
                    "none".to_owned()
                } else {
                    fits.join(", ")
                }
            ));
        }
        Ok(())
    }

    /// Does `resource` fit the schema (its type's attributes, their types)? For an entity of
    /// the operator's type, whose attributes come from the call's arguments: one that does not
    /// cannot be decided on.
    pub fn check_resource(&self, resource: &Resource) -> Result<(), String> {
        let r = self.names.uid(resource.type_name(), resource.id())?;
        Entities::from_entities([Self::resource_entity(resource, &r)?], Some(&self.schema))
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn resource_entity(resource: &Resource, r: &EntityUid) -> Result<Entity, String> {
        let attrs = match resource {
            Resource::File { namespace, path } => HashMap::from([
                (
                    "path".to_owned(),
                    RestrictedExpression::new_string(path.clone()),
                ),
                (
                    "namespace".to_owned(),
                    RestrictedExpression::new_string(namespace.clone()),
                ),
            ]),
            Resource::Tool { name } => HashMap::from([(
                "name".to_owned(),
                RestrictedExpression::new_string(name.clone()),
            )]),
            Resource::Url(u) => {
                let mut attrs = HashMap::from([
                    (
                        "scheme".to_owned(),
                        RestrictedExpression::new_string(u.scheme.clone()),
                    ),
                    (
                        "host".to_owned(),
                        RestrictedExpression::new_string(u.host.clone()),
                    ),
                    (
                        "port".to_owned(),
                        RestrictedExpression::new_long(i64::from(u.port)),
                    ),
                    (
                        "path".to_owned(),
                        RestrictedExpression::new_string(u.path.clone()),
                    ),
                ]);
                if let Some(ip) = u.ip {
                    attrs.insert(
                        "ip".to_owned(),
                        RestrictedExpression::new_ip(ip.to_string()),
                    );
                }
                attrs
            }
            Resource::Entity { attributes, .. } => attributes
                .iter()
                .map(|(k, v)| Ok((k.clone(), restricted(k, v)?)))
                .collect::<Result<HashMap<_, _>, String>>()?,
        };
        Entity::new(r.clone(), attrs, HashSet::new()).map_err(|e| e.to_string())
    }

    /// Does `ctx` fit the schema for each (action, resource type)? Asked when a turn opens, so
    /// that attributes the schema does not declare are refused there, by name, rather than
    /// denying every call of the turn.
    pub fn check_context(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        shapes: &[(&str, &str)],
    ) -> Result<(), String> {
        let prepared = self.prepared(pv, ctx)?;
        for (action, ty) in shapes {
            let a = self.names.action(action)?;
            let r = self.names.uid(ty, "")?;
            Request::new(
                prepared.principal.clone(),
                a,
                r,
                prepared.context.clone(),
                Some(&self.schema),
            )
            .map_err(|e| {
                format!("the turn's context does not fit the schema for action `{action}`: {e}")
            })?;
        }
        Ok(())
    }

    /// The call-time decision. Never fails: any error is a deny with the error in `errors`.
    pub fn decide(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource: &Resource,
    ) -> Decision {
        self.decide_with(pv, ctx, action, resource, None)
    }

    /// [`Self::decide`] for a call: `context.arguments` holds the call's typed arguments.
    pub fn decide_with(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource: &Resource,
        arguments: Option<&Typed>,
    ) -> Decision {
        match self.try_decide(pv, ctx, action, resource, arguments) {
            Ok(d) => d,
            Err(e) => Decision::internal(e),
        }
    }

    /// The context a decision with `arguments` sees, as JSON (`policy check` prints it).
    pub fn context_shown(ctx: &AccessContext, arguments: Option<&Typed>) -> serde_json::Value {
        let mut m = context_json(ctx);
        if let Some(t) = arguments {
            m.insert("arguments".to_owned(), t.shown.clone());
        }
        serde_json::Value::Object(m)
    }

    /// The decision inputs shared by every call of one context under `pv`.
    fn prepared(&self, pv: &PolicyVersion, ctx: &AccessContext) -> Result<Arc<Prepared>, String> {
        if let Some(p) = lock(&pv.prepared).get(ctx) {
            return Ok(p.clone());
        }
        let p = self.names.uid("User", &ctx.principal)?;
        let agent_uid = ctx
            .agent
            .as_deref()
            .map(|id| self.names.uid("Agent", id))
            .transpose()?;
        // Validated against the schema (see the module docs); with it, the schema's action
        // entities are added, so action groups work.
        let base = Entities::from_entities(
            self.base_entities(&p, agent_uid.as_ref(), ctx.agent_owner.as_deref())?,
            Some(&self.schema),
        )
        .map_err(|e| format!("the agent does not fit the schema: {e}"))?;
        let mut pairs = Vec::new();
        if let Some(agent) = &agent_uid {
            pairs.push((
                "agent".to_owned(),
                RestrictedExpression::new_entity_uid(agent.clone()),
            ));
        }
        let turn = ctx.turn_attributes();
        if let Some(t) = &turn {
            pairs.push(("turn".to_owned(), restricted("turn", t)?));
        }
        let context = Context::from_pairs(pairs.clone()).map_err(|e| e.to_string())?;
        let signature = format!(
            "{}{}{}",
            u8::from(agent_uid.is_some()),
            u8::from(ctx.agent_owner.is_some()),
            turn.as_ref().map(type_signature).unwrap_or_default()
        );
        let set = self.slice(pv, &p);
        let prepared = Arc::new(Prepared {
            principal: p,
            pairs,
            signature,
            base,
            context,
            set,
            narrowed: RwLock::new(Vec::new()),
        });
        let mut cache = lock(&pv.prepared);
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(ctx.clone(), prepared.clone());
        Ok(prepared)
    }

    /// `prepared`'s slice narrowed to the policies whose action scope can match `action` (an
    /// `in` scope through the schema's action groups) and whose resource scope can match a
    /// resource of `resource_type`; cached per (action, type). Keeping a policy that cannot
    /// match is only slower; dropping one that can would be wrong, so every doubt keeps it.
    fn narrowed(
        &self,
        prepared: &Prepared,
        action: &str,
        action_uid: &EntityUid,
        resource_type: &str,
    ) -> Arc<PolicySet> {
        if let Some((_, _, set)) = prepared
            .narrowed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(a, t, _)| a == action && *t == resource_type)
        {
            return set.clone();
        }
        let Ok(ty) = self.names.type_name(resource_type) else {
            return prepared.set.clone();
        };
        let action_may_match = |u: &EntityUid| {
            u == action_uid
                || self
                    .action_entities
                    .as_ref()
                    .is_none_or(|e| e.is_ancestor_of(u, action_uid))
        };
        let keep = prepared.set.policies().filter(|p| {
            let action_ok = match p.action_constraint() {
                ActionConstraint::Any => true,
                ActionConstraint::Eq(u) => &u == action_uid,
                ActionConstraint::In(us) => us.iter().any(action_may_match),
            };
            let resource_ok = match p.resource_constraint() {
                ResourceConstraint::Is(t) | ResourceConstraint::IsIn(t, _) => t == ty,
                ResourceConstraint::Eq(u) => u.type_name() == &ty,
                ResourceConstraint::Any | ResourceConstraint::In(_) => true,
            };
            action_ok && resource_ok
        });
        let set = match PolicySet::from_policies(keep.cloned()) {
            Ok(set) => Arc::new(set),
            Err(_) => prepared.set.clone(),
        };
        let mut cache = prepared.narrowed.write().unwrap_or_else(|p| p.into_inner());
        if cache.len() < CACHE_MAX {
            cache.push((action.to_owned(), resource_type.to_owned(), set.clone()));
        }
        set
    }

    fn try_decide(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource: &Resource,
        arguments: Option<&Typed>,
    ) -> Result<Decision, String> {
        let prepared = self.prepared(pv, ctx)?;
        let a = self.names.action(action)?;
        let set = &self.narrowed(&prepared, action, &a, resource.type_name());
        let r = self.names.uid(resource.type_name(), resource.id())?;
        // The resource entity and the request are validated against the schema the first time
        // their shape is seen (see `Shape`); a shape that fails is never remembered, so it
        // fails (deny) every time.
        let known = self
            .conforming
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|(a, t, g)| a == action && t == resource.type_name() && *g == prepared.signature)
            && resource.fixed_shape();
        let schema = (!known).then_some(&self.schema);
        // Only the resource entity is new per call.
        let entities = prepared
            .base
            .clone()
            .add_entities([Self::resource_entity(resource, &r)?], schema)
            .map_err(|e| e.to_string())?;
        // Every decision carries `context.arguments` when a policy reads them (an empty record
        // when this decision has no call: a search hit's read check); when none does, they
        // change nothing and are left out.
        let empty;
        let arguments = match (pv.reads_any_arguments(), arguments) {
            (false, _) => None,
            (true, Some(t)) => Some(t),
            (true, None) => {
                empty = arguments::empty();
                Some(&empty)
            }
        };
        // The request as the schema sees it: made (and so validated) only where it is needed,
        // for the decision itself or for a shape not seen yet.
        let validated = (arguments.is_none() || !known)
            .then(|| {
                Request::new(
                    prepared.principal.clone(),
                    a.clone(),
                    r.clone(),
                    prepared.context.clone(),
                    schema,
                )
                .map_err(|e| format!("request does not fit the schema: {e}"))
            })
            .transpose()?;
        if !known && resource.fixed_shape() {
            let shape = (
                action.to_owned(),
                resource.type_name().to_owned(),
                prepared.signature.clone(),
            );
            let mut conforming = self.conforming.write().unwrap_or_else(|p| p.into_inner());
            if !conforming.contains(&shape) {
                conforming.push(shape);
            }
        }
        // The call's arguments join the context validated above. They are not validated against
        // the schema: a Cedar record type is closed, and the schema's `context.arguments` (see
        // `arguments`) is the union of every tool of the action, not this tool's type. They were
        // typed from this tool's own inputSchema, which the arguments passed; what could still go
        // wrong is a policy reading an argument this tool lacks, an evaluation error, which
        // below denies even when it is a `forbid`'s.
        let request = match (arguments, validated) {
            (None, Some(request)) => request,
            (None, None) => return Err("the request was not made".to_owned()),
            (Some(t), _) => {
                let mut pairs = prepared.pairs.clone();
                pairs.push(("arguments".to_owned(), t.expr.clone()));
                let context = Context::from_pairs(pairs).map_err(|e| e.to_string())?;
                Request::new(prepared.principal.clone(), a, r, context, None)
                    .map_err(|e| format!("request does not fit the schema: {e}"))?
            }
        };
        let response = self.authorizer.is_authorized(&request, set, &entities);
        let policies: Vec<String> = response
            .diagnostics()
            .reason()
            .map(|id| id.to_string())
            .collect();
        let errors: Vec<String> = response
            .diagnostics()
            .errors()
            .map(|e| e.to_string())
            .collect();
        // Cedar skips a policy whose condition errors: for a `forbid`, that is failing open. A
        // `forbid` that errors denies here, and names itself.
        let erring_forbids: Vec<String> = response
            .diagnostics()
            .errors()
            .map(|e| {
                let AuthorizationError::PolicyEvaluationError(e) = e;
                e.policy_id()
            })
            .filter(|id| set.policy(id).is_some_and(|p| p.effect() == Effect::Forbid))
            .map(|id| id.to_string())
            .collect();
        let (allowed, policies) = if erring_forbids.is_empty() {
            (response.decision() == CedarDecision::Allow, policies)
        } else {
            (false, erring_forbids)
        };
        let forbidden = !allowed
            && policies.iter().any(|id| {
                set.policy(&PolicyId::new(id))
                    .is_some_and(|p: &Policy| p.effect() == Effect::Forbid)
            });
        let approval = if allowed && !pv.approval.is_empty() {
            policies
                .iter()
                .filter_map(|id| pv.approval.get(id).copied())
                .reduce(Approver::narrower)
        } else {
            None
        };
        Ok(Decision {
            allowed,
            forbidden,
            policies,
            errors,
            approval,
        })
    }

    /// Could any call of `action` on some resource of type `resource_type` be permitted in this
    /// context? Type-aware partial evaluation with the principal and the whole turn context
    /// known and only the resource unknown: hidden exactly when the answer is a definite deny
    /// (no resource could be permitted). Errors answer "yes" (never hide a tool that some call
    /// could be permitted; the call itself is still decided at call time).
    pub fn could_permit(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource_type: &str,
    ) -> bool {
        self.could_permit_on(pv, ctx, action, resource_type, None, &[], None)
    }

    /// [`Self::could_permit`] for one tool whose resource has attributes known before the call
    /// (a file tool's `namespace`: its provider's), and whose arguments can be only those
    /// `arguments` types (its own; `None`: not known): a policy that permits only another
    /// namespace's files, or reads an argument the tool does not have, hides it.
    pub fn could_permit_known(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource_type: &str,
        known: &[(&str, serde_json::Value)],
        arguments: Option<&arguments::Typing>,
    ) -> bool {
        self.could_permit_on(pv, ctx, action, resource_type, None, known, arguments)
    }

    /// Is the answer the same for every resource of `resource_type`? `Some(false)`: no call can
    /// be permitted (a definite deny with the resource unknown); `Some(true)`: every call is
    /// (a definite allow); `None`: it depends on the resource (or evaluation failed), so ask
    /// per resource with [`Self::could_permit_resource`].
    pub fn permit_for_every(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource_type: &str,
    ) -> Option<bool> {
        match self.partial_decision(pv, ctx, action, resource_type, None, &[], None) {
            Ok(Some(CedarDecision::Allow)) => Some(true),
            Ok(Some(CedarDecision::Deny)) => Some(false),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(principal = %ctx.principal, %action, %resource_type, error = %e, "partial evaluation failed; deciding per tool");
                None
            }
        }
    }

    /// For tools whose resource is the tool itself: could a call of `action` on each named tool
    /// be permitted? The context is the one every call of this (principal, agent) carries, so
    /// this is the call-time decision, made for all the tools at once: one entity store holding
    /// every tool, then one concrete request per tool on the principal's slice. A tool is
    /// hidden only on a deny without errors; if the store cannot be built, every tool is asked
    /// on its own with [`Self::could_permit_resource`].
    pub fn permitted_tools(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        names: &[&str],
    ) -> Vec<bool> {
        self.permitted_tools_with(pv, ctx, action, names, &[])
    }

    /// [`Self::permitted_tools`], each tool's argument types given (`typings[i]` for
    /// `names[i]`; missing: not known), for a set that reads `context.arguments`.
    pub fn permitted_tools_with(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        names: &[&str],
        typings: &[arguments::Typing],
    ) -> Vec<bool> {
        let batch = || -> Result<Vec<bool>, String> {
            let Some(first) = names.first() else {
                return Ok(vec![]);
            };
            // Validates this shape against the schema (and remembers it), as a call would.
            let probe = Resource::Tool {
                name: (*first).to_owned(),
            };
            let d = self.try_decide(pv, ctx, action, &probe, None)?;
            if !d.errors.is_empty() {
                return Err(d.errors.join("; "));
            }
            let prepared = self.prepared(pv, ctx)?;
            let a = self.names.action(action)?;
            let store = self.tool_store(names)?;
            let (uids, entities) = (&store.uids, &store.entities);
            let narrowed = self.narrowed(&prepared, action, &a, "Tool");
            if reads_arguments(pv, &narrowed) {
                // A concrete evaluation would see no arguments; each tool is asked with them
                // unknown instead.
                return Err("a policy reads the call's arguments".into());
            }
            // What is left of those policies once everything but the tool is known (Cedar's
            // residual policies, made for re-authorization): each tool evaluates only that.
            let residual = self.residual_for_type(&prepared, &a, "Tool", &narrowed);
            let set = residual.as_ref().unwrap_or(&narrowed);
            uids.iter()
                .map(|r| {
                    let request = Request::new(
                        prepared.principal.clone(),
                        a.clone(),
                        r.clone(),
                        prepared.context.clone(),
                        None,
                    )
                    .map_err(|e| e.to_string())?;
                    let response = self.authorizer.is_authorized(&request, set, entities);
                    Ok(response.decision() == CedarDecision::Allow
                        || response.diagnostics().errors().next().is_some())
                })
                .collect()
        };
        match batch() {
            Ok(answers) => answers,
            Err(e) => {
                tracing::debug!(principal = %ctx.principal, %action, error = %e, "batch tool decision failed; asking per tool");
                names
                    .iter()
                    .enumerate()
                    .map(|(i, name)| {
                        let resource = Resource::Tool {
                            name: (*name).to_owned(),
                        };
                        self.could_permit_on(
                            pv,
                            ctx,
                            action,
                            resource.type_name(),
                            Some(&resource),
                            &[],
                            typings.get(i),
                        )
                    })
                    .collect()
            }
        }
    }

    /// The [`ToolStore`] for `names`: the cached one if it holds exactly these names.
    fn tool_store(&self, names: &[&str]) -> Result<Arc<ToolStore>, String> {
        if let Some(store) = lock(&self.tool_store).as_ref()
            && store
                .names
                .iter()
                .map(String::as_str)
                .eq(names.iter().copied())
        {
            return Ok(store.clone());
        }
        let Some(actions) = &self.action_entities else {
            return Err("the schema's action entities are not available".into());
        };
        let mut uids = Vec::with_capacity(names.len());
        let mut tools = Vec::with_capacity(names.len());
        for name in names {
            let resource = Resource::Tool {
                name: (*name).to_owned(),
            };
            let r = self.names.uid("Tool", name)?;
            tools.push(Self::resource_entity(&resource, &r)?);
            uids.push(r);
        }
        let entities = actions
            .clone()
            .add_entities(tools, None)
            .map_err(|e| e.to_string())?;
        let store = Arc::new(ToolStore {
            names: names.iter().map(|n| (*n).to_owned()).collect(),
            uids,
            entities,
        });
        *lock(&self.tool_store) = Some(store.clone());
        Ok(store)
    }

    /// `set`'s residual policies for `action` on an unknown resource of `resource_type`, the
    /// principal, agent and context known. `None` if partial evaluation fails (the caller then
    /// evaluates `set` itself).
    fn residual_for_type(
        &self,
        prepared: &Prepared,
        action: &EntityUid,
        resource_type: &str,
        set: &PolicySet,
    ) -> Option<PolicySet> {
        let attempt = || -> Result<PolicySet, String> {
            let request = PartialRequest::new(
                PartialEntityUid::from_concrete(prepared.principal.clone()),
                action.clone(),
                PartialEntityUid::new(self.names.type_name(resource_type)?, None),
                Some(prepared.context.clone()),
                &self.schema,
            )
            .map_err(|e| e.to_string())?;
            let partial = PartialEntities::from_concrete(prepared.base.clone(), &self.schema)
                .map_err(|e| e.to_string())?;
            let response = set
                .tpe(&request, &partial, &self.schema)
                .map_err(|e| e.to_string())?;
            Ok(response.policy_set())
        };
        attempt()
            .inspect_err(|e| tracing::debug!(error = %e, "no residual policies; using the set"))
            .ok()
    }

    /// Like [`Self::could_permit`], for one known resource (a tool whose resource is the tool
    /// itself).
    pub fn could_permit_resource(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource: &Resource,
    ) -> bool {
        self.could_permit_on(
            pv,
            ctx,
            action,
            resource.type_name(),
            Some(resource),
            &[],
            None,
        )
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the question's parts: who, what, and what is known of the resource and the arguments"
    )]
    fn could_permit_on(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource_type: &str,
        resource: Option<&Resource>,
        known: &[(&str, serde_json::Value)],
        arguments: Option<&arguments::Typing>,
    ) -> bool {
        match self.partial_decision(pv, ctx, action, resource_type, resource, known, arguments) {
            Ok(decision) => decision != Some(CedarDecision::Deny),
            Err(e) => {
                tracing::debug!(principal = %ctx.principal, %action, %resource_type, error = %e, "partial evaluation failed; showing the tool");
                true
            }
        }
    }

    /// Type-aware partial evaluation with the principal and the context known and (without
    /// `resource`) the resource unknown, save the attributes in `known`: `Some` decision when
    /// it is definite.
    #[expect(
        clippy::too_many_arguments,
        reason = "the question's parts: who, what, and what is known of the resource and the arguments"
    )]
    fn partial_decision(
        &self,
        pv: &PolicyVersion,
        ctx: &AccessContext,
        action: &str,
        resource_type: &str,
        resource: Option<&Resource>,
        known: &[(&str, serde_json::Value)],
        arguments: Option<&arguments::Typing>,
    ) -> Result<Option<CedarDecision>, String> {
        let prepared = self.prepared(pv, ctx)?;
        let a = self.names.action(action)?;
        let mut entities = prepared.base.clone();
        let partial_resource = match resource {
            Some(r) => {
                let r_uid = self.names.uid(r.type_name(), r.id())?;
                entities = entities
                    .add_entities([Self::resource_entity(r, &r_uid)?], Some(&self.schema))
                    .map_err(|e| e.to_string())?;
                PartialEntityUid::from_concrete(r_uid)
            }
            None => PartialEntityUid::new(self.names.type_name(resource_type)?, None),
        };
        // A policy that reads `context.arguments` cannot be decided before the call: the
        // arguments are unknown then. Partial evaluation leaves a whole context known or
        // unknown, so with such a policy in the slice the context is unknown, typed by the
        // schema that declares the arguments, and what is known of it (agent, turn) is written
        // into the policies instead (see `known`), as are the resource's known attributes.
        let unknown_context = reads_arguments(pv, &prepared.set);
        let rewritten = if unknown_context || !known.is_empty() {
            let shown = unknown_context.then(|| context_json(ctx));
            known::substitute(
                &prepared.set,
                &known::Known {
                    resource: known,
                    context: shown.as_ref(),
                    arguments: arguments.map(|t| &t.fields),
                },
            )
        } else {
            None
        };
        let set = rewritten.as_ref().unwrap_or(&prepared.set);
        let state = self.argument_state();
        let schema = if unknown_context {
            &state.schema
        } else {
            &self.schema
        };
        let request = PartialRequest::new(
            PartialEntityUid::from_concrete(prepared.principal.clone()),
            a,
            partial_resource,
            (!unknown_context).then(|| prepared.context.clone()),
            schema,
        )
        .map_err(|e| e.to_string())?;
        let partial =
            PartialEntities::from_concrete(entities, schema).map_err(|e| e.to_string())?;
        let response = set
            .tpe(&request, &partial, schema)
            .map_err(|e| e.to_string())?;
        Ok(response.decision().or_else(|| {
            // Undecided: a deny all the same when no permit is true already and every residual
            // permit is one no value meets (`amount > 5 && amount < 3`), or one a residual
            // forbid applies to whenever it is true (`amount <= 100` under a forbid of
            // `amount < 200`): see `never`.
            if response.true_permits().next().is_some() {
                return None;
            }
            let forbids: Vec<Policy> = response
                .residual_forbids()
                .filter_map(|id| response.get_policy(id))
                .collect();
            let hopeless = response.residual_permits().all(|id| {
                response.get_policy(id).is_some_and(|p| {
                    never::never_true(&p) || forbids.iter().any(|f| never::covers(f, &p))
                })
            });
            hopeless.then_some(CedarDecision::Deny)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("no-secrets")
forbid(principal, action, resource is SharedOS::File)
when { resource.path like "*/secret*" };
"#;

    fn engine(src: &str) -> PolicyEngine {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("p.cedar");
        std::fs::write(&path, src).expect("write");
        PolicyEngine::load(None, &path).expect("load")
    }

    fn file(path: &str) -> Resource {
        Resource::File {
            namespace: "files".into(),
            path: path.into(),
        }
    }

    #[test]
    fn decides_from_the_resource() {
        let e = engine(POLICY);
        let pv = e.current();
        let d = e.decide(
            &pv,
            &AccessContext::new("alice", None),
            "read",
            &file("/public/a.txt"),
        );
        assert!(d.allowed);
        assert_eq!(d.policies, vec!["alice-public".to_owned()]);
        let d = e.decide(
            &pv,
            &AccessContext::new("alice", None),
            "read",
            &file("/private/a.txt"),
        );
        assert!(!d.allowed && !d.forbidden && d.policies.is_empty());
        let d = e.decide(
            &pv,
            &AccessContext::new("alice", None),
            "read",
            &file("/public/secret.txt"),
        );
        assert!(!d.allowed && d.forbidden);
        assert_eq!(d.policies, vec!["no-secrets".to_owned()]);
        let d = e.decide(
            &pv,
            &AccessContext::new("bob", Some("agent-1")),
            "read",
            &file("/public/a.txt"),
        );
        assert!(!d.allowed);
        // `"` and `::` in ids cannot inject: the id is data.
        let d = e.decide(
            &pv,
            &AccessContext::new("alice\"", None),
            "read",
            &file("/public/a.txt"),
        );
        assert!(!d.allowed);
    }

    #[test]
    fn the_agent_is_in_the_context() {
        let e = engine(
            r#"@id("helper-only") permit(principal == SharedOS::User::"carol", action == SharedOS::Action::"read", resource is SharedOS::File)
               when { context has agent && context.agent == SharedOS::Agent::"helper" };"#,
        );
        let pv = e.current();
        assert!(
            e.decide(
                &pv,
                &AccessContext::new("carol", Some("helper")),
                "read",
                &file("/a")
            )
            .allowed
        );
        assert!(
            !e.decide(
                &pv,
                &AccessContext::new("carol", Some("other")),
                "read",
                &file("/a")
            )
            .allowed
        );
        assert!(
            !e.decide(&pv, &AccessContext::new("carol", None), "read", &file("/a"))
                .allowed
        );
        // The catalogue is decided in the turn's context: shown only where a call can be permitted.
        assert!(e.could_permit(
            &pv,
            &AccessContext::new("carol", Some("helper")),
            "read",
            "File"
        ));
        assert!(!e.could_permit(
            &pv,
            &AccessContext::new("carol", Some("other")),
            "read",
            "File"
        ));
        assert!(!e.could_permit(&pv, &AccessContext::new("carol", None), "read", "File"));
    }

    #[test]
    fn catalogue_question() {
        let e = engine(POLICY);
        let pv = e.current();
        assert!(e.could_permit(&pv, &AccessContext::new("alice", None), "read", "File"));
        assert!(!e.could_permit(&pv, &AccessContext::new("alice", None), "write", "File"));
        assert!(!e.could_permit(&pv, &AccessContext::new("bob", None), "read", "File"));
        assert!(!e.could_permit(&pv, &AccessContext::new("alice", None), "call", "Tool"));
    }

    #[test]
    fn a_resource_that_does_not_fit_the_schema_is_denied_every_time() {
        let dir = tempfile::tempdir().expect("tmp");
        let schema = dir.path().join("s.cedarschema");
        // This schema's File needs an owner the kernel never supplies.
        std::fs::write(
            &schema,
            BUILTIN_SCHEMA.replace(
                "entity File { path: String, namespace: String };",
                "entity File { path: String, namespace: String, owner: User };",
            ),
        )
        .expect("schema");
        let policy = dir.path().join("p.cedar");
        std::fs::write(
            &policy,
            r#"@id("all") permit(principal, action, resource is SharedOS::File);"#,
        )
        .expect("policy");
        let e = PolicyEngine::load(Some(&schema), &policy).expect("load");
        let pv = e.current();
        for _ in 0..2 {
            let d = e.decide(
                &pv,
                &AccessContext::new("alice", None),
                "read",
                &file("/public/a.txt"),
            );
            assert!(!d.allowed, "{d:?}");
            assert!(!d.errors.is_empty(), "{d:?}");
        }
        // And a shape that fits is decided (and remembered) as before.
        let tool = e.decide(
            &pv,
            &AccessContext::new("alice", Some("a1")),
            "call",
            &Resource::Tool { name: "x.y".into() },
        );
        assert!(!tool.allowed && tool.errors.is_empty(), "{tool:?}");
    }

    fn url(text: &str) -> Resource {
        Resource::Url(crate::resource::WebUrl::parse(text).expect("url").0)
    }

    /// Issue 44 item 2: a URL is decided on its parts, and on its `ip` (Cedar's `ipaddr`)
    /// when its host is an address, however that address was spelled.
    #[test]
    fn a_url_is_decided_on_its_host_and_its_address() {
        let e = engine(
            r#"
@id("docs")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"fetch", resource is SharedOS::Url)
when { resource.scheme == "https" && resource.host == "docs.example.com" && resource.port == 443
    && resource.path like "/guide/*" };

@id("anything-public")
permit(principal == SharedOS::User::"bob", action == SharedOS::Action::"fetch", resource is SharedOS::Url);

@id("no-internal-addresses")
forbid(principal, action, resource is SharedOS::Url)
when { resource has ip && (resource.ip.isLoopback() || resource.ip.isInRange(ip("169.254.0.0/16"))
    || resource.ip.isInRange(ip("10.0.0.0/8"))) };
"#,
        );
        let pv = e.current();
        let (alice, bob) = (
            AccessContext::new("alice", None),
            AccessContext::new("bob", None),
        );
        let decide = |ctx: &AccessContext, text: &str| {
            let d = e.decide(&pv, ctx, "fetch", &url(text));
            assert!(d.errors.is_empty(), "{text}: {d:?}");
            (d.allowed, d.forbidden)
        };
        for text in [
            "https://docs.example.com/guide/a",
            "HTTPS://DOCS.EXAMPLE.COM./guide/a",
            "https://user@docs.example.com:443/guide/../guide/b?x#y",
        ] {
            assert_eq!(decide(&alice, text), (true, false), "{text}");
        }
        for text in [
            "http://docs.example.com/guide/a",
            "https://docs.example.com:8443/guide/a",
            "https://docs.example.com/guide",
            "https://docs.example.com/guide/../admin",
            "https://docs.example.com.evil.example/guide/a",
            "https://docs.example.com@evil.example/guide/a",
        ] {
            assert_eq!(decide(&alice, text), (false, false), "{text}");
        }
        assert_eq!(decide(&bob, "https://example.org/"), (true, false));
        for text in [
            "http://127.0.0.1/",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://0177.0.0.1/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://0xA9FEA9FE/",
            "http://10.1.2.3/",
            "http://example.org@10.0.0.1/",
        ] {
            assert_eq!(decide(&bob, text), (false, true), "{text}");
        }
        // The shape of a URL with and without an address is validated each time.
        assert_eq!(decide(&bob, "https://example.org/"), (true, false));
        // Some URL could be fetched by alice: her catalogue keeps a fetch tool.
        assert!(e.could_permit(&pv, &alice, "fetch", "Url"));
        assert!(!e.could_permit(&pv, &AccessContext::new("carol", None), "fetch", "Url"));
    }

    /// An operator's entity type: decided on its attributes, checked against the schema (a
    /// template whose type or action the schema lacks is refused at start, an entity whose
    /// attributes do not fit it is refused at the call).
    #[test]
    fn an_operators_entity_is_decided_on_its_attributes() {
        let dir = tempfile::tempdir().expect("tmp");
        let schema = dir.path().join("s.cedarschema");
        std::fs::write(
            &schema,
            BUILTIN_SCHEMA
                .replace("resource: [Tool],", "resource: [Tool, Github::Repo, Channel],")
                .replace(
                    "entity Tool { name: String };",
                    "entity Tool { name: String };\n  entity Channel { name: String };",
                )
                + "namespace Github { entity Repo { owner: String, private?: Bool, stars?: Long, topics?: Set<String> }; }\n",
        )
        .expect("schema");
        let policy = dir.path().join("p.cedar");
        std::fs::write(
            &policy,
            r#"
@id("alice-octo")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is Github::Repo)
when { resource.owner == "octo" && !(resource has private && resource.private) };

@id("alice-public-channel")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Channel)
when { resource.name == "public" };
"#,
        )
        .expect("policy");
        let e = PolicyEngine::load(Some(&schema), &policy).expect("load");
        let pv = e.current();
        let alice = AccessContext::new("alice", None);
        let entity = |ty: &str, attrs: serde_json::Value| Resource::Entity {
            type_name: ty.into(),
            id: "x".into(),
            attributes: attrs
                .as_object()
                .expect("object")
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        let decide = |r: &Resource| {
            let d = e.decide(&pv, &alice, "call", r);
            (d.allowed, d.errors.is_empty())
        };
        let repo = |v| entity("Github::Repo", v);
        assert_eq!(
            decide(&repo(serde_json::json!({"owner": "octo"}))),
            (true, true)
        );
        assert_eq!(
            decide(&repo(
                serde_json::json!({"owner": "octo", "stars": 3, "topics": ["a"]})
            )),
            (true, true)
        );
        assert_eq!(
            decide(&repo(serde_json::json!({"owner": "octo", "private": true}))),
            (false, true)
        );
        assert_eq!(
            decide(&repo(serde_json::json!({"owner": "evil"}))),
            (false, true)
        );
        assert_eq!(
            decide(&entity("Channel", serde_json::json!({"name": "public"}))),
            (true, true)
        );
        assert_eq!(
            decide(&entity("Channel", serde_json::json!({"name": "exec"}))),
            (false, true)
        );
        // Attributes that do not fit the schema: refused by check_resource, never permitted.
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"owner": 7}),
            serde_json::json!({"owner": "octo", "private": "no"}),
            serde_json::json!({"owner": "octo", "extra": 1}),
        ] {
            let r = repo(bad.clone());
            let why = e.check_resource(&r).expect_err("does not fit");
            assert!(!why.is_empty(), "{bad}");
            let (allowed, _) = decide(&r);
            assert!(!allowed, "{bad}");
        }
        assert_eq!(
            e.check_resource(&repo(serde_json::json!({"owner": "octo"}))),
            Ok(())
        );
        // At start: the type must be declared and the action must apply to it.
        assert_eq!(e.check_template("call", "Github::Repo"), Ok(()));
        assert_eq!(e.check_template("call", "Channel"), Ok(()));
        assert_eq!(e.check_template("fetch", "Url"), Ok(()));
        assert_eq!(e.check_template("read", "File"), Ok(()));
        let err = e
            .check_template("read", "Github::Repo")
            .expect_err("read on a repo");
        assert!(
            err.contains("does not apply to `Github::Repo`") && err.contains("`call`"),
            "{err}"
        );
        let err = e.check_template("call", "Github::Rpeo").expect_err("typo");
        assert!(err.contains("no entity type `Github::Rpeo`"), "{err}");
        let err = e.check_template("fecth", "Url").expect_err("typo");
        assert!(
            err.contains("no action `fecth`") && err.contains("`fetch`"),
            "{err}"
        );
        assert!(e.could_permit(&pv, &alice, "call", "Github::Repo"));
    }

    #[test]
    fn narrowing_by_action_keeps_action_groups_and_every_forbid_that_can_match() {
        let dir = tempfile::tempdir().expect("tmp");
        let schema = dir.path().join("s.cedarschema");
        std::fs::write(
            &schema,
            r#"namespace SharedOS {
  entity User;
  entity Agent { owner?: User };
  entity File { path: String, namespace: String };
  entity Tool { name: String };
  action readish;
  action read in [readish] appliesTo { principal: [User], resource: [File], context: { agent?: Agent } };
  action list, search, write appliesTo { principal: [User], resource: [File], context: { agent?: Agent } };
  action call appliesTo { principal: [User], resource: [Tool], context: { agent?: Agent } };
}"#,
        )
        .expect("schema");
        let policy = dir.path().join("p.cedar");
        std::fs::write(
            &policy,
            r#"@id("group") permit(principal, action in [SharedOS::Action::"readish"], resource is SharedOS::File);
               @id("tools") permit(principal, action, resource is SharedOS::Tool);
               @id("no-secrets") forbid(principal, action, resource) when { resource has path && resource.path like "*secret*" };"#,
        )
        .expect("policy");
        let e = PolicyEngine::load(Some(&schema), &policy).expect("load");
        let pv = e.current();
        let read = e.decide(
            &pv,
            &AccessContext::new("alice", None),
            "read",
            &file("/a.txt"),
        );
        assert!(read.allowed, "{read:?}");
        assert_eq!(read.policies, vec!["group".to_owned()]);
        assert!(
            !e.decide(
                &pv,
                &AccessContext::new("alice", None),
                "list",
                &file("/a.txt")
            )
            .allowed
        );
        let secret = e.decide(
            &pv,
            &AccessContext::new("alice", None),
            "read",
            &file("/secret.txt"),
        );
        assert!(!secret.allowed && secret.forbidden, "{secret:?}");
        let tool = e.decide(
            &pv,
            &AccessContext::new("alice", None),
            "call",
            &Resource::Tool { name: "x.y".into() },
        );
        assert!(tool.allowed, "{tool:?}");
    }

    #[test]
    fn the_batch_tool_answer_is_the_call_decision() {
        let e = engine(
            r#"@id("agents") permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
                 when { context has agent && resource.name like "a.*" };
               @id("owned") forbid(principal, action, resource is SharedOS::Tool)
                 when { context has agent && context.agent has owner && resource.name == "a.z" };
               @id("bob") forbid(principal == SharedOS::User::"bob", action, resource);"#,
        );
        let pv = e.current();
        let names = ["a.x", "a.z", "b.y"];
        for (principal, agent) in [("alice", Some("a1")), ("alice", None), ("bob", Some("a1"))] {
            let ctx = AccessContext::new(principal, agent);
            let batch = e.permitted_tools(&pv, &ctx, "call", &names);
            let single: Vec<bool> = names
                .iter()
                .map(|n| {
                    let d = e.decide(&pv, &ctx, "call", &Resource::Tool { name: (*n).into() });
                    d.allowed || !d.errors.is_empty()
                })
                .collect();
            assert_eq!(batch, single, "{principal} {agent:?}");
        }
        assert_eq!(
            e.permitted_tools(
                &pv,
                &AccessContext::new("alice", Some("a1")),
                "call",
                &names
            ),
            vec![true, true, false]
        );
        // A second list of names replaces the cached store.
        assert_eq!(
            e.permitted_tools(
                &pv,
                &AccessContext::new("alice", Some("a1")),
                "call",
                &["b.q", "a.q"]
            ),
            vec![false, true]
        );
    }

    #[test]
    fn catalogue_question_for_one_tool_is_exact() {
        let e = engine(
            r#"@id("echo") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
               when { resource.name == "everything.echo" };"#,
        );
        let pv = e.current();
        let tool = |n: &str| Resource::Tool { name: n.into() };
        assert!(e.could_permit(&pv, &AccessContext::new("alice", None), "call", "Tool"));
        assert!(e.could_permit_resource(
            &pv,
            &AccessContext::new("alice", None),
            "call",
            &tool("everything.echo")
        ));
        assert!(!e.could_permit_resource(
            &pv,
            &AccessContext::new("alice", None),
            "call",
            &tool("everything.get-env")
        ));
        assert!(!e.could_permit_resource(
            &pv,
            &AccessContext::new("bob", None),
            "call",
            &tool("everything.echo")
        ));
        // Whether a per-tool question is needed at all.
        assert_eq!(
            e.permit_for_every(&pv, &AccessContext::new("alice", None), "call", "Tool"),
            None
        );
        assert_eq!(
            e.permit_for_every(&pv, &AccessContext::new("bob", None), "call", "Tool"),
            Some(false)
        );
        let all = engine(
            r#"@id("tools") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool);"#,
        );
        let pv = all.current();
        assert_eq!(
            all.permit_for_every(&pv, &AccessContext::new("alice", None), "call", "Tool"),
            Some(true)
        );
        let but = engine(
            r#"@id("tools") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool);
               @id("not-env") forbid(principal, action, resource is SharedOS::Tool) when { resource.name like "*get-env" };"#,
        );
        let pv = but.current();
        assert_eq!(
            but.permit_for_every(&pv, &AccessContext::new("alice", None), "call", "Tool"),
            None
        );
        assert!(!but.could_permit_resource(
            &pv,
            &AccessContext::new("alice", None),
            "call",
            &tool("everything.get-env")
        ));
    }

    #[test]
    fn bad_policies_are_refused_with_location() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("bad.cedar");
        std::fs::write(
            &path,
            "permit(principal, action, resource)\nwhen { resource.nope };",
        )
        .expect("w");
        let err = PolicyEngine::load(None, &path).err().expect("invalid");
        let msg = err.to_string();
        assert!(msg.contains("bad.cedar:2:"), "{msg}");
        std::fs::write(&path, "permit(principal action);").expect("w");
        let msg = PolicyEngine::load(None, &path)
            .err()
            .expect("syntax")
            .to_string();
        assert!(msg.contains("bad.cedar:1:"), "{msg}");
    }

    #[test]
    fn reload_keeps_the_old_set_on_error() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("p.cedar");
        std::fs::write(&path, POLICY).expect("w");
        let e = PolicyEngine::load(None, &path).expect("load");
        std::fs::write(&path, "permit(").expect("w");
        assert!(e.reload().is_err());
        assert_eq!(e.current().version, 1);
        assert!(
            e.decide(
                &e.current(),
                &AccessContext::new("alice", None),
                "read",
                &file("/public/a")
            )
            .allowed
        );
        std::fs::write(&path, "").expect("w");
        assert_eq!(e.reload().expect("reload").version, 2);
        assert!(
            !e.decide(
                &e.current(),
                &AccessContext::new("alice", None),
                "read",
                &file("/public/a")
            )
            .allowed
        );
    }

    #[test]
    fn slicing_keeps_only_applicable_policies() {
        let mut src = String::from(POLICY);
        for i in 0..50 {
            src.push_str(&format!(
                "@id(\"u{i}\") permit(principal == SharedOS::User::\"user{i}\", action == SharedOS::Action::\"read\", resource is SharedOS::File);\n"
            ));
        }
        let e = engine(&src);
        let pv = e.current();
        let p = uid("User", "alice").expect("uid");
        assert_eq!(e.slice(&pv, &p).policies().count(), 2);
        assert!(
            e.decide(&pv, &AccessContext::new("user7", None), "read", &file("/x"))
                .allowed
        );
    }

    #[test]
    fn a_recorded_context_is_the_context_again() {
        let attrs = serde_json::json!({"purpose": "p", "project": "x", "n": 7, "tags": ["b", "a"]});
        let ctx = AccessContext {
            principal: "alice".into(),
            agent: Some("helper".into()),
            agent_owner: Some("alice".into()),
            turn: Some(sharedos_proto::catalog::canonical_json(&attrs).expect("canonical")),
        };
        // What `turn_opened` records of it (see `turn::opened_record`).
        let recorded = sharedos_proto::record::RecordedAccessContext {
            principal: ctx.principal.clone(),
            agent: ctx.agent.clone(),
            agent_owner: ctx.agent_owner.clone(),
            turn: ctx.turn_attributes(),
        };
        let line = serde_json::to_string(&recorded).expect("ser");
        let read: sharedos_proto::record::RecordedAccessContext =
            serde_json::from_str(&line).expect("de");
        assert_eq!(AccessContext::from_recorded(&read), Ok(ctx));
        let plain = AccessContext::new("bob", None);
        let recorded = sharedos_proto::record::RecordedAccessContext {
            principal: "bob".into(),
            agent: None,
            agent_owner: None,
            turn: None,
        };
        assert_eq!(AccessContext::from_recorded(&recorded), Ok(plain));
    }

    fn chat_schema() -> serde_json::Value {
        serde_json::json!({"type": "object", "properties": {
            "channel": {"type": "string"}, "text": {"type": "string"}}})
    }

    fn bank_schema() -> serde_json::Value {
        serde_json::json!({"type": "object", "properties": {
            "amount": {"type": "integer"}, "to": {"type": "string"}}})
    }

    fn call_types() -> ArgumentTypes {
        let mut types = ArgumentTypes::known();
        types.add_tool("call", Some(&chat_schema()));
        types.add_tool("call", Some(&bank_schema()));
        types.add_tool(
            "read",
            Some(&serde_json::json!({"properties": {"path": {"type": "string"}}})),
        );
        types
    }

    fn args(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        match v {
            serde_json::Value::Object(m) => m,
            _ => serde_json::Map::new(),
        }
    }

    const ARGUMENT_POLICY: &str = r#"@id("public")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name == "chat.post" && context has arguments && context.arguments has channel && context.arguments.channel == "public" };
@id("small")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name == "bank.transfer" && context.arguments has amount && context.arguments.amount <= 100 };
"#;

    #[test]
    fn a_call_is_decided_on_its_typed_arguments() {
        let e = engine(ARGUMENT_POLICY);
        assert_eq!(
            e.set_argument_types(call_types()).expect("valid"),
            Vec::<String>::new()
        );
        let pv = e.current();
        let alice = AccessContext::new("alice", None);
        let decide = |tool: &str, schema: serde_json::Value, a: serde_json::Value| {
            let typed = arguments::typed(Some(&schema), &args(a));
            e.decide_with(
                &pv,
                &alice,
                "call",
                &Resource::Tool { name: tool.into() },
                Some(&typed),
            )
        };
        let public = decide(
            "chat.post",
            chat_schema(),
            serde_json::json!({"channel": "public", "text": "hi"}),
        );
        assert!(public.allowed, "{public:?}");
        assert_eq!(public.policies, vec!["public".to_owned()]);
        assert!(
            !decide(
                "chat.post",
                chat_schema(),
                serde_json::json!({"channel": "exec"})
            )
            .allowed
        );
        assert!(!decide("chat.post", chat_schema(), serde_json::json!({})).allowed);
        assert!(
            decide(
                "bank.transfer",
                bank_schema(),
                serde_json::json!({"amount": 100})
            )
            .allowed
        );
        assert!(
            !decide(
                "bank.transfer",
                bank_schema(),
                serde_json::json!({"amount": 101})
            )
            .allowed
        );
        // A fraction is left out: the guarded permit does not apply.
        assert!(
            !decide(
                "bank.transfer",
                bank_schema(),
                serde_json::json!({"amount": 1.5})
            )
            .allowed
        );
        // The same tool under another name's policy: no.
        assert!(!decide("chat.post", bank_schema(), serde_json::json!({"amount": 1})).allowed);
        // Without a call's arguments (a search hit's read check) they are an empty record.
        assert!(
            !e.decide(
                &pv,
                &alice,
                "call",
                &Resource::Tool {
                    name: "chat.post".into()
                }
            )
            .allowed
        );
        // What `policy check` prints of it.
        let typed = arguments::typed(
            Some(&chat_schema()),
            &args(serde_json::json!({"channel": "public", "n": 1})),
        );
        let seen =
            PolicyEngine::context_shown(&AccessContext::new("alice", Some("a1")), Some(&typed));
        assert_eq!(seen["arguments"], serde_json::json!({"channel": "public"}));
        assert_eq!(seen["agent"]["__entity"]["id"], serde_json::json!("a1"));
    }

    #[test]
    fn a_misspelt_argument_is_refused_naming_file_line_and_argument() {
        let typo = ARGUMENT_POLICY.replace(
            "arguments has channel && context.arguments.channel",
            "arguments has chanel && context.arguments.chanel",
        );
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("p.cedar");
        std::fs::write(&path, &typo).expect("write");
        // Before the tools are known it loads (a replay, or a start before the providers listed).
        let e = PolicyEngine::load(None, &path).expect("load");
        let err = e
            .set_argument_types(call_types())
            .expect_err("a typo")
            .to_string();
        assert!(err.contains("p.cedar:3:"), "{err}");
        assert!(err.contains("`context.arguments.chanel`"), "{err}");
        assert!(err.contains("channel"), "the arguments there are: {err}");
        assert_eq!(err.matches("policy `public`").count(), 1, "{err}");
        // Where some tools are not known yet, it is a warning and the set loads.
        let mut open = call_types();
        open.open_action("call");
        let warnings = e.set_argument_types(open).expect("a warning only");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("p.cedar:3:") && warnings[0].contains("chanel"),
            "{warnings:?}"
        );
        // Known again (the upstream listed): a reload of the same file is refused.
        e.set_argument_types(call_types())
            .expect_err("still a typo");
        assert!(e.reload().is_err());
        assert_eq!(e.current().version, 1);
        // An argument of the wrong type is the validator's error, with its place.
        std::fs::write(
            &path,
            ARGUMENT_POLICY.replace("amount <= 100", "amount <= \"100\""),
        )
        .expect("w");
        let err = e.reload().err().expect("a type error").to_string();
        assert!(err.contains("p.cedar:6:"), "{err}");
        std::fs::write(&path, ARGUMENT_POLICY).expect("w");
        assert_eq!(e.reload().expect("fixed").version, 2);
    }

    #[test]
    fn a_forbid_whose_condition_errors_denies() {
        let e = engine(
            r#"@id("all") permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool);
               @id("limit") forbid(principal, action, resource) when { context.arguments.limit > 5 };"#,
        );
        let mut types = call_types();
        types.open_all();
        assert_eq!(e.set_argument_types(types).expect("open").len(), 1);
        let pv = e.current();
        let typed = arguments::typed(
            Some(&chat_schema()),
            &args(serde_json::json!({"channel": "x"})),
        );
        let d = e.decide_with(
            &pv,
            &AccessContext::new("alice", None),
            "call",
            &Resource::Tool {
                name: "chat.post".into(),
            },
            Some(&typed),
        );
        assert!(!d.allowed && d.forbidden, "{d:?}");
        assert_eq!(d.policies, vec!["limit".to_owned()]);
        assert_eq!(d.errors.len(), 1, "{d:?}");
    }

    #[test]
    fn the_catalogue_knows_the_namespace_and_not_the_arguments() {
        let e = engine(
            r#"@id("files-only") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is SharedOS::File)
                 when { resource.namespace == "files" && resource.path like "/public/*" };
               @id("helper-public") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
                 when { context has agent && context.agent == SharedOS::Agent::"helper" && context.arguments has channel && context.arguments.channel == "public" };
               @id("never-read") forbid(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
                 when { resource.name == "chat.read" };"#,
        );
        e.set_argument_types(call_types()).expect("valid");
        let pv = e.current();
        let ns = |n: &str| vec![("namespace", serde_json::json!(n))];
        let alice = AccessContext::new("alice", None);
        assert!(e.could_permit_known(&pv, &alice, "read", "File", &ns("files"), None));
        assert!(!e.could_permit_known(&pv, &alice, "read", "File", &ns("docs"), None));
        let helper = AccessContext::new("alice", Some("helper"));
        let other = AccessContext::new("alice", Some("other"));
        let names = ["chat.post", "chat.read", "bank.pay"];
        let typings = [
            arguments::typing(Some(&chat_schema())),
            arguments::typing(Some(&chat_schema())),
            arguments::typing(Some(&bank_schema())),
        ];
        // bank.pay has no `channel`: no call of it can be permitted.
        assert_eq!(
            e.permitted_tools_with(&pv, &helper, "call", &names, &typings),
            vec![true, false, false]
        );
        assert_eq!(
            e.permitted_tools(&pv, &helper, "call", &names),
            vec![true, false, true]
        );
        let names = ["chat.post", "chat.read"];
        assert_eq!(
            e.permitted_tools(&pv, &other, "call", &names),
            vec![false, false]
        );
        assert_eq!(
            e.permitted_tools(&pv, &alice, "call", &names),
            vec![false, false]
        );
    }

    #[test]
    fn a_residual_no_value_meets_hides_the_tool() {
        let e = engine(
            r#"@id("never") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
                 when { resource.name == "bank.pay" && context.arguments has amount && context.arguments.amount > 5 && context.arguments.amount < 3 };
               @id("two-names") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
                 when { resource.name == "chat.post" && context.arguments has channel && context.arguments.channel == "a" && context.arguments.channel == "b" };
               @id("some") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
                 when { resource.name == "chat.read" && context.arguments has channel && context.arguments.channel like "pub*" && context.arguments.channel != "pub" };
               @id("no-path") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is SharedOS::File)
                 when { resource.path like "/public/*" && resource.path == "/private/x" };"#,
        );
        e.set_argument_types(call_types()).expect("valid");
        let pv = e.current();
        let alice = AccessContext::new("alice", None);
        let names = ["bank.pay", "chat.post", "chat.read"];
        let typings = [
            arguments::typing(Some(&bank_schema())),
            arguments::typing(Some(&chat_schema())),
            arguments::typing(Some(&chat_schema())),
        ];
        assert_eq!(
            e.permitted_tools_with(&pv, &alice, "call", &names, &typings),
            vec![false, false, true]
        );
        assert!(!e.could_permit(&pv, &alice, "read", "File"));
        assert_eq!(e.permit_for_every(&pv, &alice, "read", "File"), Some(false));
    }

    /// The catalogue against brute force: a tool is listed exactly when some sampled arguments
    /// are permitted.
    mod exact {
        use super::*;
        use proptest::prelude::*;

        const CANDIDATES: &[&str] = &[
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name == "chat.post" && context.arguments has channel && context.arguments.channel == "public" };"#,
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name like "bank.*" && context.arguments has amount && context.arguments.amount <= 100 };"#,
            r#"forbid(principal, action, resource) when { context has arguments && context.arguments has amount && context.arguments.amount > 50 };"#,
            r#"forbid(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name == "chat.read" };"#,
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool);"#,
            r#"forbid(principal, action, resource) when { context has arguments && context.arguments has channel && context.arguments.channel == "exec" };"#,
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { context has agent && context.agent == SharedOS::Agent::"helper" && context.arguments has channel };"#,
            r#"permit(principal, action == SharedOS::Action::"read", resource is SharedOS::File) when { resource.namespace == "files" };"#,
            r#"permit(principal, action == SharedOS::Action::"read", resource is SharedOS::File) when { resource.path like "/public/*" && context.arguments has path };"#,
            r#"forbid(principal, action, resource is SharedOS::File) when { resource.namespace == "docs" && resource.path like "/private/*" };"#,
            r#"forbid(principal, action, resource);"#,
            r#"forbid(principal, action == SharedOS::Action::"call", resource) when { context has agent };"#,
            // Residuals no value meets (hidden), beside ones some value does (listed).
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { context.arguments has amount && context.arguments.amount > 5 && context.arguments.amount < 3 };"#,
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { context.arguments has channel && context.arguments.channel == "public" && context.arguments.channel == "exec" };"#,
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name == "bank.pay" && context.arguments has amount && context.arguments.amount >= 10 && context.arguments.amount <= 50 && context.arguments.amount != 11 };"#,
            r#"permit(principal, action == SharedOS::Action::"read", resource is SharedOS::File) when { context.arguments has path && context.arguments.path like "/public/*" && context.arguments.path == "/private/b" };"#,
            r#"permit(principal, action == SharedOS::Action::"read", resource is SharedOS::File) when { resource.path == "/public/a" && resource.path == "/other" };"#,
            r#"permit(principal, action == SharedOS::Action::"read", resource is SharedOS::File) when { resource.path like "/public/*" && !(resource.path like "/private/*") && resource.path != "/public/b" };"#,
            r#"permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { context.arguments has channel && ["public", "exec"].contains(context.arguments.channel) && context.arguments.channel != "public" && context.arguments.channel != "exec" };"#,
            // Forbids that take back every value a permit lets through (hidden), or not all.
            r#"forbid(principal, action == SharedOS::Action::"call", resource) when { context.arguments has amount && context.arguments.amount < 200 };"#,
            r#"forbid(principal, action == SharedOS::Action::"call", resource) when { context.arguments has channel && context.arguments.channel != "x" };"#,
            r#"forbid(principal, action == SharedOS::Action::"read", resource is SharedOS::File) when { resource.path like "/public/*" };"#,
            // URL templates.
            r#"permit(principal, action == SharedOS::Action::"fetch", resource is SharedOS::Url) when { resource.host == "docs.example.com" || resource.host == "127.0.0.1" };"#,
            r#"forbid(principal, action, resource is SharedOS::Url) when { resource has ip && resource.ip.isLoopback() };"#,
            r#"permit(principal, action == SharedOS::Action::"fetch", resource is SharedOS::Url) when { resource.host == "a.example" && resource.host == "b.example" };"#,
            r#"permit(principal, action == SharedOS::Action::"fetch", resource is SharedOS::Url) when { resource.port == 8443 && resource.port < 1024 };"#,
            r#"permit(principal, action == SharedOS::Action::"fetch", resource is SharedOS::Url) when { resource.scheme == "https" && resource.port >= 8000 && context.arguments has url };"#,
        ];

        /// (name, action, namespace for a file tool (`url` for a URL tool), schema).
        fn tools() -> Vec<(
            &'static str,
            &'static str,
            Option<&'static str>,
            serde_json::Value,
        )> {
            let path = serde_json::json!({"properties": {"path": {"type": "string"}}});
            vec![
                ("chat.post", "call", None, chat_schema()),
                ("chat.read", "call", None, chat_schema()),
                ("bank.pay", "call", None, bank_schema()),
                ("files.read", "read", Some("files"), path.clone()),
                ("docs.read", "read", Some("docs"), path),
                (
                    "web.fetch",
                    "fetch",
                    Some("url"),
                    serde_json::json!({"properties": {"url": {"type": "string"}}}),
                ),
            ]
        }

        fn samples(schema: &serde_json::Value) -> Vec<serde_json::Map<String, serde_json::Value>> {
            let props: Vec<String> = schema["properties"]
                .as_object()
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default();
            let values = |name: &str| -> Vec<Option<serde_json::Value>> {
                match name {
                    "channel" => ["public", "exec", "other", "x"]
                        .iter()
                        .map(|v| Some(serde_json::json!(v)))
                        .chain([None])
                        .collect(),
                    "amount" => [0, 50, 51, 100, 101]
                        .iter()
                        .map(|v| Some(serde_json::json!(v)))
                        .chain([None])
                        .collect(),
                    "path" => ["/public/a", "/private/b", "/other"]
                        .iter()
                        .map(|v| Some(serde_json::json!(v)))
                        .collect(),
                    "url" => [
                        "https://docs.example.com/x",
                        "http://127.0.0.1/",
                        "https://a.example/",
                        "https://other.example:8443/",
                        "http://other.example:8000/",
                    ]
                    .iter()
                    .map(|v| Some(serde_json::json!(v)))
                    .collect(),
                    _ => vec![None, Some(serde_json::json!("x"))],
                }
            };
            let mut out = vec![serde_json::Map::new()];
            for p in props {
                out = out
                    .into_iter()
                    .flat_map(|m| {
                        values(&p).into_iter().map({
                            let p = p.clone();
                            move |v| {
                                let mut m = m.clone();
                                if let Some(v) = v {
                                    m.insert(p.clone(), v);
                                }
                                m
                            }
                        })
                    })
                    .collect();
            }
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]
            #[test]
            fn listed_tools_are_what_brute_force_finds(pick in proptest::collection::vec(any::<bool>(), CANDIDATES.len())) {
                let src: String = CANDIDATES.iter().zip(&pick).filter(|(_, p)| **p).enumerate()
                    .map(|(i, (c, _))| format!("@id(\"p{i}\") {c}\n")).collect();
                let e = engine(&src);
                let mut types = ArgumentTypes::known();
                for (_, action, _, schema) in tools() {
                    types.add_tool(action, Some(&schema));
                }
                e.set_argument_types(types).expect("valid");
                let pv = e.current();
                for ctx in [AccessContext::new("alice", None), AccessContext::new("alice", Some("helper")), AccessContext::new("alice", Some("other"))] {
                    for (name, action, namespace, schema) in tools() {
                        let listed = match namespace {
                            Some("url") => e.could_permit_known(&pv, &ctx, action, "Url", &[], Some(&arguments::typing(Some(&schema)))),
                            Some(ns) => e.could_permit_known(&pv, &ctx, action, "File", &[("namespace", serde_json::json!(ns))], Some(&arguments::typing(Some(&schema)))),
                            None => match e.permit_for_every(&pv, &ctx, action, "Tool") {
                                Some(answer) => answer,
                                None => e.permitted_tools_with(&pv, &ctx, action, &[name], &[arguments::typing(Some(&schema))])[0],
                            },
                        };
                        let found = samples(&schema).iter().any(|a| {
                            let resource = match namespace {
                                Some("url") => url(a.get("url").and_then(|u| u.as_str()).unwrap_or("https://x.example/")),
                                Some(ns) => Resource::File { namespace: ns.into(), path: a.get("path").and_then(|p| p.as_str()).unwrap_or("/").into() },
                                None => Resource::Tool { name: name.into() },
                            };
                            let typed = arguments::typed(Some(&schema), a);
                            e.decide_with(&pv, &ctx, action, &resource, Some(&typed)).allowed
                        });
                        prop_assert_eq!(listed, found, "{} for {:?} under\n{}", name, ctx.agent, src);
                    }
                }
            }
        }
    }
}
