/*
 * libamdhip64.c: a stand-in for ROCm's HIP runtime (libamdhip64.so.5), enough
 * of it for memgov's HIP backend, imitating the runtime's rules on host
 * threads. Where ROCm's <hip/hip_runtime_api.h> is installed, the prototypes
 * come from it, so the compiler checks every signature against the real API.
 *
 * - Memory is host memory; a device pointer is the host address.
 * - Each stream is an ordered queue (common/standin.h) on its own host
 *   thread: copies, frees, event records and stream callbacks run in stream
 *   order, each after MEMGOV_STANDIN_HIP_LATENCY_US microseconds. Callbacks
 *   run on that driver thread, never on the caller's.
 * - The current device is per host thread (hipSetDevice), as in HIP.
 * - The default memory pool keeps what hipFreeAsync returned (it shows as
 *   used in hipMemGetInfo) until hipMemPoolTrimTo, like ROCm's pool.
 * - Page-locked host memory (hipHostMalloc / hipHostFree) is one table for
 *   the process, outside every device's memory and its OOM knob. Its device
 *   pointer (hipHostGetDevicePointer) differs from its host pointer, as the
 *   HIP documentation allows: the host address with bit 62 set. A copy whose
 *   pointers do not match its hipMemcpyKind (a host pointer where the kind
 *   says device, or a device pointer, or the device's view of page-locked
 *   memory, where it says host) is a contract violation, as HIP documents it
 *   as undefined; this holds for hipMemcpyHtoDAsync, hipMemcpyDtoHAsync and
 *   every kind of hipMemcpyAsync (hipMemcpyDefault tells each side's kind
 *   from its address). Copies through it are checked and ordered
 *   like device memory, and, as the HIP documentation requires, hipHostFree
 *   (synchronous) while a queued copy that uses the memory has not
 *   completed is a contract violation.
 * - Events and stream waits are common/'s (sq_event): hipStreamWaitEvent
 *   orders a stream after the work an event captured, and the stand-in
 *   tracks, per stream-ordered allocation, the stream and position of the
 *   last operation that touched it.
 * - Contract violations abort with "memgov libamdhip64 stand-in: contract
 *   violation: ...": a call on a destroyed stream, event or pool; a free of
 *   an unknown or already freed pointer; a page-locked host free while a
 *   copy using it is still queued; a copy of one, of another device's
 *   memory, or out of bounds; a stream-ordered free or copy on a stream not
 *   ordered after the last operation that touched the allocation on another
 *   stream ("missing stream ordering"); a stream destroyed with work still
 *   queued; hipDeviceReset with memory or streams still live; any HIP call
 *   from inside a stream callback; after memgov_standin_hip_quiesce(), any
 *   HIP call in flight on, or made from, another thread; and, with
 *   MEMGOV_STANDIN_HIP_EXIT_CHECK=1, when the process exits: memory, streams
 *   or created pools still live (skipped once the device is in the sticky
 *   error state: a dead device keeps what it had), or the default pool's
 *   release threshold not what the process found.
 * - Knobs: MEMGOV_STANDIN_HIP_LATENCY_US, _OOM_AFTER_BYTES (hipMallocAsync /
 *   hipMalloc return hipErrorOutOfMemory beyond it), _STICKY_ERROR_AT_OP
 *   (HIP call N and every later one fail with hipErrorIllegalAddress; queued
 *   work stops executing and callbacks receive that status), _NO_MEMPOOL=1
 *   (no stream-ordered allocator: the pool attribute reads 0 and the pool
 *   calls return hipErrorNotSupported; =2: the attribute reads 1 and the
 *   default pool exists, but hipMallocAsync / hipFreeAsync still return
 *   hipErrorNotSupported), _DROP_CALLBACKS=1 (in the sticky error state,
 *   queued callbacks are dropped without running, as a runtime may do on a
 *   lost device), _FAIL_CALLBACK_AT (the Nth
 *   hipStreamAddCallback returns hipErrorNotSupported), _TOTAL_BYTES (device
 *   size, default 16 GiB), _DEVICES (device count, default 1; 0 makes
 *   hipGetDeviceCount return hipErrorNoDevice).
 * - It says what it is: the device name starts with "memgov stand-in", and
 *   the exported function memgov_standin_hip() returns a description.
 * - Every code it returns is one ROCm's header lists.
 *
 * This one file is the whole stand-in: the exported entry points, which
 * decode HIP's arguments and structs and call the imitations in common/
 * (standin.c, linked in; sq_vmm.c and sq_graph.c, compiled here by the
 * #include in their sections) through tables of HIP's names and codes.
 * Its prototypes come from ROCm's own header (build.conf requires it), so
 * the compiler checks every definition against the real API. It has three
 * sections, each its own translation unit:
 * - the runtime: devices, streams, events, memory and copies (the
 *   runtime's rules on host threads), compiled when neither selector below
 *   is defined;
 * - virtual memory management (the HIP_VMM table), compiled with
 *   MEMGOV_STANDIN_HIP_SECTION_VMM defined, by vmm.c;
 * - stream capture and graphs (the HIP_GRAPH table), compiled with
 *   MEMGOV_STANDIN_HIP_SECTION_GRAPHS defined, by graph.c.
 * vmm.c and graph.c hold nothing but their selector and this file's
 * #include: a build that leaves one out (the HIP tests' partial stand-ins,
 * passes_on_partial_stand_in: a ROCm lacking the virtual memory or the
 * graph calls) lacks those entry points, and the runtime section reaches
 * their hooks through weak references that are NULL there.
 */
#define _GNU_SOURCE
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

#include "sq_graph.h"
#include "sq_vmm.h"
#include "standin.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- what the sections share -------------------------------------------------
 *
 * Internal to the library (the version script exports none of them). The
 * hooks of the virtual memory and graph sections are weak, so that the
 * runtime section also links without them; its callers test them for NULL
 * first. */
#pragma GCC visibility push(hidden)

/* the runtime section: the entry of every HIP call (counted in
 * memgov_standin_hip_calls, none from a stream callback, the sticky error
 * knob ticked; returns 1 when the device is sticky) and its exit. */
int hip_standin_enter(const char *fn);
void hip_standin_leave(void);

/* The virtual memory and graph sections: declare the HIP call `fn` in flight until the
 * enclosing function returns (hip_standin_enter, hip_standin_leave); a
 * sticky device answers hipErrorIllegalAddress. */
static inline void hip_standin_leave_scope(int *unused) {
    (void)unused;
    hip_standin_leave();
}
#define HIP_STANDIN_CALL(fn)                                                        \
    __attribute__((cleanup(hip_standin_leave_scope))) int in_call_ = 0;             \
    (void)in_call_;                                                                 \
    if (hip_standin_enter(fn)) return hipErrorIllegalAddress
/* The runtime section: the number of devices, the calling thread's current one,
 * and the bytes of device memory the stand-in may hand out. */
int hip_standin_devices(void);
int hip_standin_current_device(void);
uint64_t hip_standin_capacity(void);

/* The virtual memory section: an asynchronous copy of `bytes` from `src` to `dst` about to be
 * queued on q, whose device side(s) are dst (dst_device) and/or src
 * (src_device). Returns 0 when no device side lies in a virtual address
 * reservation (hipMemAddressReserve): the caller checks and queues it as
 * usual. Else every device side is checked as a device access by `fn`
 * (each byte mapped, with read-write access set, else a contract
 * violation), the copy is queued, and the mappings it touches remember
 * that q's work up to it uses them (hipMemUnmap's check); all under the
 * table's lock, so that no unmap comes in between. Returns 1. */
int vmm_copy(const char *fn, int dst_device, int src_device, void *dst, const void *src,
             size_t bytes, struct sq_queue *q) __attribute__((weak));
/* The virtual memory section: 1 when this call of `fn` is the one the MEMGOV_STANDIN_HIP_
 * FAIL_ENTRY knob says fails (counted per process). */
int hip_standin_entry_fault(const char *fn) __attribute__((weak));
/* The virtual memory section: physical memory of live allocation handles (hipMemCreate), bytes. */
uint64_t vmm_physical_bytes(void) __attribute__((weak));

#pragma GCC visibility pop

#pragma GCC visibility push(hidden)

/* The graph section: whether `stream` is in a capture sequence (active or
 * invalidated). */
