//! The bounded queue of encoded push requests between the exporter and the pusher thread.
//!
//! Bounds, both in bytes: `--push-queue-size` for request bodies held in memory, and with a
//! spool `--spool-max-size` for the files on disk. Without a spool, beyond the memory bound the
//! oldest requests are dropped (and counted). With a spool every request is written to disk
//! first; beyond the memory bound the newest requests are kept on disk only (and read back when
//! their turn comes), and beyond the disk bound the oldest are dropped. Requests being sent (the
//! batch at the front) are never dropped, so the bounds can be exceeded by at most one batch.
use std::{collections::VecDeque, sync::Arc};

use super::spool::{Spool, SpooledEntry};

#[derive(Debug)]
struct Entry {
    id: u64,
    body_bytes: u64,
    /// The body, unless it is only on disk.
    memory: Option<Arc<[u8]>>,
    /// Size of the spool file, when it has one.
    spool_file_bytes: Option<u64>,
}

#[derive(Debug)]
pub struct PushQueue {
    entries: VecDeque<Entry>,
    memory_limit: u64,
    memory_bytes: u64,
    spool: Option<Spool>,
    spool_limit: u64,
    spool_bytes: u64,
    next_id: u64,
    /// The first `in_flight` entries are being sent.
    in_flight: usize,
    /// Requests dropped by a bound or unreadable in the spool.
    dropped: u64,
}

impl PushQueue {
    pub fn new(memory_limit: u64) -> Self {
        PushQueue {
            entries: VecDeque::new(),
            memory_limit,
            memory_bytes: 0,
            spool: None,
            spool_limit: u64::MAX,
            spool_bytes: 0,
            next_id: 1,
            in_flight: 0,
            dropped: 0,
        }
    }

    /// A queue backed by `spool`, starting with the requests a previous run left there.
    pub fn with_spool(
        memory_limit: u64,
        spool: Spool,
        spool_limit: u64,
        spooled: &[SpooledEntry],
    ) -> Self {
        let mut queue = PushQueue::new(memory_limit);
        for entry in spooled {
            queue.entries.push_back(Entry {
                id: entry.id,
                body_bytes: entry.file_bytes,
                memory: None,
                spool_file_bytes: Some(entry.file_bytes),
            });
            queue.spool_bytes += entry.file_bytes;
            queue.next_id = queue.next_id.max(entry.id + 1);
        }
        queue.spool = Some(spool);
        queue.spool_limit = spool_limit;
        queue.enforce_limits();
        queue
    }

    /// Appends a request; returns how many requests the bounds dropped to make room.
    pub fn push(&mut self, body: Vec<u8>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let spool_file_bytes = self.spool.as_ref().and_then(|spool| {
            spool
                .write(id, &body)
                .map_err(|err| {
                    tracing::warn!(
                        dir = %spool.dir().display(),
                        "cannot spool a profile, keeping it in memory only: {err}"
                    )
                })
                .ok()
        });
        let body_bytes = body.len() as u64;
        self.entries.push_back(Entry {
            id,
            body_bytes,
            memory: Some(body.into()),
            spool_file_bytes,
        });
        self.memory_bytes += body_bytes;
        self.spool_bytes += spool_file_bytes.unwrap_or(0);
        let before = self.dropped;
        self.enforce_limits();
        self.dropped - before
    }

    fn enforce_limits(&mut self) {
        while self.spool_bytes > self.spool_limit {
            if !self.drop_oldest() {
                break;
            }
        }
        while self.memory_bytes > self.memory_limit {
            // Newest first: the oldest are sent next and are best kept at hand.
            if let Some(entry) = self
                .entries
                .iter_mut()
                .rev()
                .find(|e| e.memory.is_some() && e.spool_file_bytes.is_some())
            {
                entry.memory = None;
                self.memory_bytes -= entry.body_bytes;
            } else if !self.drop_oldest() {
                break;
            }
        }
    }

    /// Drops the oldest request not being sent; false when there is none.
    fn drop_oldest(&mut self) -> bool {
        match self.entries.remove(self.in_flight) {
            Some(entry) => {
                self.forget(&entry);
                self.dropped += 1;
                true
            }
            None => false,
        }
    }

