//! Per-process device memory from the vendor's management library, loaded
//! at run time: NVML (`libnvidia-ml.so.1`, shipped with the NVIDIA driver)
//! and ROCm SMI (`librocm_smi64`, shipped with ROCm).
//!
//! The driver's free/total says *how much* of a device is used outside
//! memgov; the management library says *by whom*. A process on the device
//! that has no slot in the machine ledger is outside memgov: what NVML
//! reports for it is kept from what the ledger admits (see
//! [`MachineLedger::observe_processes`](super::MachineLedger::observe_processes))
//! and named in `memgov top`.
//!
//! Each library is opened once per process and stays loaded (initialised
//! once, `nvmlInit_v2` / `rsmi_init`, and never shut down: other code in
//! the process may use it too, and both count initialisations). NVML finds
//! a device by UUID or PCI address, ROCm SMI by PCI address; a HIP device
//! is asked of ROCm SMI first, any other of NVML first, and the other
//! library is asked when the first is missing or does not know the device.
//! NVML's process lists are read in the entry layout the driver writes (16,
//! 24 or 32 bytes: [`v3_entry`] says how it is chosen) from a buffer with
//! room for the largest, and a count, a pid or bytes written that cannot be
//! true make the whole answer an error ([`ManagementError::Implausible`]),
//! never an allocation size or a process. Nothing here
//! is needed for the ledger to work: without the library, per-process
//! figures are simply not there, and [`device_processes`] says why.

use crate::DeviceIdentity;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

/// One process using the device, as the management library reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DeviceProcess {
    /// Its pid (in the management library's pid namespace: the host's, for
    /// NVML, which a process in a container does not see as its own).
    pub pid: u32,
    /// Device bytes it uses; `None` where the library cannot say (NVML's
    /// `NVML_VALUE_NOT_AVAILABLE`, e.g. without the rights to look).
    pub bytes: Option<u64>,
}

/// Every process on one device, from one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProcesses {
    /// The library that answered (`"nvml"`, `"rocm-smi"`).
    pub library: &'static str,
    /// The processes, one entry per pid (a process in both NVML's compute
    /// and graphics lists is counted once, with the larger figure).
    pub processes: Vec<DeviceProcess>,
}

/// Why per-process figures are not available.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ManagementError {
    /// The library is not there, or lacks a function this needs.
    #[error("skipped: no {library} ({why}); per-process figures need the vendor's management library (libnvidia-ml.so.1 comes with the NVIDIA driver, librocm_smi64 with ROCm); the ledger still sees outside memory through the driver's free/total")]
    Unavailable {
        /// The library's file name.
        library: &'static str,
        /// What failed: the load, or the missing symbol.
        why: String,
    },
    /// The device has neither a UUID nor a PCI address, so the library
    /// cannot be asked about it.
    #[error("device {key} has neither a UUID nor a PCI address: a management library cannot look it up; per-process figures are only for devices the driver identifies")]
    Unidentified {
        /// The device's key.
        key: String,
    },
    /// A call failed.
    #[error("{library}: {function} returned {code} ({message}) for device {key}")]
    Call {
        /// The library.
        library: &'static str,
        /// The function.
        function: &'static str,
        /// Its return code.
        code: i64,
        /// The library's own text for the code.
        message: String,
        /// The device asked about.
        key: String,
    },
    /// The library answered something that cannot be true (a count beyond
    /// the room it was given or beyond any machine's processes, bytes
    /// written past the entries it counted, a pid no process has): nothing
    /// of that answer is used.
    #[error("{library}: {function} {what} for device {key}; its answer was not used: the library and the driver may be of different versions (reinstall the driver), or this memgov does not know this driver's layout (per-process figures stay off; the driver's free/total still counts)")]
    Implausible {
        /// The library.
        library: &'static str,
        /// The function.
        function: &'static str,
        /// What it answered.
        what: String,
        /// The device asked about.
        key: String,
    },
}

