/*
 * graph.c: the stand-in's HIP stream capture and graph calls. The
 * imitation and its rules are common/sq_graph.c's (compiled here, by the
 * #include below), from the HIP runtime API reference (Stream Management:
 * hipStreamBeginCapture, hipStreamEndCapture, hipStreamGetCaptureInfo,
 * hipStreamIsCapturing; Graph Management: hipGraphInstantiate,
 * hipGraphLaunch, hipGraphExecDestroy, hipGraphDestroy) and the
 * hipStreamCaptureMode and hipError_t descriptions of ROCm's header; this
 * file fills its table with HIP's names, codes and enumerators and keeps
 * the exported entry points and the hooks libamdhip64.c and vmm.c call
 * that record (sq_graph.c defines the others over HIP_GRAPH).
 *
 * HIP's side:
 * - The potentially unsafe calls (those that allocate, map or release
 *   memory outside a stream): hipMalloc, hipFree, hipHostMalloc,
 *   hipHostFree (libamdhip64.c), hipMemCreate, hipMemRelease, hipMemMap and
 *   hipMemUnmap (vmm.c).
 * - A stream argument that is not live is a contract violation
 *   (hip_standin_check_stream aborts).
 * - hipStreamGetCaptureInfo reports the status and id only (ROCm's
 *   signature has no graph or dependencies).
 * - Contract violations besides sq_graph.c's: destroying a capturing
 *   stream (hipStreamDestroy, libamdhip64.c). With
 *   MEMGOV_STANDIN_HIP_EXIT_CHECK=1, graphs or executable graphs never
 *   destroyed at exit abort (sq_graph.c, graphs_checked_at_exit).
 * - Fault knob (vmm.c's MEMGOV_STANDIN_HIP_FAIL_ENTRY=<entry point>:<N>):
 *   hipStreamBeginCapture (hipErrorInvalidValue, the reference's failure
 *   code) and hipStreamEndCapture, as sq_graph.c says.
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

#include "sq_graph.h"

#include <stdint.h>
#include <stdlib.h>

static int entry_fault(const char *fn) {
    return hip_standin_entry_fault != NULL && hip_standin_entry_fault(fn);
}

static int replay(const void *stream, const struct sq_graph_op *op) {
    return op->type == SQ_GRAPH_NODE_HOST
               ? hip_standin_callback(stream, op->host_fn, op->user)
               : hip_standin_copy("hipGraphLaunch", stream, op->dst_device, op->src_device,
                                  op->dst, op->src, op->bytes);
}

static const struct sq_graph_vendor HIP_GRAPH = {
    .lib = "libamdhip64", .prefix = "MEMGOV_STANDIN_HIP",
    .begin_capture = "hipStreamBeginCapture", .end_capture = "hipStreamEndCapture",
    .launch = "hipGraphLaunch", .graph_destroy = "hipGraphDestroy",
    .exec_destroy = "hipGraphExecDestroy",
    .success = hipSuccess, .invalid_value = hipErrorInvalidValue,
    .out_of_memory = hipErrorOutOfMemory, .illegal_state = hipErrorIllegalState,
    .capture_unsupported = hipErrorStreamCaptureUnsupported,
    .capture_invalidated = hipErrorStreamCaptureInvalidated,
    .capture_wrong_thread = hipErrorStreamCaptureWrongThread,
    .mode_global = hipStreamCaptureModeGlobal, .mode_thread_local = hipStreamCaptureModeThreadLocal,
    .mode_relaxed = hipStreamCaptureModeRelaxed, .status_none = hipStreamCaptureStatusNone,
    .status_active = hipStreamCaptureStatusActive,
    .status_invalidated = hipStreamCaptureStatusInvalidated,
    /* The stand-in's own strictness (ROCm's documentation says nothing). */
    .graphs_checked_at_exit = 1,
    .sticky = sq_knobs_sticky, .entry_fault = entry_fault, .replay = replay,
};

#define SQ_GRAPH_TABLE HIP_GRAPH
#include "sq_graph.c"

/* The header declares hipGraph_t and hipGraphExec_t as pointers to opaque
 * structs; the stand-in's are sq_graph.c's. */
static struct sq_graph *graph_of(hipGraph_t g) { return (struct sq_graph *)(void *)g; }
static struct sq_graph_exec *exec_of(hipGraphExec_t e) { return (struct sq_graph_exec *)(void *)e; }

#define GRAPH_ENTER(fn) HIP_STANDIN_CALL(fn)

/* Counters: {captures begun, captures invalidated, runtime allocations made
 * while a capture was under way, graph launches}. */
int memgov_standin_hip_capture(unsigned long long out[4]);
int memgov_standin_hip_capture(unsigned long long out[4]) { return sq_graph_counters(out); }

