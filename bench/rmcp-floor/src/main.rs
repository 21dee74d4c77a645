//! `rmcp-floor`: the floor under the shim's memory (issue 17). The smallest MCP server this
//! workspace can make with the shim's MCP crate (rmcp), the shim's runtime (tokio, one thread)
//! and the shim's release profile (the root `Cargo.toml` gives both packages the same
//! size-optimized settings): one tool, `files.read`, answered with a fixed text; no broker link,
//! no command line, no log. Section 6 of the benchmark runs it through the same session as the
//! shim (initialize, tools/list, 100 calls) and reports its peak beside the shim's and the relay's:
//! what is left between this floor and the shim is the shim's own work (the broker link, the
//! stdin guard, clap, the log).
//!
//! stdout belongs to MCP: this binary never prints to it.
#![deny(clippy::print_stdout)]

use std::process::ExitCode;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler, ServiceExt};
use serde_json::json;

#[derive(Clone)]
struct Floor {
    tools: Vec<Tool>,
}

impl ServerHandler for Floor {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.tools.clone()))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        Ok(CallToolResult::success(vec![ContentBlock::text("hello from SharedOS\n")]).into())
    }
}

fn main() -> ExitCode {
    let tool = json!({
        "name": "files.read",
        "description": "Read a file.",
        "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    });
    let tools = match serde_json::from_value(tool) {
        Ok(t) => vec![t],
        Err(e) => {
            eprintln!("rmcp-floor: cannot build its tool: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rmcp-floor: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let floor = Floor { tools };
    rt.block_on(async {
        match floor.serve(rmcp::transport::stdio_pipes()).await {
            Ok(running) => {
                let _ = running.waiting().await;
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("rmcp-floor: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
