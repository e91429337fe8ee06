//! The conformance suite on the embedded host backend: one test per case, plus
//! a run with a per-operation delay so that pending releases really pend, and
//! whole-suite runs that also hold the backend's probe to a clean teardown.

use memgov::host::{HostConfig, HostContext};
use std::time::Duration;

memgov::conformance_tests!(host, || HostContext::new(HostConfig::default()));

memgov::conformance_tests!(host_slow, || HostContext::new(HostConfig {
    op_delay: Duration::from_micros(200),
    ..HostConfig::default()
}));

#[test]
fn whole_suite_report_passes() {
    // Probed: after every case the host backend's own bookkeeping must be
    // clean too (one teardown, nothing allocated or open, no violation).
    let report = memgov::conformance::run_suite_probed(|| {
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

#[test]
fn whole_suite_report_passes_on_null() {
    let report = memgov::conformance::run_suite_probed(|| {
        let c = memgov::null::NullContext::new();
        let probe = c.probe();
        Ok((c, probe))
    });
    println!("{report}");
    assert!(report.all_passed(), "{report}");
}

#[test]
fn a_backend_that_leaks_fails_the_probed_suite() {
    // The probe the factory hands out belongs to another context, which is
    // never torn down: every case must fail on it, naming the numbers.
    let report = memgov::conformance::run_suite_probed(|| {
        let c = HostContext::new(HostConfig::default())?;
        let never_torn_down = memgov::BackendProbe::new();
        Ok((c, never_torn_down))
    });
    assert_eq!(report.counts().1, report.cases.len(), "{report}");
    for case in &report.cases {
        assert!(
            case.outcome.to_string().contains("saw 0 teardowns"),
            "{}: {}",
            case.name,
            case.outcome
        );
    }
}
