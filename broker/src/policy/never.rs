//! Residual conditions that are false for every value: what Cedar's partial evaluation leaves
//! undecided but no call can satisfy, such as `context.arguments.amount > 5 &&
//! context.arguments.amount < 3`, or `== "a" && == "b"` on the same attribute. The catalogue
//! hides a tool whose every residual permit is one of these.
//!
//! Sound, not complete: a condition is said never true only when a conjunction in it (its
//! `&&` chain) holds comparisons of one attribute path (`context.arguments.x.y`, `resource.x`)
//! to literals that no single value meets. What it reads, per path: `==`, `!=`, `<`, `<=`, `>`,
//! `>=` against a Long; `==`, `!=` against a String; `like` and `!(... like ...)`;
//! `[literals].contains(path)`; a `false`; and that a value cannot be both a Long and a String.
//! Anything else (`||`, `if`, arithmetic, sets of the path, two paths compared with each other,
//! extension values) is taken as satisfiable, so the tool stays: over-approximated, never
//! hidden wrongly. The same reading tells when a residual `forbid` (a conjunction) applies to
//! every request a residual permit is true for ([`covers`]); `has` and `!(... has ...)` are read
//! there too (an attribute read must be there).
//!
//! Owns reading a residual's JSON form; it never decides.

use std::collections::{BTreeMap, BTreeSet};

use cedar_policy::Policy;
use serde_json::Value;

/// Is `policy`'s condition false for every request? `false` when not sure.
pub fn never_true(policy: &Policy) -> bool {
    let Some((when, _)) = clauses(policy) else {
        return false;
    };
    when.iter().any(|body| {
        let mut atoms = Vec::new();
        flatten(body, &mut atoms);
        conjunction_never_true(&atoms.into_iter().map(|a| (a, false)).collect::<Vec<_>>())
    })
}

/// Does the residual `forbid` apply to every request the residual `permit` is true for, so that
/// no request is permitted by it? `false` when not sure. The forbid's `when` is a conjunction
/// `a1 && a2 && ...`: it fails to apply only when some `ai` is false (an error applies it: a
/// forbid whose condition errors denies), so it covers the permit when each `permit && !ai` is
/// never true. A forbid with an `unless` is not read.
pub fn covers(forbid: &Policy, permit: &Policy) -> bool {
    let (Some((f_when, f_unless)), Some((p_when, _))) = (clauses(forbid), clauses(permit)) else {
        return false;
    };
    if f_unless {
        return false;
    }
    let mut p_atoms = Vec::new();
    p_when.iter().for_each(|b| flatten(b, &mut p_atoms));
    let mut f_atoms = Vec::new();
    f_when.iter().for_each(|b| flatten(b, &mut f_atoms));
    f_atoms.iter().all(|a| {
        let mut both: Vec<(&Value, bool)> = p_atoms.iter().map(|p| (*p, false)).collect();
        both.push((a, true));
        conjunction_never_true(&both)
    })
}

/// A policy's `when` bodies (as JSON), and whether it has an `unless`.
fn clauses(policy: &Policy) -> Option<(Vec<Value>, bool)> {
    let est = policy.to_json().ok()?;
    let conditions = est.get("conditions")?.as_array()?;
    let mut when = Vec::new();
    let mut unless = false;
    for c in conditions {
        match (c.get("kind").and_then(Value::as_str), c.get("body")) {
            (Some("when"), Some(body)) => when.push(body.clone()),
            _ => unless = true,
        }
    }
    Some((when, unless))
}

/// What the conjuncts say of one path.
#[derive(Default)]
struct Facts {
    /// Inclusive bounds a Long must lie in (the path is a Long when any is set).
    low: Option<i64>,
    high: Option<i64>,
    long_not: BTreeSet<i64>,
    /// The Longs it must be one of.
    long_in: Option<BTreeSet<i64>>,
    /// The Strings it must be one of (`==`, `contains`).
    string_in: Option<BTreeSet<String>>,
    string_not: BTreeSet<String>,
    /// `like` patterns it must match (`true`) or must not (`false`).
    like: Vec<(Vec<Piece>, bool)>,
    /// `has` says it is there, or `!(... has ...)` that it is not.
    present: bool,
    absent: bool,
}

