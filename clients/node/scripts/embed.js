#!/usr/bin/env node
// Print the embeddings of the given texts as JSON: {"model": ..., "embeddings": [[...], ...]}.
//
//   node scripts/embed.js --address 127.0.0.1:50051 [--model NAME] [--encoding float16]
//       [--task token_embed] "Hello world" "Another text"
//
// With --encoding the values travel packed and are decoded by the client (the bit encodings
// print their packed bytes); with --task token_embed each embedding is a list of token rows.
//
// Used by tests/client/test_node_client.py to compare the Node client with the Python one.

import { parseArgs } from 'node:util';

import { PoolingClient, PoolingError } from '../src/index.js';

const { values, positionals } = parseArgs({
  options: {
    address: { type: 'string', default: process.env.POOLING_SERVER_ADDRESS },
    model: { type: 'string' },
    encoding: { type: 'string' },
    task: { type: 'string', default: 'embed' },
    timeout: { type: 'string', default: '60' },
  },
  allowPositionals: true,
});

if (!values.address || positionals.length === 0) {
  console.error('usage: embed.js --address HOST:PORT [--model NAME] [--encoding NAME] [--task embed|token_embed] TEXT...');
  process.exit(2);
}

const client = new PoolingClient(values.address, { model: values.model ?? null, timeout: Number(values.timeout) });
try {
  const options = values.encoding ? { encoding: values.encoding } : {};
  const tokens = values.task === 'token_embed';
  const outputs = tokens
    ? await client.encode(positionals, { ...options, poolingTask: 'token_embed' })
    : await client.embed(positionals, options);
  const embeddings = outputs.map((output) => (tokens ? output.outputs.data : output.outputs.embedding));
  const result = { model: values.model ?? null, encoding: values.encoding ?? null, embeddings };
  process.stdout.write(`${JSON.stringify(result)}\n`);
} catch (error) {
  console.error(error instanceof PoolingError ? error.toString() : error);
  process.exitCode = 1;
} finally {
  client.close();
}
