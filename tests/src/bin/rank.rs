//! One rank of a multi-process test: `COHORT_TEST_SCENARIO` names what it does; torchrun's
//! variables (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`) say who it is. It prints
//! `ok` lines and `error` lines the tests read, and exits 0 when its part went as expected.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cohort_core::{DType, ReduceOp, Tensor};
use cohort_transports::tcp::init_process_group;
use cohort_transports::{ProcessGroup, WorkError};

fn wall_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn main() -> ExitCode {
    let scenario = std::env::var("COHORT_TEST_SCENARIO").unwrap_or_default();
    if scenario == "store-server" {
        return store_server();
    }
    if scenario == "nccl-emu" {
        return match nccl_emu() {
            Ok(()) => {
                println!("ok {scenario}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("error {e}");
                ExitCode::from(1)
            }
        };
    }
    let pg = match init_process_group() {
        Ok(pg) => pg,
        Err(e) => {
            println!("error init: {e}");
            return ExitCode::from(3);
        }
    };
    let result = match scenario.as_str() {
        "p2p-ring" => p2p_ring(&pg),
        "wait-for-last" => wait_for_last(&pg),
        "collectives" => cohort_tests::collectives::run_all(&pg),
        "ddp-lose-last" => ddp_lose_last(&pg),
        "skip-collective" => skip_collective(&pg),
        "monitored-barrier" => monitored_barrier(&pg),
        "store-gone" => store_gone(&pg),
        "netns-loop" => netns_loop(&pg),
        other => Err(format!("unknown scenario {other:?}")),
    };
    match result {
        Ok(()) => {
            println!("ok {scenario}");
            pg.shutdown();
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error {e}");
            ExitCode::from(1)
        }
    }
}

/// Every rank sends its rank to the next and receives from the previous.
fn p2p_ring(pg: &ProcessGroup) -> Result<(), String> {
    let (r, n) = (pg.rank().0, pg.world_size());
    let recv = pg.recv(Tensor::from_slice(&[0i64]), (r + n - 1) % n, 0).map_err(|e| e.to_string())?;
    pg.send(Tensor::from_slice(&[i64::from(r)]), (r + 1) % n, 0)
        .map_err(|e| e.to_string())?
        .wait()
        .map_err(|e| e.to_string())?;
    let got = recv.result().map_err(|e| e.to_string())?;
    let want = Tensor::from_slice(&[i64::from((r + n - 1) % n)]);
    if got != vec![want] {
        return Err(format!("rank {r} received {got:?}"));
    }
    Ok(())
}

/// The last rank announces itself and then sleeps (the test SIGKILLs it); every other rank
/// waits in a collective that needs it and reports when and how it learned of the death.
fn wait_for_last(pg: &ProcessGroup) -> Result<(), String> {
    let last = pg.world_size() - 1;
    if pg.rank().0 == last {
        println!("ready");
        std::thread::sleep(Duration::from_secs(60));
        return Err("was not killed".into());
    }
    let work = pg.allreduce(vec![Tensor::zeros(DType::F32, &[1024]).map_err(|e| e.to_string())?], ReduceOp::Sum);
    let work = work.map_err(|e| e.to_string())?;
    println!("ready");
    match work.wait() {
        Ok(()) => Err("the allreduce completed without the last rank".into()),
        Err(e @ WorkError::Failed { .. }) => {
            println!("noticed_ns {} culprit {:?} :: {e}", wall_ns(), e.culprit().map(|r| r.0));
            Ok(())
        }
        Err(e) => Err(format!("unexpected: {e}")),
    }
}

/// A DDP step with the bucketed reducer; then the last rank stops taking part (the test
/// SIGKILLs it) and every other rank's next step must fail naming it.
fn ddp_lose_last(pg: &ProcessGroup) -> Result<(), String> {
    use cohort_transports::ddp::{AllreduceHook, BucketCaps, Reducer};
    let shapes: Vec<Vec<usize>> = vec![vec![256, 256], vec![256], vec![512, 128], vec![128], vec![1000]];
    let caps = BucketCaps { first: 64 << 10, rest: 256 << 10 };
    let mut reducer = Reducer::with_caps(pg.clone(), shapes.clone(), DType::F32, Box::new(AllreduceHook), caps)
        .map_err(|e| e.to_string())?;
    let r = pg.rank().0;
    let grad = |p: usize| {
        let n: usize = shapes[p].iter().product();
        Tensor::from_slice_shaped(&vec![(r + 1) as f32; n], &shapes[p]).expect("shape")
    };
    for p in (0..shapes.len()).rev() {
        reducer.mark_ready(p, &grad(p)).map_err(|e| e.to_string())?;
    }
    let out = reducer.finish().map_err(|e| e.to_string())?;
    let n = pg.world_size() as f32;
    let want = (1..=pg.world_size()).sum::<u32>() as f32 / n;
    if out.iter().any(|t| t.to_vec::<f32>().map_or(true, |v| v.iter().any(|x| *x != want))) {
        return Err("the first step's average is wrong".into());
    }
    println!("step ok");
    let last = pg.world_size() - 1;
    if r == last {
        println!("ready");
        std::thread::sleep(Duration::from_secs(60));
        return Err("was not killed".into());
    }
    println!("ready");
    // Half the backward pass, a pause (the kill lands here), then the rest.
    for p in (2..shapes.len()).rev() {
        reducer.mark_ready(p, &grad(p)).map_err(|e| e.to_string())?;
    }
    std::thread::sleep(Duration::from_millis(300));
    for p in (0..2).rev() {
        reducer.mark_ready(p, &grad(p)).map_err(|e| e.to_string())?;
    }
    match reducer.finish() {
        Ok(_) => Err("the step completed without the last rank".into()),
        Err(e) => {
            println!("step failed culprit {:?} :: {e}", e.culprit().map(|r| r.0));
            Ok(())
        }
    }
}

/// The ranks `COHORT_TEST_SKIP` lists (comma-separated).
fn skipped() -> Vec<u32> {
    std::env::var("COHORT_TEST_SKIP").unwrap_or_default().split(',').filter_map(|s| s.trim().parse().ok()).collect()
}

/// Ranks in `COHORT_TEST_SKIP` never call the allreduce (they sleep 5 s); the others report
/// how their allreduce failed.
fn skip_collective(pg: &ProcessGroup) -> Result<(), String> {
    if skipped().contains(&pg.rank().0) {
        std::thread::sleep(Duration::from_secs(5));
        return Ok(());
    }
    let t = Tensor::zeros(DType::F32, &[16]).map_err(|e| e.to_string())?;
    match pg.allreduce(vec![t], ReduceOp::Sum).map_err(|e| e.to_string())?.wait() {
        Ok(()) => Err("the allreduce completed without the skipping rank".into()),
        Err(e) => {
            println!("failed culprit {:?} :: {e}", e.culprit().map(|r| r.0));
            Ok(())
        }
    }
}

/// Ranks in `COHORT_TEST_SKIP` never call the barrier (they sleep 3 s); the others run a
/// monitored barrier of 1000 ms (waiting for all ranks) and print its outcome.
fn monitored_barrier(pg: &ProcessGroup) -> Result<(), String> {
    if skipped().contains(&pg.rank().0) {
        std::thread::sleep(Duration::from_secs(3));
        return Ok(());
    }
    match pg.monitored_barrier(Duration::from_millis(1000), true) {
        Ok(()) => println!("passed"),
        Err(e) => println!("barrier culprits {:?} :: {e}", e.culprits().iter().map(|r| r.0).collect::<Vec<_>>()),
    }
    Ok(())
}

/// Not a rank: host the store on `MASTER_PORT` until killed (for jobs run with
/// `COHORT_STORE_HOSTED=1`).
fn store_server() -> ExitCode {
    use cohort_transports::{TcpStoreServer, TcpStoreServerConfig, TokioNet};
    let port: u16 = std::env::var("MASTER_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(0);
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let bind = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    match rt.block_on(TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind))) {
        Ok(_server) => {
            println!("listening");
            std::thread::sleep(Duration::from_secs(120));
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error store: {e}");
            ExitCode::from(1)
        }
    }
}

