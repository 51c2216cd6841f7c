//! Keeps one pipeline running for the life of the process. A transient failure restarts it
//! from the table's offsets after a capped, growing backoff that starts over once a run went
//! well; a permanent one ends the process with the error; a bad record under
//! `errors.policy: fail` stops it, and the process stays up (unready, the record named in
//! `/health/ready`, logs and `inlet_pipeline_stopped_offset`) until the configuration file
//! changes or the record is skipped. SIGTERM and SIGINT are heard in every wait: the pipeline
//! commits what it has buffered if it can within `checkpoint.shutdown_timeout_ms`, and the
//! process exits 0.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::config::Config;
use crate::health::{health, Limits, PipelineState, Stopped};
use crate::metrics::metrics;
use crate::pipeline::Pipeline;
use inlet_common::error::{Error, ErrorKind, Result};

/// Restart delays: doubling from `first` up to `max`, back to `first` after a run that went
/// well.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
    attempt: u32,
}

impl Backoff {
    /// A backoff starting at `first`, never longer than `max`.
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max,
            next: first,
            attempt: 0,
        }
    }

    /// The delay before the next restart.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        self.attempt += 1;
        delay
    }

    /// Restarts after this one count as attempts since the last good run.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Starts over at the first step.
    pub fn reset(&mut self) {
        self.next = self.first;
        self.attempt = 0;
    }
}

/// The first and longest restart delay.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// How long a run must hold its assignment (without committing) to count as having gone well.
const GOOD_RUN: Duration = Duration::from_secs(60);

/// How long a pipeline with nothing buffered gets to leave the consumer group on shutdown.
const IDLE_SHUTDOWN: Duration = Duration::from_secs(3);

/// How often a pipeline stopped at a bad record looks for a changed configuration file.
const CONFIG_POLL: Duration = Duration::from_secs(2);

/// How a run of the pipeline ended.
enum Ended {
    /// It returned.
    Returned(Result<()>),
    /// Shutdown was requested and the pipeline did not finish in time; it was left behind.
    Abandoned,
}

/// What ended a stop at a bad record.
enum Resumed {
    Shutdown,
    Reloaded(Box<Config>),
    Skipped,
}

/// Runs the pipeline of `config` (loaded from `path`) until shutdown or a permanent error.
pub async fn supervise(
    path: PathBuf,
    mut config: Config,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
    let mut last_cause: Option<String> = None;
    loop {
        configure_health(&config);
        if *shutdown.borrow() {
            return Ok(());
        }
        health().starting();
        let ended = run_once(&config, &mut shutdown).await;
        let error = match ended {
            Ended::Returned(Ok(())) => return Ok(()),
            Ended::Abandoned => {
                tracing::warn!(
                    timeout_ms = config.checkpoint.shutdown_timeout_ms,
                    "The pipeline did not finish in time; exiting without its last checkpoint (its records are read again on the next start)"
                );
                return Ok(());
            }
            Ended::Returned(Err(e)) => e,
        };
        if *shutdown.borrow() {
            tracing::warn!(error = %error, "The pipeline failed while shutting down; its uncommitted records are read again on the next start");
            return Ok(());
        }
        metrics()
            .restarts
            .with_label_values(&[error.kind().as_str()])
            .inc();
        if let Some(at) = error.bad_record().cloned() {
            let stop = Stopped {
                at,
                reason: error.reason(),
                message: error.message().to_string(),
            };
            match stopped(&path, stop, &error, &mut shutdown).await {
                Resumed::Shutdown => return Ok(()),
                Resumed::Reloaded(c) => config = *c,
                Resumed::Skipped => {}
            }
            backoff.reset();
            last_cause = None;
            continue;
        }
        if !error.retryable() {
            return Err(error);
        }
        let went_well = health().run_went_well(GOOD_RUN);
        if went_well {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        let cause = error.to_string();
        if last_cause.as_deref() != Some(cause.as_str()) {
            if went_well {
                tracing::error!(error = %cause, retry_in_ms = delay.as_millis() as u64, "Pipeline failed; restarting from the table's offsets");
            } else {
                tracing::error!(error = %cause, retry_in_ms = delay.as_millis() as u64, attempt = backoff.attempt(), "Pipeline could not start or keep running; retrying");
            }
        } else {
            tracing::debug!(error = %cause, retry_in_ms = delay.as_millis() as u64, attempt = backoff.attempt(), "Failed again the same way; retrying");
        }
        last_cause = Some(cause.clone());
        health().set_pipeline(PipelineState::Restarting {
            at: Instant::now() + delay,
            attempt: backoff.attempt(),
            cause,
        });
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = requested(&mut shutdown) => return Ok(()),
        }
    }
}

