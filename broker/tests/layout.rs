//! The broker's floors (`lib.rs`, `# Layout`), checked: every `crate::` path in a module's code
//! (tests aside) names a module on a lower floor. An import that points up or sideways fails here.
//! The rooms (`evidence/`, `files/`) group a concern, not a floor: each file in a room stands on
//! a floor of its own (`evidence::record`), and the room's `mod.rs` on the room's name.

#![allow(
    clippy::expect_used,
    reason = "a test target: an unreadable tree fails the test loudly"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Module → floor, top (1) to bottom, as `lib.rs` lists them. Within floor 6, the providers stand
/// above their own helpers (`beneath`, `vpath`, `pins`).
const FLOORS: &[(&str, f32)] = &[
    ("server", 1.0),
    ("bridge", 2.0),
    ("control", 2.0),
    ("page", 2.0),
    ("state", 3.0),
    ("admission", 3.0),
    ("assemble", 4.0),
    ("error", 4.5),
    ("turn", 4.0),
    ("kernel", 5.0),
    ("evidence", 5.0),
    ("evidence::replay", 5.0),
    ("files", 6.0),
    ("upstream", 6.0),
    ("files::beneath", 6.5),
    ("files::vpath", 6.5),
    ("pins", 6.5),
    ("provider", 7.0),
    ("budget", 7.5),
    ("approval", 7.5),
    ("policy", 8.0),
    ("config", 8.0),
    ("evidence::chain", 8.5),
    ("evidence::record", 9.0),
    ("resource", 9.0),
    ("telemetry", 9.0),
    ("secrets", 9.0),
    ("sync", 9.5),
    ("trusted", 9.5),
    ("lineage", 9.5),
    ("evidence::witness", 9.5),
    ("child", 9.75),
];

/// Folders whose files each stand on a floor of their own.
const ROOMS: &[&str] = &["evidence", "files"];

/// The module names after `crate::` in `code`: `room::file` for a file in a room.
fn crate_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    code.match_indices("crate::")
        .map(|(i, m)| {
            let rest = &code[i + m.len()..];
            let first = ident(rest);
            if ROOMS.contains(&first.as_str())
                && let Some(tail) = rest[first.len()..].strip_prefix("::")
            {
                let second = ident(tail);
                let inner = format!("{first}::{second}");
                if FLOORS.iter().any(|(m, _)| *m == inner) {
                    return inner;
                }
            }
            first
        })
        .collect()
}

/// The modules of `src`: a file, a folder standing on one floor (`upstream/`), or each file of a
/// room on its own (`files/mod.rs` is `files`, `files/beneath.rs` is `files::beneath`).
fn modules(src: &Path) -> Vec<(String, Vec<PathBuf>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(src).expect("src") {
        let path = entry.expect("entry").path();
        let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else {
            continue;
        };
        if name == "lib" {
            continue;
        }
        if !path.is_dir() {
            out.push((name, vec![path]));
            continue;
        }
        let files: Vec<PathBuf> = std::fs::read_dir(&path)
            .expect("module folder")
            .map(|f| f.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        if !ROOMS.contains(&name.as_str()) {
            out.push((name, files));
            continue;
        }
        for file in files {
            let stem = file
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default();
            let module = if stem == "mod" {
                name.clone()
            } else {
                format!("{name}::{stem}")
            };
            out.push((module, vec![file]));
        }
    }
    out
}

#[test]
fn every_import_points_down() {
    let floors: BTreeMap<&str, f32> = FLOORS.iter().copied().collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = Vec::new();
    let mut wrong = Vec::new();
    for (module, paths) in modules(&src) {
        let module = module.as_str();
        let floor = *floors
            .get(module)
            .unwrap_or_else(|| panic!("`{module}` has no floor: add it to lib.rs and to FLOORS"));
        seen.push(module.to_owned());
        let mut code = String::new();
        for file in &paths {
            let text = std::fs::read_to_string(file).expect("read");
            code.push_str(text.split("#[cfg(test)]").next().unwrap_or_default());
            code.push('\n');
        }
        for used in crate_paths(&code) {
            let used = if used == "lock" {
                "sync".to_owned()
            } else {
                used
            };
            let Some(&below) = floors.get(used.as_str()) else {
                continue; // a re-export at the root (`crate::Config`) or not a module
            };
            if used != module && below <= floor {
                wrong.push(format!(
                    "{module} (floor {floor}) uses {used} (floor {below})"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that do not point down: {wrong:#?}"
    );
    assert_eq!(
        seen.len(),
        FLOORS.len(),
        "a module of FLOORS is gone: {seen:?}"
    );
}
