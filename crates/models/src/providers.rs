use std::collections::BTreeMap;

use agentrt_core::Secret;
use serde::{Deserialize, Serialize};

/// The wire protocol a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// OpenAI-compatible chat completions: OpenAI, vLLM, Ollama, llama.cpp server,
    /// LiteLLM, DeepSeek, ...
    #[default]
    Openai,
}

/// One provider, as a config file writes it under `[providers.<name>]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSettings {
    /// The wire protocol.
    #[serde(default)]
    pub kind: ProviderKind,
    /// Base URL of the API, up to and including the version, e.g. `http://host:8000/v1`.
    pub base_url: String,
    /// The API key; prefer `api_key_env` so that the key stays out of files.
    #[serde(default, skip_serializing_if = "Secret::is_empty")]
    pub api_key: Secret,
    /// Name of an environment variable holding the API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// The header the key goes in, as it is (Azure OpenAI's `api-key`); by default
    /// `Authorization: Bearer <key>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_header: Option<String>,
    /// Speak HTTP/2 from the first byte on a plain `http://` URL (h2c with prior
    /// knowledge), for servers that accept it, such as the simulator. One connection then
    /// carries every call at once. `https://` URLs negotiate HTTP/2 by themselves.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub http2_prior_knowledge: bool,
    /// Which HTTP client calls the provider.
    #[serde(default, skip_serializing_if = "HttpClient::is_default")]
    pub http_client: HttpClient,
}

/// The HTTP client of a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HttpClient {
    /// The lean HTTP/2 client for `http://` URLs with `http2_prior_knowledge`, the general
    /// one otherwise.
    #[default]
    Lean,
    /// The general client (reqwest on hyper) always, with HTTP/2 prior knowledge when
    /// `http2_prior_knowledge` is set: to compare the two, or should the lean one not
    /// suit a server.
    General,
}

impl HttpClient {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Why providers could not be set up.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProviderError {
    /// A base URL is not an http(s) URL.
    #[error("provider {name:?}: base_url {url:?} must start with http:// or https://")]
    BadUrl {
        /// The provider.
        name: String,
        /// The URL given, its credentials masked ([`crate::mask_credentials`]): the
        /// error is printed and logged.
        url: String,
    },
    /// A base URL that no call could be made to.
    #[error("provider {name:?}: base_url {url:?} {why}")]
    InvalidUrl {
        /// The provider.
        name: String,
        /// The URL given, its credentials masked ([`crate::mask_credentials`]).
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The default provider is not among the configured ones.
    #[error("default provider {0:?} is not configured")]
    UnknownDefault(String),
    /// A provider name is empty or malformed.
    #[error("provider name {0:?} must be non-empty letters, digits, '_' or '-'")]
    BadName(String),
    /// The header named for the key is not one it can go in.
    #[error("provider {name:?}: api_key_header {header:?} is not a header the key can go in")]
    BadKeyHeader {
        /// The provider.
        name: String,
        /// The header given.
        header: String,
    },
}

/// The providers of this server, by name, with the one used when a config names none.
#[derive(Debug, Clone, Default)]
pub struct ProviderRegistry {
    providers: BTreeMap<String, ProviderSettings>,
    default: Option<String>,
}

impl ProviderRegistry {
    /// Builds the registry from settings. With no provider configured, the environment's
    /// `OPENAI_BASE_URL` and/or `OPENAI_API_KEY` register one named `openai`. The default
    /// provider is `default`, or the only provider when there is exactly one.
    pub fn new(
        mut providers: BTreeMap<String, ProviderSettings>,
        default: Option<String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ProviderError> {
        if providers.is_empty() {
            let base_url = env("OPENAI_BASE_URL").filter(|v| !v.is_empty());
            let api_key = env("OPENAI_API_KEY").filter(|v| !v.is_empty());
            if base_url.is_some() || api_key.is_some() {
                providers.insert(
                    "openai".into(),
                    ProviderSettings {
                        kind: ProviderKind::Openai,
                        base_url: base_url.unwrap_or_else(|| "https://api.openai.com/v1".into()),
                        api_key: api_key.map(Secret::new).unwrap_or_default(),
                        api_key_env: None,
                        api_key_header: None,
                        http2_prior_knowledge: false,
                        http_client: HttpClient::Lean,
                    },
                );
            }
        }
        for (name, settings) in &mut providers {
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(ProviderError::BadName(name.clone()));
            }
            if !(settings.base_url.starts_with("http://")
                || settings.base_url.starts_with("https://"))
            {
                return Err(ProviderError::BadUrl {
                    name: name.clone(),
                    url: crate::mask_credentials(&settings.base_url),
                });
            }
            let invalid = |why: String| ProviderError::InvalidUrl {
                name: name.clone(),
                url: crate::mask_credentials(&settings.base_url),
                why,
            };
            if settings.base_url.chars().any(char::is_whitespace) {
                // The URL parser would send a space in the path as `%20`.
                return Err(invalid("holds a space: no provider's URL does".to_owned()));
            }
            let url = reqwest::Url::parse(&settings.base_url)
                .map_err(|e| invalid(format!("is not a valid URL: {e}")))?;
            if url.fragment().is_some() {
                return Err(invalid(
                    "has a fragment (`#...`), which no request sends".to_owned(),
                ));
            }
            if let Some(header) = &settings.api_key_header
                && !http::header::HeaderName::from_bytes(header.as_bytes())
                    .is_ok_and(|h| h != http::header::CONTENT_TYPE && h != http::header::ACCEPT)
            {
                return Err(ProviderError::BadKeyHeader {
                    name: name.clone(),
                    header: header.clone(),
                });
            }
            if settings.api_key.is_empty()
                && let Some(var) = &settings.api_key_env
                && let Some(key) = env(var).filter(|key| !key.is_empty())
            {
                settings.api_key = Secret::new(key);
            }
        }
        let default = match default.filter(|d| !d.is_empty()) {
            Some(name) if providers.contains_key(&name) => Some(name),
            Some(name) => return Err(ProviderError::UnknownDefault(name)),
            None if providers.len() == 1 => providers.keys().next().cloned(),
            None => None,
        };
        Ok(Self { providers, default })
    }