/// The processes on the device `identity` names, from NVML or ROCm SMI.
///
/// ```no_run
/// use memgov::machine::{device_processes, ManagementError};
/// # let identity = memgov::DeviceIdentity::named("cuda", "x").with_uuid([0; 16]);
/// match device_processes(&identity) {
///     Ok(found) => {
///         for p in &found.processes {
///             println!("pid {}: {:?} bytes", p.pid, p.bytes);
///         }
///     }
///     Err(e @ ManagementError::Unavailable { .. }) => println!("{e}"),
///     Err(e) => eprintln!("{e}"),
/// }
/// ```
pub fn device_processes(identity: &DeviceIdentity) -> Result<DeviceProcesses, ManagementError> {
    if identity.uuid().is_none() && identity.pci_bus_id().is_none() {
        return Err(ManagementError::Unidentified {
            key: identity.key(),
        });
    }
    let amd_first = identity.backend() == "hip";
    let asks: [Ask; 2] = if amd_first {
        [ask_rocm_smi, ask_nvml]
    } else {
        [ask_nvml, ask_rocm_smi]
    };
    let first = asks[0](identity);
    match &first {
        // The first library is missing, or does not know the device (or
        // cannot look it up: ROCm SMI has no UUIDs): the other may.
        Err(ManagementError::Unavailable { .. }) | Err(ManagementError::Unidentified { .. }) => {}
        Err(ManagementError::Call { code, library, .. })
            if (*library == "nvml" && *code == i64::from(NVML_ERROR_NOT_FOUND))
                || (*library == "rocm-smi" && *code == RSMI_NOT_FOUND) => {}
        _ => return first,
    }
    match asks[1](identity) {
        Ok(found) => Ok(found),
        // Neither library is there: say so for both.
        Err(ManagementError::Unavailable { why, .. })
            if matches!(first, Err(ManagementError::Unavailable { .. })) =>
        {
            let Err(ManagementError::Unavailable { why: first_why, .. }) = first else {
                unreachable!()
            };
            Err(ManagementError::Unavailable {
                library: if amd_first {
                    "librocm_smi64 or libnvidia-ml.so.1"
                } else {
                    "libnvidia-ml.so.1 or librocm_smi64"
                },
                why: format!("{first_why}; {why}"),
            })
        }
        Err(ManagementError::Unavailable { .. }) | Err(ManagementError::Unidentified { .. }) => {
            first
        }
        Err(e) => Err(e),
    }
}

/// One library's query.
type Ask = fn(&DeviceIdentity) -> Result<DeviceProcesses, ManagementError>;

fn ask_nvml(identity: &DeviceIdentity) -> Result<DeviceProcesses, ManagementError> {
    nvml()?.processes(identity)
}

fn ask_rocm_smi(identity: &DeviceIdentity) -> Result<DeviceProcesses, ManagementError> {
    let Some(bus) = identity.pci_bus_id() else {
        return Err(ManagementError::Unidentified {
            key: identity.key(),
        });
    };
    rocm_smi()?.processes(bus, identity)
}

/// Open the first of `names` that loads; its handle is never closed.
fn open_library(names: &[&str]) -> Result<*mut c_void, String> {
    let mut whys = Vec::new();
    for name in names {
        let c = CString::new(*name).expect("no NUL in a library name");
        // SAFETY: dlopen with a valid NUL-terminated name; the handle is
        // never closed, so every symbol taken from it stays valid for the
        // process's life.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            return Ok(handle);
        }
        // SAFETY: dlerror returns a NUL-terminated string owned by libc, or
        // null; it is copied at once.
        whys.push(unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                format!("{name}: dlopen failed")
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        });
    }
    Err(whys.join("; "))
}

/// The symbol `name` of `handle`, or `None`.
fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).expect("no NUL in a symbol name");
    // SAFETY: a live handle (never closed) and a valid NUL-terminated name.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    (!p.is_null()).then_some(p)
}

