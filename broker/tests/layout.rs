//! The broker's floors (`lib.rs`, `# Layout`), checked: every `crate::` path in a module's code
//! (tests aside) names a module on a lower floor. An import that points up or sideways fails here.

use std::collections::BTreeMap;
use std::path::Path;

/// Module → floor, top (1) to bottom, as `lib.rs` lists them. Within floor 6, the providers stand
/// above their own helpers (`beneath`, `vpath`, `pins`).
const FLOORS: &[(&str, f32)] = &[
    ("server", 1.0),
    ("bridge", 2.0),
    ("control", 2.0),
    ("state", 3.0),
    ("admission", 3.0),
    ("assemble", 4.0),
    ("error", 4.5),
    ("turn", 4.0),
    ("kernel", 5.0),
    ("replay", 5.0),
    ("files", 6.0),
    ("upstream", 6.0),
    ("beneath", 6.5),
    ("vpath", 6.5),
    ("pins", 6.5),
    ("provider", 7.0),
    ("budget", 7.5),
    ("approval", 7.5),
    ("policy", 8.0),
    ("config", 8.0),
    ("chain", 8.5),
    ("record", 9.0),
    ("resource", 9.0),
    ("telemetry", 9.0),
    ("secrets", 9.0),
    ("sync", 9.5),
    ("trusted", 9.5),
    ("lineage", 9.5),
    ("witness", 9.5),
    ("child", 9.75),
];

/// The module names after `crate::` in `code`.
fn crate_paths(code: &str) -> Vec<String> {
    code.match_indices("crate::")
        .map(|(i, m)| {
            code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn every_import_points_down() {
    let floors: BTreeMap<&str, f32> = FLOORS.iter().copied().collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = Vec::new();
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&src).expect("src") {
        let path = entry.expect("entry").path();
        let Some(module) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if module == "lib" {
            continue;
        }
        let floor = *floors
            .get(module)
            .unwrap_or_else(|| panic!("`{module}` has no floor: add it to lib.rs and to FLOORS"));
        seen.push(module.to_owned());
        let mut paths = Vec::new();
        if path.is_dir() {
            // A module that is a folder (`upstream/`): every file in it stands on its floor.
            for file in std::fs::read_dir(&path).expect("module folder") {
                paths.push(file.expect("entry").path());
            }
        } else {
            paths.push(path.clone());
        }
        let mut code = String::new();
        for file in paths
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        {
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