    /// The provider called `name`.
    pub fn get(&self, name: &str) -> Option<&ProviderSettings> {
        self.providers.get(name)
    }

    /// The provider used when a config names none.
    pub fn default_provider(&self) -> Option<&str> {
        self.default.as_deref()
    }

    /// Every provider's name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.providers.keys().map(String::as_str)
    }

    /// The settings, for `--print-config` (keys are masked when serialized).
    pub fn settings(&self) -> &BTreeMap<String, ProviderSettings> {
        &self.providers
    }
}

/// The URL of `path` (`chat/completions`, `rerank`) under `base_url`, before the base
/// URL's query, which every call then carries (the `?api-version=...` some gateways ask for).
pub(crate) fn endpoint(base_url: &str, path: &str) -> String {
    let (base, query) = base_url
        .split_once('?')
        .map_or((base_url, ""), |(base, query)| (base, query));
    let mut url = format!("{}/{path}", base.trim_end_matches('/'));
    if !query.is_empty() {
        url.push('?');
        url.push_str(query);
    }
    url
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn openai_environment_registers_a_default_provider() {
        let registry = ProviderRegistry::new(
            BTreeMap::new(),
            None,
            env_of(&[
                ("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                ("OPENAI_API_KEY", "k"),
            ]),
        )
        .unwrap();
        assert_eq!(registry.default_provider(), Some("openai"));
        let openai = registry.get("openai").unwrap();
        assert_eq!(openai.base_url, "http://127.0.0.1:8000/v1");
        assert_eq!(openai.api_key.expose(), "k");
    }

    #[test]
    fn no_configuration_means_no_provider() {
        let registry = ProviderRegistry::new(BTreeMap::new(), None, env_of(&[])).unwrap();
        assert_eq!(registry.names().count(), 0);
        assert_eq!(registry.default_provider(), None);
    }

    #[test]
    fn keys_come_from_the_named_variable_and_bad_settings_are_refused() {
        let mut providers = BTreeMap::new();
        let local = ProviderSettings {
            kind: ProviderKind::Openai,
            base_url: "http://localhost:11434/v1".into(),
            api_key: Secret::default(),
            api_key_env: Some("LOCAL_KEY".into()),
            api_key_header: None,
            http2_prior_knowledge: false,
            http_client: HttpClient::Lean,
        };
        providers.insert("local".to_owned(), local.clone());
        let registry =
            ProviderRegistry::new(providers.clone(), None, env_of(&[("LOCAL_KEY", "s3")])).unwrap();
        assert_eq!(registry.get("local").unwrap().api_key.expose(), "s3");

        let err = ProviderRegistry::new(providers.clone(), Some("other".into()), env_of(&[]));
        assert_eq!(
            err.unwrap_err(),
            ProviderError::UnknownDefault("other".into())
        );

        providers.insert(
            "ftp".into(),
            ProviderSettings {
                base_url: "ftp://x".into(),
                ..local.clone()
            },
        );
        assert!(matches!(
            ProviderRegistry::new(providers.clone(), None, env_of(&[])),
            Err(ProviderError::BadUrl { .. })
        ));
        for (url, says) in [
            ("http://exa mple.com/v1", "holds a space"),
            ("http://example.com/v1 ", "holds a space"),
            ("http://example.com/v1#frag", "has a fragment"),
        ] {
            providers.insert(
                "ftp".into(),
                ProviderSettings {
                    base_url: url.into(),
                    ..local.clone()
                },
            );
            let error = ProviderRegistry::new(providers.clone(), None, env_of(&[])).unwrap_err();
            assert!(error.to_string().contains(says), "{url}: {error}");
        }
        providers.remove("ftp");
        providers.insert(
            "azure".into(),
            ProviderSettings {
                api_key_header: Some("api key".into()),
                ..local.clone()
            },
        );
        assert_eq!(
            ProviderRegistry::new(providers.clone(), None, env_of(&[]))
                .unwrap_err()
                .to_string(),
            "provider \"azure\": api_key_header \"api key\" is not a header the key can go in"
        );
        providers.insert(
            "azure".into(),
            ProviderSettings {
                api_key_header: Some("api-key".into()),
                ..local
            },
        );
        assert!(ProviderRegistry::new(providers, None, env_of(&[])).is_ok());
    }

    /// A refused base URL is named with its credentials masked: the error is printed at
    /// start-up and logged, and a key in the query (`?api-key=`, Azure API Management's
    /// `?subscription-key=`) or before the host must not be in it.
    #[test]
    fn refused_base_urls_are_named_without_their_credentials() {
        let provider = |base_url: &str| {
            let settings = ProviderSettings {
                kind: ProviderKind::Openai,
                base_url: base_url.into(),
                api_key: Secret::default(),
                api_key_env: None,
                api_key_header: None,
                http2_prior_knowledge: false,
                http_client: HttpClient::Lean,
            };
            BTreeMap::from([("azure".to_owned(), settings)])
        };
        for (base_url, shown) in [
            (
                "ftp://h/v1?subscription-key=s3cr3t",
                "ftp://h/v1?subscription-key=***",
            ),
            (
                "apim.example.com/openai?api-key=s3cr3t&api-version=1",
                "apim.example.com/openai?api-key=***&api-version=***",
            ),
            ("http://h/v1 ?key=s3cr3t", "http://h/v1 ?key=***"),
            (
                "http://user:s3cr3t@h/v1#x?key=s3cr3t",
                "http://***@h/v1#x?key=***",
            ),
        ] {
            let error = ProviderRegistry::new(provider(base_url), None, env_of(&[]))
                .unwrap_err()
                .to_string();
            assert!(!error.contains("s3cr3t"), "{error}");
            assert!(error.contains(shown), "{error}");
        }
    }

    #[test]
    fn calls_go_under_the_base_url_before_its_query() {
        assert_eq!(
            endpoint("http://h/v1/", "chat/completions"),
            "http://h/v1/chat/completions"
        );
        assert_eq!(
            endpoint(
                "https://h/openai/deployments/d?api-version=2024-10-21",
                "chat/completions"
            ),
            "https://h/openai/deployments/d/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(endpoint("http://h/v1?", "rerank"), "http://h/v1/rerank");
    }
}
