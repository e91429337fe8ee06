//! memgov-wgpu on lavapipe with the validation layer on: buffers governed
//! and charged, released only after wgpu's last submission using them,
//! budget refusals as errors, teardown in both orders, the workload bit for
//! bit against wgpu's own allocator, a budget sweep, and a live device swap.

mod common;

use common::{open, read_back, Alloc, Matmul};
use memgov::vulkan::VulkanContext;
use memgov::{ContextConfig, Governor, GovernorError, Role};
use memgov_wgpu::{Error, GovernedDevice, RetireMode, WgpuConfig};
use std::time::{Duration, Instant};

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// Drop the device, then check what the Vulkan backend and the validation
/// layer saw over its whole life (the messenger lives until the VkDevice is
/// destroyed, so `vkDestroyDevice`'s own checks are counted too).
fn finish(dev: GovernedDevice) {
    let probe = dev.backend_probe();
    let validation = dev.validation().expect("validation on");
    let execution = dev.context().description().execution;
    let adapter = dev.adapter_name().to_string();
    drop(dev);
    assert_eq!(
        probe.check_clean_teardown(),
        Ok(()),
        "the Vulkan backend's books"
    );
    assert_eq!(
        validation.validation_failures(),
        0,
        "validation messages: {:#?}",
        validation.messages()
    );
    println!(
        "wgpu on memgov vulkan: {adapter} ({execution}), validation layer on: 0 validation messages ({} loader notices)",
        validation.loader_messages()
    );
}

fn live_buffers(dev: &GovernedDevice) -> u64 {
    dev.context().snapshot().pins.buffers
}

#[test]
fn buffers_are_governed_charged_and_used_by_wgpu() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "charged", 64 << 20) else {
        return;
    };
    let buf = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("kv"),
                size: 1000,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            },
            Role::KvCache,
        )
        .expect("create");
    let snap = dev.context().snapshot();
    assert_eq!(snap.pins.buffers, 1);
    assert!(snap.charged >= 1000, "charged {}", snap.charged);
    let kv = snap.by_role.iter().map(|r| r.live_bytes).sum::<u64>();
    assert!(kv >= 1000, "live bytes by role {:?}", snap.by_role);
    // New buffers read as zero, like wgpu's.
    assert_eq!(read_back(dev.device(), dev.queue(), &buf), vec![0u8; 1000]);
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    dev.queue().write_buffer(&buf, 0, &data);
    assert_eq!(read_back(dev.device(), dev.queue(), &buf), data);
    drop(buf);
    dev.device()
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    let report = dev.retire(deadline(), RetireMode::Wait).expect("retire");
    assert_eq!(report.reclaimed_buffers, 0, "{report:?}");
    finish(dev);
}

/// With call-site attribution on, a buffer is counted at the line that
/// called `create_buffer` (the caller's code, not the glue's) under the
/// label "wgpu buffer", and a refused one is counted there too.
#[test]
fn buffers_are_attributed_to_the_callers_line() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let config = WgpuConfig {
        validation: true,
        context: ContextConfig::new()
            .label("sites")
            .budget(1 << 20)
            .attribution(true),
        ..WgpuConfig::default()
    };
    let dev = match GovernedDevice::open(&gov, config) {
        Ok(d) => d,
        Err(e @ (Error::NoAdapter(_) | Error::Backend(_))) => {
            println!("skipped: {e}");
            return;
        }
        Err(e) => panic!("opening the governed device: {e}"),
    };
    let desc = |size| wgpu::BufferDescriptor {
        label: Some("kv"),
        size,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    };
    let (small, big) = (desc(4096), desc(4 << 20));
    let line = line!() + 1;
    let buf = dev.create_buffer(&small, Role::KvCache).expect("create");
    let refused_line = line!() + 1;
    let refused = dev.create_buffer(&big, Role::KvCache);
    assert!(matches!(refused, Err(Error::Refused(_))), "{refused:?}");
    let sites = dev.context().snapshot().sites;
    let at = |l: u32| format!("{}:{l}:", file!());
    let row = sites
        .iter()
        .find(|s| s.site.starts_with(&at(line)))
        .unwrap_or_else(|| panic!("no row at {}: {sites:#?}", at(line)));
    assert_eq!(row.label.as_deref(), Some(memgov_wgpu::BUFFER_LABEL));
    assert_eq!(memgov_wgpu::BUFFER_LABEL, "wgpu buffer");
    assert_eq!((row.live_count, row.allocations), (1, 1));
    assert!(row.live_bytes >= 4096, "{row:?}");
    let refused_row = sites
        .iter()
        .find(|s| s.site.starts_with(&at(refused_line)))
        .unwrap_or_else(|| panic!("no row at {}: {sites:#?}", at(refused_line)));
    assert_eq!((refused_row.refusals, refused_row.live_bytes), (1, 0));
    assert!(
        sites.iter().all(|s| !s.site.starts_with("src/")),
        "a row names the glue's own line: {sites:#?}"
    );
    drop(buf);
    dev.device()
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

