/* kvbridge.kernels._cpu_spans: the CPU span copy, one call for every block of a copy.
 *
 * Built by pip as an optional extension (setuptools ``optional=True``): where it does not
 * build (no C compiler), kvbridge.kernels uses torch's ops instead (cpu_spans.py).
 *
 * copy_spans(src_views, dst_views, npairs, src_ids, dst_ids, nblocks,
 *            src_block_bytes, dst_block_bytes, src_runs, dst_runs, nruns, run_bytes, threads,
 *            stream[, chunk_bytes])
 *
 * Every argument is an integer; the array arguments are addresses of int64 arrays that the
 * caller keeps alive for the call:
 *   src_views[p], dst_views[p]  (npairs)  first byte of view pair p on each side;
 *   src_ids[i], dst_ids[i]      (nblocks) block i of the call on each side;
 *   src_runs[r], dst_runs[r]    (nruns)   byte offset of run r inside one block of a view.
 * For every block i, view pair p and run r it copies run_bytes bytes from
 *   src_views[p] + src_ids[i] * src_block_bytes + src_runs[r]
 * to the same expression on the destination side. The caller has checked every id and
 * built the offsets from the views' own strides; this file trusts them. The GIL is released
 * while bytes move.
 *
 * Threads: the (block, pair) units are handed out in chunks of at least chunk_bytes (default
 * CHUNK_BYTES) from one atomic counter to ``threads`` threads (the calling one included,
 * which starts at once): a helper that starts late, or shares its core with another
 * process, takes fewer chunks instead of holding up the call with a fixed half.
 * The helpers are the calling thread's OpenMP team, in the libgomp torch has loaded (found
 * with dlopen(RTLD_NOLOAD): this module never loads one), entered by GOMP_parallel, the call
 * `#pragma omp parallel` compiles to. Those are the threads torch's own CPU ops use: made
 * once, kept, and after each parallel region spinning for several milliseconds before they
 * sleep (GOMP_SPINCOUNT). Helpers of our own would share a core with that spinning worker
 * for most of a copy that follows a torch op (half speed for the helper); the worker takes
 * the call's work at once instead. A team belongs to the thread that made it and does not
 * survive fork(): in the child, the thread that forked may hold its parent's team, whose
 * threads are gone (its first parallel region would wait for them forever; torch's own ops
 * hang there), so that thread, and a process without libgomp (torch built with another
 * OpenMP, or none), start ``threads - 1`` pthreads per call instead; threads made in the
 * child get teams of their own. The GIL is released throughout.
 *
 * Stores: with ``stream`` nonzero (the caller sets it for copies much bigger than a cache,
 * runs of at least 64 bytes) the destination is written with non-temporal stores on x86-64,
 * 32 bytes at a time (AVX2, chosen at run time) or 16 (SSE2, part of x86-64 itself): a plain
 * store first reads the destination line into the cache (a third memory pass), and runs
 * scattered across a block (an order conversion writes 256-byte runs 4 KiB apart) also meet
 * cache-set conflicts. Elsewhere (another CPU, or ``stream`` zero) memcpy.
 *
 * Prefetch: the source is read as one stream, run after run, and where it jumps (to the next
 * unit, or between runs of 2 KiB or more, e.g. the 32-64 KiB runs of the separate per-layer
 * tensors of a layer-separate cache) the hardware prefetcher needs several misses to pick
 * it up again. The copy touches the source PREFETCH_BYTES ahead of such a jump: inside the
 * streamed copy loop of a long run (the next run's first lines while this one ends), before
 * a long memcpy (the next run's start), and for short runs the next unit's start a few runs
 * before the unit ends.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h> /* SSE2 is part of x86-64; AVX2 only in functions built for it */
#define HAVE_STREAM 1
#endif
#if defined(HAVE_STREAM) && defined(__GNUC__)
#define HAVE_AVX2 1
#endif

#define MAX_THREADS 64
#define PREFETCH_BYTES 2048
/* units are claimed in chunks of at least this many bytes (a few claims per thread) */
#define CHUNK_BYTES (1 << 20)

