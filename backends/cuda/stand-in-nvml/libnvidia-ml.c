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
 *   nvmlDeviceGetComputeRunningProcesses_v3 / ...GraphicsRunningProcesses_v3:
 *     *infoCount is the room in `infos` on entry and the number of entries
 *     on return; too little room is NVML_ERROR_INSUFFICIENT_SIZE with
 *     *infoCount set to what is needed (`infos` may be NULL when the room
 *     is 0); usedGpuMemory is NVML_VALUE_NOT_AVAILABLE when it cannot be
 *     read. A handle that is not one this library gave out is
 *     NVML_ERROR_INVALID_ARGUMENT.
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
#define NVML_VALUE_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

#define MAX_DEVICES 8
#define MAX_PROCESSES 1024

typedef struct nvml_device { int ordinal; } *nvmlDevice_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_inits;
static struct nvml_device g_dev[MAX_DEVICES];

static int device_count(void) {
    uint64_t n = sq_env_u64("MEMGOV_STANDIN_CUDA_DEVICES", 1);
    return n > MAX_DEVICES ? MAX_DEVICES : (int)n;
}

static int initialized(void) {
    pthread_mutex_lock(&g_lock);
    int n = g_inits;
    pthread_mutex_unlock(&g_lock);
    return n > 0;
}

nvmlReturn_t nvmlInit_v2(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_DEVICES; i++) g_dev[i].ordinal = i;
    g_inits++;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_inits == 0) r = NVML_ERROR_UNINITIALIZED;
    else g_inits--;
    pthread_mutex_unlock(&g_lock);
    return r;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
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

/* The processes the file lists for `ordinal`, graphics or compute. */
static unsigned read_processes(int ordinal, int graphics, nvmlProcessInfo_t *out, unsigned room) {
    const char *path = getenv("MEMGOV_STANDIN_NVML_PROCESSES");
    if (path == NULL || path[0] == 0) return 0;
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    unsigned n = 0;
    char line[256];
    while (fgets(line, sizeof line, f) != NULL) {
        int dev;
        unsigned pid;
        char bytes[64], kind[32];
        int k = sscanf(line, "%d %u %63s %31s", &dev, &pid, bytes, kind);
        if (k < 3) continue;
        int is_graphics = k == 4 && strcmp(kind, "graphics") == 0;
        if (dev != ordinal || is_graphics != graphics) continue;
        if (n < room && out != NULL) {
            out[n].pid = pid;
            out[n].usedGpuMemory =
                strcmp(bytes, "-") == 0 ? NVML_VALUE_NOT_AVAILABLE : strtoull(bytes, NULL, 10);
            out[n].gpuInstanceId = 0xFFFFFFFFu;
            out[n].computeInstanceId = 0xFFFFFFFFu;
        }
        n++;
        if (n >= MAX_PROCESSES) break;
    }
    fclose(f);
    return n;
}

static nvmlReturn_t running(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos,
                            int graphics) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL || !valid_handle(device)) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count > 0 && infos == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned room = *count;
    unsigned n = read_processes(device->ordinal, graphics, infos, room);
    *count = n;
    return n > room ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                       nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, 1);
}
