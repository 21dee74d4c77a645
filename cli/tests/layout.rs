//! The CLI's modules stand on floors, as the broker's do (`broker/tests/layout.rs`): every
//! `crate::` path in a module's code names a module on a lower floor, so no two modules import
//! each other. `output` (the write-out macros) is at the bottom, `cli` (the command line) at the
//! top, `demo` and `replay` between them.

use std::path::Path;

/// Module → floor, top (1) to bottom.
const FLOORS: &[(&str, u8)] = &[
    ("main", 0),
    ("cli", 1),
    ("demo", 2),
    ("replay", 2),
    ("output", 3),
];

#[test]
fn every_import_points_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let floor = |m: &str| FLOORS.iter().find(|(n, _)| *n == m).map(|(_, f)| *f);
    let mut wrong = Vec::new();
    let mut seen = 0;
    for entry in std::fs::read_dir(&src).expect("src") {
        let path = entry.expect("entry").path();
        let module = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a module name")
            .to_owned();
        let here =
            floor(&module).unwrap_or_else(|| panic!("`{module}` has no floor: add it to FLOORS"));
        seen += 1;
        let text = std::fs::read_to_string(&path).expect("read");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for (i, m) in code.match_indices("crate::") {
            let used: String = code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if let Some(below) = floor(&used)
                && used != module
                && below <= here
            {
                wrong.push(format!(
                    "{module} (floor {here}) uses {used} (floor {below})"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that do not point down: {wrong:#?}"
    );
    assert_eq!(seen, FLOORS.len(), "a module of FLOORS is gone");
}
