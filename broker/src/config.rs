//! The broker's configuration: a TOML file, or the embedded default.
//!
//! Owns parsing and path resolution (relative paths are relative to the config file). It never
//! loads policies or opens the record: it only says where they are.

use std::path::{Path, PathBuf};
use std::time::Duration;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::evidence::record::RecordSync;
use crate::telemetry::OtelSettings;
use crate::trusted::{TrustError, TrustedDir};

/// Most a remote provider's `max_connections` can be.
pub const MAX_CONNECTIONS: usize = 256;

/// `{arg}` names in a template.
pub fn template_args(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let Some(end) = after.find('}') else { break };
        out.push(after[..end].to_owned());
        rest = &after[end + 1..];
    }
    out
}

/// The embedded default policy: `alice` may read, list and search `/public/...`, and search from
/// `/` (as `files.search` does when no path is given), which returns only the files she may read.
/// Where a root broker's sandboxed upstreams without `run_as` (or `upstream_uids`) take their
/// uid (= gid) from, one per provider, derived from its namespace (stable across restarts and
/// config edits): `[first, last]`. Unused by distributions and systemd's ranges (1879048192 =
/// 0x70000000, below 2^31 and above the container ranges).
pub const DEFAULT_UPSTREAM_UIDS: [u32; 2] = [1_879_048_192, 1_879_048_192 + 65_535];
/// A sandboxed upstream's default memory limit, in MiB (`[providers.sandbox] memory_mb`).
pub const DEFAULT_MEMORY_MB: u64 = 2048;

pub const DEFAULT_POLICY: &str = r#"// Embedded default policy of `sharedos-broker serve` without --config.
// alice may read, list and search /public and everything under it.
@id("alice-public")
permit(
  principal == SharedOS::User::"alice",
  action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
  resource is SharedOS::File
) when { resource.path == "/public" || resource.path like "/public/*" };

// files.search searches from / when no path is given; a search returns only the files the
// caller may read, so searching from / shows alice /public and nothing else.
@id("alice-search-from-root")
permit(
  principal == SharedOS::User::"alice",
  action == SharedOS::Action::"search",
  resource is SharedOS::File
) when { resource.path == "/" };
"#;

/// How long a call may run when neither the config nor its provider says.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Default lifetime of a turn when the host gives none.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// Longest lifetime a host may ask for.
pub const MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config `{path}`: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config `{path}`: {detail}")]
    Parse { path: String, detail: String },
    /// The embedded default's folder or a file in it could have been put there by another uid.
    #[error("cannot prepare the embedded default: {0}")]
    Default(#[from] TrustError),
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ProviderConfig {
    Files {
        #[serde(default = "default_files_namespace")]
        namespace: String,
        root: PathBuf,
        #[serde(default)]
        writable: bool,
        /// Milliseconds added before every call: fault injection for testing timeouts and
        /// cancellation. Leave unset in production.
        #[serde(default)]
        latency_ms: Option<u64>,
    },
    /// An existing stdio MCP server the broker spawns and keeps (see `upstream`).
    Mcp(Box<McpProviderConfig>),
}

/// Which contexts a per-context provider exists in.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Scope {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
}

impl Scope {
    pub fn matches(&self, principal: &str, agent: Option<&str>) -> bool {
        self.principal.as_deref().is_none_or(|p| p == principal)
            && self.agent.as_deref().is_none_or(|a| Some(a) == agent)
    }
}

/// The requirement of one upstream tool, built from its call's arguments: exactly one of
/// `file`, `url` and `entity` says what the call touches.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateConfig {
    /// The Cedar action (`read`, `list`, `search`, `write` on a file, `fetch` on a URL, or any
    /// action the schema applies to the resource's type).
    pub action: String,
    /// `SharedOS::File` path template, e.g. `"{path}"`: `{arg}` is replaced by that argument.
    #[serde(default)]
    pub file: Option<String>,
    /// The argument is a host path under this folder; the policy sees the path relative to it
    /// (`/srv/data/public/a.txt` → `/public/a.txt`). Without it the argument is a virtual path.
    #[serde(default)]
    pub file_root: Option<PathBuf>,
    /// `SharedOS::Url` template, e.g. `"{url}"`: read by the WHATWG URL parser.
    #[serde(default)]
    pub url: Option<String>,
    /// An entity of a type of the operator's schema.
    #[serde(default)]
    pub entity: Option<EntityTemplate>,
}

/// `entity = { type = "Github::Repo", id = "{owner}/{repo}", attributes = { owner = "{owner}" } }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntityTemplate {
    /// The entity type as the schema names it; without `::`, a type of the SharedOS namespace.
    #[serde(rename = "type")]
    pub type_name: String,
    /// The entity id template: every `{arg}` a non-empty string or integer argument.
    pub id: String,
    /// Attribute name → template. A bare `"{arg}"` is that argument's value as it is typed
    /// (string, integer, boolean, a set, a record; left out when the call omits it); any other
    /// template is a string.
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
}

impl TemplateConfig {
    /// The Cedar type of the resource it makes: `File`, `Url`, or the entity's type.
    pub fn resource_type(&self) -> &str {
        match (&self.url, &self.entity) {
            (Some(_), _) => "Url",
            (None, Some(e)) => crate::resource::entity_type(&e.type_name),
            (None, None) => "File",
        }
    }

    /// Every `{arg}` it reads: each must be in the upstream tool's inputSchema.
    pub fn args(&self) -> Vec<String> {
        let mut out = Vec::new();
        let templates = self.file.iter().chain(&self.url).chain(
            self.entity
                .iter()
                .flat_map(|e| std::iter::once(&e.id).chain(e.attributes.values())),
        );
        for t in templates {
            for a in template_args(t) {
                if !out.contains(&a) {
                    out.push(a);
                }
            }
        }
        out
    }

    /// Exactly one kind of resource, and what that kind needs (`tool`: the upstream name).
    fn check(&self, ns: &str, tool: &str) -> Result<(), String> {
        let at = format!("provider `{ns}`: [providers.tools.{tool}]");
        let kinds = [
            self.file.is_some(),
            self.url.is_some(),
            self.entity.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(format!(
                "{at}: give exactly one of `file` (a path), `url` or `entity` (what the call touches)"
            ));
        }
        if self.file_root.is_some() && self.file.is_none() {
            return Err(format!("{at}: `file_root` goes with `file`"));
        }
        let text = |key: &str, t: &str| {
            if t.is_empty() {
                return Err(format!("{at}: `{key}` is empty"));
            }
            let args = template_args(t);
            if let Some(a) = args.iter().find(|a| a.is_empty() || a.contains('{')) {
                return Err(format!(
                    "{at}: `{key}` = \"{t}\" has a malformed `{{{a}}}` (write `{{argument}}`)"
                ));
            }
            Ok(args)
        };
        if let Some(u) = &self.url {
            text("url", u)?;
        }
        if let Some(e) = &self.entity {
            let ty = crate::resource::entity_type(&e.type_name);
            if ty.is_empty()
                || ty.split("::").any(|p| {
                    p.is_empty()
                        || !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        || p.starts_with(|c: char| c.is_ascii_digit())
                })
            {
                return Err(format!(
                    "{at}: entity type `{}` is not a Cedar type name (`Repo`, `Github::Repo`)",
                    e.type_name
                ));
            }
            if crate::resource::BUILT_IN_TYPES.contains(&ty) {
                return Err(format!(
                    "{at}: entity type `{}` is one the broker makes itself (use `file` or `url`, or a type of your own)",
                    e.type_name
                ));
            }
            text("entity.id", &e.id)?;
            for (name, t) in &e.attributes {
                text(&format!("entity.attributes.{name}"), t)?;
            }
        }
        Ok(())
    }
}

/// A `[[providers]] type = "mcp"` entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpProviderConfig {
    pub namespace: String,
    /// The stdio server to spawn (exactly one of `command` and `url`).
    #[serde(default)]
    pub command: String,
    /// A remote Streamable HTTP server (`https://…/mcp`; `http://` only for loopback unless
    /// `insecure_http`); the keys after `sandbox` are for it only (a remote provider runs no process,
    /// so it has no sandbox).
    #[serde(default)]
    pub url: Option<String>,
    /// Arguments; each a string or a secret reference `{ secret = "name" }`.
    #[serde(default)]
    pub args: Vec<ConfigValue>,
    /// Environment; each value a string or a secret reference `{ secret = "name" }`.
    #[serde(default)]
    pub env: BTreeMap<String, ConfigValue>,
    /// `shared` (default): one upstream process for everyone; `per_principal`: one per
    /// principal, spawned at their first call (required when a per-principal secret is used).
    #[serde(default)]
    pub instances: Instances,
    /// Most per-principal instances running at once (default [`DEFAULT_MAX_INSTANCES`]).
    #[serde(default)]
    pub max_instances: Option<usize>,
    /// A per-principal instance unused this long is stopped (default
    /// [`DEFAULT_INSTANCE_IDLE_SECONDS`]).
    #[serde(default)]
    pub instance_idle_seconds: Option<u64>,
    /// A per-principal provider lists its tools (the catalogue everyone sees, and the pin) on an
    /// instance of its own spawned at start: with this principal's secrets, or, unset, with each
    /// per-principal reference given as the empty string.
    #[serde(default)]
    pub list_as: Option<String>,
    /// A per-context provider: its tools exist only in turns whose context matches.
    #[serde(default)]
    pub scope: Option<Scope>,
    /// Requirement templates per upstream tool name. A tool without one requires `call` on
    /// `SharedOS::Tool {name}`.
    #[serde(default)]
    pub tools: BTreeMap<String, TemplateConfig>,
    #[serde(default)]
    pub call_timeout_seconds: Option<u64>,
    /// How long to wait for initialize and the first tools/list (default 30 s).
    #[serde(default)]
    pub startup_timeout_seconds: Option<u64>,
    /// The walls the upstream runs in (`[providers.sandbox]`), or `sandbox = "none"`.
    #[serde(default)]
    pub sandbox: SandboxSetting,
    /// What becomes of the server's questions to its client (`elicitation/create`): `refuse`
    /// (the default: refused and recorded) or `forward` (put to the person behind the call in
    /// flight, in their harness, and the answer returned; URL mode only for https).
    #[serde(default)]
    pub elicitation: ElicitationSetting,
    /// Which MCP revision to speak with the server: `auto` (the default: the newest it supports,
    /// asked with `server/discover`, falling back to `initialize` 2025-11-25 for a server that
    /// does not know it) or `2025-11-25` (`initialize` only: for a server whose tools still ask
    /// through server-initiated requests, which 2026-07-28 forbids).
    #[serde(default)]
    pub protocol: ProtocolSetting,
    // A remote (`url`) provider only (checked by `McpProviderConfig::check`):
    /// Allow `http://` to a host that is not loopback (shown by `providers`, recorded).
    #[serde(default)]
    pub insecure_http: bool,
    /// PEM file of CA certificates trusted for this provider, besides the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain and its key, presented when the server asks (mutual TLS).
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    #[serde(default)]
    pub client_key: Option<PathBuf>,
    /// Headers sent on every request to the server (`Authorization = "Bearer …"`), each a
    /// string or a secret reference `{ secret = "name" }`. The harness's own headers are never
    /// passed through.
    #[serde(default)]
    pub headers: BTreeMap<String, ConfigValue>,
    /// Seconds to wait for the TCP and TLS connection (default 10).
    #[serde(default)]
    pub connect_timeout_seconds: Option<u64>,
    /// Requests in flight to the server at once per session (default 8): over HTTP/1.1 the most
    /// connections kept open, besides the session's listening stream.
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// An idle connection is closed after this many seconds (default 4); 0: none is kept.
    #[serde(default)]
    pub idle_connection_seconds: Option<u64>,
    /// OAuth 2.0 for the server (`[providers.oauth]`): the broker gets its own access token
    /// and sends it as `Authorization: Bearer …`; the harness's never passes through.
    #[serde(default)]
    pub oauth: Option<OAuthConfig>,
}

