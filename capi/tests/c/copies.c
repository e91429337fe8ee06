/*
 * Two copies of the library in one process (loaded with dlopen from two
 * paths, RTLD_LOCAL): each refuses the other's handles, of every kind, with
 * MEMGOV_ERR_INVALID_HANDLE, and its own keep working. Both copies create
 * the same objects in the same order first, so that handles that were mere
 * counters would be equal in both.
 *
 * Usage: copies LIB_A.so LIB_B.so (two copies of libmemgov_capi.so). Exit
 * status 0 when every check passed.
 */
#include "memgov.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

typedef struct api {
    const char* name;
    const char* (*last_error_message)(void);
    const char* (*status_name)(int32_t);
    int32_t (*governor_create)(memgov_governor**);
    int32_t (*governor_destroy)(memgov_governor*);
    int32_t (*context_open)(memgov_governor*, const memgov_context_options*, memgov_context**);
    int32_t (*context_close)(memgov_context*);
    int32_t (*context_snapshot)(memgov_context*, memgov_snapshot*);
    int32_t (*context_retire)(memgov_context*, uint64_t, memgov_teardown_report*);
    int32_t (*stream_create)(memgov_context*, const char*, memgov_plugin*, memgov_stream**);
    int32_t (*stream_destroy)(memgov_stream*);
    int32_t (*buffer_allocate)(memgov_stream*, uint64_t, uint32_t, memgov_plugin*, memgov_buffer**);
    int32_t (*buffer_release)(memgov_buffer*);
    int32_t (*buffer_size)(memgov_buffer*, uint64_t*);
    int32_t (*pin_source_create)(memgov_context*, const char*, memgov_plugin*, memgov_pin_source**);
    int32_t (*pin_source_destroy)(memgov_pin_source*);
    int32_t (*pin_acquire)(memgov_pin_source*, memgov_pin**);
    int32_t (*pin_release)(memgov_pin*);
    int32_t (*pressure_callback_add)(memgov_context*, memgov_plugin*, memgov_pressure_fn, void*,
                                     memgov_callback**);
    int32_t (*pressure_callback_remove)(memgov_callback*);
    int32_t (*plugin_register)(const char*, memgov_plugin**);
    int32_t (*plugin_unregister)(memgov_plugin*, memgov_plugin_outstanding*);
    int32_t (*plugin_may_unload)(memgov_plugin*, memgov_plugin_outstanding*);
    int32_t (*ort_allocator_create)(memgov_stream*, uint32_t, const void*, memgov_plugin*,
                                    memgov_ort_allocator**);
    int32_t (*ort_allocator_destroy)(memgov_ort_allocator*);
} api;

static void* need(void* lib, const char* lib_name, const char* symbol) {
    void* p = dlsym(lib, symbol);
    if (!p) {
        fprintf(stderr, "copies: %s has no %s\n", lib_name, symbol);
        exit(2);
    }
    return p;
}

#define LOAD(field) memcpy(&a->field, &(void*){need(lib, path, "memgov_" #field)}, sizeof a->field)

static void load(api* a, const char* path) {
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "copies: cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    a->name = path;
    LOAD(last_error_message);
    LOAD(status_name);
    LOAD(governor_create);
    LOAD(governor_destroy);
    LOAD(context_open);
    LOAD(context_close);
    LOAD(context_snapshot);
    LOAD(context_retire);
    LOAD(stream_create);
    LOAD(stream_destroy);
    LOAD(buffer_allocate);
    LOAD(buffer_release);
    LOAD(buffer_size);
    LOAD(pin_source_create);
    LOAD(pin_source_destroy);
    LOAD(pin_acquire);
    LOAD(pin_release);
    LOAD(pressure_callback_add);
    LOAD(pressure_callback_remove);
    LOAD(plugin_register);
    LOAD(plugin_unregister);
    LOAD(plugin_may_unload);
    LOAD(ort_allocator_create);
    LOAD(ort_allocator_destroy);
}

