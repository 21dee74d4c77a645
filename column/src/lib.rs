//! `sharedos-column`: the MCP conformance column, with no authority of its own.
//!
//! It talks to the broker only as a host does, over the control socket, runs a real harness CLI
//! and grades each row from the record. The scripted model puts SharedOS in the model provider's
//! seat so the harnesses run offline; it is the only user of axum, which is why it lives here.
//!
//! # Layout
//! - [`runner`]: `column run`: open a turn, write the config, run the harness, grade.
//! - [`observed`]: what the harness offered its model (from the scripted model's log), mapped
//!   back to canonical names and graded (`offered-catalogue`, `tool-policy`).
//! - [`matrix`]: manifest summaries, the interop matrix of docs/interop.md, and `column compare`.
//! - [`scripted_model`]: a scripted model provider on loopback (Anthropic Messages, OpenAI
//!   Responses and Chat Completions).
//! - [`grade`]: a row's or a check's grade, below `runner` and `observed` alike (`runner` uses
//!   `observed`, never the other way round).

pub mod grade;
pub mod matrix;
pub mod observed;
pub mod runner;
pub mod scripted_model;

/// Locks `m`, taking the data even if a panicking thread poisoned it.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
