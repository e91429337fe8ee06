//! Budgets the cluster granted: the device-memory limit a container was
//! given, read where the scheduler or the sharing layer puts it, so that it
//! becomes the process level of the budget tree. A machine ledger's
//! `MachineLedger::join` reads it by default (for the device given with
//! `JoinOptions::device`; off with `JoinOptions::ignore_granted_env`), as
//! does [`ProcessBudget::from_env`](crate::ProcessBudget::from_env) without
//! a ledger; [`ProcessBudget::granted`](crate::ProcessBudget::granted) and
//! `JoinOptions::granted` take a grant read here by the program. (The
//! machine ledger is above this module, which names none of it.)
//!
//! | variable | set by | format |
//! |---|---|---|
//! | `MEMGOV_DEVICE_LIMIT` | the operator, for memgov | `<size>` (every device) or `<device>=<size>[,<device>=<size>...]`; a size is digits with an optional binary unit: none or `B`, `K`/`KB`/`KiB`, `M`/`MB`/`MiB`, `G`/`GB`/`GiB`, `T`/`TB`/`TiB` (any case) |
//! | `CUDA_DEVICE_MEMORY_LIMIT_<i>` | HAMi (HAMi-core enforces it) | digits, then optionally one of `k`/`K` (KiB), `m`/`M` (MiB), `g`/`G` (GiB); nothing else |
//! | `CUDA_DEVICE_MEMORY_LIMIT` | HAMi, for every device with no `_<i>` | as above |
//! | `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` | NVIDIA MPS (the MPS server enforces it) | `<device>=<value><unit>[,...]`, the unit `M`/`MB` or `G`/`GB` (any case, binary) |
//!
//! The HAMi rules follow HAMi-core's README ("Usage": `1g`, `1024m`,
//! `1048576k`, `1073741824`) and its `get_limit_from_env` /
//! `do_init_device_memory_limits` in `src/multiprocess/multiprocess_memory_limit.c`
//! (Project-HAMi/HAMi-core): the last character alone is the unit, the
//! per-device `CUDA_DEVICE_MEMORY_LIMIT_<i>` overrides the plain one for
//! device `i`, and an empty value is as if unset. Where HAMi-core quietly
//! falls back (a value of 0, an overflow, a suffix it does not know, which
//! it reads as bytes of the leading digits), memgov refuses with an error
//! naming the variable instead: a limit silently read as something else is
//! worse than none. HAMi-core parses the digits with `strtoul` base 0, so
//! `0x...` would be hexadecimal and a leading `0` octal there; HAMi's device
//! plugin writes plain decimal (`3000m`), and memgov accepts decimal only,
//! refusing the forms the two would read differently.
//!
//! The MPS format follows NVIDIA's MPS documentation (Appendix: Tools and
//! Interface Reference, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"): a comma-separated
//! list of `<device ordinal>=<limit>` pairs such as `0=1G,1=512MB`; a device
//! the list does not name has no limit from it.
//!
//! **Precedence.** Every variable that gives device `i` a limit is read and
//! checked (a bad one is an error even when another would win), and the
//! smallest limit wins: each is enforced by something (HAMi-core's hook,
//! the MPS server, memgov itself), so the process can use no more than the
//! smallest. Between HAMi's two, HAMi's own rule holds: `_<i>` replaces the
//! plain one for device `i`. On a tie the first in the table is named.
//!
//! **Which device is `i`.** The CUDA device ordinal the process opens (the
//! argument of `cuDeviceGet`, after `CUDA_VISIBLE_DEVICES` has been applied):
//! memgov does no remapping of its own. HAMi's device plugin writes one
//! `CUDA_DEVICE_MEMORY_LIMIT_<i>` per GPU it gives the container, in the
//! order the container sees them, and NVIDIA documents the MPS ordinals as
//! the devices a client sees (remapped by the server when
//! `CUDA_VISIBLE_DEVICES` was set for the control daemon). A container that
//! sets `CUDA_VISIBLE_DEVICES` itself to reorder its GPUs must pass the
//! ordinal it opens; memgov cannot tell the two orders apart.
//!
//! ```no_run
//! use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
//! use memgov::{ProcessBudget, SharedBudget};
//! # fn open(ordinal: u32, total: u64, identity: &memgov::DeviceIdentity) -> Result<(), Box<dyn std::error::Error>> {
//! let ledger = MachineLedger::open(&LedgerOptions::for_device(identity, total))?;
//! // The join reads the grant for the CUDA ordinal this process opens, and
//! // fails naming the variable when one does not read.
//! let me = ledger.join(JoinOptions::new("llm-server").device(ordinal).device_total(total))?;
//! // The process level takes the grant; `limit_from` names its variable.
//! let process = ProcessBudget::with_machine("llm-server", total, me);
//! let gpu0 = SharedBudget::with_parent("gpu0", total, &process);
//! # let _ = gpu0; Ok(()) }
//! ```
//!
//! Without a machine ledger:
//!
//! ```no_run
//! # fn open(ordinal: u32, total: u64) -> Result<(), memgov::granted::GrantedLimitError> {
//! let process = memgov::ProcessBudget::from_env("llm-server", total, Some(ordinal), Some(total))?;
//! # let _ = process; Ok(()) }
//! ```

