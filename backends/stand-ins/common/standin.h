/*
 * standin.h: the machinery every stand-in driver library shares.
 *
 * A stand-in driver (libcuda.so.1, libamdhip64.so) imitates a GPU driver's
 * rules on the host so that CI without a GPU exercises the same ordering and
 * lifetime contracts a real device enforces. This header is the shared part:
 *
 *   - sq_queue: an ordered queue of operations run on one host thread. A
 *     stream is one queue. Operations run strictly in push order, each after
 *     an optional latency, so work is really pending when the caller moves on.
 *   - sq_mem: a table of device allocations backed by host memory, with the
 *     checks a driver makes on a pointer (unknown, already freed, out of
 *     bounds) and the byte limit behind the out-of-memory knob.
 *   - sq_knobs: the environment knobs (latency, OOM after N bytes, sticky
 *     device error at operation N), read once with a per-driver prefix;
 *     sq_env_u64 reads a driver's own integer knobs the same way.
 *   - sq_die: abort the process with one clear "contract violation" line.
 *
 * Threading: every function here is safe to call from any thread. Operations
 * pushed to a queue run on that queue's own thread; while one runs,
 * sq_current_op_flags() on that thread returns the flags it was pushed with,
 * so a driver can refuse calls made from inside a host function
 * (SQ_OP_HOST_FN).
 *
 * The API only grows: existing functions keep their signatures and meaning.
 */
#ifndef MEMGOV_STANDIN_H
#define MEMGOV_STANDIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Internal to each stand-in library: two stand-ins loaded in one process
 * keep their own copies of this machinery. */
#pragma GCC visibility push(hidden)

/* ---- fatal contract violations ------------------------------------------ */

/* Set once per library (e.g. "libcuda stand-in"); prefixes every message. */
void sq_set_name(const char *name);

/*
 * Print "memgov <name>: contract violation: <message>" on stderr and abort().
 * The phrase "contract violation" is stable: tests match on it.
 */
