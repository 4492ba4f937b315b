/* Many jobs on keel's pool (threads.c, built with KEEL_POOL_PAUSE stalls), each chunk
 * checked: run exactly once, with its own bounds, before keel_parallel_capped returns.
 *
 *   pool_race JOBS MODE CALLER_US WORKER_US AFFINITY
 *
 * MODE 0: jobs of 2 and 8 chunks in turn; 1: random chunk counts up to 80 (past the
 * owned chunks) and random caps, the pool stopped and the process forked now and then.
 * CALLER_US stalls the caller between a job's shape and its ticket; WORKER_US stalls a
 * worker between the ticket it read and the shape. Prints the counts; exit 1 on any. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef void (*keel_task)(void *ctx, float *scratch, int64_t lo, int64_t hi);
int64_t keel_parallel_capped(keel_task, void *, int64_t, int64_t, int64_t, int64_t);
void keel_pool_stop(void);
void keel_pool_set_spin_us(int64_t);
void keel_pool_set_affinity(int64_t);

static int caller_us, worker_us;

void keel_test_pause(int where, int64_t id)
{
    if (where == 0 && caller_us) usleep(caller_us);
    if (where == 1 && id != 0 && worker_us) usleep(worker_us);
}

#define RING 64
#define MAXP 80
typedef struct {
    int64_t n, parts;
    _Atomic int count[MAXP];
    _Atomic int returned;
} job_check;
static job_check ring[RING];
static _Atomic long late, bad;

static void task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    job_check *j = ctx;
    (void)scratch;
    if (atomic_load(&j->returned)) atomic_fetch_add(&late, 1);
    int64_t base = j->n / j->parts, extra = j->n % j->parts;
    for (int64_t c = 0; c < j->parts; c++) {
        int64_t l = c * base + (c < extra ? c : extra), h = l + base + (c < extra);
        if (l == lo && h == hi) {
            atomic_fetch_add(&j->count[c], 1);
            return;
        }
    }
    atomic_fetch_add(&bad, 1);
}

static int forked_child(void)
{
    for (int q = 0; q < 200; q++) {
        job_check j;
        memset(&j, 0, sizeof j);
        j.parts = 6;
        j.n = 18;
        keel_parallel_capped(task, &j, 18, 6, 0, 0);
        for (int c = 0; c < 6; c++)
            if (atomic_load(&j.count[c]) != 1) return 3;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 6) return 2;
    long jobs = atol(argv[1]);
    int mode = atoi(argv[2]);
    caller_us = atoi(argv[3]);
    worker_us = atoi(argv[4]);
    keel_pool_set_affinity(atoi(argv[5]));
    keel_pool_set_spin_us(2000);
    srand(1);
    long missing = 0, twice = 0;
    for (long k = 0; k < jobs; k++) {
        job_check *j = &ring[k % RING];
        for (int c = 0; c < j->parts; c++)
            if (atomic_load(&j->count[c]) > 1) twice++;
        memset(j, 0, sizeof *j);
        int64_t parts = k % 2 ? 8 : 2, threads = 0;
        if (mode == 1) {
            parts = 1 + rand() % MAXP;
            threads = rand() % 4 ? 0 : 1 + rand() % 8;
        }
        j->n = parts * 3 + rand() % 5;
        j->parts = parts;
        keel_parallel_capped(task, j, j->n, parts, threads, 0);
        for (int c = 0; c < parts; c++) {
            int x = atomic_load(&j->count[c]);
            missing += x == 0;
            twice += x > 1;
        }
        atomic_store(&j->returned, 1);
        if (mode == 1 && rand() % 2000 == 0) keel_pool_stop();
        if (mode == 1 && rand() % 3000 == 0) {
            pid_t p = fork();
            if (p == 0) _exit(forked_child());
            int st;
            waitpid(p, &st, 0);
            if (!WIFEXITED(st) || WEXITSTATUS(st)) {
                printf("forked child failed (%d)\n", st);
                return 1;
            }
        }
    }
    usleep(100000); /* a chunk run late, after its job returned, shows up meanwhile */
    for (int r = 0; r < RING; r++)
        for (int c = 0; c < ring[r].parts; c++)
            if (atomic_load(&ring[r].count[c]) > 1) twice++;
    printf("jobs=%ld missing=%ld twice=%ld late=%ld bad=%ld\n", jobs, missing, twice, (long)late,
           (long)bad);
    return missing || twice || late || bad ? 1 : 0;
}
