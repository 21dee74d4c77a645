//! In-process micro-benchmarks through the broker's library API: the decision
//! (`Kernel::check`, i.e. requirement resolution + Cedar, and `PolicyEngine::decide` alone), the
//! catalogue (`Kernel::catalog`: decisions, projection, catalogHash) and a whole turn open over
//! `control.sock` of an in-process broker, the record writer (`Recorder`), and one fdatasync on
//! the filesystem the records live on.
//!
//! Nothing here changes the broker: the one thing the broker has no switch for, an `always`
//! record without group commit, is a bench-local writer ([`PerLineSync`]) that does what the
//! recorder would do without batching: write one line, fdatasync, acknowledge.

use std::hint::black_box;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;
use sharedos_broker::Config;
use sharedos_broker::evidence::record::{RecordSync, Recorder};
use sharedos_broker::kernel::{AccessContext, Verdict};
use sharedos_broker::policy::Resource;
use sharedos_host::client::ControlClient;
use sharedos_proto::record::{self, Event};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::e2e::LoadResult;
use crate::procs::{self, HELLO_PATH, WAIT};
use crate::stats::Samples;

/// How long and how many times a loop may run.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub iterations: usize,
    pub duration: Duration,
}

/// Times `f` until the count or the deadline.
fn time_loop(budget: Budget, mut f: impl FnMut()) -> Samples {
    let mut s = Samples::with_capacity(budget.iterations);
    let deadline = Instant::now() + budget.duration;
    for _ in 0..budget.iterations {
        let t = Instant::now();
        if t >= deadline {
            break;
        }
        f();
        s.push(t.elapsed());
    }
    s
}

pub fn tempdir(what: &str) -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix(&format!("sharedos-bench-{what}-"))
        .tempdir()?)
}

/// `n` policies, 5 of which apply to `alice` (4 permits and a forbid, the shape of a real
/// per-user grant); the others each name another user.
pub fn policy_text(n: usize) -> String {
    let alice = r#"@id("alice-read") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is SharedOS::File) when { resource.path like "/public/*" };
@id("alice-list") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"list", resource is SharedOS::File) when { resource.path == "/public" || resource.path like "/public/*" };
@id("alice-search") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"search", resource is SharedOS::File) when { resource.path == "/public" || resource.path like "/public/*" };
@id("alice-shared") permit(principal == SharedOS::User::"alice", action in [SharedOS::Action::"read", SharedOS::Action::"list"], resource is SharedOS::File) when { resource.path like "/shared/alice/*" };
@id("alice-no-secrets") forbid(principal == SharedOS::User::"alice", action, resource is SharedOS::File) when { resource.path like "*/secret*" };
"#;
    let mut out = String::from(alice);
    for i in 0..n.saturating_sub(5) {
        out.push_str(&format!(
            "@id(\"user{i}-home\") permit(principal == SharedOS::User::\"user{i}\", action == SharedOS::Action::\"read\", resource is SharedOS::File) when {{ resource.path like \"/home/user{i}/*\" }};\n"
        ));
    }
    out
}

/// What the decision benchmark found for one policy-set size.
pub struct Decision {
    pub policies: usize,
    /// Building the kernel (parse + strict validation of the set, providers).
    pub load: Duration,
    /// `Kernel::check`: name, catalogue membership, input schema, requirement resolution
    /// (virtual path canonicalized and resolved through the filesystem), Cedar.
    pub check: Samples,
    /// `PolicyEngine::decide` alone (entities, request, sliced set, Cedar).
    pub decide: Samples,
    /// The benchmarked call was permitted (by `alice-read`).
    pub permitted: bool,
}

