//! Run declarations: [`ToolPolicy`] (which tool classes a run had) and [`SystemIdentity`] (what
//! a column ran: harness, MCP support, declared model, catalogue).
//!
//! Both are validated on construction from JSON (`validate`); a declaration whose headline claim
//! its own manifest would contradict is rejected, never stored.

use serde::{Deserialize, Serialize};

use crate::catalog::CatalogHash;

/// Strict: the managed catalogue is the only tool set besides named harness-local tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyMode {
    #[default]
    Strict,
    Open,
}

/// Which tool classes a run had (ADR: "Three tool classes").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolPolicy {
    pub mode: PolicyMode,
    /// The CLI's own tools (patch tool, bounded shell), named one by one.
    #[serde(default)]
    pub harness_local: Vec<String>,
    /// Tools configured in the harness outside SharedOS.
    #[serde(default)]
    pub external_direct: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolPolicyError {
    #[error("a strict tool policy cannot list externalDirect tools (`{0}`)")]
    StrictWithExternalDirect(String),
    #[error("a strict tool policy must name harnessLocal tools one by one; `{0}` is a wildcard")]
    Wildcard(String),
    #[error(
        "a strict tool policy for a CLI harness must name its harnessLocal tools; the list is empty"
    )]
    EmptyHarnessLocal,
    #[error("harnessLocal entry `{0}` is empty or not printable")]
    BadEntry(String),
}

impl ToolPolicy {
    /// Checks the ToolPolicy rules. `cli_harness`: the run drives a CLI harness (which always has
    /// tools of its own, so an empty local surface would misdeclare it).
    pub fn validate(&self, cli_harness: bool) -> Result<(), ToolPolicyError> {
        for entry in self.harness_local.iter().chain(&self.external_direct) {
            if entry.trim().is_empty() || entry.chars().any(char::is_control) {
                return Err(ToolPolicyError::BadEntry(crate::name::shown(entry)));
            }
        }
        if self.mode == PolicyMode::Strict {
            if let Some(first) = self.external_direct.first() {
                return Err(ToolPolicyError::StrictWithExternalDirect(first.clone()));
            }
            if let Some(w) = self
                .harness_local
                .iter()
                .find(|e| e.contains('*') || e.contains('?'))
            {
                return Err(ToolPolicyError::Wildcard(w.clone()));
            }
            if cli_harness && self.harness_local.is_empty() {
                return Err(ToolPolicyError::EmptyHarnessLocal);
            }
        }
        Ok(())
    }
}

/// How a harness reaches MCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum McpSupport {
    /// The harness ships its own MCP client.
    Native,
    /// A host-installed extension provides the MCP client (pi + pi-mcp-adapter).
    Extension,
}

/// What a run was: stamped on every record line a column produces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SystemIdentity {
    pub harness: String,
    #[serde(default)]
    pub harness_version: Option<String>,
    pub mcp_support: McpSupport,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extension: Option<String>,
    /// The model the host says it configured. SharedOS selects nothing; it records this.
    pub declared_model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalog_hash: Option<CatalogHash>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_version: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SystemIdentityError {
    #[error("mcpSupport is `extension` but no extension is named")]
    MissingExtension,
    #[error("extension `{0}` is named but mcpSupport is `native`")]
    UnexpectedExtension(String),
    #[error("systemIdentity field `{0}` is empty")]
    Empty(&'static str),
}

impl SystemIdentity {
    pub fn validate(&self) -> Result<(), SystemIdentityError> {
        if self.harness.trim().is_empty() {
            return Err(SystemIdentityError::Empty("harness"));
        }
        if self.declared_model.trim().is_empty() {
            return Err(SystemIdentityError::Empty("declaredModel"));
        }
        match (self.mcp_support, &self.extension) {
            (McpSupport::Extension, None) => Err(SystemIdentityError::MissingExtension),
            (McpSupport::Extension, Some(e)) if e.trim().is_empty() => {
                Err(SystemIdentityError::MissingExtension)
            }
            (McpSupport::Native, Some(e)) => {
                Err(SystemIdentityError::UnexpectedExtension(e.clone()))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(v: serde_json::Value) -> ToolPolicy {
        serde_json::from_value(v).expect("policy")
    }

    #[test]
    fn strict_rules() {
        assert!(
            policy(json!({"mode": "strict", "harnessLocal": ["Bash"]}))
                .validate(true)
                .is_ok()
        );
        assert_eq!(
            policy(json!({"mode": "strict", "harnessLocal": ["Bash"], "externalDirect": ["jira"]}))
                .validate(true),
            Err(ToolPolicyError::StrictWithExternalDirect("jira".into()))
        );
        assert_eq!(
            policy(json!({"mode": "strict", "harnessLocal": ["mcp__*"]})).validate(true),
            Err(ToolPolicyError::Wildcard("mcp__*".into()))
        );
        assert_eq!(
            policy(json!({"mode": "strict"})).validate(true),
            Err(ToolPolicyError::EmptyHarnessLocal)
        );
        assert!(policy(json!({"mode": "strict"})).validate(false).is_ok());
        assert!(
            policy(json!({"mode": "open", "externalDirect": ["jira"]}))
                .validate(true)
                .is_ok()
        );
        assert!(serde_json::from_value::<ToolPolicy>(json!({"mode": "strict", "x": 1})).is_err());
    }

    #[test]
    fn extension_exactly_when_extension() {
        let id = |v: serde_json::Value| serde_json::from_value::<SystemIdentity>(v).expect("id");
        let base = json!({"harness": "pi", "declaredModel": "m"});
        let mut ext = base.clone();
        ext["mcpSupport"] = json!("extension");
        assert_eq!(
            id(ext.clone()).validate(),
            Err(SystemIdentityError::MissingExtension)
        );
        ext["extension"] = json!("pi-mcp-adapter");
        assert!(id(ext).validate().is_ok());
        let mut native = base.clone();
        native["mcpSupport"] = json!("native");
        assert!(id(native.clone()).validate().is_ok());
        native["extension"] = json!("x");
        assert!(matches!(
            id(native).validate(),
            Err(SystemIdentityError::UnexpectedExtension(_))
        ));
    }
}
