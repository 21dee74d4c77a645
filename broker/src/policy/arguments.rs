//! Typed arguments: a call's JSON arguments as the Cedar record `context.arguments`, typed from
//! the tool's `inputSchema`, and what policies may say of them.
//!
//! Owns: the typing (a pure function from a JSON Schema and a JSON value to a Cedar value), the
//! union of the argument types of the tools of each action (what policies are validated
//! against), and finding the argument names a policy reads. It must never decide: the engine
//! does, with what this module builds.
//!
//! Typing: `string` → String, `integer` → Long, `number` → Long when the value is integral,
//! `boolean` → Bool, an array of scalars → Set, an object with `properties` → record. What Cedar
//! cannot hold (a fraction, `null`, a value of no single declared type, an object without
//! declared properties, an argument the schema does not declare) is left out of the record, and
//! [`Typing::left_out`] says which: a policy sees only what it can be validated against.
//!
//! Why a union of per-action types and not the Cedar schema alone: a Cedar schema declares one
//! context type per action, and a record type is closed (open records need the experimental
//! `partial-validate` feature); every tool shares the action `call`, so the arguments of all its
//! tools are declared there, each optional, and a name two tools type differently is left out
//! of that declaration (a policy that names it is not validated, and says so). The decision
//! itself builds the record per call from the call's own tool's schema and does not validate it
//! against this union (the union is not the tool's type); a `forbid` whose evaluation errors
//! then denies (see `PolicyEngine::decide`), so nothing here can fail open.

use std::collections::{BTreeMap, BTreeSet};

use cedar_policy::{ActionConstraint, Policy, RestrictedExpression};
use serde_json::{Map, Value, json};

/// The Cedar type a JSON Schema gives an argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    String,
    Long,
    /// `number`: a Long when the value is integral, left out otherwise.
    Number,
    Bool,
    /// An array of scalars.
    Set(Box<Kind>),
    /// An object with declared `properties`.
    Record(BTreeMap<String, Kind>),
}

/// A tool's argument types, from its `inputSchema`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Typing {
    /// The top-level arguments Cedar can hold, by name.
    pub fields: BTreeMap<String, Kind>,
    /// What is left out and why, e.g. "`ratio`: a number that is not an integer is left out".
    pub left_out: Vec<String>,
}

/// Where a `$ref` points: into the tool's whole `inputSchema` (`#/$defs/Recipient`, as the
/// Python SDK writes every nested model), and how many were followed to get here.
#[derive(Clone, Copy)]
struct Refs<'a> {
    root: &'a Value,
    depth: usize,
}

/// More references than this in one argument's type: taken for a recursive type.
const MAX_REFS: usize = 16;

/// `schema` with its `$ref`s followed (a local JSON pointer), and `anyOf`/`oneOf` of one type
/// and `null` (an optional model) read as that type.
fn resolved<'a>(
    mut schema: &'a Value,
    mut refs: Refs<'a>,
) -> Result<(&'a Value, Refs<'a>), String> {
    loop {
        if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
            if refs.depth >= MAX_REFS {
                return Err("a type that refers to itself (recursive `$ref`)".into());
            }
            schema = r
                .strip_prefix('#')
                .and_then(|pointer| refs.root.pointer(pointer))
                .ok_or_else(|| format!("a `$ref` this schema does not hold (`{r}`)"))?;
            refs.depth += 1;
            continue;
        }
        if schema.get("type").is_none()
            && let Some(alternatives) = schema
                .get("anyOf")
                .or_else(|| schema.get("oneOf"))
                .and_then(Value::as_array)
        {
            let not_null: Vec<&Value> = alternatives
                .iter()
                .filter(|a| a.get("type").and_then(Value::as_str) != Some("null"))
                .collect();
            match not_null.as_slice() {
                [one] => {
                    schema = one;
                    continue;
                }
                _ => return Err("it may hold values of several types".into()),
            }
        }
        return Ok((schema, refs));
    }
}

