//! Which physical device a context runs on, in a form every process and
//! every API on the machine agrees on: the key of the machine ledger that
//! processes sharing a device join (`memgov::machine`), and what a vendor's
//! management library (NVML, ROCm SMI) looks a device up by.
//!
//! The driver's device ordinal is not such a key: it depends on
//! `CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES` and on the API (a CUDA
//! ordinal and a Vulkan physical-device index need not agree). A device's
//! UUID is the same in every process and every API that reports one (CUDA's
//! `cuDeviceGetUuid`, Vulkan's `VkPhysicalDeviceIDProperties::deviceUUID`,
//! NVML's `nvmlDeviceGetUUID`); its PCI address is the same in every
//! process of the machine.

use std::fmt;

/// A physical device's identity: its UUID and PCI address where the driver
/// reports them, else a name.
///
/// ```
/// use memgov_backend::DeviceIdentity;
///
/// let uuid = [0x8c, 0x3b, 0x1f, 0x00, 0x12, 0x34, 0x56, 0x78,
///             0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x02, 0x03, 0x04];
/// let id = DeviceIdentity::named("cuda", "NVIDIA H200")
///     .with_uuid(uuid)
///     .with_pci_bus_id("0000:65:00.0");
/// assert_eq!(id.uuid_string().as_deref(), Some("GPU-8c3b1f00-1234-5678-9abc-def001020304"));
/// // The UUID wins: two APIs on one device agree on it.
/// assert_eq!(id.key(), "gpu-8c3b1f00-1234-5678-9abc-def001020304");
/// assert_eq!(DeviceIdentity::from_key(&id.key()).unwrap().uuid(), Some(uuid));
///
/// // Without a UUID, the PCI address; without either, the backend and name.
/// let pci = DeviceIdentity::named("hip", "AMD Instinct MI300X").with_pci_bus_id("0000:C1:00.0");
/// assert_eq!(pci.key(), "pci-0000:c1:00.0");
/// assert_eq!(DeviceIdentity::named("host", "host 0").key(), "host-host-0");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceIdentity {
    backend: String,
    name: String,
    uuid: Option<[u8; 16]>,
    pci_bus_id: Option<String>,
}

impl DeviceIdentity {
    /// A device known only by its backend and name (an embedded device, a
    /// driver that reports neither UUID nor PCI address).
    pub fn named(backend: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            backend: backend.into(),
            name: name.into(),
            uuid: None,
            pci_bus_id: None,
        }
    }

    /// The device's 16-byte UUID, as the driver reports it.
    pub fn with_uuid(mut self, uuid: [u8; 16]) -> Self {
        self.uuid = Some(uuid);
        self
    }

    /// The device's PCI address, `domain:bus:device.function` in hex
    /// (`0000:65:00.0`). Kept lower-case, so that two drivers' spellings
    /// agree; an address that does not have that shape is ignored (the
    /// identity then falls back to the name).
    pub fn with_pci_bus_id(mut self, bus_id: &str) -> Self {
        self.pci_bus_id = normalize_pci(bus_id);
        self
    }

    /// The backend that reported the device.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The UUID, when the driver reported one.
    pub fn uuid(&self) -> Option<[u8; 16]> {
        self.uuid
    }

    /// The UUID in NVML's spelling (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`),
    /// the form `nvmlDeviceGetHandleByUUID` takes.
    pub fn uuid_string(&self) -> Option<String> {
        self.uuid.map(|u| format!("GPU-{}", hyphenated(&u)))
    }

    /// The PCI address (`0000:65:00.0`, lower-case), when the driver
    /// reported one.
    pub fn pci_bus_id(&self) -> Option<&str> {
        self.pci_bus_id.as_deref()
    }

    /// The machine-wide key: `gpu-<uuid>` when the UUID is known, else
    /// `pci-<address>`, else `<backend>-<name>` (spaces as `-`). Only
    /// characters a file name can hold.
    pub fn key(&self) -> String {
        if let Some(u) = &self.uuid {
            return format!("gpu-{}", hyphenated(u));
        }
        if let Some(p) = &self.pci_bus_id {
            return format!("pci-{p}");
        }
        let clean = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                        c
                    } else {
                        '-'
                    }
                })
                .collect()
        };
        format!("{}-{}", clean(&self.backend), clean(&self.name))
    }

    /// The identity a [`key`](Self::key) names, as far as the key carries
    /// it (a UUID or a PCI address; a name key gives `None`): what a tool
    /// that finds a ledger by its key looks the device up by.
    pub fn from_key(key: &str) -> Option<Self> {
        if let Some(hex) = key.strip_prefix("gpu-") {
            let digits: String = hex.chars().filter(|c| *c != '-').collect();
            if digits.len() != 32 || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
            let mut uuid = [0u8; 16];
            for (i, b) in uuid.iter_mut().enumerate() {
                *b = u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).ok()?;
            }
            return Some(Self::named("", "").with_uuid(uuid));
        }
        if let Some(pci) = key.strip_prefix("pci-") {
            let id = Self::named("", "").with_pci_bus_id(pci);
            return id.pci_bus_id.is_some().then_some(id);
        }
        None
    }
}

