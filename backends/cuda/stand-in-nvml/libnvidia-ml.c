/*
 * A stand-in for NVML (libnvidia-ml.so.1), the NVIDIA Management Library:
 * the calls memgov's machine ledger makes to learn which processes use a
 * device and how much memory each holds. Written from NVIDIA's NVML API
 * reference, not from memgov:
 *
 *   nvmlInit_v2 / nvmlShutdown: reference-counted; every other call before
 *     the first init (or after the last shutdown) returns
 *     NVML_ERROR_UNINITIALIZED.
 *   nvmlDeviceGetHandleByUUID: the UUID as nvmlDeviceGetUUID prints it
 *     ("GPU-" and 32 hex digits in 8-4-4-4-12 groups); no match is
 *     NVML_ERROR_NOT_FOUND, a NULL argument NVML_ERROR_INVALID_ARGUMENT.
 *   nvmlDeviceGetHandleByPciBusId_v2: "domain:bus:device.function",
 *     "domain:bus:device" or "bus:device.function", each number hex.
 *   nvmlDeviceGetComputeRunningProcesses{,_v2,_v3} / ...GraphicsRunningProcesses{,_v2,_v3}:
 *     *infoCount is the room in `infos` on entry and the number of entries
 *     on return; too little room is NVML_ERROR_INSUFFICIENT_SIZE with
 *     *infoCount set to what is needed (`infos` may be NULL when the room
 *     is 0); usedGpuMemory is NVML_VALUE_NOT_AVAILABLE when it cannot be
 *     read. A handle that is not one this library gave out is
 *     NVML_ERROR_INVALID_ARGUMENT. The unversioned calls write
 *     nvmlProcessInfo_v1_t (16 bytes: pid, usedGpuMemory), `_v2`
 *     nvmlProcessInfo_v2_t (24 bytes: and gpuInstanceId, computeInstanceId),
 *     `_v3` the 24-byte layout too, except as an R535 driver writes it (32
 *     bytes: and usedGpuCcProtectedMemory, the layout nvml.h declared for
 *     the R535 branch).
 *   nvmlSystemGetDriverVersion: the version as a NUL-terminated string in
 *     `length` bytes (NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE, 80, is
 *     enough); too little room is NVML_ERROR_INSUFFICIENT_SIZE.
 *
 * Layout: MEMGOV_STANDIN_NVML_LAYOUT (read on every call) chooses the
 * driver stood in for: 24 (default) a driver of the R550 branch, whose
 * `_v3` lists have 24-byte entries; 32 an R535 driver (535.54.03), whose
 * `_v3` lists have 32-byte entries; 16 an NVML without the `_v2` and `_v3`
 * lists (they answer NVML_ERROR_FUNCTION_NOT_FOUND, "this version of NVML
 * does not implement this function"), only the 16-byte unversioned ones.
 *
 * Hostile answers: MEMGOV_STANDIN_NVML_HOSTILE, a comma-separated list:
 *   huge-count  every list call answers NVML_ERROR_INSUFFICIENT_SIZE with
 *               *infoCount 0xFFFFFFFF, whatever the room;
 *   over-count  a list call that fits answers NVML_SUCCESS with *infoCount
 *               7 more than the room it was given (what it wrote is right);
 *   null-names  nvmlErrorString answers NULL, and nvmlSystemGetDriverVersion
 *               fills all `length` bytes with no NUL.
 *
 * Devices: as many as the CUDA stand-in has (MEMGOV_STANDIN_CUDA_DEVICES,
 * default 1), with the CUDA stand-in's UUIDs ("memgov-standin", 0, ordinal)
 * and PCI addresses (0000:<0x10 + ordinal>:00.0).
 *
 * Processes: read on every query from the file MEMGOV_STANDIN_NVML_PROCESSES
 * names (unset: none), one process per line, "<ordinal> <pid> <bytes>
 * [graphics]", bytes "-" for not available; so a test changes what the
 * library reports between queries by rewriting the file.
 */
#include "standin.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <pthread.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_VALUE_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

#define MAX_DEVICES 8
#define MAX_PROCESSES 1024

typedef struct nvml_device { int ordinal; } *nvmlDevice_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

/* As nvml.h of the R535 branch declared nvmlProcessInfo_t. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessInfo_r535_t;

_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "v1 entries are 16 bytes");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "v2 entries are 24 bytes");
_Static_assert(sizeof(nvmlProcessInfo_r535_t) == 32, "R535 entries are 32 bytes");

/* The layout stood in for (16, 24 or 32). */
static int layout(void) {
    const char *v = getenv("MEMGOV_STANDIN_NVML_LAYOUT");
    if (v == NULL || v[0] == 0 || strcmp(v, "24") == 0) return 24;
    if (strcmp(v, "16") == 0) return 16;
    if (strcmp(v, "32") == 0) return 32;
    sq_die("MEMGOV_STANDIN_NVML_LAYOUT=%s: 16, 24 or 32", v);
}

/* Whether MEMGOV_STANDIN_NVML_HOSTILE lists `what`. */
static int hostile(const char *what) {
    return sq_env_lists("MEMGOV_STANDIN_NVML_HOSTILE", what);
}

static struct sq_inits g_inits = SQ_INITS_INITIALIZER;
static struct nvml_device g_dev[MAX_DEVICES] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
_Static_assert(MAX_DEVICES == 8, "one handle per ordinal above");

