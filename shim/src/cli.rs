//! The shim's command: its options (clap), its log, its runtime, and the exit status of a
//! session. In the library rather than in `main.rs` so that every generic it instantiates is
//! compiled with the library: `cargo run --bin sharedos-broker` builds that library too (the
//! broker's CLI lists it), and the demo's own build of the shim binary is then a link (issue 18).

use crate::error::ShimError;
use crate::{link, refused, session};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Exit status when the shim could not start serving (no token, no broker, refused).
const EXIT_NOT_STARTED: u8 = 2;
/// Exit status when the turn closed (or the broker went away) while serving.
const EXIT_TURN_ENDED: u8 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "sharedos-mcp-shim",
    version,
    about = "Stdio MCP server that serves one SharedOS turn: presents the turn token to the broker and forwards every call",
    long_about = "Spawned by an agent harness from its MCP config. Reads the turn token from SHAREDOS_TURN_TOKEN or --turn-token-file \
and the broker's bridge socket from SHAREDOS_BROKER or --broker (default: <runtime dir>/bridge.sock); \
it sends the token only to a listener running as the broker's uid (SHAREDOS_BROKER_UID or --broker-uid), \
in a folder no other uid can write. Speaks MCP on stdin/stdout; \
logs go to stderr or --log-file, filtered by SHAREDOS_LOG: a level (default warn) or target=level pairs such as \
`sharedos_mcp_shim=debug,warn` (span and field directives are not supported). \
Exits 2 if it cannot start serving, 3 when its turn ends, 0 when the client closes stdin."
)]
struct Args {
    /// The broker's bridge socket.
    #[arg(long, env = "SHAREDOS_BROKER", value_name = "PATH")]
    broker: Option<PathBuf>,
    /// The uid the broker runs as: the token goes only to a listener of this uid (default: the
    /// owner of the socket's folder when that is this uid, root, or a folder no other uid could
    /// have made).
    #[arg(long, env = "SHAREDOS_BROKER_UID", value_name = "UID")]
    broker_uid: Option<u32>,
    /// The broker's runtime dir (used when --broker is not given).
    #[arg(long, env = "SHAREDOS_RUNTIME_DIR", value_name = "DIR")]
    runtime_dir: Option<PathBuf>,
    /// Read the turn token from this file (instead of SHAREDOS_TURN_TOKEN).
    #[arg(long, value_name = "FILE")]
    turn_token_file: Option<PathBuf>,
    /// Present `.`-free tool names (`files_read`) for a client that cannot carry a dot; they are
    /// mapped back before the call reaches the broker. The turn may also ask for this.
    #[arg(long)]
    portable_names: bool,
    /// Write logs to this file instead of stderr.
    #[arg(long, value_name = "FILE")]
    log_file: Option<PathBuf>,
}

/// The log writer. Its default buffer of 128,000 lines is allocated and touched up front (about
/// 4 MiB resident, half the shim's start-up CPU, found by profiling the benchmarks); a shim logs
/// little, so a small buffer is plenty (the writer waits rather than drop when it is full).
fn log_writer() -> tracing_appender::non_blocking::NonBlockingBuilder {
    tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(LOG_BUFFER_LINES)
        .lossy(false)
}

/// Log lines buffered before the writer waits.
const LOG_BUFFER_LINES: usize = 1024;

/// The log filter from SHAREDOS_LOG: a level (`debug`) or `target=level` pairs with an optional
/// default level (`sharedos_mcp_shim=debug,warn`); `warn` when unset or not understood. A
/// [`Targets`](tracing_subscriber::filter::Targets) filter rather than an `EnvFilter`: its
/// regex engine was a tenth of the shim's code, and code is most of the shim's memory (issue 17).
fn log_filter() -> tracing_subscriber::filter::Targets {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    let warn = || Targets::new().with_default(LevelFilter::WARN);
    match std::env::var("SHAREDOS_LOG") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().unwrap_or_else(|e| {
            eprintln!(
                "sharedos-mcp-shim: SHAREDOS_LOG `{v}` is not a level or `target=level` list ({e}); logging at warn"
            );
            warn()
        }),
        _ => warn(),
    }
}

