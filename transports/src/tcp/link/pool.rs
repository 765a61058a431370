//! The buffer pool: large frame buffers kept for reuse, shared by a group's readers and
//! senders.
//!
//! Why it exists: the allocator hands large blocks back to the kernel, so without a pool every
//! large chunk would land in fresh pages, and the page faults of a large collective can cost
//! more than its copies. See [`BufferPool`] for how it reserves ahead and what it keeps.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::tcp::tunables::{POOL_DEFAULT_LIMIT, POOL_MIN_BUFFER};

/// Large frame buffers for reuse, shared by a group's readers (payloads of large frames) and
/// senders (the part of a chunk the socket did not take, queued for the writer).
///
/// Without it a rank would map fresh pages for chunks (the allocator hands large blocks back
/// to the kernel), and the page faults of a large collective can cost more than its copies.
/// Keeping what is given back is not enough either: the buffers a rank needs at once peak when
/// a peer that started a collective first sends its part before this rank has started it (each
/// chunk waits in a buffer until then), and every new peak would map and zero fresh pages in
/// the middle of a collective, which is slow where the host backs new memory slowly. So a
/// collective that receives large chunks first [`reserves`](BufferPool::reserve) buffers for
/// what it receives, made and touched at once, and the pool keeps what is given back while it holds
/// at most [`TcpOptions::buffer_pool_bytes`](crate::tcp::TcpOptions::buffer_pool_bytes) (kept and out
/// in frames together); only buffers past that go back to the allocator.
///
/// Buffers below [`BufferPool::MIN`] are not kept.
#[derive(Clone, Debug)]
pub(crate) struct BufferPool(Arc<Mutex<PoolState>>);

#[derive(Debug)]
struct PoolState {
    /// Buffers given back; the one given back last at the end.
    kept: Vec<Vec<u8>>,
    /// Capacity of `kept`, summed.
    kept_bytes: usize,
    /// Capacity of the buffers handed out and not given back yet (made here or kept).
    out_bytes: usize,
    /// `kept_bytes + out_bytes` stays at most this, but while more are out at once.
    limit: usize,
    /// Capacity of a new buffer: at least the largest chunk reserved for, so that every kept
    /// buffer fits every chunk.
    size: usize,
}

impl PoolState {
    /// Bytes missing for `total` bytes in chunks of `chunk` (`None` if nothing is, or chunks
    /// this small or this large are not pooled).
    fn missing(&self, total: usize, chunk: usize) -> Option<usize> {
        if chunk < BufferPool::MIN || chunk > self.limit {
            return None;
        }
        let missing = total.min(self.limit).saturating_sub(self.kept_bytes + self.out_bytes);
        (missing > 0).then_some(missing)
    }
}

impl Default for BufferPool {
    fn default() -> Self {
        BufferPool::with_limit(BufferPool::DEFAULT_LIMIT)
    }
}

impl BufferPool {
    /// Smallest buffer worth keeping ([`POOL_MIN_BUFFER`]).
    pub(crate) const MIN: usize = POOL_MIN_BUFFER;
    /// Bytes a pool holds at most unless told otherwise ([`POOL_DEFAULT_LIMIT`]).
    pub(crate) const DEFAULT_LIMIT: usize = POOL_DEFAULT_LIMIT;