use crate::Bytes;
use std::fmt;

/// The explicit limit for memgov (see the module's table).
pub const MEMGOV_DEVICE_LIMIT: &str = "MEMGOV_DEVICE_LIMIT";
/// HAMi's limit for every device (and the prefix of its per-device ones).
pub const HAMI_DEVICE_MEMORY_LIMIT: &str = "CUDA_DEVICE_MEMORY_LIMIT";
/// NVIDIA MPS's per-client pinned device memory limit.
pub const MPS_PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

/// The limit the cluster granted this process on one device, and where it
/// came from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct GrantedLimit {
    /// The limit in bytes.
    pub bytes: u64,
    /// The variable it was read from (`CUDA_DEVICE_MEMORY_LIMIT_0`, ...).
    pub variable: String,
    /// The variable's value as given.
    pub value: String,
    /// The device ordinal it applies to.
    pub device: u32,
}

impl fmt::Display for GrantedLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} on device {} from {}={}",
            Bytes(self.bytes),
            self.device,
            self.variable,
            self.value
        )
    }
}

/// A granted limit that cannot be read. Each names the variable and its
/// value; nothing falls back to a default.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GrantedLimitError {
    /// The number part is missing or not a plain decimal number.
    #[error("{variable}={value:?}: {number:?} is not a decimal number of bytes; write digits with a unit ({units}), e.g. {example}")]
    NotANumber {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
        /// The part that should be the number.
        number: String,
        /// The units this variable takes.
        units: &'static str,
        /// A valid value.
        example: &'static str,
    },
    /// A unit suffix this variable's format does not have.
    #[error("{variable}={value:?}: unknown unit {suffix:?}; this variable takes {units}, e.g. {example}")]
    UnknownSuffix {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
        /// The suffix found (empty: none where one is required).
        suffix: String,
        /// The units this variable takes.
        units: &'static str,
        /// A valid value.
        example: &'static str,
    },
    /// A limit of zero bytes (HAMi-core reads it as no limit at all).
    #[error(
        "{variable}={value:?}: a limit of 0 bytes; give the limit, or unset the variable for none"
    )]
    Zero {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
    },
    /// The number times the unit does not fit in 64 bits.
    #[error(
        "{variable}={value:?}: the limit does not fit in 64 bits of bytes; give a smaller value"
    )]
    Overflow {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
    },
    /// A `<device>=<size>` list that does not parse.
    #[error("{variable}={value:?}: the device list does not parse at {entry:?}: {why}; write comma-separated <device ordinal>=<size> entries, e.g. {example}")]
    DeviceList {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
        /// The entry that does not parse.
        entry: String,
        /// What is wrong with it.
        why: &'static str,
        /// A valid value.
        example: &'static str,
    },
    /// A limit above the device's total memory.
    #[error("{variable}={value:?}: {} on device {device} is above the device's {} of memory; the value was meant for another device, or is wrong: fix it", Bytes(*bytes), Bytes(*total))]
    AboveDevice {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
        /// The limit it gives.
        bytes: u64,
        /// The device ordinal.
        device: u32,
        /// The device's total memory.
        total: u64,
    },
    /// The variable's value is not valid Unicode.
    #[error("{variable}: the value is not valid UTF-8; give a size such as 4g")]
    NotUnicode {
        /// The variable.
        variable: String,
    },
    /// The variable grants a limit per device, and the process did not say
    /// which device it opens.
    #[error("{variable}={value:?} grants a limit per device, and this process did not say which device it opens: give the CUDA ordinal it opens (JoinOptions::device, ProcessBudget::from_env's device), or join with JoinOptions::ignore_granted_env() to take no grant")]
    DeviceNotGiven {
        /// The variable.
        variable: String,
        /// Its value.
        value: String,
    },
}

