/*
 * sq_vmm.c: the virtual memory management imitation of the CUDA and HIP
 * stand-ins, on host memory. Compiled as part of the virtual memory section
 * of the vendor's stand-in file, which includes it (see sq_vmm.h); every
 * function takes the vendor's table.
 *
 * How it imitates:
 * - A reservation is host address space (mmap PROT_NONE, MAP_NORESERVE): a
 *   device pointer is still the host address, as in the rest of the
 *   stand-in.
 * - Physical memory (cuMemCreate / hipMemCreate) is a memfd of the handle's
 *   size, backed sparsely by the kernel; the map call maps it MAP_SHARED at
 *   the address with no access (PROT_NONE), the set-access call makes it
 *   readable and writable, the unmap call turns the range back into a
 *   reservation. The same handle mapped again shows the same bytes.
 * - The granularity (minimum and recommended) is 2 MiB.
 *
 * Rules, from the CUDA Driver API's Virtual Memory Management section and
 * HIP's reference (Virtual Memory Management) with its programming guide's
 * "Virtual memory management" how-to, which describe the same calls:
 * - Returned as the invalid-value code, as both references list for each
 *   call: sizes and addresses not multiples of the granularity (HIP's
 *   hipMemGetAllocationGranularity: "the size must be aligned to it"), an
 *   alignment that is not a power of two, nonzero flags (HIP: "currently
 *   unused, must be zero"), properties that are not pinned device memory of
 *   a valid device, a map outside one reservation, past the end of the
 *   handle's memory or over an existing mapping, an unmap or set-access
 *   range that is not whole mappings, an address-free range that is not a
 *   reservation. A set-access descriptor naming no valid device is the
 *   invalid-device code. The create call beyond the device's memory is the
 *   out-of-memory code.
 * - The map offset (the one documented difference in the arguments): CUDA's
 *   cuMemMap takes an offset into the handle's memory, a multiple of the
 *   granularity within it; HIP's hipMemMap documents that the offset
 *   "currently must be zero" (sq_vmm_vendor.map_offset_must_be_zero).
 * - Contract violations (undefined behaviour on the device; the stand-in
 *   aborts): a copy touching reserved memory that is not mapped, or mapped
 *   without read-write access set (set access before use; HIP's how-to:
 *   memory is not accessible until access is granted); an unmap of a
 *   mapping that queued work on any stream still uses (the last operation
 *   touching it has not completed); an address free of a reservation with
 *   live mappings (HIP's how-to frees in the order unmap, release, address
 *   free); a release or map of a handle already released (or never
 *   created). A handle released while still mapped is legal: its memory
 *   goes when its last mapping is unmapped. HIP's reference does not say
 *   what these do; the stand-in holds HIP to the CUDA rules its calls
 *   mirror (the README lists where this is stricter than AMD's
 *   documentation).
 * - With <prefix>_EXIT_CHECK=1, any reservation, allocation handle or
 *   mapping left at exit is a contract violation (unless the device is in
 *   the sticky error state: a dead device keeps what it had).
 * - Fault knobs: <prefix>_FAIL_VMM_AT=N, the Nth create, map or set-access
 *   call (counted together) fails and changes nothing, with a code the
 *   vendor's reference lists for that call: the create call with the
 *   out-of-memory code, map and set-access with the invalid-value code
 *   (their references list no out-of-memory code); <prefix>_FAIL_UNMAP_AT=N,
 *   the Nth unmap fails with the vendor's unmap_failure code and leaves the
 *   mapping as it was (every later unmap of it succeeds). The vendor's
 *   FAIL_ENTRY knob (entry_fault) fails the Nth call of one entry point
 *   that passed its argument checks the same way; release with the
 *   vendor's release_failure code, leaving the handle as it was.
 */
#define _GNU_SOURCE
#include "sq_vmm.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SQ_VMM_GRANULE (2ull << 20)
#define SQ_VMM_HANDLE_MAGIC 0x564d4d48u /* "VMMH" */
#define SQ_VMM_MAX_TOUCH 16

