//! A real multi-user deployment (issue 16): harnesses under their own uid reaching the bridge
//! socket through a group, config and token files written safely and per turn, trusted turn
//! attributes in the policy and the record, exact catalogues, providers with their own file
//! spaces, and `column run` with a relative work dir.
//!
//! The uid tests need root (CI runs as root): they use uids and a gid with no entry in
//! `/etc/passwd` (64100–64103), set with `setpriv`, so nothing is created on the machine.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sharedos_broker::Config;
use sharedos_broker::server::Running;
use sharedos_host::client::ControlClient;
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn, TurnOpened};
use tokio_util::sync::CancellationToken;

use crate::kit::{Raw, WAIT, bin, meta, run};

pub(crate) const HARNESS_GID: u32 = 64100;
pub(crate) const HARNESS_UID: u32 = 64101;
/// In the harness group, not a listed harness uid.
const OTHER_UID: u32 = 64102;
/// In no group of the broker's.
const STRANGER_UID: u32 = 64103;

/// A broker started in-process on a config written by the test.
struct Deployed {
    dir: tempfile::TempDir,
    runtime: PathBuf,
    shutdown: CancellationToken,
    _running: Running,
}

impl Deployed {
    /// Lays out `data/{public/hello.txt, private/secret.txt}` and `data2/` (the same files,
    /// other text), the policy and `broker.toml` (`config` above the providers, `providers`
    /// after), and starts the broker.
    async fn start(policy: &str, config: &str, providers: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sharedos-deploy-")
            .tempdir()
            .expect("tmp");
        let d = dir.path();
        for (path, text) in [
            ("data/public/hello.txt", "hello from files\n"),
            ("data/private/secret.txt", "files secret\n"),
            ("data2/public/hello.txt", "hello from docs\n"),
            ("data2/private/secret.txt", "docs secret\n"),
        ] {
            let p = d.join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, text).expect("write");
        }
        std::fs::write(d.join("policy.cedar"), policy).expect("policy");
        let providers = if providers.is_empty() {
            "[[providers]]\ntype = \"files\"\nnamespace = \"files\"\nroot = \"data\"\n"
        } else {
            providers
        };
        std::fs::write(
            d.join("broker.toml"),
            format!("record = \"record.jsonl\"\npolicy = \"policy.cedar\"\n{config}\n{providers}"),
        )
        .expect("config");
        let runtime = d.join("run");
        let config = Config::from_file(&d.join("broker.toml")).expect("config");
        let shutdown = CancellationToken::new();
        let running = sharedos_broker::start(config, runtime.clone(), shutdown.clone())
            .await
            .expect("broker starts");
        Self {
            dir,
            runtime,
            shutdown,
            _running: running,
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    async fn host(&self) -> ControlClient {
        ControlClient::connect(&self.runtime)
            .await
            .expect("control connection")
    }

    async fn ask(&self, req: ControlRequest) -> ControlResponse {
        self.host().await.call(&req).await.expect("control call")
    }

    async fn open(&self, req: OpenTurn) -> TurnOpened {
        match self.ask(ControlRequest::OpenTurn(Box::new(req))).await {
            ControlResponse::TurnOpened(t) => t,
            other => panic!("unexpected {other:?}"),
        }
    }

    /// The refusal's message (with its code) of an open that must fail.
    async fn open_refused(&self, req: OpenTurn) -> String {
        match self
            .host()
            .await
            .call(&ControlRequest::OpenTurn(Box::new(req)))
            .await
        {
            Err(e) => e.to_string(),
            Ok(other) => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn records(&self) -> Vec<Value> {
        std::fs::read_to_string(self.path("record.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("record line is JSON"))
            .collect()
    }

    fn shim(&self, token: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        cmd.env(runtime::TOKEN_ENV, token)
            .env(runtime::BROKER_ENV, runtime::bridge_socket(&self.runtime))
            .env_remove(runtime::RUNTIME_DIR_ENV)
            .kill_on_drop(true);
        cmd
    }

    /// `turn open --json --principal alice ARGS` by the CLI, which must succeed: its JSON.
    async fn cli_open(&self, args: &[&str]) -> Value {
        let mut cli = self.cli();
        cli.args(["turn", "open", "--json", "--principal", "alice"])
            .args(args);
        let (code, out, err) = run(cli).await;
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str(&out).expect("json")
    }

    fn cli(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(bin("sharedos-broker"));
        cmd.arg("--runtime-dir").arg(&self.runtime);
        cmd
    }
}

impl Drop for Deployed {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Spawns `cmd` (a shim), initializes it and makes each call in turn (ids 1, 2, ...): the
/// probe, still running, and each call's result.
async fn calls(cmd: tokio::process::Command, calls: &[(&str, Value)]) -> (Raw, Vec<Value>) {
    let mut raw = Raw::spawn(cmd);
    raw.initialize("2025-06-18").await;
    let mut out = Vec::new();
    for (id, (tool, args)) in (1..).zip(calls) {
        out.push(raw.call(id, tool, args.clone()).await["result"].clone());
    }
    (raw, out)
}

/// The outcome each result carries.
fn outcomes(results: &[Value]) -> Vec<String> {
    results
        .iter()
        .map(|r| meta(r)["outcome"].as_str().unwrap_or("?").to_owned())
        .collect()
}

/// A turn's request: principal, agent, the agent's owner.
fn turn_of(principal: &str, agent: Option<&str>, owner: Option<&str>) -> OpenTurn {
    OpenTurn {
        principal: principal.into(),
        agent: agent.map(Into::into),
        agent_owner: owner.map(Into::into),
        ..Default::default()
    }
}

fn is_root() -> bool {
    runtime::current_uid() == 0
}

/// Root, or (outside CI) a skip with the reason. Under CI=true, not being root fails.
pub(crate) fn need_root(test: &str) -> bool {
    if is_root() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} needs root (CI runs as root)"
    );
    eprintln!("SKIPPED {test}: needs root to run processes under other uids");
    false
}

/// `command` under `uid` with primary group `gid` and no other group, by `setpriv`.
pub(crate) fn as_uid(uid: u32, gid: u32, program: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"))
        .arg("--clear-groups")
        .arg(program)
        .kill_on_drop(true);
    cmd
}

/// The workspace binaries copied into `dir/bin` (0755): the build tree may sit under folders
/// other uids cannot search.
pub(crate) fn public_bins(dir: &Path) -> (PathBuf, PathBuf) {
    let bins = dir.join("bin");
    std::fs::create_dir_all(&bins).expect("mkdir");
    let mut out = Vec::new();
    for name in ["sharedos-mcp-shim", "sharedos-broker"] {
        let to = bins.join(name);
        std::fs::copy(bin(name), &to).expect("copy");
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        out.push(to);
    }
    std::fs::set_permissions(&bins, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (out[0].clone(), out[1].clone())
}

const ALICE_PUBLIC: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };
"#;

async fn output(mut cmd: tokio::process::Command) -> (i32, String, String) {
    cmd.stdin(std::process::Stdio::null());
    let out = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("finished in time")
        .expect("run");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The deployment of docs/deployment.md: the broker (root here) gives `bridge.sock` to the harness
/// group; a harness uid in that group and listed in `harness_uids` reaches its turn, with its
/// token in a per-turn file given to it; a uid in the group but not listed is refused by the
/// peer-uid check; a uid outside the group cannot even connect; and no harness uid can use
/// `control.sock`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (processes under other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn a_harness_under_its_own_uid() {
    if !need_root("a_harness_under_its_own_uid") {
        return;
    }
    let b = Deployed::start(
        ALICE_PUBLIC,
        &format!("harness_uids = [{HARNESS_UID}]\nharness_group = {HARNESS_GID}\n"),
        "",
    )
    .await;
    // Other uids must be able to search the way to the runtime dir and the binaries.
    std::fs::set_permissions(b.dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let (shim, broker_bin) = public_bins(b.dir.path());

    // The modes the broker set.
    let run_dir = std::fs::metadata(&b.runtime).expect("run dir");
    assert_eq!(run_dir.mode() & 0o7777, 0o710);
    assert_eq!(run_dir.gid(), HARNESS_GID);
    let bridge = std::fs::metadata(runtime::bridge_socket(&b.runtime)).expect("bridge.sock");
    assert_eq!(bridge.mode() & 0o777, 0o660);
    assert_eq!(bridge.gid(), HARNESS_GID);
    let control = std::fs::metadata(runtime::control_socket(&b.runtime)).expect("control.sock");
    assert_eq!(control.mode() & 0o777, 0o600);

    // The host (root) opens the turn and writes the token in a per-turn file given to the
    // harness uid, in a folder of its own that only root can write.
    let tokens = b.path("tokens");
    std::fs::create_dir(&tokens).expect("mkdir");
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let opened = b
        .cli_open(&[
            "--token-dir",
            &tokens.display().to_string(),
            "--file-owner",
            &format!("{HARNESS_UID}:{HARNESS_GID}"),
        ])
        .await;
    let turn = opened["turn"].as_str().expect("turn").to_owned();
    let token_file = tokens.join(format!("{turn}.token"));
    let meta_t = std::fs::metadata(&token_file).expect("token file");
    assert_eq!(
        (meta_t.uid(), meta_t.gid(), meta_t.mode() & 0o777),
        (HARNESS_UID, HARNESS_GID, 0o600)
    );

    // (a) The listed harness uid reaches its turn, reading its token file itself.
    let mut cmd = as_uid(HARNESS_UID, HARNESS_GID, &shim);
    cmd.arg("--turn-token-file")
        .arg(&token_file)
        .env(runtime::BROKER_ENV, runtime::bridge_socket(&b.runtime))
        .env_remove(runtime::TOKEN_ENV)
        .env_remove(runtime::RUNTIME_DIR_ENV);
    let (raw, results) = calls(
        cmd,
        &[
            ("files.read", json!({"path": "/public/hello.txt"})),
            ("files.read", json!({"path": "/private/secret.txt"})),
        ],
    )
    .await;
    assert_eq!(outcomes(&results), ["succeeded", "denied"], "{results:?}");

    // Another uid cannot read that turn's token file.
    let mut cat = as_uid(OTHER_UID, HARNESS_GID, Path::new("/bin/cat"));
    cat.arg(&token_file);
    let (code, _, err) = output(cat).await;
    assert_ne!(code, 0);
    assert!(err.contains("Permission denied"), "{err}");

    // (b) In the group but not a listed harness uid: connected, then refused by the uid check.
    let token = std::fs::read_to_string(&token_file).expect("token");
    let mut cmd = as_uid(OTHER_UID, HARNESS_GID, &shim);
    cmd.env(runtime::TOKEN_ENV, token.trim())
        .env(runtime::BROKER_ENV, runtime::bridge_socket(&b.runtime))
        .env_remove(runtime::RUNTIME_DIR_ENV);
    let (code, _, err) = output(cmd).await;
    assert_ne!(code, 0);
    assert!(err.contains("may not use the bridge socket"), "{err}");

    // Outside the group: the socket cannot be reached at all.
    let mut cmd = as_uid(STRANGER_UID, STRANGER_UID, &shim);
    cmd.env(runtime::TOKEN_ENV, token.trim())
        .env(runtime::BROKER_ENV, runtime::bridge_socket(&b.runtime))
        .env_remove(runtime::RUNTIME_DIR_ENV);
    let (code, _, err) = output(cmd).await;
    assert_ne!(code, 0);
    assert!(err.contains("ermission denied"), "{err}");

    // (c) No harness uid can use control.sock, listed or not.
    for (uid, gid) in [
        (HARNESS_UID, HARNESS_GID),
        (OTHER_UID, HARNESS_GID),
        (STRANGER_UID, STRANGER_UID),
    ] {
        let mut cmd = as_uid(uid, gid, &broker_bin);
        cmd.arg("--runtime-dir")
            .arg(&b.runtime)
            .args(["turn", "open", "--principal", "bob"]);
        let (code, out, err) = output(cmd).await;
        assert_ne!(code, 0, "uid {uid}: {out}");
        assert!(err.contains("ermission denied"), "uid {uid}: {err}");
    }

    // Exactly one bridge reached the turn, from the harness uid; the turn's two calls are on
    // record, and nothing else is.
    raw.close_stdin().await.kill().await.ok();
    let records = b.records();
    let bridges: Vec<&Value> = records
        .iter()
        .filter(|l| l["kind"] == "bridge_connected" && l["turn"] == turn.as_str())
        .collect();
    assert_eq!(bridges.len(), 1, "{bridges:?}");
    assert_eq!(bridges[0]["peer"]["uid"], HARNESS_UID);
    let calls = records
        .iter()
        .filter(|l| l["kind"] == "call" && l["turn"] == turn.as_str())
        .count();
    assert_eq!(calls, 2);
    // The token file goes with the turn.
    let mut cli = b.cli();
    cli.args(["turn", "close", &turn]);
    let (code, _, err) = run(cli).await;
    assert_eq!(code, 0, "{err}");
    assert!(!token_file.exists());
}

/// Without a harness group, the defaults stay private: 0700 and 0600.
#[tokio::test]
async fn the_defaults_stay_private() {
    let b = Deployed::start(ALICE_PUBLIC, "", "").await;
    let mode = |p: PathBuf| std::fs::metadata(p).expect("meta").mode() & 0o7777;
    assert_eq!(mode(b.runtime.clone()), 0o700);
    assert_eq!(mode(runtime::bridge_socket(&b.runtime)), 0o600);
    assert_eq!(mode(runtime::control_socket(&b.runtime)), 0o600);
    // A group name that does not exist is a config error naming it.
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("broker.toml");
    std::fs::write(
        &cfg,
        "record = \"r\"\npolicy = \"p\"\nharness_group = \"no-such-group-7f3a\"\n[[providers]]\ntype = \"files\"\nroot = \"d\"\n",
    )
    .expect("w");
    let e = Config::from_file(&cfg)
        .expect_err("unknown group")
        .to_string();
    assert!(
        e.contains("harness_group") && e.contains("no-such-group-7f3a"),
        "{e}"
    );
}

/// A folder another uid owns is refused for the token and config files, naming it, and the
/// turn the files were for is closed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (processes under other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn a_folder_another_uid_owns_is_refused() {
    if !need_root("a_folder_another_uid_owns_is_refused") {
        return;
    }
    let b = Deployed::start(ALICE_PUBLIC, "", "").await;
    let theirs = b.path("theirs");
    std::fs::create_dir(&theirs).expect("mkdir");
    rustix::fs::chown(
        &theirs,
        Some(rustix::fs::Uid::from_raw(HARNESS_UID)),
        Some(rustix::fs::Gid::from_raw(HARNESS_GID)),
    )
    .expect("chown");
    // The harness uid's own planted link: the host must not write through it.
    let victim = b.path("victim.txt");
    std::fs::write(&victim, "VICTIM").expect("w");
    for args in [
        vec!["--token-dir".to_owned(), theirs.display().to_string()],
        vec![
            "--write-config".to_owned(),
            "codex".to_owned(),
            theirs.join("config.toml").display().to_string(),
        ],
    ] {
        let mut cli = b.cli();
        cli.args(["turn", "open", "--principal", "alice"])
            .args(&args);
        let (code, _, err) = run(cli).await;
        assert_ne!(code, 0, "{args:?}");
        assert!(
            err.contains(&theirs.display().to_string())
                && err.contains(&format!("uid {HARNESS_UID}")),
            "{err}"
        );
        assert!(err.contains("closed again"), "{err}");
    }
    assert_eq!(std::fs::read_dir(&theirs).expect("ls").count(), 0);
    assert_eq!(std::fs::read_to_string(&victim).expect("r"), "VICTIM");
    match b.ask(ControlRequest::ListTurns).await {
        ControlResponse::Turns { turns } => assert!(turns.is_empty(), "{turns:?}"),
        other => panic!("{other:?}"),
    }
}

/// A token file closed by the broker itself (TTL) is removed too.
#[tokio::test]
async fn a_turn_that_expires_takes_its_token_file() {
    let b = Deployed::start(ALICE_PUBLIC, "", "").await;
    let tokens = b.path("tokens").display().to_string();
    let opened = b.cli_open(&["--ttl", "1", "--token-dir", &tokens]).await;
    let file = PathBuf::from(opened["tokenFile"].as_str().expect("tokenFile"));
    assert!(file.exists());
    crate::kit::eventually("the expired turn's token file is gone", || !file.exists()).await;
    let closed = b
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "turn_closed" && l["reason"] == "ttl")
        .count();
    assert_eq!(closed, 1);
}

const ATTRIBUTES: &str = r#"
@id("project-x")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is SharedOS::File)
when { context has turn && context.turn has project && context.turn.project == "x"
       && resource.path like "/public/*" };

@id("owners-agent")
permit(principal, action == SharedOS::Action::"read", resource is SharedOS::File)
when { context has agent && context.agent has owner && context.agent.owner == principal
       && resource.path like "/private/*" };
"#;

/// `--attr` reaches Cedar as `context.turn`, `--agent-owner` as `Agent.owner`; both are on
/// the `turn_opened` line; attributes the schema does not declare refuse the turn by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_attributes_and_the_agents_owner_reach_the_policy_and_the_record() {
    let b = Deployed::start(ATTRIBUTES, "", "").await;
    let attrs = |project: &str| {
        let mut m = serde_json::Map::new();
        m.insert("project".into(), json!(project));
        Some(m)
    };
    // project x: files.read is shown and /public is allowed.
    let x = b
        .open(OpenTurn {
            attributes: attrs("x"),
            ..turn_of("alice", None, None)
        })
        .await;
    let names: Vec<String> = x.tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(names, vec!["files.read"]);
    let read = |path: &str| [("files.read", json!({ "path": path }))];
    let (_x, r) = calls(b.shim(x.token.expose()), &read("/public/hello.txt")).await;
    assert_eq!(outcomes(&r), ["succeeded"]);
    assert_eq!(meta(&r[0])["policies"], json!(["project-x"]), "{r:?}");
    // project y: no policy can permit anything, so the catalogue is empty.
    let y = b
        .open(OpenTurn {
            attributes: attrs("y"),
            ..turn_of("alice", None, None)
        })
        .await;
    assert!(y.tools.is_empty(), "{:?}", y.tools);
    // The agent's owner: bob's own agent may read /private; the same agent owned by carol may not.
    let own = b.open(turn_of("bob", Some("a1"), Some("bob"))).await;
    assert_eq!(own.tools.len(), 1);
    let (_own, r) = calls(b.shim(own.token.expose()), &read("/private/secret.txt")).await;
    assert_eq!(outcomes(&r), ["succeeded"]);
    let theirs = b.open(turn_of("bob", Some("a1"), Some("carol"))).await;
    assert!(theirs.tools.is_empty());

    // The CLI: --attr KEY=VALUE, and the record line.
    let opened = b
        .cli_open(&["--attr", "project=x", "--attr", "tenant=acme"])
        .await;
    let line = b
        .records()
        .into_iter()
        .find(|l| l["kind"] == "turn_opened" && l["turn"] == opened["turn"])
        .expect("turn_opened");
    assert_eq!(
        line["accessContext"]["turn"],
        json!({"project": "x", "tenant": "acme"})
    );
    let owned = b
        .records()
        .into_iter()
        .find(|l| l["kind"] == "turn_opened" && l["turn"] == own.turn.as_str())
        .expect("turn_opened");
    assert_eq!(owned["accessContext"]["agentOwner"], "bob");

    // Refused by name: an attribute the schema lacks, a value of the wrong type, a null.
    // And the bounds on what a host may attach: 32 attributes, identifier names, 4 KiB.
    let many: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("a{i}"), json!("v"))).collect();
    for (attrs, needle) in [
        (json!({"color": "red"}), "color"),
        (json!({"project": 7}), "project"),
        (json!({"project": null}), "null"),
        (
            Value::Object(many),
            "33 attributes; a turn may carry at most 32",
        ),
        (json!({"pro ject": "x"}), "`pro ject` is not an identifier"),
        (json!({"project": "x".repeat(5000)}), "at most 4096"),
    ] {
        let message = b
            .open_refused(OpenTurn {
                attributes: attrs.as_object().cloned(),
                ..turn_of("alice", None, None)
            })
            .await;
        assert!(message.contains("(invalid_attributes)"), "{message}");
        assert!(message.contains(needle), "{attrs}: {message}");
    }
    let mut cli = b.cli();
    cli.args(["turn", "open", "--principal", "alice", "--attr", "novalue"]);
    let (code, _, err) = run(cli).await;
    assert_ne!(code, 0);
    assert!(
        err.contains("novalue") && err.contains("KEY=VALUE"),
        "{err}"
    );
}

