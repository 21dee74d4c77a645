//! Issue 45 item 3: signing people in to remote servers. A remote MCP server that accepts only
//! each person's own token, behind the broker per principal (`[providers.oauth] grant =
//! "authorization_code"`): the person signs in on their page, in a real browser, at a real
//! authorization server; the broker discovers everything from the server's 401.
//!
//! Real parts, none written here: npm `oidc-provider` as the server's authorization server
//! (`tests/node/oidc_provider.mjs` with MCP_RESOURCE: JWT access tokens for the server's audience,
//! refresh tokens, dynamic client registration), the PyPI `mcp` SDK's MCPServer verifying those
//! tokens against the provider's JWKS (`tests/python/signin_server.py`), Debian's headless
//! chromium driven by PyPI selenium as the person (`tests/python/page_person.py`), the PyPI `mcp`
//! client as the harness that shows the link (`tests/python/elicit_client.py`), and the broker as
//! its own process (`sharedos-broker serve`, its log at debug level searched for tokens).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use sharedos_host::client::ControlClient;
use sharedos_ipc::runtime;
use sharedos_proto::ipc::{ControlRequest, ControlResponse, OpenTurn, TurnOpened};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::kit::{Options, Raw, WAIT, bin, eventually, installed, text};

const POLICY: &str = r#"
@id("people-call-r")
permit(principal, action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name like "r.*" };
"#;

const CLIENT_ID: &str = "sharedos-page";
const CLIENT_SECRET: &str = "a-client-secret-for-the-test-provider";
/// The access tokens' lifetime: short, so that one expires within the test.
const TTL: u64 = 8;
/// What a browser run may take (chromium starts slowly on two busy cores).
const LONG: Duration = Duration::from_secs(240);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A child's stdout lines, kept as they come.
fn collect(
    stdout: tokio::process::ChildStdout,
) -> (Arc<Mutex<Vec<String>>>, tokio::sync::mpsc::Receiver<String>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let kept = lines.clone();
    tokio::spawn(async move {
        let mut reader = tokio::io::BufReader::new(stdout).lines();
        while let Ok(Some(l)) = reader.next_line().await {
            kept.lock().expect("lines").push(l.clone());
            let _ = tx.try_send(l);
        }
    });
    (lines, rx)
}

struct World {
    dir: tempfile::TempDir,
    runtime: PathBuf,
    log: PathBuf,
    page: u16,
    oidc: u16,
    server_log: PathBuf,
    browser: std::collections::BTreeMap<String, String>,
    grants: Arc<Mutex<Vec<String>>>,
    _provider: tokio::process::Child,
    _server: tokio::process::Child,
    _broker: tokio::process::Child,
}

