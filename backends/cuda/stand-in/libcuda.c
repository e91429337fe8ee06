/*
 * libcuda.c: a stand-in for the CUDA driver API (libcuda.so.1), enough of it
 * for memgov's CUDA backend, imitating the driver's rules on host threads.
 *
 * - Memory is host memory; a CUdeviceptr is the host address.
 * - Each stream is an ordered queue (common/standin.h) run on its own host
 *   thread: copies, frees and host functions run in stream order, each after
 *   MEMGOV_STANDIN_CUDA_LATENCY_US microseconds.
 * - Each thread has a context stack whose top is its current context
 *   (cuCtxSetCurrent, cuCtxPushCurrent, cuCtxPopCurrent, cuCtxGetCurrent); a
 *   call that needs one fails with CUDA_ERROR_INVALID_CONTEXT without it.
 * - Stream ordering, events and allocations' latest use come from
 *   common/standin.h: a copy or free on a stream not ordered after the
 *   allocation's latest use (cuEventRecord + cuStreamWaitEvent, or a host
 *   synchronization) is a contract violation.
 * - Memory comes from the default pool or pools made with cuMemPoolCreate;
 *   the default pool's release threshold must be as the process found it.
 * - Page-locked host memory (cuMemHostAlloc, cuMemHostGetDevicePointer_v2,
 *   cuMemFreeHost) is a table of its own per context, outside the device's
 *   memory and its OOM knob; its device pointer is its host address (UVA).
 *   Copies through it are checked and ordered like device memory. As the
 *   CUDA documentation requires, cuMemFreeHost (synchronous) while a queued
 *   copy that uses the memory has not completed is a contract violation,
 *   and the memory goes with its context.
 * - The primary context's last release destroys it with its streams, as the
 *   driver does; no thread may still have it current, and on a device not in
 *   the sticky error state none of its allocations may still be live
 *   (stricter than the driver, see destroy_context; on a sticky device they
 *   go with it, counted by memgov_standin_cuda_reclaimed).
 * - Contract violations abort with "memgov libcuda stand-in: contract
 *   violation: ...": a call on a destroyed context, stream, event or pool, a
 *   free or copy of an unknown or freed pointer, a copy out of bounds, a
 *   copy or free missing stream ordering, a page-locked host free while a
 *   copy using it is still queued, the primary context released (last
 *   reference) while work is pending, while a thread has it current, with
 *   the default pool changed, or (on a device not in the sticky state) with
 *   allocations still live, any primary context reference released (on a
 *   device not in the sticky state) while a created pool that was destroyed
 *   still has allocations outstanding, any driver call from inside a host
 *   function; with MEMGOV_STANDIN_CUDA_EXIT_CHECK=1, anything left at exit.
 * - Knobs (see the README): MEMGOV_STANDIN_CUDA_LATENCY_US, _OOM_AFTER_BYTES,
 *   _STICKY_ERROR_AT_OP (driver call N and all later fail with
 *   CUDA_ERROR_ILLEGAL_ADDRESS; queued work stops executing),
 *   _STICKY_ERROR_AT_EXEC (the Nth queued free or host function to execute
 *   faults instead: an asynchronous error), _FAIL_HOST_FUNC_AT (the Nth
 *   cuLaunchHostFunc fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES),
 *   _TOTAL_BYTES (device size, default 16 GiB), _DEVICES (device count,
 *   default 1), _EXIT_CHECK.
 * - It says what it is: the device name starts with "memgov stand-in" (the
 *   backend reads it), and memgov_standin_cuda() returns a description.
 * - Every other entry point cudarc's loader requires is a stub (the last
 *   section) that aborts naming itself.
 *
 * This one file is the whole stand-in: the exported entry points, which
 * decode CUDA's arguments and structs and call the imitations in
 * common/ (standin.c, linked in; sq_vmm.c and sq_graph.c, compiled here by
 * the #include in their sections) through tables of CUDA's names and codes.
 * Sections: contexts, streams, memory, host memory, host functions and
 * events (the driver's rules on host threads); virtual memory management
 * (the CUDA_VMM table); stream capture and graphs (the CUDA_GRAPH table);
 * the unimitated entry points.
 *
 * Built with -DMEMGOV_STANDIN_CUDA_PARTIAL (the CI's imitation of a
 * pre-12.0 driver, scripts/ci/40-cuda.sh), the last three sections are
 * left out: the library then lacks the virtual memory, capture and graph
 * entry points and every unimitated one, and the rest of the file reaches
 * their hooks through weak references that are NULL there.
 */
#define _GNU_SOURCE
#include "standin.h"
#include "sq_graph.h"
#include "sq_vmm.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *userData);
typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef unsigned long long CUmemGenericAllocationHandle;
/* The graph handles are opaque in CUDA's header; the stand-in's are
 * sq_graph.c's. */
typedef struct sq_graph *CUgraph;
typedef struct sq_graph_exec *CUgraphExec;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    CUDA_ERROR_UNKNOWN = 999,
};

#define CU_EVENT_DISABLE_TIMING 2u
#define CU_EVENT_VALID_FLAGS 3u /* default, blocking sync, disable timing */
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1

#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED 115
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_STREAM_NON_BLOCKING 1u

/* ---- hooks of the virtual memory and graph sections --------------------------
 *
 * Defined by the last sections of this file (graph_conflicting and
 * graph_unsafe by sq_graph.c there). Weak, so that the partial build
 * (MEMGOV_STANDIN_CUDA_PARTIAL), which leaves those sections out, still
 * links: the callers test them for NULL first. Internal to the library. */
#pragma GCC visibility push(hidden)
/* Whether `stream` is in a capture sequence (active or invalidated). */
int graph_capturing(const void *stream) __attribute__((weak));
/* Record a copy into the capture of `stream` instead of queueing it (the
 * arguments as copy_async takes them). Returns the call's result. */
int graph_record_copy(const char *fn, const void *stream, uint64_t dev, void *dst,
                      const void *src, size_t bytes) __attribute__((weak));
/* Record a host function into the capture of `stream`. */
int graph_record_host_fn(const void *stream, void (*fn)(void *), void *user)
    __attribute__((weak));
/* `fn` on a capturing stream necessarily conflicts with capture
 * (cuStreamSynchronize, cuStreamQuery): the capture is invalidated and the
 * call returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. */
int graph_conflicting(const char *fn, const void *stream) __attribute__((weak));
/* A potentially unsafe call (one that changes memory outside any stream,
 * as cudaMalloc in the driver's documentation) is about to run on the
 * calling thread. Returns 0 when the capture modes allow it, else
 * invalidates the captures that prohibit it and returns
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. `alloc` counts it as a driver
 * allocation made while a capture was under way. */
int graph_unsafe(const char *fn, int alloc) __attribute__((weak));
/* A stream-ordered allocation of `bytes` on capturing `stream`: records a
 * memory allocation node whose memory (allocated now from `mem`, held until
 * the graph and its executable graphs are destroyed) is returned in
 * `dptr`. Returns the call's result. */
int graph_record_alloc(const char *fn, const void *stream, struct sq_mem *mem, size_t bytes,
                       unsigned long long *dptr) __attribute__((weak));
/* A stream-ordered free of `dptr` on capturing `stream`: records a memory
 * free node. */
int graph_record_free(const char *fn, const void *stream, uint64_t dptr) __attribute__((weak));
/* A stream-ordered allocation on a stream that is not capturing; counted
 * when a capture is under way elsewhere. */
void graph_note_alloc(void) __attribute__((weak));
/* A copy touching device memory at [addr, addr + bytes), about to be
 * queued on q (dst and src are host addresses, one of them that range).
 * Returns 0 when addr is not inside a virtual address reservation
 * (cuMemAddressReserve): the caller checks and queues it as usual. Else the
 * range is checked as a device access by `fn` (every byte mapped with
 * read-write access set, else a contract violation), the copy is queued,
 * and the mappings it touches remember that q's work up to it uses them
 * (cuMemUnmap's check); all under the table's lock, so no unmap comes in
 * between. Returns 1. */
int vmm_copy(const char *fn, uint64_t addr, size_t bytes, struct sq_queue *q, void *dst,
             const void *src) __attribute__((weak));
/* Whether this call of entry point `fn` is the one the
 * MEMGOV_STANDIN_CUDA_FAIL_ENTRY knob says fails (counted per process). */
int standin_entry_fault(const char *fn) __attribute__((weak));
/* Physical memory of live allocation handles (cuMemCreate), bytes. */
uint64_t vmm_physical_bytes(void) __attribute__((weak));
#pragma GCC visibility pop

#define CTX_MAGIC 0x43545843u    /* "CTXC" */
#define STREAM_MAGIC 0x5354524du /* "STRM" */
#define POOL_MAGIC 0x504f4f4cu   /* "POOL" */

struct CUctx_st;

struct CUstream_st {
    unsigned magic;
    int destroyed;
    struct CUctx_st *ctx;
    struct sq_queue *q;
    struct CUstream_st *next; /* in ctx->streams */
};

struct CUmemPoolHandle_st {
    unsigned magic;
    CUdevice device;
    uint64_t release_threshold;
    int is_default;
    int destroyed;                     /* created pools only */
    struct CUmemPoolHandle_st *next;   /* in g_pools (created pools) */
    /* Created pools: allocations from it not yet freed (a free counts once
     * it has executed), under g_pool_allocs_lock. */
    uint64_t live_count, live_bytes;
};

/* cuMemPoolCreate's properties, as laid out by the CUDA 12.0 headers. */
struct CUmemPoolProps_st {
    int allocType;
    int handleTypes;
    struct {
        int type;
        int id;
    } location;
    void *win32SecurityAttributes;
    unsigned char reserved[64];
};

struct CUctx_st {
    unsigned magic;
    int destroyed;
    CUdevice device;
    struct sq_mem *mem;
    /* Page-locked host allocations (cuMemHostAlloc): not device memory. */
    struct sq_mem *host_mem;
    pthread_mutex_t lock; /* guards streams and draining */
    struct CUstream_st *streams;
    /* Destroyed streams whose queued work may still be running: like the
     * driver, cuStreamDestroy returns at once. Joined at context release. */
    struct CUstream_st *draining;
    /* cuCtxSynchronize calls waiting on queues they snapshotted: while
     * non-zero, drained streams are not reaped (their queues stay valid). */
    int syncing;
};

typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct sq_event *CUevent;

#define MAX_DEVICES 8

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static struct sq_knobs g_knobs;
static uint64_t g_fail_host_func_at;
/* MEMGOV_STANDIN_CUDA_STICKY_ERROR_AT_EXEC: the Nth queued free or host
 * function to execute faults instead (an asynchronous error, after the
 * driver call that queued it returned): the device enters the sticky error
 * state from then on. */
static uint64_t g_sticky_at_exec;
static uint64_t g_execs;
static int g_exec_sticky;

/* Whether the device is in the sticky error state (either knob). */
static int sticky_now(void) {
    return sq_knobs_sticky() || __atomic_load_n(&g_exec_sticky, __ATOMIC_ACQUIRE);
}

/* A queued free or host function is about to execute: count it for the
 * execution fault knob. Returns whether the device is now sticky (the
 * operation then does nothing, as queued work does not run after a fault). */
static int exec_tick(void) {
    if (g_sticky_at_exec != 0 &&
        __atomic_add_fetch(&g_execs, 1, __ATOMIC_ACQ_REL) >= g_sticky_at_exec)
        __atomic_store_n(&g_exec_sticky, 1, __ATOMIC_RELEASE);
    return sticky_now();
}
static uint64_t g_host_func_calls;
static uint64_t g_total_bytes = 16ull << 30;
static int g_devices = 1;
static struct {
    CUcontext primary; /* NULL when not retained */
    int refs;
    struct CUmemPoolHandle_st pool;
    /* The default pool's release threshold when the process first found it
     * (the primary context created from no references). */
    uint64_t pool_found_threshold;
    /* What destroyed primary contexts of the device took with them, summed:
     * {device allocations, device bytes, page-locked host allocations, host
     * bytes}. Nonzero only after a last release on a device in the sticky
     * error state (anywhere else live allocations at the last release are a
     * contract violation). Under g_lock. */
    uint64_t reclaimed[4];
} g_dev[MAX_DEVICES];
static struct CUmemPoolHandle_st *g_pools; /* created pools, under g_lock */

/* Which created pool each allocation came from, so that what a pool still
 * has outstanding is known when a reference to the primary context goes
 * (see cuDevicePrimaryCtxRelease_v2). Chained by base address. */
#define POOL_ALLOC_BUCKETS 4096
struct pool_alloc {
    uint64_t base, bytes;
    CUmemoryPool pool;
    struct pool_alloc *next;
};
static struct pool_alloc *g_pool_allocs[POOL_ALLOC_BUCKETS];
static pthread_mutex_t g_pool_allocs_lock = PTHREAD_MUTEX_INITIALIZER;

static struct pool_alloc **pool_alloc_bucket(uint64_t base) {
    return &g_pool_allocs[(base >> 4) % POOL_ALLOC_BUCKETS];
}

static void pool_alloc_track(CUmemoryPool pool, uint64_t base, uint64_t bytes) {
    struct pool_alloc *a = malloc(sizeof *a);
    if (a == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_pool_allocs_lock);
    *a = (struct pool_alloc){.base = base, .bytes = bytes, .pool = pool, .next = *pool_alloc_bucket(base)};
    *pool_alloc_bucket(base) = a;
    pool->live_count++;
    pool->live_bytes += bytes;
    pthread_mutex_unlock(&g_pool_allocs_lock);
}

/* The allocation at `base` was freed (its free executed): no longer the
 * pool's. Allocations of the default pool are not tracked. */
static void pool_alloc_untrack(uint64_t base) {
    pthread_mutex_lock(&g_pool_allocs_lock);
    for (struct pool_alloc **a = pool_alloc_bucket(base); *a != NULL; a = &(*a)->next) {
        if ((*a)->base == base) {
            struct pool_alloc *gone = *a;
            *a = gone->next;
            gone->pool->live_count--;
            gone->pool->live_bytes -= gone->bytes;
            free(gone);
            break;
        }
    }
    pthread_mutex_unlock(&g_pool_allocs_lock);
}

/* The primary context of `dev` is destroyed: its pools' allocations went
 * with it. */
static void pool_allocs_forget_device(CUdevice dev) {
    pthread_mutex_lock(&g_pool_allocs_lock);
    for (int b = 0; b < POOL_ALLOC_BUCKETS; b++) {
        for (struct pool_alloc **a = &g_pool_allocs[b]; *a != NULL;) {
            if ((*a)->pool->device == dev) {
                struct pool_alloc *gone = *a;
                *a = gone->next;
                gone->pool->live_count--;
                gone->pool->live_bytes -= gone->bytes;
                free(gone);
            } else {
                a = &(*a)->next;
            }
        }
    }
    pthread_mutex_unlock(&g_pool_allocs_lock);
}


/* ---- per-thread current context and context stack ------------------------
 *
 * Each thread's current context is the top of its context stack
 * (cuCtxSetCurrent replaces the top, cuCtxPushCurrent / cuCtxPopCurrent push
 * and pop). The slots of all threads are registered so that the last release
 * of a primary context can check that no thread still has it current or
 * stacked: the driver leaves a destroyed context current on other threads
 * (their next call fails with CUDA_ERROR_CONTEXT_IS_DESTROYED), which is what
 * a library that changes the caller's current context without restoring it
 * does to its caller. */

#define STACK_MAX 32

struct thread_slot {
    CUcontext current;
    CUcontext stack[STACK_MAX]; /* contexts below the current one */
    int depth;
    struct thread_slot *prev, *next;
};

static pthread_mutex_t g_slots_lock = PTHREAD_MUTEX_INITIALIZER;
static struct thread_slot *g_slots;
static pthread_key_t g_slot_key;
static pthread_once_t g_slot_once = PTHREAD_ONCE_INIT;
static __thread struct thread_slot *t_slot;

static void slot_gone(void *p) {
    struct thread_slot *t = p;
    pthread_mutex_lock(&g_slots_lock);
    if (t->prev) t->prev->next = t->next;
    else g_slots = t->next;
    if (t->next) t->next->prev = t->prev;
    pthread_mutex_unlock(&g_slots_lock);
    free(t);
}

static void slot_key_init(void) {
    if (pthread_key_create(&g_slot_key, slot_gone) != 0) sq_fatal("pthread_key_create");
}

/* The calling thread's slot, registered on first use. */
static struct thread_slot *slot(void) {
    if (t_slot != NULL) return t_slot;
    pthread_once(&g_slot_once, slot_key_init);
    struct thread_slot *t = calloc(1, sizeof *t);
    if (t == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_slots_lock);
    t->next = g_slots;
    if (g_slots) g_slots->prev = t;
    g_slots = t;
    pthread_mutex_unlock(&g_slots_lock);
    pthread_setspecific(g_slot_key, t);
    t_slot = t;
    return t;
}

static CUcontext thread_current(void) { return t_slot ? t_slot->current : NULL; }

/* Threads that have c current or on their stack, and whether the calling
 * thread is one of them. */
static int threads_holding(CUcontext c, int *caller) {
    int n = 0;
    *caller = 0;
    pthread_mutex_lock(&g_slots_lock);
    for (struct thread_slot *t = g_slots; t != NULL; t = t->next) {
        int holds = t->current == c;
        for (int i = 0; i < t->depth && !holds; i++) holds = t->stack[i] == c;
        if (holds) {
            n++;
            if (t == t_slot) *caller = 1;
        }
    }
    pthread_mutex_unlock(&g_slots_lock);
    return n;
}

static const char g_description[] =
    "memgov libcuda stand-in: CUDA driver API imitated on host threads (not a GPU)";

/* Exported marker, for tools that want to know without opening a device. */
const char *memgov_standin_cuda(void) { return g_description; }

/* For tests acting as a runtime that shares the primary context: what the
 * primary context of `dev` holds now, as {device allocations, device bytes,
 * page-locked host allocations, host bytes}. Returns 0, or -1 when `dev` is
 * not a device or its primary context is not retained. */
int memgov_standin_cuda_live(int dev, unsigned long long out[4]) {
    if (out == NULL || dev < 0 || dev >= MAX_DEVICES) return -1;
    pthread_mutex_lock(&g_lock);
    CUcontext c = g_dev[dev].refs != 0 ? g_dev[dev].primary : NULL;
    if (c != NULL) {
        out[0] = sq_mem_live_count(c->mem);
        out[1] = sq_mem_live_bytes(c->mem);
        out[2] = sq_mem_live_count(c->host_mem);
        out[3] = sq_mem_live_bytes(c->host_mem);
    }
    pthread_mutex_unlock(&g_lock);
    return c != NULL ? 0 : -1;
}

/* For tests: what the destroyed primary contexts of `dev` took with them
 * (allocations still live at their last release), summed over the process,
 * in the layout of memgov_standin_cuda_live. Returns 0, or -1 when `dev` is
 * not a device. */
int memgov_standin_cuda_reclaimed(int dev, unsigned long long out[4]) {
    if (out == NULL || dev < 0 || dev >= MAX_DEVICES) return -1;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < 4; i++) out[i] = g_dev[dev].reclaimed[i];
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* ---- checks every entry point makes -------------------------------------- */

/* Entry of every driver call: no calls from host functions; count the call
 * for the sticky error knob. Returns nonzero when the device is sticky. */
static int enter(const char *fn) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("%s called from inside a host function (the driver forbids CUDA calls there)", fn);
    sq_entry_pause(fn);
    if (!g_initialized) return 0;
    int sticky = sq_knobs_tick(&g_knobs);
    return sticky || sticky_now();
}