int graph_capturing(const void *stream) __attribute__((weak));
/* The graph section: record a copy into the capture of `stream` instead of queueing
 * it (the arguments as copy_async takes them). Returns the call's result. */
int graph_record_copy(const char *fn, const void *stream, int dst_device, int src_device,
                      void *dst, const void *src, size_t bytes) __attribute__((weak));
/* The graph section: record a stream callback into the capture of `stream`. */
int graph_record_callback(const void *stream, void *fn, void *user) __attribute__((weak));
/* The graph section: `fn` on a capturing stream necessarily conflicts with capture
 * (hipStreamSynchronize, hipStreamQuery): the capture is invalidated and
 * the call returns hipErrorStreamCaptureUnsupported. */
int graph_conflicting(const char *fn, const void *stream) __attribute__((weak));
/* The graph section: a potentially unsafe call (one that changes memory outside any
 * stream, as hipMalloc) is about to run on the calling thread. Returns 0
 * when the capture modes allow it, else invalidates the captures that
 * prohibit it and returns hipErrorStreamCaptureUnsupported. `alloc` counts
 * it as a runtime allocation made while a capture was under way. */
int graph_unsafe(const char *fn, int alloc) __attribute__((weak));

/* The runtime section: queue a recorded copy on `stream` with every check a copy
 * makes (a copy touching freed or unmapped memory aborts). */
int hip_standin_copy(const char *fn, const void *stream, int dst_device, int src_device,
                     void *dst, const void *src, size_t bytes);
/* The runtime section: queue a recorded stream callback on `stream`. */
int hip_standin_callback(const void *stream, void *fn, void *user);
/* The runtime section: a stream argument is live (else a contract violation). */
void hip_standin_check_stream(const void *stream, const char *fn);

#pragma GCC visibility pop

#if !defined(MEMGOV_STANDIN_HIP_SECTION_VMM) && !defined(MEMGOV_STANDIN_HIP_SECTION_GRAPHS)

/* ---- the runtime ------------------------------------------------------------------ */

#define STREAM_MAGIC 0x48535452u /* "HSTR" */
#define POOL_MAGIC 0x48504f4cu   /* "HPOL" */
#define MAX_DEVICES 8

/* The handle types are opaque in the header; the stand-in defines them. */
struct ihipStream_t {
    unsigned magic;
    int destroyed;
    int device;
    struct sq_queue *q;
};

/* A memory pool: the device's default one, or one hipMemPoolCreate made
 * (never freed, so that a use after hipMemPoolDestroy is caught). */
struct ihipMemPoolHandle_t {
    unsigned magic;
    int device;
    int destroyed;
    uint64_t release_threshold;
    uint64_t reserve; /* bytes freed into the pool, not yet trimmed (dev->lock) */
    struct ihipMemPoolHandle_t *next; /* the device's created pools */
};

struct device {
    struct sq_mem *mem;
    pthread_mutex_t lock; /* orders alloc/free against the pools' reserves */
    uint64_t streams;     /* live streams */
    uint64_t created_pools; /* created and not destroyed */
    struct ihipMemPoolHandle_t pool;
    struct ihipMemPoolHandle_t *created;
    uint64_t default_threshold_at_start;
};

/* Which pool a stream-ordered allocation came from (dev->lock). */
struct pool_alloc {
    uint64_t base;
    struct ihipMemPoolHandle_t *pool;
};

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct sq_knobs g_knobs;
static uint64_t g_total_bytes;
static int g_devices;
static int g_no_mempool;
static uint64_t g_fail_callback_at;
static uint64_t g_callbacks;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct device g_dev[MAX_DEVICES];
static __thread int t_device;
static int g_drop_callbacks;

/* memgov_standin_hip_quiesce: HIP calls in flight per thread, and the one
 * thread allowed to call once quiesced. */
static __thread int t_in_call;
static uint64_t g_in_flight; /* g_lock */
static int g_quiesced;       /* g_lock */
static uint64_t g_calls;     /* g_lock: HIP calls made (memgov_standin_hip_calls) */
static pthread_t g_quiesced_by;

/* Page-locked host allocations (hipHostMalloc): not any device's memory. */
static struct sq_mem *g_host_mem;

/* The device's view of mapped page-locked host memory: its host address with
 * this bit set, a non-canonical x86-64 address that is never a real one, so
 * that a host pointer passed where the device's is due (or the reverse) is
 * told apart, as on a runtime whose device pointer of mapped memory differs
 * from the host pointer. */
#define HOST_DEVICE_VIEW (1ull << 62)

static int is_device_view(uint64_t addr) { return (addr & HOST_DEVICE_VIEW) != 0; }

static struct pool_alloc *g_pool_allocs; /* g_lock */
static size_t g_pool_allocs_n, g_pool_allocs_cap;

static const char g_description[] =
    "memgov libamdhip64 stand-in: HIP runtime imitated on host threads (not a GPU)";

/* Exported marker: what this library is. */
const char *memgov_standin_hip(void);
const char *memgov_standin_hip(void) { return g_description; }

/* Nothing may be left on device d at `when` (exit or reset). */
static void check_nothing_live(int d, const char *when) {
    uint64_t live = sq_mem_live_count(g_dev[d].mem);
    if (live != 0)
        sq_die("%s with %llu allocations (%llu bytes) still live on device %d (never freed)", when,
               (unsigned long long)live, (unsigned long long)sq_mem_live_bytes(g_dev[d].mem), d);
    pthread_mutex_lock(&g_lock);
    uint64_t streams = g_dev[d].streams;
    pthread_mutex_unlock(&g_lock);
    if (streams != 0)
        sq_die("%s with %llu streams of device %d never destroyed", when,
               (unsigned long long)streams, d);
}

static void at_exit_check(void) {
    for (int d = 0; d < g_devices; d++) {
        struct device *dev = &g_dev[d];
        if (dev->pool.release_threshold != dev->default_threshold_at_start)
            sq_die("process exits with the release threshold of device %d's default memory pool "
                   "at %llu; the process found it at %llu (memgov must not change it)",
                   d, (unsigned long long)dev->pool.release_threshold,
                   (unsigned long long)dev->default_threshold_at_start);
        if (sq_knobs_sticky()) continue; /* a dead device keeps what it had */
        check_nothing_live(d, "process exits");
        if (d == 0 && sq_mem_live_count(g_host_mem) != 0)
            sq_die("process exits with %llu page-locked host allocations (%llu bytes) never freed",
                   (unsigned long long)sq_mem_live_count(g_host_mem),
                   (unsigned long long)sq_mem_live_bytes(g_host_mem));
        pthread_mutex_lock(&g_lock);
        uint64_t pools = dev->created_pools;
        pthread_mutex_unlock(&g_lock);
        if (pools != 0)
            sq_die("process exits with %llu memory pools of device %d never destroyed",
                   (unsigned long long)pools, d);
    }
}

static void init(void) {
    sq_set_name("libamdhip64 stand-in");
    sq_knobs_load(&g_knobs, "MEMGOV_STANDIN_HIP");
    g_total_bytes = sq_env_u64("MEMGOV_STANDIN_HIP_TOTAL_BYTES", 16ull << 30);
    uint64_t n = sq_env_u64("MEMGOV_STANDIN_HIP_DEVICES", 1);
    g_devices = n > MAX_DEVICES ? MAX_DEVICES : (int)n;
    g_no_mempool = (int)sq_env_u64("MEMGOV_STANDIN_HIP_NO_MEMPOOL", 0);
    g_fail_callback_at = sq_env_u64("MEMGOV_STANDIN_HIP_FAIL_CALLBACK_AT", 0);
    g_drop_callbacks = sq_env_u64("MEMGOV_STANDIN_HIP_DROP_CALLBACKS", 0) != 0;
    int exit_check = sq_env_u64("MEMGOV_STANDIN_HIP_EXIT_CHECK", 0) != 0;
    g_host_mem = sq_mem_new(0);
    for (int i = 0; i < g_devices; i++) {
        g_dev[i].mem = sq_mem_new(g_knobs.oom_after_bytes);
        pthread_mutex_init(&g_dev[i].lock, NULL);
        g_dev[i].pool = (struct ihipMemPoolHandle_t){.magic = POOL_MAGIC, .device = i};
        g_dev[i].default_threshold_at_start = g_dev[i].pool.release_threshold;
    }
    if (exit_check) atexit(at_exit_check);
}