const CAROL_HELPER: &str = r#"
@id("carol-helper-files")
permit(principal == SharedOS::User::"carol", action == SharedOS::Action::"read", resource is SharedOS::File)
when { context has agent && context.agent == SharedOS::Agent::"helper" && resource.path like "/public/*" };

@id("carol-helper-tools")
permit(principal == SharedOS::User::"carol", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { context has agent && context.agent == SharedOS::Agent::"helper" };
"#;

/// The catalogue is decided in the turn's whole context: a tool is shown exactly where some
/// call of it can be permitted, for built-in and brokered tools, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalogues_are_exact_in_the_turns_context() {
    let upstream = format!(
        "[[providers]]\ntype = \"files\"\nnamespace = \"files\"\nroot = \"data\"\n\n\
         [[providers]]\ntype = \"mcp\"\nnamespace = \"open\"\ncommand = {:?}\n\
         [providers.sandbox]\nread = [\"data\"]\n",
        bin("open-upstream").display().to_string()
    );
    let b = Deployed::start(CAROL_HELPER, "", &upstream).await;
    let catalogue = |agent: &str| {
        let agent = agent.to_owned();
        let b = &b;
        async move {
            let t = b.open(turn_of("carol", Some(&agent), None)).await;
            let names: Vec<String> = t.tools.iter().map(|t| t.name.to_string()).collect();
            (t, names)
        }
    };
    let (helper, shown) = catalogue("helper").await;
    assert_eq!(shown, vec!["files.read", "open.read_file"]);
    let (_, hidden) = catalogue("other").await;
    assert!(hidden.is_empty(), "{hidden:?}");
    // What is shown can be used.
    let hello = b.path("data/public/hello.txt").display().to_string();
    let (_raw, r) = calls(
        b.shim(helper.token.expose()),
        &[
            ("files.read", json!({"path": "/public/hello.txt"})),
            ("open.read_file", json!({ "path": hello })),
        ],
    )
    .await;
    assert_eq!(outcomes(&r), ["succeeded", "succeeded"], "{r:?}");
    // And the host's catalogue question gives the same answer.
    match b
        .ask(ControlRequest::Catalog {
            principal: "carol".into(),
            agent: Some("other".into()),
        })
        .await
    {
        ControlResponse::Catalog { tools, .. } => assert!(tools.is_empty(), "{tools:?}"),
        other => panic!("{other:?}"),
    }
}

