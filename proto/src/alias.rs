//! Presentation names: what each harness shows the model for a published tool (aliases), and
//! portable names for clients that cannot carry a dot.
//!
//! Aliases are diagnostics only: they are recorded on the bridge, never on a call, so no alias
//! can reach an authorization decision. Portable names are an opt-in, injective mapping over one
//! catalogue that the shim maps back to the canonical name before the call is issued.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::name::ToolName;

/// The longest tool name Claude Code, Codex and pi-mcp-adapter accept (and the one opencode's
/// OpenAI-compatible providers pass on: opencode itself neither cuts nor checks a name).
pub const HARNESS_NAME_MAX: usize = 64;

/// Qwen Code's longest provider tool name (`MAX_TOOL_NAME_LENGTH` in its
/// `tool-name-utils.ts`, 0.24.4): a longer or unsafe name is cut and given a hash suffix.
pub const QWEN_NAME_MAX: usize = 63;

/// The MCP server name SharedOS uses in every harness config.
pub const SERVER_NAME: &str = "sharedos";

/// A harness whose naming is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Harness {
    ClaudeCode,
    Codex,
    Pi,
    /// DeepSeek's dsh (config `cordis.yml`). Its naming is not measured here: no alias.
    Cordis,
    /// Qwen Code (`.qwen/settings.json`).
    QwenCode,
    /// opencode (`opencode.json`, servers under `mcp`).
    Opencode,
    /// Gemini CLI (`~/.gemini/settings.json`).
    GeminiCli,
    /// Cline's CLI (`~/.cline/data/settings/cline_mcp_settings.json`).
    Cline,
}

impl Harness {
    pub const ALL: [Harness; 8] = [
        Harness::ClaudeCode,
        Harness::Codex,
        Harness::Pi,
        Harness::Cordis,
        Harness::QwenCode,
        Harness::Opencode,
        Harness::GeminiCli,
        Harness::Cline,
    ];

    /// Parses `claude-code`, `codex`, `pi`, `cordis`, `qwen-code`, `opencode`, `gemini-cli`
    /// (also `claude`, `dsh`, `qwen`, `opencode-ai`, `gemini`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "claude-code" | "claude" => Some(Harness::ClaudeCode),
            "codex" => Some(Harness::Codex),
            "pi" => Some(Harness::Pi),
            "cordis" | "dsh" => Some(Harness::Cordis),
            "qwen-code" | "qwen" => Some(Harness::QwenCode),
            "opencode" | "opencode-ai" => Some(Harness::Opencode),
            "gemini-cli" | "gemini" => Some(Harness::GeminiCli),
            "cline" => Some(Harness::Cline),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Harness::ClaudeCode => "claude-code",
            Harness::Codex => "codex",
            Harness::Pi => "pi",
            Harness::Cordis => "cordis",
            Harness::QwenCode => "qwen-code",
            Harness::Opencode => "opencode",
            Harness::GeminiCli => "gemini-cli",
            Harness::Cline => "cline",
        }
    }

    /// The name the model sees for `tool` on MCP server `server`, as measured
    /// (`shared/notes/harnesses.md`): characters outside `[A-Za-z0-9_-]` become `_`.
    /// For Codex this is the function name inside namespace `mcp__<server>`.
    pub fn alias(self, server: &str, tool: &str) -> Option<String> {
        let flat = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        match self {
            Harness::ClaudeCode => Some(format!("mcp__{}__{}", flat(server), flat(tool))),
            Harness::Codex => Some(flat(tool)),
            Harness::Pi => Some(format!("{}_{}", flat(server), flat(tool))),
            Harness::Cordis => None,
            Harness::QwenCode => Some(qwen_name(&format!("mcp__{server}__{tool}"))),
            // opencode 1.18.33 (`mcp` module): `sanitize(server) + "_" + sanitize(tool)`, with
            // sanitize replacing `[^a-zA-Z0-9_-]` by `_`; the tools of one server are collected
            // with `Object.fromEntries`, so of two tools with one name the later listed wins.
            Harness::Opencode => Some(format!("{}_{}", flat(server), flat(tool))),
            Harness::GeminiCli => Some(gemini_name(&format!("{server}_{tool}"))),
            Harness::Cline => Some(cline_name(server, tool)),
        }
    }

    /// The Codex namespace for a server (`mcp__sharedos`).
    pub fn codex_namespace(server: &str) -> String {
        format!("mcp__{server}")
    }
}

