//! OpenTelemetry export, off the call path: one span per `tools/call` and a few metrics, sent
//! over OTLP (HTTP/protobuf) by a thread of its own.
//!
//! The call path only hands a [`CallSpan`] to a bounded queue (`try_send`): it never waits for
//! the exporter, and a full queue drops the span and counts it ([`Stats`]). The JSON Lines record
//! stays the source of truth; nothing here can delay, fail or drop a record line.
//!
//! Spans follow the OpenTelemetry semantic conventions for MCP (`tools/call {tool}`, kind
//! SERVER, `mcp.method.name`, `gen_ai.tool.name`, `gen_ai.operation.name = execute_tool`,
//! `network.transport = pipe`, `jsonrpc.request.id`, `error.type`), with the client's W3C
//! trace context (`params._meta.traceparent`/`tracestate`) as the remote parent, plus the
//! decision the conventions lack: `sharedos.outcome`, `sharedos.code`, `sharedos.policies`,
//! `sharedos.turn`, `sharedos.call_id`, `sharedos.principal` (`principal = false` leaves it
//! out) and, for a call held for a person, `sharedos.approval.id` and
//! `sharedos.approval.decision`. Metrics: `mcp.server.operation.duration` (s), `sharedos.tool.calls` by tool, outcome and
//! code, `sharedos.turns.open`.
//!
//! Why spans are built here as `SpanData` and handed to the OTLP exporter directly, rather than
//! through the SDK's tracer and batch processor: the processor has its own queue whose drops are
//! not counted where an operator can read them, and a span's times and parent come from the
//! call, which finished before the span is made.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, StringValue, Value as OtelValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, SpanData, SpanEvents, SpanExporter, SpanLinks,
};
use serde::Deserialize;
use sharedos_proto::ipc::TelemetryStats;

/// Spans waiting for the export thread, unless the config says.
pub const DEFAULT_QUEUE: usize = 4096;
/// The smallest `queue_bytes`: room for a few spans of the largest size.
const MIN_QUEUE_BYTES: usize = 64 * 1024;
/// Most open turns whose principal the log export remembers (for `sharedos.principal` on their
/// lines); a turn opened past it gets its lines exported without the principal.
pub const MAX_LOG_TURNS: usize = 4096;
/// Most spans in one export request.
const MAX_BATCH: usize = 512;
/// How long the export thread waits for more spans after the first of a batch: a span reaches
/// the collector at most this much later than it would alone (the SDK's batch processor waits
/// up to 5 s).
const LINGER: Duration = Duration::from_millis(200);
/// How often a waiting export thread looks at the stop flag: shutdown waits at most about this
/// long for it (then for the last export), never for a batch to fill.
const STOP_POLL: Duration = Duration::from_millis(20);
/// Bytes the spans waiting for the export thread (and the batch it is sending) may hold,
/// unless the config says; a span that would pass it is dropped (and counted), like one past
/// `queue`.
pub const DEFAULT_QUEUE_BYTES: usize = 4 * 1024 * 1024;
/// Every string a span takes from a call (tool name, request id, principal, policy ids, ...) is
/// cut to this many characters, the last one `…`, when the span is made.
pub const MAX_ATTRIBUTE_CHARS: usize = 128;
/// A span keeps at most this many policy ids (then one `… N more`).
pub const MAX_SPAN_POLICIES: usize = 32;
/// W3C Trace Context: a `tracestate` longer than this, or with more list members than
/// [`MAX_TRACESTATE_MEMBERS`], or not well formed, is dropped (the `traceparent` is kept).
pub use sharedos_proto::call::MAX_TRACESTATE_CHARS;
pub const MAX_TRACESTATE_MEMBERS: usize = 32;
/// A `traceparent` longer than this is dropped, and its `tracestate` with it (version 00 is 55
/// characters; the shim passes at most 64).
pub use sharedos_proto::call::MAX_TRACEPARENT_CHARS;

/// The `[otel]` section of the config.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OtelSettings {
    /// `false` turns export off even when `OTEL_EXPORTER_OTLP_*` variables are set.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The OTLP/HTTP base URL (`http://127.0.0.1:4318`); `/v1/traces` and `/v1/metrics` are
    /// added. Default: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, then
    /// `http://localhost:4318`.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Extra request headers (added to `OTEL_EXPORTER_OTLP_HEADERS`).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `service.name`; default `OTEL_SERVICE_NAME`, then `sharedos-broker`.
    #[serde(default)]
    pub service_name: Option<String>,
    /// Put the principal on spans (`sharedos.principal`).
    #[serde(default = "yes")]
    pub principal: bool,
    /// Export metrics as well as spans.
    #[serde(default = "yes")]
    pub metrics: bool,
    /// Spans that may wait for the exporter; more are dropped (and counted).
    #[serde(default)]
    pub queue: Option<usize>,
    /// Bytes those spans may hold; more are dropped (and counted) as well.
    #[serde(default)]
    pub queue_bytes: Option<usize>,
    /// How long one export request may take.
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    /// Seconds between metric exports (default `OTEL_METRIC_EXPORT_INTERVAL`, then 60).
    #[serde(default)]
    pub metrics_interval_seconds: Option<u64>,
    /// Export every record line as an OTLP log record too (signed checkpoints are exported
    /// whenever export is on: they are the witness a collector keeps).
    #[serde(default)]
    pub logs: bool,
}

fn yes() -> bool {
    true
}

impl Default for OtelSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            endpoint: None,
            headers: BTreeMap::new(),
            service_name: None,
            principal: true,
            metrics: true,
            queue: None,
            queue_bytes: None,
            timeout_seconds: None,
            metrics_interval_seconds: None,
            logs: false,
        }
    }
}

/// Whether to export, and how: the config's `[otel]` section, else the standard variables
/// (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set turns it on;
/// `OTEL_SDK_DISABLED=true` turns it off). `None`: off.
pub fn effective(section: Option<&OtelSettings>) -> Option<OtelSettings> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return None;
    }
    match section {
        Some(s) if s.enabled => Some(s.clone()),
        Some(_) => None,
        None if env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
            || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some() =>
        {
            Some(OtelSettings::default())
        }
        None => None,
    }
}

