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
    config: PathBuf,
    runtime: PathBuf,
    log: PathBuf,
    page: u16,
    oidc: u16,
    /// The remote MCP server's port.
    server_port: u16,
    server_log: PathBuf,
    browser: std::collections::BTreeMap<String, String>,
    /// With the page on HTTPS: its scheme and the SHA-256 of its key (base64), which the
    /// browser is told to trust (`--ignore-certificate-errors-spki-list`).
    https: Option<String>,
    grants: Arc<Mutex<Vec<String>>>,
    _provider: tokio::process::Child,
    _server: tokio::process::Child,
    _broker: tokio::process::Child,
}

impl World {
    /// The world with `list_as` the principal the provider lists its tools as.
    async fn start(python: &str, list_as: &str) -> Option<Self> {
        Self::start_with(python, list_as, false).await
    }

    /// With `https`: the page is served over HTTPS (a test CA's certificate, which the provider
    /// trusts through NODE_EXTRA_CA_CERTS), and the provider takes client ID metadata documents
    /// and registers no clients.
    async fn start_with(python: &str, list_as: &str, https: bool) -> Option<Self> {
        let browser = installed("browser", ".ci/install-browser")?;
        let (page, oidc, port) = (free_port(), free_port(), free_port());
        let dir = tempfile::Builder::new()
            .prefix("sharedos-signin-")
            .tempdir()
            .expect("tmp");
        let scheme = if https { "https" } else { "http" };
        let (tls, spki) = if https {
            use base64::Engine as _;
            use rcgen::PublicKeyData as _;
            use sha2::Digest as _;
            let (ca, cert, key) = crate::remote::test_pki(dir.path(), "127.0.0.1");
            let pair = rcgen::KeyPair::from_pem(&std::fs::read_to_string(&key).expect("key"))
                .expect("the test key");
            let spki = base64::engine::general_purpose::STANDARD
                .encode(sha2::Sha256::digest(pair.subject_public_key_info()));
            (
                format!(
                    "cert = \"{}\"\nkey = \"{}\"\n",
                    cert.display(),
                    key.display()
                ),
                Some((ca, spki)),
            )
        } else {
            (String::new(), None)
        };
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
            .env(
                "REDIRECT_URI",
                format!("{scheme}://127.0.0.1:{page}/callback"),
            )
            .env("MCP_RESOURCE", &resource)
            .env("RESOURCE_TTL", TTL.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if let Some((ca, _)) = &spki {
            provider
                .env("NODE_EXTRA_CA_CERTS", ca)
                .env("CLIENT_ID_METADATA_DOCUMENTS", "1");
        }
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
                    "[page]\nlisten = \"127.0.0.1:{page}\"\npublic_url = \"{scheme}://127.0.0.1:{page}/\"\n{tls}\
                     issuer = \"http://127.0.0.1:{oidc}\"\nclient_id = \"{CLIENT_ID}\"\n\
                     client_secret_file = \"{}\"\nprincipal_claim = \"preferred_username\"\n\
                     [[providers]]\ntype = \"mcp\"\nnamespace = \"r\"\nurl = \"{resource}\"\n\
                     instances = \"per_principal\"\nlist_as = \"{list_as}\"\ncall_timeout_seconds = 300\n\
                     startup_timeout_seconds = 20\n[providers.oauth]\ngrant = \"authorization_code\"\n",
                    secret.display(),
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
            config,
            runtime,
            log,
            page,
            oidc,
            server_port: port,
            server_log,
            browser,
            https: spki.map(|(_, s)| s),
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

    /// Waits until provider `r` is ready with its tools listed.
    async fn wait_listed(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (_, r) = self.providers().await;
            if r["state"] == "ready" && r["tools"].as_array().is_some_and(|t| !t.is_empty()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "r never listed its tools: {r}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
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

    /// `sharedos-broker secrets ARGS --config <the broker's> --principal P`: exit code, stdout,
    /// stderr.
    fn secrets(&self, args: &[&str], principal: &str) -> (i32, String, String) {
        let out = std::process::Command::new(bin("sharedos-broker"))
            .arg("secrets")
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .args(["--principal", principal])
            .output()
            .expect("sharedos-broker secrets");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
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

    /// A crafted `GET path` to the page with `cookies` (a `Cookie` header's value): (status,
    /// the whole response).
    async fn get(&self, path: &str, cookies: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.page))
            .await
            .expect("connect to the page");
        let request = format!(
            "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nCookie: {cookies}\r\n\r\n",
            self.page
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

    /// A sign-in started with a crafted `GET path` (`/signin/<id>` or `/connect/r`) as the
    /// page's session `cookie`: the authorization server URL the page sends the browser to, its
    /// `state`, and the browser's sign-in cookie (`sharedos-signin=…`).
    async fn start_sign_in(&self, path: &str, cookie: &str) -> (String, String, String) {
        let (status, text) = self.get(path, &format!("sharedos-page={cookie}")).await;
        assert_eq!(status, 303, "{text}");
        let header = |name: &str| {
            text.lines()
                .find_map(|l| {
                    l.split_once(':')
                        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                        .map(|(_, v)| v.trim().to_owned())
                })
                .unwrap_or_else(|| panic!("no {name}: {text}"))
        };
        let to = header("location");
        assert!(
            to.starts_with(&format!("http://127.0.0.1:{}/", self.oidc)),
            "{to}"
        );
        // A state is URL-safe base64: as it is in the query.
        let state = to
            .split(['?', '&'])
            .find_map(|p| p.strip_prefix("state="))
            .expect("a state")
            .to_owned();
        let cookie = header("set-cookie");
        assert!(
            cookie.starts_with("sharedos-signin=")
                && cookie.contains("HttpOnly")
                && cookie.contains("SameSite=Lax"),
            "{cookie}"
        );
        let browser = cookie.split(';').next().unwrap_or_default().to_owned();
        (to, state, browser)
    }

    /// The person at the browser: signed in at `first` (the page), then opens `then` in the
    /// same browser; the report of `then`.
    async fn person_then(&self, first: &str, user: &str, then: &str) -> Value {
        self.person_run(first, user, "show", Some(then)).await
    }

    /// `page_person.py URL USER ACTION`, its report.
    async fn person_does(&self, url: &str, user: &str, action: &str) -> Value {
        self.person_run(url, user, action, None).await
    }

    async fn person_run(&self, url: &str, user: &str, action: &str, then: Option<&str>) -> Value {
        let mut cmd = tokio::process::Command::new(&self.browser["SELENIUM_PYTHON"]);
        if let Some(then) = then {
            cmd.env("THEN_URL", then);
        }
        if let Some(spki) = &self.https {
            cmd.env("TRUST_SPKI", spki);
        }
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
    let Some(world) = World::start(&python, "alice").await else {
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
    let asked = &report["questions"][0];
    assert_eq!(asked["mode"], "url", "{report}");
    assert_sign_in_question(asked, "bob", &link, world.server_port);
    // The client is told once that the sign-in it showed is complete, by its elicitationId.
    assert_eq!(
        report["completed"],
        json!([asked["elicitationId"]]),
        "{report}"
    );
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
    // Declined: no sign-in to complete, and none is said to be.
    assert_eq!(report["completed"], json!([]), "{report}");
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

    // alice signs in again on her page; her open session's next call carries the new token. The
    // operator then signs her out with `secrets delete --sign-in`, the broker still running:
    // the token her session holds is not sent again, and her next call asks her to sign in.
    let shown = world.person(&format!("{base}/connect/r"), "alice").await;
    assert_eq!(shown["title"], "Signed in", "{shown}");
    assert_eq!(world.grants("grant authorization_code alice mcp"), 2);
    let (tokens, _) = world.stored("alice").expect("alice's tokens again");
    seen_tokens.extend(tokens);
    let r = whoami(&mut alice, 4).await;
    assert_eq!(text(&r), "alice", "{r}");
    answers.push(r.to_string());
    let whoami_alice = world.server_lines("whoami alice");
    let (code, out, err) = world.secrets(&["list", "--sign-ins"], "alice");
    assert_eq!((code, out.as_str()), (0, "r\n"), "{err}");
    let (code, out, err) = world.secrets(&["list", "--sign-ins"], "bob");
    assert_eq!(
        (code, out.as_str()),
        (0, ""),
        "bob signed out on his page: {err}"
    );
    let (code, out, err) = world.secrets(&["delete", "--sign-in", "r"], "alice");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        "`alice` signed out of `r`: its next call there asks them to sign in again\n"
    );
    assert!(
        world.stored("alice").is_none(),
        "alice's tokens are removed"
    );
    let (code, _, err) = world.secrets(&["delete", "--sign-in", "r"], "alice");
    assert_eq!(code, 1, "a second sign-out finds nothing: {err}");
    assert!(
        err.contains("principal `alice` is not signed in to `r`"),
        "{err}"
    );
    let r = whoami(&mut alice, 5).await;
    assert_eq!(crate::kit::meta(&r)["code"], "sign_in_required", "{r}");
    assert!(text(&r).contains(&format!("{base}/signin/")), "{r}");
    answers.push(r.to_string());
    assert_eq!(
        world.server_lines("whoami alice"),
        whoami_alice,
        "the removed sign-in's token was not sent"
    );

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

/// The sign-in question as the harness showed it: SharedOS asks `principal` to sign in to `r`
/// at the server's host, the link opens their own page, and the link is in `url` alone (the
/// `elicitationId` is the shim's own, not the link's one-time id).
fn assert_sign_in_question(asked: &Value, principal: &str, link: &str, port: u16) {
    let message = asked["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(&format!(
            "SharedOS asks you, `{principal}`, to sign in to the remote MCP server `r` (127.0.0.1:{port})"
        )),
        "{message}"
    );
    assert!(
        message.contains("opens your own SharedOS page"),
        "{message}"
    );
    assert!(!message.contains("it is not SharedOS asking"), "{message}");
    assert_eq!(asked["url"], link, "{asked}");
    let id = link.rsplit('/').next().unwrap_or_default();
    let shown = asked.to_string().replace(link, "");
    assert!(!shown.contains(id), "the link's id outside `url`: {asked}");
    assert!(
        asked["elicitationId"]
            .as_str()
            .is_some_and(|e| e.starts_with("sharedos-signin-")),
        "{asked}"
    );
    assert_eq!(
        asked["_meta"],
        json!({"io.sharedos/sign-in": "r"}),
        "{asked}"
    );
}

/// Issue 45 item 1: every sign-in that does not finish is refused and leaves a
/// `provider_state` line `sign_in_refused` with its code and why (never a token, a code or a
/// state), and the held call is not sent: alice's link opened by bob, a link no sign-in has,
/// alice's link replayed; bob completing alice's sign-in at the authorization server in his own
/// browser (not the one that started it), and then in a browser signed in to the page as bob; a
/// used `state` replayed; a `state` never given; the authorization server's `access_denied`; a
/// code the token endpoint refuses. Then alice signs in herself, and her held call goes on once,
/// with her own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser) and PyPI mcp 2.3.0 in SHAREDOS_PYTHON"]
async fn refused_sign_ins_are_recorded_and_the_held_call_is_not_sent() {
    let Some(python) = crate::remote::python() else {
        return;
    };
    let Some(world) = World::start(&python, "bob").await else {
        return;
    };
    let base = format!("http://127.0.0.1:{}", world.page);

    // bob (the provider's list_as) signs in to the server on his page; the tools are listed.
    let bob = world
        .person_does(&format!("{base}/connect/r"), "bob", "session")
        .await;
    assert_eq!(bob["title"], "Signed in", "{bob}");
    let bob_cookie = bob["cookies"]["sharedos-page"]
        .as_str()
        .expect("bob's session cookie")
        .to_owned();
    world.wait_listed().await;

    // alice's first call is held: her harness is shown a link to her page.
    let turn = world.open_turn("alice").await;
    let dir = tempfile::tempdir().expect("tmp");
    let url_file = dir.path().join("url");
    let harness = world.harness(&python, turn.token.expose(), "approve", &url_file);
    eventually("alice's harness is shown the link", || url_file.exists()).await;
    let link = std::fs::read_to_string(&url_file).expect("url");
    let link_path = link
        .strip_prefix(&base)
        .expect("a link of the page")
        .to_owned();
    let alice = world
        .person_does(&format!("{base}/"), "alice", "session")
        .await;
    let alice_cookie = alice["cookies"]["sharedos-page"]
        .as_str()
        .expect("alice's session cookie")
        .to_owned();

    // Links: bob opens alice's; an id no link has; alice's used, then replayed.
    let (status, text) = world
        .get(&link_path, &format!("sharedos-page={bob_cookie}"))
        .await;
    assert_eq!(status, 403, "{text}");
    let (status, text) = world
        .get(
            "/signin/0123456789abcdef0123456789abcdef",
            &format!("sharedos-page={alice_cookie}"),
        )
        .await;
    assert_eq!(status, 410, "{text}");
    let (to, state, browser) = world.start_sign_in(&link_path, &alice_cookie).await;
    let (status, text) = world
        .get(&link_path, &format!("sharedos-page={alice_cookie}"))
        .await;
    assert_eq!(status, 410, "{text}");
    assert!(text.contains("was used already"), "{text}");

    // bob, in a browser of his own, signs in at the authorization server on alice's sign-in.
    let r = world.person(&to, "bob").await;
    assert_eq!(r["title"], "Sign-in refused", "{r}");
    assert!(
        r["message"]
            .as_str()
            .is_some_and(|m| m.contains("started in another browser")),
        "{r}"
    );
    // Its state again, from alice's own browser: used.
    let (status, text) = world
        .get(&format!("/oauth/callback?code=x&state={state}"), &browser)
        .await;
    assert_eq!(status, 410, "{text}");
    let (status, text) = world
        .get("/oauth/callback?code=x&state=never-given", &browser)
        .await;
    assert_eq!(status, 400, "{text}");

    // bob, signed in to the page as bob, on another sign-in of alice's (started at /connect/r).
    let (to, _, _) = world.start_sign_in("/connect/r", &alice_cookie).await;
    let r = world.person_then(&format!("{base}/"), "bob", &to).await;
    assert_eq!(r["first_title"], "Waiting for your approval", "{r}");
    assert_eq!(r["title"], "Sign-in refused", "{r}");
    assert!(
        r["message"]
            .as_str()
            .is_some_and(|m| m.contains("signed in to the page as `bob`")),
        "{r}"
    );

    // The authorization server refuses (access_denied), and the token endpoint refuses a code.
    let (_, state, browser) = world.start_sign_in("/connect/r", &alice_cookie).await;
    let (status, text) = world
        .get(
            &format!("/oauth/callback?error=access_denied&state={state}"),
            &browser,
        )
        .await;
    assert_eq!(status, 403, "{text}");
    let (_, state, browser) = world.start_sign_in("/connect/r", &alice_cookie).await;
    let (status, text) = world
        .get(
            &format!("/oauth/callback?code=not-a-code&state={state}"),
            &browser,
        )
        .await;
    assert_eq!(status, 502, "{text}");
    assert_eq!(
        world.grants("grant-error authorization_code invalid_grant"),
        1
    );

    // Nothing reached the server for alice, and nothing is stored for her.
    assert_eq!(world.server_lines("whoami alice"), 0);
    assert_eq!(world.server_lines("whoami bob"), 0);
    assert!(
        world.stored("alice").is_none(),
        "bob's sign-in is not alice's"
    );
    let refused: Vec<Value> = world
        .records("provider_state")
        .into_iter()
        .filter(|l| l["state"] == "sign_in_refused")
        .collect();
    let codes: Vec<&str> = refused.iter().filter_map(|l| l["code"].as_str()).collect();
    assert_eq!(
        codes,
        [
            "link_not_yours",
            "link_unknown",
            "link_used",
            "other_browser",
            "state_used",
            "state_unknown",
            "not_yours",
            "authorization_refused",
            "token_failed",
        ],
        "{refused:?}"
    );
    for line in &refused {
        let unknown = matches!(
            line["code"].as_str(),
            Some("link_unknown" | "state_unknown")
        );
        let (provider, principal) = if unknown {
            (json!(""), Value::Null)
        } else {
            (json!("r"), json!("alice"))
        };
        assert_eq!(line["provider"], provider, "{line}");
        assert_eq!(line["principal"], principal, "{line}");
        assert!(
            line["reason"].as_str().is_some_and(|r| !r.is_empty()),
            "{line}"
        );
    }
    assert!(
        refused[7]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("access_denied"))
    );
    assert!(
        refused[8]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("invalid_grant"))
    );

    // alice signs in herself: her held call goes on, once, with her own token.
    let shown = world.person(&format!("{base}/connect/r"), "alice").await;
    assert_eq!(shown["title"], "Signed in", "{shown}");
    let report = harness.await.expect("harness");
    assert_eq!(
        report["calls"][0],
        json!([false, "alice", "ok"]),
        "{report}"
    );
    assert_eq!(
        report["questions"].as_array().map(Vec::len),
        Some(1),
        "{report}"
    );
    assert_sign_in_question(&report["questions"][0], "alice", &link, world.server_port);
    assert_eq!(
        report["completed"],
        json!([report["questions"][0]["elicitationId"]]),
        "{report}"
    );
    assert_eq!(world.server_lines("whoami alice"), 1);
    assert_eq!(world.server_lines("whoami bob"), 0);
    let states: Vec<String> = world
        .records("provider_state")
        .into_iter()
        .filter(|l| l["principal"] == "alice")
        .filter_map(|l| l["state"].as_str().map(str::to_owned))
        .filter(|s| s.starts_with("sign"))
        .collect();
    assert_eq!(states.first().map(String::as_str), Some("sign_in_asked"));
    assert_eq!(states.last().map(String::as_str), Some("signed_in"));
    assert_eq!(states.len(), 2 + refused.len() - 2, "{states:?}");
    // No token, code or state in the record.
    let (tokens, _) = world.stored("alice").expect("alice's tokens");
    let record = world.record();
    for t in tokens {
        assert!(!record.contains(&t), "a token in the record");
    }
    assert!(!record.contains(&state), "a state in the record");
}

/// Issue 45 item 3, the third way to be a client: where the authorization server takes client
/// ID metadata documents (npm `oidc-provider` with its `clientIdMetadataDocument` feature, and no
/// dynamic registration) and the page is on HTTPS, the broker's client id is the URL of the
/// document its page serves (`/oauth/client.json`). The provider fetches it once over TLS
/// (checking the page's certificate against the test CA), both people sign in through it, and a
/// refresh is made as that client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser) and PyPI mcp 2.3.0 in SHAREDOS_PYTHON"]
async fn a_client_id_metadata_document_names_the_broker_where_the_server_takes_one() {
    let Some(python) = crate::remote::python() else {
        return;
    };
    let Some(world) = World::start_with(&python, "alice", true).await else {
        return;
    };
    let base = format!("https://127.0.0.1:{}", world.page);
    let document = format!("{base}/oauth/client.json");

    // alice signs in on her page: the provider fetches the document, once, and her tokens were
    // issued to the client the document names.
    let shown = world.person(&format!("{base}/connect/r"), "alice").await;
    assert_eq!(shown["title"], "Signed in", "{shown}");
    assert_eq!(world.grants(&format!("metadata-document {document}")), 1);
    assert_eq!(world.grants("grant authorization_code alice mcp"), 1);
    assert_eq!(world.grants(&format!("client {document}")), 1);
    let stored = |who: &str| -> Value {
        let path = world.dir.path().join(format!("record.jsonl.oauth/{who}/r"));
        serde_json::from_str(&std::fs::read_to_string(path).expect("stored")).expect("JSON")
    };
    assert_eq!(stored("alice")["client_id"], document.as_str());
    let (providers, r) = world.providers().await;
    assert_eq!(r["oauthClientRegistration"], "metadata_document", "{r}");
    world.wait_listed().await;

    // Her calls carry her token.
    let turn = world.open_turn("alice").await;
    let mut alice = Raw::spawn(world.shim(turn.token.expose()));
    alice.initialize("2025-11-25").await;
    let r = whoami(&mut alice, 1).await;
    assert_eq!(text(&r), "alice", "{r}");

    // bob signs in as the same client; the provider had the document already.
    let shown = world.person(&format!("{base}/connect/r"), "bob").await;
    assert_eq!(shown["title"], "Signed in", "{shown}");
    assert_eq!(world.grants("grant authorization_code bob mcp"), 1);
    assert_eq!(world.grants(&format!("client {document}")), 2);
    assert_eq!(stored("bob")["client_id"], document.as_str());
    assert_eq!(world.grants(&format!("metadata-document {document}")), 1);

    // alice's access token expires: it is refreshed as the document's client (a public client:
    // no secret, as the document says), and her call goes on.
    tokio::time::sleep(Duration::from_secs(TTL)).await;
    let r = whoami(&mut alice, 2).await;
    assert_eq!(text(&r), "alice", "{r}");
    assert_eq!(world.grants("grant refresh_token alice mcp"), 1);
    assert_eq!(world.grants(&format!("client {document}")), 3);
    assert_eq!(world.server_lines("whoami alice"), 2);
    // No registration was attempted, and no token is in `providers`.
    assert_eq!(
        world
            .grants
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.starts_with("grant-error"))
            .count(),
        0
    );
    for who in ["alice", "bob"] {
        let t = stored(who)["access_token"]
            .as_str()
            .expect("token")
            .to_owned();
        assert!(!providers.contains(&t) && !world.record().contains(&t));
    }
    let log = std::fs::read_to_string(&world.log).expect("log");
    assert!(
        log.contains("registration=\"metadata_document\"")
            || log.contains("registration=metadata_document"),
        "the broker says how it is the client"
    );
    drop(alice);
}
