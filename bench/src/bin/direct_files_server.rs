//! `direct-files-server`: the benchmark's baseline. An rmcp stdio MCP server that serves the
//! built-in `files.read` / `files.list` / `files.search` tools directly from a folder, with no
//! broker, no policy and no record in between.
//!
//! Its tools/list is the one the shim presents for `alice` on the embedded default (the same
//! published definitions from `FilesProvider::definitions()`, in catalogue order, projected to MCP
//! exactly as the shim does), and its calls run the same provider code (`resolve` + `execute`),
//! so what the benchmark compares is the boundary: shim, bridge socket, kernel, Cedar and record.
//! It runs on the same runtime as the shim (multi-thread, 2 workers) and the same stdio transport.
//!
//! `--synthetic-tools N` serves N trivial tools instead (`t00000` …): an upstream with many tools
//! for the turn-open benchmark of brokered providers.
//!
//! stdout belongs to MCP: this binary never prints to it.
#![deny(clippy::print_stdout)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context as _;
use clap::Parser;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler, ServiceExt};
use serde_json::{Value, json};
use sharedos_broker::files::{FileOp, FilesProvider, ReadCheck};
use sharedos_proto::PublishedToolDefinition;

#[derive(Debug, Parser)]
#[command(
    name = "direct-files-server",
    about = "Benchmark baseline: the files tools served directly over stdio MCP, no broker"
)]
struct Args {
    /// The folder served (virtual path `/` is this folder).
    #[arg(long, value_name = "DIR", required_unless_present = "synthetic_tools")]
    root: Option<PathBuf>,
    /// Serve this many trivial tools instead of the files tools.
    #[arg(long, value_name = "N", conflicts_with = "root")]
    synthetic_tools: Option<usize>,
    /// Listen on this Unix socket instead of stdio, one MCP session per connection (the server
    /// behind the benchmark's `relay`).
    #[arg(long, value_name = "SOCKET")]
    listen: Option<PathBuf>,
}

/// The baseline has no policy: every `search` hit is returned.
struct AllowAll;

impl ReadCheck for AllowAll {
    fn may_read(&self, _virtual_path: &str) -> bool {
        true
    }
}

#[derive(Clone)]
struct Direct {
    /// The files provider, or None in synthetic mode.
    provider: Option<Arc<FilesProvider>>,
    ops: Arc<HashMap<String, FileOp>>,
    tools: Arc<Vec<Tool>>,
}

/// The shim's projection of a published definition to an MCP tool (`shim/src/server.rs`).
fn to_tool(def: &PublishedToolDefinition) -> anyhow::Result<Tool> {
    let mut t = json!({"name": def.name.as_str(), "inputSchema": def.input_schema_or_default()});
    if let Some(d) = &def.description {
        t["description"] = json!(d);
    }
    if let Some(s) = &def.output_schema {
        t["outputSchema"] = s.clone();
    }
    if let Some(a) = &def.annotations {
        t["annotations"] = a.clone();
    }
    serde_json::from_value(t).with_context(|| format!("tool `{}`", def.name))
}

impl Direct {
    fn files(root: &std::path::Path) -> anyhow::Result<Self> {
        let provider = FilesProvider::new("files", root, false)?;
        let mut defs = provider.definitions()?;
        // The catalogue is sorted by name (kernel `catalog`).
        defs.sort_by(|a, b| a.name.cmp(&b.name));
        let mut ops = HashMap::new();
        let mut tools = Vec::new();
        for def in &defs {
            ops.insert(def.name.to_string(), def.authority);
            tools.push(to_tool(&def.publish())?);
        }
        Ok(Self {
            provider: Some(Arc::new(provider)),
            ops: Arc::new(ops),
            tools: Arc::new(tools),
        })
    }

    fn synthetic(n: usize) -> anyhow::Result<Self> {
        let tools = (0..n)
            .map(|i| {
                serde_json::from_value(json!({
                    "name": format!("t{i:05}"),
                    "description": format!("Synthetic benchmark tool number {i}; answers `ok`."),
                    "inputSchema": {"type": "object",
                                    "properties": {"x": {"type": "string", "description": "ignored"}},
                                    "additionalProperties": false},
                    "annotations": {"readOnlyHint": true, "openWorldHint": false}
                }))
                .context("synthetic tool")
            })
            .collect::<anyhow::Result<Vec<Tool>>>()?;
        Ok(Self {
            provider: None,
            ops: Arc::default(),
            tools: Arc::new(tools),
        })
    }

    fn call(&self, name: &str, arguments: serde_json::Map<String, Value>) -> CallToolResult {
        let Some(provider) = &self.provider else {
            return CallToolResult::success(vec![ContentBlock::text("ok")]);
        };
        let Some(op) = self.ops.get(name) else {
            return CallToolResult::error(vec![ContentBlock::text(format!(
                "unknown tool `{name}`"
            ))]);
        };
        let resolved = match provider.resolve(*op, &arguments) {
            Ok(r) => r,
            Err(why) => return CallToolResult::error(vec![ContentBlock::text(why)]),
        };
        match provider.execute(
            *op,
            &resolved,
            &arguments,
            &AllowAll,
            &AtomicBool::new(false),
        ) {
            Ok(success) => {
                let content: Result<Vec<ContentBlock>, _> = success
                    .content
                    .into_iter()
                    .map(serde_json::from_value)
                    .collect();
                match content {
                    Ok(content) => {
                        let mut ok = CallToolResult::success(content);
                        ok.structured_content = success.structured;
                        ok
                    }
                    Err(e) => CallToolResult::error(vec![ContentBlock::text(e.to_string())]),
                }
            }
            Err(failure) => CallToolResult::error(vec![ContentBlock::text(failure.message)]),
        }
    }
}

impl ServerHandler for Direct {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new("direct-files-server", env!("CARGO_PKG_VERSION")),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let arguments = request.arguments.unwrap_or_default();
        Ok(self.call(&request.name, arguments).into())
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = match (args.synthetic_tools, &args.root) {
        (Some(n), _) => Direct::synthetic(n)?,
        (None, Some(root)) => Direct::files(root)?,
        (None, None) => anyhow::bail!("give --root DIR or --synthetic-tools N"),
    };
    // The same runtime as the shim's.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    if let Some(path) = args.listen {
        return rt.block_on(async move {
            let listener = tokio::net::UnixListener::bind(&path)
                .with_context(|| format!("cannot listen on `{}`", path.display()))?;
            loop {
                let (stream, _) = listener.accept().await.context("accept")?;
                let server = server.clone();
                tokio::spawn(async move {
                    if let Ok(running) = server.serve(tokio::io::split(stream)).await {
                        let _ = running.waiting().await;
                    }
                });
            }
        });
    }
    rt.block_on(async move {
        server
            .serve(rmcp::transport::stdio_pipes())
            .await
            .context("MCP session did not start")?
            .waiting()
            .await
            .context("MCP session failed")?;
        Ok(())
    })
}
