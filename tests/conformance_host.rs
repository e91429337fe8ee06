//! The conformance suite on the embedded host backend: one test per case, plus
//! a run with a per-operation delay so that pending releases really pend.

use memgov::host::{HostConfig, HostContext};
use std::time::Duration;

memgov::conformance_tests!(host, || HostContext::new(HostConfig::default()));

memgov::conformance_tests!(host_slow, || HostContext::new(HostConfig {
    op_delay: Duration::from_micros(200),
    ..HostConfig::default()
}));

#[test]
fn whole_suite_report_passes() {
    let report = memgov::conformance::run_suite(|| HostContext::new(HostConfig::default()));
    println!("{report}");
    assert!(report.all_passed(), "{report}");
    assert_eq!(report.counts().1, 0);
    assert_eq!(
        report.counts().0,
        report.cases.len(),
        "no case may be skipped on the host backend"
    );
}
