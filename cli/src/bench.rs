//! `cohort bench`: collective benchmarks in the nccl-tests format.
//!
//! Without `RANK`/`WORLD_SIZE` in the environment it starts `--ranks` local processes (this
//! executable, same arguments) and rank 0 prints the table; under `cohort launch` or torchrun
//! it runs as the one rank the environment names, so the same command measures across machines.

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
    (n-1)/n; broadcast, reduce, sendrecv 1).")]
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
    if args.transport == Transport::Nccl {
        return Err("--transport nccl: NCCL backend unavailable: this build of cohort has no NCCL support".into());
    }
    if args.op.reduces() && args.dtype == DType::Bool && args.redop == ReduceOp::Avg {
        return Err("-r avg is not defined for -d bool".into());
    }
    match (std::env::var("RANK"), std::env::var("WORLD_SIZE")) {
        (Ok(_), Ok(_)) => run_rank(&args),
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

fn run_rank(args: &BenchArgs) -> Result<i32, String> {
    let pg = cohort_transports::tcp::init_process_group().map_err(|e| format!("init_process_group: {e}"))?;
    let n = pg.world_size();
    if args.op.rooted() && args.root >= n {
        return Err(format!("--root {} is not a rank of a {n}-rank group", args.root));
    }
    let me = pg.rank().0;
    let print = me == 0;
    if print && !args.json {
        header(args, n);
    }
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
    let mut total_wrong = 0;
    let mut busbw_sum = 0.0;
    let mut rows = 0;
    for size in sizes {
        let row = bench_size(&pg, args, size as usize)?;
        total_wrong += row.wrong;
        let secs = row.mean_us / 1e6;
        let algbw = if secs > 0.0 { row.bytes as f64 / secs / 1e9 } else { 0.0 };
        let busbw = algbw * args.op.bus_factor(n);
        busbw_sum += busbw;
        rows += 1;
        if print {
            let root = if args.op.rooted() { args.root as i64 } else { -1 };
            let redop = if args.op.reduces() { redop_name(args.redop) } else { "none" };
            if args.json {
                let mut sorted = row.times_us.clone();
                sorted.sort_by(f64::total_cmp);
                let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
                let obj = serde_json::json!({
                    "op": args.op.name(), "ranks": n, "transport": "tcp", "inflight": args.inflight,
                    "size": row.bytes, "count": row.count, "type": type_name(args.dtype), "redop": redop, "root": root,
                    "time_us": row.mean_us, "median_us": median, "algbw": algbw, "busbw": busbw,
                    "wrong": if args.check == 1 { Some(row.wrong) } else { None },
                    "times_us": row.times_us,
                });
                println!("{obj}");
            } else {
                let wrong = if args.check == 1 { row.wrong.to_string() } else { "N/A".into() };
                println!(
                    "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9.2}  {:>7.3}  {:>7.3}  {:>6}",
                    row.bytes,
                    row.count,
                    type_name(args.dtype),
                    redop,
                    root,
                    row.mean_us,
                    algbw,
                    busbw,
                    wrong
                );
            }
            let _ = std::io::stdout().flush();
        }
    }
    if print && !args.json {
        let verdict = if total_wrong == 0 { "OK" } else { "FAILED" };
        println!("# Out of bounds values : {total_wrong} {verdict}");
        println!("# Avg bus bandwidth    : {:.4} ", if rows > 0 { busbw_sum / f64::from(rows) } else { 0.0 });
        println!("#");
    }
    pg.shutdown();
    Ok(if total_wrong > 0 { 1 } else { 0 })
}

fn header(args: &BenchArgs, n: u32) {
    println!(
        "# cohort bench: {} over {} ranks (tcp), {} iters, {} warmup iters, {} in flight, check {}",
        args.op.name(),
        n,
        args.iters,
        args.warmup,
        args.inflight,
        args.check
    );
    println!("#");
    println!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    );
    println!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
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
fn once(pg: &ProcessGroup, args: &BenchArgs, data: Vec<Tensor>, count: usize) -> Result<Vec<Tensor>, String> {
    let works = data.into_iter().map(|t| submit(pg, args, t, count)).collect::<Result<Vec<_>, _>>()?;
    works.into_iter().map(|w| w.wait(args)).collect()
}

fn bench_size(pg: &ProcessGroup, args: &BenchArgs, size: usize) -> Result<Row, String> {
    let n = pg.world_size();
    let me = pg.rank().0;
    let es = args.dtype.size();
    let align = args.op.align(n);
    let count = if args.op == BenchOp::Barrier { 0 } else { size / es / align * align };
    let bytes = count * es;
    let k = args.inflight as usize;
    // allgather's input is one rank's piece; the rest take the whole buffer.
    let in_count = if args.op == BenchOp::Allgather { count / n as usize } else { count };
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
    let mut data: Vec<Tensor> = if chains { (0..k).map(|_| input(args, me, in_count)).collect() } else { Vec::new() };
    for _ in 0..args.warmup {
        data = once(pg, args, inputs(data), count)?;
    }
    sync(pg)?;
    let mut times_us = Vec::with_capacity(args.iters as usize);
    let start = Instant::now();
    for _ in 0..args.iters {
        let t = Instant::now();
        data = once(pg, args, inputs(data), count)?;
        times_us.push(t.elapsed().as_secs_f64() * 1e6 / k as f64);
    }
    let mine = start.elapsed().as_secs_f64() * 1e6 / f64::from(args.iters) / k as f64;
    let mean_us = all_max(pg, mine)?;

    let mut wrong = 0u64;
    if args.check == 1 && args.op != BenchOp::Barrier {
        drop(data);
        let got = once(pg, args, vec![input(args, me, in_count); k], count)?;
        let want = expected(args, n, me, count);
        if !want.is_empty() {
            for got in got.iter().map(Tensor::to_f64s) {
                wrong += if got.len() != want.len() {
                    want.len() as u64
                } else {
                    got.iter().zip(&want).filter(|(g, w)| !close(args.dtype, **g, **w)).count() as u64
                };
            }
        }
        wrong = all_sum(pg, wrong)?;
    }
    Ok(Row { bytes, count, times_us, mean_us, wrong })
}

fn sync(pg: &ProcessGroup) -> Result<(), String> {
    pg.barrier().map_err(|e| format!("barrier: {e}"))?.wait().map_err(|e| format!("barrier: {e}"))
}

fn all_max(pg: &ProcessGroup, v: f64) -> Result<f64, String> {
    let w = pg.allreduce(vec![Tensor::from_slice(&[v])], ReduceOp::Max).map_err(|e| e.to_string())?;
    let out = w.result().map_err(|e| e.to_string())?;
    Ok(out[0].to_f64s()[0])
}

fn all_sum(pg: &ProcessGroup, v: u64) -> Result<u64, String> {
    let w = pg.allreduce(vec![Tensor::from_slice(&[v as i64])], ReduceOp::Sum).map_err(|e| e.to_string())?;
    let out = w.result().map_err(|e| e.to_string())?;
    Ok(out[0].to_f64s()[0] as u64)
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
}