#[test]
fn mappable_and_empty_buffers_are_refused_with_a_reason() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "refused", 64 << 20) else {
        return;
    };
    let e = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("staging"),
                size: 64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            },
            Role::Other,
        )
        .unwrap_err();
    assert!(matches!(e, Error::Mappable { .. }), "{e}");
    assert!(e.to_string().contains("wgpu::Device::create_buffer"), "{e}");
    let e = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("empty"),
                size: 0,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            },
            Role::Other,
        )
        .unwrap_err();
    assert!(matches!(e, Error::ZeroSized(_)), "{e}");
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

/// The memory of a buffer dropped while a compute pass still uses it (held
/// in flight by a [`common::Gate`]) stays charged and alive until wgpu has
/// seen that pass complete; the validation layer (which reports a buffer
/// destroyed while in use) stays silent.
#[test]
fn release_waits_for_the_last_submission_using_the_buffer() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "ordered", 64 << 20) else {
        return;
    };
    let (device, queue) = (dev.device(), dev.queue());
    let usage =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
    let data = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("data"),
                size: 4096,
                usage,
                mapped_at_creation: false,
            },
            Role::Activation,
        )
        .expect("data");
    let iterations = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("iterations"),
                size: 16,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            },
            Role::Other,
        )
        .expect("iterations");
    queue.write_buffer(
        &iterations,
        0,
        &[200_000u32, 0, 0, 0].map(u32::to_le_bytes).concat(),
    );
    // The pass waits on a gate the test opens: it is still in flight at
    // the drop and at the poll below, whatever the machine's load.
    let mut gate = common::Gate::hold_next_submission(queue);
    common::long_pass(device, queue, &data, &iterations);
    drop(data);
    drop(iterations);
    // Not complete, so still charged: the release is tied to wgpu's
    // completion, not to the drop.
    let status = device.poll(wgpu::PollType::Poll).expect("poll");
    assert!(
        !status.is_queue_empty(),
        "the gated pass completed: {status:?}"
    );
    assert_eq!(
        live_buffers(&dev),
        2,
        "released while the pass is still in flight"
    );
    gate.open();
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    drop(gate);
    assert_eq!(live_buffers(&dev), 0, "released once the pass completed");
    println!("gated pass in flight: both buffers charged; completed: both released");
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

