//! Allocator entry points in the shapes runtimes load by name: PyTorch's
//! `CUDAPluggableAllocator` pair and ONNX Runtime's `OrtAllocator`.

use crate::ffi::*;
use crate::objects::{allocate, device_ptr_of, release, role_from, StreamObj};
use crate::plugin::{charge, created_ort, Charge, PluginObj, What};
use crate::registry::lock;
use crate::status::*;
use crate::{get, memgov_plugin, memgov_stream, put};
use memgov::Role;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

// ----------------------------------------------------------------- PyTorch

struct TorchDevice {
    default: Arc<StreamObj>,
    by_raw: HashMap<usize, Arc<StreamObj>>,
    role: Role,
}

#[derive(Default)]
struct Torch {
    devices: HashMap<i32, TorchDevice>,
    /// Address → buffer handle id, of every live allocation.
    live: HashMap<usize, u64>,
}

fn torch() -> &'static Mutex<Torch> {
    static TORCH: OnceLock<Mutex<Torch>> = OnceLock::new();
    TORCH.get_or_init(|| Mutex::new(Torch::default()))
}

/// A device ordinal: zero or more.
fn check_device(device: i32) -> Result<()> {
    if device < 0 {
        return Err(Error::invalid(format!(
            "device {device} is negative; PyTorch's device ordinals start at 0"
        )));
    }
    Ok(())
}

/// Route PyTorch's allocations for `device` to `default_stream`'s context:
/// allocations on streams not mapped with `memgov_torch_map_stream` go to
/// `default_stream`, under `role`. Replaces an earlier configuration of the
/// device (its stream mappings too). A negative device is
/// `MEMGOV_ERR_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn memgov_torch_configure(
    device: i32,
    default_stream: *mut memgov_stream,
    role: u32,
) -> i32 {
    guard("memgov_torch_configure", || {
        check_device(device)?;
        let s = get::<StreamObj, _>(default_stream)?;
        let role = role_from(role)?;
        let old = lock(torch()).devices.insert(
            device,
            TorchDevice {
                default: s,
                by_raw: HashMap::new(),
                role,
            },
        );
        // Streams dropped outside the lock.
        drop(old);
        Ok(())
    })
}

/// Map PyTorch's raw stream `raw_stream` (a `cudaStream_t`) on `device` to a
/// memgov stream of the same context: allocations requested on it are
/// allocated on `stream`, and frees requested on it are released on it.
#[no_mangle]
pub extern "C" fn memgov_torch_map_stream(
    device: i32,
    raw_stream: *mut c_void,
    stream: *mut memgov_stream,
) -> i32 {
    guard("memgov_torch_map_stream", || {
        check_device(device)?;
        let s = get::<StreamObj, _>(stream)?;
        let mut t = lock(torch());
        let Some(d) = t.devices.get_mut(&device) else {
            return Err(Error::invalid(format!(
                "device {device} is not configured; call memgov_torch_configure first"
            )));
        };
        if s.stream.context() != d.default.stream.context() {
            return Err(Error::invalid(
                "the stream belongs to another context than the device's default stream",
            ));
        }
        let old = d.by_raw.insert(raw_stream as usize, s);
        drop(t);
        drop(old);
        Ok(())
    })
}

/// Forget every device configuration. Refused with `MEMGOV_ERR_BUSY` while
/// allocations made through `memgov_torch_alloc` are live. The streams the
/// configuration held are let go (they pin their contexts until then).
#[no_mangle]
pub extern "C" fn memgov_torch_reset() -> i32 {
    guard("memgov_torch_reset", || {
        let mut t = lock(torch());
        if !t.live.is_empty() {
            return Err(Error::new(
                MEMGOV_ERR_BUSY,
                format!(
                    "{} allocation(s) made through memgov_torch_alloc are live; free them first",
                    t.live.len()
                ),
            ));
        }
        let devices = std::mem::take(&mut t.devices);
        drop(t);
        drop(devices);
        Ok(())
    })
}

fn pick(device: i32, raw_stream: *mut c_void) -> Result<(Arc<StreamObj>, Role, bool)> {
    let t = lock(torch());
    let d = t.devices.get(&device).ok_or_else(|| {
        Error::invalid(format!(
            "device {device} is not configured; call memgov_torch_configure first"
        ))
    })?;
    Ok(match d.by_raw.get(&(raw_stream as usize)) {
        Some(s) => (s.clone(), d.role, true),
        None => (d.default.clone(), d.role, false),
    })
}

