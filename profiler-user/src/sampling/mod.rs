//! Stage ①: reads raw samples from the eBPF ring buffer and decodes them.
//!
//! The reader runs on its own thread and never waits for the rest of the pipeline: when the
//! pipeline falls behind, the queue is full and the sample is counted as dropped here (and when
//! the reader itself falls behind, the kernel counts `ringbuf_full`). The queue is bounded in
//! samples and, for the stack copies some samples carry (up to 16 KiB each, for the agent to
//! finish their walk), in bytes: past [`QUEUED_COPY_BYTES`] a new sample keeps its stack only
//! as far as BPF walked it, marked truncated, rather than the queue growing.
//!
//! The bound in samples is a count kept here, on a channel that allocates as it fills: a
//! bounded channel allocates all its slots at once, and 65,536 slots of a sample are 9.5 MiB
//! resident from the start for a queue that holds a few samples nearly all the time.
mod decode;

use std::{
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

pub use decode::{DecodeError, decode_sample};

use crate::{bpf::SampleRing, model::Sample};

/// Counters of the reader thread.
#[derive(Debug, Default)]
pub struct ReaderStats {
    pub received: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Samples dropped because the pipeline channel was full.
    pub channel_full: AtomicU64,
    /// Stack copies dropped because the queued ones had reached [`QUEUED_COPY_BYTES`].
    pub copies_shed: AtomicU64,
    /// Bytes of the stack copies in the channel now.
    queued_copy_bytes: AtomicUsize,
    /// Samples in the channel now.
    queued_samples: AtomicUsize,
}

/// The stack copies the channel holds at most, in bytes: with a pipeline stalled for seconds
/// (a large library's tables being built) the queue would otherwise hold up to 16 KiB for
/// each of its 65,536 samples.
pub const QUEUED_COPY_BYTES: usize = 16 << 20;

/// [`ReaderStats`] read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderCounts {
    pub received: u64,
    pub decode_errors: u64,
    pub channel_full: u64,
    pub copies_shed: u64,
}

impl ReaderStats {
    pub fn counts(&self) -> ReaderCounts {
        ReaderCounts {
            received: self.received.load(Ordering::Relaxed),
            decode_errors: self.decode_errors.load(Ordering::Relaxed),
            channel_full: self.channel_full.load(Ordering::Relaxed),
            copies_shed: self.copies_shed.load(Ordering::Relaxed),
        }
    }