/// The decision at each policy-set size, in [`DECISION_ROUNDS`] rounds: each round builds each
/// size's kernel in turn, times it for its share of the budget and drops it. On this VM the same
/// loop moves by 30–50 % from one second to the next: timed one size after the other, a noisy
/// second lands on one size and reads as a difference between sizes. In rounds, every size sees
/// the same machine, and each is timed alone in the process, as a broker holds one policy set.
pub async fn decisions(
    data: &Path,
    sizes: &[usize],
    budget: Budget,
) -> anyhow::Result<Vec<Decision>> {
    let mut out: Vec<Decision> = sizes
        .iter()
        .map(|&n| Decision {
            policies: n,
            load: Duration::ZERO,
            check: Samples::with_capacity(budget.iterations),
            decide: Samples::with_capacity(budget.iterations),
            permitted: true,
        })
        .collect();
    let share = Budget {
        iterations: budget.iterations.div_ceil(DECISION_ROUNDS),
        duration: budget.duration / u32::try_from(DECISION_ROUNDS).unwrap_or(1),
    };
    let ctx = AccessContext::new("alice", None);
    let args = json!({"path": HELLO_PATH});
    let resource = Resource::File {
        namespace: "files".into(),
        path: HELLO_PATH.into(),
    };
    for round in 0..DECISION_ROUNDS {
        for d in &mut out {
            let dir = tempdir("policy")?;
            let cfg = procs::write_config(
                dir.path(),
                "batch",
                &policy_text(d.policies),
                &procs::files_provider("files", data, false),
            )?;
            let config = Config::from_file(&cfg)?;
            let root = CancellationToken::new();
            let t = Instant::now();
            let kernel = sharedos_broker::assemble::build_kernel(&config, &root).await?;
            if round == 0 {
                d.load = t.elapsed();
            }
            let catalog = kernel.catalog(&ctx);
            d.permitted &= matches!(
                kernel.check(&ctx, &catalog, "files.read", Some(&args)),
                Verdict::Permitted { .. }
            );
            d.check.extend(time_loop(share, || {
                black_box(kernel.check(&ctx, &catalog, "files.read", Some(&args)));
            }));
            let pv = kernel.policy.current();
            d.decide.extend(time_loop(share, || {
                black_box(kernel.policy.decide(&pv, &ctx, "read", &resource));
            }));
            root.cancel();
        }
    }
    Ok(out)
}

/// The decision on a brokered tool with typed arguments (issue 44) against today's on the tool
/// alone: 10 policies for alice (4 read `context.arguments`), a call with 1 KiB of arguments.
/// `plain`: `PolicyEngine::decide` without arguments; `typed`: the arguments typed from the
/// tool's inputSchema (`arguments::typed`) and `decide_with` them, together.
pub struct TypedDecision {
    pub plain: Samples,
    pub typed: Samples,
    pub permitted: bool,
    pub argument_bytes: usize,
}

