//! Manifests side by side: the summary of one column run (what the interop matrix keeps of it),
//! the interop matrix (docs/interop.md) rendered from summaries (`column matrix`), and two manifests compared row
//! by row (`column compare`).
//!
//! Owns: the summary's shape (only what a rerun of the same pinned CLI reproduces: grades,
//! outcomes, offered names, the models; no times, paths, ids or hashes of a run), the markdown
//! table, and the comparison's rule that refusal behaviour is compared only between runs offered
//! the same catalogue. It reads manifests written by [`crate::runner`]; it grades nothing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::runner::grade_word;

/// `kind` of a manifest written by `column run`.
pub const MANIFEST_KIND: &str = "sharedos.mcp-column";
/// `kind` of a summary.
pub const SUMMARY_KIND: &str = "sharedos.mcp-column-summary";
/// Exit status of `column compare` when some row differs.
pub const EXIT_ROWS_DIFFER: u8 = 4;
/// Exit status of `column compare` when the catalogue hashes differ (nothing compared).
pub const EXIT_CATALOGUES_DIFFER: u8 = 5;

#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    #[error("cannot read `{}`", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{}` is not JSON", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("`{}` is neither a column manifest nor a summary (`kind` is {kind})", path.display())]
    Kind { path: PathBuf, kind: String },
    #[error("no summaries or manifests (*.json) in `{}`", path.display())]
    Empty { path: PathBuf },
    /// The columns were not offered the same tools, so their lines are not comparable (the ADR's
    /// condition); `column matrix --show-anyway` prints them, marked.
    #[error(
        "the columns were not given the same catalogue, so the matrix would compare unlike runs: {detail} (regenerate the summaries from runs of the same catalogue, or pass --show-anyway to print it with the differing lines marked)"
    )]
    CatalogsDiffer { detail: String },
}

/// What a column's run shows in the matrix, from its manifest.
pub fn summary(manifest: &Value) -> Value {
    let mut id = manifest["systemIdentity"].clone();
    // A manifest carries its turn's hash beside the identity too: the summary keeps it either way.
    if id.is_object() && id["catalogHash"].is_null() && manifest["catalogHash"].is_string() {
        id["catalogHash"] = manifest["catalogHash"].clone();
    }
    let id = &id;
    let rows: Vec<Value> = manifest["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let outcome = match (r["outcome"].as_str(), r["code"].as_str()) {
                (Some(o), Some(c)) => json!(format!("{o}/{c}")),
                _ => Value::Null,
            };
            let mut row = json!({"id": r["id"], "grade": r["grade"], "outcome": outcome});
            if let Some(said) = r["approval"]["said"].as_str() {
                row["approval"] = json!(said);
            }
            row
        })
        .collect();
    let checks: Vec<Value> = manifest["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| json!({"id": c["id"], "grade": c["grade"]}))
        .collect();
    let o = &manifest["offered"];
    let others = o["others"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let names = |f: &dyn Fn(&Value) -> bool| -> Vec<Value> {
        others
            .iter()
            .filter(|t| f(t))
            .map(|t| t["name"].clone())
            .collect()
    };
    let offered = if o.is_object() {
        json!({
            "boundary": o["boundary"],
            "missing": o["missing"],
            "extra": o["extra"],
            "renamed": o["renamed"],
            "harnessLocal": names(&|t| t["declared"] == true).len(),
            "undeclared": names(&|t| t["declared"] != true),
        })
    } else {
        Value::Null
    };
    let m = &manifest["model"];
    let measured = &manifest["harnessVersionMeasured"];
    json!({
        "kind": SUMMARY_KIND,
        "version": 2,
        "systemIdentity": id,
        "harness": id["harness"],
        "harnessVersion": id["harnessVersion"],
        "harnessVersionMeasured": measured["version"],
        "harnessVersionOutput": measured["output"],
        "mcpSupport": id["mcpSupport"],
        "extension": id["extension"],
        "rows": rows,
        "checks": checks,
        "offered": offered,
        "model": {"declared": m["declared"], "asked": m["asked"], "same": m["same"]},
    })
}

fn read_json(path: &Path) -> Result<Value, MatrixError> {
    let text = std::fs::read_to_string(path).map_err(|source| MatrixError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| MatrixError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// A manifest, refused naming the file when it is not one.
pub fn read_manifest(path: &Path) -> Result<Value, MatrixError> {
    let v = read_json(path)?;
    if v["kind"] != MANIFEST_KIND {
        return Err(MatrixError::Kind {
            path: path.to_path_buf(),
            kind: v["kind"].to_string(),
        });
    }
    Ok(v)
}

/// The summaries in `paths`: each a summary or a manifest (summarized), or a folder whose
/// `*.json` files are, in name order.
pub fn read_summaries(paths: &[PathBuf]) -> Result<Vec<Value>, MatrixError> {
    let mut out = Vec::new();
    for path in paths {
        let files = if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|source| MatrixError::Read {
                    path: path.clone(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(MatrixError::Empty { path: path.clone() });
            }
            files
        } else {
            vec![path.clone()]
        };
        for file in files {
            let v = read_json(&file)?;
            out.push(match v["kind"].as_str() {
                Some(MANIFEST_KIND) => summary(&v),
                Some(SUMMARY_KIND) => v,
                _ => {
                    return Err(MatrixError::Kind {
                        path: file,
                        kind: v["kind"].to_string(),
                    });
                }
            });
        }
    }
    Ok(out)
}

/// The ids of `key` (`rows` or `checks`) over all summaries, in the order first seen.
fn ids(summaries: &[Value], key: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in summaries {
        for r in s[key].as_array().into_iter().flatten() {
            if let Some(id) = r["id"].as_str()
                && !out.iter().any(|x| x == id)
            {
                out.push(id.to_owned());
            }
        }
    }
    out
}

fn grade_of<'a>(s: &'a Value, key: &str, id: &str) -> Option<&'a Value> {
    s[key]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["id"] == id)
}

