//! Governed device buffers: born pinned, released stream-ordered.

use super::error::{ContextOperation, GovernorError};
use super::record::sites::SiteId;
use super::record::stream::StreamShared;
use super::release::{release, Freed, Released};
use super::role::Role;
use super::stream::GovernedStream;
use crate::trace::EventKind;
use crate::{DeviceContext, ProviderContextIdentity, Tier};
use std::fmt;
use std::sync::Arc;

/// A device allocation owned by the governor's accounting.
///
/// It holds a pin on its context from birth. Dropping it queues a
/// stream-ordered free on the stream it was allocated on; the pin travels
/// with that release and is dropped when the free has retired on the device.
/// [`release_on`](Self::release_on) queues the free on another stream of the
/// same context instead.
///
/// # Streams other than its own
///
/// A stream-ordered free is ordered only within the stream it is queued on.
/// So that it never overtakes work that still uses the memory elsewhere, the
/// release is ordered after every other stream the buffer is known to be
/// used on ([`DeviceContext::order_after`]: an event recorded there and
/// waited on by the freeing stream, on CUDA and HIP):
///
/// * its own stream, when it is released on another one;
/// * every stream named with [`record_stream`](Self::record_stream), the
///   equivalent of PyTorch's `Tensor.record_stream`: call it when work of
///   your own on that stream (through [`GovernedStream::raw`]) uses the
///   buffer.
pub struct DeviceBuffer<C: DeviceContext> {
    /// The buffer's stream; its `ctx` is the buffer's context (checked at
    /// allocation). The buffer reaches its context through it rather than
    /// holding an `Arc` of its own: one reference-count round trip fewer per
    /// allocation.
    pub(crate) stream: Arc<StreamShared<C>>,
    pub(crate) memory: Option<C::Memory>,
    /// The bytes charged for it and returned on its release: the request,
    /// or with the block cache on the request's size class.
    pub(crate) bytes: u64,
    /// The bytes asked for: what [`len`](Self::len) reports and what reads
    /// and writes are bounded by, whether the cache rounded the block up or
    /// not, so that turning the cache on changes no access's outcome.
    pub(crate) len: u64,
    pub(crate) role: Role,
    /// The tier it was allocated in, whose budget it is charged to.
    pub(crate) tier: Tier,
    /// Other streams of the same context the buffer was used on: its release
    /// is ordered after each. Distinct, never the buffer's own stream; held so
    /// that they outlive the release. `None` (no allocation) unless
    /// [`DeviceBuffer::record_stream`] was called; one thin pointer, so
    /// that the buffer (and a `ReleaseError` carrying it) stays small.
    pub(crate) recorded: Option<Box<Recorded<C>>>,
    /// Its slot in its context's table of call sites, 0 when not
    /// attributed (attribution off).
    pub(crate) site: SiteId,
}

/// The streams a buffer was recorded on, behind one thin pointer.
pub(crate) struct Recorded<C: DeviceContext>(Vec<Arc<StreamShared<C>>>);

/// A release that could not be queued.
///
/// Whether the buffer comes back depends on how far the release got:
///
/// * refused before anything happened ([`GovernorError::WrongContext`]: the
///   stream is another context's): `buffer` is `Some`, the buffer untouched,
///   still live and charged, yours to release again;
/// * refused after the buffer was let go ([`GovernorError::Backend`]: the
///   backend refused the free and the memory is quarantined;
///   [`GovernorError::Reclaimed`]: the context was force-retired and the
///   memory goes with it): `buffer` is `None`, and `error` says where its
///   memory went.
pub struct ReleaseError<C: DeviceContext> {
    /// The buffer, when the release was refused before anything happened
    /// (`Some` exactly for [`GovernorError::WrongContext`]); `None` when it
    /// is gone (see the type's docs).
    pub buffer: Option<DeviceBuffer<C>>,
    /// What went wrong.
    pub error: GovernorError,
}

impl<C: DeviceContext> fmt::Debug for ReleaseError<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseError")
            .field("buffer", &self.buffer)
            .field("error", &self.error)
            .finish()
    }
}

impl<C: DeviceContext> fmt::Display for ReleaseError<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<C: DeviceContext> std::error::Error for ReleaseError<C> {}

impl<C: DeviceContext> fmt::Debug for DeviceBuffer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("context", &self.stream.ctx.id)
            .field("len", &self.len)
            .field("charged", &self.bytes)
            .field("role", &self.role)
            .field("tier", &self.tier)
            .field("stream", &self.stream.label)
            .finish()
    }
}

