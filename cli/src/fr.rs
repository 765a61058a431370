//! `cohort fr`: read flight-recorder dumps (ours and PyTorch's JSON dumps, schema 2.x).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use cohort_core::analyze;
use cohort_core::recorder::Dump;
use cohort_core::work::Rank;

/// Arguments of `cohort fr`.
#[derive(Debug, Args)]
pub(crate) struct FrArgs {
    #[command(subcommand)]
    command: FrCommand,
}

#[derive(Debug, Subcommand)]
enum FrCommand {
    /// Diagnose a folder of dumps (one per rank): the first collective the ranks disagree on,
    /// its kind (never joined, op/size/dtype mismatch, state mismatch, undecided) and culprits.
    #[command(after_help = "Example:\n  cohort fr analyze /tmp/cohort-demo-1234/\n  cohort fr analyze dumps/ --json")]
    Analyze {
        /// A folder of `*.json` dumps (ours, or torch's written with TORCH_FR_DUMP_TEMP_FILE as JSON).
        dir: PathBuf,
        /// Print the diagnosis as JSON.
        #[arg(long)]
        json: bool,
        /// The job's world size, when some ranks left no dump at all.
        #[arg(long)]
        world_size: Option<u32>,
    },
    /// Print one dump's entries as a table.
    #[command(after_help = "Example:\n  cohort fr show /tmp/cohort-demo-1234/rank_0.json")]
    Show {
        /// The dump file.
        file: PathBuf,
    },
    /// Write a Chrome trace (Perfetto, chrome://tracing): a track per rank, a slice per
    /// collective, unfinished ones marked.
    #[command(after_help = "Example:\n  cohort fr timeline /tmp/cohort-demo-1234/ -o trace.json")]
    Timeline {
        /// A folder of `*.json` dumps.
        dir: PathBuf,
        /// Where to write the trace.
        #[arg(short = 'o', long = "output", default_value = "trace.json")]
        output: PathBuf,
    },
}

/// Run `cohort fr`; returns the exit code.
pub(crate) fn run(args: FrArgs) -> Result<i32, String> {
    match args.command {
        FrCommand::Analyze { dir, json, world_size } => {
            let dumps = load_dir(&dir)?;
            let world = world_size.or_else(|| dumps.iter().filter_map(|(_, d)| d.world_size).max());
            let diagnosis = analyze::diagnose(&dumps, world);
            if json {
                println!("{}", diagnosis.to_json());
            } else {
                println!("{} dumps from {}: ranks {}", dumps.len(), dir.display(), rank_list(&dumps));
                println!("{diagnosis}");
            }
            Ok(0)
        }
        FrCommand::Show { file } => {
            let dump = load_file(&file)?;
            show(&dump);
            Ok(0)
        }
        FrCommand::Timeline { dir, output } => {
            let dumps = load_dir(&dir)?;
            let trace = crate::timeline::chrome_trace(&dumps);
            std::fs::write(&output, trace).map_err(|e| format!("cannot write {}: {e}", output.display()))?;
            let n: usize = dumps.iter().map(|(_, d)| d.entries.len()).sum();
            println!(
                "wrote {} ({} ranks, {n} collectives); open it in https://ui.perfetto.dev",
                output.display(),
                dumps.len()
            );
            Ok(0)
        }
    }
}

/// The dumps' ranks as ranges (`[0-16, 18-4095]`): a list of thousands stays one short line.
fn rank_list(dumps: &[(Rank, Dump)]) -> String {
    let mut ranks: Vec<Rank> = dumps.iter().map(|(r, _)| *r).collect();
    ranks.sort_unstable();
    cohort_core::work::rank_ranges(&ranks)
}

fn load_file(path: &Path) -> Result<Dump, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Dump::from_json(&text).map_err(|e| format!("{} is not a flight-recorder dump: {e}", path.display()))
}

