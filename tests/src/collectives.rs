//! Every collective and dtype, checked against a reference each rank computes on its own:
//! rank r's input element i is a small integer `(r + 1) * (i % 7 + 1)`, exact in every dtype,
//! so any rank knows every other rank's input.

use cohort_core::{DType, ReduceOp, Tensor};
use cohort_transports::ProcessGroup;

/// Rank `r`'s input value at element `i`.
pub fn value(r: u32, i: usize) -> f64 {
    f64::from(r + 1) * ((i % 7) as f64 + 1.0)
}

/// A 1-d tensor of `dtype` holding `values` (which must be representable).
pub fn make(dtype: DType, values: &[f64]) -> Tensor {
    Tensor::from_f64s(dtype, values)
}

/// The elements of `t` as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_f64s()
}

fn input(dtype: DType, r: u32, n: usize) -> Tensor {
    let v: Vec<f64> = (0..n).map(|i| value(r, i)).collect();
    let v: Vec<f64> =
        if dtype == DType::Bool { v.iter().map(|x| f64::from((*x as u64).is_multiple_of(2))).collect() } else { v };
    make(dtype, &v)
}

fn expect(what: &str, got: &Tensor, want: &[f64]) -> Result<(), String> {
    let g = values(got);
    if g.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", g.len(), want.len()));
    }
    if let Some(i) = (0..g.len()).find(|&i| g[i] != want[i]) {
        return Err(format!("{what}: element {i} is {}, expected {}", g[i], want[i]));
    }
    Ok(())
}

fn reduce_ref(op: ReduceOp, dtype: DType, world: u32, n: usize) -> Vec<f64> {
    let inputs: Vec<Vec<f64>> = (0..world).map(|r| values(&input(dtype, r, n))).collect();
    (0..n)
        .map(|i| {
            let col = inputs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum if dtype == DType::Bool => f64::from(col.fold(0.0, |a, b| a + b) > 0.0),
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg if dtype.is_floating_point() => col.sum::<f64>() / f64::from(world),
                ReduceOp::Avg => (col.sum::<f64>() / f64::from(world)).trunc(),
                ReduceOp::Max => col.fold(f64::MIN, f64::max),
                ReduceOp::Min => col.fold(f64::MAX, f64::min),
                ReduceOp::BXor => col.fold(0u64, |a, b| a ^ b as u64) as f64,
                _ => f64::NAN,
            }
        })
        .collect()
}

