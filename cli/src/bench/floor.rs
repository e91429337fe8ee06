//! The floors the boxed-pin row is measured against: what the pin contract
//! costs before the governor does anything (shared by `memgov bench` and
//! `benches/overhead.rs`).

use memgov::{
    ProviderContextIdentity, ProviderContextPin, ProviderContextPinError, ProviderContextPinSource,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The contract's own floor under any `Box<dyn ProviderContextPin>` that
/// keeps its context alive: a heap allocation holding an `Arc` clone, dropped
/// through the trait object. What a pin does beyond this is the governor's.
#[derive(Debug)]
pub struct FloorPin {
    _alive: Arc<u64>,
    context: ProviderContextIdentity,
}

impl FloorPin {
    /// One floor pin: `alive` cloned into a box, as a trait object.
    #[inline]
    pub fn boxed(
        alive: &Arc<u64>,
        context: ProviderContextIdentity,
    ) -> Box<dyn ProviderContextPin> {
        Box::new(FloorPin {
            _alive: Arc::clone(alive),
            context,
        })
    }
}

impl ProviderContextPin for FloorPin {
    fn context(&self) -> ProviderContextIdentity {
        self.context
    }
}

/// The floor plus what any pin that teardown waits for must add: one claim
/// word, taken with a compare-and-swap (a claim has a maximum) and given back
/// with a subtraction when the box is dropped. No governor code: what the
/// hardware charges for the contract and a waitable claim together.
#[derive(Debug)]
pub struct ClaimedFloorPin {
    claims: Arc<ClaimWord>,
    context: ProviderContextIdentity,
}

/// A claim count alone on its cache line(s), like the governor's pin word.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct ClaimWord(AtomicU64);

impl ClaimedFloorPin {
    #[inline(never)]
    pub fn take(
        claims: &Arc<ClaimWord>,
        context: ProviderContextIdentity,
    ) -> Box<dyn ProviderContextPin> {
        let word = &claims.0;
        let mut cur = word.load(Ordering::Relaxed);
        while let Err(actual) =
            word.compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed)
        {
            cur = actual;
        }
        Box::new(ClaimedFloorPin {
            claims: Arc::clone(claims),
            context,
        })
    }
}

/// The same claimed floor pin handed out through the contract's own API: an
/// `Arc<dyn ProviderContextPinSource>` whose `pin` returns a `Result`, with
/// the checks any correct claim makes (refused once closed, refused at a
/// maximum). Still no governor code.
#[derive(Debug)]
pub struct ClaimedFloorSource {
    claims: Arc<ClaimWord>,
    context: ProviderContextIdentity,
}

impl ClaimedFloorSource {
    /// A source handing out claims of `claims`.
    pub fn new(claims: &Arc<ClaimWord>, context: ProviderContextIdentity) -> Self {
        Self {
            claims: Arc::clone(claims),
            context,
        }
    }
}

/// The closed bit of a [`ClaimWord`], and its maximum below it.
const CLAIM_CLOSED: u64 = 1 << 63;

impl ProviderContextPinSource for ClaimedFloorSource {
    fn context(&self) -> ProviderContextIdentity {
        self.context
    }

    fn pin(&self) -> Result<Box<dyn ProviderContextPin>, ProviderContextPinError> {
        let word = &self.claims.0;
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            if cur & CLAIM_CLOSED != 0 {
                return Err(ProviderContextPinError::ContextUnavailable(self.context));
            }
            if cur >= CLAIM_CLOSED - 1 {
                return Err(ProviderContextPinError::PinCountOverflow(self.context));
            }
            match word.compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        Ok(Box::new(ClaimedFloorPin {
            claims: Arc::clone(&self.claims),
            context: self.context,
        }))
    }
}

impl Drop for ClaimedFloorPin {
    fn drop(&mut self) {
        self.claims.0.fetch_sub(1, Ordering::Release);
    }
}

impl ProviderContextPin for ClaimedFloorPin {
    fn context(&self) -> ProviderContextIdentity {
        self.context
    }
}
