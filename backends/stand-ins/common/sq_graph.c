/*
 * sq_graph.c: the stream capture and graph imitation of the CUDA and HIP
 * stand-ins. Compiled as part of the graph section of the vendor's
 * stand-in file, which includes it (see sq_graph.h); every entry takes the
 * vendor's table.
 *
 * Rules, each from CUDA's driver API documentation (stream capture, graph
 * management) and HIP's reference for the same calls, which describe them
 * alike:
 *
 * - Begin capture puts a stream in capture mode: work issued to it is
 *   recorded into a graph instead of executed. A stream already capturing
 *   cannot begin again (the illegal-state code).
 * - Each capture has a process-unique id (get capture info) and a mode,
 *   which (HIP's header) "controls the interaction of this capture sequence
 *   with other API calls that are not safe": while a capture is ongoing,
 *   "potentially unsafe API calls" (CUDA's example: cudaMalloc, which
 *   changes memory outside any stream and so is not observed by capture)
 *   are prohibited on a thread that has a non-relaxed capture of its own
 *   (global, thread-local), or on any thread while another thread has a
 *   global capture. A prohibited call returns the capture-unsupported code
 *   (HIP: "the operation is not permitted when the stream is capturing")
 *   and invalidates the capture. Which calls the stand-in counts as
 *   potentially unsafe is the vendor's (its graph section lists them).
 * - Calls that necessarily conflict with capture are refused in every
 *   mode: synchronizing or querying a capturing stream returns the
 *   capture-unsupported code and invalidates its capture.
 * - End capture returns the graph, or, for an invalidated capture, the
 *   capture-invalidated code (HIP: "the current capture sequence on the
 *   stream has been invalidated due to a previous error") and a NULL graph;
 *   either way the stream leaves capture mode. A capture not begun relaxed
 *   must end on the thread that began it (else the wrong-thread code, and
 *   the capture goes on).
 * - Instantiating makes an executable graph that stays valid after its
 *   graph is destroyed; a launch queues the recorded work on a stream. The
 *   work is checked as it would be when issued directly (the vendor's
 *   replay hook), so a launch whose copies touch freed memory, or reserved
 *   memory that is not mapped, is a contract violation (the device would
 *   fault).
 * - Contract violations (stricter than the documentation, which leaves
 *   them undefined): destroying a graph or an executable graph twice; with
 *   the vendor's exit check (graphs_checked_at_exit), graphs or executable
 *   graphs never destroyed at exit.
 * - Memory nodes (CUDA; HIP's stand-in refuses stream-ordered allocation on
 *   a capturing stream): a stream-ordered allocation on a capturing stream
 *   records a memory allocation node and returns its address at once; a
 *   stream-ordered free there records a memory free node. CUDA's
 *   documentation fixes a graph allocation's address for the graph's life
 *   and keeps its memory for the graph while it may launch; the stand-in
 *   allocates it when the node is recorded and frees it when the graph and
 *   every executable graph made from it are destroyed.
 * - Fault knob (the vendor's FAIL_ENTRY=<entry point>:<N>): the Nth begin
 *   capture fails with the invalid-value code (of the codes both
 *   references list, the one a valid call can meet) and begins nothing;
 *   the Nth end capture ends the capture as an invalidated one (the
 *   capture-invalidated code, no graph, the stream out of capture mode).
 *
 * Not imitated (a contract violation naming the call): launching a graph
 * into a capture; the vendor's graph section lists what else it refuses.
 */
#define _GNU_SOURCE
#include "sq_graph.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SQ_GRAPH_MAGIC 0x47525048u /* "GRPH" */
#define SQ_GRAPH_EXEC_MAGIC 0x47455845u /* "GEXE" */
#define SQ_GRAPH_NODE_MAGIC 0x4e4f4445u /* "NODE" */

/* The memory of an allocation node, shared by the graph and the executable
 * graphs made from it; freed when the last of them is destroyed. */
struct sq_graph_gmem {
    struct sq_mem *mem;
    uint64_t ptr;
    size_t bytes;
    int refs;
};

struct sq_graph_ops {
    struct sq_graph_op *v;
    size_t n, cap;
};

/* Headers stay allocated after destruction so that a second destroy is
 * recognised; their operations are freed. */
struct sq_graph {
    unsigned magic;
    int destroyed;
    struct sq_graph_ops ops;
};

struct sq_graph_exec {
    unsigned magic;
    int destroyed;
    struct sq_graph_ops ops;
};

