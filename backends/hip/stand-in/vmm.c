/*
 * vmm.c: the stand-in's HIP virtual memory management calls
 * (hipMemGetAllocationGranularity, hipMemAddressReserve / hipMemAddressFree,
 * hipMemCreate / hipMemRelease, hipMemMap / hipMemUnmap, hipMemSetAccess),
 * imitating ROCm's documented rules on host memory.
 *
 * - A reservation is host address space (mmap PROT_NONE, MAP_NORESERVE): a
 *   device pointer is still the host address, as in libamdhip64.c.
 * - Physical memory (hipMemCreate) is a memfd of the handle's size; hipMemMap
 *   maps it MAP_SHARED at the address with no access (PROT_NONE),
 *   hipMemSetAccess makes it readable and writable, hipMemUnmap turns the
 *   range back into a reservation. The same handle mapped again shows the
 *   same bytes.
 * - The granularity (minimum and recommended) is 2 MiB.
 *
 * Rules, from the HIP runtime API reference (Virtual Memory Management) and
 * the HIP programming guide's "Virtual memory management" how-to:
 * - Returned as errors (hipErrorInvalidValue), as the reference lists:
 *   sizes and addresses not multiples of the granularity
 *   (hipMemGetAllocationGranularity: "the size must be aligned to it"), an
 *   alignment that is not a power of two, nonzero flags ("currently unused,
 *   must be zero"), a nonzero hipMemMap offset ("currently must be zero"),
 *   properties that are not pinned memory of a valid device, a map outside
 *   one reservation, past the end of the handle's memory or over an
 *   existing mapping, an unmap or set-access range that is not whole
 *   mappings, a hipMemAddressFree range that is not a reservation.
 *   hipMemCreate beyond the device's memory is hipErrorOutOfMemory.
 * - Contract violations (the stand-in aborts): a copy touching reserved
 *   memory that is not mapped, or mapped without read-write access set (the
 *   how-to: memory is not accessible until hipMemSetAccess grants it);
 *   hipMemUnmap of a mapping that queued work on any stream still uses;
 *   hipMemAddressFree of a reservation with live mappings (the how-to frees
 *   in the order unmap, release, address free); hipMemRelease or hipMemMap
 *   of a handle already released (or never created). A handle released while
 *   still mapped is legal: its memory goes when its last mapping is unmapped.
 *   The README lists where this is stricter than AMD's documentation.
 * - With MEMGOV_STANDIN_HIP_EXIT_CHECK=1, any reservation, allocation handle
 *   or mapping left at exit is a contract violation (unless the device is
 *   in the sticky error state).
 * - Fault knobs: MEMGOV_STANDIN_HIP_FAIL_VMM_AT=N, the Nth call of
 *   hipMemCreate, hipMemMap or hipMemSetAccess (counted together) fails and
 *   changes nothing, with a code AMD's reference lists for that call:
 *   hipMemCreate with hipErrorOutOfMemory, hipMemMap and hipMemSetAccess
 *   with hipErrorInvalidValue (their references list no out-of-memory
 *   code); MEMGOV_STANDIN_HIP_
 *   FAIL_UNMAP_AT=N, the Nth hipMemUnmap fails with hipErrorInvalidValue and
 *   leaves the mapping as it was (every later unmap of it succeeds).
 * - MEMGOV_STANDIN_HIP_FAIL_ENTRY=<entry point>:<N>: the Nth call of that
 *   entry point (counting the calls that pass its argument checks) fails
 *   and changes nothing, with the codes FAIL_VMM_AT uses (hipMemCreate
 *   hipErrorOutOfMemory, hipMemMap and hipMemSetAccess hipErrorInvalidValue);
 *   hipMemUnmap and hipMemRelease with hipErrorInvalidValue (the
 *   reference's failure code for both), leaving the mapping or handle as
 *   it was (a later call on it succeeds); graph.c's hipStreamBeginCapture
 *   and hipStreamEndCapture as it says; libamdhip64.c's hipHostMalloc
 *   with hipErrorOutOfMemory, nothing allocated, and hipGetDevice with
 *   hipErrorInvalidDevice, nothing read.
 *   memgov_standin_hip_fail_entry(fn,
 *   N) sets the same at run time (the count starts again), so that one
 *   process runs many fault cells.
 * - memgov_standin_hip_vmm() reports what is held, for tests.
 */
#define _GNU_SOURCE
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

#include "graph.h"
#include "vmm.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define GRANULE (2ull << 20)
#define HANDLE_MAGIC 0x48564d48u /* "HVMH" */
#define MAX_TOUCH 16

