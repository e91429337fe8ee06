/*
 * differences.c: checks, on a built stand-in, the documented differences
 * between CUDA's and HIP's virtual memory calls that each vendor's table
 * gives sq_vmm.c (run by selftest.sh):
 *
 *   differences cuda <path of libcuda.so.1>
 *   differences hip <path of libamdhip64.so.5>
 *
 * - The map offset. CUDA Driver API, cuMemMap: "offset - Offset into the
 *   memory represented by handle from which to start mapping" (a multiple
 *   of the granularity): the second half of a handle mapped at offset
 *   2 MiB shows the same bytes as the handle's second half mapped
 *   elsewhere. HIP reference, hipMemMap: "offset - offset into the memory,
 *   currently must be zero": a nonzero offset is hipErrorInvalidValue and
 *   maps nothing.
 * - The code of an unmap or release that fails (the FAIL_ENTRY knob): a
 *   code each reference lists for the call, CUDA_ERROR_UNKNOWN (999) for
 *   cuMemUnmap and cuMemRelease, hipErrorInvalidValue (1) for hipMemUnmap
 *   and hipMemRelease; the mapping or handle stays, and the call again
 *   succeeds.
 *
 * Prints "ok", or one line naming the first check that failed and exits 1.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1ull << 20)

static void *g_lib;

static void *sym(const char *name) {
    void *p = dlsym(g_lib, name);
    if (p == NULL) {
        printf("differences: %s missing from the stand-in\n", name);
        exit(1);
    }
    return p;
}

static void expect(const char *what, long long got, long long want) {
    if (got != want) {
        printf("differences: %s returned %lld, expected %lld\n", what, got, want);
        exit(1);
    }
}

/* ---- CUDA: the layouts of the CUDA 12 headers -------------------------------- */

struct cu_location {
    int type, id;
};
struct cu_prop {
    int type, requestedHandleTypes;
    struct cu_location location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
};
struct cu_access {
    struct cu_location location;
    int flags;
};

static void cuda(void) {
    int (*cuInit)(unsigned) = sym("cuInit");
    int (*reserve)(uint64_t *, size_t, size_t, uint64_t, unsigned long long) =
        sym("cuMemAddressReserve");
    int (*address_free)(uint64_t, size_t) = sym("cuMemAddressFree");
    int (*create)(uint64_t *, size_t, const struct cu_prop *, unsigned long long) =
        sym("cuMemCreate");
    int (*release)(uint64_t) = sym("cuMemRelease");
    int (*map)(uint64_t, size_t, size_t, uint64_t, unsigned long long) = sym("cuMemMap");
    int (*unmap)(uint64_t, size_t) = sym("cuMemUnmap");
    int (*set_access)(uint64_t, size_t, const struct cu_access *, size_t) = sym("cuMemSetAccess");
    int (*fail_entry)(const char *, unsigned long long) = sym("memgov_standin_cuda_fail_entry");

    expect("cuInit", cuInit(0), 0);
    struct cu_prop prop = {.type = 1, .location = {.type = 1, .id = 0}}; /* pinned, device 0 */
    struct cu_access rw = {.location = {.type = 1, .id = 0}, .flags = 3}; /* read-write */
    uint64_t va, va2, h;
    expect("cuMemAddressReserve 4 MiB", reserve(&va, 4 * MIB, 0, 0, 0), 0);
    expect("cuMemAddressReserve 2 MiB", reserve(&va2, 2 * MIB, 0, 0, 0), 0);
    expect("cuMemCreate 4 MiB", create(&h, 4 * MIB, &prop, 0), 0);
    expect("cuMemMap of the handle's first half", map(va, 2 * MIB, 0, h, 0), 0);
    expect("cuMemMap at offset 2 MiB", map(va + 2 * MIB, 2 * MIB, 2 * MIB, h, 0), 0);
    expect("cuMemMap at offset 2 MiB, elsewhere", map(va2, 2 * MIB, 2 * MIB, h, 0), 0);
    expect("cuMemSetAccess", set_access(va, 4 * MIB, &rw, 1), 0);
    expect("cuMemSetAccess", set_access(va2, 2 * MIB, &rw, 1), 0);
    ((volatile unsigned char *)(uintptr_t)va)[2 * MIB + 7] = 0x5a;
    ((volatile unsigned char *)(uintptr_t)va)[7] = 0x11;
    expect("the handle's byte 2 MiB + 7 through the other mapping at offset 2 MiB",
           ((volatile unsigned char *)(uintptr_t)va2)[7], 0x5a);

    fail_entry("cuMemUnmap", 1);
    expect("cuMemUnmap with FAIL_ENTRY", unmap(va2, 2 * MIB), 999);
    expect("cuMemUnmap again", unmap(va2, 2 * MIB), 0);
    fail_entry("cuMemRelease", 1);
    expect("cuMemRelease with FAIL_ENTRY", release(h), 999);
    expect("cuMemRelease again", release(h), 0);
    expect("cuMemUnmap of both mappings", unmap(va, 4 * MIB), 0);
    expect("cuMemAddressFree", address_free(va, 4 * MIB), 0);
    expect("cuMemAddressFree", address_free(va2, 2 * MIB), 0);
}