/// `[providers.oauth]`: how the broker gets an access token for a remote server.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuthConfig {
    /// `client_credentials` (RFC 6749 §4.4, the default), or `authorization_code`: each
    /// principal signs in on the person's page (PKCE S256, the server's authorization server
    /// discovered from its 401; a `per_principal` provider with `[page]` only).
    #[serde(default)]
    pub grant: OAuthGrant,
    /// The authorization server's token endpoint (https; http only to loopback unless the
    /// provider's `insecure_http`). `client_credentials` only: `authorization_code` discovers it.
    #[serde(default)]
    pub token_url: String,
    /// The client id (`authorization_code`: optional; without it the broker registers itself
    /// at the authorization server, RFC 7591).
    #[serde(default)]
    pub client_id: String,
    /// The client secret: a string or a secret reference (`{ secret = "name" }` per principal:
    /// each principal's instance then gets its own client's tokens). Required for
    /// `client_credentials`; optional for `authorization_code` (none: a public client).
    #[serde(default)]
    pub client_secret: Option<ConfigValue>,
    /// Scopes asked for (space-joined in `scope`).
    #[serde(default)]
    pub scopes: Vec<String>,
    /// The `resource` parameter (RFC 8707; the MCP authorization spec asks for it): default
    /// the provider's `url`.
    #[serde(default)]
    pub resource: Option<String>,
    /// How the client authenticates at the token endpoint: `client_secret_basic` (default,
    /// HTTP Basic, which RFC 6749 requires servers to support) or `client_secret_post`.
    #[serde(default)]
    pub auth_method: OAuthAuthMethod,
    /// `token_exchange` only: the `audience` parameter (RFC 8693 §2.1), besides `resource`.
    #[serde(default)]
    pub audience: Option<String>,
    /// `token_exchange` only: what the host hands in, `access_token` (the default) or
    /// `id_token` (sent as RFC 8693's `subject_token_type` URN).
    #[serde(default)]
    pub subject_token_type: SubjectTokenType,
}

/// `subject_token_type` of `grant = "token_exchange"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SubjectTokenType {
    #[default]
    AccessToken,
    IdToken,
}

impl SubjectTokenType {
    /// The RFC 8693 §3 token type identifier.
    pub fn urn(self) -> &'static str {
        match self {
            SubjectTokenType::AccessToken => "urn:ietf:params:oauth:token-type:access_token",
            SubjectTokenType::IdToken => "urn:ietf:params:oauth:token-type:id_token",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OAuthGrant {
    #[default]
    ClientCredentials,
    AuthorizationCode,
    /// RFC 8693: the person's token, handed in by the host at turn open, exchanged for one of
    /// the server's audience (per principal).
    TokenExchange,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OAuthAuthMethod {
    #[default]
    ClientSecretBasic,
    ClientSecretPost,
}

/// `elicitation = "refuse" | "forward"` on a provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ElicitationSetting {
    #[default]
    Refuse,
    Forward,
}

/// `protocol = "auto" | "2025-11-25"` on a provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum ProtocolSetting {
    #[default]
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "2025-11-25")]
    Legacy,
}

/// `sandbox = "none"` (the upstream runs with the broker's authority: shown by `providers` and
/// recorded), or a `[providers.sandbox]` table (the default: every wall on).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SandboxSetting {
    Off(SandboxOff),
    On(Box<SandboxConfig>),
}

impl Default for SandboxSetting {
    fn default() -> Self {
        SandboxSetting::On(Box::default())
    }
}

/// The only word `sandbox = "..."` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxOff {
    None,
}

/// A brokered upstream's sandbox (`[providers.sandbox]`). Every key has a default: an empty
/// table is the full sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    /// Paths the upstream may read and execute beneath, besides the defaults (the system's
    /// libraries and tools, the command's own folder).
    #[serde(default)]
    pub read: Vec<PathBuf>,
    /// Paths the upstream may read, write, create and remove beneath.
    #[serde(default)]
    pub write: Vec<PathBuf>,
    /// `false` (default): no TCP at all, and a network namespace of its own where the broker
    /// can make one; `true`: the host's network; `["host:port", ...]`: TCP connects to these
    /// ports only (Landlock filters ports, not hosts: the host part is not enforced).
    #[serde(default)]
    pub network: NetworkSetting,
    /// `HOME` in the upstream's environment (default `/nonexistent`).
    #[serde(default)]
    pub home: Option<String>,
    /// Largest data segment (RLIMIT_DATA, MiB).
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Most processes and threads of the upstream's uid (RLIMIT_NPROC).
    #[serde(default)]
    pub processes: Option<u64>,
    /// Most open files (RLIMIT_NOFILE).
    #[serde(default)]
    pub open_files: Option<u64>,
    /// CPU seconds over the upstream's life (RLIMIT_CPU; default unlimited).
    #[serde(default)]
    pub cpu_seconds: Option<u64>,
    /// `uid` or `uid:gid` to run the upstream as (the broker must be root).
    #[serde(default)]
    pub run_as: Option<String>,
    /// `[first, last]`: a `per_principal` provider's instances each run under a uid of their own
    /// from this range (uid = gid), given at a principal's first instance and kept while the
    /// broker runs (the broker must be root). Without it, the top-level `instance_uids`.
    #[serde(default)]
    pub instance_uids: Option<[u32; 2]>,
    /// The lowest Landlock ABI this provider accepts (default: 3 for files, 4 when the network
    /// is restricted). A kernel below it refuses the provider.
    #[serde(default)]
    pub min_landlock_abi: Option<u32>,
}

/// `run_as = "uid"` or `"uid:gid"` (gid defaults to the uid).
pub fn parse_run_as(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("run_as = `{text}`: give a numeric `uid` or `uid:gid`");
    let (u, g) = match text.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (text, None),
    };
    let uid: u32 = u.trim().parse().map_err(|_| bad())?;
    let gid: u32 = match g {
        Some(g) => g.trim().parse().map_err(|_| bad())?,
        None => uid,
    };
    Ok((uid, gid))
}

/// Gives each sandboxed provider without `run_as` the next uid of `upstream_uids` that no
/// provider's `run_as` names (uid = gid); every one is then checked like a `run_as`.
fn allocate_uids([first, last]: [u32; 2], providers: &mut [ProviderConfig]) -> Result<(), String> {
    if first == 0 || first > last {
        return Err(format!(
            "upstream_uids = [{first}, {last}]: give [first, last] with 0 < first <= last"
        ));
    }
    let taken: Vec<u32> = providers
        .iter()
        .filter_map(|p| match p {
            ProviderConfig::Mcp(m) => match &m.sandbox {
                SandboxSetting::On(sb) => sb.run_as.as_deref().and_then(|r| parse_run_as(r).ok()),
                SandboxSetting::Off(_) => None,
            },
            ProviderConfig::Files { .. } => None,
        })
        .map(|(uid, _)| uid)
        .collect();
    let mut next = (first..=last).filter(|u| !taken.contains(u));
    for p in providers {
        if let ProviderConfig::Mcp(m) = p
            && let SandboxSetting::On(sb) = &mut m.sandbox
            && sb.run_as.is_none()
        {
            let uid = next.next().ok_or_else(|| {
                format!(
                    "upstream_uids = [{first}, {last}]: too few uids for the sandboxed providers (`{}` gets none)",
                    m.namespace
                )
            })?;
            sb.run_as = Some(uid.to_string());
        }
    }
    Ok(())
}

/// As root, gives each sandboxed stdio provider still without `run_as` (none named, no
/// `upstream_uids`) a uid (= gid) of its own from [`DEFAULT_UPSTREAM_UIDS`]: an upstream never
/// runs as root by default. The uid is derived from the provider's namespace (FNV-1a), so it is
/// the same across restarts and config edits; one that is taken (another provider's, a host's
/// or harness's, in an `instance_uids` range) moves to the next free one, providers taken in
/// namespace order.
///
/// [`DEFAULT_UPSTREAM_UIDS`]: DEFAULT_UPSTREAM_UIDS
fn default_uids(
    providers: &mut [ProviderConfig],
    taken_besides: &[u32],
    ranges: &[[u32; 2]],
) -> Result<(), String> {
    let [first, last] = DEFAULT_UPSTREAM_UIDS;
    let mut taken: Vec<u32> = taken_besides.to_vec();
    let mut ranges = ranges.to_vec();
    let mut wanting: Vec<(String, usize)> = Vec::new();
    for (i, p) in providers.iter().enumerate() {
        let ProviderConfig::Mcp(m) = p else { continue };
        let SandboxSetting::On(sb) = &m.sandbox else {
            continue;
        };
        if let Some((uid, _)) = sb.run_as.as_deref().and_then(|r| parse_run_as(r).ok()) {
            taken.push(uid);
        } else if m.url.is_none() {
            wanting.push((m.namespace.clone(), i));
        }
        ranges.extend(sb.instance_uids);
    }
    wanting.sort();
    let size = u64::from(last - first) + 1;
    for (namespace, i) in wanting {
        let hash = namespace.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let free = (0..size)
            .map(|k| first + ((hash + k) % size) as u32)
            .find(|u| !taken.contains(u) && !ranges.iter().any(|[f, l]| (*f..=*l).contains(u)))
            .ok_or_else(|| {
                format!(
                    "provider `{namespace}`: no free uid in the default range [{first}, {last}]; give it `run_as` in [providers.sandbox], or set `upstream_uids`"
                )
            })?;
        taken.push(free);
        if let ProviderConfig::Mcp(m) = &mut providers[i]
            && let SandboxSetting::On(sb) = &mut m.sandbox
        {
            sb.run_as = Some(free.to_string());
        }
    }
    Ok(())
}

