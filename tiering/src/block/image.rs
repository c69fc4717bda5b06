//! The block image: the self-describing form of one KV block in G2, G3 and on the wire.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "DYNKVIMG"
//!      8     2  format version (1)
//!     10     2  header length (128)
//!     12     2  flags (bit 0: has parent)
//!     14     1  region code            15  1  priority 0–100
//!     16    16  block hash             32 16  parent hash (0 without parent)
//!     48    16  model salt
//!     64     8  layout: layers u16, kv_heads u16, head_dim u16, dtype u8, reserved u8
//!     72     2  block tokens (B)       74  2  token count
//!     76     1  checksum kind (1 = xxh3-64)   77 3 reserved (0)
//!     80     8  payload length         88  8  payload checksum
//!     96     8  retain-until (ms)     104  8  last access (ms)
//!    112     4  access count          116  4  reserved (0)
//!    120     8  header checksum: xxh3-64 of bytes 0..120
//!    128     …  payload: [layer][k|v][B][kv_heads][head_dim]
//! ```
//!
//! Everything is little-endian. The header checksum covers every header byte, reserved ones included,
//! and the payload checksum covers every payload byte, so a flipped bit anywhere in an image is caught
//! by [`verify_image`]. An image is written in place: the producer fills the payload behind
//! [`HEADER_LEN`] and then [`seal`]s the buffer, which checksums the payload and writes the header —
//! no staging copy.

use dynamo_config::RegionKind;
use xxhash_rust::xxh3::xxh3_64;

use super::hash::{BlockHash, Salt};

/// Bytes of the fixed header in front of every payload.
pub const HEADER_LEN: usize = 128;
/// The eight magic bytes that open every image.
pub const MAGIC: [u8; 8] = *b"DYNKVIMG";
/// The image format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
const CHECKSUM_XXH3_64: u8 = 1;
const FLAG_HAS_PARENT: u16 = 1;

/// Element type of the KV payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KvDtype {
    /// Bytes without a numeric interpretation (benchmarks, opaque payloads).
    Opaque = 0,
    /// 32-bit float.
    F32 = 1,
    /// IEEE half.
    F16 = 2,
    /// bfloat16.
    Bf16 = 3,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            KvDtype::Opaque => 1,
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        [KvDtype::Opaque, KvDtype::F32, KvDtype::F16, KvDtype::Bf16].into_iter().find(|d| *d as u8 == code)
    }
}

impl From<dynamo_config::Dtype> for KvDtype {
    fn from(d: dynamo_config::Dtype) -> Self {
        match d {
            dynamo_config::Dtype::F32 => KvDtype::F32,
            dynamo_config::Dtype::F16 => KvDtype::F16,
            dynamo_config::Dtype::Bf16 => KvDtype::Bf16,
        }
    }
}

/// The shape of one block's KV: what the payload holds and how it is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    /// Transformer layers.
    pub layers: u16,
    /// Key/value heads per layer.
    pub kv_heads: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Element type.
    pub dtype: KvDtype,
    /// Tokens per block (B).
    pub block_tokens: u16,
}

impl BlockLayout {
    /// The layout of one block of `model` at `block_tokens` tokens.
    pub fn for_model(model: &dynamo_config::ModelShape, dtype: dynamo_config::Dtype, block_tokens: usize) -> Self {
        Self {
            layers: model.layers as u16,
            kv_heads: model.kv_heads as u16,
            head_dim: model.head_dim as u16,
            dtype: dtype.into(),
            block_tokens: block_tokens as u16,
        }
    }

    /// An opaque payload of exactly `bytes` bytes, if the header can describe that size (as
    /// `layers × head_dim`, each at most 65,535): external engines' blocks.
    pub fn try_opaque(bytes: usize) -> Option<Self> {
        let (layers, head_dim) = try_split_opaque(bytes)?;
        Some(Self { layers, kv_heads: 1, head_dim, dtype: KvDtype::Opaque, block_tokens: 1 })
    }