/* Entry of every HIP call: none from inside a callback, none from another
 * thread once quiesced; count the call in flight (left when the calling
 * function returns, see CALL) and for the sticky error knob. Returns nonzero
 * when the device is sticky. */
static int enter(const char *fn) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("%s called from inside a stream callback (HIP forbids HIP calls there)", fn);
    sq_entry_pause(fn);
    pthread_once(&g_once, init);
    pthread_mutex_lock(&g_lock);
    int late = g_quiesced && !pthread_equal(g_quiesced_by, pthread_self());
    if (t_in_call++ == 0) g_in_flight++;
    g_calls++;
    pthread_mutex_unlock(&g_lock);
    if (late)
        sq_die("%s called from another thread after memgov_standin_hip_quiesce() (a backend "
               "thread still calls HIP after teardown returned)",
               fn);
    return sq_knobs_tick(&g_knobs);
}

static void leave(int *unused) {
    (void)unused;
    pthread_mutex_lock(&g_lock);
    if (--t_in_call == 0) g_in_flight--;
    pthread_mutex_unlock(&g_lock);
}

/* Declares the call in flight until the enclosing function returns. */
#define CALL(fn) __attribute__((cleanup(leave))) int in_call_ = 0; int sticky_ = enter(fn); (void)in_call_

#define ENTER(fn)                                       \
    CALL(fn);                                           \
    do {                                                \
        if (sticky_) return hipErrorIllegalAddress;     \
    } while (0)

/* The graph section's hooks, where it is linked in. */
static int capturing(hipStream_t s) { return graph_capturing != NULL && graph_capturing(s); }
static hipError_t unsafe_during_capture(const char *fn, int alloc) {
    return graph_unsafe != NULL ? (hipError_t)graph_unsafe(fn, alloc) : hipSuccess;
}
static void not_during_capture(hipStream_t s, const char *fn) {
    if (capturing(s))
        sq_die("%s on capturing stream %p: stream-ordered allocation and free inside a capture "
               "(memory nodes) are not imitated by the stand-in libamdhip64",
               fn, (void *)s);
}

/* For the other sections: the same entry and exit as every call here. */
int hip_standin_enter(const char *fn) { return enter(fn); }
void hip_standin_leave(void) { leave(NULL); }
int hip_standin_devices(void) {
    pthread_once(&g_once, init);
    return g_devices;
}
int hip_standin_current_device(void) { return t_device; }

/* Test hook (tests find it with dlsym): HIP calls made so far, by every
 * thread, this one included. */
uint64_t memgov_standin_hip_calls(void);
uint64_t memgov_standin_hip_calls(void) {
    pthread_once(&g_once, init);
    pthread_mutex_lock(&g_lock);
    uint64_t n = g_calls;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Test hook (tests find it with dlsym): from now on, only the calling thread
 * may call HIP, and no other thread may be inside a HIP call now. A test
 * calls it after a teardown returned, with every context torn down: a
 * backend thread (a free thread) still calling HIP is caught here or at its next
 * call. */
void memgov_standin_hip_quiesce(void);
void memgov_standin_hip_quiesce(void) {
    pthread_once(&g_once, init);
    pthread_mutex_lock(&g_lock);
    uint64_t others = g_in_flight - (t_in_call != 0);
    g_quiesced = 1;
    g_quiesced_by = pthread_self();
    pthread_mutex_unlock(&g_lock);
    if (others != 0)
        sq_die("memgov_standin_hip_quiesce: %llu other threads are still inside a HIP call (a "
               "backend thread still calls HIP after teardown returned)",
               (unsigned long long)others);
}

static int valid_device(int d) { return d >= 0 && d < g_devices; }

static void check_stream(hipStream_t s, const char *fn) {
    if (s == NULL) sq_die("%s on the null stream: memgov's backend never uses it", fn);
    if (s->magic != STREAM_MAGIC) sq_die("%s: %p is not a stream", fn, (void *)s);
    if (s->destroyed) sq_die("%s on destroyed stream %p", fn, (void *)s);
}

static void check_pool(hipMemPool_t p, const char *fn) {
    if (p == NULL || p->magic != POOL_MAGIC) sq_die("%s: %p is not a memory pool", fn, (void *)p);
    if (p->destroyed) sq_die("%s on destroyed memory pool %p", fn, (void *)p);
}

/* ---- errors ---------------------------------------------------------------- */

struct code_name {
    hipError_t code;
    const char *name, *text;
};

static const struct code_name g_codes[] = {
    {hipSuccess, "hipSuccess", "no error"},
    {hipErrorInvalidValue, "hipErrorInvalidValue", "invalid argument"},
    {hipErrorOutOfMemory, "hipErrorOutOfMemory", "out of memory"},
    {hipErrorNoDevice, "hipErrorNoDevice", "no ROCm-capable device is detected"},
    {hipErrorInvalidDevice, "hipErrorInvalidDevice", "invalid device ordinal"},
    {hipErrorInvalidHandle, "hipErrorInvalidHandle", "invalid resource handle"},
    {hipErrorNotReady, "hipErrorNotReady", "device not ready"},
    {hipErrorIllegalAddress, "hipErrorIllegalAddress", "an illegal memory access was encountered"},
    {hipErrorNotSupported, "hipErrorNotSupported", "operation not supported"},
    {hipErrorIllegalState, "hipErrorIllegalState", "the operation cannot be performed in the present state"},
    {hipErrorStreamCaptureUnsupported, "hipErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {hipErrorStreamCaptureInvalidated, "hipErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {hipErrorStreamCaptureWrongThread, "hipErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
};

static const struct code_name *find_code(hipError_t e) {
    for (size_t i = 0; i < sizeof g_codes / sizeof g_codes[0]; i++)
        if (g_codes[i].code == e) return &g_codes[i];
    return NULL;
}

const char *hipGetErrorName(hipError_t e) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("hipGetErrorName called from inside a stream callback");
    const struct code_name *c = find_code(e);
    return c ? c->name : "hipErrorUnknown";
}

const char *hipGetErrorString(hipError_t e) {
    if (sq_current_op_flags() & SQ_OP_HOST_FN)
        sq_die("hipGetErrorString called from inside a stream callback");
    const struct code_name *c = find_code(e);
    return c ? c->text : "unknown error";
}

/* ---- devices ----------------------------------------------------------------- */

hipError_t hipInit(unsigned int flags) {
    ENTER("hipInit");
    return flags == 0 ? hipSuccess : hipErrorInvalidValue;
}

hipError_t hipDriverGetVersion(int *v) {
    ENTER("hipDriverGetVersion");
    if (v == NULL) return hipErrorInvalidValue;
    *v = 50223; /* the ROCm release it imitates: 5.2.3 */
    return hipSuccess;
}

hipError_t hipRuntimeGetVersion(int *v) {
    ENTER("hipRuntimeGetVersion");
    if (v == NULL) return hipErrorInvalidValue;
    *v = 50223;
    return hipSuccess;
}

hipError_t hipGetDeviceCount(int *count) {
    ENTER("hipGetDeviceCount");
    if (count == NULL) return hipErrorInvalidValue;
    *count = g_devices;
    return g_devices == 0 ? hipErrorNoDevice : hipSuccess;
}

hipError_t hipSetDevice(int d) {
    ENTER("hipSetDevice");
    if (!valid_device(d)) return hipErrorInvalidDevice;
    t_device = d;
    return hipSuccess;
}

hipError_t hipGetDevice(int *d) {
    ENTER("hipGetDevice");
    if (d == NULL) return hipErrorInvalidValue;
    /* FAIL_ENTRY (the virtual memory section, weak: absent from a runtime
     * built without it):
     * hipErrorInvalidDevice, one of the reference's codes; nothing read. */
    if (hip_standin_entry_fault != NULL && hip_standin_entry_fault("hipGetDevice"))
        return hipErrorInvalidDevice;
    *d = t_device;
    return hipSuccess;
}

/* Destroys every resource of the current device in real HIP: memgov never
 * calls it (other users of the device own theirs). The stand-in treats it
 * as the device's destruction and requires nothing to be left. */
hipError_t hipDeviceReset(void) {
    CALL("hipDeviceReset");
    if (!sticky_) check_nothing_live(t_device, "hipDeviceReset");
    return hipSuccess;
}

hipError_t hipDeviceGetName(char *name, int len, hipDevice_t d) {
    ENTER("hipDeviceGetName");
    if (name == NULL || len <= 0) return hipErrorInvalidValue;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    snprintf(name, (size_t)len, "memgov stand-in HIP device %d (libamdhip64.so.5 imitation)", d);
    return hipSuccess;
}

/* The device's UUID: the same in every process for one ordinal, distinct
 * between ordinals and from the CUDA stand-in's ("memgov-standin", 'h',
 * ordinal). */
hipError_t hipDeviceGetUuid(hipUUID *uuid, hipDevice_t d) {
    ENTER("hipDeviceGetUuid");
    if (uuid == NULL) return hipErrorInvalidValue;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    static const char stem[14] = {'m', 'e', 'm', 'g', 'o', 'v', '-', 's', 't', 'a', 'n', 'd', 'i', 'n'};
    memcpy(uuid->bytes, stem, sizeof stem);
    uuid->bytes[14] = 'h';
    uuid->bytes[15] = (char)d;
    return hipSuccess;
}

/* "domain:bus:device.function", hex, NUL-terminated within `len` bytes:
 * domain 0, bus 0x20 + ordinal. */
hipError_t hipDeviceGetPCIBusId(char *pciBusId, int len, int d) {
    ENTER("hipDeviceGetPCIBusId");
    if (pciBusId == NULL || len <= 0) return hipErrorInvalidValue;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x20 + d);
    return hipSuccess;
}

hipError_t hipDeviceTotalMem(size_t *bytes, hipDevice_t d) {
    ENTER("hipDeviceTotalMem");
    if (bytes == NULL) return hipErrorInvalidValue;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    *bytes = (size_t)g_total_bytes;
    return hipSuccess;
}

hipError_t hipDeviceGetAttribute(int *pi, hipDeviceAttribute_t attr, int d) {
    ENTER("hipDeviceGetAttribute");
    if (pi == NULL) return hipErrorInvalidValue;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    if (attr != hipDeviceAttributeMemoryPoolsSupported) return hipErrorInvalidValue;
    *pi = g_no_mempool == 1 ? 0 : 1;
    return hipSuccess;
}

static uint64_t cap_bytes(void) {
    uint64_t cap = g_total_bytes;
    if (g_knobs.oom_after_bytes != 0 && g_knobs.oom_after_bytes < cap) cap = g_knobs.oom_after_bytes;
    return cap;
}

uint64_t hip_standin_capacity(void) { return cap_bytes(); }

hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total) {
    ENTER("hipMemGetInfo");
    if (free_bytes == NULL || total == NULL) return hipErrorInvalidValue;
    struct device *dev = &g_dev[t_device];
    pthread_mutex_lock(&dev->lock);
    uint64_t used = sq_mem_live_bytes(dev->mem) + dev->pool.reserve;
    for (struct ihipMemPoolHandle_t *p = dev->created; p != NULL; p = p->next) used += p->reserve;
    pthread_mutex_unlock(&dev->lock);
    if (vmm_physical_bytes != NULL) used += vmm_physical_bytes();
    uint64_t cap = cap_bytes();
    *free_bytes = (size_t)(used > cap ? 0 : cap - used);
    *total = (size_t)g_total_bytes;
    return hipSuccess;
}