/// Every `*.json` dump in `dir`, with the rank that wrote it: the dump's own `rank` field
/// (ours), else the last number in the file name (torch names its dumps `<prefix><rank>`).
pub(crate) fn load_dir(dir: &Path) -> Result<Vec<(Rank, Dump)>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot read folder {}: {e}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_none_or(|x| x == "json"))
        .collect();
    paths.sort();
    let mut dumps = Vec::new();
    for path in paths {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        // Other JSON files (a diagnosis, a trace) may share the folder: skip what is not a dump.
        let Ok(dump) = Dump::from_json(&text) else {
            if path.extension().is_some() && looks_like_dump(&text) {
                return Err(format!("{} looks like a dump but does not parse", path.display()));
            }
            continue;
        };
        let rank = dump.rank.or_else(|| rank_from_name(&path).map(Rank)).ok_or_else(|| {
            format!("{}: cannot tell which rank wrote it (no `rank` field, no number in its name)", path.display())
        })?;
        dumps.push((rank, dump));
    }
    if dumps.is_empty() {
        return Err(format!("no flight-recorder dumps in {}", dir.display()));
    }
    dumps.sort_by_key(|(r, _)| *r);
    Ok(dumps)
}

fn looks_like_dump(text: &str) -> bool {
    text.contains("\"entries\"") && text.contains("\"version\"")
}

fn rank_from_name(path: &Path) -> Option<u32> {
    let stem = path.file_stem()?.to_str()?;
    let digits: String =
        stem.chars().rev().skip_while(|c| !c.is_ascii_digit()).take_while(char::is_ascii_digit).collect();
    digits.chars().rev().collect::<String>().parse().ok()
}

fn show(dump: &Dump) {
    let who = match (dump.rank, dump.world_size) {
        (Some(r), Some(w)) => format!("rank {r} of {w}"),
        (Some(r), None) => format!("rank {r}"),
        _ => "unknown rank".into(),
    };
    println!("flight recorder of {who}, schema {}, {} entries", dump.version, dump.entries.len());
    println!(
        "{:>6} {:>4} {:>6} {:<24} {:<10} {:>10} {:>10} {:<9} {:>11} {:>11}",
        "id", "pg", "seq", "op", "state", "in numel", "out numel", "dtype", "started ms", "took ms"
    );
    let origin = dump.entries.iter().map(|e| e.time_created_ns).min().unwrap_or(0);
    for e in &dump.entries {
        let numel = |sizes: &[Vec<u64>]| sizes.iter().map(|s| s.iter().product::<u64>()).sum::<u64>();
        let state = match e.cohort_state {
            Some(s) => format!("{s:?}").to_lowercase(),
            None => format!("{:?}", e.state).to_lowercase(),
        };
        let started = e.time_discovered_started_ns.map_or("-".into(), |t| ms(t.saturating_sub(origin)));
        let took = match (e.time_discovered_started_ns, e.cohort_time_finished_ns.or(e.time_discovered_completed_ns)) {
            (Some(s), Some(f)) => ms(f.saturating_sub(s)),
            _ => e.duration_ms.map_or("-".into(), |d| format!("{d:.3}")),
        };
        let seq = if e.is_p2p { format!("p{}", e.p2p_seq_id) } else { e.collective_seq_id.to_string() };
        println!(
            "{:>6} {:>4} {:>6} {:<24} {:<10} {:>10} {:>10} {:<9} {:>11} {:>11}",
            e.record_id,
            e.pg_id,
            seq,
            e.profiling_name,
            state,
            numel(&e.input_sizes),
            numel(&e.output_sizes),
            e.input_dtypes.first().map_or("-", String::as_str),
            started,
            took
        );
        if let Some(err) = &e.cohort_error {
            println!("{:>6} error: {err}", "");
        }
    }
}

fn ms(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_come_from_the_last_number_of_the_name() {
        assert_eq!(rank_from_name(Path::new("/x/rank_12.json")), Some(12));
        assert_eq!(rank_from_name(Path::new("nccl_trace_rank_3")), Some(3));
        assert_eq!(rank_from_name(Path::new("trace.json")), None);
    }
}
