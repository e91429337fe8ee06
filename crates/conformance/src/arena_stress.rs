//! The arena as an LLM server drives it, written once over the capability
//! traits and run on each backend's stand-in: eight threads allocating,
//! writing and releasing KV blocks, one thread sleeping and waking a set of
//! its own and the whole arena, one thread capturing graphs from a pool and
//! launching them, and a driver call failing in every round (the stand-in's
//! fault knob armed at the start of each round for one entry point at one
//! position, cycled over the entry points and positions by the seed).
//! The sleeper's set is six half granules side by side, made between
//! rounds; half its wakes release a member sharing a granule with another
//! while the wake is held inside its first map (the stand-in's pause knob),
//! so that the release retires into a granule being mapped.
//!
//! What is checked:
//!
//! * no two live allocations overlap: every allocation, as it comes back,
//!   against a shared set of the live ranges;
//! * every byte written is read back intact at the same address: each KV
//!   block at once after its write and again at the end of every round, the
//!   sleeper's set after each of its wakes and the whole arena's, each
//!   graph's recorded copy after its launch; an allocation's address is read
//!   again after every wake;
//! * every failure is a typed error (a `BackendError` or a
//!   `PoolExhausted`), counted by kind; nothing panics;
//! * the books balance after every round (the arena's bytes in use are the
//!   live allocations', nothing asleep, mapped within the limit and whole
//!   granules) and at the end (nothing in use or cached, every half granule
//!   of the reservation but the quarantined granules' allocated once, and
//!   after teardown the driver holds nothing; the child's exit check covers
//!   the process);
//! * a whole-arena sleep refused for its page-locked copies leaves the arena
//!   awake: the sleeper's set is read back at once.
//!
//! Bounded by counts (rounds, operations per thread), never by wall-clock
//! time. A copy or launch that was checked awake can still be queued after a
//! concurrent whole-arena sleep waited for the streams, and a graph's launch
//! is not refused while its pool's granule sleeps (the backends do not hold
//! them apart), so this body holds KV copies apart from a whole-arena sleep
//! while it runs, and graph launches from a whole-arena sleep until its
//! wake, with locks; KV copies while the arena sleeps (refused, typed),
//! allocations, releases, set sleeps and wakes, captures and the wakes run
//! against everything.
//!
//! A graph whose pool's granule may have been quarantined unmapped (a
//! granule was quarantined since its capture began) is destroyed without a
//! launch: a launch is not refused there either.
//!
//! A KV block whose granule a refused unmap or release quarantined has lost
//! its memory by design (copies to it are refused, naming the quarantine):
//! it is counted, released, and not read again.

use crate::arena_faults::{CaseResult, Driver};
use crate::capability::DriverHeld;
use memgov::backend::capability::{
    ArenaUsage, CaptureBackend, CaptureConfig, CaptureMode, CapturedGraph, PoolCapture, SleepWake,
    VirtualArena,
};
use memgov::{BackendError, BackendErrorKind, RetireSignal};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// KV threads.
pub const KV_THREADS: usize = 8;
/// Rounds per seed; each arms one fault.
pub const ROUNDS: u64 = 12;
/// Operations per KV thread per round.
pub const KV_OPS: u64 = 16;
/// Sleeps or wakes per round of the sleeping thread.
pub const SLEEP_OPS: u64 = 10;
/// Captures per round of the capturing thread.
pub const CAPTURES: u64 = 4;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// The stand-in's pause knob: hold the `n`th call of an entry point from
/// now on (`None`: none).
pub type PauseKnob = dyn Fn(Option<(&str, u64)>) + Sync;

/// Blocks a thread holds, each with whether its probes are written.
type Held<M> = Vec<(Block<M>, bool)>;

/// The entry points whose faults the stress cycles through, besides the
/// release, map and page-locked allocation [`Driver`] names.
pub struct StressEntries<'a> {
    /// Creating a physical handle (`cuMemCreate`).
    pub create: &'a str,
    /// Setting a mapping's access (`cuMemSetAccess`).
    pub set_access: &'a str,
    /// Unmapping (`cuMemUnmap`).
    pub unmap: &'a str,
    /// The pause knob on the map entry point, callable from the sleeping
    /// thread ([`Driver::pause`]).
    pub pause: &'a PauseKnob,
    /// Whether a call is held ([`Driver::paused`]).
    pub paused: &'a (dyn Fn() -> bool + Sync),
    /// Let the held call go on ([`Driver::resume`]).
    pub resume: &'a (dyn Fn() + Sync),
    /// The map entry point ([`Driver::map`]).
    pub map: &'a str,
}

