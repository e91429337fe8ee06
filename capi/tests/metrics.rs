//! `memgov_metrics_render`: the governor's page through the C ABI, copied
//! as snprintf copies (whole when the buffer holds it, truncated and
//! NUL-terminated when not, the full length always reported).

use memgov_capi::*;
use std::ffi::CStr;
use std::ptr::null_mut;

fn message() -> String {
    // SAFETY: never NULL, NUL-terminated, valid until the next call here.
    unsafe { CStr::from_ptr(memgov_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(rc: i32) {
    assert_eq!(rc, MEMGOV_OK, "{}", message());
}

#[test]
fn the_page_names_the_contexts_and_is_copied_as_snprintf_copies() {
    let mut gov = null_mut();
    // SAFETY: a writable out-pointer.
    ok(unsafe { memgov_governor_create(&mut gov) });
    let opts = memgov_context_options {
        size: std::mem::size_of::<memgov_context_options>() as u32,
        backend: c"host".as_ptr(),
        label: c"from-c".as_ptr(),
        budget: 1 << 20,
        ..Default::default()
    };
    let mut ctx = null_mut();
    // SAFETY: a sized options struct and an out-pointer.
    ok(unsafe { memgov_context_open(gov, &opts, &mut ctx) });
    let mut s = null_mut();
    // SAFETY: a valid label and out-pointer.
    ok(unsafe { memgov_stream_create(ctx, c"s".as_ptr(), null_mut(), &mut s) });
    let mut b = null_mut();
    // SAFETY: a valid stream and out-pointer.
    ok(unsafe { memgov_buffer_allocate(s, 4096, MEMGOV_ROLE_WEIGHTS, null_mut(), &mut b) });
    let mut refused = null_mut();
    // SAFETY: as above; above the 1 MiB budget, refused.
    let rc =
        unsafe { memgov_buffer_allocate(s, 2 << 20, MEMGOV_ROLE_OTHER, null_mut(), &mut refused) };
    assert_ne!(rc, MEMGOV_OK);

    // The size first, then the whole page.
    let mut full = 0usize;
    // SAFETY: NULL buffer, writable out_len.
    ok(unsafe { memgov_metrics_render(gov, null_mut(), 0, &mut full) });
    assert!(full > 0);
    let mut buf = vec![0u8; full + 1];
    let mut again = 0usize;
    // SAFETY: `buf` holds `full + 1` bytes.
    ok(unsafe { memgov_metrics_render(gov, buf.as_mut_ptr().cast(), buf.len(), &mut again) });
    assert_eq!(again, full);
    let page = CStr::from_bytes_with_nul(&buf).unwrap().to_str().unwrap();
    assert_eq!(page.len(), full);
    let refusals = page
        .lines()
        .find(|l| {
            l.starts_with("memgov_context_refusals_total{") && l.contains("context=\"from-c\"")
        })
        .unwrap_or_else(|| panic!("no refusal count of the context:\n{page}"));
    assert!(refusals.ends_with(" 1"), "{refusals}");
    assert!(page.contains("role=\"weights\"} 4096"), "{page}");
    assert!(page.ends_with("# EOF\n"));

    // Truncated: len - 1 bytes and a NUL, the full length reported.
    let mut small = [0xffu8; 16];
    let mut n = 0usize;
    // SAFETY: `small` holds 16 bytes.
    ok(unsafe { memgov_metrics_render(gov, small.as_mut_ptr().cast(), small.len(), &mut n) });
    assert_eq!(n, full);
    assert_eq!(small[15], 0);
    assert_eq!(&small[..15], &page.as_bytes()[..15]);

    // Nothing to write into: an error that says so; a bad handle: an error.
    // SAFETY: both NULL is a checked argument error.
    let rc = unsafe { memgov_metrics_render(gov, null_mut(), 0, null_mut()) };
    assert_eq!(rc, MEMGOV_ERR_INVALID_ARGUMENT);
    assert!(message().contains("out_len"), "{}", message());
    // SAFETY: a NULL handle is a checked error.
    let rc = unsafe { memgov_metrics_render(null_mut(), null_mut(), 0, &mut n) };
    assert_eq!(rc, MEMGOV_ERR_INVALID_HANDLE);

    ok(memgov_buffer_release(b));
    ok(memgov_stream_destroy(s));
    ok(memgov_context_close(ctx));
    ok(memgov_governor_destroy(gov));
}