/// A provider's sandbox table, checked at load: a `run_as` that parses and is none of the uids
/// the sockets admit (an upstream under a host's or a harness's uid would be one), nor root;
/// network entries of the form `host:port`.
fn check_sandbox(m: &McpProviderConfig, host: &[u32], harness: &[u32]) -> Result<(), String> {
    let SandboxSetting::On(sb) = &m.sandbox else {
        return Ok(());
    };
    let at = format!("provider `{}`: [providers.sandbox]", m.namespace);
    if let Some(r) = &sb.run_as {
        let (uid, gid) = parse_run_as(r).map_err(|e| format!("{at}: {e}"))?;
        if uid == 0 || gid == 0 {
            return Err(format!(
                "{at}: run_as = `{r}`: an upstream never runs as root"
            ));
        }
        if host.contains(&uid) {
            return Err(format!(
                "{at}: run_as = `{r}`: uid {uid} is in host_uids; an upstream under a host's uid could drive the control socket"
            ));
        }
        if harness.contains(&uid) {
            return Err(format!(
                "{at}: run_as = `{r}`: uid {uid} is in harness_uids; an upstream under a harness's uid could reach the bridge socket"
            ));
        }
    }
    // The limit is set in bytes: a size whose bytes do not fit would wrap to a few MiB.
    if let Some(mb) = sb.memory_mb
        && (mb == 0 || mb.checked_mul(1024 * 1024).is_none())
    {
        return Err(format!(
            "{at}: memory_mb = {mb}: give a size in MiB from 1 to {} (leave it out for the default, {} MiB)",
            u64::MAX >> 20,
            DEFAULT_MEMORY_MB
        ));
    }
    if let NetworkSetting::Allow(list) = &sb.network {
        for e in list {
            let port = e.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
            if port.is_none() {
                return Err(format!(
                    "{at}: network entry `{e}` is not `host:port` (a port from 1 to 65535)"
                ));
            }
        }
    }
    Ok(())
}

/// The uid ranges per-principal instances are given (`instance_uids`, top-level and per
/// provider), checked at load: well formed, none of root, `host_uids`, `harness_uids` or a
/// provider's own uid (`run_as`, or given from `upstream_uids`), and no two overlapping (a uid
/// is one instance's only). A provider's range needs `instances = "per_principal"`.
fn check_instance_uids(
    top: Option<[u32; 2]>,
    providers: &[ProviderConfig],
    host: &[u32],
    harness: &[u32],
) -> Result<(), String> {
    let mut ranges: Vec<(String, [u32; 2])> = Vec::new();
    if let Some(r) = top {
        ranges.push(("instance_uids".to_owned(), r));
    }
    let mut own: Vec<(u32, String)> = Vec::new();
    for p in providers {
        let ProviderConfig::Mcp(m) = p else { continue };
        let SandboxSetting::On(sb) = &m.sandbox else {
            continue;
        };
        if let Some((uid, _)) = sb.run_as.as_deref().and_then(|r| parse_run_as(r).ok()) {
            own.push((uid, m.namespace.clone()));
        }
        if let Some(r) = sb.instance_uids {
            let at = format!(
                "provider `{}`: [providers.sandbox] instance_uids",
                m.namespace
            );
            if m.instances != Instances::PerPrincipal || m.url.is_some() {
                return Err(format!(
                    "{at}: only a stdio provider with instances = \"per_principal\" runs instances"
                ));
            }
            ranges.push((at, r));
        }
    }
    for (i, (at, [first, last])) in ranges.iter().enumerate() {
        let (first, last) = (*first, *last);
        let shown = format!("{at} = [{first}, {last}]");
        if first == 0 || first > last {
            return Err(format!(
                "{shown}: give [first, last] with 0 < first <= last"
            ));
        }
        let within = |u: &u32| (first..=last).contains(u);
        if let Some(u) = host.iter().find(|u| within(u)) {
            return Err(format!(
                "{shown}: uid {u} is in host_uids; an instance under a host's uid could drive the control socket"
            ));
        }
        if let Some(u) = harness.iter().find(|u| within(u)) {
            return Err(format!(
                "{shown}: uid {u} is in harness_uids; an instance under a harness's uid could reach the bridge socket"
            ));
        }
        if let Some((u, ns)) = own.iter().find(|(u, _)| within(u)) {
            return Err(format!(
                "{shown}: uid {u} is provider `{ns}`'s own (run_as, or from upstream_uids); an instance's uid is its principal's only"
            ));
        }
        for (other, [f, l]) in &ranges[..i] {
            if first <= *l && *f <= last {
                return Err(format!(
                    "{shown} overlaps {other} = [{f}, {l}]; an instance's uid is its principal's only"
                ));
            }
        }
    }
    Ok(())
}

/// `network = true | false | ["host:port", ...]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum NetworkSetting {
    All(bool),
    Allow(Vec<String>),
}

impl Default for NetworkSetting {
    fn default() -> Self {
        NetworkSetting::All(false)
    }
}

/// Most per-principal instances of one provider running at once, unless it says.
pub const DEFAULT_MAX_INSTANCES: usize = 64;
/// Seconds a per-principal instance may sit unused before it is stopped, unless it says.
pub const DEFAULT_INSTANCE_IDLE_SECONDS: u64 = 300;

/// How many upstream processes a brokered provider runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Instances {
    #[default]
    Shared,
    PerPrincipal,
}

/// A value in a provider's `args` or `env`: a string, or a secret reference resolved at spawn
/// time (`{ secret = "github_token" }` per principal; `shared = true` for the one value of
/// `_shared`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ConfigValue {
    Plain(String),
    Secret(SecretRef),
}

/// `{ secret = "name" }` or `{ secret = "name", shared = true }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    pub secret: String,
    #[serde(default)]
    pub shared: bool,
}

impl McpProviderConfig {
    /// The secret references of `args`, `env` and `headers`.
    pub fn secret_refs(&self) -> impl Iterator<Item = &SecretRef> {
        self.args
            .iter()
            .chain(self.env.values())
            .chain(self.headers.values())
            .chain(self.oauth.iter().filter_map(|o| o.client_secret.as_ref()))
            .filter_map(|v| match v {
                ConfigValue::Secret(r) => Some(r),
                ConfigValue::Plain(_) => None,
            })
    }

    /// Checks the secret references and the instance settings against each other.
    fn check_secrets(&self) -> Result<(), String> {
        let ns = &self.namespace;
        for r in self.secret_refs() {
            crate::secrets::check_name("secret", &r.secret)
                .map_err(|e| format!("provider `{ns}`: {e}"))?;
            if !r.shared && self.instances == Instances::Shared {
                return Err(format!(
                    "provider `{ns}`: secret `{}` is per principal, so the provider must have `instances = \"per_principal\"` (or make the reference `{{ secret = \"{}\", shared = true }}`)",
                    r.secret, r.secret
                ));
            }
        }
        if self.max_instances == Some(0) {
            return Err(format!("provider `{ns}`: max_instances = 0: at least 1"));
        }
        if self.instance_idle_seconds == Some(0) {
            return Err(format!(
                "provider `{ns}`: instance_idle_seconds = 0: at least 1"
            ));
        }
        if let Some(p) = &self.list_as {
            crate::secrets::check_name("principal", p)
                .map_err(|e| format!("provider `{ns}`: list_as: {e}"))?;
        }
        Ok(())
    }
}

impl McpProviderConfig {
    /// `[providers.oauth]` as its grant needs it: `client_credentials` a token endpoint, a
    /// client id and secret; `authorization_code` a `per_principal` provider (each person signs
    /// in for their own instance) and nothing to discover given by hand.
    fn check_grant(&self, o: &OAuthConfig) -> Result<(), String> {
        let ns = &self.namespace;
        match o.grant {
            OAuthGrant::ClientCredentials => {
                check_url(ns, "oauth.token_url", &o.token_url, self.insecure_http)?;
                if o.client_id.is_empty() {
                    return Err(format!("provider `{ns}`: oauth.client_id is empty"));
                }
                if o.client_secret.is_none() {
                    return Err(format!(
                        "provider `{ns}`: grant = \"client_credentials\" needs oauth.client_secret (a secret reference)"
                    ));
                }
            }
            OAuthGrant::AuthorizationCode => {
                if self.instances != Instances::PerPrincipal {
                    return Err(format!(
                        "provider `{ns}`: grant = \"authorization_code\" signs each person in for their own tokens, so the provider needs `instances = \"per_principal\"`"
                    ));
                }
                if matches!(&o.client_secret, Some(ConfigValue::Secret(r)) if !r.shared) {
                    return Err(format!(
                        "provider `{ns}`: with grant = \"authorization_code\" the broker is one client for everyone: make oauth.client_secret `{{ secret = \"...\", shared = true }}`"
                    ));
                }
                if !o.token_url.is_empty() {
                    return Err(format!(
                        "provider `{ns}`: grant = \"authorization_code\" discovers the token endpoint from the server (RFC 9728, RFC 8414): remove oauth.token_url"
                    ));
                }
                if self.list_as.is_none() {
                    return Err(format!(
                        "provider `{ns}`: grant = \"authorization_code\" lists the server's tools with one person's sign-in: set `list_as = \"<principal>\"` (who signs in first, on the page at /connect/{ns})"
                    ));
                }
            }
            OAuthGrant::TokenExchange => self.check_exchange(o)?,
        }
        if o.grant != OAuthGrant::TokenExchange
            && (o.audience.is_some() || o.subject_token_type != SubjectTokenType::default())
        {
            return Err(format!(
                "provider `{ns}`: oauth.audience and oauth.subject_token_type are for grant = \"token_exchange\""
            ));
        }
        Ok(())
    }

    /// `grant = "token_exchange"`: each principal's instance sends a token exchanged from the
    /// one their host handed in, so a `per_principal` provider, listed as `list_as`, with the
    /// broker's client id (one client for everyone); the token endpoint given or discovered.
    fn check_exchange(&self, o: &OAuthConfig) -> Result<(), String> {
        let ns = &self.namespace;
        if self.instances != Instances::PerPrincipal {
            return Err(format!(
                "provider `{ns}`: grant = \"token_exchange\" exchanges each person's own token for their own instance, so the provider needs `instances = \"per_principal\"`"
            ));
        }
        if o.client_id.is_empty() {
            return Err(format!(
                "provider `{ns}`: grant = \"token_exchange\" needs oauth.client_id (the broker's client at the authorization server)"
            ));
        }
        if matches!(&o.client_secret, Some(ConfigValue::Secret(r)) if !r.shared) {
            return Err(format!(
                "provider `{ns}`: with grant = \"token_exchange\" the broker is one client for everyone: make oauth.client_secret `{{ secret = \"...\", shared = true }}`"
            ));
        }
        if !o.token_url.is_empty() {
            check_url(ns, "oauth.token_url", &o.token_url, self.insecure_http)?;
        }
        if self.list_as.is_none() {
            return Err(format!(
                "provider `{ns}`: grant = \"token_exchange\" lists the server's tools with one person's token: set `list_as = \"<principal>\"` (its tools are listed at that principal's first turn opened with a subject token)"
            ));
        }
        Ok(())
    }
}

