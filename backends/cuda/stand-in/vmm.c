/*
 * vmm.c: the stand-in's CUDA virtual memory management calls
 * (cuMemGetAllocationGranularity, cuMemAddressReserve / cuMemAddressFree,
 * cuMemCreate / cuMemRelease, cuMemMap / cuMemUnmap, cuMemSetAccess),
 * imitating the driver's documented rules on host memory.
 *
 * - A reservation is host address space (mmap PROT_NONE, MAP_NORESERVE): a
 *   CUdeviceptr is still the host address, as in libcuda.c.
 * - Physical memory (cuMemCreate) is a memfd of the handle's size, backed
 *   sparsely by the kernel; cuMemMap maps it MAP_SHARED at the address
 *   with no access (PROT_NONE), cuMemSetAccess makes it readable and
 *   writable, cuMemUnmap turns the range back into a reservation. The same
 *   handle mapped again shows the same bytes.
 * - The granularity (minimum and recommended) is 2 MiB.
 *
 * Rules, from the CUDA Driver API's Virtual Memory Management section:
 * - Returned as errors (CUDA_ERROR_INVALID_VALUE), as the driver does:
 *   sizes, offsets and addresses not multiples of the granularity (cuMemCreate,
 *   cuMemMap, cuMemAddressReserve), an alignment that is not a power of two,
 *   nonzero flags, properties that are not pinned device memory of a valid
 *   device, a map outside one reservation, past the end of the handle's
 *   memory or over an existing mapping, an unmap or set-access range that is
 *   not whole mappings, a cuMemAddressFree range that is not a reservation.
 *   cuMemCreate beyond the device's memory is CUDA_ERROR_OUT_OF_MEMORY.
 * - Contract violations (undefined behaviour on the device; the stand-in
 *   aborts): a copy touching reserved memory that is not mapped, or mapped
 *   without read-write access set (cuMemSetAccess before use); cuMemUnmap of
 *   a mapping that queued work on any stream still uses (the last operation
 *   touching it has not completed); cuMemAddressFree of a reservation with
 *   live mappings; cuMemRelease or cuMemMap of a handle already released
 *   (or never created). A handle released while still mapped is legal: its
 *   memory goes when its last mapping is unmapped.
 * - With MEMGOV_STANDIN_CUDA_EXIT_CHECK=1, any reservation, allocation
 *   handle or mapping left at exit is a contract violation (unless the
 *   device is in the sticky error state).
 * - Fault knobs: MEMGOV_STANDIN_CUDA_FAIL_VMM_AT=N, the Nth call of
 *   cuMemCreate, cuMemMap or cuMemSetAccess (counted together) fails and
 *   changes nothing, with a code the driver API reference lists for that
 *   call: cuMemCreate with CUDA_ERROR_OUT_OF_MEMORY, cuMemMap and
 *   cuMemSetAccess with CUDA_ERROR_INVALID_VALUE (their references list no
 *   out-of-memory code); MEMGOV_STANDIN_CUDA_
 *   FAIL_UNMAP_AT=N, the Nth cuMemUnmap fails with CUDA_ERROR_UNKNOWN and
 *   leaves the mapping as it was (every later unmap of it succeeds).
 * - MEMGOV_STANDIN_CUDA_FAIL_ENTRY=<entry point>:<N>: the Nth call of that
 *   entry point (counting the calls that pass its argument checks) fails:
 *   cuMemCreate, cuMemMap and cuMemSetAccess with the codes FAIL_VMM_AT
 *   uses, changing nothing; cuMemUnmap and cuMemRelease with CUDA_ERROR_UNKNOWN,
 *   leaving the mapping or handle as it was (a later call on it succeeds);
 *   graph.c's cuStreamBeginCapture_v2 and cuStreamEndCapture as it says;
 *   libcuda.c's cuMemHostAlloc with CUDA_ERROR_OUT_OF_MEMORY, nothing
 *   allocated, and cuCtxPushCurrent_v2 with CUDA_ERROR_INVALID_CONTEXT,
 *   nothing pushed.
 *   memgov_standin_cuda_fail_entry(fn, N) sets the same at run time (the
 *   count starts again), so that one process runs many fault cells.
 * - memgov_standin_cuda_vmm() reports what is held, for tests.
 */
