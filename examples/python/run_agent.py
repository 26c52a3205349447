#!/usr/bin/env python3
"""Runs a tool-using agent turn on agent-server from Python, over plain gRPC.

Generates the Python stubs from the repository's proto/ on the fly (grpcio-tools), creates
an engine, streams one Execute and prints what happens as it happens. When the stream ends
with UNAVAILABLE (the replica serving it shut down and handed the run over, or the
connection broke), it resumes by itself with Subscribe(run_id, after_sequence).

    pip install grpcio grpcio-tools
    python3 examples/python/run_agent.py --target localhost:50051 --query "What is 6 * 7?"

Exits 0 when the run ends with a final answer, 1 otherwise.
"""

import argparse
import importlib
import pathlib
import sys
import tempfile
import time
import uuid

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


RESUME_FIRST_WAIT = 0.2  # seconds before the first retry; doubles up to RESUME_MAX_WAIT
RESUME_MAX_WAIT = 2.0
RESUME_BUDGET = 30.0  # give up after this long without a new event


class StreamLost(Exception):
    """The run's stream stayed UNAVAILABLE for RESUME_BUDGET seconds."""


def stream_run(engine, agent_engine_pb2, request, timeout=60):
    """Yields the events of the run `request` starts, each once, in order, up to `done`.

    On UNAVAILABLE it resumes with Subscribe(run_id, after_sequence) on the same target,
    or, before the first event, repeats the Execute: its message_id makes it the same run.
    """
    import grpc

    run_id, last, wait, give_up_at = None, 0, RESUME_FIRST_WAIT, None
    while True:
        if run_id is None:
            call = engine.Execute(request, timeout=timeout)
        else:
            call = engine.Subscribe(agent_engine_pb2.SubscribeRequest(
                run_id=run_id, after_sequence=last), timeout=timeout)
        try:
            for event in call:
                if event.sequence <= last:
                    continue  # seen before the stream was lost
                run_id, last = event.run_id, event.sequence
                wait, give_up_at = RESUME_FIRST_WAIT, None
                yield event
                if event.done:
                    return
            return  # ended without a `done` event; the caller tells
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            give_up_at = give_up_at or time.monotonic() + RESUME_BUDGET
            if time.monotonic() + wait > give_up_at:
                raise StreamLost(f"run {run_id or '(not started)'}: still UNAVAILABLE after "
                                 f"{RESUME_BUDGET:.0f}s of retries: {error.details()}") from error
            where = f"run {run_id} after event {last}" if run_id else "the Execute"
            print(f"[stream lost: {error.details()}; resuming {where} in {wait:.1f}s]")
            time.sleep(wait)
            wait = min(wait * 2, RESUME_MAX_WAIT)


def event_type(events_pb2, value) -> str:
    """The name of an EventType, also of one newer than the protos the stubs came from."""
    try:
        return events_pb2.EventType.Name(value)
    except ValueError:
        return f"EVENT_TYPE_{value}"


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

        # The message id is the turn's idempotency key: an Execute repeated with it (after
        # UNAVAILABLE before the first event) re-attaches to the same run.
        request = pb["agent_engine_pb2"].ExecuteRequest(
            engine_id=created.engine_id, query=args.query, message_id=str(uuid.uuid4()))
        answer, last = [], None  # answer: (iteration, delta)
        try:
            for event in stream_run(engine, pb["agent_engine_pb2"], request):
                kind = event_type(events_pb2, event.type)
                data = json_format.MessageToDict(event.data) if event.HasField("data") else {}
                if event.done:
                    last = (kind, data)
                elif kind == "EVENT_TYPE_THOUGHT":
                    print(f"[thought] {event.content}")
                elif kind == "EVENT_TYPE_TOOL_CALL":
                    print(f"[tool call] {data['name']}({data.get('arguments')})")
                elif kind == "EVENT_TYPE_TOOL_RESULT":
                    print(f"[tool result] {data['name']} -> {data['output']}")
                elif kind == "EVENT_TYPE_ROUND_RESTARTED":
                    # The round's deltas so far are void: the model round runs again.
                    round_ = int(data.get("iteration", event.iteration))
                    print(f"[round {round_} restarted on another replica ({data.get('reason')})]")
                    answer = [(i, text) for i, text in answer if i != round_]
                elif kind == "EVENT_TYPE_FINAL_ANSWER":
                    answer.append((event.iteration, event.content))
        except StreamLost as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"answer: {''.join(text for _, text in answer)}")
        if last is None:
            print("the stream ended without a done event")
            return 1
        kind, data = last
        print(f"done: {kind} stop_reason={data.get('stop_reason')}")
        return 0 if kind == "EVENT_TYPE_FINAL_ANSWER" else 1


if __name__ == "__main__":
    sys.exit(main())