/// Keys only a stdio (`command`) provider takes, and only a remote (`url`) one.
const REMOTE_ONLY: &[&str] = &[
    "insecure_http",
    "ca_file",
    "client_cert",
    "client_key",
    "headers",
    "connect_timeout_seconds",
    "oauth",
    "max_connections",
    "idle_connection_seconds",
];

impl McpProviderConfig {
    /// Exactly one of `command` and `url`; a URL must be http(s), and plain HTTP only to a
    /// loopback host unless `insecure_http`.
    pub fn check(&self) -> Result<(), String> {
        let ns = &self.namespace;
        for (tool, t) in &self.tools {
            t.check(ns, tool)?;
        }
        let Some(url) = &self.url else {
            if self.command.is_empty() {
                return Err(format!(
                    "provider `{ns}`: a `type = \"mcp\"` provider needs `command` (a stdio server) or `url` (a Streamable HTTP server)"
                ));
            }
            let r = self;
            let set = [
                r.insecure_http,
                r.ca_file.is_some(),
                r.client_cert.is_some(),
                r.client_key.is_some(),
                !r.headers.is_empty(),
                r.connect_timeout_seconds.is_some(),
                r.oauth.is_some(),
                r.max_connections.is_some(),
                r.idle_connection_seconds.is_some(),
            ];
            if let Some(i) = set.iter().position(|s| *s) {
                return Err(format!(
                    "provider `{ns}`: `{}` is for a remote provider (`url`), not a stdio one (`command`)",
                    REMOTE_ONLY[i]
                ));
            }
            return Ok(());
        };
        if !self.command.is_empty() || !self.args.is_empty() || !self.env.is_empty() {
            return Err(format!(
                "provider `{ns}`: give `command` (with `args`, `env`) or `url`, not both"
            ));
        }
        check_url(ns, "url", url, self.insecure_http)?;
        if let Some(o) = &self.oauth {
            self.check_grant(o)?;
            if self
                .headers
                .keys()
                .any(|h| h.eq_ignore_ascii_case("authorization"))
            {
                return Err(format!(
                    "provider `{ns}`: give `[providers.oauth]` or an `Authorization` header, not both"
                ));
            }
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err(format!(
                "provider `{ns}`: `client_cert` and `client_key` go together"
            ));
        }
        if self.connect_timeout_seconds == Some(0) {
            return Err(format!(
                "provider `{ns}`: connect_timeout_seconds = 0: at least 1"
            ));
        }
        let max = MAX_CONNECTIONS;
        if let Some(n) = self.max_connections
            && !(1..=max).contains(&n)
        {
            return Err(format!(
                "provider `{ns}`: max_connections = {n}: from 1 to {max}"
            ));
        }
        for name in self.headers.keys() {
            let lower = name.to_ascii_lowercase();
            if matches!(
                lower.as_str(),
                "host"
                    | "content-type"
                    | "accept"
                    | "content-length"
                    | "mcp-session-id"
                    | "mcp-protocol-version"
                    | "last-event-id"
            ) {
                return Err(format!(
                    "provider `{ns}`: header `{name}` is set by the broker's HTTP transport and cannot be configured"
                ));
            }
        }
        Ok(())
    }
}

/// An http(s) URL with a host, read by the parser the HTTP client itself uses (WHATWG, the
/// `url` crate through reqwest), so that the host checked is the host called: no user info
/// (`user@`), no `\\`, no whitespace or control characters (the parser would strip or reread
/// them), and plain HTTP only to a loopback host unless `insecure_http`. The error names the key
/// and the problem, and shows the URL only with its user info cut out.
fn check_url(ns: &str, key: &str, url: &str, insecure_http: bool) -> Result<(), String> {
    parse_url(url, insecure_http)
        .map(|_| ())
        .map_err(|problem| {
            format!(
                "provider `{ns}`: {key} `{}` {problem}",
                shown_url(url).escape_debug()
            )
        })
}

/// [`check_url`]'s reading of `url`: the parsed URL, or what is wrong with it.
pub fn parse_url(url: &str, insecure_http: bool) -> Result<reqwest::Url, String> {
    if let Some(c) = url.chars().find(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "contains {}: URLs with whitespace or control characters are refused (the HTTP client's parser drops some of them, so the host checked would not be the host called)",
            c.escape_default()
        ));
    }
    if url.contains('\\') {
        return Err(
            "contains `\\`: refused (an HTTP client reads it as `/`, ending the host early, so the host checked would not be the host called)".into(),
        );
    }
    let parsed =
        reqwest::Url::parse(url).map_err(|e| format!("is not an http:// or https:// URL ({e})"))?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(
            "has user info (`...@` before the host): refused; give credentials as `headers` or `[providers.oauth]`, never in the URL".into(),
        );
    }
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "is not an http:// or https:// URL (scheme `{}`)",
            parsed.scheme()
        ));
    }
    if parsed.host().is_none() {
        return Err("has no host".into());
    }
    let loopback = host_is_loopback(&parsed);
    match parsed.scheme() {
        "https" => Ok(parsed),
        _ if insecure_http || loopback => Ok(parsed),
        _ => Err(format!(
            "is plain HTTP to `{}`, which is not loopback: use https://, or set `insecure_http = true` to send calls and credentials unencrypted",
            parsed.host_str().unwrap_or_default()
        )),
    }
}

/// `url` for messages: user info (anything before an `@` in the authority) cut out: it may be
/// a password.
pub fn shown_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    match authority.rsplit_once('@') {
        Some((_, host)) => {
            let after = rest.get(authority.len()..).unwrap_or_default();
            format!("{scheme}://(user info cut)@{host}{after}")
        }
        None => url.to_owned(),
    }
}

/// Whether a parsed URL's host stays on this machine: `localhost`, 127.0.0.0/8 or ::1, as the
/// HTTP client reads the host (`0x7f000001` is 127.0.0.1 to it; `127.0.0.1.evil.example` a name).
pub fn host_is_loopback(url: &reqwest::Url) -> bool {
    match url.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// A `[[budgets]]` table: a limit on the calls of one tool (`tool`) or of every tool of one
/// provider (`namespace`). Checked by the kernel after the policy permits a call (and after a
/// person approved it, where one must), right before it runs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// One tool, by its full name (`files.read`).
    #[serde(default)]
    pub tool: Option<String>,
    /// Every tool of the provider with this namespace (`fs`).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Calls that may run in one turn.
    #[serde(default)]
    pub calls_per_turn: Option<u64>,
    /// A token bucket per principal across turns: this many calls at once, refilled at this
    /// many per minute.
    #[serde(default)]
    pub calls_per_minute_per_principal: Option<u64>,
    /// Bytes the turn's calls may return: the compact JSON text of each result's `content`
    /// (and `structuredContent`). A call that starts below the limit runs whole.
    #[serde(default)]
    pub bytes_per_turn: Option<u64>,
}

impl BudgetConfig {
    /// What the budget applies to: the tool's name or the namespace.
    pub fn target(&self) -> &str {
        self.tool
            .as_deref()
            .or(self.namespace.as_deref())
            .unwrap_or("")
    }

    /// Checks one table (`index` counts from 0) against the configured providers.
    fn check(&self, index: usize, providers: &[ProviderConfig]) -> Result<(), String> {
        let at = format!("[[budgets]] #{} (budgets[{index}])", index + 1);
        let namespaces: Vec<&str> = providers.iter().map(ProviderConfig::namespace).collect();
        let known = namespaces.join(", ");
        match (&self.tool, &self.namespace) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(format!(
                    "{at}: give exactly one of `tool` (a tool's full name) or `namespace` (a provider's)"
                ));
            }
            (None, Some(ns)) => {
                if !namespaces.contains(&ns.as_str()) {
                    return Err(format!(
                        "{at}: namespace = \"{ns}\" is no provider's namespace (configured: {known})"
                    ));
                }
            }
            (Some(tool), None) => {
                let provider = providers.iter().find(|p| {
                    tool.strip_prefix(p.namespace())
                        .is_some_and(|rest| rest.starts_with('.') && rest.len() > 1)
                });
                match provider {
                    None => {
                        return Err(format!(
                            "{at}: tool = \"{tool}\" names no provider's tool (a tool is `<namespace>.<name>`; configured namespaces: {known})"
                        ));
                    }
                    // The files provider's tools are known now; a brokered provider's only once
                    // its upstream lists them (such a budget for a tool it never lists applies
                    // to nothing).
                    Some(ProviderConfig::Files {
                        namespace,
                        writable,
                        ..
                    }) => {
                        let name = &tool[namespace.len() + 1..];
                        let mut tools = vec!["read", "list", "search"];
                        if *writable {
                            tools.push("write");
                        }
                        if !tools.contains(&name) {
                            return Err(format!(
                                "{at}: tool = \"{tool}\" is not a tool of files provider `{namespace}` (it has {})",
                                tools
                                    .iter()
                                    .map(|t| format!("{namespace}.{t}"))
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ));
                        }
                    }
                    Some(ProviderConfig::Mcp(_)) => {}
                }
            }
        }
        let limits = [
            ("calls_per_turn", self.calls_per_turn),
            (
                "calls_per_minute_per_principal",
                self.calls_per_minute_per_principal,
            ),
            ("bytes_per_turn", self.bytes_per_turn),
        ];
        if limits.iter().all(|(_, v)| v.is_none()) {
            return Err(format!(
                "{at}: no limit: give calls_per_turn, calls_per_minute_per_principal or bytes_per_turn"
            ));
        }
        if let Some((key, _)) = limits.iter().find(|(_, v)| *v == Some(0)) {
            return Err(format!(
                "{at}: {key} = 0: a limit must be at least 1 (to refuse a tool altogether, write a policy)"
            ));
        }
        Ok(())
    }
}

/// How long a call waits for a person's approval unless the config says otherwise.
pub const DEFAULT_APPROVAL_TIMEOUT: Duration = Duration::from_secs(120);

/// Most bridges one turn may have open at once, by default.
pub const DEFAULT_MAX_BRIDGES_PER_TURN: usize = 8;

/// Bridge connections one turn may make per minute, by default (as many at once, then one every
/// `60 s / N`): a harness connects a few times a turn; a loop of connections is refused.
pub const DEFAULT_MAX_BRIDGE_CONNECTS_PER_MINUTE: u32 = 120;

/// Arguments longer than this (as JSON text) are recorded by size and SHA-256, not inline.
pub const DEFAULT_RECORD_MAX_ARGUMENT_BYTES: usize = 64 * 1024;

