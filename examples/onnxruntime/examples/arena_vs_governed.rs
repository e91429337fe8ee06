//! ONNX Runtime's own CPU arena against governed memory, on real models.
//!
//! For each model, two sessions are built in this one process: one on ONNX
//! Runtime's CPU arena allocator (the default), one whose weights and
//! allocations are governed (`GovernedAllocator::session` on a host
//! context). Both get the same inputs, synthesised from the model's input
//! types and shapes (a dynamic batch dimension is 1, other dynamic
//! dimensions are `--dim`, 320 unless told). After a warm-up their `run`s
//! are timed in alternation (the order flips every round, so drift on a
//! shared machine hits both alike), each run including the release of its
//! outputs, and the medians compared. This is done twice per model: with
//! ONNX Runtime's memory-pattern planning on (intermediates carved out of
//! one planned block per run) and off (every intermediate is its own
//! allocation).
//!
//! Columns: allocations per run that ONNX Runtime asked the governed
//! allocator for (`alloc/run`) and their size (`KiB/run`), the context's
//! admitted allocations per run (`admit/run`), minor page faults per run of
//! each session (the process's, from `getrusage`), the two wall-clock
//! medians and their ratio (governed / arena), and the ratio of the medians
//! of the process's CPU time per run (`cpu ratio`: the stream worker's frees
//! included, other processes' use of the cores not), and once the cost of a
//! bare governed allocation and release. Timing is reported, never
//! asserted. What is checked (the exit status fails otherwise): both
//! sessions give the same outputs, bit for bit; the governed session made
//! allocations through memgov on every run; the arena session made none;
//! and all governed memory comes back.
//!
//! ```sh
//! cargo run --release --manifest-path examples/onnxruntime/Cargo.toml \
//!     --example arena_vs_governed -- [--quick] [--json] [--rounds N] \
//!     [--warmup N] [--dim N] [--pattern on|off|both] [--cache MIB] [model.onnx ...]
//! ```
//!
//! Models: the paths given, or else those in `MEMGOV_ORT_MODELS` (separated
//! by `:`; `scripts/ci/60-onnxruntime.sh` fetches five and sets it). Needs
//! `ORT_DYLIB_PATH`. `--quick` is one warm-up and five rounds (for CI).
//! `--cache MIB` sizes the governed context's block cache
//! (`ContextConfig::cache`; default 256 MiB, 0 turns it off).

use memgov::host::{HostConfig, HostContext};
use memgov::{Admission, Alloc, CacheConfig, ContextConfig, ContextHandle, Governor, Role};
use memgov_onnxruntime::{environment, GovernedAllocator};
use ort::session::builder::SessionBuilder;
use ort::session::{Session, SessionOutputs};
use ort::value::{DynValue, Tensor, TensorElementType, ValueType};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How the comparison is run.
struct Options {
    warmup: usize,
    rounds: usize,
    dim: i64,
    json: bool,
    patterns: Vec<bool>,
    /// The governed context's block cache, MiB (0: off).
    cache_mib: u64,
    models: Vec<String>,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut o = Options {
            warmup: 5,
            rounds: 50,
            dim: 320,
            json: false,
            patterns: vec![true, false],
            cache_mib: 256,
            models: Vec::new(),
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut number = |name: &str| -> Result<usize, String> {
                let v = args.next().ok_or(format!("{name} needs a number"))?;
                v.parse()
                    .map_err(|e| format!("{name} {v}: {e} (a whole number is expected)"))
            };
            match arg.as_str() {
                "--quick" => (o.warmup, o.rounds) = (1, 5),
                "--json" => o.json = true,
                "--rounds" => o.rounds = number("--rounds")?.max(1),
                "--warmup" => o.warmup = number("--warmup")?,
                "--pattern" => {
                    o.patterns = match args.next().as_deref() {
                        Some("on") => vec![true],
                        Some("off") => vec![false],
                        Some("both") => vec![true, false],
                        other => {
                            return Err(format!("--pattern {other:?}: on, off or both"));
                        }
                    }
                }
                "--cache" => o.cache_mib = number("--cache")? as u64,
                "--dim" => o.dim = i64::try_from(number("--dim")?.max(1)).unwrap_or(320),
                flag if flag.starts_with("--") => {
                    return Err(format!(
                    "unknown option {flag} (known: --quick --json --rounds N --warmup N --dim N --pattern on|off|both --cache MIB)"
                ))
                }
                path => o.models.push(path.to_owned()),
            }
        }
        if o.models.is_empty() {
            let list = std::env::var("MEMGOV_ORT_MODELS").map_err(|_| {
                "no model given and MEMGOV_ORT_MODELS is not set \
                 (scripts/ci/60-onnxruntime.sh fetches real models and sets it)"
                    .to_owned()
            })?;
            o.models = list
                .split(':')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
        }
        Ok(o)
    }
}

