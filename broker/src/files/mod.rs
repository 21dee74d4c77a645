//! The built-in files provider: `files.read`, `files.list`, `files.search`, `files.write`
//! (registered only when writable) over a real folder, addressed by virtual paths.
//!
//! Owns: the tools' published definitions, requirement resolution from arguments, and bounded
//! execution. Resolution ([`beneath`]) turns the call's virtual path into a descriptor of
//! the file it names now, and the policy decides on the path that descriptor names; execution
//! then works only through that descriptor (a reopen of it, `openat` relative to it, a walk of
//! descriptors below it), never through a path resolved again. It never decides authority
//! itself: `search` asks the kernel (through [`ReadCheck`]) before returning each hit, on the
//! path the hit's own descriptor names.
//!
//! A room of its own: the provider here, over [`beneath`] (a call's virtual path to a descriptor
//! below the root, without following what it must not) and [`vpath`] (virtual-path
//! canonicalization), which the brokered providers' file templates use too.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;
use serde_json::{Map, Value, json};
use sharedos_proto::{FailCode, ToolDefinition, ToolMetadata, ToolName};

pub mod beneath;
pub mod vpath;

use crate::provider::{CallEnv, Job, Resolution as ProvidedResolution, ToolHandler};
pub use crate::provider::{Failure, ReadCheck, Success};
use crate::resource::Resource;
use beneath::{Found, Resolution, ResolveError, Root, Strategy};

/// Largest file `read` returns and `search` looks into; larger files fail with `too_large`.
pub const MAX_READ_BYTES: u64 = 1024 * 1024;
/// Largest content `write` accepts.
pub const MAX_WRITE_BYTES: usize = 1024 * 1024;
/// Most entries `list` returns (the rest are counted, not shown).
pub const MAX_LIST_ENTRIES: usize = 1000;
/// Most entries `list` reads from one folder (past that it says "at least").
pub const MAX_LIST_SCAN: usize = 100_000;
/// Most files `search` opens in one call.
pub const MAX_SEARCH_FILES: usize = 10_000;
/// Most directory entries `search` reads in one call, over every folder it walks.
pub const MAX_SEARCH_ENTRIES: usize = 100_000;
/// Most file bytes `search` reads in one call.
pub const MAX_SEARCH_BYTES: u64 = 64 * 1024 * 1024;
/// Deepest folder `search` descends into below the one it was given.
pub const MAX_SEARCH_DEPTH: usize = 32;
/// Longest `list` or `search` works on one call before it answers with what it has.
pub const WORK_TIME_BUDGET: Duration = Duration::from_secs(10);
/// Hits `search` returns by default and at most.
pub const SEARCH_DEFAULT_LIMIT: u64 = 20;
pub const SEARCH_MAX_LIMIT: u64 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp {
    Read,
    List,
    Search,
    Write,
}

impl FileOp {
    pub fn action(self) -> &'static str {
        match self {
            FileOp::Read => "read",
            FileOp::List => "list",
            FileOp::Search => "search",
            FileOp::Write => "write",
        }
    }
}

/// One files provider instance (one `[[providers]] type = "files"` entry).
#[derive(Debug)]
pub struct FilesProvider {
    pub namespace: String,
    /// The root, held open: every resolution starts from its descriptor.
    root: Root,
    pub writable: bool,
    /// Added before every call (fault injection for testing timeouts and cancellation).
    pub latency: Option<std::time::Duration>,
}

/// A resolved requirement, plus what execution needs to touch exactly that file: the
/// descriptor the decision was made on.
#[derive(Debug)]
pub struct Resolved {
    pub action: &'static str,
    pub resource: Resource,
    pub target: Resolution,
}

fn fail(code: FailCode, message: impl Into<String>) -> Failure {
    Failure::new(code, message)
}

/// One built-in files tool: its provider and operation, as the kernel calls it.
pub struct FileTool {
    pub provider: Arc<FilesProvider>,
    pub op: FileOp,
}

