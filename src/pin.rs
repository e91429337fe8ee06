//! The pin contract: the seam between the governor and everything that queues
//! work against a device context.
//!
//! # Direction of the guarantee
//!
//! A pin does **not** ask a context to stay alive. A context can be retired at
//! any moment, and retiring never waits for permission. What a pin does is make
//! teardown *observe* the work it stands for: the backend's destroy runs only
//! after every outstanding pin has been dropped, so a stream-ordered free that
//! holds a pin can never execute after its context is gone.
//!
//! The other half of the contract belongs to the caller: once a context is
//! retiring, [`ProviderContextPinSource::pin`] fails with
//! [`ProviderContextPinError::ContextUnavailable`], and a release that cannot be
//! pinned **must not be queued**. The caller keeps ownership of what it wanted
//! to release and reports the error; it never queues work that teardown cannot
//! see.
//!
//! This module depends on nothing else in the crate, so that plugins and
//! execution providers can hold pins without naming the governor's types.

use std::fmt;
use std::num::NonZeroU32;

/// Opaque identity of one provider context.
///
/// Issued by the governor when a context is registered; callers cannot forge
/// one (the fields are private and there is no public constructor). Two
/// identities are equal only if they name the same registration of the same
/// governor.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderContextIdentity {
    governor: NonZeroU32,
    index: u32,
}

impl ProviderContextIdentity {
    /// Only the governor mints identities.
    pub(crate) fn new(governor: NonZeroU32, index: u32) -> Self {
        Self { governor, index }
    }
}

impl fmt::Debug for ProviderContextIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProviderContextIdentity({self})")
    }
}

impl fmt::Display for ProviderContextIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}.{}", self.governor, self.index)
    }
}

/// A claim on a provider context: while it exists, the context cannot finish
/// tearing down. Dropping it releases the claim.
///
/// Object-safe so that holders outside the crate can carry
/// `Box<dyn ProviderContextPin>` without knowing the backend.
pub trait ProviderContextPin: Send + Sync + fmt::Debug {
    /// The context this pin holds.
    fn context(&self) -> ProviderContextIdentity;
}

/// Something that can hand out pins on one context.
///
/// The governor gives these to external holders (plugins, execution
/// providers) through `ContextHandle::pin_source`. `Debug` because sources
/// cross plugin boundaries and must be printable in their diagnostics.
pub trait ProviderContextPinSource: Send + Sync + fmt::Debug {
    /// The context whose pins this source hands out.
    fn context(&self) -> ProviderContextIdentity;

    /// Acquire a pin.
    ///
    /// # Errors
    ///
    /// [`ProviderContextPinError::ContextUnavailable`] once the context is
    /// retiring, lost or terminated: the caller must not queue the work it
    /// wanted to pin. [`ProviderContextPinError::PinCountOverflow`] when the
    /// context already has the maximum number of outstanding pins.
    fn pin(&self) -> Result<Box<dyn ProviderContextPin>, ProviderContextPinError>;
}

/// Why a pin could not be acquired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProviderContextPinError {
    /// The context is retiring, lost or terminated. Do not queue the work;
    /// keep ownership of what was to be released.
    #[error("provider context {0} is no longer accepting work")]
    ContextUnavailable(ProviderContextIdentity),
    /// The context's pin counter is at its maximum; acquiring another would
    /// wrap it. Drop pins you no longer need.
    #[error("provider context {0} has too many outstanding pins")]
    PinCountOverflow(ProviderContextIdentity),
}

impl ProviderContextPinError {
    /// The context the failed acquire was aimed at.
    pub fn context(&self) -> ProviderContextIdentity {
        match *self {
            Self::ContextUnavailable(id) | Self::PinCountOverflow(id) => id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_name_the_context() {
        let id = ProviderContextIdentity::new(NonZeroU32::new(3).unwrap(), 7);
        assert_eq!(
            ProviderContextPinError::ContextUnavailable(id).to_string(),
            "provider context #3.7 is no longer accepting work"
        );
        assert_eq!(
            ProviderContextPinError::PinCountOverflow(id).to_string(),
            "provider context #3.7 has too many outstanding pins"
        );
        assert_eq!(ProviderContextPinError::PinCountOverflow(id).context(), id);
    }

    #[test]
    fn pin_traits_are_object_safe() {
        fn takes(_: Option<&dyn ProviderContextPin>, _: Option<&dyn ProviderContextPinSource>) {}
        takes(None, None);
    }

    #[test]
    fn a_pin_source_object_formats_with_debug() {
        let gov = crate::Governor::new();
        let ctx = gov.register(crate::null::NullContext::new(), crate::ContextConfig::new());
        let source = ctx.pin_source(Some("plugin-a"));
        let as_dyn: &dyn ProviderContextPinSource = &*source;
        let text = format!("{as_dyn:?}");
        assert!(text.contains("plugin-a"), "{text}");
        assert!(text.contains(&ctx.id().to_string()), "{text}");
    }
}
