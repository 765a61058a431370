//! Workloads: a script of collectives every rank runs, with inputs whose results are known,
//! so a run can check every completed collective's output.

use std::fmt;
use std::str::FromStr;

use cohort_core::reduce::ReduceOp;
use cohort_core::tensor::{DType, Tensor};
use cohort_transports::{ProcessGroup, Work};
use serde::{Deserialize, Serialize};

/// A collective a script can call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScriptOp {
    /// `all_reduce` with Sum.
    Allreduce,
    /// `broadcast` from the step's root.
    Broadcast,
    /// `all_gather`: one tensor per rank.
    Allgather,
    /// `reduce_scatter_tensor` with Sum: every rank gets its slice of the reduction.
    ReduceScatter,
    /// `all_to_all_single` with equal splits.
    Alltoall,
    /// `barrier`.
    Barrier,
}

impl ScriptOp {
    /// Every op, in the order random workloads draw from.
    pub const ALL: [ScriptOp; 6] = [
        ScriptOp::Allreduce,
        ScriptOp::Broadcast,
        ScriptOp::Allgather,
        ScriptOp::ReduceScatter,
        ScriptOp::Alltoall,
        ScriptOp::Barrier,
    ];

    /// The name used in scripts and plans.
    pub const fn name(self) -> &'static str {
        match self {
            ScriptOp::Allreduce => "allreduce",
            ScriptOp::Broadcast => "broadcast",
            ScriptOp::Allgather => "allgather",
            ScriptOp::ReduceScatter => "reduce_scatter",
            ScriptOp::Alltoall => "alltoall",
            ScriptOp::Barrier => "barrier",
        }
    }
}

impl fmt::Display for ScriptOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScriptOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ScriptOp::ALL.into_iter().find(|op| op.name() == s).ok_or_else(|| {
            let names: Vec<&str> = ScriptOp::ALL.iter().map(|op| op.name()).collect();
            format!("unknown collective {s:?} (expected one of {})", names.join(", "))
        })
    }
}

/// One collective of a script: the op, the elements each rank contributes, their dtype and
/// (for broadcast) the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The collective.
    pub op: ScriptOp,
    /// Elements per rank (per destination rank for reduce_scatter and alltoall).
    pub numel: usize,
    /// The element type.
    pub dtype: DType,
    /// The root (broadcast only).
    pub root: u32,
}

impl Step {
    /// `op` over `numel` f32 elements, root 0.
    pub fn new(op: ScriptOp, numel: usize) -> Step {
        Step { op, numel, dtype: DType::F32, root: 0 }
    }

    /// This step with another dtype.
    pub fn dtype(mut self, dtype: DType) -> Step {
        self.dtype = dtype;
        self
    }

    /// This step with another root.
    pub fn root(mut self, root: u32) -> Step {
        self.root = root;
        self
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.op {
            ScriptOp::Barrier => f.write_str("barrier"),
            ScriptOp::Broadcast => write!(f, "broadcast:{}:{}:root={}", self.numel, dtype_short(self.dtype), self.root),
            op => write!(f, "{op}:{}:{}", self.numel, dtype_short(self.dtype)),
        }
    }
}

/// The short name scripts and plans use (`f32`, `bf16`…).
pub fn dtype_short(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "bf16",
        DType::Bool => "bool",
        DType::F16 => "f16",
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I8 => "i8",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::U8 => "u8",
    }
}

impl FromStr for Step {
    type Err = String;
    /// `op[:numel[:dtype[:root=R]]]`, e.g. `allreduce:1024:f32`, `broadcast:16:f16:root=2`,
    /// `barrier`. Defaults: 1024 elements, f32, root 0.
    fn from_str(s: &str) -> Result<Step, String> {
        let mut parts = s.trim().split(':');
        let op: ScriptOp = parts.next().unwrap_or_default().parse()?;
        let mut step = Step::new(op, if op == ScriptOp::Barrier { 0 } else { 1024 });
        if let Some(n) = parts.next() {
            step.numel = n.parse().map_err(|_| format!("{s:?}: element count {n:?} is not a number"))?;
        }
        if let Some(d) = parts.next() {
            step.dtype = d.parse().map_err(|_| format!("{s:?}: unknown dtype {d:?}"))?;
            if !is_checkable(step.dtype) {
                return Err(format!("{s:?}: scripts use float or 32/64-bit integer dtypes, not {d}"));
            }
        }
        if let Some(r) = parts.next() {
            let v = r.strip_prefix("root=").ok_or_else(|| format!("{s:?}: expected root=R, got {r:?}"))?;
            step.root = v.parse().map_err(|_| format!("{s:?}: root {v:?} is not a number"))?;
        }
        if let Some(extra) = parts.next() {
            return Err(format!("{s:?}: unexpected {extra:?}"));
        }
        Ok(step)
    }
}

