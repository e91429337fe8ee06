//! The shared-memory segment: a file mapped by every process that governs
//! one physical device, its header and its table of process slots. Only
//! atomic words are read or written in the mapping once it is set up; no
//! lock lives in it, so a process that dies leaves nothing held.
//!
//! A segment is built whole in a private file (its pages reserved, its
//! header written) and only then linked at its path, never over another;
//! an opener follows no symbolic link, takes only a regular file whose
//! owner and mode it trusts, and checks the header and the file's size,
//! read from the file, before it maps anything (`Segment::open_or_create_with`).
//! A file cut short under a mapping does not kill the process (`bus_guard`).
//!
//! # Layout (version 5, every field a little-endian `u64` word)
//!
//! ```text
//! header (512 B)
//!   0   magic "MEMGOVML"            set once by the creator, checked by every opener
//!   8   layout version (1)
//!   16  slot count
//!   24  slot size (512)
//!   32  checksum of the words 0..32 and the device key (FNV-1a)
//!   40  state: 1 ready (what is linked at a path is always ready)
//!   48  limit: the bytes the ledger may promise in all
//!   56  the owner's uid
//!   64  device key (64 bytes, NUL padded)
//!   128 the ledger word G (its own cache line): total units (32 bits) | tag slot (8) | tag sequence (24)
//!   192 device total bytes, as last observed
//!   200 device free bytes, as last observed
//!   208 outside units: device bytes in use that no slot has charged
//!   216 when the device was observed (ms since the Unix epoch)
//!   224 reclaims: dead slots reclaimed so far
//!   248 audit: impossible changes refused (a give-back beyond a share)
//! slots (slot count x 512 B), from offset 512
//!   0   state: kind (2 bits) | epoch (30 bits) | pid (32 bits)
//!   8   the owner's start time (clock ticks since boot, /proc/<pid>/stat field 22)
//!   16  W: charged units (40 bits) | applied sequence (24 bits)
//!   24  C: claim sequence (24 bits) | signed delta in units (40 bits)
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
//!   192 where the limit came from (64 bytes, NUL padded)
//!   256 top sites' sequence: odd while the holder rewrites them
//!   264 top sites: 4 x (site text, 48 bytes NUL padded; live bytes)
//! ```
//!
//! The first byte of each slot is also its lock byte: its holder keeps an
//! open-file-description lock on it (see "Slot locks" below).

use super::MachineError;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"MEMGOVML");
/// The layout this build reads and writes.
pub const LAYOUT_VERSION: u64 = 5;
pub(crate) const HEADER: usize = 512;
pub(crate) const SLOT: usize = 512;
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
/// Where the process's limit came from (`JoinOptions::granted`): the
/// variable's name, NUL-padded; all zero when the limit was not granted.
/// Older builds of this layout never write these bytes and read past them.
pub(crate) const S_LIMIT_FROM: usize = 192;
/// A sequence word guarding the slot's top sites: odd while its process
/// rewrites them (a reader retries until it reads the same even value
/// before and after).
pub(crate) const S_SITES_SEQ: usize = 256;
/// The process's largest call sites by live bytes (contexts with
/// attribution on), largest first: [`SITE_ENTRIES`] entries of
/// [`SITE_TEXT`] bytes of text (NUL-padded, cut on a character boundary)
/// then a word of live bytes; an entry of empty text is unused.
pub(crate) const S_SITES: usize = 264;
/// How many sites a slot publishes.
pub const SITE_ENTRIES: usize = 4;
/// The bytes of one published site's text (longer ones are cut).
pub const SITE_TEXT: usize = 48;
const SITE_ENTRY: usize = SITE_TEXT + 8;
const _: () = assert!(S_SITES + SITE_ENTRIES * SITE_ENTRY <= SLOT);

/// A mapped segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    slots: usize,
    path: PathBuf,
    key: String,
    /// This mapping's entry in the SIGBUS guard's table.
    guard: usize,
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

/// Whom an opener trusts with the segment (`LedgerOptions::shared`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Trust {
    /// The segment must belong to this process's effective uid and be
    /// writable by its owner alone (no group or other write bit).
    #[default]
    Owner,
    /// Any owner, and group write, are accepted (a ledger shared by the
    /// users of a group); other (world) write still is not.
    Group,
}

