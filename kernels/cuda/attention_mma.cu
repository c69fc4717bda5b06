// Causal grouped-query attention on the tensor cores (sm_80 and later): the contract of
// attention_paged (attention.cu) with Q and the softmax weights P rounded to bf16 for the
// matrix products (mma.sync m16n8k16, f32 accumulation), as FlashAttention-2 does. One entry point
// per head_dim (64, 128); the host picks this kernel for those and attention_paged otherwise.
//
// Work split: a thread block owns MMA_QV query vectors of one KV head (vector index
// qi = r * group + g, as in attention_paged), one warp per 16 of them. Keys and values go through
// shared memory in tiles of MMA_KEYS, row-major [key][dim] with rows padded to STRIDE elements
// (16-byte aligned rows; the fragment reads below fall in distinct banks), two tiles in flight:
// the next tile's cp.async copies run while the warps compute on this one. Dynamic shared memory
// of mma_smem_bytes(D) (69,632 bytes at D = 128, so the host opts in above 48 KiB). Per tile,
// each warp:
// 1. S = Q Kᵀ (16 × 64) with Q's fragments held in registers for the whole kernel;
// 2. masks keys past each row's position, updates the row's running max and sum (online
//    softmax, in log2 units: Q is pre-scaled by scale · log2 e) and rescales its output;
// 3. O += P V, with S's accumulators reused as P's A fragments (the m16n8k16 accumulator and A
//    layouts line up) and V's B fragments read transposed by ldmatrix.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, bf16): lane = 4 g + t.
//   A (16 × 16, row-major): reg 0 = (row g, cols 2t, 2t+1), reg 1 = (row g+8, same cols),
//                            reg 2 = (row g, cols 2t+8, 2t+9), reg 3 = (row g+8, cols 2t+8, 2t+9).
//   B (16 × 8):             reg 0 = (rows 2t, 2t+1; col g), reg 1 = (rows 2t+8, 2t+9; col g).
//   C (16 × 8, f32):        c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols).
// Each 32-bit register holds its lower-indexed element in the low half.
//
// Determinism: tiles start at multiples of MMA_KEYS from position 0, and a tile past a row's
// position leaves its max, sum and output exactly as they were (alpha = 1, P = 0, and the keys and
// values past the last position are zero-filled), so a row's output does not depend on which rows
// share its launch nor on where its KV pages sit.

#define MMA_WARPS 4
#define MMA_QV (MMA_WARPS * 16)
#define MMA_KEYS 64
#define LOG2E 1.4426950408889634f

// Two buffers of one K and one V tile: 2 · 2 · MMA_KEYS · (D + 8) bf16.
extern __shared__ __align__(16) bf16_t mma_smem[];

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}

// c += a · b for one m16n8k16 tile (a: 4 registers of A, b0/b1: the 2 registers of B).
__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("trap;");
#endif
}

// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned shared_addr(const void* p) {
    unsigned addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(addr) : "l"(p));
    return addr;
}

// Four 8 × 8 bf16 matrices from shared memory, transposed: lanes 8m .. 8m+7 give the addresses of
// matrix m's rows, and lane 4g + t receives (row 2t, col g) and (row 2t+1, col g) of matrix m in r[m].
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16_t* row) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(row))
                 : "memory");
#else
    asm volatile("trap;");
#endif
}

