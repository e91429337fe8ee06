/*
 * memgov.h: the C ABI of memgov (library memgov_capi).
 *
 * Governed device memory for C and C++ runtimes and for plugins loaded with
 * dlopen: budgets, stream-ordered release, pins that teardown observes,
 * pressure callbacks, and an unload gate that refuses to unload a plugin
 * while anything it created is outstanding.
 *
 * Conventions (docs/c-api.md has the full rules):
 *  - Every function returning int32_t returns MEMGOV_OK or a MEMGOV_ERR_*
 *    status and sets this thread's message (memgov_last_error_message()).
 *  - Handles are opaque and checked: a NULL, foreign, stale, released or
 *    wrong-kind handle, or one issued by another copy of the library loaded
 *    in the process, returns MEMGOV_ERR_INVALID_HANDLE, never a crash.
 *  - Structs whose first member is `size` can grow: set `size` to sizeof the
 *    struct before passing it in either direction.
 *  - memgov never calls a callback with a lock held. Callbacks and plugin
 *    init functions must not throw C++ exceptions or longjmp out: nothing
 *    can catch across extern "C", and an escaping exception terminates.
 *  - 64-bit targets only.
 *
 * This header is written by hand; a test compiles it as C11 and C++17 with
 * -Wall -Wextra -Werror and compares every struct's size and offsets, every
 * constant and every declared function with the library.
 */
#ifndef MEMGOV_H
#define MEMGOV_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

#define MEMGOV_ABI_VERSION 2u

/* A budget of no limit beyond the device (memgov_context_options.budget,
 * memgov_context_set_budget, memgov_snapshot.budget_limit). A budget of 0
 * admits nothing, as in Rust's ContextConfig::budget(0). */
#define MEMGOV_UNLIMITED UINT64_MAX

/* ------------------------------------------------------------- statuses */

#define MEMGOV_OK 0
#define MEMGOV_ERR_INVALID_HANDLE 1   /* NULL, foreign, stale, released or wrong-kind handle */
#define MEMGOV_ERR_INVALID_ARGUMENT 2 /* bad size/role/pointer, struct size too small, other context */
#define MEMGOV_ERR_OUT_OF_MEMORY 3    /* the budget or the device has no room */
#define MEMGOV_ERR_RETIRING 4         /* context retiring/terminated/reclaimed, or plugin unloading (by any thread) */
#define MEMGOV_ERR_DEVICE_LOST 5      /* the device was lost */
#define MEMGOV_ERR_TIMEOUT 6          /* a deadline passed with work outstanding */
#define MEMGOV_ERR_BUSY 7             /* something is outstanding (plugin unload, allocator destroy), or init runs */
#define MEMGOV_ERR_UNSUPPORTED 8      /* the backend has no such thing */
#define MEMGOV_ERR_UNAVAILABLE 9      /* backend not compiled in, or no driver/device */
#define MEMGOV_ERR_BACKEND 10         /* another backend error */
#define MEMGOV_ERR_PLUGIN 11          /* a plugin failed to load or to initialize */
#define MEMGOV_ERR_LIMIT 12           /* too many pins outstanding */
#define MEMGOV_ERR_PANIC 13           /* memgov panicked; the call was abandoned */

/* --------------------------------------------------------- capabilities */

#define MEMGOV_CAP_BACKEND_HOST (1ull << 0)
#define MEMGOV_CAP_BACKEND_NULL (1ull << 1)
#define MEMGOV_CAP_BACKEND_CUDA (1ull << 2)
#define MEMGOV_CAP_BACKEND_HIP (1ull << 3)
#define MEMGOV_CAP_BACKEND_VULKAN (1ull << 4)
#define MEMGOV_CAP_RECORD_STREAM (1ull << 8)
#define MEMGOV_CAP_PRESSURE_CALLBACKS (1ull << 9)
#define MEMGOV_CAP_PLUGIN_LOADER (1ull << 10)
#define MEMGOV_CAP_TORCH_ALLOCATOR (1ull << 11)
#define MEMGOV_CAP_ORT_ALLOCATOR (1ull << 12)
#define MEMGOV_CAP_RESERVATIONS (1ull << 13) /* not in the C ABI yet (Rust has ContextHandle::reserve): never set */

/* ---------------------------------------------------- roles, lifecycles */

#define MEMGOV_ROLE_WEIGHTS 0u
#define MEMGOV_ROLE_KV_CACHE 1u
#define MEMGOV_ROLE_ACTIVATION 2u
#define MEMGOV_ROLE_WORKSPACE 3u
#define MEMGOV_ROLE_OTHER 4u
#define MEMGOV_ROLE_COUNT 5

#define MEMGOV_LIFECYCLE_ACTIVE 0u
#define MEMGOV_LIFECYCLE_RETIRING 1u
#define MEMGOV_LIFECYCLE_LOST 2u
#define MEMGOV_LIFECYCLE_TERMINATED 3u

