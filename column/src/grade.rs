//! A row's or a check's grade: whether what it claims held.

use serde::{Deserialize, Serialize};

/// `pass` only where the claim held; `not exercised` where the harness never got to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grade {
    Pass,
    Fail,
    NotExercised,
}

impl Grade {
    /// As the table and the matrix show it.
    pub fn word(self) -> &'static str {
        match self {
            Grade::Pass => "pass",
            Grade::Fail => "fail",
            Grade::NotExercised => "not exercised",
        }
    }
}
