//! The `cohort` binary's allocator: mimalloc, asked the way its small blocks come fastest.
//!
//! glibc's allocator hands freed large blocks back to the kernel, so a rank would fault fresh,
//! zeroed pages in on every large collective, and its small allocations are a visible share of
//! a small work's cost; mimalloc keeps both down at the price of a somewhat larger resident set
//! (figures in `docs/performance.md`). A program that embeds the library picks its own
//! allocator.
//!
//! # Why not the `mimalloc` crate's allocator as it is
//!
//! It asks for every block with `mi_malloc_aligned`, whatever the alignment. mimalloc 3 serves
//! that from the size's free list while the list has a block; once the list is empty, it takes
//! its plain allocation only for sizes whose class is a power of two, and otherwise
//! over-allocates by the alignment and aligns inside the block, through two more calls. A
//! program that frees a block and soon asks for one of its size again (a small collective's
//! finished `Work`, at every iteration) finds the list empty at nearly every call: the freed
//! block waits on the page's local list until an allocation's slow path collects it. Counted
//! with callgrind, mimalloc's own instructions in a two-rank 4 B allreduce over TCP came to
//! about 2,900 a work through the aligned calls and about 1,360 through the plain ones
//! (`docs/performance.md`). Every mimalloc block is a whole number of words on a word-aligned
//! start, so a request aligned to at most a word goes to the plain functions, which satisfy
//! it; a larger alignment keeps the aligned ones.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The global allocator of the `cohort` binary (see the module docs).
pub(crate) struct Mimalloc;

/// The alignment every mimalloc block has.
const WORD: usize = std::mem::size_of::<usize>();

// SAFETY: every block comes from mimalloc and goes back through `mi_free`, which takes any
// block mimalloc made, aligned or not. The plain functions serve only layouts aligned to at
// most a word, which every block they return is; larger alignments go to the aligned
// functions, for allocation and reallocation alike (a block's layout keeps its alignment).
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain calls into the allocator with the layout's size (and alignment).
        unsafe {
            if layout.align() <= WORD {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller hands back a block this allocator made.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: a block this allocator made with `layout`, resized as it was allocated.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::alloc::{GlobalAlloc, Layout};

    use super::Mimalloc;

    #[test]
    fn every_block_has_its_alignment_keeps_its_bytes_through_a_resize_and_zeroed_ones_are_zero() {
        let a = Mimalloc;
        for align in [1usize, 2, 4, 8, 16, 32, 64, 4096] {
            for size in [1usize, 3, 8, 24, 40, 48, 72, 200, 328, 1000, 1025, 5000, 1 << 20] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size; each block is written within its size and freed once.
                unsafe {
                    let zeroed = a.alloc_zeroed(layout);
                    assert!(!zeroed.is_null() && (zeroed as usize).is_multiple_of(align), "zeroed {size} at {align}");
                    assert!(std::slice::from_raw_parts(zeroed, size).iter().all(|&b| b == 0), "{size} at {align}");
                    a.dealloc(zeroed, layout);
                    for new_size in [size * 3, size.div_ceil(2)] {
                        let p = a.alloc(layout);
                        assert!(!p.is_null() && (p as usize).is_multiple_of(align), "{size} at {align}");
                        for i in 0..size {
                            *p.add(i) = (i % 251) as u8;
                        }
                        let q = a.realloc(p, layout, new_size);
                        assert!(!q.is_null() && (q as usize).is_multiple_of(align), "{size} to {new_size} at {align}");
                        let kept = size.min(new_size);
                        assert!((0..kept).all(|i| *q.add(i) == (i % 251) as u8), "{size} to {new_size} at {align}");
                        a.dealloc(q, Layout::from_size_align(new_size, align).unwrap());
                    }
                }
            }
        }
    }
}
