//! The shared-memory segment two ranks of one host exchange frames through: its layout, its
//! header, the offer that agrees on it, and the two byte rings it holds.
//!
//! # Why here
//!
//! The transport maps the segment and moves the frames; everything a peer could corrupt is
//! read here, bounds-checked, and fuzzed (`fuzz/fuzz_targets/shm_ring.rs`). The peer's process
//! writes this memory while we read it, so nothing in it is trusted: a ring position that
//! breaks the ring's invariant is an error ([`ShmError::Corrupt`]) naming what was wrong, never
//! an out-of-bounds access or a panic.
//!
//! # Layout
//!
//! ```text
//! 0      segment header, 64 bytes: magic "CoSHMv2\0", nonce u64, capacity u64,
//!        creator rank u32, acceptor rank u32, group u32, zeros
//! 64     ring 0 (creator → acceptor): control block, 256 bytes, then the box, 1,024 bytes,
//!        then `capacity` data bytes
//! 64 + 1280 + capacity
//!        ring 1 (acceptor → creator): the same
//! ```
//!
//! A control block has four cache lines, so that the two sides never write the same line:
//! `tail` (ring bytes ever written, the producer's), `head` (ring bytes ever read) and
//! `box_head` (box entries ever read), both the consumer's, `want_data` (the consumer sleeps
//! and wants a doorbell) with `sleep_barrier` and `poller_core` on its line (see below), and
//! `want_space` (the producer waits for room and wants a doorbell). Positions only grow; a
//! byte at position `p` lives at `p mod capacity`.
//!
//! `poller_core` is the core the consumer's waiting thread last ran on, plus one (0: unknown,
//! or the thread sleeps): two ranks of a pair whose waiting threads share one core take turns
//! on it while another core may idle, and this word tells each which core the other's is on
//! ([`Segment::poller_core`]). It is a hint and nothing more: whatever a peer writes there is
//! only compared with a core number.
//!
//! # The box: small writes on one cache line
//!
//! A reader that waits for the ring's bytes pulls two cache lines from the writer's core: the
//! writer's position, then the bytes. A small frame (a scalar allreduce's is 44 bytes) can
//! come in one: the box is 16 slots of one line each, and a write of at most [`BOX_BYTES`]
//! goes into the next slot when one is free. A slot holds a stamp (the entry's count plus
//! one, as 32 bits, stored last), the length, the ring position the entry stands at (the
//! writer's `tail` when it wrote it) and the bytes. Both ends still see one ordered stream of
//! bytes: an entry standing at position `p` comes after the ring's bytes before `p` and before
//! those from `p` on. The reader reads `tail` first and the next slot's stamp second, so a
//! slot it does not see yet stands at or after the `tail` it read; `tail` does not change
//! while only small writes go, and a reader spinning on it reads its own cache. A slot's
//! stale stamp is always an older count's (slots are written in turn), never the one awaited.
//!
//! # Warming the next slot
//!
//! A slot the reader has read is in its cache as well as the writer's, so the writer's next
//! store to it waits for the reader's copy to be given up, and a sender that then fences (the
//! doorbell's check, below) waits that long before it goes on. [`Warmer::warm`] asks the
//! writer's cache for the line of its next entry, for writing, ahead of the write. When to ask
//! is the caller's choice and matters: the reader's hardware prefetcher takes the line after a
//! slot it reads, so a request made right after a write is undone by the read that follows it.
//! The transport asks when it has taken the peer's part of an exchange, which the peer sent
//! before it looked for this side's: it has read that by then, or is reading it
//! (`docs/performance.md`). The reader, for its part, asks for its next slot's line
//! ([`Consumer::prefetch_next`]) just before it starts to look for an entry it expects written
//! by then: the line is on its way while the wait sets up.
//!
//! # Doorbells
//!
//! A side that goes to sleep sets its flag, then looks at the ring once more (with a full
//! fence between, as the other side has between publishing and looking at the flag), so
//! either it sees the new bytes or the other side sees the flag and rings: a wake-up is never
//! lost. The transport rings over the pair's TCP connection, which it keeps open for that and
//! as the liveness channel (a dead peer's socket reads EOF).
//!
//! The writer's fence is on every write's path, and it waits there for the write to reach
//! its line, whose last copy is in the reader's cache: on a small exchange's path, a wait of
//! a line's trip between cores at every send (`docs/performance.md`, "The send's fences").
//! So the fence may move to the sleeper, which is slow anyway: a reader that announces a
//! barrier ([`Consumer::set_sleep_barrier`], the `sleep_barrier` word beside `want_data`)
//! runs one between its flag and its look that makes every running thread of the writer's
//! process execute a full fence (Linux's `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`; a
//! thread not running has fenced when it was switched out). The writer's look at the flag,
//! then, is either before that fence point, and its write was visible by then (the reader's
//! look sees it), or after it, and it sees the flag. A writer whose process does not take
//! part ([`Producer::set_in_barriers`]) keeps its fence.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, compiler_fence, fence};

use crate::work::{GroupId, Rank};

/// Size of the segment header in bytes.
pub const HEADER_LEN: usize = 64;
/// Size of a ring's control block in bytes.
pub const CONTROL_LEN: usize = 256;
/// Slots in a ring's box.
pub const BOX_SLOTS: u64 = 16;
/// Size of a ring's box in bytes: one cache line a slot.
pub const BOX_LEN: usize = BOX_SLOTS as usize * SLOT_LEN;
/// The most bytes one box entry holds: a write of at most this many may go into the box.
pub const BOX_BYTES: usize = SLOT_LEN - SLOT_BYTES;
/// The segment header's first eight bytes.
pub const SEGMENT_MAGIC: [u8; 8] = *b"CoSHMv2\0";
/// The smallest ring capacity accepted (bytes).
pub const MIN_CAPACITY: u64 = 4096;
/// The largest ring capacity accepted (bytes): a hostile offer cannot make a peer map more.
pub const MAX_CAPACITY: u64 = 1 << 30;

const TAIL: usize = 0;
const HEAD: usize = 64;
const BOX_HEAD: usize = 72;
const WANT_DATA: usize = 128;
const SLEEP_BARRIER: usize = 132;
const POLLER_CORE: usize = 136;
const WANT_SPACE: usize = 192;

/// A box slot: the stamp (u32) at 0, the length (u32) at 4, the ring position (u64) at 8,
/// the bytes from [`SLOT_BYTES`].
const SLOT_LEN: usize = 64;
const SLOT_LEN_AT: usize = 4;
const SLOT_POS_AT: usize = 8;
const SLOT_BYTES: usize = 16;

/// Why a segment, a ring or an offer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A ring's capacity is not a power of two between [`MIN_CAPACITY`] and [`MAX_CAPACITY`].
    #[error("ring capacity {0} is not a power of two from {MIN_CAPACITY} to {MAX_CAPACITY}")]
    BadCapacity(u64),
    /// The mapping is not the size the capacity needs, or not aligned to 64 bytes.
    #[error(
        "segment of {len} bytes at alignment {align} does not fit capacity {capacity} ({needed} bytes, 64-aligned)"
    )]
    BadMapping {
        /// Its length.
        len: usize,
        /// The largest power of two (up to 64) its address is a multiple of.
        align: usize,
        /// The capacity it was asked to hold.
        capacity: u64,
        /// The length that capacity needs.
        needed: usize,
    },
    /// The segment header is not what the offer described.
    #[error("segment header mismatch: {0}")]
    Header(String),
    /// A ring position the peer wrote breaks the ring's invariant.
    #[error("shared ring corrupt: {0}")]
    Corrupt(String),
    /// A malformed offer or answer.
    #[error("malformed shared-memory offer: {0}")]
    Offer(String),
}

/// The segment's size for rings of `capacity` bytes.
pub fn segment_len(capacity: u64) -> Result<usize, ShmError> {
    check_capacity(capacity)?;
    Ok(HEADER_LEN + 2 * (CONTROL_LEN + BOX_LEN + capacity as usize))
}

fn check_capacity(capacity: u64) -> Result<(), ShmError> {
    if capacity.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        Ok(())
    } else {
        Err(ShmError::BadCapacity(capacity))
    }
}

/// What the segment header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// A random number the offer carries too: the segment opened is the one offered.
    pub nonce: u64,
    /// Each ring's capacity in bytes.
    pub capacity: u64,
    /// The rank that created the segment (it writes ring 0).
    pub creator: Rank,
    /// The rank that accepted it (it writes ring 1).
    pub acceptor: Rank,
    /// The group the pair's connection serves.
    pub group: GroupId,
}

