//! Salted, chained 128-bit block hashes (DESIGN.md §3).
//!
//! `h_0 = xxh3_128(salt ‖ tokens[0..B])` and `h_i = xxh3_128(salt ‖ h_{i-1} ‖ tokens[iB..(i+1)B])`,
//! every integer little-endian. A hash therefore names a block *and its whole prefix*: two sequences
//! share the hash of block `i` exactly when they share tokens `0..(i+1)B` (up to xxh3-128 collisions).
//! The salt folds in everything that makes KV incompatible or private — the hash-scheme version, the
//! model identity, a LoRA adapter, a tenant's `cache_salt` — so that two tenants never share, or probe,
//! each other's blocks.

use std::fmt;

use xxhash_rust::xxh3::xxh3_128;

/// Version of the hashing scheme; bumping it changes every salt and so every hash.
pub const HASH_SCHEME_VERSION: u32 = 1;

/// A token id as the engine sees it.
pub type TokenId = u32;

/// The identity of a complete block and its whole prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The little-endian bytes, as stored in block-image headers and on the wire.
    pub fn to_le_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    /// Inverse of [`BlockHash::to_le_bytes`].
    pub fn from_le_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_le_bytes(bytes))
    }
}

/// An order-free digest of a set of blocks, kept as members come and go: the wrapping sum of each
/// member's hash folded to 64 bits (block hashes are xxh3-128 outputs, uniform already). Two
/// holders of a set compare it by one number, where counts agree for sets that differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetDigest(u64);

impl SetDigest {
    fn fold(hash: BlockHash) -> u64 {
        (hash.0 as u64) ^ ((hash.0 >> 64) as u64)
    }

    /// `hash` joined the set (it was not in it).
    pub fn insert(&mut self, hash: BlockHash) {
        self.0 = self.0.wrapping_add(Self::fold(hash));
    }

    /// `hash` left the set (it was in it).
    pub fn remove(&mut self, hash: BlockHash) {
        self.0 = self.0.wrapping_sub(Self::fold(hash));
    }

    /// Its top 52 bits, which a Prometheus sample (an f64) holds exactly.
    pub fn gauge(self) -> f64 {
        (self.0 >> 12) as f64
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The 128-bit salt that scopes every hash to one model, adapter and tenant.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Salt(pub u128);

impl fmt::Debug for Salt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Salt({:032x})", self.0)
    }
}

/// A private cache namespace within a model's salt: a tenant, narrowed further by a request's
/// `cache_salt`. Blocks hashed [`within`](Salt::within) two different namespaces (or one and the
/// shared namespace) never have the same hash, so neither can hit, or probe, the other's.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace(u128);

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({:032x})", self.0)
    }
}

impl Namespace {
    /// The namespace of `tenant` (empty for the shared tenant) narrowed by `cache_salt` (empty
    /// for none); `None` when both are empty: the shared namespace, whose salt is the model's.
    pub fn new(tenant: &str, cache_salt: &str) -> Option<Namespace> {
        if tenant.is_empty() && cache_salt.is_empty() {
            return None;
        }
        let mut buf = Vec::with_capacity(40 + tenant.len() + cache_salt.len());
        buf.extend_from_slice(b"dynamo-node/namespace");
        for field in [tenant, cache_salt] {
            buf.extend_from_slice(&(field.len() as u64).to_le_bytes());
            buf.extend_from_slice(field.as_bytes());
        }
        Some(Namespace(xxh3_128(&buf)))
    }

    /// Its 32 hex digits: how it is named to an engine (vLLM's `cache_salt`).
    pub fn to_hex(self) -> String {
        format!("{:032x}", self.0)
    }

    /// The namespace [`to_hex`](Self::to_hex) wrote, or `None` for anything else.
    pub fn from_hex(hex: &str) -> Option<Namespace> {
        (hex.len() == 32).then(|| u128::from_str_radix(hex, 16).ok().map(Namespace)).flatten()
    }
}

/// What a salt is made of. Every field is length-prefixed before hashing, so no two different
/// inputs encode to the same bytes (`("ab", "c")` and `("a", "bc")` give different salts).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaltInputs<'a> {
    /// Model name, e.g. `"llama-8b"`.
    pub model: &'a str,
    /// Digest of the weights (empty for seeded random weights; the seed then belongs in `model`).
    pub weights_digest: &'a str,
    /// LoRA adapter name, empty for none.
    pub lora: &'a str,
    /// Per-tenant cache salt, empty for the shared namespace.
    pub cache_salt: &'a str,
}