impl fmt::Display for DeviceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.key())
    }
}

fn hyphenated(u: &[u8; 16]) -> String {
    let mut s = String::with_capacity(36);
    for (i, b) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// `domain:bus:device.function`, each hex (domain up to 8 digits: NVML
/// writes 8, CUDA 4), lower-cased with the domain at 4 digits when it fits.
fn normalize_pci(s: &str) -> Option<String> {
    let s = s.trim().trim_end_matches('\0');
    let (domain, rest) = s.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let num = |p: &str, max: usize| -> Option<u64> {
        if p.is_empty() || p.len() > max || !p.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(p, 16).ok()
    };
    let (d, b, dev, f) = (
        num(domain, 8)?,
        num(bus, 2)?,
        num(device, 2)?,
        num(function, 1)?,
    );
    Some(format!("{d:04x}:{b:02x}:{dev:02x}.{f:x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_spellings_of_one_device_agree() {
        let a = DeviceIdentity::named("cuda", "x").with_pci_bus_id("0000:65:00.0");
        let b = DeviceIdentity::named("nvml", "y").with_pci_bus_id("00000000:65:00.0");
        let c = DeviceIdentity::named("hip", "z").with_pci_bus_id("0000:65:00.0\0\0");
        assert_eq!(a.key(), "pci-0000:65:00.0");
        assert_eq!(a.key(), b.key());
        assert_eq!(a.key(), c.key());
    }

    #[test]
    fn malformed_pci_addresses_are_ignored() {
        for bad in [
            "",
            "65:00.0",
            "0000:65:00",
            "0000:6g:00.0",
            "0000:165:00.0",
            "x:y:z.w",
        ] {
            let id = DeviceIdentity::named("cuda", "dev 0").with_pci_bus_id(bad);
            assert_eq!(id.pci_bus_id(), None, "{bad:?} was accepted");
            assert_eq!(id.key(), "cuda-dev-0");
        }
    }

    #[test]
    fn keys_parse_back() {
        let u = [0xab; 16];
        let id = DeviceIdentity::named("cuda", "x")
            .with_uuid(u)
            .with_pci_bus_id("0000:01:00.0");
        assert_eq!(DeviceIdentity::from_key(&id.key()).unwrap().uuid(), Some(u));
        let p = DeviceIdentity::named("hip", "x").with_pci_bus_id("0000:01:00.0");
        let back = DeviceIdentity::from_key(&p.key()).unwrap();
        assert_eq!(back.pci_bus_id(), Some("0000:01:00.0"));
        assert_eq!(back.uuid(), None);
        assert!(DeviceIdentity::from_key("host-host-0").is_none());
        assert!(DeviceIdentity::from_key("gpu-1234").is_none());
    }

    #[test]
    fn keys_hold_only_file_name_characters() {
        let k = DeviceIdentity::named("vulkan", "llvmpipe (LLVM 15.0.6, 256 bits)/x").key();
        assert!(
            k.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c)),
            "{k}"
        );
    }
}