/// Seconds between signed checkpoints of the record, unless the config says otherwise.
pub const DEFAULT_CHECKPOINT_SECONDS: u64 = 60;

/// Where the record's signing key is kept unless the config says: `<record>.key`.
pub fn default_signing_key(record: &Path) -> PathBuf {
    PathBuf::from(format!("{}.key", record.display()))
}

/// A group, by number or by name (looked up in `/etc/group`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum GroupRef {
    Id(u32),
    Name(String),
}

impl GroupRef {
    fn resolve(&self, key: &str) -> Result<u32, String> {
        match self {
            GroupRef::Id(g) => Ok(*g),
            GroupRef::Name(name) => group_by_name(Path::new("/etc/group"), name)
                .map_err(|e| format!("{key} = \"{name}\": {e}")),
        }
    }
}

/// A group's id from a `group(5)` file. Read directly rather than through NSS: `getgrnam` is
/// C (and `unsafe` is forbidden here); a group kept only in a directory service can be given by
/// number instead.
fn group_by_name(file: &Path, name: &str) -> Result<u32, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read `{}`: {e}", file.display()))?;
    for line in text.lines() {
        let mut fields = line.split(':');
        if fields.next() == Some(name) {
            return fields
                .nth(1)
                .and_then(|g| g.parse().ok())
                .ok_or_else(|| format!("`{}` has no usable gid for it", file.display()));
        }
    }
    Err(format!(
        "no such group in `{}` (give its number instead if it lives elsewhere)",
        file.display()
    ))
}

fn default_files_namespace() -> String {
    "files".into()
}

impl ProviderConfig {
    pub fn namespace(&self) -> &str {
        match self {
            ProviderConfig::Files { namespace, .. } => namespace,
            ProviderConfig::Mcp(m) => &m.namespace,
        }
    }
}

/// The config's `admin_group` alone, read before the rest: the config's own check needs it.
#[derive(Deserialize)]
struct AdminGroupOnly {
    #[serde(default)]
    admin_group: Option<GroupRef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    record: PathBuf,
    #[serde(default)]
    record_sync: RecordSync,
    policy: PathBuf,
    #[serde(default)]
    schema: Option<PathBuf>,
    #[serde(default)]
    redact_arguments: bool,
    #[serde(default)]
    record_max_argument_bytes: Option<usize>,
    /// The Ed25519 seed that signs checkpoints (made if missing); default `<record>.key`.
    #[serde(default)]
    record_signing_key: Option<PathBuf>,
    /// Seconds between signed checkpoints (0: only at shutdown and rotation); default 60.
    #[serde(default)]
    record_checkpoint_seconds: Option<u64>,
    /// Rotate the record when it reaches this many bytes.
    #[serde(default)]
    record_rotate_bytes: Option<u64>,
    /// Rotate the record when it is this many seconds old.
    #[serde(default)]
    record_rotate_seconds: Option<u64>,
    /// Each signed checkpoint is appended here (see `crate::evidence::witness`).
    #[serde(default)]
    witness_file: Option<PathBuf>,
    /// Each signed checkpoint is handed to this program on stdin (argv, no shell).
    #[serde(default)]
    witness_command: Vec<String>,
    /// The whole environment `witness_command` gets besides `PATH`, `LANG`, `HOME`.
    #[serde(default)]
    witness_env: BTreeMap<String, String>,
    /// How long one run of `witness_command` may take (default 10 s).
    #[serde(default)]
    witness_command_timeout_seconds: Option<u64>,
    #[serde(default)]
    max_bridges_per_turn: Option<usize>,
    #[serde(default)]
    max_bridge_connects_per_minute: Option<u32>,
    #[serde(default)]
    host_uids: Vec<u32>,
    #[serde(default)]
    harness_uids: Vec<u32>,
    #[serde(default)]
    harness_group: Option<GroupRef>,
    #[serde(default)]
    host_group: Option<GroupRef>,
    /// A group whose members may write the config, the policy, the schema and the pins.
    #[serde(default)]
    admin_group: Option<GroupRef>,
    #[serde(default)]
    default_ttl_seconds: Option<u64>,
    #[serde(default)]
    call_timeout_seconds: Option<u64>,
    /// Pin file for brokered providers' tool lists (`providers pin` writes it).
    #[serde(default)]
    pins: Option<PathBuf>,
    #[serde(default)]
    providers: Vec<ProviderConfig>,
    /// OpenTelemetry export (off unless present or `OTEL_EXPORTER_OTLP_*ENDPOINT` is set).
    #[serde(default)]
    otel: Option<OtelSettings>,
    /// How long a call waits for a person's approval (default 120 s).
    #[serde(default)]
    approval_timeout_seconds: Option<u64>,
    #[serde(default)]
    budgets: Vec<BudgetConfig>,
    /// `[first, last]`: uids for sandboxed upstreams without `run_as`, one per provider in
    /// config order (uid = gid), the broker being root.
    #[serde(default)]
    upstream_uids: Option<[u32; 2]>,
    /// `[first, last]`: uids for per-principal instances, one per principal and provider, for
    /// providers without their own `instance_uids` (the broker being root).
    #[serde(default)]
    instance_uids: Option<[u32; 2]>,
    /// The folder store of secrets (default `secrets` beside the config).
    #[serde(default)]
    secrets_dir: Option<PathBuf>,
    /// A helper command secrets are read from instead of the folder store.
    #[serde(default)]
    secret_command: Option<Vec<String>>,
    /// The whole environment `secret_command` gets besides `PATH`, `LANG` and `HOME` (the
    /// broker's `HOME`, so that `pass`, `gpg` and `op` find their stores).
    #[serde(default)]
    secret_env: BTreeMap<String, String>,
    /// How long the helper may run for one secret (default 10 s).
    #[serde(default)]
    secret_command_timeout_seconds: Option<u64>,
    /// The person's page (issue 45): off unless present.
    #[serde(default)]
    page: Option<RawPage>,
}

/// `[page]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPage {
    listen: String,
    public_url: String,
    #[serde(default)]
    cert: Option<PathBuf>,
    #[serde(default)]
    key: Option<PathBuf>,
    issuer: String,
    #[serde(default)]
    issuer_ca_file: Option<PathBuf>,
    client_id: String,
    #[serde(default)]
    client_secret_file: Option<PathBuf>,
    #[serde(default)]
    principal_claim: Option<String>,
    #[serde(default)]
    scopes: Option<Vec<String>>,
}

/// The person's page (`[page]`): where it listens, the URL people reach it at, its certificate,
/// and the operator's OpenID Connect provider that signs people in.
#[derive(Debug, Clone, PartialEq)]
pub struct PageConfig {
    pub listen: std::net::SocketAddr,
    /// The page's public base URL (ends in `/`): links and the sign-in's redirect are made
    /// from it.
    pub public_url: url::Url,
    /// The certificate chain and key (PEM): HTTPS. Without them, plain HTTP (loopback only).
    pub tls: Option<(PathBuf, PathBuf)>,
    pub issuer: String,
    /// Roots for the issuer's TLS besides the system's.
    pub issuer_ca_file: Option<PathBuf>,
    pub client_id: String,
    /// The client secret, read at start (none: a public client, PKCE alone).
    pub client_secret_file: Option<PathBuf>,
    /// The ID token claim whose value is the principal (default `sub`).
    pub principal_claim: String,
    pub scopes: Vec<String>,
}

/// A host that only this machine reaches: a loopback address or `localhost`.
fn loopback_host(url: &url::Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(a)) => a.is_loopback(),
        Some(url::Host::Ipv6(a)) => a.is_loopback(),
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        None => false,
    }
}

impl RawPage {
    fn resolve(self, rel: &dyn Fn(&Path) -> PathBuf) -> Result<PageConfig, String> {
        let listen: std::net::SocketAddr = self.listen.parse().map_err(|e| {
            format!(
                "[page] listen = {:?}: {e} (give an address and port, e.g. \"127.0.0.1:8443\")",
                self.listen
            )
        })?;
        let tls = match (self.cert, self.key) {
            (Some(c), Some(k)) => Some((rel(&c), rel(&k))),
            (None, None) => None,
            _ => {
                return Err(
                    "[page]: give both cert and key (PEM), or neither (plain HTTP on loopback)"
                        .into(),
                );
            }
        };
        if tls.is_none() && !listen.ip().is_loopback() {
            return Err(format!(
                "[page] listen = \"{listen}\" without cert and key: plain HTTP only on a loopback address; give cert and key (PEM) to serve HTTPS there"
            ));
        }
        let mut public = self.public_url.clone();
        if !public.ends_with('/') {
            public.push('/');
        }
        let public_url = url::Url::parse(&public)
            .map_err(|e| format!("[page] public_url = {:?}: {e}", self.public_url))?;
        match public_url.scheme() {
            "https" => {}
            "http" if tls.is_none() && loopback_host(&public_url) => {}
            _ => {
                return Err(format!(
                    "[page] public_url = {:?}: https (http only for a page on loopback without cert)",
                    self.public_url
                ));
            }
        }
        if public_url.query().is_some() || public_url.fragment().is_some() {
            return Err(format!(
                "[page] public_url = {:?}: no query or fragment",
                self.public_url
            ));
        }
        let issuer_url = url::Url::parse(&self.issuer)
            .map_err(|e| format!("[page] issuer = {:?}: {e}", self.issuer))?;
        if !(issuer_url.scheme() == "https"
            || (issuer_url.scheme() == "http" && loopback_host(&issuer_url)))
        {
            return Err(format!(
                "[page] issuer = {:?}: https (http only on loopback)",
                self.issuer
            ));
        }
        if self.client_id.is_empty() {
            return Err(
                "[page] client_id = \"\": give the client id registered with the identity provider"
                    .into(),
            );
        }
        let principal_claim = self.principal_claim.unwrap_or_else(|| "sub".into());
        if principal_claim.is_empty() {
            return Err("[page] principal_claim = \"\": name the ID token claim whose value is the principal (default sub)".into());
        }
        let scopes = self
            .scopes
            .unwrap_or_else(|| vec!["openid".into(), "profile".into()]);
        if !scopes.iter().any(|s| s == "openid") {
            return Err("[page] scopes: include \"openid\"".into());
        }
        Ok(PageConfig {
            listen,
            public_url,
            tls,
            issuer: self.issuer,
            issuer_ca_file: self.issuer_ca_file.as_deref().map(rel),
            client_id: self.client_id,
            client_secret_file: self.client_secret_file.as_deref().map(rel),
            principal_claim,
            scopes,
        })
    }
}

