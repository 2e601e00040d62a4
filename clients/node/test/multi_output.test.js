// bge-m3's multi-output contract without a pooling server: embedOutputs (the outputs asked
// for on the wire, each text's dense vector, lexical weights and ColBERT matrix decoded) and
// outputWeights on score and rerank, over a tiny in-process grpc-js fake so that the real
// serialization runs both ways. Against a real server the Python client's served test
// (tests/service/test_multi_output_served.py) checks the same contract.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { ChunkedJob } from '../src/chunking.js';
import { PoolingClient, paramsToWire, verifyParams } from '../src/index.js';
import { outputsOptions, requestTemplate, rerankRequest } from '../src/requests.js';
import { fakeServer, rerankInOrder } from './helpers.js';

/** A 2 x 3 matrix and its float16 bytes (each value is exact in half precision). */
const VALUES = [0.5, -0.25, 1, 0.125, 0, -2];
const HALF_BITS = [0x3800, 0xb400, 0x3c00, 0x3000, 0x0000, 0xc000];

/** @param {number[]} bits */
function uint16Bytes(bits) {
  const bytes = Buffer.alloc(2 * bits.length);
  bits.forEach((value, i) => bytes.writeUInt16LE(value, 2 * i));
  return bytes;
}

const M3_CARD = {
  name: 'm3',
  tasks: [
    'POOLING_TASK_EMBED',
    'POOLING_TASK_EMBED_SPARSE',
    'POOLING_TASK_EMBED_MULTI',
    'POOLING_TASK_EMBED_OUTPUTS',
    'POOLING_TASK_SCORE',
  ],
  hidden_size: 4,
  outputs: ['dense', 'sparse', 'multi'],
};

/** What the fake answers for one text: only the outputs the request asked for. */
function textOutputs(/** @type {any} */ asked, /** @type {number} */ i) {
  /** @type {Record<string, unknown>} */
  const item = {};
  if (asked.dense) item.dense = { values: [i, 0, 0, 1] };
  if (asked.sparse) {
    const tokens = asked.return_tokens ? ['paris', 'capital'] : [];
    item.sparse = { indices: [7, 3], values: [0.5, 0.25], tokens };
  }
  if (asked.multi) item.multi = { rows: 2, cols: 3, data: uint16Bytes(HALF_BITS), encoding: 'EMBEDDING_ENCODING_FLOAT16' };
  return item;
}

describe('embed_outputs and output weights without a server', () => {
  test('the outputs asked for travel in OutputsInput, checked first', () => {
    assert.deepEqual(outputsOptions({}), { dense: true, sparse: true, multi: true, sparse_top_k: 0, return_tokens: false });
    assert.deepEqual(outputsOptions({ dense: false, multi: false, sparseTopK: 5, returnTokens: true }), {
      dense: false,
      sparse: true,
      multi: false,
      sparse_top_k: 5,
      return_tokens: true,
    });
    assert.throws(() => outputsOptions({ dense: false, sparse: false, multi: false }), /at least one output/);
    assert.throws(() => outputsOptions({ sparseTopK: -1 }), RangeError);
    assert.throws(() => outputsOptions({ dense: /** @type {any} */ ('yes') }), TypeError);
    const template = requestTemplate('embed_outputs', { encoding: 'float16', inputOptions: outputsOptions({ sparse: false }) });
    assert.equal(template.params.task, 'POOLING_TASK_EMBED_OUTPUTS');
    assert.equal(template.encoding, 'EMBEDDING_ENCODING_FLOAT16');
    const job = new ChunkedJob('embed_outputs', ['a', 'b', 'c'], template, 2, 2);
    const chunks = job.fill().map((r) => r.request.embed_outputs);
    assert.deepEqual(
      chunks.map((c) => [c.texts, c.dense, c.sparse, c.multi]),
      [
        [['a', 'b'], true, false, true],
        [['c'], true, false, true],
      ],
      'every PoolStream chunk keeps the outputs asked for',
    );
  });

  test('outputWeights belong to score (and so rerank), checked and sent', () => {
    verifyParams({ outputWeights: { dense: 0.4, sparse: 0.2, multi: 0.4 } }, 'score');
    assert.throws(() => verifyParams({ outputWeights: { dense: 1 } }, 'embed'), /does not support \[outputWeights\]/);
    assert.throws(() => verifyParams({ outputWeights: {} }, 'score'), RangeError);
    assert.throws(() => verifyParams({ outputWeights: { dense: -1, multi: 1 } }, 'score'), RangeError);
    assert.throws(() => verifyParams({ outputWeights: { lexical: 1 } }, 'score'), TypeError);
    assert.throws(() => verifyParams({ useActivation: true, dimensions: 4 }, 'embed_outputs'), TypeError);
    assert.deepEqual(paramsToWire({ outputWeights: { sparse: 1 } }, 'score').output_weights, { dense: 0, sparse: 1, multi: 0 });
    const rerank = rerankRequest('q', ['d'], { poolingParams: { outputWeights: { dense: 1, multi: 1 } } });
    assert.deepEqual(rerank.params.output_weights, { dense: 1, sparse: 0, multi: 1 });
  });
});

