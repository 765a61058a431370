//! The tensor lists that entries describe (each input's and output's shape and dtype), each
//! distinct list kept once while an entry points at it.
//!
//! # Why
//!
//! A loop of collectives on tensors of one shape, the common case, would otherwise write the
//! same lists into every slot of the ring: vectors whose lines were last written a whole turn of
//! the ring ago and are out of the cache by then. An entry holds the id of its description
//! instead; a description lives while an entry points at it (a count of them), so the table
//! holds at most one description per slot, however many distinct shapes a job uses.
//!
//! # Encoding
//!
//! A description is a list of `u64`: the number of inputs, the number of tensors (inputs, then
//! outputs), then for each tensor its dtype's code, its number of dims and its dims.

use std::collections::HashMap;

use super::TensorShape;
use crate::tensor::DType;

/// No description: a slot not yet written.
pub(super) const NONE: u32 = u32::MAX;

/// The sizes and dtype names of an entry's inputs and outputs, as the dump gives them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Described {
    pub(super) input_sizes: Vec<Vec<u64>>,
    pub(super) input_dtypes: Vec<String>,
    pub(super) output_sizes: Vec<Vec<u64>>,
    pub(super) output_dtypes: Vec<String>,
}

/// The interned descriptions.
#[derive(Debug, Default)]
pub(super) struct Shapes {
    /// By id: the encoded description and the number of entries pointing at it (a free id's
    /// is empty, with none).
    table: Vec<(Box<[u64]>, u32)>,
    /// Ids no entry points at, for the next new description.
    free: Vec<u32>,
    index: HashMap<Box<[u64]>, u32>,
    /// The last id handed out: the next work's description is most often the same.
    last: u32,
    /// Where a description missing from `last` is encoded for the lookup (kept: no allocation).
    scratch: Vec<u64>,
}

impl Shapes {
    /// The id of the description of `inputs` then `outputs`, counted as pointed at by one more
    /// entry.
    pub(super) fn acquire<T: TensorShape>(&mut self, inputs: &[T], outputs: &[T]) -> u32 {
        let last = self.last as usize;
        if let Some((key, refs)) = self.table.get_mut(last)
            && *refs > 0
            && matches(key, inputs, outputs)
        {
            *refs += 1;
            return self.last;
        }
        let scratch = &mut self.scratch;
        scratch.clear();
        scratch.extend([inputs.len() as u64, (inputs.len() + outputs.len()) as u64]);
        for t in inputs.iter().chain(outputs) {
            scratch.extend([u64::from(t.dtype().code()), t.shape().len() as u64]);
            scratch.extend(t.shape().iter().map(|&d| d as u64));
        }
        let id = match self.index.get(&self.scratch[..]) {
            Some(&id) => id,
            None => {
                let key: Box<[u64]> = self.scratch.as_slice().into();
                let id = match self.free.pop() {
                    Some(id) => {
                        self.table[id as usize] = (key.clone(), 0);
                        id
                    }
                    None => {
                        self.table.push((key.clone(), 0));
                        u32::try_from(self.table.len() - 1).expect("fewer than 2^32 descriptions")
                    }
                };
                self.index.insert(key, id);
                id
            }
        };
        self.table[id as usize].1 += 1;
        self.last = id;
        id
    }

    /// One more entry points at `id`, which an entry points at already ([`NONE`] and free ids
    /// are ignored).
    pub(super) fn add_ref(&mut self, id: u32) {
        if let Some((_, refs)) = self.table.get_mut(id as usize)
            && *refs > 0
        {
            *refs += 1;
        }
    }

