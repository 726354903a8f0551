//! The one way gdrvm takes a lock.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, carrying on if a thread panicked while holding it. Device state stays
/// usable (every register write leaves it consistent), and a VMM whose vCPU thread
/// panicked must still stop the machine and tear down rather than panic again.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn test_lock_survives_a_panicking_holder() {
        let m = Arc::new(Mutex::new(1));
        let holder = m.clone();
        let panicked = std::thread::spawn(move || {
            let mut g = holder.lock().unwrap();
            *g = 2;
            panic!("holder panics with the lock held");
        })
        .join();
        assert!(panicked.is_err());
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 2);
    }
}
