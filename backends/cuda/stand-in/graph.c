/*
 * graph.c: the stand-in's CUDA stream capture and graph calls. The
 * imitation and its rules are common/sq_graph.c's (compiled here, by the
 * #include below), from the stream capture and graph management sections
 * of NVIDIA's CUDA Driver API documentation; this file fills its table
 * with the driver API's names, codes and enumerators and keeps the
 * exported entry points and the hooks libcuda.c and vmm.c call that
 * record (sq_graph.c defines the others over CUDA_GRAPH).
 *
 * CUDA's side:
 * - The potentially unsafe calls (those that allocate, map or release
 *   memory outside a stream, as the documentation's example cudaMalloc):
 *   cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap (vmm.c),
 *   cuMemHostAlloc, cuMemFreeHost and cuCtxSynchronize (libcuda.c).
 * - A stream argument that is not live or not of the current context is
 *   the code libcuda.c's stream check returns (cuda_standin_check_stream).
 * - Memory nodes: cuMemAllocAsync and cuMemAllocFromPoolAsync on a
 *   capturing stream record a memory allocation node and return its
 *   address at once; cuMemFreeAsync there records a memory free node
 *   (sq_graph.c keeps their memory for the graph).
 * - cuGraphGetNodes lists a graph's nodes (a NULL array asks for the count;
 *   a larger count gets NULL entries past the end and the real count
 *   back); cuGraphNodeGetType names them (memcpy, host, mem alloc, mem
 *   free); cuGraphMemAllocNodeGetParams returns an allocation node's size
 *   and address, CUDA_ERROR_INVALID_VALUE for any other node.
 * - cuGraphInstantiateWithFlags takes flags 0 (else
 *   CUDA_ERROR_INVALID_VALUE).
 * - Fault knob (vmm.c's MEMGOV_STANDIN_CUDA_FAIL_ENTRY=<entry point>:<N>):
 *   cuStreamBeginCapture_v2 and cuStreamEndCapture, as sq_graph.c says.
 * - The exit check (MEMGOV_STANDIN_CUDA_EXIT_CHECK) does not cover graphs.
 *
 * - Test hook (not a driver rule): memgov_standin_cuda_pause_entry(name, n)
 *   (vmm.c) makes the Nth call of that entry point, on any thread, block at
 *   its entry before it does anything, until
 *   memgov_standin_cuda_resume_entry(). A test holds a call there to force
 *   an interleaving.
 *
 * Not imitated (a contract violation naming the call): event record and
 * event wait on a capturing stream (fork/join nodes), and launching a
 * graph into a capture.
 */
#define _GNU_SOURCE
#include "graph.h"
#include "vmm.h"

#include "sq_graph.h"

#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void (*CUhostFn)(void *);
typedef struct sq_graph *CUgraph;
typedef struct sq_graph_exec *CUgraphExec;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
};

/* CUstreamCaptureMode and CUstreamCaptureStatus. */
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
enum { STATUS_NONE = 0, STATUS_ACTIVE = 1, STATUS_INVALIDATED = 2 };

static int entry_fault(const char *fn) {
    return standin_entry_fault != NULL && standin_entry_fault(fn);
}

static int replay(const void *stream, const struct sq_graph_op *op) {
    return op->type == SQ_GRAPH_NODE_HOST
               ? cuda_standin_host_fn(stream, (CUhostFn)op->host_fn, op->user)
               : cuda_standin_copy("cuGraphLaunch", stream, op->dev, op->dst, op->src, op->bytes);
}

