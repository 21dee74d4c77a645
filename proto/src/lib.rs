//! `sharedos-proto`: the contract both processes and every outside checker rely on.
//!
//! Pure types, validation, canonical JSON, catalogue hash and the IPC frame codec. No IO, no
//! tokio, and no authority: anything that carries authority (required capability, requirement
//! resolution, grants, handler references, credentials) lives in the broker.
//!
//! # Layout
//! - [`name`]: `ToolName` (ToolNameSchema) and `Identifier`.
//! - [`alias`]: harness aliases (diagnostics) and portable names.
//! - [`definition`]: registered and published tool definitions, the fixed projection.
//! - [`catalog`]: RFC 8785 canonical JSON and `catalogHash`.
//! - [`call`]: `ToolCall` (raw tool string), outcomes with codes, and the `Digest` (size and
//!   SHA-256) of arguments kept out of a line, below both `ipc` and `record`.
//! - [`nesting`]: the one nesting limit for arguments, and a depth scan.
//! - [`declaration`]: `ToolPolicy` and `SystemIdentity` with their rules.
//! - [`frame`]: the length-prefixed frame codec.
//! - [`ipc`]: the messages on the bridge and control sockets.
//! - [`record`]: the record's lines, typed: `Event` tagged by `kind`, `RecordLine`.

pub mod alias;
pub mod call;
pub mod catalog;
pub mod declaration;
pub mod definition;
pub mod frame;
pub mod ipc;
pub mod name;
pub mod nesting;
pub mod record;

pub use call::{CancelCode, DenyCode, FailCode, Outcome, Requirement, ToolCall};
pub use catalog::{CatalogHash, canonical_catalog, catalog_hash};
pub use declaration::{McpSupport, PolicyMode, SystemIdentity, ToolPolicy};
pub use definition::{CATALOG_HASH_FIELDS, PublishedToolDefinition, ToolDefinition, ToolMetadata};
pub use name::{Identifier, ToolName};
