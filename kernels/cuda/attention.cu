// Causal grouped-query attention of a chunk of query rows over the paged KV of one layer: prefill
// (a chunk whose prefix is already resident) and decode (one row) are the same kernel.
//
// Query row r sits at absolute position positions[r] and attends to positions 0..=positions[r];
// the KV of position p lives in page block_table[p / B] at offset p % B. Online softmax (running
// max and sum), so memory is O(rows), never O(T^2).
//
// Work split: a thread block owns QV_PER_CTA query vectors of one KV head (vector index
// qi = r * group + g over the rows of the chunk and the `group = heads / kv_heads` query heads that
// share the KV head), 4 warps of QV_PER_WARP vectors each. Keys go through shared memory in tiles
// of 32 (converted to f32 once per tile, reused by every query vector of the block): lane j scores
// key j, the warp reduces max / sum with shuffles, and lane l accumulates output dims l, l + 32, ...
//
// Batches: blockIdx.z is a sequence, owning rows seq_rows[z]..seq_rows[z + 1] (positions and q/out
// rows are offset by seq_rows[z]) and the block table at block_table + seq_tables[z]; `rows` is
// the most rows of one sequence (the grid's x extent covers it).
//
// Determinism: tiles always start at multiples of 32 from position 0 and a tile past a row's
// position contributes exactly nothing, so a row's output does not depend on which rows share its
// launch nor on where its KV pages sit.

#define KT 32
#define WARPS 4
#define QV_PER_WARP 4
#define QV_PER_CTA (WARPS * QV_PER_WARP)
#define MAX_DIM_CHUNKS 8  // head_dim <= 256

extern "C" __global__ void __launch_bounds__(WARPS * 32)
attention_paged(const float* __restrict__ q, const bf16_t* __restrict__ k_pages, const bf16_t* __restrict__ v_pages,
                const unsigned int* __restrict__ block_table, const unsigned int* __restrict__ positions,
                const unsigned int* __restrict__ seq_rows, const unsigned int* __restrict__ seq_tables,
                float* __restrict__ out, int rows, int heads, int kv_heads, int head_dim, int block_tokens,
                float scale) {
    extern __shared__ float smem[];
    const int stride = head_dim + 1;  // padded rows: lane j reads key j's element d without bank conflicts
    float* ks = smem;                        // [KT][stride]
    float* vs = ks + KT * stride;            // [KT][stride]
    float* qs = vs + KT * stride;            // [QV_PER_CTA][head_dim], pre-scaled
    __shared__ unsigned int max_pos_s;

    // This block's sequence: its rows, its block table; blocks past its rows have nothing to do.
    if (!enter_sequence(seq_rows, seq_tables, q, out, positions, block_table, rows, heads, kv_heads, head_dim,
                        QV_PER_CTA))
        return;
    const int group = heads / kv_heads;
    const int kvh = blockIdx.y;
    const long long n_qv = (long long)rows * group;
    const long long qv0 = (long long)blockIdx.x * QV_PER_CTA;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int row_elems = kv_heads * head_dim;

    if (threadIdx.x == 0) max_pos_s = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < QV_PER_CTA; t += blockDim.x) {
        const long long qi = qv0 + t;
        if (qi < n_qv) atomicMax(&max_pos_s, positions[qi / group]);
    }
    for (int idx = threadIdx.x; idx < QV_PER_CTA * head_dim; idx += blockDim.x) {
        const int t = idx / head_dim;
        const int d = idx % head_dim;
        const long long qi = qv0 + t;
        float val = 0.0f;
        if (qi < n_qv) {
            const long long r = qi / group;
            const int h = kvh * group + (int)(qi % group);
            val = q[(r * heads + h) * head_dim + d] * scale;
        }
        qs[idx] = val;
    }
    __syncthreads();
    const unsigned int max_pos = max_pos_s;

    // This warp's query vectors.
    unsigned int my_pos[QV_PER_WARP];
    bool my_valid[QV_PER_WARP];
    float m[QV_PER_WARP], l[QV_PER_WARP], acc[QV_PER_WARP][MAX_DIM_CHUNKS];
