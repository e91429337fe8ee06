//! The registry of live handles.
//!
//! A handle is never a pointer memgov dereferences: it is an id, unique for
//! the life of the process (never reused), with its kind in the top byte,
//! looked up in one map. A foreign, stale, released or wrong-kind handle is
//! simply not found: `MEMGOV_ERR_INVALID_HANDLE`, never a crash.
//!
//! The map's lock is held only to look an id up, insert or remove it: never
//! while calling into the governor, a backend or user code. Objects removed
//! are dropped after the lock is released.

use crate::status::{Error, Result, MEMGOV_ERR_INVALID_HANDLE};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Lock, ignoring poisoning: every critical section here leaves its data
/// consistent (plain inserts, removes and counter updates).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A kind of object a handle names.
pub(crate) trait Kind: Any + Send + Sync + Sized {
    /// Its tag in the top byte of the id.
    const TAG: u8;
    /// Its name in messages.
    const NAME: &'static str;
}

struct Entry {
    tag: u8,
    object: Arc<dyn Any + Send + Sync>,
}

fn map() -> &'static Mutex<HashMap<u64, Entry>> {
    static MAP: OnceLock<Mutex<HashMap<u64, Entry>>> = OnceLock::new();
    MAP.get_or_init(|| Mutex::new(HashMap::new()))
}

static NEXT: AtomicU64 = AtomicU64::new(1);

/// Register `object`; returns its handle (never zero).
pub(crate) fn insert<T: Kind>(object: Arc<T>) -> u64 {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // 2^56 handles per process: at a million a second, two thousand years.
    assert!(n < 1 << 56, "memgov handle space exhausted");
    let id = (u64::from(T::TAG) << 56) | n;
    lock(map()).insert(
        id,
        Entry {
            tag: T::TAG,
            object,
        },
    );
    id
}

fn not_live<T: Kind>(id: u64) -> Error {
    let what = if id == 0 {
        "a null handle".to_owned()
    } else if (id >> 56) as u8 != T::TAG && (id >> 56) != 0 && (id >> 56) < 16 {
        format!("handle {id:#x} names another kind of object")
    } else {
        format!("handle {id:#x} is not live (never issued, already released, or destroyed)")
    };
    Error::new(
        MEMGOV_ERR_INVALID_HANDLE,
        format!("expected a {} handle: {what}", T::NAME),
    )
}

fn downcast<T: Kind>(e: &Entry) -> Option<Arc<T>> {
    if e.tag != T::TAG {
        return None;
    }
    e.object.clone().downcast::<T>().ok()
}

/// The live object `id` names.
pub(crate) fn get<T: Kind>(id: u64) -> Result<Arc<T>> {
    let found = lock(map()).get(&id).and_then(downcast::<T>);
    found.ok_or_else(|| not_live::<T>(id))
}

/// Take `id` out of the registry: later calls with it fail. The object is
/// returned so that the caller drops it (or acts on it) outside the lock.
pub(crate) fn remove<T: Kind>(id: u64) -> Result<Arc<T>> {
    let mut m = lock(map());
    match m.get(&id).map(|e| e.tag == T::TAG) {
        Some(true) => {
            let entry = m.remove(&id).expect("present under the lock");
            drop(m);
            Ok(entry
                .object
                .downcast::<T>()
                .unwrap_or_else(|_| unreachable!("tag and type agree")))
        }
        _ => Err(not_live::<T>(id)),
    }
}
