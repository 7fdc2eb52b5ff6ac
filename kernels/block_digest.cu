// kvbridge device block digest (algorithm "kvb-mlh32x4"), see kvbridge/kernels/digest_cuda.py
// for the definition and its CPU reference, which this kernel must match bit for bit.
//
// pieces is an int64 array of n_pieces rows (addr, nbytes, out_index, chunk_seq): nbytes is a
// whole number of chunks (chunk_words 32-bit words each), addr is 4-byte aligned, chunk_seq is
// the index of the piece's first chunk in its block's byte stream. One thread block takes one
// piece at a time (grid-stride); each warp takes one chunk at a time: its 32 threads load the
// chunk's words coalesced, multiply each by that lane's level-1 coefficient (table, one row of
// 256 per lane) and the warp sums the products mod 2^64. Lane 0 keeps the high 32 bits as the
// chunk's value and adds value * C(lane, chunk_seq) to the piece's running sums; the block
// adds its sums to out[out_index][0..3] with one 64-bit atomic each (addition mod 2^64 is
// exact, so the result does not depend on the order pieces and chunks are summed in).

#define KVB_LANES 4
#define KVB_TABLE 256

__device__ __forceinline__ unsigned long long kvb_splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void kvb_block_digest(const long long* __restrict__ pieces,
                                            long long n_pieces,
                                            const unsigned long long* __restrict__ table,
                                            unsigned long long l2_base0,
                                            unsigned long long l2_base1,
                                            unsigned long long l2_base2,
                                            unsigned long long l2_base3,
                                            int chunk_words,
                                            unsigned long long* __restrict__ out) {
    __shared__ unsigned long long coef[KVB_LANES * KVB_TABLE];
    __shared__ unsigned long long partial[32][KVB_LANES];
    for (int i = threadIdx.x; i < KVB_LANES * KVB_TABLE; i += blockDim.x) coef[i] = table[i];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const unsigned long long base[KVB_LANES] = {l2_base0, l2_base1, l2_base2, l2_base3};
    for (long long p = blockIdx.x; p < n_pieces; p += gridDim.x) {
        const unsigned int* words = reinterpret_cast<const unsigned int*>(pieces[4 * p]);
        const long long nchunks = pieces[4 * p + 1] / (4LL * chunk_words);
        const long long out_index = pieces[4 * p + 2];
        const long long seq0 = pieces[4 * p + 3];
        unsigned long long tot[KVB_LANES] = {0ULL, 0ULL, 0ULL, 0ULL};
        for (long long c = warp; c < nchunks; c += warps) {
            const unsigned int* w = words + c * chunk_words;
            unsigned long long s[KVB_LANES] = {0ULL, 0ULL, 0ULL, 0ULL};
            if (chunk_words == KVB_TABLE) {
                // the common case (spans of a multiple of 1 KiB): all 8 loads in flight at once
                unsigned int m8[KVB_TABLE / 32];
#pragma unroll
                for (int k = 0; k < KVB_TABLE / 32; ++k) m8[k] = __ldg(w + lane + 32 * k);
#pragma unroll
                for (int k = 0; k < KVB_TABLE / 32; ++k) {
#pragma unroll
                    for (int l = 0; l < KVB_LANES; ++l)
                        s[l] += coef[l * KVB_TABLE + lane + 32 * k] *
                                static_cast<unsigned long long>(m8[k]);
                }
            } else {
                for (int i = lane; i < chunk_words; i += 32) {
                    const unsigned long long m = __ldg(w + i);
#pragma unroll
                    for (int l = 0; l < KVB_LANES; ++l) s[l] += coef[l * KVB_TABLE + i] * m;
                }
            }
#pragma unroll
            for (int l = 0; l < KVB_LANES; ++l) {
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) s[l] += __shfl_xor_sync(0xffffffffu, s[l], off);
            }
            if (lane == 0) {
                const unsigned long long seq = static_cast<unsigned long long>(seq0 + c);
#pragma unroll
                for (int l = 0; l < KVB_LANES; ++l) {
                    const unsigned long long k2 = kvb_splitmix64(base[l] + seq * 0x9E3779B97F4A7C15ULL);
                    tot[l] += k2 * (s[l] >> 32);
                }
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int l = 0; l < KVB_LANES; ++l) partial[warp][l] = tot[l];
        }
        __syncthreads();
        if (threadIdx.x < KVB_LANES) {
            unsigned long long sum = 0ULL;
            for (int i = 0; i < warps; ++i) sum += partial[i][threadIdx.x];
            atomicAdd(out + KVB_LANES * out_index + threadIdx.x, sum);
        }
        __syncthreads();
    }
}
