//! # memgov-backend
//!
//! Everything a memgov backend implements and uses, in a crate that knows
//! nothing of the governor, so a backend can live in another repository:
//!
//! * [`DeviceContext`]: the trait a backend implements (allocation,
//!   stream-ordered free, ordering between streams, teardown);
//! * [`RetireSignal`]: what a stream-ordered free fires once it has executed
//!   on the device;
//! * [`BackendError`] and [`BackendErrorKind`], with
//!   [`BackendError::from_driver_call`] and [`OUT_OF_MEMORY_HINT`] for mapping
//!   a driver's result codes;
//! * [`shell`]: the driver shell a backend over a C driver API wraps around
//!   its calls (the lost flag [`LostState`], the usable check, the checked
//!   driver call, the current-context guard), written once;
//! * [`BackendProbe`]: the counters every backend records into, read by the
//!   conformance suite, the fault matrix and `memgov check`;
//! * [`fault`]: [`FaultInjecting`](fault::FaultInjecting), a wrapper that
//!   makes any backend fail on purpose;
//! * [`vmm`]: the driver-agnostic core of a virtual-memory arena (granule
//!   books, the per-granule state machine, transactional map and unmap,
//!   quarantine, sleep and wake) that the CUDA and HIP backends drive
//!   through their own driver calls.
//! * the deferred-free kit a backend over a C driver API builds its
//!   stream-ordered frees from: [`Tickets`] (a signal parked under a ticket
//!   and claimed exactly once, by the driver's callback or by device loss),
//!   [`FreeThread`] (the one thread per context that makes the driver calls
//!   a callback may not; the backend supplies them through [`FreeWork`]) and
//!   [`Unsettled`] (frees per stream whose signal has not settled, for
//!   `synchronize`).
//!
//! The conformance suite that checks a backend against this contract drives
//! it through the governor, so it lives in the test kit
//! (`memgov-conformance`, above `memgov`): a backend crate runs it from its
//! tests with `memgov-conformance` as a dev-dependency.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod capability;
mod context;
pub mod fault;
mod free_thread;
mod identity;
mod probe;
pub mod shell;
mod tickets;
mod unsettled;
pub mod vmm;

pub use context::{
    tier_unsupported, BackendError, BackendErrorKind, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireOutcome, RetireSignal, RetireSink, Tier, OUT_OF_MEMORY_HINT,
};
pub use free_thread::{FreeThread, FreeWork, Stop, Take};
pub use identity::DeviceIdentity;
pub use probe::{BackendProbe, ProbeShard};
pub use shell::{LostState, Shell};
pub use tickets::{Claim, Tickets};
pub use unsettled::{Settling, Unsettled};

/// Lock a bookkeeping mutex, recovering from poisoning (see
/// [`memgov_sync::lock`]): a backend's state is left consistent between
/// statements, and one panicking user thread must not wedge teardown.
pub use memgov_sync::lock;