    fn forget(&mut self, entry: &Entry) {
        if entry.memory.is_some() {
            self.memory_bytes -= entry.body_bytes;
        }
        if let Some(file_bytes) = entry.spool_file_bytes {
            self.spool_bytes -= file_bytes;
            if let Some(spool) = &self.spool {
                spool.remove(entry.id);
            }
        }
    }

    /// Takes the next batch from the front for sending: at least one request (when any), at
    /// most `max_count`, and no more than `max_bytes` unless a single request is larger. Spool
    /// files that cannot be read back are skipped with a warning and counted as dropped.
    pub fn next_batch(&mut self, max_count: usize, max_bytes: u64) -> Vec<Arc<[u8]>> {
        debug_assert_eq!(self.in_flight, 0, "one batch at a time");
        let mut batch: Vec<Arc<[u8]>> = Vec::new();
        let mut batch_bytes = 0u64;
        let mut index = 0;
        while index < self.entries.len() && batch.len() < max_count.max(1) {
            let entry = &self.entries[index];
            let body = match (&entry.memory, &self.spool) {
                (Some(body), _) => Ok(body.clone()),
                (None, Some(spool)) => spool.read(entry.id).map(Arc::from),
                (None, None) => Err(super::spool::SpoolReadError::Lost),
            };
            match body {
                Ok(body) => {
                    if !batch.is_empty() && batch_bytes + body.len() as u64 > max_bytes {
                        break;
                    }
                    batch_bytes += body.len() as u64;
                    batch.push(body);
                    index += 1;
                }
                Err(err) => {
                    let path = self
                        .spool
                        .as_ref()
                        .map(|s| s.path_of(entry.id).display().to_string());
                    tracing::warn!(file = ?path, "skipping a spooled profile: {err}");
                    let entry = self.entries.remove(index).expect("index is in range");
                    self.forget(&entry);
                    self.dropped += 1;
                }
            }
        }
        self.in_flight = batch.len();
        batch
    }

    /// The batch taken by [`PushQueue::next_batch`] is done with (sent, or rejected for good):
    /// removes it, also from the spool.
    pub fn complete(&mut self) {
        let done = self.in_flight;
        self.in_flight = 0;
        for entry in self.entries.drain(..done).collect::<Vec<_>>() {
            self.forget(&entry);
        }
    }

