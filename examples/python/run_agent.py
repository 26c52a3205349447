#!/usr/bin/env python3
"""Runs a tool-using agent turn on agent-server from Python, over plain gRPC.

Generates the Python stubs from the repository's proto/ on the fly (grpcio-tools), creates
an engine, streams one Execute and prints what happens as it happens. When the stream ends
with UNAVAILABLE (the replica serving it shut down and handed the run over, or the
connection broke), it resumes by itself with Subscribe(run_id, after_sequence).

The agent has the tool executor's calculator and a client tool, lookup_order, that this
script runs itself: when the run asks for it (EVENT_TYPE_ACTION_REQUIRED, action
`client_execute`), the script looks the order up in its own table (ORDERS) and sends the
output with SubmitToolOutputs. `--approve-tool NAME` makes the calls of the executor tool
NAME (added to the agent when it is not the calculator) wait for approval (action
`approve`): the script asks on the terminal (y/n, then a reason for a denial, which the
model reads) and answers with ApproveToolCalls, or answers by itself with
`--auto-approve yes|no` (`--deny-reason` says why). The run goes on in the same stream.

    pip install grpcio grpcio-tools
    python3 examples/python/run_agent.py --target localhost:50051 --query "What is 6 * 7?"
    python3 examples/python/run_agent.py --approve-tool calculator --query "What is 6 * 7?"
    python3 examples/python/run_agent.py --model gpt-4o-mini --approve-tool calculator \
        --auto-approve no --deny-reason "not today" --query "Where is order A-17? And 6 * 7?"

Exits 0 when the run ends with a final answer, 1 otherwise.
"""

import argparse
import importlib
import pathlib
import sys
import tempfile
import time
import uuid

from google.protobuf import json_format, struct_pb2


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


# The client tool: the model calls it like any tool; this script runs it and sends the output.
ORDERS = {"A-17": "shipped on 2026-11-20, arriving Friday", "B-2": "in transit",
          "C-5": "waiting for payment"}


def lookup_order(order_id):
    """Looks up the status of an order of the shop by its id (e.g. A-17)."""
    if order_id not in ORDERS:
        raise LookupError(f"no order {order_id}")
    return f"order {order_id}: {ORDERS[order_id]}"


# name: (function, JSON Schema of its arguments); the description is the docstring.
CLIENT_TOOLS = {
    "lookup_order": (lookup_order, {
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "The order's id."}},
        "required": ["order_id"],
        "additionalProperties": False,
    }),
}


def client_tool_configs(config_pb2):
    """CLIENT_TOOLS as AgentConfig.client_tools."""
    tools = []
    for name, (function, schema) in CLIENT_TOOLS.items():
        input_schema = struct_pb2.Struct()
        input_schema.update(schema)
        tools.append(config_pb2.ClientTool(name=name, description=function.__doc__,
                                           input_schema=input_schema))
    return tools


def run_client_tool(name, arguments):
    """Runs a client tool: (output, is_error)."""
    try:
        return str(CLIENT_TOOLS[name][0](**arguments)), False
    except Exception as error:  # the model reads the error and may try again
        return f"{name} failed: {error}", True


def ask_terminal(name, arguments):
    """Asks on the terminal whether the call may run: (approved, reason)."""
    try:
        approved = input(f"approve {name}({arguments})? [y/N] ").strip().lower() in ("y", "yes")
        reason = "" if approved else input("reason (optional, the model reads it): ").strip()
    except EOFError:
        approved, reason = False, "no answer on the terminal"
    return approved, reason


