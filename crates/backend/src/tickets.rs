//! Signal tickets: where a stream-ordered free's [`RetireSignal`] waits
//! between the call that queued the free and the one side that settles it.
//!
//! A driver tells a backend that a queued free has executed through a host
//! function or stream callback that runs on a driver thread. The signal must
//! not travel inside that callback's data: on a lost device the driver may
//! never run the callback, and the governor still has to learn that the
//! release was abandoned. So the signal is parked here under a ticket (a
//! number the callback carries), and whichever side comes first claims it:
//!
//! * the callback, once the free has executed: [`Tickets::claim`], then
//!   [`Claim::retire`];
//! * device loss or teardown: [`Tickets::claim_all`], then
//!   [`Claim::abandon`] on each; a callback that runs later finds its ticket
//!   gone and does nothing.
//!
//! The table's one lock is held only to insert or remove an entry, never
//! across a driver call or a signal's sink, so a driver callback may take it.
//! A claim owns the signal: it is settled exactly once because the entry
//! leaves the table under that lock, and [`Claim::retire`] and
//! [`Claim::abandon`] consume the claim.
//!
//! ```
//! use memgov_backend::{BackendProbe, RetireOutcome, RetireSignal, Tickets};
//! use std::sync::{Arc, Mutex};
//!
//! let probe = BackendProbe::new();
//! let tickets: Tickets<&str> = Tickets::default();
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! for (ticket, name) in [(1, "first"), (2, "second")] {
//!     let seen = seen.clone();
//!     let signal = RetireSignal::from_fn(move |o| seen.lock().unwrap().push((name, o)));
//!     tickets.park(ticket, signal, 4096, name);
//! }
//! // The driver's callback for ticket 1: the free executed.
//! let claim = tickets.claim(1).expect("parked");
//! assert_eq!(claim.retire(&probe), "first");
//! // A second claim of the same ticket finds nothing.
//! assert!(tickets.claim(1).is_none());
//! // The device is lost: every signal still parked is abandoned.
//! assert_eq!(tickets.abandon_all(&probe), ["second"]);
//! assert_eq!(
//!     *seen.lock().unwrap(),
//!     [("first", RetireOutcome::Retired), ("second", RetireOutcome::Abandoned)]
//! );
//! assert!(tickets.is_empty());
//! ```

use crate::{BackendProbe, RetireSignal};
use memgov_sync::lock;
use std::collections::HashMap;
use std::sync::Mutex;

/// Parked signals of queued frees, by ticket, each with the bytes it
/// releases and what the backend needs to finish the release (`T`: the
/// stream it was queued on, the address to give back, or nothing).
#[derive(Debug)]
pub struct Tickets<T> {
    parked: Mutex<HashMap<u64, Claim<T>>>,
}

impl<T> Default for Tickets<T> {
    fn default() -> Self {
        Self {
            parked: Mutex::new(HashMap::new()),
        }
    }
}

impl<T> Tickets<T> {
    /// Park `signal` under `ticket` until one side claims it. Park before
    /// the driver can run the callback that carries the ticket.
    ///
    /// # Panics
    ///
    /// If `ticket` is already parked: tickets are unique (a counter), and a
    /// second signal under one ticket would be settled by the wrong free.
    pub fn park(&self, ticket: u64, signal: RetireSignal, bytes: u64, item: T) {
        let previous = lock(&self.parked).insert(
            ticket,
            Claim {
                ticket,
                signal,
                bytes,
                item,
            },
        );
        assert!(
            previous.is_none(),
            "ticket {ticket} parked twice: tickets must be unique"
        );
    }

    /// Take the signal parked under `ticket`, if no one has yet.
    pub fn claim(&self, ticket: u64) -> Option<Claim<T>> {
        lock(&self.parked).remove(&ticket)
    }

    /// Take every signal still parked (device loss, teardown). Settle them
    /// after this returns: the table's lock is released by then.
    pub fn claim_all(&self) -> Vec<Claim<T>> {
        lock(&self.parked).drain().map(|(_, c)| c).collect()
    }

    /// Device loss: claim every signal still parked and
    /// [abandon](Claim::abandon) it, after the table's lock is released.
    /// Returns the items, in no particular order.
    pub fn abandon_all(&self, probe: &BackendProbe) -> Vec<T> {
        self.claim_all()
            .into_iter()
            .map(|c| c.abandon(probe))
            .collect()
    }

    /// How many signals are parked.
    pub fn len(&self) -> usize {
        lock(&self.parked).len()
    }

    /// Whether no signal is parked.
    pub fn is_empty(&self) -> bool {
        lock(&self.parked).is_empty()
    }
}

/// A claimed signal: the one side that took it settles it, once, with
/// [`retire`](Self::retire) or [`abandon`](Self::abandon). Dropped without
/// either, the signal settles as abandoned but the probe does not count it.
#[derive(Debug)]
#[must_use = "settle a claim with retire or abandon"]
pub struct Claim<T> {
    ticket: u64,
    signal: RetireSignal,
    bytes: u64,
    item: T,
}

impl<T> Claim<T> {
    /// The ticket it was parked under.
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// The bytes the queued free releases.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What the backend parked with the signal.
    pub fn item(&self) -> &T {
        &self.item
    }

    /// The free has executed: count it on `probe`, fire the signal, and hand
    /// back the item. Call with no lock held (the signal's sink runs here).
    pub fn retire(self, probe: &BackendProbe) -> T {
        probe.free_retired(self.bytes);
        self.signal.retire();
        self.item
    }

    /// The free will not be reported executed (the device is lost, or the
    /// wait for it failed): count it on `probe`, drop the signal unfired,
    /// and hand back the item.
    pub fn abandon(self, probe: &BackendProbe) -> T {
        probe.free_abandoned(self.bytes);
        drop(self.signal);
        self.item
    }
}