/// The argument type a property schema declares, or why Cedar cannot hold it.
fn kind_of(
    schema: &Value,
    at: &str,
    notes: &mut Vec<String>,
    refs: Refs<'_>,
) -> Result<Kind, String> {
    let (schema, refs) = resolved(schema, refs)?;
    let declared = match schema.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => {
            let kinds: Vec<&str> = ts
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect();
            match kinds.as_slice() {
                [one] => (*one).to_owned(),
                _ => return Err("it may hold values of several types".into()),
            }
        }
        _ => match schema.get("enum").and_then(Value::as_array) {
            Some(values) if !values.is_empty() && values.iter().all(Value::is_string) => {
                "string".to_owned()
            }
            _ => return Err("its schema declares no single type".into()),
        },
    };
    Ok(match declared.as_str() {
        "string" => Kind::String,
        "integer" => Kind::Long,
        "number" => {
            notes.push(format!(
                "`{at}`: a number; a value that is not an integer is left out (Cedar has no fractions)"
            ));
            Kind::Number
        }
        "boolean" => Kind::Bool,
        "array" => {
            let items = schema.get("items").unwrap_or(&Value::Null);
            match kind_of(items, at, notes, refs) {
                Ok(k @ (Kind::String | Kind::Long | Kind::Number | Kind::Bool)) => {
                    Kind::Set(Box::new(k))
                }
                Ok(_) => return Err("an array of arrays or objects".into()),
                Err(_) => return Err("an array whose items have no single scalar type".into()),
            }
        }
        "object" => match schema.get("properties").and_then(Value::as_object) {
            Some(props) => Kind::Record(fields_of(props, &format!("{at}."), notes, refs)),
            None => return Err("an object without declared properties".into()),
        },
        "null" => return Err("always null (Cedar has no null)".into()),
        other => return Err(format!("of type `{other}`")),
    })
}

fn fields_of(
    props: &Map<String, Value>,
    prefix: &str,
    notes: &mut Vec<String>,
    refs: Refs<'_>,
) -> BTreeMap<String, Kind> {
    let mut fields = BTreeMap::new();
    for (name, schema) in props {
        let at = format!("{prefix}{name}");
        match kind_of(schema, &at, notes, refs) {
            Ok(k) => {
                fields.insert(name.clone(), k);
            }
            Err(why) => notes.push(format!("`{at}`: {why}; left out")),
        }
    }
    fields
}

/// The argument types of a tool with this `inputSchema` (none without one).
pub fn typing(input_schema: Option<&Value>) -> Typing {
    let mut left_out = Vec::new();
    let fields = match input_schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
    {
        Some(props) => fields_of(
            props,
            "",
            &mut left_out,
            Refs {
                root: input_schema.unwrap_or(&Value::Null),
                depth: 0,
            },
        ),
        None => BTreeMap::new(),
    };
    Typing { fields, left_out }
}

/// The value of one argument as `kind` types it; `None` when Cedar cannot hold it.
fn value_of(kind: &Kind, v: &Value) -> Option<(RestrictedExpression, Value)> {
    match (kind, v) {
        (Kind::String, Value::String(s)) => {
            Some((RestrictedExpression::new_string(s.clone()), v.clone()))
        }
        (Kind::Long | Kind::Number, Value::Number(n)) => n
            .as_i64()
            .map(|i| (RestrictedExpression::new_long(i), json!(i))),
        (Kind::Bool, Value::Bool(b)) => Some((RestrictedExpression::new_bool(*b), v.clone())),
        (Kind::Set(k), Value::Array(items)) => {
            let (exprs, shown): (Vec<_>, Vec<_>) = items
                .iter()
                .map(|i| value_of(k, i))
                .collect::<Option<Vec<_>>>()?
                .into_iter()
                .unzip();
            Some((RestrictedExpression::new_set(exprs), Value::Array(shown)))
        }
        (Kind::Record(fields), Value::Object(m)) => record_of(fields, m),
        _ => None,
    }
}

fn record_of(
    fields: &BTreeMap<String, Kind>,
    m: &Map<String, Value>,
) -> Option<(RestrictedExpression, Value)> {
    let mut exprs = Vec::new();
    let mut shown = Map::new();
    for (name, kind) in fields {
        if let Some((e, s)) = m.get(name).and_then(|v| value_of(kind, v)) {
            exprs.push((name.clone(), e));
            shown.insert(name.clone(), s);
        }
    }
    let expr = RestrictedExpression::new_record(exprs).ok()?;
    Some((expr, Value::Object(shown)))
}