/// Set when the future that holds it is dropped (the call was cancelled or timed out, or it
/// finished): blocking work it started checks it and stops.
#[derive(Default)]
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl ToolHandler for FileTool {
    fn namespace(&self) -> &str {
        &self.provider.namespace
    }

    fn kind(&self) -> &'static str {
        "files"
    }

    fn shape(&self) -> (&str, &str) {
        (self.op.action(), "File")
    }

    fn changes_state(&self, _annotations: Option<&Value>) -> bool {
        self.op == FileOp::Write
    }

    fn resolve(
        &self,
        _tool: &str,
        arguments: &Map<String, Value>,
    ) -> Result<ProvidedResolution, String> {
        let r = self.provider.resolve(self.op, arguments)?;
        Ok(ProvidedResolution {
            action: r.action.to_owned(),
            resource: r.resource.clone(),
            forwarded: None,
            object: Some(r.target.object()),
            detail: Some(Box::new(r)),
        })
    }

    fn execute(
        &self,
        resolution: ProvidedResolution,
        arguments: Map<String, Value>,
        env: CallEnv,
    ) -> Job {
        let (provider, op) = (self.provider.clone(), self.op);
        let latency = provider.latency;
        Box::pin(async move {
            let stop = StopOnDrop::default();
            if let Some(latency) = latency {
                tokio::time::sleep(latency).await;
            }
            let Some(files) = resolution
                .detail
                .and_then(|d| d.downcast::<Resolved>().ok())
            else {
                return Err(Failure::new(
                    FailCode::Internal,
                    "files call without a resolved file",
                ));
            };
            let flag = stop.0.clone();
            let check = env.read_check;
            let run = move || provider.execute(op, &files, &arguments, check.as_ref(), &flag);
            // A read is one open, fstat and read of at most MAX_READ_BYTES of a regular file
            // (opened non-blocking, so a FIFO cannot hang it): done in place, which spares two
            // thread hand-offs per call. Folders and searches can be large and go to the
            // blocking pool.
            if op == FileOp::Read {
                return std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(
                    |_| {
                        Err(Failure::new(
                            FailCode::Internal,
                            "internal error: the read panicked",
                        ))
                    },
                );
            }
            // One of the turn's places first (waiting counts toward the call's timeout, and a
            // cancelled call stops waiting).
            let _place = match &env.blocking {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            tokio::task::spawn_blocking(run).await.unwrap_or_else(|e| {
                Err(Failure::new(
                    FailCode::Internal,
                    format!("internal error: {e}"),
                ))
            })
        })
    }
}

