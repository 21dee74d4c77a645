//! Fuzzes the shim's stdin handling: the pure line check (`sharedos_mcp_shim::guard::check_line`)
//! and the streaming path in front of rmcp (`sharedos_mcp_shim::session::run`).
//!
//! 1. `check_line` never panics, on the whole input and on every line of it. Where
//!    `check_line_fast` gives a verdict (lines up to 64 KiB), it is `check_line_full`'s. An `Answer` is a JSON
//!    object with `jsonrpc: "2.0"`, an `error.code` in {-32700, -32600, -32602}, a string
//!    `error.message` and an `id` that is null, a string or an integer, and serializes to one line.
//!    `Pass` and `Cancel` only for a JSON object with `jsonrpc == "2.0"`, a string `method` other
//!    than `tools/call` and no `id` or a valid one; `Cancel` only for `notifications/cancelled`
//!    without an id, carrying its valid `params.requestId`. `Refer` exactly for `tools/call`,
//!    with the line's id.
//! 2. The input after a control byte is client stdin, written in pieces (1 to all bytes, low
//!    three bits of the control byte, unless 3. applies) through a `tokio::io::duplex` into
//!    `session::run`, on a current-thread runtime. A fake kernel answers each referred call after a
//!    yield, on the call's own task. A fake rmcp reads the guard's output to the end, answering
//!    each line with a JSON line of its own written in two halves, then closes, and the session
//!    is finished as the shim does. Checks: every line passed to rmcp is newline-terminated and
//!    `check_line` says `Pass` or `Cancel` for it; the passed lines are exactly the `Pass` and
//!    `Cancel` lines of a model of the line splitting (`\n`, one trailing `\r` stripped on a
//!    terminated line, blank lines skipped, lines over `MAX_LINE_BYTES` answered); every line on
//!    stdout is valid JSON; the guard's own answers on stdout are exactly the model's, in order;
//!    the referred calls' answers are exactly the model's, in any order (each call runs on its
//!    own task); a call without an id gets none; the fake rmcp's lines all arrive, in order.
//! 3. If the control byte is 0xff (rare on purpose: such a run costs ~50 normal ones), the next
//!    byte is a parameter and the first line after it is padded at its start with `x` to
//!    `MAX_LINE_BYTES - 2 ..= MAX_LINE_BYTES + 1` bytes (bits 0-1 of the parameter), so the
//!    guard's line limit is hit on both sides: up to the limit the line reaches `check_line` (a
//!    parse error answer), above it it is answered as too long; the lines after it must be
//!    handled as usual. (`x`, not JSON whitespace: parsing megabytes of spaces under the
//!    sanitizers costs ~200 ms a pass.)
//!
//! Everything runs under a timeout: a hang panics (a finding), it does not stall the fuzzer.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sharedos_mcp_shim::guard::{
    INVALID_PARAMS, INVALID_REQUEST, MAX_LINE_BYTES, OVERSIZE_PREFIX_BYTES, PARSE_ERROR, Referral,
    Verdict, check_line, check_line_fast, check_line_full, check_oversize, sha256_hex,
};
use sharedos_mcp_shim::session::{CancellationToken, run};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::runtime::Runtime;

/// A whole session, overlong line included, must finish within this.
const SESSION_TIMEOUT: Duration = Duration::from_secs(30);
/// Stdin write sizes, picked by the low three bits of the control byte.
const CHUNKS: [usize; 8] = [1, 2, 3, 7, 16, 61, 4096, usize::MAX];

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime")
    })
}

fn shown(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]);
    if bytes.len() > 200 {
        format!("{s:?}… ({} bytes)", bytes.len())
    } else {
        format!("{s:?}")
    }
}

fn valid_id(id: &Value) -> bool {
    id.is_string() || id.is_i64() || id.is_u64()
}

