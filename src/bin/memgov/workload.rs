//! `memgov run`: a serving-style workload on the embedded host backend.
//!
//! Two contexts share one physical device's budget (an LLM and an embedder);
//! the LLM's KV cache grows until admission asks a pressure responder to evict
//! blocks; halfway through, the LLM moves to a second device (weights copied
//! and verified) and the first context retires while its last releases are
//! still pending; at the end everything retires and the accounting must be
//! back at zero with no contract violation on either simulated device.

use memgov::host::{HostConfig, HostContext};
use memgov::BackendProbe;
use memgov::{
    Admission, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor,
    ProviderContextPinSource, Role, SharedBudget, TeardownReport,
};
use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Requests to serve.
    #[arg(long, default_value_t = 48)]
    requests: u32,
    /// Decode steps per request.
    #[arg(long, default_value_t = 12)]
    steps: u32,
    /// Capacity of each simulated device, MiB.
    #[arg(long, default_value_t = 512)]
    device_mib: u64,
    /// Budget of the LLM context, MiB.
    #[arg(long, default_value_t = 256)]
    llm_budget_mib: u64,
    /// Simulated time per queued device operation, microseconds.
    #[arg(long, default_value_t = 20)]
    op_delay_us: u64,
}

type Ctx = HostContext;
type Kv = Arc<Mutex<VecDeque<DeviceBuffer<Ctx>>>>;

fn device(name: &str, ordinal: u32, args: &RunArgs) -> Result<(HostContext, BackendProbe), String> {
    let ctx = HostContext::new(HostConfig {
        capacity: args.device_mib * MIB,
        op_delay: Duration::from_micros(args.op_delay_us),
        name: name.into(),
        ordinal,
    })
    .map_err(|e| e.to_string())?;
    let probe = ctx.probe();
    Ok((ctx, probe))
}

fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn print_snapshot(gov: &Governor<Ctx>, title: &str) {
    println!("  -- {title}");
    println!(
        "     {:<14} {:<11} {:>10} {:>10} {:>10} {:>10} {:>6} {:>8} {:>8}",
        "context",
        "state",
        "weights",
        "kv-cache",
        "activ.",
        "pending",
        "pins",
        "retired",
        "refused"
    );
    for c in gov.snapshot().contexts {
        let t = c.total();
        println!(
            "     {:<14} {:<11} {:>8}Mi {:>8}Mi {:>8}Mi {:>8}Ki {:>6} {:>8} {:>8}",
            c.label,
            format!("{:?}", c.lifecycle),
            c.role(Role::Weights).live_bytes / MIB,
            c.role(Role::KvCache).live_bytes / MIB,
            c.role(Role::Activation).live_bytes / MIB,
            t.pending_bytes / 1024,
            c.pins.total(),
            c.counters.retired,
            c.counters.admission_refusals,
        );
    }
}

fn print_report(r: &TeardownReport) {
    println!(
        "     teardown of {} '{}': {} releases retired, {} abandoned, {} reclaimed, lost={}, forced={}, {:.1?} after retire, backend {}",
        r.context,
        r.label,
        r.retired_releases,
        r.abandoned_releases,
        r.reclaimed_buffers,
        r.lost,
        r.forced,
        r.elapsed,
        if r.backend_result.is_ok() { "ok".to_owned() } else { format!("{:?}", r.backend_result) }
    );
}

struct Llm {
    ctx: ContextHandle<Ctx>,
    load: GovernedStream<Ctx>,
    decode: GovernedStream<Ctx>,
    weights: Vec<(DeviceBuffer<Ctx>, u64)>,
    kv: Kv,
}

const WEIGHT_SHARDS: usize = 8;
const SHARD: u64 = 16 * MIB;
const SAMPLE: usize = 256 * 1024;

