//! What `/health/ready` reports: the process-wide state the pipeline and its probes update
//! (partition assignment, the last answer of the broker, catalog and storage, the last
//! checkpoint, a stop at a bad record) and the checks readiness derives from it. Components are
//! logged once per change of state (failing, then answering again), with the real cause.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::metrics::{metrics, Component};
use inlet_common::error::RecordAt;

/// The readiness checks, in report order.
pub const CHECKS: [&str; 7] = [
    "pipeline",
    "assignment",
    "topics",
    "broker",
    "catalog",
    "storage",
    "checkpoint",
];

/// What the supervisor is doing with the pipeline.
#[derive(Debug, Clone)]
pub enum PipelineState {
    /// Connecting to the catalog and the broker.
    Starting,
    /// Consuming.
    Running,
    /// Failed with a transient fault; restarts at `at`.
    Restarting {
        at: Instant,
        attempt: u32,
        cause: String,
    },
    /// Stopped at a bad record under `errors.policy: fail`.
    Stopped(Stopped),
    /// SIGTERM or SIGINT received.
    ShuttingDown,
}

/// The bad record the pipeline stopped at.
#[derive(Debug, Clone)]
pub struct Stopped {
    pub at: RecordAt,
    pub reason: &'static str,
    pub message: String,
}

#[derive(Default)]
struct ComponentState {
    last_ok: Option<Instant>,
    failing_since: Option<Instant>,
    error: Option<String>,
}

struct State {
    pipeline: PipelineState,
    /// Partitions assigned in this run; `None` until the group assigned them.
    assignment: Option<Vec<(String, i32)>>,
    assigned_at: Option<Instant>,
    /// Configured topics the broker does not know; `None` until the broker has answered.
    missing_topics: Option<Vec<String>>,
    components: [ComponentState; 3],
    /// When the last checkpoint succeeded and when one last failed (with why).
    checkpoint_ok: Option<Instant>,
    checkpoint_failed: Option<(Instant, String)>,
    /// Since when records wait for a checkpoint.
    pending_since: Option<Instant>,
    commits_this_run: u64,
    run_started: Instant,
    /// Bad records an operator asked to skip.
    skips: HashSet<RecordAt>,
}

/// Tuning of the checks, from the `health` and `checkpoint` settings.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a transient fault of a component that answered before is tolerated.
    pub fault_grace: Duration,
    /// How often probes run; a component not heard from for three rounds (or the grace, if
    /// longer) counts as failing.
    pub probe_interval: Duration,
    /// The checkpoint interval: records may wait this long (plus the grace) for a commit.
    pub checkpoint_interval: Duration,
}

/// The process's health.
pub struct Health {
    state: Mutex<State>,
    limits: Mutex<Limits>,
    /// Wakes a supervisor waiting at a bad record when a skip is requested.
    pub skip_requested: Notify,
}

/// The process-wide health.
pub fn health() -> &'static Health {
    static HEALTH: OnceLock<Health> = OnceLock::new();
    HEALTH.get_or_init(Health::new)
}

impl Health {
    fn new() -> Health {
        Health {
            state: Mutex::new(State {
                pipeline: PipelineState::Starting,
                assignment: None,
                assigned_at: None,
                missing_topics: None,
                components: Default::default(),
                checkpoint_ok: None,
                checkpoint_failed: None,
                pending_since: None,
                commits_this_run: 0,
                run_started: Instant::now(),
                skips: HashSet::new(),
            }),
            limits: Mutex::new(Limits {
                fault_grace: Duration::from_secs(60),
                probe_interval: Duration::from_secs(10),
                checkpoint_interval: Duration::from_secs(60),
            }),
            skip_requested: Notify::new(),
        }
    }
}

/// One readiness check's outcome.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

/// Every check, and whether all pass.
#[derive(Debug, Clone)]
pub struct Report {
    pub ready: bool,
    pub checks: Vec<Check>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", if self.ready { "ready" } else { "not ready" })?;
        for c in &self.checks {
            let status = if c.ok { "ok" } else { "FAIL" };
            writeln!(f, "{}: {status}: {}", c.name, c.detail)?;
        }
        Ok(())
    }
}

fn ago(t: Instant) -> String {
    format!("{}s ago", t.elapsed().as_secs())
}

impl Health {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn limits(&self) -> Limits {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the limits the checks use.
    pub fn configure(&self, limits: Limits) {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner()) = limits;
    }