/// A `like` pattern's element.
#[derive(Clone, PartialEq, Eq)]
enum Piece {
    Any,
    Text(String),
}

/// Are these atoms (each negated when its flag is set) never all true at once?
fn conjunction_never_true(atoms: &[(&Value, bool)]) -> bool {
    let mut facts: BTreeMap<String, Facts> = BTreeMap::new();
    for (atom, not) in atoms {
        if let Some(Value::Bool(b)) = atom.get("Value")
            && b == not
        {
            return true;
        }
        add(atom, *not, &mut facts);
    }
    // Said absent, yet read (or said present), there or beneath: an attribute read that is not
    // there is an error, never true.
    facts.iter().any(|(path, f)| {
        f.unsatisfiable()
            || (f.absent
                && (f.present
                    || f.constrained()
                    || facts
                        .keys()
                        .any(|k| k.len() > path.len() && k.starts_with(&format!("{path}.")))))
    })
}

fn flatten<'a>(e: &'a Value, out: &mut Vec<&'a Value>) {
    match e.get("&&") {
        Some(node) if e.as_object().is_some_and(|m| m.len() == 1) => {
            for side in ["left", "right"] {
                if let Some(s) = node.get(side) {
                    flatten(s, out);
                }
            }
        }
        _ => out.push(e),
    }
}

/// `context.arguments.amount` for a chain of `.` ending in a variable.
fn path(e: &Value) -> Option<String> {
    if let Some(v) = e.get("Var").and_then(Value::as_str) {
        return Some(v.to_owned());
    }
    let node = e.get(".")?;
    let attr = node.get("attr")?.as_str()?;
    Some(format!("{}.{attr:?}", path(node.get("left")?)?))
}

enum Literal {
    Long(i64),
    String(String),
}

fn literal(e: &Value) -> Option<Literal> {
    match e.get("Value") {
        Some(Value::Number(n)) => n.as_i64().map(Literal::Long),
        Some(Value::String(s)) => Some(Literal::String(s.clone())),
        Some(_) => None,
        None => {
            // `-5` as `neg` of `5`.
            let inner = e.get("neg")?.get("arg")?.get("Value")?.as_i64()?;
            inner.checked_neg().map(Literal::Long)
        }
    }
}

