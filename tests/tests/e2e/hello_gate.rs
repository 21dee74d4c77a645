//! The places before hello are shared by uid and by process (issue 31, item 5), with real
//! processes: a broker (root), a flood of idle connections from another uid (`setpriv`) or from
//! another process of the harness's own uid, and real shims of a victim turn.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use crate::kit::{Raw, bin};
use crate::races::Served;

/// In the harness group and listed in `harness_uids`: another harness's uid, the attacker.
const ATTACKER_UID: u32 = 64111;
const HARNESS_GID: u32 = 64110;
/// Flooding processes, and the connections each keeps open without a hello.
const FLOOD_PROCESSES: usize = 20;
const FLOOD_PER_PROCESS: usize = 16;
/// Real shims of the victim turn, started one after another while the flood runs.
const SHIMS: usize = 38;
/// Each shim gets its welcome (its `initialize` is answered) within this.
const WELCOME_WITHIN: Duration = Duration::from_secs(2);

/// `procs` processes, each keeping `per` connections to `bridge.sock` that never say hello (a
/// closed one is opened again at once, as the hello timeout drops them; with `renew` > 0 each is
/// also closed and opened again after `renew` seconds, so that none is ever idle long), for
/// `secs` seconds; each process prints how many connections it made.
const FLOOD: &str = r#"
import os, select, socket, sys, time
path, procs, per, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
renew = float(sys.argv[5])
def child():
    end = time.time() + secs
    conns, made, opened = [], 0, {}
    while time.time() < end:
        if renew > 0:
            for s in [s for s in conns if time.time() - opened[s] >= renew]:
                conns.remove(s)
                s.close()
        while len(conns) < per:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
            except OSError:
                s.close()
                time.sleep(0.01)
                break
            conns.append(s)
            opened[s] = time.time()
            made += 1
        r, _, _ = select.select(conns, [], [], 0.05)
        for s in r:
            # A refusal or the end: the broker is done with it.
            try:
                s.recv(65536)
            except OSError:
                pass
            conns.remove(s)
            s.close()
    os.write(1, ("%d\n" % made).encode())
    os._exit(0)
kids = []
for _ in range(procs):
    pid = os.fork()
    if pid == 0:
        child()
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
"#;

/// How the flood's processes run.
enum Flooder {
    OtherUid,
    OwnUid,
}

/// The flood's shape: processes, connections each, and the age at which each is renewed (zero:
/// kept until the broker drops it).
#[derive(Clone, Copy)]
struct Shape {
    procs: usize,
    per: usize,
    renew: Duration,
}

/// 20 x 16 idle connections, kept until dropped.
const WIDE: Shape = Shape {
    procs: FLOOD_PROCESSES,
    per: FLOOD_PER_PROCESS,
    renew: Duration::ZERO,
};

/// 256 processes with one connection each, each renewed every 500 ms: every process holds as
/// few places as any newcomer's, and no place is ever silent for `HELLO_IDLE_EVICTABLE` (1 s).
const RENEWED: Shape = Shape {
    procs: 256,
    per: 1,
    renew: Duration::from_millis(500),
};

