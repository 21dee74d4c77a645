//! Packs the binary's relative relocations (DT_RELR, `ld -z pack-relative-relocs`). A
//! position-independent shim otherwise carries about 280 KB of them, read at every start (a
//! static-pie shim applies them to itself), and each of the many shims a host runs keeps them
//! resident: peak RSS 3.94 -> 3.69 MiB (bench/NOTES.md). Only on Linux with glibc, whose loader
//! and static start read DT_RELR (2.36 and later; binutils 2.38 and later write it).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
