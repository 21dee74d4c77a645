//! End-to-end measurements with real processes: cold start (spawn → initialize → tools/list
//! answered) and per-call round trips with N concurrent callers, each caller its own MCP client
//! and its own server process (a shim with its own bridge, or a direct server).
//!
//! Every loop is bounded by a count and a deadline; every process started here is stopped here.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rmcp::model::{CallToolRequestParams, Tool};
use serde_json::{Map, Value, json};
use tokio::process::Command;
use tokio::task::JoinSet;

use crate::procs::{self, Client, HELLO_PATH, WAIT};
use crate::stats::Samples;

/// What cold start found.
pub struct ColdStart {
    pub direct: Samples,
    pub shim: Samples,
    /// The tools/list each side answered (from the last iteration).
    pub direct_tools: Vec<Tool>,
    pub shim_tools: Vec<Tool>,
}

/// One cold start: spawn, initialize, tools/list answered. The teardown is not timed.
async fn cold_once(cmd: Command) -> anyhow::Result<(Duration, Vec<Tool>)> {
    let started = Instant::now();
    let client = procs::spawn_client(cmd).await?;
    let tools = tokio::time::timeout(WAIT, client.service.peer().list_all_tools())
        .await
        .context("tools/list did not answer in time")?
        .context("tools/list failed")?;
    let took = started.elapsed();
    client.stop().await?;
    Ok((took, tools))
}

/// Cold starts of the direct server and of the shim, interleaved (so drift in the machine's
/// load hits both alike), after `warmup` untimed starts of each.
pub async fn cold_start(
    direct: impl Fn() -> Command,
    shim: impl Fn() -> Command,
    warmup: usize,
    iterations: usize,
    budget: Duration,
) -> anyhow::Result<ColdStart> {
    for _ in 0..warmup {
        cold_once(direct()).await?;
        cold_once(shim()).await?;
    }
    let mut out = ColdStart {
        direct: Samples::with_capacity(iterations),
        shim: Samples::with_capacity(iterations),
        direct_tools: vec![],
        shim_tools: vec![],
    };
    let deadline = Instant::now() + budget;
    for i in 0..iterations {
        if Instant::now() > deadline {
            break;
        }
        let order = if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_direct in order {
            if is_direct {
                let (t, tools) = cold_once(direct()).await?;
                out.direct.push(t);
                out.direct_tools = tools;
            } else {
                let (t, tools) = cold_once(shim()).await?;
                out.shim.push(t);
                out.shim_tools = tools;
            }
        }
    }
    Ok(out)
}

/// A load: how many callers, and how long each runs.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub callers: usize,
    /// Untimed calls per caller before the measurement.
    pub warmup: usize,
    /// Most timed calls per caller.
    pub max_calls: usize,
    /// Longest the timed phase runs.
    pub duration: Duration,
}