/* ------------------------------------------------------- opaque handles */

typedef struct memgov_governor memgov_governor;
typedef struct memgov_context memgov_context;
typedef struct memgov_stream memgov_stream;
typedef struct memgov_buffer memgov_buffer;
typedef struct memgov_pin_source memgov_pin_source;
typedef struct memgov_pin memgov_pin;
typedef struct memgov_callback memgov_callback;
typedef struct memgov_plugin memgov_plugin;

/* -------------------------------------------------------------- structs */

typedef struct memgov_context_options {
    uint32_t size;             /* sizeof(memgov_context_options) */
    uint32_t reserved;         /* 0 */
    const char* backend;       /* "host", "null", "cuda", "hip", "vulkan" */
    const char* label;         /* NULL: "backend:ordinal" */
    uint64_t budget;           /* bytes; 0 admits nothing; MEMGOV_UNLIMITED: no budget */
    uint64_t wait_for_pending_ms; /* 0: fail fast; else wait for pending releases */
    uint64_t host_op_delay_us; /* host backend: simulated time per queued op */
} memgov_context_options;

typedef struct memgov_pressure_request {
    uint32_t size;      /* sizeof(memgov_pressure_request) of the library */
    uint32_t role;      /* MEMGOV_ROLE_* of the allocation that did not fit */
    uint64_t requested; /* its size */
    uint64_t shortfall; /* bytes to give back for it to fit */
} memgov_pressure_request;

/* Returns the bytes it gave back (an estimate). Called with no memgov lock
 * held, on the allocating thread; it may release buffers. An allocation made
 * from inside a pressure callback asks no callback again (of any context,
 * on that thread): it is admitted or refused as it stands. Must not throw. */
typedef uint64_t (*memgov_pressure_fn)(const memgov_pressure_request* request, void* user_data);

/* A plugin's init function, called by memgov_plugin_open: 0 on success. */
typedef int32_t (*memgov_plugin_init_fn)(memgov_plugin* self, void* host_data);

typedef struct memgov_teardown_report {
    uint32_t size;           /* sizeof(memgov_teardown_report) */
    uint32_t lost;           /* 1: the device was lost */
    uint32_t forced;         /* 1: force reclaimed live buffers/streams */
    int32_t backend_status;  /* MEMGOV_OK or the status of the backend's teardown error */
    uint64_t retired_releases;
    uint64_t abandoned_releases;
    uint64_t settled_lost;
    uint64_t reclaimed_buffers;
    uint64_t quarantined_bytes;
    uint64_t awaiting_teardown_bytes;
    uint64_t unsettled_releases; /* nonzero: a backend bug */
    uint64_t elapsed_ns;
} memgov_teardown_report;

typedef struct memgov_role_usage {
    uint64_t live_bytes;
    uint64_t live_count;
    uint64_t pending_bytes;
    uint64_t pending_count;
    uint64_t quarantined_bytes;
    uint64_t quarantined_count;
} memgov_role_usage;

typedef struct memgov_snapshot {
    uint32_t size;      /* sizeof(memgov_snapshot) */
    uint32_t lifecycle; /* MEMGOV_LIFECYCLE_* */
    uint64_t budget_limit; /* MEMGOV_UNLIMITED: no budget beyond the device */
    uint64_t charged;
    uint64_t peak;      /* most bytes live at once: exact on one stream, else an upper bound (ContextSnapshot::peak) */
    uint64_t awaiting_teardown;
    memgov_role_usage total;
    memgov_role_usage by_role[MEMGOV_ROLE_COUNT];
    uint64_t pins_streams;
    uint64_t pins_buffers;
    uint64_t pins_pending_releases;
    uint64_t pins_external;
    uint64_t pins_other;
    uint64_t allocations;
    uint64_t releases_queued;
    uint64_t retired;
    uint64_t abandoned;
    uint64_t quarantined;
    uint64_t admission_refusals;
    uint64_t pressure_calls;
    uint64_t backend_errors;
} memgov_snapshot;

typedef struct memgov_plugin_outstanding {
    uint32_t size;     /* sizeof(memgov_plugin_outstanding) */
    uint32_t reserved;
    uint64_t streams;
    uint64_t buffers;
    uint64_t buffer_bytes;
    uint64_t pending_releases; /* queued releases not known to have retired */
    uint64_t pin_sources;
    uint64_t pins;
    uint64_t callbacks;
    uint64_t allocators;
} memgov_plugin_outstanding;

/* The first five members of ONNX Runtime's OrtAllocator (version 18: Reserve
 * present, nothing after it): cast a memgov_ort_allocator* to OrtAllocator*. */
