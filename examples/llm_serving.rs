//! An LLM-serving loop on governed memory, the worked example of
//! `docs/llm-serving.md`: each request reserves KV-cache capacity before it
//! decodes and grows the reservation one block per token block; when the
//! device budget refuses a grow, the coldest request is offloaded to pinned
//! host memory (its blocks copied out, its device reservation and blocks
//! released stream-ordered) and brought back when its turn comes. An
//! embedding model on the same device keeps a cache that the device's
//! shared budget reclaims first, by priority, when the LLM loads its
//! weights.
//!
//! It runs on the embedded host backend, so anywhere, and checks what it
//! claims: every block reads back what was written into it, however often
//! its request moved between tiers, and every byte is back at the end.
//!
//! ```sh
//! cargo run -p memgov --example llm_serving
//! ```

use memgov::host::{HostConfig, HostContext};
use memgov::{
    Alloc, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor, GovernorError,
    Reservation, Reserve, Role, SharedBudget, Tier,
};
use std::collections::VecDeque;
use std::error::Error;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;
/// One KV-cache block: the keys and values of one block of tokens.
const BLOCK: u64 = MIB;
/// The device: 40 MiB shared by the LLM and the embedder.
const DEVICE: u64 = 40 * MIB;
/// The embedder's cache: 12 buffers of 2 MiB.
const EMBEDDER_CACHE: u64 = 12;
/// The LLM's own budget on the device (its weights and at most 12 KV
/// blocks), and its pinned host staging.
const LLM_BUDGET: u64 = 32 * MIB;
const PINNED: u64 = 48 * MIB;
const WEIGHTS: u64 = 20 * MIB;
/// Requests decoding at once, and token blocks each decodes.
const REQUESTS: u32 = 8;
const TOKEN_BLOCKS: u32 = 6;

type Ctx = ContextHandle<HostContext>;
type Buffer = DeviceBuffer<HostContext>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llm_serving: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Where a request's KV cache lives now.
enum Kv {
    /// On the device: the reservation it grows, and its blocks.
    Device {
        reservation: Reservation<HostContext>,
        blocks: Vec<Buffer>,
    },
    /// Offloaded: its blocks in pinned host memory.
    Pinned { blocks: Vec<Buffer> },
}

struct Request {
    id: u32,
    decoded: u32,
    kv: Kv,
}

/// What the run counts, to report and to check.
#[derive(Default)]
struct Tally {
    grows: u64,
    offloads: u64,
    restores: u64,
    blocks_copied: u64,
    peak_pinned: u64,
}

/// The header written at the start of each block: which request and which
/// block, so a block that moved between tiers can be checked.
fn header(request: u32, block: u32) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&request.to_le_bytes());
    h[4..].copy_from_slice(&block.to_le_bytes());
    h
}

