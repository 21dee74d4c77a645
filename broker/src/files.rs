//! The built-in files provider: `files.read`, `files.list`, `files.search`, `files.write`
//! (registered only when writable) over a real folder, addressed by virtual paths.
//!
//! Owns: the tools' published definitions, requirement resolution from arguments (a virtual path
//! canonicalized, then resolved through symbolic links *before* the policy sees it, so the policy
//! decides on the file that will actually be touched), and bounded execution. It never decides
//! authority itself: `search` asks the kernel (through [`ReadCheck`]) before returning each hit.
//! Nothing here can leave the root: resolution refuses links that lead out, and execution checks
//! through `/proc/self/fd` that the file it opened is the one that was authorized.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};
use sharedos_proto::{FailCode, ToolDefinition, ToolMetadata, ToolName};

use crate::policy::Resource;
use crate::vpath;

/// Largest file `read` returns and `search` looks into; larger files fail with `too_large`.
pub const MAX_READ_BYTES: u64 = 1024 * 1024;
/// Largest content `write` accepts.
pub const MAX_WRITE_BYTES: usize = 1024 * 1024;
/// Most entries `list` returns (the rest are counted, not shown).
pub const MAX_LIST_ENTRIES: usize = 1000;
/// Most files `search` opens in one call.
pub const MAX_SEARCH_FILES: usize = 10_000;
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
    /// The real root, canonical (no symlinks).
    root: PathBuf,
    pub writable: bool,
    /// Added before every call (fault injection for testing timeouts and cancellation).
    pub latency: Option<std::time::Duration>,
}

/// A resolved requirement, plus what execution needs to touch exactly that file.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub action: &'static str,
    pub resource: Resource,
    /// The real path of the resource (canonical, inside the root), when it exists or can.
    pub real: PathBuf,
}

/// A failed execution: the code, the sentence after `failed: `, and any content a provider
/// returned with its error (passed through after that sentence).
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: FailCode,
    pub message: String,
    pub content: Vec<Value>,
}

impl Failure {
    pub fn new(code: FailCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            content: vec![],
        }
    }

    pub fn with_content(mut self, content: Vec<Value>) -> Self {
        self.content = content;
        self
    }
}

fn fail(code: FailCode, message: impl Into<String>) -> Failure {
    Failure::new(code, message)
}

/// A successful execution: MCP content blocks and structured content, as the provider gave them.
#[derive(Debug, Clone)]
pub struct Success {
    pub content: Vec<Value>,
    pub structured: Option<Value>,
}

impl Success {
    pub fn text(text: String) -> Self {
        Self {
            content: vec![json!({"type": "text", "text": text})],
            structured: None,
        }
    }

    pub fn content(content: Vec<Value>, structured: Option<Value>) -> Self {
        Self {
            content,
            structured,
        }
    }

    /// The text of the first block (tests, tables).
    pub fn first_text(&self) -> &str {
        self.content
            .first()
            .and_then(|c| c["text"].as_str())
            .unwrap_or_default()
    }
}

