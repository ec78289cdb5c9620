//! Byte sizes on the command line: `500M`, `10GiB`, `1.5G`, `4096`. Sans-IO.
//!
//! Suffixes are binary (K = 1024) whether or not the `i` is written, because cache bounds
//! and rates are compared with file sizes, which tools show in binary units.

/// Parses a size; the error says what is accepted.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1,
        "k" | "ki" => 1 << 10,
        "m" | "mi" => 1 << 20,
        "g" | "gi" => 1 << 30,
        "t" | "ti" => 1 << 40,
        _ => {
            return Err(format!(
                "size {s:?}: unit must be one of K, M, G, T (binary), or none"
            ))
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("size {s:?}: expected a number like 500M or 10G"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("size {s:?} is out of range"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("500M"), Ok(500 << 20));
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert!(parse_size("ten").is_err());
        assert!(parse_size("5X").unwrap_err().contains("unit"));
    }
}
