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

/// `text` with the credentials of every URL in it replaced by `***`, for logs, errors and
/// printed settings: a user and password (`scheme://user:password@host`), and the value of
/// every query parameter (`?api-key=***`), where gateways such as Azure API Management
/// (`subscription-key`) and Google (`key`) take their keys. The rest of each URL (host,
/// path, the parameters' names) is kept, so that it can still be told which URL it was.
pub fn mask_url_credentials(text: &str) -> String {
    // A URL ends where it would in a config file or a message: at a quote, an angle
    // bracket or a space.
    let ends_url = |c: char| matches!(c, '"' | '\'' | '<' | '>') || c.is_whitespace();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| matches!(c, '/' | '?' | '#') || ends_url(c))
            .unwrap_or(after.len());
        match after[..authority_end].rfind('@') {
            Some(user_end) => {
                out.push_str("***");
                out.push_str(&after[user_end..authority_end]);
            }
            None => out.push_str(&after[..authority_end]),
        }
        let after = &after[authority_end..];
        let path_end = after
            .find(|c: char| matches!(c, '?' | '#') || ends_url(c))
            .unwrap_or(after.len());
        out.push_str(&after[..path_end]);
        rest = &after[path_end..];
        if let Some(query) = rest.strip_prefix('?') {
            let query_end = query
                .find(|c: char| c == '#' || ends_url(c))
                .unwrap_or(query.len());
            out.push('?');
            push_masked_query(&mut out, &query[..query_end]);
            rest = &query[query_end..];
        }
    }
    out.push_str(rest);
    out
}

/// Writes `query` (without its `?`) to `out`, each parameter's value replaced by `***`.
/// Parameters are split at `&` only: a value holding a `;` is masked whole. A parameter
/// without a value (`?stream`, `?key=`) has nothing to hide, and is kept.
pub fn push_masked_query(out: &mut String, query: &str) {
    for (i, parameter) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match parameter.split_once('=') {
            Some((name, value)) if !value.is_empty() => {
                out.push_str(name);
                out.push_str("=***");
            }
            _ => out.push_str(parameter),
        }
    }
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
            "base_url = \"http://***@host:8000/v1?x=***\"\nother = \"https://h/p\""
        );
        assert_eq!(
            mask_url_credentials("redis://:pw@r:6379/0 and ftp://a@b"),
            "redis://***@r:6379/0 and ftp://***@b"
        );
        assert_eq!(mask_url_credentials("no urls here"), "no urls here");
    }

    /// Keys in a URL's query (Azure API Management's `subscription-key`, `api-key`,
    /// Google's `key`) are masked too; the names stay, to tell the URL.
    #[test]
    fn every_query_value_is_masked_and_the_names_stay() {
        assert_eq!(
            mask_url_credentials(
                "https://apim.example.com/openai/v1/chat/completions?subscription-key=s3cr3t&api-version=2024-10-21"
            ),
            "https://apim.example.com/openai/v1/chat/completions?subscription-key=***&api-version=***"
        );
        assert_eq!(
            mask_url_credentials(
                "model call failed url=http://u:p@h:1/v1?key=abc;def&stream&empty=#top, again"
            ),
            "model call failed url=http://***@h:1/v1?key=***&stream&empty=#top, again"
        );
        assert_eq!(
            mask_url_credentials(
                "base_url \"http://h/v1?api-key=k1\" and <https://h?x=a%26b> then https://h/?q=1"
            ),
            "base_url \"http://h/v1?api-key=***\" and <https://h?x=***> then https://h/?q=***"
        );
        // A URL in a query value is masked with it.
        assert_eq!(
            mask_url_credentials("https://h/cb?next=https://u:p@o/?key=k"),
            "https://h/cb?next=***"
        );
    }
}
