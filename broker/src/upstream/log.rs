//! What an upstream may put in the broker's log: its `notifications/message`, its stderr and
//! what it announces, escaped, cut and bounded per provider.

use std::sync::{Arc, Mutex};

use super::{MAX_UPSTREAM_LOG_BYTES, UPSTREAM_LOG_LINES, UPSTREAM_LOG_WINDOW};
use crate::secrets::{Secret, redact_with};

/// What one upstream may put in the broker's log: [`UPSTREAM_LOG_LINES`] lines per
/// [`UPSTREAM_LOG_WINDOW`], each carrying at most [`MAX_UPSTREAM_LOG_BYTES`] of its text; the
/// rest is counted, and said.
pub struct UpstreamLog {
    provider: String,
    window: Mutex<LogWindow>,
    /// The sandbox launcher's last error line on the upstream's stderr (escaped, bounded): the
    /// reason a start failed before the upstream ran.
    launcher_error: Mutex<Option<String>>,
}

struct LogWindow {
    started: std::time::Instant,
    written: u32,
    /// Lines not written since the last one that was.
    held_back: u64,
}

impl UpstreamLog {
    pub fn new(provider: &str) -> Self {
        Self {
            provider: provider.to_owned(),
            window: Mutex::new(LogWindow {
                started: std::time::Instant::now(),
                written: 0,
                held_back: 0,
            }),
            launcher_error: Mutex::new(None),
        }
    }

    /// What the sandbox launcher said when it gave up, taken (once).
    pub(super) fn take_launcher_error(&self) -> Option<String> {
        self.launcher_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Writes a line with `write(provider, lines held back before it)` if the window has room;
    /// else counts it: the first one past the window's room says so, and when the window ends
    /// one line says how many were held back (unless a line written before then said it).
    pub fn line(self: &Arc<Self>, write: impl FnOnce(&str, u64)) {
        let admitted = {
            let mut w = crate::lock(&self.window);
            let now = std::time::Instant::now();
            if now.duration_since(w.started) >= UPSTREAM_LOG_WINDOW {
                w.started = now;
                w.written = 0;
            }
            if w.written < UPSTREAM_LOG_LINES {
                w.written += 1;
                Ok(std::mem::take(&mut w.held_back))
            } else {
                w.held_back += 1;
                Err((w.held_back == 1)
                    .then(|| UPSTREAM_LOG_WINDOW.saturating_sub(now.duration_since(w.started))))
            }
        };
        match admitted {
            Ok(held_back) => write(&self.provider, held_back),
            Err(Some(left)) => {
                tracing::warn!(
                    provider = %self.provider,
                    "the upstream sends more than {UPSTREAM_LOG_LINES} log lines in {} s: the rest are counted, not written",
                    UPSTREAM_LOG_WINDOW.as_secs()
                );
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let log = self.clone();
                    rt.spawn(async move {
                        tokio::time::sleep(left).await;
                        log.say_held_back();
                    });
                }
            }
            Err(None) => {}
        }
    }

    /// The count of lines held back and not yet said, in a line of its own.
    fn say_held_back(&self) {
        let held_back = std::mem::take(&mut crate::lock(&self.window).held_back);
        if held_back > 0 {
            tracing::warn!(provider = %self.provider, held_back, "upstream log lines held back (over {UPSTREAM_LOG_LINES} in {} s)", UPSTREAM_LOG_WINDOW.as_secs());
        }
    }
}