/* ---- streams ------------------------------------------------------------------- */

hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags) {
    ENTER("hipStreamCreateWithFlags");
    if (stream == NULL || (flags & ~(unsigned)hipStreamNonBlocking) != 0) return hipErrorInvalidValue;
    hipStream_t s = calloc(1, sizeof *s);
    if (s == NULL) sq_fatal("out of host memory");
    s->magic = STREAM_MAGIC;
    s->device = t_device;
    s->q = sq_queue_new(g_knobs.latency_us);
    pthread_mutex_lock(&g_lock);
    g_dev[s->device].streams++;
    pthread_mutex_unlock(&g_lock);
    *stream = s;
    return hipSuccess;
}

hipError_t hipStreamDestroy(hipStream_t s) {
    CALL("hipStreamDestroy");
    check_stream(s, "hipStreamDestroy");
    if (capturing(s))
        sq_die("hipStreamDestroy of stream %p while it is capturing: end the capture first "
               "(hipStreamEndCapture)",
               (void *)s);
    uint64_t pending = sq_queue_pending(s->q);
    if (pending != 0 && !sticky_)
        sq_die("hipStreamDestroy of stream %p with %llu operations (frees, copies or callbacks) "
               "still queued: synchronize it first",
               (void *)s, (unsigned long long)pending);
    s->destroyed = 1; /* the struct is kept so that later use is caught */
    pthread_mutex_lock(&g_lock);
    g_dev[s->device].streams--;
    pthread_mutex_unlock(&g_lock);
    sq_queue_destroy(s->q); /* on a sticky device queued work drains as no-ops */
    s->q = NULL;
    return hipSuccess;
}

hipError_t hipStreamSynchronize(hipStream_t s) {
    ENTER("hipStreamSynchronize");
    check_stream(s, "hipStreamSynchronize");
    if (capturing(s)) return (hipError_t)graph_conflicting("hipStreamSynchronize", s);
    sq_queue_sync(s->q);
    return sq_knobs_sticky() ? hipErrorIllegalAddress : hipSuccess;
}

hipError_t hipStreamQuery(hipStream_t s) {
    ENTER("hipStreamQuery");
    check_stream(s, "hipStreamQuery");
    if (capturing(s)) return (hipError_t)graph_conflicting("hipStreamQuery", s);
    return sq_queue_pending(s->q) == 0 ? hipSuccess : hipErrorNotReady;
}

struct callback_op {
    hipStream_t stream;
    hipStreamCallback_t fn;
    void *user;
};

static void run_callback(void *arg) {
    struct callback_op *op = arg;
    if (g_drop_callbacks && sq_knobs_sticky()) {
        free(op); /* dropped unrun, as a runtime may on a lost device */
        return;
    }
    /* On a sticky device the callback still runs, with the error as its
     * status, as HIP reports a failed stream to its callbacks. */
    op->fn(op->stream, sq_knobs_sticky() ? hipErrorIllegalAddress : hipSuccess, op->user);
    free(op);
}

hipError_t hipStreamAddCallback(hipStream_t s, hipStreamCallback_t fn, void *user, unsigned int flags) {
    ENTER("hipStreamAddCallback");
    check_stream(s, "hipStreamAddCallback");
    if (fn == NULL || flags != 0) return hipErrorInvalidValue;
    pthread_mutex_lock(&g_lock);
    uint64_t n = ++g_callbacks;
    pthread_mutex_unlock(&g_lock);
    if (g_fail_callback_at != 0 && n == g_fail_callback_at) return hipErrorNotSupported;
    if (capturing(s)) return (hipError_t)graph_record_callback(s, (void *)fn, user);
    return (hipError_t)hip_standin_callback(s, (void *)fn, user);
}

int hip_standin_callback(const void *stream, void *fn, void *user) {
    hipStream_t s = (hipStream_t)stream;
    struct callback_op *op = malloc(sizeof *op);
    if (op == NULL) sq_fatal("out of host memory");
    *op = (struct callback_op){.stream = s, .fn = (hipStreamCallback_t)fn, .user = user};
    sq_queue_push(s->q, run_callback, op, SQ_OP_HOST_FN);
    return hipSuccess;
}

void hip_standin_check_stream(const void *stream, const char *fn) {
    check_stream((hipStream_t)stream, fn);
}


/* ---- events -------------------------------------------------------------------- */

/* A hipEvent_t is common/'s sq_event (the header's struct is opaque). */
static struct sq_event *ev(hipEvent_t e) { return (struct sq_event *)(void *)e; }

hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned flags) {
    ENTER("hipEventCreateWithFlags");
    if (event == NULL) return hipErrorInvalidValue;
    (void)flags;
    *event = (hipEvent_t)(void *)sq_event_new();
    return hipSuccess;
}

hipError_t hipEventRecord(hipEvent_t e, hipStream_t s) {
    ENTER("hipEventRecord");
    sq_event_check(ev(e), "hipEventRecord");
    check_stream(s, "hipEventRecord");
    sq_event_record(ev(e), s->q);
    return hipSuccess;
}

