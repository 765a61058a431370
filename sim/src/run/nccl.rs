//! A rank on the NCCL backend: `NcclProcessGroup` over the emulated device and communicator,
//! whose fabric runs through the simulated store. The same script, checks, report and
//! diagnosis as on TCP; device faults are injected into the rank's emulated communicator
//! right before the collective they name.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cohort_core::group::ErrorHandling;
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::Tensor;
use cohort_transports::nccl::emu::{EmuConfig, EmuDevice, EmuFault, StoreFabric};
use cohort_transports::nccl::{DeviceTensor, NcclOptions, NcclProcessGroup, NcclResult};
use cohort_transports::{Store, TcpStore, TcpStoreConfig, Work};

use super::{Fate, Outcome, RankCtx, STORE_HOST, STORE_PORT, WALL_CLOCK_START_NS, WorkEvent, WorkOutcome, sim_ms};
use crate::net::TurmoilNet;
use crate::plan::{DeviceFault, SLOW_KERNEL_MS};
use crate::workload::{ScriptOp, Step, check, input};

/// A rank's NCCL group in the simulator.
pub(super) type Pg = NcclProcessGroup<EmuDevice>;

type Dev = DeviceTensor<EmuDevice>;

/// A work in flight: its step, the call as made, the work, when, and the tensors to read back.
type InFlight = (usize, Step, Work, u64, Vec<Dev>);

impl RankCtx {
    async fn store(&self) -> Result<Arc<dyn Store>, String> {
        let cfg = &self.cfg;
        let store_cfg = TcpStoreConfig::new(STORE_HOST, STORE_PORT)
            .with_timeout(cfg.init_timeout.max(cfg.limit))
            .with_connect_timeout(cfg.init_timeout);
        let store =
            TcpStore::connect_with(TurmoilNet, store_cfg).await.map_err(|e| format!("cannot reach the store: {e}"))?;
        Ok(Arc::new(store))
    }

