//! The registry of live handles.
//!
//! A handle is never a pointer memgov dereferences: it is an id, unique for
//! the life of the process (never reused), with its kind in the top byte,
//! looked up in one map. A foreign, stale, released or wrong-kind handle is
//! simply not found: `MEMGOV_ERR_INVALID_HANDLE`, never a crash.
//!
//! Each copy of the library in a process (loaded from two paths, or linked
//! into a host and a plugin each) has its own map, and must refuse the
//! other's handles rather than take them for its own. So the low 56 bits of
//! an id are its sequence number XORed with a key drawn at random when the
//! copy is loaded ([`copy_key`]), and every lookup first decodes the
//! sequence number and checks that this copy issued it. In another copy the
//! same bits decode to a pseudo-random number that is almost never among
//! the few issued there (the chance is the issued count over 2^56), so the
//! handle is refused, with a message that says it was not issued by this
//! copy.
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

/// The bits of an id below its kind.
const SEQUENCE: u64 = (1 << 56) - 1;

/// This copy's key over the sequence bits of its handles, drawn once per
/// load: std's random hash keys (each copy of std seeds its own from the
/// operating system), mixed with addresses inside this copy (another load
/// address for another copy) and the time.
fn copy_key() -> u64 {
    static KEY: OnceLock<u64> = OnceLock::new();
    *KEY.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(copy_key as fn() -> u64 as usize);
        h.write_usize(&NEXT as *const AtomicU64 as usize);
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        h.write_u32(std::process::id());
        h.finish() & SEQUENCE
    })
}

/// The sequence number `id` carries, if this copy issued it.
fn issued_here(id: u64) -> Option<u64> {
    let n = (id & SEQUENCE) ^ copy_key();
    (n != 0 && n < NEXT.load(Ordering::Relaxed)).then_some(n)
}

/// Register `object`; returns its handle (never zero: the kind is not).
pub(crate) fn insert<T: Kind>(object: Arc<T>) -> u64 {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // 2^56 handles per process: at a million a second, two thousand years.
    assert!(n < 1 << 56, "memgov handle space exhausted");
    let id = (u64::from(T::TAG) << 56) | (n ^ copy_key());
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
    } else if issued_here(id).is_none() {
        format!(
            "handle {id:#x} was not issued by this copy of the library: a made-up value, or a \
             handle of another copy of libmemgov_capi loaded in this process (each copy refuses \
             the other's handles; load one copy, see docs/c-api.md, Linking)"
        )
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
    if issued_here(id).is_none() {
        return Err(not_live::<T>(id));
    }
    let found = lock(map()).get(&id).and_then(downcast::<T>);
    found.ok_or_else(|| not_live::<T>(id))
}

/// Take `id` out of the registry: later calls with it fail. The object is
/// returned so that the caller drops it (or acts on it) outside the lock.
pub(crate) fn remove<T: Kind>(id: u64) -> Result<Arc<T>> {
    if issued_here(id).is_none() {
        return Err(not_live::<T>(id));
    }
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
