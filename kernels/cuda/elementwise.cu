// Element-wise kernels: embedding lookup, SwiGLU, add, f32 -> bf16.

// out[t][d] = table[tokens[t]][d]; grid.x = tokens, grid-stride over dim. Token ids are checked on
// the host against the vocabulary.
extern "C" __global__ void embed_bf16(const bf16_t* __restrict__ table, const unsigned int* __restrict__ tokens,
                                      float* __restrict__ out, int n_tokens, int dim) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const bf16_t* row = table + (size_t)tokens[t] * dim;
    float* o = out + (size_t)t * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = bf16_to_f32(row[d]);
}

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
extern "C" __global__ void swiglu_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                      float* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// x += y.
extern "C" __global__ void add_assign_f32(float* __restrict__ x, const float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// x[r][c] += bias[c] over rows × cols (a linear layer's bias, kept as bf16 like every weight).
extern "C" __global__ void add_bias_f32(float* __restrict__ x, const bf16_t* __restrict__ bias, long long n,
                                        int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += bf16_to_f32(bias[i % cols]);
    }
}

// y = bf16(x), round to nearest even (the GEMM's activation input).
extern "C" __global__ void f32_to_bf16_kernel(const float* __restrict__ x, bf16_t* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = f32_to_bf16(x[i]);
    }
}
