/* keel's worker threads for native kernels: one pool per process, shared by every
 * kernel library (each gets keel_parallel's address through its keel_use_pool).
 *
 *   keel_parallel(fn, ctx, n, parts, scratch_floats)
 *
 * splits [0, n) into `parts` contiguous chunks of near-equal size (the same chunks
 * for the same n and parts, every time: keel.native.pool.chunks), and runs
 * fn(ctx, scratch, lo, hi) for each, the calling thread taking chunks alongside the
 * workers. `scratch` is the running thread's own buffer of at least scratch_floats
 * floats (64-byte aligned), kept between calls. A kernel whose chunks compute
 * disjoint outputs with the same instructions wherever the chunk starts gives
 * bitwise the same result whichever thread runs which chunk.
 * keel_parallel_capped(fn, ctx, n, parts, threads, scratch_floats) runs the same chunks
 * on at most `threads` threads, which claim those past their own one at a time (every
 * kernel library's pool entry: parallel.h).
 *
 * Why not Python threads: waking a Python worker through a queue costs ~22 us on
 * the 2-core development machine (a sleeping vCPU is woken through the
 * hypervisor), more than a 32 x 512 x 256 GEMM takes on one thread (80 us) gains
 * from a second. Here a worker that has just run a chunk spins for a while
 * (KEEL_SPIN_US, which keel passes in at load; default 200 us) before it sleeps,
 * so the chunks of the next kernel, a few microseconds later in the same model
 * run, start at once; one dispatch to a spinning worker costs about a
 * microsecond. A model's run is a sequence of such kernels, so the workers
 * sleep only between runs: when a run ends keel calls keel_pool_park, and the
 * idle workers spin on for the idle spin at most (KEEL_IDLE_SPIN_US, default 50
 * us), then sleep. On the 2-core development VM a dispatch to a spinning worker
 * takes the caller 0.7-0.8 us, one to a sleeping worker 7.5-9 us (the futex
 * wake), and the woken worker comes too late for a small job's chunks.
 *
 * A job takes the threads of the pool's ids below its width (its chunks, or its cap if
 * fewer): the others are not woken for it and, spinning, pass it over without spinning
 * on, so the workers a wider split started (keel measures the dispatch on every core
 * once) sleep while a model of fewer threads runs, instead of spinning on every core.
 *
 * One job runs at a time: a second caller (another Python thread) that finds the
 * pool busy runs its chunks itself, in order, on its own scratch. The pool is
 * rebuilt in a child after fork (its threads do not survive one).
 *
 * keel_pool_pin(cpus, n) keeps the workers on those CPUs (one NUMA node's, as the cpu
 * plan decides): the workers running and every worker started later.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* A test build (tests/native/test_pool_race.py) defines KEEL_POOL_PAUSE(where) to stall a
 * thread where a preemption opens a window between two threads' steps: 0, the caller
 * between a job's shape and its ticket; 1, a thread between the ticket it read and the
 * shape it reads next. Nothing in a normal build. */
#ifndef KEEL_POOL_PAUSE
#define KEEL_POOL_PAUSE(where) ((void)0)
#endif

#define MAX_WORKERS 255
#define ALIGN 64

typedef void (*keel_task)(void *ctx, float *scratch, int64_t lo, int64_t hi);

/* ---- per-thread scratch ------------------------------------------------------------ */

