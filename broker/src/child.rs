//! Programs the broker starts on its own behalf (an upstream through the sandbox launcher, the
//! secret helper, the witness command): what they get and how they end.
//!
//! - [`clean_env`]: none of the broker's own environment (its tokens, `OTEL_EXPORTER_OTLP_HEADERS`,
//!   whatever its service manager set), only `PATH`, `LANG` and `HOME` with fixed defaults and
//!   what the operator declared for that program.
//! - [`own_group`] / [`kill_group`]: a process group of its own, killed whole (what it forked
//!   goes with it), at a timeout or when it is done.

use std::process::Command;

/// `PATH` a helper program gets unless its declared environment sets one.
pub const CLEAN_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// `LANG` a helper program gets unless its declared environment sets one.
pub const CLEAN_LANG: &str = "C.UTF-8";
/// `HOME` a helper program gets unless its declared environment sets one (or a caller's
/// setting, e.g. a sandbox's `home`).
pub const CLEAN_HOME: &str = "/nonexistent";

/// Empties `cmd`'s environment, then gives it `PATH`, `LANG` and `HOME` ([`CLEAN_PATH`],
/// [`CLEAN_LANG`], `home`) and the `declared` variables, which override those three. The
/// program itself is looked up in the `PATH` it gets, not the broker's.
pub fn clean_env<'a>(
    cmd: &mut Command,
    home: &str,
    declared: impl IntoIterator<Item = (&'a str, &'a str)>,
) {
    cmd.env_clear()
        .env("PATH", CLEAN_PATH)
        .env("LANG", CLEAN_LANG)
        .env("HOME", home)
        .envs(declared);
}

/// Starts `cmd` as the leader of a process group of its own (its pgid is its pid), so that
/// [`kill_group`] of its pid ends it and everything it started that stayed in the group.
pub fn own_group(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
}

/// SIGKILL to the process group `pgid` (a pid given [`own_group`]); a group already gone is
/// fine.
pub fn kill_group(pgid: u32) {
    if let Some(p) = i32::try_from(pgid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
    }
}

/// Why a declared environment for a helper program cannot be used, if it cannot: names must be
/// non-empty, without `=` or NUL; values without NUL. `what` names the config key.
pub fn check_env<'a>(
    what: &str,
    declared: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), String> {
    for (name, value) in declared {
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(format!(
                "{what}: `{}` is not a variable name (non-empty, no `=` or NUL)",
                name.escape_debug()
            ));
        }
        if value.contains('\0') {
            return Err(format!("{what}: the value of `{name}` holds a NUL byte"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_env_holds_only_the_three_defaults_and_what_was_declared() {
        let mut cmd = Command::new("/usr/bin/env");
        clean_env(&mut cmd, CLEAN_HOME, [("A", "1"), ("PATH", "/opt/bin")]);
        let out = cmd.output().expect("env");
        let mut got: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        got.sort();
        assert_eq!(
            got,
            ["A=1", "HOME=/nonexistent", "LANG=C.UTF-8", "PATH=/opt/bin"]
        );
    }

    #[test]
    fn bad_names_and_values_are_refused() {
        assert!(check_env("witness_env", [("OK_1", "x")]).is_ok());
        for (n, v) in [("", "x"), ("A=B", "x"), ("A\0", "x"), ("A", "x\0y")] {
            let e = check_env("witness_env", [(n, v)]).expect_err(n);
            assert!(e.starts_with("witness_env: "), "{e}");
        }
    }
}
