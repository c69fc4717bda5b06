// RMSNorm and rotary position embedding.

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; one thread block per row.
extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                       float* __restrict__ out, int rows, int dim, float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * dim;
    float* o = out + (size_t)r * dim;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) ss += xr[d] * xr[d];
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = xr[d] * inv * bf16_to_f32(w[d]);
}

// Rotate-half RoPE in place over x: [rows, heads, head_dim]; one thread per (row, head, i < head_dim/2):
//   (a, b) = (x[i], x[i + half]);  x[i] = a cos - b sin;  x[i + half] = b cos + a sin
// with angle = (float)pos * inv_freq[i], one f32 product as in transformers; the frequencies come
// from the host (the same table for every backend), and sincosf is the accurate one (no fast math).
extern "C" __global__ void rope_f32(float* __restrict__ x, const unsigned int* __restrict__ positions,
                                    const float* __restrict__ inv_freq, int rows, int heads, int head_dim) {
    const int half = head_dim / 2;
    const long long total = (long long)rows * heads * half;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const long long rh = idx / half;
        const int r = (int)(rh / heads);
        const float angle = __fmul_rn((float)positions[r], inv_freq[i]);
        float s, c;
        sincosf(angle, &s, &c);
        float* base = x + rh * head_dim;
        const float a = base[i];
        const float b = base[i + half];
        base[i] = a * c - b * s;
        base[i + half] = b * c + a * s;
    }
}