/// Qwen Code 0.24.4's `normalizeToolNameForProvider`: a name of at most [`QWEN_NAME_MAX`]
/// characters matching `^[A-Za-z][A-Za-z0-9_-]*$` is kept; any other has each character outside
/// `[A-Za-z0-9_-]` replaced by `_` (and `tool_` put in front if it does not start with a letter),
/// is cut to leave room, and ends in `_` + the base-36 FNV-1a hash of the original name (7
/// digits at least). So `files.read` on server `sharedos` is `mcp__sharedos__files_read_<hash>`.
pub fn qwen_name(name: &str) -> String {
    let safe = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if safe && name.chars().count() <= QWEN_NAME_MAX {
        return name.to_owned();
    }
    let mut sanitized: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if !sanitized.starts_with(|c: char| c.is_ascii_alphabetic()) {
        sanitized.insert_str(0, "tool_");
    }
    // FNV-1a over UTF-16 code units, as `charCodeAt` sees them.
    let mut hash: u32 = 2_166_136_261;
    for unit in name.encode_utf16() {
        hash = (hash ^ u32::from(unit)).wrapping_mul(16_777_619);
    }
    let mut digits = Vec::new();
    let mut h = hash;
    loop {
        let d = (h % 36) as u8;
        digits.push(if d < 10 { b'0' + d } else { b'a' + d - 10 });
        h /= 36;
        if h == 0 {
            break;
        }
    }
    while digits.len() < 7 {
        digits.push(b'0');
    }
    digits.reverse();
    let suffix = format!("_{}", String::from_utf8_lossy(&digits));
    let keep = QWEN_NAME_MAX.saturating_sub(suffix.len());
    let mut out: String = sanitized.chars().take(keep).collect();
    out.push_str(&suffix);
    out
}

/// Cline CLI 3.0.65's MCP tool name (`@cline/core`, the default `nameTransform`): the name
/// `<server>__<tool>` is kept when it has only `[A-Za-z0-9_-]` and at most [`HARNESS_NAME_MAX`]
/// characters; any other has each run of other characters replaced by one `_`, is cut to 55
/// characters (`mcp_tool` if nothing is left) and ends in `_` + the first 8 hex digits of the
/// SHA-1 of the original name. So every dotted tool gets a suffix: `files.read` on server
/// `sharedos` is `sharedos__files_read_<hash>`.
pub fn cline_name(server: &str, tool: &str) -> String {
    use sha1::Digest;
    let name = format!("{server}__{tool}");
    let mut sanitized = String::with_capacity(name.len());
    let mut in_run = false;
    for c in name.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
            sanitized.push(c);
            in_run = false;
        } else if !in_run {
            sanitized.push('_');
            in_run = true;
        }
    }
    if sanitized == name && name.encode_utf16().count() <= HARNESS_NAME_MAX {
        return name;
    }
    let digest = sha1::Sha1::digest(name.as_bytes());
    let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    // 64 - 1 (`_`) - 8 (hash). Every character left is ASCII, so bytes are characters.
    let head: String = sanitized.chars().take(HARNESS_NAME_MAX - 1 - 8).collect();
    let head = if head.is_empty() {
        "mcp_tool".to_owned()
    } else {
        head
    };
    format!("{head}_{hex}")
}

/// Gemini CLI 0.61.0's `generateValidName` (packages/core, `mcp-tool`): `mcp_` in front (unless
/// already there), each character outside `[A-Za-z0-9_.:-]` replaced by `_` (so a `.` is kept),
/// `_` in front if it does not start with a letter or `_`, and a name over 63 characters cut to
/// its first 30 and last 30 around `...`. So `files.read` on server `sharedos` is
/// `mcp_sharedos_files.read`.
pub fn gemini_name(name: &str) -> String {
    let mut out: String = if name.starts_with("mcp_") {
        name.to_owned()
    } else {
        format!("mcp_{name}")
    };
    out = out
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if !out.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        out.insert(0, '_');
    }
    // UTF-16 length and slices in the CLI; every character here is ASCII by now.
    if out.len() > HARNESS_NAME_MAX - 1 {
        out = format!("{}...{}", &out[..30], &out[out.len() - 30..]);
    }
    out
}

/// Aliases of a catalogue for one harness, and the names over the harness's limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AliasReport {
    /// The namespace the aliases live in, where the harness has one (Codex: `mcp__sharedos`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// canonical name → alias.
    pub aliases: BTreeMap<String, String>,
    /// Human-readable problems (an alias over 64 characters, two tools with one alias).
    pub problems: Vec<String>,
}

