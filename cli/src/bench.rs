//! `cohort bench`: collective benchmarks in the nccl-tests format.
//!
//! Without `RANK`/`WORLD_SIZE` in the environment it starts `--ranks` local processes (this
//! executable, same arguments) and rank 0 prints the table; under `cohort launch` or torchrun
//! it runs as the one rank the environment names, so the same command measures across machines.
//!
//! The sweep, the table and the checks are shared; a `Backend` runs the op. TCP (`Tcp`) waits
//! for each iteration before the next; NCCL (`nccl::Nccl`, feature `nccl`, one CUDA device per
//! rank) enqueues every iteration first and waits once, as nccl-tests does.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use clap::{Args, ValueEnum};
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Tensor};
use cohort_transports::ProcessGroup;

/// Arguments of `cohort bench` (the nccl-tests flags where they exist).
#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  cohort bench -b 8 -e 64M -f 4 -o allreduce --ranks 2\n  \
    cohort bench -o allgather -d half -b 1K -e 16M -f 4 --ranks 4 --json\n  \
    cohort launch -n 2 -- cohort bench -o broadcast -b 1M -e 1M   # one rank per launched process\n\n\
    Columns as nccl-tests: time is the mean per iteration (the slowest rank's), algbw = size / time,\n\
    busbw = algbw × the op's bus factor (allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall\n\
    (n-1)/n; broadcast, reduce, sendrecv 1).\n\n\
    --transport nccl (a build with --features nccl): each rank on CUDA device LOCAL_RANK modulo the\n\
    devices visible (or COHORT_CUDA_DEVICE); every iteration is enqueued before the wait, and\n\
    --json's times_us are the device's (CUDA event) times.")]
pub(crate) struct BenchArgs {
    /// Smallest size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: u64,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    max_bytes: u64,
    /// Multiply the size by this factor between rows.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..))]
    factor: u64,
    /// The collective.
    #[arg(short = 'o', long = "op", value_enum, default_value_t = BenchOp::Allreduce)]
    op: BenchOp,
    /// Element type (float, half, bfloat16, double, int8, uint8, int32, int64, bool).
    #[arg(short = 'd', long = "datatype", default_value = "float", value_parser = parse_dtype)]
    dtype: DType,
    /// Reduction (sum, prod, min, max, avg) for allreduce, reduce and reduce_scatter.
    #[arg(short = 'r', long = "redop", default_value = "sum", value_parser = parse_redop)]
    redop: ReduceOp,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed iterations first.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u32,
    /// Check results against a reference (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    check: u8,
    /// Root rank of broadcast and reduce.
    #[arg(long, default_value_t = 0)]
    root: u32,
    /// Works in flight: each iteration submits this many (each on its own tensor) before
    /// waiting for them; the time is per work. With `-b 0 -e 0` it measures the work
    /// lifecycle's own overhead.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    inflight: u32,
    /// Local rank processes to start (ignored when RANK and WORLD_SIZE are set).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    ranks: u32,
    /// The backend.
    #[arg(long, value_enum, default_value_t = Transport::Tcp)]
    transport: Transport,
    /// One JSON object per size on stdout (with every iteration's time) instead of the table.
    #[arg(long)]
    json: bool,
    /// Read the clock only before and after the timed loop, as the MPI and torch anchors do,
    /// not after every iteration: a clock read costs a few percent of a small op's time. The
    /// TCP table always times the whole loop; with --json, `times_us` is then empty and
    /// `median_us` null. (NCCL's times are the device's, taken either way.)
    #[arg(long)]
    whole_loop: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BenchOp {
    Allreduce,
    Allgather,
    Broadcast,
    Reduce,
    #[value(name = "reduce_scatter", alias = "reduce-scatter")]
    ReduceScatter,
    Alltoall,
    Sendrecv,
    Barrier,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Transport {
    Tcp,
    Nccl,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (a number of bytes, optionally with K, M or G)"))
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).ok_or_else(|| {
        format!("{s:?} is not a datatype (float, half, bfloat16, double, int8, uint8, int32, int64, bool)")
    })
}

fn parse_redop(s: &str) -> Result<ReduceOp, String> {
    match ReduceOp::parse(s) {
        Some(op @ (ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max | ReduceOp::Avg)) => Ok(op),
        _ => Err(format!("{s:?} is not a reduction (sum, prod, min, max, avg)")),
    }
}

/// nccl-tests' name of a dtype.
fn type_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F16 => "half",
        DType::Bf16 => "bfloat16",
        DType::F64 => "double",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::Bool => "bool",
    }
}

fn redop_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "sum",
        ReduceOp::Product => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::Avg => "avg",
        _ => "other",
    }
}

impl BenchArgs {
    /// Whether the TCP backend reads the clock after every iteration: only for `--json`'s
    /// `times_us`, unless `--whole-loop` says not to.
    fn per_iteration(&self) -> bool {
        self.json && !self.whole_loop
    }
}

impl BenchOp {
    fn name(self) -> &'static str {
        match self {
            BenchOp::Allreduce => "allreduce",
            BenchOp::Allgather => "allgather",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::Alltoall => "alltoall",
            BenchOp::Sendrecv => "sendrecv",
            BenchOp::Barrier => "barrier",
        }
    }

    fn reduces(self) -> bool {
        matches!(self, BenchOp::Allreduce | BenchOp::Reduce | BenchOp::ReduceScatter)
    }

    fn rooted(self) -> bool {
        matches!(self, BenchOp::Broadcast | BenchOp::Reduce)
    }

    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n);
        match self {
            BenchOp::Allreduce => 2.0 * (n - 1.0) / n,
            BenchOp::Allgather | BenchOp::ReduceScatter | BenchOp::Alltoall => (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::Reduce | BenchOp::Sendrecv => 1.0,
            BenchOp::Barrier => 0.0,
        }
    }

    /// Element counts must be a multiple of this (the per-rank pieces are equal).
    fn align(self, n: u32) -> usize {
        match self {
            BenchOp::Allgather | BenchOp::ReduceScatter | BenchOp::Alltoall => n as usize,
            _ => 1,
        }
    }
}

