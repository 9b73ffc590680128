//! The CUDA C source of every kernel: the `.cu` files of `kernels/`, one translation unit.

/// The kernel source: the files are one translation unit, concatenated in
/// this order (`forward.cu`'s header says what each holds). NVRTC compiles
/// it at start-up; the emulation test compiles it as C++.
pub(crate) const KERNEL_SOURCE: &str = concat!(
    include_str!("kernels/forward.cu"),
    include_str!("kernels/q32.cu"),
    include_str!("kernels/kquant.cu"),
    include_str!("kernels/half.cu"),
    include_str!("kernels/sampling.cu"),
);