    /// An opaque payload of exactly `bytes` bytes (benchmarks and tests).
    pub fn opaque(bytes: usize) -> Self {
        assert!(bytes <= u32::MAX as usize, "opaque payloads are limited to 4 GiB");
        // Encoded as layers × head_dim with one head and one token so that payload_bytes() == bytes.
        let (layers, head_dim) = split_opaque(bytes);
        Self { layers, kv_heads: 1, head_dim, dtype: KvDtype::Opaque, block_tokens: 1 }
    }

    /// The largest opaque payload of at most `bytes` bytes that the header can describe (sizes
    /// with a large prime factor are not representable as `layers × head_dim`; this steps down in
    /// 64-byte units until one is).
    pub fn opaque_at_most(bytes: usize) -> Self {
        let mut b = bytes - bytes % 64;
        while b >= 64 {
            if let Some((layers, head_dim)) = try_split_opaque(b) {
                return Self { layers, kv_heads: 1, head_dim, dtype: KvDtype::Opaque, block_tokens: 1 };
            }
            b -= 64;
        }
        Self::opaque(bytes.min(64))
    }

    /// Payload bytes: `layers × 2 (K and V) × B × kv_heads × head_dim × dtype`, or the opaque size.
    pub fn payload_bytes(&self) -> usize {
        let elems = self.layers as usize * self.kv_heads as usize * self.head_dim as usize * self.block_tokens as usize;
        match self.dtype {
            KvDtype::Opaque => elems,
            d => elems * 2 * d.size_bytes(),
        }
    }

    /// The engine-side paged layout whose gather produces this payload (`None` for opaque payloads).
    pub fn paged(&self) -> Option<dynamo_kernels::kv_layout::PagedLayout> {
        (self.dtype != KvDtype::Opaque).then(|| dynamo_kernels::kv_layout::PagedLayout {
            layers: self.layers as usize,
            block_tokens: self.block_tokens as usize,
            kv_heads: self.kv_heads as usize,
            head_dim: self.head_dim as usize,
            elem_bytes: self.dtype.size_bytes(),
        })
    }

    /// Header plus payload.
    pub fn image_bytes(&self) -> usize {
        HEADER_LEN + self.payload_bytes()
    }

    fn encode(&self) -> [u8; 8] {
        let mut out = [0u8; 8];
        out[0..2].copy_from_slice(&self.layers.to_le_bytes());
        out[2..4].copy_from_slice(&self.kv_heads.to_le_bytes());
        out[4..6].copy_from_slice(&self.head_dim.to_le_bytes());
        out[6] = self.dtype as u8;
        out
    }
}

/// Splits an opaque byte count into two u16 factors (`layers × head_dim`) when possible.
fn try_split_opaque(bytes: usize) -> Option<(u16, u16)> {
    (1..=u16::MAX as usize)
        .find(|&layers| bytes.is_multiple_of(layers) && bytes / layers <= u16::MAX as usize)
        .map(|layers| (layers as u16, (bytes / layers) as u16))
}

fn split_opaque(bytes: usize) -> (u16, u16) {
    try_split_opaque(bytes).unwrap_or_else(|| {
        panic!(
            "opaque payload of {bytes} bytes cannot be described as layers × head_dim; see BlockLayout::opaque_at_most"
        )
    })
}

/// Retention metadata that travels with a block across tiers (DESIGN.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionMeta {
    /// Region of the block's tokens.
    pub region: RegionKind,
    /// Priority 0–100; higher is kept longer.
    pub priority: u8,
    /// Hold deadline in ms since the Unix epoch (0: none).
    pub retain_until_ms: u64,
    /// Last access in ms since the Unix epoch.
    pub last_access_ms: u64,
    /// Accesses so far.
    pub access_count: u32,
}

impl Default for RetentionMeta {
    fn default() -> Self {
        Self { region: RegionKind::Conversation, priority: 60, retain_until_ms: 0, last_access_ms: 0, access_count: 0 }
    }
}

