//! A capture's pool: one range of arena memory mapped before the capture
//! begins, carved front to back while it runs, with no driver call.
//!
//! Carving must not call the driver (an allocation during a capture would
//! invalidate it, or become a graph node), so the pool is plain arithmetic
//! over a range the arena already mapped; what a backend records into the
//! pool is checked against what was carved, so a graph only ever touches
//! memory its pool pins.

use crate::capability::PoolExhausted;
use crate::{BackendError, BackendErrorKind};

/// A capture pool asked for that, rounded up to the alignment of capture
/// allocations, does not fit in 64 bits. Nothing was taken from the arena
/// and no capture began.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a capture pool of {requested} B was asked for, which rounded up to the {align} B \
     alignment of capture allocations passes the 64-bit limit: nothing was taken and no \
     capture began; ask for at most {max} B (CaptureConfig::pool_bytes), or rather what the \
     capture's allocations need",
    max = u64::MAX / align * align
)]
pub struct PoolTooLarge {
    /// The backend whose capture refused (`"cuda"`, ...).
    pub backend: &'static str,
    /// Bytes asked for (`CaptureConfig::pool_bytes`).
    pub requested: u64,
    /// The alignment the pool is rounded up to.
    pub align: u64,
}

impl From<PoolTooLarge> for BackendError {
    fn from(e: PoolTooLarge) -> Self {
        BackendError::new(
            e.backend,
            "begin_capture",
            BackendErrorKind::InvalidArgument,
            e.to_string(),
        )
    }
}

/// The carved front of a capture's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapturePool {
    base: u64,
    bytes: u64,
    used: u64,
}

impl CapturePool {
    /// A pool of `bytes` at device address `base`, nothing carved yet.
    pub const fn new(base: u64, bytes: u64) -> Self {
        Self {
            base,
            bytes,
            used: 0,
        }
    }

    /// The size of a pool of `requested` bytes: at least 1, rounded up to
    /// `align` (a power of two, or any non-zero alignment), checked:
    /// [`PoolTooLarge`], naming `backend`, when it passes `u64::MAX`.
    pub fn size_for(
        backend: &'static str,
        requested: u64,
        align: u64,
    ) -> Result<u64, PoolTooLarge> {
        requested
            .max(1)
            .checked_next_multiple_of(align)
            .ok_or(PoolTooLarge {
                backend,
                requested,
                align,
            })
    }

    /// The pool's device address.
    pub const fn base(&self) -> u64 {
        self.base
    }

    /// The pool's size.
    pub const fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes carved so far.
    pub const fn used(&self) -> u64 {
        self.used
    }

    /// Bytes not carved yet.
    pub const fn free(&self) -> u64 {
        self.bytes - self.used
    }

    /// Carve `bytes` (at least 1, rounded up to `align`) and return their
    /// device address; [`PoolExhausted`], naming `backend`, when they do not
    /// fit, with nothing carved.
    pub fn carve(
        &mut self,
        backend: &'static str,
        bytes: u64,
        align: u64,
    ) -> Result<u64, PoolExhausted> {
        match bytes.max(1).checked_next_multiple_of(align) {
            Some(len) if len <= self.free() => {
                let ptr = self.base + self.used;
                self.used += len;
                Ok(ptr)
            }
            _ => Err(PoolExhausted {
                backend,
                requested: bytes,
                free: self.free(),
                pool: self.bytes,
            }),
        }
    }

    /// Whether `len` bytes at `offset` of the `buf_bytes` carved at `buf`
    /// lie in what this pool carved.
    pub fn holds(&self, buf: u64, buf_bytes: u64, offset: u64, len: u64) -> bool {
        buf >= self.base
            && buf
                .checked_add(buf_bytes)
                .is_some_and(|end| end <= self.base + self.used)
            && offset.checked_add(len).is_some_and(|end| end <= buf_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carves_front_to_back_and_refuses_what_does_not_fit() {
        let mut pool = CapturePool::new(0x1000, 1024);
        assert_eq!(pool.carve("test", 100, 256), Ok(0x1000));
        assert_eq!(pool.carve("test", 0, 256), Ok(0x1100));
        assert_eq!((pool.used(), pool.free()), (512, 512));
        let refused = pool.carve("test", 513, 256).unwrap_err();
        assert_eq!(
            (refused.requested, refused.free, refused.pool),
            (513, 512, 1024)
        );
        assert_eq!(pool.used(), 512, "a refusal carves nothing");
        assert_eq!(pool.carve("test", 512, 256), Ok(0x1200));
        assert!(pool.carve("test", u64::MAX, 256).is_err());
    }

    #[test]
    fn a_pool_size_is_rounded_up_and_checked() {
        assert_eq!(CapturePool::size_for("test", 0, 256), Ok(256));
        assert_eq!(CapturePool::size_for("test", 257, 256), Ok(512));
        let max = u64::MAX / 256 * 256;
        assert_eq!(CapturePool::size_for("test", max, 256), Ok(max));
        for requested in [max + 1, u64::MAX - 1, u64::MAX] {
            let e = CapturePool::size_for("test", requested, 256).unwrap_err();
            assert_eq!(e.requested, requested);
            let e = BackendError::from(e);
            assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
            assert!(e.message.contains(&format!("at most {max} B")), "{e}");
        }
    }

    #[test]
    fn holds_only_what_was_carved_within_each_buffer() {
        let mut pool = CapturePool::new(0x1000, 1024);
        let a = pool.carve("test", 256, 256).unwrap();
        assert!(pool.holds(a, 256, 0, 256));
        assert!(pool.holds(a, 256, 255, 1));
        assert!(!pool.holds(a, 256, 200, 57), "past the buffer's end");
        assert!(!pool.holds(a + 256, 256, 0, 1), "not carved yet");
        assert!(!pool.holds(0x800, 256, 0, 1), "below the pool");
        assert!(!pool.holds(a, 256, u64::MAX, 2), "an offset that overflows");
    }
}
