//! Whether a context's memory sleeps, role by role: the state word its
//! record holds. Putting memory to sleep and waking it is `suspend.rs`'s.
//!
//! One word holds both halves, so that a reader sees them together: the
//! roles whose memory sleeps (one bit per role, indexed like
//! [`Role::ALL`]) and the step running, if any (a sleep or a wake, one at
//! a time per context).

use crate::governor::role::Role;
use crate::governor::snapshot::SleepState;
use std::sync::atomic::{AtomicU16, Ordering};

/// The roles' bits of the word.
const ROLES: u16 = 0x1f;
/// A sleep is running.
const FALLING_ASLEEP: u16 = 1 << 8;
/// A wake is running.
const WAKING: u16 = 1 << 9;

/// A set of roles, one bit per role (indexed like [`Role::ALL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RoleSet(u16);

impl RoleSet {
    /// Every role.
    pub(crate) const ALL: RoleSet = RoleSet(ROLES);

    /// `roles`, duplicates counted once; every role when empty.
    pub(crate) fn of_or_all(roles: &[Role]) -> Self {
        if roles.is_empty() {
            return Self::ALL;
        }
        RoleSet(roles.iter().fold(0, |m, r| m | 1 << r.index()))
    }

    pub(crate) fn contains(self, role: Role) -> bool {
        self.0 & 1 << role.index() != 0
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The roles of `self` that are not in `other`.
    pub(crate) fn minus(self, other: RoleSet) -> RoleSet {
        RoleSet(self.0 & !other.0)
    }

    /// The roles in both.
    pub(crate) fn and(self, other: RoleSet) -> RoleSet {
        RoleSet(self.0 & other.0)
    }

    pub(crate) fn or(self, other: RoleSet) -> RoleSet {
        RoleSet(self.0 | other.0)
    }

    /// The roles of the set, in [`Role::ALL`]'s order.
    pub(crate) fn roles(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |&r| self.contains(r))
    }

    /// The first role of the set, if any.
    pub(crate) fn first(self) -> Option<Role> {
        self.roles().next()
    }
}

/// A context's sleep state word (see the module docs and `suspend.rs`).
#[derive(Debug, Default)]
pub(crate) struct SleepWord(AtomicU16);

/// What a step found instead of what it needed: the state, and the role in
/// the wrong state when a role was the reason.
pub(crate) type Refused = (SleepState, Option<Role>);

impl SleepWord {
    /// The context's state: a step running, else asleep while any role
    /// sleeps.
    pub(crate) fn get(&self) -> SleepState {
        state_of(self.0.load(Ordering::Acquire))
    }

    /// The roles whose memory sleeps now (a step running changes them only
    /// when it is done).
    pub(crate) fn asleep(&self) -> RoleSet {
        RoleSet(self.0.load(Ordering::Acquire) & ROLES)
    }

    /// Start a sleep of `roles`: refused while a step runs or when one of
    /// them sleeps already. Returns the roles asleep before it.
    pub(crate) fn begin_sleep(&self, roles: RoleSet) -> Result<RoleSet, Refused> {
        self.begin(FALLING_ASLEEP, |asleep| {
            asleep
                .and(roles)
                .first()
                .map(|r| (SleepState::Asleep, Some(r)))
        })
    }

    /// Start a wake of `roles` (every role asleep when `None`): refused
    /// while a step runs, when nothing sleeps, or when one of `roles` is
    /// awake. Returns the roles asleep before it.
    pub(crate) fn begin_wake(&self, roles: Option<RoleSet>) -> Result<RoleSet, Refused> {
        self.begin(WAKING, |asleep| match roles {
            None if asleep.is_empty() => Some((SleepState::Awake, None)),
            None => None,
            Some(r) => r
                .minus(asleep)
                .first()
                .map(|r| (SleepState::Awake, Some(r))),
        })
    }

    fn begin(
        &self,
        step: u16,
        refuse: impl Fn(RoleSet) -> Option<Refused>,
    ) -> Result<RoleSet, Refused> {
        let mut now = self.0.load(Ordering::Acquire);
        loop {
            if now & !ROLES != 0 {
                return Err((state_of(now), None));
            }
            let asleep = RoleSet(now & ROLES);
            if let Some(refused) = refuse(asleep) {
                return Err(refused);
            }
            match self
                .0
                .compare_exchange(now, now | step, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(asleep),
                Err(seen) => now = seen,
            }
        }
    }

    /// End the step running: `asleep` is the roles whose memory sleeps
    /// from now on.
    pub(crate) fn end(&self, asleep: RoleSet) {
        self.0.store(asleep.0 & ROLES, Ordering::Release);
    }
}

fn state_of(word: u16) -> SleepState {
    if word & FALLING_ASLEEP != 0 {
        SleepState::FallingAsleep
    } else if word & WAKING != 0 {
        SleepState::Waking
    } else if word & ROLES != 0 {
        SleepState::Asleep
    } else {
        SleepState::Awake
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_sleep_and_wake_apart() {
        let w = SleepWord::default();
        let both = RoleSet::of_or_all(&[Role::Weights, Role::KvCache]);
        assert_eq!(w.begin_sleep(both), Ok(RoleSet::default()));
        assert_eq!(w.get(), SleepState::FallingAsleep);
        assert_eq!(
            w.begin_wake(None),
            Err((SleepState::FallingAsleep, None)),
            "one step at a time"
        );
        w.end(both);
        assert_eq!(w.get(), SleepState::Asleep);
        let weights = RoleSet::of_or_all(&[Role::Weights]);
        assert_eq!(w.begin_wake(Some(weights)), Ok(both));
        w.end(both.minus(weights));
        assert_eq!(w.get(), SleepState::Asleep, "the KV cache still sleeps");
        assert_eq!(w.asleep().first(), Some(Role::KvCache));
        assert_eq!(
            w.begin_wake(Some(weights)),
            Err((SleepState::Awake, Some(Role::Weights)))
        );
        assert_eq!(
            w.begin_sleep(RoleSet::ALL),
            Err((SleepState::Asleep, Some(Role::KvCache)))
        );
        assert_eq!(w.begin_wake(None), Ok(both.minus(weights)));
        w.end(RoleSet::default());
        assert_eq!(w.get(), SleepState::Awake);
        assert_eq!(w.begin_wake(None), Err((SleepState::Awake, None)));
    }
}