/// The planted violation: the governed memory released at the drop, while
/// the pass using it is still in flight, is what the validation layer
/// reports.
///
/// The pass waits on a [`common::Gate`] that is never opened, so it is in
/// flight when the memory is freed whatever the machine's load (the pass
/// lasts a few milliseconds on lavapipe, see [`common::LONG_PASS`]; once it
/// has finished and wgpu has read its fence, the layer rightly says
/// nothing). The
/// device cannot be torn down with that pass waiting, and opening the gate
/// would let it write freed memory (on lavapipe, the process's heap): the
/// plant runs in a child process (this test binary again, this test alone,
/// with `MEMGOV_WGPU_PLANT` set), which prints what the layer said and
/// aborts.
#[test]
fn planted_release_before_completion_is_reported_by_validation() {
    let _one = common::one_test_at_a_time();
    const NAME: &str = "planted_release_before_completion_is_reported_by_validation";
    if std::env::var_os("MEMGOV_WGPU_PLANT").is_some() {
        planted_child();
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env("MEMGOV_WGPU_PLANT", "1")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The child's lines follow libtest's "test <name> ... ".
    let said = |what: &str| {
        stdout
            .lines()
            .find_map(|l| l.find(what).map(|i| l[i..].to_string()))
    };
    if let Some(line) = said("skipped:") {
        println!("{line}");
        return;
    }
    let reported = said("planted: reported")
        .unwrap_or_else(|| panic!("the validation layer did not report the buffer destroyed in use; child said:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert!(reported.contains("vkDestroyBuffer"), "{reported}");
    println!("{reported}");
}

fn planted_child() -> ! {
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "planted", 64 << 20) else {
        std::process::exit(0)
    };
    let validation = dev.validation().expect("on");
    validation.set_print(false);
    let (device, queue) = (dev.device(), dev.queue());
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
    let data = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("data"),
                size: 4096,
                usage,
                mapped_at_creation: false,
            },
            Role::Activation,
        )
        .expect("data");
    let iterations = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("iterations"),
        size: 16,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    queue.write_buffer(
        &iterations,
        0,
        &[2_000_000u32, 0, 0, 0].map(u32::to_le_bytes).concat(),
    );
    // Held until the host opens the gate, which it never does: the pass is
    // in flight, deterministically, when its memory is freed below.
    let _gate = common::Gate::hold_next_submission(queue);
    common::long_pass(device, queue, &data, &iterations);
    // Wrong on purpose: free the memory now, while the pass uses it.
    drop(data.take_memory_for_test().expect("memory"));
    let messages = validation.messages();
    match messages.iter().find(|m| m.contains("vkDestroyBuffer")) {
        Some(m) => println!("planted: reported {m}"),
        None => println!("planted: not reported: {messages:#?}"),
    }
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    std::process::abort();
}

#[test]
fn budget_refusal_is_an_error_and_the_device_goes_on() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "tight", 1 << 20) else {
        return;
    };
    let usage =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let keep = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("keep"),
                size: 512 << 10,
                usage,
                mapped_at_creation: false,
            },
            Role::Weights,
        )
        .expect("fits");
    let e = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("big"),
                size: 768 << 10,
                usage,
                mapped_at_creation: false,
            },
            Role::Activation,
        )
        .unwrap_err();
    match &e {
        Error::Refused(GovernorError::BudgetExceeded(_)) => {}
        other => panic!("expected a budget refusal, got {other}"),
    }
    assert!(e.to_string().contains("raise the budget"), "{e}");
    // Nothing was created, the device and the other buffer are as they were.
    dev.queue().write_buffer(&keep, 0, &[9u8; 16]);
    assert_eq!(
        &read_back(dev.device(), dev.queue(), &keep)[..16],
        &[9u8; 16]
    );
    drop(keep);
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

/// Retiring while wgpu holds a buffer waits for it (the deadline passes and
/// says who holds what); once dropped, the retire finishes.
#[test]
fn retire_waits_for_buffers_wgpu_holds() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "wait", 64 << 20) else {
        return;
    };
    let buf = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("held"),
                size: 4096,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            },
            Role::Weights,
        )
        .expect("create");
    dev.queue().write_buffer(&buf, 0, &[1u8; 4096]);
    let e = dev
        .retire(
            Instant::now() + Duration::from_millis(100),
            RetireMode::Wait,
        )
        .unwrap_err();
    assert!(matches!(e, Error::Retire(_)), "{e}");
    assert!(e.to_string().contains("weights"), "names the holder: {e}");
    assert!(matches!(
        dev.create_buffer(
            &wgpu::BufferDescriptor {
                label: None,
                size: 4,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false
            },
            Role::Other
        ),
        Err(Error::Retired)
    ));
    drop(buf);
    let report = dev.retire(deadline(), RetireMode::Wait).expect("retire");
    assert_eq!(report.reclaimed_buffers, 0, "{report:?}");
    finish(dev);
}

