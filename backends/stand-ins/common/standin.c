/*
 * standin.c: ordered queues, host-backed device memory, knobs and fatal
 * messages shared by the stand-in driver libraries. See standin.h.
 */
#define _GNU_SOURCE
#include "standin.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- fatal contract violations ------------------------------------------ */

static const char *g_name = "stand-in driver";

void sq_set_name(const char *name) { g_name = name; }

static void vreport(const char *kind, const char *fmt, va_list ap) {
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    fprintf(stderr, "memgov %s: %s: %s\n", g_name, kind, buf);
    fflush(stderr);
}

void sq_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vreport("contract violation", fmt, ap);
    va_end(ap);
    abort();
}

void sq_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vreport("internal failure", fmt, ap);
    va_end(ap);
    abort();
}

static void lock(pthread_mutex_t *m) {
    int rc = pthread_mutex_lock(m);
    if (rc != 0) sq_fatal("pthread_mutex_lock: %s", strerror(rc));
}

static void unlock(pthread_mutex_t *m) {
    int rc = pthread_mutex_unlock(m);
    if (rc != 0) sq_fatal("pthread_mutex_unlock: %s", strerror(rc));
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n, size);
    if (p == NULL) sq_fatal("out of host memory (%zu x %zu bytes)", n, size);
    return p;
}

/* ---- environment knobs --------------------------------------------------- */

uint64_t sq_env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return dflt;
    char *end = NULL;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || v[0] == '-')
        sq_die("%s=%s is not a non-negative decimal integer", name, v);
    return (uint64_t)n;
}

int sq_env_lists(const char *name, const char *item) {
    const char *v = getenv(name);
    if (v == NULL) return 0;
    size_t n = strlen(item);
    for (const char *p = v; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, item, n) == 0) return 1;
        if (end == NULL) break;
        p = end + 1;
    }
    return 0;
}

void sq_inits_acquire(struct sq_inits *i) { __atomic_add_fetch(&i->count, 1, __ATOMIC_ACQ_REL); }