#define ENTER(fn)                                             \
    do {                                                      \
        if (enter(fn)) return CUDA_ERROR_ILLEGAL_ADDRESS;     \
        if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

static void check_ctx_handle(CUcontext c, const char *fn) {
    if (c->magic != CTX_MAGIC) sq_die("%s: %p is not a context", fn, (void *)c);
    if (c->destroyed) sq_die("%s on destroyed context %p", fn, (void *)c);
}

/* The calling thread's current context, or NULL (the caller then returns
 * CUDA_ERROR_INVALID_CONTEXT). A destroyed current context is a violation. */
static CUcontext current(const char *fn) {
    CUcontext c = thread_current();
    if (c != NULL) check_ctx_handle(c, fn);
    return c;
}

/* A stream argument: live, of the current context. Returns 0 or an error. */
static CUresult check_stream(CUstream s, const char *fn) {
    CUcontext c = current(fn);
    if (s == NULL) sq_die("%s on the legacy default stream: memgov's backend never uses it", fn);
    if (s->magic != STREAM_MAGIC) sq_die("%s: %p is not a stream", fn, (void *)s);
    if (s->destroyed) sq_die("%s on destroyed stream %p", fn, (void *)s);
    if (s->ctx->destroyed) sq_die("%s on stream %p of a destroyed context", fn, (void *)s);
    if (c == NULL || c != s->ctx) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

static const char *check_name(enum sq_mem_check c) { return sq_mem_check_str(c); }

/* Whether hStream is capturing (the graph section). */
static int capturing(CUstream s) { return graph_capturing != NULL && graph_capturing(s); }

/* Work the graph section does not record on a capturing stream. */
static void not_captured(CUstream s, const char *fn) {
    if (capturing(s)) sq_die("%s on a capturing stream is not imitated by the stand-in libcuda", fn);
}

/* A potentially unsafe call during a capture (the graph section): 0 or the error. */
static CUresult capture_unsafe(const char *fn, int alloc) {
    return graph_unsafe != NULL ? graph_unsafe(fn, alloc) : CUDA_SUCCESS;
}

/* ---- errors ---------------------------------------------------------------- */

struct code_name {
    CUresult code;
    const char *name, *text;
};

static const struct code_name g_codes[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const struct code_name *find_code(CUresult e) {
    for (size_t i = 0; i < sizeof g_codes / sizeof g_codes[0]; i++)
        if (g_codes[i].code == e) return &g_codes[i];
    return NULL;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("cuGetErrorName called from inside a host function");
    const struct code_name *c = find_code(error);
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (c == NULL) {
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = c->name;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("cuGetErrorString called from inside a host function");
    const struct code_name *c = find_code(error);
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (c == NULL) {
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = c->text;
    return CUDA_SUCCESS;
}

/* ---- initialisation and devices ------------------------------------------ */

/* The default pool's attributes must be as the process found them. */
static void check_default_pool(CUdevice d, const char *when) {
    uint64_t now = g_dev[d].pool.release_threshold, found = g_dev[d].pool_found_threshold;
    if (now != found)
        sq_die("%s: the release threshold of device %d's default memory pool is %llu, but the "
               "process found it at %llu: a library changed process-wide pool state and did not "
               "restore it (use a pool of its own, cuMemPoolCreate)",
               when, d, (unsigned long long)now, (unsigned long long)found);
}

/* MEMGOV_STANDIN_CUDA_EXIT_CHECK=1: at process exit nothing may be left:
 * no primary context reference (with its allocations and streams), no
 * created memory pool, no default pool attribute changed. */
static void exit_check(void) {
    pthread_mutex_lock(&g_lock);
    for (int d = 0; d < g_devices; d++) {
        CUcontext c = g_dev[d].primary;
        if (g_dev[d].refs != 0) {
            unsigned long long streams = 0;
            pthread_mutex_lock(&c->lock);
            for (CUstream s = c->streams; s != NULL; s = s->next) streams++;
            pthread_mutex_unlock(&c->lock);
            sq_die("at exit: the primary context of device %d still has %d reference(s) (never "
                   "released), holding %llu allocations (%llu bytes) and %llu streams",
                   d, g_dev[d].refs, (unsigned long long)sq_mem_live_count(c->mem),
                   (unsigned long long)sq_mem_live_bytes(c->mem), streams);
        }
        check_default_pool(d, "at exit");
    }
    for (CUmemoryPool p = g_pools; p != NULL; p = p->next)
        if (!p->destroyed) sq_die("at exit: memory pool %p of device %d never destroyed", (void *)p, p->device);
    pthread_mutex_unlock(&g_lock);
}

CUresult cuInit(unsigned int flags) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN) sq_die("cuInit called from inside a host function");
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        sq_set_name("libcuda stand-in");
        sq_knobs_load(&g_knobs, "MEMGOV_STANDIN_CUDA");
        g_fail_host_func_at = sq_env_u64("MEMGOV_STANDIN_CUDA_FAIL_HOST_FUNC_AT", 0);
        g_sticky_at_exec = sq_env_u64("MEMGOV_STANDIN_CUDA_STICKY_ERROR_AT_EXEC", 0);
        g_total_bytes = sq_env_u64("MEMGOV_STANDIN_CUDA_TOTAL_BYTES", 16ull << 30);
        uint64_t n = sq_env_u64("MEMGOV_STANDIN_CUDA_DEVICES", 1);
        g_devices = n > MAX_DEVICES ? MAX_DEVICES : (int)n;
        for (int i = 0; i < MAX_DEVICES; i++) {
            g_dev[i].pool =
                (struct CUmemPoolHandle_st){.magic = POOL_MAGIC, .device = i, .is_default = 1};
            g_dev[i].pool_found_threshold = g_dev[i].pool.release_threshold;
        }
        if (sq_env_u64("MEMGOV_STANDIN_CUDA_EXIT_CHECK", 0) != 0) atexit(exit_check);
        g_initialized = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return sq_knobs_tick(&g_knobs) ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("cuDriverGetVersion called from inside a host function");
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = 12040;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount");
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    *count = g_devices;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet");
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static int valid_device(CUdevice d) { return d >= 0 && d < g_devices; }

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    if (name == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "memgov stand-in CUDA device %d", dev);
    return CUDA_SUCCESS;
}

/* The device's UUID: 16 bytes, the same in every process for one ordinal
 * (as a real device's is), distinct between ordinals. */
static void device_uuid(CUuuid *uuid, CUdevice dev) {
    static const char stem[14] = {'m', 'e', 'm', 'g', 'o', 'v', '-', 's', 't', 'a', 'n', 'd', 'i', 'n'};
    memcpy(uuid->bytes, stem, sizeof stem);
    uuid->bytes[14] = 0;
    uuid->bytes[15] = (char)dev;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    ENTER("cuDeviceGetUuid_v2");
    if (uuid == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    device_uuid(uuid, dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    ENTER("cuDeviceGetUuid");
    if (uuid == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    device_uuid(uuid, dev);
    return CUDA_SUCCESS;
}

/* "[domain]:[bus]:[device].[function]", hex, NUL-terminated within `len`
 * bytes: domain 0, bus 0x10 + ordinal. */
CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    ENTER("cuDeviceGetPCIBusId");
    if (pciBusId == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x10 + dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem_v2");
    if (bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)g_total_bytes;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    ENTER("cuDeviceGetAttribute");
    if (pi == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *pi = 1; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* ---- contexts ---------------------------------------------------------------- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (g_dev[dev].refs == 0) {
        /* A fresh context each time the primary context is (re)created: the
         * old handle stays destroyed, so late use of it is caught. */
        CUcontext c = calloc(1, sizeof *c);
        if (c == NULL) sq_fatal("out of host memory");
        c->magic = CTX_MAGIC;
        c->device = dev;
        c->mem = sq_mem_new(g_knobs.oom_after_bytes);
        c->host_mem = sq_mem_new(0);
        pthread_mutex_init(&c->lock, NULL);
        g_dev[dev].primary = c;
    }
    g_dev[dev].refs++;
    *pctx = g_dev[dev].primary;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static void destroy_context(CUcontext c, int sticky) {
    /* Pending work is a violation on a healthy device; on a device in the
     * sticky error state queued work no longer executes and is dropped. */
    pthread_mutex_lock(&c->lock);
    for (CUstream s = c->streams; s != NULL; s = s->next) {
        uint64_t pending = sq_queue_pending(s->q);
        if (pending != 0 && !sticky)
            sq_die("primary context of device %d released (last reference) with %llu operations "
                   "(frees, copies or host functions) still pending on stream %p",
                   c->device, (unsigned long long)pending, (void *)s);
    }
    for (CUstream s = c->draining; s != NULL; s = s->next) {
        uint64_t pending = sq_queue_pending(s->q);
        if (pending != 0 && !sticky)
            sq_die("primary context of device %d released (last reference) with %llu operations "
                   "(frees, copies or host functions) still pending on destroyed stream %p",
                   c->device, (unsigned long long)pending, (void *)s);
    }
    int caller = 0;
    int holding = threads_holding(c, &caller);
    if (holding != 0)
        sq_die("primary context of device %d released (last reference) while it is still the "
               "current context (or stacked) on %d thread(s)%s: their next driver call fails with "
               "CUDA_ERROR_CONTEXT_IS_DESTROYED; a library must restore each thread's previous "
               "context before returning (cuCtxPushCurrent / cuCtxPopCurrent)",
               c->device, holding, caller ? ", the releasing thread among them" : "");
    check_default_pool(c->device, "last release of the primary context");
    /* The driver destroys the context with whatever it still holds ("the
     * context is automatically reset once the last reference to it is
     * released"), so allocations live here are not a driver error. They are
     * a holder's leak all the same: a reference is released without knowing
     * whether it is the last one, and the same release with another holder
     * left (a runtime sharing the primary context) leaves them allocated in
     * that holder's context for as long as it holds it. So, stricter than
     * the driver: every allocation of the context (device memory from any
     * pool, page-locked host memory) must be freed, and its free executed,
     * before the last reference goes. On a device in the sticky error state
     * nothing can be freed: the allocations go with the context. */
    uint64_t live = sq_mem_live_count(c->mem), live_bytes = sq_mem_live_bytes(c->mem);
    uint64_t host_live = sq_mem_live_count(c->host_mem);
    uint64_t host_bytes = sq_mem_live_bytes(c->host_mem);
    if (!sticky && (live != 0 || host_live != 0))
        sq_die("primary context of device %d released (last reference) with %llu device "
               "allocation(s) (%llu bytes) and %llu page-locked host allocation(s) (%llu bytes) "
               "still live on a device that still executes work: the driver would destroy them "
               "with the context, but the same release with another holder left (a runtime "
               "sharing the primary context) leaves them allocated in its context; free them "
               "(and let the frees execute) before releasing the reference",
               c->device, (unsigned long long)live, (unsigned long long)live_bytes,
               (unsigned long long)host_live, (unsigned long long)host_bytes);
    CUstream lists[2] = {c->streams, c->draining};
    c->streams = NULL;
    c->draining = NULL;
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_lock(&g_lock); /* never under c->lock: exit_check takes g_lock, then it */
    g_dev[c->device].reclaimed[0] += live;
    g_dev[c->device].reclaimed[1] += live_bytes;
    g_dev[c->device].reclaimed[2] += host_live;
    g_dev[c->device].reclaimed[3] += host_bytes;
    pthread_mutex_unlock(&g_lock);
    for (int i = 0; i < 2; i++) {
        CUstream s = lists[i];
        while (s != NULL) {
            CUstream next = s->next;
            sq_queue_destroy(s->q);
            s->q = NULL;
            s->destroyed = 1; /* the struct is kept so later use is caught */
            s = next;
        }
    }
    c->destroyed = 1; /* kept, likewise */
    /* The table still holding live allocations is leaked (host memory only):
     * the device's memory went with the context. */
    if (!sticky && live == 0) sq_mem_destroy(c->mem);
    c->mem = NULL;
    if (!sticky && host_live == 0) sq_mem_destroy(c->host_mem);
    c->host_mem = NULL;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    int sticky = enter("cuDevicePrimaryCtxRelease_v2");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (g_dev[dev].refs == 0) sq_die("cuDevicePrimaryCtxRelease_v2 of device %d, which is not retained", dev);
    /* A reference let go while a pool its holder created and destroyed still
     * has allocations outstanding: cuMemPoolDestroy with allocations
     * outstanding is legal (the pool goes once they are freed), but nothing
     * will free them now, so they stay allocated in the primary context for
     * as long as anyone holds it (a runtime that shares it keeps them for
     * ever). On a device in the sticky error state nothing can be freed and
     * the memory goes with the context: no violation. */
    if (!sticky) {
        pthread_mutex_lock(&g_pool_allocs_lock);
        for (CUmemoryPool p = g_pools; p != NULL; p = p->next)
            if (p->device == dev && p->destroyed && p->live_count != 0)
                sq_die("cuDevicePrimaryCtxRelease_v2 of device %d (%d reference(s) left after it) "
                       "while memory pool %p, destroyed, still has %llu allocation(s) (%llu bytes) "
                       "outstanding on a device that still executes work: they stay allocated in "
                       "the primary context for as long as anyone holds it; free them (and let the "
                       "frees execute) before releasing the reference",
                       dev, g_dev[dev].refs - 1, (void *)p, (unsigned long long)p->live_count,
                       (unsigned long long)p->live_bytes);
        pthread_mutex_unlock(&g_pool_allocs_lock);
    }
    CUcontext c = NULL;
    if (--g_dev[dev].refs == 0) {
        c = g_dev[dev].primary;
        g_dev[dev].primary = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    /* Releasing succeeds even on a device in the sticky error state: it is
     * how a program lets go of a broken context. */
    if (c != NULL) {
        destroy_context(c, sticky);
        pool_allocs_forget_device(dev);
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (enter("cuCtxSetCurrent")) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx != NULL) check_ctx_handle(ctx, "cuCtxSetCurrent");
    struct thread_slot *t = slot();
    pthread_mutex_lock(&g_slots_lock);
    t->current = ctx; /* replaces the top of the stack */
    pthread_mutex_unlock(&g_slots_lock);
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (enter("cuCtxPushCurrent_v2")) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    check_ctx_handle(ctx, "cuCtxPushCurrent_v2");
    /* FAIL_ENTRY (the virtual memory section): CUDA_ERROR_INVALID_CONTEXT, nothing pushed. */
    if (standin_entry_fault != NULL && standin_entry_fault("cuCtxPushCurrent_v2"))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct thread_slot *t = slot();
    pthread_mutex_lock(&g_slots_lock);
    if (t->depth == STACK_MAX) {
        pthread_mutex_unlock(&g_slots_lock);
        sq_die("cuCtxPushCurrent_v2: context stack deeper than %d (pushes without pops)", STACK_MAX);
    }
    t->stack[t->depth++] = t->current;
    t->current = ctx;
    pthread_mutex_unlock(&g_slots_lock);
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    /* Popping touches no device and works in the sticky error state too: it
     * is how a thread lets go of a broken context. */
    (void)enter("cuCtxPopCurrent_v2");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    struct thread_slot *t = slot();
    pthread_mutex_lock(&g_slots_lock);
    CUcontext top = t->current;
    if (top == NULL) {
        pthread_mutex_unlock(&g_slots_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    t->current = t->depth > 0 ? t->stack[--t->depth] : NULL;
    pthread_mutex_unlock(&g_slots_lock);
    if (pctx != NULL) *pctx = top;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (enter("cuCtxGetCurrent")) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pctx = thread_current(); /* a destroyed current context is returned as is */
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    if (capture_unsafe("cuCtxSynchronize", 0)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    CUcontext c = current("cuCtxSynchronize");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&c->lock);
    /* Snapshot the queues' last operations, then wait outside the lock. */
    size_t n = 0;
    for (CUstream s = c->streams; s != NULL; s = s->next) n++;
    for (CUstream s = c->draining; s != NULL; s = s->next) n++;
    struct sq_queue **qs = calloc(n ? n : 1, sizeof *qs);
    uint64_t *last = calloc(n ? n : 1, sizeof *last);
    if (qs == NULL || last == NULL) sq_fatal("out of host memory");
    n = 0;
    for (int i = 0; i < 2; i++) {
        for (CUstream s = i == 0 ? c->streams : c->draining; s != NULL; s = s->next, n++) {
            qs[n] = s->q;
            last[n] = sq_queue_last(s->q);
        }
    }
    c->syncing++;
    pthread_mutex_unlock(&c->lock);
    /* The pause knob holds a synchronize here, between its snapshot and its
     * waits, so a test can destroy and reap streams meanwhile (a point of
     * its own name: the entry point's own pause is at its entry). */
    sq_entry_pause("cuCtxSynchronize:waits");
    for (size_t i = 0; i < n; i++) sq_queue_wait(qs[i], last[i]);
    pthread_mutex_lock(&c->lock);
    c->syncing--;
    pthread_mutex_unlock(&c->lock);
    free(qs);
    free(last);
    return sticky_now() ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER("cuMemGetInfo_v2");
    CUcontext c = current("cuMemGetInfo_v2");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (free_bytes == NULL || total == NULL) return CUDA_ERROR_INVALID_VALUE;
    uint64_t cap = g_total_bytes;
    if (g_knobs.oom_after_bytes != 0 && g_knobs.oom_after_bytes < cap) cap = g_knobs.oom_after_bytes;
    uint64_t used = sq_mem_live_bytes(c->mem) + (vmm_physical_bytes != NULL ? vmm_physical_bytes() : 0);
    *free_bytes = (size_t)(used > cap ? 0 : cap - used);
    *total = (size_t)g_total_bytes;
    return CUDA_SUCCESS;
}

/* ---- streams ----------------------------------------------------------------- */

/* Join destroyed streams whose queued work has all run, so that a program
 * creating and destroying streams does not accumulate threads. */
static void reap_drained(CUcontext c) {
    CUstream done = NULL;
    pthread_mutex_lock(&c->lock);
    /* A cuCtxSynchronize waits on these queues: reaped by a later call. */
    for (CUstream *p = c->syncing > 0 ? &done : &c->draining; *p != NULL;) {
        CUstream s = *p;
        if (sq_queue_pending(s->q) == 0) {
            *p = s->next;
            s->next = done;
            done = s;
        } else {
            p = &s->next;
        }
    }
    pthread_mutex_unlock(&c->lock);
    while (done != NULL) {
        CUstream next = done->next;
        sq_queue_destroy(done->q);
        done->q = NULL;
        done->next = NULL;
        done = next;
    }
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    ENTER("cuStreamCreate");
    CUcontext c = current("cuStreamCreate");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (phStream == NULL || (flags & ~CU_STREAM_NON_BLOCKING) != 0) return CUDA_ERROR_INVALID_VALUE;
    reap_drained(c);
    CUstream s = calloc(1, sizeof *s);
    if (s == NULL) sq_fatal("out of host memory");
    s->magic = STREAM_MAGIC;
    s->ctx = c;
    s->q = sq_queue_new(g_knobs.latency_us);
    pthread_mutex_lock(&c->lock);
    s->next = c->streams;
    c->streams = s;
    pthread_mutex_unlock(&c->lock);
    *phStream = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
    if (enter("cuStreamDestroy_v2")) {
        /* Still validate the handle: destroying twice is a bug either way. */
        if (hStream != NULL && hStream->magic == STREAM_MAGIC && hStream->destroyed)
            sq_die("cuStreamDestroy_v2 on destroyed stream %p", (void *)hStream);
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = check_stream(hStream, "cuStreamDestroy_v2");
    if (r != CUDA_SUCCESS) return r;
    /* A capture sequence must be ended on its stream before the stream is
     * used again; the driver defines no result for destroying it. */
    if (capturing(hStream))
        sq_die("cuStreamDestroy_v2 of stream %p in a capture sequence (end it with "
               "cuStreamEndCapture first)", (void *)hStream);
    CUcontext c = hStream->ctx;
    pthread_mutex_lock(&c->lock);
    for (CUstream *p = &c->streams; *p != NULL; p = &(*p)->next) {
        if (*p == hStream) {
            *p = hStream->next;
            break;
        }
    }
    hStream->destroyed = 1;
    hStream->next = c->draining;
    c->draining = hStream;
    /* Like the driver: returns at once; work already queued still runs. */
    sq_queue_close(hStream->q);
    pthread_mutex_unlock(&c->lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream hStream) {
    ENTER("cuStreamSynchronize");
    CUresult r = check_stream(hStream, "cuStreamSynchronize");
    if (r != CUDA_SUCCESS) return r;
    if (capturing(hStream)) return graph_conflicting("cuStreamSynchronize", hStream);
    sq_queue_sync(hStream->q);
    return sticky_now() ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream hStream) {
    ENTER("cuStreamQuery");
    CUresult r = check_stream(hStream, "cuStreamQuery");
    if (r != CUDA_SUCCESS) return r;
    if (capturing(hStream)) return graph_conflicting("cuStreamQuery", hStream);
    return sq_queue_pending(hStream->q) == 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* ---- memory ------------------------------------------------------------------ */

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    ENTER("cuDeviceGetDefaultMemPool");
    if (pool == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pool = &g_dev[dev].pool;
    return CUDA_SUCCESS;
}

static void check_pool(CUmemoryPool pool, const char *fn) {
    if (pool == NULL || pool->magic != POOL_MAGIC) sq_die("%s: %p is not a memory pool", fn, (void *)pool);
    if (pool->destroyed) sq_die("%s on destroyed memory pool %p", fn, (void *)pool);
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const struct CUmemPoolProps_st *props) {
    ENTER("cuMemPoolCreate");
    if (pool == NULL || props == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(props->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (props->handleTypes != 0) return CUDA_ERROR_NOT_SUPPORTED;
    CUmemoryPool p = calloc(1, sizeof *p);
    if (p == NULL) sq_fatal("out of host memory");
    *p = (struct CUmemPoolHandle_st){.magic = POOL_MAGIC, .device = props->location.id};
    pthread_mutex_lock(&g_lock);
    p->next = g_pools;
    g_pools = p;
    pthread_mutex_unlock(&g_lock);
    *pool = p;
    return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    /* Like the driver: legal with allocations outstanding (they are released
     * when freed); the pool handle is dead at once. Kept, so that a later
     * use is caught. */
    int sticky = enter("cuMemPoolDestroy");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    check_pool(pool, "cuMemPoolDestroy");
    if (pool->is_default) sq_die("cuMemPoolDestroy of device %d's default memory pool", pool->device);
    pool->destroyed = 1;
    return sticky ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    ENTER("cuMemPoolSetAttribute");
    check_pool(pool, "cuMemPoolSetAttribute");
    if (value == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_NOT_SUPPORTED;
    memcpy(&pool->release_threshold, value, sizeof pool->release_threshold);
    return CUDA_SUCCESS;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    ENTER("cuMemPoolGetAttribute");
    check_pool(pool, "cuMemPoolGetAttribute");
    if (value == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_NOT_SUPPORTED;
    memcpy(value, &pool->release_threshold, sizeof pool->release_threshold);
    return CUDA_SUCCESS;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    ENTER("cuMemPoolTrimTo");
    check_pool(pool, "cuMemPoolTrimTo");
    (void)minBytesToKeep; /* the stand-in's pool caches nothing */
    return CUDA_SUCCESS;
}

static CUresult alloc_async(const char *fn, CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    CUresult r = check_stream(hStream, fn);
    if (r != CUDA_SUCCESS) return r;
    if (dptr == NULL || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    /* A memory allocation node of the capture (the graph section). */
    if (capturing(hStream)) return graph_record_alloc(fn, hStream, hStream->ctx->mem, bytesize, dptr);
    if (graph_note_alloc != NULL) graph_note_alloc();
    /* Valid from a position on the stream: use on another stream must be
     * ordered after it. */
    uint64_t p = sq_mem_alloc_on(hStream->ctx->mem, bytesize, hStream->q);
    if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = p;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ENTER("cuMemAllocAsync");
    return alloc_async("cuMemAllocAsync", dptr, bytesize, hStream);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    ENTER("cuMemAllocFromPoolAsync");
    check_pool(pool, "cuMemAllocFromPoolAsync");
    if (hStream != NULL && hStream->magic == STREAM_MAGIC && !hStream->destroyed &&
        hStream->ctx->device != pool->device)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = alloc_async("cuMemAllocFromPoolAsync", dptr, bytesize, hStream);
    if (r == CUDA_SUCCESS && !pool->is_default && !capturing(hStream))
        pool_alloc_track(pool, *dptr, bytesize);
    return r;
}

struct free_op {
    struct sq_mem *mem;
    uint64_t base;
};

static void run_free(void *arg) {
    struct free_op *op = arg;
    /* On a device in the sticky error state queued work no longer runs; the
     * memory goes when the context is released. */
    if (!exec_tick()) {
        pool_alloc_untrack(op->base);
        sq_mem_finish_free(op->mem, op->base);
    }
    free(op);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    ENTER("cuMemFreeAsync");
    CUresult r = check_stream(hStream, "cuMemFreeAsync");
    if (r != CUDA_SUCCESS) return r;
    /* A memory free node of the capture (the graph section). */
    if (capturing(hStream)) return graph_record_free("cuMemFreeAsync", hStream, dptr);
    enum sq_mem_check c =
        sq_mem_begin_free_on(hStream->ctx->mem, dptr, hStream->q, "cuMemFreeAsync");
    if (c != SQ_MEM_OK)
        sq_die("cuMemFreeAsync of %s pointer 0x%llx", check_name(c), (unsigned long long)dptr);
    struct free_op *op = malloc(sizeof *op);
    if (op == NULL) sq_fatal("out of host memory");
    *op = (struct free_op){.mem = hStream->ctx->mem, .base = dptr};
    sq_queue_push(hStream->q, run_free, op, SQ_OP_PLAIN);
    return CUDA_SUCCESS;
}


static CUresult copy_async(const char *fn, CUdeviceptr dev, void *dst, const void *src, size_t bytes,
                           CUstream hStream) {
    CUresult r = check_stream(hStream, fn);
    if (r != CUDA_SUCCESS) return r;
    if (bytes == 0) return CUDA_SUCCESS;
    if (dst == NULL || src == NULL) return CUDA_ERROR_INVALID_VALUE;
    /* Recorded, checked when a graph of it is launched. */
    if (capturing(hStream)) return graph_record_copy(fn, hStream, dev, dst, src, bytes);
    /* Memory mapped into a reservation (the virtual memory section) has its own checks. */
    if (vmm_copy != NULL && vmm_copy(fn, dev, bytes, hStream->q, dst, src)) return CUDA_SUCCESS;
    struct sq_mem *mem = sq_mem_table_of(hStream->ctx->mem, hStream->ctx->host_mem, dev);
    enum sq_mem_check c = sq_mem_check_on(mem, dev, bytes, hStream->q, fn);
    if (c != SQ_MEM_OK)
        sq_die("%s of %zu bytes at %s device pointer 0x%llx", fn, bytes, check_name(c),
               (unsigned long long)dev);
    sq_queue_copy(hStream->q, dst, src, bytes);
    sq_mem_touch(mem, dev, hStream->q, sq_queue_last(hStream->q));
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream) {
    ENTER("cuMemcpyHtoDAsync_v2");
    return copy_async("cuMemcpyHtoDAsync_v2", dstDevice, (void *)(uintptr_t)dstDevice, srcHost,
                      ByteCount, hStream);
}

CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream) {
    ENTER("cuMemcpyDtoHAsync_v2");
    return copy_async("cuMemcpyDtoHAsync_v2", srcDevice, dstHost,
                      (const void *)(uintptr_t)srcDevice, ByteCount, hStream);
}

/* ---- page-locked host memory ---------------------------------------------------- */

#define CU_MEMHOSTALLOC_VALID_FLAGS 7u /* portable, devicemap, writecombined */

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    ENTER("cuMemHostAlloc");
    CUcontext c = current("cuMemHostAlloc");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (pp == NULL || bytesize == 0 || (Flags & ~CU_MEMHOSTALLOC_VALID_FLAGS) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (capture_unsafe("cuMemHostAlloc", 1)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    /* FAIL_ENTRY (the virtual memory section): out of page-locked memory, nothing allocated. */
    if (standin_entry_fault != NULL && standin_entry_fault("cuMemHostAlloc"))
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t p = sq_mem_alloc_tracked(c->host_mem, bytesize);
    if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = (void *)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    ENTER("cuMemHostGetDevicePointer_v2");
    CUcontext c = current("cuMemHostGetDevicePointer_v2");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (pdptr == NULL || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (sq_mem_check(c->host_mem, (uint64_t)(uintptr_t)p, 1) != SQ_MEM_OK)
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing */
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    ENTER("cuMemFreeHost");
    CUcontext c = current("cuMemFreeHost");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (capture_unsafe("cuMemFreeHost", 0)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    enum sq_mem_check r = sq_mem_free_now(c->host_mem, (uint64_t)(uintptr_t)p, "cuMemFreeHost");
    if (r != SQ_MEM_OK)
        sq_die("cuMemFreeHost of %s page-locked pointer %p", check_name(r), p);
    return CUDA_SUCCESS;
}

/* ---- host functions ------------------------------------------------------------ */

struct host_fn_op {
    CUhostFn fn;
    void *user;
};

static void run_host_fn(void *arg) {
    struct host_fn_op *op = arg;
    if (!exec_tick()) op->fn(op->user);
    free(op);
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    ENTER("cuLaunchHostFunc");
    CUresult r = check_stream(hStream, "cuLaunchHostFunc");
    if (r != CUDA_SUCCESS) return r;
    if (fn == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (capturing(hStream)) return graph_record_host_fn(hStream, fn, userData);
    pthread_mutex_lock(&g_lock);
    uint64_t n = ++g_host_func_calls;
    pthread_mutex_unlock(&g_lock);
    if (g_fail_host_func_at != 0 && n == g_fail_host_func_at) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    struct host_fn_op *op = malloc(sizeof *op);
    if (op == NULL) sq_fatal("out of host memory");
    *op = (struct host_fn_op){.fn = fn, .user = userData};
    sq_queue_push(hStream->q, run_host_fn, op, SQ_OP_HOST_FN);
    return CUDA_SUCCESS;
}

/* ---- events ------------------------------------------------------------------- */

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    ENTER("cuEventCreate");
    CUcontext c = current("cuEventCreate");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (phEvent == NULL || (Flags & ~CU_EVENT_VALID_FLAGS) != 0) return CUDA_ERROR_INVALID_VALUE;
    *phEvent = sq_event_new();
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    ENTER("cuEventRecord");
    sq_event_check(hEvent, "cuEventRecord");
    CUresult r = check_stream(hStream, "cuEventRecord");
    if (r != CUDA_SUCCESS) return r;
    not_captured(hStream, "cuEventRecord");
    /* Captures the work queued on the stream so far; overwrites. */
    sq_event_record(hEvent, hStream->q);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    ENTER("cuStreamWaitEvent");
    sq_event_check(hEvent, "cuStreamWaitEvent");
    CUresult r = check_stream(hStream, "cuStreamWaitEvent");
    if (r != CUDA_SUCCESS) return r;
    not_captured(hStream, "cuStreamWaitEvent");
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    /* Orders work queued on hStream after this call after the event's work. */
    sq_queue_wait_event(hStream->q, hEvent);
    return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent hEvent) {
    ENTER("cuEventQuery");
    sq_event_check(hEvent, "cuEventQuery");
    return sq_event_done(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    ENTER("cuEventSynchronize");
    sq_event_check(hEvent, "cuEventSynchronize");
    sq_event_sync(hEvent);
    return sticky_now() ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent hEvent) {
    /* Legal while a wait on the event is pending: its resources go once the
     * event completes (the wait keeps what it needs). */
    int sticky = enter("cuEventDestroy_v2");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    sq_event_check(hEvent, "cuEventDestroy_v2");
    sq_event_destroy(hEvent);
    return sticky ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

#ifndef MEMGOV_STANDIN_CUDA_PARTIAL

/* ---- what the virtual memory and graph tables call ------------------------------ */

static int cuda_standin_devices(void) { return g_devices; }

static int cuda_standin_copy(const char *fn, const void *stream, uint64_t dev, void *dst,
                      const void *src, size_t bytes) {
    return copy_async(fn, dev, dst, src, bytes, (CUstream)stream);
}

static int cuda_standin_host_fn(const void *stream, void (*fn)(void *), void *user) {
    return cuLaunchHostFunc((CUstream)stream, fn, user);
}

static int cuda_standin_check_stream(const void *stream, const char *fn) {
    return check_stream((CUstream)stream, fn);
}

static uint64_t cuda_standin_capacity(void) {
    uint64_t cap = g_total_bytes;
    if (g_knobs.oom_after_bytes != 0 && g_knobs.oom_after_bytes < cap) cap = g_knobs.oom_after_bytes;
    return cap;
}

static int cuda_standin_sticky(void) { return sticky_now(); }

/* ---- virtual memory management -------------------------------------------------
 *
 * The CUDA virtual memory management calls
 * (cuMemGetAllocationGranularity, cuMemAddressReserve / cuMemAddressFree,
 * cuMemCreate / cuMemRelease, cuMemMap / cuMemUnmap, cuMemSetAccess). The
 * imitation and its rules are common/sq_vmm.c's (compiled here, by the
 * #include below); this section fills its table with the driver API's names
 * and codes and keeps the exported entry points, which decode the CUDA
 * structs and call it.
 *
 * CUDA's side of the documented differences (CUDA Driver API, Virtual
 * Memory Management):
 * - cuMemMap maps from `offset` into the handle's memory, any multiple of
 *   the granularity within it.
 * - A failing cuMemUnmap or cuMemRelease (MEMGOV_STANDIN_CUDA_
 *   FAIL_UNMAP_AT=N, and the FAIL_ENTRY knob below) returns
 *   CUDA_ERROR_UNKNOWN, leaving the mapping or handle as it was.
 * - A copy has one device side (cuMemcpyHtoDAsync, cuMemcpyDtoHAsync):
 *   copy_async names its device address.
 *
 * - MEMGOV_STANDIN_CUDA_FAIL_ENTRY=<entry point>:<N>: the Nth call of that
 *   entry point (counting the calls that pass its argument checks) fails:
 *   cuMemCreate, cuMemMap and cuMemSetAccess with the codes FAIL_VMM_AT
 *   uses (sq_vmm.c), changing nothing; cuMemUnmap and cuMemRelease with
 *   CUDA_ERROR_UNKNOWN, leaving the mapping or handle as it was (a later
 *   call on it succeeds); the graph section's cuStreamBeginCapture_v2 and
 *   cuStreamEndCapture as it says; cuMemHostAlloc with
 *   CUDA_ERROR_OUT_OF_MEMORY, nothing allocated, and cuCtxPushCurrent_v2
 *   with CUDA_ERROR_INVALID_CONTEXT, nothing pushed.
 *   memgov_standin_cuda_fail_entry(fn, N) sets the same at run time (the
 *   count starts again), so that one process runs many fault cells.
 * - memgov_standin_cuda_vmm() reports what is held, for tests.
 */

/* As laid out by the CUDA 12 headers. */
struct CUmemLocation_st {
    int type;
    int id;
};
struct CUmemAllocationProp_st {
    int type;
    int requestedHandleTypes;
    struct CUmemLocation_st location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType, gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
};
struct CUmemAccessDesc_st {
    struct CUmemLocation_st location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_{NONE,READ,READWRITE}: 0, 1, 3 */
};

int standin_entry_fault(const char *fn) {
    return sq_entry_fault("MEMGOV_STANDIN_CUDA_FAIL_ENTRY", fn);
}

static struct sq_vmm_access access_of(const void *desc, size_t i) {
    const struct CUmemAccessDesc_st *d = (const struct CUmemAccessDesc_st *)desc + i;
    return (struct sq_vmm_access){.on_device = d->location.type == CU_MEM_LOCATION_TYPE_DEVICE,
                                  .device = d->location.id,
                                  .flags = d->flags};
}

static const struct sq_vmm_vendor CUDA_VMM = {
    .create = "cuMemCreate", .release = "cuMemRelease", .map = "cuMemMap",
    .set_access = "cuMemSetAccess", .unmap = "cuMemUnmap", .address_free = "cuMemAddressFree",
    .prefix = "MEMGOV_STANDIN_CUDA", .memfd_name = "memgov-standin-vmm",
    .success = CUDA_SUCCESS, .invalid_value = CUDA_ERROR_INVALID_VALUE,
    .out_of_memory = CUDA_ERROR_OUT_OF_MEMORY, .invalid_device = CUDA_ERROR_INVALID_DEVICE,
    /* cuMemUnmap's and cuMemRelease's references list CUDA_ERROR_UNKNOWN. */
    .unmap_failure = CUDA_ERROR_UNKNOWN, .release_failure = CUDA_ERROR_UNKNOWN,
    /* cuMemMap: "offset - Offset into the memory represented by handle". */
    .map_offset_must_be_zero = 0,
    .devices = cuda_standin_devices, .capacity = cuda_standin_capacity,
    .sticky = cuda_standin_sticky, .entry_fault = standin_entry_fault, .access_of = access_of,
    .unsafe_during_capture = graph_unsafe,
    .capture_unsupported = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
};

#include "sq_vmm.c"

/* For tests (standin.h): memgov_standin_cuda_fail_entry(fn, n): from now
 * on the Nth call of `fn` fails (counting from this call; N = 0 or fn =
 * NULL: none), as MEMGOV_STANDIN_CUDA_FAIL_ENTRY says at process start, so
 * that one process runs many fault cells; memgov_standin_cuda_pause_entry
 * (fn, n), for tests that force an interleaving: from now on the Nth call
 * of `fn` (any entry point, at its entry; and the point named
 * "cuCtxSynchronize:waits", after a context synchronize took its snapshot
 * of the queues and before it waits on them) blocks before it changes
 * anything, until memgov_standin_cuda_resume_entry();
 * memgov_standin_cuda_entry_paused() says whether one is held. */
SQ_ENTRY_TEST_HOOKS(cuda)

static const struct sq_vmm_prop *prop_of(const struct CUmemAllocationProp_st *p,
                                        struct sq_vmm_prop *out) {
    if (p == NULL) return NULL;
    *out = (struct sq_vmm_prop){.pinned = p->type == CU_MEM_ALLOCATION_TYPE_PINNED,
                                .on_device = p->location.type == CU_MEM_LOCATION_TYPE_DEVICE,
                                .device = p->location.id};
    return out;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity,
                                       const struct CUmemAllocationProp_st *prop, int option) {
    ENTER("cuMemGetAllocationGranularity");
    struct sq_vmm_prop p;
    return sq_vmm_granularity(&CUDA_VMM, granularity, prop_of(prop, &p), option);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    ENTER("cuMemAddressReserve");
    (void)addr; /* a hint only */
    uint64_t base;
    CUresult r = sq_vmm_reserve(&CUDA_VMM, ptr != NULL ? &base : NULL, size, alignment, flags);
    if (r == CUDA_SUCCESS) *ptr = base;
    return r;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemAddressFree");
    return sq_vmm_address_free(&CUDA_VMM, ptr, size);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const struct CUmemAllocationProp_st *prop, unsigned long long flags) {
    ENTER("cuMemCreate");
    struct sq_vmm_prop p;
    uint64_t h;
    CUresult r =
        sq_vmm_create(&CUDA_VMM, handle != NULL ? &h : NULL, size, prop_of(prop, &p), flags);
    if (r == CUDA_SUCCESS) *handle = h;
    return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER("cuMemRelease");
    return sq_vmm_release(&CUDA_VMM, handle);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    ENTER("cuMemMap");
    return sq_vmm_map(&CUDA_VMM, ptr, size, offset, handle, flags);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct CUmemAccessDesc_st *desc,
                        size_t count) {
    ENTER("cuMemSetAccess");
    return sq_vmm_set_access(&CUDA_VMM, ptr, size, desc, count);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemUnmap");
    return sq_vmm_unmap(&CUDA_VMM, ptr, size);
}

/* vmm_copy (declared above): copy_async names its one device side, `addr`. */
int vmm_copy(const char *fn, uint64_t addr, size_t bytes, struct sq_queue *q, void *dst,
             const void *src) {
    int dst_is_device = (uint64_t)(uintptr_t)dst == addr;
    return sq_vmm_copy(&CUDA_VMM, fn, dst_is_device, !dst_is_device, dst, src, bytes, q);
}

uint64_t vmm_physical_bytes(void) { return sq_vmm_physical_bytes(); }

/* For tests: what the process holds, as {reservations, reserved bytes,
 * allocation handles (released but still mapped included), physical bytes,
 * mappings, mapped bytes}. Returns 0. */
int memgov_standin_cuda_vmm(unsigned long long out[6]) { return sq_vmm_held(out); }

/* ---- stream capture and graphs --------------------------------------------------
 *
 * The CUDA stream capture and graph calls. The
 * imitation and its rules are common/sq_graph.c's (compiled here, by the
 * #include below), from the stream capture and graph management sections
 * of NVIDIA's CUDA Driver API documentation; this section fills its table
 * with the driver API's names, codes and enumerators and keeps the
 * exported entry points and the hooks the rest of the file calls that
 * record (sq_graph.c defines the others over CUDA_GRAPH).
 *
 * CUDA's side:
 * - The potentially unsafe calls (those that allocate, map or release
 *   memory outside a stream, as the documentation's example cudaMalloc):
 *   cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap (the virtual
 *   memory section), cuMemHostAlloc, cuMemFreeHost and cuCtxSynchronize.
 * - A stream argument that is not live or not of the current context is
 *   the code the stream check returns (cuda_standin_check_stream).
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
 * - Fault knob (the MEMGOV_STANDIN_CUDA_FAIL_ENTRY=<entry point>:<N>):
 *   cuStreamBeginCapture_v2 and cuStreamEndCapture, as sq_graph.c says.
 * - The exit check (MEMGOV_STANDIN_CUDA_EXIT_CHECK) does not cover graphs.
 *
 * - Test hook (not a driver rule): memgov_standin_cuda_pause_entry(name, n)
 *   (SQ_ENTRY_TEST_HOOKS above) makes the Nth call of that entry point, on
 *   any thread, block at its entry before it does anything, until
 *   memgov_standin_cuda_resume_entry(). A test holds a call there to force
 *   an interleaving.
 *
 * Not imitated (a contract violation naming the call): event record and
 * event wait on a capturing stream (fork/join nodes), and launching a
 * graph into a capture.
 */

/* CUstreamCaptureMode and CUstreamCaptureStatus. */
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
enum { STATUS_NONE = 0, STATUS_ACTIVE = 1, STATUS_INVALIDATED = 2 };

static int entry_fault(const char *fn) { return standin_entry_fault(fn); }

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

/* ---- the hooks declared above ------------------------------------------------ */

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

/* ---- unimitated entry points -----------------------------------------------------
 *
 * Every other entry point of the CUDA 12.0 driver API that
 * cudarc 0.19.0 binds. cudarc's dynamic loader resolves all of its symbols
 * when it opens libcuda and panics if one is missing, so the stand-in must
 * export them; the backend never calls these, and a call aborts with a
 * contract violation naming the function rather than doing something
 * undefined.
 *
 * The list is the set of symbols cudarc 0.19.0's `Lib::from_library`
 * requires with its `cuda-12000` feature, less those this file imitates.
 * Each stub ignores its arguments: on the System V ABIs the caller owns the
 * argument registers and stack, so a stub declared without parameters is
 * safe to call with any.
 */
#define UNIMITATED(name)                                                              \
    int name(void);                                                                   \
    int name(void) { sq_die("%s is not imitated by the stand-in libcuda", #name); }

UNIMITATED(cuArray3DCreate_v2)
UNIMITATED(cuArray3DGetDescriptor_v2)
UNIMITATED(cuArrayCreate_v2)
UNIMITATED(cuArrayDestroy)
UNIMITATED(cuArrayGetDescriptor_v2)
UNIMITATED(cuArrayGetMemoryRequirements)
UNIMITATED(cuArrayGetPlane)
UNIMITATED(cuArrayGetSparseProperties)
UNIMITATED(cuCtxAttach)
UNIMITATED(cuCtxCreate_v2)
UNIMITATED(cuCtxCreate_v3)
UNIMITATED(cuCtxDestroy_v2)
UNIMITATED(cuCtxDetach)
UNIMITATED(cuCtxDisablePeerAccess)
UNIMITATED(cuCtxEnablePeerAccess)
UNIMITATED(cuCtxGetApiVersion)
UNIMITATED(cuCtxGetCacheConfig)
UNIMITATED(cuCtxGetDevice)
UNIMITATED(cuCtxGetExecAffinity)
UNIMITATED(cuCtxGetFlags)
UNIMITATED(cuCtxGetId)
UNIMITATED(cuCtxGetLimit)
UNIMITATED(cuCtxGetSharedMemConfig)
UNIMITATED(cuCtxGetStreamPriorityRange)
UNIMITATED(cuCtxResetPersistingL2Cache)
UNIMITATED(cuCtxSetCacheConfig)
UNIMITATED(cuCtxSetLimit)
UNIMITATED(cuCtxSetSharedMemConfig)
UNIMITATED(cuDestroyExternalMemory)
UNIMITATED(cuDestroyExternalSemaphore)
UNIMITATED(cuDeviceCanAccessPeer)
UNIMITATED(cuDeviceComputeCapability)
UNIMITATED(cuDeviceGetByPCIBusId)
UNIMITATED(cuDeviceGetExecAffinitySupport)
UNIMITATED(cuDeviceGetGraphMemAttribute)
UNIMITATED(cuDeviceGetLuid)
UNIMITATED(cuDeviceGetMemPool)
UNIMITATED(cuDeviceGetP2PAttribute)
UNIMITATED(cuDeviceGetProperties)
UNIMITATED(cuDeviceGetTexture1DLinearMaxWidth)
UNIMITATED(cuDeviceGraphMemTrim)
UNIMITATED(cuDevicePrimaryCtxGetState)
UNIMITATED(cuDevicePrimaryCtxReset_v2)
UNIMITATED(cuDevicePrimaryCtxSetFlags_v2)
UNIMITATED(cuDeviceSetGraphMemAttribute)
UNIMITATED(cuDeviceSetMemPool)
UNIMITATED(cuEventElapsedTime)
UNIMITATED(cuEventRecordWithFlags)
UNIMITATED(cuExternalMemoryGetMappedBuffer)
UNIMITATED(cuExternalMemoryGetMappedMipmappedArray)
UNIMITATED(cuFlushGPUDirectRDMAWrites)
UNIMITATED(cuFuncGetAttribute)
UNIMITATED(cuFuncGetModule)
UNIMITATED(cuFuncSetAttribute)
UNIMITATED(cuFuncSetBlockShape)
UNIMITATED(cuFuncSetCacheConfig)
UNIMITATED(cuFuncSetSharedMemConfig)
UNIMITATED(cuFuncSetSharedSize)
UNIMITATED(cuGetExportTable)
UNIMITATED(cuGetProcAddress_v2)
UNIMITATED(cuGraphAddBatchMemOpNode)
UNIMITATED(cuGraphAddChildGraphNode)
UNIMITATED(cuGraphAddDependencies)
UNIMITATED(cuGraphAddEmptyNode)
UNIMITATED(cuGraphAddEventRecordNode)
UNIMITATED(cuGraphAddEventWaitNode)
UNIMITATED(cuGraphAddExternalSemaphoresSignalNode)
UNIMITATED(cuGraphAddExternalSemaphoresWaitNode)
UNIMITATED(cuGraphAddHostNode)
UNIMITATED(cuGraphAddKernelNode_v2)
UNIMITATED(cuGraphAddMemAllocNode)
UNIMITATED(cuGraphAddMemFreeNode)
UNIMITATED(cuGraphAddMemcpyNode)
UNIMITATED(cuGraphAddMemsetNode)
UNIMITATED(cuGraphBatchMemOpNodeGetParams)
UNIMITATED(cuGraphBatchMemOpNodeSetParams)
UNIMITATED(cuGraphChildGraphNodeGetGraph)
UNIMITATED(cuGraphClone)
UNIMITATED(cuGraphCreate)
UNIMITATED(cuGraphDebugDotPrint)
UNIMITATED(cuGraphDestroyNode)
UNIMITATED(cuGraphEventRecordNodeGetEvent)
UNIMITATED(cuGraphEventRecordNodeSetEvent)
UNIMITATED(cuGraphEventWaitNodeGetEvent)
UNIMITATED(cuGraphEventWaitNodeSetEvent)
UNIMITATED(cuGraphExecBatchMemOpNodeSetParams)
UNIMITATED(cuGraphExecChildGraphNodeSetParams)
UNIMITATED(cuGraphExecEventRecordNodeSetEvent)
UNIMITATED(cuGraphExecEventWaitNodeSetEvent)
UNIMITATED(cuGraphExecExternalSemaphoresSignalNodeSetParams)
UNIMITATED(cuGraphExecExternalSemaphoresWaitNodeSetParams)
UNIMITATED(cuGraphExecGetFlags)
UNIMITATED(cuGraphExecHostNodeSetParams)
UNIMITATED(cuGraphExecKernelNodeSetParams_v2)
UNIMITATED(cuGraphExecMemcpyNodeSetParams)
UNIMITATED(cuGraphExecMemsetNodeSetParams)
UNIMITATED(cuGraphExecUpdate_v2)
UNIMITATED(cuGraphExternalSemaphoresSignalNodeGetParams)
UNIMITATED(cuGraphExternalSemaphoresSignalNodeSetParams)
UNIMITATED(cuGraphExternalSemaphoresWaitNodeGetParams)
UNIMITATED(cuGraphExternalSemaphoresWaitNodeSetParams)
UNIMITATED(cuGraphGetEdges)
UNIMITATED(cuGraphGetRootNodes)
UNIMITATED(cuGraphHostNodeGetParams)
UNIMITATED(cuGraphHostNodeSetParams)
UNIMITATED(cuGraphInstantiateWithParams)
UNIMITATED(cuGraphKernelNodeCopyAttributes)
UNIMITATED(cuGraphKernelNodeGetAttribute)
UNIMITATED(cuGraphKernelNodeGetParams_v2)
UNIMITATED(cuGraphKernelNodeSetAttribute)
UNIMITATED(cuGraphKernelNodeSetParams_v2)
UNIMITATED(cuGraphMemFreeNodeGetParams)
UNIMITATED(cuGraphMemcpyNodeGetParams)
UNIMITATED(cuGraphMemcpyNodeSetParams)
UNIMITATED(cuGraphMemsetNodeGetParams)
UNIMITATED(cuGraphMemsetNodeSetParams)
UNIMITATED(cuGraphNodeFindInClone)
UNIMITATED(cuGraphNodeGetDependencies)
UNIMITATED(cuGraphNodeGetDependentNodes)
UNIMITATED(cuGraphNodeGetEnabled)
UNIMITATED(cuGraphNodeSetEnabled)
UNIMITATED(cuGraphReleaseUserObject)
UNIMITATED(cuGraphRemoveDependencies)
UNIMITATED(cuGraphRetainUserObject)
UNIMITATED(cuGraphUpload)
UNIMITATED(cuGraphicsMapResources)
UNIMITATED(cuGraphicsResourceGetMappedMipmappedArray)
UNIMITATED(cuGraphicsResourceGetMappedPointer_v2)
UNIMITATED(cuGraphicsResourceSetMapFlags_v2)
UNIMITATED(cuGraphicsSubResourceGetMappedArray)
UNIMITATED(cuGraphicsUnmapResources)
UNIMITATED(cuGraphicsUnregisterResource)
UNIMITATED(cuImportExternalMemory)
UNIMITATED(cuImportExternalSemaphore)
UNIMITATED(cuIpcCloseMemHandle)
UNIMITATED(cuIpcGetEventHandle)
UNIMITATED(cuIpcGetMemHandle)
UNIMITATED(cuIpcOpenEventHandle)
UNIMITATED(cuIpcOpenMemHandle_v2)
UNIMITATED(cuKernelGetAttribute)
UNIMITATED(cuKernelGetFunction)
UNIMITATED(cuKernelSetAttribute)
UNIMITATED(cuKernelSetCacheConfig)
UNIMITATED(cuLaunch)
UNIMITATED(cuLaunchCooperativeKernel)
UNIMITATED(cuLaunchCooperativeKernelMultiDevice)
UNIMITATED(cuLaunchGrid)
UNIMITATED(cuLaunchGridAsync)
UNIMITATED(cuLaunchKernel)
UNIMITATED(cuLaunchKernelEx)
UNIMITATED(cuLibraryGetGlobal)
UNIMITATED(cuLibraryGetKernel)
UNIMITATED(cuLibraryGetManaged)
UNIMITATED(cuLibraryGetModule)
UNIMITATED(cuLibraryGetUnifiedFunction)
UNIMITATED(cuLibraryLoadData)
UNIMITATED(cuLibraryLoadFromFile)
UNIMITATED(cuLibraryUnload)
UNIMITATED(cuLinkAddData_v2)
UNIMITATED(cuLinkAddFile_v2)
UNIMITATED(cuLinkComplete)
UNIMITATED(cuLinkCreate_v2)
UNIMITATED(cuLinkDestroy)
UNIMITATED(cuMemAdvise)
UNIMITATED(cuMemAllocHost_v2)
UNIMITATED(cuMemAllocManaged)
UNIMITATED(cuMemAllocPitch_v2)
UNIMITATED(cuMemAlloc_v2)
UNIMITATED(cuMemExportToShareableHandle)
UNIMITATED(cuMemFree_v2)
UNIMITATED(cuMemGetAccess)
UNIMITATED(cuMemGetAddressRange_v2)
UNIMITATED(cuMemGetAllocationPropertiesFromHandle)
UNIMITATED(cuMemGetHandleForAddressRange)
UNIMITATED(cuMemHostGetFlags)
UNIMITATED(cuMemHostRegister_v2)
UNIMITATED(cuMemHostUnregister)
UNIMITATED(cuMemImportFromShareableHandle)
UNIMITATED(cuMemMapArrayAsync)
UNIMITATED(cuMemPoolExportPointer)
UNIMITATED(cuMemPoolExportToShareableHandle)
UNIMITATED(cuMemPoolGetAccess)
UNIMITATED(cuMemPoolImportFromShareableHandle)
UNIMITATED(cuMemPoolImportPointer)
UNIMITATED(cuMemPoolSetAccess)
UNIMITATED(cuMemPrefetchAsync)
UNIMITATED(cuMemRangeGetAttribute)
UNIMITATED(cuMemRangeGetAttributes)
UNIMITATED(cuMemRetainAllocationHandle)
UNIMITATED(cuMemcpy)
UNIMITATED(cuMemcpy2DAsync_v2)
UNIMITATED(cuMemcpy2DUnaligned_v2)
UNIMITATED(cuMemcpy2D_v2)
UNIMITATED(cuMemcpy3DAsync_v2)
UNIMITATED(cuMemcpy3DPeer)
UNIMITATED(cuMemcpy3DPeerAsync)
UNIMITATED(cuMemcpy3D_v2)
UNIMITATED(cuMemcpyAsync)
UNIMITATED(cuMemcpyAtoA_v2)
UNIMITATED(cuMemcpyAtoD_v2)
UNIMITATED(cuMemcpyAtoHAsync_v2)
UNIMITATED(cuMemcpyAtoH_v2)
UNIMITATED(cuMemcpyDtoA_v2)
UNIMITATED(cuMemcpyDtoDAsync_v2)
UNIMITATED(cuMemcpyDtoD_v2)
UNIMITATED(cuMemcpyDtoH_v2)
UNIMITATED(cuMemcpyHtoAAsync_v2)
UNIMITATED(cuMemcpyHtoA_v2)
UNIMITATED(cuMemcpyHtoD_v2)
UNIMITATED(cuMemcpyPeer)
UNIMITATED(cuMemcpyPeerAsync)
UNIMITATED(cuMemsetD16Async)
UNIMITATED(cuMemsetD16_v2)
UNIMITATED(cuMemsetD2D16Async)
UNIMITATED(cuMemsetD2D16_v2)
UNIMITATED(cuMemsetD2D32Async)
UNIMITATED(cuMemsetD2D32_v2)
UNIMITATED(cuMemsetD2D8Async)
UNIMITATED(cuMemsetD2D8_v2)
UNIMITATED(cuMemsetD32Async)
UNIMITATED(cuMemsetD32_v2)
UNIMITATED(cuMemsetD8Async)
UNIMITATED(cuMemsetD8_v2)
UNIMITATED(cuMipmappedArrayCreate)
UNIMITATED(cuMipmappedArrayDestroy)
UNIMITATED(cuMipmappedArrayGetLevel)
UNIMITATED(cuMipmappedArrayGetMemoryRequirements)
UNIMITATED(cuMipmappedArrayGetSparseProperties)
UNIMITATED(cuModuleGetFunction)
UNIMITATED(cuModuleGetGlobal_v2)
UNIMITATED(cuModuleGetLoadingMode)
UNIMITATED(cuModuleGetSurfRef)
UNIMITATED(cuModuleGetTexRef)
UNIMITATED(cuModuleLoad)
UNIMITATED(cuModuleLoadData)
UNIMITATED(cuModuleLoadDataEx)
UNIMITATED(cuModuleLoadFatBinary)
UNIMITATED(cuModuleUnload)
UNIMITATED(cuOccupancyAvailableDynamicSMemPerBlock)
UNIMITATED(cuOccupancyMaxActiveBlocksPerMultiprocessor)
UNIMITATED(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)
UNIMITATED(cuOccupancyMaxActiveClusters)
UNIMITATED(cuOccupancyMaxPotentialBlockSize)
UNIMITATED(cuOccupancyMaxPotentialBlockSizeWithFlags)
UNIMITATED(cuOccupancyMaxPotentialClusterSize)
UNIMITATED(cuParamSetSize)
UNIMITATED(cuParamSetTexRef)
UNIMITATED(cuParamSetf)
UNIMITATED(cuParamSeti)
UNIMITATED(cuParamSetv)
UNIMITATED(cuPointerGetAttribute)
UNIMITATED(cuPointerGetAttributes)
UNIMITATED(cuPointerSetAttribute)
UNIMITATED(cuProfilerInitialize)
UNIMITATED(cuProfilerStart)
UNIMITATED(cuProfilerStop)
UNIMITATED(cuSignalExternalSemaphoresAsync)
UNIMITATED(cuStreamAddCallback)
UNIMITATED(cuStreamAttachMemAsync)
UNIMITATED(cuStreamBatchMemOp_v2)
UNIMITATED(cuStreamCopyAttributes)
UNIMITATED(cuStreamCreateWithPriority)
UNIMITATED(cuStreamGetAttribute)
UNIMITATED(cuStreamGetCtx)
UNIMITATED(cuStreamGetFlags)
UNIMITATED(cuStreamGetId)
UNIMITATED(cuStreamGetPriority)
UNIMITATED(cuStreamSetAttribute)
UNIMITATED(cuStreamUpdateCaptureDependencies)
UNIMITATED(cuStreamWaitValue32_v2)
UNIMITATED(cuStreamWaitValue64_v2)
UNIMITATED(cuStreamWriteValue32_v2)
UNIMITATED(cuStreamWriteValue64_v2)
UNIMITATED(cuSurfObjectCreate)
UNIMITATED(cuSurfObjectDestroy)
UNIMITATED(cuSurfObjectGetResourceDesc)
UNIMITATED(cuSurfRefGetArray)
UNIMITATED(cuSurfRefSetArray)
UNIMITATED(cuTensorMapEncodeIm2col)
UNIMITATED(cuTensorMapEncodeTiled)
UNIMITATED(cuTensorMapReplaceAddress)
UNIMITATED(cuTexObjectCreate)
UNIMITATED(cuTexObjectDestroy)
UNIMITATED(cuTexObjectGetResourceDesc)
UNIMITATED(cuTexObjectGetResourceViewDesc)
UNIMITATED(cuTexObjectGetTextureDesc)
UNIMITATED(cuTexRefCreate)
UNIMITATED(cuTexRefDestroy)
UNIMITATED(cuTexRefGetAddressMode)
UNIMITATED(cuTexRefGetAddress_v2)
UNIMITATED(cuTexRefGetArray)
UNIMITATED(cuTexRefGetBorderColor)
UNIMITATED(cuTexRefGetFilterMode)
UNIMITATED(cuTexRefGetFlags)
UNIMITATED(cuTexRefGetFormat)
UNIMITATED(cuTexRefGetMaxAnisotropy)
UNIMITATED(cuTexRefGetMipmapFilterMode)
UNIMITATED(cuTexRefGetMipmapLevelBias)
UNIMITATED(cuTexRefGetMipmapLevelClamp)
UNIMITATED(cuTexRefGetMipmappedArray)
UNIMITATED(cuTexRefSetAddress2D_v3)
UNIMITATED(cuTexRefSetAddressMode)
UNIMITATED(cuTexRefSetAddress_v2)
UNIMITATED(cuTexRefSetArray)
UNIMITATED(cuTexRefSetBorderColor)
UNIMITATED(cuTexRefSetFilterMode)
UNIMITATED(cuTexRefSetFlags)
UNIMITATED(cuTexRefSetFormat)
UNIMITATED(cuTexRefSetMaxAnisotropy)
UNIMITATED(cuTexRefSetMipmapFilterMode)
UNIMITATED(cuTexRefSetMipmapLevelBias)
UNIMITATED(cuTexRefSetMipmapLevelClamp)
UNIMITATED(cuTexRefSetMipmappedArray)
UNIMITATED(cuThreadExchangeStreamCaptureMode)
UNIMITATED(cuUserObjectCreate)
UNIMITATED(cuUserObjectRelease)
UNIMITATED(cuUserObjectRetain)
UNIMITATED(cuWaitExternalSemaphoresAsync)

#endif /* MEMGOV_STANDIN_CUDA_PARTIAL */
