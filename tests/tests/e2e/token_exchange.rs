//! Issue 45 item 4: token exchange (RFC 8693) for hosts that already hold the person's token. A
//! remote MCP server that accepts only tokens of its own audience, behind the broker per
//! principal (`[providers.oauth] grant = "token_exchange"`): the host hands each person's own
//! token in at turn open, and the broker exchanges it at the server's authorization server (found
//! from the server's 401) for one the server takes.
//!
//! Real parts, none written here but the grant: npm `oidc-provider` as the authorization server
//! (`tests/node/oidc_provider.mjs` with EXCHANGE_CLIENT_ID: it has no RFC 8693 grant built in, so
//! the script registers one with `registerGrantType`, validating the subject token with the
//! provider's own AccessToken model and counting exchanges on stdout), the PyPI `mcp` SDK's
//! MCPServer verifying the exchanged JWTs against the provider's JWKS for its own audience
//! (`tests/python/signin_server.py`), the broker as its own process (its debug log searched for
//! tokens) and its CLI handing a subject token in from a file.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use sharedos_host::client::ControlClient;
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn, SubjectToken, TurnOpened};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::kit::{Options, Raw, WAIT, bin, installed, meta, text};

const POLICY: &str = r#"
@id("people-call-r")
permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "r.*" };
"#;

const HOST_CLIENT: &str = "the-host";
const EXCHANGE_CLIENT: &str = "sharedos-exchange";
const EXCHANGE_SECRET: &str = "an-exchange-client-secret";
/// The exchanged tokens' lifetime: short, so that one expires within the test.
const TTL: u64 = 8;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A child's stdout lines, kept as they come; the first one returned.
async fn first_line(stdout: tokio::process::ChildStdout) -> (Arc<Mutex<Vec<String>>>, String) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let kept = lines.clone();
    tokio::spawn(async move {
        let mut reader = tokio::io::BufReader::new(stdout).lines();
        while let Ok(Some(l)) = reader.next_line().await {
            kept.lock().expect("lines").push(l.clone());
            let _ = tx.try_send(l);
        }
    });
    let first = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("the process starts in time")
        .expect("a line");
    (lines, first)
}

struct World {
    dir: tempfile::TempDir,
    runtime: PathBuf,
    log: PathBuf,
    oidc: u16,
    server_log: PathBuf,
    provider_lines: Arc<Mutex<Vec<String>>>,
    _provider: tokio::process::Child,
    _server: tokio::process::Child,
    _broker: tokio::process::Child,
}

