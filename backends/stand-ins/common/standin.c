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

static uint64_t env_u64(const char *prefix, const char *suffix, uint64_t dflt) {
    char name[128];
    snprintf(name, sizeof name, "%s_%s", prefix, suffix);
    return sq_env_u64(name, dflt);
}

void sq_knobs_load(struct sq_knobs *knobs, const char *prefix) {
    knobs->latency_us = env_u64(prefix, "LATENCY_US", 0);
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

struct sq_queue {
    pthread_mutex_t lock;
    pthread_cond_t work;     /* signalled when an op is pushed or stop is set */
    pthread_cond_t finished; /* signalled when an op finishes */
    struct sq_op *head, *tail;
    uint64_t pushed;    /* seq of the last op pushed */
    uint64_t completed; /* seq of the last op finished (ops finish in order) */
    uint64_t latency_us;
    int stop;
    pthread_t thread;
};

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

        sleep_us(q->latency_us);
        t_op_flags = op->flags;
        op->fn(op->arg);
        t_op_flags = SQ_OP_PLAIN;

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

void sq_queue_wait(struct sq_queue *q, uint64_t seq) {
    lock(&q->lock);
    if (q->completed < seq && t_on_queue && pthread_equal(pthread_self(), q->thread))
        sq_die("a stream waited on itself from its own operation (deadlock)");
    while (q->completed < seq) pthread_cond_wait(&q->finished, &q->lock);
    unlock(&q->lock);
}

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
    unlock(&q->lock);
    return done;
}

uint64_t sq_queue_pending(struct sq_queue *q) {
    lock(&q->lock);
    uint64_t n = q->pushed - q->completed;
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
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->finished);
    pthread_mutex_destroy(&q->lock);
    free(q);
}

/* ---- device memory table -------------------------------------------------- */

enum { LIVE = 0, FREEING = 1 };

struct sq_alloc {
    uint64_t base, size;
    int state;
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

uint64_t sq_mem_alloc(struct sq_mem *m, uint64_t bytes) {
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
    m->v[m->n++] = (struct sq_alloc){.base = base, .size = bytes, .state = LIVE};
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
            m->freed[m->freed_next] = a;
            m->freed_next = (m->freed_next + 1) % FREED_RING;
            if (m->freed_n < FREED_RING) m->freed_n++;
            unlock(&m->lock);
            free((void *)(uintptr_t)base);
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

const char *sq_mem_check_str(enum sq_mem_check c) {
    switch (c) {
    case SQ_MEM_OK: return "valid";
    case SQ_MEM_UNKNOWN: return "unknown";
    case SQ_MEM_FREED: return "already freed";
    case SQ_MEM_OUT_OF_BOUNDS: return "out of bounds";
    }
    return "invalid check result";
}