/// Run the benchmark; returns the exit code.
pub(crate) fn run(args: BenchArgs) -> Result<i32, String> {
    if args.min_bytes > args.max_bytes {
        return Err(format!("-b {} is larger than -e {}", args.min_bytes, args.max_bytes));
    }
    #[cfg(not(feature = "nccl"))]
    if args.transport == Transport::Nccl {
        return Err("--transport nccl: NCCL backend unavailable: this build of cohort has no NCCL support \
                    (build it with --features nccl)"
            .into());
    }
    if args.op.reduces() && args.dtype == DType::Bool && args.redop == ReduceOp::Avg {
        return Err("-r avg is not defined for -d bool".into());
    }
    let vars = cohort_transports::Env::process();
    let in_rank = vars.is_set(cohort_transports::env::RANK) && vars.is_set(cohort_transports::env::WORLD_SIZE);
    match args.transport {
        Transport::Tcp if in_rank => run_tcp_rank(&args),
        #[cfg(feature = "nccl")]
        Transport::Nccl if in_rank => nccl::run_rank(&args),
        #[cfg(feature = "nccl")]
        Transport::Nccl => {
            // Here rather than in every rank: one clear line when this machine has no GPU.
            nccl::check_local_devices(args.ranks)?;
            spawn_ranks(&args)
        }
        _ => spawn_ranks(&args),
    }
}

/// Start `--ranks` copies of this executable as local ranks and relay rank 0's output. This
/// process hosts the store on a port the OS picks (a port picked here and bound by rank 0
/// later could be taken in between), and the first rank to fail stops the others: they would
/// otherwise wait out the rendezvous or collective timeout for a rank that is gone.
fn spawn_ranks(args: &BenchArgs) -> Result<i32, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the cohort executable: {e}"))?;
    let store = crate::launch::HostedStore::start(0).map_err(|e| format!("cannot host the store: {e}"))?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for rank in 0..args.ranks {
        let spawned = Command::new(&exe)
            .args(&argv)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", store.port.to_string())
            .env("COHORT_STORE_HOSTED", "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", args.ranks.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", args.ranks.to_string())
            .stdin(Stdio::null())
            .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::inherit())
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    let relay = children[0].stdout.take().map(|out| {
        std::thread::spawn(move || {
            let mut stdout = std::io::stdout();
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = writeln!(stdout, "{line}");
                let _ = stdout.flush();
            }
        })
    });
    let mut done = vec![false; children.len()];
    let mut code = 0;
    while done.contains(&false) {
        let mut failed = false;
        for (rank, (child, done)) in children.iter_mut().zip(done.iter_mut()).enumerate().filter(|(_, (_, d))| !**d) {
            match child.try_wait() {
                Ok(None) => continue,
                Ok(Some(s)) if s.success() => {}
                Ok(Some(s)) => {
                    eprintln!("cohort bench: rank {rank} ended with {s}");
                    failed = true;
                    if code == 0 {
                        code = s.code().unwrap_or(1).max(1);
                    }
                }
                Err(e) => {
                    eprintln!("cohort bench: cannot wait for rank {rank}: {e}");
                    let _ = child.kill();
                    failed = true;
                    code = code.max(1);
                }
            }
            *done = true;
        }
        if failed {
            for (rank, (child, done)) in children.iter_mut().zip(done.iter_mut()).enumerate().filter(|(_, (_, d))| !**d)
            {
                eprintln!("cohort bench: stopping rank {rank}");
                let _ = child.kill();
                let _ = child.wait();
                *done = true;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    if let Some(relay) = relay {
        let _ = relay.join();
    }
    drop(store);
    Ok(code)
}

/// What the sweep needs from a backend. Every rank calls the methods in the same order: each
/// runs collectives.
trait Backend {
    /// The backend's name in the header and in the JSON rows.
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> u32;
    /// Number of ranks.
    fn world_size(&self) -> u32;
    /// A header line about this rank's device, if it has one.
    fn describe(&self) -> Option<String> {
        None
    }
    /// `args.warmup` untimed iterations, then `args.iters` timed ones, each of `args.inflight`
    /// works on buffers of `shape`: this rank's times.
    fn time(&mut self, args: &BenchArgs, shape: Shape) -> Result<Timing, String>;
    /// One iteration on fresh inputs: each work's result, on the host.
    fn outputs(&mut self, args: &BenchArgs, shape: Shape) -> Result<Vec<Tensor>, String>;
    /// The largest `v` of all ranks.
    fn max(&self, v: f64) -> Result<f64, String>;
    /// The sum of `v` over all ranks.
    fn sum(&self, v: u64) -> Result<u64, String>;
}

/// One rank's times for one size, µs per work.
#[derive(Debug)]
struct Timing {
    /// Every timed iteration's time.
    times_us: Vec<f64>,
    /// The mean over all timed iterations.
    mean_us: f64,
}

/// The element counts of one size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    /// Elements of the op's whole buffer (allgather's output, reduce_scatter's input), rounded
    /// down to whole per-rank pieces; 0 for barrier.
    count: usize,
    /// Elements of each rank's input (allgather's is one rank's piece).
    in_count: usize,
    /// Elements of each rank's output (reduce_scatter's is one rank's piece).
    out_count: usize,
}

impl Shape {
    fn new(args: &BenchArgs, n: u32, size: usize) -> Shape {
        let align = args.op.align(n);
        let count = if args.op == BenchOp::Barrier { 0 } else { size / args.dtype.size() / align * align };
        let piece = count / n as usize;
        Shape {
            count,
            in_count: if args.op == BenchOp::Allgather { piece } else { count },
            out_count: if args.op == BenchOp::ReduceScatter { piece } else { count },
        }
    }
}

/// One size's figures.
#[derive(Debug)]
struct Row {
    bytes: usize,
    count: usize,
    /// Every timed iteration's time on this rank, µs.
    times_us: Vec<f64>,
    /// The mean per iteration, the slowest rank's, µs.
    mean_us: f64,
    wrong: u64,
}

/// The sweep over sizes on any backend; rank 0 writes the table (or the JSON rows) to `out`.
/// Returns the exit code: 1 when a result was wrong.
fn sweep(b: &mut impl Backend, args: &BenchArgs, out: &mut dyn Write) -> Result<i32, String> {
    let n = b.world_size();
    if args.op.rooted() && args.root >= n {
        return Err(format!("--root {} is not a rank of a {n}-rank group", args.root));
    }
    let print = b.rank() == 0;
    let mut emit = |text: &str| -> Result<(), String> {
        if !print {
            return Ok(());
        }
        out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(|e| format!("cannot write the results: {e}"))
    };
    if !args.json {
        emit(&header(args, n, b.name(), b.describe().as_deref()))?;
    }
    let mut total_wrong = 0;
    let mut busbw_sum = 0.0;
    let mut rows = 0;
    for size in sizes(args) {
        let row = bench_size(b, args, size as usize)?;
        total_wrong += row.wrong;
        let secs = row.mean_us / 1e6;
        let algbw = if secs > 0.0 { row.bytes as f64 / secs / 1e9 } else { 0.0 };
        let busbw = algbw * args.op.bus_factor(n);
        busbw_sum += busbw;
        rows += 1;
        emit(&row_text(args, n, b.name(), &row, algbw, busbw))?;
    }
    if !args.json {
        let verdict = if total_wrong == 0 { "OK" } else { "FAILED" };
        let avg = if rows > 0 { busbw_sum / f64::from(rows) } else { 0.0 };
        emit(&format!("# Out of bounds values : {total_wrong} {verdict}\n# Avg bus bandwidth    : {avg:.4} \n#\n"))?;
    }
    Ok(if total_wrong > 0 { 1 } else { 0 })
}

/// The sizes of the rows, in bytes: from `-b`, times `-f`, up to `-e` (one row for barrier).
fn sizes(args: &BenchArgs) -> Vec<u64> {
    let mut sizes = Vec::new();
    let mut s = args.min_bytes;
    loop {
        sizes.push(s);
        if args.op == BenchOp::Barrier {
            break;
        }
        match s.checked_mul(args.factor) {
            Some(next) if next <= args.max_bytes && s > 0 => s = next,
            _ if s == 0 && args.max_bytes > 0 => s = 1,
            _ => break,
        }
    }
    sizes
}

/// One size: time it, take the slowest rank's mean, and check one more iteration.
fn bench_size(b: &mut impl Backend, args: &BenchArgs, size: usize) -> Result<Row, String> {
    let n = b.world_size();
    let shape = Shape::new(args, n, size);
    let timing = b.time(args, shape)?;
    let mean_us = b.max(timing.mean_us)?;
    let mut wrong = 0;
    if args.check == 1 && args.op != BenchOp::Barrier {
        let got = b.outputs(args, shape)?;
        wrong = b.sum(count_wrong(args.dtype, &got, &expected(args, n, b.rank(), shape.count)))?;
    }
    let bytes = shape.count * args.dtype.size();
    Ok(Row { bytes, count: shape.count, times_us: timing.times_us, mean_us, wrong })
}

/// Elements of `got` (one tensor per work) that differ from `want`; a tensor of the wrong
/// length is wrong throughout. Nothing is wrong when nothing is expected.
fn count_wrong(dtype: DType, got: &[Tensor], want: &[f64]) -> u64 {
    if want.is_empty() {
        return 0;
    }
    got.iter()
        .map(Tensor::to_f64s)
        .map(|got| {
            if got.len() != want.len() {
                want.len() as u64
            } else {
                got.iter().zip(want).filter(|(g, w)| !close(dtype, **g, **w)).count() as u64
            }
        })
        .sum()
}

/// The table's header (nccl-tests' columns).
fn header(args: &BenchArgs, n: u32, backend: &str, device: Option<&str>) -> String {
    let mut text = format!(
        "# cohort bench: {} over {} ranks ({backend}), {} iters, {} warmup iters, {} in flight, check {}\n",
        args.op.name(),
        n,
        args.iters,
        args.warmup,
        args.inflight,
        args.check
    );
    if let Some(device) = device {
        text += &format!("# {device}\n");
    }
    text += "#\n";
    text += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}\n",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    );
    text += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}\n",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    text
}

