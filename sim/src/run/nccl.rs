//! A rank on the NCCL backend: `NcclProcessGroup` over the emulated device and communicator,
//! whose fabric runs through the simulated store. The same script, checks, report and
//! diagnosis as on TCP; device faults are injected into the rank's emulated communicator
//! right before the collective they name.

use std::sync::Arc;
use std::time::Duration;

use cohort_core::group::ErrorHandling;
use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::Tensor;
use cohort_transports::nccl::emu::{EmuConfig, EmuDevice, EmuFault, StoreFabric};
use cohort_transports::nccl::{DeviceTensor, NcclOptions, NcclProcessGroup, NcclResult};
use cohort_transports::{Store, TcpStore, TcpStoreConfig, Work};

use super::{Fate, RankCtx, STORE_HOST, STORE_PORT, SimGroup, WALL_CLOCK_START_NS, sim_ms};
use crate::net::TurmoilNet;
use crate::plan::{DeviceFault, SLOW_KERNEL_MS};
use crate::workload::{ScriptOp, Step, input};

/// A rank's NCCL group in the simulator.
pub(super) type Pg = NcclProcessGroup<EmuDevice>;

type Dev = DeviceTensor<EmuDevice>;

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
        self.joined(&pg);
        self.slot().nccl = Some(pg.clone());
        let fate = match &cfg.workload {
            super::Workload::Script(script) => self.run_script(&pg, script).await,
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
}

impl SimGroup for Pg {
    type Pending = Vec<Dev>;

    fn submit(&self, step: &Step) -> Result<(Work, Vec<Dev>), String> {
        submit(self, step)
    }

    /// Reads the device tensors back (on tokio's clock, the simulator's).
    async fn outputs(&self, pending: Vec<Dev>, _from_work: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        let mut host = Vec::with_capacity(pending.len());
        for t in &pending {
            host.push(self.to_host_async(t).await.map_err(|e| format!("reading the result back failed: {e}"))?);
        }
        Ok(host)
    }

    fn failure(&self) -> Option<cohort_core::group::GroupFailure> {
        NcclProcessGroup::failure(self)
    }

    fn flight_recorder_json(&self) -> String {
        NcclProcessGroup::flight_recorder_json(self)
    }

    fn set_completion_hook(&self, hook: impl Fn(&cohort_transports::WorkInfo) + Send + Sync + 'static) {
        NcclProcessGroup::set_completion_hook(self, hook);
    }

    fn inject(&self, fault: DeviceFault) {
        if let Some(comm) = self.comm_handle() {
            comm.inject(match fault {
                DeviceFault::KernelHang => EmuFault::KernelHang,
                DeviceFault::NcclError => EmuFault::AsyncError(NcclResult::RemoteError),
                DeviceFault::SlowKernel => EmuFault::SlowKernel(Duration::from_millis(SLOW_KERNEL_MS)),
            });
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
