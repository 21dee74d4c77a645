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

/// A witness poisoned (a forged checkpoint line appended, unsigned by the key) and carried
/// through a JSON pipeline (every genuine line re-serialized by Python with sorted keys and
/// other spacing): with the trusted key, the genuine record verifies and the forged line is
/// named and skipped; without it, the conflict fails closed and says which line the record
/// matches.
#[tokio::test]
async fn a_forged_witness_line_is_named_and_skipped_and_re_serialized_checkpoints_match() {
    let safe = tempfile::tempdir().expect("tmp");
    let witness = safe.path().join("witness.jsonl");
    let mut broker = witnessed(&witness, "").await;
    let record = broker.record_path();
    turn(&broker).await;
    broker.stop().await;
    broker.restart().await;
    turn(&broker).await;
    broker.stop().await;
    let genuine = lines(&witness);
    assert_eq!(genuine.len(), 2, "one checkpoint per shutdown: {genuine:?}");
    let first_cp = seq_of(&genuine[0]);
    // Re-serialized by another program: sorted keys, other separators, one object a line.
    let carried = safe.path().join("carried.jsonl");
    let script = r#"
import json, sys
out = open(sys.argv[2], "w")
for l in open(sys.argv[1]):
    out.write(json.dumps(json.loads(l), sort_keys=True, separators=(" ,  ", " : ")) + "\n")
"#;
    let mut cmd = std::process::Command::new("python3");
    cmd.args(["-c", script]).arg(&witness).arg(&carried);
    let (code, out, err) = run(cmd).await;
    assert_eq!(code, 0, "{out}{err}");
    let mut carried_lines = lines(&carried);
    assert_eq!(carried_lines.len(), 2);
    for (c, g) in carried_lines.iter().zip(&genuine) {
        assert_ne!(c, g, "re-serialized: other bytes");
        assert_eq!(seq_of(c), seq_of(g));
    }
    // Forged: the first checkpoint with another time, its signature kept (no longer valid).
    let mut forged: Value = serde_json::from_str(&genuine[0]).expect("json");
    forged["at"] = json!("2020-01-01T00:00:00.000Z");
    carried_lines.push(forged.to_string());
    write_lines(&carried, &carried_lines);
    let public = safe.path().join("record.pub");
    std::fs::copy(format!("{}.key.pub", record.display()), &public).expect("copy pub");
    let public_s = public.display().to_string();
    let carried_s = carried.display().to_string();

    let (code, out, err) = verify(
        &record,
        &["--public-key", &public_s, "--witness", &carried_s],
    )
    .await;
    assert_eq!(code, 0, "the genuine record verifies: {out}{err}");
    assert!(out.contains("2 of its 2 checkpoints found"), "{out}");
    assert!(out.contains(": 1 skipped"), "{out}");
    assert!(
        out.contains(&format!(
            "skipped witness line 3: the checkpoint at seq {first_cp}: its signature does not verify under the trusted key"
        )),
        "the forged line is named: {out}"
    );
    let (code, out, err) = verify(
        &record,
        &["--json", "--public-key", &public_s, "--witness", &carried_s],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["witnessChecked"], true);
    assert_eq!(v["witnessSkipped"], 1);
    assert_eq!(v["witnessSkippedLines"][0]["line"], 3);
    assert_eq!(v["witnessed"], 2);

    // Without a trusted key the forged line cannot be told apart: fail closed, saying which
    // line the record matches and what to pass.
    let (code, out, _) = verify(&record, &["--witness", &carried_s]).await;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(&format!(
            "BROKEN at seq {first_cp}: the witness holds 2 different checkpoints at seq {first_cp}"
        )) && out.contains("the record's line matches witness line 1")
            && out.contains("not checked against a key"),
        "{out}"
    );
    // Without the forged line and without a key, the re-serialized witness still matches.
    write_lines(&carried, &carried_lines[..2]);
    let (code, out, _) = verify(&record, &["--witness", &carried_s]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("2 of its 2 checkpoints found"), "{out}");
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
    let files = sharedos_broker::evidence::record::record_files(&record).expect("files");
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

