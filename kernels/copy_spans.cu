// kvbridge block-copy kernel: copy a list of byte spans in one launch.
//
// spans is an int64 array of n_spans rows (src_addr, dst_addr, length), absolute device
// addresses, built by kvbridge/kernels/cuda_path.py. Spans never overlap each other's
// destination, and a source never overlaps a destination (the caller falls back to a
// temporary when they could). One thread block copies one span at a time (grid-stride over
// spans); inside a span the threads use the widest loads the alignment of the two
// addresses allows: 16 bytes (uint4), then 8, 4, and single bytes for what is left.
// Loads go through the read-only data cache (__ldg): a source is never written by the call.

extern "C" __global__ void kvb_copy_spans(const long long* __restrict__ spans,
                                          long long n_spans) {
    for (long long s = blockIdx.x; s < n_spans; s += gridDim.x) {
        const unsigned char* src = reinterpret_cast<const unsigned char*>(spans[3 * s]);
        unsigned char* dst = reinterpret_cast<unsigned char*>(spans[3 * s + 1]);
        const long long len = spans[3 * s + 2];
        const unsigned long long align =
            reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst);
        long long done = 0;
        if ((align & 15ULL) == 0) {
            const long long n = len >> 4;
            const uint4* s4 = reinterpret_cast<const uint4*>(src);
            uint4* d4 = reinterpret_cast<uint4*>(dst);
            for (long long i = threadIdx.x; i < n; i += blockDim.x) d4[i] = __ldg(s4 + i);
            done = n << 4;
        } else if ((align & 7ULL) == 0) {
            const long long n = len >> 3;
            const unsigned long long* s8 = reinterpret_cast<const unsigned long long*>(src);
            unsigned long long* d8 = reinterpret_cast<unsigned long long*>(dst);
            for (long long i = threadIdx.x; i < n; i += blockDim.x) d8[i] = __ldg(s8 + i);
            done = n << 3;
        } else if ((align & 3ULL) == 0) {
            const long long n = len >> 2;
            const unsigned int* s4 = reinterpret_cast<const unsigned int*>(src);
            unsigned int* d4 = reinterpret_cast<unsigned int*>(dst);
            for (long long i = threadIdx.x; i < n; i += blockDim.x) d4[i] = __ldg(s4 + i);
            done = n << 2;
        }
        for (long long i = done + threadIdx.x; i < len; i += blockDim.x) dst[i] = __ldg(src + i);
    }
}