typedef struct {
    float *p;
    int64_t floats;
} scratch_buf;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *v)
{
    scratch_buf *s = v;
    free(s->p);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

/* This thread's scratch of at least `floats` floats; NULL if memory ran out. */
static float *scratch_get(int64_t floats)
{
    pthread_once(&scratch_once, scratch_init);
    scratch_buf *s = pthread_getspecific(scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (floats < 1) floats = 1;
    if (s->floats < floats) {
        size_t bytes = ((size_t)floats * sizeof(float) + ALIGN - 1) / ALIGN * ALIGN;
        float *p = aligned_alloc(ALIGN, bytes);
        if (!p) return NULL;
        free(s->p);
        s->p = p;
        s->floats = floats;
    }
    return s->p;
}

/* ---- the pool ---------------------------------------------------------------------- */

typedef struct {
    keel_task fn;
    void *ctx;
    int64_t n, scratch_floats;
} job;

/* The ticket holds the job's epoch (high 32 bits), its chunk count (16) and the next
 * chunk to take (16); the job's shape (pool.shape) its epoch, its width (16) and its
 * owned chunks (16), written before the ticket. A thread takes part in the job of the
 * ticket it read only where the shape it reads next is of the same epoch (else that job
 * has ended and the next one is being set up), and runs a chunk only after claiming it
 * for that epoch: so a worker that wakes late never runs a finished job, and the job's
 * description is stable while any of its chunks can still be claimed. */
#define CHUNK_BITS 16
#define MAX_PARTS ((1 << CHUNK_BITS) - 1)
/* Chunks [0, OWN_PARTS) of a job each have an owner: chunk c goes first to the thread
 * of id c (the calling thread 0, worker i the id i + 1), which claims it by writing the
 * job's epoch into the chunk's claim (claims[c]). The same thread so runs the same
 * part of consecutive kernels that split the same way (the rows of a product, then of
 * its layer norm; the images of a phase copy, then of the conv), and finds that part's
 * data in its own cache. The ticket hands out the chunks from the owned ones on; a
 * thread left without work takes any owned chunk not yet claimed, so a slow or sleeping
 * owner delays nothing. */
#define OWN_PARTS 32

/* Where threads on other cores write, each its own cache line: a word that one thread
 * writes while fifteen others poll the line it shares (the ticket, read by every
 * spinning worker) makes each write a round of invalidations, and sixteen threads
 * updating one word (a shared count of finished chunks, a shared claim mask) queue for
 * the line one after another, a wait that grows with the threads (a dispatch measured
 * 2.6 us on 2 threads, 6.4 us on 16, with every such word on one line). So the live job
 * is one line the caller writes once a job; each owned chunk's claim is its own line;
 * each thread counts the chunks it finished in its own line, and the caller sums them. */
#define LINE 64

static struct {
    /* The live job, written by the caller once a job, polled by spinning workers. */
    _Alignas(LINE) _Atomic uint64_t ticket; /* epoch | parts | next chunk */
    job j;
    /* epoch | width: the threads of the job, those of id below it taking chunks (16) |
     * owned: chunks [0, owned) going first to their owners (16) */
    _Atomic uint64_t shape;
    _Atomic int failed;     /* a thread could not get its scratch */
    _Atomic int stop;
    /* Read-mostly. Started workers: written by grow (under `lock`), keel_pool_stop and a
     * forked child, read by spinning workers without the lock, hence atomic. */
    _Alignas(LINE) _Atomic int workers;
    _Atomic int64_t spin_ns;
    _Alignas(LINE) _Atomic int sleepers; /* workers asleep (each on its slot's `wake`) */
    _Alignas(LINE) atomic_flag busy;     /* a job is being run */
    _Alignas(LINE) pthread_mutex_t lock; /* guards sleeping and waking, and starting workers */
    pthread_t threads[MAX_WORKERS];
} pool = {.ticket = 0, .shape = 0, .failed = 0, .stop = 0, .workers = 0,
          .spin_ns = 200000, .sleepers = 0, .busy = ATOMIC_FLAG_INIT,
          .lock = PTHREAD_MUTEX_INITIALIZER};

/* The epoch of the last job each owned chunk was claimed in. */
static struct {
    _Alignas(LINE) _Atomic uint32_t epoch;
} claims[OWN_PARTS];

/* Each pool thread's own line (id 0: the calling thread; i + 1: worker i): the chunks it
 * ever finished (only it writes them; the caller of a job sums them over the job's
 * threads), the CPU it last ran on as it last looked (-1: asleep, not started, or a CPU
 * not known; read only with yield_shared), whether it sleeps, and the condition it
 * sleeps on, so that a job wakes only the threads it has work for. */
typedef struct {
    _Alignas(LINE) _Atomic int64_t finished;
    _Atomic int cpu;
    _Atomic int asleep; /* written under pool.lock */
    pthread_cond_t wake;
} slot;
static slot slots[MAX_WORKERS + 1];
static pthread_once_t slots_once = PTHREAD_ONCE_INIT;

static void init_slots(void)
{
    for (int i = 0; i <= MAX_WORKERS; i++) {
        pthread_cond_init(&slots[i].wake, NULL);
        atomic_store_explicit(&slots[i].asleep, 0, memory_order_relaxed);
        atomic_store_explicit(&slots[i].cpu, -1, memory_order_relaxed);
    }
}

#if defined(__linux__)
/* The CPUs the workers run on (keel_pool_pin); `pinned` 0: wherever the process may. */
static cpu_set_t pin_set;
static int pinned = 0;
#endif

/* The end of a run (keel_pool_park): a worker waiting for the job after the one of
 * epoch park_epoch spins only until park_until (the moment of the call plus the idle
 * spin, keel_pool_set_idle_spin_us), then sleeps, even if it only came to wait after the
 * call (a worker that woke late for the run's last job). A new job moves the epoch on:
 * the spins between a run's jobs keep KEEL_SPIN_US. */
static _Atomic int64_t park_until = 0;
static _Atomic uint32_t park_epoch = UINT32_MAX;
static _Atomic int64_t idle_spin_ns = 0;

/* A spinning thread (a worker waiting for the next job, the caller waiting for a job's
 * last chunks) may give its core to other runnable threads (sched_yield: a few hundred
 * nanoseconds where none is waiting) every yield_spins spins, as keel's planner decides
 * (keel_pool_set_yield; until then every 256, to any thread). Where the cores are shared
 * with other work, a worker spinning on the caller's core (the other one busy) holds it
 * until the scheduler's slice ends, and a caller waiting on a descheduled worker there
 * delays it: the yield gives the core back. But a worker that yields on a core where
 * another process runs loses that core for a whole slice and misses the jobs meanwhile;
 * so with yield_shared a thread yields only where another of the pool's threads last ran
 * on its CPU (the only threads its spinning can delay), and otherwise spins on, as
 * onnxruntime's workers do. The caller waiting on a job's chunks yields every LONG_SPINS
 * spins in any case (with yield_spins 0 too), so that it never spins for long on a
 * worker descheduled where it could not tell. The clock and the end of a run are checked
 * every CHECK_SPINS spins. */
#define CHECK_SPINS 256
#define LONG_SPINS 4096
static _Atomic int64_t yield_spins = 256; /* a power of two; 0: never (but LONG_SPINS) */
static _Atomic int yield_shared = 0;
/* Every slot's CPU not known: from the pool's first job (forget_cpus) and after
 * keel_pool_stop. */
static void forget_cpus(void)
{
    for (int i = 0; i <= MAX_WORKERS; i++)
        atomic_store_explicit(&slots[i].cpu, -1, memory_order_relaxed);
}

/* The CPU this thread runs on; -1 where that is not known (off Linux), which shares a
 * CPU with no thread. */
static int current_cpu(void)
{
#if defined(__linux__)
    return sched_getcpu();
#else
    return -1;
#endif
}

/* This thread's id in the pool: 0 for a calling thread, i + 1 for worker i. */
static _Thread_local int64_t pool_id = 0;
/* Whether chunks go first to their owners (keel_pool_set_affinity: for measurements). */
static _Atomic int affinity = 1;

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* keel hands the pool KEEL_SPIN_US when it loads this library (keel_pool_set_spin_us):
 * the C code reads no environment. Until then, the default of 200 us. */
static int64_t spin_ns(void) { return pool.spin_ns; }

static uint32_t epoch_of(uint64_t t) { return (uint32_t)(t >> 32); }

/* The width of a job's shape word (pool.shape). */
static int64_t shape_width(uint64_t shape) { return (int64_t)((shape >> CHUNK_BITS) & MAX_PARTS); }

/* Chunk c of [0, n) in `parts` near-equal contiguous pieces (the first n % parts one longer). */
static void chunk(int64_t n, int64_t parts, int64_t c, int64_t *lo, int64_t *hi)
{
    int64_t base = n / parts, extra = n % parts;
    *lo = c * base + (c < extra ? c : extra);
    *hi = *lo + base + (c < extra);
}

/* Run chunk c of the live job (its description is stable while the job is live). */
static void run_chunk(int64_t parts, int64_t c, float **scratch)
{
    if (!*scratch) *scratch = scratch_get(pool.j.scratch_floats);
    if (*scratch) {
        int64_t lo, hi;
        chunk(pool.j.n, parts, c, &lo, &hi);
        pool.j.fn(pool.j.ctx, *scratch, lo, hi);
    } else {
        atomic_store(&pool.failed, 1);
    }
    /* Only this thread writes its count: a plain add, published to the caller's sum. */
    atomic_store_explicit(&slots[pool_id].finished,
                          atomic_load_explicit(&slots[pool_id].finished, memory_order_relaxed) + 1,
                          memory_order_release);
}

/* Claim owned chunk c of the job of `epoch`: 0 when c is taken (or that job is gone).
 * The caller read the job's shape for `epoch`, so c is one of that job's owned chunks;
 * every one is claimed before the job ends, so a thread late for the job finds its
 * chunks taken. A claim moves the chunk's epoch forward only (a thread late for an older
 * job cannot undo a newer claim); the check of the ticket after it is a second guard. */
static int claim_own(uint32_t epoch, int64_t c)
{
    uint32_t seen = atomic_load_explicit(&claims[c].epoch, memory_order_acquire);
    for (;;) {
        if ((int32_t)(seen - epoch) >= 0) return 0;
        if (atomic_compare_exchange_weak_explicit(&claims[c].epoch, &seen, epoch,
                                                  memory_order_acq_rel, memory_order_acquire))
            break;
    }
    return epoch_of(atomic_load_explicit(&pool.ticket, memory_order_acquire)) == epoch;
}

/* Claim and run chunks of the job of `epoch` until none is left (or another job is live):
 * this thread's own chunk first, then the ticket's, then owned chunks left unclaimed. */
static void take_chunks(uint32_t epoch)
{
    float *scratch = NULL;
    uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    if (epoch_of(t) != epoch) return;
    KEEL_POOL_PAUSE(1);
    uint64_t shape = atomic_load_explicit(&pool.shape, memory_order_acquire);
    if (epoch_of(shape) != epoch || pool_id >= shape_width(shape)) return;
    int64_t parts = (int64_t)((t >> CHUNK_BITS) & MAX_PARTS);
    int64_t owned = (int64_t)(shape & MAX_PARTS);
    if (pool_id < owned && claim_own(epoch, pool_id)) run_chunk(parts, pool_id, &scratch);
    t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        int64_t c = (int64_t)(t & MAX_PARTS);
        if (epoch_of(t) != epoch || c >= parts) break;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        run_chunk(parts, c, &scratch);
        t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
    for (int64_t c = 0; c < owned; c++)
        if (claim_own(epoch, c)) run_chunk(parts, c, &scratch);
}

/* Whether another of the first `count` pool threads than this one last ran on `cpu`
 * (never for a CPU not known, -1). */
static int shares_cpu(int cpu, int64_t count)
{
    if (cpu < 0) return 0;
    for (int64_t id = 0; id < count; id++)
        if (id != pool_id && atomic_load_explicit(&slots[id].cpu, memory_order_relaxed) == cpu)
            return 1;
    return 0;
}

/* Whether a thread that has spun `spins` times gives its core away now, the pool's first
 * `count` threads being those its spinning may delay. */
static int should_yield(uint64_t spins, int64_t count)
{
    uint64_t every = (uint64_t)atomic_load_explicit(&yield_spins, memory_order_relaxed);
    if (every == 0 || (spins & (every - 1)) != 0) return 0;
    if (!atomic_load_explicit(&yield_shared, memory_order_relaxed)) return 1;
    int cpu = current_cpu();
    atomic_store_explicit(&slots[pool_id].cpu, cpu, memory_order_relaxed);
    return shares_cpu(cpu, count);
}

/* Whether the job of epoch `now` (the ticket's, just read) has work for this worker: its
 * id below the job's width. A shape of a newer epoch means that job has ended: nothing. */
static int wanted(uint32_t now)
{
    uint64_t shape = atomic_load_explicit(&pool.shape, memory_order_acquire);
    return epoch_of(shape) == now && pool_id < shape_width(shape);
}

/* The epoch of a job newer than `seen` that has work for this worker, spinning a while
 * and then sleeping for one. A job without work for it (a narrower split, or a model of
 * fewer threads than the pool has workers) is passed over: it neither starts the spin
 * again nor wakes the worker, so workers beyond the threads a process's models use go to
 * sleep and stay asleep. */
static uint32_t next_epoch(uint32_t seen)
{
    uint32_t now = epoch_of(atomic_load_explicit(&pool.ticket, memory_order_acquire));
    if (now != seen) {
        if (wanted(now)) return now;
        seen = now;
    }
    int64_t until = now_ns() + spin_ns();
    for (uint64_t i = 0; !atomic_load_explicit(&pool.stop, memory_order_relaxed); i++) {
        now = epoch_of(atomic_load_explicit(&pool.ticket, memory_order_acquire));
        if (now != seen) {
            if (wanted(now)) return now;
            seen = now;
        }
        /* Not on the first pass: a job that follows at once is taken without a call. */
        if (i != 0 && should_yield(i, atomic_load_explicit(&pool.workers, memory_order_relaxed) + 1)) sched_yield();
        if ((i & (CHECK_SPINS - 1)) == 0) {
            if (atomic_load_explicit(&park_epoch, memory_order_acquire) == seen) {
                /* The run ended after the last job: spin on only until park_until. */
                int64_t parked = atomic_load_explicit(&park_until, memory_order_relaxed);
                if (parked < until) until = parked;
            }
            if (now_ns() > until) break;
        }
        cpu_relax();
    }
    atomic_store_explicit(&slots[pool_id].cpu, -1, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);
    /* Asleep and counted before the ticket is read again: a caller that publishes a job
     * after that read sees the count and signals this slot under the lock. */
    atomic_store(&slots[pool_id].asleep, 1);
    atomic_fetch_add(&pool.sleepers, 1);
    while (!atomic_load(&pool.stop)) {
        now = epoch_of(atomic_load(&pool.ticket));
        if (now != seen) {
            if (wanted(now)) break;
            seen = now;
        }
        pthread_cond_wait(&slots[pool_id].wake, &pool.lock);
    }
    atomic_fetch_sub(&pool.sleepers, 1);
    atomic_store(&slots[pool_id].asleep, 0);
    pthread_mutex_unlock(&pool.lock);
    atomic_store_explicit(&slots[pool_id].cpu, current_cpu(), memory_order_relaxed);
    return now;
}

/* Wake the sleeping workers a job of `width` threads has work for (called once its
 * ticket is out, and only where some worker sleeps). */
static void wake_for(int64_t width)
{
    pthread_mutex_lock(&pool.lock);
    int64_t last = atomic_load_explicit(&pool.workers, memory_order_relaxed);
    for (int64_t id = 1; id < width && id <= last; id++)
        if (atomic_load_explicit(&slots[id].asleep, memory_order_relaxed))
            pthread_cond_signal(&slots[id].wake);
    pthread_mutex_unlock(&pool.lock);
}

/* The chunks the threads of ids below `width` have ever finished (the caller of a job
 * subtracts the sum before it). */
static int64_t finished_below(int64_t width)
{
    int64_t sum = 0;
    for (int64_t id = 0; id < width; id++)
        sum += atomic_load_explicit(&slots[id].finished, memory_order_acquire);
    return sum;
}

/* arg: the epoch before the job the worker was started for (so it takes part in that one). */
static _Atomic int64_t next_id = 0; /* ids handed to workers as they start */

static void *worker(void *arg)
{
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    pool_id = atomic_fetch_add(&next_id, 1) + 1;
    atomic_store_explicit(&slots[pool_id].cpu, current_cpu(), memory_order_relaxed);
    for (;;) {
        seen = next_epoch(seen);
        if (atomic_load(&pool.stop)) return NULL;
        take_chunks(seen);
    }
}

/* Start workers until there are `want` (fewer if a thread cannot be created). */
static void grow(int want)
{
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    if (pool.workers >= want) return;
    pthread_mutex_lock(&pool.lock);
    while (pool.workers < want) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        uintptr_t seen = epoch_of(atomic_load_explicit(&pool.ticket, memory_order_relaxed));
#if defined(__linux__)
        if (pinned) pthread_attr_setaffinity_np(&attr, sizeof pin_set, &pin_set);
#endif
        int rc = pthread_create(&pool.threads[pool.workers], &attr, worker, (void *)seen);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
#if defined(__linux__)
        /* Named here, not by the worker: what top -H, debuggers and keel's tests read of
         * a worker is there when grow returns, even if it has not run yet (under load a
         * worker the caller's job did without could still show the caller's name). */
        pthread_setname_np(pool.threads[pool.workers], "keel-worker");
#endif
        pool.workers++;
    }
    pthread_mutex_unlock(&pool.lock);
}

/* Run the chunks on this thread alone, in order. */
static int64_t run_inline(keel_task fn, void *ctx, int64_t n, int64_t parts, int64_t floats)
{
    float *scratch = scratch_get(floats);
    if (!scratch) return -1;
    for (int64_t c = 0; c < parts; c++) {
        int64_t lo, hi;
        chunk(n, parts, c, &lo, &hi);
        fn(ctx, scratch, lo, hi);
    }
    return 0;
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
/* Set on this thread when its last split found the pool busy and ran inline (read by the
 * dispatch timing below, which must not time such a job). */
static _Thread_local int found_busy;

static void after_fork_child(void)
{
    /* The workers did not come along: start over with none. */
    pthread_mutex_init(&pool.lock, NULL);
    init_slots();
    atomic_flag_clear(&pool.busy);
    pool.workers = 0;
    atomic_store(&next_id, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.stop, 0);
    forget_cpus();
}

/* Before the pool's first job: no thread's CPU known yet, and a forked child that
 * starts over. */
static void pool_init(void)
{
    pthread_once(&slots_once, init_slots);
    forget_cpus();
    pthread_atfork(NULL, NULL, after_fork_child);
}

/* Run fn over [0, n) in `parts` chunks on at most `threads` threads (this one
 * included; 0 or less: no cap, as keel_parallel), the chunks past the threads' own
 * claimed from the ticket one at a time, so that a slow or descheduled thread holds only
 * its chunk. Only the threads of the pool's ids below `threads` take chunks (workers
 * started for a wider split wait it out), and the pool grows to threads - 1 workers.
 * Each thread keeps its scratch across its chunks. Returns 0, or -1 when a thread could
 * not get its scratch (chunks may be missing). */
int64_t keel_parallel_capped(keel_task fn, void *ctx, int64_t n, int64_t parts, int64_t threads,
                             int64_t scratch_floats)
{
    if (n <= 0) return 0;
    if (parts > n) parts = n;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    if (parts < 1) parts = 1;
    int64_t cap = threads > 0 && threads < parts ? threads : MAX_WORKERS + 1;
    int64_t width = cap < parts ? cap : parts; /* the threads the job can use */
    if (width == 1) return run_inline(fn, ctx, n, parts, scratch_floats);
    if (atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire)) {
        found_busy = 1;
        return run_inline(fn, ctx, n, parts, scratch_floats);
    }
    pthread_once(&pool_once, pool_init);
    grow((int)(width - 1));
    int64_t owned = atomic_load_explicit(&affinity, memory_order_relaxed)
                        ? (width < OWN_PARTS ? width : OWN_PARTS) : 0;
    int64_t threads_in = width <= pool.workers ? width : pool.workers + 1; /* grow may fall short */
    int64_t before = finished_below(threads_in);
    pool.j = (job){fn, ctx, n, scratch_floats};
    if (atomic_load_explicit(&yield_shared, memory_order_relaxed))
        atomic_store_explicit(&slots[0].cpu, current_cpu(), memory_order_relaxed);
    atomic_store_explicit(&pool.failed, 0, memory_order_relaxed);
    uint32_t epoch = epoch_of(atomic_load_explicit(&pool.ticket, memory_order_relaxed)) + 1;
    atomic_store_explicit(&pool.shape,
                          ((uint64_t)epoch << 32) | ((uint64_t)width << CHUNK_BITS) | (uint64_t)owned,
                          memory_order_release);
    KEEL_POOL_PAUSE(0);
    /* Claims compare epochs as a window (claim_own), so none may fall 2^31 jobs behind:
     * a claim this job does not own is brought to the last epoch, one a job in turn. */
    int64_t stale = epoch % OWN_PARTS;
    if (stale >= owned) atomic_store_explicit(&claims[stale].epoch, epoch - 1, memory_order_relaxed);
    atomic_store(&pool.ticket,
                 ((uint64_t)epoch << 32) | ((uint64_t)parts << CHUNK_BITS) | (uint64_t)owned);
    if (atomic_load(&pool.sleepers) > 0) wake_for(width);
    take_chunks(epoch);
    for (uint64_t i = 1; finished_below(threads_in) - before < parts; i++) {
        cpu_relax();
        if ((i & (LONG_SPINS - 1)) == 0 || should_yield(i, width)) sched_yield();
    }
    int failed = atomic_load(&pool.failed);
    atomic_flag_clear_explicit(&pool.busy, memory_order_release);
    return failed ? -1 : 0;
}

/* Run fn over [0, n) in `parts` chunks on up to `parts` threads (this one included).
 * Returns 0, or -1 when a thread could not get its scratch (chunks may be missing). */
int64_t keel_parallel(keel_task fn, void *ctx, int64_t n, int64_t parts, int64_t scratch_floats)
{
    return keel_parallel_capped(fn, ctx, n, parts, 0, scratch_floats);
}

/* Worker threads started so far. */
int64_t keel_pool_workers(void) { return atomic_load(&pool.workers); }

/* How long an idle worker spins before it sleeps, in microseconds (as keel set it). */
int64_t keel_pool_spin_us(void) { return spin_ns() / 1000; }

/* Set how long an idle worker spins before it sleeps (microseconds; 0 or less: sleep at
 * once). keel calls it with KEEL_SPIN_US when it loads this library. */
void keel_pool_set_spin_us(int64_t us) { pool.spin_ns = us < 0 ? 0 : us * 1000; }

/* How long an idle worker spins after a run ends (keel_pool_park), in microseconds. */
int64_t keel_pool_idle_spin_us(void) { return atomic_load(&idle_spin_ns) / 1000; }

/* Set how long idle workers spin after a run ends (microseconds; 0 or less: they sleep
 * at once). keel calls it with its spin policy when it loads this library. */
void keel_pool_set_idle_spin_us(int64_t us) { atomic_store(&idle_spin_ns, us < 0 ? 0 : us * 1000); }

/* A run ended: workers waiting for the next job spin on for at most the idle spin, then
 * sleep (where KEEL_SPIN_US would have them spin longer). A job that comes first is
 * taken as usual; the next run's first job wakes any that slept (or the caller runs
 * their chunks itself, if they wake late). Costs two atomic stores and a clock read. */
void keel_pool_park(void)
{
    atomic_store_explicit(&park_until, now_ns() + atomic_load(&idle_spin_ns),
                          memory_order_relaxed);
    atomic_store_explicit(&park_epoch,
                          epoch_of(atomic_load_explicit(&pool.ticket, memory_order_relaxed)),
                          memory_order_release);
}

/* How spinning threads give their core away (keel's planner decides: planner.pool_yield):
 * every `spins` spins, rounded up to a power of two (0 or less: never, but the caller every
 * LONG_SPINS), and with
 * `shared` only where another of the pool's threads last ran on the same CPU. Any time: a
 * spinning thread reads them at its next spin (the caller's CPU is known from its next job). */
void keel_pool_set_yield(int64_t spins, int64_t shared)
{
    int64_t every = 0;
    if (spins > 0)
        for (every = 1; every < spins && every < ((int64_t)1 << 40); every <<= 1) {}
    atomic_store(&yield_spins, every);
    atomic_store(&yield_shared, shared != 0);
}

/* The yield interval in spins and whether it is only for a shared CPU, as set. */
int64_t keel_pool_yield_spins(void) { return atomic_load(&yield_spins); }
int64_t keel_pool_yield_shared(void) { return atomic_load(&yield_shared); }

/* Whether each owned chunk goes first to its owner (1, the default) or every chunk to
 * whichever thread claims it first (0): the same chunks either way, so the same results;
 * for measuring what the affinity is worth. Set it only while no job runs. */
void keel_pool_set_affinity(int64_t on) { atomic_store(&affinity, on != 0); }

/* Keep the workers on the `n` CPUs `cpus` (n 0: wherever the process may run), those
 * running now and those started later. Returns 0, -1 where the platform cannot pin or
 * a worker could not be moved. Call it only while no job runs. */
int64_t keel_pool_pin(const int64_t *cpus, int64_t n)
{
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (n > 0) {
        for (int64_t i = 0; i < n; i++)
            if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET((int)cpus[i], &set);
    } else if (sched_getaffinity(0, sizeof set, &set) != 0) {
        return -1;
    }
    int64_t rc = 0;
    pthread_mutex_lock(&pool.lock);
    pin_set = set;
    pinned = n > 0;
    for (int i = 0; i < pool.workers; i++)
        if (pthread_setaffinity_np(pool.threads[i], sizeof set, &set) != 0) rc = -1;
    pthread_mutex_unlock(&pool.lock);
    return rc;
#else
    (void)cpus;
    (void)n;
    return -1;
#endif
}

/* Stop and join every worker (they start again on the next parallel call). */
void keel_pool_stop(void)
{
    while (atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire)) sched_yield();
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.stop, 1);
    int count = pool.workers;
    for (int id = 1; id <= count; id++) pthread_cond_signal(&slots[id].wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < count; i++) pthread_join(pool.threads[i], NULL);
    pool.workers = 0;
    forget_cpus();
    atomic_store(&next_id, 0);
    atomic_store(&pool.stop, 0);
    atomic_flag_clear_explicit(&pool.busy, memory_order_release);
}

