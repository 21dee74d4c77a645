//! Issue 45: the person's page. With `[page]` configured, a call under `@approval("principal")`
//! is decided by the person signed in with the operator's OpenID provider, on a page out of the
//! agent's reach; the harness only carries the link (a URL-mode elicitation).
//!
//! Real parts, none written here: npm `oidc-provider` (the OpenID-certified provider, on
//! loopback, alice and bob at its development login; `tests/node/oidc_provider.mjs`), Debian's
//! headless chromium driven by PyPI selenium through chromedriver as the person
//! (`tests/python/page_person.py`), and the PyPI `mcp` client as the harness
//! (`tests/python/elicit_client.py`), which receives the link.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use sharedos_proto::ipc::{BridgeEvent, BridgeRequest, PrincipalAnswer};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::kit::{Options, TestBroker, WAIT, bin, eventually, installed};

const POLICY: &str = r#"
@id("alice-public")
permit(principal == SharedOS::User::"alice",
       action in [SharedOS::Action::"read", SharedOS::Action::"list", SharedOS::Action::"search"],
       resource is SharedOS::File)
when { resource.path == "/public" || resource.path like "/public/*" };

@id("alice-private-asks-alice")
@approval("principal")
permit(principal == SharedOS::User::"alice",
       action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/private/*" };
"#;

const CLIENT_ID: &str = "sharedos-page";
const CLIENT_SECRET: &str = "a-client-secret-for-the-test-provider";
/// What a browser run may take (chromium starts slowly on two busy cores: up to 100 s measured).
const LONG: Duration = Duration::from_secs(240);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn python() -> Option<String> {
    match std::env::var("SHAREDOS_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must set SHAREDOS_PYTHON (see .ci/run)"
            );
            eprintln!("SKIPPED: SHAREDOS_PYTHON is not set (run .ci/run)");
            None
        }
    }
}

/// The test's world: the OpenID provider, and a broker whose page signs people in with it.
pub(crate) struct World {
    pub(crate) broker: TestBroker,
    browser: std::collections::BTreeMap<String, String>,
    pub(crate) page: u16,
    oidc: u16,
    /// The test CA of the page's certificate (HTTPS only).
    ca: Option<std::path::PathBuf>,
    _provider: tokio::process::Child,
    _secrets: tempfile::TempDir,
}

impl World {
    pub(crate) async fn start(approval_timeout_seconds: u64) -> Option<Self> {
        Self::start_with(approval_timeout_seconds, false).await
    }

    /// With `https`: the page serves HTTPS with a certificate of a test CA for 127.0.0.1.
    async fn start_with(approval_timeout_seconds: u64, https: bool) -> Option<Self> {
        let browser = installed("browser", ".ci/install-browser")?;
        let (page, oidc) = (free_port(), free_port());
        let secrets = tempfile::tempdir().expect("tempdir");
        let (scheme, pki) = if https {
            let (ca, cert, key) = crate::remote::test_pki(secrets.path(), "127.0.0.1");
            (
                "https",
                Some((
                    ca,
                    format!(
                        "cert = \"{}\"\nkey = \"{}\"\n",
                        cert.display(),
                        key.display()
                    ),
                )),
            )
        } else {
            ("http", None)
        };
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
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut provider = provider.spawn().expect("node oidc_provider.mjs");
        let mut lines = tokio::io::BufReader::new(provider.stdout.take().expect("stdout")).lines();
        let first = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("the provider starts in time")
            .expect("read")
            .expect("a line");
        assert_eq!(first, format!("issuer http://127.0.0.1:{oidc}"));
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let secret = secrets.path().join("client-secret");
        std::fs::write(&secret, format!("{CLIENT_SECRET}\n")).expect("secret");
        let broker = TestBroker::start(Options {
            policy: POLICY,
            top: format!("approval_timeout_seconds = {approval_timeout_seconds}\n"),
            tables: format!(
                "[page]\nlisten = \"127.0.0.1:{page}\"\npublic_url = \"{scheme}://127.0.0.1:{page}/\"\n\
                 issuer = \"http://127.0.0.1:{oidc}\"\nclient_id = \"{CLIENT_ID}\"\n\
                 client_secret_file = \"{}\"\nprincipal_claim = \"preferred_username\"\n{}",
                secret.display(),
                pki.as_ref().map_or("", |p| p.1.as_str())
            ),
            ..Options::default()
        })
        .await;
        Some(Self {
            broker,
            browser,
            page,
            oidc,
            ca: pki.map(|p| p.0),
            _provider: provider,
            _secrets: secrets,
        })
    }

    /// The person at the browser: `page_person.py URL USER ACTION`, its report.
    pub(crate) async fn person(&self, url: &str, user: &str, action: &str) -> Value {
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
            "page_person.py {action} {url}:\n{stdout}\n{stderr}"
        );
        serde_json::from_str(stdout.lines().last().unwrap_or("{}"))
            .unwrap_or_else(|e| panic!("report ({e}): {stdout}\n{stderr}"))
    }

    /// A crafted `POST path` to the page over HTTP/1.0: (status, body).
    async fn post(&self, path: &str, headers: &[(&str, String)], body: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.page))
            .await
            .expect("connect to the page");
        let mut request = format!(
            "POST {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            self.page,
            body.len()
        );
        for (k, v) in headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
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

    fn lines(&self, kind: &str) -> Vec<Value> {
        self.broker
            .records()
            .into_iter()
            .filter(|l| l["kind"] == kind)
            .collect()
    }

    fn refusals(&self, code: &str) -> Vec<Value> {
        self.lines("approval_answer_refused")
            .into_iter()
            .filter(|l| l["code"] == code)
            .collect()
    }
}

/// The PyPI mcp client as the harness (2025-11-25, URL-mode elicitation declared unless
/// `answer` is `none`): one call of `files.read` on `path`; the link it is shown is written to
/// `url_file`. Resolves with its report.
fn harness(
    python: &str,
    world: &World,
    token: &str,
    answer: &str,
    path: &str,
    url_file: &Path,
) -> tokio::task::JoinHandle<Value> {
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/python/elicit_client.py"
    ))
    .env("SHAREDOS_SHIM", bin("sharedos-mcp-shim"))
    .env("SHAREDOS_TURN_TOKEN", token)
    .env("SHAREDOS_BROKER", world.broker.bridge())
    .env("ELICIT_MODE", "legacy")
    .env("ELICIT_ANSWER", answer)
    .env("ELICIT_READ_TIMEOUT", "900")
    .env("ELICIT_URL_FILE", url_file)
    .env(
        "ELICIT_CALLS",
        json!([["files.read", {"path": path}]]).to_string(),
    )
    .stdin(Stdio::null())
    .kill_on_drop(true);
    tokio::spawn(async move {
        let out = tokio::time::timeout(Duration::from_secs(960), cmd.output())
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

fn link_of(url: &str) -> &str {
    url.rsplit('/').next().unwrap_or("")
}

/// The person signs in on their page through the link the harness was shown, sees the exact
/// call (tool, arguments, resource, policy, turn, agent), approves it, and the call runs exactly
/// once, recorded `by: principal`, `via: page`, with the provider's subject. Every other way to
/// decide it is refused and recorded: the agent's own answer over the bridge (it holds the
/// turn's token), a POST without a session, from another origin, without the session's CSRF
/// token, with bob's session, a link of another call, and the used link replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser)"]
async fn the_person_approves_on_their_page_and_nothing_else_decides() {
    let Some(python) = python() else { return };
    let Some(world) = World::start(900).await else {
        return;
    };
    let base = format!("http://127.0.0.1:{}", world.page);
    let turn = world.broker.open_turn("alice").await;

    // The agent, with the turn's token, speaks the bridge itself and asks for the secret.
    let (mut reader, mut writer) =
        crate::kit::raw_bridge(&world.broker.bridge(), turn.token.expose()).await;
    let call = BridgeRequest::Call {
        id: 1,
        call: sharedos_proto::ToolCall {
            tool: "files.read".into(),
            arguments: Some(json!({"path": "/private/secret.txt"})),
            request_id: None,
            rejected_arguments: None,
            traceparent: None,
            tracestate: None,
        },
    };
    sharedos_ipc::write_frame(&mut writer, &call)
        .await
        .expect("call");
    let (agents_approval, agents_link) = loop {
        let e = tokio::time::timeout(WAIT, reader.next::<BridgeEvent>())
            .await
            .expect("a frame in time")
            .expect("frame");
        match e {
            BridgeEvent::Waiting { .. } => continue,
            BridgeEvent::Ask {
                id: 1,
                approval,
                question,
            } => {
                let url = question.url.expect("the question carries the page's link");
                assert!(url.starts_with(&format!("{base}/approval/")), "{url}");
                break (approval, url);
            }
            other => panic!("no question for the agent's call: {other:?}"),
        }
    };
    sharedos_ipc::write_frame(
        &mut writer,
        &BridgeRequest::Decide {
            approval: agents_approval.clone(),
            answer: PrincipalAnswer::Approve,
            reason: None,
            via: Some("elicitation/create".into()),
        },
    )
    .await
    .expect("the agent's answer");
    let refused = loop {
        let e = tokio::time::timeout(WAIT, reader.next::<BridgeEvent>())
            .await
            .expect("a frame in time")
            .expect("frame");
        if !matches!(e, BridgeEvent::Waiting { .. }) {
            break e;
        }
    };
    assert!(
        matches!(&refused, BridgeEvent::DecideRefused { approval, .. } if *approval == agents_approval),
        "{refused:?}"
    );
    assert_eq!(world.refusals("asked_on_page").len(), 1);
    assert_eq!(world.refusals("asked_on_page")[0]["via"], "bridge");

    // The harness's call: the client is shown the link.
    let dir = tempfile::tempdir().expect("tempdir");
    let url_file = dir.path().join("url");
    let harness = harness(
        &python,
        &world,
        turn.token.expose(),
        "approve",
        "/private/secret.txt",
        &url_file,
    );
    eventually("the harness is shown the link", || url_file.exists()).await;
    let url = std::fs::read_to_string(&url_file).expect("url");
    let link = link_of(&url).to_owned();
    assert_eq!(link.len(), 32, "{url}");
    let requested = world.lines("approval_requested");
    let approval = requested
        .iter()
        .find(|l| l["approval"] != agents_approval.as_str())
        .and_then(|l| l["approval"].as_str())
        .expect("the harness's call waits")
        .to_owned();
    let form = |approval: &str, csrf: &str, decision: &str| {
        format!("csrf={csrf}&approval={approval}&decision={decision}")
    };
    let path = format!("/approval/{link}");

    // No session.
    let (status, _) = world
        .post(&path, &[], &form(&approval, "x", "approve"))
        .await;
    assert_eq!(status, 401);
    assert_eq!(world.refusals("no_session").len(), 1);

    // bob signs in (a real sign-in at the provider) and tries.
    let bob = world.person(&format!("{base}/"), "bob", "session").await;
    assert_eq!(bob["principal"], "bob", "{bob}");
    let cookie = bob["cookies"]["sharedos-page"]
        .as_str()
        .expect("bob's session cookie")
        .to_owned();
    let csrf = bob["csrf"].as_str().expect("bob's csrf").to_owned();
    let with_cookie = vec![("Cookie", format!("sharedos-page={cookie}"))];
    let mut other_origin = with_cookie.clone();
    other_origin.push(("Origin", "http://attacker.example".to_owned()));
    let (status, _) = world
        .post(&path, &other_origin, &form(&approval, &csrf, "approve"))
        .await;
    assert_eq!(status, 403);
    assert_eq!(world.refusals("cross_origin").len(), 1);
    let (status, _) = world
        .post(
            &path,
            &with_cookie,
            &form(&approval, "not-the-token", "approve"),
        )
        .await;
    assert_eq!(status, 403);
    assert_eq!(world.refusals("csrf").len(), 1);
    let (status, body) = world
        .post(&path, &with_cookie, &form(&approval, &csrf, "approve"))
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("for principal `alice`"), "{body}");
    // bob opening alice's link in the browser sees it is not his.
    let shown = world.person(&url, "bob", "show").await;
    assert_eq!(shown["title"], "Not yours to decide", "{shown}");
    assert_eq!(world.refusals("not_the_principal").len(), 2);
    let refused_as_bob = world.refusals("not_the_principal");
    assert!(
        refused_as_bob
            .iter()
            .all(|l| l["principal"] == "bob" && l["subject"] == "bob")
    );
    // The agent's call's link, posted for the harness's call.
    let (status, _) = world
        .post(
            &format!("/approval/{}", link_of(&agents_link)),
            &with_cookie,
            &form(&approval, &csrf, "approve"),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(world.refusals("other_call").len(), 1);
    assert!(
        world
            .calls_of_files_read(&turn.turn)
            .iter()
            .all(|c| c["outcome"] != "succeeded"),
        "nothing ran yet"
    );

    // alice, at the browser, signs in, sees the exact call, approves.
    let seen = world.person(&url, "alice", "approve").await;
    assert_eq!(seen["principal"], "alice", "{seen}");
    assert_eq!(seen["tool"], "files.read", "{seen}");
    let arguments: Value =
        serde_json::from_str(seen["arguments"].as_str().expect("arguments")).expect("json");
    assert_eq!(arguments, json!({"path": "/private/secret.txt"}), "{seen}");
    assert_eq!(
        seen["resource"], "read on SharedOS::File::\"/private/secret.txt\"",
        "{seen}"
    );
    assert_eq!(seen["policy"], "alice-private-asks-alice", "{seen}");
    assert_eq!(seen["turn"], turn.turn.as_str(), "{seen}");
    assert_eq!(seen["approval"], approval.as_str(), "{seen}");
    assert!(
        seen["answer"]
            .as_str()
            .is_some_and(|a| a.starts_with("You approved")),
        "{seen}"
    );
    let report = harness.await.expect("harness");
    assert_eq!(report["calls"][0][0], false, "{report}");
    assert_eq!(report["calls"][0][1], "the secret\n", "{report}");
    let questions = report["questions"].as_array().expect("questions");
    assert_eq!(questions.len(), 1, "{report}");
    assert_eq!(questions[0]["mode"], "url", "{report}");
    // Decided on the page: the client is told once, by the question's elicitationId
    // (`notifications/elicitation/complete`, before the call's answer).
    assert!(
        questions[0]["elicitationId"]
            .as_str()
            .is_some_and(|e| e.starts_with("sharedos-page-")),
        "{report}"
    );
    assert_eq!(
        report["completed"],
        json!([questions[0]["elicitationId"]]),
        "{report}"
    );

    // The used link, replayed.
    let (status, _) = world
        .post(&path, &with_cookie, &form(&approval, &csrf, "approve"))
        .await;
    assert_eq!(status, 410);
    assert_eq!(world.refusals("link_used").len(), 1);

    // The record: decided once, by the person on the page; the call ran exactly once.
    let decided: Vec<Value> = world
        .lines("approval_decided")
        .into_iter()
        .filter(|l| l["approval"] == approval.as_str())
        .collect();
    assert_eq!(decided.len(), 1, "{decided:?}");
    assert_eq!(
        (
            &decided[0]["decision"],
            &decided[0]["by"],
            &decided[0]["via"],
            &decided[0]["subject"]
        ),
        (
            &json!("approved"),
            &json!("principal"),
            &json!("page"),
            &json!("alice")
        ),
        "{decided:?}"
    );
    let succeeded = world
        .calls_of_files_read(&turn.turn)
        .into_iter()
        .filter(|c| c["outcome"] == "succeeded")
        .count();
    assert_eq!(succeeded, 1);
    world.broker.close_turn(&turn.turn).await;
    // The agent's own call never ran: cancelled with its turn.
    let calls = world.calls_of_files_read(&turn.turn);
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(
        calls.iter().filter(|c| c["outcome"] == "cancelled").count(),
        1,
        "{calls:?}"
    );
}

impl World {
    fn calls_of_files_read(&self, turn: &str) -> Vec<Value> {
        self.broker
            .calls_of(turn)
            .into_iter()
            .filter(|c| c["tool"] == "files.read")
            .collect()
    }
}

/// A client that cannot show a link (no elicitation declared): the call waits for the page, and
/// the person's list shows it; nobody decides, and the call is refused when its time is up; its
/// link, opened after, decides nothing (refused and recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser)"]
async fn a_call_waits_on_the_persons_list_and_its_link_ends_with_it() {
    let Some(python) = python() else { return };
    let Some(world) = World::start(40).await else {
        return;
    };
    let base = format!("http://127.0.0.1:{}", world.page);
    let turn = world.broker.open_turn("alice").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url_file = dir.path().join("url");
    let harness = harness(
        &python,
        &world,
        turn.token.expose(),
        "none",
        "/private/secret.txt",
        &url_file,
    );
    eventually("the call waits", || {
        !world.lines("approval_requested").is_empty()
    })
    .await;
    let listed = world.person(&format!("{base}/"), "alice", "show").await;
    let links = listed["links"].as_array().expect("links");
    assert_eq!(links.len(), 1, "{listed}");
    let link = links[0].as_str().expect("link").to_owned();
    assert!(
        listed["waiting"]
            .as_str()
            .is_some_and(|w| w.contains("files.read")),
        "{listed}"
    );
    let report = harness.await.expect("harness");
    assert_eq!(report["calls"][0][0], true, "{report}");
    assert_eq!(report["calls"][0][2], "approval_timeout", "{report}");
    assert!(
        !url_file.exists(),
        "no link was shown to a client that cannot show one"
    );
    let after = world.person(&link, "alice", "show").await;
    assert_eq!(after["title"], "This link decides nothing", "{after}");
    assert_eq!(world.refusals("link_ended").len(), 1);
    let decided = world.lines("approval_decided");
    assert_eq!(decided.len(), 1, "{decided:?}");
    assert_eq!(decided[0]["decision"], "timeout");
    assert_eq!(
        world
            .calls_of_files_read(&turn.turn)
            .iter()
            .filter(|c| c["outcome"] == "succeeded")
            .count(),
        0
    );
}

/// `curl` against the page: (exit status, headers and body).
async fn curl(args: &[&str]) -> (i32, String) {
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-s", "-D", "-", "--max-time", "10"]).args(args);
    let (code, out, err) = crate::kit::run(cmd).await;
    (code, format!("{out}{err}"))
}

/// The page over HTTPS with the operator's certificate (rustls, a test CA here): it answers
/// with its guards (no caching, no framing, a CSP that allows forms to itself only), sign-in
/// starts at the provider with PKCE S256, `state` and `nonce`, the redirect back to
/// `<public_url>callback`; plain HTTP to it gets no page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser)"]
async fn the_page_serves_https_and_starts_sign_in_with_pkce() {
    let Some(world) = World::start_with(30, true).await else {
        return;
    };
    let ca = world.ca.clone().expect("a test CA");
    let ca = ca.to_str().expect("utf-8 path");
    let base = format!("https://127.0.0.1:{}", world.page);
    let (code, home) = curl(&["--cacert", ca, &format!("{base}/")]).await;
    assert_eq!(code, 0, "{home}");
    assert!(home.starts_with("HTTP/1.1 200"), "{home}");
    let lower = home.to_lowercase();
    for header in [
        "cache-control: no-store",
        "x-frame-options: deny",
        "content-security-policy: default-src 'none'; form-action 'self'; frame-ancestors 'none'",
    ] {
        assert!(lower.contains(header), "{header}: {home}");
    }
    assert!(home.contains("Sign in"), "{home}");
    let (code, login) = curl(&["--cacert", ca, &format!("{base}/login?next=/")]).await;
    assert_eq!(code, 0, "{login}");
    assert!(login.starts_with("HTTP/1.1 303"), "{login}");
    let location = login
        .lines()
        .find_map(|l| l.strip_prefix("location: "))
        .expect("a location")
        .trim();
    assert!(
        location.starts_with(&format!("http://127.0.0.1:{}/auth?", world.oidc)),
        "{location}"
    );
    let query: std::collections::BTreeMap<String, String> = location
        .split_once('?')
        .map(|(_, q)| q)
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    assert_eq!(query["code_challenge_method"], "S256", "{location}");
    assert_eq!(query["code_challenge"].len(), 43, "{location}");
    assert_eq!(query["response_type"], "code");
    assert_eq!(query["client_id"], CLIENT_ID);
    assert_eq!(
        query["redirect_uri"],
        format!("https%3A%2F%2F127.0.0.1%3A{}%2Fcallback", world.page)
    );
    assert!(
        query["state"].len() >= 43 && query["nonce"].len() >= 43,
        "{location}"
    );
    // Without the CA, curl refuses the certificate; plain HTTP gets no page.
    let (code, _) = curl(&[&format!("{base}/")]).await;
    assert_ne!(code, 0);
    let (_, plain) = curl(&[&format!("http://127.0.0.1:{}/", world.page)]).await;
    assert!(!plain.contains("HTTP/1.1 200"), "{plain}");
}

/// A flood of refused decisions (POSTs without a session, 150 in a row) is answered, each one,
/// with its refusal, and recorded at most `REFUSALS_RECORDED_PER_MINUTE` (120) times a minute:
/// a stranger cannot grow the record without bound through the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium, selenium and oidc-provider (.ci/install-browser)"]
async fn refusals_on_the_page_are_recorded_at_most_120_a_minute() {
    let Some(world) = World::start(30).await else {
        return;
    };
    let base = format!("http://127.0.0.1:{}", world.page);
    let refused_lines = || world.refusals("no_session").len();
    let before = refused_lines();
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..150 {
        let (code, out) = curl(&[
            "-X",
            "POST",
            "-H",
            &format!("Origin: {base}"),
            "-d",
            "decision=approve&approval=a1&csrf=x",
            &format!("{base}/approval/link{i}"),
        ])
        .await;
        assert_eq!(code, 0, "{out}");
        let status = out.lines().next().unwrap_or("").trim().to_owned();
        *answers.entry(status).or_default() += 1;
    }
    assert_eq!(
        answers,
        [("HTTP/1.1 401 Unauthorized".to_owned(), 150)].into(),
        "every POST refused for want of a session"
    );
    assert_eq!(
        refused_lines() - before,
        sharedos_broker::page::REFUSALS_RECORDED_PER_MINUTE as usize,
        "recorded up to the bound, the rest only logged"
    );
    // The page still serves.
    let (_, home) = curl(&[&format!("{base}/")]).await;
    assert!(home.starts_with("HTTP/1.1 200"), "{home}");
}
