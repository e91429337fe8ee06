/*
 * The C API from C on the host backend: bad handles, double releases and
 * calls after retire return error codes; sized structs; budgets and a
 * pressure callback; release on another stream and record_stream; the
 * PyTorch and ONNX Runtime allocator entry points; what the handles of a
 * force-retired context return; racing unregisters; allocations from inside
 * a pressure callback; the last-error copy.
 *
 * Exit status 0 when every check passed; prints one line per section.
 */
#define _POSIX_C_SOURCE 200809L
#include "memgov.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int failures;

#define EXPECT(cond)                                                                  \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "api: line %d: expected %s (last message: %s)\n", __LINE__, \
                    #cond, memgov_last_error_message());                              \
            failures++;                                                               \
        }                                                                             \
    } while (0)

#define OK(call) EXPECT((call) == MEMGOV_OK)
#define FAILS(call, status)                                                  \
    do {                                                                     \
        int32_t rc_ = (call);                                                \
        EXPECT(rc_ == (status));                                             \
        if (rc_ != (status))                                                 \
            fprintf(stderr, "api:   got %s\n", memgov_status_name(rc_));     \
        EXPECT(memgov_last_error_message()[0] != '\0');                      \
    } while (0)

static memgov_context* open_ctx(memgov_governor* gov, const char* backend, uint64_t budget) {
    memgov_context_options o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    o.backend = backend;
    o.label = backend;
    o.budget = budget;
    memgov_context* ctx = NULL;
    OK(memgov_context_open(gov, &o, &ctx));
    return ctx;
}

static memgov_snapshot snapshot(memgov_context* ctx) {
    memgov_snapshot s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    OK(memgov_context_snapshot(ctx, &s));
    return s;
}

/* Pressure callback: releases the buffer it is given. */
static memgov_buffer* victim;
static int pressure_calls;
static uint64_t give_back(const memgov_pressure_request* r, void* user) {
    pressure_calls++;
    EXPECT(user == (void*)&victim);
    EXPECT(r->size == sizeof *r && r->role == MEMGOV_ROLE_KV_CACHE && r->shortfall > 0);
    if (!victim)
        return 0;
    EXPECT(memgov_buffer_release(victim) == MEMGOV_OK);
    victim = NULL;
    return 8192;
}

