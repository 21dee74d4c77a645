//! The stdio transport: the upstream as a child process of the broker, its stdin/stdout the MCP
//! session, its stderr drained into the bounded log. A sandboxed upstream is started through
//! the launcher (`sharedos-broker sandbox-exec PLAN COMMAND ARGS...`, see [`super::sandbox`]),
//! with a clean environment and `/` as its working folder.

use std::path::Path;
use std::sync::Arc;

use rmcp::ClientServiceExt;
use rmcp::transport::TokioChildProcess;

use super::log::{StderrTail, drain_stderr};
use super::sandbox;
use super::{Launch, McpProvider, Session};

/// A sandboxed upstream's process group (the launcher made its pid the group's id): killed
/// whole, and forgotten by [`crate::lineage`], when dropped.
pub(super) struct Group(Option<u32>);

impl Group {
    /// No process group (a remote session).
    pub(super) fn none() -> Self {
        Group(None)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // Gone already (ESRCH) is fine.
            crate::child::kill_group(pid);
            crate::lineage::remove(pid);
        }
    }
}

impl McpProvider {
    /// The upstream's command, with its arguments and environment as resolved for one instance
    /// (secret references filled in), run through the sandbox launcher unless `sandbox = "none"`.
    fn command(&self, launch: &Launch) -> Result<tokio::process::Command, String> {
        let command = if self.config.command.contains('/')
            && !Path::new(&self.config.command).is_absolute()
        {
            self.base.join(&self.config.command).display().to_string()
        } else {
            self.config.command.clone()
        };
        let mut cmd = match &self.sandbox {
            None => tokio::process::Command::new(command),
            Some(Err(e)) => return Err(e.clone()),
            Some(Ok(plan)) => {
                let plan = match launch.run_as {
                    Some(uid) => &super::instance_plan(plan, uid, &launch.write_folders),
                    None => plan,
                };
                let plan_json = serde_json::to_string(plan)
                    .map_err(|e| format!("cannot write the sandbox plan: {e}"))?;
                let mut cmd = tokio::process::Command::new(sandbox::launcher()?);
                cmd.arg(sandbox::SUBCOMMAND)
                    .arg(plan_json)
                    .arg(command)
                    .current_dir("/");
                // Then the declared `env` (below), which may replace PATH, LANG and HOME.
                crate::child::clean_env(
                    cmd.as_std_mut(),
                    match &self.config.sandbox {
                        crate::config::SandboxSetting::On(sb) => sb.home.as_deref(),
                        crate::config::SandboxSetting::Off(_) => None,
                    }
                    // An instance of its own: its own folder, where it may keep files.
                    .or(launch.write_folders.first().map(|(_, own)| own.as_str()))
                    .unwrap_or(sandbox::DEFAULT_HOME),
                    std::iter::empty(),
                );
                cmd
            }
        };
        cmd.args(&launch.args)
            .envs(launch.env.iter().map(|(k, v)| (k, v.expose())))
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// Spawns the upstream, initializes, lists its tools. The session is returned for supervision.
    pub(super) async fn connect(&self, launch: &Launch) -> Result<Session, String> {
        let (status_tx, mut status) = tokio::sync::watch::channel(None);
        let mut wrapped = process_wrap::tokio::CommandWrap::from(self.command(launch)?);
        wrapped.wrap(KeepStatus(status_tx));
        let (transport, stderr) = TokioChildProcess::builder(wrapped)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{}`: {e}", self.config.command))?;
        let sandboxed = matches!(self.sandbox, Some(Ok(_)));
        let group = Group(transport.id().filter(|_| sandboxed));
        if let Some(pid) = group.0 {
            crate::lineage::add(pid);
        }
        // Drain the upstream's stderr into our log (a full pipe would block it), bounded; its
        // last lines are kept for a failed start to show.
        let tail = Arc::new(StderrTail::default());
        let drained = stderr.map(|stderr| {
            tokio::spawn(drain_stderr(
                stderr,
                self.log.clone(),
                launch.given.clone(),
                tail.clone(),
            ))
        });
        let limit = self.startup_timeout();
        let changed = Arc::new(tokio::sync::Notify::new());
        let listener = self.listener(changed.clone(), launch);
        let service = match tokio::time::timeout(
            limit,
            listener.serve_with_lifecycle(transport, self.lifecycle()),
        )
        .await
        {
            Err(_) => {
                return Err(format!(
                    "the upstream did not finish initialize in time{}",
                    self.start_failure(None, &tail.lines())
                ));
            }
            Ok(Ok(service)) => service,
            Ok(Err(e)) => {
                self.note_discover(&e);
                // The upstream's last words and its exit status: its stderr ends when it exits
                // (a launcher that could not apply the sandbox says why there, then exits).
                if let Some(drained) = drained {
                    let _ = tokio::time::timeout(sandbox::LAUNCHER_ERROR_WAIT, drained).await;
                }
                let exited = tokio::time::timeout(
                    sandbox::LAUNCHER_ERROR_WAIT,
                    status.wait_for(Option::is_some),
                )
                .await
                .ok()
                .and_then(Result::ok)
                .and_then(|s| *s);
                return Err(match self.log.take_launcher_error() {
                    Some(why) => format!("the sandbox could not be applied: {why}"),
                    None => format!(
                        "MCP initialize with the upstream failed: {e}{}",
                        self.start_failure(exited, &tail.lines())
                    ),
                });
            }
        };
        let tools = self.list(service.peer()).await?;
        self.listen_for_changes(service.peer(), changed.clone());
        Ok(Session {
            service,
            tools,
            changed,
            group,
        })
    }

    /// What a failed start says besides its cause: the upstream's exit status, its last stderr
    /// lines (redacted, escaped, bounded), and, sandboxed, the rules it had and the rule to add
    /// for a path it was refused.
    fn start_failure(&self, exited: Option<std::process::ExitStatus>, tail: &[String]) -> String {
        use std::os::unix::process::ExitStatusExt;
        let mut out = String::new();
        if let Some(st) = exited {
            out.push_str(&match (st.code(), st.signal()) {
                (Some(code), _) => format!("; the upstream exited with status {code}"),
                (None, Some(9)) => "; the upstream ended by signal 9 (SIGKILL: the broker ends an upstream whose start failed, if it had not exited)".to_owned(),
                (None, Some(sig)) => format!("; the upstream was killed by signal {sig}"),
                _ => format!("; the upstream ended: {st}"),
            });
        }
        if tail.is_empty() {
            out.push_str("; it wrote nothing on stderr");
        } else {
            out.push_str(&format!(
                "; its last stderr line(s): {}",
                tail.iter()
                    .map(|l| format!("`{l}`"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
        let Some(Ok(plan)) = &self.sandbox else {
            return out;
        };
        let own: Vec<String> = plan
            .rules
            .iter()
            .filter(|r| r.origin != sandbox::ORIGIN_DEFAULT)
            .map(|r| format!("{} {} ({})", r.access, r.path, r.origin))
            .collect();
        out.push_str(&format!(
            "; the sandbox was on: it may read the system's folders (see `sharedos-broker providers`){}",
            if own.is_empty() {
                String::new()
            } else {
                format!(" and {}", own.join(", "))
            }
        ));
        if let Some(add) = refused_path(tail, plan) {
            out.push_str(&format!(
                "; it was refused `{}`: to let it read that, add `read = [{:?}]` to the provider's [providers.sandbox] (or `write` if it must write there), or set `sandbox = \"none\"` to run it without one",
                add.0, add.1
            ));
        } else {
            out.push_str(
                "; if it needs files outside those, add their folder to the provider's [providers.sandbox] `read` (or `write`)",
            );
        }
        out
    }
}

