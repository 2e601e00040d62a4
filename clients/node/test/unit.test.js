// Unit tests that need no pooling server: parameter checks, request shapes, error decoding,
// chunk planning, and the wire behaviour against a tiny in-process grpc-js fake server.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { ChunkedJob, chunkSize, chunksInFlight, needsLimits } from '../src/chunking.js';
import { PoolingClient, PoolingError, channelTarget, paramsToWire, verifyParams } from '../src/index.js';
import { errorTypes } from '../src/proto.js';
import { bfloat16ToNumber, decodeValues, encodingName, float16ToNumber } from '../src/encodings.js';
import { convertOutputs } from '../src/outputs.js';
import { requestTemplate, scoreTexts, splitSep } from '../src/requests.js';
import { fakeServer } from './helpers.js';

/**
 * A serialized google.rpc.Status carrying ErrorInfo, BadRequest and RetryInfo details.
 * @returns {Buffer}
 */
function richStatusBytes() {
  const root = errorTypes();
  /** @param {string} name @param {object} value */
  const pack = (name, value) => {
    const type = root.lookupType(name);
    return { type_url: `type.googleapis.com/${name}`, value: type.encode(type.fromObject(value)).finish() };
  };
  const Status = root.lookupType('google.rpc.Status');
  const status = Status.fromObject({
    code: 3,
    message: 'bad dimensions',
    details: [
      pack('google.rpc.ErrorInfo', { reason: 'DIMENSIONS_NOT_SUPPORTED', domain: 'pooling.v1', metadata: { model: 'm' } }),
      pack('google.rpc.BadRequest', {
        field_violations: [{ field: 'params.dimensions', description: 'not matryoshka', reason: 'DIMENSIONS_NOT_SUPPORTED' }],
      }),
      pack('google.rpc.RetryInfo', { retry_delay: { seconds: 1, nanos: 500_000_000 } }),
      { type_url: 'type.googleapis.com/some.Unknown', value: Buffer.from([1, 2, 3]) },
    ],
  });
  return Buffer.from(Status.encode(status).finish());
}

describe('PoolingParams checks', () => {
  test('the task/parameter table matches vLLM', () => {
    verifyParams({ useActivation: true, dimensions: 8, truncatePromptTokens: -1 }, 'embed');
    verifyParams({ useActivation: false, dimensions: 8 }, 'token_embed');
    for (const task of ['classify', 'score', 'token_classify']) {
      verifyParams({ useActivation: true, truncatePromptTokens: 5 }, task);
      assert.throws(() => verifyParams({ dimensions: 8 }, task), TypeError);
    }
  });

  test('bad values and keys are rejected locally', () => {
    assert.throws(() => verifyParams({ dimensions: 0 }, 'embed'), RangeError);
    assert.throws(() => verifyParams({ dimensions: 1.5 }, 'embed'), TypeError);
    assert.throws(() => verifyParams({ truncatePromptTokens: 0 }, 'embed'), RangeError);
    assert.throws(() => verifyParams({ truncatePromptTokens: -2 }, 'embed'), RangeError);
    assert.throws(() => verifyParams({ useActivation: 'yes' }, 'embed'), TypeError);
    assert.throws(() => verifyParams({ use_activation: true }, 'embed'), TypeError);
    assert.throws(() => verifyParams({ task: 'classify' }, 'embed'), TypeError);
    assert.throws(() => verifyParams({ task: 'nope' }, 'embed'), TypeError);
    assert.throws(() => verifyParams({}, 'nope'), TypeError);
  });

  test('only set fields go on the wire', () => {
    assert.deepEqual(paramsToWire({}, 'embed'), { task: 'POOLING_TASK_EMBED' });
    // A LoRA adapter by name, for any task; verified as known.
    assert.deepEqual(paramsToWire({ adapter: 'a1' }, 'classify'), { task: 'POOLING_TASK_CLASSIFY', adapter: 'a1' });
    verifyParams({ adapter: 'a1' }, 'score');
    assert.deepEqual(paramsToWire({ useActivation: false, dimensions: 4, truncatePromptTokens: 7 }, 'token_embed'), {
      task: 'POOLING_TASK_TOKEN_EMBED',
      use_activation: false,
      dimensions: 4,
      truncate_prompt_tokens: 7,
    });
  });
});