/// One row of the table, or one JSON object, with its newline.
fn row_text(args: &BenchArgs, n: u32, backend: &str, row: &Row, algbw: f64, busbw: f64) -> String {
    let root = if args.op.rooted() { args.root as i64 } else { -1 };
    let redop = if args.op.reduces() { redop_name(args.redop) } else { "none" };
    if args.json {
        let mut sorted = row.times_us.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied();
        let obj = serde_json::json!({
            "op": args.op.name(), "ranks": n, "transport": backend, "inflight": args.inflight,
            "size": row.bytes, "count": row.count, "type": type_name(args.dtype), "redop": redop, "root": root,
            "time_us": row.mean_us, "median_us": median, "algbw": algbw, "busbw": busbw,
            "wrong": if args.check == 1 { Some(row.wrong) } else { None },
            "times_us": row.times_us,
        });
        format!("{obj}\n")
    } else {
        let wrong = if args.check == 1 { row.wrong.to_string() } else { "N/A".into() };
        format!(
            "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9.2}  {:>7.3}  {:>7.3}  {:>6}\n",
            row.bytes,
            row.count,
            type_name(args.dtype),
            redop,
            root,
            row.mean_us,
            algbw,
            busbw,
            wrong
        )
    }
}

/// Rank `r`'s input at element `i`: small integers, exact in every dtype. For products, only
/// 1 and 2 (so that the product of a few ranks stays exact).
fn value(args: &BenchArgs, r: u32, i: usize) -> f64 {
    if args.dtype == DType::Bool {
        return f64::from(u8::from(!(i + r as usize).is_multiple_of(3)));
    }
    if args.op.reduces() && args.redop == ReduceOp::Product {
        return ((i + r as usize) % 2 + 1) as f64;
    }
    f64::from(r + 1) * ((i % 7) as f64 + 1.0)
}

/// Rank `r`'s input, built a piece at a time (a whole-tensor `f64` staging copy would be the
/// largest allocation of a large run and distort its peak memory).
fn input(args: &BenchArgs, r: u32, count: usize) -> Tensor {
    const PIECE: usize = 1 << 14;
    let es = args.dtype.size();
    let mut t = Tensor::zeros(args.dtype, &[count]).expect("a 1-d shape is valid");
    for (p, out) in t.bytes_mut().chunks_mut(PIECE * es).enumerate() {
        let v: Vec<f64> = (p * PIECE..p * PIECE + out.len() / es).map(|i| value(args, r, i)).collect();
        out.copy_from_slice(Tensor::from_f64s(args.dtype, &v).bytes());
    }
    t
}

fn reduce_col(args: &BenchArgs, n: u32, i: usize) -> f64 {
    let col = (0..n).map(|r| value(args, r, i));
    let v = match args.redop {
        ReduceOp::Sum | ReduceOp::Avg => col.sum::<f64>(),
        ReduceOp::Product => col.product(),
        ReduceOp::Min => col.fold(f64::MAX, f64::min),
        _ => col.fold(f64::MIN, f64::max),
    };
    match (args.redop, args.dtype) {
        (_, DType::Bool) => f64::from(u8::from(v != 0.0)),
        (ReduceOp::Avg, d) if d.is_floating_point() => v / f64::from(n),
        (ReduceOp::Avg, _) => (v / f64::from(n)).trunc(),
        _ => v,
    }
}

