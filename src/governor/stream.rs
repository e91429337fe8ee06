//! Governed streams. A stream holds a pin for as long as it exists; buffers
//! allocated on it keep it alive, so that their release on drop always has
//! their own stream to go to.

use super::error::{ContextName, GovernorError};
use super::pin_source::ContextPin;
use super::record::stream::StreamShared;
use super::record::ContextInner;
use crate::sync::lock;
use crate::DeviceContext;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

impl<C: DeviceContext> Drop for StreamShared<C> {
    fn drop(&mut self) {
        // Free the blocks cached here first, stream-ordered, while the raw
        // stream still exists.
        super::cache::flush_stream(self, "stream dropped");
        let ctx = &*self.ctx;
        let Some(backend) = ctx.enter_on(self.shard) else {
            // The gate is closed only by force (a stream's pin keeps ordinary
            // teardown away): force revoked this stream's pin and teardown
            // destroys the raw stream. Dropping the handle has no side effects.
            return;
        };
        // The stream's pin and its `streams_live` count leave together,
        // under the gate claim like every `streams_live` transition (force
        // reads it once the gate has drained), and also when the backend's
        // `destroy_stream` panics: declared after `backend`, so dropped
        // before it.
        let _leave = StreamLeaves { ctx };
        if let Some(raw) = self.raw.take() {
            if !ctx.is_lost() {
                if let Err(e) = backend.destroy_stream(raw) {
                    ctx.note_backend_error(&e);
                }
            }
        }
    }
}

/// Takes a dropped stream out of the counts (live streams, pins) on every
/// way out of [`StreamShared`]'s drop.
struct StreamLeaves<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
}

impl<C: DeviceContext> Drop for StreamLeaves<'_, C> {
    fn drop(&mut self) {
        self.ctx.stream_left();
    }
}

/// A stream of ordered work on a governed context.
///
/// Cloning shares the stream. The raw stream is destroyed when the last clone
/// and the last buffer allocated on it are gone.
pub struct GovernedStream<C: DeviceContext> {
    pub(crate) shared: Arc<StreamShared<C>>,
}

impl<C: DeviceContext> Clone for GovernedStream<C> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<C: DeviceContext> fmt::Debug for GovernedStream<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernedStream")
            .field("context", &self.shared.ctx.id)
            .field("label", &self.shared.label)
            .finish()
    }
}

impl<C: DeviceContext> GovernedStream<C> {
    pub(crate) fn create(ctx: &Arc<ContextInner<C>>, label: String) -> Result<Self, GovernorError> {
        // Released on every failure below, and if the backend panics.
        let pin = ContextPin::acquire(ctx).map_err(|e| ctx.pin_error(e))?;
        let raw = match ctx.enter() {
            Some(backend) => match backend.create_stream() {
                Ok(raw) => {
                    // Counted under the gate claim, so force sees it.
                    ctx.stream_created();
                    pin.transfer();
                    raw
                }
                Err(e) => {
                    drop(backend);
                    return Err(ctx.backend_failure(e));
                }
            },
            None => {
                return Err(
                    ctx.pin_error(crate::ProviderContextPinError::ContextUnavailable(ctx.id))
                )
            }
        };
        let shared = Arc::new(StreamShared {
            ctx: ctx.clone(),
            raw: Some(raw),
            trace_tag: ctx.trace.as_ref().map_or(0, |t| t.stream_created(&label)),
            label,
            shard: ctx.ledger.stats().pick_shard(),
            pending_bytes: ctx
                .description
                .stream_ordered_reuse
                .then(|| Arc::new(AtomicU64::new(0))),
            cache: ctx.cache.enabled().then(crate::sync::Bins::new),
        });
        let mut streams = lock(&ctx.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(&shared));
        drop(streams);
        Ok(Self { shared })
    }

    /// Block until everything queued on this stream has executed, including
    /// the retirement of stream-ordered releases queued on it.
    pub fn synchronize(&self) -> Result<(), GovernorError> {
        let ctx = &*self.shared.ctx;
        if ctx.is_lost() {
            return Err(ctx.lost_error());
        }
        let backend = ctx
            .enter_on(self.shared.shard)
            .ok_or_else(|| GovernorError::Reclaimed {
                context: ctx.name(),
            })?;
        backend.synchronize(self.shared.raw()).map_err(|e| {
            drop(backend);
            ctx.backend_failure(e)
        })
    }

    /// The label given at creation.
    pub fn label(&self) -> &str {
        &self.shared.label
    }

    /// The context this stream belongs to.
    pub fn context(&self) -> crate::ProviderContextIdentity {
        self.shared.ctx.id
    }

    /// The context this stream belongs to, by identity and label.
    pub fn context_name(&self) -> ContextName {
        self.shared.ctx.name()
    }

    /// The raw backend stream, for queuing kernels and copies of your own.
    ///
    /// Returns `None` once the context has been force-retired. Do not destroy
    /// it: the governor does, when the last clone is dropped.
    pub fn raw(&self) -> Option<&C::Stream> {
        (!self.shared.ctx.gate_closed()).then(|| self.shared.raw())
    }
}
