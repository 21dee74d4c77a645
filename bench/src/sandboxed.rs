//! Section 7: a sandboxed upstream's cold start against the same command unsandboxed (issue 32).
//!
//! The sandbox is planned by the broker's own code from a config the broker would load
//! (`Config::from_file`, which as root gives the provider a uid of its own, then
//! `upstream::sandbox::plan`), and applied by the real launcher (`sharedos-broker sandbox-exec
//! PLAN command args`), as the broker starts a sandboxed upstream. Both sides get the clean
//! environment the broker gives an upstream (`PATH`, `LANG`, `HOME` only), and `/` as their
//! folder, so the only difference measured is the sandbox.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use sharedos_broker::config::{ProviderConfig, SandboxSetting};
use sharedos_broker::upstream::sandbox;
use tokio::process::Command;

use crate::e2e;
use crate::micro;
use crate::procs::{self, Bins};
use crate::report::{Report, Table};
use crate::stats::{delta, dur, ratio};

pub const TITLE: &str =
    "7. Sandboxed upstream cold start: the same command with and without the sandbox";

/// How many starts, and how long at most, per upstream.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub warmup: usize,
    pub iterations: usize,
    pub budget: Duration,
}

/// One upstream command measured both ways.
struct Upstream {
    label: String,
    command: PathBuf,
    args: Vec<String>,
    /// `[providers.sandbox] read`: what it needs beyond the defaults and its command's folder.
    read: Vec<PathBuf>,
}

/// The script the issue-32 tests run: a plain JSON-RPC stdio server on the standard library.
fn hostile_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/hostile_upstream.py")
}

const SYSTEM_PYTHON: &str = "/usr/bin/python3";

fn upstreams(bins: &Bins) -> (Vec<Upstream>, Vec<String>) {
    let mut out = vec![Upstream {
        label: "`direct-files-server --synthetic-tools 3` (rmcp, Rust)".into(),
        command: bins.direct.clone(),
        args: vec!["--synthetic-tools".into(), "3".into()],
        read: vec![],
    }];
    let mut skipped = vec![];
    let script = sandbox::canonical(&hostile_script());
    match (Path::new(SYSTEM_PYTHON).is_file(), script.parent()) {
        (true, Some(folder)) if script.is_file() => out.push(Upstream {
            label: format!(
                "`tests/python/hostile_upstream.py` on `{SYSTEM_PYTHON}` (standard library only)"
            ),
            command: PathBuf::from(SYSTEM_PYTHON),
            args: vec![script.display().to_string()],
            read: vec![folder.to_path_buf()],
        }),
        _ => skipped.push(format!(
            "The Python row was not measured: it needs `{SYSTEM_PYTHON}` and `{}`.",
            script.display()
        )),
    }
    (out, skipped)
}

/// The broker's plan for each upstream (as JSON for the launcher, and in words), or why the
/// sandbox cannot be applied on this machine.
fn plans(upstreams: &[Upstream]) -> anyhow::Result<Vec<Result<(String, String), String>>> {
    let dir = micro::tempdir("sandbox")?;
    let mut providers = String::new();
    for (i, u) in upstreams.iter().enumerate() {
        let list = |items: Vec<String>| {
            items
                .iter()
                .map(|s| procs::toml_string(s))
                .collect::<Vec<_>>()
                .join(", ")
        };
        providers.push_str(&format!(
            "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"u{i}\"\ncommand = {}\nargs = [{}]\n[providers.sandbox]\nread = [{}]\n",
            procs::toml_string(&u.command.display().to_string()),
            list(u.args.clone()),
            list(u.read.iter().map(|p| p.display().to_string()).collect())
        ));
    }
    let cfg = procs::write_config(dir.path(), "batch", procs::PERMIT_CALLS, &providers)?;
    let config = sharedos_broker::Config::from_file(&cfg)
        .with_context(|| format!("the sandbox section's config `{}`", cfg.display()))?;
    let abi = sandbox::kernel_abi();
    let mut out = Vec::new();
    for p in &config.providers {
        let ProviderConfig::Mcp(m) = p else { continue };
        let SandboxSetting::On(sb) = &m.sandbox else {
            continue;
        };
        out.push(
            sandbox::plan(&m.namespace, sb, &m.command, dir.path(), None, &[], abi).and_then(
                |plan| {
                    let json = serde_json::to_string(&plan)
                        .map_err(|e| format!("cannot write the sandbox plan: {e}"))?;
                    Ok((json, describe(&plan)))
                },
            ),
        );
    }
    anyhow::ensure!(
        out.len() == upstreams.len(),
        "the config held {} sandboxed providers, not {}",
        out.len(),
        upstreams.len()
    );
    Ok(out)
}

