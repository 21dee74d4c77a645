//! What the harness really offered its model, read from the scripted model's log, and the two
//! checks graded from it (ADR: the column sees what the harness did, not what it was told).
//!
//! Owns: mapping each offered tool back to a canonical name through the harness's alias rule
//! (`sharedos_proto::alias`, on the portable name when the turn uses portable names; the
//! scripted model's [`match_tool`] where the rule does not predict the name), the
//! `offered-catalogue` check (the boundary's tools equal the turn's catalogue in every request
//! that offered tools), the `tool-policy` check (every other offered tool is declared by the
//! ToolPolicy), and the model the harness asked for beside the declared one (shown, never
//! corrected). It never decides anything about a call.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use sharedos_proto::alias::{Harness, SERVER_NAME, portable_name};
use sharedos_proto::{PolicyMode, ToolName, ToolPolicy};

use crate::grade::Grade;
use crate::scripted_model::{LoggedRequest, OfferedTool, match_tool};

/// The id of the check that the boundary's offered tools equal the catalogue.
pub const OFFERED_CATALOGUE: &str = "offered-catalogue";
/// The id of the check that every other offered tool is declared by the ToolPolicy.
pub const TOOL_POLICY: &str = "tool-policy";
/// The id of the check of the ToolPolicy's `externalDirect` entries (only when it has some).
pub const EXTERNAL_DIRECT: &str = "external-direct";

/// A graded check of the whole run (not of one attempt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub id: &'static str,
    pub grade: Grade,
    /// Why, in words: the difference, or what was found equal.
    pub detail: String,
}

/// An offered tool that did not come from the boundary.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OtherTool {
    /// As offered (`namespace/name` for Codex).
    pub name: String,
    /// `other-server` when it carries the harness's naming for another server in its config,
    /// else `harness-local`.
    pub origin: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// Named by the ToolPolicy (`harnessLocal`, or `externalDirect` in open mode).
    pub declared: bool,
}

/// A catalogue tool offered under another name than the alias rule predicts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Renamed {
    pub canonical: String,
    pub expected: String,
    pub offered: String,
}

/// The model requests of one run, as the column sees them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Offered {
    pub requests: usize,
    /// Requests that offered at least one tool (a harness's own title request offers none).
    pub requests_with_tools: usize,
    /// Canonical name → the name the harness offered it as (every request, merged).
    pub boundary: BTreeMap<String, String>,
    /// Catalogue tools some request with tools did not offer.
    pub missing: Vec<String>,
    /// Offered with the boundary's naming, but mapping to no catalogue tool.
    pub extra: Vec<String>,
    /// Requests with tools whose boundary tools differ from the catalogue.
    pub requests_differing: usize,
    pub renamed: Vec<Renamed>,
    pub others: Vec<OtherTool>,
    /// ToolPolicy `harnessLocal` entries no request offered.
    pub declared_not_offered: Vec<String>,
}

/// The declared model beside the ones the harness asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Model {
    pub declared: String,
    /// Distinct, in the order first asked.
    pub asked: Vec<String>,
    /// Whether every model asked for is the declared one (see [`same_model`]); `None` when no
    /// request named a model.
    pub same: Option<bool>,
}

/// Everything observed, and the checks graded from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Observed {
    pub offered: Offered,
    pub model: Model,
    pub checks: Vec<Check>,
}

/// What the turn's harness and catalogue predict.
pub struct Expectation<'a> {
    pub harness: Harness,
    /// The turn's published tools (canonical names).
    pub catalogue: &'a [String],
    pub portable_names: bool,
    pub tool_policy: &'a ToolPolicy,
    /// The other MCP servers in the harness's config.
    pub other_servers: &'a [String],
    pub declared_model: &'a str,
}

/// How `tool` shows in the log (`namespace/name` for Codex), through the harness's alias rule,
/// or `None` where the rule is not measured.
fn shown_alias(harness: Harness, server: &str, tool: &str) -> Option<String> {
    let alias = harness.alias(server, tool)?;
    Some(match harness {
        Harness::Codex => format!("{}/{alias}", Harness::codex_namespace(server)),
        _ => alias,
    })
}

/// The start every shown alias of `server`'s tools has (`mcp__sharedos__`, `mcp__sharedos/`).
fn shown_prefix(harness: Harness, server: &str) -> Option<String> {
    shown_alias(harness, server, "").filter(|p| !p.is_empty())
}

