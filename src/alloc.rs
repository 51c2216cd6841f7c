//! The allocators' settings. The `inlet` binary allocates with mimalloc; RocksDB and librdkafka
//! allocate with the C library's malloc.

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

/// `mi_option_allow_thp` in mimalloc 3's `mimalloc.h`.
const MI_OPTION_ALLOW_THP: c_int = 43;

/// Sets both allocators' options. Called first in `main`, before any thread starts.
pub fn configure() {
    return_freed_memory_promptly();
    limit_c_heap_arenas();
    without_huge_pages();
}

/// mimalloc asks for transparent huge pages for its memory, and a purge returns whole 2 MiB
/// pages, which the kernel zeroes in full when they are touched again: the pipeline spent 5.5%
/// of its CPU in page faults (4.5% with 4 KiB pages), and its peak RSS was about 10% higher
/// (see docs/benchmarks.md, Memory). Turned off for the whole process (RocksDB's and
/// librdkafka's memory too), as databases usually advise; `MIMALLOC_ALLOW_THP` in the
/// environment still wins.
fn without_huge_pages() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return;
    }
    // SAFETY: sets one of mimalloc's options, which it reads atomically.
    unsafe { mi_option_set(MI_OPTION_ALLOW_THP, 0) }
    #[cfg(target_os = "linux")]
    {
        /// `PR_SET_THP_DISABLE` in Linux's `prctl.h`.
        const PR_SET_THP_DISABLE: c_int = 41;
        unsafe extern "C" {
            fn prctl(option: c_int, ...) -> c_int;
        }
        // SAFETY: sets a flag of this process's memory; it fails only on kernels without it.
        unsafe {
            prctl(
                PR_SET_THP_DISABLE,
                1 as std::ffi::c_ulong,
                0_u64,
                0_u64,
                0_u64,
            )
        };
    }
}

/// mimalloc 3 keeps freed pages committed for a second before it returns them; a checkpoint
/// frees a few hundred MB at once on threads other than those that allocated them, so the
/// pipeline's RSS stood at about twice its live memory. 10 ms (mimalloc 2's default) returns
/// them sooner at the same rate. `MIMALLOC_PURGE_DELAY` in the environment still wins.
fn return_freed_memory_promptly() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of mimalloc's options, which it reads atomically.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 10) }
    }
}

/// The most heaps ("arenas") glibc's malloc keeps for the C and C++ code.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const C_HEAP_ARENAS: c_int = 2;

