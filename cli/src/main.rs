//! `sharedos-broker`: parse the command line, set up logging, run, map errors to exit codes.

use clap::Parser;

mod cli;
mod demo;
mod output;
mod replay;

/// jemalloc instead of glibc's malloc. Measured (bench/NOTES.md): with glibc, a decision cost
/// more as the process held more policies (13.4 µs with 10, 22 µs with 10,000, for the same five
/// that apply), because its per-call allocations slowed on the heap a large set leaves; with
/// jemalloc it is the same at every size (12.5 µs), and the 10,000-tool catalogue takes half the
/// time. The benchmark uses the same allocator when it drives this library in process.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    // The sandbox launcher (hidden: the broker runs it to start a brokered upstream). Handled
    // before anything else so that the process is still single-threaded when it drops its
    // privileges and execs.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let [_, sub] = argv.as_slice()
        && sub == sharedos_broker::upstream::sandbox::PROBE_SUBCOMMAND
    {
        return match sharedos_broker::upstream::sandbox::probe_userns() {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{}{e}", sharedos_broker::upstream::sandbox::LAUNCHER_ERROR);
                std::process::ExitCode::from(1)
            }
        };
    }
    if let [_, sub, plan, command, args @ ..] = argv.as_slice()
        && sub == sharedos_broker::upstream::sandbox::SUBCOMMAND
    {
        let e = sharedos_broker::upstream::sandbox::launch(&plan.to_string_lossy(), command, args);
        eprintln!("{}{e}", sharedos_broker::upstream::sandbox::LAUNCHER_ERROR);
        return std::process::ExitCode::from(126);
    }
    let cli = cli::Cli::parse();
    match cli::main(cli) {
        Ok(code) => code,
        // A reader that closed stdout (`records | head -1`) has what it wanted.
        Err(e) if e.chain().any(|c| c.is::<output::StdoutClosed>()) => {
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sharedos-broker: error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
