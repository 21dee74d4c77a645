//! Section 8: per-principal instances (issue 33). A principal's first call to a
//! `instances = "per_principal"` provider starts their instance (spawn, sandbox, initialize,
//! tools/list checked against the provider's listing, then the call); once it runs, a call costs
//! what a call to a shared instance of the same command costs. Both are measured against a
//! shared provider of the same command, in the same broker, in the same run.

use std::time::Duration;

use anyhow::Context as _;
use rmcp::model::CallToolRequestParams;
use serde_json::json;

use crate::e2e;
use crate::procs::{self, Bins, BrokerProc};
use crate::report::{Report, Table};
use crate::stats::{Samples, delta, dur, ratio};

pub const TITLE: &str = "8. Per-principal instances: a principal's first call and the steady state";

/// The record mode the section's broker runs in: the broker's default.
const RECORD_SYNC: &str = "always";

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// New principals, each making a first call to each provider.
    pub principals: usize,
    /// Untimed calls to each provider before the steady state.
    pub warmup: usize,
    /// Rounds of `calls` timed calls to each provider, the order swapped each round.
    pub rounds: usize,
    pub calls: usize,
}

fn request(tool: &str) -> CallToolRequestParams {
    CallToolRequestParams::new(tool.to_owned()).with_arguments(e2e::object(json!({"x": "bench"})))
}

/// `[[providers]]` of the same command twice: per principal (`pp`) and shared (`sh`).
fn providers(bins: &Bins) -> String {
    let command = procs::toml_string(&bins.direct.display().to_string());
    let args = "args = [\"--synthetic-tools\", \"1\"]";
    format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"pp\"\ncommand = {command}\n{args}\ninstances = \"per_principal\"\n\
         \n[[providers]]\ntype = \"mcp\"\nnamespace = \"sh\"\ncommand = {command}\n{args}\n"
    )
}

struct Measured {
    first_pp: Samples,
    first_sh: Samples,
    steady_pp: Samples,
    steady_sh: Samples,
    errors: u64,
}

/// A new principal's session (turn, shim, initialize), then its first call to `tool`, timed.
async fn first_call(
    bins: &Bins,
    broker: &BrokerProc,
    principal: &str,
    tool: &str,
) -> anyhow::Result<(Duration, bool)> {
    let turn = broker.open_turn(principal).await?;
    let client = procs::spawn_client(procs::shim_command(
        bins,
        &broker.bridge(),
        turn.token.expose(),
    ))
    .await?;
    let r = e2e::timed_call(client.service.peer(), &request(tool)).await;
    client.stop().await?;
    r
}

async fn measure(bins: &Bins, broker: &BrokerProc, plan: Plan) -> anyhow::Result<Measured> {
    let mut m = Measured {
        first_pp: Samples::default(),
        first_sh: Samples::default(),
        steady_pp: Samples::default(),
        steady_sh: Samples::default(),
        errors: 0,
    };
    // Each new principal once per provider (two principals per round, so that neither call is
    // the second of a session), the providers in turn.
    for i in 0..plan.principals {
        let (t, ok) = first_call(bins, broker, &format!("p{i}"), "pp.t00000").await?;
        m.first_pp.push(t);
        m.errors += u64::from(!ok);
        let (t, ok) = first_call(bins, broker, &format!("s{i}"), "sh.t00000").await?;
        m.first_sh.push(t);
        m.errors += u64::from(!ok);
    }
    // The steady state: one more session of the first principal, whose instance is running.
    let turn = broker.open_turn("p0").await?;
    let client = procs::spawn_client(procs::shim_command(
        bins,
        &broker.bridge(),
        turn.token.expose(),
    ))
    .await?;
    let result = async {
        let peer = client.service.peer();
        let (pp, sh) = (request("pp.t00000"), request("sh.t00000"));
        for _ in 0..plan.warmup {
            e2e::timed_call(peer, &pp).await?;
            e2e::timed_call(peer, &sh).await?;
        }
        for round in 0..plan.rounds {
            let order = if round % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for per_principal in order {
                let (req, samples) = if per_principal {
                    (&pp, &mut m.steady_pp)
                } else {
                    (&sh, &mut m.steady_sh)
                };
                for _ in 0..plan.calls {
                    let (t, ok) = e2e::timed_call(peer, req).await?;
                    samples.push(t);
                    m.errors += u64::from(!ok);
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    client.stop().await?;
    result?;
    Ok(m)
}

pub async fn section(
    bins: &Bins,
    plan: Plan,
    quick: bool,
    report: &mut Report,
) -> anyhow::Result<()> {
    let broker = BrokerProc::start_with(bins, RECORD_SYNC, procs::PERMIT_CALLS, &providers(bins))
        .await
        .context("a broker with a per-principal and a shared provider")?;
    let measured = measure(bins, &broker, plan).await;
    broker.stop().await?;
    let m = measured?;
    // Every call was permitted and answered `ok`: an error would be measured as a call.
    anyhow::ensure!(
        m.errors == 0,
        "{} calls of the per-principal section answered with an error",
        m.errors
    );
    let mut t = Table::new(
        TITLE,
        &[
            "call",
            "provider",
            "n",
            "median",
            "p99",
            "added (median)",
            "ratio (median)",
        ],
    );
    t.text(format!(
        "One real `sharedos-broker serve` (record_sync `{RECORD_SYNC}`, the default) with two \
         providers of the same command, `direct-files-server --synthetic-tools 1` (an rmcp stdio \
         server whose one tool answers `ok`), both in the default sandbox: `pp` with `instances = \
         \"per_principal\"`, `sh` shared (started with the broker). The client is an rmcp client \
         in the benchmark process, through a real shim. \"first call\": {} new principals each \
         open a turn and a shim session (not timed), and the first `tools/call` is timed: on `pp` \
         it starts the principal's instance (spawned through the sandbox launcher, initialized, \
         its tools/list checked against the provider's listing) before the call; on `sh` \
         (other new principals) the instance is running, so its row is the first call of a \
         session without an instance start. \"steady state\": one more session of the first \
         principal, {} untimed calls to each, then {} rounds of {} sequential calls to each, the \
         order swapped each round.{}",
        plan.principals,
        plan.warmup,
        plan.rounds,
        plan.calls,
        if quick {
            " --quick: fewer principals and calls."
        } else {
            ""
        }
    ));
    let (fp, fs) = (m.first_pp.summary(), m.first_sh.summary());
    let (sp, ss) = (m.steady_pp.summary(), m.steady_sh.summary());
    t.text(format!(
        "A principal's instance start, the difference of the first calls' medians: {}.",
        delta(fp.median, fs.median)
    ));
    let row = |call: &str,
               provider: &str,
               s: crate::stats::Summary,
               base: Option<crate::stats::Summary>| {
        vec![
            call.to_owned(),
            provider.to_owned(),
            s.n.to_string(),
            dur(s.median),
            dur(s.p99),
            base.map_or_else(|| "—".into(), |b| delta(s.median, b.median)),
            base.map_or_else(
                || "1.00".into(),
                |b| format!("{:.2}", ratio(s.median, b.median)),
            ),
        ]
    };
    t.row(row(
        "first call of a new principal",
        "shared (baseline)",
        fs,
        None,
    ));
    t.row(row(
        "first call of a new principal (their instance starts)",
        "per principal",
        fp,
        Some(fs),
    ));
    t.row(row("steady state", "shared (baseline)", ss, None));
    t.row(row(
        "steady state, the principal's instance running",
        "per principal",
        sp,
        Some(ss),
    ));
    report.tables.push(t);
    Ok(())
}
