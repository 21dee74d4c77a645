//! The evidence: what the broker can later prove of every call, and how it is checked.
//!
//! - [`record`]: the durable JSON Lines record of `sharedos_proto::record::Event`s (group commit,
//!   hash chain, signed checkpoints, rotation); a leaf every floor above writes through.
//! - [`witness`]: each signed checkpoint handed to a witness file or command, off the call path;
//!   below the record.
//! - [`chain`]: checking a record's hash chain, its signed checkpoints and a witness's copies
//!   (`records verify`); above the record it reads.
//! - [`replay`]: the record's calls decided again under another policy set, offline (`policy
//!   replay`); beside the kernel, whose decision it repeats, and never the running broker.
//!
//! Each file keeps its own floor (`lib.rs`, `tests/layout.rs`): the room groups a concern, not a
//! layer.

pub mod chain;
pub mod record;
pub mod replay;
pub mod witness;
