//! What a caller asks for: [`Alloc`] (one allocation) and [`Reserve`] (one
//! reservation), the descriptors that [`ContextHandle::allocate`],
//! [`ContextHandle::reserve`] and [`Reservation::allocate`] take.
//!
//! One descriptor per request instead of a method per combination of
//! options: a new option is a builder method here, not a new `allocate_*`
//! beside the others. Both are `Copy` and small; building one costs nothing
//! on the allocation path.
//!
//! [`ContextHandle::allocate`]: super::ContextHandle::allocate
//! [`ContextHandle::reserve`]: super::ContextHandle::reserve
//! [`Reservation::allocate`]: super::Reservation::allocate

use super::role::Role;
use crate::Tier;

/// One allocation: its size, the role its bytes are charged to, and the tier
/// it lives in (the device unless [`tier`](Self::tier) says otherwise).
///
/// ```
/// use memgov::{Alloc, ContextConfig, Governor, Role, Tier, host::{HostConfig, HostContext}};
/// let gov = Governor::new();
/// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new());
/// let stream = ctx.create_stream("copy")?;
/// let weights = ctx.allocate(&stream, Alloc::new(1 << 20, Role::Weights))?;
/// let staging = ctx.allocate(&stream, Alloc::new(4096, Role::Other).tier(Tier::PinnedHost))?;
/// assert_eq!((weights.tier(), staging.tier()), (Tier::Device, Tier::PinnedHost));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    pub(crate) bytes: u64,
    pub(crate) role: Role,
    /// `None`: the device, or the reservation's tier when allocated out of
    /// one.
    pub(crate) tier: Option<Tier>,
    /// What the caller named the allocation, for attribution.
    pub(crate) label: Option<&'static str>,
    /// The site the caller named, shown instead of its line.
    pub(crate) site: Option<&'static str>,
}

impl Alloc {
    /// What attribution counts the allocation under besides its line.
    #[inline]
    pub(crate) fn names(&self) -> super::record::sites::Names {
        super::record::sites::Names {
            label: self.label,
            site: self.site,
        }
    }

    /// `bytes` for `role`, in the device tier.
    #[inline]
    pub const fn new(bytes: u64, role: Role) -> Self {
        Self {
            bytes,
            role,
            tier: None,
            label: None,
            site: None,
        }
    }

    /// Name the allocation (`"kv-cache layer 12"`): with attribution on
    /// ([`ContextConfig::attribution`](super::ContextConfig::attribution)),
    /// snapshots and refusals count it under its call site *and* this
    /// label, one row per pair, so that allocations made at one line for
    /// different purposes can be told apart. Off, the label costs nothing
    /// and is not kept.
    #[inline]
    pub const fn label(mut self, label: &'static str) -> Self {
        self.label = Some(label);
        self
    }

    /// In `tier` instead, charged to that tier's budget
    /// ([`ContextConfig::tier_budget`](super::ContextConfig::tier_budget)).
    /// Out of a reservation, the tier must be the reservation's.
    #[inline]
    pub const fn tier(mut self, tier: Tier) -> Self {
        self.tier = Some(tier);
        self
    }

    /// The bytes asked for.
    #[inline]
    pub const fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The role the bytes are charged to.
    #[inline]
    pub const fn role(&self) -> Role {
        self.role
    }

    /// The tier asked for, when one was.
    #[inline]
    pub const fn requested_tier(&self) -> Option<Tier> {
        self.tier
    }

    /// Count the allocation at `site` instead of the caller's line, with
    /// attribution on: for a layer that allocates for others and knows
    /// where they are (a C caller's `"model.c:42"`, a runtime's
    /// `"onnxruntime arena"`). Off, it costs nothing and is not kept.
    #[inline]
    pub const fn site(mut self, site: &'static str) -> Self {
        self.site = Some(site);
        self
    }

    /// The site given with [`site`](Self::site), if any.
    #[inline]
    pub const fn named_site(&self) -> Option<&'static str> {
        self.site
    }

    /// The label given with [`label`](Self::label), if any.
    #[inline]
    pub const fn name(&self) -> Option<&'static str> {
        self.label
    }
}

/// One reservation: its size, the label snapshots and refusals name it by,
/// and the tier its bytes are charged in (the device unless
/// [`tier`](Self::tier) says otherwise).
///
/// ```
/// use memgov::{Alloc, ContextConfig, Governor, Reserve, Role, host::{HostConfig, HostContext}};
/// let gov = Governor::new();
/// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
/// let stream = ctx.create_stream("main")?;
/// let request = ctx.reserve(Reserve::new(64 << 10, "request-17"))?;
/// let kv = request.allocate(&stream, Alloc::new(16 << 10, Role::KvCache))?;
/// assert_eq!(request.left(), 48 << 10);
/// # drop(kv);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve<'a> {
    pub(crate) bytes: u64,
    pub(crate) label: &'a str,
    pub(crate) tier: Tier,
}

impl<'a> Reserve<'a> {
    /// `bytes` under `label`, in the device tier.
    #[inline]
    pub const fn new(bytes: u64, label: &'a str) -> Self {
        Self {
            bytes,
            label,
            tier: Tier::Device,
        }
    }

    /// In `tier` instead: its bytes are charged to the tier's budget and
    /// allocations out of the reservation are made in that tier (pinned
    /// host staging for a request's offloaded KV cache, say).
    #[inline]
    pub const fn tier(mut self, tier: Tier) -> Self {
        self.tier = tier;
        self
    }
}
