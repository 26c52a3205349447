#!/usr/bin/env node
// Runs a tool-using agent turn on agent-server from Node.js, over plain gRPC.
//
// Loads the repository's proto/ at run time (@grpc/proto-loader), creates an engine,
// streams one Execute and prints what happens as it happens. When the stream ends with
// UNAVAILABLE (the replica serving it shut down and handed the run over, or the connection
// broke), it resumes by itself with Subscribe(run_id, after_sequence).
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
// Exits 0 when the run ends with a final answer, 1 otherwise.
'use strict';

const { randomUUID } = require('node:crypto');
const path = require('node:path');
const { setTimeout: sleep } = require('node:timers/promises');
const readline = require('node:readline');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const { values: args } = parseArgs({
  options: {
    target: { type: 'string', default: 'localhost:50051' },
    query: { type: 'string', default: 'What is 6 * 7?' },
    model: { type: 'string', default: 'demo' },
    'approve-tool': { type: 'string', multiple: true, default: [] },
    'auto-approve': { type: 'string' }, // yes | no: answer by itself instead of asking
    'deny-reason': { type: 'string', default: 'denied with --auto-approve no' },
    'proto-dir': { type: 'string', default: path.join(__dirname, '..', '..', 'proto') },
  },
});
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
  if (outputs.length) await unary(engine, 'SubmitToolOutputs', { run_id: runId, outputs });
  if (decisions.length) await unary(engine, 'ApproveToolCalls', { run_id: runId, decisions });
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

function unary(client, method, request) {
  const deadline = new Date(Date.now() + 10_000);
  return new Promise((resolve, reject) => {
    client[method](request, { deadline }, (error, response) => (error ? reject(error) : resolve(response)));
  });
}

const RESUME_FIRST_WAIT_MS = 200; // before the first retry; doubles up to RESUME_MAX_WAIT_MS
const RESUME_MAX_WAIT_MS = 2_000;
const RESUME_BUDGET_MS = 30_000; // give up after this long without a new event

// Yields the events of the run `request` starts, each once, in order, up to `done`.
// On UNAVAILABLE it resumes with Subscribe(run_id, after_sequence) on the same target,
// or, before the first event, repeats the Execute: its message_id makes it the same run.
// The streams have no deadline unless `timeoutMs` says: a run may wait for an answer typed
// on the terminal, and the server ends every run within its own timeouts.
async function* streamRun(engine, request, timeoutMs) {
  let runId = null;
  let last = 0;
  let wait = RESUME_FIRST_WAIT_MS;
  let giveUpAt = null;
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
        wait = RESUME_FIRST_WAIT_MS;
        giveUpAt = null;
        yield event;
        if (event.done) return;
      }
      return; // ended without a `done` event; the caller tells
    } catch (error) {
      if (error.code !== grpc.status.UNAVAILABLE) throw error;
      giveUpAt ??= Date.now() + RESUME_BUDGET_MS;
      if (Date.now() + wait > giveUpAt) {
        throw new Error(`run ${runId ?? '(not started)'}: still UNAVAILABLE after `
          + `${RESUME_BUDGET_MS / 1000}s of retries: ${error.details}`);
      }
      const where = runId ? `run ${runId} after event ${last}` : 'the Execute';
      console.log(`[stream lost: ${error.details}; resuming ${where} in ${(wait / 1000).toFixed(1)}s]`);
      await sleep(wait);
      wait = Math.min(wait * 2, RESUME_MAX_WAIT_MS);
    }
  }
}

async function main() {
  const v1 = loadPackage(args['proto-dir']);
  const credentials = grpc.credentials.createInsecure();
  const service = new v1.AgentService(args.target, credentials);
  const engine = new v1.AgentEngine(args.target, credentials);
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
  // UNAVAILABLE before the first event) re-attaches to the same run.
  const request = { engine_id: created.engine_id, query: args.query, message_id: randomUUID() };
  let answer = []; // { iteration, text }
  let last = null;
  for await (const event of streamRun(engine, request)) {
    const data = event.data ? fromStruct(event.data) : {};
    if (event.done) {
      last = { type: event.type, data };
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
  service.close();
  engine.close();
  console.log(`answer: ${answer.map((delta) => delta.text).join('')}`);
  if (!last) {
    console.log('the stream ended without a done event');
    return 1;
  }
  console.log(`done: ${last.type} stop_reason=${last.data.stop_reason}`);
  return last.type === 'EVENT_TYPE_FINAL_ANSWER' ? 0 : 1;
}

main().then(
  (code) => process.exit(code),
  (error) => {
    console.error(`error: ${error.code !== undefined ? `gRPC ${grpc.status[error.code]}: ` : ''}${error.details || error.message}`);
    process.exit(1);
  },
);
