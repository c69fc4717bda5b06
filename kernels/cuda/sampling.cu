// Greedy sampling: argmax over each row of logits (ties to the lowest index, NaN never wins).

extern "C" __global__ void argmax_rows(const float* __restrict__ logits, unsigned int* __restrict__ out, int rows,
                                       int vocab) {
    __shared__ float best_v[32];
    __shared__ unsigned int best_i[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + (size_t)r * vocab;
    float bv = NEG_INF;
    unsigned int bi = 0xffffffffu;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float v = row[j];
        if (v > bv || (bi == 0xffffffffu && !(v != v))) {
            bv = v;
            bi = (unsigned int)j;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > bv || (ov == bv && oi < bi))) {
            bv = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        bv = lane < warps ? best_v[lane] : NEG_INF;
        bi = lane < warps ? best_i[lane] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) out[r] = bi == 0xffffffffu ? 0u : bi;
    }
}
