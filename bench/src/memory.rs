//! Memory: the shim's and the direct server's resident size after a session, and a real
//! broker's idle and with many open turns, from `/proc/<pid>/status` (VmRSS now, VmHWM peak).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::task::JoinSet;

use crate::procs::{self, Bins, BrokerProc, Mem, WAIT};

/// Control connections opening turns at once.
const OPENERS: usize = 8;
/// Calls each MCP server answers before its memory is read.
const CALLS_BEFORE_READING: usize = 100;

pub struct Memory {
    pub broker_idle: Mem,
    pub broker_turns: Mem,
    pub turns: usize,
    /// Time to open all the turns (over `OPENERS` connections).
    pub open_all: Duration,
    pub shim: Mem,
    pub direct: Mem,
    pub floors: Floors,
}

/// The floors under the shim's memory, measured through the same session as the shim (median
/// of [`FLOOR_SESSIONS`]): the relay (`relay`, std only, in front of a listening direct server),
/// what any process between a harness and a server costs; and `rmcp-floor`, the smallest rmcp
/// stdio server, built with the shim's profile.
#[derive(Clone, Copy)]
pub struct Floors {
    pub relay: Mem,
    pub rmcp: Mem,
}

/// Sessions per floor; their peaks vary by a few pages.
pub const FLOOR_SESSIONS: usize = 3;

pub async fn measure(bins: &Bins, data: &Path, turns: usize) -> anyhow::Result<Memory> {
    let broker = BrokerProc::start(bins, data, "always").await?;
    let result = with_broker(bins, data, &broker, turns).await;
    broker.stop().await?;
    result
}

async fn with_broker(
    bins: &Bins,
    data: &Path,
    broker: &BrokerProc,
    turns: usize,
) -> anyhow::Result<Memory> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let broker_idle = broker.memory()?;
    let started = Instant::now();
    let mut set = JoinSet::new();
    for o in 0..OPENERS {
        let runtime = broker.runtime.clone();
        let n = turns / OPENERS + usize::from(o < turns % OPENERS);
        set.spawn(async move {
            let mut host = sharedos_host::client::ControlClient::connect(&runtime).await?;
            let mut token = None;
            for _ in 0..n {
                let t = tokio::time::timeout(WAIT, procs::open_turn(&mut host, "alice"))
                    .await
                    .context("open_turn did not answer in time")??;
                token.get_or_insert(t.token);
            }
            anyhow::Ok(token)
        });
    }
    let mut token = None;
    while let Some(r) = set.join_next().await {
        if let Some(t) = r?? {
            token.get_or_insert(t);
        }
    }
    let open_all = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let broker_turns = broker.memory()?;
    let token = token.context("no turn was opened")?;
    let shim = session_memory(
        procs::shim_command(bins, &broker.bridge(), token.expose()),
        None,
    )
    .await?;
    let direct = session_memory(procs::direct_command(bins, data), None).await?;
    let floors = floors(bins, data).await?;
    Ok(Memory {
        broker_idle,
        broker_turns,
        turns,
        open_all,
        shim,
        direct,
        floors,
    })
}

/// The relay's and the rmcp floor's memory after the shim's session, each the median of
/// [`FLOOR_SESSIONS`] (by peak).
pub async fn floors(bins: &Bins, data: &Path) -> anyhow::Result<Floors> {
    let server = procs::DirectListener::start(bins, data).await?;
    let mut relay = Vec::with_capacity(FLOOR_SESSIONS);
    let mut rmcp = Vec::with_capacity(FLOOR_SESSIONS);
    let measured = async {
        for _ in 0..FLOOR_SESSIONS {
            relay.push(
                session_memory(procs::relay_command(bins, &server.socket, None), None).await?,
            );
            rmcp.push(session_memory(tokio::process::Command::new(&bins.rmcp_floor), None).await?);
        }
        anyhow::Ok(())
    }
    .await;
    server.stop().await?;
    measured?;
    Ok(Floors {
        relay: median_by_peak(relay),
        rmcp: median_by_peak(rmcp),
    })
}

/// The session whose peak is the median.
pub fn median_by_peak(mut mems: Vec<Mem>) -> Mem {
    mems.sort_unstable_by_key(|m| m.hwm_kib);
    mems.get(mems.len() / 2).copied().unwrap_or_default()
}

/// The shim's memory alone (`--shim-memory`): `sessions` shims one after another, each on the
/// same turn of one broker, as section 6 measures it. With `smaps`, each shim's
/// `/proc/<pid>/smaps` is saved there as `shim-<session>.smaps`.
pub async fn shim_only(
    bins: &Bins,
    data: &Path,
    sessions: usize,
    smaps: Option<&Path>,
) -> anyhow::Result<Vec<Mem>> {
    let broker = BrokerProc::start(bins, data, "always").await?;
    let result = async {
        let turn = broker.open_turn("alice").await?;
        let mut mems = Vec::with_capacity(sessions);
        for i in 0..sessions {
            let cmd = procs::shim_command(bins, &broker.bridge(), turn.token.expose());
            let file = smaps.map(|d| d.join(format!("shim-{i}.smaps")));
            mems.push(session_memory(cmd, file.as_deref()).await?);
        }
        anyhow::Ok(mems)
    }
    .await;
    broker.stop().await?;
    result
}

/// An MCP server's memory after initialize, tools/list and some reads; with `smaps`, its
/// `/proc/<pid>/smaps` at that moment is copied there.
async fn session_memory(cmd: tokio::process::Command, smaps: Option<&Path>) -> anyhow::Result<Mem> {
    let client = procs::spawn_client(cmd).await?;
    let result = tokio::time::timeout(WAIT, async {
        client.service.peer().list_all_tools().await?;
        let req = rmcp::model::CallToolRequestParams::new("files.read").with_arguments(
            crate::e2e::object(serde_json::json!({"path": procs::HELLO_PATH})),
        );
        for _ in 0..CALLS_BEFORE_READING {
            client.service.peer().call_tool(req.clone()).await?;
        }
        let pid = client.pid.context("the server has no pid")?;
        let mem = procs::memory(pid)?;
        if let Some(file) = smaps {
            let text = std::fs::read(format!("/proc/{pid}/smaps"))
                .with_context(|| format!("cannot read /proc/{pid}/smaps"))?;
            std::fs::write(file, text)
                .with_context(|| format!("cannot write `{}`", file.display()))?;
        }
        anyhow::Ok(mem)
    })
    .await
    .context("the session did not finish in time")
    .and_then(|r| r);
    client.stop().await?;
    result
}