const NVML: &str = "libnvidia-ml.so.1";
const NVML_SUCCESS: c_int = 0;
const NVML_ERROR_NOT_FOUND: c_int = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: c_int = 7;
const NVML_ERROR_FUNCTION_NOT_FOUND: c_int = 13;
/// `usedGpuMemory` when NVML cannot say.
const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;
/// `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE` (nvml.h).
const DRIVER_VERSION_BYTES: usize = 80;
/// The largest entry any NVML writes in a running-process list: every
/// buffer handed to NVML has this much room per entry, whichever layout it
/// is read with, so a wrong guess of the layout cannot make it write past
/// the buffer.
const LARGEST_ENTRY: usize = 32;
/// The most processes a list is read with. A count above it is not
/// believed (and never becomes an allocation size).
const MOST_PROCESSES: u32 = 4096;
/// The largest pid (`pid_t` is a signed 32-bit int): a pid above it, or
/// pid 0, is not a process.
const PID_MAX: u32 = i32::MAX as u32;

type NvmlDevice = *mut c_void;

type Init = unsafe extern "C" fn() -> c_int;
type ByString = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int;
/// Every running-process list, whatever its entry layout: the entries are
/// written to the untyped buffer.
type Running = unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut c_void) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type DriverVersion = unsafe extern "C" fn(*mut c_char, c_uint) -> c_int;

/// One running-process list function and the size of the entries it
/// writes. Every layout starts `pid: u32` at 0 and `usedGpuMemory: u64` at
/// 8: `nvmlProcessInfo_v1_t` (16 bytes) stops there, `nvmlProcessInfo_v2_t`
/// (24) adds the MIG instance ids, and the R535 branch's `_v3` entry (32)
/// adds `usedGpuCcProtectedMemory`.
#[derive(Clone, Copy)]
struct List {
    name: &'static str,
    f: Running,
    entry: usize,
}

/// The entry size the `_v3` lists of this NVML write.
///
/// nvml.h of the R535 branch declared the `_v3` entry with an 8-byte
/// `usedGpuCcProtectedMemory` after the MIG ids (32 bytes); the branches
/// before and after it write 24. The R535 branch is also the first NVML
/// with the confidential-computing calls (`nvmlDeviceGetConfComputeMemSizeInfo`)
/// and precedes `nvmlDeviceGetRunningProcessDetailList` (R550), which is
/// how nvitop's `libnvml` tells these drivers apart: 32-byte entries where
/// the first symbol is there and the second is not. Here the driver
/// version NVML reports (`nvmlSystemGetDriverVersion`) decides when it can
/// be read, branches 535 to 549 writing 32 bytes; the symbols decide when
/// it cannot. Whatever is chosen, the buffer has room for 32-byte entries
/// and what NVML wrote past the entries it counted is checked
/// (`Nvml::list`).
fn v3_entry(driver_major: Option<u32>, conf_compute: bool, detail_list: bool) -> usize {
    let r535 = match driver_major {
        Some(major) => (535..550).contains(&major),
        None => conf_compute && !detail_list,
    };
    if r535 {
        32
    } else {
        24
    }
}

/// The major number of a driver version string (`"535.54.03"`: 535).
fn driver_major(version: &str) -> Option<u32> {
    let major = version.split('.').next()?;
    if major.is_empty() || major.len() > 4 || !major.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    major.parse().ok()
}

struct Nvml {
    by_uuid: ByString,
    by_pci: ByString,
    /// The compute lists, newest first: each is asked in turn while the
    /// one before answers `NVML_ERROR_FUNCTION_NOT_FOUND`.
    compute: Vec<List>,
    graphics: Vec<List>,
    error_string: Option<ErrorString>,
    /// The driver version NVML reported at load (`None`: unreadable).
    driver: Option<String>,
}

fn nvml() -> Result<&'static Nvml, ManagementError> {
    static NVML_LIB: OnceLock<Result<Nvml, ManagementError>> = OnceLock::new();
    NVML_LIB
        .get_or_init(load_nvml)
        .as_ref()
        .map_err(Clone::clone)
}

