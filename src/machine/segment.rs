//! The shared-memory segment: a file mapped by every process that governs
//! one physical device, its header and its table of process slots. Only
//! atomic words are read or written in the mapping once it is set up; no
//! lock lives in it, so a process that dies leaves nothing held.
//!
//! # Layout (version 3, every field a little-endian `u64` word)
//!
//! ```text
//! header (512 B)
//!   0   magic "MEMGOVML"            set once by the creator, checked by every opener
//!   8   layout version (1)
//!   16  slot count
//!   24  slot size (256)
//!   32  checksum of the words 0..32 and the device key (FNV-1a)
//!   40  state: 0 being set up, 1 ready
//!   48  limit: the bytes the ledger may promise in all
//!   56  the owner's uid
//!   64  device key (64 bytes, NUL padded)
//!   128 the ledger word G (its own cache line): total units, tag slot, tag sequence
//!   192 device total bytes, as last observed
//!   200 device free bytes, as last observed
//!   208 outside units: device bytes in use that no slot has charged
//!   216 when the device was observed (ms since the Unix epoch)
//!   224 reclaims: dead slots reclaimed so far
//!   248 audit: impossible changes refused (a give-back beyond a share)
//! slots (slot count x 256 B), from offset 512
//!   0   state: kind (2 bits) | epoch (30 bits) | pid (32 bits)
//!   8   the owner's start time (clock ticks since boot, /proc/<pid>/stat field 22)
//!   16  W: charged units (48 bits) | applied sequence (16 bits)
//!   24  C: claim sequence (16 bits) | signed delta in units (48 bits)
//!   32  limit (bytes)           40  floor (bytes)        48  priority
//!   56  used (bytes charged to allocations, as last published)
//!   64  cached (bytes in block caches, as last published)
//!   72  contexts
//!   80  doorbell ring (low 32 bits: a futex word)
//!   88  bytes asked for by the last ring
//!   96  the last ring answered
//!   104 bytes given back through the doorbell, in all
//!   112 threads of the holder waiting for room (low 32 bits)
//!   128 name (64 bytes, NUL padded)
//! ```
//!
//! The first byte of each slot is also its lock byte: its holder keeps an
//! open-file-description lock on it (see "Slot locks" below).

use super::MachineError;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"MEMGOVML");
/// The layout this build reads and writes.
pub const LAYOUT_VERSION: u64 = 3;
pub(crate) const HEADER: usize = 512;
pub(crate) const SLOT: usize = 256;
pub(crate) const KEY_BYTES: usize = 64;
pub(crate) const NAME_BYTES: usize = 64;
/// The ledger's unit: every charge on it is a whole number of 4 KiB pages.
pub const UNIT: u64 = 4096;
/// The most slots a segment has (the tag of the ledger word has 8 bits,
/// one value of which means "no tag").
pub const MAX_SLOTS: usize = 255;

const READY: u64 = 1;

// Header word offsets.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_SLOTS: usize = 16;
const H_SLOT_SIZE: usize = 24;
const H_CHECKSUM: usize = 32;
const H_STATE: usize = 40;
pub(crate) const H_LIMIT: usize = 48;
const H_UID: usize = 56;
const H_KEY: usize = 64;
pub(crate) const H_LEDGER: usize = 128;
pub(crate) const H_DEV_TOTAL: usize = 192;
pub(crate) const H_DEV_FREE: usize = 200;
pub(crate) const H_OUTSIDE: usize = 208;
pub(crate) const H_DEV_AT: usize = 216;
pub(crate) const H_RECLAIMS: usize = 224;
/// A futex word bumped when room may have appeared (a share given back, a
/// dead slot reclaimed, a trim request answered) while someone waits.
pub(crate) const H_NEWS: usize = 232;
/// Processes waiting on `H_NEWS` (a 32-bit count).
pub(crate) const H_WAITERS: usize = 236;
/// Units the management library attributes to processes on the device
/// that have no slot here (`observe_processes`).
pub(crate) const H_OUTSIDE_PROCS: usize = 240;

