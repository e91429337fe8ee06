/*
 * graph.c: HIP stream capture and graphs, imitated from the HIP runtime
 * API reference (Stream Management: hipStreamBeginCapture,
 * hipStreamEndCapture, hipStreamGetCaptureInfo, hipStreamIsCapturing;
 * Graph Management: hipGraphInstantiate, hipGraphLaunch,
 * hipGraphExecDestroy, hipGraphDestroy) and the hipStreamCaptureMode and
 * hipError_t descriptions of ROCm's header.
 *
 * Rules:
 *
 * - hipStreamBeginCapture puts a stream in capture mode: work issued to it
 *   is recorded into a graph instead of executed. A stream already
 *   capturing cannot begin again (hipErrorIllegalState).
 * - Each capture has a process-unique id (hipStreamGetCaptureInfo) and a
 *   mode, which "controls the interaction of this capture sequence with
 *   other API calls that are not safe": a potentially unsafe call is
 *   prohibited on a thread with a non-relaxed capture of its own
 *   (hipStreamCaptureModeGlobal, ThreadLocal), and on any thread while
 *   another thread has a Global capture. A prohibited call returns
 *   hipErrorStreamCaptureUnsupported ("the operation is not permitted when
 *   the stream is capturing") and invalidates the capture. The stand-in
 *   counts as potentially unsafe the calls that allocate, map or release
 *   memory outside a stream: hipMalloc, hipFree, hipHostMalloc, hipHostFree,
 *   hipMemCreate, hipMemRelease, hipMemMap and hipMemUnmap.
 * - Calls that necessarily conflict with capture are refused in every
 *   mode: synchronizing or querying a capturing stream returns
 *   hipErrorStreamCaptureUnsupported and invalidates its capture.
 * - hipStreamEndCapture returns the graph, or, for an invalidated capture,
 *   hipErrorStreamCaptureInvalidated ("the current capture sequence on the
 *   stream has been invalidated due to a previous error") and a NULL graph;
 *   either way the stream leaves capture mode. A capture not begun relaxed
 *   must end on the thread that began it (else
 *   hipErrorStreamCaptureWrongThread, and the capture goes on).
 * - hipGraphInstantiate makes an executable graph that stays valid after
 *   its graph is destroyed; hipGraphLaunch queues the recorded work on a
 *   stream, checked as it would be when issued directly: a launch whose
 *   copies touch freed memory, or reserved memory that is not mapped, is a
 *   contract violation (the device would fault).
 * - Contract violations (stricter than the documentation, which leaves
 *   them undefined): destroying a graph or an executable graph twice;
 *   destroying a capturing stream (hipStreamDestroy); with
 *   MEMGOV_STANDIN_HIP_EXIT_CHECK=1, graphs or executable graphs never
 *   destroyed at exit.
 * - Fault knob (vmm.c's MEMGOV_STANDIN_HIP_FAIL_ENTRY=<entry point>:<N>):
 *   the Nth hipStreamBeginCapture fails with hipErrorInvalidValue (the
 *   reference's failure code) and begins nothing; the Nth
 *   hipStreamEndCapture ends the capture as an invalidated one
 *   (hipErrorStreamCaptureInvalidated, no graph, the stream out of
 *   capture mode).
 *
 * Test hook (not a runtime rule): memgov_standin_hip_pause_entry(name, n)
 * (vmm.c) makes the Nth call of that entry point, on any thread, block at
 * its entry before it does anything, until memgov_standin_hip_resume_entry().
 *
 * Not imitated (a contract violation naming the call): stream-ordered
 * allocation and free (hipMallocAsync, hipMallocFromPoolAsync,
 * hipFreeAsync), event record and event wait on a capturing stream (memory
 * and fork/join nodes), and launching a graph into a capture.
 */
#define _GNU_SOURCE
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

#include "graph.h"
#include "vmm.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GRAPH_MAGIC 0x48475250u /* "HGRP" */
#define EXEC_MAGIC 0x48475845u  /* "HGXE" */

struct op {
    const char *fn; /* NULL: a stream callback */
    int dst_device, src_device;
    void *dst;
    const void *src;
    size_t bytes;
    void *callback;
    void *user;
};

