//! What a call touches, as the policy decides on it: a leaf below the policy engine and the
//! providers, which both use it and neither owns it.

use sharedos_proto::Requirement;

/// The Cedar namespace of every entity type.
pub const NAMESPACE: &str = "SharedOS";

/// A resource a call is decided on, built from the call's canonicalized arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Resource {
    /// A file of one provider's space: `namespace` is the provider's (two providers' `/a` are
    /// two files, and a policy can tell them apart with `resource.namespace`).
    File {
        namespace: String,
        path: String,
    },
    Tool {
        name: String,
    },
}

impl Resource {
    pub fn type_name(&self) -> &'static str {
        match self {
            Resource::File { .. } => "File",
            Resource::Tool { .. } => "Tool",
        }
    }

    pub(crate) fn id(&self) -> &str {
        match self {
            Resource::File { path, .. } => path,
            Resource::Tool { name } => name,
        }
    }

    /// `SharedOS::File::"/public/a.txt"`, for people and records.
    pub fn display(&self) -> String {
        let (ty, id) = (self.type_name(), self.id());
        // The common id (printable ASCII, no `"` or backslash) is its own `Debug` text between
        // quotes: written straight, where `{:?}` escapes it a char at a time on every call
        // (bench/NOTES.md). Any other id takes `{:?}`.
        if id
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            let mut s = String::with_capacity(NAMESPACE.len() + ty.len() + id.len() + 6);
            for part in [NAMESPACE, "::", ty, "::\"", id, "\""] {
                s.push_str(part);
            }
            return s;
        }
        format!("{NAMESPACE}::{ty}::{id:?}")
    }

    /// The bare id (`/public/a.txt`), for sentences.
    pub fn short(&self) -> &str {
        self.id()
    }

    /// What a call requires, as answers and record lines carry it: the action, the resource's
    /// [`display`](Self::display) text, and what that text leaves out (a file's namespace).
    pub fn requirement(&self, action: &str) -> Requirement {
        Requirement {
            action: action.to_owned(),
            resource: self.display(),
            namespace: match self {
                Resource::File { namespace, .. } => Some(namespace.clone()),
                Resource::Tool { .. } => None,
            },
        }
    }

    /// The resource a recorded [`Requirement`] names: the inverse of
    /// [`requirement`](Self::requirement).
    pub fn from_requirement(req: &Requirement) -> Result<Self, RequirementError> {
        let rest = req
            .resource
            .strip_prefix(NAMESPACE)
            .and_then(|r| r.strip_prefix("::"))
            .ok_or(RequirementError::Unknown)?;
        let (ty, quoted) = rest.split_once("::").ok_or(RequirementError::Unknown)?;
        let id = unquote(quoted).ok_or(RequirementError::Unknown)?;
        match ty {
            "File" => Ok(Resource::File {
                namespace: req.namespace.clone().ok_or(RequirementError::NoNamespace)?,
                path: id,
            }),
            "Tool" => Ok(Resource::Tool { name: id }),
            _ => Err(RequirementError::Unknown),
        }
    }
}

/// Which object a file resource resolved to, as the filesystem tells objects apart (device and
/// inode): what an approval is bound to, so a path re-pointed or replaced while a person decides
/// is seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Object {
    /// An existing file or folder.
    Existing { dev: u64, ino: u64 },
    /// Nothing there yet; the folder it would be created in (device, inode), when that exists.
    Missing { parent: Option<(u64, u64)> },
}

/// Why a recorded [`Requirement`] names no [`Resource`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequirementError {
    #[error(
        "a file requirement without its namespace (a line written before requirements carried it)"
    )]
    NoNamespace,
    #[error("a resource that is not `SharedOS::File` or `SharedOS::Tool` with a quoted id")]
    Unknown,
}

/// The string a `{:?}` of a `str` made (`"a\"b\u{7f}"`), or `None` if `quoted` is not one.
fn unquote(quoted: &str) -> Option<String> {
    let inner = quoted.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push(match chars.next()? {
                '\\' => '\\',
                '"' => '"',
                '\'' => '\'',
                'n' => '\n',
                'r' => '\r',
                't' => '\t',
                '0' => '\0',
                'u' => {
                    if chars.next()? != '{' {
                        return None;
                    }
                    let mut hex = String::new();
                    loop {
                        match chars.next()? {
                            '}' => break,
                            h => hex.push(h),
                        }
                    }
                    char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?
                }
                _ => return None,
            }),
            // `{:?}` escapes every quote inside.
            '"' => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn file(path: &str) -> Resource {
        Resource::File {
            namespace: "files".into(),
            path: path.into(),
        }
    }

    #[test]
    fn a_requirement_names_its_resource_again() {
        for r in [
            file("/public/a.txt"),
            file("/a \"quoted\" \\ name\n\t\u{7f}\u{301}é'"),
            file(""),
            Resource::Tool {
                name: "plain.read_file".into(),
            },
        ] {
            let req = r.requirement("read");
            assert_eq!(Resource::from_requirement(&req), Ok(r));
        }
        assert_eq!(
            file("/a").requirement("read").namespace.as_deref(),
            Some("files")
        );
        assert_eq!(
            Resource::Tool { name: "t".into() }
                .requirement("call")
                .namespace,
            None
        );
    }

    #[test]
    fn the_written_display_is_the_debug_text() {
        let ids = [
            "/public/a.txt",
            "",
            " ~!#$%&'()*+,-./:;<=>?@[]^_`{|}",
            "/a \"quoted\"",
            "/back\\slash",
            "/tab\there",
            "/del\u{7f}",
            "/é",
            "/e\u{301}",
        ];
        for id in ids {
            for r in [file(id), Resource::Tool { name: id.into() }] {
                let debug = format!("{NAMESPACE}::{}::{:?}", r.type_name(), id);
                assert_eq!(r.display(), debug, "{id:?}");
            }
        }
    }

    #[test]
    fn what_is_not_a_resource_is_refused_with_a_reason() {
        let req = |resource: &str, namespace: Option<&str>| Requirement {
            action: "read".into(),
            resource: resource.into(),
            namespace: namespace.map(str::to_owned),
        };
        let old = Resource::from_requirement(&req("SharedOS::File::\"/a\"", None));
        assert_eq!(old, Err(RequirementError::NoNamespace));
        for text in [
            "SharedOS::Folder::\"/a\"",
            "Other::File::\"/a\"",
            "SharedOS::File::/a",
            "SharedOS::File::\"/a",
            "SharedOS::File::\"a\"b\"",
            "SharedOS::File::\"\\q\"",
            "SharedOS::File::\"\\u{110000}\"",
            "SharedOS::File::\"\\u{41\"",
            "SharedOS::File",
        ] {
            let r = Resource::from_requirement(&req(text, Some("files")));
            assert_eq!(r, Err(RequirementError::Unknown), "{text}");
        }
    }

    proptest! {
        #[test]
        fn any_path_comes_back(path in any::<String>()) {
            let r = file(&path);
            prop_assert_eq!(Resource::from_requirement(&r.requirement("read")), Ok(r));
        }
    }
}