impl Salt {
    /// Derives the salt for a model / adapter / tenant under the current [`HASH_SCHEME_VERSION`].
    pub fn derive(inputs: &SaltInputs<'_>) -> Self {
        let mut buf = Vec::with_capacity(
            32 + inputs.model.len() + inputs.weights_digest.len() + inputs.lora.len() + inputs.cache_salt.len(),
        );
        buf.extend_from_slice(b"dynamo-node/salt");
        buf.extend_from_slice(&HASH_SCHEME_VERSION.to_le_bytes());
        for field in [inputs.model, inputs.weights_digest, inputs.lora, inputs.cache_salt] {
            buf.extend_from_slice(&(field.len() as u64).to_le_bytes());
            buf.extend_from_slice(field.as_bytes());
        }
        Self(xxh3_128(&buf))
    }
}

impl Salt {
    /// The salt of `namespace` within this one (`self` itself for the shared namespace).
    pub fn within(self, namespace: Option<Namespace>) -> Salt {
        match namespace {
            None => self,
            Some(ns) => {
                let mut buf = [0u8; 32];
                buf[..16].copy_from_slice(&self.0.to_le_bytes());
                buf[16..].copy_from_slice(&ns.0.to_le_bytes());
                Salt(xxh3_128(&buf))
            }
        }
    }
}

/// Hashes token blocks of a fixed size under one salt.
///
/// Reuses one scratch buffer per hasher: hashing a block copies `16 + 16 + 4·B` bytes and runs one
/// one-shot xxh3-128 over them, which is faster than the streaming hasher at these sizes.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    salt: Salt,
    block_size: usize,
    scratch: Vec<u8>,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens.
    ///
    /// # Panics
    /// If `block_size` is zero (configuration validation rejects that earlier).
    pub fn new(salt: Salt, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self { salt, block_size, scratch: Vec::with_capacity(32 + 4 * block_size) }
    }

    /// The salt this hasher applies.
    pub fn salt(&self) -> Salt {
        self.salt
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of one complete block given its parent's hash (`None` for the first block).
    ///
    /// # Panics
    /// If `tokens.len()` is not the block size.
    pub fn hash_block(&mut self, parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
        assert_eq!(tokens.len(), self.block_size, "a block hash covers exactly one complete block");
        let prefix = if parent.is_some() { 32 } else { 16 };
        let len = prefix + 4 * tokens.len();
        let buf = &mut self.scratch;
        buf.resize(len, 0);
        buf[..16].copy_from_slice(&self.salt.0.to_le_bytes());
        if let Some(parent) = parent {
            buf[16..32].copy_from_slice(&parent.0.to_le_bytes());
        }
        copy_tokens_le(tokens, &mut buf[prefix..len]);
        BlockHash(xxh3_128(&buf[..len]))
    }

    /// Hashes every complete block of `tokens`, continuing the chain after `parent`.
    /// A partial tail is ignored: only complete blocks have an identity.
    pub fn extend(&mut self, mut parent: Option<BlockHash>, tokens: &[TokenId], out: &mut Vec<BlockHash>) {
        out.reserve(tokens.len() / self.block_size);
        for block in tokens.chunks_exact(self.block_size) {
            let hash = self.hash_block(parent, block);
            out.push(hash);
            parent = Some(hash);
        }
    }

    /// The hashes of every complete block of a sequence that starts at token 0.
    pub fn hash_sequence(&mut self, tokens: &[TokenId]) -> Vec<BlockHash> {
        let mut out = Vec::new();
        self.extend(None, tokens, &mut out);
        out
    }
}

