//! The validation layer turned on the usual way, through the environment
//! (`VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation`), with memgov's own
//! messenger listening: the loader's notice that it adds the layer is a
//! loader message, not a validation failure, so a clean run counts zero.
//!
//! A file of its own: the variable must be set before the first instance of
//! the process is created, and it affects every instance after.

use memgov::vulkan::{VulkanConfig, VulkanContext};
use memgov::{BackendErrorKind, DeviceContext, RetireSignal};

#[test]
fn layer_enabled_through_the_environment_counts_no_loader_notice() {
    std::env::set_var("VK_INSTANCE_LAYERS", "VK_LAYER_KHRONOS_validation");
    let ctx = match VulkanContext::new(VulkanConfig::validated()) {
        Ok(c) => c,
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            eprintln!("skipped: no Vulkan loader/ICD or validation layer ({e})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (probe, validation) = (ctx.probe(), ctx.validation());
    let s = ctx.create_stream().expect("create_stream");
    let m = ctx.allocate(&s, 4096).expect("allocate");
    ctx.write(&s, &m, 0, b"abc").expect("write");
    ctx.free_async(&s, m, RetireSignal::from_fn(|_| {}))
        .map_err(|(_, _, e)| e)
        .expect("free_async");
    ctx.synchronize(&s).expect("synchronize");
    ctx.destroy_stream(s).expect("destroy_stream");
    ctx.teardown(false).expect("teardown");
    eprintln!(
        "loader messages: {}, validation messages: {:?}",
        validation.loader_messages(),
        validation.messages()
    );
    assert!(
        validation.loader_messages() >= 1,
        "the loader should have announced the layer it adds from VK_INSTANCE_LAYERS"
    );
    assert_eq!(
        validation.validation_failures(),
        0,
        "validation failures: {:#?}",
        validation.messages()
    );
    assert_eq!(probe.check_clean_teardown(), Ok(()));
}
