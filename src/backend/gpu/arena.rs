//! One call's device memory as one allocation (issue 32, bench/NOTES.md v21). A case of at
//! most 17 tokens moves a few kilobytes, so what a run costs the host is the number of driver
//! calls, not the bytes: a buffer each took an allocation, a copy and a free (about twenty
//! per forward and backward). Here the outputs (with their guard bands and poison) come
//! first and the inputs after them, each segment on a 256-byte boundary like an allocation of
//! its own; the call uploads the whole once and downloads the outputs' prefix once.

use crate::backend::DevBuf;

/// Where every segment starts: a device allocation's alignment, so a tensor starts where the
/// kernels' 16-byte vector accesses and the guard bands expect it, as in a buffer of its own.
pub(crate) const ALIGN: usize = 256;

/// The host image of one call's allocation.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    bytes: Vec<u8>,
}

impl Arena {
    /// Appends `b` at the next boundary; returns its offset.
    pub(crate) fn push(&mut self, b: &[u8]) -> usize {
        let at = self.bytes.len().next_multiple_of(ALIGN);
        self.bytes.resize(at, 0);
        self.bytes.extend_from_slice(b);
        at
    }

    /// Appends a guarded buffer whole (guards and poison included); returns where it starts.
    pub(crate) fn push_buf(&mut self, buf: &DevBuf) -> usize {
        self.push(super::host::bytes_of(&buf.data))
    }

    /// Bytes so far.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// The image to upload.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// The device address of `buf`'s body, pushed at `at` of an allocation at `base`.
pub(crate) fn body_addr(base: u64, at: usize, buf: &DevBuf) -> u64 {
    base + (at + buf.base * 4) as u64
}

/// Copies back a guarded buffer pushed at `at` from the downloaded prefix `host`.
pub(crate) fn unpack(host: &[u8], at: usize, buf: &mut DevBuf) {
    let dst = super::host::bytes_of_mut(&mut buf.data);
    let n = dst.len();
    dst.copy_from_slice(&host[at..at + n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_start_on_boundaries_and_come_back_whole() {
        let mut a = Arena::default();
        let mut o = DevBuf::new(5, 0.0);
        o.data
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as f32);
        let o_at = a.push_buf(&o);
        let odd = a.push(&[1, 2, 3]);
        let empty = a.push(&[]);
        let after = a.push(&[9]);
        assert_eq!(o_at, 0);
        for at in [odd, empty, after] {
            assert_eq!(at % ALIGN, 0, "{at}");
        }
        assert!(odd >= o.data.len() * 4 && empty > odd && after >= empty);
        assert_eq!(&a.bytes()[odd..odd + 3], &[1, 2, 3]);
        assert_eq!(body_addr(0x1000, o_at, &o), 0x1000 + (o.base * 4) as u64);
        // The body of a guarded buffer is as aligned as in an allocation of its own.
        assert_eq!(body_addr(0, after, &o) % 16, 0);
        let mut back = DevBuf::new(5, 0.0);
        unpack(a.bytes(), o_at, &mut back);
        assert_eq!(back.data, o.data);
    }
}
