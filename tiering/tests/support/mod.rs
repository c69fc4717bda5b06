//! What the G4 protocol tests share: resident blocks served from memory.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, seal};
use dynamo_tiering::g4::auth::PeerIdentity;
use dynamo_tiering::g4::tcp::BlockSource;

/// Resident blocks: hash → sealed image.
#[derive(Default)]
pub(crate) struct Blocks(pub(crate) HashMap<BlockHash, Arc<Vec<u8>>>);

/// A resident image, as a hold keeps it.
#[derive(Clone)]
pub(crate) struct Image(Arc<Vec<u8>>);

impl AsRef<[u8]> for Image {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl BlockSource for Blocks {
    type Handle = Image;
    fn resolve(&self, hash: BlockHash) -> Option<Image> {
        self.0.get(&hash).cloned().map(Image)
    }
}

/// The sealed image of block `hash` with a payload of `payload` bytes, byte `i` of which is
/// `fill(i)`.
pub(crate) fn sealed_with(hash: u128, payload: usize, fill: impl Fn(usize) -> u8) -> Vec<u8> {
    let mut buf = vec![0u8; HEADER_LEN + payload];
    for (i, b) in buf[HEADER_LEN..].iter_mut().enumerate() {
        *b = fill(i);
    }
    let spec = ImageSpec {
        hash: BlockHash(hash),
        parent: None,
        salt: Salt(0),
        layout: BlockLayout::opaque(payload),
        token_count: 1,
        retention: RetentionMeta::default(),
    };
    seal(&mut buf, &spec);
    buf
}

/// A node of the test cluster.
pub(crate) fn identity(node: &str) -> PeerIdentity {
    PeerIdentity { cluster: "test".into(), node: node.into(), epoch: 1 }
}