    /// A pool that holds at most `limit` bytes of buffers (0: it keeps nothing).
    pub(crate) fn with_limit(limit: usize) -> Self {
        let state = PoolState { kept: Vec::new(), kept_bytes: 0, out_bytes: 0, limit, size: 0 };
        BufferPool(Arc::new(Mutex::new(state)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of `len` bytes, for a read to fill: a kept one when it is large enough (its old
    /// bytes are left in place, not cleared: the caller overwrites every one before using it),
    /// else a fresh zeroed one.
    pub(crate) fn take(&self, len: usize) -> Result<Vec<u8>, std::collections::TryReserveError> {
        let mut v = self.lend(len);
        if v.len() >= len {
            v.truncate(len);
            return Ok(v);
        }
        v.try_reserve_exact(len - v.len())?;
        v.resize(len, 0);
        Ok(v)
    }

    /// A buffer with room for `len` bytes, its contents as they were: the kept one given back
    /// last that has the room (likeliest still in cache), else a new one of at least the
    /// pool's buffer size. Below [`BufferPool::MIN`], a new empty one that the
    /// pool does not count.
    fn lend(&self, len: usize) -> Vec<u8> {
        if len < Self::MIN {
            return Vec::new();
        }
        let mut st = self.lock();
        if let Some(i) = st.kept.iter().rposition(|b| b.capacity() >= len) {
            let v = st.kept.swap_remove(i);
            st.kept_bytes -= v.capacity();
            st.out_bytes += v.capacity();
            return v;
        }
        let size = len.max(st.size);
        drop(st);
        let mut v = Vec::new();
        if v.try_reserve_exact(size).is_ok() {
            self.lock().out_bytes += v.capacity();
        }
        v
    }

    /// Keep `buf` for a later [`BufferPool::take`], if it is large and the pool's limit allows.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap < Self::MIN {
            return;
        }
        let mut st = self.lock();
        st.out_bytes = st.out_bytes.saturating_sub(cap);
        if st.kept_bytes + st.out_bytes + cap <= st.limit {
            st.kept.push(buf);
            st.kept_bytes += cap;
        } else {
            drop(st);
            drop(buf);
        }
    }

    /// Before a collective that receives `total` bytes in chunks of up to `chunk` bytes: make
    /// sure the pool holds buffers of at least `chunk` bytes for all of it, up to its limit,
    /// making the missing ones now and writing every page of them, so that no chunk of this
    /// collective or of later ones of its size waits for the kernel to map memory. Does
    /// nothing for chunks below [`BufferPool::MIN`] (they are not pooled), and nothing once
    /// the pool holds that much; a failed allocation just stops it (the rest are then made on
    /// demand).
    pub(crate) fn reserve(&self, total: usize, chunk: usize) {
        let (size, missing) = {
            let mut st = self.lock();
            let Some(missing) = st.missing(total, chunk) else { return };
            st.size = st.size.max(chunk);
            (st.size, missing.div_ceil(st.size))
        };
        let mut made = Vec::with_capacity(missing);
        for _ in 0..missing {
            let mut v = Vec::new();
            if v.try_reserve_exact(size).is_err() {
                break;
            }
            // Written, not just allocated: a zeroed allocation may be fresh pages, mapped on
            // first touch, which is the cost this avoids.
            v.resize(size, 0);
            made.push(v);
        }
        let mut st = self.lock();
        let room = st.limit.saturating_sub(st.kept_bytes + st.out_bytes);
        made.truncate(room / size);
        st.kept_bytes += made.iter().map(Vec::capacity).sum::<usize>();
        // Cold: handed out after the buffers given back, which are likelier in cache.
        st.kept.splice(0..0, made);
    }

    /// Whether [`BufferPool::reserve`] with these arguments would make buffers now (a cheap
    /// check, for a caller that reserves later, with no other lock held).
    pub(crate) fn needs_reserve(&self, total: usize, chunk: usize) -> bool {
        chunk >= Self::MIN && self.lock().missing(total, chunk).is_some()
    }

    /// Bytes of buffers the pool holds: kept, and out in frames.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        let st = self.lock();
        st.kept_bytes + st.out_bytes
    }

    /// `bytes` copied into a buffer that returns to this pool once written and dropped.
    pub(crate) fn bytes(&self, bytes: &[u8]) -> Bytes {
        if bytes.len() < Self::MIN {
            return Bytes::copy_from_slice(bytes);
        }
        let mut v = self.lend(bytes.len());
        v.clear();
        if v.try_reserve_exact(bytes.len()).is_err() {
            self.give(v);
            return Bytes::copy_from_slice(bytes);
        }
        v.extend_from_slice(bytes);
        Bytes::from_owner(Pooled { buf: v, pool: self.clone() })
    }
}

/// A pooled buffer lent to a [`Bytes`]; goes back to its pool when dropped.
struct Pooled {
    buf: Vec<u8>,
    pool: BufferPool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl BufferPool {
        /// (buffers kept, bytes kept, bytes out)
        fn counts(&self) -> (usize, usize, usize) {
            let st = self.lock();
            (st.kept.len(), st.kept_bytes, st.out_bytes)
        }
    }