static const struct sq_graph_vendor CUDA_GRAPH = {
    .lib = "libcuda", .prefix = "MEMGOV_STANDIN_CUDA",
    .begin_capture = "cuStreamBeginCapture_v2", .end_capture = "cuStreamEndCapture",
    .launch = "cuGraphLaunch", .graph_destroy = "cuGraphDestroy",
    .exec_destroy = "cuGraphExecDestroy",
    .success = CUDA_SUCCESS, .invalid_value = CUDA_ERROR_INVALID_VALUE,
    .out_of_memory = CUDA_ERROR_OUT_OF_MEMORY, .illegal_state = CUDA_ERROR_ILLEGAL_STATE,
    .capture_unsupported = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    .capture_invalidated = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    .capture_wrong_thread = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
    .mode_global = MODE_GLOBAL, .mode_thread_local = MODE_THREAD_LOCAL,
    .mode_relaxed = MODE_RELAXED, .status_none = STATUS_NONE, .status_active = STATUS_ACTIVE,
    .status_invalidated = STATUS_INVALIDATED,
    .graphs_checked_at_exit = 0,
    .sticky = cuda_standin_sticky, .entry_fault = entry_fault, .replay = replay,
};

#define SQ_GRAPH_TABLE CUDA_GRAPH
#include "sq_graph.c"

#define ENTER(fn) CUDA_STANDIN_CALL(fn)

#define CHECK_STREAM(s, fn)                                        \
    do {                                                           \
        CUresult r_ = cuda_standin_check_stream(s, fn);            \
        if (r_ != CUDA_SUCCESS) return r_;                         \
    } while (0)

/* Counters: {captures begun, captures invalidated, driver allocations made
 * while a capture was under way, graph launches}. */
__attribute__((visibility("default"))) int memgov_standin_cuda_capture(unsigned long long out[4]) {
    return sq_graph_counters(out);
}

/* Graph memory: {allocation nodes recorded, free nodes recorded, bytes of
 * allocation nodes still held by a graph}. */
__attribute__((visibility("default"))) int memgov_standin_cuda_graph_mem(unsigned long long out[3]) {
    return sq_graph_mem_counters(out);
}

/* ---- hooks libcuda.c and vmm.c call (graph.h) -------------------------------- */

int graph_record_alloc(const char *fn, const void *stream, struct sq_mem *mem, size_t bytes,
                       unsigned long long *dptr) {
    return sq_graph_record_alloc(&CUDA_GRAPH, fn, stream, mem, bytes, dptr);
}

int graph_record_free(const char *fn, const void *stream, uint64_t dptr) {
    return sq_graph_record_free(&CUDA_GRAPH, fn, stream, dptr);
}

int graph_record_copy(const char *fn, const void *stream, uint64_t dev, void *dst,
                      const void *src, size_t bytes) {
    return sq_graph_record(&CUDA_GRAPH, fn, stream,
                           (struct sq_graph_op){.type = SQ_GRAPH_NODE_MEMCPY, .fn = fn, .dev = dev,
                                                .dst = dst, .src = src, .bytes = bytes});
}

int graph_record_host_fn(const void *stream, CUhostFn fn, void *user) {
    return sq_graph_record(&CUDA_GRAPH, "cuLaunchHostFunc", stream,
                           (struct sq_graph_op){.type = SQ_GRAPH_NODE_HOST,
                                                .host_fn = (void *)fn, .user = user});
}

void graph_note_alloc(void) { sq_graph_note_alloc(); }

/* ---- capture ---------------------------------------------------------------- */

CUresult cuStreamBeginCapture_v2(void *hStream, int mode) {
    ENTER("cuStreamBeginCapture_v2");
    CHECK_STREAM(hStream, "cuStreamBeginCapture_v2");
    return sq_graph_begin(&CUDA_GRAPH, hStream, mode);
}

CUresult cuStreamEndCapture(void *hStream, CUgraph *phGraph) {
    ENTER("cuStreamEndCapture");
    CHECK_STREAM(hStream, "cuStreamEndCapture");
    return sq_graph_end(&CUDA_GRAPH, hStream, phGraph);
}