struct sq_graph_capture {
    const void *stream;
    uint64_t id;
    int mode;
    pthread_t thread;
    int invalidated;
    struct sq_graph *graph;
    struct sq_graph_capture *next;
};

static pthread_mutex_t g_graph_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sq_graph_capture *g_captures; /* ongoing, under g_graph_lock */
static uint64_t g_next_id = 1;
/* Counters for the tests and the exit check. */
static uint64_t g_begun, g_invalidated, g_allocs_during, g_launches;
static uint64_t g_alloc_nodes, g_free_nodes, g_gmem_live;
static uint64_t g_live_graphs, g_live_execs;
static int g_exit_check_set;
/* The vendor whose exit check is armed (one per library). */
static const struct sq_graph_vendor *g_graph_exit_vendor;

static void sq_graph_exit_check(void) {
    if (g_graph_exit_vendor->sticky()) return;
    pthread_mutex_lock(&g_graph_lock);
    uint64_t graphs = g_live_graphs, execs = g_live_execs;
    pthread_mutex_unlock(&g_graph_lock);
    if (graphs != 0 || execs != 0)
        sq_die("at exit: %llu graph(s) and %llu executable graph(s) never destroyed "
               "(%s, %s)",
               (unsigned long long)graphs, (unsigned long long)execs,
               g_graph_exit_vendor->graph_destroy, g_graph_exit_vendor->exec_destroy);
}

/* Under g_graph_lock. */
static void sq_graph_arm_exit_check(const struct sq_graph_vendor *v) {
    if (g_exit_check_set || !v->graphs_checked_at_exit) return;
    g_exit_check_set = 1;
    char var[96];
    snprintf(var, sizeof var, "%s_EXIT_CHECK", v->prefix);
    if (sq_env_u64(var, 0) != 0) {
        g_graph_exit_vendor = v;
        atexit(sq_graph_exit_check);
    }
}

static int sq_graph_entry_fault(const struct sq_graph_vendor *v, const char *fn) {
    return v->entry_fault != NULL && v->entry_fault(fn);
}

/* Under g_graph_lock. */
static struct sq_graph_capture *sq_graph_find(const void *stream) {
    for (struct sq_graph_capture *c = g_captures; c != NULL; c = c->next)
        if (c->stream == stream) return c;
    return NULL;
}

static void sq_graph_push(struct sq_graph_ops *ops, struct sq_graph_op op) {
    if (ops->n == ops->cap) {
        ops->cap = ops->cap ? ops->cap * 2 : 8;
        ops->v = realloc(ops->v, ops->cap * sizeof *ops->v);
        if (ops->v == NULL) sq_fatal("out of host memory");
    }
    op.magic = SQ_GRAPH_NODE_MAGIC;
    ops->v[ops->n++] = op;
}

/* Under g_graph_lock. */
static void sq_graph_invalidate(struct sq_graph_capture *c) {
    if (!c->invalidated) g_invalidated++;
    c->invalidated = 1;
}

/* Under g_graph_lock: one holder of `m` less; the memory goes with the last. */
static void sq_graph_gmem_drop(const struct sq_graph_vendor *v, struct sq_graph_gmem *m) {
    if (--m->refs > 0) return;
    enum sq_mem_check c = sq_mem_free_now(m->mem, m->ptr, v->graph_destroy);
    if (c != SQ_MEM_OK)
        sq_die("graph memory at 0x%llx: %s", (unsigned long long)m->ptr, sq_mem_check_str(c));
    g_gmem_live -= m->bytes;
    free(m);
}

/* Under g_graph_lock: the operations of a destroyed graph or executable graph. */
static void sq_graph_ops_drop(const struct sq_graph_vendor *v, struct sq_graph_ops *ops) {
    for (size_t i = 0; i < ops->n; i++)
        if (ops->v[i].type == SQ_GRAPH_NODE_MEM_ALLOC) sq_graph_gmem_drop(v, ops->v[i].gmem);
    free(ops->v);
    *ops = (struct sq_graph_ops){0};
}

/* Counters: {captures begun, captures invalidated, driver allocations made
 * while a capture was under way, graph launches}. */
static int sq_graph_counters(unsigned long long out[4]) {
    if (out == NULL) return 1;
    pthread_mutex_lock(&g_graph_lock);
    out[0] = g_begun;
    out[1] = g_invalidated;
    out[2] = g_allocs_during;
    out[3] = g_launches;
    pthread_mutex_unlock(&g_graph_lock);
    return 0;
}

