//! Per-process device memory from the vendor's management library, loaded
//! at run time: NVML (`libnvidia-ml.so.1`, shipped with the NVIDIA driver).
//!
//! The driver's free/total says *how much* of a device is used outside
//! memgov; the management library says *by whom*. A process on the device
//! that has no slot in the machine ledger is outside memgov: what NVML
//! reports for it is kept from what the ledger admits (see
//! [`MachineLedger::observe_processes`](super::MachineLedger::observe_processes))
//! and named in `memgov top`.
//!
//! The library is opened once per process and stays loaded (NVML is
//! initialised once, `nvmlInit_v2`, and never shut down: other code in the
//! process may use it too, and NVML counts initialisations). Nothing here
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
    /// The library that answered (`"nvml"`).
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
    #[error("skipped: no {library} ({why}); per-process figures need the vendor's management library (libnvidia-ml.so.1 comes with the NVIDIA driver); the ledger still sees outside memory through the driver's free/total")]
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
}

/// The processes on the device `identity` names, from NVML.
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
    let nvml = nvml()?;
    nvml.processes(identity)
}

const NVML: &str = "libnvidia-ml.so.1";
const NVML_SUCCESS: c_int = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: c_int = 7;
/// `usedGpuMemory` when NVML cannot say.
const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;

type NvmlDevice = *mut c_void;

/// `nvmlProcessInfo_t` as the `_v3` queries fill it (NVML 11.x and later).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type Init = unsafe extern "C" fn() -> c_int;
type ByString = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int;
type Running = unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut ProcessInfo) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

struct Nvml {
    by_uuid: ByString,
    by_pci: ByString,
    compute: Running,
    graphics: Option<Running>,
    error_string: Option<ErrorString>,
}

fn nvml() -> Result<&'static Nvml, ManagementError> {
    static NVML_LIB: OnceLock<Result<Nvml, ManagementError>> = OnceLock::new();
    NVML_LIB.get_or_init(load_nvml).as_ref().map_err(Clone::clone)
}

fn load_nvml() -> Result<Nvml, ManagementError> {
    let unavailable = |why: String| ManagementError::Unavailable {
        library: NVML,
        why,
    };
    let name = CString::new(NVML).expect("no NUL in the library name");
    // SAFETY: dlopen with a valid NUL-terminated name; the handle is never
    // closed, so every symbol taken from it stays valid for the process's
    // life.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated string owned by libc, or
        // null; it is copied at once.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "dlopen failed".to_owned()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(unavailable(why));
    }
    let sym = |s: &str| -> Option<*mut c_void> {
        let c = CString::new(s).expect("no NUL in a symbol name");
        // SAFETY: a live handle and a valid NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let need = |s: &str| sym(s).ok_or_else(|| unavailable(format!("{NVML} has no {s}")));
    let init = need("nvmlInit_v2")?;
    let by_uuid = need("nvmlDeviceGetHandleByUUID")?;
    let by_pci = need("nvmlDeviceGetHandleByPciBusId_v2")?;
    let compute = need("nvmlDeviceGetComputeRunningProcesses_v3")?;
    // SAFETY: each symbol is the NVML function of that name, whose C
    // signature is the function type it is cast to (NVML's nvml.h); a data
    // pointer and a function pointer have one size on every target memgov
    // builds for.
    let nvml = unsafe {
        Nvml {
            by_uuid: std::mem::transmute::<*mut c_void, ByString>(by_uuid),
            by_pci: std::mem::transmute::<*mut c_void, ByString>(by_pci),
            compute: std::mem::transmute::<*mut c_void, Running>(compute),
            graphics: sym("nvmlDeviceGetGraphicsRunningProcesses_v3")
                .map(|p| std::mem::transmute::<*mut c_void, Running>(p)),
            error_string: sym("nvmlErrorString")
                .map(|p| std::mem::transmute::<*mut c_void, ErrorString>(p)),
        }
    };
    // SAFETY: nvmlInit_v2 takes no arguments and may be called from any
    // thread, any number of times (NVML counts them).
    let init: Init = unsafe { std::mem::transmute::<*mut c_void, Init>(init) };
    // SAFETY: as above.
    let r = unsafe { init() };
    if r != NVML_SUCCESS {
        return Err(unavailable(format!(
            "nvmlInit_v2 returned {r} ({})",
            nvml.message(r)
        )));
    }
    Ok(nvml)
}

