// The newer parts of the contract without a pooling server: embed_multi (ColBERT matrices in
// each encoding), prompts, ModelCard's newer fields and Rerank's instruction, over a tiny
// in-process grpc-js fake so that the real serialization runs both ways. Against real servers
// they are checked by tests/client/test_node_client.py (scripts/contract.js).

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { ChunkedJob } from '../src/chunking.js';
import { PoolingClient, verifyParams } from '../src/index.js';
import { multiVectorOutput } from '../src/outputs.js';
import { requestTemplate, rerankRequest } from '../src/requests.js';
import { fakeServer, rerankInOrder } from './helpers.js';

/** A 2 x 3 matrix and its float16 bytes (each value is exact in half precision). */
const VALUES = [0.5, -0.25, 1, 0.125, 0, -2];
const HALF_BITS = [0x3800, 0xb400, 0x3c00, 0x3000, 0x0000, 0xc000];

/** @param {number[]} values */
function float32Bytes(values) {
  const bytes = Buffer.alloc(4 * values.length);
  values.forEach((value, i) => bytes.writeFloatLE(value, 4 * i));
  return bytes;
}

/** @param {number[]} bits */
function uint16Bytes(bits) {
  const bytes = Buffer.alloc(2 * bits.length);
  bits.forEach((value, i) => bytes.writeUInt16LE(value, 2 * i));
  return bytes;
}

const COLBERT_CARD = {
  name: 'colbert',
  tasks: ['POOLING_TASK_EMBED_MULTI', 'POOLING_TASK_SCORE'],
  hidden_size: 3,
  engines_per_device: 2,
  multi_vector: {
    query_prefix: '[Q] ',
    document_prefix: '[D] ',
    query_length: 12,
    document_length: 20,
    query_expansion: true,
    attend_to_expansion_tokens: false,
    skiplist_words: ['!', '?'],
  },
};
const PLAIN_CARD = {
  name: 'plain',
  tasks: ['POOLING_TASK_EMBED'],
  is_default: true,
  prompts: { query: 'query: ' },
  default_prompt_name: 'query',
  has_calibration_ranges: true,
  calibration_source: 'computed',
  score_template_source: '',
};
const RERANKER_CARD = { name: 'rr', tasks: ['POOLING_TASK_SCORE'], score_template_source: 'score_template.json' };

describe('embed_multi, prompts and instructions without a server', () => {
  test('embed_multi takes truncation only, an encoding and prompts', () => {
    verifyParams({ truncatePromptTokens: 8 }, 'embed_multi');
    assert.throws(() => verifyParams({ useActivation: true }, 'embed_multi'), TypeError);
    assert.throws(() => verifyParams({ dimensions: 2 }, 'embed_multi'), TypeError);
    const template = requestTemplate('embed_multi', { encoding: 'float16', promptName: 'query' });
    assert.equal(template.params.task, 'POOLING_TASK_EMBED_MULTI');
    assert.equal(template.encoding, 'EMBEDDING_ENCODING_FLOAT16');
    assert.equal(template.prompt_name, 'query');
    assert.equal(template.prompt, undefined);
    assert.equal(requestTemplate('embed', { prompt: '' }).prompt, '');
    assert.throws(() => requestTemplate('embed', { promptName: 'query', prompt: 'q: ' }), /not both/);
    assert.throws(() => requestTemplate('classify', { promptName: 'query' }), /prompts apply/);
    assert.throws(() => requestTemplate('score', { prompt: 'x' }), /prompts apply/);
    assert.throws(() => requestTemplate('embed', { promptName: /** @type {any} */ (3) }), TypeError);
    // validate: false leaves the judgement to the server.
    assert.equal(requestTemplate('classify', { promptName: 'query', validate: false }).prompt_name, 'query');
  });

  test('a matrix decodes into one typed array in each encoding', () => {
    const plain = multiVectorOutput({ rows: 2, cols: 3, data: float32Bytes(VALUES), encoding: 'EMBEDDING_ENCODING_UNSPECIFIED' });
    assert.equal(plain.encoding, 'float32');
    assert.ok(plain.data instanceof Float32Array);
    assert.deepEqual([...plain.data], VALUES);
    const half = multiVectorOutput({ rows: 2, cols: 3, data: uint16Bytes(HALF_BITS), encoding: 'EMBEDDING_ENCODING_FLOAT16' });
    assert.deepEqual([half.rows, half.cols, half.encoding, [...half.data]], [2, 3, 'float16', VALUES]);
    const bf16 = multiVectorOutput({
      rows: 1,
      cols: 2,
      data: uint16Bytes([0x3f80, 0xc040]),
      encoding: 'EMBEDDING_ENCODING_BFLOAT16',
    });
    assert.deepEqual([...bf16.data], [1, -3]);
    const empty = multiVectorOutput({ rows: 0, cols: 3, data: Buffer.alloc(0), encoding: 'EMBEDDING_ENCODING_FLOAT32' });
    assert.equal(empty.data.length, 0);
    assert.throws(() => multiVectorOutput({ rows: 2, cols: 3, data: Buffer.alloc(8), encoding: 'EMBEDDING_ENCODING_FLOAT32' }), /24 bytes/);
  });

  test('a big embed_multi job keeps its mode in every PoolStream chunk', () => {
    const texts = ['a', 'b', 'c'];
    const template = requestTemplate('embed_multi', { requestId: 'base', promptName: 'query', encoding: 'float16' });
    const job = new ChunkedJob('embed_multi', texts, template, 2, 2);
    const requests = job.fill().map((r) => r.request);
    assert.deepEqual(
      requests.map((r) => [r.request_id, r.prompt_name, r.encoding, r.embed_multi.texts]),
      [
        ['base-0', 'query', 'EMBEDDING_ENCODING_FLOAT16', ['a', 'b']],
        ['base-1', 'query', 'EMBEDDING_ENCODING_FLOAT16', ['c']],
      ],
    );
    /** @param {string} id @param {number} n */
    const answer = (id, n) => ({
      request_id: id,
      result: 'response',
      response: {
        request_id: id,
        output: 'embed_multi',
        embed_multi: {
          items: Array.from({ length: n }, () => ({ rows: 2, cols: 3, data: uint16Bytes(HALF_BITS), encoding: 'EMBEDDING_ENCODING_FLOAT16' })),
        },
      },
    });
    job.accept(answer('base-1', 1));
    job.accept(answer('base-0', 2));
    assert.deepEqual(
      job.outputs().map((o) => [o.requestId, o.outputs.rows, [...o.outputs.data]]),
      texts.map((_, i) => [`base-${i}`, 2, VALUES]),
    );
  });

  test('rerank sends an instruction only when given one', () => {
    assert.equal(rerankRequest('q', ['d'], { instruction: 'Find the answer' }).instruction, 'Find the answer');
    assert.equal('instruction' in rerankRequest('q', ['d']), false);
    assert.equal(rerankRequest('q', ['d'], { instruction: '' }).instruction, '');
    assert.throws(() => rerankRequest('q', ['d'], { instruction: /** @type {any} */ (1) }), TypeError);
  });
});