/// A resolved configuration (all paths absolute or relative to the working directory).
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it came from, for messages (`<embedded default>` or the file).
    pub source: String,
    pub record: PathBuf,
    pub record_sync: RecordSync,
    pub policy: PathBuf,
    pub schema: Option<PathBuf>,
    pub redact_arguments: bool,
    /// Arguments whose JSON text is longer are recorded as `argumentsDigest: {bytes, sha256}`
    /// instead of inline (the record must not grow with what a caller chooses to send).
    pub record_max_argument_bytes: usize,
    /// The Ed25519 seed that signs the record's checkpoints (made, 0600, if missing; its public
    /// half is written beside it, `<key>.pub`).
    pub record_signing_key: PathBuf,
    /// Time between signed checkpoints (zero: only at shutdown and before a rotation).
    pub record_checkpoint_interval: Duration,
    /// Rotate the record at this size (bytes), or this age; `None`: never.
    pub record_rotate_bytes: Option<u64>,
    pub record_rotate_age: Option<Duration>,
    /// Where each signed checkpoint is also appended, for `records verify --witness`.
    pub witness_file: Option<PathBuf>,
    /// A program each signed checkpoint is handed to (its stdin), off the call path, with its
    /// declared environment (`witness_env`) and time limit.
    pub witness_command: crate::evidence::witness::WitnessCommand,
    /// Most bridges (shim connections) one turn may have open at once.
    pub max_bridges_per_turn: usize,
    /// Bridge connections one turn may make per minute (a burst of as many, then one every
    /// `60 s / N`); the excess is refused (`connect_rate`).
    pub max_bridge_connects_per_minute: u32,
    /// Uids allowed on the control socket (empty: the broker's own uid).
    pub host_uids: Vec<u32>,
    /// Uids allowed on the bridge socket (empty: the broker's own uid).
    pub harness_uids: Vec<u32>,
    /// The group whose members may reach `bridge.sock` (0660, this group): harnesses under
    /// their own uids. None: the socket is the broker's uid's only. The peer-uid check
    /// (`harness_uids`) stays the authority; the group only lets the connection be made.
    pub harness_group: Option<u32>,
    /// The same for `control.sock` and host uids.
    pub host_group: Option<u32>,
    /// `admin_group`: a group whose members may write the config, the policy, the schema and the
    /// pins (and their folders); otherwise only the broker's uid or root may.
    pub admin_group: Option<u32>,
    pub default_ttl: Duration,
    pub call_timeout: Duration,
    pub pins: Option<PathBuf>,
    pub providers: Vec<ProviderConfig>,
    /// The `[otel]` section, as written (`telemetry::effective` adds the standard variables).
    pub otel: Option<OtelSettings>,
    /// How long a call held for approval waits before it is refused `denied/approval_timeout`.
    pub approval_timeout: Duration,
    /// `[[budgets]]`, checked at load.
    pub budgets: Vec<BudgetConfig>,
    /// The folder relative paths in provider entries resolve against.
    pub base: PathBuf,
    /// Uids for per-principal instances of providers without their own range (`instance_uids`).
    pub instance_uids: Option<[u32; 2]>,
    /// The folder store of secrets (`secrets_dir`; default `<config folder>/secrets`).
    pub secrets_dir: PathBuf,
    /// `secret_command`: secrets come from this helper instead of the folder.
    pub secret_command: Option<Vec<String>>,
    /// How long `secret_command` may run for one secret.
    pub secret_command_timeout: Duration,
    /// What `secret_command` gets besides `PATH`, `LANG` and `HOME` (none of the broker's own
    /// environment).
    pub secret_env: BTreeMap<String, String>,
    /// `[page]`: the person's page (none: principals' approvals are asked in the harness).
    pub page: Option<PageConfig>,
}

