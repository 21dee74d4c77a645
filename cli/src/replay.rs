//! `policy replay`: the record decided again under another policy file, printed for people or
//! as one JSON object. The replay itself is the broker library's (`sharedos_broker::evidence::replay`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use serde::Serialize;
use sharedos_broker::Config;
use sharedos_broker::evidence::replay::{self, Change, Report};
use sharedos_broker::policy::PolicyEngine;

use crate::output::{outln, print_json};

/// `policy replay`'s arguments.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The policy file to try (Cedar); it must validate against the schema, as for a reload.
    #[arg(long, value_name = "FILE")]
    pub policy: PathBuf,
    /// The record to read (JSON Lines); its rotated files (`<record>.<first seq>`) are read
    /// first, in order. Repeat it to read several records, oldest first.
    /// Default: the record of --config, else the embedded default's (<runtime dir>/default/record.jsonl).
    #[arg(long, value_name = "FILE")]
    pub record: Vec<PathBuf>,
    /// The broker's config file (TOML): its record and its Cedar schema. Without it: the
    /// embedded default's (the built-in schema).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Only calls recorded at or after this time (RFC 3339, like 2026-12-03T16:00:00Z); turns
    /// opened before it still give their calls' contexts.
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// Print one JSON object: the counts and every change.
    #[arg(long)]
    pub json: bool,
}

/// Exit status when some call would change (as `policy check` says 3 for a refusal).
const EXIT_WOULD_CHANGE: u8 = 3;

/// `--json`: the inputs, then the report's counts and changes.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Output<'a> {
    records: Vec<String>,
    policy: String,
    since: Option<&'a str>,
    #[serde(flatten)]
    report: &'a Report,
}

/// Runs `policy replay`. `default_dir`: where the embedded default lives (its record is the
/// default without --config or --record).
pub fn run(args: ReplayArgs, default_dir: &Path) -> anyhow::Result<ExitCode> {
    let since = args
        .since
        .as_deref()
        .map(replay::parse_time)
        .transpose()
        .context("--since")?;
    let (record, schema) = match &args.config {
        Some(path) => {
            let config = Config::from_file(path)?;
            (config.record, config.schema)
        }
        None => (Config::embedded_record(default_dir), None),
    };
    let given = if args.record.is_empty() {
        vec![record]
    } else {
        args.record.clone()
    };
    // The policy first (the input given on this command line), then the record.
    // A policy file that does not parse or validate is an error naming it, line and column.
    let engine = PolicyEngine::load(schema.as_deref(), &args.policy)?;
    // The record's chain first: a replay says what the policy would have decided of what the
    // record says happened, so a record changed since it was written is not replayed. (The key is
    // the one the chain recorded; `records verify --public-key` checks it against a kept copy.)
    for path in &given {
        let report = sharedos_broker::evidence::chain::verify(path, None)
            .with_context(|| format!("cannot verify record `{}`", path.display()))?;
        if let Some(b) = &report.broken {
            anyhow::bail!(
                "record `{}` does not verify: at seq {} (`{}` line {}): {}; it is not replayed (`sharedos-broker records verify --record {}` says more)",
                path.display(),
                b.seq,
                b.file.display(),
                b.line,
                b.reason,
                path.display()
            );
        }
    }
    // A rotated record is its rotated files (`<record>.<first seq>`) and then itself.
    let mut records = Vec::new();
    for path in given {
        let files = sharedos_broker::evidence::record::record_files(&path)?;
        if files.is_empty() {
            records.push(path);
        } else {
            records.extend(files);
        }
    }
    let report = replay::replay(&engine, &records, since)?;
    let shown: Vec<String> = records.iter().map(|p| p.display().to_string()).collect();
    if args.json {
        print_json(&Output {
            records: shown,
            policy: args.policy.display().to_string(),
            since: args.since.as_deref(),
            report: &report,
        })?;
    } else {
        print(&report, &shown, &args.policy, args.since.as_deref())?;
    }
    Ok(if report.changes.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_WOULD_CHANGE)
    })
}

fn print(
    report: &Report,
    records: &[String],
    policy: &Path,
    since: Option<&str>,
) -> anyhow::Result<()> {
    let since = since
        .map(|s| format!(", calls since {s}"))
        .unwrap_or_default();
    outln!(
        "replay of {} under {}{since}",
        records.join(", "),
        policy.display()
    );
    outln!(
        "{} calls read: {} replayable, {} not decided by policy (refused before it was asked), {} not replayable",
        report.calls,
        report.replayable,
        report.not_decided_by_policy,
        report.not_replayable
    );
    for (why, n) in &report.not_replayable_why {
        outln!("  {n} not replayable: {why}");
    }
    if report.torn_lines > 0 {
        outln!("  a last line still being written was skipped");
    }
    if report.changes.is_empty() {
        outln!("no call would change");
        return Ok(());
    }
    let held = if report.now_held + report.no_longer_held > 0 {
        format!(
            ", {} would now be held for approval, {} no longer held for approval",
            report.now_held, report.no_longer_held
        )
    } else {
        String::new()
    };
    outln!(
        "would change: {} ({} allowed → denied, {} denied → allowed{held})",
        report.changes.len(),
        report.allowed_to_denied,
        report.denied_to_allowed
    );
    for (tool, by) in report.groups() {
        outln!();
        outln!("{tool}");
        for (deciding, changes) in by {
            outln!("  {deciding}");
            for c in changes {
                outln!("    {}", row(c));
                if !c.new.errors.is_empty() {
                    outln!("      errors: {}", c.new.errors.join("; "));
                }
            }
        }
    }
    Ok(())
}

/// One change: seq, turn, who, what, and the decision before and after.
fn row(c: &Change) -> String {
    let who = match &c.agent {
        Some(agent) => format!("{} via {agent}", c.principal),
        None => c.principal.clone(),
    };
    let word = |allowed: bool, held: bool| match (allowed, held) {
        (true, true) => "allowed, held for approval",
        (true, false) => "allowed",
        (false, _) => "denied",
    };
    let old_policies = match c.old.policies.as_deref() {
        Some(p) if !p.is_empty() => format!(" by {}", p.join(", ")),
        _ => String::new(),
    };
    format!(
        "seq {}  turn {}  {who}  {} {}  {} ({}/{}{old_policies}) → {}",
        c.seq,
        c.turn,
        c.action,
        c.resource,
        word(c.old.allowed, c.old.held),
        c.old.outcome,
        c.old.code,
        word(c.new.allowed, c.new.held)
    )
}