/// A call's arguments as the policy sees them.
#[derive(Clone)]
pub struct Typed {
    /// The Cedar record (`context.arguments`).
    pub expr: RestrictedExpression,
    /// The same, as JSON: what a policy could read (`policy check` prints it).
    pub shown: Value,
}

impl std::fmt::Debug for Typed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Typed({})", self.shown)
    }
}

/// The pure function: a tool's `inputSchema` and a call's arguments → the Cedar record
/// `context.arguments`. An argument Cedar cannot hold, or the schema does not type, is left out
/// (never an error: the call's arguments have already passed the schema).
pub fn typed(input_schema: Option<&Value>, arguments: &Map<String, Value>) -> Typed {
    typed_with(&typing(input_schema), arguments)
}

/// [`typed`], with the tool's typing made once.
pub fn typed_with(typing: &Typing, arguments: &Map<String, Value>) -> Typed {
    match record_of(&typing.fields, arguments) {
        Some((expr, shown)) => Typed { expr, shown },
        None => empty(),
    }
}

/// The kind a JSON value has on its own: a recorded call's arguments, whose tool's schema the
/// record does not keep. Integers, strings, booleans, arrays of one scalar kind, objects; the
/// rest is left out, as the schema-typed record leaves it out.
fn kind_of_value(v: &Value) -> Option<Kind> {
    Some(match v {
        Value::String(_) => Kind::String,
        Value::Number(n) if n.as_i64().is_some() => Kind::Long,
        Value::Bool(_) => Kind::Bool,
        Value::Array(items) => {
            let mut kinds = items.iter().map(kind_of_value);
            let first = kinds.next().flatten().unwrap_or(Kind::String);
            if !matches!(first, Kind::String | Kind::Long | Kind::Bool)
                || !kinds.all(|k| k.as_ref() == Some(&first))
            {
                return None;
            }
            Kind::Set(Box::new(first))
        }
        Value::Object(m) => Kind::Record(
            m.iter()
                .filter_map(|(k, v)| kind_of_value(v).map(|kind| (k.clone(), kind)))
                .collect(),
        ),
        _ => return None,
    })
}

/// [`typed`] without the tool's schema: the arguments typed by their own values (`policy
/// replay`, which has the record's arguments and not the tools' schemas). For arguments that
/// passed their schema this is the live record, save for arguments the schema does not
/// declare (which a validated policy cannot read).
pub fn typed_from_values(arguments: &Map<String, Value>) -> Typed {
    let fields = arguments
        .iter()
        .filter_map(|(k, v)| kind_of_value(v).map(|kind| (k.clone(), kind)))
        .collect();
    typed_with(
        &Typing {
            fields,
            left_out: vec![],
        },
        arguments,
    )
}

/// No arguments: an empty record.
pub fn empty() -> Typed {
    Typed {
        expr: RestrictedExpression::new_record(Vec::<(String, RestrictedExpression)>::new())
            .unwrap_or_else(|_| RestrictedExpression::new_set([])),
        shown: json!({}),
    }
}

/// Merges two declarations of one name; `None` when they disagree.
fn merge(a: &Kind, b: &Kind) -> Option<Kind> {
    Some(match (a, b) {
        (Kind::Long, Kind::Number) | (Kind::Number, Kind::Long) => Kind::Number,
        (Kind::Set(x), Kind::Set(y)) => Kind::Set(Box::new(merge(x, y)?)),
        (Kind::Record(x), Kind::Record(y)) => {
            let mut out = x.clone();
            for (name, k) in y {
                let merged = match out.get(name) {
                    Some(had) => merge(had, k)?,
                    None => k.clone(),
                };
                out.insert(name.clone(), merged);
            }
            Kind::Record(out)
        }
        (x, y) if x == y => x.clone(),
        _ => return None,
    })
}