/// Two files providers are two file spaces: `resource.namespace` tells them apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_file_roots_are_told_apart_by_a_policy() {
    let policy = r#"
@id("files-only")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is SharedOS::File)
when { resource.namespace == "files" && resource.path like "/public/*" };
"#;
    let providers = "[[providers]]\ntype = \"files\"\nnamespace = \"files\"\nroot = \"data\"\n\n\
                     [[providers]]\ntype = \"files\"\nnamespace = \"docs\"\nroot = \"data2\"\n";
    let b = Deployed::start(policy, "", providers).await;
    let t = b.open(turn_of("alice", None, None)).await;
    let hello = json!({"path": "/public/hello.txt"});
    let (_raw, r) = calls(
        b.shim(t.token.expose()),
        &[("files.read", hello.clone()), ("docs.read", hello)],
    )
    .await;
    assert_eq!(outcomes(&r), ["succeeded", "denied"], "{r:?}");
    assert!(crate::kit::text(&r[0]).contains("hello from files"));
    let recorded: Vec<Value> = b
        .records()
        .into_iter()
        .filter(|l| l["kind"] == "call" && l["turn"] == t.turn.as_str())
        .collect();
    assert_eq!(recorded.len(), 2);
    assert_eq!(recorded[0]["outcome"], "succeeded");
    assert_eq!(recorded[1]["outcome"], "denied");
}