describe('request shapes', () => {
  test('score accepts 1:N, N:N, pairs and [SEP] strings', () => {
    assert.deepEqual(scoreTexts('q', ['a', 'b']), [['q'], ['a', 'b']]);
    assert.deepEqual(scoreTexts(['q1', 'q2'], ['a', 'b']), [['q1', 'q2'], ['a', 'b']]);
    assert.deepEqual(scoreTexts([['q', 'a'], 'r [SEP] b'], undefined), [['q', 'r'], ['a', 'b']]);
    assert.deepEqual(splitSep('query  [SEP]  doc [SEP] x'), ['query', 'doc [SEP] x']);
    assert.throws(() => scoreTexts([['q']], undefined), TypeError);
    assert.throws(() => scoreTexts(['no separator'], undefined), TypeError);
    assert.throws(() => scoreTexts([1], ['a']), TypeError);
  });

  test('several replicas become one static ipv4/ipv6 target', () => {
    assert.equal(channelTarget('host:1'), 'host:1');
    assert.equal(channelTarget(['10.0.0.1:1', '10.0.0.2:2']), 'ipv4:10.0.0.1:1,10.0.0.2:2');
    assert.equal(channelTarget(['[::1]:1', '[::2]:2']), 'ipv6:[::1]:1,[::2]:2');
    assert.throws(() => channelTarget(['a:1', 'b:2']), TypeError);
  });
});

describe('PoolingError', () => {
  test('decodes ErrorInfo, BadRequest and RetryInfo from the status details trailer', () => {
    const metadata = new grpc.Metadata();
    metadata.set('grpc-status-details-bin', richStatusBytes());
    const serviceError = Object.assign(new Error('3 INVALID_ARGUMENT: bad dimensions'), {
      code: 3,
      details: 'bad dimensions',
      metadata,
    });
    const error = PoolingError.fromServiceError(serviceError);
    assert.ok(error instanceof Error);
    assert.equal(error.code, 3);
    assert.equal(error.codeName, 'INVALID_ARGUMENT');
    assert.equal(error.reason, 'DIMENSIONS_NOT_SUPPORTED');
    assert.equal(error.domain, 'pooling.v1');
    assert.deepEqual(error.metadata, { model: 'm' });
    assert.deepEqual(error.fieldViolations, [
      { field: 'params.dimensions', description: 'not matryoshka', reason: 'DIMENSIONS_NOT_SUPPORTED' },
    ]);
    assert.equal(error.retryDelayMs, 1500);
    assert.equal(error.cause, serviceError);
    assert.match(error.message, /^INVALID_ARGUMENT: bad dimensions \[reason=DIMENSIONS_NOT_SUPPORTED\]/);
  });

  test('a missing or malformed trailer keeps the code and message', () => {
    const metadata = new grpc.Metadata();
    metadata.set('grpc-status-details-bin', Buffer.from([0xff, 0xff, 0xff]));
    const error = PoolingError.fromServiceError({ code: 14, details: 'gone', metadata });
    assert.equal(error.codeName, 'UNAVAILABLE');
    assert.equal(error.details, 'gone');
    assert.equal(error.reason, null);
    assert.deepEqual(error.fieldViolations, []);
  });

  test('fromStatus takes bytes or an in-band google.rpc.Status object', () => {
    const fromBytes = PoolingError.fromStatus(richStatusBytes());
    assert.equal(fromBytes.reason, 'DIMENSIONS_NOT_SUPPORTED');
    const Status = errorTypes().lookupType('google.rpc.Status');
    const plain = Status.toObject(Status.decode(richStatusBytes()), { defaults: true });
    const fromObject = PoolingError.fromStatus(/** @type {any} */ (plain));
    assert.equal(fromObject.fieldViolations[0].field, 'params.dimensions');
    assert.equal(fromObject.retryDelayMs, 1500);
  });
});