/// Whether a request offered any tool under the boundary's naming (`mcp__sharedos__…`).
pub fn offers_boundary(harness: Harness, request: &LoggedRequest) -> bool {
    shown_prefix(harness, SERVER_NAME)
        .is_some_and(|p| request.offered.iter().any(|t| t.display().starts_with(&p)))
}

/// Whether the declared model names `asked`: its first word is `asked`, or ends in `/asked`
/// (`fake/fake-model (a note)` names `fake-model`).
pub fn same_model(declared: &str, asked: &str) -> bool {
    let first = declared.split_whitespace().next().unwrap_or("");
    !asked.is_empty() && (first == asked || first.ends_with(&format!("/{asked}")))
}

fn list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads the requests against what the turn predicts.
pub fn observe(want: &Expectation<'_>, requests: &[LoggedRequest]) -> Observed {
    let h = want.harness;
    // Shown alias → canonical name, through the rule (on the portable name when used).
    let mut by_alias: BTreeMap<String, String> = BTreeMap::new();
    for canonical in want.catalogue {
        let presented = match ToolName::new(canonical) {
            Ok(name) if want.portable_names => portable_name(&name),
            _ => canonical.clone(),
        };
        if let Some(alias) = shown_alias(h, SERVER_NAME, &presented) {
            by_alias.insert(alias, canonical.clone());
        }
    }
    let boundary_prefix = shown_prefix(h, SERVER_NAME);
    let other_prefixes: Vec<(String, &String)> = want
        .other_servers
        .iter()
        .filter_map(|s| shown_prefix(h, s).map(|p| (p, s)))
        .collect();
    let catalogue: BTreeSet<&String> = want.catalogue.iter().collect();

    let mut offered = Offered {
        requests: requests.len(),
        requests_with_tools: 0,
        boundary: BTreeMap::new(),
        missing: vec![],
        extra: vec![],
        requests_differing: 0,
        renamed: vec![],
        others: vec![],
        declared_not_offered: vec![],
    };
    let (mut missing, mut extra, mut renamed, mut others) = (
        BTreeSet::new(),
        BTreeSet::new(),
        BTreeMap::new(),
        BTreeSet::new(),
    );
    let mut seen_names: BTreeSet<String> = BTreeSet::new();
    for request in requests.iter().filter(|r| !r.offered.is_empty()) {
        offered.requests_with_tools += 1;
        let mut found: BTreeMap<&String, String> = BTreeMap::new();
        let mut unmatched: Vec<&OfferedTool> = vec![];
        for tool in &request.offered {
            let shown = tool.display();
            seen_names.insert(shown.clone());
            match by_alias.get(&shown) {
                Some(canonical) => {
                    found.insert(canonical, shown);
                }
                None => unmatched.push(tool),
            }
        }
        // Where the rule did not predict the name, the scripted model's matching finds it
        // among the tools carrying the boundary's naming (any tool, where the rule is unknown).
        let mut candidates: Vec<OfferedTool> = unmatched
            .iter()
            .filter(|t| {
                boundary_prefix
                    .as_deref()
                    .is_none_or(|p| t.display().starts_with(p))
            })
            .map(|t| (*t).clone())
            .collect();
        for canonical in &catalogue {
            if found.contains_key(canonical) {
                continue;
            }
            if let Some(t) = match_tool(canonical, &candidates).cloned() {
                let shown = t.display();
                if let Some(expected) = shown_alias(h, SERVER_NAME, canonical) {
                    renamed.insert(
                        (*canonical).clone(),
                        Renamed {
                            canonical: (*canonical).clone(),
                            expected,
                            offered: shown.clone(),
                        },
                    );
                }
                candidates.retain(|c| *c != t);
                found.insert(canonical, shown);
            }
        }
        let mut differs = false;
        for canonical in &catalogue {
            if !found.contains_key(canonical) {
                missing.insert((*canonical).clone());
                differs = true;
            }
        }
        for tool in unmatched {
            let shown = tool.display();
            if found.values().any(|v| *v == shown) {
                continue;
            }
            if boundary_prefix
                .as_deref()
                .is_some_and(|p| shown.starts_with(p))
            {
                extra.insert(shown);
                differs = true;
                continue;
            }
            // The longest prefix wins: `mcp__a_b__` over `mcp__a__`.
            let server = other_prefixes
                .iter()
                .filter(|(p, _)| shown.starts_with(p.as_str()))
                .max_by_key(|(p, _)| p.len())
                .map(|(_, s)| (*s).clone());
            let declared = want.tool_policy.harness_local.contains(&shown)
                || (want.tool_policy.mode == PolicyMode::Open
                    && want
                        .tool_policy
                        .external_direct
                        .iter()
                        .any(|e| *e == shown || server.as_ref() == Some(e)));
            others.insert(OtherTool {
                name: shown,
                origin: if server.is_some() {
                    "other-server"
                } else {
                    "harness-local"
                },
                server,
                declared,
            });
        }
        if differs {
            offered.requests_differing += 1;
        }
        for (canonical, shown) in found {
            offered.boundary.entry(canonical.clone()).or_insert(shown);
        }
    }
    offered.missing = missing.into_iter().collect();
    offered.extra = extra.into_iter().collect();
    offered.renamed = renamed.into_values().collect();
    offered.others = others.into_iter().collect();
    offered.declared_not_offered = want
        .tool_policy
        .harness_local
        .iter()
        .filter(|l| {
            !seen_names.contains(*l) && !seen_names.iter().any(|s| s.ends_with(&format!("/{l}")))
        })
        .cloned()
        .collect();

    let mut asked: Vec<String> = vec![];
    for m in requests.iter().filter_map(|r| r.model.as_ref()) {
        if !asked.contains(m) {
            asked.push(m.clone());
        }
    }
    let model = Model {
        declared: want.declared_model.to_owned(),
        same: (!asked.is_empty()).then(|| asked.iter().all(|a| same_model(want.declared_model, a))),
        asked,
    };
    let checks = vec![
        catalogue_check(&offered, want.catalogue.len()),
        policy_check(&offered, want.tool_policy),
    ];
    Observed {
        offered,
        model,
        checks,
    }
}

