/*
 * Pressure callbacks removed while other threads are calling them: once
 * memgov_pressure_callback_remove has returned, no call is in the callback
 * and none starts.
 *
 * THREADS threads each loop: register a callback with a registration of its
 * own (alive = 1), allocate on a context whose budget is full (so every
 * registered callback, the other threads' too, is called), remove the
 * callback, and clear `alive` right after remove returns. The callback
 * checks `alive` when it enters and again before it returns, and counts the
 * calls inside it: a call that enters after remove returned, or is still
 * inside when it returned, is a violation. Registrations are freed only at
 * the end, so a violation is counted, not a use-after-free.
 *
 * Usage: stress [ITERATIONS] (per thread; default 400). Exit status 0 when
 * no violation was seen.
 */
#include "memgov.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 16

typedef struct registration {
    atomic_int alive;
    atomic_int inside;
    atomic_int calls;
} registration;

static memgov_context* ctx;
static memgov_stream* stream;
static int iterations = 400;
static atomic_long violations;
static atomic_long calls;
static atomic_long failures;
static registration* regs[THREADS];

static uint64_t check_alive(const memgov_pressure_request* request, void* user_data) {
    (void)request;
    registration* r = user_data;
    if (atomic_load(&r->alive) != 1)
        atomic_fetch_add(&violations, 1); /* entered after remove returned */
    atomic_fetch_add(&r->inside, 1);
    atomic_fetch_add(&r->calls, 1);
    atomic_fetch_add(&calls, 1);
    sched_yield(); /* widen the window in which a remove can race this call */
    if (atomic_load(&r->alive) != 1)
        atomic_fetch_add(&violations, 1); /* remove returned while inside */
    atomic_fetch_sub(&r->inside, 1);
    return 0;
}

static void* worker(void* arg) {
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < iterations; i++) {
        registration* r = &regs[t][i];
        atomic_store(&r->alive, 1);
        memgov_callback* cb = NULL;
        if (memgov_pressure_callback_add(ctx, NULL, check_alive, r, &cb) != MEMGOV_OK) {
            fprintf(stderr, "stress: add: %s\n", memgov_last_error_message());
            atomic_fetch_add(&failures, 1);
            return NULL;
        }
        memgov_buffer* b = NULL;
        int32_t rc = memgov_buffer_allocate(stream, 4096, MEMGOV_ROLE_ACTIVATION, NULL, &b);
        if (rc != MEMGOV_ERR_OUT_OF_MEMORY) {
            fprintf(stderr, "stress: allocate: %s: %s\n", memgov_status_name(rc),
                    memgov_last_error_message());
            atomic_fetch_add(&failures, 1);
        }
        if (memgov_pressure_callback_remove(cb) != MEMGOV_OK) {
            fprintf(stderr, "stress: remove: %s\n", memgov_last_error_message());
            atomic_fetch_add(&failures, 1);
        }
        atomic_store(&r->alive, 0);
        if (atomic_load(&r->inside) != 0)
            atomic_fetch_add(&violations, 1);
    }
    return NULL;
}

int main(int argc, char** argv) {
    if (argc > 1)
        iterations = atoi(argv[1]);
    if (iterations <= 0) {
        fprintf(stderr, "usage: stress [ITERATIONS]\n");
        return 2;
    }
    memgov_governor* gov = NULL;
    memgov_buffer* held = NULL;
    memgov_context_options o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    o.backend = "host";
    o.label = "stress";
    o.budget = 4096; /* full once `held` is: every allocation asks the callbacks */
    if (memgov_governor_create(&gov) != MEMGOV_OK || memgov_context_open(gov, &o, &ctx) != MEMGOV_OK ||
        memgov_stream_create(ctx, "stress", NULL, &stream) != MEMGOV_OK ||
        memgov_buffer_allocate(stream, 4096, MEMGOV_ROLE_WEIGHTS, NULL, &held) != MEMGOV_OK) {
        fprintf(stderr, "stress: set-up: %s\n", memgov_last_error_message());
        return 2;
    }
    for (int t = 0; t < THREADS; t++)
        regs[t] = calloc((size_t)iterations, sizeof(registration));
    pthread_t threads[THREADS];
    for (int t = 0; t < THREADS; t++)
        pthread_create(&threads[t], NULL, worker, (void*)(intptr_t)t);
    for (int t = 0; t < THREADS; t++)
        pthread_join(threads[t], NULL);
    for (int t = 0; t < THREADS; t++)
        free(regs[t]);
    int ok = memgov_buffer_release(held) == MEMGOV_OK && memgov_stream_destroy(stream) == MEMGOV_OK &&
             memgov_context_retire(ctx, 5000, NULL) == MEMGOV_OK &&
             memgov_context_close(ctx) == MEMGOV_OK && memgov_governor_destroy(gov) == MEMGOV_OK;
    printf("stress: %d threads x %d registrations: %ld callback calls, %ld calls after remove returned\n",
           THREADS, iterations, atomic_load(&calls), atomic_load(&violations));
    if (!ok || atomic_load(&failures) || atomic_load(&violations)) {
        fprintf(stderr, "stress: FAILED (%ld failed calls, %ld violations)\n", atomic_load(&failures),
                atomic_load(&violations));
        return 1;
    }
    printf("stress: all checks passed\n");
    return 0;
}