    /// The pipeline (re)starts: its assignment and run counters start over.
    pub fn starting(&self) {
        let mut s = self.state();
        s.pipeline = PipelineState::Starting;
        s.assignment = None;
        s.assigned_at = None;
        s.pending_since = None;
        s.commits_this_run = 0;
        s.run_started = Instant::now();
        metrics().pipeline_stopped.reset();
        metrics().buffered_records.set(0);
    }

    /// Sets what the supervisor is doing.
    pub fn set_pipeline(&self, state: PipelineState) {
        let mut s = self.state();
        if let PipelineState::Stopped(stop) = &state {
            metrics()
                .pipeline_stopped
                .with_label_values(&[
                    stop.at.topic.as_str(),
                    &stop.at.partition.to_string(),
                    stop.reason,
                ])
                .set(stop.at.offset);
        }
        s.pipeline = state;
    }

    /// Whether the pipeline is still connecting (nothing buffered that a shutdown could commit).
    pub fn is_starting(&self) -> bool {
        matches!(self.state().pipeline, PipelineState::Starting)
    }

    /// Whether the current run did well enough that its failure starts the backoff over: it
    /// committed a checkpoint, or kept its assignment for `long`.
    pub fn run_went_well(&self, long: Duration) -> bool {
        let s = self.state();
        s.commits_this_run > 0 || s.assigned_at.is_some_and(|t| t.elapsed() >= long)
    }

    /// Checkpoints committed since the pipeline last started.
    pub fn commits_this_run(&self) -> u64 {
        self.state().commits_this_run
    }

    /// The consumer group assigned `parts` (possibly none: more members than partitions).
    pub fn assigned(&self, parts: Vec<(String, i32)>) {
        let mut s = self.state();
        if s.assigned_at.is_none() {
            s.assigned_at = Some(Instant::now());
        }
        s.assignment = Some(parts);
    }

    /// The assignment was taken away; a new one follows.
    pub fn revoked(&self) {
        let mut s = self.state();
        s.assignment = None;
        s.assigned_at = None;
        s.pending_since = None;
    }

    /// The partitions assigned right now; `None` while the group has not assigned any.
    pub fn assignment(&self) -> Option<Vec<(String, i32)>> {
        self.state().assignment.clone()
    }

    /// Records configured topics the broker does not know (empty: all exist). Logged when the
    /// set changes.
    pub fn set_missing_topics(&self, missing: Vec<String>) {
        let mut s = self.state();
        if s.missing_topics.as_ref() != Some(&missing) {
            if missing.is_empty() {
                tracing::info!("Every configured topic exists");
            } else {
                // Debezium creates its topics as it first writes to them: no fault.
                tracing::info!(topics = ?missing, "Configured topics do not exist (yet); consuming them once they are created");
            }
            s.missing_topics = Some(missing);
        }
    }

    /// `component` answered.
    pub fn succeeded(&self, component: Component) {
        let mut s = self.state();
        let c = &mut s.components[component.index()];
        if let Some(since) = c.failing_since.take() {
            tracing::info!(
                component = component.as_str(),
                failed_for_s = since.elapsed().as_secs(),
                "{} answers again",
                capitalised(component)
            );
        }
        c.error = None;
        c.last_ok = Some(Instant::now());
        metrics()
            .component_up
            .with_label_values(&[component.as_str()])
            .set(1);
    }

    /// `component` failed with `error`: counted every time, logged when it starts failing.
    pub fn failed(&self, component: Component, error: &dyn fmt::Display) {
        let m = metrics();
        m.component_failures
            .with_label_values(&[component.as_str()])
            .inc();
        m.component_up
            .with_label_values(&[component.as_str()])
            .set(0);
        let mut s = self.state();
        let c = &mut s.components[component.index()];
        let text = error.to_string();
        if c.failing_since.is_none() {
            c.failing_since = Some(Instant::now());
            tracing::warn!(
                component = component.as_str(),
                error = %text,
                "{} is failing; retrying",
                capitalised(component)
            );
        } else {
            tracing::debug!(component = component.as_str(), error = %text, "Still failing");
        }
        c.error = Some(text);
    }

    /// Records a failure of the component an error of kind catalog, storage or Kafka names.
    pub fn failed_with(&self, error: &crate::Error) {
        use crate::ErrorKind;
        let component = match error.kind() {
            ErrorKind::Catalog => Component::Catalog,
            ErrorKind::Storage => Component::Storage,
            ErrorKind::Kafka => Component::Broker,
            _ => return,
        };
        self.failed(component, error);
    }

