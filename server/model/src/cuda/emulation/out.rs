//! The case files the emulated kernels read: host values written as their raw bytes.

use std::io::Write;
use std::path::Path;

use crate::quant::{BlockQ8_1, QK, quantize_q8_1};

pub(super) fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: only used on slices of f32 / i32 / u16 / u8 and the
    // #[repr(C)] block structs, whose bytes are all initialised (no padding).
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

pub(super) struct Out(std::fs::File);

impl Out {
    pub(super) fn create(dir: &Path, name: &str) -> Out {
        Out(std::fs::File::create(dir.join(name)).expect("case file"))
    }
    pub(super) fn put<T>(&mut self, v: &[T]) {
        self.0.write_all(bytes(v)).expect("case file write");
    }
}

pub(super) fn quantized(x: &[f32]) -> Vec<BlockQ8_1> {
    let mut q = vec![BlockQ8_1::default(); x.len() / QK];
    quantize_q8_1(x, &mut q);
    q
}
