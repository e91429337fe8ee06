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
/* libcuda.c: the number of devices, and the bytes of device memory the
 * stand-in may hand out (its size, or the OOM knob when lower). */
int cuda_standin_devices(void);
uint64_t cuda_standin_capacity(void);
/* libcuda.c: whether the device is in the sticky error state. */
int cuda_standin_sticky(void);

/* The vmm.c hooks are weak so that libcuda.c also links without vmm.c (the
 * CI's imitation of a driver lacking entry points); libcuda.c calls them
 * only when present. */

/* vmm.c: whether [addr, addr + bytes) starts inside a virtual address
 * reservation (cuMemAddressReserve). When it does, the range is checked as
 * a device access by `fn`: every byte must be mapped (cuMemMap) with
 * read-write access set (cuMemSetAccess), else a contract violation. */
int vmm_check_access(const char *fn, uint64_t addr, size_t bytes) __attribute__((weak));
/* vmm.c: after pushing operation `seq` on q that uses [addr, addr + bytes)
 * (checked by vmm_check_access): the mappings it touches remember that q's
 * work up to that operation uses them, for cuMemUnmap's check. */
void vmm_touch(uint64_t addr, size_t bytes, struct sq_queue *q) __attribute__((weak));
/* vmm.c: physical memory of live allocation handles (cuMemCreate), bytes. */
uint64_t vmm_physical_bytes(void) __attribute__((weak));

#pragma GCC visibility pop

#endif