fn llm_on(
    gov: &Governor<Ctx>,
    backend: Ctx,
    label: &str,
    args: &RunArgs,
    shared: Option<SharedBudget>,
) -> Result<Llm, String> {
    let mut cfg = ContextConfig::new()
        .label(label)
        .budget(args.llm_budget_mib * MIB)
        .admission(Admission::WaitForPending {
            timeout: Duration::from_secs(5),
        });
    if let Some(s) = shared {
        cfg = cfg.shared_budget(s);
    }
    let ctx = gov.register(backend, cfg);
    let kv: Kv = Arc::new(Mutex::new(VecDeque::new()));
    // Evict least-recently-used KV blocks when an allocation does not fit.
    // Called with no governor lock held; buffers are dropped outside our lock.
    let lru = kv.clone();
    ctx.add_pressure_responder(move |req| {
        let mut evicted = Vec::new();
        let mut freed = 0;
        {
            let mut q = lru.lock().unwrap();
            while freed < req.shortfall {
                match q.pop_front() {
                    Some(b) => {
                        freed += b.len();
                        evicted.push(b);
                    }
                    None => break,
                }
            }
        }
        drop(evicted);
        freed
    });
    let load = ctx.create_stream("load").map_err(|e| e.to_string())?;
    let decode = ctx.create_stream("decode").map_err(|e| e.to_string())?;
    Ok(Llm {
        ctx,
        load,
        decode,
        weights: Vec::new(),
        kv,
    })
}

fn serve(llm: &Llm, request: u32, steps: u32) -> Result<(), String> {
    for step in 0..steps {
        let act = llm
            .ctx
            .allocate(&llm.decode, 4 * MIB, Role::Activation)
            .map_err(|e| e.to_string())?;
        let data = fill((request as u64) << 32 | step as u64, 4096);
        act.write(0, &data).map_err(|e| e.to_string())?;
        let mut back = vec![0u8; data.len()];
        act.read(0, &mut back).map_err(|e| e.to_string())?;
        if back != data {
            return Err(format!(
                "request {request} step {step}: activation read back wrong"
            ));
        }
        let block = llm
            .ctx
            .allocate(&llm.decode, 2 * MIB, Role::KvCache)
            .map_err(|e| e.to_string())?;
        block.write(0, &data[..512]).map_err(|e| e.to_string())?;
        llm.kv.lock().unwrap().push_back(block);
        drop(act); // stream-ordered: retires behind this step's work
    }
    Ok(())
}