/// A forced retire destroys the buffers wgpu still holds through wgpu, after
/// the submissions using them, and tears the context down; the wgpu device
/// goes on with wgpu's own buffers.
#[test]
fn forced_retire_reclaims_through_wgpu() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "force", 64 << 20) else {
        return;
    };
    let m = Matmul::new(dev.device(), dev.queue(), &Alloc::Governed(&dev), 64).expect("matmul");
    m.dispatch(dev.device(), dev.queue());
    let report = dev
        .retire(deadline(), RetireMode::Force)
        .expect("forced retire");
    assert_eq!(
        report.reclaimed_buffers, 0,
        "released through wgpu, not reclaimed by memgov: {report:?}"
    );
    assert_eq!(dev.backend_probe().check_clean_teardown(), Ok(()));
    // wgpu's own buffers still work on the same VkDevice.
    let own = Matmul::new(dev.device(), dev.queue(), &Alloc::Wgpu, 16).expect("wgpu's own");
    assert_eq!(own.run(dev.device(), dev.queue()).len(), 16 * 16 * 4);
    drop((m, own));
    finish(dev);
}

/// Dropping the wgpu side first: the buffers it held are released, and the
/// VkDevice stays until the memgov context is torn down.
#[test]
fn dropping_the_wgpu_device_first_is_safe() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "wgpu-first", 64 << 20) else {
        return;
    };
    let m = Matmul::new(dev.device(), dev.queue(), &Alloc::Governed(&dev), 64).expect("matmul");
    m.dispatch(dev.device(), dev.queue());
    let context = dev.context().clone();
    let probe = dev.backend_probe();
    let validation = dev.validation().expect("on");
    drop(m);
    drop(dev);
    let report = context
        .retire()
        .wait(deadline())
        .expect("retire after wgpu is gone");
    assert_eq!(report.reclaimed_buffers, 0, "{report:?}");
    assert_eq!(probe.check_clean_teardown(), Ok(()));
    assert_eq!(
        validation.validation_failures(),
        0,
        "{:#?}",
        validation.messages()
    );
}

/// The workload on governed buffers gives the same bits as on wgpu's own.
#[test]
fn workload_is_bit_identical_to_wgpus_allocator() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "bits", 64 << 20) else {
        return;
    };
    let n = 128;
    let own = Matmul::new(dev.device(), dev.queue(), &Alloc::Wgpu, n).expect("wgpu's");
    let governed =
        Matmul::new(dev.device(), dev.queue(), &Alloc::Governed(&dev), n).expect("governed");
    let expected = own.run(dev.device(), dev.queue());
    let got = governed.run(dev.device(), dev.queue());
    assert_eq!(got.len(), (n * n * 4) as usize);
    assert!(
        expected.iter().any(|&b| b != 0),
        "the workload computed something"
    );
    assert!(
        got == expected,
        "governed result differs from wgpu's allocator"
    );
    println!(
        "matmul {n}x{n}: {} bytes bit-identical on governed buffers and wgpu's own",
        got.len()
    );
    drop((own, governed));
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

/// Budgets from generous to below the working set: the workload runs and is
/// bit-identical, or its allocation is refused cleanly; never a crash.
#[test]
fn budget_sweep_refuses_cleanly_below_the_working_set() {
    let _one = common::one_test_at_a_time();
    let n = 64;
    let need = common::working_set(n);
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(reference) = open(&gov, "reference", 64 << 20) else {
        return;
    };
    let expected = Matmul::new(reference.device(), reference.queue(), &Alloc::Wgpu, n)
        .expect("wgpu's")
        .run(reference.device(), reference.queue());
    reference
        .retire(deadline(), RetireMode::Wait)
        .expect("retire");
    finish(reference);
    let mut ran = 0;
    let mut refused = 0;
    for budget in [
        need * 4,
        need * 2,
        need + need / 8,
        need,
        need - 1,
        need / 2,
        need / 4,
        4096,
        1,
    ] {
        let Some(dev) = open(&gov, &format!("budget {budget}"), budget) else {
            return;
        };
        match Matmul::new(dev.device(), dev.queue(), &Alloc::Governed(&dev), n) {
            Ok(m) => {
                assert!(
                    m.run(dev.device(), dev.queue()) == expected,
                    "budget {budget}: result differs"
                );
                ran += 1;
            }
            Err(Error::Refused(GovernorError::BudgetExceeded(_))) => {
                assert!(
                    budget < need,
                    "budget {budget} >= working set {need} was refused"
                );
                refused += 1;
            }
            Err(e) => panic!("budget {budget}: {e}"),
        }
        dev.retire(deadline(), RetireMode::Wait).expect("retire");
        finish(dev);
    }
    assert!(ran >= 3 && refused >= 4, "ran {ran}, refused {refused}");
    println!(
        "budget sweep (working set {need} B): {ran} ran bit-identical, {refused} refused cleanly"
    );
}