#define _GNU_SOURCE
#include "vmm.h"
#include "graph.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_UNKNOWN = 999,
};

#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_NONE 0
#define CU_MEM_ACCESS_FLAGS_PROT_READ 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3

#define GRANULE (2ull << 20)
#define HANDLE_MAGIC 0x564d4d48u /* "VMMH" */
#define MAX_TOUCH 16

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
    int flags;
};

struct handle {
    unsigned magic;
    int released;
    int maps; /* live mappings of it */
    int fd;
    uint64_t size;
    struct handle *next;
};

/* The latest operation of one queue that uses a mapping: an event recorded
 * right after it (events keep their queue readable after it is destroyed). */
struct touch {
    uint64_t queue;
    struct sq_event *event;
};

struct mapping {
    uint64_t va, size, offset;
    struct handle *h;
    int access; /* CU_MEM_ACCESS_FLAGS_* */
    struct touch touches[MAX_TOUCH];
    int ntouch;
    struct mapping *next;
};

struct reservation {
    uint64_t va, size;
    struct reservation *next;
};

static pthread_mutex_t g_vmm = PTHREAD_MUTEX_INITIALIZER;
static struct reservation *g_res;
static struct handle *g_handles;
static struct mapping *g_maps;
static uint64_t g_phys_bytes;
/* Live reservations, read without the lock by vmm_copy so that
 * copies of ordinary allocations do not take it. */
static uint64_t g_res_count;
static uint64_t g_fail_vmm_at, g_fail_unmap_at, g_vmm_calls, g_unmap_calls;
static int g_vmm_init;

static void exit_check(void);

/* Under g_vmm: the knobs, read once. */
static void vmm_init(void) {
    if (g_vmm_init) return;
    g_vmm_init = 1;
    g_fail_vmm_at = sq_env_u64("MEMGOV_STANDIN_CUDA_FAIL_VMM_AT", 0);
    g_fail_unmap_at = sq_env_u64("MEMGOV_STANDIN_CUDA_FAIL_UNMAP_AT", 0);
    if (sq_env_u64("MEMGOV_STANDIN_CUDA_EXIT_CHECK", 0) != 0) atexit(exit_check);
}

/* For tests: from now on the Nth call of `fn` fails (counting from this
 * call; N = 0 or fn = NULL: none), as MEMGOV_STANDIN_CUDA_FAIL_ENTRY says at
 * process start. Lets one process run many fault cells. */
__attribute__((visibility("default"))) int memgov_standin_cuda_fail_entry(const char *fn,
                                                                          unsigned long long n) {
    return sq_entry_fault_set(fn, n);
}

/* For tests that force an interleaving: from now on the Nth call of `fn`
 * (any entry point, at its entry; and the point named
 * "cuCtxSynchronize:waits", after a context synchronize took its snapshot
 * of the queues and before it waits on them) blocks before it changes
 * anything, until
 * memgov_standin_cuda_resume_entry(); memgov_standin_cuda_entry_paused()
 * says whether one is held. See sq_entry_pause_set. */
__attribute__((visibility("default"))) int memgov_standin_cuda_pause_entry(const char *fn,
                                                                           unsigned long long n) {
    return sq_entry_pause_set(fn, n);
}

__attribute__((visibility("default"))) int memgov_standin_cuda_entry_paused(void) {
    return sq_entry_paused();
}

__attribute__((visibility("default"))) void memgov_standin_cuda_resume_entry(void) {
    sq_entry_resume();
}

int standin_entry_fault(const char *fn) {
    return sq_entry_fault("MEMGOV_STANDIN_CUDA_FAIL_ENTRY", fn);
}