/// xorshift64*: the threads' choices, from the seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, stream: u64) -> Self {
        Rng(
            (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03))
                | 1,
        )
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pattern(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(31)
                .wrapping_add(tag.wrapping_mul(0x9d)) as u8
        })
        .collect()
}

/// Outcomes counted by name (refusals, faults, checks made).
#[derive(Default)]
struct Tally(Mutex<BTreeMap<String, (u64, Option<String>)>>);

impl Tally {
    fn add(&self, what: impl Into<String>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(what.into())
            .or_default()
            .0 += 1;
    }
    /// A typed refusal, counted by operation and kind; the first of each
    /// kept as an example.
    fn refused(&self, op: &str, e: &BackendError) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // The refusals of a sleeping arena apart from the others of the kind.
        let asleep = if e.message.contains("asleep") {
            " (asleep)"
        } else {
            ""
        };
        let entry = m
            .entry(format!("{op} refused {:?}{asleep}", e.kind))
            .or_default();
        entry.0 += 1;
        entry.1.get_or_insert_with(|| e.to_string());
    }
    fn get(&self, what: &str) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(what)
            .map_or(0, |(n, _)| *n)
    }
    fn line(&self) -> String {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let counts: Vec<String> = m.iter().map(|(k, (n, _))| format!("{k}: {n}")).collect();
        let examples: Vec<String> = m
            .iter()
            .filter_map(|(k, (_, e))| e.as_ref().map(|e| format!("\n  first {k}: {e}")))
            .collect();
        format!("{}{}", counts.join(", "), examples.concat())
    }
}

/// The live ranges, by start: every allocation is checked against them as
/// it comes back.
#[derive(Default)]
struct Live(Mutex<BTreeMap<u64, (u64, &'static str)>>);

impl Live {
    fn insert(&self, at: u64, len: u64, who: &'static str) -> Result<(), String> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((&q, &(l, w))) = m.range(..=at).next_back() {
            ensure!(
                q + l <= at,
                "{who}'s allocation {at:#x}+{len:#x} overlaps {w}'s live {q:#x}+{l:#x}"
            );
        }
        if let Some((&q, &(l, w))) = m.range(at..).next() {
            ensure!(
                at + len <= q,
                "{who}'s allocation {at:#x}+{len:#x} overlaps {w}'s live {q:#x}+{l:#x}"
            );
        }
        m.insert(at, (len, who));
        Ok(())
    }
    fn remove(&self, at: u64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&at);
    }
    fn bytes(&self) -> u64 {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.values().map(|(l, _)| l).sum()
    }
}

/// What every thread shares.
struct Shared<'s, C: CaptureBackend> {
    ctx: &'s C,
    arena: C::Arena,
    live: Live,
    tally: Tally,
    /// Held for reading by KV copies, for writing by a whole-arena sleep
    /// while it runs (see the module's docs).
    copies: RwLock<()>,
    /// Held for reading by graph launches, for writing from a whole-arena
    /// sleep to its wake (see the module's docs).
    launches: RwLock<()>,
    /// Held for reading by allocations and captures' beginnings (which may
    /// map), for writing by the sleeper from arming the pause knob until a
    /// map is held: the map held is its set's wake's.
    maps: RwLock<()>,
    granule: u64,
    /// The entry point allocating page-locked host memory
    /// ([`Driver::host_alloc`]).
    host_alloc: &'s str,
}

/// A live allocation with the bytes written at its start and end.
struct Block<M> {
    memory: M,
    at: u64,
    len: u64,
    tag: u64,
}

const PROBE: usize = 4096;

fn probes(len: u64) -> [u64; 2] {
    [0, len.saturating_sub(PROBE as u64)]
}

fn alloc<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    bytes: u64,
    who: &'static str,
) -> Result<Option<(C::Memory, u64, u64)>, String> {
    let maps = sh.maps.read().unwrap_or_else(|e| e.into_inner());
    let outcome = sh.ctx.allocate(s, bytes);
    drop(maps);
    match outcome {
        Ok(m) => {
            let at = sh.ctx.device_address(&m);
            let len = bytes.next_multiple_of(256);
            sh.live.insert(at, len, who)?;
            sh.tally.add("allocations checked for overlap");
            Ok(Some((m, at, len)))
        }
        Err(e) => {
            sh.tally.refused(&format!("{who} allocate"), &e);
            Ok(None)
        }
    }
}

