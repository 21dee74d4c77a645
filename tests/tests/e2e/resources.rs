//! Issue 44, item 2: resources beyond files. Requirement templates make a `SharedOS::Url`
//! (`url = "{url}"`) or an entity of the operator's schema (`entity = {...}`) from a call's
//! arguments, decided by Cedar like a file, with real third-party servers behind the broker in
//! their sandbox: PyPI `mcp-server-fetch` (a URL it fetches itself) and npm
//! `@modelcontextprotocol/server-memory` (entity names).

use std::path::Path;

use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt as _;

use crate::kit::{Options, Raw, TestBroker, meta, text};
use crate::upstream::{package, q, sandboxed, servers};

/// A docs site on loopback: every request it gets is a line `<Host header> <path>` in `log`.
/// Returns the process (killed when dropped) and its port.
async fn docs_site(log: &Path) -> (tokio::process::Child, u16) {
    let script = r#"
import http.server, sys
log = open(sys.argv[1], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        log.write("%s %s\n" % (self.headers.get("Host"), self.path))
        body = b"<html><head><title>Docs</title></head><body><h1>Docs</h1><p>Hello from the docs site, a page long enough to be read as the main text of the page.</p></body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;
    let mut child = tokio::process::Command::new("python3")
        .args(["-c", script])
        .arg(log)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs the docs site");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let port = tokio::time::timeout(crate::kit::WAIT, lines.next_line())
        .await
        .expect("the docs site says its port in time")
        .expect("read")
        .expect("a line")
        .trim()
        .parse()
        .expect("a port");
    (child, port)
}

/// A broker with the files provider and `extra` providers, deciding on `policy`.
async fn broker(policy: &'static str, extra: &str) -> TestBroker {
    TestBroker::start(Options {
        policy,
        tables: extra.to_owned(),
        ..Options::default()
    })
    .await
}

fn outcome(r: &Value) -> String {
    let m = meta(r);
    format!(
        "{}/{}",
        m["outcome"].as_str().unwrap_or("?"),
        m["code"].as_str().unwrap_or("?")
    )
}

const FETCH_POLICY: &str = r#"
@id("alice-docs")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"fetch", resource is SharedOS::Url)
when { resource.scheme == "http" && resource.host == "localhost" };

@id("no-internal-addresses")
forbid(principal, action, resource is SharedOS::Url)
when { resource has ip && (resource.ip.isLoopback() || resource.ip.isInRange(ip("169.254.0.0/16"))
    || resource.ip.isInRange(ip("0.0.0.0/8"))) };
"#;