/// Records what `atom` (negated when `not`) says of a path, if it says something this module
/// reads.
fn add(atom: &Value, not: bool, facts: &mut BTreeMap<String, Facts>) {
    let Some((op, node)) = atom
        .as_object()
        .filter(|m| m.len() == 1)
        .and_then(|m| m.iter().next())
    else {
        return;
    };
    match op.as_str() {
        "has" => {
            let (Some(p), Some(attr)) = (
                node.get("left").and_then(path),
                node.get("attr").and_then(Value::as_str),
            ) else {
                return;
            };
            let f = facts.entry(format!("{p}.{attr:?}")).or_default();
            if not {
                f.absent = true;
            } else {
                f.present = true;
            }
        }
        "!" => {
            if let Some(arg) = node.get("arg") {
                add(arg, !not, facts);
            }
        }
        "like" => {
            let (Some(p), Some(pattern)) = (
                node.get("left").and_then(path),
                node.get("pattern").and_then(pieces),
            ) else {
                return;
            };
            facts.entry(p).or_default().like.push((pattern, !not));
        }
        "contains" if !not => {
            let (Some(set), Some(p)) = (
                node.get("left")
                    .and_then(|l| l.get("Set"))
                    .and_then(Value::as_array),
                node.get("right").and_then(path),
            ) else {
                return;
            };
            let literals: Option<Vec<Literal>> = set.iter().map(literal).collect();
            let Some(literals) = literals else { return };
            let f = facts.entry(p).or_default();
            let longs: BTreeSet<i64> = literals
                .iter()
                .filter_map(|l| match l {
                    Literal::Long(i) => Some(*i),
                    Literal::String(_) => None,
                })
                .collect();
            let strings: BTreeSet<String> = literals
                .iter()
                .filter_map(|l| match l {
                    Literal::String(s) => Some(s.clone()),
                    Literal::Long(_) => None,
                })
                .collect();
            // One of the set's values: of one kind only when the set is.
            if strings.is_empty() {
                f.long_in = Some(intersect(f.long_in.take(), longs));
            } else if longs.is_empty() {
                f.string_in = Some(intersect(f.string_in.take(), strings));
            }
        }
        "==" | "!=" | "<" | "<=" | ">" | ">=" => {
            let (Some(l), Some(r)) = (node.get("left"), node.get("right")) else {
                return;
            };
            // `path op literal`, or `literal op path` read the other way round.
            let (p, lit, op) = match (path(l), literal(r), path(r), literal(l)) {
                (Some(p), Some(lit), _, _) => (p, lit, op.as_str()),
                (_, _, Some(p), Some(lit)) => (p, lit, flipped(op)),
                _ => return,
            };
            let op = if not { negated(op) } else { op };
            let f = facts.entry(p).or_default();
            match (op, lit) {
                ("==", Literal::Long(i)) => f.long_in = Some(intersect(f.long_in.take(), [i])),
                ("!=", Literal::Long(i)) => {
                    f.long_not.insert(i);
                }
                ("==", Literal::String(s)) => {
                    f.string_in = Some(intersect(f.string_in.take(), [s]));
                }
                ("!=", Literal::String(s)) => {
                    f.string_not.insert(s);
                }
                (op, Literal::Long(i)) => {
                    // `<` and friends: a Long on both sides, or an error (never true).
                    let (low, high) = match op {
                        "<" => (None, i.checked_sub(1).or(Some(i64::MIN))),
                        "<=" => (None, Some(i)),
                        ">" => (i.checked_add(1).or(Some(i64::MAX)), None),
                        _ => (Some(i), None),
                    };
                    // `x < i64::MIN` or `x > i64::MAX`: nothing is.
                    if (op == "<" && i == i64::MIN) || (op == ">" && i == i64::MAX) {
                        f.long_in = Some(BTreeSet::new());
                    }
                    if let Some(l) = low {
                        f.low = Some(f.low.map_or(l, |x| x.max(l)));
                    }
                    if let Some(h) = high {
                        f.high = Some(f.high.map_or(h, |x| x.min(h)));
                    }
                }
                // An order between strings is an error: never true.
                (_, Literal::String(_)) => f.string_in = Some(BTreeSet::new()),
            }
        }
        _ => {}
    }
}

fn flipped(op: &str) -> &'static str {
    match op {
        "<" => ">",
        "<=" => ">=",
        ">" => "<",
        ">=" => "<=",
        "==" => "==",
        _ => "!=",
    }
}

/// The comparison `!(a op b)` is: for `<` and friends only when it is not an error, which is
/// when both are Longs, as the negated comparison also requires.
fn negated(op: &str) -> &'static str {
    match op {
        "<" => ">=",
        "<=" => ">",
        ">" => "<=",
        ">=" => "<",
        "==" => "!=",
        _ => "==",
    }
}

fn intersect<T: Ord + Clone>(
    have: Option<BTreeSet<T>>,
    new: impl IntoIterator<Item = T>,
) -> BTreeSet<T> {
    let new: BTreeSet<T> = new.into_iter().collect();
    match have {
        Some(h) => h.intersection(&new).cloned().collect(),
        None => new,
    }
}

fn pieces(pattern: &Value) -> Option<Vec<Piece>> {
    pattern
        .as_array()?
        .iter()
        .map(|p| match p {
            Value::String(w) if w == "Wildcard" => Some(Piece::Any),
            _ => p
                .get("Literal")
                .and_then(Value::as_str)
                .map(|t| Piece::Text(t.to_owned())),
        })
        .collect()
}

/// Does `s` match the `like` pattern (`Any` matches any run of characters)?
fn matches(s: &str, pattern: &[Piece]) -> bool {
    match pattern.split_first() {
        None => s.is_empty(),
        Some((Piece::Text(t), rest)) => {
            s.strip_prefix(t.as_str()).is_some_and(|r| matches(r, rest))
        }
        Some((Piece::Any, rest)) => s
            .char_indices()
            .map(|(i, _)| i)
            .chain([s.len()])
            .any(|i| matches(&s[i..], rest)),
    }
}