/// A live device swap: the workload runs on one device, its live buffers
/// move to a second device's context with `ContextHandle::migrate`, the old
/// context retires with their frees in flight, and the workload goes on on
/// the new device with bit-identical results.
#[test]
fn live_device_swap_moves_the_workload_bit_for_bit() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(old) = open(&gov, "gpu0", 64 << 20) else {
        return;
    };
    let Some(new) = open(&gov, "gpu1", 64 << 20) else {
        return;
    };
    let n = 64;
    let m = Matmul::new(old.device(), old.queue(), &Alloc::Governed(&old), n).expect("on gpu0");
    let expected = m.run(old.device(), old.queue());
    // Still running on the old device when the swap begins.
    m.dispatch(old.device(), old.queue());
    let live = m
        .into_buffers()
        .map(|b| match b {
            common::Buf::Governed(g) => g,
            common::Buf::Wgpu(_) => unreachable!("governed"),
        })
        .into_iter()
        .collect::<Vec<_>>();
    let charged: u64 = live.iter().map(|b| b.charged()).sum();
    let moved = old
        .migrate_to(&new, live)
        .map_err(|(e, _)| e)
        .expect("swap");
    assert_eq!(moved.len(), 4);
    assert_eq!(new.context().snapshot().pins.buffers, 4);
    assert!(new.context().snapshot().charged >= charged);
    // The old context retires with the frees of the moved-out buffers queued.
    let report = old
        .retire(deadline(), RetireMode::Wait)
        .expect("old retires");
    assert_eq!(report.reclaimed_buffers, 0, "{report:?}");
    assert!(report.retired_releases >= 4, "{report:?}");
    finish(old);
    let [a, b, c, dims]: [memgov_wgpu::GovernedBuffer; 4] = moved.try_into().expect("four");
    let buffers = [a, b, c, dims].map(common::Buf::Governed);
    let m = Matmul::with_buffers(new.device(), n, buffers);
    // C as the old device left it, then computed again on the new one.
    assert!(
        read_back(new.device(), new.queue(), &m.c) == expected,
        "C moved bit for bit"
    );
    assert!(
        m.run(new.device(), new.queue()) == expected,
        "recomputed bit for bit"
    );
    println!("live swap: 4 buffers ({charged} B) moved gpu0 -> gpu1, old context retired with {} releases, results bit-identical", report.retired_releases);
    drop(m);
    new.retire(deadline(), RetireMode::Wait)
        .expect("new retires");
    finish(new);
}

