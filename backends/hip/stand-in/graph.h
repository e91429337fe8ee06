/*
 * graph.h: what libamdhip64.c and vmm.c share with graph.c (stream capture
 * and graphs) inside the stand-in. Internal to the library.
 *
 * The graph.c hooks are weak, like vmm.c's, so that libamdhip64.c also
 * links without graph.c; callers test them for NULL first.
 */
#ifndef MEMGOV_STANDIN_HIP_GRAPH_H
#define MEMGOV_STANDIN_HIP_GRAPH_H

#include "standin.h"

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* graph.c: whether `stream` is in a capture sequence (active or
 * invalidated). */
/* graph.c: the test hook memgov_standin_hip_pause_entry arms: the call of
 * `fn` it names blocks here, at its entry, until resumed. */
void graph_pause_point(const char *fn) __attribute__((weak));
int graph_capturing(const void *stream) __attribute__((weak));
/* graph.c: record a copy into the capture of `stream` instead of queueing
 * it (the arguments as copy_async takes them). Returns the call's result. */
int graph_record_copy(const char *fn, const void *stream, int dst_device, int src_device,
                      void *dst, const void *src, size_t bytes) __attribute__((weak));
/* graph.c: record a stream callback into the capture of `stream`. */
int graph_record_callback(const void *stream, void *fn, void *user) __attribute__((weak));
/* graph.c: `fn` on a capturing stream necessarily conflicts with capture
 * (hipStreamSynchronize, hipStreamQuery): the capture is invalidated and
 * the call returns hipErrorStreamCaptureUnsupported. */
int graph_conflicting(const char *fn, const void *stream) __attribute__((weak));
/* graph.c: a potentially unsafe call (one that changes memory outside any
 * stream, as hipMalloc) is about to run on the calling thread. Returns 0
 * when the capture modes allow it, else invalidates the captures that
 * prohibit it and returns hipErrorStreamCaptureUnsupported. `alloc` counts
 * it as a runtime allocation made while a capture was under way. */
int graph_unsafe(const char *fn, int alloc) __attribute__((weak));

/* libamdhip64.c: queue a recorded copy on `stream` with every check a copy
 * makes (a copy touching freed or unmapped memory aborts). */
int hip_standin_copy(const char *fn, const void *stream, int dst_device, int src_device,
                     void *dst, const void *src, size_t bytes);
/* libamdhip64.c: queue a recorded stream callback on `stream`. */
int hip_standin_callback(const void *stream, void *fn, void *user);
/* libamdhip64.c: a stream argument is live (else a contract violation). */
void hip_standin_check_stream(const void *stream, const char *fn);

#pragma GCC visibility pop

#endif