/* ---- hooks the vendor's other files call ----------------------------------- */

/* Whether `stream` is in a capture sequence (active or invalidated). */
static int sq_graph_capturing(const void *stream) {
    pthread_mutex_lock(&g_graph_lock);
    int r = g_captures != NULL && sq_graph_find(stream) != NULL;
    pthread_mutex_unlock(&g_graph_lock);
    return r;
}

/* Records `op` (a copy or host function issued by entry point `fn`) into
 * the capture of `stream` instead of queueing it. */
static int sq_graph_record(const struct sq_graph_vendor *v, const char *fn, const void *stream,
                           struct sq_graph_op op) {
    pthread_mutex_lock(&g_graph_lock);
    struct sq_graph_capture *c = sq_graph_find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    if (!c->invalidated) sq_graph_push(&c->graph->ops, op);
    int r = c->invalidated ? v->capture_invalidated : v->success;
    pthread_mutex_unlock(&g_graph_lock);
    return r;
}

/* `fn` on a capturing stream necessarily conflicts with capture: the
 * capture is invalidated and the call returns the capture-unsupported
 * code. */
static int sq_graph_conflicting(const struct sq_graph_vendor *v, const void *stream) {
    pthread_mutex_lock(&g_graph_lock);
    struct sq_graph_capture *c = sq_graph_find(stream);
    if (c != NULL) sq_graph_invalidate(c);
    pthread_mutex_unlock(&g_graph_lock);
    return v->capture_unsupported;
}

/* A potentially unsafe call is about to run on the calling thread. Returns
 * 0 when the capture modes allow it, else invalidates the captures that
 * prohibit it and returns the capture-unsupported code. `alloc` counts it
 * as an allocation made while a capture was under way. */
static int sq_graph_unsafe(const struct sq_graph_vendor *v, int alloc) {
    pthread_mutex_lock(&g_graph_lock);
    if (g_captures == NULL) {
        pthread_mutex_unlock(&g_graph_lock);
        return 0;
    }
    if (alloc) g_allocs_during++;
    pthread_t me = pthread_self();
    int prohibited = 0;
    for (struct sq_graph_capture *c = g_captures; c != NULL; c = c->next) {
        int mine = pthread_equal(c->thread, me);
        if ((mine && c->mode != v->mode_relaxed) || (!mine && c->mode == v->mode_global)) {
            sq_graph_invalidate(c);
            prohibited = 1;
        }
    }
    pthread_mutex_unlock(&g_graph_lock);
    return prohibited ? v->capture_unsupported : 0;
}

/* Memory nodes (CUDA only, unused in HIP's stand-in). A stream-ordered
 * allocation of `bytes` on capturing `stream`: records a memory allocation
 * node whose memory (allocated now from `mem`, held until the graph and its
 * executable graphs are destroyed) is returned in `dptr`. */
__attribute__((unused)) static int sq_graph_record_alloc(const struct sq_graph_vendor *v,
                                                         const char *fn, const void *stream,
                                                         struct sq_mem *mem, size_t bytes,
                                                         unsigned long long *dptr) {
    pthread_mutex_lock(&g_graph_lock);
    struct sq_graph_capture *c = sq_graph_find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    if (c->invalidated) {
        pthread_mutex_unlock(&g_graph_lock);
        return v->capture_invalidated;
    }
    uint64_t p = sq_mem_alloc_tracked(mem, bytes);
    if (p == 0) {
        pthread_mutex_unlock(&g_graph_lock);
        return v->out_of_memory;
    }
    struct sq_graph_gmem *m = malloc(sizeof *m);
    if (m == NULL) sq_fatal("out of host memory");
    *m = (struct sq_graph_gmem){.mem = mem, .ptr = p, .bytes = bytes, .refs = 1};
    sq_graph_push(&c->graph->ops, (struct sq_graph_op){.type = SQ_GRAPH_NODE_MEM_ALLOC,
                                                       .gmem = m, .dev = p, .bytes = bytes});
    g_alloc_nodes++;
    g_gmem_live += bytes;
    *dptr = p;
    pthread_mutex_unlock(&g_graph_lock);
    return v->success;
}

/* A stream-ordered free of `dptr` on capturing `stream`: records a memory
 * free node (CUDA only). */
