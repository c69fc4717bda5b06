// KV cache writes and the batched block gather/scatter between the paged G1 layout and block-image
// payloads.
//
// The paged pool keeps, per layer, one K and one V array of `num_blocks` pages of `page_bytes`
// (= B * kv_heads * head_dim * 2). A block image is the same pages back to back in the order
// [layer][k|v]. The page table `pages[p]` (p = layer * 2 + is_v) gives each array's base address, so
// block `b`'s page p lives at pages[p] + b * page_bytes and at payload offset p * page_bytes.

// K and V rows [rows, row_elems] (f32) into token slots of one layer's bf16 pages: row r lands at
// token slot slots[r] (block slots[r] / B, offset slots[r] % B), i.e. element slots[r] * row_elems.
extern "C" __global__ void kv_write_bf16(const float* __restrict__ k, const float* __restrict__ v,
                                         bf16_t* __restrict__ k_pages, bf16_t* __restrict__ v_pages,
                                         const unsigned int* __restrict__ slots, int rows, int row_elems) {
    const long long total = (long long)rows * row_elems;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / row_elems;
        const long long e = idx % row_elems;
        const long long dst = (long long)slots[r] * row_elems + e;
        k_pages[dst] = f32_to_bf16(k[idx]);
        v_pages[dst] = f32_to_bf16(v[idx]);
    }
}

// Copies one page per thread block: 16-byte vectors when `vec16` (every address and page_bytes a
// multiple of 16), bytes otherwise.
__device__ __forceinline__ void copy_page(unsigned char* dst, const unsigned char* src, u64_t page_bytes, int vec16) {
    if (vec16) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const u64_t n = page_bytes / 16;
        for (u64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    } else {
        for (u64_t i = threadIdx.x; i < page_bytes; i += blockDim.x) dst[i] = src[i];
    }
}

// Gather: grid.x = n_blocks * n_pages, one job per (block, page) for pages first_page ..
// first_page + n_pages of the [layer][k|v] order (all of them: 0 .. layers * 2; one layer's: 2l ..
// 2l + 2). Payload i (at payloads[i], any device-accessible address: device staging or mapped pinned
// host memory) receives those pages of block blocks[i] at their payload offsets.
extern "C" __global__ void kv_gather_pages(const u64_t* __restrict__ pages, int first_page, int n_pages,
                                           const unsigned int* __restrict__ blocks, const u64_t* __restrict__ payloads,
                                           int n_blocks, u64_t page_bytes, int vec16) {
    const long long job = blockIdx.x;
    if (job >= (long long)n_blocks * n_pages) return;
    const int i = (int)(job / n_pages);
    const int p = first_page + (int)(job % n_pages);
    const unsigned char* src = (const unsigned char*)pages[p] + (u64_t)blocks[i] * page_bytes;
    unsigned char* dst = (unsigned char*)payloads[i] + (u64_t)p * page_bytes;
    copy_page(dst, src, page_bytes, vec16);
}

// Scatter: the reverse; payload i lands in block blocks[i] (the host refuses duplicate targets).
extern "C" __global__ void kv_scatter_pages(const u64_t* __restrict__ pages, int first_page, int n_pages,
                                            const unsigned int* __restrict__ blocks, const u64_t* __restrict__ payloads,
                                            int n_blocks, u64_t page_bytes, int vec16) {
    const long long job = blockIdx.x;
    if (job >= (long long)n_blocks * n_pages) return;
    const int i = (int)(job / n_pages);
    const int p = first_page + (int)(job % n_pages);
    const unsigned char* src = (const unsigned char*)payloads[i] + (u64_t)p * page_bytes;
    unsigned char* dst = (unsigned char*)pages[p] + (u64_t)blocks[i] * page_bytes;
    copy_page(dst, src, page_bytes, vec16);
}
