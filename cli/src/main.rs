//! The `cohort` command: run, launch, measure and diagnose process groups.

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

/// The `cohort` binary allocates with mimalloc (see [`alloc`]).
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;

mod alloc;
mod bench;
mod demo;
mod fr;
mod launch;
mod sim;
mod store;
mod timeline;

/// cohort: PyTorch's c10d process-group runtime, rebuilt in Rust.
#[derive(Debug, Parser)]
#[command(name = "cohort", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The main job: 4 local ranks train with bucketed allreduce, then one hangs; watch the
    /// watchdog, the flight-recorder dumps and the diagnosis name it.
    Demo(demo::DemoArgs),
    /// One rank of `cohort demo` (started by it).
    #[command(hide = true)]
    DemoRank(demo::DemoRankArgs),
    /// Start N local rank processes with torchrun's environment (MASTER_ADDR, MASTER_PORT,
    /// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); stop them all when one fails.
    Launch(launch::LaunchArgs),
    /// Measure a collective in the nccl-tests format (size, count, type, redop, root, time,
    /// algbw, busbw, #wrong).
    Bench(bench::BenchArgs),
    /// Serve the TCPStore protocol (PyTorch's clients can use it).
    Store(store::StoreArgs),
    /// Run a simulated job under a fault plan (crash, hang, partition, desync…) and print each
    /// rank's outcomes and the diagnosis; the same seed gives the same output.
    Sim(sim::SimArgs),
    /// Read flight-recorder dumps: analyze a folder, show a file, draw a timeline.
    Fr(fr::FrArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            e.exit()
        }
        Err(e) => {
            // One line that names the flag, not clap's usage block.
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("bad arguments").trim_start_matches("error: ");
            eprintln!("cohort: error: {first} (see --help)");
            return ExitCode::from(2);
        }
    };
    if matches!(cli.command, Command::Fr(_) | Command::Sim(_)) {
        // `cohort fr show … | head` should end quietly, as other Unix tools do, rather than
        // panic on a closed pipe. Only here: the ranks' sockets keep Rust's default.
        // SAFETY: restoring the default disposition of a signal before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::DemoRank(args) => demo::run_rank(args),
        Command::Launch(args) => launch::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Store(args) => store::run(args),
        Command::Sim(args) => sim::run(args),
        Command::Fr(args) => fr::run(args),
    };
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(message) => {
            eprintln!("cohort: error: {message}");
            ExitCode::from(2)
        }
    }
}
