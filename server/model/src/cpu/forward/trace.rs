//! Per-layer tracing of the residual stream, for comparing backends layer by layer.

thread_local! {
    /// The residual stream after every layer, while [`trace_layers`] runs.
    static LAYER_TRACE: std::cell::RefCell<Option<Vec<Vec<f32>>>> =
        const { std::cell::RefCell::new(None) };
}

pub(super) fn record_layer(x: &[f32]) {
    LAYER_TRACE.with(|t| {
        if let Some(v) = t.borrow_mut().as_mut() {
            v.push(x.to_vec());
        }
    });
}

/// Diagnostics (the GPU tests compare backends layer by layer): runs `f`
/// with per-layer recording on this thread and returns its result and the
/// residual stream after every layer of every CPU forward step `f` ran on
/// this thread (`n_tokens × n_embd` values per layer and step).
pub fn trace_layers<R>(f: impl FnOnce() -> R) -> (R, Vec<Vec<f32>>) {
    LAYER_TRACE.with(|t| *t.borrow_mut() = Some(Vec::new()));
    let r = f();
    let layers = LAYER_TRACE
        .with(|t| t.borrow_mut().take())
        .unwrap_or_default();
    (r, layers)
}
