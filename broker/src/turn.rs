//! Turns: the table of open turns, their tokens, and their lifecycle (open, TTL, close).
//!
//! A turn fixes its access context and catalogue at open; its token is 256 random bits, kept
//! only as text for constant-time comparison and as a SHA-256 digest for lookup, never logged or
//! recorded. Closing a turn cancels its tree (bridges, in-flight calls), waits (bounded) for the
//! calls to record their outcome, then records `turn_closed`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use base64::Engine;
use sha2::{Digest, Sha256};
use sharedos_proto::alias::AliasReport;
use sharedos_proto::ipc::{TurnSummary, TurnToken};
use sharedos_proto::record::{self, Event};
use sharedos_proto::{SystemIdentity, ToolPolicy};
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::budget::{Budgets, TurnUse};
use crate::evidence::record::rfc3339;
use crate::kernel::{AccessContext, Catalog};

/// How long closing a turn waits for its in-flight calls to record their outcome.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Most list, search and write calls one turn runs at once (each on a blocking thread); the
/// rest wait their turn, within their call timeout.
pub const MAX_BLOCKING_PER_TURN: usize = 2;

pub struct Turn {
    pub id: String,
    pub context: AccessContext,
    pub catalog: Arc<Catalog>,
    /// The bearer secret. Compared in constant time; never logged.
    token: TurnToken,
    pub opened_at: String,
    pub expires_at: SystemTime,
    /// Cancelled when the turn closes; parent of every bridge and call token of the turn.
    pub cancel: CancellationToken,
    /// In-flight call tasks, so close can wait for their records.
    pub tracker: TaskTracker,
    pub bridges: AtomicUsize,
    pub calls: AtomicU64,
    /// Places for this turn's calls that run on blocking threads (list, search, write): turns
    /// share the broker's threads fairly, whatever one of them sends.
    pub blocking: Arc<tokio::sync::Semaphore>,
    pub tool_policy: Option<ToolPolicy>,
    /// A column's identity of the run: on `turn_opened`, and last on every other line of the
    /// turn.
    pub system_identity: Option<SystemIdentity>,
    pub harness: Option<String>,
    /// Present portable (`.`-free) names to the harness.
    pub portable_names: bool,
    /// Harness aliases of this catalogue (diagnostics for `bridge_connected`; never on a call).
    pub aliases: BTreeMap<String, AliasReport>,
    /// Set by the turn's first `bridge_connected` line, the one that carries `aliases`.
    pub aliases_recorded: std::sync::atomic::AtomicBool,
    /// The turn's bridge connections over time (`max_bridge_connects_per_minute`).
    pub connects: std::sync::Mutex<ConnectRate>,
    /// Why it closed, once it has.
    pub close_reason: RwLock<Option<String>>,
    /// This turn's token file (the host writes it; removed when the turn closes).
    pub token_file: Option<std::path::PathBuf>,
    /// What the turn has used of its per-turn budgets.
    pub budget: TurnUse,
    /// The person's own token the host handed in (`grant = "token_exchange"` providers
    /// exchange it). Never logged or recorded.
    pub subject_token: Option<crate::secrets::Secret>,
}

impl Turn {
    pub fn next_call_id(&self) -> String {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        format!("{}.{n}", self.id)
    }

    /// What `turn list` shows, with what is left of the budgets that apply to its tools.
    pub fn summary(&self, budgets: &Budgets) -> TurnSummary {
        TurnSummary {
            budgets: budgets.left(
                Some(&self.budget),
                &self.context.principal,
                self.catalog.namespaces(),
            ),
            turn: self.id.clone(),
            principal: self.context.principal.clone(),
            agent: self.context.agent.clone(),
            catalog_hash: self.catalog.hash.clone(),
            tools: self.catalog.tools.len(),
            opened_at: self.opened_at.clone(),
            expires_at: rfc3339(self.expires_at),
            bridges: self.bridges.load(Ordering::Relaxed),
            calls: self.calls.load(Ordering::Relaxed),
        }
    }

    pub fn token(&self) -> &TurnToken {
        &self.token
    }

    pub fn closed_reason(&self) -> Option<String> {
        self.close_reason.read().ok().and_then(|g| g.clone())
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// 256 random bits, as URL-safe base64 (a turn's token, the control key).
pub fn new_secret() -> Result<TurnToken, getrandom::Error> {
    Ok(TurnToken::new(
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes::<32>()?),
    ))
}

fn random_bytes<const N: usize>() -> Result<[u8; N], getrandom::Error> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf)?;
    Ok(buf)
}

/// Parameters of a new turn, already validated by the caller.
pub struct NewTurn {
    pub context: AccessContext,
    pub catalog: Arc<Catalog>,
    pub ttl: Duration,
    pub tool_policy: Option<ToolPolicy>,
    pub system_identity: Option<SystemIdentity>,
    pub harness: Option<String>,
    pub portable_names: bool,
    pub aliases: BTreeMap<String, AliasReport>,
    /// Where the host writes the turn's token.
    pub token_file: Option<TokenFileTemplate>,
    /// Budget slots the turn counts (the kernel's `Budgets::slots`).
    pub budget_slots: usize,
    /// The person's own token, if the host handed one in.
    pub subject_token: Option<crate::secrets::Secret>,
}

/// A host's token file path: absolute, with `{turn}` in its file name (and only there), so no
/// two turns share one.
pub struct TokenFileTemplate {
    folder: std::path::PathBuf,
    name: String,
}