hipError_t hipStreamWaitEvent(hipStream_t s, hipEvent_t e, unsigned int flags) {
    ENTER("hipStreamWaitEvent");
    check_stream(s, "hipStreamWaitEvent");
    sq_event_check(ev(e), "hipStreamWaitEvent");
    if (flags != 0) return hipErrorInvalidValue;
    sq_queue_wait_event(s->q, ev(e));
    return hipSuccess;
}

hipError_t hipEventSynchronize(hipEvent_t e) {
    ENTER("hipEventSynchronize");
    sq_event_check(ev(e), "hipEventSynchronize");
    sq_event_sync(ev(e));
    return sq_knobs_sticky() ? hipErrorIllegalAddress : hipSuccess;
}

hipError_t hipEventQuery(hipEvent_t e) {
    ENTER("hipEventQuery");
    sq_event_check(ev(e), "hipEventQuery");
    return sq_event_done(ev(e)) ? hipSuccess : hipErrorNotReady;
}

hipError_t hipEventDestroy(hipEvent_t e) {
    ENTER("hipEventDestroy");
    sq_event_check(ev(e), "hipEventDestroy");
    sq_event_destroy(ev(e));
    return hipSuccess;
}

/* ---- memory --------------------------------------------------------------------- */

/* Allocate on device d: from `pool` (stream-ordered on queue q, reusing
 * what the pool kept, as ROCm's pool does) or, with pool == NULL, plain. */
static uint64_t alloc_on(int d, size_t bytes, struct ihipMemPoolHandle_t *pool, struct sq_queue *q) {
    struct device *dev = &g_dev[d];
    pthread_mutex_lock(&dev->lock);
    uint64_t p = pool ? sq_mem_alloc_on(dev->mem, bytes, q) : sq_mem_alloc(dev->mem, bytes);
    if (p != 0 && pool) {
        uint64_t take = pool->reserve < bytes ? pool->reserve : bytes;
        pool->reserve -= take;
        if (g_pool_allocs_n == g_pool_allocs_cap) {
            g_pool_allocs_cap = g_pool_allocs_cap ? 2 * g_pool_allocs_cap : 64;
            g_pool_allocs = realloc(g_pool_allocs, g_pool_allocs_cap * sizeof *g_pool_allocs);
            if (g_pool_allocs == NULL) sq_fatal("out of host memory");
        }
        g_pool_allocs[g_pool_allocs_n++] = (struct pool_alloc){.base = p, .pool = pool};
    }
    pthread_mutex_unlock(&dev->lock);
    return p;
}

/* The pool `base` came from, forgotten (NULL for plain memory); dev->lock. */
static struct ihipMemPoolHandle_t *take_pool_of(uint64_t base) {
    for (size_t i = 0; i < g_pool_allocs_n; i++) {
        if (g_pool_allocs[i].base == base) {
            struct ihipMemPoolHandle_t *p = g_pool_allocs[i].pool;
            g_pool_allocs[i] = g_pool_allocs[--g_pool_allocs_n];
            return p;
        }
    }
    return NULL;
}

/* Release a marked allocation, into its pool's reserve when it came from a
 * pool that still exists. */
static void finish_free_on(int d, uint64_t base) {
    struct device *dev = &g_dev[d];
    pthread_mutex_lock(&dev->lock);
    uint64_t before = sq_mem_live_bytes(dev->mem);
    sq_mem_finish_free(dev->mem, base);
    struct ihipMemPoolHandle_t *pool = take_pool_of(base);
    if (pool != NULL && !pool->destroyed) pool->reserve += before - sq_mem_live_bytes(dev->mem);
    pthread_mutex_unlock(&dev->lock);
}

hipError_t hipMalloc(void **ptr, size_t size) {
    ENTER("hipMalloc");
    if (ptr == NULL) return hipErrorInvalidValue;
    hipError_t u = unsafe_during_capture("hipMalloc", 1);
    if (u != hipSuccess) return u;
    if (size == 0) {
        *ptr = NULL;
        return hipSuccess;
    }
    uint64_t p = alloc_on(t_device, size, NULL, NULL);
    if (p == 0) return hipErrorOutOfMemory;
    *ptr = (void *)(uintptr_t)p;
    return hipSuccess;
}

hipError_t hipFree(void *ptr) {
    ENTER("hipFree");
    if (ptr == NULL) return hipSuccess;
    hipError_t u = unsafe_during_capture("hipFree", 0);
    if (u != hipSuccess) return u;
    uint64_t base = (uint64_t)(uintptr_t)ptr;
    /* The pointer may belong to any device; find the one that knows it. */
    for (int d = 0; d < g_devices; d++) {
        enum sq_mem_check c = sq_mem_begin_free(g_dev[d].mem, base);
        if (c == SQ_MEM_OK) {
            finish_free_on(d, base);
            return hipSuccess;
        }
        if (c != SQ_MEM_UNKNOWN) sq_die("hipFree of %s pointer %p", sq_mem_check_str(c), ptr);
    }
    sq_die("hipFree of unknown pointer %p", ptr);
}

#define HIP_HOST_MALLOC_VALID_FLAGS 0xfu /* default/portable, mapped, write-combined, numa */

hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int flags) {
    ENTER("hipHostMalloc");
    if (ptr == NULL || (flags & ~HIP_HOST_MALLOC_VALID_FLAGS) != 0) return hipErrorInvalidValue;
    hipError_t u = unsafe_during_capture("hipHostMalloc", 1);
    if (u != hipSuccess) return u;
    if (size == 0) {
        *ptr = NULL;
        return hipSuccess;
    }
    /* FAIL_ENTRY (the virtual memory section): out of page-locked memory,
     * nothing allocated. */
    if (hip_standin_entry_fault != NULL && hip_standin_entry_fault("hipHostMalloc"))
        return hipErrorOutOfMemory;
    uint64_t p = sq_mem_alloc_tracked(g_host_mem, size);
    if (p == 0) return hipErrorOutOfMemory;
    *ptr = (void *)(uintptr_t)p;
    return hipSuccess;
}

hipError_t hipHostGetDevicePointer(void **devPtr, void *hstPtr, unsigned int flags) {
    ENTER("hipHostGetDevicePointer");
    uint64_t h = (uint64_t)(uintptr_t)hstPtr;
    if (devPtr == NULL || flags != 0 || is_device_view(h) ||
        sq_mem_check(g_host_mem, h, 1) != SQ_MEM_OK)
        return hipErrorInvalidValue;
    *devPtr = (void *)(uintptr_t)(h | HOST_DEVICE_VIEW);
    return hipSuccess;
}

hipError_t hipHostFree(void *ptr) {
    ENTER("hipHostFree");
    if (ptr == NULL) return hipSuccess;
    hipError_t u = unsafe_during_capture("hipHostFree", 0);
    if (u != hipSuccess) return u;
    enum sq_mem_check c = sq_mem_free_now(g_host_mem, (uint64_t)(uintptr_t)ptr, "hipHostFree");
    if (c != SQ_MEM_OK) sq_die("hipHostFree of %s page-locked pointer %p", sq_mem_check_str(c), ptr);
    return hipSuccess;
}

hipError_t hipDeviceGetDefaultMemPool(hipMemPool_t *pool, int d) {
    ENTER("hipDeviceGetDefaultMemPool");
    if (pool == NULL) return hipErrorInvalidValue;
    if (!valid_device(d)) return hipErrorInvalidDevice;
    if (g_no_mempool == 1) return hipErrorNotSupported;
    *pool = &g_dev[d].pool;
    return hipSuccess;
}

hipError_t hipMemPoolSetAttribute(hipMemPool_t pool, hipMemPoolAttr attr, void *value) {
    ENTER("hipMemPoolSetAttribute");
    check_pool(pool, "hipMemPoolSetAttribute");
    if (value == NULL) return hipErrorInvalidValue;
    if (attr != hipMemPoolAttrReleaseThreshold) return hipErrorNotSupported;
    memcpy(&pool->release_threshold, value, sizeof pool->release_threshold);
    return hipSuccess;
}

hipError_t hipMemPoolGetAttribute(hipMemPool_t pool, hipMemPoolAttr attr, void *value) {
    ENTER("hipMemPoolGetAttribute");
    check_pool(pool, "hipMemPoolGetAttribute");
    if (value == NULL) return hipErrorInvalidValue;
    if (attr != hipMemPoolAttrReleaseThreshold) return hipErrorNotSupported;
    memcpy(value, &pool->release_threshold, sizeof pool->release_threshold);
    return hipSuccess;
}

