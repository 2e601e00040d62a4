// Splitting a big job into chunks sent over PoolStream, and reassembling the answers.
//
// A job of N inputs with chunk size C becomes ceil(N / C) PoolRequests, built lazily as room
// frees up. Chunk k gets the stream-unique id "<base>-<k>"; outputs are relabelled
// "<base>-<input index>", so they look exactly like one unary Pool call with id <base>.

import { PoolingError } from './errors.js';
import { convertOutputs } from './outputs.js';
import { expectedOutputs, inputCount, withInputs } from './requests.js';

/** Calls with at most this many inputs go out as one unary Pool without asking for limits. */
export const STREAM_THRESHOLD = 32;
/** Chunk size when neither the client nor the server names one. */
export const DEFAULT_CHUNK_SIZE = 256;
/** Chunks in flight when the server does not report max_stream_inflight. */
export const DEFAULT_CHUNKS_IN_FLIGHT = 4;

/**
 * @typedef {{maxClientBatchSize: number, maxStreamInflight: number}} StreamLimits
 *   0 means the server did not say.
 */

/**
 * Validate the client's batchSize option (null/undefined: the server's limit).
 * @param {unknown} batchSize
 * @returns {number|null}
 */
export function checkBatchSize(batchSize) {
  if (batchSize === undefined || batchSize === null) return null;
  if (!Number.isInteger(batchSize)) throw new TypeError(`batchSize must be an integer, got ${batchSize}`);
  if (/** @type {number} */ (batchSize) < 1) throw new RangeError(`batchSize must be >= 1, got ${batchSize}`);
  return /** @type {number} */ (batchSize);
}

/**
 * Whether a job this big might be chunked, so the server's limits are worth fetching.
 * @param {number} count
 * @param {number|null} batchSize
 */
export function needsLimits(count, batchSize) {
  return count > (batchSize === null ? STREAM_THRESHOLD : Math.min(batchSize, STREAM_THRESHOLD));
}

/**
 * min(batchSize or the server's limit, the server's limit), at least 1.
 * @param {number|null} batchSize
 * @param {StreamLimits} limits
 */
export function chunkSize(batchSize, limits) {
  const server = limits.maxClientBatchSize || null;
  let size = batchSize || server || DEFAULT_CHUNK_SIZE;
  if (server !== null) size = Math.min(size, server);
  return Math.max(size, 1);
}

/**
 * How many chunks may be unanswered at once without the server pausing the stream.
 * @param {number} size
 * @param {StreamLimits} limits
 */
export function chunksInFlight(size, limits) {
  if (limits.maxStreamInflight <= 0) return DEFAULT_CHUNKS_IN_FLIGHT;
  return Math.max(1, Math.floor(limits.maxStreamInflight / size));
}

/**
 * Yield [offset, chunk inputs] lazily.
 * @param {string} task
 * @param {import('./requests.js').Inputs} inputs
 * @param {number} size
 * @returns {Generator<[number, import('./requests.js').Inputs]>}
 */
function* iterChunks(task, inputs, size) {
  const count = /** @type {number} */ (inputCount(task, inputs));
  for (let offset = 0; offset < count; offset += size) {
    const end = offset + size;
    if (task !== 'score') {
      yield [offset, /** @type {string[]} */ (inputs).slice(offset, end)];
    } else {
      const [text1, text2] = /** @type {[string[], string[]]} */ (inputs);
      yield text1.length === 1
        ? [offset, [text1, text2.slice(offset, end)]]
        : [offset, [text1.slice(offset, end), text2.slice(offset, end)]];
    }
  }
}

/**
 * One task over many inputs, as a bounded window of chunks on one PoolStream. Drive it with
 * fill() (requests to send now), accept() (each response) and outputs() once done.
 */
export class ChunkedJob {
  /**
   * @param {string} task
   * @param {import('./requests.js').Inputs} inputs
   * @param {{request_id: string}} template a verified request without inputs; its id is the base
   * @param {number} size inputs per chunk
   * @param {number} window most chunks unanswered at once
   */
  constructor(task, inputs, template, size, window) {
    const count = inputCount(task, inputs);
    if (count === null) throw new TypeError('score inputs must be 1:N or N:N to be chunked');
    if (size < 1 || window < 1) throw new RangeError(`chunk size and window must be >= 1, got ${size} and ${window}`);
    this.task = task;
    this.total = count;
    this.size = size;
    this.window = window;
    this.baseId = template.request_id;
    this.template = template;
    this.chunks = iterChunks(task, inputs, size);
    this.nextIndex = 0;
    this.exhausted = false;
    /** @type {Map<string, {offset: number, count: number}>} */
    this.pending = new Map();
    /** @type {any[]} */
    this.results = new Array(count);
    this.answered = 0;
  }

  /** Whether every chunk has been handed out and answered. */
  get done() {
    return this.exhausted && this.pending.size === 0;
  }

  /** The next PoolStreamRequests to send, enough to fill the window. */
  fill() {
    const requests = [];
    while (!this.exhausted && this.pending.size < this.window) {
      const next = this.chunks.next();
      if (next.done) {
        this.exhausted = true;
        break;
      }
      const [offset, chunkInputs] = next.value;
      const streamId = `${this.baseId}-${this.nextIndex}`;
      this.nextIndex += 1;
      this.pending.set(streamId, { offset, count: expectedOutputs(this.task, chunkInputs) });
      requests.push({ request: withInputs(this.template, this.task, chunkInputs, streamId) });
    }
    if (!this.exhausted && this.nextIndex * this.size >= this.total) this.exhausted = true;
    return requests;
  }

  /**
   * Take one PoolStreamResponse; returns how many inputs it answered. Throws PoolingError for
   * an in-band error, Error for a response that answers nothing in flight.
   * @param {any} response
   */
  accept(response) {
    const pending = this.pending.get(response.request_id);
    if (pending === undefined) {
      throw new Error(`PoolStream answered request_id ${JSON.stringify(response.request_id)}, which is not in flight`);
    }
    this.pending.delete(response.request_id);
    if (response.result === 'error') throw PoolingError.fromStatus(response.error);
    if (response.result !== 'response') {
      throw new Error(`PoolStreamResponse ${JSON.stringify(response.request_id)} carries no result`);
    }
    const outputs = convertOutputs(this.task, response.response, pending.count);
    outputs.forEach((output, i) => {
      output.requestId = `${this.baseId}-${pending.offset + i}`;
      this.results[pending.offset + i] = output;
    });
    this.answered += pending.count;
    return pending.count;
  }

  /** Every output in input order; throws if any chunk went unanswered. */
  outputs() {
    if (!this.done) {
      throw new Error(`PoolStream ended with ${this.total - this.answered} of ${this.total} inputs unanswered`);
    }
    return this.results;
  }
}