/// Dtypes whose script values (small integers) are exact and cannot overflow.
fn is_checkable(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::Bf16 | DType::I32 | DType::I64)
}

/// A list of collectives every rank runs in order, `window` of them in flight at once
/// (1: each is waited before the next is issued, as synchronous calls are).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Script {
    /// The collectives.
    pub steps: Vec<Step>,
    /// How many may be in flight at once (at least 1).
    pub window: usize,
}

impl Script {
    /// A synchronous script.
    pub fn new(steps: Vec<Step>) -> Script {
        Script { steps, window: 1 }
    }

    /// `n` f32 allreduces of `numel` elements.
    pub fn allreduces(n: usize, numel: usize) -> Script {
        Script::new(vec![Step::new(ScriptOp::Allreduce, numel); n])
    }

    /// This script with `window` collectives in flight at once.
    pub fn window(mut self, window: usize) -> Script {
        self.window = window.max(1);
        self
    }

    /// Check the script against a world size: roots in range.
    pub fn validate(&self, world_size: u32) -> Result<(), ScriptError> {
        for (k, s) in self.steps.iter().enumerate() {
            if s.op == ScriptOp::Broadcast && s.root >= world_size {
                return Err(ScriptError(format!(
                    "step {k} ({s}): root {} is not a rank of a {world_size}-rank world",
                    s.root
                )));
            }
        }
        Ok(())
    }
}

/// A script that does not fit the world ([`Script::validate`]); the text says which step and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ScriptError(pub String);

impl FromStr for Script {
    type Err = String;
    /// Comma-separated [`Step`]s, e.g. `allreduce:1024,allgather:16:f16,barrier`.
    fn from_str(s: &str) -> Result<Script, String> {
        let steps = s.split(',').filter(|p| !p.trim().is_empty()).map(str::parse).collect::<Result<Vec<_>, _>>()?;
        if steps.is_empty() {
            return Err("an empty script".into());
        }
        Ok(Script::new(steps))
    }
}

impl fmt::Display for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps: Vec<String> = self.steps.iter().map(Step::to_string).collect();
        write!(f, "{}", steps.join(","))?;
        if self.window > 1 {
            write!(f, " (window {})", self.window)?;
        }
        Ok(())
    }
}

/// Rank `rank`'s input value at element `i`: small integers, exact in every checkable dtype
/// even when summed over 64 ranks.
pub fn value(rank: u32, i: usize) -> f64 {
    ((rank as usize + 2 * i) % 3) as f64
}

/// The sum of [`value`]`(q, i)` over ranks `q < world`, in constant time: a rank's value only
/// depends on it modulo 3, so every run of 3 ranks adds 0 + 1 + 2. The check of a big job's
/// allreduce would otherwise cost every rank O(world) a element, O(world²) in all.
pub fn sum_of_values(world: u32, i: usize) -> f64 {
    let partial: f64 = (0..world % 3).map(|q| value(q, i)).sum();
    f64::from(world / 3) * 3.0 + partial
}

pub(crate) fn input(rank: u32, numel: usize, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..numel).map(|i| value(rank, i)).collect();
    Tensor::from_f64s(dtype, &v)
}

/// Submit `step` on `pg`.
pub(crate) fn submit(pg: &ProcessGroup, step: &Step) -> Result<Work, String> {
    let me = pg.rank().0;
    let n = pg.world_size() as usize;
    let r = match step.op {
        ScriptOp::Allreduce => pg.allreduce(vec![input(me, step.numel, step.dtype)], ReduceOp::Sum),
        ScriptOp::Broadcast => pg.broadcast(vec![input(me, step.numel, step.dtype)], step.root),
        ScriptOp::Allgather => pg.allgather(input(me, step.numel, step.dtype)),
        ScriptOp::ReduceScatter => pg.reduce_scatter_tensor(input(me, step.numel * n, step.dtype), ReduceOp::Sum),
        ScriptOp::Alltoall => {
            let out = Tensor::from_f64s(step.dtype, &vec![0.0; step.numel * n]);
            pg.alltoall_base(out, input(me, step.numel * n, step.dtype), None, None)
        }
        ScriptOp::Barrier => pg.barrier(),
    };
    r.map_err(|e| e.to_string())
}