/// Allreduce `rank + 1` and check the sum.
fn checked_allreduce(pg: &ProcessGroup) -> Result<(), String> {
    let n = pg.world_size();
    let t = Tensor::from_slice(&[pg.rank().0 as f32 + 1.0; 64]);
    let out = pg.allreduce(vec![t], ReduceOp::Sum).map_err(|e| e.to_string())?.result().map_err(|e| e.to_string())?;
    let want = (n * (n + 1) / 2) as f32;
    match out.first().map(|t| t.to_vec::<f32>()) {
        Some(Ok(v)) if v.iter().all(|&x| x == want) => Ok(()),
        other => Err(format!("allreduce gave {other:?}, want {want}")),
    }
}

/// The store (hosted outside the ranks) is killed after init: collectives go on over the mesh,
/// and when the last rank is lost later, the survivors still name it (publishing the failure to
/// the dead store must neither hang nor panic).
fn store_gone(pg: &ProcessGroup) -> Result<(), String> {
    checked_allreduce(pg)?;
    println!("ready");
    let go = std::env::var("COHORT_TEST_GO").map_err(|_| "COHORT_TEST_GO is not set".to_string())?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !std::path::Path::new(&go).exists() {
        if std::time::Instant::now() > deadline {
            return Err("the test never said go".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..3 {
        checked_allreduce(pg)?;
    }
    println!("collectives ok without the store");
    wait_for_last(pg)
}

/// The NCCL process group on the emulated device, across real processes: the fabric runs over
/// the TCPStore that rank 0 hosts on `MASTER_PORT`. Every rank allreduces once and prints the
/// sum; then the ranks in `COHORT_TEST_SKIP` exit (`COHORT_TEST_EXIT=1`, as a crashed process)
/// or sleep 5 s, and the others report how their second allreduce failed.
fn nccl_emu() -> Result<(), String> {
    use std::sync::Arc;

    use cohort_transports::nccl::emu::{EmuConfig, EmuDevice, StoreFabric};
    use cohort_transports::nccl::{NcclOptions, NcclProcessGroup};
    use cohort_transports::{Store, TcpStore, TcpStoreConfig, TcpStoreServer, TcpStoreServerConfig, TokioNet};

    let var = |n: &str| std::env::var(n).map_err(|_| format!("{n} is not set"));
    let port: u16 = var("MASTER_PORT")?.parse().map_err(|e| format!("MASTER_PORT: {e}"))?;
    let rank: u32 = var("RANK")?.parse().map_err(|e| format!("RANK: {e}"))?;
    let world: u32 = var("WORLD_SIZE")?.parse().map_err(|e| format!("WORLD_SIZE: {e}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let _server = if rank == 0 {
        let bind = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        Some(rt.block_on(TcpStoreServer::bind(TokioNet, TcpStoreServerConfig::new(bind))).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let connect = || -> Result<Arc<dyn Store>, String> {
        let cfg = TcpStoreConfig::new("127.0.0.1", port).with_connect_timeout(Duration::from_secs(20));
        Ok(Arc::new(rt.block_on(TcpStore::connect(cfg)).map_err(|e| e.to_string())?))
    };
    // The fabric's polls get a connection of their own (a TcpStore client runs one call at a time).
    let (store, fabric) = (connect()?, connect()?);
    let mut cfg = EmuConfig::new(rt.handle().clone(), StoreFabric::new(fabric));
    cfg.ordinal = rank as usize;
    let device = Arc::new(EmuDevice::new(cfg));
    let opts = NcclOptions::from_env().map_err(|e| e.to_string())?;
    let pg = rt
        .block_on(NcclProcessGroup::new(device, store.clone(), "mp", rank, world, opts, rt.handle().clone()))
        .map_err(|e| format!("init: {e}"))?;
    let t = pg.to_device(&Tensor::from_slice(&[rank as f32, 1.0])).map_err(|e| e.to_string())?;
    pg.allreduce(&t, ReduceOp::Sum).map_err(|e| e.to_string())?.wait().map_err(|e| e.to_string())?;
    let sum = pg.to_host(&t).map_err(|e| e.to_string())?.to_vec::<f32>().map_err(|e| e.to_string())?;
    println!("sum {sum:?}");
    if skipped().contains(&rank) {
        if std::env::var("COHORT_TEST_EXIT").is_ok_and(|v| v == "1") {
            std::process::exit(0);
        }
        std::thread::sleep(Duration::from_secs(5));
        return Ok(());
    }
    let outcome = match pg.allreduce(&t, ReduceOp::Sum).map_err(|e| e.to_string())?.wait() {
        Ok(()) => Err("the second allreduce completed without the skipping rank".into()),
        Err(e) => {
            println!("failed culprit {:?} :: {e}", e.culprit().map(|r| r.0));
            Ok(())
        }
    };
    // Rank 0 hosts the store, which carries the fabric: it stays until every other survivor has
    // seen its own failure, or theirs would be the store going away.
    let done = |r: u32| format!("test/done/{r}");
    rt.block_on(store.set(&done(rank), b"1")).map_err(|e| e.to_string())?;
    if rank == 0 {
        let skip = skipped();
        let others: Vec<String> = (1..world).filter(|r| !skip.contains(r)).map(done).collect();
        let keys: Vec<&str> = others.iter().map(String::as_str).collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !rt.block_on(store.check(&keys)).map_err(|e| e.to_string())? && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    outcome
}

/// One allreduce of `rank + 1`: `None` when it completed, or how it failed (the blame, and the
/// text: the work's error, or the refusal of a group that had already failed).
fn blamed_allreduce(pg: &ProcessGroup) -> Result<Option<(&'static str, cohort_core::Blame, String)>, String> {
    use cohort_core::SubmitError;
    let t = Tensor::from_slice(&[pg.rank().0 as f32 + 1.0; 64]);
    let work = match pg.allreduce(vec![t], ReduceOp::Sum) {
        Ok(work) => work,
        Err(e @ SubmitError::GroupFailed { .. }) => {
            let SubmitError::GroupFailed { cause } = &e else { unreachable!() };
            let blame = cause.blame.clone();
            return Ok(Some(("submit", blame.clone(), format!("{e}; blame: {blame}"))));
        }
        Err(e) => return Err(e.to_string()),
    };
    match work.wait() {
        Ok(()) => Ok(None),
        Err(e) => Ok(Some(("work", e.blame(), e.to_string()))),
    }
}

/// For the network-namespace test: allreduce in a loop until the file `COHORT_TEST_GO` exists
/// (the test cuts the network first), then once more (an allreduce that needs a rank across
/// the cut); the first failure is printed as
/// `netns-error via=<work|submit> blame=<Blame::encode> :: <error text>`. The rank then stays
/// `COHORT_TEST_LINGER_MS` (default 2000) so that its exit does not reach a peer before the
/// peer has failed on its own.
fn netns_loop(pg: &ProcessGroup) -> Result<(), String> {
    checked_allreduce(pg)?;
    println!("ready");
    let go = std::env::var("COHORT_TEST_GO").map_err(|_| "COHORT_TEST_GO is not set".to_string())?;
    let linger = std::env::var("COHORT_TEST_LINGER_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut completed = 1u64;
    let mut last_try = false;
    let failure = loop {
        if std::time::Instant::now() > deadline {
            return Err(format!("no failure within 60 s ({completed} allreduces completed)"));
        }
        if let Some(f) = blamed_allreduce(pg)? {
            break f;
        }
        if last_try {
            return Err(format!("the allreduce after the cut completed ({completed} allreduces completed)"));
        }
        completed += 1;
        last_try = std::path::Path::new(&go).exists();
        if !last_try {
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let (via, blame, text) = failure;
    println!("netns-error via={via} blame={} after={completed} :: {text}", blame.encode());
    std::thread::sleep(Duration::from_millis(linger));
    Ok(())
}