/* ---- HIP: ROCm's header, when it is there ----------------------------------- */

#ifdef WITH_HIP
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

static void hip(void) {
    hipError_t (*reserve)(void **, size_t, size_t, void *, unsigned long long) =
        sym("hipMemAddressReserve");
    hipError_t (*address_free)(void *, size_t) = sym("hipMemAddressFree");
    hipError_t (*create)(hipMemGenericAllocationHandle_t *, size_t, const hipMemAllocationProp *,
                         unsigned long long) = sym("hipMemCreate");
    hipError_t (*release)(hipMemGenericAllocationHandle_t) = sym("hipMemRelease");
    hipError_t (*map)(void *, size_t, size_t, hipMemGenericAllocationHandle_t,
                      unsigned long long) = sym("hipMemMap");
    hipError_t (*unmap)(void *, size_t) = sym("hipMemUnmap");
    int (*fail_entry)(const char *, unsigned long long) = sym("memgov_standin_hip_fail_entry");

    hipMemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = hipMemAllocationTypePinned;
    prop.location.type = hipMemLocationTypeDevice;
    prop.location.id = 0;
    void *va;
    hipMemGenericAllocationHandle_t h;
    expect("hipMemAddressReserve 4 MiB", reserve(&va, 4 * MIB, 0, NULL, 0), hipSuccess);
    expect("hipMemCreate 4 MiB", create(&h, 4 * MIB, &prop, 0), hipSuccess);
    expect("hipMemMap at offset 2 MiB", map(va, 2 * MIB, 2 * MIB, h, 0), hipErrorInvalidValue);
    expect("hipMemMap at offset 0 where the refused map was", map(va, 2 * MIB, 0, h, 0),
           hipSuccess);

    fail_entry("hipMemUnmap", 1);
    expect("hipMemUnmap with FAIL_ENTRY", unmap(va, 2 * MIB), hipErrorInvalidValue);
    expect("hipMemUnmap again", unmap(va, 2 * MIB), hipSuccess);
    fail_entry("hipMemRelease", 1);
    expect("hipMemRelease with FAIL_ENTRY", release(h), hipErrorInvalidValue);
    expect("hipMemRelease again", release(h), hipSuccess);
    expect("hipMemAddressFree", address_free(va, 4 * MIB), hipSuccess);
}
#endif

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: differences cuda|hip <library>\n");
        return 2;
    }
    g_lib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (g_lib == NULL) {
        printf("differences: %s\n", dlerror());
        return 1;
    }
    if (strcmp(argv[1], "cuda") == 0) {
        cuda();
#ifdef WITH_HIP
    } else if (strcmp(argv[1], "hip") == 0) {
        hip();
#endif
    } else {
        fprintf(stderr, "differences: no vendor %s in this build\n", argv[1]);
        return 2;
    }
    printf("ok\n");
    return 0;
}
