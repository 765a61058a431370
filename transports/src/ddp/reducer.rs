//! The bucketed gradient reducer (c10d's `Reducer`, dense gradients).

use cohort_core::tensor::{DType, Tensor};

use super::DdpError;
use super::hooks::{CommHook, GradBucket};
use crate::tcp::ProcessGroup;
use crate::work::Work;

/// Bucket size caps in bytes: DDP's first bucket is small so that communication starts early
/// in the backward pass (`bucket_cap_mb` for the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCaps {
    /// The first bucket's cap (DDP: 1 MiB).
    pub first: usize,
    /// Every other bucket's cap (DDP: 25 MiB).
    pub rest: usize,
}

impl Default for BucketCaps {
    fn default() -> Self {
        BucketCaps { first: 1 << 20, rest: 25 << 20 }
    }
}

/// DDP's bucket assignment: parameters in reverse registration order (gradients become ready
/// roughly in that order during backward), a bucket closed once it reaches its cap. Returns
/// the parameter indices of each bucket, in reduction order.
pub fn assign_buckets(sizes_bytes: &[usize], caps: BucketCaps) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut filled = 0;
    for p in (0..sizes_bytes.len()).rev() {
        current.push(p);
        filled += sizes_bytes[p];
        let cap = if buckets.is_empty() { caps.first } else { caps.rest };
        if filled >= cap {
            buckets.push(std::mem::take(&mut current));
            filled = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

#[derive(Debug)]
struct Bucket {
    params: Vec<usize>,
    offsets: Vec<usize>,
    numel: usize,
    /// This step's flat buffer, filled as gradients arrive.
    buffer: Option<Tensor>,
    pending: usize,
    work: Option<Work>,
}

/// Buckets gradients as DDP does and reduces each bucket with a [`CommHook`] as soon as all
/// its gradients are marked ready, so communication overlaps the rest of the backward pass.
/// Buckets are launched in bucket order (a complete bucket waits for the ones before it), so
/// every rank issues the same collectives in the same order whatever order its gradients
/// arrive in.
pub struct Reducer {
    pg: ProcessGroup,
    hook: Box<dyn CommHook>,
    dtype: DType,
    shapes: Vec<Vec<usize>>,
    names: Vec<Option<String>>,
    buckets: Vec<Bucket>,
    /// Per parameter: (bucket, position in it).
    place: Vec<(usize, usize)>,
    ready: Vec<bool>,
    next_launch: usize,
    step: u64,
}

impl std::fmt::Debug for Reducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reducer")
            .field("hook", &self.hook.name())
            .field("params", &self.shapes.len())
            .field("buckets", &self.buckets.len())
            .field("step", &self.step)
            .finish()
    }
}

impl Reducer {
    /// A reducer for parameters of `shapes` (registration order) and `dtype`, with DDP's
    /// default caps (first bucket 1 MiB, then 25 MiB).
    pub fn new(
        pg: ProcessGroup,
        shapes: Vec<Vec<usize>>,
        dtype: DType,
        hook: Box<dyn CommHook>,
    ) -> Result<Reducer, DdpError> {
        Reducer::with_caps(pg, shapes, dtype, hook, BucketCaps::default())
    }

