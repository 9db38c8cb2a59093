//! Byte sizes on the command line (`4K`, `64KiB`, `1M`, `65536`) and in reports.
use crate::bail;
use crate::error::Result;

/// Parses a size with an optional binary suffix: K/KiB, M/MiB, G/GiB (all powers of 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        bail!("size '{text}' does not start with a number");
    }
    let value: u64 = match t[..digits].parse() {
        Ok(v) => v,
        Err(e) => bail!("size '{text}': {e}"),
    };
    let shift = match t[digits..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        other => bail!("size '{text}': unknown suffix '{other}' (use K, M or G)"),
    };
    let Some(bytes) = value.checked_mul(1u64 << shift) else { bail!("size '{text}' overflows") };
    if bytes == 0 {
        bail!("size '{text}' must be positive");
    }
    Ok(bytes)
}

/// clap value parser for sizes.
pub fn size_arg(text: &str) -> std::result::Result<u64, String> {
    parse_size(text).map_err(|e| e.0)
}

/// `4 KiB`, `64 MiB`, `100 B`.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes & ((1 << shift) - 1) == 0 {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(100), "100 B");
        assert!(parse_size("").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }
}