describe('chunking', () => {
  test('chunk size and window follow the client and server limits', () => {
    assert.equal(needsLimits(32, null), false);
    assert.equal(needsLimits(33, null), true);
    assert.equal(needsLimits(5, 4), true);
    assert.equal(chunkSize(null, { maxClientBatchSize: 64, maxStreamInflight: 256 }), 64);
    assert.equal(chunkSize(10, { maxClientBatchSize: 64, maxStreamInflight: 256 }), 10);
    assert.equal(chunkSize(100, { maxClientBatchSize: 64, maxStreamInflight: 0 }), 64);
    assert.equal(chunkSize(null, { maxClientBatchSize: 0, maxStreamInflight: 0 }), 256);
    assert.equal(chunksInFlight(64, { maxClientBatchSize: 64, maxStreamInflight: 256 }), 4);
    assert.equal(chunksInFlight(64, { maxClientBatchSize: 64, maxStreamInflight: 0 }), 4);
    assert.equal(chunksInFlight(500, { maxClientBatchSize: 0, maxStreamInflight: 100 }), 1);
  });

  test('a job fills a bounded window and reassembles out-of-order answers', () => {
    const texts = Array.from({ length: 10 }, (_, i) => `t${i}`);
    const job = new ChunkedJob('embed', texts, { request_id: 'base' }, 3, 2);
    const first = job.fill();
    assert.deepEqual(
      first.map((r) => r.request.request_id),
      ['base-0', 'base-1'],
    );
    assert.deepEqual(first[1].request.embed, { texts: ['t3', 't4', 't5'] });
    assert.equal(job.fill().length, 0);
    /** @param {string} id @param {number} n @param {number} seed */
    const answer = (id, n, seed) => ({
      request_id: id,
      result: 'response',
      response: {
        request_id: id,
        output: 'embed',
        embed: { embeddings: Array.from({ length: n }, (_, i) => ({ values: [seed + i] })) },
      },
    });
    assert.equal(job.accept(answer('base-1', 3, 3)), 3);
    const second = job.fill();
    assert.deepEqual(
      second.map((r) => r.request.request_id),
      ['base-2'],
    );
    job.accept(answer('base-0', 3, 0));
    const third = job.fill();
    assert.deepEqual(third[0].request.embed, { texts: ['t9'] });
    assert.equal(job.exhausted, true);
    job.accept(answer('base-3', 1, 9));
    assert.throws(() => job.outputs(), /unanswered/);
    job.accept(answer('base-2', 3, 6));
    const outputs = job.outputs();
    assert.deepEqual(
      outputs.map((o) => [o.requestId, o.outputs.embedding[0]]),
      texts.map((_, i) => [`base-${i}`, i]),
    );
    assert.throws(() => job.accept(answer('base-0', 3, 0)), /not in flight/);
  });

  test('score 1:N keeps text_1 in every chunk; an in-band error becomes PoolingError', () => {
    const job = new ChunkedJob('score', [['q'], ['a', 'b', 'c']], { request_id: 's' }, 2, 4);
    const requests = job.fill();
    assert.deepEqual(
      requests.map((r) => r.request.score),
      [
        { text_1: ['q'], text_2: ['a', 'b'] },
        { text_1: ['q'], text_2: ['c'] },
      ],
    );
    const Status = errorTypes().lookupType('google.rpc.Status');
    const error = Status.toObject(Status.decode(richStatusBytes()), { defaults: true });
    assert.throws(
      () => job.accept({ request_id: 's-1', result: 'error', error }),
      (thrown) => thrown instanceof PoolingError && thrown.reason === 'DIMENSIONS_NOT_SUPPORTED',
    );
  });
});