/// One model under one memory-pattern setting.
struct Row {
    model: String,
    pattern: bool,
    inputs: String,
    allocations_per_run: f64,
    bytes_per_run: f64,
    admitted_per_run: f64,
    arena_faults_per_run: f64,
    governed_faults_per_run: f64,
    arena_median: Duration,
    governed_median: Duration,
    arena_cpu_median: Duration,
    governed_cpu_median: Duration,
}

impl Row {
    /// Governed / arena, wall-clock medians.
    fn ratio(&self) -> f64 {
        self.governed_median.as_secs_f64() / self.arena_median.as_secs_f64()
    }

    /// Governed / arena, process CPU-time medians.
    fn cpu_ratio(&self) -> f64 {
        self.governed_cpu_median.as_secs_f64() / self.arena_cpu_median.as_secs_f64()
    }
}

/// A short name for a model file: its stem, or its directory's name when
/// the file is just `model.onnx`.
fn model_name(path: &str) -> String {
    let p = std::path::Path::new(path);
    let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or(path);
    match (stem, p.parent().and_then(|d| d.file_name())) {
        ("model", Some(dir)) => dir.to_string_lossy().into_owned(),
        _ => stem.to_owned(),
    }
}

/// Deterministic filler: `i`-th value of a sequence in [0, 1).
fn unit(i: usize) -> f32 {
    // A multiplicative hash, so that the values are not all alike.
    let h = (i as u32).wrapping_mul(2_654_435_761) >> 8;
    h as f32 / (1u32 << 24) as f32
}

/// Inputs of the models `scripts/ci/60-onnxruntime.sh` fetches whose valid
/// shape or value the generic rule (dynamic batch 1, other dynamic
/// dimensions `--dim`, integers counting up) does not give: model name,
/// input name, shape, and the value of every element (integers) if fixed.
const KNOWN: &[(&str, &str, &[i64], Option<i64>)] = &[
    // 512 samples at 16 kHz, one stream of LSTM state.
    ("silero_vad", "input", &[1, 512], None),
    ("silero_vad", "state", &[2, 1, 128], None),
    ("silero_vad", "sr", &[], Some(16_000)),
    // Text lines are 48 pixels high; the classifier takes 48 x 192 crops.
    ("ch_PP-OCRv4_rec_infer", "x", &[1, 3, 48, 320], None),
    (
        "ch_ppocr_mobile_v2.0_cls_infer",
        "x",
        &[1, 3, 48, 192],
        None,
    ),
];

/// An input tensor for `ty` with `shape` (dynamic dimensions resolved).
/// Floats are in [0, 1); integers are `fixed` or count up in [0, 256),
/// which indexes any embedding table of a byte model; booleans alternate.
fn synthesize(
    name: &str,
    ty: TensorElementType,
    shape: &[i64],
    fixed: Option<i64>,
) -> Result<DynValue, String> {
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let n: usize = dims.iter().product();
    let fail = |e: ort::Error| format!("input {name:?}: {e}");
    let int = |i: usize| fixed.unwrap_or((i % 256) as i64);
    Ok(match ty {
        TensorElementType::Float32 => {
            Tensor::from_array((dims, (0..n).map(unit).collect::<Vec<f32>>()))
                .map_err(fail)?
                .into_dyn()
        }
        TensorElementType::Float64 => Tensor::from_array((
            dims,
            (0..n).map(|i| f64::from(unit(i))).collect::<Vec<f64>>(),
        ))
        .map_err(fail)?
        .into_dyn(),
        TensorElementType::Int64 => Tensor::from_array((dims, (0..n).map(int).collect::<Vec<_>>()))
            .map_err(fail)?
            .into_dyn(),
        TensorElementType::Int32 => {
            Tensor::from_array((dims, (0..n).map(|i| int(i) as i32).collect::<Vec<_>>()))
                .map_err(fail)?
                .into_dyn()
        }
        TensorElementType::Uint8 => {
            Tensor::from_array((dims, (0..n).map(|i| int(i) as u8).collect::<Vec<_>>()))
                .map_err(fail)?
                .into_dyn()
        }
        TensorElementType::Bool => {
            Tensor::from_array((dims, (0..n).map(|i| i % 2 == 0).collect::<Vec<_>>()))
                .map_err(fail)?
                .into_dyn()
        }
        other => {
            return Err(format!(
                "input {name:?}: element type {other:?} is not synthesised"
            ))
        }
    })
}