/// The kernel's answer to "may this principal read this file?", for `search` hits.
pub trait ReadCheck: Send + Sync {
    fn may_read(&self, virtual_path: &str) -> bool;
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
        let root_err = |source| FilesConfigError::Root {
            namespace: namespace.to_owned(),
            root: root.display().to_string(),
            source,
        };
        let canonical = std::fs::canonicalize(root).map_err(root_err)?;
        if !canonical.is_dir() {
            return Err(root_err(std::io::Error::other("not a folder")));
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            root: canonical,
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

    fn real_of(&self, canonical: &str) -> PathBuf {
        let mut p = self.root.clone();
        p.extend(vpath::components(canonical));
        p
    }

    fn virtual_of(&self, real: &Path) -> Option<String> {
        let rel = real.strip_prefix(&self.root).ok()?;
        let parts: Option<Vec<&str>> = rel.components().map(|c| c.as_os_str().to_str()).collect();
        Some(format!("/{}", parts?.join("/")))
    }

    /// The lexical path when it is already the real one: the root is still a folder (not a
    /// link put in its place) and every component below it exists and is not a symbolic link.
    /// One lstat per component from the root, where `realpath` reads every component from `/`.
    /// `None` sends the caller through the filesystem's own resolution.
    fn plain_path(&self, canonical: &str) -> Option<PathBuf> {
        let mut p = self.root.clone();
        if !std::fs::symlink_metadata(&p).ok()?.is_dir() {
            return None;
        }
        for part in vpath::components(canonical) {
            p.push(part);
            if std::fs::symlink_metadata(&p).ok()?.file_type().is_symlink() {
                return None;
            }
        }
        Some(p)
    }

    /// Resolves a virtual path to the file that would be touched: lexically canonical, then
    /// through symbolic links. `Err` is a sentence for `denied: ... unresolvable`.
    pub fn resolve_path(&self, raw: &str) -> Result<(String, PathBuf), String> {
        let canonical = vpath::canonicalize(raw).map_err(|e| e.to_string())?;
        if let Some(real) = self.plain_path(&canonical) {
            return Ok((canonical, real));
        }
        let lexical = self.real_of(&canonical);
        let outside = || {
            format!(
                "path `{}` leads outside the root through a symbolic link",
                sharedos_proto::name::shown(raw)
            )
        };
        match std::fs::canonicalize(&lexical) {
            Ok(real) => {
                let v = self.virtual_of(&real).ok_or_else(outside)?;
                Ok((v, real))
            }
            Err(_) => {
                // Does not exist (yet): resolve the folder it would be in.
                let (Some(parent), Some(name)) = (lexical.parent(), lexical.file_name()) else {
                    return Ok((canonical, lexical));
                };
                match std::fs::canonicalize(parent) {
                    Ok(real_parent) => {
                        let mut real = real_parent;
                        real.push(name);
                        if std::fs::symlink_metadata(&real).is_ok() {
                            // A dangling symbolic link: where it points is unknown territory.
                            return Err(outside());
                        }
                        let v = self.virtual_of(&real).ok_or_else(outside)?;
                        Ok((v, real))
                    }
                    Err(_) => Ok((canonical, lexical)),
                }
            }
        }
    }

    /// The requirement of a call: action and resource from its arguments.
    pub fn resolve(&self, op: FileOp, args: &Map<String, Value>) -> Result<Resolved, String> {
        let raw = match (op, args.get("path")) {
            (_, Some(Value::String(p))) => p.as_str(),
            (FileOp::Search, None) => "/",
            _ => return Err("the call names no `path`".into()),
        };
        let (virtual_path, real) = self.resolve_path(raw)?;
        Ok(Resolved {
            action: op.action(),
            resource: Resource::File { path: virtual_path },
            real,
        })
    }

    /// Runs an authorized call. Blocking file IO: call from a blocking thread.
    pub fn execute(
        &self,
        op: FileOp,
        resolved: &Resolved,
        args: &Map<String, Value>,
        check: &dyn ReadCheck,
    ) -> Result<Success, Failure> {
        let vpath = resolved.resource.short();
        match op {
            FileOp::Read => self.read(vpath, &resolved.real),
            FileOp::List => self.list(vpath, &resolved.real),
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
                self.search(vpath, &resolved.real, query, limit, check)
            }
            FileOp::Write => {
                let content = args
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.write(vpath, &resolved.real, content)
            }
        }
    }