static int device_count(void) { return sq_env_devices("MEMGOV_STANDIN_CUDA_DEVICES", MAX_DEVICES); }

static int initialized(void) { return sq_inits_held(&g_inits); }

nvmlReturn_t nvmlInit_v2(void) {
    sq_inits_acquire(&g_inits);
    return NVML_SUCCESS;
}

/* Without an init: NVML_ERROR_UNINITIALIZED. */
nvmlReturn_t nvmlShutdown(void) {
    return sq_inits_release(&g_inits) == 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    if (hostile("null-names")) return NULL;
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (version == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (hostile("null-names")) {
        memset(version, '5', length);
        return NVML_SUCCESS;
    }
    int l = layout();
    const char *v = l == 32 ? "535.54.03" : l == 16 ? "450.248.02" : "550.54.14";
    if (length < strlen(v) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(version, v, strlen(v) + 1);
    return NVML_SUCCESS;
}

static void uuid_of(int ordinal, char *out, size_t len) {
    /* "memgov-standin" = 6d656d67 6f76 2d73 7461 6e64696e, then 0, ordinal. */
    snprintf(out, len, "GPU-6d656d67-6f76-2d73-7461-6e64696e00%02x", ordinal);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < device_count(); i++) {
        char mine[64];
        uuid_of(i, mine, sizeof mine);
        if (strcasecmp(mine, uuid) == 0) {
            *device = &g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *device) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (bus_id == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned domain = 0, bus = 0, dev = 0, fn = 0;
    char tail;
    if (sscanf(bus_id, "%x:%x:%x.%x%c", &domain, &bus, &dev, &fn, &tail) == 4) {
    } else if (sscanf(bus_id, "%x:%x:%x%c", &domain, &bus, &dev, &tail) == 3) {
        fn = 0;
    } else if (sscanf(bus_id, "%x:%x.%x%c", &bus, &dev, &fn, &tail) == 3) {
        domain = 0;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (int i = 0; i < device_count(); i++) {
        if (domain == 0 && bus == (unsigned)(0x10 + i) && dev == 0 && fn == 0) {
            *device = &g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static int valid_handle(nvmlDevice_t d) {
    for (int i = 0; i < device_count(); i++)
        if (d == &g_dev[i]) return 1;
    return 0;
}

/* Entry `i` of an array of `size`-byte entries at `infos`. */
static void put(void *infos, int size, unsigned i, unsigned pid, unsigned long long bytes) {
    char *at = (char *)infos + (size_t)i * (size_t)size;
    if (size == 16) {
        nvmlProcessInfo_v1_t e = {pid, bytes};
        memcpy(at, &e, sizeof e);
    } else if (size == 24) {
        nvmlProcessInfo_v2_t e = {pid, bytes, 0xFFFFFFFFu, 0xFFFFFFFFu};
        memcpy(at, &e, sizeof e);
    } else {
        nvmlProcessInfo_r535_t e = {pid, bytes, 0xFFFFFFFFu, 0xFFFFFFFFu, 0};
        memcpy(at, &e, sizeof e);
    }
}

struct listing {
    int ordinal, graphics; /* which processes */
    void *out;             /* `size`-byte entries, room for `room` */
    int size;
    unsigned room, n;
};

static int list_line(void *ctx, const struct sq_process_line *l) {
    struct listing *s = ctx;
    if (l->device != s->ordinal || l->graphics != s->graphics) return 0;
    /* NVML's "-": usedGpuMemory NVML_VALUE_NOT_AVAILABLE. */
    if (s->n < s->room && s->out != NULL)
        put(s->out, s->size, s->n, l->pid, l->not_available ? NVML_VALUE_NOT_AVAILABLE : l->bytes);
    s->n++;
    return s->n >= MAX_PROCESSES;
}

/* The processes the file lists for `ordinal`, graphics or compute, written
 * as `size`-byte entries. */
static unsigned read_processes(int ordinal, int graphics, void *out, int size, unsigned room) {
    struct listing s = {.ordinal = ordinal, .graphics = graphics, .out = out, .size = size,
                        .room = room};
    sq_process_file_each("MEMGOV_STANDIN_NVML_PROCESSES", list_line, &s);
    return s.n;
}

/* One list call: `version` 1 (unversioned), 2 or 3. */
static nvmlReturn_t running(nvmlDevice_t device, unsigned int *count, void *infos, int graphics,
                            int version) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    int l = layout();
    if (l == 16 && version > 1) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (count == NULL || !valid_handle(device)) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count > 0 && infos == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (hostile("huge-count")) {
        *count = 0xFFFFFFFFu;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    int size = version == 1 ? 16 : version == 2 ? 24 : l == 32 ? 32 : 24;
    unsigned room = *count;
    unsigned n = read_processes(device->ordinal, graphics, infos, size, room);
    if (n > room) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = hostile("over-count") ? room + 7 : n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos) {
    return running(device, infoCount, infos, 0, 1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos) {
    return running(device, infoCount, infos, 1, 1);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos) {
    return running(device, infoCount, infos, 0, 2);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v2_t *infos) {
    return running(device, infoCount, infos, 1, 2);
}

/* `infos`: nvmlProcessInfo_v2_t entries, or nvmlProcessInfo_r535_t ones
 * when standing in for an R535 driver. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      void *infos) {
    return running(device, infoCount, infos, 0, 3);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                       void *infos) {
    return running(device, infoCount, infos, 1, 3);
}
