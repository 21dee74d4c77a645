//! Where the `sharedos-mcp-shim` binary is, for configs that must name it.

use std::path::PathBuf;

/// Why the shim binary was not found.
#[derive(Debug, thiserror::Error)]
pub enum ShimPathError {
    #[error("cannot find this executable")]
    CurrentExe(#[source] std::io::Error),
    #[error("this executable `{}` has no folder", exe.display())]
    NoFolder { exe: PathBuf },
    #[error("cannot run cargo to build the shim")]
    Cargo(#[source] std::io::Error),
    #[error(
        "cannot find the sharedos-mcp-shim binary: build it (`cargo build -p sharedos-mcp-shim`) or set SHAREDOS_SHIM"
    )]
    NotFound,
}

/// Finds the shim binary: `SHAREDOS_SHIM`, next to this executable, or on PATH. Under
/// `cargo run` (which builds only the binary it runs) it builds the shim with the same profile.
pub fn locate_shim() -> Result<PathBuf, ShimPathError> {
    if let Some(p) = std::env::var_os("SHAREDOS_SHIM") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(ShimPathError::CurrentExe)?;
    let Some(dir) = exe.parent() else {
        return Err(ShimPathError::NoFolder { exe });
    };
    // Test binaries live in target/<profile>/deps.
    let candidates = [
        dir.join("sharedos-mcp-shim"),
        dir.join("../sharedos-mcp-shim"),
    ];
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    if let (Some(cargo), Some(manifest)) = (
        std::env::var_os("CARGO"),
        std::env::var_os("CARGO_MANIFEST_DIR"),
    ) {
        let release = dir.file_name().is_some_and(|n| n == "release");
        eprintln!(
            "demo: linking sharedos-mcp-shim (cargo run builds only the broker's binary; the shim's library was built with it)…"
        );
        let mut cmd = std::process::Command::new(cargo);
        // Selecting the broker's CLI package too makes cargo resolve dependency features as it
        // did for `cargo run` (the shim alone resolves fewer, e.g. serde_json without
        // preserve_order, and every crate above them would compile a second time). The broker's
        // CLI lists the shim's library, so `cargo run` has compiled it already: what is left here
        // is the shim's one-line `main` and the link (under a second on a fresh build).
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "sharedos-broker-cli",
            "-p",
            "sharedos-mcp-shim",
            "--bin",
            "sharedos-mcp-shim",
            "--manifest-path",
        ])
        .arg(PathBuf::from(manifest).join("../Cargo.toml"));
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().map_err(ShimPathError::Cargo)?;
        if status.success() && candidates[0].is_file() {
            return Ok(candidates[0].clone());
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("sharedos-mcp-shim");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(ShimPathError::NotFound)
}