impl SegmentHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..8].copy_from_slice(&SEGMENT_MAGIC);
        out[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        out[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        out[24..28].copy_from_slice(&self.creator.0.to_le_bytes());
        out[28..32].copy_from_slice(&self.acceptor.0.to_le_bytes());
        out[32..36].copy_from_slice(&self.group.0.to_le_bytes());
        out
    }

    /// Decodes a header. Total: a bad magic, a bad capacity or non-zero padding is an error.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<SegmentHeader, ShmError> {
        if bytes[0..8] != SEGMENT_MAGIC {
            return Err(ShmError::Header(format!("bad magic {:02x?}", &bytes[0..8])));
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        if let Some(i) = (36..HEADER_LEN).find(|&i| bytes[i] != 0) {
            return Err(ShmError::Header(format!("padding byte {i} is {:#04x}, not zero", bytes[i])));
        }
        let capacity = u64_at(16);
        check_capacity(capacity)?;
        Ok(SegmentHeader {
            nonce: u64_at(8),
            capacity,
            creator: Rank(u32_at(24)),
            acceptor: Rank(u32_at(28)),
            group: GroupId(u32_at(32)),
        })
    }
}

/// Which ring of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Ring 0: the creator writes, the acceptor reads.
    FromCreator,
    /// Ring 1: the acceptor writes, the creator reads.
    FromAcceptor,
}

/// A mapped segment: memory of [`segment_len`] bytes, and whatever keeps it mapped.
#[derive(Clone)]
pub struct Segment {
    base: NonNull<u8>,
    capacity: u64,
    /// Keeps the memory alive (the transport's mapping, or a heap allocation).
    _owner: Arc<dyn Send + Sync>,
}

// SAFETY: the segment's memory is only touched through atomics (positions and flags) and
// through copies of byte ranges that the ring's positions hand to one side at a time; `owner`
// is Send + Sync and keeps the memory alive.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("base", &self.base).field("capacity", &self.capacity).finish()
    }
}

impl Segment {
    /// A view of `len` bytes at `base` holding rings of `capacity` bytes.
    ///
    /// # Safety
    ///
    /// `base..base + len` must stay mapped, readable and writable for as long as `owner` lives,
    /// and nothing but [`Segment`]s (here or in another process) may write it.
    pub unsafe fn from_raw(
        base: *mut u8,
        len: usize,
        capacity: u64,
        owner: Arc<dyn Send + Sync>,
    ) -> Result<Segment, ShmError> {
        let needed = segment_len(capacity)?;
        let align = 1usize << (base as usize).trailing_zeros().min(6);
        match NonNull::new(base) {
            Some(base) if len == needed && align == 64 => Ok(Segment { base, capacity, _owner: owner }),
            _ => Err(ShmError::BadMapping { len, align, capacity, needed }),
        }
    }

    /// A segment in this process's heap (tests, fuzzing, and the transport's own checks).
    pub fn in_heap(capacity: u64) -> Result<Segment, ShmError> {
        let len = segment_len(capacity)?;
        // 64-byte blocks, so the base is 64-aligned.
        #[repr(align(64))]
        #[derive(Default)]
        struct Block {
            _words: [AtomicU64; 8],
        }
        let blocks: Arc<Vec<Block>> = Arc::new((0..len / 64).map(|_| Block::default()).collect());
        let base = blocks.as_ptr() as *mut u8;
        // SAFETY: the allocation is `len` bytes (segment lengths are multiples of 64), 64-aligned,
        // lives as long as the owner, and is only written through this segment's atomics and
        // copies (interior mutability: the blocks are atomics).
        unsafe { Segment::from_raw(base, len, capacity, blocks) }
    }

    /// Each ring's capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Write the header and clear both control blocks: the creator does this before it offers
    /// the segment.
    pub fn init(&self, header: &SegmentHeader) {
        for dir in [Direction::FromCreator, Direction::FromAcceptor] {
            for field in [TAIL, HEAD, BOX_HEAD] {
                self.word(dir, field).store(0, Ordering::Relaxed);
            }
            for slot in 0..BOX_SLOTS {
                self.stamp(dir, slot).store(0, Ordering::Relaxed);
            }
            for field in [WANT_DATA, SLEEP_BARRIER, POLLER_CORE, WANT_SPACE] {
                self.flag(dir, field).store(0, Ordering::Relaxed);
            }
        }
        let bytes = header.encode();
        // SAFETY: the header's 64 bytes are inside the segment; nobody else has it yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.as_ptr(), HEADER_LEN) };
        fence(Ordering::Release);
    }

    /// The header as the segment holds it now.
    pub fn header(&self) -> Result<SegmentHeader, ShmError> {
        fence(Ordering::Acquire);
        let mut bytes = [0u8; HEADER_LEN];
        // SAFETY: the header's 64 bytes are inside the segment.
        unsafe { std::ptr::copy_nonoverlapping(self.base.as_ptr(), bytes.as_mut_ptr(), HEADER_LEN) };
        SegmentHeader::decode(&bytes)
    }

    /// The writing end of ring `dir`. Only one side may hold it.
    pub fn producer(&self, dir: Direction) -> Producer {
        let tail = self.word(dir, TAIL).load(Ordering::Acquire);
        // Nothing written yet counts as read: the first write that needs more room than that
        // reads (and checks) the consumer's position.
        let box_next = self.word(dir, BOX_HEAD).load(Ordering::Acquire);
        Producer {
            seg: self.clone(),
            dir,
            box_next_shared: Arc::new(AtomicU64::new(box_next)),
            tail,
            head_seen: tail.saturating_sub(self.capacity),
            box_next,
            box_seen: box_next,
            in_barriers: false,
        }
    }

    /// The reading end of ring `dir`. Only one side may hold it.
    pub fn consumer(&self, dir: Direction) -> Consumer {
        let head = self.word(dir, HEAD).load(Ordering::Acquire);
        let box_next = self.word(dir, BOX_HEAD).load(Ordering::Acquire);
        Consumer { seg: self.clone(), dir, head, box_next, box_off: 0, box_len: 0, sleep_barrier: None }
    }

    /// Say that the thread waiting for ring `dir`'s bytes (this side consumes it) runs on
    /// `core` (`None`: unknown, or it goes to sleep). The word is written only when it
    /// changes: the producer reads `want_data` on the same line after every write.
    pub fn set_poller_core(&self, dir: Direction, core: Option<u32>) {
        let flag = self.flag(dir, POLLER_CORE);
        let value = core.map_or(0, |c| c.saturating_add(1));
        if flag.load(Ordering::Relaxed) != value {
            flag.store(value, Ordering::Relaxed);
        }
    }

    /// The core the thread waiting for ring `dir`'s bytes said it runs on
    /// ([`Segment::set_poller_core`]): the peer's, when this side produces `dir`. A hint from
    /// the peer's memory: any number may come back.
    pub fn poller_core(&self, dir: Direction) -> Option<u32> {
        self.flag(dir, POLLER_CORE).load(Ordering::Relaxed).checked_sub(1)
    }

    /// Store `value` in control field `field` (0 tail, 1 head, 2 want_data, 3 want_space, 4
    /// box_head, 5 poller_core, 6 sleep_barrier; others are ignored) of ring `dir`, as a
    /// misbehaving peer could: what tests and the fuzzer use to play one.
    #[doc(hidden)]
    pub fn scribble(&self, dir: Direction, field: u8, value: u64) {
        match field {
            0 => self.word(dir, TAIL).store(value, Ordering::Release),
            1 => self.word(dir, HEAD).store(value, Ordering::Release),
            2 => self.flag(dir, WANT_DATA).store(value as u32, Ordering::Release),
            3 => self.flag(dir, WANT_SPACE).store(value as u32, Ordering::Release),
            4 => self.word(dir, BOX_HEAD).store(value, Ordering::Release),
            5 => self.flag(dir, POLLER_CORE).store(value as u32, Ordering::Release),
            6 => self.flag(dir, SLEEP_BARRIER).store(value as u32, Ordering::Release),
            _ => {}
        }
    }