/// Computes a harness's aliases for a catalogue and what it will not carry.
pub fn aliases<'a>(
    harness: Harness,
    server: &str,
    tools: impl IntoIterator<Item = &'a ToolName>,
) -> AliasReport {
    let mut report = AliasReport {
        namespace: (harness == Harness::Codex).then(|| Harness::codex_namespace(server)),
        ..AliasReport::default()
    };
    let mut seen: HashMap<String, String> = HashMap::new();
    for tool in tools {
        let Some(alias) = harness.alias(server, tool.as_str()) else {
            continue;
        };
        let shown_len = match harness {
            Harness::Codex => alias.len().max(Harness::codex_namespace(server).len()),
            _ => alias.len(),
        };
        let limit = match harness {
            Harness::QwenCode => QWEN_NAME_MAX,
            _ => HARNESS_NAME_MAX,
        };
        if shown_len > limit {
            report.problems.push(format!(
                "{}: `{tool}` is presented as `{alias}` ({} characters), over the {limit}-character limit",
                harness.as_str(),
                alias.len()
            ));
        }
        if let Some(other) = seen.insert(alias.clone(), tool.to_string()) {
            report.problems.push(format!(
                "{}: `{other}` and `{tool}` are both presented as `{alias}`",
                harness.as_str()
            ));
        }
        report.aliases.insert(tool.to_string(), alias);
    }
    report
}

/// The portable form of a tool name: `.` becomes `_`.
pub fn portable_name(tool: &ToolName) -> String {
    tool.as_str().replace('.', "_")
}

/// Two tools of one catalogue would share a portable name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("portable names collide: `{first}` and `{second}` both become `{portable}`")]
pub struct PortableCollision {
    pub first: String,
    pub second: String,
    pub portable: String,
}

/// An injective portable ↔ canonical mapping over one catalogue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortableNames {
    to_canonical: HashMap<String, String>,
    to_portable: HashMap<String, String>,
}

