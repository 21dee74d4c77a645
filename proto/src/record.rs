//! The record's shared formats: what every line's `at` looks like.

/// Now, as a record line's `at`: RFC 3339 UTC with microseconds
/// (`2026-12-03T16:05:05.123456Z`).
pub fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    now.format(&format)
        .unwrap_or_else(|_| now.unix_timestamp().to_string())
}
