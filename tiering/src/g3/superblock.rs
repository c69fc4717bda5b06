//! The first 4 KiB of every G3 file: what the rest of the file is.

use xxhash_rust::xxh3::xxh3_64;

/// Bytes reserved for the superblock; slots start here.
pub const SUPERBLOCK_LEN: u64 = 4096;
const MAGIC: [u8; 8] = *b"DYNKVG3S";
const VERSION: u32 = 1;

/// The superblock's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in this file.
    pub slots: u64,
    /// Index of this file in the store.
    pub file_index: u32,
}

impl Superblock {
    /// Encodes into a 4 KiB buffer (the rest zeroed).
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..SUPERBLOCK_LEN as usize];
        out.fill(0);
        out[0..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.file_index.to_le_bytes());
        out[16..24].copy_from_slice(&self.slot_bytes.to_le_bytes());
        out[24..32].copy_from_slice(&self.slots.to_le_bytes());
        let sum = xxh3_64(&out[..32]);
        out[32..40].copy_from_slice(&sum.to_le_bytes());
    }

    /// Decodes, or `None` when the bytes are not a valid superblock of this version.
    pub fn decode(buf: &[u8]) -> Option<Self> {
        if buf.len() < 40 || buf[0..8] != MAGIC {
            return None;
        }
        let u64_at = |at: usize| u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
        if u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")) != VERSION || xxh3_64(&buf[..32]) != u64_at(32) {
            return None;
        }
        Some(Self {
            file_index: u32::from_le_bytes(buf[12..16].try_into().expect("4 bytes")),
            slot_bytes: u64_at(16),
            slots: u64_at(24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let sb = Superblock { slot_bytes: 1 << 20, slots: 77, file_index: 3 };
        let mut buf = vec![0u8; 4096];
        sb.encode(&mut buf);
        assert_eq!(Superblock::decode(&buf), Some(sb));
        buf[20] ^= 4;
        assert_eq!(Superblock::decode(&buf), None);
        assert_eq!(Superblock::decode(&[0u8; 4096]), None);
    }
}
