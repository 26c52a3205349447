#!/usr/bin/env python3
"""Runs a tool-using agent turn on agent-server from Python, over plain gRPC.

Generates the Python stubs from the repository's proto/ on the fly (grpcio-tools), creates
an engine, streams one Execute and prints what happens as it happens. The Execute is sent with
`detach` set, so that the run outlives a broken connection: when the stream ends with
UNAVAILABLE (the replica serving it shut down and handed the run over, or the connection
broke), or with OUT_OF_RANGE `EVENTS_LAGGED` (this client read too slowly and the run went
on without it), it resumes by itself with Subscribe(run_id, after_sequence). Since the run
does not end with the stream, the script cancels it (Cancel) when it quits before the
run's end: on Ctrl-C or an error.

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

Prints the answer (the final answer deltas of the run's last iteration) and how the run
ended. Exits 0 when the run ends with a complete answer (stop reason `final_answer` or
`max_iterations`); 1 when the answer is incomplete (`max_tokens`: the partial answer is
printed, and why it is cut), when the run failed (no answer; its error's code, message and
category are printed) or on a client error; 130 on Ctrl-C.
"""

import argparse
import atexit
import importlib
import pathlib
import shutil
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
    # Imported once at start; removed when the client exits.
    atexit.register(shutil.rmtree, out, ignore_errors=True)
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
        send_answers(engine, "SubmitToolOutputs", agent_engine_pb2.SubmitToolOutputsRequest(
            run_id=run_id, outputs=outputs))
    if decisions:
        send_answers(engine, "ApproveToolCalls", agent_engine_pb2.ApproveToolCallsRequest(
            run_id=run_id, decisions=decisions))


RESUME_FIRST_WAIT = 0.2  # seconds before the first retry; doubles up to RESUME_MAX_WAIT
RESUME_MAX_WAIT = 2.0
RESUME_BUDGET = 30.0  # give up after this long without a new event (or answer taken)
CANCEL_TIMEOUT = 3.0  # seconds a Cancel may take when the script quits early

# Client keepalive: a ping every 30 s on a connection with a call open (a run's stream may
# be quiet for long, e.g. while it waits for an answer typed on the terminal), and a
# connection that does not answer one within 10 s is broken: the stream ends UNAVAILABLE
# and is resumed. gRPC core stops pinging after two pings without data unless
# max_pings_without_data is 0 (no limit).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class StreamLost(Exception):
    """The run's stream (or an answer to it) stayed UNAVAILABLE for RESUME_BUDGET seconds."""


