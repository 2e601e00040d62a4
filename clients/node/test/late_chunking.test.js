// Late chunking on embed and ModelCard's image and multi-output fields. Without a server:
// request building and checks, and a chunked answer and the newer card fields over an
// in-process grpc-js fake. Against the real server in POOLING_SERVER_ADDRESS (started by
// tests/client/test_node_client.py; skipped with a message without it): chunks by spans and
// by rule on the default model (MiniLM, mean pooling), each equal to the mean of its tokens'
// states from token_embed of the whole text, normalised; a big rule job over PoolStream equal
// to one call per text; the server's refusal of a span past the text.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { ChunkedJob } from '../src/chunking.js';
import { CHUNK_RULES, PoolingClient, PoolingError, lateChunkingToWire } from '../src/index.js';
import { requestTemplate } from '../src/requests.js';
import { ADDRESS, fakeServer, live } from './helpers.js';

const TEXT = 'Late chunking keeps context. Each chunk is pooled from one pass! Is that not neat?';

/**
 * @param {number[]} a
 * @param {number[]} b
 */
function maxAbsDiff(a, b) {
  assert.equal(a.length, b.length);
  return Math.max(...a.map((v, i) => Math.abs(v - b[i])));
}

/** @param {number[]} values */
function normalised(values) {
  const norm = Math.sqrt(values.reduce((sum, v) => sum + v * v, 0));
  return values.map((v) => v / norm);
}

describe('late chunking and the newer card fields without a server', () => {
  test('lateChunkingToWire: spans, rules and their checks', () => {
    assert.deepEqual(lateChunkingToWire('embed', { spans: [[0, 4], [5, 9]] }), {
      spans: [
        { start: 0, end: 4 },
        { start: 5, end: 9 },
      ],
      window_tokens: 0,
      overlap_tokens: 0,
    });
    assert.deepEqual(lateChunkingToWire('embed', { rule: 'tokens', window: 16, overlap: 4 }), {
      spans: [],
      window_tokens: 16,
      overlap_tokens: 4,
      rule: 'CHUNK_RULE_TOKENS',
    });
    assert.equal(lateChunkingToWire('embed', { rule: 'sentences' })?.rule, CHUNK_RULES.sentences);
    assert.equal(lateChunkingToWire('embed', undefined), undefined);
    assert.throws(() => lateChunkingToWire('classify', { rule: 'sentences' }), /applies to embed/);
    assert.throws(() => lateChunkingToWire('embed', { rule: 'paragraphs' }), /rule must be one of/);
    assert.throws(() => lateChunkingToWire('embed', /** @type {any} */ ({ spans: [[0, 1, 2]] })), /pairs/);
    assert.throws(() => lateChunkingToWire('embed', /** @type {any} */ ({ span: [[0, 1]] })), /Unknown lateChunking keys span/);
    assert.throws(() => lateChunkingToWire('embed', /** @type {any} */ ({ rule: 'tokens', window: 1.5 })), /window/);
    // validate: false leaves the judgement to the server.
    assert.equal(lateChunkingToWire('classify', { rule: 'paragraphs' }, false)?.rule, 'paragraphs');
  });

  test('a big rule job keeps late_chunking in every PoolStream chunk', () => {
    const template = requestTemplate('embed', { requestId: 'base' });
    template.late_chunking = lateChunkingToWire('embed', { rule: 'sentences' });
    const job = new ChunkedJob('embed', ['a.', 'b.', 'c.'], template, 2, 2);
    const requests = job.fill().map((r) => r.request);
    assert.deepEqual(
      requests.map((r) => [r.request_id, r.late_chunking.rule, r.embed.texts]),
      [
        ['base-0', 'CHUNK_RULE_SENTENCES', ['a.', 'b.']],
        ['base-1', 'CHUNK_RULE_SENTENCES', ['c.']],
      ],
    );
  });
});

describe('late chunking and the newer card fields over grpc-js', () => {
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
        const chunked = request.embed.texts.map((/** @type {string} */ text) => ({
          chunks: [
            { span: { start: 0, end: 2 }, embedding: { values: [1, 0] } },
            { span: { start: 3, end: text.length }, embedding: { values: [0, 1] } },
          ],
        }));
        callback(null, { request_id: request.request_id, model: 'm', embed: { chunked } });
      },
      ListModels: (/** @type {any} */ _call, /** @type {Function} */ callback) =>
        callback(null, {
          models: [
            { name: 'clip', tasks: ['POOLING_TASK_EMBED'], modalities: ['MODALITY_TEXT', 'MODALITY_IMAGE'], image_size: 224 },
            { name: 'm3', tasks: ['POOLING_TASK_EMBED_OUTPUTS'], outputs: ['dense', 'sparse', 'multi'] },
            { name: 'old', tasks: ['POOLING_TASK_EMBED'] },
          ],
        }),
      Rerank: (/** @type {any} */ _call, /** @type {Function} */ callback) => callback(null, { results: [] }),
    }));
  });

  after(() => stop?.());

  test('embed with lateChunking sends it and returns spans with embeddings per text', async () => {
    const outputs = await client.embed(['ab cd', 'ab cdef'], { lateChunking: { rule: 'sentences' }, requestId: 'c' });
    assert.equal(seen.at(-1).late_chunking.rule, 'CHUNK_RULE_SENTENCES');
    assert.deepEqual(
      outputs.map((o) => [o.requestId, o.outputs]),
      [
        ['c-0', { spans: [[0, 2], [3, 5]], embeddings: [{ embedding: [1, 0] }, { embedding: [0, 1] }] }],
        ['c-1', { spans: [[0, 2], [3, 7]], embeddings: [{ embedding: [1, 0] }, { embedding: [0, 1] }] }],
      ],
    );
    await client.embed('ab cd');
    assert.equal(seen.at(-1).late_chunking, null, 'no late_chunking unless asked');
  });

  test('models() carries modalities, imageSize and outputs', async () => {
    const [clip, m3, old] = await client.models();
    assert.deepEqual([clip.modalities, clip.imageSize, clip.outputs], [['text', 'image'], 224, []]);
    assert.deepEqual([m3.modalities, m3.imageSize, m3.outputs], [['text'], 0, ['dense', 'sparse', 'multi']]);
    assert.deepEqual([old.modalities, old.imageSize, old.outputs], [['text'], 0, []]);
  });
});