describe('wire behaviour against an in-process fake server', () => {
  /** @type {PoolingClient} */
  let client;
  /** @type {() => void} */
  let stop;
  /** @type {any[]} */
  const seen = [];

  before(async () => {
    /** @type {import('../src/client.js').ClientOptions} */
    const options = { apiKey: 'k3y', metadata: [['x-extra', 'yes']], model: 'default-model', timeout: 10 };
    ({ client, stop } = await fakeServer({
      Pool: (/** @type {any} */ call, /** @type {Function} */ callback) => {
        seen.push({ request: call.request, metadata: call.metadata.getMap() });
        if (call.request.request_id.startsWith('cancel-once')) {
          const id = call.request.request_id;
          if (seen.filter((s) => s.request.request_id === id).length === 1) {
            callback({ code: grpc.status.CANCELLED, details: 'server stopping' });
            return;
          }
        }
        if (call.request.model === 'broken') {
          const trailer = new grpc.Metadata();
          trailer.set('grpc-status-details-bin', richStatusBytes());
          callback({ code: grpc.status.INVALID_ARGUMENT, details: 'bad dimensions', metadata: trailer });
          return;
        }
        const texts = call.request.embed.texts;
        callback(null, {
          request_id: call.request.request_id,
          model: call.request.model || 'fake',
          embed: { embeddings: texts.map((/** @type {string} */ t) => ({ values: [t.length, 0.5] })) },
        });
      },
      ListModels: (/** @type {any} */ _call, /** @type {Function} */ callback) =>
        callback(null, { models: [], max_client_batch_size: 8, max_stream_inflight: 16 }),
    }, options));
  });

  after(() => stop?.());

  test('requests carry the model, params, request id, api key and metadata', async () => {
    const outputs = await client.embed(['abc', 'de'], {
      requestId: 'rid',
      poolingParams: { useActivation: false },
      truncatePromptTokens: 5,
    });
    assert.deepEqual(
      outputs.map((o) => [o.requestId, o.outputs.embedding]),
      [
        ['rid-0', [3, 0.5]],
        ['rid-1', [2, 0.5]],
      ],
    );
    const { request, metadata } = seen.at(-1);
    assert.equal(request.model, 'default-model');
    assert.equal(request.input, 'embed');
    assert.equal(request.params.task, 'POOLING_TASK_EMBED');
    assert.equal(request.params.use_activation, false);
    assert.equal(request.params.truncate_prompt_tokens, 5);
    assert.equal(request.params.dimensions, undefined);
    assert.equal(metadata.authorization, 'Bearer k3y');
    assert.equal(metadata['x-extra'], 'yes');
  });

  test('a failed call rejects with the trailer details decoded', async () => {
    await assert.rejects(client.embed('x', { model: 'broken' }), (error) => {
      assert.ok(error instanceof PoolingError);
      assert.equal(error.codeName, 'INVALID_ARGUMENT');
      assert.equal(error.reason, 'DIMENSIONS_NOT_SUPPORTED');
      assert.equal(error.fieldViolations[0].field, 'params.dimensions');
      assert.equal(error.retryDelayMs, 1500);
      return true;
    });
  });

  test('a call the server cancelled is retried, as one refused UNAVAILABLE', async () => {
    const outputs = await client.embed('abc', { requestId: 'cancel-once' });
    assert.deepEqual(outputs[0].outputs.embedding, [3, 0.5]);
    assert.equal(seen.filter((s) => s.request.request_id === 'cancel-once').length, 2);
  });

  test('local validation rejects before anything is sent', async () => {
    const before = seen.length;
    await assert.rejects(client.classify('x', { poolingParams: { dimensions: 3 } }), TypeError);
    await assert.rejects(client.embed([1]), TypeError);
    await assert.rejects(client.encode('x', { poolingTask: 'score' }), TypeError);
    assert.equal(seen.length, before);
  });

  test('a stream that ends with chunks unanswered rejects', async () => {
    const texts = Array.from({ length: 40 }, (_, i) => `t${i}`);
    await assert.rejects(client.embed(texts), /unanswered/);
  });
});