/* ---- what a dispatch costs (keel.backends.cpu.thread_costs) -------------------------
 * The round trip of `repeats` jobs of `threads` chunks on `threads` threads, each timed
 * here (no ctypes call inside the clock), in nanoseconds into out[i]. Each chunk waits
 * (up to a millisecond) until every chunk has started, so no thread finishes a job
 * alone: a time is handing the chunks out, every thread in the job at once, and the
 * caller seeing them done, the least a split over that many threads costs. One untimed
 * job first starts or wakes the workers, so the times are those of spinning workers, as
 * between the kernels of a model run. A job that ran inline (the pool busy with another
 * thread's job: its chunks one after another on this thread, each waiting out its
 * millisecond) measures nothing: the timing stops there and returns -2. A job whose
 * chunks did not all meet within the wait (a thread descheduled: more threads than free
 * cores) keeps its time, over a millisecond, and is counted. Returns the count of such
 * jobs (0 or more), -1 when fewer than threads - 1 workers could be started, or -2. */
typedef struct {
    _Atomic int64_t started;
    int64_t parts;
    _Atomic int timed_out;
} meet_job;

static void meet_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    meet_job *j = ctx;
    (void)scratch, (void)lo, (void)hi;
    atomic_fetch_add(&j->started, 1);
    int64_t until = now_ns() + 1000000;
    for (uint64_t i = 1; atomic_load(&j->started) < j->parts; i++) {
        cpu_relax();
        /* As the pool's own waits do: a worker woken onto this core gets it. */
        if (should_yield(i, j->parts)) sched_yield();
        if ((i & (CHECK_SPINS - 1)) != 0) continue;
        if (now_ns() > until) {
            atomic_store(&j->timed_out, 1);
            return;
        }
    }
}

