//! Reservations: bytes charged to a context's budgets ahead of the
//! allocations that will use them.
//!
//! A reservation holds only its *unused* bytes: an allocation made out of it
//! moves its bytes from the reservation to the buffer, and the buffer's
//! release gives them back to the budgets like any other buffer's. The
//! reservation's unused bytes go back to the budgets when it is shrunk or
//! dropped, exactly once. Every reserved byte is charged, so reservations
//! and plain allocations together never admit more than a limit.
//!
//! A reservation holds a pin, like a buffer: `retire().wait` waits for it to
//! be dropped.
//!
//! The context's record lists its live reservations ([`Reservations`](super::record::reservations::Reservations)), so
//! that snapshots and refusals say who holds the reserved bytes ("3.0 MiB
//! reserved by 'request-17'"). The list is touched when a reservation is made
//! and dropped, never when an allocation is made out of one.

use super::admission::{allocate_charged, reserve_refused, Held};
use super::buffer::DeviceBuffer;
use super::error::{ContextOperation, GovernorError};
use super::pin_source::ContextPin;
use super::record::reservations::Reserved;
use super::record::ContextInner;
use super::request::Alloc;
use super::role::Role;
use super::shards::GLOBAL;
use super::stream::GovernedStream;
use crate::sync::Allowance;
use crate::trace::EventKind;
use crate::{DeviceContext, Tier};
use std::fmt;
use std::panic::Location;
use std::sync::Arc;

/// Bytes charged to a context's budget (and its shared budget) ahead of the
/// allocations that will use them: see
/// [`ContextHandle::reserve`](crate::ContextHandle::reserve).
pub struct Reservation<C: DeviceContext> {
    ctx: Arc<ContextInner<C>>,
    /// The tier its bytes are charged in, and its allocations made in.
    tier: Tier,
    /// Label and bytes left, shared with the context's list.
    state: Arc<Reserved>,
    /// Its key in the context's list.
    key: u64,
}

impl<C: DeviceContext> fmt::Debug for Reservation<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("context", &self.ctx.id)
            .field("label", &self.label())
            .field("tier", &self.tier)
            .field("left", &self.left())
            .finish()
    }
}

impl<C: DeviceContext> Reservation<C> {
    /// Charge `bytes` in `tier` now and take the reservation's pin.
    pub(crate) fn new(
        ctx: &Arc<ContextInner<C>>,
        tier: Tier,
        bytes: u64,
        label: &str,
    ) -> Result<Self, GovernorError> {
        if bytes == 0 {
            return Err(GovernorError::ZeroSized {
                context: ctx.name(),
                role: Role::Other,
            });
        }
        let pin = ContextPin::acquire(ctx).map_err(|e| ctx.pin_error(e))?;
        ctx.ledger
            .reserve(tier, bytes)
            .map_err(|refused| traced_refusal(ctx, reserve_refused(ctx, refused, bytes), bytes))?;
        // The pin is the reservation's until it is dropped.
        pin.transfer();
        let state = Arc::new(Reserved {
            label: label.into(),
            tier,
            left: Allowance::new(bytes),
        });
        let key = ctx.reservations.insert(state.clone());
        if ctx.trace.is_some() {
            let note = Some(label.to_owned());
            ctx.trace_event(0, None, EventKind::Reserved, bytes, note);
        }
        Ok(Self {
            ctx: ctx.clone(),
            tier,
            state,
            key,
        })
    }

    /// The label given at [`reserve`](crate::ContextHandle::reserve).
    pub fn label(&self) -> &str {
        &self.state.label
    }

    /// The tier its bytes are charged in and its allocations are made in.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Bytes reserved and not yet allocated.
    pub fn left(&self) -> u64 {
        self.state.left.left()
    }

    /// Allocate what `alloc` asks for on `stream` out of the reservation, in
    /// the reservation's tier: the budgets are not charged again, the bytes
    /// leave the reservation, and the buffer's release gives them back to
    /// the budgets.
    ///
    /// # Errors
    ///
    /// [`GovernorError::ReservationExhausted`] when fewer than the bytes
    /// asked are left (nothing changes), [`GovernorError::WrongTier`] when
    /// `alloc` names another tier, [`GovernorError::ZeroSized`],
    /// [`GovernorError::WrongContext`], [`GovernorError::Pin`] (retiring),
    /// [`GovernorError::BudgetExceeded`] when the device itself is out of
    /// memory, or [`GovernorError::Backend`]. On every error the bytes stay
    /// in the reservation.
    ///
    /// With attribution on ([`ContextConfig::attribution`](super::ContextConfig::attribution)),
    /// the buffer is counted at the caller's line (`#[track_caller]`) and
    /// under [`Alloc::label`].
    #[track_caller]
    pub fn allocate(
        &self,
        stream: &GovernedStream<C>,
        alloc: Alloc,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        let site = Location::caller();
        match self.allocate_at(stream, alloc, site) {
            Err(
                e @ (GovernorError::ReservationExhausted { .. } | GovernorError::BudgetExceeded(_)),
            ) => Err(self.refused(e, site, alloc)),
            made => made,
        }
    }

