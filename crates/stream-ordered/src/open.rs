//! Opening a device, the same on every vendor: the device count (none is
//! `Unavailable`, "no CUDA device ..." / "no HIP device ..."; an ordinal
//! past it is `InvalidArgument` naming the count), the device's handle, its
//! name, its total memory, its identity (UUID and PCI bus id, advisory: a
//! call that fails leaves that part out) and the vendor's version words,
//! gathered into the core's [`Device`].
//!
//! The entry points are the vendor's [`OpenTable`]. What really differs
//! stays with the vendor, before [`open`] (the library loaded, CUDA's
//! `cuInit`) and in its two hooks: `enter`, run once the ordinal is known
//! to be in range (HIP makes the device current on the calling thread
//! while it asks about it), and `words`, which asks the vendor's own facts
//! (CUDA's memory-pools attribute, HIP's allocator choice) and returns the
//! driver and runtime versions as `describe` reports them.

use crate::result::{check, err, error, Class, Vendor};
use crate::state::Device;
use memgov_backend::{BackendError, BackendErrorKind, DeviceIdentity};
use std::ffi::{c_char, CStr};

/// The vendor's names of its opening calls, for messages.
#[derive(Debug, Clone, Copy)]
pub struct OpenNames {
    /// [`OpenTable::device_count`] (`cuDeviceGetCount`).
    pub device_count: &'static str,
    /// [`OpenTable::device_get`] (`cuDeviceGet`).
    pub device_get: &'static str,
    /// [`OpenTable::device_name`] (`cuDeviceGetName`).
    pub device_name: &'static str,
    /// [`OpenTable::device_total_mem`] (`cuDeviceTotalMem_v2`).
    pub device_total_mem: &'static str,
}

/// The bytes of the buffer a device's name is read into, NUL included.
pub const NAME_BYTES: usize = 256;

/// The bytes of the buffer a PCI bus id is read into, NUL included:
/// "0000:65:00.0" is 13 bytes with its NUL; room for an 8-digit domain.
pub const PCI_BUS_ID_BYTES: usize = 32;

/// A vendor's entry points for opening a device. Each returns the driver's
/// code (and, for a query, the value written to its out parameter,
/// meaningful only on success). The driver is loaded and initialised
/// before any of them is called.
pub trait OpenTable: Vendor {
    /// What the vendor's device calls take (`CUdevice` from
    /// `cuDeviceGet`, HIP's ordinal itself).
    type Device: Copy;

    /// The calls' names, for messages.
    const OPEN_NAMES: OpenNames;

    /// Whether the identity is asked last, after the total memory and the
    /// vendor's `words` (CUDA), rather than right after the name (HIP):
    /// each vendor's order of calls is kept.
    const IDENTITY_LAST: bool;

    /// The number of devices the driver reports.
    ///
    /// # Safety
    ///
    /// The driver is loaded (and initialised where it must be).
    unsafe fn device_count() -> (Self::Code, i32);

    /// The device handle of `ordinal`.
    ///
    /// # Safety
    ///
    /// `ordinal` is below [`device_count`](Self::device_count).
    unsafe fn device_get(ordinal: i32) -> (Self::Code, Self::Device);

    /// The device's name into `buf`, NUL-terminated within it.
    ///
    /// # Safety
    ///
    /// `device` came from [`device_get`](Self::device_get).
    unsafe fn device_name(buf: &mut [c_char; NAME_BYTES], device: Self::Device) -> Self::Code;

    /// The device's UUID.
    ///
    /// # Safety
    ///
    /// `device` came from [`device_get`](Self::device_get).
    unsafe fn device_uuid(device: Self::Device) -> (Self::Code, [u8; 16]);

    /// The device's PCI bus id (`"0000:65:00.0"`) into `buf`.
    ///
    /// # Safety
    ///
    /// `device` came from [`device_get`](Self::device_get).
    unsafe fn device_pci_bus_id(
        buf: &mut [c_char; PCI_BUS_ID_BYTES],
        device: Self::Device,
    ) -> Self::Code;

    /// The device's memory in bytes.
    ///
    /// # Safety
    ///
    /// `device` came from [`device_get`](Self::device_get).
    unsafe fn device_total_mem(device: Self::Device) -> (Self::Code, usize);
}

