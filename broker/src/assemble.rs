//! The composition root: a config becomes a running kernel. The only module that names the
//! concrete providers (files, brokered MCP); everything above gets a [`Kernel`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sharedos_proto::record::{self, Event};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProviderConfig};
use crate::error::StartError;
use crate::files::FilesProvider;
use crate::kernel::{Kernel, Registry};
use crate::pins::Pins;
use crate::policy::PolicyEngine;
use crate::record::Recorder;
use crate::secrets::{CommandStore, FolderStore, Known};
use crate::upstream::{McpProvider, Secrets};

/// Builds the kernel: policy (validated), record, built-in providers (names validated at
/// registration), then brokered providers (started and listed before this returns; a failed
/// start or a template naming an argument the upstream lacks is a config error).
pub async fn build_kernel(config: &Config, root: &CancellationToken) -> Result<Kernel, StartError> {
    Ok(build(config, root).await?.0)
}

/// [`build_kernel`], and what the record's last broker left open (closed out by [`start`]
/// once this broker's start is on record).
pub(crate) async fn build(
    config: &Config,
    root: &CancellationToken,
) -> Result<(Kernel, crate::record::Recovery), StartError> {
    // Every name of the record's and its key's checked before any of them is made or touched.
    crate::record::check_files(&config.record, &config.record_signing_key)?;
    let policy = PolicyEngine::load_checked(
        config.schema.as_deref(),
        &config.policy,
        Some(config.admin_group),
    )?;
    let mut registry = Registry::default();
    let signing_key = crate::record::load_or_create_signing_key(&config.record_signing_key)?;
    let (recorder, recovery) = Recorder::open_with(
        &config.record,
        crate::record::RecordOptions {
            sync: config.record_sync,
            signing_key: Some(signing_key),
            rotate_bytes: config.record_rotate_bytes,
            rotate_age: config.record_rotate_age,
        },
    )?;
    recorder.witness_checkpoints(
        crate::witness::Witness::start(config.witness_file.clone(), config.witness_command.clone())
            .map_err(|source| StartError::Io {
                what: "cannot start the witness thread for",
                path: config.record.display().to_string(),
                source,
            })?,
    );
    if recovery.torn_bytes > 0 {
        tracing::warn!(
            record = %config.record.display(),
            bytes = recovery.torn_bytes,
            saved_to = ?recovery.torn_saved_to,
            "the record ended in a torn line (a crash mid-write); it was cut off and saved aside"
        );
        eprintln!(
            "warning: record `{}` ended in a torn line of {} bytes (a crash mid-write); saved to `{}` and cut off",
            config.record.display(),
            recovery.torn_bytes,
            recovery
                .torn_saved_to
                .as_deref()
                .unwrap_or(Path::new("?"))
                .display()
        );
    }
    let pins = Arc::new(Pins::load(config.pins.clone(), config.admin_group)?);
    let secrets = Secrets {
        store: match &config.secret_command {
            Some(command) => Arc::new(CommandStore {
                command: command.clone(),
                timeout: config.secret_command_timeout,
            }),
            None => Arc::new(FolderStore::new(config.secrets_dir.clone())),
        },
        known: Arc::new(Known::default()),
    };
    for provider in &config.providers {
        match provider {
            ProviderConfig::Files {
                namespace,
                root,
                writable,
                latency_ms,
            } => {
                let mut p = FilesProvider::new(namespace, root, *writable)?;
                p.latency = latency_ms.map(Duration::from_millis);
                registry.register(namespace, Arc::new(p).tools()?)?;
            }
            ProviderConfig::Mcp(_) => {}
        }
    }
    // Per-principal instances' uids from the top-level range, shared by the providers without
    // their own.
    let instance_uids = config
        .instance_uids
        .map(|r| crate::upstream::UidPool::new(r, "instance_uids"));
    let mut starting = Vec::new();
    for provider in &config.providers {
        let ProviderConfig::Mcp(cfg) = provider else {
            continue;
        };
        let p = McpProvider::new(
            (**cfg).clone(),
            config.base.clone(),
            registry.names.clone(),
            pins.clone(),
            registry.generation.clone(),
            recorder.clone(),
            config.call_timeout,
            root.child_token(),
            secrets.clone(),
            instance_uids.clone(),
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(p.clone().supervise(tx));
        registry.providers.push(p.clone());
        registry.pins = Some(pins.clone());
        starting.push((p, rx));
    }
    for (p, rx) in starting {
        let started =
            tokio::time::timeout(p.startup_timeout() * 2 + Duration::from_secs(5), rx).await;
        match started {
            Ok(Ok(Ok(()))) => {
                let status = McpProvider::status(&p);
                tracing::info!(provider = %status.namespace, state = ?status.state, tools = status.tools.len(), rejected = status.rejected.len(), "brokered provider started");
            }
            Ok(Ok(Err(e))) => {
                root.cancel();
                return Err(StartError::Provider {
                    namespace: p.namespace().to_owned(),
                    config: config.source.clone(),
                    detail: e.to_string(),
                });
            }
            _ => {
                root.cancel();
                return Err(StartError::ProviderTimeout {
                    namespace: p.namespace().to_owned(),
                    config: config.source.clone(),
                });
            }
        }
    }
    let mut kernel = Kernel::new(
        registry,
        policy,
        recorder,
        config.redact_arguments,
        config.call_timeout,
    );
    kernel.record_max_argument_bytes = config.record_max_argument_bytes;
    kernel.known_secrets = secrets.known.clone();
    if let Some(otel) = crate::telemetry::effective(config.otel.as_ref()) {
        kernel.telemetry = crate::telemetry::Telemetry::start(&otel)?;
        // Checkpoints (and every line with `logs = true`) go out as log records, queued.
        if let Some(export) = kernel.telemetry.line_export() {
            kernel
                .recorder
                .export_lines_to(Box::new(move |line, checkpoint| {
                    export.line(line, checkpoint)
                }));
        }
    }
    kernel.budgets = crate::budget::Budgets::new(&config.budgets);
    kernel.approvals = crate::approval::Approvals::new(config.approval_timeout);
    Ok((kernel, recovery))
}

/// What the last broker left open when it stopped without closing: each call whose intent is on
/// record but whose outcome is not gets `outcome: unknown` (its effect may or may not have
/// happened), and each turn still open is closed with reason `broker_restart`.
pub(crate) async fn close_out(
    recorder: &Recorder,
    recovery: &crate::record::Recovery,
) -> Result<(), StartError> {
    for intent in &recovery.open_intents {
        let line = Event::Call(record::Call {
            turn: intent.turn.clone(),
            call_id: intent.call_id.clone(),
            request_id: intent.request_id.clone(),
            tool: intent.tool.clone(),
            arguments: None,
            requirement: intent.requirement.clone(),
            outcome: "unknown".into(),
            code: "broker_restart".into(),
            policies: None,
            duration_us: None,
            message: Some("the broker stopped before this call's outcome was recorded; its effect may or may not have happened".into()),
            cut: intent.cut.clone(),
            system_identity: None,
            forwarded_arguments: None,
            redacted: None,
        });
        recorder.append(&line).await?;
    }
    for turn in &recovery.open_turns {
        let line = Event::TurnClosed(record::TurnClosed {
            turn: turn.clone(),
            reason: "broker_restart".into(),
            calls: None,
            system_identity: None,
        });
        recorder.append(&line).await?;
    }
    if !recovery.open_intents.is_empty() || !recovery.open_turns.is_empty() {
        tracing::warn!(
            calls = recovery.open_intents.len(),
            turns = recovery.open_turns.len(),
            "the last broker stopped without closing: calls with no outcome recorded as unknown, open turns closed"
        );
    }
    Ok(())
}