int sq_inits_release(struct sq_inits *i) {
    int n = __atomic_load_n(&i->count, __ATOMIC_ACQUIRE);
    while (n > 0)
        if (__atomic_compare_exchange_n(&i->count, &n, n - 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 0;
    return -1;
}

int sq_inits_held(struct sq_inits *i) { return __atomic_load_n(&i->count, __ATOMIC_ACQUIRE) > 0; }

int sq_env_devices(const char *env, int max) {
    uint64_t n = sq_env_u64(env, 1);
    return n > (uint64_t)max ? max : (int)n;
}

void sq_process_file_each(const char *env, int (*each)(void *ctx, const struct sq_process_line *),
                          void *ctx) {
    const char *path = getenv(env);
    if (path == NULL || path[0] == 0) return;
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    char buf[256];
    while (fgets(buf, sizeof buf, f) != NULL) {
        struct sq_process_line l = {0};
        char bytes[64], kind[32];
        int k = sscanf(buf, "%d %u %63s %31s", &l.device, &l.pid, bytes, kind);
        if (k < 3) continue;
        l.not_available = strcmp(bytes, "-") == 0;
        char *end = bytes;
        if (!l.not_available) l.bytes = strtoull(bytes, &end, 10);
        l.numeric = end != bytes;
        l.graphics = k == 4 && strcmp(kind, "graphics") == 0;
        if (each(ctx, &l)) break;
    }
    fclose(f);
}

static pthread_mutex_t g_entry_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_fail_entry[64];
static uint64_t g_fail_entry_at, g_entry_calls;
static int g_entry_init;

int sq_entry_fault_set(const char *fn, unsigned long long n) {
    if (fn != NULL && strlen(fn) >= sizeof g_fail_entry) return 1;
    pthread_mutex_lock(&g_entry_lock);
    g_entry_init = 1;
    memset(g_fail_entry, 0, sizeof g_fail_entry);
    if (fn != NULL) memcpy(g_fail_entry, fn, strlen(fn));
    g_fail_entry_at = fn != NULL ? n : 0;
    g_entry_calls = 0;
    pthread_mutex_unlock(&g_entry_lock);
    return 0;
}

int sq_entry_fault(const char *env, const char *fn) {
    pthread_mutex_lock(&g_entry_lock);
    if (!g_entry_init) {
        g_entry_init = 1;
        const char *v = getenv(env);
        const char *colon = v != NULL ? strrchr(v, ':') : NULL;
        if (colon != NULL && (size_t)(colon - v) < sizeof g_fail_entry) {
            memcpy(g_fail_entry, v, (size_t)(colon - v));
            g_fail_entry_at = strtoull(colon + 1, NULL, 10);
        } else if (v != NULL && *v != '\0') {
            sq_fatal("%s=%s: expected <entry point>:<N>", env, v);
        }
    }
    int fail = g_fail_entry_at != 0 && strcmp(fn, g_fail_entry) == 0 &&
               ++g_entry_calls == g_fail_entry_at;
    pthread_mutex_unlock(&g_entry_lock);
    return fail;
}

static pthread_mutex_t g_pause_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_pause_cond = PTHREAD_COND_INITIALIZER;
static char g_pause_entry[64];
static uint64_t g_pause_at, g_pause_calls;
static int g_paused, g_resumed;

int sq_entry_pause_set(const char *fn, unsigned long long n) {
    if (fn != NULL && strlen(fn) >= sizeof g_pause_entry) return 1;
    pthread_mutex_lock(&g_pause_lock);
    memset(g_pause_entry, 0, sizeof g_pause_entry);
    if (fn != NULL) memcpy(g_pause_entry, fn, strlen(fn));
    __atomic_store_n(&g_pause_at, fn != NULL ? n : 0, __ATOMIC_RELEASE);
    g_pause_calls = 0;
    pthread_mutex_unlock(&g_pause_lock);
    return 0;
}

void sq_entry_pause(const char *fn) {
    /* Every entry point comes here: nothing armed, no lock taken. */
    if (__atomic_load_n(&g_pause_at, __ATOMIC_ACQUIRE) == 0) return;
    pthread_mutex_lock(&g_pause_lock);
    if (g_pause_at != 0 && strcmp(fn, g_pause_entry) == 0 && ++g_pause_calls == g_pause_at) {
        g_paused = 1;
        g_resumed = 0;
        pthread_cond_broadcast(&g_pause_cond);
        while (!g_resumed) pthread_cond_wait(&g_pause_cond, &g_pause_lock);
        g_paused = 0;
    }
    pthread_mutex_unlock(&g_pause_lock);
}

int sq_entry_paused(void) {
    pthread_mutex_lock(&g_pause_lock);
    int p = g_paused;
    pthread_mutex_unlock(&g_pause_lock);
    return p;
}

void sq_entry_resume(void) {
    pthread_mutex_lock(&g_pause_lock);
    g_resumed = 1;
    pthread_cond_broadcast(&g_pause_cond);
    pthread_mutex_unlock(&g_pause_lock);
}

static uint64_t env_u64(const char *prefix, const char *suffix, uint64_t dflt) {
    char name[128];
    snprintf(name, sizeof name, "%s_%s", prefix, suffix);
    return sq_env_u64(name, dflt);
}

/* The latency seed of the loaded knobs (see sq_knobs.latency_seed); written
 * by sq_knobs_load (the seed before the flag, which is stored with release
 * and read with acquire by sq_queue_new on any thread). */
static int g_latency_seeded;
static uint64_t g_latency_seed;

void sq_knobs_load(struct sq_knobs *knobs, const char *prefix) {
    knobs->latency_us = env_u64(prefix, "LATENCY_US", 0);
    char name[128];
    snprintf(name, sizeof name, "%s_LATENCY_SEED", prefix);
    const char *seed = getenv(name);
    knobs->latency_seeded = seed != NULL && seed[0] != '\0';
    knobs->latency_seed = knobs->latency_seeded ? sq_env_u64(name, 0) : 0;
    __atomic_store_n(&g_latency_seed, knobs->latency_seed, __ATOMIC_RELAXED);
    __atomic_store_n(&g_latency_seeded, knobs->latency_seeded, __ATOMIC_RELEASE);
    knobs->oom_after_bytes = env_u64(prefix, "OOM_AFTER_BYTES", 0);
    knobs->sticky_error_at_op = env_u64(prefix, "STICKY_ERROR_AT_OP", 0);
}

static pthread_mutex_t g_ops_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_ops;
static int g_sticky;

int sq_knobs_tick(const struct sq_knobs *knobs) {
    lock(&g_ops_lock);
    g_ops++;
    if (knobs->sticky_error_at_op != 0 && g_ops >= knobs->sticky_error_at_op) g_sticky = 1;
    int sticky = g_sticky;
    unlock(&g_ops_lock);
    return sticky;
}

int sq_knobs_sticky(void) {
    lock(&g_ops_lock);
    int sticky = g_sticky;
    unlock(&g_ops_lock);
    return sticky;
}

/* ---- ordered operation queue --------------------------------------------- */

struct sq_op {
    sq_op_fn fn;
    void *arg;
    unsigned flags;
    uint64_t seq;
    struct sq_op *next;
};

struct sq_front {
    struct sq_queue *q; /* referenced */
    uint64_t seq;
};

struct sq_queue {
    uint64_t id;
    int refs; /* guarded by g_refs_lock */
    pthread_mutex_t lock;
    pthread_cond_t work;     /* signalled when an op is pushed or stop is set */
    pthread_cond_t finished; /* signalled when an op finishes */
    struct sq_op *head, *tail;
    uint64_t pushed;    /* seq of the last op pushed */
    uint64_t completed; /* seq of the last op finished (ops finish in order) */
    uint64_t latency_us;
    int jitter;          /* delays drawn from rng (a latency seed was set) */
    uint64_t rng;        /* splitmix64 state; used by the queue's thread only */
    uint64_t observed; /* highest seq the host has observed complete */
    struct sq_front *front; /* frontier (see standin.h), guarded by lock */
    size_t front_n, front_cap;
    int stop;
    pthread_t thread;
};

/* Internal flag: an empty position marker, run without latency. */
#define SQ_OP_MARK 0x80000000u

static pthread_mutex_t g_refs_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_next_queue_id;

static void queue_ref(struct sq_queue *q) {
    lock(&g_refs_lock);
    q->refs++;
    unlock(&g_refs_lock);
}

static void queue_unref(struct sq_queue *q) {
    lock(&g_refs_lock);
    int last = --q->refs == 0;
    unlock(&g_refs_lock);
    if (!last) return;
    for (size_t i = 0; i < q->front_n; i++) queue_unref(q->front[i].q);
    free(q->front);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->finished);
    pthread_mutex_destroy(&q->lock);
    free(q);
}

static __thread int t_on_queue;
static __thread unsigned t_op_flags;

unsigned sq_current_op_flags(void) { return t_op_flags; }

int sq_on_queue_thread(void) { return t_on_queue; }

static void sleep_us(uint64_t us) {
    if (us == 0) return;
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000), .tv_nsec = (long)(us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The wait before the queue's next operation: the latency, or with a seed a
 * draw from [0, 2 * latency]. */
static uint64_t next_delay(struct sq_queue *q) {
    if (!q->jitter || q->latency_us == 0) return q->latency_us;
    return splitmix64(&q->rng) % (2 * q->latency_us + 1);
}

static void *queue_main(void *p) {
    struct sq_queue *q = p;
    t_on_queue = 1;
    lock(&q->lock);
    for (;;) {
        while (q->head == NULL && !q->stop) pthread_cond_wait(&q->work, &q->lock);
        if (q->head == NULL && q->stop) break;
        struct sq_op *op = q->head;
        q->head = op->next;
        if (q->head == NULL) q->tail = NULL;
        unlock(&q->lock);

        if (!(op->flags & SQ_OP_MARK)) {
            sleep_us(next_delay(q));
            t_op_flags = op->flags;
            op->fn(op->arg);
            t_op_flags = SQ_OP_PLAIN;
        }

        lock(&q->lock);
        q->completed = op->seq;
        free(op);
        pthread_cond_broadcast(&q->finished);
    }
    unlock(&q->lock);
    return NULL;
}

struct sq_queue *sq_queue_new(uint64_t latency_us) {
    struct sq_queue *q = xcalloc(1, sizeof *q);
    q->latency_us = latency_us;
    q->refs = 1;
    lock(&g_refs_lock);
    q->id = ++g_next_queue_id;
    unlock(&g_refs_lock);
    /* Each queue's draws start from the seed combined with its id (the Nth
     * queue the library makes): different sequences for different queues,
     * the same ones for the same seed. */
    q->jitter = __atomic_load_n(&g_latency_seeded, __ATOMIC_ACQUIRE);
    q->rng = __atomic_load_n(&g_latency_seed, __ATOMIC_RELAXED) ^ (q->id * 0x9e3779b97f4a7c15ull);
    if (pthread_mutex_init(&q->lock, NULL) != 0 || pthread_cond_init(&q->work, NULL) != 0 ||
        pthread_cond_init(&q->finished, NULL) != 0)
        sq_fatal("cannot initialise queue synchronisation");
    int rc = pthread_create(&q->thread, NULL, queue_main, q);
    if (rc != 0) sq_fatal("pthread_create: %s", strerror(rc));
    return q;
}

uint64_t sq_queue_push(struct sq_queue *q, sq_op_fn fn, void *arg, unsigned flags) {
    struct sq_op *op = xcalloc(1, sizeof *op);
    op->fn = fn;
    op->arg = arg;
    op->flags = flags;
    lock(&q->lock);
    if (q->stop) sq_die("operation pushed to a queue that is being destroyed");
    op->seq = ++q->pushed;
    if (q->tail) q->tail->next = op;
    else q->head = op;
    q->tail = op;
    pthread_cond_signal(&q->work);
    uint64_t seq = op->seq;
    unlock(&q->lock);
    return seq;
}

/* Wait for op `seq`; `host` records the completion as observed by the host. */
static void wait_seq(struct sq_queue *q, uint64_t seq, int host) {
    lock(&q->lock);
    if (q->completed < seq && t_on_queue && pthread_equal(pthread_self(), q->thread))
        sq_die("a stream waited on itself from its own operation (deadlock)");
    while (q->completed < seq) pthread_cond_wait(&q->finished, &q->lock);
    if (host && q->observed < seq) q->observed = seq;
    unlock(&q->lock);
}

void sq_queue_wait(struct sq_queue *q, uint64_t seq) { wait_seq(q, seq, 1); }

struct copy_op {
    void *dst;
    const void *src;
    size_t bytes;
};

static void run_copy(void *arg) {
    struct copy_op *op = arg;
    if (!sq_knobs_sticky()) memcpy(op->dst, op->src, op->bytes);
    free(op);
}

void sq_queue_copy(struct sq_queue *q, void *dst, const void *src, size_t bytes) {
    struct copy_op *op = xcalloc(1, sizeof *op);
    *op = (struct copy_op){.dst = dst, .src = src, .bytes = bytes};
    sq_queue_push(q, run_copy, op, SQ_OP_PLAIN);
}

void sq_queue_sync(struct sq_queue *q) {
    lock(&q->lock);
    uint64_t target = q->pushed;
    unlock(&q->lock);
    sq_queue_wait(q, target);
}

int sq_queue_done(struct sq_queue *q, uint64_t seq) {
    lock(&q->lock);
    int done = q->completed >= seq;
    if (done && q->observed < seq) q->observed = seq;
    unlock(&q->lock);
    return done;
}

uint64_t sq_queue_pending(struct sq_queue *q) {
    lock(&q->lock);
    uint64_t n = q->pushed - q->completed;
    /* Nothing pending is what a stream query reports as complete. */
    if (n == 0) q->observed = q->completed;
    unlock(&q->lock);
    return n;
}

uint64_t sq_queue_last(struct sq_queue *q) {
    lock(&q->lock);
    uint64_t n = q->pushed;
    unlock(&q->lock);
    return n;
}

void sq_queue_close(struct sq_queue *q) {
    lock(&q->lock);
    q->stop = 1;
    pthread_cond_signal(&q->work);
    unlock(&q->lock);
}

void sq_queue_destroy(struct sq_queue *q) {
    if (t_on_queue && pthread_equal(pthread_self(), q->thread))
        sq_die("a stream was destroyed from its own operation");
    sq_queue_close(q);
    int rc = pthread_join(q->thread, NULL);
    if (rc != 0) sq_fatal("pthread_join: %s", strerror(rc));
    lock(&q->lock);
    q->observed = q->completed; /* drained and joined: all of it ran */
    unlock(&q->lock);
    queue_unref(q);
}

/* ---- stream ordering ------------------------------------------------------ */

uint64_t sq_queue_id(struct sq_queue *q) { return q->id; }

static void noop(void *arg) { (void)arg; }

uint64_t sq_queue_mark(struct sq_queue *q) { return sq_queue_push(q, noop, NULL, SQ_OP_MARK); }

/* Frontier entry of q for a (q->lock held); 0 when none. */
static uint64_t front_get(struct sq_queue *q, struct sq_queue *a) {
    for (size_t i = 0; i < q->front_n; i++)
        if (q->front[i].q == a) return q->front[i].seq;
    return 0;
}

/* Raise q's frontier for a to at least seq (q->lock held). */
static void front_raise(struct sq_queue *q, struct sq_queue *a, uint64_t seq) {
    if (a == q || seq == 0) return;
    for (size_t i = 0; i < q->front_n; i++) {
        if (q->front[i].q == a) {
            if (q->front[i].seq < seq) q->front[i].seq = seq;
            return;
        }
    }
    if (q->front_n == q->front_cap) {
        q->front_cap = q->front_cap ? q->front_cap * 2 : 8;
        q->front = realloc(q->front, q->front_cap * sizeof *q->front);
        if (q->front == NULL) sq_fatal("out of host memory growing a stream frontier");
    }
    queue_ref(a);
    q->front[q->front_n++] = (struct sq_front){.q = a, .seq = seq};
}

uint64_t sq_queue_frontier(struct sq_queue *q, struct sq_queue *a) {
    lock(&q->lock);
    uint64_t n = a == q ? q->pushed : front_get(q, a);
    unlock(&q->lock);
    return n;
}

uint64_t sq_queue_observed(struct sq_queue *q) {
    lock(&q->lock);
    uint64_t n = q->observed;
    unlock(&q->lock);
    return n;
}

int sq_queue_ordered_after(struct sq_queue *q, struct sq_queue *a, uint64_t n) {
    if (n == 0 || q == a) return 1;
    if (sq_queue_observed(a) >= n) return 1;
    return sq_queue_frontier(q, a) >= n;
}

/* What a record captured: the queue (referenced), its last seq, and a copy
 * of its frontier. Shared by the event and the waits pushed from it. */
struct sq_capture {
    int refs; /* guarded by g_refs_lock */
    struct sq_queue *q;
    uint64_t seq;
    struct sq_front *front; /* each entry referenced */
    size_t front_n;
};

static void capture_unref(struct sq_capture *c) {
    if (c == NULL) return;
    lock(&g_refs_lock);
    int last = --c->refs == 0;
    unlock(&g_refs_lock);
    if (!last) return;
    for (size_t i = 0; i < c->front_n; i++) queue_unref(c->front[i].q);
    free(c->front);
    queue_unref(c->q);
    free(c);
}

#define EVENT_MAGIC 0x45564e54u /* "EVNT" */
#define EVENT_QUARANTINE 4096

struct sq_event {
    unsigned magic;
    int destroyed;
    pthread_mutex_t lock;
    struct sq_capture *cap; /* NULL until recorded */
};

static pthread_mutex_t g_quarantine_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sq_event *g_quarantine[EVENT_QUARANTINE];
static size_t g_quarantine_next;

struct sq_event *sq_event_new(void) {
    struct sq_event *e = xcalloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    if (pthread_mutex_init(&e->lock, NULL) != 0) sq_fatal("cannot initialise event lock");
    return e;
}

void sq_event_check(struct sq_event *e, const char *fn) {
    if (e == NULL || e->magic != EVENT_MAGIC) sq_die("%s: %p is not an event", fn, (void *)e);
    if (e->destroyed) sq_die("%s on destroyed event %p", fn, (void *)e);
}

static struct sq_capture *event_capture(struct sq_event *e) {
    lock(&e->lock);
    struct sq_capture *c = e->cap;
    if (c != NULL) {
        lock(&g_refs_lock);
        c->refs++;
        unlock(&g_refs_lock);
    }
    unlock(&e->lock);
    return c;
}

void sq_event_record(struct sq_event *e, struct sq_queue *q) {
    struct sq_capture *c = xcalloc(1, sizeof *c);
    c->refs = 1;
    queue_ref(q);
    c->q = q;
    lock(&q->lock);
    c->seq = q->pushed;
    if (q->front_n != 0) {
        c->front = xcalloc(q->front_n, sizeof *c->front);
        for (size_t i = 0; i < q->front_n; i++) {
            queue_ref(q->front[i].q);
            c->front[i] = q->front[i];
        }
        c->front_n = q->front_n;
    }
    unlock(&q->lock);
    lock(&e->lock);
    struct sq_capture *old = e->cap;
    e->cap = c;
    unlock(&e->lock);
    capture_unref(old);
}

static void run_wait(void *arg) {
    struct sq_capture *c = arg;
    wait_seq(c->q, c->seq, 0);
    capture_unref(c);
}

void sq_queue_wait_event(struct sq_queue *q, struct sq_event *e) {
    struct sq_capture *c = event_capture(e);
    if (c == NULL) return;
    if (c->seq == 0) {
        capture_unref(c);
        return;
    }
    /* The frontier is raised before the wait is pushed: nothing else can be
     * pushed on q in between by this thread, and a concurrent push on q from
     * another thread is unordered with this call either way. */
    lock(&q->lock);
    front_raise(q, c->q, c->seq);
    for (size_t i = 0; i < c->front_n; i++) front_raise(q, c->front[i].q, c->front[i].seq);
    unlock(&q->lock);
    sq_queue_push(q, run_wait, c, SQ_OP_PLAIN);
}

int sq_event_done(struct sq_event *e) {
    struct sq_capture *c = event_capture(e);
    if (c == NULL) return 1;
    int done = sq_queue_done(c->q, c->seq);
    capture_unref(c);
    return done;
}

void sq_event_sync(struct sq_event *e) {
    struct sq_capture *c = event_capture(e);
    if (c == NULL) return;
    wait_seq(c->q, c->seq, 1);
    capture_unref(c);
}

void sq_event_destroy(struct sq_event *e) {
    lock(&e->lock);
    struct sq_capture *c = e->cap;
    e->cap = NULL;
    e->destroyed = 1;
    unlock(&e->lock);
    capture_unref(c);
    /* Kept (bounded) so that a later use is caught rather than undefined. */
    lock(&g_quarantine_lock);
    struct sq_event *old = g_quarantine[g_quarantine_next];
    g_quarantine[g_quarantine_next] = e;
    g_quarantine_next = (g_quarantine_next + 1) % EVENT_QUARANTINE;
    unlock(&g_quarantine_lock);
    if (old != NULL) {
        old->magic = 0;
        pthread_mutex_destroy(&old->lock);
        free(old);
    }
}

/* ---- device memory table -------------------------------------------------- */

enum { LIVE = 0, FREEING = 1 };

struct sq_alloc {
    uint64_t base, size;
    int state;
    /* Stream-ordered allocations: the queue (referenced) and position of the
     * latest operation touching it, and whether that is still the allocation
     * itself. NULL for plain allocations. */
    struct sq_queue *last_q;
    uint64_t last_seq;
    int last_is_alloc;
    /* Page-locked host allocations (sq_mem_alloc_tracked): not
     * stream-ordered, but their queued uses are tracked in last_q. */
    int tracked;
};

#define FREED_RING 4096

struct sq_mem {
    pthread_mutex_t lock;
    struct sq_alloc *v; /* allocations not yet finished freeing */
    size_t n, cap;
    uint64_t live_bytes;
    uint64_t limit;
    /* Ranges whose free finished, newest last, so a late use can be named
     * "already freed" rather than "unknown". Bounded; older ones are forgotten. */
    struct sq_alloc freed[FREED_RING];
    size_t freed_next, freed_n;
};

struct sq_mem *sq_mem_new(uint64_t oom_after_bytes) {
    struct sq_mem *m = xcalloc(1, sizeof *m);
    m->limit = oom_after_bytes;
    if (pthread_mutex_init(&m->lock, NULL) != 0) sq_fatal("cannot initialise memory table lock");
    return m;
}

static uint64_t mem_alloc(struct sq_mem *m, uint64_t bytes, struct sq_queue *q, uint64_t seq);
static struct sq_alloc *find_containing(struct sq_mem *m, uint64_t addr);

uint64_t sq_mem_alloc(struct sq_mem *m, uint64_t bytes) { return mem_alloc(m, bytes, NULL, 0); }

uint64_t sq_mem_alloc_tracked(struct sq_mem *m, uint64_t bytes) {
    uint64_t base = mem_alloc(m, bytes, NULL, 0);
    if (base == 0) return 0;
    lock(&m->lock);
    struct sq_alloc *a = find_containing(m, base);
    if (a != NULL) a->tracked = 1;
    unlock(&m->lock);
    return base;
}

uint64_t sq_mem_alloc_on(struct sq_mem *m, uint64_t bytes, struct sq_queue *q) {
    /* The position is taken first: an allocation refused for lack of memory
     * leaves only an empty marker behind. */
    uint64_t seq = sq_queue_mark(q);
    return mem_alloc(m, bytes, q, seq);
}

static uint64_t mem_alloc(struct sq_mem *m, uint64_t bytes, struct sq_queue *q, uint64_t seq) {
    if (bytes == 0) sq_fatal("sq_mem_alloc of 0 bytes");
    lock(&m->lock);
    if (m->limit != 0 && (bytes > m->limit || m->live_bytes > m->limit - bytes)) {
        unlock(&m->lock);
        return 0;
    }
    void *p = calloc(1, (size_t)bytes);
    if (p == NULL) {
        unlock(&m->lock);
        return 0;
    }
    if (m->n == m->cap) {
        m->cap = m->cap ? m->cap * 2 : 64;
        m->v = realloc(m->v, m->cap * sizeof *m->v);
        if (m->v == NULL) sq_fatal("out of host memory growing the allocation table");
    }
    uint64_t base = (uint64_t)(uintptr_t)p;
    if (q != NULL) queue_ref(q);
    m->v[m->n++] = (struct sq_alloc){.base = base,
                                     .size = bytes,
                                     .state = LIVE,
                                     .last_q = q,
                                     .last_seq = seq,
                                     .last_is_alloc = 1};
    m->live_bytes += bytes;
    /* A new allocation may reuse an address that was freed before. */
    for (size_t i = 0; i < m->freed_n; i++) {
        struct sq_alloc *f = &m->freed[i];
        if (f->size != 0 && base < f->base + f->size && f->base < base + bytes) f->size = 0;
    }
    unlock(&m->lock);
    return base;
}

static struct sq_alloc *find_containing(struct sq_mem *m, uint64_t addr) {
    for (size_t i = 0; i < m->n; i++)
        if (addr >= m->v[i].base && addr - m->v[i].base < m->v[i].size) return &m->v[i];
    return NULL;
}

static int in_freed_ring(struct sq_mem *m, uint64_t addr) {
    for (size_t i = 0; i < m->freed_n; i++) {
        struct sq_alloc *f = &m->freed[i];
        if (f->size != 0 && addr >= f->base && addr - f->base < f->size) return 1;
    }
    return 0;
}

enum sq_mem_check sq_mem_check(struct sq_mem *m, uint64_t addr, uint64_t len) {
    lock(&m->lock);
    enum sq_mem_check r;
    struct sq_alloc *a = find_containing(m, addr);
    if (a == NULL) r = in_freed_ring(m, addr) ? SQ_MEM_FREED : SQ_MEM_UNKNOWN;
    else if (a->state != LIVE) r = SQ_MEM_FREED;
    else if (len > a->size - (addr - a->base)) r = SQ_MEM_OUT_OF_BOUNDS;
    else r = SQ_MEM_OK;
    unlock(&m->lock);
    return r;
}

enum sq_mem_check sq_mem_begin_free(struct sq_mem *m, uint64_t base) {
    lock(&m->lock);
    enum sq_mem_check r;
    struct sq_alloc *a = find_containing(m, base);
    if (a == NULL) r = in_freed_ring(m, base) ? SQ_MEM_FREED : SQ_MEM_UNKNOWN;
    else if (a->state != LIVE) r = SQ_MEM_FREED;
    else if (a->base != base) r = SQ_MEM_OUT_OF_BOUNDS;
    else {
        a->state = FREEING;
        r = SQ_MEM_OK;
    }
    unlock(&m->lock);
    return r;
}

void sq_mem_finish_free(struct sq_mem *m, uint64_t base) {
    lock(&m->lock);
    for (size_t i = 0; i < m->n; i++) {
        if (m->v[i].base == base && m->v[i].state == FREEING) {
            struct sq_alloc a = m->v[i];
            m->v[i] = m->v[--m->n];
            m->live_bytes -= a.size;
            struct sq_queue *last_q = a.last_q;
            a.last_q = NULL;
            m->freed[m->freed_next] = a;
            m->freed_next = (m->freed_next + 1) % FREED_RING;
            if (m->freed_n < FREED_RING) m->freed_n++;
            unlock(&m->lock);
            free((void *)(uintptr_t)base);
            if (last_q != NULL) queue_unref(last_q);
            return;
        }
    }
    unlock(&m->lock);
    sq_fatal("sq_mem_finish_free of 0x%llx, which has no free in flight", (unsigned long long)base);
}

uint64_t sq_mem_live_count(struct sq_mem *m) {
    lock(&m->lock);
    uint64_t n = m->n;
    unlock(&m->lock);
    return n;
}

uint64_t sq_mem_live_bytes(struct sq_mem *m) {
    lock(&m->lock);
    uint64_t n = m->live_bytes;
    unlock(&m->lock);
    return n;
}

void sq_mem_destroy(struct sq_mem *m) {
    if (sq_mem_live_count(m) != 0)
        sq_fatal("memory table destroyed with %llu allocations live",
                 (unsigned long long)sq_mem_live_count(m));
    free(m->v);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

/* The ordering check of sq_mem_check_on / sq_mem_begin_free_on, for the
 * allocation containing addr (which the caller found live). */
static void check_order(struct sq_mem *m, uint64_t addr, struct sq_queue *q, const char *fn,
                        int is_free) {
    lock(&m->lock);
    struct sq_alloc *a = find_containing(m, addr);
    struct sq_queue *last_q = a ? a->last_q : NULL;
    uint64_t last_seq = a ? a->last_seq : 0;
    int last_is_alloc = a ? a->last_is_alloc : 0;
    uint64_t base = a ? a->base : 0;
    if (last_q != NULL) queue_ref(last_q);
    unlock(&m->lock);
    if (last_q == NULL) return;
    int ok = sq_queue_ordered_after(q, last_q, last_seq);
    if (!ok) {
        uint64_t front = sq_queue_frontier(q, last_q);
        uint64_t seen = sq_queue_observed(last_q);
        sq_die("%s: allocation 0x%llx %s on stream #%llu before its %s completed - missing "
               "stream ordering (the %s is operation %llu of stream #%llu; stream #%llu is "
               "ordered after its operation %llu through event waits and the host has "
               "observed up to %llu: record an event on stream #%llu after the last use and "
               "make stream #%llu wait on it, or synchronize)",
               fn, (unsigned long long)base, is_free ? "freed" : "used",
               (unsigned long long)q->id,
               last_is_alloc ? "stream-ordered allocation" : "last stream-ordered use",
               last_is_alloc ? "allocation" : "last use", (unsigned long long)last_seq,
               (unsigned long long)last_q->id, (unsigned long long)q->id,
               (unsigned long long)front, (unsigned long long)seen,
               (unsigned long long)last_q->id, (unsigned long long)q->id);
    }
    queue_unref(last_q);
}

enum sq_mem_check sq_mem_check_on(struct sq_mem *m, uint64_t addr, uint64_t len,
                                  struct sq_queue *q, const char *fn) {
    enum sq_mem_check r = sq_mem_check(m, addr, len);
    if (r == SQ_MEM_OK) check_order(m, addr, q, fn, 0);
    return r;
}

void sq_mem_touch(struct sq_mem *m, uint64_t addr, struct sq_queue *q, uint64_t seq) {
    lock(&m->lock);
    struct sq_alloc *a = find_containing(m, addr);
    struct sq_queue *old = NULL;
    if (a != NULL && (a->last_q != NULL || a->tracked)) {
        old = a->last_q;
        queue_ref(q);
        a->last_q = q;
        a->last_seq = seq;
        a->last_is_alloc = 0;
    }
    unlock(&m->lock);
    if (old != NULL) queue_unref(old);
}

enum sq_mem_check sq_mem_begin_free_on(struct sq_mem *m, uint64_t base, struct sq_queue *q,
                                       const char *fn) {
    lock(&m->lock);
    struct sq_alloc *a = find_containing(m, base);
    int live = a != NULL && a->state == LIVE && a->base == base;
    unlock(&m->lock);
    if (live) check_order(m, base, q, fn, 1);
    return sq_mem_begin_free(m, base);
}

enum sq_mem_check sq_mem_free_now(struct sq_mem *m, uint64_t base, const char *fn) {
    lock(&m->lock);
    struct sq_alloc *a = find_containing(m, base);
    int live = a != NULL && a->state == LIVE && a->base == base;
    struct sq_queue *last_q = live ? a->last_q : NULL;
    uint64_t last_seq = live ? a->last_seq : 0;
    if (last_q != NULL) queue_ref(last_q);
    unlock(&m->lock);
    if (last_q != NULL) {
        if (!sq_queue_done(last_q, last_seq))
            sq_die("%s: page-locked host allocation 0x%llx freed while operation %llu of stream "
                   "#%llu that uses it has not completed (an asynchronous copy may still read or "
                   "write it): free it only once the stream has passed its last use (an event "
                   "recorded after the copy has completed, or the stream synchronized)",
                   fn, (unsigned long long)base, (unsigned long long)last_seq,
                   (unsigned long long)last_q->id);
        queue_unref(last_q);
    }
    enum sq_mem_check r = sq_mem_begin_free(m, base);
    if (r == SQ_MEM_OK) sq_mem_finish_free(m, base);
    return r;
}

struct sq_mem *sq_mem_table_of(struct sq_mem *device, struct sq_mem *host, uint64_t addr) {
    enum sq_mem_check d = sq_mem_check(device, addr, 1);
    if (d == SQ_MEM_OK) return device;
    enum sq_mem_check h = sq_mem_check(host, addr, 1);
    if (h == SQ_MEM_OK) return host;
    return d == SQ_MEM_UNKNOWN && h != SQ_MEM_UNKNOWN ? host : device;
}

const char *sq_mem_check_str(enum sq_mem_check c) {
    switch (c) {
    case SQ_MEM_OK: return "valid";
    case SQ_MEM_UNKNOWN: return "unknown";
    case SQ_MEM_FREED: return "already freed";
    case SQ_MEM_OUT_OF_BOUNDS: return "out of bounds";
    }
    return "invalid check result";
}
