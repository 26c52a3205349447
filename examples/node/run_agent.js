#!/usr/bin/env node
// Runs a tool-using agent turn on agent-server from Node.js, over plain gRPC.
//
// Loads the repository's proto/ at run time (@grpc/proto-loader), creates an engine,
// streams one Execute and prints what happens as it happens. The Execute is sent with
// `detach` set, so that the run outlives a broken connection: when the stream ends with
// UNAVAILABLE (the replica serving it shut down and handed the run over, or the connection
// broke), or with OUT_OF_RANGE `EVENTS_LAGGED` (this client read too slowly and the run went
// on without it), it resumes by itself with Subscribe(run_id, after_sequence). Since the run
// does not end with the stream, the script cancels it (Cancel) when it quits before the
// run's end: on Ctrl-C or an error.
//
// The agent has the tool executor's calculator and a client tool, lookup_order, that this
// script runs itself: when the run asks for it (EVENT_TYPE_ACTION_REQUIRED, action
// `client_execute`), the script looks the order up in its own table (ORDERS) and sends the
// output with SubmitToolOutputs. `--approve-tool NAME` makes the calls of the executor tool
// NAME (added to the agent when it is not the calculator) wait for approval (action
// `approve`): the script asks on the terminal (y/n, then a reason for a denial, which the
// model reads) and answers with ApproveToolCalls, or answers by itself with
// `--auto-approve yes|no` (`--deny-reason` says why). The run goes on in the same stream.
//
//     npm ci --prefix examples/node
//     node examples/node/run_agent.js --target localhost:50051 --query "What is 6 * 7?"
//     node examples/node/run_agent.js --approve-tool calculator --query "What is 6 * 7?"
//     node examples/node/run_agent.js --model gpt-4o-mini --approve-tool calculator \
//         --auto-approve no --deny-reason "not today" --query "Where is order A-17? And 6 * 7?"
//
// Prints the answer (the final answer deltas of the run's last iteration) and how the run
// ended. Exits 0 when the run ends with a complete answer (stop reason `final_answer` or
// `max_iterations`); 1 when the answer is incomplete (`max_tokens`: the partial answer is
// printed, and why it is cut), when the run failed (no answer; its error's code, message and
// category are printed) or on a client error; 130 on Ctrl-C.
'use strict';

const { randomUUID } = require('node:crypto');
const path = require('node:path');
const { setTimeout: sleep } = require('node:timers/promises');
const readline = require('node:readline');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const USAGE = `usage: node run_agent.js [--target HOST:PORT] [--query TEXT] [--model ID]
  [--approve-tool NAME]... [--auto-approve yes|no] [--deny-reason TEXT] [--proto-dir DIR]`;

function parseArguments() {
  try {
    return parseArgs({
      options: {
        target: { type: 'string', default: 'localhost:50051' },
        query: { type: 'string', default: 'What is 6 * 7?' },
        model: { type: 'string', default: 'demo' },
        'approve-tool': { type: 'string', multiple: true, default: [] },
        'auto-approve': { type: 'string' }, // yes | no: answer by itself instead of asking
        'deny-reason': { type: 'string', default: 'denied with --auto-approve no' },
        'proto-dir': { type: 'string', default: path.join(__dirname, '..', '..', 'proto') },
        help: { type: 'boolean', short: 'h', default: false },
      },
    }).values;
  } catch (error) {
    console.error(`error: ${error.message}\n${USAGE}`);
    return process.exit(2);
  }
}

const args = parseArguments();
if (args.help) {
  console.log(USAGE);
  process.exit(0);
}
if (![undefined, 'yes', 'no'].includes(args['auto-approve'])) {
  console.error('error: --auto-approve takes yes or no');
  process.exit(2);
}

// The client tool: the model calls it like any tool; this script runs it and sends the output.
const ORDERS = {
  'A-17': 'shipped on 2026-11-20, arriving Friday',
  'B-2': 'in transit',
  'C-5': 'waiting for payment',
};

