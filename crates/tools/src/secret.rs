//! Secret values for tool sources (API keys, bearer tokens): the config says where to read
//! them, from the environment or a file, never the value itself, so that config files
//! and `--print-config` carry no secrets.

use std::path::{Path, PathBuf};

use agentrt_core::Secret;
use serde::{Deserialize, Serialize};

/// Where a secret comes from, e.g. `{ env = "DOCS_TOKEN", prefix = "Bearer " }` or
/// `{ file = "/var/run/secrets/docs/token" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SecretRef {
    /// Read from this environment variable of the tool executor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
    /// Read from this file (trailing newlines removed); relative to the config file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Put before the value, e.g. `"Bearer "`. Not secret.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
}

/// The fields of a [`SecretRef`], as a config writes them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretFields {
    #[serde(default)]
    env: Option<String>,
    #[serde(default)]
    file: Option<PathBuf>,
    #[serde(default)]
    prefix: String,
}

/// What a config may give where a secret goes: where to read it (a table), never its
/// value, which is refused saying so.
impl<'de> Deserialize<'de> for SecretRef {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Place;
        impl<'de> serde::de::Visitor<'de> for Place {
            type Value = SecretRef;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "where to read a secret: `{ env = \"VAR\" }` or `{ file = \"path\" }` \
                     (with an optional `prefix`)",
                )
            }

            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<SecretRef, E> {
                Err(E::custom(
                    "a secret is never written in the config: say where to read it, \
                     `{ env = \"VAR\" }` or `{ file = \"path\" }` (with an optional `prefix`)",
                ))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<SecretRef, A::Error> {
                let fields =
                    SecretFields::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(SecretRef {
                    env: fields.env,
                    file: fields.file,
                    prefix: fields.prefix,
                })
            }
        }
        deserializer.deserialize_any(Place)
    }
}

impl SecretRef {
    /// Makes a relative file path relative to `dir` (the config file's directory).
    pub fn resolve_paths(&mut self, dir: &Path) {
        if let Some(file) = &mut self.file
            && file.is_relative()
        {
            *file = dir.join(&*file);
        }
    }

    /// Checks that exactly one place is named.
    pub fn check(&self) -> Result<(), String> {
        match (&self.env, &self.file) {
            (Some(env), None) if !env.is_empty() => Ok(()),
            (None, Some(file)) if !file.as_os_str().is_empty() => Ok(()),
            _ => Err("name exactly one of `env` (a variable) or `file` (a path)".into()),
        }
    }

    /// Reads the value, with its prefix.
    pub fn read(&self) -> Result<Secret, String> {
        self.check()?;
        let value = if let Some(name) = &self.env {
            std::env::var(name)
                .map_err(|_| format!("environment variable {name} is not set (or not UTF-8)"))?
        } else if let Some(file) = &self.file {
            let text = std::fs::read_to_string(file)
                .map_err(|e| format!("cannot read secret file {}: {e}", file.display()))?;
            text.trim_end_matches(['\r', '\n']).to_owned()
        } else {
            String::new()
        };
        if value.is_empty() {
            return Err("the secret is empty".into());
        }
        Ok(Secret::new(format!("{}{value}", self.prefix)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_from_files_with_their_prefix() {
        let dir = std::env::temp_dir().join(format!("agentrt-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), "s3cret\n").unwrap();
        let mut secret: SecretRef =
            serde_json::from_value(serde_json::json!({"file": "token", "prefix": "Bearer "}))
                .unwrap();
        secret.resolve_paths(&dir);
        assert_eq!(secret.read().unwrap().expose(), "Bearer s3cret");
        let missing = SecretRef {
            env: Some("AGENTRT_TEST_SURELY_UNSET".into()),
            file: None,
            prefix: String::new(),
        };
        assert!(
            missing
                .read()
                .unwrap_err()
                .contains("AGENTRT_TEST_SURELY_UNSET")
        );
        let both = SecretRef {
            env: Some("A".into()),
            file: Some("b".into()),
            prefix: String::new(),
        };
        assert!(both.check().is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_secret_written_in_the_config_or_a_misspelt_place_is_refused_saying_so() {
        let inline = serde_json::from_value::<SecretRef>(serde_json::json!("literal-secret"))
            .unwrap_err()
            .to_string();
        assert!(inline.contains("never written in the config"), "{inline}");
        let typo = serde_json::from_value::<SecretRef>(serde_json::json!({"evn": "X"}))
            .unwrap_err()
            .to_string();
        assert!(typo.contains("unknown field `evn`"), "{typo}");
    }
}