pub fn typed_decision(budget: Budget) -> anyhow::Result<TypedDecision> {
    use sharedos_broker::policy::{ArgumentTypes, PolicyEngine, arguments};
    let dir = tempdir("typed")?;
    let mut policy = String::new();
    for i in 0..6 {
        policy.push_str(&format!(
            "@id(\"p{i}\") permit(principal == SharedOS::User::\"alice\", action == SharedOS::Action::\"call\", resource is SharedOS::Tool) when {{ resource.name == \"chat.t{i}\" }};\n"
        ));
    }
    policy.push_str(r#"@id("public") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name == "chat.post" && context.arguments has channel && context.arguments.channel == "public" };
@id("small") permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name == "chat.post" && context.arguments has amount && context.arguments.amount <= 100 };
@id("no-exec") forbid(principal, action, resource) when { context.arguments has channel && context.arguments.channel == "exec" };
@id("no-tag") forbid(principal, action, resource) when { context.arguments has tags && context.arguments.tags.contains("secret") };
"#);
    let path = dir.path().join("policy.cedar");
    std::fs::write(&path, policy)?;
    let engine = PolicyEngine::load(None, &path)?;
    let schema = json!({"type": "object", "properties": {
        "channel": {"type": "string"}, "text": {"type": "string"}, "amount": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object", "properties": {"thread": {"type": "string"}, "urgent": {"type": "boolean"}}}}});
    let mut types = ArgumentTypes::known();
    types.add_tool("call", Some(&schema));
    engine.set_argument_types(types)?;
    let args = json!({"channel": "public", "text": "x".repeat(880), "amount": 42,
        "tags": ["a", "b", "c"], "meta": {"thread": "t-1", "urgent": false}});
    let argument_bytes = args.to_string().len();
    let serde_json::Value::Object(map) = args else {
        anyhow::bail!("arguments are an object")
    };
    let (pv, ctx) = (engine.current(), AccessContext::new("alice", None));
    let tool = Resource::Tool {
        name: "chat.post".into(),
    };
    let typed = arguments::typed(Some(&schema), &map);
    let permitted = engine
        .decide_with(&pv, &ctx, "call", &tool, Some(&typed))
        .allowed;
    let plain = time_loop(budget, || {
        black_box(engine.decide(&pv, &ctx, "call", &tool));
    });
    let typed = time_loop(budget, || {
        let t = arguments::typed(Some(&schema), &map);
        black_box(engine.decide_with(&pv, &ctx, "call", &tool, Some(&t)));
    });
    Ok(TypedDecision {
        plain,
        typed,
        permitted,
        argument_bytes,
    })
}

/// Rounds of the decision benchmark (see [`decisions`]).
pub const DECISION_ROUNDS: usize = 4;

/// Which registered tools the catalogue benchmark uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolKind {
    /// Built-in files providers (3 or 4 tools each): tools share requirement shapes, so the
    /// catalogue decides once per shape.
    Builtin,
    /// One brokered MCP provider with N tools and no templates: each tool's resource is the
    /// tool itself, so the catalogue decides once per tool.
    Brokered,
}

/// Every principal may read, list and search `/public`.
const EVERYONE_PUBLIC: &str = r#"@id("everyone-public") permit(principal is SharedOS::User, action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"], resource is SharedOS::File) when { resource.path == "/public" || resource.path like "/public/*" };
"#;
/// Every principal may call the synthetic upstream's tools.
const EVERYONE_SYNTH: &str = r#"@id("everyone-synth") permit(principal is SharedOS::User, action == SharedOS::Action::"call", resource is SharedOS::Tool) when { resource.name like "synth.*" };
"#;

/// What the catalogue benchmark found for one registry size.
pub struct CatalogRun {
    pub registered: usize,
    /// Tools in the principal's catalogue.
    pub visible: usize,
    /// Starting the broker with this registry.
    pub start: Duration,
    /// `Kernel::catalog` for a principal not seen before (nothing cached).
    pub cold: Samples,
    /// `Kernel::catalog` again for the same principal, policy unchanged.
    pub warm: Samples,
    /// A whole `open_turn` over control.sock, new principal each time.
    pub open_cold: Samples,
    /// A whole `open_turn` over control.sock, same principal.
    pub open_warm: Samples,
}

/// The `[[providers]]` of a registry with `n` tools of `kind`.
fn registry_toml(kind: ToolKind, data: &Path, direct: &Path, n: usize) -> anyhow::Result<String> {
    match kind {
        ToolKind::Builtin => {
            // n = 3 × read-only providers + 4 (one writable provider).
            anyhow::ensure!(
                n >= 4 && (n - 4).is_multiple_of(3),
                "{n} tools cannot be laid out"
            );
            let mut toml = procs::files_provider("w", data, true);
            for i in 0..(n - 4) / 3 {
                toml.push_str(&procs::files_provider(&format!("f{i:05}"), data, false));
            }
            Ok(toml)
        }
        ToolKind::Brokered => Ok(format!(
            "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"synth\"\ncommand = {}\nargs = [\"--synthetic-tools\", \"{n}\"]\n",
            procs::toml_string(&direct.display().to_string())
        )),
    }
}

pub async fn catalog(
    kind: ToolKind,
    data: &Path,
    direct: &Path,
    n: usize,
    cold: Budget,
    warm: Budget,
) -> anyhow::Result<CatalogRun> {
    let dir = tempdir("catalog")?;
    let policy = match kind {
        ToolKind::Builtin => EVERYONE_PUBLIC,
        ToolKind::Brokered => EVERYONE_SYNTH,
    };
    let cfg = procs::write_config(
        dir.path(),
        "batch",
        policy,
        &registry_toml(kind, data, direct, n)?,
    )?;
    let config = Config::from_file(&cfg)?;
    let shutdown = CancellationToken::new();
    let t = Instant::now();
    let running = sharedos_broker::start(config, dir.path().join("run"), shutdown.clone()).await?;
    let start = t.elapsed();
    let result = measure_catalog(&running, &dir.path().join("run"), cold, warm).await;
    shutdown.cancel();
    tokio::time::timeout(WAIT * 3, running.wait())
        .await
        .context("the in-process broker did not stop in time")??;
    let (visible, cold_s, warm_s, open_cold, open_warm) = result?;
    Ok(CatalogRun {
        registered: n,
        visible,
        start,
        cold: cold_s,
        warm: warm_s,
        open_cold,
        open_warm,
    })
}

type CatalogSamples = (usize, Samples, Samples, Samples, Samples);

async fn measure_catalog(
    running: &sharedos_broker::server::Running,
    runtime: &Path,
    cold: Budget,
    warm: Budget,
) -> anyhow::Result<CatalogSamples> {
    let kernel = &running.broker.kernel;
    let ctx = |p: String| AccessContext::new(&p, None);
    let mut i = 0usize;
    let cold_s = time_loop(cold, || {
        i += 1;
        black_box(kernel.catalog(&ctx(format!("cold{i}"))));
    });
    let alice = ctx("alice".into());
    let visible = kernel.catalog(&alice).tools.len();
    let warm_s = time_loop(warm, || {
        black_box(kernel.catalog(&alice));
    });
    let mut host = ControlClient::connect(runtime).await?;
    let mut open_cold = Samples::default();
    let deadline = Instant::now() + cold.duration;
    for i in 0..cold.iterations {
        let t = Instant::now();
        if t >= deadline {
            break;
        }
        procs::open_turn(&mut host, &format!("open{i}")).await?;
        open_cold.push(t.elapsed());
    }
    let mut open_warm = Samples::default();
    procs::open_turn(&mut host, "alice").await?;
    let deadline = Instant::now() + cold.duration;
    for _ in 0..cold.iterations {
        let t = Instant::now();
        if t >= deadline {
            break;
        }
        procs::open_turn(&mut host, "alice").await?;
        open_warm.push(t.elapsed());
    }
    Ok((visible, cold_s, warm_s, open_cold, open_warm))
}

/// How the record is written in the record benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordMode {
    /// fdatasync per line, no group commit (bench-local writer).
    AlwaysPerLine,
    /// The broker's recorder, `record_sync = "always"` (group commit).
    AlwaysGroup,
    /// The broker's recorder, `record_sync = "batch"`.
    Batch,
    /// What `batch` costs without hand-offs: the caller writes its line itself, under a mutex,
    /// with no writer task and no blocking-pool thread (bench-local; for comparison).
    BatchInline,
}

impl RecordMode {
    pub fn label(self) -> &'static str {
        match self {
            RecordMode::AlwaysPerLine => "`always`, no group commit (one fdatasync per line)",
            RecordMode::AlwaysGroup => "`always`, group commit (Recorder)",
            RecordMode::Batch => "`batch` (Recorder)",
            RecordMode::BatchInline => {
                "`batch` written by the caller, no writer task (bench-local, for comparison)"
            }
        }
    }
}