struct sq_vmm_handle {
    unsigned magic;
    int released;
    int maps; /* live mappings of it */
    int fd;
    uint64_t size;
    struct sq_vmm_handle *next;
};

/* The latest operation of one queue that uses a mapping: an event recorded
 * right after it (events keep their queue readable after it is destroyed). */
struct sq_vmm_touch {
    uint64_t queue;
    struct sq_event *event;
};

struct sq_vmm_mapping {
    uint64_t va, size, offset;
    struct sq_vmm_handle *h;
    int access; /* SQ_VMM_PROT_* */
    struct sq_vmm_touch touches[SQ_VMM_MAX_TOUCH];
    int ntouch;
    struct sq_vmm_mapping *next;
};

struct sq_vmm_reservation {
    uint64_t va, size;
    struct sq_vmm_reservation *next;
};

static pthread_mutex_t g_vmm = PTHREAD_MUTEX_INITIALIZER;
static struct sq_vmm_reservation *g_res;
static struct sq_vmm_handle *g_handles;
static struct sq_vmm_mapping *g_maps;
static uint64_t g_phys_bytes;
/* Live reservations, read without the lock by sq_vmm_copy so that copies of
 * ordinary allocations do not take it. */
static uint64_t g_res_count;
static uint64_t g_fail_vmm_at, g_fail_unmap_at, g_vmm_calls, g_unmap_calls;
static int g_vmm_init;
/* The vendor whose exit check is armed (one per library). */
static const struct sq_vmm_vendor *g_vmm_exit_vendor;

static void sq_vmm_exit_check(void);

/* The vendor's knob <prefix>_<name>. */
static uint64_t sq_vmm_knob(const struct sq_vmm_vendor *v, const char *name) {
    char var[96];
    snprintf(var, sizeof var, "%s_%s", v->prefix, name);
    return sq_env_u64(var, 0);
}

/* Under g_vmm: the knobs, read once. */
static void sq_vmm_init(const struct sq_vmm_vendor *v) {
    if (g_vmm_init) return;
    g_vmm_init = 1;
    g_fail_vmm_at = sq_vmm_knob(v, "FAIL_VMM_AT");
    g_fail_unmap_at = sq_vmm_knob(v, "FAIL_UNMAP_AT");
    if (sq_vmm_knob(v, "EXIT_CHECK") != 0) {
        g_vmm_exit_vendor = v;
        atexit(sq_vmm_exit_check);
    }
}

/* Under g_vmm: count a create / map / set-access call; 1 when the fault
 * knob says this one fails. */
static int sq_vmm_fault(void) { return g_fail_vmm_at != 0 && ++g_vmm_calls == g_fail_vmm_at; }

static int sq_vmm_entry_fault(const struct sq_vmm_vendor *v, const char *fn) {
    return v->entry_fault != NULL && v->entry_fault(fn);
}

static int sq_vmm_aligned(uint64_t x) { return x % SQ_VMM_GRANULE == 0; }

static int sq_vmm_valid_prop(const struct sq_vmm_vendor *v, const struct sq_vmm_prop *p) {
    return p != NULL && p->pinned && p->on_device && p->device >= 0 && p->device < v->devices();
}

/* Under g_vmm: the handle `h` names, or a contract violation naming fn. */
static struct sq_vmm_handle *sq_vmm_find_handle(const struct sq_vmm_vendor *v, uint64_t h,
                                                const char *fn) {
    for (struct sq_vmm_handle *x = g_handles; x != NULL; x = x->next) {
        if ((uintptr_t)x == h) {
            if (x->released)
                sq_die("%s of allocation handle 0x%llx, already released (%s)", fn,
                       (unsigned long long)h, v->release);
            return x;
        }
    }
    sq_die("%s of 0x%llx, which is not a live allocation handle (never created by %s, "
           "or released and its memory gone)",
           fn, (unsigned long long)h, v->create);
}