/// Writes `tokens` as little-endian bytes: one `memcpy` on little-endian machines.
fn copy_tokens_le(tokens: &[TokenId], out: &mut [u8]) {
    #[cfg(target_endian = "little")]
    out.copy_from_slice(bytemuck::cast_slice(tokens));
    #[cfg(not(target_endian = "little"))]
    for (chunk, token) in out.chunks_exact_mut(4).zip(tokens) {
        chunk.copy_from_slice(&token.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    fn salt(tag: &str) -> Salt {
        Salt::derive(&SaltInputs { model: "tiny", cache_salt: tag, ..Default::default() })
    }

    #[test]
    fn salt_fields_are_length_prefixed() {
        let a = Salt::derive(&SaltInputs { model: "ab", weights_digest: "c", ..Default::default() });
        let b = Salt::derive(&SaltInputs { model: "a", weights_digest: "bc", ..Default::default() });
        assert_ne!(a, b);
    }

    #[test]
    fn hash_is_xxh3_128_over_salt_parent_and_little_endian_tokens() {
        let s = salt("x");
        let mut h = BlockHasher::new(s, 2);
        let first = h.hash_block(None, &[1, 0x0102_0304]);
        let mut bytes = s.0.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[1, 0, 0, 0, 4, 3, 2, 1]);
        assert_eq!(first, BlockHash(xxh3_128(&bytes)));
        let second = h.hash_block(Some(first), &[5, 6]);
        let mut bytes = s.0.to_le_bytes().to_vec();
        bytes.extend_from_slice(&first.0.to_le_bytes());
        bytes.extend_from_slice(&[5, 0, 0, 0, 6, 0, 0, 0]);
        assert_eq!(second, BlockHash(xxh3_128(&bytes)), "the documented scheme, byte for byte");
    }

    #[test]
    fn namespaces_share_no_block_with_each_other_or_the_shared_one() {
        let model = salt("");
        assert_eq!(Namespace::new("", ""), None, "no tenant and no cache_salt: the shared namespace");
        assert_eq!(model.within(None), model);
        let spaces = [
            Namespace::new("a", ""),
            Namespace::new("b", ""),
            Namespace::new("a", "x"),
            Namespace::new("", "x"),
            Namespace::new("ax", ""),
            Namespace::new("a", "x"),
        ];
        assert_eq!(spaces[2], spaces[5], "the same tenant and salt: the same namespace");
        let tokens: Vec<u32> = (0..8).collect();
        let mut seen = HashSet::new();
        seen.insert(BlockHasher::new(model, 4).hash_sequence(&tokens)[0]);
        for ns in &spaces[..5] {
            let first = BlockHasher::new(model.within(*ns), 4).hash_sequence(&tokens)[0];
            assert!(seen.insert(first), "{ns:?} shares a block hash");
        }
    }

    #[test]
    fn partial_tail_has_no_hash() {
        let mut h = BlockHasher::new(salt(""), 4);
        assert_eq!(h.hash_sequence(&[1, 2, 3]).len(), 0);
        assert_eq!(h.hash_sequence(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
    }

    #[test]
    fn extend_continues_the_chain() {
        let mut h = BlockHasher::new(salt(""), 4);
        let tokens: Vec<u32> = (0..16).collect();
        let whole = h.hash_sequence(&tokens);
        let mut split = h.hash_sequence(&tokens[..8]);
        h.extend(split.last().copied(), &tokens[8..], &mut split);
        assert_eq!(whole, split);
    }

    #[test]
    fn first_block_differs_from_same_tokens_later_in_a_chain() {
        let mut h = BlockHasher::new(salt(""), 2);
        let seq = h.hash_sequence(&[7, 7, 7, 7]);
        assert_ne!(seq[0], seq[1], "the chain must make position part of identity");
    }

    proptest! {
        /// Equal prefixes ⇔ equal hashes: block i agrees exactly when tokens 0..(i+1)B agree.
        #[test]
        fn equal_prefixes_iff_equal_hashes(
            block_size in 1usize..9,
            common in proptest::collection::vec(0u32..4, 0..64),
            a_tail in proptest::collection::vec(0u32..4, 0..40),
            b_tail in proptest::collection::vec(0u32..4, 0..40),
        ) {
            let a: Vec<u32> = common.iter().chain(&a_tail).copied().collect();
            let b: Vec<u32> = common.iter().chain(&b_tail).copied().collect();
            let mut h = BlockHasher::new(salt("t"), block_size);
            let ha = h.hash_sequence(&a);
            let hb = h.hash_sequence(&b);
            for i in 0..ha.len().min(hb.len()) {
                let end = (i + 1) * block_size;
                prop_assert_eq!(ha[i] == hb[i], a[..end] == b[..end], "block {}", i);
            }
        }

        /// Different salts never collide, on any block of any sequence.
        #[test]
        fn different_salts_never_collide(
            tokens in proptest::collection::vec(any::<u32>(), 1..256),
            tags in proptest::collection::hash_set("[a-z]{0,6}", 2..6),
        ) {
            let mut seen = HashSet::new();
            for tag in &tags {
                let mut h = BlockHasher::new(salt(tag), 1);
                for hash in h.hash_sequence(&tokens) {
                    prop_assert!(seen.insert(hash), "collision across salts");
                }
            }
        }
    }
}
