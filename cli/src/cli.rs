//! The `sharedos-broker` command line: `serve`, `demo`, host commands that talk to a running
//! broker over its control socket, and `catalog hash` for outside checkers.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand};
use serde_json::Value;
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn};
use sharedos_proto::record::{Event, RecordLine};
use sharedos_proto::{PublishedToolDefinition, ToolDefinition};
use tokio_util::sync::CancellationToken;

use sharedos_broker::Config;
use sharedos_host::client::ControlClient;

use crate::output::{out, outln, print_json};
use crate::replay::ReplayArgs;

#[derive(Debug, Parser)]
#[command(
    name = "sharedos-broker",
    version,
    about = "SharedOS broker: the kernel behind the MCP toolshare boundary",
    long_about = "The SharedOS broker holds the tool registry, the Cedar policy, the turns and the record. \
Harnesses reach it through `sharedos-mcp-shim` with a per-turn token; hosts open and close turns with the commands below."
)]
pub struct Cli {
    /// The broker's runtime directory (sockets live here). Default: $XDG_RUNTIME_DIR/sharedos, else /tmp/sharedos-$UID.
    #[arg(long, global = true, env = "SHAREDOS_RUNTIME_DIR", value_name = "DIR")]
    pub runtime_dir: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the broker until SIGINT or SIGTERM.
    Serve {
        /// Config file (TOML). Without it: the embedded default (alice may read /public).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Also write logs to this file (logs always go to stderr).
        #[arg(long, value_name = "FILE")]
        log_file: Option<PathBuf>,
        /// Record each call's arguments as their SHA-256 instead of as given.
        #[arg(long)]
        redact_arguments: bool,
    },
    /// Start a broker on the embedded default, drive the real shim through one turn, print what happened.
    Demo,
    /// The effective catalogue of a principal, or `catalog hash FILE` for any tool list.
    #[command(args_conflicts_with_subcommands = true)]
    Catalog {
        #[command(subcommand)]
        command: Option<CatalogCommand>,
        #[command(flatten)]
        query: CatalogQuery,
    },
    /// Open, close and list turns.
    #[command(subcommand)]
    Turn(TurnCommand),
    /// Read the record (from the running broker), or `records verify` its chain and signatures.
    #[command(args_conflicts_with_subcommands = true)]
    Records {
        #[command(subcommand)]
        command: Option<RecordsCommand>,
        /// Only this turn's lines.
        #[arg(long)]
        turn: Option<String>,
        /// Print JSON Lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Check a decision, reload the policy, or replay the record under another policy file.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Each provider: its state (starting, ready, restarting, drifted, failed), tools and
    /// rejected registrations; `providers pin` pins the brokered upstreams' tool lists.
    #[command(args_conflicts_with_subcommands = true)]
    Providers {
        #[command(subcommand)]
        command: Option<ProvidersCommand>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// OpenTelemetry export: whether it is on, where it sends, and the spans queued, exported
    /// and dropped (queue full, export failed) since the broker started.
    Telemetry {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The calls waiting for a person's approval (a permit annotated `@approval("required")`);
    /// `approvals approve ID` lets one run, `approvals deny ID` refuses it.
    #[command(args_conflicts_with_subcommands = true)]
    Approvals {
        #[command(subcommand)]
        command: Option<ApprovalsCommand>,
        /// Print a JSON array of {id, turn, callId, principal, tool, arguments, requestedAt,
        /// expiresAt} instead of a table (arguments longer than 4096 bytes are `null`, with
        /// `argumentsDigest` {bytes, sha256}; `approvals show ID` prints them).
        #[arg(long)]
        json: bool,
    },
    /// The MCP conformance column: run a real harness CLI against one turn and grade it.
    #[command(subcommand)]
    Column(ColumnCommand),
    /// The folder store of secrets (`secrets_dir`): `secrets set` reads the value from stdin
    /// (never from the command line), `secrets list` prints names only, `secrets delete` removes
    /// one. Run it as the broker's uid: a secret file must be the broker's, mode 0600.
    #[command(subcommand)]
    Secrets(SecretsCommand),
    /// Serve a scripted model (Anthropic Messages, OpenAI Responses, Chat Completions) on loopback,
    /// so real harness CLIs run offline. Prints `listening on http://ADDR` first.
    ScriptedModel {
        /// Loopback address to listen on; port 0 picks a free port.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
        /// The script (JSON): {"steps":[{"tool":"files.read","arguments":{...}}],"final":"..."}.
        #[arg(long, value_name = "FILE")]
        script: PathBuf,
        /// Append what the model saw (requests, tool results) to this file as JSON Lines.
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum SecretsCommand {
    /// Store (or replace) a secret; its value is read from stdin (one trailing newline is not
    /// part of it), written 0600 in `<secrets_dir>/<principal>/<name>`.
    Set {
        #[command(flatten)]
        at: SecretsAt,
        /// The secret's name, as `{ secret = "NAME" }` references it.
        #[arg(value_name = "NAME")]
        name: String,
    },
    /// The names of a principal's secrets (never their values); with `--sign-ins`, the remote
    /// servers they are signed in to instead.
    List {
        #[command(flatten)]
        at: SecretsAt,
        /// List the remote servers (`[providers.oauth] grant = "authorization_code"`) the
        /// principal signed in to on their page, kept beside the record (`<record>.oauth`);
        /// needs `--config`.
        #[arg(long)]
        sign_ins: bool,
    },
    /// Remove a secret; with `--sign-in`, sign the principal out of a remote server: its tokens
    /// are removed, a running broker stops sending them at the next call, and that call asks
    /// the person to sign in again.
    Delete {
        #[command(flatten)]
        at: SecretsAt,
        /// NAME is a provider whose sign-in (`<record>.oauth/<principal>/<provider>`) to
        /// remove, not a secret; needs `--config`.
        #[arg(long)]
        sign_in: bool,
        /// The secret's name (with `--sign-in`: the provider's name).
        #[arg(value_name = "NAME")]
        name: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct SecretsAt {
    /// Whose secret: a principal, or `_shared` for the one value every principal's instance gets.
    #[arg(long, value_name = "P")]
    principal: String,
    /// The broker config whose `secrets_dir` to use (default: `secrets` beside it).
    #[arg(long, value_name = "FILE", conflicts_with = "dir")]
    config: Option<PathBuf>,
    /// The folder store itself.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// `secrets set|list|delete`: the folder store, read and written here, without a broker.
fn secrets_command(command: &SecretsCommand) -> anyhow::Result<ExitCode> {
    use sharedos_broker::secrets::FolderStore;
    let (at, sign_ins) = match command {
        SecretsCommand::Set { at, .. } => (at, false),
        SecretsCommand::List { at, sign_ins } => (at, *sign_ins),
        SecretsCommand::Delete { at, sign_in, .. } => (at, *sign_in),
    };
    let store = match (&at.dir, &at.config) {
        (_, Some(c)) if sign_ins => {
            sharedos_broker::upstream::signin::store_beside(&Config::from_file(c)?.record)
        }
        (_, None) if sign_ins => bail!(
            "sign-ins are kept beside the broker's record (`<record>.oauth`): give --config FILE"
        ),
        (Some(d), _) => FolderStore::new(d.clone()),
        (None, Some(c)) => FolderStore::new(Config::from_file(c)?.secrets_dir),
        (None, None) => {
            bail!("give the folder store: --config FILE (its `secrets_dir`) or --dir DIR")
        }
    };
    match command {
        SecretsCommand::Set { name, .. } => {
            use std::io::Read as _;
            let mut value = Vec::new();
            std::io::stdin()
                .take(sharedos_broker::secrets::MAX_SECRET_BYTES as u64 + 2)
                .read_to_end(&mut value)
                .context("cannot read the secret's value from stdin")?;
            if value.ends_with(b"\n") {
                value.pop();
                if value.ends_with(b"\r") {
                    value.pop();
                }
            }
            if value.is_empty() {
                bail!(
                    "no value on stdin: give the secret's value on stdin, e.g. `sharedos-broker secrets set --principal P NAME < file`"
                );
            }
            let path = store
                .set(&at.principal, name, &value)
                .map_err(|e| anyhow::anyhow!(e))?;
            outln!(
                "secret `{name}` of `{}` written to {} (0600)",
                at.principal,
                path.display()
            );
        }
        SecretsCommand::List { .. } => {
            for n in store.list(&at.principal).map_err(|e| anyhow::anyhow!(e))? {
                outln!("{n}");
            }
        }
        SecretsCommand::Delete { name, .. } => {
            let removed = store
                .delete(&at.principal, name)
                .map_err(|e| anyhow::anyhow!(e))?;
            let principal = &at.principal;
            match (removed, sign_ins) {
                (false, true) => bail!(
                    "principal `{principal}` is not signed in to `{name}` (nothing in {})",
                    store.dir.display()
                ),
                (false, false) => bail!("no secret `{name}` for principal `{principal}`"),
                (true, true) => outln!(
                    "`{principal}` signed out of `{name}`: its next call there asks them to sign in again"
                ),
                (true, false) => outln!("secret `{name}` of `{principal}` removed"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Subcommand)]
pub enum ApprovalsCommand {
    /// Let the waiting call run (it is checked again under the policy in force now). Your uid
    /// is recorded as who decided. An id is used once: a decided or unknown id exits 1.
    Approve {
        /// The approval id (64 hex digits), as `approvals` lists it.
        #[arg(value_name = "ID")]
        id: String,
    },
    /// Print a waiting call's arguments whole, as JSON (the listing shows long ones as their
    /// size and SHA-256 only).
    Show {
        /// The approval id (64 hex digits), as `approvals` lists it.
        #[arg(value_name = "ID")]
        id: String,
    },
    /// Refuse the waiting call: it is answered `denied/approval_denied`, with your reason.
    Deny {
        /// The approval id (64 hex digits), as `approvals` lists it.
        #[arg(value_name = "ID")]
        id: String,
        /// Why (recorded, and shown to the model in the refusal; at most 500 bytes).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum RecordsCommand {
    /// Check the record's hash chain, seqs and signed checkpoints, across rotated files; print
    /// the first broken seq and why. Exit status 0 only when everything verifies, 3 when not.
    /// Reads the files directly: no broker needs to run.
    Verify {
        /// The record (its rotated files `<record>.<seq>` are read first). Default: the
        /// config's `record`, else the embedded default's record under the runtime dir.
        #[arg(long, value_name = "FILE")]
        record: Option<PathBuf>,
        /// The config whose record and signing key to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Check signatures with this public key (64 hex digits, as the broker writes to
        /// `<signing key>.pub`). Default: that file if it exists, else the key the record's
        /// chain names (which shows the record is whole, not whose it is).
        #[arg(long, value_name = "FILE")]
        public_key: Option<PathBuf>,
        /// Check the record against a witness: a file of checkpoints the broker handed out as
        /// it signed them (its `witness_file`, what `witness_command` or the OpenTelemetry log
        /// export received, or `records checkpoint --json` output), one JSON object per line.
        /// Every witnessed checkpoint must be in the record with the same signed content (RFC
        /// 8785: spacing and key order do not matter), and the record must reach the newest of
        /// them: a cut at the end or a rewrite re-signed with a stolen key is reported as broken,
        /// naming the seq. With --public-key (kept outside the record's folder), witness lines
        /// not signed by that key are reported by line number and skipped.
        #[arg(long, value_name = "FILE")]
        witness: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the record's newest signed checkpoint (read from the files; no broker needs to
    /// run), to anchor it by hand somewhere the broker cannot write. Exit 1 when there is none.
    Checkpoint {
        /// The record. Default: the config's `record`, else the embedded default's record.
        #[arg(long, value_name = "FILE")]
        record: Option<PathBuf>,
        /// The config whose record to read.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the checkpoint's record line as it is (one JSON object: the shape a witness
        /// file holds) instead of its seq, time and SHA-256.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct CatalogQuery {
    /// The principal whose catalogue to compute.
    #[arg(long)]
    principal: Option<String>,
    /// The agent acting for the principal (`SharedOS::Agent`), as `turn open --agent`.
    #[arg(long)]
    agent: Option<String>,
    /// Print the catalogHash and the published tool definitions as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
pub enum CatalogCommand {
    /// Print the catalogHash of a JSON array of tool definitions (FILE, or - for stdin).
    Hash {
        /// A JSON file holding an array of tool definitions, or - for stdin.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Print the RFC 8785 canonical JSON instead of the hash.
        #[arg(long)]
        canonical: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum TurnCommand {
    /// Open a turn and print its id, token and catalogHash.
    Open(Box<OpenArgs>),
    /// Close a turn: its shims exit and its token dies.
    Close {
        /// The turn's id (`t-` and 16 hex digits), as `turn open` and `turn list` print it.
        #[arg(value_name = "TURN")]
        turn: String,
    },
    /// List open turns (never their tokens).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct OpenArgs {
    /// Who the turn acts for (`SharedOS::User`): the policies decide its catalogue and every
    /// call by this id.
    #[arg(long)]
    principal: String,
    /// The agent acting for the principal (`SharedOS::Agent`): policies may name it, and its
    /// owner (--agent-owner), besides the principal. Omit it for a principal acting directly.
    #[arg(long)]
    agent: Option<String>,
    /// The agent's owner (a principal id): `Agent.owner` in every decision of the turn.
    #[arg(long, value_name = "PRINCIPAL", requires = "agent")]
    agent_owner: Option<String>,
    /// A turn attribute, `context.turn.KEY` in every decision of the turn and recorded on
    /// `turn_opened`: KEY=VALUE for a string, KEY:=JSON for any other value (a number, true,
    /// a list). Repeatable. The Cedar schema types them (the built-in one: tenant, project,
    /// purpose, all strings); an attribute it does not declare refuses the turn.
    #[arg(long = "attr", value_name = "KEY=VALUE")]
    attributes: Vec<String>,
    /// Lifetime in seconds (default 3600).
    #[arg(long, value_name = "SECONDS")]
    ttl: Option<u64>,
    /// The harness this turn is for (recorded).
    #[arg(long)]
    harness: Option<String>,
    /// ToolPolicy as JSON: {"mode":"strict","harnessLocal":[...],"externalDirect":[...]}.
    #[arg(long, value_name = "JSON")]
    tool_policy: Option<String>,
    /// SystemIdentity as JSON (stamped on every record line of the turn).
    #[arg(long, value_name = "JSON")]
    system_identity: Option<String>,
    /// Present `.`-free tool names (refused if two tools would collide).
    #[arg(long)]
    portable_names: bool,
    /// Write the MCP config for this turn (FORMAT: claude-code, codex, pi, cordis, qwen-code,
    /// opencode, gemini-cli or cline) to PATH, mode 0600; an existing file of any format keeps
    /// its other entries. `{turn}` in PATH becomes the turn's id. The folder must be this uid's (or root's) and
    /// writable by no other uid, unless sticky.
    #[arg(long, num_args = 2, value_names = ["FORMAT", "PATH"])]
    write_config: Option<Vec<String>>,
    /// Write the token to this file (0600) and have the config point the shim at it instead
    /// of carrying the token itself. PATH must have `{turn}` in its file name (it becomes
    /// the turn's id): no two turns share a token file. Removed when the turn closes.
    #[arg(long, value_name = "PATH", conflicts_with = "token_dir")]
    token_file: Option<String>,
    /// Like --token-file DIR/{turn}.token.
    #[arg(long, value_name = "DIR")]
    token_dir: Option<PathBuf>,
    /// The person's own OAuth token (access or ID token) in this file, handed to the broker
    /// for remote providers with `grant = "token_exchange"` to exchange (RFC 8693). Read here,
    /// sent over control.sock, never printed; one trailing newline is not part of it.
    #[arg(long, value_name = "PATH")]
    subject_token_file: Option<PathBuf>,
    /// Give the written config and token files to this uid (and gid): a harness that runs
    /// under its own uid reads them, no other harness can. Needs the right to chown (root).
    #[arg(long, value_name = "UID[:GID]")]
    file_owner: Option<sharedos_host::harness_config::FileOwner>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ProvidersCommand {
    /// Write each brokered upstream's current catalogHash to the pin file (`pins` in the config);
    /// an upstream whose tools later differ from its pin is held back from every catalogue.
    Pin,
}

#[derive(Debug, Subcommand)]
pub enum ColumnCommand {
    /// Open a turn, write the harness's MCP config, run the harness with a prompt asking for each
    /// row, close the turn and grade every row from the record (pass, fail, not exercised).
    /// Exit status 0 when every row passed, 4 otherwise.
    Run {
        /// Host config (TOML): harness command, args, env, declared model, MCP support, ...
        #[arg(long, value_name = "FILE")]
        host_config: PathBuf,
        /// Rows (JSON array of {id, tool, arguments, expect: allowed|denied}).
        #[arg(long, value_name = "FILE")]
        rows: PathBuf,
        /// Where to write the manifest (JSON).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Keep the harness's work dir (config, logs) here instead of a temporary dir.
        #[arg(long, value_name = "DIR")]
        workdir: Option<PathBuf>,
        /// The scripted model's log (`scripted-model --log FILE`) the harness's model requests
        /// go to. The lines it gains during the run show what the harness offered its model and
        /// the model it asked for: the manifest then lists the offered tools (the boundary's
        /// mapped back to canonical names through the harness's alias rule, and every other one
        /// as harness-local or another server's) and the model asked for beside the declared
        /// one, and grades two more rows: `offered-catalogue` (the boundary's tools equal the
        /// turn's catalogue in every request with tools) and `tool-policy` (every other offered
        /// tool is declared harness-local; else `misdeclared`). Without it neither is observed.
        #[arg(long, value_name = "FILE")]
        model_log: Option<PathBuf>,
    },
    /// Compare two column manifests row by row.
    ///
    /// Each row's grade and recorded outcome, then the checks and the model asked for. Refusal behaviour is compared only between runs offered
    /// the same catalogue: when the catalogHashes differ, nothing is compared and the tool-set
    /// difference is printed instead. Exit status 0 when every row is the same, 4 when some row
    /// differs, 5 when the catalogues differ. Reads files only; needs no broker.
    Compare {
        /// The first manifest (`column run --out`).
        #[arg(value_name = "A.json")]
        a: PathBuf,
        /// The second manifest.
        #[arg(value_name = "B.json")]
        b: PathBuf,
    },
    /// Print the interop matrix (markdown) from manifests or their summaries.
    ///
    /// A line per harness: its version (declared, and measured where they differ), its
    /// catalogue hash, the grade of every row and check (an approval row with what the approval
    /// came to), the model it asked for; from column manifests or their
    /// summaries (`column summary`); a folder stands for its `*.json` files in name order. The
    /// matrix in `docs/interop.md` is this command's output over `tests/interop/matrix`. Refused when the
    /// columns' catalogue hashes differ (they were not offered the same tools). Needs no broker.
    Matrix {
        /// Manifests, summaries, or folders of them.
        #[arg(value_name = "PATH", required = true)]
        paths: Vec<PathBuf>,
        /// Print the matrix even when the catalogue hashes differ, the odd lines marked.
        #[arg(long)]
        show_anyway: bool,
    },
    /// Print the summary of a column manifest (JSON).
    ///
    /// What the interop matrix keeps of a run: only what a rerun of the same pinned CLI reproduces (grades, outcomes, offered names, the
    /// models; no times, paths or ids). Needs no broker.
    Summary {
        /// The manifest (`column run --out`).
        #[arg(value_name = "MANIFEST.json")]
        manifest: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Decide a call without running it. Exit status 0 when allowed, 3 when refused.
    Check {
        /// The principal the call would act for (`SharedOS::User`).
        #[arg(long)]
        principal: String,
        /// The agent acting for the principal (`SharedOS::Agent`), as `turn open --agent`.
        #[arg(long)]
        agent: Option<String>,
        /// The tool's name as a client would call it (`files.read`).
        #[arg(long)]
        tool: String,
        /// The call's arguments as a JSON object.
        #[arg(long, value_name = "JSON", default_value = "{}")]
        args: String,
        /// Print the decision as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-read the policy file; a file that fails to parse or validate is refused and the old set stays.
    Reload,
    /// Decide the recorded calls again under another policy file and print each whose decision
    /// would change. Exit status 0 when none would, 3 when some would.
    ///
    /// Try a changed policy against real traffic before reloading it: every call of the record is
    /// decided again in its turn's recorded context, and each call whose decision would change
    /// (allowed → denied, denied → allowed) is printed, by tool and by the policies that would
    /// decide it now. What is compared is the Cedar decision of each call that reached it (it
    /// ran, or was denied `no_permit` or `forbidden`); calls refused before it (a malformed name,
    /// a tool not in the turn's catalogue, invalid arguments, an unresolvable path) are counted
    /// and skipped, and the catalogue a turn would get is not recomputed. Reads the record file
    /// itself: no broker needs to run.
    Replay(Box<ReplayArgs>),
}

/// `--attr` values: KEY=VALUE (a string) or KEY:=JSON (any JSON value).
/// `--subject-token-file`: the token in the file, one trailing newline off; never in an error.
fn read_subject_token(path: &Path) -> anyhow::Result<sharedos_proto::ipc::SubjectToken> {
    const MAX_SUBJECT_TOKEN_BYTES: u64 = 64 * 1024;
    let shown = path.display();
    let meta = std::fs::metadata(path)
        .with_context(|| format!("--subject-token-file `{shown}` cannot be read"))?;
    if meta.len() > MAX_SUBJECT_TOKEN_BYTES {
        bail!("--subject-token-file `{shown}` is over {MAX_SUBJECT_TOKEN_BYTES} bytes");
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--subject-token-file `{shown}` cannot be read as text"))?;
    let token = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    if token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!(
            "--subject-token-file `{shown}` holds no token (empty, or whitespace or control characters in it)"
        );
    }
    Ok(sharedos_proto::ipc::SubjectToken::new(token.to_owned()))
}

fn parse_attributes(
    given: &[String],
) -> anyhow::Result<Option<serde_json::Map<String, serde_json::Value>>> {
    let mut out = serde_json::Map::new();
    for a in given {
        let (key, value) = if let Some((k, json)) = a.split_once(":=") {
            let v = serde_json::from_str(json).with_context(|| {
                format!("--attr `{a}`: `{json}` is not JSON (use KEY=VALUE for a string)")
            })?;
            (k, v)
        } else if let Some((k, v)) = a.split_once('=') {
            (k, serde_json::Value::String(v.to_owned()))
        } else {
            bail!("--attr `{a}`: use KEY=VALUE (a string) or KEY:=JSON");
        };
        if out.insert(key.to_owned(), value).is_some() {
            bail!("--attr `{key}` is given twice");
        }
    }
    Ok((!out.is_empty()).then_some(out))
}

/// The tracing target of the MCP client library (rmcp: every module's target starts with it).
const LIBRARY_TARGET: &str = "rmcp";

fn init_logging(
    default: &str,
    file: Option<&Path>,
) -> anyhow::Result<Option<tracing_appender::non_blocking::WorkerGuard>> {
    use tracing_subscriber::{EnvFilter, fmt, prelude::*};
    let asked = std::env::var("SHAREDOS_LOG").ok();
    let mut filter =
        EnvFilter::try_from_env("SHAREDOS_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    // The MCP client library logs what an upstream sends (every notification, with its payload,
    // at INFO; rejected requests and over-long lines at WARN and ERROR, once each): an upstream
    // reaches the log only through the broker's own bounded lines (`upstream/log.rs`). Unless
    // SHAREDOS_LOG names the library's targets itself.
    if !asked.is_some_and(|a| a.contains(LIBRARY_TARGET)) {
        filter = filter.add_directive(format!("{LIBRARY_TARGET}=off").parse()?);
    }
    let stderr = fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(colour_on_stderr());
    let (file_layer, guard) = match file {
        Some(path) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot open log file `{}`", path.display()))?;
            // A bounded, lossless buffer (the default pre-allocates 128,000 lines).
            let (w, g) = tracing_appender::non_blocking::NonBlockingBuilder::default()
                .buffered_lines_limit(8192)
                .lossy(false)
                .finish(f);
            (Some(fmt::layer().with_writer(w).with_ansi(false)), Some(g))
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(stderr)
        .with(file_layer)
        .try_init();
    Ok(guard)
}

/// Colour in logs only on a terminal, and never with `NO_COLOR` set (no-color.org): escape codes
/// must not reach a redirected log.
fn colour_on_stderr() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

pub fn main(cli: Cli) -> anyhow::Result<ExitCode> {
    let runtime_dir = runtime::resolve_runtime_dir(cli.runtime_dir.as_deref());
    if let Command::Catalog {
        command: Some(CatalogCommand::Hash { file, canonical }),
        ..
    } = &cli.command
    {
        return catalog_hash(file, *canonical);
    }
    if let Command::Records {
        command:
            Some(RecordsCommand::Verify {
                record,
                config,
                public_key,
                witness,
                json,
            }),
        ..
    } = &cli.command
    {
        return records_verify(
            &runtime_dir,
            record.as_deref(),
            config.as_deref(),
            public_key.as_deref(),
            witness.as_deref(),
            *json,
        );
    }
    if let Command::Records {
        command:
            Some(RecordsCommand::Checkpoint {
                record,
                config,
                json,
            }),
        ..
    } = &cli.command
    {
        return records_checkpoint(&runtime_dir, record.as_deref(), config.as_deref(), *json);
    }
    if let Command::Secrets(command) = &cli.command {
        return secrets_command(command);
    }
    let log_file = match &cli.command {
        Command::Serve { log_file, .. } => log_file.clone(),
        _ => None,
    };
    let default_level = if matches!(cli.command, Command::Serve { .. }) {
        "info"
    } else {
        "warn"
    };
    let _guard = init_logging(default_level, log_file.as_deref())?;
    // Offline: it reads a record file, and needs neither a broker nor a runtime.
    if let Command::Policy(PolicyCommand::Replay(args)) = cli.command {
        return crate::replay::run(*args, &default_dir(&runtime_dir));
    }
    if let Command::Column(
        c @ (ColumnCommand::Compare { .. }
        | ColumnCommand::Matrix { .. }
        | ColumnCommand::Summary { .. }),
    ) = cli.command
    {
        return column_offline(c);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        match cli.command {
            Command::Serve {
                config,
                redact_arguments,
                ..
            } => serve(config, runtime_dir, redact_arguments).await,
            Command::Demo => crate::demo::run().await,
            Command::ScriptedModel {
                listen,
                script,
                log,
            } => {
                sharedos_column::scripted_model::run(listen, &script, log).await?;
                Ok(ExitCode::SUCCESS)
            }
            command => host_command(command, &runtime_dir).await,
        }
    })
}

/// Where `serve` without --config lays out the embedded default.
fn default_dir(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("default")
}

async fn serve(
    config: Option<PathBuf>,
    runtime_dir: PathBuf,
    redact_arguments: bool,
) -> anyhow::Result<ExitCode> {
    let mut config = match config {
        Some(path) => Config::from_file(&path)?,
        None => {
            // The runtime dir, and the record's and key's names, are checked before the
            // embedded default is laid out in it.
            sharedos_broker::server::check_runtime_dir(&runtime_dir)?;
            let record = Config::embedded_record(&default_dir(&runtime_dir));
            sharedos_broker::evidence::record::check_files(
                &record,
                &sharedos_broker::config::default_signing_key(&record),
            )?;
            Config::embedded(&default_dir(&runtime_dir))?
        }
    };
    config.redact_arguments |= redact_arguments;
    let shutdown = CancellationToken::new();
    let running =
        sharedos_broker::server::start(config, runtime_dir.clone(), shutdown.clone()).await?;
    eprintln!(
        "sharedos-broker: serving; control socket {}, bridge socket {}",
        runtime::control_socket(&runtime_dir).display(),
        runtime::bridge_socket(&runtime_dir).display()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    shutdown.cancel();
    running.wait().await?;
    Ok(ExitCode::SUCCESS)
}

fn catalog_hash(file: &Path, canonical: bool) -> anyhow::Result<ExitCode> {
    let text = if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin")?;
        s
    } else {
        std::fs::read_to_string(file)
            .with_context(|| format!("cannot read `{}`", file.display()))?
    };
    let tools = parse_tool_list(&text).with_context(|| format!("`{}`", file.display()))?;
    if canonical {
        outln!("{}", sharedos_proto::canonical_catalog(&tools)?);
    } else {
        outln!("{}", sharedos_proto::catalog_hash(&tools)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads a JSON array of tool definitions; any invalid entry rejects the whole input.
pub fn parse_tool_list(text: &str) -> anyhow::Result<Vec<PublishedToolDefinition>> {
    let value: Value = serde_json::from_str(text).context("not JSON")?;
    let Value::Array(items) = value else {
        bail!("expected a JSON array of tool definitions");
    };
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let shown_name = item
            .get("name")
            .map(|n| n.to_string())
            .unwrap_or_else(|| "(no name)".into());
        let def: ToolDefinition = serde_json::from_value(item)
            .with_context(|| format!("tool #{i} {shown_name} is rejected"))?;
        if !seen.insert(def.name.to_string()) {
            bail!(
                "tool #{i} `{}` is rejected: the name appears twice",
                def.name
            );
        }
        out.push(def.publish());
    }
    Ok(out)
}

/// What is left of each budget, one line each: `budget "files.read calls_per_turn=3": 2 of 3 left`.
fn print_budgets(budgets: &[sharedos_proto::ipc::BudgetLeft]) -> anyhow::Result<()> {
    for b in budgets {
        let refill = b
            .refills_in_seconds
            .map(|s| format!(", one more in {s} s"))
            .unwrap_or_default();
        outln!(
            "  budget \"{}\": {} of {} left (per {}){refill}",
            b.budget,
            b.left,
            b.limit,
            b.scope
        );
    }
    Ok(())
}

fn unexpected(r: ControlResponse) -> anyhow::Error {
    anyhow::anyhow!("unexpected answer from the broker: {r:?}")
}

/// `column compare`, `column matrix` and `column summary`: files in, text out.
fn column_offline(command: ColumnCommand) -> anyhow::Result<ExitCode> {
    use sharedos_column::matrix;
    match command {
        ColumnCommand::Compare { a, b } => {
            let (ma, mb) = (matrix::read_manifest(&a)?, matrix::read_manifest(&b)?);
            let c = matrix::compare(&a.display().to_string(), &ma, &b.display().to_string(), &mb);
            out!("{}", c.text);
            Ok(ExitCode::from(c.exit))
        }
        ColumnCommand::Matrix { paths, show_anyway } => {
            out!(
                "{}",
                matrix::render(&matrix::read_summaries(&paths)?, show_anyway)?
            );
            Ok(ExitCode::SUCCESS)
        }
        ColumnCommand::Summary { manifest } => {
            crate::output::print_json(&matrix::summary(&matrix::read_manifest(&manifest)?))?;
            Ok(ExitCode::SUCCESS)
        }
        ColumnCommand::Run { .. } => bail!("`column run` needs the broker"),
    }
}

async fn host_command(command: Command, runtime_dir: &Path) -> anyhow::Result<ExitCode> {
    if let Command::Column(ColumnCommand::Run {
        host_config,
        rows,
        out,
        workdir,
        model_log,
    }) = command
    {
        let opts = sharedos_column::runner::RunOptions {
            runtime_dir: runtime_dir.to_path_buf(),
            host_config,
            rows,
            out,
            workdir,
            model_log,
        };
        let (manifest, all_passed) = sharedos_column::runner::run(&opts).await?;
        out!("{}", sharedos_column::runner::table(&manifest));
        outln!("manifest: {}", opts.out.display());
        return Ok(if all_passed {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(sharedos_column::runner::EXIT_NOT_ALL_PASSED)
        });
    }
    let mut client = ControlClient::connect(runtime_dir).await?;
    match command {
        Command::Catalog { query, .. } => {
            let Some(principal) = query.principal else {
                bail!("`catalog` needs --principal ID (or use `catalog hash FILE`)");
            };
            match client
                .call(&ControlRequest::Catalog {
                    principal,
                    agent: query.agent,
                })
                .await?
            {
                ControlResponse::Catalog {
                    catalog_hash,
                    tools,
                    budgets,
                } => {
                    // What a policy cannot see of each tool's arguments (`context.arguments`
                    // leaves out what Cedar cannot hold), from the schemas listed.
                    let left_out = |t: &PublishedToolDefinition| {
                        sharedos_broker::policy::arguments::typing(t.input_schema.as_ref()).left_out
                    };
                    if query.json {
                        let mut v =
                            serde_json::json!({"catalogHash": catalog_hash, "tools": tools});
                        if !budgets.is_empty() {
                            v["budgets"] = serde_json::to_value(&budgets)?;
                        }
                        let notes: serde_json::Map<String, Value> = tools
                            .iter()
                            .map(|t| (t.name.to_string(), left_out(t)))
                            .filter(|(_, l)| !l.is_empty())
                            .map(|(n, l)| (n, serde_json::json!(l)))
                            .collect();
                        if !notes.is_empty() {
                            v["argumentsLeftOut"] = Value::Object(notes);
                        }
                        print_json(&v)?;
                    } else {
                        outln!("catalogHash: {catalog_hash}");
                        for t in &tools {
                            outln!(
                                "  {:<24} {}",
                                t.name,
                                t.description.as_deref().unwrap_or("")
                            );
                            for note in left_out(t) {
                                outln!("  {:<24}   not in context.arguments: {note}", "");
                            }
                        }
                        if tools.is_empty() {
                            outln!("  (no tools: no policy could permit this principal anything)");
                        }
                        print_budgets(&budgets)?;
                    }
                }
                r => return Err(unexpected(r)),
            }
        }
        Command::Turn(TurnCommand::Open(open)) => {
            let OpenArgs {
                principal,
                agent,
                agent_owner,
                attributes,
                ttl,
                harness,
                tool_policy,
                system_identity,
                portable_names,
                write_config,
                token_file,
                token_dir,
                subject_token_file,
                file_owner,
                json,
            } = *open;
            let attributes = parse_attributes(&attributes)?;
            let subject_token = subject_token_file
                .as_deref()
                .map(read_subject_token)
                .transpose()?;
            let token_file = match (token_file, token_dir) {
                (Some(t), _) => Some(std::path::absolute(&t)?.display().to_string()),
                (None, Some(d)) => Some(
                    std::path::absolute(d.join("{turn}.token"))?
                        .display()
                        .to_string(),
                ),
                (None, None) => None,
            };
            let write_config = write_config
                .map(
                    |v| -> anyhow::Result<(sharedos_proto::alias::Harness, PathBuf)> {
                        let [format, path] = v.as_slice() else {
                            bail!("--write-config takes FORMAT PATH");
                        };
                        Ok((
                            sharedos_host::harness_config::parse_format(format)?,
                            PathBuf::from(path),
                        ))
                    },
                )
                .transpose()?;
            // Without --harness, the config format names the harness (for its aliases).
            let harness =
                harness.or_else(|| write_config.as_ref().map(|(f, _)| f.as_str().to_owned()));
            let tool_policy = tool_policy
                .map(|s| {
                    serde_json::from_str(&s).context("--tool-policy is not a valid ToolPolicy")
                })
                .transpose()?;
            let system_identity = system_identity
                .map(|s| {
                    serde_json::from_str(&s)
                        .context("--system-identity is not a valid SystemIdentity")
                })
                .transpose()?;
            let req = OpenTurn {
                principal,
                agent,
                agent_owner,
                attributes,
                token_file,
                ttl_seconds: ttl,
                harness,
                tool_policy,
                system_identity,
                portable_names,
                subject_token,
            };
            let t = match client
                .call(&ControlRequest::OpenTurn(Box::new(req)))
                .await?
            {
                ControlResponse::TurnOpened(t) => t,
                r => return Err(unexpected(r)),
            };
            let token_path = t.token_file.as_deref().map(PathBuf::from);
            let config_path = write_config
                .as_ref()
                .map(|(_, p)| PathBuf::from(p.display().to_string().replace("{turn}", &t.turn)));
            let written = (|| -> anyhow::Result<()> {
                if let Some(path) = &token_path {
                    sharedos_host::harness_config::write_private(
                        path,
                        &format!("{}\n", t.token.expose()),
                        file_owner,
                    )?;
                }
                if let (Some((format, _)), Some(path)) = (&write_config, &config_path) {
                    let launch = sharedos_host::harness_config::ShimLaunch {
                        shim: sharedos_host::shim_path::locate_shim()?,
                        bridge: std::path::absolute(runtime::bridge_socket(runtime_dir))?,
                        broker_uid: client.broker_uid(),
                        token: match &token_path {
                            Some(p) => sharedos_host::harness_config::TokenSource::File(p.clone()),
                            None => sharedos_host::harness_config::TokenSource::Env(
                                t.token.expose().to_owned(),
                            ),
                        },
                    };
                    sharedos_host::harness_config::write(*format, &launch, path, file_owner)?;
                }
                Ok(())
            })();
            if let Err(e) = written {
                // A turn whose files could not be written is of no use to anyone: close it.
                let _ = client
                    .call(&ControlRequest::CloseTurn {
                        turn: t.turn.clone(),
                    })
                    .await;
                return Err(e.context(format!("turn {} closed again", t.turn)));
            }
            for w in &t.warnings {
                eprintln!("warning: {w}");
            }
            if json {
                print_json(&t)?;
            } else {
                outln!("turn:        {}", t.turn);
                outln!("token:       {}", t.token.expose());
                outln!("catalogHash: {}", t.catalog_hash);
                outln!("expiresAt:   {}", t.expires_at);
                let names: Vec<String> = t.tools.iter().map(|t| t.name.to_string()).collect();
                outln!("tools:       {}", names.join(", "));
                if let (Some((format, _)), Some(path)) = (&write_config, &config_path) {
                    outln!(
                        "config:      {} ({}, mode 0600)",
                        path.display(),
                        format.as_str()
                    );
                }
                if let Some(path) = &token_path {
                    outln!("tokenFile:   {} (mode 0600)", path.display());
                }
            }
        }
        Command::Turn(TurnCommand::Close { turn }) => {
            match client.call(&ControlRequest::CloseTurn { turn }).await? {
                ControlResponse::TurnClosed { turn, token_file } => {
                    // The broker removes it too; this covers a folder only the host can write.
                    if let Some(path) = token_file {
                        sharedos_broker::state::remove_token_file(Path::new(&path));
                    }
                    outln!("closed {turn}")
                }
                r => return Err(unexpected(r)),
            }
        }
        Command::Turn(TurnCommand::List { json }) => {
            match client.call(&ControlRequest::ListTurns).await? {
                ControlResponse::Turns { turns } => {
                    if json {
                        print_json(&turns)?;
                    } else if turns.is_empty() {
                        outln!("no open turns");
                    } else {
                        outln!(
                            "{:<20} {:<12} {:<12} {:>5} {:>7} {:>6}  expires",
                            "turn",
                            "principal",
                            "catalog",
                            "tools",
                            "bridges",
                            "calls"
                        );
                        for t in turns {
                            outln!(
                                "{:<20} {:<12} {:<12} {:>5} {:>7} {:>6}  {}",
                                t.turn,
                                t.principal,
                                &t.catalog_hash.as_str()[..12],
                                t.tools,
                                t.bridges,
                                t.calls,
                                t.expires_at
                            );
                            print_budgets(&t.budgets)?;
                        }
                    }
                }
                r => return Err(unexpected(r)),
            }
        }
        Command::Records { turn, json, .. } => {
            let mut after_seq = 0;
            if !json {
                outln!("{}", record_header());
            }
            loop {
                let req = ControlRequest::Records {
                    turn: turn.clone(),
                    after_seq,
                    limit: None,
                };
                match client.call(&req).await? {
                    ControlResponse::Records {
                        lines,
                        last_seq,
                        more,
                    } => {
                        for line in &lines {
                            if json {
                                outln!("{}", serde_json::to_string(line)?);
                            } else {
                                outln!("{}", record_row(line));
                            }
                        }
                        after_seq = last_seq;
                        if !more {
                            break;
                        }
                    }
                    r => return Err(unexpected(r)),
                }
            }
        }
        Command::Policy(PolicyCommand::Check {
            principal,
            agent,
            tool,
            args,
            json,
        }) => {
            let arguments: Value =
                serde_json::from_str(&args).context("--args is not valid JSON")?;
            match client
                .call(&ControlRequest::PolicyCheck {
                    principal,
                    agent,
                    tool,
                    arguments: Some(arguments),
                })
                .await?
            {
                r @ ControlResponse::Decision { .. } => {
                    let ControlResponse::Decision {
                        decision,
                        outcome,
                        requirement,
                        policies,
                        message,
                        context,
                    } = &r
                    else {
                        return Err(unexpected(r));
                    };
                    if json {
                        print_json(
                            &serde_json::json!({"decision": decision, "outcome": outcome.word(), "code": outcome.code(),
                                                       "requirement": requirement, "policies": policies, "message": message,
                                                       "context": context}),
                        )?;
                    } else {
                        outln!("{message}");
                        if let Some(req) = requirement {
                            outln!("requirement: {} on {}", req.action, req.resource);
                        }
                        let deciding = if !policies.is_empty() {
                            policies.join(", ")
                        } else if decision == "deny" {
                            "(none: no policy permits it, so it is denied by default)".to_owned()
                        } else {
                            format!(
                                "(none: the call would fail before any policy is asked: {})",
                                outcome.code()
                            )
                        };
                        outln!("policies: {deciding}");
                        if let Some(context) = context {
                            outln!("context: {context}");
                        }
                    }
                    if decision != "allow" {
                        return Ok(ExitCode::from(3));
                    }
                }
                r => return Err(unexpected(r)),
            }
        }
        Command::Providers {
            command: Some(ProvidersCommand::Pin),
            ..
        } => match client.call(&ControlRequest::PinProviders).await? {
            ControlResponse::Pinned { path, pins } => {
                for (ns, hash) in &pins {
                    outln!("{ns} = {hash}");
                }
                outln!("pinned in {path}");
            }
            r => return Err(unexpected(r)),
        },
        Command::Telemetry { json } => match client.call(&ControlRequest::Telemetry).await? {
            ControlResponse::Telemetry(stats) => {
                if json {
                    print_json(&stats)?;
                } else if !stats.enabled {
                    outln!(
                        "OpenTelemetry export: off (an [otel] section or OTEL_EXPORTER_OTLP_ENDPOINT turns it on)"
                    );
                } else {
                    outln!(
                        "OpenTelemetry export: on, to {}",
                        stats.endpoint.as_deref().unwrap_or("?")
                    );
                    outln!(
                        "spans: {} queued, {} exported, {} dropped (queue full), {} dropped (export failed)",
                        stats.queued,
                        stats.exported,
                        stats.dropped_queue_full,
                        stats.dropped_export_failed
                    );
                    let l = &stats.logs;
                    outln!(
                        "record lines as logs: {} queued, {} exported, {} dropped (queue full), {} dropped (export failed)",
                        l.queued,
                        l.exported,
                        l.dropped_queue_full,
                        l.dropped_export_failed
                    );
                }
                if !json {
                    let w = &stats.witness;
                    if w.enabled {
                        outln!(
                            "witness: {} checkpoints queued, {} witnessed, {} failed, {} dropped (queue full)",
                            w.queued,
                            w.witnessed,
                            w.failed,
                            w.dropped
                        );
                    } else {
                        outln!("witness: off (no witness_file or witness_command)");
                    }
                }
            }
            r => return Err(unexpected(r)),
        },
        Command::Providers {
            command: None,
            json,
        } => match client.call(&ControlRequest::Providers).await? {
            ControlResponse::Providers { providers } => {
                if json {
                    print_json(&providers)?;
                } else {
                    for p in &providers {
                        let s = |k: &str| p[k].as_str().unwrap_or("").to_owned();
                        let scope = if p["scope"].is_object() {
                            format!(" scope={}", p["scope"])
                        } else {
                            String::new()
                        };
                        outln!("{} ({}) {}{}", s("namespace"), s("type"), s("state"), scope);
                        if let Some(h) = p["upstreamHash"].as_str() {
                            let pin = p["pinnedHash"].as_str().unwrap_or("(not pinned)");
                            outln!("  upstream catalogHash {h}, pinned {pin}");
                        }
                        let tools: Vec<&str> = p["tools"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(Value::as_str)
                            .collect();
                        outln!(
                            "  tools: {}",
                            if tools.is_empty() {
                                "(none)".to_owned()
                            } else {
                                tools.join(", ")
                            }
                        );
                        for r in p["rejected"].as_array().into_iter().flatten() {
                            outln!(
                                "  rejected {:?}: {}",
                                r["upstream"].as_str().unwrap_or(""),
                                r["reason"].as_str().unwrap_or("")
                            );
                        }
                        if let Some(e) = p["lastError"].as_str() {
                            outln!("  last error: {e}");
                        }
                        if p["elicitation"] == "forward" {
                            outln!(
                                "  elicitation: forward (its server's questions go to the person behind the call)"
                            );
                        }
                        let sb = &p["sandbox"];
                        if sb == "none" {
                            outln!(
                                "  sandbox: none (runs with the broker's uid, environment, files and network)"
                            );
                        } else if let Some(e) = sb["unavailable"].as_str() {
                            outln!("  sandbox: unavailable: {e}");
                        } else if sb.is_object() {
                            // Each rule with where it came from (default, command folder,
                            // interpreter, file_root, config), where the broker says.
                            let list = |k: &str| match sb["rules"].as_array() {
                                Some(rules) => rules
                                    .iter()
                                    .filter(|r| r["access"] == k)
                                    .map(|r| {
                                        format!(
                                            "{} ({})",
                                            r["path"].as_str().unwrap_or("?"),
                                            r["origin"].as_str().unwrap_or("?")
                                        )
                                    })
                                    .collect::<Vec<_>>()
                                    .join(", "),
                                None => sb[k]
                                    .as_array()
                                    .into_iter()
                                    .flatten()
                                    .filter_map(Value::as_str)
                                    .collect::<Vec<_>>()
                                    .join(" "),
                            };
                            let uid = if sb["ownUid"] == true {
                                format!("uid {} gid {}", sb["uid"], sb["gid"])
                            } else {
                                format!("uid {} (the broker's; no capabilities)", sb["uid"])
                            };
                            let net = match sb["network"].as_str() {
                                Some("ports") => format!("tcp ports {}", sb["ports"]),
                                Some("off") if sb["userns"] == true => {
                                    "off (own network namespace, in its own user namespace)".into()
                                }
                                Some("off") if sb["netns"] == true => {
                                    "off (own network namespace)".into()
                                }
                                n => n.unwrap_or("").to_owned(),
                            };
                            outln!(
                                "  sandbox: {uid}, network {net}, memory {} MiB, processes {}, open files {}, cpu {}, landlock abi {}",
                                sb["memoryBytes"].as_u64().unwrap_or(0) / (1024 * 1024),
                                sb["processes"],
                                sb["openFiles"],
                                sb["cpuSeconds"]
                                    .as_u64()
                                    .map_or("unlimited".to_owned(), |s| format!("{s} s")),
                                sb["landlockAbi"],
                            );
                            outln!("    read: {}", list("read"));
                            outln!("    write: {}", list("write"));
                            let own: Vec<&str> = [
                                ("mountNs", "mount (only its rules' paths)"),
                                ("ipcNs", "ipc"),
                                ("netns", "network"),
                                ("userns", "user"),
                            ]
                            .into_iter()
                            .filter(|(k, _)| sb[*k] == true)
                            .map(|(_, name)| name)
                            .collect();
                            if !own.is_empty() {
                                outln!("    namespaces of its own: {}", own.join(", "));
                            }
                            let iu = &sb["instanceUids"];
                            if let Some(own) = iu.get("own") {
                                outln!(
                                    "    instances: each principal's under a uid of its own, from {} = [{}, {}]",
                                    own["setting"].as_str().unwrap_or("instance_uids"),
                                    own["first"],
                                    own["last"]
                                );
                            } else if let Some(why) = iu["shared"]["why"].as_str() {
                                outln!("    instances: the provider's uid and sandbox ({why})");
                            }
                        }
                        for i in p["instances"].as_array().into_iter().flatten() {
                            outln!(
                                "  instance of {}: {}{} call(s) in flight, idle {} s",
                                i["principal"].as_str().unwrap_or("?"),
                                i["uid"]
                                    .as_u64()
                                    .map_or(String::new(), |u| format!("uid {u}, ")),
                                i["callsInFlight"],
                                i["idleSeconds"],
                            );
                        }
                    }
                }
            }
            r => return Err(unexpected(r)),
        },
        Command::Approvals {
            command: None,
            json,
        } => match client.call(&ControlRequest::Approvals).await? {
            ControlResponse::Approvals {
                approvals,
                not_shown,
            } => {
                if json {
                    print_json(&approvals)?;
                } else if approvals.is_empty() && not_shown == 0 {
                    outln!("no calls are waiting for approval");
                } else {
                    for a in &approvals {
                        outln!("{}", a.id);
                        let arguments = match &a.arguments_digest {
                            Some(d) => format!(
                                "(arguments of {} bytes, sha256 {}: `approvals show {}` prints them)",
                                d.bytes, d.sha256, a.id
                            ),
                            None => a.arguments.to_string(),
                        };
                        outln!(
                            "  turn {} ({}) principal {}: {} {}",
                            a.turn,
                            a.call_id,
                            a.principal,
                            a.tool,
                            arguments
                        );
                        // What the policy decided on, which the approval covers: the file
                        // the arguments resolved to, not only the arguments.
                        if let Some(r) = &a.requirement {
                            let ns = r
                                .namespace
                                .as_ref()
                                .map(|n| format!(" (namespace {n})"))
                                .unwrap_or_default();
                            outln!("  requirement: {} on {}{ns}", r.action, r.resource);
                        }
                        outln!("  requested {}, expires {}", a.requested_at, a.expires_at);
                    }
                }
                if not_shown > 0 {
                    eprintln!(
                        "{not_shown} more calls are waiting for approval than one answer carries; decide some and list again"
                    );
                }
            }
            r => return Err(unexpected(r)),
        },
        Command::Approvals {
            command: Some(ApprovalsCommand::Show { id }),
            ..
        } => {
            let mut text = String::new();
            let (bytes, sha256) = loop {
                let req = ControlRequest::ApprovalArguments {
                    id: id.clone(),
                    offset: text.len(),
                };
                match client.call(&req).await? {
                    ControlResponse::ApprovalArguments {
                        text: part,
                        bytes,
                        sha256,
                        more,
                        ..
                    } => {
                        text.push_str(&part);
                        if !more || part.is_empty() {
                            break (bytes, sha256);
                        }
                    }
                    r => return Err(unexpected(r)),
                }
            };
            if text.len() != bytes || sharedos_proto::catalog::sha256_hex(text.as_bytes()) != sha256
            {
                bail!(
                    "the arguments of approval `{}` read back as {} bytes that do not match the broker's {bytes} bytes, sha256 {sha256}",
                    sharedos_proto::name::shown(&id),
                    text.len()
                );
            }
            outln!("{text}");
        }
        Command::Approvals {
            command: Some(decide),
            ..
        } => {
            let (id, approve, reason) = match decide {
                ApprovalsCommand::Approve { id } => (id, true, None),
                ApprovalsCommand::Deny { id, reason } => (id, false, reason),
                ApprovalsCommand::Show { .. } => bail!("`approvals show` is answered above"),
            };
            match client
                .call(&ControlRequest::DecideApproval {
                    id,
                    approve,
                    reason,
                })
                .await?
            {
                ControlResponse::ApprovalDecided { id, decision } => outln!("{decision} {id}"),
                r => return Err(unexpected(r)),
            }
        }
        Command::Policy(PolicyCommand::Reload) => {
            match client.call(&ControlRequest::PolicyReload).await? {
                ControlResponse::PolicyReloaded { version, policies } => {
                    outln!("policy reloaded: version {version}, {policies} policies")
                }
                r => return Err(unexpected(r)),
            }
        }
        Command::Serve { .. }
        | Command::Demo
        | Command::ScriptedModel { .. }
        | Command::Column(_)
        | Command::Secrets(_)
        | Command::Policy(PolicyCommand::Replay(_)) => {
            bail!("not a host command")
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The record a `records` command reads: `--record`, else the config's, else the default's.
fn record_of(runtime_dir: &Path, record: Option<&Path>, config: Option<&Config>) -> PathBuf {
    match (record, config) {
        (Some(r), _) => r.to_path_buf(),
        (None, Some(c)) => c.record.clone(),
        (None, None) => runtime_dir.join("default").join("record.jsonl"),
    }
}

/// `records checkpoint`: the newest signed checkpoint, from the files.
fn records_checkpoint(
    runtime_dir: &Path,
    record: Option<&Path>,
    config: Option<&Path>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let config = config.map(Config::from_file).transpose()?;
    let record = record_of(runtime_dir, record, config.as_ref());
    let newest = sharedos_broker::evidence::chain::newest_checkpoint(&record)
        .with_context(|| format!("cannot read record `{}`", record.display()))?;
    let Some(line) = newest else {
        eprintln!(
            "record `{}` has no checkpoint (no signing key, or nothing signed yet)",
            record.display()
        );
        return Ok(ExitCode::from(1));
    };
    if json {
        outln!("{line}");
    } else {
        let v: Value = serde_json::from_str(&line).context("the checkpoint line is not JSON")?;
        outln!(
            "seq {}  at {}  sha256 {}  key {}",
            v["seq"],
            v["at"].as_str().unwrap_or(""),
            sharedos_proto::catalog::hex(&sharedos_broker::evidence::record::line_hash(
                line.as_bytes()
            )),
            v["publicKey"].as_str().unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether `file` lies in `record`'s folder (or below it): a key there can be replaced by
/// whoever can rewrite the record.
fn in_record_folder(file: &Path, record: &Path) -> bool {
    let folder = record
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match (file.canonicalize(), folder.canonicalize()) {
        (Ok(f), Ok(d)) => f.starts_with(d),
        _ => false,
    }
}

/// `records verify`: the record's chain and signatures, checked from the files.
fn records_verify(
    runtime_dir: &Path,
    record: Option<&Path>,
    config: Option<&Path>,
    public_key: Option<&Path>,
    witness: Option<&Path>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use sharedos_broker::evidence::chain;
    let config = config.map(Config::from_file).transpose()?;
    let record = record_of(runtime_dir, record, config.as_ref());
    let signing_key = config.as_ref().map_or_else(
        || sharedos_broker::config::default_signing_key(&record),
        |c| c.record_signing_key.clone(),
    );
    let beside = sharedos_broker::evidence::record::public_key_path(&signing_key);
    let key_file = match public_key {
        Some(p) => Some(p.to_path_buf()),
        None => beside.exists().then_some(beside),
    };
    let key = key_file
        .as_deref()
        .map(|p| chain::read_public_key(p).map(|k| (k, p.display().to_string())))
        .transpose()?;
    // Witness lines are checked against a key the caller holds: a key the record names, or one
    // beside it, is the one a rewriter of the record would replace, so it would let them skip
    // the genuine witnessed lines as "wrongly signed".
    let trusted = key
        .as_ref()
        .filter(|_| public_key.is_some_and(|p| !in_record_folder(p, &record)))
        .map(|(k, _)| k);
    let witness = witness
        .map(|w| {
            chain::Witness::read(w, trusted)
                .with_context(|| format!("cannot read witness `{}`", w.display()))
                .map(|read| (w, read))
        })
        .transpose()?;
    let report = chain::verify_witnessed(
        &record,
        key.as_ref().map(|(k, from)| (k, from.clone())),
        witness.as_ref().map(|(_, w)| w),
    )
    .with_context(|| format!("cannot verify record `{}`", record.display()))?;
    let key_in_folder = key_file
        .as_deref()
        .is_some_and(|k| in_record_folder(k, &record));
    let mut warnings = Vec::new();
    if key_in_folder && let Some(k) = &key_file {
        warnings.push(format!(
            "the key `{}` lies in the record's own folder: whoever can rewrite the record can replace the key (and its `.pub`) too, so this check shows the record is whole under that key, not that it is yours; pass --public-key with a copy kept elsewhere, and --witness",
            k.display()
        ));
    }
    if report.key_source == chain::KeySource::Recorded {
        warnings.push(
            "the key was named by the record itself: this shows the record is whole under that key, not whose key it is; pass --public-key with a copy kept elsewhere".to_owned(),
        );
    }
    // A key given but nothing signed: nothing was checked against it.
    let unsigned_with_key = public_key.is_some() && report.checkpoints == 0;
    let ok = report.ok() && !unsigned_with_key;
    let chained = report.lines.saturating_sub(report.unchained);
    let cut_note = match (report.last_checkpoint, witness.is_some()) {
        (_, true) => None,
        (None, false) => Some(format!(
            "no checkpoint: none of the {chained} chained lines is signed; lines cut from the end, or a record made up from nothing, cannot be detected"
        )),
        (Some(last), false) if report.unsigned_tail > 0 => Some(format!(
            "{} lines after the last checkpoint (seq {last}) are not signed: a cut after seq {last} (or of the last checkpoints with it) cannot be detected without a witness (--witness)",
            report.unsigned_tail
        )),
        (Some(last), false) => Some(format!(
            "0 lines after the last checkpoint (seq {last}) are unsigned; a cut of the last checkpoints with the lines before them cannot be detected without a witness (--witness)"
        )),
    };
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if json {
        let broken = report.broken.as_ref().map(|b| {
            serde_json::json!({
                "seq": b.seq, "file": b.file, "line": b.line, "reason": b.reason,
            })
        });
        outln!(
            "{}",
            serde_json::json!({
                "ok": ok,
                "files": report.files,
                "lines": report.lines,
                "firstSeq": report.first_seq,
                "lastSeq": report.last_seq,
                "unchained": report.unchained,
                "chainStart": report.chain_start,
                "checkpoints": report.checkpoints,
                "lastCheckpoint": report.last_checkpoint,
                "unsignedTail": report.unsigned_tail,
                "tornCuts": report.torn_cuts,
                "publicKey": report.key,
                "keyFrom": match &report.key_source {
                    chain::KeySource::Given(f) => f.clone(),
                    chain::KeySource::Recorded => "record".into(),
                    chain::KeySource::None => "none".into(),
                },
                "keyInRecordFolder": key_in_folder || report.key_source == chain::KeySource::Recorded,
                "noCheckpointWithKey": unsigned_with_key,
                "witness": witness.as_ref().map(|(p, _)| p),
                "witnessed": report.witnessed,
                "witnessNewest": report.witness_newest,
                "witnessChecked": witness.as_ref().map(|(_, w)| w.checked),
                "witnessSkipped": witness.as_ref().map(|(_, w)| w.skipped_count),
                "witnessSkippedLines": witness.as_ref().map(|(_, w)| w
                    .skipped
                    .iter()
                    .map(|s| serde_json::json!({"line": s.line, "reason": s.reason}))
                    .collect::<Vec<_>>()),
                "cutUndetectable": cut_note,
                "warnings": warnings,
                "broken": broken,
            })
        );
    } else {
        let files = report.files.len();
        outln!(
            "record `{}`: {} lines in {files} file{}, seq {}..{}",
            record.display(),
            report.lines,
            if files == 1 { "" } else { "s" },
            report.first_seq.unwrap_or(0),
            report.last_seq.unwrap_or(0)
        );
        match &report.key_source {
            chain::KeySource::Given(f) => {
                outln!("key: {} (from {f})", report.key.clone().unwrap_or_default())
            }
            chain::KeySource::Recorded => outln!(
                "key: {} (named by the record itself: this shows the record is whole under that key, not whose key it is; pass --public-key)",
                report.key.clone().unwrap_or_default()
            ),
            chain::KeySource::None => outln!("key: none (no checkpoint was checked)"),
        }
        if report.unchained > 0 {
            outln!(
                "{} lines before the chain began are not covered by it",
                report.unchained
            );
        }
        if report.torn_cuts > 0 {
            outln!(
                "{} torn tail(s) cut off by a broker at start, each recorded",
                report.torn_cuts
            );
        }
        if let Some((path, w)) = &witness {
            outln!(
                "witness `{}`: {} of its {} checkpoints found in the record with the same signed content; the newest it holds is seq {}",
                path.display(),
                report.witnessed,
                w.checkpoints.len(),
                report
                    .witness_newest
                    .map_or("-".to_owned(), |s| s.to_string())
            );
            if w.checked {
                outln!(
                    "witness lines checked against the key from {}: {} skipped",
                    public_key
                        .map(Path::display)
                        .map_or(String::new(), |p| p.to_string()),
                    w.skipped_count
                );
            } else {
                outln!(
                    "witness lines not checked against a key (no --public-key kept outside the record's folder): a checkpoint line anyone appended to the witness cannot be told from a genuine one; {} lines skipped",
                    w.skipped_count
                );
            }
            for s in &w.skipped {
                outln!("  skipped witness line {}: {}", s.line, s.reason);
            }
            let unlisted = w.skipped_count.saturating_sub(w.skipped.len() as u64);
            if unlisted > 0 {
                outln!("  ... and {unlisted} more skipped witness lines");
            }
        }
        match &report.broken {
            Some(b) => outln!(
                "BROKEN at seq {}: {} ({} line {})",
                b.seq,
                b.reason,
                b.file.display(),
                b.line
            ),
            None if report.chain_start.is_none() => {
                outln!("BROKEN: the record has no chain (no `chain_started` line)")
            }
            None if unsigned_with_key => outln!(
                "NOT VERIFIED: --public-key was given, but the record has no checkpoint: none of its {chained} chained lines is signed, so nothing ties it to that key (a record made up from nothing looks the same)"
            ),
            None => {
                outln!(
                    "verified: chain from seq {} whole; {} signed checkpoints, the last at seq {}",
                    report.chain_start.unwrap_or(0),
                    report.checkpoints,
                    report
                        .last_checkpoint
                        .map_or("-".to_owned(), |s| s.to_string())
                );
            }
        }
        if report.broken.is_none()
            && let Some(note) = &cut_note
        {
            outln!("{note}");
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

pub fn record_header() -> String {
    format!(
        "{:>5}  {:<15}  {:<18}  {:<28}  {:<30}  {}",
        "seq", "at", "kind", "tool", "outcome", "resource / detail"
    )
}

/// One record line as a table row. A line that is not a known event (a record written by a
/// newer broker) still shows its seq, time, kind and turn.
pub fn record_row(line: &Value) -> String {
    let s = |k: &str| line.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let at = s("at");
    let time = at
        .split('T')
        .nth(1)
        .unwrap_or(&at)
        .chars()
        .take(15)
        .collect::<String>();
    let seq = line.get("seq").and_then(Value::as_u64).unwrap_or(0);
    let row = |kind: &str, tool: &str, outcome: &str, detail: &str| {
        format!("{seq:>5}  {time:<15}  {kind:<18}  {tool:<28}  {outcome:<30}  {detail}")
    };
    let Ok(RecordLine { event, .. }) = serde_json::from_value::<RecordLine>(line.clone()) else {
        return row(&s("kind"), "", "", &s("turn"));
    };
    let (tool, outcome, detail) = match &event {
        Event::Call(c) => {
            let mut tool = format!("{:?}", c.tool);
            sharedos_proto::name::clip(&mut tool, 28);
            let resource = c.requirement.as_ref().map_or("-", |r| r.resource.as_str());
            (
                tool,
                format!("{}/{}", c.outcome, c.code),
                resource.to_owned(),
            )
        }
        Event::TurnOpened(o) => (
            String::new(),
            String::new(),
            format!(
                "{} principal={} catalogHash={}",
                o.turn,
                o.access_context.principal,
                o.catalog_hash.as_str().chars().take(16).collect::<String>()
            ),
        ),
        Event::TurnClosed(c) => (
            String::new(),
            String::new(),
            format!("{} reason={}", c.turn, c.reason),
        ),
        Event::BridgeConnected(b) => (
            String::new(),
            String::new(),
            format!(
                "{} pid={}",
                b.turn,
                b.peer.pid.map_or("null".to_owned(), |p| p.to_string())
            ),
        ),
        Event::ApprovalRequested(a) => (
            format!("{:?}", a.tool),
            "waiting".to_owned(),
            format!(
                "{} approval={} expires={}",
                a.call_id, a.approval, a.expires_at
            ),
        ),
        Event::ApprovalDecided(d) => (
            String::new(),
            d.decision.clone(),
            format!(
                "{} approval={} by={}{}",
                d.call_id,
                d.approval,
                d.decided_by.map_or("-".to_owned(), |u| u.to_string()),
                d.reason
                    .as_deref()
                    .map(|r| format!(" reason={r:?}"))
                    .unwrap_or_default()
            ),
        ),
        other => (
            String::new(),
            String::new(),
            other.turn().unwrap_or_default().to_owned(),
        ),
    };
    row(event.kind(), &tool, &outcome, &detail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every subcommand, option and argument of `sharedos-broker` says what it is for.
    #[test]
    fn every_option_and_argument_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            let here = format!("{path} {}", cmd.get_name());
            if cmd.get_about().is_none() && cmd.get_long_about().is_none() {
                missing.push(format!("{here}: the command"));
            }
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") || arg.is_hide_set() {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{here}: {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_name() != "help" {
                    walk(sub, &here, missing);
                }
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