/// The units and examples of each format, for messages.
#[derive(Clone, Copy)]
enum Format {
    Memgov,
    Hami,
    Mps,
}

impl Format {
    fn units(self) -> &'static str {
        match self {
            Self::Memgov => "none or B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (binary, any case)",
            Self::Hami => "none (bytes), k, m or g (KiB, MiB, GiB; either case)",
            Self::Mps => "M/MB or G/GB (binary, any case)",
        }
    }

    fn example(self) -> &'static str {
        match self {
            Self::Memgov => "12GiB or 0=12GiB,1=8GiB",
            Self::Hami => "3000m",
            Self::Mps => "0=1G,1=512MB",
        }
    }

    /// The multiplier of `suffix`, or `None` when the format has no such
    /// unit. An empty suffix is bytes where the format allows it.
    fn multiplier(self, suffix: &str) -> Option<u64> {
        const K: u64 = 1 << 10;
        const M: u64 = 1 << 20;
        const G: u64 = 1 << 30;
        const T: u64 = 1 << 40;
        match self {
            // HAMi-core: the last character alone, one letter or none.
            Self::Hami => match suffix {
                "" => Some(1),
                "k" | "K" => Some(K),
                "m" | "M" => Some(M),
                "g" | "G" => Some(G),
                _ => None,
            },
            Self::Mps => match suffix.to_ascii_uppercase().as_str() {
                "M" | "MB" => Some(M),
                "G" | "GB" => Some(G),
                _ => None,
            },
            Self::Memgov => match suffix.to_ascii_uppercase().as_str() {
                "" | "B" => Some(1),
                "K" | "KB" | "KIB" => Some(K),
                "M" | "MB" | "MIB" => Some(M),
                "G" | "GB" | "GIB" => Some(G),
                "T" | "TB" | "TIB" => Some(T),
                _ => None,
            },
        }
    }
}

/// One size in `format`: decimal digits, then the unit.
fn parse_size(
    variable: &str,
    value: &str,
    text: &str,
    format: Format,
) -> Result<u64, GrantedLimitError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    // A leading zero is octal to HAMi-core's strtoul: refuse what the two
    // would read differently ("0" alone is caught as zero below).
    if number.is_empty() || (number.len() > 1 && number.starts_with('0')) {
        return Err(GrantedLimitError::NotANumber {
            variable: variable.to_owned(),
            value: value.to_owned(),
            number: text.to_owned(),
            units: format.units(),
            example: format.example(),
        });
    }
    let unit = format
        .multiplier(suffix)
        .ok_or_else(|| GrantedLimitError::UnknownSuffix {
            variable: variable.to_owned(),
            value: value.to_owned(),
            suffix: suffix.to_owned(),
            units: format.units(),
            example: format.example(),
        })?;
    let overflow = || GrantedLimitError::Overflow {
        variable: variable.to_owned(),
        value: value.to_owned(),
    };
    let n: u64 = number.parse().map_err(|_| overflow())?;
    let bytes = n.checked_mul(unit).ok_or_else(overflow)?;
    if bytes == 0 {
        return Err(GrantedLimitError::Zero {
            variable: variable.to_owned(),
            value: value.to_owned(),
        });
    }
    Ok(bytes)
}