// Slot word offsets.
pub(crate) const S_STATE: usize = 0;
pub(crate) const S_START: usize = 8;
pub(crate) const S_W: usize = 16;
pub(crate) const S_C: usize = 24;
pub(crate) const S_LIMIT: usize = 32;
pub(crate) const S_FLOOR: usize = 40;
pub(crate) const S_PRIORITY: usize = 48;
pub(crate) const S_USED: usize = 56;
pub(crate) const S_CACHED: usize = 64;
pub(crate) const S_CONTEXTS: usize = 72;
pub(crate) const S_RING: usize = 80;
pub(crate) const S_ASK: usize = 88;
pub(crate) const S_ANSWERED: usize = 96;
pub(crate) const S_GAVE: usize = 104;
pub(crate) const S_NAME: usize = 128;

/// A mapped segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    slots: usize,
    path: PathBuf,
    key: String,
    _file: File,
}

// SAFETY: the mapping is shared memory read and written only through
// atomic words (`word`, `word32`) and, before the segment is published as
// ready, by its creator alone; the pointer stays valid until `Drop` unmaps
// it, which needs `&mut self`.
unsafe impl Send for Segment {}
// SAFETY: as above: every access after set-up is atomic.
unsafe impl Sync for Segment {}

fn checksum(slots: u64, key: &[u8; KEY_BYTES]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    for w in [MAGIC, LAYOUT_VERSION, slots, SLOT as u64] {
        w.to_le_bytes().into_iter().for_each(&mut eat);
    }
    key.iter().copied().for_each(&mut eat);
    h
}

pub(crate) fn key_bytes(key: &str) -> [u8; KEY_BYTES] {
    let mut out = [0u8; KEY_BYTES];
    let b = key.as_bytes();
    let n = b.len().min(KEY_BYTES);
    out[..n].copy_from_slice(&b[..n]);
    out
}

fn size_for(slots: usize) -> usize {
    HEADER + slots * SLOT
}

impl Segment {
    /// Open the segment at `path`, creating it (with `slots` slots, `limit`
    /// bytes to promise and permission bits `mode`) when there is none.
    pub(crate) fn open_or_create(
        path: &Path,
        key: &str,
        slots: usize,
        limit: u64,
        mode: u32,
    ) -> Result<Self, MachineError> {
        if key.is_empty() || key.len() > KEY_BYTES {
            return Err(MachineError::BadKey {
                key: key.to_owned(),
            });
        }
        if slots == 0 || slots > MAX_SLOTS {
            return Err(MachineError::BadSlots { slots });
        }
        let io = |e: std::io::Error| MachineError::Io {
            path: path.to_owned(),
            source: e,
        };
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
        {
            Ok(file) => {
                let created = Self::create(file, path, key, slots, limit);
                if created.is_err() {
                    // Nothing else can have attached: it was never ready.
                    let _ = std::fs::remove_file(path);
                }
                created
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Self::attach(path, Some(key))
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                Err(Self::permission(path, e))
            }
            Err(e) => Err(io(e)),
        }
    }

    fn permission(path: &Path, e: std::io::Error) -> MachineError {
        let owner = std::fs::metadata(path).map(|m| m.uid()).ok();
        MachineError::Permission {
            path: path.to_owned(),
            owner,
            uid: current_uid(),
            source: e,
        }
    }

    fn create(
        file: File,
        path: &Path,
        key: &str,
        slots: usize,
        limit: u64,
    ) -> Result<Self, MachineError> {
        let len = size_for(slots);
        file.set_len(len as u64).map_err(|e| MachineError::Io {
            path: path.to_owned(),
            source: e,
        })?;
        let seg = Self::map(file, path, key.to_owned(), len, slots)?;
        let kb = key_bytes(key);
        // The file is new and empty (zeroed by ftruncate); the state word
        // stays 0 until the header is written, so an opener waits for it.
        seg.word(H_MAGIC).store(MAGIC, Ordering::Relaxed);
        seg.word(H_VERSION).store(LAYOUT_VERSION, Ordering::Relaxed);
        seg.word(H_SLOTS).store(slots as u64, Ordering::Relaxed);
        seg.word(H_SLOT_SIZE).store(SLOT as u64, Ordering::Relaxed);
        seg.word(H_CHECKSUM)
            .store(checksum(slots as u64, &kb), Ordering::Relaxed);
        seg.word(H_LIMIT).store(limit, Ordering::Relaxed);
        seg.word(H_UID)
            .store(u64::from(current_uid()), Ordering::Relaxed);
        seg.write_bytes(H_KEY, &kb);
        seg.word(H_LEDGER)
            .store(super::ledger::G::EMPTY, Ordering::Relaxed);
        seg.word(H_STATE).store(READY, Ordering::Release);
        Ok(seg)
    }