typedef struct {
    const int64_t *src_views, *dst_views, *src_ids, *dst_ids, *src_runs, *dst_runs;
    int64_t npairs, nruns, run_bytes, src_block_bytes, dst_block_bytes;
    int64_t units, chunk; /* unit = block * npairs + pair; chunk: units per claim */
    int64_t next;         /* first unclaimed unit, claimed atomically */
    int stream;
} job_t;

static int have_avx2;

static const char *unit_src(const job_t *j, int64_t u)
{
    int64_t i = u / j->npairs, p = u % j->npairs;
    return (const char *)(intptr_t)(j->src_views[p] + j->src_ids[i] * j->src_block_bytes);
}

static char *unit_dst(const job_t *j, int64_t u)
{
    int64_t i = u / j->npairs, p = u % j->npairs;
    return (char *)(intptr_t)(j->dst_views[p] + j->dst_ids[i] * j->dst_block_bytes);
}

static void prefetch_lines(const char *p, size_t n)
{
    for (size_t o = 0; o < n; o += 64)
        __builtin_prefetch(p + o, 0, 3);
}

/* The stores of one run: n bytes from s to d. ``next`` (or NULL) is where the source stream
 * goes on after s's last byte (the next run); the streamed copies touch the source
 * PREFETCH_BYTES ahead of their reads, into ``next`` near the run's end. Inlined into the
 * loop over runs (copy_units_*), which is built once per kind of store. */
#define INLINE static inline __attribute__((always_inline))

INLINE void copy_plain(char *d, const char *s, size_t n, const char *next)
{
    if (next != NULL) /* memcpy gives no place to prefetch inside: the next run's start */
        prefetch_lines(next, PREFETCH_BYTES);
    memcpy(d, s, n);
}

#define PREFETCH_AHEAD(s, o, n, next)                                                        \
    do {                                                                                     \
        size_t at_ = (o) + PREFETCH_BYTES;                                                   \
        if (at_ < (n))                                                                       \
            __builtin_prefetch((s) + at_, 0, 3);                                             \
        else if ((next) != NULL)                                                             \
            __builtin_prefetch((next) + (at_ - (n)), 0, 3);                                  \
    } while (0)

#ifdef HAVE_STREAM
/* The streamed copy of one run with W-byte vectors (VEC, LOAD, STORE): non-temporal stores
 * from d's first W-byte boundary on, 64 bytes (a line) per step, the source touched ahead;
 * the unaligned head and the tail under W bytes with memcpy (skipped when empty). The usual
 * short run (e.g. a 256-byte head: whole lines, aligned, nothing ahead) takes the first loop
 * alone. One form for every width: the inner loop of 64 / W vectors is unrolled whole. */
#define COPY_STREAMED(NAME, ATTR, VEC, LOAD, STORE, W)                                      \
    ATTR INLINE void NAME(char *d, const char *s, size_t n, const char *next)               \
    {                                                                                        \
        if (next == NULL && (n & 63) == 0 && ((uintptr_t)d & (W - 1)) == 0) {                \
            for (size_t o = 0; o < n; o += 64)                                               \
                for (size_t k = 0; k < 64; k += W)                                           \
                    STORE((VEC *)(d + o + k), LOAD((const VEC *)(s + o + k)));               \
            return;                                                                          \
        }                                                                                    \
        size_t head = (size_t)(-(uintptr_t)d & (W - 1)), o;                                  \
        if (head > n)                                                                        \
            head = n;                                                                        \
        if (head)                                                                            \
            memcpy(d, s, head);                                                              \
        for (o = head; o + 64 <= n; o += 64) {                                               \
            PREFETCH_AHEAD(s, o, n, next);                                                   \
            for (size_t k = 0; k < 64; k += W)                                               \
                STORE((VEC *)(d + o + k), LOAD((const VEC *)(s + o + k)));                   \
        }                                                                                    \
        for (; o + W <= n; o += W)                                                           \
            STORE((VEC *)(d + o), LOAD((const VEC *)(s + o)));                               \
        if (o < n)                                                                           \
            memcpy(d + o, s + o, n - o);                                                     \
    }