/// A `<device>=<size>` list: every entry is checked; returns the size for
/// `device`, if the list names it.
fn parse_list(
    variable: &str,
    value: &str,
    format: Format,
    device: u32,
) -> Result<Option<u64>, GrantedLimitError> {
    let bad = |entry: &str, why: &'static str| GrantedLimitError::DeviceList {
        variable: variable.to_owned(),
        value: value.to_owned(),
        entry: entry.to_owned(),
        why,
        example: format.example(),
    };
    let mut seen: Vec<u32> = Vec::new();
    let mut found = None;
    for entry in value.split(',') {
        let entry = entry.trim();
        if entry.is_empty() {
            return Err(bad(entry, "an empty entry"));
        }
        let (dev, size) = entry
            .split_once('=')
            .ok_or_else(|| bad(entry, "no '=' between the device and the size"))?;
        let dev = dev.trim();
        if dev.is_empty() || !dev.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(entry, "the device is not an ordinal (0, 1, ...)"));
        }
        let dev: u32 = dev
            .parse()
            .map_err(|_| bad(entry, "the device ordinal is too large"))?;
        if seen.contains(&dev) {
            return Err(bad(entry, "the device is named twice"));
        }
        seen.push(dev);
        let bytes = parse_size(variable, value, size, format)?;
        if dev == device {
            found = Some(bytes);
        }
    }
    Ok(found)
}

/// The limit the cluster granted on `device` (the CUDA ordinal the process
/// opens), read through `env` (a variable's value, `None` when unset) from
/// the variables in the module's table; `None` when none of them gives
/// one. `device_total` is the device's memory when known: a limit above it
/// is an error.
///
/// A pure function of `env`, so that its handling is tested without
/// touching the process environment; [`granted_limit_from_env`] reads the
/// real one.
pub fn granted_limit(
    device: u32,
    device_total: Option<u64>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    // Unset and empty are the same (HAMi-core's rule, kept for all four).
    let read = |name: &str| env(name).filter(|v| !v.is_empty());
    let mut candidates: Vec<GrantedLimit> = Vec::new();
    let mut take = |variable: &str, value: String, bytes: Option<u64>| {
        if let Some(bytes) = bytes {
            candidates.push(GrantedLimit {
                bytes,
                variable: variable.to_owned(),
                value,
                device,
            });
        }
    };

    if let Some(v) = read(MEMGOV_DEVICE_LIMIT) {
        let bytes = if v.contains('=') {
            parse_list(MEMGOV_DEVICE_LIMIT, &v, Format::Memgov, device)?
        } else {
            Some(parse_size(MEMGOV_DEVICE_LIMIT, &v, &v, Format::Memgov)?)
        };
        take(MEMGOV_DEVICE_LIMIT, v, bytes);
    }

    let indexed = format!("{HAMI_DEVICE_MEMORY_LIMIT}_{device}");
    let hami_indexed = read(&indexed)
        .map(|v| parse_size(&indexed, &v, &v, Format::Hami).map(|b| (v, b)))
        .transpose()?;
    let hami_all = read(HAMI_DEVICE_MEMORY_LIMIT)
        .map(|v| parse_size(HAMI_DEVICE_MEMORY_LIMIT, &v, &v, Format::Hami).map(|b| (v, b)))
        .transpose()?;
    // HAMi's rule: the per-device variable replaces the plain one.
    match (hami_indexed, hami_all) {
        (Some((v, b)), _) => take(&indexed, v, Some(b)),
        (None, Some((v, b))) => take(HAMI_DEVICE_MEMORY_LIMIT, v, Some(b)),
        (None, None) => {}
    }

    if let Some(v) = read(MPS_PINNED_DEVICE_MEM_LIMIT) {
        let bytes = parse_list(MPS_PINNED_DEVICE_MEM_LIMIT, &v, Format::Mps, device)?;
        take(MPS_PINNED_DEVICE_MEM_LIMIT, v, bytes);
    }

    if let Some(total) = device_total.filter(|&t| t > 0) {
        if let Some(c) = candidates.iter().find(|c| c.bytes > total) {
            return Err(GrantedLimitError::AboveDevice {
                variable: c.variable.clone(),
                value: c.value.clone(),
                bytes: c.bytes,
                device,
                total,
            });
        }
    }
    // The smallest wins; `min_by_key` keeps the first of equals, and the
    // candidates are in the table's order.
    Ok(candidates.into_iter().min_by_key(|c| c.bytes))
}