/// A call record line as the kernel writes one (`seq` and `at` are added by the writer).
fn call_line(i: u64) -> Event {
    let turn = "t-5f0c1e2d3a4b5c6d";
    Event::Call(record::Call {
        turn: turn.into(),
        call_id: format!("{turn}.{i}"),
        request_id: Some(i.to_string()),
        tool: "files.read".into(),
        arguments: Some(record::Arguments::Kept(json!({"path": HELLO_PATH}))),
        requirement: Some(sharedos_proto::Requirement {
            action: "read".into(),
            resource: "SharedOS::File::\"/public/hello.txt\"".into(),
            namespace: Some("files".into()),
            attributes: None,
        }),
        outcome: "succeeded".into(),
        code: "ok".into(),
        policies: Some(vec!["alice-public".into()]),
        duration_us: Some(41),
        message: None,
        cut: None,
        system_identity: None,
        forwarded_arguments: None,
        redacted: None,
    })
}

/// A bench-local writer: the caller serializes and writes its own line under a mutex (seq and
/// at added as the recorder adds them); with `sync`, fdatasync before the next line (no group
/// commit, on a blocking-pool thread), without it inline in the calling task.
struct Direct {
    file: Arc<Mutex<(std::fs::File, u64)>>,
    sync: bool,
}