/* SSE2 (part of x86-64 itself): 16-byte stores */
COPY_STREAMED(copy_sse2, , __m128i, _mm_loadu_si128, _mm_stream_si128, 16)
#ifdef HAVE_AVX2
/* AVX2 (chosen at run time): 32-byte stores */
COPY_STREAMED(copy_avx2, __attribute__((target("avx2"))), __m256i, _mm256_loadu_si256,
              _mm256_stream_si256, 32)
#endif
#endif

/* Copy units [first, last), every run of each, with COPY_RUN's stores. The source is read as
 * one stream, touched PREFETCH_BYTES ahead where it jumps: runs at least that long pass the
 * next run to COPY_RUN (whose loop reads into it near its end); shorter runs of one unit
 * follow each other in the source (sorted by source offset), where the hardware prefetcher
 * keeps up, and only the next unit's start is touched, that many bytes before its turn. */
#define COPY_UNITS(COPY_RUN)                                                                 \
    {                                                                                        \
        const size_t len = (size_t)j->run_bytes;                                             \
        const int64_t nruns = j->nruns;                                                      \
        const int64_t *const src_runs = j->src_runs, *const dst_runs = j->dst_runs;          \
        const int long_runs = len >= PREFETCH_BYTES;                                         \
        /* short runs: the run of each unit at which the next unit's start is touched */     \
        int64_t touch_at = long_runs ? nruns : nruns - PREFETCH_BYTES / (int64_t)len;        \
        if (touch_at < 0)                                                                    \
            touch_at = 0;                                                                    \
        const char *nsrc = unit_src(j, first);                                               \
        prefetch_lines(nsrc + src_runs[0], PREFETCH_BYTES);                                  \
        for (int64_t u = first; u < last; u++) {                                             \
            const char *const src = nsrc;                                                    \
            char *const dst = unit_dst(j, u);                                                \
            nsrc = u + 1 < last ? unit_src(j, u + 1) : NULL;                                 \
            const char *nstart = nsrc != NULL ? nsrc + src_runs[0] : NULL;                   \
            for (int64_t r = 0; r < nruns; r++) {                                            \
                const char *next = NULL;                                                     \
                if (long_runs)                                                               \
                    next = r + 1 < nruns ? src + src_runs[r + 1] : nstart;                   \
                else if (r == touch_at && nstart != NULL)                                    \
                    prefetch_lines(nstart, PREFETCH_BYTES);                                  \
                COPY_RUN(dst + dst_runs[r], src + src_runs[r], len, next);                   \
            }                                                                                \
        }                                                                                    \
    }

static void copy_units_plain(const job_t *j, int64_t first, int64_t last) COPY_UNITS(copy_plain)
#ifdef HAVE_STREAM
static void copy_units_sse2(const job_t *j, int64_t first, int64_t last) COPY_UNITS(copy_sse2)
#ifdef HAVE_AVX2
__attribute__((target("avx2"))) static void copy_units_avx2(const job_t *j, int64_t first,
                                                            int64_t last) COPY_UNITS(copy_avx2)
#endif
#endif

static void copy_units(const job_t *j, int64_t first, int64_t last)
{
#ifdef HAVE_STREAM
    if (j->stream) {
#ifdef HAVE_AVX2
        if (have_avx2) {
            copy_units_avx2(j, first, last);
            return;
        }
#endif
        copy_units_sse2(j, first, last);
        return;
    }
#endif
    copy_units_plain(j, first, last);
}

static void work(void *arg)
{
    job_t *j = (job_t *)arg;
    for (;;) {
        int64_t first = __atomic_fetch_add(&j->next, j->chunk, __ATOMIC_RELAXED);
        if (first >= j->units)
            break;
        copy_units(j, first, first + j->chunk < j->units ? first + j->chunk : j->units);
    }
#ifdef HAVE_STREAM
    if (j->stream)
        _mm_sfence(); /* streamed stores are weakly ordered: done before the join sees them */
#endif
}

static void *pthread_work(void *arg)
{
    work(arg);
    return NULL;
}

/* GOMP_parallel(fn, data, num_threads, flags): fn(data) on a team of num_threads, the caller
 * being thread 0; returns when every member has returned (libgomp's ABI since GCC 4.9) */
typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_t gomp_parallel; /* NULL: no libgomp loaded */
static int forked;                    /* this process is a child of fork() ... */
static pthread_t fork_thread;         /* ... made by this thread, the child's first one */

