//! Catalogue identity: the canonical JSON of a published catalogue and its `catalogHash`.
//!
//! `catalogHash` = lowercase hex SHA-256 of the RFC 8785 canonical JSON of the array of
//! projections sorted by name. RFC 8785 (UTF-16 key order, ECMAScript number form, minimal string
//! escapes) comes from the `serde_json_canonicalizer` crate, which passes every vector in
//! `vectors/catalog-hash.json`; `serde_json::to_string` would not.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::definition::PublishedToolDefinition;

/// Why a catalogue could not be canonicalized.
#[derive(Debug, thiserror::Error)]
#[error("cannot canonicalize the catalogue: {0}")]
pub struct CanonicalError(String);

/// RFC 8785 canonical JSON of any value.
pub fn canonical_json(value: &Value) -> Result<String, CanonicalError> {
    serde_json_canonicalizer::to_string(value).map_err(|e| CanonicalError(e.to_string()))
}

/// A catalogue's identity: 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CatalogHash(String);

impl CatalogHash {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CatalogHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The projections of `tools` sorted by name, as the JSON array that is hashed. Registration
/// order never matters. Names are ASCII, so byte order equals UTF-16 order.
pub fn projection_array(tools: &[PublishedToolDefinition]) -> Value {
    let mut sorted: Vec<&PublishedToolDefinition> = tools.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    Value::Array(
        sorted
            .into_iter()
            .map(|t| Value::Object(t.projection()))
            .collect(),
    )
}

/// The canonical JSON text whose SHA-256 is the catalogue hash.
pub fn canonical_catalog(tools: &[PublishedToolDefinition]) -> Result<String, CanonicalError> {
    canonical_json(&projection_array(tools))
}

/// `catalogHash` of a published catalogue.
pub fn catalog_hash(tools: &[PublishedToolDefinition]) -> Result<CatalogHash, CanonicalError> {
    Ok(hash_canonical(&canonical_catalog(tools)?))
}

/// `catalogHash` of tool definitions given as raw MCP JSON (an upstream server's `tools/list`),
/// projected with the same fixed field list; names need not be valid ToolNames here.
pub fn raw_catalog_hash(tools: &[Value]) -> Result<CatalogHash, CanonicalError> {
    let mut projected: Vec<Value> = tools
        .iter()
        .map(|t| {
            let mut out = serde_json::Map::new();
            for field in crate::definition::CATALOG_HASH_FIELDS {
                let Some(v) = t.get(field) else { continue };
                if field == "metadata" {
                    let m: serde_json::Map<String, Value> = v
                        .as_object()
                        .into_iter()
                        .flatten()
                        .filter(|(k, _)| crate::definition::METADATA_FIELDS.contains(&k.as_str()))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    if !m.is_empty() {
                        out.insert(field.to_owned(), Value::Object(m));
                    }
                } else {
                    out.insert(field.to_owned(), v.clone());
                }
            }
            Value::Object(out)
        })
        .collect();
    projected.sort_by(|a, b| {
        let key = |v: &Value| {
            v.get("name")
                .and_then(Value::as_str)
                .map(|s| s.encode_utf16().collect::<Vec<u16>>())
        };
        key(a).cmp(&key(b))
    });
    Ok(hash_canonical(&canonical_json(&Value::Array(projected))?))
}

/// RFC 8785 text of one tool's projection: one element of the array that is hashed. A
/// registration never changes, so a broker computes this once per tool.
pub fn canonical_projection(tool: &PublishedToolDefinition) -> Result<String, CanonicalError> {
    canonical_json(&Value::Object(tool.projection()))
}

/// `catalogHash` from the tools' [`canonical_projection`]s, given in name order. RFC 8785
/// writes an array as `[`, its elements' canonical texts joined by `,`, then `]` (elements
/// canonicalize independently), so this hashes exactly the bytes [`catalog_hash`] hashes.
pub fn catalog_hash_of_sorted<'a>(parts: impl IntoIterator<Item = &'a str>) -> CatalogHash {
    let mut hasher = Sha256::new();
    hasher.update(b"[");
    for (i, part) in parts.into_iter().enumerate() {
        if i > 0 {
            hasher.update(b",");
        }
        hasher.update(part.as_bytes());
    }
    hasher.update(b"]");
    hex_of(&hasher.finalize())
}

/// Lowercase hex SHA-256 of canonical text.
pub fn hash_canonical(canonical: &str) -> CatalogHash {
    hex_of(&Sha256::digest(canonical.as_bytes()))
}

fn hex_of(digest: &[u8]) -> CatalogHash {
    CatalogHash(hex(digest))
}