fn load_nvml() -> Result<Nvml, ManagementError> {
    let unavailable = |why: String| ManagementError::Unavailable { library: NVML, why };
    let handle = open_library(&[NVML]).map_err(unavailable)?;
    let sym = |s: &str| symbol(handle, s);
    let need = |s: &str| sym(s).ok_or_else(|| unavailable(format!("{NVML} has no {s}")));
    let init = need("nvmlInit_v2")?;
    let by_uuid = need("nvmlDeviceGetHandleByUUID")?;
    let by_pci = need("nvmlDeviceGetHandleByPciBusId_v2")?;
    // SAFETY: the symbol is nvmlInit_v2, `nvmlReturn_t nvmlInit_v2(void)`.
    let init: Init = unsafe { std::mem::transmute::<*mut c_void, Init>(init) };
    // SAFETY: nvmlInit_v2 takes no arguments and may be called from any
    // thread, any number of times (NVML counts them).
    let r = unsafe { init() };
    // SAFETY: nvmlErrorString is `const char *nvmlErrorString(nvmlReturn_t)`.
    let error_string = sym("nvmlErrorString")
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, ErrorString>(p) });
    if r != NVML_SUCCESS {
        return Err(unavailable(format!(
            "nvmlInit_v2 returned {r} ({})",
            message(error_string, r)
        )));
    }
    let driver = sym("nvmlSystemGetDriverVersion").and_then(|p| {
        // SAFETY: the symbol is `nvmlReturn_t
        // nvmlSystemGetDriverVersion(char *version, unsigned int length)`.
        let f = unsafe { std::mem::transmute::<*mut c_void, DriverVersion>(p) };
        let mut buf = [0u8; DRIVER_VERSION_BYTES];
        // SAFETY: `buf` has `DRIVER_VERSION_BYTES` writable bytes and NVML
        // is told so; it writes at most that many.
        let r = unsafe { f(buf.as_mut_ptr().cast(), DRIVER_VERSION_BYTES as c_uint) };
        // Only what ends in a NUL inside the buffer is a string.
        (r == NVML_SUCCESS)
            .then(|| CStr::from_bytes_until_nul(&buf).ok())
            .flatten()
            .and_then(|c| c.to_str().ok())
            .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_graphic()))
            .map(str::to_owned)
    });
    let entry_v3 = v3_entry(
        driver.as_deref().and_then(driver_major),
        sym("nvmlDeviceGetConfComputeMemSizeInfo").is_some(),
        sym("nvmlDeviceGetRunningProcessDetailList").is_some(),
    );
    let lists = |base: &'static [&'static str; 3]| -> Vec<List> {
        [(base[0], entry_v3), (base[1], 24), (base[2], 16)]
            .into_iter()
            .filter_map(|(name, entry)| {
                sym(name).map(|p| List {
                    name,
                    // SAFETY: every running-process list is `nvmlReturn_t
                    // f(nvmlDevice_t, unsigned int *infoCount, <entry> *infos)`;
                    // the entries are written through the untyped pointer,
                    // whose buffer always has room for LARGEST_ENTRY bytes
                    // per entry counted.
                    f: unsafe { std::mem::transmute::<*mut c_void, Running>(p) },
                    entry,
                })
            })
            .collect()
    };
    let compute = lists(&[
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    ]);
    if compute.is_empty() {
        return Err(unavailable(format!(
            "{NVML} has no nvmlDeviceGetComputeRunningProcesses (_v3, _v2 or unversioned)"
        )));
    }
    let graphics = lists(&[
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ]);
    // SAFETY: each symbol is the NVML function of that name, whose C
    // signature is the function type it is cast to (NVML's nvml.h); a data
    // pointer and a function pointer have one size on every target memgov
    // builds for.
    let (by_uuid, by_pci) = unsafe {
        (
            std::mem::transmute::<*mut c_void, ByString>(by_uuid),
            std::mem::transmute::<*mut c_void, ByString>(by_pci),
        )
    };
    Ok(Nvml {
        by_uuid,
        by_pci,
        compute,
        graphics,
        error_string,
        driver,
    })
}