/// The device count, at least 1: a count call answering an
/// [`Class::Unavailable`] code (no device, a driver not initialised) or
/// reporting 0 devices is `Unavailable`, "no CUDA device (...)"; any other
/// failure is the code's own error.
pub fn device_count<V: OpenTable>() -> Result<i32, BackendError> {
    let names = V::OPEN_NAMES;
    // SAFETY: the driver is loaded and initialised (open's contract).
    let (r, count) = unsafe { V::device_count() };
    let ok = r == V::SUCCESS;
    if ok && count > 0 {
        return Ok(count);
    }
    if ok || V::classify(r) == Class::Unavailable {
        let count = if ok { count } else { 0 };
        let e = err::<V>(
            "new",
            BackendErrorKind::Unavailable,
            format!(
                "no {} device ({} returned {}, {count} devices)",
                V::NAME,
                names.device_count,
                V::name(r)
            ),
        );
        return Err(if ok { e } else { e.with_code(V::number(r)) });
    }
    Err(error::<V>("new", names.device_count, r))
}

/// The device's UUID and PCI address, as far as the driver reports them:
/// the identity is advisory (a ledger key, a management-library lookup), so
/// a call that fails leaves that part out rather than failing the open.
pub fn identity<V: OpenTable>(device: V::Device, name: &str) -> DeviceIdentity {
    let mut identity = DeviceIdentity::named(V::BACKEND, name);
    // SAFETY: `device` came from device_get (the caller's).
    let (r, uuid) = unsafe { V::device_uuid(device) };
    if r == V::SUCCESS {
        identity = identity.with_uuid(uuid);
    }
    let mut bus = [0 as c_char; PCI_BUS_ID_BYTES];
    // SAFETY: as above; the buffer is the table's size.
    if unsafe { V::device_pci_bus_id(&mut bus, device) } == V::SUCCESS {
        identity = identity.with_pci_bus_id(&terminated(&mut bus));
    }
    identity
}

/// The string in `buf` up to its NUL, its last byte made one whatever the
/// driver wrote.
fn terminated(buf: &mut [c_char]) -> String {
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    // SAFETY: NUL-terminated within the buffer (last byte set above), which
    // outlives the borrow.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// What [`open`] returns: the vendor's handle of the device, its facts,
/// and what the vendor's two hooks returned.
#[derive(Debug)]
pub struct Opened<D, G, W> {
    /// The vendor's handle of the device ([`OpenTable::Device`]).
    pub handle: D,
    /// The device's facts.
    pub device: Device,
    /// What `enter` returned (held while the device was asked about).
    pub entered: G,
    /// What `words` returned beside the version words.
    pub own: W,
}

/// Open device `ordinal`: the count, the range check, the device's handle,
/// then (with `enter`'s value held) its name, total memory, the vendor's
/// `words` (its own facts, and the versions as `describe` reports them,
/// with anything else the vendor keeps) and its identity, in the vendor's
/// order ([`OpenTable::IDENTITY_LAST`]). Nothing after `words` can fail, so
/// what `words` made (a pool) is returned to the vendor, never dropped.
///
/// The driver must be loaded and initialised.
pub fn open<V: OpenTable, G, W>(
    ordinal: u32,
    enter: impl FnOnce(V::Device) -> Result<G, BackendError>,
    words: impl FnOnce(V::Device, &str) -> Result<(String, W), BackendError>,
) -> Result<Opened<V::Device, G, W>, BackendError> {
    let names = V::OPEN_NAMES;
    let count = device_count::<V>()?;
    let Some(index) = i32::try_from(ordinal).ok().filter(|&i| i < count) else {
        return Err(err::<V>(
            "new",
            BackendErrorKind::InvalidArgument,
            format!(
                "{} device ordinal {ordinal} is out of range: the {} reports {count} devices \
                 (0..{count}); ask for one of those",
                V::NAME,
                V::DRIVER
            ),
        ));
    };
    // SAFETY: the ordinal is below the count.
    let (r, handle) = unsafe { V::device_get(index) };
    check::<V>("new", names.device_get, r)?;
    let entered = enter(handle)?;
    let mut buf = [0 as c_char; NAME_BYTES];
    // SAFETY: `handle` came from device_get; the buffer is the table's size.
    check::<V>("new", names.device_name, unsafe {
        V::device_name(&mut buf, handle)
    })?;
    let name = terminated(&mut buf);
    let early = (!V::IDENTITY_LAST).then(|| identity::<V>(handle, &name));
    // SAFETY: `handle` came from device_get.
    let (r, total) = unsafe { V::device_total_mem(handle) };
    check::<V>("new", names.device_total_mem, r)?;
    let (driver, own) = words(handle, &name)?;
    let identity = early.unwrap_or_else(|| identity::<V>(handle, &name));
    Ok(Opened {
        handle,
        device: Device::new(ordinal, name, identity, total as u64, driver),
        entered,
        own,
    })
}
