#!/usr/bin/env node
// Print the embeddings of the given texts as JSON: {"model": ..., "embeddings": [[...], ...]}.
//
//   node scripts/embed.js --address 127.0.0.1:50051 [--model NAME] "Hello world" "Another text"
//
// Used by tests/client/test_node_client.py to compare the Node client with the Python one.

import { parseArgs } from 'node:util';

import { PoolingClient, PoolingError } from '../src/index.js';

const { values, positionals } = parseArgs({
  options: {
    address: { type: 'string', default: process.env.POOLING_SERVER_ADDRESS },
    model: { type: 'string' },
    timeout: { type: 'string', default: '60' },
  },
  allowPositionals: true,
});

if (!values.address || positionals.length === 0) {
  console.error('usage: embed.js --address HOST:PORT [--model NAME] TEXT...');
  process.exit(2);
}

const client = new PoolingClient(values.address, { model: values.model ?? null, timeout: Number(values.timeout) });
try {
  const outputs = await client.embed(positionals);
  const result = { model: values.model ?? null, embeddings: outputs.map((output) => output.outputs.embedding) };
  process.stdout.write(`${JSON.stringify(result)}\n`);
} catch (error) {
  console.error(error instanceof PoolingError ? error.toString() : error);
  process.exitCode = 1;
} finally {
  client.close();
}
