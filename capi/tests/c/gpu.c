/*
 * The allocator entry points on a GPU backend (argv[1]: "cuda" or "hip"),
 * run on the stand-in driver in CI and on a real GPU when one is reachable:
 * PyTorch's pair keyed by the raw streams memgov hands out, an OrtAllocator,
 * a plugin whose releases are queued on the device, and a teardown that
 * retires every release. Prints "skipped: ..." and exits 0 when the backend
 * is not compiled in or no driver answers.
 */
#include "memgov.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int failures;

#define EXPECT(cond)                                                                  \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "gpu: line %d: expected %s (last message: %s)\n", __LINE__, \
                    #cond, memgov_last_error_message());                              \
            failures++;                                                               \
        }                                                                             \
    } while (0)

#define OK(call) EXPECT((call) == MEMGOV_OK)

int main(int argc, char** argv) {
    const char* backend = argc > 1 ? argv[1] : "cuda";
    memgov_governor* gov = NULL;
    OK(memgov_governor_create(&gov));
    memgov_context_options o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    o.backend = backend;
    o.label = "gpu-capi";
    o.budget = 64 << 20;
    memgov_context* ctx = NULL;
    int32_t rc = memgov_context_open(gov, &o, &ctx);
    if (rc == MEMGOV_ERR_UNAVAILABLE) {
        printf("skipped: %s: %s\n", backend, memgov_last_error_message());
        memgov_governor_destroy(gov);
        return 0;
    }
    EXPECT(rc == MEMGOV_OK);
    if (rc != MEMGOV_OK)
        return 1;

    memgov_stream *s1 = NULL, *s2 = NULL;
    OK(memgov_stream_create(ctx, "compute", NULL, &s1));
    OK(memgov_stream_create(ctx, "copy", NULL, &s2));
    void *raw1 = NULL, *raw2 = NULL;
    OK(memgov_stream_raw(s1, &raw1));
    OK(memgov_stream_raw(s2, &raw2));
    EXPECT(raw1 != NULL && raw2 != NULL && raw1 != raw2);

    /* PyTorch: allocations keyed by the raw stream PyTorch passes. */
    OK(memgov_torch_configure(0, s1, MEMGOV_ROLE_ACTIVATION));
    OK(memgov_torch_map_stream(0, raw2, s2));
    void* p = memgov_torch_alloc(1 << 20, 0, raw1);
    void* q = memgov_torch_alloc(1 << 16, 0, raw2);
    EXPECT(p != NULL && q != NULL);
    memgov_torch_free(p, 1 << 20, 0, raw2); /* freed on the copy stream, after compute */
    memgov_torch_free(q, 1 << 16, 0, raw2);
    EXPECT(memgov_last_error_message()[0] == '\0');
    OK(memgov_torch_reset());

    /* An OrtAllocator, counted against a plugin. */
    memgov_plugin* ep = NULL;
    OK(memgov_plugin_register("gpu-ep", &ep));
    memgov_ort_allocator* a = NULL;
    static int info;
    OK(memgov_ort_allocator_create(s1, MEMGOV_ROLE_ACTIVATION, &info, ep, &a));
    void* x = a->Alloc(a, 4096);
    void* w = a->Reserve(a, 8192);
    EXPECT(x != NULL && w != NULL);
    a->Free(a, x);
    a->Free(a, w);
    OK(memgov_ort_allocator_destroy(a));

    /* Data round trip and a recorded stream. */
    memgov_buffer* b = NULL;
    OK(memgov_buffer_allocate(s1, 4096, MEMGOV_ROLE_KV_CACHE, ep, &b));
    const char msg[] = "on the device";
    char back[sizeof msg];
    OK(memgov_buffer_write(b, 0, msg, sizeof msg));
    OK(memgov_buffer_read(b, 0, back, sizeof back));
    EXPECT(memcmp(msg, back, sizeof msg) == 0);
    void* dp = NULL;
    OK(memgov_buffer_device_ptr(b, &dp));
    EXPECT(dp != NULL);
    OK(memgov_buffer_record_stream(b, s2));
    OK(memgov_buffer_release(b));

    OK(memgov_stream_synchronize(s1));
    OK(memgov_stream_synchronize(s2));
    memgov_plugin_outstanding out;
    memset(&out, 0, sizeof out);
    out.size = sizeof out;
    OK(memgov_plugin_unregister(ep, &out));
    EXPECT(out.pending_releases == 0 && out.buffers == 0 && out.allocators == 0);

    OK(memgov_stream_destroy(s1));
    OK(memgov_stream_destroy(s2));
    memgov_teardown_report r;
    memset(&r, 0, sizeof r);
    r.size = sizeof r;
    OK(memgov_context_retire(ctx, 10000, &r));
    EXPECT(r.retired_releases == 5 && r.abandoned_releases == 0 && r.backend_status == MEMGOV_OK);
    printf("gpu: %s: torch pair, OrtAllocator, plugin, record_stream: %llu releases retired\n",
           backend, (unsigned long long)r.retired_releases);
    OK(memgov_context_close(ctx));
    OK(memgov_governor_destroy(gov));
    if (failures) {
        fprintf(stderr, "gpu: %d check(s) failed\n", failures);
        return 1;
    }
    printf("gpu: all checks passed\n");
    return 0;
}
