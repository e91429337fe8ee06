//! The out-of-memory situation `docs/diagnosing-oom.md` sets beside
//! PyTorch's message: a 16 GiB device budget holding weights, a KV cache
//! and activations made at three places, asked for 1.25 GiB more. The
//! refusal this prints is the one the page quotes; the test fails when
//! they part.

use memgov::null::NullContext;
use memgov::{Alloc, BudgetExceeded, ContextConfig, Governor, GovernorError, Role};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn refusal() -> Box<BudgetExceeded> {
    let gov = Governor::new();
    let ctx = gov.register(
        NullContext::new(),
        ContextConfig::new()
            .label("llm")
            .budget(16 * GIB)
            .attribution(true),
    );
    let s = ctx.create_stream("main").unwrap();
    let weights = ctx
        .allocate(&s, Alloc::new(10 * GIB, Role::Weights))
        .unwrap();
    let kv: Vec<_> = (0..4)
        .map(|_| {
            ctx.allocate(&s, Alloc::new(GIB, Role::KvCache).label("kv-cache"))
                .unwrap()
        })
        .collect();
    let activations = ctx
        .allocate(&s, Alloc::new(1536 * MIB, Role::Activation))
        .unwrap();
    let e = ctx
        .allocate(&s, Alloc::new(1280 * MIB, Role::Activation))
        .unwrap_err();
    drop((weights, kv, activations));
    match e {
        GovernorError::BudgetExceeded(b) => b,
        other => panic!("expected a budget refusal, got {other}"),
    }
}

#[test]
fn the_page_quotes_the_refusal_this_workload_gets() {
    let b = refusal();
    let text = b.to_string();
    println!("{text}");
    // The largest site first, with its bytes; the way out names it.
    assert_eq!(b.holders.by_site[0].live_bytes, 10 * GIB);
    assert!(b.holders.by_site[0]
        .site
        .starts_with("tests/oom_message.rs:"));
    assert_eq!(b.holders.by_site[1].label.as_deref(), Some("kv-cache"));
    assert_eq!(b.holders.by_site[1].live_bytes, 4 * GIB);
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/diagnosing-oom.md"
    ))
    .expect("docs/diagnosing-oom.md");
    // The page wraps nothing: the message is one line in a text block,
    // quoted whole (the one test of this file registers the process's
    // first context, and with nothing pending the refusal waited for
    // nothing: no timing in it).
    assert!(
        page.lines().any(|l| l == text),
        "docs/diagnosing-oom.md does not quote the refusal as it reads now:\n{text}"
    );
}