    #[test]
    fn large_buffers_are_reused_and_small_ones_are_not_kept() {
        let pool = BufferPool::default();
        let mut a = pool.take(BufferPool::MIN).unwrap();
        a[0] = 7;
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(BufferPool::MIN - 1).unwrap();
        assert_eq!(b.len(), BufferPool::MIN - 1);
        assert!(b.iter().all(|&x| x == 0), "a small take is fresh and zeroed");
        let c = pool.take(BufferPool::MIN).unwrap();
        assert_eq!(c.as_ptr(), ptr, "the kept buffer comes back");
        assert_eq!((c.len(), c[0]), (BufferPool::MIN, 7), "as it was: a read overwrites it");
        assert_eq!(pool.counts(), (0, 0, BufferPool::MIN), "it is out");
        pool.give(b);
        assert_eq!(pool.counts().0, 0, "small buffers are not kept");
        pool.give(c);
        assert_eq!(pool.counts(), (1, BufferPool::MIN, 0));
        // A pooled Bytes returns its buffer when the last handle drops.
        let payload = vec![3u8; BufferPool::MIN];
        let bytes = pool.bytes(&payload);
        assert_eq!(&bytes[..], &payload[..]);
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(pool.counts(), (0, 0, BufferPool::MIN));
        drop(clone);
        assert_eq!(pool.counts(), (1, BufferPool::MIN, 0));
    }

    #[test]
    fn a_pool_holds_at_most_its_limit_kept_and_out_together() {
        let pool = BufferPool::with_limit(3 * BufferPool::MIN);
        let out: Vec<Vec<u8>> = (0..5).map(|_| pool.take(BufferPool::MIN).unwrap()).collect();
        assert_eq!(pool.counts(), (0, 0, 5 * BufferPool::MIN), "a peak above the limit is served");
        for b in out {
            pool.give(b);
        }
        assert_eq!(pool.counts(), (3, 3 * BufferPool::MIN, 0), "and shrinks back to the limit");
        let none = BufferPool::with_limit(0);
        none.give(none.take(BufferPool::MIN).unwrap());
        assert_eq!(none.counts(), (0, 0, 0), "a limit of 0 keeps nothing");
    }

    #[test]
    fn reserve_makes_buffers_for_a_collective_up_to_the_limit_once() {
        let chunk = 2 * BufferPool::MIN;
        let pool = BufferPool::with_limit(10 * chunk);
        pool.reserve(4 * chunk + 1, chunk);
        assert_eq!(pool.counts(), (5, 5 * chunk, 0), "rounded up to whole buffers");
        {
            let st = pool.lock();
            assert!(st.kept.iter().all(|b| b.capacity() >= chunk && b.len() == chunk), "written, not just allocated");
        }
        pool.reserve(4 * chunk, chunk);
        assert_eq!(pool.counts().0, 5, "nothing more once it holds that much");
        // Buffers out count as held.
        let taken: Vec<Vec<u8>> = (0..5).map(|_| pool.take(chunk).unwrap()).collect();
        pool.reserve(6 * chunk, chunk);
        assert_eq!(pool.counts(), (1, chunk, 5 * chunk));
        drop(taken); // lost, not given back: the pool still counts them out
        pool.reserve(100 * chunk, chunk);
        assert_eq!(pool.counts(), (5, 5 * chunk, 5 * chunk), "never past the limit");
        // New buffers are made at the reserved size, so any kept one fits any chunk.
        let small = BufferPool::with_limit(10 * chunk);
        small.reserve(chunk, chunk);
        let b = small.take(chunk).unwrap();
        let c = small.take(BufferPool::MIN).unwrap();
        assert!(c.capacity() >= chunk, "a fresh buffer has the reserved size");
        drop((b, c));
        // Nothing for small chunks or chunks past the limit.
        let p = BufferPool::with_limit(chunk);
        p.reserve(10 * chunk, BufferPool::MIN - 1);
        p.reserve(10 * chunk, 2 * chunk);
        assert_eq!(p.counts(), (0, 0, 0));
    }
}
