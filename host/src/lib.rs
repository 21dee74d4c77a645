//! `sharedos-host`: the host's side of a SharedOS broker, with no authority of its own.
//!
//! A host talks to the broker over `control.sock` and hands harnesses their MCP configs; nothing
//! here decides anything about a call.
//!
//! # Layout
//! - [`client`]: the control-socket client (the CLI, the column, tests, the demo).
//! - [`harness_config`]: harness MCP configs (`turn open --write-config`), written privately.
//! - [`shim_path`]: where the `sharedos-mcp-shim` binary is.

pub mod client;
pub mod harness_config;
pub mod shim_path;
