/*
 * A stand-in for ROCm SMI (librocm_smi64), AMD's System Management
 * Interface library: the calls memgov's machine ledger makes to learn which
 * processes use a device and how much VRAM each holds there. Written from
 * rocm_smi.h's documentation, not from memgov:
 *
 *   rsmi_init / rsmi_shut_down: reference-counted; every other call before
 *     the first init returns RSMI_STATUS_INIT_ERROR.
 *   rsmi_num_monitor_devices: the device count.
 *   rsmi_dev_pci_id_get: the BDFID, ((domain & 0xffffffff) << 32) |
 *     ((partition & 0xf) << 28) | ((bus & 0xff) << 8) | ((device & 0x1f) << 3)
 *     | (function & 0x7); an index past the count is
 *     RSMI_STATUS_INVALID_ARGS.
 *   rsmi_compute_process_info_get: with `procs` NULL, *num_items becomes the
 *     number of processes using any GPU; otherwise up to *num_items entries
 *     are written and *num_items becomes the number written, and more
 *     processes than room is RSMI_STATUS_INSUFFICIENT_SIZE. vram_usage is
 *     the process's VRAM on every device together.
 *   rsmi_compute_process_info_by_device_get: one process's figures on one
 *     device; a process not using that device is RSMI_STATUS_NOT_FOUND.
 *
 * Devices: as many as the HIP stand-in has (MEMGOV_STANDIN_HIP_DEVICES,
 * default 1), at the HIP stand-in's PCI addresses (0000:<0x20 + ordinal>:00.0),
 * with partition bits set on odd ordinals (a reader must mask them).
 *
 * Processes: read on every query from the file MEMGOV_STANDIN_ROCM_SMI_PROCESSES
 * names (unset: none), one line per process and device, "<ordinal> <pid>
 * <bytes>"; so a test changes what the library reports by rewriting it.
 *
 * Hostile answers: MEMGOV_STANDIN_ROCM_SMI_HOSTILE, a comma-separated list:
 *   huge-count  rsmi_compute_process_info_get with `procs` NULL answers
 *               0xFFFFFFFF processes;
 *   over-count  with `procs` given, *num_items becomes 7 more than the room
 *               (what it wrote is right) and the answer is success.
 */
#include "standin.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    RSMI_STATUS_SUCCESS = 0,
    RSMI_STATUS_INVALID_ARGS = 1,
    RSMI_STATUS_INIT_ERROR = 8,
    RSMI_STATUS_NOT_FOUND = 10,
    RSMI_STATUS_INSUFFICIENT_SIZE = 11,
} rsmi_status_t;

typedef struct {
    uint32_t process_id;
    uint32_t pasid;
    uint64_t vram_usage;
    uint64_t sdma_usage;
    uint32_t cu_occupancy;
} rsmi_process_info_t;

#define MAX_DEVICES 8
#define MAX_LINES 1024

/* Guards the process queries' tables below. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sq_inits g_inits = SQ_INITS_INITIALIZER;

static int initialized(void) { return sq_inits_held(&g_inits); }

static uint32_t device_count(void) {
    return (uint32_t)sq_env_devices("MEMGOV_STANDIN_HIP_DEVICES", MAX_DEVICES);
}

rsmi_status_t rsmi_init(uint64_t flags) {
    (void)flags;
    sq_inits_acquire(&g_inits);
    return RSMI_STATUS_SUCCESS;
}

/* Without an init: RSMI_STATUS_INIT_ERROR. */
rsmi_status_t rsmi_shut_down(void) {
    return sq_inits_release(&g_inits) == 0 ? RSMI_STATUS_SUCCESS : RSMI_STATUS_INIT_ERROR;
}

rsmi_status_t rsmi_num_monitor_devices(uint32_t *num_devices) {
    if (!initialized()) return RSMI_STATUS_INIT_ERROR;
    if (num_devices == NULL) return RSMI_STATUS_INVALID_ARGS;
    *num_devices = device_count();
    return RSMI_STATUS_SUCCESS;
}

