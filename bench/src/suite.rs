//! The suite: the six sections of issue 7 in order, then the sandboxed cold start (issue 32),
//! per-principal instances (issue 33) and remote providers (issues 34, 46); their parameters
//! (every loop bounded by a count and a time), and the tables and targets they add to the report.
//! [`SECTION_TITLES`] is every heading the report has besides the machine, the targets and
//! `bench/NOTES.md`: `BENCHMARKS.md` is generated whole (a test holds it to that).
//!
//! Sections that need real processes start them and stop them before the next section starts,
//! so no section measures another's leftovers.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;

use crate::e2e::{self, Load, LoadResult};
use crate::instances;
use crate::memory;
use crate::micro::{self, Budget, RecordMode, ToolKind};
use crate::procs::{self, Bins, BrokerProc, Mem};
use crate::report::{Machine, Report, Table, Target, loadavg, verdict};
use crate::stats::{MustAdd, Samples, delta, dur, mib, rate, ratio, reach, thousands};
use crate::{remote, sandboxed};

/// The command that regenerates BENCHMARKS.md.
pub const COMMAND: &str = "cargo run --release -p sharedos-bench -- --write BENCHMARKS.md";

#[derive(Debug, Parser)]
#[command(
    name = "sharedos-bench",
    about = "Benchmarks the SharedOS boundary (shim + broker) against a direct MCP server",
    long_about = "Starts real brokers and shims (and, for the micro-benchmarks, the broker's library in \
process), prints a markdown report of medians, p99s, ratios and targets, and with --write writes it to a file. \
Regenerate BENCHMARKS.md with: cargo run --release -p sharedos-bench -- --write BENCHMARKS.md"
)]
pub struct Args {
    /// Also write the report to this file.
    #[arg(long, value_name = "FILE")]
    pub write: Option<PathBuf>,
    /// A smoke run: few iterations; the numbers mean little.
    #[arg(long)]
    pub quick: bool,
    /// Run only these sections (comma-separated).
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Section>,
    /// Run section 2 with only these numbers of concurrent callers (of 1, 8 and 64; comma-
    /// separated): a quicker A/B run. Targets that need a load left out are left out too.
    #[arg(long, value_delimiter = ',', value_name = "N")]
    pub callers: Vec<usize>,
    /// Measure only the shim's memory (section 6's shim row), this many sessions against one
    /// broker and one turn; print each session's VmRSS and VmHWM and the median, and no report.
    #[arg(long, value_name = "SESSIONS")]
    pub shim_memory: Option<usize>,
    /// With --shim-memory: save each shim's /proc/<pid>/smaps, read when its memory is, here.
    #[arg(long, value_name = "DIR", requires = "shim_memory")]
    pub smaps_dir: Option<PathBuf>,
    /// Run this shim binary instead of the one built next to the benchmark.
    #[arg(long, value_name = "FILE")]
    pub shim: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    Cold,
    Rtt,
    Kernel,
    Turn,
    Record,
    Memory,
    Sandbox,
    Instances,
    Remote,
}

pub const COLD: &str = "1. Cold start: spawn → initialize → tools/list answered";
pub const RTT: &str = "2. Per-call round trip: `files.read` of a 42-byte file";
pub const KERNEL: &str = "3. Kernel decision: requirement resolution + Cedar";
pub const TURN: &str = "4. Turn open: catalogue + catalogHash";
pub const RECORD: &str = "5. Record alone";
pub const HANDOFFS: &str = "5b. Hand-offs on this machine (context for the findings)";
pub const EXPORT: &str = "5c. What the hash chain and OpenTelemetry export add per call (CPU)";
pub const MEMORY: &str = "6. Memory";

/// Every section's heading, in the report's order: a full run writes each once.
pub const SECTION_TITLES: [&str; 11] = [
    COLD,
    RTT,
    KERNEL,
    TURN,
    RECORD,
    HANDOFFS,
    EXPORT,
    MEMORY,
    sandboxed::TITLE,
    instances::TITLE,
    remote::TITLE,
];

/// Iteration counts and time bounds.
struct Plan {
    cold_warmup: usize,
    cold_iterations: usize,
    cold_budget: Duration,
    loads: Vec<Load>,
    policy_sizes: Vec<usize>,
    decision: Budget,
    tool_counts: Vec<usize>,
    catalog_cold: Budget,
    catalog_warm: Budget,
    record_appenders: Vec<usize>,
    record_max: usize,
    record_duration: Duration,
    fsync: Budget,
    handoff: Budget,
    /// Spans sent in the export-cost measurement.
    spans: usize,
    turns: usize,
    sandbox: sandboxed::Plan,
    instances: instances::Plan,
    remote: remote::Plan,
}

impl Plan {
    fn new(quick: bool) -> Self {
        let s = |full: u64, q: u64| Duration::from_millis(if quick { q } else { full });
        let n = |full: usize, q: usize| if quick { q } else { full };
        Self {
            cold_warmup: n(3, 1),
            cold_iterations: n(40, 5),
            cold_budget: s(30_000, 5_000),
            loads: vec![
                Load {
                    callers: 1,
                    warmup: n(100, 10),
                    max_calls: n(3_000, 200),
                    duration: s(4_000, 500),
                },
                Load {
                    callers: 8,
                    warmup: n(20, 5),
                    max_calls: 100_000,
                    duration: s(3_000, 500),
                },
                Load {
                    callers: 64,
                    warmup: n(10, 2),
                    max_calls: 100_000,
                    duration: s(3_000, 500),
                },
            ],
            policy_sizes: vec![10, 1_000, 10_000],
            decision: Budget {
                iterations: n(20_000, 1_000),
                duration: s(2_000, 300),
            },
            tool_counts: vec![100, 1_000, 10_000],
            catalog_cold: Budget {
                iterations: n(30, 3),
                duration: s(2_000, 500),
            },
            catalog_warm: Budget {
                iterations: n(10_000, 100),
                duration: s(500, 100),
            },
            record_appenders: vec![1, 64],
            record_max: 100_000,
            record_duration: s(2_500, 300),
            fsync: Budget {
                iterations: n(200, 20),
                duration: s(3_000, 500),
            },
            handoff: Budget {
                iterations: n(20_000, 1_000),
                duration: s(1_000, 200),
            },
            spans: n(20_000, 2_000),
            turns: 1_000,
            sandbox: sandboxed::Plan {
                warmup: n(2, 1),
                iterations: n(30, 3),
                budget: s(40_000, 10_000),
            },
            instances: instances::Plan {
                principals: n(8, 2),
                warmup: n(20, 3),
                rounds: n(5, 1),
                calls: n(60, 10),
            },
            remote: remote::Plan {
                warmup: n(20, 3),
                rounds: n(5, 1),
                calls: n(40, 5),
            },
        }
    }