/// One finished call, as the export thread needs it.
#[derive(Debug, Clone)]
pub struct CallSpan {
    pub tool: String,
    pub turn: String,
    pub call_id: String,
    pub request_id: Option<String>,
    /// `None` when the config leaves the principal out.
    pub principal: Option<String>,
    pub outcome: &'static str,
    pub code: String,
    pub policies: Vec<String>,
    pub start: SystemTime,
    pub end: SystemTime,
    /// The client's W3C trace context, as sent in `params._meta`.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The approval the call waited for (its id) and how that ended (`approved`, `denied`,
    /// `timeout`, `cancelled`), when a policy asked for one.
    pub approval: Option<(String, &'static str)>,
    /// The span's own ids, chosen when the call started ([`Telemetry::outgoing`]): the parent
    /// an upstream server's spans name.
    pub ids: Option<(TraceId, SpanId)>,
}

/// The W3C trace context a call sends on to an upstream MCP server (`params._meta.traceparent`
/// and `tracestate`, the spec's OpenTelemetry keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl CallSpan {
    /// The span as the queue may hold it: every string cut to [`MAX_ATTRIBUTE_CHARS`], at most
    /// [`MAX_SPAN_POLICIES`] policy ids, the trace context kept only when it is within the W3C
    /// limits ([`bound_trace_context`]). A string already within its limit is kept as it is.
    pub fn bounded(mut self) -> Self {
        for s in [
            &mut self.tool,
            &mut self.turn,
            &mut self.call_id,
            &mut self.code,
        ] {
            cut(s);
        }
        for s in [&mut self.request_id, &mut self.principal]
            .into_iter()
            .flatten()
        {
            cut(s);
        }
        if let Some((id, _)) = &mut self.approval {
            cut(id);
        }
        if self.policies.len() > MAX_SPAN_POLICIES {
            let more = self.policies.len() - (MAX_SPAN_POLICIES - 1);
            self.policies.truncate(MAX_SPAN_POLICIES - 1);
            self.policies.push(format!("… {more} more"));
        }
        self.policies.iter_mut().for_each(cut);
        bound_trace_context(&mut self.traceparent, &mut self.tracestate);
        self
    }

    /// About what the span holds, in bytes: what the queue's byte limit counts.
    fn weight(&self) -> usize {
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        std::mem::size_of::<Self>()
            + self.tool.len()
            + self.turn.len()
            + self.call_id.len()
            + self.code.len()
            + text(&self.request_id)
            + text(&self.principal)
            + text(&self.traceparent)
            + text(&self.tracestate)
            + self.approval.as_ref().map_or(0, |(id, _)| id.len())
            + self
                .policies
                .iter()
                .map(|p| p.len() + std::mem::size_of::<String>())
                .sum::<usize>()
    }
}

/// A client's W3C trace context as a call may keep it, bounded as soon as the call arrives: a
/// `traceparent` longer than [`MAX_TRACEPARENT_CHARS`] is dropped with its `tracestate`; a
/// `tracestate` that breaks the W3C rules (more than [`MAX_TRACESTATE_CHARS`] characters or
/// [`MAX_TRACESTATE_MEMBERS`] members, a malformed or repeated key, a malformed value) is
/// dropped, and the parent kept. What is dropped is freed here, not held until export.
pub fn bound_trace_context(parent: &mut Option<String>, state: &mut Option<String>) {
    if parent
        .as_ref()
        .is_some_and(|p| p.len() > MAX_TRACEPARENT_CHARS)
    {
        *parent = None;
    }
    if parent.is_none() || state.as_deref().is_some_and(|s| !valid_tracestate(s)) {
        *state = None;
    }
}

/// Whether `s` is a `tracestate` header the W3C Trace Context rules allow: at most 512
/// characters and 32 list members, each `key=value` (empty members are allowed), no key twice.
fn valid_tracestate(s: &str) -> bool {
    if s.len() > MAX_TRACESTATE_CHARS {
        return false;
    }
    let mut keys: Vec<&str> = Vec::new();
    for member in s.split(',') {
        let member = member.trim_matches([' ', '\t']);
        if member.is_empty() {
            continue;
        }
        let Some((key, value)) = member.split_once('=') else {
            return false;
        };
        if !valid_tracestate_key(key) || !valid_tracestate_value(value) || keys.contains(&key) {
            return false;
        }
        keys.push(key);
        if keys.len() > MAX_TRACESTATE_MEMBERS {
            return false;
        }
    }
    true
}

/// `simple-key` (`lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")`) or
/// `tenant-id "@" system-id` (`(lcalpha / DIGIT) 0*240(...)` and `lcalpha 0*13(...)`).
fn valid_tracestate_key(key: &str) -> bool {
    let rest = |s: &str, most: usize| {
        s.len() <= most
            && s.bytes().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'_' | b'-' | b'*' | b'/')
            })
    };
    let starts = |s: &str, digit: bool| {
        s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || (digit && b.is_ascii_digit()))
    };
    match key.split_once('@') {
        None => starts(key, false) && rest(&key[1..], 255),
        Some((tenant, system)) => {
            starts(tenant, true)
                && rest(&tenant[1..], 240)
                && starts(system, false)
                && rest(&system[1..], 13)
        }
    }
}

/// `0*255(chr) nblk-chr`: printable ASCII but `,` and `=`, at most 256, not ending in a space.
fn valid_tracestate_value(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 256
        && !value.ends_with(' ')
        && value
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
}

/// What happened to the spans handed to the exporter (and, `logs_*`, to the record lines).
#[derive(Debug, Default)]
pub struct Stats {
    pub queued: AtomicU64,
    pub exported: AtomicU64,
    pub dropped_queue_full: AtomicU64,
    pub dropped_export_failed: AtomicU64,
    pub logs_queued: AtomicU64,
    pub logs_exported: AtomicU64,
    pub logs_dropped_queue_full: AtomicU64,
    pub logs_dropped_export_failed: AtomicU64,
}

/// What the export queue carries: a finished call's span, or a record line (its bytes) to go
/// out as a log record.
#[allow(
    clippy::large_enum_variant,
    reason = "a span is the common item: boxing it would cost every call an allocation"
)]
enum Item {
    Span(CallSpan),
    Line(Vec<u8>),
}

impl Item {
    fn weight(&self) -> usize {
        match self {
            Item::Span(s) => s.weight(),
            Item::Line(l) => std::mem::size_of::<Self>() + l.len(),
        }
    }
}

/// Hands record lines to the export queue (see [`Telemetry::line_export`]); cheap to clone.
#[derive(Clone)]
pub struct LineExport {
    tx: SyncSender<Item>,
    stats: Arc<Stats>,
    bytes: Arc<AtomicUsize>,
    max_bytes: usize,
    /// Every line (`[otel] logs = true`), else checkpoints only.
    all: bool,
}

impl LineExport {
    /// Queues one record line (without its newline) for export as a log record: every line
    /// with `logs = true`, else only checkpoints. Never waits; a full queue drops it (counted).
    pub fn line(&self, line: &[u8], checkpoint: bool) {
        if !(self.all || checkpoint) {
            return;
        }
        let item = Item::Line(line.to_vec());
        let weight = item.weight();
        let dropped = || {
            self.stats
                .logs_dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        };
        if self.bytes.fetch_add(weight, Ordering::Relaxed) + weight > self.max_bytes {
            self.bytes.fetch_sub(weight, Ordering::Relaxed);
            return dropped();
        }
        match self.tx.try_send(item) {
            Ok(()) => {
                self.stats.logs_queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.bytes.fetch_sub(weight, Ordering::Relaxed);
                dropped();
            }
        }
    }
}

