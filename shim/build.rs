//! Two link options for the shim, whose resident memory is mostly its own code and data (each of
//! the many shims a host runs keeps them; bench/NOTES.md):
//!
//! - Packed relative relocations (DT_RELR, `ld -z pack-relative-relocs`). A
//!   position-independent shim otherwise carries about 280 KB of them, read at every start (a
//!   static-pie shim applies them to itself): peak RSS 3.94 -> 3.69 MiB. Only on Linux with
//!   glibc, whose loader and static start read DT_RELR (2.36 and later; binutils 2.38 and later
//!   write it).
//! - In release builds linked by lld, the functions a session runs first in `.text`
//!   (`hot-functions.txt`, written by bench/shim-order.py): the kernel maps code 64 KiB around
//!   each fault, and with those functions spread over all of `.text` nearly all of it became
//!   resident. Only where lld links: rustc's own on x86_64 Linux with glibc since 1.90, unless the
//!   flags say otherwise (GNU ld does not know the option). A name the list has and the shim does
//!   not (another toolchain, Cargo.lock or profile) is skipped without a warning.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=hot-functions.txt");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ENV") != "gnu" {
        return;
    }
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    if var("PROFILE") == "release" && var("CARGO_CFG_TARGET_ARCH") == "x86_64" && links_with_lld() {
        let list = std::path::Path::new(&var("CARGO_MANIFEST_DIR")).join("hot-functions.txt");
        if list.is_file() {
            println!(
                "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
                list.display()
            );
            println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
            // The list's content in what cargo sees of this script's output, so that a new list
            // links the binary again (the link argument, its path, stays the same).
            let bytes = std::fs::read(&list).unwrap_or_default();
            let fnv = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
            });
            println!("cargo:rustc-env=SHAREDOS_SHIM_HOT_FUNCTIONS={fnv:016x}");
        }
    }
}

/// rustc 1.90 and later link x86_64 Linux glibc targets with their own lld, unless the flags
/// choose the linker's features or its self-containment.
fn links_with_lld() -> bool {
    let flags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    if flags.contains("linker-features") || flags.contains("link-self-contained") {
        return false;
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(out) = std::process::Command::new(rustc).arg("-vV").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let minor = text
        .lines()
        .find_map(|l| l.strip_prefix("release: "))
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    minor.is_some_and(|m| m >= 90)
}
