//! What a stream is, as data the context's shared state holds
//! ([`StreamState`]): its timeline semaphore and queue, the value last
//! submitted, its queue of parked frees, and its command buffer and staging
//! buffer for transfers. Submitting, transferring and parking are
//! `stream.rs`'s; retiring parked frees is `retire.rs`'s.

use crate::allocator::Live;
use ash::vk;
use memgov_backend::RetireSignal;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Condvar, Mutex};

/// A free waiting for its stream's timeline to reach `value`.
pub(crate) struct Parked {
    pub value: u64,
    pub memory_id: u64,
    pub signal: RetireSignal,
}

/// Parked frees of one stream, in increasing `value` order, and how many
/// the free thread has taken but not yet fired.
#[derive(Default)]
pub(crate) struct Park {
    pub queue: VecDeque<Parked>,
    pub firing: usize,
}

pub(crate) struct Staging {
    pub live: Live,
    pub size: u64,
    /// Host address of the (persistently mapped, coherent) staging memory.
    pub ptr: usize,
}

pub(crate) struct Xfer {
    pub pool: vk::CommandPool,
    pub cmd: vk::CommandBuffer,
    pub staging: Option<Staging>,
    /// The timeline value of a submission of `cmd` whose wait gave up
    /// (timeout or error): until it is reached, `cmd` may still be pending
    /// and the staging buffer still in use by the device, so neither may be
    /// touched. `None` when every submission of `cmd` has completed.
    pub unsettled: Option<u64>,
}

/// One stream's state, shared by its handle and the context (which keeps
/// every live stream's for the free thread and teardown).
pub(crate) struct StreamState {
    pub id: u64,
    /// The id of the context the stream belongs to.
    pub context: u64,
    /// Index of the stream's queue among the context's.
    pub queue: usize,
    pub timeline: vk::Semaphore,
    /// Last value submitted; the lock orders submissions by value.
    pub submit: Mutex<u64>,
    /// Mirror of `submit`, readable without the lock.
    pub last: AtomicU64,
    pub park: Mutex<Park>,
    pub parked_cv: Condvar,
    pub xfer: Mutex<Xfer>,
    pub destroyed: AtomicBool,
}

impl StreamState {
    /// A stream with nothing submitted or parked, over objects just created.
    pub(crate) fn new(
        id: u64,
        context: u64,
        queue: usize,
        timeline: vk::Semaphore,
        pool: vk::CommandPool,
        cmd: vk::CommandBuffer,
    ) -> Self {
        Self {
            id,
            context,
            queue,
            timeline,
            submit: Mutex::new(0),
            last: AtomicU64::new(0),
            park: Mutex::new(Park::default()),
            parked_cv: Condvar::new(),
            xfer: Mutex::new(Xfer {
                pool,
                cmd,
                staging: None,
                unsettled: None,
            }),
            destroyed: AtomicBool::new(false),
        }
    }
}
