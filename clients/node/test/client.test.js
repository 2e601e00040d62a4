// Tests against a real pooling server whose address is in POOLING_SERVER_ADDRESS (the Python
// test tests/client/test_node_client.py starts one and runs these). Without it every test
// here is skipped with a message saying so.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { PoolingClient, PoolingError } from '../src/index.js';
import { ADDRESS, live } from './helpers.js';

const DEFAULT_MODEL = 'sentence-transformers/all-MiniLM-L6-v2';

/** @type {PoolingClient} */
let client;

/** @param {number[]} values */
const norm = (values) => Math.sqrt(values.reduce((sum, v) => sum + v * v, 0));
/**
 * Largest absolute difference between two vectors (batching changes the last float bits).
 * @param {number[]} a
 * @param {number[]} b
 */
function maxAbsDiff(a, b) {
  assert.equal(a.length, b.length);
  return Math.max(...a.map((v, i) => Math.abs(v - b[i])));
}
/** @param {number[]} values */
const sum = (values) => values.reduce((total, v) => total + v, 0);

describe('PoolingClient against a live server', () => {
  before(() => {
    if (ADDRESS) client = new PoolingClient(ADDRESS, { timeout: 60 });
  });

  after(() => {
    client?.close();
  });

  test(
    'embed: one 384-dim unit-norm vector per text on the default model',
    live(async () => {
      const texts = ['Hello world', 'How are you?', 'The quick brown fox'];
      const outputs = await client.embed(texts, { requestId: 'node-embed' });
      assert.equal(outputs.length, texts.length);
      outputs.forEach((output, i) => {
        assert.equal(output.requestId, `node-embed-${i}`);
        assert.equal(output.outputs.embedding.length, 384);
        assert.ok(Math.abs(norm(output.outputs.embedding) - 1) < 1e-4, `norm ${norm(output.outputs.embedding)}`);
      });
      assert.notDeepEqual(outputs[0].outputs.embedding, outputs[1].outputs.embedding);
      const [single] = await client.embed('Hello world');
      assert.ok(maxAbsDiff(single.outputs.embedding, outputs[0].outputs.embedding) < 1e-5);
    }),
  );

  test(
    'embed and token_embed: every float and bit encoding decodes close to the float32 values',
    live(async () => {
      const texts = ['Hello world', 'Compact embeddings travel as packed bytes'];
      const reference = (await client.embed(texts)).map((o) => o.outputs.embedding);
      /** @type {Array<[string, number]>} relative error bound of each float encoding */
      const floats = [
        ['float32', 1e-6],
        ['float16', 2 ** -11],
        ['bfloat16', 2 ** -8],
      ];
      for (const [encoding, relative] of floats) {
        const outputs = await client.embed(texts, { encoding });
        outputs.forEach((output, i) => {
          assert.equal(output.outputs.encoding, encoding);
          assert.equal(output.outputs.dimensions, 384);
          output.outputs.embedding.forEach((v, j) => {
            const expected = reference[i][j];
            assert.ok(Math.abs(v - expected) <= Math.abs(expected) * relative + 1e-6, `${encoding}[${i}][${j}]: ${v} vs ${expected}`);
          });
        });
      }
      for (const encoding of ['binary', 'ubinary']) {
        const outputs = await client.embed(texts, { encoding });
        outputs.forEach((output, i) => {
          assert.equal(output.outputs.embedding.length, 48);
          const bytes = output.outputs.embedding.map((b) => (encoding === 'binary' ? b + 128 : b));
          reference[i].forEach((v, j) => {
            const bit = (bytes[j >> 3] >> (7 - (j & 7))) & 1;
            if (Math.abs(v) > 1e-6) assert.equal(bit, v > 0 ? 1 : 0, `${encoding}[${i}] bit ${j}`);
          });
        });
      }
      const [tokens] = await client.encode(texts[0], { encoding: 'float16' });
      const [tokensRef] = await client.encode(texts[0]);
      assert.equal(tokens.outputs.encoding, 'float16');
      assert.equal(tokens.outputs.data.length, tokensRef.outputs.data.length);
      tokens.outputs.data.forEach((row, r) => {
        assert.equal(row.length, 384);
        row.forEach((v, j) => {
          const expected = tokensRef.outputs.data[r][j];
          assert.ok(Math.abs(v - expected) <= Math.abs(expected) * 2 ** -11 + 1e-6);
        });
      });
    }),
  );

  test(
    'embed: int8 on a model that ships no calibration ranges uses the ranges computed at load',
    live(async () => {
      const [output] = await client.embed('x', { encoding: 'int8' });
      assert.equal(output.outputs.encoding, 'int8');
      assert.equal(output.outputs.embedding.length, 384);
      assert.ok(output.outputs.embedding.every((v) => Number.isInteger(v) && v >= -128 && v <= 127));
      const [again] = await client.embed(['x', 'another text beside it'], { encoding: 'int8' });
      assert.deepEqual(Array.from(again.outputs.embedding), Array.from(output.outputs.embedding));
      // The ranges cover the full width: int8 of fewer dimensions is refused, with the field path.
      const options = { model: 'minilm-matryoshka', encoding: 'int8', poolingParams: { dimensions: 128 } };
      await assert.rejects(client.embed('x', options), (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.codeName, 'INVALID_ARGUMENT');
        assert.equal(error.reason, 'CALIBRATION_RANGES_DIMENSIONS');
        assert.equal(error.fieldViolations[0].field, 'encoding');
        return true;
      });
    }),
  );

  test(
    'embed: useActivation false skips normalisation',
    live(async () => {
      const [raw] = await client.embed(['Hello world'], { poolingParams: { useActivation: false } });
      assert.equal(raw.outputs.embedding.length, 384);
      assert.ok(Math.abs(norm(raw.outputs.embedding) - 1) > 1e-3);
    }),
  );

  test(
    'embed: a job bigger than the server batch limit is chunked over PoolStream, in order',
    live(async () => {
      const texts = Array.from({ length: 70 }, (_, i) => `sentence number ${i}`);
      const outputs = await client.embed(texts, { requestId: 'big' });
      assert.equal(outputs.length, 70);
      assert.deepEqual(
        outputs.map((o) => o.requestId),
        texts.map((_, i) => `big-${i}`),
      );
      const [last] = await client.embed(texts[69]);
      assert.ok(maxAbsDiff(outputs[69].outputs.embedding, last.outputs.embedding) < 1e-5);
    }),
  );

  test(
    'classify: tiny-classifier probabilities over negative/neutral/positive',
    live(async () => {
      const outputs = await client.classify(['I love it', 'I hate it'], { model: 'tiny-classifier' });
      assert.equal(outputs.length, 2);
      for (const { outputs: result } of outputs) {
        assert.equal(result.probs.length, 3);
        assert.ok(Math.abs(sum(result.probs) - 1) < 1e-5, `probs sum ${sum(result.probs)}`);
        assert.ok(['negative', 'neutral', 'positive'].includes(result.label));
        assert.equal(result.labelId, result.probs.indexOf(Math.max(...result.probs)));
        assert.equal(result.label, ['negative', 'neutral', 'positive'][result.labelId]);
      }
    }),
  );

  test(
    'score: 1:N, N:N and pairs on tiny-cross-encoder',
    live(async () => {
      const docs = ['Paris is the capital of France', 'Bananas are yellow', 'The Eiffel tower'];
      const oneToN = await client.score('What is the capital of France?', docs, { model: 'tiny-cross-encoder' });
      assert.equal(oneToN.length, docs.length);
      for (const { outputs } of oneToN) {
        assert.equal(typeof outputs.score, 'number');
        assert.ok(Number.isFinite(outputs.score));
      }
      const queries = docs.map(() => 'What is the capital of France?');
      const nToN = await client.score(queries, docs, { model: 'tiny-cross-encoder' });
      const pairs = await client.score(
        docs.map((doc) => ['What is the capital of France?', doc]),
        { model: 'tiny-cross-encoder' },
      );
      for (let i = 0; i < docs.length; i += 1) {
        assert.ok(Math.abs(nToN[i].outputs.score - oneToN[i].outputs.score) < 1e-5);
        assert.ok(Math.abs(pairs[i].outputs.score - oneToN[i].outputs.score) < 1e-5);
      }
    }),
  );

  test(
    'encode token_embed on tiny-bert: one row per token with offsets',
    live(async () => {
      const text = 'hello world';
      const [output] = await client.encode([text], { model: 'tiny-bert', poolingTask: 'token_embed' });
      const { data, tokenIds, offsets, specialTokensMask, labelIds, labels } = output.outputs;
      const [tokenized] = await client.tokenize([text], { model: 'tiny-bert' });
      assert.equal(data.length, tokenized.tokenIds.length);
      assert.deepEqual(tokenIds, tokenized.tokenIds);
      assert.deepEqual(offsets, tokenized.offsets);
      assert.equal(offsets.length, data.length);
      assert.equal(specialTokensMask.length, data.length);
      assert.equal(specialTokensMask[0], true);
      assert.equal(specialTokensMask.at(-1), true);
      assert.deepEqual(offsets[0], [0, 0]);
      const cols = data[0].length;
      assert.ok(cols > 0);
      for (const row of data) assert.equal(row.length, cols);
      for (let i = 0; i < data.length; i += 1) {
        const [start, end] = offsets[i];
        if (!specialTokensMask[i]) assert.ok(start < end && end <= text.length);
      }
      assert.deepEqual(labelIds, []);
      assert.deepEqual(labels, []);
    }),
  );

  test(
    'encode token_classify on tiny-ner: a label per token from 5 labels',
    live(async () => {
      const [output] = await client.encode(['John lives in Berlin'], {
        model: 'tiny-ner',
        poolingTask: 'token_classify',
      });
      const { data, labelIds, labels, tokenIds } = output.outputs;
      const [card] = (await client.models()).filter((model) => model.name === 'tiny-ner');
      assert.equal(card.labels.length, 5);
      assert.equal(data.length, tokenIds.length);
      assert.equal(labelIds.length, data.length);
      assert.equal(labels.length, data.length);
      data.forEach((row, i) => {
        assert.equal(row.length, 5);
        assert.ok(Math.abs(sum(row) - 1) < 1e-5);
        assert.equal(labelIds[i], row.indexOf(Math.max(...row)));
        assert.equal(labels[i], card.labels[labelIds[i]]);
      });
    }),
  );

  test(
    'models: the default model first, with its capabilities',
    live(async () => {
      const models = await client.models();
      const names = models.map((model) => model.name);
      assert.equal(models[0].name, DEFAULT_MODEL);
      assert.equal(models[0].isDefault, true);
      assert.equal(models[0].hiddenSize, 384);
      assert.ok(models[0].tasks.includes('embed'));
      for (const name of ['tiny-classifier', 'tiny-cross-encoder', 'tiny-bert', 'tiny-ner']) {
        assert.ok(names.includes(name), `${name} in ${names}`);
      }
      const classifier = models.find((model) => model.name === 'tiny-classifier');
      assert.deepEqual(classifier?.labels, ['negative', 'neutral', 'positive']);
      assert.ok(classifier?.tasks.includes('classify'));
      assert.ok(client.limits !== null && client.limits.maxClientBatchSize > 0);
      for (const model of models) {
        assert.ok(model.enginesPerDevice >= 1, model.name);
        assert.equal(model.multiVector, null, model.name);
        assert.equal(model.scoreTemplateSource, '', model.name);
        assert.equal(typeof model.prompts, 'object');
        assert.equal(typeof model.calibrationSource, 'string');
        assert.ok(model.device.length > 0 && model.backend.length > 0, model.name);
      }
      assert.equal(models[0].dtype, 'float32'); // the test server runs --dtype float32
    }),
  );

  test(
    'embed: a prompt is prepended to every text on the server',
    live(async () => {
      const [prompted] = await client.embed('Hello world', { prompt: 'query: ' });
      const [written] = await client.embed('query: Hello world');
      const [plain] = await client.embed('Hello world');
      const diff = (/** @type {number[]} */ a, /** @type {number[]} */ b) => Math.max(...a.map((x, i) => Math.abs(x - b[i])));
      assert.ok(diff(prompted.outputs.embedding, written.outputs.embedding) < 1e-5);
      assert.ok(diff(prompted.outputs.embedding, plain.outputs.embedding) > 1e-3);
      await assert.rejects(client.embed('x', { promptName: 'no-such-prompt' }), PoolingError);
    }),
  );

  test(
    'tokenize: token ids, strings and offsets, with and without special tokens',
    live(async () => {
      const [withSpecial] = await client.tokenize('Hello world');
      assert.deepEqual(withSpecial.tokens, ['[CLS]', 'hello', 'world', '[SEP]']);
      assert.equal(withSpecial.tokenIds.length, 4);
      assert.deepEqual(withSpecial.offsets, [
        [0, 0],
        [0, 5],
        [6, 11],
        [0, 0],
      ]);
      const [bare] = await client.tokenize(['Hello world'], { addSpecialTokens: false });
      assert.deepEqual(bare.tokens, ['hello', 'world']);
    }),
  );

  test(
    'errors: an unknown model is NOT_FOUND with reason MODEL_NOT_FOUND',
    live(async () => {
      await assert.rejects(client.embed(['x'], { model: 'no-such-model' }), (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.code, 5);
        assert.equal(error.codeName, 'NOT_FOUND');
        assert.equal(error.reason, 'MODEL_NOT_FOUND');
        assert.equal(error.domain, 'pooling.v1');
        return true;
      });
    }),
  );

  test(
    'errors: dimensions on a non-matryoshka model is DIMENSIONS_NOT_SUPPORTED on params.dimensions',
    live(async () => {
      // The client-side check allows dimensions for embed (whether the model is matryoshka is
      // the server's call), so this reaches the server; validate: false is shown for clarity.
      const call = client.embed(['x'], { poolingParams: { dimensions: 8 }, validate: false });
      await assert.rejects(call, (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.code, 3);
        assert.equal(error.codeName, 'INVALID_ARGUMENT');
        assert.equal(error.reason, 'DIMENSIONS_NOT_SUPPORTED');
        assert.equal(error.fieldViolations[0].field, 'params.dimensions');
        return true;
      });
    }),
  );

  test(
    'errors: params the task does not take are sent with validate: false, rejected by the server',
    live(async () => {
      await assert.rejects(
        client.classify(['x'], { model: 'tiny-classifier', poolingParams: { dimensions: 2 } }),
        TypeError,
      );
      await assert.rejects(
        client.classify(['x'], { model: 'tiny-classifier', poolingParams: { dimensions: 2 }, validate: false }),
        (error) => {
          assert.ok(error instanceof PoolingError);
          assert.equal(error.codeName, 'INVALID_ARGUMENT');
          assert.ok(error.fieldViolations.some((v) => v.field === 'params.dimensions'));
          return true;
        },
      );
    }),
  );

  test(
    'errors: the raw stub gets the same rich details',
    live(async () => {
      const request = { request_id: 'raw', model: '', params: { dimensions: 8 }, embed: { texts: ['x'] } };
      await assert.rejects(client.rawCall('Pool', request), (error) => {
        assert.equal(error.reason, 'DIMENSIONS_NOT_SUPPORTED');
        assert.equal(error.fieldViolations[0].field, 'params.dimensions');
        return true;
      });
    }),
  );

  test(
    'errors: an in-band PoolStream failure rejects with its details',
    live(async () => {
      const texts = Array.from({ length: 70 }, (_, i) => `text ${i}`);
      texts[50] = 'word '.repeat(1000);
      await assert.rejects(client.embed(texts), (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.codeName, 'INVALID_ARGUMENT');
        assert.equal(error.reason, 'INPUT_TOO_LONG');
        assert.match(error.fieldViolations[0].field, /^embed\.texts\[\d+\]$/);
        return true;
      });
    }),
  );

  test(
    'apiKey and metadata are sent without upsetting an open server',
    live(async () => {
      const other = new PoolingClient([ADDRESS], {
        apiKey: 'secret',
        metadata: () => ({ 'x-request-source': 'node-test' }),
        model: 'tiny-classifier',
        timeout: 30,
      });
      try {
        const [output] = await other.classify('fine');
        assert.equal(output.outputs.probs.length, 3);
      } finally {
        other.close();
      }
    }),
  );
});
