//! Flight-recorder hot path: recording and transitions into a full, wrapping ring of 2000.
//!
//! `CARGO_TARGET_DIR=/work/main/target cargo bench -p cohort-core --bench recorder -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Duration;

use cohort_core::DType;
use cohort_core::recorder::{DumpMeta, FlightRecorder, RecordRequest, RecorderConfig, TensorMeta};
use cohort_core::work::Rank;
use criterion::{Criterion, criterion_group, criterion_main};

const SHAPE: &[usize] = &[1024, 1024];
const TENSORS: &[TensorMeta<'static>] = &[TensorMeta { dtype: DType::F32, shape: SHAPE }];
/// Rotating through a few names exercises the interning lookup rather than one hot key.
const NAMES: [&str; 4] = ["tcp:all_reduce", "tcp:broadcast", "tcp:all_gather", "tcp:_reduce_scatter_base"];

fn request(seq: u64) -> RecordRequest<'static> {
    RecordRequest {
        pg_id: 0,
        pg_name: "0",
        pg_desc: "default_pg",
        collective_seq_id: seq,
        p2p_seq_id: 0,
        op_id: seq,
        profiling_name: NAMES[(seq % 4) as usize].into(),
        inputs: TENSORS,
        outputs: TENSORS,
        timeout: Duration::from_secs(600),
        is_p2p: false,
    }
}

/// A recorder whose ring of 2000 is already full, so every record overwrites.
fn full_recorder(timing: bool) -> (FlightRecorder, u64) {
    let mut fr = FlightRecorder::new(RecorderConfig { capacity: 2000, timing }, 1_700_000_000_000_000_000);
    fr.record_group(0, "0", "default_pg", &[0, 1, 2, 3]);
    let mut seq = 0;
    for _ in 0..4000 {
        seq += 1;
        let id = fr.record(Duration::from_nanos(seq), &request(seq)).expect("enabled");
        fr.handle_started(id, Duration::from_nanos(seq));
        fr.handle_completed(id, Duration::from_nanos(seq));
    }
    (fr, seq)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("recorder_2000_full");

    let (mut fr, mut seq) = full_recorder(true);
    g.bench_function("record", |b| {
        b.iter(|| {
            seq += 1;
            black_box(fr.record(Duration::from_nanos(seq), black_box(&request(seq))))
        })
    });

    let (mut fr, mut seq) = full_recorder(true);
    g.bench_function("record_start_complete", |b| {
        b.iter(|| {
            seq += 1;
            let now = Duration::from_nanos(seq);
            let id = fr.record(now, black_box(&request(seq))).expect("enabled");
            fr.handle_started(black_box(id), now);
            fr.handle_completed(black_box(id), now);
        })
    });

    // A transition on an entry the ring overwrote long ago: the lookup and the no-op.
    let (mut fr, seq) = full_recorder(true);
    let stale = {
        let mut f = FlightRecorder::new(RecorderConfig::new(1), 0);
        f.record(Duration::ZERO, &request(0)).expect("enabled")
    };
    g.bench_function("start_overwritten", |b| {
        b.iter(|| fr.handle_started(black_box(stale), Duration::from_nanos(seq)))
    });

    let mut off = FlightRecorder::new(RecorderConfig::new(0), 0);
    g.bench_function("record_disabled", |b| b.iter(|| black_box(off.record(Duration::ZERO, black_box(&request(1))))));

    let (fr, _) = full_recorder(true);
    g.bench_function("dump_to_json", |b| b.iter(|| black_box(fr.dump(DumpMeta::new(Rank(0), 4)).to_json())));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