    /// Records are buffered for a checkpoint from now on (if not already).
    pub fn buffering(&self) {
        self.state().pending_since.get_or_insert_with(Instant::now);
    }

    /// A checkpoint ended.
    pub fn checkpoint_done(&self, result: Result<(), &crate::Error>) {
        let mut s = self.state();
        match result {
            Ok(()) => {
                s.checkpoint_ok = Some(Instant::now());
                s.checkpoint_failed = None;
                s.pending_since = None;
                s.commits_this_run += 1;
            }
            Err(e) => s.checkpoint_failed = Some((Instant::now(), e.to_string())),
        }
    }

    /// An operator asks to skip the bad record the pipeline stopped at; refused unless `at` is
    /// that record.
    pub fn request_skip(&self, at: RecordAt) -> Result<(), String> {
        let mut s = self.state();
        match &s.pipeline {
            PipelineState::Stopped(stop) if stop.at == at => {
                tracing::warn!(record = %at, "Skipping the bad record as requested");
                s.skips.insert(at);
                drop(s);
                self.skip_requested.notify_one();
                Ok(())
            }
            PipelineState::Stopped(stop) => Err(format!(
                "the pipeline is stopped at {}, not at {at}",
                stop.at
            )),
            _ => Err("the pipeline is not stopped at a bad record".into()),
        }
    }

    /// Whether an operator asked to skip the record at `at`.
    pub fn skip_granted(&self, topic: &str, partition: i32, offset: i64) -> bool {
        let s = self.state();
        !s.skips.is_empty()
            && s.skips.contains(&RecordAt {
                topic: topic.to_string(),
                partition,
                offset,
            })
    }

    /// The bad record the pipeline is stopped at, if it is.
    pub fn stopped(&self) -> Option<Stopped> {
        match &self.state().pipeline {
            PipelineState::Stopped(s) => Some(s.clone()),
            _ => None,
        }
    }

    /// Every check and whether the process is ready; also sets the health gauges.
    pub fn report(&self) -> Report {
        let limits = self.limits();
        let s = self.state();
        let running = matches!(s.pipeline, PipelineState::Running);
        let mut checks = Vec::with_capacity(CHECKS.len());
        let mut add =
            |name: &'static str, ok: bool, detail: String| checks.push(Check { name, ok, detail });

        let (ok, detail) = match &s.pipeline {
            PipelineState::Starting => (false, "starting: connecting to the catalog and the broker".into()),
            PipelineState::Running => (true, format!("running for {}s", s.run_started.elapsed().as_secs())),
            PipelineState::Restarting { at, attempt, cause } => (
                false,
                format!(
                    "restarting in {}s (attempt {attempt}) after: {cause}",
                    at.saturating_duration_since(Instant::now()).as_secs()
                ),
            ),
            PipelineState::Stopped(stop) => (
                false,
                format!(
                    "stopped at the bad record topic={} partition={} offset={} (reason {}) under errors.policy fail: {}; fix the source or the table, change errors.policy, or skip this record with POST /errors/skip?topic={}&partition={}&offset={} sending Authorization: Bearer <metrics.admin_token>",
                    stop.at.topic, stop.at.partition, stop.at.offset, stop.reason, stop.message,
                    stop.at.topic, stop.at.partition, stop.at.offset
                ),
            ),
            PipelineState::ShuttingDown => (false, "shutting down".into()),
        };
        add("pipeline", ok, detail);

        let (ok, detail) = match (&s.assignment, running) {
            (_, false) => (false, "the pipeline is not running".into()),
            (None, true) => (
                false,
                "waiting for the consumer group to assign partitions".into(),
            ),
            (Some(parts), true) => (true, format!("{} partitions assigned", parts.len())),
        };
        add("assignment", ok, detail);

        let (ok, detail) = match &s.missing_topics {
            None => (false, "the broker has not answered yet".into()),
            Some(missing) if missing.is_empty() => (true, "every configured topic exists".into()),
            Some(missing) => (false, format!("topics {} do not exist", missing.join(", "))),
        };
        add("topics", ok, detail);

        let stale_after = (limits.probe_interval * 3).max(limits.fault_grace);
        for component in Component::ALL {
            let c = &s.components[component.index()];
            let (ok, detail) = match (c.failing_since, c.last_ok) {
                (Some(since), last_ok) => {
                    let failing = since.elapsed();
                    let text = c.error.as_deref().unwrap_or("unknown error");
                    // Never answered in this process: a rollout that cannot work is not ready.
                    if last_ok.is_none() || failing >= limits.fault_grace {
                        (false, format!("failing for {}s: {text}", failing.as_secs()))
                    } else {
                        (
                            true,
                            format!(
                                "failing for {}s (tolerated for {}s): {text}",
                                failing.as_secs(),
                                limits.fault_grace.as_secs()
                            ),
                        )
                    }
                }
                (None, Some(t)) if running && t.elapsed() > stale_after => {
                    (false, format!("no answer since {}", ago(t)))
                }
                (None, Some(t)) => (true, format!("answered {}", ago(t))),
                (None, None) if running => (false, "not checked yet".into()),
                (None, None) => (false, "not contacted yet".into()),
            };
            add(component.as_str(), ok, detail);
        }

        let due = limits.checkpoint_interval + limits.fault_grace;
        let (ok, detail) = match (&s.checkpoint_failed, s.checkpoint_ok, s.pending_since) {
            (Some((t, why)), _, pending) if pending.is_some() || t.elapsed() < due => (
                false,
                format!("the last checkpoint failed {}: {why}", ago(*t)),
            ),
            (_, _, Some(p)) if p.elapsed() > due => (
                false,
                format!(
                    "records have waited {}s for a checkpoint (interval {}s)",
                    p.elapsed().as_secs(),
                    limits.checkpoint_interval.as_secs()
                ),
            ),
            (_, Some(t), _) => (true, format!("last committed {}", ago(t))),
            (_, None, _) => (true, "none due yet".into()),
        };
        add("checkpoint", ok, detail);
        drop(s);

        let ready = checks.iter().all(|c| c.ok);
        let m = metrics();
        m.ready.set(i64::from(ready));
        for c in &checks {
            m.check_ok.with_label_values(&[c.name]).set(i64::from(c.ok));
        }
        Report { ready, checks }
    }
}

