//! Harness MCP configs: the file each harness reads to spawn `sharedos-mcp-shim` for one turn.
//!
//! Owns rendering (Claude Code `--mcp-config` JSON, Codex `config.toml`, pi-mcp-adapter
//! `.mcp.json`, dsh `cordis.yml`) and writing them 0600 (they hold, or point at, the turn's bearer
//! token). An existing Claude Code, Codex or pi file is merged: only the `sharedos` server entry
//! is replaced. It never decides anything about the turn.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sharedos_ipc::runtime;
use sharedos_proto::alias::{Harness, SERVER_NAME};

#[derive(Debug, thiserror::Error)]
pub enum HarnessConfigError {
    #[error("unknown config format `{0}`: use claude-code, codex, pi or cordis")]
    Format(String),
    #[error("existing `{path}` is not valid {format}: {detail}")]
    Existing {
        path: String,
        format: &'static str,
        detail: String,
    },
    #[error("refused to write `{path}`: {detail}")]
    Refused { path: String, detail: String },
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
    let servers = obj.entry("mcpServers").or_insert_with(|| json!({}));
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

/// Who a written file is given to (`turn open --file-owner`): a harness that runs under its own
/// uid must be able to read its config and token, and no other harness may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileOwner {
    pub uid: u32,
    pub gid: Option<u32>,
}

impl std::str::FromStr for FileOwner {
    type Err = String;

    /// `UID` or `UID:GID` (numbers).
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |part: &str, what: &str| {
            part.parse::<u32>()
                .map_err(|_| format!("`{s}`: {what} `{part}` is not a number (use UID or UID:GID)"))
        };
        match s.split_once(':') {
            Some((u, g)) => Ok(Self {
                uid: num(u, "uid")?,
                gid: Some(num(g, "gid")?),
            }),
            None => Ok(Self {
                uid: num(s, "uid")?,
                gid: None,
            }),
        }
    }
}