/// Free `b` stream-ordered and wait until it retired; a refused free keeps
/// it live (returned).
fn free<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    b: Block<C::Memory>,
    who: &str,
) -> Result<Option<Block<C::Memory>>, String> {
    match free_start(sh, s, b, who) {
        Ok(retired) => free_finish(sh, s, &retired, who).map(|()| None),
        Err(kept) => Ok(Some(kept)),
    }
}

/// Free `b` stream-ordered: its retire flag, or `b` back when the free was
/// refused (kept live).
fn free_start<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    b: Block<C::Memory>,
    who: &str,
) -> Result<Arc<AtomicBool>, Block<C::Memory>> {
    let retired = Arc::new(AtomicBool::new(false));
    let r = retired.clone();
    sh.live.remove(b.at);
    match sh.ctx.free_async(
        s,
        b.memory,
        RetireSignal::from_fn(move |_| r.store(true, Ordering::SeqCst)),
    ) {
        Ok(()) => Ok(retired),
        Err((memory, _, e)) => {
            sh.tally.refused(&format!("{who} free_async"), &e);
            let kept = Block { memory, ..b };
            let m = &mut *sh.live.0.lock().unwrap_or_else(|e| e.into_inner());
            m.insert(kept.at, (kept.len, "kept"));
            Err(kept)
        }
    }
}

/// Wait until a release begun on `s` retired.
fn free_finish<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    retired: &AtomicBool,
    who: &str,
) -> Result<(), String> {
    // A synchronize refused by a fault is tried again: the release retires
    // with its stream whatever the wait reports.
    for _ in 0..8 {
        match sh.ctx.synchronize(s) {
            Ok(()) => break,
            Err(e) => sh.tally.refused(&format!("{who} synchronize"), &e),
        }
    }
    ensure!(
        retired.load(Ordering::SeqCst),
        "{who}: a release had not retired once its stream was synchronized"
    );
    Ok(())
}

/// Write `b`'s probes (its start and end) and read them back at once. `Ok(false)`:
/// refused (typed, counted); the block's contents are then unknown and it
/// is written again before it is checked.
fn write_block<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    b: &Block<C::Memory>,
    who: &str,
) -> Result<bool, String> {
    let _copies = sh.copies.read().unwrap_or_else(|e| e.into_inner());
    for (i, off) in probes(b.len).into_iter().enumerate() {
        let n = (PROBE as u64).min(b.len) as usize;
        let want = pattern(b.tag * 2 + i as u64, n);
        if let Err(e) = sh.ctx.write(s, &b.memory, off, &want) {
            sh.tally.refused(&format!("{who} write"), &e);
            return Ok(false);
        }
    }
    drop(_copies);
    check_block(sh, s, b, who)
}

/// Read `b`'s probes back: `Ok(true)` intact, `Ok(false)` the read was
/// refused (typed, counted), `Err` a byte differs or the address moved.
fn check_block<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    b: &Block<C::Memory>,
    who: &str,
) -> Result<bool, String> {
    let _copies = sh.copies.read().unwrap_or_else(|e| e.into_inner());
    let now = sh.ctx.device_address(&b.memory);
    ensure!(
        now == b.at,
        "{who}: an allocation moved from {:#x} to {now:#x}",
        b.at
    );
    for (i, off) in probes(b.len).into_iter().enumerate() {
        let n = (PROBE as u64).min(b.len) as usize;
        let mut back = vec![0u8; n];
        if let Err(e) = sh.ctx.read(s, &b.memory, off, &mut back) {
            sh.tally.refused(&format!("{who} read"), &e);
            return Ok(false);
        }
        ensure!(
            back == pattern(b.tag * 2 + i as u64, n),
            "{who}: the bytes at {:#x}+{off:#x} ({n} B) differ from what was written",
            b.at
        );
    }
    sh.tally.add("blocks read back intact");
    Ok(true)
}

