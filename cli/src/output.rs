//! Command output: every command writes to stdout through here, so a closed pipe
//! (`records | head -1`) ends the command quietly instead of panicking. Below every other module
//! of the CLI (`cli`, `demo`, `replay` use it; it uses none of them).

/// Stdout was closed by its reader (`records | head -1`): the command ends quietly, status 0.
#[derive(Debug, thiserror::Error)]
#[error("stdout is closed")]
pub struct StdoutClosed;

/// Writes command output. A closed pipe becomes [`StdoutClosed`] (which `main` turns into a
/// quiet exit 0) instead of `println!`'s panic; any other write error is an error.
pub fn write_out(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_fmt(args) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot write to stdout")),
    }
}

/// `println!` for command output, through [`write_out`] (use in functions returning
/// `anyhow::Result`).
macro_rules! outln {
    () => {
        $crate::output::write_out(format_args!("\n"))?
    };
    ($($t:tt)*) => {
        $crate::output::write_out(format_args!("{}\n", format_args!($($t)*)))?
    };
}
/// `print!` for command output, through [`write_out`].
macro_rules! out {
    ($($t:tt)*) => {
        $crate::output::write_out(format_args!($($t)*))?
    };
}
pub(crate) use {out, outln};

/// Prints `v` as pretty JSON, through [`write_out`].
pub(crate) fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    outln!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}
