//! Crash points for fault tests: `INLET_CRASH_AT=<step>:<n>` kills the process the n-th time it
//! reaches `step`, with no cleanup, as SIGKILL would. Unset, a crash point costs one atomic load.
//! `INLET_DELAY_AT=<step>:<ms>` makes a delay point wait instead.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Steps of a checkpoint where a crash is most telling.
pub const STEPS: [&str; 4] = [
    "before_upload",
    "after_upload",
    "after_metadata_write",
    "after_commit",
];

struct Plan {
    step: String,
    nth: u64,
    seen: AtomicU64,
}

fn plan() -> Option<&'static Plan> {
    static PLAN: OnceLock<Option<Plan>> = OnceLock::new();
    PLAN.get_or_init(|| {
        let spec = std::env::var("INLET_CRASH_AT").ok()?;
        let (step, nth) = spec.split_once(':').unwrap_or((spec.as_str(), "1"));
        Some(Plan {
            step: step.to_string(),
            nth: nth.parse().unwrap_or(1),
            seen: AtomicU64::new(0),
        })
    })
    .as_ref()
}

/// Dies here if the crash plan names this step and its count is reached.
pub fn crash_point(step: &str) {
    if let Some(p) = plan() {
        if p.step == step && p.seen.fetch_add(1, Ordering::SeqCst) + 1 == p.nth {
            eprintln!("INLET_CRASH_AT: crashing at {step}");
            std::process::abort();
        }
    }
}

/// Waits here for the milliseconds `INLET_DELAY_AT=<step>:<ms>` names, for tests of slow
/// steps (a long index rebuild). Unset, it costs one lookup of a cached setting.
pub async fn delay_point(step: &str) {
    static PLAN: OnceLock<Option<(String, u64)>> = OnceLock::new();
    let plan = PLAN.get_or_init(|| {
        let spec = std::env::var("INLET_DELAY_AT").ok()?;
        let (step, ms) = spec.split_once(':')?;
        Some((step.to_string(), ms.parse().ok()?))
    });
    if let Some((at, ms)) = plan {
        if at == step {
            tokio::time::sleep(std::time::Duration::from_millis(*ms)).await;
        }
    }
}