    /// Counts `sample`'s stack copy into the queued bytes, or drops the copy (the stack is then
    /// cut where BPF stopped, and marked so) when it would pass `limit`. Returns the bytes
    /// counted, to give back if the sample is not queued after all.
    fn admit_copy(&self, sample: &mut Sample, limit: usize) -> usize {
        let bytes = sample.stack_copy_bytes();
        if bytes == 0 {
            return 0;
        }
        let admitted = self
            .queued_copy_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued + bytes <= limit).then_some(queued + bytes)
            })
            .is_ok();
        if admitted {
            return bytes;
        }
        self.copies_shed.fetch_add(1, Ordering::Relaxed);
        sample.stack_copy = None;
        sample.user_truncated = true;
        0
    }

    /// Counts one more sample into the queue, unless it holds `capacity` already.
    fn admit_sample(&self, capacity: usize) -> bool {
        self.queued_samples
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued < capacity).then_some(queued + 1)
            })
            .is_ok()
    }

    fn release_sample(&self) {
        self.queued_samples.fetch_sub(1, Ordering::AcqRel);
    }

    /// Samples in the queue now.
    pub fn queued_samples(&self) -> usize {
        self.queued_samples.load(Ordering::Acquire)
    }

    fn release_copy(&self, bytes: usize) {
        if bytes > 0 {
            self.queued_copy_bytes.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    /// Bytes of the stack copies queued now.
    pub fn queued_copy_bytes(&self) -> usize {
        self.queued_copy_bytes.load(Ordering::Acquire)
    }
}

/// Tells the pipeline that the reader queued samples (or stopped). The channel's own blocking
/// receive spins and then calls `sched_yield` a few times before it sleeps, at every wait: the
/// pipeline waits once per drain of the ring, and on a loaded host those yields were 3.4 % of
/// the agent's CPU. This sleeps on a futex at once.
#[derive(Debug, Default)]
struct Wakeup {
    pending: Mutex<bool>,
    signal: Condvar,
}

impl Wakeup {
    fn notify(&self) {
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.signal.notify_one();
    }

    /// Forgets a notification whose samples were taken without waiting.
    fn clear(&self) {
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = false;
    }

    /// Waits until notified (since the last wait or clear) or `timeout` has passed.
    fn wait(&self, timeout: Duration) {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let (mut pending, _) = self
            .signal
            .wait_timeout_while(pending, timeout, |pending| !*pending)
            .unwrap_or_else(|e| e.into_inner());
        *pending = false;
    }
}

/// The pipeline's end of the reader's channel: taking a sample out gives its stack copy's
/// bytes back to the budget.
pub struct SampleQueue {
    rx: Receiver<Sample>,
    stats: Arc<ReaderStats>,
    wakeup: Arc<Wakeup>,
}

impl SampleQueue {
    fn taken(&self, sample: Sample) -> Sample {
        self.stats.release_copy(sample.stack_copy_bytes());
        self.stats.release_sample();
        sample
    }

    /// The next sample, waiting up to about `timeout` for one.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Sample, RecvTimeoutError> {
        let received = match self.rx.try_recv() {
            Err(TryRecvError::Empty) => {
                // A notification left from a batch taken without waiting would end the wait
                // at once for nothing, so it is cleared first and the queue looked at again:
                // a sample queued after that look sets the flag, and the wait returns at once
                // or at the notification.
                self.wakeup.clear();
                match self.rx.try_recv() {
                    Err(TryRecvError::Empty) => {
                        self.wakeup.wait(timeout);
                        self.rx.try_recv()
                    }
                    received => received,
                }
            }
            received => received,
        };
        match received {
            Ok(sample) => Ok(self.taken(sample)),
            Err(TryRecvError::Empty) => Err(RecvTimeoutError::Timeout),
            Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
        }
    }

    /// The samples queued now, without waiting.
    pub fn try_iter(&self) -> impl Iterator<Item = Sample> + '_ {
        self.rx.try_iter().map(|sample| self.taken(sample))
    }

    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }
}

/// Handle of the reader thread.
pub struct SampleReader {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<ReaderStats>,
}

impl SampleReader {
    /// Starts reading `ring` into a queue of `capacity` samples (and [`QUEUED_COPY_BYTES`]).
    pub fn spawn(ring: SampleRing, capacity: usize) -> (Self, SampleQueue) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ReaderStats::default());
        let wakeup = Arc::new(Wakeup::default());
        let thread = {
            let stop = stop.clone();
            let stats = stats.clone();
            let wakeup = Arc::clone(&wakeup);
            std::thread::Builder::new()
                .name("sample-reader".into())
                .spawn(move || {
                    let sender = QueueSender {
                        tx,
                        stats: &stats,
                        capacity,
                    };
                    read_loop(ring, &sender, &stop, &wakeup);
                    // The channel closes as `sender` goes: a waiting pipeline sees it now.
                    drop(sender);
                    wakeup.notify();
                })
                .expect("spawning the sample reader thread")
        };
        let queue = SampleQueue {
            rx,
            stats: Arc::clone(&stats),
            wakeup,
        };
        (
            SampleReader {
                stop,
                thread: Some(thread),
                stats,
            },
            queue,
        )
    }

    /// Drains what is left in the ring buffer, then stops; the channel closes afterwards.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for SampleReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The reader's end of the queue, with its bounds.
struct QueueSender<'a> {
    tx: Sender<Sample>,
    stats: &'a ReaderStats,
    capacity: usize,
}

impl QueueSender<'_> {
    /// Queues `sample`, or counts it dropped when the queue holds `capacity` samples.
    fn send(&self, mut sample: Sample) {
        let stats = self.stats;
        if !stats.admit_sample(self.capacity) {
            stats.channel_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let counted = stats.admit_copy(&mut sample, QUEUED_COPY_BYTES);
        if self.tx.send(sample).is_err() {
            // The pipeline is gone (the agent is stopping).
            stats.release_copy(counted);
            stats.release_sample();
        }
    }
}

