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
//! This crate depends on nothing, so that plugins and execution providers
//! can hold pins without naming the governor's types (`memgov` re-exports
//! everything here).

use std::fmt;
use std::num::NonZeroU32;

/// Opaque identity of one provider context.
///
/// Issued by the governor when a context is registered. Two identities
/// issued by governors are equal only if they name the same registration of
/// the same governor. An identity grants nothing: it names a context, and
/// only a [`ProviderContextPinSource`] hands out pins on it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderContextIdentity {
    governor: NonZeroU32,
    index: u32,
}

impl ProviderContextIdentity {
    /// The identity of registration `index` of governor number `governor`.
    /// Governors mint these (each takes a process-unique number); anything
    /// else that makes one only names a context, it cannot pin it.
    pub fn new(governor: NonZeroU32, index: u32) -> Self {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderContextPinError {
    /// The context is retiring, lost or terminated. Do not queue the work;
    /// keep ownership of what was to be released.
    ContextUnavailable(ProviderContextIdentity),
    /// The context's pin counter is at its maximum; acquiring another would
    /// wrap it. Drop pins you no longer need.
    PinCountOverflow(ProviderContextIdentity),
}

impl fmt::Display for ProviderContextPinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ContextUnavailable(id) => {
                write!(f, "provider context {id} is no longer accepting work")
            }
            Self::PinCountOverflow(id) => {
                write!(f, "provider context {id} has too many outstanding pins")
            }
        }
    }
}

impl std::error::Error for ProviderContextPinError {}

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
}