/* One job of `threads` meeting chunks: 0, 1 if a chunk's wait timed out, 2 if it ran
 * inline (the pool busy). */
static int meet(int64_t threads)
{
    meet_job j = {0, threads, 0};
    found_busy = 0;
    keel_parallel_capped(meet_task, &j, threads, threads, threads, 0);
    return found_busy ? 2 : atomic_load(&j.timed_out);
}

int64_t keel_pool_time_dispatch(int64_t threads, int64_t repeats, int64_t *out)
{
    if (threads < 2) return -1;
    if (meet(threads) == 2) return -2;
    if (pool.workers < threads - 1) return -1;
    int64_t stalled = 0;
    for (int64_t i = 0; i < repeats; i++) {
        int64_t t0 = now_ns();
        int met = meet(threads);
        out[i] = now_ns() - t0;
        if (met == 2) return -2;
        stalled += met;
    }
    return stalled;
}

/* ---- a self-check (tests) -------------------------------------------------------------
 * keel_parallel over [0, n) in `parts` chunks of a task that records, per chunk, its
 * bounds and which thread ran it: out[3c] = lo, out[3c + 1] = hi, out[3c + 2] = 0 on
 * the calling thread, i + 1 on worker i. With wait_ms > 0 each chunk then waits
 * (up to wait_ms) until every chunk has started: on the pool, that needs `parts`
 * threads at once. Returns keel_parallel's result, or -2 if a chunk's wait timed out. */