impl FilesProvider {
    /// This provider's registrations: each definition with its handler.
    pub fn tools(
        self: &Arc<Self>,
    ) -> Result<Vec<ToolDefinition<Arc<dyn ToolHandler>>>, FilesConfigError> {
        Ok(self
            .definitions()?
            .into_iter()
            .map(|def| {
                let op = def.authority;
                def.with_authority(Arc::new(FileTool {
                    provider: self.clone(),
                    op,
                }) as Arc<dyn ToolHandler>)
            })
            .collect())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FilesConfigError {
    #[error("files provider `{namespace}`: root `{root}` is not a usable folder: {source}")]
    Root {
        namespace: String,
        root: String,
        source: std::io::Error,
    },
    #[error("files provider `{namespace}`: {source}")]
    Name {
        namespace: String,
        source: sharedos_proto::name::ToolNameError,
    },
}

impl FilesProvider {
    pub fn new(namespace: &str, root: &Path, writable: bool) -> Result<Self, FilesConfigError> {
        Self::with_strategy(namespace, root, writable, Strategy::from_env())
    }

    pub fn with_strategy(
        namespace: &str,
        root: &Path,
        writable: bool,
        strategy: Strategy,
    ) -> Result<Self, FilesConfigError> {
        let root = Root::open(root, strategy).map_err(|source| FilesConfigError::Root {
            namespace: namespace.to_owned(),
            root: root.display().to_string(),
            source,
        })?;
        Ok(Self {
            namespace: namespace.to_owned(),
            root,
            writable,
            latency: None,
        })
    }

    /// The tools this provider registers, each with its operation as authority.
    pub fn definitions(&self) -> Result<Vec<ToolDefinition<FileOp>>, FilesConfigError> {
        let meta = Some(ToolMetadata {
            namespace: Some(self.namespace.clone()),
            source: Some("builtin".into()),
        });
        let path_prop = |what: &str| json!({"type": "string", "description": what});
        let mut defs = vec![
            (
                FileOp::Read,
                "read",
                format!("Read a UTF-8 text file (at most {MAX_READ_BYTES} bytes) by its absolute virtual path, e.g. /public/hello.txt."),
                json!({"type": "object",
                       "properties": {"path": path_prop("Absolute virtual path of the file")},
                       "required": ["path"], "additionalProperties": false}),
                json!({"readOnlyHint": true, "openWorldHint": false}),
            ),
            (
                FileOp::List,
                "list",
                format!("List a folder by its absolute virtual path (at most {MAX_LIST_ENTRIES} entries; folders end with /)."),
                json!({"type": "object",
                       "properties": {"path": path_prop("Absolute virtual path of the folder")},
                       "required": ["path"], "additionalProperties": false}),
                json!({"readOnlyHint": true, "openWorldHint": false}),
            ),
            (
                FileOp::Search,
                "search",
                "Search file names and contents by substring under a folder (default /). Only files you may read are returned.".to_owned(),
                json!({"type": "object",
                       "properties": {
                           "query": {"type": "string", "minLength": 1, "description": "Substring to look for"},
                           "path": path_prop("Folder to search under (default /)"),
                           "limit": {"type": "integer", "minimum": 1, "maximum": SEARCH_MAX_LIMIT}},
                       "required": ["query"], "additionalProperties": false}),
                json!({"readOnlyHint": true, "openWorldHint": false}),
            ),
        ];
        if self.writable {
            defs.push((
                FileOp::Write,
                "write",
                format!("Create or replace a UTF-8 text file (at most {MAX_WRITE_BYTES} bytes) at an absolute virtual path whose folder exists."),
                json!({"type": "object",
                       "properties": {"path": path_prop("Absolute virtual path of the file"),
                                      "content": {"type": "string"}},
                       "required": ["path", "content"], "additionalProperties": false}),
                json!({"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": false}),
            ));
        }
        defs.into_iter()
            .map(|(op, suffix, description, schema, annotations)| {
                let name =
                    ToolName::new(&format!("{}.{suffix}", self.namespace)).map_err(|source| {
                        FilesConfigError::Name {
                            namespace: self.namespace.clone(),
                            source,
                        }
                    })?;
                Ok(ToolDefinition {
                    name,
                    description: Some(description),
                    input_schema: Some(schema),
                    output_schema: None,
                    annotations: Some(annotations),
                    metadata: meta.clone(),
                    authority: op,
                })
            })
            .collect()
    }

    /// Resolves a virtual path to what it names now (see [`beneath`]). `Err` is a
    /// sentence for `denied: ... could not resolve`.
    pub fn resolve_path(&self, raw: &str) -> Result<Resolution, String> {
        let canonical = vpath::canonicalize(raw).map_err(|e| e.to_string())?;
        self.root
            .resolve(vpath::components(&canonical))
            .map_err(|e| resolve_sentence(raw, &e))
    }

    /// The requirement of a call: action and resource from its arguments.
    pub fn resolve(&self, op: FileOp, args: &Map<String, Value>) -> Result<Resolved, String> {
        let raw = match (op, args.get("path")) {
            (_, Some(Value::String(p))) => p.as_str(),
            (FileOp::Search, None) => "/",
            _ => return Err("the call names no `path`".into()),
        };
        let target = self.resolve_path(raw)?;
        Ok(Resolved {
            action: op.action(),
            resource: Resource::File {
                namespace: self.namespace.clone(),
                path: target.virtual_path().to_owned(),
            },
            target,
        })
    }

    /// Runs an authorized call. Blocking file IO: call from a blocking thread. `stop` is set when
    /// the call is cancelled or timed out; long work checks it and ends early.
    pub fn execute(
        &self,
        op: FileOp,
        resolved: &Resolved,
        args: &Map<String, Value>,
        check: &dyn ReadCheck,
        stop: &AtomicBool,
    ) -> Result<Success, Failure> {
        let vpath = resolved.resource.short();
        let existing = || match &resolved.target {
            Resolution::Exists(found) => Ok(found),
            Resolution::Missing { .. } => {
                Err(fail(FailCode::NotFound, format!("{vpath} does not exist")))
            }
        };
        match op {
            FileOp::Read => read(vpath, existing()?),
            FileOp::List => list(vpath, existing()?, &Budget::new(stop)),
            FileOp::Search => {
                let query = args
                    .get("query")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let limit = args
                    .get("limit")
                    .and_then(Value::as_u64)
                    .unwrap_or(SEARCH_DEFAULT_LIMIT)
                    .clamp(1, SEARCH_MAX_LIMIT) as usize;
                self.search(vpath, existing()?, query, limit, check, &Budget::new(stop))
            }
            FileOp::Write => {
                let content = args
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.write(vpath, &resolved.target, content)
            }
        }
    }

    fn search(
        &self,
        vpath: &str,
        start: &Found,
        query: &str,
        limit: usize,
        check: &dyn ReadCheck,
        budget: &Budget<'_>,
    ) -> Result<Success, Failure> {
        if start.file_type() != FileType::Directory {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is not a folder"),
            ));
        }
        let first =
            crate::files::beneath::open_dir(start.fd.as_fd()).map_err(|e| io_failure(vpath, &e))?;
        // Hits are named by their descriptors' paths, below where the root is now.
        let root_now = self.root.current_path().map_err(|e| {
            fail(
                FailCode::ProviderError,
                format!("cannot search {vpath}: {e}"),
            )
        })?;
        let mut walk = Walk {
            budget,
            entries: 0,
            files: 0,
            bytes: 0,
            stopped: None,
        };
        let mut hits = Vec::new();
        // Depth first, in name order; each level holds its folder's descriptor and names.
        let mut stack = vec![walk.frame(first)];
        'walk: while let Some(frame) = stack.last_mut() {
            if let Some(why) = walk.over() {
                walk.stopped = Some(why);
                break;
            }
            let Some((name, hint)) = frame.names.pop() else {
                stack.pop();
                continue;
            };
            // The entry's type only says what is worth opening (links, FIFOs, devices and
            // sockets are not); what was opened is judged by its descriptor.
            if !matches!(
                hint,
                FileType::Directory | FileType::RegularFile | FileType::Unknown
            ) {
                continue;
            }
            let Some(opened) = open_entry(frame.fd.as_fd(), &name) else {
                continue;
            };
            let kind = match rustix::fs::fstat(&opened) {
                Ok(st) => FileType::from_raw_mode(st.st_mode),
                Err(_) => continue,
            };
            match kind {
                FileType::Directory if stack.len() <= MAX_SEARCH_DEPTH => {
                    let frame = walk.frame(opened);
                    stack.push(frame);
                }
                FileType::RegularFile => {
                    walk.files += 1;
                    if walk.files > MAX_SEARCH_FILES {
                        walk.stopped = Some(format!("it opened {MAX_SEARCH_FILES} files"));
                        break 'walk;
                    }
                    let Ok(name) = std::str::from_utf8(&name) else {
                        continue;
                    };
                    let name_hit = name.contains(query);
                    let file = std::fs::File::from(opened);
                    let line_hit = walk.line_hit(&file, query);
                    if !name_hit && line_hit.is_none() {
                        continue;
                    }
                    // The hit is reported, and decided, under the path its descriptor names.
                    let Ok(host) = crate::files::beneath::fd_path(file.as_fd()) else {
                        continue;
                    };
                    let Ok(v) = self.root.virtual_of(&host, &root_now) else {
                        continue;
                    };
                    if check.may_read(&v) {
                        // A path with `:` is quoted too: `/a:1: x` would pass for a line hit.
                        let shown = shown_name(&v, v.contains(':'));
                        hits.push(match line_hit {
                            Some((n, line)) => format!("{shown}:{n}: {}", shown_line(&line)),
                            None => shown.into_owned(),
                        });
                        if hits.len() >= limit {
                            break 'walk;
                        }
                    }
                }
                // Folders past the depth limit are not entered; FIFOs, devices, sockets are
                // never read.
                _ => {}
            }
        }
        let mut text = if hits.is_empty() {
            format!("no readable file under {vpath} matches {query:?}")
        } else {
            hits.join("\n")
        };
        if let Some(why) = walk.stopped {
            text.push_str(&format!(
                "\n… the search stopped early ({why}); results may be incomplete"
            ));
        }
        Ok(Success::text(text))
    }

    fn write(&self, vpath: &str, target: &Resolution, content: &str) -> Result<Success, Failure> {
        if !self.writable {
            return Err(fail(
                FailCode::ProviderError,
                "this files provider is read-only",
            ));
        }
        if content.len() > MAX_WRITE_BYTES {
            return Err(fail(
                FailCode::TooLarge,
                format!(
                    "content is {} bytes; the limit is {MAX_WRITE_BYTES}",
                    content.len()
                ),
            ));
        }
        let changed = || {
            fail(
                FailCode::ProviderError,
                format!("{vpath} changed while it was being written; try again"),
            )
        };
        let not_regular = || {
            fail(
                FailCode::WrongKind,
                format!("{vpath} exists and is not a regular file"),
            )
        };
        let mut file = match target {
            Resolution::Exists(found) => {
                if found.file_type() != FileType::RegularFile {
                    return Err(not_regular());
                }
                // The very file that was decided on, whatever its name is now.
                let fd = crate::files::beneath::reopen(
                    found.fd.as_fd(),
                    OFlags::WRONLY | OFlags::NONBLOCK | OFlags::NOCTTY,
                )
                .map_err(|e| io_failure(vpath, &e))?;
                std::fs::File::from(fd)
            }
            Resolution::Missing {
                parent: Some((parent, name)),
                ..
            } => {
                // Created in the folder that was decided on; O_EXCL | O_NOFOLLOW: whatever was
                // put at that name since is never followed or opened.
                let fd = rustix::fs::openat(
                    &parent.fd,
                    name.as_str(),
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::NONBLOCK
                        | OFlags::NOCTTY
                        | OFlags::CLOEXEC,
                    Mode::from_bits_truncate(0o666),
                )
                .map_err(|e| match e {
                    Errno::EXIST | Errno::LOOP => changed(),
                    e => io_failure(vpath, &e.into()),
                })?;
                std::fs::File::from(fd)
            }
            Resolution::Missing { parent: None, .. } => {
                return Err(fail(
                    FailCode::NotFound,
                    format!("the folder of {vpath} does not exist"),
                ));
            }
        };
        let meta = file.metadata().map_err(|e| io_failure(vpath, &e))?;
        if !meta.is_file() {
            return Err(not_regular());
        }
        {
            use std::os::unix::fs::MetadataExt;
            if meta.nlink() > 1 {
                return Err(fail(
                    FailCode::WrongKind,
                    format!(
                        "{vpath} has {} hard links; files.write does not write files that have other names",
                        meta.nlink()
                    ),
                ));
            }
        }
        file.set_len(0).map_err(|e| io_failure(vpath, &e))?;
        file.write_all(content.as_bytes())
            .map_err(|e| io_failure(vpath, &e))?;
        Ok(Success::text(format!(
            "wrote {} bytes to {vpath}",
            content.len()
        )))
    }
}

