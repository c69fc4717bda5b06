//! The paged G1 KV layout and the block-image payload layout, and the CPU gather/scatter between
//! them.
//!
//! In G1, each layer owns one K and one V array of `num_blocks` pages; a page holds one block's
//! `B × kv_heads × head_dim` elements contiguously. A block image payload puts the same pages one
//! after another, layer by layer, K before V. Gathering block `b` is therefore `2 × layers`
//! contiguous copies of one page each, and scattering is the reverse: no element shuffling, which
//! is what lets the GPU versions run at copy bandwidth.

/// Shape of the paged KV of one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedLayout {
    /// Transformer layers.
    pub layers: usize,
    /// Tokens per block (B).
    pub block_tokens: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Bytes per element.
    pub elem_bytes: usize,
}

impl PagedLayout {
    /// Bytes of one page: one block of K (or V) of one layer.
    pub fn page_bytes(&self) -> usize {
        self.block_tokens * self.kv_heads * self.head_dim * self.elem_bytes
    }

    /// Bytes of one block's image payload: every layer's K and V page.
    pub fn payload_bytes(&self) -> usize {
        self.layers * 2 * self.page_bytes()
    }

    /// Offset in the payload of `layer`'s K (`v = false`) or V (`v = true`) page.
    pub fn payload_offset(&self, layer: usize, v: bool) -> usize {
        (layer * 2 + v as usize) * self.page_bytes()
    }
}

/// Why a gather or scatter was refused. Nothing is copied when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A block id is outside the pool.
    #[error("block {block} is outside a pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The id.
        block: u32,
        /// Pages per layer.
        num_blocks: usize,
    },
    /// A payload buffer has the wrong length.
    #[error("payload {index} has {len} bytes, the layout needs {need}")]
    PayloadLength {
        /// Position in the batch.
        index: usize,
        /// Its length.
        len: usize,
        /// The layout's payload size.
        need: usize,
    },
    /// The batch names fewer or more payloads than blocks.
    #[error("{blocks} blocks but {payloads} payloads")]
    BatchMismatch {
        /// Blocks in the batch.
        blocks: usize,
        /// Payloads in the batch.
        payloads: usize,
    },
    /// A scatter writes one block twice.
    #[error("block {0} appears twice in one scatter")]
    DuplicateTarget(u32),
}

impl LayoutError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            LayoutError::BlockOutOfRange { .. } => "block_out_of_range",
            LayoutError::PayloadLength { .. } => "payload_length",
            LayoutError::BatchMismatch { .. } => "batch_mismatch",
            LayoutError::DuplicateTarget(_) => "duplicate_target",
        }
    }
}

/// A G1 pool in host memory: per layer, one K and one V array of `num_blocks` pages.
///
/// Storage is 4-byte aligned (pages are multiples of 4 bytes), so a backend can view a page of
/// `f32` elements in place with [`HostKvPool::page_f32`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostKvPool {
    layout: PagedLayout,
    num_blocks: usize,
    k: Vec<Vec<u32>>,
    v: Vec<Vec<u32>>,
}

impl HostKvPool {
    /// A zeroed pool of `num_blocks` pages per layer.
    ///
    /// # Panics
    /// If a page is not a multiple of 4 bytes (no model shape produces one).
    pub fn new(layout: PagedLayout, num_blocks: usize) -> Self {
        let page = layout.page_bytes();
        assert!(page.is_multiple_of(4), "a KV page of {page} bytes is not a multiple of 4");
        let arrays = || (0..layout.layers).map(|_| vec![0u32; page / 4 * num_blocks]).collect();
        Self { layout, num_blocks, k: arrays(), v: arrays() }
    }

    /// One page of `f32` elements (the pool must hold 4-byte elements).
    pub fn page_f32(&self, layer: usize, v: bool, block: u32) -> &[f32] {
        debug_assert_eq!(self.layout.elem_bytes, 4);
        bytemuck::cast_slice(self.page(layer, v, block))
    }

    /// One page of `f32` elements, writable.
    pub fn page_f32_mut(&mut self, layer: usize, v: bool, block: u32) -> &mut [f32] {
        debug_assert_eq!(self.layout.elem_bytes, 4);
        bytemuck::cast_slice_mut(self.page_mut(layer, v, block))
    }

    /// The layout.
    pub fn layout(&self) -> PagedLayout {
        self.layout
    }

    /// Pages per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// One page: `layer`'s K (`v = false`) or V page of `block`.
    pub fn page(&self, layer: usize, v: bool, block: u32) -> &[u8] {
        let page = self.layout.page_bytes();
        let array: &[u8] = bytemuck::cast_slice(if v { &self.v[layer] } else { &self.k[layer] });
        &array[block as usize * page..(block as usize + 1) * page]
    }

    /// One page, writable (the engine writes KV here as it prefills and decodes).
    pub fn page_mut(&mut self, layer: usize, v: bool, block: u32) -> &mut [u8] {
        let page = self.layout.page_bytes();
        let array: &mut [u8] = bytemuck::cast_slice_mut(if v { &mut self.v[layer] } else { &mut self.k[layer] });
        &mut array[block as usize * page..(block as usize + 1) * page]
    }