impl World {
    async fn start(python: &str) -> Option<Self> {
        let node = installed("browser", ".ci/install-browser")?;
        let (oidc, port) = (free_port(), free_port());
        let dir = tempfile::Builder::new()
            .prefix("sharedos-exchange-")
            .tempdir()
            .expect("tmp");
        let resource = format!("http://127.0.0.1:{port}/mcp");
        let mut provider = tokio::process::Command::new(&node["NODE"]);
        provider
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/node/oidc_provider.mjs"
            ))
            .env("OIDC_NODE_PATH", &node["OIDC_NODE_PATH"])
            .env("PORT", oidc.to_string())
            .env("CLIENT_ID", HOST_CLIENT)
            .env("CLIENT_SECRET", "the-host-secret")
            .env("REDIRECT_URI", "http://127.0.0.1:1/callback")
            .env("MCP_RESOURCE", &resource)
            .env("RESOURCE_TTL", TTL.to_string())
            .env("EXCHANGE_CLIENT_ID", EXCHANGE_CLIENT)
            .env("EXCHANGE_CLIENT_SECRET", EXCHANGE_SECRET)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut provider = provider.spawn().expect("node oidc_provider.mjs");
        let (provider_lines, first) = first_line(provider.stdout.take().expect("stdout")).await;
        assert_eq!(first, format!("issuer http://127.0.0.1:{oidc}"));

        let server_log = dir.path().join("server.log");
        let mut server = tokio::process::Command::new(python);
        server
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/python/signin_server.py"
            ))
            .args([port.to_string(), format!("http://127.0.0.1:{oidc}")])
            .env("REMOTE_LOG", &server_log)
            .env("TOKENS_SEEN", dir.path().join("tokens-seen"))
            .env("REVOKED", dir.path().join("revoked"))
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let mut server = server.spawn().expect("signin_server.py");
        let (_, first) = first_line(server.stdout.take().expect("stdout")).await;
        assert_eq!(first, format!("PORT {port}"));

        let config = crate::kit::write_config(
            dir.path(),
            &Options {
                policy: POLICY,
                tables: format!(
                    "[[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = \"{resource}\"\n\
                     instances = \"per_principal\"\nlist_as = \"alice\"\nstartup_timeout_seconds = 20\n\
                     [providers.oauth]\ngrant = \"token_exchange\"\nclient_id = \"{EXCHANGE_CLIENT}\"\n\
                     client_secret = \"{EXCHANGE_SECRET}\"\n"
                ),
                ..Options::default()
            },
        );
        let runtime = dir.path().join("run");
        let log = dir.path().join("broker.log");
        let mut broker = tokio::process::Command::new(bin("sharedos-broker"));
        broker
            .arg("--runtime-dir")
            .arg(&runtime)
            .args(["serve", "--config"])
            .arg(&config)
            .env("SHAREDOS_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .kill_on_drop(true);
        let broker = broker.spawn().expect("sharedos-broker serve");
        let world = Self {
            dir,
            runtime,
            log,
            oidc,
            server_log,
            provider_lines,
            _provider: provider,
            _server: server,
            _broker: broker,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while ControlClient::connect(&world.runtime).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the broker did not start: {}",
                std::fs::read_to_string(&world.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(world)
    }

    async fn control(&self, req: ControlRequest) -> ControlResponse {
        ControlClient::connect(&self.runtime)
            .await
            .expect("control")
            .call(&req)
            .await
            .expect("answer")
    }

    async fn open_turn(&self, principal: &str, subject: Option<&str>) -> TurnOpened {
        match self
            .control(ControlRequest::OpenTurn(Box::new(OpenTurn {
                principal: principal.into(),
                subject_token: subject.map(|s| SubjectToken::new(s.to_owned())),
                ..Default::default()
            })))
            .await
        {
            ControlResponse::TurnOpened(t) => t,
            other => panic!("{other:?}"),
        }
    }

    /// `turn open --subject-token-file` with the CLI: the turn's token.
    async fn open_turn_cli(&self, principal: &str, subject: &str) -> String {
        let file = self.dir.path().join(format!("{principal}.subject"));
        std::fs::write(&file, format!("{subject}\n")).expect("subject file");
        let out = tokio::process::Command::new(bin("sharedos-broker"))
            .arg("--runtime-dir")
            .arg(&self.runtime)
            .args(["turn", "open", "--principal", principal, "--json"])
            .arg("--subject-token-file")
            .arg(&file)
            .output()
            .await
            .expect("sharedos-broker turn open");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!stdout.contains(subject), "the CLI prints no subject token");
        let v: Value = serde_json::from_str(&stdout).expect("turn open --json");
        v["token"].as_str().expect("token").to_owned()
    }

    /// `providers`, as JSON text, and provider `r`'s entry.
    async fn providers(&self) -> (String, Value) {
        match self.control(ControlRequest::Providers).await {
            ControlResponse::Providers { providers } => {
                let r = providers
                    .iter()
                    .find(|p| p["namespace"] == "r")
                    .cloned()
                    .unwrap_or_default();
                (serde_json::to_string(&providers).expect("json"), r)
            }
            other => panic!("{other:?}"),
        }
    }

    /// A fresh access token of `account` from the provider (what a host holds for them).
    async fn subject_token(&self, account: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.oidc))
            .await
            .expect("connect to the provider");
        s.write_all(
            format!(
                "POST /test/subject?account={account} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\n\r\n",
                self.oidc
            )
            .as_bytes(),
        )
        .await
        .expect("ask");
        let mut answer = String::new();
        tokio::time::timeout(WAIT, s.read_to_string(&mut answer))
            .await
            .expect("in time")
            .expect("read");
        let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
        assert!(head.contains(" 200 "), "{answer}");
        assert!(body.len() >= 20, "{body}");
        body.to_owned()
    }

    fn shim(&self, token: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        cmd.env(runtime::TOKEN_ENV, token)
            .env(runtime::BROKER_ENV, runtime::bridge_socket(&self.runtime))
            .env_remove(runtime::RUNTIME_DIR_ENV)
            .kill_on_drop(true);
        cmd
    }

    /// The provider's stdout lines that are `line`.
    fn provider_said(&self, line: &str) -> usize {
        self.provider_lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| *l == line)
            .count()
    }

    fn exchanges(&self, account: &str) -> usize {
        let resource = self.resource();
        self.provider_said(&format!("exchange {account} {resource}"))
    }

    fn resource(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("broker.toml"))
            .expect("config")
            .lines()
            .find_map(|l| l.strip_prefix("url = \""))
            .map(|u| u.trim_end_matches('"').to_owned())
            .expect("url")
    }

    fn server_lines(&self, prefix: &str) -> usize {
        std::fs::read_to_string(&self.server_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }
}