/// What policies are validated against: per action, the union of its known tools' arguments.
#[derive(Debug, Clone, Default)]
pub struct ArgumentTypes {
    /// Whether any tool is known at all: before, every action is open (a policy loaded by
    /// `policy replay` or before the providers listed their tools).
    known: bool,
    actions: BTreeMap<String, BTreeMap<String, Kind>>,
    /// Names two tools of an action type differently (left out of its declaration).
    conflicts: BTreeMap<String, BTreeSet<String>>,
    /// Actions whose tool set is open: a brokered provider has not listed its tools (yet).
    open: BTreeSet<String>,
}

impl ArgumentTypes {
    /// Nothing known: every action open.
    pub fn unknown() -> Self {
        Self::default()
    }

    /// An empty, known set (then tools are added).
    pub fn known() -> Self {
        Self {
            known: true,
            ..Self::default()
        }
    }

    pub fn is_known(&self) -> bool {
        self.known
    }

    /// A tool of `action` with `input_schema`.
    pub fn add_tool(&mut self, action: &str, input_schema: Option<&Value>) {
        let fields = typing(input_schema).fields;
        let conflicts = self.conflicts.entry(action.to_owned()).or_default();
        let union = self.actions.entry(action.to_owned()).or_default();
        for (name, kind) in fields {
            if conflicts.contains(&name) {
                continue;
            }
            match union.get(&name) {
                None => {
                    union.insert(name, kind);
                }
                Some(had) => match merge(had, &kind) {
                    Some(m) => {
                        union.insert(name, m);
                    }
                    None => {
                        union.remove(&name);
                        conflicts.insert(name);
                    }
                },
            }
        }
    }

    /// Some tools of `action` are not known (a brokered provider that has not listed yet).
    pub fn open_action(&mut self, action: &str) {
        self.open.insert(action.to_owned());
    }

    /// Every action may have tools not known: brokered providers that have not listed.
    pub fn open_all(&mut self) {
        self.open.insert(String::new());
    }

    fn is_open(&self, action: &str) -> bool {
        !self.known || self.open.contains(action) || self.open.contains("")
    }

    /// The Cedar JSON-schema type of `context.arguments` for `action`.
    fn cedar_type(&self, action: &str) -> Value {
        let fields = self.actions.get(action).cloned().unwrap_or_default();
        cedar_type(&Kind::Record(fields))
    }

    /// Does some tool of one of `actions` (all, for `None`) have the argument at `path`? `Ok`
    /// yes; `Err(open)` no, `open` when a tool not known could have it.
    fn has(&self, actions: Option<&[String]>, path: &[String]) -> Result<(), bool> {
        let all: Vec<String> = self.actions.keys().cloned().collect();
        let actions = actions.unwrap_or(&all);
        let mut open = !self.known;
        for action in actions {
            open |= self.is_open(action);
            if self
                .conflicts
                .get(action)
                .is_some_and(|c| path.first().is_some_and(|p| c.contains(p)))
            {
                // Typed differently by two tools: cannot be validated; not a typo either.
                return Err(true);
            }
            let mut fields = self.actions.get(action);
            let mut found = true;
            for (i, name) in path.iter().enumerate() {
                match fields.and_then(|f| f.get(name)) {
                    Some(Kind::Record(inner)) => fields = Some(inner),
                    Some(_) if i + 1 == path.len() => {}
                    // A scalar read as a record: the validator says so.
                    Some(_) => break,
                    None => {
                        found = false;
                        break;
                    }
                }
            }
            if found {
                return Ok(());
            }
        }
        Err(open)
    }

    /// The names of `action`'s tools' arguments, for an error message.
    fn names(&self, actions: Option<&[String]>) -> Vec<String> {
        let mut out: BTreeSet<String> = BTreeSet::new();
        for (action, fields) in &self.actions {
            if actions.is_none_or(|a| a.contains(action)) {
                out.extend(fields.keys().cloned());
            }
        }
        out.into_iter().collect()
    }
}

