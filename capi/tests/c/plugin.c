/*
 * An example plugin: loaded by memgov_plugin_open, it allocates governed
 * memory, queues releases, holds a pin and registers a pressure callback,
 * all counted against its plugin handle, and lets everything go when asked.
 * The host (host.c) checks that memgov refuses to unload it until then.
 */
#define _POSIX_C_SOURCE 200809L
#include "memgov.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static memgov_plugin* self;
static memgov_context* ctx;
static memgov_stream* stream;
static memgov_buffer* buffers[3];
static memgov_pin_source* source;
static memgov_pin* pin;
static memgov_callback* callback;

#define CHECK(call)                                                                   \
    do {                                                                              \
        int32_t rc_ = (call);                                                         \
        if (rc_ != MEMGOV_OK) {                                                       \
            fprintf(stderr, "plugin: %s failed: %s: %s\n", #call, memgov_status_name(rc_), \
                    memgov_last_error_message());                                     \
            return rc_;                                                               \
        }                                                                             \
    } while (0)

static uint64_t on_pressure(const memgov_pressure_request* request, void* user_data) {
    (void)request;
    (void)user_data;
    return 0;
}

/* host_data: the host's context. */
int32_t memgov_plugin_init(memgov_plugin* plugin, void* host_data) {
    self = plugin;
    ctx = (memgov_context*)host_data;
    return MEMGOV_OK;
}

/* Allocate three buffers (write through the raw pointer), release one
 * stream-ordered, take a pin, register a pressure callback. */
int32_t plugin_run(void) {
    CHECK(memgov_stream_create(ctx, "plugin", self, &stream));
    for (int i = 0; i < 3; i++) {
        CHECK(memgov_buffer_allocate(stream, 4096, MEMGOV_ROLE_ACTIVATION, self, &buffers[i]));
        void* p = NULL;
        CHECK(memgov_buffer_device_ptr(buffers[i], &p));
        memset(p, 0x5a, 4096);
    }
    CHECK(memgov_buffer_release(buffers[0]));
    buffers[0] = NULL;
    CHECK(memgov_pin_source_create(ctx, "example-plugin", self, &source));
    CHECK(memgov_pin_acquire(source, &pin));
    CHECK(memgov_pressure_callback_add(ctx, self, on_pressure, NULL, &callback));
    return MEMGOV_OK;
}

/* Let go of one kind of thing at a time, so the host can watch the counts. */
int32_t plugin_release_buffers(void) {
    for (int i = 0; i < 3; i++) {
        if (buffers[i]) {
            CHECK(memgov_buffer_release(buffers[i]));
            buffers[i] = NULL;
        }
    }
    return MEMGOV_OK;
}

int32_t plugin_release_rest(void) {
    CHECK(memgov_pin_release(pin));
    CHECK(memgov_pin_source_destroy(source));
    CHECK(memgov_pressure_callback_remove(callback));
    CHECK(memgov_stream_destroy(stream));
    return MEMGOV_OK;
}

/* The stream must still exist: waits for the queued releases to retire. */
int32_t plugin_synchronize(void) {
    CHECK(memgov_stream_synchronize(stream));
    return MEMGOV_OK;
}

/* An init that fails having created nothing: memgov closes it again. */
int32_t plugin_init_fails(memgov_plugin* plugin, void* host_data) {
    (void)plugin;
    (void)host_data;
    return 7;
}

/* An init that fails having created a stream, a buffer (and queued the
 * release of another), a pin source, a pin and a pressure callback: memgov
 * cleans all of it up and unloads the library. */
int32_t plugin_init_fails_holding(memgov_plugin* plugin, void* host_data) {
    memgov_context* c = (memgov_context*)host_data;
    memgov_stream* s = NULL;
    memgov_buffer *b = NULL, *gone = NULL;
    memgov_pin_source* src = NULL;
    memgov_pin* p = NULL;
    memgov_callback* cb = NULL;
    CHECK(memgov_stream_create(c, "half-initialized", plugin, &s));
    CHECK(memgov_buffer_allocate(s, 4096, MEMGOV_ROLE_WEIGHTS, plugin, &b));
    CHECK(memgov_buffer_allocate(s, 4096, MEMGOV_ROLE_WEIGHTS, plugin, &gone));
    CHECK(memgov_buffer_release(gone));
    CHECK(memgov_pin_source_create(c, "half-initialized", plugin, &src));
    CHECK(memgov_pin_acquire(src, &p));
    CHECK(memgov_pressure_callback_add(c, plugin, on_pressure, NULL, &cb));
    return 8;
}

/* An init that tries to close (and unregister) its own plugin: refused,
 * since dlclose would unmap the code that is running. What it was told is
 * kept for the host to check. */
static int32_t self_close_rc = -1, self_unregister_rc = -1;
static char self_close_message[512];

int32_t plugin_init_closes_itself(memgov_plugin* plugin, void* host_data) {
    (void)host_data;
    memgov_plugin_outstanding o;
    memset(&o, 0, sizeof o);
    o.size = sizeof o;
    self_close_rc = memgov_plugin_close(plugin, &o);
    snprintf(self_close_message, sizeof self_close_message, "%s", memgov_last_error_message());
    self_unregister_rc = memgov_plugin_unregister(plugin, &o);
    return MEMGOV_OK;
}

int32_t plugin_self_close_rc(void) {
    return self_close_rc;
}

int32_t plugin_self_unregister_rc(void) {
    return self_unregister_rc;
}

const char* plugin_self_close_message(void) {
    return self_close_message;
}

/* An init that registers a pressure callback on the host's context
 * (host_data) which, when called, removes itself and then stays in the
 * plugin's code until the host lets it return: while it runs, memgov must
 * count it against the plugin and refuse to unload it. */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_changed = PTHREAD_COND_INITIALIZER;
static int gate_entered, gate_go;
static memgov_callback* self_removing;
static int32_t self_remove_rc = -1;

static uint64_t remove_self_then_wait(const memgov_pressure_request* request, void* user_data) {
    (void)request;
    (void)user_data;
    self_remove_rc = memgov_pressure_callback_remove(self_removing);
    pthread_mutex_lock(&gate_lock);
    gate_entered = 1;
    pthread_cond_broadcast(&gate_changed);
    while (!gate_go)
        pthread_cond_wait(&gate_changed, &gate_lock);
    pthread_mutex_unlock(&gate_lock);
    return 0;
}

int32_t plugin_init_self_removing(memgov_plugin* plugin, void* host_data) {
    gate_entered = 0;
    gate_go = 0;
    self_remove_rc = -1;
    CHECK(memgov_pressure_callback_add((memgov_context*)host_data, plugin, remove_self_then_wait,
                                       NULL, &self_removing));
    return MEMGOV_OK;
}

/* Wait until the callback has removed itself and is waiting; its remove's
 * status. */
int32_t plugin_wait_until_removed(void) {
    pthread_mutex_lock(&gate_lock);
    while (!gate_entered)
        pthread_cond_wait(&gate_changed, &gate_lock);
    pthread_mutex_unlock(&gate_lock);
    return self_remove_rc;
}

/* Let the callback return. */
int32_t plugin_let_the_callback_return(void) {
    pthread_mutex_lock(&gate_lock);
    gate_go = 1;
    pthread_cond_broadcast(&gate_changed);
    pthread_mutex_unlock(&gate_lock);
    return MEMGOV_OK;
}