    /// Store `value` in the 8-byte word `word` (modulo the box's 128) of ring `dir`'s box, as a
    /// misbehaving peer could.
    #[doc(hidden)]
    pub fn scribble_box(&self, dir: Direction, word: u16, value: u64) {
        let at = (word as usize % (BOX_LEN / 8)) * 8;
        // SAFETY: `at + 8 <= BOX_LEN`, inside the box, 8-aligned, and box words are only
        // accessed atomically or as plain bytes of a peer.
        let w = unsafe { &*(self.boxed(dir).add(at) as *const AtomicU64) };
        w.store(value, Ordering::Release);
    }

    fn control(&self, dir: Direction) -> usize {
        match dir {
            Direction::FromCreator => HEADER_LEN,
            Direction::FromAcceptor => HEADER_LEN + CONTROL_LEN + BOX_LEN + self.capacity as usize,
        }
    }

    fn word(&self, dir: Direction, field: usize) -> &AtomicU64 {
        // SAFETY: the field is inside the segment, 8-aligned (the base is 64-aligned and every
        // offset a multiple of 64), and only ever accessed atomically.
        unsafe { &*(self.base.as_ptr().add(self.control(dir) + field) as *const AtomicU64) }
    }

    fn flag(&self, dir: Direction, field: usize) -> &AtomicU32 {
        // SAFETY: as in `word`.
        unsafe { &*(self.base.as_ptr().add(self.control(dir) + field) as *const AtomicU32) }
    }

    fn data(&self, dir: Direction) -> *mut u8 {
        // SAFETY: the data area starts inside the segment, right after the box.
        unsafe { self.base.as_ptr().add(self.control(dir) + CONTROL_LEN + BOX_LEN) }
    }

    fn boxed(&self, dir: Direction) -> *mut u8 {
        // SAFETY: the box starts inside the segment, right after the control block.
        unsafe { self.base.as_ptr().add(self.control(dir) + CONTROL_LEN) }
    }

    /// Box entry `count`'s slot.
    fn slot(&self, dir: Direction, count: u64) -> *mut u8 {
        // SAFETY: `count % BOX_SLOTS` slots of `SLOT_LEN` bytes fit in the box.
        unsafe { self.boxed(dir).add((count % BOX_SLOTS) as usize * SLOT_LEN) }
    }

    fn stamp(&self, dir: Direction, count: u64) -> &AtomicU32 {
        // SAFETY: a slot's first 4 bytes, 64-aligned, only ever accessed atomically (or as a
        // peer's plain bytes, which it may be: any value is fine).
        unsafe { &*(self.slot(dir, count) as *const AtomicU32) }
    }

    fn slot_len(&self, dir: Direction, count: u64) -> &AtomicU32 {
        // SAFETY: as in `stamp`, 4 bytes further.
        unsafe { &*(self.slot(dir, count).add(SLOT_LEN_AT) as *const AtomicU32) }
    }

    fn slot_pos(&self, dir: Direction, count: u64) -> &AtomicU64 {
        // SAFETY: as in `stamp`, 8 bytes further, 8-aligned.
        unsafe { &*(self.slot(dir, count).add(SLOT_POS_AT) as *const AtomicU64) }
    }
}

/// A box entry's stamp: its count plus one, as 32 bits. A slot holds zeros until its first
/// entry and then the stamp of the entry [`BOX_SLOTS`] before the one awaited: never the
/// awaited one (stamps repeat only every 2^32 entries).
fn stamp_of(count: u64) -> u32 {
    count.wrapping_add(1) as u32
}

/// The writing end of one ring. Its position is its own; it reads the consumer's, and refuses
/// one that breaks the invariant `tail - capacity <= head <= tail`.
#[derive(Debug)]
pub struct Producer {
    seg: Segment,
    dir: Direction,
    /// `box_next`, for the ring's [`Warmer`]s, which read it without the producer.
    box_next_shared: Arc<AtomicU64>,
    tail: u64,
    /// The consumer's position when last read (checked then). It only grows, so the room it
    /// gives is never more than there is: a write that fits in it does not read the
    /// consumer's cache line, which the consumer writes at every read, and so does not wait
    /// for that line to come over from the other core.
    head_seen: u64,
    /// Box entries written.
    box_next: u64,
    /// The consumer's `box_head` when last read (checked then): as `head_seen`.
    box_seen: u64,
    /// Whether this process's threads take part in the barrier a consumer may announce
    /// ([`Producer::set_in_barriers`]).
    in_barriers: bool,
}

impl Producer {
    /// Bytes that fit now.
    pub fn free(&self) -> Result<usize, ShmError> {
        self.head().map(|head| self.room_after(head))
    }

    /// The consumer's position, checked against the invariant.
    fn head(&self) -> Result<u64, ShmError> {
        let head = self.seg.word(self.dir, HEAD).load(Ordering::Acquire);
        let cap = self.seg.capacity;
        match self.tail.checked_sub(head) {
            Some(used) if used <= cap => Ok(head),
            _ => Err(ShmError::Corrupt(format!(
                "the reader's position {head} is not within {cap} bytes behind the writer's {}",
                self.tail
            ))),
        }
    }

    /// Room in the ring when the consumer is at `head` (checked, or a position it has passed).
    fn room_after(&self, head: u64) -> usize {
        (self.seg.capacity - (self.tail - head)) as usize
    }

    /// Whether a box slot is free. The consumer's `box_head` is read only when the count seen
    /// last leaves none.
    fn box_free(&mut self) -> Result<bool, ShmError> {
        if self.box_next - self.box_seen < BOX_SLOTS {
            return Ok(true);
        }
        let seen = self.seg.word(self.dir, BOX_HEAD).load(Ordering::Acquire);
        match self.box_next.checked_sub(seen) {
            Some(unread) if unread <= BOX_SLOTS => {
                self.box_seen = seen;
                Ok(unread < BOX_SLOTS)
            }
            _ => Err(ShmError::Corrupt(format!(
                "the reader's box count {seen} is not within {BOX_SLOTS} entries behind the writer's {}",
                self.box_next
            ))),
        }
    }

    /// Copy as much of `bufs` (in order) as fits, publish it, and return how many bytes went.
    /// All of a write of at most [`BOX_BYTES`] goes into the box when a slot is free; others go
    /// into the ring. The consumer's positions are read only when the room seen last is too
    /// small.
    pub fn write<'a, I>(&mut self, bufs: I) -> Result<usize, ShmError>
    where
        I: IntoIterator<Item = &'a [u8]>,
        I::IntoIter: Clone,
    {
        let bufs = bufs.into_iter();
        let want: usize = bufs.clone().map(<[u8]>::len).sum();
        if (1..=BOX_BYTES).contains(&want) && self.box_free()? {
            self.put_in_box(bufs, want);
            return Ok(want);
        }
        let mut room = self.room_after(self.head_seen);
        if room < want {
            self.head_seen = self.head()?;
            room = self.room_after(self.head_seen);
        }
        let cap = self.seg.capacity as usize;
        let data = self.seg.data(self.dir);
        let mut pos = self.tail;
        for buf in bufs {
            let n = buf.len().min(room);
            let mut done = 0;
            while done < n {
                // The capacity is a power of two (`segment_len` refuses any other): a
                // position's offset is its low bits, without a division.
                let at = (pos & (cap as u64 - 1)) as usize;
                let run = (n - done).min(cap - at);
                // SAFETY: `at + run <= cap`, inside this ring's data area; the bytes from `pos`
                // to `head + cap` belong to the producer until it publishes `tail`.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(done), data.add(at), run) };
                done += run;
                pos += run as u64;
            }
            room -= n;
            if n < buf.len() {
                break;
            }
        }
        let wrote = (pos - self.tail) as usize;
        if wrote > 0 {
            self.tail = pos;
            self.seg.word(self.dir, TAIL).store(pos, Ordering::Release);
        }
        Ok(wrote)
    }

    /// Write all of `frame` or none of it, and publish it: into the box when it fits one and a
    /// slot is free, else into the ring when it has room for the whole. True if it went.
    /// [`Producer::write`] of one buffer that went whole leaves the same; a sender that must not
    /// leave part of a frame behind (its rest would have to be queued) takes this instead.
    pub fn write_whole(&mut self, frame: &[u8]) -> Result<bool, ShmError> {
        if (1..=BOX_BYTES).contains(&frame.len()) && self.box_free()? {
            self.put_in_box([frame], frame.len());
            return Ok(true);
        }
        if self.room_after(self.head_seen) < frame.len() {
            self.head_seen = self.head()?;
            if self.room_after(self.head_seen) < frame.len() {
                return Ok(false);
            }
        }
        Ok(self.write([frame])? == frame.len())
    }