    pub(super) async fn run_nccl(&self) {
        let cfg = &self.cfg;
        // Two connections: the fabric's waits for peers' data must never hold up the group's
        // own store traffic (progress, failures), which a TcpStore client serializes.
        let (store, fabric_store) = match (self.store().await, self.store().await) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return self.end(Fate::InitFailed { error: e }),
        };
        let mut ecfg = EmuConfig::new(tokio::runtime::Handle::current(), StoreFabric::new(fabric_store));
        ecfg.ordinal = self.rank as usize;
        let device = Arc::new(EmuDevice::new(ecfg));
        let opts = NcclOptions {
            timeout: cfg.timeout,
            init_timeout: cfg.init_timeout,
            error_handling: ErrorHandling::CleanUpOnly,
            // The monitor is a thread: the simulator runs only tokio tasks.
            heartbeat_timeout: None,
            status_interval: Duration::from_millis(100),
            trace_buffer_size: cfg.trace_buffer_size,
            wall_clock_anchor_ns: Some(WALL_CLOCK_START_NS + sim_ms() * 1_000_000),
            ..NcclOptions::default()
        };
        let handle = tokio::runtime::Handle::current();
        let pg = match Pg::new(device, store, "0", self.rank, cfg.world_size, opts, handle).await {
            Ok(pg) => pg,
            Err(e) => return self.end(Fate::InitFailed { error: e.to_string() }),
        };
        let events = self.slot().events.clone();
        pg.set_completion_hook(move |info| {
            events.lock().unwrap_or_else(|p| p.into_inner()).push(WorkEvent {
                seq: info.seq.0,
                op: info.op.to_string(),
                state: info.state,
                at_ms: sim_ms(),
            });
        });
        {
            let mut slot = self.slot();
            slot.nccl = Some(pg.clone());
            slot.joined_ms = Some(sim_ms());
        }
        let fate = match &cfg.workload {
            super::Workload::Script(script) => self.run_script_nccl(&pg, script).await,
            super::Workload::Custom { .. } => {
                Fate::Failed { error: "code workloads run on the TCP backend only".into() }
            }
        };
        if matches!(fate, Fate::Hung { .. }) {
            self.end(fate);
            return;
        }
        self.slot().dump = Some(pg.flight_recorder_json());
        self.end(fate);
    }

    async fn run_script_nccl(&self, pg: &Pg, script: &crate::workload::Script) -> Fate {
        let mut in_flight: VecDeque<InFlight> = VecDeque::new();
        let mut first_error: Option<String> = None;
        for (k, &step) in script.steps.iter().enumerate() {
            while in_flight.len() >= script.window {
                let Some(w) = in_flight.pop_front() else { break };
                if let Err(e) = self.finish_nccl(pg, w).await {
                    first_error.get_or_insert(e);
                }
            }
            if first_error.is_some() {
                break;
            }
            if self.faults.crash_at_collective == Some(k) {
                self.slot().crash_requested = true;
                std::future::pending::<()>().await;
            }
            if self.faults.hang_at == Some(k) {
                while let Some(w) = in_flight.pop_front() {
                    let _ = self.finish_nccl(pg, w).await;
                }
                return self.hang_nccl(pg, k).await;
            }
            if let Some(d) = self.faults.slow {
                tokio::time::sleep(d).await;
            }
            for &(c, kind) in &self.faults.device {
                if c == k
                    && let Some(comm) = pg.comm_handle()
                {
                    comm.inject(match kind {
                        DeviceFault::KernelHang => EmuFault::KernelHang,
                        DeviceFault::NcclError => EmuFault::AsyncError(NcclResult::RemoteError),
                        DeviceFault::SlowKernel => EmuFault::SlowKernel(Duration::from_millis(SLOW_KERNEL_MS)),
                    });
                }
            }
            let call = self.faults.apply(k, step);
            let submitted_ms = sim_ms();
            match submit(pg, &call) {
                Ok((work, outputs)) => in_flight.push_back((k, call, work, submitted_ms, outputs)),
                Err(e) => {
                    self.slot().works.push(WorkOutcome {
                        step: k,
                        call: call.to_string(),
                        seq: None,
                        outcome: Outcome::Refused,
                        error: Some(e.clone()),
                        culprit: pg.failure().and_then(|f| f.culprit).map(|r| r.0),
                        submitted_ms,
                        ended_ms: Some(submitted_ms),
                    });
                    first_error.get_or_insert(e);
                    break;
                }
            }
        }
        while let Some(w) = in_flight.pop_front() {
            if let Err(e) = self.finish_nccl(pg, w).await {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            None => Fate::Finished,
            Some(error) => Fate::Failed { error },
        }
    }

    async fn finish_nccl(&self, pg: &Pg, (k, call, work, submitted_ms, outputs): InFlight) -> Result<(), String> {
        let index = {
            let mut slot = self.slot();
            slot.works.push(WorkOutcome {
                step: k,
                call: call.to_string(),
                seq: Some(work.seq().0),
                outcome: Outcome::Unfinished,
                error: None,
                culprit: None,
                submitted_ms,
                ended_ms: None,
            });
            slot.works.len() - 1
        };
        let result = work.clone().await;
        let (outcome, error, culprit) = match &result {
            Ok(_) => {
                let mut host: Vec<Tensor> = Vec::with_capacity(outputs.len());
                let mut read_error = None;
                for t in &outputs {
                    match pg.to_host_async(t).await {
                        Ok(h) => host.push(h),
                        Err(e) => {
                            read_error = Some(format!("reading the result back failed: {e}"));
                            break;
                        }
                    }
                }
                match read_error {
                    Some(e) => (Outcome::Failed, Some(e), None),
                    None => match check(&call, self.rank, self.cfg.world_size, &host) {
                        Ok(()) => (Outcome::Completed, None, None),
                        Err(e) => (Outcome::Wrong, Some(format!("wrong result: {e}")), None),
                    },
                }
            }
            Err(e) => (Outcome::of(work.state()), Some(e.to_string()), e.culprit().map(|r| r.0)),
        };
        let ended_ms = sim_ms();
        let mut slot = self.slot();
        let w = &mut slot.works[index];
        w.outcome = outcome;
        w.error = error.clone();
        w.culprit = culprit;
        w.ended_ms = Some(ended_ms);
        match error {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    async fn hang_nccl(&self, pg: &Pg, k: usize) -> Fate {
        self.slot().fate = Some(Fate::Hung { collective: k, learned: None });
        loop {
            if let Some(f) = pg.failure() {
                self.slot().dump = Some(pg.flight_recorder_json());
                return Fate::Hung { collective: k, learned: Some(f.message) };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Submit `step` on `pg`: the work and the device tensors that hold its results.
fn submit(pg: &Pg, step: &Step) -> Result<(Work, Vec<Dev>), String> {
    let me = pg.rank().0;
    let n = pg.world_size() as usize;
    let e = |e: cohort_transports::nccl::NcclError| e.to_string();
    let up = |t: Tensor| pg.to_device(&t).map_err(e);
    Ok(match step.op {
        ScriptOp::Allreduce => {
            let t = up(input(me, step.numel, step.dtype))?;
            (pg.allreduce(&t, ReduceOp::Sum).map_err(e)?, vec![t])
        }
        ScriptOp::Broadcast => {
            let t = up(input(me, step.numel, step.dtype))?;
            (pg.broadcast(&t, step.root).map_err(e)?, vec![t])
        }
        ScriptOp::Allgather => {
            let t = up(input(me, step.numel, step.dtype))?;
            let outs = (0..n).map(|_| pg.zeros(step.dtype, &[step.numel]).map_err(e)).collect::<Result<Vec<_>, _>>()?;
            (pg.allgather(&outs, &t).map_err(e)?, outs)
        }
        ScriptOp::ReduceScatter => {
            let t = up(input(me, step.numel * n, step.dtype))?;
            let out = pg.zeros(step.dtype, &[step.numel]).map_err(e)?;
            (pg.reduce_scatter_tensor(&out, &t, ReduceOp::Sum).map_err(e)?, vec![out])
        }
        ScriptOp::Alltoall => {
            let t = up(input(me, step.numel * n, step.dtype))?;
            let out = pg.zeros(step.dtype, &[step.numel * n]).map_err(e)?;
            (pg.alltoall_base(&out, &t, None).map_err(e)?, vec![out])
        }
        ScriptOp::Barrier => (pg.barrier().map_err(e)?, Vec::new()),
    })
}