const CLIENT_TOOLS = {
  lookup_order: {
    description: 'Looks up the status of an order of the shop by its id (e.g. A-17).',
    input_schema: {
      type: 'object',
      properties: { order_id: { type: 'string', description: "The order's id." } },
      required: ['order_id'],
      additionalProperties: false,
    },
    run({ order_id: id }) {
      if (!Object.hasOwn(ORDERS, id)) throw new Error(`no order ${id}`);
      return `order ${id}: ${ORDERS[id]}`;
    },
  },
};

// google.protobuf.Value / Struct, as proto-loader decodes them, to plain JavaScript.
function fromValue(value) {
  switch (value.kind) {
    case 'nullValue': return null;
    case 'numberValue': return value.numberValue;
    case 'stringValue': return value.stringValue;
    case 'boolValue': return value.boolValue;
    case 'structValue': return fromStruct(value.structValue);
    case 'listValue': return (value.listValue.values || []).map(fromValue);
    default: return undefined;
  }
}

function fromStruct(struct) {
  const out = {};
  for (const [key, value] of Object.entries((struct && struct.fields) || {})) {
    out[key] = fromValue(value);
  }
  return out;
}

// Plain JavaScript to google.protobuf.Value / Struct, as proto-loader encodes them.
function toValue(value) {
  if (value === null) return { nullValue: 'NULL_VALUE' };
  if (Array.isArray(value)) return { listValue: { values: value.map(toValue) } };
  switch (typeof value) {
    case 'number': return { numberValue: value };
    case 'string': return { stringValue: value };
    case 'boolean': return { boolValue: value };
    default: return { structValue: toStruct(value) };
  }
}

function toStruct(object) {
  return { fields: Object.fromEntries(Object.entries(object).map(([k, v]) => [k, toValue(v)])) };
}

// Runs a client tool: { output, is_error }.
function runClientTool(name, callArgs) {
  try {
    return { output: String(CLIENT_TOOLS[name].run(callArgs)), is_error: false };
  } catch (error) { // the model reads the error and may try again
    return { output: `${name} failed: ${error.message}`, is_error: true };
  }
}

// Lines typed on the terminal (or piped in), read one at a time; made at the first question.
let terminalLines = null;

// Asks on the terminal whether the call may run: { approved, reason }.
async function askTerminal(name, callArgs) {
  terminalLines ??= readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  const ask = async (question) => {
    process.stdout.write(question);
    const line = await terminalLines.next();
    return line.done ? null : line.value.trim();
  };
  const yes = await ask(`approve ${name}(${JSON.stringify(callArgs)})? [y/N] `);
  if (yes === null) return { approved: false, reason: 'no answer on the terminal' };
  if (['y', 'yes'].includes(yes.toLowerCase())) return { approved: true, reason: '' };
  return { approved: false, reason: (await ask('reason (optional, the model reads it): ')) ?? '' };
}

// Answers an EVENT_TYPE_ACTION_REQUIRED: runs the client tool calls and sends their outputs,
// decides the calls waiting for approval (`decide(name, callArgs)` gives { approved, reason })
// and sends the decisions. The run goes on once all are answered.
async function answerAction(engine, runId, calls, decide) {
  const outputs = [];
  const decisions = [];
  for (const { id, name, arguments: callArgs = {}, action } of calls) {
    if (action === 'client_execute') {
      const { output, is_error } = runClientTool(name, callArgs);
      console.log(`[client tool] ${name}(${JSON.stringify(callArgs)}) -> ${output}`);
      outputs.push({ tool_call_id: id, output, is_error });
    } else if (action === 'approve') {
      const { approved, reason } = await decide(name, callArgs);
      const said = approved ? 'approved' : 'denied';
      console.log(`[${said}] ${name}(${JSON.stringify(callArgs)})${reason ? `: ${reason}` : ''}`);
      decisions.push({ tool_call_id: id, approved, reason });
    } else {
      console.log(`[unknown action '${action}' for ${name}: left unanswered]`);
    }
  }
  if (outputs.length) await sendAnswers(engine, 'SubmitToolOutputs', { run_id: runId, outputs });
  if (decisions.length) await sendAnswers(engine, 'ApproveToolCalls', { run_id: runId, decisions });
}