fn catalogue_check(o: &Offered, catalogue: usize) -> Check {
    let (grade, detail) = if o.requests_with_tools == 0 {
        (
            Grade::NotExercised,
            format!(
                "the harness offered its model no tools in {} request(s)",
                o.requests
            ),
        )
    } else if o.requests_differing == 0 {
        (
            Grade::Pass,
            format!(
                "the {catalogue} catalogue tool(s) and no other boundary tool, in each of {} request(s) with tools",
                o.requests_with_tools
            ),
        )
    } else {
        let mut parts = vec![];
        if !o.missing.is_empty() {
            parts.push(format!("missing {}", list(&o.missing)));
        }
        if !o.extra.is_empty() {
            parts.push(format!("extra {}", list(&o.extra)));
        }
        (
            Grade::Fail,
            format!(
                "{} in {} of {} request(s) with tools",
                parts.join("; "),
                o.requests_differing,
                o.requests_with_tools
            ),
        )
    };
    Check {
        id: OFFERED_CATALOGUE,
        grade,
        detail,
    }
}

fn policy_check(o: &Offered, policy: &ToolPolicy) -> Check {
    let undeclared: Vec<String> = o
        .others
        .iter()
        .filter(|t| !t.declared)
        .map(|t| match &t.server {
            Some(s) => format!("`{}` (server `{s}`)", t.name),
            None => format!("`{}`", t.name),
        })
        .collect();
    let declared = o.others.iter().filter(|t| t.declared).count();
    let (grade, detail) = if o.requests_with_tools == 0 {
        (
            Grade::NotExercised,
            "the harness offered its model no tools".to_owned(),
        )
    } else if undeclared.is_empty() {
        (
            Grade::Pass,
            format!(
                "{declared} other tool(s) offered, each declared harness-local ({} declared)",
                policy.harness_local.len()
            ),
        )
    } else {
        let mode = match policy.mode {
            PolicyMode::Strict => "strict",
            PolicyMode::Open => "open",
        };
        (
            Grade::Fail,
            format!(
                "misdeclared: the {mode} ToolPolicy names {} harness-local tool(s), but the harness also offered its model {} undeclared: {}",
                policy.harness_local.len(),
                undeclared.len(),
                undeclared.join(", ")
            ),
        )
    };
    Check {
        id: TOOL_POLICY,
        grade,
        detail,
    }
}

