/*
 * graph.c: stream capture and graphs, imitated from the stream capture and
 * graph management sections of NVIDIA's CUDA Driver API documentation.
 *
 * Rules, each from the documentation:
 *
 * - cuStreamBeginCapture_v2 puts a stream in capture mode: work issued to
 *   it is recorded into a graph instead of executed. A stream already
 *   capturing cannot begin again (CUDA_ERROR_ILLEGAL_STATE).
 * - Each capture has a process-unique id (cuStreamGetCaptureInfo_v2) and a
 *   mode. While a capture is ongoing, "potentially unsafe API calls" (the
 *   documentation's example: cudaMalloc, which changes memory outside any
 *   stream and so is not observed by capture) are prohibited on a thread
 *   that has a non-RELAXED capture of its own (GLOBAL, THREAD_LOCAL), or on
 *   any thread while another thread has a GLOBAL capture. A prohibited call
 *   returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the
 *   capture. The stand-in counts as potentially unsafe the calls that
 *   allocate, map or release memory outside a stream: cuMemCreate,
 *   cuMemRelease, cuMemMap, cuMemUnmap, cuMemHostAlloc, cuMemFreeHost, and
 *   cuCtxSynchronize.
 * - Calls that necessarily conflict with capture are refused in every
 *   mode: synchronizing or querying a capturing stream returns
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates its capture.
 * - cuStreamEndCapture returns the graph, or, for an invalidated capture,
 *   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and a NULL graph; either way the
 *   stream leaves capture mode. A capture not begun RELAXED must end on the
 *   thread that began it (else CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, and
 *   the capture goes on).
 * - cuGraphInstantiateWithFlags makes an executable graph that stays valid
 *   after its graph is destroyed; cuGraphLaunch queues the recorded work on
 *   a stream. The work is checked as it would be when issued directly, so a
 *   launch whose copies touch freed memory, or reserved memory that is not
 *   mapped, is a contract violation (the device would fault).
 * - Destroying a graph or an executable graph twice is a contract
 *   violation.
 *
 * - Stream-ordered allocation on a capturing stream (cuMemAllocAsync,
 *   cuMemAllocFromPoolAsync) records a memory allocation node and returns
 *   its address at once; cuMemFreeAsync there records a memory free node.
 *   The documentation fixes a graph allocation's address for the graph's
 *   life and keeps its memory for the graph while it may launch; the
 *   stand-in allocates it when the node is recorded and frees it when the
 *   graph and every executable graph made from it are destroyed.
 * - cuGraphGetNodes lists a graph's nodes (a NULL array asks for the count;
 *   a larger count gets NULL entries past the end and the real count
 *   back); cuGraphNodeGetType names them (memcpy, host, mem alloc, mem
 *   free); cuGraphMemAllocNodeGetParams returns an allocation node's size
 *   and address, CUDA_ERROR_INVALID_VALUE for any other node.
 * - Fault knob (vmm.c's MEMGOV_STANDIN_CUDA_FAIL_ENTRY=<entry point>:<N>):
 *   the Nth cuStreamBeginCapture_v2 fails with CUDA_ERROR_INVALID_VALUE (of
 *   the codes its reference lists, the one a valid call can meet) and
 *   begins nothing; the Nth cuStreamEndCapture ends the capture as an
 *   invalidated one (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, no graph, the
 *   stream out of capture mode).
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

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void (*CUhostFn)(void *);

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

enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
enum { STATUS_NONE = 0, STATUS_ACTIVE = 1, STATUS_INVALIDATED = 2 };

#define GRAPH_MAGIC 0x47525048u /* "GRPH" */
#define EXEC_MAGIC 0x47455845u  /* "GEXE" */

/* CUgraphNodeType values of the nodes the stand-in records. */
enum { NODE_MEMCPY = 1, NODE_HOST = 3, NODE_MEM_ALLOC = 10, NODE_MEM_FREE = 11 };

#define NODE_MAGIC 0x4e4f4445u /* "NODE" */

/* The memory of an allocation node, shared by the graph and the executable
 * graphs made from it; freed when the last of them is destroyed. */
struct gmem {
    struct sq_mem *mem;
    uint64_t ptr;
    size_t bytes;
    int refs;
};

struct op {
    unsigned magic;
    int type;       /* NODE_* */
    const char *fn; /* NULL: a host function or a memory node */
    struct gmem *gmem; /* NODE_MEM_ALLOC */
    uint64_t dev;
    void *dst;
    const void *src;
    size_t bytes;
    CUhostFn host_fn;
    void *user;
};

