//! `sharedos-broker`: parse the command line, set up logging, run, map errors to exit codes.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = sharedos_broker::cli::Cli::parse();
    match sharedos_broker::cli::main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sharedos-broker: error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