pub fn run(args: RunArgs) -> ExitCode {
    match run_inner(&args) {
        Ok(()) => {
            println!("memgov run: ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("memgov run: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_inner(args: &RunArgs) -> Result<(), String> {
    let start = Instant::now();
    println!(
        "memgov run: embedded host backend, {} requests x {} steps, {} MiB devices, {} us per device op",
        args.requests, args.steps, args.device_mib, args.op_delay_us
    );
    let gov: Governor<Ctx> = Governor::new();
    let (dev0, probe0) = device("sim-gpu0 (llm)", 0, args)?;
    let (dev0b, probe0b) = device("sim-gpu0 (embedder)", 0, args)?;
    // Both contexts live on "gpu0": one budget for the physical device.
    let gpu0 = SharedBudget::new("gpu0", args.device_mib * MIB);
    let llm = llm_on(&gov, dev0, "llm@gpu0", args, Some(gpu0.clone()))?;
    let embedder = gov.register(
        dev0b,
        ContextConfig::new()
            .label("embedder@gpu0")
            .budget(64 * MIB)
            .shared_budget(gpu0.clone()),
    );
    let emb_stream = embedder.create_stream("embed").map_err(|e| e.to_string())?;
    let plugin: Arc<dyn ProviderContextPinSource> = llm.ctx.pin_source(Some("tokenizer-plugin"));
    let plugin_pin = plugin.pin().map_err(|e| e.to_string())?;

    println!(
        "phase 1: load {} x {} MiB weights on {}",
        WEIGHT_SHARDS,
        SHARD / MIB,
        llm.ctx.label()
    );
    let mut llm = llm;
    for i in 0..WEIGHT_SHARDS {
        let w = llm
            .ctx
            .allocate(&llm.load, SHARD, Role::Weights)
            .map_err(|e| e.to_string())?;
        let sample = fill(1000 + i as u64, SAMPLE);
        w.write(0, &sample).map_err(|e| e.to_string())?;
        llm.weights.push((w, checksum(&sample)));
    }
    let emb_weights = embedder
        .allocate(&emb_stream, 32 * MIB, Role::Weights)
        .map_err(|e| e.to_string())?;
    print_snapshot(&gov, "after loading");

    let half = args.requests / 2;
    println!(
        "phase 2: serve {half} requests on {} (KV cache grows until pressure evicts)",
        llm.ctx.label()
    );
    for r in 0..half {
        serve(&llm, r, args.steps)?;
        let ws = embedder
            .allocate(&emb_stream, 8 * MIB, Role::Workspace)
            .map_err(|e| e.to_string())?;
        drop(ws);
    }
    let snap = llm.ctx.snapshot();
    println!(
        "     pressure responder calls: {}, admission waits: {}, KV blocks resident: {}",
        snap.counters.pressure_calls,
        snap.counters.admission_waits,
        llm.kv.lock().unwrap().len()
    );
    print_snapshot(&gov, "after serving on gpu0");

    println!("phase 3: move the LLM to gpu1 and retire llm@gpu0");
    let (dev1, probe1) = device("sim-gpu1 (llm)", 1, args)?;
    let mut moved = llm_on(&gov, dev1, "llm@gpu1", args, None)?;
    for (i, (w, sum)) in llm.weights.iter().enumerate() {
        let mut sample = vec![0u8; SAMPLE];
        w.read(0, &mut sample).map_err(|e| e.to_string())?;
        if checksum(&sample) != *sum {
            return Err(format!("weight shard {i} corrupted before the move"));
        }
        let nw = moved
            .ctx
            .allocate(&moved.load, w.len(), Role::Weights)
            .map_err(|e| e.to_string())?;
        nw.write(0, &sample).map_err(|e| e.to_string())?;
        let mut check = vec![0u8; SAMPLE];
        nw.read(0, &mut check).map_err(|e| e.to_string())?;
        if checksum(&check) != *sum {
            return Err(format!("weight shard {i} corrupted by the move"));
        }
        moved.weights.push((nw, *sum));
    }
    // Let go of everything on gpu0; the last releases are still pending on
    // the device when retire() is called.
    let old = llm;
    let retire = old.ctx.retire();
    let refused = old.ctx.allocate(&old.decode, MIB, Role::Activation);
    println!(
        "     allocation on the retiring context: {}",
        refused
            .err()
            .map_or("admitted (BUG)".into(), |e| e.to_string())
    );
    let Llm {
        ctx: old_ctx,
        load,
        decode,
        weights,
        kv,
    } = old;
    drop(weights);
    kv.lock().unwrap().clear();
    drop((load, decode));
    match retire.wait(Instant::now() + Duration::from_millis(1)) {
        Ok(_) => println!("     (retired at once: nothing was pending)"),
        Err(e) => println!("     before the plugin lets go: {e}"),
    }
    drop(plugin_pin);
    let report = retire
        .wait(Instant::now() + Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    print_report(&report);
    let _ = old_ctx;

    println!(
        "phase 4: serve {} more requests on {}",
        args.requests - half,
        moved.ctx.label()
    );
    for r in half..args.requests {
        serve(&moved, r, args.steps)?;
    }
    print_snapshot(&gov, "after serving on gpu1");

    println!("phase 5: retire everything");
    drop(emb_weights);
    drop(emb_stream);
    let Llm {
        ctx: moved_ctx,
        load,
        decode,
        weights,
        kv,
    } = moved;
    drop(weights);
    kv.lock().unwrap().clear();
    drop((load, decode));
    for ctx in [&embedder, &moved_ctx] {
        let r = ctx
            .retire()
            .wait(Instant::now() + Duration::from_secs(30))
            .map_err(|e| e.to_string())?;
        print_report(&r);
    }
    print_snapshot(&gov, "final");

    let final_snap = gov.snapshot();
    let total = final_snap.total();
    if total != Default::default() || final_snap.contexts.iter().any(|c| c.charged != 0) {
        return Err(format!("accounting not back to zero: {total:?}"));
    }
    if gpu0.charged() != 0 {
        return Err(format!(
            "shared budget gpu0 still charged {} B",
            gpu0.charged()
        ));
    }
    for (name, p) in [
        ("gpu0 llm", &probe0),
        ("gpu0 embedder", &probe0b),
        ("gpu1", &probe1),
    ] {
        if p.violations() != 0 || p.teardowns() != 1 || p.used_bytes() != 0 {
            return Err(format!("{name}: {p:?} {:?}", p.violation_log()));
        }
    }
    let served: u64 = final_snap
        .contexts
        .iter()
        .map(|c| c.counters.allocations)
        .sum();
    println!(
        "     {} allocations, every context terminated, 0 B charged, 0 contract violations on 3 simulated devices, {:.2?}",
        served,
        start.elapsed()
    );
    Ok(())
}