void sq_die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* Same as sq_die for the stand-in's own internal failures (pthread, malloc). */
void sq_fatal(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* ---- environment knobs --------------------------------------------------- */

struct sq_knobs {
    /* <PREFIX>_LATENCY_US: microseconds each queued operation waits before it
     * runs (default 0). */
    uint64_t latency_us;
    /* <PREFIX>_LATENCY_SEED: when set, each queued operation waits a
     * pseudo-random time between 0 and twice <PREFIX>_LATENCY_US instead,
     * drawn per queue from this seed (splitmix64 from the seed combined
     * with the queue's id, the Nth queue made): runs with different seeds
     * interleave streams differently, and a seed gives the Nth queue the
     * same delays in every run. Unset or empty: every operation waits
     * exactly the latency. */
    uint64_t latency_seed;
    int latency_seeded;
    /* <PREFIX>_OOM_AFTER_BYTES: allocations fail with the driver's
     * out-of-memory code once live bytes would exceed this (default: none). */
    uint64_t oom_after_bytes;
    /* <PREFIX>_STICKY_ERROR_AT_OP: counting driver calls from 1, call N and
     * every later call fail with the driver's sticky device error, as after
     * an illegal address on real hardware (default 0: never). */
    uint64_t sticky_error_at_op;
};

/* The environment variable `name` as a non-negative decimal integer, or dflt
 * when it is unset or empty. A malformed value is a contract violation. */
uint64_t sq_env_u64(const char *name, uint64_t dflt);

/* Whether the environment variable `name`, a comma-separated list, names
 * `item` (a whole entry; unset or empty: no). */
int sq_env_lists(const char *name, const char *item);

/* ---- what the management library stand-ins share (NVML, ROCm SMI) ------------
 *
 * Both libraries (NVIDIA's NVML, AMD's ROCm SMI) are reference-counted:
 * their references (nvmlInit_v2 / nvmlShutdown, rsmi_init /
 * rsmi_shut_down) say every other call before the first init returns an
 * uninitialised code, and a shutdown without an init fails; the code each
 * returns is the vendor's. */
struct sq_inits {
    int count; /* atomic */
};
#define SQ_INITS_INITIALIZER {0}
/* An init: one more reference. */
void sq_inits_acquire(struct sq_inits *i);
/* A shutdown: one reference fewer. Returns 0, or -1 (nothing changed) when
 * none is held: the caller returns its vendor's uninitialised code. */
int sq_inits_release(struct sq_inits *i);
/* Whether a reference is held (the library is initialised). */
int sq_inits_held(struct sq_inits *i);

/* The device count of the driver stand-in a management stand-in shadows:
 * the environment variable `env` (that stand-in's _DEVICES knob), default
 * 1, at most `max`. */
int sq_env_devices(const char *env, int max);

/* One line of a management stand-in's process file: "<ordinal> <pid>
 * <bytes> [<kind>]", each on its own line. */
struct sq_process_line {
    int device;
    unsigned pid;
    /* The bytes field: "-" (NVML's "not available"), else a decimal number
     * (`numeric`: it starts with one) read into `bytes` (0 when not). */
    int not_available;
    int numeric;
    unsigned long long bytes;
    /* The optional fourth field is "graphics" (NVML's graphics processes). */
    int graphics;
};
/* Reads the file the environment variable `env` names (unset, empty or
 * unreadable: no lines) on every call, so that a test changes what the
 * library reports between queries by rewriting it, and calls each(ctx,
 * line) for each line with at least the three first fields, in order,
 * until each returns nonzero. */
void sq_process_file_each(const char *env, int (*each)(void *ctx, const struct sq_process_line *),
                          void *ctx);

/* The entry-point fault knob: the environment variable `env` set to
 * "<entry point>:<N>" makes the Nth call of that entry point (counted by
 * sq_entry_fault, per process) fail. sq_entry_fault(env, fn) counts a call
 * of `fn` and returns 1 when it is the one to fail; the variable is read at
 * the first call. sq_entry_fault_set(fn, n) sets the same at run time (fn =
 * NULL or n = 0: none; the count starts again) and returns 1 when the name
 * is too long, else 0. Thread-safe. */
int sq_entry_fault(const char *env, const char *fn);
int sq_entry_fault_set(const char *fn, unsigned long long n);

/* The entry-point pause, for tests that force an interleaving: after
 * sq_entry_pause_set(fn, n) (fn = NULL or n = 0: none; the count starts
 * again; returns 1 when the name is too long, else 0), the Nth call of `fn`
 * that reaches sq_entry_pause(fn) blocks there, before it takes any of the
 * library's locks or changes anything, until sq_entry_resume(); while it is
 * held sq_entry_paused() returns 1. One pause at a time. Thread-safe. */
int sq_entry_pause_set(const char *fn, unsigned long long n);
void sq_entry_pause(const char *fn);
int sq_entry_paused(void);
void sq_entry_resume(void);

/* The test hooks over the knobs above that a stand-in exports under its
 * vendor's name, defined where this is used (once, in the vendor's
 * virtual memory section):
 * memgov_standin_<vendor>_fail_entry(fn, n) (sq_entry_fault_set),
 * memgov_standin_<vendor>_pause_entry(fn, n) (sq_entry_pause_set),
 * memgov_standin_<vendor>_entry_paused() and
 * memgov_standin_<vendor>_resume_entry(). */
#define SQ_EXPORT __attribute__((visibility("default")))
#define SQ_ENTRY_TEST_HOOKS(vendor)                                                          \
    SQ_EXPORT int memgov_standin_##vendor##_fail_entry(const char *fn, unsigned long long n); \
    int memgov_standin_##vendor##_fail_entry(const char *fn, unsigned long long n) {          \
        return sq_entry_fault_set(fn, n);                                                     \
    }                                                                                         \
    SQ_EXPORT int memgov_standin_##vendor##_pause_entry(const char *fn, unsigned long long n); \
    int memgov_standin_##vendor##_pause_entry(const char *fn, unsigned long long n) {         \
        return sq_entry_pause_set(fn, n);                                                     \
    }                                                                                         \
    SQ_EXPORT int memgov_standin_##vendor##_entry_paused(void);                              \
    int memgov_standin_##vendor##_entry_paused(void) { return sq_entry_paused(); }            \
    SQ_EXPORT void memgov_standin_##vendor##_resume_entry(void);                             \
    void memgov_standin_##vendor##_resume_entry(void) { sq_entry_resume(); }

