//! The conformance cases the null backend can pass. It stores no data, so
//! the cases that read back what they wrote are not run on it (`memgov
//! check` reports it unavailable for that reason); these need none.

use memgov::null::{NullConfig, NullContext};
use memgov_conformance::{assert_outcome, run_case, run_case_with, SuiteOptions};

/// Cases that read no data back.
const CASES: &[&str] = &[
    "cross_stream_release_is_ordered",
    "raw_misuse_is_refused",
    "pinned_host_release_is_stream_ordered",
];

#[test]
fn inline_null_passes_the_cases_without_data() {
    for case in CASES {
        let outcome = run_case(case, &|| Ok(NullContext::new()));
        assert_outcome("null", case, outcome);
    }
}

#[test]
fn bounded_deferred_null_passes_the_cases_without_data() {
    // Deferred frees park until their stream is synchronized, and capacity
    // mode counts bytes: ordering and refusals must hold there too.
    let factory = || {
        Ok(NullContext::with_config(NullConfig {
            deferred: true,
            capacity: 1 << 30,
            ..NullConfig::default()
        }))
    };
    for case in CASES {
        assert_outcome("null-deferred", case, run_case(case, &factory));
    }
}

#[test]
fn null_with_the_block_cache_passes_the_cases_without_data() {
    // Inline and deferred frees, every context keeping freed blocks.
    let cached = SuiteOptions::new().cache(memgov::CacheConfig::new(64 << 20));
    for deferred in [false, true] {
        let factory = || {
            Ok(NullContext::with_config(NullConfig {
                deferred,
                capacity: 1 << 30,
                ..NullConfig::default()
            }))
        };
        for case in CASES {
            let outcome = run_case_with(case, &cached, &factory);
            assert_outcome("null-cached", case, outcome);
        }
    }
}