// SAFETY: the struct holds plain function pointers into a library that is
// never unloaded; NVML's functions are thread-safe.
unsafe impl Send for Nvml {}
// SAFETY: as above.
unsafe impl Sync for Nvml {}

impl Nvml {
    fn message(&self, code: c_int) -> String {
        match self.error_string {
            Some(f) => {
                // SAFETY: nvmlErrorString returns a static NUL-terminated
                // string for any code (or null, handled).
                let p = unsafe { f(code) };
                if p.is_null() {
                    "no description".to_owned()
                } else {
                    // SAFETY: non-null, NUL-terminated, static.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            None => "no description".to_owned(),
        }
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

    fn device(&self, id: &DeviceIdentity) -> Result<NvmlDevice, ManagementError> {
        let (function, f, arg) = match (id.uuid_string(), id.pci_bus_id()) {
            (Some(u), _) => ("nvmlDeviceGetHandleByUUID", self.by_uuid, u),
            (None, Some(p)) => ("nvmlDeviceGetHandleByPciBusId_v2", self.by_pci, p.to_owned()),
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

    /// One of the `_v3` running-process lists: ask with room for what was
    /// there last time plus some, grow on `NVML_ERROR_INSUFFICIENT_SIZE`
    /// (processes come and go between calls), at most a few times.
    fn list(
        &self,
        function: &'static str,
        f: Running,
        dev: NvmlDevice,
        id: &DeviceIdentity,
    ) -> Result<Vec<ProcessInfo>, ManagementError> {
        let mut room: c_uint = 32;
        for _ in 0..8 {
            let mut infos = vec![ProcessInfo::default(); room as usize];
            let mut count = room;
            // SAFETY: `infos` has `count` elements of NVML's
            // nvmlProcessInfo_t layout; `dev` came from NVML.
            let r = unsafe { f(dev, &mut count, infos.as_mut_ptr()) };
            match r {
                NVML_SUCCESS => {
                    infos.truncate((count as usize).min(room as usize));
                    return Ok(infos);
                }
                NVML_ERROR_INSUFFICIENT_SIZE => room = count.max(room).saturating_mul(2),
                _ => return Err(self.fail(function, r, id)),
            }
        }
        Err(self.fail(function, NVML_ERROR_INSUFFICIENT_SIZE, id))
    }

    fn processes(&self, id: &DeviceIdentity) -> Result<DeviceProcesses, ManagementError> {
        let dev = self.device(id)?;
        let mut all = self.list("nvmlDeviceGetComputeRunningProcesses_v3", self.compute, dev, id)?;
        if let Some(g) = self.graphics {
            all.extend(self.list("nvmlDeviceGetGraphicsRunningProcesses_v3", g, dev, id)?);
        }
        let mut processes: Vec<DeviceProcess> = Vec::new();
        for info in all {
            let bytes =
                (info.used_gpu_memory != NVML_VALUE_NOT_AVAILABLE).then_some(info.used_gpu_memory);
            match processes.iter_mut().find(|p| p.pid == info.pid) {
                Some(p) => p.bytes = p.bytes.max(bytes),
                None => processes.push(DeviceProcess {
                    pid: info.pid,
                    bytes,
                }),
            }
        }
        processes.sort_by_key(|p| p.pid);
        Ok(DeviceProcesses {
            library: "nvml",
            processes,
        })
    }
}
