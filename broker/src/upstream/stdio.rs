//! The stdio transport: the upstream as a child process of the broker, its stdin/stdout the MCP
//! session, its stderr drained into the bounded log. A sandboxed upstream is started through
//! the launcher (`sharedos-broker sandbox-exec PLAN COMMAND ARGS...`, see [`super::sandbox`]),
//! with a clean environment and `/` as its working folder.

use std::path::Path;
use std::sync::Arc;

use rmcp::ServiceExt;
use rmcp::transport::TokioChildProcess;

use super::log::drain_stderr;
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
        let (transport, stderr) = TokioChildProcess::builder(self.command(launch)?)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{}`: {e}", self.config.command))?;
        let sandboxed = matches!(self.sandbox, Some(Ok(_)));
        let group = Group(transport.id().filter(|_| sandboxed));
        if let Some(pid) = group.0 {
            crate::lineage::add(pid);
        }
        // Drain the upstream's stderr into our log (a full pipe would block it), bounded.
        let drained = stderr.map(|stderr| {
            tokio::spawn(drain_stderr(stderr, self.log.clone(), launch.given.clone()))
        });
        let limit = self.startup_timeout();
        let changed = Arc::new(tokio::sync::Notify::new());
        let listener = self.listener(changed.clone(), launch);
        let service = match tokio::time::timeout(limit, listener.serve(transport)).await {
            Err(_) => return Err("the upstream did not finish initialize in time".to_owned()),
            Ok(Ok(service)) => service,
            Ok(Err(e)) => {
                // A launcher that could not apply the sandbox says why on stderr, then exits.
                if sandboxed && let Some(drained) = drained {
                    let _ = tokio::time::timeout(sandbox::LAUNCHER_ERROR_WAIT, drained).await;
                }
                return Err(match self.log.take_launcher_error() {
                    Some(why) => format!("the sandbox could not be applied: {why}"),
                    None => format!("MCP initialize with the upstream failed: {e}"),
                });
            }
        };
        let tools = self.list(service.peer()).await?;
        Ok(Session {
            service,
            tools,
            changed,
            group,
        })
    }
}
