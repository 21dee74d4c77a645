//! `sharedos-bench`: the boundary's cost against a direct MCP server, and how it scales.
//!
//! Prints a markdown report (medians, p99s, ratios, targets met or missed) and, with
//! `--write FILE`, writes it there. The one command that regenerates `BENCHMARKS.md`:
//! `cargo run --release -p sharedos-bench -- --write BENCHMARKS.md`.
//!
//! # Layout
//! - [`suite`]: the sections in order, their parameters, and the report they make.
//! - [`e2e`]: real processes: cold start, round trips with N concurrent callers.
//! - [`micro`]: in-process: decision, catalogue and turn open, record, fdatasync.
//! - [`memory`]: resident memory of the shim, the direct server and the broker.
//! - [`sandboxed`]: a sandboxed upstream's cold start against the same command unsandboxed.
//! - [`instances`]: a per-principal instance's first call and steady state.
//! - [`remote`]: a remote provider over Streamable HTTP, direct, through the broker, and
//!   through a byte-copying relay that counts connections and TLS handshakes.
//! - [`procs`]: starting and stopping brokers, shims, direct servers; `/proc` memory.
//! - [`stats`]: samples, percentiles, formatting.
//! - [`report`]: the machine, the tables, the markdown.
//!
//! The baseline server is the second binary, `direct-files-server` (`src/bin/`).

mod e2e;
mod instances;
mod memory;
mod micro;
mod procs;
mod remote;
mod report;
mod sandboxed;
mod stats;
mod suite;

use std::process::ExitCode;

use clap::Parser;

/// The broker binary's allocator, so that the in-process sections (decision, catalogue, turn
/// open, record) measure the broker's library as `sharedos-broker` runs it.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let args = suite::Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sharedos-bench: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(suite::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sharedos-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
