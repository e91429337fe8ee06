//! The machine level of the budget tree: one ledger per physical device,
//! shared by every process that governs it, in a shared-memory file.
//!
//! ```text
//! machine ledger "gpu-8f3c..."           MachineLedger::open (/dev/shm/memgov-<key>)
//! ├── process "trainer"  (slot 0)        ledger.join(JoinOptions) -> MachineMember
//! │   └── ProcessBudget "trainer"        ProcessBudget::with_machine(label, limit, member)
//! │       └── SharedBudget "gpu0" ...    the tree below, as in one process
//! └── process "eval"     (slot 1)
//! ```
//!
//! Every allocation of a context under such a process budget is charged to
//! the machine ledger too (through the process's lease: see `member.rs`),
//! all levels or none, so no two processes can together be admitted more
//! than the ledger's limit. A refusal there is
//! [`BudgetScope::Machine`](crate::BudgetScope::Machine) and carries a
//! [`MachineRefusal`] with every process's figures. See
//! `docs/sharing-a-gpu.md` for what this guarantees and what it cannot.
//!
//! The protocol (crash-safe, lock-free) is in `ledger.rs`, the segment's
//! layout in `segment.rs`.

mod ledger;
mod management;
mod member;
mod segment;

pub use ledger::{Reclaimed, MAX_TOTAL_BYTES};
pub use management::{device_processes, DeviceProcess, DeviceProcesses, ManagementError};
pub use segment::{LAYOUT_VERSION, MAX_SLOTS, SITE_ENTRIES, SITE_TEXT, UNIT};

use crate::Bytes;
use crate::{DeviceIdentity, MemoryInfo};
use segment::{
    Segment, H_DEV_AT, H_DEV_FREE, H_DEV_TOTAL, H_LIMIT, H_OUTSIDE, H_OUTSIDE_PROCS, H_RECLAIMS,
    S_ANSWERED, S_CACHED, S_CONTEXTS, S_FLOOR, S_GAVE, S_LIMIT, S_PRIORITY, S_RING, S_STATE,
    S_USED, S_W,
};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use member::Host;
/// The operations the budget tree calls on a membership.
pub(crate) type MemberOps = member::Inner;

