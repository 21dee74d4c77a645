//! `sharedos-mcp-shim`: the stdio MCP server a harness spawns. Holds no authority and no state
//! beyond its connection: it presents the turn token to the broker, serves the catalogue the
//! broker returns, and forwards every `tools/call` and cancellation.
//!
//! stdout belongs to MCP: logs go to stderr or `--log-file` (`print_stdout` is denied here).
//!
//! Everything lives in the library (`lib.rs`, the command in [`sharedos_mcp_shim::cli`]), so the
//! fuzz targets can reach the stdin guard and this binary compiles in a second.

fn main() -> std::process::ExitCode {
    sharedos_mcp_shim::cli::main()
}
