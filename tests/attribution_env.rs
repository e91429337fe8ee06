//! `MEMGOV_ATTRIBUTION=1` turns attribution on without a code change, and
//! `ContextConfig::attribution(false)` keeps it off whatever the
//! environment says. One test in its own binary: it sets the process's
//! environment, which no other test may read at the same time.

use memgov::null::NullContext;
use memgov::{Alloc, ContextConfig, Governor, Role};

#[test]
fn the_environment_switches_attribution_on_and_the_config_wins() {
    let gov = Governor::new();
    let count = |config: ContextConfig| {
        let ctx = gov.register(NullContext::new(), config);
        let s = ctx.create_stream("main").unwrap();
        let _b = ctx.allocate(&s, Alloc::new(64, Role::Other)).unwrap();
        ctx.snapshot().sites.len()
    };
    std::env::remove_var("MEMGOV_ATTRIBUTION");
    assert_eq!(count(ContextConfig::new()), 0, "off by default");
    std::env::set_var("MEMGOV_ATTRIBUTION", "1");
    assert_eq!(
        count(ContextConfig::new()),
        1,
        "on with MEMGOV_ATTRIBUTION=1"
    );
    assert_eq!(
        count(ContextConfig::new().attribution(false)),
        0,
        "the config wins"
    );
    std::env::set_var("MEMGOV_ATTRIBUTION", "0");
    assert_eq!(
        count(ContextConfig::new()),
        0,
        "off with MEMGOV_ATTRIBUTION=0"
    );
    assert_eq!(
        count(ContextConfig::new().attribution(true)),
        1,
        "the config wins"
    );
    std::env::remove_var("MEMGOV_ATTRIBUTION");
}