/// A harness for `column run` in a few lines of Python: reads the Claude Code config at its
/// first argument (as given: relative paths resolve in the work dir, where it runs), starts
/// the shim it names and calls each row of the rows file.
const MINI_HARNESS: &str = r#"
import json, os, subprocess, sys
server = json.load(open(sys.argv[1]))["mcpServers"]["sharedos"]
rows = json.load(open(sys.argv[2]))
env = dict(os.environ); env.update(server.get("env", {}))
p = subprocess.Popen([server["command"]] + server.get("args", []), stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, env=env, text=True)
def send(m):
    p.stdin.write(json.dumps(m) + "\n"); p.stdin.flush()
def rpc(i, method, params):
    send({"jsonrpc": "2.0", "id": i, "method": method, "params": params})
    while True:
        line = p.stdout.readline()
        if not line: sys.exit("the shim closed")
        m = json.loads(line)
        if m.get("id") == i: return m
rpc(0, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                      "clientInfo": {"name": "mini", "version": "1"}})
send({"jsonrpc": "2.0", "method": "notifications/initialized"})
for n, r in enumerate(rows):
    print(json.dumps(rpc(n + 1, "tools/call", {"name": r["tool"], "arguments": r["arguments"]})))
p.stdin.close(); p.wait()
"#;

