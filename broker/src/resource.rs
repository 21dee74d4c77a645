//! What a call touches, as the policy decides on it: a leaf below the policy engine and the
//! providers, which both use it and neither owns it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::Value;
use sharedos_proto::Requirement;

/// The Cedar namespace of every entity type.
pub const NAMESPACE: &str = "SharedOS";

/// The types of this namespace the broker makes itself: an `entity` template names none of them.
pub const BUILT_IN_TYPES: [&str; 5] = ["User", "Agent", "File", "Tool", "Url"];

/// A resource a call is decided on, built from the call's canonicalized arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// A URL, as [`WebUrl::parse`] reads it (a `url` template).
    Url(WebUrl),
    /// An entity of a type the operator's schema declares (an `entity` template): `type_name`
    /// as [`entity_type`] writes it (`Github::Repo`, or `Channel` for `SharedOS::Channel`),
    /// attributes as JSON values Cedar can hold.
    Entity {
        type_name: String,
        id: String,
        attributes: BTreeMap<String, Value>,
    },
}

/// An entity type as the broker names it: `SharedOS::X` (a type of the broker's namespace) as
/// `X`, any other qualified name as it is. A name without `::` is in the SharedOS namespace.
pub fn entity_type(ty: &str) -> &str {
    ty.strip_prefix(NAMESPACE)
        .and_then(|r| r.strip_prefix("::"))
        .filter(|r| !r.contains("::"))
        .unwrap_or(ty)
}

impl Resource {
    /// The entity type: `File`, `Tool`, `Url` (of the SharedOS namespace), or an `entity`
    /// template's type (see [`entity_type`]).
    pub fn type_name(&self) -> &str {
        match self {
            Resource::File { .. } => "File",
            Resource::Tool { .. } => "Tool",
            Resource::Url(_) => "Url",
            Resource::Entity { type_name, .. } => type_name,
        }
    }

    /// Every resource of this kind has the same attribute types (a `File`, a `Tool`): one that
    /// passed schema validation stands for all. A `Url`'s `ip` comes and goes, an entity's
    /// attributes come from arguments.
    pub fn fixed_shape(&self) -> bool {
        matches!(self, Resource::File { .. } | Resource::Tool { .. })
    }

    pub(crate) fn id(&self) -> &str {
        match self {
            Resource::File { path, .. } => path,
            Resource::Tool { name } => name,
            Resource::Url(u) => &u.id,
            Resource::Entity { id, .. } => id,
        }
    }