/// The declared version, and the measured one beside it when they differ (shown, never
/// corrected) or when none was measured.
fn version(s: &Value) -> String {
    let declared = s["harnessVersion"].as_str().unwrap_or("?");
    let mut v = match s["harnessVersionMeasured"].as_str() {
        Some(m) if m == declared => declared.to_owned(),
        Some(m) => format!("{declared} (measured {m}: MISMATCH)"),
        None => format!("{declared} (declared; not measured)"),
    };
    if let Some(ext) = s["extension"].as_str() {
        v.push_str(&format!(" + {ext}"));
    }
    v
}

/// A summary's catalogue hash (its SystemIdentity's `catalogHash`).
fn catalog_hash(s: &Value) -> Option<&str> {
    s["systemIdentity"]["catalogHash"].as_str()
}

/// The hash most summaries carry (the first seen on a tie), and the harnesses whose hash is
/// another or missing.
fn catalog_odd_ones(summaries: &[Value]) -> (Option<String>, Vec<String>) {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for h in summaries.iter().filter_map(catalog_hash) {
        match counts.iter_mut().find(|(x, _)| x == h) {
            Some((_, n)) => *n += 1,
            None => counts.push((h.to_owned(), 1)),
        }
    }
    let mut common: Option<(String, usize)> = None;
    for (h, n) in counts {
        if common.as_ref().is_none_or(|(_, m)| n > *m) {
            common = Some((h, n));
        }
    }
    let common = common.map(|(h, _)| h);
    let odd = summaries
        .iter()
        .filter(|s| catalog_hash(s).is_none() || catalog_hash(s) != common.as_deref())
        .map(|s| {
            format!(
                "{} has {}",
                s["harness"].as_str().unwrap_or("?"),
                catalog_hash(s).map_or("no catalogHash".to_owned(), |h| format!("catalogHash {h}"))
            )
        })
        .collect();
    (common, odd)
}

/// A row's cell: its grade, and for a row whose call waited for an approval, what the approval
/// came to (`fail: declined by the client`, `pass: no question shown: operator approved`).
fn row_cell(r: &Value) -> String {
    let grade = grade_word(&r["grade"]);
    match r["approval"].as_str() {
        Some(said) => format!("{grade}: {said}"),
        None => grade.to_owned(),
    }
}