/// The plan in words, for the report.
fn describe(p: &sandbox::Plan) -> String {
    format!(
        "uid {}{}, network `{}`{}{}, mount and IPC namespaces {}, Landlock ABI {} ({} read and {} write rules), limits: data {} MiB, {} processes, {} open files",
        p.uid,
        if p.own_uid {
            " (its own)"
        } else {
            " (the broker's, capabilities dropped)"
        },
        p.network,
        if p.netns {
            " in a network namespace of its own"
        } else {
            ""
        },
        if p.userns {
            ", in a user namespace of its own"
        } else {
            ""
        },
        if p.mount_ns && p.ipc_ns { "on" } else { "off" },
        p.landlock_abi,
        p.read.len(),
        p.write.len(),
        p.memory_bytes / (1024 * 1024),
        p.processes,
        p.open_files
    )
}

/// The command with the clean environment the broker gives an upstream, in `/`.
fn clean(mut cmd: Command) -> Command {
    sharedos_broker::child::clean_env(cmd.as_std_mut(), sandbox::DEFAULT_HOME, std::iter::empty());
    cmd.current_dir("/");
    cmd
}

fn unsandboxed(u: &Upstream) -> Command {
    let mut cmd = Command::new(&u.command);
    cmd.args(&u.args);
    clean(cmd)
}

fn sandboxed(bins: &Bins, plan: &str, u: &Upstream) -> Command {
    let mut cmd = Command::new(&bins.broker);
    cmd.arg(sandbox::SUBCOMMAND)
        .arg(plan)
        .arg(&u.command)
        .args(&u.args);
    clean(cmd)
}

pub async fn section(
    bins: &Bins,
    plan: Plan,
    quick: bool,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut t = Table::new(
        TITLE,
        &[
            "upstream",
            "started",
            "n",
            "median",
            "p99",
            "added (median)",
            "ratio (median)",
        ],
    );
    t.text(format!(
        "Measured from the client's side (an rmcp client in the benchmark process), as section 1: \
         spawn the upstream, `initialize`, `tools/list` answered; teardown not timed. \
         \"unsandboxed\" runs the command itself; \"sandboxed\" runs it through the real launcher \
         as the broker starts a sandboxed upstream (`sharedos-broker sandbox-exec PLAN command \
         args`: namespaces, its own process session, rlimits, capabilities dropped, a \
         parent-death signal, Landlock, then exec), with the plan the broker's own code makes \
         for a `[providers.sandbox]` of the defaults (plus the script's folder to read) from a \
         config loaded as the broker loads it. Both get the broker's clean environment and `/` \
         as their folder. {} untimed starts of each, then up to {} of each, interleaved \
         (bounded by {:.0} s per upstream){}. A start happens once per upstream and per \
         restart (and per principal's first call for a per-principal provider), never per call. \
         Replaces `bench/sandbox-cold-start.sh`.",
        plan.warmup,
        plan.iterations,
        plan.budget.as_secs_f64(),
        if quick { " (--quick: few starts)" } else { "" }
    ));
    let (list, skipped) = upstreams(bins);
    for s in skipped {
        t.text(s);
    }
    let planned = plans(&list)?;
    for (u, planned) in list.iter().zip(planned) {
        let plan_json = match planned {
            Ok((json, words)) => {
                t.text(format!("The plan for {}: {words}.", u.label));
                json
            }
            Err(why) => {
                t.text(format!(
                    "**{} was not measured sandboxed**: the sandbox cannot be applied on this \
                     machine: {why}",
                    u.label
                ));
                continue;
            }
        };
        eprintln!("bench:    {}…", u.label);
        let c = e2e::cold_start(
            || unsandboxed(u),
            || sandboxed(bins, &plan_json, u),
            plan.warmup,
            plan.iterations,
            plan.budget,
        )
        .await
        .with_context(|| format!("cold start of {}", u.label))?;
        anyhow::ensure!(
            e2e::same_tools(&c.direct_tools, &c.shim_tools),
            "{}: the sandboxed start listed other tools than the unsandboxed one",
            u.label
        );
        let (bare, walled) = (c.direct.summary(), c.shim.summary());
        t.row(vec![
            u.label.clone(),
            "unsandboxed (baseline)".into(),
            bare.n.to_string(),
            dur(bare.median),
            dur(bare.p99),
            "—".into(),
            "1.00".into(),
        ]);
        t.row(vec![
            u.label.clone(),
            "sandboxed".into(),
            walled.n.to_string(),
            dur(walled.median),
            dur(walled.p99),
            delta(walled.median, bare.median),
            format!("{:.2}", ratio(walled.median, bare.median)),
        ]);
    }
    report.tables.push(t);
    Ok(())
}