struct ops {
    struct op *v;
    size_t n, cap;
};

/* Headers stay allocated after destruction so that a second destroy is
 * recognised; their operations are freed. */
struct CUgraph_st {
    unsigned magic;
    int destroyed;
    struct ops ops;
};

struct CUgraphExec_st {
    unsigned magic;
    int destroyed;
    struct ops ops;
};

struct capture {
    const void *stream;
    uint64_t id;
    int mode;
    pthread_t thread;
    int invalidated;
    struct CUgraph_st *graph;
    struct capture *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct capture *g_captures; /* ongoing, under g_lock */
static uint64_t g_next_id = 1;
/* Counters for the tests (memgov_standin_cuda_capture,
 * memgov_standin_cuda_graph_mem). */
static uint64_t g_begun, g_invalidated, g_allocs_during, g_launches;
static uint64_t g_alloc_nodes, g_free_nodes, g_gmem_live;

static int entry_fault(const char *fn) {
    return standin_entry_fault != NULL && standin_entry_fault(fn);
}

#define ENTER(fn)                                                  \
    do {                                                           \
        int e_ = cuda_standin_enter(fn);                           \
        if (e_ > 0) return CUDA_ERROR_ILLEGAL_ADDRESS;             \
        if (e_ < 0) return CUDA_ERROR_NOT_INITIALIZED;             \
    } while (0)

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
    op.magic = NODE_MAGIC;
    ops->v[ops->n++] = op;
}

static void invalidate(struct capture *c) {
    if (!c->invalidated) g_invalidated++;
    c->invalidated = 1;
}

/* Counters: {captures begun, captures invalidated, driver allocations made
 * while a capture was under way, graph launches}. */