/// An upstream's text as one log line may carry it: control characters escaped (a newline in it
/// cannot start a line of its own), cut to [`MAX_UPSTREAM_LOG_BYTES`].
pub(super) fn upstream_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_UPSTREAM_LOG_BYTES + 8));
    for c in text.chars() {
        if out.len() > MAX_UPSTREAM_LOG_BYTES {
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    sharedos_proto::name::clip(&mut out, MAX_UPSTREAM_LOG_BYTES);
    out
}

/// How many of an upstream's last stderr lines a failed start shows.
pub const STDERR_TAIL_LINES: usize = 5;
/// How much of each of those lines it shows.
pub const STDERR_TAIL_BYTES: usize = 300;

/// An upstream's last stderr lines (redacted, escaped, cut): what a failed start shows.
#[derive(Default)]
pub struct StderrTail(Mutex<std::collections::VecDeque<String>>);

impl StderrTail {
    fn push(&self, line: String) {
        let mut t = crate::lock(&self.0);
        if t.len() == STDERR_TAIL_LINES {
            t.pop_front();
        }
        t.push_back(line);
    }

    /// The lines kept, oldest first.
    pub fn lines(&self) -> Vec<String> {
        crate::lock(&self.0).iter().cloned().collect()
    }
}

/// Reads an upstream's stderr line by line, each into the log through `log` (at DEBUG), keeping at
/// most [`MAX_UPSTREAM_LOG_BYTES`] of a line: a line without end is never buffered whole.
/// The secret values given to the instance are replaced by their names first.
pub(super) async fn drain_stderr(
    stderr: impl tokio::io::AsyncRead + Unpin,
    log: Arc<UpstreamLog>,
    secrets: Arc<[(String, Secret)]>,
    tail: Arc<StderrTail>,
) {
    use tokio::io::AsyncBufReadExt;
    let mut reader = tokio::io::BufReader::new(stderr);
    let mut line = Vec::new();
    loop {
        let Ok(chunk) = reader.fill_buf().await else {
            return;
        };
        if chunk.is_empty() {
            break;
        }
        let (part, ends) = match chunk.iter().position(|&b| b == b'\n') {
            Some(at) => (&chunk[..at], true),
            None => (chunk, false),
        };
        let room = (MAX_UPSTREAM_LOG_BYTES + 4).saturating_sub(line.len());
        line.extend_from_slice(&part[..part.len().min(room)]);
        let used = part.len() + usize::from(ends);
        reader.consume(used);
        if ends {
            stderr_line(&log, &line, &secrets, &tail);
            line.clear();
        }
    }
    if !line.is_empty() {
        stderr_line(&log, &line, &secrets, &tail);
    }
}

fn stderr_line(
    log: &Arc<UpstreamLog>,
    line: &[u8],
    secrets: &[(String, Secret)],
    tail: &StderrTail,
) {
    let text = String::from_utf8_lossy(line);
    {
        let mut raw = text.clone().into_owned();
        redact_with(secrets, &mut raw, &mut Default::default());
        let mut shown = upstream_text(&raw);
        sharedos_proto::name::clip(&mut shown, STDERR_TAIL_BYTES);
        tail.push(shown);
    }
    if let Some(e) = text.strip_prefix(super::sandbox::LAUNCHER_ERROR) {
        *log.launcher_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(upstream_text(e));
    }
    log.line(|provider, held_back| {
        let mut raw = String::from_utf8_lossy(line).into_owned();
        redact_with(secrets, &mut raw, &mut Default::default());
        let text = upstream_text(&raw);
        tracing::debug!(%provider, held_back, "upstream stderr: {text}");
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream's log lines: the window's room written, the rest counted and given to the
    /// next line written; the upstream's text escaped and cut.
    #[test]
    fn an_upstream_log_is_bounded_and_counted() {
        let log = Arc::new(UpstreamLog::new("noisy"));
        let mut written = vec![];
        for _ in 0..1000 {
            log.line(|provider, held_back| written.push((provider.to_owned(), held_back)));
        }
        assert_eq!(written.len(), UPSTREAM_LOG_LINES as usize);
        assert!(written.iter().all(|(p, n)| p == "noisy" && *n == 0));
        // The next window: its first line counts what the last one held back.
        crate::lock(&log.window).started -= UPSTREAM_LOG_WINDOW;
        let mut next = None;
        log.line(|_, held_back| next = Some(held_back));
        assert_eq!(next, Some(1000 - u64::from(UPSTREAM_LOG_LINES)));
        let text = upstream_text(&format!("a\nERROR forged\r\u{1b}[31m{}", "é".repeat(5000)));
        assert!(text.starts_with("a\\nERROR forged\\r\\u{1b}[31m"), "{text}");
        assert!(!text.chars().any(char::is_control), "{text}");
        assert!(
            text.len() <= MAX_UPSTREAM_LOG_BYTES && text.ends_with('…'),
            "{}",
            text.len()
        );
    }
}