/// The decoded header of a block image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageHeader {
    /// Identity of the block (and its prefix).
    pub hash: BlockHash,
    /// Identity of the previous block, `None` for a sequence's first block.
    pub parent: Option<BlockHash>,
    /// The salt the hash was computed under.
    pub salt: Salt,
    /// Shape of the payload.
    pub layout: BlockLayout,
    /// Tokens actually held (B for a complete block).
    pub token_count: u16,
    /// Retention metadata.
    pub retention: RetentionMeta,
    /// Payload length in bytes.
    pub payload_len: u64,
    /// xxh3-64 of the payload.
    pub payload_checksum: u64,
}

/// Why an image was rejected. Every variant means: do not hand this block to an engine.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The buffer is shorter than the header or than header + payload.
    #[error("image truncated: {have} bytes, need {need}")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes the header (or its payload length) requires.
        need: usize,
    },
    /// The magic bytes are wrong: not an image, or an empty slot.
    #[error("not a block image (bad magic)")]
    BadMagic,
    /// Written by a format this build does not read.
    #[error("unsupported image format version {0}")]
    UnsupportedVersion(u16),
    /// A header byte changed since the image was sealed.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// A header field holds a value no writer produces.
    #[error("malformed header field `{0}`")]
    Malformed(&'static str),
    /// The image is intact but names another block.
    #[error("block hash mismatch: expected {expected}, found {found}")]
    HashMismatch {
        /// The hash the reader asked for.
        expected: BlockHash,
        /// The hash in the header.
        found: BlockHash,
    },
    /// A payload byte changed since the image was sealed.
    #[error("payload checksum mismatch")]
    PayloadChecksum,
}

impl ImageError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ImageError::Truncated { .. } => "truncated",
            ImageError::BadMagic => "bad_magic",
            ImageError::UnsupportedVersion(_) => "version",
            ImageError::HeaderChecksum => "header_checksum",
            ImageError::Malformed(_) => "malformed",
            ImageError::HashMismatch { .. } => "hash_mismatch",
            ImageError::PayloadChecksum => "payload_checksum",
        }
    }
}

/// What a producer says about the block it seals; the checksum and lengths are computed by [`seal`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageSpec {
    /// Identity of the block.
    pub hash: BlockHash,
    /// Its parent, `None` for the first block of a sequence.
    pub parent: Option<BlockHash>,
    /// The salt the hash was computed under.
    pub salt: Salt,
    /// Payload shape.
    pub layout: BlockLayout,
    /// Tokens held.
    pub token_count: u16,
    /// Retention metadata.
    pub retention: RetentionMeta,
}

/// The payload area of an image buffer, for the producer to fill before [`seal`].
///
/// # Panics
/// If the buffer cannot hold the layout's image.
pub fn payload_mut<'a>(buf: &'a mut [u8], layout: &BlockLayout) -> &'a mut [u8] {
    let end = layout.image_bytes();
    assert!(buf.len() >= end, "buffer of {} bytes cannot hold a {end}-byte image", buf.len());
    &mut buf[HEADER_LEN..end]
}

/// Seals an image in place: checksums the payload already in `buf[HEADER_LEN..]` and writes the
/// header in front of it. Returns the header written.
///
/// # Panics
/// If the buffer cannot hold the layout's image.
pub fn seal(buf: &mut [u8], spec: &ImageSpec) -> ImageHeader {
    let payload = payload_mut(buf, &spec.layout);
    let header = ImageHeader {
        hash: spec.hash,
        parent: spec.parent,
        salt: spec.salt,
        layout: spec.layout,
        token_count: spec.token_count,
        retention: spec.retention,
        payload_len: payload.len() as u64,
        payload_checksum: payload_checksum(payload),
    };
    header.encode(&mut buf[..HEADER_LEN]);
    header
}

/// Verifies an image: magic, version, header checksum, the expected hash, and the payload checksum.
/// Only an image that passes is ever handed to an engine.
pub fn verify_image(buf: &[u8], expected: BlockHash) -> Result<ImageHeader, ImageError> {
    let header = ImageHeader::decode(buf)?;
    if header.hash != expected {
        return Err(ImageError::HashMismatch { expected, found: header.hash });
    }
    let end = HEADER_LEN + header.payload_len as usize;
    if payload_checksum(&buf[HEADER_LEN..end]) != header.payload_checksum {
        return Err(ImageError::PayloadChecksum);
    }
    Ok(header)
}

