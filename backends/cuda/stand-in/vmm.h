/*
 * vmm.h: what libcuda.c and vmm.c (the virtual memory management calls)
 * share inside the stand-in. Internal to the library.
 */
#ifndef MEMGOV_STANDIN_CUDA_VMM_H
#define MEMGOV_STANDIN_CUDA_VMM_H

#include "standin.h"

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* libcuda.c: the entry checks of every driver call (no call from a host
 * function; the sticky error knob counts it). Returns 1 when the device is
 * in the sticky error state, -1 before cuInit, else 0. */
int cuda_standin_enter(const char *fn);
/* vmm.c and graph.c: the entry of driver call `fn` (cuda_standin_enter):
 * CUDA_ERROR_NOT_INITIALIZED before cuInit, CUDA_ERROR_ILLEGAL_ADDRESS on a
 * sticky device (the file defines both names). */
#define CUDA_STANDIN_CALL(fn)                                   \
    do {                                                        \
        int e_ = cuda_standin_enter(fn);                        \
        if (e_ < 0) return CUDA_ERROR_NOT_INITIALIZED;          \
        if (e_ > 0) return CUDA_ERROR_ILLEGAL_ADDRESS;          \
    } while (0)
/* libcuda.c: the number of devices, and the bytes of device memory the
 * stand-in may hand out (its size, or the OOM knob when lower). */
int cuda_standin_devices(void);
uint64_t cuda_standin_capacity(void);
/* libcuda.c: whether the device is in the sticky error state. */
int cuda_standin_sticky(void);

/* The vmm.c hooks are weak so that libcuda.c also links without vmm.c (the
 * CI's imitation of a driver lacking entry points); libcuda.c calls them
 * only when present. */

/* vmm.c: a copy touching device memory at [addr, addr + bytes), about to be
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
/* vmm.c: whether this call of entry point `fn` is the one the
 * MEMGOV_STANDIN_CUDA_FAIL_ENTRY knob says fails (counted per process). */
int standin_entry_fault(const char *fn) __attribute__((weak));
/* vmm.c: physical memory of live allocation handles (cuMemCreate), bytes. */
uint64_t vmm_physical_bytes(void) __attribute__((weak));

#pragma GCC visibility pop

#endif
