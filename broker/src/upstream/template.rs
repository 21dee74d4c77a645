//! Requirement templates: what a brokered tool's call touches, read from its own arguments.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::config::EntityTemplate;
pub use crate::config::template_args;
use crate::resource::{Resource, WebUrl, entity_type};

/// A template's path with each `{arg}` replaced by that string argument, in one pass (an
/// argument holding `{other}` stays as it is).
///
/// A template that is not exactly one `{arg}` joins its arguments with its own text, and an
/// upstream may join them otherwise: Python's `os.path.join`, `pathlib` and Node's
/// `path.resolve` drop what comes before an absolute part. So each argument of such a template
/// is refused when it holds a NUL or a `..` component, when it is absolute and the template does
/// not start with it, and, past the first argument, when it holds a `/` at all: the separators
/// of the path are the template's own, and every way of joining the parts lands on the same path.
pub(super) fn fill_template(template: &str, args: &Map<String, Value>) -> Result<String, String> {
    let bare = template_args(template)
        .first()
        .is_some_and(|a| template == format!("{{{a}}}"));
    let mut path = String::with_capacity(template.len());
    let mut rest = template;
    let mut nth = 0;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let Some(end) = after.find('}') else { break };
        let arg = &after[..end];
        let v = args
            .get(arg)
            .and_then(Value::as_str)
            .ok_or_else(|| format!("the call has no string argument `{arg}`"))?;
        if !bare {
            let shown = || sharedos_proto::name::shown(v);
            if v.contains('\0') {
                return Err(format!("argument `{arg}` (`{}`) holds a NUL", shown()));
            }
            if v.split('/').any(|c| c == "..") {
                return Err(format!(
                    "argument `{arg}` (`{}`) holds a `..` component, which this tool's template does not allow",
                    shown()
                ));
            }
            if v.starts_with('/') && (start > 0 || !path.is_empty()) {
                return Err(format!(
                    "argument `{arg}` (`{}`) is absolute, and this tool's template puts it after other text (joined, it would stand alone)",
                    shown()
                ));
            }
            if nth > 0 && v.contains('/') {
                return Err(format!(
                    "argument `{arg}` (`{}`) holds a `/`, and in this tool's template only the first argument may",
                    shown()
                ));
            }
        }
        path.push_str(&rest[..start]);
        path.push_str(v);
        rest = &after[end + 1..];
        nth += 1;
    }
    path.push_str(rest);
    Ok(path)
}

/// The `SharedOS::Url` a `url` template names, and the arguments to send upstream when they
/// are not the call's own: a bare `"{url}"` is sent as the broker read it (the canonical text,
/// so an upstream whose parser reads URLs otherwise still fetches what was decided on); any
/// other template goes on only when its text already is that.
pub(super) fn resolve_url(
    template: &str,
    args: &Map<String, Value>,
) -> Result<(WebUrl, Option<Map<String, Value>>), String> {
    let filled = fill_template(template, args)?;
    let (url, canonical) = WebUrl::parse(&filled)?;
    let forwarded = match template_args(template).as_slice() {
        [only] if template == format!("{{{only}}}") => {
            if filled == canonical {
                None
            } else {
                let mut a = args.clone();
                a.insert(only.clone(), Value::String(canonical));
                Some(a)
            }
        }
        _ if filled == canonical => None,
        _ => {
            return Err(format!(
                "URL `{}` reads as `{}`, and this tool's template cannot be sent that",
                sharedos_proto::name::shown(&filled),
                sharedos_proto::name::shown(&canonical)
            ));
        }
    };
    Ok((url, forwarded))
}

