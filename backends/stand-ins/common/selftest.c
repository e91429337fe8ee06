/*
 * selftest.c: planted violations for the ordering checks of standin.c.
 * Not part of any stand-in library; built and run by selftest.sh.
 *
 *   selftest <case>
 *
 * Cases that must pass print "ok" and exit 0: ordered (event wait, and
 * transitively through a second stream), synced (host synchronization),
 * destroyed-wait (event destroyed while the wait is pending), host-free-synced
 * (a page-locked host allocation freed once its copy completed), seeded (with
 * SELFTEST_LATENCY_US and SELFTEST_LATENCY_SEED set, jittered operations
 * still run in queue order). Cases that must abort with "contract
 * violation": unordered-free, early-event (event recorded before the last
 * use), event-after-destroy, host-free-during-copy (freed while a queued copy
 * that uses it has not run), seed-malformed (SELFTEST_LATENCY_SEED not a
 * non-negative integer). The case inits checks sq_inits, the
 * management stand-ins' reference count, against NVML's and ROCm SMI's
 * references: a shutdown without an init fails and changes nothing, and
 * the library stays initialised until every init has its shutdown.
 */
#include "standin.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    const char *c = argc > 1 ? argv[1] : "";
    sq_set_name("stand-in common self-test");
    if (!strcmp(c, "inits")) {
        struct sq_inits i = SQ_INITS_INITIALIZER;
        if (sq_inits_held(&i) || sq_inits_release(&i) != -1 || sq_inits_held(&i)) return 2;
        sq_inits_acquire(&i);
        sq_inits_acquire(&i);
        if (!sq_inits_held(&i) || sq_inits_release(&i) != 0 || !sq_inits_held(&i)) return 3;
        if (sq_inits_release(&i) != 0 || sq_inits_held(&i) || sq_inits_release(&i) != -1) return 4;
        puts("ok");
        return 0;
    }
    if (!strcmp(c, "seeded") || !strcmp(c, "seed-malformed")) {
        struct sq_knobs k;
        sq_knobs_load(&k, "SELFTEST");
        if (!k.latency_seeded) return 2;
        /* Two queues, each with 32 copies of increasing values into its own
         * byte, every copy after a delay drawn from [0, 2 * latency]: the
         * last one queued must be the one that lands last. */
        struct sq_queue *q[2] = {sq_queue_new(k.latency_us), sq_queue_new(k.latency_us)};
        static unsigned char dst[2], vals[32];
        for (int i = 0; i < 32; i++) vals[i] = (unsigned char)(i + 1);
        for (int i = 0; i < 32; i++)
            for (int j = 0; j < 2; j++) sq_queue_copy(q[j], &dst[j], &vals[i], 1);
        for (int j = 0; j < 2; j++) {
            sq_queue_sync(q[j]);
            if (dst[j] != 32) return 2;
            sq_queue_destroy(q[j]);
        }
        puts("ok");
        return 0;
    }
    /* Stream a is slow, so its work is really pending when b and c move on. */
    struct sq_queue *a = sq_queue_new(20000), *b = sq_queue_new(0), *q3 = sq_queue_new(0);
    struct sq_mem *m = sq_mem_new(0);
    uint64_t p = sq_mem_alloc_on(m, 64, a);
    static char buf[64];
    sq_queue_copy(a, (void *)(uintptr_t)p, buf, sizeof buf);
    sq_mem_touch(m, p, a, sq_queue_last(a));
    if (!strcmp(c, "ordered") || !strcmp(c, "destroyed-wait")) {
        struct sq_event *e = sq_event_new();
        sq_event_record(e, a);
        sq_queue_wait_event(b, e);
        sq_event_destroy(e);
        struct sq_queue *target = b;
        if (!strcmp(c, "ordered")) {
            struct sq_event *e2 = sq_event_new();
            sq_event_record(e2, b);
            sq_queue_wait_event(q3, e2);
            sq_event_destroy(e2);
            target = q3;
        }
        if (sq_mem_begin_free_on(m, p, target, "free") != SQ_MEM_OK) return 2;
        sq_queue_sync(target);
        sq_mem_finish_free(m, p);
    } else if (!strcmp(c, "synced")) {
        sq_queue_sync(a);
        if (sq_mem_begin_free_on(m, p, b, "free") != SQ_MEM_OK) return 2;
        sq_mem_finish_free(m, p);
    } else if (!strcmp(c, "unordered-free")) {
        sq_mem_begin_free_on(m, p, b, "free");
        return 3;
    } else if (!strcmp(c, "early-event")) {
        struct sq_event *e = sq_event_new();
        sq_event_record(e, a);
        sq_queue_copy(a, (void *)(uintptr_t)p, buf, sizeof buf);
        sq_mem_touch(m, p, a, sq_queue_last(a));
        sq_queue_wait_event(b, e);
        sq_mem_check_on(m, p, sizeof buf, b, "copy");
        return 3;
    } else if (!strcmp(c, "host-free-synced") || !strcmp(c, "host-free-during-copy")) {
        /* A page-locked host buffer copied into on the slow stream, then
         * freed synchronously (cuMemFreeHost / hipHostFree). */
        uint64_t h = sq_mem_alloc_tracked(m, 64);
        if (sq_mem_check_on(m, h, sizeof buf, a, "copy") != SQ_MEM_OK) return 2;
        sq_queue_copy(a, (void *)(uintptr_t)h, buf, sizeof buf);
        sq_mem_touch(m, h, a, sq_queue_last(a));
        if (!strcmp(c, "host-free-during-copy")) {
            sq_mem_free_now(m, h, "host free");
            return 3;
        }
        sq_queue_sync(a);
        if (sq_mem_free_now(m, h, "host free") != SQ_MEM_OK) return 2;
        if (sq_mem_check(m, h, 1) != SQ_MEM_FREED) return 2;
        sq_mem_begin_free(m, p);
        sq_mem_finish_free(m, p);
    } else if (!strcmp(c, "event-after-destroy")) {
        struct sq_event *e = sq_event_new();
        sq_event_destroy(e);
        sq_event_check(e, "wait");
        return 3;
    } else {
        fprintf(stderr, "selftest: unknown case '%s'\n", c);
        return 64;
    }
    sq_queue_destroy(a);
    sq_queue_destroy(b);
    sq_queue_destroy(q3);
    sq_mem_destroy(m);
    puts("ok");
    return 0;
}