/// The shape every guard answer has.
fn assert_answer(v: &Value) {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("answer is not an object: {v}"));
    assert_eq!(obj.get("jsonrpc"), Some(&Value::from("2.0")), "answer {v}");
    let code = v["error"]["code"].as_i64();
    assert!(
        matches!(code, Some(PARSE_ERROR | INVALID_REQUEST | INVALID_PARAMS)),
        "answer has error code {code:?}: {v}"
    );
    assert!(v["error"]["message"].is_string(), "answer {v}");
    let id = obj
        .get("id")
        .unwrap_or_else(|| panic!("answer has no id: {v}"));
    assert!(id.is_null() || valid_id(id), "answer id {id}");
    assert!(!v.to_string().contains('\n'), "answer spans lines: {v}");
}

/// `check_line` plus the invariants of its verdict.
fn checked(line: &[u8]) -> Verdict {
    let verdict = check_line(line);
    if line.len() <= 64 * 1024 {
        if let Some(fast) = check_line_fast(line) {
            assert_eq!(
                fast,
                check_line_full(line),
                "the fast check disagrees with the full one: {}",
                shown(line)
            );
        }
    }
    match &verdict {
        Verdict::Answer(v) => assert_answer(v),
        Verdict::Pass | Verdict::Cancel(_) => {
            let v: Value = serde_json::from_slice(line)
                .unwrap_or_else(|e| panic!("Pass for non-JSON ({e}): {}", shown(line)));
            assert_ne!(v["method"], "tools/call", "a call passed: {}", shown(line));
            if let Verdict::Cancel(id) = &verdict {
                assert_eq!(
                    v["method"],
                    "notifications/cancelled",
                    "Cancel: {}",
                    shown(line)
                );
                assert!(
                    v.get("id").is_none(),
                    "Cancel of a request: {}",
                    shown(line)
                );
                assert_eq!(
                    &v["params"]["requestId"],
                    id,
                    "Cancel of another id: {}",
                    shown(line)
                );
                assert!(valid_id(id), "Cancel with a bad id: {}", shown(line));
            }
            let obj = v
                .as_object()
                .unwrap_or_else(|| panic!("Pass for a non-object: {}", shown(line)));
            assert_eq!(
                obj.get("jsonrpc"),
                Some(&Value::from("2.0")),
                "Pass: {}",
                shown(line)
            );
            assert!(
                obj.get("method").is_some_and(Value::is_string),
                "Pass without a string method: {}",
                shown(line)
            );
            assert!(
                obj.get("id").is_none_or(valid_id),
                "Pass with a bad id: {}",
                shown(line)
            );
        }
        Verdict::Refer(r) if r.rejected.is_some() => {
            // Referred without its arguments: only for lines past the one nesting limit (which
            // may be past what a Value can hold).
            assert!(
                sharedos_proto::nesting::json_depth(line) > sharedos_proto::nesting::MAX_LINE_DEPTH,
                "Refer without arguments for a shallow line: {}",
                shown(line)
            );
            assert!(
                r.arguments.is_none(),
                "rejected with arguments: {}",
                shown(line)
            );
        }
        Verdict::Refer(r) => {
            let v: Value = serde_json::from_slice(line)
                .unwrap_or_else(|e| panic!("Refer for non-JSON ({e}): {}", shown(line)));
            assert_eq!(v["method"], "tools/call", "Refer: {}", shown(line));
            assert_eq!(
                r.id.as_ref(),
                v.get("id"),
                "Refer with another id: {}",
                shown(line)
            );
            assert!(
                r.id.as_ref().is_none_or(valid_id),
                "Refer with a bad id: {}",
                shown(line)
            );
            assert!(
                r.arguments.as_ref().is_none_or(|a| !a.is_null()),
                "Refer with null arguments: {}",
                shown(line)
            );
        }
        Verdict::Ignore(_) | Verdict::Response(_) => {}
    }
    verdict
}

/// The fake kernel's answer to a referred call.
fn referred(r: &Referral) -> Value {
    serde_json::json!({"jsonrpc": "2.0", "id": r.id, "result": {"referred": r.tool, "arguments": r.arguments}})
}