/// The entity an `entity` template names: its id from the id template (each `{arg}` a
/// non-empty string, or an integer written in decimal), its attributes from theirs.
pub(super) fn resolve_entity(
    template: &EntityTemplate,
    args: &Map<String, Value>,
) -> Result<Resource, String> {
    // Integers name ids too (an issue number); nothing else that is not a string does.
    let texts: Map<String, Value> = args
        .iter()
        .filter_map(|(k, v)| match v {
            Value::String(_) => Some((k.clone(), v.clone())),
            Value::Number(n) if n.is_i64() || n.is_u64() => {
                Some((k.clone(), Value::String(n.to_string())))
            }
            _ => None,
        })
        .collect();
    let fill = |t: &str| -> Result<String, String> {
        for a in template_args(t) {
            if texts.get(&a).and_then(Value::as_str) == Some("") {
                return Err(format!("argument `{a}` is empty"));
            }
        }
        fill_template(t, &texts).map_err(|e| {
            e.replace(
                "has no string argument",
                "has no string or integer argument",
            )
        })
    };
    let id = fill(&template.id)?;
    let mut attributes = BTreeMap::new();
    for (name, t) in &template.attributes {
        let value = match template_args(t).as_slice() {
            [only] if *t == format!("{{{only}}}") => match args.get(only) {
                // Left out: a policy asks `resource has <name>`.
                None | Some(Value::Null) => continue,
                Some(v) => {
                    cedar_value(only, v)?;
                    v.clone()
                }
            },
            _ => Value::String(fill(t)?),
        };
        attributes.insert(name.clone(), value);
    }
    Ok(Resource::Entity {
        type_name: entity_type(&template.type_name).to_owned(),
        id,
        attributes,
    })
}

