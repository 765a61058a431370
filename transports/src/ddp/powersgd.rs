//! PowerSGD (Vogels et al., 2019) as torch's `powerSGD_hook`: each gradient matrix M (n × m)
//! is approximated by P Qᵀ with P (n × r) and Q (m × r); ranks allreduce P and Q instead of
//! M. Error feedback carries what the approximation missed into the next step; warm start
//! reuses last step's Q, so the power iteration converges across steps.

use std::collections::BTreeMap;
use std::sync::Arc;

use cohort_core::reduce::ReduceOp;
use cohort_core::schedule::harness::SplitMix64;
use cohort_core::tensor::{DType, Tensor};
use cohort_core::work::{OpType, WorkResult};
use tokio::sync::Mutex;

use super::hooks::{CommHook, GradBucket, failed_work, refused_result};
use crate::tcp::ProcessGroup;
use crate::work::Work;

/// PowerSGD's settings (torch's `PowerSGDState`).
#[derive(Debug, Clone, PartialEq)]
pub struct PowerSgdConfig {
    /// The rank r of the approximation (`matrix_approximation_rank`, default 1).
    pub rank: usize,
    /// Steps of plain allreduce before compressing (`start_powerSGD_iter`, default 1000; torch
    /// requires at least 2 with error feedback or warm start).
    pub start_iter: u64,
    /// A matrix is compressed only if `(n + m) · r · min_compression_rate < n · m`
    /// (`min_compression_rate`, default 2).
    pub min_compression_rate: f64,
    /// Add last step's approximation error before compressing (`use_error_feedback`).
    pub error_feedback: bool,
    /// Start each step's power iteration from last step's Q (`warm_start`).
    pub warm_start: bool,
    /// Added to column norms during orthogonalization (`orthogonalization_epsilon`, default 0).
    pub epsilon: f32,
    /// Seed of Q's random initialization; equal on every rank (`random_seed`, default 0).
    pub seed: u64,
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        PowerSgdConfig {
            rank: 1,
            start_iter: 1000,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
            epsilon: 0.0,
            seed: 0,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    iter: u64,
    rng: Option<SplitMix64>,
    /// Per bucket: the error of last step's approximation.
    errors: BTreeMap<usize, Vec<f32>>,
    /// Per bucket: last step's Q of each compressed matrix.
    qs: BTreeMap<usize, Vec<Vec<f32>>>,
}

/// The PowerSGD hook. Buckets are reduced one after another (each waits for the previous
/// bucket's three collectives), so that every rank issues them in the same order.
#[derive(Debug)]
pub struct PowerSgdHook {
    config: PowerSgdConfig,
    state: Arc<Mutex<State>>,
    /// Completion of the last launched bucket.
    previous: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl PowerSgdHook {
    /// A hook with `config`; fails on settings torch refuses.
    pub fn new(config: PowerSgdConfig) -> Result<PowerSgdHook, super::DdpError> {
        if config.rank == 0 {
            return Err(super::DdpError::Config("PowerSGD: the approximation rank must be at least 1".into()));
        }
        if (config.error_feedback || config.warm_start) && config.start_iter < 2 {
            return Err(super::DdpError::Config(
                "PowerSGD: start_iter must be at least 2 with error feedback or warm start (as torch requires)".into(),
            ));
        }
        let rng = Some(SplitMix64::new(config.seed));
        Ok(PowerSgdHook { config, state: Arc::new(Mutex::new(State { rng, ..State::default() })), previous: None })
    }

    /// Steps seen so far (torch's `state.iter`).
    pub fn iteration(&self) -> u64 {
        self.state.try_lock().map(|s| s.iter).unwrap_or(0)
    }
}

impl CommHook for PowerSgdHook {
    fn name(&self) -> &str {
        "powerSGD"
    }

    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> Work {
        if bucket.buffer.dtype() != DType::F32 {
            return failed_work(pg, format!("PowerSGD: gradients must be float32, not {}", bucket.buffer.dtype()));
        }
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let previous = self.previous.replace(done_rx);
        let (pg2, config, state) = (pg.clone(), self.config.clone(), self.state.clone());
        pg.spawn_work(OpType::Allreduce, async move {
            if let Some(prev) = previous {
                let _ = prev.await; // the previous bucket's collectives are all issued and done
            }
            let out = reduce_bucket(&pg2, &config, &state, bucket).await;
            let _ = done_tx.send(());
            out
        })
    }
}

fn comm_err(message: impl Into<String>) -> WorkResult {
    WorkResult::CommError { blame: cohort_core::Blame::nobody(), message: message.into() }
}

async fn allreduce_sum(pg: &ProcessGroup, data: Vec<f32>) -> Result<Vec<f32>, WorkResult> {
    let n = data.len();
    if n == 0 {
        return Ok(data);
    }
    let work = pg.allreduce(vec![Tensor::from_slice(&data)], ReduceOp::Sum).map_err(|e| refused_result(&e))?;
    let out = work.await.map_err(|e| e.to_result())?;
    out.first()
        .and_then(|t| t.to_vec::<f32>().ok())
        .filter(|v| v.len() == n)
        .ok_or_else(|| comm_err("allreduce returned no tensor"))
}

/// Standard normal samples (Box–Muller) from a seeded generator.
fn gaussian(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        out.push((r * (std::f64::consts::TAU * u2).cos()) as f32);
        out.push((r * (std::f64::consts::TAU * u2).sin()) as f32);
    }
    out.truncate(n);
    out
}

/// Gram–Schmidt on the r columns of a row-major (rows × r) matrix, as torch's
/// `_orthogonalize_gram_schmidt`.
fn orthogonalize(m: &mut [f32], rows: usize, r: usize, epsilon: f32) {
    for i in 0..r {
        let norm = (0..rows).map(|k| m[k * r + i] * m[k * r + i]).sum::<f32>().sqrt();
        let d = if epsilon == 0.0 { if norm > 0.0 { norm } else { 1.0 } } else { norm + epsilon };
        (0..rows).for_each(|k| m[k * r + i] /= d);
        for j in i + 1..r {
            let dot: f32 = (0..rows).map(|k| m[k * r + i] * m[k * r + j]).sum();
            (0..rows).for_each(|k| m[k * r + j] -= dot * m[k * r + i]);
        }
    }
}

/// out (n × r) = M (n × m) · Q (m × r)
fn matmul(mat: &[f32], n: usize, m: usize, q: &[f32], r: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * r];
    for i in 0..n {
        let row = &mat[i * m..(i + 1) * m];
        for (k, &x) in row.iter().enumerate() {
            let qk = &q[k * r..(k + 1) * r];
            for c in 0..r {
                out[i * r + c] += x * qk[c];
            }
        }
    }
    out
}