/// `column run --workdir` with a relative path: every path handed to the harness is absolute,
/// so the rows are exercised (they were all "not exercised" before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_run_with_a_relative_workdir() {
    let b = Deployed::start(ALICE_PUBLIC, "", "").await;
    let d = b.dir.path();
    std::fs::write(d.join("mini.py"), MINI_HARNESS).expect("w");
    let rows = json!([
        {"id": "public", "tool": "files.read", "arguments": {"path": "/public/hello.txt"}, "expect": "allowed"},
        {"id": "private", "tool": "files.read", "arguments": {"path": "/private/secret.txt"}, "expect": "denied"},
    ]);
    std::fs::write(d.join("rows.json"), rows.to_string()).expect("w");
    std::fs::write(
        d.join("host.toml"),
        format!(
            "harness = \"claude-code\"\ndeclared_model = \"none: a script\"\nmcp_support = \"native\"\n\
             config_format = \"claude-code\"\ncommand = \"python3\"\n\
             args = [{:?}, \"{{config}}\", {:?}]\ntimeout_seconds = 60\nprincipal = \"alice\"\nharness_local = [\"Bash\"]\n",
            d.join("mini.py").display().to_string(),
            d.join("rows.json").display().to_string(),
        ),
    )
    .expect("w");
    let mut cmd = b.cli();
    cmd.current_dir(d)
        .args([
            "column",
            "run",
            "--host-config",
            "host.toml",
            "--rows",
            "rows.json",
        ])
        .args(["--out", "manifest.json", "--workdir", "work"]);
    let (code, out, err) = run(cmd).await;
    let harness_err =
        std::fs::read_to_string(d.join("work/harness.stderr.log")).unwrap_or_default();
    assert_eq!(code, 0, "{out}\n{err}\nharness: {harness_err}");
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("manifest.json")).expect("manifest"))
            .expect("json");
    let grades: Vec<&str> = manifest["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["grade"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(grades, vec!["pass", "pass"], "{manifest:#}");
    let log = manifest["harnessRun"]["stdout"]
        .as_str()
        .unwrap_or_default();
    assert!(log.starts_with('/'), "{manifest:#}");
}

/// A harness group whose members cannot reach the runtime dir (a folder above it is 0700, as
/// `$XDG_RUNTIME_DIR` is) is reported at start, naming the folder in the way; a reachable one
/// is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (processes under other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn an_unreachable_runtime_dir_is_reported_at_start() {
    if !need_root("an_unreachable_runtime_dir_is_reported_at_start") {
        return;
    }
    let mut b = crate::races::Served::start_with(
        &[],
        &format!("call_timeout_seconds = 10\nharness_group = {HARNESS_GID}"),
    )
    .await;
    let dir = b.path("");
    let shown = dir.display().to_string();
    let shown = shown.trim_end_matches('/');
    let log = b.path("broker.stderr");
    let stderr = || std::fs::read_to_string(&log).expect("stderr");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    b.kill_and_restart().await;
    let reachable = stderr();
    assert!(!reachable.contains("not searchable"), "{reachable}");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    b.kill_and_restart().await;
    let blocked = stderr();
    assert!(
        blocked.contains(&format!("`{shown}` (mode 0700"))
            && blocked.contains(&format!("harness_group {HARNESS_GID}")),
        "{blocked}"
    );
}