/// glibc gives each new thread a heap of its own, up to eight per core, and never returns the
/// free space inside them. RocksDB's flush and compaction threads and librdkafka's broker
/// threads each fill one with blocks and buffers that come and go, so the C heaps held about
/// 540 MiB with about 160 MiB in use. Two heaps hold about 250 MiB for the same use.
/// `MALLOC_ARENA_MAX` in the environment still wins.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn limit_c_heap_arenas() {
    /// `M_ARENA_MAX` in glibc's `malloc.h`.
    const M_ARENA_MAX: c_int = -8;
    unsafe extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: sets one of glibc's malloc parameters before threads allocate.
        unsafe { mallopt(M_ARENA_MAX, C_HEAP_ARENAS) };
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn limit_c_heap_arenas() {}

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

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn huge_pages_disabled() -> bool {
        /// `PR_GET_THP_DISABLE` in Linux's `prctl.h`.
        const PR_GET_THP_DISABLE: c_int = 42;
        unsafe extern "C" {
            fn prctl(option: c_int, ...) -> c_int;
        }
        // SAFETY: reads a flag of this process's memory.
        unsafe { prctl(PR_GET_THP_DISABLE, 0_u64, 0_u64, 0_u64, 0_u64) == 1 }
    }

    /// The flag is the process's, so the check runs in new processes of this test binary:
    /// one configured as `main` configures it, one left as the kernel starts it.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_process_runs_without_transparent_huge_pages() {
        const NAME: &str = "alloc::tests::the_process_runs_without_transparent_huge_pages";
        if let Some(configured) = std::env::var_os(CHILD) {
            if configured == "1" {
                configure();
                // SAFETY: reads one of mimalloc's options.
                assert_eq!(unsafe { mi_option_get(MI_OPTION_ALLOW_THP) }, 0);
            }
            assert!(huge_pages_disabled(), "huge pages allowed");
            return;
        }
        let child = |configured: &str| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--test-threads", "1", "--nocapture"])
                .env(CHILD, configured)
                .env_remove("MIMALLOC_ALLOW_THP")
                .output()
                .unwrap()
        };
        let said = |out: &std::process::Output| {
            let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&out.stderr));
            text
        };
        let configured = child("1");
        assert!(configured.status.success(), "{}", said(&configured));
        // The check itself sees the difference: a process left alone has them.
        let left = child("0");
        assert!(!left.status.success(), "{}", said(&left));
        assert!(
            said(&left).contains("huge pages allowed"),
            "{}",
            said(&left)
        );
    }

    /// Set in the process this test starts, which then checks the heaps its threads got.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    const CHILD: &str = "INLET_ALLOC_TEST_CHILD";

    /// The number of heaps is fixed when threads first allocate, so the check runs in a new
    /// process of this test binary whose first step is `configure`.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn threads_of_c_code_share_two_heaps() {
        const NAME: &str = "alloc::tests::threads_of_c_code_share_two_heaps";
        if std::env::var_os(CHILD).is_some() {
            configure();
            let heaps = c_heaps_after_threads_allocate(8);
            assert!(heaps <= C_HEAP_ARENAS as usize, "{heaps} C heaps");
            return;
        }
        let child = |limit: bool| {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args(["--exact", NAME, "--test-threads", "1", "--nocapture"])
                .env(CHILD, "1")
                .env_remove("MALLOC_ARENA_MAX");
            if !limit {
                // glibc's own default, as if inlet set nothing.
                cmd.env("MALLOC_ARENA_MAX", "16");
            }
            cmd.output().unwrap()
        };
        let said = |out: &std::process::Output| {
            let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&out.stderr));
            text
        };
        let limited = child(true);
        assert!(limited.status.success(), "{}", said(&limited));
        // The check itself sees the difference: with glibc's default the threads get more.
        let unlimited = child(false);
        assert!(!unlimited.status.success(), "{}", said(&unlimited));
        assert!(
            said(&unlimited).contains(" C heaps"),
            "{}",
            said(&unlimited)
        );
    }

    /// Starts `threads` threads that each allocate with C's malloc while the others hold
    /// theirs, and counts the heaps glibc's `malloc_info` reports.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn c_heaps_after_threads_allocate(threads: usize) -> usize {
        use std::ffi::{c_char, c_void};
        unsafe extern "C" {
            fn malloc(size: usize) -> *mut c_void;
            fn free(ptr: *mut c_void);
            fn malloc_info(options: c_int, stream: *mut c_void) -> c_int;
            fn open_memstream(buf: *mut *mut c_char, size: *mut usize) -> *mut c_void;
            fn fclose(stream: *mut c_void) -> c_int;
        }
        let all_hold = std::sync::Barrier::new(threads + 1);
        let released = std::sync::Barrier::new(threads + 1);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    // SAFETY: a C allocation, freed below.
                    let p = unsafe { malloc(1024) } as usize;
                    all_hold.wait();
                    released.wait();
                    // SAFETY: freed once, on the thread that allocated it.
                    unsafe { free(p as *mut c_void) };
                });
            }
            all_hold.wait();
            let mut buf: *mut c_char = std::ptr::null_mut();
            let mut len = 0usize;
            // SAFETY: `open_memstream` fills `buf`/`len` when the stream is closed; the buffer
            // is copied and freed with C's free, as its manual says.
            let xml = unsafe {
                let stream = open_memstream(&mut buf, &mut len);
                assert!(!stream.is_null());
                malloc_info(0, stream);
                fclose(stream);
                let xml = std::slice::from_raw_parts(buf as *const u8, len).to_vec();
                free(buf as *mut c_void);
                String::from_utf8(xml).unwrap()
            };
            released.wait();
            xml.matches("<heap nr=").count()
        })
    }
}
