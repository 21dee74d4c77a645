//! Evidence that holds against the host it runs on: `records verify` says what a record without
//! a witness cannot prove, and with a witness (the checkpoints the broker appended to its
//! `witness_file` as it signed them) catches a cut at the end, a cut followed by a restart that
//! signed the shortened record, a rewrite re-signed with the stolen key, and deleted rotated
//! files. Real broker, real shims, the real CLI.

use std::path::{Path, PathBuf};

use ed25519_dalek::{Signer, SigningKey};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sharedos_proto::catalog::hex;

use crate::kit::{Options, Raw, TestBroker, bin, run};

/// `records verify --record R [args]`: (exit status, stdout, stderr).
async fn verify(record: &Path, args: &[&str]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["records", "verify", "--record"]).arg(record);
    cmd.args(args);
    run(cmd).await
}

/// One turn of alice's: a read let through, a read refused, closed.
async fn turn(broker: &TestBroker) {
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert!(r["result"].is_object(), "{r}");
    let r = raw
        .call(2, "files.read", json!({"path": "/private/secret.txt"}))
        .await;
    assert!(r["result"].is_object(), "{r}");
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("read record")
        .lines()
        .map(str::to_owned)
        .collect()
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").expect("write record");
}

fn seq_of(line: &str) -> u64 {
    serde_json::from_str::<Value>(line).expect("json")["seq"]
        .as_u64()
        .expect("seq")
}

fn is_checkpoint(line: &str) -> bool {
    line.contains("\"kind\":\"checkpoint\"")
}

/// A broker whose checkpoints are witnessed to a file outside the record's folder.
async fn witnessed(witness: &Path, more: &str) -> TestBroker {
    TestBroker::start(Options {
        top: format!("witness_file = {:?}\n{more}", witness.display().to_string()),
        ..Options::default()
    })
    .await
}

/// What an attacker holding the broker's uid does after rewriting a line: recompute every
/// later `prev` (SHA-256 needs no key) and re-sign every checkpoint with the stolen key.
fn rechain(lines: &mut [String], from: usize, key: &SigningKey) {
    let field = |line: &str, name: &str| -> Option<(usize, usize)> {
        let start = line.find(&format!("\"{name}\":\""))? + name.len() + 4;
        let end = start + line[start..].find('"')?;
        Some((start, end))
    };
    for i in from.max(1)..lines.len() {
        let prev = hex(&Sha256::digest(lines[i - 1].as_bytes()));
        let (s, e) = field(&lines[i], "prev").expect("a chained line");
        lines[i].replace_range(s..e, &prev);
        if is_checkpoint(&lines[i]) {
            let v: Value = serde_json::from_str(&lines[i]).expect("json");
            let message = sharedos_proto::record::checkpoint_message(
                v["seq"].as_u64().expect("seq"),
                &prev,
                v["at"].as_str().expect("at"),
                v["reason"].as_str().expect("reason"),
            );
            let signature = hex(&key.sign(&message).to_bytes());
            let (s, e) = field(&lines[i], "signature").expect("signature");
            lines[i].replace_range(s..e, &signature);
        }
    }
}

fn stolen_key(record: &Path) -> SigningKey {
    let text = std::fs::read_to_string(format!("{}.key", record.display())).expect("key");
    let text = text.trim();
    let mut seed = [0u8; 32];
    for (i, b) in seed.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex");
    }
    SigningKey::from_bytes(&seed)
}