/* Read <prefix>_LATENCY_US, <prefix>_LATENCY_SEED, <prefix>_OOM_AFTER_BYTES
 * and <prefix>_STICKY_ERROR_AT_OP. A malformed value is a contract
 * violation. Queues made after this draw their delays from the seed, if one
 * is set. */
void sq_knobs_load(struct sq_knobs *knobs, const char *prefix);

/* Count one driver call; returns 1 when the device is (now) in the sticky
 * error state per knobs->sticky_error_at_op, else 0. Thread-safe. */
int sq_knobs_tick(const struct sq_knobs *knobs);

/* Whether the sticky error state has been entered (without counting a call). */
int sq_knobs_sticky(void);

/* ---- ordered operation queue (one per stream) ---------------------------- */

/* Flags an operation carries while it runs (see sq_current_op_flags). */
#define SQ_OP_PLAIN 0u
#define SQ_OP_HOST_FN 1u /* a user host function: no driver calls allowed */

typedef void (*sq_op_fn)(void *arg);

struct sq_queue;

/* Start a queue and its thread. latency_us is applied before every op. */
struct sq_queue *sq_queue_new(uint64_t latency_us);

/* Append an operation; it runs after every operation pushed before it.
 * Returns the operation's sequence number (1, 2, ...). */
uint64_t sq_queue_push(struct sq_queue *q, sq_op_fn fn, void *arg, unsigned flags);

/* Append a copy of `bytes` bytes from src to dst (host addresses; the caller
 * has checked both ranges). Skipped when it runs in the sticky error state,
 * as a real device runs nothing after one. */
void sq_queue_copy(struct sq_queue *q, void *dst, const void *src, size_t bytes);

/* Block until every operation pushed before this call has finished. Calling
 * it from the queue's own thread is a contract violation (it would deadlock). */
void sq_queue_sync(struct sq_queue *q);

/* Block until operation `seq` (from sq_queue_push) has finished. */
void sq_queue_wait(struct sq_queue *q, uint64_t seq);

/* Whether operation `seq` has finished (non-blocking). */
int sq_queue_done(struct sq_queue *q, uint64_t seq);

/* Operations pushed but not finished (queued plus running). */
uint64_t sq_queue_pending(struct sq_queue *q);

/* Sequence number of the last operation pushed (0 if none). */
uint64_t sq_queue_last(struct sq_queue *q);

/* Drain the queue (every pushed op still runs), stop and join its thread and
 * free it. Must not be called from the queue's own thread. May follow
 * sq_queue_close. */
void sq_queue_destroy(struct sq_queue *q);

/* Refuse further pushes (a push after this is a contract violation) and
 * return at once; operations already pushed still run, in order, and
 * sq_queue_pending / sq_queue_sync keep working. Free it later with
 * sq_queue_destroy. This is how a driver's non-blocking stream destroy is
 * imitated. */
void sq_queue_close(struct sq_queue *q);

/* Flags of the operation the calling thread is running, or SQ_OP_PLAIN when
 * the calling thread is not running a queued operation. */
unsigned sq_current_op_flags(void);

/* Whether the calling thread is a queue thread (running an op or not). */
int sq_on_queue_thread(void);