/* The header declares the handle opaque; the stand-in defines it. */
struct ihipMemGenericAllocationHandle {
    unsigned magic;
    int released;
    int maps; /* live mappings of it */
    int fd;
    uint64_t size;
    struct ihipMemGenericAllocationHandle *next;
};
typedef struct ihipMemGenericAllocationHandle handle_t;

/* The latest operation of one queue that uses a mapping: an event recorded
 * right after it. */
struct touch {
    uint64_t queue;
    struct sq_event *event;
};

struct mapping {
    uint64_t va, size;
    handle_t *h;
    int access; /* hipMemAccessFlags */
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
static handle_t *g_handles;
static struct mapping *g_maps;
static uint64_t g_phys_bytes;
/* Live reservations, read without the lock by vmm_copy so that copies of
 * ordinary allocations do not take it. */
static uint64_t g_res_count;
static uint64_t g_fail_vmm_at, g_fail_unmap_at, g_vmm_calls, g_unmap_calls;
static int g_vmm_init;

static void exit_check(void);

/* Under g_vmm: the knobs, read once. */
static void vmm_init(void) {
    if (g_vmm_init) return;
    g_vmm_init = 1;
    g_fail_vmm_at = sq_env_u64("MEMGOV_STANDIN_HIP_FAIL_VMM_AT", 0);
    g_fail_unmap_at = sq_env_u64("MEMGOV_STANDIN_HIP_FAIL_UNMAP_AT", 0);
    if (sq_env_u64("MEMGOV_STANDIN_HIP_EXIT_CHECK", 0) != 0) atexit(exit_check);
}

/* For tests: from now on the Nth call of `fn` fails (counting from this
 * call; N = 0 or fn = NULL: none), as MEMGOV_STANDIN_HIP_FAIL_ENTRY says at
 * process start. Returns 1 for a name too long, else 0. */
int memgov_standin_hip_fail_entry(const char *fn, unsigned long long n);
int memgov_standin_hip_fail_entry(const char *fn, unsigned long long n) {
    return sq_entry_fault_set(fn, n);
}

/* For tests that force an interleaving: from now on the Nth call of `fn`
 * (any entry point, at its entry) blocks before it changes anything, until
 * memgov_standin_hip_resume_entry(); memgov_standin_hip_entry_paused()
 * says whether one is held (exported through libamdhip64.map). See
 * sq_entry_pause_set. */
int memgov_standin_hip_pause_entry(const char *fn, unsigned long long n);
int memgov_standin_hip_pause_entry(const char *fn, unsigned long long n) {
    return sq_entry_pause_set(fn, n);
}

int memgov_standin_hip_entry_paused(void);
int memgov_standin_hip_entry_paused(void) {
    return sq_entry_paused();
}

void memgov_standin_hip_resume_entry(void);
void memgov_standin_hip_resume_entry(void) {
    sq_entry_resume();
}

int hip_standin_entry_fault(const char *fn) {
    return sq_entry_fault("MEMGOV_STANDIN_HIP_FAIL_ENTRY", fn);
}

/* Under g_vmm: count a create / map / set-access call; 1 when the fault
 * knob says this one fails. */
static int vmm_fault(void) { return g_fail_vmm_at != 0 && ++g_vmm_calls == g_fail_vmm_at; }

static void leave_call(int *unused) {
    (void)unused;
    hip_standin_leave();
}

/* Declares the HIP call in flight until the enclosing function returns; a
 * sticky device answers hipErrorIllegalAddress. */
#define VMM_ENTER(fn)                                                               \
    __attribute__((cleanup(leave_call))) int in_call_ = 0;                          \
    (void)in_call_;                                                                 \
    if (hip_standin_enter(fn)) return hipErrorIllegalAddress

/* A potentially unsafe call while a capture is under way (graph.c). */
#define UNSAFE_DURING_CAPTURE(fn, alloc)                                        \
    do {                                                                        \
        if (graph_unsafe != NULL && graph_unsafe(fn, alloc))                    \
            return hipErrorStreamCaptureUnsupported;                            \
    } while (0)

static int aligned(uint64_t v) { return v % GRANULE == 0; }

static int valid_prop(const hipMemAllocationProp *p) {
    return p != NULL && p->type == hipMemAllocationTypePinned &&
           p->location.type == hipMemLocationTypeDevice && p->location.id >= 0 &&
           p->location.id < hip_standin_devices();
}

/* Under g_vmm: the handle `h` names, or a contract violation naming fn. */
static handle_t *find_handle(hipMemGenericAllocationHandle_t h, const char *fn) {
    for (handle_t *x = g_handles; x != NULL; x = x->next) {
        if (x == h) {
            if (x->released)
                sq_die("%s of allocation handle %p, already released (hipMemRelease)", fn,
                       (void *)h);
            return x;
        }
    }
    sq_die("%s of %p, which is not a live allocation handle (never created by hipMemCreate, or "
           "released and its memory gone)",
           fn, (void *)h);
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
static void handle_maybe_free(handle_t *h) {
    if (!h->released || h->maps != 0) return;
    for (handle_t **p = &g_handles; *p != NULL; p = &(*p)->next) {
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

hipError_t hipMemGetAllocationGranularity(size_t *granularity, const hipMemAllocationProp *prop,
                                          hipMemAllocationGranularity_flags option) {
    VMM_ENTER("hipMemGetAllocationGranularity");
    if (granularity == NULL || !valid_prop(prop) ||
        (option != hipMemAllocationGranularityMinimum &&
         option != hipMemAllocationGranularityRecommended))
        return hipErrorInvalidValue;
    *granularity = GRANULE;
    return hipSuccess;
}

hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr,
                                unsigned long long flags) {
    VMM_ENTER("hipMemAddressReserve");
    (void)addr; /* a hint only */
    if (ptr == NULL || size == 0 || !aligned(size) || flags != 0 ||
        (alignment & (alignment - 1)) != 0)
        return hipErrorInvalidValue;
    uint64_t align = alignment > GRANULE ? alignment : GRANULE;
    size_t span = size + align;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return hipErrorOutOfMemory;
    uint64_t start = (uint64_t)(uintptr_t)p, base = (start + align - 1) / align * align;
    if (base > start) munmap(p, base - start);
    if (start + span > base + size)
        munmap((void *)(uintptr_t)(base + size), start + span - (base + size));
    struct reservation *r = malloc(sizeof *r);
    if (r == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_vmm);
    vmm_init();
    *r = (struct reservation){.va = base, .size = size, .next = g_res};
    g_res = r;
    __atomic_add_fetch(&g_res_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_vmm);
    *ptr = (void *)(uintptr_t)base;
    return hipSuccess;
}

hipError_t hipMemAddressFree(void *devPtr, size_t size) {
    VMM_ENTER("hipMemAddressFree");
    uint64_t ptr = (uint64_t)(uintptr_t)devPtr;
    pthread_mutex_lock(&g_vmm);
    struct reservation **p = &g_res;
    while (*p != NULL && !((*p)->va == ptr && (*p)->size == size)) p = &(*p)->next;
    if (*p == NULL) {
        pthread_mutex_unlock(&g_vmm);
        return hipErrorInvalidValue;
    }
    unsigned long long live = 0, bytes = 0;
    for (struct mapping *m = g_maps; m != NULL; m = m->next)
        if (m->va >= ptr && m->va - ptr < size) live++, bytes += m->size;
    if (live != 0)
        sq_die("hipMemAddressFree of reservation %p (%zu bytes) with %llu live mapping(s) "
               "(%llu bytes) in it: unmap them first (hipMemUnmap)",
               devPtr, size, live, bytes);
    struct reservation *r = *p;
    *p = r->next;
    __atomic_sub_fetch(&g_res_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_vmm);
    munmap((void *)(uintptr_t)r->va, r->size);
    free(r);
    return hipSuccess;
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                        const hipMemAllocationProp *prop, unsigned long long flags) {
    VMM_ENTER("hipMemCreate");
    UNSAFE_DURING_CAPTURE("hipMemCreate", 1);
    if (handle == NULL || size == 0 || !aligned(size) || flags != 0 || !valid_prop(prop))
        return hipErrorInvalidValue;
    pthread_mutex_lock(&g_vmm);
    vmm_init();
    if (vmm_fault() || hip_standin_entry_fault("hipMemCreate") ||
        g_phys_bytes + size > hip_standin_capacity()) {
        pthread_mutex_unlock(&g_vmm);
        return hipErrorOutOfMemory;
    }
    g_phys_bytes += size; /* claimed before the lock goes */
    pthread_mutex_unlock(&g_vmm);
    int fd = memfd_create("memgov-standin-hip-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0)
        sq_fatal("memfd of %zu bytes: %s", size, strerror(errno));
    handle_t *h = malloc(sizeof *h);
    if (h == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_vmm);
    *h = (handle_t){.magic = HANDLE_MAGIC, .fd = fd, .size = size, .next = g_handles};
    g_handles = h;
    pthread_mutex_unlock(&g_vmm);
    *handle = h;
    return hipSuccess;
}

hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
    VMM_ENTER("hipMemRelease");
    UNSAFE_DURING_CAPTURE("hipMemRelease", 0);
    pthread_mutex_lock(&g_vmm);
    handle_t *h = find_handle(handle, "hipMemRelease");
    if (hip_standin_entry_fault("hipMemRelease")) {
        pthread_mutex_unlock(&g_vmm);
        return hipErrorInvalidValue;
    }
    h->released = 1; /* the memory stays while mapped */
    handle_maybe_free(h);
    pthread_mutex_unlock(&g_vmm);
    return hipSuccess;
}

hipError_t hipMemMap(void *va, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
    VMM_ENTER("hipMemMap");
    UNSAFE_DURING_CAPTURE("hipMemMap", 0);
    uint64_t ptr = (uint64_t)(uintptr_t)va;
    pthread_mutex_lock(&g_vmm);
    handle_t *h = find_handle(handle, "hipMemMap");
    hipError_t r = hipSuccess;
    if (size == 0 || !aligned(ptr) || !aligned(size) || offset != 0 || flags != 0 ||
        size > h->size || reservation_of(ptr, size) == NULL) {
        r = hipErrorInvalidValue;
    } else {
        for (struct mapping *m = g_maps; m != NULL; m = m->next)
            if (m->va < ptr + size && ptr < m->va + m->size) r = hipErrorInvalidValue;
    }
    if (r == hipSuccess && (vmm_fault() || hip_standin_entry_fault("hipMemMap")))
        r = hipErrorInvalidValue; /* the reference's failure code for valid arguments */
    if (r != hipSuccess) {
        pthread_mutex_unlock(&g_vmm);
        return r;
    }
    void *p = mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0);
    if (p == MAP_FAILED) sq_fatal("mmap of a mapping: %s", strerror(errno));
    struct mapping *m = calloc(1, sizeof *m);
    if (m == NULL) sq_fatal("out of host memory");
    *m = (struct mapping){.va = ptr, .size = size, .h = h, .next = g_maps};
    g_maps = m;
    h->maps++;
    pthread_mutex_unlock(&g_vmm);
    return hipSuccess;
}

hipError_t hipMemSetAccess(void *va, size_t size, const hipMemAccessDesc *desc, size_t count) {
    VMM_ENTER("hipMemSetAccess");
    uint64_t ptr = (uint64_t)(uintptr_t)va;
    if (desc == NULL || count == 0 || size == 0) return hipErrorInvalidValue;
    int access = -1;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != hipMemLocationTypeDevice || desc[i].location.id < 0 ||
            desc[i].location.id >= hip_standin_devices())
            return hipErrorInvalidDevice;
        if (desc[i].flags != hipMemAccessFlagsProtNone &&
            desc[i].flags != hipMemAccessFlagsProtRead &&
            desc[i].flags != hipMemAccessFlagsProtReadWrite)
            return hipErrorInvalidValue;
        access = desc[i].flags;
    }
    pthread_mutex_lock(&g_vmm);
    /* The range must be whole mappings, back to back. */
    uint64_t at = ptr;
    while (at < ptr + size) {
        struct mapping *m = mapping_at(at);
        if (m == NULL || m->va != at || m->size > ptr + size - at) {
            pthread_mutex_unlock(&g_vmm);
            return hipErrorInvalidValue;
        }
        at += m->size;
    }
    if (vmm_fault() || hip_standin_entry_fault("hipMemSetAccess")) {
        pthread_mutex_unlock(&g_vmm);
        return hipErrorInvalidValue; /* the reference's failure code for valid arguments */
    }
    int prot = access == hipMemAccessFlagsProtReadWrite ? PROT_READ | PROT_WRITE
               : access == hipMemAccessFlagsProtRead    ? PROT_READ
                                                        : PROT_NONE;
    for (at = ptr; at < ptr + size;) {
        struct mapping *m = mapping_at(at);
        if (mprotect((void *)(uintptr_t)m->va, m->size, prot) != 0)
            sq_fatal("mprotect: %s", strerror(errno));
        m->access = access;
        at += m->size;
    }
    pthread_mutex_unlock(&g_vmm);
    return hipSuccess;
}