    fn check(&self, blocks: &[u32], lens: impl Iterator<Item = usize>, payloads: usize) -> Result<(), LayoutError> {
        if blocks.len() != payloads {
            return Err(LayoutError::BatchMismatch { blocks: blocks.len(), payloads });
        }
        let need = self.layout.payload_bytes();
        for (index, len) in lens.enumerate() {
            if len != need {
                return Err(LayoutError::PayloadLength { index, len, need });
            }
        }
        match blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(&block) => Err(LayoutError::BlockOutOfRange { block, num_blocks: self.num_blocks }),
            None => Ok(()),
        }
    }

    /// Copies blocks out of the pool into image payloads (`out[i]` receives `blocks[i]`).
    pub fn gather(&self, blocks: &[u32], out: &mut [&mut [u8]]) -> Result<(), LayoutError> {
        self.check(blocks, out.iter().map(|p| p.len()), out.len())?;
        let page = self.layout.page_bytes();
        for (payload, &block) in out.iter_mut().zip(blocks) {
            for layer in 0..self.layout.layers {
                for v in [false, true] {
                    let at = self.layout.payload_offset(layer, v);
                    payload[at..at + page].copy_from_slice(self.page(layer, v, block));
                }
            }
        }
        Ok(())
    }

    /// Copies image payloads into the pool (`payloads[i]` lands in `blocks[i]`).
    pub fn scatter(&mut self, blocks: &[u32], payloads: &[&[u8]]) -> Result<(), LayoutError> {
        self.check(blocks, payloads.iter().map(|p| p.len()), payloads.len())?;
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        if let Some(&dup) = blocks.iter().find(|&&b| !seen.insert(b)) {
            return Err(LayoutError::DuplicateTarget(dup));
        }
        let page = self.layout.page_bytes();
        for (payload, &block) in payloads.iter().zip(blocks) {
            for layer in 0..self.layout.layers {
                for v in [false, true] {
                    let at = self.layout.payload_offset(layer, v);
                    self.page_mut(layer, v, block).copy_from_slice(&payload[at..at + page]);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: PagedLayout = PagedLayout { layers: 3, block_tokens: 4, kv_heads: 2, head_dim: 5, elem_bytes: 2 };

    fn filled(num_blocks: usize) -> HostKvPool {
        let mut pool = HostKvPool::new(LAYOUT, num_blocks);
        for b in 0..num_blocks as u32 {
            for layer in 0..LAYOUT.layers {
                for v in [false, true] {
                    for (i, byte) in pool.page_mut(layer, v, b).iter_mut().enumerate() {
                        *byte = (b as usize * 31 + layer * 7 + v as usize * 3 + i) as u8;
                    }
                }
            }
        }
        pool
    }

    #[test]
    fn gather_places_every_page_at_its_payload_offset() {
        let pool = filled(6);
        let mut a = vec![0u8; LAYOUT.payload_bytes()];
        let mut b = vec![0u8; LAYOUT.payload_bytes()];
        pool.gather(&[4, 1], &mut [&mut a, &mut b]).expect("gather");
        let page = LAYOUT.page_bytes();
        for layer in 0..LAYOUT.layers {
            for v in [false, true] {
                let at = LAYOUT.payload_offset(layer, v);
                assert_eq!(&a[at..at + page], pool.page(layer, v, 4));
                assert_eq!(&b[at..at + page], pool.page(layer, v, 1));
            }
        }
        assert_eq!(LAYOUT.payload_offset(1, true), 3 * page, "[layer][k|v] order");
    }

    #[test]
    fn scatter_then_gather_round_trips_into_other_pages() {
        let src = filled(4);
        let mut images = vec![vec![0u8; LAYOUT.payload_bytes()]; 4];
        {
            let mut outs: Vec<&mut [u8]> = images.iter_mut().map(|v| v.as_mut_slice()).collect();
            src.gather(&[0, 1, 2, 3], &mut outs).expect("gather");
        }
        let mut dst = HostKvPool::new(LAYOUT, 8);
        let ins: Vec<&[u8]> = images.iter().map(|v| v.as_slice()).collect();
        dst.scatter(&[7, 5, 3, 1], &ins).expect("scatter");
        for (from, to) in [(0u32, 7u32), (1, 5), (2, 3), (3, 1)] {
            for layer in 0..LAYOUT.layers {
                for v in [false, true] {
                    assert_eq!(src.page(layer, v, from), dst.page(layer, v, to));
                }
            }
        }
        assert!(dst.page(0, false, 0).iter().all(|&b| b == 0), "untouched pages stay untouched");
    }

    #[test]
    fn bad_batches_are_refused_without_copying() {
        let mut pool = filled(2);
        let before = pool.clone();
        let good = vec![1u8; LAYOUT.payload_bytes()];
        let short = vec![1u8; 3];
        assert_eq!(pool.scatter(&[0, 2], &[&good, &good]).unwrap_err().kind(), "block_out_of_range");
        assert_eq!(pool.scatter(&[0], &[&short]).unwrap_err().kind(), "payload_length");
        assert_eq!(pool.scatter(&[0, 1], &[&good]).unwrap_err().kind(), "batch_mismatch");
        assert_eq!(pool.scatter(&[1, 1], &[&good, &good]).unwrap_err().kind(), "duplicate_target");
        assert_eq!(pool, before);
    }
}
