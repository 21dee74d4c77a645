//! No circles, of modules or of files, in any crate of the workspace: a module that uses another
//! (`crate::a` in its code, tests aside) is never used back, directly or around a loop; and within
//! a folder module (`upstream/`), a file that uses a sibling (`super::http`) is never used back.
//! A folder's `mod.rs` and its own files are one module to the rest of the crate: a child using
//! its parent's items (`super::Session`) is how Rust nests them, not a circle.
//!
//! The broker's floors (`broker/tests/layout.rs`) already order its top-level modules; this test
//! covers every crate and the files inside folders.

#![allow(
    clippy::expect_used,
    reason = "a test target: an unreadable tree fails the test loudly"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The identifiers right after each `prefix` in `code` (`crate::{a, b::c}` gives `a` and `b`).
fn paths_after(code: &str, prefix: &str) -> Vec<(String, Option<String>)> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, m) in code.match_indices(prefix) {
        // `super::` inside `crate::a::super::` does not occur; a `prefix` that is the tail of a
        // longer path (`foo_crate::`) is not ours.
        if code[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            continue;
        }
        let rest = &code[i + m.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner: String = group.chars().take_while(|c| *c != '}').collect();
            for part in inner.split(',') {
                let part = part.trim();
                let (first, second) = match part.split_once("::") {
                    Some((a, b)) => (ident(a), Some(ident(b))),
                    None => (ident(part), None),
                };
                if !first.is_empty() {
                    out.push((first, second.filter(|s| !s.is_empty())));
                }
            }
        } else {
            let first = ident(rest);
            let second = rest[first.len()..]
                .strip_prefix("::")
                .map(ident)
                .filter(|s| !s.is_empty());
            if !first.is_empty() {
                out.push((first, second));
            }
        }
    }
    out
}

/// A file's code with its tests and its comment lines left out (a doc link to a module above is
/// a pointer for the reader, not a use).
fn code_of(file: &Path) -> String {
    let text = std::fs::read_to_string(file).expect("read");
    text.split("#[cfg(test)]")
        .next()
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    files
}

/// Every circle in `graph`, each once, as the names around it.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn walk(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut circle = stack[at..].to_vec();
            circle.push(node.to_owned());
            found.push(circle);
            return;
        }
        if done.contains(node) {
            return;
        }
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            walk(next, graph, stack, done, found);
        }
        stack.pop();
        done.insert(node.to_owned());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        walk(node, graph, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// The circles of one crate: between its top-level modules, and between the files of each folder.
fn crate_circles(src: &Path) -> (usize, Vec<String>) {
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let mut folders: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("src") {
        let path = entry.expect("entry").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if ["lib", "main"].contains(&stem) || stem == "bin" {
            continue;
        }
        if path.is_dir() {
            let files = rust_files(&path);
            folders.insert(stem.to_owned(), files.clone());
            modules.entry(stem.to_owned()).or_default().extend(files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            modules.entry(stem.to_owned()).or_default().push(path);
        }
    }
    let mut found = Vec::new();
    // Between top-level modules.
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, files) in &modules {
        let uses = graph.entry(module.clone()).or_default();
        for file in files {
            for (used, _) in paths_after(&code_of(file), "crate::") {
                if used != *module && modules.contains_key(&used) {
                    uses.insert(used);
                }
            }
        }
    }
    for c in circles(&graph) {
        found.push(format!("modules: {}", c.join(" → ")));
    }
    // Between the files of each folder (`mod.rs` is the folder itself, not a sibling).
    for (folder, files) in &folders {
        let names: BTreeSet<String> = files
            .iter()
            .filter_map(|f| f.file_stem().and_then(|s| s.to_str()))
            .filter(|s| *s != "mod")
            .map(str::to_owned)
            .collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in files {
            let Some(me) = file.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if me == "mod" {
                continue;
            }
            let code = code_of(file);
            let uses = graph.entry(me.to_owned()).or_default();
            let mut sibling = |name: &str| {
                if name != me && names.contains(name) {
                    uses.insert(name.to_owned());
                }
            };
            for (first, _) in paths_after(&code, "super::") {
                sibling(&first);
            }
            for (first, second) in paths_after(&code, "crate::") {
                if first == *folder
                    && let Some(s) = second
                {
                    sibling(&s);
                }
            }
        }
        for c in circles(&graph) {
            found.push(format!("files of {folder}/: {}", c.join(" → ")));
        }
    }
    (modules.len(), found)
}

#[test]
fn no_crate_has_a_circle_of_modules_or_of_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf();
    let mut checked = Vec::new();
    let mut found = Vec::new();
    let mut crates: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("workspace")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    crates.sort();
    for dir in crates {
        let name = dir
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_owned();
        let (modules, circles) = crate_circles(&dir.join("src"));
        checked.push(format!("{name} ({modules} modules)"));
        found.extend(circles.into_iter().map(|c| format!("{name}: {c}")));
    }
    eprintln!("checked: {}", checked.join(", "));
    for crate_name in ["broker", "proto", "column"] {
        assert!(
            checked
                .iter()
                .any(|c| c.starts_with(&format!("{crate_name} "))),
            "{crate_name} not checked: {checked:?}"
        );
    }
    assert!(found.is_empty(), "circles: {found:#?}");
}

/// The checker finds what it must: a circle of two modules, one of three files in a folder, and
/// none where a child uses its parent's items.
#[test]
fn the_checker_finds_a_circle_it_is_shown() {
    let dir = std::env::temp_dir().join(format!("sharedos-circles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("up")).expect("mkdir");
    let write = |p: &str, s: &str| std::fs::write(dir.join(p), s).expect("write");
    write("lib.rs", "pub mod a; pub mod b; pub mod up;");
    write("a.rs", "use crate::b::X;");
    write("b.rs", "use crate::{a, up};");
    write("up/mod.rs", "mod x; mod y; mod z; pub struct S;");
    write("up/x.rs", "use super::y::f; use super::S;");
    write("up/y.rs", "use crate::up::z::g;");
    write(
        "up/z.rs",
        "use super::{x::h, S};\n/// Not [`crate::b`].\n#[cfg(test)]\nmod tests { use crate::a; }",
    );
    let (modules, found) = crate_circles(&dir);
    std::fs::remove_dir_all(&dir).expect("clean up");
    assert_eq!(modules, 3);
    assert_eq!(
        found,
        vec![
            "modules: a → b → a".to_owned(),
            "files of up/: x → y → z → x".to_owned()
        ]
    );
}
