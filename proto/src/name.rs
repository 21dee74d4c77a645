//! Validated names: [`ToolName`] (the canonical SharedOS tool id, which is also the raw MCP
//! `Tool.name`) and [`Identifier`] (an opaque host identifier: principals, agents, turns).
//!
//! The two are deliberately distinct: a tool name goes on a wire that every harness must carry
//! unchanged, so its character set is the narrow `[A-Za-z0-9_.-]`; an identifier is never put on
//! an MCP wire and only has to be printable and bounded.
//!
//! This module never narrows what a *call* names: `ToolCall.tool` stays a plain string so that a
//! malformed name still reaches the kernel and its record.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest tool name, in characters (all ASCII, so also bytes).
pub const TOOL_NAME_MAX: usize = 128;
/// Longest identifier, in bytes.
pub const IDENTIFIER_MAX: usize = 256;

/// Why a string is not a [`ToolName`]. The message names the offending input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolNameError {
    #[error("tool name is empty")]
    Empty,
    #[error("tool name `{shown}` is {len} characters long; the limit is {TOOL_NAME_MAX}")]
    TooLong { shown: String, len: usize },
    #[error(
        "tool name `{shown}` has {what} at character {index}; only A-Z a-z 0-9 _ . - are allowed"
    )]
    BadCharacter {
        shown: String,
        what: String,
        index: usize,
    },
}

/// A published tool name: 1 to 128 characters of `[A-Za-z0-9_.-]`, ASCII only.
///
/// `ToolName::new` is the only way to make one, so every value of this type is valid.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ToolName(String);

/// Shows a user string safely inside an error message: control characters escaped, long input cut.
pub fn shown(input: &str) -> String {
    const SHOW_MAX: usize = 80;
    let mut out: String = input
        .chars()
        .take(SHOW_MAX)
        .flat_map(char::escape_debug)
        .collect();
    if input.chars().count() > SHOW_MAX {
        out.push('…');
    }
    out
}

/// Cuts `text` to at most `max_bytes` bytes on a character boundary, marking a cut with `…`
/// (which counts toward the limit). Never panics, whatever the text: for outside input.
pub fn clip(text: &mut String, max_bytes: usize) {
    if text.len() <= max_bytes {
        return;
    }
    let mut end = max_bytes.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push('…');
}

fn is_tool_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