    /// The batch could not be sent now; it stays at the front for the next attempt.
    pub fn release(&mut self) {
        self.in_flight = 0;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn memory_bytes(&self) -> u64 {
        self.memory_bytes
    }

    pub fn spool_bytes(&self) -> u64 {
        self.spool_bytes
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    pub fn has_spool(&self) -> bool {
        self.spool.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(tag: u8, len: usize) -> Vec<u8> {
        vec![tag; len]
    }

    fn tags(batch: &[Arc<[u8]>]) -> Vec<u8> {
        batch.iter().map(|b| b[0]).collect()
    }

    #[test]
    fn memory_bound_drops_the_oldest() {
        let mut queue = PushQueue::new(250);
        assert_eq!(queue.push(body(1, 100)), 0);
        assert_eq!(queue.push(body(2, 100)), 0);
        assert_eq!(queue.push(body(3, 100)), 1);
        assert_eq!(
            (queue.len(), queue.memory_bytes(), queue.dropped()),
            (2, 200, 1)
        );
        assert_eq!(tags(&queue.next_batch(10, u64::MAX)), [2, 3]);
        // A request larger than the whole bound cannot be kept at all.
        queue.release();
        assert_eq!(queue.push(body(4, 300)), 3);
        assert!(queue.is_empty());
        assert_eq!(queue.memory_bytes(), 0);
    }

    #[test]
    fn the_batch_being_sent_is_never_dropped() {
        let mut queue = PushQueue::new(250);
        queue.push(body(1, 100));
        queue.push(body(2, 100));
        assert_eq!(tags(&queue.next_batch(1, u64::MAX)), [1]);
        // 1 is in flight, so 2 goes instead.
        assert_eq!(queue.push(body(3, 100)), 1);
        queue.complete();
        assert_eq!(tags(&queue.next_batch(10, u64::MAX)), [3]);
        queue.complete();
        assert!(queue.is_empty());
        assert_eq!(queue.memory_bytes(), 0);
    }

    #[test]
    fn batches_respect_count_and_bytes_and_failed_batches_stay_in_front() {
        let mut queue = PushQueue::new(u64::MAX);
        for tag in 1..=5 {
            queue.push(body(tag, 10));
        }
        assert_eq!(tags(&queue.next_batch(2, u64::MAX)), [1, 2]);
        queue.release();
        assert_eq!(tags(&queue.next_batch(10, 25)), [1, 2]);
        queue.complete();
        assert_eq!(
            tags(&queue.next_batch(10, 5)),
            [3],
            "at least one, even if larger"
        );
        queue.complete();
        assert_eq!(tags(&queue.next_batch(10, u64::MAX)), [4, 5]);
        queue.complete();
        assert!(queue.next_batch(10, u64::MAX).is_empty());
    }

    #[test]
    fn spool_keeps_what_memory_cannot_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, spooled) = Spool::open(dir.path()).unwrap();
        let mut queue = PushQueue::with_spool(150, spool, u64::MAX, &spooled);
        for tag in 1..=4 {
            assert_eq!(queue.push(body(tag, 100)), 0, "the disk holds them");
        }
        assert_eq!(queue.memory_bytes(), 100, "only the oldest stays in memory");
        assert_eq!(queue.spool_bytes(), 4 * 120);
        assert_eq!(tags(&queue.next_batch(1, u64::MAX)), [1]);
        queue.complete();
        drop(queue);

        let (spool, spooled) = Spool::open(dir.path()).unwrap();
        assert_eq!(spooled.len(), 3);
        let mut queue = PushQueue::with_spool(150, spool, u64::MAX, &spooled);
        assert_eq!(queue.memory_bytes(), 0);
        assert_eq!(tags(&queue.next_batch(10, u64::MAX)), [2, 3, 4]);
        queue.complete();
        // New ids continue after the old ones, so order survives the restart.
        queue.push(body(5, 10));
        drop(queue);
        let (_, spooled) = Spool::open(dir.path()).unwrap();
        assert_eq!(spooled.len(), 1);
        assert!(spooled[0].id > 4);
    }

    #[test]
    fn spool_bound_drops_the_oldest_files() {
        let dir = tempfile::tempdir().unwrap();
        let (spool, spooled) = Spool::open(dir.path()).unwrap();
        let mut queue = PushQueue::with_spool(1 << 20, spool, 250, &spooled);
        queue.push(body(1, 100));
        queue.push(body(2, 100));
        assert_eq!(queue.push(body(3, 100)), 1);
        assert_eq!(queue.spool_bytes(), 240);
        assert_eq!(tags(&queue.next_batch(10, u64::MAX)), [2, 3]);
        queue.complete();
        assert_eq!(queue.spool_bytes(), 0);
        let files = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                !e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with('.')
            })
            .count();
        assert_eq!(files, 0, "sent and dropped requests leave no files");
    }

    #[test]
    fn corrupted_spool_files_are_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (spool, spooled) = Spool::open(dir.path()).unwrap();
            let mut queue = PushQueue::with_spool(1 << 20, spool, u64::MAX, &spooled);
            for tag in 1..=4 {
                queue.push(body(tag, 50));
            }
        }
        let mut files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "push"))
            .collect();
        files.sort();
        std::fs::write(&files[0], b"not a spool file").unwrap();
        let mut truncated = std::fs::read(&files[2]).unwrap();
        truncated.truncate(30);
        std::fs::write(&files[2], truncated).unwrap();

        let (spool, spooled) = Spool::open(dir.path()).unwrap();
        let mut queue = PushQueue::with_spool(1 << 20, spool, u64::MAX, &spooled);
        assert_eq!(queue.len(), 4);
        assert_eq!(tags(&queue.next_batch(10, u64::MAX)), [2, 4]);
        assert_eq!(queue.dropped(), 2);
        assert!(
            !files[0].exists() && !files[2].exists(),
            "corrupted files are deleted"
        );
        queue.complete();
        assert!(queue.is_empty());
        assert_eq!(queue.spool_bytes(), 0);
    }
}