/// What went wrong opening, joining or checking a machine ledger. Nothing
/// in the segment is changed by an operation that returns one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MachineError {
    /// The file could not be created, opened, sized or mapped.
    #[error("machine ledger {}: {source}; check the directory exists and is writable, or give another path (LedgerOptions::path)", path.display())]
    Io {
        /// The segment's path.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The OS refused access to the file.
    #[error("machine ledger {}: permission denied (owner uid {}, this process uid {uid}): {source}; run as the segment's owner, or give this process its own path (LedgerOptions::path)", path.display(), owner.map_or_else(|| "unknown".to_owned(), |o| o.to_string()))]
    Permission {
        /// The segment's path.
        path: PathBuf,
        /// Its owner, when it could be read.
        owner: Option<u32>,
        /// This process's effective uid.
        uid: u32,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The segment belongs to another user: its processes' charges cannot
    /// be trusted, nor can ours be protected from them.
    #[error("machine ledger {}: owned by uid {owner}, this process runs as uid {uid}; processes of different users do not share a ledger: run as uid {owner}, or give this process its own path (LedgerOptions::path)", path.display())]
    ForeignOwner {
        /// The segment's path.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// The segment was written by a memgov with another layout.
    #[error("machine ledger {}: layout version {found}, this memgov reads version {expected}; stop the processes using it (memgov top --path shows them) and remove it (MachineLedger::reset, memgov top --reset), or give this process another path", path.display())]
    LayoutVersion {
        /// The segment's path.
        path: PathBuf,
        /// The version it holds.
        found: u64,
        /// The version this build reads.
        expected: u64,
    },
    /// The header does not hold together.
    #[error("machine ledger {}: corrupt ({what}); nothing was changed; remove it with MachineLedger::reset (memgov top --reset) once no process uses it", path.display())]
    Corrupt {
        /// The segment's path.
        path: PathBuf,
        /// What does not match.
        what: String,
    },
    /// The segment at this path is another device's.
    #[error("machine ledger {}: belongs to device '{found}', not '{expected}'; give each device its own path", path.display())]
    WrongDevice {
        /// The segment's path.
        path: PathBuf,
        /// The device key it holds.
        found: String,
        /// The key asked for.
        expected: String,
    },
    /// Its header is not marked ready. memgov links a segment at its path
    /// only once it is ready, so this file was made otherwise (by hand, or
    /// by a memgov that built segments in place).
    #[error("machine ledger {}: not marked ready (it was not made whole by memgov: a file made by hand, or a creator of an older memgov that stopped while setting it up); remove it with MachineLedger::reset (memgov top --reset)", path.display())]
    NeverReady {
        /// The segment's path.
        path: PathBuf,
    },
    /// The file system holding the segment has no room for it.
    #[error("machine ledger {}: the segment needs {} and {} has {} free; give the directory more room (a container's /dev/shm: docker run --shm-size=256m, or a Kubernetes emptyDir with medium: Memory mounted at /dev/shm; data-loader workers may be filling it), or put the ledger in another directory (LedgerOptions::path) that every process sharing the device can reach", path.display(), Bytes(*needed), dir.display(), Bytes(*free))]
    NoSpace {
        /// The segment's path.
        path: PathBuf,
        /// Bytes the segment needs.
        needed: u64,
        /// The directory it was to be made in.
        dir: PathBuf,
        /// Bytes free there.
        free: u64,
    },
    /// Something other than a regular file is at the segment's path.
    #[error("machine ledger {}: {found} is there, not a segment file (memgov opens no symbolic link and nothing but a regular file); remove it if it is not yours to keep, or give this process another path (LedgerOptions::path)", path.display())]
    NotRegular {
        /// The segment's path.
        path: PathBuf,
        /// What is there.
        found: String,
    },
    /// The segment can be written by users other than its owner, and no
    /// shared mode was asked for.
    #[error("machine ledger {}: mode {mode:04o} (owner uid {owner}) lets {} write it; a ledger others can write is refused unless shared is asked for (LedgerOptions::shared, memgov top --shared: group write; write by every user is never accepted): remove it (memgov top --reset --force once no process uses it), or give this process its own path (LedgerOptions::path)", path.display(), if mode & 0o002 != 0 { "every user" } else { "its group" })]
    OpenToOthers {
        /// The segment's path.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner.
        owner: u32,
    },
    /// [`MachineLedger::reset`] refused: processes still use the ledger.
    #[error("machine ledger {}: not removed, {} live process(es) use it: {}; stop them first (they would keep the old ledger while new processes make another, and the device would be promised twice), or, when they are gone but the ledger cannot tell (another pid namespace, a dead machine), remove it anyway (MachineLedger::force_reset, memgov top --reset --force)", path.display(), holders.len(), holders.iter().map(|h| format!("'{}' (pid {})", h.name, h.pid)).collect::<Vec<_>>().join(", "))]
    InUse {
        /// The segment's path.
        path: PathBuf,
        /// The live processes on it.
        holders: Vec<Holder>,
    },
    /// The device key is empty or longer than 64 bytes.
    #[error("machine ledger key '{key}' must be 1 to 64 bytes")]
    BadKey {
        /// The key given.
        key: String,
    },
    /// The slot count is 0 or above [`MAX_SLOTS`].
    #[error("machine ledger: {slots} slots asked for; 1 to {MAX_SLOTS} are possible")]
    BadSlots {
        /// The count given.
        slots: usize,
    },
    /// The limit asked for is above what the ledger's total can count
    /// ([`MAX_TOTAL_BYTES`]).
    #[error("machine ledger '{key}': a limit of {} ({limit} bytes) asked for; the ledger counts at most {} ({max} bytes, 2^32 - 1 units of {UNIT} bytes); give a limit no larger", Bytes(*limit), Bytes(*max))]
    BadLimit {
        /// The device key.
        key: String,
        /// The limit given, in bytes.
        limit: u64,
        /// The most a ledger can promise, in bytes ([`MAX_TOTAL_BYTES`]).
        max: u64,
    },
    /// Every slot is held by a live process.
    #[error("machine ledger {}: all {slots} process slots are taken by live processes; create the ledger with more (LedgerOptions::slots) or stop a process", path.display())]
    Full {
        /// The segment's path.
        path: PathBuf,
        /// Its slot count.
        slots: usize,
    },
    /// A process asked for a limit or floor the device cannot hold.
    #[error("machine ledger '{ledger}': process '{name}' asks for {what} {}, above the ledger's limit {}; lower it", Bytes(*asked), Bytes(*limit))]
    AboveDevice {
        /// The ledger's key.
        ledger: String,
        /// The process's name.
        name: String,
        /// "a limit" or "a floor".
        what: &'static str,
        /// What it asked for.
        asked: u64,
        /// The ledger's limit.
        limit: u64,
    },
    /// The limit the cluster granted the process does not read: a variable
    /// of [`crate::granted`]'s family is set to a value that is no limit,
    /// or grants limits per device and the join named none.
    #[error("machine ledger '{ledger}': process '{name}' not joined: {source}")]
    Granted {
        /// The ledger's key.
        ledger: String,
        /// The process's name.
        name: String,
        /// What is wrong with the variable (it names it).
        source: Box<crate::granted::GrantedLimitError>,
    },
    /// The floors of the processes on the ledger would exceed its limit.
    #[error("machine ledger '{ledger}': a floor of {} for '{name}' with {} guaranteed to others exceeds the limit {}; lower a floor or raise the limit", Bytes(*asked), Bytes(*others), Bytes(*limit))]
    Floors {
        /// The ledger's key.
        ledger: String,
        /// The process's name.
        name: String,
        /// The floor asked for.
        asked: u64,
        /// The floors already guaranteed.
        others: u64,
        /// The ledger's limit.
        limit: u64,
    },
    /// [`MachineLedger::check`] found the ledger inconsistent.
    #[error("machine ledger '{ledger}': {what}; MachineLedger::repair rebuilds the total from the slots")]
    Inconsistent {
        /// The ledger's key.
        ledger: String,
        /// What does not add up.
        what: String,
    },
    /// [`MachineLedger::check`] could not judge: the ledger changed during
    /// every one of its reads.
    #[error("machine ledger '{ledger}': changed during each of {tries} reads, so whether it adds up cannot be judged now (a busy ledger, not an inconsistent one); check again, or when fewer processes charge")]
    Unsettled {
        /// The ledger's key.
        ledger: String,
        /// The reads tried.
        tries: u32,
    },
    /// The membership no longer holds its slot: it left, this process is
    /// a forked child of the one that joined, or the slot was taken from
    /// it. Nothing was charged or given back.
    #[error("machine ledger '{ledger}': '{name}' no longer holds its slot: {why}; join the ledger again (MachineLedger::join)")]
    SlotLost {
        /// The ledger's key.
        ledger: String,
        /// The membership's name.
        name: String,
        /// What happened to the slot.
        why: String,
    },
    /// [`MachineMember::uncharge`] was asked to give back more than
    /// [`MachineMember::charge`] took.
    #[error("machine ledger '{ledger}': '{name}' asked to give back {} but holds {} charged through MachineMember::charge; give back only what charge took", Bytes(*asked), Bytes(*held))]
    Overdrawn {
        /// The ledger's key.
        ledger: String,
        /// The membership's name.
        name: String,
        /// Bytes asked to give back.
        asked: u64,
        /// Bytes charged through `charge` and not given back.
        held: u64,
    },
}

/// How to open a machine ledger.
#[derive(Debug, Clone)]
pub struct LedgerOptions {
    key: String,
    path: Option<PathBuf>,
    limit: u64,
    slots: usize,
    mode: Option<u32>,
    shared: bool,
}

impl LedgerOptions {
    /// The ledger of the device `key` (a CUDA device UUID, a PCI bus id, a
    /// name for the host backend), promising at most `limit` bytes when
    /// this process creates it (an existing ledger keeps its own). A limit
    /// above [`MAX_TOTAL_BYTES`] (16 TiB) is refused when the ledger is
    /// opened ([`MachineError::BadLimit`]).
    pub fn new(key: impl Into<String>, limit: u64) -> Self {
        Self {
            key: key.into(),
            path: None,
            limit,
            slots: 64,
            mode: None,
            shared: false,
        }
    }

    /// The ledger of the physical device `identity` names (its
    /// [`key`](DeviceIdentity::key): the UUID, else the PCI address), which
    /// every process on the machine that opens that device agrees on,
    /// whatever its `CUDA_VISIBLE_DEVICES` or API. Take it from the context:
    /// [`DeviceContext::identity`](crate::DeviceContext::identity).
    ///
    /// ```no_run
    /// # #[cfg(feature = "cuda")] fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use memgov::cuda::{CudaConfig, CudaContext};
    /// use memgov::machine::{LedgerOptions, MachineLedger};
    /// use memgov::DeviceContext;
    ///
    /// let ctx = CudaContext::new(CudaConfig::default())?;
    /// let ledger = MachineLedger::open(&LedgerOptions::for_device(&ctx.identity(), 60 << 30))?;
    /// assert!(ledger.key().starts_with("gpu-"));
    /// # Ok(()) }
    /// # #[cfg(not(feature = "cuda"))] fn main() {}
    /// ```
    pub fn for_device(identity: &DeviceIdentity, limit: u64) -> Self {
        Self::new(identity.key(), limit)
    }

    /// The segment's file (default: [`default_path`]).
    pub fn path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// Process slots, when this process creates it (default 64, at most
    /// [`MAX_SLOTS`]).
    pub fn slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }

    /// Permission bits of a segment this process creates (default 0600:
    /// the owner alone; 0660 when [`shared`](Self::shared)), applied
    /// whatever the umask.
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = Some(mode);
        self
    }

    /// Share the ledger with the other users of a group: a segment this
    /// process creates is made group-writable (0660, unless
    /// [`mode`](Self::mode) says otherwise; give the file the group with
    /// `chgrp`, or create it in a setgid directory), and an existing one is
    /// accepted whoever owns it and with group write. Without this, a
    /// segment owned by another user ([`MachineError::ForeignOwner`]) or
    /// writable by its group or others ([`MachineError::OpenToOthers`]) is
    /// refused. A segment writable by every user is refused either way.
    /// Every process that can write the segment can change every number in
    /// it: what it is admitted, others' charges, limits and floors, and it
    /// can ring anyone's doorbell; share only with users you would let stop
    /// your processes' allocations (`docs/sharing-a-gpu.md`, "Trust").
    pub fn shared(mut self) -> Self {
        self.shared = true;
        self
    }
}

