#!/usr/bin/env node
// Runs a tool-using agent turn on agent-server from Node.js, over plain gRPC.
//
// Loads the repository's proto/ at run time (@grpc/proto-loader), creates an engine,
// streams one Execute and prints what happens as it happens.
//
//     npm install --prefix examples/node
//     node examples/node/run_agent.js --target localhost:50051 --query "What is 6 * 7?"
//
// Exits 0 when the run ends with a final answer, 1 otherwise.
'use strict';

const path = require('node:path');
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
    enums: String,
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

  const answer = [];
  let last = null;
  const call = engine.Execute(
    { engine_id: created.engine_id, query: args.query },
    { deadline: new Date(Date.now() + 60_000) },
  );
  for await (const event of call) {
    const data = event.data ? fromStruct(event.data) : {};
    if (event.done) {
      last = { type: event.type, data };
    } else if (event.type === 'EVENT_TYPE_THOUGHT') {
      console.log(`[thought] ${event.content}`);
    } else if (event.type === 'EVENT_TYPE_TOOL_CALL') {
      console.log(`[tool call] ${data.name}(${JSON.stringify(data.arguments)})`);
    } else if (event.type === 'EVENT_TYPE_TOOL_RESULT') {
      console.log(`[tool result] ${data.name} -> ${data.output}`);
    } else if (event.type === 'EVENT_TYPE_FINAL_ANSWER') {
      answer.push(event.content);
    }
  }
  service.close();
  engine.close();
  console.log(`answer: ${answer.join('')}`);
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
