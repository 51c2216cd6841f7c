//! Decoding on every core: batches of messages go to a fixed set of threads, and come back in
//! the order they were sent, so the pipeline applies changes exactly as the partitions hold
//! them while the next batches decode.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Mutex};

use tokio::sync::oneshot;

use super::{Decoded, Decoder};
use crate::error::{Error, ErrorKind, Result};

/// A message as the pipeline keeps it once read from Kafka.
#[derive(Debug, Clone)]
pub struct Message {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
}

/// A message with what decoding made of it.
pub struct DecodedMessage {
    pub message: Message,
    pub decoded: Result<Vec<Decoded>>,
}

type Job = (Vec<Message>, oneshot::Sender<Vec<DecodedMessage>>);

/// Threads that decode batches, and the batches sent and not yet taken back, oldest first.
pub struct DecodePool {
    decoder: Arc<dyn Decoder>,
    jobs: Option<mpsc::Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    ahead: VecDeque<Ahead>,
}

/// A batch on its way: its messages' first offsets per partition (to read them again if the
/// batch is dropped) and the receiver of its result.
struct Ahead {
    first: Vec<(Arc<str>, i32, i64)>,
    len: usize,
    done: Done,
}

enum Done {
    Waiting(oneshot::Receiver<Vec<DecodedMessage>>),
    Ready(Vec<DecodedMessage>),
}

fn decode_all(decoder: &dyn Decoder, batch: Vec<Message>) -> Vec<DecodedMessage> {
    batch
        .into_iter()
        .map(|message| {
            let decoded = decoder.decode(message.key.as_deref(), message.payload.as_deref());
            DecodedMessage { message, decoded }
        })
        .collect()
}

impl DecodePool {
    /// `threads` decoding threads; with fewer than two, batches decode on the caller's thread
    /// when they are sent.
    pub fn new(decoder: Box<dyn Decoder>, threads: usize) -> Result<DecodePool> {
        let decoder: Arc<dyn Decoder> = Arc::from(decoder);
        let mut pool = DecodePool {
            decoder: decoder.clone(),
            jobs: None,
            threads: Vec::new(),
            ahead: VecDeque::new(),
        };
        if threads < 2 {
            return Ok(pool);
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let (rx, decoder) = (rx.clone(), decoder.clone());
            let handle = std::thread::Builder::new()
                .name(format!("inlet-decode-{i}"))
                .spawn(move || loop {
                    // The lock is held only while waiting for the next job.
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    let Ok((batch, reply)) = job else { return };
                    let _ = reply.send(decode_all(decoder.as_ref(), batch));
                })
                .map_err(|e| {
                    Error::new(ErrorKind::Internal, "cannot start a decoding thread").with_source(e)
                })?;
            pool.threads.push(handle);
        }
        pool.jobs = Some(tx);
        Ok(pool)
    }

    /// Batches sent and not yet taken back.
    pub fn in_flight(&self) -> usize {
        self.ahead.len()
    }

    /// Messages sent and not yet taken back.
    pub fn messages_in_flight(&self) -> usize {
        self.ahead.iter().map(|a| a.len).sum()
    }

    /// Sends a batch to be decoded.
    pub fn send(&mut self, batch: Vec<Message>) {
        let mut first: Vec<(Arc<str>, i32, i64)> = Vec::new();
        for m in &batch {
            if !first
                .iter()
                .any(|(t, p, _)| *p == m.partition && **t == *m.topic)
            {
                first.push((m.topic.clone(), m.partition, m.offset));
            }
        }
        let len = batch.len();
        let done = match &self.jobs {
            Some(jobs) => {
                let (tx, rx) = oneshot::channel();
                match jobs.send((batch, tx)) {
                    Ok(()) => Done::Waiting(rx),
                    // Every thread is gone (a panic): decode here rather than lose the batch.
                    Err(mpsc::SendError((batch, _))) => {
                        Done::Ready(decode_all(self.decoder.as_ref(), batch))
                    }
                }
            }
            None => Done::Ready(decode_all(self.decoder.as_ref(), batch)),
        };
        self.ahead.push_back(Ahead { first, len, done });
    }

    /// The oldest batch sent, decoded; `None` if none is on its way.
    pub async fn next(&mut self) -> Option<Result<Vec<DecodedMessage>>> {
        let ahead = self.ahead.pop_front()?;
        Some(match ahead.done {
            Done::Ready(out) => Ok(out),
            Done::Waiting(rx) => rx
                .await
                .map_err(|_| Error::new(ErrorKind::Internal, "a decoding thread stopped")),
        })
    }

    /// Forgets every batch on its way; returns where each of their partitions must be read
    /// again (its first message among them).
    pub fn drop_ahead(&mut self) -> Vec<(Arc<str>, i32, i64)> {
        let mut first: Vec<(Arc<str>, i32, i64)> = Vec::new();
        for a in self.ahead.drain(..) {
            for (t, p, o) in a.first {
                if !first.iter().any(|(ft, fp, _)| *fp == p && *ft == t) {
                    first.push((t, p, o));
                }
            }
        }
        first
    }
}

impl Drop for DecodePool {
    fn drop(&mut self) {
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::upsert_json::UpsertJson;

    fn message(partition: i32, offset: i64, id: i64) -> Message {
        Message {
            topic: Arc::from("t"),
            partition,
            offset,
            timestamp_ms: None,
            key: Some(format!("{{\"id\":{id}}}").into_bytes()),
            payload: Some(format!("{{\"id\":{id},\"v\":\"x{offset}\"}}").into_bytes()),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_come_back_in_the_order_they_were_sent() {
        for threads in [1, 3] {
            let mut pool =
                DecodePool::new(Box::new(UpsertJson::new(&["id".into()])), threads).unwrap();
            let mut offset = 0;
            for b in 0..20 {
                let batch = (0..(b % 7) + 1)
                    .map(|_| {
                        offset += 1;
                        message((offset % 3) as i32, offset, offset)
                    })
                    .collect();
                pool.send(batch);
            }
            assert_eq!(pool.in_flight(), 20);
            let mut seen = Vec::new();
            while let Some(batch) = pool.next().await {
                for d in batch.unwrap() {
                    assert!(d.decoded.is_ok());
                    seen.push(d.message.offset);
                }
            }
            assert_eq!(seen, (1..=offset).collect::<Vec<_>>(), "threads {threads}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_batches_name_where_each_partition_reads_again() {
        let mut pool = DecodePool::new(Box::new(UpsertJson::new(&["id".into()])), 2).unwrap();
        pool.send(vec![
            message(0, 10, 1),
            message(1, 20, 2),
            message(0, 11, 3),
        ]);
        pool.send(vec![message(1, 21, 4), message(2, 30, 5)]);
        let mut first = pool.drop_ahead();
        first.sort_by_key(|(_, p, _)| *p);
        let first: Vec<(i32, i64)> = first.into_iter().map(|(_, p, o)| (p, o)).collect();
        assert_eq!(first, vec![(0, 10), (1, 20), (2, 30)]);
        assert!(pool.next().await.is_none());
    }
}