/// What rank `me` should hold after one iteration on fresh inputs.
fn expected(args: &BenchArgs, n: u32, me: u32, count: usize) -> Vec<f64> {
    let k = count / n as usize;
    match args.op {
        BenchOp::Allreduce => (0..count).map(|i| reduce_col(args, n, i)).collect(),
        BenchOp::Reduce if me == args.root => (0..count).map(|i| reduce_col(args, n, i)).collect(),
        BenchOp::Reduce => Vec::new(), // other ranks' buffers are not specified
        BenchOp::Broadcast => (0..count).map(|i| value(args, args.root, i)).collect(),
        BenchOp::Allgather => (0..count).map(|i| value(args, (i / k) as u32, i % k)).collect(),
        BenchOp::ReduceScatter => (0..k).map(|i| reduce_col(args, n, me as usize * k + i)).collect(),
        // Rank s sends its piece `me` (elements [me·k, (me+1)·k) of its input) to `me`.
        BenchOp::Alltoall => (0..count).map(|i| value(args, (i / k) as u32, me as usize * k + i % k)).collect(),
        BenchOp::Sendrecv => (0..count).map(|i| value(args, (me + n - 1) % n, i)).collect(),
        BenchOp::Barrier => Vec::new(),
    }
}

fn close(dtype: DType, got: f64, want: f64) -> bool {
    match dtype {
        DType::F16 | DType::Bf16 => (got - want).abs() <= want.abs() * 1e-2 + 1e-2,
        DType::F32 => (got - want).abs() <= want.abs() * 1e-5,
        _ => got == want,
    }
}

// ---- TCP ----

fn run_tcp_rank(args: &BenchArgs) -> Result<i32, String> {
    let pg = cohort_transports::tcp::init_process_group().map_err(|e| format!("init_process_group: {e}"))?;
    let mut tcp = Tcp(pg);
    let code = sweep(&mut tcp, args, &mut std::io::stdout())?;
    tcp.0.shutdown();
    Ok(code)
}

/// The TCP backend: each iteration submits its works on host tensors and waits for them.
#[derive(Debug)]
struct Tcp(ProcessGroup);

impl Backend for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> u32 {
        self.0.rank().0
    }

    fn world_size(&self) -> u32 {
        self.0.world_size()
    }

    fn describe(&self) -> Option<String> {
        let shared = self.0.shared_memory_peers();
        let peers = self.0.world_size().saturating_sub(1);
        Some(match shared.as_slice() {
            [] => format!("rank {}: TCP to every peer (no shared memory)", self.rank()),
            _ => format!(
                "rank {}: shared memory with ranks {} ({} of {peers} peers; TCP to the others)",
                self.rank(),
                cohort_core::work::rank_ranges(&shared),
                shared.len(),
            ),
        })
    }

    fn time(&mut self, args: &BenchArgs, shape: Shape) -> Result<Timing, String> {
        let pg = &self.0;
        let me = pg.rank().0;
        let Shape { count, in_count, .. } = shape;
        let k = args.inflight as usize;
        // Inputs whose shape the op keeps are chained from one iteration to the next (no spare
        // copy is held: peak memory is the op's own); the others restart from a copy of the input.
        let chains = !matches!(args.op, BenchOp::Allgather | BenchOp::ReduceScatter);
        let fresh = (!chains).then(|| input(args, me, in_count));
        let inputs = |data: Vec<Tensor>| -> Vec<Tensor> {
            match &fresh {
                Some(f) => vec![f.clone(); k],
                None => data,
            }
        };
        let mut data: Vec<Tensor> =
            if chains { (0..k).map(|_| input(args, me, in_count)).collect() } else { Vec::new() };
        for _ in 0..args.warmup {
            data = once(pg, args, inputs(data), count)?;
        }
        sync(pg)?;
        // Written through before the clock starts: a page of it touched first inside the loop
        // would put the kernel's fault (a 2 MiB page zeroed, where huge pages are on) into
        // one iteration's time.
        // (Not zeros, which a fresh mapping may hand out without touching a page.)
        if !args.per_iteration() {
            let start = Instant::now();
            for _ in 0..args.iters {
                data = once(pg, args, inputs(data), count)?;
            }
            let mean_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(args.iters) / k as f64;
            return Ok(Timing { times_us: Vec::new(), mean_us });
        }
        let mut times_us = std::hint::black_box(vec![-1.0; args.iters as usize]);
        let start = Instant::now();
        // One clock read an iteration, as its end is the next one's start.
        let mut t = start;
        for slot in &mut times_us {
            data = once(pg, args, inputs(data), count)?;
            let end = Instant::now();
            *slot = (end - t).as_secs_f64() * 1e6 / k as f64;
            t = end;
        }
        let mean_us = (t - start).as_secs_f64() * 1e6 / f64::from(args.iters) / k as f64;
        Ok(Timing { times_us, mean_us })
    }

    fn outputs(&mut self, args: &BenchArgs, shape: Shape) -> Result<Vec<Tensor>, String> {
        let pg = &self.0;
        let fresh = input(args, pg.rank().0, shape.in_count);
        once(pg, args, vec![fresh; args.inflight as usize], shape.count)
    }

    fn max(&self, v: f64) -> Result<f64, String> {
        let w = self.0.allreduce(vec![Tensor::from_slice(&[v])], ReduceOp::Max).map_err(|e| e.to_string())?;
        let out = w.result().map_err(|e| e.to_string())?;
        Ok(out[0].to_f64s()[0])
    }

    fn sum(&self, v: u64) -> Result<u64, String> {
        let w = self.0.allreduce(vec![Tensor::from_slice(&[v as i64])], ReduceOp::Sum).map_err(|e| e.to_string())?;
        let out = w.result().map_err(|e| e.to_string())?;
        Ok(out[0].to_f64s()[0] as u64)
    }
}

/// Submit the op on `data`; the work's first output becomes the next iteration's input.
fn submit(pg: &ProcessGroup, args: &BenchArgs, data: Tensor, count: usize) -> Result<Pending, String> {
    let n = pg.world_size();
    let me = pg.rank().0;
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", args.op.name());
    let one = |w: Result<cohort_transports::Work, cohort_core::group::SubmitError>| w.map_err(|e| fail(&e));
    Ok(match args.op {
        BenchOp::Allreduce => Pending::Output(one(pg.allreduce(vec![data], args.redop))?),
        BenchOp::Broadcast => Pending::Output(one(pg.broadcast(vec![data], args.root))?),
        BenchOp::Reduce => Pending::Output(one(pg.reduce(vec![data], args.root, args.redop))?),
        BenchOp::Allgather => Pending::Output(one(pg.allgather_into_tensor(data))?),
        BenchOp::ReduceScatter => Pending::Output(one(pg.reduce_scatter_tensor(data, args.redop))?),
        BenchOp::Alltoall => {
            let out = Tensor::zeros(args.dtype, &[count]).map_err(|e| fail(&e))?;
            Pending::Output(one(pg.alltoall_base(out, data, None, None))?)
        }
        BenchOp::Sendrecv if n == 1 => Pending::Ready(data),
        BenchOp::Sendrecv => {
            let to = (me + 1) % n;
            let from = (me + n - 1) % n;
            let dst = Tensor::zeros(args.dtype, &[count]).map_err(|e| fail(&e))?;
            let send = one(pg.send(data, to, 0))?;
            Pending::SendRecv(send, one(pg.recv(dst, from, 0))?)
        }
        BenchOp::Barrier => Pending::Kept(one(pg.barrier())?, data),
    })
}