// SAFETY: the struct holds plain function pointers into a library that is
// never unloaded; NVML's functions are thread-safe.
unsafe impl Send for Nvml {}
// SAFETY: as above.
unsafe impl Sync for Nvml {}

/// NVML's own text for `code` (`nvmlErrorString`), or a placeholder when
/// there is none or it answers NULL.
fn message(error_string: Option<ErrorString>, code: c_int) -> String {
    let Some(f) = error_string else {
        return "no description".to_owned();
    };
    // SAFETY: nvmlErrorString returns a static NUL-terminated string for
    // any code, or null (handled).
    let p = unsafe { f(code) };
    if p.is_null() {
        "no description".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        let text = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        text.chars().take(200).collect()
    }
}

impl Nvml {
    fn message(&self, code: c_int) -> String {
        message(self.error_string, code)
    }

    fn fail(&self, function: &'static str, code: c_int, id: &DeviceIdentity) -> ManagementError {
        ManagementError::Call {
            library: "nvml",
            function,
            code: i64::from(code),
            message: self.message(code),
            key: id.key(),
        }
    }

    fn implausible(
        &self,
        function: &'static str,
        what: String,
        id: &DeviceIdentity,
    ) -> ManagementError {
        ManagementError::Implausible {
            library: "nvml",
            function,
            what: match &self.driver {
                Some(v) => format!("{what} (driver {v})"),
                None => format!("{what} (driver version unknown)"),
            },
            key: id.key(),
        }
    }

    fn device(&self, id: &DeviceIdentity) -> Result<NvmlDevice, ManagementError> {
        let (function, f, arg) = match (id.uuid_string(), id.pci_bus_id()) {
            (Some(u), _) => ("nvmlDeviceGetHandleByUUID", self.by_uuid, u),
            (None, Some(p)) => (
                "nvmlDeviceGetHandleByPciBusId_v2",
                self.by_pci,
                p.to_owned(),
            ),
            (None, None) => unreachable!("device_processes checked the identity"),
        };
        let arg = CString::new(arg).expect("a UUID or PCI address has no NUL");
        let mut dev: NvmlDevice = std::ptr::null_mut();
        // SAFETY: a valid NUL-terminated string and a valid out pointer.
        let r = unsafe { f(arg.as_ptr(), &mut dev) };
        if r != NVML_SUCCESS {
            return Err(self.fail(function, r, id));
        }
        Ok(dev)
    }

    /// One kind of running-process list: the newest function this NVML
    /// implements (an older one where it answers
    /// `NVML_ERROR_FUNCTION_NOT_FOUND`).
    fn list_any(
        &self,
        lists: &[List],
        dev: NvmlDevice,
        id: &DeviceIdentity,
    ) -> Result<Vec<DeviceProcess>, ManagementError> {
        let mut last = None;
        for list in lists {
            match self.list(*list, dev, id) {
                Err(ManagementError::Call { code, .. })
                    if code == i64::from(NVML_ERROR_FUNCTION_NOT_FOUND) =>
                {
                    last = Some(list.name);
                }
                other => return other,
            }
        }
        Err(self.fail(
            last.unwrap_or("nvmlDeviceGetComputeRunningProcesses"),
            NVML_ERROR_FUNCTION_NOT_FOUND,
            id,
        ))
    }