fn write_line(file: &Mutex<(std::fs::File, u64)>, event: Event, sync: bool) -> anyhow::Result<u64> {
    let mut guard = file
        .lock()
        .map_err(|_| anyhow::anyhow!("writer poisoned"))?;
    guard.1 += 1;
    let line = record::RecordLine {
        seq: guard.1,
        at: sharedos_broker::evidence::record::now_rfc3339(),
        // No chain: the baseline is a plain writer (the Recorder hashes each line as well).
        prev: None,
        event,
    };
    let mut text = serde_json::to_vec(&line)?;
    text.push(b'\n');
    guard.0.write_all(&text)?;
    if sync {
        guard.0.sync_data()?;
    }
    Ok(guard.1)
}

impl Direct {
    async fn append(&self, event: Event) -> anyhow::Result<u64> {
        if !self.sync {
            return write_line(&self.file, event, false);
        }
        let file = self.file.clone();
        tokio::task::spawn_blocking(move || write_line(&file, event, true)).await?
    }
}

enum Writer {
    Direct(Direct),
    Recorder(Recorder),
}

impl Writer {
    async fn append(&self, event: Event) -> anyhow::Result<u64> {
        match self {
            Writer::Direct(w) => w.append(event).await,
            Writer::Recorder(r) => Ok(r.append(&event).await?),
        }
    }
}

/// `appenders` tasks append call lines, each one at a time, until the count or the deadline.
pub async fn record(
    mode: RecordMode,
    appenders: usize,
    max_per: usize,
    duration: Duration,
) -> anyhow::Result<LoadResult> {
    let dir = tempdir("record")?;
    let path = dir.path().join("record.jsonl");
    let direct = |sync| -> anyhow::Result<Writer> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        Ok(Writer::Direct(Direct {
            file: Arc::new(Mutex::new((file, 0))),
            sync,
        }))
    };
    let writer = Arc::new(match mode {
        RecordMode::AlwaysPerLine => direct(true)?,
        RecordMode::BatchInline => direct(false)?,
        RecordMode::AlwaysGroup => Writer::Recorder(Recorder::open(&path, RecordSync::Always)?.0),
        RecordMode::Batch => Writer::Recorder(Recorder::open(&path, RecordSync::Batch)?.0),
    });
    // Warm-up: the file exists and has a few lines.
    for i in 0..5 {
        writer.append(call_line(i)).await?;
    }
    let start = Instant::now() + Duration::from_millis(5);
    let deadline = start + duration;
    let mut set = JoinSet::new();
    for a in 0..appenders {
        let writer = writer.clone();
        set.spawn(async move {
            tokio::time::sleep_until(start.into()).await;
            let mut latency = Samples::with_capacity(max_per.min(100_000));
            let mut end = start;
            for i in 0..max_per {
                let t = Instant::now();
                if t >= deadline {
                    break;
                }
                tokio::time::timeout(WAIT, writer.append(call_line((a * max_per + i) as u64)))
                    .await
                    .context("append did not finish in time")??;
                end = Instant::now();
                latency.push(end - t);
            }
            anyhow::Ok((latency, end))
        });
    }
    let mut out = LoadResult {
        latency: Samples::default(),
        calls: 0,
        errors: 0,
        wall: Duration::ZERO,
        cpu: Default::default(),
    };
    let mut last = start;
    while let Some(r) = set.join_next().await {
        let (latency, end) = r??;
        out.calls += latency.len() as u64;
        out.latency.extend(latency);
        last = last.max(end);
    }
    out.wall = last - start;
    Ok(out)
}