/* Under g_vmm: count a create / map / set-access call; 1 when the fault
 * knob says this one fails. */
static int vmm_fault(void) {
    return g_fail_vmm_at != 0 && ++g_vmm_calls == g_fail_vmm_at;
}

#define VMM_ENTER(fn)                                           \
    do {                                                        \
        int e_ = cuda_standin_enter(fn);                        \
        if (e_ < 0) return CUDA_ERROR_NOT_INITIALIZED;          \
        if (e_ > 0) return CUDA_ERROR_ILLEGAL_ADDRESS;          \
    } while (0)

/* A potentially unsafe call while a capture is under way (graph.c). */
#define UNSAFE_DURING_CAPTURE(fn, alloc)                                     \
    do {                                                                     \
        if (graph_unsafe != NULL && graph_unsafe(fn, alloc))                 \
            return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;                    \
    } while (0)

static int aligned(uint64_t v) { return v % GRANULE == 0; }

static int valid_prop(const struct CUmemAllocationProp_st *p) {
    return p != NULL && p->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
           p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && p->location.id >= 0 &&
           p->location.id < cuda_standin_devices();
}

/* Under g_vmm: the handle `h` names, or a contract violation naming fn. */
static struct handle *find_handle(CUmemGenericAllocationHandle h, const char *fn) {
    for (struct handle *x = g_handles; x != NULL; x = x->next) {
        if ((uintptr_t)x == h) {
            if (x->released)
                sq_die("%s of allocation handle 0x%llx, already released (cuMemRelease)", fn,
                       (unsigned long long)h);
            return x;
        }
    }
    sq_die("%s of 0x%llx, which is not a live allocation handle (never created by cuMemCreate, "
           "or released and its memory gone)",
           fn, (unsigned long long)h);
}

static struct reservation *reservation_of(uint64_t va, uint64_t size) {
    for (struct reservation *r = g_res; r != NULL; r = r->next)
        if (va >= r->va && va - r->va < r->size && size <= r->size - (va - r->va)) return r;
    return NULL;
}

static struct mapping *mapping_at(uint64_t va) {
    for (struct mapping *m = g_maps; m != NULL; m = m->next)
        if (va >= m->va && va - m->va < m->size) return m;
    return NULL;
}

/* Under g_vmm: the memory of a handle released and no longer mapped goes. */
static void handle_maybe_free(struct handle *h) {
    if (!h->released || h->maps != 0) return;
    for (struct handle **p = &g_handles; *p != NULL; p = &(*p)->next) {
        if (*p == h) {
            *p = h->next;
            break;
        }
    }
    close(h->fd);
    g_phys_bytes -= h->size;
    h->magic = 0;
    free(h);
}

