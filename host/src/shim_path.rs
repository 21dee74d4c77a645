//! Where the `sharedos-mcp-shim` binary is, for configs that must name it, and how it is linked.

use std::path::{Path, PathBuf};

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

/// Whether `cargo run` sets `key` for the program it runs (cargo's "environment variables Cargo
/// sets for crates"), as opposed to a setting the person gave cargo (`CARGO_HOME`,
/// `CARGO_TARGET_DIR`, `CARGO_PROFILE_*`, …), which the inner build must keep.
fn set_by_cargo_run(key: &str) -> bool {
    matches!(
        key,
        "CARGO_MANIFEST_DIR"
            | "CARGO_MANIFEST_PATH"
            | "CARGO_MANIFEST_LINKS"
            | "CARGO_CRATE_NAME"
            | "CARGO_BIN_NAME"
            | "CARGO_PRIMARY_PACKAGE"
    ) || key.starts_with("CARGO_PKG_")
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
        // `cargo run` gave this process the variables cargo sets for the program it runs
        // (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, …). Build scripts watch some of them (ring's
        // declares `rerun-if-env-changed=CARGO_MANIFEST_DIR`): inherited, they made this build
        // compile ring, rustls, reqwest, rmcp and the shim's library again, 75 s of a first demo
        // on a two-core machine (BENCHMARKS, time to a first demo). The outer build ran without them.
        for (key, _) in std::env::vars_os() {
            if key.to_str().is_some_and(set_by_cargo_run) {
                cmd.env_remove(key);
            }
        }
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

/// How an executable is linked: the README deploys the shim statically (static-pie).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linking {
    /// No dynamic loader named (no `PT_INTERP` program header).
    Static,
    /// Loaded by `ld.so`, with shared libraries.
    Dynamic,
}

impl Linking {
    pub fn as_str(self) -> &'static str {
        match self {
            Linking::Static => "static",
            Linking::Dynamic => "dynamic",
        }
    }
}

/// Why [`linking`] could not tell.
#[derive(Debug, thiserror::Error)]
pub enum LinkingError {
    #[error("cannot read `{}`", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{}` is not a 64-bit little-endian ELF file", path.display())]
    NotElf { path: PathBuf },
}

/// How the ELF executable at `path` is linked, from its program headers.
pub fn linking(path: &Path) -> Result<Linking, LinkingError> {
    use std::os::unix::fs::FileExt as _;
    let read = |source| LinkingError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let mut header = [0u8; 64];
    file.read_exact_at(&mut header, 0).map_err(read)?;
    // ELF magic, ELFCLASS64, ELFDATA2LSB.
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(LinkingError::NotElf {
            path: path.to_owned(),
        });
    }
    let u16_at = |at: usize| u64::from(u16::from_le_bytes([header[at], header[at + 1]]));
    let mut phoff = [0u8; 8];
    phoff.copy_from_slice(&header[0x20..0x28]);
    let (phoff, entsize, count) = (u64::from_le_bytes(phoff), u16_at(0x36), u16_at(0x38));
    for i in 0..count {
        let mut kind = [0u8; 4];
        file.read_exact_at(&mut kind, phoff + i * entsize)
            .map_err(read)?;
        // PT_INTERP: the program names its loader.
        if u32::from_le_bytes(kind) == 3 {
            return Ok(Linking::Dynamic);
        }
    }
    Ok(Linking::Static)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inner_build_drops_what_cargo_run_set_and_keeps_what_the_person_set() {
        for set in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_BIN_NAME",
        ] {
            assert!(set_by_cargo_run(set), "{set}");
        }
        for kept in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_PROFILE_RELEASE_DEBUG",
            "PATH",
        ] {
            assert!(!set_by_cargo_run(kept), "{kept}");
        }
    }

    #[test]
    fn this_test_binary_is_dynamic_and_a_text_file_is_no_elf() {
        let exe = std::env::current_exe().expect("exe");
        assert_eq!(linking(&exe).expect("linking"), Linking::Dynamic);
        let dir = tempfile::tempdir().expect("tmp");
        let text = dir.path().join("not-elf");
        std::fs::write(&text, "#!/bin/sh\n".repeat(10)).expect("write");
        let err = linking(&text).expect_err("not elf");
        assert!(err.to_string().contains("not-elf"), "{err}");
        let short = dir.path().join("short");
        std::fs::write(&short, b"\x7fELF").expect("write");
        assert!(matches!(linking(&short), Err(LinkingError::Read { .. })));
    }
}
