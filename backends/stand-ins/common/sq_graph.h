/*
 * sq_graph.h: the stream capture and graph imitation the CUDA and HIP
 * stand-ins share (sq_graph.c), parameterised by a table each vendor fills
 * with its entry points' names, its error codes and enumerators and its
 * documented differences.
 *
 * CUDA's driver API (Stream Management: cuStreamBeginCapture,
 * cuStreamEndCapture, cuStreamGetCaptureInfo, cuStreamIsCapturing; Graph
 * Management: cuGraphInstantiate, cuGraphLaunch, cuGraphExecDestroy,
 * cuGraphDestroy) and HIP's runtime API (the same calls, hip*, with the
 * hipStreamCaptureMode and hipError_t descriptions of ROCm's header)
 * describe one capture model; its rules are written once in sq_graph.c.
 * Each vendor's graph section (of its one stand-in file) keeps only its
 * exported entry points (which check their stream the vendor's way and
 * call these) and the hooks its other sections call that differ by vendor
 * (recording a copy or a host function);
 * the others (graph_capturing, graph_conflicting, graph_unsafe) are
 * sq_graph.c's, over the table the vendor names SQ_GRAPH_TABLE.
 *
 * sq_graph.c is compiled as part of the vendor's graph section, which
 * includes it after filling its table: a stand-in built without that
 * section (CUDA: -DMEMGOV_STANDIN_CUDA_PARTIAL; HIP: without graph.c, the
 * selector that compiles it) lacks the whole imitation, as the partial
 * builds that imitate a runtime lacking the graph calls rely on.
 */
#ifndef MEMGOV_STANDIN_SQ_GRAPH_H
#define MEMGOV_STANDIN_SQ_GRAPH_H

#include "standin.h"

#include <stddef.h>
#include <stdint.h>

/* The node types the stand-in records, numbered as CUDA's CUgraphNodeType
 * (cuGraphNodeGetType returns them as they are). */
enum {
    SQ_GRAPH_NODE_MEMCPY = 1,
    SQ_GRAPH_NODE_HOST = 3,
    SQ_GRAPH_NODE_MEM_ALLOC = 10,
    SQ_GRAPH_NODE_MEM_FREE = 11,
};

struct sq_graph_gmem;

/* One recorded operation. The copy's arguments are kept as the vendor's
 * copy took them (CUDA: one device address `dev`; HIP: which sides are
 * device memory), for the vendor's replay hook. */
struct sq_graph_op {
    unsigned magic;
    int type;       /* SQ_GRAPH_NODE_* */
    const char *fn; /* the copy's entry point */
    struct sq_graph_gmem *gmem; /* SQ_GRAPH_NODE_MEM_ALLOC */
    uint64_t dev;
    int dst_device, src_device;
    void *dst;
    const void *src;
    size_t bytes;
    void *host_fn; /* SQ_GRAPH_NODE_HOST: the host function or callback */
    void *user;
};

struct sq_graph_vendor {
    /* For messages: the library ("libcuda", "libamdhip64") and entry
     * points. */
    const char *lib;
    const char *begin_capture, *end_capture, *launch, *graph_destroy, *exec_destroy;
    /* The knobs' prefix (<prefix>_EXIT_CHECK). */
    const char *prefix;

    /* Codes. */
    int success;
    int invalid_value;
    int out_of_memory;
    int illegal_state;
    int capture_unsupported;
    int capture_invalidated;
    int capture_wrong_thread;

    /* Capture modes and statuses, as the vendor numbers them. */
    int mode_global, mode_thread_local, mode_relaxed;
    int status_none, status_active, status_invalidated;

    /* Documented differences. */
    /* With <prefix>_EXIT_CHECK=1, graphs and executable graphs never
     * destroyed are a contract violation at exit (HIP's stand-in; the CUDA
     * stand-in's exit check covers contexts, pools and virtual memory). */
    int graphs_checked_at_exit;

    /* Hooks into the vendor's library. */
    int (*sticky)(void);                /* the device is in the sticky error state */
    int (*entry_fault)(const char *fn); /* the FAIL_ENTRY knob says this call fails */
    /* Queues one recorded copy or host function on `stream` at a launch,
     * with every check the direct call makes; returns the call's code. */
    int (*replay)(const void *stream, const struct sq_graph_op *op);
};

#endif