/// A submitted iteration.
enum Pending {
    /// The work's first output is the result.
    Output(cohort_transports::Work),
    /// A send and the recv whose output is the result.
    SendRecv(cohort_transports::Work, cohort_transports::Work),
    /// The work has no output; the input is kept.
    Kept(cohort_transports::Work, Tensor),
    /// Nothing to wait for.
    Ready(Tensor),
}

impl Pending {
    fn wait(self, args: &BenchArgs) -> Result<Tensor, String> {
        let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", args.op.name());
        let output = |work: cohort_transports::Work| -> Result<Tensor, String> {
            let mut out = work.result().map_err(|e| fail(&e))?;
            out.pop().ok_or_else(|| format!("{}: no output tensor", args.op.name()))
        };
        match self {
            Pending::Output(work) => output(work),
            Pending::SendRecv(send, recv) => {
                let got = output(recv)?;
                send.wait().map_err(|e| fail(&e))?;
                Ok(got)
            }
            Pending::Kept(work, data) => {
                work.wait().map_err(|e| fail(&e))?;
                Ok(data)
            }
            Pending::Ready(data) => Ok(data),
        }
    }
}

/// One iteration: submit the op on every tensor of `data` (one work each), then wait for all.
fn once(pg: &ProcessGroup, args: &BenchArgs, mut data: Vec<Tensor>, count: usize) -> Result<Vec<Tensor>, String> {
    if let ([_], BenchOp::Allreduce) = (&data[..], args.op) {
        // One allreduce in flight (the default): the vector goes in and comes back as the
        // work's outputs, as a user's loop of `tensors = pg.allreduce(tensors, op).result()`
        // has it, so that the loop allocates nothing of its own in a small op's time.
        let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", args.op.name());
        let out = pg.allreduce(data, args.redop).map_err(|e| fail(&e))?.result().map_err(|e| fail(&e))?;
        if out.len() != 1 {
            return Err(format!("{}: {} output tensors, not 1", args.op.name(), out.len()));
        }
        return Ok(out);
    }
    if let [_] = &data[..] {
        // One in flight: the vector carries the tensor to the next iteration, and no vector of
        // pending works is built, so that the loop's own allocations stay out of a small op's
        // time.
        let t = data.pop().expect("one tensor");
        data.push(submit(pg, args, t, count)?.wait(args)?);
        return Ok(data);
    }
    let works = data.into_iter().map(|t| submit(pg, args, t, count)).collect::<Result<Vec<_>, _>>()?;
    works.into_iter().map(|w| w.wait(args)).collect()
}

fn sync(pg: &ProcessGroup) -> Result<(), String> {
    pg.barrier().map_err(|e| format!("barrier: {e}"))?.wait().map_err(|e| format!("barrier: {e}"))
}

/// `--transport nccl`: the sweep on an [`NcclProcessGroup`], as nccl-tests runs it. Generic over
/// the device so that the unit tests run it on the host emulation; the CUDA device and the
/// store behind it come with the `nccl` feature.
#[cfg(any(feature = "nccl", test))]
mod nccl {
    use std::time::Instant;

    use cohort_core::reduce::ReduceOp;
    use cohort_core::tensor::Tensor;
    use cohort_transports::Work;
    use cohort_transports::nccl::{Device, DeviceTensor, NcclError, NcclProcessGroup, P2pOp};

    use super::{Backend, BenchArgs, BenchOp, Shape, Timing, input};

    /// One rank of `cohort bench --transport nccl` under torchrun's environment: the CUDA device
    /// `COHORT_CUDA_DEVICE`, else `LOCAL_RANK` modulo the devices visible; rank 0 hosts the store
    /// unless a launcher does (`COHORT_STORE_HOSTED=1`); `COHORT_*`/`TORCH_NCCL_*` options apply,
    /// with timing always on (the JSON rows' `times_us` are the device's times).
    #[cfg(feature = "nccl")]
    pub(super) fn run_rank(args: &BenchArgs) -> Result<i32, String> {
        use std::sync::Arc;

        use cohort_transports::nccl::NcclOptions;
        use cohort_transports::nccl::cuda::{self, CudaDevice};
        use cohort_transports::nccl::device::version_text;
        use cohort_transports::tcp::{InitConfig, rendezvous_store};

        let cfg = InitConfig::from_env().map_err(|e| format!("init_process_group: {e}"))?;
        let count = cuda::device_count().map_err(|e| format!("--transport nccl: {e}"))?;
        let explicit = cohort_transports::Env::process().string(cohort_transports::env::CUDA_DEVICE);
        let ordinal = device_ordinal(explicit.as_deref(), cfg.local_rank, count)?;
        let device = Arc::new(CudaDevice::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}"))?);
        let mut opts = NcclOptions::from_env().map_err(|e| e.to_string())?;
        opts.enable_timing = true;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("cohort-bench")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the runtime: {e}"))?;
        let (pg, _server) = runtime.block_on(async {
            let (store, server) = rendezvous_store(&cfg, opts.init_timeout)
                .await
                .map_err(|e| format!("the store at {}:{}: {e}", cfg.master_addr, cfg.master_port))?;
            let handle = tokio::runtime::Handle::current();
            let pg = NcclProcessGroup::new(device, store, "bench", cfg.rank, cfg.world_size, opts, handle)
                .await
                .map_err(|e| format!("NCCL process group on CUDA device {ordinal}: {e}"))?;
            Ok::<_, String>((pg, server))
        })?;
        let version = pg.device().nccl_version().map_or_else(|e| e.to_string(), version_text);
        let name = pg.device().name().unwrap_or_else(|e| e.to_string());
        let mut nccl = Nccl::new(pg, format!("rank 0: CUDA device {ordinal} ({name}), NCCL {version}"));
        let code = super::sweep(&mut nccl, args, &mut std::io::stdout())?;
        nccl.pg.shutdown().map_err(|e| format!("shutdown: {e}"))?;
        Ok(code)
    }