describe('embed_multi, ModelCard fields and instruction over grpc-js', () => {
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
        const half = request.encoding === 'EMBEDDING_ENCODING_FLOAT16';
        const items = request.embed_multi.texts.map(() => ({
          rows: 2,
          cols: 3,
          data: half ? uint16Bytes(HALF_BITS) : float32Bytes(VALUES),
          encoding: half ? 'EMBEDDING_ENCODING_FLOAT16' : 'EMBEDDING_ENCODING_FLOAT32',
        }));
        callback(null, { request_id: request.request_id, model: 'colbert', embed_multi: { items } });
      },
      ListModels: (/** @type {any} */ _call, /** @type {Function} */ callback) =>
        callback(null, { models: [PLAIN_CARD, COLBERT_CARD, RERANKER_CARD], max_client_batch_size: 8 }),
      Rerank: rerankInOrder('rr', seen),
    }));
  });

  after(() => stop?.());

  test('encode(embed_multi) sends the mode and returns one matrix per text', async () => {
    const outputs = await client.encode(['a', 'b'], { poolingTask: 'embed_multi', promptName: 'document', requestId: 'm' });
    const request = seen.at(-1);
    assert.equal(request.input, 'embed_multi');
    assert.equal(request.params.task, 'POOLING_TASK_EMBED_MULTI');
    assert.equal(request.prompt_name, 'document');
    assert.deepEqual(
      outputs.map((o) => [o.requestId, o.outputs.rows, o.outputs.cols, o.outputs.encoding, [...o.outputs.data]]),
      [
        ['m-0', 2, 3, 'float32', VALUES],
        ['m-1', 2, 3, 'float32', VALUES],
      ],
    );
    const [half] = await client.encode('q', { poolingTask: 'embed_multi', promptName: 'query', encoding: 'float16' });
    assert.equal(seen.at(-1).encoding, 'EMBEDDING_ENCODING_FLOAT16');
    assert.deepEqual([half.outputs.encoding, [...half.outputs.data]], ['float16', VALUES]);
  });

  test('models() carries every ModelCard field, multiVector null where there is none', async () => {
    const [plain, colbert, reranker] = await client.models();
    assert.deepEqual(colbert.tasks, ['embed_multi', 'score']);
    assert.equal(colbert.enginesPerDevice, 2);
    assert.deepEqual(colbert.multiVector, {
      queryPrefix: '[Q] ',
      documentPrefix: '[D] ',
      queryLength: 12,
      documentLength: 20,
      queryExpansion: true,
      attendToExpansionTokens: false,
      skiplistWords: ['!', '?'],
    });
    assert.equal(plain.multiVector, null);
    assert.equal(plain.enginesPerDevice, 1, 'an unset engines_per_device means one process');
    assert.deepEqual(plain.prompts, { query: 'query: ' });
    assert.equal(plain.defaultPromptName, 'query');
    assert.equal(plain.calibrationSource, 'computed');
    assert.equal(plain.scoreTemplateSource, '');
    assert.equal(reranker.scoreTemplateSource, 'score_template.json');
    for (const key of ['dtype', 'device', 'revision', 'backend', 'precision', 'backendFile']) {
      assert.equal(plain[key], '', key);
    }
  });

  test('rerank carries its instruction on the wire', async () => {
    await client.rerank('q', ['d0', 'd1'], { model: 'rr', instruction: 'Judge relevance' });
    assert.equal(seen.at(-1).instruction, 'Judge relevance');
    await client.rerank('q', ['d0'], { model: 'rr' });
    assert.equal(seen.at(-1).instruction, undefined);
  });
});