impl Facts {
    /// Whether anything is said of its value (which then must be there).
    fn constrained(&self) -> bool {
        self.low.is_some()
            || self.high.is_some()
            || self.long_in.is_some()
            || !self.long_not.is_empty()
            || self.string_in.is_some()
            || !self.string_not.is_empty()
            || !self.like.is_empty()
    }

    fn is_long(&self) -> bool {
        self.low.is_some() || self.high.is_some() || self.long_in.is_some()
    }

    fn is_string(&self) -> bool {
        self.string_in.is_some() || self.like.iter().any(|(_, must)| *must)
    }

    fn unsatisfiable(&self) -> bool {
        if self.is_long() && self.is_string() {
            return true;
        }
        self.longs_unsatisfiable() || self.strings_unsatisfiable()
    }

    fn longs_unsatisfiable(&self) -> bool {
        let low = self.low.unwrap_or(i64::MIN);
        let high = self.high.unwrap_or(i64::MAX);
        if low > high {
            return true;
        }
        let fits = |i: &i64| (low..=high).contains(i) && !self.long_not.contains(i);
        match &self.long_in {
            Some(set) => !set.iter().any(fits),
            // Every value of a short interval excluded.
            None if self.low.is_some() && self.high.is_some() => {
                let width = i128::from(high) - i128::from(low);
                width < self.long_not.len() as i128 && !(low..=high).any(|i| fits(&i))
            }
            None => false,
        }
    }