#[tokio::test]
async fn a_witness_catches_cuts_at_the_end_and_a_rewrite_resigned_with_the_stolen_key() {
    let safe = tempfile::tempdir().expect("tmp");
    let witness = safe.path().join("witness.jsonl");
    let mut broker = witnessed(&witness, "").await;
    let record = broker.record_path();
    turn(&broker).await;
    // Running: the lines since this broker started are chained, not yet signed.
    let (code, out, err) = verify(&record, &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    let unsigned = lines(&record).len() as u64;
    assert!(
        out.contains("no checkpoint: none of the")
            && out.contains("cannot be detected")
            && out.contains(&format!("none of the {unsigned} chained lines")),
        "{out}"
    );
    broker.stop().await;
    broker.restart().await;
    turn(&broker).await;
    broker.stop().await;
    let original = lines(&record);
    let checkpoints: Vec<&String> = original.iter().filter(|l| is_checkpoint(l)).collect();
    assert_eq!(checkpoints.len(), 2, "one per shutdown");
    // The witness holds exactly the checkpoint lines, as written.
    let witnessed_lines = lines(&witness);
    assert_eq!(
        witnessed_lines.iter().collect::<Vec<_>>(),
        checkpoints,
        "the witness file holds each checkpoint line once, in order"
    );
    let first_cp = seq_of(checkpoints[0]);
    let last_cp = seq_of(checkpoints[1]);
    assert_eq!(last_cp, seq_of(original.last().expect("a line")));
    // A copy of the public key kept elsewhere, as the README advises.
    let public = safe.path().join("record.pub");
    std::fs::copy(format!("{}.key.pub", record.display()), &public).expect("copy pub");
    let public_s = public.display().to_string();
    let witness_s = witness.display().to_string();

    // Untouched: verifies with the witness.
    let (code, out, err) = verify(
        &record,
        &["--public-key", &public_s, "--witness", &witness_s],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 of its 2 checkpoints found"), "{out}");
    assert!(
        !err.contains("own folder"),
        "a key kept elsewhere is not warned about: {err}"
    );
    // `records checkpoint --json` prints the newest checkpoint: the witness's last line.
    let mut cmd = std::process::Command::new(bin("sharedos-broker"));
    cmd.args(["records", "checkpoint", "--json", "--record"])
        .arg(&record);
    let (code, out, _) = run(cmd).await;
    assert_eq!(code, 0);
    assert_eq!(out.trim(), witnessed_lines[1]);

    // The last 2 lines cut (the last checkpoint and what it signed): verifies without a
    // witness, broken with it, naming the witnessed seq.
    write_lines(&record, &original[..original.len() - 2]);
    let (code, out, err) = verify(&record, &["--public-key", &public_s]).await;
    assert_eq!(code, 0, "without a witness the cut is not seen: {out}{err}");
    assert!(
        out.contains(&format!(
            "after the last checkpoint (seq {first_cp}) are not signed"
        )),
        "{out}"
    );
    let (code, out, _) = verify(
        &record,
        &["--public-key", &public_s, "--witness", &witness_s],
    )
    .await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(&format!("BROKEN at seq {last_cp}")) && out.contains("were cut"),
        "{out}"
    );
    // Cut, and the broker restarted on the shortened record: its shutdown checkpoint signs it
    // (and is witnessed too: the checks after this one use the witness as it was before).
    let before = safe.path().join("witness-before.jsonl");
    std::fs::copy(&witness, &before).expect("copy witness");
    broker.restart().await;
    turn(&broker).await;
    broker.stop().await;
    let (code, out, _) = verify(&record, &["--public-key", &public_s]).await;
    assert_eq!(code, 0, "the next broker signed the cut record: {out}");
    let (code, out, _) = verify(
        &record,
        &["--public-key", &public_s, "--witness", &witness_s],
    )
    .await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(&format!("BROKEN at seq {last_cp}"))
            && out.contains("differs from the witnessed checkpoint"),
        "{out}"
    );
    assert_eq!(lines(&witness).len(), 3);
    let witness_s = before.display().to_string();

    // Everything from 3 lines before the first checkpoint cut: the record ends before it.
    let cp0 = original.iter().position(|l| is_checkpoint(l)).expect("cp");
    write_lines(&record, &original[..cp0 - 3]);
    let (code, out, _) = verify(&record, &["--witness", &witness_s]).await;
    assert_eq!(code, 3, "{out}");
    assert!(out.contains(&format!("BROKEN at seq {last_cp}")), "{out}");

    // A denied call rewritten to succeeded, the chain recomputed and every checkpoint re-signed
    // with the stolen key: the signatures verify, the witness does not.
    let mut forged = original.clone();
    let denied = forged
        .iter()
        .position(|l| l.contains("\"kind\":\"call\"") && l.contains("\"outcome\":\"denied\""))
        .expect("a denied call");
    assert!(denied < cp0);
    forged[denied] = forged[denied].replace("\"outcome\":\"denied\"", "\"outcome\":\"succeeded\"");
    rechain(&mut forged, denied + 1, &stolen_key(&record));
    write_lines(&record, &forged);
    let (code, out, _) = verify(&record, &["--public-key", &public_s]).await;
    assert_eq!(code, 0, "re-signed with the stolen key: {out}");
    let (code, out, _) = verify(
        &record,
        &["--public-key", &public_s, "--witness", &witness_s],
    )
    .await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(&format!(
            "BROKEN at seq {first_cp}: seq {first_cp} differs from the witnessed checkpoint"
        )),
        "the first witnessed checkpoint that differs: {out}"
    );

    // Without a witness, no checkpoint at all: with --public-key, not verified.
    let made_up: Vec<String> = original[..cp0.min(5)].to_vec();
    write_lines(&record, &made_up);
    let (code, out, _) = verify(&record, &["--public-key", &public_s]).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("NOT VERIFIED") && out.contains("no checkpoint"),
        "{out}"
    );
    let (code, out, _) = verify(&record, &[]).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "none of the {} chained lines is signed",
            made_up.len()
        )),
        "{out}"
    );

    // The key from the record's own folder: warned, by default and when named.
    write_lines(&record, &original);
    let (code, out, err) = verify(&record, &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("lies in the record's own folder"), "{err}");
    let beside = format!("{}.key.pub", record.display());
    let (code, _, err) = verify(&record, &["--public-key", &beside]).await;
    assert_eq!(code, 0);
    assert!(err.contains("lies in the record's own folder"), "{err}");
    let (code, out, err) = verify(&record, &["--json", "--public-key", &public_s]).await;
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["keyInRecordFolder"], false);
    assert_eq!(v["unsignedTail"], 0);
}

