//! Decoding on every core: batches of messages go to a fixed set of threads, and come back in
//! the order they were sent, so the pipeline applies changes exactly as the partitions hold
//! them while the next batches decode. The threads also type each change for the table's
//! shape the pipeline last published ([`DecodePool::type_for`]), and drop the batches the
//! pipeline is done with ([`DecodePool::recycle`]): both cost the applying thread as much as
//! an index lookup per change.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Mutex};

use tokio::sync::oneshot;

use super::{ChangeRecord, Decoded, Decoder, Shape};
use inlet_common::error::{Error, ErrorKind, Result};

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
    /// Per entry of `decoded`, in order: the change typed for the published shape, if one was
    /// published and the entry is a change.
    pub typed: Vec<Option<Typed>>,
}

/// A change typed on a decoding thread for a table's shape. It holds for the table only while
/// the table's shape is this very one (`Arc::ptr_eq`): a schema change makes a new shape, and
/// the change is typed again by whoever applies it.
pub struct Typed {
    pub shape: Arc<Shape>,
    /// [`Shape::record`] of the change.
    pub record: Result<ChangeRecord>,
    /// [`Shape::needs_change`] of the change.
    pub needs_change: bool,
    /// The change came without its images ([`Decoder::decode_typed`]): where the record is
    /// not taken, the message is decoded again.
    pub elided: bool,
}

enum Job {
    /// A batch to decode, and to type for the shape, if any.
    Decode(
        Vec<Message>,
        Option<Arc<Shape>>,
        oneshot::Sender<Vec<DecodedMessage>>,
    ),
    Drop(Vec<DecodedMessage>),
}

/// Threads that decode batches, and the batches sent and not yet taken back, oldest first.
pub struct DecodePool {
    decoder: Arc<dyn Decoder>,
    /// What batches sent are typed for.
    typing: Option<Arc<Shape>>,
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

fn decode_all(
    decoder: &dyn Decoder,
    shape: Option<&Arc<Shape>>,
    batch: Vec<Message>,
) -> Vec<DecodedMessage> {
    batch
        .into_iter()
        .map(|message| {
            let key = message.key.as_deref();
            let at_once = shape
                .zip(message.payload.as_deref())
                .and_then(|(shape, value)| {
                    let (raw, record) = decoder.decode_typed(key, value, shape)?;
                    Some((shape, raw, record))
                });
            if let Some((shape, raw, record)) = at_once {
                return DecodedMessage {
                    message,
                    decoded: Ok(vec![Decoded::Change(raw)]),
                    typed: vec![Some(Typed {
                        shape: shape.clone(),
                        record: Ok(record),
                        needs_change: false,
                        elided: true,
                    })],
                };
            }
            let decoded = decoder.decode(key, message.payload.as_deref());
            let typed = match (&decoded, shape) {
                (Ok(changes), Some(shape)) => changes
                    .iter()
                    .map(|d| match d {
                        Decoded::Change(raw) => Some(Typed {
                            shape: shape.clone(),
                            record: shape.record(raw),
                            needs_change: shape.needs_change(raw),
                            elided: false,
                        }),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            DecodedMessage {
                message,
                decoded,
                typed,
            }
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
            typing: None,
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
                    match job {
                        Ok(Job::Decode(batch, shape, reply)) => {
                            let _ = reply.send(decode_all(decoder.as_ref(), shape.as_ref(), batch));
                        }
                        Ok(Job::Drop(batch)) => drop(batch),
                        Err(_) => return,
                    }
                })
                .map_err(|e| {
                    Error::new(ErrorKind::Internal, "cannot start a decoding thread").with_source(e)
                })?;
            pool.threads.push(handle);
        }
        pool.jobs = Some(tx);
        Ok(pool)
    }

    /// The decoder the threads use, to decode a message again on the caller's thread.
    pub fn decoder(&self) -> &dyn Decoder {
        self.decoder.as_ref()
    }

    /// Types the changes of batches sent from now on for `shape` too (`None`: not at all).
    pub fn type_for(&mut self, shape: Option<Arc<Shape>>) {
        self.typing = shape;
    }

    /// The shape changes are typed for.
    pub fn typing_for(&self) -> Option<&Arc<Shape>> {
        self.typing.as_ref()
    }

    /// Drops a batch the pipeline is done with on a decoding thread: freeing every message's
    /// bytes and decoded images is work the applying thread need not do.
    pub fn recycle(&self, batch: Vec<DecodedMessage>) {
        if let Some(jobs) = &self.jobs {
            // Every thread gone: the batch comes back and is dropped here.
            let _ = jobs.send(Job::Drop(batch));
        }
    }

    /// Does a job on the caller's thread: decodes its batch, or drops it.
    fn run_here(&self, job: Job) -> Vec<DecodedMessage> {
        match job {
            Job::Decode(batch, shape, _) => {
                decode_all(self.decoder.as_ref(), shape.as_ref(), batch)
            }
            Job::Drop(_) => Vec::new(),
        }
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
                match jobs.send(Job::Decode(batch, self.typing.clone(), tx)) {
                    Ok(()) => Done::Waiting(rx),
                    // Every thread is gone (a panic): decode here rather than lose the batch.
                    Err(mpsc::SendError(job)) => Done::Ready(self.run_here(job)),
                }
            }
            None => Done::Ready(decode_all(
                self.decoder.as_ref(),
                self.typing.as_ref(),
                batch,
            )),
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
    use crate::upsert_json::UpsertJson;

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
    async fn changes_are_typed_for_the_shape_published_when_their_batch_was_sent() {
        use crate::config::TimeUnit;
        use crate::Column;
        use inlet_iceberg::types::{Type, Value};
        let column = |name: &str, ty| Column {
            name: name.into(),
            ty,
            required: false,
            time_unit: TimeUnit::Millis,
        };
        for threads in [1, 2] {
            let mut pool =
                DecodePool::new(Box::new(UpsertJson::new(&["id".into()])), threads).unwrap();
            pool.send(vec![message(0, 1, 1)]);
            let narrow = Arc::new(Shape::new(vec![column("id", Type::Long)]));
            pool.type_for(Some(narrow.clone()));
            pool.send(vec![message(0, 2, 2), message(0, 3, 3)]);
            let wide = Arc::new(Shape::new(vec![
                column("id", Type::Long),
                column("v", Type::String),
            ]));
            pool.type_for(Some(wide.clone()));
            pool.send(vec![message(0, 4, 4)]);
            // Nothing published: not typed.
            let first = pool.next().await.unwrap().unwrap();
            assert!(first[0].typed.is_empty());
            for d in pool.next().await.unwrap().unwrap() {
                let [Some(t)] = &d.typed[..] else {
                    panic!("one typed change per change")
                };
                assert!(Arc::ptr_eq(&t.shape, &narrow));
                // `v` is a field the narrow shape lacks.
                assert!(t.needs_change);
                let id = d.message.offset;
                let after = t.record.as_ref().unwrap().after.clone().unwrap();
                assert_eq!(after, vec![Value::Long(id)]);
            }
            let last = pool.next().await.unwrap().unwrap();
            let [Some(t)] = &last[0].typed[..] else {
                panic!("one typed change per change")
            };
            assert!(Arc::ptr_eq(&t.shape, &wide) && !t.needs_change);
            assert_eq!(
                t.record.as_ref().unwrap().after.clone().unwrap(),
                vec![Value::Long(4), Value::String("x4".into())]
            );
            pool.recycle(last);
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
