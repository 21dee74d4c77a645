//! `sharedos-mcp-shim`: the stdio MCP server a harness spawns. It holds no authority: it presents
//! the turn token, serves the catalogue the broker returns, and forwards every call.
//!
//! # Layout
//! From the transport up to the handlers, no room calls back into one above it:
//! - [`stdio`]: transport only: the bounded stdin line reader and the one writer that owns
//!   stdout.
//! - [`guard`]: checks each stdin line (pure, fuzzed); malformed JSON-RPC gets its JSON-RPC
//!   answer.
//! - [`session`]: the one loop over stdin lines, call answers and the link's end; the calls in
//!   flight; hands every `tools/call` to [`call`] and every other line to rmcp ([`server`]).
//! - [`call`]: one `tools/call`, forwarded to the broker (portable names mapped back).
//! - [`ask`]: a call held for its principal's approval asked of the person through the MCP
//!   client (`elicitation/create`), and the client's response matched back to it.
//! - [`render`]: the one mapping from a kernel answer to its MCP result; the shim's own answers.
//! - [`server`]: what rmcp serves (`ServerHandler`): `initialize` and `tools/list`.
//! - [`cli`]: the command (options, log, runtime, exit status); `main.rs` only calls it.
//! - [`error`]: [`error::ShimError`], why the shim could not start serving or stopped.
//! - [`link`]: the bridge connection to the broker (hello, calls, cancels, turn end).
//! - [`refused`]: what the harness hears when [`trust`] refused the listener.
//! - [`trust`]: whether the listener at the socket path may have the token (its uid, its
//!   folder), checked before hello.

pub mod ask;
pub mod call;
pub mod cli;
pub mod error;
pub mod guard;
pub mod link;
pub mod refused;
pub mod render;
pub mod server;
pub mod session;
pub mod stdio;
pub mod trust;
