//! Conversions between the wire `AgentConfig` and the domain one, at the service edge.

use std::time::{Duration, SystemTime};

use agentrt::v1;
use agentrt_core::{
    AgentConfig, ContextBudget, ModelSelection, RerankSelection, Strategy, Timeouts,
};

/// Converts a config that passed validation (defaults applied, every field in range).
/// Fields validation guarantees are read with their defaults as a fallback, never a panic.
pub fn config_from_wire(config: &v1::AgentConfig) -> AgentConfig {
    let model = config.model.clone().unwrap_or_default();
    let timeouts = config.timeouts.unwrap_or_default();
    let defaults = Timeouts::default();
    AgentConfig {
        name: config.name.clone(),
        system_prompt: config.system_prompt.clone(),
        model: ModelSelection {
            provider: model.provider,
            name: model.name,
            temperature: model.temperature,
            max_tokens: u32::try_from(model.max_tokens).ok().filter(|n| *n > 0),
        },
        rerank_model: config.rerank_model.clone().map(|r| RerankSelection {
            provider: r.provider,
            name: r.name,
            top_n: u32::try_from(r.top_n).unwrap_or(1),
            min_score: r.min_score,
        }),
        strategy: match v1::Strategy::try_from(config.strategy) {
            Ok(v1::Strategy::React) => Strategy::React,
            _ => Strategy::FunctionCall,
        },
        max_iterations: u32::try_from(config.max_iterations).unwrap_or(1),
        tools: config.tools.iter().map(|t| t.name.clone()).collect(),
        parallel_tool_calls: config.parallel_tool_calls,
        max_parallel_tool_calls: u32::try_from(config.max_parallel_tool_calls).unwrap_or(1),
        context: ContextBudget {
            max_prompt_tokens: config
                .context
                .map_or(0, |c| u32::try_from(c.max_prompt_tokens).unwrap_or(0)),
        },
        timeouts: Timeouts {
            run: duration_from_wire(timeouts.run).unwrap_or(defaults.run),
            model_call: duration_from_wire(timeouts.model_call).unwrap_or(defaults.model_call),
            tool_call: duration_from_wire(timeouts.tool_call).unwrap_or(defaults.tool_call),
        },
    }
}

/// The wire form of a domain config, as `GetAgentEngine` and `CreateAgentEngine` return it.
pub fn config_to_wire(config: &AgentConfig) -> v1::AgentConfig {
    let clamp = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
    v1::AgentConfig {
        name: config.name.clone(),
        system_prompt: config.system_prompt.clone(),
        model: Some(v1::ModelConfig {
            provider: config.model.provider.clone(),
            name: config.model.name.clone(),
            temperature: config.model.temperature,
            max_tokens: config.model.max_tokens.map_or(0, clamp),
        }),
        rerank_model: config.rerank_model.as_ref().map(|r| v1::RerankModelConfig {
            provider: r.provider.clone(),
            name: r.name.clone(),
            top_n: clamp(r.top_n),
            min_score: r.min_score,
        }),
        strategy: match config.strategy {
            Strategy::FunctionCall => v1::Strategy::FunctionCall,
            Strategy::React => v1::Strategy::React,
        } as i32,
        max_iterations: clamp(config.max_iterations),
        tools: config
            .tools
            .iter()
            .map(|name| v1::ToolRef { name: name.clone() })
            .collect(),
        parallel_tool_calls: config.parallel_tool_calls,
        max_parallel_tool_calls: clamp(config.max_parallel_tool_calls),
        context: Some(v1::ContextConfig {
            max_prompt_tokens: clamp(config.context.max_prompt_tokens),
        }),
        timeouts: Some(v1::Timeouts {
            run: duration_to_wire(config.timeouts.run),
            model_call: duration_to_wire(config.timeouts.model_call),
            tool_call: duration_to_wire(config.timeouts.tool_call),
        }),
    }
}

fn duration_from_wire(d: Option<prost_types::Duration>) -> Option<Duration> {
    d.and_then(|d| Duration::try_from(d).ok())
}

fn duration_to_wire(d: Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

/// A timestamp for the wire.
pub fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_effective_config_survives_the_round_trip() {
        let wire = v1::AgentConfig {
            name: "a".into(),
            system_prompt: "be brief".into(),
            model: Some(v1::ModelConfig {
                provider: "openai".into(),
                name: "m".into(),
                temperature: Some(0.5),
                max_tokens: 256,
            }),
            rerank_model: Some(v1::RerankModelConfig {
                provider: "openai".into(),
                name: "r".into(),
                top_n: 3,
                min_score: 0.25,
            }),
            strategy: v1::Strategy::React as i32,
            max_iterations: 7,
            tools: vec![v1::ToolRef {
                name: "calculator".into(),
            }],
            parallel_tool_calls: true,
            max_parallel_tool_calls: 2,
            context: Some(v1::ContextConfig {
                max_prompt_tokens: 4096,
            }),
            timeouts: Some(v1::Timeouts {
                run: Some(prost_types::Duration {
                    seconds: 60,
                    nanos: 0,
                }),
                model_call: Some(prost_types::Duration {
                    seconds: 30,
                    nanos: 500_000_000,
                }),
                tool_call: Some(prost_types::Duration {
                    seconds: 10,
                    nanos: 0,
                }),
            }),
        };
        assert_eq!(config_to_wire(&config_from_wire(&wire)), wire);
    }
}
