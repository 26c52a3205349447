use std::fmt;

use serde::{Deserialize, Serialize};

/// A secret setting (an API key): read like a string, never printed.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether no secret was given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() {
            "\"\""
        } else {
            "\"****\""
        })
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(if self.0.is_empty() { "" } else { "****" })
    }
}

/// `text` with the credentials of every URL in it (`scheme://user:password@host`) replaced
/// by `***`, for logs, errors and printed settings. The rest of each URL is kept.
pub fn mask_url_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| {
                matches!(c, '/' | '?' | '#' | '"' | '\'' | '<' | '>') || c.is_whitespace()
            })
            .unwrap_or(after.len());
        match after[..authority_end].rfind('@') {
            Some(user_end) => {
                out.push_str("***");
                out.push_str(&after[user_end..authority_end]);
            }
            None => out.push_str(&after[..authority_end]),
        }
        rest = &after[authority_end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod mask_tests {
    use super::*;

    #[test]
    fn url_credentials_are_masked_wherever_they_stand() {
        assert_eq!(
            mask_url_credentials(
                "base_url = \"http://user:pass@host:8000/v1?x=@\"\nother = \"https://h/p\""
            ),
            "base_url = \"http://***@host:8000/v1?x=@\"\nother = \"https://h/p\""
        );
        assert_eq!(
            mask_url_credentials("redis://:pw@r:6379/0 and ftp://a@b"),
            "redis://***@r:6379/0 and ftp://***@b"
        );
        assert_eq!(mask_url_credentials("no urls here"), "no urls here");
    }
}