#define MEMGOV_ORT_ALLOCATOR_VERSION 18u
typedef struct memgov_ort_allocator {
    uint32_t version;
    void* (*Alloc)(struct memgov_ort_allocator* self, size_t size);
    void (*Free)(struct memgov_ort_allocator* self, void* p);
    const void* (*Info)(const struct memgov_ort_allocator* self); /* the OrtMemoryInfo* given */
    void* (*Reserve)(struct memgov_ort_allocator* self, size_t size);
} memgov_ort_allocator;

/* ------------------------------------------------------------- library */

uint32_t memgov_abi_version(void);
uint64_t memgov_capabilities(void);
/* This thread's message about its last call ("" after a success); valid until
 * the next memgov call on this thread; never NULL. */
const char* memgov_last_error_message(void);
/* Copies this thread's message into buf (len bytes): truncated to len - 1
 * bytes and NUL-terminated when len > 0; nothing is written when buf is NULL
 * or len is 0. Returns the message's full length without the NUL, as
 * snprintf does (the copy is whole when that is below len). Does not change
 * the message. */
size_t memgov_last_error_copy(char* buf, size_t len);
const char* memgov_status_name(int32_t status);

/* ------------------------------------------------------------ governor */

int32_t memgov_governor_create(memgov_governor** out);
/* Retires every context it governs. */
int32_t memgov_governor_destroy(memgov_governor* governor);

/* ------------------------------------------------------------- context */

int32_t memgov_context_open(memgov_governor* governor, const memgov_context_options* options,
                            memgov_context** out);
/* Drops the handle only; the context stays governed until retired. */
int32_t memgov_context_close(memgov_context* context);
/* 0 admits nothing more; MEMGOV_UNLIMITED lifts the limit. */
int32_t memgov_context_set_budget(memgov_context* context, uint64_t bytes);
int32_t memgov_context_mark_lost(memgov_context* context, const char* reason);
int32_t memgov_context_snapshot(memgov_context* context, memgov_snapshot* out);
/* The context's call sites as JSON, most live bytes first: [{"site":
 * "model.c:42", "label": null, "live_bytes": 4096, "live_count": 1,
 * "peak_bytes": 4096, "allocations": 1, "refusals": 0}, ...]; [] unless the
 * context attributes allocations (MEMGOV_ATTRIBUTION=1). Written as snprintf
 * does (at most len - 1 bytes and a NUL when len > 0; nothing when buf is
 * NULL or len is 0); *needed (may be NULL) gets the full length without the
 * NUL. */
int32_t memgov_context_sites_json(memgov_context* context, char* buf, size_t len, size_t* needed);
/* Refuse new work, wait up to timeout_ms for everything outstanding, tear
 * down. out may be NULL. MEMGOV_ERR_TIMEOUT names what is outstanding.
 * MEMGOV_ERR_BACKEND (the backend's teardown) or MEMGOV_ERR_PANIC (memgov's
 * own teardown step) when a teardown step panicked: the context is torn down
 * all the same, and the message names the step. */
int32_t memgov_context_retire(memgov_context* context, uint64_t timeout_ms,
                              memgov_teardown_report* out);
int32_t memgov_context_force_retire(memgov_context* context, uint64_t timeout_ms,
                                    memgov_teardown_report* out);
/* plugin may be NULL. */
int32_t memgov_pressure_callback_add(memgov_context* context, memgov_plugin* plugin,
                                     memgov_pressure_fn callback, void* user_data,
                                     memgov_callback** out);
/* No call enters the callback after this; when it returns no call is in it
 * (user_data may be freed). Waits for calls on other threads: do not hold a
 * lock the callback takes. From inside the callback itself its own call is
 * not waited for; from inside another callback nothing is waited for. */
int32_t memgov_pressure_callback_remove(memgov_callback* callback);

/* -------------------------------------------------------------- stream */

int32_t memgov_stream_create(memgov_context* context, const char* label, memgov_plugin* plugin,
                             memgov_stream** out);
int32_t memgov_stream_destroy(memgov_stream* stream);
int32_t memgov_stream_synchronize(memgov_stream* stream);
/* CUstream / hipStream_t; MEMGOV_ERR_UNSUPPORTED elsewhere. Do not destroy it. */
int32_t memgov_stream_raw(memgov_stream* stream, void** out);

/* -------------------------------------------------------------- buffer */

int32_t memgov_buffer_allocate(memgov_stream* stream, uint64_t bytes, uint32_t role,
                               memgov_plugin* plugin, memgov_buffer** out);
/* As memgov_buffer_allocate, counted at `site` ("model.c:42"; NULL: the
 * library's own line) when the context attributes allocations to call sites
 * (MEMGOV_ATTRIBUTION=1 in the environment). The string is copied. */