    /// One running-process list: ask with room for some, grow on
    /// `NVML_ERROR_INSUFFICIENT_SIZE` (processes come and go between
    /// calls), at most a few times. The buffer has `LARGEST_ENTRY` bytes
    /// per entry of room whatever `list.entry` is, and is filled with a
    /// pattern first: a byte changed past the entries NVML counted means
    /// its entries are larger than thought, an error rather than a list
    /// read wrong. Counts above `MOST_PROCESSES`, or above the room on
    /// success, and pids that are no process's are errors too.
    fn list(
        &self,
        list: List,
        dev: NvmlDevice,
        id: &DeviceIdentity,
    ) -> Result<Vec<DeviceProcess>, ManagementError> {
        const PATTERN: u8 = 0xA5;
        let mut room: c_uint = 32;
        for _ in 0..8 {
            // u64 words: 8-aligned, as every entry layout needs.
            let words = room as usize * LARGEST_ENTRY / 8;
            let mut buf = vec![u64::from_ne_bytes([PATTERN; 8]); words];
            let mut count = room;
            // SAFETY: `buf` has room for `count` entries of the largest
            // layout any NVML writes (LARGEST_ENTRY bytes each), which the
            // function is told; `dev` came from NVML; `count` is a valid
            // out pointer.
            let r = unsafe { (list.f)(dev, &mut count, buf.as_mut_ptr().cast()) };
            match r {
                NVML_SUCCESS => {
                    if count > room {
                        return Err(self.implausible(
                            list.name,
                            format!("answered success with {count} processes in room for {room}"),
                            id,
                        ));
                    }
                    // SAFETY: plain bytes of the buffer NVML wrote into; the
                    // slice lives no longer than `buf`.
                    let bytes: &[u8] =
                        unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), words * 8) };
                    let used = count as usize * list.entry;
                    if let Some(at) = bytes[used..].iter().position(|&b| b != PATTERN) {
                        return Err(self.implausible(
                            list.name,
                            format!(
                                "wrote byte {} of a list it said holds {count} entries of {} bytes: its entries are larger",
                                used + at,
                                list.entry
                            ),
                            id,
                        ));
                    }
                    return bytes[..used]
                        .chunks_exact(list.entry)
                        .map(|e| {
                            let pid = u32::from_ne_bytes(e[0..4].try_into().expect("4 bytes"));
                            let used_gpu_memory =
                                u64::from_ne_bytes(e[8..16].try_into().expect("8 bytes"));
                            if pid == 0 || pid > PID_MAX {
                                return Err(self.implausible(
                                    list.name,
                                    format!("listed pid {pid}, which no process has (entries read as {} bytes)", list.entry),
                                    id,
                                ));
                            }
                            Ok(DeviceProcess {
                                pid,
                                bytes: (used_gpu_memory != NVML_VALUE_NOT_AVAILABLE)
                                    .then_some(used_gpu_memory),
                            })
                        })
                        .collect();
                }
                NVML_ERROR_INSUFFICIENT_SIZE => {
                    if count > MOST_PROCESSES {
                        return Err(self.implausible(
                            list.name,
                            format!("asked for room for {count} processes (at most {MOST_PROCESSES} are read)"),
                            id,
                        ));
                    }
                    // Room for what is there now and some that start
                    // before the next call.
                    room = count.max(room).saturating_add(16).min(MOST_PROCESSES);
                }
                _ => return Err(self.fail(list.name, r, id)),
            }
        }
        Err(self.fail(list.name, NVML_ERROR_INSUFFICIENT_SIZE, id))
    }

    fn processes(&self, id: &DeviceIdentity) -> Result<DeviceProcesses, ManagementError> {
        let dev = self.device(id)?;
        let mut all = self.list_any(&self.compute, dev, id)?;
        if !self.graphics.is_empty() {
            all.extend(self.list_any(&self.graphics, dev, id)?);
        }
        let mut processes: Vec<DeviceProcess> = Vec::new();
        for info in all {
            match processes.iter_mut().find(|p| p.pid == info.pid) {
                Some(p) => p.bytes = p.bytes.max(info.bytes),
                None => processes.push(info),
            }
        }
        processes.sort_by_key(|p| p.pid);
        Ok(DeviceProcesses {
            library: "nvml",
            processes,
        })
    }
}

// --- ROCm SMI ---

/// The names ROCm SMI's library goes by: ROCm 6 and 5, Debian's package.
const ROCM_SMI: [&str; 4] = [
    "librocm_smi64.so.7",
    "librocm_smi64.so.6",
    "librocm_smi64.so.5",
    "librocm_smi64.so.1",
];
/// `rsmi_status_t` values (rocm_smi.h).
const RSMI_SUCCESS: u32 = 0;
const RSMI_INVALID_ARGS: u32 = 1;
const RSMI_NOT_FOUND: i64 = 10;
const RSMI_INSUFFICIENT_SIZE: u32 = 11;

