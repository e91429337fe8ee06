//! A compute kernel nobody here wrote, run unchanged on governed buffers:
//! wgpu-core's timestamp normalization (`src/timestamp_normalization/` of
//! the wgpu-core crate this one builds against: 96-bit emulated multiply and
//! shift over a storage buffer of 64-bit values, with immediates and
//! pipeline-overridable constants). Its source is read from the crate's own
//! files, found with `cargo metadata`, and put together the way wgpu-core
//! does (`common.wgsl`, a newline, `timestamp_normalization.wgsl`). Only the
//! buffer it works on changes: wgpu's own allocator, then memgov.

mod common;

use memgov::vulkan::VulkanContext;
use memgov::{ContextConfig, Governor, GovernorError, Role};
use memgov_wgpu::{Error, GovernedDevice, RetireMode, WgpuConfig};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `TIMESTAMP_PERIOD_MULTIPLY` and `TIMESTAMP_PERIOD_SHIFT`: a period of
/// 41,943 / 2^12 (about 10.24 ns per tick).
const MULTIPLY: u32 = 41_943;
const SHIFT: u32 = 12;
const COUNT: u32 = 4096;

/// The kernel's source, as wgpu-core builds it, or why it cannot be found.
fn kernel() -> Result<String, String> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--manifest-path",
        ])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata output: {e}"))?;
    let manifest = meta["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "wgpu-core"))
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or("wgpu-core is not in the dependency graph")?;
    let dir = PathBuf::from(manifest)
        .parent()
        .expect("a manifest has a directory")
        .join("src/timestamp_normalization");
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .map_err(|e| format!("{}: {e}", dir.join(name).display()))
    };
    Ok(format!(
        "{}\n{}",
        read("common.wgsl")?,
        read("timestamp_normalization.wgsl")?
    ))
}

/// What the kernel computes, on the CPU: `(x * MULTIPLY) >> SHIFT` in 96
/// bits, truncated to 64.
fn expected(x: u64) -> u64 {
    ((u128::from(x) * u128::from(MULTIPLY)) >> SHIFT) as u64
}

fn inputs() -> Vec<u64> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..COUNT)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

fn open(gov: &Governor<VulkanContext>, budget: u64) -> Option<GovernedDevice> {
    let limits = wgpu::Limits {
        max_immediate_size: 8,
        ..wgpu::Limits::default()
    };
    let config = WgpuConfig {
        validation: true,
        features: wgpu::Features::IMMEDIATES,
        limits,
        context: ContextConfig::new().label("timestamps").budget(budget),
        ..WgpuConfig::default()
    };
    match GovernedDevice::open(gov, config) {
        Ok(d) => Some(d),
        Err(e @ (Error::NoAdapter(_) | Error::Backend(_))) => {
            println!("skipped: {e}");
            None
        }
        Err(e) => panic!("opening the governed device (with immediates): {e}"),
    }
}

/// Run the kernel over `buffer` (holding [`inputs`]) and read it back.
fn run(dev: &GovernedDevice, source: &str, buffer: &wgpu::Buffer) -> Vec<u8> {
    let device = dev.device();
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("timestamp normalization"),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("timestamps"),
        entries: &[wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only: false },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        }],
    });
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some("timestamps"),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 8,
    });
    let constants = [
        ("TIMESTAMP_PERIOD_MULTIPLY", f64::from(MULTIPLY)),
        ("TIMESTAMP_PERIOD_SHIFT", f64::from(SHIFT)),
    ];
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("timestamp normalization"),
        layout: Some(&pipeline_layout),
        module: &module,
        entry_point: Some("main"),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &constants,
            ..Default::default()
        },
        cache: None,
    });
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("timestamps"),
        layout: &layout,
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: buffer.as_entire_binding(),
        }],
    });
    let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        let immediates: Vec<u8> = [0u32, COUNT].iter().flat_map(|v| v.to_le_bytes()).collect();
        pass.set_immediates(0, &immediates);
        pass.dispatch_workgroups(COUNT.div_ceil(64), 1, 1);
    }
    dev.queue().submit([encoder.finish()]);
    common::read_back(device, dev.queue(), buffer)
}

fn input_bytes() -> Vec<u8> {
    inputs().iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn desc() -> wgpu::BufferDescriptor<'static> {
    wgpu::BufferDescriptor {
        label: Some("timestamps"),
        size: u64::from(COUNT) * 8,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    }
}

fn finish(dev: GovernedDevice) {
    let probe = dev.backend_probe();
    let validation = dev.validation().expect("validation on");
    dev.retire(Instant::now() + Duration::from_secs(60), RetireMode::Wait)
        .expect("retire");
    drop(dev);
    assert_eq!(probe.check_clean_teardown(), Ok(()));
    assert_eq!(
        validation.validation_failures(),
        0,
        "{:#?}",
        validation.messages()
    );
}

#[test]
fn wgpu_cores_timestamp_kernel_is_bit_identical_on_governed_buffers() {
    let _one = common::one_test_at_a_time();
    let source = match kernel() {
        Ok(s) => s,
        Err(why) => panic!("wgpu-core's kernel source: {why}"),
    };
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, 64 << 20) else {
        return;
    };
    let own = dev.device().create_buffer(&desc());
    dev.queue().write_buffer(&own, 0, &input_bytes());
    let reference = run(&dev, &source, &own);
    let governed = dev
        .create_buffer(&desc(), Role::Activation)
        .expect("governed");
    dev.queue().write_buffer(&governed, 0, &input_bytes());
    let got = run(&dev, &source, &governed);
    assert!(
        got == reference,
        "governed result differs from wgpu's allocator"
    );
    // And it computed what the kernel is for.
    let values: Vec<u64> = got
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let want: Vec<u64> = inputs().into_iter().map(expected).collect();
    assert_eq!(values, want, "the kernel's result against the CPU");
    println!(
        "wgpu-core's timestamp normalization kernel: {COUNT} values bit-identical on governed buffers and wgpu's own, and equal to the CPU's"
    );
    drop((own, governed));
    finish(dev);
}

/// The same kernel under budgets from generous to below its buffer: it runs
/// bit-identical or its buffer is refused cleanly.
#[test]
fn wgpu_cores_timestamp_kernel_under_a_budget_sweep() {
    let _one = common::one_test_at_a_time();
    let source = kernel().expect("wgpu-core's kernel source");
    let need = u64::from(COUNT) * 8;
    let want: Vec<u8> = inputs()
        .into_iter()
        .flat_map(|x| expected(x).to_le_bytes())
        .collect();
    let gov: Governor<VulkanContext> = Governor::new();
    let (mut ran, mut refused) = (0, 0);
    for budget in [need * 8, need * 2, need, need - 8, need / 2, 1] {
        let Some(dev) = open(&gov, budget) else {
            return;
        };
        match dev.create_buffer(&desc(), Role::Activation) {
            Ok(buffer) => {
                dev.queue().write_buffer(&buffer, 0, &input_bytes());
                assert!(
                    run(&dev, &source, &buffer) == want,
                    "budget {budget}: result differs"
                );
                ran += 1;
            }
            Err(Error::Refused(GovernorError::BudgetExceeded(_))) => {
                assert!(budget < need, "budget {budget} >= {need} refused");
                refused += 1;
            }
            Err(e) => panic!("budget {budget}: {e}"),
        }
        finish(dev);
    }
    assert_eq!((ran, refused), (3, 3));
    println!("timestamp kernel budget sweep ({need} B buffer): {ran} ran bit-identical, {refused} refused cleanly");
}
