/* A pool of worker threads that spin a short while for the next task before they sleep.
 *
 * Why not OpenMP: with OMP_WAIT_POLICY=PASSIVE (the setting the `flotilla` command and the benchmarks use, because
 * spinning threads on shared cores made whole steps several times slower) libgomp's worker sleeps as soon as a
 * parallel region ends, and waking it costs ~45 us a region on the project's VM; a tiny decode step runs ~20 such
 * regions, each a matmul of ~100-300 us. Here a worker spins for `spin_ns` after each task, so the next task of the
 * same step (tens of microseconds later) starts at once, and sleeps on a futex once the step is over: the spin is
 * bounded by the gaps inside a step, not by the time between steps.
 *
 * One task runs at a time, started by one thread (the engine's); the caller works on it too. Items are handed out
 * through an atomic counter, so a worker that is late (asleep, or its core busy) takes fewer of them, and the
 * caller does the rest. The caller still waits until every worker has checked in for the task (its fields are
 * then free to reuse): for one that had gone to sleep, until it wakes, as an OpenMP region would; once a step,
 * for its first task. A child process after fork() has no workers: the pool restarts there on first use. */
#ifndef FLOTILLA_SPIN_POOL_H
#define FLOTILLA_SPIN_POOL_H

#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SPIN_POOL_MAX_THREADS 64

typedef void (*spin_pool_item_fn)(void *context, int64_t item);

static struct {
    pthread_mutex_t start_lock, run_lock;
    int num_threads; /* workers + the caller; 1: no pool */
    pid_t owner;     /* the process whose workers these are */
    long spin_ns;
    _Atomic uint32_t generation; /* bumped for each task; the futex the workers sleep on */
    _Atomic int sleepers, pending, started;
    _Atomic int64_t next_item;
    int active; /* threads the running task may use: workers numbered from 1 at or above it take no item */
    spin_pool_item_fn fn;
    void *context;
    int64_t items;
} spin_pool = {.start_lock = PTHREAD_MUTEX_INITIALIZER, .run_lock = PTHREAD_MUTEX_INITIALIZER};

static long spin_pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void spin_pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void spin_pool_take_items(void) {
    int64_t item;
    while ((item = atomic_fetch_add(&spin_pool.next_item, 1)) < spin_pool.items) spin_pool.fn(spin_pool.context, item);
}

static void *spin_pool_worker(void *number) {
    const int index = (int)(intptr_t)number;
    uint32_t seen = atomic_load(&spin_pool.generation);
    atomic_fetch_add(&spin_pool.started, 1); /* from here on a task's bump of the generation is one it sees */
    for (;;) {
        long since = spin_pool_now_ns();
        uint32_t now;
        while ((now = atomic_load(&spin_pool.generation)) == seen) {
            if (spin_pool_now_ns() - since < spin_pool.spin_ns) {
                spin_pool_pause();
                continue;
            }
            /* Counted before the futex re-reads the generation: a task started in between either sees the
             * sleeper and wakes it, or changed the generation first, and the wait returns at once. */
            atomic_fetch_add(&spin_pool.sleepers, 1);
            syscall(SYS_futex, &spin_pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&spin_pool.sleepers, 1);
            since = spin_pool_now_ns();
        }
        seen = now;
        if (index < spin_pool.active) spin_pool_take_items();
        atomic_fetch_sub(&spin_pool.pending, 1);
    }
    return NULL;
}

/* Starts (or grows, or after a fork restarts) the pool to at least `num_threads` threads in all. Workers are
 * never stopped: a task that asks for fewer leaves the others out of it. Returns the pool's size: fewer than asked where threads
 * could not be created. */
static int spin_pool_ensure(int num_threads, long spin_ns) {
    if (num_threads > SPIN_POOL_MAX_THREADS) num_threads = SPIN_POOL_MAX_THREADS;
    if (num_threads < 1) num_threads = 1;
    pid_t pid = getpid();
    if (spin_pool.owner == pid && spin_pool.num_threads >= num_threads) return num_threads;
    pthread_mutex_lock(&spin_pool.start_lock);
    if (spin_pool.owner != pid) { /* first use, or a forked child: no workers of ours run here */
        spin_pool.num_threads = 1;
        spin_pool.owner = pid;
        atomic_store(&spin_pool.started, 0);
    }
    spin_pool.spin_ns = spin_ns;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (spin_pool.num_threads < num_threads) {
        pthread_t thread;
        if (pthread_create(&thread, &attr, spin_pool_worker, (void *)(intptr_t)spin_pool.num_threads) != 0) break;
        spin_pool.num_threads++;
    }
    pthread_attr_destroy(&attr);
    while (atomic_load(&spin_pool.started) < spin_pool.num_threads - 1) sched_yield();
    int size = spin_pool.num_threads < num_threads ? spin_pool.num_threads : num_threads;
    pthread_mutex_unlock(&spin_pool.start_lock);
    return size;
}

/* fn(context, i) for every i in [0, items), on up to `num_threads` threads (the caller one of them); returns when
 * all are done. A second caller while a task runs (two engines in one process, each on its own thread) runs its
 * items alone rather than wait. */
static void spin_pool_run(int num_threads, long spin_ns, spin_pool_item_fn fn, void *context, int64_t items) {
    /* The pool grows only under run_lock, so never while a task counts its workers. */
    int size = items > 1 && num_threads > 1 && pthread_mutex_trylock(&spin_pool.run_lock) == 0
                   ? spin_pool_ensure(num_threads, spin_ns)
                   : 0;
    if (size <= 1) {
        if (size == 1) pthread_mutex_unlock(&spin_pool.run_lock);
        for (int64_t i = 0; i < items; i++) fn(context, i);
        return;
    }
    spin_pool.fn = fn;
    spin_pool.context = context;
    spin_pool.items = items;
    spin_pool.active = size;
    atomic_store(&spin_pool.next_item, 0);
    /* Every worker counts itself done, including the ones this task leaves out. */
    atomic_store(&spin_pool.pending, spin_pool.num_threads - 1);
    atomic_fetch_add(&spin_pool.generation, 1);
    if (atomic_load(&spin_pool.sleepers) > 0)
        syscall(SYS_futex, &spin_pool.generation, FUTEX_WAKE_PRIVATE, SPIN_POOL_MAX_THREADS, NULL, NULL, 0);
    spin_pool_take_items();
    long since = spin_pool_now_ns();
    while (atomic_load(&spin_pool.pending) > 0) { /* a worker finishing its last item */
        if (spin_pool_now_ns() - since < spin_ns) spin_pool_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&spin_pool.run_lock);
}

#endif