impl ToolName {
    /// Validates `name` against ToolNameSchema.
    pub fn new(name: &str) -> Result<Self, ToolNameError> {
        if name.is_empty() {
            return Err(ToolNameError::Empty);
        }
        if let Some((index, c)) = name
            .chars()
            .enumerate()
            .find(|(_, c)| !is_tool_name_char(*c))
        {
            let what = if c.is_whitespace() || c.is_control() {
                format!("the character {:?}", c)
            } else {
                format!("`{c}` (U+{:04X})", c as u32)
            };
            return Err(ToolNameError::BadCharacter {
                shown: shown(name),
                what,
                index,
            });
        }
        // All characters are ASCII from here on, so bytes == characters.
        if name.len() > TOOL_NAME_MAX {
            return Err(ToolNameError::TooLong {
                shown: shown(name),
                len: name.len(),
            });
        }
        Ok(Self(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The part before the first `.`, which brokered providers use as their namespace.
    pub fn namespace(&self) -> Option<&str> {
        self.0.split_once('.').map(|(ns, _)| ns)
    }
}

impl TryFrom<String> for ToolName {
    type Error = ToolNameError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(&value)
    }
}

impl From<ToolName> for String {
    fn from(value: ToolName) -> Self {
        value.0
    }
}

impl fmt::Display for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for ToolName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Why a string is not an [`Identifier`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentifierError {
    #[error("identifier is empty")]
    Empty,
    #[error("identifier `{shown}` is {len} bytes long; the limit is {IDENTIFIER_MAX}")]
    TooLong { shown: String, len: usize },
    #[error("identifier `{shown}` contains a control character or white space")]
    BadCharacter { shown: String },
}

/// An opaque host identifier (principal, agent, turn id): 1 to 256 bytes of printable text
/// without white space. Wider than [`ToolName`] on purpose: it never goes on an MCP wire.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Identifier(String);

impl Identifier {
    pub fn new(id: &str) -> Result<Self, IdentifierError> {
        if id.is_empty() {
            return Err(IdentifierError::Empty);
        }
        if id.len() > IDENTIFIER_MAX {
            return Err(IdentifierError::TooLong {
                shown: shown(id),
                len: id.len(),
            });
        }
        if id.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(IdentifierError::BadCharacter { shown: shown(id) });
        }
        Ok(Self(id.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Identifier {
    type Error = IdentifierError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(&value)
    }
}

impl From<Identifier> for String {
    fn from(value: Identifier) -> Self {
        value.0
    }
}

impl fmt::Display for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_cuts_on_character_boundaries() {
        for (text, max) in [
            ("aéééé", 4),
            ("日本語のテキスト", 7),
            ("abc", 3),
            ("abcd", 3),
            ("é", 1),
        ] {
            let mut t = text.to_owned();
            clip(&mut t, max);
            assert!(t.len() <= max.max('…'.len_utf8()), "{text:?} {max}: {t:?}");
            if text.len() <= max {
                assert_eq!(t, text);
            } else {
                assert!(t.ends_with('…'), "{t:?}");
                assert!(text.starts_with(t.trim_end_matches('…')));
            }
        }
        let mut long = format!("a{}", "é".repeat(150));
        clip(&mut long, 200);
        assert!(long.len() <= 200 && long.ends_with('…'));
    }
    use proptest::prelude::*;

    fn vectors() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/tool-names.json");
        let text = std::fs::read_to_string(path).expect("read vectors/tool-names.json");
        serde_json::from_str(&text).expect("parse tool-names.json")
    }

    #[test]
    fn accepts_every_valid_vector() {
        let v = vectors();
        let valid = v["valid"].as_array().expect("valid array");
        assert!(!valid.is_empty());
        for name in valid {
            let name = name.as_str().expect("string");
            let tool = ToolName::new(name).unwrap_or_else(|e| panic!("{name:?} rejected: {e}"));
            assert_eq!(tool.as_str(), name);
        }
    }

    #[test]
    fn rejects_every_invalid_vector_naming_the_input() {
        let v = vectors();
        let invalid = v["invalid"].as_array().expect("invalid array");
        assert!(!invalid.is_empty());
        for name in invalid {
            let name = name.as_str().expect("string");
            let err = ToolName::new(name).expect_err(name);
            let msg = err.to_string();
            if !name.is_empty() {
                let prefix: String = shown(name).chars().take(20).collect();
                assert!(msg.contains(&prefix), "{msg:?} does not name {name:?}");
            }
        }
    }

    #[test]
    fn serde_validates() {
        assert!(serde_json::from_str::<ToolName>("\"files.read\"").is_ok());
        let err = serde_json::from_str::<ToolName>("\"files read\"").expect_err("space");
        assert!(err.to_string().contains("files read"));
    }

    #[test]
    fn identifier_is_distinct_and_wider() {
        assert!(Identifier::new("alice@example.com").is_ok());
        assert!(ToolName::new("alice@example.com").is_err());
        assert!(Identifier::new("").is_err());
        assert!(Identifier::new("a b").is_err());
        assert!(Identifier::new(&"x".repeat(257)).is_err());
    }

    proptest! {
        #[test]
        fn valid_charset_and_length_is_accepted(name in "[A-Za-z0-9_.-]{1,128}") {
            prop_assert!(ToolName::new(&name).is_ok());
        }

        #[test]
        fn too_long_is_rejected(name in "[A-Za-z0-9_.-]{129,300}") {
            let is_too_long = matches!(ToolName::new(&name), Err(ToolNameError::TooLong { .. }));
            prop_assert!(is_too_long);
        }

        #[test]
        fn any_other_character_is_rejected(
            prefix in "[A-Za-z0-9_.-]{0,20}",
            bad in any::<char>().prop_filter("outside the set", |c| !is_tool_name_char(*c)),
            suffix in "[A-Za-z0-9_.-]{0,20}",
        ) {
            let name = format!("{prefix}{bad}{suffix}");
            let is_bad_char = matches!(ToolName::new(&name), Err(ToolNameError::BadCharacter { .. }));
            prop_assert!(is_bad_char);
        }

        #[test]
        fn acceptance_matches_the_schema(name in any::<String>()) {
            let expected = !name.is_empty()
                && name.chars().count() <= TOOL_NAME_MAX
                && name.chars().all(is_tool_name_char);
            prop_assert_eq!(ToolName::new(&name).is_ok(), expected);
        }
    }
}