type TurnCount = Box<dyn Fn() -> u64 + Send + Sync>;

/// The exporter's handle; off (no thread, nothing done per call) unless started.
#[derive(Default)]
pub struct Telemetry {
    inner: Option<Inner>,
}

struct Inner {
    tx: SyncSender<Item>,
    logs: bool,
    stats: Arc<Stats>,
    /// Bytes the queue (and the batch being sent) holds now, and the most it may.
    bytes: Arc<AtomicUsize>,
    max_bytes: usize,
    principal: bool,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    turns: Arc<OnceLock<TurnCount>>,
    endpoint: String,
}

/// Why export could not start (a config or variable it cannot use).
#[derive(Debug, thiserror::Error)]
#[error("[otel]: {0}")]
pub struct TelemetryError(String);

impl Telemetry {
    /// Export off: every method is a no-op.
    pub fn off() -> Self {
        Self { inner: None }
    }

    /// Starts the export thread, which builds the exporters (their HTTP client must not live
    /// on the async runtime) and says whether it could.
    pub fn start(settings: &OtelSettings) -> Result<Self, TelemetryError> {
        check_protocol()?;
        install_crypto_provider();
        let endpoint = settings.endpoint.as_ref().map(|e| e.trim_end_matches('/'));
        let shown = endpoint.map(str::to_owned).unwrap_or_else(|| {
            std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT"))
                .unwrap_or_else(|_| "http://localhost:4318".into())
        });
        if let Some(e) = endpoint
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return Err(TelemetryError(format!(
                "endpoint = {e:?}: give an http:// URL (OTLP over HTTP, e.g. http://127.0.0.1:4318)"
            )));
        }
        // `shown` is the configured endpoint when there is one, else what the variables say.
        if shown.starts_with("https://") {
            return Err(TelemetryError(format!(
                "endpoint {shown}: this build exports over plain HTTP only (no TLS stack); send to a local collector"
            )));
        }
        let queue = settings.queue.unwrap_or(DEFAULT_QUEUE);
        if queue == 0 {
            return Err(TelemetryError("queue = 0: give at least 1".into()));
        }
        let max_bytes = settings.queue_bytes.unwrap_or(DEFAULT_QUEUE_BYTES);
        if max_bytes < MIN_QUEUE_BYTES {
            return Err(TelemetryError(format!(
                "queue_bytes = {max_bytes}: give at least {MIN_QUEUE_BYTES}"
            )));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(queue);
        let stats = Arc::new(Stats::default());
        let bytes = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let turns: Arc<OnceLock<TurnCount>> = Arc::new(OnceLock::new());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        // The worker takes the endpoint as checked here, trimmed once.
        let mut trimmed = settings.clone();
        trimmed.endpoint = endpoint.map(str::to_owned);
        let worker = Worker {
            rx,
            settings: trimmed,
            stats: stats.clone(),
            bytes: bytes.clone(),
            stop: stop.clone(),
            turns: turns.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("otel-export".into())
            .spawn(move || worker.run(ready_tx))
            .map_err(|e| TelemetryError(format!("cannot start the export thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(TelemetryError(e));
            }
            Err(_) => return Err(TelemetryError("the export thread ended at start".into())),
        }
        tracing::info!(endpoint = %shown, queue, queue_bytes = max_bytes, "OpenTelemetry export on");
        Ok(Self {
            inner: Some(Inner {
                tx,
                logs: settings.logs,
                stats,
                bytes,
                max_bytes,
                principal: settings.principal,
                stop,
                thread: Mutex::new(Some(thread)),
                turns,
                endpoint: shown,
            }),
        })
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The trace context a call passes upstream, decided as it starts: with export on, the
    /// broker's span for the call (ids chosen now, in the client's trace when it sent one) is
    /// the upstream's parent; with export off, the client's context goes on as it came.
    pub fn outgoing(
        &self,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) -> (Option<Outgoing>, Option<(TraceId, SpanId)>) {
        if self.inner.is_none() {
            let out = traceparent.map(|t| Outgoing {
                traceparent: t.to_owned(),
                tracestate: tracestate.map(str::to_owned),
            });
            return (out, None);
        }
        let ids = RandomIdGenerator::default();
        let parent = remote_parent(traceparent, tracestate);
        let (trace_id, flags) = match &parent {
            Some(p) => (p.trace_id(), p.trace_flags()),
            None => (ids.new_trace_id(), TraceFlags::SAMPLED),
        };
        let span_id = ids.new_span_id();
        let out = Outgoing {
            traceparent: format!("00-{trace_id}-{span_id}-{:02x}", flags.to_u8()),
            tracestate: parent.and(tracestate.map(str::to_owned)),
        };
        (Some(out), Some((trace_id, span_id)))
    }

    /// Whether spans carry the principal.
    pub fn principal_on(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.principal)
    }

    /// Hands a finished call to the export thread, bounded first ([`CallSpan::bounded`]); never
    /// waits. A queue full by spans or by bytes drops it (counted).
    pub fn call(&self, span: CallSpan) {
        let Some(inner) = &self.inner else { return };
        let span = span.bounded();
        let weight = span.weight();
        let dropped = || {
            inner
                .stats
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        };
        if inner.bytes.fetch_add(weight, Ordering::Relaxed) + weight > inner.max_bytes {
            inner.bytes.fetch_sub(weight, Ordering::Relaxed);
            return dropped();
        }
        match inner.tx.try_send(Item::Span(span)) {
            Ok(()) => {
                inner.stats.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                inner.bytes.fetch_sub(weight, Ordering::Relaxed);
                dropped();
            }
        }
    }

    /// What the record hands its lines to (checkpoints always, every line with `logs = true`);
    /// `None` when export is off.
    pub fn line_export(&self) -> Option<LineExport> {
        let inner = self.inner.as_ref()?;
        Some(LineExport {
            tx: inner.tx.clone(),
            stats: inner.stats.clone(),
            bytes: inner.bytes.clone(),
            max_bytes: inner.max_bytes,
            all: inner.logs,
        })
    }

    /// Where `sharedos.turns.open` reads the number of open turns (set once, by the server).
    pub fn count_turns_with(&self, count: impl Fn() -> u64 + Send + Sync + 'static) {
        if let Some(inner) = &self.inner {
            let _ = inner.turns.set(Box::new(count));
        }
    }

    pub fn stats(&self) -> TelemetryStats {
        match &self.inner {
            None => TelemetryStats {
                enabled: false,
                endpoint: None,
                queued: 0,
                exported: 0,
                dropped_queue_full: 0,
                dropped_export_failed: 0,
                logs: Default::default(),
                witness: Default::default(),
            },
            Some(i) => TelemetryStats {
                enabled: true,
                endpoint: Some(i.endpoint.clone()),
                queued: i.stats.queued.load(Ordering::Relaxed),
                exported: i.stats.exported.load(Ordering::Relaxed),
                dropped_queue_full: i.stats.dropped_queue_full.load(Ordering::Relaxed),
                dropped_export_failed: i.stats.dropped_export_failed.load(Ordering::Relaxed),
                logs: sharedos_proto::ipc::LogStats {
                    queued: i.stats.logs_queued.load(Ordering::Relaxed),
                    exported: i.stats.logs_exported.load(Ordering::Relaxed),
                    dropped_queue_full: i.stats.logs_dropped_queue_full.load(Ordering::Relaxed),
                    dropped_export_failed: i
                        .stats
                        .logs_dropped_export_failed
                        .load(Ordering::Relaxed),
                },
                witness: Default::default(),
            },
        }
    }

    /// Exports what is queued and stops the thread (blocking; at most about one export
    /// timeout per pending batch and the metric flush).
    pub fn shutdown(&self) {
        let Some(inner) = &self.inner else { return };
        inner.stop.store(true, Ordering::Relaxed);
        let thread = crate::lock(&inner.thread).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
        let s = self.stats();
        tracing::info!(
            exported = s.exported,
            dropped_queue_full = s.dropped_queue_full,
            dropped_export_failed = s.dropped_export_failed,
            "OpenTelemetry export stopped"
        );
    }
}

/// Only OTLP over HTTP/protobuf is built in: a variable asking for another protocol is an error,
/// not a silent switch.
fn check_protocol() -> Result<(), TelemetryError> {
    for var in [
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    ] {
        if let Ok(v) = std::env::var(var)
            && !v.is_empty()
            && v != "http/protobuf"
        {
            return Err(TelemetryError(format!(
                "{var}={v}: this broker exports OTLP over http/protobuf only"
            )));
        }
    }
    Ok(())
}

struct Worker {
    rx: Receiver<Item>,
    settings: OtelSettings,
    stats: Arc<Stats>,
    bytes: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    turns: Arc<OnceLock<TurnCount>>,
}

struct Instruments {
    provider: SdkMeterProvider,
    duration: opentelemetry::metrics::Histogram<f64>,
    calls: opentelemetry::metrics::Counter<u64>,
}

impl Worker {
    fn run(self, ready: std::sync::mpsc::Sender<Result<(), String>>) {
        let (exporter, log_exporter, instruments) = match self.build() {
            Ok(built) => built,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        let ids = RandomIdGenerator::default();
        let scope = InstrumentationScope::builder("sharedos-broker")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let mut failing = false;
        let mut logs_failing = false;
        // Makes the log records (the SDK's only way to); it has no processor: they go to
        // `log_exporter` here, counted.
        let log_provider = opentelemetry_sdk::logs::SdkLoggerProvider::builder().build();
        let logger = opentelemetry::logs::LoggerProvider::logger(&log_provider, "sharedos-broker");
        // Each open turn's principal, from its `turn_opened` line, for the lines of the turn.
        let mut principals: HashMap<String, String> = HashMap::new();
        loop {
            let first = match self.rx.recv_timeout(STOP_POLL) {
                Ok(s) => s,
                Err(RecvTimeoutError::Timeout) if !self.stop.load(Ordering::Relaxed) => continue,
                Err(_) => match self.rx.try_recv() {
                    Ok(s) => s,
                    Err(_) => break,
                },
            };
            // Gather a batch: up to MAX_BATCH spans, or what arrives within LINGER of the first
            // (none at shutdown). One request per span or two under steady traffic cost the
            // export thread more per span in HTTP than in the spans themselves (issue 19's 5 µs).
            let mut batch = vec![first];
            let until = Instant::now() + LINGER;
            while batch.len() < MAX_BATCH {
                let left = until.saturating_duration_since(Instant::now());
                let next = if left.is_zero() || self.stop.load(Ordering::Relaxed) {
                    self.rx.try_recv().map_err(|_| ())
                } else {
                    match self.rx.recv_timeout(left.min(STOP_POLL)) {
                        Ok(s) => Ok(s),
                        // Look at the clock and the stop flag again.
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => Err(()),
                    }
                };
                match next {
                    Ok(s) => batch.push(s),
                    Err(()) => break,
                }
            }
            // Counted against the queue's bytes until the export is over.
            let weight: usize = batch.iter().map(Item::weight).sum();
            let mut spans: Vec<SpanData> = Vec::new();
            let mut lines: Vec<Vec<u8>> = Vec::new();
            for item in batch {
                match item {
                    Item::Span(s) => {
                        if let Some(m) = &instruments {
                            m.record(&s);
                        }
                        spans.push(span_data(s, &ids, &scope));
                    }
                    Item::Line(l) => lines.push(l),
                }
            }
            if !lines.is_empty() {
                let n = lines.len() as u64;
                let records: Vec<opentelemetry_sdk::logs::SdkLogRecord> = lines
                    .iter()
                    .map(|l| {
                        log_record(
                            &logger,
                            l,
                            self.settings.principal.then_some(&mut principals),
                        )
                    })
                    .collect();
                let pairs: Vec<(
                    &opentelemetry_sdk::logs::SdkLogRecord,
                    &InstrumentationScope,
                )> = records.iter().map(|r| (r, &scope)).collect();
                let batch = opentelemetry_sdk::logs::LogBatch::new(&pairs);
                match futures_executor::block_on(opentelemetry_sdk::logs::LogExporter::export(
                    &log_exporter,
                    batch,
                )) {
                    Ok(()) => {
                        self.stats.logs_exported.fetch_add(n, Ordering::Relaxed);
                        logs_failing = false;
                    }
                    Err(e) => {
                        self.stats
                            .logs_dropped_export_failed
                            .fetch_add(n, Ordering::Relaxed);
                        if !logs_failing {
                            tracing::warn!(error = %e, "OpenTelemetry log export failed: record lines are not exported (counted) until it works again; the record is unaffected");
                            logs_failing = true;
                        }
                    }
                }
            }
            if spans.is_empty() {
                self.bytes.fetch_sub(weight, Ordering::Relaxed);
                continue;
            }
            let n = spans.len() as u64;
            let exported = futures_executor::block_on(exporter.export(spans));
            self.bytes.fetch_sub(weight, Ordering::Relaxed);
            match exported {
                Ok(()) => {
                    self.stats.exported.fetch_add(n, Ordering::Relaxed);
                    if failing {
                        tracing::info!("OpenTelemetry export works again");
                        failing = false;
                    }
                }
                Err(e) => {
                    self.stats
                        .dropped_export_failed
                        .fetch_add(n, Ordering::Relaxed);
                    if !failing {
                        tracing::warn!(error = %e, "OpenTelemetry export failed: spans are dropped (counted) until it works again; the record is unaffected");
                        failing = true;
                    }
                }
            }
        }
        let _ = exporter.shutdown();
        let _ = opentelemetry_sdk::logs::LogExporter::shutdown(&log_exporter);
        if let Some(m) = instruments {
            let _ = m.provider.shutdown();
        }
    }

    #[allow(
        clippy::type_complexity,
        reason = "the three exporters, built together"
    )]
    fn build(
        &self,
    ) -> Result<
        (
            opentelemetry_otlp::SpanExporter,
            opentelemetry_otlp::LogExporter,
            Option<Instruments>,
        ),
        String,
    > {
        let s = &self.settings;
        let base = s.endpoint.as_deref();
        let timeout = Duration::from_secs(s.timeout_seconds.unwrap_or(5).max(1));
        let headers: HashMap<String, String> = s
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut resource = Resource::builder();
        if let Some(name) = &s.service_name {
            resource = resource.with_service_name(name.clone());
        } else if std::env::var("OTEL_SERVICE_NAME").is_err() {
            resource = resource.with_service_name("sharedos-broker");
        }
        let resource = resource.build();
        let mut spans = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_timeout(timeout)
            .with_headers(headers.clone());
        if let Some(b) = base {
            spans = spans.with_endpoint(format!("{b}/v1/traces"));
        }
        let mut exporter = spans
            .build()
            .map_err(|e| format!("cannot build the span exporter: {e}"))?;
        exporter.set_resource(&resource);
        let mut logs = opentelemetry_otlp::LogExporter::builder()
            .with_http()
            .with_timeout(timeout)
            .with_headers(headers.clone());
        if let Some(b) = base {
            logs = logs.with_endpoint(format!("{b}/v1/logs"));
        }
        let mut log_exporter = logs
            .build()
            .map_err(|e| format!("cannot build the log exporter: {e}"))?;
        opentelemetry_sdk::logs::LogExporter::set_resource(&mut log_exporter, &resource);
        let instruments = if s.metrics {
            let mut metrics = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_timeout(timeout)
                .with_headers(headers);
            if let Some(b) = base {
                metrics = metrics.with_endpoint(format!("{b}/v1/metrics"));
            }
            let metrics = metrics
                .build()
                .map_err(|e| format!("cannot build the metric exporter: {e}"))?;
            let mut reader = opentelemetry_sdk::metrics::PeriodicReader::builder(metrics);
            if let Some(secs) = s.metrics_interval_seconds {
                reader = reader.with_interval(Duration::from_secs(secs.max(1)));
            }
            let provider = SdkMeterProvider::builder()
                .with_resource(resource)
                .with_reader(reader.build())
                .build();
            let meter = opentelemetry::metrics::MeterProvider::meter(&provider, "sharedos-broker");
            let duration = meter
                .f64_histogram("mcp.server.operation.duration")
                .with_unit("s")
                .with_description("Duration of tools/call as the broker handled it")
                .with_boundaries(DURATION_BOUNDARIES.to_vec())
                .build();
            let calls = meter
                .u64_counter("sharedos.tool.calls")
                .with_description("tools/call attempts by tool, outcome and code")
                .build();
            let turns = self.turns.clone();
            let _open = meter
                .u64_observable_gauge("sharedos.turns.open")
                .with_description("Turns open now")
                .with_callback(move |o| {
                    if let Some(count) = turns.get() {
                        o.observe(count(), &[]);
                    }
                })
                .build();
            let stats = self.stats.clone();
            let _dropped = meter
                .u64_observable_counter("sharedos.telemetry.spans.dropped")
                .with_description("Spans dropped: queue full or export failed")
                .with_callback(move |o| {
                    let full = stats.dropped_queue_full.load(Ordering::Relaxed);
                    let failed = stats.dropped_export_failed.load(Ordering::Relaxed);
                    o.observe(full, &[KeyValue::new("reason", "queue_full")]);
                    o.observe(failed, &[KeyValue::new("reason", "export_failed")]);
                })
                .build();
            Some(Instruments {
                provider,
                duration,
                calls,
            })
        } else {
            None
        };
        Ok((exporter, log_exporter, instruments))
    }
}

/// What [`log_record`] reads of a record line; a string field that is not a string, or a
/// `seq` that is not a number, leaves the line without attributes (its body is still sent).
#[derive(serde::Deserialize)]
struct LineHead<'a> {
    #[serde(borrow)]
    at: Option<Cow<'a, str>>,
    #[serde(borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    turn: Option<Cow<'a, str>>,
    #[serde(borrow)]
    outcome: Option<Cow<'a, str>>,
    #[serde(borrow)]
    code: Option<Cow<'a, str>>,
    seq: Option<u64>,
    #[serde(borrow, rename = "accessContext")]
    access_context: Option<LineContext<'a>>,
}