/// One call of `r.whoami` on a raw shim: the result.
async fn whoami(raw: &mut Raw, id: i64) -> Value {
    raw.call(id, "r.whoami", json!({})).await["result"].clone()
}

/// alice (the provider's `list_as`) opens a turn with her own token: the provider lists its tools
/// with her exchanged token while the open waits, so the turn has them. Her calls carry a token
/// of the server's audience with her subject (the server says `alice`), exchanged once while it
/// is cached, again once it expired, and once when the server refuses it (a 401: the call is
/// sent again with the new token); bob's turn (opened with the CLI from a file) gets his.
/// A turn without a subject token is refused `missing_credential` before anything reaches the
/// server; a subject token the provider refuses likewise, with its OAuth error code. No token,
/// subject or exchanged, is in the record, the broker's debug log or `providers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs oidc-provider (.ci/install-browser) and PyPI mcp 2.3.0 in SHAREDOS_PYTHON"]
async fn a_hosts_token_is_exchanged_per_principal_for_the_servers_own() {
    let Some(python) = crate::remote::python() else {
        return;
    };
    let Some(world) = World::start(&python).await else {
        return;
    };
    let mut tokens = Vec::new();
    let mut answers = Vec::new();

    // Before any subject token: the provider waits for alice's, and says so.
    let (_, r) = world.providers().await;
    assert!(
        r["lastError"]
            .as_str()
            .is_some_and(|e| e
                .contains("waiting for a turn of `alice` (list_as) opened with a subject token")),
        "{r}"
    );
    assert_eq!(world.server_lines("whoami"), 0);

    // alice's turn: the tools are listed as she opens it, with her exchanged token.
    let alice_subject = world.subject_token("alice").await;
    tokens.push(alice_subject.clone());
    let turn = world.open_turn("alice", Some(&alice_subject)).await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    assert!(names.contains(&"r.whoami".to_owned()), "{names:?}");
    assert_eq!(world.exchanges("alice"), 1, "the listing exchanged hers");
    let mut alice = Raw::spawn(world.shim(turn.token.expose()));
    alice.initialize("2025-11-25").await;
    for id in 1..=2 {
        let r = whoami(&mut alice, id).await;
        assert_eq!(text(&r), "alice", "{r}");
        answers.push(r.to_string());
    }
    assert_eq!(world.server_lines("whoami alice"), 2);
    assert_eq!(
        world.exchanges("alice"),
        1,
        "one exchange while it is cached"
    );

    // bob's turn, opened by the CLI from a file: his own token, exchanged once.
    let bob_subject = world.subject_token("bob").await;
    tokens.push(bob_subject.clone());
    let bob_turn = world.open_turn_cli("bob", &bob_subject).await;
    let mut bob = Raw::spawn(world.shim(&bob_turn));
    bob.initialize("2025-11-25").await;
    for id in 1..=2 {
        let r = whoami(&mut bob, id).await;
        assert_eq!(text(&r), "bob", "{r}");
        answers.push(r.to_string());
    }
    assert_eq!(world.server_lines("whoami bob"), 2);
    assert_eq!(world.exchanges("bob"), 1);

    // A turn of bob without a subject token: refused, and nothing reaches the server.
    let before = world.server_lines("token");
    let bare = world.open_turn("bob", None).await;
    let mut bare_shim = Raw::spawn(world.shim(bare.token.expose()));
    bare_shim.initialize("2025-11-25").await;
    let r = whoami(&mut bare_shim, 1).await;
    assert_eq!(meta(&r)["code"], "missing_credential", "{r}");
    assert!(text(&r).contains("--subject-token-file"), "{r}");
    answers.push(r.to_string());
    // A subject token the authorization server refuses: carol's call is refused, naming the
    // OAuth error code, and nothing reaches the server.
    let forged = "not-a-token-this-provider-issued-0123456789";
    tokens.push(forged.to_owned());
    let carol = world.open_turn("carol", Some(forged)).await;
    let mut carol_shim = Raw::spawn(world.shim(carol.token.expose()));
    carol_shim.initialize("2025-11-25").await;
    let r = whoami(&mut carol_shim, 1).await;
    assert_eq!(meta(&r)["code"], "missing_credential", "{r}");
    assert!(text(&r).contains("invalid_grant"), "{r}");
    answers.push(r.to_string());
    assert_eq!(world.provider_said("exchange-error subject_token"), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        world.server_lines("token"),
        before,
        "nothing reached the server"
    );

    // alice's exchanged token expires: her next call exchanges her subject token again, once.
    tokio::time::sleep(Duration::from_secs(TTL)).await;
    let r = whoami(&mut alice, 3).await;
    assert_eq!(text(&r), "alice", "{r}");
    answers.push(r.to_string());
    assert_eq!(world.exchanges("alice"), 2);
    let r = whoami(&mut alice, 4).await;
    assert_eq!(text(&r), "alice", "{r}");
    assert_eq!(world.exchanges("alice"), 2);

    // The server refuses alice's exchanged token before it expires (revoked there): the 401 has
    // her subject token exchanged again, once, and the call sent again with the new token.
    let current = world
        .read("tokens-seen")
        .lines()
        .last()
        .expect("a token the server accepted")
        .to_owned();
    std::fs::write(world.dir.path().join("revoked"), format!("{current}\n")).expect("revoke");
    let r = whoami(&mut alice, 5).await;
    assert_eq!(text(&r), "alice", "{r}");
    answers.push(r.to_string());
    let refused = world.server_lines("token refused revoked");
    assert!(refused >= 1, "the server refused the revoked token");
    assert_eq!(world.exchanges("alice"), 3, "one exchange on the 401");
    let r = whoami(&mut alice, 6).await;
    assert_eq!(text(&r), "alice", "{r}");
    assert_eq!(world.exchanges("alice"), 3);
    assert_eq!(
        world.server_lines("token refused revoked"),
        refused,
        "the new token is the one sent"
    );
    let (providers, r) = world.providers().await;
    assert_eq!(r["oauthTokenExchanges"], 5, "{r}");

    // No token anywhere but the wire: the subject tokens and every token the server accepted.
    tokens.extend(world.read("tokens-seen").lines().map(str::to_owned));
    assert!(tokens.len() >= 7, "{}", tokens.len());
    let record = world.read("record.jsonl");
    let log = std::fs::read_to_string(&world.log).expect("log");
    assert!(
        log.contains("subject token exchanged"),
        "the log is the broker's"
    );
    for t in &tokens {
        assert!(t.len() >= 20, "a real token");
        for (place, text) in [
            ("the record", &record),
            ("the broker's log", &log),
            ("providers", &providers),
        ] {
            assert!(!text.contains(t.as_str()), "a token in {place}");
        }
        for a in &answers {
            assert!(!a.contains(t.as_str()), "a token in an answer");
        }
    }
    drop((alice, bob, bare_shim, carol_shim));
}