CUresult cuMemGetAllocationGranularity(size_t *granularity,
                                       const struct CUmemAllocationProp_st *prop, int option) {
    VMM_ENTER("cuMemGetAllocationGranularity");
    if (granularity == NULL || !valid_prop(prop) || (option != 0 && option != 1))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = GRANULE;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    VMM_ENTER("cuMemAddressReserve");
    (void)addr; /* a hint only */
    if (ptr == NULL || size == 0 || !aligned(size) || flags != 0 ||
        (alignment & (alignment - 1)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t align = alignment > GRANULE ? alignment : GRANULE;
    size_t span = size + align;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t start = (uint64_t)(uintptr_t)p, base = (start + align - 1) / align * align;
    if (base > start) munmap(p, base - start);
    if (start + span > base + size) munmap((void *)(uintptr_t)(base + size), start + span - (base + size));
    struct reservation *r = malloc(sizeof *r);
    if (r == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_vmm);
    vmm_init();
    *r = (struct reservation){.va = base, .size = size, .next = g_res};
    g_res = r;
    __atomic_add_fetch(&g_res_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_vmm);
    *ptr = base;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    VMM_ENTER("cuMemAddressFree");
    pthread_mutex_lock(&g_vmm);
    struct reservation **p = &g_res;
    while (*p != NULL && !((*p)->va == ptr && (*p)->size == size)) p = &(*p)->next;
    if (*p == NULL) {
        pthread_mutex_unlock(&g_vmm);
        return CUDA_ERROR_INVALID_VALUE;
    }
    unsigned long long live = 0, bytes = 0;
    for (struct mapping *m = g_maps; m != NULL; m = m->next)
        if (m->va >= ptr && m->va - ptr < size) live++, bytes += m->size;
    if (live != 0)
        sq_die("cuMemAddressFree of reservation 0x%llx (%zu bytes) with %llu live mapping(s) "
               "(%llu bytes) in it: unmap them first (cuMemUnmap)",
               (unsigned long long)ptr, size, live, bytes);
    struct reservation *r = *p;
    *p = r->next;
    __atomic_sub_fetch(&g_res_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_vmm);
    munmap((void *)(uintptr_t)r->va, r->size);
    free(r);
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const struct CUmemAllocationProp_st *prop, unsigned long long flags) {
    VMM_ENTER("cuMemCreate");
    UNSAFE_DURING_CAPTURE("cuMemCreate", 1);
    if (handle == NULL || size == 0 || !aligned(size) || flags != 0 || !valid_prop(prop))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm);
    vmm_init();
    if (vmm_fault() || standin_entry_fault("cuMemCreate") ||
        g_phys_bytes + size > cuda_standin_capacity()) {
        pthread_mutex_unlock(&g_vmm);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_phys_bytes += size; /* claimed before the lock goes */
    pthread_mutex_unlock(&g_vmm);
    int fd = memfd_create("memgov-standin-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) sq_fatal("memfd of %zu bytes: %s", size, strerror(errno));
    struct handle *h = malloc(sizeof *h);
    if (h == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_vmm);
    *h = (struct handle){.magic = HANDLE_MAGIC, .fd = fd, .size = size, .next = g_handles};
    g_handles = h;
    pthread_mutex_unlock(&g_vmm);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    VMM_ENTER("cuMemRelease");
    UNSAFE_DURING_CAPTURE("cuMemRelease", 0);
    pthread_mutex_lock(&g_vmm);
    struct handle *h = find_handle(handle, "cuMemRelease");
    if (standin_entry_fault("cuMemRelease")) {
        pthread_mutex_unlock(&g_vmm);
        return CUDA_ERROR_UNKNOWN;
    }
    h->released = 1; /* the memory stays while mapped */
    handle_maybe_free(h);
    pthread_mutex_unlock(&g_vmm);
    return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    VMM_ENTER("cuMemMap");
    UNSAFE_DURING_CAPTURE("cuMemMap", 0);
    pthread_mutex_lock(&g_vmm);
    struct handle *h = find_handle(handle, "cuMemMap");
    CUresult r = CUDA_SUCCESS;
    if (size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset) || flags != 0 ||
        offset > h->size || size > h->size - offset || reservation_of(ptr, size) == NULL) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (struct mapping *m = g_maps; m != NULL; m = m->next)
            if (m->va < ptr + size && ptr < m->va + m->size) r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS && (vmm_fault() || standin_entry_fault("cuMemMap")))
        r = CUDA_ERROR_INVALID_VALUE; /* the reference's failure code for valid arguments */
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_vmm);
        return r;
    }
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset);
    if (p == MAP_FAILED) sq_fatal("mmap of a mapping: %s", strerror(errno));
    struct mapping *m = calloc(1, sizeof *m);
    if (m == NULL) sq_fatal("out of host memory");
    *m = (struct mapping){.va = ptr, .size = size, .offset = offset, .h = h, .next = g_maps};
    g_maps = m;
    h->maps++;
    pthread_mutex_unlock(&g_vmm);
    return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct CUmemAccessDesc_st *desc,
                        size_t count) {
    VMM_ENTER("cuMemSetAccess");
    if (desc == NULL || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int access = -1;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
            desc[i].location.id >= cuda_standin_devices())
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
        access = desc[i].flags;
    }
    pthread_mutex_lock(&g_vmm);
    /* The range must be whole mappings, back to back. */
    uint64_t at = ptr;
    while (at < ptr + size) {
        struct mapping *m = mapping_at(at);
        if (m == NULL || m->va != at || m->size > ptr + size - at) {
            pthread_mutex_unlock(&g_vmm);
            return CUDA_ERROR_INVALID_VALUE;
        }
        at += m->size;
    }
    if (vmm_fault() || standin_entry_fault("cuMemSetAccess")) {
        pthread_mutex_unlock(&g_vmm);
        return CUDA_ERROR_INVALID_VALUE; /* the reference's failure code for valid arguments */
    }
    int prot = access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
               : access == CU_MEM_ACCESS_FLAGS_PROT_READ    ? PROT_READ
                                                             : PROT_NONE;
    for (at = ptr; at < ptr + size;) {
        struct mapping *m = mapping_at(at);
        if (mprotect((void *)(uintptr_t)m->va, m->size, prot) != 0) sq_fatal("mprotect: %s", strerror(errno));
        m->access = access;
        at += m->size;
    }
    pthread_mutex_unlock(&g_vmm);
    return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    VMM_ENTER("cuMemUnmap");
    UNSAFE_DURING_CAPTURE("cuMemUnmap", 0);
    pthread_mutex_lock(&g_vmm);
    vmm_init();
    uint64_t at = ptr;
    while (size != 0 && at < ptr + size) {
        struct mapping *m = mapping_at(at);
        if (m == NULL || m->va != at || m->size > ptr + size - at) {
            pthread_mutex_unlock(&g_vmm);
            return CUDA_ERROR_INVALID_VALUE;
        }
        for (int i = 0; i < m->ntouch; i++)
            if (!sq_event_done(m->touches[i].event))
                sq_die("cuMemUnmap of 0x%llx (%llu bytes) while work queued on stream #%llu that "
                       "uses it has not completed: unmap only after every stream that touched the "
                       "memory has passed its last use",
                       (unsigned long long)m->va, (unsigned long long)m->size,
                       (unsigned long long)m->touches[i].queue);
        at += m->size;
    }
    if (size == 0) {
        pthread_mutex_unlock(&g_vmm);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((g_fail_unmap_at != 0 && ++g_unmap_calls == g_fail_unmap_at) ||
        standin_entry_fault("cuMemUnmap")) {
        pthread_mutex_unlock(&g_vmm);
        return CUDA_ERROR_UNKNOWN;
    }
    for (at = ptr; at < ptr + size;) {
        struct mapping *m = mapping_at(at);
        void *p = mmap((void *)(uintptr_t)m->va, m->size, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        if (p == MAP_FAILED) sq_fatal("mmap over an unmapped range: %s", strerror(errno));
        for (struct mapping **q = &g_maps; *q != NULL; q = &(*q)->next) {
            if (*q == m) {
                *q = m->next;
                break;
            }
        }
        at += m->size;
        for (int i = 0; i < m->ntouch; i++) sq_event_destroy(m->touches[i].event);
        m->h->maps--;
        handle_maybe_free(m->h);
        free(m);
    }
    pthread_mutex_unlock(&g_vmm);
    return CUDA_SUCCESS;
}

/* Under g_vmm: the copy's range is mapped read-write throughout. */
static void check_access(const char *fn, uint64_t addr, size_t bytes) {
    for (uint64_t at = addr; at < addr + bytes;) {
        struct mapping *m = mapping_at(at);
        if (m == NULL)
            sq_die("%s of %zu bytes at 0x%llx touches reserved address 0x%llx that is not mapped "
                   "(cuMemMap)",
                   fn, bytes, (unsigned long long)addr, (unsigned long long)at);
        if (m->access != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            sq_die("%s of %zu bytes at 0x%llx touches mapping 0x%llx whose access was not set "
                   "read-write (cuMemSetAccess before use)",
                   fn, bytes, (unsigned long long)addr, (unsigned long long)m->va);
        at = m->va + m->size;
    }
}

/* Under g_vmm: the mappings of [addr, addr + bytes) are used by q's work up
 * to its last queued operation. */
static void touch(uint64_t addr, size_t bytes, struct sq_queue *q) {
    uint64_t qid = sq_queue_id(q);
    for (uint64_t at = addr; at < addr + bytes;) {
        struct mapping *m = mapping_at(at);
        struct touch *t = NULL;
        for (int i = 0; i < m->ntouch && t == NULL; i++)
            if (m->touches[i].queue == qid) t = &m->touches[i];
        if (t == NULL) {
            if (m->ntouch == MAX_TOUCH) {
                /* Keep the bound: an entry whose work is done makes room
                 * (else the check would be lost). */
                int freed = -1;
                for (int i = 0; i < m->ntouch && freed < 0; i++)
                    if (sq_event_done(m->touches[i].event)) freed = i;
                if (freed < 0) sq_fatal("more than %d streams with work queued on one mapping", MAX_TOUCH);
                sq_event_destroy(m->touches[freed].event);
                m->touches[freed] = m->touches[--m->ntouch];
            }
            t = &m->touches[m->ntouch++];
            *t = (struct touch){.queue = qid, .event = sq_event_new()};
        }
        sq_event_record(t->event, q);
        at = m->va + m->size;
    }
}

int vmm_copy(const char *fn, uint64_t addr, size_t bytes, struct sq_queue *q, void *dst,
             const void *src) {
    /* No reservation: not VMM memory (a reservation made concurrently with
     * this copy cannot contain its address). */
    if (__atomic_load_n(&g_res_count, __ATOMIC_ACQUIRE) == 0) return 0;
    pthread_mutex_lock(&g_vmm);
    if (reservation_of(addr, 1) == NULL) {
        pthread_mutex_unlock(&g_vmm);
        return 0;
    }
    check_access(fn, addr, bytes);
    sq_queue_copy(q, dst, src, bytes);
    touch(addr, bytes, q);
    pthread_mutex_unlock(&g_vmm);
    return 1;
}

uint64_t vmm_physical_bytes(void) {
    pthread_mutex_lock(&g_vmm);
    uint64_t b = g_phys_bytes;
    pthread_mutex_unlock(&g_vmm);
    return b;
}

/* For tests: what the process holds, as {reservations, reserved bytes,
 * allocation handles (released but still mapped included), physical bytes,
 * mappings, mapped bytes}. Returns 0. */
int memgov_standin_cuda_vmm(unsigned long long out[6]) {
    if (out == NULL) return -1;
    memset(out, 0, 6 * sizeof out[0]);
    pthread_mutex_lock(&g_vmm);
    for (struct reservation *r = g_res; r != NULL; r = r->next) out[0]++, out[1] += r->size;
    for (struct handle *h = g_handles; h != NULL; h = h->next) out[2]++;
    out[3] = g_phys_bytes;
    for (struct mapping *m = g_maps; m != NULL; m = m->next) out[4]++, out[5] += m->size;
    pthread_mutex_unlock(&g_vmm);
    return 0;
}

static void exit_check(void) {
    if (cuda_standin_sticky()) return;
    unsigned long long v[6];
    memgov_standin_cuda_vmm(v);
    if (v[0] != 0 || v[2] != 0 || v[4] != 0)
        sq_die("at exit: %llu address reservation(s) (%llu bytes), %llu allocation handle(s) "
               "(%llu bytes of physical memory) and %llu mapping(s) (%llu bytes) never freed",
               v[0], v[1], v[2], v[3], v[4], v[5]);
}
