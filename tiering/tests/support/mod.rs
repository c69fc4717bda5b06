//! What the G4 protocol tests share: resident blocks served from memory.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_tiering::block::BlockHash;
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