/// `rsmi_process_info_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RsmiProcess {
    process_id: u32,
    pasid: u32,
    vram_usage: u64,
    sdma_usage: u64,
    cu_occupancy: u32,
}

type RsmiInit = unsafe extern "C" fn(u64) -> u32;
type RsmiCount = unsafe extern "C" fn(*mut u32) -> u32;
type RsmiPciId = unsafe extern "C" fn(u32, *mut u64) -> u32;
type RsmiProcesses = unsafe extern "C" fn(*mut RsmiProcess, *mut u32) -> u32;
type RsmiByDevice = unsafe extern "C" fn(u32, u32, *mut RsmiProcess) -> u32;

struct RocmSmi {
    devices: RsmiCount,
    pci_id: RsmiPciId,
    processes: RsmiProcesses,
    by_device: RsmiByDevice,
}

// SAFETY: plain function pointers into a library that is never unloaded;
// ROCm SMI's functions are thread-safe (it serialises inside).
unsafe impl Send for RocmSmi {}
// SAFETY: as above.
unsafe impl Sync for RocmSmi {}

fn rocm_smi() -> Result<&'static RocmSmi, ManagementError> {
    static LIB: OnceLock<Result<RocmSmi, ManagementError>> = OnceLock::new();
    LIB.get_or_init(load_rocm_smi)
        .as_ref()
        .map_err(Clone::clone)
}

fn load_rocm_smi() -> Result<RocmSmi, ManagementError> {
    let unavailable = |why: String| ManagementError::Unavailable {
        library: "librocm_smi64",
        why,
    };
    let handle = open_library(&ROCM_SMI).map_err(unavailable)?;
    let need =
        |s: &str| symbol(handle, s).ok_or_else(|| unavailable(format!("librocm_smi64 has no {s}")));
    let init = need("rsmi_init")?;
    let devices = need("rsmi_num_monitor_devices")?;
    let pci_id = need("rsmi_dev_pci_id_get")?;
    let processes = need("rsmi_compute_process_info_get")?;
    let by_device = need("rsmi_compute_process_info_by_device_get")?;
    // SAFETY: each symbol is the ROCm SMI function of that name, whose C
    // signature (rocm_smi.h) is the function type it is cast to.
    let (init, lib) = unsafe {
        (
            std::mem::transmute::<*mut c_void, RsmiInit>(init),
            RocmSmi {
                devices: std::mem::transmute::<*mut c_void, RsmiCount>(devices),
                pci_id: std::mem::transmute::<*mut c_void, RsmiPciId>(pci_id),
                processes: std::mem::transmute::<*mut c_void, RsmiProcesses>(processes),
                by_device: std::mem::transmute::<*mut c_void, RsmiByDevice>(by_device),
            },
        )
    };
    // SAFETY: rsmi_init(0) may be called from any thread; ROCm SMI counts
    // initialisations.
    let r = unsafe { init(0) };
    if r != RSMI_SUCCESS {
        return Err(unavailable(format!("rsmi_init returned {r}")));
    }
    Ok(lib)
}

impl RocmSmi {
    fn fail(function: &'static str, code: u32, id: &DeviceIdentity) -> ManagementError {
        ManagementError::Call {
            library: "rocm-smi",
            function,
            code: i64::from(code),
            message: match code {
                1 => "invalid arguments",
                8 => "initialisation error",
                10 => "not found",
                11 => "insufficient size",
                _ => "see rsmi_status_t in rocm_smi.h",
            }
            .to_owned(),
            key: id.key(),
        }
    }

