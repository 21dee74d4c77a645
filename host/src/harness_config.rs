//! Harness MCP configs: the file each harness reads to spawn `sharedos-mcp-shim` for one turn.
//!
//! Owns rendering (Claude Code `--mcp-config` JSON, Codex `config.toml`, pi-mcp-adapter
//! `.mcp.json`, Qwen Code `settings.json`, opencode `opencode.json`, dsh `cordis.yml`) and writing
//! them 0600 (they hold, or point at, the turn's bearer token). An existing Claude Code, Codex, pi,
//! Qwen Code or opencode file is merged: only the `sharedos` server entry is replaced. It never
//! decides anything about the turn.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sharedos_ipc::runtime;
use sharedos_proto::alias::{Harness, SERVER_NAME};

pub use sharedos_ipc::private_file::{FileOwner, PrivateFileError, write_private};

#[derive(Debug, thiserror::Error)]
pub enum HarnessConfigError {
    #[error(
        "unknown config format `{0}`: use claude-code, codex, pi, cordis, qwen-code, opencode or gemini-cli"
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
            let mut y = String::from(
                "# dsh (DeepSeek Harness) cordis.yml: SharedOS as a stdio MCP server.\n\
                 # UNTESTED: the dsh CLI is not on any registry reachable where this was built; this\n\
                 # follows the generic MCP stdio server shape (command, args, env).\n",
            );
            y.push_str(&format!(
                "mcp_servers:\n  {SERVER_NAME}:\n    transport: stdio\n    command: {}\n",
                q(&shim)
            ));
            y.push_str("    args: [");
            y.push_str(
                &launch
                    .args()
                    .iter()
                    .map(|a| q(a))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
            y.push_str("]\n    env:\n");
            for (k, v) in launch.env() {
                y.push_str(&format!("      {k}: {}\n", q(&v)));
            }
            Ok(y)
        }
    }
}

/// The MCP servers a rendered config of `format` names besides `sharedos`, sorted: the keys
/// under `mcpServers` (`mcp` for opencode, `mcp_servers` for Codex). A text that does not parse
/// names none (the harness would not start those servers either); dsh's `cordis.yml` is written
/// whole, with `sharedos` alone.
pub fn other_servers(format: Harness, text: &str) -> Vec<String> {
    let mut names: Vec<String> = match format {
        Harness::Cordis => vec![],
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
    let existing = match format {
        Harness::Cordis => None,
        _ => read_existing(path)?,
    };
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
        assert!(other_servers(Harness::Cordis, "mcp_servers:\n  x: {}\n").is_empty());
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