describe('late chunking against a live server', () => {
  /** @type {PoolingClient} */
  let client;

  before(() => {
    if (ADDRESS) client = new PoolingClient(ADDRESS, { timeout: 60 });
  });

  after(() => {
    client?.close();
  });

  /**
   * The mean of the token states of `text` whose offsets overlap [start, end), special tokens
   * left out, normalised: what late chunking computes, from token_embed of the whole text.
   * @param {string} text
   * @param {Array<[number, number]>} spans
   */
  async function tokenMeans(text, spans) {
    const [tokens] = await client.encode(text, { poolingTask: 'token_embed', poolingParams: { useActivation: false } });
    const { data, offsets, specialTokensMask } = tokens.outputs;
    return spans.map(([start, end]) => {
      const rows = data.filter((_, i) => !specialTokensMask[i] && offsets[i][0] < end && offsets[i][1] > start);
      assert.ok(rows.length > 0, `no token in [${start}, ${end})`);
      const mean = rows[0].map((_, c) => rows.reduce((sum, row) => sum + row[c], 0) / rows.length);
      return normalised(mean);
    });
  }

  test(
    'spans: one embedding per span, each the mean of its tokens from one pass',
    live(async () => {
      /** @type {Array<[number, number]>} */
      const spans = [
        [0, 28],
        [29, 64],
        [65, TEXT.length],
        [5, 6], // inside one token: that token
      ];
      const [output] = await client.embed(TEXT, { lateChunking: { spans }, requestId: 'lc' });
      assert.equal(output.requestId, 'lc-0');
      const chunked = /** @type {import('../src/outputs.js').ChunkedEmbeddingOutput} */ (output.outputs);
      assert.deepEqual(chunked.spans, spans);
      const want = await tokenMeans(TEXT, spans);
      chunked.embeddings.forEach((embedding, i) => {
        assert.equal(embedding.embedding.length, 384);
        assert.ok(maxAbsDiff(embedding.embedding, want[i]) < 1e-4, `chunk ${i}`);
      });
    }),
  );

  test(
    'rules: sentences equal the same spans given; tokens windows overlap as asked',
    live(async () => {
      const [bySentence] = await client.embed(TEXT, { lateChunking: { rule: 'sentences' } });
      const sentences = /** @type {import('../src/outputs.js').ChunkedEmbeddingOutput} */ (bySentence.outputs);
      assert.deepEqual(sentences.spans, [
        [0, 28],
        [29, 64],
        [65, TEXT.length],
      ]);
      const [bySpan] = await client.embed(TEXT, { lateChunking: { spans: sentences.spans } });
      const given = /** @type {import('../src/outputs.js').ChunkedEmbeddingOutput} */ (bySpan.outputs);
      given.embeddings.forEach((embedding, i) => {
        assert.ok(maxAbsDiff(embedding.embedding, sentences.embeddings[i].embedding) < 1e-5);
      });
      const [byTokens] = await client.embed(TEXT, { lateChunking: { rule: 'tokens', window: 6, overlap: 2 } });
      const windows = /** @type {import('../src/outputs.js').ChunkedEmbeddingOutput} */ (byTokens.outputs);
      assert.ok(windows.spans.length >= 3);
      windows.spans.slice(1).forEach(([start], i) => assert.ok(start < windows.spans[i][1], 'neighbours overlap'));
    }),
  );

  test(
    'a rule over many texts in PoolStream chunks equals one call per text',
    live(async () => {
      const texts = Array.from({ length: 5 }, (_, i) => `Text ${i} begins here. It ends ${'well '.repeat(i)}now.`);
      const small = new PoolingClient(ADDRESS ?? '', { timeout: 60, batchSize: 2 });
      try {
        const outputs = await small.embed(texts, { lateChunking: { rule: 'sentences' }, requestId: 'many' });
        assert.deepEqual(
          outputs.map((o) => o.requestId),
          texts.map((_, i) => `many-${i}`),
        );
        for (const [i, text] of texts.entries()) {
          const [alone] = await client.embed(text, { lateChunking: { rule: 'sentences' } });
          const got = /** @type {import('../src/outputs.js').ChunkedEmbeddingOutput} */ (outputs[i].outputs);
          const want = /** @type {import('../src/outputs.js').ChunkedEmbeddingOutput} */ (alone.outputs);
          assert.deepEqual(got.spans, want.spans);
          got.embeddings.forEach((e, k) => assert.ok(maxAbsDiff(e.embedding, want.embeddings[k].embedding) < 1e-5));
        }
      } finally {
        small.close();
      }
    }),
  );

  test(
    'a span past the text is refused by the server, naming the span',
    live(async () => {
      await assert.rejects(client.embed(TEXT, { lateChunking: { spans: [[0, TEXT.length + 5]] } }), (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.code, grpc.status.INVALID_ARGUMENT);
        assert.equal(error.reason, 'SPAN_OUT_OF_TEXT');
        assert.deepEqual(
          error.fieldViolations.map((v) => v.field),
          ['late_chunking.spans[0]'],
        );
        return true;
      });
    }),
  );
});