/// The folder a private file may be written in: ours or root's, and writable by nobody else
/// unless it has the sticky bit (as `/tmp`): otherwise another uid could swap what we write.
fn check_folder(dir: &Path, fd: impl rustix::fd::AsFd, uid: u32) -> Result<(), String> {
    let st = rustix::fs::fstat(fd).map_err(|e| e.to_string())?;
    let mode = st.st_mode;
    if st.st_uid != uid && st.st_uid != 0 {
        return Err(format!(
            "folder `{}` belongs to uid {}, not to this uid ({uid}) or root: another uid could replace what is written there",
            dir.display(),
            st.st_uid
        ));
    }
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !sticky {
        return Err(format!(
            "folder `{}` (mode {:04o}) can be written by other uids and has no sticky bit: another uid could replace what is written there",
            dir.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Writes `text` to `path` atomically with mode 0600, safely against other uids: the folder is
/// opened once and checked ([`check_folder`]); the text goes to a random temporary name created
/// there with `O_CREAT | O_EXCL | O_NOFOLLOW` (a name planted in advance, link or not, fails
/// the create and another one is tried), then is renamed into place relative to the same folder.
/// With `owner`, the file is given to that uid (and gid) before it is renamed into place.
pub fn write_private(
    path: &Path,
    text: &str,
    owner: Option<FileOwner>,
) -> Result<(), HarnessConfigError> {
    write_private_named(path, text, owner, || {
        let mut rnd = [0u8; 12];
        getrandom::fill(&mut rnd).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(format!(
            ".sharedos-{}.tmp",
            sharedos_proto::catalog::hex(&rnd)
        ))
    })
}

/// Temporary names tried before giving up (each one already taken is skipped).
const TEMP_ATTEMPTS: usize = 8;

/// [`write_private`] with the temporary names from `next_name`.
fn write_private_named(
    path: &Path,
    text: &str,
    owner: Option<FileOwner>,
    mut next_name: impl FnMut() -> std::io::Result<String>,
) -> Result<(), HarnessConfigError> {
    use rustix::fs::{Mode, OFlags};
    let shown = path.display().to_string();
    let err = |source: std::io::Error| HarnessConfigError::Write {
        path: shown.clone(),
        source,
    };
    let refused = |detail: String| HarnessConfigError::Refused {
        path: shown.clone(),
        detail,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| refused("the path names no file".into()))?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
    }
    let dirfd = rustix::fs::open(
        dir,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| err(e.into()))?;
    check_folder(dir, &dirfd, rustix::process::geteuid().as_raw()).map_err(refused)?;
    let mut attempts = 0;
    let (tmp, fd) = loop {
        let tmp = next_name().map_err(err)?;
        match rustix::fs::openat(
            &dirfd,
            tmp.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => break (tmp, fd),
            Err(rustix::io::Errno::EXIST) if attempts + 1 < TEMP_ATTEMPTS => attempts += 1,
            Err(e) => return Err(err(e.into())),
        }
    };
    let written = (|| -> std::io::Result<()> {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600))?;
        if let Some(o) = owner {
            rustix::fs::fchown(
                &fd,
                Some(rustix::fs::Uid::from_raw(o.uid)),
                o.gid.map(rustix::fs::Gid::from_raw),
            )?;
        }
        let mut f = std::fs::File::from(fd);
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        rustix::fs::renameat(&dirfd, tmp.as_str(), &dirfd, name)?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = rustix::fs::unlinkat(&dirfd, tmp.as_str(), rustix::fs::AtFlags::empty());
        return Err(err(e));
    }
    Ok(())
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
    write_private(path, &text, owner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(token: TokenSource) -> ShimLaunch {
        ShimLaunch {
            shim: "/opt/sharedos/bin/sharedos-mcp-shim".into(),
            bridge: "/run/sharedos/bridge.sock".into(),
            token,
        }
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

    /// Links planted at the temporary names the writer will use are skipped, never followed:
    /// the file they point at is untouched, and the write lands at the path asked for.
    #[test]
    fn planted_links_at_temporary_names_are_never_followed() {
        let dir = tempfile::tempdir().expect("tmp");
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "VICTIM").expect("w");
        let out = dir.path().join("out");
        std::fs::create_dir(&out).expect("mkdir");
        let names: Vec<String> = (0..TEMP_ATTEMPTS).map(|i| format!(".t{i}")).collect();
        // Every name but the last is taken by a link to the victim (or a FIFO, or a file).
        for (i, n) in names.iter().take(TEMP_ATTEMPTS - 1).enumerate() {
            let at = out.join(n);
            match i % 3 {
                0 => std::os::unix::fs::symlink(&victim, &at).expect("ln"),
                1 => std::os::unix::fs::symlink("../victim.txt", &at).expect("ln"),
                _ => std::fs::write(&at, "planted").expect("w"),
            }
        }
        let mut it = names.clone().into_iter();
        write_private_named(&out.join("cfg"), "SECRET", None, || {
            it.next()
                .ok_or_else(|| std::io::Error::other("no more names"))
        })
        .expect("write");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
        assert_eq!(
            std::fs::read_to_string(out.join("cfg")).expect("r"),
            "SECRET"
        );
        assert!(
            !out.join(&names[TEMP_ATTEMPTS - 1]).exists(),
            "renamed away"
        );
        // Every name taken: the write fails, and still touches nothing.
        std::os::unix::fs::symlink(&victim, out.join(&names[TEMP_ATTEMPTS - 1])).expect("ln");
        let mut it = names.clone().into_iter();
        let e = write_private_named(&out.join("cfg2"), "SECRET", None, || {
            it.next()
                .ok_or_else(|| std::io::Error::other("no more names"))
        })
        .expect_err("all taken");
        assert!(e.to_string().contains("cfg2"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
        assert!(!out.join("cfg2").exists());
        // A config that is itself a link is not read through (nor written through).
        std::os::unix::fs::symlink(&victim, out.join("linked.json")).expect("ln");
        let e = write(
            Harness::ClaudeCode,
            &launch(TokenSource::Env("T".into())),
            &out.join("linked.json"),
            None,
        )
        .expect_err("link refused");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
    }

    #[test]
    fn folders_other_uids_can_write_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = write_private(&open.join("t"), "x", None).expect_err("refused");
        assert!(
            e.to_string().contains("open") && e.to_string().contains("sticky"),
            "{e}"
        );
        assert!(!open.join("t").exists());
        // The same folder with the sticky bit (as /tmp) is fine.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        write_private(&open.join("t"), "x", None).expect("sticky is fine");
        let group = dir.path().join("group");
        std::fs::create_dir(&group).expect("mkdir");
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o770)).expect("chmod");
        assert!(write_private(&group.join("t"), "x", None).is_err());
    }
}