    /// Write `bufs`, `want` bytes in all (1 to [`BOX_BYTES`]), as the next box entry, standing
    /// at the ring's present position, and publish it. The caller has found a slot free.
    #[inline]
    fn put_in_box<'a>(&mut self, bufs: impl IntoIterator<Item = &'a [u8]>, want: usize) {
        let (seg, dir, count) = (&self.seg, self.dir, self.box_next);
        let slot = seg.slot(dir, count);
        let mut at = SLOT_BYTES;
        for buf in bufs {
            // SAFETY: `at + buf.len() <= SLOT_LEN` (the lengths sum to `want`, at most
            // `BOX_BYTES`), inside this slot, which belongs to the producer until it stores the
            // stamp.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), slot.add(at), buf.len()) };
            at += buf.len();
        }
        seg.slot_len(dir, count).store(want as u32, Ordering::Relaxed);
        seg.slot_pos(dir, count).store(self.tail, Ordering::Relaxed);
        seg.stamp(dir, count).store(stamp_of(count), Ordering::Release);
        self.box_next = count + 1;
        self.box_next_shared.store(count + 1, Ordering::Relaxed);
    }

    /// A handle that warms this producer's next box slot ([`Warmer::warm`]) from any thread.
    pub fn warmer(&self) -> Warmer {
        Warmer {
            seg: self.seg.clone(),
            dir: self.dir,
            box_next: self.box_next_shared.clone(),
            for_write: crate::prefetch::for_write_supported(),
        }
    }

    /// After a write: whether the consumer asked for a doorbell (the request is taken, so
    /// exactly one writer rings for it). Without a full fence before the look at the request
    /// where the consumer announced a barrier this thread takes part in ("Doorbells" in the
    /// [module docs](self)).
    pub fn take_data_request(&self) -> bool {
        if self.fences() {
            fence(Ordering::SeqCst);
        } else {
            compiler_fence(Ordering::SeqCst);
        }
        let flag = self.seg.flag(self.dir, WANT_DATA);
        flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0
    }

    /// Say whether this process's threads take part in the barrier a consumer announces with
    /// [`Consumer::set_sleep_barrier`] (every thread of the process that runs then executes a
    /// full fence). Where they do and the consumer announced one, [`Producer::take_data_request`]
    /// needs no fence of its own.
    pub fn set_in_barriers(&mut self, yes: bool) {
        self.in_barriers = yes;
    }

    /// Whether [`Producer::take_data_request`] fences now: unless this process takes part in
    /// the consumer's barrier and the consumer announced one. The announcement is the peer's
    /// word, read on the line the request is: a peer that announces a barrier it does not run
    /// loses only its own doorbells.
    pub fn fences(&self) -> bool {
        !(self.in_barriers && self.seg.flag(self.dir, SLEEP_BARRIER).load(Ordering::Relaxed) == 1)
    }

    /// Ask the consumer for a doorbell when it frees room; true if a write of `want` bytes
    /// would take some of them already (the request then stands, and a doorbell may come
    /// anyway).
    pub fn request_space(&mut self, want: usize) -> Result<bool, ShmError> {
        self.seg.flag(self.dir, WANT_SPACE).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        Ok(self.free()? > 0 || ((1..=BOX_BYTES).contains(&want) && self.box_free()?))
    }

    /// Bytes written so far.
    pub fn position(&self) -> u64 {
        self.tail
    }
}

/// Asks the cache for the line of a [`Producer`]'s next box entry, for writing (see "Warming
/// the next slot" in the [module docs](self)). It reads the producer's count of entries as the
/// producer last wrote it, and only names an address inside the box: whatever the peer does
/// to the segment, a warm changes no byte and cannot fault.
#[derive(Debug, Clone)]
pub struct Warmer {
    seg: Segment,
    dir: Direction,
    box_next: Arc<AtomicU64>,
    /// Whether this processor has the prefetch-for-write instruction.
    for_write: bool,
}

impl Warmer {
    /// Ask for the next entry's slot line, in the exclusive state a store needs. Does nothing
    /// on a processor without the instruction (or not x86-64).
    #[inline]
    pub fn warm(&self) {
        if self.for_write {
            crate::prefetch::for_write(self.next_slot());
        }
    }

    /// Where the producer's next box entry goes.
    fn next_slot(&self) -> *const u8 {
        self.seg.slot(self.dir, self.box_next.load(Ordering::Relaxed))
    }
}

/// The reading end of one ring. Its position is its own; it reads the producer's, and refuses
/// one that breaks the invariant `head <= tail <= head + capacity`.
#[derive(Debug)]
pub struct Consumer {
    seg: Segment,
    dir: Direction,
    head: u64,
    /// Box entries read whole.
    box_next: u64,
    /// Bytes of box entry `box_next` read so far (0: none), of `box_len` (its length when it
    /// was first read, checked then: a peer that changes it later changes nothing).
    box_off: usize,
    box_len: usize,
    /// Run between a doorbell request and the look after it ([`Consumer::set_sleep_barrier`]).
    sleep_barrier: Option<fn()>,
}

/// What comes next in a ring's stream ([`Consumer::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// This many ring bytes (maybe none) before the next box entry.
    Ring(usize),
    /// The rest of box entry `box_next`: this many bytes (at least one).
    Boxed(usize),
}

impl Consumer {
    /// The writer's ring position, checked against the invariant.
    fn tail(&self) -> Result<u64, ShmError> {
        let tail = self.seg.word(self.dir, TAIL).load(Ordering::Acquire);
        let cap = self.seg.capacity;
        match tail.checked_sub(self.head) {
            Some(n) if n <= cap => Ok(tail),
            _ => Err(ShmError::Corrupt(format!(
                "the writer's position {tail} is not within {cap} bytes ahead of the reader's {}",
                self.head
            ))),
        }
    }

    /// What comes next: ring bytes up to the next box entry's position, or that entry.
    fn next(&self) -> Result<Next, ShmError> {
        if self.box_off > 0 {
            return Ok(Next::Boxed(self.box_len - self.box_off));
        }
        // `tail` first: an entry not seen below was written after it, so it stands at or
        // after it, and the ring's bytes up to it all come first.
        let tail = self.tail()?;
        let (seg, dir, count) = (&self.seg, self.dir, self.box_next);
        if seg.stamp(dir, count).load(Ordering::Acquire) != stamp_of(count) {
            return Ok(Next::Ring((tail - self.head) as usize));
        }
        let len = seg.slot_len(dir, count).load(Ordering::Relaxed) as usize;
        if !(1..=BOX_BYTES).contains(&len) {
            return Err(ShmError::Corrupt(format!("box entry {count} holds {len} bytes, not 1 to {BOX_BYTES}")));
        }
        let at = seg.slot_pos(dir, count).load(Ordering::Relaxed);
        if at == self.head {
            return Ok(Next::Boxed(len));
        }
        // Written after the ring's bytes up to `at` were published: a `tail` read now has them.
        let tail = if at > tail { self.tail()? } else { tail };
        if at < self.head || at > tail {
            return Err(ShmError::Corrupt(format!(
                "box entry {count} stands at position {at}, outside the reader's {} to the writer's {tail}",
                self.head
            )));
        }
        Ok(Next::Ring((at - self.head) as usize))
    }

    /// Where box entry `box_next`'s bytes not read yet start (`next` says how many).
    fn box_bytes(&self) -> *const u8 {
        // SAFETY: `box_off < BOX_BYTES` (`next` checked the entry's length), inside the slot.
        unsafe { self.seg.slot(self.dir, self.box_next).add(SLOT_BYTES + self.box_off) }
    }

    /// `used` more bytes of box entry `box_next`, which has `left` not read before them, are
    /// read: the entry's slot is released when none are left.
    fn box_read(&mut self, used: usize, left: usize) {
        if used == 0 {
            return;
        }
        if used < left {
            if self.box_off == 0 {
                self.box_len = left;
            }
            self.box_off += used;
            return;
        }
        self.box_off = 0;
        self.box_next += 1;
        self.seg.word(self.dir, BOX_HEAD).store(self.box_next, Ordering::Release);
    }

    /// Ask this core's cache for the next box entry's slot line, a little ahead of a look at
    /// it ([`Consumer::looks_empty`]) by a reader that expects the entry written by then (see
    /// "Warming the next slot" in the [module docs](self)). Reads and changes nothing.
    #[inline]
    pub fn prefetch_next(&self) {
        crate::prefetch::for_read(self.seg.slot(self.dir, self.box_next));
    }

