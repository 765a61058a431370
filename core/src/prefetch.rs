//! Cache hints: ask for a line ahead of its use, by its address alone. Neither reads nor writes
//! anything the program sees, nor can fault, whatever the address; each does nothing on targets
//! without the instruction.

/// Ask for the cache line at `line`, to read.
#[inline]
pub(crate) fn for_read(line: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
}

/// Ask for the cache line at `line` in the exclusive state a store needs. Call only where
/// [`for_write_supported`] says the processor has the instruction.
#[inline]
pub(crate) fn for_write(line: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads and writes nothing and never faults; the caller checked that
    // the processor has the instruction.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) line, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
}

/// Whether this processor has `prefetchw` (CPUID 8000_0001h, ECX bit 8), for [`for_write`]. The
/// standard library can neither detect nor enable it on stable Rust (`prfchw` is an unstable
/// target feature, and `_mm_prefetch` with a write hint emits a read prefetch without it).
pub(crate) fn for_write_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *SUPPORTED.get_or_init(|| {
            // Leaf 8000_0000h says which extended leaves there are.
            __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}
