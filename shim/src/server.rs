//! The MCP side rmcp serves: an rmcp `ServerHandler` that answers `initialize` and lists the
//! turn's published catalogue. It never sees a `tools/call`: the session takes every one before
//! rmcp does ([`crate::session`], [`crate::call`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rmcp::model::{
    DiscoverResult, Implementation, InitializeRequestParams, InitializeResult, ListToolsResult,
    PaginatedRequestParams, ProtocolVersion, RequestMetaObject, ServerCapabilities, ServerConfig,
    Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::json;
use sharedos_proto::alias::PortableNames;

use crate::link::{Link, Welcome};

/// The protocol version `initialize` settled on: the answers to the calls the session takes
/// take the wire shape rmcp gives the others for it. Shared by the handler (which settles it)
/// and the session (which renders by it).
#[derive(Clone, Default)]
pub struct Negotiated(Arc<Mutex<Option<ProtocolVersion>>>);

impl Negotiated {
    fn settle(&self, version: ProtocolVersion) {
        if let Ok(mut p) = self.0.lock() {
            *p = Some(version);
        }
    }

    /// A call's protocol is 2026-07-28 or later: the version it states for itself if it does
    /// (as rmcp decides per request), else the one `initialize` settled on.
    pub fn is_current(&self, stated: Option<&str>) -> bool {
        let current = |v: &str| v >= ProtocolVersion::V_2026_07_28.as_str();
        match stated {
            Some(v) => current(v),
            None => self
                .0
                .lock()
                .ok()
                .and_then(|p| p.clone())
                .is_some_and(|v| current(v.as_str())),
        }
    }
}

#[derive(Clone)]
pub struct Shim {
    link: Arc<Link>,
    turn: String,
    tools: Arc<Vec<Tool>>,
    protocol: Negotiated,
    /// The broker has been told which client this is (`bridge_client`), once per shim.
    announced: Arc<AtomicBool>,
    /// What the client declared it can do (elicitation), for the questions the shim asks.
    can: crate::ask::ClientCan,
}

impl Shim {
    /// The MCP side for a turn, its tools shown under their portable names when `portable` is
    /// given.
    pub fn new(
        link: Arc<Link>,
        welcome: &Welcome,
        portable: Option<&PortableNames>,
        protocol: Negotiated,
        can: crate::ask::ClientCan,
    ) -> Self {
        let tools = welcome
            .tools
            .iter()
            .filter_map(|def| {
                let shown = portable.map_or(def.name.as_str(), |p| p.portable(def.name.as_str()));
                to_tool(def, shown)
            })
            .collect();
        tracing::debug!(catalog_hash = %welcome.catalog_hash, portable = portable.is_some(), "catalogue");
        Self {
            link,
            turn: welcome.turn.clone(),
            tools: Arc::new(tools),
            protocol,
            announced: Arc::default(),
            can,
        }
    }

    /// Tells the broker which client is on the other side, the first time it is known.
    async fn announce(
        &self,
        name: String,
        version: String,
        protocol: Option<String>,
        capabilities: Option<serde_json::Value>,
    ) {
        if !self.announced.swap(true, Ordering::Relaxed) {
            self.link
                .client_info(name, version, protocol, capabilities)
                .await;
        }
    }

    /// A client without `initialize` (2026-07-28: `server/discover`, then stateless requests)
    /// names itself, if at all, in each request's `_meta`. The first request that does is the
    /// one announced; `tools/list` announces even a client that never names itself, so that the
    /// record says a client came and which protocol it spoke.
    async fn announce_from_meta(&self, meta: &RequestMetaObject, or_unnamed: bool) {
        if self.announced.load(Ordering::Relaxed) {
            return;
        }
        let protocol = meta.protocol_version().map(|v| v.as_str().to_owned());
        // As sent (the record keeps names only): no typed decode and re-encode of them.
        let capabilities = meta.get(crate::guard::CAPABILITIES_META_KEY).cloned();
        match meta.client_info() {
            Some(info) => {
                self.announce(info.name, info.version, protocol, capabilities)
                    .await;
            }
            None if or_unnamed => {
                self.announce(String::new(), String::new(), protocol, capabilities)
                    .await;
            }
            None => {}
        }
    }
}

fn to_tool(def: &sharedos_proto::PublishedToolDefinition, shown_name: &str) -> Option<Tool> {
    let mut t = json!({"name": shown_name, "inputSchema": def.input_schema_or_default()});
    if let Some(d) = &def.description {
        t["description"] = json!(d);
    }
    if let Some(s) = &def.output_schema {
        t["outputSchema"] = s.clone();
    }
    if let Some(a) = &def.annotations {
        t["annotations"] = a.clone();
    }
    match serde_json::from_value(t) {
        Ok(tool) => Some(tool),
        Err(e) => {
            tracing::error!(tool = %def.name, error = %e, "cannot present a published tool over MCP; leaving it out");
            None
        }
    }
}

impl ServerHandler for Shim {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("sharedos-mcp-shim", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "SharedOS tools for turn {}. Every call is authorized from its arguments; a refusal comes back as a result whose text starts with `denied:` (a policy said no) or `failed:` (the call could not be done).",
                self.turn
            ))
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, McpError> {
        context.peer.set_peer_info(request.clone());
        let capabilities = serde_json::to_value(&request.capabilities).ok();
        if let Some(caps) = &capabilities {
            self.can.settle(caps);
        }
        let protocol = serde_json::to_value(&request.protocol_version)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned));
        self.announce(
            request.client_info.name.clone(),
            request.client_info.version.clone(),
            protocol,
            capabilities,
        )
        .await;
        let result = self.negotiate_initialize(&request);
        if let Ok(r) = &result {
            self.protocol.settle(r.protocol_version.clone());
        }
        result
    }

    async fn discover(
        &self,
        context: RequestContext<RoleServer>,
    ) -> Result<DiscoverResult, McpError> {
        self.announce_from_meta(&context.meta, false).await;
        Ok(DiscoverResult::from_server_info(
            self.supported_protocol_versions().into_owned(),
            self.get_info(),
        ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        self.announce_from_meta(&context.meta, true).await;
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    // No `call_tool`: the session takes every `tools/call` before rmcp sees it (see
    // `crate::session`).
}