fn asked(model: &Value) -> String {
    let asked: Vec<String> = model["asked"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|a| format!("`{a}`"))
        .collect();
    if asked.is_empty() {
        return "not observed".to_owned();
    }
    let verdict = match model["same"].as_bool() {
        Some(true) => "the declared one",
        Some(false) => "not the declared one",
        None => "",
    };
    format!("{} ({verdict})", asked.join(", "))
}

/// The markdown matrix: a line per harness (its version, declared and measured, its catalogue
/// hash, each row's and check's grade, with what an approval came to, the model it asked for), a
/// column per row id and check id as first seen, and under the table the catalogue hash in full.
/// Refused ([`MatrixError::CatalogsDiffer`]) when the summaries' catalogue hashes differ or one
/// has none, unless `show_anyway`: then the odd lines' hash cells say `DIFFERS`.
pub fn render(summaries: &[Value], show_anyway: bool) -> Result<String, MatrixError> {
    let (common, odd) = catalog_odd_ones(summaries);
    if !odd.is_empty() && !show_anyway {
        return Err(MatrixError::CatalogsDiffer {
            detail: format!(
                "{} (most carry {})",
                odd.join("; "),
                common.as_deref().unwrap_or("none")
            ),
        });
    }
    let rows = ids(summaries, "rows");
    let checks = ids(summaries, "checks");
    let mut head = vec![
        "harness".to_owned(),
        "version".to_owned(),
        "catalogue".to_owned(),
    ];
    head.extend(rows.iter().chain(&checks).map(|id| format!("`{id}`")));
    head.push("model asked for".to_owned());
    let mut out = format!("| {} |\n", head.join(" | "));
    out.push_str(&format!("|{}\n", " --- |".repeat(head.len())));
    for s in summaries {
        let short = |h: &str| h.chars().take(12).collect::<String>();
        let hash = match catalog_hash(s) {
            Some(h) if Some(h) == common.as_deref() => format!("`{}`", short(h)),
            Some(h) => format!("`{}` DIFFERS", short(h)),
            None => "none: DIFFERS".to_owned(),
        };
        let mut cells = vec![
            s["harness"].as_str().unwrap_or("?").to_owned(),
            version(s),
            hash,
        ];
        for (key, list) in [("rows", &rows), ("checks", &checks)] {
            for id in list {
                cells.push(grade_of(s, key, id).map_or("—".to_owned(), row_cell));
            }
        }
        cells.push(asked(&s["model"]));
        out.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    match (&common, odd.is_empty()) {
        (Some(h), true) => out.push_str(&format!(
            "\nEvery column was given the same catalogue: catalogHash `{h}`.\n"
        )),
        _ => out.push_str(&format!(
            "\nNOT the same catalogue: {} (shown anyway).\n",
            odd.join("; ")
        )),
    }
    Ok(out)
}

/// The outcome of `column compare`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comparison {
    pub text: String,
    /// 0, [`EXIT_ROWS_DIFFER`] or [`EXIT_CATALOGUES_DIFFER`].
    pub exit: u8,
}

fn tool_set(manifest: &Value) -> Option<BTreeSet<String>> {
    manifest["catalogue"].as_array().map(|a| {
        a.iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    })
}

