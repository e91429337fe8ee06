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

use super::admission::{allocate_charged, reserve_refused};
use super::buffer::DeviceBuffer;
use super::config::Role;
use super::error::{ContextOperation, GovernorError};
use super::pin_source::ContextPin;
use super::record::ContextInner;
use super::shards::GLOBAL;
use super::stream::{pin_error, GovernedStream};
use crate::DeviceContext;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes charged to a context's budget (and its shared budget) ahead of the
/// allocations that will use them: see
/// [`ContextHandle::reserve`](crate::ContextHandle::reserve).
pub struct Reservation<C: DeviceContext> {
    ctx: Arc<ContextInner<C>>,
    label: String,
    /// Bytes reserved and not yet allocated: charged to the budgets.
    left: AtomicU64,
}

impl<C: DeviceContext> fmt::Debug for Reservation<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("context", &self.ctx.id)
            .field("label", &self.label)
            .field("left", &self.left())
            .finish()
    }
}

impl<C: DeviceContext> Reservation<C> {
    /// Charge `bytes` now and take the reservation's pin.
    pub(crate) fn new(
        ctx: &Arc<ContextInner<C>>,
        bytes: u64,
        label: &str,
    ) -> Result<Self, GovernorError> {
        if bytes == 0 {
            return Err(GovernorError::ZeroSized {
                context: ctx.id,
                role: Role::Other,
            });
        }
        let pin = ContextPin::acquire(ctx).map_err(|e| pin_error(ctx, e))?;
        ctx.charges
            .reserve(bytes)
            .map_err(|refused| reserve_refused(ctx, refused, bytes))?;
        // The pin is the reservation's until it is dropped.
        pin.transfer();
        Ok(Self {
            ctx: ctx.clone(),
            label: label.to_owned(),
            left: AtomicU64::new(bytes),
        })
    }

    /// The label given at [`reserve`](crate::ContextHandle::reserve).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Bytes reserved and not yet allocated.
    pub fn left(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// Take `bytes` out of what is left, or say how much is left.
    fn take(&self, bytes: u64) -> Result<(), u64> {
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                left.checked_sub(bytes)
            })
            .map(drop)
    }

    /// Allocate `bytes` for `role` on `stream` out of the reservation: the
    /// budgets are not charged again, the bytes leave the reservation, and
    /// the buffer's release gives them back to the budgets.
    ///
    /// # Errors
    ///
    /// [`GovernorError::ReservationExhausted`] when fewer than `bytes` are
    /// left (nothing changes), [`GovernorError::ZeroSized`],
    /// [`GovernorError::WrongContext`], [`GovernorError::Pin`] (retiring),
    /// [`GovernorError::BudgetExceeded`] when the device itself is out of
    /// memory, or [`GovernorError::Backend`]. On every error the bytes stay
    /// in the reservation.
    pub fn allocate(
        &self,
        stream: &GovernedStream<C>,
        bytes: u64,
        role: Role,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        let ctx = &self.ctx;
        if !Arc::ptr_eq(&stream.shared.ctx, ctx) {
            return Err(GovernorError::wrong_context(
                ContextOperation::Allocate,
                ctx.id,
                stream,
            ));
        }
        if bytes == 0 {
            return Err(GovernorError::ZeroSized {
                context: ctx.id,
                role,
            });
        }
        let pin =
            ContextPin::acquire_on(ctx, stream.shared.shard).map_err(|e| pin_error(ctx, e))?;
        self.take(bytes)
            .map_err(|left| GovernorError::ReservationExhausted {
                context: ctx.id,
                label: self.label.clone(),
                requested: bytes,
                left,
            })?;
        // Back into the reservation on every way out but a live buffer,
        // unwinding out of the backend included.
        let taken = Taken { from: self, bytes };
        let memory = allocate_charged(ctx, &stream.shared, bytes, role)?;
        std::mem::forget(taken);
        pin.transfer();
        Ok(DeviceBuffer {
            stream: stream.shared.clone(),
            memory: Some(memory),
            bytes,
            role,
            tier: crate::Tier::Device,
            recorded: None,
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
            .charges
            .reserve(bytes)
            .map_err(|refused| reserve_refused(&self.ctx, refused, bytes))?;
        self.left.fetch_add(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Give `bytes` of the unused reservation back to the budgets (at most
    /// what is left). Returns how many were given back.
    pub fn shrink(&self, bytes: u64) -> u64 {
        let mut given = 0;
        let _ = self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                given = left.min(bytes);
                Some(left - given)
            });
        self.ctx.charges.unreserve(given);
        given
    }
}

impl<C: DeviceContext> Drop for Reservation<C> {
    fn drop(&mut self) {
        // `&mut self`: no allocation is taking bytes out any more, so what
        // is left goes back exactly once.
        let left = std::mem::take(self.left.get_mut());
        self.ctx.charges.unreserve(left);
        drop(ContextPin::adopt(&self.ctx, GLOBAL));
    }
}

/// Bytes taken out of a reservation for an allocation being made: put back
/// when dropped.
struct Taken<'a, C: DeviceContext> {
    from: &'a Reservation<C>,
    bytes: u64,
}

impl<C: DeviceContext> Drop for Taken<'_, C> {
    fn drop(&mut self) {
        self.from.left.fetch_add(self.bytes, Ordering::AcqRel);
    }
}
