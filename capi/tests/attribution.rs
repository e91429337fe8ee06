//! A C caller names its allocation sites (`memgov_buffer_allocate_at`), and
//! with `MEMGOV_ATTRIBUTION=1` a refusal names them: the largest holder
//! first, with its bytes, in the thread's error message. One test in its own
//! binary: it sets the process's environment before any context opens.

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
fn a_refusal_names_the_sites_c_callers_gave() {
    std::env::set_var("MEMGOV_ATTRIBUTION", "1");
    let mut gov = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { memgov_governor_create(&mut gov) });
    let opts = memgov_context_options {
        size: std::mem::size_of::<memgov_context_options>() as u32,
        backend: c"null".as_ptr(),
        label: c"c-sites".as_ptr(),
        budget: 1 << 20,
        ..Default::default()
    };
    let mut ctx = null_mut();
    // SAFETY: a sized options struct and an out-pointer.
    ok(unsafe { memgov_context_open(gov, &opts, &mut ctx) });
    let mut s = null_mut();
    // SAFETY: a valid label and out-pointer.
    ok(unsafe { memgov_stream_create(ctx, c"s".as_ptr(), null_mut(), &mut s) });
    let (mut small, mut big, mut unnamed, mut refused) =
        (null_mut(), null_mut(), null_mut(), null_mut());
    // The site string is copied: a temporary one is gone before the refusal.
    let site = std::ffi::CString::new("model.c:42").unwrap();
    // SAFETY: a live stream, NUL-terminated site strings (or NULL) and
    // out-pointers.
    unsafe {
        ok(memgov_buffer_allocate_at(
            s,
            128 << 10,
            MEMGOV_ROLE_WEIGHTS,
            null_mut(),
            c"model.c:17".as_ptr(),
            &mut small,
        ));
        ok(memgov_buffer_allocate_at(
            s,
            512 << 10,
            MEMGOV_ROLE_KV_CACHE,
            null_mut(),
            site.as_ptr(),
            &mut big,
        ));
        ok(memgov_buffer_allocate_at(
            s,
            64 << 10,
            MEMGOV_ROLE_OTHER,
            null_mut(),
            std::ptr::null(),
            &mut unnamed,
        ));
    }
    drop(site);
    // SAFETY: as above.
    let rc = unsafe {
        memgov_buffer_allocate_at(
            s,
            512 << 10,
            MEMGOV_ROLE_ACTIVATION,
            null_mut(),
            c"model.c:99".as_ptr(),
            &mut refused,
        )
    };
    assert_eq!(rc, MEMGOV_ERR_OUT_OF_MEMORY, "{}", message());
    let m = message();
    let held = m
        .find("held at ")
        .map(|i| &m[i..])
        .unwrap_or_else(|| panic!("{m}"));
    assert!(
        held.starts_with("held at model.c:42 512.0 KiB (1 buffer), model.c:17 128.0 KiB (1 buffer), capi/src/objects.rs:"),
        "{m}"
    );
    // The same figures as JSON: sized by a first call, then whole.
    let mut needed = 0usize;
    // SAFETY: a live context; NULL buffer of length 0; a writable size.
    ok(unsafe { memgov_context_sites_json(ctx, null_mut(), 0, &mut needed) });
    let mut buf = vec![0 as std::ffi::c_char; needed + 1];
    let mut again = 0usize;
    // SAFETY: `buf` is valid for its length.
    ok(unsafe { memgov_context_sites_json(ctx, buf.as_mut_ptr(), buf.len(), &mut again) });
    assert_eq!(again, needed);
    // SAFETY: NUL-terminated by the call.
    let json = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(json.len(), needed);
    assert!(
        json.starts_with(r#"[{"site":"model.c:42","label":null,"live_bytes":524288,"live_count":1,"peak_bytes":524288,"allocations":1,"refusals":0},{"site":"model.c:17","#),
        "{json}"
    );
    assert!(
        json.contains(r#"{"site":"model.c:99","label":null,"live_bytes":0,"live_count":0,"peak_bytes":0,"allocations":0,"refusals":1}"#),
        "{json}"
    );
    // Too short a buffer: truncated and NUL-terminated, the length whole.
    let mut short = [1 as std::ffi::c_char; 8];
    // SAFETY: `short` is valid for 8 bytes.
    ok(unsafe { memgov_context_sites_json(ctx, short.as_mut_ptr(), 8, &mut again) });
    assert_eq!(again, needed);
    // SAFETY: NUL-terminated by the call.
    let truncated = unsafe { CStr::from_ptr(short.as_ptr()) };
    assert_eq!(truncated.to_bytes(), &json.as_bytes()[..7]);
    for b in [small, big, unnamed] {
        ok(memgov_buffer_release(b));
    }
    ok(memgov_stream_destroy(s));
    ok(memgov_context_close(ctx));
    ok(memgov_governor_destroy(gov));
    std::env::remove_var("MEMGOV_ATTRIBUTION");
}