// Sends `request` with the AgentEngine `method` (SubmitToolOutputs or ApproveToolCalls),
// retrying UNAVAILABLE with the stream's backoff: the same answer sent again is accepted once.
// FAILED_PRECONDITION means the run does not wait for these answers (any more): it ended
// meanwhile (cancelled, timed out waiting, ...), or the calls were answered otherwise. That
// is not this client's end: the run's stream goes on and tells how the run ends.
async function sendAnswers(engine, method, request) {
  const backoff = new Backoff();
  for (;;) {
    try {
      await unary(engine, method, request);
      return;
    } catch (error) {
      if (error.code === grpc.status.FAILED_PRECONDITION) {
        console.log(`[${method} not taken: ${error.details}; reading on to the run's end]`);
        return;
      }
      if (error.code !== grpc.status.UNAVAILABLE) throw error;
      const wait = backoff.nextWait();
      if (wait === null) {
        throw new Error(`${method}: still UNAVAILABLE after ${RESUME_BUDGET_MS / 1000}s of `
          + `retries: ${error.details}`);
      }
      const seconds = (wait / 1000).toFixed(1);
      console.log(`[${method} failed: ${error.details}; sending it again in ${seconds}s]`);
      await sleep(wait);
    }
  }
}

function loadPackage(protoDir) {
  const dir = path.join(protoDir, 'agent', 'v1');
  const files = ['agent_service.proto', 'agent_engine.proto'].map((f) => path.join(dir, f));
  const definition = protoLoader.loadSync(files, {
    includeDirs: [protoDir],
    keepCase: true, // field names as the .proto writes them
    enums: String, // a type newer than these protos arrives as its number
    longs: Number, // `sequence` as a number
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).agent.v1;
}

function unary(client, method, request, timeoutMs = 10_000) {
  const deadline = new Date(Date.now() + timeoutMs);
  return new Promise((resolve, reject) => {
    client[method](request, { deadline }, (error, response) => (error ? reject(error) : resolve(response)));
  });
}

const RESUME_FIRST_WAIT_MS = 200; // before the first retry; doubles up to RESUME_MAX_WAIT_MS
const RESUME_MAX_WAIT_MS = 2_000;
const RESUME_BUDGET_MS = 30_000; // give up after this long without a new event (or answer taken)
const CANCEL_TIMEOUT_MS = 3_000; // how long a Cancel may take when the script quits early

// Client keepalive: a ping every 30 s (a run's stream may be quiet for long, e.g. while it
// waits for an answer typed on the terminal), and a connection that does not answer one
// within 10 s is broken: the stream ends UNAVAILABLE and is resumed.
const CHANNEL_OPTIONS = {
  'grpc.keepalive_time_ms': 30_000,
  'grpc.keepalive_timeout_ms': 10_000,
};

// The waits between retries: RESUME_FIRST_WAIT_MS doubling up to RESUME_MAX_WAIT_MS, until
// RESUME_BUDGET_MS has passed since the first failure after the last progress (`reset`).
class Backoff {
  constructor() {
    this.reset();
  }

  reset() {
    this.wait = RESUME_FIRST_WAIT_MS;
    this.giveUpAt = null;
  }

  // Milliseconds to wait before the next attempt, or null when the budget is spent.
  nextWait() {
    this.giveUpAt ??= Date.now() + RESUME_BUDGET_MS;
    if (Date.now() + this.wait > this.giveUpAt) return null;
    const wait = this.wait;
    this.wait = Math.min(this.wait * 2, RESUME_MAX_WAIT_MS);
    return wait;
  }
}

// The length-delimited fields of a serialized protobuf message, as [number, Buffer]; the
// others are skipped. Enough to read a google.rpc.Status and its ErrorInfo without their
// generated code (no package of this example has google/rpc).
function protoFields(data) {
  const fields = [];
  let i = 0;
  const varint = () => {
    let value = 0;
    for (let shift = 0; ; shift += 7) {
      if (i >= data.length) throw new Error('truncated message');
      const byte = data[i++];
      value += (byte & 0x7f) * 2 ** shift; // not <<: a varint may pass 32 bits
      if (byte < 0x80) return value;
    }
  };
  while (i < data.length) {
    const key = varint();
    const number = Math.floor(key / 8);
    const wireType = key % 8;
    if (wireType === 0) varint(); // varint
    else if (wireType === 1) i += 8; // 64-bit
    else if (wireType === 5) i += 4; // 32-bit
    else if (wireType === 2) { // length-delimited: strings, bytes, messages
      const size = varint();
      fields.push([number, data.subarray(i, i + size)]);
      i += size;
    } else throw new Error(`unexpected wire type ${wireType}`);
  }
  if (i > data.length) throw new Error('truncated message');
  return fields;
}

// The google.rpc.ErrorInfo of a gRPC error as { reason, metadata }, read from its
// `grpc-status-details-bin` trailer (a google.rpc.Status: details = 3, each a
// google.protobuf.Any with type_url = 1, value = 2; ErrorInfo: reason = 1, metadata = 3,
// each entry key = 1, value = 2); { reason: '', metadata: {} } when it has none.
function errorInfo(error) {
  try {
    const [details] = (error.metadata && error.metadata.get('grpc-status-details-bin')) || [];
    for (const [number, detail] of details ? protoFields(details) : []) {
      const any = new Map(number === 3 ? protoFields(detail) : []);
      if (!String(any.get(1) ?? '').endsWith('/google.rpc.ErrorInfo')) continue;
      const info = protoFields(any.get(2) ?? Buffer.alloc(0));
      const metadata = {};
      for (const [n, entry] of info) {
        if (n !== 3) continue;
        const pair = new Map(protoFields(entry));
        metadata[String(pair.get(1) ?? '')] = String(pair.get(2) ?? '');
      }
      return { reason: String(new Map(info).get(1) ?? ''), metadata };
    }
  } catch {
    // unreadable details: as if there were none
  }
  return { reason: '', metadata: {} };
}

// Yields the events of the run `request` starts, each once, in order, up to `done`.
// On UNAVAILABLE it resumes with Subscribe(run_id, after_sequence) on the same target,
// or, before the first event, repeats the Execute: its message_id makes it the same run
// (the request sets `detach`, so that the run is not cancelled when its stream breaks).
// OUT_OF_RANGE with reason EVENTS_LAGGED (this client fell further behind than the run's
// replay log; the run goes on) is resumed after the last event lost (its ErrorInfo's
// `resume_after`), with the run id the error names when no event came yet; the lost events'
// [first, last] sequence numbers are pushed onto `lost`, when given.
// The streams have no deadline unless `timeoutMs` says: a run may wait for an answer typed
// on the terminal, and the server ends every run within its own timeouts.
async function* streamRun(engine, request, timeoutMs, lost) {
  let runId = null;
  let last = 0;
  const backoff = new Backoff();
  for (;;) {
    const options = timeoutMs === undefined ? {} : { deadline: new Date(Date.now() + timeoutMs) };
    const call = runId === null
      ? engine.Execute(request, options)
      : engine.Subscribe({ run_id: runId, after_sequence: last }, options);
    try {
      for await (const event of call) {
        if (event.sequence <= last) continue; // seen before the stream was lost
        runId = event.run_id;
        last = event.sequence;
        backoff.reset();
        yield event;
        if (event.done) return;
      }
      return; // ended without a `done` event; the caller tells
    } catch (error) {
      if (error.code === grpc.status.OUT_OF_RANGE) {
        const { reason, metadata } = errorInfo(error);
        if (reason !== 'EVENTS_LAGGED' || !(runId || metadata.run)) {
          throw error; // events expired, or a run this client cannot name
        }
        runId ||= metadata.run;
        // The events after `last` up to `resume_after` are gone for good: asking for them
        // again would be refused again.
        const resumeAfter = Number(metadata.resume_after ?? last);
        if (resumeAfter > last) {
          if (lost) lost.push([last + 1, resumeAfter]);
          console.log(`[events ${last + 1} to ${resumeAfter} of run ${runId} were lost: `
            + 'this client read too slowly]');
          last = resumeAfter;
          backoff.reset();
        }
      } else if (error.code !== grpc.status.UNAVAILABLE) {
        throw error;
      }
      const wait = backoff.nextWait();
      if (wait === null) {
        throw new Error(`run ${runId ?? '(not started)'}: still ${grpc.status[error.code]} after `
          + `${RESUME_BUDGET_MS / 1000}s of retries: ${error.details}`);
      }
      const where = runId ? `run ${runId} after event ${last}` : 'the Execute';
      console.log(`[stream lost: ${error.details}; resuming ${where} in ${(wait / 1000).toFixed(1)}s]`);
      await sleep(wait);
    }
  }
}

// Cancels the run this script leaves before its end (Ctrl-C, an error): started with
// `detach`, it would go on, or wait for answers, with nobody reading it. Errors are reported
// and ignored; the server ends every run within its own timeouts anyway.
async function cancelRun(engine, runId) {
  if (!runId) {
    console.error("[the run's id is not known yet: it cannot be cancelled]");
    return;
  }
  try {
    await unary(engine, 'Cancel', { run_id: runId }, CANCEL_TIMEOUT_MS);
    console.error(`[run ${runId} cancelled]`);
  } catch (error) {
    const status = error.code !== undefined ? `gRPC ${grpc.status[error.code]}: ` : '';
    console.error(`[could not cancel run ${runId}: ${status}${error.details || error.message}]`);
  }
}

// The run in progress: what a Ctrl-C cancels. `engine` is set from the Execute until the
// done event, `runId` from the first event (RUN_STARTED).
const current = { engine: null, runId: null };

// Ctrl-C cancels the run in progress, then exits 130; a second one exits at once.
let interrupted = false;
process.on('SIGINT', () => {
  if (interrupted) process.exit(130);
  interrupted = true;
  console.error('interrupted');
  const cancelled = current.engine ? cancelRun(current.engine, current.runId) : Promise.resolve();
  cancelled.finally(() => process.exit(130));
});

// Prints the answer and how the run ended (`done`: the type, data and iteration of its done
// event); returns the exit status: 0 for a complete answer only.
function report(answer, { type, data, iteration }) {
  if (type !== 'EVENT_TYPE_ERROR') {
    // The final answer rule: only the deltas of the done event's iteration are the answer;
    // text of earlier iterations is what the model wrote before calling tools.
    const text = answer.filter((delta) => delta.iteration === iteration).map((delta) => delta.text);
    console.log(`answer: ${text.join('')}`);
  }
  console.log(`done: ${type} stop_reason=${data.stop_reason}`);
  if (type === 'EVENT_TYPE_ERROR') { // the run failed: there is no answer
    console.log(`run failed: ${data.code}: ${data.message} (category ${data.category})`);
    return 1;
  }
  if (['final_answer', 'max_iterations'].includes(data.stop_reason)) return 0;
  // An answer cut short (max_tokens: the provider's token limit), or a reason this script
  // does not know: not a success.
  const why = data.message ? `: ${data.message}` : '';
  console.log(`the answer is incomplete (${data.stop_reason})${why}`);
  return 1;
}

async function main() {
  const v1 = loadPackage(args['proto-dir']);
  const credentials = grpc.credentials.createInsecure();
  const service = new v1.AgentService(args.target, credentials, CHANNEL_OPTIONS);
  const engine = new v1.AgentEngine(args.target, credentials, CHANNEL_OPTIONS);
  const decide = args['auto-approve']
    ? () => {
      const approved = args['auto-approve'] === 'yes';
      return { approved, reason: approved ? '' : args['deny-reason'] };
    }
    : askTerminal;
  const approveTools = args['approve-tool'];

  const created = await unary(service, 'CreateAgentEngine', {
    config: {
      name: 'node-example',
      system_prompt: 'Use the calculator for arithmetic and lookup_order for orders.',
      model: { name: args.model },
      tools: [...new Set(['calculator', ...approveTools])]
        .map((name) => ({ name, require_approval: approveTools.includes(name) })),
      client_tools: Object.entries(CLIENT_TOOLS).map(([name, tool]) => ({
        name,
        description: tool.description,
        input_schema: toStruct(tool.input_schema),
      })),
    },
  });
  console.log(`engine ${created.engine_id} in session ${created.session_id}`);

  // The message id is the turn's idempotency key: an Execute repeated with it (after
  // UNAVAILABLE before the first event) re-attaches to the same run. `detach` keeps the run
  // going when the stream breaks, for this script to resume it; the script cancels it
  // itself when it quits early.
  const request = {
    engine_id: created.engine_id, query: args.query, message_id: randomUUID(), detach: true,
  };
  let answer = []; // { iteration, text }
  let done = null;
  const lost = []; // events this client read too slowly to get
  current.engine = engine;
  try {
    for await (const event of streamRun(engine, request, undefined, lost)) {
      current.runId = event.run_id;
      const data = event.data ? fromStruct(event.data) : {};
      if (event.done) {
        done = { type: event.type, data, iteration: event.iteration };
      } else if (event.type === 'EVENT_TYPE_THOUGHT') {
        console.log(`[thought] ${event.content}`);
      } else if (event.type === 'EVENT_TYPE_TOOL_CALL') {
        console.log(`[tool call] ${data.name}(${JSON.stringify(data.arguments)})`);
      } else if (event.type === 'EVENT_TYPE_TOOL_RESULT') {
        console.log(`[tool result] ${data.name} -> ${data.output}`);
      } else if (event.type === 'EVENT_TYPE_ACTION_REQUIRED') {
        // The run waits (the stream stays open) until every call is answered.
        const calls = data.tool_calls || [];
        console.log(`[action required] ${calls.length} tool call(s) wait for an answer`);
        await answerAction(engine, event.run_id, calls, decide);
      } else if (event.type === 'EVENT_TYPE_ROUND_RESTARTED') {
        // The round's deltas so far are void: the model round runs again.
        const round = data.iteration ?? event.iteration;
        console.log(`[round ${round} restarted on another replica (${data.reason})]`);
        answer = answer.filter((delta) => delta.iteration !== round);
      } else if (event.type === 'EVENT_TYPE_FINAL_ANSWER') {
        answer.push({ iteration: event.iteration, text: event.content });
      }
    }
    if (!done) {
      console.log('the stream ended without a done event');
      await cancelRun(engine, current.runId);
      return 1;
    }
    if (lost.length > 0) {
      // Deltas may be among the events lost: the run's record has the answer whole.
      try {
        const state = await unary(engine, 'GetRun', { run_id: current.runId });
        answer = [{ iteration: done.iteration, text: state.final_answer }];
      } catch (error) {
        console.log(`[the answer may miss text: GetRun failed: ${error.details || error.message}]`);
      }
    }
  } catch (error) {
    // Leaving before the done event leaves the run (detached) going: cancel it.
    await cancelRun(engine, current.runId);
    throw error;
  } finally {
    current.engine = null; // nothing left for Ctrl-C to cancel
  }
  service.close();
  engine.close();
  return report(answer, done);
}

main().then(
  (code) => process.exit(code),
  (error) => {
    console.error(`error: ${error.code !== undefined ? `gRPC ${grpc.status[error.code]}: ` : ''}${error.details || error.message}`);
    process.exit(1);
  },
);