/* ---- hooks libamdhip64.c and vmm.c call (graph.h) ---------------------------- */

int graph_record_copy(const char *fn, const void *stream, int dst_device, int src_device,
                      void *dst, const void *src, size_t bytes) {
    return sq_graph_record(&HIP_GRAPH, fn, stream,
                           (struct sq_graph_op){.type = SQ_GRAPH_NODE_MEMCPY, .fn = fn,
                                                .dst_device = dst_device,
                                                .src_device = src_device, .dst = dst,
                                                .src = src, .bytes = bytes});
}

int graph_record_callback(const void *stream, void *fn, void *user) {
    return sq_graph_record(
        &HIP_GRAPH, "hipStreamAddCallback", stream,
        (struct sq_graph_op){.type = SQ_GRAPH_NODE_HOST, .host_fn = fn, .user = user});
}

/* ---- capture ------------------------------------------------------------------ */

hipError_t hipStreamBeginCapture(hipStream_t stream, hipStreamCaptureMode mode) {
    GRAPH_ENTER("hipStreamBeginCapture");
    hip_standin_check_stream(stream, "hipStreamBeginCapture");
    return (hipError_t)sq_graph_begin(&HIP_GRAPH, stream, (int)mode);
}

hipError_t hipStreamEndCapture(hipStream_t stream, hipGraph_t *pGraph) {
    GRAPH_ENTER("hipStreamEndCapture");
    hip_standin_check_stream(stream, "hipStreamEndCapture");
    struct sq_graph *g = NULL;
    hipError_t r = (hipError_t)sq_graph_end(&HIP_GRAPH, stream, pGraph != NULL ? &g : NULL);
    if (pGraph != NULL && (r == hipSuccess || r == hipErrorStreamCaptureInvalidated))
        *pGraph = (hipGraph_t)(void *)g;
    return r;
}

hipError_t hipStreamIsCapturing(hipStream_t stream, hipStreamCaptureStatus *status) {
    GRAPH_ENTER("hipStreamIsCapturing");
    hip_standin_check_stream(stream, "hipStreamIsCapturing");
    if (status == NULL) return hipErrorInvalidValue;
    *status = (hipStreamCaptureStatus)sq_graph_status(&HIP_GRAPH, stream, NULL, NULL);
    return hipSuccess;
}

hipError_t hipStreamGetCaptureInfo(hipStream_t stream, hipStreamCaptureStatus *status,
                                   unsigned long long *id) {
    GRAPH_ENTER("hipStreamGetCaptureInfo");
    hip_standin_check_stream(stream, "hipStreamGetCaptureInfo");
    if (status == NULL) return hipErrorInvalidValue;
    /* The id is written only while the capture is active. */
    uint64_t got;
    *status = (hipStreamCaptureStatus)sq_graph_status(&HIP_GRAPH, stream, &got, NULL);
    if (*status == hipStreamCaptureStatusActive && id != NULL) *id = got;
    return hipSuccess;
}

/* ---- graphs -------------------------------------------------------------------- */

hipError_t hipGraphInstantiate(hipGraphExec_t *pGraphExec, hipGraph_t graph,
                               hipGraphNode_t *pErrorNode, char *pLogBuffer, size_t bufferSize) {
    GRAPH_ENTER("hipGraphInstantiate");
    (void)pErrorNode;
    (void)pLogBuffer;
    (void)bufferSize;
    sq_graph_check(graph_of(graph), "hipGraphInstantiate");
    struct sq_graph_exec *e;
    hipError_t r = (hipError_t)sq_graph_instantiate(&HIP_GRAPH, pGraphExec != NULL ? &e : NULL,
                                                    graph_of(graph), 1);
    if (r == hipSuccess) *pGraphExec = (hipGraphExec_t)(void *)e;
    return r;
}

hipError_t hipGraphLaunch(hipGraphExec_t e, hipStream_t stream) {
    GRAPH_ENTER("hipGraphLaunch");
    sq_graph_check_exec(exec_of(e), "hipGraphLaunch");
    hip_standin_check_stream(stream, "hipGraphLaunch");
    return (hipError_t)sq_graph_launch(&HIP_GRAPH, exec_of(e), stream);
}

hipError_t hipGraphExecDestroy(hipGraphExec_t e) {
    GRAPH_ENTER("hipGraphExecDestroy");
    return (hipError_t)sq_graph_exec_destroy(&HIP_GRAPH, exec_of(e));
}

hipError_t hipGraphDestroy(hipGraph_t g) {
    GRAPH_ENTER("hipGraphDestroy");
    return (hipError_t)sq_graph_destroy(&HIP_GRAPH, graph_of(g));
}
