//! What memory is for: the role every allocation is accounted under.
//!
//! Imports nothing from its neighbours.

use std::fmt;

/// What memory is for. Accounting is kept per role so that snapshots and
/// errors say whether weights, KV cache or scratch space is taking the room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Role {
    /// Model parameters: long-lived, loaded once.
    Weights,
    /// Attention key/value cache: grows with sequence length.
    KvCache,
    /// Activations of a forward or backward pass.
    Activation,
    /// Scratch space for kernels (GEMM workspaces, reductions).
    Workspace,
    /// Anything else.
    Other,
}

impl Role {
    /// Every role, in accounting order.
    pub const ALL: [Role; 5] = [
        Role::Weights,
        Role::KvCache,
        Role::Activation,
        Role::Workspace,
        Role::Other,
    ];

    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// Short name used in messages and reports.
    pub const fn name(self) -> &'static str {
        match self {
            Role::Weights => "weights",
            Role::KvCache => "kv-cache",
            Role::Activation => "activation",
            Role::Workspace => "workspace",
            Role::Other => "other",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
