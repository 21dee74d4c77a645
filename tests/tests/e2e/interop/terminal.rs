//! A real terminal for a CLI: a detached session of a private tmux server (its own socket in the
//! test's temp dir, no config of the user's), read with `capture-pane` and typed into with
//! `send-keys`, as a person at that terminal would. Every screen the test acted on and every key
//! it sent are kept in order ([`Terminal::transcript`]). The server is killed on drop.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;

/// Columns and rows of the terminal.
pub const COLS: u16 = 200;
pub const ROWS: u16 = 50;

/// How often the screen is read while waiting for something on it.
const POLL: Duration = Duration::from_millis(100);

/// A person's pause before each key: they read the screen first. Claude Code 2.1.332's forms
/// ignore an `Enter` that comes within about 150 ms of the key before it (measured: dropped at
/// 50 and 100 ms, taken at 200 and 300 ms), which no person types.
pub const PAUSE: Duration = Duration::from_millis(500);

pub struct Terminal {
    socket: PathBuf,
    /// Where the shell the program runs under writes its exit status.
    status: PathBuf,
    /// What was shown and what was answered, in order (see [`Terminal::answered`]).
    pub transcript: Vec<String>,
    /// Every screen the test answered, whole (for the run's output).
    pub screens: Vec<Vec<String>>,
}

