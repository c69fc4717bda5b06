//! What a KV block is: its identity ([`hash`]) and its self-describing byte form ([`image`]).

pub mod guard;
pub mod hash;
pub mod image;
pub mod map;

pub use hash::{BlockHash, BlockHasher, HASH_SCHEME_VERSION, Namespace, Salt, SaltInputs, SetDigest, TokenId};
pub use image::{
    BlockLayout, HEADER_LEN, ImageError, ImageHeader, ImageSpec, KvDtype, PayloadChecksum, RetentionMeta,
    payload_checksum, payload_mut, seal, verify_image, verify_image_digested,
};
pub use map::{BlockHashBuild, BlockMap};