/// out (m × r) = Mᵀ (m × n) · P (n × r)
fn matmul_t(mat: &[f32], n: usize, m: usize, p: &[f32], r: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * r];
    for i in 0..n {
        let row = &mat[i * m..(i + 1) * m];
        let pi = &p[i * r..(i + 1) * r];
        for (k, &x) in row.iter().enumerate() {
            for c in 0..r {
                out[k * r + c] += x * pi[c];
            }
        }
    }
    out
}

async fn reduce_bucket(
    pg: &ProcessGroup,
    cfg: &PowerSgdConfig,
    state: &Mutex<State>,
    bucket: GradBucket,
) -> Result<Vec<Tensor>, WorkResult> {
    let world = pg.world_size() as f32;
    let mut state = state.lock().await;
    let mut input = bucket.buffer.to_vec::<f32>().map_err(|e| comm_err(e.to_string()))?;
    let shape = bucket.buffer.shape().to_vec();
    let finish = |state: &mut State, data: &[f32]| -> Result<Vec<Tensor>, WorkResult> {
        if bucket.is_last() {
            state.iter += 1;
        }
        Ok(vec![Tensor::from_slice_shaped(data, &shape).map_err(|e| comm_err(e.to_string()))?])
    };

    if state.iter < cfg.start_iter {
        // Vanilla allreduce until PowerSGD starts.
        let mut sum = allreduce_sum(pg, input).await?;
        sum.iter_mut().for_each(|x| *x /= world);
        return finish(&mut state, &sum);
    }

    if cfg.error_feedback {
        let err = state.errors.entry(bucket.index).or_insert_with(|| vec![0.0; input.len()]);
        if err.len() == input.len() {
            input.iter_mut().zip(err.iter()).for_each(|(x, e)| *x += e);
        }
    }
    let with_feedback = cfg.error_feedback.then(|| input.clone());

    // Which gradients to compress: matrices (n × m with n = shape[0]) worth it; the rest go
    // through a plain allreduce.
    let r = cfg.rank;
    let mut compress: Vec<(usize, usize, usize, usize)> = Vec::new(); // (offset, n, m, r_eff)
    let mut plain: Vec<usize> = Vec::new();
    for i in 0..bucket.params.len() {
        let s = &bucket.shapes[i];
        let numel = bucket.lengths[i];
        if s.len() >= 2 && numel > 0 {
            let (n, m) = (s[0], numel / s[0]);
            let re = r.min(n).min(m);
            if ((n + m) * re) as f64 * cfg.min_compression_rate < (n * m) as f64 {
                compress.push((bucket.offsets[i], n, m, re));
                continue;
            }
        }
        plain.push(i);
    }

    // The uncompressed gradients: allreduce, average.
    let flat_plain: Vec<f32> = plain
        .iter()
        .flat_map(|&i| input[bucket.offsets[i]..bucket.offsets[i] + bucket.lengths[i]].iter().copied())
        .collect();
    let reduced_plain = allreduce_sum(pg, flat_plain).await?;
    let mut at = 0;
    for &i in &plain {
        let dst = &mut input[bucket.offsets[i]..bucket.offsets[i] + bucket.lengths[i]];
        for (d, s) in dst.iter_mut().zip(&reduced_plain[at..at + bucket.lengths[i]]) {
            *d = s / world;
        }
        at += bucket.lengths[i];
    }

    // Q: last step's (warm start) or fresh Gaussians, equal on every rank (same seed, same
    // sequence of buckets), orthogonalized.
    let reuse = cfg.warm_start
        && state.qs.get(&bucket.index).is_some_and(|qs| {
            qs.len() == compress.len() && qs.iter().zip(&compress).all(|(q, &(_, _, m, re))| q.len() == m * re)
        });
    let mut qs: Vec<Vec<f32>> = if reuse {
        state.qs.remove(&bucket.index).expect("checked")
    } else {
        let rng = state.rng.get_or_insert_with(|| SplitMix64::new(cfg.seed));
        let mut seeded = SplitMix64::new(rng.next_u64());
        compress.iter().map(|&(_, _, m, re)| gaussian(&mut seeded, m * re)).collect()
    };
    for (q, &(_, _, m, re)) in qs.iter_mut().zip(&compress) {
        orthogonalize(q, m, re, cfg.epsilon);
    }

    // P = M Q for every matrix, allreduced (summed) as one buffer.
    let mut ps_flat = Vec::new();
    for (q, &(off, n, m, re)) in qs.iter().zip(&compress) {
        ps_flat.extend(matmul(&input[off..off + n * m], n, m, q, re));
    }
    let ps_flat = allreduce_sum(pg, ps_flat).await?;
    let mut ps: Vec<Vec<f32>> = Vec::with_capacity(compress.len());
    let mut at = 0;
    for &(_, n, _, re) in &compress {
        let mut p = ps_flat[at..at + n * re].to_vec();
        orthogonalize(&mut p, n, re, cfg.epsilon);
        ps.push(p);
        at += n * re;
    }

    // Q = Mᵀ P, allreduced and averaged.
    let mut qs_flat = Vec::new();
    for (p, &(off, n, m, re)) in ps.iter().zip(&compress) {
        qs_flat.extend(matmul_t(&input[off..off + n * m], n, m, p, re));
    }
    let qs_flat = allreduce_sum(pg, qs_flat).await?;
    let mut at = 0;
    for (q, &(_, _, m, re)) in qs.iter_mut().zip(&compress) {
        q.copy_from_slice(&qs_flat[at..at + m * re]);
        q.iter_mut().for_each(|x| *x /= world);
        at += m * re;
    }

    // M ≈ P Qᵀ.
    for ((p, q), &(off, n, m, re)) in ps.iter().zip(&qs).zip(&compress) {
        let dst = &mut input[off..off + n * m];
        for i in 0..n {
            for k in 0..m {
                dst[i * m + k] = (0..re).map(|c| p[i * re + c] * q[k * re + c]).sum();
            }
        }
    }

    if let Some(fed) = with_feedback {
        let err: Vec<f32> = fed.iter().zip(&input).map(|(a, b)| a - b).collect();
        state.errors.insert(bucket.index, err);
    }
    if cfg.warm_start {
        state.qs.insert(bucket.index, qs);
    }
    finish(&mut state, &input)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_schmidt_gives_orthonormal_columns() {
        let mut rng = SplitMix64::new(3);
        let (rows, r) = (20, 4);
        let mut m = gaussian(&mut rng, rows * r);
        orthogonalize(&mut m, rows, r, 0.0);
        for i in 0..r {
            for j in 0..r {
                let dot: f32 = (0..rows).map(|k| m[k * r + i] * m[k * r + j]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5, "({i},{j}) = {dot}");
            }
        }
    }

    #[test]
    fn matmuls_agree_with_the_definition() {
        // M = [[1, 2, 3], [4, 5, 6]], Q = [[1], [0], [2]] -> MQ = [[7], [16]]; Mᵀ[[1],[1]] = [5, 7, 9].
        let m = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(matmul(&m, 2, 3, &[1.0, 0.0, 2.0], 1), vec![7.0, 16.0]);
        assert_eq!(matmul_t(&m, 2, 3, &[1.0, 1.0], 1), vec![5.0, 7.0, 9.0]);
    }

    #[test]
    fn gaussians_are_seeded_and_roughly_standard() {
        let a = gaussian(&mut SplitMix64::new(9), 10_000);
        assert_eq!(a, gaussian(&mut SplitMix64::new(9), 10_000));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let var = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
    }

    #[test]
    fn torch_refuses_what_we_refuse() {
        let bad = PowerSgdConfig { start_iter: 1, ..PowerSgdConfig::default() };
        assert!(PowerSgdHook::new(bad).unwrap_err().to_string().contains("at least 2"));
        let zero = PowerSgdConfig { rank: 0, ..PowerSgdConfig::default() };
        assert!(PowerSgdHook::new(zero).is_err());
    }
}
