/* kvbridge.kernels._cpu_spans: the CPU span copy, one call for every block of a copy.
 *
 * Built by pip as an optional extension (setuptools ``optional=True``): where it does not
 * build (no C compiler), kvbridge.kernels uses torch's ops instead (cpu_spans.py).
 *
 * copy_spans(src_views, dst_views, npairs, src_ids, dst_ids, nblocks,
 *            src_block_bytes, dst_block_bytes, src_runs, dst_runs, nruns, run_bytes, threads,
 *            stream)
 *
 * Every argument is an integer; the array arguments are addresses of int64 arrays that the
 * caller keeps alive for the call:
 *   src_views[p], dst_views[p]  (npairs)  first byte of view pair p on each side;
 *   src_ids[i], dst_ids[i]      (nblocks) block i of the call on each side;
 *   src_runs[r], dst_runs[r]    (nruns)   byte offset of run r inside one block of a view.
 * For every block i, view pair p and run r it copies run_bytes bytes from
 *   src_views[p] + src_ids[i] * src_block_bytes + src_runs[r]
 * to the same expression on the destination side. The caller has checked every id and
 * built the offsets from the views' own strides; this file trusts them. The (block, pair)
 * units are split between ``threads`` threads (the calling one included); the GIL is
 * released while bytes move.
 *
 * With ``stream`` nonzero (the caller sets it for copies much bigger than a cache whose runs
 * are 64 B to 4 KiB) the destination is written with non-temporal stores on x86-64: a plain
 * store first reads the destination line into the cache (a third memory pass), and short
 * runs scattered across a block (an order conversion writes 256-byte runs 4 KiB apart) also
 * meet cache-set conflicts. Streamed, such runs copy at least as fast as one long memcpy.
 * Elsewhere (another CPU, or ``stream`` zero) memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h> /* SSE2: part of x86-64 itself, no compiler flag needed */
#define HAVE_STREAM 1
#endif

#define MAX_THREADS 64

typedef struct {
    const int64_t *src_views, *dst_views, *src_ids, *dst_ids, *src_runs, *dst_runs;
    int64_t npairs, nruns, run_bytes, src_block_bytes, dst_block_bytes;
    int64_t first, last; /* [first, last) units, unit = block * npairs + pair */
    int stream;
} part_t;

#ifdef HAVE_STREAM
/* memcpy with non-temporal 16-byte stores for the 16-byte-aligned part of dst */
static void copy_streamed(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (head > n)
        head = n;
    if (head) {
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
    }
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    for (; n >= 16; n -= 16, src += 16, dst += 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    if (n)
        memcpy(dst, src, n);
}
#endif

/* Touch the first PREFETCH_BYTES of a source piece ahead of its copy. Each run of a block
 * (or the first one of the next block) starts somewhere else in memory, where the hardware
 * prefetcher needs several misses to pick the stream up; reading 32-64 KiB runs from the
 * separate tensors of a layer-separate cache is slower than one long read. */
#define PREFETCH_BYTES 2048

static void prefetch(const char *p)
{
    for (int o = 0; o < PREFETCH_BYTES; o += 64)
        __builtin_prefetch(p + o, 0, 3);
}

static void *copy_part(void *arg)
{
    const part_t *w = (const part_t *)arg;
    size_t len = (size_t)w->run_bytes;
    /* runs shorter than the prefetch follow each other in the source (sorted by source
     * offset): only the next block's first run is a new place, touched this many runs ahead */
    int64_t ahead = len >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / (int64_t)len;
    int64_t next_at = w->nruns > ahead ? w->nruns - ahead : 0;
    for (int64_t u = w->first; u < w->last; u++) {
        int64_t i = u / w->npairs, p = u % w->npairs;
        const char *src = (const char *)(intptr_t)(w->src_views[p] + w->src_ids[i] * w->src_block_bytes);
        char *dst = (char *)(intptr_t)(w->dst_views[p] + w->dst_ids[i] * w->dst_block_bytes);
        const char *next = NULL; /* the next unit's first source run */
        if (u + 1 < w->last) {
            int64_t ni = (u + 1) / w->npairs, np = (u + 1) % w->npairs;
            next = (const char *)(intptr_t)(w->src_views[np] + w->src_ids[ni] * w->src_block_bytes +
                                            w->src_runs[0]);
        }
        for (int64_t r = 0; r < w->nruns; r++) {
            if (len >= PREFETCH_BYTES && r + 1 < w->nruns)
                prefetch(src + w->src_runs[r + 1]);
            else if (r == next_at && next != NULL)
                prefetch(next);
#ifdef HAVE_STREAM
            if (w->stream) {
                copy_streamed(dst + w->dst_runs[r], src + w->src_runs[r], len);
                continue;
            }
#endif
            memcpy(dst + w->dst_runs[r], src + w->src_runs[r], len);
        }
    }
#ifdef HAVE_STREAM
    if (w->stream)
        _mm_sfence(); /* streamed stores are weakly ordered: done before the join sees them */
#endif
    return NULL;
}

#define ARRAY(addr) ((const int64_t *)(intptr_t)(addr))

static PyObject *copy_spans(PyObject *self, PyObject *args)
{
    long long src_views, dst_views, npairs, src_ids, dst_ids, nblocks, src_bb, dst_bb;
    long long src_runs, dst_runs, nruns, run_bytes, threads;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLp", &src_views, &dst_views, &npairs, &src_ids,
                          &dst_ids, &nblocks, &src_bb, &dst_bb, &src_runs, &dst_runs, &nruns,
                          &run_bytes, &threads, &stream))
        return NULL;
    if (npairs < 0 || nblocks < 0 || nruns < 0 || run_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_spans: negative count or length");
        return NULL;
    }
    int64_t units = (int64_t)npairs * (int64_t)nblocks;
    if (units == 0 || nruns == 0 || run_bytes == 0)
        Py_RETURN_NONE;
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > units)
        threads = units;
    part_t parts[MAX_THREADS];
    pthread_t helpers[MAX_THREADS];
    int started[MAX_THREADS];
    int64_t step = (units + threads - 1) / threads;
    for (long long t = 0; t < threads; t++) {
        part_t *w = &parts[t];
        w->src_views = ARRAY(src_views);
        w->dst_views = ARRAY(dst_views);
        w->src_ids = ARRAY(src_ids);
        w->dst_ids = ARRAY(dst_ids);
        w->src_runs = ARRAY(src_runs);
        w->dst_runs = ARRAY(dst_runs);
        w->npairs = npairs;
        w->nruns = nruns;
        w->run_bytes = run_bytes;
        w->src_block_bytes = src_bb;
        w->dst_block_bytes = dst_bb;
        w->first = t * step < units ? t * step : units;
        w->last = (t + 1) * step < units ? (t + 1) * step : units;
        w->stream = stream;
        started[t] = 0;
    }
    Py_BEGIN_ALLOW_THREADS
    for (long long t = 1; t < threads; t++)
        started[t] = pthread_create(&helpers[t], NULL, copy_part, &parts[t]) == 0;
    copy_part(&parts[0]);
    for (long long t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(helpers[t], NULL);
        else /* no thread to be had: this thread does that part too */
            copy_part(&parts[t]);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_spans", copy_spans, METH_VARARGS,
     "Copy run_bytes-byte runs of every (block, view pair); see cpu_spans.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_spans", "kvbridge's CPU span copy (see cpu_spans.c)", -1,
    methods,
};

PyMODINIT_FUNC PyInit__cpu_spans(void) { return PyModule_Create(&module); }
