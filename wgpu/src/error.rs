//! [`Error`]: what opening a device, creating a buffer, moving buffers and
//! retiring can fail with.

use memgov::{BackendError, BackendErrorKind, GovernorError, RetireError};

/// Why an operation of this crate failed. Nothing here is a device loss or a
/// panic: a refused allocation leaves the device and every other buffer as
/// they were.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// memgov refused the allocation (its budget, a shared budget, a
    /// retiring context): the message carries the numbers and the way out.
    #[error("memgov refused the buffer: {0}")]
    Refused(#[source] GovernorError),
    /// The Vulkan backend failed (opening the loader, adopting the device).
    #[error("memgov's Vulkan backend: {0}")]
    Backend(#[source] BackendError),
    /// wgpu could not open a Vulkan adapter or device.
    #[error("wgpu: {0}")]
    Wgpu(String),
    /// No Vulkan adapter: nothing to share.
    #[error("no Vulkan adapter found by wgpu ({0}); install libvulkan1 and a driver (mesa-vulkan-drivers for lavapipe)")]
    NoAdapter(String),
    /// A governed buffer cannot be mapped by wgpu (wgpu maps only buffers
    /// it allocated itself).
    #[error("{usage:?} asks for mapping (MAP_READ / MAP_WRITE or mapped_at_creation); wgpu maps only its own buffers: create the staging buffer with wgpu::Device::create_buffer and copy")]
    Mappable {
        /// The usage asked for.
        usage: wgpu::BufferUsages,
    },
    /// A zero-byte buffer.
    #[error("zero-byte buffer '{0}'; wgpu and memgov need at least one byte")]
    ZeroSized(String),
    /// The device was retired: no buffer can be created on it.
    #[error("the governed device was retired; open another one")]
    Retired,
    /// Retiring did not finish by its deadline (the holders are listed).
    #[error("retiring the governed device: {0}")]
    Retire(#[source] RetireError),
    /// wgpu's poll failed while waiting for its submissions.
    #[error("waiting for wgpu's submissions: {0}")]
    Poll(String),
    /// Moving buffers to another device failed; every buffer is back on the
    /// device it came from.
    #[error("moving {count} buffer(s) failed: {source}; every buffer stays on its device, with its contents")]
    Migrate {
        /// How many buffers were to move.
        count: usize,
        /// Why.
        #[source]
        source: GovernorError,
    },
}

impl Error {
    /// The wgpu error scope that would have caught this failure had wgpu
    /// allocated the buffer itself: [`wgpu::ErrorFilter::OutOfMemory`] for
    /// a refusal for lack of memory (a budget of memgov's, a reservation
    /// used up, or the driver's allocator out of memory), where wgpu's
    /// `create_buffer` reports an out-of-memory error to the innermost
    /// `push_error_scope(ErrorFilter::OutOfMemory)`. `None` where wgpu would
    /// not have failed this way: a restriction of governed buffers
    /// ([`Mappable`](Self::Mappable), [`ZeroSized`](Self::ZeroSized)), a
    /// retired device or lost context, or an operation wgpu does not have.
    ///
    /// A refusal is returned, never reported to wgpu's error scopes or its
    /// uncaptured-error handler (wgpu has no way to raise an error into
    /// them): code written the wgpu way matches on this instead of popping
    /// a scope.
    ///
    /// ```
    /// # fn demo(e: memgov_wgpu::Error) {
    /// if e.wgpu_error_filter() == Some(wgpu::ErrorFilter::OutOfMemory) {
    ///     // what the code did when its OutOfMemory scope popped an error:
    ///     // free something, use a smaller buffer, or give up
    /// }
    /// # }
    /// ```
    pub fn wgpu_error_filter(&self) -> Option<wgpu::ErrorFilter> {
        let refusal = match self {
            Self::Refused(e) | Self::Migrate { source: e, .. } => e,
            _ => return None,
        };
        match refusal {
            GovernorError::BudgetExceeded(_) | GovernorError::ReservationExhausted { .. } => {
                Some(wgpu::ErrorFilter::OutOfMemory)
            }
            GovernorError::Backend { source, .. }
                if source.kind == BackendErrorKind::OutOfMemory =>
            {
                Some(wgpu::ErrorFilter::OutOfMemory)
            }
            _ => None,
        }
    }

    /// This error as the [`wgpu::Error`] wgpu would have reported (its
    /// source is this error, message and numbers included), for code that
    /// hands wgpu's errors to one handler; `Err(self)` where
    /// [`wgpu_error_filter`](Self::wgpu_error_filter) is `None`.
    pub fn into_wgpu_error(self) -> Result<wgpu::Error, Self> {
        match self.wgpu_error_filter() {
            Some(wgpu::ErrorFilter::OutOfMemory) => Ok(wgpu::Error::OutOfMemory {
                source: Box::new(self),
            }),
            _ => Err(self),
        }
    }
}