    /// Before starting `ranks` local ranks: a GPU and NCCL are there, and a device for each rank
    /// (NCCL refuses two ranks of one communicator on one device).
    #[cfg(feature = "nccl")]
    pub(super) fn check_local_devices(ranks: u32) -> Result<(), String> {
        let count = cohort_transports::nccl::cuda::device_count().map_err(|e| format!("--transport nccl: {e}"))?;
        enough_devices(ranks, count)
    }

    /// The CUDA device of a rank: `explicit` (`COHORT_CUDA_DEVICE`) when set, else `local_rank`
    /// modulo the `count` devices visible.
    pub(super) fn device_ordinal(explicit: Option<&str>, local_rank: u32, count: usize) -> Result<usize, String> {
        if count == 0 {
            return Err("--transport nccl: no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".into());
        }
        match explicit {
            None => Ok(local_rank as usize % count),
            Some(v) => match v.trim().parse::<usize>() {
                Ok(d) if d < count => Ok(d),
                Ok(d) => Err(format!("COHORT_CUDA_DEVICE={d}: only {count} CUDA devices are visible")),
                Err(_) => Err(format!("COHORT_CUDA_DEVICE={v:?} is not a device number")),
            },
        }
    }

    /// Whether `count` visible devices can hold `ranks` local ranks, one each.
    pub(super) fn enough_devices(ranks: u32, count: usize) -> Result<(), String> {
        if count == 0 {
            return Err("--transport nccl: no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".into());
        }
        if ranks as usize > count {
            return Err(format!(
                "--transport nccl --ranks {ranks}: NCCL needs a CUDA device per rank, {count} visible \
                 (use --ranks {count}, or cohort launch across machines)"
            ));
        }
        Ok(())
    }

    /// The NCCL backend: inputs are made on the host and copied to the device once per size;
    /// every iteration is enqueued before any is waited for, and the time is the wall time of
    /// them all, as nccl-tests measures it.
    pub(super) struct Nccl<D: Device> {
        pub(super) pg: NcclProcessGroup<D>,
        describe: String,
    }

    /// One work's buffers: its input, and its output when the op writes out of place.
    struct Slot<D: Device> {
        input: DeviceTensor<D>,
        output: Option<DeviceTensor<D>>,
    }

    impl<D: Device> Slot<D> {
        /// Where the op leaves its result.
        fn result(&self) -> &DeviceTensor<D> {
            self.output.as_ref().unwrap_or(&self.input)
        }
    }

    impl<D: Device> Nccl<D> {
        /// The backend on `pg`; `describe` is the header's device line.
        pub(super) fn new(pg: NcclProcessGroup<D>, describe: String) -> Nccl<D> {
            Nccl { pg, describe }
        }

        /// `args.inflight` slots holding this rank's input (copied from one host tensor).
        fn slots(&self, args: &BenchArgs, shape: Shape) -> Result<Vec<Slot<D>>, String> {
            let host = input(args, self.pg.rank().0, shape.in_count);
            let out_of_place = match args.op {
                BenchOp::Allgather | BenchOp::ReduceScatter | BenchOp::Alltoall => true,
                BenchOp::Sendrecv => self.pg.world_size() > 1,
                _ => false,
            };
            (0..args.inflight)
                .map(|_| {
                    let input = self.pg.to_device(&host).map_err(|e| format!("copy to the device: {e}"))?;
                    let output = if out_of_place {
                        Some(self.pg.zeros(args.dtype, &[shape.out_count]).map_err(|e| format!("allocate: {e}"))?)
                    } else {
                        None
                    };
                    Ok(Slot { input, output })
                })
                .collect()
        }

        /// Enqueues the op on one slot: its works (a send and a receive for sendrecv).
        fn enqueue(&self, args: &BenchArgs, slot: &Slot<D>) -> Result<Vec<Work>, String> {
            let pg = &self.pg;
            let (n, me) = (pg.world_size(), pg.rank().0);
            let fail = |e: NcclError| format!("{}: {e}", args.op.name());
            let x = &slot.input;
            let out = slot.result();
            let one = |w: Result<Work, NcclError>| w.map(|w| vec![w]).map_err(fail);
            match args.op {
                BenchOp::Allreduce => one(pg.allreduce(x, args.redop)),
                BenchOp::Broadcast => one(pg.broadcast(x, args.root)),
                BenchOp::Reduce => one(pg.reduce(x, args.root, args.redop)),
                BenchOp::Allgather => one(pg.allgather_into_tensor(out, x)),
                BenchOp::ReduceScatter => one(pg.reduce_scatter_tensor(out, x, args.redop)),
                BenchOp::Alltoall => one(pg.alltoall_base(out, x, None)),
                // Nothing to send to on one rank (the core refuses a send to oneself), as on TCP.
                BenchOp::Sendrecv if n == 1 => Ok(Vec::new()),
                // One NCCL group: every rank's send and receive at once (separately, a ring of
                // sends would wait for receives queued behind them).
                BenchOp::Sendrecv => pg
                    .batch_isend_irecv(&[
                        P2pOp::Send(x.clone(), (me + 1) % n),
                        P2pOp::Recv(out.clone(), (me + n - 1) % n),
                    ])
                    .map_err(fail),
                BenchOp::Barrier => one(pg.barrier()),
            }
        }

        /// Enqueues `iters` iterations on every slot: each iteration's works, slot by slot.
        fn enqueue_iters(
            &self,
            args: &BenchArgs,
            slots: &[Slot<D>],
            iters: u32,
        ) -> Result<Vec<Vec<Vec<Work>>>, String> {
            (0..iters).map(|_| slots.iter().map(|s| self.enqueue(args, s)).collect()).collect()
        }

        /// Blocks until the device has run `last` (and so everything enqueued before it), spinning
        /// on an event as nccl-tests does: the watchdog, which ends works, looks only every
        /// millisecond. Returns early when `last` ended otherwise (failed, timed out, aborted):
        /// its `wait` says why.
        fn settle(&self, last: &Work) -> Result<(), String> {
            let fail = |e: NcclError| format!("waiting for the device: {e}");
            let (pg, dev) = (&self.pg, self.pg.device());
            pg.wait_stream(last, pg.compute_stream()).map_err(fail)?;
            let done = dev.new_event(false).map_err(fail)?;
            dev.record(&done, pg.compute_stream()).map_err(fail)?;
            let mut spins = 0u32;
            while !dev.query(&done).map_err(fail)? {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && last.is_completed() {
                    break;
                }
                std::thread::yield_now();
            }
            Ok(())
        }