/// A harness uid whose own shim is tested against listeners of another harness uid.
const SHIM_UID: u32 = 64107;

/// The listener another uid plants: makes its folder (0755 where it may), listens on
/// `bridge.sock` there (0666), and writes every byte a connection sends to the record file,
/// saying on stdout when it listens, accepts, receives (`got N`), and how many bytes a closed
/// connection sent.
const PLANTED_LISTENER: &str = r#"
import os, socket, sys
folder, received = sys.argv[1], sys.argv[2]
os.makedirs(folder, exist_ok=True)
try:
    os.chmod(folder, 0o755)
except PermissionError:
    pass
path = os.path.join(folder, "bridge.sock")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o666)
s.listen(8)
record = open(received, "ab", buffering=0)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    print("accepted", flush=True)
    n = 0
    while True:
        b = c.recv(65536)
        if not b:
            break
        record.write(b)
        n += len(b)
        print(f"got {len(b)}", flush=True)
    c.close()
    print(f"closed {n}", flush=True)
"#;

/// A planted listener, running as another uid.
struct Planted {
    child: tokio::process::Child,
    out: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    received: PathBuf,
}

impl Planted {
    /// Starts the listener as `uid` in `folder` and waits until it listens.
    async fn start(uid: u32, gid: u32, folder: &Path) -> Self {
        use tokio::io::AsyncBufReadExt as _;
        let received = folder.join("received.bin");
        let mut cmd = as_uid(uid, gid, Path::new("/usr/bin/python3"));
        cmd.arg("-c")
            .arg(PLANTED_LISTENER)
            .arg(folder)
            .arg(&received)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("listener");
        let out = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut planted = Self {
            child,
            out,
            received,
        };
        assert_eq!(planted.line().await, "listening");
        planted
    }