/// One KV thread's round: allocate, write and read back, release, with a
/// few blocks held across rounds in `held`.
fn kv_round<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    rng: &mut Rng,
    held: &mut Held<C::Memory>,
    next_tag: &AtomicU64,
) -> Result<(), String> {
    let g = sh.granule;
    let sizes = [64 << 10, 256 << 10, g / 2, g, g + g / 2, 2 * g];
    for _ in 0..KV_OPS {
        if held.len() < 4 && rng.below(3) != 0 {
            let bytes = sizes[rng.below(sizes.len() as u64) as usize];
            if let Some((memory, at, len)) = alloc(sh, s, bytes, "a KV thread")? {
                let b = Block {
                    memory,
                    at,
                    len,
                    tag: next_tag.fetch_add(1, Ordering::Relaxed),
                };
                let written = write_block(sh, s, &b, "a KV thread")?;
                held.push((b, written));
            }
        } else if !held.is_empty() {
            let i = rng.below(held.len() as u64) as usize;
            let (b, written) = held.swap_remove(i);
            if written {
                check_block(sh, s, &b, "a KV thread")?;
            }
            if let Some(kept) = free(sh, s, b, "a KV thread")? {
                held.push((kept, false));
            }
        }
    }
    Ok(())
}

/// The sleeping thread's blocks: a set of written blocks it puts to sleep
/// and wakes, and blocks whose write or release was refused (`spare`,
/// written when checked, released at the end).
struct Sleeper<M> {
    set: Held<M>,
    set_asleep: bool,
    spare: Held<M>,
}

/// Wake the set at `ptrs` on another thread, hold the wake's first map in
/// the driver (no other thread maps meanwhile), release `b` and wait
/// until its release retired, then let the map go on. Returns the wake's
/// outcome.
fn release_during_wake<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    d: &StressEntries<'_>,
    s: &C::Stream,
    gone: Vec<Block<C::Memory>>,
    ptrs: &[u64],
    spare: &mut Held<C::Memory>,
) -> Result<Result<u64, BackendError>, String> {
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let maps = sh.maps.write().unwrap_or_else(|e| e.into_inner());
        (d.pause)(Some((d.map, 1)));
        let waker = scope.spawn(|| {
            let r = sh.arena.wake_ranges(ptrs);
            done.store(true, Ordering::SeqCst);
            r
        });
        until(|| (d.paused)() || done.load(Ordering::SeqCst));
        // Disarmed: a map not held by now is not held later.
        (d.pause)(None);
        drop(maps);
        let held = (d.paused)();
        let mut retiring = Vec::new();
        for b in gone {
            match free_start(sh, s, b, "the sleeper") {
                Ok(retired) => retiring.push(retired),
                Err(kept) => spare.push((kept, false)),
            }
        }
        let mut outcome: Result<(), String> = Ok(());
        if held {
            // The releases retire on their stream's thread, which waits for
            // nothing the held map holds; only a deadlock takes 60 s (no
            // timing is asserted).
            let since = std::time::Instant::now();
            let all = || retiring.iter().all(|r| r.load(Ordering::SeqCst));
            until(|| all() || since.elapsed().as_secs() >= 60);
            if all() {
                sh.tally
                    .add("set members retired while the wake's map was held");
            } else {
                outcome = Err("a release did not retire in 60 s while a map was held".into());
            }
            (d.resume)();
        }
        let woke = waker
            .join()
            .map_err(|_| "the waking thread panicked".to_string())?;
        outcome?;
        for retired in retiring {
            free_finish(sh, s, &retired, "the sleeper")?;
            sh.tally.add("set members released during the set's wake");
        }
        Ok(woke)
    })
}

/// Spin (yielding) until `what` holds.
fn until(what: impl Fn() -> bool) {
    while !what() {
        std::thread::yield_now();
    }
}

/// A new set for the sleeping thread, made between rounds (no other thread
/// allocating): six half granules side by side, so that the granules
/// between its ends are the set's alone, each shared by two of it.
fn new_set<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    me: &mut Sleeper<C::Memory>,
    next_tag: &AtomicU64,
) -> Result<(), String> {
    for _ in 0..6 {
        if let Some((memory, at, len)) = alloc(sh, s, sh.granule / 2, "the sleeper")? {
            let b = Block {
                memory,
                at,
                len,
                tag: next_tag.fetch_add(1, Ordering::Relaxed),
            };
            if write_block(sh, s, &b, "the sleeper")? {
                me.set.push((b, true));
            } else if let Some(kept) = free(sh, s, b, "the sleeper")? {
                me.spare.push((kept, false));
            }
        }
    }
    Ok(())
}

