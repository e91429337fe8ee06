//! Moving live buffers to another context: the device swap with data.
//!
//! A runtime that moves a model from one device to another registers the new
//! context, moves the model's buffers there, and retires the old context. The
//! move is built from what any context offers (allocate, ordered read and
//! write, stream-ordered release), so it works between any two contexts of
//! one governor type, `Governor<AnyContext>` included (host to Vulkan, say).
//! Data travels through host memory in bounded chunks; a device-to-device
//! copy where both contexts share a driver (CUDA peer copies, one Vulkan
//! device) would be a backend extension on the same entry point.
//!
//! The move is all or nothing. Every target buffer is allocated, charged and
//! filled before any source buffer is let go; on the first failure the target
//! buffers made so far are released (stream-ordered, on the target) and every
//! source buffer comes back to the caller untouched and still charged. On
//! success the source buffers are released stream-ordered on their own
//! streams, so retiring the old context afterwards waits only for those frees
//! and whatever else still holds it.

use super::buffer::DeviceBuffer;
use super::error::{ContextOperation, GovernorError};
use super::handle::ContextHandle;
use super::stream::GovernedStream;
use crate::DeviceContext;
use std::fmt;

/// Largest piece of a buffer held in host memory at once during a move.
const CHUNK: usize = 8 << 20;

/// A move that did not happen. Nothing is lost: [`buffers`](Self::buffers)
/// holds every source buffer, in the order given, still live and charged on
/// its context, and nothing the move created on the target remains.
pub struct MigrateError<C: DeviceContext> {
    /// The source buffers, handed back.
    pub buffers: Vec<DeviceBuffer<C>>,
    /// Index in `buffers` of the buffer whose move failed.
    pub index: usize,
    /// Buffers already copied to the target and released again.
    pub undone: usize,
    /// Why.
    pub error: GovernorError,
}

impl<C: DeviceContext> fmt::Debug for MigrateError<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MigrateError")
            .field("buffers", &self.buffers.len())
            .field("index", &self.index)
            .field("undone", &self.undone)
            .field("error", &self.error)
            .finish()
    }
}

impl<C: DeviceContext> fmt::Display for MigrateError<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (bytes, role) = self
            .buffers
            .get(self.index)
            .map_or((0, None), |b| (b.len(), Some(b.role())));
        write!(
            f,
            "moving buffer {} of {} ({}",
            self.index + 1,
            self.buffers.len(),
            super::Bytes(bytes)
        )?;
        if let Some(role) = role {
            write!(f, " of {role}")?;
        }
        write!(
            f,
            ") failed: {}; the {} copies already made were released and every source buffer is returned unchanged (make room on the target and move again)",
            self.error, self.undone
        )
    }
}

impl<C: DeviceContext> std::error::Error for MigrateError<C> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<C: DeviceContext> ContextHandle<C> {
    /// Move live buffers to this context: allocate each again on `stream`
    /// (same size, same role, under this context's budgets and admission
    /// policy), copy its contents, and release the originals stream-ordered on
    /// their own streams. Returns the new buffers in the order given.
    ///
    /// ```
    /// use memgov::{Alloc, Governor, ContextConfig, Role, host::{HostContext, HostConfig}};
    /// use std::time::{Duration, Instant};
    ///
    /// let gov = Governor::new();
    /// let old = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().label("gpu0"));
    /// let new = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().label("gpu1"));
    /// let (s0, s1) = (old.create_stream("load")?, new.create_stream("load")?);
    /// let w = old.allocate(&s0, Alloc::new(4096, Role::Weights))?;
    /// w.write(0, b"weights")?;
    /// let moved = new.migrate(&s1, vec![w])?;
    /// let mut back = [0u8; 7];
    /// moved[0].read(0, &mut back)?;
    /// assert_eq!(&back, b"weights");
    /// drop(s0);
    /// old.retire().wait(Instant::now() + Duration::from_secs(5))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`MigrateError`] (boxed: it carries the buffers), holding every source
    /// buffer: `stream` belongs to
    /// another context ([`GovernorError::WrongContext`]), the target refused
    /// an allocation (budget, retiring, device lost), or a copy failed. The
    /// copies already made have been released.
    pub fn migrate(
        &self,
        stream: &GovernedStream<C>,
        buffers: Vec<DeviceBuffer<C>>,
    ) -> Result<Vec<DeviceBuffer<C>>, Box<MigrateError<C>>> {
        if stream.context() != self.id() {
            return Err(Box::new(MigrateError {
                buffers,
                index: 0,
                undone: 0,
                error: GovernorError::wrong_context(
                    ContextOperation::Migrate,
                    self.inner.name(),
                    stream,
                ),
            }));
        }
        let mut moved = Vec::with_capacity(buffers.len());
        let mut scratch = Vec::new();
        for (index, source) in buffers.iter().enumerate() {
            match self.copy_one(stream, source, &mut scratch) {
                Ok(target) => moved.push(target),
                Err(error) => {
                    let undone = moved.len();
                    // Released stream-ordered on the target; the source
                    // buffers were only read.
                    drop(moved);
                    return Err(Box::new(MigrateError {
                        buffers,
                        index,
                        undone,
                        error,
                    }));
                }
            }
        }
        // Every copy is in place: let go of the originals. Each free is
        // queued on the buffer's own stream behind the reads above.
        drop(buffers);
        Ok(moved)
    }

    fn copy_one(
        &self,
        stream: &GovernedStream<C>,
        source: &DeviceBuffer<C>,
        scratch: &mut Vec<u8>,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        // The copy is counted where the original was made, under its label,
        // when both contexts attribute.
        let mut alloc = super::Alloc::new(source.len(), source.role());
        let origin = source
            .stream
            .ctx
            .sites
            .as_ref()
            .and_then(|s| s.key(source.site));
        if let Some((_, names)) = origin {
            alloc.label = names.label;
            alloc.site = names.site;
        }
        let site = origin.map_or(std::panic::Location::caller(), |(site, _)| site);
        let target = self.allocate_at(stream, alloc, site)?;
        let mut offset = 0u64;
        while offset < source.len() {
            let n = (source.len() - offset).min(CHUNK as u64) as usize;
            scratch.resize(n, 0);
            source.read(offset, &mut scratch[..n])?;
            target.write(offset, &scratch[..n])?;
            offset += n as u64;
        }
        Ok(target)
    }
}
