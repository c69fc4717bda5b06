//! One reader of little-endian wire fields for both of the node's codecs — the engine endpoint's
//! frames ([`crate::foreign`]) and G4's ([`crate::g4::wire`]). Every read is bounds-checked, and
//! a count is checked against its limit and against the bytes present before anything is
//! allocated for its items, so no frame can make a decoder panic or allocate past what it sent.
//! Each codec turns a [`ReadError`] into its own error, naming the field it was reading.

/// Why a field could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// The field needs `needed` bytes and only `left` remain (for a count: its items' bytes).
    Short {
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the buffer.
        left: usize,
    },
    /// A length or count above its limit.
    TooMany {
        /// What was sent.
        n: u64,
        /// The limit.
        max: u64,
    },
    /// Text that is not UTF-8.
    NotUtf8,
    /// Bytes after the last field.
    Trailing(usize),
}

/// Reads fields off the front of a buffer.
#[derive(Debug)]
pub struct ByteReader<'a> {
    rest: &'a [u8],
}

impl<'a> ByteReader<'a> {
    /// A reader of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { rest: buf }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        if self.rest.len() < n {
            return Err(ReadError::Short { needed: n, left: self.rest.len() });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    /// A byte.
    pub fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.array::<1>()?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, ReadError> {
        self.array().map(u16::from_le_bytes)
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, ReadError> {
        self.array().map(u32::from_le_bytes)
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, ReadError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A little-endian `u128`.
    pub fn u128(&mut self) -> Result<u128, ReadError> {
        self.array().map(u128::from_le_bytes)
    }

    /// UTF-8 text after its `u16` length, at most `max` bytes long.
    pub fn str16(&mut self, max: usize) -> Result<String, ReadError> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(ReadError::TooMany { n: len as u64, max: max as u64 });
        }
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| ReadError::NotUtf8)
    }

    /// A `u32` count of items at least `item_len` bytes long: at most `max`, and no more than the
    /// bytes left can hold (checked before the caller allocates for them).
    pub fn count32(&mut self, item_len: usize, max: u64) -> Result<usize, ReadError> {
        let n = self.u32()?;
        if u64::from(n) > max {
            return Err(ReadError::TooMany { n: n.into(), max });
        }
        let needed = (n as usize).saturating_mul(item_len);
        if needed > self.rest.len() {
            return Err(ReadError::Short { needed, left: self.rest.len() });
        }
        Ok(n as usize)
    }

    /// The end: an error if bytes are left.
    pub fn finish(self) -> Result<(), ReadError> {
        if self.rest.is_empty() { Ok(()) } else { Err(ReadError::Trailing(self.rest.len())) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_in_order_and_every_overrun_is_an_error() {
        let mut buf = vec![7u8];
        buf.extend_from_slice(&0x0102u16.to_le_bytes());
        buf.extend_from_slice(&0x0304_0506u32.to_le_bytes());
        buf.extend_from_slice(&u64::MAX.to_le_bytes());
        buf.extend_from_slice(&2u16.to_le_bytes());
        buf.extend_from_slice(b"hi");
        let mut r = ByteReader::new(&buf);
        assert_eq!((r.u8(), r.u16(), r.u32(), r.u64()), (Ok(7), Ok(0x0102), Ok(0x0304_0506), Ok(u64::MAX)));
        assert_eq!(r.str16(2).as_deref(), Ok("hi"));
        assert_eq!(r.u8(), Err(ReadError::Short { needed: 1, left: 0 }));
        assert_eq!(ByteReader::new(&buf).finish(), Err(ReadError::Trailing(buf.len())));
        assert_eq!(ByteReader::new(&[]).finish(), Ok(()));
    }

    #[test]
    fn lengths_and_counts_are_checked_before_anything_is_allocated() {
        let mut text = 3u16.to_le_bytes().to_vec();
        text.extend_from_slice(&[0xff, 0xfe, 0xfd]);
        assert_eq!(ByteReader::new(&text).str16(2), Err(ReadError::TooMany { n: 3, max: 2 }));
        assert_eq!(ByteReader::new(&text).str16(3), Err(ReadError::NotUtf8));
        let huge = u32::MAX.to_le_bytes();
        assert_eq!(ByteReader::new(&huge).count32(16, 1000), Err(ReadError::TooMany { n: u32::MAX.into(), max: 1000 }));
        let mut two = 2u32.to_le_bytes().to_vec();
        two.extend_from_slice(&[0; 31]);
        assert_eq!(ByteReader::new(&two).count32(16, 100), Err(ReadError::Short { needed: 32, left: 31 }));
        two.push(0);
        assert_eq!(ByteReader::new(&two).count32(16, 100), Ok(2));
    }
}