/// How long [`fdatasync`] waits between syncs when spaced: about a sequential `batch` round
/// trip, so the syncs come as far apart as a lone `always` caller's do.
pub const SYNC_GAP: Duration = Duration::from_micros(150);

/// One fdatasync after appending a record-sized line, on the filesystem of the temporary
/// folder (where every benchmark record lives): back to back, or, with `gap`, after sleeping
/// that long (a lone `always` caller's syncs are a round trip apart; on this VM such a sync is
/// slower than one right after another).
pub async fn fdatasync(budget: Budget, gap: Option<Duration>) -> anyhow::Result<Samples> {
    let dir = tempdir("fsync")?;
    let path = dir.path().join("probe.jsonl");
    tokio::task::spawn_blocking(move || -> anyhow::Result<Samples> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let mut line = serde_json::to_vec(&call_line(0))?;
        line.push(b'\n');
        let mut s = Samples::with_capacity(budget.iterations);
        let deadline = Instant::now() + budget.duration;
        for _ in 0..budget.iterations {
            if Instant::now() >= deadline {
                break;
            }
            if let Some(gap) = gap {
                std::thread::sleep(gap);
            }
            file.write_all(&line)?;
            let t = Instant::now();
            file.sync_data()?;
            s.push(t.elapsed());
        }
        drop(dir);
        Ok(s)
    })
    .await?
}

/// What one hand-off costs on this machine, in the benchmark's own runtime (multi-thread, one
/// worker per core): the hops a call makes inside the broker and the shim.
pub struct Handoffs {
    /// `spawn_blocking(|| ())` awaited: to a blocking-pool thread and back.
    pub spawn_blocking: Samples,
    /// A request to another task over an mpsc channel, answered over a oneshot.
    pub task_round_trip: Samples,
    /// Writing a call line with write(2), inline.
    pub write_inline: Samples,
    /// 300 bytes to another process (`cat`) over a pipe and back: the least one more process
    /// on a call's path costs (two wake-ups of a sleeping process).
    pub process_round_trip: Samples,
}

pub async fn handoffs(budget: Budget) -> anyhow::Result<Handoffs> {
    let mut spawn_blocking = Samples::with_capacity(budget.iterations);
    let deadline = Instant::now() + budget.duration;
    for _ in 0..budget.iterations {
        let t = Instant::now();
        if t >= deadline {
            break;
        }
        tokio::task::spawn_blocking(|| black_box(())).await?;
        spawn_blocking.push(t.elapsed());
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<u64>>(64);
    let server = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(ack) = rx.recv().await {
            n += 1;
            let _ = ack.send(n);
        }
    });
    let mut task_round_trip = Samples::with_capacity(budget.iterations);
    let deadline = Instant::now() + budget.duration;
    for _ in 0..budget.iterations {
        let t = Instant::now();
        if t >= deadline {
            break;
        }
        let (ack, done) = tokio::sync::oneshot::channel();
        tx.send(ack)
            .await
            .map_err(|_| anyhow::anyhow!("the task stopped"))?;
        black_box(done.await?);
        task_round_trip.push(t.elapsed());
    }
    drop(tx);
    server.await?;
    let dir = tempdir("write")?;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.path().join("probe.jsonl"))?;
    let mut line = serde_json::to_vec(&call_line(0))?;
    line.push(b'\n');
    let write_inline = time_loop(budget, || {
        let _ = black_box(file.write_all(&line));
    });
    let process_round_trip = tokio::task::spawn_blocking(move || process_echo(budget)).await??;
    Ok(Handoffs {
        spawn_blocking,
        task_round_trip,
        write_inline,
        process_round_trip,
    })
}