/// The checksum of an image's payload: xxh3-64. Every byte of every block goes through it when
/// an image is sealed and each time it is verified, so it is `twox-hash`'s, which picks AVX2 at
/// run time where the CPU has it (about 35 GB/s on a core of the dev machine, where a portable
/// build of `xxhash-rust` gives 22).
pub fn payload_checksum(payload: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(payload)
}

/// [`payload_checksum`] taken piece by piece, as a payload arrives.
#[derive(Clone, Default)]
pub struct PayloadChecksum(twox_hash::XxHash3_64);

impl PayloadChecksum {
    /// Adds the payload's next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(&mut self.0, bytes);
    }

    /// The checksum of every byte added.
    pub fn digest(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

impl std::fmt::Debug for PayloadChecksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadChecksum").finish_non_exhaustive()
    }
}

/// [`verify_image`] for an image whose payload checksum was taken as its bytes arrived
/// (`payload_xxh3`: the xxh3-64 of every byte of `buf` after the header), so the payload is not
/// read from memory again. An image whose header announces another length than `buf` holds is
/// verified the long way.
pub fn verify_image_digested(buf: &[u8], expected: BlockHash, payload_xxh3: u64) -> Result<ImageHeader, ImageError> {
    let header = ImageHeader::decode(buf)?;
    if header.hash != expected {
        return Err(ImageError::HashMismatch { expected, found: header.hash });
    }
    if header.image_bytes() != buf.len() {
        return verify_image(buf, expected);
    }
    if payload_xxh3 != header.payload_checksum {
        return Err(ImageError::PayloadChecksum);
    }
    Ok(header)
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn le_u128(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

impl ImageHeader {
    /// Image length: header plus payload.
    pub fn image_bytes(&self) -> usize {
        HEADER_LEN + self.payload_len as usize
    }

    /// Writes the header into `out[..HEADER_LEN]`, checksum last.
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..HEADER_LEN];
        out.fill(0);
        out[0..8].copy_from_slice(&MAGIC);
        out[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[10..12].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        let flags = if self.parent.is_some() { FLAG_HAS_PARENT } else { 0 };
        out[12..14].copy_from_slice(&flags.to_le_bytes());
        out[14] = self.retention.region.code();
        out[15] = self.retention.priority.min(100);
        out[16..32].copy_from_slice(&self.hash.to_le_bytes());
        out[32..48].copy_from_slice(&self.parent.unwrap_or_default().to_le_bytes());
        out[48..64].copy_from_slice(&self.salt.0.to_le_bytes());
        out[64..72].copy_from_slice(&self.layout.encode());
        out[72..74].copy_from_slice(&self.layout.block_tokens.to_le_bytes());
        out[74..76].copy_from_slice(&self.token_count.to_le_bytes());
        out[76] = CHECKSUM_XXH3_64;
        out[80..88].copy_from_slice(&self.payload_len.to_le_bytes());
        out[88..96].copy_from_slice(&self.payload_checksum.to_le_bytes());
        out[96..104].copy_from_slice(&self.retention.retain_until_ms.to_le_bytes());
        out[104..112].copy_from_slice(&self.retention.last_access_ms.to_le_bytes());
        out[112..116].copy_from_slice(&self.retention.access_count.to_le_bytes());
        let checksum = xxh3_64(&out[..120]);
        out[120..128].copy_from_slice(&checksum.to_le_bytes());
    }

    /// Decodes and checks a header (magic, version, header checksum, field sanity). It does not
    /// check the payload: that is [`verify_image`]'s job. `buf` must hold the whole image.
    pub fn decode(buf: &[u8]) -> Result<Self, ImageError> {
        let header = Self::decode_header_only(buf)?;
        let need = header.image_bytes();
        if buf.len() < need {
            return Err(ImageError::Truncated { have: buf.len(), need });
        }
        Ok(header)
    }

    /// Like [`ImageHeader::decode`] but needs only the first [`HEADER_LEN`] bytes: for scans that
    /// rebuild an index from headers without reading payloads.
    pub fn decode_header_only(buf: &[u8]) -> Result<Self, ImageError> {
        if buf.len() < HEADER_LEN {
            return Err(ImageError::Truncated { have: buf.len(), need: HEADER_LEN });
        }
        let b = &buf[..HEADER_LEN];
        if b[0..8] != MAGIC {
            return Err(ImageError::BadMagic);
        }
        let version = le_u16(b, 8);
        if version != FORMAT_VERSION {
            return Err(ImageError::UnsupportedVersion(version));
        }
        if xxh3_64(&b[..120]) != le_u64(b, 120) {
            return Err(ImageError::HeaderChecksum);
        }
        if le_u16(b, 10) as usize != HEADER_LEN {
            return Err(ImageError::Malformed("header length"));
        }
        let flags = le_u16(b, 12);
        if flags & !FLAG_HAS_PARENT != 0 {
            return Err(ImageError::Malformed("flags"));
        }
        let region = RegionKind::from_code(b[14]).ok_or(ImageError::Malformed("region"))?;
        let dtype = KvDtype::from_code(b[70]).ok_or(ImageError::Malformed("dtype"))?;
        if b[76] != CHECKSUM_XXH3_64 {
            return Err(ImageError::Malformed("checksum kind"));
        }
        let layout = BlockLayout {
            layers: le_u16(b, 64),
            kv_heads: le_u16(b, 66),
            head_dim: le_u16(b, 68),
            dtype,
            block_tokens: le_u16(b, 72),
        };
        let payload_len = le_u64(b, 80);
        if payload_len != layout.payload_bytes() as u64 {
            return Err(ImageError::Malformed("payload length"));
        }
        let parent = (flags & FLAG_HAS_PARENT != 0).then(|| BlockHash(le_u128(b, 32)));
        Ok(Self {
            hash: BlockHash(le_u128(b, 16)),
            parent,
            salt: Salt(le_u128(b, 48)),
            layout,
            token_count: le_u16(b, 74),
            retention: RetentionMeta {
                region,
                priority: b[15],
                retain_until_ms: le_u64(b, 96),
                last_access_ms: le_u64(b, 104),
                access_count: le_u32(b, 112),
            },
            payload_len,
            payload_checksum: le_u64(b, 88),
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn spec(payload: usize, parent: Option<BlockHash>) -> ImageSpec {
        ImageSpec {
            hash: BlockHash(0x1234_5678_9abc_def0_0fed_cba9_8765_4321),
            parent,
            salt: Salt(42),
            layout: BlockLayout::opaque(payload),
            token_count: 1,
            retention: RetentionMeta {
                region: RegionKind::ToolResult,
                priority: 50,
                retain_until_ms: 7,
                last_access_ms: 9,
                access_count: 3,
            },
        }
    }

    fn sealed(payload: &[u8], parent: Option<BlockHash>) -> (Vec<u8>, ImageSpec) {
        let s = spec(payload.len(), parent);
        let mut buf = vec![0u8; s.layout.image_bytes()];
        payload_mut(&mut buf, &s.layout).copy_from_slice(payload);
        seal(&mut buf, &s);
        (buf, s)
    }

    #[test]
    fn model_layout_matches_kv_bytes_per_token() {
        let shape = dynamo_config::ModelShape::named("llama-8b").expect("known shape");
        let layout = BlockLayout::for_model(&shape, dynamo_config::Dtype::Bf16, 32);
        assert_eq!(layout.payload_bytes(), 32 * 131_072);
        let paged = layout.paged().expect("a model layout is paged");
        assert_eq!(paged.payload_bytes(), layout.payload_bytes(), "the gather fills exactly one payload");
        assert_eq!(BlockLayout::opaque(4096).paged(), None);
    }

    #[test]
    fn payload_checksum_is_xxh3_64_whole_or_in_pieces() {
        // Images sealed before the checksum moved crates (G3 on disk, peers) must still verify.
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 16, 128, 240, 241, 1024, 4097, 65_536, 300_000] {
            let want = xxh3_64(&bytes[..len]);
            assert_eq!(payload_checksum(&bytes[..len]), want, "{len} bytes whole");
            for piece in [1, 7, 256, 4096, 65_536] {
                let mut sum = PayloadChecksum::default();
                bytes[..len].chunks(piece).for_each(|p| sum.update(p));
                assert_eq!(sum.digest(), want, "{len} bytes in pieces of {piece}");
            }
        }
    }

    #[test]
    fn a_digested_image_verifies_as_the_long_way_does() {
        let (buf, s) = sealed(&[9u8; 4096], None);
        let sum = payload_checksum(&buf[HEADER_LEN..]);
        assert!(verify_image_digested(&buf, s.hash, sum).is_ok());
        assert_eq!(verify_image_digested(&buf, s.hash, sum ^ 1), Err(ImageError::PayloadChecksum));
        assert!(matches!(
            verify_image_digested(&buf, BlockHash(s.hash.0 ^ 1), sum),
            Err(ImageError::HashMismatch { .. })
        ));
        // Bytes past the image: the digest covered them, so the image is checked the long way.
        let mut longer = buf.clone();
        longer.extend_from_slice(&[1, 2, 3]);
        let sum = payload_checksum(&longer[HEADER_LEN..]);
        assert!(verify_image_digested(&longer, s.hash, sum).is_ok());
        let mut flipped = buf.clone();
        flipped[HEADER_LEN + 100] ^= 4;
        let sum = payload_checksum(&flipped[HEADER_LEN..]);
        assert_eq!(verify_image_digested(&flipped, s.hash, sum), Err(ImageError::PayloadChecksum));
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let (buf, s) = sealed(&[5u8; 640], Some(BlockHash(99)));
        let h = verify_image(&buf, s.hash).expect("valid image");
        assert_eq!(h.parent, Some(BlockHash(99)));
        assert_eq!(h.salt, s.salt);
        assert_eq!(h.layout, s.layout);
        assert_eq!(h.retention, s.retention);
        assert_eq!(h.payload_len, 640);
        let (buf, s) = sealed(&[5u8; 64], None);
        assert_eq!(verify_image(&buf, s.hash).expect("valid").parent, None);
    }

    #[test]
    fn wrong_hash_and_empty_slot_are_rejected() {
        let (buf, s) = sealed(&[1u8; 64], None);
        assert!(matches!(verify_image(&buf, BlockHash(s.hash.0 ^ 1)), Err(ImageError::HashMismatch { .. })));
        assert_eq!(verify_image(&[0u8; 4096], s.hash), Err(ImageError::BadMagic));
        assert!(matches!(verify_image(&buf[..100], s.hash), Err(ImageError::Truncated { .. })));
        assert!(matches!(verify_image(&buf[..buf.len() - 1], s.hash), Err(ImageError::Truncated { .. })));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A flipped bit anywhere in an image — header or payload — is detected.
        #[test]
        fn any_flipped_bit_is_detected(
            payload in proptest::collection::vec(any::<u8>(), 64..1024),
            has_parent in any::<bool>(),
            bit_seed in any::<u64>(),
        ) {
            let len = payload.len() - payload.len() % 64;
            let (mut buf, s) = sealed(&payload[..len], has_parent.then_some(BlockHash(7)));
            prop_assert!(verify_image(&buf, s.hash).is_ok());
            let bit = (bit_seed % (buf.len() as u64 * 8)) as usize;
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(verify_image(&buf, s.hash).is_err(), "flip of bit {} went unnoticed", bit);
        }
    }

    #[test]
    fn every_single_bit_flip_of_a_small_image_is_detected() {
        let (buf, s) = sealed(&[0xA5u8; 64], Some(BlockHash(3)));
        for bit in 0..buf.len() * 8 {
            let mut copy = buf.clone();
            copy[bit / 8] ^= 1 << (bit % 8);
            assert!(verify_image(&copy, s.hash).is_err(), "flip of bit {bit} went unnoticed");
        }
    }
}
