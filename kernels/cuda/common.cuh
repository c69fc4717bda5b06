// Shared prelude of every kernel source: the Rust side prepends this file to each .cu before
// handing it to NVRTC (so the sources need no include path and no CUDA headers).
//
// bf16 is carried as `unsigned short` with explicit conversions: round-to-nearest-even from f32
// (the same rounding as the `half` crate on the host), NaN kept quiet.

typedef unsigned short bf16_t;
typedef unsigned long long u64_t;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024). Every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(t);
}

// Batched attention: narrows a thread block's view to its sequence (blockIdx.z), which owns rows
// seq_rows[z]..seq_rows[z + 1] of q, out and positions and the block table at
// block_table + seq_tables[z]. Returns false when the block's first query vector (of `per_block`
// from blockIdx.x) lies past the sequence's rows: that block has nothing to do.
__device__ __forceinline__ bool enter_sequence(const unsigned int* seq_rows, const unsigned int* seq_tables,
                                               const float* __restrict__& q, float* __restrict__& out,
                                               const unsigned int* __restrict__& positions,
                                               const unsigned int* __restrict__& block_table, int& rows, int heads,
                                               int kv_heads, int head_dim, int per_block) {
    const unsigned int row0 = seq_rows[blockIdx.z];
    rows = (int)(seq_rows[blockIdx.z + 1] - row0);
    q += (long long)row0 * heads * head_dim;
    out += (long long)row0 * heads * head_dim;
    positions += row0;
    block_table += seq_tables[blockIdx.z];
    return (long long)blockIdx.x * per_block < (long long)rows * (heads / kv_heads);
}