fn names(set: &BTreeSet<&String>) -> String {
    if set.is_empty() {
        return "none".to_owned();
    }
    set.iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn who(label: &str, m: &Value) -> String {
    let id = &m["systemIdentity"];
    format!(
        "{label} ({} {})",
        id["harness"].as_str().unwrap_or("?"),
        id["harnessVersion"].as_str().unwrap_or("")
    )
}

/// One row's or check's cell: grade, and the recorded outcome where there is one.
fn cell(r: Option<&Value>) -> String {
    match r {
        None => "absent".to_owned(),
        Some(r) => match (r["outcome"].as_str(), r["code"].as_str()) {
            (Some(o), Some(c)) => format!("{} {o}/{c}", grade_word(&r["grade"])),
            _ => grade_word(&r["grade"]).to_owned(),
        },
    }
}

/// Compares two manifests row by row (attempt rows, then checks, then the model asked for).
/// When their catalogue hashes differ the refusals are not comparable: the tool-set difference
/// is given instead, and the exit is [`EXIT_CATALOGUES_DIFFER`].
pub fn compare(a_label: &str, a: &Value, b_label: &str, b: &Value) -> Comparison {
    let (ha, hb) = (&a["catalogHash"], &b["catalogHash"]);
    let mut text = format!("A: {}\nB: {}\n", who(a_label, a), who(b_label, b));
    if ha != hb || ha.is_null() {
        text.push_str(&format!(
            "catalogue hashes differ (A {}, B {}): refusal behaviour is not compared, the two runs were not offered the same tools.\n",
            ha.as_str().unwrap_or("none"),
            hb.as_str().unwrap_or("none"),
        ));
        match (tool_set(a), tool_set(b)) {
            (Some(sa), Some(sb)) => {
                let only_a: BTreeSet<&String> = sa.difference(&sb).collect();
                let only_b: BTreeSet<&String> = sb.difference(&sa).collect();
                if only_a.is_empty() && only_b.is_empty() {
                    text.push_str(&format!(
                        "the same {} tool name(s); their definitions differ\n",
                        sa.len()
                    ));
                } else {
                    text.push_str(&format!("tools only in A: {}\n", names(&only_a)));
                    text.push_str(&format!("tools only in B: {}\n", names(&only_b)));
                }
            }
            (sa, sb) => {
                for (label, set) in [(a_label, sa), (b_label, sb)] {
                    if set.is_none() {
                        text.push_str(&format!(
                            "{label} records no tool list (`catalogue`): the difference cannot be named\n"
                        ));
                    }
                }
            }
        }
        return Comparison {
            text,
            exit: EXIT_CATALOGUES_DIFFER,
        };
    }
    text.push_str(&format!(
        "catalogHash {} (the same)\n",
        ha.as_str().unwrap_or("")
    ));
    text.push_str(&format!("{:<20} {:<36} {:<36} {}\n", "row", "A", "B", ""));
    let mut differ = 0;
    for key in ["rows", "checks"] {
        let pair = [a.clone(), b.clone()];
        for id in ids(&pair, key) {
            let (ca, cb) = (cell(grade_of(a, key, &id)), cell(grade_of(b, key, &id)));
            let same = ca == cb;
            if !same {
                differ += 1;
            }
            text.push_str(&format!(
                "{:<20} {:<36} {:<36} {}\n",
                id,
                ca,
                cb,
                if same { "same" } else { "DIFFERS" }
            ));
        }
    }
    let (ma, mb) = (asked(&a["model"]), asked(&b["model"]));
    text.push_str(&format!(
        "{:<20} {:<36} {:<36} {}\n",
        "model asked for",
        ma,
        mb,
        if ma == mb {
            "same"
        } else {
            "differs (shown, not graded)"
        }
    ));
    text.push_str(&if differ == 0 {
        "every row the same\n".to_owned()
    } else {
        format!("{differ} row(s) differ\n")
    });
    Comparison {
        text,
        exit: if differ == 0 { 0 } else { EXIT_ROWS_DIFFER },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(harness: &str, hash: &str, tools: &[&str], denied: (&str, &str)) -> Value {
        json!({
            "kind": MANIFEST_KIND,
            "systemIdentity": {"harness": harness, "harnessVersion": "1.0", "mcpSupport": "native", "extension": null, "catalogHash": hash},
            "harnessVersionMeasured": {"version": "1.0", "output": "1.0 (x)"},
            "catalogHash": hash,
            "catalogue": tools,
            "rows": [
                {"id": "allowed-read", "grade": "pass", "outcome": "succeeded", "code": "ok", "matchedCallIds": ["c1"]},
                {"id": "denied-read", "grade": denied.0, "outcome": denied.1, "code": "x"},
                {"id": "never", "grade": "not_exercised", "outcome": null, "code": null},
            ],
            "checks": [{"id": "offered-catalogue", "grade": "pass", "detail": "d"}],
            "offered": {"boundary": {"files.read": "a_files_read"}, "missing": [], "extra": [], "renamed": [],
                        "others": [{"name": "Bash", "origin": "harness-local", "declared": true},
                                   {"name": "mcp__time__x", "origin": "other-server", "server": "time", "declared": false}]},
            "model": {"declared": "m", "asked": ["m"], "same": true},
            "startedAt": "2026-01-01T00:00:00Z",
        })
    }

    #[test]
    fn summary_keeps_what_a_rerun_reproduces() {
        let s = summary(&manifest("pi", "h", &["files.read"], ("pass", "denied")));
        assert_eq!(s["kind"], SUMMARY_KIND);
        assert_eq!(
            s["rows"][0],
            json!({"id": "allowed-read", "grade": "pass", "outcome": "succeeded/ok"})
        );
        assert_eq!(s["rows"][2]["outcome"], Value::Null);
        assert_eq!(s["offered"]["harnessLocal"], 1);
        assert_eq!(s["offered"]["undeclared"], json!(["mcp__time__x"]));
        assert!(s.get("startedAt").is_none());
        assert!(!s.to_string().contains("c1"), "no call ids: {s}");
    }

    #[test]
    fn render_is_a_markdown_table_of_grades() {
        let a = summary(&manifest("pi", "h", &["files.read"], ("pass", "denied")));
        let mut b = summary(&manifest(
            "codex",
            "h",
            &["files.read"],
            ("fail", "succeeded"),
        ));
        b["extension"] = json!("ext@2");
        b["model"] = json!({"declared": "m", "asked": ["other"], "same": false});
        let t = render(&[a, b], false).expect("same catalogue");
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "| harness | version | catalogue | `allowed-read` | `denied-read` | `never` | `offered-catalogue` | model asked for |"
        );
        assert_eq!(
            lines[1],
            "| --- | --- | --- | --- | --- | --- | --- | --- |"
        );
        assert_eq!(
            lines[2],
            "| pi | 1.0 | `h` | pass | pass | not exercised | pass | `m` (the declared one) |"
        );
        assert_eq!(
            lines[3],
            "| codex | 1.0 + ext@2 | `h` | pass | fail | not exercised | pass | `other` (not the declared one) |"
        );
        assert_eq!(
            lines[5],
            "Every column was given the same catalogue: catalogHash `h`."
        );
        assert_eq!(lines.len(), 6, "{t}");
    }

    /// Issue 47: a summary carries the SystemIdentity with its catalogHash; the matrix refuses
    /// lines of another catalogue (or none) unless shown anyway, marked.
    #[test]
    fn render_refuses_unlike_catalogues_unless_shown_anyway() {
        let a = summary(&manifest("pi", "h1", &["files.read"], ("pass", "denied")));
        assert_eq!(a["systemIdentity"]["catalogHash"], "h1");
        let b = summary(&manifest(
            "codex",
            "h1",
            &["files.read"],
            ("pass", "denied"),
        ));
        let c = summary(&manifest("qwen", "h2", &["files.read"], ("pass", "denied")));
        let e = render(&[a.clone(), b.clone(), c.clone()], false).expect_err("differs");
        let text = e.to_string();
        assert!(
            text.contains("qwen has catalogHash h2 (most carry h1)"),
            "{text}"
        );
        assert!(text.contains("--show-anyway"), "{text}");
        let t = render(&[a.clone(), b, c], true).expect("anyway");
        let qwen = t.lines().find(|l| l.starts_with("| qwen")).expect("line");
        assert!(qwen.contains("| `h2` DIFFERS |"), "{qwen}");
        assert!(
            t.contains("NOT the same catalogue: qwen has catalogHash h2 (shown anyway)."),
            "{t}"
        );
        let mut old = a.clone();
        old["systemIdentity"]
            .as_object_mut()
            .expect("id")
            .remove("catalogHash");
        let e = render(&[a, old], false).expect_err("none");
        assert!(e.to_string().contains("pi has no catalogHash"), "{e}");
    }

    /// Issue 47: the measured version beside the declared one, a mismatch shown, never
    /// corrected; an approval row's cell says what the approval came to.
    #[test]
    fn render_shows_measured_versions_and_approval_outcomes() {
        let mut m = manifest("pi", "h", &["files.read"], ("fail", "denied"));
        m["harnessVersionMeasured"] = json!({"version": "1.1", "output": "pi 1.1"});
        m["rows"][1]["approval"] = json!({"said": "declined by the client", "decision": "denied"});
        let s = summary(&m);
        assert_eq!(s["harnessVersion"], "1.0");
        assert_eq!(s["harnessVersionMeasured"], "1.1");
        assert_eq!(s["rows"][1]["approval"], "declined by the client");
        assert!(s["rows"][0].get("approval").is_none());
        let t = render(&[s], false).expect("render");
        assert!(
            t.contains(
                "| pi | 1.0 (measured 1.1: MISMATCH) | `h` | pass | fail: declined by the client |"
            ),
            "{t}"
        );
        m["harnessVersionMeasured"] = json!({"version": null, "error": "cannot start it"});
        let t = render(&[summary(&m)], false).expect("render");
        assert!(t.contains("| 1.0 (declared; not measured) |"), "{t}");
    }

    #[test]
    fn compare_row_by_row() {
        let a = manifest("pi", "h", &["files.read"], ("pass", "denied"));
        let c = compare("a.json", &a, "b.json", &a);
        assert_eq!(c.exit, 0, "{}", c.text);
        assert!(c.text.contains("every row the same"), "{}", c.text);
        let b = manifest("codex", "h", &["files.read"], ("fail", "succeeded"));
        let c = compare("a.json", &a, "b.json", &b);
        assert_eq!(c.exit, EXIT_ROWS_DIFFER, "{}", c.text);
        let line = c
            .text
            .lines()
            .find(|l| l.starts_with("denied-read"))
            .expect("row");
        assert!(line.contains("pass denied/x"), "{line}");
        assert!(line.contains("fail succeeded/x"), "{line}");
        assert!(line.ends_with("DIFFERS"), "{line}");
        assert!(c.text.contains("1 row(s) differ"), "{}", c.text);
    }

    #[test]
    fn compare_refuses_across_catalogues_naming_the_difference() {
        let a = manifest(
            "pi",
            "h1",
            &["files.read", "files.list"],
            ("pass", "denied"),
        );
        let b = manifest(
            "pi",
            "h2",
            &["files.read", "files.write"],
            ("pass", "denied"),
        );
        let c = compare("a.json", &a, "b.json", &b);
        assert_eq!(c.exit, EXIT_CATALOGUES_DIFFER);
        assert!(
            c.text.contains("refusal behaviour is not compared"),
            "{}",
            c.text
        );
        assert!(
            c.text.contains("tools only in A: `files.list`"),
            "{}",
            c.text
        );
        assert!(
            c.text.contains("tools only in B: `files.write`"),
            "{}",
            c.text
        );
        assert!(
            !c.text.contains("denied-read"),
            "no rows compared: {}",
            c.text
        );
        let b = manifest(
            "pi",
            "h2",
            &["files.list", "files.read"],
            ("pass", "denied"),
        );
        let c = compare("a.json", &a, "b.json", &b);
        assert!(c.text.contains("definitions differ"), "{}", c.text);
        let mut old = a.clone();
        old.as_object_mut().expect("obj").remove("catalogue");
        let c = compare("old.json", &old, "b.json", &b);
        assert_eq!(c.exit, EXIT_CATALOGUES_DIFFER);
        assert!(
            c.text.contains("old.json records no tool list"),
            "{}",
            c.text
        );
    }

    #[test]
    fn read_summaries_names_the_bad_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let e = read_summaries(&[dir.path().to_path_buf()]).expect_err("empty");
        assert!(e.to_string().contains("no summaries"), "{e}");
        std::fs::write(
            dir.path().join("b.json"),
            summary(&manifest("b", "h", &[], ("pass", "denied"))).to_string(),
        )
        .expect("w");
        std::fs::write(
            dir.path().join("a.json"),
            manifest("a", "h", &[], ("pass", "denied")).to_string(),
        )
        .expect("w");
        let s = read_summaries(&[dir.path().to_path_buf()]).expect("read");
        assert_eq!(
            s.iter().map(|s| s["harness"].clone()).collect::<Vec<_>>(),
            [json!("a"), json!("b")]
        );
        std::fs::write(dir.path().join("c.json"), r#"{"kind": "other"}"#).expect("w");
        let e = read_summaries(&[dir.path().to_path_buf()]).expect_err("kind");
        assert!(e.to_string().contains("c.json"), "{e}");
        assert!(read_manifest(&dir.path().join("b.json")).is_err());
    }
}