/// Inputs for every input of `session`, and a description like
/// `x:f32[1,3,320,320]`.
fn inputs(
    session: &Session,
    model: &str,
    dim: i64,
) -> Result<(Vec<(String, DynValue)>, String), String> {
    let mut values = Vec::new();
    let mut described = Vec::new();
    for input in session.inputs() {
        let ValueType::Tensor { ty, shape, .. } = input.dtype() else {
            return Err(format!("input {:?} is not a tensor", input.name()));
        };
        let known = KNOWN.iter().find(|k| k.0 == model && k.1 == input.name());
        let shape: Vec<i64> = match known {
            Some(k) => k.2.to_vec(),
            None => shape.to_vec(),
        };
        let shape: Vec<i64> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| match d {
                d if d >= 0 => d,
                _ if i == 0 => 1,
                _ => dim,
            })
            .collect();
        described.push(format!("{}:{ty:?}{:?}", input.name(), shape));
        values.push((
            input.name().to_owned(),
            synthesize(input.name(), *ty, &shape, known.and_then(|k| k.3))?,
        ));
    }
    Ok((values, described.join(" ")))
}

/// The outputs of one run as bytes, by name, in the session's order.
type OutputBytes = Vec<(String, Vec<u8>)>;

/// The outputs of one run as bytes, to compare bit for bit.
fn output_bytes(outputs: &SessionOutputs<'_>) -> Result<OutputBytes, String> {
    let mut all = Vec::new();
    for (name, value) in outputs {
        let bytes = match value.dtype() {
            ValueType::Tensor { ty, .. } => {
                macro_rules! raw {
                    ($t:ty) => {
                        value
                            .try_extract_tensor::<$t>()
                            .map_err(|e| format!("output {name:?}: {e}"))?
                            .1
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect::<Vec<u8>>()
                    };
                }
                match ty {
                    TensorElementType::Float32 => raw!(f32),
                    TensorElementType::Float64 => raw!(f64),
                    TensorElementType::Int64 => raw!(i64),
                    TensorElementType::Int32 => raw!(i32),
                    TensorElementType::Uint8 => raw!(u8),
                    TensorElementType::Int8 => raw!(i8),
                    TensorElementType::Bool => value
                        .try_extract_tensor::<bool>()
                        .map_err(|e| format!("output {name:?}: {e}"))?
                        .1
                        .iter()
                        .map(|&b| u8::from(b))
                        .collect(),
                    other => {
                        return Err(format!(
                            "output {name:?}: element type {other:?} is not compared"
                        ))
                    }
                }
            }
            other => return Err(format!("output {name:?} is not a tensor: {other:?}")),
        };
        all.push((name.to_owned(), bytes));
    }
    Ok(all)
}

/// Minor page faults of the whole process so far (the stream worker that
/// runs the governed frees included).
fn minor_faults() -> u64 {
    // SAFETY: `getrusage` fills the zeroed `rusage` it is given and reads
    // nothing else.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    usage.ru_minflt as u64
}

/// CPU time the whole process has used so far, all its threads together.
/// Unlike wall time it does not count the time other processes on a
/// shared machine hold the cores.
fn process_cpu() -> Duration {
    // SAFETY: `clock_gettime` writes the zeroed `timespec` it is given.
    let t = unsafe {
        let mut t: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t);
        t
    };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// What one `run` cost.
#[derive(Default)]
struct Samples {
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
    faults: u64,
}