    /// Open an existing segment; `key`, when given, must be its device's.
    pub(crate) fn attach(path: &Path, key: Option<&str>) -> Result<Self, MachineError> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(Self::permission(path, e))
            }
            Err(e) => {
                return Err(MachineError::Io {
                    path: path.to_owned(),
                    source: e,
                })
            }
        };
        let meta = file.metadata().map_err(|e| MachineError::Io {
            path: path.to_owned(),
            source: e,
        })?;
        if meta.uid() != current_uid() {
            return Err(MachineError::ForeignOwner {
                path: path.to_owned(),
                owner: meta.uid(),
                uid: current_uid(),
            });
        }
        // A creator sets the size first and the header after: wait (briefly)
        // for both. One that died in between leaves a segment never ready.
        let deadline = Instant::now() + Duration::from_secs(1);
        let len = loop {
            let len = file
                .metadata()
                .map_err(|e| MachineError::Io {
                    path: path.to_owned(),
                    source: e,
                })?
                .len() as usize;
            if len >= HEADER {
                break len;
            }
            if Instant::now() >= deadline {
                return Err(MachineError::NeverReady {
                    path: path.to_owned(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let mut seg = Self::map(file, path, key.unwrap_or_default().to_owned(), len, 0)?;
        while seg.word(H_STATE).load(Ordering::Acquire) != READY {
            if Instant::now() >= deadline {
                return Err(MachineError::NeverReady {
                    path: path.to_owned(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let magic = seg.word(H_MAGIC).load(Ordering::Relaxed);
        if magic != MAGIC {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!("magic {magic:#018x}, expected {MAGIC:#018x}"),
            });
        }
        let version = seg.word(H_VERSION).load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(MachineError::LayoutVersion {
                path: path.to_owned(),
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        let slots = seg.word(H_SLOTS).load(Ordering::Relaxed);
        let slot_size = seg.word(H_SLOT_SIZE).load(Ordering::Relaxed);
        let mut kb = [0u8; KEY_BYTES];
        seg.read_bytes(H_KEY, &mut kb);
        let sum = seg.word(H_CHECKSUM).load(Ordering::Relaxed);
        if sum != checksum(slots, &kb) || slot_size != SLOT as u64 {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!(
                    "header checksum {sum:#018x} does not match its geometry ({slots} slots of {slot_size} B)"
                ),
            });
        }
        if slots == 0 || slots as usize > MAX_SLOTS || size_for(slots as usize) != len {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!("{len} B long for {slots} slots of {SLOT} B"),
            });
        }
        let found = String::from_utf8_lossy(&kb)
            .trim_end_matches('\0')
            .to_owned();
        match key {
            Some(key) if kb != key_bytes(key) => {
                return Err(MachineError::WrongDevice {
                    path: path.to_owned(),
                    found,
                    expected: key.to_owned(),
                });
            }
            _ => seg.key = found,
        }
        seg.slots = slots as usize;
        Ok(seg)
    }

    fn map(
        file: File,
        path: &Path,
        key: String,
        len: usize,
        slots: usize,
    ) -> Result<Self, MachineError> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of `len` bytes of an open file
        // descriptor; the kernel chooses the address; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MachineError::Io {
                path: path.to_owned(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Self {
            base: p.cast(),
            len,
            slots,
            path: path.to_owned(),
            key,
            _file: file,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// The atomic word at byte `offset`.
    #[inline]
    pub(crate) fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.len);
        // SAFETY: in bounds (checked above) and 8-aligned (the mapping is
        // page-aligned and `offset` a multiple of 8); shared memory is only
        // ever accessed atomically, and the reference lives no longer than
        // `self`, which keeps the mapping.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }

    /// The 32-bit atomic word at byte `offset` (a futex word).
    #[inline]
    pub(crate) fn word32(&self, offset: usize) -> &AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= self.len);
        // SAFETY: as in `word`, for a 4-aligned 32-bit word.
        unsafe { &*self.base.add(offset).cast::<AtomicU32>() }
    }

    /// Slot `i`'s word at `offset` within the slot.
    #[inline]
    pub(crate) fn slot(&self, i: usize, offset: usize) -> &AtomicU64 {
        debug_assert!(i < self.slots);
        self.word(HEADER + i * SLOT + offset)
    }

    pub(crate) fn slot32(&self, i: usize, offset: usize) -> &AtomicU32 {
        self.word32(HEADER + i * SLOT + offset)
    }

    /// Bytes at `offset` (a multiple of 8), written word by word.
    pub(crate) fn write_bytes(&self, offset: usize, bytes: &[u8]) {
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(offset + i * 8)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
    }

    pub(crate) fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            let w = self
                .word(offset + i * 8)
                .load(Ordering::Relaxed)
                .to_le_bytes();
            let n = chunk.len();
            chunk.copy_from_slice(&w[..n]);
        }
    }

    pub(crate) fn slot_name(&self, i: usize) -> String {
        let mut b = [0u8; NAME_BYTES];
        self.read_bytes(HEADER + i * SLOT + S_NAME, &mut b);
        String::from_utf8_lossy(&b)
            .trim_end_matches('\0')
            .to_owned()
    }

    pub(crate) fn set_slot_name(&self, i: usize, name: &str) {
        let mut b = [0u8; NAME_BYTES];
        let mut n = name.len().min(NAME_BYTES);
        while !name.is_char_boundary(n) {
            n -= 1;
        }
        b[..n].copy_from_slice(&name.as_bytes()[..n]);
        self.write_bytes(HEADER + i * SLOT + S_NAME, &b);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are the mapping `map` made; no reference into
        // it outlives `self` (they borrow it).
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

pub(crate) fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Block while the futex word `w` still holds `expected`, at most `timeout`.
pub(crate) fn futex_wait(w: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `w` is a valid, aligned 32-bit word in a shared mapping that
    // outlives the call; FUTEX_WAIT (not private: other processes wake it)
    // only reads it; `ts` lives across the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            w.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wake every waiter on the futex word `w`.
pub(crate) fn futex_wake(w: &AtomicU32) {
    // SAFETY: `w` is a valid, aligned 32-bit word; FUTEX_WAKE does not
    // touch it.
    unsafe {
        libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Threads of the slot's holder waiting on `H_NEWS` (a 32-bit count,
/// part of `H_WAITERS`): what a reclaim takes off `H_WAITERS` for a holder
/// that died waiting.
pub(crate) const S_WAITING: usize = 112;

/// Impossible changes the protocol refused or found (a give-back beyond
/// what a slot held, a total that does not cover a share): an audit
/// finding `MachineLedger::check` reports.
pub(crate) const H_AUDIT: usize = 248;

// --- Slot locks: liveness the kernel vouches for ---
//
// Each slot's holder keeps an open-file-description lock (`F_OFD_SETLK`)
// on one byte of the segment file, the slot's first, for as long as it
// holds the slot. The kernel drops such a lock when the last descriptor of
// its open file description closes, which a dying process's exit does
// whatever killed it: so a slot whose lock can be taken has no living
// holder, in any pid namespace and whatever state its threads are in.
// Locks of one open file description never conflict with each other, so
// every holder takes its lock on a description of its own
// ([`Segment::lock_slot`]) and the probe ([`Segment::slot_held`]) asks
// through the segment's own description, which never locks.

/// Slot `i`'s lock byte.
fn slot_lock_byte(i: usize) -> libc::off_t {
    (HEADER + i * SLOT) as libc::off_t
}

/// `fcntl(fd, cmd, &flock)` on slot `i`'s lock byte, for an OFD lock
/// command; returns the `flock` the kernel filled in.
fn ofd_fcntl(
    fd: std::os::fd::RawFd,
    cmd: libc::c_int,
    kind: libc::c_int,
    i: usize,
) -> std::io::Result<libc::flock> {
    // SAFETY: a plain-old-data struct; all-zero is a valid value (and OFD
    // lock commands require `l_pid` to be 0).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = slot_lock_byte(i);
    fl.l_len = 1;
    // SAFETY: `fd` is an open descriptor owned by the caller for the
    // call's length; `fl` is a valid `flock` that lives across the call.
    let r = unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) };
    if r == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(fl)
    }
}

impl Segment {
    /// A new open file description of the segment's file (not a `dup`,
    /// which shares the description), checked to be the very file mapped.
    fn reopen(&self) -> std::io::Result<File> {
        use std::os::fd::AsRawFd;
        let mine = self._file.metadata()?;
        let same = |f: &File| {
            f.metadata()
                .map(|m| m.dev() == mine.dev() && m.ino() == mine.ino())
                .unwrap_or(false)
        };
        let fd_path = format!("/proc/self/fd/{}", self._file.as_raw_fd());
        for p in [Path::new(&fd_path), self.path.as_path()] {
            if let Ok(f) = OpenOptions::new().read(true).write(true).open(p) {
                if same(&f) {
                    return Ok(f);
                }
            }
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the segment's file cannot be opened again (no /proc/self/fd, and its path names another file)",
        ))
    }

    /// Take slot `i`'s lock on a new open file description: `Ok(None)`
    /// when another description holds it. The lock is held until the
    /// returned [`SlotLock`] is dropped (or the process dies).
    pub(crate) fn lock_slot(&self, i: usize) -> std::io::Result<Option<SlotLock>> {
        use std::os::fd::AsRawFd;
        assert!(i < self.slots);
        let f = self.reopen()?;
        match ofd_fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK, i) {
            Ok(_) => Ok(Some(SlotLock::new(f))),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether some open file description holds slot `i`'s lock: `None`
    /// when the kernel cannot say (then nothing may be judged dead).
    pub(crate) fn slot_held(&self, i: usize) -> Option<bool> {
        use std::os::fd::AsRawFd;
        assert!(i < self.slots);
        let fl = ofd_fcntl(self._file.as_raw_fd(), libc::F_OFD_GETLK, libc::F_WRLCK, i).ok()?;
        Some(i32::from(fl.l_type) != libc::F_UNLCK)
    }
}

/// A slot's lock, held while this value lives: the open file description
/// that holds it. Its descriptor is listed in [`LOCK_FDS`] so that a child
/// `fork` makes lets go of its copy at once (the lock would otherwise live
/// on in the child, keeping a dead parent's slot from being reclaimed).
pub(crate) struct SlotLock {
    file: File,
    at: Option<usize>,
}

/// Descriptors of the slot locks this process holds (-1: none), which the
/// child handler of `pthread_atfork` points at `/dev/null` in a forked
/// child.
static LOCK_FDS: [std::sync::atomic::AtomicI32; 256] =
    [const { std::sync::atomic::AtomicI32::new(-1) }; 256];
/// `/dev/null`, opened once, close-on-exec.
static DEV_NULL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn forked_child_drops_locks() {
    let null = DEV_NULL.load(Ordering::SeqCst);
    if null < 0 {
        return;
    }
    for fd in &LOCK_FDS {
        let fd = fd.load(Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: async-signal-safe (as a handler run in the child
            // after fork must be); atomically makes `fd` another
            // descriptor of /dev/null, dropping the child's reference to
            // the lock's description. The `File` owning `fd` in the child
            // now closes /dev/null instead.
            unsafe {
                libc::dup3(null, fd, libc::O_CLOEXEC);
            }
        }
    }
}

fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use std::os::fd::IntoRawFd;
        if let Ok(null) = OpenOptions::new().read(true).open("/dev/null") {
            DEV_NULL.store(null.into_raw_fd(), Ordering::SeqCst);
            // SAFETY: registers a child handler that only loads atomics and
            // calls dup3 (async-signal-safe).
            unsafe {
                libc::pthread_atfork(None, None, Some(forked_child_drops_locks));
            }
        }
    });
}

impl SlotLock {
    fn new(file: File) -> Self {
        use std::os::fd::AsRawFd;
        watch_forks();
        let fd = file.as_raw_fd();
        let at = LOCK_FDS.iter().position(|w| {
            w.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        Self { file, at }
    }
}

impl Drop for SlotLock {
    fn drop(&mut self) {
        // Off the list before the descriptor closes (and its number can be
        // reused): a fork in between finds it listed only while it is ours.
        if let Some(at) = self.at {
            LOCK_FDS[at].store(-1, Ordering::SeqCst);
        }
        let _ = &self.file;
    }
}