/// A [`Kind`] as a Cedar JSON-schema type (record attributes all optional: a tool's argument
/// may be absent, and another tool of the action may not have it at all).
fn cedar_type(kind: &Kind) -> Value {
    match kind {
        Kind::String => json!({"type": "String"}),
        Kind::Long | Kind::Number => json!({"type": "Long"}),
        Kind::Bool => json!({"type": "Boolean"}),
        Kind::Set(k) => json!({"type": "Set", "element": cedar_type(k)}),
        Kind::Record(fields) => {
            let attributes: Map<String, Value> = fields
                .iter()
                .map(|(n, k)| {
                    let mut t = cedar_type(k);
                    if let Some(o) = t.as_object_mut() {
                        o.insert("required".into(), Value::Bool(false));
                    }
                    (n.clone(), t)
                })
                .collect();
            json!({"type": "Record", "attributes": attributes})
        }
    }
}

/// Adds an `arguments` attribute, typed by `types`, to the context of every action of a Cedar
/// schema in its JSON form. It is required: every decision carries it (an empty record when a
/// decision has no call, such as a search hit's read check), so a policy needs no
/// `context has arguments` (it may say it: it is always true). A context that names a common type gets that record inlined
/// (each action's arguments differ). A context that is neither is left as it is (policies that
/// read its arguments then fail validation, naming the attribute).
pub fn augment(schema: &mut Value, types: &ArgumentTypes) {
    let Some(namespaces) = schema.as_object_mut() else {
        return;
    };
    for ns in namespaces.values_mut() {
        let common = ns.get("commonTypes").cloned().unwrap_or(Value::Null);
        let Some(actions) = ns.get_mut("actions").and_then(Value::as_object_mut) else {
            continue;
        };
        for (action, def) in actions.iter_mut() {
            let Some(applies) = def.get_mut("appliesTo").and_then(Value::as_object_mut) else {
                continue;
            };
            let mut arguments = types.cedar_type(action);
            if let Some(o) = arguments.as_object_mut() {
                o.insert("required".into(), Value::Bool(true));
            }
            let context = applies
                .entry("context")
                .or_insert_with(|| json!({"type": "Record", "attributes": {}}));
            if context.get("type").and_then(Value::as_str) != Some("Record") {
                let name = context
                    .get("name")
                    .or_else(|| context.get("type"))
                    .and_then(Value::as_str)
                    .map(|n| n.rsplit("::").next().unwrap_or(n).to_owned());
                match name.and_then(|n| common.get(&n)) {
                    Some(record)
                        if record.get("type").and_then(Value::as_str) == Some("Record") =>
                    {
                        *context = record.clone();
                    }
                    _ => continue,
                }
            }
            if let Some(attrs) = context
                .as_object_mut()
                .map(|c| c.entry("attributes").or_insert_with(|| json!({})))
                .and_then(Value::as_object_mut)
            {
                attrs.insert("arguments".into(), arguments.clone());
            }
        }
    }
}

/// The argument paths a policy reads (`context.arguments.a.b` → `["a", "b"]`), from its JSON
/// form: attribute accesses and `has` tests below `context.arguments`.
pub fn references(policy: &Policy) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    if let Ok(est) = policy.to_json() {
        walk(&est, &mut out);
    }
    out.sort();
    out.dedup();
    out
}

fn walk(v: &Value, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(m) => {
            for key in [".", "has"] {
                if let Some(node) = m.get(key)
                    && let (Some(left), Some(attr)) =
                        (node.get("left"), node.get("attr").and_then(Value::as_str))
                    && let Some(mut path) = path_of(left)
                    && path.len() >= 2
                    && path[0] == "context"
                    && path[1] == "arguments"
                {
                    path.drain(..2);
                    path.push(attr.to_owned());
                    out.push(path);
                }
            }
            m.values().for_each(|x| walk(x, out));
        }
        Value::Array(items) => items.iter().for_each(|x| walk(x, out)),
        _ => {}
    }
}

/// `context.a.b` as `["context", "a", "b"]`.
fn path_of(e: &Value) -> Option<Vec<String>> {
    if e.get("Var").and_then(Value::as_str) == Some("context") {
        return Some(vec!["context".into()]);
    }
    let node = e.get(".")?;
    let mut p = path_of(node.get("left")?)?;
    p.push(node.get("attr")?.as_str()?.to_owned());
    Some(p)
}