/// Whether `outputs` are what `step` must produce on `rank` of `world_size`; `Err` says what
/// differs.
pub(crate) fn check(step: &Step, rank: u32, world_size: u32, outputs: &[Tensor]) -> Result<(), String> {
    let n = world_size as usize;
    let k = step.numel;
    let expected: Vec<Vec<f64>> = match step.op {
        ScriptOp::Barrier => return Ok(()),
        ScriptOp::Allreduce => vec![(0..k).map(|i| sum_of_values(world_size, i)).collect()],
        ScriptOp::Broadcast => vec![(0..k).map(|i| value(step.root, i)).collect()],
        ScriptOp::Allgather => (0..world_size).map(|q| (0..k).map(|i| value(q, i)).collect()).collect(),
        ScriptOp::ReduceScatter => {
            vec![(0..k).map(|i| sum_of_values(world_size, rank as usize * k + i)).collect()]
        }
        ScriptOp::Alltoall => {
            vec![(0..n * k).map(|j| value((j / k.max(1)) as u32, rank as usize * k + j % k.max(1))).collect()]
        }
    };
    if outputs.len() != expected.len() {
        return Err(format!("{} output tensors, expected {}", outputs.len(), expected.len()));
    }
    for (t, (out, want)) in outputs.iter().zip(&expected).enumerate() {
        if out.dtype() != step.dtype {
            return Err(format!("output {t} is {}, expected {}", out.dtype(), step.dtype));
        }
        let got = out.to_f64s();
        if got.len() != want.len() {
            return Err(format!("output {t} has {} elements, expected {}", got.len(), want.len()));
        }
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
            return Err(format!("output {t}[{i}] = {}, expected {}", got[i], want[i]));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_of_values_is_the_sum() {
        for world in 0..20 {
            for i in 0..12 {
                let brute: f64 = (0..world).map(|q| value(q, i)).sum();
                assert_eq!(sum_of_values(world, i), brute, "world {world}, element {i}");
            }
        }
    }

    #[test]
    fn scripts_parse_and_print_back() {
        let s: Script = "allreduce:1024:f32, broadcast:16:f16:root=2,barrier,alltoall:8:i64".parse().unwrap();
        assert_eq!(s.steps.len(), 4);
        assert_eq!(s.steps[1], Step::new(ScriptOp::Broadcast, 16).dtype(DType::F16).root(2));
        assert_eq!(s.to_string(), "allreduce:1024:f32,broadcast:16:f16:root=2,barrier,alltoall:8:i64");
        assert_eq!(s.to_string().parse::<Script>().unwrap(), s);
        assert_eq!("allgather".parse::<Step>().unwrap(), Step::new(ScriptOp::Allgather, 1024));
    }

    #[test]
    fn bad_scripts_name_what_is_wrong() {
        assert!("allreduse:4".parse::<Script>().unwrap_err().contains("unknown collective \"allreduse\""));
        assert!("allreduce:x".parse::<Script>().unwrap_err().contains("\"x\" is not a number"));
        assert!("allreduce:4:u8".parse::<Script>().unwrap_err().contains("not u8"));
        assert!("allreduce:4:f32:7".parse::<Script>().unwrap_err().contains("root=R"));
        assert!("".parse::<Script>().unwrap_err().contains("empty"));
        let s: Script = "broadcast:4:f32:root=4".parse().unwrap();
        assert!(s.validate(4).unwrap_err().0.contains("root 4 is not a rank of a 4-rank world"));
        s.validate(5).unwrap();
    }

    #[test]
    fn the_checker_accepts_the_right_outputs_and_names_a_wrong_element() {
        let step = Step::new(ScriptOp::Allreduce, 5);
        let sum: Vec<f64> = (0..5).map(|i| (0..3).map(|q| value(q, i)).sum()).collect();
        check(&step, 0, 3, &[Tensor::from_f64s(DType::F32, &sum)]).unwrap();
        let mut bad = sum.clone();
        bad[3] += 1.0;
        let e = check(&step, 0, 3, &[Tensor::from_f64s(DType::F32, &bad)]).unwrap_err();
        assert!(e.contains("output 0[3]"), "{e}");
        let e = check(&step, 0, 3, &[]).unwrap_err();
        assert!(e.contains("0 output tensors, expected 1"), "{e}");
    }
}
