//! Shared leaves for locks.

/// Locks `m`, taking the data even if a panicking thread poisoned it: every lock in the broker
/// leaves its data consistent at each unlock, so a panic elsewhere must not wedge it.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