/// What an open found at the path.
enum Found {
    Segment(Segment),
    Nothing,
}

impl Segment {
    /// Open the segment at `path`, creating it (with `slots` slots, `limit`
    /// bytes to promise and permission bits `mode`) when there is none;
    /// owner-only trust.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn open_or_create(
        path: &Path,
        key: &str,
        slots: usize,
        limit: u64,
        mode: u32,
    ) -> Result<Self, MachineError> {
        Self::open_or_create_with(path, key, slots, limit, mode, Trust::Owner)
    }

    /// [`open_or_create`](Self::open_or_create) with the trust given.
    ///
    /// A segment is built whole in a file of its own (an unnamed
    /// `O_TMPFILE` in the target's directory, or a uniquely named hidden
    /// file where the file system has none), its pages reserved
    /// (`posix_fallocate`) and its header written, and only then linked at
    /// `path`, failing if something is there: a creator killed half-way
    /// leaves nothing at `path`, and an opener never sees a segment that is
    /// not ready. Two creators racing: one links, the other attaches to
    /// what it linked.
    pub(crate) fn open_or_create_with(
        path: &Path,
        key: &str,
        slots: usize,
        limit: u64,
        mode: u32,
        trust: Trust,
    ) -> Result<Self, MachineError> {
        if key.is_empty() || key.len() > KEY_BYTES {
            return Err(MachineError::BadKey {
                key: key.to_owned(),
            });
        }
        if slots == 0 || slots > MAX_SLOTS {
            return Err(MachineError::BadSlots { slots });
        }
        if limit > super::ledger::MAX_TOTAL_BYTES {
            return Err(MachineError::BadLimit {
                key: key.to_owned(),
                limit,
                max: super::ledger::MAX_TOTAL_BYTES,
            });
        }
        // Attach, else create; a creator that lost the race to link
        // attaches to the winner's. Removed between the two: again.
        for _ in 0..16 {
            if let Found::Segment(seg) = Self::attach_found(path, Some(key), trust)? {
                return Ok(seg);
            }
            if let Some(seg) = Self::create(path, key, slots, limit, mode)? {
                return Ok(seg);
            }
        }
        Err(MachineError::Io {
            path: path.to_owned(),
            source: std::io::Error::other(
                "created and removed by others 16 times while this process opened it",
            ),
        })
    }

    fn permission(path: &Path, e: std::io::Error) -> MachineError {
        let owner = std::fs::symlink_metadata(path).map(|m| m.uid()).ok();
        MachineError::Permission {
            path: path.to_owned(),
            owner,
            uid: current_uid(),
            source: e,
        }
    }

    /// Build a segment in a private file and link it at `path`. `None`:
    /// something was linked there first.
    fn create(
        path: &Path,
        key: &str,
        slots: usize,
        limit: u64,
        mode: u32,
    ) -> Result<Option<Self>, MachineError> {
        use std::os::fd::AsRawFd;
        let io = |e: std::io::Error| MachineError::Io {
            path: path.to_owned(),
            source: e,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path.file_name().ok_or_else(|| {
            io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the path names no file",
            ))
        })?;
        let private = Private::new(&dir, name).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => Self::permission(path, e),
            _ => io(e),
        })?;
        let file = private.file.try_clone().map_err(io)?;
        // The mode asked for, whatever the umask: a shared ledger's group
        // must be able to write it.
        // SAFETY: fchmod on an open descriptor this function owns.
        if unsafe { libc::fchmod(file.as_raw_fd(), mode as libc::mode_t) } != 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        let len = size_for(slots);
        // Every page the mapping will touch, reserved now: a full tmpfs is
        // an error here, never a SIGBUS later.
        // SAFETY: posix_fallocate on an open descriptor; it returns an
        // error number, it does not set errno.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if r == libc::ENOSPC {
            return Err(MachineError::NoSpace {
                path: path.to_owned(),
                needed: len as u64,
                free: free_bytes(&file),
                dir,
            });
        }
        if r != 0 {
            return Err(io(std::io::Error::from_raw_os_error(r)));
        }
        let seg = Self::map(file, path, key.to_owned(), len, slots)?;
        let kb = key_bytes(key);
        // The file is new and zeroed, and nobody else can reach it until
        // it is linked below.
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
        if private.link_at(path).map_err(io)? {
            Ok(Some(seg))
        } else {
            Ok(None)
        }
    }

    /// Open an existing segment; `key`, when given, must be its device's.
    pub(crate) fn attach(
        path: &Path,
        key: Option<&str>,
        trust: Trust,
    ) -> Result<Self, MachineError> {
        match Self::attach_found(path, key, trust)? {
            Found::Segment(seg) => Ok(seg),
            Found::Nothing => Err(MachineError::Io {
                path: path.to_owned(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            }),
        }
    }

    /// Open the segment at `path`: not following a symbolic link, a
    /// regular file, its owner and mode as `trust` allows, its header read
    /// from the file (not the mapping) and checked, and its size the one
    /// its geometry needs, all before the file is mapped; after, the path
    /// must still name the file mapped.
    fn attach_found(path: &Path, key: Option<&str>, trust: Trust) -> Result<Found, MachineError> {
        use std::os::unix::fs::{FileExt, FileTypeExt};
        let io = |e: std::io::Error| MachineError::Io {
            path: path.to_owned(),
            source: e,
        };
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Nothing),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(MachineError::NotRegular {
                    path: path.to_owned(),
                    found: "a symbolic link".to_owned(),
                })
            }
            Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
                return Err(MachineError::NotRegular {
                    path: path.to_owned(),
                    found: "a directory".to_owned(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(Self::permission(path, e))
            }
            Err(e) => return Err(io(e)),
        };
        let meta = file.metadata().map_err(io)?;
        let ft = meta.file_type();
        if !ft.is_file() {
            let found = if ft.is_dir() {
                "a directory"
            } else if ft.is_fifo() {
                "a named pipe"
            } else if ft.is_socket() {
                "a socket"
            } else if ft.is_char_device() || ft.is_block_device() {
                "a device"
            } else {
                "not a regular file"
            };
            return Err(MachineError::NotRegular {
                path: path.to_owned(),
                found: found.to_owned(),
            });
        }
        let uid = current_uid();
        if trust == Trust::Owner && meta.uid() != uid {
            return Err(MachineError::ForeignOwner {
                path: path.to_owned(),
                owner: meta.uid(),
                uid,
            });
        }
        let mode = meta.mode() & 0o7777;
        let refused = match trust {
            Trust::Owner => 0o022,
            Trust::Group => 0o002,
        };
        if mode & refused != 0 {
            return Err(MachineError::OpenToOthers {
                path: path.to_owned(),
                mode,
                owner: meta.uid(),
            });
        }
        let len = meta.len();
        if len < HEADER as u64 {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!("{len} B long, shorter than the {HEADER} B header (truncated)"),
            });
        }
        let mut header = [0u8; HEADER];
        file.read_exact_at(&mut header, 0).map_err(io)?;
        let word =
            |off: usize| u64::from_le_bytes(header[off..off + 8].try_into().expect("8 bytes"));
        if word(H_STATE) != READY {
            // A segment is linked only once ready: this one was made by
            // something else (or a memgov that built it in place).
            return Err(MachineError::NeverReady {
                path: path.to_owned(),
            });
        }
        let magic = word(H_MAGIC);
        if magic != MAGIC {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!("magic {magic:#018x}, expected {MAGIC:#018x}"),
            });
        }
        let version = word(H_VERSION);
        if version != LAYOUT_VERSION {
            return Err(MachineError::LayoutVersion {
                path: path.to_owned(),
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        let slots = word(H_SLOTS);
        let slot_size = word(H_SLOT_SIZE);
        let mut kb = [0u8; KEY_BYTES];
        kb.copy_from_slice(&header[H_KEY..H_KEY + KEY_BYTES]);
        let sum = word(H_CHECKSUM);
        if sum != checksum(slots, &kb) || slot_size != SLOT as u64 {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!(
                    "header checksum {sum:#018x} does not match its geometry ({slots} slots of {slot_size} B)"
                ),
            });
        }
        if slots == 0 || slots as usize > MAX_SLOTS || size_for(slots as usize) as u64 != len {
            return Err(MachineError::Corrupt {
                path: path.to_owned(),
                what: format!("{len} B long for {slots} slots of {SLOT} B (truncated or extended)"),
            });
        }
        let found = String::from_utf8_lossy(&kb)
            .trim_end_matches('\0')
            .to_owned();
        if let Some(key) = key {
            if kb != key_bytes(key) {
                return Err(MachineError::WrongDevice {
                    path: path.to_owned(),
                    found,
                    expected: key.to_owned(),
                });
            }
        }
        let (dev, ino) = (meta.dev(), meta.ino());
        let seg = Self::map(file, path, found, len as usize, slots as usize)?;
        // Replaced since it was opened (removed and made anew): the mapping
        // is sound, but of a file nobody else will open. Open again.
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.dev() == dev && m.ino() == ino => Ok(Found::Segment(seg)),
            Ok(_) | Err(_) => Ok(Found::Nothing),
        }
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
        let guard = bus_guard::register(p.cast(), len);
        Ok(Self {
            base: p.cast(),
            len,
            slots,
            path: path.to_owned(),
            key,
            guard,
            _file: file,
        })
    }

    /// Whether the mapped file is still whole and still the one at the
    /// path: its size (`fstat`) the segment's, the path naming the same
    /// file, and no access to it having faulted (a file cut short under the
    /// mapping: the pages past its end were replaced by blank ones in this
    /// process, see `bus_guard`).
    pub(crate) fn verify(&self) -> Result<(), MachineError> {
        let corrupt = |what: String| {
            Err(MachineError::Corrupt {
                path: self.path.clone(),
                what,
            })
        };
        let meta = self._file.metadata().map_err(|e| MachineError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        if bus_guard::faulted(self.guard) {
            return corrupt(format!(
                "the file was cut short to {} B under this process's mapping of {} B; what this process sees of the ledger past that is its own blank copy",
                meta.len(),
                self.len
            ));
        }
        if meta.len() != self.len as u64 {
            return corrupt(format!(
                "the file is {} B long, the segment mapped {} B (truncated or extended under its processes)",
                meta.len(),
                self.len
            ));
        }
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if m.dev() == meta.dev() && m.ino() == meta.ino() => Ok(()),
            Ok(_) => corrupt("the path names another file than the one mapped (replaced: its processes and new ones are on different ledgers)".to_owned()),
            Err(e) => corrupt(format!("the path no longer names the file mapped ({e}): removed under its processes")),
        }
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
        self.set_slot_text(i, S_NAME, name);
    }

    /// Where slot `i`'s limit came from, if it was granted.
    pub(crate) fn slot_limit_from(&self, i: usize) -> Option<String> {
        let mut b = [0u8; NAME_BYTES];
        self.read_bytes(HEADER + i * SLOT + S_LIMIT_FROM, &mut b);
        let s = String::from_utf8_lossy(&b)
            .trim_end_matches('\0')
            .to_owned();
        (!s.is_empty()).then_some(s)
    }

    pub(crate) fn set_slot_limit_from(&self, i: usize, from: &str) {
        self.set_slot_text(i, S_LIMIT_FROM, from);
    }

    /// `text`, cut to `NAME_BYTES` on a character boundary and NUL-padded,
    /// at `off` in slot `i`.
    fn set_slot_text(&self, i: usize, off: usize, text: &str) {
        let mut b = [0u8; NAME_BYTES];
        let n = cut(text, NAME_BYTES);
        b[..n].copy_from_slice(&text.as_bytes()[..n]);
        self.write_bytes(HEADER + i * SLOT + off, &b);
    }

    /// Publish slot `i`'s top sites (site text, live bytes), largest first;
    /// the first [`SITE_ENTRIES`] are kept, the rest of the table emptied.
    /// One writer per slot at a time: its process's doorbell thread, or
    /// whoever claims or reclaims the slot.
    pub(crate) fn set_slot_sites(&self, i: usize, sites: &[(String, u64)]) {
        let seq = self.slot(i, S_SITES_SEQ);
        // Odd first, and no entry's store before it.
        seq.fetch_add(1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        for k in 0..SITE_ENTRIES {
            let off = HEADER + i * SLOT + S_SITES + k * SITE_ENTRY;
            let (text, live) = sites.get(k).map_or(("", 0), |(t, l)| (t.as_str(), *l));
            let mut b = [0u8; SITE_TEXT];
            let n = cut(text, SITE_TEXT);
            b[..n].copy_from_slice(&text.as_bytes()[..n]);
            self.write_bytes(off, &b);
            self.word(off + SITE_TEXT).store(live, Ordering::Relaxed);
        }
        // Even again, after every entry's store.
        seq.fetch_add(1, Ordering::Release);
    }

    /// Slot `i`'s top sites as its process last published them; empty when
    /// none were, or when a rewrite kept overlapping the read.
    pub(crate) fn slot_sites(&self, i: usize) -> Vec<(String, u64)> {
        let seq = self.slot(i, S_SITES_SEQ);
        for _ in 0..64 {
            let before = seq.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::thread::yield_now();
                continue;
            }
            let mut read = Vec::with_capacity(SITE_ENTRIES);
            for k in 0..SITE_ENTRIES {
                let off = HEADER + i * SLOT + S_SITES + k * SITE_ENTRY;
                let mut b = [0u8; SITE_TEXT];
                self.read_bytes(off, &mut b);
                read.push((b, self.word(off + SITE_TEXT).load(Ordering::Relaxed)));
            }
            std::sync::atomic::fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) != before {
                continue;
            }
            return read
                .into_iter()
                .map(|(b, live)| {
                    let text = String::from_utf8_lossy(&b)
                        .trim_end_matches('\0')
                        .to_owned();
                    (text, live)
                })
                .filter(|(text, _)| !text.is_empty())
                .collect();
        }
        Vec::new()
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends on a
/// character boundary.
fn cut(text: &str, max: usize) -> usize {
    let mut n = text.len().min(max);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    n
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Out of the guard's table first: the range may be mapped anew by
        // anything once unmapped.
        bus_guard::unregister(self.guard);
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

/// Bytes free to this user in the file system holding `file`.
fn free_bytes(file: &File) -> u64 {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero statvfs is a valid value of the plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatvfs on an open descriptor, into a valid out pointer.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) } != 0 {
        return 0;
    }
    (st.f_bavail as u64).saturating_mul(st.f_frsize as u64)
}