/// How a process joins a ledger.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    name: String,
    pub(crate) limit: u64,
    pub(crate) floor: u64,
    pub(crate) priority: u32,
    pub(crate) lease_chunk: u64,
    pub(crate) answer_timeout: Duration,
    pub(crate) watch: Option<DeviceIdentity>,
    pub(crate) limit_from: Option<String>,
    /// Read the cluster's grant at join (`None`: ignore it), for this
    /// device ordinal (`None`: not given) and total.
    granted_env: Option<(Option<u32>, Option<u64>)>,
}

impl JoinOptions {
    /// Join as `name` (shown by `memgov top` and in refusals), with no
    /// limit of its own, no floor, priority 100, leases of 8 MiB and 250 ms
    /// to answer a trim request, and the limit the cluster granted the
    /// process read from its environment at [`join`](MachineLedger::join)
    /// ([`crate::granted`]: HAMi's `CUDA_DEVICE_MEMORY_LIMIT[_<i>]`, MPS's
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, `MEMGOV_DEVICE_LIMIT`).
    ///
    /// The grant is read for the device given with
    /// [`device`](Self::device); without it only a limit for every device
    /// counts, and a variable that grants limits per device fails the join
    /// ([`GrantedLimitError::DeviceNotGiven`](crate::granted::GrantedLimitError::DeviceNotGiven)).
    /// A grant found is taken as by [`granted`](Self::granted): the smaller
    /// of it and the limit given wins, it is capped to the ledger's limit,
    /// and the slot names its variable. A variable that does not read fails
    /// the join ([`MachineError::Granted`], naming the variable); nothing
    /// falls back to a default. [`ignore_granted_env`](Self::ignore_granted_env)
    /// turns the reading off.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            limit: u64::MAX,
            floor: 0,
            priority: 100,
            lease_chunk: 8 << 20,
            answer_timeout: Duration::from_millis(250),
            watch: None,
            limit_from: None,
            granted_env: Some((None, None)),
        }
    }

    /// The CUDA ordinal of the device this ledger is for, as this process
    /// opens it (after `CUDA_VISIBLE_DEVICES`): the grant read at join is
    /// this device's (`CUDA_DEVICE_MEMORY_LIMIT_<ordinal>`, the MPS and
    /// `MEMGOV_DEVICE_LIMIT` lists' entry for it).
    pub fn device(mut self, ordinal: u32) -> Self {
        if let Some((device, _)) = self.granted_env.as_mut() {
            *device = Some(ordinal);
        }
        self
    }

    /// The device's total memory, when known: a grant above it fails the
    /// join ([`GrantedLimitError::AboveDevice`](crate::granted::GrantedLimitError::AboveDevice)).
    pub fn device_total(mut self, bytes: u64) -> Self {
        if let Some((_, total)) = self.granted_env.as_mut() {
            *total = Some(bytes);
        }
        self
    }

    /// Do not read the cluster's grant from the environment at join: the
    /// limit is what [`limit`](Self::limit) and [`granted`](Self::granted)
    /// give, nothing else.
    pub fn ignore_granted_env(mut self) -> Self {
        self.granted_env = None;
        self
    }

    /// Read the grant from the environment, as [`new`](Self::new) says,
    /// and take it.
    fn take_granted_env(&mut self) -> Result<(), crate::granted::GrantedLimitError> {
        if let Some((device, total)) = self.granted_env {
            if let Some(grant) = crate::granted::read_grant(device, total)? {
                self.take_grant(&grant);
            }
        }
        Ok(())
    }

    /// Ask the vendor's management library (NVML), about every two
    /// seconds from the doorbell thread, which processes use the device
    /// `identity` names, and keep what those without a slot on the ledger
    /// use from what it admits ([`MachineLedger::observe_processes`]).
    /// Without the library this does nothing (the driver's free/total is
    /// still observed on a refusal). Processes are matched by pid in the
    /// library's pid namespace: in a container whose pids are not the
    /// host's, memgov processes would be counted as outside, so leave this
    /// off there.
    pub fn watch_device(mut self, identity: DeviceIdentity) -> Self {
        self.watch = Some(identity);
        self
    }

    /// The most this process may hold on the ledger. It replaces a limit
    /// taken from [`granted`](Self::granted) before it, which is then no
    /// longer named.
    pub fn limit(mut self, bytes: u64) -> Self {
        self.limit = bytes;
        self.limit_from = None;
        self
    }

    /// Take the limit the cluster granted this process
    /// ([`granted_limit_from_env`](crate::granted::granted_limit_from_env))
    /// as its limit on the ledger, when it is below the limit given so
    /// far: the slot records the variable it came from, which snapshots,
    /// `memgov top` and refusals show. A grant above the ledger's own
    /// limit is capped to it at [`join`](MachineLedger::join) (where a
    /// plain [`limit`](Self::limit) above it is an error), and the slot says
    /// so. Give the membership to
    /// [`ProcessBudget::with_machine`](crate::ProcessBudget::with_machine),
    /// whose process level then takes the same limit.
    pub fn granted(mut self, granted: &crate::granted::GrantedLimit) -> Self {
        self.take_grant(granted);
        self
    }

    /// The grant becomes the limit when it is the smaller, and the limit
    /// then names its variable.
    fn take_grant(&mut self, granted: &crate::granted::GrantedLimit) {
        if granted.bytes <= self.limit {
            self.limit = granted.bytes;
            self.limit_from = Some(granted.variable.clone());
        }
    }

    /// Bytes guaranteed to this process: others are not admitted into
    /// them, and it is not asked to trim below them.
    pub fn floor(mut self, bytes: u64) -> Self {
        self.floor = bytes;
        self
    }

    /// A process with a lower priority is asked to trim for one with a
    /// higher priority (down to its floor).
    pub fn priority(mut self, priority: u32) -> Self {
        self.priority = priority;
        self
    }

    /// Bytes charged ahead on the ledger at a time (0: every allocation
    /// touches the segment).
    pub fn lease_chunk(mut self, bytes: u64) -> Self {
        self.lease_chunk = bytes;
        self
    }

    /// How long a process asking for room waits for the processes it asked
    /// to answer, at most (a `WaitForPending` admission waits up to its own
    /// timeout instead).
    pub fn answer_timeout(mut self, timeout: Duration) -> Self {
        self.answer_timeout = timeout;
        self
    }
}

