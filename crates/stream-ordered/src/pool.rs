//! The context's own stream-ordered memory pool: created on its device with
//! the release threshold set ([`create`]), and given back at teardown,
//! trimmed to nothing, then destroyed ([`release`]).
//!
//! A pool of memgov's own, not the device's default one, so that its
//! attributes (the release threshold above all) are memgov's to set, and a
//! runtime's own use of the default pool neither sees nor changes them.
//! The vendor's table ([`PoolTable`]) makes the calls with its properties:
//! pinned device memory of one device, no shareable handle.

use crate::result::check;
use crate::stream::StreamContext;
use crate::teardown::{stopped, FirstError};
use crate::{Class, Vendor};
use memgov_backend::BackendError;

/// The names of a vendor's pool calls, for messages.
#[derive(Debug, Clone, Copy)]
pub struct PoolNames {
    /// Create a pool (`cuMemPoolCreate`).
    pub create: &'static str,
    /// Set a pool attribute (`cuMemPoolSetAttribute`).
    pub set_attribute: &'static str,
    /// Trim a pool (`cuMemPoolTrimTo`).
    pub trim: &'static str,
    /// Destroy a pool (`cuMemPoolDestroy`).
    pub destroy: &'static str,
}

/// A vendor's memory-pool calls.
pub trait PoolTable: Vendor {
    /// A pool handle (`CUmemoryPool`).
    type Pool: Copy;

    /// The calls' names, for messages.
    const POOL_NAMES: PoolNames;

    /// Create a pool of pinned device memory on device `ordinal`, no
    /// shareable handle.
    ///
    /// # Safety
    ///
    /// `ordinal` is a device of the driver, below its device count; the
    /// vendor's current-context rule holds (CUDA: the device's context is
    /// current).
    unsafe fn pool_create(ordinal: i32) -> (Self::Code, Self::Pool);

    /// Set the pool's release threshold: the bytes it keeps reserved
    /// across synchronizations instead of giving them back to the device.
    ///
    /// # Safety
    ///
    /// `pool` came from [`pool_create`](Self::pool_create) and is not
    /// destroyed.
    unsafe fn pool_set_release_threshold(pool: Self::Pool, bytes: u64) -> Self::Code;

    /// Give every byte the pool holds and no allocation uses back to the
    /// device (trim to 0).
    ///
    /// # Safety
    ///
    /// As for [`pool_set_release_threshold`](Self::pool_set_release_threshold).
    unsafe fn pool_trim(pool: Self::Pool) -> Self::Code;

    /// Destroy the pool.
    ///
    /// # Safety
    ///
    /// As above, and the pool is destroyed once: nothing uses the handle
    /// afterwards.
    unsafe fn pool_destroy(pool: Self::Pool) -> Self::Code;
}

/// Create the context's pool on `ordinal` and set its release threshold
/// where one is given. `None` where the driver answers that it has no
/// pools for the device (the create's code classifies as
/// [`Class::NotSupported`]): the vendor falls back, or refuses, in its own
/// words. A pool whose threshold is refused is destroyed before the error
/// returns, so nothing is left on any path.
///
/// # Safety
///
/// As for [`PoolTable::pool_create`].
pub unsafe fn create<T: PoolTable>(
    op: &'static str,
    ordinal: i32,
    release_threshold: Option<u64>,
) -> Result<Option<T::Pool>, BackendError> {
    let n = &T::POOL_NAMES;
    // SAFETY: the caller's contract.
    let (r, pool) = unsafe { T::pool_create(ordinal) };
    if T::classify(r) == Class::NotSupported {
        return Ok(None);
    }
    check::<T>(op, n.create, r)?;
    if let Some(bytes) = release_threshold {
        // SAFETY: the pool just created.
        let r = unsafe { T::pool_set_release_threshold(pool, bytes) };
        if let Err(e) = check::<T>(op, n.set_attribute, r) {
            // SAFETY: the pool just created, unused, destroyed once.
            let _ = unsafe { T::pool_destroy(pool) };
            return Err(e);
        }
    }
    Ok(Some(pool))
}

/// Trim `pool` to nothing: its cached bytes go back to the device.
///
/// # Safety
///
/// As for [`PoolTable::pool_trim`].
pub unsafe fn trim<T: PoolTable>(op: &'static str, pool: T::Pool) -> Result<(), BackendError> {
    // SAFETY: the caller's contract.
    check::<T>(op, T::POOL_NAMES.trim, unsafe { T::pool_trim(pool) })
}

/// Destroy `pool`.
///
/// # Safety
///
/// As for [`PoolTable::pool_destroy`].
pub unsafe fn destroy<T: PoolTable>(op: &'static str, pool: T::Pool) -> Result<(), BackendError> {
    // SAFETY: the caller's contract.
    check::<T>(op, T::POOL_NAMES.destroy, unsafe { T::pool_destroy(pool) })
}

/// Teardown's end of the pool: trimmed, then destroyed, each answer kept in
/// `errors` and checked on the context (a sticky code marks it lost). A
/// vendor that makes no call after a sticky code
/// ([`StreamTable::CALLS_AFTER_STICKY`](crate::table::StreamTable::CALLS_AFTER_STICKY)
/// false) stops there: the pool goes with the device.
///
/// # Safety
///
/// `pool` is the context's own, destroyed here once; every allocation from
/// it was freed and every free executed (teardown synchronized every
/// stream); the context is current.
pub unsafe fn release<C>(s: &C, op: &'static str, pool: PoolOf<C>, errors: &mut FirstError)
where
    C: StreamContext,
    C::Table: PoolTable,
{
    let n = &<C::Table as PoolTable>::POOL_NAMES;
    if stopped(s) {
        return;
    }
    // SAFETY: the caller's contract.
    errors.keep(s.checked(op, n.trim, unsafe { C::Table::pool_trim(pool) }));
    if stopped(s) {
        return;
    }
    // SAFETY: the caller's contract: destroyed once, here.
    errors.keep(s.checked(op, n.destroy, unsafe { C::Table::pool_destroy(pool) }));
}

/// A context's pool handle.
pub type PoolOf<C> = <<C as crate::table::Context>::Table as PoolTable>::Pool;