/// Round trips of a 300-byte message through `cat` (stdin pipe in, stdout pipe back).
fn process_echo(budget: Budget) -> anyhow::Result<Samples> {
    use std::io::Read;
    let mut child = std::process::Command::new("cat")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start `cat` for the process round trip: {e}"))?;
    let (Some(mut to), Some(mut from)) = (child.stdin.take(), child.stdout.take()) else {
        anyhow::bail!("`cat` has no pipes");
    };
    let message = [b'x'; 300];
    let mut back = [0u8; 300];
    let mut once = || -> std::io::Result<()> {
        to.write_all(&message)?;
        from.read_exact(&mut back)
    };
    for _ in 0..100 {
        once()?;
    }
    // The first failure stops the timing (the remaining iterations do nothing) and is returned.
    let mut failed = None;
    let samples = time_loop(budget, || {
        if failed.is_none() {
            failed = once().err();
        }
    });
    drop(to);
    let _ = child.wait();
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(samples),
    }
}

/// What the hash chain and OpenTelemetry export add to each call, in CPU.
pub struct Overheads {
    /// Bytes of the typical call line the chain hashes.
    pub line_bytes: usize,
    /// SHA-256 of that line and its hex form (what the recorder adds per line).
    pub chain: Samples,
    /// On the call path with export on: the span built and handed to the queue.
    pub export_hot: Samples,
    /// The export thread's CPU (and its HTTP client's), per span exported.
    pub export_thread_per_span: Duration,
    pub spans_exported: u64,
    pub spans_dropped: u64,
    /// `[otel] logs = true`: a record line handed to the same queue, on the call path (under
    /// the record's lock, as the recorder does), and the export thread's CPU per line exported.
    pub logs_hot: Samples,
    pub export_thread_per_line: Duration,
    pub lines_exported: u64,
}

/// A stand-in OTLP receiver: answers every HTTP request 200 with an empty body, so the export
/// thread's work is measured whole (encoding, HTTP) and nothing fails. Not a backend: the
/// export's correctness is tested against a real one (tests/tests/e2e/telemetry.rs).
fn otlp_sink() -> anyhow::Result<u16> {
    use std::io::{BufRead, BufReader, Read};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::Builder::new()
        .name("otlp-sink".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::Builder::new()
                    .name("otlp-sink".into())
                    .spawn(move || {
                        let mut out = match stream.try_clone() {
                            Ok(s) => s,
                            Err(_) => return,
                        };
                        let mut reader = BufReader::new(stream);
                        loop {
                            let mut length = 0usize;
                            let mut line = String::new();
                            loop {
                                line.clear();
                                match reader.read_line(&mut line) {
                                    Ok(0) | Err(_) => return,
                                    Ok(_) => {}
                                }
                                if line == "\r\n" {
                                    break;
                                }
                                if let Some((k, v)) = line.split_once(':')
                                    && k.eq_ignore_ascii_case("content-length")
                                {
                                    length = v.trim().parse().unwrap_or(0);
                                }
                            }
                            let mut body = vec![0; length];
                            if reader.read_exact(&mut body).is_err() {
                                return;
                            }
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                            if out.write_all(ok).is_err() {
                                return;
                            }
                        }
                    })
                    .ok();
            }
        })?;
    Ok(port)
}

/// CPU time of this process's threads whose name starts with one of `prefixes`.
fn threads_cpu(prefixes: &[&str]) -> Duration {
    let mut total = Duration::ZERO;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return total;
    };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !prefixes.iter().any(|p| comm.trim_end().starts_with(p)) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = [11, 12]
            .iter()
            .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok()))
            .sum();
        total += Duration::from_millis(ticks * 10);
    }
    total
}