typedef struct {
    int64_t *out;
    int64_t parts, n, wait_ms;
    pthread_t caller;
    _Atomic int64_t started;
    _Atomic int timed_out;
} check_job;

static void check_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    check_job *j = ctx;
    (void)scratch;
    for (int64_t c = 0; c < j->parts; c++) {
        int64_t clo, chi;
        chunk(j->n, j->parts, c, &clo, &chi);
        if (clo == lo && chi == hi) {
            j->out[3 * c] = lo;
            j->out[3 * c + 1] = hi;
            j->out[3 * c + 2] = pthread_equal(pthread_self(), j->caller) ? 0 : pool_id;
        }
    }
    atomic_fetch_add(&j->started, 1);
    int64_t until = now_ns() + j->wait_ms * 1000000;
    while (j->wait_ms > 0 && atomic_load(&j->started) < j->parts) {
        if (now_ns() > until) {
            atomic_store(&j->timed_out, 1);
            return;
        }
        sched_yield();
    }
}

int64_t keel_pool_check(int64_t n, int64_t parts, int64_t wait_ms, int64_t *out)
{
    check_job j = {out, parts > n ? n : (parts < 1 ? 1 : parts), n, wait_ms, pthread_self(), 0,
                   0};
    int64_t rc = keel_parallel(check_task, &j, n, parts, 0);
    return rc != 0 ? rc : atomic_load(&j.timed_out) ? -2 : 0;
}

/* keel_pool_check's record (no waiting) of keel_parallel_capped's run of `parts` chunks
 * on at most `threads` threads. */
int64_t keel_pool_check_capped(int64_t n, int64_t parts, int64_t threads, int64_t *out)
{
    check_job j = {out, parts > n ? n : (parts < 1 ? 1 : parts), n, 0, pthread_self(), 0, 0};
    return keel_parallel_capped(check_task, &j, n, parts, threads, 0);
}