impl World {
    async fn start(python: &str) -> Option<Self> {
        let browser = installed("browser", ".ci/install-browser")?;
        let (page, oidc, port) = (free_port(), free_port(), free_port());
        let dir = tempfile::Builder::new()
            .prefix("sharedos-signin-")
            .tempdir()
            .expect("tmp");
        let resource = format!("http://127.0.0.1:{port}/mcp");
        let mut provider = tokio::process::Command::new(&browser["NODE"]);
        provider
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/node/oidc_provider.mjs"
            ))
            .env("OIDC_NODE_PATH", &browser["OIDC_NODE_PATH"])
            .env("PORT", oidc.to_string())
            .env("CLIENT_ID", CLIENT_ID)
            .env("CLIENT_SECRET", CLIENT_SECRET)
            .env("REDIRECT_URI", format!("http://127.0.0.1:{page}/callback"))
            .env("MCP_RESOURCE", &resource)
            .env("RESOURCE_TTL", TTL.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut provider = provider.spawn().expect("node oidc_provider.mjs");
        let (grants, mut rx) = collect(provider.stdout.take().expect("stdout"));
        let first = tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("the provider starts in time")
            .expect("a line");
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
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let mut server = server.spawn().expect("signin_server.py");
        let (_, mut srx) = collect(server.stdout.take().expect("stdout"));
        let first = tokio::time::timeout(Duration::from_secs(30), srx.recv())
            .await
            .expect("the server starts in time")
            .expect("a line");
        assert_eq!(first, format!("PORT {port}"));

        let secret = dir.path().join("client-secret");
        std::fs::write(&secret, format!("{CLIENT_SECRET}\n")).expect("secret");
        let config = crate::kit::write_config(
            dir.path(),
            &Options {
                policy: POLICY,
                tables: format!(
                    "[page]\nlisten = \"127.0.0.1:{page}\"\npublic_url = \"http://127.0.0.1:{page}/\"\n\
                     issuer = \"http://127.0.0.1:{oidc}\"\nclient_id = \"{CLIENT_ID}\"\n\
                     client_secret_file = \"{}\"\nprincipal_claim = \"preferred_username\"\n\
                     [[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = \"{resource}\"\n\
                     instances = \"per_principal\"\nlist_as = \"alice\"\ncall_timeout_seconds = 300\n\
                     startup_timeout_seconds = 20\n[providers.oauth]\ngrant = \"authorization_code\"\n",
                    secret.display()
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
            page,
            oidc,
            server_log,
            browser,
            grants,
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

    async fn open_turn(&self, principal: &str) -> TurnOpened {
        match self
            .control(ControlRequest::OpenTurn(Box::new(OpenTurn {
                principal: principal.into(),
                ..Default::default()
            })))
            .await
        {
            ControlResponse::TurnOpened(t) => t,
            other => panic!("{other:?}"),
        }
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

    fn shim(&self, token: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(bin("sharedos-mcp-shim"));
        cmd.env(runtime::TOKEN_ENV, token)
            .env(runtime::BROKER_ENV, runtime::bridge_socket(&self.runtime))
            .env_remove(runtime::RUNTIME_DIR_ENV)
            .kill_on_drop(true);
        cmd
    }

    fn record(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("record.jsonl")).unwrap_or_default()
    }

    fn records(&self, kind: &str) -> Vec<Value> {
        self.record()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["kind"] == kind)
            .collect()
    }

    fn grants(&self, line: &str) -> usize {
        self.grants
            .lock()
            .expect("grants")
            .iter()
            .filter(|l| *l == line)
            .count()
    }

    fn server_lines(&self, line: &str) -> usize {
        std::fs::read_to_string(&self.server_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == line)
            .count()
    }

    /// The tokens stored for `principal` (access and refresh), and the file's mode.
    fn stored(&self, principal: &str) -> Option<(Vec<String>, u32)> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = self
            .dir
            .path()
            .join(format!("record.jsonl.oauth/{principal}/r"));
        let text = std::fs::read_to_string(&path).ok()?;
        let v: Value = serde_json::from_str(&text).expect("stored JSON");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        let tokens = ["access_token", "refresh_token"]
            .iter()
            .filter_map(|k| v[*k].as_str().map(str::to_owned))
            .collect();
        Some((tokens, mode))
    }

    /// The person at the browser: `page_person.py URL USER show`, its report.
    async fn person(&self, url: &str, user: &str) -> Value {
        self.person_does(url, user, "show").await
    }

    /// A crafted `POST path` to the page over HTTP/1.0: (status, body).
    async fn post(&self, path: &str, cookie: &str, body: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.page))
            .await
            .expect("connect to the page");
        let request = format!(
            "POST {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nCookie: sharedos-page={cookie}\r\n\r\n{body}",
            self.page,
            body.len()
        );
        s.write_all(request.as_bytes()).await.expect("write");
        let mut buf = Vec::new();
        tokio::time::timeout(WAIT, s.read_to_end(&mut buf))
            .await
            .expect("the page answers in time")
            .expect("read");
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (status, text)
    }

    /// `page_person.py URL USER ACTION`, its report.
    async fn person_does(&self, url: &str, user: &str, action: &str) -> Value {
        let mut cmd = tokio::process::Command::new(&self.browser["SELENIUM_PYTHON"]);
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/python/page_person.py"
        ))
        .args([url, user, action])
        .env("CHROMEDRIVER", &self.browser["CHROMEDRIVER"])
        .stdin(Stdio::null())
        .kill_on_drop(true);
        let out = tokio::time::timeout(LONG, cmd.output())
            .await
            .expect("the browser run ends in time")
            .expect("run page_person.py");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success(),
            "page_person.py {url}:\n{stdout}\n{stderr}"
        );
        serde_json::from_str(stdout.lines().last().unwrap_or("{}"))
            .unwrap_or_else(|e| panic!("report ({e}): {stdout}\n{stderr}"))
    }

    /// The PyPI mcp client as the harness: calls `r.whoami` once; the link of a URL-mode
    /// question is written to `url_file`; `answer` is what the person does with it.
    fn harness(
        &self,
        python: &str,
        token: &str,
        answer: &str,
        url_file: &Path,
    ) -> tokio::task::JoinHandle<Value> {
        let mut cmd = tokio::process::Command::new(python);
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/python/elicit_client.py"
        ))
        .env("SHAREDOS_SHIM", bin("sharedos-mcp-shim"))
        .env("SHAREDOS_TURN_TOKEN", token)
        .env("SHAREDOS_BROKER", runtime::bridge_socket(&self.runtime))
        .env("ELICIT_MODE", "legacy")
        .env("ELICIT_ANSWER", answer)
        .env("ELICIT_READ_TIMEOUT", "600")
        .env("ELICIT_URL_FILE", url_file)
        .env("ELICIT_CALLS", json!([["r.whoami", {}]]).to_string())
        .stdin(Stdio::null())
        .kill_on_drop(true);
        tokio::spawn(async move {
            let out = tokio::time::timeout(Duration::from_secs(600), cmd.output())
                .await
                .expect("the harness ends in time")
                .expect("run the harness");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "harness failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_str(stdout.lines().last().unwrap_or("{}")).expect("report")
        })
    }
}