/// Whether a policy reads `context.arguments` at all (`context has arguments` counts).
pub fn reads_arguments(policy: &Policy) -> bool {
    fn reads(v: &Value) -> bool {
        match v {
            Value::Object(m) => {
                let here = [".", "has"].iter().any(|key| {
                    m.get(*key).is_some_and(|node| {
                        node.get("attr").and_then(Value::as_str) == Some("arguments")
                            && node.get("left").and_then(path_of).as_deref()
                                == Some(&["context".to_owned()][..])
                    })
                });
                here || m.values().any(reads)
            }
            Value::Array(items) => items.iter().any(reads),
            _ => false,
        }
    }
    // A policy whose JSON form cannot be made is taken to read them (the safe side: its
    // catalogue question leaves the arguments unknown).
    policy.to_json().map(|est| reads(&est)).unwrap_or(true)
}

/// The actions a policy can apply to, by name (`None`: any).
fn actions_of(policy: &Policy) -> Option<Vec<String>> {
    match policy.action_constraint() {
        ActionConstraint::Any => None,
        ActionConstraint::Eq(u) => Some(vec![u.id().unescaped().to_owned()]),
        // An action group may hold any action: every action is checked.
        ActionConstraint::In(us) => {
            let ids: Vec<String> = us.iter().map(|u| u.id().unescaped().to_owned()).collect();
            Some(ids)
        }
    }
}

/// `line:col` (1-based) of the first place `src` reads argument `name` (`arguments.name` or
/// `arguments has name`).
pub fn locate(src: &str, name: &str) -> Option<(usize, usize)> {
    let mut from = 0;
    while let Some(i) = src[from..].find("arguments") {
        let start = from + i;
        from = start + "arguments".len();
        let rest = src[from..].trim_start();
        let after = if let Some(r) = rest.strip_prefix('.') {
            r.trim_start()
        } else if let Some(r) = rest.strip_prefix("has") {
            r.trim_start().trim_start_matches('"')
        } else {
            continue;
        };
        let ident: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident == name {
            let before = &src[..start];
            let line = before.matches('\n').count() + 1;
            let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            return Some((line, col));
        }
    }
    None
}

