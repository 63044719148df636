//! Exponential backoff with full jitter: the n-th consecutive failure waits a uniformly random
//! time in `[0, min(max, initial * 2^n)]`, so many agents recovering from the same outage do not
//! retry in lock step.
use std::time::Duration;

/// First ceiling of the random wait.
pub const INITIAL_BACKOFF: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff::with_rng(initial, max, fastrand::Rng::new())
    }

    /// With a seeded generator, for tests.
    pub fn with_rng(initial: Duration, max: Duration, rng: fastrand::Rng) -> Self {
        Backoff {
            initial: initial.min(max),
            max,
            failures: 0,
            rng,
        }
    }

    /// The largest wait the next failure can draw: `min(max, initial * 2^failures)`.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.failures.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }

    /// Records a failure and returns how long to wait before the next attempt. A server's
    /// `Retry-After` raises the wait (never beyond the maximum).
    pub fn next_wait(&mut self, retry_after: Option<Duration>) -> Duration {
        let ceiling = self.ceiling();
        self.failures = self.failures.saturating_add(1);
        let jittered = Duration::from_nanos(self.rng.u64(0..=ceiling.as_nanos() as u64));
        match retry_after {
            Some(after) => jittered.max(after.min(self.max)),
            None => jittered,
        }
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// After a success the next failure starts from the initial ceiling again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff(max_secs: u64) -> Backoff {
        Backoff::with_rng(
            Duration::from_millis(500),
            Duration::from_secs(max_secs),
            fastrand::Rng::with_seed(7),
        )
    }

    #[test]
    fn ceiling_doubles_up_to_the_maximum() {
        let mut b = backoff(10);
        let mut ceilings = Vec::new();
        for _ in 0..8 {
            ceilings.push(b.ceiling().as_millis());
            b.next_wait(None);
        }
        assert_eq!(
            ceilings,
            [500, 1000, 2000, 4000, 8000, 10_000, 10_000, 10_000]
        );
        // Far beyond 2^31 failures the ceiling stays at the maximum instead of overflowing.
        b.failures = u32::MAX - 1;
        assert_eq!(b.ceiling(), Duration::from_secs(10));
        b.next_wait(None);
        assert_eq!(b.ceiling(), Duration::from_secs(10));
    }

    #[test]
    fn waits_are_jittered_within_the_ceiling() {
        let mut b = backoff(60);
        let mut waits = Vec::new();
        for _ in 0..200 {
            b.reset();
            for _ in 0..3 {
                b.next_wait(None);
            }
            // The fourth failure draws from [0, 4 s].
            waits.push(b.next_wait(None));
        }
        assert!(waits.iter().all(|w| *w <= Duration::from_secs(4)));
        let below_1s = waits
            .iter()
            .filter(|w| **w < Duration::from_secs(1))
            .count();
        let above_3s = waits
            .iter()
            .filter(|w| **w > Duration::from_secs(3))
            .count();
        // Full jitter: the whole range is used, not just the top.
        assert!(below_1s > 20 && above_3s > 20, "{below_1s} {above_3s}");
    }

    #[test]
    fn reset_starts_over_and_retry_after_is_honoured_up_to_the_maximum() {
        let mut b = backoff(5);
        for _ in 0..6 {
            b.next_wait(None);
        }
        assert_eq!(b.ceiling(), Duration::from_secs(5));
        b.reset();
        assert_eq!(b.failures(), 0);
        assert_eq!(b.ceiling(), Duration::from_millis(500));
        assert!(b.next_wait(Some(Duration::from_secs(3))) >= Duration::from_secs(3));
        assert_eq!(
            b.next_wait(Some(Duration::from_secs(3600))),
            Duration::from_secs(5)
        );
    }
}
