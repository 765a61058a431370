//! The floor under a small allreduce over shared memory: two threads, each a rank, exchange
//! one 4-byte frame per iteration through a segment's two rings (header encoded, written,
//! spun for, decoded and the payload summed), with none of a work's lifecycle around it; then
//! the same with the core's bookkeeping of each work around the exchange (`_with_core`). The
//! distance between these and `cohort bench --ranks 2 -b 4 -e 4` is what the core's and then
//! the transport's and API's parts of the lifecycle cost; `docs/performance.md` compares them
//! with OpenMPI's vader.
//!
//! `cargo bench -p cohort-core --bench shm -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cohort_core::group::{Checked, Inline};
use cohort_core::protocol::{FrameHeader, FrameLimits, HEADER_LEN};
use cohort_core::shm::{Consumer, Direction, Producer, Segment};
use cohort_core::work::OpType;
use cohort_core::{Collective, DType, GroupConfig, GroupId, GroupState, Rank, SeqNo, TensorSpec};
use criterion::{Criterion, criterion_group, criterion_main};

const FRAME: usize = HEADER_LEN + 4;

/// One rank's side: send `value` for `seq`, wait for the peer's, and return the sum.
fn exchange(me: Rank, tx: &mut Producer, rx: &mut Consumer, seq: u64, value: f32, limits: &FrameLimits) -> f32 {
    let header = FrameHeader::data(GroupId(1), SeqNo(seq), 0, me, 4).encode();
    let payload = value.to_le_bytes();
    let wrote = tx.write([&header[..], &payload[..]]).expect("the bench's own ring is sound");
    assert_eq!(wrote, FRAME, "the ring has room for one frame a turn");
    while rx.available().expect("the bench's own ring is sound") < FRAME {
        std::hint::spin_loop();
    }
    // Copied out rather than read in place: a frame may wrap around the ring's end.
    let mut bytes = [0u8; FRAME];
    let read = rx.read(&mut bytes).expect("the bench's own ring is sound");
    assert_eq!(read, FRAME, "one whole frame waits");
    let head: &[u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().expect("a frame starts with its header");
    let header = FrameHeader::decode(head, limits).expect("the peer wrote a valid header");
    assert_eq!(header.seq, SeqNo(seq), "frames arrive in order");
    value + f32::from_le_bytes(bytes[HEADER_LEN..].try_into().expect("4 payload bytes"))
}

/// What a rank does each iteration: exchange one value with its peer, return the sum.
trait Side: Send + 'static {
    fn exchange(&mut self, me: Rank, tx: &mut Producer, rx: &mut Consumer, value: f32, limits: &FrameLimits) -> f32;
}

/// The exchange alone.
struct Bare {
    seq: u64,
}

impl Side for Bare {
    fn exchange(&mut self, me: Rank, tx: &mut Producer, rx: &mut Consumer, value: f32, limits: &FrameLimits) -> f32 {
        self.seq += 1;
        exchange(me, tx, rx, self.seq, value, limits)
    }
}

/// The exchange with the core's bookkeeping of a work that ends in its submit call around it,
/// as the transport's two-rank path keeps it: the clock read at submission and at the end,
/// [`GroupState::submit_inline`] (checks, made once for the kept description; sequence number,
/// flight-recorder entry, desync signature; the frame goes as soon as the work is numbered) and
/// [`GroupState::finish_inline`]. What is left between this and `cohort bench` is the
/// transport's and the API's own cost.
struct Core {
    group: GroupState,
    collective: Checked,
}

impl Core {
    fn new(me: Rank) -> Self {
        #[allow(clippy::disallowed_methods)] // a benchmark's own clock; the core has none
        let group = GroupState::new(GroupConfig::new(2), me, Instant::now());
        let collective = Collective::new(OpType::Allreduce).inputs(vec![TensorSpec::new(DType::F32, &[1])]);
        let collective = Checked::new(collective, me, 2).expect("a valid allreduce");
        Core { group, collective }
    }
}

impl Side for Core {
    fn exchange(&mut self, me: Rank, tx: &mut Producer, rx: &mut Consumer, value: f32, limits: &FrameLimits) -> f32 {
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        let Core { group, collective } = self;
        let started = group.submit_inline(now, collective, |_, seq| seq).expect("an idle, healthy group takes it");
        let Inline::Running(work, seq) = started else { panic!("an idle group runs it inline") };
        let sum = exchange(me, tx, rx, seq.0, value, limits);
        #[allow(clippy::disallowed_methods)]
        let end = Instant::now();
        black_box(group.finish_inline(end, work, [Rank(1 - me.0)]));
        sum
    }
}

/// Time `name`: rank 0 on the bench's thread and rank 1 on a thread of its own, each with the
/// side `side` makes for it, exchanging through one segment.
fn pair<S: Side>(c: &mut Criterion, name: &str, side: impl Fn(Rank) -> S) {
    let seg = Segment::in_heap(1 << 16).expect("a valid capacity");
    let (mut tx, mut rx) = (seg.producer(Direction::FromCreator), seg.consumer(Direction::FromAcceptor));
    let (mut peer_tx, mut peer_rx) = (seg.producer(Direction::FromAcceptor), seg.consumer(Direction::FromCreator));
    let (order, orders) = mpsc::channel::<u64>();
    let mut peer_side = side(Rank(1));
    let peer = std::thread::spawn(move || {
        let limits = FrameLimits::default();
        for iters in orders {
            for _ in 0..iters {
                black_box(peer_side.exchange(Rank(1), &mut peer_tx, &mut peer_rx, 2.0, &limits));
            }
        }
    });
    let limits = FrameLimits::default();
    let mut me = side(Rank(0));
    let mut g = c.benchmark_group("shm_exchange");
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            order.send(iters).expect("the peer thread runs");
            #[allow(clippy::disallowed_methods)] // a benchmark's own wall clock; the core has none
            let start = Instant::now();
            for _ in 0..iters {
                let sum = me.exchange(Rank(0), &mut tx, &mut rx, 1.0, &limits);
                assert_eq!(sum, 3.0);
            }
            start.elapsed()
        })
    });
    g.finish();
    drop(order);
    peer.join().expect("the peer thread ends");
}

fn pingpong(c: &mut Criterion) {
    pair(c, "allreduce_4B_two_threads", |_| Bare { seq: 0 });
}

fn pingpong_with_core(c: &mut Criterion) {
    pair(c, "allreduce_4B_two_threads_with_core", Core::new);
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = pingpong, pingpong_with_core
}
criterion_main!(benches);
