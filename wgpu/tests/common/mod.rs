//! What the tests share: opening a governed device on lavapipe with the
//! validation layer on (or saying `skipped:` why not), the matmul workload
//! run on governed buffers or on wgpu's own, and reading a buffer back.

#![allow(dead_code)]

use memgov::vulkan::VulkanContext;
use memgov::{ContextConfig, Governor, Role};
use memgov_wgpu::{Error, GovernedDevice, WgpuConfig};

/// Held for the whole of each test, so that the tests of one process open,
/// use and drop their Vulkan instances and devices one test at a time.
///
/// The validation layer this suite runs with (Debian 12's
/// `vulkan-validationlayers` 1.3.239) keeps process-wide state across
/// instances, and the loader unloads and reloads it whenever the last
/// instance of the process is destroyed. With tests running on parallel
/// threads, one test's wgpu device was once refused a shader module the
/// layer had just returned to wgpu itself: a `vkCreateComputePipelines`
/// and a `vkDestroyShaderModule` of wgpu's own internal pipeline, reported
/// by three of the layer's trackers as an unknown handle (its wrapped id,
/// 18, is one a layer counting from a fresh load hands out), while the same
/// test passed in 100 runs of the whole binary on parallel threads, half of
/// them two processes at a time. No call of memgov's is involved (memgov
/// creates no shader module), so the suite keeps the layer's cross-instance
/// races out of its verdict on memgov: every test here takes this lock
/// first. What the tests check
/// (governed buffers, releases after wgpu's submissions, refusals, swaps)
/// happens inside one test, on its own threads, as before.
pub fn one_test_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that panicked while holding it leaves nothing to repair.
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A governed device with validation on and `budget` bytes, or `None` with
/// `skipped: <why>` printed when this machine has no Vulkan driver or no
/// validation layer.
pub fn open(gov: &Governor<VulkanContext>, label: &str, budget: u64) -> Option<GovernedDevice> {
    open_with(gov, label, budget, true)
}

/// As [`open`], with the validation layer on or off.
pub fn open_with(
    gov: &Governor<VulkanContext>,
    label: &str,
    budget: u64,
    validation: bool,
) -> Option<GovernedDevice> {
    let config = WgpuConfig {
        validation,
        context: ContextConfig::new().label(label).budget(budget),
        ..WgpuConfig::default()
    };
    match GovernedDevice::open(gov, config) {
        Ok(d) => {
            if let Some(v) = d.validation() {
                v.set_print(true);
            }
            Some(d)
        }
        Err(e @ (Error::NoAdapter(_) | Error::Backend(_))) => {
            println!("skipped: {e}");
            None
        }
        Err(e) => panic!("opening the governed device: {e}"),
    }
}

/// Where the workload's storage buffers come from.
pub enum Alloc<'a> {
    /// wgpu's own allocator.
    Wgpu,
    /// memgov, through the governed device.
    Governed(&'a GovernedDevice),
}

/// A buffer of either kind, kept alive for the run.
pub enum Buf {
    Wgpu(wgpu::Buffer),
    Governed(memgov_wgpu::GovernedBuffer),
}

impl std::ops::Deref for Buf {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        match self {
            Buf::Wgpu(b) => b,
            Buf::Governed(b) => b,
        }
    }
}

pub fn storage(
    device: &wgpu::Device,
    alloc: &Alloc<'_>,
    label: &str,
    size: u64,
    role: Role,
) -> Result<Buf, Error> {
    let desc = wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::UNIFORM,
        mapped_at_creation: false,
    };
    match alloc {
        Alloc::Wgpu => Ok(Buf::Wgpu(device.create_buffer(&desc))),
        Alloc::Governed(g) => g.create_buffer(&desc, role).map(Buf::Governed),
    }
}