#define CHECK(a, call, expected)                                                              \
    do {                                                                                      \
        int32_t rc_ = (call);                                                                 \
        if (rc_ != (expected)) {                                                              \
            fprintf(stderr, "copies: line %d: %s: %s returned %s, expected %s (%s)\n", __LINE__, \
                    (a)->name, #call, (a)->status_name(rc_), (a)->status_name(expected),     \
                    (a)->last_error_message());                                               \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

typedef struct objects {
    memgov_governor* gov;
    memgov_context* ctx;
    memgov_stream* stream;
    memgov_buffer* buffer;
    memgov_pin_source* source;
    memgov_pin* pin;
    memgov_callback* callback;
    memgov_plugin* plugin;
    memgov_ort_allocator* ort;
} objects;

static uint64_t no_pressure(const memgov_pressure_request* r, void* user) {
    (void)r;
    (void)user;
    return 0;
}

static objects create(const api* a) {
    objects o;
    memset(&o, 0, sizeof o);
    memgov_context_options opts;
    memset(&opts, 0, sizeof opts);
    opts.size = sizeof opts;
    opts.backend = "host";
    opts.budget = MEMGOV_UNLIMITED;
    CHECK(a, a->governor_create(&o.gov), MEMGOV_OK);
    CHECK(a, a->context_open(o.gov, &opts, &o.ctx), MEMGOV_OK);
    CHECK(a, a->plugin_register("copy", &o.plugin), MEMGOV_OK);
    CHECK(a, a->stream_create(o.ctx, "s", o.plugin, &o.stream), MEMGOV_OK);
    CHECK(a, a->buffer_allocate(o.stream, 64, MEMGOV_ROLE_OTHER, o.plugin, &o.buffer), MEMGOV_OK);
    CHECK(a, a->pin_source_create(o.ctx, "copy", o.plugin, &o.source), MEMGOV_OK);
    CHECK(a, a->pin_acquire(o.source, &o.pin), MEMGOV_OK);
    CHECK(a, a->pressure_callback_add(o.ctx, o.plugin, no_pressure, NULL, &o.callback), MEMGOV_OK);
    CHECK(a, a->ort_allocator_create(o.stream, MEMGOV_ROLE_OTHER, NULL, o.plugin, &o.ort), MEMGOV_OK);
    return o;
}

/* Every handle of `theirs` given to `a`: refused, and nothing of a's own
 * (created in the same order, so with the same counters) is touched. */
static void refuses(const api* a, const objects* theirs) {
    uint64_t size = 0;
    memgov_snapshot snap;
    memset(&snap, 0, sizeof snap);
    snap.size = sizeof snap;
    memgov_buffer* b = NULL;
    memgov_pin* pin = NULL;
    memgov_plugin_outstanding out;
    memset(&out, 0, sizeof out);
    out.size = sizeof out;
    CHECK(a, a->context_snapshot(theirs->ctx, &snap), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->buffer_allocate(theirs->stream, 64, MEMGOV_ROLE_OTHER, NULL, &b), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->buffer_size(theirs->buffer, &size), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->pin_acquire(theirs->source, &pin), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->plugin_may_unload(theirs->plugin, &out), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->ort_allocator_destroy(theirs->ort), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->pressure_callback_remove(theirs->callback), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->pin_release(theirs->pin), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->pin_source_destroy(theirs->source), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->buffer_release(theirs->buffer), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->stream_destroy(theirs->stream), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->plugin_unregister(theirs->plugin, &out), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->context_close(theirs->ctx), MEMGOV_ERR_INVALID_HANDLE);
    CHECK(a, a->governor_destroy(theirs->gov), MEMGOV_ERR_INVALID_HANDLE);
    if (strstr(a->last_error_message(), "another copy") == NULL) {
        fprintf(stderr, "copies: %s: the message does not name another copy: %s\n", a->name,
                a->last_error_message());
        failures++;
    }
}

/* Its own handles still work, every one, and everything goes. */
static void release_own(const api* a, objects* o) {
    uint64_t size = 0;
    memgov_plugin_outstanding out;
    memset(&out, 0, sizeof out);
    out.size = sizeof out;
    CHECK(a, a->buffer_size(o->buffer, &size), MEMGOV_OK);
    if (size != 64) {
        fprintf(stderr, "copies: %s: buffer size %llu\n", a->name, (unsigned long long)size);
        failures++;
    }
    CHECK(a, a->ort_allocator_destroy(o->ort), MEMGOV_OK);
    CHECK(a, a->pressure_callback_remove(o->callback), MEMGOV_OK);
    CHECK(a, a->pin_release(o->pin), MEMGOV_OK);
    CHECK(a, a->pin_source_destroy(o->source), MEMGOV_OK);
    CHECK(a, a->buffer_release(o->buffer), MEMGOV_OK);
    CHECK(a, a->stream_destroy(o->stream), MEMGOV_OK);
    CHECK(a, a->context_retire(o->ctx, 5000, NULL), MEMGOV_OK);
    CHECK(a, a->plugin_unregister(o->plugin, &out), MEMGOV_OK);
    CHECK(a, a->context_close(o->ctx), MEMGOV_OK);
    CHECK(a, a->governor_destroy(o->gov), MEMGOV_OK);
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: copies LIB_A.so LIB_B.so\n");
        return 2;
    }
    api a, b;
    load(&a, argv[1]);
    load(&b, argv[2]);
    if (a.governor_create == b.governor_create) {
        fprintf(stderr, "copies: %s and %s are one copy (same code address)\n", argv[1], argv[2]);
        return 2;
    }
    objects in_a = create(&a);
    objects in_b = create(&b);
    refuses(&b, &in_a);
    refuses(&a, &in_b);
    release_own(&a, &in_a);
    release_own(&b, &in_b);
    if (failures) {
        fprintf(stderr, "copies: %d check(s) failed\n", failures);
        return 1;
    }
    printf("copies: each of two copies refuses the other's handles of every kind\n");
    printf("copies: all checks passed\n");
    return 0;
}