impl PortableNames {
    pub fn new<'a>(
        tools: impl IntoIterator<Item = &'a ToolName>,
    ) -> Result<Self, PortableCollision> {
        let mut map = PortableNames::default();
        let mut names: Vec<&ToolName> = tools.into_iter().collect();
        names.sort();
        for tool in names {
            let portable = portable_name(tool);
            if let Some(first) = map.to_canonical.get(&portable) {
                return Err(PortableCollision {
                    first: first.clone(),
                    second: tool.to_string(),
                    portable,
                });
            }
            map.to_canonical.insert(portable.clone(), tool.to_string());
            map.to_portable.insert(tool.to_string(), portable);
        }
        Ok(map)
    }

    pub fn portable<'a>(&'a self, canonical: &'a str) -> &'a str {
        self.to_portable
            .get(canonical)
            .map_or(canonical, String::as_str)
    }

    /// The canonical name of a portable one; any other string is returned unchanged (so a guess
    /// still reaches the kernel as sent).
    pub fn canonical<'a>(&'a self, sent: &'a str) -> &'a str {
        self.to_canonical.get(sent).map_or(sent, String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(v: &[&str]) -> Vec<ToolName> {
        v.iter().map(|n| ToolName::new(n).expect("valid")).collect()
    }

    #[test]
    fn measured_aliases() {
        assert_eq!(
            Harness::ClaudeCode
                .alias("sharedos", "files.read")
                .as_deref(),
            Some("mcp__sharedos__files_read")
        );
        assert_eq!(
            Harness::Codex.alias("sharedos", "files.read").as_deref(),
            Some("files_read")
        );
        assert_eq!(Harness::codex_namespace("sharedos"), "mcp__sharedos");
        assert_eq!(
            Harness::Pi.alias("sharedos", "files.read").as_deref(),
            Some("sharedos_files_read")
        );
        assert_eq!(Harness::Cordis.alias("sharedos", "files.read"), None);
    }

    /// Expected values printed by Qwen Code 0.24.4's own `normalizeToolNameForProvider`
    /// (chunks/chunk-WZAD4ZNJ.js) run under Node 22.
    #[test]
    fn qwen_names_match_the_cli() {
        assert_eq!(
            Harness::QwenCode.alias("sharedos", "files.read").as_deref(),
            Some("mcp__sharedos__files_read_1rtbejb")
        );
        assert_eq!(
            qwen_name("mcp__sharedos__files_read"),
            "mcp__sharedos__files_read"
        );
        let long = qwen_name(&format!("mcp__sharedos__ns.{}", "x".repeat(60)));
        assert_eq!(
            long,
            "mcp__sharedos__ns_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx_1vuqlbz"
        );
        assert_eq!(long.len(), QWEN_NAME_MAX);
        assert_eq!(
            qwen_name("mcp__sharedos__a.b"),
            "mcp__sharedos__a_b_030gm4f"
        );
        // The hash keeps `a.b` and `a_b` apart: no collision report.
        let r = aliases(Harness::QwenCode, SERVER_NAME, &names(&["a.b", "a_b"]));
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(Harness::parse("qwen"), Some(Harness::QwenCode));
    }

    /// Cline 3.0.65's rule, checked against the same rule run in Node (its `crypto` SHA-1):
    /// dotted names get a hash suffix, a clean one is kept, a long one is cut to 64.
    #[test]
    fn cline_names_match_the_cli() {
        assert_eq!(
            Harness::Cline.alias("sharedos", "files.read").as_deref(),
            Some("sharedos__files_read_5f40265d")
        );
        assert_eq!(
            cline_name("sharedos", "a_namespace_near_limits.get_current_time"),
            "sharedos__a_namespace_near_limits_get_current_time_2ece13b0"
        );
        assert_eq!(
            cline_name("sharedos", "get_current_time"),
            "sharedos__get_current_time"
        );
        assert_eq!(cline_name("sharedos", "a..b"), "sharedos__a_b_9fb48790");
        let long = cline_name("sharedos", &"x".repeat(70));
        assert_eq!(long, format!("sharedos__{}_16b8d117", "x".repeat(45)));
        assert_eq!(long.len(), HARNESS_NAME_MAX);
        let r = aliases(Harness::Cline, SERVER_NAME, &names(&["a.b", "a_b"]));
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(Harness::parse("cline"), Some(Harness::Cline));
        assert_eq!(Harness::Cline.as_str(), "cline");
    }

    /// opencode 1.18.33 offered `sharedos_files_read` for `files.read` (measured in the interop
    /// column from the scripted model's log); it cuts nothing, and `a.b` / `a_b` collide.
    #[test]
    fn opencode_names_match_the_cli() {
        assert_eq!(
            Harness::Opencode.alias("sharedos", "files.read").as_deref(),
            Some("sharedos_files_read")
        );
        assert_eq!(Harness::parse("opencode-ai"), Some(Harness::Opencode));
        assert_eq!(Harness::Opencode.as_str(), "opencode");
        let long = format!("ns.{}", "x".repeat(60));
        let r = aliases(
            Harness::Opencode,
            SERVER_NAME,
            &names(&[&long, "a.b", "a_b"]),
        );
        assert_eq!(r.problems.len(), 2, "{:?}", r.problems);
        assert!(r.problems.iter().any(|p| p.contains("64-character")));
        assert!(
            r.problems
                .iter()
                .any(|p| p.contains("`a.b`") && p.contains("`a_b`") && p.contains("sharedos_a_b"))
        );
    }

    /// Gemini CLI 0.61.0 offered and called `mcp_sharedos_files.read` for `files.read`
    /// (measured in the interop column from the scripted model's log); the cut follows its
    /// `generateValidName`.
    #[test]
    fn gemini_names_match_the_cli() {
        assert_eq!(
            Harness::GeminiCli
                .alias("sharedos", "files.read")
                .as_deref(),
            Some("mcp_sharedos_files.read")
        );
        assert_eq!(Harness::parse("gemini"), Some(Harness::GeminiCli));
        let long = gemini_name(&format!("sharedos_ns.{}", "x".repeat(60)));
        assert_eq!(
            long,
            format!("mcp_sharedos_ns.{}...{}", "x".repeat(14), "x".repeat(30))
        );
        assert_eq!(long.len(), 63);
        // A dot is kept: `a.b` and `a_b` stay apart.
        let r = aliases(Harness::GeminiCli, SERVER_NAME, &names(&["a.b", "a_b"]));
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }

    #[test]
    fn long_and_colliding_aliases_are_reported() {
        let long = format!("ns.{}", "x".repeat(60));
        let tools = names(&[&long, "a.b", "a_b"]);
        let r = aliases(Harness::ClaudeCode, SERVER_NAME, &tools);
        assert_eq!(r.problems.len(), 2, "{:?}", r.problems);
        assert!(r.problems.iter().any(|p| p.contains("64-character")));
        assert!(
            r.problems
                .iter()
                .any(|p| p.contains("`a.b`") && p.contains("`a_b`"))
        );
    }

    #[test]
    fn portable_names_round_trip_and_collisions_are_refused() {
        let tools = names(&["files.read", "files.list", "github.search"]);
        let map = PortableNames::new(&tools).expect("injective");
        assert_eq!(map.portable("files.read"), "files_read");
        assert_eq!(map.canonical("files_read"), "files.read");
        assert_eq!(map.canonical("files.delete"), "files.delete");
        let err = PortableNames::new(&names(&["a.b", "a_b"])).expect_err("collision");
        assert_eq!(err.portable, "a_b");
    }

    proptest! {
        #[test]
        fn portable_mapping_is_injective_or_refused(raw in prop::collection::btree_set("[a-c_.]{1,4}", 0..12)) {
            let tools: Vec<ToolName> = raw.iter().map(|n| ToolName::new(n).expect("valid")).collect();
            if let Ok(map) = PortableNames::new(&tools) {
                for t in &tools {
                    let p = map.portable(t.as_str());
                    prop_assert!(!p.contains('.'));
                    prop_assert_eq!(map.canonical(p), t.as_str());
                }
            }
        }
    }
}
