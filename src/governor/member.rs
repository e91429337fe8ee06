//! The context as a member of its [`SharedBudget`](super::SharedBudget):
//! what the shared budget asks of each context on it (device loss, the bytes
//! a teardown in progress will give back, its pressure responders and its
//! cache).

use super::cache::release_for_pressure;
use super::ledger::DeviceMember;
use super::pressure::RegisteredResponder;
use super::record::{ContextInner, Phase};
use crate::sync::lock;
use crate::trace::EventKind;
use crate::DeviceContext;

impl<C: DeviceContext> DeviceMember for ContextInner<C> {
    fn device_lost(&self, reason: &str) {
        self.mark_lost(reason);
    }

    /// The amounts first, the phase last. Pending first, then awaiting
    /// teardown: an abandoned release adds its bytes to the latter before it
    /// leaves the former, so it is counted in one or both. Teardown changes
    /// the amounts only after its Retiring -> Terminating step, with Release
    /// writes that these Acquire reads pair with: amounts that show anything
    /// teardown did come with a phase of Terminating or later. A phase of
    /// Terminating counts at least 1: the bytes may be half given back, and
    /// the epoch bump at Terminated ([`finish`](ContextInner::finish)) is
    /// what ends the wait; a phase of Terminated means every byte is back.
    fn returning_at_teardown(&self) -> u64 {
        let held = self.ledger.returned_by_teardown();
        match self.phase() {
            Phase::Retiring => held,
            Phase::Terminating => held.max(1),
            Phase::Active | Phase::Terminated => 0,
        }
    }

    fn identity(&self) -> crate::ProviderContextIdentity {
        self.id
    }

    fn pressure_responders(&self) -> Vec<RegisteredResponder> {
        lock(&self.responders).clone()
    }

    fn release_cache_for_pressure(&self, bytes: u64) -> u64 {
        if self.cache.bytes() == 0 {
            return 0;
        }
        release_for_pressure(self, bytes)
    }

    fn cached_bytes(&self) -> u64 {
        self.cache.bytes()
    }

    fn live_sites(&self) -> Vec<(String, u64)> {
        let Some(sites) = &self.sites else {
            return Vec::new();
        };
        sites
            .usage()
            .into_iter()
            .filter(|s| s.live_bytes > 0)
            .map(|s| {
                let text = match &s.label {
                    Some(label) => format!("{} '{label}'", s.site),
                    None => s.site,
                };
                (text, s.live_bytes)
            })
            .collect()
    }

    fn trimmed(&self, asked: u64, released: u64) {
        if self.trace.is_some() {
            let note = Some(format!("the process was asked for {asked} bytes"));
            self.trace_event(0, None, EventKind::Trimmed, released, note);
        }
    }
}
