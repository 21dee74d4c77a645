//! Section 9: a remote provider over Streamable HTTP (issues 34 and 46). The same `echo` call
//! to PyPI `mcp`'s `MCPServer` (`tests/python/remote_server.py`, uvicorn on loopback) made by
//! an rmcp Streamable HTTP client in this process, directly; the same client through a relay
//! that only copies bytes (the floor of one hop); and an rmcp stdio client through a real shim
//! and `sharedos-broker serve`, whose own HTTP session reaches the server. Plain HTTP, and HTTPS
//! with a test CA made here (rcgen), trusted by the broker through the provider's `ca_file`.
//!
//! The relays are [`CountingRelay`]s: each counts the TCP connections it accepted (what the
//! server saw) and the TLS ClientHellos among them (handshakes), so the rows behind a relay say
//! how many connections and handshakes 100 calls cost.
//!
//! Every wait is bounded; every process started here is stopped here.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{Peer, RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rustls::pki_types::CertificateDer;
use serde_json::json;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::e2e;
use crate::micro;
use crate::procs::{self, Bins, BrokerProc, WAIT};
use crate::report::{Report, Table, Target};
use crate::stats::{MustAdd, Samples, Summary, delta, dur, ratio};

pub const TITLE: &str = "9. Remote provider over Streamable HTTP: through the broker, direct, and through a byte-copying relay";

/// The record mode the section's broker runs in: the broker's default.
const RECORD_SYNC: &str = "always";

/// Connections (and TLS handshakes) per 100 sequential calls through the broker that issue 46
/// asks for: a few, reused.
const REUSE_TARGET: f64 = 5.0;

/// The CI's virtualenv with PyPI mcp 2.3.0 (`.ci/run` makes it), under `$HOME`.
const CI_VENV: &str = ".cache/sharedos-ci/venv-mcp-2.3.0";

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Untimed calls on each path.
    pub warmup: usize,
    /// Rounds of `calls` sequential calls on each path, the paths in a rotated order each round.
    pub rounds: usize,
    pub calls: usize,
}