/// Copy `buffer` to a wgpu staging buffer, map it, and return its bytes.
pub fn read_back(device: &wgpu::Device, queue: &wgpu::Queue, buffer: &wgpu::Buffer) -> Vec<u8> {
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read back"),
        size: buffer.size(),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
    encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, buffer.size());
    queue.submit([encoder.finish()]);
    let slice = staging.slice(..);
    slice.map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    let bytes = slice.get_mapped_range().expect("mapped").to_vec();
    staging.unmap();
    bytes
}

/// A tiled single-precision matrix multiply, C = A x B, N x N, 8 x 8 tiles
/// in workgroup memory.
pub const MATMUL: &str = r#"
struct Dims { n: u32 }
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> dims: Dims;

var<workgroup> ta: array<array<f32, 8>, 8>;
var<workgroup> tb: array<array<f32, 8>, 8>;

@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    let n = dims.n;
    var acc = 0.0;
    for (var t = 0u; t < n; t = t + 8u) {
        ta[l.y][l.x] = a[g.y * n + t + l.x];
        tb[l.y][l.x] = b[(t + l.y) * n + g.x];
        workgroupBarrier();
        for (var k = 0u; k < 8u; k = k + 1u) {
            acc = fma(ta[l.y][k], tb[k][l.x], acc);
        }
        workgroupBarrier();
    }
    c[g.y * n + g.x] = acc;
}
"#;

/// The workload's inputs: deterministic, not round numbers.
pub fn inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..n * n)
        .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
        .collect();
    let b = (0..n * n)
        .map(|i| ((i * 104729) % 877) as f32 / 53.0 - 8.0)
        .collect();
    (a, b)
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The matmul's buffers, made once; `run` dispatches on them.
pub struct Matmul {
    pub n: u32,
    pub a: Buf,
    pub b: Buf,
    pub c: Buf,
    pub dims: Buf,
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
}

/// Bytes the workload's buffers take: A, B, C and the 4-byte dims (16 with
/// wgpu's alignment).
pub fn working_set(n: u32) -> u64 {
    3 * u64::from(n) * u64::from(n) * 4 + 16
}

impl Matmul {
    pub fn new(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        alloc: &Alloc<'_>,
        n: u32,
    ) -> Result<Self, Error> {
        assert_eq!(n % 8, 0);
        let size = u64::from(n) * u64::from(n) * 4;
        let a = storage(device, alloc, "a", size, Role::Weights)?;
        let b = storage(device, alloc, "b", size, Role::Activation)?;
        let c = storage(device, alloc, "c", size, Role::Activation)?;
        let dims = storage(device, alloc, "dims", 16, Role::Other)?;
        let (va, vb) = inputs(n as usize);
        queue.write_buffer(&a, 0, &bytes(&va));
        queue.write_buffer(&b, 0, &bytes(&vb));
        queue.write_buffer(&dims, 0, &n.to_le_bytes());
        Ok(Self::with_buffers(device, n, [a, b, c, dims]))
    }

    /// The workload on buffers that already hold its inputs (moved from
    /// another device, say).
    pub fn with_buffers(device: &wgpu::Device, n: u32, [a, b, c, dims]: [Buf; 4]) -> Self {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("matmul"),
            source: wgpu::ShaderSource::Wgsl(MATMUL.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("matmul"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let layout = pipeline.get_bind_group_layout(0);
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("matmul"),
            layout: &layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: a.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: b.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: c.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 3,
                    resource: dims.as_entire_binding(),
                },
            ],
        });
        Self {
            n,
            a,
            b,
            c,
            dims,
            pipeline,
            bind_group,
        }
    }

    /// The buffers, A, B, C, dims (the pipeline is dropped).
    pub fn into_buffers(self) -> [Buf; 4] {
        [self.a, self.b, self.c, self.dims]
    }

    /// Dispatch once and submit (does not wait).
    pub fn dispatch(&self, device: &wgpu::Device, queue: &wgpu::Queue) -> wgpu::SubmissionIndex {
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &self.bind_group, &[]);
            pass.dispatch_workgroups(self.n / 8, self.n / 8, 1);
        }
        queue.submit([encoder.finish()])
    }

    /// Dispatch, wait, and read C back.
    pub fn run(&self, device: &wgpu::Device, queue: &wgpu::Queue) -> Vec<u8> {
        self.dispatch(device, queue);
        read_back(device, queue, &self.c)
    }
}