/// One call of `r.whoami` on a raw shim: the result.
async fn whoami(raw: &mut Raw, id: i64) -> Value {
    raw.call(id, "r.whoami", json!({})).await["result"].clone()
}

/// alice (the provider's `list_as`) signs in ahead on her page (`/connect/r`), and the provider
/// lists its tools with her sign-in; her calls carry her own token (the server says `alice`). bob's
/// first call is held and his harness shown a link to his page; he signs in in the browser and
/// the held call goes on with his token (`bob`). alice's expired access token is refreshed once
/// (counted at the authorization server); after her refresh token is revoked, her next call asks
/// her again (a new link; declined here, so the call fails `sign_in_required` with it). No token
/// is in the record, the broker's debug log, `providers` or any answer; the stored ones are 0600.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser) and PyPI mcp 2.3.0 in SHAREDOS_PYTHON"]
async fn people_sign_in_to_a_remote_server_and_their_calls_carry_their_own_tokens() {
    let Some(python) = crate::remote::python() else {
        return;
    };
    let Some(world) = World::start(&python).await else {
        return;
    };
    let base = format!("http://127.0.0.1:{}", world.page);
    let mut answers = Vec::new();
    let mut seen_tokens = Vec::new();

    // Before anyone signs in: the provider waits for alice, and says so.
    let (_, r) = world.providers().await;
    assert!(
        r["lastError"]
            .as_str()
            .is_some_and(|e| e.contains("waiting for `alice` (list_as) to sign in")),
        "{r}"
    );

    // alice signs in to the server ahead of any call, on her page.
    let shown = world.person(&format!("{base}/connect/r"), "alice").await;
    assert_eq!(shown["title"], "Signed in", "{shown}");
    assert_eq!(shown["principal"], "alice", "{shown}");
    let (tokens, mode) = world.stored("alice").expect("alice's tokens are stored");
    assert_eq!(mode, 0o600);
    assert_eq!(tokens.len(), 2, "an access and a refresh token");
    seen_tokens.extend(tokens);
    assert_eq!(world.grants("grant authorization_code alice mcp"), 1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, r) = world.providers().await;
        if r["state"] == "ready" && r["tools"].as_array().is_some_and(|t| !t.is_empty()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "r never listed its tools: {r}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // alice's calls carry her token.
    let turn = world.open_turn("alice").await;
    let mut alice = Raw::spawn(world.shim(turn.token.expose()));
    alice.initialize("2025-11-25").await;
    for id in 1..=2 {
        let r = whoami(&mut alice, id).await;
        assert_eq!(text(&r), "alice", "{r}");
        answers.push(r.to_string());
    }
    assert_eq!(world.server_lines("whoami alice"), 2);

    // bob's first call asks him: his harness is shown a link to his page; the call waits.
    let bob_turn = world.open_turn("bob").await;
    let dir = tempfile::tempdir().expect("tmp");
    let url_file = dir.path().join("url");
    let harness = world.harness(&python, bob_turn.token.expose(), "approve", &url_file);
    eventually("bob's harness is shown the link", || url_file.exists()).await;
    let link = std::fs::read_to_string(&url_file).expect("url");
    assert!(link.starts_with(&format!("{base}/signin/")), "{link}");
    assert_eq!(link.rsplit('/').next().map(str::len), Some(32), "{link}");
    // alice cannot use bob's link.
    let refused = world.person(&link, "alice").await;
    assert_eq!(refused["title"], "Sign-in refused", "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("for principal `bob`")),
        "{refused}"
    );
    let shown = world.person(&link, "bob").await;
    assert_eq!(shown["title"], "Signed in", "{shown}");
    assert_eq!(shown["principal"], "bob", "{shown}");
    let report = harness.await.expect("harness");
    assert_eq!(report["calls"][0], json!([false, "bob", "ok"]), "{report}");
    assert_eq!(
        report["questions"].as_array().map(Vec::len),
        Some(1),
        "{report}"
    );
    assert_eq!(report["questions"][0]["mode"], "url", "{report}");
    answers.push(report.to_string());
    assert_eq!(world.server_lines("whoami bob"), 1);
    assert_eq!(world.grants("grant authorization_code bob mcp"), 1);
    // The used link signs nobody in again.
    let again = world.person(&link, "bob").await;
    assert_eq!(again["title"], "Sign-in refused", "{again}");
    let (tokens, mode) = world.stored("bob").expect("bob's tokens are stored");
    assert_eq!(mode, 0o600);
    seen_tokens.extend(tokens);
    // bob signs out on his page: his tokens are forgotten, and his next call, from a client that
    // shows no links, fails `sign_in_required` with a new link (nothing reaches the server).
    let session = world
        .person_does(&format!("{base}/"), "bob", "session")
        .await;
    let cookie = session["cookies"]["sharedos-page"]
        .as_str()
        .expect("bob's session cookie")
        .to_owned();
    let csrf = session["csrf"].as_str().expect("bob's csrf").to_owned();
    let (status, body) = world
        .post("/connect/r/signout", &cookie, "csrf=wrong")
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        world.stored("bob").is_some(),
        "a form without the CSRF token signs nobody out"
    );
    let (status, body) = world
        .post("/connect/r/signout", &cookie, &format!("csrf={csrf}"))
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("signed out of <code>r</code>"), "{body}");
    assert!(world.stored("bob").is_none(), "bob's tokens are forgotten");
    let mut bob = Raw::spawn(world.shim(bob_turn.token.expose()));
    bob.initialize("2025-11-25").await;
    let r = whoami(&mut bob, 1).await;
    assert_eq!(crate::kit::meta(&r)["code"], "sign_in_required", "{r}");
    assert!(text(&r).contains(&format!("{base}/signin/")), "{r}");
    answers.push(r.to_string());
    assert_eq!(
        world.server_lines("whoami bob"),
        1,
        "nothing reached the server"
    );
    drop(bob);
    let asked: Vec<Value> = world
        .records("provider_state")
        .into_iter()
        .filter(|l| l["state"] == "sign_in_asked" || l["state"] == "signed_in")
        .collect();
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert_eq!(asked[1]["state"], "signed_in", "{asked:?}");
    assert_eq!(asked[2]["state"], "sign_in_asked", "{asked:?}");
    assert_eq!(asked[0]["principal"], "bob");
    assert!(
        asked[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains(&link)),
        "{asked:?}"
    );

    // alice's access token expires: her next call refreshes it once, and goes on.
    tokio::time::sleep(Duration::from_secs(TTL)).await;
    let refreshes = world.grants("grant refresh_token alice mcp");
    let r = whoami(&mut alice, 3).await;
    assert_eq!(text(&r), "alice", "{r}");
    answers.push(r.to_string());
    assert_eq!(world.grants("grant refresh_token alice mcp"), refreshes + 1);
    let (tokens, _) = world.stored("alice").expect("alice's new tokens");
    seen_tokens.extend(tokens);
    let (_, r) = world.providers().await;
    assert!(
        r["oauthSignInRefreshes"].as_u64().is_some_and(|n| n >= 1),
        "{r}"
    );

    // Her refresh token is revoked: the next call, once the access token expired, asks her to
    // sign in again; her harness declines the link, so the call fails with it.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", world.oidc))
        .await
        .expect("connect to the provider");
    s.write_all(
        format!(
            "POST /test/revoke?account=alice HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\n\r\n",
            world.oidc
        )
        .as_bytes(),
    )
    .await
    .expect("revoke");
    let mut revoked = String::new();
    tokio::time::timeout(WAIT, s.read_to_string(&mut revoked))
        .await
        .expect("in time")
        .expect("read");
    assert!(
        revoked.starts_with("HTTP/1.1 200") || revoked.starts_with("HTTP/1.0 200"),
        "{revoked}"
    );
    tokio::time::sleep(Duration::from_secs(TTL)).await;
    let alice_again = world.open_turn("alice").await;
    let url_file = dir.path().join("url-alice");
    let report = world
        .harness(&python, alice_again.token.expose(), "decline", &url_file)
        .await
        .expect("harness");
    answers.push(report.to_string());
    assert_eq!(report["calls"][0][0], true, "{report}");
    assert_eq!(report["calls"][0][2], "sign_in_required", "{report}");
    let link = std::fs::read_to_string(&url_file).expect("a new link");
    assert!(link.starts_with(&format!("{base}/signin/")), "{link}");
    assert!(
        report["calls"][0][1]
            .as_str()
            .is_some_and(|t| t.contains(&link)),
        "{report}"
    );
    assert_eq!(world.grants("grant-error refresh_token invalid_grant"), 1);
    assert!(
        world.stored("alice").is_none(),
        "the refused sign-in is forgotten"
    );
    let calls: Vec<Value> = world
        .records("call")
        .into_iter()
        .filter(|l| l["turn"] == alice_again.turn.as_str())
        .collect();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(meta_code(&calls[0]), "sign_in_required", "{calls:?}");

    // No token anywhere but the store and the wire.
    let (providers, _) = world.providers().await;
    let record = world.record();
    let log = std::fs::read_to_string(&world.log).expect("log");
    assert!(
        log.contains("signed in to a remote server"),
        "the log is the broker's"
    );
    assert!(seen_tokens.len() >= 5, "{}", seen_tokens.len());
    for t in &seen_tokens {
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
    drop(alice);
}

/// A call line's outcome code.
fn meta_code(line: &Value) -> String {
    line["code"].as_str().unwrap_or_default().to_owned()
}