/// What the guard should do with a stdin stream, line by line.
#[derive(Debug, Default)]
struct Expected {
    passed: Vec<Vec<u8>>,
    /// The guard's own answers, in order.
    answers: Vec<Answer>,
    /// The fake kernel's answers to referred calls, in any order.
    referred: Vec<Value>,
}

#[derive(Debug)]
enum Answer {
    /// The answer `check_line` gives.
    Exactly(Value),
    /// A line of this many bytes (without its newline) over the limit.
    TooLong(usize),
}

fn model(stdin: &[u8]) -> Expected {
    let mut expected = Expected::default();
    let mut rest = stdin;
    while !rest.is_empty() {
        let (raw, terminated) = match memchr::memchr(b'\n', rest) {
            Some(i) => {
                let raw = &rest[..i];
                rest = &rest[i + 1..];
                (raw, true)
            }
            None => (std::mem::take(&mut rest), false),
        };
        if raw.len() > MAX_LINE_BYTES {
            // What the start of the line shows decides: a call is referred without arguments
            // (with the line's size and digest), anything else is answered -32600.
            let prefix = &raw[..raw.len().min(OVERSIZE_PREFIX_BYTES)];
            match check_oversize(raw.len(), prefix, &sha256_hex(raw)) {
                Verdict::Refer(r) if r.id.is_none() => {}
                Verdict::Refer(r) => expected.referred.push(referred(&r)),
                _ => expected.answers.push(Answer::TooLong(raw.len())),
            }
            continue;
        }
        let line = match raw.split_last() {
            Some((b'\r', line)) if terminated => line,
            _ => raw,
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match checked(line) {
            Verdict::Pass | Verdict::Cancel(_) => expected.passed.push(line.to_vec()),
            Verdict::Answer(v) => expected.answers.push(Answer::Exactly(v)),
            // A call without an id goes to the kernel, but nothing is answered.
            Verdict::Refer(r) if r.id.is_none() => {}
            Verdict::Refer(r) => expected.referred.push(referred(&r)),
            Verdict::Ignore(_) | Verdict::Response(_) => {}
        }
    }
    expected
}

/// The fake rmcp's reply to its `n`th line.
fn echo(n: usize) -> String {
    format!("{{\"jsonrpc\":\"2.0\",\"id\":null,\"result\":{{\"echo\":{n}}}}}\n")
}

/// Runs a session over `stdin`; returns the lines rmcp got (without newlines) and all of stdout.
async fn session(stdin: Vec<u8>, chunk: usize) -> (Vec<Vec<u8>>, Vec<u8>) {
    let (mut client_in, shim_in) = tokio::io::duplex(64 * 1024);
    let (shim_out, mut client_out) = tokio::io::duplex(64 * 1024);

    let feeder = tokio::spawn(async move {
        for piece in stdin.chunks(chunk) {
            client_in
                .write_all(piece)
                .await
                .expect("the guard reads stdin to its end");
        }
        client_in.shutdown().await.expect("stdin closes");
    });
    let stdout = tokio::spawn(async move {
        let mut out = Vec::new();
        client_out.read_to_end(&mut out).await.expect("read stdout");
        out
    });
    let fake_rmcp =
        |(rmcp_in, mut rmcp_out): (tokio::io::DuplexStream, tokio::io::DuplexStream)| async move {
            let mut input = BufReader::new(rmcp_in);
            let mut passed = Vec::new();
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = input
                    .read_until(b'\n', &mut line)
                    .await
                    .expect("read from the guard");
                if n == 0 {
                    break;
                }
                assert_eq!(
                    line.pop(),
                    Some(b'\n'),
                    "the guard passed an unterminated line: {}",
                    shown(&line)
                );
                let reply = echo(passed.len());
                let (a, b) = reply.as_bytes().split_at(reply.len() / 2);
                rmcp_out.write_all(a).await.expect("the writer reads rmcp");
                tokio::task::yield_now().await;
                rmcp_out.write_all(b).await.expect("the writer reads rmcp");
                passed.push(std::mem::take(&mut line));
            }
            // rmcp's input ended: the session is over, rmcp closes its output.
            drop(rmcp_out);
            passed
        };

    // A fake kernel answers each referred call after a yield; the link never ends.
    let passed = run(
        shim_in,
        shim_out,
        |r: Referral, _cancel: CancellationToken| {
            let answer = referred(&r).to_string().into_bytes();
            async move {
                tokio::task::yield_now().await;
                Some(answer)
            }
        },
        std::future::pending::<()>(),
        fake_rmcp,
        SESSION_TIMEOUT,
    )
    .await;
    feeder.await.expect("feeder");
    let out = stdout.await.expect("stdout reader");
    (passed, out)
}

