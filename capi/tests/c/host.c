/*
 * A test host: opens a governed context, loads plugin.so with
 * memgov_plugin_open, lets it allocate, queue releases, hold a pin and
 * register a callback, and checks that memgov refuses to unload it (naming
 * what is outstanding) until everything is gone, then that it unloads, and
 * that the context retires clean. A plugin whose init fails having created
 * things is cleaned up and unloaded; one whose init tries to close itself is
 * refused.
 *
 * Usage: host PLUGIN.so [BACKEND] (default "host"; "cuda" and "hip" only on
 * their stand-ins). Exit status 0 when every check passed.
 */
#define _POSIX_C_SOURCE 200809L
#include "memgov.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define EXPECT(cond)                                                                   \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "host: line %d: expected %s (last message: %s)\n", __LINE__, \
                    #cond, memgov_last_error_message());                               \
            failures++;                                                                \
        }                                                                              \
    } while (0)

#define OK(call) EXPECT((call) == MEMGOV_OK)

typedef int32_t (*step_fn)(void);

static step_fn symbol(memgov_plugin* plugin, const char* name) {
    void* p = NULL;
    if (memgov_plugin_symbol(plugin, name, &p) != MEMGOV_OK) {
        fprintf(stderr, "host: no %s: %s\n", name, memgov_last_error_message());
        exit(2);
    }
    step_fn f;
    memcpy(&f, &p, sizeof f);
    return f;
}

static memgov_plugin_outstanding outstanding(memgov_plugin* plugin, int32_t* rc) {
    memgov_plugin_outstanding o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    *rc = memgov_plugin_close(plugin, &o);
    return o;
}

/* Allocates on a full context, so that its pressure callbacks are called;
 * returns the status. */
static void* allocate_on_full(void* stream) {
    memgov_buffer* b = NULL;
    int32_t rc = memgov_buffer_allocate((memgov_stream*)stream, 4096, MEMGOV_ROLE_OTHER, NULL, &b);
    if (rc == MEMGOV_OK)
        memgov_buffer_release(b);
    return (void*)(intptr_t)rc;
}

static void print(const char* when, int32_t rc, const memgov_plugin_outstanding* o) {
    printf("close %s: %s: streams %llu, buffers %llu (%llu B), pending releases %llu, pin sources %llu, pins %llu, callbacks %llu\n",
           when, memgov_status_name(rc), (unsigned long long)o->streams,
           (unsigned long long)o->buffers, (unsigned long long)o->buffer_bytes,
           (unsigned long long)o->pending_releases, (unsigned long long)o->pin_sources,
           (unsigned long long)o->pins, (unsigned long long)o->callbacks);
}

