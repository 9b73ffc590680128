//! [`CachedHead`]: one head's (or one group's) rounded query and its cached keys and values.

use half::f16;

use crate::ggml::Flavor;

/// One attention head over `n_pos` cached positions (`attention_head`), or
/// one grouped-query group's heads (`attention_group`: `q16` holds their
/// queries one after another).
#[derive(Clone, Copy, Debug)]
pub struct CachedHead<'a> {
    /// The query already rounded to f16 (`hd` values).
    pub q16: &'a [f32],
    /// `n_pos × hd` keys and values, straight from the cache.
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub n_pos: usize,
    pub scale: f32,
    /// A one-token batch (llama.cpp's `ggml_vec_dot_f16` order; see
    /// `ggml::attention::Head::decode`).
    pub decode: bool,
    /// Whose lane order (`model.numerics`).
    pub flavor: Flavor,
}