/// The sleeping thread's round: a set of its own put to sleep and woken,
/// the whole arena put to sleep and woken, each wake checked.
fn sleeper_round<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    d: &StressEntries<'_>,
    s: &C::Stream,
    rng: &mut Rng,
    me: &mut Sleeper<C::Memory>,
) -> Result<(), String> {
    // Held from a whole-arena sleep to its wake.
    let mut asleep = None;
    for _ in 0..SLEEP_OPS {
        if me.set_asleep {
            // Half the time one of the set is released as the rest wakes:
            // the wake held inside its first map (the stand-in's pause
            // knob) while the release retires, sharing a granule with the
            // others.
            let woke = if me.set.len() > 1 && rng.below(2) == 0 {
                // One whose granule keeps another member (so the wake maps
                // that granule as it retires), at an end of the set when
                // there is one (its range meets free space or a KV block's
                // in the free list).
                me.set.sort_by_key(|(b, _)| b.at);
                let g = sh.granule;
                let shares = |i: usize| {
                    let (lo, hi) = (
                        me.set[i].0.at / g,
                        (me.set[i].0.at + me.set[i].0.len - 1) / g,
                    );
                    me.set
                        .iter()
                        .enumerate()
                        .any(|(j, (b, _))| j != i && b.at / g <= hi && (b.at + b.len - 1) / g >= lo)
                };
                let last = me.set.len() - 1;
                let ends: Vec<usize> = [0, last].into_iter().filter(|&i| shares(i)).collect();
                let any: Vec<usize> = (0..me.set.len()).filter(|&i| shares(i)).collect();
                let pick = |v: &[usize], r: u64| v[(r % v.len() as u64) as usize];
                let r = rng.next();
                let i = if !ends.is_empty() {
                    pick(&ends, r)
                } else if !any.is_empty() {
                    pick(&any, r)
                } else {
                    (r % me.set.len() as u64) as usize
                };
                let gone = vec![me.set.remove(i).0];
                let ptrs: Vec<u64> = me.set.iter().map(|(b, _)| b.at).collect();
                release_during_wake(sh, d, s, gone, &ptrs, &mut me.spare)?
            } else {
                let ptrs: Vec<u64> = me.set.iter().map(|(b, _)| b.at).collect();
                sh.arena.wake_ranges(&ptrs)
            };
            match woke {
                Ok(_) => {
                    sh.tally.add("set wakes");
                    me.set_asleep = false;
                    for (b, _) in me.set.iter() {
                        check_block(sh, s, b, "the sleeper's set")?;
                    }
                }
                Err(e) => sh.tally.refused("wake_ranges", &e),
            }
        } else if asleep.is_some() || sh.arena.usage().asleep > 0 {
            match sh.arena.wake() {
                Ok(_) => {
                    asleep = None;
                    sh.tally.add("arena wakes");
                    for (b, _) in me.set.iter() {
                        check_block(sh, s, b, "the sleeper's set")?;
                    }
                }
                Err(e) => sh.tally.refused("wake", &e),
            }
        } else if !me.set.is_empty() && rng.below(2) == 0 {
            let ptrs: Vec<u64> = me.set.iter().map(|(b, _)| b.at).collect();
            match sh.arena.sleep_ranges(&ptrs, true) {
                Ok(r) => {
                    sh.tally.add("set sleeps");
                    if r.released > 0 {
                        sh.tally.add("set sleeps releasing granules");
                    }
                    me.set_asleep = true;
                }
                Err(e) => {
                    sh.tally.refused("sleep_ranges", &e);
                    // Only this thread sleeps: what sleeps now is the set's.
                    me.set_asleep = sh.arena.usage().asleep > 0;
                }
            }
        } else {
            let launches = sh.launches.write().unwrap_or_else(|e| e.into_inner());
            let copies = sh.copies.write().unwrap_or_else(|e| e.into_inner());
            // A sleep refused part-way may leave the arena asleep with no
            // granule counted asleep (those in use quarantined): the
            // launches stay held until a wake (which is `Ok(0)` on an awake
            // arena) goes ahead.
            let refused_copies = match sh.arena.sleep(true) {
                Ok(_) => {
                    sh.tally.add("arena sleeps");
                    false
                }
                Err(e) => {
                    sh.tally.refused("sleep", &e);
                    e.message.contains(sh.host_alloc)
                }
            };
            drop(copies);
            if refused_copies {
                // Refused for its page-locked copies: nothing released, the
                // arena awake and its memory usable at once.
                for (b, _) in me.set.iter() {
                    ensure!(
                        check_block(sh, s, b, "the sleeper's set")?,
                        "a copy refused after a sleep refused for its page-locked copies, which \
                         leaves the arena awake"
                    );
                }
                sh.tally
                    .add("sleeps refused for their copies, arena awake after");
            }
            asleep = Some(launches);
        }
    }
    // The round ends with the arena awake (its set may sleep): the fault
    // fails one call, so a wake tried again goes ahead.
    for _ in 0..4 {
        if asleep.is_none() || me.set_asleep {
            break;
        }
        match sh.arena.wake() {
            Ok(_) => {
                asleep = None;
                sh.tally.add("arena wakes");
            }
            Err(e) => sh.tally.refused("wake", &e),
        }
    }
    ensure!(
        asleep.is_none() || me.set_asleep,
        "the arena's wake was refused four times in a row under a single fault"
    );
    Ok(())
}