/// PyTorch's `CUDAPluggableAllocator` allocation function:
/// `torch.cuda.memory.CUDAPluggableAllocator(path, "memgov_torch_alloc",
/// "memgov_torch_free")`. Returns NULL on failure (the thread's message says
/// why), which PyTorch reports as out of memory.
#[no_mangle]
pub extern "C" fn memgov_torch_alloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
    guard_value("memgov_torch_alloc", std::ptr::null_mut(), || {
        let bytes = u64::try_from(size)
            .ok()
            .filter(|b| *b > 0)
            .ok_or_else(|| Error::invalid(format!("size {size} is not positive")))?;
        let (s, role, _) = pick(device, stream)?;
        // Named for attribution: every PyTorch tensor comes through here.
        let h = allocate(&s, bytes, role, None, Some("pytorch (memgov_torch_alloc)"))?;
        let p = match device_ptr_of(h) {
            Ok(p) => p,
            Err(e) => {
                let _ = release(h, None);
                return Err(e);
            }
        };
        lock(torch()).live.insert(p as usize, h);
        Ok(p)
    })
}

/// PyTorch's `CUDAPluggableAllocator` free function. Releases the memory
/// stream-ordered on `stream` when it is mapped (after the allocation's own
/// stream), else on the allocation's own stream. An unknown pointer is
/// ignored (the thread's message says so).
#[no_mangle]
pub extern "C" fn memgov_torch_free(
    ptr: *mut c_void,
    _size: isize,
    device: i32,
    stream: *mut c_void,
) {
    guard_value("memgov_torch_free", (), || {
        if ptr.is_null() {
            return Ok(());
        }
        let h = lock(torch()).live.remove(&(ptr as usize)).ok_or_else(|| {
            Error::invalid(format!(
                "{ptr:p} was not allocated by memgov_torch_alloc (or was freed already)"
            ))
        })?;
        let on = pick(device, stream)
            .ok()
            .and_then(|(s, _, mapped)| mapped.then_some(s));
        release(h, on.as_deref())
    })
}

// ------------------------------------------------------------ ONNX Runtime

/// A `memgov_ort_allocator` with memgov's state after the public members.
/// Only its address is ever used to find the state: memgov never reads
/// through a pointer a caller hands it before finding it in [`ort`].
#[repr(C)]
struct OrtBox {
    public: memgov_ort_allocator,
}

struct OrtState {
    stream: Arc<StreamObj>,
    role: Role,
    info: usize,
    plugin: Option<Arc<PluginObj>>,
    live: Mutex<HashMap<usize, u64>>,
    _charge: Option<Charge>,
}

fn ort() -> &'static Mutex<HashMap<usize, Arc<OrtState>>> {
    static ORT: OnceLock<Mutex<HashMap<usize, Arc<OrtState>>>> = OnceLock::new();
    ORT.get_or_init(|| Mutex::new(HashMap::new()))
}

fn ort_state(this: *const memgov_ort_allocator) -> Result<Arc<OrtState>> {
    lock(ort()).get(&(this as usize)).cloned().ok_or_else(|| {
        Error::new(
            MEMGOV_ERR_INVALID_HANDLE,
            format!("{this:p} is not a live memgov_ort_allocator"),
        )
    })
}

fn ort_alloc_role(
    this: *mut memgov_ort_allocator,
    size: usize,
    role: Option<Role>,
) -> Result<*mut c_void> {
    let st = ort_state(this)?;
    let bytes = u64::try_from(size)
        .ok()
        .filter(|b| *b > 0)
        .ok_or_else(|| Error::invalid("size 0"))?;
    // Named for attribution: every ONNX Runtime allocation comes through
    // here.
    let h = allocate(
        &st.stream,
        bytes,
        role.unwrap_or(st.role),
        st.plugin.as_ref(),
        Some("onnxruntime (memgov OrtAllocator)"),
    )?;
    let p = match device_ptr_of(h) {
        Ok(p) => p,
        Err(e) => {
            let _ = release(h, None);
            return Err(e);
        }
    };
    lock(&st.live).insert(p as usize, h);
    Ok(p)
}

unsafe extern "C" fn ort_alloc(this: *mut memgov_ort_allocator, size: usize) -> *mut c_void {
    guard_value("OrtAllocator::Alloc", std::ptr::null_mut(), || {
        ort_alloc_role(this, size, None)
    })
}

