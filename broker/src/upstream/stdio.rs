//! The stdio transport: the upstream as a child process of the broker, its stdin/stdout the MCP
//! session, its stderr drained into the bounded log.

use std::path::Path;
use std::sync::Arc;

use rmcp::ServiceExt;
use rmcp::transport::TokioChildProcess;

use super::log::drain_stderr;
use super::{McpProvider, Session};

impl McpProvider {
    fn command(&self) -> tokio::process::Command {
        let command = if self.config.command.contains('/')
            && !Path::new(&self.config.command).is_absolute()
        {
            self.base.join(&self.config.command).display().to_string()
        } else {
            self.config.command.clone()
        };
        let mut cmd = tokio::process::Command::new(command);
        cmd.args(&self.config.args)
            .envs(&self.config.env)
            .kill_on_drop(true);
        cmd
    }

    /// Spawns the upstream, initializes, lists its tools. The session is returned for supervision.
    pub(super) async fn connect(&self) -> Result<Session, String> {
        let (transport, stderr) = TokioChildProcess::builder(self.command())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{}`: {e}", self.config.command))?;
        if let Some(stderr) = stderr {
            // Drain the upstream's stderr into our log (a full pipe would block it), bounded.
            tokio::spawn(drain_stderr(stderr, self.log.clone()));
        }
        let limit = self.startup_timeout();
        let changed = Arc::new(tokio::sync::Notify::new());
        let listener = self.listener(changed.clone());
        let service = tokio::time::timeout(limit, listener.serve(transport))
            .await
            .map_err(|_| "the upstream did not finish initialize in time".to_owned())?
            .map_err(|e| format!("MCP initialize with the upstream failed: {e}"))?;
        let tools = self.list(service.peer()).await?;
        Ok(Session {
            service,
            tools,
            changed,
        })
    }
}