fn init_logging(file: Option<&PathBuf>) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    use tracing_subscriber::fmt;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let opened = file.and_then(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .inspect_err(|e| {
                // Serving matters more than the log: say so once, and log to stderr instead.
                eprintln!(
                    "sharedos-mcp-shim: cannot open the log file `{}`: {e}; logging to stderr",
                    p.display()
                );
            })
            .ok()
    });
    let registry = tracing_subscriber::registry().with(log_filter());
    match opened {
        Some(f) => {
            let (writer, guard) = log_writer().finish(f);
            let _ = registry
                .with(fmt::layer().with_writer(writer).with_ansi(false))
                .try_init();
            Some(guard)
        }
        // To stderr, written in place: a shim logs little (warnings), and a writer thread costs
        // its stack, its malloc arena and its buffer for the whole session (issue 17).
        None => {
            let _ = registry
                .with(fmt::layer().with_writer(std::io::stderr).with_ansi(false))
                .try_init();
            None
        }
    }
}

fn read_token(args: &Args) -> Result<String, ShimError> {
    let token = match &args.turn_token_file {
        Some(path) => std::fs::read_to_string(path).map_err(|source| ShimError::TokenFile {
            path: path.clone(),
            source,
        })?,
        None => std::env::var(sharedos_ipc::runtime::TOKEN_ENV).map_err(|_| ShimError::NoToken)?,
    };
    let token = token.trim().to_owned();
    if token.is_empty() {
        return Err(ShimError::EmptyToken);
    }
    Ok(token)
}

/// The shim's whole life: parse the command line, start logging and the runtime, serve.
pub fn main() -> ExitCode {
    let args = Args::parse();
    let _guard = init_logging(args.log_file.as_ref());
    // One shim serves one harness: a single-threaded runtime, so that a call does not cross
    // threads on its way between stdin, the broker link and stdout.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sharedos-mcp-shim: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_NOT_STARTED);
        }
    };
    // The session runs as a task, not as `block_on`'s own future: a task woken by another task
    // on this thread is queued in place, while waking `block_on`'s future goes through the
    // driver (an eventfd write and one more epoll_wait per call).
    let code = rt.block_on(async {
        match tokio::spawn(run(args)).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("sharedos-mcp-shim: the session ended abnormally: {e}");
                ExitCode::FAILURE
            }
        }
    });
    // Do not wait for a read of stdin that may never return: the session is over.
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    code
}

async fn run(args: Args) -> ExitCode {
    let token = match read_token(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("sharedos-mcp-shim: {e}");
            return ExitCode::from(EXIT_NOT_STARTED);
        }
    };
    let socket = args.broker.clone().unwrap_or_else(|| {
        sharedos_ipc::runtime::bridge_socket(&sharedos_ipc::runtime::resolve_runtime_dir(
            args.runtime_dir.as_deref(),
        ))
    });
    let (link, mut welcome) = match link::Link::connect(&socket, token, args.broker_uid).await {
        Ok(x) => x,
        Err(e) if e.is_untrusted_broker() => {
            eprintln!("sharedos-mcp-shim: {e}");
            refused::answer(&e.to_string()).await;
            return ExitCode::from(EXIT_NOT_STARTED);
        }
        Err(e) => {
            eprintln!("sharedos-mcp-shim: {e}");
            return ExitCode::from(EXIT_NOT_STARTED);
        }
    };
    welcome.portable_names |= args.portable_names;
    tracing::info!(turn = %welcome.turn, tools = welcome.tools.len(), "serving turn");
    let serving = match session::Session::new(link, &welcome) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sharedos-mcp-shim: {e}");
            return ExitCode::from(EXIT_NOT_STARTED);
        }
    };
    match serving.serve().await {
        session::End::ClientClosed => ExitCode::SUCCESS,
        session::End::TurnEnded(reason) => {
            eprintln!("sharedos-mcp-shim: {reason}; exiting");
            ExitCode::from(EXIT_TURN_ENDED)
        }
        session::End::Error(e) => {
            eprintln!("sharedos-mcp-shim: {e}");
            ExitCode::from(EXIT_TURN_ENDED)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every option of the shim says what it is for.
    #[test]
    fn every_option_has_help_text() {
        let cmd = Args::command();
        let missing: Vec<&str> = cmd
            .get_arguments()
            .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
            .filter(|a| a.get_help().is_none() && a.get_long_help().is_none())
            .map(|a| a.get_id().as_str())
            .collect();
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }
}