/// A file a segment is built in before it is linked at its path: unnamed
/// (`O_TMPFILE`, linked through `/proc/self/fd`), or, where the file
/// system or `/proc` lacks that, a hidden uniquely named file beside the
/// path (`.<name>.<pid>.<n>.building`), removed once linked or when
/// dropped. A creator killed while building leaves nothing at the path
/// (the unnamed file vanishes with it; a named one stays, under its own
/// name, never opened by anyone).
struct Private {
    file: File,
    named: Option<PathBuf>,
}

impl Private {
    fn new(dir: &Path, name: &std::ffi::OsStr) -> std::io::Result<Self> {
        if Path::new("/proc/self/fd").is_dir() {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .mode(0o600)
                .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
                .open(dir)
            {
                Ok(file) => return Ok(Self { file, named: None }),
                // No O_TMPFILE on this file system (or kernel): a name.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!(
                ".{}.{}.{n}.building",
                name.to_string_lossy(),
                std::process::id()
            ));
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)
            {
                Ok(file) => {
                    return Ok(Self {
                        file,
                        named: Some(tmp),
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1 << 20 => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Link the file at `path` unless something is there: `Ok(false)`
    /// then.
    fn link_at(&self, path: &Path) -> std::io::Result<bool> {
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        let from = match &self.named {
            Some(tmp) => tmp.clone(),
            None => PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd())),
        };
        let c = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes())
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
        };
        let (from, to) = (c(&from)?, c(path)?);
        // SAFETY: two valid NUL-terminated paths. linkat never replaces
        // what is at `to` (EEXIST); AT_SYMLINK_FOLLOW makes the
        // /proc/self/fd link name the unnamed file itself, as open(2)
        // documents for O_TMPFILE.
        let r = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                if self.named.is_some() {
                    0
                } else {
                    libc::AT_SYMLINK_FOLLOW
                },
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EEXIST) {
            Ok(false)
        } else {
            Err(e)
        }
    }
}