    #[cold]
    #[inline(never)]
    fn refused(
        &self,
        mut e: GovernorError,
        site: &'static Location<'static>,
        alloc: Alloc,
    ) -> GovernorError {
        if let Some(sites) = &self.ctx.sites {
            sites.refused(site, alloc.names());
        }
        if let GovernorError::BudgetExceeded(refusal) = &mut e {
            super::view::explain(&self.ctx, refusal);
        }
        e
    }

    fn allocate_at(
        &self,
        stream: &GovernedStream<C>,
        alloc: Alloc,
        site: &'static Location<'static>,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        let ctx = &self.ctx;
        let (bytes, role) = (alloc.bytes, alloc.role);
        if !Arc::ptr_eq(&stream.shared.ctx, ctx) {
            return Err(GovernorError::wrong_context(
                ContextOperation::Allocate,
                ctx.name(),
                stream,
            ));
        }
        if let Some(asked) = alloc.tier.filter(|&t| t != self.tier) {
            return Err(GovernorError::WrongTier {
                context: ctx.name(),
                label: self.label().to_owned(),
                reservation: self.tier,
                asked,
            });
        }
        if bytes == 0 {
            return Err(GovernorError::ZeroSized {
                context: ctx.name(),
                role,
            });
        }
        let pin = ContextPin::acquire_on(ctx, stream.shared.shard).map_err(|e| ctx.pin_error(e))?;
        self.state
            .left
            .take(bytes)
            .map_err(|left| GovernorError::ReservationExhausted {
                context: ctx.name(),
                label: self.label().to_owned(),
                requested: bytes,
                left,
            })?;
        // Back into the reservation on every way out but a live buffer,
        // unwinding out of the backend included.
        let taken = Taken { from: self, bytes };
        let memory = allocate_charged(ctx, &stream.shared, bytes, role, self.tier, Held::Reserved)?;
        std::mem::forget(taken);
        let site = ctx
            .sites
            .as_ref()
            .map_or(0, |s| s.admit(site, alloc.names(), bytes));
        // On the timeline as on the books: the bytes became live (the
        // stream's tag is set only on a traced context).
        if stream.shared.trace_tag != 0 {
            let tag = stream.shared.trace_tag;
            let note = Some(self.label().to_owned());
            ctx.trace_event_at(tag, Some(role), EventKind::Allocated, bytes, note, site);
        }
        pin.transfer();
        Ok(DeviceBuffer {
            stream: stream.shared.clone(),
            memory: Some(memory),
            bytes,
            len: bytes,
            role,
            tier: self.tier,
            recorded: None,
            site,
        })
    }

    /// Reserve `bytes` more: charged to the budgets now, or, when they
    /// refuse, an error and the reservation unchanged.
    ///
    /// # Errors
    ///
    /// [`GovernorError::BudgetExceeded`] with every number.
    pub fn grow(&self, bytes: u64) -> Result<(), GovernorError> {
        self.ctx
            .ledger
            .reserve(self.tier, bytes)
            .map_err(|refused| {
                traced_refusal(&self.ctx, reserve_refused(&self.ctx, refused, bytes), bytes)
            })?;
        self.state.left.add(bytes);
        self.trace(EventKind::Reserved, bytes);
        Ok(())
    }

    /// Give `bytes` of the unused reservation back to the budgets (at most
    /// what is left). Returns how many were given back.
    pub fn shrink(&self, bytes: u64) -> u64 {
        let given = self.state.left.shrink(bytes);
        self.ctx.ledger.unreserve(self.tier, given);
        if given > 0 {
            self.trace(EventKind::Unreserved, given);
        }
        given
    }

    /// Records `kind` of `bytes` on the context's timeline, when traced.
    fn trace(&self, kind: EventKind, bytes: u64) {
        if self.ctx.trace.is_some() {
            let note = Some(self.label().to_owned());
            self.ctx.trace_event(0, None, kind, bytes, note);
        }
    }
}

impl<C: DeviceContext> Drop for Reservation<C> {
    fn drop(&mut self) {
        // `&mut self`: no allocation is taking bytes out any more, so what
        // is left goes back exactly once (`close` leaves 0 for the list,
        // which may still read the state until it is removed).
        let left = self.state.left.close();
        self.ctx.ledger.unreserve(self.tier, left);
        if left > 0 {
            self.trace(EventKind::Unreserved, left);
        }
        self.ctx.reservations.remove(self.key);
        drop(ContextPin::adopt(&self.ctx, GLOBAL));
    }
}

/// `err`, the refusal of a reservation of `bytes`, after recording it on the
/// context's timeline when the context is traced (on no stream, with no
/// role: a reservation has neither).
#[cold]
fn traced_refusal<C: DeviceContext>(
    ctx: &ContextInner<C>,
    err: GovernorError,
    bytes: u64,
) -> GovernorError {
    if ctx.trace.is_some() {
        let note = Some(err.to_string());
        ctx.trace_event(0, None, EventKind::Refused, bytes, note);
    }
    err
}

/// Bytes taken out of a reservation for an allocation being made: put back
/// when dropped.
struct Taken<'a, C: DeviceContext> {
    from: &'a Reservation<C>,
    bytes: u64,
}

impl<C: DeviceContext> Drop for Taken<'_, C> {
    fn drop(&mut self) {
        self.from.state.left.add(self.bytes);
    }
}