/// What a policy's argument names say against `types`: `(errors, warnings, unvalidated)`. An
/// error is a name no tool it can apply to has, where every tool is known; a warning the same
/// where some are not (or the name is typed differently by two tools). Policies with a warning
/// are `unvalidated`: the Cedar validator would refuse what it cannot type yet.
pub fn check(
    policy: &Policy,
    types: &ArgumentTypes,
    path: &str,
    src: &str,
) -> (Vec<String>, Vec<String>, bool) {
    let (mut errors, mut warnings, mut unvalidated) = (Vec::new(), Vec::new(), false);
    if !types.is_known() {
        // Nothing to check against yet: validated once the tools are known.
        return (errors, warnings, reads_arguments(policy));
    }
    // An action this set has no tools for (an action group, or one no tool resolves to): any.
    let actions = actions_of(policy).filter(|a| a.iter().all(|x| types.actions.contains_key(x)));
    for reference in references(policy) {
        let Err(open) = types.has(actions.as_deref(), &reference) else {
            continue;
        };
        let name = reference.join(".");
        let at = reference
            .first()
            .and_then(|first| locate(src, first))
            .map(|(l, c)| format!("{path}:{l}:{c}"))
            .unwrap_or_else(|| path.to_owned());
        let known = types.names(actions.as_deref());
        let which = match &actions {
            Some(a) => format!("action {}", a.join(", ")),
            None => "any action".to_owned(),
        };
        let message = format!(
            "  {at}: policy `{}` reads `context.arguments.{name}`, but no tool of {which} has an argument `{name}` (their arguments: {})",
            policy.id(),
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        );
        if open {
            unvalidated = true;
            warnings.push(format!(
                "{message}; a brokered provider's tools are not all known, so the policy is kept, unvalidated, until they are"
            ));
        } else {
            errors.push(format!("{message}\n    help: a misspelt argument is a deny that looks like a permit; name one the tool has"));
        }
    }
    (errors, warnings, unvalidated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "channel": {"type": "string"},
                "amount": {"type": "integer"},
                "ratio": {"type": "number"},
                "urgent": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "rows": {"type": "array", "items": {"type": "object"}},
                "to": {"type": "object", "properties": {"bank": {"type": "string"}, "n": {"type": "integer"}}},
                "free": {"type": "object"},
                "maybe": {"type": ["string", "null"]},
                "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                "mode": {"enum": ["a", "b"]}
            }
        })
    }

    fn shown(args: Value) -> Value {
        let Value::Object(m) = args else {
            panic!("an object")
        };
        typed(Some(&schema()), &m).shown
    }

    #[test]
    fn each_json_type_becomes_its_cedar_type() {
        let got = shown(json!({
            "channel": "public", "amount": 100, "ratio": 2, "urgent": true,
            "tags": ["a", "b"], "to": {"bank": "x", "n": -3, "extra": 1},
            "maybe": "m", "mode": "a"
        }));
        assert_eq!(
            got,
            json!({"channel": "public", "amount": 100, "ratio": 2, "urgent": true,
                   "tags": ["a", "b"], "to": {"bank": "x", "n": -3}, "maybe": "m", "mode": "a"})
        );
    }

    #[test]
    fn what_cedar_cannot_hold_is_left_out_and_said() {
        let got = shown(json!({
            "ratio": 0.5, "rows": [{"a": 1}], "free": {"k": "v"}, "maybe": null,
            "either": 3, "undeclared": "x", "amount": 18446744073709551615u64
        }));
        assert_eq!(got, json!({}));
        let t = typing(Some(&schema()));
        assert_eq!(t.fields.len(), 8, "{:?}", t.fields);
        let notes = t.left_out.join("\n");
        for name in ["`ratio`", "`rows`", "`free`", "`either`"] {
            assert!(notes.contains(name), "{name} in {notes}");
        }
        assert!(!notes.contains("`channel`"), "{notes}");
    }

    /// What the PyPI SDK (pydantic) writes: nested models as `$ref`s into `$defs`, an optional
    /// one as `anyOf` with `null`.
    #[test]
    fn references_and_optional_models_are_followed() {
        let schema = json!({
            "$defs": {
                "Recipient": {"type": "object", "properties": {
                    "channel": {"type": "string"}, "tier": {"type": "integer"},
                    "next": {"$ref": "#/$defs/Recipient"}}},
                "Loop": {"$ref": "#/$defs/Loop"}
            },
            "type": "object",
            "properties": {
                "amount": {"type": "integer"},
                "to": {"$ref": "#/$defs/Recipient"},
                "cc": {"anyOf": [{"$ref": "#/$defs/Recipient"}, {"type": "null"}], "default": null},
                "tags": {"type": "array", "items": {"type": "string"}},
                "loop": {"$ref": "#/$defs/Loop"},
                "gone": {"$ref": "#/$defs/Missing"},
                "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]}
            }
        });
        let t = typing(Some(&schema));
        let Some(Kind::Record(to)) = t.fields.get("to") else {
            panic!("{:?}", t.fields)
        };
        assert_eq!(to.get("channel"), Some(&Kind::String));
        assert_eq!(to.get("tier"), Some(&Kind::Long));
        assert!(
            matches!(t.fields.get("cc"), Some(Kind::Record(_))),
            "{:?}",
            t.fields
        );
        for gone in ["loop", "gone", "either"] {
            assert!(!t.fields.contains_key(gone), "{gone}: {:?}", t.fields);
        }
        let notes = t.left_out.join("\n");
        assert!(
            notes.contains("`loop`: a type that refers to itself"),
            "{notes}"
        );
        assert!(notes.contains("`gone`: a `$ref`"), "{notes}");
        assert!(
            notes.contains("`either`: it may hold values of several types"),
            "{notes}"
        );
        // A recursive model is followed as deep as the limit, then left out there.
        assert!(notes.contains("`to.next.next"), "{notes}");
        let Value::Object(m) = json!({"amount": 5, "to": {"channel": "public", "tier": 2},
                                       "cc": null, "tags": ["a"]})
        else {
            panic!()
        };
        assert_eq!(
            typed(Some(&schema), &m).shown,
            json!({"amount": 5, "to": {"channel": "public", "tier": 2}, "tags": ["a"]})
        );
    }

    #[test]
    fn the_record_is_a_cedar_record() {
        let Value::Object(m) = json!({"channel": "public", "tags": ["x"], "to": {"n": 1}}) else {
            panic!()
        };
        let t = typed(Some(&schema()), &m);
        let ctx = cedar_policy::Context::from_pairs([("arguments".to_owned(), t.expr)])
            .expect("a context");
        let Some(cedar_policy::EvalResult::Record(r)) = ctx.get("arguments") else {
            panic!("a record")
        };
        assert_eq!(
            r.get("channel"),
            Some(&cedar_policy::EvalResult::String("public".into()))
        );
        let Some(cedar_policy::EvalResult::Record(to)) = r.get("to") else {
            panic!("a nested record")
        };
        assert_eq!(to.get("n"), Some(&cedar_policy::EvalResult::Long(1)));
        assert_eq!(r.len(), 3);
        // No schema: an empty record.
        assert_eq!(typed(None, &m).shown, json!({}));
    }

    #[test]
    fn recorded_arguments_type_by_their_values() {
        let Value::Object(m) = json!({
            "channel": "public", "amount": 100, "ratio": 0.5, "tags": ["a"], "mixed": ["a", 1],
            "to": {"bank": "x", "f": 1.5}, "none": null
        }) else {
            panic!()
        };
        let live = shown(Value::Object(m.clone()));
        let replayed = typed_from_values(&m).shown;
        assert_eq!(
            replayed,
            json!({"channel": "public", "amount": 100, "tags": ["a"], "to": {"bank": "x"}})
        );
        // What the schema declares, replay sees the same.
        assert_eq!(live["channel"], replayed["channel"]);
        assert_eq!(live["amount"], replayed["amount"]);
    }

    #[test]
    fn unions_merge_and_conflicts_are_left_out() {
        let mut types = ArgumentTypes::known();
        types.add_tool(
            "call",
            Some(&json!({"properties": {"a": {"type": "string"}, "n": {"type": "integer"}}})),
        );
        types.add_tool("call", Some(&json!({"properties": {"a": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"}}})));
        let mut s = json!({"SharedOS": {"actions": {"call": {"appliesTo": {"context": {"type": "Record", "attributes": {}}}}}}});
        augment(&mut s, &types);
        let args =
            &s["SharedOS"]["actions"]["call"]["appliesTo"]["context"]["attributes"]["arguments"];
        assert_eq!(args["required"], json!(true));
        let attrs = args["attributes"].as_object().expect("attributes");
        assert_eq!(attrs.keys().collect::<Vec<_>>(), vec!["b", "n"]);
        assert_eq!(types.has(None, &["a".to_owned()]), Err(true));
        assert_eq!(types.has(None, &["b".to_owned()]), Ok(()));
        assert_eq!(types.has(None, &["c".to_owned()]), Err(false));
    }

    #[test]
    fn references_and_their_place() {
        let src = "permit(principal, action, resource)\nwhen { context has arguments &&\n  context.arguments has chanel && context.arguments.to.bank == \"x\" };";
        let p = Policy::from_str(src).expect("policy");
        assert_eq!(
            references(&p),
            vec![
                vec!["chanel".to_owned()],
                vec!["to".to_owned()],
                vec!["to".to_owned(), "bank".to_owned()]
            ]
        );
        assert_eq!(locate(src, "chanel"), Some((3, 11)));
        let mut types = ArgumentTypes::known();
        types.add_tool("call", Some(&schema()));
        let (errors, warnings, unvalidated) = check(&p, &types, "p.cedar", src);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("p.cedar:3:11") && errors[0].contains("`chanel`"),
            "{errors:?}"
        );
        assert!(warnings.is_empty() && !unvalidated);
        types.open_action("call");
        let (errors, warnings, unvalidated) = check(&p, &types, "p.cedar", src);
        assert_eq!((errors.len(), warnings.len(), unvalidated), (0, 1, true));
    }
}