impl Drop for Private {
    fn drop(&mut self) {
        if let Some(tmp) = &self.named {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// No SIGBUS from a segment cut short under its mapping. A file truncated
/// while mapped makes every access past its new end fault with SIGBUS,
/// which kills the process; another process of the same user (or a
/// mistaken `truncate`) can do that to every member at once. This
/// process's handler (installed once, chaining to the one before it for
/// every fault outside a segment) replaces the faulting page of a segment
/// by a blank private page and marks the segment, so the access is retried
/// and the process lives; `Segment::verify` (`MachineLedger::verify`,
/// `memgov top`) then says the ledger is broken. Only ranges of live
/// segment mappings are in the table (taken out before they are unmapped).
mod bus_guard {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Once;

    const ENTRIES: usize = 64;
    /// Each entry's mapping: its base (0: free) and length.
    static BASE: [AtomicUsize; ENTRIES] = [const { AtomicUsize::new(0) }; ENTRIES];
    static LEN: [AtomicUsize; ENTRIES] = [const { AtomicUsize::new(0) }; ENTRIES];
    static FAULTED: [AtomicBool; ENTRIES] = [const { AtomicBool::new(false) }; ENTRIES];
    static PAGE: AtomicUsize = AtomicUsize::new(4096);
    /// The SIGBUS action before this one, for the handler: a leaked box,
    /// set once before the handler is installed, never freed.
    static CHAIN: AtomicUsize = AtomicUsize::new(0);

    fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if page > 0 {
                PAGE.store(page as usize, Ordering::Relaxed);
            }
            // SAFETY: an all-zero sigaction is a valid value; the first
            // call only reads the current action into `prev`; the second
            // installs `handler`, an `extern "C" fn(c_int, *mut siginfo_t,
            // *mut c_void)` as SA_SIGINFO requires, which does only
            // async-signal-safe work (atomic loads and stores, mmap,
            // sigaction, the previous handler).
            unsafe {
                let mut prev: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut prev);
                CHAIN.store(Box::into_raw(Box::new(prev)) as usize, Ordering::Release);
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = handler as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
                libc::sigemptyset(&mut act.sa_mask);
                libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut());
            }
        });
    }

    /// Guard `len` bytes at `base`; the entry's index (`usize::MAX`: the
    /// table is full, the mapping is not guarded).
    pub(super) fn register(base: *mut u8, len: usize) -> usize {
        install();
        for i in 0..ENTRIES {
            if BASE[i]
                .compare_exchange(0, base as usize, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                FAULTED[i].store(false, Ordering::Relaxed);
                LEN[i].store(len, Ordering::Release);
                return i;
            }
        }
        usize::MAX
    }

    pub(super) fn unregister(i: usize) {
        if i < ENTRIES {
            LEN[i].store(0, Ordering::Release);
            BASE[i].store(0, Ordering::Release);
        }
    }

    pub(super) fn faulted(i: usize) -> bool {
        i < ENTRIES && FAULTED[i].load(Ordering::Acquire)
    }

    extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO.
        let addr = unsafe { (*info).si_addr() } as usize;
        let page = PAGE.load(Ordering::Relaxed);
        for i in 0..ENTRIES {
            let base = BASE[i].load(Ordering::Acquire);
            let len = LEN[i].load(Ordering::Acquire);
            if base == 0 || addr < base || addr >= base + len {
                continue;
            }
            let at = addr & !(page - 1);
            // SAFETY: replaces one page inside a live segment mapping of
            // this process (the table holds only those) with a blank
            // private one; mmap is async-signal-safe in practice (a system
            // call), and nothing else of the process is touched.
            let r = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if r != libc::MAP_FAILED {
                FAULTED[i].store(true, Ordering::Release);
                return;
            }
        }
        // Not a segment's: whatever handled SIGBUS before.
        let prev = CHAIN.load(Ordering::Acquire) as *const libc::sigaction;
        // SAFETY: set once, before this handler was installed, to a leaked
        // box that is never freed.
        let prev = unsafe { &*prev };
        let h = prev.sa_sigaction;
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            // The default action: restored, and the faulting access, run
            // again on return, kills the process as it would have.
            // SAFETY: an all-zero sigaction with SIG_DFL (0) is the default
            // action; sigaction is async-signal-safe.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
            // SAFETY: the previous handler was installed with SA_SIGINFO,
            // so it has this signature; it is called as the kernel would.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
        } else {
            // SAFETY: a handler installed without SA_SIGINFO takes the
            // signal number alone.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
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