/// The first path a stderr line says was refused (`Permission denied`, `EACCES`,
/// `Operation not permitted`) or missing (`No such file or directory`, `ENOENT`: the mount
/// namespace shows the upstream only its rules' paths, so a path outside them is not there for
/// it; counted only when the path is there for the broker) that no rule of `plan` covers, and
/// the folder to add for it (the path itself when it is a folder, else its folder).
fn refused_path(tail: &[String], plan: &sandbox::Plan) -> Option<(String, String)> {
    let refused = |l: &str| {
        let l = l.to_ascii_lowercase();
        l.contains("permission denied") || l.contains("eacces") || l.contains("not permitted")
    };
    let hidden = |l: &str| {
        let l = l.to_ascii_lowercase();
        l.contains("no such file or directory") || l.contains("enoent")
    };
    for line in tail.iter().rev().filter(|l| refused(l) || hidden(l)) {
        for word in line
            .split(['\'', '"', '`', ' ', ',', '(', ')', '[', ']'])
            .map(|w| w.trim_end_matches([':', '.', ';']))
            .filter(|w| w.starts_with('/') && w.len() > 1)
            .filter(|w| refused(line) || Path::new(w).exists())
        {
            let at = sandbox::canonical(Path::new(word));
            let covered = plan
                .rules
                .iter()
                .any(|r| at.starts_with(sandbox::canonical(Path::new(&r.path))));
            if covered {
                continue;
            }
            let folder = if at.is_dir() {
                at.clone()
            } else {
                at.parent().map_or(at.clone(), Path::to_path_buf)
            };
            return Some((word.to_owned(), folder.display().to_string()));
        }
    }
    None
}

/// Keeps the upstream's exit status when rmcp's child handle waits for it (on a failed start it
/// reaps the child itself).
#[derive(Debug)]
struct KeepStatus(tokio::sync::watch::Sender<Option<std::process::ExitStatus>>);

impl process_wrap::tokio::CommandWrapper for KeepStatus {
    fn wrap_child(
        &mut self,
        child: Box<dyn process_wrap::tokio::ChildWrapper>,
        _core: &process_wrap::tokio::CommandWrap,
    ) -> std::io::Result<Box<dyn process_wrap::tokio::ChildWrapper>> {
        Ok(Box::new(StatusChild {
            inner: child,
            status: self.0.clone(),
        }))
    }
}

#[derive(Debug)]
struct StatusChild {
    inner: Box<dyn process_wrap::tokio::ChildWrapper>,
    status: tokio::sync::watch::Sender<Option<std::process::ExitStatus>>,
}

impl process_wrap::tokio::ChildWrapper for StatusChild {
    fn inner(&self) -> &dyn process_wrap::tokio::ChildWrapper {
        &*self.inner
    }

    fn inner_mut(&mut self) -> &mut dyn process_wrap::tokio::ChildWrapper {
        &mut *self.inner
    }

    fn into_inner(self: Box<Self>) -> Box<dyn process_wrap::tokio::ChildWrapper> {
        self.inner
    }

    fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        let r = self.inner.try_wait();
        if let Ok(Some(st)) = &r {
            self.status.send_replace(Some(*st));
        }
        r
    }

    fn wait(
        &mut self,
    ) -> std::pin::Pin<
        Box<dyn Future<Output = std::io::Result<std::process::ExitStatus>> + Send + '_>,
    > {
        Box::pin(async move {
            let r = self.inner.wait().await;
            if let Ok(st) = &r {
                self.status.send_replace(Some(*st));
            }
            r
        })
    }
}