    /// Opens `real` and checks that the open file is the authorized one (no link swapped in).
    /// Non-blocking, so a FIFO or device put in the tree cannot hang the call; only regular
    /// files are read after that.
    fn open_checked(&self, vpath: &str, real: &Path) -> Result<std::fs::File, Failure> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(real)
            .map_err(|e| io_failure(vpath, &e))?;
        let opened =
            std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(|e| {
                fail(
                    FailCode::ProviderError,
                    format!("cannot verify {vpath}: {e}"),
                )
            })?;
        if opened != real {
            return Err(fail(
                FailCode::ProviderError,
                format!("{vpath} changed while it was being opened; try again"),
            ));
        }
        Ok(file)
    }

    fn read(&self, vpath: &str, real: &Path) -> Result<Success, Failure> {
        let file = self.open_checked(vpath, real)?;
        let meta = file.metadata().map_err(|e| io_failure(vpath, &e))?;
        if meta.is_dir() {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is a folder; use files.list"),
            ));
        }
        if !meta.is_file() {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is not a regular file"),
            ));
        }
        if meta.len() > MAX_READ_BYTES {
            return Err(fail(
                FailCode::TooLarge,
                format!(
                    "{vpath} is {} bytes; files.read returns at most {MAX_READ_BYTES} bytes",
                    meta.len()
                ),
            ));
        }
        let mut bytes = Vec::new();
        file.take(MAX_READ_BYTES + 1)
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

    fn list(&self, vpath: &str, real: &Path) -> Result<Success, Failure> {
        let meta = std::fs::metadata(real).map_err(|e| io_failure(vpath, &e))?;
        if !meta.is_dir() {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is not a folder; use files.read"),
            ));
        }
        let mut names = Vec::new();
        let mut total = 0usize;
        for entry in std::fs::read_dir(real).map_err(|e| io_failure(vpath, &e))? {
            let entry = entry.map_err(|e| io_failure(vpath, &e))?;
            total += 1;
            if names.len() < MAX_LIST_ENTRIES {
                let mut name = entry.file_name().to_string_lossy().into_owned();
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
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
        Ok(Success::text(text))
    }

    fn search(
        &self,
        vpath: &str,
        real: &Path,
        query: &str,
        limit: usize,
        check: &dyn ReadCheck,
    ) -> Result<Success, Failure> {
        let meta = std::fs::metadata(real).map_err(|e| io_failure(vpath, &e))?;
        if !meta.is_dir() {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} is not a folder"),
            ));
        }
        let mut hits = Vec::new();
        let mut scanned = 0usize;
        let mut stack = vec![real.to_path_buf()];
        'walk: while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
            entries.sort_by_key(|e| e.file_name());
            for entry in entries {
                // Never follow links while walking: file_type() does not.
                let Ok(kind) = entry.file_type() else {
                    continue;
                };
                let path = entry.path();
                if kind.is_dir() {
                    stack.push(path);
                    continue;
                }
                if !kind.is_file() {
                    continue;
                }
                scanned += 1;
                if scanned > MAX_SEARCH_FILES {
                    break 'walk;
                }
                let Some(v) = self.virtual_of(&path) else {
                    continue;
                };
                let name_hit = entry.file_name().to_string_lossy().contains(query);
                let line_hit = if entry.metadata().is_ok_and(|m| m.len() <= MAX_READ_BYTES) {
                    std::fs::read_to_string(&path).ok().and_then(|text| {
                        text.lines()
                            .enumerate()
                            .find(|(_, l)| l.contains(query))
                            .map(|(i, l)| (i + 1, l.chars().take(200).collect::<String>()))
                    })
                } else {
                    None
                };
                if (name_hit || line_hit.is_some()) && check.may_read(&v) {
                    hits.push(match line_hit {
                        Some((n, line)) => format!("{v}:{n}: {line}"),
                        None => v,
                    });
                    if hits.len() >= limit {
                        break 'walk;
                    }
                }
            }
        }
        let text = if hits.is_empty() {
            format!("no readable file under {vpath} matches {query:?}")
        } else {
            hits.join("\n")
        };
        Ok(Success::text(text))
    }

    fn write(&self, vpath: &str, real: &Path, content: &str) -> Result<Success, Failure> {
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
        if std::fs::symlink_metadata(real).is_ok_and(|m| !m.is_file()) {
            return Err(fail(
                FailCode::WrongKind,
                format!("{vpath} exists and is not a regular file"),
            ));
        }
        let parent_ok = real
            .parent()
            .is_some_and(|p| std::fs::canonicalize(p).is_ok_and(|c| c.starts_with(&self.root)));
        if !parent_ok {
            return Err(fail(
                FailCode::NotFound,
                format!("the folder of {vpath} does not exist"),
            ));
        }
        std::fs::write(real, content).map_err(|e| io_failure(vpath, &e))?;
        Ok(Success::text(format!(
            "wrote {} bytes to {vpath}",
            content.len()
        )))
    }
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
        let swapped = p.resolve(FileOp::Read, &args(json!({"path": "/public/hello.txt"})));
        assert!(swapped.is_err(), "resolved through a swapped root");
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
                path: "/private/secret.txt".into()
            }
        );
        let r = p
            .resolve(FileOp::Write, &args(json!({"path": "/public/new.txt"})))
            .expect("new");
        assert_eq!(
            r.resource,
            Resource::File {
                path: "/public/new.txt".into()
            }
        );
    }

    #[test]
    fn operations() {
        let (_d, p) = setup();
        let run = |op, a: Value| {
            let a = args(a);
            let r = p.resolve(op, &a).expect("resolve");
            p.execute(op, &r, &a, &AllowPublic)
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
            p.root.join("public/big"),
            vec![b'a'; MAX_READ_BYTES as usize + 1],
        )
        .expect("w");
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/big"}))
                .expect_err("big")
                .code,
            FailCode::TooLarge
        );
        std::fs::write(p.root.join("public/bin"), [0xff, 0xfe]).expect("w");
        assert_eq!(
            run(FileOp::Read, json!({"path": "/public/bin"}))
                .expect_err("bin")
                .code,
            FailCode::WrongKind
        );
    }
}