    /// Every description in use and how many entries point at it, in a fixed order.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> Vec<(Box<[u64]>, u32)> {
        let mut used: Vec<_> = self.table.iter().filter(|(_, refs)| *refs > 0).cloned().collect();
        used.sort();
        used
    }

    /// One entry less points at `id` ([`NONE`] is ignored); the last one frees it.
    pub(super) fn release(&mut self, id: u32) {
        let Some((key, refs)) = self.table.get_mut(id as usize) else { return };
        if *refs == 0 {
            return;
        }
        *refs -= 1;
        if *refs == 0 {
            let key = std::mem::take(key);
            self.index.remove(&key);
            self.free.push(id);
        }
    }

    /// What description `id` says (empty lists for [`NONE`] or an id not in use).
    pub(super) fn describe(&self, id: u32) -> Described {
        let Some((key, _)) = self.table.get(id as usize).filter(|(_, refs)| *refs > 0) else {
            return Described::default();
        };
        let mut words = key.iter().copied();
        let inputs = words.next().unwrap_or(0);
        let tensors = words.next().unwrap_or(0);
        let mut out = Described::default();
        for i in 0..tensors {
            let dtype = words.next().and_then(|c| u8::try_from(c).ok()).and_then(DType::from_code);
            let dims = words.next().unwrap_or(0);
            let sizes: Vec<u64> = words.by_ref().take(dims as usize).collect();
            let name = dtype.map_or("(unknown)", DType::scalar_type_name).to_owned();
            let (s, d) = if i < inputs {
                (&mut out.input_sizes, &mut out.input_dtypes)
            } else {
                (&mut out.output_sizes, &mut out.output_dtypes)
            };
            s.push(sizes);
            d.push(name);
        }
        out
    }

    /// Descriptions some entry points at.
    #[cfg(test)]
    pub(super) fn live(&self) -> usize {
        self.table.iter().filter(|(_, refs)| *refs > 0).count()
    }
}

/// Whether `key` describes `inputs` then `outputs`.
fn matches<T: TensorShape>(key: &[u64], inputs: &[T], outputs: &[T]) -> bool {
    let mut words = key.iter().copied();
    if words.next() != Some(inputs.len() as u64) || words.next() != Some((inputs.len() + outputs.len()) as u64) {
        return false;
    }
    for t in inputs.iter().chain(outputs) {
        let shape = t.shape();
        if words.next() != Some(u64::from(t.dtype().code())) || words.next() != Some(shape.len() as u64) {
            return false;
        }
        if !shape.iter().all(|&d| words.next() == Some(d as u64)) {
            return false;
        }
    }
    words.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::TensorMeta;

    fn t(dtype: DType, shape: &'static [usize]) -> TensorMeta<'static> {
        TensorMeta { dtype, shape }
    }

    #[test]
    fn one_description_per_distinct_list_and_each_reads_back_as_it_went_in() {
        let mut s = Shapes::default();
        let a = [t(DType::F32, &[2, 3])];
        let b = [t(DType::F32, &[6])];
        let out = [t(DType::I64, &[]), t(DType::Bf16, &[1, 1, 4])];
        let ia = s.acquire(&a, &[]);
        assert_eq!(s.acquire(&a, &[]), ia, "the same list twice");
        let ib = s.acquire(&b, &[]);
        assert_ne!(ia, ib, "same numel, other shape");
        let ic = s.acquire(&[t(DType::I32, &[6])], &[]);
        assert_ne!(ic, ib, "same shape, other dtype");
        let id = s.acquire(&a, &out);
        assert_ne!(id, ia, "outputs count");
        assert_eq!(s.acquire(&[], &a), s.acquire(&[], &a));
        assert_ne!(s.acquire(&[], &a), ia, "an output is not an input");
        assert_eq!(s.acquire(&a, &[]), ia, "found again after others");
        assert_eq!(
            s.describe(id),
            Described {
                input_sizes: vec![vec![2, 3]],
                input_dtypes: vec!["Float".into()],
                output_sizes: vec![vec![], vec![1, 1, 4]],
                output_dtypes: vec!["Long".into(), "BFloat16".into()],
            }
        );
        assert_eq!(s.describe(NONE), Described::default());
    }

    #[test]
    fn the_last_release_frees_a_description_and_its_id_is_reused() {
        let mut s = Shapes::default();
        let a = [t(DType::F32, &[4])];
        let b = [t(DType::F64, &[4])];
        let ia = s.acquire(&a, &[]);
        assert_eq!(s.acquire(&a, &[]), ia);
        let ib = s.acquire(&b, &[]);
        s.release(ia);
        assert_eq!(s.live(), 2, "one entry still points at a");
        s.release(ia);
        assert_eq!(s.live(), 1);
        assert_eq!(s.describe(ia), Described::default(), "freed");
        s.release(ia);
        s.release(NONE);
        assert_eq!(s.live(), 1, "a release too many changes nothing");
        let ic = s.acquire(&[t(DType::U8, &[9])], &[]);
        assert_eq!(ic, ia, "the free id is reused");
        assert_eq!(s.describe(ic).input_dtypes, ["Byte"]);
        assert_eq!(s.acquire(&a, &[]), 2, "a, gone, comes back under a new id");
        assert_eq!(s.describe(ib).input_sizes, [vec![4]]);
    }
}
