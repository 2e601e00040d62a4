// Audio clips from the Node client without a pooling server: Buffers of WAV, FLAC or OGG
// bytes become Item.audio beside texts (embed, classify with zero-shot labels, score,
// rerank), over a tiny in-process grpc-js fake so that the real serialization runs both
// ways. Against a real server the Python client's served test
// (tests/client/test_client_audio.py) checks the same contract.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { PoolingClient } from '../src/index.js';
import { asInputs, inputMessage, isAudio, rerankRequest, scoreTexts } from '../src/requests.js';
import { fakeServer, rerankInOrder } from './helpers.js';

// Only the signatures matter to the client: the server decodes and bounds the clip.
const WAV = Buffer.concat([Buffer.from('RIFF'), Buffer.from([36, 0, 0, 0]), Buffer.from('WAVEfmt ')]);
const FLAC = Buffer.concat([Buffer.from('fLaC'), Buffer.alloc(8)]);
const OGG = Buffer.concat([Buffer.from('OggS'), Buffer.alloc(8)]);
const PNG = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 1, 2, 3]);

describe('audio inputs without a server', () => {
  test('WAV, FLAC and OGG bytes become Item.audio; other bytes stay images', () => {
    assert.ok([WAV, FLAC, OGG].every(isAudio));
    assert.ok(!isAudio(PNG) && !isAudio(Buffer.from('RIFF....WEBP')));
    const items = asInputs(['a', WAV, FLAC, OGG, PNG]);
    assert.deepEqual(items, [
      { text: 'a' },
      { audio: { data: WAV } },
      { audio: { data: FLAC } },
      { audio: { data: OGG } },
      { image: { data: PNG } },
    ]);
    assert.deepEqual(inputMessage('embed', items), { items });
  });

  test('score sends items on both sides once one holds a clip; rerank sends items', () => {
    const [one, two] = scoreTexts('a dog', [WAV, 'rain']);
    assert.deepEqual(inputMessage('score', [one, two]), {
      items_1: [{ text: 'a dog' }],
      items_2: [{ audio: { data: WAV } }, { text: 'rain' }],
    });
    const request = rerankRequest('a dog', [FLAC, 'rain']);
    assert.equal(request.documents, undefined);
    assert.deepEqual(request.items[0], { audio: { data: FLAC } });
  });
});

describe('audio over grpc-js', () => {
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
        if (request.input === 'classify') {
          const labels = request.classify.candidate_labels;
          const classifications = request.classify.items.map(() => ({
            probs: labels.map(() => 1 / labels.length),
            label_id: 0,
            label: labels[0],
            modality: 'MODALITY_AUDIO',
          }));
          callback(null, { request_id: id, model: 'clap', classify: { classifications } });
        } else {
          const embeddings = request.embed.items.map((/** @type {any} */ item) => ({
            values: item.audio ? [item.audio.data.length, 0] : [0, 1],
            modality: item.audio ? 'MODALITY_AUDIO' : 'MODALITY_TEXT',
          }));
          callback(null, { request_id: id, model: 'clap', embed: { embeddings } });
        }
      },
      ListModels: (/** @type {any} */ _call, /** @type {Function} */ callback) =>
        callback(null, { models: [{ name: 'clap', modalities: ['MODALITY_TEXT', 'MODALITY_AUDIO'] }], max_client_batch_size: 8 }),
      Rerank: rerankInOrder('clap', seen),
    }));
  });

  after(() => stop?.());

  test('embed sends the Buffer bytes as Item.audio', async () => {
    const outputs = await client.embed(['a dog', OGG], { model: 'clap' });
    const request = seen.at(-1);
    assert.deepEqual([...request.embed.items[1].audio.data], [...OGG]);
    assert.equal(request.embed.items[0].text, 'a dog');
    assert.deepEqual(
      outputs.map((o) => [o.outputs.embedding, o.outputs.modality]),
      [
        [[0, 1], 'text'],
        [[OGG.length, 0], 'audio'],
      ],
    );
  });

  test('classify sends candidate labels over clips; the card lists audio', async () => {
    const [only] = await client.classify([WAV], { model: 'clap', candidateLabels: ['dog', 'rain'] });
    assert.deepEqual(seen.at(-1).classify.candidate_labels, ['dog', 'rain']);
    assert.equal(only.outputs.modality, 'audio');
    const [card] = await client.models();
    assert.deepEqual(card.modalities, ['text', 'audio']);
  });
});
