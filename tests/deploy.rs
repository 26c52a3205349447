//! The settings files the Kubernetes ConfigMap ships are accepted by the binaries.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use agentrt_test_support::binary;

/// The block under `  <key>: |` in a ConfigMap, unindented.
fn config_file(configmap: &str, key: &str) -> String {
    let start = format!("  {key}: |");
    let mut lines = configmap
        .lines()
        .skip_while(|l| l.trim_end() != start)
        .skip(1);
    let mut text = String::new();
    for line in lines.by_ref() {
        if !line.is_empty() && !line.starts_with("    ") {
            break;
        }
        text.push_str(line.strip_prefix("    ").unwrap_or(line));
        text.push('\n');
    }
    assert!(!text.trim().is_empty(), "no {key} in the ConfigMap");
    text
}

#[test]
fn the_configmap_settings_load() {
    let configmap = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s/base/configmap.yaml"),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("agentrt-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (binary_name, key, expect) in [
        (
            "agent-server",
            "agent-server.toml",
            "http://tool-executor:50052",
        ),
        ("tool-executor", "tool-executor.toml", "0.0.0.0:50052"),
    ] {
        let file = dir.join(key);
        std::fs::write(&file, config_file(&configmap, key)).unwrap();
        let output = Command::new(binary(binary_name))
            .arg("--config")
            .arg(&file)
            .arg("--print-config")
            .env("OPENAI_API_KEY", "from-the-secret")
            .output()
            .unwrap();
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{binary_name} refused {key}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(printed.contains(expect), "{printed}");
        assert!(
            printed.contains(r#"metrics_listen = "0.0.0.0:9090""#),
            "{printed}"
        );
        assert!(
            printed.contains(r#"health_listen = "0.0.0.0:8081""#),
            "{printed}"
        );
        assert!(
            !printed.contains("from-the-secret"),
            "a key was printed: {printed}"
        );
    }
}

#[test]
fn every_variable_the_manifests_set_is_one_the_binaries_read() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s");
    let mut checked = 0;
    for file in [
        "base/agent-server.yaml",
        "base/tool-executor.yaml",
        "overlays/production/tls.yaml",
        "overlays/production/state.yaml",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for name in text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- name: "))
            .filter(|n| n.starts_with("AGENT_SERVER_") || n.starts_with("TOOL_EXECUTOR_"))
        {
            let binary_name = if name.starts_with("AGENT_SERVER_") {
                "agent-server"
            } else {
                "tool-executor"
            };
            let help = Command::new(binary(binary_name))
                .arg("--help")
                .output()
                .unwrap();
            let help = String::from_utf8_lossy(&help.stdout);
            assert!(
                // A setting that may hold a secret hides its value: `[env: NAME]`.
                help.contains(&format!("[env: {name}="))
                    || help.contains(&format!("[env: {name}]")),
                "{file} sets {name}, which {binary_name} does not read"
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} variables found");
}

/// The documents of a manifest file.
fn documents(file: &str) -> Vec<serde_json::Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    text.split("\n---\n")
        .map(|document| {
            let yaml: yaml_serde::Value = yaml_serde::from_str(document).unwrap();
            serde_json::to_value(&yaml).unwrap()
        })
        .collect()
}

/// The ingress rules of the NetworkPolicy `name` of the base, by port: the `from` list
/// of each (`None`: from anywhere).
fn ingress(name: &str) -> Vec<(u64, Option<serde_json::Value>)> {
    let policies = documents("deploy/k8s/base/networkpolicy.yaml");
    let policy = policies
        .iter()
        .find(|p| p["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no NetworkPolicy {name}"));
    let mut rules = Vec::new();
    for rule in policy["spec"]["ingress"].as_array().unwrap() {
        for port in rule["ports"].as_array().unwrap() {
            rules.push((port["port"].as_u64().unwrap(), rule.get("from").cloned()));
        }
    }
    rules
}

#[test]
fn probes_use_the_health_port_served_apart_from_the_grpc_port() {
    // Probed on the gRPC port, a server whose connections are at their most would fail
    // its liveness probe and be restarted (losing every run kept in memory).
    for file in [
        "deploy/k8s/base/agent-server.yaml",
        "deploy/k8s/base/tool-executor.yaml",
    ] {
        let deployment = documents(file)
            .into_iter()
            .find(|d| d["kind"] == "Deployment")
            .unwrap();
        let container = &deployment["spec"]["template"]["spec"]["containers"][0];
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            assert_eq!(container[probe]["grpc"]["port"], 8081, "{file}: {probe}");
        }
        // Set by the Deployment itself, not only by the settings file an overlay may
        // replace whole.
        assert!(
            container["env"].as_array().unwrap().iter().any(|e| {
                e["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("_HEALTH_LISTEN"))
                    && e["value"] == "0.0.0.0:8081"
            }),
            "{file}"
        );
        assert!(
            container["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["containerPort"] == 8081),
            "{file}"
        );
    }
}

#[test]
fn network_policies_open_each_port_only_to_its_callers() {
    let monitoring = serde_json::json!([{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]);
    // agent-server: gRPC from its namespace and the client namespaces an overlay names;
    // metrics from the monitoring namespace only; nothing else.
    let agent = ingress("agent-server-ingress");
    let grpc: Vec<_> = agent.iter().filter(|(port, _)| *port == 50051).collect();
    assert_eq!(grpc.len(), 1, "{agent:?}");
    let from = grpc[0].1.as_ref().expect("gRPC is not open to everyone");
    assert_eq!(from[0], serde_json::json!({"podSelector": {}}));
    assert_eq!(
        from[1]["namespaceSelector"]["matchExpressions"][0]["key"],
        "kubernetes.io/metadata.name"
    );
    for (port, from) in &agent {
        match port {
            50051 => {}
            9090 => assert_eq!(from.as_ref(), Some(&monitoring), "agent-server metrics"),
            other => panic!("agent-server port {other} is open in the base"),
        }
    }
    // tool-executor: gRPC from agent-server pods only, metrics from monitoring only.
    for (port, from) in ingress("tool-executor-ingress") {
        match port {
            50052 => assert_eq!(
                from,
                Some(serde_json::json!([{"podSelector": {"matchLabels": {
                    "app.kubernetes.io/name": "agent-server"}}}]))
            ),
            9090 => assert_eq!(from.as_ref(), Some(&monitoring), "tool-executor metrics"),
            other => panic!("tool-executor port {other} is open in the base"),
        }
    }

    // Production names the client namespaces and opens nothing else (the kubelet's probes
    // of the plaintext health port need no rule), and lets only agent-server's
    // certificate reach the tool executor.
    let kustomization = documents("deploy/k8s/overlays/production/kustomization.yaml");
    let patches = serde_json::to_string(&kustomization[0]["patches"]).unwrap();
    assert!(
        patches.contains("agent-server-ingress") && patches.contains("matchExpressions/0/values"),
        "{patches}"
    );
    let tls = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/k8s/overlays/production/tls.yaml"),
    )
    .unwrap();
    assert!(
        tls.contains("- name: TOOL_EXECUTOR_TLS_ALLOWED_CLIENT_NAMES\n              value: agent-server.agentrt.svc"),
        "the tool executor's allow-list is not set in production"
    );
}

#[test]
fn in_production_the_autoscalers_own_the_replica_counts() {
    // A replica count in a Deployment an HPA scales is applied again by every `kubectl
    // apply`, scaling a scaled-out Deployment back down until the HPA catches up.
    let hpas = documents("deploy/k8s/overlays/production/hpa.yaml");
    let scaled: Vec<&str> = hpas
        .iter()
        .map(|hpa| hpa["spec"]["scaleTargetRef"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(scaled.len(), 2, "{scaled:?}");
    let state = documents("deploy/k8s/overlays/production/state.yaml");
    let agent_server = state
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "agent-server")
        .unwrap();
    assert!(scaled.contains(&"agent-server"));
    assert!(
        agent_server["spec"]
            .as_object()
            .unwrap()
            .get("replicas")
            .is_some_and(serde_json::Value::is_null),
        "state.yaml must remove agent-server's replicas (replicas: null)"
    );
    let kustomization = documents("deploy/k8s/overlays/production/kustomization.yaml");
    let tool_executor = kustomization[0]["patches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["target"]["name"] == "tool-executor" && p["target"]["kind"] == "Deployment")
        .unwrap();
    assert!(scaled.contains(&"tool-executor"));
    let ops: Vec<serde_json::Value> =
        yaml_serde::from_str(tool_executor["patch"].as_str().unwrap()).unwrap();
    assert!(
        ops.iter()
            .any(|op| op["op"] == "remove" && op["path"] == "/spec/replicas"),
        "the production overlay must remove tool-executor's replicas: {ops:?}"
    );
}