/// An open machine ledger: the segment mapped into this process.
#[derive(Clone)]
pub struct MachineLedger {
    seg: Arc<Segment>,
}

impl fmt::Debug for MachineLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MachineLedger")
            .field("key", &self.key())
            .field("path", &self.path())
            .field("limit", &self.limit())
            .field("charged", &self.charged())
            .finish()
    }
}

/// The default segment of device `key`: `/dev/shm/memgov-<key>`, every
/// character of the key other than letters, digits, `-`, `_` and `.`
/// written as `_`.
///
/// The name is predictable (that is how the processes of a machine find
/// one another), so any local user can make a file there first. What is
/// found there is opened only if it is a regular file (no symbolic link is
/// followed), owned by this user and writable by nobody else (unless
/// [`LedgerOptions::shared`]); otherwise opening fails and says so, and
/// nothing is written to it. A user who does not want to depend on that
/// gives a private path, the same in every process, in a directory others
/// cannot enter: e.g. `$XDG_RUNTIME_DIR/memgov-<key>` (`/run/user/<uid>`, a
/// per-user tmpfs of mode 0700) through [`LedgerOptions::path`].
pub fn default_path(key: &str) -> PathBuf {
    let clean: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    PathBuf::from(format!("/dev/shm/memgov-{clean}"))
}

impl MachineLedger {
    /// Open the ledger `opts` names, creating it if there is none. An
    /// existing one is checked (magic, layout version, header checksum,
    /// geometry, device key, owner) before anything is written to it.
    pub fn open(opts: &LedgerOptions) -> Result<Self, MachineError> {
        let path = opts.path.clone().unwrap_or_else(|| default_path(&opts.key));
        let (trust, mode) = if opts.shared {
            (segment::Trust::Group, opts.mode.unwrap_or(0o660))
        } else {
            (segment::Trust::Owner, opts.mode.unwrap_or(0o600))
        };
        let seg =
            Segment::open_or_create_with(&path, &opts.key, opts.slots, opts.limit, mode, trust)?;
        let ledger = Self { seg: Arc::new(seg) };
        ledger.sweep();
        Ok(ledger)
    }

    /// Open the ledger at `path` if there is one, whatever its device, and
    /// create nothing (what `memgov top` does). Checked as
    /// [`open`](Self::open) checks; sweeps nothing.
    pub fn open_existing(path: &Path) -> Result<Self, MachineError> {
        Ok(Self {
            seg: Arc::new(Segment::attach(path, None, segment::Trust::Owner)?),
        })
    }

    /// [`open_existing`](Self::open_existing) for a ledger shared with a
    /// group ([`LedgerOptions::shared`]).
    pub fn open_existing_shared(path: &Path) -> Result<Self, MachineError> {
        Ok(Self {
            seg: Arc::new(Segment::attach(path, None, segment::Trust::Group)?),
        })
    }

    /// Whether the segment's file is still whole and still the one at its
    /// path: cut short or extended under its processes, removed or
    /// replaced, it is a [`MachineError::Corrupt`] naming what happened. A
    /// file cut short never kills this process with SIGBUS: the pages past
    /// its end are replaced by blank ones in this process, and this says so.
    pub fn verify(&self) -> Result<(), MachineError> {
        self.seg.verify()
    }

    /// Remove the segment at `path`: for a corrupt segment, or one of
    /// another layout. Refused ([`MachineError::InUse`], naming them) while
    /// the ledger has live processes that are alive; a segment that cannot
    /// be read (corrupt, another layout, another owner's) is removed, since
    /// nobody can join it. Processes still attached keep the old one
    /// mapped (their charges there are lost to the new one).
    pub fn reset(path: &Path) -> Result<(), MachineError> {
        if let Ok(ledger) = Self::open_existing_shared(path) {
            let holders: Vec<Holder> = ledger
                .snapshot()
                .processes
                .iter()
                .filter(|p| p.alive)
                .map(Holder::from)
                .collect();
            if !holders.is_empty() {
                return Err(MachineError::InUse {
                    path: path.to_owned(),
                    holders,
                });
            }
        }
        Self::force_reset(path)
    }