/* ---- stream ordering: queue ids, frontiers, events ------------------------
 *
 * Imitates the ordering rules of stream-ordered drivers (CUDA, HIP):
 *
 *   - Every queue has an id (sq_queue_id, 1, 2, ...; never reused).
 *   - A queue's "frontier" says, for each other queue A, the highest sequence
 *     number N of A such that every operation pushed to this queue from now
 *     on is ordered after A's operations 1..N. It only grows, and only
 *     through sq_queue_wait_event: waiting on an event recorded on A at N
 *     orders the waiting queue after A's 1..N and, transitively, after
 *     everything A was ordered after when the event was recorded.
 *   - The host also orders work: once the host has observed operation N of
 *     queue A complete (sq_queue_sync, sq_queue_wait, sq_queue_done returning
 *     1, sq_event_sync, sq_event_done returning 1, sq_queue_destroy), every
 *     later push on any queue is ordered after A's 1..N. sq_queue_observed
 *     reads that position.
 *   - sq_queue_ordered_after(q, a, n): whether work pushed to q from now on
 *     runs after operation n of queue a (same queue, frontier, or host
 *     observation).
 *
 * Events (cuEvent / hipEvent semantics):
 *   - sq_event_record captures the work queued on a queue so far (its last
 *     sequence number) and that queue's frontier; recording again overwrites.
 *     An event never recorded is complete.
 *   - sq_queue_wait_event pushes an operation that blocks the queue's thread
 *     until the captured operation has run; only work pushed after the wait
 *     is ordered by it. The wait keeps what it needs, so the event may be
 *     destroyed (or re-recorded) while the wait is pending.
 *   - sq_event_destroy: the event is kept in a bounded quarantine so that a
 *     later use is caught by sq_event_check (contract violation) rather than
 *     touching freed memory.
 *
 * Queues are reference counted internally: sq_queue_destroy drops the
 * creator's reference after joining the thread; waits, events and
 * allocations that refer to a queue keep it readable until they let go. */

struct sq_event;

/* The queue's id (never 0, never reused within the process). */
uint64_t sq_queue_id(struct sq_queue *q);

/* Push an empty operation (no latency, no work) and return its sequence
 * number: a position in the queue, e.g. where a stream-ordered allocation
 * becomes valid. */
uint64_t sq_queue_mark(struct sq_queue *q);

/* The frontier of q for queue a (see above); sq_queue_last(q) when a == q. */
uint64_t sq_queue_frontier(struct sq_queue *q, struct sq_queue *a);

/* The highest sequence number of q the host has observed complete. */
uint64_t sq_queue_observed(struct sq_queue *q);

/* Whether work pushed to q from now on is ordered after operation n of a. */
int sq_queue_ordered_after(struct sq_queue *q, struct sq_queue *a, uint64_t n);

/* A new, unrecorded event. */
struct sq_event *sq_event_new(void);

/* Capture q's queued work (and its frontier); overwrites an earlier record.
 * Pushes nothing. */
void sq_event_record(struct sq_event *e, struct sq_queue *q);

/* Push onto q an operation that waits until e's captured work has run, and
 * order q's later work after it (frontier). An unrecorded event: no-op. */
void sq_queue_wait_event(struct sq_queue *q, struct sq_event *e);

/* Whether the captured work has run (non-blocking; 1 when unrecorded). A 1
 * counts as a host observation. */
int sq_event_done(struct sq_event *e);

/* Block until the captured work has run (a host observation). */
void sq_event_sync(struct sq_event *e);

/* Destroy the event. Legal while a wait on it is pending (the wait keeps
 * what it needs). Using or destroying it again is caught by sq_event_check. */
void sq_event_destroy(struct sq_event *e);

/* Contract violation (naming fn) unless e is an event that is not destroyed.
 * A pointer that never was an event, or whose quarantine ended, is reported
 * as "not an event". */
void sq_event_check(struct sq_event *e, const char *fn);

/* ---- device memory table (host-backed) ----------------------------------- */

struct sq_mem;

enum sq_mem_check {
    SQ_MEM_OK = 0,
    SQ_MEM_UNKNOWN = 1,       /* not inside any allocation ever made here */
    SQ_MEM_FREED = 2,         /* inside an allocation whose free was queued/done */
    SQ_MEM_OUT_OF_BOUNDS = 3, /* starts inside a live allocation, runs past it */
};

/* A new, empty table. oom_after_bytes == 0 means no limit. */
struct sq_mem *sq_mem_new(uint64_t oom_after_bytes);

/* Allocate `bytes` (> 0) of zeroed host memory and register it. Returns the
 * device address, or 0 when the limit would be exceeded. */
uint64_t sq_mem_alloc(struct sq_mem *m, uint64_t bytes);

/* Check [addr, addr + len) against live allocations. */
enum sq_mem_check sq_mem_check(struct sq_mem *m, uint64_t addr, uint64_t len);

