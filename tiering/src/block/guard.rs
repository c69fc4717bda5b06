//! Keyed tags of the images the node keeps in memory that other processes can write: a G2 pool
//! shared with engines. An image's own checksums cannot tell the node's bytes from bytes an
//! engine wrote over them, since the engine can recompute them; a tag under a key only this
//! process holds (AEGIS-128X4's MAC, a fresh nonce per tag) can, and it is checked on every read.

use std::sync::atomic::{AtomicU64, Ordering};

use aegis::aegis128x4::Aegis128X4Mac;

/// The tag of one image, as [`ImageGuard::tag`] made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tag {
    nonce: u64,
    mac: [u8; 16],
}

/// This process's key for [`Tag`]s.
pub struct ImageGuard {
    key: [u8; 16],
    next: AtomicU64,
}

impl std::fmt::Debug for ImageGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageGuard").finish_non_exhaustive()
    }
}

impl ImageGuard {
    /// A guard with a random key (never written anywhere).
    pub fn new() -> std::io::Result<Self> {
        let mut key = [0u8; 16];
        getrandom::fill(&mut key).map_err(|e| std::io::Error::other(format!("no randomness for the G2 key: {e}")))?;
        Ok(Self { key, next: AtomicU64::new(1) })
    }

    fn mac(&self, nonce: u64, image: &[u8]) -> [u8; 16] {
        let mut n = [0u8; 16];
        n[..8].copy_from_slice(&nonce.to_le_bytes());
        let mut mac = Aegis128X4Mac::<16>::new_with_nonce(&self.key, &n);
        mac.update(image);
        mac.finalize()
    }

    /// The tag of `image` as it is now.
    pub fn tag(&self, image: &[u8]) -> Tag {
        let nonce = self.next.fetch_add(1, Ordering::Relaxed);
        Tag { nonce, mac: self.mac(nonce, image) }
    }

    /// Whether `image` is what `tag` was made of (compared in constant time).
    pub fn check(&self, image: &[u8], tag: &Tag) -> bool {
        let got = self.mac(tag.nonce, image);
        got.iter().zip(&tag.mac).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_holds_for_its_image_only() {
        let guard = ImageGuard::new().unwrap();
        let mut image = vec![7u8; 1 << 20];
        let tag = guard.tag(&image);
        assert!(guard.check(&image, &tag));
        image[123_456] ^= 1;
        assert!(!guard.check(&image, &tag), "a flipped bit");
        image[123_456] ^= 1;
        let other = ImageGuard::new().unwrap();
        assert!(!other.check(&image, &tag), "another key");
        assert_ne!(guard.tag(&image), tag, "a fresh nonce each time");
    }
}