        /// Waits for every work (after [`Nccl::settle`] they have run on the device).
        fn wait_all<'a>(&self, args: &BenchArgs, works: impl IntoIterator<Item = &'a Work>) -> Result<(), String> {
            works.into_iter().try_for_each(|w| w.wait().map_err(|e| format!("{}: {e}", args.op.name())))
        }

        /// Allreduce of one value through the device.
        fn reduce_one(&self, t: &Tensor, op: ReduceOp) -> Result<f64, String> {
            let fail = |e: &dyn std::fmt::Display| format!("allreduce of the results: {e}");
            let d = self.pg.to_device(t).map_err(|e| fail(&e))?;
            self.pg.allreduce(&d, op).map_err(|e| fail(&e))?.wait().map_err(|e| fail(&e))?;
            Ok(self.pg.to_host(&d).map_err(|e| fail(&e))?.to_f64s()[0])
        }
    }

    impl<D: Device> Backend for Nccl<D> {
        fn name(&self) -> &'static str {
            "nccl"
        }

        fn rank(&self) -> u32 {
            self.pg.rank().0
        }

        fn world_size(&self) -> u32 {
            self.pg.world_size()
        }

        fn describe(&self) -> Option<String> {
            Some(self.describe.clone())
        }

        fn time(&mut self, args: &BenchArgs, shape: Shape) -> Result<Timing, String> {
            let slots = self.slots(args, shape)?;
            let warmup = self.enqueue_iters(args, &slots, args.warmup)?;
            if let Some(last) = warmup.iter().flatten().flatten().last() {
                self.settle(last)?;
            }
            self.wait_all(args, warmup.iter().flatten().flatten())?;
            let sync = |e: &dyn std::fmt::Display| format!("barrier: {e}");
            self.pg.barrier().map_err(|e| sync(&e))?.wait().map_err(|e| sync(&e))?;

            let start = Instant::now();
            let timed = self.enqueue_iters(args, &slots, args.iters)?;
            if let Some(last) = timed.iter().flatten().flatten().last() {
                self.settle(last)?;
            }
            let k = f64::from(args.inflight);
            let mean_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(args.iters) / k;
            self.wait_all(args, timed.iter().flatten().flatten())?;
            // Each iteration's device time: its works' (a batch's works share their events).
            let times_us = timed
                .iter()
                .map(|iteration| {
                    let device_us = |works: &Vec<Work>| {
                        works.iter().filter_map(Work::duration).map(|d| d.as_secs_f64() * 1e6).fold(0.0, f64::max)
                    };
                    iteration.iter().map(device_us).sum::<f64>() / k
                })
                .collect();
            Ok(Timing { times_us, mean_us })
        }

        fn outputs(&mut self, args: &BenchArgs, shape: Shape) -> Result<Vec<Tensor>, String> {
            let slots = self.slots(args, shape)?;
            let works = self.enqueue_iters(args, &slots, 1)?;
            self.wait_all(args, works.iter().flatten().flatten())?;
            slots.iter().map(|s| self.pg.to_host(s.result()).map_err(|e| format!("copy to the host: {e}"))).collect()
        }

        fn max(&self, v: f64) -> Result<f64, String> {
            self.reduce_one(&Tensor::from_slice(&[v]), ReduceOp::Max)
        }

        fn sum(&self, v: u64) -> Result<u64, String> {
            Ok(self.reduce_one(&Tensor::from_slice(&[v as i64]), ReduceOp::Sum)? as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_suffixes_and_refuse_garbage() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("12Q").unwrap_err().contains("not a size"));
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999G").is_err());
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(BenchOp::Allreduce.bus_factor(2), 1.0);
        assert_eq!(BenchOp::Allreduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::Allgather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::Broadcast.bus_factor(8), 1.0);
    }

    #[test]
    fn redops_are_the_nccl_ones() {
        assert_eq!(parse_redop("sum"), Ok(ReduceOp::Sum));
        assert!(parse_redop("bxor").unwrap_err().contains("not a reduction"));
        assert!(parse_dtype("float33").unwrap_err().contains("not a datatype"));
    }

    /// `cohort bench ARGV…`'s arguments.
    fn bench_args(argv: &[&str]) -> BenchArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: BenchArgs,
        }
        <Cli as clap::Parser>::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
            .expect("valid arguments")
            .args
    }

    #[test]
    fn sizes_step_by_the_factor_up_to_the_largest() {
        assert_eq!(sizes(&bench_args(&["-b", "8", "-e", "64K", "-f", "32"])), [8, 256, 8192]);
        assert_eq!(sizes(&bench_args(&["-b", "0", "-e", "4", "-f", "2"])), [0, 1, 2, 4]);
        assert_eq!(sizes(&bench_args(&["-b", "0", "-e", "0"])), [0]);
        assert_eq!(sizes(&bench_args(&["-o", "barrier", "-b", "8", "-e", "1M"])), [8]);
    }

    #[test]
    fn shapes_round_down_to_whole_per_rank_pieces() {
        let shape = |argv: &[&str], n, size| Shape::new(&bench_args(argv), n, size);
        assert_eq!(shape(&[], 4, 30), Shape { count: 7, in_count: 7, out_count: 7 });
        assert_eq!(shape(&["-o", "allgather"], 4, 40), Shape { count: 8, in_count: 2, out_count: 8 });
        assert_eq!(
            shape(&["-o", "reduce_scatter", "-d", "half"], 3, 20),
            Shape { count: 9, in_count: 9, out_count: 3 }
        );
        assert_eq!(shape(&["-o", "alltoall"], 3, 40), Shape { count: 9, in_count: 9, out_count: 9 });
        assert_eq!(shape(&["-o", "barrier"], 2, 1024), Shape { count: 0, in_count: 0, out_count: 0 });
    }

    #[test]
    fn the_tcp_header_keeps_its_layout() {
        let text = header(&bench_args(&["-n", "3", "-w", "1"]), 3, "tcp", None);
        assert_eq!(
            text,
            "# cohort bench: allreduce over 3 ranks (tcp), 3 iters, 1 warmup iters, 1 in flight, check 1\n\
             #\n\
             #       size         count      type   redop    root       time    algbw    busbw  #wrong\n\
             #        (B)    (elements)                                 (us)   (GB/s)   (GB/s)        \n"
        );
        let nccl = header(&bench_args(&[]), 1, "nccl", Some("rank 0: CUDA device 0"));
        assert!(nccl.starts_with("# cohort bench: allreduce over 1 ranks (nccl), 20 iters"), "{nccl}");
        assert!(nccl.contains("\n# rank 0: CUDA device 0\n#\n"), "{nccl}");
    }

    #[test]
    fn rows_print_as_nccl_tests_or_json() {
        let row = Row { bytes: 1024, count: 256, times_us: vec![3.0, 1.0, 2.0], mean_us: 2.5, wrong: 0 };
        let line = row_text(&bench_args(&[]), 2, "tcp", &row, 0.4096, 0.4096);
        assert_eq!(line, "        1024           256     float     sum      -1       2.50    0.410    0.410       0\n");
        let json: serde_json::Value =
            serde_json::from_str(&row_text(&bench_args(&["--json", "-c", "0"]), 2, "nccl", &row, 0.4, 0.4)).unwrap();
        assert_eq!(json["transport"], "nccl");
        assert_eq!(json["median_us"], 2.0);
        assert!(json["wrong"].is_null());
    }

    #[test]
    fn wrong_elements_are_counted_per_work() {
        let want = [1.0, 2.0, 3.0];
        let right = Tensor::from_f64s(DType::F32, &want);
        let one_off = Tensor::from_f64s(DType::F32, &[1.0, 2.5, 3.0]);
        let short = Tensor::from_f64s(DType::F32, &[1.0]);
        assert_eq!(count_wrong(DType::F32, &[right.clone(), one_off], &want), 1);
        assert_eq!(count_wrong(DType::F32, &[short, right.clone()], &want), 3);
        assert_eq!(count_wrong(DType::F32, &[right], &[]), 0, "nothing expected, nothing wrong");
    }

    #[test]
    fn a_rank_takes_its_local_rank_modulo_the_devices_or_the_override() {
        assert_eq!(nccl::device_ordinal(None, 5, 4), Ok(1));
        assert_eq!(nccl::device_ordinal(Some("2"), 0, 4), Ok(2));
        assert!(nccl::device_ordinal(Some("4"), 0, 4).unwrap_err().contains("only 4 CUDA devices"));
        assert!(nccl::device_ordinal(Some("gpu1"), 0, 4).unwrap_err().contains("not a device number"));
        assert!(nccl::device_ordinal(None, 0, 0).unwrap_err().contains("no CUDA device is visible"));
        assert_eq!(nccl::enough_devices(2, 8), Ok(()));
        assert!(nccl::enough_devices(4, 2).unwrap_err().contains("a CUDA device per rank, 2 visible"));
        assert!(nccl::enough_devices(1, 0).unwrap_err().contains("no CUDA device is visible"));
    }

    /// Runs `cohort bench ARGV…` on `n` NCCL ranks over the host emulation (one process, one
    /// thread per rank): rank 0's output and every rank's exit code.
    fn nccl_emulated(n: u32, argv: &[&str]) -> (String, Vec<i32>) {
        use std::sync::Arc;
        use std::time::Duration;

        use cohort_transports::MemoryStore;
        use cohort_transports::nccl::emu::{EmuConfig, EmuDevice, MemFabric};
        use cohort_transports::nccl::{NcclOptions, NcclProcessGroup};

        let args = bench_args(argv);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let fabric = MemFabric::new();
        let store: Arc<dyn cohort_transports::Store> = Arc::new(MemoryStore::new());
        let opts = NcclOptions {
            timeout: Duration::from_secs(30),
            enable_timing: true,
            heartbeat_timeout: None,
            ..NcclOptions::default()
        };
        let pgs: Vec<_> = rt.block_on(async {
            let ranks = (0..n).map(|r| {
                let mut cfg = EmuConfig::new(rt.handle().clone(), fabric.clone());
                cfg.ordinal = r as usize;
                let dev = Arc::new(EmuDevice::new(cfg));
                let pg = NcclProcessGroup::new(dev, store.clone(), "bench", r, n, opts.clone(), rt.handle().clone());
                tokio::spawn(pg)
            });
            let mut pgs = Vec::new();
            for rank in ranks.collect::<Vec<_>>() {
                pgs.push(rank.await.unwrap().expect("init"));
            }
            pgs
        });
        let results: Vec<(Vec<u8>, i32)> = std::thread::scope(|s| {
            let ranks: Vec<_> = pgs
                .into_iter()
                .map(|pg| {
                    let args = &args;
                    s.spawn(move || {
                        let mut b = nccl::Nccl::new(pg, "rank 0: emulated device".into());
                        let mut out = Vec::new();
                        let code = sweep(&mut b, args, &mut out).expect("the sweep runs");
                        b.pg.shutdown().expect("shutdown");
                        (out, code)
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().expect("a rank panicked")).collect()
        });
        let text = String::from_utf8(results[0].0.clone()).unwrap();
        assert!(results[1..].iter().all(|(out, _)| out.is_empty()), "only rank 0 prints");
        (text, results.into_iter().map(|(_, code)| code).collect())
    }

    #[test]
    fn nccl_sweep_checks_every_op_on_the_emulated_device() {
        for op in ["allreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "alltoall", "sendrecv", "barrier"]
        {
            let argv = ["-o", op, "-d", "int32", "-r", "max", "--root", "1", "-b", "12", "-e", "1K", "-f", "8"];
            let (text, codes) = nccl_emulated(3, &[&argv[..], &["-n", "3", "-w", "1", "--inflight", "2"]].concat());
            assert_eq!(codes, [0, 0, 0], "{op}: {text}");
            assert!(text.contains("over 3 ranks (nccl)") && text.contains("# rank 0: emulated device"), "{text}");
            assert!(text.contains("# Out of bounds values : 0 OK"), "{op}: {text}");
            let rows: Vec<Vec<&str>> =
                text.lines().filter(|l| !l.starts_with('#')).map(|l| l.split_whitespace().collect()).collect();
            let want: &[&str] = if op == "barrier" { &["0"] } else { &["12", "96", "768"] };
            assert_eq!(rows.iter().map(|r| r[0]).collect::<Vec<_>>(), want, "{op}: {text}");
        }
    }

    #[test]
    fn nccl_sweep_on_one_rank_emits_device_times_as_json() {
        for op in ["allreduce", "sendrecv"] {
            let (text, codes) =
                nccl_emulated(1, &["-o", op, "-b", "1K", "-e", "4K", "-f", "4", "-n", "4", "-w", "0", "--json"]);
            assert_eq!(codes, [0], "{op}: {text}");
            let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect(l)).collect();
            assert_eq!(rows.len(), 2, "{op}: {text}");
            for row in rows {
                assert_eq!(row["transport"], "nccl");
                assert_eq!(row["wrong"], 0, "{op}: {row}");
                let times = row["times_us"].as_array().expect("times_us");
                assert_eq!(times.len(), 4, "{op}: {row}");
                assert!(times.iter().all(|t| t.as_f64().is_some_and(|t| t >= 0.0)), "{op}: {row}");
            }
        }
    }
}