/* Mark the allocation starting exactly at `base` as freed-in-flight: later
 * checks report SQ_MEM_FREED. Returns SQ_MEM_OK, or why it cannot be freed
 * (SQ_MEM_UNKNOWN, SQ_MEM_FREED, or SQ_MEM_OUT_OF_BOUNDS for an interior
 * pointer). The bytes stay allocated until sq_mem_finish_free. */
enum sq_mem_check sq_mem_begin_free(struct sq_mem *m, uint64_t base);

/* Release the host memory of an allocation marked by sq_mem_begin_free. */
void sq_mem_finish_free(struct sq_mem *m, uint64_t base);

/* Allocations not yet finished freeing, and their bytes. */
uint64_t sq_mem_live_count(struct sq_mem *m);
uint64_t sq_mem_live_bytes(struct sq_mem *m);

/* Free the table. Every allocation must have finished freeing. */
void sq_mem_destroy(struct sq_mem *m);

/* Stream-ordered allocations. Like sq_mem_alloc, but the allocation becomes
 * valid at a position of queue q (sq_queue_mark), and the table tracks, per
 * allocation, the queue and position of the latest operation that touches
 * it. Allocations made with plain sq_mem_alloc are not stream-ordered and
 * never fail the ordering check. */
uint64_t sq_mem_alloc_on(struct sq_mem *m, uint64_t bytes, struct sq_queue *q);

/* Before pushing an operation on q that uses [addr, addr + len) (fn names the
 * driver call, for the message): the range must be valid (returns the check
 * result otherwise, without the ordering check), and q must be ordered after
 * the latest operation that touched the allocation, else a contract
 * violation: "... used on stream <q> before ... - missing stream ordering". */
enum sq_mem_check sq_mem_check_on(struct sq_mem *m, uint64_t addr, uint64_t len,
                                  struct sq_queue *q, const char *fn);

/* After pushing that operation (sequence number seq on q): it is now the
 * latest to touch the allocation containing addr. */
void sq_mem_touch(struct sq_mem *m, uint64_t addr, struct sq_queue *q, uint64_t seq);

/* sq_mem_begin_free for a free about to be pushed on q, with the ordering
 * check of sq_mem_check_on: a free on another queue than the allocation's
 * latest user that is not ordered after it is a contract violation
 * ("... freed before its stream-ordered allocation completed - missing
 * stream ordering"). */
enum sq_mem_check sq_mem_begin_free_on(struct sq_mem *m, uint64_t base, struct sq_queue *q,
                                       const char *fn);

/* Page-locked host allocations (cuMemHostAlloc, hipHostMalloc). Like
 * sq_mem_alloc, allocated at once and valid on every queue, but the table
 * tracks the latest queued operation that touches them (sq_mem_check_on /
 * sq_mem_touch), as for a stream-ordered allocation, so that their
 * synchronous free can be checked by sq_mem_free_now. */
uint64_t sq_mem_alloc_tracked(struct sq_mem *m, uint64_t bytes);

/* A synchronous free (cuMemFreeHost, hipHostFree) of the tracked allocation
 * at `base` (fn names the driver call). The CUDA and HIP documentation say
 * the memory must not be freed while an asynchronous copy that uses it may
 * still run: if the latest queued operation touching the allocation (and
 * with it, by the ordering check, every earlier one) has not completed, it
 * is a contract violation ("... freed while operation N of stream #Q that
 * uses it has not completed"). Otherwise the memory is freed at once and
 * SQ_MEM_OK returned; else why it cannot be freed. */
enum sq_mem_check sq_mem_free_now(struct sq_mem *m, uint64_t base, const char *fn);

/* Of a device table and a page-locked host table whose allocations share
 * one address space (the host's), the one an address belongs to: the one
 * where it is live, else the one that knew it (freed), the device's first,
 * else the device's. Addresses are reused across the two tables, so the
 * freed ring of one must not claim a live allocation of the other. */
struct sq_mem *sq_mem_table_of(struct sq_mem *device, struct sq_mem *host, uint64_t addr);

/* Human-readable word for a check result ("unknown", "already freed", ...). */
const char *sq_mem_check_str(enum sq_mem_check c);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* MEMGOV_STANDIN_H */