#[tokio::test]
async fn with_a_witness_deleting_the_newest_rotated_files_is_broken() {
    let safe = tempfile::tempdir().expect("tmp");
    let witness = safe.path().join("witness.jsonl");
    let mut broker = witnessed(&witness, "record_rotate_bytes = 1500\n").await;
    let record = broker.record_path();
    for _ in 0..4 {
        turn(&broker).await;
    }
    broker.stop().await;
    let files = sharedos_broker::record::record_files(&record).expect("files");
    assert!(files.len() >= 3, "{files:?}");
    let witness_s = witness.display().to_string();
    let (code, out, _) = verify(&record, &["--witness", &witness_s]).await;
    assert_eq!(code, 0, "{out}");
    let newest_witnessed = lines(&witness)
        .last()
        .map(|l| seq_of(l))
        .expect("witnessed");
    // The active file and the newest rotated file deleted: the rest still chains and verifies
    // on its own, but not against the witness.
    std::fs::remove_file(&record).expect("rm active");
    let rotated: Vec<PathBuf> = files[..files.len() - 1].to_vec();
    std::fs::remove_file(rotated.last().expect("rotated")).expect("rm newest rotated");
    let (code, out, _) = verify(&record, &[]).await;
    assert_eq!(code, 0, "without a witness the cut is not seen: {out}");
    let (code, out, _) = verify(&record, &["--witness", &witness_s]).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(&format!("BROKEN at seq {newest_witnessed}")) && out.contains("were cut"),
        "{out}"
    );
}

/// The witness stats of a running broker (`telemetry`).
async fn witness_counts(broker: &TestBroker) -> sharedos_proto::ipc::WitnessCounts {
    use sharedos_proto::ipc::{ControlRequest, ControlResponse};
    match broker.host().await.call(&ControlRequest::Telemetry).await {
        Ok(ControlResponse::Telemetry(s)) => s.witness,
        other => panic!("unexpected {other:?}"),
    }
}

/// The mean latency of `n` reads through one shim, after a first call.
async fn mean_call_latency(broker: &TestBroker, n: i64) -> std::time::Duration {
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    raw.call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    let start = std::time::Instant::now();
    for id in 2..2 + n {
        let r = raw
            .call(id, "files.read", json!({"path": "/public/hello.txt"}))
            .await;
        assert!(r["result"].is_object(), "{r}");
    }
    let mean = start.elapsed() / n as u32;
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    mean
}