/// A swap the target refuses (its budget is below the working set) leaves
/// every buffer on the source, contents unchanged, and the workload runs on.
#[test]
fn refused_swap_leaves_the_workload_on_the_source() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(old) = open(&gov, "gpu0", 64 << 20) else {
        return;
    };
    let Some(small) = open(&gov, "small", 16 << 10) else {
        return;
    };
    let n = 64;
    let m = Matmul::new(old.device(), old.queue(), &Alloc::Governed(&old), n).expect("on gpu0");
    let expected = m.run(old.device(), old.queue());
    let live: Vec<_> = m
        .into_buffers()
        .into_iter()
        .map(|b| match b {
            common::Buf::Governed(g) => g,
            common::Buf::Wgpu(_) => unreachable!("governed"),
        })
        .collect();
    let (e, back) = old.migrate_to(&small, live).expect_err("refused");
    assert!(
        matches!(
            e,
            Error::Migrate {
                source: GovernorError::BudgetExceeded(_),
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(back.len(), 4);
    assert_eq!(
        small.context().snapshot().pins.buffers,
        0,
        "nothing left on the target"
    );
    let [a, b, c, dims]: [memgov_wgpu::GovernedBuffer; 4] = back.try_into().expect("four");
    let m = Matmul::with_buffers(old.device(), n, [a, b, c, dims].map(common::Buf::Governed));
    assert!(
        read_back(old.device(), old.queue(), &m.c) == expected,
        "contents unchanged"
    );
    assert!(
        m.run(old.device(), old.queue()) == expected,
        "the workload runs on"
    );
    drop(m);
    for dev in [old, small] {
        dev.retire(deadline(), RetireMode::Wait).expect("retire");
        finish(dev);
    }
}

/// A buffer the caller dropped with a queued write is still wgpu's until
/// wgpu has submitted that write and seen it complete; an allocation that needs its bytes asks the
/// pressure responder, which lets wgpu give it back, and fits. Without the
/// responder the same allocation is refused.
fn pressure_case(poll_on_pressure: bool) -> Option<Result<(), Error>> {
    let gov: Governor<VulkanContext> = Governor::new();
    let config = memgov_wgpu::WgpuConfig {
        validation: true,
        poll_on_pressure,
        context: memgov::ContextConfig::new()
            .label("pressure")
            .budget(1 << 20),
        ..memgov_wgpu::WgpuConfig::default()
    };
    let dev = match GovernedDevice::open(&gov, config) {
        Ok(d) => d,
        Err(e @ (Error::NoAdapter(_) | Error::Backend(_))) => {
            println!("skipped: {e}");
            return None;
        }
        Err(e) => panic!("open: {e}"),
    };
    let queue = dev.queue();
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
    let big = |label| {
        dev.create_buffer(
            &wgpu::BufferDescriptor {
                label: Some(label),
                size: 768 << 10,
                usage,
                mapped_at_creation: false,
            },
            Role::Activation,
        )
    };
    let first = big("first").expect("fits");
    // Queued data for `first` that no submission has carried yet: wgpu
    // holds the buffer until its next submission completes (no timing
    // involved: nothing is submitted before the allocation below).
    queue.write_buffer(&first, 0, &[7u8; 4096]);
    drop(first);
    // Dropped by the caller, still held by wgpu.
    assert_eq!(live_buffers(&dev), 1);
    let second = big("second").map(drop);
    let snapshot = dev.context().snapshot();
    if poll_on_pressure {
        assert!(
            snapshot.counters.pressure_calls >= 1,
            "{:?}",
            snapshot.counters
        );
    }
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
    Some(second)
}

#[test]
fn pressure_lets_wgpu_give_back_what_it_still_holds() {
    let _one = common::one_test_at_a_time();
    let Some(with) = pressure_case(true) else {
        return;
    };
    with.expect("admitted once the responder let wgpu release the first buffer");
    let without = pressure_case(false).expect("ran above");
    match without {
        Err(Error::Refused(GovernorError::BudgetExceeded(_))) => {}
        other => panic!("without the responder the allocation must be refused, got {other:?}"),
    }
}

/// What a buffer's memory held before: a pattern with no zero byte.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| 0x80 | (i * 37 % 127) as u8).collect()
}

/// Store `value` in the first word of `buffer` from a compute shader (its
/// first use where it has `STORAGE` and no `COPY_DST`).
fn store_first_word(device: &wgpu::Device, queue: &wgpu::Queue, buffer: &wgpu::Buffer, value: u32) {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("store first word"),
        source: wgpu::ShaderSource::Wgsl(
            format!(
                "@group(0) @binding(0) var<storage, read_write> b: array<u32>;\n\
                 @compute @workgroup_size(1) fn main() {{ b[0] = {value}u; }}"
            )
            .into(),
        ),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("store first word"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset: 0,
                size: std::num::NonZeroU64::new(4),
            }),
        }],
    });
    let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    queue.submit([encoder.finish()]);
}