/// The capturing thread's round: capture an upload and a download from a
/// pool, end, launch, compare, destroy. Refusals (typed) are counted.
fn capture_round<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    rng: &mut Rng,
    round: u64,
) -> Result<(), String> {
    for i in 0..CAPTURES {
        let n = 256 * (1 + rng.below(16)) as usize;
        let config = CaptureConfig {
            pool_bytes: n as u64,
            mode: CaptureMode::Global,
        };
        let quarantined = sh.arena.usage().quarantined;
        let maps = sh.maps.read().unwrap_or_else(|e| e.into_inner());
        let began = sh.ctx.begin_capture(s, config);
        drop(maps);
        let mut cap = match began {
            Ok(c) => c,
            Err(e) => {
                sh.tally.refused("begin_capture", &e);
                continue;
            }
        };
        let want = pattern(round * 100 + i, n);
        let recorded = (|| {
            let buf = cap.allocate(n as u64).map_err(BackendError::from)?;
            cap.upload(&buf, 0, want.clone())?;
            cap.download(&buf, 0, n)
        })();
        let graph = cap.end();
        let (slot, mut graph) = match (recorded, graph) {
            (Ok(slot), Ok(graph)) => (slot, graph),
            (Err(e), Ok(graph)) => {
                sh.tally.refused("capture", &e);
                graph.destroy().map_err(|e| format!("destroy: {e}"))?;
                continue;
            }
            (_, Err(e)) => {
                sh.tally.refused("end capture", &e);
                continue;
            }
        };
        {
            let _launches = sh.launches.read().unwrap_or_else(|e| e.into_inner());
            // A granule quarantined unmapped since the pool was taken may be
            // the pool's, and a launch is not refused for it: not launched.
            if sh.arena.usage().quarantined > quarantined {
                sh.tally.add("graphs not launched after a quarantine");
            } else {
                match graph.launch(s) {
                    Ok(()) => match graph.read_output(slot) {
                        Ok(got) => {
                            ensure!(got == want, "a graph's recorded copy came back different");
                            sh.tally.add("graphs launched and compared");
                        }
                        Err(e) => sh.tally.refused("read_output", &e),
                    },
                    Err(e) => sh.tally.refused("launch", &e),
                }
            }
        }
        if let Err(e) = graph.destroy() {
            return Err(format!("destroy: {e}"));
        }
    }
    Ok(())
}

/// Wake whatever sleeps (the fault disarmed): a wake refused then is a
/// failure, but one that does not fit the limit (the KV threads filled the
/// arena while the set slept), which makes room: a trim, then KV blocks
/// read back and released one by one.
fn settle<C: CaptureBackend>(
    sh: &Shared<'_, C>,
    s: &C::Stream,
    me: &mut Sleeper<C::Memory>,
    kv: &mut [Held<C::Memory>],
) -> Result<(), String> {
    while me.set_asleep {
        let ptrs: Vec<u64> = me.set.iter().map(|(b, _)| b.at).collect();
        match sh.arena.wake_ranges(&ptrs) {
            Ok(_) => me.set_asleep = false,
            Err(e) if e.kind == BackendErrorKind::OutOfMemory => {
                sh.tally.add("set wakes after the round making room");
                if sh.arena.trim().map_err(|e| format!("trim: {e}"))? > 0 {
                    continue;
                }
                let (b, written) = kv.iter_mut().find_map(|h| h.pop()).ok_or_else(|| {
                    format!("waking the set after the round: {e}; nothing left to release")
                })?;
                if written {
                    check_block(sh, s, &b, "the round's check")?;
                }
                if free(sh, s, b, "the round's check")?.is_some() {
                    return Err("a release refused with no fault armed".into());
                }
            }
            Err(e) => return Err(format!("waking the set after the round: {e}")),
        }
    }
    // `Ok(0)` on an awake arena.
    sh.arena
        .wake()
        .map_err(|e| format!("waking the arena after the round: {e}"))?;
    Ok(())
}