__attribute__((unused)) static int sq_graph_record_free(const struct sq_graph_vendor *v,
                                                        const char *fn, const void *stream,
                                                        uint64_t dptr) {
    pthread_mutex_lock(&g_graph_lock);
    struct sq_graph_capture *c = sq_graph_find(stream);
    if (c == NULL) sq_die("%s: stream %p is not capturing", fn, stream);
    int r = c->invalidated ? v->capture_invalidated : v->success;
    if (!c->invalidated) {
        sq_graph_push(&c->graph->ops,
                      (struct sq_graph_op){.type = SQ_GRAPH_NODE_MEM_FREE, .dev = dptr});
        g_free_nodes++;
    }
    pthread_mutex_unlock(&g_graph_lock);
    return r;
}

/* A stream-ordered allocation on a stream that is not capturing; counted
 * when a capture is under way elsewhere (CUDA only). */
__attribute__((unused)) static void sq_graph_note_alloc(void) {
    pthread_mutex_lock(&g_graph_lock);
    if (g_captures != NULL) g_allocs_during++;
    pthread_mutex_unlock(&g_graph_lock);
}

/* Graph memory: {allocation nodes recorded, free nodes recorded, bytes of
 * allocation nodes still held by a graph} (CUDA only). */
__attribute__((unused)) static int sq_graph_mem_counters(unsigned long long out[3]) {
    if (out == NULL) return 1;
    pthread_mutex_lock(&g_graph_lock);
    out[0] = g_alloc_nodes;
    out[1] = g_free_nodes;
    out[2] = g_gmem_live;
    pthread_mutex_unlock(&g_graph_lock);
    return 0;
}

/* ---- capture: the entry points' bodies, after the vendor checked the
 * stream ---------------------------------------------------------------------- */

static int sq_graph_begin(const struct sq_graph_vendor *v, const void *stream, int mode) {
    if (mode != v->mode_global && mode != v->mode_thread_local && mode != v->mode_relaxed)
        return v->invalid_value;
    struct sq_graph_capture *c = calloc(1, sizeof *c);
    struct sq_graph *g = calloc(1, sizeof *g);
    if (c == NULL || g == NULL) sq_fatal("out of host memory");
    g->magic = SQ_GRAPH_MAGIC;
    pthread_mutex_lock(&g_graph_lock);
    sq_graph_arm_exit_check(v);
    if (sq_graph_entry_fault(v, v->begin_capture)) {
        pthread_mutex_unlock(&g_graph_lock);
        free(c);
        free(g);
        return v->invalid_value; /* the references list no other failure */
    }
    if (sq_graph_find(stream) != NULL) {
        pthread_mutex_unlock(&g_graph_lock);
        free(c);
        free(g);
        return v->illegal_state;
    }
    *c = (struct sq_graph_capture){.stream = stream, .id = g_next_id++, .mode = mode,
                                   .thread = pthread_self(), .graph = g, .next = g_captures};
    g_captures = c;
    g_begun++;
    pthread_mutex_unlock(&g_graph_lock);
    return v->success;
}

static int sq_graph_end(const struct sq_graph_vendor *v, const void *stream,
                        struct sq_graph **graph) {
    if (graph == NULL) return v->invalid_value;
    pthread_mutex_lock(&g_graph_lock);
    struct sq_graph_capture **p = &g_captures;
    while (*p != NULL && (*p)->stream != stream) p = &(*p)->next;
    struct sq_graph_capture *c = *p;
    if (c == NULL) {
        pthread_mutex_unlock(&g_graph_lock);
        return v->illegal_state;
    }
    if (c->mode != v->mode_relaxed && !pthread_equal(c->thread, pthread_self())) {
        pthread_mutex_unlock(&g_graph_lock);
        return v->capture_wrong_thread;
    }
    *p = c->next;
    if (sq_graph_entry_fault(v, v->end_capture)) sq_graph_invalidate(c);
    int r = v->success;
    if (c->invalidated) {
        sq_graph_ops_drop(v, &c->graph->ops);
        free(c->graph);
        *graph = NULL;
        r = v->capture_invalidated;
    } else {
        *graph = c->graph;
        g_live_graphs++;
    }
    pthread_mutex_unlock(&g_graph_lock);
    free(c);
    return r;
}

/* The capture status of `stream` (is capturing, get capture info); its id
 * and graph are written (where asked) only while the capture is active. */