/// The sentence for a path that cannot be resolved.
fn resolve_sentence(raw: &str, e: &ResolveError) -> String {
    format!("path `{}`: {e}", sharedos_proto::name::shown(raw))
}

fn read(vpath: &str, found: &Found) -> Result<Success, Failure> {
    match found.file_type() {
        FileType::RegularFile => {}
        FileType::Directory => {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is a folder; use files.list"),
            ));
        }
        _ => {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is not a regular file"),
            ));
        }
    }
    let size = u64::try_from(found.stat.st_size).unwrap_or(0);
    if size > MAX_READ_BYTES {
        return Err(fail(
            FailCode::TooLarge,
            format!("{vpath} is {size} bytes; files.read returns at most {MAX_READ_BYTES} bytes"),
        ));
    }
    // The very file that was decided on; non-blocking, though only a regular file gets here.
    let fd = crate::files::beneath::reopen(
        found.fd.as_fd(),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY,
    )
    .map_err(|e| io_failure(vpath, &e))?;
    let mut bytes = Vec::with_capacity(size as usize);
    std::fs::File::from(fd)
        .take(MAX_READ_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_failure(vpath, &e))?;
    if bytes.len() as u64 > MAX_READ_BYTES {
        return Err(fail(
            FailCode::TooLarge,
            format!("{vpath} grew past {MAX_READ_BYTES} bytes while being read"),
        ));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        fail(
            FailCode::WrongKind,
            format!(
                "{vpath} is not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    Ok(Success::text(text))
}

fn list(vpath: &str, found: &Found, budget: &Budget<'_>) -> Result<Success, Failure> {
    if found.file_type() != FileType::Directory {
        return Err(fail(
            FailCode::WrongKind,
            format!("{vpath} is not a folder; use files.read"),
        ));
    }
    let fd =
        crate::files::beneath::open_dir(found.fd.as_fd()).map_err(|e| io_failure(vpath, &e))?;
    let mut dir = rustix::fs::Dir::new(fd).map_err(|e| io_failure(vpath, &e.into()))?;
    let mut names = Vec::new();
    let mut total = 0usize;
    let mut stopped = None;
    while let Some(entry) = dir.read() {
        let entry = entry.map_err(|e| io_failure(vpath, &e.into()))?;
        let raw = entry.file_name().to_bytes();
        if raw == b"." || raw == b".." {
            continue;
        }
        if total >= MAX_LIST_SCAN {
            stopped = Some(format!("at least {MAX_LIST_SCAN} entries"));
            break;
        }
        if total.is_multiple_of(1024)
            && let Some(why) = budget.over()
        {
            stopped = Some(why);
            break;
        }
        total += 1;
        if names.len() < MAX_LIST_ENTRIES {
            let mut name = shown_name(&String::from_utf8_lossy(raw), false).into_owned();
            if entry.file_type() == FileType::Directory {
                name.push('/');
            }
            names.push(name);
        }
    }
    names.sort();
    let mut text = names.join("\n");
    if total > names.len() {
        text.push_str(&format!(
            "\n… {} more entries not shown",
            total - names.len()
        ));
    }
    if names.is_empty() {
        text = format!("{vpath} is empty");
    }
    if let Some(why) = stopped {
        text.push_str(&format!("\n… the listing stopped early ({why})"));
    }
    Ok(Success::text(text))
}

/// A name or path as `list` and `search` show it, one entry per line whatever it holds: as it
/// is when that is unambiguous, otherwise quoted with Rust's escapes (`"notes.txt\nsalary.xlsx"`).
/// Quoted: a name with a control or other non-printable character (a newline would forge
/// entries), a `\` or `"` (which the quoting itself uses), one starting with `…` (the listings'
/// own footers start with it), and, when `quote_colon`, one with `:` (a search hit's separator).
fn shown_name(name: &str, quote_colon: bool) -> std::borrow::Cow<'_, str> {
    let quoted = format!("{name:?}");
    let plain = quoted.len() == name.len() + 2
        && !name.starts_with('…')
        && !(quote_colon && name.contains(':'));
    if plain {
        std::borrow::Cow::Borrowed(name)
    } else {
        std::borrow::Cow::Owned(quoted)
    }
}

/// A file's line as a search hit shows it: control characters, the Unicode line and paragraph
/// separators and the bidirectional controls escaped (a lone `\r` or U+2028 would otherwise
/// start another line for a reader, an override would reorder what follows).
fn shown_line(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    for c in line.chars() {
        if (c.is_control() && c != '\t')
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// What one `list` or `search` call may spend: time, and the call's stop flag.
struct Budget<'a> {
    stop: &'a AtomicBool,
    deadline: Instant,
}

impl<'a> Budget<'a> {
    fn new(stop: &'a AtomicBool) -> Self {
        Self {
            stop,
            deadline: Instant::now() + WORK_TIME_BUDGET,
        }
    }

    /// Why the work must end now, if it must.
    fn over(&self) -> Option<String> {
        if self.stop.load(Ordering::Relaxed) {
            return Some("the call was cancelled or timed out".into());
        }
        if Instant::now() >= self.deadline {
            return Some(format!("it ran for {} s", WORK_TIME_BUDGET.as_secs()));
        }
        None
    }
}

/// One folder of a search walk: its descriptor and the entries still to visit (last first).
struct Frame {
    fd: OwnedFd,
    names: Vec<(Vec<u8>, FileType)>,
}

/// A search walk's spending so far.
struct Walk<'a> {
    budget: &'a Budget<'a>,
    entries: usize,
    files: usize,
    bytes: u64,
    stopped: Option<String>,
}

impl Walk<'_> {
    /// Reads a folder's names (bounded by the entry budget), sorted so the walk pops them in
    /// name order.
    fn frame(&mut self, fd: OwnedFd) -> Frame {
        let mut names = Vec::new();
        if let Ok(dup) = fd.try_clone()
            && let Ok(mut dir) = rustix::fs::Dir::new(dup)
        {
            while let Some(Ok(entry)) = dir.read() {
                let raw = entry.file_name().to_bytes();
                if raw == b"." || raw == b".." {
                    continue;
                }
                self.entries += 1;
                if self.entries > MAX_SEARCH_ENTRIES {
                    break;
                }
                names.push((raw.to_vec(), entry.file_type()));
            }
        }
        names.sort_unstable_by(|a, b| b.0.cmp(&a.0));
        Frame { fd, names }
    }

    fn over(&self) -> Option<String> {
        if self.entries > MAX_SEARCH_ENTRIES {
            return Some(format!("it read {MAX_SEARCH_ENTRIES} folder entries"));
        }
        if self.bytes > MAX_SEARCH_BYTES {
            return Some(format!("it read {MAX_SEARCH_BYTES} bytes"));
        }
        self.budget.over()
    }

    /// The first line of an open regular file that contains `query`: at most
    /// `MAX_READ_BYTES + 1` bytes are read, and a larger file is not looked into.
    fn line_hit(&mut self, file: &std::fs::File, query: &str) -> Option<(usize, String)> {
        let mut bytes = Vec::new();
        let read = file.take(MAX_READ_BYTES + 1).read_to_end(&mut bytes).ok()?;
        self.bytes += read as u64;
        if read as u64 > MAX_READ_BYTES {
            return None;
        }
        let text = std::str::from_utf8(&bytes).ok()?;
        text.lines()
            .enumerate()
            .find(|(_, l)| l.contains(query))
            .map(|(i, l)| (i + 1, l.chars().take(200).collect::<String>()))
    }
}