/// `witness_command` under a broker whose environment holds a secret
/// (`OTEL_EXPORTER_OTLP_HEADERS`): the command sees only `PATH`, `LANG`, `HOME` and what
/// `witness_env` declares; it leaves a `sleep` child and hangs, and at its timeout (1 s here)
/// its whole process group is killed, the child with it.
#[tokio::test]
async fn a_witness_command_gets_only_its_declared_env_and_its_children_die_with_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let env_file = dir.path().join("env.txt");
    let pid_file = dir.path().join("child.pid");
    let script = format!(
        "tr '\\0' '\\n' < /proc/$$/environ > {env}; sleep 300 & [ -e {pid} ] || echo $! > {pid}; wait",
        env = env_file.display(),
        pid = pid_file.display()
    );
    let config = crate::kit::write_config(
        dir.path(),
        &Options {
            top: format!(
                "witness_command = [\"/bin/sh\", \"-c\", {script:?}]\n\
                 witness_env = {{ WITNESS_TOKEN = \"declared\" }}\n\
                 witness_command_timeout_seconds = 1\n\
                 record_rotate_bytes = 1000\n"
            ),
            ..Options::default()
        },
    );
    let run_dir = dir.path().join("run");
    let mut serve = tokio::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(&run_dir)
        .arg("--config")
        .arg(&config)
        .env(
            "OTEL_EXPORTER_OTLP_HEADERS",
            "authorization=Bearer broker-secret",
        )
        .env("SHAREDOS_CANARY", "broker-only")
        .kill_on_drop(true)
        .stderr(std::process::Stdio::null());
    let mut broker = serve.spawn().expect("serve");
    crate::kit::eventually("the broker serves", || {
        sharedos_ipc::runtime::bridge_socket(&run_dir).exists()
    })
    .await;
    // Turns opened until the record rotates: its rotation checkpoint is witnessed.
    let ran = || {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.trim().parse::<u32>().is_ok())
            && std::fs::read_to_string(&env_file).is_ok_and(|e| e.contains("PATH="))
    };
    let mut turns = 0;
    while !ran() {
        assert!(turns < 40, "no witness run after {turns} turns");
        let mut open = std::process::Command::new(bin("sharedos-broker"));
        open.args(["turn", "open", "--principal", "alice", "--runtime-dir"])
            .arg(&run_dir);
        let (code, _, err) = run(open).await;
        assert_eq!(code, 0, "{err}");
        turns += 1;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .expect("pid")
        .trim()
        .parse()
        .expect("a pid");
    let mut env: Vec<String> = std::fs::read_to_string(&env_file)
        .expect("env")
        .lines()
        .map(str::to_owned)
        .collect();
    env.sort();
    assert_eq!(
        env,
        [
            "HOME=/nonexistent",
            "LANG=C.UTF-8",
            "PATH=/usr/local/bin:/usr/bin:/bin",
            "WITNESS_TOKEN=declared",
        ],
        "only the declared environment"
    );
    // The sleeping child: gone (or dead, not yet reaped) once the 1 s timeout killed the group,
    // long before its 300 s.
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
        })
    };
    let started = std::time::Instant::now();
    while alive(pid) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the witness command's child {pid} outlived the command's timeout"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Counted as failed (timed out), never witnessed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let mut telemetry = std::process::Command::new(bin("sharedos-broker"));
        telemetry.args(["telemetry", "--runtime-dir"]).arg(&run_dir);
        let (code, out, err) = run(telemetry).await;
        assert_eq!(code, 0, "{err}");
        if out.contains(" 0 witnessed, ") && !out.contains(" 0 failed") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not counted: {out}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    broker.start_kill().expect("kill");
    let _ = broker.wait().await;
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