    /// Remove the segment at `path` whoever uses it: for a machine whose
    /// processes are gone but the ledger cannot tell (they ran in another
    /// pid namespace, or the ledger outlived them on a tmpfs that was not
    /// cleared). A process still using it keeps its mapping, and new
    /// processes make another ledger beside it: the device is then promised
    /// twice.
    pub fn force_reset(path: &Path) -> Result<(), MachineError> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(MachineError::Io {
                path: path.to_owned(),
                source: e,
            }),
        }
    }

    /// The device key.
    pub fn key(&self) -> &str {
        self.seg.key()
    }

    /// The segment's file.
    pub fn path(&self) -> &Path {
        self.seg.path()
    }

    /// The most the ledger promises, in bytes.
    pub fn limit(&self) -> u64 {
        ledger::limit(&self.seg)
    }

    /// Change the limit (every process sees it at its next refill). A
    /// limit above [`MAX_TOTAL_BYTES`], which the total cannot count, is
    /// stored as [`MAX_TOTAL_BYTES`].
    pub fn set_limit(&self, bytes: u64) {
        self.seg
            .word(H_LIMIT)
            .store(bytes.min(MAX_TOTAL_BYTES), Relaxed);
    }

    /// Bytes charged on the ledger by every process (idle leases included).
    pub fn charged(&self) -> u64 {
        ledger::total_units(&self.seg) * UNIT
    }

    /// Bytes the device uses that no process charged here, as last
    /// observed ([`observe_device`](Self::observe_device)).
    pub fn outside(&self) -> u64 {
        ledger::outside_bytes(&self.seg)
    }

    /// Record what the driver says of the device now (its
    /// `memory_info`): what it uses beyond what memgov processes have
    /// charged here is *outside*, shown in snapshots and kept from what the
    /// ledger admits. An admission refused on the ledger observes the
    /// device through its own context first, when that context's backend
    /// drives real hardware (an embedded device or a stand-in driver is the
    /// process's own, not the machine's).
    pub fn observe_device(&self, info: MemoryInfo) {
        observe(&self.seg, info);
    }

    /// Reclaim the slots of processes that died, returning their bytes.
    pub fn sweep(&self) -> Vec<Reclaimed> {
        ledger::sweep(&self.seg)
    }

    /// Check the ledger adds up: the total is the sum of the slots' shares,
    /// no process holds more than the limit, and no impossible change was
    /// refused or found (an audit finding). Judged on a consistent
    /// snapshot (the pending operation applied first, the rows read against
    /// one unchanged total); when the ledger changed during every read, it
    /// says it cannot judge ([`MachineError::Unsettled`]) rather than
    /// calling a busy ledger inconsistent.
    pub fn check(&self) -> Result<(), MachineError> {
        let snap = self.snapshot();
        if !snap.consistent {
            return Err(MachineError::Unsettled {
                ledger: self.key().to_owned(),
                tries: SNAPSHOT_TRIES,
            });
        }
        let sum: u128 = snap.processes.iter().map(|p| u128::from(p.charged)).sum();
        let bad = |what: String| {
            Err(MachineError::Inconsistent {
                ledger: self.key().to_owned(),
                what,
            })
        };
        if sum != u128::from(snap.charged) {
            return bad(format!(
                "the total is {} and the slots hold {}",
                snap.charged, sum
            ));
        }
        if let Some(p) = snap.processes.iter().find(|p| p.charged > snap.limit) {
            return bad(format!(
                "'{}' (pid {}) holds {}, above the limit {}",
                p.name,
                p.pid,
                Bytes(p.charged),
                Bytes(snap.limit)
            ));
        }
        if snap.audit > 0 {
            return bad(format!(
                "{} impossible change(s) refused or found (a give-back beyond a slot's share or the total: a segment written by something other than memgov)",
                snap.audit
            ));
        }
        Ok(())
    }

    /// Rebuild the total from the slots (after [`check`](Self::check) found
    /// them apart: a segment written by something that is not memgov).
    /// Returns the total before and after, in bytes.
    pub fn repair(&self) -> (u64, u64) {
        let (b, a) = ledger::repair(&self.seg);
        self.seg.word(segment::H_AUDIT).store(0, Relaxed);
        (b * UNIT, a * UNIT)
    }

    /// Join the ledger as this process: a slot of its own and a doorbell
    /// thread that answers other processes' trim requests. Dead processes'
    /// slots are reclaimed first.
    pub fn join(&self, mut opts: JoinOptions) -> Result<MachineMember, MachineError> {
        opts.take_granted_env()
            .map_err(|source| MachineError::Granted {
                ledger: self.key().to_owned(),
                name: opts.name.clone(),
                source: Box::new(source),
            })?;
        let limit = self.limit();
        if opts.limit > limit {
            if let Some(from) = opts.limit_from.as_mut() {
                // A granted limit is never above what the ledger allows.
                opts.limit = limit;
                from.push_str(", capped to the ledger");
            }
        }
        if opts.limit != u64::MAX && opts.limit > limit {
            return Err(MachineError::AboveDevice {
                ledger: self.key().to_owned(),
                name: opts.name,
                what: "a limit",
                asked: opts.limit,
                limit,
            });
        }
        if opts.floor > limit {
            return Err(MachineError::AboveDevice {
                ledger: self.key().to_owned(),
                name: opts.name,
                what: "a floor",
                asked: opts.floor,
                limit,
            });
        }
        self.sweep();
        let pid = std::process::id();
        let start = ledger::proc_stat(pid).map_or(0, |(_, s)| s);
        // The slot's lock first, then a compare-and-swap from free: held
        // from here for the membership's life (dropped, with the slot,
        // on every error below).
        let (slot, epoch, lock) =
            ledger::claim_slot(&self.seg, pid, start).ok_or_else(|| MachineError::Full {
                path: self.path().to_owned(),
                slots: self.seg.slots(),
            })?;
        let seg = &self.seg;
        for off in [S_USED, S_CACHED, S_CONTEXTS, S_GAVE] {
            seg.slot(slot, off).store(0, Relaxed);
        }
        seg.slot(slot, segment::S_ASK).store(0, Relaxed);
        seg.slot(slot, S_ANSWERED)
            .store(u64::from(seg.slot32(slot, S_RING).load(Acquire)), Release);
        seg.set_slot_name(slot, &opts.name);
        seg.set_slot_limit_from(slot, opts.limit_from.as_deref().unwrap_or(""));
        seg.set_slot_sites(slot, &[]);
        let inner = Arc::new(member::Inner::new(
            Arc::clone(seg),
            slot,
            epoch,
            opts.name.clone(),
            &opts,
            lock,
        ));
        inner.set_limit_word();
        // Floors of claiming slots count as live ones: two processes joining
        // at once each publish their floor (above, sequentially consistent)
        // before reading the others', so at least one sees the other's.
        let claiming = ledger::st_pack(ledger::Kind::Claiming, epoch, pid);
        let give_back = |inner: &member::Inner| {
            ledger::reclaim(seg, slot, claiming, pid, false);
            inner.abandon();
        };
        let others = floors_of_others(seg, slot);
        if opts.floor > 0 && others.saturating_add(opts.floor) > limit {
            give_back(&inner);
            return Err(MachineError::Floors {
                ledger: self.key().to_owned(),
                name: opts.name,
                asked: opts.floor,
                others,
                limit,
            });
        }
        let live = ledger::st_pack(ledger::Kind::Live, epoch, pid);
        if let Err(found) = seg
            .slot(slot, S_STATE)
            .compare_exchange(claiming, live, SeqCst, SeqCst)
        {
            inner.abandon();
            return Err(MachineError::SlotLost {
                ledger: self.key().to_owned(),
                name: opts.name,
                why: member::Lost::Taken { found }.describe(slot, epoch),
            });
        }
        inner.start();
        Ok(MachineMember(Arc::new(MemberHandle(inner))))
    }

    /// Every process on the ledger now, and the ledger's totals.
    pub fn snapshot(&self) -> MachineSnapshot {
        snapshot_of(&self.seg)
    }

    /// Record what the management library says of the device's processes
    /// ([`device_processes`]): the bytes of those that have no live slot
    /// here are outside memgov, kept from what the ledger admits (the
    /// larger of this and the driver's view counts) and shown in
    /// snapshots. Returns those processes. A process whose figure the
    /// library cannot give counts 0 bytes here and is still returned.
    pub fn observe_processes(&self, found: &DeviceProcesses) -> Vec<DeviceProcess> {
        observe_processes(&self.seg, found)
    }
}

/// The floors of the slots other than `slot` that are live or being
/// claimed, in bytes. Each floor is read before its slot's state: a floor
/// is published after its slot is claimed, so a floor seen belongs to a
/// slot whose state is read as claiming or later.
fn floors_of_others(seg: &Segment, slot: usize) -> u64 {
    (0..seg.slots())
        .filter(|&i| i != slot)
        .map(|i| {
            (
                seg.slot(i, S_FLOOR).load(SeqCst),
                seg.slot(i, S_STATE).load(SeqCst),
            )
        })
        .filter(|&(_, s)| {
            matches!(
                ledger::st_kind(s),
                ledger::Kind::Live | ledger::Kind::Claiming
            )
        })
        .map(|(f, _)| f)
        .fold(0, u64::saturating_add)
}