/// Opens one entry of a folder being walked, never through a link (`O_NOFOLLOW`) and
/// non-blocking (a FIFO cannot hang the walk); its type is then taken from the descriptor, never
/// from the entry.
fn open_entry(dir: BorrowedFd<'_>, name: &[u8]) -> Option<OwnedFd> {
    let name = std::ffi::OsStr::from_bytes(name);
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

fn io_failure(vpath: &str, e: &std::io::Error) -> Failure {
    match e.kind() {
        std::io::ErrorKind::NotFound => fail(FailCode::NotFound, format!("{vpath} does not exist")),
        _ => fail(
            FailCode::ProviderError,
            format!("cannot access {vpath}: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct AllowPublic;
    impl ReadCheck for AllowPublic {
        fn may_read(&self, p: &str) -> bool {
            p.starts_with("/public/")
        }
    }

    fn setup() -> (tempfile::TempDir, FilesProvider) {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("public/sub")).expect("mk");
        std::fs::create_dir_all(root.join("private")).expect("mk");
        std::fs::write(root.join("public/hello.txt"), "Hello\nworld\n").expect("w");
        std::fs::write(root.join("private/secret.txt"), "the world secret\n").expect("w");
        std::fs::write(dir.path().join("outside.txt"), "outside").expect("w");
        std::os::unix::fs::symlink(root.join("private/secret.txt"), root.join("public/link"))
            .expect("ln");
        std::os::unix::fs::symlink(dir.path().join("outside.txt"), root.join("public/out"))
            .expect("ln");
        let p = FilesProvider::new("files", &root, true).expect("provider");
        (dir, p)
    }

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn a_root_swapped_for_a_link_after_start_is_not_followed() {
        let (d, p) = setup();
        assert!(
            p.resolve(FileOp::Read, &args(json!({"path": "/public/hello.txt"})))
                .is_ok()
        );
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir_all(elsewhere.join("public")).expect("mk");
        std::fs::write(elsewhere.join("public/hello.txt"), "not the root's").expect("w");
        std::fs::rename(d.path().join("root"), d.path().join("old-root")).expect("mv");
        std::os::unix::fs::symlink(&elsewhere, d.path().join("root")).expect("ln");
        // The root is held by descriptor: the link is never followed, the original is served.
        let a = args(json!({"path": "/public/hello.txt"}));
        let r = p
            .resolve(FileOp::Read, &a)
            .expect("resolves in the held root");
        let read = p
            .execute(FileOp::Read, &r, &a, &AllowPublic, &AtomicBool::new(false))
            .expect("read");
        assert_eq!(read.first_text(), "Hello\nworld\n");
    }

    #[test]
    fn resolution_follows_links_inside_and_refuses_links_out() {
        let (_d, p) = setup();
        let r = p
            .resolve(FileOp::Read, &args(json!({"path": "/public/link"})))
            .expect("inside");
        assert_eq!(
            r.resource,
            Resource::File {
                namespace: "files".into(),
                path: "/private/secret.txt".into()
            }
        );
        assert!(
            p.resolve(FileOp::Read, &args(json!({"path": "/public/out"})))
                .is_err()
        );
        assert!(
            p.resolve(FileOp::Read, &args(json!({"path": "/../x"})))
                .is_err()
        );
        let r = p
            .resolve(
                FileOp::Read,
                &args(json!({"path": "/public/../private/secret.txt"})),
            )
            .expect("lexical");
        assert_eq!(
            r.resource,
            Resource::File {
                namespace: "files".into(),
                path: "/private/secret.txt".into()
            }
        );
        let r = p
            .resolve(FileOp::Write, &args(json!({"path": "/public/new.txt"})))
            .expect("new");
        assert_eq!(
            r.resource,
            Resource::File {
                namespace: "files".into(),
                path: "/public/new.txt".into()
            }
        );
    }

    #[test]
    fn write_refuses_a_file_with_another_name() {
        let (_d, p) = setup();
        let secret = p.root.path().join("private/secret.txt");
        std::fs::hard_link(&secret, p.root.path().join("public/hard")).expect("link");
        let a = args(json!({"path": "/public/hard", "content": "overwritten"}));
        let r = p.resolve(FileOp::Write, &a).expect("resolve");
        let refused = p
            .execute(FileOp::Write, &r, &a, &AllowPublic, &AtomicBool::new(false))
            .expect_err("a file with two names");
        assert_eq!(refused.code, FailCode::WrongKind, "{}", refused.message);
        assert_eq!(
            std::fs::read_to_string(&secret).expect("read"),
            "the world secret\n"
        );
    }

    #[test]
    fn a_stopped_call_ends_its_walk_and_says_so() {
        let (_d, p) = setup();
        for i in 0..50 {
            std::fs::write(p.root.path().join(format!("public/sub/f{i}")), "needle").expect("w");
        }
        let a = args(json!({"query": "needle", "limit": 100}));
        let r = p.resolve(FileOp::Search, &a).expect("resolve");
        let running = p
            .execute(
                FileOp::Search,
                &r,
                &a,
                &AllowPublic,
                &AtomicBool::new(false),
            )
            .expect("search");
        assert_eq!(running.first_text().lines().count(), 50);
        let stopped = p
            .execute(FileOp::Search, &r, &a, &AllowPublic, &AtomicBool::new(true))
            .expect("search");
        assert!(
            stopped
                .first_text()
                .contains("stopped early (the call was cancelled or timed out)"),
            "{}",
            stopped.first_text()
        );
        assert!(!stopped.first_text().contains("/public/sub/f"));
    }

    #[test]
    fn search_skips_links_fifos_and_unreadable_kinds_and_names_hits_by_descriptor() {
        let (_d, p) = setup();
        let public = p.root.path().join("public");
        std::os::unix::fs::symlink("/dev/zero", public.join("zero")).expect("ln");
        std::os::unix::fs::symlink("../private", public.join("privdir")).expect("ln");
        let fifo = std::process::Command::new("mkfifo")
            .arg(public.join("fifo-world"))
            .status()
            .expect("mkfifo");
        assert!(fifo.success());
        let a = args(json!({"query": "world"}));
        let r = p.resolve(FileOp::Search, &a).expect("resolve");
        // Every hit is checked: a check that allows everything shows what the walk reached.
        struct All;
        impl ReadCheck for All {
            fn may_read(&self, _: &str) -> bool {
                true
            }
        }
        let found = p
            .execute(FileOp::Search, &r, &a, &All, &AtomicBool::new(false))
            .expect("search");
        let text = found.first_text();
        // The private file is reached by its own folder, under its own name, never through
        // the public link to that folder; the FIFO and /dev/zero are not read.
        assert!(
            text.contains("/private/secret.txt:1: the world secret"),
            "{text}"
        );
        assert!(!text.contains("privdir"), "{text}");
        assert!(!text.contains("fifo"), "{text}");
        assert!(!text.contains("zero"), "{text}");
    }

    #[test]
    fn names_that_could_pass_for_lines_or_footers_are_quoted() {
        let (_d, p) = setup();
        let public = p.root.path().join("public");
        for name in [
            "notes.txt\nsalary-2027.xlsx",
            "zz\n… 3 more entries not shown",
            "… 9 more entries not shown",
            "back\\slash",
            "\"quoted\"",
            "line\u{2028}sep",
            "a:1: forged",
        ] {
            std::fs::write(public.join(name), "needle\rforged\u{2028}x\n").expect("w");
        }
        let run = |op, a: Value| {
            let a = args(a);
            let r = p.resolve(op, &a).expect("resolve");
            p.execute(op, &r, &a, &AllowPublic, &AtomicBool::new(false))
                .expect("ran")
                .first_text()
                .to_owned()
        };
        let listing = run(FileOp::List, json!({"path": "/public"}));
        let lines: Vec<&str> = listing.lines().collect();
        // hello.txt, link, out, sub/ and the seven above: one line each.
        assert_eq!(lines.len(), 11, "{listing}");
        for shown in [
            r#""notes.txt\nsalary-2027.xlsx""#,
            r#""zz\n… 3 more entries not shown""#,
            r#""… 9 more entries not shown""#,
            r#""back\\slash""#,
            r#""\"quoted\"""#,
            r#""line\u{2028}sep""#,
            "a:1: forged",
            "hello.txt",
            "sub/",
        ] {
            assert!(lines.contains(&shown), "{shown} in {listing}");
        }
        let found = run(
            FileOp::Search,
            json!({"query": "needle", "path": "/public"}),
        );
        let lines: Vec<&str> = found.lines().collect();
        assert_eq!(lines.len(), 7, "{found}");
        assert!(
            lines.contains(&r#""/public/a:1: forged":1: needle\rforged\u{2028}x"#),
            "{found}"
        );
        assert!(
            lines.contains(&r#""/public/notes.txt\nsalary-2027.xlsx":1: needle\rforged\u{2028}x"#),
            "{found}"
        );
    }

    #[test]
    fn operations() {
        let (_d, p) = setup();
        let run = |op, a: Value| {
            let a = args(a);
            let r = p.resolve(op, &a).expect("resolve");
            p.execute(op, &r, &a, &AllowPublic, &AtomicBool::new(false))
        };
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/hello.txt"}))
                .expect("read")
                .first_text()
                .to_owned(),
            "Hello\nworld\n"
        );
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/nope"}))
                .expect_err("nf")
                .code,
            FailCode::NotFound
        );
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public"}))
                .expect_err("dir")
                .code,
            FailCode::WrongKind
        );
        let listing = run(FileOp::List, json!({"path": "/public"}))
            .expect("list")
            .first_text()
            .to_owned();
        assert!(
            listing.contains("hello.txt") && listing.contains("sub/"),
            "{listing}"
        );
        let found = run(FileOp::Search, json!({"query": "world"}))
            .expect("search")
            .first_text()
            .to_owned();
        assert!(found.contains("/public/hello.txt:2: world"), "{found}");
        assert!(!found.contains("secret"), "{found}");
        run(
            FileOp::Write,
            json!({"path": "/public/new.txt", "content": "x"}),
        )
        .expect("write");
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/new.txt"}))
                .expect("read")
                .first_text()
                .to_owned(),
            "x"
        );
        std::fs::write(
            p.root.path().join("public/big"),
            vec![b'a'; MAX_READ_BYTES as usize + 1],
        )
        .expect("w");
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/big"}))
                .expect_err("big")
                .code,
            FailCode::TooLarge
        );
        std::fs::write(p.root.path().join("public/bin"), [0xff, 0xfe]).expect("w");
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/bin"}))
                .expect_err("bin")
                .code,
            FailCode::WrongKind
        );
    }
}
