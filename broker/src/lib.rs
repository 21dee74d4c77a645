//! `sharedos-broker`: the kernel behind the MCP toolshare boundary.
//!
//! Holds all authority: the tool registry and its handlers, the Cedar policy, the turn table and
//! the record. Shims reach it over `bridge.sock` with a turn token; hosts over `control.sock`.
//! Nothing else lives here: the host's tooling is `sharedos-host`, the conformance column
//! `sharedos-column`, the command line `sharedos-broker-cli`; Cargo keeps them out.
//!
//! # Layout
//! Floors from the top down; every import points down (a module imports only from floors below
//! it, and nothing imports `server`):
//! 1. [`server`]: the process: runtime dir, sockets, accept loops, shutdown.
//! 2. [`bridge`] (one shim connection), [`control`] (one host connection), [`page`] (the
//!    person's page: sign-in and approvals over HTTPS, issue 45).
//! 3. [`state`]: the shared state below the handlers: `Broker`, the peer-uid rule, closing a
//!    turn; [`admission`]: bounds on connections before hello.
//! 4. [`assemble`]: the composition root, config → kernel, the only module naming concrete
//!    providers, over [`error`] (why a start failed, wrapping the errors of the floors below);
//!    [`turn`]: the turn table, tokens, lifecycle.
//! 5. [`kernel`]: registry, per-context catalogue, `check` and `invoke` (the single call path);
//!    [`evidence::replay`]: the record's calls decided again under another policy set, offline
//!    (`policy replay`), beside the kernel and apart from it: it reads a record, never the
//!    running broker.
//! 6. [`files`] (the built-in files provider, over [`files::beneath`] and [`files::vpath`]) and [`upstream`]
//!    (brokered MCP servers, with [`pins`]): the concrete providers. The kernel never imports
//!    them; they and the kernel meet only in
//! 7. [`provider`]: the provider interface (`ToolHandler`, `Provider`, `Authority`): all the
//!    kernel knows of a provider; half a floor below it, [`budget`] (the `[[budgets]]` limits and
//!    what is left of them) and [`approval`] (the calls waiting for a person), which the kernel
//!    consults on the call path and the handlers read.
//! 8. [`policy`] (Cedar schema and policies, decisions, the catalogue question, `AccessContext`)
//!    and [`config`] (the TOML config and the embedded default); half a floor below them,
//!    [`evidence::chain`]: checking the record's hash chain and signed checkpoints (`records verify`).
//! 9. Leaves: [`evidence::record`] (the durable JSON Lines record of `sharedos_proto::record::Event`s,
//!    group commit), [`secrets`] (the secret stores a provider's `{ secret = "name" }` values are
//!    read from, and the redaction of those values), [`resource`] (what a call touches), [`telemetry`] (OpenTelemetry export
//!    off the call path), [`trusted`] (the folders and files the broker writes, checked and
//!    opened without following links) and the lock helper; below the record, [`evidence::witness`]
//!    (each signed checkpoint handed to a witness file or command, off the call path); last,
//!    [`child`] (the clean environment and process group of every child the broker runs: upstreams,
//!    the secret helper, the witness command).
//!
//! Rooms group a concern across floors: [`evidence`] (record, witness, chain, replay) and
//! [`files`] (the provider, `beneath`, `vpath`); each of their files keeps the floor named above.
//! `tests/layout.rs` checks this order: every `crate::` path in a module's code names a module
//! on a lower floor (a room's file by its own floor).

pub mod admission;
pub mod approval;
pub mod assemble;
pub mod bridge;
pub mod budget;
pub mod child;
pub mod config;
pub mod control;
pub mod error;
pub mod evidence;
pub mod files;
pub mod kernel;
pub mod lineage;
pub mod page;
pub mod pins;
pub mod policy;
pub mod provider;
pub mod resource;
pub mod secrets;
pub mod server;
pub mod state;
mod sync;
pub mod telemetry;
pub mod trusted;
pub(crate) use sync::lock;
pub mod turn;
pub mod upstream;

pub use config::Config;
pub use error::StartError;
pub use server::{run, start};
