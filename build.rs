//! Placeholder; compiles proto/ once the service issue lands.
fn main() {}
