/*
 * vmm.h: what libamdhip64.c and vmm.c (HIP's virtual memory management
 * calls) share inside the stand-in. Internal to the library.
 */
#ifndef MEMGOV_STANDIN_HIP_VMM_H
#define MEMGOV_STANDIN_HIP_VMM_H

#include "standin.h"

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* libamdhip64.c: the entry of every HIP call (counted in
 * memgov_standin_hip_calls, none from a stream callback, the sticky error
 * knob ticked; returns 1 when the device is sticky) and its exit. */
int hip_standin_enter(const char *fn);
void hip_standin_leave(void);

/* vmm.c and graph.c: declares the HIP call `fn` in flight until the
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
/* libamdhip64.c: the number of devices, the calling thread's current one,
 * and the bytes of device memory the stand-in may hand out. */
int hip_standin_devices(void);
int hip_standin_current_device(void);
uint64_t hip_standin_capacity(void);

/* The vmm.c hooks are weak, so that libamdhip64.c also links without vmm.c
 * (a ROCm lacking the virtual memory calls); libamdhip64.c calls them only
 * when present. */

/* vmm.c: an asynchronous copy of `bytes` from `src` to `dst` about to be
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
/* vmm.c: 1 when this call of `fn` is the one the MEMGOV_STANDIN_HIP_
 * FAIL_ENTRY knob says fails (counted per process). */
int hip_standin_entry_fault(const char *fn) __attribute__((weak));
/* vmm.c: physical memory of live allocation handles (hipMemCreate), bytes. */
uint64_t vmm_physical_bytes(void) __attribute__((weak));

#pragma GCC visibility pop

#endif