/// The zero-fill of the device-local path (forced on lavapipe, whose memory
/// is all host-visible): wgpu's sizes that are not a multiple of
/// `COPY_BUFFER_ALIGNMENT` and usages without `COPY_DST` (`STORAGE` alone,
/// as in wgpu's out-of-memory test) are created, and never show the bytes
/// the memory's previous holder left. Each case first shows that the memory
/// comes back to a new allocation with those bytes in it (memgov does not
/// clear it), then that the governed buffer made on it reads zero, every
/// byte up to the 4-byte boundary, through memgov's mapping.
#[test]
fn gpu_zero_fill_hides_the_previous_holders_bytes() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "zero-on-gpu", 64 << 20) else {
        return;
    };
    dev.zero_on_gpu_for_test();
    let (device, queue) = (dev.device(), dev.queue());
    let rw =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let cases: [(u64, wgpu::BufferUsages); 4] = [
        (1234, rw),
        (1234, wgpu::BufferUsages::STORAGE),
        (1000, wgpu::BufferUsages::STORAGE),
        (5, wgpu::BufferUsages::UNIFORM),
    ];
    for (size, usage) in cases {
        let whole = size.next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
        let old = pattern(whole as usize);
        let previous = dev
            .create_buffer(
                &wgpu::BufferDescriptor {
                    label: Some("previous holder"),
                    size: whole,
                    usage: rw,
                    mapped_at_creation: false,
                },
                Role::KvCache,
            )
            .expect("previous holder");
        queue.write_buffer(&previous, 0, &old);
        assert!(
            read_back(device, queue, &previous) == old,
            "pattern written"
        );
        drop(previous);
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("poll");
        assert_eq!(live_buffers(&dev), 0, "the previous holder released");
        // The same request straight from memgov lands on the same memory,
        // with the previous holder's bytes.
        let stream = dev.context().create_stream("probe").expect("stream");
        let probe = dev
            .context()
            .allocate(&stream, memgov::Alloc::new(whole, Role::Activation))
            .expect("probe");
        let mut seen = vec![0u8; whole as usize];
        probe.read(0, &mut seen).expect("read the probe");
        assert!(
            seen == old,
            "the probe did not land on the previous holder's bytes: {:?}",
            &seen[..16]
        );
        drop(probe);
        drop(stream);
        assert_eq!(live_buffers(&dev), 0, "the probe released");
        // A governed buffer on that memory reads zero.
        let desc = wgpu::BufferDescriptor {
            label: Some("new holder"),
            size,
            usage,
            mapped_at_creation: false,
        };
        let buffer = dev.create_buffer(&desc, Role::Activation).expect("create");
        // The caller's first use comes after the fill: a write queued now
        // (a copy, or a shader's store where the buffer has STORAGE only)
        // is not overwritten by it.
        let first = [7u8; 4];
        let written = if usage.contains(wgpu::BufferUsages::COPY_DST) {
            queue.write_buffer(&buffer, 0, &first);
            true
        } else if usage.contains(wgpu::BufferUsages::STORAGE) {
            store_first_word(device, queue, &buffer, u32::from_le_bytes(first));
            true
        } else {
            false
        };
        queue.submit([]);
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("poll");
        let mut now = vec![0xffu8; whole as usize];
        buffer
            .read_memory_for_test(0, &mut now)
            .expect("read through the mapping");
        let mut expected = vec![0u8; whole as usize];
        if written {
            expected[..4].copy_from_slice(&first);
        }
        let wrong = now.iter().zip(&expected).position(|(a, b)| a != b);
        assert_eq!(
            wrong,
            None,
            "{size} B, {usage:?}: byte {wrong:?} of {whole} is not as expected: {:?}",
            wrong.map(|i| &now[i..(i + 8).min(now.len())])
        );
        drop(buffer);
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("poll");
        println!(
            "zero-fill on the GPU: {size} B, {usage:?}: the previous holder's {whole} B never show"
        );
    }
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

/// A buffer dropped while its zero-fill is still in flight (held by a
/// [`common::Gate`]) keeps its memory until the fill has completed: wgpu
/// knows the fill uses the buffer.
#[test]
fn gpu_zero_fill_in_flight_keeps_the_memory() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "zero-in-flight", 64 << 20) else {
        return;
    };
    dev.zero_on_gpu_for_test();
    let (device, queue) = (dev.device(), dev.queue());
    let mut gate = common::Gate::hold_next_submission(queue);
    let buffer = dev
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("dropped at once"),
                size: 1234,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            },
            Role::Activation,
        )
        .expect("create");
    drop(buffer);
    let status = device.poll(wgpu::PollType::Poll).expect("poll");
    assert!(
        !status.is_queue_empty(),
        "the gated fill completed: {status:?}"
    );
    assert_eq!(
        live_buffers(&dev),
        1,
        "released while its zero-fill is still in flight"
    );
    gate.open();
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    drop(gate);
    assert_eq!(live_buffers(&dev), 0, "released once the fill completed");
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    finish(dev);
}