impl<C: DeviceContext> DeviceBuffer<C> {
    /// Size in bytes: what was asked for. Reads and writes are bounded by
    /// it.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The bytes charged to the budgets for this buffer, returned when it is
    /// released: [`len`](Self::len), or with the block cache on the size
    /// class it was rounded up to
    /// ([`CacheConfig`](super::CacheConfig)), whose every byte the
    /// allocation holds.
    pub fn charged(&self) -> u64 {
        self.bytes
    }

    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The role it is accounted under.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The tier it was allocated in ([`Tier::Device`] unless its
    /// [`Alloc`](super::Alloc) named another, or its reservation is in another).
    /// Its release is stream-ordered in every tier, and returns its bytes to
    /// that tier's budget.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The context it belongs to.
    pub fn context(&self) -> ProviderContextIdentity {
        self.stream.ctx.id
    }

    /// The label of the stream it was allocated on, where dropping it queues
    /// its free.
    pub fn stream_label(&self) -> &str {
        &self.stream.label
    }

    /// The stream it was allocated on (a clone of the handle), for example
    /// to [`release_on`](Self::release_on) it explicitly and see a refused
    /// free as an error rather than as a quarantine entry in a snapshot.
    pub fn stream(&self) -> GovernedStream<C> {
        GovernedStream {
            shared: self.stream.clone(),
        }
    }

    /// The raw allocation, for kernels of your own. Valid until the buffer is
    /// released; `None` once the context has been force-retired.
    pub fn raw(&self) -> Option<&C::Memory> {
        if self.stream.ctx.gate_closed() {
            None
        } else {
            self.memory.as_ref()
        }
    }

    /// Copy `src` into the buffer at `offset`, ordered on the buffer's stream.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GovernorError> {
        self.check_bounds("write", offset, src.len() as u64)?;
        self.access(|b, s, m| b.write(s, m, offset, src))
    }