static void bad_handles(memgov_governor* gov) {
    memgov_context* ctx = open_ctx(gov, "host", MEMGOV_UNLIMITED);
    memgov_stream* s = NULL;
    OK(memgov_stream_create(ctx, "s", NULL, &s));

    FAILS(memgov_buffer_release(NULL), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_buffer_release((memgov_buffer*)(uintptr_t)0xdeadbeef), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_stream_destroy((memgov_stream*)(uintptr_t)0x1234), MEMGOV_ERR_INVALID_HANDLE);
    /* A stream handle where a buffer is expected, and a context as a stream. */
    FAILS(memgov_buffer_release((memgov_buffer*)s), MEMGOV_ERR_INVALID_HANDLE);
    memgov_stream* not_a_stream = (memgov_stream*)ctx;
    memgov_buffer* b = NULL;
    FAILS(memgov_buffer_allocate(not_a_stream, 64, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_pin_release((memgov_pin*)(uintptr_t)UINT64_MAX), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_plugin_may_unload((memgov_plugin*)(uintptr_t)42, NULL), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_ort_allocator_destroy((memgov_ort_allocator*)(uintptr_t)0x1000), MEMGOV_ERR_INVALID_HANDLE);

    /* Bad arguments. */
    FAILS(memgov_buffer_allocate(s, 0, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_allocate(s, 64, 9, NULL, &b), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_allocate(s, 64, MEMGOV_ROLE_OTHER, NULL, NULL), MEMGOV_ERR_INVALID_ARGUMENT);
    memgov_context_options o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    o.backend = "tpu";
    memgov_context* c2 = NULL;
    FAILS(memgov_context_open(gov, &o, &c2), MEMGOV_ERR_INVALID_ARGUMENT);
    if (!(memgov_capabilities() & MEMGOV_CAP_BACKEND_CUDA)) {
        o.backend = "cuda";
        FAILS(memgov_context_open(gov, &o, &c2), MEMGOV_ERR_UNAVAILABLE);
        EXPECT(strstr(memgov_last_error_message(), "--features cuda") != NULL);
    }
    o.size = 4;
    o.backend = "host";
    FAILS(memgov_context_open(gov, &o, &c2), MEMGOV_ERR_INVALID_ARGUMENT);
    memgov_snapshot snap;
    memset(&snap, 0, sizeof snap);
    snap.size = 4;
    FAILS(memgov_context_snapshot(ctx, &snap), MEMGOV_ERR_INVALID_ARGUMENT);
    /* An older, shorter snapshot: filled up to its size, nothing after. */
    memset(&snap, 0xab, sizeof snap);
    snap.size = (uint32_t)offsetof(memgov_snapshot, peak);
    OK(memgov_context_snapshot(ctx, &snap));
    EXPECT(snap.size == offsetof(memgov_snapshot, peak));
    EXPECT(snap.lifecycle == MEMGOV_LIFECYCLE_ACTIVE);
    EXPECT(snap.peak == 0xababababababababull);

    /* Double releases. */
    OK(memgov_buffer_allocate(s, 64, MEMGOV_ROLE_OTHER, NULL, &b));
    OK(memgov_buffer_release(b));
    FAILS(memgov_buffer_release(b), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_buffer_release_on(b, s), MEMGOV_ERR_INVALID_HANDLE);
    void* p = NULL;
    FAILS(memgov_buffer_device_ptr(b, &p), MEMGOV_ERR_INVALID_HANDLE);
    memgov_pin_source* src = NULL;
    memgov_pin* pin = NULL;
    OK(memgov_pin_source_create(ctx, "holder", NULL, &src));
    OK(memgov_pin_acquire(src, &pin));
    OK(memgov_pin_release(pin));
    FAILS(memgov_pin_release(pin), MEMGOV_ERR_INVALID_HANDLE);
    OK(memgov_pin_source_destroy(src));
    FAILS(memgov_pin_source_destroy(src), MEMGOV_ERR_INVALID_HANDLE);
    OK(memgov_stream_destroy(s));
    FAILS(memgov_stream_destroy(s), MEMGOV_ERR_INVALID_HANDLE);
    memgov_plugin* plugin = NULL;
    OK(memgov_plugin_register("p", &plugin));
    OK(memgov_plugin_unregister(plugin, NULL));
    FAILS(memgov_plugin_unregister(plugin, NULL), MEMGOV_ERR_INVALID_HANDLE);

    /* A report that cannot be written is refused before anything retires. */
    memgov_teardown_report small;
    memset(&small, 0, sizeof small);
    small.size = 4;
    FAILS(memgov_context_retire(ctx, 0, &small), MEMGOV_ERR_INVALID_ARGUMENT);
    EXPECT(snapshot(ctx).lifecycle == MEMGOV_LIFECYCLE_ACTIVE);

    OK(memgov_context_retire(ctx, 5000, NULL));
    OK(memgov_context_close(ctx));
    FAILS(memgov_context_close(ctx), MEMGOV_ERR_INVALID_HANDLE);
    printf("bad handles, bad arguments, double releases: refused\n");
}

static void after_retire(memgov_governor* gov) {
    memgov_context* ctx = open_ctx(gov, "host", MEMGOV_UNLIMITED);
    memgov_stream* s = NULL;
    memgov_pin_source* src = NULL;
    OK(memgov_stream_create(ctx, "s", NULL, &s));
    OK(memgov_pin_source_create(ctx, "late-holder", NULL, &src));
    memgov_pin* pin = NULL;
    OK(memgov_pin_acquire(src, &pin));

    /* The stream and the pin hold it: the retire times out and names them. */
    memgov_teardown_report r;
    memset(&r, 0, sizeof r);
    r.size = sizeof r;
    FAILS(memgov_context_retire(ctx, 0, &r), MEMGOV_ERR_TIMEOUT);
    EXPECT(strstr(memgov_last_error_message(), "late-holder") != NULL);
    /* Retiring: new work is refused. */
    memgov_buffer* b = NULL;
    memgov_stream* s2 = NULL;
    memgov_pin* pin2 = NULL;
    FAILS(memgov_buffer_allocate(s, 64, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_RETIRING);
    FAILS(memgov_stream_create(ctx, "late", NULL, &s2), MEMGOV_ERR_RETIRING);
    FAILS(memgov_pin_acquire(src, &pin2), MEMGOV_ERR_RETIRING);
    EXPECT(snapshot(ctx).lifecycle == MEMGOV_LIFECYCLE_RETIRING);

    OK(memgov_pin_release(pin));
    OK(memgov_pin_source_destroy(src));
    OK(memgov_stream_destroy(s));
    OK(memgov_context_retire(ctx, 5000, &r));
    EXPECT(r.size == sizeof r && r.backend_status == MEMGOV_OK && r.forced == 0);
    EXPECT(snapshot(ctx).lifecycle == MEMGOV_LIFECYCLE_TERMINATED);
    FAILS(memgov_stream_create(ctx, "after", NULL, &s2), MEMGOV_ERR_RETIRING);
    /* Retiring again returns the same report. */
    OK(memgov_context_retire(ctx, 0, &r));

    /* Device loss. */
    memgov_context* lost = open_ctx(gov, "host", MEMGOV_UNLIMITED);
    OK(memgov_context_mark_lost(lost, "test"));
    FAILS(memgov_stream_create(lost, "s", NULL, &s2), MEMGOV_ERR_DEVICE_LOST);
    memset(&r, 0, sizeof r);
    r.size = sizeof r;
    OK(memgov_context_retire(lost, 5000, &r));
    EXPECT(r.lost == 1);
    OK(memgov_context_close(lost));
    OK(memgov_context_close(ctx));
    printf("calls after retire and after device loss: refused\n");
}

/* One meaning of a budget, as in Rust's ContextConfig::budget: 0 bytes
 * admits nothing; MEMGOV_UNLIMITED sets no budget beyond the device. At
 * open and through memgov_context_set_budget alike. */
static void budget_zero_and_unlimited(memgov_governor* gov) {
    memgov_context* none = open_ctx(gov, "host", 0);
    memgov_context* all = open_ctx(gov, "host", MEMGOV_UNLIMITED);
    memgov_stream *sn = NULL, *sa = NULL;
    OK(memgov_stream_create(none, "zero", NULL, &sn));
    OK(memgov_stream_create(all, "unlimited", NULL, &sa));
    memgov_buffer *b = NULL, *c = NULL;
    FAILS(memgov_buffer_allocate(sn, 1, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_OUT_OF_MEMORY);
    EXPECT(b == NULL);
    EXPECT(snapshot(none).budget_limit == 0);
    OK(memgov_buffer_allocate(sa, 1 << 20, MEMGOV_ROLE_OTHER, NULL, &c));
    EXPECT(snapshot(all).budget_limit == MEMGOV_UNLIMITED);
    /* set_budget agrees: 0 refuses, MEMGOV_UNLIMITED lifts the limit. */
    OK(memgov_context_set_budget(all, 0));
    FAILS(memgov_buffer_allocate(sa, 1, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_OUT_OF_MEMORY);
    OK(memgov_context_set_budget(none, MEMGOV_UNLIMITED));
    OK(memgov_buffer_allocate(sn, 1 << 20, MEMGOV_ROLE_OTHER, NULL, &b));
    OK(memgov_buffer_release(b));
    OK(memgov_buffer_release(c));
    OK(memgov_stream_destroy(sn));
    OK(memgov_stream_destroy(sa));
    OK(memgov_context_retire(none, 5000, NULL));
    OK(memgov_context_retire(all, 5000, NULL));
    OK(memgov_context_close(none));
    OK(memgov_context_close(all));
    printf("budget 0 admits nothing, MEMGOV_UNLIMITED sets no limit: ok\n");
}

static void budgets_streams_and_data(memgov_governor* gov) {
    memgov_context* ctx = open_ctx(gov, "host", 16384);
    memgov_context* other = open_ctx(gov, "host", MEMGOV_UNLIMITED);
    memgov_stream *s1 = NULL, *s2 = NULL, *foreign = NULL;
    OK(memgov_stream_create(ctx, "compute", NULL, &s1));
    OK(memgov_stream_create(ctx, "copy", NULL, &s2));
    OK(memgov_stream_create(other, "foreign", NULL, &foreign));
    void* raw = NULL;
    FAILS(memgov_stream_raw(s1, &raw), MEMGOV_ERR_UNSUPPORTED);

    memgov_buffer *a = NULL, *b = NULL, *c = NULL;
    OK(memgov_buffer_allocate(s1, 8192, MEMGOV_ROLE_WEIGHTS, NULL, &a));
    OK(memgov_buffer_allocate(s1, 8192, MEMGOV_ROLE_KV_CACHE, NULL, &b));
    FAILS(memgov_buffer_allocate(s1, 4096, MEMGOV_ROLE_KV_CACHE, NULL, &c), MEMGOV_ERR_OUT_OF_MEMORY);
    EXPECT(strstr(memgov_last_error_message(), "16.0 KiB (16384 bytes) limit") != NULL);

    /* A pressure callback gives b back. */
    memgov_callback* cb = NULL;
    victim = b;
    OK(memgov_pressure_callback_add(ctx, NULL, give_back, &victim, &cb));
    /* The release is queued; the budget waits for it to retire, so make the
     * context wait for pending releases. */
    OK(memgov_stream_synchronize(s1));
    memgov_snapshot before = snapshot(ctx);
    int32_t rc = memgov_buffer_allocate(s1, 4096, MEMGOV_ROLE_KV_CACHE, NULL, &c);
    EXPECT(pressure_calls >= 1 && victim == NULL);
    if (rc != MEMGOV_OK) {
        /* Fail-fast admission: the freed room shows after the release retires. */
        EXPECT(rc == MEMGOV_ERR_OUT_OF_MEMORY);
        OK(memgov_stream_synchronize(s1));
        OK(memgov_buffer_allocate(s1, 4096, MEMGOV_ROLE_KV_CACHE, NULL, &c));
    }
    EXPECT(snapshot(ctx).pressure_calls > before.pressure_calls);
    OK(memgov_pressure_callback_remove(cb));
    FAILS(memgov_pressure_callback_remove(cb), MEMGOV_ERR_INVALID_HANDLE);

    /* Data through the API, and through the raw pointer. */
    const char msg[] = "governed";
    char back[sizeof msg];
    OK(memgov_buffer_write(a, 100, msg, sizeof msg));
    OK(memgov_buffer_read(a, 100, back, sizeof back));
    EXPECT(memcmp(msg, back, sizeof msg) == 0);
    FAILS(memgov_buffer_write(a, 8190, msg, sizeof msg), MEMGOV_ERR_INVALID_ARGUMENT);
    /* Lengths no buffer can have: refused before the pointer and length are
     * used (offset + SIZE_MAX wraps; UINT64_MAX - 1 + 2 wraps; a length past
     * PTRDIFF_MAX with offset 0). */
    FAILS(memgov_buffer_write(a, 2, msg, SIZE_MAX), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_read(a, 2, back, SIZE_MAX), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_write(a, 0, msg, SIZE_MAX), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_read(a, 0, back, (size_t)PTRDIFF_MAX + 1), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_write(a, UINT64_MAX - 1, msg, 2), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_read(a, UINT64_MAX - 1, back, 2), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_read(a, 8190, back, sizeof back), MEMGOV_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(memgov_last_error_message(), "8192") != NULL);
    void* pa = NULL;
    OK(memgov_buffer_device_ptr(a, &pa));
    EXPECT(memcmp((char*)pa + 100, msg, sizeof msg) == 0);
    uint64_t size = 0;
    OK(memgov_buffer_size(a, &size));
    EXPECT(size == 8192);

    /* Another context's stream: refused, the buffer stays live. */
    FAILS(memgov_buffer_release_on(a, foreign), MEMGOV_ERR_INVALID_ARGUMENT);
    FAILS(memgov_buffer_record_stream(a, foreign), MEMGOV_ERR_INVALID_ARGUMENT);
    OK(memgov_buffer_device_ptr(a, &pa));
    /* Recorded on s2, released on s2 (after s1's work). */
    OK(memgov_buffer_record_stream(c, s2));
    OK(memgov_buffer_release_on(a, s2));
    OK(memgov_buffer_release(c));
    OK(memgov_stream_synchronize(s1));
    OK(memgov_stream_synchronize(s2));
    memgov_snapshot s = snapshot(ctx);
    EXPECT(s.total.live_count == 0 && s.total.pending_count == 0 && s.retired == 3);

    /* The null backend has no addresses. */
    memgov_context* null_ctx = open_ctx(gov, "null", MEMGOV_UNLIMITED);
    memgov_stream* ns = NULL;
    memgov_buffer* nb = NULL;
    OK(memgov_stream_create(null_ctx, "n", NULL, &ns));
    OK(memgov_buffer_allocate(ns, 64, MEMGOV_ROLE_OTHER, NULL, &nb));
    FAILS(memgov_buffer_device_ptr(nb, &pa), MEMGOV_ERR_UNSUPPORTED);
    OK(memgov_buffer_release(nb));
    OK(memgov_stream_destroy(ns));
    OK(memgov_context_retire(null_ctx, 5000, NULL));

    OK(memgov_stream_destroy(s1));
    OK(memgov_stream_destroy(s2));
    OK(memgov_stream_destroy(foreign));
    OK(memgov_context_retire(ctx, 5000, NULL));
    OK(memgov_context_retire(other, 5000, NULL));
    printf("budget, pressure callback, record_stream, release_on, data: ok\n");
}

/* After memgov_context_force_retire, the reclaimed buffers' and streams'
 * handles fail with MEMGOV_ERR_RETIRING, also the calls that release them
 * (which still take the handle out). */
static void after_force_retire(memgov_governor* gov) {
    memgov_context* ctx = open_ctx(gov, "host", MEMGOV_UNLIMITED);
    memgov_stream* s = NULL;
    memgov_buffer *b = NULL, *b2 = NULL;
    OK(memgov_stream_create(ctx, "reclaimed", NULL, &s));
    OK(memgov_buffer_allocate(s, 256, MEMGOV_ROLE_OTHER, NULL, &b));
    OK(memgov_buffer_allocate(s, 256, MEMGOV_ROLE_OTHER, NULL, &b2));
    memgov_teardown_report r;
    memset(&r, 0, sizeof r);
    r.size = sizeof r;
    OK(memgov_context_force_retire(ctx, 5000, &r));
    EXPECT(r.forced == 1 && r.reclaimed_buffers == 2);

    uint64_t size = 0;
    void* p = NULL;
    char byte = 0;
    FAILS(memgov_buffer_size(b, &size), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_device_ptr(b, &p), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_write(b, 0, &byte, 1), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_read(b, 0, &byte, 1), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_record_stream(b, s), MEMGOV_ERR_RETIRING);
    FAILS(memgov_stream_synchronize(s), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_release(b), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_release(b), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_buffer_release_on(b2, s), MEMGOV_ERR_RETIRING);
    FAILS(memgov_buffer_size(b2, &size), MEMGOV_ERR_INVALID_HANDLE);
    FAILS(memgov_stream_destroy(s), MEMGOV_ERR_RETIRING);
    EXPECT(strstr(memgov_last_error_message(), "force-retired") != NULL);
    FAILS(memgov_stream_destroy(s), MEMGOV_ERR_INVALID_HANDLE);
    OK(memgov_context_close(ctx));
    printf("handles of a force-retired context: MEMGOV_ERR_RETIRING\n");
}

/* Threads racing to unregister one plugin: one MEMGOV_OK; a loser that
 * finds the unload in progress gets MEMGOV_ERR_RETIRING, one that comes
 * after it MEMGOV_ERR_INVALID_HANDLE; none MEMGOV_ERR_BUSY (nothing is
 * outstanding). */
#define RACERS 8
static pthread_barrier_t race_start;
static memgov_plugin* race_plugin;
static int32_t race_rc[RACERS];

static void* race_unregister(void* arg) {
    int i = (int)(intptr_t)arg;
    memgov_plugin_outstanding o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    pthread_barrier_wait(&race_start);
    race_rc[i] = memgov_plugin_unregister(race_plugin, &o);
    return NULL;
}

static void unregister_race(void) {
    int counts[MEMGOV_ERR_PANIC + 1];
    memset(counts, 0, sizeof counts);
    for (int round = 0; round < 300; round++) {
        OK(memgov_plugin_register("raced", &race_plugin));
        pthread_barrier_init(&race_start, NULL, RACERS);
        pthread_t t[RACERS];
        for (int i = 0; i < RACERS; i++)
            pthread_create(&t[i], NULL, race_unregister, (void*)(intptr_t)i);
        int ok = 0;
        for (int i = 0; i < RACERS; i++) {
            pthread_join(t[i], NULL);
            if (race_rc[i] >= 0 && race_rc[i] <= MEMGOV_ERR_PANIC)
                counts[race_rc[i]]++;
            ok += race_rc[i] == MEMGOV_OK;
            EXPECT(race_rc[i] == MEMGOV_OK || race_rc[i] == MEMGOV_ERR_RETIRING ||
                   race_rc[i] == MEMGOV_ERR_INVALID_HANDLE);
        }
        pthread_barrier_destroy(&race_start);
        EXPECT(ok == 1);
    }
    EXPECT(counts[MEMGOV_ERR_BUSY] == 0);
    printf("racing unregisters: %d MEMGOV_OK, %d MEMGOV_ERR_RETIRING, %d MEMGOV_ERR_INVALID_HANDLE, %d MEMGOV_ERR_BUSY\n",
           counts[MEMGOV_OK], counts[MEMGOV_ERR_RETIRING], counts[MEMGOV_ERR_INVALID_HANDLE],
           counts[MEMGOV_ERR_BUSY]);
}

/* An allocation made from inside a pressure callback asks no pressure
 * callback (on that thread): it is admitted or refused as it stands. */
static memgov_stream* nested_stream;
static int nested_depth, nested_max_depth, nested_calls;
static int32_t nested_rc = -1;
static uint64_t allocate_inside(const memgov_pressure_request* r, void* user) {
    (void)r;
    (void)user;
    nested_calls++;
    nested_depth++;
    if (nested_depth > nested_max_depth)
        nested_max_depth = nested_depth;
    if (nested_depth < 4) { /* a guard of the test's own, should re-entry happen */
        memgov_buffer* inner = NULL;
        nested_rc = memgov_buffer_allocate(nested_stream, 4096, MEMGOV_ROLE_WORKSPACE, NULL, &inner);
        if (nested_rc == MEMGOV_OK)
            EXPECT(memgov_buffer_release(inner) == MEMGOV_OK);
    }
    nested_depth--;
    return 0;
}

static void allocation_inside_a_callback(memgov_governor* gov) {
    memgov_context* ctx = open_ctx(gov, "host", 4096);
    memgov_buffer *held = NULL, *b = NULL;
    memgov_callback* cb = NULL;
    OK(memgov_stream_create(ctx, "nested", NULL, &nested_stream));
    OK(memgov_buffer_allocate(nested_stream, 4096, MEMGOV_ROLE_OTHER, NULL, &held));
    OK(memgov_pressure_callback_add(ctx, NULL, allocate_inside, NULL, &cb));
    FAILS(memgov_buffer_allocate(nested_stream, 4096, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_OUT_OF_MEMORY);
    EXPECT(nested_max_depth == 1);
    EXPECT(nested_rc == MEMGOV_ERR_OUT_OF_MEMORY);
    EXPECT(nested_calls >= 1);
    printf("allocation inside a pressure callback: depth %d, inner allocation %s\n", nested_max_depth,
           memgov_status_name(nested_rc));
    OK(memgov_pressure_callback_remove(cb));
    OK(memgov_buffer_release(held));
    OK(memgov_stream_destroy(nested_stream));
    OK(memgov_context_retire(ctx, 5000, NULL));
    OK(memgov_context_close(ctx));
}

/* Removing a pressure callback from inside it returns at once (its own call
 * is the caller's and ends when it returns), as does removing another one
 * from inside a callback: no deadlock, and neither is called again. */
static memgov_callback *self_cb, *other_cb;
static int self_calls, other_calls;
static int32_t self_remove_rc = -1, other_remove_rc = -1;
static uint64_t removes_itself(const memgov_pressure_request* r, void* user) {
    (void)r;
    (void)user;
    self_calls++;
    self_remove_rc = memgov_pressure_callback_remove(self_cb);
    other_remove_rc = memgov_pressure_callback_remove(other_cb);
    return 0;
}
static uint64_t counts_calls(const memgov_pressure_request* r, void* user) {
    (void)r;
    (void)user;
    other_calls++;
    return 0;
}

static void remove_from_inside(memgov_governor* gov) {
    memgov_context* ctx = open_ctx(gov, "host", 4096);
    memgov_stream* s = NULL;
    memgov_buffer *held = NULL, *b = NULL;
    OK(memgov_stream_create(ctx, "inside", NULL, &s));
    OK(memgov_buffer_allocate(s, 4096, MEMGOV_ROLE_OTHER, NULL, &held));
    OK(memgov_pressure_callback_add(ctx, NULL, removes_itself, NULL, &self_cb));
    OK(memgov_pressure_callback_add(ctx, NULL, counts_calls, NULL, &other_cb));
    FAILS(memgov_buffer_allocate(s, 4096, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_OUT_OF_MEMORY);
    FAILS(memgov_buffer_allocate(s, 4096, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_OUT_OF_MEMORY);
    EXPECT(self_remove_rc == MEMGOV_OK && other_remove_rc == MEMGOV_OK);
    EXPECT(self_calls == 1 && other_calls == 0);
    FAILS(memgov_pressure_callback_remove(self_cb), MEMGOV_ERR_INVALID_HANDLE);
    OK(memgov_buffer_release(held));
    OK(memgov_stream_destroy(s));
    OK(memgov_context_retire(ctx, 5000, NULL));
    OK(memgov_context_close(ctx));
    printf("remove from inside a callback: itself %s, another %s, neither called again\n",
           memgov_status_name(self_remove_rc), memgov_status_name(other_remove_rc));
}

/* memgov_last_error_copy: the message copied with truncation, always
 * NUL-terminated, returning the full length (snprintf's convention); it
 * does not change the message. */
static void last_error_copy(void) {
    FAILS(memgov_stream_destroy(NULL), MEMGOV_ERR_INVALID_HANDLE);
    const char* m = memgov_last_error_message();
    size_t n = strlen(m);
    EXPECT(n > 16);
    EXPECT(memgov_last_error_copy(NULL, 0) == n);
    char big[1024];
    memset(big, 'x', sizeof big);
    EXPECT(memgov_last_error_copy(big, sizeof big) == n);
    EXPECT(strcmp(big, m) == 0);
    char small[8];
    memset(small, 'x', sizeof small);
    EXPECT(memgov_last_error_copy(small, sizeof small) == n);
    EXPECT(memcmp(small, m, 7) == 0 && small[7] == '\0');
    char exact[1024];
    EXPECT(memgov_last_error_copy(exact, n) == n); /* one byte short: truncated */
    EXPECT(memcmp(exact, m, n - 1) == 0 && exact[n - 1] == '\0');
    EXPECT(memgov_last_error_copy(exact, n + 1) == n && strcmp(exact, m) == 0);
    char one = 'x';
    EXPECT(memgov_last_error_copy(&one, 1) == n && one == '\0');
    EXPECT(memgov_last_error_copy(NULL, 64) == n); /* NULL: nothing written */
    EXPECT(strcmp(memgov_last_error_message(), big) == 0); /* unchanged */
    memgov_governor* gov = NULL;
    OK(memgov_governor_create(&gov));
    OK(memgov_governor_destroy(gov));
    memset(small, 'x', sizeof small);
    EXPECT(memgov_last_error_copy(small, sizeof small) == 0 && small[0] == '\0');
    printf("last error copy: truncated and NUL-terminated, full length returned\n");
}

/* The shape PyTorch loads by name. */
typedef void* (*torch_alloc_fn)(ssize_t, int, void*);
typedef void (*torch_free_fn)(void*, ssize_t, int, void*);

static void torch(memgov_governor* gov) {
    torch_alloc_fn alloc = memgov_torch_alloc;
    torch_free_fn release = memgov_torch_free;
    memgov_context* ctx = open_ctx(gov, "host", 1 << 20);
    memgov_stream *s1 = NULL, *s2 = NULL;
    OK(memgov_stream_create(ctx, "torch-default", NULL, &s1));
    OK(memgov_stream_create(ctx, "torch-side", NULL, &s2));
    void* side = (void*)(uintptr_t)0x5eed;

    FAILS(memgov_torch_configure(-1, s1, MEMGOV_ROLE_ACTIVATION), MEMGOV_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(memgov_last_error_message(), "device -1") != NULL);
    FAILS(memgov_torch_map_stream(-1, side, s2), MEMGOV_ERR_INVALID_ARGUMENT);
    EXPECT(alloc(1024, -1, NULL) == NULL);
    EXPECT(alloc(1024, 0, NULL) == NULL); /* not configured */
    EXPECT(strstr(memgov_last_error_message(), "not configured") != NULL);
    OK(memgov_torch_configure(0, s1, MEMGOV_ROLE_ACTIVATION));
    OK(memgov_torch_map_stream(0, side, s2));
    void* p = alloc(1000, 0, NULL);
    void* q = alloc(3000, 0, side);
    EXPECT(p != NULL && q != NULL && p != q);
    memset(p, 1, 1000);
    memset(q, 2, 3000);
    memgov_snapshot s = snapshot(ctx);
    EXPECT(s.by_role[MEMGOV_ROLE_ACTIVATION].live_count == 2);
    EXPECT(s.by_role[MEMGOV_ROLE_ACTIVATION].live_bytes == 4000);
    EXPECT(alloc(0, 0, NULL) == NULL);
    EXPECT(alloc(2 << 20, 0, NULL) == NULL); /* over budget */
    FAILS(memgov_torch_reset(), MEMGOV_ERR_BUSY);
    release(p, 1000, 0, side); /* freed on the side stream, after the default one */
    release(q, 3000, 0, NULL);
    release(q, 3000, 0, NULL); /* a second free: ignored, with a message */
    EXPECT(strstr(memgov_last_error_message(), "was not allocated") != NULL);
    OK(memgov_stream_synchronize(s1));
    OK(memgov_stream_synchronize(s2));
    s = snapshot(ctx);
    EXPECT(s.total.live_count == 0 && s.releases_queued == 2 && s.retired == 2);
    OK(memgov_torch_reset());
    OK(memgov_stream_destroy(s1));
    OK(memgov_stream_destroy(s2));
    OK(memgov_context_retire(ctx, 5000, NULL));
    printf("torch: alloc/free by (size, device, stream): ok\n");
}

/* The shape ONNX Runtime calls. */
typedef struct OrtAllocatorShape {
    uint32_t version;
    void* (*Alloc)(struct OrtAllocatorShape* self, size_t size);
    void (*Free)(struct OrtAllocatorShape* self, void* p);
    const void* (*Info)(const struct OrtAllocatorShape* self);
    void* (*Reserve)(struct OrtAllocatorShape* self, size_t size);
} OrtAllocatorShape;

static void ort(memgov_governor* gov) {
    static int memory_info; /* stands for an OrtMemoryInfo */
    memgov_context* ctx = open_ctx(gov, "host", 1 << 20);
    memgov_stream* s = NULL;
    OK(memgov_stream_create(ctx, "ort", NULL, &s));
    memgov_plugin* ep = NULL;
    OK(memgov_plugin_register("execution-provider", &ep));
    memgov_ort_allocator* m = NULL;
    OK(memgov_ort_allocator_create(s, MEMGOV_ROLE_ACTIVATION, &memory_info, ep, &m));
    OrtAllocatorShape* a = (OrtAllocatorShape*)(void*)m;
    EXPECT(a->version == MEMGOV_ORT_ALLOCATOR_VERSION);
    EXPECT(a->Info(a) == &memory_info);
    void* x = a->Alloc(a, 256);
    void* w = a->Reserve(a, 512);
    EXPECT(x != NULL && w != NULL);
    memset(x, 3, 256);
    memgov_snapshot snap = snapshot(ctx);
    EXPECT(snap.by_role[MEMGOV_ROLE_WEIGHTS].live_bytes == 512);
    EXPECT(snap.by_role[MEMGOV_ROLE_ACTIVATION].live_bytes == 256);

    /* A struct that only looks like one of ours is refused, not read. */
    OrtAllocatorShape fake = *a;
    EXPECT(fake.Alloc(&fake, 16) == NULL);
    EXPECT(fake.Info(&fake) == NULL);

    memgov_plugin_outstanding o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    FAILS(memgov_plugin_unregister(ep, &o), MEMGOV_ERR_BUSY);
    EXPECT(o.allocators == 1 && o.buffers == 2 && o.buffer_bytes == 768);
    FAILS(memgov_ort_allocator_destroy(m), MEMGOV_ERR_BUSY);
    a->Free(a, x);
    a->Free(a, w);
    a->Free(a, w); /* ignored, with a message */
    EXPECT(strstr(memgov_last_error_message(), "not allocated by this allocator") != NULL);
    OK(memgov_ort_allocator_destroy(m));
    FAILS(memgov_ort_allocator_destroy(m), MEMGOV_ERR_INVALID_HANDLE);
    OK(memgov_stream_synchronize(s));
    OK(memgov_plugin_unregister(ep, &o));
    EXPECT(o.size == sizeof o && o.allocators == 0 && o.buffers == 0 && o.pending_releases == 0);
    OK(memgov_stream_destroy(s));
    OK(memgov_context_retire(ctx, 5000, NULL));
    printf("ort: OrtAllocator Alloc/Free/Info/Reserve: ok\n");
}

int main(void) {
    memgov_governor* gov = NULL;
    OK(memgov_governor_create(&gov));
    bad_handles(gov);
    after_retire(gov);
    after_force_retire(gov);
    unregister_race();
    allocation_inside_a_callback(gov);
    remove_from_inside(gov);
    last_error_copy();
    budget_zero_and_unlimited(gov);
    budgets_streams_and_data(gov);
    torch(gov);
    ort(gov);
    OK(memgov_governor_destroy(gov));
    FAILS(memgov_governor_destroy(gov), MEMGOV_ERR_INVALID_HANDLE);
    if (failures) {
        fprintf(stderr, "api: %d check(s) failed\n", failures);
        return 1;
    }
    printf("api: all checks passed\n");
    return 0;
}