    /// `SharedOS::File::"/public/a.txt"`, for people and records.
    pub fn display(&self) -> String {
        let (ty, id) = (self.type_name(), self.id());
        // An operator's type (`Github::Repo`) is written as it is; ours take the namespace.
        let ns: &[&str] = if ty.contains("::") {
            &[]
        } else {
            &[NAMESPACE, "::"]
        };
        // The common id (printable ASCII, no `"` or backslash) is its own `Debug` text between
        // quotes: written straight, where `{:?}` escapes it a char at a time on every call
        // (bench/NOTES.md). Any other id takes `{:?}`.
        if id
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            let mut s = String::with_capacity(NAMESPACE.len() + ty.len() + id.len() + 6);
            for part in ns.iter().copied().chain([ty, "::\"", id, "\""]) {
                s.push_str(part);
            }
            return s;
        }
        format!("{}{ty}::{id:?}", ns.concat())
    }

    /// The bare id (`/public/a.txt`), for sentences.
    pub fn short(&self) -> &str {
        self.id()
    }

    /// What a call requires, as answers and record lines carry it: the action, the resource's
    /// [`display`](Self::display) text, and what that text leaves out (a file's namespace, an
    /// entity's attributes; a URL's attributes are read again from its text).
    pub fn requirement(&self, action: &str) -> Requirement {
        Requirement {
            action: action.to_owned(),
            resource: self.display(),
            namespace: match self {
                Resource::File { namespace, .. } => Some(namespace.clone()),
                _ => None,
            },
            attributes: match self {
                Resource::Entity { attributes, .. } => Some(Box::new(
                    attributes
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                )),
                _ => None,
            },
        }
    }

    /// The resource a recorded [`Requirement`] names: the inverse of
    /// [`requirement`](Self::requirement).
    pub fn from_requirement(req: &Requirement) -> Result<Self, RequirementError> {
        // A type name holds no `"`: the id's quote follows the first `::"`.
        let at = req.resource.find("::\"").ok_or(RequirementError::Unknown)?;
        let (full, quoted) = (&req.resource[..at], &req.resource[at + 2..]);
        let id = unquote(quoted).ok_or(RequirementError::Unknown)?;
        // An entity of the operator's type carries its attributes (perhaps none).
        if let Some(attributes) = &req.attributes {
            let ty = entity_type(full);
            if ty.is_empty() || BUILT_IN_TYPES.contains(&ty) {
                return Err(RequirementError::Unknown);
            }
            return Ok(Resource::Entity {
                type_name: ty.to_owned(),
                id,
                attributes: attributes
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            });
        }
        let ty = full
            .strip_prefix(NAMESPACE)
            .and_then(|r| r.strip_prefix("::"))
            .ok_or(RequirementError::Unknown)?;
        match ty {
            "File" => Ok(Resource::File {
                namespace: req.namespace.clone().ok_or(RequirementError::NoNamespace)?,
                path: id,
            }),
            "Tool" => Ok(Resource::Tool { name: id }),
            // Only a URL already in its canonical form is one the broker recorded.
            "Url" => match WebUrl::parse(&id) {
                Ok((u, _)) if u.id == id => Ok(Resource::Url(u)),
                _ => Err(RequirementError::Unknown),
            },
            _ => Err(RequirementError::Unknown),
        }
    }
}

/// The URL schemes whose hosts the WHATWG parser normalizes (lower case, IDNA, IPv4 in every
/// spelling) and whose default ports it knows. Another scheme's host is opaque text.
pub const URL_SCHEMES: [&str; 5] = ["http", "https", "ws", "wss", "ftp"];

/// A URL as the policy decides on it (`SharedOS::Url {scheme, host, port, path, ip?}`), read
/// by the WHATWG URL parser that HTTP clients use.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WebUrl {
    /// The canonical URL without its userinfo, query and fragment: the entity's id.
    pub id: String,
    pub scheme: String,
    /// Lower case, IDNA applied (`xn--`), trailing dots removed; an IP address in its usual
    /// text (IPv6 without brackets), an IPv4-mapped IPv6 address as the IPv4 one.
    pub host: String,
    /// The port, the scheme's default when the URL gives none.
    pub port: u16,
    /// The path as sent (percent-encoded, `.` and `..` segments resolved).
    pub path: String,
    /// The host when it is an IP address (Cedar's `ipaddr`).
    pub ip: Option<IpAddr>,
}