/// [`granted_limit`] on this process's environment. A variable whose value
/// is not UTF-8 is an error naming it.
pub fn granted_limit_from_env(
    device: u32,
    device_total: Option<u64>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    with_process_env(|env| granted_limit(device, device_total, env))
}

/// The limit the cluster granted this process on a device it did not
/// name, read through `env` as [`granted_limit`] reads it: only a limit for
/// every device counts (`MEMGOV_DEVICE_LIMIT=<size>`,
/// `CUDA_DEVICE_MEMORY_LIMIT`), and a variable that grants limits per
/// device is an error ([`GrantedLimitError::DeviceNotGiven`]) rather than
/// read for a device guessed. `indexed` lists the `CUDA_DEVICE_MEMORY_LIMIT_<i>`
/// variables set (their names). The device in the result is 0 (the limit
/// holds on every device).
///
/// What `MachineLedger::join` reads when `JoinOptions::device` was not
/// given.
pub fn granted_limit_any_device(
    device_total: Option<u64>,
    indexed: &[String],
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    let read = |name: &str| env(name).filter(|v| !v.is_empty());
    let per_device = |variable: &str, value: String| GrantedLimitError::DeviceNotGiven {
        variable: variable.to_owned(),
        value,
    };
    // Every variable is checked before any limit is taken, as for a
    // device named.
    if let Some(v) = read(MEMGOV_DEVICE_LIMIT).filter(|v| v.contains('=')) {
        // Still parsed, so that a list that does not parse says so.
        parse_list(MEMGOV_DEVICE_LIMIT, &v, Format::Memgov, 0)?;
        return Err(per_device(MEMGOV_DEVICE_LIMIT, v));
    }
    let mut indexed: Vec<&String> = indexed.iter().collect();
    indexed.sort();
    for name in indexed {
        if let Some(v) = read(name) {
            parse_size(name, &v, &v, Format::Hami)?;
            return Err(per_device(name, v));
        }
    }
    if let Some(v) = read(MPS_PINNED_DEVICE_MEM_LIMIT) {
        parse_list(MPS_PINNED_DEVICE_MEM_LIMIT, &v, Format::Mps, 0)?;
        return Err(per_device(MPS_PINNED_DEVICE_MEM_LIMIT, v));
    }
    // What is left gives every device the same limit: device 0 reads it.
    granted_limit(0, device_total, env)
}

/// [`granted_limit_any_device`] on this process's environment.
pub fn granted_limit_from_env_any_device(
    device_total: Option<u64>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    let prefix = format!("{HAMI_DEVICE_MEMORY_LIMIT}_");
    let indexed: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| {
            k.strip_prefix(&prefix)
                .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    with_process_env(|env| granted_limit_any_device(device_total, &indexed, env))
}

/// Run `read` on this process's environment; a variable it asks for whose
/// value is not UTF-8 is an error naming it.
fn with_process_env(
    read: impl FnOnce(
        &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<GrantedLimit>, GrantedLimitError>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    let bad = std::cell::RefCell::new(None);
    let env = |name: &str| match std::env::var_os(name)?.into_string() {
        Ok(v) => Some(v),
        Err(_) => {
            bad.borrow_mut().get_or_insert_with(|| name.to_owned());
            None
        }
    };
    let found = read(&env);
    match bad.into_inner() {
        Some(variable) => Err(GrantedLimitError::NotUnicode { variable }),
        None => found,
    }
}

/// Where a process reads its grant from: the device it opens, when it
/// said, and that device's memory, when known.
pub(crate) fn read_grant(
    device: Option<u32>,
    device_total: Option<u64>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    match device {
        Some(d) => granted_limit_from_env(d, device_total),
        None => granted_limit_from_env_any_device(device_total),
    }
}