    /// Whether nothing can be waiting: no box entry partly read, the next box slot not written
    /// yet, and the writer's position where this reader's is. Two loads, and no checks, for a
    /// reader that spins on an empty ring: `false` only says to look ([`Consumer::available`],
    /// [`Consumer::read`] and [`Consumer::read_in_place`] check what they find). A hostile
    /// writer can make it say `false`, never make it read outside the segment.
    #[inline]
    pub fn looks_empty(&self) -> bool {
        let (seg, dir, count) = (&self.seg, self.dir, self.box_next);
        self.box_off == 0
            && seg.stamp(dir, count).load(Ordering::Relaxed) != stamp_of(count)
            && seg.word(dir, TAIL).load(Ordering::Relaxed) == self.head
    }

    /// Bytes waiting to be read in one run: ring bytes up to the next box entry, or the rest
    /// of that entry. Zero only when nothing waits.
    pub fn available(&self) -> Result<usize, ShmError> {
        Ok(match self.next()? {
            Next::Ring(n) | Next::Boxed(n) => n,
        })
    }

    /// Copy up to `out.len()` waiting bytes into `out`, release their room, and return how many
    /// (a read stops at a box entry's edge: read again for more).
    pub fn read(&mut self, out: &mut [u8]) -> Result<usize, ShmError> {
        let n = match self.next()? {
            Next::Ring(n) => n,
            Next::Boxed(left) => {
                let n = left.min(out.len());
                // SAFETY: `n <= left` bytes of the entry, inside its slot (`box_bytes`); the
                // slot is the consumer's until it publishes `box_head`.
                unsafe { std::ptr::copy_nonoverlapping(self.box_bytes(), out.as_mut_ptr(), n) };
                self.box_read(n, left);
                return Ok(n);
            }
        };
        let n = n.min(out.len());
        let cap = self.seg.capacity as usize;
        let data = self.seg.data(self.dir);
        let mut done = 0;
        while done < n {
            let at = ((self.head + done as u64) & (cap as u64 - 1)) as usize;
            let run = (n - done).min(cap - at);
            // SAFETY: `at + run <= cap`, inside this ring's data area; the bytes from `head` to
            // `tail` belong to the consumer until it publishes `head`. A hostile writer may
            // change them meanwhile: they are plain bytes, checked by the frame decoder.
            unsafe { std::ptr::copy_nonoverlapping(data.add(at), out.as_mut_ptr().add(done), run) };
            done += run;
        }
        if n > 0 {
            self.head += n as u64;
            self.seg.word(self.dir, HEAD).store(self.head, Ordering::Release);
        }
        Ok(n)
    }

    /// Let `f` use the waiting bytes where they lie, up to the ring's end or a box entry's
    /// edge (bytes past either come in a later call), then release as many as it says it used
    /// (at most what it saw); its other result is returned. For a reader that consumes a frame
    /// straight out of the ring instead of copying it out first ([`Consumer::read`]).
    ///
    /// The bytes are the peer's to have written, not to change: a well-behaved producer never
    /// writes between the reader's position and its own. A hostile one may, while `f` reads
    /// them; like [`Consumer::read`]'s, they are then plain bytes that `f` must check as it
    /// would any from the peer (no length or index may come from them unchecked).
    pub fn read_in_place<R>(&mut self, f: impl FnOnce(&[u8]) -> (usize, R)) -> Result<R, ShmError> {
        let waiting = match self.next()? {
            Next::Ring(n) => n,
            Next::Boxed(left) => {
                // SAFETY: `left` bytes of the entry, inside its slot (`box_bytes`), which is the
                // consumer's until it publishes `box_head`, after `f` has returned.
                let bytes = unsafe { std::slice::from_raw_parts(self.box_bytes(), left) };
                let (used, out) = f(bytes);
                self.box_read(used.min(left), left);
                return Ok(out);
            }
        };
        let cap = self.seg.capacity as usize;
        let at = (self.head & (cap as u64 - 1)) as usize;
        let run = waiting.min(cap - at);
        // SAFETY: `at + run <= cap`, inside this ring's data area; the bytes from `head` to
        // `tail` belong to the consumer until it publishes `head`, which happens only below,
        // after `f` has returned (and `&mut self` keeps every other read out meanwhile).
        let bytes = unsafe { std::slice::from_raw_parts(self.seg.data(self.dir).add(at), run) };
        let (used, out) = f(bytes);
        let used = used.min(run);
        if used > 0 {
            self.head += used as u64;
            self.seg.word(self.dir, HEAD).store(self.head, Ordering::Release);
        }
        Ok(out)
    }

    /// Ask the producer for a doorbell when it writes; true if bytes are waiting already (the
    /// request then stands, and a doorbell may come anyway).
    pub fn request_data(&self) -> Result<bool, ShmError> {
        self.seg.flag(self.dir, WANT_DATA).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if let Some(barrier) = self.sleep_barrier {
            barrier();
        }
        Ok(self.available()? > 0)
    }

    /// Run `barrier` at every doorbell request, between the request and the look after it, and
    /// tell the producer so (on the request's line): `barrier` must make every thread of the
    /// producer's process that runs then execute a full fence (Linux's `membarrier`), which
    /// lets a producer that takes part ([`Producer::set_in_barriers`]) look at the request
    /// without a fence of its own after every write. Set before the first request.
    pub fn set_sleep_barrier(&mut self, barrier: fn()) {
        self.sleep_barrier = Some(barrier);
        self.seg.flag(self.dir, SLEEP_BARRIER).store(1, Ordering::Release);
    }

    /// Withdraw a doorbell request (the reader is awake and reads anyway).
    pub fn cancel_data_request(&self) {
        self.seg.flag(self.dir, WANT_DATA).store(0, Ordering::Relaxed);
    }

    /// After a read: whether the producer asked for a doorbell when room frees up (the request
    /// is taken, so exactly one reader rings for it).
    pub fn take_space_request(&self) -> bool {
        fence(Ordering::SeqCst);
        let flag = self.seg.flag(self.dir, WANT_SPACE);
        flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0
    }

    /// Bytes read so far.
    pub fn position(&self) -> u64 {
        self.head
    }
}

/// Size of an [`Offer`]'s fixed part in bytes; the segment's name follows.
pub const OFFER_LEN: usize = 40;
/// The longest segment name an offer carries.
pub const MAX_NAME_LEN: usize = 128;
/// Size of an [`Answer`] in bytes.
pub const ANSWER_LEN: usize = 8;
const OFFER_MAGIC: [u8; 4] = *b"CoSO";
const ANSWER_MAGIC: [u8; 4] = *b"CoSA";

/// What the rank that dials a same-host peer sends after the handshake when both sides said
/// they can share memory: where the segment is and how to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The creator's boot id (`/proc/sys/kernel/random/boot_id` as 16 bytes): a peer on
    /// another host (or another boot) declines without looking for the segment.
    pub boot_id: [u8; 16],
    /// The segment header's nonce.
    pub nonce: u64,
    /// Each ring's capacity.
    pub capacity: u64,
    /// The segment's file name under the shared-memory directory (`[A-Za-z0-9._-]`, no path).
    pub name: String,
}

impl Offer {
    /// The offer's bytes: the fixed part, then the name.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(OFFER_LEN + self.name.len());
        out.extend_from_slice(&OFFER_MAGIC);
        out.extend_from_slice(&(self.name.len().min(MAX_NAME_LEN) as u16).to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.boot_id);
        out.extend_from_slice(&self.nonce.to_le_bytes());
        out.extend_from_slice(&self.capacity.to_le_bytes());
        out.extend_from_slice(&self.name.as_bytes()[..self.name.len().min(MAX_NAME_LEN)]);
        out
    }

    /// The length of the name that follows a fixed part (checked: at most [`MAX_NAME_LEN`]).
    pub fn name_len(fixed: &[u8; OFFER_LEN]) -> Result<usize, ShmError> {
        if fixed[0..4] != OFFER_MAGIC {
            return Err(ShmError::Offer(format!("bad magic {:02x?}", &fixed[0..4])));
        }
        let len = u16::from_le_bytes([fixed[4], fixed[5]]) as usize;
        if len == 0 || len > MAX_NAME_LEN {
            return Err(ShmError::Offer(format!("name of {len} bytes (1 to {MAX_NAME_LEN} allowed)")));
        }
        Ok(len)
    }

    /// Decodes an offer from its fixed part and its name. Total.
    pub fn decode(fixed: &[u8; OFFER_LEN], name: &[u8]) -> Result<Offer, ShmError> {
        let len = Offer::name_len(fixed)?;
        if name.len() != len {
            return Err(ShmError::Offer(format!("name of {} bytes where the offer says {len}", name.len())));
        }
        if fixed[6..8] != [0, 0] {
            return Err(ShmError::Offer("reserved bytes are not zero".into()));
        }
        let name = std::str::from_utf8(name)
            .ok()
            .filter(|n| n.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) && !n.starts_with('.'))
            .ok_or_else(|| {
                ShmError::Offer(format!("segment name {:?} is not a plain file name", String::from_utf8_lossy(name)))
            })?;
        let capacity = u64::from_le_bytes(fixed[32..40].try_into().expect("8 bytes"));
        check_capacity(capacity)?;
        Ok(Offer {
            boot_id: fixed[8..24].try_into().expect("16 bytes"),
            nonce: u64::from_le_bytes(fixed[24..32].try_into().expect("8 bytes")),
            capacity,
            name: name.to_owned(),
        })
    }
}