#[derive(serde::Deserialize)]
struct LineContext<'a> {
    #[serde(borrow)]
    principal: Option<Cow<'a, str>>,
}

/// A record line as an OTLP log record: the line is the body; its `kind`, `turn`, `seq`,
/// `outcome`, `code` and (with `principal = true`) `principal` are attributes
/// (`sharedos.kind`, ...); its `at` is the timestamp.
fn log_record(
    logger: &opentelemetry_sdk::logs::SdkLogger,
    line: &[u8],
    principals: Option<&mut HashMap<String, String>>,
) -> opentelemetry_sdk::logs::SdkLogRecord {
    use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, Severity};
    let mut r = logger.create_log_record();
    let text = String::from_utf8_lossy(line).into_owned();
    r.set_observed_timestamp(SystemTime::now());
    r.set_event_name("sharedos.record");
    r.set_severity_number(Severity::Info);
    // Only the fields that become attributes are read, borrowed where they need no unescaping:
    // the rest of the line (arguments, requirement, policies) is skipped, not built.
    if let Ok(v) = serde_json::from_slice::<LineHead<'_>>(line) {
        let at = v.at.as_deref().and_then(|a| {
            time::OffsetDateTime::parse(a, &time::format_description::well_known::Rfc3339).ok()
        });
        r.set_timestamp(at.map_or_else(SystemTime::now, SystemTime::from));
        for (key, value) in [
            ("sharedos.kind", &v.kind),
            ("sharedos.turn", &v.turn),
            ("sharedos.outcome", &v.outcome),
            ("sharedos.code", &v.code),
        ] {
            if let Some(t) = value {
                r.add_attribute(key, bounded(t));
            }
        }
        if let Some(seq) = v.seq {
            r.add_attribute("sharedos.seq", i64::try_from(seq).unwrap_or(i64::MAX));
        }
        if let Some(principals) = principals
            && let Some(turn) = v.turn.as_deref()
        {
            let kind = v.kind.as_deref().unwrap_or("");
            if kind == "turn_opened"
                && let Some(p) = v
                    .access_context
                    .as_ref()
                    .and_then(|c| c.principal.as_deref())
                && principals.len() < MAX_LOG_TURNS
            {
                principals.insert(turn.to_owned(), bounded(p));
            }
            let known = if kind == "turn_closed" {
                principals.remove(turn)
            } else {
                principals.get(turn).cloned()
            };
            if let Some(p) = known {
                r.add_attribute("sharedos.principal", p);
            }
        }
    }
    r.set_body(AnyValue::from(text));
    r
}