int main(int argc, char** argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: host PLUGIN.so [BACKEND]\n");
        return 2;
    }
    const char* backend = argc == 3 ? argv[2] : "host";
    EXPECT(memgov_abi_version() == MEMGOV_ABI_VERSION);
    EXPECT((memgov_capabilities() & MEMGOV_CAP_PLUGIN_LOADER) != 0);

    memgov_governor* gov = NULL;
    OK(memgov_governor_create(&gov));
    memgov_context_options opts;
    memset(&opts, 0, sizeof opts);
    opts.size = sizeof opts;
    opts.backend = backend;
    opts.label = "plugin-host";
    opts.budget = 1 << 20;
    /* Each queued operation takes 1 s on the simulated device, so a release
     * queued by the plugin is still pending when the host looks. (On a GPU
     * stand-in its latency knob does the same; the plugin writes through the
     * device pointer, which is host memory on the host backend and on the
     * stand-ins.) */
    opts.host_op_delay_us = 1000000;
    memgov_context* ctx = NULL;
    OK(memgov_context_open(gov, &opts, &ctx));

    /* Loading failures: a missing library, a missing init symbol, an init
     * that fails having created nothing (closed again, no handle). */
    memgov_plugin* plugin = (memgov_plugin*)(uintptr_t)1;
    EXPECT(memgov_plugin_open("/nonexistent/plugin.so", NULL, ctx, &plugin) == MEMGOV_ERR_PLUGIN);
    EXPECT(plugin == NULL);
    EXPECT(memgov_plugin_open(argv[1], "no_such_init", ctx, &plugin) == MEMGOV_ERR_PLUGIN);
    EXPECT(strstr(memgov_last_error_message(), "no_such_init") != NULL);
    EXPECT(memgov_plugin_open(argv[1], "plugin_init_fails", ctx, &plugin) == MEMGOV_ERR_PLUGIN);
    EXPECT(strstr(memgov_last_error_message(), "returned 7; the library was closed again") != NULL);
    EXPECT(plugin == NULL);
    printf("load failures: reported\n");

    /* An init that closes its own plugin: refused (the library stays
     * mapped while init runs), and the plugin loads. */
    plugin = NULL;
    int32_t rc = memgov_plugin_open(argv[1], "plugin_init_closes_itself", ctx, &plugin);
    EXPECT(rc == MEMGOV_OK && plugin != NULL);
    if (rc == MEMGOV_OK) {
        int32_t close_rc = symbol(plugin, "plugin_self_close_rc")();
        int32_t unregister_rc = symbol(plugin, "plugin_self_unregister_rc")();
        void* m = NULL;
        OK(memgov_plugin_symbol(plugin, "plugin_self_close_message", &m));
        const char* (*message)(void);
        memcpy(&message, &m, sizeof message);
        EXPECT(close_rc == MEMGOV_ERR_BUSY && unregister_rc == MEMGOV_ERR_BUSY);
        EXPECT(strstr(message(), "init function") != NULL);
        printf("close from inside init: %s, unregister: %s (%s)\n", memgov_status_name(close_rc),
               memgov_status_name(unregister_rc), message());
        memgov_plugin_outstanding left = outstanding(plugin, &rc);
        EXPECT(rc == MEMGOV_OK && left.streams == 0);
    }

    rc = memgov_plugin_open(argv[1], NULL, ctx, &plugin);
    if (rc != MEMGOV_OK) {
        fprintf(stderr, "host: cannot load %s: %s\n", argv[1], memgov_last_error_message());
        return 2;
    }
    step_fn run = symbol(plugin, "plugin_run");
    step_fn release_buffers = symbol(plugin, "plugin_release_buffers");
    step_fn release_rest = symbol(plugin, "plugin_release_rest");
    step_fn synchronize = symbol(plugin, "plugin_synchronize");

    /* Nothing outstanding yet (closing now would unload it: ask instead). */
    memgov_plugin_outstanding o, q;
    memset(&q, 0, sizeof q);
    q.size = sizeof q;
    EXPECT(memgov_plugin_may_unload(plugin, &q) == MEMGOV_OK);
    EXPECT(q.size == sizeof q);

    OK(run());
    o = outstanding(plugin, &rc);
    print("after run", rc, &o);
    EXPECT(rc == MEMGOV_ERR_BUSY);
    EXPECT(strstr(memgov_last_error_message(), "may not be unloaded") != NULL);
    EXPECT(o.streams == 1 && o.buffers == 2 && o.buffer_bytes == 8192);
    EXPECT(o.pending_releases == 1);
    EXPECT(o.pin_sources == 1 && o.pins == 1 && o.callbacks == 1);
    EXPECT(memgov_plugin_may_unload(plugin, &q) == MEMGOV_ERR_BUSY);

    /* The plugin's pin shows in a retire timeout, by its holder label. */
    memgov_snapshot snap;
    memset(&snap, 0, sizeof snap);
    snap.size = sizeof snap;
    OK(memgov_context_snapshot(ctx, &snap));
    EXPECT(snap.pins_external == 1);
    EXPECT(snap.by_role[MEMGOV_ROLE_ACTIVATION].live_count == 2);

    OK(release_buffers());
    o = outstanding(plugin, &rc);
    print("after releasing buffers", rc, &o);
    EXPECT(rc == MEMGOV_ERR_BUSY);
    EXPECT(o.buffers == 0 && o.pending_releases >= 1 && o.pending_releases <= 3);

    OK(synchronize());
    o = outstanding(plugin, &rc);
    print("after synchronize", rc, &o);
    EXPECT(rc == MEMGOV_ERR_BUSY);
    EXPECT(o.pending_releases == 0 && o.pins == 1 && o.callbacks == 1 && o.streams == 1);

    OK(release_rest());
    o = outstanding(plugin, &rc);
    print("after releasing the rest", rc, &o);
    EXPECT(rc == MEMGOV_OK);
    /* Unloaded: the handle is gone. */
    EXPECT(memgov_plugin_may_unload(plugin, NULL) == MEMGOV_ERR_INVALID_HANDLE);
    EXPECT(memgov_plugin_close(plugin, NULL) == MEMGOV_ERR_INVALID_HANDLE);

    /* An init that fails holding things: memgov releases everything it
     * created (its queued releases retire), and unloads it. */
    plugin = (memgov_plugin*)(uintptr_t)1;
    EXPECT(memgov_plugin_open(argv[1], "plugin_init_fails_holding", ctx, &plugin) == MEMGOV_ERR_PLUGIN);
    EXPECT(strstr(memgov_last_error_message(), "returned 8") != NULL);
    EXPECT(strstr(memgov_last_error_message(), "the library was closed again") != NULL);
    EXPECT(plugin == NULL);
    snap = (memgov_snapshot){.size = sizeof snap};
    OK(memgov_context_snapshot(ctx, &snap));
    EXPECT(snap.pins_streams == 0 && snap.pins_buffers == 0 && snap.pins_external == 0);
    EXPECT(snap.pins_pending_releases == 0 && snap.total.live_count == 0);
    printf("failed init holding a stream, buffers, a pin and a callback: cleaned up and unloaded (pins %llu)\n",
           (unsigned long long)(snap.pins_streams + snap.pins_buffers + snap.pins_external +
                                snap.pins_pending_releases));

    /* A callback of the plugin that removed itself and is still running in
     * the plugin's code: close is refused, and what it fills counts the
     * callback until it returns; then the plugin unloads. */
    memgov_context_options tight_opts = opts;
    tight_opts.backend = "host";
    tight_opts.label = "tight";
    tight_opts.budget = 4096;
    tight_opts.host_op_delay_us = 0;
    memgov_context* tight = NULL;
    memgov_stream* ts = NULL;
    memgov_buffer* held = NULL;
    OK(memgov_context_open(gov, &tight_opts, &tight));
    OK(memgov_stream_create(tight, "tight", NULL, &ts));
    OK(memgov_buffer_allocate(ts, 4096, MEMGOV_ROLE_OTHER, NULL, &held));
    plugin = NULL;
    OK(memgov_plugin_open(argv[1], "plugin_init_self_removing", tight, &plugin));
    pthread_t allocating;
    EXPECT(pthread_create(&allocating, NULL, allocate_on_full, ts) == 0);
    EXPECT(symbol(plugin, "plugin_wait_until_removed")() == MEMGOV_OK);
    step_fn let_return = symbol(plugin, "plugin_let_the_callback_return");
    o = outstanding(plugin, &rc);
    print("while a removed callback runs", rc, &o);
    EXPECT(rc == MEMGOV_ERR_BUSY);
    EXPECT(o.callbacks == 1);
    EXPECT(o.streams + o.buffers + o.pending_releases + o.pin_sources + o.pins + o.allocators == 0);
    EXPECT(strstr(memgov_last_error_message(), "1 pressure callback(s)") != NULL);
    OK(let_return());
    void* allocated = NULL;
    EXPECT(pthread_join(allocating, &allocated) == 0);
    EXPECT((int32_t)(intptr_t)allocated == MEMGOV_ERR_OUT_OF_MEMORY);
    o = outstanding(plugin, &rc);
    print("after the callback returned", rc, &o);
    EXPECT(rc == MEMGOV_OK);
    OK(memgov_buffer_release(held));
    OK(memgov_stream_destroy(ts));
    OK(memgov_context_retire(tight, 10000, NULL));
    OK(memgov_context_close(tight));

    memgov_teardown_report report;
    memset(&report, 0, sizeof report);
    report.size = sizeof report;
    OK(memgov_context_retire(ctx, 10000, &report));
    EXPECT(report.size == sizeof report);
    EXPECT(report.retired_releases == 5 && report.backend_status == MEMGOV_OK);
    printf("teardown: %llu releases retired, backend %s\n",
           (unsigned long long)report.retired_releases, memgov_status_name(report.backend_status));
    OK(memgov_context_close(ctx));
    OK(memgov_governor_destroy(gov));

    if (failures) {
        fprintf(stderr, "host: %d check(s) failed\n", failures);
        return 1;
    }
    printf("host: all checks passed\n");
    return 0;
}