rsmi_status_t rsmi_dev_pci_id_get(uint32_t dv_ind, uint64_t *bdfid) {
    if (!initialized()) return RSMI_STATUS_INIT_ERROR;
    if (bdfid == NULL || dv_ind >= device_count()) return RSMI_STATUS_INVALID_ARGS;
    uint64_t partition = (dv_ind & 1) ? 0x3 : 0;
    *bdfid = (partition << 28) | ((uint64_t)((0x20 + dv_ind) & 0xff) << 8);
    return RSMI_STATUS_SUCCESS;
}

/* Whether MEMGOV_STANDIN_ROCM_SMI_HOSTILE lists `what`. */
static int hostile(const char *what) {
    return sq_env_lists("MEMGOV_STANDIN_ROCM_SMI_HOSTILE", what);
}

struct line { int dev; uint32_t pid; uint64_t bytes; };

struct lines {
    struct line *out;
    int room, n;
};

/* A line's bytes must be a number (no "not available" in ROCm SMI's
 * figures); a fourth field is ignored. */
static int take_line(void *ctx, const struct sq_process_line *l) {
    struct lines *s = ctx;
    if (l->not_available || !l->numeric) return 0;
    s->out[s->n++] = (struct line){.dev = l->device, .pid = l->pid, .bytes = l->bytes};
    return s->n >= s->room;
}

static int read_lines(struct line *out, int room) {
    struct lines s = {.out = out, .room = room};
    if (room > 0) sq_process_file_each("MEMGOV_STANDIN_ROCM_SMI_PROCESSES", take_line, &s);
    return s.n;
}

rsmi_status_t rsmi_compute_process_info_get(rsmi_process_info_t *procs, uint32_t *num_items) {
    if (!initialized()) return RSMI_STATUS_INIT_ERROR;
    if (num_items == NULL) return RSMI_STATUS_INVALID_ARGS;
    static struct line lines[MAX_LINES];
    static rsmi_process_info_t found[MAX_LINES];
    pthread_mutex_lock(&g_lock);
    int n = read_lines(lines, MAX_LINES);
    uint32_t unique = 0;
    for (int i = 0; i < n; i++) {
        uint32_t j = 0;
        while (j < unique && found[j].process_id != lines[i].pid) j++;
        if (j == unique) {
            memset(&found[j], 0, sizeof found[j]);
            found[j].process_id = lines[i].pid;
            found[j].pasid = 0x8000 + j;
            unique++;
        }
        found[j].vram_usage += lines[i].bytes;
    }
    rsmi_status_t r = RSMI_STATUS_SUCCESS;
    if (procs == NULL) {
        *num_items = hostile("huge-count") ? 0xFFFFFFFFu : unique;
    } else {
        uint32_t room = *num_items;
        uint32_t w = unique < room ? unique : room;
        memcpy(procs, found, w * sizeof *procs);
        *num_items = w;
        if (unique > room) r = RSMI_STATUS_INSUFFICIENT_SIZE;
        else if (hostile("over-count")) *num_items = room + 7;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

rsmi_status_t rsmi_compute_process_info_by_device_get(uint32_t pid, uint32_t dv_ind,
                                                      rsmi_process_info_t *proc) {
    if (!initialized()) return RSMI_STATUS_INIT_ERROR;
    if (proc == NULL || dv_ind >= device_count()) return RSMI_STATUS_INVALID_ARGS;
    static struct line lines[MAX_LINES];
    pthread_mutex_lock(&g_lock);
    int n = read_lines(lines, MAX_LINES);
    rsmi_status_t r = RSMI_STATUS_NOT_FOUND;
    for (int i = 0; i < n; i++) {
        if (lines[i].pid == pid && lines[i].dev == (int)dv_ind) {
            memset(proc, 0, sizeof *proc);
            proc->process_id = pid;
            proc->vram_usage = lines[i].bytes;
            r = RSMI_STATUS_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}
