//! Harness MCP configs: the file each harness reads to spawn `sharedos-mcp-shim` for one turn.
//!
//! Owns rendering (Claude Code `--mcp-config` JSON, Codex `config.toml`, pi-mcp-adapter
//! `.mcp.json`, Qwen Code `settings.json`, opencode `opencode.json`, dsh `cordis.yml`) and writing
//! them 0600 (they hold, or point at, the turn's bearer token). An existing Claude Code, Codex, pi,
//! Qwen Code, opencode, Gemini CLI or dsh file is merged: only the `sharedos` server entry is
//! replaced (dsh's YAML line by line, its comments kept; see [`merge_cordis`]). It never
//! decides anything about the turn.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sharedos_ipc::runtime;
use sharedos_proto::alias::{Harness, SERVER_NAME};

pub use sharedos_ipc::private_file::{FileOwner, PrivateFileError, write_private};

#[derive(Debug, thiserror::Error)]
pub enum HarnessConfigError {
    #[error(
        "unknown config format `{0}`: use claude-code, codex, pi, cordis, qwen-code, opencode, gemini-cli or cline"
    )]
    Format(String),
    #[error("existing `{path}` is not valid {format}: {detail}")]
    Existing {
        path: String,
        format: &'static str,
        detail: String,
    },
    #[error("refused to write `{path}`: {detail}")]
    Refused { path: String, detail: String },
    #[error(transparent)]
    File(#[from] PrivateFileError),
    #[error("cannot write `{path}`: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// How the shim gets its token.
#[derive(Debug, Clone)]
pub enum TokenSource {
    /// In the config's env (`SHAREDOS_TURN_TOKEN`).
    Env(String),
    /// In a file the config names (`--turn-token-file`).
    File(PathBuf),
}

/// What goes into a harness config.
#[derive(Debug, Clone)]
pub struct ShimLaunch {
    pub shim: PathBuf,
    pub bridge: PathBuf,
    pub token: TokenSource,
    /// The uid the broker runs as (`SHAREDOS_BROKER_UID`): the shim gives its token to no
    /// listener of another uid.
    pub broker_uid: Option<u32>,
}

impl ShimLaunch {
    fn args(&self) -> Vec<String> {
        match &self.token {
            TokenSource::File(p) => vec!["--turn-token-file".into(), p.display().to_string()],
            TokenSource::Env(_) => vec![],
        }
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![(runtime::BROKER_ENV, self.bridge.display().to_string())];
        if let Some(uid) = self.broker_uid {
            env.push((runtime::BROKER_UID_ENV, uid.to_string()));
        }
        if let TokenSource::Env(t) = &self.token {
            env.push((runtime::TOKEN_ENV, t.clone()));
        }
        env
    }

    fn env_json(&self) -> Value {
        Value::Object(
            self.env()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), json!(v)))
                .collect(),
        )
    }
}

pub fn parse_format(s: &str) -> Result<Harness, HarnessConfigError> {
    Harness::parse(s).ok_or_else(|| HarnessConfigError::Format(s.to_owned()))
}

fn merge_json(
    existing: Option<&str>,
    path: &Path,
    entry: Value,
) -> Result<String, HarnessConfigError> {
    merge_json_under(existing, path, "mcpServers", entry)
}

/// `entry` as the `sharedos` server under `key` of the JSON object in `existing` (or a new one),
/// keeping everything else.
fn merge_json_under(
    existing: Option<&str>,
    path: &Path,
    key: &str,
    entry: Value,
) -> Result<String, HarnessConfigError> {
    let mut doc = match existing {
        Some(text) if !text.trim().is_empty() => {
            serde_json::from_str::<Value>(text).map_err(|e| HarnessConfigError::Existing {
                path: path.display().to_string(),
                format: "JSON",
                detail: e.to_string(),
            })?
        }
        _ => json!({}),
    };
    let Some(obj) = doc.as_object_mut() else {
        return Err(HarnessConfigError::Existing {
            path: path.display().to_string(),
            format: "JSON",
            detail: "the top level is not an object".into(),
        });
    };
    let servers = obj.entry(key).or_insert_with(|| json!({}));
    if !servers.is_object() {
        *servers = json!({});
    }
    servers[SERVER_NAME] = entry;
    let mut text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    text.push('\n');
    Ok(text)
}

