//! Splitting buffers into per-rank segments and pipeline chunks. Everything here
//! is pure arithmetic, property-tested: segments tile the buffer exactly, differ
//! in length by at most one element, and are the same on every rank.

use std::ops::Range;

/// Splits `count` elements into `n` contiguous segments whose lengths differ by at
/// most one (the first `count % n` get the extra element). `n` must be > 0.
pub fn partition(count: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let (base, extra) = (count / n, count % n);
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for i in 0..n {
        let len = base + usize::from(i < extra);
        out.push(start..start + len);
        start += len;
    }
    out
}

/// The segment of `rank` among `n` (same as `partition(count, n)[rank]`, without allocating).
pub fn segment(count: usize, n: usize, rank: usize) -> Range<usize> {
    let n = n.max(1);
    let (base, extra) = (count / n, count % n);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Scales an element range to a byte range.
pub fn bytes(r: &Range<usize>, esize: usize) -> Range<usize> {
    r.start * esize..r.end * esize
}

/// Splits `len` bytes into pipeline chunks of at most `chunk` bytes, each a
/// multiple of `align` except possibly the last; at least one (possibly empty) chunk.
pub fn chunks(len: usize, chunk: usize, align: usize) -> Vec<Range<usize>> {
    let align = align.max(1);
    let step = (chunk / align).max(1) * align;
    if len == 0 {
        return std::iter::once(0..0).collect();
    }
    (0..len).step_by(step).map(|s| s..(s + step).min(len)).collect()
}

/// Number of chunks [`chunks`] gives for `len` bytes with an 8-byte alignment.
pub fn chunk_count(len: usize, chunk: usize) -> usize {
    let step = (chunk / 8).max(1) * 8;
    len.div_ceil(step).max(1)
}

/// Chunk `i` of [`chunks`]`(len, chunk, 8)`, computed without allocating.
pub fn chunk_range(len: usize, chunk: usize, i: usize) -> Range<usize> {
    let step = (chunk / 8).max(1) * 8;
    (i * step).min(len)..((i + 1) * step).min(len)
}

/// Two disjoint views into one buffer: `a` to read, `b` to write.
pub fn split_pair(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn partition_tiles_exactly(count in 0usize..10_000, n in 1usize..64) {
            let p = partition(count, n);
            prop_assert_eq!(p.len(), n);
            prop_assert_eq!(p[0].start, 0);
            prop_assert_eq!(p[n - 1].end, count);
            for w in p.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let lens: Vec<usize> = p.iter().map(|r| r.len()).collect();
            let (mn, mx) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
            prop_assert!(mx - mn <= 1);
            for (i, r) in p.iter().enumerate() {
                prop_assert_eq!(segment(count, n, i), r.clone());
            }
        }

        #[test]
        fn chunks_cover_and_align(len in 0usize..1_000_000, chunk in 1usize..100_000, align in prop::sample::select(vec![1usize, 2, 4, 8])) {
            let c = chunks(len, chunk, align);
            prop_assert!(!c.is_empty());
            prop_assert_eq!(c[0].start, 0);
            prop_assert_eq!(c.last().map(|r| r.end), Some(len));
            for w in c.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
                prop_assert_eq!(w[0].len() % align, 0);
            }
        }

        #[test]
        fn chunk_arithmetic_matches_the_list(len in 0usize..1_000_000, chunk in 1usize..100_000) {
            let c = chunks(len, chunk, 8);
            prop_assert_eq!(chunk_count(len, chunk), c.len());
            for (i, r) in c.iter().enumerate() {
                prop_assert_eq!(chunk_range(len, chunk, i), r.clone());
            }
        }

        #[test]
        fn split_pair_gives_the_right_bytes(len in 2usize..200, x in 0usize..200, y in 0usize..200) {
            let buf0: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut buf = buf0.clone();
            let m = x % len;
            let (a, b) = if y % 2 == 0 { (0..m, m..len) } else { (m..len, 0..m) };
            let (ra, rb) = split_pair(&mut buf, a.clone(), b.clone());
            prop_assert_eq!(ra, &buf0[a]);
            prop_assert_eq!(rb.len(), b.len());
        }
    }
}