struct ops {
    struct op *v;
    size_t n, cap;
};

/* The header declares both opaque; the stand-in defines them. Headers stay
 * allocated after destruction so that a second destroy is recognised; their
 * operations are freed. */
struct ihipGraph {
    unsigned magic;
    int destroyed;
    struct ops ops;
};

struct hipGraphExec {
    unsigned magic;
    int destroyed;
    struct ops ops;
};

struct capture {
    const void *stream;
    unsigned long long id;
    int mode;
    pthread_t thread;
    int invalidated;
    struct ihipGraph *graph;
    struct capture *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct capture *g_captures; /* ongoing, under g_lock */
static unsigned long long g_next_id = 1;
/* Counters for the tests (memgov_standin_hip_capture) and the exit check. */
static uint64_t g_begun, g_invalidated, g_allocs_during, g_launches;
static uint64_t g_live_graphs, g_live_execs;
static int g_exit_check_set;

static void leave_call(int *unused) {
    (void)unused;
    hip_standin_leave();
}

#define GRAPH_ENTER(fn)                                                             \
    __attribute__((cleanup(leave_call))) int in_call_ = 0;                          \
    (void)in_call_;                                                                 \
    if (hip_standin_enter(fn)) return hipErrorIllegalAddress

static void exit_check(void) {
    if (sq_knobs_sticky()) return;
    pthread_mutex_lock(&g_lock);
    uint64_t graphs = g_live_graphs, execs = g_live_execs;
    pthread_mutex_unlock(&g_lock);
    if (graphs != 0 || execs != 0)
        sq_die("at exit: %llu graph(s) and %llu executable graph(s) never destroyed "
               "(hipGraphDestroy, hipGraphExecDestroy)",
               (unsigned long long)graphs, (unsigned long long)execs);
}

/* Under g_lock. */
static void arm_exit_check(void) {
    if (g_exit_check_set) return;
    g_exit_check_set = 1;
    if (sq_env_u64("MEMGOV_STANDIN_HIP_EXIT_CHECK", 0) != 0) atexit(exit_check);
}

/* Under g_lock. */
static struct capture *find(const void *stream) {
    for (struct capture *c = g_captures; c != NULL; c = c->next)
        if (c->stream == stream) return c;
    return NULL;
}

static void push(struct ops *ops, struct op op) {
    if (ops->n == ops->cap) {
        ops->cap = ops->cap ? ops->cap * 2 : 8;
        ops->v = realloc(ops->v, ops->cap * sizeof *ops->v);
        if (ops->v == NULL) sq_fatal("out of host memory");
    }
    ops->v[ops->n++] = op;
}

static void invalidate(struct capture *c) {
    if (!c->invalidated) g_invalidated++;
    c->invalidated = 1;
}

/* Counters: {captures begun, captures invalidated, runtime allocations made
 * while a capture was under way, graph launches}. */
int memgov_standin_hip_capture(unsigned long long out[4]);
int memgov_standin_hip_capture(unsigned long long out[4]) {
    if (out == NULL) return 1;
    pthread_mutex_lock(&g_lock);
    out[0] = g_begun;
    out[1] = g_invalidated;
    out[2] = g_allocs_during;
    out[3] = g_launches;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* ---- hooks libamdhip64.c and vmm.c call ------------------------------------ */

int graph_capturing(const void *stream) {
    pthread_mutex_lock(&g_lock);
    int r = g_captures != NULL && find(stream) != NULL;
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_record_copy(const char *fn, const void *stream, int dst_device, int src_device,
                      void *dst, const void *src, size_t bytes) {
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    if (!c->invalidated)
        push(&c->graph->ops, (struct op){.fn = fn, .dst_device = dst_device,
                                         .src_device = src_device, .dst = dst, .src = src,
                                         .bytes = bytes});
    int r = c->invalidated ? hipErrorStreamCaptureInvalidated : hipSuccess;
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_record_callback(const void *stream, void *fn, void *user) {
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c == NULL) sq_die("hipStreamAddCallback: stream %p is not capturing", stream);
    if (!c->invalidated) push(&c->graph->ops, (struct op){.callback = fn, .user = user});
    int r = c->invalidated ? hipErrorStreamCaptureInvalidated : hipSuccess;
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_conflicting(const char *fn, const void *stream) {
    (void)fn;
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c != NULL) invalidate(c);
    pthread_mutex_unlock(&g_lock);
    return hipErrorStreamCaptureUnsupported;
}

int graph_unsafe(const char *fn, int alloc) {
    (void)fn;
    pthread_mutex_lock(&g_lock);
    if (g_captures == NULL) {
        pthread_mutex_unlock(&g_lock);
        return 0;
    }
    if (alloc) g_allocs_during++;
    pthread_t me = pthread_self();
    int prohibited = 0;
    for (struct capture *c = g_captures; c != NULL; c = c->next) {
        int mine = pthread_equal(c->thread, me);
        if ((mine && c->mode != hipStreamCaptureModeRelaxed) ||
            (!mine && c->mode == hipStreamCaptureModeGlobal)) {
            invalidate(c);
            prohibited = 1;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return prohibited ? hipErrorStreamCaptureUnsupported : 0;
}

static int entry_fault(const char *fn) {
    return hip_standin_entry_fault != NULL && hip_standin_entry_fault(fn);
}

/* ---- capture ------------------------------------------------------------------ */

hipError_t hipStreamBeginCapture(hipStream_t stream, hipStreamCaptureMode mode) {
    GRAPH_ENTER("hipStreamBeginCapture");
    hip_standin_check_stream(stream, "hipStreamBeginCapture");
    if (mode != hipStreamCaptureModeGlobal && mode != hipStreamCaptureModeThreadLocal &&
        mode != hipStreamCaptureModeRelaxed)
        return hipErrorInvalidValue;
    struct capture *c = calloc(1, sizeof *c);
    struct ihipGraph *g = calloc(1, sizeof *g);
    if (c == NULL || g == NULL) sq_fatal("out of host memory");
    g->magic = GRAPH_MAGIC;
    pthread_mutex_lock(&g_lock);
    arm_exit_check();
    if (entry_fault("hipStreamBeginCapture")) {
        pthread_mutex_unlock(&g_lock);
        free(c);
        free(g);
        return hipErrorInvalidValue;
    }
    if (find(stream) != NULL) {
        pthread_mutex_unlock(&g_lock);
        free(c);
        free(g);
        return hipErrorIllegalState;
    }
    *c = (struct capture){.stream = stream, .id = g_next_id++, .mode = mode,
                          .thread = pthread_self(), .graph = g, .next = g_captures};
    g_captures = c;
    g_begun++;
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

hipError_t hipStreamEndCapture(hipStream_t stream, hipGraph_t *pGraph) {
    GRAPH_ENTER("hipStreamEndCapture");
    hip_standin_check_stream(stream, "hipStreamEndCapture");
    if (pGraph == NULL) return hipErrorInvalidValue;
    pthread_mutex_lock(&g_lock);
    struct capture **p = &g_captures;
    while (*p != NULL && (*p)->stream != stream) p = &(*p)->next;
    struct capture *c = *p;
    if (c == NULL) {
        pthread_mutex_unlock(&g_lock);
        return hipErrorIllegalState;
    }
    if (c->mode != hipStreamCaptureModeRelaxed && !pthread_equal(c->thread, pthread_self())) {
        pthread_mutex_unlock(&g_lock);
        return hipErrorStreamCaptureWrongThread;
    }
    *p = c->next;
    hipError_t r = hipSuccess;
    if (entry_fault("hipStreamEndCapture")) c->invalidated = 1;
    if (c->invalidated) {
        free(c->graph->ops.v);
        free(c->graph);
        *pGraph = NULL;
        r = hipErrorStreamCaptureInvalidated;
    } else {
        *pGraph = c->graph;
        g_live_graphs++;
    }
    pthread_mutex_unlock(&g_lock);
    free(c);
    return r;
}

hipError_t hipStreamIsCapturing(hipStream_t stream, hipStreamCaptureStatus *status) {
    GRAPH_ENTER("hipStreamIsCapturing");
    hip_standin_check_stream(stream, "hipStreamIsCapturing");
    if (status == NULL) return hipErrorInvalidValue;
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    *status = c == NULL          ? hipStreamCaptureStatusNone
              : c->invalidated ? hipStreamCaptureStatusInvalidated
                               : hipStreamCaptureStatusActive;
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

hipError_t hipStreamGetCaptureInfo(hipStream_t stream, hipStreamCaptureStatus *status,
                                   unsigned long long *id) {
    GRAPH_ENTER("hipStreamGetCaptureInfo");
    hip_standin_check_stream(stream, "hipStreamGetCaptureInfo");
    if (status == NULL) return hipErrorInvalidValue;
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    *status = c == NULL          ? hipStreamCaptureStatusNone
              : c->invalidated ? hipStreamCaptureStatusInvalidated
                               : hipStreamCaptureStatusActive;
    /* The id is written only while the capture is active. */
    if (c != NULL && !c->invalidated && id != NULL) *id = c->id;
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

/* ---- graphs -------------------------------------------------------------------- */

static void check_graph(struct ihipGraph *g, const char *fn) {
    if (g == NULL || g->magic != GRAPH_MAGIC) sq_die("%s: %p is not a graph", fn, (void *)g);
    if (g->destroyed) sq_die("%s on destroyed graph %p", fn, (void *)g);
}

static void check_exec(struct hipGraphExec *e, const char *fn) {
    if (e == NULL || e->magic != EXEC_MAGIC)
        sq_die("%s: %p is not an executable graph", fn, (void *)e);
    if (e->destroyed) sq_die("%s on destroyed executable graph %p", fn, (void *)e);
}

hipError_t hipGraphInstantiate(hipGraphExec_t *pGraphExec, hipGraph_t graph,
                               hipGraphNode_t *pErrorNode, char *pLogBuffer, size_t bufferSize) {
    GRAPH_ENTER("hipGraphInstantiate");
    (void)pErrorNode;
    (void)pLogBuffer;
    (void)bufferSize;
    check_graph(graph, "hipGraphInstantiate");
    if (pGraphExec == NULL) return hipErrorInvalidValue;
    struct hipGraphExec *e = calloc(1, sizeof *e);
    if (e == NULL) sq_fatal("out of host memory");
    e->magic = EXEC_MAGIC;
    for (size_t i = 0; i < graph->ops.n; i++) push(&e->ops, graph->ops.v[i]);
    pthread_mutex_lock(&g_lock);
    g_live_execs++;
    pthread_mutex_unlock(&g_lock);
    *pGraphExec = e;
    return hipSuccess;
}

hipError_t hipGraphLaunch(hipGraphExec_t e, hipStream_t stream) {
    GRAPH_ENTER("hipGraphLaunch");
    check_exec(e, "hipGraphLaunch");
    hip_standin_check_stream(stream, "hipGraphLaunch");
    if (graph_capturing(stream))
        sq_die("hipGraphLaunch into a capturing stream (a child graph node) is not imitated by "
               "the stand-in libamdhip64");
    pthread_mutex_lock(&g_lock);
    g_launches++;
    pthread_mutex_unlock(&g_lock);
    for (size_t i = 0; i < e->ops.n; i++) {
        const struct op *op = &e->ops.v[i];
        int r = op->fn == NULL
                    ? hip_standin_callback(stream, op->callback, op->user)
                    : hip_standin_copy("hipGraphLaunch", stream, op->dst_device, op->src_device,
                                       op->dst, op->src, op->bytes);
        if (r != hipSuccess) return (hipError_t)r;
    }
    return hipSuccess;
}

hipError_t hipGraphExecDestroy(hipGraphExec_t e) {
    GRAPH_ENTER("hipGraphExecDestroy");
    check_exec(e, "hipGraphExecDestroy");
    /* Launches already queued hold copies of what they need. */
    e->destroyed = 1;
    free(e->ops.v);
    e->ops = (struct ops){0};
    pthread_mutex_lock(&g_lock);
    g_live_execs--;
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

hipError_t hipGraphDestroy(hipGraph_t g) {
    GRAPH_ENTER("hipGraphDestroy");
    check_graph(g, "hipGraphDestroy");
    g->destroyed = 1;
    free(g->ops.v);
    g->ops = (struct ops){0};
    pthread_mutex_lock(&g_lock);
    g_live_graphs--;
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}
