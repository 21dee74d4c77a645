//! Fuzzes virtual-path canonicalization (`sharedos_broker::files::vpath::canonicalize`) on arbitrary
//! UTF-8 strings (inputs that are not UTF-8 are skipped).
//!
//! - Never panics.
//! - `Ok(c)`: `c` starts with `/`, has no `//`, no `.` or `..` component, no trailing `/` (unless
//!   `c == "/"`), no NUL, is no longer than the input, and is a fixed point:
//!   `canonicalize(c) == Ok(c)`.
//! - The outcome matches an independent model: `TooLong` above `MAX_PATH_BYTES`, then `Nul`, then
//!   `NotAbsolute`, then `EscapesRoot` exactly when a `..` climbs above `/` (depth count). So an
//!   absolute, short, NUL-free input without a `..` component is always `Ok`, and then `c` is `/`
//!   followed by the input's non-empty, non-`.` components joined by `/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sharedos_broker::files::vpath::{MAX_PATH_BYTES, VPathError, canonicalize, components};

/// Invariants of a canonical path.
fn assert_canonical(raw: &str, c: &str) {
    assert!(c.starts_with('/'), "{raw:?} -> {c:?}: not absolute");
    assert!(!c.contains("//"), "{raw:?} -> {c:?}: contains //");
    assert!(!c.contains('\0'), "{raw:?} -> {c:?}: contains NUL");
    assert!(
        c == "/" || !c.ends_with('/'),
        "{raw:?} -> {c:?}: trailing /"
    );
    assert!(
        c.split('/').all(|p| p != "." && p != ".."),
        "{raw:?} -> {c:?}: has a . or .. component"
    );
    assert!(
        c.len() <= raw.len(),
        "{raw:?} -> {c:?}: longer than the input"
    );
    assert_eq!(
        components(c).collect::<Vec<_>>(),
        c.split('/')
            .skip(1)
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>(),
        "components({c:?})"
    );
    assert_eq!(
        canonicalize(c).as_deref(),
        Ok(c),
        "{raw:?} -> {c:?}: not idempotent"
    );
}

/// Whether some `..` climbs above `/` (independent depth count).
fn escapes(raw: &str) -> bool {
    let mut depth: usize = 0;
    for part in raw.split('/') {
        match part {
            "" | "." => {}
            ".." => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return true,
            },
            _ => depth += 1,
        }
    }
    false
}

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let result = canonicalize(raw);

    // The error a path gets, in the order the checks are documented.
    if raw.len() > MAX_PATH_BYTES {
        assert_eq!(result, Err(VPathError::TooLong(raw.len())), "{raw:?}");
        return;
    }
    if raw.contains('\0') {
        assert_eq!(result, Err(VPathError::Nul), "{raw:?}");
        return;
    }
    if !raw.starts_with('/') {
        assert!(
            matches!(result, Err(VPathError::NotAbsolute(_))),
            "{raw:?} -> {result:?}: expected NotAbsolute"
        );
        return;
    }
    if escapes(raw) {
        assert!(
            matches!(result, Err(VPathError::EscapesRoot(_))),
            "{raw:?} -> {result:?}: expected EscapesRoot"
        );
        return;
    }
    let c = match result {
        Ok(c) => c,
        Err(e) => panic!("{raw:?}: absolute, short, NUL-free, not escaping, but {e:?}"),
    };
    assert_canonical(raw, &c);

    // Without `..`, canonicalization only drops empty and `.` components.
    if raw.split('/').all(|p| p != "..") {
        let kept: Vec<&str> = raw
            .split('/')
            .filter(|p| !p.is_empty() && *p != ".")
            .collect();
        assert_eq!(c, format!("/{}", kept.join("/")), "{raw:?}");
    }
});