CUresult cuStreamIsCapturing(void *hStream, int *status) {
    ENTER("cuStreamIsCapturing");
    CHECK_STREAM(hStream, "cuStreamIsCapturing");
    if (status == NULL) return CUDA_ERROR_INVALID_VALUE;
    *status = sq_graph_status(&CUDA_GRAPH, hStream, NULL, NULL);
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v2(void *hStream, int *status, uint64_t *id, CUgraph *graph,
                                   const void **deps, size_t *ndeps) {
    ENTER("cuStreamGetCaptureInfo_v2");
    CHECK_STREAM(hStream, "cuStreamGetCaptureInfo_v2");
    if (status == NULL) return CUDA_ERROR_INVALID_VALUE;
    *status = sq_graph_status(&CUDA_GRAPH, hStream, id, graph);
    /* The other outputs are written only while the capture is active. */
    if (*status == STATUS_ACTIVE) {
        if (deps != NULL) *deps = NULL;
        if (ndeps != NULL) *ndeps = 0;
    }
    return CUDA_SUCCESS;
}

/* ---- graphs ------------------------------------------------------------------ */

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phExec, CUgraph g, unsigned long long flags) {
    ENTER("cuGraphInstantiateWithFlags");
    sq_graph_check(g, "cuGraphInstantiateWithFlags");
    return sq_graph_instantiate(&CUDA_GRAPH, phExec, g, flags == 0);
}

CUresult cuGraphLaunch(CUgraphExec e, void *hStream) {
    ENTER("cuGraphLaunch");
    sq_graph_check_exec(e, "cuGraphLaunch");
    CHECK_STREAM(hStream, "cuGraphLaunch");
    return sq_graph_launch(&CUDA_GRAPH, e, hStream);
}

CUresult cuGraphExecDestroy(CUgraphExec e) {
    ENTER("cuGraphExecDestroy");
    return sq_graph_exec_destroy(&CUDA_GRAPH, e);
}

CUresult cuGraphDestroy(CUgraph g) {
    ENTER("cuGraphDestroy");
    return sq_graph_destroy(&CUDA_GRAPH, g);
}

/* ---- nodes ------------------------------------------------------------------- */

static struct sq_graph_op *check_node(void *node, const char *fn) {
    struct sq_graph_op *op = node;
    if (op == NULL || op->magic != SQ_GRAPH_NODE_MAGIC)
        sq_die("%s: %p is not a graph node", fn, node);
    return op;
}

CUresult cuGraphGetNodes(CUgraph g, void **nodes, size_t *numNodes) {
    ENTER("cuGraphGetNodes");
    sq_graph_check(g, "cuGraphGetNodes");
    if (numNodes == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (nodes == NULL) {
        *numNodes = g->ops.n;
        return CUDA_SUCCESS;
    }
    size_t n = *numNodes < g->ops.n ? *numNodes : g->ops.n;
    for (size_t i = 0; i < *numNodes; i++) nodes[i] = i < n ? (void *)&g->ops.v[i] : NULL;
    *numNodes = n;
    return CUDA_SUCCESS;
}

CUresult cuGraphNodeGetType(void *node, int *type) {
    ENTER("cuGraphNodeGetType");
    struct sq_graph_op *op = check_node(node, "cuGraphNodeGetType");
    if (type == NULL) return CUDA_ERROR_INVALID_VALUE;
    *type = op->type; /* SQ_GRAPH_NODE_* are CUgraphNodeType values */
    return CUDA_SUCCESS;
}

/* As laid out by the CUDA 12.0 headers (CUDA_MEM_ALLOC_NODE_PARAMS). */
struct mem_alloc_node_params {
    struct {
        int allocType, handleTypes;
        struct {
            int type, id;
        } location;
        void *win32SecurityAttributes;
        unsigned char reserved[64];
    } poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    uint64_t dptr;
};

CUresult cuGraphMemAllocNodeGetParams(void *node, struct mem_alloc_node_params *params) {
    ENTER("cuGraphMemAllocNodeGetParams");
    struct sq_graph_op *op = check_node(node, "cuGraphMemAllocNodeGetParams");
    if (params == NULL || op->type != SQ_GRAPH_NODE_MEM_ALLOC) return CUDA_ERROR_INVALID_VALUE;
    *params = (struct mem_alloc_node_params){0};
    params->poolProps.allocType = 1;     /* CU_MEM_ALLOCATION_TYPE_PINNED */
    params->poolProps.location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
    params->bytesize = op->bytes;
    params->dptr = op->dev;
    return CUDA_SUCCESS;
}
