//! A bridge whose client goes away (issue 31, item 10), with a real broker process: the calls it
//! sent and never saw answered do not run after it closed, and the broker's CPU goes back to idle.

use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

use crate::kit::eventually;
use crate::races::{Served, record_texts};

/// Calls written before the close.
const CALLS: u64 = 271;
/// Calls a bridge runs at once (`bridge::MAX_INFLIGHT_PER_BRIDGE`).
const IN_FLIGHT: usize = 8;

/// Microseconds since the epoch of an RFC 3339 UTC time as the record writes it
/// (`2026-12-05T08:46:43.227585Z`).
fn micros(at: &str) -> i64 {
    let (date, time) = at
        .trim_end_matches('Z')
        .split_once('T')
        .expect("date and time");
    let d: Vec<i64> = date.split('-').map(|x| x.parse().expect("date")).collect();
    let (clock, frac) = time.split_once('.').unwrap_or((time, "0"));
    let t: Vec<i64> = clock.split(':').map(|x| x.parse().expect("time")).collect();
    let frac_us: i64 = format!("{frac:0<6}")[..6].parse().expect("fraction");
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y, m) = if d[1] <= 2 {
        (d[0] - 1, d[1] + 9)
    } else {
        (d[0], d[1] - 3)
    };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + d[2] - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 86_400 + t[0] * 3600 + t[1] * 60 + t[2]) * 1_000_000) + frac_us
}

/// CPU time the process has used (user + system), in clock ticks, from `/proc/<pid>/stat`.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

/// 271 `files.search` calls over a 3,000-file tree written on a raw bridge, which is then closed:
/// every call is recorded once; at most the 8 a bridge runs at once ran at all (cancelled
/// `disconnected` when the close was seen, or finished before); every other is
/// `cancelled/client_gone` ("it was not run"), so no call started after the broker saw the close.
/// The broker's CPU is back to idle within a second of the close: under 0.1 s of CPU in the next
/// second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_bridges_unread_calls_never_run() {
    use sharedos_ipc::write_frame;
    use sharedos_proto::ipc::BridgeRequest;
    let b = Served::start(&[]).await;
    let tree = b.path("data/public/tree");
    for d in 0..30 {
        let dir = tree.join(format!("d{d}"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..100 {
            std::fs::write(
                dir.join(format!("f{f}.txt")),
                "some text that never matches\n".repeat(20),
            )
            .expect("w");
        }
    }
    let (turn, token) = b.open_turn().await;
    let (reader, mut w) = b.raw_bridge(&token).await;
    let search = |id| BridgeRequest::Call {
        id,
        call: sharedos_proto::ToolCall {
            tool: "files.search".into(),
            arguments: Some(json!({"path": "/public/tree", "query": "zzz-nowhere"})),
            request_id: Some(id.to_string()),
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        },
    };
    let cpu_before = cpu_ticks(b.pid());
    for id in 0..CALLS {
        write_frame(&mut w, &search(id)).await.expect("call");
    }
    drop(w);
    drop(reader);
    let closed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("now")
        .as_micros() as i64;
    let closed_at = Instant::now();
    let calls = || -> Vec<Value> {
        record_texts(&b.path("record.jsonl"))
            .iter()
            .flat_map(|t| t.lines())
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["kind"] == "call" && v["turn"] == turn.as_str())
            .collect()
    };
    eventually("every call recorded", || calls().len() as u64 >= CALLS).await;
    let recorded_in = closed_at.elapsed();
    // CPU: back to idle within a second of the close.
    let idle_from = closed_at + Duration::from_secs(1);
    tokio::time::sleep(idle_from.saturating_duration_since(Instant::now())).await;
    let cpu_at_1s = cpu_ticks(b.pid());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu_at_2s = cpu_ticks(b.pid());
    let calls = calls();
    let mut by_code = std::collections::BTreeMap::<String, usize>::new();
    let mut ran = 0;
    let mut running_at_close = 0;
    let mut started_after_close = Vec::new();
    for c in &calls {
        let code = format!(
            "{}/{}",
            c["outcome"].as_str().unwrap_or(""),
            c["code"].as_str().unwrap_or("")
        );
        *by_code.entry(code.clone()).or_default() += 1;
        if code == "cancelled/client_gone" {
            assert!(
                c["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("it was not run"),
                "{c}"
            );
            continue;
        }
        ran += 1;
        let end = micros(c["at"].as_str().expect("at"));
        let start = end - c["duration_us"].as_i64().unwrap_or(0);
        if start > closed {
            started_after_close.push(c.clone());
        }
        if end > closed {
            running_at_close += 1;
        }
    }
    let hz = 100;
    eprintln!(
        "{CALLS} calls written then closed: {} recorded in {recorded_in:?} ({by_code:?}); {ran} ran, {running_at_close} of them ending after the close and {} starting after it by the record's clock; broker CPU {} ticks (1/{hz} s) from the first call to 1 s after the close, {} ticks in the second after that",
        calls.len(),
        started_after_close.len(),
        cpu_at_1s - cpu_before,
        cpu_at_2s - cpu_at_1s,
    );
    assert_eq!(calls.len() as u64, CALLS, "each call recorded once");
    // At most the calls in flight when the broker saw the close ran at all; every later one
    // was recorded without running. (The record's `at` is when a line is written, so the clock
    // comparison above is printed, not asserted.)
    assert!(ran <= IN_FLIGHT, "{ran} calls ran: {calls:?}");
    let gone = by_code.get("cancelled/client_gone").copied().unwrap_or(0);
    assert_eq!(gone, calls.len() - ran);
    assert!(
        gone as u64 >= CALLS - ran as u64 && gone > 0,
        "client_gone: {gone}"
    );
    assert!(
        cpu_at_2s - cpu_at_1s < 10,
        "the broker used {} ticks in the second after it should be idle",
        cpu_at_2s - cpu_at_1s
    );
}
