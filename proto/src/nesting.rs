//! One nesting limit for everything a caller sends, and a depth scan that no input can
//! overflow.
//!
//! serde_json refuses values nested 128 levels deep or more. A call travels from the client's
//! line (where its arguments sit two levels down) to the broker's call frame (two levels down
//! too) and the record, so one limit, [`MAX_ARGUMENT_DEPTH`], well below that, is checked once,
//! where the call enters: the shim refers a deeper call to the kernel without its arguments (it
//! is refused and recorded), and any frame the shim sends then decodes in the broker.

/// Deepest nesting accepted in a call's arguments (`{}` and `[]` each count one level).
pub const MAX_ARGUMENT_DEPTH: usize = 64;

/// Deepest nesting accepted in a whole client line: the arguments' limit plus the envelope
/// (`{"params": {"arguments": …}}`).
pub const MAX_LINE_DEPTH: usize = MAX_ARGUMENT_DEPTH + 2;

/// The deepest nesting of `[` and `{` in a JSON text, outside strings (escapes honoured). Any
/// bytes are accepted (the answer for invalid JSON is some number); no recursion, no panic.
pub fn json_depth(text: &[u8]) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut in_string = false;
    let mut escaped = false;
    for &b in text {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// The deepest nesting of arrays and objects in a value (`{}` and `[]` each count one level),
/// without recursion.
pub fn value_depth(value: &serde_json::Value) -> usize {
    use serde_json::Value;
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((v, depth)) = stack.pop() {
        match v {
            Value::Array(items) => {
                deepest = deepest.max(depth + 1);
                stack.extend(items.iter().map(|i| (i, depth + 1)));
            }
            Value::Object(map) => {
                deepest = deepest.max(depth + 1);
                stack.extend(map.values().map(|i| (i, depth + 1)));
            }
            _ => {}
        }
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_depths_agree_with_the_text_scan() {
        for text in [
            "1",
            "{}",
            r#"{"a":[1,{"b":[]}]}"#,
            r#"{"a":"[[[["}"#,
            "[[],[[[]]],{}]",
        ] {
            let v: serde_json::Value = serde_json::from_str(text).expect("json");
            assert_eq!(value_depth(&v), json_depth(text.as_bytes()), "{text}");
        }
        let deep = format!("{}{}", "[".repeat(125), "]".repeat(125));
        let v: serde_json::Value = serde_json::from_str(&deep).expect("json");
        assert_eq!(value_depth(&v), 125);
    }

    #[test]
    fn depths() {
        assert_eq!(json_depth(b"1"), 0);
        assert_eq!(json_depth(b"{}"), 1);
        assert_eq!(json_depth(br#"{"a":[1,{"b":[]}]}"#), 4);
        assert_eq!(json_depth(br#"{"a":"[[[[{{{{"}"#), 1);
        assert_eq!(json_depth(br#"{"a":"\"[[[["}"#), 1);
        assert_eq!(json_depth(br#"["\\",[[]]]"#), 3);
        assert_eq!(json_depth(b"]]]]"), 0);
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(json_depth(deep.as_bytes()), 10_000);
    }

    /// The depth scan agrees with serde_json's own limit on what it parses.
    #[test]
    fn agrees_with_serde_on_nesting() {
        for n in [1usize, 60, 126, 127, 128, 129] {
            let text = format!("{}{}", "[".repeat(n), "]".repeat(n));
            assert_eq!(json_depth(text.as_bytes()), n);
            let parsed = serde_json::from_str::<serde_json::Value>(&text);
            assert_eq!(parsed.is_ok(), n <= 127, "depth {n}");
        }
    }
}
