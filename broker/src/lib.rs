//! `sharedos-broker`: the kernel behind the MCP toolshare boundary.
//!
//! Holds all authority: the tool registry and its handlers, the Cedar policy, the turn table and
//! the record. Shims reach it over `bridge.sock` with a turn token; hosts over `control.sock`.
//! Nothing else lives here: the host's tooling is `sharedos-host`, the conformance column
//! `sharedos-column`, the command line `sharedos-broker-cli`; Cargo keeps them out.
//!
//! # Layout
//! - [`config`]: the TOML config and the embedded default.
//! - [`policy`]: Cedar schema and policies, decisions, the catalogue question.
//! - [`vpath`]: canonical virtual paths.
//! - [`resource`]: what a call touches (`Resource`), below the policy and the providers.
//! - [`beneath`]: a root held by descriptor; paths resolved beneath it without a gap.
//! - [`provider`]: the provider interface (`ToolHandler`, `Provider`, `Authority`): all the
//!   kernel knows of a provider.
//! - [`files`]: the built-in files provider.
//! - [`pins`]: the pin file of brokered providers.
//! - [`kernel`]: registry, per-context catalogue, `invoke` (the single call path).
//! - [`record`]: the durable JSON Lines record (group commit).
//! - [`turn`]: the turn table, tokens, lifecycle.
//! - [`upstream`]: brokered MCP providers (upstream servers behind the kernel).
//! - [`server`]: the process: runtime dir, sockets, accept loops, shutdown.
//! - [`state`]: the shared state below the handlers: `Broker`, the peer-uid rule, closing a turn.
//! - [`assemble`]: the composition root: config → kernel (the only module naming providers).
//! - [`admission`]: bounds on connections before hello, rate-limited refusal logs.
//! - [`bridge`]: one shim connection.
//! - [`control`]: one host connection.

pub mod admission;
pub mod assemble;
pub mod beneath;
pub mod bridge;
pub mod config;
pub mod control;
pub mod error;
pub mod files;
pub mod kernel;
pub mod pins;
pub mod policy;
pub mod provider;
pub mod record;
pub mod resource;
pub mod server;
pub mod state;
mod sync;
pub(crate) use sync::lock;
pub mod turn;
pub mod upstream;
pub mod vpath;

pub use config::Config;
pub use error::StartError;
pub use server::{run, start};