hipError_t hipMemPoolTrimTo(hipMemPool_t pool, size_t keep) {
    ENTER("hipMemPoolTrimTo");
    check_pool(pool, "hipMemPoolTrimTo");
    struct device *dev = &g_dev[pool->device];
    pthread_mutex_lock(&dev->lock);
    if (pool->reserve > keep) pool->reserve = keep;
    pthread_mutex_unlock(&dev->lock);
    return hipSuccess;
}

hipError_t hipMemPoolCreate(hipMemPool_t *pool, const hipMemPoolProps *props) {
    ENTER("hipMemPoolCreate");
    if (pool == NULL || props == NULL) return hipErrorInvalidValue;
    if (g_no_mempool == 1) return hipErrorNotSupported;
    if (props->allocType != hipMemAllocationTypePinned ||
        props->location.type != hipMemLocationTypeDevice || !valid_device(props->location.id))
        return hipErrorInvalidValue;
    hipMemPool_t p = calloc(1, sizeof *p);
    if (p == NULL) sq_fatal("out of host memory");
    p->magic = POOL_MAGIC;
    p->device = props->location.id;
    struct device *dev = &g_dev[p->device];
    pthread_mutex_lock(&dev->lock);
    p->next = dev->created;
    dev->created = p;
    pthread_mutex_unlock(&dev->lock);
    pthread_mutex_lock(&g_lock);
    dev->created_pools++;
    pthread_mutex_unlock(&g_lock);
    *pool = p;
    return hipSuccess;
}

/* ROCm releases a pool's resources once its last allocation is freed; the
 * stand-in requires none live (memgov frees everything first) and keeps the
 * struct so that a later use is caught. */