describe('embedding encodings', () => {
  test('float16 and bfloat16 bit patterns decode to the numbers they stand for', () => {
    const halves = [
      [0x3c00, 1],
      [0xc000, -2],
      [0x7bff, 65504],
      [0x0001, 2 ** -24],
      [0x3555, 0.333251953125],
      [0x8000, -0],
      [0x7c00, Infinity],
      [0xfc00, -Infinity],
    ];
    for (const [bits, value] of halves) assert.equal(float16ToNumber(bits), value, `0x${bits.toString(16)}`);
    assert.ok(Number.isNaN(float16ToNumber(0x7e00)));
    const bhalves = [
      [0x3f80, 1],
      [0xbf00, -0.5],
      [0x4049, 3.140625],
      [0x7f80, Infinity],
    ];
    for (const [bits, value] of bhalves) assert.equal(bfloat16ToNumber(bits), value, `0x${bits.toString(16)}`);
  });

  test('every encoding decodes from unaligned little-endian bytes', () => {
    const values = [0.25, -1.5, 3, 0, -0.125];
    /** @param {number[]} bytes */
    const unaligned = (bytes) => Buffer.concat([Buffer.from([0xff]), Buffer.from(bytes)]).subarray(1);
    const f32 = Buffer.alloc(20);
    values.forEach((v, i) => f32.writeFloatLE(v, 4 * i));
    assert.deepEqual([...decodeValues(unaligned([...f32]), 'float32', 5)], values);
    const f16 = [0x3400, 0xbe00, 0x4200, 0x0000, 0xb000].flatMap((h) => [h & 0xff, h >> 8]);
    assert.deepEqual([...decodeValues(unaligned(f16), 'float16', 5)], values);
    const bf16 = [0x3e80, 0xbfc0, 0x4040, 0x0000, 0xbe00].flatMap((h) => [h & 0xff, h >> 8]);
    assert.deepEqual([...decodeValues(unaligned(bf16), 'bfloat16', 5)], values);
    // 10 values > 0 at 0, 2, 9: bits 1010000001 -> 0b10100000, 0b01000000 (160, 64).
    assert.deepEqual([...decodeValues(unaligned([160, 64]), 'ubinary', 10)], [160, 64]);
    assert.deepEqual([...decodeValues(unaligned([160 ^ 0x80, 64 ^ 0x80]), 'binary', 10)], [160 - 128, 64 - 128]);
    assert.deepEqual([...decodeValues(unaligned([0, 127, 128, 255]), 'int8', 4)], [0, 127, -128, -1]);
    assert.deepEqual([...decodeValues(unaligned([0, 127, 128, 255]), 'uint8', 4)], [0, 127, 128, 255]);
    assert.throws(() => decodeValues(Buffer.alloc(3), 'float16', 2), /should hold 4 bytes/);
  });

  test('responses with data decode to embeddings and token rows', () => {
    const f16 = Buffer.from([0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38]); // 1, -2, 0.5
    const [embedded] = convertOutputs(
      'embed',
      {
        request_id: 'r',
        output: 'embed',
        embed: { embeddings: [{ values: [], data: f16, dimensions: 3, encoding: 'EMBEDDING_ENCODING_FLOAT16' }] },
      },
      1,
    );
    assert.deepEqual(embedded.outputs.embedding, [1, -2, 0.5]);
    assert.equal(embedded.outputs.encoding, 'float16');
    assert.equal(embedded.outputs.dimensions, 3);
    const matrix = {
      rows: 2,
      cols: 9,
      values: [],
      data: Buffer.from([0xff, 0x80, 0x01, 0x00]),
      encoding: 'EMBEDDING_ENCODING_UBINARY',
      token_ids: [1, 2],
      offsets: [],
      special_tokens_mask: [true, true],
      label_ids: [],
      labels: [],
    };
    const [tokens] = convertOutputs('token_embed', { request_id: 'r', output: 'token_embed', token_embed: { items: [matrix] } }, 1);
    assert.deepEqual(tokens.outputs.data, [
      [255, 128],
      [1, 0],
    ]);
    assert.equal(tokens.outputs.encoding, 'ubinary');
    assert.throws(() => encodingName('EMBEDDING_ENCODING_FLOAT8'), /unknown embedding encoding/);
  });

  test('the encoding option is checked and sent as the wire enum', () => {
    assert.equal(requestTemplate('embed', { encoding: 'bfloat16' }).encoding, 'EMBEDDING_ENCODING_BFLOAT16');
    assert.equal(requestTemplate('token_embed', { encoding: 'binary' }).encoding, 'EMBEDDING_ENCODING_BINARY');
    assert.equal(requestTemplate('embed', {}).encoding, undefined);
    assert.throws(() => requestTemplate('embed', { encoding: 'float8' }), TypeError);
    assert.throws(() => requestTemplate('classify', { encoding: 'int8' }), /only for embed and token_embed/);
    assert.equal(requestTemplate('classify', { encoding: 'int8', validate: false }).encoding, 'EMBEDDING_ENCODING_INT8');
  });
});