#[tokio::test]
async fn a_witness_command_that_fails_or_hangs_does_not_slow_calls_and_is_counted() {
    // Rotation every ~1.5 KiB: a checkpoint (and a witness run) every few calls.
    let rotate = "record_rotate_bytes = 1500\n";
    let plain = TestBroker::start(Options {
        top: rotate.into(),
        ..Options::default()
    })
    .await;
    let hanging = TestBroker::start(Options {
        top: format!("{rotate}witness_command = [\"/bin/sh\", \"-c\", \"sleep 60\"]\n"),
        ..Options::default()
    })
    .await;
    let failing = TestBroker::start(Options {
        top: format!(
            "{rotate}witness_command = [\"/bin/sh\", \"-c\", \"cat >/dev/null; exit 1\"]\n"
        ),
        ..Options::default()
    })
    .await;
    let n = 40;
    let without = mean_call_latency(&plain, n).await;
    let with_hang = mean_call_latency(&hanging, n).await;
    let with_fail = mean_call_latency(&failing, n).await;
    eprintln!(
        "mean call latency: no witness {without:?}, hanging witness_command {with_hang:?}, failing {with_fail:?}"
    );
    let hung = witness_counts(&hanging).await;
    assert!(
        hung.enabled && hung.queued >= 2,
        "checkpoints were handed on: {hung:?}"
    );
    assert_eq!(hung.witnessed, 0, "{hung:?}");
    // Calls answered while the command hung: no slower than without a witness (with room
    // for a loaded machine), and far from the command's 10 s timeout.
    for (what, d) in [("hanging", with_hang), ("failing", with_fail)] {
        assert!(
            d < without * 3 + std::time::Duration::from_millis(20),
            "{what} witness_command slowed calls: {d:?} vs {without:?}"
        );
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let f = witness_counts(&failing).await;
        let h = witness_counts(&hanging).await;
        if f.failed >= f.queued && f.queued >= 2 && h.failed >= 1 {
            assert_eq!(f.witnessed, 0, "{f:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "failures not counted: failing {f:?}, hanging {h:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn ten_thousand_bad_tokens_leave_a_few_counted_lines() {
    use sharedos_proto::ipc::{BridgeEvent, BridgeRequest, PROTOCOL_VERSION, ShimInfo, TurnToken};
    let mut broker = TestBroker::start(Options::default()).await;
    let record = broker.record_path();
    let before = std::fs::metadata(&record).expect("record").len();
    let n = 10_000u64;
    let start = std::time::Instant::now();
    for _ in 0..n {
        let stream = sharedos_ipc::connect(&broker.bridge())
            .await
            .expect("connect");
        let (r, mut w) = tokio::io::split(stream);
        let mut reader = sharedos_ipc::FrameReader::new(r);
        sharedos_ipc::write_frame(
            &mut w,
            &BridgeRequest::Hello {
                protocol: PROTOCOL_VERSION,
                token: TurnToken::new("not-a-token".to_owned()),
                client: ShimInfo::default(),
            },
        )
        .await
        .expect("hello");
        let answer = reader.next::<BridgeEvent>().await.expect("answer");
        assert!(matches!(answer, BridgeEvent::Refused { .. }), "{answer:?}");
    }
    let elapsed = start.elapsed();
    broker.stop().await;
    let grown = std::fs::metadata(&record).expect("record").len() - before;
    let refused: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "bridge_refused")
        .collect();
    eprintln!(
        "{n} bad-token connections in {elapsed:?}: {} bridge_refused lines, record grew {grown} bytes",
        refused.len()
    );
    let total: u64 = refused
        .iter()
        .map(|l| l["count"].as_u64().expect("count"))
        .sum();
    assert_eq!(total, n, "{refused:?}");
    for l in &refused {
        assert_eq!(l["reason"], "bad_token", "{l}");
        assert_eq!(l["pid"], std::process::id(), "{l}");
        assert_eq!(l["uid"], rustix::process::geteuid().as_raw(), "{l}");
    }
    // One at the first refusal, then at most one per interval, and the rest at shutdown.
    let interval = sharedos_broker::admission::REFUSAL_RECORD_INTERVAL;
    let most = 2 + (elapsed.as_secs_f64() / interval.as_secs_f64()).ceil() as usize;
    assert!(
        refused.len() <= most,
        "{} lines, at most {most}",
        refused.len()
    );
    assert!(grown < 10 * 1024, "the record grew {grown} bytes");
}

#[tokio::test]
async fn a_line_on_the_shims_stdin_that_is_not_json_is_on_record() {
    let broker = TestBroker::start(Options::default()).await;
    let alice = broker.open_turn("alice").await;
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    let junk = b"this is { not json";
    raw.send_raw(junk).await;
    let answer = raw.recv().await;
    assert_eq!(answer["error"]["code"], -32700, "{answer}");
    // A call after it: the shim still serves, and the report went before it on the bridge.
    let r = raw
        .call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    assert!(r["result"].is_object(), "{r}");
    crate::kit::eventually("a malformed_frame line", || {
        broker
            .records()
            .iter()
            .any(|l| l["kind"] == "malformed_frame")
    })
    .await;
    drop(raw.close_stdin().await);
    broker.close_turn(&alice.turn).await;
    let lines: Vec<Value> = broker
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "malformed_frame")
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["turn"], alice.turn.as_str());
    assert_eq!(lines[0]["bytes"], junk.len());
    assert_eq!(lines[0]["sha256"], hex(&Sha256::digest(junk)));
    assert_eq!(lines[0]["count"], 1);
}