fn run() -> Result<(), Box<dyn Error>> {
    let gov = Governor::new();
    let device = SharedBudget::new("gpu0", DEVICE);
    let host = || HostContext::new(HostConfig::default());

    // The embedder keeps finished embeddings' buffers cached: cheap to
    // rebuild, so its responder has the lowest priority (asked first).
    let embedder = gov.register(
        host()?,
        ContextConfig::new()
            .label("embedder")
            .budget(EMBEDDER_CACHE * 2 * MIB)
            .shared_budget(device.clone()),
    );
    let emb_stream = embedder.create_stream("embed")?;
    let cache: Arc<Mutex<Vec<Buffer>>> = Arc::default();
    let evictable = cache.clone();
    let evict_stream = emb_stream.clone();
    embedder.add_pressure_responder(0, move |req| {
        let mut freed = 0;
        let mut gone = Vec::new();
        {
            let mut c = evictable.lock().unwrap_or_else(|e| e.into_inner());
            while freed < req.shortfall {
                let Some(b) = c.pop() else { break };
                freed += b.len();
                gone.push(b);
            }
        }
        drop(gone);
        // Freed stream-ordered: the bytes are back once the frees retire.
        let _ = evict_stream.synchronize();
        freed
    });
    for _ in 0..EMBEDDER_CACHE {
        let b = embedder.allocate(&emb_stream, Alloc::new(2 * MIB, Role::Workspace))?;
        cache.lock().unwrap_or_else(|e| e.into_inner()).push(b);
    }

    let llm = gov.register(
        host()?,
        ContextConfig::new()
            .label("llm")
            .budget(LLM_BUDGET)
            .shared_budget(device.clone())
            .tier_budget(Tier::PinnedHost, PINNED),
    );
    let decode = llm.create_stream("decode")?;
    let copy = llm.create_stream("offload")?;

    // Weights: the embedder's cache leaves the device too little room, so
    // the shared budget's refusal asks the responders of every context on
    // it, lowest priority first, and what they free goes to this request.
    let weights = llm.allocate(&decode, Alloc::new(WEIGHTS, Role::Weights))?;
    let emb_cached = cache.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
    println!(
        "weights: {} MiB loaded; the embedder's cache gave back {} MiB first ({emb_cached} of {EMBEDDER_CACHE} buffers left)",
        WEIGHTS / MIB,
        (EMBEDDER_CACHE - emb_cached) * 2,
    );
    if emb_cached == EMBEDDER_CACHE {
        return Err("loading the weights reclaimed nothing from the embedder's cache".into());
    }
    // The embedder's batch is done: it lets its cache go, and the LLM's
    // own budget is what limits its KV cache from here on.
    cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    emb_stream.synchronize()?;

    let mut tally = Tally::default();
    // Coldest first: the request decoded least recently is at the front.
    let mut active: VecDeque<Request> = VecDeque::new();
    for id in 0..REQUESTS {
        let reservation = reserve_or_offload(&llm, &decode, &copy, &mut active, &mut tally, id)?;
        active.push_back(Request {
            id,
            decoded: 0,
            kv: Kv::Device {
                reservation,
                blocks: Vec::new(),
            },
        });
    }

    // Round-robin decoding: one token block per turn.
    while let Some(mut r) = active.pop_front() {
        if let Kv::Pinned { .. } = r.kv {
            restore(&llm, &decode, &copy, &mut active, &mut tally, &mut r)?;
        }
        let Kv::Device {
            reservation,
            blocks,
        } = &mut r.kv
        else {
            unreachable!("restored above");
        };
        // Grow by one block; a refusal offloads the coldest request.
        loop {
            match reservation.grow(BLOCK) {
                Ok(()) => break,
                Err(GovernorError::BudgetExceeded(_))
                    if offload_coldest(&llm, &decode, &copy, &mut active, &mut tally)? => {}
                Err(e) => return Err(e.into()),
            }
        }
        tally.grows += 1;
        let block = reservation.allocate(&decode, Alloc::new(BLOCK, Role::KvCache))?;
        block.write(0, &header(r.id, r.decoded))?;
        blocks.push(block);
        r.decoded += 1;
        if r.decoded < TOKEN_BLOCKS {
            active.push_back(r);
        } else {
            verify(&r)?;
            // Finished: its blocks and what is left of its reservation go
            // back, stream-ordered.
            drop(r);
        }
        let pinned = llm
            .snapshot()
            .tier(Tier::PinnedHost)
            .map_or(0, |t| t.charged);
        tally.peak_pinned = tally.peak_pinned.max(pinned);
    }

    drop(weights);
    drop((decode, copy, emb_stream));
    for ctx in [&llm, &embedder] {
        ctx.retire()
            .wait_timeout(std::time::Duration::from_secs(30))?;
    }
    let snap = llm.snapshot();
    let pinned = snap.tier(Tier::PinnedHost).map_or(0, |t| t.charged);
    println!(
        "served {REQUESTS} requests x {TOKEN_BLOCKS} token blocks: {} grows, {} offloads to pinned host, {} restores, {} blocks copied, pinned peak {} MiB",
        tally.grows,
        tally.offloads,
        tally.restores,
        tally.blocks_copied,
        tally.peak_pinned / MIB
    );
    if tally.offloads == 0 || tally.restores == 0 {
        return Err("the device never ran short: nothing was offloaded and restored".into());
    }
    if snap.charged != 0 || pinned != 0 || device.charged() != 0 {
        return Err(format!(
            "bytes left: {} on the LLM's device budget, {pinned} pinned, {} on gpu0",
            snap.charged,
            device.charged()
        )
        .into());
    }
    println!("every block read back what was written; every byte is back");
    Ok(())
}