impl WebUrl {
    /// Reads `text` as a URL: the resource, and the whole URL written canonically (userinfo,
    /// query and fragment kept), which is what an upstream should be sent so that it fetches
    /// what was decided on, whatever parser it uses.
    pub fn parse(text: &str) -> Result<(WebUrl, String), String> {
        let shown = || sharedos_proto::name::shown(text);
        let mut url =
            url::Url::parse(text).map_err(|e| format!("`{}` is not a URL: {e}", shown()))?;
        let scheme = url.scheme().to_owned();
        if !URL_SCHEMES.contains(&scheme.as_str()) {
            return Err(format!(
                "`{}`: scheme `{scheme}` is not one the broker reads hosts of ({})",
                shown(),
                URL_SCHEMES.join(", ")
            ));
        }
        // Trailing dots name the same host: written without them, for the policy and upstream.
        if let Some(url::Host::Domain(d)) = url.host()
            && d.ends_with('.')
        {
            let trimmed = d.trim_end_matches('.').to_owned();
            if trimmed.is_empty() {
                return Err(format!("`{}` has no host", shown()));
            }
            url.set_host(Some(&trimmed))
                .map_err(|e| format!("`{}`: host `{trimmed}`: {e}", shown()))?;
        }
        // An IPv4-mapped IPv6 address reaches the IPv4 one: written as that.
        if let Some(url::Host::Ipv6(a)) = url.host()
            && let Some(v4) = a.to_ipv4_mapped()
        {
            url.set_ip_host(IpAddr::V4(v4))
                .map_err(|()| format!("`{}`: its host cannot be written back", shown()))?;
        }
        let (host, ip) = match url.host() {
            None => return Err(format!("`{}` has no host", shown())),
            Some(url::Host::Ipv4(a)) => (a.to_string(), Some(IpAddr::V4(a))),
            Some(url::Host::Ipv6(a)) => (a.to_string(), Some(IpAddr::V6(a))),
            Some(url::Host::Domain(d)) => (d.to_owned(), None),
        };
        if host.is_empty() {
            return Err(format!("`{}` has no host", shown()));
        }
        let port = url
            .port_or_known_default()
            .ok_or_else(|| format!("`{}` has no port", shown()))?;
        let whole = url.as_str().to_owned();
        let mut bare = url;
        // A special URL always has a host, so its userinfo can be cleared.
        let _ = bare.set_username("");
        let _ = bare.set_password(None);
        bare.set_query(None);
        bare.set_fragment(None);
        Ok((
            WebUrl {
                id: bare.as_str().to_owned(),
                path: bare.path().to_owned(),
                scheme,
                host,
                port,
                ip,
            },
            whole,
        ))
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
    #[error(
        "a resource that is not `SharedOS::File`, `SharedOS::Tool` or `SharedOS::Url` (in its canonical form) with a quoted id, nor an entity with its attributes"
    )]
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
            attributes: None,
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

        /// Whatever a URL reads as, its id reads as the same URL again (the record keeps only
        /// the id), and so does the canonical text an upstream is sent.
        #[test]
        fn a_url_read_once_reads_the_same_again(
            text in "(https?|wss?|ftp|HTTP)://[a-zA-Z0-9.\\-@:%\\[\\]]{0,24}(/[a-zA-Z0-9.%/?#]{0,16})?"
        ) {
            if let Ok((u, whole)) = WebUrl::parse(&text) {
                prop_assert_eq!(&WebUrl::parse(&u.id).map(|p| p.0), &Ok(u.clone()));
                prop_assert_eq!(WebUrl::parse(&whole).map(|p| p.0), Ok(u.clone()));
                let r = Resource::Url(u);
                prop_assert_eq!(Resource::from_requirement(&r.requirement("fetch")), Ok(r));
            }
        }
    }

    /// Every spelling of issue 44: what the policy sees of each, and what an upstream is sent.
    #[test]
    fn urls_read_as_the_policy_sees_them() {
        let v4 = |a: [u8; 4]| Some(IpAddr::from(a));
        // (text, host, port, path, ip, id)
        type Row<'a> = (&'a str, &'a str, u16, &'a str, Option<IpAddr>, &'a str);
        let table: &[Row] = &[
            (
                "http://docs.example.com/a",
                "docs.example.com",
                80,
                "/a",
                None,
                "http://docs.example.com/a",
            ),
            (
                "HTTP://Docs.Example.COM./a",
                "docs.example.com",
                80,
                "/a",
                None,
                "http://docs.example.com/a",
            ),
            (
                "http://DOCS.EXAMPLE.COM.../",
                "docs.example.com",
                80,
                "/",
                None,
                "http://docs.example.com/",
            ),
            (
                "https://docs.example.com:443/x?q=1#f",
                "docs.example.com",
                443,
                "/x",
                None,
                "https://docs.example.com/x",
            ),
            (
                "https://docs.example.com:8443",
                "docs.example.com",
                8443,
                "/",
                None,
                "https://docs.example.com:8443/",
            ),
            (
                "http://docs.example.com/a/../b/./c",
                "docs.example.com",
                80,
                "/b/c",
                None,
                "http://docs.example.com/b/c",
            ),
            (
                "http://docs.example.com/public/%2e%2e/private",
                "docs.example.com",
                80,
                "/private",
                None,
                "http://docs.example.com/private",
            ),
            (
                "http://docs.example.com/a/%2E./b",
                "docs.example.com",
                80,
                "/b",
                None,
                "http://docs.example.com/b",
            ),
            // IDNA: a name in Unicode is its `xn--` form; fullwidth letters are the ASCII ones.
            (
                "https://Bücher.example/",
                "xn--bcher-kva.example",
                443,
                "/",
                None,
                "https://xn--bcher-kva.example/",
            ),
            (
                "http://ｌｏｃａｌｈｏｓｔ:8080/",
                "localhost",
                8080,
                "/",
                None,
                "http://localhost:8080/",
            ),
            (
                "http://%6C%6Fcalhost/",
                "localhost",
                80,
                "/",
                None,
                "http://localhost/",
            ),
            (
                "http://%31%32%37.0.0.1/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            // Userinfo is never the host, and never in the id.
            (
                "http://docs.example@127.0.0.1/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://docs.example.com:80@169.254.169.254/",
                "169.254.169.254",
                80,
                "/",
                v4([169, 254, 169, 254]),
                "http://169.254.169.254/",
            ),
            (
                "http://user:pw@docs.example.com/",
                "docs.example.com",
                80,
                "/",
                None,
                "http://docs.example.com/",
            ),
            // `\` ends the authority of a special URL: what follows is the path.
            (
                "http://docs.example.com\\@127.0.0.1/",
                "docs.example.com",
                80,
                "/@127.0.0.1/",
                None,
                "http://docs.example.com/@127.0.0.1/",
            ),
            // IPv4 in every spelling.
            (
                "http://127.0.0.1:8080/",
                "127.0.0.1",
                8080,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1:8080/",
            ),
            (
                "http://2130706433/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://0x7f000001/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://0x7f.1/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://0177.0.0.1/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://127.1/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://127.0.0.1./",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://0/",
                "0.0.0.0",
                80,
                "/",
                v4([0, 0, 0, 0]),
                "http://0.0.0.0/",
            ),
            (
                "http://169.254.169.254/latest/meta-data/",
                "169.254.169.254",
                80,
                "/latest/meta-data/",
                v4([169, 254, 169, 254]),
                "http://169.254.169.254/latest/meta-data/",
            ),
            (
                "http://0xA9FEA9FE/",
                "169.254.169.254",
                80,
                "/",
                v4([169, 254, 169, 254]),
                "http://169.254.169.254/",
            ),
            (
                "http://2852039166/",
                "169.254.169.254",
                80,
                "/",
                v4([169, 254, 169, 254]),
                "http://169.254.169.254/",
            ),
            // IPv6, and IPv4-mapped IPv6 as the IPv4 address it reaches.
            (
                "http://[::1]:8080/",
                "::1",
                8080,
                "/",
                Some(IpAddr::from([0, 0, 0, 0, 0, 0, 0, 1u16])),
                "http://[::1]:8080/",
            ),
            (
                "http://[0:0:0:0:0:0:0:1]/",
                "::1",
                80,
                "/",
                Some(IpAddr::from([0, 0, 0, 0, 0, 0, 0, 1u16])),
                "http://[::1]/",
            ),
            (
                "http://[::ffff:127.0.0.1]/",
                "127.0.0.1",
                80,
                "/",
                v4([127, 0, 0, 1]),
                "http://127.0.0.1/",
            ),
            (
                "http://[::FFFF:a9fe:a9fe]:81/",
                "169.254.169.254",
                81,
                "/",
                v4([169, 254, 169, 254]),
                "http://169.254.169.254:81/",
            ),
            // Default ports of every scheme read.
            (
                "ws://example.com/s",
                "example.com",
                80,
                "/s",
                None,
                "ws://example.com/s",
            ),
            (
                "wss://example.com/s",
                "example.com",
                443,
                "/s",
                None,
                "wss://example.com/s",
            ),
            (
                "ftp://example.com/f",
                "example.com",
                21,
                "/f",
                None,
                "ftp://example.com/f",
            ),
        ];
        for (text, host, port, path, ip, id) in table {
            let (u, whole) = WebUrl::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(
                (
                    u.host.as_str(),
                    u.port,
                    u.path.as_str(),
                    u.ip,
                    u.id.as_str()
                ),
                (*host, *port, *path, *ip, *id),
                "{text}"
            );
            // What an upstream is sent reads as the same URL, by any parser: the canonical text.
            assert_eq!(WebUrl::parse(&whole).map(|p| p.0), Ok(u.clone()), "{text}");
            assert_eq!(
                WebUrl::parse(&whole).map(|p| p.1),
                Ok(whole.clone()),
                "{text}"
            );
            let r = Resource::Url(u);
            assert_eq!(r.display(), format!("SharedOS::Url::{id:?}"));
            assert_eq!(
                Resource::from_requirement(&r.requirement("fetch")),
                Ok(r.clone())
            );
        }
        // The query, fragment and userinfo are kept in what is sent, not in the id.
        let (_, whole) = WebUrl::parse("HTTP://u:p@Docs.Example.COM.:80/a?q=1#f").expect("url");
        assert_eq!(whole, "http://u:p@docs.example.com/a?q=1#f");
        // A look-alike name is another name.
        let (u, _) = WebUrl::parse("http://l\u{43e}calhost/").expect("url");
        assert!(
            u.host.starts_with("xn--") && u.host != "localhost",
            "{}",
            u.host
        );
        for (text, why) in [
            ("docs.example.com/a", "is not a URL"),
            ("/relative", "is not a URL"),
            ("", "is not a URL"),
            ("http://", "is not a URL"),
            ("http://[::1/", "is not a URL"),
            ("http://exa mple.com/", "is not a URL"),
            ("file:///etc/passwd", "scheme `file`"),
            ("gopher://example.com/", "scheme `gopher`"),
            ("javascript:alert(1)", "scheme `javascript`"),
            ("mailto:a@example.com", "scheme `mailto`"),
            ("http://.../", "no host"),
        ] {
            let e = WebUrl::parse(text).expect_err(text);
            assert!(e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn an_entity_names_its_type_and_attributes_again() {
        let e = |ty: &str, attributes: Value| Resource::Entity {
            type_name: ty.into(),
            id: "octo/hello".into(),
            attributes: attributes
                .as_object()
                .expect("object")
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        for r in [
            e(
                "Github::Repo",
                serde_json::json!({"owner": "octo", "stars": 3, "topics": ["a"], "meta": {"private": true}}),
            ),
            e("Channel", serde_json::json!({})),
            e("A::B::C", serde_json::json!({"x": "\"quoted\" \\"})),
        ] {
            let req = r.requirement("write");
            assert!(req.attributes.is_some() && req.namespace.is_none());
            assert_eq!(Resource::from_requirement(&req), Ok(r));
        }
        assert_eq!(
            e("Channel", serde_json::json!({})).display(),
            "SharedOS::Channel::\"octo/hello\""
        );
        assert_eq!(
            e("Github::Repo", serde_json::json!({})).display(),
            "Github::Repo::\"octo/hello\""
        );
        assert_eq!(entity_type("SharedOS::Channel"), "Channel");
        assert_eq!(entity_type("SharedOS::A::B"), "SharedOS::A::B");
        assert_eq!(entity_type("Github::Repo"), "Github::Repo");
        // A built-in type's text with attributes is not an entity of the operator's.
        let mut req = e("Channel", serde_json::json!({})).requirement("write");
        req.resource = "SharedOS::File::\"/a\"".into();
        assert_eq!(
            Resource::from_requirement(&req),
            Err(RequirementError::Unknown)
        );
        // A URL not in its canonical form is not one the broker recorded.
        let req = Requirement {
            action: "fetch".into(),
            resource: "SharedOS::Url::\"HTTP://A.example/\"".into(),
            namespace: None,
            attributes: None,
        };
        assert_eq!(
            Resource::from_requirement(&req),
            Err(RequirementError::Unknown)
        );
    }
}