/// PyPI mcp-server-fetch behind the broker, its `fetch` tool templated `url = "{url}"`: the
/// policy permits the docs host `localhost` and forbids loopback, link-local and `0.0.0.0/8`
/// addresses. The docs host is fetched however it is spelled (capitals, trailing dots,
/// fullwidth letters, a `\` before a userinfo-looking part), and the upstream is sent the URL as
/// the broker read it; loopback by IP in every spelling (dotted, decimal, hex, octal, short,
/// IPv4-mapped IPv6, `::1`), the metadata address, `0`, userinfo tricks and an IDN look-alike are
/// denied, and what is not a URL is `denied/unresolvable_requirement`. Every call is recorded;
/// the docs site saw exactly the permitted calls, each for `localhost`. The server's own check
/// (it refuses names that resolve to private addresses) is off (`--allow-private-ips`): the
/// docs site is on loopback, and what the test shows is that the broker alone holds the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn fetch_server_fetches_only_the_urls_the_policy_permits() {
    let Some(s) = servers() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("requests.log");
    let (_site, port) = docs_site(&log).await;
    let fetch = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"web\"\ncommand = {}\nargs = [\"--ignore-robots-txt\", \"--allow-private-ips\"]\n\
         [providers.tools.fetch]\naction = \"fetch\"\nurl = \"{{url}}\"\n{}network = [\"localhost:{port}\"]\n",
        q(&s["FETCH_CMD"]),
        sandboxed(&[], &[]),
    );
    let broker = broker(FETCH_POLICY, &fetch).await;
    // Shown to alice (some URL is permitted), not to bob (none is).
    let names = |t: &sharedos_proto::ipc::TurnOpened| -> Vec<String> {
        t.tools.iter().map(|t| t.name.to_string()).collect()
    };
    assert!(
        !names(&broker.open_turn("bob").await).contains(&"web.fetch".to_owned()),
        "bob may fetch nothing: hidden"
    );
    let turn = broker.open_turn("alice").await;
    assert!(names(&turn).contains(&"web.fetch".to_owned()));
    let mut raw = Raw::spawn(broker.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let docs = format!("http://localhost:{port}/docs");
    let allowed = [
        (docs.clone(), docs.clone()),
        (
            format!("HTTP://LOCALHOST:{port}/docs"),
            format!("http://localhost:{port}/docs"),
        ),
        (
            format!("http://LocalHost.:{port}/docs?page=2#top"),
            format!("http://localhost:{port}/docs?page=2#top"),
        ),
        (
            format!("http://localhost..:{port}/a/../docs"),
            format!("http://localhost:{port}/docs"),
        ),
        (
            format!(
                "http://\u{ff4c}\u{ff4f}\u{ff43}\u{ff41}\u{ff4c}\u{ff48}\u{ff4f}\u{ff53}\u{ff54}:{port}/docs"
            ),
            format!("http://localhost:{port}/docs"),
        ),
        // WHATWG ends the authority at `\`: the host is localhost, and an upstream whose parser
        // would read 127.0.0.1 there is sent the canonical text instead.
        (
            format!("http://localhost:{port}\\@127.0.0.1/"),
            format!("http://localhost:{port}/@127.0.0.1/"),
        ),
    ];
    let denied = [
        (format!("http://127.0.0.1:{port}/docs"), "denied/forbidden"),
        (format!("http://2130706433:{port}/docs"), "denied/forbidden"),
        (format!("http://0x7f000001:{port}/docs"), "denied/forbidden"),
        (format!("http://0x7f.1:{port}/docs"), "denied/forbidden"),
        (format!("http://0177.0.0.1:{port}/docs"), "denied/forbidden"),
        (format!("http://127.1:{port}/docs"), "denied/forbidden"),
        (
            format!("http://[::ffff:127.0.0.1]:{port}/docs"),
            "denied/forbidden",
        ),
        (format!("http://[::1]:{port}/docs"), "denied/forbidden"),
        (format!("http://0:{port}/docs"), "denied/forbidden"),
        (
            "http://169.254.169.254/latest/meta-data/".to_owned(),
            "denied/forbidden",
        ),
        (
            "http://0xA9FEA9FE/latest/meta-data/".to_owned(),
            "denied/forbidden",
        ),
        (
            format!("http://localhost@127.0.0.1:{port}/docs"),
            "denied/forbidden",
        ),
        (
            format!("http://localhost:{port}@127.0.0.1:{port}/docs"),
            "denied/forbidden",
        ),
        // Cyrillic `о`: another name (`xn--…`), no permit.
        (
            format!("http://l\u{43e}calhost:{port}/docs"),
            "denied/no_permit",
        ),
        (
            format!("http://localhost.evil.example:{port}/docs"),
            "denied/no_permit",
        ),
        (format!("https://localhost:{port}/docs"), "denied/no_permit"),
        (
            format!("localhost:{port}/docs"),
            "denied/unresolvable_requirement",
        ),
        ("not a url".to_owned(), "denied/unresolvable_requirement"),
        (
            "file:///etc/passwd".to_owned(),
            "denied/unresolvable_requirement",
        ),
    ];
    let mut id = 0;
    // `raw`: the page as it is (simplifying it would have readabilipy run `npm install` on its
    // first use, which the sandbox's network rule refuses).
    for (url, _) in &allowed {
        id += 1;
        let r = raw
            .call(id, "web.fetch", json!({"url": url, "raw": true}))
            .await["result"]
            .clone();
        assert_eq!(outcome(&r), "succeeded/ok", "{url}: {r}");
        assert!(text(&r).contains("Hello from the docs site"), "{url}: {r}");
    }
    for (url, want) in &denied {
        id += 1;
        let r = raw.call(id, "web.fetch", json!({"url": url})).await["result"].clone();
        assert_eq!(outcome(&r), *want, "{url}: {r}");
    }
    // The docs site saw the permitted calls and nothing else, each for the name `localhost`.
    let seen = std::fs::read_to_string(&log).unwrap_or_default();
    let seen: Vec<&str> = seen.lines().collect();
    let want: Vec<String> = allowed
        .iter()
        .map(|(_, sent)| {
            let path = sent
                .split_once(&format!(":{port}"))
                .map(|(_, p)| p.split('#').next().unwrap_or(p))
                .unwrap_or_default()
                .to_owned();
            format!("localhost:{port} {path}")
        })
        .collect();
    assert_eq!(seen, want, "the site saw exactly the permitted fetches");
    // Every call recorded: the requirement as the policy saw it, what the upstream was sent
    // when it was not the argument, and no requirement where none could be read.
    let calls = broker.calls_of(&turn.turn);
    assert_eq!(calls.len(), allowed.len() + denied.len());
    for ((url, sent), line) in allowed.iter().zip(&calls) {
        assert_eq!(line["outcome"], "succeeded", "{line}");
        assert_eq!(line["requirement"]["action"], "fetch");
        let bare = sent.split(['?', '#']).next().unwrap_or(sent);
        assert_eq!(
            line["requirement"]["resource"],
            format!("SharedOS::Url::{bare:?}"),
            "{line}"
        );
        if url == sent {
            assert!(line.get("forwardedArguments").is_none(), "{line}");
        } else {
            assert_eq!(line["forwardedArguments"]["url"], sent.as_str(), "{line}");
            assert_eq!(line["arguments"]["url"], url.as_str(), "{line}");
        }
    }
    for ((url, want), line) in denied.iter().zip(&calls[allowed.len()..]) {
        assert_eq!(
            format!(
                "{}/{}",
                line["outcome"].as_str().unwrap_or("?"),
                line["code"].as_str().unwrap_or("?")
            ),
            *want,
            "{url}: {line}"
        );
        assert!(line.get("forwardedArguments").is_none(), "{line}");
        if *want == "denied/forbidden" {
            assert_eq!(line["policies"], json!(["no-internal-addresses"]), "{line}");
        }
    }
    let loopback = &calls[allowed.len() + 1]["requirement"]["resource"];
    assert_eq!(
        loopback,
        &json!(format!("SharedOS::Url::\"http://127.0.0.1:{port}/docs\""))
    );
}