int32_t memgov_buffer_allocate_at(memgov_stream* stream, uint64_t bytes, uint32_t role,
                                  memgov_plugin* plugin, const char* site, memgov_buffer** out);
/* Stream-ordered on its own stream; the handle is gone afterwards. */
int32_t memgov_buffer_release(memgov_buffer* buffer);
/* Stream-ordered on another stream of its context. */
int32_t memgov_buffer_release_on(memgov_buffer* buffer, memgov_stream* stream);
int32_t memgov_buffer_record_stream(memgov_buffer* buffer, memgov_stream* stream);
/* Host memory (host), CUdeviceptr (cuda), hipDeviceptr_t (hip), buffer device
 * address (vulkan); MEMGOV_ERR_UNSUPPORTED elsewhere. */
int32_t memgov_buffer_device_ptr(memgov_buffer* buffer, void** out);
int32_t memgov_buffer_size(memgov_buffer* buffer, uint64_t* out);
/* MEMGOV_ERR_INVALID_ARGUMENT unless offset + len (without wrapping) is at
 * most the buffer's size; checked before src/dst is touched. */
int32_t memgov_buffer_write(memgov_buffer* buffer, uint64_t offset, const void* src, size_t len);
int32_t memgov_buffer_read(memgov_buffer* buffer, uint64_t offset, void* dst, size_t len);

/* ---------------------------------------------------------------- pins */

int32_t memgov_pin_source_create(memgov_context* context, const char* holder,
                                 memgov_plugin* plugin, memgov_pin_source** out);
int32_t memgov_pin_source_destroy(memgov_pin_source* source);
int32_t memgov_pin_acquire(memgov_pin_source* source, memgov_pin** out);
int32_t memgov_pin_release(memgov_pin* pin);

/* -------------------------------------------------------------- plugins */

int32_t memgov_plugin_register(const char* name, memgov_plugin** out);
int32_t memgov_plugin_unregister(memgov_plugin* plugin, memgov_plugin_outstanding* out);
/* MEMGOV_OK when nothing is outstanding, MEMGOV_ERR_BUSY otherwise; out may be NULL. */
int32_t memgov_plugin_may_unload(memgov_plugin* plugin, memgov_plugin_outstanding* out);
/* dlopen(path) and call init_symbol (NULL: "memgov_plugin_init"). While init
 * runs the plugin may not be closed or unregistered (MEMGOV_ERR_BUSY). If
 * init returns nonzero, what it created for the plugin is released and
 * destroyed, the library is closed, and *out is NULL (MEMGOV_ERR_PLUGIN). */
int32_t memgov_plugin_open(const char* path, const char* init_symbol, void* host_data,
                           memgov_plugin** out);
int32_t memgov_plugin_symbol(memgov_plugin* plugin, const char* name, void** out);
/* dlclose, refused with MEMGOV_ERR_BUSY while anything is outstanding;
 * MEMGOV_ERR_RETIRING while another thread's close of it is under way. */
int32_t memgov_plugin_close(memgov_plugin* plugin, memgov_plugin_outstanding* out);

/* -------------------------------------- PyTorch CUDAPluggableAllocator */

/* device >= 0 (else MEMGOV_ERR_INVALID_ARGUMENT). */
int32_t memgov_torch_configure(int32_t device, memgov_stream* default_stream, uint32_t role);
int32_t memgov_torch_map_stream(int32_t device, void* raw_stream, memgov_stream* stream);
int32_t memgov_torch_reset(void);
/* Loaded by name: CUDAPluggableAllocator(path, "memgov_torch_alloc", "memgov_torch_free"). */
void* memgov_torch_alloc(ssize_t size, int device, void* stream);
void memgov_torch_free(void* ptr, ssize_t size, int device, void* stream);

/* ---------------------------------------------------- ONNX Runtime */

int32_t memgov_ort_allocator_create(memgov_stream* stream, uint32_t role,
                                    const void* ort_memory_info, memgov_plugin* plugin,
                                    memgov_ort_allocator** out);
int32_t memgov_ort_allocator_destroy(memgov_ort_allocator* allocator);

/* ---------------------------------------------------- Prometheus metrics */

/* The governor's contexts in Prometheus's exposition format (docs/metrics.md),
 * written into buf (len bytes) as snprintf does: truncated to len - 1 bytes
 * and NUL-terminated when len > 0, nothing written when buf is NULL or len is
 * 0. *out_len (when not NULL) receives the page's full length without the
 * NUL: the page is whole when that is below len. buf and out_len both NULL is
 * MEMGOV_ERR_INVALID_ARGUMENT. Serve it as
 * "application/openmetrics-text; version=1.0.0; charset=utf-8". */
int32_t memgov_metrics_render(memgov_governor* governor, char* buf, size_t len, size_t* out_len);

#ifdef __cplusplus
}
#endif

#endif /* MEMGOV_H */
