//! Sleep and wake of a context's arena on HIP: its physical memory unmapped
//! and released (its contents kept in page-locked host memory,
//! `hipHostMalloc`, when asked) while the addresses stay reserved, then
//! mapped again at the same addresses with the contents restored; the whole
//! arena or a chosen set of its allocations.
//!
//! The state machine is the shared core's ([`memgov_backend::vmm`]): each
//! granule's slot is its mapped state, `Mapped` → `Asleep` on sleep,
//! `Asleep` → `Mapped` on wake, each step taken once, so no handle is
//! released twice and none is forgotten. A wake that would pass the arena's
//! limit is refused (`OutOfMemory`, with the numbers) before any granule is
//! mapped; one that fails half-way unmaps what it mapped and stays asleep.
//! While asleep, allocation and copies to and from sleeping memory are refused
//! (`InvalidArgument`), and releases retire as usual. This module gives the
//! core HIP's copies: on a stream of the sleep's own, synchronized after
//! each granule.

use crate::arena::{release, Driver, HipArena, SleepReport};
use crate::ffi;
use crate::stream::RawStream;
use memgov_backend::vmm::{self, GranuleDriver};
use memgov_backend::BackendError;
use std::ffi::c_void;

impl Driver<'_> {
    /// The copy stream, made on first use.
    fn copies(&self, op: &'static str) -> Result<RawStream, BackendError> {
        if let Some(raw) = self.copies.get() {
            return Ok(raw);
        }
        let raw = crate::stream::create_raw(self.s, op)?;
        self.copies.set(Some(raw));
        Ok(raw)
    }

    fn sync(&self, op: &'static str, raw: RawStream) -> Result<(), BackendError> {
        // SAFETY: the driver's own copy stream, alive until the driver drops.
        let r = unsafe { ffi::hipStreamSynchronize(raw.0) };
        self.s.checked(op, "hipStreamSynchronize", r)
    }
}

impl Drop for Driver<'_> {
    fn drop(&mut self) {
        if let Some(raw) = self.copies.take() {
            if let Ok(_device) = self.s.make_current("sleep") {
                // SAFETY: the copy stream made by `copies`, destroyed once,
                // after its copies completed (synchronized here as well).
                unsafe {
                    let _ = ffi::hipStreamSynchronize(raw.0);
                    let _ = ffi::hipStreamDestroy(raw.0);
                }
            }
        }
    }
}

impl vmm::SleepDriver for Driver<'_> {
    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        release::quiesce(self.s, op, None)
    }

    fn offload(&self, at: u64, bytes: u64) -> Result<usize, BackendError> {
        let raw = self.copies("sleep")?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; the device is current.
        let r = unsafe { ffi::hipHostMalloc(&mut host, bytes as usize, ffi::hipHostMallocDefault) };
        self.s.checked("sleep", "hipHostMalloc", r)?;
        // SAFETY: the granule at `at` is mapped read-write; `host` holds
        // `bytes` and outlives the copy (synchronized below).
        let r = unsafe { ffi::hipMemcpyDtoHAsync(host, at as *mut c_void, bytes as usize, raw.0) };
        let copied = self
            .s
            .checked("sleep", "hipMemcpyDtoHAsync", r)
            .and_then(|()| self.sync("sleep", raw));
        if let Err(e) = copied {
            self.free_host(host as usize, "sleep");
            return Err(e);
        }
        Ok(host as usize)
    }

    fn restore(&self, at: u64, host: usize, bytes: u64) -> Result<(), BackendError> {
        let raw = self.copies("wake")?;
        // SAFETY: `host` holds one granule of contents; the granule at `at`
        // was just mapped read-write; the host memory outlives the copy
        // (synchronized below).
        let r = unsafe {
            ffi::hipMemcpyHtoDAsync(
                at as *mut c_void,
                host as *mut c_void,
                bytes as usize,
                raw.0,
            )
        };
        self.s.checked("wake", "hipMemcpyHtoDAsync", r)?;
        self.sync("wake", raw)
    }
}

impl HipArena {
    /// Run `f` on the arena with this backend's driver, once the context is
    /// usable and the capture gate admits `op`: no capture begins while it
    /// runs, and one under way is waited for (sleep and wake synchronize
    /// every stream of the context, the captured one included).
    fn gated<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&crate::arena::Arena, &Driver<'_>) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        self.shared.check_usable(op)?;
        let _call = crate::capture::gate().call(op, true)?;
        f(&self.arena, &self.arena.driver(&self.shared))
    }

    /// Sleeps of this arena waiting for copies or graph launches between
    /// their awake check and their enqueue (for tests that force that
    /// interleaving).
    pub fn sleeps_waiting(&self) -> usize {
        self.shared.sleep_gate.counts().1
    }

    /// Put the arena to sleep: wait for every stream of the context, then
    /// unmap and release every granule, copying the contents of those in
    /// use to page-locked host memory first when `keep_contents` is set.
    /// Addresses stay reserved and allocations stay live (but unusable until
    /// [`wake`](Self::wake)).
    pub fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError> {
        self.gated("sleep", |a, d| {
            let _sleep = self.shared.sleep_gate.sleep();
            a.sleep(d, keep_contents)
        })
    }

    /// Wake the arena: map every sleeping granule again at its address and
    /// copy back the contents kept. Refused with `OutOfMemory` before any
    /// mapping when the granules do not fit the arena's limit. Returns the
    /// bytes mapped.
    pub fn wake(&self) -> Result<u64, BackendError> {
        self.gated("wake", |a, d| a.wake(d))
    }

    /// Put the allocations at `ptrs` (device pointers of live allocations of
    /// this arena) to sleep: wait for every stream of the device, then
    /// unmap and release each granule that only they use, copying its
    /// contents to page-locked host memory first when `keep_contents` is
    /// set. Granules shared with other allocations stay mapped; the other
    /// allocations stay usable. Copies to and from the set are refused
    /// until [`wake_ranges`](Self::wake_ranges). The rules are the shared
    /// core's (`memgov_backend::vmm`, its `sleep_set` module).
    pub fn sleep_ranges(
        &self,
        ptrs: &[u64],
        keep_contents: bool,
    ) -> Result<SleepReport, BackendError> {
        self.gated("sleep_ranges", |a, d| {
            let _sleep = self.shared.sleep_gate.sleep();
            a.sleep_ranges(d, ptrs, keep_contents)
        })
    }

    /// Wake the allocations at `ptrs`: map every sleeping granule under them
    /// again at its address and copy back the contents kept. Refused with
    /// `OutOfMemory` before any mapping when they do not fit the arena's
    /// limit; one that fails half-way unmaps what it mapped and leaves the
    /// set asleep. Returns the bytes mapped.
    pub fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, BackendError> {
        self.gated("wake_ranges", |a, d| a.wake_ranges(d, ptrs))
    }
}