/// What a load measured.
pub struct LoadResult {
    /// Every timed call's round trip.
    pub latency: Samples,
    pub calls: u64,
    /// Calls answered with `isError` (should be none: the read is permitted).
    pub errors: u64,
    /// From the common start to the last caller's end.
    pub wall: Duration,
    /// CPU used during the timed window: by the server processes the callers talk to (shims or
    /// direct servers), by the other processes named by the caller (the broker), and by this
    /// benchmark process (the MCP clients).
    pub cpu: Cpu,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu {
    pub servers: Duration,
    pub others: Duration,
    pub client: Duration,
}

fn read_request() -> anyhow::Result<CallToolRequestParams> {
    let Value::Object(args) = json!({"path": HELLO_PATH}) else {
        bail!("arguments are an object");
    };
    Ok(CallToolRequestParams::new("files.read").with_arguments(args))
}

async fn one_call(
    peer: &rmcp::service::Peer<rmcp::RoleClient>,
    req: &CallToolRequestParams,
) -> anyhow::Result<bool> {
    let result = tokio::time::timeout(WAIT, peer.call_tool(req.clone()))
        .await
        .context("tools/call did not answer in time")?
        .context("tools/call failed")?;
    Ok(result.is_error != Some(true))
}

/// One `tools/call` of `req` on `peer`, timed from the request to the answer (bounded by
/// [`WAIT`]): its round trip, and whether it succeeded (not `isError`).
pub async fn timed_call(
    peer: &rmcp::service::Peer<rmcp::RoleClient>,
    req: &CallToolRequestParams,
) -> anyhow::Result<(Duration, bool)> {
    let t = Instant::now();
    let ok = one_call(peer, req).await?;
    Ok((t.elapsed(), ok))
}

/// Spawns one client per command (each its own server process), warms each up, then runs every
/// caller at once: each calls `files.read` in a loop, one call at a time, until its count or
/// the deadline. Stops every client before returning. `others` are processes whose CPU time is
/// also accounted (the broker).
pub async fn drive(cmds: Vec<Command>, load: Load, others: &[u32]) -> anyhow::Result<LoadResult> {
    let mut clients: Vec<Client> = Vec::with_capacity(cmds.len());
    for cmd in cmds {
        match procs::spawn_client(cmd).await {
            Ok(c) => clients.push(c),
            Err(e) => {
                stop_all(clients).await;
                return Err(e);
            }
        }
    }
    let result = run(&clients, load, others).await;
    stop_all(clients).await;
    result
}

async fn run(clients: &[Client], load: Load, others: &[u32]) -> anyhow::Result<LoadResult> {
    let req = read_request()?;
    let mut warm = JoinSet::new();
    for c in clients {
        let (peer, req) = (c.service.peer().clone(), req.clone());
        warm.spawn(async move {
            for _ in 0..load.warmup {
                one_call(&peer, &req).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = warm.join_next().await {
        r??;
    }
    let servers: Vec<u32> = clients.iter().filter_map(|c| c.pid).collect();
    let me = [std::process::id()];
    let cpu_before = (
        procs::cpu_of(&servers),
        procs::cpu_of(others),
        procs::cpu_of(&me),
    );
    // A common start, so every caller is running during the whole window.
    let start = Instant::now() + Duration::from_millis(20);
    let deadline = start + load.duration;
    let mut set = JoinSet::new();
    for c in clients {
        let (peer, req) = (c.service.peer().clone(), req.clone());
        set.spawn(async move {
            tokio::time::sleep_until(start.into()).await;
            let mut latency = Samples::with_capacity(load.max_calls.min(100_000));
            let mut errors = 0u64;
            let mut end = start;
            for _ in 0..load.max_calls {
                let t = Instant::now();
                if t >= deadline {
                    break;
                }
                if !one_call(&peer, &req).await? {
                    errors += 1;
                }
                end = Instant::now();
                latency.push(end - t);
            }
            anyhow::Ok((latency, errors, end))
        });
    }
    let mut out = LoadResult {
        latency: Samples::default(),
        calls: 0,
        errors: 0,
        wall: Duration::ZERO,
        cpu: Cpu::default(),
    };
    let mut last = start;
    while let Some(r) = set.join_next().await {
        let (latency, errors, end) = r??;
        out.calls += latency.len() as u64;
        out.latency.extend(latency);
        out.errors += errors;
        last = last.max(end);
    }
    out.wall = last - start;
    out.cpu = Cpu {
        servers: procs::cpu_of(&servers).saturating_sub(cpu_before.0),
        others: procs::cpu_of(others).saturating_sub(cpu_before.1),
        client: procs::cpu_of(&me).saturating_sub(cpu_before.2),
    };
    Ok(out)
}

async fn stop_all(clients: Vec<Client>) {
    let mut set = JoinSet::new();
    for c in clients {
        set.spawn(c.stop());
    }
    while let Some(r) = set.join_next().await {
        if let Ok(Err(e)) = r {
            eprintln!("bench: warning: {e:#}");
        }
    }
}

/// Compares two tool lists as JSON.
pub fn same_tools(a: &[Tool], b: &[Tool]) -> bool {
    let json = |t: &[Tool]| serde_json::to_value(t).unwrap_or(Value::Null);
    !a.is_empty() && json(a) == json(b)
}

/// Arguments as a JSON object (for callers that build their own requests).
pub fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}