class Backoff:
    """The waits between retries: RESUME_FIRST_WAIT doubling up to RESUME_MAX_WAIT, until
    RESUME_BUDGET has passed since the first failure after the last progress (`reset`)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.wait, self.give_up_at = RESUME_FIRST_WAIT, None

    def next_wait(self):
        """Seconds to wait before the next attempt, or None when the budget is spent."""
        self.give_up_at = self.give_up_at or time.monotonic() + RESUME_BUDGET
        if time.monotonic() + self.wait > self.give_up_at:
            return None
        wait, self.wait = self.wait, min(self.wait * 2, RESUME_MAX_WAIT)
        return wait


def send_answers(engine, method, request):
    """Sends `request` with the AgentEngine `method` (SubmitToolOutputs or
    ApproveToolCalls), retrying UNAVAILABLE with the stream's backoff: the same answer sent
    again is accepted once.

    FAILED_PRECONDITION means the run does not wait for these answers (any more): it ended
    meanwhile (cancelled, timed out waiting, ...), or the calls were answered otherwise.
    That is not this client's end: the run's stream goes on and tells how the run ends.
    """
    import grpc

    backoff = Backoff()
    while True:
        try:
            getattr(engine, method)(request, timeout=10)
            return
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                print(f"[{method} not taken: {error.details()}; reading on to the run's end]")
                return
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            wait = backoff.next_wait()
            if wait is None:
                raise StreamLost(f"{method}: still UNAVAILABLE after {RESUME_BUDGET:.0f}s of "
                                 f"retries: {error.details()}") from error
            print(f"[{method} failed: {error.details()}; sending it again in {wait:.1f}s]")
            time.sleep(wait)


def proto_fields(data):
    """The length-delimited fields of a serialized protobuf message, as (number, bytes);
    the others are skipped. Enough to read a google.rpc.Status and its ErrorInfo without
    their generated classes (googleapis-common-protos is not among this script's packages).
    """
    fields, i = [], 0

    def varint():
        nonlocal i
        value, shift = 0, 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:  # varint
            varint()
        elif wire_type == 1:  # 64-bit
            i += 8
        elif wire_type == 5:  # 32-bit
            i += 4
        elif wire_type == 2:  # length-delimited: strings, bytes, messages
            size = varint()
            fields.append((number, data[i:i + size]))
            i += size
        else:
            raise ValueError(f"unexpected wire type {wire_type}")
    if i > len(data):
        raise ValueError("truncated message")
    return fields


def error_info(error):
    """The google.rpc.ErrorInfo of a gRPC error as (reason, metadata), read from its
    `grpc-status-details-bin` trailer (a google.rpc.Status: details = 3, each a
    google.protobuf.Any with type_url = 1, value = 2; ErrorInfo: reason = 1, metadata = 3,
    each entry key = 1, value = 2); ("", {}) when it has none."""
    try:
        trailers = dict(error.trailing_metadata() or ())
        for number, detail in proto_fields(trailers.get("grpc-status-details-bin", b"")):
            any_ = dict(proto_fields(detail)) if number == 3 else {}
            if any_.get(1, b"").decode().endswith("/google.rpc.ErrorInfo"):
                info = proto_fields(any_.get(2, b""))
                reason = dict(info).get(1, b"").decode()
                metadata = {}
                for n, entry in info:
                    if n == 3:
                        entry = dict(proto_fields(entry))
                        metadata[entry.get(1, b"").decode()] = entry.get(2, b"").decode()
                return reason, metadata
    except (ValueError, IndexError, UnicodeDecodeError):
        pass  # unreadable details: as if there were none
    return "", {}


def stream_run(engine, agent_engine_pb2, request, timeout=None, lost=None):
    """Yields the events of the run `request` starts, each once, in order, up to `done`.

    On UNAVAILABLE it resumes with Subscribe(run_id, after_sequence) on the same target,
    or, before the first event, repeats the Execute: its message_id makes it the same run
    (the request sets `detach`, so that the run is not cancelled when its stream breaks).
    OUT_OF_RANGE with reason EVENTS_LAGGED (this client fell further behind than the run's
    replay log; the run goes on) is resumed after the last event lost (its ErrorInfo's
    `resume_after`), with the run id the error names when no event came yet; the lost
    events' (first, last) sequence numbers are added to `lost`, when given.
    The streams have no deadline unless `timeout` (seconds) says: a run may wait for an
    answer typed on the terminal, and the server ends every run within its own timeouts.
    """
    import grpc

    run_id, last, backoff = None, 0, Backoff()
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
                backoff.reset()
                yield event
                if event.done:
                    return
            return  # ended without a `done` event; the caller tells
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.OUT_OF_RANGE:
                reason, metadata = error_info(error)
                if reason != "EVENTS_LAGGED" or not (run_id or metadata.get("run")):
                    raise  # events expired, or a run this client cannot name
                run_id = run_id or metadata["run"]
                # The events after `last` up to `resume_after` are gone for good: asking
                # for them again would be refused again.
                resume_after = int(metadata.get("resume_after", last))
                if resume_after > last:
                    if lost is not None:
                        lost.append((last + 1, resume_after))
                    print(f"[events {last + 1} to {resume_after} of run {run_id} were lost: "
                          f"this client read too slowly]")
                    last = resume_after
                    backoff.reset()
            elif error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            wait = backoff.next_wait()
            if wait is None:
                raise StreamLost(f"run {run_id or '(not started)'}: still "
                                 f"{error.code().name} after {RESUME_BUDGET:.0f}s of retries: "
                                 f"{error.details()}") from error
            where = f"run {run_id} after event {last}" if run_id else "the Execute"
            print(f"[stream lost: {error.details()}; resuming {where} in {wait:.1f}s]")
            time.sleep(wait)


def cancel_run(engine, agent_engine_pb2, run_id):
    """Cancels the run this script leaves before its end (Ctrl-C, an error): started with
    `detach`, it would go on, or wait for answers, with nobody reading it. Errors are
    reported and ignored; the server ends every run within its own timeouts anyway."""
    import grpc

    if run_id is None:
        print("[the run's id is not known yet: it cannot be cancelled]", file=sys.stderr)
        return
    try:
        engine.Cancel(agent_engine_pb2.CancelRequest(run_id=run_id), timeout=CANCEL_TIMEOUT)
        print(f"[run {run_id} cancelled]", file=sys.stderr)
    except grpc.RpcError as error:
        print(f"[could not cancel run {run_id}: gRPC {error.code().name}: {error.details()}]",
              file=sys.stderr)
    except KeyboardInterrupt:
        print(f"[run {run_id} left running: interrupted again]", file=sys.stderr)


def report(answer, done) -> int:
    """Prints the answer and how the run ended (`done`: the type, data and iteration of its
    done event); the exit status: 0 for a complete answer only."""
    kind, data, iteration = done
    stop_reason = data.get("stop_reason")
    if kind != "EVENT_TYPE_ERROR":
        # The final answer rule: only the deltas of the done event's iteration are the
        # answer; text of earlier iterations is what the model wrote before calling tools.
        print(f"answer: {''.join(text for i, text in answer if i == iteration)}")
    print(f"done: {kind} stop_reason={stop_reason}")
    if kind == "EVENT_TYPE_ERROR":  # the run failed: there is no answer
        print(f"run failed: {data.get('code')}: {data.get('message')} "
              f"(category {data.get('category')})")
        return 1
    if stop_reason in ("final_answer", "max_iterations"):
        return 0
    # An answer cut short (max_tokens: the provider's token limit), or a reason this
    # script does not know: not a success.
    message = data.get("message")
    print(f"the answer is incomplete ({stop_reason})" + (f": {message}" if message else ""))
    return 1


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
    with grpc.insecure_channel(args.target, options=CHANNEL_OPTIONS) as channel:
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
        try:
            created = service.CreateAgentEngine(
                pb["agent_service_pb2"].CreateAgentEngineRequest(config=config), timeout=10)
        except grpc.RpcError as error:
            print(f"error: cannot create the engine: gRPC {error.code().name}: "
                  f"{error.details()}", file=sys.stderr)
            return 1
        print(f"engine {created.engine_id} in session {created.session_id}")

        # The message id is the turn's idempotency key: an Execute repeated with it (after
        # UNAVAILABLE before the first event) re-attaches to the same run. `detach` keeps
        # the run going when the stream breaks, for this script to resume it; the script
        # cancels it itself when it quits early.
        request = pb["agent_engine_pb2"].ExecuteRequest(
            engine_id=created.engine_id, query=args.query, message_id=str(uuid.uuid4()),
            detach=True)
        answer, done = [], None  # answer: (iteration, delta)
        lost = []  # events this client read too slowly to get
        run_id = None  # from the first event (RUN_STARTED): the run to cancel on quitting
        try:
            for event in stream_run(engine, pb["agent_engine_pb2"], request, lost=lost):
                run_id = event.run_id
                kind = event_type(events_pb2, event.type)
                data = json_format.MessageToDict(event.data) if event.HasField("data") else {}
                if event.done:
                    done = (kind, data, event.iteration)
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
        # Leaving before the done event leaves the run (detached) going: cancel it.
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            cancel_run(engine, pb["agent_engine_pb2"], run_id)
            return 130
        except StreamLost as error:
            print(f"error: {error}", file=sys.stderr)
            cancel_run(engine, pb["agent_engine_pb2"], run_id)
            return 1
        except grpc.RpcError as error:
            print(f"error: gRPC {error.code().name}: {error.details()}", file=sys.stderr)
            cancel_run(engine, pb["agent_engine_pb2"], run_id)
            return 1
        except Exception:
            cancel_run(engine, pb["agent_engine_pb2"], run_id)
            raise
        if done is None:
            print("the stream ended without a done event")
            cancel_run(engine, pb["agent_engine_pb2"], run_id)
            return 1
        if lost:
            # Deltas may be among the events lost: the run's record has the answer whole.
            try:
                state = engine.GetRun(
                    pb["agent_engine_pb2"].GetRunRequest(run_id=run_id), timeout=10)
                answer = [(done[2], state.final_answer)]
            except grpc.RpcError as error:
                print(f"[the answer may miss text: GetRun failed: {error.details()}]")
        return report(answer, done)


if __name__ == "__main__":
    sys.exit(main())