/// One `run` of `session` on `inputs` with its outputs dropped, recorded in
/// `samples`; returns its outputs' bytes if `keep`.
fn timed_run(
    session: &mut Session,
    inputs: &[(String, DynValue)],
    keep: bool,
    samples: &mut Samples,
) -> Result<Option<OutputBytes>, String> {
    let refs: Vec<(&str, &DynValue)> = inputs.iter().map(|(n, v)| (n.as_str(), v)).collect();
    let faults = minor_faults();
    let cpu = process_cpu();
    let start = Instant::now();
    let outputs = session.run(refs).map_err(|e| format!("run: {e}"))?;
    let kept = if keep {
        Some(output_bytes(&outputs)?)
    } else {
        None
    };
    drop(outputs);
    samples.wall.push(start.elapsed());
    samples.cpu.push(process_cpu().saturating_sub(cpu));
    samples.faults += minor_faults() - faults;
    Ok(kept)
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

fn configure(b: SessionBuilder, pattern: bool) -> ort::Result<SessionBuilder> {
    // One thread: the same kernels in the same order in both sessions, so
    // their outputs are comparable bit for bit, and less noise on a shared
    // machine.
    Ok(b.with_intra_threads(1)?
        .with_inter_threads(1)?
        .with_memory_pattern(pattern)?)
}

/// Compare the two sessions of `path` with memory patterns `pattern`.
fn compare(
    env: &ort::environment::Environment,
    alloc: &GovernedAllocator<HostContext>,
    ctx: &ContextHandle<HostContext>,
    path: &str,
    pattern: bool,
    o: &Options,
) -> Result<Row, String> {
    let model = std::fs::read(path).map_err(|e| format!("reading {path}: {e}"))?;
    let before = alloc.stats().allocations;
    let mut arena = configure(Session::builder(env).map_err(|e| e.to_string())?, pattern)
        .and_then(|mut b| b.commit_from_memory(&model))
        .map_err(|e| format!("arena session: {e}"))?;
    if alloc.stats().allocations != before {
        return Err(format!(
            "the arena session made {} allocations through memgov while it was created; it must make none",
            alloc.stats().allocations - before
        ));
    }
    let mut governed = alloc
        .session(env, &model, |b| configure(b, pattern))
        .map_err(|e| format!("governed session: {e}"))?;
    let (inputs, described) = inputs(&arena, &model_name(path), o.dim)?;

    let mut arena_run = |keep: bool, samples: &mut Samples| {
        let before = alloc.stats().allocations;
        let kept = timed_run(&mut arena, &inputs, keep, samples)?;
        match alloc.stats().allocations - before {
            0 => Ok(kept),
            n => Err(format!(
                "the arena session made {n} allocations through memgov in a run; it must make none"
            )),
        }
    };
    let mut no_allocation = 0;
    let mut governed_run = |keep: bool, samples: &mut Samples| {
        let before = alloc.stats().allocations;
        let kept = timed_run(&mut governed, &inputs, keep, samples)?;
        if alloc.stats().allocations == before {
            no_allocation += 1;
        }
        Ok::<_, String>(kept)
    };

    // Warm-up; the first runs' outputs are compared.
    for warmup in 0..o.warmup.max(1) {
        let a = arena_run(warmup == 0, &mut Samples::default())?;
        let g = governed_run(warmup == 0, &mut Samples::default())?;
        if let (Some(a), Some(g)) = (a, g) {
            if a.len() != g.len() {
                return Err(format!(
                    "{} outputs from the arena session, {} from the governed one",
                    a.len(),
                    g.len()
                ));
            }
            for ((na, ba), (ng, bg)) in a.iter().zip(&g) {
                if na != ng || ba != bg {
                    let differ = ba.iter().zip(bg).filter(|(x, y)| x != y).count();
                    return Err(format!(
                        "output {na:?}: the two sessions differ ({} and {} bytes, {differ} bytes differ)",
                        ba.len(),
                        bg.len()
                    ));
                }
            }
        }
    }

    let (mut a, mut g) = (Samples::default(), Samples::default());
    let stats_before = alloc.stats();
    let admitted_before = ctx.snapshot().counters.allocations;
    for round in 0..o.rounds {
        if round % 2 == 0 {
            arena_run(false, &mut a)?;
            governed_run(false, &mut g)?;
        } else {
            governed_run(false, &mut g)?;
            arena_run(false, &mut a)?;
        }
    }
    if no_allocation > 0 {
        return Err(format!(
            "{no_allocation} of {} governed runs made no allocation through memgov",
            o.rounds + o.warmup.max(1)
        ));
    }
    let n = o.rounds as f64;
    let row = Row {
        model: model_name(path),
        pattern,
        inputs: described,
        allocations_per_run: (alloc.stats().allocations - stats_before.allocations) as f64 / n,
        bytes_per_run: (alloc.stats().allocated_bytes - stats_before.allocated_bytes) as f64 / n,
        admitted_per_run: (ctx.snapshot().counters.allocations - admitted_before) as f64 / n,
        arena_faults_per_run: a.faults as f64 / n,
        governed_faults_per_run: g.faults as f64 / n,
        arena_median: median(&a.wall),
        governed_median: median(&g.wall),
        arena_cpu_median: median(&a.cpu),
        governed_cpu_median: median(&g.cpu),
    };
    drop(governed);
    drop(arena);
    Ok(row)
}

/// The mean time of one governed allocation of `bytes` and its
/// stream-ordered release on `ctx`, with nothing written to it: the
/// governor's and the backend's cost per allocation, without ONNX Runtime.
fn cycle(ctx: &ContextHandle<HostContext>, bytes: u64, n: u32) -> Result<Duration, String> {
    let stream = ctx
        .create_stream("cycle")
        .map_err(|e| format!("a stream for the allocation cycle: {e}"))?;
    let once = || {
        ctx.allocate(&stream, Alloc::new(bytes, Role::Activation))
            .map(drop)
            .map_err(|e| format!("allocating {bytes} B: {e}"))
    };
    for _ in 0..n / 10 {
        once()?;
    }
    let start = Instant::now();
    for _ in 0..n {
        once()?;
    }
    let elapsed = start.elapsed();
    stream
        .synchronize()
        .map_err(|e| format!("synchronizing the cycle's stream: {e}"))?;
    Ok(elapsed / n)
}

/// [`cycle`] for a small and a large allocation.
struct Cycles {
    small: Duration,
    large: Duration,
}

const SMALL: u64 = 256;
const LARGE: u64 = 1 << 20;

fn print_table(rows: &[Row], cycles: &Cycles, o: &Options) {
    println!(
        "ONNX Runtime arena vs governed memory: {} warm-up + {} alternating rounds per session, 1 thread, medians; governed block cache {}",
        o.warmup.max(1),
        o.rounds,
        if o.cache_mib > 0 {
            format!("on ({} MiB)", o.cache_mib)
        } else {
            "off".to_owned()
        }
    );
    println!(
        "{:<31} {:>7} {:>9} {:>8} {:>9} {:>11} {:>12} {:>11} {:>11} {:>6} {:>9}",
        "model",
        "pattern",
        "alloc/run",
        "KiB/run",
        "admit/run",
        "arena flt/r",
        "memgov flt/r",
        "arena",
        "memgov",
        "ratio",
        "cpu ratio"
    );
    for r in rows {
        println!(
            "{:<31} {:>7} {:>9.1} {:>8.0} {:>9.1} {:>11.1} {:>12.1} {:>9.3}ms {:>9.3}ms {:>5.2}x {:>8.2}x",
            r.model,
            if r.pattern { "on" } else { "off" },
            r.allocations_per_run,
            r.bytes_per_run / 1024.0,
            r.admitted_per_run,
            r.arena_faults_per_run,
            r.governed_faults_per_run,
            r.arena_median.as_secs_f64() * 1e3,
            r.governed_median.as_secs_f64() * 1e3,
            r.ratio(),
            r.cpu_ratio()
        );
    }
    println!(
        "  one governed allocate + release, nothing written: {SMALL} B {:.2}us, {} KiB {:.2}us",
        cycles.small.as_secs_f64() * 1e6,
        LARGE / 1024,
        cycles.large.as_secs_f64() * 1e6
    );
    let mut described = Vec::new();
    for r in rows {
        if !described.contains(&&r.model) {
            described.push(&r.model);
            println!("  {} inputs: {}", r.model, r.inputs);
        }
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn print_json(rows: &[Row], cycles: &Cycles, o: &Options) {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"model\":{},\"memory_pattern\":{},\"inputs\":{},\"allocations_per_run\":{},\
                 \"allocated_bytes_per_run\":{},\"admitted_per_run\":{},\
                 \"arena_minor_faults_per_run\":{},\"governed_minor_faults_per_run\":{},\
                 \"arena_median_ns\":{},\"governed_median_ns\":{},\"ratio\":{:.4},\
                 \"arena_cpu_median_ns\":{},\"governed_cpu_median_ns\":{},\"cpu_ratio\":{:.4}}}",
                json_string(&r.model),
                r.pattern,
                json_string(&r.inputs),
                r.allocations_per_run,
                r.bytes_per_run,
                r.admitted_per_run,
                r.arena_faults_per_run,
                r.governed_faults_per_run,
                r.arena_median.as_nanos(),
                r.governed_median.as_nanos(),
                r.ratio(),
                r.arena_cpu_median.as_nanos(),
                r.governed_cpu_median.as_nanos(),
                r.cpu_ratio()
            )
        })
        .collect();
    println!(
        "{{\"warmup\":{},\"rounds\":{},\"cache_mib\":{},\"intra_threads\":1,\"cycle_ns\":{{\"{SMALL}\":{},\"{LARGE}\":{}}},\"rows\":[{}]}}",
        o.warmup.max(1),
        o.rounds,
        o.cache_mib,
        cycles.small.as_nanos(),
        cycles.large.as_nanos(),
        rows.join(",")
    );
}

