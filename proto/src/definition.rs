//! Tool definitions: what a provider registers ([`ToolDefinition`]) and what crosses the
//! boundary ([`PublishedToolDefinition`]).
//!
//! A registration may carry an authority part `A` (required capability, requirement resolution,
//! handler reference, credentials, namespace settings): this crate does not know what it is and
//! never looks inside it; the broker defines it. The published definition is *defined by what it
//! omits*: it has exactly the fields of [`CATALOG_HASH_FIELDS`], so authority cannot cross the
//! boundary, by construction rather than by convention.

use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::name::ToolName;

/// The only fields a published definition, and so a catalogue projection, may have: in this order
/// they are emitted, and nothing outside this list is ever emitted.
pub const CATALOG_HASH_FIELDS: [&str; 6] = [
    "name",
    "description",
    "inputSchema",
    "outputSchema",
    "annotations",
    "metadata",
];

/// The only keys of `metadata` that participate.
pub const METADATA_FIELDS: [&str; 2] = ["namespace", "source"];

/// `metadata` of a published tool: namespace and source only. Other keys a provider sets on its
/// registration are dropped when the definition is read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolMetadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl ToolMetadata {
    fn is_empty(&self) -> bool {
        self.namespace.is_none() && self.source.is_none()
    }
}

/// What a provider registers: the published surface plus an authority part `A` that never
/// crosses the boundary. With the default `A` (a JSON object) every field outside the surface is
/// kept aside, so arbitrary definitions (the shape of the test vectors) can be read and projected.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolDefinition<A = Map<String, Value>> {
    pub name: ToolName,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub input_schema: Option<Value>,
    #[serde(default)]
    pub output_schema: Option<Value>,
    #[serde(default)]
    pub annotations: Option<Value>,
    #[serde(default)]
    pub metadata: Option<ToolMetadata>,
    /// Everything else the registration carries. Never published, never hashed.
    #[serde(flatten)]
    pub authority: A,
}

impl<A> ToolDefinition<A> {
    /// The same registration with another authority part.
    pub fn with_authority<B>(self, authority: B) -> ToolDefinition<B> {
        ToolDefinition {
            name: self.name,
            description: self.description,
            input_schema: self.input_schema,
            output_schema: self.output_schema,
            annotations: self.annotations,
            metadata: self.metadata,
            authority,
        }
    }

    /// The published projection of this registration.
    pub fn publish(&self) -> PublishedToolDefinition {
        PublishedToolDefinition {
            name: self.name.clone(),
            description: self.description.clone(),
            input_schema: self.input_schema.clone(),
            output_schema: self.output_schema.clone(),
            annotations: self.annotations.clone(),
            metadata: self.metadata.clone().filter(|m| !m.is_empty()),
        }
    }
}

/// The operation surface a harness receives. It has no field for authority, and its serialized
/// form is built from [`CATALOG_HASH_FIELDS`] alone (see [`PublishedToolDefinition::projection`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedToolDefinition {
    pub name: ToolName,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub input_schema: Option<Value>,
    #[serde(default)]
    pub output_schema: Option<Value>,
    #[serde(default)]
    pub annotations: Option<Value>,
    // INVARIANT: never `Some` of an empty ToolMetadata. An empty (or all-unknown-keys) metadata
    // object reads as `None`, exactly as it projects, so decode ∘ encode is the identity
    // (found by the frame_decoder fuzz target).
    #[serde(default, deserialize_with = "non_empty_metadata")]
    pub metadata: Option<ToolMetadata>,
}

fn non_empty_metadata<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<ToolMetadata>, D::Error> {
    let m = Option::<ToolMetadata>::deserialize(deserializer)?;
    Ok(m.filter(|m| !m.is_empty()))
}

impl PublishedToolDefinition {
    /// The value of one participating field, if present. Only names in [`CATALOG_HASH_FIELDS`]
    /// have a value.
    fn field(&self, field: &str) -> Option<Value> {
        match field {
            "name" => Some(Value::String(self.name.to_string())),
            "description" => self.description.clone().map(Value::String),
            "inputSchema" => self.input_schema.clone(),
            "outputSchema" => self.output_schema.clone(),
            "annotations" => self.annotations.clone(),
            "metadata" => self
                .metadata
                .as_ref()
                .filter(|m| !m.is_empty())
                .and_then(|m| serde_json::to_value(m).ok()),
            _ => None,
        }
    }