hipError_t hipMemPoolDestroy(hipMemPool_t pool) {
    ENTER("hipMemPoolDestroy");
    check_pool(pool, "hipMemPoolDestroy");
    struct device *dev = &g_dev[pool->device];
    if (pool == &dev->pool) sq_die("hipMemPoolDestroy of device %d's default memory pool", pool->device);
    pthread_mutex_lock(&dev->lock);
    uint64_t live = 0;
    for (size_t i = 0; i < g_pool_allocs_n; i++) live += g_pool_allocs[i].pool == pool;
    if (live != 0) {
        pthread_mutex_unlock(&dev->lock);
        sq_die("hipMemPoolDestroy of pool %p with %llu allocations not yet freed", (void *)pool,
               (unsigned long long)live);
    }
    pool->destroyed = 1;
    pool->reserve = 0;
    for (hipMemPool_t *at = &dev->created; *at != NULL; at = &(*at)->next) {
        if (*at == pool) {
            *at = pool->next;
            break;
        }
    }
    pthread_mutex_unlock(&dev->lock);
    pthread_mutex_lock(&g_lock);
    dev->created_pools--;
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

static hipError_t malloc_from(const char *fn, void **ptr, size_t size, hipMemPool_t pool, hipStream_t s) {
    check_stream(s, fn);
    check_pool(pool, fn);
    if (g_no_mempool) return hipErrorNotSupported;
    if (ptr == NULL || size == 0) return hipErrorInvalidValue;
    if (pool->device != s->device)
        sq_die("%s from device %d's pool on a stream of device %d", fn, pool->device, s->device);
    uint64_t p = alloc_on(s->device, size, pool, s->q);
    if (p == 0) return hipErrorOutOfMemory;
    *ptr = (void *)(uintptr_t)p;
    return hipSuccess;
}

hipError_t hipMallocAsync(void **ptr, size_t size, hipStream_t s) {
    ENTER("hipMallocAsync");
    check_stream(s, "hipMallocAsync");
    not_during_capture(s, "hipMallocAsync");
    return malloc_from("hipMallocAsync", ptr, size, &g_dev[s->device].pool, s);
}

hipError_t hipMallocFromPoolAsync(void **ptr, size_t size, hipMemPool_t pool, hipStream_t s) {
    ENTER("hipMallocFromPoolAsync");
    check_stream(s, "hipMallocFromPoolAsync");
    not_during_capture(s, "hipMallocFromPoolAsync");
    return malloc_from("hipMallocFromPoolAsync", ptr, size, pool, s);
}

struct free_op {
    int device;
    uint64_t base;
};

static void run_free(void *arg) {
    struct free_op *op = arg;
    /* On a sticky device queued work no longer runs: the memory stays. */
    if (!sq_knobs_sticky()) finish_free_on(op->device, op->base);
    free(op);
}

hipError_t hipFreeAsync(void *ptr, hipStream_t s) {
    ENTER("hipFreeAsync");
    check_stream(s, "hipFreeAsync");
    not_during_capture(s, "hipFreeAsync");
    if (g_no_mempool) return hipErrorNotSupported;
    uint64_t base = (uint64_t)(uintptr_t)ptr;
    enum sq_mem_check c = sq_mem_begin_free_on(g_dev[s->device].mem, base, s->q, "hipFreeAsync");
    if (c != SQ_MEM_OK) sq_die("hipFreeAsync of %s pointer %p", sq_mem_check_str(c), ptr);
    struct free_op *op = malloc(sizeof *op);
    if (op == NULL) sq_fatal("out of host memory");
    *op = (struct free_op){.device = s->device, .base = base};
    sq_queue_push(s->q, run_free, op, SQ_OP_PLAIN);
    return hipSuccess;
}


/* ---- copies ---------------------------------------------------------------------- */

/* HIP's documentation: calling a copy with dst and src pointers that do not
 * match its hipMemcpyKind is undefined behaviour, and the device pointer of
 * mapped host memory is the one hipHostGetDevicePointer returns, which may
 * differ from the host pointer ("applications must use the device pointer in
 * device code"). Each side of a copy is therefore checked against what the
 * kind names for it: a device side must be device memory or the device's
 * view of mapped page-locked memory, a host side must be neither. */

/* Whether `addr` lies in a live allocation of any device's memory (only
 * live ones: a freed allocation's address may be the host's again). */
static int in_device_memory(uint64_t addr) {
    for (int d = 0; d < g_devices; d++)
        if (sq_mem_check(g_dev[d].mem, addr, 1) == SQ_MEM_OK) return 1;
    return 0;
}

/* A side of a copy whose kind says host: neither device memory nor the
 * device's view of page-locked memory. */
static void check_host_side(const char *fn, const char *which, const void *p) {
    uint64_t a = (uint64_t)(uintptr_t)p;
    if (is_device_view(a))
        sq_die("%s: the %s %p is the device pointer of page-locked host memory, where the copy's "
               "kind takes a host pointer (HIP: pointers that do not match the hipMemcpyKind are "
               "undefined behaviour): pass the host pointer",
               fn, which, p);
    if (in_device_memory(a))
        sq_die("%s: the %s %p is device memory, where the copy's kind takes a host pointer (HIP: "
               "pointers that do not match the hipMemcpyKind are undefined behaviour)",
               fn, which, p);
}

/* A side of a copy whose kind says device, checked for `bytes` on stream
 * `s`: device memory of the stream's device, or the device's view of mapped
 * page-locked memory (hipHostGetDevicePointer), live, in bounds and ordered
 * after its last use on another stream; never a host pointer. Returns the
 * table it lies in and its address there (where the stand-in's bytes are). */
static struct sq_mem *device_side(const char *fn, const char *which, const void *p, size_t bytes,
                                  hipStream_t s, uint64_t *addr) {
    uint64_t a = (uint64_t)(uintptr_t)p;
    struct sq_mem *mem;
    if (is_device_view(a)) {
        *addr = a & ~HOST_DEVICE_VIEW;
        mem = g_host_mem;
    } else {
        if (sq_mem_check(g_host_mem, a, 1) == SQ_MEM_OK)
            sq_die("%s: the %s %p is a host pointer (page-locked host memory), where the copy's "
                   "kind takes a device pointer (HIP: pointers that do not match the "
                   "hipMemcpyKind are undefined behaviour; the device pointer of mapped host "
                   "memory comes from hipHostGetDevicePointer and may differ from the host "
                   "pointer)",
                   fn, which, p);
        *addr = a;
        mem = g_dev[s->device].mem;
    }
    enum sq_mem_check c = sq_mem_check_on(mem, *addr, bytes, s->q, fn);
    if (c == SQ_MEM_UNKNOWN) {
        for (int d = 0; d < g_devices; d++)
            if (d != s->device && sq_mem_check(g_dev[d].mem, *addr, bytes) != SQ_MEM_UNKNOWN)
                sq_die("%s of %zu bytes at %p, memory of device %d, on a stream of device %d", fn,
                       bytes, p, d, s->device);
    }
    if (c != SQ_MEM_OK)
        sq_die("%s of %zu bytes at %s device pointer %p (the %s; the copy's kind takes a device "
               "pointer there)",
               fn, bytes, sq_mem_check_str(c), p, which);
    return mem;
}

/* What hipMemcpyDefault infers for a pointer from its address: device
 * memory of any device, or the device's view of page-locked memory, is a
 * device side; anything else a host side. */
static int is_device_address(const void *p) {
    uint64_t a = (uint64_t)(uintptr_t)p;
    return is_device_view(a) || in_device_memory(a);
}

/* An asynchronous copy of `bytes` from `src` to `dst` on `s`; each side is
 * a device side (dst_device, src_device) or a host side, as the copy's
 * kind says. */
static hipError_t copy_async(const char *fn, int dst_device, int src_device, void *dst,
                             const void *src, size_t bytes, hipStream_t s) {
    check_stream(s, fn);
    if (bytes == 0) return hipSuccess;
    if (dst == NULL || src == NULL) return hipErrorInvalidValue;
    /* A capturing stream records the copy into its graph (the graph
     * section); the
     * launch checks it as it queues it. */
    if (capturing(s))
        return (hipError_t)graph_record_copy(fn, s, dst_device, src_device, dst, src, bytes);
    return (hipError_t)hip_standin_copy(fn, s, dst_device, src_device, dst, src, bytes);
}

int hip_standin_copy(const char *fn, const void *stream, int dst_device, int src_device,
                     void *dst, const void *src, size_t bytes) {
    hipStream_t s = (hipStream_t)stream;
    /* Memory of a virtual address reservation: the virtual memory section
     * checks and queues it. */
    if (vmm_copy != NULL && (dst_device || src_device) &&
        vmm_copy(fn, dst_device, src_device, dst, src, bytes, s->q))
        return hipSuccess;
    uint64_t dst_addr = 0, src_addr = 0;
    struct sq_mem *dst_mem = NULL, *src_mem = NULL;
    if (dst_device)
        dst_mem = device_side(fn, "destination", dst, bytes, s, &dst_addr);
    else
        check_host_side(fn, "destination", dst);
    if (src_device)
        src_mem = device_side(fn, "source", src, bytes, s, &src_addr);
    else
        check_host_side(fn, "source", src);
    void *to = dst_device ? (void *)(uintptr_t)dst_addr : dst;
    const void *from = src_device ? (const void *)(uintptr_t)src_addr : src;
    sq_queue_copy(s->q, to, from, bytes);
    uint64_t seq = sq_queue_last(s->q);
    if (dst_mem != NULL) sq_mem_touch(dst_mem, dst_addr, s->q, seq);
    if (src_mem != NULL) sq_mem_touch(src_mem, src_addr, s->q, seq);
    return hipSuccess;
}

hipError_t hipMemcpyHtoDAsync(hipDeviceptr_t dst, void *src, size_t bytes, hipStream_t s) {
    ENTER("hipMemcpyHtoDAsync");
    return copy_async("hipMemcpyHtoDAsync", 1, 0, dst, src, bytes, s);
}

hipError_t hipMemcpyDtoHAsync(void *dst, hipDeviceptr_t src, size_t bytes, hipStream_t s) {
    ENTER("hipMemcpyDtoHAsync");
    return copy_async("hipMemcpyDtoHAsync", 0, 1, dst, src, bytes, s);
}

hipError_t hipMemcpyAsync(void *dst, const void *src, size_t bytes, hipMemcpyKind kind, hipStream_t s) {
    ENTER("hipMemcpyAsync");
    switch (kind) {
    case hipMemcpyHostToHost: return copy_async("hipMemcpyAsync", 0, 0, dst, src, bytes, s);
    case hipMemcpyHostToDevice: return copy_async("hipMemcpyAsync", 1, 0, dst, src, bytes, s);
    case hipMemcpyDeviceToHost: return copy_async("hipMemcpyAsync", 0, 1, dst, src, bytes, s);
    case hipMemcpyDeviceToDevice: return copy_async("hipMemcpyAsync", 1, 1, dst, src, bytes, s);
    case hipMemcpyDefault:
        return copy_async("hipMemcpyAsync", is_device_address(dst), is_device_address(src), dst,
                          src, bytes, s);
    default: return hipErrorInvalidValue;
    }
}

#elif defined(MEMGOV_STANDIN_HIP_SECTION_VMM)

/* ---- virtual memory management -------------------------------------------------
 *
 * The HIP virtual memory management calls
 * (hipMemGetAllocationGranularity, hipMemAddressReserve / hipMemAddressFree,
 * hipMemCreate / hipMemRelease, hipMemMap / hipMemUnmap, hipMemSetAccess).
 * The imitation and its rules are common/sq_vmm.c's (compiled here, by the
 * #include below), written from the CUDA driver API whose calls HIP's
 * mirror and from HIP's reference (Virtual Memory Management) and
 * programming guide ("Virtual memory management"); this section fills its
 * table with HIP's names and codes and keeps the exported entry points,
 * which decode ROCm's structs and call it.
 *
 * HIP's side of the documented differences:
 * - hipMemMap: "offset: offset into the memory, currently must be zero"
 *   (a nonzero one is hipErrorInvalidValue).
 * - A failing hipMemUnmap or hipMemRelease (MEMGOV_STANDIN_HIP_
 *   FAIL_UNMAP_AT=N, and the FAIL_ENTRY knob below) returns
 *   hipErrorInvalidValue, the reference's failure code for both, leaving
 *   the mapping or handle as it was.
 * - A copy may have two device sides (hipMemcpyAsync's kinds):
 *   the runtime section's copies name both; one in a reservation and the other device
 *   memory of another kind aborts (not imitated).
 * - hipMemGenericAllocationHandle_t is a pointer to a struct the header
 *   declares opaque: the stand-in's handle is the address of its record.
 *
 * - MEMGOV_STANDIN_HIP_FAIL_ENTRY=<entry point>:<N>: the Nth call of that
 *   entry point (counting the calls that pass its argument checks) fails
 *   and changes nothing, with the codes FAIL_VMM_AT uses (hipMemCreate
 *   hipErrorOutOfMemory, hipMemMap and hipMemSetAccess hipErrorInvalidValue);
 *   hipMemUnmap and hipMemRelease with hipErrorInvalidValue (the
 *   reference's failure code for both), leaving the mapping or handle as
 *   it was (a later call on it succeeds); the graph section's hipStreamBeginCapture
 *   and hipStreamEndCapture as it says; the runtime section's hipHostMalloc
 *   with hipErrorOutOfMemory, nothing allocated, and hipGetDevice with
 *   hipErrorInvalidDevice, nothing read.
 *   memgov_standin_hip_fail_entry(fn,
 *   N) sets the same at run time (the count starts again), so that one
 *   process runs many fault cells.
 * - memgov_standin_hip_vmm() reports what is held, for tests.
 */
#define _GNU_SOURCE
int hip_standin_entry_fault(const char *fn) {
    return sq_entry_fault("MEMGOV_STANDIN_HIP_FAIL_ENTRY", fn);
}

static struct sq_vmm_access access_of(const void *desc, size_t i) {
    const hipMemAccessDesc *d = (const hipMemAccessDesc *)desc + i;
    return (struct sq_vmm_access){.on_device = d->location.type == hipMemLocationTypeDevice,
                                  .device = d->location.id,
                                  .flags = (int)d->flags};
}

_Static_assert((int)hipMemAccessFlagsProtNone == SQ_VMM_PROT_NONE &&
                   (int)hipMemAccessFlagsProtRead == SQ_VMM_PROT_READ &&
                   (int)hipMemAccessFlagsProtReadWrite == SQ_VMM_PROT_READWRITE,
               "hipMemAccessFlags numbered as sq_vmm.c reads them");
_Static_assert(hipMemAllocationGranularityMinimum == 0 &&
                   hipMemAllocationGranularityRecommended == 1,
               "hipMemAllocationGranularity_flags numbered as sq_vmm.c reads them");

static const struct sq_vmm_vendor HIP_VMM = {
    .create = "hipMemCreate", .release = "hipMemRelease", .map = "hipMemMap",
    .set_access = "hipMemSetAccess", .unmap = "hipMemUnmap", .address_free = "hipMemAddressFree",
    .prefix = "MEMGOV_STANDIN_HIP", .memfd_name = "memgov-standin-hip-vmm",
    .success = hipSuccess, .invalid_value = hipErrorInvalidValue,
    .out_of_memory = hipErrorOutOfMemory, .invalid_device = hipErrorInvalidDevice,
    /* hipMemUnmap's and hipMemRelease's references list hipErrorInvalidValue. */
    .unmap_failure = hipErrorInvalidValue, .release_failure = hipErrorInvalidValue,
    /* hipMemMap: "offset - offset into the memory, currently must be zero". */
    .map_offset_must_be_zero = 1,
    .devices = hip_standin_devices, .capacity = hip_standin_capacity,
    .sticky = sq_knobs_sticky, .entry_fault = hip_standin_entry_fault, .access_of = access_of,
    .unsafe_during_capture = graph_unsafe, .capture_unsupported = hipErrorStreamCaptureUnsupported,
};

#include "sq_vmm.c"

/* For tests (standin.h, exported through libamdhip64.map):
 * memgov_standin_hip_fail_entry(fn, n): from now on the Nth call of `fn`
 * fails (counting from this call; N = 0 or fn = NULL: none), as
 * MEMGOV_STANDIN_HIP_FAIL_ENTRY says at process start (1 for a name too
 * long, else 0); memgov_standin_hip_pause_entry(fn, n), for tests that
 * force an interleaving: from now on the Nth call of `fn` (any entry
 * point, at its entry) blocks before it changes anything, until
 * memgov_standin_hip_resume_entry(); memgov_standin_hip_entry_paused()
 * says whether one is held. */
SQ_ENTRY_TEST_HOOKS(hip)

#define VMM_ENTER(fn) HIP_STANDIN_CALL(fn)

static const struct sq_vmm_prop *prop_of(const hipMemAllocationProp *p, struct sq_vmm_prop *out) {
    if (p == NULL) return NULL;
    *out = (struct sq_vmm_prop){.pinned = p->type == hipMemAllocationTypePinned,
                                .on_device = p->location.type == hipMemLocationTypeDevice,
                                .device = p->location.id};
    return out;
}

hipError_t hipMemGetAllocationGranularity(size_t *granularity, const hipMemAllocationProp *prop,
                                          hipMemAllocationGranularity_flags option) {
    VMM_ENTER("hipMemGetAllocationGranularity");
    struct sq_vmm_prop p;
    return (hipError_t)sq_vmm_granularity(&HIP_VMM, granularity, prop_of(prop, &p), (int)option);
}

hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr,
                                unsigned long long flags) {
    VMM_ENTER("hipMemAddressReserve");
    (void)addr; /* a hint only */
    uint64_t base;
    hipError_t r =
        (hipError_t)sq_vmm_reserve(&HIP_VMM, ptr != NULL ? &base : NULL, size, alignment, flags);
    if (r == hipSuccess) *ptr = (void *)(uintptr_t)base;
    return r;
}

