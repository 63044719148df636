//! Stage ①: reads raw samples from the eBPF ring buffer and decodes them.
//!
//! The reader runs on its own thread and never waits for the rest of the pipeline: when the
//! pipeline falls behind, the bounded channel is full and the sample is counted as dropped here
//! (and when the reader itself falls behind, the kernel counts `ringbuf_full`).
mod decode;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use crossbeam_channel::{Receiver, Sender, TrySendError};

pub use decode::{DecodeError, decode_sample};

use crate::{bpf::SampleRing, model::Sample};

/// Counters of the reader thread.
#[derive(Debug, Default)]
pub struct ReaderStats {
    pub received: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Samples dropped because the pipeline channel was full.
    pub channel_full: AtomicU64,
}

/// [`ReaderStats`] read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderCounts {
    pub received: u64,
    pub decode_errors: u64,
    pub channel_full: u64,
}

impl ReaderStats {
    pub fn counts(&self) -> ReaderCounts {
        ReaderCounts {
            received: self.received.load(Ordering::Relaxed),
            decode_errors: self.decode_errors.load(Ordering::Relaxed),
            channel_full: self.channel_full.load(Ordering::Relaxed),
        }
    }
}

/// Handle of the reader thread.
pub struct SampleReader {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<ReaderStats>,
}

impl SampleReader {
    /// Starts reading `ring` into a channel of `capacity` samples.
    pub fn spawn(ring: SampleRing, capacity: usize) -> (Self, Receiver<Sample>) {
        let (tx, rx) = crossbeam_channel::bounded(capacity);
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ReaderStats::default());
        let thread = {
            let stop = stop.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("sample-reader".into())
                .spawn(move || read_loop(ring, tx, &stop, &stats))
                .expect("spawning the sample reader thread")
        };
        (
            SampleReader {
                stop,
                thread: Some(thread),
                stats,
            },
            rx,
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

fn read_loop(mut ring: SampleRing, tx: Sender<Sample>, stop: &AtomicBool, stats: &ReaderStats) {
    let drain = |ring: &mut SampleRing| {
        ring.drain(|bytes| {
            stats.received.fetch_add(1, Ordering::Relaxed);
            match decode_sample(bytes) {
                Ok(sample) => match tx.try_send(sample) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        stats.channel_full.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(TrySendError::Disconnected(_)) => {}
                },
                Err(err) => {
                    if stats.decode_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!("undecodable sample from the eBPF program: {err}");
                    }
                }
            }
        })
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
/// 3 KiB, i.e. 50 ms of 260 busy CPUs at 100 Hz.
const DRAIN_INTERVAL: Duration = Duration::from_millis(50);
