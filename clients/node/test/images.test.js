// Images from the Node client without a pooling server: Buffers become Item.image beside
// texts (embed, classify with zero-shot labels, score, rerank), over a tiny in-process
// grpc-js fake so that the real serialization runs both ways. Against a real server the
// Python client's served test (tests/client/test_client_images.py) checks the same contract.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { PoolingClient } from '../src/index.js';
import { asInputs, inputMessage, rerankRequest, scoreTexts } from '../src/requests.js';
import { fakeServer, rerankInOrder } from './helpers.js';

const PNG = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 1, 2, 3]);

describe('image inputs without a server', () => {
  test('texts stay texts; one Buffer makes every input an Item', () => {
    assert.deepEqual(asInputs(['a', 'b']), ['a', 'b']);
    const items = asInputs(['a', PNG]);
    assert.deepEqual(items, [{ text: 'a' }, { image: { data: PNG } }]);
    assert.deepEqual(asInputs(PNG), [{ image: { data: PNG } }]);
    assert.deepEqual(inputMessage('embed', items), { items });
    assert.deepEqual(inputMessage('embed', ['a']), { texts: ['a'] });
    assert.throws(() => asInputs(['a', PNG, 3]), TypeError);
  });

  test('score sends items on both sides once one holds an image; rerank sends items', () => {
    const [one, two] = scoreTexts('a cat', [PNG, 'a dog']);
    assert.deepEqual(inputMessage('score', [one, two]), {
      items_1: [{ text: 'a cat' }],
      items_2: [{ image: { data: PNG } }, { text: 'a dog' }],
    });
    const request = rerankRequest('a cat', [PNG, 'a dog']);
    assert.equal(request.documents, undefined);
    assert.equal(request.items.length, 2);
    assert.deepEqual(rerankRequest('q', ['d']).documents, ['d']);
  });
});

describe('images over grpc-js', () => {
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
        const id = request.request_id;
        if (request.input === 'score') {
          const scores = request.score.items_2.map(() => 0.5);
          callback(null, { request_id: id, model: 'clip', score: { scores } });
        } else if (request.input === 'classify') {
          const labels = request.classify.candidate_labels;
          const classifications = request.classify.items.map(() => ({
            probs: labels.map(() => 1 / labels.length),
            label_id: 0,
            label: labels[0],
            modality: 'MODALITY_IMAGE',
          }));
          callback(null, { request_id: id, model: 'clip', classify: { classifications } });
        } else {
          const embeddings = request.embed.items.map((/** @type {any} */ item) => ({
            values: item.image ? [item.image.data.length, 0] : [0, 1],
            modality: item.image ? 'MODALITY_IMAGE' : 'MODALITY_TEXT',
          }));
          callback(null, { request_id: id, model: 'clip', embed: { embeddings } });
        }
      },
      ListModels: (/** @type {any} */ _call, /** @type {Function} */ callback) =>
        callback(null, { models: [{ name: 'clip', modalities: ['MODALITY_TEXT', 'MODALITY_IMAGE'] }], max_client_batch_size: 8 }),
      Rerank: rerankInOrder('clip', seen),
    }));
  });

  after(() => stop?.());

  test('embed sends the Buffer bytes as Item.image', async () => {
    const outputs = await client.embed(['a cat', PNG], { model: 'clip' });
    const request = seen.at(-1);
    assert.deepEqual(request.embed.texts, []);
    assert.deepEqual([...request.embed.items[1].image.data], [...PNG]);
    assert.equal(request.embed.items[0].text, 'a cat');
    assert.deepEqual(
      outputs.map((o) => [o.outputs.embedding, o.outputs.modality]),
      [
        [[0, 1], 'text'],
        [[PNG.length, 0], 'image'],
      ],
    );
  });

  test('classify sends candidate labels and the template; score and rerank send items', async () => {
    const [only] = await client.classify([PNG], { model: 'clip', candidateLabels: ['cat', 'dog'], labelTemplate: 'a {label}' });
    const request = seen.at(-1);
    assert.deepEqual(request.classify.candidate_labels, ['cat', 'dog']);
    assert.equal(request.classify.label_template, 'a {label}');
    assert.equal(only.outputs.label, 'cat');
    assert.equal(only.outputs.modality, 'image');
    const scores = await client.score('a cat', [PNG, 'a dog'], { model: 'clip' });
    assert.equal(scores.length, 2);
    assert.equal(seen.at(-1).score.items_1[0].text, 'a cat');
    const ranked = await client.rerank('a cat', [PNG, PNG], { model: 'clip' });
    assert.deepEqual(
      ranked.results.map((r) => r.index),
      [0, 1],
    );
  });
});