impl TokenFileTemplate {
    /// Checks a template; the error names it and says what is wrong.
    pub fn parse(template: &str) -> Result<Self, String> {
        let bad = |m: &str| {
            format!(
                "token file `{}`: {m}",
                sharedos_proto::name::shown(template)
            )
        };
        let path = std::path::Path::new(template);
        if !path.is_absolute() {
            return Err(bad("not an absolute path"));
        }
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| bad("names no file"))?;
        let folder = path.parent().unwrap_or(std::path::Path::new("/"));
        if !name.contains("{turn}") || folder.to_string_lossy().contains("{turn}") {
            return Err(bad(
                "put `{turn}` in the file name (not in a folder): a path two turns share would let a harness restarted late join the next turn",
            ));
        }
        Ok(Self {
            folder: folder.to_path_buf(),
            name: name.to_owned(),
        })
    }

    /// The path for turn `id`.
    pub fn for_turn(&self, id: &str) -> std::path::PathBuf {
        self.folder.join(self.name.replace("{turn}", id))
    }
}

#[derive(Default)]
pub struct Turns {
    by_id: RwLock<HashMap<String, Arc<Turn>>>,
    by_digest: RwLock<HashMap<[u8; 32], String>>,
}

impl Turns {
    /// Creates a turn under `root` (the broker's cancellation tree).
    pub fn insert(
        &self,
        new: NewTurn,
        root: &CancellationToken,
    ) -> Result<Arc<Turn>, getrandom::Error> {
        let id_bytes: [u8; 8] = random_bytes()?;
        let id = format!(
            "t-{}",
            id_bytes
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes::<32>()?);
        let turn = Arc::new(Turn {
            id: id.clone(),
            context: new.context,
            catalog: new.catalog,
            token: TurnToken::new(secret.clone()),
            opened_at: rfc3339(SystemTime::now()),
            expires_at: SystemTime::now() + new.ttl,
            cancel: root.child_token(),
            tracker: TaskTracker::new(),
            bridges: AtomicUsize::new(0),
            blocking: Arc::new(tokio::sync::Semaphore::new(MAX_BLOCKING_PER_TURN)),
            calls: AtomicU64::new(0),
            tool_policy: new.tool_policy,
            system_identity: new.system_identity,
            harness: new.harness,
            portable_names: new.portable_names,
            aliases: new.aliases,
            aliases_recorded: std::sync::atomic::AtomicBool::new(false),
            connects: std::sync::Mutex::default(),
            close_reason: RwLock::new(None),
            token_file: new.token_file.map(|t| t.for_turn(&id)),
            budget: TurnUse::new(new.budget_slots),
            subject_token: new.subject_token,
        });
        if let Ok(mut m) = self.by_id.write() {
            m.insert(id.clone(), turn.clone());
        }
        if let Ok(mut m) = self.by_digest.write() {
            m.insert(digest(&secret), id);
        }
        Ok(turn)
    }

    /// The live turn a token names, compared in constant time.
    pub fn by_token(&self, presented: &str) -> Option<Arc<Turn>> {
        let id = self.by_digest.read().ok()?.get(&digest(presented))?.clone();
        let turn = self.by_id.read().ok()?.get(&id)?.clone();
        let same: bool = turn
            .token
            .expose()
            .as_bytes()
            .ct_eq(presented.as_bytes())
            .into();
        (same && !turn.cancel.is_cancelled()).then_some(turn)
    }

    pub fn get(&self, id: &str) -> Option<Arc<Turn>> {
        self.by_id.read().ok()?.get(id).cloned()
    }

    /// Removes a turn from the table (its token is dead from here on).
    pub fn remove(&self, id: &str) -> Option<Arc<Turn>> {
        let turn = self.by_id.write().ok()?.remove(id)?;
        if let Ok(mut m) = self.by_digest.write() {
            m.remove(&digest(turn.token.expose()));
        }
        Some(turn)
    }

    /// How many turns are open.
    pub fn len(&self) -> usize {
        self.by_id.read().map(|m| m.len()).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn list(&self) -> Vec<Arc<Turn>> {
        let mut turns: Vec<Arc<Turn>> = self
            .by_id
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        turns.sort_by(|a, b| a.opened_at.cmp(&b.opened_at).then(a.id.cmp(&b.id)));
        turns
    }
}

/// The `turn_opened` record line.
pub fn opened_record(turn: &Turn) -> Event {
    Event::TurnOpened(record::TurnOpened {
        turn: turn.id.clone(),
        access_context: record::RecordedAccessContext {
            principal: turn.context.principal.clone(),
            agent: turn.context.agent.clone(),
            agent_owner: turn.context.agent_owner.clone(),
            turn: turn.context.turn_attributes(),
        },
        token_file: turn.token_file.as_ref().map(|p| p.display().to_string()),
        tool_policy: turn.tool_policy.clone(),
        system_identity: turn.system_identity.clone(),
        catalog_hash: turn.catalog.hash.clone(),
        tools: turn
            .catalog
            .tools
            .iter()
            .map(|t| t.name.to_string())
            .collect(),
        policy_version: turn.catalog.policy_version,
        expires_at: rfc3339(turn.expires_at),
        harness: turn.harness.clone(),
        portable_names: turn.portable_names,
    })
}

/// A turn's bridge connections over time: as many as `per_minute` at once, then one every
/// `60 s / per_minute` (a generic cell rate: one instant kept, no timer).
#[derive(Default)]
pub struct ConnectRate {
    /// When the next connection would be on time.
    next: Option<std::time::Instant>,
}

impl ConnectRate {
    /// Takes a place for one connection now, or `false` when the turn has used its rate.
    pub fn admit(&mut self, per_minute: u32, now: std::time::Instant) -> bool {
        let per_minute = per_minute.max(1);
        let every = std::time::Duration::from_secs(60) / per_minute;
        let burst = every * (per_minute - 1);
        let due = self.next.map_or(now, |t| t.max(now));
        if due.saturating_duration_since(now) > burst {
            return false;
        }
        self.next = Some(due + every);
        true
    }
}