// 16 bytes from global to shared memory without passing through registers (completes at a
// cp.async.wait_group).
__device__ __forceinline__ void cp_async16(bf16_t* dst, const bf16_t* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_addr(dst)), "l"(src) : "memory");
#else
    asm volatile("trap;");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Starts copying the tile of keys k0 .. k0 + MMA_KEYS of KV head kvh into ks / vs (row pitch
// STRIDE); keys from n_keys on are zero-filled with plain stores.
template <int D>
__device__ __forceinline__ void load_tile(bf16_t* ks, bf16_t* vs, const bf16_t* __restrict__ k_pages,
                                          const bf16_t* __restrict__ v_pages,
                                          const unsigned int* __restrict__ block_table, unsigned int k0,
                                          unsigned int n_keys, int block_tokens, int row_elems, int kvh) {
    constexpr int STRIDE = D + 8;
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per key row
    for (int c = threadIdx.x; c < MMA_KEYS * CHUNKS; c += blockDim.x) {
        const int j = c / CHUNKS;
        const int d = (c % CHUNKS) * 8;
        const unsigned int p = k0 + j;
        bf16_t* kd = ks + j * STRIDE + d;
        bf16_t* vd = vs + j * STRIDE + d;
        if (p < n_keys) {
            const unsigned int blk = block_table[p / block_tokens];
            const size_t at = ((size_t)blk * block_tokens + p % block_tokens) * row_elems + (size_t)kvh * D + d;
            cp_async16(kd, k_pages + at);
            cp_async16(vd, v_pages + at);
        } else {
            *(uint4*)kd = make_uint4(0u, 0u, 0u, 0u);
            *(uint4*)vd = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Elements d and d+1 of a query vector, scaled, as one bf16 pair (zero for a missing vector).
__device__ __forceinline__ unsigned q_pair(const float* qv, int d, float s) {
    return qv ? pack_bf16x2(qv[d] * s, qv[d + 1] * s) : 0u;
}

template <int D>
__device__ __forceinline__ void attention_mma(const float* __restrict__ q, const bf16_t* __restrict__ k_pages,
                                              const bf16_t* __restrict__ v_pages,
                                              const unsigned int* __restrict__ block_table,
                                              const unsigned int* __restrict__ positions,
                                              const unsigned int* __restrict__ seq_rows,
                                              const unsigned int* __restrict__ seq_tables, float* __restrict__ out,
                                              int rows, int heads, int kv_heads, int block_tokens, float scale) {
    constexpr int STRIDE = D + 8;        // bf16 per shared row
    constexpr int KSTEPS = D / 16;       // k-steps of S over the head dim
    constexpr int DTILES = D / 8;        // n-tiles of O over the head dim
    constexpr int NTILES = MMA_KEYS / 8; // n-tiles of S over the tile's keys
    constexpr int TILE = MMA_KEYS * STRIDE;
    __shared__ unsigned int max_pos_s;

    // This block's sequence: its rows, its block table; blocks past its rows have nothing to do.
    if (!enter_sequence(seq_rows, seq_tables, q, out, positions, block_table, rows, heads, kv_heads, D, MMA_QV))
        return;
    const int group = heads / kv_heads;
    const int kvh = blockIdx.y;
    const long long n_qv = (long long)rows * group;
    const long long qv0 = (long long)blockIdx.x * MMA_QV;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int row_elems = kv_heads * D;

    if (threadIdx.x == 0) max_pos_s = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < MMA_QV; i += blockDim.x) {
        const long long qi = qv0 + i;
        if (qi < n_qv) atomicMax(&max_pos_s, positions[qi / group]);
    }
    __syncthreads();
    const unsigned int n_keys = max_pos_s + 1;

    // This thread's two query vectors: rows g and g + 8 of its warp's 16.
    bool valid[2];
    unsigned int pos[2];
    const float* qrow[2];
    float* orow[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long qi = qv0 + warp * 16 + g + 8 * rr;
        valid[rr] = qi < n_qv;
        pos[rr] = valid[rr] ? positions[qi / group] : 0u;
        const long long r = qi / group;
        const int h = kvh * group + (int)(qi % group);
        qrow[rr] = valid[rr] ? q + (r * heads + h) * D : nullptr;
        orow[rr] = valid[rr] ? out + (r * heads + h) * D : nullptr;
    }
    const float qscale = scale * LOG2E;
    unsigned qa[KSTEPS][4];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        const int d = 16 * s + 2 * t;
        qa[s][0] = q_pair(qrow[0], d, qscale);
        qa[s][1] = q_pair(qrow[1], d, qscale);
        qa[s][2] = q_pair(qrow[0], d + 8, qscale);
        qa[s][3] = q_pair(qrow[1], d + 8, qscale);
    }

    float o[DTILES][4];
#pragma unroll
    for (int i = 0; i < DTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF};
    float l[2] = {0.0f, 0.0f};

    // Buffer b holds K at mma_smem + 2 b TILE and V right after it.
    const unsigned int n_tiles = (n_keys + MMA_KEYS - 1) / MMA_KEYS;
    load_tile<D>(mma_smem, mma_smem + TILE, k_pages, v_pages, block_table, 0, n_keys, block_tokens, row_elems, kvh);
    cp_async_commit();
    for (unsigned int it = 0; it < n_tiles; ++it) {
        const unsigned int k0 = it * MMA_KEYS;
        const bf16_t* ks = mma_smem + 2 * (it & 1) * TILE;
        const bf16_t* vs = ks + TILE;
        if (it + 1 < n_tiles) {
            // The other buffer was last read in iteration it - 1, which ended at a barrier.
            bf16_t* next = mma_smem + 2 * ((it + 1) & 1) * TILE;
            load_tile<D>(next, next + TILE, k_pages, v_pages, block_table, k0 + MMA_KEYS, n_keys, block_tokens,
                         row_elems, kvh);
            cp_async_commit();
            cp_async_wait<1>();  // this tile's copies are done, the next tile's may still run
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies (and zero stores) of this tile are visible

        // 1. S = Q Kᵀ: B's (rows 2t, 2t+1; col g) are key 8j + g's dims 16s + 2t, +1.
        float sacc[NTILES][4];
#pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
                const bf16_t* kp = ks + (8 * j + g) * STRIDE + 16 * s + 2 * t;
                mma_bf16_16816(sacc[j], qa[s], *(const unsigned*)kp, *(const unsigned*)(kp + 8));
            }
        }

        // 2. Mask and online softmax: sacc[j][2 rr + c] is row rr's key k0 + 8j + 2t + c; a row's
        // 64 keys are spread over the 4 lanes of its quad.
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const unsigned int p = k0 + 8 * j + 2 * t + c;
                    float& sv = sacc[j][2 * rr + c];
                    sv = (valid[rr] && p <= pos[rr]) ? sv : NEG_INF;
                    mx = fmaxf(mx, sv);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[rr], mx);
            const float alpha = m[rr] == m_new ? 1.0f : exp2f(m[rr] - m_new);
            // A row without a live key so far (only one without a query vector) stays at zero.
            const float base = m_new == NEG_INF ? 0.0f : m_new;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float pv = exp2f(sacc[j][2 * rr + c] - base);
                    sacc[j][2 * rr + c] = pv;
                    sum += pv;
                }
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l[rr] = l[rr] * alpha + sum;
            m[rr] = m_new;
#pragma unroll
            for (int i = 0; i < DTILES; ++i) {
                o[i][2 * rr] *= alpha;
                o[i][2 * rr + 1] *= alpha;
            }
        }

        // 3. O += P V over the tile's keys in steps of 16: P's A fragment is S's n-tiles 2u and
        // 2u + 1; V's B fragments for dims 16dp .. 16dp + 15 come from one transposed ldmatrix
        // (matrix m: keys 16u + 8 (m & 1) .., dims 16dp + 8 (m >> 1) ..).
        const int mtx = lane >> 3;
        const int mrow = lane & 7;
