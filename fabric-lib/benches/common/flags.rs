//! Command-line flags of the harness-less benches: `--name value` pairs.

/// The `(flag, value)` pairs after the program name; panics on a flag without a value. `cargo
/// bench` passes `--bench` to every harness-less bench: it is skipped.
pub fn flag_pairs() -> impl Iterator<Item = (String, String)> {
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    std::iter::from_fn(move || {
        let flag = it.next()?;
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        Some((flag, value))
    })
}