    fn describe(&self) -> Vec<String> {
        let loads: Vec<String> = self
            .loads
            .iter()
            .map(|l| {
                format!(
                    "{} caller(s): {} warm-up calls each, then up to {} calls each or {:.1} s",
                    l.callers,
                    l.warmup,
                    thousands(l.max_calls as u64),
                    l.duration.as_secs_f64()
                )
            })
            .collect();
        vec![
            format!(
                "cold start: {} untimed starts of each, then up to {} of each, interleaved (bounded by {:.0} s)",
                self.cold_warmup,
                self.cold_iterations,
                self.cold_budget.as_secs_f64()
            ),
            format!("round trips: {}", loads.join("; ")),
            format!(
                "decision: up to {} iterations or {:.1} s per size",
                thousands(self.decision.iterations as u64),
                self.decision.duration.as_secs_f64()
            ),
            format!(
                "catalogue: cold up to {} or {:.1} s, warm up to {} or {:.1} s; turn open over control.sock: cold and warm each up to {} or {:.1} s",
                self.catalog_cold.iterations,
                self.catalog_cold.duration.as_secs_f64(),
                thousands(self.catalog_warm.iterations as u64),
                self.catalog_warm.duration.as_secs_f64(),
                self.catalog_cold.iterations,
                self.catalog_cold.duration.as_secs_f64()
            ),
            format!(
                "record: each appender appends one line at a time for {:.1} s (at most {} each)",
                self.record_duration.as_secs_f64(),
                thousands(self.record_max as u64)
            ),
            format!(
                "fdatasync: up to {} syncs or {:.1} s, back to back and again {} µs apart, before the \
                 end-to-end sections and again after them",
                self.fsync.iterations,
                self.fsync.duration.as_secs_f64(),
                micro::SYNC_GAP.as_micros()
            ),
            format!("memory: {} open turns", thousands(self.turns as u64)),
            format!(
                "sandboxed cold start: {} untimed starts of each, then up to {} of each, interleaved (bounded by {:.0} s per upstream)",
                self.sandbox.warmup,
                self.sandbox.iterations,
                self.sandbox.budget.as_secs_f64()
            ),
            format!(
                "per-principal instances: {} new principals' first calls to each provider; then {} untimed calls and {} rounds of {} calls to each",
                self.instances.principals,
                self.instances.warmup,
                self.instances.rounds,
                self.instances.calls
            ),
            format!(
                "remote provider: {} untimed calls on each of 6 paths, then {} rounds of {} sequential calls on each",
                self.remote.warmup, self.remote.rounds, self.remote.calls
            ),
        ]
    }
}

impl Shared {
    /// The fdatasync probes, back to back and spaced; run before and after the end-to-end
    /// sections.
    async fn probe_fsync(&mut self, plan: &Plan) -> anyhow::Result<()> {
        self.fsync.extend(micro::fdatasync(plan.fsync, None).await?);
        self.fsync_spaced
            .extend(micro::fdatasync(plan.fsync, Some(micro::SYNC_GAP)).await?);
        Ok(())
    }
}

/// Numbers one section hands to another.
#[derive(Default)]
struct Shared {
    fsync: Samples,
    /// fdatasync with the syncs spaced as a lone `always` caller spaces them.
    fsync_spaced: Samples,
    /// Broker peak memory after the 64-bridge round trips, per record mode.
    broker_after_load: Vec<(String, Mem)>,
    /// The round trips, kept for their targets (which need both fdatasync measurements).
    rtt: Vec<Rtt>,
    /// `batch` and `always` calls/s at 64 bridges, measured in alternating pairs (the main
    /// rows first, then [`EXTRA_PAIRS`] more, each in the opposite order to the last).
    pairs_64: Vec<(f64, f64)>,
    /// Work the boundary must add to a call on top of a relay hop, measured in sections 3 and
    /// 5: one decision (`PolicyEngine::decide`, the fewest policies) and one `batch` record line
    /// (`Recorder::append`, one appender). Medians.
    decide: Option<Duration>,
    append: Option<Duration>,
}

