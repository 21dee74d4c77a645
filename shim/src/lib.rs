//! `sharedos-mcp-shim`: the stdio MCP server a harness spawns. It holds no authority: it presents
//! the turn token, serves the catalogue the broker returns, and forwards every call.
//!
//! # Layout
//! - [`guard`]: checks each stdin line; malformed JSON-RPC gets its JSON-RPC answer.
//! - [`stdio`]: stdin → guard → rmcp, and the one writer that owns stdout.
//! - [`error`]: [`error::ShimError`], why the shim could not start serving or stopped.
//! - [`link`]: the bridge connection to the broker (hello, calls, cancels, turn end).
//! - [`server`]: the MCP side (rmcp `ServerHandler`) and the one outcome → MCP result mapping.

pub mod error;
pub mod guard;
pub mod link;
pub mod server;
pub mod stdio;