static int sq_graph_status(const struct sq_graph_vendor *v, const void *stream, uint64_t *id,
                           struct sq_graph **graph) {
    pthread_mutex_lock(&g_graph_lock);
    struct sq_graph_capture *c = sq_graph_find(stream);
    int status = c == NULL ? v->status_none : c->invalidated ? v->status_invalidated
                                                             : v->status_active;
    if (c != NULL && !c->invalidated) {
        if (id != NULL) *id = c->id;
        if (graph != NULL) *graph = c->graph;
    }
    pthread_mutex_unlock(&g_graph_lock);
    return status;
}

/* ---- graphs ------------------------------------------------------------------ */

static void sq_graph_check(struct sq_graph *g, const char *fn) {
    if (g == NULL || g->magic != SQ_GRAPH_MAGIC) sq_die("%s: %p is not a graph", fn, (void *)g);
    if (g->destroyed) sq_die("%s on destroyed graph %p", fn, (void *)g);
}

static void sq_graph_check_exec(struct sq_graph_exec *e, const char *fn) {
    if (e == NULL || e->magic != SQ_GRAPH_EXEC_MAGIC)
        sq_die("%s: %p is not an executable graph", fn, (void *)e);
    if (e->destroyed) sq_die("%s on destroyed executable graph %p", fn, (void *)e);
}

/* Instantiate (after sq_graph_check): `args_valid` is the vendor's own
 * argument checks (CUDA: flags 0). */
static int sq_graph_instantiate(const struct sq_graph_vendor *v, struct sq_graph_exec **out,
                                struct sq_graph *g, int args_valid) {
    if (out == NULL || !args_valid) return v->invalid_value;
    struct sq_graph_exec *e = calloc(1, sizeof *e);
    if (e == NULL) sq_fatal("out of host memory");
    e->magic = SQ_GRAPH_EXEC_MAGIC;
    pthread_mutex_lock(&g_graph_lock);
    for (size_t i = 0; i < g->ops.n; i++) {
        sq_graph_push(&e->ops, g->ops.v[i]);
        if (g->ops.v[i].type == SQ_GRAPH_NODE_MEM_ALLOC) g->ops.v[i].gmem->refs++;
    }
    g_live_execs++;
    pthread_mutex_unlock(&g_graph_lock);
    *out = e;
    return v->success;
}

/* Launch (after sq_graph_check_exec and the vendor's stream check). */
static int sq_graph_launch(const struct sq_graph_vendor *v, struct sq_graph_exec *e,
                           const void *stream) {
    if (sq_graph_capturing(stream))
        sq_die("%s into a capturing stream (a child graph node) is not imitated by "
               "the stand-in %s",
               v->launch, v->lib);
    pthread_mutex_lock(&g_graph_lock);
    g_launches++;
    pthread_mutex_unlock(&g_graph_lock);
    for (size_t i = 0; i < e->ops.n; i++) {
        const struct sq_graph_op *op = &e->ops.v[i];
        /* Graph memory stays allocated for the graph: nothing to queue. */
        if (op->type == SQ_GRAPH_NODE_MEM_ALLOC || op->type == SQ_GRAPH_NODE_MEM_FREE) continue;
        int r = v->replay(stream, op);
        if (r != v->success) return r;
    }
    return v->success;
}

static int sq_graph_exec_destroy(const struct sq_graph_vendor *v, struct sq_graph_exec *e) {
    sq_graph_check_exec(e, v->exec_destroy);
    /* Launches already queued hold copies of what they need. */
    e->destroyed = 1;
    pthread_mutex_lock(&g_graph_lock);
    sq_graph_ops_drop(v, &e->ops);
    g_live_execs--;
    pthread_mutex_unlock(&g_graph_lock);
    return v->success;
}

static int sq_graph_destroy(const struct sq_graph_vendor *v, struct sq_graph *g) {
    sq_graph_check(g, v->graph_destroy);
    g->destroyed = 1;
    pthread_mutex_lock(&g_graph_lock);
    sq_graph_ops_drop(v, &g->ops);
    g_live_graphs--;
    pthread_mutex_unlock(&g_graph_lock);
    return v->success;
}

/* The hooks the vendor's other sections call, over the table the
 * vendor's graph section names SQ_GRAPH_TABLE before including this file. */
int graph_capturing(const void *stream) { return sq_graph_capturing(stream); }

int graph_conflicting(const char *fn, const void *stream) {
    (void)fn;
    return sq_graph_conflicting(&SQ_GRAPH_TABLE, stream);
}

int graph_unsafe(const char *fn, int alloc) {
    (void)fn;
    return sq_graph_unsafe(&SQ_GRAPH_TABLE, alloc);
}
