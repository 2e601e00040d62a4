// client.rerank: request building and response checks without a server, and rankings against a
// real server whose address is in POOLING_SERVER_ADDRESS (skipped, saying so, without it).

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { PoolingClient, PoolingError } from '../src/index.js';
import { rerankOutput } from '../src/outputs.js';
import { rerankRequest } from '../src/requests.js';
import { ADDRESS, live } from './helpers.js';

const QUERY = 'what is the capital of france?';
const DOCUMENTS = [
  'Berlin is a city in Germany.',
  'Paris is the capital of France.',
  'Cooking pasta al dente takes ten minutes.',
  "France's capital is Paris, on the Seine.",
  '',
];

describe('rerank without a server', () => {
  test('rerankRequest builds the wire request with score params', () => {
    const request = rerankRequest(QUERY, DOCUMENTS, {
      topN: 2,
      returnDocuments: true,
      poolingParams: { useActivation: false },
      truncatePromptTokens: 16,
      model: 'm',
      requestId: 'r',
    });
    assert.deepEqual(
      { ...request, params: undefined },
      {
        request_id: 'r',
        model: 'm',
        query: QUERY,
        documents: DOCUMENTS,
        top_n: 2,
        return_documents: true,
        params: undefined,
      },
    );
    assert.equal(request.params.task, 'POOLING_TASK_SCORE');
    assert.equal(request.params.use_activation, false);
    assert.equal(request.params.truncate_prompt_tokens, 16);
    const defaults = rerankRequest(QUERY, 'one document');
    assert.deepEqual(defaults.documents, ['one document']);
    assert.equal(defaults.top_n, 0);
    assert.equal(defaults.return_documents, false);
    assert.ok(defaults.request_id.length > 0);
  });

  test('rerankRequest refuses obvious mistakes before sending', () => {
    assert.throws(() => rerankRequest(QUERY, DOCUMENTS, { topN: -1 }), RangeError);
    assert.throws(() => rerankRequest(QUERY, DOCUMENTS, { topN: 1.5 }), RangeError);
    assert.throws(() => rerankRequest(QUERY, DOCUMENTS, { poolingParams: { dimensions: 8 } }), TypeError);
    assert.throws(() => rerankRequest(QUERY, ['ok', /** @type {any} */ (3)]), TypeError);
    assert.throws(() => rerankRequest(/** @type {any} */ (['q']), DOCUMENTS), TypeError);
    // validate: false leaves the params to the server.
    const unchecked = rerankRequest(QUERY, DOCUMENTS, { poolingParams: { dimensions: 8 }, validate: false });
    assert.equal(unchecked.params.dimensions, 8);
  });

  /** @param {number[]} indices @param {string} [document] */
  const response = (indices, document) => ({
    request_id: 'r',
    model: 'm',
    results: indices.map((index, k) => ({ index, relevance_score: 1 - k / 10, ...(document === undefined ? {} : { document }) })),
    usage: { prompt_tokens: 9, total_tokens: 9 },
  });

  test('rerankOutput converts a response', () => {
    assert.deepEqual(rerankOutput(response([2, 0], ''), 3, 2), {
      requestId: 'r',
      model: 'm',
      results: [
        { index: 2, relevanceScore: 1, document: '' },
        { index: 0, relevanceScore: 0.9, document: '' },
      ],
      usage: { promptTokens: 9, totalTokens: 9, cachedTokens: 0 },
    });
    assert.deepEqual(
      rerankOutput(response([1, 0]), 2, 0).results.map((r) => r.document),
      [null, null],
    );
  });

  test('rerankOutput refuses a response that does not answer the request', () => {
    for (const [indices, documents, topN] of [
      [[0], 2, 0],
      [[0, 0], 2, 0],
      [[0, 2], 2, 0],
      [[0, 1], 3, 1],
      [[-1], 1, 0],
    ]) {
      assert.throws(() => rerankOutput(response(/** @type {number[]} */ (indices)), /** @type {number} */ (documents), /** @type {number} */ (topN)), /does not rank/);
    }
  });
});

// The tiny cross-encoder's scores lie near 0.5, the closest two 1.2e-6 apart.
const ATOL = 5e-7;

/**
 * The ranking is score()'s order but for documents whose scores differ by float noise: each
 * result has its score() score, results are sorted (ties by index), and the k-th result scores
 * as score()'s k-th best.
 * @param {import('../src/outputs.js').RerankResult[]} results
 * @param {number[]} order document indices by decreasing score()
 * @param {number[]} scores score() per document
 */
function checkRanking(results, order, scores) {
  results.forEach((r, k) => {
    assert.ok(Math.abs(r.relevanceScore - scores[r.index]) < ATOL, `${r.relevanceScore} vs ${scores[r.index]}`);
    assert.ok(Math.abs(scores[r.index] - scores[order[k]]) < ATOL);
    if (k > 0) {
      const previous = results[k - 1];
      assert.ok(previous.relevanceScore > r.relevanceScore || (previous.relevanceScore === r.relevanceScore && previous.index < r.index));
    }
  });
}

describe('rerank against a live server', () => {
  /** @type {PoolingClient} */
  let client;

  before(() => {
    if (ADDRESS) client = new PoolingClient(ADDRESS, { timeout: 60 });
  });

  after(() => {
    client?.close();
  });

  for (const model of ['tiny-cross-encoder', 'tiny-st-mean']) {
    test(
      `rerank on ${model}: the order of score(), top_n and documents`,
      live(async () => {
        const scores = (await client.score(QUERY, DOCUMENTS, { model })).map((o) => o.outputs.score);
        const order = scores.map((_, i) => i).sort((a, b) => scores[b] - scores[a] || a - b);
        const all = await client.rerank(QUERY, DOCUMENTS, { model, requestId: 'node-rerank' });
        assert.equal(all.requestId, 'node-rerank');
        assert.equal(all.model, model);
        checkRanking(all.results, order, scores);
        for (const r of all.results) assert.equal(r.document, null);
        assert.ok(all.usage.promptTokens > 0);
        assert.equal(all.usage.totalTokens, all.usage.promptTokens);
        const best = await client.rerank(QUERY, DOCUMENTS, { model, topN: 2, returnDocuments: true });
        assert.equal(best.results.length, 2);
        checkRanking(best.results, order, scores);
        assert.deepEqual(
          best.results.map((r) => r.document),
          best.results.map((r) => DOCUMENTS[r.index]),
        );
        const more = await client.rerank(QUERY, DOCUMENTS, { model, topN: 50 });
        assert.equal(more.results.length, DOCUMENTS.length);
      }),
    );
  }

  test(
    'rerank errors carry the reason and field path',
    live(async () => {
      await assert.rejects(client.rerank(QUERY, [], { model: 'tiny-cross-encoder' }), (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.codeName, 'INVALID_ARGUMENT');
        assert.equal(error.reason, 'EMPTY_INPUT');
        assert.deepEqual(
          error.fieldViolations.map((v) => v.field),
          ['documents'],
        );
        return true;
      });
      await assert.rejects(client.rerank(QUERY, DOCUMENTS, { model: 'tiny-classifier' }), (error) => {
        assert.ok(error instanceof PoolingError);
        assert.equal(error.codeName, 'FAILED_PRECONDITION');
        assert.equal(error.reason, 'TASK_NOT_SUPPORTED');
        return true;
      });
    }),
  );
});
