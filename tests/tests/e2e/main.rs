//! End-to-end tests: one binary, a module per scenario, the kit in `kit.rs`.
//! Each test starts its own broker on its own temp runtime dir and stops everything it starts.
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::panic,
    reason = "test code: a failed expectation is the test failing"
)]

mod approvals;
mod arguments;
mod boundary;
mod budgets;
mod cli;
mod client_gone;
mod deploy;
mod deploy_planted;
mod docs;
mod elicitation;
mod evidence;
mod faults;
mod floods;
mod golden;
mod hello_gate;
mod hostile;
mod interop;
mod kit;
mod linking;
mod names;
mod outside_client;
mod page;
mod races;
mod readme;
mod remote;
mod remote_pool;
mod remote_signin;
mod replay;
mod resources;
mod robustness;
mod sandbox;
mod secrets;
mod security;
mod telemetry;
mod token_exchange;
mod turns;
mod upstream;
mod upstream_protocol;
mod views;
