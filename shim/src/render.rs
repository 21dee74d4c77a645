//! The one mapping from a kernel answer to the bytes of its MCP result, and the answers the shim
//! makes itself when the broker cannot give one.
//!
//! [`to_mcp`] is the one outcome mapping: succeeded → content; denied and failed →
//! `isError: true` with a first text block that starts with the outcome word; every result
//! carries the machine form under `_meta["sharedos"]`. On the hot path the same result is written
//! without rmcp's types (`Direct`), held to `to_mcp` by a test. [`response`] picks between them.

use rmcp::model::{CallToolResult, ContentBlock, MetaObject, ServerResult};
use serde::Deserialize;
use serde_json::{Value, json};
use sharedos_proto::ipc::{CallAnswer, META_KEY};
use sharedos_proto::{CancelCode, FailCode, Outcome};

use crate::link::LinkDown;

/// The whole JSON-RPC response to a call, as one line (without its newline), in the wire shape
/// of the call's protocol (`current`: 2026-07-28 or later): written straight from the answer
/// ([`Direct`]), or through rmcp's types ([`to_mcp`], [`wire_shape`]) for the shapes
/// the direct writer leaves to them.
pub fn response(id: Value, answer: &CallAnswer, current: bool) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Response<'a, R> {
        jsonrpc: &'static str,
        id: &'a Value,
        result: R,
    }
    let written = match Direct::new(answer, current) {
        Some(result) => serde_json::to_vec(&Response {
            jsonrpc: "2.0",
            id: &id,
            result,
        }),
        None => serde_json::to_vec(&Response {
            jsonrpc: "2.0",
            id: &id,
            result: wire_shape(to_mcp(answer), current),
        }),
    };
    written.unwrap_or_else(|e| {
        crate::guard::error(
            id,
            crate::guard::INTERNAL_ERROR,
            format!("the shim could not represent the broker's answer: {e}"),
        )
        .to_string()
        .into_bytes()
    })
}

/// The sentence a refusal's first content block carries: the kernel's message, or one made from
/// the outcome when it gave none.
fn sentence(answer: &CallAnswer) -> String {
    answer.message.clone().unwrap_or_else(|| {
        format!(
            "{}: {} ({})",
            answer.outcome.word(),
            answer.tool,
            answer.outcome.code()
        )
    })
}

/// The one outcome mapping: kernel answer → MCP result.
pub fn to_mcp(answer: &CallAnswer) -> CallToolResult {
    let mut meta = serde_json::Map::new();
    meta.insert(META_KEY.to_owned(), Value::Object(answer.meta()));
    // Constructors set `resultType` as the negotiated protocol requires (2026-07-28 needs it).
    let mut result = if answer.outcome.is_error() {
        let text = sentence(answer);
        // The sentence first (it carries the meaning where a harness drops the flag), then any
        // content the provider returned with its error, as it gave it.
        let mut blocks = vec![ContentBlock::text(text)];
        blocks.extend(
            answer
                .content
                .iter()
                .filter_map(|c| serde_json::from_value(c.clone()).ok()),
        );
        CallToolResult::error(blocks)
    } else {
        let content: Result<Vec<ContentBlock>, _> = answer
            .content
            .iter()
            .map(|c| serde_json::from_value(c.clone()))
            .collect();
        match content {
            Ok(content) => {
                let mut ok = CallToolResult::success(content);
                ok.structured_content = answer.structured_content.clone();
                ok
            }
            Err(e) => CallToolResult::error(vec![ContentBlock::text(format!(
                "failed: {} — the shim could not represent the broker's answer: {e}",
                answer.tool
            ))]),
        }
    };
    result.meta = Some(MetaObject::from(meta));
    result
}

/// A result as rmcp would put it on the wire: before 2026-07-28 (`current` false) without
/// `resultType: "complete"` and without non-object structured output.
fn wire_shape(result: CallToolResult, current: bool) -> ServerResult {
    let mut result = ServerResult::from(result);
    if !current {
        result.strip_result_type_for_legacy_peer();
        result.strip_non_object_output_for_legacy_peer();
    }
    result
}