/// A host's subject token that is empty, over 64 KiB, or holds whitespace or control characters
/// is refused at turn open (`invalid_subject_token`), without the token in the refusal or the
/// record, and no turn is opened; a well-formed one opens its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_subject_token_is_refused_at_turn_open_without_showing_it() {
    let b = crate::kit::TestBroker::start(Options::default()).await;
    let long = format!("long-subject-{}", "x".repeat(64 * 1024));
    let bad = [
        String::new(),
        "subject-with a-space".to_owned(),
        "subject-with\nnewline".to_owned(),
        "subject-with-bell\u{7}".to_owned(),
        long.clone(),
    ];
    for token in &bad {
        let refused = b
            .host()
            .await
            .call(&ControlRequest::OpenTurn(Box::new(OpenTurn {
                principal: "alice".into(),
                subject_token: Some(SubjectToken::new(token.clone())),
                ..Default::default()
            })))
            .await;
        let message = match refused {
            Err(e) => e.to_string(),
            Ok(other) => panic!("expected a refusal, got {other:?}"),
        };
        assert!(message.contains("(invalid_subject_token)"), "{message}");
        assert!(!message.contains("subject-with"), "the token is not shown");
        assert!(!message.contains("long-subject"), "the token is not shown");
    }
    let record = std::fs::read_to_string(b.record_path()).unwrap_or_default();
    assert!(!record.contains("subject-with") && !record.contains("long-subject"));
    let opened = |b: &crate::kit::TestBroker| {
        b.records()
            .iter()
            .filter(|l| l["kind"] == "turn_opened")
            .count()
    };
    assert_eq!(opened(&b), 0, "no turn opened for a malformed token");
    let ok = b
        .open(OpenTurn {
            principal: "alice".into(),
            subject_token: Some(SubjectToken::new(long[..64 * 1024].to_owned())),
            ..Default::default()
        })
        .await;
    assert!(!ok.turn.is_empty());
    assert_eq!(opened(&b), 1, "a token of exactly 64 KiB opens its turn");
}
