//! A counting global allocator, for the heap-bytes rows of `memgov bench`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(false);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Set by the first allocation that goes through a `CountingAllocator`.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting the bytes it hands out and takes back
/// while a [`HeapCounter`] is running. When no counter runs it costs one
/// relaxed load per call.
///
/// Install it in a binary with
/// `#[global_allocator] static ALLOC: bench::CountingAllocator = bench::CountingAllocator::new();`
#[derive(Debug, Default)]
pub struct CountingAllocator {
    _private: (),
}

impl CountingAllocator {
    /// The allocator (a unit value; counters are process-wide).
    pub const fn new() -> Self {
        Self { _private: () }
    }
}

#[inline]
fn note_alloc(size: usize) {
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    if ENABLED.load(Ordering::Relaxed) {
        ALLOCATED.fetch_add(size as u64, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

#[inline]
fn note_free(size: usize) {
    if ENABLED.load(Ordering::Relaxed) {
        FREED.fetch_add(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees carry over; the counting touches only
// static atomics and never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        // SAFETY: forwarded as is; `ptr` came from this allocator (that is,
        // from `System`) with `layout`, per the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note_free(layout.size());
            note_alloc(new_size);
        }
        p
    }
}

/// Whether the process's global allocator is a [`CountingAllocator`].
pub fn counting_allocator_installed() -> bool {
    // Make sure at least one allocation has happened.
    drop(std::hint::black_box(Box::new(0u64)));
    INSTALLED.load(Ordering::Relaxed)
}

/// Heap traffic seen while a [`HeapCounter`] ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeapDelta {
    /// Bytes allocated.
    pub allocated: u64,
    /// Bytes freed.
    pub freed: u64,
    /// Allocation calls.
    pub allocations: u64,
}

impl HeapDelta {
    /// Bytes allocated and not freed.
    pub fn net(&self) -> i64 {
        self.allocated as i64 - self.freed as i64
    }
}

/// Counts the process's heap traffic between [`start`](Self::start) and
/// [`finish`](Self::finish). Counters are process-wide: run one at a time,
/// with no other thread allocating. Counts nothing unless a
/// [`CountingAllocator`] is the global allocator.
#[derive(Debug)]
pub struct HeapCounter {
    at: HeapDelta,
}

fn now() -> HeapDelta {
    HeapDelta {
        allocated: ALLOCATED.load(Ordering::Relaxed),
        freed: FREED.load(Ordering::Relaxed),
        allocations: ALLOCATIONS.load(Ordering::Relaxed),
    }
}

impl HeapCounter {
    /// Start counting.
    pub fn start() -> Self {
        let at = now();
        ENABLED.store(true, Ordering::SeqCst);
        Self { at }
    }

    /// Stop counting and return what was seen.
    pub fn finish(self) -> HeapDelta {
        ENABLED.store(false, Ordering::SeqCst);
        let end = now();
        HeapDelta {
            allocated: end.allocated - self.at.allocated,
            freed: end.freed - self.at.freed,
            allocations: end.allocations - self.at.allocations,
        }
    }
}