/// The MCP result for a kernel answer as [`to_mcp`] and [`wire_shape`] put it on the wire,
/// written straight from the answer: rmcp's types cost a fifth of the shim's CPU per call
/// (building the `_meta` map, converting each content block, serializing, dropping). Only where
/// the outcome is plain: every content block is one rmcp can represent, and before 2026-07-28
/// structured content, if any, is an object (rmcp rewrites the others). Content blocks go as the
/// broker gave them; they come from rmcp's own types (upstreams) or the files provider, so rmcp's
/// path writes the same. Tested against that path.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Direct<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    result_type: Option<&'static str>,
    content: Blocks<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    structured_content: Option<&'a Value>,
    is_error: bool,
    #[serde(rename = "_meta")]
    meta: DirectMeta<'a>,
}

/// The content: for an error the sentence first, then what the provider gave.
struct Blocks<'a> {
    sentence: Option<Value>,
    rest: &'a [Value],
}

impl serde::Serialize for Blocks<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.sentence.iter().chain(self.rest))
    }
}

#[derive(serde::Serialize)]
struct DirectMeta<'a> {
    sharedos: MetaFields<'a>,
}

/// [`CallAnswer::meta`], field for field.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct MetaFields<'a> {
    outcome: &'static str,
    code: String,
    call_id: &'a str,
    tool: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    action: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource: Option<&'a str>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    policies: &'a [String],
}

impl<'a> Direct<'a> {
    /// `None` where the answer needs rmcp's handling (see above).
    fn new(answer: &'a CallAnswer, current: bool) -> Option<Self> {
        let representable = answer
            .content
            .iter()
            .all(|c| ContentBlock::deserialize(c).is_ok());
        if !representable {
            return None;
        }
        let is_error = answer.outcome.is_error();
        let structured_content = if is_error {
            None
        } else {
            answer.structured_content.as_ref()
        };
        if !current && structured_content.is_some_and(|v| !v.is_object()) {
            return None;
        }
        let sentence = is_error.then(|| json!({"type": "text", "text": sentence(answer)}));
        Some(Direct {
            result_type: current.then_some("complete"),
            content: Blocks {
                sentence,
                rest: &answer.content,
            },
            structured_content,
            is_error,
            meta: DirectMeta {
                sharedos: MetaFields {
                    outcome: answer.outcome.word(),
                    code: answer.outcome.code(),
                    call_id: &answer.call_id,
                    tool: &answer.tool,
                    action: answer.requirement.as_ref().map(|r| r.action.as_str()),
                    resource: answer.requirement.as_ref().map(|r| r.resource.as_str()),
                    policies: &answer.policies,
                },
            },
        })
    }
}