fn observe_processes(seg: &Segment, found: &DeviceProcesses) -> Vec<DeviceProcess> {
    let outside = snapshot_of(seg).processes_outside(found);
    let bytes: u64 = outside
        .iter()
        .filter_map(|p| p.bytes)
        .fold(0, u64::saturating_add);
    let before = seg
        .word(H_OUTSIDE_PROCS)
        .swap(bytes.div_ceil(UNIT), Relaxed);
    if before.saturating_mul(UNIT) > bytes {
        ledger::announce(seg);
    }
    outside
}

fn observe(seg: &Segment, info: MemoryInfo) {
    // What memgov processes hold is taken as everything they charged, idle
    // leases included: a process's published figures lag, and counting
    // less than it holds would turn its own bytes into outside bytes and
    // refuse admissions the device has room for. So outside is a lower
    // bound, short of the truth by the idle leases at most.
    let used_on_device = info.total.saturating_sub(info.free);
    let ours = ledger::total_units(seg) * UNIT;
    let outside = used_on_device.saturating_sub(ours);
    seg.word(H_DEV_TOTAL).store(info.total, Relaxed);
    seg.word(H_DEV_FREE).store(info.free, Relaxed);
    seg.word(H_OUTSIDE).store(outside / UNIT, Relaxed);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    seg.word(H_DEV_AT).store(now, Relaxed);
}

/// Stops the doorbell thread and gives the slot back when the last clone
/// goes.
struct MemberHandle(Arc<member::Inner>);

impl Drop for MemberHandle {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// This process's membership of a machine ledger ([`MachineLedger::join`]).
/// Give it to [`ProcessBudget::with_machine`](crate::ProcessBudget::with_machine)
/// so that the process's allocations are charged on the ledger. Dropping
/// the last clone leaves the ledger: every byte still charged goes back.
#[derive(Clone)]
pub struct MachineMember(Arc<MemberHandle>);

impl fmt::Debug for MachineMember {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MachineMember")
            .field("ledger", &self.ledger_key())
            .field("slot", &self.slot())
            .field("name", &self.0 .0.name)
            .field("charged", &self.charged())
            .field("used", &self.used())
            .finish()
    }
}

impl MachineMember {
    #[inline]
    pub(crate) fn inner(&self) -> &MemberOps {
        &self.0 .0
    }

    /// The ledger's key.
    pub fn ledger_key(&self) -> &str {
        self.inner().seg.key()
    }

    /// This process's slot.
    pub fn slot(&self) -> usize {
        self.inner().slot
    }

    /// Bytes this process holds on the ledger (its idle lease included).
    pub fn charged(&self) -> u64 {
        self.inner().share()
    }

    /// Bytes this process has charged to allocations.
    pub fn used(&self) -> u64 {
        self.inner().used()
    }

    /// The ledger, as this process sees it.
    pub fn snapshot(&self) -> MachineSnapshot {
        snapshot_of(&self.inner().seg)
    }

    /// This process's limit on the ledger (`u64::MAX`: none).
    pub fn limit(&self) -> u64 {
        self.inner().limit
    }

    /// Where that limit came from, when the cluster granted it
    /// ([`JoinOptions::granted`]): the variable's name.
    pub fn limit_from(&self) -> Option<String> {
        self.inner().seg.slot_limit_from(self.slot())
    }

    /// Charge `bytes` on the ledger directly (what an allocation under a
    /// [`ProcessBudget::with_machine`](crate::ProcessBudget::with_machine)
    /// does): for memory this process governs itself. Give them back with
    /// [`uncharge`](Self::uncharge).
    pub fn charge(&self, bytes: u64) -> Result<(), Box<MachineRefusal>> {
        self.inner().charge(bytes)?;
        self.inner().direct.fetch_add(bytes, SeqCst);
        Ok(())
    }

    /// Give back bytes [`charge`](Self::charge) took: never more than it
    /// took and has not had back ([`MachineError::Overdrawn`], nothing
    /// changed), and nothing once the membership no longer holds its slot
    /// ([`MachineError::SlotLost`]).
    pub fn uncharge(&self, bytes: u64) -> Result<(), MachineError> {
        let inner = self.inner();
        if let Err(lost) = inner.holds_slot() {
            return Err(MachineError::SlotLost {
                ledger: self.ledger_key().to_owned(),
                name: inner.name.clone(),
                why: lost.describe(inner.slot, inner.epoch),
            });
        }
        inner
            .direct
            .fetch_update(SeqCst, SeqCst, |held| held.checked_sub(bytes))
            .map_err(|held| MachineError::Overdrawn {
                ledger: self.ledger_key().to_owned(),
                name: inner.name.clone(),
                asked: bytes,
                held,
            })?;
        inner.uncharge(bytes);
        Ok(())
    }

    /// Panics caught on this membership's doorbell thread: in pressure
    /// responders or block caches asked to trim for another process, or in
    /// the census of its contexts. Each is printed by the panic hook (and,
    /// with `tracing`, logged as a warning naming the slot); the thread
    /// answers the ring anyway and keeps serving.
    pub fn doorbell_panics(&self) -> u64 {
        self.inner().host_panics()
    }

    /// Ask the other processes for room for `bytes`, waiting until
    /// `deadline` at most; returns the processes that did not answer.
    pub fn make_room(&self, bytes: u64, deadline: Instant) -> Vec<Holder> {
        self.inner().make_room(bytes, deadline)
    }

    /// See [`MachineLedger::observe_processes`].
    pub fn observe_processes(&self, found: &DeviceProcesses) -> Vec<DeviceProcess> {
        observe_processes(&self.inner().seg, found)
    }

    /// See [`MachineLedger::observe_device`].
    pub fn observe_device(&self, info: MemoryInfo) {
        observe(&self.inner().seg, info);
    }

    /// Reclaim dead processes' slots (see [`MachineLedger::sweep`]).
    pub fn sweep(&self) -> Vec<Reclaimed> {
        ledger::sweep(&self.inner().seg)
    }

    /// The ledger's limit.
    pub fn ledger_limit(&self) -> u64 {
        self.inner().ledger_limit()
    }

    pub(crate) fn set_host(&self, host: Arc<dyn Host>) {
        self.inner().set_host(host);
    }
}

/// Which limit on the machine refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum RefusedBy {
    /// The ledger's own limit (less outside bytes and others' floors).
    Ledger,
    /// This process's limit on the ledger ([`JoinOptions::limit`]).
    ProcessLimit,
    /// The membership no longer holds its slot (it left, this process is
    /// a forked child of the one that joined, or the slot was taken from
    /// it): nothing is charged into a slot that is not its own
    /// ([`MachineRefusal::lost`] says which).
    SlotLost,
}