def answer_action(engine, agent_engine_pb2, run_id, calls, decide):
    """Answers an EVENT_TYPE_ACTION_REQUIRED: runs the client tool calls and sends their
    outputs, decides the calls waiting for approval (`decide(name, arguments)` gives
    (approved, reason)) and sends the decisions. The run goes on once all are answered."""
    outputs, decisions = [], []
    for call in calls:
        call_id, name, arguments = call["id"], call["name"], call.get("arguments", {})
        if call["action"] == "client_execute":
            output, is_error = run_client_tool(name, arguments)
            print(f"[client tool] {name}({arguments}) -> {output}")
            outputs.append(agent_engine_pb2.ToolOutput(
                tool_call_id=call_id, output=output, is_error=is_error))
        elif call["action"] == "approve":
            approved, reason = decide(name, arguments)
            said = "approved" if approved else "denied"
            print(f"[{said}] {name}({arguments})" + (f": {reason}" if reason else ""))
            decisions.append(agent_engine_pb2.ToolCallDecision(
                tool_call_id=call_id, approved=approved, reason=reason))
        else:
            print(f"[unknown action {call['action']!r} for {name}: left unanswered]")
    if outputs:
        engine.SubmitToolOutputs(agent_engine_pb2.SubmitToolOutputsRequest(
            run_id=run_id, outputs=outputs), timeout=10)
    if decisions:
        engine.ApproveToolCalls(agent_engine_pb2.ApproveToolCallsRequest(
            run_id=run_id, decisions=decisions), timeout=10)


RESUME_FIRST_WAIT = 0.2  # seconds before the first retry; doubles up to RESUME_MAX_WAIT
RESUME_MAX_WAIT = 2.0
RESUME_BUDGET = 30.0  # give up after this long without a new event


class StreamLost(Exception):
    """The run's stream stayed UNAVAILABLE for RESUME_BUDGET seconds."""


def stream_run(engine, agent_engine_pb2, request, timeout=None):
    """Yields the events of the run `request` starts, each once, in order, up to `done`.

    On UNAVAILABLE it resumes with Subscribe(run_id, after_sequence) on the same target,
    or, before the first event, repeats the Execute: its message_id makes it the same run.
    The streams have no deadline unless `timeout` (seconds) says: a run may wait for an
    answer typed on the terminal, and the server ends every run within its own timeouts.
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
    parser.add_argument("--approve-tool", action="append", default=[], metavar="NAME",
                        help="calls of this executor tool wait for approval (repeatable)")
    parser.add_argument("--auto-approve", choices=["yes", "no"],
                        help="approve or deny every call by itself instead of asking")
    parser.add_argument("--deny-reason", default="denied with --auto-approve no",
                        help="the reason the model reads for a call denied by --auto-approve no")
    parser.add_argument("--proto-dir", default=str(here.parent.parent / "proto"))
    args = parser.parse_args()
    if args.auto_approve:
        def decide(_name, _arguments):
            approved = args.auto_approve == "yes"
            return approved, "" if approved else args.deny_reason
    else:
        decide = ask_terminal

    import grpc

    pb = load_stubs(pathlib.Path(args.proto_dir))
    config_pb2, events_pb2 = pb["config_pb2"], pb["events_pb2"]
    with grpc.insecure_channel(args.target) as channel:
        service = pb["agent_service_pb2_grpc"].AgentServiceStub(channel)
        engine = pb["agent_engine_pb2_grpc"].AgentEngineStub(channel)

        config = config_pb2.AgentConfig(
            name="python-example",
            system_prompt="Use the calculator for arithmetic and lookup_order for orders.",
            model=config_pb2.ModelConfig(name=args.model),
            tools=[config_pb2.ToolRef(name=name, require_approval=name in args.approve_tool)
                   for name in dict.fromkeys(["calculator", *args.approve_tool])],
            client_tools=client_tool_configs(config_pb2),
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
                elif kind == "EVENT_TYPE_ACTION_REQUIRED":
                    # The run waits (the stream stays open) until every call is answered.
                    calls = data.get("tool_calls", [])
                    print(f"[action required] {len(calls)} tool call(s) wait for an answer")
                    answer_action(engine, pb["agent_engine_pb2"], event.run_id, calls, decide)
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
        except grpc.RpcError as error:
            print(f"error: gRPC {error.code().name}: {error.details()}", file=sys.stderr)
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