fn ok<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Run every collective on every dtype and check each result; the first mismatch is the error.
pub fn run_all(pg: &ProcessGroup) -> Result<(), String> {
    let (me, world) = (pg.rank().0, pg.world_size());
    let w = world as usize;
    for dtype in DType::ALL {
        for n in [1usize, 1001] {
            let ops: &[ReduceOp] = match dtype {
                DType::Bool => &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::BXor],
                d if d.is_floating_point() => &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min],
                _ => &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::BXor],
            };
            for &op in ops {
                let what = format!("allreduce {op} {dtype} n={n}");
                let out = ok(&what, ok(&what, pg.allreduce(vec![input(dtype, me, n)], op))?.result())?;
                expect(&what, &out[0], &reduce_ref(op, dtype, world, n))?;

                let root = (world - 1) / 2;
                let what = format!("reduce {op} {dtype} n={n} root={root}");
                let out = ok(&what, ok(&what, pg.reduce(vec![input(dtype, me, n)], root, op))?.result())?;
                if me == root {
                    expect(&what, &out[0], &reduce_ref(op, dtype, world, n))?;
                }
            }
            let root = world - 1;
            let what = format!("broadcast {dtype} n={n} root={root}");
            let out = ok(&what, ok(&what, pg.broadcast(vec![input(dtype, me, n)], root))?.result())?;
            expect(&what, &out[0], &values(&input(dtype, root, n)))?;

            let what = format!("allgather {dtype} n={n}");
            let out = ok(&what, ok(&what, pg.allgather(input(dtype, me, n)))?.result())?;
            for r in 0..world {
                expect(&format!("{what} from rank {r}"), &out[r as usize], &values(&input(dtype, r, n)))?;
            }
            let what = format!("allgather_into_tensor {dtype} n={n}");
            let out = ok(&what, ok(&what, pg.allgather_into_tensor(input(dtype, me, n)))?.result())?;
            let want: Vec<f64> = (0..world).flat_map(|r| values(&input(dtype, r, n))).collect();
            expect(&what, &out[0], &want)?;
            // Into the caller's output (world × n, filled with ones first: every element must be
            // written), which comes back with its shape.
            let what = format!("allgather_base {dtype} n={n}");
            let given = make(dtype, &vec![1.0; w * n]).reshape(&[w, n]).map_err(|e| e.to_string())?;
            let out = ok(&what, ok(&what, pg.allgather_base(given, input(dtype, me, n)))?.result())?;
            if out[0].shape() != [w, n] {
                return Err(format!("{what}: shape {:?}", out[0].shape()));
            }
            expect(&what, &out[0], &want)?;
            let what = format!("allgather_base {dtype} n={n} with a short output");
            match pg.allgather_base(make(dtype, &vec![0.0; n]), input(dtype, me, n)).map(|w| w.result()) {
                Err(e) if e.to_string().contains("expected world size") => {}
                other => return Err(format!("{what}: expected a refusal, got {other:?}")),
            }

            let what = format!("gather {dtype} n={n}");
            let out = ok(&what, ok(&what, pg.gather(input(dtype, me, n), 0))?.result())?;
            if me == 0 {
                for r in 0..world {
                    expect(&format!("{what} from rank {r}"), &out[r as usize], &values(&input(dtype, r, n)))?;
                }
            }
            let what = format!("scatter {dtype} n={n}");
            let pieces = if me == 1 % world { (0..world).map(|r| input(dtype, r, n)).collect() } else { Vec::new() };
            let out = ok(&what, ok(&what, pg.scatter(make(dtype, &vec![0.0; n]), pieces, 1 % world))?.result())?;
            expect(&what, &out[0], &values(&input(dtype, me, n)))?;

            if dtype != DType::Bool {
                let what = format!("reduce_scatter_tensor {dtype} n={n}");
                let full = input(dtype, me, n * w);
                let out = ok(&what, ok(&what, pg.reduce_scatter_tensor(full, ReduceOp::Sum))?.result())?;
                let all = reduce_ref(ReduceOp::Sum, dtype, world, n * w);
                expect(&what, &out[0], &all[me as usize * n..(me as usize + 1) * n])?;
                let what = format!("reduce_scatter_base {dtype} n={n}");
                let given = make(dtype, &vec![1.0; n]);
                let out = ok(
                    &what,
                    ok(&what, pg.reduce_scatter_base(given, input(dtype, me, n * w), ReduceOp::Sum))?.result(),
                )?;
                expect(&what, &out[0], &all[me as usize * n..(me as usize + 1) * n])?;
            }

            let what = format!("alltoall_base {dtype} n={n}");
            // Rank r sends (r + p + 1) elements to rank p.
            let sends: Vec<usize> = (0..world).map(|p| (me + p + 1) as usize).collect();
            let recvs: Vec<usize> = (0..world).map(|p| (p + me + 1) as usize).collect();
            let inp = input(dtype, me, sends.iter().sum());
            let out = make(dtype, &vec![0.0; recvs.iter().sum()]);
            let got = ok(&what, ok(&what, pg.alltoall_base(out, inp, Some(recvs.clone()), Some(sends)))?.result())?;
            let mut want = Vec::new();
            for p in 0..world {
                let theirs = values(&input(dtype, p, (0..world).map(|q| (p + q + 1) as usize).sum()));
                let start: usize = (0..me).map(|q| (p + q + 1) as usize).sum();
                want.extend_from_slice(&theirs[start..start + recvs[p as usize]]);
            }
            expect(&what, &got[0], &want)?;
        }
    }
    let what = "allreduce_coalesced";
    let ts = vec![input(DType::F32, me, 5), input(DType::F32, me, 17)];
    let out = ok(what, ok(what, pg.allreduce_coalesced(ts, ReduceOp::Sum))?.result())?;
    expect(what, &out[0], &reduce_ref(ReduceOp::Sum, DType::F32, world, 5))?;
    expect(what, &out[1], &reduce_ref(ReduceOp::Sum, DType::F32, world, 17))?;
    ok("barrier", ok("barrier", pg.barrier())?.wait())?;
    Ok(())
}
