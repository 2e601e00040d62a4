// loadModel, unloadModel and listModels against an in-process grpc-js fake of both services:
// the admin key goes on the repository's calls (the API key on PoolingService's), the
// wire's states come back as short names, and per-model options travel as strings.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { PoolingClient, loadPoolingService } from '../src/index.js';

const CARD = { name: 'minilm', tasks: ['POOLING_TASK_EMBED'], state: 'MODEL_STATE_LOADED', memory_bytes: '90000000' };

test('the repository calls carry the admin key and read states', async () => {
  const { Service, RepositoryService } = loadPoolingService();
  /** @type {Record<string, string[]>} */
  const keys = {};
  /** @type {any[]} */
  const loads = [];
  const seen = (/** @type {string} */ method, /** @type {any} */ call) => {
    keys[method] = call.metadata.get('authorization');
  };
  const server = new grpc.Server();
  server.addService(Service.service, {
    ListModels: (/** @type {any} */ call, /** @type {Function} */ callback) => {
      seen('ListModels', call);
      const failed = { name: 'broken', state: 'MODEL_STATE_FAILED', reason: 'no model_type', retry_after_s: 29.5 };
      callback(null, { models: [CARD], repository: [{ name: 'rep-a', state: 'MODEL_STATE_AVAILABLE' }, failed] });
    },
  });
  server.addService(RepositoryService.service, {
    Load: (/** @type {any} */ call, /** @type {Function} */ callback) => {
      seen('Load', call);
      loads.push(call.request);
      const model = { name: call.request.name, state: 'MODEL_STATE_LOADED', memory_bytes: '1234', source: call.request.source };
      callback(null, { model, card: { ...CARD, name: call.request.name } });
    },
    Unload: (/** @type {any} */ call, /** @type {Function} */ callback) => {
      seen('Unload', call);
      callback(null, { model: { name: call.request.name, state: 'MODEL_STATE_AVAILABLE' } });
    },
    List: (/** @type {any} */ _call, /** @type {Function} */ callback) => callback(null, { models: [] }),
  });
  const port = await new Promise((resolve, reject) => {
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound),
    );
  });
  const client = new PoolingClient(`127.0.0.1:${port}`, { timeout: 10, apiKey: 'api', adminKey: 'admin' });
  try {
    const listed = await client.listModels();
    assert.deepEqual(
      listed.map((m) => [m.name, m.state]),
      [['minilm', 'loaded'], ['rep-a', 'available'], ['broken', 'failed']],
    );
    assert.equal(listed[0].memoryBytes, 90000000);
    assert.equal(listed[0].info?.name, 'minilm');
    assert.equal(listed[2].reason, 'no model_type');
    assert.equal(listed[2].retryAfterS, 29.5);

    const loaded = await client.loadModel('st', { source: '/models/st', options: { 'pooling-type': 'mean', 'trust-remote-code': false } });
    assert.deepEqual([loaded.name, loaded.state, loaded.memoryBytes, loaded.info?.state], ['st', 'loaded', 1234, 'loaded']);
    assert.deepEqual(loads[0].options, { 'pooling-type': 'mean', 'trust-remote-code': 'false' });
    assert.equal(loads[0].source, '/models/st');
    assert.equal((await client.unloadModel('st')).state, 'available');

    assert.deepEqual(keys.ListModels, ['Bearer api']);
    assert.deepEqual(keys.Load, ['Bearer admin']);
    assert.deepEqual(keys.Unload, ['Bearer admin']);
  } finally {
    client.close();
    server.forceShutdown();
  }
});
