/*
 * graph.h: what libcuda.c and vmm.c share with graph.c (stream capture and
 * graphs) inside the stand-in. Internal to the library.
 *
 * The graph.c hooks are weak, like vmm.c's, so that libcuda.c also links
 * without graph.c; callers test them for NULL first.
 */
#ifndef MEMGOV_STANDIN_CUDA_GRAPH_H
#define MEMGOV_STANDIN_CUDA_GRAPH_H

#include "standin.h"

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* graph.c: whether `stream` is in a capture sequence (active or
 * invalidated). */
int graph_capturing(const void *stream) __attribute__((weak));
/* graph.c: record a copy into the capture of `stream` instead of queueing
 * it (the arguments as copy_async takes them). Returns the call's result. */
int graph_record_copy(const char *fn, const void *stream, uint64_t dev, void *dst,
                      const void *src, size_t bytes) __attribute__((weak));
/* graph.c: record a host function into the capture of `stream`. */
int graph_record_host_fn(const void *stream, void (*fn)(void *), void *user)
    __attribute__((weak));
/* graph.c: `fn` on a capturing stream necessarily conflicts with capture
 * (cuStreamSynchronize, cuStreamQuery): the capture is invalidated and the
 * call returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. */
int graph_conflicting(const char *fn, const void *stream) __attribute__((weak));
/* graph.c: a potentially unsafe call (one that changes memory outside any
 * stream, as cudaMalloc in the driver's documentation) is about to run on
 * the calling thread. Returns 0 when the capture modes allow it, else
 * invalidates the captures that prohibit it and returns
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. `alloc` counts it as a driver
 * allocation made while a capture was under way. */
int graph_unsafe(const char *fn, int alloc) __attribute__((weak));
/* graph.c: a stream-ordered allocation of `bytes` on capturing `stream`:
 * records a memory allocation node whose memory (allocated now from `mem`,
 * held until the graph and its executable graphs are destroyed) is
 * returned in `dptr`. Returns the call's result. */
int graph_record_alloc(const char *fn, const void *stream, struct sq_mem *mem, size_t bytes,
                       unsigned long long *dptr) __attribute__((weak));
/* graph.c: a stream-ordered free of `dptr` on capturing `stream`: records a
 * memory free node. */
int graph_record_free(const char *fn, const void *stream, uint64_t dptr) __attribute__((weak));
/* graph.c: a stream-ordered allocation on a stream that is not capturing;
 * counted when a capture is under way elsewhere. */
void graph_note_alloc(void) __attribute__((weak));

/* graph.c: the test hook memgov_standin_cuda_pause_entry arms: the call of
 * `fn` it names blocks here, at its entry, until resumed. */
void graph_pause_point(const char *fn) __attribute__((weak));

/* libcuda.c: queue a recorded copy on `stream` with every check a copy
 * makes (a copy touching freed or unmapped memory aborts). */
int cuda_standin_copy(const char *fn, const void *stream, uint64_t dev, void *dst,
                      const void *src, size_t bytes);
/* libcuda.c: queue a recorded host function on `stream`. */
int cuda_standin_host_fn(const void *stream, void (*fn)(void *), void *user);
/* libcuda.c: a stream argument is live and of the current context; 0 or the
 * error code. */
int cuda_standin_check_stream(const void *stream, const char *fn);

#pragma GCC visibility pop

#endif
