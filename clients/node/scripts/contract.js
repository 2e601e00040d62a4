#!/usr/bin/env node
// Print, as one JSON object, what the Node client gets for the contract's newer parts, so that
// tests/client/test_node_client.py can hold it against the Python client and the raw stub:
//
//   node scripts/contract.js --address 127.0.0.1:50051 --colbert NAME [--reranker NAME]
//       [--instruction TEXT] --query TEXT DOCUMENT...
//
// {"models": [ModelInfo...],
//  "embedMulti": {"query": {"float32": [matrix], "float16": [matrix]}, "document": {...}},
//  "rerank": {"default": RerankOutput, "instructed": RerankOutput}}  (rerank with --reranker)
// where a matrix is {"rows", "cols", "encoding", "data": [row-major values]}.

import { parseArgs } from 'node:util';

import { PoolingClient, PoolingError } from '../src/index.js';

const { values, positionals } = parseArgs({
  options: {
    address: { type: 'string', default: process.env.POOLING_SERVER_ADDRESS },
    colbert: { type: 'string' },
    reranker: { type: 'string' },
    instruction: { type: 'string' },
    query: { type: 'string' },
    timeout: { type: 'string', default: '60' },
  },
  allowPositionals: true,
});

if (!values.address || !values.colbert || values.query === undefined || positionals.length === 0) {
  console.error('usage: contract.js --address HOST:PORT --colbert NAME [--reranker NAME] [--instruction TEXT] --query TEXT DOCUMENT...');
  process.exit(2);
}

/** @param {import('../src/outputs.js').MultiVectorRequestOutput[]} outputs */
const matrices = (outputs) =>
  outputs.map(({ outputs: m }) => ({ rows: m.rows, cols: m.cols, encoding: m.encoding, data: Array.from(m.data) }));

const client = new PoolingClient(values.address, { timeout: Number(values.timeout) });
try {
  const result = { models: await client.models(), embedMulti: {}, rerank: null };
  for (const [mode, texts] of [
    ['query', [values.query]],
    ['document', positionals],
  ]) {
    const options = { model: values.colbert, poolingTask: 'embed_multi', promptName: mode };
    result.embedMulti[mode] = {
      float32: matrices(await client.encode(texts, options)),
      float16: matrices(await client.encode(texts, { ...options, encoding: 'float16' })),
    };
  }
  if (values.reranker) {
    const options = { model: values.reranker, returnDocuments: true };
    result.rerank = {
      default: await client.rerank(values.query, positionals, options),
      instructed: await client.rerank(values.query, positionals, { ...options, instruction: values.instruction ?? '' }),
    };
  }
  process.stdout.write(`${JSON.stringify(result)}\n`);
} catch (error) {
  console.error(error instanceof PoolingError ? error.toString() : error);
  process.exitCode = 1;
} finally {
  client.close();
}