const MEMORY_POLICY: &str = r#"
@id("alice-reads-public-names")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is Memory::Nodes)
when { ["public-notes", "glossary", "scratch"].containsAll(resource.names) };

@id("alice-deletes-scratch")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"write", resource is Memory::Nodes)
when { ["scratch"].containsAll(resource.names) };

@id("alice-searches")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read", resource is Memory::Search);

@id("alice-creates")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"call", resource is SharedOS::Tool)
when { resource.name == "mem.create_entities" };
"#;

/// The built-in schema, with the entity types the memory templates make: `Memory::Nodes` (the
/// names a call asks for, a set) and `Memory::Search` (a search, by its query).
fn memory_schema() -> String {
    let builtin = sharedos_broker::policy::BUILTIN_SCHEMA;
    let from = "resource: [File],";
    assert_eq!(builtin.matches(from).count(), 1, "{builtin}");
    builtin.replace(from, "resource: [File, Memory::Nodes, Memory::Search],")
        + "namespace Memory {\n  entity Nodes { names: Set<String> };\n  entity Search;\n}\n"
}

/// npm server-memory behind the broker, decided on the entity names its calls ask for:
/// `open_nodes` and `delete_entities` make a `Memory::Nodes` whose `names` attribute is the
/// call's array (a Cedar set), `search_nodes` a `Memory::Search` whose id is the query. Alice
/// may read the public names and delete only `scratch`; a read naming another entity, and a
/// delete of anything but `scratch`, are denied, and the denied delete never reached the server
/// (what it would have deleted is still there). An empty query cannot be an entity id:
/// `denied/unresolvable_requirement`. Every call is recorded with the entity's attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn memory_server_decided_on_the_entity_names_a_call_asks_for() {
    let Some(s) = servers() else { return };
    // The server's store: a folder its uid may write. The schema: beside the broker's files,
    // in a folder only root may write (the broker checks who may write what it loads).
    let store_dir = tempfile::tempdir().expect("tmp");
    crate::upstream::open_to_every_uid(store_dir.path());
    let schema_dir = tempfile::tempdir().expect("tmp");
    let schema = schema_dir.path().join("memory.cedarschema");
    std::fs::write(&schema, memory_schema()).expect("schema");
    let store = store_dir.path().join("memory.jsonl");
    let nodes = |arg: &str| {
        format!(
            "entity = {{ type = \"Memory::Nodes\", id = \"nodes\", attributes = {{ names = \"{{{arg}}}\" }} }}"
        )
    };
    let memory = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"mem\"\ncommand = {}\nargs = [{}]\nenv = {{ MEMORY_FILE_PATH = {} }}\n\
         [providers.tools.open_nodes]\naction = \"read\"\n{}\n\
         [providers.tools.delete_entities]\naction = \"write\"\n{}\n\
         [providers.tools.search_nodes]\naction = \"read\"\nentity = {{ type = \"Memory::Search\", id = \"{{query}}\" }}\n\
         {}",
        q(&s["MEMORY_CMD"]),
        q(&s["MEMORY_ARGS"]),
        q(&store.display().to_string()),
        nodes("names"),
        nodes("entityNames"),
        sandboxed(
            &[package(&s["MEMORY_ARGS"])],
            &[&store_dir.path().display().to_string()]
        ),
    );
    let b = TestBroker::start(Options {
        policy: MEMORY_POLICY,
        top: format!("schema = {}\n", q(&schema.display().to_string())),
        tables: memory,
        ..Options::default()
    })
    .await;
    let turn = b.open_turn("alice").await;
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let entity = |name: &str| json!({"name": name, "entityType": "note", "observations": [format!("{name} body")]});
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "mem.create_entities",
            json!({"entities": [entity("public-notes"), entity("glossary"), entity("scratch"), entity("alice-diary")]}),
            "succeeded/ok",
        ),
        (
            "mem.open_nodes",
            json!({"names": ["public-notes"]}),
            "succeeded/ok",
        ),
        (
            "mem.open_nodes",
            json!({"names": ["public-notes", "glossary"]}),
            "succeeded/ok",
        ),
        (
            "mem.open_nodes",
            json!({"names": ["public-notes", "alice-diary"]}),
            "denied/no_permit",
        ),
        (
            "mem.open_nodes",
            json!({"names": ["alice-diary"]}),
            "denied/no_permit",
        ),
        (
            "mem.delete_entities",
            json!({"entityNames": ["glossary"]}),
            "denied/no_permit",
        ),
        (
            "mem.delete_entities",
            json!({"entityNames": ["scratch", "alice-diary"]}),
            "denied/no_permit",
        ),
        (
            "mem.delete_entities",
            json!({"entityNames": ["scratch"]}),
            "succeeded/ok",
        ),
        (
            "mem.search_nodes",
            json!({"query": ""}),
            "denied/unresolvable_requirement",
        ),
        (
            "mem.search_nodes",
            json!({"query": "glossary"}),
            "succeeded/ok",
        ),
        // What the denied deletes named is still there; `scratch` is gone.
        (
            "mem.open_nodes",
            json!({"names": ["glossary", "scratch"]}),
            "succeeded/ok",
        ),
    ];
    let mut answers = Vec::new();
    for (i, (tool, args, want)) in cases.iter().enumerate() {
        let r = raw.call(i as i64 + 1, tool, args.clone()).await["result"].clone();
        assert_eq!(outcome(&r), *want, "{tool} {args}: {r}");
        answers.push(r);
    }
    let read = text(&answers[1]);
    assert!(read.contains("public-notes body"), "{read}");
    let last = text(&answers[10]);
    assert!(
        last.contains("glossary body") && !last.contains("scratch body"),
        "{last}"
    );
    assert!(
        text(&answers[8]).contains("argument `query` is empty"),
        "{}",
        answers[8]
    );
    let calls = b.calls_of(&turn.turn);
    assert_eq!(calls.len(), cases.len(), "every call recorded");
    assert_eq!(
        calls[3]["requirement"],
        json!({"action": "read", "resource": "Memory::Nodes::\"nodes\"",
               "attributes": {"names": ["public-notes", "alice-diary"]}})
    );
    assert_eq!(
        calls[9]["requirement"],
        json!({"action": "read", "resource": "Memory::Search::\"glossary\"", "attributes": {}})
    );
    assert!(calls[8]["requirement"].is_null(), "{}", calls[8]);
    // The store holds what the permitted calls left: no `scratch`, the rest.
    let kept = std::fs::read_to_string(&store).expect("store");
    assert!(
        !kept.contains("\"scratch\"") && kept.contains("\"alice-diary\""),
        "{kept}"
    );
}

