//! The allocator's settings. The `inlet` binary allocates with mimalloc.

use std::ffi::{c_int, c_long};

// Links mimalloc into the library too, so its options are the ones the tests read.
use mimalloc as _;

/// `mi_option_purge_delay` in mimalloc's `mimalloc.h` (v2 and v3); libmimalloc-sys does not
/// name it.
const MI_OPTION_PURGE_DELAY: c_int = 15;

unsafe extern "C" {
    #[cfg(test)]
    fn mi_option_get(option: c_int) -> c_long;
    fn mi_option_set(option: c_int, value: c_long);
}

/// mimalloc 3 keeps freed pages committed for a second before it returns them; a checkpoint
/// frees a few hundred MB at once on threads other than those that allocated them, so the
/// pipeline's RSS stood at about twice its live memory. 10 ms (mimalloc 2's default) returns
/// them sooner at the same rate. `MIMALLOC_PURGE_DELAY` in the environment still wins.
pub fn return_freed_memory_promptly() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of mimalloc's options, which it reads atomically.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 10) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_delay_option_is_the_one_mimalloc_defaults_to_a_second() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: reads and sets one of mimalloc's options.
        unsafe {
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), 1000);
            return_freed_memory_promptly();
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), 10);
        }
    }
}