/// Runs the flood for its time, and real shims of a victim turn while it holds the gate:
/// (connections the flood made, each shim's time to welcome).
async fn flood_and_shims(b: &Served, who: Flooder, shape: Shape) -> (u64, Vec<Duration>) {
    let script = b.path("flood.py");
    std::fs::write(&script, FLOOD).expect("script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let secs = 16;
    let mut cmd = match who {
        Flooder::OtherUid => {
            let mut c = tokio::process::Command::new("setpriv");
            c.arg(format!("--reuid={ATTACKER_UID}"))
                .arg(format!("--regid={HARNESS_GID}"))
                .arg("--clear-groups")
                .arg("/usr/bin/python3");
            c
        }
        Flooder::OwnUid => tokio::process::Command::new("/usr/bin/python3"),
    };
    cmd.arg(&script)
        .arg(b.run_dir.join("bridge.sock"))
        .arg(shape.procs.to_string())
        .arg(shape.per.to_string())
        .arg(secs.to_string())
        .arg(shape.renew.as_secs_f64().to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    let flood = cmd.spawn().expect("flood");
    // Let the flood fill the gate and go through a hello timeout (3 s) and its refill.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (_, token) = b.open_turn().await;
    let mut times = Vec::new();
    for _ in 0..SHIMS {
        let mut c = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        c.env("SHAREDOS_TURN_TOKEN", &token)
            .env("SHAREDOS_BROKER", b.run_dir.join("bridge.sock"))
            .kill_on_drop(true);
        let started = Instant::now();
        let mut raw = Raw::spawn(c);
        raw.send(
            serde_json::json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "victim", "version": "1"}}}),
        )
        .await;
        // The shim answers `initialize` once the broker has welcomed it; a shim kept out
        // exits (its stdout ends) or stays silent.
        let welcomed = tokio::time::timeout(Duration::from_secs(10), raw.next_line()).await;
        let took = started.elapsed();
        let line = match welcomed {
            Ok(Some(l)) => l,
            _ => String::new(),
        };
        let ok = serde_json::from_str::<serde_json::Value>(&line)
            .is_ok_and(|v| v["result"]["serverInfo"].is_object());
        if !ok {
            eprintln!("a shim was not welcomed ({took:?}): {line:?}");
        }
        let took = if ok { took } else { Duration::MAX };
        times.push(took);
        drop(raw);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = tokio::time::timeout(Duration::from_secs(secs + 20), flood.wait_with_output())
        .await
        .expect("flood ends")
        .expect("flood");
    let made = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse::<u64>().ok())
        .sum();
    (made, times)
}

fn is_root() -> bool {
    sharedos_ipc::runtime::current_uid() == 0
}

async fn victim_shims_get_in(who: Flooder, shape: Shape, name: &str) {
    if !is_root() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{name} needs root (CI runs as root)"
        );
        eprintln!("SKIPPED {name}: needs root to run processes under other uids");
        return;
    }
    let b = Served::start_with(
        &[],
        &format!(
            "call_timeout_seconds = 10\nharness_group = {HARNESS_GID}\nharness_uids = [0, {ATTACKER_UID}]\nmax_bridges_per_turn = 64"
        ),
    )
    .await;
    // The attacker's uid must reach bridge.sock (the broker makes run/ 0710 for the group).
    std::fs::set_permissions(b.path(""), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let (made, times) = flood_and_shims(&b, who, shape).await;
    let within = times.iter().filter(|t| **t < WELCOME_WITHIN).count();
    let worst = times.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{name}: the flood ({} x {}, renewed after {:?}) made {made} connections; {within} of {SHIMS} shims welcomed within {WELCOME_WITHIN:?}, the slowest in {worst:?}",
        shape.procs, shape.per, shape.renew
    );
    assert!(
        made >= (shape.procs * shape.per) as u64,
        "the flood made only {made} connections"
    );
    assert_eq!(within, SHIMS, "times to welcome: {times:?}");
}

/// Another local user (a harness uid of its own, in the harness group) keeps 20 x 16 idle
/// connections to `bridge.sock`, refilled as they are dropped: each of 38 real shims of the
/// victim's turn (the broker's uid), started 200 ms apart, gets its welcome within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (processes under other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn another_uids_idle_connections_keep_no_shim_out() {
    victim_shims_get_in(
        Flooder::OtherUid,
        WIDE,
        "another_uids_idle_connections_keep_no_shim_out",
    )
    .await;
}

/// The same flood from other processes of the harness's own uid: the places are shared by
/// process within a uid, so each of the 38 shims still gets its welcome within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (the broker serves a listed harness group): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn the_same_uids_idle_connections_keep_no_shim_out() {
    victim_shims_get_in(
        Flooder::OwnUid,
        WIDE,
        "the_same_uids_idle_connections_keep_no_shim_out",
    )
    .await;
}

/// 256 processes of the harness's own uid, one connection each, renewed every 500 ms: no place
/// can be taken by sharing (every process holds one) or for idleness (none waits 1 s), so the
/// gate is full for good; a shim still gets a place in the fast lane, says hello at once and
/// is welcomed: each of the 38 within 2 s. (Renewals also reach the lane, which turns over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (the broker serves a listed harness group): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn the_same_uids_renewed_single_connections_keep_no_shim_out() {
    victim_shims_get_in(
        Flooder::OwnUid,
        RENEWED,
        "the_same_uids_renewed_single_connections_keep_no_shim_out",
    )
    .await;
}