unsafe extern "C" fn ort_reserve(this: *mut memgov_ort_allocator, size: usize) -> *mut c_void {
    guard_value("OrtAllocator::Reserve", std::ptr::null_mut(), || {
        ort_alloc_role(this, size, Some(Role::Weights))
    })
}

unsafe extern "C" fn ort_free(this: *mut memgov_ort_allocator, p: *mut c_void) {
    guard_value("OrtAllocator::Free", (), || {
        if p.is_null() {
            return Ok(());
        }
        let st = ort_state(this)?;
        let h = lock(&st.live)
            .remove(&(p as usize))
            .ok_or_else(|| Error::invalid(format!("{p:p} was not allocated by this allocator")))?;
        release(h, None)
    })
}

unsafe extern "C" fn ort_info(this: *const memgov_ort_allocator) -> *const c_void {
    guard_value("OrtAllocator::Info", std::ptr::null(), || {
        Ok(ort_state(this)?.info as *const c_void)
    })
}

/// An `OrtAllocator` (cast the result to `OrtAllocator*`) that allocates on
/// `stream` under `role` (`Reserve`: `MEMGOV_ROLE_WEIGHTS`); `Info` returns
/// `ort_memory_info` (an `OrtMemoryInfo*` the caller created with ORT's API
/// and keeps alive). Counted against `plugin` (may be NULL) until destroyed,
/// and so is every live allocation.
#[no_mangle]
pub unsafe extern "C" fn memgov_ort_allocator_create(
    stream: *mut memgov_stream,
    role: u32,
    ort_memory_info: *const c_void,
    plugin: *mut memgov_plugin,
    out: *mut *mut memgov_ort_allocator,
) -> i32 {
    guard("memgov_ort_allocator_create", || {
        let s = get::<StreamObj, _>(stream)?;
        let role = role_from(role)?;
        let plugin = if plugin.is_null() {
            None
        } else {
            Some(get::<PluginObj, _>(plugin)?)
        };
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let charge = charge(plugin.as_ref(), What::Allocator)?;
        let b = Box::into_raw(Box::new(OrtBox {
            public: memgov_ort_allocator {
                version: MEMGOV_ORT_ALLOCATOR_VERSION,
                Alloc: Some(ort_alloc),
                Free: Some(ort_free),
                Info: Some(ort_info),
                Reserve: Some(ort_reserve),
            },
        }));
        let state = Arc::new(OrtState {
            stream: s,
            role,
            info: ort_memory_info as usize,
            plugin: plugin.clone(),
            live: Mutex::new(HashMap::new()),
            _charge: charge,
        });
        lock(ort()).insert(b as usize, state);
        created_ort(plugin.as_ref(), b as usize);
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, b.cast::<memgov_ort_allocator>()) }
    })
}

/// Destroy an allocator made by `memgov_ort_allocator_create`. Refused with
/// `MEMGOV_ERR_BUSY` while allocations from it are live (ONNX Runtime frees
/// them when it releases its sessions and values).
#[no_mangle]
pub unsafe extern "C" fn memgov_ort_allocator_destroy(allocator: *mut memgov_ort_allocator) -> i32 {
    guard("memgov_ort_allocator_destroy", || {
        let mut map = lock(ort());
        let Some(st) = map.get(&(allocator as usize)) else {
            return Err(Error::new(
                MEMGOV_ERR_INVALID_HANDLE,
                format!("{allocator:p} is not a live memgov_ort_allocator"),
            ));
        };
        let live = lock(&st.live).len();
        if live > 0 {
            return Err(Error::new(
                MEMGOV_ERR_BUSY,
                format!("{live} allocation(s) from this allocator are live; free them first"),
            ));
        }
        let st = map.remove(&(allocator as usize));
        drop(map);
        // SAFETY: the address was found in the map, so it is a box this
        // library made with `Box::into_raw` and has not freed (removed from
        // the map just now, under its lock: freed once).
        drop(unsafe { Box::from_raw(allocator.cast::<OrtBox>()) });
        drop(st);
        Ok(())
    })
}

/// Destroy an allocator whose plugin's init failed, live allocations or
/// not: the allocations' buffers are released by the caller (they were
/// created for the same plugin).
pub(crate) fn ort_discard(allocator: usize) {
    let Some(st) = lock(ort()).remove(&allocator) else {
        return;
    };
    // SAFETY: the address was in the map, so it is a box this library made
    // with `Box::into_raw` and has not freed; removed from the map just now,
    // under its lock: freed once.
    drop(unsafe { Box::from_raw(allocator as *mut OrtBox) });
    drop(st);
}