fn main() -> ExitCode {
    let o = match Options::parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("arena_vs_governed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let env = match environment() {
        Ok(env) => env,
        Err(why) => {
            eprintln!("arena_vs_governed: {why}");
            return ExitCode::FAILURE;
        }
    };
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).expect("a host context"),
        // Allocations wait for pending releases rather than fail when the
        // stream worker's frees lag behind (the host device's 1 GiB can be
        // all pending in the allocation cycle below).
        {
            let config = ContextConfig::new().label("arena-vs-governed").admission(
                Admission::WaitForPending {
                    timeout: Duration::from_secs(10),
                },
            );
            if o.cache_mib > 0 {
                config.cache(CacheConfig::new(o.cache_mib << 20))
            } else {
                config
            }
        },
    );
    let alloc = match GovernedAllocator::register(&env, &ctx, Role::Activation) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("arena_vs_governed: registering the allocator: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut rows = Vec::new();
    let mut failed = false;
    for path in &o.models {
        for &pattern in &o.patterns {
            match compare(&env, &alloc, &ctx, path, pattern, &o) {
                Ok(row) => rows.push(row),
                Err(e) => {
                    eprintln!(
                        "arena_vs_governed: {} (memory pattern {}): {e}",
                        model_name(path),
                        if pattern { "on" } else { "off" }
                    );
                    failed = true;
                }
            }
        }
    }
    let cycles = match (cycle(&ctx, SMALL, 20_000), cycle(&ctx, LARGE, 2_000)) {
        (Ok(small), Ok(large)) => Cycles { small, large },
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("arena_vs_governed: {e}");
            failed = true;
            Cycles {
                small: Duration::ZERO,
                large: Duration::ZERO,
            }
        }
    };
    if o.json {
        print_json(&rows, &cycles, &o);
    } else {
        print_table(&rows, &cycles, &o);
    }
    let cache = ctx.snapshot().cache;
    if !o.json && cache.enabled {
        println!(
            "  block cache: {} hits; {} cached at the end, {} released under pressure, {} evicted",
            cache.hits,
            memgov::Bytes(cache.cached_bytes),
            memgov::Bytes(cache.pressure_released),
            memgov::Bytes(cache.evicted)
        );
    }
    let stats = alloc.stats();
    drop(alloc);
    if stats.live_bytes != 0 || stats.overdrafts != 0 {
        eprintln!("arena_vs_governed: after the sessions, {stats:?}: expected nothing live and no overdraft");
        failed = true;
    }
    if let Err(e) = ctx.retire().wait(Instant::now() + Duration::from_secs(20)) {
        eprintln!("arena_vs_governed: retiring the context: {e}");
        failed = true;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
