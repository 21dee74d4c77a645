//! The composition root: a config becomes a running kernel. The only module that names the
//! concrete providers (files, brokered MCP); everything above gets a [`Kernel`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sharedos_proto::record::{self, Event};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProviderConfig};
use crate::error::StartError;
use crate::evidence::record::Recorder;
use crate::files::FilesProvider;
use crate::kernel::{Kernel, Registry};
use crate::pins::Pins;
use crate::policy::PolicyEngine;
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
) -> Result<(Kernel, crate::evidence::record::Recovery), StartError> {
    // No upstream's sandbox reaches the broker's own files (the runtime dir is checked by
    // `server::start`, which knows it).
    check_sandboxes(config, None)?;
    // Every name of the record's and its key's checked before any of them is made or touched.
    crate::evidence::record::check_files(&config.record, &config.record_signing_key)?;
    let policy = PolicyEngine::load_checked(
        config.schema.as_deref(),
        &config.policy,
        Some(config.admin_group),
    )?;
    // Every template's requirement can be decided under the schema (its type declared, its
    // action applying to it): a typo stops the start, naming the tool.
    for provider in &config.providers {
        let ProviderConfig::Mcp(cfg) = provider else {
            continue;
        };
        for (tool, t) in &cfg.tools {
            policy
                .check_template(&t.action, t.resource_type())
                .map_err(|detail| StartError::Provider {
                    namespace: cfg.namespace.clone(),
                    config: config.source.clone(),
                    detail: format!(
                        "the template for `{tool}` (action = \"{}\"): {detail}",
                        t.action
                    ),
                })?;
        }
    }
    let mut registry = Registry::default();
    let signing_key =
        crate::evidence::record::load_or_create_signing_key(&config.record_signing_key)?;
    let (recorder, recovery) = Recorder::open_with(
        &config.record,
        crate::evidence::record::RecordOptions {
            sync: config.record_sync,
            signing_key: Some(signing_key),
            rotate_bytes: config.record_rotate_bytes,
            rotate_age: config.record_rotate_age,
        },
    )?;
    recorder.witness_checkpoints(
        crate::evidence::witness::Witness::start(
            config.witness_file.clone(),
            config.witness_command.clone(),
        )
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
                env: config.secret_env.clone(),
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
    // The uids given to them are kept for good, beside the record: loaded (and checked like
    // its key) when any range is set.
    let uid_map = if config.instance_uids.is_some()
        || config.providers.iter().any(|p| {
            matches!(p, ProviderConfig::Mcp(c) if matches!(&c.sandbox, crate::config::SandboxSetting::On(sb) if sb.instance_uids.is_some()))
        }) {
        let path = crate::upstream::uid_map_path(&config.record);
        Some(
            crate::upstream::UidMap::load(&path).map_err(StartError::InstanceUids)?,
        )
    } else {
        None
    };
    let instance_uids = config.instance_uids.and_then(|r| {
        uid_map
            .clone()
            .map(|map| crate::upstream::UidPool::new(r, "instance_uids", map))
    });
    // People's sign-ins to remote servers, on the person's page; tokens beside the record.
    let signins = config.page.as_ref().map(|p| {
        crate::upstream::signin::SignIns::new(
            p.public_url.clone(),
            &config.record,
            secrets.known.clone(),
        )
    });
    // The subject tokens hosts hand in at turn open (`grant = "token_exchange"`).
    let subject_tokens = Arc::new(crate::upstream::exchange::SubjectTokens::default());
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
            uid_map.clone(),
        );
        if let Some(s) = &signins {
            p.attach_signins(s).map_err(|detail| StartError::Provider {
                namespace: p.namespace().to_owned(),
                config: config.source.clone(),
                detail,
            })?;
        }
        p.attach_exchange(&subject_tokens)
            .map_err(|detail| StartError::Provider {
                namespace: p.namespace().to_owned(),
                config: config.source.clone(),
                detail,
            })?;
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
    // Every provider has listed its tools: policies that read `context.arguments` are
    // validated against them now, and a name no tool has refuses the start.
    match kernel.validate_arguments() {
        Ok(warnings) => {
            for w in warnings {
                tracing::warn!(policy = %config.policy.display(), "{}", w.trim());
            }
        }
        Err(e) => {
            root.cancel();
            return Err(e.into());
        }
    }
    kernel.known_secrets = secrets.known.clone();
    kernel.signins = signins;
    kernel.subject_tokens = subject_tokens;
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
    kernel.approvals = crate::approval::Approvals::new(config.approval_timeout)
        .with_page(config.page.as_ref().map(|p| p.public_url.clone()));
    Ok((kernel, recovery))
}

/// The broker's own files an upstream's sandbox must not reach: the config, the record (and
/// every file named after it: its key, rotated parts), its signing key, the policy, the schema,
/// the pins file, the witness file, the secrets folder and the runtime dir.
pub fn protected_files(config: &Config, runtime_dir: Option<&Path>) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    let source = Path::new(&config.source);
    if source.exists() {
        out.push(("the config".into(), source.to_path_buf()));
    }
    out.push(("the record".into(), config.record.clone()));
    if let (Some(dir), Some(name)) = (config.record.parent(), config.record.file_name()) {
        let prefix = format!("{}.", name.to_string_lossy());
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                out.push(("the record's file".into(), e.path()));
            }
        }
    }
    out.push((
        "the record's signing key".into(),
        config.record_signing_key.clone(),
    ));
    out.push(("the policy".into(), config.policy.clone()));
    if let Some(p) = &config.schema {
        out.push(("the policy schema".into(), p.clone()));
    }
    if let Some(p) = &config.pins {
        out.push(("the pins file".into(), p.clone()));
    }
    if let Some(p) = &config.witness_file {
        out.push(("the witness file".into(), p.clone()));
    }
    out.push((
        "the secrets folder (secrets_dir)".into(),
        config.secrets_dir.clone(),
    ));
    if let Some(dir) = runtime_dir {
        out.push((
            "the runtime dir (control.key, the sockets)".into(),
            dir.to_path_buf(),
        ));
    }
    out
}

/// Refuses, before anything is started, a brokered provider whose sandbox would reach one of the
/// broker's own files ([`protected_files`]).
pub fn check_sandboxes(config: &Config, runtime_dir: Option<&Path>) -> Result<(), StartError> {
    let protected = protected_files(config, runtime_dir);
    for provider in &config.providers {
        let ProviderConfig::Mcp(cfg) = provider else {
            continue;
        };
        crate::upstream::check_exposure(cfg, &config.base, &protected).map_err(|detail| {
            StartError::Provider {
                namespace: cfg.namespace.clone(),
                config: config.source.clone(),
                detail,
            }
        })?;
    }
    Ok(())
}

/// What the last broker left open when it stopped without closing: each call whose intent is on
/// record but whose outcome is not gets `outcome: unknown` (its effect may or may not have
/// happened), and each turn still open is closed with reason `broker_restart`.
pub(crate) async fn close_out(
    recorder: &Recorder,
    recovery: &crate::evidence::record::Recovery,
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