impl Instruments {
    fn record(&self, s: &CallSpan) {
        let tool = metric_tool(&s.code, &s.tool);
        let secs = s
            .end
            .duration_since(s.start)
            .unwrap_or_default()
            .as_secs_f64();
        let mut attrs = vec![
            KeyValue::new("mcp.method.name", "tools/call"),
            KeyValue::new("gen_ai.tool.name", tool.clone()),
            KeyValue::new("sharedos.outcome", s.outcome),
        ];
        if let Some(e) = error_type(s.outcome) {
            attrs.push(KeyValue::new("error.type", e));
        }
        self.duration.record(secs, &attrs);
        self.calls.add(
            1,
            &[
                KeyValue::new("gen_ai.tool.name", tool),
                KeyValue::new("sharedos.outcome", s.outcome),
                KeyValue::new("sharedos.code", s.code.clone()),
            ],
        );
    }
}

/// The bucket boundaries (s) the MCP semantic conventions give `mcp.server.operation.duration`;
/// the SDK's default ones (0, 5, 10, 25 … 10,000) are meant for milliseconds and would put every
/// call in one bucket.
const DURATION_BOUNDARIES: [f64; 14] = [
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// The tool as a metric attribute. A tool the catalogue does not hold is any string a client
/// chose: one bucket for all, so a hostile client cannot grow the metric's series (a published
/// tool is one of the catalogue's, which the host chose).
fn metric_tool(code: &str, tool: &str) -> String {
    match code {
        "malformed_tool_name" | "unpublished_tool" => "(unpublished)".to_owned(),
        _ => bounded(tool),
    }
}

/// `error.type`: the MCP conventions' `tool_error` for a result with `isError: true` (a
/// refusal or a failure; `sharedos.outcome` and `sharedos.code` say which), `cancelled` for a
/// call the client cancelled.
fn error_type(outcome: &str) -> Option<&'static str> {
    match outcome {
        "succeeded" => None,
        "cancelled" => Some("cancelled"),
        _ => Some("tool_error"),
    }
}