hipError_t hipMemUnmap(void *va, size_t size) {
    VMM_ENTER("hipMemUnmap");
    UNSAFE_DURING_CAPTURE("hipMemUnmap", 0);
    uint64_t ptr = (uint64_t)(uintptr_t)va;
    pthread_mutex_lock(&g_vmm);
    vmm_init();
    uint64_t at = ptr;
    while (size != 0 && at < ptr + size) {
        struct mapping *m = mapping_at(at);
        if (m == NULL || m->va != at || m->size > ptr + size - at) {
            pthread_mutex_unlock(&g_vmm);
            return hipErrorInvalidValue;
        }
        for (int i = 0; i < m->ntouch; i++)
            if (!sq_event_done(m->touches[i].event))
                sq_die("hipMemUnmap of 0x%llx (%llu bytes) while work queued on stream #%llu that "
                       "uses it has not completed: unmap only after every stream that touched the "
                       "memory has passed its last use",
                       (unsigned long long)m->va, (unsigned long long)m->size,
                       (unsigned long long)m->touches[i].queue);
        at += m->size;
    }
    if (size == 0) {
        pthread_mutex_unlock(&g_vmm);
        return hipErrorInvalidValue;
    }
    if ((g_fail_unmap_at != 0 && ++g_unmap_calls == g_fail_unmap_at) ||
        hip_standin_entry_fault("hipMemUnmap")) {
        pthread_mutex_unlock(&g_vmm);
        return hipErrorInvalidValue;
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
    return hipSuccess;
}

/* Under g_vmm: the copy's range is mapped read-write throughout. */
static void check_access(const char *fn, uint64_t addr, size_t bytes) {
    for (uint64_t at = addr; at < addr + bytes;) {
        struct mapping *m = mapping_at(at);
        if (m == NULL)
            sq_die("%s of %zu bytes at 0x%llx touches reserved address 0x%llx that is not mapped "
                   "(hipMemMap)",
                   fn, bytes, (unsigned long long)addr, (unsigned long long)at);
        if (m->access != hipMemAccessFlagsProtReadWrite)
            sq_die("%s of %zu bytes at 0x%llx touches mapping 0x%llx whose access was not set "
                   "read-write (hipMemSetAccess before use)",
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
                /* Keep the bound: an entry whose work is done makes room. */
                int freed = -1;
                for (int i = 0; i < m->ntouch && freed < 0; i++)
                    if (sq_event_done(m->touches[i].event)) freed = i;
                if (freed < 0)
                    sq_fatal("more than %d streams with work queued on one mapping", MAX_TOUCH);
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

int vmm_copy(const char *fn, int dst_device, int src_device, void *dst, const void *src,
             size_t bytes, struct sq_queue *q) {
    /* No reservation: not VMM memory (a reservation made concurrently with
     * this copy cannot contain its addresses). */
    if (__atomic_load_n(&g_res_count, __ATOMIC_ACQUIRE) == 0) return 0;
    uint64_t d = (uint64_t)(uintptr_t)dst, s = (uint64_t)(uintptr_t)src;
    pthread_mutex_lock(&g_vmm);
    int dst_vmm = dst_device && reservation_of(d, 1) != NULL;
    int src_vmm = src_device && reservation_of(s, 1) != NULL;
    if (!dst_vmm && !src_vmm) {
        pthread_mutex_unlock(&g_vmm);
        return 0;
    }
    if ((dst_device && !dst_vmm) || (src_device && !src_vmm))
        sq_die("%s between reserved memory and another kind of device memory: the stand-in "
               "copies arena memory only to and from the host",
               fn);
    if (dst_vmm) check_access(fn, d, bytes);
    if (src_vmm) check_access(fn, s, bytes);
    sq_queue_copy(q, dst, src, bytes);
    if (dst_vmm) touch(d, bytes, q);
    if (src_vmm) touch(s, bytes, q);
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
int memgov_standin_hip_vmm(unsigned long long out[6]);
int memgov_standin_hip_vmm(unsigned long long out[6]) {
    if (out == NULL) return -1;
    memset(out, 0, 6 * sizeof out[0]);
    pthread_mutex_lock(&g_vmm);
    for (struct reservation *r = g_res; r != NULL; r = r->next) out[0]++, out[1] += r->size;
    for (handle_t *h = g_handles; h != NULL; h = h->next) out[2]++;
    out[3] = g_phys_bytes;
    for (struct mapping *m = g_maps; m != NULL; m = m->next) out[4]++, out[5] += m->size;
    pthread_mutex_unlock(&g_vmm);
    return 0;
}

static void exit_check(void) {
    if (sq_knobs_sticky()) return;
    unsigned long long v[6];
    memgov_standin_hip_vmm(v);
    if (v[0] != 0 || v[2] != 0 || v[4] != 0)
        sq_die("at exit: %llu address reservation(s) (%llu bytes), %llu allocation handle(s) "
               "(%llu bytes of physical memory) and %llu mapping(s) (%llu bytes) never freed",
               v[0], v[1], v[2], v[3], v[4], v[5]);
}