/// The accepting side's answer to an [`Offer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The segment is mapped: frames go through it from now on.
    Accept,
    /// The peer runs on another host or boot.
    OtherHost,
    /// The segment could not be opened or mapped.
    CannotMap,
    /// The segment's header or size is not what the offer said.
    Mismatch,
    /// The offer was malformed.
    BadOffer,
}

impl Answer {
    /// The answer's bytes.
    pub fn encode(self) -> [u8; ANSWER_LEN] {
        let code = match self {
            Answer::Accept => 0,
            Answer::OtherHost => 1,
            Answer::CannotMap => 2,
            Answer::Mismatch => 3,
            Answer::BadOffer => 4,
        };
        let mut out = [0u8; ANSWER_LEN];
        out[0..4].copy_from_slice(&ANSWER_MAGIC);
        out[4] = code;
        out
    }

    /// Decodes an answer. Total.
    pub fn decode(bytes: &[u8; ANSWER_LEN]) -> Result<Answer, ShmError> {
        if bytes[0..4] != ANSWER_MAGIC || bytes[5..] != [0, 0, 0] {
            return Err(ShmError::Offer(format!("malformed answer {bytes:02x?}")));
        }
        Ok(match bytes[4] {
            0 => Answer::Accept,
            1 => Answer::OtherHost,
            2 => Answer::CannotMap,
            3 => Answer::Mismatch,
            4 => Answer::BadOffer,
            code => return Err(ShmError::Offer(format!("unknown answer code {code}"))),
        })
    }
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Answer::Accept => "accepted",
            Answer::OtherHost => "the peer runs on another host",
            Answer::CannotMap => "the peer could not map the segment",
            Answer::Mismatch => "the segment the peer found is not the one offered",
            Answer::BadOffer => "the peer could not read the offer",
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    fn pair(capacity: u64) -> (Producer, Consumer, Segment) {
        let seg = Segment::in_heap(capacity).unwrap();
        seg.init(&SegmentHeader { nonce: 7, capacity, creator: Rank(0), acceptor: Rank(1), group: GroupId(0) });
        (seg.producer(Direction::FromCreator), seg.consumer(Direction::FromCreator), seg)
    }

    #[test]
    fn bytes_come_out_in_order_across_the_wrap_and_a_full_ring_and_box_take_nothing() {
        let (mut p, mut c, seg) = pair(4096);
        assert_eq!(seg.header().unwrap().nonce, 7);
        let mut out = vec![0u8; 10_000];
        let mut sent = Vec::new();
        let mut got = Vec::new();
        for round in 0..50u32 {
            let chunk: Vec<u8> = (0..(round * 397) % 3000).map(|i| (i + round) as u8).collect();
            let n = p.write([&chunk[..chunk.len() / 2], &chunk[chunk.len() / 2..]]).unwrap();
            sent.extend_from_slice(&chunk[..n]);
            let m = c.read(&mut out[..(round as usize * 131) % 5000]).unwrap();
            got.extend_from_slice(&out[..m]);
            assert_eq!(p.free().unwrap() + (p.position() - c.position()) as usize, 4096);
        }
        let m = c.read(&mut out).unwrap();
        got.extend_from_slice(&out[..m]);
        assert_eq!(got, sent);
        assert_eq!(p.write([&[1u8; 5000][..]]).unwrap(), 4096);
        // The ring is full; small writes still fit in the box, until it is full too.
        for i in 0..BOX_SLOTS as u8 {
            assert_eq!(p.write([&[i + 2][..]]).unwrap(), 1, "box entry {i}");
        }
        assert_eq!(p.write([&[1u8; 1][..]]).unwrap(), 0, "full");
        assert!(!p.request_space(1).unwrap());
        assert!(!p.request_space(BOX_BYTES + 1).unwrap());
        let mut all = Vec::new();
        while let Ok(n @ 1..) = c.read(&mut out) {
            all.extend_from_slice(&out[..n]);
        }
        let mut want = vec![1u8; 4096];
        want.extend(2..BOX_SLOTS as u8 + 2);
        assert_eq!(all, want, "the ring's bytes, then the box's, as written");
    }

    #[test]
    fn a_warmer_names_the_slot_the_producers_next_box_entry_goes_into() {
        let (mut p, mut c, seg) = pair(4096);
        let warmer = p.warmer();
        let mut out = [0u8; 64];
        // Box entries and ring writes (which leave the box's count) mixed, past the box's wrap;
        // the reader keeps up, so that every small write goes into the box.
        for i in 0..3 * BOX_SLOTS as u8 {
            let at = warmer.next_slot();
            warmer.warm();
            let entry = [i, i.wrapping_mul(7), 0xA5];
            assert!(p.write_whole(&entry).unwrap());
            // SAFETY: `at` is a slot inside the heap segment, which outlives this read, and
            // nothing writes it meanwhile (the next write into it is `BOX_SLOTS` entries on).
            let slot_bytes = unsafe { std::slice::from_raw_parts(at.add(SLOT_BYTES), entry.len()) };
            assert_eq!(slot_bytes, entry, "entry {i} went where the warmer said");
            if i % 5 == 0 {
                assert!(p.write_whole(&[i; 200]).unwrap(), "a ring write");
            }
            while c.read(&mut out).unwrap() > 0 {}
        }
        // A producer made anew on the same ring (as after a reconnect) starts where the box is.
        let again = seg.producer(Direction::FromCreator);
        assert_eq!(again.warmer().next_slot(), warmer.next_slot());
    }

    #[test]
    fn a_whole_write_goes_all_or_nothing_in_the_stream_order_of_the_others() {
        let (mut p, mut c, _seg) = pair(4096);
        let chunk = |i: usize, len: usize| -> Vec<u8> { (0..len).map(|j| (i * 31 + j) as u8).collect() };
        let mut sent = Vec::new();
        // Whole writes into the box and the ring, between split ones.
        for (i, (len, whole)) in
            [(44, true), (100, false), (48, true), (49, true), (3, false), (2000, true)].into_iter().enumerate()
        {
            let bytes = chunk(i, len);
            if whole {
                assert!(p.write_whole(&bytes).unwrap(), "write {i}");
            } else {
                assert_eq!(p.write([&bytes[..1], &bytes[1..]]).unwrap(), len);
            }
            sent.extend_from_slice(&bytes);
        }
        // Too little room in the ring for a whole frame: nothing of it goes (a split write
        // would have taken part).
        let room = p.free().unwrap();
        assert!(!p.write_whole(&vec![9u8; room + 1]).unwrap(), "no room for all of it");
        assert_eq!(p.free().unwrap(), room, "and nothing of it was written");
        let mut out = vec![0u8; 8192];
        let mut got = Vec::new();
        while let Ok(n @ 1..) = c.read(&mut out) {
            got.extend_from_slice(&out[..n]);
        }
        assert_eq!(got, sent);
        // A full box and a full ring take no whole write, and a freed slot takes one again.
        assert!(p.write_whole(&vec![1u8; 4096]).unwrap());
        for i in 0..BOX_SLOTS as u8 {
            assert!(p.write_whole(&[i; 40]).unwrap(), "box entry {i}");
        }
        assert!(!p.write_whole(&[7u8; 40]).unwrap(), "box and ring full");
        let mut ring = vec![0u8; 4096];
        assert_eq!(c.read(&mut ring).unwrap(), 4096);
        assert_eq!(c.read(&mut out[..40]).unwrap(), 40);
        assert!(p.write_whole(&[7u8; 40]).unwrap(), "a slot was read");
    }