hipError_t hipMemAddressFree(void *devPtr, size_t size) {
    VMM_ENTER("hipMemAddressFree");
    return (hipError_t)sq_vmm_address_free(&HIP_VMM, (uint64_t)(uintptr_t)devPtr, size);
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                        const hipMemAllocationProp *prop, unsigned long long flags) {
    VMM_ENTER("hipMemCreate");
    struct sq_vmm_prop p;
    uint64_t h;
    hipError_t r = (hipError_t)sq_vmm_create(&HIP_VMM, handle != NULL ? &h : NULL, size,
                                             prop_of(prop, &p), flags);
    if (r == hipSuccess) *handle = (hipMemGenericAllocationHandle_t)(uintptr_t)h;
    return r;
}

hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
    VMM_ENTER("hipMemRelease");
    return (hipError_t)sq_vmm_release(&HIP_VMM, (uint64_t)(uintptr_t)handle);
}

hipError_t hipMemMap(void *va, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
    VMM_ENTER("hipMemMap");
    return (hipError_t)sq_vmm_map(&HIP_VMM, (uint64_t)(uintptr_t)va, size, offset,
                                  (uint64_t)(uintptr_t)handle, flags);
}

hipError_t hipMemSetAccess(void *va, size_t size, const hipMemAccessDesc *desc, size_t count) {
    VMM_ENTER("hipMemSetAccess");
    return (hipError_t)sq_vmm_set_access(&HIP_VMM, (uint64_t)(uintptr_t)va, size, desc, count);
}

hipError_t hipMemUnmap(void *va, size_t size) {
    VMM_ENTER("hipMemUnmap");
    return (hipError_t)sq_vmm_unmap(&HIP_VMM, (uint64_t)(uintptr_t)va, size);
}

int vmm_copy(const char *fn, int dst_device, int src_device, void *dst, const void *src,
             size_t bytes, struct sq_queue *q) {
    return sq_vmm_copy(&HIP_VMM, fn, dst_device, src_device, dst, src, bytes, q);
}

uint64_t vmm_physical_bytes(void) { return sq_vmm_physical_bytes(); }

/* For tests: what the process holds, as {reservations, reserved bytes,
 * allocation handles (released but still mapped included), physical bytes,
 * mappings, mapped bytes}. Returns 0. */
int memgov_standin_hip_vmm(unsigned long long out[6]);
int memgov_standin_hip_vmm(unsigned long long out[6]) { return sq_vmm_held(out); }

#else /* MEMGOV_STANDIN_HIP_SECTION_GRAPHS */

/* ---- stream capture and graphs --------------------------------------------------
 *
 * The HIP stream capture and graph calls. The
 * imitation and its rules are common/sq_graph.c's (compiled here, by the
 * #include below), from the HIP runtime API reference (Stream Management:
 * hipStreamBeginCapture, hipStreamEndCapture, hipStreamGetCaptureInfo,
 * hipStreamIsCapturing; Graph Management: hipGraphInstantiate,
 * hipGraphLaunch, hipGraphExecDestroy, hipGraphDestroy) and the
 * hipStreamCaptureMode and hipError_t descriptions of ROCm's header; this
 * section fills its table with HIP's names, codes and enumerators and keeps
 * the exported entry points and the hooks the other sections call
 * that record (sq_graph.c defines the others over HIP_GRAPH).
 *
 * HIP's side:
 * - The potentially unsafe calls (those that allocate, map or release
 *   memory outside a stream): hipMalloc, hipFree, hipHostMalloc,
 *   hipHostFree (the runtime section), hipMemCreate, hipMemRelease,
 *   hipMemMap and hipMemUnmap (the virtual memory section).
 * - A stream argument that is not live is a contract violation
 *   (hip_standin_check_stream aborts).
 * - hipStreamGetCaptureInfo reports the status and id only (ROCm's
 *   signature has no graph or dependencies).
 * - Contract violations besides sq_graph.c's: destroying a capturing
 *   stream (hipStreamDestroy, the runtime section). With
 *   MEMGOV_STANDIN_HIP_EXIT_CHECK=1, graphs or executable graphs never
 *   destroyed at exit abort (sq_graph.c, graphs_checked_at_exit).
 * - Fault knob (the virtual memory section's MEMGOV_STANDIN_HIP_FAIL_ENTRY=<entry point>:<N>):
 *   hipStreamBeginCapture (hipErrorInvalidValue, the reference's failure
 *   code) and hipStreamEndCapture, as sq_graph.c says.
 *
 * Test hook (not a runtime rule): memgov_standin_hip_pause_entry(name, n)
 * (the virtual memory section) makes the Nth call of that entry point, on any thread, block at
 * its entry before it does anything, until memgov_standin_hip_resume_entry().
 *
 * Not imitated (a contract violation naming the call): stream-ordered
 * allocation and free (hipMallocAsync, hipMallocFromPoolAsync,
 * hipFreeAsync), event record and event wait on a capturing stream (memory
 * and fork/join nodes), and launching a graph into a capture.
 */
#define _GNU_SOURCE
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

/* ---- hooks the other sections call (declared above) -------------------------- */

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

#endif /* the sections */
