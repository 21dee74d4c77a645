//! What the catalogue knows before a call, written into the policies: partial evaluation
//! (`tpe`) leaves a whole resource, or a whole context, known or unknown, while the catalogue
//! knows part of each: a file tool's `resource.namespace` (its provider's) with the path
//! unknown, and the turn's `context.agent` and `context.turn` with `context.arguments` unknown
//! (but present: every call's decision carries them).
//! So each policy has those reads replaced by their values, and partial evaluation runs with
//! the resource (and, where a policy reads the arguments, the context) unknown: what is left
//! depends only on what is not known before the call.
//!
//! Owns the rewriting of a policy's JSON form; it never decides.

use std::collections::BTreeMap;

use cedar_policy::{Policy, PolicySet};
use serde_json::{Map, Value, json};

use super::arguments::Kind;

/// What is known before a call.
pub struct Known<'a> {
    /// The resource's attributes known (a file tool's `namespace`).
    pub resource: &'a [(&'a str, Value)],
    /// The context without its arguments (`agent`, `turn`), when it is to be written in.
    pub context: Option<&'a Map<String, Value>>,
    /// The tool's argument types (what `context.arguments` can hold), when one tool is asked.
    pub arguments: Option<&'a BTreeMap<String, Kind>>,
}

/// `set` with `resource.<attr>` and `context.<attr>` reads replaced by the values known
/// (`resource has <attr>` by `true` for a known attribute, `context has <attr>` by whether the
/// context has it, `context.arguments has <arg>` by whether the tool has that argument at all;
/// what `context.arguments` holds stays unknown). `None` if a policy cannot be rewritten (the
/// caller then uses `set` as it is, which only keeps more tools).
pub fn substitute(set: &PolicySet, known: &Known<'_>) -> Option<PolicySet> {
    let mut out = Vec::new();
    for p in set.policies() {
        let mut est = p.to_json().ok()?;
        rewrite(&mut est, known);
        out.push(Policy::from_json(Some(p.id().clone()), est).ok()?);
    }
    PolicySet::from_policies(out).ok()
}

/// The attributes `policy` reads on `resource` (`resource.<attr>` or `resource has <attr>`);
/// `None` when its JSON form cannot be made (then take it to read every attribute). A known
/// attribute no policy reads cannot change a catalogue answer, so the catalogue need not ask
/// once per value of it.
pub fn resource_attributes_read(policy: &Policy) -> Option<Vec<String>> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for key in [".", "has"] {
                    if let Some(node) = m.get(key)
                        && node
                            .get("left")
                            .and_then(|l| l.get("Var"))
                            .and_then(Value::as_str)
                            == Some("resource")
                        && let Some(attr) = node.get("attr").and_then(Value::as_str)
                        && !out.iter().any(|a| a == attr)
                    {
                        out.push(attr.to_owned());
                    }
                }
                m.values().for_each(|x| walk(x, out));
            }
            Value::Array(items) => items.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let est = policy.to_json().ok()?;
    let mut out = Vec::new();
    walk(&est, &mut out);
    Some(out)
}

fn rewrite(v: &mut Value, known: &Known<'_>) {
    if let Some(replacement) = replacement(v, known) {
        *v = replacement;
        return;
    }
    match v {
        Value::Object(m) => m.values_mut().for_each(|x| rewrite(x, known)),
        Value::Array(items) => items.iter_mut().for_each(|x| rewrite(x, known)),
        _ => {}
    }
}

/// What a `.`/`has` node on `resource`, `context` or `context.arguments` becomes, if its value
/// is known.
fn replacement(v: &Value, known: &Known<'_>) -> Option<Value> {
    let (resource, context) = (known.resource, known.context);
    let m = v.as_object()?;
    let (key, node) = m.iter().next().filter(|_| m.len() == 1)?;
    let left = node.get("left")?;
    let attr = node.get("attr")?.as_str()?;
    // `context.arguments has <arg>`: false when the tool has no such argument (a value it
    // cannot hold is left out of the record, so it is never there either).
    if key == "has"
        && let Some(fields) = known.arguments
        && let Some(inner) = left.get(".")
        && inner.get("attr").and_then(Value::as_str) == Some("arguments")
        && inner
            .get("left")
            .and_then(|l| l.get("Var"))
            .and_then(Value::as_str)
            == Some("context")
        && !fields.contains_key(attr)
    {
        return Some(json!({ "Value": false }));
    }
    let var = left.get("Var")?.as_str()?;
    match (key.as_str(), var) {
        (".", "resource") => resource
            .iter()
            .find(|(a, _)| *a == attr)
            .map(|(_, value)| json!({ "Value": value })),
        ("has", "resource") => resource
            .iter()
            .any(|(a, _)| *a == attr)
            .then(|| json!({ "Value": true })),
        // Every call's decision carries `context.arguments` (an empty record at least), and
        // what they hold is unknown before the call.
        ("has", "context") if attr == "arguments" => Some(json!({ "Value": true })),
        (_, "context") if attr == "arguments" => None,
        (".", "context") => context?.get(attr).map(|value| json!({ "Value": value })),
        ("has", "context") => context.map(|c| json!({ "Value": c.contains_key(attr) })),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    #[test]
    fn the_resource_attributes_a_policy_reads_are_listed() {
        let set = PolicySet::from_str(
            r#"@id("a") permit(principal, action, resource)
               when { resource.path like "/public/*" && resource has namespace };
               @id("b") permit(principal, action, resource is SharedOS::Tool)
               when { resource.name == "x" && context.agent.id == "y" };"#,
        )
        .expect("set");
        let read = |annotation: &str| {
            let p = set
                .policies()
                .find(|p| p.annotation("id") == Some(annotation))
                .expect("policy");
            resource_attributes_read(p).expect("json")
        };
        assert_eq!(read("a"), vec!["path".to_owned(), "namespace".to_owned()]);
        assert_eq!(read("b"), vec!["name".to_owned()]);
    }

    #[test]
    fn known_reads_become_values_and_the_arguments_stay() {
        let set = PolicySet::from_str(
            r#"permit(principal, action, resource)
               when { resource.namespace == "files" && resource has namespace
                      && context has agent && context.agent == SharedOS::Agent::"a"
                      && !(context has turn)
                      && context has arguments && context.arguments has channel
                      && !(context.arguments has amount) };"#,
        )
        .expect("set");
        let ctx = json!({"agent": {"__entity": {"type": "SharedOS::Agent", "id": "a"}}});
        let fields = BTreeMap::from([("channel".to_owned(), Kind::String)]);
        let known = Known {
            resource: &[("namespace", json!("docs"))],
            context: ctx.as_object(),
            arguments: Some(&fields),
        };
        let out = substitute(&set, &known).expect("rewritten");
        let text = out.policies().next().expect("one").to_string();
        assert!(text.contains("\"docs\" == \"files\""), "{text}");
        assert!(!text.contains("resource.namespace"), "{text}");
        assert!(!text.contains("context has agent"), "{text}");
        assert!(text.contains("context.arguments"), "{text}");
        assert!(!text.contains("context has arguments"), "{text}");
        assert!(text.contains("context.arguments has channel"), "{text}");
        assert!(!text.contains("amount"), "{text}");
    }
}