/// An answer the shim makes itself when the broker cannot give one.
pub fn local_answer(tool: &str, why: &LinkDown) -> CallAnswer {
    let (outcome, message) = match why {
        LinkDown::TurnClosed(reason) => (
            Outcome::Cancelled(CancelCode::TurnClosed),
            format!(
                "cancelled: {tool} did not finish: {reason}; nothing more can be called in this turn"
            ),
        ),
        LinkDown::BrokerGone(reason) => (
            Outcome::Failed(FailCode::BrokerUnavailable),
            format!("failed: {tool} could not be completed: {reason}"),
        ),
        LinkDown::NoAnswer(waited) => (
            Outcome::Failed(FailCode::Timeout),
            format!(
                "failed: {tool} got no answer from the SharedOS broker within {} s",
                waited.as_secs_f64()
            ),
        ),
    };
    CallAnswer {
        outcome,
        call_id: String::new(),
        tool: tool.to_owned(),
        message: Some(message),
        content: vec![],
        structured_content: None,
        requirement: None,
        policies: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharedos_proto::{DenyCode, Requirement};

    fn answer(outcome: Outcome) -> CallAnswer {
        CallAnswer {
            outcome,
            call_id: "t-1.1".into(),
            tool: "files.read".into(),
            message: outcome
                .is_error()
                .then(|| format!("{}: files.read of /x — why", outcome.word())),
            content: if outcome.is_error() {
                vec![]
            } else {
                vec![json!({"type": "text", "text": "body"})]
            },
            structured_content: None,
            requirement: Some(Requirement {
                action: "read".into(),
                resource: "SharedOS::File::\"/x\"".into(),
                namespace: Some("files".into()),
                attributes: None,
            }),
            policies: vec![],
        }
    }

    #[test]
    fn one_mapping_keeps_denied_and_failed_apart() {
        for (outcome, word) in [
            (Outcome::Denied(DenyCode::NoPermit), "denied"),
            (Outcome::Failed(FailCode::NotFound), "failed"),
        ] {
            let r = serde_json::to_value(to_mcp(&answer(outcome))).expect("json");
            assert_eq!(r["isError"], true);
            assert!(
                r["content"][0]["text"]
                    .as_str()
                    .is_some_and(|t| t.starts_with(&format!("{word}:")))
            );
            assert_eq!(r["_meta"]["sharedos"]["outcome"], word);
            assert_eq!(r["_meta"]["sharedos"]["resource"], "SharedOS::File::\"/x\"");
        }
        let r = serde_json::to_value(to_mcp(&answer(Outcome::Succeeded))).expect("json");
        assert_eq!(r["isError"], false);
        assert_eq!(r["content"][0]["text"], "body");
        assert_eq!(r["_meta"]["sharedos"]["code"], "ok");
    }

    #[test]
    fn the_shims_own_answers_say_why() {
        let closed = to_mcp(&local_answer(
            "files.read",
            &LinkDown::TurnClosed("the turn closed (host)".into()),
        ));
        let r = serde_json::to_value(closed).expect("json");
        assert_eq!(r["isError"], true);
        assert_eq!(r["_meta"]["sharedos"]["outcome"], "cancelled");
        let gone = to_mcp(&local_answer(
            "files.read",
            &LinkDown::BrokerGone("gone".into()),
        ));
        let r = serde_json::to_value(gone).expect("json");
        assert_eq!(r["_meta"]["sharedos"]["code"], "broker_unavailable");
    }

    #[test]
    fn the_direct_writer_writes_what_rmcp_writes() {
        let text = json!({"type": "text", "text": "body"});
        let mut answers = vec![
            answer(Outcome::Succeeded),
            answer(Outcome::Denied(DenyCode::NoPermit)),
            answer(Outcome::Failed(FailCode::NotFound)),
            CallAnswer {
                message: None,
                policies: vec!["p0".into(), "p1".into()],
                ..answer(Outcome::Cancelled(CancelCode::ClientCancelled))
            },
            CallAnswer {
                content: vec![
                    text.clone(),
                    json!({"type": "image", "data": "AA==", "mimeType": "image/png"}),
                ],
                ..answer(Outcome::Failed(FailCode::UpstreamError))
            },
        ];
        for structured in [json!({"a": 1}), json!([1, 2])] {
            answers.push(CallAnswer {
                structured_content: Some(structured.clone()),
                ..answer(Outcome::Succeeded)
            });
            answers.push(CallAnswer {
                structured_content: Some(structured),
                ..answer(Outcome::Failed(FailCode::ProviderError))
            });
        }
        answers.push(CallAnswer {
            content: vec![json!({"type": "nonsense"})],
            ..answer(Outcome::Succeeded)
        });
        let mut direct = 0;
        for a in &answers {
            for current in [false, true] {
                let rmcp = serde_json::to_value(wire_shape(to_mcp(a), current)).expect("json");
                match Direct::new(a, current) {
                    Some(d) => {
                        direct += 1;
                        assert_eq!(
                            serde_json::to_value(d).expect("json"),
                            rmcp,
                            "{a:?} at current={current}"
                        );
                    }
                    None => assert!(
                        a.content.iter().any(|c| c["type"] == "nonsense")
                            || (!current
                                && a.structured_content
                                    .as_ref()
                                    .is_some_and(|v| !v.is_object())),
                        "left to rmcp: {a:?}"
                    ),
                }
            }
        }
        // Everything but the array output before 2026-07-28 and the unrepresentable block.
        assert_eq!(direct, 2 * answers.len() - 3);
    }
}