    fn strings_unsatisfiable(&self) -> bool {
        let fits = |s: &String| {
            !self.string_not.contains(s)
                && self
                    .like
                    .iter()
                    .all(|(pattern, must)| matches(s, pattern) == *must)
        };
        match &self.string_in {
            Some(set) => !set.iter().any(fits),
            // The same pattern required and refused.
            None => self
                .like
                .iter()
                .any(|(p, must)| *must && self.like.iter().any(|(q, m)| !*m && p == q)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn never(condition: &str) -> bool {
        let p = Policy::from_str(&format!(
            "permit(principal, action, resource) when {{ {condition} }};"
        ))
        .expect("policy");
        never_true(&p)
    }

    #[test]
    fn contradictions_on_one_attribute_are_never_true() {
        let a = "context.arguments.amount";
        let c = "context.arguments.channel";
        for cond in [
            format!("{a} > 5 && {a} < 3"),
            format!("{a} >= 5 && {a} <= 4"),
            format!("{a} == 3 && {a} == 4"),
            format!("{a} == 3 && {a} != 3"),
            format!("{a} == 3 && {a} > 3"),
            format!("3 < {a} && {a} < 4"),
            format!("{a} >= 1 && {a} <= 2 && {a} != 1 && {a} != 2"),
            format!("!({a} <= 5) && {a} < 6"),
            format!("[1, 2].contains({a}) && {a} > 2"),
            format!("{a} < -5 && {a} > -6"),
            format!("{a} > 9223372036854775807"),
            format!("{c} == \"a\" && {c} == \"b\""),
            format!("{c} == \"a\" && !({c} == \"a\")"),
            format!("{c} == \"bob/x\" && {c} like \"alice/*\""),
            format!("{c} like \"alice/*\" && !({c} like \"alice/*\")"),
            format!("{c} == \"alice/x\" && !({c} like \"alice/*\")"),
            format!("[\"a\", \"b\"].contains({c}) && {c} != \"a\" && {c} != \"b\""),
            format!("{c} == \"a\" && {c} == 1"),
            format!("{c} like \"a*\" && {c} < 3"),
            format!("context has arguments && ({a} > 5 && false)"),
            "resource.path == \"/a\" && resource.path == \"/b\"".to_owned(),
        ] {
            assert!(never(&cond), "{cond}");
        }
    }

    #[test]
    fn what_some_value_meets_or_is_not_read_stays() {
        let a = "context.arguments.amount";
        let c = "context.arguments.channel";
        for cond in [
            format!("{a} > 5 && {a} < 7"),
            format!("{a} == 3 && {a} >= 3"),
            format!("{a} >= 1 && {a} <= 3 && {a} != 1 && {a} != 2"),
            format!("{a} != 3 && {a} != 4"),
            format!("{a} > 5 || {a} < 3"),
            format!("{a} > 5 && context.arguments.other < 3"),
            format!("{a} + 1 > 5 && {a} < 3"),
            format!("{c} == \"alice/x\" && {c} like \"alice/*\""),
            format!("{c} like \"a*\" && !({c} like \"b*\")"),
            format!("{c} like \"a*\" && {c} like \"*b\""),
            format!("{c} != \"a\" && {c} != \"b\""),
            format!("{c} == \"a\" || {c} == \"b\""),
            format!("context.arguments.to.channel == \"a\" && {c} == \"b\""),
            format!("[\"a\", 1].contains({c}) && {c} == 1"),
            format!("{c} like \"*\\**\" && {c} == \"x*y\""),
            "true".to_owned(),
        ] {
            assert!(!never(&cond), "{cond}");
        }
        // Two `when` clauses: either never true is enough; an `unless` is not read.
        let p = Policy::from_str(
            "permit(principal, action, resource) when { true } when { context.arguments.n > 2 && context.arguments.n < 1 };",
        );
        if let Ok(p) = p {
            assert!(never_true(&p));
        }
        let p = Policy::from_str(
            "permit(principal, action, resource) unless { context.arguments.n > 2 && context.arguments.n < 1 };",
        )
        .expect("policy");
        assert!(!never_true(&p));
    }

    #[test]
    fn a_forbid_that_takes_back_every_permitted_value_covers_the_permit() {
        let policy = |effect: &str, cond: &str| {
            Policy::from_str(&format!(
                "{effect}(principal, action, resource) when {{ {cond} }};"
            ))
            .expect("policy")
        };
        let a = "context.arguments.amount";
        let c = "context.arguments.channel";
        for (permit, forbid, want) in [
            (
                format!("{a} <= 100"),
                format!("context.arguments has amount && {a} < 200"),
                true,
            ),
            (
                format!("context.arguments has channel && {c} == \"public\""),
                format!("context.arguments has channel && {c} != \"x\""),
                true,
            ),
            (
                "resource.path like \"/public/*\" && resource.path != \"/public/b\"".to_owned(),
                "resource.path like \"/public/*\"".to_owned(),
                true,
            ),
            // One pattern within another is not read: kept.
            (
                "resource.path like \"/public/a*\"".to_owned(),
                "resource.path like \"/public/*\"".to_owned(),
                false,
            ),
            (format!("{a} == 7"), format!("{a} >= 0 && {a} != 8"), true),
            ("true".to_owned(), format!("{a} > 5"), false),
            (format!("{a} <= 100"), format!("{a} < 50"), false),
            (
                "context.arguments has channel".to_owned(),
                format!("context.arguments has channel && {c} != \"x\""),
                false,
            ),
            (
                format!("{a} <= 100"),
                format!("{a} < 200 || {c} == \"x\""),
                false,
            ),
            (
                "resource.path like \"/public/*\"".to_owned(),
                "resource.path like \"/public/a*\"".to_owned(),
                false,
            ),
        ] {
            assert_eq!(
                covers(&policy("forbid", &forbid), &policy("permit", &permit)),
                want,
                "permit {permit} / forbid {forbid}"
            );
        }
        let unless = Policy::from_str(&format!(
            "forbid(principal, action, resource) when {{ {a} < 200 }} unless {{ {a} == 3 }};"
        ))
        .expect("policy");
        assert!(!covers(&unless, &policy("permit", &format!("{a} <= 100"))));
    }

    #[test]
    fn like_matches_as_cedar_does() {
        let p = |s: &str| -> Vec<Piece> {
            let policy = Policy::from_str(&format!(
                "permit(principal, action, resource) when {{ context.x like \"{s}\" }};"
            ))
            .expect("policy");
            let est = policy.to_json().expect("json");
            pieces(&est["conditions"][0]["body"]["like"]["pattern"]).expect("pattern")
        };
        assert!(matches("alice/x", &p("alice/*")));
        assert!(matches("alice/", &p("alice/*")));
        assert!(!matches("bob/alice/x", &p("alice/*")));
        assert!(matches("a-b-c", &p("a*b*c")));
        assert!(!matches("a-b-", &p("a*b*c")));
        assert!(matches("x*y", &p("x\\*y")));
        assert!(!matches("xzy", &p("x\\*y")));
        assert!(matches("", &p("*")));
        assert!(matches("é/ü", &p("*/*")));
    }
}
