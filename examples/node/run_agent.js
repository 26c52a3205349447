#!/usr/bin/env node
// Runs a tool-using agent turn on agent-server from Node.js, over plain gRPC.
//
// Loads the repository's proto/ at run time (@grpc/proto-loader), creates an engine,
// streams one Execute and prints what happens as it happens. When the stream ends with
// UNAVAILABLE (the replica serving it shut down and handed the run over, or the connection
// broke), it resumes by itself with Subscribe(run_id, after_sequence).
//
//     npm install --prefix examples/node
//     node examples/node/run_agent.js --target localhost:50051 --query "What is 6 * 7?"
//
// Exits 0 when the run ends with a final answer, 1 otherwise.
'use strict';

const { randomUUID } = require('node:crypto');
const path = require('node:path');
const { setTimeout: sleep } = require('node:timers/promises');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const { values: args } = parseArgs({
  options: {
    target: { type: 'string', default: 'localhost:50051' },
    query: { type: 'string', default: 'What is 6 * 7?' },
    model: { type: 'string', default: 'demo' },
    'proto-dir': { type: 'string', default: path.join(__dirname, '..', '..', 'proto') },
  },
});

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
async function* streamRun(engine, request, timeoutMs = 60_000) {
  let runId = null;
  let last = 0;
  let wait = RESUME_FIRST_WAIT_MS;
  let giveUpAt = null;
  for (;;) {
    const options = { deadline: new Date(Date.now() + timeoutMs) };
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

  const created = await unary(service, 'CreateAgentEngine', {
    config: {
      name: 'node-example',
      system_prompt: 'Use the calculator for arithmetic.',
      model: { name: args.model },
      tools: [{ name: 'calculator' }],
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