    /// [`Reducer::new`] with other bucket caps.
    pub fn with_caps(
        pg: ProcessGroup,
        shapes: Vec<Vec<usize>>,
        dtype: DType,
        hook: Box<dyn CommHook>,
        caps: BucketCaps,
    ) -> Result<Reducer, DdpError> {
        if shapes.is_empty() {
            return Err(DdpError::Config("the reducer needs at least one parameter".into()));
        }
        let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product::<usize>() * dtype.size()).collect();
        let plan = assign_buckets(&sizes, caps);
        let mut place = vec![(0, 0); shapes.len()];
        let buckets = plan
            .into_iter()
            .enumerate()
            .map(|(b, params)| {
                let mut offsets = Vec::with_capacity(params.len());
                let mut numel = 0;
                for (i, &p) in params.iter().enumerate() {
                    place[p] = (b, i);
                    offsets.push(numel);
                    numel += shapes[p].iter().product::<usize>();
                }
                let pending = params.len();
                Bucket { params, offsets, numel, buffer: None, pending, work: None }
            })
            .collect();
        let n = shapes.len();
        Ok(Reducer {
            pg,
            hook,
            dtype,
            shapes,
            names: vec![None; n],
            buckets,
            place,
            ready: vec![false; n],
            next_launch: 0,
            step: 0,
        })
    }

    /// Name the parameters (registration order), for error messages.
    pub fn with_names(mut self, names: Vec<String>) -> Self {
        for (slot, name) in self.names.iter_mut().zip(names) {
            *slot = Some(name);
        }
        self
    }

    /// The buckets' parameter indices, in reduction order.
    pub fn buckets(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Steps finished so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    fn describe(&self, p: usize) -> String {
        match &self.names[p] {
            Some(name) => format!("{p} ({name})"),
            None => p.to_string(),
        }
    }

    /// Parameter `param`'s gradient is ready: copy it into its bucket, and launch the hook on
    /// every bucket that is now complete and next in order.
    pub fn mark_ready(&mut self, param: usize, grad: &Tensor) -> Result<(), DdpError> {
        let count = self.shapes.len();
        if param >= count {
            return Err(DdpError::NoSuchParam { index: param, count });
        }
        if self.ready[param] {
            return Err(DdpError::ReadyTwice { param: self.describe(param) });
        }
        let numel: usize = self.shapes[param].iter().product();
        if grad.dtype() != self.dtype || grad.numel() != numel {
            return Err(DdpError::BadGradient {
                param: self.describe(param),
                what: format!(
                    "got {} {:?}, expected {} {:?}",
                    grad.dtype(),
                    grad.shape(),
                    self.dtype,
                    self.shapes[param]
                ),
            });
        }
        let (b, i) = self.place[param];
        let es = self.dtype.size();
        let bucket = &mut self.buckets[b];
        if bucket.buffer.is_none() {
            bucket.buffer = Some(Tensor::zeros(self.dtype, &[bucket.numel])?);
        }
        let buffer = bucket.buffer.as_mut().expect("just made");
        let at = bucket.offsets[i] * es;
        buffer.bytes_mut()[at..at + grad.nbytes()].copy_from_slice(grad.bytes());
        bucket.pending -= 1;
        self.ready[param] = true;
        self.launch_ready();
        Ok(())
    }

    fn launch_ready(&mut self) {
        let num_buckets = self.buckets.len();
        while self.next_launch < num_buckets && self.buckets[self.next_launch].pending == 0 {
            let b = self.next_launch;
            let bucket = &mut self.buckets[b];
            let grad_bucket = GradBucket {
                index: b,
                num_buckets,
                buffer: bucket.buffer.take().expect("a complete bucket has its buffer"),
                params: bucket.params.clone(),
                offsets: bucket.offsets.clone(),
                lengths: bucket.params.iter().map(|&p| self.shapes[p].iter().product()).collect(),
                shapes: bucket.params.iter().map(|&p| self.shapes[p].clone()).collect(),
                sparse_indices: None,
            };
            let work = self.hook.run(&self.pg, grad_bucket);
            self.buckets[b].work = Some(work);
            self.next_launch += 1;
        }
    }

    /// Check every gradient was marked and take the launched works, resetting for the next step.
    fn end_step(&mut self) -> Result<Vec<(usize, Work)>, DdpError> {
        let missing: Vec<String> =
            (0..self.shapes.len()).filter(|&p| !self.ready[p]).map(|p| self.describe(p)).collect();
        let works: Vec<(usize, Work)> =
            self.buckets.iter_mut().enumerate().filter_map(|(b, bucket)| bucket.work.take().map(|w| (b, w))).collect();
        self.reset();
        if !missing.is_empty() {
            // Launched buckets still finish in the background (their collectives are under way
            // on every rank); the ones never launched leave the other ranks waiting, as in DDP.
            drop(works);
            return Err(DdpError::NeverReady { params: missing.join(", ") });
        }
        Ok(works)
    }

    fn reset(&mut self) {
        for bucket in &mut self.buckets {
            bucket.pending = bucket.params.len();
            bucket.buffer = None;
            bucket.work = None;
        }
        self.ready.iter_mut().for_each(|r| *r = false);
        self.next_launch = 0;
    }

    fn scatter_back(&self, reduced: Vec<(usize, Tensor)>) -> Result<Vec<Tensor>, DdpError> {
        let mut out: Vec<Option<Tensor>> = vec![None; self.shapes.len()];
        for (b, flat) in reduced {
            let bucket = &self.buckets[b];
            let es = flat.element_size();
            if flat.numel() != bucket.numel || flat.dtype() != self.dtype {
                return Err(DdpError::Config(format!(
                    "the {} hook returned {} {} elements for bucket {b}, expected {} {}",
                    self.hook.name(),
                    flat.numel(),
                    flat.dtype(),
                    bucket.numel,
                    self.dtype
                )));
            }
            for (i, &p) in bucket.params.iter().enumerate() {
                let n: usize = self.shapes[p].iter().product();
                let bytes = &flat.bytes()[bucket.offsets[i] * es..(bucket.offsets[i] + n) * es];
                out[p] = Some(Tensor::from_bytes(self.dtype, &self.shapes[p], bytes)?);
            }
        }
        Ok(out.into_iter().map(|t| t.expect("every parameter is in one bucket")).collect())
    }

    /// End the step: wait for every bucket's hook and return the reduced gradients, one per
    /// parameter in registration order. Fails naming the parameters never marked ready, or
    /// with the first failed bucket's error (which names the rank it blames).
    pub fn finish(&mut self) -> Result<Vec<Tensor>, DdpError> {
        let works = self.end_step()?;
        let mut reduced = Vec::with_capacity(works.len());
        for (b, w) in works {
            let flat = w.result()?.pop().ok_or_else(|| DdpError::Config(format!("bucket {b}: no tensor")))?;
            reduced.push((b, flat));
        }
        self.step += 1;
        self.scatter_back(reduced)
    }

    /// [`Reducer::finish`] for async code.
    pub async fn finish_async(&mut self) -> Result<Vec<Tensor>, DdpError> {
        let works = self.end_step()?;
        let mut reduced = Vec::with_capacity(works.len());
        for (b, w) in works {
            let flat = w.await?.pop().ok_or_else(|| DdpError::Config(format!("bucket {b}: no tensor")))?;
            reduced.push((b, flat));
        }
        self.step += 1;
        self.scatter_back(reduced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_ddp_reverse_order_and_caps() {
        let mib = 1 << 20;
        // 6 params: 0.5, 0.5, 0.5, 10, 20, 0.25 MiB.
        let sizes = [mib / 2, mib / 2, mib / 2, 10 * mib, 20 * mib, mib / 4];
        let caps = BucketCaps::default();
        let b = assign_buckets(&sizes, caps);
        // First bucket closes at 1 MiB: params 5 (0.25) + 4 (20) -> over 1 MiB at once.
        assert_eq!(b, vec![vec![5, 4], vec![3, 2, 1, 0]]);
        let small = assign_buckets(&[100; 10], BucketCaps { first: 250, rest: 400 });
        assert_eq!(small, vec![vec![9, 8, 7], vec![6, 5, 4, 3], vec![2, 1, 0]]);
        assert_eq!(assign_buckets(&[0], caps), vec![vec![0]]);
    }
}