    /// The projection: a JSON object with exactly the participating fields that are present.
    ///
    // INVARIANT: the keys are drawn from CATALOG_HASH_FIELDS only; the loop is the sole
    // producer of keys, so no other key can appear whatever fields this struct grows.
    pub fn projection(&self) -> Map<String, Value> {
        let mut out = Map::new();
        for field in CATALOG_HASH_FIELDS {
            if let Some(value) = self.field(field) {
                out.insert(field.to_owned(), value);
            }
        }
        out
    }

    /// The input schema a client should see: the declared one, or an empty object schema (MCP
    /// requires `inputSchema`; the hash sees only what was declared).
    pub fn input_schema_or_default(&self) -> Value {
        self.input_schema
            .clone()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}))
    }
}

impl Serialize for PublishedToolDefinition {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.projection().serialize(serializer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn authority_never_published() {
        let def: ToolDefinition = serde_json::from_value(json!({
            "name": "files.read",
            "description": "Read a file.",
            "inputSchema": {"type": "object"},
            "metadata": {"namespace": "files", "source": "builtin", "owner": "ops"},
            "credentials": {"token": "secret"},
            "handler": "builtin:files.read",
            "title": "Read",
        }))
        .expect("definition");
        assert!(def.authority.contains_key("credentials"));
        let published = serde_json::to_value(def.publish()).expect("serialize");
        let text = published.to_string();
        assert!(!text.contains("secret"));
        assert!(!text.contains("handler"));
        assert!(!text.contains("owner"));
        assert!(!text.contains("title"));
        assert_eq!(
            published["metadata"],
            json!({"namespace": "files", "source": "builtin"})
        );
    }

    #[test]
    fn empty_metadata_is_absent() {
        let def: ToolDefinition =
            serde_json::from_value(json!({"name": "a", "metadata": {"owner": "x"}})).expect("def");
        assert_eq!(
            serde_json::to_value(def.publish()).expect("ser"),
            json!({"name": "a"})
        );
    }

    /// Regression: fuzz/artifacts/frame_decoder/handmin-empty-metadata. A published tool whose
    /// metadata is empty must decode to the same value its encoding decodes to.
    #[test]
    fn empty_metadata_round_trips() {
        for meta in [json!({}), json!({"nalespace": "x", "sourbe": 1})] {
            let t: PublishedToolDefinition =
                serde_json::from_value(json!({"name": "a", "metadata": meta})).expect("read");
            assert_eq!(t.metadata, None);
            let back: PublishedToolDefinition =
                serde_json::from_value(serde_json::to_value(&t).expect("ser")).expect("again");
            assert_eq!(back, t);
        }
    }

    #[test]
    fn invalid_name_is_rejected_when_read() {
        let err = serde_json::from_value::<ToolDefinition>(json!({"name": "files read"}))
            .expect_err("invalid");
        assert!(err.to_string().contains("files read"));
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-zA-Z_]{1,12}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn projection_never_leaves_the_field_list(
            extra in prop::collection::btree_map("[a-zA-Z_]{1,16}", arb_json(), 0..8),
            metadata_extra in prop::collection::btree_map("[a-zA-Z_]{1,16}", arb_json(), 0..4),
        ) {
            let mut obj = Map::new();
            for (k, v) in extra { obj.insert(k, v); }
            let mut meta: Map<String, Value> = metadata_extra.into_iter().collect();
            meta.insert("namespace".into(), json!("ns"));
            obj.insert("name".into(), json!("ns.tool"));
            obj.insert("metadata".into(), Value::Object(meta));
            // Fields of the surface must have the right type for the definition to read;
            // drop generated ones that do not.
            for k in ["description", "inputSchema", "outputSchema", "annotations"] {
                if k == "description" && !obj.get(k).is_some_and(Value::is_string) {
                    obj.remove(k);
                }
            }
            let def: ToolDefinition = serde_json::from_value(Value::Object(obj)).expect("def");
            let projected = serde_json::to_value(def.publish()).expect("ser");
            let projected = projected.as_object().expect("object");
            for key in projected.keys() {
                prop_assert!(CATALOG_HASH_FIELDS.contains(&key.as_str()), "{key}");
            }
            for key in projected["metadata"].as_object().expect("metadata").keys() {
                prop_assert!(METADATA_FIELDS.contains(&key.as_str()), "{key}");
            }
        }
    }
}
