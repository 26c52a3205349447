#!/usr/bin/env python3
"""Runs a tool-using agent turn on agent-server from Python, over plain gRPC.

Generates the Python stubs from the repository's proto/ on the fly (grpcio-tools), creates
an engine, streams one Execute and prints what happens as it happens.

    pip install grpcio grpcio-tools
    python3 examples/python/run_agent.py --target localhost:50051 --query "What is 6 * 7?"

Exits 0 when the run ends with a final answer, 1 otherwise.
"""

import argparse
import importlib
import pathlib
import sys
import tempfile

from google.protobuf import json_format


def load_stubs(proto_dir: pathlib.Path):
    """Compiles agent/v1/*.proto into a temporary package and imports it."""
    from grpc_tools import protoc
    import grpc_tools

    out = pathlib.Path(tempfile.mkdtemp(prefix="agentrt-py-"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p) for p in (proto_dir / "agent" / "v1").glob("*.proto"))
    status = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ])
    if status != 0:
        sys.exit(f"protoc failed with status {status}")
    sys.path.insert(0, str(out))
    names = ["agent_service_pb2", "agent_service_pb2_grpc", "agent_engine_pb2",
             "agent_engine_pb2_grpc", "config_pb2", "events_pb2"]
    return {n: importlib.import_module(f"agent.v1.{n}") for n in names}


def main() -> int:
    here = pathlib.Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="agent-server HOST:PORT")
    parser.add_argument("--query", default="What is 6 * 7?")
    parser.add_argument("--model", default="demo", help="the provider's model id")
    parser.add_argument("--proto-dir", default=str(here.parent.parent / "proto"))
    args = parser.parse_args()

    import grpc

    pb = load_stubs(pathlib.Path(args.proto_dir))
    config_pb2, events_pb2 = pb["config_pb2"], pb["events_pb2"]
    with grpc.insecure_channel(args.target) as channel:
        service = pb["agent_service_pb2_grpc"].AgentServiceStub(channel)
        engine = pb["agent_engine_pb2_grpc"].AgentEngineStub(channel)

        config = config_pb2.AgentConfig(
            name="python-example",
            system_prompt="Use the calculator for arithmetic.",
            model=config_pb2.ModelConfig(name=args.model),
            tools=[config_pb2.ToolRef(name="calculator")],
        )
        created = service.CreateAgentEngine(
            pb["agent_service_pb2"].CreateAgentEngineRequest(config=config), timeout=10)
        print(f"engine {created.engine_id} in session {created.session_id}")

        request = pb["agent_engine_pb2"].ExecuteRequest(engine_id=created.engine_id, query=args.query)
        answer, last = [], None
        for event in engine.Execute(request, timeout=60):
            kind = events_pb2.EventType.Name(event.type)
            data = json_format.MessageToDict(event.data) if event.HasField("data") else {}
            if event.done:
                last = (kind, data)
            elif kind == "EVENT_TYPE_THOUGHT":
                print(f"[thought] {event.content}")
            elif kind == "EVENT_TYPE_TOOL_CALL":
                print(f"[tool call] {data['name']}({data.get('arguments')})")
            elif kind == "EVENT_TYPE_TOOL_RESULT":
                print(f"[tool result] {data['name']} -> {data['output']}")
            elif kind == "EVENT_TYPE_FINAL_ANSWER":
                answer.append(event.content)
        print(f"answer: {''.join(answer)}")
        kind, data = last
        print(f"done: {kind} stop_reason={data.get('stop_reason')}")
        return 0 if kind == "EVENT_TYPE_FINAL_ANSWER" else 1


if __name__ == "__main__":
    sys.exit(main())