/// A process on the ledger, as a refusal names it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Holder {
    /// Its name.
    pub name: String,
    /// Its pid.
    pub pid: u32,
    /// What it holds on the ledger (its idle lease included).
    pub charged: u64,
    /// What it holds in block caches.
    pub cached: u64,
    /// Its floor.
    pub floor: u64,
    /// Its priority.
    pub priority: u32,
}

impl From<&ProcessSnapshot> for Holder {
    fn from(p: &ProcessSnapshot) -> Self {
        Self {
            name: p.name.clone(),
            pid: p.pid,
            charged: p.charged,
            cached: p.cached,
            floor: p.floor,
            priority: p.priority,
        }
    }
}

/// The numbers behind a refusal by the machine ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MachineRefusal {
    /// The ledger's key.
    pub ledger: String,
    /// Which limit refused.
    pub by: RefusedBy,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes charged on the ledger by every process.
    pub charged: u64,
    /// The ledger's limit.
    pub limit: u64,
    /// Bytes the device uses outside memgov, as last observed.
    pub outside: u64,
    /// Bytes kept for other processes' floors they have not used.
    pub floors_reserved: u64,
    /// This process's name.
    pub process: String,
    /// This process's pid.
    pub pid: u32,
    /// What this process holds on the ledger.
    pub process_charged: u64,
    /// This process's limit on the ledger.
    pub process_limit: u64,
    /// Where that limit came from, when the cluster granted it
    /// ([`JoinOptions::granted`]).
    pub process_limit_from: Option<String>,
    /// The other processes on the ledger, as they were at the refusal.
    pub holders: Vec<Holder>,
    /// The processes asked to trim that did not answer in time.
    pub unanswered: Vec<Holder>,
    /// Why the membership no longer holds its slot
    /// ([`RefusedBy::SlotLost`]).
    pub lost: Option<String>,
}

impl MachineRefusal {
    /// Bytes available on the ledger at the refusal.
    pub fn available(&self) -> u64 {
        self.limit
            .saturating_sub(self.charged)
            .saturating_sub(self.outside)
            .saturating_sub(self.floors_reserved)
    }
}

impl fmt::Display for MachineRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot admit {} on the machine ledger '{}': ",
            Bytes(self.requested),
            self.ledger
        )?;
        match self.by {
            RefusedBy::SlotLost => {
                return write!(
                    f,
                    "'{}' (pid {}) no longer holds its slot on the machine ledger: {}; nothing was charged; join the ledger again (MachineLedger::join)",
                    self.process,
                    self.pid,
                    self.lost.as_deref().unwrap_or("it left the ledger")
                )
            }
            RefusedBy::ProcessLimit => {
                write!(
                    f,
                    "'{}' (pid {}) holds {} of its {} limit on the machine",
                    self.process,
                    self.pid,
                    Bytes(self.process_charged),
                    Bytes(self.process_limit)
                )?;
                if let Some(from) = &self.process_limit_from {
                    write!(f, " (granted by {from})")?;
                }
            }
            RefusedBy::Ledger => {
                write!(
                    f,
                    "{} charged by every process ('{}' (pid {}) {}",
                    Bytes(self.charged),
                    self.process,
                    self.pid,
                    Bytes(self.process_charged)
                )?;
                let mut by = self.holders.clone();
                by.sort_by_key(|h| std::cmp::Reverse(h.charged));
                for h in by.iter().take(4) {
                    write!(f, ", '{}' (pid {}) {}", h.name, h.pid, Bytes(h.charged))?;
                }
                if by.len() > 4 {
                    write!(f, ", {} more", by.len() - 4)?;
                }
                f.write_str(")")?;
                if self.outside > 0 {
                    write!(f, " + {} outside memgov", Bytes(self.outside))?;
                }
                if self.floors_reserved > 0 {
                    write!(
                        f,
                        " + {} kept for other processes' floors",
                        Bytes(self.floors_reserved)
                    )?;
                }
                write!(
                    f,
                    " of a {} limit leaves {} available",
                    Bytes(self.limit),
                    Bytes(self.available())
                )?;
            }
        }
        if !self.unanswered.is_empty() {
            f.write_str("; asked to trim and did not answer in time: ")?;
            for (i, h) in self.unanswered.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "'{}' (pid {}, {})", h.name, h.pid, Bytes(h.charged))?;
            }
        }
        f.write_str("; release memory in these processes, lower their limits (JoinOptions::limit), or raise the ledger's limit (MachineLedger::set_limit); `memgov top` shows who holds what")
    }
}

/// One process slot of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ProcessSnapshot {
    /// The slot's index.
    pub slot: usize,
    /// The process's pid.
    pub pid: u32,
    /// Its name.
    pub name: String,
    /// Whether the slot is in use by a live process (false: being set up
    /// or reclaimed).
    pub live: bool,
    /// Whether a living process holds the slot now, as the kernel says:
    /// the slot's lock is held (a dead one is reclaimed by the next sweep).
    pub alive: bool,
    /// Its lease epoch.
    pub epoch: u32,
    /// Bytes it holds on the ledger (its idle lease included).
    pub charged: u64,
    /// Bytes charged to its allocations (as last published).
    pub used: u64,
    /// Bytes in its block caches.
    pub cached: u64,
    /// Its contexts.
    pub contexts: u64,
    /// Its limit on the ledger (`u64::MAX`: none).
    pub limit: u64,
    /// Where that limit came from, when the cluster granted it
    /// ([`JoinOptions::granted`]): the variable's name.
    pub limit_from: Option<String>,
    /// Its floor.
    pub floor: u64,
    /// Its priority.
    pub priority: u32,
    /// Bytes it gave back through its doorbell.
    pub gave_back: u64,
    /// Trim requests rung and not answered yet.
    pub unanswered_rings: u32,
    /// The process's largest call sites by live bytes, largest first (at
    /// most [`SITE_ENTRIES`], each site's text cut to [`SITE_TEXT`] bytes),
    /// as its doorbell thread last published them (about every 250 ms):
    /// the sites of its contexts with attribution on, summed over them.
    /// Empty when none has attribution on.
    pub sites: Vec<ProcessSite>,
}

/// One of a process's largest call sites, as the machine ledger publishes
/// it ([`ProcessSnapshot::sites`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ProcessSite {
    /// The site (`file:line:col` or a name given with `Alloc::site`; its
    /// label after it in quotes when it has one), cut to [`SITE_TEXT`]
    /// bytes.
    pub site: String,
    /// Its live bytes, over the process's contexts.
    pub live_bytes: u64,
}

