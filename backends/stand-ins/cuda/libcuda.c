/*
 * libcuda.c: a stand-in for the CUDA driver API (libcuda.so.1), enough of it
 * for memgov's CUDA backend, imitating the driver's rules on host threads.
 *
 * - Memory is host memory; a CUdeviceptr is the host address.
 * - Each stream is an ordered queue (common/standin.h) run on its own host
 *   thread: copies, frees and host functions run in stream order, each after
 *   MEMGOV_STANDIN_CUDA_LATENCY_US microseconds.
 * - Each thread has a current context (cuCtxSetCurrent / cuCtxGetCurrent);
 *   a call that needs one fails with CUDA_ERROR_INVALID_CONTEXT without it.
 * - Contract violations abort with "memgov libcuda stand-in: contract
 *   violation: ...": a call on a destroyed context or stream, a free or copy
 *   of an unknown or freed pointer, a copy out of bounds, the primary context
 *   released (last reference) while frees or host functions are pending or
 *   memory is still allocated, any driver call from inside a host function.
 * - Knobs: MEMGOV_STANDIN_CUDA_LATENCY_US, _OOM_AFTER_BYTES,
 *   _STICKY_ERROR_AT_OP (driver call N and all later fail with
 *   CUDA_ERROR_ILLEGAL_ADDRESS; queued work stops executing),
 *   _FAIL_HOST_FUNC_AT (the Nth cuLaunchHostFunc fails with
 *   CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES), _TOTAL_BYTES (device size,
 *   default 16 GiB), _DEVICES (device count, default 1).
 * - It says what it is: the device name starts with "memgov stand-in" (the
 *   backend reads it), and memgov_standin_cuda() returns a description.
 * - Every other entry point cudarc's loader requires is a stub in
 *   unimitated.c that aborts naming itself.
 */
#define _GNU_SOURCE
#include "standin.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *userData);

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED 115
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_STREAM_NON_BLOCKING 1u

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
};

struct CUctx_st {
    unsigned magic;
    int destroyed;
    CUdevice device;
    struct sq_mem *mem;
    pthread_mutex_t lock; /* guards streams and draining */
    struct CUstream_st *streams;
    /* Destroyed streams whose queued work may still be running: like the
     * driver, cuStreamDestroy returns at once. Joined at context release. */
    struct CUstream_st *draining;
};

typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;

#define MAX_DEVICES 8

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static struct sq_knobs g_knobs;
static uint64_t g_fail_host_func_at;
static uint64_t g_host_func_calls;
static uint64_t g_total_bytes = 16ull << 30;
static int g_devices = 1;
static struct {
    CUcontext primary; /* NULL when not retained */
    int refs;
    struct CUmemPoolHandle_st pool;
} g_dev[MAX_DEVICES];

static __thread CUcontext t_current;

static const char g_description[] =
    "memgov libcuda stand-in: CUDA driver API imitated on host threads (not a GPU)";

/* Exported marker, for tools that want to know without opening a device. */
const char *memgov_standin_cuda(void) { return g_description; }

/* ---- checks every entry point makes -------------------------------------- */

/* Entry of every driver call: no calls from host functions; count the call
 * for the sticky error knob. Returns nonzero when the device is sticky. */
static int enter(const char *fn) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("%s called from inside a host function (the driver forbids CUDA calls there)", fn);
    if (!g_initialized) return 0;
    return sq_knobs_tick(&g_knobs);
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
    CUcontext c = t_current;
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
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
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