const GIT_POLICY: &str = r#"
@id("alice-reads-public-repos")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"read",
       resource is SharedOS::File)
when { resource.path like "/public/*" };

@id("alice-branches-public-repos")
permit(principal == SharedOS::User::"alice", action == SharedOS::Action::"write",
       resource is SharedOS::File)
when { resource.path like "/public/*" && context has arguments
       && context.arguments has branch_name && context.arguments.branch_name like "alice/*" };
"#;

/// `git` in `dir` (the test's own, as root), failing the test if it fails.
fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// PyPI mcp-server-git behind the broker, its `repo_path` argument a file resource under the
/// repositories' folder (`file = "{repo_path}"`, `file_root`), decided on `repo_path` and on the
/// typed argument `branch_name` (`context.arguments`): alice may read (log, status) the
/// repositories under `/public`, and write them only on `alice/*` branches (`git_create_branch`
/// and `git_checkout` name the branch). A private repository, a `..` back out of `/public`, and
/// a link from `/public` to the private one are denied; a path outside the folder is
/// `denied/unresolvable_requirement`; `bob/feature` and a checkout of `main` in the public
/// repository are denied on their arguments alone (the same requirement as alice's permitted
/// branch), never reach the server, and the repository has exactly the branches permitted.
/// `git_commit` names no branch (it commits to whatever is checked out, which the broker cannot
/// see): no permit can apply to it (it has no `branch_name`), so it is not in alice's catalogue
/// and a call of it is `denied/unpublished_tool`; committing stays a person's step outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs third-party MCP servers: run bash .ci/install-mcp-servers, then cargo test -- --include-ignored (bash .ci/run does both)"]
async fn git_server_decided_on_the_repository_it_is_given() {
    let Some(s) = servers() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let repos = std::fs::canonicalize(dir.path())
        .expect("canon")
        .join("repos");
    for (name, message) in [
        ("public/docs", "docs: the first page"),
        ("private/keys", "keys: the vault"),
    ] {
        let r = repos.join(name);
        std::fs::create_dir_all(&r).expect("mkdir");
        git(&r, &["init", "-q", "-b", "main"]);
        git(&r, &["commit", "-q", "--allow-empty", "-m", message]);
    }
    std::os::unix::fs::symlink(repos.join("private/keys"), repos.join("public/link")).expect("ln");
    // Under a root broker the upstream runs under a uid of its own: it may write the repositories.
    let status = std::process::Command::new("chmod")
        .args(["-R", "a+rwX"])
        .arg(dir.path())
        .status()
        .expect("chmod");
    assert!(status.success());
    let r = repos.display().to_string();
    let template = |tool: &str, action: &str| {
        format!(
            "[providers.tools.{tool}]\naction = \"{action}\"\nfile = \"{{repo_path}}\"\nfile_root = {}\n",
            q(&r)
        )
    };
    // git refuses a repository another uid owns unless told it is safe (the test's, here).
    let provider = format!(
        "\n[[providers]]\ntype = \"mcp\"\nnamespace = \"git\"\ncommand = {}\n\
         env = {{ GIT_CONFIG_COUNT = \"1\", GIT_CONFIG_KEY_0 = \"safe.directory\", GIT_CONFIG_VALUE_0 = \"*\" }}\n{}{}{}{}{}{}",
        q(&s["GIT_CMD"]),
        template("git_log", "read"),
        template("git_status", "read"),
        template("git_create_branch", "write"),
        template("git_checkout", "write"),
        template("git_commit", "write"),
        sandboxed(&[], &[]),
    );
    let b = broker(GIT_POLICY, &provider).await;
    let turn = b.open_turn("alice").await;
    let names: Vec<String> = turn.tools.iter().map(|t| t.name.to_string()).collect();
    for shown in ["git.git_log", "git.git_create_branch", "git.git_checkout"] {
        assert!(names.contains(&shown.to_owned()), "{shown} in {names:?}");
    }
    assert!(
        !names.contains(&"git.git_commit".to_owned()),
        "no branch to decide on: hidden, {names:?}"
    );
    let mut raw = Raw::spawn(b.shim_command(turn.token.expose()));
    raw.initialize("2025-06-18").await;
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "git.git_log",
            json!({"repo_path": format!("{r}/public/docs")}),
            "succeeded/ok",
        ),
        (
            "git.git_status",
            json!({"repo_path": format!("{r}/public/docs")}),
            "succeeded/ok",
        ),
        (
            "git.git_log",
            json!({"repo_path": format!("{r}/private/keys")}),
            "denied/no_permit",
        ),
        (
            "git.git_log",
            json!({"repo_path": format!("{r}/public/../private/keys")}),
            "denied/no_permit",
        ),
        (
            "git.git_log",
            json!({"repo_path": format!("{r}/public/link")}),
            "denied/no_permit",
        ),
        (
            "git.git_log",
            json!({"repo_path": "/etc"}),
            "denied/unresolvable_requirement",
        ),
        (
            "git.git_create_branch",
            json!({"repo_path": format!("{r}/public/docs"), "branch_name": "alice/feature"}),
            "succeeded/ok",
        ),
        (
            "git.git_create_branch",
            json!({"repo_path": format!("{r}/private/keys"), "branch_name": "alice/feature"}),
            "denied/no_permit",
        ),
        (
            "git.git_create_branch",
            json!({"repo_path": format!("{r}/public/link"), "branch_name": "alice/feature"}),
            "denied/no_permit",
        ),
        // 9..: the same repository, decided on the branch the arguments name.
        (
            "git.git_create_branch",
            json!({"repo_path": format!("{r}/public/docs"), "branch_name": "bob/feature"}),
            "denied/no_permit",
        ),
        (
            "git.git_create_branch",
            json!({"repo_path": format!("{r}/public/docs"), "branch_name": "x/alice/feature"}),
            "denied/no_permit",
        ),
        (
            "git.git_checkout",
            json!({"repo_path": format!("{r}/public/docs"), "branch_name": "alice/feature"}),
            "succeeded/ok",
        ),
        (
            "git.git_checkout",
            json!({"repo_path": format!("{r}/public/docs"), "branch_name": "main"}),
            "denied/no_permit",
        ),
        (
            "git.git_commit",
            json!({"repo_path": format!("{r}/public/docs"), "message": "on whatever is checked out"}),
            "denied/unpublished_tool",
        ),
    ];
    let mut answers = Vec::new();
    for (i, (tool, args, want)) in cases.iter().enumerate() {
        let a = raw.call(i as i64 + 1, tool, args.clone()).await["result"].clone();
        assert_eq!(outcome(&a), *want, "{tool} {args}: {a}");
        answers.push(a);
    }
    assert!(
        text(&answers[0]).contains("docs: the first page"),
        "{}",
        answers[0]
    );
    assert!(!answers.iter().any(|a| a.to_string().contains("the vault")));
    // The branch was made where it was permitted, and only there.
    assert!(
        git(
            &repos.join("public/docs"),
            &["branch", "--list", "alice/feature"]
        )
        .contains("alice/feature")
    );
    assert_eq!(
        git(
            &repos.join("private/keys"),
            &["branch", "--list", "alice/feature"]
        ),
        ""
    );
    let calls = b.calls_of(&turn.turn);
    assert_eq!(calls.len(), cases.len(), "every call recorded");
    assert_eq!(
        calls[0]["requirement"]["resource"],
        "SharedOS::File::\"/public/docs\""
    );
    assert_eq!(
        calls[3]["requirement"]["resource"],
        "SharedOS::File::\"/private/keys\""
    );
    assert_eq!(
        calls[4]["requirement"]["resource"],
        "SharedOS::File::\"/private/keys\""
    );
    assert_eq!(calls[6]["requirement"]["action"], "write");
    // The public repository has exactly the branches permitted, alice's checked out: bob's
    // branch and the checkout of `main` never reached the server.
    let public = repos.join("public/docs");
    let mut branches: Vec<String> =
        git(&public, &["branch", "--list", "--format=%(refname:short)"])
            .lines()
            .map(str::to_owned)
            .collect();
    branches.sort();
    assert_eq!(branches, ["alice/feature", "main"]);
    assert_eq!(
        git(&public, &["rev-parse", "--abbrev-ref", "HEAD"]).trim(),
        "alice/feature"
    );
    assert_eq!(
        git(&public, &["rev-list", "--count", "--all"]).trim(),
        "1",
        "no commit made"
    );
    // `context.arguments` decided: alice's branch and bob's have the same requirement (write on
    // the public repository); the permit that reads `branch_name` decided the one, no permit
    // applied to the other, and the record keeps the arguments each was decided on.
    assert_eq!(
        calls[9]["requirement"], calls[6]["requirement"],
        "{}",
        calls[9]
    );
    assert_eq!(calls[6]["policies"], json!(["alice-branches-public-repos"]));
    assert_eq!(calls[6]["arguments"]["branch_name"], "alice/feature");
    assert_eq!(calls[9]["arguments"]["branch_name"], "bob/feature");
    assert_eq!(calls[9]["policies"], json!([]), "{}", calls[9]);
    assert_eq!(
        calls[11]["policies"],
        json!(["alice-branches-public-repos"])
    );
    let denied = calls
        .iter()
        .filter(|c| c["outcome"] == "denied" && c["requirement"] == calls[6]["requirement"])
        .count();
    assert_eq!(
        denied, 3,
        "bob/feature, x/alice/feature and main: {calls:?}"
    );
    // `policy check` shows the context the policy saw.
    for (branch, decision, code) in [("bob/feature", "deny", 3), ("alice/next", "allow", 0)] {
        let mut check = b.cli();
        check.args([
            "policy",
            "check",
            "--principal",
            "alice",
            "--tool",
            "git.git_create_branch",
            "--json",
            "--args",
        ]);
        check.arg(
            json!({"repo_path": format!("{r}/public/docs"), "branch_name": branch}).to_string(),
        );
        let (got, out, err) = crate::kit::run(check).await;
        assert_eq!(got, code, "{out}{err}");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v["decision"], decision, "{v}");
        assert_eq!(v["context"]["arguments"]["branch_name"], branch, "{v}");
    }
}