/// The ledger and every process on it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MachineSnapshot {
    /// The device key.
    pub key: String,
    /// The segment's file.
    pub path: String,
    /// The layout version.
    pub layout_version: u64,
    /// The most the ledger promises.
    pub limit: u64,
    /// Bytes charged by every process.
    pub charged: u64,
    /// Device bytes in use outside memgov, as last observed.
    pub outside: u64,
    /// Of `outside`, what the management library attributes to processes
    /// with no slot here, as last observed
    /// ([`MachineLedger::observe_processes`]; 0 when never observed).
    pub outside_processes: u64,
    /// The device's total memory, as last observed (0: never).
    pub device_total: u64,
    /// The device's free memory, as last observed.
    pub device_free: u64,
    /// When the device was last observed (ms since the Unix epoch, 0:
    /// never).
    pub observed_at_ms: u64,
    /// Dead processes' slots reclaimed so far.
    pub reclaims: u64,
    /// The slot count.
    pub slots: usize,
    /// The occupied slots.
    pub processes: Vec<ProcessSnapshot>,
    /// Whether the rows were read against one unchanged total (the
    /// pending operation applied first): then `charged` is the sum of the
    /// rows' `charged`. False only when the ledger changed during each of
    /// several reads.
    pub consistent: bool,
    /// Impossible changes refused or found so far (an audit finding:
    /// [`MachineLedger::check`] reports it, [`MachineLedger::repair`]
    /// clears it).
    pub audit: u64,
}

impl MachineSnapshot {
    /// What the ledger can still promise.
    pub fn available(&self) -> u64 {
        self.limit
            .saturating_sub(self.charged)
            .saturating_sub(self.outside)
    }

    /// Of the processes the management library found on the device, those
    /// with no live slot on this ledger: memory memgov does not govern.
    pub fn processes_outside(&self, found: &DeviceProcesses) -> Vec<DeviceProcess> {
        found
            .processes
            .iter()
            .filter(|d| !self.processes.iter().any(|p| p.live && p.pid == d.pid))
            .copied()
            .collect()
    }
}

/// How many times a snapshot reads the slots before it gives up on a
/// consistent read.
const SNAPSHOT_TRIES: u32 = 64;

pub(crate) fn snapshot_of(seg: &Segment) -> MachineSnapshot {
    // A sequence-checked read: every commit changes the ledger word (its
    // tag names the committing slot and sequence), and a share changes
    // only by applying a committed operation. So rows read between two
    // equal loads of the word, after its pending operation was applied,
    // add up to its total.
    // Only the shares are read inside the checked window (one load per
    // slot), so that a busy ledger still gives a consistent read.
    let g_word = seg.word(segment::H_LEDGER);
    let mut shares = vec![0u64; seg.slots()];
    let mut tries = 0;
    let (g, consistent) = loop {
        tries += 1;
        let g = g_word.load(SeqCst);
        ledger::help_pending(seg, g);
        for (i, w) in shares.iter_mut().enumerate() {
            *w = seg.slot(i, S_W).load(SeqCst);
        }
        let again = g_word.load(SeqCst);
        if again == g || tries >= SNAPSHOT_TRIES {
            break (again, again == g);
        }
    };
    let processes = rows_of(seg, &shares);
    MachineSnapshot {
        key: seg.key().to_owned(),
        path: seg.path().display().to_string(),
        layout_version: LAYOUT_VERSION,
        limit: ledger::limit(seg),
        charged: ledger::G::total(g) * UNIT,
        outside: ledger::outside_bytes(seg),
        outside_processes: seg.word(H_OUTSIDE_PROCS).load(Relaxed).saturating_mul(UNIT),
        device_total: seg.word(H_DEV_TOTAL).load(Relaxed),
        device_free: seg.word(H_DEV_FREE).load(Relaxed),
        observed_at_ms: seg.word(H_DEV_AT).load(Relaxed),
        reclaims: seg.word(H_RECLAIMS).load(Relaxed),
        slots: seg.slots(),
        processes,
        consistent,
        audit: seg.word(segment::H_AUDIT).load(Relaxed),
    }
}

/// The occupied slots, their shares as read in `shares`.
fn rows_of(seg: &Segment, shares: &[u64]) -> Vec<ProcessSnapshot> {
    (0..seg.slots())
        .filter_map(|i| {
            let s = seg.slot(i, S_STATE).load(Acquire);
            let kind = ledger::st_kind(s);
            let w = shares[i];
            if kind == ledger::Kind::Free && ledger::w_units(w) == 0 {
                return None;
            }
            let pid = ledger::st_pid(s);
            let ring = seg.slot32(i, S_RING).load(Relaxed);
            let answered = seg.slot(i, S_ANSWERED).load(Relaxed) as u32;
            Some(ProcessSnapshot {
                slot: i,
                pid,
                name: seg.slot_name(i),
                live: kind == ledger::Kind::Live,
                alive: kind != ledger::Kind::Free && ledger::held(seg, i),
                epoch: ledger::st_epoch(s),
                charged: ledger::w_units(w) * UNIT,
                used: seg.slot(i, S_USED).load(Relaxed),
                cached: seg.slot(i, S_CACHED).load(Relaxed),
                contexts: seg.slot(i, S_CONTEXTS).load(Relaxed),
                limit: seg.slot(i, S_LIMIT).load(Relaxed),
                limit_from: seg.slot_limit_from(i),
                floor: seg.slot(i, S_FLOOR).load(Relaxed),
                priority: seg.slot(i, S_PRIORITY).load(Relaxed) as u32,
                gave_back: seg.slot(i, S_GAVE).load(Relaxed),
                unanswered_rings: ring.wrapping_sub(answered),
                sites: seg
                    .slot_sites(i)
                    .into_iter()
                    .map(|(site, live_bytes)| ProcessSite { site, live_bytes })
                    .collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process half-way through its join (slot claimed, floor
    /// published, not live yet) keeps its floor from the next joiner: the
    /// interleaving two joins at once can take, forced.
    #[test]
    // Maps a file and takes file locks: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_claiming_slots_floor_counts_at_join() {
        const MIB: u64 = 1 << 20;
        let path =
            std::env::temp_dir().join(format!("memgov-machine-unit-floors-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let ledger =
            MachineLedger::open(&LedgerOptions::new("unit", 100 * MIB).path(&path)).unwrap();
        let seg = &ledger.seg;
        let pid = std::process::id();
        let (slot, epoch, lock) = ledger::claim_slot(seg, pid, 0).unwrap();
        seg.slot(slot, S_FLOOR).store(60 * MIB, SeqCst);
        let e = ledger
            .join(JoinOptions::new("second").floor(60 * MIB))
            .unwrap_err();
        assert!(
            matches!(e, MachineError::Floors { others, .. } if others == 60 * MIB),
            "{e}"
        );
        // The first joiner gives up: the second's floor fits.
        let claiming = ledger::st_pack(ledger::Kind::Claiming, epoch, pid);
        ledger::reclaim(seg, slot, claiming, pid, false).unwrap();
        drop(lock);
        let m = ledger
            .join(JoinOptions::new("second").floor(60 * MIB))
            .unwrap();
        drop(m);
        drop(ledger);
        let _ = std::fs::remove_file(&path);
    }
}