impl Config {
    /// Reads a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        // Checked as the broker's own files are (its owner and mode, its folders), with the
        // `admin_group` it names, before its text is used.
        let text = crate::trusted::read_settings(path, "config", |text| {
            toml::from_str::<AdminGroupOnly>(text)
                .ok()
                .and_then(|g| g.admin_group)
                .and_then(|g| g.resolve("admin_group").ok())
        })
        .map_err(|e| match e {
            TrustError::Io { source, .. } => ConfigError::Read {
                path: shown.clone(),
                source,
            },
            e => ConfigError::Parse {
                path: shown.clone(),
                detail: e.to_string(),
            },
        })?;
        let mut raw: RawConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: shown.clone(),
            detail: e.to_string(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let rel = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            }
        };
        let mut namespaces = std::collections::HashSet::new();
        for p in &raw.providers {
            let ns = match p {
                ProviderConfig::Files { namespace, .. } => namespace,
                ProviderConfig::Mcp(m) => &m.namespace,
            };
            if let ProviderConfig::Mcp(m) = p {
                m.check().map_err(|detail| ConfigError::Parse {
                    path: shown.clone(),
                    detail,
                })?;
            }
            if !namespaces.insert(ns.clone()) {
                return Err(ConfigError::Parse {
                    path: shown,
                    detail: format!(
                        "two providers share namespace `{ns}`: each provider needs its own"
                    ),
                });
            }
        }
        for p in &raw.providers {
            if let ProviderConfig::Mcp(m) = p {
                m.check_secrets().map_err(|detail| ConfigError::Parse {
                    path: shown.clone(),
                    detail,
                })?;
            }
        }
        crate::child::check_env(
            "witness_env",
            raw.witness_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .map_err(|detail| ConfigError::Parse {
            path: shown.clone(),
            detail,
        })?;
        crate::child::check_env(
            "secret_env",
            raw.secret_env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .map_err(|detail| ConfigError::Parse {
            path: shown.clone(),
            detail,
        })?;
        if raw.secret_command.as_ref().is_some_and(Vec::is_empty) {
            return Err(ConfigError::Parse {
                path: shown,
                detail: "secret_command = []: give the helper's program and its arguments".into(),
            });
        }
        if raw.providers.is_empty() {
            return Err(ConfigError::Parse {
                path: shown,
                detail: "no [[providers]]: a broker with no tools publishes an empty catalogue"
                    .into(),
            });
        }
        let group = |g: Option<GroupRef>, key: &str| {
            g.map(|g| g.resolve(key))
                .transpose()
                .map_err(|detail| ConfigError::Parse {
                    path: shown.clone(),
                    detail,
                })
        };
        for (i, b) in raw.budgets.iter().enumerate() {
            b.check(i, &raw.providers)
                .map_err(|detail| ConfigError::Parse {
                    path: shown.clone(),
                    detail,
                })?;
        }
        match raw.approval_timeout_seconds {
            Some(0) => {
                return Err(ConfigError::Parse {
                    path: shown,
                    detail: "approval_timeout_seconds = 0: a call held for approval needs at least 1 s for a person to decide".into(),
                });
            }
            Some(s) if Duration::from_secs(s) > MAX_TTL => {
                return Err(ConfigError::Parse {
                    path: shown,
                    detail: format!(
                        "approval_timeout_seconds = {s}: at most {} (a turn's longest life)",
                        MAX_TTL.as_secs()
                    ),
                });
            }
            _ => {}
        }
        let page = match raw.page.take() {
            None => None,
            Some(p) => Some(p.resolve(&rel).map_err(|detail| ConfigError::Parse {
                path: shown.clone(),
                detail,
            })?),
        };
        if page.is_none()
            && let Some(ns) = raw.providers.iter().find_map(|p| match p {
                ProviderConfig::Mcp(m)
                    if m.oauth.as_ref().map(|o| o.grant) == Some(OAuthGrant::AuthorizationCode) =>
                {
                    Some(m.namespace.clone())
                }
                _ => None,
            })
        {
            return Err(ConfigError::Parse {
                path: shown,
                detail: format!(
                    "provider `{ns}`: grant = \"authorization_code\" signs people in on the person's page: configure `[page]`, or use another grant"
                ),
            });
        }
        if let Some(range) = raw.upstream_uids {
            allocate_uids(range, &mut raw.providers).map_err(|detail| ConfigError::Parse {
                path: shown.clone(),
                detail,
            })?;
        }
        if rustix::process::geteuid().is_root() {
            let besides: Vec<u32> = raw
                .host_uids
                .iter()
                .chain(&raw.harness_uids)
                .copied()
                .collect();
            default_uids(&mut raw.providers, &besides, raw.instance_uids.as_slice()).map_err(
                |detail| ConfigError::Parse {
                    path: shown.clone(),
                    detail,
                },
            )?;
        }
        for p in &raw.providers {
            if let ProviderConfig::Mcp(m) = p {
                check_sandbox(m, &raw.host_uids, &raw.harness_uids).map_err(|detail| {
                    ConfigError::Parse {
                        path: shown.clone(),
                        detail,
                    }
                })?;
            }
        }
        check_instance_uids(
            raw.instance_uids,
            &raw.providers,
            &raw.host_uids,
            &raw.harness_uids,
        )
        .map_err(|detail| ConfigError::Parse {
            path: shown.clone(),
            detail,
        })?;
        let harness_group = group(raw.harness_group, "harness_group")?;
        let host_group = group(raw.host_group, "host_group")?;
        let admin_group = group(raw.admin_group, "admin_group")?;
        Ok(Config {
            source: shown,
            record_signing_key: raw
                .record_signing_key
                .as_deref()
                .map_or_else(|| default_signing_key(&rel(&raw.record)), rel),
            record_checkpoint_interval: Duration::from_secs(
                raw.record_checkpoint_seconds
                    .unwrap_or(DEFAULT_CHECKPOINT_SECONDS),
            ),
            record_rotate_bytes: raw.record_rotate_bytes.filter(|b| *b > 0),
            record_rotate_age: raw
                .record_rotate_seconds
                .filter(|s| *s > 0)
                .map(Duration::from_secs),
            witness_file: raw.witness_file.as_deref().map(rel),
            witness_command: crate::evidence::witness::WitnessCommand {
                argv: raw.witness_command,
                env: raw.witness_env,
                timeout: raw
                    .witness_command_timeout_seconds
                    .filter(|s| *s > 0)
                    .map_or(
                        crate::evidence::witness::WITNESS_COMMAND_TIMEOUT,
                        Duration::from_secs,
                    ),
            },
            record: rel(&raw.record),
            record_sync: raw.record_sync,
            policy: rel(&raw.policy),
            schema: raw.schema.as_deref().map(rel),
            redact_arguments: raw.redact_arguments,
            record_max_argument_bytes: raw
                .record_max_argument_bytes
                .unwrap_or(DEFAULT_RECORD_MAX_ARGUMENT_BYTES),
            max_bridges_per_turn: raw
                .max_bridges_per_turn
                .unwrap_or(DEFAULT_MAX_BRIDGES_PER_TURN)
                .max(1),
            max_bridge_connects_per_minute: raw
                .max_bridge_connects_per_minute
                .unwrap_or(DEFAULT_MAX_BRIDGE_CONNECTS_PER_MINUTE)
                .max(1),
            host_uids: raw.host_uids,
            harness_uids: raw.harness_uids,
            harness_group,
            host_group,
            admin_group,
            default_ttl: raw
                .default_ttl_seconds
                .map_or(DEFAULT_TTL, Duration::from_secs)
                .min(MAX_TTL),
            call_timeout: raw
                .call_timeout_seconds
                .map_or(DEFAULT_CALL_TIMEOUT, Duration::from_secs),
            providers: raw
                .providers
                .into_iter()
                .map(|p| match p {
                    ProviderConfig::Files {
                        namespace,
                        root,
                        writable,
                        latency_ms,
                    } => ProviderConfig::Files {
                        namespace,
                        root: rel(&root),
                        writable,
                        latency_ms,
                    },
                    ProviderConfig::Mcp(mut m) => {
                        for t in m.tools.values_mut() {
                            t.file_root = t.file_root.as_deref().map(rel);
                        }
                        if let SandboxSetting::On(sb) = &mut m.sandbox {
                            for p in sb.read.iter_mut().chain(sb.write.iter_mut()) {
                                *p = rel(p);
                            }
                        }
                        for f in [&mut m.ca_file, &mut m.client_cert, &mut m.client_key] {
                            *f = f.as_deref().map(rel);
                        }
                        ProviderConfig::Mcp(m)
                    }
                })
                .collect(),
            pins: raw.pins.as_deref().map(rel),
            otel: raw.otel,
            approval_timeout: raw
                .approval_timeout_seconds
                .map_or(DEFAULT_APPROVAL_TIMEOUT, Duration::from_secs),
            budgets: raw.budgets,
            instance_uids: raw.instance_uids,
            secrets_dir: raw
                .secrets_dir
                .as_deref()
                .map_or_else(|| crate::secrets::default_dir(base), rel),
            secret_command: raw.secret_command,
            secret_env: raw.secret_env,
            secret_command_timeout: raw
                .secret_command_timeout_seconds
                .filter(|s| *s > 0)
                .map_or(crate::secrets::SECRET_COMMAND_TIMEOUT, Duration::from_secs),
            base: base.to_path_buf(),
            page,
        })
    }

    /// Where the embedded default laid out in `dir` keeps its record (nothing is created).
    pub fn embedded_record(dir: &Path) -> PathBuf {
        dir.join("record.jsonl")
    }

    /// The embedded default, laid out in `dir`: `data/public/hello.txt`,
    /// `data/private/secret.txt`, `policy.cedar`, `record.jsonl`. Existing files are kept. `dir`
    /// and every folder made in it are checked before anything is made in them
    /// ([`TrustedDir`]); a seed file that is a link or another uid's is refused by name, and the
    /// seed files are created without following links, never over something there.
    pub fn embedded(dir: &Path) -> Result<Self, ConfigError> {
        let held = TrustedDir::open(dir, true)?;
        let data_dir = held.subdir("data", true)?;
        let public = data_dir.subdir("public", true)?;
        let private = data_dir.subdir("private", true)?;
        let seed = [
            (
                &public,
                "hello.txt",
                "Hello from SharedOS. This file is public.\n",
            ),
            (
                &private,
                "secret.txt",
                "This file is private: alice may not read it.\n",
            ),
            (&held, "policy.cedar", DEFAULT_POLICY),
        ];
        for (folder, name, text) in seed {
            if folder.check_file(name)?.is_none() {
                folder.create_whole(name, text.as_bytes(), 0o644)?;
            }
        }
        let data = dir.join("data");
        Ok(Config {
            source: "<embedded default>".into(),
            record: Self::embedded_record(dir),
            record_signing_key: default_signing_key(&Self::embedded_record(dir)),
            record_checkpoint_interval: Duration::from_secs(DEFAULT_CHECKPOINT_SECONDS),
            record_rotate_bytes: None,
            record_rotate_age: None,
            witness_file: None,
            witness_command: crate::evidence::witness::WitnessCommand::default(),
            record_sync: RecordSync::Always,
            policy: dir.join("policy.cedar"),
            schema: None,
            redact_arguments: false,
            record_max_argument_bytes: DEFAULT_RECORD_MAX_ARGUMENT_BYTES,
            max_bridges_per_turn: DEFAULT_MAX_BRIDGES_PER_TURN,
            max_bridge_connects_per_minute: DEFAULT_MAX_BRIDGE_CONNECTS_PER_MINUTE,
            host_uids: vec![],
            harness_uids: vec![],
            harness_group: None,
            host_group: None,
            admin_group: None,
            default_ttl: DEFAULT_TTL,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            providers: vec![ProviderConfig::Files {
                namespace: "files".into(),
                root: data,
                writable: false,
                latency_ms: None,
            }],
            pins: None,
            otel: None,
            approval_timeout: DEFAULT_APPROVAL_TIMEOUT,
            budgets: Vec::new(),
            instance_uids: None,
            secrets_dir: crate::secrets::default_dir(dir),
            secret_command: None,
            secret_command_timeout: crate::secrets::SECRET_COMMAND_TIMEOUT,
            secret_env: BTreeMap::new(),
            base: dir.to_path_buf(),
            page: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_table_is_checked() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        let base = "record = \"r.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"files\"\nroot = \"d\"\n";
        let page = "[page]\nlisten = \"127.0.0.1:8443\"\npublic_url = \"http://127.0.0.1:8443\"\nissuer = \"http://127.0.0.1:9000\"\nclient_id = \"c\"\n";
        let load = |text: String| {
            std::fs::write(&path, text).expect("w");
            Config::from_file(&path).map_err(|e| e.to_string())
        };
        let c = load(format!("{base}{page}")).expect("valid");
        let p = c.page.expect("page");
        assert_eq!(p.public_url.as_str(), "http://127.0.0.1:8443/");
        assert_eq!((p.principal_claim.as_str(), p.tls), ("sub", None));
        assert_eq!(p.scopes, ["openid", "profile"]);
        let e = load(format!(
            "{base}{}",
            page.replace("127.0.0.1:8443\"\npublic", "0.0.0.0:8443\"\npublic")
        ))
        .expect_err("plain http off loopback");
        assert!(e.contains("plain HTTP only on a loopback address"), "{e}");
        let e = load(format!("{base}{page}cert = \"c.pem\"\n")).expect_err("cert alone");
        assert!(e.contains("both cert and key"), "{e}");
        let e = load(format!(
            "{base}{}",
            page.replace("http://127.0.0.1:9000", "http://login.example.com")
        ))
        .expect_err("issuer over http");
        assert!(e.contains("[page] issuer"), "{e}");
        let tls = load(format!(
            "{base}{}cert = \"c.pem\"\nkey = \"k.pem\"\n",
            page.replace(
                "http://127.0.0.1:8443",
                "https://approvals.example.com/sharedos"
            )
        ))
        .expect("https")
        .page
        .expect("page");
        assert_eq!(
            tls.public_url.join("callback").expect("join").as_str(),
            "https://approvals.example.com/sharedos/callback"
        );
        assert_eq!(tls.tls.map(|t| t.0), Some(dir.path().join("c.pem")));
        let e = load(format!("{base}{page}scopes = [\"profile\"]\n")).expect_err("no openid");
        assert!(e.contains("openid"), "{e}");
    }

    #[test]
    fn the_oauth_table_is_checked() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        let base = "record = \"r.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\n";
        let oauth = "[providers.oauth]\ntoken_url = \"https://auth.example.com/token\"\nclient_id = \"c\"\nclient_secret = { secret = \"s\", shared = true }\n";
        let load = |text: String| {
            std::fs::write(&path, text).expect("w");
            Config::from_file(&path)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        load(format!(
            "{base}url = \"https://mcp.example.com/mcp\"\n{oauth}"
        ))
        .expect("valid");
        let e = load(format!("{base}command = \"srv\"\n{oauth}")).expect_err("stdio");
        assert!(e.contains("`oauth` is for a remote provider"), "{e}");
        let e = load(format!(
            "{base}url = \"https://mcp.example.com/mcp\"\nheaders = {{ Authorization = \"Bearer x\" }}\n{oauth}"
        ))
        .expect_err("both");
        assert!(e.contains("not both"), "{e}");
        let e = load(format!(
            "{base}url = \"https://mcp.example.com/mcp\"\n{}",
            oauth.replace("https://auth", "http://auth")
        ))
        .expect_err("plain http");
        assert!(
            e.contains("oauth.token_url") && e.contains("not loopback"),
            "{e}"
        );
        let e = load(format!(
            "{base}url = \"https://mcp.example.com/mcp\"\n{oauth}grant = \"password\"\n"
        ))
        .expect_err("grant");
        assert!(e.contains("password"), "{e}");
        // Issue 45: people sign in for their own instances, on the page.
        let code = "[providers.oauth]\ngrant = \"authorization_code\"\n";
        let page = "[page]\nlisten = \"127.0.0.1:8443\"\npublic_url = \"http://127.0.0.1:8443/\"\nissuer = \"http://127.0.0.1:9000\"\nclient_id = \"c\"\n";
        let remote = "url = \"https://mcp.example.com/mcp\"\n";
        let e = load(format!("{base}{remote}{code}")).expect_err("shared");
        assert!(
            e.contains("provider `r`") && e.contains("instances = \"per_principal\""),
            "{e}"
        );
        let per = "instances = \"per_principal\"\nlist_as = \"alice\"\n";
        let e = load(format!("{base}{remote}{per}{code}")).expect_err("no page");
        assert!(
            e.contains("provider `r`") && e.contains("configure `[page]`"),
            "{e}"
        );
        load(format!("{base}{remote}{per}{code}{page}")).expect("valid");
        let e = load(format!(
            "{base}{remote}instances = \"per_principal\"\n{code}{page}"
        ))
        .expect_err("no list_as");
        assert!(e.contains("list_as"), "{e}");
        let e = load(format!(
            "{base}{remote}{per}{code}token_url = \"https://a/t\"\n{page}"
        ))
        .expect_err("token_url");
        assert!(e.contains("remove oauth.token_url"), "{e}");
    }

    /// Issue 45 item 4: token exchange is checked at load, naming the provider and the fix.
    #[test]
    fn the_token_exchange_grant_is_checked() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        let base = "record = \"r.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = \"https://mcp.example.com/mcp\"\n";
        let load = |text: String| {
            std::fs::write(&path, text).expect("w");
            Config::from_file(&path)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let per = "instances = \"per_principal\"\nlist_as = \"alice\"\n";
        let tx = "[providers.oauth]\ngrant = \"token_exchange\"\nclient_id = \"c\"\n";
        load(format!("{base}{per}{tx}")).expect("valid, no [page] needed");
        load(format!(
            "{base}{per}{tx}client_secret = {{ secret = \"s\", shared = true }}\ntoken_url = \"https://auth/t\"\naudience = \"a\"\nsubject_token_type = \"id_token\"\n"
        ))
        .expect("valid, every key");
        let e = load(format!("{base}{tx}")).expect_err("shared");
        assert!(
            e.contains("provider `r`") && e.contains("instances = \"per_principal\""),
            "{e}"
        );
        let e = load(format!("{base}instances = \"per_principal\"\n{tx}")).expect_err("list_as");
        assert!(e.contains("set `list_as"), "{e}");
        let e = load(format!(
            "{base}{per}[providers.oauth]\ngrant = \"token_exchange\"\n"
        ))
        .expect_err("client_id");
        assert!(e.contains("needs oauth.client_id"), "{e}");
        let e = load(format!(
            "{base}{per}{tx}client_secret = {{ secret = \"s\" }}\n"
        ))
        .expect_err("per-principal secret");
        assert!(e.contains("shared = true"), "{e}");
        let e = load(format!(
            "{base}{per}{tx}token_url = \"http://auth.example/t\"\n"
        ))
        .expect_err("plain http");
        assert!(e.contains("oauth.token_url"), "{e}");
        let e = load(format!("{base}{per}{tx}subject_token_type = \"saml\"\n")).expect_err("type");
        assert!(e.contains("saml"), "{e}");
        let e = load(format!(
            "{base}[providers.oauth]\ntoken_url = \"https://auth/t\"\nclient_id = \"c\"\nclient_secret = \"s\"\naudience = \"a\"\n"
        ))
        .expect_err("audience elsewhere");
        assert!(e.contains("for grant = \"token_exchange\""), "{e}");
    }

    /// Issue 46: the connection pool's keys, for a remote provider only, bounded.
    #[test]
    fn the_pool_keys_are_checked() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        let base = "record = \"r.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\n";
        let load = |text: String| {
            std::fs::write(&path, text).expect("w");
            Config::from_file(&path)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let url = "url = \"https://mcp.example.com/mcp\"\n";
        load(format!(
            "{base}{url}max_connections = 256\nidle_connection_seconds = 0\n"
        ))
        .expect("valid");
        for n in [0, 257] {
            let e = load(format!("{base}{url}max_connections = {n}\n")).expect_err("bound");
            assert!(
                e.contains(&format!("max_connections = {n}: from 1 to 256")),
                "{e}"
            );
        }
        for key in ["max_connections = 2", "idle_connection_seconds = 9"] {
            let e = load(format!("{base}command = \"srv\"\n{key}\n")).expect_err("stdio");
            let name = key.split(' ').next().unwrap_or_default();
            assert!(
                e.contains(&format!("`{name}` is for a remote provider")),
                "{e}"
            );
        }
    }

    /// Issue 42 item 9: URLs are read as the HTTP client reads them.
    #[test]
    fn urls_are_read_as_the_http_client_reads_them() {
        let refused = [
            ("http://192.0.2.2:8080\\@127.0.0.1/mcp", "`\\`"),
            ("http://127.0.0.1\\@evil.example/", "`\\`"),
            ("http://evil.example\\\\@127.0.0.1/", "`\\`"),
            ("http://user@127.0.0.1/", "user info"),
            ("http://user:pa55word@127.0.0.1/", "user info"),
            ("https://user:pa55word@mcp.example.com/", "user info"),
            ("http://evil%5C@127.0.0.1/", "user info"),
            ("http://127.0.0.1.evil.example/", "not loopback"),
            ("http://127.0.0.1\t.evil.example/", "control"),
            ("http://evil\n.example@127.0.0.1/", "control"),
            (" http://127.0.0.1/", "whitespace"),
            ("ftp://127.0.0.1/", "scheme `ftp`"),
            ("127.0.0.1:8080", "not an http"),
            ("http:///mcp", "not loopback"),
        ];
        for (url, problem) in refused {
            let e = check_url("r", "url", url, false).expect_err(url);
            assert!(
                e.contains("provider `r`: url `") && e.contains(problem),
                "{url}: {e}"
            );
            assert!(!e.contains("pa55word"), "{e}");
        }
        for url in [
            "http://127.0.0.1:8080/mcp",
            "http://0x7f000001/",
            "http://127.1.2.3/",
            "http://[::1]:9/",
            "http://LOCALHOST/",
            "https://mcp.example.com/mcp",
        ] {
            assert!(check_url("r", "url", url, false).is_ok(), "{url}");
        }
        // `insecure_http` lets plain HTTP go anywhere, never user info or a backslash.
        assert!(check_url("r", "url", "http://192.0.2.1/", true).is_ok());
        assert!(check_url("r", "url", "http://u@192.0.2.1/", true).is_err());
        assert!(check_url("r", "url", "http://a\\@192.0.2.1/", true).is_err());
    }

    /// Issue 44 item 2: a template says what a call touches with exactly one of `file`, `url`
    /// and `entity`, and each is checked at load, naming the tool.
    #[test]
    fn templates_name_one_kind_of_resource() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        let base = "record = \"r.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"mcp\"\nnamespace = \"gh\"\ncommand = \"srv\"\n[providers.tools.t]\naction = \"write\"\n";
        let load = |extra: &str| {
            std::fs::write(&path, format!("{base}{extra}")).expect("w");
            Config::from_file(&path).map_err(|e| e.to_string())
        };
        let tools = |c: Config| match c.providers.into_iter().next() {
            Some(ProviderConfig::Mcp(m)) => m.tools,
            other => panic!("{other:?}"),
        };
        let t = tools(load("url = \"{url}\"\n").expect("url"));
        assert_eq!(t["t"].resource_type(), "Url");
        assert_eq!(t["t"].args(), ["url"]);
        let t = tools(
            load("entity = { type = \"Github::Repo\", id = \"{owner}/{repo}\", attributes = { owner = \"{owner}\", private = \"{private}\", title = \"Re: {title}\" } }\n")
                .expect("entity"),
        );
        assert_eq!(t["t"].resource_type(), "Github::Repo");
        assert_eq!(t["t"].args(), ["owner", "repo", "private", "title"]);
        let t = tools(
            load("entity = { type = \"SharedOS::Channel\", id = \"{channel}\" }\n")
                .expect("entity"),
        );
        assert_eq!(t["t"].resource_type(), "Channel");
        let t = tools(load("entity = { type = \"Transfer\", id = \"transfer\", attributes = { amount = \"{amount}\" } }\n").expect("fixed id"));
        assert_eq!(t["t"].args(), ["amount"]);
        assert_eq!(
            tools(load("file = \"{path}\"\n").expect("file"))["t"].resource_type(),
            "File"
        );
        for (extra, problem) in [
            ("", "exactly one of `file`"),
            (
                "file = \"{path}\"\nurl = \"{url}\"\n",
                "exactly one of `file`",
            ),
            (
                "url = \"{url}\"\nentity = { type = \"A\", id = \"{a}\" }\n",
                "exactly one of `file`",
            ),
            (
                "url = \"{url}\"\nfile_root = \"/srv\"\n",
                "`file_root` goes with `file`",
            ),
            ("url = \"\"\n", "`url` is empty"),
            ("url = \"{}\"\n", "malformed `{}`"),
            (
                "entity = { type = \"Repo\", id = \"\" }\n",
                "`entity.id` is empty",
            ),
            (
                "entity = { type = \"Github::\", id = \"{a}\" }\n",
                "not a Cedar type name",
            ),
            (
                "entity = { type = \"Git hub\", id = \"{a}\" }\n",
                "not a Cedar type name",
            ),
            (
                "entity = { type = \"1Repo\", id = \"{a}\" }\n",
                "not a Cedar type name",
            ),
            (
                "entity = { type = \"File\", id = \"{a}\" }\n",
                "one the broker makes itself",
            ),
            (
                "entity = { type = \"SharedOS::Url\", id = \"{a}\" }\n",
                "one the broker makes itself",
            ),
            (
                "entity = { type = \"Repo\", id = \"{a}\", attributes = { x = \"{a{b}\" } }\n",
                "entity.attributes.x",
            ),
            (
                "entity = { type = \"Repo\", id = \"{a}\", attrs = {} }\n",
                "attrs",
            ),
        ] {
            let e = load(extra).expect_err(extra);
            assert!(e.contains(problem), "{extra}: {e}");
            assert!(
                e.contains("attrs") || e.contains("[providers.tools.t]"),
                "{extra}: {e}"
            );
        }
    }

    #[test]
    fn the_otel_section() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        let base = "record = \"r.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"files\"\nroot = \"data\"\n";
        std::fs::write(&path, base).expect("w");
        assert_eq!(Config::from_file(&path).expect("config").otel, None);
        std::fs::write(
            &path,
            format!("{base}[otel]\nendpoint = \"http://127.0.0.1:4318\"\nprincipal = false\n"),
        )
        .expect("w");
        let otel = Config::from_file(&path)
            .expect("config")
            .otel
            .expect("otel");
        assert_eq!(otel.endpoint.as_deref(), Some("http://127.0.0.1:4318"));
        assert!(!otel.principal && otel.metrics && otel.enabled);
        std::fs::write(&path, format!("{base}[otel]\nendpont = \"x\"\n")).expect("w");
        let e = Config::from_file(&path)
            .expect_err("unknown key")
            .to_string();
        assert!(e.contains("endpont"), "{e}");
    }

    #[test]
    fn relative_paths_and_errors() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("broker.toml");
        std::fs::write(
            &path,
            "record = \"rec.jsonl\"\npolicy = \"p.cedar\"\n[[providers]]\ntype = \"files\"\nroot = \"data\"\n",
        )
        .expect("w");
        let c = Config::from_file(&path).expect("config");
        assert_eq!(c.record, dir.path().join("rec.jsonl"));
        assert_eq!(
            c.providers,
            vec![ProviderConfig::Files {
                namespace: "files".into(),
                root: dir.path().join("data"),
                writable: false,
                latency_ms: None,
            }]
        );
        std::fs::write(
            &path,
            "record = \"r\"\npolicy = \"p\"\n[[providers]]\ntype = \"ftp\"\n",
        )
        .expect("w");
        let msg = Config::from_file(&path)
            .expect_err("unknown type")
            .to_string();
        assert!(
            msg.contains("broker.toml") && msg.contains("line 4") && msg.contains("ftp"),
            "{msg}"
        );
        for (bad, says) in [
            (
                "approval_timeout_seconds = 0",
                "approval_timeout_seconds = 0",
            ),
            ("approval_timeout_seconds = 99999999", "at most 604800"),
        ] {
            std::fs::write(
                &path,
                format!("record = \"r\"\npolicy = \"p\"\n{bad}\n[[providers]]\ntype = \"files\"\nroot = \"data\"\n"),
            )
            .expect("w");
            let msg = Config::from_file(&path).expect_err(bad).to_string();
            assert!(msg.contains(says), "{msg}");
        }
        let msg = Config::from_file(&dir.path().join("missing.toml"))
            .expect_err("missing")
            .to_string();
        assert!(msg.contains("missing.toml"), "{msg}");
    }
}
