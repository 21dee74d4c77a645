//! Security properties through real processes: the bearer token never leaks, the peer uid is
//! checked on both sockets, and nothing a shim sends can widen its turn.

use serde_json::{Value, json};
use sharedos_ipc::{FrameReader, write_frame};
use sharedos_proto::ToolCall;
use sharedos_proto::ipc::{
    BridgeEvent, BridgeRequest, ControlRequest, ControlResponse, PROTOCOL_VERSION, ShimInfo,
};

use crate::kit::{Options, Raw, TestBroker, bin, eventually, meta, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_never_in_logs_records_errors_or_turn_list() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = crate::kit::write_config(dir.path(), &Options::default());
    let run_dir = dir.path().join("run");
    let broker_log = dir.path().join("broker.log");
    let mut serve = tokio::process::Command::new(bin("sharedos-broker"));
    serve
        .args(["serve", "--runtime-dir"])
        .arg(&run_dir)
        .arg("--config")
        .arg(&cfg)
        .arg("--log-file")
        .arg(&broker_log)
        .env("SHAREDOS_LOG", "trace")
        .kill_on_drop(true)
        .stderr(std::fs::File::create(dir.path().join("broker.stderr")).expect("stderr"));
    let mut broker = serve.spawn().expect("serve");
    let record = dir.path().join("record.jsonl");
    let control = run_dir.join("control.sock");
    eventually("broker started", || {
        control.exists() && std::fs::read_to_string(&record).is_ok_and(|t| !t.is_empty())
    })
    .await;
    let cli = |args: &[&str]| {
        let mut c = std::process::Command::new(bin("sharedos-broker"));
        c.args(args).arg("--runtime-dir").arg(&run_dir);
        c
    };
    let (code, out, err) = run(cli(&["turn", "open", "--principal", "alice", "--json"])).await;
    assert_eq!(code, 0, "turn open: {err}");
    let opened: Value = serde_json::from_str(&out).expect("json");
    let token = opened["token"].as_str().expect("token").to_owned();
    let turn = opened["turn"].as_str().expect("turn").to_owned();
    let shim_log = dir.path().join("shim.log");
    let mut c = tokio::process::Command::new(bin("sharedos-mcp-shim"));
    c.env("SHAREDOS_TURN_TOKEN", &token)
        .env("SHAREDOS_BROKER", run_dir.join("bridge.sock"))
        .env("SHAREDOS_LOG", "trace")
        .arg("--log-file")
        .arg(&shim_log)
        .kill_on_drop(true);
    let mut raw = Raw::spawn(c);
    raw.initialize("2025-06-18").await;
    raw.call(1, "files.read", json!({"path": "/public/hello.txt"}))
        .await;
    raw.call(2, "files.read", json!({"path": "/private/secret.txt"}))
        .await;
    // A near miss of the token: refused, and the message does not echo it.
    let mut bad = std::process::Command::new(bin("sharedos-mcp-shim"));
    bad.env("SHAREDOS_TURN_TOKEN", format!("{token}x"))
        .env("SHAREDOS_BROKER", run_dir.join("bridge.sock"));
    let (code, _, bad_err) = run(bad).await;
    assert_eq!(code, 2);
    let (_, list, list_err) = run(cli(&["turn", "list", "--json"])).await;
    let (_, records, _) = run(cli(&["records", "--json"])).await;
    let (_, _, close_err) = run(cli(&["turn", "close", &turn])).await;
    assert_eq!(raw.exit_code().await, Some(3));
    broker.start_kill().expect("stop");
    let _ = broker.wait().await;
    let mut places = vec![
        ("turn list", list + &list_err),
        ("records", records),
        ("rejected shim stderr", bad_err),
        ("turn close", close_err),
    ];
    for f in [
        &broker_log,
        &shim_log,
        &record,
        &dir.path().join("broker.stderr"),
    ] {
        places.push(("file", std::fs::read_to_string(f).unwrap_or_default()));
    }
    assert!(
        std::fs::read_to_string(&broker_log).expect("log").len() > 100,
        "the broker logged at trace level"
    );
    for (what, text) in places {
        assert!(!text.contains(&token), "the token leaked into {what}");
        assert!(
            !text.contains(&token[..20]),
            "a prefix of the token leaked into {what}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_that_is_not_listed_is_refused_on_both_sockets() {
    let broker = TestBroker::start(Options::default()).await;
    let turn = broker.open_turn("alice").await;
    let cfg = std::fs::read_to_string(&broker.config_path).expect("cfg");
    // Only uid 4242 may use each socket; this test runs as another uid, so the check refuses it.
    std::fs::write(
        &broker.config_path,
        format!("host_uids = [4242]\nharness_uids = [4242]\n{cfg}"),
    )
    .expect("w");
    let mut broker = broker;
    broker.restart().await;
    let mut shim = std::process::Command::new(bin("sharedos-mcp-shim"));
    shim.env("SHAREDOS_TURN_TOKEN", turn.token.expose())
        .env("SHAREDOS_BROKER", broker.bridge());
    let (code, _, err) = run(shim).await;
    assert_eq!(code, 2);
    assert!(
        err.contains("this uid may not use the bridge socket"),
        "{err}"
    );
    let mut list = broker.cli();
    list.args(["turn", "list"]);
    let (code, _, err) = run(list).await;
    assert_eq!(code, 1);
    assert!(err.contains("may not use the control socket"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_shim_sends_widens_its_turn() {
    let broker = TestBroker::start(Options::default()).await;
    let (alice, bob) = tokio::join!(broker.open_turn("alice"), broker.open_turn("bob"));
    async fn catalog(b: &TestBroker) -> sharedos_proto::CatalogHash {
        match b
            .host()
            .await
            .call(&ControlRequest::Catalog {
                principal: "alice".into(),
                agent: None,
            })
            .await
        {
            Ok(ControlResponse::Catalog { catalog_hash, .. }) => catalog_hash,
            other => panic!("{other:?}"),
        }
    }
    let before = catalog(&broker).await;
    let s = sharedos_ipc::connect(&broker.bridge())
        .await
        .expect("connect");
    let (r, mut w) = tokio::io::split(s);
    let mut r = FrameReader::new(r);
    write_frame(
        &mut w,
        &BridgeRequest::Hello {
            protocol: PROTOCOL_VERSION,
            token: alice.token.clone(),
            client: ShimInfo::default(),
        },
    )
    .await
    .expect("hello");
    assert!(matches!(
        r.next::<BridgeEvent>().await.expect("welcome"),
        BridgeEvent::Welcome { .. }
    ));
    // Claims in the client info and in the call's arguments change nothing.
    write_frame(
        &mut w,
        &BridgeRequest::ClientInfo {
            name: "principal=bob".into(),
            version: "admin".into(),
            protocol_version: None,
            capabilities: None,
        },
    )
    .await
    .expect("info");
    let call = |id: u64, tool: &str, args: Value| BridgeRequest::Call {
        id,
        call: ToolCall {
            tool: tool.into(),
            arguments: Some(args),
            request_id: None,
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        },
    };
    write_frame(
        &mut w,
        &call(
            1,
            "files.write",
            json!({"path": "/private/x", "content": "x", "principal": "bob"}),
        ),
    )
    .await
    .expect("call");
    write_frame(
        &mut w,
        &call(
            2,
            "files.read",
            json!({"path": "/private/secret.txt", "_meta": {"principal": "bob"}}),
        ),
    )
    .await
    .expect("call");
    let mut codes = Vec::new();
    for _ in 0..2 {
        match r.next::<BridgeEvent>().await.expect("answer") {
            BridgeEvent::Answer { answer, .. } => codes.push(answer.outcome.code()),
            other => panic!("{other:?}"),
        }
    }
    codes.sort();
    assert_eq!(codes, ["invalid_arguments", "unpublished_tool"]);
    // A second hello with bob's token does not switch the connection to bob's turn: it ends it.
    write_frame(
        &mut w,
        &BridgeRequest::Hello {
            protocol: PROTOCOL_VERSION,
            token: bob.token.clone(),
            client: ShimInfo::default(),
        },
    )
    .await
    .expect("hello2");
    let _ = write_frame(
        &mut w,
        &call(
            3,
            "files.write",
            json!({"path": "/private/x", "content": "x"}),
        ),
    )
    .await;
    assert!(
        r.next::<BridgeEvent>().await.is_err(),
        "the connection was closed"
    );
    // A control request on the bridge socket is not understood there.
    let s = sharedos_ipc::connect(&broker.bridge())
        .await
        .expect("connect");
    let (r2, mut w2) = tokio::io::split(s);
    write_frame(&mut w2, &ControlRequest::PolicyReload)
        .await
        .expect("frame");
    assert!(matches!(
        FrameReader::new(r2).next::<BridgeEvent>().await,
        Ok(BridgeEvent::Refused { .. })
    ));
    // Nothing changed: alice's catalogue, the policy, and every call decided as alice.
    assert_eq!(catalog(&broker).await, before);
    let lines = broker.records();
    assert!(!lines.iter().any(|l| l["kind"] == "policy_reloaded"));
    assert_eq!(broker.calls_of(&bob.turn).len(), 0);
    let mut raw = Raw::spawn(broker.shim_command(alice.token.expose()));
    raw.initialize("2025-06-18").await;
    let r = raw
        .call(9, "files.read", json!({"path": "/private/secret.txt"}))
        .await;
    assert_eq!(meta(&r["result"])["code"], "no_permit");
}

/// Issue 42 item 12: the config, the policy, the schema and the pin file are checked as the
/// broker's own files are. Each one made writable by every uid (0666), by its group (0664), or
/// given to uid 65534 keeps the real broker binary from starting, the error naming the file and
/// the fix; `0644` root-owned starts; a group named `admin_group` may write them; a policy made
/// 0666 under a running broker is refused at `policy reload`, the old set staying in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (files of another uid): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn settings_files_others_can_write_are_refused_at_load_and_reload() {
    use std::os::unix::fs::PermissionsExt;
    let mut b = TestBroker::start(Options::default()).await;
    b.stop().await;
    let dir = b.dir.path().to_path_buf();
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(
        &b.config_path,
        format!("schema = \"schema.cedarschema\"\npins = \"pins.toml\"\n{cfg}"),
    )
    .expect("w");
    let files = [
        "broker.toml",
        "policy.cedar",
        "schema.cedarschema",
        "pins.toml",
    ];
    std::fs::write(
        dir.join("schema.cedarschema"),
        sharedos_broker::policy::BUILTIN_SCHEMA,
    )
    .expect("schema");
    std::fs::write(dir.join("pins.toml"), "").expect("pins");
    let set = |name: &str, mode: u32, owner: u32, group: u32| {
        let p = dir.join(name);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        rustix::fs::chown(
            &p,
            Some(rustix::fs::Uid::from_raw(owner)),
            Some(rustix::fs::Gid::from_raw(group)),
        )
        .expect("chown");
    };
    for f in files {
        set(f, 0o644, 0, 0);
    }
    // 0644, root's: the broker starts on all four.
    b.restart().await;
    b.stop().await;
    let serve = || {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.arg("--runtime-dir")
            .arg(b.runtime.clone())
            .arg("serve")
            .arg("--config")
            .arg(&b.config_path);
        cmd
    };
    let mut refused = 0;
    for f in files {
        for (mode, owner, fix) in [
            (0o666, 0, "chmod go-w"),
            (0o664, 0, "chmod g-w"),
            (0o644, 65534, "belongs to uid 65534"),
        ] {
            set(f, mode, owner, 0);
            let (code, _, err) = run(serve()).await;
            assert_ne!(code, 0, "{f} {mode:o} uid {owner} was accepted: {err}");
            let shown = format!("refused `{}`", dir.join(f).display());
            assert!(
                err.contains(&shown) && err.contains(fix),
                "{f} {mode:o} uid {owner}: {err}"
            );
            set(f, 0o644, 0, 0);
            refused += 1;
        }
    }
    assert_eq!(refused, 12);
    // A group named `admin_group` may write them all (the config names it itself).
    let admins = 4242;
    let cfg = std::fs::read_to_string(&b.config_path).expect("cfg");
    std::fs::write(&b.config_path, format!("admin_group = {admins}\n{cfg}")).expect("w");
    for f in files {
        set(f, 0o664, 0, admins);
    }
    b.restart().await;
    // Another group still may not.
    set("policy.cedar", 0o664, 0, admins + 1);
    let mut reload = b.cli();
    reload.args(["policy", "reload"]);
    let (code, _, err) = run(reload).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("refused `{}`", dir.join("policy.cedar").display()))
            && err.contains(&format!("group {}", admins + 1))
            && err.contains("admin_group"),
        "{err}"
    );
    // Writable by every uid under a running broker: refused at reload, the old set stays.
    set("policy.cedar", 0o666, 0, admins);
    let mut reload = b.cli();
    reload.args(["policy", "reload"]);
    let (code, _, err) = run(reload).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("chmod go-w"), "{err}");
    assert!(err.contains("previous policy set stays"), "{err}");
    set("policy.cedar", 0o644, 0, 0);
    let mut reload = b.cli();
    reload.args(["policy", "reload"]);
    let (code, out, err) = run(reload).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("version 2"), "{out}");
    let turn = b.open_turn("alice").await;
    assert!(!turn.tools.is_empty(), "the broker serves");
}