static struct sq_vmm_reservation *sq_vmm_reservation_of(uint64_t va, uint64_t size) {
    for (struct sq_vmm_reservation *r = g_res; r != NULL; r = r->next)
        if (va >= r->va && va - r->va < r->size && size <= r->size - (va - r->va)) return r;
    return NULL;
}

static struct sq_vmm_mapping *sq_vmm_mapping_at(uint64_t va) {
    for (struct sq_vmm_mapping *m = g_maps; m != NULL; m = m->next)
        if (va >= m->va && va - m->va < m->size) return m;
    return NULL;
}

/* Under g_vmm: whether [ptr, ptr + size) is whole mappings, back to back
 * (what the unmap and set-access calls take). */
static int sq_vmm_whole_mappings(uint64_t ptr, uint64_t size) {
    for (uint64_t at = ptr; at < ptr + size;) {
        struct sq_vmm_mapping *m = sq_vmm_mapping_at(at);
        if (m == NULL || m->va != at || m->size > ptr + size - at) return 0;
        at += m->size;
    }
    return 1;
}

/* Under g_vmm: the memory of a handle released and no longer mapped goes. */
static void sq_vmm_handle_maybe_free(struct sq_vmm_handle *h) {
    if (!h->released || h->maps != 0) return;
    for (struct sq_vmm_handle **p = &g_handles; *p != NULL; p = &(*p)->next) {
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

/* cuMemGetAllocationGranularity / hipMemGetAllocationGranularity. `option`
 * is 0 (minimum) or 1 (recommended) in both vendors' enums. */
static int sq_vmm_granularity(const struct sq_vmm_vendor *v, size_t *granularity,
                              const struct sq_vmm_prop *prop, int option) {
    if (granularity == NULL || !sq_vmm_valid_prop(v, prop) || (option != 0 && option != 1))
        return v->invalid_value;
    *granularity = SQ_VMM_GRANULE;
    return v->success;
}

/* cuMemAddressReserve / hipMemAddressReserve (the address is a hint only). */
static int sq_vmm_reserve(const struct sq_vmm_vendor *v, uint64_t *ptr, size_t size,
                          size_t alignment, unsigned long long flags) {
    if (ptr == NULL || size == 0 || !sq_vmm_aligned(size) || flags != 0 ||
        (alignment & (alignment - 1)) != 0)
        return v->invalid_value;
    uint64_t align = alignment > SQ_VMM_GRANULE ? alignment : SQ_VMM_GRANULE;
    size_t span = size + align;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return v->out_of_memory;
    uint64_t start = (uint64_t)(uintptr_t)p, base = (start + align - 1) / align * align;
    if (base > start) munmap(p, base - start);
    if (start + span > base + size)
        munmap((void *)(uintptr_t)(base + size), start + span - (base + size));
    struct sq_vmm_reservation *r = malloc(sizeof *r);
    if (r == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_vmm);
    sq_vmm_init(v);
    *r = (struct sq_vmm_reservation){.va = base, .size = size, .next = g_res};
    g_res = r;
    __atomic_add_fetch(&g_res_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_vmm);
    *ptr = base;
    return v->success;
}

/* cuMemAddressFree / hipMemAddressFree. */
static int sq_vmm_address_free(const struct sq_vmm_vendor *v, uint64_t ptr, size_t size) {
    pthread_mutex_lock(&g_vmm);
    struct sq_vmm_reservation **p = &g_res;
    while (*p != NULL && !((*p)->va == ptr && (*p)->size == size)) p = &(*p)->next;
    if (*p == NULL) {
        pthread_mutex_unlock(&g_vmm);
        return v->invalid_value;
    }
    unsigned long long live = 0, bytes = 0;
    for (struct sq_vmm_mapping *m = g_maps; m != NULL; m = m->next)
        if (m->va >= ptr && m->va - ptr < size) live++, bytes += m->size;
    if (live != 0)
        sq_die("%s of reservation 0x%llx (%zu bytes) with %llu live mapping(s) "
               "(%llu bytes) in it: unmap them first (%s)",
               v->address_free, (unsigned long long)ptr, size, live, bytes, v->unmap);
    struct sq_vmm_reservation *r = *p;
    *p = r->next;
    __atomic_sub_fetch(&g_res_count, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_vmm);
    munmap((void *)(uintptr_t)r->va, r->size);
    free(r);
    return v->success;
}

/* The capture rule of the potentially unsafe calls (create, release, map,
 * unmap: they change memory outside any stream): checked first, before
 * their arguments, as the vendors' captures prohibit the call itself. */
#define SQ_VMM_UNSAFE_DURING_CAPTURE(v, fn, alloc)                                     \
    do {                                                                               \
        if ((v)->unsafe_during_capture != NULL && (v)->unsafe_during_capture(fn, alloc)) \
            return (v)->capture_unsupported;                                           \
    } while (0)

/* cuMemCreate / hipMemCreate. */
static int sq_vmm_create(const struct sq_vmm_vendor *v, uint64_t *handle, size_t size,
                         const struct sq_vmm_prop *prop, unsigned long long flags) {
    SQ_VMM_UNSAFE_DURING_CAPTURE(v, v->create, 1);
    if (handle == NULL || size == 0 || !sq_vmm_aligned(size) || flags != 0 ||
        !sq_vmm_valid_prop(v, prop))
        return v->invalid_value;
    pthread_mutex_lock(&g_vmm);
    sq_vmm_init(v);
    if (sq_vmm_fault() || sq_vmm_entry_fault(v, v->create) ||
        g_phys_bytes + size > v->capacity()) {
        pthread_mutex_unlock(&g_vmm);
        return v->out_of_memory;
    }
    g_phys_bytes += size; /* claimed before the lock goes */
    pthread_mutex_unlock(&g_vmm);
    int fd = memfd_create(v->memfd_name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0)
        sq_fatal("memfd of %zu bytes: %s", size, strerror(errno));
    struct sq_vmm_handle *h = malloc(sizeof *h);
    if (h == NULL) sq_fatal("out of host memory");
    pthread_mutex_lock(&g_vmm);
    *h = (struct sq_vmm_handle){
        .magic = SQ_VMM_HANDLE_MAGIC, .fd = fd, .size = size, .next = g_handles};
    g_handles = h;
    pthread_mutex_unlock(&g_vmm);
    *handle = (uint64_t)(uintptr_t)h;
    return v->success;
}

/* cuMemRelease / hipMemRelease. */
static int sq_vmm_release(const struct sq_vmm_vendor *v, uint64_t handle) {
    SQ_VMM_UNSAFE_DURING_CAPTURE(v, v->release, 0);
    pthread_mutex_lock(&g_vmm);
    struct sq_vmm_handle *h = sq_vmm_find_handle(v, handle, v->release);
    if (sq_vmm_entry_fault(v, v->release)) {
        pthread_mutex_unlock(&g_vmm);
        return v->release_failure;
    }
    h->released = 1; /* the memory stays while mapped */
    sq_vmm_handle_maybe_free(h);
    pthread_mutex_unlock(&g_vmm);
    return v->success;
}

/* cuMemMap / hipMemMap. */
static int sq_vmm_map(const struct sq_vmm_vendor *v, uint64_t ptr, size_t size, size_t offset,
                      uint64_t handle, unsigned long long flags) {
    SQ_VMM_UNSAFE_DURING_CAPTURE(v, v->map, 0);
    pthread_mutex_lock(&g_vmm);
    struct sq_vmm_handle *h = sq_vmm_find_handle(v, handle, v->map);
    int r = v->success;
    if (size == 0 || !sq_vmm_aligned(ptr) || !sq_vmm_aligned(size) || !sq_vmm_aligned(offset) ||
        (v->map_offset_must_be_zero && offset != 0) || flags != 0 || offset > h->size ||
        size > h->size - offset || sq_vmm_reservation_of(ptr, size) == NULL) {
        r = v->invalid_value;
    } else {
        for (struct sq_vmm_mapping *m = g_maps; m != NULL; m = m->next)
            if (m->va < ptr + size && ptr < m->va + m->size) r = v->invalid_value;
    }
    if (r == v->success && (sq_vmm_fault() || sq_vmm_entry_fault(v, v->map)))
        r = v->invalid_value; /* the reference's failure code for valid arguments */
    if (r != v->success) {
        pthread_mutex_unlock(&g_vmm);
        return r;
    }
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd,
                   (off_t)offset);
    if (p == MAP_FAILED) sq_fatal("mmap of a mapping: %s", strerror(errno));
    struct sq_vmm_mapping *m = calloc(1, sizeof *m);
    if (m == NULL) sq_fatal("out of host memory");
    *m = (struct sq_vmm_mapping){.va = ptr, .size = size, .offset = offset, .h = h, .next = g_maps};
    g_maps = m;
    h->maps++;
    pthread_mutex_unlock(&g_vmm);
    return v->success;
}

/* cuMemSetAccess / hipMemSetAccess: `desc` is the vendor's array of `count`
 * descriptors, read through v->access_of. */
static int sq_vmm_set_access(const struct sq_vmm_vendor *v, uint64_t ptr, size_t size,
                             const void *desc, size_t count) {
    if (desc == NULL || count == 0 || size == 0) return v->invalid_value;
    int access = -1;
    for (size_t i = 0; i < count; i++) {
        struct sq_vmm_access a = v->access_of(desc, i);
        if (!a.on_device || a.device < 0 || a.device >= v->devices()) return v->invalid_device;
        if (a.flags != SQ_VMM_PROT_NONE && a.flags != SQ_VMM_PROT_READ &&
            a.flags != SQ_VMM_PROT_READWRITE)
            return v->invalid_value;
        access = a.flags;
    }
    pthread_mutex_lock(&g_vmm);
    if (!sq_vmm_whole_mappings(ptr, size)) {
        pthread_mutex_unlock(&g_vmm);
        return v->invalid_value;
    }
    if (sq_vmm_fault() || sq_vmm_entry_fault(v, v->set_access)) {
        pthread_mutex_unlock(&g_vmm);
        return v->invalid_value; /* the reference's failure code for valid arguments */
    }
    int prot = access == SQ_VMM_PROT_READWRITE ? PROT_READ | PROT_WRITE
               : access == SQ_VMM_PROT_READ    ? PROT_READ
                                               : PROT_NONE;
    for (uint64_t at = ptr; at < ptr + size;) {
        struct sq_vmm_mapping *m = sq_vmm_mapping_at(at);
        if (mprotect((void *)(uintptr_t)m->va, m->size, prot) != 0)
            sq_fatal("mprotect: %s", strerror(errno));
        m->access = access;
        at += m->size;
    }
    pthread_mutex_unlock(&g_vmm);
    return v->success;
}

/* cuMemUnmap / hipMemUnmap. */
static int sq_vmm_unmap(const struct sq_vmm_vendor *v, uint64_t ptr, size_t size) {
    SQ_VMM_UNSAFE_DURING_CAPTURE(v, v->unmap, 0);
    pthread_mutex_lock(&g_vmm);
    sq_vmm_init(v);
    uint64_t at = ptr;
    while (size != 0 && at < ptr + size) {
        struct sq_vmm_mapping *m = sq_vmm_mapping_at(at);
        if (m == NULL || m->va != at || m->size > ptr + size - at) {
            pthread_mutex_unlock(&g_vmm);
            return v->invalid_value;
        }
        for (int i = 0; i < m->ntouch; i++)
            if (!sq_event_done(m->touches[i].event))
                sq_die("%s of 0x%llx (%llu bytes) while work queued on stream #%llu that "
                       "uses it has not completed: unmap only after every stream that touched the "
                       "memory has passed its last use",
                       v->unmap, (unsigned long long)m->va, (unsigned long long)m->size,
                       (unsigned long long)m->touches[i].queue);
        at += m->size;
    }
    if (size == 0) {
        pthread_mutex_unlock(&g_vmm);
        return v->invalid_value;
    }
    if ((g_fail_unmap_at != 0 && ++g_unmap_calls == g_fail_unmap_at) ||
        sq_vmm_entry_fault(v, v->unmap)) {
        pthread_mutex_unlock(&g_vmm);
        return v->unmap_failure;
    }
    for (at = ptr; at < ptr + size;) {
        struct sq_vmm_mapping *m = sq_vmm_mapping_at(at);
        void *p = mmap((void *)(uintptr_t)m->va, m->size, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        if (p == MAP_FAILED) sq_fatal("mmap over an unmapped range: %s", strerror(errno));
        for (struct sq_vmm_mapping **q = &g_maps; *q != NULL; q = &(*q)->next) {
            if (*q == m) {
                *q = m->next;
                break;
            }
        }
        at += m->size;
        for (int i = 0; i < m->ntouch; i++) sq_event_destroy(m->touches[i].event);
        m->h->maps--;
        sq_vmm_handle_maybe_free(m->h);
        free(m);
    }
    pthread_mutex_unlock(&g_vmm);
    return v->success;
}

/* Under g_vmm: the copy's range is mapped read-write throughout. */
static void sq_vmm_check_access(const struct sq_vmm_vendor *v, const char *fn, uint64_t addr,
                                size_t bytes) {
    for (uint64_t at = addr; at < addr + bytes;) {
        struct sq_vmm_mapping *m = sq_vmm_mapping_at(at);
        if (m == NULL)
            sq_die("%s of %zu bytes at 0x%llx touches reserved address 0x%llx that is not mapped "
                   "(%s)",
                   fn, bytes, (unsigned long long)addr, (unsigned long long)at, v->map);
        if (m->access != SQ_VMM_PROT_READWRITE)
            sq_die("%s of %zu bytes at 0x%llx touches mapping 0x%llx whose access was not set "
                   "read-write (%s before use)",
                   fn, bytes, (unsigned long long)addr, (unsigned long long)m->va, v->set_access);
        at = m->va + m->size;
    }
}

/* Under g_vmm: the mappings of [addr, addr + bytes) are used by q's work up
 * to its last queued operation. */
static void sq_vmm_touch(uint64_t addr, size_t bytes, struct sq_queue *q) {
    uint64_t qid = sq_queue_id(q);
    for (uint64_t at = addr; at < addr + bytes;) {
        struct sq_vmm_mapping *m = sq_vmm_mapping_at(at);
        struct sq_vmm_touch *t = NULL;
        for (int i = 0; i < m->ntouch && t == NULL; i++)
            if (m->touches[i].queue == qid) t = &m->touches[i];
        if (t == NULL) {
            if (m->ntouch == SQ_VMM_MAX_TOUCH) {
                /* Keep the bound: an entry whose work is done makes room
                 * (else the check would be lost). */
                int freed = -1;
                for (int i = 0; i < m->ntouch && freed < 0; i++)
                    if (sq_event_done(m->touches[i].event)) freed = i;
                if (freed < 0)
                    sq_fatal("more than %d streams with work queued on one mapping",
                             SQ_VMM_MAX_TOUCH);
                sq_event_destroy(m->touches[freed].event);
                m->touches[freed] = m->touches[--m->ntouch];
            }
            t = &m->touches[m->ntouch++];
            *t = (struct sq_vmm_touch){.queue = qid, .event = sq_event_new()};
        }
        sq_event_record(t->event, q);
        at = m->va + m->size;
    }
}

/* A copy of `bytes` from `src` to `dst` about to be queued on q by entry
 * point `fn`, whose device side(s) are dst (dst_device) and/or src
 * (src_device). Returns 0 when no device side lies in a reservation: the
 * caller checks and queues it as usual. Else every device side is checked
 * as a device access (each byte mapped, with read-write access set, else a
 * contract violation), the copy is queued, and the mappings it touches
 * remember that q's work up to it uses them (the unmap call's check); all
 * under the table's lock, so that no unmap comes in between. Returns 1. */
static int sq_vmm_copy(const struct sq_vmm_vendor *v, const char *fn, int dst_device,
                       int src_device, void *dst, const void *src, size_t bytes,
                       struct sq_queue *q) {
    /* No reservation: not VMM memory (a reservation made concurrently with
     * this copy cannot contain its addresses). */
    if (__atomic_load_n(&g_res_count, __ATOMIC_ACQUIRE) == 0) return 0;
    uint64_t d = (uint64_t)(uintptr_t)dst, s = (uint64_t)(uintptr_t)src;
    pthread_mutex_lock(&g_vmm);
    int dst_vmm = dst_device && sq_vmm_reservation_of(d, 1) != NULL;
    int src_vmm = src_device && sq_vmm_reservation_of(s, 1) != NULL;
    if (!dst_vmm && !src_vmm) {
        pthread_mutex_unlock(&g_vmm);
        return 0;
    }
    if ((dst_device && !dst_vmm) || (src_device && !src_vmm))
        sq_die("%s between reserved memory and another kind of device memory: the stand-in "
               "copies arena memory only to and from the host",
               fn);
    if (dst_vmm) sq_vmm_check_access(v, fn, d, bytes);
    if (src_vmm) sq_vmm_check_access(v, fn, s, bytes);
    sq_queue_copy(q, dst, src, bytes);
    if (dst_vmm) sq_vmm_touch(d, bytes, q);
    if (src_vmm) sq_vmm_touch(s, bytes, q);
    pthread_mutex_unlock(&g_vmm);
    return 1;
}

/* Physical memory of live allocation handles, bytes (counted as used in the
 * vendor's memory info). */
static uint64_t sq_vmm_physical_bytes(void) {
    pthread_mutex_lock(&g_vmm);
    uint64_t b = g_phys_bytes;
    pthread_mutex_unlock(&g_vmm);
    return b;
}

/* For tests: what the process holds, as {reservations, reserved bytes,
 * allocation handles (released but still mapped included), physical bytes,
 * mappings, mapped bytes}. Returns 0. */
static int sq_vmm_held(unsigned long long out[6]) {
    if (out == NULL) return -1;
    memset(out, 0, 6 * sizeof out[0]);
    pthread_mutex_lock(&g_vmm);
    for (struct sq_vmm_reservation *r = g_res; r != NULL; r = r->next) out[0]++, out[1] += r->size;
    for (struct sq_vmm_handle *h = g_handles; h != NULL; h = h->next) out[2]++;
    out[3] = g_phys_bytes;
    for (struct sq_vmm_mapping *m = g_maps; m != NULL; m = m->next) out[4]++, out[5] += m->size;
    pthread_mutex_unlock(&g_vmm);
    return 0;
}

static void sq_vmm_exit_check(void) {
    if (g_vmm_exit_vendor->sticky()) return;
    unsigned long long h[6];
    sq_vmm_held(h);
    if (h[0] != 0 || h[2] != 0 || h[4] != 0)
        sq_die("at exit: %llu address reservation(s) (%llu bytes), %llu allocation handle(s) "
               "(%llu bytes of physical memory) and %llu mapping(s) (%llu bytes) never freed",
               h[0], h[1], h[2], h[3], h[4], h[5]);
}