__attribute__((visibility("default"))) int memgov_standin_cuda_capture(unsigned long long out[4]) {
    if (out == NULL) return 1;
    pthread_mutex_lock(&g_lock);
    out[0] = g_begun;
    out[1] = g_invalidated;
    out[2] = g_allocs_during;
    out[3] = g_launches;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Graph memory: {allocation nodes recorded, free nodes recorded, bytes of
 * allocation nodes still held by a graph}. */
__attribute__((visibility("default"))) int memgov_standin_cuda_graph_mem(unsigned long long out[3]) {
    if (out == NULL) return 1;
    pthread_mutex_lock(&g_lock);
    out[0] = g_alloc_nodes;
    out[1] = g_free_nodes;
    out[2] = g_gmem_live;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Under g_lock: one holder of `m` less; the memory goes with the last. */
static void gmem_drop(struct gmem *m) {
    if (--m->refs > 0) return;
    enum sq_mem_check c = sq_mem_free_now(m->mem, m->ptr, "cuGraphDestroy");
    if (c != SQ_MEM_OK)
        sq_die("graph memory at 0x%llx: %s", (unsigned long long)m->ptr, sq_mem_check_str(c));
    g_gmem_live -= m->bytes;
    free(m);
}

/* Under g_lock: the operations of a destroyed graph or executable graph. */
static void ops_drop(struct ops *ops) {
    for (size_t i = 0; i < ops->n; i++)
        if (ops->v[i].type == NODE_MEM_ALLOC) gmem_drop(ops->v[i].gmem);
    free(ops->v);
    *ops = (struct ops){0};
}

/* ---- hooks libcuda.c and vmm.c call --------------------------------------- */

int graph_record_alloc(const char *fn, const void *stream, struct sq_mem *mem, size_t bytes,
                       unsigned long long *dptr) {
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    if (c->invalidated) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    uint64_t p = sq_mem_alloc_tracked(mem, bytes);
    if (p == 0) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct gmem *m = malloc(sizeof *m);
    if (m == NULL) sq_fatal("out of host memory");
    *m = (struct gmem){.mem = mem, .ptr = p, .bytes = bytes, .refs = 1};
    push(&c->graph->ops, (struct op){.type = NODE_MEM_ALLOC, .gmem = m, .dev = p, .bytes = bytes});
    g_alloc_nodes++;
    g_gmem_live += bytes;
    *dptr = p;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

int graph_record_free(const char *fn, const void *stream, uint64_t dptr) {
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    int r = c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
    if (!c->invalidated) {
        push(&c->graph->ops, (struct op){.type = NODE_MEM_FREE, .dev = dptr});
        g_free_nodes++;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_capturing(const void *stream) {
    pthread_mutex_lock(&g_lock);
    int r = g_captures != NULL && find(stream) != NULL;
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_record_copy(const char *fn, const void *stream, uint64_t dev, void *dst,
                      const void *src, size_t bytes) {
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    if (!c->invalidated)
        push(&c->graph->ops,
             (struct op){.type = NODE_MEMCPY, .fn = fn, .dev = dev, .dst = dst, .src = src,
                         .bytes = bytes});
    int r = c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_record_host_fn(const void *stream, CUhostFn fn, void *user) {
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c == NULL) sq_die("cuLaunchHostFunc: stream %p is not capturing", stream);
    if (!c->invalidated)
        push(&c->graph->ops, (struct op){.type = NODE_HOST, .host_fn = fn, .user = user});
    int r = c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
    pthread_mutex_unlock(&g_lock);
    return r;
}

int graph_conflicting(const char *fn, const void *stream) {
    (void)fn;
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(stream);
    if (c != NULL) invalidate(c);
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
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
        if ((mine && c->mode != MODE_RELAXED) || (!mine && c->mode == MODE_GLOBAL)) {
            invalidate(c);
            prohibited = 1;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return prohibited ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : 0;
}

void graph_note_alloc(void) {
    pthread_mutex_lock(&g_lock);
    if (g_captures != NULL) g_allocs_during++;
    pthread_mutex_unlock(&g_lock);
}

/* ---- capture ---------------------------------------------------------------- */

CUresult cuStreamBeginCapture_v2(void *hStream, int mode) {
    ENTER("cuStreamBeginCapture_v2");
    CUresult r = cuda_standin_check_stream(hStream, "cuStreamBeginCapture_v2");
    if (r != CUDA_SUCCESS) return r;
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    struct capture *c = calloc(1, sizeof *c);
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (c == NULL || g == NULL) sq_fatal("out of host memory");
    g->magic = GRAPH_MAGIC;
    pthread_mutex_lock(&g_lock);
    if (entry_fault("cuStreamBeginCapture_v2")) {
        pthread_mutex_unlock(&g_lock);
        free(c);
        free(g);
        return CUDA_ERROR_INVALID_VALUE; /* the reference lists no other failure */
    }
    if (find(hStream) != NULL) {
        pthread_mutex_unlock(&g_lock);
        free(c);
        free(g);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    *c = (struct capture){.stream = hStream, .id = g_next_id++, .mode = mode,
                          .thread = pthread_self(), .graph = g, .next = g_captures};
    g_captures = c;
    g_begun++;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(void *hStream, struct CUgraph_st **phGraph) {
    ENTER("cuStreamEndCapture");
    CUresult r = cuda_standin_check_stream(hStream, "cuStreamEndCapture");
    if (r != CUDA_SUCCESS) return r;
    if (phGraph == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct capture **p = &g_captures;
    while (*p != NULL && (*p)->stream != hStream) p = &(*p)->next;
    struct capture *c = *p;
    if (c == NULL) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    if (c->mode != MODE_RELAXED && !pthread_equal(c->thread, pthread_self())) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    }
    *p = c->next;
    if (entry_fault("cuStreamEndCapture")) invalidate(c);
    if (c->invalidated) ops_drop(&c->graph->ops);
    pthread_mutex_unlock(&g_lock);
    if (c->invalidated) {
        free(c->graph);
        *phGraph = NULL;
        r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else {
        *phGraph = c->graph;
    }
    free(c);
    return r;
}

CUresult cuStreamIsCapturing(void *hStream, int *status) {
    ENTER("cuStreamIsCapturing");
    CUresult r = cuda_standin_check_stream(hStream, "cuStreamIsCapturing");
    if (r != CUDA_SUCCESS) return r;
    if (status == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(hStream);
    *status = c == NULL ? STATUS_NONE : c->invalidated ? STATUS_INVALIDATED : STATUS_ACTIVE;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v2(void *hStream, int *status, uint64_t *id,
                                   struct CUgraph_st **graph, const void **deps, size_t *ndeps) {
    ENTER("cuStreamGetCaptureInfo_v2");
    CUresult r = cuda_standin_check_stream(hStream, "cuStreamGetCaptureInfo_v2");
    if (r != CUDA_SUCCESS) return r;
    if (status == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct capture *c = find(hStream);
    *status = c == NULL ? STATUS_NONE : c->invalidated ? STATUS_INVALIDATED : STATUS_ACTIVE;
    /* The other outputs are written only while the capture is active. */
    if (c != NULL && !c->invalidated) {
        if (id != NULL) *id = c->id;
        if (graph != NULL) *graph = c->graph;
        if (deps != NULL) *deps = NULL;
        if (ndeps != NULL) *ndeps = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* ---- graphs ------------------------------------------------------------------ */

static void check_graph(struct CUgraph_st *g, const char *fn) {
    if (g == NULL || g->magic != GRAPH_MAGIC) sq_die("%s: %p is not a graph", fn, (void *)g);
    if (g->destroyed) sq_die("%s on destroyed graph %p", fn, (void *)g);
}

static void check_exec(struct CUgraphExec_st *e, const char *fn) {
    if (e == NULL || e->magic != EXEC_MAGIC)
        sq_die("%s: %p is not an executable graph", fn, (void *)e);
    if (e->destroyed) sq_die("%s on destroyed executable graph %p", fn, (void *)e);
}

CUresult cuGraphInstantiateWithFlags(struct CUgraphExec_st **phExec, struct CUgraph_st *g,
                                     unsigned long long flags) {
    ENTER("cuGraphInstantiateWithFlags");
    check_graph(g, "cuGraphInstantiateWithFlags");
    if (phExec == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (e == NULL) sq_fatal("out of host memory");
    e->magic = EXEC_MAGIC;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g->ops.n; i++) {
        push(&e->ops, g->ops.v[i]);
        if (g->ops.v[i].type == NODE_MEM_ALLOC) g->ops.v[i].gmem->refs++;
    }
    pthread_mutex_unlock(&g_lock);
    *phExec = e;
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(struct CUgraphExec_st *e, void *hStream) {
    ENTER("cuGraphLaunch");
    check_exec(e, "cuGraphLaunch");
    CUresult r = cuda_standin_check_stream(hStream, "cuGraphLaunch");
    if (r != CUDA_SUCCESS) return r;
    if (graph_capturing(hStream))
        sq_die("cuGraphLaunch into a capturing stream (a child graph node) is not imitated by "
               "the stand-in libcuda");
    pthread_mutex_lock(&g_lock);
    g_launches++;
    pthread_mutex_unlock(&g_lock);
    for (size_t i = 0; i < e->ops.n; i++) {
        const struct op *op = &e->ops.v[i];
        /* Graph memory stays allocated for the graph: nothing to queue. */
        if (op->type == NODE_MEM_ALLOC || op->type == NODE_MEM_FREE) continue;
        r = op->fn == NULL ? cuda_standin_host_fn(hStream, op->host_fn, op->user)
                           : cuda_standin_copy("cuGraphLaunch", hStream, op->dev, op->dst, op->src,
                                               op->bytes);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(struct CUgraphExec_st *e) {
    ENTER("cuGraphExecDestroy");
    check_exec(e, "cuGraphExecDestroy");
    /* Launches already queued hold copies of what they need. */
    e->destroyed = 1;
    pthread_mutex_lock(&g_lock);
    ops_drop(&e->ops);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(struct CUgraph_st *g) {
    ENTER("cuGraphDestroy");
    check_graph(g, "cuGraphDestroy");
    g->destroyed = 1;
    pthread_mutex_lock(&g_lock);
    ops_drop(&g->ops);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* ---- nodes ------------------------------------------------------------------- */

static struct op *check_node(void *node, const char *fn) {
    struct op *op = node;
    if (op == NULL || op->magic != NODE_MAGIC) sq_die("%s: %p is not a graph node", fn, node);
    return op;
}

CUresult cuGraphGetNodes(struct CUgraph_st *g, void **nodes, size_t *numNodes) {
    ENTER("cuGraphGetNodes");
    check_graph(g, "cuGraphGetNodes");
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
    struct op *op = check_node(node, "cuGraphNodeGetType");
    if (type == NULL) return CUDA_ERROR_INVALID_VALUE;
    *type = op->type;
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
    struct op *op = check_node(node, "cuGraphMemAllocNodeGetParams");
    if (params == NULL || op->type != NODE_MEM_ALLOC) return CUDA_ERROR_INVALID_VALUE;
    *params = (struct mem_alloc_node_params){0};
    params->poolProps.allocType = 1;     /* CU_MEM_ALLOCATION_TYPE_PINNED */
    params->poolProps.location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
    params->bytesize = op->bytes;
    params->dptr = op->dev;
    return CUDA_SUCCESS;
}