CUresult cuInit(unsigned int flags) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN) sq_die("cuInit called from inside a host function");
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        sq_set_name("libcuda stand-in");
        sq_knobs_load(&g_knobs, "MEMGOV_STANDIN_CUDA");
        g_fail_host_func_at = sq_env_u64("MEMGOV_STANDIN_CUDA_FAIL_HOST_FUNC_AT", 0);
        g_total_bytes = sq_env_u64("MEMGOV_STANDIN_CUDA_TOTAL_BYTES", 16ull << 30);
        uint64_t n = sq_env_u64("MEMGOV_STANDIN_CUDA_DEVICES", 1);
        g_devices = n > MAX_DEVICES ? MAX_DEVICES : (int)n;
        for (int i = 0; i < MAX_DEVICES; i++)
            g_dev[i].pool = (struct CUmemPoolHandle_st){.magic = POOL_MAGIC, .device = i};
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
    uint64_t live = sq_mem_live_count(c->mem);
    if (live != 0 && !sticky)
        sq_die("primary context of device %d released (last reference) with %llu allocations "
               "(%llu bytes) still allocated",
               c->device, (unsigned long long)live, (unsigned long long)sq_mem_live_bytes(c->mem));
    CUstream lists[2] = {c->streams, c->draining};
    c->streams = NULL;
    c->draining = NULL;
    pthread_mutex_unlock(&c->lock);
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
    c->destroyed = 1; /* kept, likewise; its memory table leaks if sticky */
    if (!sticky) sq_mem_destroy(c->mem);
    c->mem = NULL;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    int sticky = enter("cuDevicePrimaryCtxRelease_v2");
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (g_dev[dev].refs == 0) sq_die("cuDevicePrimaryCtxRelease_v2 of device %d, which is not retained", dev);
    CUcontext c = NULL;
    if (--g_dev[dev].refs == 0) {
        c = g_dev[dev].primary;
        g_dev[dev].primary = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    /* Releasing succeeds even on a device in the sticky error state: it is
     * how a program lets go of a broken context. */
    if (c != NULL) destroy_context(c, sticky);
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (enter("cuCtxSetCurrent")) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx != NULL) check_ctx_handle(ctx, "cuCtxSetCurrent");
    t_current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (enter("cuCtxGetCurrent")) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_current; /* a destroyed current context is returned as is */
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
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
    pthread_mutex_unlock(&c->lock);
    for (size_t i = 0; i < n; i++) sq_queue_wait(qs[i], last[i]);
    free(qs);
    free(last);
    return sq_knobs_sticky() ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER("cuMemGetInfo_v2");
    CUcontext c = current("cuMemGetInfo_v2");
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (free_bytes == NULL || total == NULL) return CUDA_ERROR_INVALID_VALUE;
    uint64_t cap = g_total_bytes;
    if (g_knobs.oom_after_bytes != 0 && g_knobs.oom_after_bytes < cap) cap = g_knobs.oom_after_bytes;
    uint64_t used = sq_mem_live_bytes(c->mem);
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
    for (CUstream *p = &c->draining; *p != NULL;) {
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
    sq_queue_sync(hStream->q);
    return sq_knobs_sticky() ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream hStream) {
    ENTER("cuStreamQuery");
    CUresult r = check_stream(hStream, "cuStreamQuery");
    if (r != CUDA_SUCCESS) return r;
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

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ENTER("cuMemAllocAsync");
    CUresult r = check_stream(hStream, "cuMemAllocAsync");
    if (r != CUDA_SUCCESS) return r;
    if (dptr == NULL || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = sq_mem_alloc(hStream->ctx->mem, bytesize);
    if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = p;
    return CUDA_SUCCESS;
}

struct free_op {
    struct sq_mem *mem;
    uint64_t base;
};

static void run_free(void *arg) {
    struct free_op *op = arg;
    /* On a device in the sticky error state queued work no longer runs; the
     * memory goes when the context is released. */
    if (!sq_knobs_sticky()) sq_mem_finish_free(op->mem, op->base);
    free(op);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    ENTER("cuMemFreeAsync");
    CUresult r = check_stream(hStream, "cuMemFreeAsync");
    if (r != CUDA_SUCCESS) return r;
    enum sq_mem_check c = sq_mem_begin_free(hStream->ctx->mem, dptr);
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
    enum sq_mem_check c = sq_mem_check(hStream->ctx->mem, dev, bytes);
    if (c != SQ_MEM_OK)
        sq_die("%s of %zu bytes at %s device pointer 0x%llx", fn, bytes, check_name(c),
               (unsigned long long)dev);
    sq_queue_copy(hStream->q, dst, src, bytes);
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

/* ---- host functions ------------------------------------------------------------ */

struct host_fn_op {
    CUhostFn fn;
    void *user;
};

static void run_host_fn(void *arg) {
    struct host_fn_op *op = arg;
    if (!sq_knobs_sticky()) op->fn(op->user);
    free(op);
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    ENTER("cuLaunchHostFunc");
    CUresult r = check_stream(hStream, "cuLaunchHostFunc");
    if (r != CUDA_SUCCESS) return r;
    if (fn == NULL) return CUDA_ERROR_INVALID_VALUE;
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