/// Renders the config for `format`, merged into `existing` where the format allows.
pub fn render(
    format: Harness,
    launch: &ShimLaunch,
    existing: Option<&str>,
    path: &Path,
) -> Result<String, HarnessConfigError> {
    let shim = launch.shim.display().to_string();
    match format {
        Harness::ClaudeCode => merge_json(
            existing,
            path,
            json!({"type": "stdio", "command": shim, "args": launch.args(), "env": launch.env_json()}),
        ),
        Harness::Pi => merge_json(
            existing,
            path,
            json!({"command": shim, "args": launch.args(), "env": launch.env_json(), "directTools": true}),
        ),
        // Qwen Code `.qwen/settings.json` (project) or `~/.qwen/settings.json`: `trust` skips its
        // per-call confirmation for this server only (the boundary decides; a prompt in `-p`
        // mode would refuse every call).
        // Gemini CLI reads the same shape (Qwen Code is its fork); it starts MCP servers only
        // from a trusted folder, and 0.61 ignored a project `.gemini/settings.json` in `-p` mode
        // where `~/.gemini/settings.json` worked.
        Harness::QwenCode | Harness::GeminiCli => merge_json(
            existing,
            path,
            json!({"command": shim, "args": launch.args(), "env": launch.env_json(), "trust": true}),
        ),
        // Cline's `~/.cline/data/settings/cline_mcp_settings.json` (or `$CLINE_MCP_SETTINGS_PATH`):
        // `mcpServers` as Claude Code's. `timeout` (seconds) because Cline's default of 3 s for
        // `initialize` skips a server that starts slowly (measured under load: "timed out after
        // 3s", the run goes on without its tools). `--auto-approve` (its default) asks nothing.
        Harness::Cline => merge_json(
            existing,
            path,
            json!({"type": "stdio", "command": shim, "args": launch.args(), "env": launch.env_json(), "timeout": 60}),
        ),
        // opencode `opencode.json` (project) or `~/.config/opencode/opencode.json`: servers under
        // `mcp`, a local one as `{type: "local", command: [program, args...], environment}`.
        // opencode asks no confirmation for MCP tools unless the user's `permission` says so.
        Harness::Opencode => {
            let mut command = vec![shim];
            command.extend(launch.args());
            merge_json_under(
                existing,
                path,
                "mcp",
                json!({"type": "local", "command": command, "environment": launch.env_json(), "enabled": true}),
            )
        }
        Harness::Codex => {
            let mut doc = match existing {
                Some(text) => text.parse::<toml_edit::DocumentMut>().map_err(|e| {
                    HarnessConfigError::Existing {
                        path: path.display().to_string(),
                        format: "TOML",
                        detail: e.to_string(),
                    }
                })?,
                None => toml_edit::DocumentMut::new(),
            };
            let mut server = toml_edit::Table::new();
            server["command"] = toml_edit::value(shim);
            let mut args = toml_edit::Array::new();
            for a in launch.args() {
                args.push(a);
            }
            server["args"] = toml_edit::value(args);
            let mut env = toml_edit::InlineTable::new();
            for (k, v) in launch.env() {
                env.insert(k, v.into());
            }
            server["env"] = toml_edit::value(env);
            // Without `required`, Codex may send the first model request before the shim has
            // listed its tools; without `approve`, `approval_policy = "never"` refuses every call.
            server["required"] = toml_edit::value(true);
            server["startup_timeout_sec"] = toml_edit::value(30);
            server["tool_timeout_sec"] = toml_edit::value(120);
            server["default_tools_approval_mode"] = toml_edit::value("approve");
            if !doc.contains_key("mcp_servers") {
                let mut t = toml_edit::Table::new();
                t.set_implicit(true);
                doc["mcp_servers"] = toml_edit::Item::Table(t);
            }
            doc["mcp_servers"][SERVER_NAME] = toml_edit::Item::Table(server);
            Ok(doc.to_string())
        }
        Harness::Cordis => {
            let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
            // The `sharedos` entry's lines, without indentation (the merge indents them).
            let mut entry = vec![
                format!("{SERVER_NAME}:"),
                "  transport: stdio".to_owned(),
                format!("  command: {}", q(&shim)),
                format!(
                    "  args: [{}]",
                    launch
                        .args()
                        .iter()
                        .map(|a| q(a))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                "  env:".to_owned(),
            ];
            for (k, v) in launch.env() {
                entry.push(format!("    {k}: {}", q(&v)));
            }
            match existing {
                Some(text) if !text.trim().is_empty() => merge_cordis(text, path, &entry),
                _ => {
                    let mut y = String::from(
                        "# dsh (DeepSeek Harness) cordis.yml: SharedOS as a stdio MCP server.\n\
                         # UNTESTED: the dsh CLI is not on any registry reachable where this was built; this\n\
                         # follows the generic MCP stdio server shape (command, args, env).\n\
                         mcp_servers:\n",
                    );
                    for l in &entry {
                        y.push_str(&format!("  {l}\n"));
                    }
                    Ok(y)
                }
            }
        }
    }
}

/// Merges the `sharedos` entry (`entry`: its lines, unindented) into an existing dsh `cordis.yml`,
/// keeping every other line as it is (other servers, other keys, comments, blank lines). No YAML
/// library in this workspace keeps comments, so this edits lines, and only a layout it can read
/// unambiguously: a top-level block mapping whose `mcp_servers:` (at column 0, nothing after it
/// but a comment) holds a block mapping. The `sharedos:` entry at its children's indentation is
/// replaced (with its own lines, comments inside it included), else the entry is added after the
/// last server; without `mcp_servers:` the block is appended. Anything else (tabs, flow style
/// `mcp_servers: {...}`, several documents, an entry indented unlike its siblings) is refused
/// naming the file and the line, never guessed at.
fn merge_cordis(text: &str, path: &Path, entry: &[String]) -> Result<String, HarnessConfigError> {
    let refuse = |line: usize, detail: &str| HarnessConfigError::Existing {
        path: path.display().to_string(),
        format: "YAML (as `--write-config cordis` merges it)",
        detail: format!("line {line}: {detail}"),
    };
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start_matches(' ').len();
    let is_blank_or_comment = |l: &str| {
        let t = l.trim();
        t.is_empty() || t.starts_with('#')
    };
    let mut servers_at: Option<usize> = None;
    let mut content_seen = false;
    for (i, l) in lines.iter().enumerate() {
        if l.contains('\t') {
            return Err(refuse(
                i + 1,
                "a tab in the indentation or a value: indent with spaces",
            ));
        }
        if l.starts_with("---") || l.starts_with("...") {
            if content_seen {
                return Err(refuse(
                    i + 1,
                    "a second YAML document: keep cordis.yml to one",
                ));
            }
            continue;
        }
        if is_blank_or_comment(l) {
            continue;
        }
        content_seen = true;
        if indent(l) == 0 {
            let key = l.split('#').next().unwrap_or("").trim_end();
            if key == "mcp_servers:" {
                if servers_at.is_some() {
                    return Err(refuse(i + 1, "`mcp_servers` appears twice"));
                }
                servers_at = Some(i);
            } else if key.starts_with("mcp_servers:") {
                return Err(refuse(
                    i + 1,
                    "`mcp_servers` is written inline (flow style): write it as a block mapping, one server per indented key",
                ));
            } else if key.starts_with(['{', '[', '-']) {
                return Err(refuse(i + 1, "the top level is not a block mapping"));
            }
        }
    }
    let mut out: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
    let Some(start) = servers_at else {
        if out.last().is_some_and(|l| !l.trim().is_empty()) {
            out.push(String::new());
        }
        out.push("mcp_servers:".to_owned());
        out.extend(entry.iter().map(|l| format!("  {l}")));
        return Ok(out.join("\n") + "\n");
    };
    // The block: the lines after `mcp_servers:` until the next one at column 0 (blank lines and
    // comments inside it belong to it; trailing ones, to whatever follows).
    let mut end = start + 1;
    let mut last_content = start;
    while end < lines.len() {
        let l = lines[end];
        if !is_blank_or_comment(l) {
            if indent(l) == 0 {
                break;
            }
            last_content = end;
        }
        end += 1;
    }
    let children: Vec<usize> = (start + 1..=last_content)
        .filter(|&i| !is_blank_or_comment(lines[i]))
        .collect();
    let child_indent = children.first().map_or(2, |&i| indent(lines[i]));
    // Every entry at the children's indentation must be a key (`name:` or `name: value`).
    let mut ours: Option<usize> = None;
    for &i in &children {
        let l = lines[i];
        let n = indent(l);
        if n < child_indent {
            return Err(refuse(
                i + 1,
                "indented less than the first server under `mcp_servers`",
            ));
        }
        if n == child_indent {
            let t = l.trim_start();
            if t.starts_with('-') {
                return Err(refuse(
                    i + 1,
                    "`mcp_servers` holds a list: it must be a mapping of server names",
                ));
            }
            let key = t
                .split(':')
                .next()
                .unwrap_or("")
                .trim()
                .trim_matches(['"', '\'']);
            if key == SERVER_NAME {
                if ours.is_some() {
                    return Err(refuse(
                        i + 1,
                        "`sharedos` appears twice under `mcp_servers`",
                    ));
                }
                ours = Some(i);
            }
        }
    }
    // The entry at the children's indentation, nested by the same step (its lines step by 2).
    let block: Vec<String> = entry
        .iter()
        .map(|l| {
            let lead = l.len() - l.trim_start_matches(' ').len();
            let depth = 1 + lead / 2;
            format!("{}{}", " ".repeat(depth * child_indent), l.trim_start())
        })
        .collect();
    match ours {
        Some(first) => {
            // Its lines: up to the next key at the children's indentation (or the block's end).
            let next = children
                .iter()
                .copied()
                .find(|&i| i > first && indent(lines[i]) == child_indent)
                .unwrap_or(last_content + 1);
            // Keep comments and blank lines just before the next key (they describe it).
            let mut stop = next;
            while stop > first + 1 && is_blank_or_comment(lines[stop - 1]) {
                stop -= 1;
            }
            out.splice(first..stop, block);
        }
        None => {
            out.splice(last_content + 1..last_content + 1, block);
        }
    }
    Ok(out.join("\n") + "\n")
}

/// The keys under a `cordis.yml`'s block `mcp_servers:` (the layout [`merge_cordis`] reads).
fn cordis_servers(text: &str) -> Vec<String> {
    let indent = |l: &str| l.len() - l.trim_start_matches(' ').len();
    let mut names = vec![];
    let mut inside = false;
    let mut child: Option<usize> = None;
    for l in text.lines() {
        let t = l.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if indent(l) == 0 {
            inside = l.split('#').next().unwrap_or("").trim_end() == "mcp_servers:";
            continue;
        }
        if inside
            && *child.get_or_insert(indent(l)) == indent(l)
            && let Some((key, _)) = t.split_once(':')
        {
            names.push(key.trim().trim_matches(['"', '\'']).to_owned());
        }
    }
    names
}

/// The MCP servers a rendered config of `format` names besides `sharedos`, sorted: the keys
/// under `mcpServers` (`mcp` for opencode, `mcp_servers` for Codex). A text that does not parse
/// names none (the harness would not start those servers either); for dsh's `cordis.yml`, the
/// keys under its block `mcp_servers:`.
pub fn other_servers(format: Harness, text: &str) -> Vec<String> {
    let mut names: Vec<String> = match format {
        Harness::Cordis => cordis_servers(text),
        Harness::Codex => text
            .parse::<toml_edit::DocumentMut>()
            .ok()
            .and_then(|doc| {
                doc.get("mcp_servers")
                    .and_then(toml_edit::Item::as_table_like)
                    .map(|t| t.iter().map(|(k, _)| k.to_owned()).collect())
            })
            .unwrap_or_default(),
        _ => {
            let key = if format == Harness::Opencode {
                "mcp"
            } else {
                "mcpServers"
            };
            serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|doc| {
                    doc.get(key)
                        .and_then(Value::as_object)
                        .map(|o| o.keys().cloned().collect())
                })
                .unwrap_or_default()
        }
    };
    names.retain(|n| n != SERVER_NAME);
    names.sort();
    names
}