    /// Copy from the buffer at `offset` into `dst`, ordered on the buffer's
    /// stream.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GovernorError> {
        self.check_bounds("read", offset, dst.len() as u64)?;
        self.access(|b, s, m| b.read(s, m, offset, dst))
    }

    fn check_bounds(&self, op: &'static str, offset: u64, len: u64) -> Result<(), GovernorError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(GovernorError::OutOfBounds {
                context: self.stream.ctx.name(),
                op,
                offset,
                len,
                size: self.len,
            }),
        }
    }

    fn access(
        &self,
        f: impl FnOnce(&C, &C::Stream, &C::Memory) -> Result<(), crate::BackendError>,
    ) -> Result<(), GovernorError> {
        let ctx = &*self.stream.ctx;
        if ctx.is_lost() {
            return Err(ctx.lost_error());
        }
        let backend = ctx
            .enter_on(self.stream.shard)
            .ok_or_else(|| GovernorError::Reclaimed {
                context: ctx.name(),
            })?;
        let memory = self.memory.as_ref().expect("memory present until release");
        f(&backend, self.stream.raw(), memory).map_err(|e| {
            drop(backend);
            ctx.backend_failure(e)
        })
    }

    /// Record that work on `stream` uses this buffer, so that its release
    /// (on whichever stream) is ordered after the work queued on `stream` up
    /// to that release, not only after its own stream's.
    ///
    /// Call it after queuing, on `stream`'s raw handle, work of your own that
    /// reads or writes the buffer. Recording the buffer's own stream, or a
    /// stream twice, changes nothing. The stream is kept alive until the
    /// buffer is released.
    ///
    /// ```
    /// use memgov::{Alloc, Governor, ContextConfig, Role, host::{HostContext, HostConfig}};
    ///
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new());
    /// let compute = ctx.create_stream("compute")?;
    /// let copy = ctx.create_stream("copy")?;
    /// let mut kv = ctx.allocate(&compute, Alloc::new(1 << 20, Role::KvCache))?;
    /// // ... a copy of your own on `copy.raw()` reads `kv` ...
    /// kv.record_stream(&copy)?;
    /// drop(kv); // freed on `compute`, after the work queued on `copy` so far
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`GovernorError::WrongContext`] if `stream` belongs to another
    /// context; nothing is recorded.
    pub fn record_stream(&mut self, stream: &GovernedStream<C>) -> Result<(), GovernorError> {
        if !Arc::ptr_eq(&stream.shared.ctx, &self.stream.ctx) {
            return Err(GovernorError::wrong_context(
                ContextOperation::RecordStream,
                self.stream.ctx.name(),
                stream,
            ));
        }
        if Arc::ptr_eq(&stream.shared, &self.stream) {
            return Ok(());
        }
        let recorded = &mut self
            .recorded
            .get_or_insert_with(|| Box::new(Recorded(Vec::new())))
            .0;
        if !recorded.iter().any(|s| Arc::ptr_eq(s, &stream.shared)) {
            recorded.push(stream.shared.clone());
        }
        Ok(())
    }

    /// The labels of the streams recorded with
    /// [`record_stream`](Self::record_stream), in the order recorded.
    pub fn recorded_streams(&self) -> impl Iterator<Item = &str> {
        self.recorded
            .iter()
            .flat_map(|r| r.0.iter())
            .map(|s| s.label.as_str())
    }

    /// Release stream-ordered on `target` (`None`: the buffer's own stream),
    /// after every other stream the buffer was used on.
    fn release_to(&mut self, target: Option<&StreamShared<C>>) -> Released {
        let memory = self.memory.take().expect("memory present until release");
        let own: &StreamShared<C> = &self.stream;
        let target = target.unwrap_or(own);
        let (ctx, shard, bytes, role, tier) = (
            &self.stream.ctx,
            self.stream.shard,
            self.bytes,
            self.role,
            self.tier,
        );
        let site = self.site;
        if site != 0 {
            if let Some(sites) = &ctx.sites {
                sites.release(site, bytes);
            }
        }
        // A stream's trace tag is set only on a traced context.
        if own.trace_tag != 0 && !std::ptr::eq(own, target) {
            ctx.trace_event(own.trace_tag, Some(role), EventKind::MovedOut, bytes, None);
            ctx.trace_event(
                target.trace_tag,
                Some(role),
                EventKind::MovedIn,
                bytes,
                None,
            );
        }
        let Some(recorded) = &self.recorded else {
            // Used on its own stream only and released there: the cache may
            // keep it for the next allocation of its class on that stream
            // (device memory only: a hit is always a device allocation).
            let memory = if std::ptr::eq(own, target) && own.cache.is_some() && tier == Tier::Device
            {
                match super::cache::put(ctx, own, memory, bytes, role, site) {
                    Ok(()) => return Released::Queued,
                    Err(memory) => memory,
                }
            } else {
                memory
            };
            // The common cases, without building a list.
            let after: &[&StreamShared<C>] = if std::ptr::eq(own, target) {
                &[]
            } else {
                &[own]
            };
            let freed = Freed::Live(site);
            return release(ctx, shard, target, after, memory, bytes, role, tier, freed);
        };
        let mut after: Vec<&StreamShared<C>> = Vec::with_capacity(1 + recorded.0.len());
        for s in std::iter::once(own).chain(recorded.0.iter().map(|s| &**s)) {
            if !std::ptr::eq(s, target) {
                after.push(s);
            }
        }
        let freed = Freed::Live(site);
        release(ctx, shard, target, &after, memory, bytes, role, tier, freed)
    }

    /// Queue the free on `stream` instead of the buffer's own stream.
    ///
    /// The free is ordered after the work already queued on the buffer's own
    /// stream and on every recorded stream (see the type's docs).
    ///
    /// # Errors
    ///
    /// * [`GovernorError::WrongContext`] if `stream` belongs to another
    ///   context: the buffer comes back in [`ReleaseError::buffer`], untouched.
    /// * [`GovernorError::Backend`] if the backend refused the free: the
    ///   memory is quarantined (owned and charged until the context
    ///   terminates) and shows in snapshots with this reason.
    /// * [`GovernorError::Reclaimed`] if the context was force-retired: the
    ///   memory was reclaimed with the context.
    ///
    /// On a lost device the release settles at once without calling the
    /// device, and this returns `Ok`.
    pub fn release_on(mut self, stream: &GovernedStream<C>) -> Result<(), ReleaseError<C>> {
        if !Arc::ptr_eq(&stream.shared.ctx, &self.stream.ctx) {
            let error = GovernorError::wrong_context(
                ContextOperation::ReleaseOn,
                self.stream.ctx.name(),
                stream,
            );
            return Err(ReleaseError {
                buffer: Some(self),
                error,
            });
        }
        // `stream` is of the buffer's context (checked above): errors name
        // the context through it, since the buffer is gone by then.
        match self.release_to(Some(&stream.shared)) {
            Released::Queued | Released::SettledLost => Ok(()),
            Released::Reclaimed => Err(ReleaseError {
                buffer: None,
                error: GovernorError::Reclaimed {
                    context: stream.shared.ctx.name(),
                },
            }),
            Released::Quarantined(e) => Err(ReleaseError {
                buffer: None,
                error: GovernorError::Backend {
                    context: stream.shared.ctx.name(),
                    source: *e,
                },
            }),
        }
    }
}

impl<C: DeviceContext> Drop for DeviceBuffer<C> {
    fn drop(&mut self) {
        if self.memory.is_some() {
            // Errors are recorded in the context (quarantine, counters,
            // tracing); a destructor has no one to return them to.
            let _ = self.release_to(None);
        }
    }
}