    /// The monitor index of the device at PCI address `bus`.
    fn device(&self, bus: &str, id: &DeviceIdentity) -> Result<u32, ManagementError> {
        let mut n = 0u32;
        // SAFETY: a valid out pointer.
        let r = unsafe { (self.devices)(&mut n) };
        if r != RSMI_SUCCESS {
            return Err(Self::fail("rsmi_num_monitor_devices", r, id));
        }
        for i in 0..n {
            let mut bdf = 0u64;
            // SAFETY: a valid out pointer; `i` below the count.
            let r = unsafe { (self.pci_id)(i, &mut bdf) };
            if r != RSMI_SUCCESS {
                return Err(Self::fail("rsmi_dev_pci_id_get", r, id));
            }
            // BDFID: domain in the high 32 bits, a partition in bits 28..32,
            // bus in 8..16, device in 3..8, function in 0..3.
            let spelled = format!(
                "{:04x}:{:02x}:{:02x}.{:x}",
                bdf >> 32,
                (bdf >> 8) & 0xff,
                (bdf >> 3) & 0x1f,
                bdf & 0x7
            );
            if spelled == bus {
                return Ok(i);
            }
        }
        Err(Self::fail("rsmi_dev_pci_id_get", RSMI_NOT_FOUND as u32, id))
    }

    fn processes(
        &self,
        bus: &str,
        id: &DeviceIdentity,
    ) -> Result<DeviceProcesses, ManagementError> {
        let dev = self.device(bus, id)?;
        // Every process using any GPU, then each one's figure on this one.
        let implausible = |function, what: String| ManagementError::Implausible {
            library: "rocm-smi",
            function,
            what,
            key: id.key(),
        };
        let mut all = Vec::new();
        for _ in 0..8 {
            let mut count = 0u32;
            // SAFETY: a NULL array asks for the count only.
            let r = unsafe { (self.processes)(std::ptr::null_mut(), &mut count) };
            if r != RSMI_SUCCESS {
                return Err(Self::fail("rsmi_compute_process_info_get", r, id));
            }
            if count > MOST_PROCESSES {
                return Err(implausible(
                    "rsmi_compute_process_info_get",
                    format!("counted {count} processes (at most {MOST_PROCESSES} are read)"),
                ));
            }
            let room = count + 8;
            all = vec![RsmiProcess::default(); room as usize];
            let mut n = room;
            // SAFETY: `all` has `n` elements of rocm_smi.h's layout.
            let r = unsafe { (self.processes)(all.as_mut_ptr(), &mut n) };
            match r {
                RSMI_SUCCESS if n > room => {
                    return Err(implausible(
                        "rsmi_compute_process_info_get",
                        format!("answered success with {n} processes in room for {room}"),
                    ));
                }
                RSMI_SUCCESS => {
                    all.truncate(n as usize);
                    break;
                }
                // Processes started between the two calls: ask again.
                RSMI_INSUFFICIENT_SIZE => all.clear(),
                _ => return Err(Self::fail("rsmi_compute_process_info_get", r, id)),
            }
        }
        if let Some(p) = all
            .iter()
            .find(|p| p.process_id == 0 || p.process_id > PID_MAX)
        {
            return Err(implausible(
                "rsmi_compute_process_info_get",
                format!("listed pid {}, which no process has", p.process_id),
            ));
        }
        let mut processes = Vec::new();
        for p in all {
            let mut info = RsmiProcess::default();
            // SAFETY: a valid out pointer; `dev` a monitor index.
            let r = unsafe { (self.by_device)(p.process_id, dev, &mut info) };
            match r {
                RSMI_SUCCESS => processes.push(DeviceProcess {
                    pid: p.process_id,
                    bytes: Some(info.vram_usage),
                }),
                // Not on this device (or gone since the list was read).
                RSMI_INVALID_ARGS => {}
                r if i64::from(r) == RSMI_NOT_FOUND => {}
                _ => return Err(Self::fail("rsmi_compute_process_info_by_device_get", r, id)),
            }
        }
        processes.sort_by_key(|p: &DeviceProcess| p.pid);
        processes.dedup_by_key(|p| p.pid);
        Ok(DeviceProcesses {
            library: "rocm-smi",
            processes,
        })
    }
}