fn books(u: &ArenaUsage, live: u64, limit: u64) -> Result<(), String> {
    ensure!(
        u.in_use == live,
        "the arena counts {} B in use, the live allocations hold {live} B: {u:?}",
        u.in_use
    );
    ensure!(
        u.asleep == 0,
        "granules still asleep after the wakes: {u:?}"
    );
    ensure!(
        u.mapped % u.granule == 0 && u.cached <= u.mapped && u.in_use <= u.mapped,
        "the arena's bytes do not add up: {u:?}"
    );
    ensure!(
        u.mapped <= limit + u.quarantined as u64 * u.granule,
        "{} B mapped over the limit of {limit} B: {u:?}",
        u.mapped
    );
    Ok(())
}

/// Run the stress with `seed` (the threads' choices and the fault cycle).
pub fn run<C: CaptureBackend>(d: &Driver<'_, C>, e: &StressEntries<'_>, seed: u64) -> CaseResult {
    let r = stress(d, e, seed);
    (d.fail)(None);
    r
}

fn stress<C: CaptureBackend>(d: &Driver<'_, C>, e: &StressEntries<'_>, seed: u64) -> CaseResult {
    let ctx = (d.factory)().map_err(|e| format!("open: {e}"))?;
    let arena = ctx.arena().ok_or("no arena")?;
    let u0 = arena.usage();
    let g = u0.granule;
    // Room for about half of what the threads ask at their peak: over the
    // limit, allocations trim and are refused.
    let limit = 40 * g;
    arena.set_limit(limit);
    let sh = Shared {
        ctx: &ctx,
        arena: arena.clone(),
        live: Live::default(),
        tally: Tally::default(),
        copies: RwLock::new(()),
        launches: RwLock::new(()),
        maps: RwLock::new(()),
        granule: g,
        host_alloc: d.host_alloc,
    };
    let entries = [
        e.create,
        d.map,
        e.set_access,
        e.unmap,
        d.release,
        d.host_alloc,
    ];
    let streams: Vec<C::Stream> = (0..KV_THREADS + 2)
        .map(|_| ctx.create_stream())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("create_stream: {e}"))?;
    let next_tag = AtomicU64::new(seed << 32);
    let mut kv_held: Vec<Held<C::Memory>> = (0..KV_THREADS).map(|_| Vec::new()).collect();
    let mut me: Sleeper<C::Memory> = Sleeper {
        set: Vec::new(),
        set_asleep: false,
        spare: Vec::new(),
    };
    let mut rngs: Vec<Rng> = (0..KV_THREADS as u64 + 2)
        .map(|i| Rng::new(seed, i))
        .collect();
    let mut faults: HashMap<&str, u64> = HashMap::new();
    for round in 0..ROUNDS {
        let entry = entries[((seed + round) % entries.len() as u64) as usize];
        let position = 1 + (seed * 7 + round * 3) % 5;
        *faults.entry(entry).or_default() += 1;
        if me.set.is_empty() {
            new_set(&sh, &streams[KV_THREADS], &mut me, &next_tag)?;
        }
        (d.fail)(Some((entry, position)));
        let (kv_rngs, rest) = rngs.split_at_mut(KV_THREADS);
        let (sleeper_rng, capture_rng) = rest.split_at_mut(1);
        let outcome: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let sh = &sh;
            let next_tag = &next_tag;
            let mut joins = Vec::new();
            for ((held, rng), s) in kv_held.iter_mut().zip(kv_rngs.iter_mut()).zip(&streams) {
                joins.push(scope.spawn(move || kv_round(sh, s, rng, held, next_tag)));
            }
            let me = &mut me;
            let (ss, cs) = (&streams[KV_THREADS], &streams[KV_THREADS + 1]);
            let rng = &mut sleeper_rng[0];
            joins.push(scope.spawn(move || sleeper_round(sh, e, ss, rng, me)));
            let rng = &mut capture_rng[0];
            joins.push(scope.spawn(move || capture_round(sh, cs, rng, round)));
            joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err("a thread panicked".into())))
                .collect()
        });
        (d.fail)(None);
        for r in outcome {
            r.map_err(|e| {
                format!("seed {seed}, round {round} ({entry} call {position} failing): {e}")
            })?;
        }
        settle(&sh, &streams[0], &mut me, &mut kv_held)
            .map_err(|e| format!("seed {seed}, round {round}: {e}"))?;
        // Every block the threads hold, read back; one whose write was
        // refused is written now; one on a quarantined granule is let go.
        let checker = &streams[0];
        for held in kv_held.iter_mut().chain([&mut me.set, &mut me.spare]) {
            let mut i = 0;
            while i < held.len() {
                let (b, written) = &mut held[i];
                let ok = if *written {
                    check_block(&sh, checker, b, "the round's check")?
                } else {
                    write_block(&sh, checker, b, "the round's check")?
                };
                if ok {
                    *written = true;
                    i += 1;
                    continue;
                }
                // Refused with the fault disarmed and everything awake:
                // only a quarantined granule's block may be.
                let mut back = [0u8; 1];
                let e = ctx
                    .read(checker, &b.memory, 0, &mut back)
                    .err()
                    .ok_or("a copy refused with nothing asleep went ahead when tried again")?;
                ensure!(
                    e.message.contains("quarantined"),
                    "seed {seed}, round {round}: a copy to a live block at {:#x} refused with \
                     nothing asleep and no fault armed: {e}",
                    b.at
                );
                sh.tally.add("blocks lost to a quarantined granule");
                let (b, _) = held.swap_remove(i);
                if let Some(kept) = free(&sh, checker, b, "the round's check")? {
                    return Err(format!(
                        "seed {seed}, round {round}: the release of a block at {:#x} was \
                         refused with no fault armed",
                        kept.at
                    ));
                }
            }
        }
        books(&arena.usage(), sh.live.bytes(), limit)
            .map_err(|e| format!("seed {seed}, after round {round}: {e}"))?;
    }
    // Everything released; the books at zero.
    let s = &streams[0];
    for held in kv_held.iter_mut().chain([&mut me.set, &mut me.spare]) {
        for (b, _) in held.drain(..) {
            if free(&sh, s, b, "the end")?.is_some() {
                return Err("a release refused at the end with no fault armed".into());
            }
        }
    }
    arena.trim().map_err(|e| format!("the last trim: {e}"))?;
    let u = arena.usage();
    ensure!(
        u.in_use == 0 && u.cached == 0 && u.asleep == 0 && sh.live.bytes() == 0,
        "after every release and a trim: {u:?}"
    );
    // No address space lost or handed out twice: with the limit at the
    // reservation, every half granule of it but the quarantined granules'
    // is allocated once (each checked for overlap and written: a write to
    // memory that is not mapped stops the stand-in).
    arena.set_limit(u.reserved);
    let mut fill = Vec::new();
    let half = g / 2;
    loop {
        match alloc(&sh, s, half, "the last fill")? {
            Some((memory, at, len)) => {
                let b = Block {
                    memory,
                    at,
                    len,
                    tag: next_tag.fetch_add(1, Ordering::Relaxed),
                };
                ensure!(
                    write_block(&sh, s, &b, "the last fill")?,
                    "a write to the last fill's allocation at {at:#x} was refused"
                );
                fill.push((b, true));
            }
            None => break,
        }
        ensure!(
            fill.len() as u64 <= u.reserved / half,
            "more half granules allocated than the reservation holds"
        );
    }
    let want = (u.reserved - u.quarantined as u64 * g) / half;
    ensure!(
        fill.len() as u64 == want,
        "{} half granules fit in the emptied arena, not {want} (its reservation less the {} \
         quarantined granule(s)): {}",
        fill.len(),
        u.quarantined,
        sh.tally.line()
    );
    for (b, _) in fill {
        if free(&sh, s, b, "the end")?.is_some() {
            return Err("a release refused at the end with no fault armed".into());
        }
    }
    arena
        .trim()
        .map_err(|e| format!("the trim after the fill: {e}"))?;
    ensure!(
        sh.tally.get("allocations checked for overlap") > 0
            && sh.tally.get("blocks read back intact") > 0,
        "nothing was checked: {}",
        sh.tally.line()
    );
    let tally = sh.tally.line();
    drop(sh);
    for st in streams {
        ctx.destroy_stream(st)
            .map_err(|e| format!("destroy_stream: {e}"))?;
    }
    ctx.teardown(false).map_err(|e| format!("teardown: {e}"))?;
    let left = (d.held)();
    ensure!(
        left == DriverHeld::default(),
        "after teardown the driver still holds {left:?}"
    );
    let mut faults: Vec<_> = faults.into_iter().collect();
    faults.sort();
    Ok(format!(
        "seed {seed}: {ROUNDS} rounds, faults armed {faults:?}; {tally}; quarantined at the end: {}",
        u.quarantined
    ))
}