/// Reserve the first block of request `id`, offloading cold requests while
/// the device budget refuses.
fn reserve_or_offload(
    llm: &Ctx,
    decode: &GovernedStream<HostContext>,
    copy: &GovernedStream<HostContext>,
    active: &mut VecDeque<Request>,
    tally: &mut Tally,
    id: u32,
) -> Result<Reservation<HostContext>, Box<dyn Error>> {
    loop {
        match llm.reserve(Reserve::new(BLOCK, &format!("request-{id}"))) {
            Ok(r) => return Ok(r),
            Err(GovernorError::BudgetExceeded(_))
                if offload_coldest(llm, decode, copy, active, tally)? => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Offload the coldest request still on the device: copy its blocks into
/// pinned host memory, then release its device blocks and reservation and
/// wait for those frees to retire, so their bytes are back in the budget.
/// Returns false when no request is left on the device.
fn offload_coldest(
    llm: &Ctx,
    decode: &GovernedStream<HostContext>,
    copy: &GovernedStream<HostContext>,
    active: &mut VecDeque<Request>,
    tally: &mut Tally,
) -> Result<bool, Box<dyn Error>> {
    let Some(r) = active
        .iter_mut()
        .find(|r| matches!(&r.kv, Kv::Device { blocks, .. } if !blocks.is_empty()))
    else {
        return Ok(false);
    };
    let Kv::Device { blocks, .. } = &r.kv else {
        unreachable!()
    };
    let staging = llm.reserve(
        Reserve::new(
            blocks.len() as u64 * BLOCK,
            &format!("request-{} offload", r.id),
        )
        .tier(Tier::PinnedHost),
    )?;
    let mut pinned = Vec::with_capacity(blocks.len());
    let mut bytes = vec![0u8; BLOCK as usize];
    for b in blocks {
        b.read(0, &mut bytes)?;
        let p = staging.allocate(copy, Alloc::new(BLOCK, Role::KvCache))?;
        p.write(0, &bytes)?;
        pinned.push(p);
    }
    tally.blocks_copied += pinned.len() as u64;
    // The device blocks and the reservation go. Each block's free runs on
    // its stream behind the reads of it; once they have retired, their
    // bytes are back in the budget.
    r.kv = Kv::Pinned { blocks: pinned };
    decode.synchronize()?;
    tally.offloads += 1;
    Ok(true)
}

/// Bring an offloaded request back to the device before it decodes.
fn restore(
    llm: &Ctx,
    decode: &GovernedStream<HostContext>,
    copy: &GovernedStream<HostContext>,
    active: &mut VecDeque<Request>,
    tally: &mut Tally,
    r: &mut Request,
) -> Result<(), Box<dyn Error>> {
    let Kv::Pinned { blocks } = &r.kv else {
        return Ok(());
    };
    let need = blocks.len() as u64 * BLOCK;
    let reservation = loop {
        match llm.reserve(Reserve::new(need, &format!("request-{}", r.id))) {
            Ok(res) => break res,
            Err(GovernorError::BudgetExceeded(_))
                if offload_coldest(llm, decode, copy, active, tally)? => {}
            Err(e) => return Err(e.into()),
        }
    };
    let mut device = Vec::with_capacity(blocks.len());
    let mut bytes = vec![0u8; BLOCK as usize];
    for p in blocks {
        p.read(0, &mut bytes)?;
        let b = reservation.allocate(decode, Alloc::new(BLOCK, Role::KvCache))?;
        b.write(0, &bytes)?;
        device.push(b);
    }
    tally.blocks_copied += device.len() as u64;
    tally.restores += 1;
    // The pinned blocks go, stream-ordered behind the reads of them.
    r.kv = Kv::Device {
        reservation,
        blocks: device,
    };
    Ok(())
}

/// Every block of a finished request holds the header written into it.
fn verify(r: &Request) -> Result<(), Box<dyn Error>> {
    let (Kv::Device { blocks, .. } | Kv::Pinned { blocks }) = &r.kv;
    for (i, b) in blocks.iter().enumerate() {
        let mut h = [0u8; 8];
        b.read(0, &mut h)?;
        if h != header(r.id, i as u32) {
            return Err(format!(
                "request {} block {i} reads {h:?} after moving between tiers",
                r.id
            )
            .into());
        }
    }
    Ok(())
}