    #[test]
    fn box_entries_and_ring_bytes_come_out_in_the_order_written_and_a_box_entry_may_be_read_in_parts() {
        let (mut p, mut c, _seg) = pair(4096);
        let mut sent = Vec::new();
        // Alternate small (box) and larger (ring) writes, some several to a slot's worth.
        for (i, len) in [3usize, 100, 48, 49, 1, 1, 2000, 47, 600, 12].into_iter().enumerate() {
            let chunk: Vec<u8> = (0..len).map(|j| (i * 50 + j) as u8).collect();
            assert_eq!(p.write([&chunk[..len / 3], &chunk[len / 3..]]).unwrap(), len);
            sent.extend_from_slice(&chunk);
        }
        let mut got = Vec::new();
        // Runs stop at an entry's edge; read some in place, some by copying, a few bytes at a time.
        let mut k = 0usize;
        loop {
            k += 1;
            let before = got.len();
            if k.is_multiple_of(2) {
                c.read_in_place(|b| {
                    let n = b.len().min(k % 7 + 1);
                    got.extend_from_slice(&b[..n]);
                    (n, ())
                })
                .unwrap();
            } else {
                let mut out = [0u8; 5];
                let n = c.read(&mut out).unwrap();
                got.extend_from_slice(&out[..n]);
            }
            if got.len() == before {
                break;
            }
        }
        assert_eq!(got, sent);
        assert_eq!(c.available().unwrap(), 0);
    }

    #[test]
    fn the_quick_look_says_empty_exactly_when_nothing_waits() {
        let (mut p, mut c, _seg) = pair(4096);
        let same = |c: &Consumer, when: &str| {
            assert_eq!(c.looks_empty(), c.available().unwrap() == 0, "{when}");
        };
        same(&c, "new");
        assert!(c.looks_empty());
        // Box entries, ring bytes, an entry read in parts, and every slot of the box reused.
        for (i, len) in
            [3usize, 100, 48, 1, 2000, 47, 12, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5].into_iter().enumerate()
        {
            assert_eq!(p.write([&vec![i as u8; len][..]]).unwrap(), len);
            same(&c, &format!("after write {i}"));
            assert!(!c.looks_empty(), "write {i} waits");
            loop {
                let mut out = [0u8; 7];
                let n = c.read(&mut out).unwrap();
                same(&c, &format!("after reading {n} bytes of write {i}"));
                if n == 0 {
                    break;
                }
            }
            assert!(c.looks_empty(), "write {i} read");
        }
    }

    #[test]
    fn two_threads_exchange_through_both_rings_at_once_and_every_byte_arrives() {
        let seg = Segment::in_heap(4096).unwrap();
        seg.init(&SegmentHeader { nonce: 1, capacity: 4096, creator: Rank(0), acceptor: Rank(1), group: GroupId(0) });
        let side = |out: Direction, inc: Direction, salt: u8| {
            let (mut p, mut c) = (seg.producer(out), seg.consumer(inc));
            std::thread::spawn(move || {
                // Writes of 1 to 300 bytes (some in the box, some in the ring) of a stream
                // this side's salt marks; the other side's stream is checked byte by byte.
                let stream = |n: usize, salt: u8| (n as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ salt;
                let total = 400_000usize;
                let (mut wrote, mut read, mut k) = (0usize, 0usize, 0usize);
                let mut out = [0u8; 512];
                while wrote < total || read < total {
                    if wrote < total {
                        k += 1;
                        let len = (k * 37 % 300 + 1).min(total - wrote);
                        let chunk: Vec<u8> = (wrote..wrote + len).map(|n| stream(n, salt)).collect();
                        wrote += p.write([&chunk[..]]).unwrap();
                    }
                    let n = c.read(&mut out).unwrap();
                    for (i, &b) in out[..n].iter().enumerate() {
                        assert_eq!(b, stream(read + i, salt ^ 0xff), "byte {} from the other side", read + i);
                    }
                    read += n;
                }
            })
        };
        let a = side(Direction::FromCreator, Direction::FromAcceptor, 0x00);
        let b = side(Direction::FromAcceptor, Direction::FromCreator, 0xff);
        a.join().unwrap();
        b.join().unwrap();
    }

    #[test]
    fn a_box_entry_a_peer_corrupted_is_an_error_that_says_so() {
        let dir = Direction::FromCreator;
        let corrupt = |len: u32, at: u64| {
            let (mut p, mut c, seg) = pair(4096);
            p.write([&[7u8; 100][..]]).unwrap();
            // Entry 0 in slot 0: stamp and length in word 0, the position in word 1.
            seg.scribble_box(dir, 1, at);
            seg.scribble_box(dir, 0, u64::from(stamp_of(0)) | (u64::from(len) << 32));
            c.read(&mut [0u8; 8]).map(|_| ()).unwrap_err().to_string()
        };
        assert_eq!(corrupt(0, 0), "shared ring corrupt: box entry 0 holds 0 bytes, not 1 to 48");
        assert_eq!(corrupt(49, 0), "shared ring corrupt: box entry 0 holds 49 bytes, not 1 to 48");
        assert_eq!(
            corrupt(4, 101),
            "shared ring corrupt: box entry 0 stands at position 101, outside the reader's 0 to the writer's 100"
        );
        // An entry at the reader's position is taken, bounds and all: 4 bytes of the slot.
        let (mut p, mut c, seg) = pair(4096);
        seg.scribble_box(dir, 0, u64::from(stamp_of(0)) | (4 << 32));
        assert_eq!(c.read(&mut [0u8; 64]).unwrap(), 4);
        // A reader that says it read more entries than were written.
        seg.scribble(dir, 4, 99);
        for _ in 0..BOX_SLOTS {
            p.write([&[1u8][..]]).unwrap();
        }
        assert_eq!(
            p.write([&[1u8][..]]).unwrap_err().to_string(),
            "shared ring corrupt: the reader's box count 99 is not within 16 entries behind the writer's 16"
        );
    }

    #[test]
    fn a_doorbell_request_is_taken_once_and_seen_by_a_late_look() {
        let (mut p, mut c, _seg) = pair(4096);
        assert!(!c.request_data().unwrap(), "empty: the consumer may sleep");
        p.write([&b"abc"[..]]).unwrap();
        assert!(p.take_data_request(), "the sleeper asked: ring");
        assert!(!p.take_data_request(), "once");
        assert!(c.request_data().unwrap(), "bytes wait: do not sleep");
        c.cancel_data_request();
        assert!(!p.take_data_request());
        let mut out = [0u8; 8];
        assert_eq!(c.read(&mut out).unwrap(), 3);
        assert_eq!(p.write([&[0u8; 4096][..]]).unwrap(), 4096);
        assert!(!p.request_space(4096).unwrap(), "full: the producer may wait");
        c.read(&mut out).unwrap();
        assert!(c.take_space_request(), "the waiter asked: ring");
        assert!(!c.take_space_request(), "once");
        // A free box slot is room for a small write only.
        assert_eq!(p.write([&[0u8; 100][..]]).unwrap(), 8, "what the ring has room for");
        assert!(p.request_space(1).unwrap(), "a small write fits in the box");
        assert!(!p.request_space(BOX_BYTES + 1).unwrap(), "a larger one waits for the ring");
        for _ in 0..BOX_SLOTS {
            p.write([&[0u8; 1][..]]).unwrap();
        }
        assert!(!p.request_space(1).unwrap(), "the box is full too");
        while c.read(&mut out).unwrap() > 0 {}
        assert!(c.take_space_request(), "the waiter asked: ring");
        assert!(p.request_space(1).unwrap());
    }

    #[test]
    fn a_producer_looks_at_a_request_unfenced_only_where_it_takes_part_in_the_barrier_its_consumer_announced() {
        fn none() {}
        for (in_barriers, announced) in [(false, false), (true, false), (false, true), (true, true)] {
            let (mut p, mut c, seg) = pair(4096);
            p.set_in_barriers(in_barriers);
            if announced {
                c.set_sleep_barrier(none);
            }
            assert_eq!(p.fences(), !(in_barriers && announced), "{in_barriers} {announced}");
            // The other ring's consumer announced nothing.
            let mut back = seg.producer(Direction::FromAcceptor);
            back.set_in_barriers(in_barriers);
            assert!(back.fences());
            // The doorbells work either way.
            assert!(!c.request_data().unwrap());
            p.write([&b"a"[..]]).unwrap();
            assert!(p.take_data_request());
        }
        // The word is the peer's: only a 1 announces a barrier.
        let (mut p, _c, seg) = pair(4096);
        p.set_in_barriers(true);
        for (value, fences) in [(2, true), (u64::from(u32::MAX), true), (1, false), (0, true)] {
            seg.scribble(Direction::FromCreator, 6, value);
            assert_eq!(p.fences(), fences, "{value}");
        }
    }

    thread_local! {
        /// The producer [`a_consumers_barrier_runs_after_its_request_and_before_its_look`]'s
        /// barrier writes with, and what it saw.
        static IN_BARRIER: RefCell<(Option<Producer>, Vec<bool>)> = const { RefCell::new((None, Vec::new())) };
    }

    #[test]
    fn a_consumers_barrier_runs_after_its_request_and_before_its_look() {
        // As a producer whose write lands while the barrier runs: it finds the request, and
        // the consumer's look after the barrier finds its byte.
        fn barrier() {
            IN_BARRIER.with_borrow_mut(|(p, seen)| {
                let p = p.as_mut().expect("a producer");
                p.write([&b"x"[..]]).unwrap();
                seen.push(p.take_data_request());
            });
        }
        let (p, mut c, _seg) = pair(4096);
        IN_BARRIER.with_borrow_mut(|state| state.0 = Some(p));
        c.set_sleep_barrier(barrier);
        assert!(c.request_data().unwrap(), "the look after the barrier sees the byte written in it");
        assert!(c.request_data().unwrap());
        IN_BARRIER
            .with_borrow(|(_, seen)| assert_eq!(seen, &[true, true], "each request was there when the barrier ran"));
        let mut out = [0u8; 4];
        assert_eq!(c.read(&mut out).unwrap(), 1);
        assert_eq!(c.read(&mut out).unwrap(), 1);
    }

    #[test]
    fn the_poller_core_goes_to_the_other_side_and_leaves_the_ring_alone() {
        let (mut p, mut c, seg) = pair(4096);
        let (dir, other) = (Direction::FromCreator, Direction::FromAcceptor);
        assert_eq!(seg.poller_core(dir), None, "unknown until said");
        seg.set_poller_core(dir, Some(0));
        assert_eq!(seg.poller_core(dir), Some(0), "core 0 is not 'unknown'");
        assert_eq!(seg.poller_core(other), None, "each ring has its own");
        seg.set_poller_core(dir, Some(7));
        p.write([&b"ab"[..]]).unwrap();
        assert!(!p.take_data_request(), "the word is not a doorbell request");
        assert!(c.request_data().unwrap(), "a request beside it");
        p.write([&b"c"[..]]).unwrap();
        assert!(p.take_data_request(), "is seen");
        assert_eq!(seg.poller_core(dir), Some(7), "and leaves the word alone");
        seg.set_poller_core(dir, None);
        assert_eq!(seg.poller_core(dir), None, "asleep");
        // Whatever a peer writes is a number and nothing else.
        seg.scribble(dir, 5, u64::MAX);
        assert_eq!(seg.poller_core(dir), Some(u32::MAX - 1));
        seg.set_poller_core(dir, Some(u32::MAX));
        assert_eq!(seg.poller_core(dir), Some(u32::MAX - 1), "saturates, never wraps to 'unknown'");
        let mut out = [0u8; 8];
        assert_eq!(c.read(&mut out).unwrap(), 2, "the ring is untouched");
        assert_eq!(c.read(&mut out[2..]).unwrap(), 1);
        assert_eq!(&out[..3], b"abc");
    }

    #[test]
    fn positions_a_peer_corrupted_are_errors_that_say_so() {
        let (mut p, mut c, seg) = pair(4096);
        seg.word(Direction::FromCreator, TAIL).store(5000, Ordering::Relaxed);
        let e = c.read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shared ring corrupt: the writer's position 5000 is not within 4096 bytes ahead of the reader's 0"
        );
        seg.word(Direction::FromCreator, HEAD).store(1, Ordering::Relaxed);
        assert!(matches!(p.free(), Err(ShmError::Corrupt(_))), "a reader ahead of the writer");
        // A write reads the reader's position when the room it saw last is too small.
        assert!(matches!(p.write([&[0u8; 4097][..]]), Err(ShmError::Corrupt(_))), "a reader ahead of the writer");
        seg.word(Direction::FromCreator, HEAD).store(0, Ordering::Relaxed);
        seg.word(Direction::FromCreator, TAIL).store(u64::MAX, Ordering::Relaxed);
        assert!(c.available().is_err());
    }