/// The Python with PyPI `mcp` and uvicorn: `SHAREDOS_PYTHON`, else the CI's venv, checked by
/// importing them, and its `mcp` version; or why there is none.
async fn python() -> Result<(PathBuf, String), String> {
    let (python, from) = match std::env::var_os("SHAREDOS_PYTHON").filter(|p| !p.is_empty()) {
        Some(p) => (PathBuf::from(p), "SHAREDOS_PYTHON"),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_default();
            (
                Path::new(&home).join(CI_VENV).join("bin/python"),
                "the CI's virtualenv",
            )
        }
    };
    if !python.is_file() {
        return Err(format!(
            "no Python with PyPI `mcp` was found (SHAREDOS_PYTHON is unset and `~/{CI_VENV}/bin/python` does not exist)"
        ));
    }
    let check = tokio::process::Command::new(&python)
        .args([
            "-c",
            "import importlib.metadata, mcp.server.mcpserver, uvicorn; print(importlib.metadata.version('mcp'))",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(WAIT * 3, check).await {
        Ok(Ok(out)) if out.status.success() => Ok((
            python,
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        )),
        Ok(Ok(out)) => Err(format!(
            "`{}` (from {from}) cannot import PyPI `mcp` 2.x's `MCPServer` and uvicorn: {}",
            python.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(Err(e)) => Err(format!(
            "cannot run `{}` (from {from}): {e}",
            python.display()
        )),
        Err(_) => Err(format!(
            "`{}` (from {from}) did not import `mcp` within {:?}",
            python.display(),
            WAIT * 3
        )),
    }
}

/// A running `tests/python/remote_server.py`.
struct PyServer {
    child: tokio::process::Child,
    port: u16,
}

impl PyServer {
    async fn start(python: &Path, dir: &Path, tls: Option<&Pki>) -> anyhow::Result<Self> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/remote_server.py");
        let log_path = dir.join(if tls.is_some() {
            "server-tls.log"
        } else {
            "server.log"
        });
        let mut cmd = tokio::process::Command::new(python);
        cmd.arg(&script);
        if let Some(pki) = tls {
            cmd.arg("--tls").arg(&pki.cert).arg(&pki.key);
        }
        let mut child = cmd
            .env_remove("REMOTE_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log_path)?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start `{}`", script.display()))?;
        let stdout = child.stdout.take().context("the server's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(WAIT * 3, lines.next_line()).await;
        let port = match first {
            Ok(Ok(Some(line))) => line.strip_prefix("PORT ").and_then(|p| p.parse().ok()),
            _ => None,
        };
        let Some(port) = port else {
            let _ = child.kill().await;
            bail!(
                "`{}` did not say its port within {:?}; its log:\n{}",
                script.display(),
                WAIT * 3,
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        };
        // Its stdout is read no further: it prints nothing after the port line.
        drop(lines);
        Ok(Self { child, port })
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A test CA and a server certificate for 127.0.0.1 signed by it (PEM files in a folder).
struct Pki {
    ca_der: CertificateDer<'static>,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn test_pki(dir: &Path) -> anyhow::Result<Pki> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "sharedos bench test ca");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let mut server = CertificateParams::new(vec!["127.0.0.1".to_owned()])?;
    server
        .distinguished_name
        .push(DnType::CommonName, "bench server");
    let server_key = KeyPair::generate()?;
    let server_cert = server.signed_by(&server_key, &issuer)?;
    let pki = Pki {
        ca_der: ca_cert.der().clone(),
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    };
    std::fs::write(&pki.ca, ca_cert.pem())?;
    std::fs::write(&pki.cert, server_cert.pem())?;
    std::fs::write(&pki.key, server_key.serialize_pem())?;
    Ok(pki)
}

/// What a [`CountingRelay`] counted.
#[derive(Debug, Default)]
struct Counts {
    accepts: AtomicU64,
    client_hellos: AtomicU64,
}

/// A TCP relay on 127.0.0.1 to one server that only copies bytes (`copy_bidirectional`, with
/// `TCP_NODELAY` on both sides, and its reads from the server acknowledged at once), counting the connections it accepts and the TLS ClientHellos
/// they open with. Stopped (with every connection it relays) when dropped.
pub struct CountingRelay {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingRelay {
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(Counts::default());
        let task = tokio::spawn(serve(listener, upstream, counts.clone()));
        Ok(Self { addr, counts, task })
    }

    /// (connections accepted, TLS ClientHellos) so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.counts.accepts.load(Ordering::Relaxed),
            self.counts.client_hellos.load(Ordering::Relaxed),
        )
    }
}

impl Drop for CountingRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, upstream: SocketAddr, counts: Arc<Counts>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((inbound, _)) => {
                    counts.accepts.fetch_add(1, Ordering::Relaxed);
                    conns.spawn(pipe(inbound, upstream, counts.clone()));
                }
                // Out of file descriptors, or a connection reset before it was accepted.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn pipe(mut inbound: TcpStream, upstream: SocketAddr, counts: Arc<Counts>) {
    let Ok(outbound) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    if opens_with_client_hello(&inbound).await {
        counts.client_hellos.fetch_add(1, Ordering::Relaxed);
    }
    let mut outbound = QuickAck(outbound);
    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
}

/// The relay's connection to the server, acknowledging what it reads at once
/// (`TCP_QUICKACK` before each read, as the broker's own HTTP client does): a relay whose
/// kernel delays its ACKs would hold a server that writes with Nagle's algorithm on (uvicorn)
/// up to 40 ms per answer on a kept connection, and be no floor of one hop.
struct QuickAck(TcpStream);

impl tokio::io::AsyncRead for QuickAck {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let _ = rustix::net::sockopt::set_tcp_quickack(&self.0, true);
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for QuickAck {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Whether a connection's first bytes are a TLS handshake record holding a ClientHello
/// (content type 22, then the version and length, then handshake type 1). Peeked, so the bytes
/// are still relayed; bounded: a client that sends nothing within [`WAIT`] is not counted.
async fn opens_with_client_hello(s: &TcpStream) -> bool {
    let mut head = [0u8; 6];
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let peeked = tokio::time::timeout_at(deadline, s.peek(&mut head)).await;
        match peeked {
            Ok(Ok(n)) if n >= head.len() => return head[0] == 0x16 && head[5] == 0x01,
            // Closed, failed, or out of time.
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return false,
            // Fewer bytes than the record header so far: wait for the rest.
            Ok(Ok(_)) => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

/// An HTTP client that trusts `ca` (rustls with ring, HTTP/1.1, no proxy), with rmcp's default
/// client's pooling (`pool_max_idle_per_host(0)`), so that the direct TLS row differs from the
/// plain one only in TLS.
fn tls_client(ca: &CertificateDer<'static>) -> anyhow::Result<reqwest::Client> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone())?;
    #[expect(
        deprecated,
        reason = "ring has no post-quantum key exchange; the broker's remote transport uses ring too"
    )]
    let provider = rustls::crypto::ring::default_provider();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(reqwest::Client::builder()
        .tls_backend_preconfigured(config)
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()?)
}

/// An rmcp Streamable HTTP client session to `url` (initialized, bounded by [`WAIT`]).
async fn direct_client(
    url: String,
    ca: Option<&CertificateDer<'static>>,
) -> anyhow::Result<RunningService<RoleClient, ()>> {
    let serve = async {
        match ca {
            None => anyhow::Ok(
                ().serve(StreamableHttpClientTransport::from_uri(url))
                    .await?,
            ),
            Some(ca) => anyhow::Ok(
                ().serve(StreamableHttpClientTransport::with_client(
                    tls_client(ca)?,
                    StreamableHttpClientTransportConfig::with_uri(url),
                ))
                .await?,
            ),
        }
    };
    tokio::time::timeout(WAIT, serve)
        .await
        .context("the direct client's initialize did not finish in time")?
}

/// One measured path: who calls, through what, and what it counted.
struct Path9 {
    label: &'static str,
    transport: &'static str,
    peer: Peer<RoleClient>,
    req: CallToolRequestParams,
    relay: Option<Arc<CountingRelay>>,
    /// The row whose median this row's "added" is against (an index into the paths); none
    /// for a baseline.
    baseline: Option<usize>,
    samples: Samples,
    errors: u64,
    /// (connections, ClientHellos) counted during the timed calls.
    counted: (u64, u64),
}

fn path(
    label: &'static str,
    transport: &'static str,
    peer: &Peer<RoleClient>,
    tool: &str,
    relay: Option<&Arc<CountingRelay>>,
    baseline: Option<usize>,
) -> Path9 {
    Path9 {
        label,
        transport,
        peer: peer.clone(),
        req: echo(tool),
        relay: relay.cloned(),
        baseline,
        samples: Samples::default(),
        errors: 0,
        counted: (0, 0),
    }
}

fn echo(tool: &str) -> CallToolRequestParams {
    CallToolRequestParams::new(tool.to_owned()).with_arguments(e2e::object(json!({"text": "x"})))
}

fn url(scheme: &str, addr: SocketAddr) -> String {
    format!("{scheme}://{addr}/mcp")
}

/// The broker's `[[providers]]`: the server directly (`r`), through a counting relay (`rr`),
/// and the TLS server through a counting relay (`rt`, trusting the test CA by `ca_file`).
fn providers(plain: SocketAddr, relay: SocketAddr, tls_relay: SocketAddr, ca: &Path) -> String {
    let entry = |ns: &str, url: String, more: String| {
        format!(
            "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"{ns}\"\nurl = {}\n{more}",
            procs::toml_string(&url)
        )
    };
    [
        entry("r", url("http", plain), String::new()),
        entry("rr", url("http", relay), String::new()),
        entry(
            "rt",
            url("https", tls_relay),
            format!(
                "ca_file = {}\n",
                procs::toml_string(&ca.display().to_string())
            ),
        ),
    ]
    .concat()
}

pub async fn section(
    bins: &Bins,
    plan: Plan,
    quick: bool,
    must_add: Option<MustAdd>,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut t = Table::new(
        TITLE,
        &[
            "client → server",
            "transport",
            "calls",
            "median",
            "p99",
            "added (median)",
            "ratio (median)",
            "TCP connections per 100 calls",
            "TLS handshakes per 100 calls",
            "errors",
        ],
    );
    let (python, version) = match python().await {
        Ok(p) => p,
        Err(why) => {
            t.text(format!(
                "**Not measured in this run**: {why}. The section needs a Python with PyPI `mcp` \
                 2.3.0 (its `MCPServer`, and uvicorn): set `SHAREDOS_PYTHON` to one, or make the \
                 CI's: `python3 -m venv ~/{CI_VENV} && ~/{CI_VENV}/bin/pip install mcp==2.3.0` \
                 (what `bash .ci/run` does)."
            ));
            report.tables.push(t);
            return Ok(());
        }
    };
    sharedos_broker::telemetry::install_crypto_provider();
    let dir = micro::tempdir("remote")?;
    let pki = test_pki(dir.path())?;
    let plain = PyServer::start(&python, dir.path(), None).await?;
    let tls = match PyServer::start(&python, dir.path(), Some(&pki)).await {
        Ok(s) => s,
        Err(e) => {
            plain.stop().await;
            return Err(e);
        }
    };
    let result = measure(bins, &plain, &tls, &pki, plan).await;
    plain.stop().await;
    tls.stop().await;
    let paths = result?;
    t.text(format!(
        "One `echo` tool call (`{{\"text\": \"x\"}}`, read-only) to PyPI `mcp` {version}'s \
         `MCPServer` over Streamable HTTP (`tests/python/remote_server.py`, uvicorn on \
         127.0.0.1; a second one with `--tls`, its certificate from a test CA made for the run \
         with rcgen). \"direct\" is an rmcp 3.11 Streamable HTTP client in the benchmark process \
         (`StreamableHttpClientTransport::from_uri`, rmcp's default HTTP client: no idle \
         connection reused; over TLS the same settings with the test CA trusted). \"shim + \
         broker\" is an rmcp stdio client through a real shim and `sharedos-broker serve` \
         (record_sync `{RECORD_SYNC}`, the default), whose own HTTP session calls the server: \
         a remote provider with `url`, and `ca_file` for TLS. \"relay\" is a TCP relay in the \
         benchmark process that only copies bytes (tokio `copy_bidirectional`, `TCP_NODELAY`, its reads from the server acknowledged at once with `TCP_QUICKACK`): \
         the floor of one hop; it counts the connections it accepts (the connections the server \
         saw) and the TLS ClientHellos they open with (the handshakes). After {} untimed calls \
         on each path, {} rounds of {} sequential calls on each, the paths in a rotated order \
         each round; the counts are of the timed calls only. \"added\" is against the direct \
         client over the same transport (over TLS, the direct client through a relay, as the \
         broker's TLS row is).{}",
        plan.warmup,
        plan.rounds,
        plan.calls,
        if quick { " --quick: few calls." } else { "" }
    ));
    let summaries: Vec<Summary> = paths.iter().map(|p| p.samples.summary()).collect();
    for (p, s) in paths.iter().zip(&summaries) {
        let base = p.baseline.and_then(|b| summaries.get(b).copied());
        let per_100 = |n: u64| match (&p.relay, s.n) {
            (Some(_), calls) if calls > 0 => format!("{:.1}", n as f64 * 100.0 / calls as f64),
            _ => "— (no relay to count)".into(),
        };
        t.row(vec![
            p.label.into(),
            p.transport.into(),
            s.n.to_string(),
            dur(s.median),
            dur(s.p99),
            base.map_or_else(|| "—".into(), |b| delta(s.median, b.median)),
            base.map_or_else(
                || "1.00".into(),
                |b| format!("{:.2}", ratio(s.median, b.median)),
            ),
            per_100(p.counted.0),
            per_100(p.counted.1),
            p.errors.to_string(),
        ]);
    }
    report.tables.push(t);
    report.targets.extend(targets(&paths, &summaries, must_add));
    let errors: u64 = paths.iter().map(|p| p.errors).sum();
    anyhow::ensure!(errors == 0, "{errors} remote calls answered with an error");
    Ok(())
}

/// Rows, by index: the direct client, the direct client through a relay, the broker, the
/// broker through a relay; then over TLS, the direct client and the broker, each through a
/// relay.
const DIRECT: usize = 0;
const DIRECT_RELAY: usize = 1;
const BROKER: usize = 2;
const BROKER_RELAY: usize = 3;
const DIRECT_TLS: usize = 4;
const BROKER_TLS: usize = 5;

fn targets(paths: &[Path9], s: &[Summary], must_add: Option<MustAdd>) -> Vec<Target> {
    let mut out = Vec::new();
    if paths.len() <= BROKER_TLS {
        return out;
    }
    let d = s[DIRECT].median;
    let floor = s[DIRECT_RELAY].median.saturating_sub(d);
    let added = s[BROKER].median.saturating_sub(d);
    // A relay hop that measured nothing (the machine's noise over a few calls) gives no ratio.
    let (measured, met) = if floor.is_zero() {
        (
            format!(
                "no ratio: the relay hop added nothing measurable in this run (relay {}, direct {}); the broker added {}",
                dur(s[DIRECT_RELAY].median),
                dur(d),
                dur(added)
            ),
            added.is_zero(),
        )
    } else {
        let r = ratio(added, floor);
        let mut measured = format!(
            "{r:.2}× ({} added vs the relay's {}; direct {})",
            dur(added),
            dur(floor),
            dur(d)
        );
        // As in section 2: what no boundary that decides and records durably can skip.
        if let Some(m) = must_add {
            measured.push_str(&m.floor(
                floor,
                &format!(" (record_sync `{RECORD_SYNC}`)"),
                RECORD_SYNC == "always",
            ));
        }
        (measured, r <= 1.0)
    };
    out.push(Target {
        what: "9. remote call through the broker: added latency against one relay hop's (medians, plain HTTP)".into(),
        target: "≤ 1.0× (issue 46)".into(),
        measured,
        met,
    });
    for (i, what, n) in [
        (
            BROKER_RELAY,
            "TCP connections the server saw",
            paths[BROKER_RELAY].counted.0,
        ),
        (BROKER_TLS, "TLS handshakes", paths[BROKER_TLS].counted.1),
    ] {
        let calls = paths[i].samples.len().max(1) as f64;
        let per_100 = n as f64 * 100.0 / calls;
        out.push(Target {
            what: format!("9. {what} per 100 sequential calls through the broker"),
            target: format!("≤ {REUSE_TARGET:.0} (issue 46: connections reused)"),
            measured: format!("{per_100:.1} ({n} in {} calls)", paths[i].samples.len()),
            met: per_100 <= REUSE_TARGET,
        });
    }
    out
}

async fn measure(
    bins: &Bins,
    plain: &PyServer,
    tls: &PyServer,
    pki: &Pki,
    plan: Plan,
) -> anyhow::Result<Vec<Path9>> {
    let relays = [
        Arc::new(CountingRelay::start(plain.addr()).await?),
        Arc::new(CountingRelay::start(plain.addr()).await?),
        Arc::new(CountingRelay::start(tls.addr()).await?),
        Arc::new(CountingRelay::start(tls.addr()).await?),
    ];
    let [
        direct_relay,
        broker_relay,
        direct_tls_relay,
        broker_tls_relay,
    ] = &relays;
    let direct = direct_client(url("http", plain.addr()), None).await?;
    let via_relay = direct_client(url("http", direct_relay.addr), None).await?;
    let via_tls_relay =
        direct_client(url("https", direct_tls_relay.addr), Some(&pki.ca_der)).await?;
    let broker = BrokerProc::start_with(
        bins,
        RECORD_SYNC,
        procs::PERMIT_CALLS,
        &providers(
            plain.addr(),
            broker_relay.addr,
            broker_tls_relay.addr,
            &pki.ca,
        ),
    )
    .await
    .context("a broker with the remote providers")?;
    let result = async {
        let turn = broker.open_turn("alice").await?;
        let shim = procs::spawn_client(procs::shim_command(
            bins,
            &broker.bridge(),
            turn.token.expose(),
        ))
        .await?;
        let shim_peer = shim.service.peer();
        let mut paths = vec![
            path(
                "direct (baseline)",
                "HTTP",
                direct.peer(),
                "echo",
                None,
                None,
            ),
            path(
                "direct → relay (floor: one hop)",
                "HTTP",
                via_relay.peer(),
                "echo",
                Some(direct_relay),
                Some(DIRECT),
            ),
            path(
                "shim + broker",
                "HTTP",
                shim_peer,
                "r.echo",
                None,
                Some(DIRECT),
            ),
            path(
                "shim + broker → relay",
                "HTTP",
                shim_peer,
                "rr.echo",
                Some(broker_relay),
                Some(DIRECT),
            ),
            path(
                "direct → relay (baseline over TLS)",
                "HTTPS (test CA)",
                via_tls_relay.peer(),
                "echo",
                Some(direct_tls_relay),
                None,
            ),
            path(
                "shim + broker → relay",
                "HTTPS (test CA)",
                shim_peer,
                "rt.echo",
                Some(broker_tls_relay),
                Some(DIRECT_TLS),
            ),
        ];
        let r = run(&mut paths, plan).await;
        shim.stop().await?;
        r?;
        anyhow::Ok(paths)
    }
    .await;
    broker.stop().await?;
    for c in [direct, via_relay, via_tls_relay] {
        let _ = tokio::time::timeout(WAIT, c.cancel()).await;
    }
    result
}

async fn run(paths: &mut [Path9], plan: Plan) -> anyhow::Result<()> {
    for p in paths.iter_mut() {
        for _ in 0..plan.warmup {
            let (_, ok) = e2e::timed_call(&p.peer, &p.req)
                .await
                .with_context(|| format!("{} over {}", p.label, p.transport))?;
            anyhow::ensure!(
                ok,
                "{} over {}: the warm-up call failed",
                p.label,
                p.transport
            );
        }
    }
    let before: Vec<(u64, u64)> = paths
        .iter()
        .map(|p| p.relay.as_ref().map_or((0, 0), |r| r.counts()))
        .collect();
    let n = paths.len();
    for round in 0..plan.rounds {
        for k in 0..n {
            let p = &mut paths[(round + k) % n];
            for _ in 0..plan.calls {
                let (t, ok) = e2e::timed_call(&p.peer, &p.req)
                    .await
                    .with_context(|| format!("{} over {}", p.label, p.transport))?;
                p.samples.push(t);
                p.errors += u64::from(!ok);
            }
        }
    }
    for (p, (c0, h0)) in paths.iter_mut().zip(before) {
        if let Some(r) = &p.relay {
            let (c, h) = r.counts();
            p.counted = (c.saturating_sub(c0), h.saturating_sub(h0));
        }
    }
    Ok(())
}
