//! Model shapes known by name, and the element types of weights and KV.

config_enum! {
    /// Element type of weights, activations and KV blocks.
    #[derive(Default)]
    pub enum Dtype ("dtype") {
        /// 32-bit IEEE float.
        #[default]
        F32 = "f32",
        /// 16-bit IEEE half float.
        F16 = "f16",
        /// bfloat16.
        Bf16 = "bf16",
    }
}

impl Dtype {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

/// The dimensions of a Llama-architecture decoder, enough to size KV blocks and to build random
/// weights for a named shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelShape {
    /// Name used in `model.name`.
    pub name: &'static str,
    /// Decoder layers.
    pub layers: usize,
    /// Hidden (embedding) width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl ModelShape {
    /// A two-layer model for tests: fast on a CPU, real enough to exercise every code path.
    pub const TINY: ModelShape = ModelShape {
        name: "tiny",
        layers: 2,
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 384,
        vocab: 201_088,
    };

    /// The shape of Llama 3.2 1B.
    pub const LLAMA_1B: ModelShape = ModelShape {
        name: "llama-1b",
        layers: 16,
        hidden: 2048,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        ffn: 8192,
        vocab: 128_256,
    };

    /// The shape of Llama 3.1 8B.
    pub const LLAMA_8B: ModelShape = ModelShape {
        name: "llama-8b",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        vocab: 128_256,
    };

    /// Every named shape.
    pub const ALL: [ModelShape; 3] = [Self::TINY, Self::LLAMA_1B, Self::LLAMA_8B];

    /// The shape called `name`, if there is one.
    pub fn named(name: &str) -> Option<ModelShape> {
        Self::ALL.into_iter().find(|s| s.name == name)
    }

    /// Bytes of K and V one token occupies across all layers:
    /// `layers * 2 * kv_heads * head_dim * dtype.size_bytes()`.
    pub const fn kv_bytes_per_token(&self, dtype: Dtype) -> u64 {
        (self.layers * 2 * self.kv_heads * self.head_dim * dtype.size_bytes()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_shapes() {
        for shape in ModelShape::ALL {
            assert_eq!(ModelShape::named(shape.name), Some(shape));
            assert_eq!(shape.hidden, shape.heads * shape.head_dim);
        }
        assert_eq!(ModelShape::named("llama-70b"), None);
    }

    #[test]
    fn kv_bytes() {
        assert_eq!(ModelShape::TINY.kv_bytes_per_token(Dtype::F32), 1024);
        assert_eq!(ModelShape::LLAMA_1B.kv_bytes_per_token(Dtype::Bf16), 32_768);
        assert_eq!(ModelShape::LLAMA_8B.kv_bytes_per_token(Dtype::Bf16), 131_072);
        assert_eq!(Dtype::F16.size_bytes(), 2);
        assert_eq!("bf16".parse::<Dtype>(), Ok(Dtype::Bf16));
    }
}
