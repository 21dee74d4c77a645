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