fn capitalised(c: Component) -> &'static str {
    match c {
        Component::Broker => "Kafka",
        Component::Catalog => "The catalog",
        Component::Storage => "The storage",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(h: &Health, name: &str) -> Check {
        h.report()
            .checks
            .into_iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no check {name}"))
    }

    fn running(limits: Limits) -> Health {
        let h = Health::new();
        h.configure(limits);
        h.set_pipeline(PipelineState::Running);
        h.assigned(vec![("t".into(), 0)]);
        h
    }

    const QUICK: Limits = Limits {
        fault_grace: Duration::from_millis(100),
        probe_interval: Duration::from_millis(20),
        checkpoint_interval: Duration::from_millis(100),
    };

    #[test]
    fn a_component_that_never_answered_is_not_ready_and_one_that_did_gets_the_grace() {
        let h = running(QUICK);
        let c = check(&h, "storage");
        assert!(!c.ok && c.detail == "not checked yet", "{c:?}");
        h.failed(Component::Storage, &"refused");
        let c = check(&h, "storage");
        assert!(
            !c.ok && c.detail.contains("refused"),
            "never answered: {c:?}"
        );

        h.succeeded(Component::Catalog);
        h.failed(Component::Catalog, &"connection reset");
        let c = check(&h, "catalog");
        assert!(c.ok && c.detail.contains("tolerated"), "{c:?}");
        std::thread::sleep(Duration::from_millis(150));
        let c = check(&h, "catalog");
        assert!(!c.ok && c.detail.contains("connection reset"), "{c:?}");
        h.succeeded(Component::Catalog);
        assert!(check(&h, "catalog").ok);
    }

    #[test]
    fn a_component_not_heard_from_for_three_probe_rounds_and_the_grace_fails() {
        let h = running(QUICK);
        h.succeeded(Component::Broker);
        assert!(check(&h, "broker").ok);
        std::thread::sleep(Duration::from_millis(150));
        let c = check(&h, "broker");
        assert!(!c.ok && c.detail.starts_with("no answer since"), "{c:?}");
    }

    #[test]
    fn records_waiting_past_the_interval_and_the_grace_fail_the_checkpoint_check() {
        let h = running(QUICK);
        assert!(check(&h, "checkpoint").ok);
        h.buffering();
        assert!(check(&h, "checkpoint").ok, "within the interval");
        std::thread::sleep(Duration::from_millis(250));
        let c = check(&h, "checkpoint");
        assert!(
            !c.ok && c.detail.starts_with("records have waited"),
            "{c:?}"
        );
        h.checkpoint_done(Ok(()));
        let c = check(&h, "checkpoint");
        assert!(c.ok && c.detail.starts_with("last committed"), "{c:?}");
    }
}