#pragma unroll
    for (int a = 0; a < QV_PER_WARP; ++a) {
        const long long qi = qv0 + warp * QV_PER_WARP + a;
        my_valid[a] = qi < n_qv;
        my_pos[a] = my_valid[a] ? positions[qi / group] : 0u;
        m[a] = NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int c = 0; c < MAX_DIM_CHUNKS; ++c) acc[a][c] = 0.0f;
    }

    const unsigned int n_keys = max_pos + 1;
    for (unsigned int k0 = 0; k0 < n_keys; k0 += KT) {
        __syncthreads();  // the previous tile is no longer read
        for (int idx = threadIdx.x; idx < KT * head_dim; idx += blockDim.x) {
            const int j = idx / head_dim;
            const int d = idx % head_dim;
            const unsigned int p = k0 + j;
            float kv_k = 0.0f, kv_v = 0.0f;
            if (p < n_keys) {
                const unsigned int blk = block_table[p / block_tokens];
                const size_t at = ((size_t)blk * block_tokens + p % block_tokens) * row_elems +
                                  (size_t)kvh * head_dim + d;
                kv_k = bf16_to_f32(k_pages[at]);
                kv_v = bf16_to_f32(v_pages[at]);
            }
            ks[j * stride + d] = kv_k;
            vs[j * stride + d] = kv_v;
        }
        __syncthreads();

        // Scores: lane j against key k0 + j, for this warp's query vectors at once.
        float s[QV_PER_WARP];
#pragma unroll
        for (int a = 0; a < QV_PER_WARP; ++a) s[a] = 0.0f;
        const float* kj = ks + lane * stride;
        const float* qw = qs + (warp * QV_PER_WARP) * head_dim;
        for (int d = 0; d < head_dim; ++d) {
            const float kd = kj[d];
#pragma unroll
            for (int a = 0; a < QV_PER_WARP; ++a) s[a] += qw[a * head_dim + d] * kd;
        }
        const unsigned int p = k0 + lane;
        float pr[QV_PER_WARP];
#pragma unroll
        for (int a = 0; a < QV_PER_WARP; ++a) {
            const bool live = my_valid[a] && p <= my_pos[a];
            const float sa = live ? s[a] : NEG_INF;
            const float tile_max = warp_max(sa);
            const float m_new = fmaxf(m[a], tile_max);
            // m_new is finite once key 0 has been seen (every row attends to position 0).
            const float alpha = m[a] == m_new ? 1.0f : expf(m[a] - m_new);
            pr[a] = live ? expf(sa - m_new) : 0.0f;
            l[a] = l[a] * alpha + warp_sum(pr[a]);
            m[a] = m_new;
#pragma unroll
            for (int c = 0; c < MAX_DIM_CHUNKS; ++c) acc[a][c] *= alpha;
        }
        // Output: lane accumulates dims lane + 32 c.
        const int jmax = min(KT, (int)(n_keys - k0));
        for (int j = 0; j < jmax; ++j) {
            const float* vj = vs + j * stride;
#pragma unroll
            for (int a = 0; a < QV_PER_WARP; ++a) {
                const float pj = __shfl_sync(0xffffffffu, pr[a], j);
#pragma unroll
                for (int c = 0; c < MAX_DIM_CHUNKS; ++c) {
                    const int d = lane + 32 * c;
                    if (d < head_dim) acc[a][c] += pj * vj[d];
                }
            }
        }
    }

#pragma unroll
    for (int a = 0; a < QV_PER_WARP; ++a) {
        const long long qi = qv0 + warp * QV_PER_WARP + a;
        if (!my_valid[a]) continue;
        const long long r = qi / group;
        const int h = kvh * group + (int)(qi % group);
        float* o = out + (r * heads + h) * head_dim;
        const float inv = 1.0f / l[a];
#pragma unroll
        for (int c = 0; c < MAX_DIM_CHUNKS; ++c) {
            const int d = lane + 32 * c;
            if (d < head_dim) o[d] = acc[a][c] * inv;
        }
    }
}
