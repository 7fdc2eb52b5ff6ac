/* kvbridge.kernels._cpu_spans: the CPU span copy, one call for every block of a copy.
 *
 * Built by pip as an optional extension (setuptools ``optional=True``): where it does not
 * build (no C compiler), kvbridge.kernels uses torch's ops instead (cpu_spans.py).
 *
 * copy_spans(src_views, dst_views, npairs, src_ids, dst_ids, nblocks,
 *            src_block_bytes, dst_block_bytes, src_runs, dst_runs, nruns, run_bytes, threads)
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64

typedef struct {
    const int64_t *src_views, *dst_views, *src_ids, *dst_ids, *src_runs, *dst_runs;
    int64_t npairs, nruns, run_bytes, src_block_bytes, dst_block_bytes;
    int64_t first, last; /* [first, last) units, unit = block * npairs + pair */
} part_t;

static void *copy_part(void *arg)
{
    const part_t *w = (const part_t *)arg;
    for (int64_t u = w->first; u < w->last; u++) {
        int64_t i = u / w->npairs, p = u % w->npairs;
        const char *src = (const char *)(intptr_t)(w->src_views[p] + w->src_ids[i] * w->src_block_bytes);
        char *dst = (char *)(intptr_t)(w->dst_views[p] + w->dst_ids[i] * w->dst_block_bytes);
        for (int64_t r = 0; r < w->nruns; r++)
            memcpy(dst + w->dst_runs[r], src + w->src_runs[r], (size_t)w->run_bytes);
    }
    return NULL;
}

#define ARRAY(addr) ((const int64_t *)(intptr_t)(addr))

static PyObject *copy_spans(PyObject *self, PyObject *args)
{
    long long src_views, dst_views, npairs, src_ids, dst_ids, nblocks, src_bb, dst_bb;
    long long src_runs, dst_runs, nruns, run_bytes, threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLL", &src_views, &dst_views, &npairs, &src_ids,
                          &dst_ids, &nblocks, &src_bb, &dst_bb, &src_runs, &dst_runs, &nruns,
                          &run_bytes, &threads))
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
