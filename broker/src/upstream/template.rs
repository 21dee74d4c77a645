//! Requirement templates: what a brokered tool's call touches, read from its own arguments.

use serde_json::{Map, Value};

/// `{arg}` names in a template.
pub fn template_args(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let Some(end) = after.find('}') else { break };
        out.push(after[..end].to_owned());
        rest = &after[end + 1..];
    }
    out
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