/// `text` as a span attribute: cut to [`MAX_ATTRIBUTE_CHARS`] characters, the last one `…`.
pub fn bounded(text: &str) -> String {
    match text.char_indices().nth(MAX_ATTRIBUTE_CHARS) {
        Some(_) => {
            let at = text
                .char_indices()
                .nth(MAX_ATTRIBUTE_CHARS - 1)
                .map_or(0, |(at, _)| at);
            format!("{}…", &text[..at])
        }
        None => text.to_owned(),
    }
}

/// [`bounded`] in place: a string within the limit is left alone (and not copied).
fn cut(text: &mut String) {
    if text.char_indices().nth(MAX_ATTRIBUTE_CHARS).is_some() {
        *text = bounded(text);
    }
}

/// The remote parent a client sent (`traceparent`, `tracestate`), if it is valid W3C.
fn remote_parent(traceparent: Option<&str>, tracestate: Option<&str>) -> Option<SpanContext> {
    let mut carrier = HashMap::new();
    carrier.insert("traceparent".to_owned(), traceparent?.to_owned());
    if let Some(s) = tracestate {
        carrier.insert("tracestate".to_owned(), s.to_owned());
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    let parent = cx.span().span_context().clone();
    parent.is_valid().then_some(parent)
}

fn span_data(s: CallSpan, ids: &RandomIdGenerator, scope: &InstrumentationScope) -> SpanData {
    let parent = remote_parent(s.traceparent.as_deref(), s.tracestate.as_deref());
    let tool = bounded(&s.tool);
    let (trace_id, parent_id, flags, state) = match &parent {
        Some(p) => (
            p.trace_id(),
            p.span_id(),
            p.trace_flags(),
            p.trace_state().clone(),
        ),
        None => (
            ids.new_trace_id(),
            SpanId::INVALID,
            TraceFlags::SAMPLED,
            TraceState::default(),
        ),
    };
    let mut attributes = vec![
        KeyValue::new("mcp.method.name", "tools/call"),
        KeyValue::new("gen_ai.tool.name", tool.clone()),
        KeyValue::new("gen_ai.operation.name", "execute_tool"),
        KeyValue::new("network.transport", "pipe"),
        KeyValue::new("sharedos.outcome", s.outcome),
        KeyValue::new("sharedos.code", s.code.clone()),
        KeyValue::new(
            "sharedos.policies",
            OtelValue::Array(
                s.policies
                    .into_iter()
                    .map(StringValue::from)
                    .collect::<Vec<_>>()
                    .into(),
            ),
        ),
        KeyValue::new("sharedos.turn", s.turn),
        KeyValue::new("sharedos.call_id", s.call_id),
    ];
    if let Some(id) = s.request_id {
        attributes.push(KeyValue::new("jsonrpc.request.id", id));
    }
    if let Some(p) = s.principal {
        attributes.push(KeyValue::new("sharedos.principal", p));
    }
    if let Some((id, decision)) = s.approval {
        attributes.push(KeyValue::new("sharedos.approval.id", id));
        attributes.push(KeyValue::new("sharedos.approval.decision", decision));
    }
    let status = match error_type(s.outcome) {
        Some(e) => {
            attributes.push(KeyValue::new("error.type", e));
            Status::Error {
                description: Cow::Owned(format!("{}/{}", s.outcome, s.code)),
            }
        }
        None => Status::Unset,
    };
    // Ids chosen at the call's start (what the upstream was told) when there are any.
    let (trace_id, span_id) = s.ids.unwrap_or_else(|| (trace_id, ids.new_span_id()));
    SpanData {
        span_context: SpanContext::new(trace_id, span_id, flags, false, state),
        parent_span_id: parent_id,
        parent_span_is_remote: parent.is_some(),
        span_kind: SpanKind::Server,
        name: Cow::Owned(format!("tools/call {tool}")),
        start_time: s.start,
        end_time: s.end,
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    }
}

/// Makes ring the process's rustls provider, once. reqwest is built with rustls and no provider
/// of its own (the remote transport chooses ring explicitly); the OTLP exporter's client asks
/// for the process default, and without one its builder panics. Installing it twice is a no-op.
pub fn install_crypto_provider() {
    #[expect(
        deprecated,
        reason = "ring has no post-quantum key exchange; aws-lc-rs would need a C build on every CI machine"
    )]
    let ring = rustls::crypto::ring::default_provider();
    let _ = ring.install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(outcome: &'static str, code: &str, parent: Option<&str>) -> CallSpan {
        let now = SystemTime::now();
        CallSpan {
            tool: "files.read".into(),
            turn: "t1".into(),
            call_id: "c1".into(),
            request_id: Some("7".into()),
            principal: Some("alice".into()),
            outcome,
            code: code.into(),
            policies: vec!["p1".into()],
            start: now,
            end: now + Duration::from_millis(3),
            traceparent: parent.map(str::to_owned),
            tracestate: None,
            approval: None,
            ids: None,
        }
    }

    fn attr<'a>(s: &'a SpanData, key: &str) -> Option<&'a OtelValue> {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| &kv.value)
    }

    #[test]
    fn a_span_takes_the_clients_parent_and_the_decision() {
        let ids = RandomIdGenerator::default();
        let scope = InstrumentationScope::builder("t").build();
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let s = span_data(call("denied", "no_permit", Some(parent)), &ids, &scope);
        assert_eq!(s.name, "tools/call files.read");
        assert_eq!(s.span_kind, SpanKind::Server);
        assert_eq!(
            s.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(s.parent_span_id.to_string(), "00f067aa0ba902b7");
        assert!(s.parent_span_is_remote);
        assert_eq!(
            attr(&s, "error.type").map(|v| v.as_str().into_owned()),
            Some("tool_error".into())
        );
        assert_eq!(
            attr(&s, "sharedos.code").map(|v| v.as_str().into_owned()),
            Some("no_permit".into())
        );
        assert!(matches!(s.status, Status::Error { .. }));
    }

    #[test]
    fn a_bad_traceparent_starts_a_new_trace() {
        let ids = RandomIdGenerator::default();
        let scope = InstrumentationScope::builder("t").build();
        let s = span_data(call("succeeded", "ok", Some("00-zz-01")), &ids, &scope);
        assert_eq!(s.parent_span_id, SpanId::INVALID);
        assert!(!s.parent_span_is_remote);
        assert!(attr(&s, "error.type").is_none());
        assert_eq!(s.status, Status::Unset);
    }

    #[test]
    fn a_long_name_is_cut() {
        let long = "é".repeat(500);
        let b = bounded(&long);
        assert_eq!(b.chars().count(), MAX_ATTRIBUTE_CHARS);
        assert!(b.ends_with("é…"), "{b}");
        // Cut once: a cut string is within the limit.
        assert_eq!(bounded(&b), b);
        assert_eq!(bounded("files.read"), "files.read");
    }

    /// Everything a call hands to a span is bounded when the span is made: a 7 MiB tracestate
    /// is dropped (the parent kept), a 100,000-character request id and every other string cut.
    #[test]
    fn a_span_holds_no_more_than_its_limits() {
        let huge = "x".repeat(100_000);
        let mut s = call(
            "denied",
            &huge,
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        s.tool = huge.clone();
        s.turn = huge.clone();
        s.call_id = huge.clone();
        s.request_id = Some(huge.clone());
        s.principal = Some(huge.clone());
        s.approval = Some((huge.clone(), "approved"));
        s.policies = vec![huge.clone(); 1000];
        s.tracestate = Some(format!("vendor={}", "v".repeat(7 << 20)));
        let s = s.bounded();
        assert!(s.traceparent.is_some());
        assert_eq!(s.tracestate, None);
        for text in [&s.tool, &s.turn, &s.call_id, &s.code]
            .into_iter()
            .chain(s.request_id.as_ref())
            .chain(s.principal.as_ref())
            .chain(s.approval.as_ref().map(|(id, _)| id))
            .chain(&s.policies)
        {
            assert!(
                text.chars().count() <= MAX_ATTRIBUTE_CHARS,
                "{}",
                text.len()
            );
        }
        assert_eq!(s.policies.len(), MAX_SPAN_POLICIES);
        assert_eq!(s.policies[MAX_SPAN_POLICIES - 1], "… 969 more");
        assert!(s.weight() < 16 * 1024, "{}", s.weight());
        let ids = RandomIdGenerator::default();
        let scope = InstrumentationScope::builder("t").build();
        let data = span_data(s, &ids, &scope);
        assert_eq!(
            attr(&data, "jsonrpc.request.id").map(|v| v.as_str().chars().count()),
            Some(MAX_ATTRIBUTE_CHARS)
        );
    }

    #[test]
    fn tracestate_follows_the_w3c_rules() {
        let parent = || Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned());
        let kept = |state: &str| {
            let (mut p, mut s) = (parent(), Some(state.to_owned()));
            bound_trace_context(&mut p, &mut s);
            assert!(p.is_some());
            s.is_some()
        };
        assert!(kept("vendor=x"));
        assert!(kept("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"));
        assert!(kept("a@b=1, ,c-d/e*f_g=two words"));
        assert!(kept(&format!("k={}", "v".repeat(256))));
        let members: Vec<String> = (0..32).map(|i| format!("k{i}=v")).collect();
        assert!(kept(&members.join(",")));
        let members: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert!(!kept(&members.join(",")), "33 members");
        assert!(!kept(&format!("k={}", "v".repeat(257))), "a value over 256");
        assert!(
            !kept(&format!("a={},b=c", "v".repeat(MAX_TRACESTATE_CHARS))),
            "over 512"
        );
        assert!(!kept("Upper=x"));
        assert!(!kept("k=v,k=w"), "a key twice");
        assert!(!kept("k"), "no value");
        assert!(!kept("k=a=b"));
        assert!(
            kept("k=v "),
            "a space after a member is optional whitespace"
        );
        assert!(!kept("k= "), "an empty value");
        assert!(!kept("k=caf\u{e9}"));
        assert!(!kept("@x=1"));
        assert!(!kept("t@Sys=1"));
        // No parent: no state either; an overlong parent goes with its state.
        let (mut p, mut s) = (None, Some("vendor=x".to_owned()));
        bound_trace_context(&mut p, &mut s);
        assert_eq!(s, None);
        let (mut p, mut s) = (Some("0".repeat(100)), Some("vendor=x".to_owned()));
        bound_trace_context(&mut p, &mut s);
        assert_eq!((p, s), (None, None));
    }

    /// The queue is bounded in bytes too: with room for few spans' bytes and a collector that
    /// never answers, spans past the bytes are dropped and counted although the count has room.
    #[test]
    fn the_queue_is_bounded_in_bytes() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = silent.local_addr().expect("addr").port();
        let t = Telemetry::start(&OtelSettings {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            metrics: false,
            queue: Some(100_000),
            queue_bytes: Some(MIN_QUEUE_BYTES),
            timeout_seconds: Some(1),
            ..OtelSettings::default()
        })
        .expect("start");
        let mut big = call("succeeded", "ok", None);
        big.policies = vec!["p".repeat(MAX_ATTRIBUTE_CHARS); MAX_SPAN_POLICIES];
        let weight = big.clone().bounded().weight();
        for _ in 0..2000 {
            t.call(big.clone());
        }
        let s = t.stats();
        assert_eq!(s.queued + s.dropped_queue_full, 2000, "{s:?}");
        assert!(
            s.queued <= (MIN_QUEUE_BYTES / weight) as u64,
            "{} spans of {weight} bytes queued: {s:?}",
            s.queued
        );
        assert!(s.queued > 0, "{s:?}");
        t.shutdown();
        drop(silent);
    }

    /// A backend that takes the connection and never answers: the export thread waits on it,
    /// the queue fills, and every further span is dropped and counted, none waited for.
    #[test]
    fn a_full_queue_drops_and_counts() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = silent.local_addr().expect("addr").port();
        let t = Telemetry::start(&OtelSettings {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            metrics: false,
            queue: Some(4),
            timeout_seconds: Some(1),
            ..OtelSettings::default()
        })
        .expect("start");
        for _ in 0..2000 {
            t.call(call("succeeded", "ok", None));
        }
        let s = t.stats();
        assert_eq!(s.queued + s.dropped_queue_full, 2000, "{s:?}");
        // The queue's 4, and the one batch (at most MAX_BATCH) the thread gathered out of it,
        // racing the loop, before it blocked on the silent backend: the rest is dropped.
        assert!(s.queued <= MAX_BATCH as u64 + 4, "{s:?}");
        t.shutdown();
        let s = t.stats();
        assert_eq!(s.exported, 0, "{s:?}");
        assert_eq!(s.dropped_export_failed, s.queued, "{s:?}");
        drop(silent);
    }

    /// A stand-in OTLP/HTTP sink for timing tests (the real backend is Phoenix, in the e2e
    /// tests): answers every request 200 with an empty body and notes when each arrived.
    struct Sink {
        port: u16,
        /// When each request arrived, and its path.
        arrivals: Arc<Mutex<Vec<(Instant, String)>>>,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Sink {
        fn start() -> Self {
            use std::io::{BufRead as _, BufReader, Read as _, Write as _};
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let port = listener.local_addr().expect("addr").port();
            let arrivals = Arc::new(Mutex::new(Vec::new()));
            let stop = Arc::new(AtomicBool::new(false));
            let (seen, stopped) = (arrivals.clone(), stop.clone());
            let thread = std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stopped.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let seen = seen.clone();
                    std::thread::spawn(move || {
                        let mut out = conn.try_clone().expect("clone");
                        let mut reader = BufReader::new(conn);
                        loop {
                            let mut length = 0usize;
                            let mut path = String::new();
                            let mut line = String::new();
                            loop {
                                line.clear();
                                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                    return;
                                }
                                if line == "\r\n" {
                                    break;
                                }
                                if path.is_empty() {
                                    // The request line: `POST /v1/traces HTTP/1.1`.
                                    path = line.split(' ').nth(1).unwrap_or("").to_owned();
                                }
                                let lower = line.to_ascii_lowercase();
                                if let Some(v) = lower.strip_prefix("content-length:") {
                                    length = v.trim().parse().unwrap_or(0);
                                }
                            }
                            let mut body = vec![0; length];
                            if reader.read_exact(&mut body).is_err() {
                                return;
                            }
                            crate::lock(&seen).push((Instant::now(), path));
                            let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                            if out.write_all(answer.as_bytes()).is_err() {
                                return;
                            }
                        }
                    });
                }
            });
            Sink {
                port,
                arrivals,
                stop,
                thread: Some(thread),
            }
        }

        fn telemetry(&self) -> Telemetry {
            Telemetry::start(&OtelSettings {
                // With a trailing slash, which the broker trims once.
                endpoint: Some(format!("http://127.0.0.1:{}/", self.port)),
                metrics: false,
                ..OtelSettings::default()
            })
            .expect("start")
        }

        fn arrivals(&self) -> Vec<(Instant, String)> {
            crate::lock(&self.arrivals).clone()
        }
    }

    impl Drop for Sink {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            // Wakes the accept loop, which then sees the flag.
            let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// Spans are gathered for LINGER after the first of a batch, and sent together then: a
    /// span waits at least that long under light traffic, and not much longer.
    #[test]
    fn a_batch_goes_out_linger_after_its_first_span() {
        let sink = Sink::start();
        let t = sink.telemetry();
        let first = Instant::now();
        t.call(call("succeeded", "ok", None));
        std::thread::sleep(Duration::from_millis(50));
        t.call(call("denied", "no_permit", None));
        let deadline = Instant::now() + Duration::from_secs(5);
        while t.stats().exported < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let arrivals = sink.arrivals();
        assert_eq!(arrivals.len(), 1, "both spans in one request");
        assert_eq!(arrivals[0].1, "/v1/traces");
        let waited = arrivals[0].0 - first;
        assert!(
            waited >= LINGER - Duration::from_millis(10) && waited < LINGER * 5,
            "the batch left {waited:?} after its first span; LINGER is {LINGER:?}"
        );
        assert_eq!(t.stats().exported, 2);
        t.shutdown();
    }

    /// Shutdown sends what is gathered without waiting out LINGER.
    #[test]
    fn shutdown_does_not_wait_for_a_batch_to_fill() {
        let sink = Sink::start();
        let t = sink.telemetry();
        t.call(call("succeeded", "ok", None));
        // Let the thread take the span and start gathering its batch.
        std::thread::sleep(Duration::from_millis(5));
        let asked = Instant::now();
        t.shutdown();
        let took = asked.elapsed();
        assert!(
            took < LINGER,
            "shutdown took {took:?}, not less than LINGER ({LINGER:?})"
        );
        assert_eq!(t.stats().exported, 1, "the gathered span went out");
        assert_eq!(sink.arrivals().len(), 1);
    }

    /// However many names a client invents, calls to tools outside the catalogue add one series.
    #[test]
    fn invented_tool_names_share_one_metric_series() {
        let mut series = std::collections::BTreeSet::new();
        for i in 0..1000 {
            series.insert(metric_tool("unpublished_tool", &format!("x.tool{i}")));
            series.insert(metric_tool("malformed_tool_name", &format!("bad name {i}")));
        }
        series.insert(metric_tool("ok", "files.read"));
        series.insert(metric_tool("no_permit", "files.read"));
        assert_eq!(
            series.into_iter().collect::<Vec<_>>(),
            ["(unpublished)", "files.read"]
        );
    }

    #[test]
    fn off_does_nothing() {
        let t = Telemetry::off();
        t.call(call("succeeded", "ok", None));
        assert_eq!(t.stats().queued, 0);
        assert!(!t.enabled());
        t.shutdown();
    }
}
