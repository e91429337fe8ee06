//! The conformance suite on the embedded host backend: one test per case, plus
//! a run with a per-operation delay so that pending releases really pend, and
//! whole-suite runs that also hold the backend's probe to a clean teardown.

use memgov::host::{HostConfig, HostContext};
use std::time::Duration;

memgov_conformance::conformance_tests!(host, || HostContext::new(HostConfig::default()));

memgov_conformance::conformance_tests!(host_slow, || HostContext::new(HostConfig {
    op_delay: Duration::from_micros(200),
    ..HostConfig::default()
}));

#[test]
fn whole_suite_report_passes() {
    // Probed: after every case the host backend's own bookkeeping must be
    // clean too (one teardown, nothing allocated or open, no violation).
    let report = memgov_conformance::run_suite_probed(|| {
        let c = HostContext::new(HostConfig::default())?;
        let probe = c.probe();
        Ok((c, probe))
    });
    println!("{report}");
    assert!(report.all_passed(), "{report}");
    assert_eq!(report.counts().1, 0);
    assert_eq!(
        report.counts().0,
        report.cases.len(),
        "no case may be skipped on the host backend"
    );
}

/// The probe of a host context torn down while a free was still queued: a
/// contract violation the backend saw.
///
/// The free is queued behind a 20 ms delay and teardown follows at once, so
/// it is still queued unless this thread was descheduled for longer than
/// that; such an attempt (no violation seen) is tried again, and a host
/// backend that never reports the violation fails after 20 attempts.
fn probe_of_a_dirty_teardown() -> memgov::BackendProbe {
    use memgov::{DeviceContext, RetireSignal};
    for _ in 0..20 {
        let c = HostContext::new(HostConfig {
            op_delay: Duration::from_millis(20),
            ..HostConfig::default()
        })
        .expect("host context");
        let probe = c.probe();
        let s = c.create_stream().expect("stream");
        let m = c.allocate(&s, 4096).expect("allocate");
        c.free_async(&s, m, RetireSignal::from_fn(|_| {}))
            .map_err(|(_, _, e)| e)
            .expect("free_async");
        c.teardown(false).expect("teardown");
        if probe.violations() > 0 {
            return probe;
        }
    }
    panic!("20 teardowns with a free queued behind a 20 ms delay, and the host probe saw none");
}

#[test]
fn a_backend_that_breaks_its_contract_fails_the_probed_suite() {
    // Each context the cases use is fine, but the probe the factory hands
    // out saw a violation: every case must fail on it, with the numbers.
    let report = memgov_conformance::run_suite_probed(|| {
        let c = HostContext::new(HostConfig::default())?;
        Ok((c, probe_of_a_dirty_teardown()))
    });
    assert_eq!(report.counts().1, report.cases.len(), "{report}");
    for case in &report.cases {
        assert!(
            case.outcome.is_failed()
                && case
                    .outcome
                    .to_string()
                    .contains("teardown with stream-ordered frees still queued"),
            "{}: {}",
            case.name,
            case.outcome
        );
    }
}

/// Every case again with the block cache on in every context the cases
/// register: freed blocks are kept and reused, and every check still holds,
/// the backend's probe included.
#[test]
fn whole_suite_with_the_block_cache_passes() {
    use memgov_conformance::{run_suite_probed_with, SuiteOptions};
    let cached = SuiteOptions::new().cache(memgov::CacheConfig::new(64 << 20));
    for op_delay in [Duration::ZERO, Duration::from_micros(200)] {
        let report = run_suite_probed_with(&cached, || {
            let c = HostContext::new(HostConfig {
                op_delay,
                ..HostConfig::default()
            })?;
            let probe = c.probe();
            Ok((c, probe))
        });
        println!("{report}");
        assert!(report.all_passed(), "{report}");
        assert_eq!(
            report.counts().0,
            report.cases.len(),
            "no case may be skipped on the host backend"
        );
    }
}
