//! Ages and sizes as flags and settings write them (`7d`, `90m`, `10GiB`), read and written
//! back. At the bottom of the crate: the server's, the store's and the pusher's flags all use
//! them.
use std::time::Duration;

/// Seconds in one of the time units ages are written in (`s`, `m`, `h`, `d`, `w`).
pub(crate) fn unit_seconds(unit: &str) -> Option<u64> {
    Some(match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => return None,
    })
}

/// `7d`, `12h`, `90m`, `30s` or plain seconds.
pub(crate) fn parse_age(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(pos) => text.split_at(pos),
        None => (text, "s"),
    };
    let Some(seconds) = unit_seconds(unit) else {
        return Err(format!(
            "'{text}' is not a duration (e.g. 7d, 12h, 90m, 3600s)"
        ));
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Duration::from_secs(n.saturating_mul(seconds))),
        _ => Err(format!(
            "'{text}' is not a positive duration (e.g. 7d, 12h, 90m, 3600s)"
        )),
    }
}

/// The shortest text [`parse_age`] reads back as `age`: the largest unit that divides it.
pub(crate) fn format_age(age: Duration) -> String {
    let seconds = age.as_secs();
    let unit = [(86_400, "d"), (3600, "h"), (60, "m")]
        .into_iter()
        .find(|(size, _)| seconds > 0 && seconds.is_multiple_of(*size));
    match unit {
        Some((size, suffix)) => format!("{}{suffix}", seconds / size),
        None => format!("{seconds}s"),
    }
}

/// The shortest text [`parse_size`] reads back as `bytes`, in binary units.
pub(crate) fn format_size(bytes: u64) -> String {
    let unit = [
        (1u64 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ]
    .into_iter()
    .find(|(size, _)| bytes > 0 && bytes.is_multiple_of(*size));
    match unit {
        Some((size, suffix)) => format!("{}{suffix}", bytes / size),
        None => format!("{bytes}B"),
    }
}

/// `10GiB`, `500MiB`, `64KiB`, `1GB`, or plain bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(pos) => text.split_at(pos),
        None => (text, ""),
    };
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "'{text}' is not a size (e.g. 10GiB, 500MiB, 16MiB)"
            ));
        }
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 => n
            .checked_mul(factor)
            .ok_or_else(|| format!("'{text}' is too large")),
        _ => Err(format!(
            "'{text}' is not a positive size (e.g. 10GiB, 500MiB)"
        )),
    }
}
