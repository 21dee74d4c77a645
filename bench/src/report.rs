//! The report: the machine it ran on, the tables, the targets with met/missed, and the
//! hand-written findings (`bench/NOTES.md`), as one markdown document.
//!
//! It only formats: every number comes from the caller.

use std::fmt::Write as _;

/// Where and when the benchmark ran.
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory: String,
    pub kernel: String,
    pub rustc: String,
    pub date: String,
    pub commit: String,
    pub profile: &'static str,
    /// How the binaries under test are linked (static or dynamic), named one by one.
    pub linking: String,
    pub load_start: String,
    pub load_end: String,
    pub duration_s: f64,
}

impl Machine {
    pub fn capture() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, m)| m.trim().to_owned());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|kib| kib.parse::<f64>().ok())
            .map_or_else(
                || "unknown".to_owned(),
                |kib| format!("{:.1} GiB", kib / 1024.0 / 1024.0),
            );
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
        let now = time::OffsetDateTime::now_utc();
        let date = now
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|_| now.unix_timestamp().to_string());
        Self {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model,
            memory,
            kernel,
            rustc: command_line("rustc", &["-V"]).unwrap_or_else(|| "unknown".into()),
            date,
            commit: commit(),
            profile: "release",
            linking: String::new(),
            load_start: loadavg(),
            load_end: String::new(),
            duration_s: 0.0,
        }
    }
}

/// The 1, 5 and 15 minute load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn command_line(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd)
        .args(args)
        .current_dir(workspace())
        .output()
        .ok()?;
    out.status
        .success()
        // Only the end: `git status --porcelain` lines start with a meaningful space.
        .then(|| String::from_utf8_lossy(&out.stdout).trim_end().to_owned())
}

/// A 1-minute load average at or above this at the start marks the run as taken on a busy machine.
const BUSY_LOAD: f64 = 0.5;

fn workspace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The paths in `git status --porcelain` output (`XY path`), as code spans.
fn changed_files(porcelain: &str) -> Vec<String> {
    porcelain
        .lines()
        .filter_map(|l| l.get(3..).map(|p| format!("`{p}`")))
        .collect()
}

/// `abc1234`, and which tracked files had uncommitted changes (the working tree is shared).
fn commit() -> String {
    let head = command_line("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "?".into());
    let changed = changed_files(
        &command_line("git", &["status", "--porcelain", "--untracked-files=no"])
            .unwrap_or_default(),
    );
    match changed.len() {
        0 => head,
        n if n <= 10 => format!("{head}, with uncommitted changes in {}", changed.join(", ")),
        n => format!("{head}, with uncommitted changes in {n} tracked files"),
    }
}

/// One table with its heading and the paragraphs before it.
pub struct Table {
    pub title: String,
    pub text: Vec<String>,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: &str, header: &[&str]) -> Self {
        Self {
            title: title.to_owned(),
            text: vec![],
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: vec![],
        }
    }

    pub fn text(&mut self, p: impl Into<String>) {
        self.text.push(p.into());
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
}

/// One target of the issue, and whether this run met it.
pub struct Target {
    pub what: String,
    pub target: String,
    pub measured: String,
    pub met: bool,
}

pub fn verdict(met: bool) -> String {
    let word = if met { "met" } else { "**missed**" };
    word.to_owned()
}

pub struct Report {
    pub tables: Vec<Table>,
    pub targets: Vec<Target>,
    /// Iteration counts and other parameters, one line each.
    pub parameters: Vec<String>,
}

/// A table without rows (a section that could not run here says why in its text) prints nothing.
fn render_table(out: &mut String, header: &[String], rows: &[Vec<String>]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(
        out,
        "|{}|",
        header.iter().map(|_| " --- ").collect::<Vec<_>>().join("|")
    );
    for r in rows {
        let _ = writeln!(out, "| {} |", r.join(" | "));
    }
    out.push('\n');
}

impl Report {
    pub fn markdown(&self, m: &Machine, command: &str, notes: Option<&str>) -> String {
        let mut out = String::new();
        out.push_str("# Benchmarks\n\n");
        let _ = writeln!(
            out,
            "The boundary's cost against a direct MCP server, and how it scales (issue 7); a \
             sandboxed upstream's start, per-principal instances and remote providers, each \
             against its baseline measured in the same run (issues 32, 33, 34, 46). Generated \
             whole by the benchmark program in `bench/` (the findings at the end are \
             `bench/NOTES.md`); regenerate with:\n\n```sh\n{command}\n```\n"
        );
        out.push_str("## Machine and run\n\n");
        let _ = writeln!(
            out,
            "- machine: {} × {}, {} RAM, Linux {}",
            m.cpus, m.cpu_model, m.memory, m.kernel
        );
        let _ = writeln!(out, "- toolchain: {}, {} build", m.rustc, m.profile);
        if !m.linking.is_empty() {
            let _ = writeln!(out, "- linked: {}", m.linking);
        }
        let _ = writeln!(out, "- date: {}", m.date);
        let _ = writeln!(out, "- commit: {}", m.commit);
        let _ = writeln!(
            out,
            "- load average (1/5/15 min) at start: {}; at end: {}; run took {:.0} s",
            m.load_start, m.load_end, m.duration_s
        );
        // The 1-minute load when the benchmark started says whether others were using the cores.
        let busy = m
            .load_start
            .split_whitespace()
            .next()
            .and_then(|l| l.parse::<f64>().ok())
            .is_none_or(|l| l >= BUSY_LOAD);
        out.push_str(if busy {
            "- **the machine was shared**: other work was running on the same cores when the run \
             started, so every number here is noisy (medians more than p99s) and a missed target \
             is not by itself a regression; compare ratios measured in the same run rather than \
             absolute numbers across runs.\n\n"
        } else {
            "- the machine was quiet when the run started; the load at the end is the benchmark's \
             own processes.\n\n"
        });
        if !self.parameters.is_empty() {
            out.push_str("Parameters:\n\n");
            for p in &self.parameters {
                let _ = writeln!(out, "- {p}");
            }
            out.push('\n');
        }
        out.push_str("## Targets\n\n");
        let header: Vec<String> = ["what", "target", "measured", "result"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let rows: Vec<Vec<String>> = self
            .targets
            .iter()
            .map(|t| {
                vec![
                    t.what.clone(),
                    t.target.clone(),
                    t.measured.clone(),
                    verdict(t.met),
                ]
            })
            .collect();
        render_table(&mut out, &header, &rows);
        for t in &self.tables {
            let _ = writeln!(out, "## {}\n", t.title);
            for p in &t.text {
                let _ = writeln!(out, "{p}\n");
            }
            render_table(&mut out, &t.header, &t.rows);
        }
        if let Some(notes) = notes {
            out.push_str(notes.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod porcelain_tests {
    use super::changed_files;

    #[test]
    fn the_first_path_keeps_its_first_letter() {
        assert_eq!(
            changed_files(" M BENCHMARKS.md\nM  bench/NOTES.md"),
            vec!["`BENCHMARKS.md`".to_owned(), "`bench/NOTES.md`".to_owned()]
        );
    }
}