describe('embedOutputs and weighted rerank over grpc-js', () => {
  /** @type {PoolingClient} */
  let client;
  /** @type {() => void} */
  let stop;
  /** @type {any[]} */
  const seen = [];

  before(async () => {
    ({ client, stop } = await fakeServer({
      Pool: (/** @type {any} */ call, /** @type {Function} */ callback) => {
        const request = call.request;
        seen.push(request);
        if (request.input === 'score') {
          callback(null, { request_id: request.request_id, model: 'm3', score: { scores: request.score.text_2.map(() => 0.5) } });
          return;
        }
        const asked = request.embed_outputs;
        const items = asked.texts.map((/** @type {string} */ _t, /** @type {number} */ i) => textOutputs(asked, i));
        callback(null, { request_id: request.request_id, model: 'm3', embed_outputs: { items } });
      },
      ListModels: (/** @type {any} */ _call, /** @type {Function} */ callback) =>
        callback(null, { models: [M3_CARD], max_client_batch_size: 8 }),
      Rerank: rerankInOrder('m3', seen),
    }));
  });

  after(() => stop?.());

  test('embedOutputs returns each text\'s asked outputs, the others null', async () => {
    const outputs = await client.embedOutputs(['a', 'b'], { requestId: 'o', sparseTopK: 2, returnTokens: true, encoding: 'float16' });
    const request = seen.at(-1);
    assert.equal(request.input, 'embed_outputs');
    assert.equal(request.params.task, 'POOLING_TASK_EMBED_OUTPUTS');
    assert.equal(request.encoding, 'EMBEDDING_ENCODING_FLOAT16');
    assert.deepEqual(
      [request.embed_outputs.dense, request.embed_outputs.sparse, request.embed_outputs.multi, request.embed_outputs.sparse_top_k],
      [true, true, true, 2],
    );
    assert.deepEqual(
      outputs.map((o) => [o.requestId, o.outputs.dense, o.outputs.sparse, o.outputs.multi?.rows, [...(o.outputs.multi?.data ?? [])]]),
      [
        ['o-0', [0, 0, 0, 1], { indices: [7, 3], values: [0.5, 0.25], tokens: ['paris', 'capital'] }, 2, VALUES],
        ['o-1', [1, 0, 0, 1], { indices: [7, 3], values: [0.5, 0.25], tokens: ['paris', 'capital'] }, 2, VALUES],
      ],
    );
    const [only] = await client.embedOutputs('a', { dense: false, multi: false });
    assert.deepEqual([only.outputs.dense, only.outputs.multi, only.outputs.sparse?.indices], [null, null, [7, 3]]);
    await assert.rejects(client.embedOutputs('a', { dense: false, sparse: false, multi: false }), /at least one output/);
  });

  test('score and rerank carry outputWeights; models() shows the outputs', async () => {
    const poolingParams = { outputWeights: { dense: 0.4, sparse: 0.2, multi: 0.4 } };
    await client.score('q', ['d0', 'd1'], { model: 'm3', poolingParams });
    const weights = seen.at(-1).params.output_weights;
    assert.deepEqual([weights.dense, weights.sparse, weights.multi].map((w) => Math.round(w * 10) / 10), [0.4, 0.2, 0.4]);
    await client.rerank('q', ['d0', 'd1'], { model: 'm3', poolingParams: { outputWeights: { sparse: 1 } } });
    assert.deepEqual(seen.at(-1).params.output_weights, { dense: 0, sparse: 1, multi: 0 });
    const [m3] = await client.models();
    assert.ok(m3.tasks.includes('embed_outputs'));
    assert.deepEqual(m3.outputs, ['dense', 'sparse', 'multi']);
  });
});