static void after_fork_in_child(void)
{
    forked = 1;
    fork_thread = pthread_self();
}

/* GOMP_parallel if the calling thread may enter its team, else NULL */
static gomp_parallel_t team_of_caller(void)
{
    if (forked && pthread_equal(pthread_self(), fork_thread))
        return NULL; /* it may hold the parent's team, whose threads are gone */
    return gomp_parallel;
}

/* Copy the job on `threads` threads (the caller included); the GIL is released. */
static void run_job(job_t *job, long long threads)
{
    if (threads <= 1) {
        work(job);
        return;
    }
    gomp_parallel_t team = team_of_caller();
    if (team != NULL) {
        team(work, job, (unsigned)threads, 0);
        return;
    }
    pthread_t helpers[MAX_THREADS];
    int started[MAX_THREADS];
    for (long long t = 1; t < threads; t++) /* one that fails to start leaves more to claim */
        started[t] = pthread_create(&helpers[t], NULL, pthread_work, job) == 0;
    work(job);
    for (long long t = 1; t < threads; t++)
        if (started[t])
            pthread_join(helpers[t], NULL);
}

static PyObject *copy_spans(PyObject *self, PyObject *args)
{
    long long src_views, dst_views, npairs, src_ids, dst_ids, nblocks, src_bb, dst_bb;
    long long src_runs, dst_runs, nruns, run_bytes, threads, chunk_bytes = CHUNK_BYTES;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLp|L", &src_views, &dst_views, &npairs, &src_ids,
                          &dst_ids, &nblocks, &src_bb, &dst_bb, &src_runs, &dst_runs, &nruns,
                          &run_bytes, &threads, &stream, &chunk_bytes))
        return NULL;
    if (npairs < 0 || nblocks < 0 || nruns < 0 || run_bytes < 0 || chunk_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_spans: negative count or length");
        return NULL;
    }
    int64_t units = (int64_t)npairs * (int64_t)nblocks;
    if (units == 0 || nruns == 0 || run_bytes == 0)
        Py_RETURN_NONE;
    int64_t unit_bytes = (int64_t)nruns * (int64_t)run_bytes;
    job_t job = {
        .src_views = (const int64_t *)(intptr_t)src_views,
        .dst_views = (const int64_t *)(intptr_t)dst_views,
        .src_ids = (const int64_t *)(intptr_t)src_ids,
        .dst_ids = (const int64_t *)(intptr_t)dst_ids,
        .src_runs = (const int64_t *)(intptr_t)src_runs,
        .dst_runs = (const int64_t *)(intptr_t)dst_runs,
        .npairs = npairs,
        .nruns = nruns,
        .run_bytes = run_bytes,
        .src_block_bytes = src_bb,
        .dst_block_bytes = dst_bb,
        .units = units,
        .chunk = unit_bytes >= chunk_bytes ? 1 : (chunk_bytes + unit_bytes - 1) / unit_bytes,
        .next = 0,
        .stream = stream,
    };
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    int64_t chunks = (units + job.chunk - 1) / job.chunk;
    if (threads > chunks)
        threads = chunks;
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *helper_threads(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    return PyUnicode_FromString(team_of_caller() != NULL ? "openmp" : "pthreads");
}

static PyMethodDef methods[] = {
    {"copy_spans", copy_spans, METH_VARARGS,
     "Copy run_bytes-byte runs of every (block, view pair); see cpu_spans.c."},
    {"helper_threads", helper_threads, METH_NOARGS,
     "For the calling thread: 'openmp' (its libgomp team) or 'pthreads' (made per call)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_spans", "kvbridge's CPU span copy (see cpu_spans.c)", -1,
    methods,
};

PyMODINIT_FUNC PyInit__cpu_spans(void)
{
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    /* only a libgomp already loaded (torch's); the handle is kept, so it stays loaded */
    void *gomp = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (gomp != NULL)
        gomp_parallel = (gomp_parallel_t)dlsym(gomp, "GOMP_parallel");
    if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0)
        gomp_parallel = NULL; /* no way to tell a child's first thread: no teams at all */
    return PyModule_Create(&module);
}
