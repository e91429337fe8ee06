//! A process that embeds `memgov::metrics::render` in its own `/metrics`
//! page: it joins a machine ledger, governs one host context under a
//! process limit, allocates, has some allocations refused, and serves its
//! governor's metrics over HTTP until it is killed. The suite's Prometheus
//! step (`scripts/ci/68-prometheus.sh`) runs several of these against one
//! ledger.
//!
//! ```text
//! cargo run --example metrics_worker --features metrics -- \
//!     LEDGER_PATH KEY NAME ALLOC_MIB LIMIT_MIB REFUSALS
//! ```
//!
//! It prints `listening <addr>` (a port the system picked on 127.0.0.1)
//! once its allocations and refusals are done. `MEMGOV_WORKER_BACKEND=cuda`
//! (built with the `cuda` feature) governs a CUDA context instead of a host
//! one.

use memgov::any::AnyContext;
use memgov::host::{HostConfig, HostContext};
use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
use memgov::{Alloc, ContextConfig, Governor, ProcessBudget, Role, SharedBudget};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;

const MIB: u64 = 1 << 20;

fn device_context() -> AnyContext {
    match std::env::var("MEMGOV_WORKER_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("host") => HostContext::new(HostConfig {
            capacity: 1 << 40,
            ..HostConfig::default()
        })
        .expect("a host context")
        .into(),
        #[cfg(feature = "cuda")]
        Ok("cuda") => memgov::cuda::CudaContext::new(memgov::cuda::CudaConfig::default())
            .unwrap_or_else(|e| panic!("MEMGOV_WORKER_BACKEND=cuda: no CUDA context: {e}"))
            .into(),
        Ok(other) => panic!(
            "MEMGOV_WORKER_BACKEND={other}: not a backend this build has (host, or cuda with --features cuda)"
        ),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 6 {
        eprintln!("usage: metrics_worker LEDGER_PATH KEY NAME ALLOC_MIB LIMIT_MIB REFUSALS");
        std::process::exit(2);
    }
    let num = |i: usize| -> u64 {
        args[i]
            .parse()
            .unwrap_or_else(|_| panic!("argument {} ('{}') is not a number", i + 1, args[i]))
    };
    let (path, key, name) = (&args[0], &args[1], &args[2]);
    let (alloc_mib, limit_mib, refusals) = (num(3), num(4), num(5));

    let ledger = MachineLedger::open(&LedgerOptions::new(key.as_str(), 1 << 40).path(path))
        .unwrap_or_else(|e| panic!("opening the ledger at {path}: {e}"));
    let member = ledger
        .join(JoinOptions::new(name.as_str()).lease_chunk(0))
        .unwrap_or_else(|e| panic!("joining the ledger at {path}: {e}"));
    let process = ProcessBudget::with_machine(name.as_str(), limit_mib * MIB, member);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let gov: Governor<AnyContext> = Governor::new();
    let ctx = gov.register(
        device_context(),
        ContextConfig::new()
            .label(name.as_str())
            .shared_budget(device),
    );
    let stream = ctx.create_stream("worker").expect("a stream");
    let mut held = Vec::new();
    for _ in 0..alloc_mib {
        held.push(
            ctx.allocate(&stream, Alloc::new(MIB, Role::Weights))
                .expect("an allocation under the process limit"),
        );
    }
    for _ in 0..refusals {
        // Larger than the process limit: refused by the process budget.
        let refused = ctx.allocate(&stream, Alloc::new((limit_mib + 1) * MIB, Role::KvCache));
        assert!(
            refused.is_err(),
            "an allocation above the limit was admitted"
        );
    }

    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    println!(
        "listening {}",
        listener.local_addr().expect("the listener's address")
    );
    let _ = std::io::stdout().flush();
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        // Read the request head; every path answers with the metrics.
        let mut reader = BufReader::new(&conn);
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
            if line == "\r\n" || line == "\n" {
                break;
            }
            line.clear();
        }
        let body = memgov::metrics::render(&gov);
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            memgov::metrics::CONTENT_TYPE,
            body.len()
        );
    }
    drop(held);
}