/// Is `tmux` there to run? Its `-V` line, or `None`.
pub async fn tmux_version() -> Option<String> {
    let out = Command::new("tmux").arg("-V").output().await.ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

impl Terminal {
    /// Starts `argv` in `cwd` on a `COLS`x`ROWS` terminal with exactly `env` as its environment
    /// (tmux adds `TERM`, `TMUX` and `TMUX_PANE`), under `sh` as a person's terminal runs it: the
    /// shell writes the program's exit status to a file when it ends ([`Terminal::ended`]), since
    /// tmux 3.3a was seen to leave the exited program unreaped, its status unknown, for over 20 s
    /// on a loaded machine. The pane stays when the program exits.
    pub async fn start(dir: &Path, cwd: &Path, env: &[(&str, String)], argv: &[String]) -> Self {
        let socket = dir.join("tmux.sock");
        let status = dir.join("exit-status");
        let conf = dir.join("tmux.conf");
        std::fs::write(
            &conf,
            "set -g remain-on-exit on\nset -g history-limit 5000\n",
        )
        .expect("tmux.conf");
        let mut cmd = Command::new("tmux");
        cmd.env_clear()
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .arg("-u")
            .arg("-S")
            .arg(&socket)
            .arg("-f")
            .arg(&conf)
            .args(["new-session", "-d", "-s", "person"])
            .args(["-x", &COLS.to_string(), "-y", &ROWS.to_string()])
            .arg("-c")
            .arg(cwd)
            .args(["/bin/sh", "-c", "\"$@\"; echo $? > \"$0\""])
            .arg(&status)
            .args(argv)
            .kill_on_drop(true);
        let out = tokio::time::timeout(crate::kit::WAIT, cmd.output())
            .await
            .expect("tmux started in time")
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self {
            socket,
            status,
            transcript: Vec::new(),
            screens: Vec::new(),
        }
    }

    async fn tmux(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("tmux");
        // `-u`: the screen is read as UTF-8 whatever the test's locale.
        cmd.arg("-u")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .kill_on_drop(true);
        let out = tokio::time::timeout(crate::kit::WAIT, cmd.output())
            .await
            .expect("tmux answered in time")
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The screen as it is now: its lines, trailing blanks cut, a no-break space (Claude Code
    /// puts one after its `❯`) read as a space.
    pub async fn screen(&self) -> Vec<String> {
        self.tmux(&["capture-pane", "-p", "-t", "person"])
            .await
            .lines()
            .map(|l| l.replace('\u{a0}', " ").trim_end().to_owned())
            .collect()
    }

    /// Reads the screen until `ready` holds for it (every [`POLL`], at most `within`), and
    /// returns it; fails showing the last screen read.
    pub async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        ready: impl Fn(&[String]) -> bool,
    ) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let screen = self.screen().await;
            if ready(&screen) {
                return screen;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out ({within:?}) waiting for the screen to show {what}; it shows:\n{}",
                shown(&screen).join("\n")
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Presses keys (tmux key names: `Up`, `Enter`, `Space`, `Escape`, ...), one at a time, each
    /// after a [`PAUSE`].
    pub async fn press(&mut self, keys: &[&str]) {
        for k in keys {
            tokio::time::sleep(PAUSE).await;
            self.tmux(&["send-keys", "-t", "person", k]).await;
        }
        self.transcript.push(format!("  keys: {}", keys.join(" ")));
    }

    /// Types text as it is (no key names), after a [`PAUSE`].
    pub async fn type_text(&mut self, text: &str) {
        tokio::time::sleep(PAUSE).await;
        self.tmux(&["send-keys", "-t", "person", "-l", text]).await;
        self.transcript.push(format!("  typed: {text}"));
    }

    /// Keeps `screen` as one the test is about to answer: whole in [`Terminal::screens`], and its
    /// last panel (`panel`) in the transcript under `heading`.
    pub fn answered(&mut self, heading: &str, screen: &[String]) {
        self.transcript.push(format!("screen: {heading}"));
        self.shows(&panel(screen));
        self.screens.push(shown(screen));
    }

    /// Keeps `lines` (of a screen) in the transcript, after the keys that led to them.
    pub fn shows(&mut self, lines: &[String]) {
        self.transcript
            .extend(lines.iter().map(|l| format!("  | {}", l.trim_end())));
    }

    /// Moves the cursor (`❯`) of the screen's last panel to the option that starts with
    /// `option` (`Up`/`Down`, each seen to move it), then presses `Enter`; every panel on the way
    /// goes to the transcript.
    pub async fn choose(&mut self, option: &str) {
        for _ in 0..8 {
            let p = panel(&self.screen().await);
            let Some(key) = towards(&p, option) else {
                panic!("no option `{option}` on the screen:\n{}", p.join("\n"));
            };
            self.press(&[key]).await;
            if key == "Enter" {
                return;
            }
            let before = cursor(&p);
            let screen = self
                .wait_for("the cursor to move", crate::kit::WAIT, |s| {
                    cursor(&panel(s)) != before
                })
                .await;
            self.shows(&panel(&screen));
        }
        panic!("the cursor never reached `{option}`");
    }

    /// Notes a line in the transcript.
    pub fn note(&mut self, line: String) {
        self.transcript.push(line);
    }

    /// The pane's state as tmux has it (for a failure's message).
    pub async fn pane(&self) -> String {
        self.tmux(&[
            "display-message",
            "-p",
            "-t",
            "person",
            "pane_pid #{pane_pid}, pane_dead #{pane_dead}, status #{pane_dead_status}, signal #{pane_dead_signal}",
        ])
        .await
        .trim()
        .to_owned()
            + &processes()
    }

    /// Once the program in the pane has ended: `exited N`, or `killed by signal N`, from the
    /// status its shell wrote, else from tmux once tmux has it (the pane is dead as soon as its
    /// terminal closes; tmux's status comes only once it reaps the process).
    pub async fn ended(&self) -> Option<String> {
        // The shell's word first (see `start`); a status over 128 is a signal's.
        if let Ok(text) = std::fs::read_to_string(&self.status)
            && let Ok(code) = text.trim().parse::<u32>()
        {
            return Some(match code {
                0..=128 => format!("exited {code}"),
                _ => format!("killed by signal {}", code - 128),
            });
        }
        let out = self
            .tmux(&[
                "display-message",
                "-p",
                "-t",
                "person",
                "#{pane_dead} #{pane_dead_status} #{pane_dead_signal}",
            ])
            .await;
        let mut f = out.split(' ').map(str::trim);
        match (f.next(), f.next(), f.next()) {
            (Some("1"), Some(status), _) if !status.is_empty() => Some(format!("exited {status}")),
            (Some("1"), _, Some(signal)) if !signal.is_empty() => {
                Some(format!("killed by signal {signal}"))
            }
            _ => None,
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Every process, for a failure's message (`ps`; empty if it cannot run).
fn processes() -> String {
    std::process::Command::new("ps")
        .args(["-eo", "pid,ppid,stat,etime,args"])
        .output()
        .map(|o| format!("\n{}", String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default()
}

/// The screen's lines that show something (blank lines dropped).
pub fn shown(screen: &[String]) -> Vec<String> {
    screen
        .iter()
        .filter(|l| !l.trim().is_empty())
        .cloned()
        .collect()
}

/// A rule across the screen (`────`, `▔▔▔▔`): where a TUI's panel starts.
fn is_rule(line: &str) -> bool {
    let t = line.trim();
    t.chars().count() >= 20 && t.chars().all(|c| c == '─' || c == '▔')
}

/// The last panel of the screen: the lines shown below its last rule (a question, a form, a
/// list), or the whole screen when it has no rule.
pub fn panel(screen: &[String]) -> Vec<String> {
    let start = screen.iter().rposition(|l| is_rule(l)).map_or(0, |i| i + 1);
    shown(&screen[start..])
}

/// Where the cursor (`❯`) is in `lines`.
fn cursor(lines: &[String]) -> Option<usize> {
    lines.iter().position(|l| l.trim_start().starts_with('❯'))
}

/// The column (in characters) where a line's text starts, after its cursor (`❯`) if it has one.
fn text_column(line: &str) -> usize {
    line.chars()
        .position(|c| c != ' ' && c != '❯')
        .unwrap_or(usize::MAX)
}

/// The line with the cursor (`❯`) in `lines`, and the option that starts with `option` (an
/// option's text starts in the cursor line's text column, so a question above the options is
/// never taken for one): `Up`, `Down` or `Enter` to choose it, `None` when it is not shown.
pub fn towards(lines: &[String], option: &str) -> Option<&'static str> {
    let at = cursor(lines)?;
    let column = text_column(&lines[at]);
    let want = lines.iter().position(|l| {
        text_column(l) == column
            && l.trim_start()
                .trim_start_matches('❯')
                .trim_start()
                .starts_with(option)
    })?;
    Some(match want.cmp(&at) {
        std::cmp::Ordering::Less => "Up",
        std::cmp::Ordering::Greater => "Down",
        std::cmp::Ordering::Equal => "Enter",
    })
}

/// `line` with every RFC 3339 UTC time (`2026-12-06T22:24:07.148599257Z`) as `<time>` and `path`
/// (the test's temp dir) as `<dir>`: what differs from run to run.
pub fn normalized(line: &str, path: &str) -> String {
    let line = line.replace(path, "<dir>");
    let b = line.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        let date = b.len() >= i + 11
            && b[i..i + 10].iter().enumerate().all(|(k, c)| {
                if k == 4 || k == 7 {
                    *c == b'-'
                } else {
                    c.is_ascii_digit()
                }
            })
            && b[i + 10] == b'T';
        if date {
            let end = b[i + 11..]
                .iter()
                .position(|c| !(c.is_ascii_digit() || *c == b':' || *c == b'.'))
                .map(|n| i + 11 + n);
            if let Some(z) = end.filter(|z| b[*z] == b'Z') {
                out.push_str("<time>");
                i = z + 1;
                continue;
            }
        }
        // Advance by one whole character.
        let ch = line[i..].chars().next().unwrap_or(' ');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

#[test]
fn times_and_the_workdir_are_normalized() {
    assert_eq!(
        normalized(
            "by 2026-12-06T22:24:07.148599257Z, it is; at /tmp/x/work and 2026-12-06T22:24:07Z",
            "/tmp/x"
        ),
        "by <time>, it is; at <dir>/work and <time>"
    );
    assert_eq!(
        normalized("“sharedos” 2026-12-06", "/w"),
        "“sharedos” 2026-12-06"
    );
    let screen: Vec<String> = [
        "top",
        "",
        &"─".repeat(30),
        "  Yes or no?",
        "",
        "  ❯ No",
        "    Yes",
    ]
    .map(String::from)
    .to_vec();
    assert_eq!(panel(&screen), ["  Yes or no?", "  ❯ No", "    Yes"]);
    assert_eq!(towards(&panel(&screen), "Yes"), Some("Down"));
    assert_eq!(towards(&panel(&screen), "No"), Some("Enter"));
    assert_eq!(towards(&panel(&screen), "Maybe"), None);
}
