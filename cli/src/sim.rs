//! `cohort sim`: run a simulator scenario and print its report and diagnosis.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use cohort_sim::{Backend, FaultPlan, Script, Simulation};

/// Arguments of `cohort sim`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    cohort sim --ranks 4 --seed 7 --fault crash:3@seq2\n  \
    cohort sim --ranks 8 --seed 1 --fault hang:2@seq3 --dumps /tmp/sim-dumps\n  \
    cohort sim --ranks 4 --seed 3 --fault 'partition 0-1 @20ms' --script allreduce:4096,allgather:256,barrier\n  \
    cohort sim --ranks 5 --seed 99 --random-fault --json report.json\n  \
    cohort sim --backend nccl --ranks 4 --seed 1 --fault kernel-hang:2@seq3\n\n\
    Faults (repeat --fault, or separate with ';'): crash:R@seqN | crash:R@t=2s | hang:R@seqN |\n\
    partition:A-B@t=T | isolate:R@t=T | cut:A..B@t=T (ranks A to B-1 from the others) |\n\
    hold:A-B@t=T | slow:R@100ms | desync-op:R@seqN | desync-size:R@seqN | desync-dtype:R@seqN |\n\
    store-crash@t=T; with --backend nccl also\n\
    kernel-hang:R@seqN | nccl-error:R@seqN | slow-kernel:R@seqN; or the long form (docs/simulator.md)\n\
    ('hold 0-1 @10ms until 300ms', 'desync 1 @collective 2 dtype=f16', 'latency 0-1 20ms').\n\
    seqN is the N-th collective of the script. The same seed gives the same output.")]
pub(crate) struct SimArgs {
    /// Ranks.
    #[arg(short = 'n', long, default_value_t = 4)]
    ranks: u32,
    /// The seed (drawn and printed when not given).
    #[arg(short, long)]
    seed: Option<u64>,
    /// A fault (repeatable).
    #[arg(short, long = "fault", alias = "faults", value_name = "FAULT")]
    faults: Vec<String>,
    /// The process group the ranks run: tcp, or nccl (over the emulated device and
    /// communicator, whose fabric goes through the simulated store).
    #[arg(long, default_value = "tcp", value_parser = parse_backend)]
    backend: Backend,
    /// Draw one fault from the seed instead.
    #[arg(long, conflicts_with = "faults")]
    random_fault: bool,
    /// The collectives every rank runs: op[:numel[:dtype[:root=R]]], comma-separated.
    #[arg(long, default_value = "allreduce:4096,allreduce:4096,allgather:256,broadcast:1024,barrier")]
    script: String,
    /// Collectives in flight at once per rank.
    #[arg(long, default_value_t = 1)]
    window: usize,
    /// The collective timeout in milliseconds (simulated).
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    timeout_ms: u64,
    /// Ranks connect to a peer on first use instead of to every peer at init (how large jobs
    /// run; much cheaper to simulate at hundreds of ranks).
    #[arg(long)]
    lazy_connect: bool,
    /// Ranks per simulated host (a node, as torchrun's --nproc-per-node): ranks of one host
    /// talk over its loopback. A rank a crash or link fault names gets a host of its own. The
    /// simulator's cost grows with hosts cubed: use tens per host at hundreds of ranks.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    ranks_per_host: u32,
    /// Write the whole report (outcomes, events, dumps, diagnosis) as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write each surviving rank's flight-recorder dump here as rank_<r>.json (for `cohort fr`).
    #[arg(long, value_name = "DIR")]
    dumps: Option<PathBuf>,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    s.parse()
}

/// Run `cohort sim`; returns the exit code.
pub(crate) fn run(args: SimArgs) -> Result<i32, String> {
    if args.ranks == 0 {
        return Err("--ranks: a job has at least 1 rank".into());
    }
    let script = args.script.parse::<Script>().map_err(|e| format!("--script: {e}"))?.window(args.window);
    let plan = if args.random_fault {
        let seed = args.seed.ok_or("--random-fault needs --seed (the plan is drawn from it)")?;
        match args.backend {
            Backend::Tcp => FaultPlan::random(seed, args.ranks, script.steps.len(), 8),
            Backend::Nccl => FaultPlan::random_nccl(seed, args.ranks, script.steps.len()),
        }
    } else {
        let mut plan = FaultPlan::none();
        for f in &args.faults {
            let more = f.parse::<FaultPlan>().map_err(|e| format!("--fault: {e}"))?;
            plan.faults.extend(more.faults);
        }
        plan
    };
    let mut sim = Simulation::new(args.ranks)
        .script(script)
        .faults(plan)
        .timeout(Duration::from_millis(args.timeout_ms))
        .backend(args.backend)
        .lazy_connect(args.lazy_connect)
        .ranks_per_host(args.ranks_per_host);
    if let Some(seed) = args.seed {
        sim = sim.seed(seed);
    }
    let report = sim.run().map_err(|e| e.to_string())?;
    print!("{report}");
    if let Some(path) = &args.json {
        std::fs::write(path, report.to_json()).map_err(|e| format!("--json {}: {e}", path.display()))?;
        println!("report written to {}", path.display());
    }
    if let Some(dir) = &args.dumps {
        std::fs::create_dir_all(dir).map_err(|e| format!("--dumps {}: {e}", dir.display()))?;
        let mut n = 0;
        for r in &report.ranks {
            if let Some(dump) = &r.dump {
                let path = dir.join(format!("rank_{}.json", r.rank));
                std::fs::write(&path, dump.to_json()).map_err(|e| format!("--dumps {}: {e}", path.display()))?;
                n += 1;
            }
        }
        println!(
            "{n} dumps written to {} (cohort fr analyze {} --world-size {})",
            dir.display(),
            dir.display(),
            args.ranks
        );
    }
    Ok(0)
}