fn read_loop(mut ring: SampleRing, sender: &QueueSender<'_>, stop: &AtomicBool, wakeup: &Wakeup) {
    let stats = sender.stats;
    let drain = |ring: &mut SampleRing| {
        let before = stats.received.load(Ordering::Relaxed);
        ring.drain(|bytes| {
            stats.received.fetch_add(1, Ordering::Relaxed);
            match decode_sample(bytes) {
                Ok(sample) => sender.send(sample),
                Err(err) => {
                    if stats.decode_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!("undecodable sample from the eBPF program: {err}");
                    }
                }
            }
        });
        // Once per drain, not per sample: the pipeline takes the whole batch at one wake-up.
        if stats.received.load(Ordering::Relaxed) != before {
            wakeup.notify();
        }
    };
    // The BPF side submits without waking us; draining on a timer batches the work.
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(DRAIN_INTERVAL);
        drain(&mut ring);
    }
    // Samples taken before the stop request are still delivered.
    drain(&mut ring);
}

/// How often the reader empties the ring buffer. The 4 MiB buffer holds ~1,300 samples of
/// 3 KiB, i.e. 50 ms of 260 busy CPUs at 100 Hz. Not longer on a quieter host, though each
/// wake-up costs a switch (the reader's thread was 6.3 % of the agent's CPU on the host suite
/// at 20 a second, 4.1 % at 5): what a sample names is read from its process when the sample
/// is handled (Python code objects, /proc), and waits of up to 200 ms left a test's module
/// bodies, run once and freed at once by imports, unnamed (`[unknown python]`).
const DRAIN_INTERVAL: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Pid, StackCopy, Tid};

    fn sample_with_copy(bytes: usize) -> Sample {
        Sample {
            pid: Pid(7),
            tid: Tid(7),
            user_ips: vec![0x1000],
            stack_copy: Some(Box::new(StackCopy {
                rip: 0x1000,
                rsp: 0x7000,
                rbp: 0,
                exact_pc: true,
                bytes: vec![0; bytes],
            })),
            ..Default::default()
        }
    }

    #[test]
    fn queued_stack_copies_stay_within_their_bytes_and_are_given_back_when_taken() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::new(ReaderStats::default());
        let queue = SampleQueue {
            rx,
            stats: Arc::clone(&stats),
            wakeup: Arc::default(),
        };
        let limit = 10_000;
        let mut counted = Vec::new();
        for _ in 0..3 {
            let mut sample = sample_with_copy(4_000);
            counted.push(stats.admit_copy(&mut sample, limit));
            assert!(stats.admit_sample(8));
            tx.send(sample).unwrap();
        }
        assert_eq!(counted, [4_000, 4_000, 0]);
        // Two copies fit; the third sample is queued without one, its stack marked cut.
        assert_eq!(stats.queued_copy_bytes(), 8_000);
        assert_eq!(stats.counts().copies_shed, 1);
        let taken: Vec<Sample> = queue.try_iter().collect();
        assert_eq!(taken.len(), 3, "no sample is lost for its copy");
        assert!(
            taken[..2]
                .iter()
                .all(|s| s.stack_copy.is_some() && !s.user_truncated)
        );
        assert!(taken[2].stack_copy.is_none() && taken[2].user_truncated);
        assert_eq!(
            stats.queued_copy_bytes(),
            0,
            "taking a sample gives its bytes back"
        );
        assert_eq!(stats.queued_samples(), 0);

        // A sample without a copy costs nothing and is never marked.
        let mut plain = Sample::default();
        assert_eq!(stats.admit_copy(&mut plain, limit), 0);
        assert!(!plain.user_truncated);
        let mut again = sample_with_copy(4_000);
        assert_eq!(stats.admit_copy(&mut again, limit), 4_000);
        stats.release_copy(4_000);
        assert_eq!(stats.queued_copy_bytes(), 0);
    }

    /// The reader's sending end, the counters, the wake-up and the pipeline's queue.
    fn channel_and_queue() -> (Sender<Sample>, Arc<ReaderStats>, Arc<Wakeup>, SampleQueue) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::new(ReaderStats::default());
        let wakeup = Arc::new(Wakeup::default());
        let queue = SampleQueue {
            rx,
            stats: Arc::clone(&stats),
            wakeup: Arc::clone(&wakeup),
        };
        (tx, stats, wakeup, queue)
    }

    #[test]
    fn the_queue_holds_at_most_its_capacity_and_takes_more_once_emptied() {
        let (tx, stats, _, queue) = channel_and_queue();
        let sender = QueueSender {
            tx,
            stats: &stats,
            capacity: 3,
        };
        let with_pid = |pid| Sample {
            pid: Pid(pid),
            ..sample_with_copy(100)
        };
        for pid in 1..=5 {
            sender.send(with_pid(pid));
        }
        assert_eq!(stats.queued_samples(), 3);
        assert_eq!(stats.counts().channel_full, 2, "the two past the bound");
        assert_eq!(stats.queued_copy_bytes(), 300, "only queued copies count");
        let first = queue.recv_timeout(Duration::from_secs(1)).expect("queued");
        assert_eq!(first.pid, Pid(1));
        sender.send(with_pid(6));
        let rest: Vec<u32> = queue.try_iter().map(|s| s.pid.0).collect();
        assert_eq!(rest, [2, 3, 6], "in order, the dropped ones missing");
        assert_eq!(stats.queued_samples(), 0);
        assert_eq!(stats.queued_copy_bytes(), 0);

        // With the pipeline gone, nothing stays counted as queued.
        drop(queue);
        sender.send(with_pid(7));
        assert_eq!(stats.queued_samples(), 0);
        assert_eq!(stats.queued_copy_bytes(), 0);
    }

    #[test]
    fn a_waiting_pipeline_wakes_for_each_batch_and_sees_the_reader_stop() {
        let (tx, stats, wakeup, queue) = channel_and_queue();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<()>(0);
        let reader = std::thread::spawn({
            let stats = Arc::clone(&stats);
            move || {
                let sender = QueueSender {
                    tx,
                    stats: &stats,
                    capacity: 16,
                };
                for pid in [1, 2] {
                    // Queued only once the pipeline is about to wait (or waiting) for it.
                    let _ = ready_rx.recv();
                    std::thread::sleep(Duration::from_millis(20));
                    sender.send(Sample {
                        pid: Pid(pid),
                        ..Default::default()
                    });
                    wakeup.notify();
                }
                let _ = ready_rx.recv();
                drop(sender);
                wakeup.notify();
            }
        });
        // A lost wake-up would leave the wait to its whole minute and fail.
        for pid in [1, 2] {
            ready_tx.send(()).expect("reader running");
            let sample = queue.recv_timeout(Duration::from_secs(60)).expect("woken");
            assert_eq!(sample.pid, Pid(pid));
        }
        ready_tx.send(()).expect("reader running");
        assert!(matches!(
            queue.recv_timeout(Duration::from_secs(60)),
            Err(RecvTimeoutError::Disconnected)
        ));
        reader.join().expect("reader");
        // With nothing queued and the reader still there, the wait ends at its timeout.
        let (_reader_end, rx) = crossbeam_channel::unbounded();
        let idle = SampleQueue {
            rx,
            stats,
            wakeup: Arc::default(),
        };
        assert!(matches!(
            idle.recv_timeout(Duration::from_millis(10)),
            Err(RecvTimeoutError::Timeout)
        ));
    }

    #[test]
    fn a_batch_taken_without_waiting_does_not_end_the_next_wait_early() {
        let (tx, stats, wakeup, queue) = channel_and_queue();
        let sender = QueueSender {
            tx: tx.clone(),
            stats: &stats,
            capacity: 16,
        };
        // A batch queued and notified while the pipeline was busy, then taken without a wait.
        sender.send(Sample {
            pid: Pid(1),
            ..Default::default()
        });
        wakeup.notify();
        assert_eq!(queue.try_iter().count(), 1);
        let late = std::thread::spawn({
            let stats = Arc::clone(&stats);
            let wakeup = Arc::clone(&wakeup);
            move || {
                std::thread::sleep(Duration::from_millis(50));
                let sender = QueueSender {
                    tx,
                    stats: &stats,
                    capacity: 16,
                };
                sender.send(Sample {
                    pid: Pid(2),
                    ..Default::default()
                });
                wakeup.notify();
            }
        });
        // The old notification would end this wait at once, empty-handed.
        let sample = queue
            .recv_timeout(Duration::from_secs(60))
            .expect("the next batch, not a timeout");
        assert_eq!(sample.pid, Pid(2));
        late.join().expect("sender");
    }
}