    #[test]
    fn headers_offers_and_answers_round_trip_and_junk_is_refused() {
        let h = SegmentHeader { nonce: 9, capacity: 1 << 20, creator: Rank(3), acceptor: Rank(5), group: GroupId(2) };
        assert_eq!(SegmentHeader::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[16] = 3;
        assert_eq!(SegmentHeader::decode(&bad), Err(ShmError::BadCapacity((1 << 20) + 3)));
        let offer = Offer { boot_id: [4; 16], nonce: 11, capacity: 1 << 16, name: "cohort-1-2-abc".into() };
        let bytes = offer.encode();
        let fixed: [u8; OFFER_LEN] = bytes[..OFFER_LEN].try_into().unwrap();
        assert_eq!(Offer::name_len(&fixed).unwrap(), 14);
        assert_eq!(Offer::decode(&fixed, &bytes[OFFER_LEN..]).unwrap(), offer);
        for name in ["../etc/passwd", "a/b", ".hidden", "sp ace"] {
            let o = Offer { name: name.into(), ..offer.clone() }.encode();
            let fixed: [u8; OFFER_LEN] = o[..OFFER_LEN].try_into().unwrap();
            let e = Offer::decode(&fixed, &o[OFFER_LEN..]).unwrap_err();
            assert!(e.to_string().contains("not a plain file name"), "{name}: {e}");
        }
        for a in [Answer::Accept, Answer::OtherHost, Answer::CannotMap, Answer::Mismatch, Answer::BadOffer] {
            assert_eq!(Answer::decode(&a.encode()).unwrap(), a);
        }
        assert!(Answer::decode(b"CoSA\x09\0\0\0").is_err());
    }

    #[test]
    fn a_mapping_of_the_wrong_size_or_alignment_is_refused() {
        let seg = Segment::in_heap(4096).unwrap();
        let len = segment_len(4096).unwrap();
        // SAFETY: never dereferenced: both calls are refused before a view exists.
        let short = unsafe { Segment::from_raw(seg.base.as_ptr(), len - 64, 4096, Arc::new(())) };
        assert!(matches!(short, Err(ShmError::BadMapping { .. })));
        // SAFETY: as above.
        let odd = unsafe { Segment::from_raw(seg.base.as_ptr().wrapping_add(8), len, 4096, Arc::new(())) };
        assert!(matches!(odd, Err(ShmError::BadMapping { align: 8, .. })));
        assert_eq!(segment_len(3000), Err(ShmError::BadCapacity(3000)));
    }

    proptest::proptest! {
        #[test]
        fn any_interleaving_of_writes_and_reads_delivers_the_bytes_in_order(
            ops in proptest::collection::vec(
                (proptest::prop_oneof![0usize..64, 0usize..9000], 0usize..9000, proptest::bool::ANY),
                1..40,
            ),
        ) {
            let (mut p, mut c, _seg) = pair(4096);
            let (mut sent, mut got) = (Vec::new(), Vec::new());
            let mut out = vec![0u8; 9000];
            for (i, (w, r, in_place)) in ops.into_iter().enumerate() {
                let chunk: Vec<u8> = (0..w).map(|j| (i * 31 + j) as u8).collect();
                let n = p.write([&chunk[..]]).unwrap();
                sent.extend_from_slice(&chunk[..n]);
                if in_place {
                    // Use `r` bytes of what it sees (claiming more releases only what it saw).
                    let seen = c.read_in_place(|b| {
                        got.extend_from_slice(&b[..r.min(b.len())]);
                        (r, b.len())
                    }).unwrap();
                    proptest::prop_assert!(seen <= 4096);
                } else {
                    let m = c.read(&mut out[..r]).unwrap();
                    got.extend_from_slice(&out[..m]);
                }
            }
            loop {
                let m = c.read(&mut out).unwrap();
                if m == 0 { break; }
                got.extend_from_slice(&out[..m]);
            }
            proptest::prop_assert_eq!(got, sent);
        }
    }
}