/// Whether Cedar can hold `v` (strings, booleans, 64-bit integers, sets and records of them):
/// no fractions, no null.
fn cedar_value(arg: &str, v: &Value) -> Result<(), String> {
    match v {
        Value::String(_) | Value::Bool(_) => Ok(()),
        Value::Number(n) if n.is_i64() => Ok(()),
        Value::Number(n) => Err(format!(
            "argument `{arg}`: {n} is not a 64-bit integer (Cedar has no fractions)"
        )),
        Value::Null => Err(format!("argument `{arg}` holds a null (Cedar has none)")),
        Value::Array(items) => items.iter().try_for_each(|i| cedar_value(arg, i)),
        Value::Object(m) => m.values().try_for_each(|i| cedar_value(arg, i)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn a_url_template_sends_the_url_as_the_broker_read_it() {
        let (u, sent) = resolve_url(
            "{url}",
            &object(json!({"url": "HTTP://Docs.Example.COM./a", "max_length": 5})),
        )
        .expect("url");
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("docs.example.com", 80, "/a")
        );
        assert_eq!(
            sent,
            Some(object(
                json!({"url": "http://docs.example.com/a", "max_length": 5})
            ))
        );
        // Already canonical: the call's own arguments go.
        let (_, sent) = resolve_url(
            "{url}",
            &object(json!({"url": "http://docs.example.com/a"})),
        )
        .expect("url");
        assert_eq!(sent, None);
        // A template with its own text goes on only when it already reads as written.
        let t = "https://api.example.com/repos/{owner}/{repo}";
        let (u, sent) =
            resolve_url(t, &object(json!({"owner": "octo", "repo": "hello"}))).expect("url");
        assert_eq!((u.path.as_str(), sent), ("/repos/octo/hello", None));
        for (args, why) in [
            (json!({"owner": "octo", "repo": "%2e%2e"}), "reads as"),
            (json!({"owner": "octo", "repo": "a b"}), "reads as"),
            (json!({"owner": "octo", "repo": "a/b"}), "holds a `/`"),
            (json!({"owner": "..", "repo": "b"}), "`..`"),
            (json!({"owner": "octo"}), "no string argument `repo`"),
        ] {
            let e = resolve_url(t, &object(args.clone())).expect_err("refused");
            assert!(e.contains(why), "{args}: {e}");
        }
        for (args, why) in [
            (json!({"url": "docs.example.com"}), "is not a URL"),
            (json!({"url": "file:///etc/passwd"}), "scheme `file`"),
            (json!({"url": 7}), "no string argument `url`"),
            (json!({}), "no string argument `url`"),
        ] {
            let e = resolve_url("{url}", &object(args.clone())).expect_err("refused");
            assert!(e.contains(why), "{args}: {e}");
        }
    }

    #[test]
    fn an_entity_template_takes_its_id_and_attributes_from_the_arguments() {
        let template = |id: &str, attributes: &[(&str, &str)]| EntityTemplate {
            type_name: "SharedOS::Repo".into(),
            id: id.into(),
            attributes: attributes
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        let t = template(
            "{owner}/{repo}#{number}",
            &[
                ("owner", "{owner}"),
                ("number", "{number}"),
                ("labels", "{labels}"),
                ("meta", "{meta}"),
                ("title", "Re: {title}"),
                ("draft", "{draft}"),
            ],
        );
        let r = resolve_entity(
            &t,
            &object(
                json!({"owner": "octo", "repo": "hello", "number": 42, "labels": ["bug"],
                "meta": {"a": true}, "title": "x", "draft": null}),
            ),
        )
        .expect("entity");
        assert_eq!(
            r,
            Resource::Entity {
                type_name: "Repo".into(),
                id: "octo/hello#42".into(),
                attributes: object(json!({"owner": "octo", "number": 42, "labels": ["bug"],
                    "meta": {"a": true}, "title": "Re: x"}))
                .into_iter()
                .collect(),
            }
        );
        assert_eq!(r.display(), "SharedOS::Repo::\"octo/hello#42\"");
        for (args, why) in [
            (
                json!({"owner": "octo", "number": 1, "title": "x"}),
                "no string or integer argument `repo`",
            ),
            (
                json!({"owner": "", "repo": "r", "number": 1, "title": "x"}),
                "argument `owner` is empty",
            ),
            (
                json!({"owner": "o", "repo": "a/b", "number": 1, "title": "x"}),
                "holds a `/`",
            ),
            (
                json!({"owner": "o", "repo": "r", "number": 1.5, "title": "x"}),
                "no string or integer argument `number`",
            ),
            (
                json!({"owner": "o", "repo": "r", "number": true, "title": "x"}),
                "no string or integer argument `number`",
            ),
            (
                json!({"owner": "o", "repo": "r", "number": 1, "title": "x", "labels": [1.5]}),
                "not a 64-bit integer",
            ),
            (
                json!({"owner": "o", "repo": "r", "number": 1, "title": "x", "meta": {"a": null}}),
                "holds a null",
            ),
            (
                json!({"owner": "o", "repo": "r", "number": 1}),
                "no string or integer argument `title`",
            ),
        ] {
            let e = resolve_entity(&t, &object(args.clone())).expect_err("refused");
            assert!(e.contains(why), "{args}: {e}");
        }
        // A fixed id: one entity, its attributes from the call.
        let r = resolve_entity(
            &template("transfer", &[("amount", "{amount}")]),
            &object(json!({"amount": 100})),
        )
        .expect("entity");
        assert_eq!(r.id(), "transfer");
    }

    #[test]
    fn template_arguments() {
        assert_eq!(template_args("{path}"), ["path"]);
        assert_eq!(template_args("/repos/{owner}/{repo}"), ["owner", "repo"]);
        assert!(template_args("/fixed").is_empty());
    }

    #[test]
    fn template_parts_are_refused_where_a_join_would_read_them_otherwise() {
        let args = |v: Value| v.as_object().cloned().expect("object");
        let fill = |t: &str, v: Value| fill_template(t, &args(v));
        let two = "{dir}/{name}";
        assert_eq!(
            fill(two, json!({"dir": "/srv/d/public", "name": "a.txt"})).as_deref(),
            Ok("/srv/d/public/a.txt")
        );
        for (v, why) in [
            (
                json!({"dir": "/srv/d/public", "name": "/srv/d/private/s"}),
                "is absolute",
            ),
            (
                json!({"dir": "/srv/d/public", "name": "/etc/hostname"}),
                "is absolute",
            ),
            (
                json!({"dir": "/srv/d/public", "name": "sub/a"}),
                "holds a `/`",
            ),
            (json!({"dir": "/srv/d/public", "name": ".."}), "`..`"),
            (json!({"dir": "/srv/d/../private", "name": "s"}), "`..`"),
            (json!({"dir": "/srv/d/public", "name": "a\u{0}b"}), "NUL"),
            (
                json!({"dir": "/srv", "name": 1}),
                "no string argument `name`",
            ),
        ] {
            let e = fill(two, v.clone()).expect_err("refused");
            assert!(e.contains(why), "{v}: {e}");
        }
        // A prefixed single argument may hold folders, but not stand alone.
        assert_eq!(
            fill("/docs/{p}", json!({"p": "a/b.txt"})).as_deref(),
            Ok("/docs/a/b.txt")
        );
        let e = fill("/docs/{p}", json!({"p": "/etc/passwd"})).expect_err("abs");
        assert!(e.contains("is absolute"), "{e}");
        // A bare argument is the whole path: a file_root check or canonicalization judges it.
        assert_eq!(
            fill("{path}", json!({"path": "/a/../b"})).as_deref(),
            Ok("/a/../b")
        );
        // Substitution is one pass: an argument naming another stays as it is.
        assert_eq!(
            fill("/r/{a}-{b}", json!({"a": "{b}", "b": "x"})).as_deref(),
            Ok("/r/{b}-x")
        );
    }
}