#pragma unroll
        for (int u = 0; u < MMA_KEYS / 16; ++u) {
            unsigned pa[4];
            pa[0] = pack_bf16x2(sacc[2 * u][0], sacc[2 * u][1]);
            pa[1] = pack_bf16x2(sacc[2 * u][2], sacc[2 * u][3]);
            pa[2] = pack_bf16x2(sacc[2 * u + 1][0], sacc[2 * u + 1][1]);
            pa[3] = pack_bf16x2(sacc[2 * u + 1][2], sacc[2 * u + 1][3]);
            const bf16_t* vrow = vs + (16 * u + mrow + 8 * (mtx & 1)) * STRIDE + 8 * (mtx >> 1);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, vrow + 16 * dp);
                mma_bf16_16816(o[2 * dp], pa, vb[0], vb[1]);
                mma_bf16_16816(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // this buffer is no longer read: the next iteration may load into it
    }

#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        if (!valid[rr]) continue;
        const float inv = 1.0f / l[rr];
#pragma unroll
        for (int i = 0; i < DTILES; ++i) {
            const int d = 8 * i + 2 * t;
            orow[rr][d] = o[i][2 * rr] * inv;
            orow[rr][d + 1] = o[i][2 * rr + 1] * inv;
        }
    }
}

// The arguments of attention_paged (head_dim must be the entry point's). Grid: x = ceil(rows ·
// group / MMA_QV) for the longest sequence's rows, y = kv_heads, z = sequences; MMA_WARPS · 32 threads; 2 · 2 · MMA_KEYS · (head_dim + 8) · 2
// bytes of dynamic shared memory.
#define ATTENTION_MMA_ENTRY(D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) attention_mma_d##D(                               \
        const float* __restrict__ q, const bf16_t* __restrict__ k_pages, const bf16_t* __restrict__ v_pages,      \
        const unsigned int* __restrict__ block_table, const unsigned int* __restrict__ positions,                 \
        const unsigned int* __restrict__ seq_rows, const unsigned int* __restrict__ seq_tables,                   \
        float* __restrict__ out, int rows, int heads, int kv_heads, int head_dim, int block_tokens, float scale) { \
        attention_mma<D>(q, k_pages, v_pages, block_table, positions, seq_rows, seq_tables, out, rows, heads,      \
                         kv_heads, block_tokens, scale);                                                           \
    }

ATTENTION_MMA_ENTRY(64)
ATTENTION_MMA_ENTRY(128)