/// Reads an existing config to merge into, never through a link; `None` when there is none.
fn read_existing(path: &Path) -> Result<Option<String>, HarnessConfigError> {
    use rustix::fs::{Mode, OFlags};
    match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            let st = rustix::fs::fstat(&fd).map_err(|e| HarnessConfigError::Write {
                path: path.display().to_string(),
                source: e.into(),
            })?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
            {
                return Err(HarnessConfigError::Refused {
                    path: path.display().to_string(),
                    detail: "it exists and is not a regular file".into(),
                });
            }
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut text).map_err(
                |e| HarnessConfigError::Existing {
                    path: path.display().to_string(),
                    format: "text",
                    detail: e.to_string(),
                },
            )?;
            Ok(Some(text))
        }
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(rustix::io::Errno::LOOP) => Err(HarnessConfigError::Refused {
            path: path.display().to_string(),
            detail: "it is a symbolic link: write to the file itself".into(),
        }),
        Err(e) => Err(HarnessConfigError::Write {
            path: path.display().to_string(),
            source: e.into(),
        }),
    }
}

/// Renders and writes the config for `format` at `path` (merging an existing file).
pub fn write(
    format: Harness,
    launch: &ShimLaunch,
    path: &Path,
    owner: Option<FileOwner>,
) -> Result<(), HarnessConfigError> {
    let existing = read_existing(path)?;
    let text = render(format, launch, existing.as_deref(), path)?;
    Ok(write_private(path, &text, owner)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(token: TokenSource) -> ShimLaunch {
        ShimLaunch {
            shim: "/opt/sharedos/bin/sharedos-mcp-shim".into(),
            bridge: "/run/sharedos/bridge.sock".into(),
            token,
            broker_uid: Some(1042),
        }
    }

    /// The servers a merged config names besides `sharedos`, per format.
    #[test]
    fn other_servers_of_each_format() {
        let l = launch(TokenSource::Env("T".into()));
        let p = Path::new("c");
        for (format, existing) in [
            (
                Harness::ClaudeCode,
                r#"{"mcpServers": {"time": {}, "a": {}}}"#,
            ),
            (
                Harness::QwenCode,
                r#"{"mcpServers": {"time": {}, "a": {}}}"#,
            ),
            (Harness::Opencode, r#"{"mcp": {"time": {}, "a": {}}}"#),
            (
                Harness::Codex,
                "[mcp_servers.time]\ncommand = \"t\"\n[mcp_servers.a]\n",
            ),
        ] {
            let text = render(format, &l, Some(existing), p).expect("render");
            assert_eq!(other_servers(format, &text), ["a", "time"], "{format:?}");
            let alone = render(format, &l, None, p).expect("render");
            assert!(other_servers(format, &alone).is_empty(), "{format:?}");
        }
        // opencode's servers are under `mcp`, not `mcpServers`.
        assert!(other_servers(Harness::Opencode, r#"{"mcpServers": {"x": {}}}"#).is_empty());
        assert!(other_servers(Harness::Pi, "not json").is_empty());
        assert_eq!(
            other_servers(
                Harness::Cordis,
                "# c\nmodel: x\nmcp_servers:\n  # jira\n  x: {}\n  sharedos:\n    command: s\n  jira:\n    command: j\nother: 1\n"
            ),
            ["jira", "x"]
        );
    }

    #[test]
    fn claude_and_pi_json_merge_keeping_other_servers() {
        let existing = r#"{"mcpServers": {"other": {"command": "x"}}, "keep": 1}"#;
        let out = render(
            Harness::ClaudeCode,
            &launch(TokenSource::Env("T".into())),
            Some(existing),
            Path::new("a.json"),
        )
        .expect("render");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v["keep"], 1);
        assert_eq!(v["mcpServers"]["other"]["command"], "x");
        assert_eq!(v["mcpServers"]["sharedos"]["type"], "stdio");
        assert_eq!(
            v["mcpServers"]["sharedos"]["env"]["SHAREDOS_TURN_TOKEN"],
            "T"
        );
        let out = render(
            Harness::Pi,
            &launch(TokenSource::File("/run/t".into())),
            None,
            Path::new("b.json"),
        )
        .expect("pi");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v["mcpServers"]["sharedos"]["directTools"], true);
        assert_eq!(
            v["mcpServers"]["sharedos"]["args"],
            json!(["--turn-token-file", "/run/t"])
        );
        assert!(
            v["mcpServers"]["sharedos"]["env"]
                .get("SHAREDOS_TURN_TOKEN")
                .is_none()
        );
    }

    /// Qwen Code's settings.json keeps the user's other servers and settings.
    #[test]
    fn qwen_settings_merge_keeping_other_servers() {
        let existing = r#"{"mcpServers": {"other": {"command": "x", "trust": false}}, "tools": {"toolSearch": {"enabled": false}}, "model": {"name": "m"}}"#;
        let out = render(
            Harness::QwenCode,
            &launch(TokenSource::File("/run/t".into())),
            Some(existing),
            Path::new("settings.json"),
        )
        .expect("render");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(
            v["mcpServers"]["other"],
            json!({"command": "x", "trust": false})
        );
        assert_eq!(v["tools"]["toolSearch"]["enabled"], false);
        assert_eq!(v["model"]["name"], "m");
        let s = &v["mcpServers"]["sharedos"];
        assert_eq!(s["trust"], true);
        assert_eq!(s["command"], "/opt/sharedos/bin/sharedos-mcp-shim");
        assert_eq!(s["args"], json!(["--turn-token-file", "/run/t"]));
        assert_eq!(s["env"]["SHAREDOS_BROKER_UID"], "1042");
        assert_eq!(v["mcpServers"].as_object().map(|o| o.len()), Some(2));
    }

    /// Cline's cline_mcp_settings.json keeps the user's other servers and keys; the `sharedos`
    /// entry waits up to 60 s for the shim's `initialize`.
    #[test]
    fn cline_settings_merge_keeping_other_servers() {
        let existing =
            r#"{"mcpServers": {"other": {"command": "x", "disabled": true}}, "keep": {"a": 1}}"#;
        let out = render(
            Harness::Cline,
            &launch(TokenSource::File("/run/t".into())),
            Some(existing),
            Path::new("cline_mcp_settings.json"),
        )
        .expect("render");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(
            v["mcpServers"]["other"],
            json!({"command": "x", "disabled": true})
        );
        assert_eq!(v["keep"]["a"], 1);
        let s = &v["mcpServers"]["sharedos"];
        assert_eq!(s["type"], "stdio");
        assert_eq!(s["timeout"], 60);
        assert_eq!(s["args"], json!(["--turn-token-file", "/run/t"]));
        assert_eq!(v["mcpServers"].as_object().map(|o| o.len()), Some(2));
        assert_eq!(other_servers(Harness::Cline, &out), ["other"]);
    }

    /// opencode's opencode.json keeps the user's provider, model and other MCP servers.
    #[test]
    fn opencode_config_merge_keeping_other_servers() {
        let existing = r#"{"$schema": "https://opencode.ai/config.json", "model": "p/m", "provider": {"p": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "http://127.0.0.1:1/v1"}}}, "mcp": {"other": {"type": "remote", "url": "http://127.0.0.1:2/mcp"}}}"#;
        let out = render(
            Harness::Opencode,
            &launch(TokenSource::File("/run/t".into())),
            Some(existing),
            Path::new("opencode.json"),
        )
        .expect("render");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(
            v["mcp"]["other"],
            json!({"type": "remote", "url": "http://127.0.0.1:2/mcp"})
        );
        assert_eq!(v["model"], "p/m");
        assert_eq!(
            v["provider"]["p"]["options"]["baseURL"],
            "http://127.0.0.1:1/v1"
        );
        let s = &v["mcp"]["sharedos"];
        assert_eq!(s["type"], "local");
        assert_eq!(s["enabled"], true);
        assert_eq!(
            s["command"],
            json!([
                "/opt/sharedos/bin/sharedos-mcp-shim",
                "--turn-token-file",
                "/run/t"
            ])
        );
        assert_eq!(s["environment"]["SHAREDOS_BROKER_UID"], "1042");
        assert_eq!(v["mcp"].as_object().map(|o| o.len()), Some(2));
        assert!(v.get("mcpServers").is_none(), "{v}");
    }

    #[test]
    fn codex_toml_merges_into_the_hosts_config() {
        let existing = "# host settings\nmodel = \"m\"\napproval_policy = \"never\"\n\n[model_providers.fake]\nbase_url = \"http://127.0.0.1:1/v1\"\n";
        let out = render(
            Harness::Codex,
            &launch(TokenSource::Env("T".into())),
            Some(existing),
            Path::new("c.toml"),
        )
        .expect("render");
        assert!(out.contains("# host settings"));
        let t: toml::Table = toml::from_str(&out).expect("toml");
        let s = &t["mcp_servers"]["sharedos"];
        assert_eq!(s["required"].as_bool(), Some(true));
        assert_eq!(s["default_tools_approval_mode"].as_str(), Some("approve"));
        assert_eq!(s["env"]["SHAREDOS_TURN_TOKEN"].as_str(), Some("T"));
        assert_eq!(t["model"].as_str(), Some("m"));
    }

    /// Every renderer gives the shim the broker's uid, so that it gives its token to no other.
    #[test]
    fn every_config_names_the_brokers_uid() {
        for format in Harness::ALL {
            for token in [TokenSource::Env("T".into()), TokenSource::File("/t".into())] {
                let out = render(format, &launch(token), None, Path::new("x")).expect("render");
                let line = out
                    .lines()
                    .find(|l| l.contains(runtime::BROKER_UID_ENV))
                    .unwrap_or_else(|| panic!("{format:?}: no broker uid in {out}"));
                assert!(line.contains("1042"), "{format:?}: {line}");
            }
        }
        let mut none = launch(TokenSource::Env("T".into()));
        none.broker_uid = None;
        let out = render(Harness::ClaudeCode, &none, None, Path::new("x")).expect("render");
        assert!(!out.contains(runtime::BROKER_UID_ENV), "{out}");
    }

    #[test]
    fn written_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("sub/cordis.yml");
        write(
            Harness::Cordis,
            &launch(TokenSource::Env("T".into())),
            &path,
            None,
        )
        .expect("write");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(
            std::fs::read_to_string(&path)
                .expect("read")
                .contains("UNTESTED")
        );
    }

    /// Issue 47: `--write-config cordis` merges into an existing cordis.yml: two other servers,
    /// other keys and every comment kept, the `sharedos` entry added, then replaced in place on the
    /// next write (its old lines gone, the comment before the next server kept).
    #[test]
    fn cordis_merges_keeping_other_servers_keys_and_comments() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("cordis.yml");
        let original = "\
# dsh settings (mine)
model: deepseek-chat   # the default model
mcp_servers:
    # the issue tracker
    jira:
        transport: stdio
        command: jira-mcp   # pinned
        env:
            JIRA_URL: https://jira.example
    files:
        transport: stdio
        command: files-mcp

# keys after the servers
theme: dark
";
        std::fs::write(&path, original).expect("w");
        let first = launch(TokenSource::Env("T1".into()));
        write(Harness::Cordis, &first, &path, None).expect("merge");
        let merged = std::fs::read_to_string(&path).expect("r");
        for kept in original.lines() {
            assert!(merged.contains(kept), "`{kept}` kept:\n{merged}");
        }
        assert!(
            merged.contains("        command: files-mcp\n    sharedos:\n        transport: stdio\n        command: \"/opt/sharedos/bin/sharedos-mcp-shim\"\n"),
            "added after the last server at its siblings' indentation:\n{merged}"
        );
        assert!(
            merged.contains("            SHAREDOS_TURN_TOKEN: \"T1\"\n"),
            "{merged}"
        );
        assert!(
            merged.ends_with("\n# keys after the servers\ntheme: dark\n"),
            "{merged}"
        );
        assert_eq!(other_servers(Harness::Cordis, &merged), ["files", "jira"]);
        // Written again (a new turn): replaced, not added twice.
        write(
            Harness::Cordis,
            &launch(TokenSource::Env("T2".into())),
            &path,
            None,
        )
        .expect("merge again");
        let again = std::fs::read_to_string(&path).expect("r");
        assert_eq!(again.matches("sharedos:").count(), 1, "{again}");
        assert!(!again.contains("T1") && again.contains("T2"), "{again}");
        assert_eq!(again, merged.replace("T1", "T2"));
        // `sharedos` first, with a comment before the next server: that comment stays.
        let path2 = dir.path().join("c2.yml");
        std::fs::write(
            &path2,
            "mcp_servers:\n  sharedos:\n    command: old\n    args: [\"--x\"]\n  # the tracker\n  jira:\n    command: j\n",
        )
        .expect("w");
        write(Harness::Cordis, &first, &path2, None).expect("merge");
        let t = std::fs::read_to_string(&path2).expect("r");
        assert!(!t.contains("old") && !t.contains("--x"), "{t}");
        assert!(
            t.contains(
                "    SHAREDOS_TURN_TOKEN: \"T1\"\n  # the tracker\n  jira:\n    command: j\n"
            ),
            "{t}"
        );
        // No `mcp_servers` yet: appended, the rest kept.
        std::fs::write(&path2, "# only a model\nmodel: m\n").expect("w");
        write(Harness::Cordis, &first, &path2, None).expect("merge");
        let t = std::fs::read_to_string(&path2).expect("r");
        assert!(
            t.starts_with("# only a model\nmodel: m\n\nmcp_servers:\n  sharedos:\n"),
            "{t}"
        );
    }

    /// Layouts the line merge cannot read unambiguously are refused naming the file and line,
    /// and the file is left as it was.
    #[test]
    fn cordis_layouts_it_cannot_merge_are_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("cordis.yml");
        for (text, says) in [
            (
                "mcp_servers: {jira: {command: j}}\n",
                "line 1: `mcp_servers` is written inline",
            ),
            ("mcp_servers:\n\tjira: {}\n", "line 2: a tab"),
            (
                "mcp_servers:\n  - jira\n",
                "line 2: `mcp_servers` holds a list",
            ),
            (
                "mcp_servers:\n    jira: {}\n  files: {}\n",
                "line 3: indented less",
            ),
            ("a: 1\n---\nb: 2\n", "line 2: a second YAML document"),
            (
                "mcp_servers:\n  a: {}\nmcp_servers:\n  b: {}\n",
                "line 3: `mcp_servers` appears twice",
            ),
        ] {
            std::fs::write(&path, text).expect("w");
            let e = write(
                Harness::Cordis,
                &launch(TokenSource::Env("T".into())),
                &path,
                None,
            )
            .expect_err(text);
            let m = e.to_string();
            assert!(
                m.contains(&path.display().to_string()) && m.contains(says),
                "{text:?}: {m}"
            );
            assert_eq!(std::fs::read_to_string(&path).expect("r"), text);
        }
    }

    /// An existing config that is a link is not read through (nor written through).
    #[test]
    fn a_config_that_is_a_link_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let victim = dir.path().join("victim.json");
        std::fs::write(&victim, r#"{"secret": 1}"#).expect("w");
        let link = dir.path().join("linked.json");
        std::os::unix::fs::symlink(&victim, &link).expect("ln");
        let e = write(
            Harness::ClaudeCode,
            &launch(TokenSource::Env("T".into())),
            &link,
            None,
        )
        .expect_err("link refused");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&victim).expect("r"),
            r#"{"secret": 1}"#
        );
    }
}