/// A compute pass that writes every word of its buffer: one invocation that
/// iterates a hash `iterations` times per word.
///
/// It is not long on lavapipe whatever `iterations` says: llvmpipe ends a
/// shader after 65,535 loop iterations in all (gallivm's loop limiter, shared
/// by every loop of the shader), a few milliseconds. A test that needs it in
/// flight holds it with a [`Gate`].
pub const LONG_PASS: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
@group(0) @binding(1) var<uniform> iterations: vec4<u32>;

@compute @workgroup_size(1)
fn main() {
    let n = arrayLength(&data);
    for (var i = 0u; i < n; i = i + 1u) {
        var x = data[i] ^ i;
        for (var k = 0u; k < iterations.x; k = k + 1u) {
            x = x * 1664525u + 1013904223u;
            x = x ^ (x >> 13u);
        }
        data[i] = x;
    }
}
"#;

/// Record and submit [`LONG_PASS`] over `data` with `iterations` per word.
pub fn long_pass(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    data: &wgpu::Buffer,
    iterations: &wgpu::Buffer,
) -> wgpu::SubmissionIndex {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("long pass"),
        source: wgpu::ShaderSource::Wgsl(LONG_PASS.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("long pass"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("long pass"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: data.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: iterations.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    queue.submit([encoder.finish()])
}

/// A host-controlled gate on wgpu's queue: the next submission waits on a
/// timeline semaphore that only [`open`](Self::open) signals, so it stays in
/// flight, deterministically, until the test says so (no timing involved: a
/// pass that is merely long may finish before the host looks on a loaded
/// machine, since lavapipe runs it on its own thread).
pub struct Gate {
    device: ash::Device,
    semaphore: ash::vk::Semaphore,
    opened: bool,
}

impl Gate {
    /// A closed gate on `queue`'s device, holding `queue`'s next submission.
    pub fn hold_next_submission(queue: &wgpu::Queue) -> Self {
        use ash::vk;
        // SAFETY: the hal queue is only used to read its device and to stage
        // a wait on the next submission; nothing is destroyed through it.
        let hal = unsafe { queue.as_hal::<wgpu::hal::api::Vulkan>() }.expect("a Vulkan queue");
        let device = hal.raw_device().clone();
        let mut timeline = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut timeline);
        // SAFETY: a valid device with timelineSemaphore enabled (wgpu-hal and
        // memgov both need it); the create info lives for the call.
        let semaphore =
            unsafe { device.create_semaphore(&info, None) }.expect("timeline semaphore");
        hal.add_wait_semaphore(semaphore, Some(1), vk::PipelineStageFlags::ALL_COMMANDS);
        Self {
            device,
            semaphore,
            opened: false,
        }
    }

    /// Let the held submission run (a host signal of the semaphore).
    pub fn open(&mut self) {
        let info = ash::vk::SemaphoreSignalInfo::default()
            .semaphore(self.semaphore)
            .value(1);
        // SAFETY: the semaphore is alive and at 0; signalled once.
        unsafe { self.device.signal_semaphore(&info) }.expect("host signal");
        self.opened = true;
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if self.opened {
            // SAFETY: callers drop an opened gate only after waiting for the
            // submission that waited on it: nothing refers to it any more.
            unsafe { self.device.destroy_semaphore(self.semaphore, None) };
        } else {
            // Dropped closed: a test failed before opening it. Open it, so
            // that the held submission runs and the device's teardown (wgpu
            // waits for its queue) does not hang and hide the failure; the
            // semaphore is leaked, as the submission may still refer to it.
            let info = ash::vk::SemaphoreSignalInfo::default()
                .semaphore(self.semaphore)
                .value(1);
            // SAFETY: the semaphore is alive and was never signalled.
            let _ = unsafe { self.device.signal_semaphore(&info) };
        }
    }
}