impl Shared {
    /// What a boundary must add, once sections 3 and 5 measured it.
    fn must_add(&self) -> Option<MustAdd> {
        Some(MustAdd {
            decide: self.decide?,
            append: self.append?,
            fsync: self.fsync.summary().median,
        })
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let mut bins = Bins::build_and_locate()?;
    if let Some(shim) = &args.shim {
        shim.is_file()
            .then_some(())
            .with_context(|| format!("`{}` is not a file", shim.display()))?;
        bins.shim = shim.clone();
    }
    if let Some(sessions) = args.shim_memory {
        return shim_memory(&bins, sessions, args.smaps_dir.as_deref()).await;
    }
    // After the build, so the load and the duration are the benchmark's.
    let started = Instant::now();
    let mut machine = Machine::capture();
    if !bins.release {
        machine.profile = "debug (not representative: use --release)";
    }
    machine.linking = bins.linking()?;
    let mut plan = Plan::new(args.quick);
    if !args.callers.is_empty() {
        plan.loads.retain(|l| args.callers.contains(&l.callers));
        if plan.loads.is_empty() {
            anyhow::bail!(
                "--callers: section 2 runs with 1, 8 or 64 callers; none of those was given"
            );
        }
    }
    let want = |s: Section| args.only.is_empty() || args.only.contains(&s);
    let fixture = tempfile::Builder::new()
        .prefix("sharedos-bench-data-")
        .tempdir()?;
    let data = procs::write_data(fixture.path())?;
    let mut report = Report {
        tables: vec![],
        targets: vec![],
        parameters: plan.describe(),
    };
    if args.quick {
        report.parameters.insert(
            0,
            "**--quick: a smoke run; the numbers mean little**".into(),
        );
    }
    let mut shared = Shared::default();
    eprintln!("bench: fdatasync…");
    shared.probe_fsync(&plan).await?;
    if want(Section::Cold) {
        eprintln!("bench: 1. cold start…");
        cold_start(&bins, &data, &plan, &mut report).await?;
    }
    if want(Section::Rtt) {
        eprintln!("bench: 2. round trips…");
        round_trips(&bins, &data, &plan, &mut report, &mut shared).await?;
    }
    eprintln!("bench: fdatasync again…");
    shared.probe_fsync(&plan).await?;
    // Section 2's targets go here in the table, but are computed after sections 3 and 5, whose
    // decision and record line give the floor under the added-latency goal.
    let rtt_targets_at = report.targets.len();
    if want(Section::Kernel) {
        eprintln!("bench: 3. kernel decision…");
        decision(&data, &plan, &mut report, &mut shared).await?;
    }
    if want(Section::Turn) {
        eprintln!("bench: 4. turn open…");
        turn_open(&bins, &data, &plan, &mut report).await?;
    }
    if want(Section::Record) {
        eprintln!("bench: 5. record…");
        record(&plan, &mut report, &mut shared).await?;
    }
    if want(Section::Rtt) {
        let mut targets = round_trip_targets(&shared);
        targets.extend(throughput_target(&shared.pairs_64));
        report
            .targets
            .splice(rtt_targets_at..rtt_targets_at, targets);
    }
    if want(Section::Memory) {
        eprintln!("bench: 6. memory…");
        memory_section(&bins, &data, &plan, &mut report, &shared).await?;
    }
    if want(Section::Sandbox) {
        eprintln!("bench: 7. sandboxed upstream cold start…");
        sandboxed::section(&bins, plan.sandbox, args.quick, &mut report).await?;
    }
    if want(Section::Instances) {
        eprintln!("bench: 8. per-principal instances…");
        instances::section(&bins, plan.instances, args.quick, &mut report).await?;
    }
    if want(Section::Remote) {
        eprintln!("bench: 9. remote provider over Streamable HTTP…");
        let must_add = shared.must_add();
        remote::section(&bins, plan.remote, args.quick, must_add, &mut report).await?;
    }
    if args.only.is_empty() {
        // A full run writes every section, each under a title of [`SECTION_TITLES`] (the list
        // the test of the committed BENCHMARKS.md holds it to), in that order.
        let titles: Vec<&str> = report.tables.iter().map(|t| t.title.as_str()).collect();
        anyhow::ensure!(
            titles == SECTION_TITLES,
            "the report's sections {titles:?} are not suite::SECTION_TITLES: name a new section there"
        );
    }
    machine.load_end = loadavg();
    machine.duration_s = started.elapsed().as_secs_f64();
    let notes_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("NOTES.md");
    let notes = std::fs::read_to_string(&notes_path).ok();
    let md = report.markdown(&machine, COMMAND, notes.as_deref());
    print!("{md}");
    if let Some(path) = &args.write {
        std::fs::write(path, &md).with_context(|| format!("cannot write `{}`", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

/// `--shim-memory`: the shim's row of section 6 alone, `sessions` times, and the median.
async fn shim_memory(bins: &Bins, sessions: usize, smaps: Option<&Path>) -> anyhow::Result<()> {
    let fixture = tempfile::Builder::new()
        .prefix("sharedos-bench-data-")
        .tempdir()?;
    let data = procs::write_data(fixture.path())?;
    if let Some(dir) = smaps {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
    }
    eprintln!(
        "bench: shim memory, {sessions} session(s) of {} (linked: {})",
        bins.shim.display(),
        bins.linking()?
    );
    let mems = memory::shim_only(bins, &data, sessions, smaps).await?;
    for (i, m) in mems.iter().enumerate() {
        eprintln!(
            "session {i}: VmRSS {} KiB, VmHWM {} KiB",
            m.rss_kib, m.hwm_kib
        );
    }
    // The session with the median peak, as section 6 and the floors are taken.
    let m = memory::median_by_peak(mems.clone());
    eprintln!(
        "median of {} (by peak): VmRSS {} KiB, VmHWM {} KiB ({:.2} MiB)",
        mems.len(),
        m.rss_kib,
        m.hwm_kib,
        m.hwm_kib as f64 / 1024.0
    );
    let floors = memory::floors(bins, &data).await?;
    eprintln!(
        "floors (same session, median of {}): relay VmHWM {} KiB ({:.2} MiB), rmcp-floor VmHWM {} KiB ({:.2} MiB)",
        memory::FLOOR_SESSIONS,
        floors.relay.hwm_kib,
        floors.relay.hwm_kib as f64 / 1024.0,
        floors.rmcp.hwm_kib,
        floors.rmcp.hwm_kib as f64 / 1024.0
    );
    Ok(())
}

async fn cold_start(
    bins: &Bins,
    data: &Path,
    plan: &Plan,
    report: &mut Report,
) -> anyhow::Result<()> {
    let broker = BrokerProc::start(bins, data, "always").await?;
    let result = async {
        let turn = broker.open_turn("alice").await?;
        let token = turn.token.expose().to_owned();
        let bridge = broker.bridge();
        e2e::cold_start(
            || procs::direct_command(bins, data),
            || procs::shim_command(bins, &bridge, &token),
            plan.cold_warmup,
            plan.cold_iterations,
            plan.cold_budget,
        )
        .await
    }
    .await;
    broker.stop().await?;
    let c = result?;
    let (d, s) = (c.direct.summary(), c.shim.summary());
    let r = ratio(s.median, d.median);
    let same = e2e::same_tools(&c.direct_tools, &c.shim_tools);
    let mut t = Table::new(
        COLD,
        &[
            "server",
            "n",
            "median",
            "p99",
            "ratio (median)",
            "target",
            "result",
        ],
    );
    t.text(
        "Measured from the client's side (rmcp client in the benchmark process): spawn the server \
         process, `initialize` (+ `notifications/initialized`), `tools/list` answered. The shim \
         connects to a running `sharedos-broker serve` (record_sync `always`) with an open turn's \
         token before it answers `initialize`. Teardown is not timed. Starts of the two servers \
         are interleaved.",
    );
    t.text(format!(
        "tools/list of the direct server and of the shim are identical: **{}** ({} tools).",
        if same { "yes" } else { "NO" },
        c.shim_tools.len()
    ));
    t.row(vec![
        "direct rmcp stdio server (baseline)".into(),
        d.n.to_string(),
        dur(d.median),
        dur(d.p99),
        "1.00".into(),
        "—".into(),
        "—".into(),
    ]);
    let met_ratio = r <= 1.2;
    let met_abs = s.median <= Duration::from_millis(5);
    t.row(vec![
        "shim + broker".into(),
        s.n.to_string(),
        dur(s.median),
        dur(s.p99),
        format!("{r:.2}"),
        "ratio ≤ 1.2; median ≤ 5 ms".into(),
        verdict(met_ratio && met_abs),
    ]);
    report.tables.push(t);
    report.targets.push(Target {
        what: "1. cold start, ratio shim+broker / direct (median)".into(),
        target: "≤ 1.2".into(),
        measured: format!("{r:.2} ({} vs {})", dur(s.median), dur(d.median)),
        met: met_ratio,
    });
    report.targets.push(Target {
        what: "1. cold start through shim + broker, median".into(),
        target: "≤ 5 ms".into(),
        measured: dur(s.median),
        met: met_abs,
    });
    Ok(())
}

/// The floor's row label: a byte-copying relay process in front of a listening direct server.
const RELAY: &str = "relay + direct (floor)";

/// More `batch`/`always` pairs at 64 bridges after section 2's rows, for the throughput target.
const EXTRA_PAIRS: usize = 2;

/// One round-trip measurement: which server, which record mode, how many callers.
struct Rtt {
    server: &'static str,
    record: &'static str,
    callers: usize,
    /// Measured with both CPUs held awake ([`Spinners`]).
    awake: bool,
    result: LoadResult,
}

impl Rtt {
    fn new(
        server: &'static str,
        record: &'static str,
        load: Load,
        awake: bool,
        result: LoadResult,
    ) -> Self {
        Self {
            server,
            record,
            callers: load.callers,
            awake,
            result,
        }
    }
}

async fn direct(bins: &Bins, data: &Path, load: Load) -> anyhow::Result<LoadResult> {
    let cmds = (0..load.callers)
        .map(|_| procs::direct_command(bins, data))
        .collect();
    e2e::drive(cmds, load, &[]).await
}

/// The relay floor; `durable`: each relay appends every answer to its own file and fdatasyncs
/// it before passing it on (the floor of an `always` boundary).
async fn relay(bins: &Bins, data: &Path, load: Load, durable: bool) -> anyhow::Result<LoadResult> {
    let server = procs::DirectListener::start(bins, data).await?;
    let records = micro::tempdir("relay-records")?;
    let cmds = (0..load.callers)
        .map(|i| {
            let record = durable.then(|| records.path().join(format!("relay-{i}.jsonl")));
            procs::relay_command(bins, &server.socket, record.as_deref())
        })
        .collect();
    let result = e2e::drive(cmds, load, &[server.pid]).await;
    server.stop().await?;
    result
}

/// Each load in turn against one broker in `mode`, and the broker's memory after them.
async fn shim_broker(
    bins: &Bins,
    data: &Path,
    mode: &'static str,
    loads: &[Load],
) -> anyhow::Result<(Vec<LoadResult>, Mem)> {
    let broker = BrokerProc::start(bins, data, mode).await?;
    let result = async {
        let mut out = Vec::new();
        for load in loads {
            eprintln!(
                "bench:    shim + broker ({mode}), {} caller(s)…",
                load.callers
            );
            let mut host = broker.host().await?;
            let mut cmds = Vec::with_capacity(load.callers);
            for _ in 0..load.callers {
                let turn = procs::open_turn(&mut host, "alice").await?;
                cmds.push(procs::shim_command(
                    bins,
                    &broker.bridge(),
                    turn.token.expose(),
                ));
            }
            out.push(e2e::drive(cmds, *load, &[broker.pid]).await?);
        }
        anyhow::Ok((out, broker.memory()?))
    }
    .await;
    broker.stop().await?;
    result
}

/// One busy loop per CPU at `SCHED_IDLE` (`chrt --idle 0`), so no CPU halts while a round trip
/// waits, and any real work preempts them at once. Stopped when dropped.
struct Spinners(Vec<std::process::Child>);

impl Spinners {
    fn start() -> anyhow::Result<Self> {
        let n = std::thread::available_parallelism().map_or(2, usize::from);
        let mut s = Self(Vec::with_capacity(n));
        for _ in 0..n {
            let child = std::process::Command::new("chrt")
                .args(["--idle", "0", "sh", "-c", "while :; do :; done"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .context("cannot run `chrt --idle 0 sh` (util-linux)")?;
            s.0.push(child);
        }
        std::thread::sleep(Duration::from_millis(200));
        for c in &mut s.0 {
            if let Some(status) = c.try_wait()? {
                anyhow::bail!("`chrt --idle 0 sh` exited at once: {status}");
            }
        }
        Ok(s)
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn round_trips(
    bins: &Bins,
    data: &Path,
    plan: &Plan,
    report: &mut Report,
    shared: &mut Shared,
) -> anyhow::Result<()> {
    let mut all = Vec::new();
    for load in &plan.loads {
        eprintln!("bench:    direct, {} caller(s)…", load.callers);
        all.push(Rtt::new(
            "direct",
            "—",
            *load,
            false,
            direct(bins, data, *load).await?,
        ));
    }
    // The floor: one extra process that only copies bytes, in front of one listening direct
    // server (as the shims are in front of one broker).
    for load in &plan.loads {
        eprintln!("bench:    relay + direct, {} caller(s)…", load.callers);
        all.push(Rtt::new(
            RELAY,
            "—",
            *load,
            false,
            relay(bins, data, *load, false).await?,
        ));
    }
    // The floor of an `always` boundary: the same relay, making each answer durable (appended
    // and fdatasynced) before passing it on. One caller: the sequential round trip's floor.
    if let Some(one) = plan.loads.iter().find(|l| l.callers == 1) {
        eprintln!("bench:    durable relay + direct, 1 caller…");
        all.push(Rtt::new(
            RELAY,
            "always",
            *one,
            false,
            relay(bins, data, *one, true).await?,
        ));
    }
    for mode in ["batch", "always"] {
        let (rows, mem) = shim_broker(bins, data, mode, &plan.loads).await?;
        for (load, result) in plan.loads.iter().zip(rows) {
            all.push(Rtt::new("shim + broker", mode, *load, false, result));
        }
        shared.broker_after_load.push((format!("`{mode}`"), mem));
    }
    // The throughput target compares two runs made a minute apart on a machine whose speed
    // drifts (single `batch` runs at 64 bridges read from 7,000 to 16,000 calls/s): more pairs,
    // each made back to back and in the opposite order to the last, so drift cancels out.
    if let Some(many) = plan.loads.iter().find(|l| l.callers == 64) {
        let rate_of = |mode: &str| {
            all.iter()
                .find(|r| r.server == "shim + broker" && r.record == mode && r.callers == 64)
                .map(|r| rate(r.result.calls, r.result.wall))
        };
        if let (Some(b), Some(a)) = (rate_of("batch"), rate_of("always")) {
            shared.pairs_64.push((b, a));
        }
        for pair in 0..EXTRA_PAIRS {
            let order = if pair % 2 == 0 {
                ["always", "batch"]
            } else {
                ["batch", "always"]
            };
            let mut rates = [0.0; 2];
            for mode in order {
                let (mut r, _) = shim_broker(bins, data, mode, &[*many]).await?;
                let r = r.pop().context("no row")?;
                rates[usize::from(mode == "always")] = rate(r.calls, r.wall);
            }
            shared.pairs_64.push((rates[0], rates[1]));
        }
    }
    // One caller again with both CPUs kept from halting: a caller's processes all wait while
    // an `always` call's fdatasync runs, and on a VM a CPU that halted that long wakes slowly.
    if let Some(one) = plan.loads.iter().find(|l| l.callers == 1) {
        match Spinners::start() {
            Ok(spinners) => {
                eprintln!("bench:    one caller again, CPUs held awake…");
                let rows = async {
                    let mut rows = vec![
                        Rtt::new("direct", "—", *one, true, direct(bins, data, *one).await?),
                        Rtt::new(
                            RELAY,
                            "—",
                            *one,
                            true,
                            relay(bins, data, *one, false).await?,
                        ),
                        Rtt::new(
                            RELAY,
                            "always",
                            *one,
                            true,
                            relay(bins, data, *one, true).await?,
                        ),
                    ];
                    for mode in ["batch", "always"] {
                        let (mut r, _) = shim_broker(bins, data, mode, &[*one]).await?;
                        let result = r.pop().context("no row")?;
                        rows.push(Rtt::new("shim + broker", mode, *one, true, result));
                    }
                    anyhow::Ok(rows)
                }
                .await;
                drop(spinners);
                all.extend(rows?);
            }
            Err(e) => eprintln!("bench:    CPUs held awake: skipped ({e:#})"),
        }
    }
    let direct_median = |callers: usize, awake: bool| {
        all.iter()
            .find(|r| r.server == "direct" && r.callers == callers && r.awake == awake)
            .map(|r| r.result.latency.summary().median)
    };
    let mut t = Table::new(
        RTT,
        &[
            "server",
            "record_sync",
            "callers",
            "calls",
            "median",
            "p99",
            "calls/s",
            "added (median)",
            "ratio (median)",
            "server CPU per call",
            "client CPU per call",
            "errors",
        ],
    );
    t.text(
        "Each caller is its own MCP client with its own server process: a direct server, or a \
         shim with its own turn and bridge connection to one real `sharedos-broker serve`. A \
         caller makes one call at a time; with N callers, N calls are in flight. \"added\" is the \
         median round trip minus the direct server's median at the same number of callers; \
         calls/s is all callers' calls over the common window. CPU per call is the CPU time \
         (user + system, from `/proc/<pid>/stat`, 10 ms ticks) the processes used during the \
         window divided by the calls: the server side is the direct servers, or the shims + the \
         broker; the client is this benchmark's rmcp clients (the same work in both). On 2 cores, \
         2 s of CPU per second divided by the CPU of a call bounds the calls/s. The floor row, \
         \"relay + direct\", puts one process that copies bytes between stdio and a Unix socket \
         (`bench/relay/src/main.rs`: std only, no parsing) in front of one `direct-files-server \
         --listen` serving every caller's connection: what any boundary process costs before it \
         does anything. Its `always` row is the floor of a durable hop: the same relay appends \
         every answer to its own file and fdatasyncs it before passing it on (`relay SOCKET \
         RECORD`), what any boundary that makes its record line durable before answering pays \
         on this machine, wake-ups included. The rows \"CPUs held awake\" run one caller again \
         while one `SCHED_IDLE` busy loop per CPU (`chrt --idle 0`) keeps the CPUs from halting (any real work preempts \
         it): on a VM, a CPU that halted through an `always` call's fdatasync (all of a lone \
         caller's processes wait for it) takes long to wake, and these rows show how much of a \
         round trip that is; their \"added\" is against the direct server held awake too.",
    );
    for r in &all {
        let s = r.result.latency.summary();
        let base = direct_median(r.callers, r.awake);
        let (added, rat) = match (r.server, base) {
            ("direct", _) | (_, None) => ("—".to_owned(), "1.00".to_owned()),
            (_, Some(b)) => (delta(s.median, b), format!("{:.2}", ratio(s.median, b))),
        };
        let per_call =
            |d: Duration| dur(d / u32::try_from(r.result.calls.max(1)).unwrap_or(u32::MAX));
        let cpu = r.result.cpu;
        let server_cpu = if r.server == "direct" {
            per_call(cpu.servers)
        } else if r.server == RELAY {
            format!(
                "{} (relay {} + server {})",
                per_call(cpu.servers + cpu.others),
                per_call(cpu.servers),
                per_call(cpu.others)
            )
        } else {
            format!(
                "{} (shim {} + broker {})",
                per_call(cpu.servers + cpu.others),
                per_call(cpu.servers),
                per_call(cpu.others)
            )
        };
        t.row(vec![
            if r.awake {
                format!("{}, CPUs held awake", r.server)
            } else {
                r.server.into()
            },
            r.record.into(),
            r.callers.to_string(),
            thousands(r.result.calls),
            dur(s.median),
            dur(s.p99),
            thousands(rate(r.result.calls, r.result.wall) as u64),
            added,
            rat,
            server_cpu,
            per_call(cpu.client),
            r.result.errors.to_string(),
        ]);
    }
    report.tables.push(t);
    shared.rtt = all;
    Ok(())
}

/// Section 2's one-caller targets. The added-latency rows also give the floor under their goal,
/// when sections 3 and 5 ran: the relay's added latency plus the work a boundary cannot skip on
/// top of a hop (a decision, a record line written before the answer, and in `always` one
/// fdatasync). When that floor is over 1.0× the relay's, the goal is out of reach by
/// construction, and the row says so. The `always` sequential row gives the floor measured end
/// to end (the durable relay's round trip, plus a decision), and the round trip with the CPUs
/// held awake.
fn round_trip_targets(shared: &Shared) -> Vec<Target> {
    let mut targets = Vec::new();
    let all = &shared.rtt;
    let find_in = |awake: bool, server: &str, record: &str, callers: usize| {
        all.iter().find(|r| {
            r.server == server && r.record == record && r.callers == callers && r.awake == awake
        })
    };
    let find = |server: &str, record: &str, callers: usize| find_in(false, server, record, callers);
    let median = |r: &Rtt| r.result.latency.summary().median;
    let fsync = shared.fsync.summary();
    let (Some(direct), Some(relay)) = (find("direct", "—", 1), find(RELAY, "—", 1)) else {
        return targets;
    };
    let d = median(direct);
    let floor = median(relay).saturating_sub(d);
    // The boundary's added latency against the floor's, in each record mode.
    for mode in ["batch", "always"] {
        let Some(b) = find("shim + broker", mode, 1) else {
            continue;
        };
        let added = median(b).saturating_sub(d);
        let r = ratio(added, floor);
        let mut measured = format!(
            "{r:.2}× ({} added vs the relay's {}; direct {})",
            dur(added),
            dur(floor),
            dur(d)
        );
        // Without a measurable relay hop (a --quick run can read 0) there is no ratio to give.
        if let (Some(m), false) = (shared.must_add(), floor.is_zero()) {
            // `always` cannot answer before one fdatasync (back to back: the smaller figure).
            measured.push_str(&m.floor(floor, "", mode == "always"));
        }
        targets.push(Target {
            what: format!(
                "2. added latency, `{mode}`, sequential, against the relay's added latency (medians)"
            ),
            target: "≤ 1.0×".into(),
            measured,
            met: r <= 1.0,
        });
    }
    if let Some(a) = find("shim + broker", "always", 1) {
        let m = median(a);
        let limit = median(relay) + fsync.median.mul_f64(1.5);
        let mut measured = dur(m);
        // The floor, measured end to end: a relay that does nothing but make each answer
        // durable (appended and fdatasynced) before passing it on, which pays every wake-up a
        // lone caller's fdatasync costs on this machine; plus the decision a boundary cannot
        // skip (the relay already writes a line).
        if let Some(dr) = find(RELAY, "always", 1) {
            let required = median(dr) + shared.decide.unwrap_or_default();
            measured.push_str(&format!(
                "; floor measured end to end, same run: the relay making each answer durable \
                 (appended and fdatasynced) before passing it on, {}{}{}",
                dur(median(dr)),
                shared
                    .decide
                    .map(|d| format!(" + a decision {d} = {}", dur(required), d = dur(d)))
                    .unwrap_or_default(),
                reach(required > limit)
            ));
        }
        // The same round trip with no CPU halting while the fdatasync runs: how much of the
        // miss is this machine's wake-up from idle rather than the boundary's work.
        if let (Some(aa), Some(ra)) = (
            find_in(true, "shim + broker", "always", 1),
            find_in(true, RELAY, "—", 1),
        ) {
            let limit_awake = median(ra) + fsync.median.mul_f64(1.5);
            measured.push_str(&format!(
                "; with the CPUs held awake, same run: {} against the relay's {} + 1.5 × \
                 fdatasync = {}, {}{}",
                dur(median(aa)),
                dur(median(ra)),
                dur(limit_awake),
                if median(aa) <= limit_awake {
                    "within it"
                } else {
                    "over it"
                },
                find_in(true, RELAY, "always", 1)
                    .map(|d| format!(" (the durable relay held awake: {})", dur(median(d))))
                    .unwrap_or_default()
            ));
        }
        targets.push(Target {
            what: "2. `always`, sequential round trip (median)".into(),
            target: format!(
                "≤ relay + 1.5 × fdatasync = {} (relay {}, fdatasync median {}, p99 {}, n = {})",
                dur(limit),
                dur(median(relay)),
                dur(fsync.median),
                dur(fsync.p99),
                fsync.n
            ),
            measured,
            met: m <= limit,
        });
    }
    targets
}

/// Section 2's throughput target, from the 64-bridge pairs (a `--callers 64` run has no other
/// rows): the median of each pair's `always`/`batch` ratio.
fn throughput_target(pairs: &[(f64, f64)]) -> Option<Target> {
    let mut ratios: Vec<f64> = pairs.iter().map(|(b, a)| a / b.max(1.0)).collect();
    ratios.sort_by(f64::total_cmp);
    let median = *ratios.get(ratios.len() / 2)?;
    let each = pairs
        .iter()
        .map(|(b, a)| {
            format!(
                "{:.2} ({} vs {})",
                a / b.max(1.0),
                thousands(*a as u64),
                thousands(*b as u64)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Some(Target {
        what: "2. throughput, `always` against `batch`, 64 concurrent bridges".into(),
        target: "≥ 0.9 × `batch`".into(),
        measured: format!(
            "{median:.2} × (median of {} pairs, each `batch` and `always` back to back, calls/s: \
             {each})",
            pairs.len()
        ),
        met: median >= 0.9,
    })
}

async fn decision(
    data: &Path,
    plan: &Plan,
    report: &mut Report,
    shared: &mut Shared,
) -> anyhow::Result<()> {
    let mut t = Table::new(
        KERNEL,
        &[
            "policies (5 apply to alice)",
            "kernel build",
            "`Kernel::check` median",
            "p99",
            "`PolicyEngine::decide` median",
            "p99",
            "target",
            "result",
        ],
    );
    t.text(
        "In process, through the broker's library: `Kernel::check` for `files.read` of \
         `/public/hello.txt` by `alice` (name, catalogue membership, input schema, the virtual \
         path canonicalized and resolved through the filesystem, then Cedar on the policy set \
         sliced to alice), and `PolicyEngine::decide` alone. Of the policies, 5 name alice \
         (4 permits, 1 forbid); every other one names another user. The call is permitted. \
         \"kernel build\" is loading the config, parsing and strictly validating the set. The \
         sizes are timed in four rounds, each size's kernel built, timed for a quarter of the \
         iterations and dropped in turn, so a noisy second of the machine falls on all of them \
         alike; \"kernel build\" is the first round's.",
    );
    eprintln!(
        "bench:    {} policies, in rounds…",
        plan.policy_sizes
            .iter()
            .map(|n| thousands(*n as u64))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for d in micro::decisions(data, &plan.policy_sizes, plan.decision).await? {
        anyhow::ensure!(d.permitted, "the benchmarked call was not permitted");
        let (c, p) = (d.check.summary(), d.decide.summary());
        if plan.policy_sizes.iter().min() == Some(&d.policies) {
            shared.decide = Some(p.median);
        }
        let met = c.median <= Duration::from_micros(20);
        t.row(vec![
            thousands(d.policies as u64),
            dur(d.load),
            dur(c.median),
            dur(c.p99),
            dur(p.median),
            dur(p.p99),
            "≤ 20 µs median".into(),
            verdict(met),
        ]);
        report.targets.push(Target {
            what: format!(
                "3. decision with {} policies (median)",
                thousands(d.policies as u64)
            ),
            target: "≤ 20 µs".into(),
            measured: dur(c.median),
            met,
        });
    }
    // Issue 44: a brokered call decided on its typed arguments, against the tool alone.
    let typed = micro::typed_decision(plan.decision)?;
    anyhow::ensure!(
        typed.permitted,
        "the benchmarked typed call was not permitted"
    );
    let (plain, with) = (typed.plain.summary(), typed.typed.summary());
    t.text(format!(
        "The last row: `chat.post` (a brokered tool's resource, the tool itself) under 10 policies \
         for alice, 4 of which read `context.arguments`; \"check\" is the call's {} bytes of \
         arguments typed from its inputSchema and `PolicyEngine::decide_with` them, \"decide\" \
         is today's `decide` on the tool alone.",
        typed.argument_bytes
    ));
    let met = with.median <= Duration::from_micros(20);
    t.row(vec![
        "10, typed arguments".into(),
        "—".into(),
        dur(with.median),
        dur(with.p99),
        dur(plain.median),
        dur(plain.p99),
        "≤ 20 µs median".into(),
        verdict(met),
    ]);
    report.targets.push(Target {
        what: "3. decision with typed arguments, 10 policies (median)".into(),
        target: "≤ 20 µs".into(),
        measured: dur(with.median),
        met,
    });
    report.tables.push(t);
    Ok(())
}

async fn turn_open(
    bins: &Bins,
    data: &Path,
    plan: &Plan,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut t = Table::new(
        TURN,
        &[
            "registered tools",
            "kind",
            "in catalogue",
            "broker start",
            "catalogue cold median",
            "p99",
            "catalogue repeated median",
            "turn open cold median",
            "turn open repeated median",
            "target (cold ≤ 5 ms at 1,000; repeated near zero)",
        ],
    );
    t.text(
        "`Kernel::catalog` in process (an in-process broker started with `sharedos_broker::start`): \
         \"cold\" is a principal not seen before (nothing cached: the policy set is sliced for it, \
         each requirement shape or tool is decided, the definitions are projected, sorted and \
         hashed); \"repeated\" is the same principal again with the policy unchanged. \"turn open\" \
         is a whole `open_turn` request over control.sock (catalogue, harness aliases, token, the \
         `turn_opened` record line with record_sync `batch`, the answer carrying every \
         definition). Built-in: files providers of 3 tools (one of 4), all visible through one \
         policy for every principal, so the catalogue decides once per (action, resource type). \
         Brokered: one upstream MCP server (`direct-files-server --synthetic-tools N`) behind the \
         broker, tools without requirement templates, so each tool's resource is the tool \
         itself and the catalogue decides once per tool. \"near zero\" is taken as ≤ 10 µs.",
    );
    for kind in [ToolKind::Builtin, ToolKind::Brokered] {
        for &n in &plan.tool_counts {
            eprintln!("bench:    {n} {kind:?} tools…");
            let c = micro::catalog(
                kind,
                data,
                &bins.direct,
                n,
                plan.catalog_cold,
                plan.catalog_warm,
            )
            .await
            .with_context(|| format!("turn open with {n} {kind:?} tools"))?;
            let (cold, warm) = (c.cold.summary(), c.warm.summary());
            let (ocold, owarm) = (c.open_cold.summary(), c.open_warm.summary());
            let kind_label = match kind {
                ToolKind::Builtin => "built-in",
                ToolKind::Brokered => "brokered",
            };
            let target = if n == 1_000 {
                let met_cold = cold.median <= Duration::from_millis(5);
                let met_warm = warm.median <= Duration::from_micros(10);
                report.targets.push(Target {
                    what: format!("4. catalogue cold, 1,000 {kind_label} tools (median)"),
                    target: "≤ 5 ms".into(),
                    measured: dur(cold.median),
                    met: met_cold,
                });
                report.targets.push(Target {
                    what: format!(
                        "4. catalogue repeated principal, 1,000 {kind_label} tools (median)"
                    ),
                    target: "near zero (≤ 10 µs)".into(),
                    measured: dur(warm.median),
                    met: met_warm,
                });
                format!("cold {}; repeated {}", verdict(met_cold), verdict(met_warm))
            } else {
                "—".into()
            };
            t.row(vec![
                thousands(c.registered as u64),
                kind_label.into(),
                thousands(c.visible as u64),
                dur(c.start),
                format!("{} (n = {})", dur(cold.median), cold.n),
                dur(cold.p99),
                dur(warm.median),
                format!("{} (n = {})", dur(ocold.median), ocold.n),
                dur(owarm.median),
                target,
            ]);
        }
    }
    report.tables.push(t);
    Ok(())
}

async fn record(plan: &Plan, report: &mut Report, shared: &mut Shared) -> anyhow::Result<()> {
    let mut t = Table::new(
        RECORD,
        &[
            "writer",
            "appenders",
            "appends",
            "added latency median",
            "p99",
            "appends/s",
        ],
    );
    let fsync = shared.fsync.summary();
    let spaced = shared.fsync_spaced.summary();
    t.text(format!(
        "`Recorder::append` of a call line (~330 bytes) in process, each appender one append at a \
         time; the latency of an append is what the record adds to a call. \"no group commit\" is \
         a bench-local writer that writes and fdatasyncs each line before taking the next (the \
         broker has no such mode). One fdatasync on this filesystem (ext4 here, where the \
         temporary records live) measured in the same run: median {}, p99 {} (n = {}) back to \
         back; median {}, p99 {} {} µs after the last one (as a lone `always` caller's come).",
        dur(fsync.median),
        dur(fsync.p99),
        fsync.n,
        dur(spaced.median),
        dur(spaced.p99),
        micro::SYNC_GAP.as_micros()
    ));
    for mode in [
        RecordMode::AlwaysPerLine,
        RecordMode::AlwaysGroup,
        RecordMode::Batch,
        RecordMode::BatchInline,
    ] {
        for &appenders in &plan.record_appenders {
            eprintln!("bench:    {mode:?}, {appenders} appender(s)…");
            let r = micro::record(mode, appenders, plan.record_max, plan.record_duration).await?;
            let s = r.latency.summary();
            if matches!(mode, RecordMode::Batch) && appenders == 1 {
                shared.append = Some(s.median);
            }
            t.row(vec![
                mode.label().into(),
                appenders.to_string(),
                thousands(r.calls),
                dur(s.median),
                dur(s.p99),
                thousands(rate(r.calls, r.wall) as u64),
            ]);
        }
    }
    report.tables.push(t);
    let h = micro::handoffs(plan.handoff).await?;
    let mut t = Table::new(HANDOFFS, &["hand-off", "n", "median", "p99"]);
    t.text(
        "In this benchmark's runtime (tokio multi-thread, one worker per core), the kinds of hop \
         a call can make inside a process (to the blocking pool, to another task and back), \
         next to the work a `batch` record line needs without them; and what one \
         more process on a call's path costs: a message to `cat` and back (a sleeping process \
         woken, then this one). Through the boundary a call makes one such trip more than to a \
         direct server (client → shim → broker → shim → client, against client → server → \
         client). The figure depends on placement: on a VM, waking a process on another vCPU \
         costs far more than on the same one.",
    );
    for (what, s) in [
        (
            "`spawn_blocking` of an empty closure, awaited",
            &h.spawn_blocking,
        ),
        (
            "request to another task over mpsc, answer over oneshot",
            &h.task_round_trip,
        ),
        ("write(2) of a call line, inline", &h.write_inline),
        (
            "300 bytes to another process (`cat`) over a pipe and back",
            &h.process_round_trip,
        ),
    ] {
        let s = s.summary();
        t.row(vec![
            what.into(),
            thousands(s.n as u64),
            dur(s.median),
            dur(s.p99),
        ]);
    }
    report.tables.push(t);
    eprintln!("bench:    what the hash chain and OpenTelemetry export add…");
    let o = micro::overheads(plan.handoff, plan.spans).await?;
    let mut t = Table::new(EXPORT, &["work", "n", "median", "p99", "target", "result"]);
    t.text(format!(
        "In process, through the broker's library. The chain: SHA-256 of a typical call line \
         ({} bytes, as the recorder hashes every line for the next one's `prev`) and its hex \
         form. The export, on: on the call path, the span's fields cloned and handed to the \
         bounded queue (`Telemetry::call`); off the call path, the export thread's CPU and its \
         HTTP client's (from `/proc/self/task/*/stat`, 10 ms ticks) for {} spans sent in \
         batches over OTLP/HTTP to a stand-in receiver that answers 200 (metrics on), divided \
         by the spans; {} dropped. With export off, the call path does one branch.",
        o.line_bytes,
        thousands(o.spans_exported),
        o.spans_dropped
    ));
    let chain = o.chain.summary();
    let hot = o.export_hot.summary();
    let logs = o.logs_hot.summary();
    let rows = [
        (
            "hash chain, per line",
            chain.n,
            chain.median,
            dur(chain.p99),
        ),
        (
            "export on, on the call path",
            hot.n,
            hot.median,
            dur(hot.p99),
        ),
        (
            "export on, the export thread, per span",
            o.spans_exported as usize,
            o.export_thread_per_span,
            "—".to_owned(),
        ),
        (
            "record line as a log (`logs = true`), on the call path",
            logs.n,
            logs.median,
            dur(logs.p99),
        ),
        (
            "record line as a log, the export thread, per line",
            o.lines_exported as usize,
            o.export_thread_per_line,
            "—".to_owned(),
        ),
    ];
    for (what, n, median, p99) in rows {
        let met = median <= Duration::from_micros(5);
        t.row(vec![
            what.into(),
            thousands(n as u64),
            dur(median),
            p99,
            "≤ 5 µs".into(),
            verdict(met),
        ]);
        report.targets.push(Target {
            what: format!("5c. CPU per call: {what} (median)"),
            target: "≤ 5 µs".into(),
            measured: dur(median),
            met,
        });
    }
    report.tables.push(t);
    Ok(())
}

async fn memory_section(
    bins: &Bins,
    data: &Path,
    plan: &Plan,
    report: &mut Report,
    shared: &Shared,
) -> anyhow::Result<()> {
    let m = memory::measure(bins, data, plan.turns).await?;
    let mut t = Table::new(
        MEMORY,
        &[
            "process",
            "state",
            "VmRSS",
            "VmHWM (peak)",
            "target",
            "result",
        ],
    );
    t.text(format!(
        "From `/proc/<pid>/status` of the real processes. Targets are judged on the peak (VmHWM). \
         The shim, the relay and rmcp-floor are linked statically under `cargo run`, as the README \
         deploys the shim (`cargo rustc … -- -C target-feature=+crt-static`; \"linked\" above says \
         how each binary of this run is): a dynamically linked process also counts the pages of \
         libc, libm and ld.so it touches. The {} turns were opened for alice over 8 control connections in {} (record_sync `always`). \
         The shim's code is laid out with the functions a session runs first (`shim/hot-functions.txt`, \
         written by `bench/shim-order.py`; shim/build.rs): {}.",
        thousands(m.turns as u64),
        dur(m.open_all),
        procs::hot_functions_found(&bins.shim)
    ));
    let kib = |mb: u64| mb * 1024;
    let shim_met = m.shim.hwm_kib <= kib(8);
    let shim_goal_met = m.shim.hwm_kib <= kib(4);
    let shim_46_met = m.shim.hwm_kib <= kib(7) / 2;
    let broker_met = m.broker_turns.hwm_kib <= kib(64);
    let row = |process: &str, state: &str, mem: Mem, target: &str, result: String| {
        vec![
            process.to_owned(),
            state.to_owned(),
            mib(mem.rss_kib),
            mib(mem.hwm_kib),
            target.to_owned(),
            result,
        ]
    };
    t.row(row(
        "sharedos-mcp-shim",
        "after initialize, tools/list, 100 reads",
        m.shim,
        "≤ 8 MiB",
        verdict(shim_met),
    ));
    t.row(row(
        "direct-files-server (baseline)",
        "after initialize, tools/list, 100 reads",
        m.direct,
        "—",
        "—".into(),
    ));
    t.row(row(
        "relay (floor: any process between client and server)",
        "the same session, through to a listening direct server",
        m.floors.relay,
        "—",
        "—".into(),
    ));
    t.row(row(
        "rmcp-floor (floor: the smallest rmcp stdio server, built as the shim is)",
        "the same session",
        m.floors.rmcp,
        "—",
        "—".into(),
    ));
    t.row(row(
        "sharedos-broker serve",
        "idle (started, no turn)",
        m.broker_idle,
        "—",
        "—".into(),
    ));
    t.row(row(
        "sharedos-broker serve",
        &format!("{} open turns", thousands(m.turns as u64)),
        m.broker_turns,
        "≤ 64 MiB",
        verdict(broker_met),
    ));
    for (mode, mem) in &shared.broker_after_load {
        t.row(row(
            "sharedos-broker serve",
            &format!("after the round trips of section 2 ({mode}, up to 64 bridges)"),
            *mem,
            "—",
            "—".into(),
        ));
    }
    report.tables.push(t);
    report.targets.push(Target {
        what: "6. shim memory (VmHWM)".into(),
        target: "≤ 8 MiB".into(),
        measured: mib(m.shim.hwm_kib),
        met: shim_met,
    });
    report.targets.push(Target {
        what: "6. shim memory, issue 17's goal (VmHWM)".into(),
        target: "≤ 4 MiB".into(),
        measured: format!(
            "{} (floors: relay {}, rmcp-floor {})",
            mib(m.shim.hwm_kib),
            mib(m.floors.relay.hwm_kib),
            mib(m.floors.rmcp.hwm_kib)
        ),
        met: shim_goal_met,
    });
    report.targets.push(Target {
        what: "6. shim memory, issue 46's goal (VmHWM)".into(),
        target: "≤ 3.5 MiB".into(),
        measured: mib(m.shim.hwm_kib),
        met: shim_46_met,
    });
    report.targets.push(Target {
        what: format!(
            "6. broker memory with {} open turns (VmHWM)",
            thousands(m.turns as u64)
        ),
        target: "≤ 64 MiB".into(),
        measured: mib(m.broker_turns.hwm_kib),
        met: broker_met,
    });
    Ok(())
}

#[cfg(test)]
mod generated_whole {
    use super::{COMMAND, SECTION_TITLES};
    use crate::report::{Machine, Report, Table};
    use std::path::Path;

    /// The `## ` headings of a markdown text, outside fenced code blocks.
    fn headings(text: &str) -> Vec<String> {
        let mut fenced = false;
        let mut out = Vec::new();
        for line in text.lines() {
            if line.starts_with("```") {
                fenced = !fenced;
            } else if !fenced && let Some(h) = line.strip_prefix("## ") {
                out.push(h.to_owned());
            }
        }
        out
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// What a full run writes: the machine, the targets, every section, then NOTES.md's.
    fn expected(notes: &str) -> Vec<String> {
        let mut want = vec!["Machine and run".to_owned(), "Targets".to_owned()];
        want.extend(SECTION_TITLES.iter().map(|t| (*t).to_owned()));
        want.extend(headings(notes));
        want
    }

    fn notes() -> String {
        read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("NOTES.md"))
    }

    /// BENCHMARKS.md is generated whole: every `##` heading of the committed file is one the
    /// generator writes (a section of the suite) or one of `bench/NOTES.md`'s, in the order a
    /// `--write` run writes them, so no section is kept by hand that a `--write` would erase.
    #[test]
    fn the_committed_benchmarks_md_holds_only_generated_sections_and_the_notes() {
        let committed = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../BENCHMARKS.md"));
        assert_eq!(
            headings(&committed),
            expected(&notes()),
            "BENCHMARKS.md has headings the generator does not write (a hand-kept section: move \
             its findings to bench/NOTES.md and its figures into the suite), or misses some: \
             regenerate it with `{COMMAND}`"
        );
    }

    /// The generator writes each section's heading once, in [`SECTION_TITLES`]' order, and the
    /// notes after them.
    #[test]
    fn the_report_writes_every_section_title_then_the_notes() {
        let mut distinct = SECTION_TITLES.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), SECTION_TITLES.len(), "a title twice");
        let report = Report {
            tables: SECTION_TITLES
                .iter()
                .map(|title| {
                    let mut t = Table::new(title, &["a"]);
                    t.row(vec!["1".into()]);
                    t
                })
                .collect(),
            targets: vec![],
            parameters: vec![],
        };
        let notes = notes();
        let md = report.markdown(&Machine::capture(), COMMAND, Some(&notes));
        assert_eq!(headings(&md), expected(&notes));
        assert!(md.ends_with(&format!("{}\n", notes.trim_end())));
    }
}