fuzz_target!(|data: &[u8]| {
    // 1. The whole input as one line.
    checked(data);

    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let (chunk, stdin) = match rest {
        // 3. Pad the first line with `x` to MAX_LINE_BYTES - 2 + (bits 0-1 of the next byte)
        // bytes. Written in large pieces.
        [param, rest @ ..] if control == 0xff => {
            let first = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
            let target = MAX_LINE_BYTES - 2 + usize::from(param & 0x03);
            let mut padded = vec![b'x'; target.saturating_sub(first)];
            padded.extend_from_slice(rest);
            (64 * 1024, padded)
        }
        _ => (CHUNKS[usize::from(control & 0x07)], rest.to_vec()),
    };

    // 2. The streaming path against the model.
    let expected = model(&stdin);
    let (passed, out) = runtime().block_on(async {
        tokio::time::timeout(SESSION_TIMEOUT, session(stdin, chunk))
            .await
            .expect("the guarded session hung")
    });

    // check_line must pass every line the guard passed. (A line over 64 KiB is only compared with
    // the model's line below, which check_line passed: re-parsing megabytes here costs too much.)
    for line in passed.iter().filter(|l| l.len() <= 64 * 1024) {
        assert!(
            matches!(check_line(line), Verdict::Pass | Verdict::Cancel(_)),
            "the guard passed a line check_line does not pass: {}",
            shown(line)
        );
    }
    assert_eq!(
        passed.len(),
        expected.passed.len(),
        "lines passed to rmcp: got {:?}, expected {:?}",
        passed.iter().map(|l| shown(l)).collect::<Vec<_>>(),
        expected.passed.iter().map(|l| shown(l)).collect::<Vec<_>>()
    );
    for (got, want) in passed.iter().zip(&expected.passed) {
        assert!(
            got == want,
            "passed {} instead of {}",
            shown(got),
            shown(want)
        );
    }

    assert!(
        out.is_empty() || out.ends_with(b"\n"),
        "stdout ends mid-line: {}",
        shown(&out)
    );
    let mut echoes = 0usize;
    let mut answers = Vec::new();
    let mut referred_answers = Vec::new();
    for line in out.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let v: Value = serde_json::from_slice(line)
            .unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {}", shown(line)));
        if let Some(n) = v.get("result").and_then(|r| r.get("echo")) {
            assert_eq!(n.as_u64(), Some(echoes as u64), "rmcp lines out of order");
            echoes += 1;
        } else if v["result"].get("referred").is_some() {
            referred_answers.push(v);
        } else {
            assert_answer(&v);
            answers.push(v);
        }
    }
    assert_eq!(echoes, passed.len(), "rmcp lines lost on stdout");
    assert_eq!(
        answers.len(),
        expected.answers.len(),
        "guard answers: got {answers:?}, expected {:?}",
        expected.answers
    );
    for (got, want) in answers.iter().zip(&expected.answers) {
        match want {
            Answer::Exactly(want) => assert_eq!(got, want, "guard answer"),
            Answer::TooLong(len) => {
                assert_eq!(got["error"]["code"], INVALID_REQUEST, "{got}");
                let message = got["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    message.contains(&format!("{len} bytes")),
                    "overlong line of {len} bytes answered {got}"
                );
            }
        }
    }
    let mut want: Vec<String> = expected.referred.iter().map(Value::to_string).collect();
    let mut got: Vec<String> = referred_answers.iter().map(Value::to_string).collect();
    want.sort();
    got.sort();
    assert_eq!(got, want, "answers to referred calls");
});
