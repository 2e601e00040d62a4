// What the Node client's tests share: the live server's address (tests/client/
// test_node_client.py exports it; without it live tests skip, saying why) and an in-process
// grpc-js fake of PoolingService on a free port, so that the real serialization runs both
// ways without a pooling server. No tests here.

import * as grpc from '@grpc/grpc-js';

import { PoolingClient, loadPoolingService } from '../src/index.js';

export const ADDRESS = process.env.POOLING_SERVER_ADDRESS;
export const SKIP_MESSAGE = 'POOLING_SERVER_ADDRESS is not set: start a pooling server and export its host:port to run this test';

/**
 * Wrap a test body so it is skipped, with a clear message, when no server address is given.
 * @param {(t: import('node:test').TestContext) => Promise<void>} body
 */
export function live(body) {
  return async (/** @type {import('node:test').TestContext} */ t) => {
    if (!ADDRESS) {
      t.skip(SKIP_MESSAGE);
      return;
    }
    await body(t);
  };
}

/**
 * Serve `handlers` (PoolingService methods by name) on 127.0.0.1's next free port and connect
 * a client to it. PoolStream ends at once and Tokenize answers no items unless `handlers`
 * says otherwise. `stop` closes the client and shuts the server down.
 * @param {Record<string, Function>} handlers
 * @param {import('../src/client.js').ClientOptions} [options] the client's (default: a 10 s timeout)
 * @returns {Promise<{ client: PoolingClient, stop: () => void }>}
 */
export async function fakeServer(handlers, options = { timeout: 10 }) {
  const { Service } = loadPoolingService();
  const server = new grpc.Server();
  server.addService(Service.service, {
    PoolStream: (/** @type {any} */ call) => call.end(),
    Tokenize: (/** @type {any} */ _call, /** @type {Function} */ callback) => callback(null, { items: [] }),
    ...handlers,
  });
  const port = await new Promise((resolve, reject) => {
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound),
    );
  });
  const client = new PoolingClient(`127.0.0.1:${port}`, options);
  return {
    client,
    stop: () => {
      client.close();
      server.forceShutdown();
    },
  };
}

/**
 * A fake Rerank that records each request in `seen` and ranks its documents (or, where it
 * sends items, its items) in the order given, scoring them 1, 0, -1, ...
 * @param {string} model the model the answers name
 * @param {any[]} seen
 */
export function rerankInOrder(model, seen) {
  return (/** @type {any} */ call, /** @type {Function} */ callback) => {
    seen.push(call.request);
    const { request_id, items, documents } = call.request;
    const inputs = items?.length ? items : documents;
    const results = inputs.map((/** @type {any} */ _d, /** @type {number} */ index) => ({ index, relevance_score: 1 - index }));
    callback(null, { request_id, model, results });
  };
}