/// The `external-direct` check, when the ToolPolicy declares external entries: each entry (an
/// offered tool's name, or a server in the harness's config) was offered to the model as
/// declared, and no call through the boundary named it (`called`: the tools of the turn's
/// recorded calls). `None` without entries.
pub fn external_check(o: &Offered, policy: &ToolPolicy, called: &[String]) -> Option<Check> {
    if policy.external_direct.is_empty() {
        return None;
    }
    let not_offered: Vec<String> = policy
        .external_direct
        .iter()
        .filter(|e| {
            !o.others
                .iter()
                .any(|t| t.name == **e || t.server.as_ref() == Some(*e))
        })
        .cloned()
        .collect();
    let through: Vec<String> = called
        .iter()
        .filter(|c| {
            policy
                .external_direct
                .iter()
                .any(|e| *c == e || c.starts_with(&format!("{e}.")))
        })
        .cloned()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let offered: usize = o
        .others
        .iter()
        .filter(|t| {
            policy
                .external_direct
                .iter()
                .any(|e| t.name == *e || t.server.as_ref() == Some(e))
        })
        .count();
    let (grade, detail) = if o.requests_with_tools == 0 {
        (
            Grade::NotExercised,
            "the harness offered its model no tools".to_owned(),
        )
    } else if not_offered.is_empty() && through.is_empty() {
        (
            Grade::Pass,
            format!(
                "{} declared external entr(ies) ({}) offered to the model as {offered} tool(s), none called through the boundary",
                policy.external_direct.len(),
                list(&policy.external_direct)
            ),
        )
    } else {
        let mut parts = vec![];
        if !not_offered.is_empty() {
            parts.push(format!(
                "declared externalDirect but never offered: {}",
                list(&not_offered)
            ));
        }
        if !through.is_empty() {
            parts.push(format!("called through the boundary: {}", list(&through)));
        }
        (Grade::Fail, parts.join("; "))
    };
    Some(Check {
        id: EXTERNAL_DIRECT,
        grade,
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(model: &str, offered: &[&str]) -> LoggedRequest {
        LoggedRequest {
            api: "anthropic".into(),
            model: Some(model.into()),
            offered: offered
                .iter()
                .map(|n| OfferedTool::from_display("anthropic", n))
                .collect(),
        }
    }

    fn policy(local: &[&str]) -> ToolPolicy {
        ToolPolicy {
            mode: PolicyMode::Strict,
            harness_local: local.iter().map(|s| s.to_string()).collect(),
            external_direct: vec![],
        }
    }

    fn catalogue() -> Vec<String> {
        vec!["files.list".into(), "files.read".into()]
    }

    #[test]
    fn the_catalogue_offered_and_declared_passes() {
        let (cat, pol) = (catalogue(), policy(&["Bash", "Read"]));
        let want = Expectation {
            harness: Harness::ClaudeCode,
            catalogue: &cat,
            portable_names: false,
            tool_policy: &pol,
            other_servers: &[],
            declared_model: "fake-model (scripted)",
        };
        let o = observe(
            &want,
            &[
                req("fake-model", &[]),
                req(
                    "fake-model",
                    &[
                        "Bash",
                        "mcp__sharedos__files_list",
                        "mcp__sharedos__files_read",
                    ],
                ),
            ],
        );
        assert_eq!(o.checks[0].grade, Grade::Pass, "{:?}", o.checks);
        assert_eq!(o.checks[1].grade, Grade::Pass, "{:?}", o.checks);
        assert_eq!(o.offered.requests, 2);
        assert_eq!(o.offered.requests_with_tools, 1);
        assert_eq!(
            o.offered.boundary["files.read"],
            "mcp__sharedos__files_read"
        );
        assert_eq!(o.offered.others.len(), 1);
        assert_eq!(o.offered.others[0].origin, "harness-local");
        assert_eq!(o.offered.declared_not_offered, ["Read"]);
        assert_eq!(o.model.asked, ["fake-model"]);
        assert_eq!(o.model.same, Some(true));
    }

    /// A dropped tool, a stale one, and another server's tools under strict: each named.
    #[test]
    fn missing_extra_and_other_server_tools_fail_naming_them() {
        let (cat, pol) = (catalogue(), policy(&["Bash"]));
        let servers = vec!["time".to_owned()];
        let want = Expectation {
            harness: Harness::ClaudeCode,
            catalogue: &cat,
            portable_names: false,
            tool_policy: &pol,
            other_servers: &servers,
            declared_model: "sharedos scripted-model",
        };
        let o = observe(
            &want,
            &[req(
                "claude-sonnet",
                &[
                    "Bash",
                    "Edit",
                    "mcp__sharedos__files_read",
                    "mcp__sharedos__files_write",
                    "mcp__time__get_current_time",
                ],
            )],
        );
        let c = &o.checks[0];
        assert_eq!(c.grade, Grade::Fail);
        assert_eq!(
            c.detail,
            "missing `files.list`; extra `mcp__sharedos__files_write` in 1 of 1 request(s) with tools"
        );
        let p = &o.checks[1];
        assert_eq!(p.grade, Grade::Fail);
        assert_eq!(
            p.detail,
            "misdeclared: the strict ToolPolicy names 1 harness-local tool(s), but the harness also offered its model 2 undeclared: `Edit`, `mcp__time__get_current_time` (server `time`)"
        );
        let time = o
            .offered
            .others
            .iter()
            .find(|t| t.name == "mcp__time__get_current_time")
            .expect("time");
        assert_eq!(
            (time.origin, time.server.as_deref()),
            ("other-server", Some("time"))
        );
        assert_eq!(o.model.same, Some(false));
    }

    /// Portable names go through the rule as presented; Codex's namespace; a name the rule does
    /// not predict is still found (by the scripted model's matching) and reported renamed.
    #[test]
    fn portable_codex_and_renamed() {
        let (cat, pol) = (catalogue(), policy(&["shell"]));
        let want = Expectation {
            harness: Harness::GeminiCli,
            catalogue: &cat,
            portable_names: true,
            tool_policy: &pol,
            other_servers: &[],
            declared_model: "m",
        };
        let o = observe(
            &want,
            &[req(
                "m",
                &[
                    "shell",
                    "mcp_sharedos_files_list",
                    "mcp_sharedos_files_read",
                ],
            )],
        );
        assert_eq!(o.checks[0].grade, Grade::Pass, "{:?}", o);
        assert!(o.offered.renamed.is_empty());
        // Without portable names Gemini CLI keeps the dot: `_` is a name the rule did not predict.
        let want = Expectation {
            portable_names: false,
            ..want
        };
        let o = observe(
            &want,
            &[req(
                "m",
                &[
                    "shell",
                    "mcp_sharedos_files_list",
                    "mcp_sharedos_files.read",
                ],
            )],
        );
        assert_eq!(o.checks[0].grade, Grade::Pass, "{:?}", o);
        assert_eq!(
            o.offered.renamed,
            [Renamed {
                canonical: "files.list".into(),
                expected: "mcp_sharedos_files.list".into(),
                offered: "mcp_sharedos_files_list".into()
            }]
        );

        let codex = LoggedRequest {
            api: "responses".into(),
            model: Some("fake-model".into()),
            offered: [
                "shell",
                "mcp__sharedos/files_list",
                "mcp__sharedos/files_read",
            ]
            .iter()
            .map(|n| OfferedTool::from_display("responses", n))
            .collect(),
        };
        let want = Expectation {
            harness: Harness::Codex,
            ..want
        };
        let o = observe(&want, &[codex]);
        assert_eq!(o.checks[0].grade, Grade::Pass, "{:?}", o);
        assert_eq!(o.checks[1].grade, Grade::Pass, "{:?}", o);
        assert_eq!(o.offered.boundary["files.list"], "mcp__sharedos/files_list");
    }

    /// The ADR's example: strict with an empty local surface, and the harness offered `Bash`.
    /// (`column run` refuses to open such a turn for a CLI harness; the check says why.)
    #[test]
    fn strict_with_no_local_tools_that_offered_bash_is_misdeclared() {
        let (cat, pol) = (catalogue(), policy(&[]));
        let want = Expectation {
            harness: Harness::ClaudeCode,
            catalogue: &cat,
            portable_names: false,
            tool_policy: &pol,
            other_servers: &[],
            declared_model: "m",
        };
        let o = observe(
            &want,
            &[req(
                "m",
                &[
                    "Bash",
                    "mcp__sharedos__files_list",
                    "mcp__sharedos__files_read",
                ],
            )],
        );
        assert_eq!(o.checks[0].grade, Grade::Pass);
        assert_eq!(
            o.checks[1],
            Check {
                id: TOOL_POLICY,
                grade: Grade::Fail,
                detail: "misdeclared: the strict ToolPolicy names 0 harness-local tool(s), but the harness also offered its model 1 undeclared: `Bash`".into()
            }
        );
    }

    #[test]
    fn no_requests_with_tools_is_not_exercised() {
        let (cat, pol) = (catalogue(), policy(&["Bash"]));
        let want = Expectation {
            harness: Harness::Pi,
            catalogue: &cat,
            portable_names: false,
            tool_policy: &pol,
            other_servers: &[],
            declared_model: "m",
        };
        let o = observe(&want, &[]);
        assert!(o.checks.iter().all(|c| c.grade == Grade::NotExercised));
        assert_eq!(o.model.same, None);
        assert!(same_model("fake/fake-model (note)", "fake-model"));
        assert!(same_model("fake-model", "fake-model"));
        assert!(!same_model("sharedos scripted-model", "claude-sonnet"));
        assert!(!same_model("fake-model-2", "fake-model"));
    }
}