/// Buffers moved to a device whose buffers are zeroed on the GPU keep their
/// contents: only new buffers are zeroed.
#[test]
fn moved_buffers_are_not_zeroed_on_the_target() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(old) = open(&gov, "gpu0", 64 << 20) else {
        return;
    };
    let Some(new) = open(&gov, "gpu1", 64 << 20) else {
        return;
    };
    old.zero_on_gpu_for_test();
    new.zero_on_gpu_for_test();
    let usage =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let buffer = old
        .create_buffer(
            &wgpu::BufferDescriptor {
                label: Some("moved"),
                size: 4096,
                usage,
                mapped_at_creation: false,
            },
            Role::KvCache,
        )
        .expect("create");
    let data = pattern(4096);
    old.queue().write_buffer(&buffer, 0, &data);
    let moved = old
        .migrate_to(&new, vec![buffer])
        .map_err(|(e, _)| e)
        .expect("move");
    old.retire(deadline(), RetireMode::Wait)
        .expect("old retires");
    finish(old);
    assert!(
        read_back(new.device(), new.queue(), &moved[0]) == data,
        "moved with its contents"
    );
    drop(moved);
    new.retire(deadline(), RetireMode::Wait)
        .expect("new retires");
    finish(new);
}

/// Code written the wgpu way (an `OutOfMemory` error scope around buffer
/// creation, as in wgpu's own out-of-memory test and WebGPU's
/// `createBuffer`, which raises a `GPUOutOfMemoryError`) pops nothing for a
/// budget refusal: the refusal is returned instead, and
/// `Error::wgpu_error_filter` names the scope that would have caught it,
/// `Error::into_wgpu_error` the error it would have popped. What wgpu would
/// not have refused maps to no scope.
#[test]
fn refusals_map_to_wgpus_error_scopes() {
    let _one = common::one_test_at_a_time();
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = open(&gov, "scoped", 1 << 20) else {
        return;
    };
    let desc = |label, size, usage| wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage,
        mapped_at_creation: false,
    };
    let scope = dev
        .device()
        .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let refused = dev
        .create_buffer(
            &desc("too big", 2 << 20, wgpu::BufferUsages::STORAGE),
            Role::Activation,
        )
        .unwrap_err();
    assert!(
        pollster::block_on(scope.pop()).is_none(),
        "wgpu's scope saw the refusal"
    );
    assert!(
        matches!(refused, Error::Refused(GovernorError::BudgetExceeded(_))),
        "{refused}"
    );
    assert_eq!(
        refused.wgpu_error_filter(),
        Some(wgpu::ErrorFilter::OutOfMemory)
    );
    let message = refused.to_string();
    match refused.into_wgpu_error() {
        Ok(wgpu::Error::OutOfMemory { source }) => {
            assert_eq!(source.to_string(), message, "the refusal, numbers and all");
            assert!(message.contains("raise the budget"), "{message}");
        }
        other => panic!("expected wgpu's out-of-memory error, got {other:?}"),
    }
    // Refused only because the buffer is governed: wgpu would have made it.
    let mappable = dev
        .create_buffer(
            &desc(
                "staging",
                64,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            Role::Other,
        )
        .unwrap_err();
    assert_eq!(mappable.wgpu_error_filter(), None, "{mappable}");
    assert!(matches!(
        mappable.into_wgpu_error(),
        Err(Error::Mappable { .. })
    ));
    let empty = dev
        .create_buffer(&desc("empty", 0, wgpu::BufferUsages::STORAGE), Role::Other)
        .unwrap_err();
    assert_eq!(empty.wgpu_error_filter(), None, "{empty}");
    dev.retire(deadline(), RetireMode::Wait).expect("retire");
    let retired = dev
        .create_buffer(&desc("late", 64, wgpu::BufferUsages::STORAGE), Role::Other)
        .unwrap_err();
    assert!(matches!(retired, Error::Retired), "{retired}");
    assert_eq!(retired.wgpu_error_filter(), None);
    finish(dev);
}