fn configure_health(config: &Config) {
    health().configure(Limits {
        fault_grace: Duration::from_millis(config.health.fault_grace_ms),
        probe_interval: Duration::from_millis(config.health.probe_interval_ms),
        checkpoint_interval: Duration::from_millis(config.checkpoint.interval_ms),
    });
}

/// Resolves once shutdown is requested (at once if it already was).
async fn requested(shutdown: &mut watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        if shutdown.changed().await.is_err() {
            // The signal handler is gone; nothing can request a shutdown any more.
            std::future::pending::<()>().await;
        }
    }
}

/// Starts and runs the pipeline in a task of its own, so that no wait inside it (connecting,
/// recovery, commit retries) can hold up a shutdown beyond its deadline.
async fn run_once(config: &Config, shutdown: &mut watch::Receiver<bool>) -> Ended {
    let cfg = config.clone();
    let stop = shutdown.clone();
    let mut task = tokio::spawn(async move { Pipeline::start(cfg).await?.run(stop).await });
    tokio::select! {
        joined = &mut task => return Ended::Returned(joined_result(joined)),
        _ = requested(shutdown) => {}
    }
    // Nothing buffered: only leaving the group is left to do. Else the final checkpoint.
    let starting = health().is_starting();
    health().set_pipeline(PipelineState::ShuttingDown);
    let deadline = if starting {
        Duration::ZERO
    } else if metrics().buffered_records.get() == 0 {
        IDLE_SHUTDOWN
    } else {
        Duration::from_millis(config.checkpoint.shutdown_timeout_ms)
    };
    match tokio::time::timeout(deadline, &mut task).await {
        Ok(joined) => Ended::Returned(joined_result(joined)),
        Err(_) if starting || metrics().buffered_records.get() == 0 => {
            task.abort();
            Ended::Returned(Ok(()))
        }
        Err(_) => {
            task.abort();
            Ended::Abandoned
        }
    }
}

fn joined_result(joined: std::result::Result<Result<()>, tokio::task::JoinError>) -> Result<()> {
    joined.unwrap_or_else(|e| {
        Err(Error::new(ErrorKind::Internal, "the pipeline task ended abnormally").with_source(e))
    })
}

/// Waits at a bad record until shutdown, a valid change of the configuration file, or a skip
/// of exactly that record.
async fn stopped(
    path: &std::path::Path,
    stop: Stopped,
    error: &Error,
    shutdown: &mut watch::Receiver<bool>,
) -> Resumed {
    tracing::error!(
        topic = %stop.at.topic,
        partition = stop.at.partition,
        offset = stop.at.offset,
        reason = stop.reason,
        error = %error,
        "Stopped at a bad record (errors.policy fail); fix the source or the table, change errors.policy in the configuration file, or skip this record with POST /errors/skip?topic={}&partition={}&offset={} sending Authorization: Bearer <metrics.admin_token>",
        stop.at.topic, stop.at.partition, stop.at.offset
    );
    let original = std::fs::read(path).ok();
    health().set_pipeline(PipelineState::Stopped(stop));
    let mut rejected: Option<Vec<u8>> = None;
    loop {
        tokio::select! {
            _ = requested(shutdown) => return Resumed::Shutdown,
            _ = health().skip_requested.notified() => {
                if health().stopped().is_some_and(|s| health().skip_granted(&s.at.topic, s.at.partition, s.at.offset)) {
                    return Resumed::Skipped;
                }
            }
            _ = tokio::time::sleep(CONFIG_POLL) => {
                let now = std::fs::read(path).ok();
                if now == original || now == rejected {
                    continue;
                }
                match Config::load(path) {
                    Ok(c) => {
                        tracing::info!(config = %path.display(), "The configuration changed; restarting the pipeline with it");
                        return Resumed::Reloaded(Box::new(c));
                    }
                    Err(e) => {
                        tracing::error!(config = %path.display(), error = %e, "The configuration changed but is not valid; still stopped");
                        rejected = now;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_starts_over_after_a_good_run() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        let delays: Vec<u64> = (0..8).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(b.attempt(), 8);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_secs(1));
        assert_eq!(b.attempt(), 1);
    }
}