/// Lowercase hex of bytes (a digest). Every record line's `prev` is one: a `write!` per byte
/// cost the broker about 16,000 instructions a call (bench/NOTES.md).
pub fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// Lowercase hex SHA-256 of bytes (record digests of arguments and over-size lines).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::definition::ToolDefinition;
    use proptest::prelude::*;
    use serde_json::json;

    fn vectors() -> Vec<Value> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/catalog-hash.json");
        let text = std::fs::read_to_string(path).expect("read vectors/catalog-hash.json");
        let v: Value = serde_json::from_str(&text).expect("parse catalog-hash.json");
        v["vectors"].as_array().expect("vectors").clone()
    }

    fn read_tools(tools: &Value) -> Vec<PublishedToolDefinition> {
        tools
            .as_array()
            .expect("tools")
            .iter()
            .map(|t| {
                serde_json::from_value::<ToolDefinition>(t.clone())
                    .expect("definition")
                    .publish()
            })
            .collect()
    }

    #[test]
    fn every_vector_passes() {
        let vectors = vectors();
        assert_eq!(vectors.len(), 6, "the vector file has six vectors");
        for v in &vectors {
            let name = v["name"].as_str().expect("name");
            let tools = read_tools(&v["tools"]);
            assert_eq!(
                projection_array(&tools),
                v["projection"],
                "{name}: projection"
            );
            let canonical = canonical_catalog(&tools).expect("canonical");
            assert_eq!(
                canonical,
                v["canonical"].as_str().expect("canonical"),
                "{name}"
            );
            let hash = catalog_hash(&tools).expect("hash");
            assert_eq!(
                hash.as_str(),
                v["catalogHash"].as_str().expect("hash"),
                "{name}"
            );
            let mut sorted: Vec<&PublishedToolDefinition> = tools.iter().collect();
            sorted.sort_by(|a, b| a.name.cmp(&b.name));
            let parts: Vec<String> = sorted
                .iter()
                .map(|t| canonical_projection(t).expect("part"))
                .collect();
            assert_eq!(
                catalog_hash_of_sorted(parts.iter().map(String::as_str)).as_str(),
                v["catalogHash"].as_str().expect("hash"),
                "{name}: joined per-tool projections"
            );
        }
    }

    #[test]
    fn raw_hash_agrees_with_the_vectors() {
        for v in vectors() {
            let tools = v["tools"].as_array().expect("tools").clone();
            let hash = raw_catalog_hash(&tools).expect("hash");
            assert_eq!(
                hash.as_str(),
                v["catalogHash"].as_str().expect("hash"),
                "{}",
                v["name"]
            );
        }
    }

    #[test]
    fn authority_vector_equals_single() {
        let vectors = vectors();
        let by_name = |n: &str| {
            vectors
                .iter()
                .find(|v| v["name"] == n)
                .map(|v| v["catalogHash"].clone())
                .expect(n)
        };
        assert_eq!(by_name("authority-never-participates"), by_name("single"));
    }

    fn arb_tool() -> impl Strategy<Value = Value> {
        (
            "[a-z]{1,6}\\.[a-z]{1,6}",
            proptest::option::of("[ -~]{0,20}"),
            proptest::option::of(Just(json!({"type": "object"}))),
            proptest::option::of("[a-z]{1,8}"),
        )
            .prop_map(|(name, desc, schema, ns)| {
                let mut t = json!({"name": name});
                if let Some(d) = desc {
                    t["description"] = json!(d);
                }
                if let Some(s) = schema {
                    t["inputSchema"] = s;
                }
                if let Some(ns) = ns {
                    t["metadata"] = json!({"namespace": ns, "source": "builtin"});
                }
                t
            })
    }

    proptest! {
        #[test]
        fn hash_ignores_order_and_non_participating_fields(
            tools in prop::collection::vec(arb_tool(), 0..8)
                .prop_map(|mut v| { v.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
                                    v.dedup_by(|a, b| a["name"] == b["name"]); v }),
            seed in any::<u64>(),
            junk in "[a-z]{1,10}",
        ) {
            let base = read_tools(&Value::Array(tools.clone()));
            let mut shuffled = tools.clone();
            // Deterministic shuffle from the seed.
            let n = shuffled.len();
            for i in (1..n).rev() {
                let j = (seed.wrapping_mul(6364136223846793005).wrapping_add(i as u64) % (i as u64 + 1)) as usize;
                shuffled.swap(i, j);
            }
            for t in &mut shuffled {
                t["handler"] = json!(junk.clone());
                t["requiredCapability"] = json!({"action": junk.clone()});
                t["title"] = json!(junk.clone());
                t["_meta"] = json!({"x": junk.clone()});
                if let Some(m) = t.get_mut("metadata") { m["owner"] = json!(junk.clone()); }
            }
            let other = read_tools(&Value::Array(shuffled));
            prop_assert_eq!(catalog_hash(&base).expect("a"), catalog_hash(&other).expect("b"));
            // The per-tool pieces joined give the same hash as the whole array.
            let parts: Vec<String> = base.iter().map(|t| canonical_projection(t).expect("part")).collect();
            prop_assert_eq!(
                catalog_hash_of_sorted(parts.iter().map(String::as_str)),
                catalog_hash(&base).expect("whole")
            );
        }
    }
}