    async fn line(&mut self) -> String {
        tokio::time::timeout(WAIT, self.out.next_line())
            .await
            .expect("listener speaks in time")
            .expect("read")
            .expect("listener alive")
    }

    /// The connections it accepted and the bytes each sent, once `n` have closed.
    async fn closed(&mut self, n: usize) -> (usize, Vec<u64>) {
        let mut accepted = 0;
        let mut bytes = Vec::new();
        while bytes.len() < n {
            let line = self.line().await;
            if line == "accepted" {
                accepted += 1;
            } else if let Some(b) = line.strip_prefix("closed ") {
                bytes.push(b.parse().expect("count"));
            }
        }
        (accepted, bytes)
    }
}

/// Drives a shim as a harness does (`initialize`, then `tools/list`) and expects the refusal as
/// a JSON-RPC error on both, exit status 2, and the reason on stderr: (the error messages, the
/// stderr).
async fn refused_shim(cmd: tokio::process::Command) -> (Vec<String>, String) {
    let mut raw = Raw::spawn(cmd);
    raw.send(json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}}}))
        .await;
    let mut messages = Vec::new();
    let first = raw.response(0).await;
    raw.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .await;
    let second = raw.response(1).await;
    for r in [first, second] {
        assert!(r.get("result").is_none(), "{r}");
        assert_eq!(r["error"]["code"], -32001, "{r}");
        assert_eq!(r["error"]["data"]["sharedos"]["code"], "untrusted_broker");
        messages.push(r["error"]["message"].as_str().expect("message").to_owned());
    }
    let child = raw.close_stdin().await;
    let out = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("shim exits in time")
        .expect("wait");
    assert_eq!(out.status.code(), Some(2));
    (messages, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Issue 31, item 3: the shim gives its token to no listener but the broker's uid. Another
/// harness uid of the same group plants a listener (a real process of its uid that records every
/// byte) where the shim looks: at the default path `/tmp/sharedos-<uid>/bridge.sock`, at a path
/// named by `SHAREDOS_BROKER` (with and without `SHAREDOS_BROKER_UID`), in a root-owned folder
/// (only `SO_PEERCRED` tells), and in a folder anyone may write. Each time the shim connects,
/// sends nothing (the listener counts zero bytes, no token byte in its record), answers
/// `initialize` and `tools/list` with a JSON-RPC error and says why on stderr. The real broker
/// still serves the harness uid with the config `turn open --write-config` wrote (which names
/// the broker's uid), and a wrong `SHAREDOS_BROKER_UID` keeps the real broker from the token too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (processes under other uids): run as root with cargo test -- --include-ignored, or bash .ci/run"]
async fn a_listener_of_another_uid_gets_no_token() {
    if !need_root("a_listener_of_another_uid_gets_no_token") {
        return;
    }
    let b = Deployed::start(
        ALICE_PUBLIC,
        &format!("harness_uids = [{SHIM_UID}]\nharness_group = {HARNESS_GID}\n"),
        "",
    )
    .await;
    std::fs::set_permissions(b.dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let (shim, _) = public_bins(b.dir.path());
    let configs = b.path("configs");
    std::fs::create_dir(&configs).expect("mkdir");
    std::fs::set_permissions(&configs, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let config = configs.join("claude.mcp.json");
    let opened = b
        .cli_open(&[
            "--write-config",
            "claude-code",
            &config.display().to_string(),
            "--file-owner",
            &format!("{SHIM_UID}:{HARNESS_GID}"),
        ])
        .await;
    let token = opened["token"].as_str().expect("token").to_owned();
    let turn = opened["turn"].as_str().expect("turn").to_owned();
    // The config names the broker's uid (root's, here) for every harness.
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("config")).expect("json");
    let env = &written["mcpServers"]["sharedos"]["env"];
    assert_eq!(env[runtime::BROKER_UID_ENV], "0", "{written}");

    // The harness uid's shim, with what a harness passes it, and no runtime dir of its own.
    let shim_cmd = |vars: &[(&str, String)]| {
        let mut cmd = as_uid(SHIM_UID, HARNESS_GID, &shim);
        cmd.env(runtime::TOKEN_ENV, &token)
            .env_remove(runtime::BROKER_ENV)
            .env_remove(runtime::BROKER_UID_ENV)
            .env_remove(runtime::RUNTIME_DIR_ENV)
            .env_remove("XDG_RUNTIME_DIR");
        for (k, v) in vars {
            cmd.env(k, v);
        }
        cmd
    };
    let pid = std::process::id();
    let default_dir = PathBuf::from(format!("/tmp/sharedos-{SHIM_UID}"));
    let named = PathBuf::from(format!("/tmp/sharedos-named-{pid}"));
    let chowned = PathBuf::from(format!("/tmp/sharedos-chowned-{pid}"));
    let open = PathBuf::from(format!("/tmp/sharedos-open-{pid}"));
    for d in [&default_dir, &named, &chowned, &open] {
        let _ = std::fs::remove_dir_all(d);
    }
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let sock = |d: &Path| runtime::bridge_socket(d).display().to_string();

    // (folder, shim environment, what stderr and the JSON-RPC error say, root takes the folder
    // over after the listener started).
    type Case<'a> = (&'a Path, Vec<(&'static str, String)>, String, bool);
    let cases: Vec<Case> = vec![
        (
            &default_dir,
            vec![],
            format!("`{}`: it belongs to uid {OTHER_UID}", default_dir.display()),
            false,
        ),
        (
            &named,
            vec![(runtime::BROKER_ENV, sock(&named))],
            format!("`{}`: it belongs to uid {OTHER_UID}", named.display()),
            false,
        ),
        (
            &named,
            vec![
                (runtime::BROKER_ENV, sock(&named)),
                (runtime::BROKER_UID_ENV, "0".into()),
            ],
            format!("it belongs to uid {OTHER_UID}, not to the broker's uid 0 or root"),
            false,
        ),
        (
            &chowned,
            vec![(runtime::BROKER_ENV, sock(&chowned))],
            format!("it runs as uid {OTHER_UID}, not as the broker's uid 0"),
            true,
        ),
        (
            &open,
            vec![
                (runtime::BROKER_ENV, sock(&open)),
                (runtime::BROKER_UID_ENV, "0".into()),
            ],
            "mode 1777 lets other uids write it".to_owned(),
            false,
        ),
    ];
    for (folder, vars, says, take_over) in cases {
        let mut planted = Planted::start(OTHER_UID, HARNESS_GID, folder).await;
        if take_over {
            rustix::fs::chown(
                folder,
                Some(rustix::fs::Uid::ROOT),
                Some(rustix::fs::Gid::ROOT),
            )
            .expect("chown");
        }
        let (messages, stderr) = refused_shim(shim_cmd(&vars)).await;
        for m in &messages {
            assert!(m.contains(&says) && m.contains("no token sent"), "{m}");
        }
        assert!(
            stderr.contains(&says) && stderr.contains("no token sent"),
            "{stderr}"
        );
        // The shim connected (one connection, from the harness uid), and sent nothing.
        let (accepted, bytes) = planted.closed(1).await;
        assert_eq!((accepted, bytes), (1, vec![0]), "{}", folder.display());
        let record = std::fs::read(&planted.received).expect("record");
        assert_eq!(record.len(), 0);
        assert!(!String::from_utf8_lossy(&record).contains(&token));
        eprintln!(
            "planted at {}: 1 connection, 0 bytes; {says}",
            folder.display()
        );
        planted.child.kill().await.ok();
        let _ = std::fs::remove_file(runtime::bridge_socket(folder));
        let _ = std::fs::remove_file(&planted.received);
    }
    // The control: told to trust that uid, the shim sends hello, and the listener records the
    // token (so the zero counts above are the shim's doing, not the listener's).
    let mut planted = Planted::start(OTHER_UID, HARNESS_GID, &named).await;
    let mut trusting = Raw::spawn(shim_cmd(&[
        (runtime::BROKER_ENV, sock(&named)),
        (runtime::BROKER_UID_ENV, OTHER_UID.to_string()),
    ]));
    let mut got = 0;
    while got == 0 {
        let line = planted.line().await;
        if let Some(n) = line.strip_prefix("got ") {
            got = n.parse::<u64>().expect("count");
        }
    }
    let record = std::fs::read(&planted.received).expect("record");
    assert!(String::from_utf8_lossy(&record).contains(&token));
    eprintln!("trusting uid {OTHER_UID}: the listener got {got} bytes, the token among them");
    trusting.child.kill().await.ok();
    planted.child.kill().await.ok();
    for d in [&default_dir, &named, &chowned, &open] {
        let _ = std::fs::remove_dir_all(d);
    }

    // The real broker: a wrong broker uid keeps the token from it too (no bridge on record)...
    let wrong = shim_cmd(&[
        (runtime::BROKER_ENV, sock(&b.runtime)),
        (runtime::BROKER_UID_ENV, OTHER_UID.to_string()),
    ]);
    let (_, stderr) = refused_shim(wrong).await;
    assert!(
        stderr.contains(&format!(
            "it runs as uid 0, not as the broker's uid {OTHER_UID}"
        )),
        "{stderr}"
    );
    // ... and the environment the written config gives the shim reaches the turn.
    let vars: Vec<(&str, String)> = env
        .as_object()
        .expect("env")
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str().expect("string").to_owned()))
        .collect();
    let (raw, results) = calls(
        shim_cmd(&vars),
        &[("files.read", json!({"path": "/public/hello.txt"}))],
    )
    .await;
    assert_eq!(outcomes(&results), ["succeeded"], "{results:?}");
    raw.close_stdin().await.kill().await.ok();
    let bridges = b
        .records()
        .iter()
        .filter(|l| l["kind"] == "bridge_connected" && l["turn"] == turn.as_str())
        .count();
    assert_eq!(bridges, 1);
}