pub async fn overheads(budget: Budget, spans: usize) -> anyhow::Result<Overheads> {
    use sharedos_broker::telemetry::{CallSpan, OtelSettings, Telemetry};
    let line = record::RecordLine {
        seq: 1_000_001,
        at: sharedos_broker::evidence::record::now_rfc3339(),
        prev: Some("ab".repeat(32)),
        event: call_line(1),
    };
    let bytes = serde_json::to_vec(&line)?;
    let chain = time_loop(budget, || {
        let h = sharedos_broker::evidence::record::line_hash(black_box(&bytes));
        let mut hex = String::with_capacity(64);
        for b in h {
            use std::fmt::Write as _;
            let _ = write!(hex, "{b:02x}");
        }
        black_box(hex);
    });
    let port = otlp_sink()?;
    let settings = OtelSettings {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        logs: true,
        ..OtelSettings::default()
    };
    let telemetry = tokio::task::spawn_blocking(move || Telemetry::start(&settings)).await??;
    let template = CallSpan {
        tool: "files.read".into(),
        turn: "t-5f0c1e2d3a4b5c6d".into(),
        call_id: "t-5f0c1e2d3a4b5c6d.1".into(),
        request_id: Some("1".into()),
        principal: Some("alice".into()),
        outcome: "succeeded",
        code: "ok".into(),
        policies: vec!["alice-public".into()],
        start: std::time::SystemTime::now(),
        end: std::time::SystemTime::now(),
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        tracestate: None,
        approval: None,
        ids: None,
    };
    // Warm the exporter's connection first.
    telemetry.call(template.clone());
    let settled = |t: &Telemetry, n: u64| {
        let s = t.stats();
        s.exported + s.dropped_export_failed + s.dropped_queue_full >= n
    };
    let deadline = Instant::now() + WAIT;
    while !settled(&telemetry, 1) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let threads = ["otel-export", "reqwest-internal"];
    let before = threads_cpu(&threads);
    let exported_before = telemetry.stats().exported;
    let mut export_hot = Samples::with_capacity(spans);
    let mut sent = 1u64;
    // In chunks smaller than the queue, each drained before the next: what is measured is the
    // work per span, not drops.
    for _ in 0..spans.div_ceil(1000) {
        for _ in 0..1000 {
            let t = Instant::now();
            // As the kernel does: clone what the span needs, hand it over.
            telemetry.call(black_box(&template).clone());
            export_hot.push(t.elapsed());
        }
        sent += 1000;
        let deadline = Instant::now() + WAIT;
        while !settled(&telemetry, sent) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let cpu = threads_cpu(&threads).saturating_sub(before);
    let stats = telemetry.stats();
    let exported = stats.exported - exported_before;
    // Record lines as log records, through the same queue.
    let export = telemetry
        .line_export()
        .ok_or_else(|| anyhow::anyhow!("export is on, but has no line export"))?;
    let lines_settled = |t: &Telemetry, n: u64| {
        let s = t.stats().logs;
        s.exported + s.dropped_export_failed + s.dropped_queue_full >= n
    };
    export.line(&bytes, false);
    let deadline = Instant::now() + WAIT;
    while !lines_settled(&telemetry, 1) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before_lines = threads_cpu(&threads);
    let lines_before = telemetry.stats().logs.exported;
    let mut logs_hot = Samples::with_capacity(spans);
    let mut sent_lines = 1u64;
    for _ in 0..spans.div_ceil(1000) {
        for _ in 0..1000 {
            let t = Instant::now();
            export.line(black_box(&bytes), false);
            logs_hot.push(t.elapsed());
        }
        sent_lines += 1000;
        let deadline = Instant::now() + WAIT;
        while !lines_settled(&telemetry, sent_lines) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let cpu_lines = threads_cpu(&threads).saturating_sub(before_lines);
    let lines_exported = telemetry.stats().logs.exported - lines_before;
    drop(export);
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(Overheads {
        line_bytes: bytes.len(),
        chain,
        export_hot,
        export_thread_per_span: cpu / u32::try_from(exported.max(1)).unwrap_or(u32::MAX),
        spans_exported: exported,
        spans_dropped: stats.dropped_export_failed + stats.dropped_queue_full,
        logs_hot,
        export_thread_per_line: cpu_lines
            / u32::try_from(lines_exported.max(1)).unwrap_or(u32::MAX),
        lines_exported,
    })
}
