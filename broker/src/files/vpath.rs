//! Virtual paths: the canonical form a file resource has before the policy sees it.
//!
//! Absolute, no NUL, `//` and `.` collapsed, `..` resolved lexically, no trailing `/`. A path
//! that would climb above `/` cannot be resolved (a denial, never a clamp: `/../etc` is not `/etc`).
//! Cedar's `like` is byte-exact, so every spelling of one file must reach it as one string.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VPathError {
    #[error("path `{0}` is not absolute (it must start with `/`)")]
    NotAbsolute(String),
    #[error("path contains a NUL byte")]
    Nul,
    #[error("path `{0}` escapes the root")]
    EscapesRoot(String),
    #[error("path is {0} bytes long; the limit is {MAX_PATH_BYTES}")]
    TooLong(usize),
}

/// Longest virtual path accepted.
pub const MAX_PATH_BYTES: usize = 4096;

/// Canonicalizes a virtual path (see module docs).
pub fn canonicalize(raw: &str) -> Result<String, VPathError> {
    if raw.len() > MAX_PATH_BYTES {
        return Err(VPathError::TooLong(raw.len()));
    }
    if raw.contains('\0') {
        return Err(VPathError::Nul);
    }
    if !raw.starts_with('/') {
        return Err(VPathError::NotAbsolute(sharedos_proto::name::shown(raw)));
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in raw.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(VPathError::EscapesRoot(sharedos_proto::name::shown(raw)));
                }
            }
            other => parts.push(other),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// The components of a canonical path (empty for `/`).
pub fn components(canonical: &str) -> impl Iterator<Item = &str> {
    canonical.split('/').filter(|p| !p.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cases() {
        assert_eq!(
            canonicalize("/public/a.txt").as_deref(),
            Ok("/public/a.txt")
        );
        assert_eq!(
            canonicalize("//public//./a.txt/").as_deref(),
            Ok("/public/a.txt")
        );
        assert_eq!(
            canonicalize("/public/../private/secret.txt").as_deref(),
            Ok("/private/secret.txt")
        );
        assert_eq!(canonicalize("/").as_deref(), Ok("/"));
        assert_eq!(canonicalize("/a/..").as_deref(), Ok("/"));
        assert!(matches!(
            canonicalize("/../etc/passwd"),
            Err(VPathError::EscapesRoot(_))
        ));
        assert!(matches!(
            canonicalize("/a/../../b"),
            Err(VPathError::EscapesRoot(_))
        ));
        assert!(matches!(
            canonicalize("public/a"),
            Err(VPathError::NotAbsolute(_))
        ));
        assert!(matches!(canonicalize(""), Err(VPathError::NotAbsolute(_))));
        assert!(matches!(canonicalize("/a\0b"), Err(VPathError::Nul)));
        assert_eq!(canonicalize("/a/...").as_deref(), Ok("/a/..."));
    }

    proptest! {
        #[test]
        fn canonical_form_is_a_fixed_point(raw in "(/|[a-z]{1,3}|\\.|\\.\\.){0,12}") {
            if let Ok(c) = canonicalize(&raw) {
                prop_assert!(c.starts_with('/'));
                prop_assert!(!c.contains("//"));
                prop_assert!(c == "/" || !c.ends_with('/'));
                prop_assert!(components(&c).all(|p| p != "." && p != ".."));
                prop_assert_eq!(canonicalize(&c), Ok(c.clone()));
            }
        }
    }
}
