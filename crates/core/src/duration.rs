//! Durations as config files, flags and the environment write them: `1h`, `2m`, `10s`,
//! `250ms`, `1m30s`, or plain seconds (`15`, `0.5`). One parser for every setting of
//! every binary, so that a duration reads the same wherever it is written.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// The longest duration a setting may have: 100 years, far beyond any timeout or
/// retention, and short enough that a deadline that far from now is still a time (a
/// `1e19` seconds' TTL overflowed every `Instant` it was added to).
pub const MAX: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Parses `1h`, `2m`, `10s`, `250ms`, `1m30s` or plain seconds (`15`, `0.5`), at most
/// [`MAX`].
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let invalid = || format!("invalid duration {text:?}: use e.g. 500ms, 10s, 2m or 1h");
    parse_unbounded(text, invalid).and_then(|d| within_max(d, text))
}

/// `d`, or an error when it is longer than [`MAX`].
fn within_max(d: Duration, text: &str) -> Result<Duration, String> {
    if d > MAX {
        Err(format!(
            "duration {text:?} is too long: at most 100 years ({}s)",
            MAX.as_secs()
        ))
    } else {
        Ok(d)
    }
}

fn parse_unbounded(text: &str, invalid: impl Fn() -> String + Copy) -> Result<Duration, String> {
    if text.is_empty() {
        return Err(invalid());
    }
    if let Ok(seconds) = text.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).map_err(|_| invalid());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(invalid)?;
        let (number, tail) = rest.split_at(split);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let value: f64 = number.parse().map_err(|_| invalid())?;
        let seconds = match unit {
            "ms" => value / 1000.0,
            "s" => value,
            "m" => value * 60.0,
            "h" => value * 3600.0,
            _ => return Err(invalid()),
        };
        total += Duration::try_from_secs_f64(seconds).map_err(|_| invalid())?;
        rest = next;
    }
    Ok(total)
}

/// Renders a duration the way [`parse`] reads it.
pub fn format(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

/// Serializes as text, for `#[serde(with = "agentrt_core::duration")]`.
pub fn serialize<S: Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format(*d))
}

/// Deserializes from text or a number of seconds.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Seconds(f64),
    }
    match Raw::deserialize(deserializer)? {
        Raw::Text(text) => parse(&text).map_err(serde::de::Error::custom),
        Raw::Seconds(s) => Duration::try_from_secs_f64(s)
            .map_err(|e| e.to_string())
            .and_then(|d| within_max(d, &s.to_string()))
            .map_err(serde::de::Error::custom),
    }
}
