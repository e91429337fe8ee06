//! [`Slot`]: one cached box, handed between threads without a lock, that
//! can be closed for good.
//!
//! The governor keeps one per shard of streams to recycle the boxes of
//! pending releases: a release takes the shard's cached box (or makes one),
//! and its settlement, on whatever thread fires it, offers the box back.
//! Retire closes the slots, because a cached box may hold a reference to
//! the very record the slot lives in.
//!
//! # Invariants
//!
//! * The word holds null (empty), the closed mark (`CLOSED_MARK`'s
//!   address), or a pointer from `Box::into_raw` of a complete `Box<T>` that
//!   the slot owns. Whoever moves a pointer out of the word by a successful
//!   read-modify-write owns its box; nobody else touches it.
//! * A take is a compare-and-swap from the pointer it read to null, never a
//!   swap: a swap could replace a closed mark written in between with null
//!   and reopen the slot. (ABA is harmless: whoever holds the pointer in the
//!   word owns the box it points to.)
//! * An offer is a compare-and-swap from null: it never replaces a box or
//!   the closed mark. Release, paired with the Acquire of the take and of
//!   the close, so that the taker sees every write its previous owner made.
//! * [`close`](Slot::close) swaps the closed mark in: from then on every
//!   offer fails and every take finds nothing.
//!
//! Modelled in `tests/loom.rs` (`spare_slot_hands_boxes_over_and_closes`).

#[cfg(loom)]
use loom::sync::atomic::AtomicPtr;
#[cfg(not(loom))]
use std::sync::atomic::AtomicPtr;

use std::marker::PhantomData;
use std::sync::atomic::Ordering;

/// The closed mark: the address of a static, which no `Box<T>` can have (a
/// box of a zero-sized `T` points at a small dangling address, never at a
/// static).
static CLOSED_MARK: u8 = 0;

/// The word of a closed slot.
#[inline]
fn closed<T>() -> *mut T {
    std::ptr::addr_of!(CLOSED_MARK) as *mut T
}

/// One cached `Box<T>`, or none, or closed for good.
///
/// `Send` and `Sync` when `T` is `Send`, like a `Mutex<Box<T>>`: a take
/// through a shared reference moves the box to the taking thread.
pub struct Slot<T> {
    word: AtomicPtr<T>,
    _owns: PhantomData<std::sync::Mutex<Box<T>>>,
}

impl<T> Slot<T> {
    /// An empty, open slot.
    pub fn new() -> Self {
        Self {
            word: AtomicPtr::new(std::ptr::null_mut()),
            _owns: PhantomData,
        }
    }

    /// An open slot that holds `value` (the loom model starts from one).
    pub fn with(value: Box<T>) -> Self {
        Self {
            word: AtomicPtr::new(Box::into_raw(value)),
            _owns: PhantomData,
        }
    }

    #[inline]
    fn is_box(p: *mut T) -> bool {
        !p.is_null() && p != closed()
    }

    /// Take the cached box, if there is one. One load when the slot is empty
    /// or closed; a compare-and-swap otherwise.
    #[inline]
    pub fn take(&self) -> Option<Box<T>> {
        let p = self.word.load(Ordering::Relaxed);
        if Self::is_box(p)
            && self
                .word
                .compare_exchange(
                    p,
                    std::ptr::null_mut(),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            // SAFETY: a box pointer in the word came from `Box::into_raw`
            // (`offer`, `with`) and belongs to the slot; the successful
            // compare-and-swap moved it out, so this thread alone owns it,
            // and its Acquire pairs with the Release that stored it.
            return Some(unsafe { Box::from_raw(p) });
        }
        None
    }

    /// Cache `value` if the slot is empty and open; otherwise hand it back
    /// (the caller drops it).
    ///
    /// After a successful offer the box is no longer the caller's: another
    /// thread may take and drop it at once. When the box keeps alive what
    /// the slot lives in, the caller must reach the slot through a pointer
    /// that does not borrow from the box, and touch nothing of it after
    /// this call.
    #[inline]
    pub fn offer(&self, value: Box<T>) -> Result<(), Box<T>> {
        let raw = Box::into_raw(value);
        match self.word.compare_exchange(
            std::ptr::null_mut(),
            raw,
            Ordering::Release,
            Ordering::Relaxed,
        ) {
            Ok(_) => Ok(()),
            // SAFETY: the exchange failed, so `raw` (from `Box::into_raw`
            // just above) was never published: it is still ours.
            Err(_) => Err(unsafe { Box::from_raw(raw) }),
        }
    }

    /// Close the slot for good and return the box it held, if any: no offer
    /// succeeds from now on.
    pub fn close(&self) -> Option<Box<T>> {
        let p = self.word.swap(closed(), Ordering::AcqRel);
        if Self::is_box(p) {
            // SAFETY: as in `take`: the swap moved the pointer out of the
            // word, and its Acquire pairs with the offer's Release.
            Some(unsafe { Box::from_raw(p) })
        } else {
            None
        }
    }

    /// Whether [`close`](Self::close) ran.
    pub fn is_closed(&self) -> bool {
        self.word.load(Ordering::Acquire) == closed()
    }

    /// Whether a box is cached now.
    pub fn is_filled(&self) -> bool {
        Self::is_box(self.word.load(Ordering::Acquire))
    }
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Drop for Slot<T> {
    fn drop(&mut self) {
        // `&mut self`: no other thread can reach the word.
        drop(self.close());
    }
}

impl<T> std::fmt::Debug for Slot<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.word.load(Ordering::Relaxed);
        let state = if p.is_null() {
            "empty"
        } else if p == closed() {
            "closed"
        } else {
            "filled"
        };
        f.debug_tuple("Slot").field(&state).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Slot;

    #[test]
    fn takes_what_was_offered_and_refuses_once_closed() {
        let slot = Slot::new();
        assert!(slot.take().is_none());
        slot.offer(Box::new(7u32)).unwrap();
        assert_eq!(slot.offer(Box::new(8)).unwrap_err(), Box::new(8), "full");
        assert!(slot.is_filled());
        assert_eq!(slot.take(), Some(Box::new(7)));
        slot.offer(Box::new(9)).unwrap();
        assert_eq!(slot.close(), Some(Box::new(9)));
        assert!(slot.is_closed());
        assert_eq!(slot.offer(Box::new(10)).unwrap_err(), Box::new(10));
        assert!(slot.take().is_none());
        assert!(slot.is_closed(), "a take never reopens a closed slot");
    }

    #[test]
    fn zero_sized_boxes_are_not_mistaken_for_the_closed_mark() {
        let slot = Slot::new();
        slot.offer(Box::new(())).unwrap();
        assert!(slot.is_filled() && !slot.is_closed());
        assert_eq!(slot.take(), Some(Box::new(())));
    }

    #[test]
    fn a_dropped_slot_drops_its_box() {
        use std::sync::Arc;
        let held = Arc::new(());
        let slot = Slot::new();
        slot.offer(Box::new(held.clone())).unwrap();
        assert_eq!(Arc::strong_count(&held), 2);
        drop(slot);
        assert_eq!(Arc::strong_count(&held), 1);
    }
}
