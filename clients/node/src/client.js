// PoolingClient: a promise-based client whose methods mirror the Python client (and vLLM's
// LLM pooling API): embed, classify, score, encode, rerank, models, tokenize.

import { isIP } from 'node:net';

import * as grpc from '@grpc/grpc-js';

import { ChunkedJob, checkBatchSize, chunkSize, chunksInFlight, needsLimits } from './chunking.js';
import { PoolingError } from './errors.js';
import { convertOutputs, modelInfos, repositoryModel, repositoryModels, rerankOutput, tokenizeOutputs } from './outputs.js';
import { loadPoolingService } from './proto.js';
import {
  asInputs,
  asTexts,
  checkEncodeTask,
  expectedOutputs,
  inputCount,
  lateChunkingToWire,
  requestTemplate,
  rerankRequest,
  scoreTexts,
  outputsOptions,
  withInputs,
} from './requests.js';

/**
 * Spread calls over every address a target resolves to, and retry calls that found a replica
 * going away on another one: UNAVAILABLE, or CANCELLED, which a server gives a call that
 * reached it as it stopped or died (grpc/grpc#41785). Every Pooling RPC is a pure function,
 * so a retry is safe; a call this client cancels is not retried.
 */
export const SERVICE_CONFIG = JSON.stringify({
  loadBalancingConfig: [{ round_robin: {} }],
  methodConfig: [
    {
      name: [{ service: 'pooling.v1.PoolingService' }],
      retryPolicy: {
        maxAttempts: 5,
        initialBackoff: '0.05s',
        maxBackoff: '1s',
        backoffMultiplier: 2,
        retryableStatusCodes: ['UNAVAILABLE', 'CANCELLED'],
      },
    },
  ],
});

/**
 * Channel options applied unless the caller sets the same key. Token matrices of a large batch
 * easily pass gRPC's default 4 MiB receive limit, so the client accepts any size.
 */
export const DEFAULT_CHANNEL_OPTIONS = Object.freeze({
  'grpc.max_receive_message_length': -1,
  'grpc.service_config': SERVICE_CONFIG,
  'grpc.enable_retries': 1,
});

/**
 * @typedef {Record<string, string|Buffer|Array<string|Buffer>> | Array<[string, string|Buffer]> | grpc.Metadata} MetadataPairs
 * @typedef {MetadataPairs | (() => MetadataPairs) | null | undefined} MetadataArg
 */

/**
 * @typedef {object} ClientOptions
 * @property {grpc.ChannelCredentials} [credentials] TLS credentials; or give the PEM parts.
 * @property {Buffer} [rootCertificates] PEM root certificates (TLS).
 * @property {Buffer} [privateKey] PEM client key (mutual TLS, with certificateChain).
 * @property {Buffer} [certificateChain] PEM client certificate chain (mutual TLS).
 * @property {string|null} [model] default served model; unset: the server's default.
 * @property {number|null} [timeout] default per-call deadline in SECONDS (as in the Python
 *   client); unset waits indefinitely.
 * @property {string} [apiKey] sent as "authorization: Bearer <key>" on every call.
 * @property {string} [adminKey] sent in its place on the model repository's calls
 *   (loadModel, unloadModel), which a server serves only with --admin-key.
 * @property {MetadataArg} [metadata] extra metadata, or a function returning it, per call.
 * @property {Record<string, unknown>} [channelOptions] gRPC channel options.
 * @property {number|null} [batchSize] most inputs per request; bigger jobs go out in chunks
 *   over one PoolStream (see README). Unset: the server's max_client_batch_size.
 * @property {string} [protoPath] the pooling.proto to load (default: the repository's).
 * @property {string[]} [includeDirs] proto import roots (default: see proto.js).
 */

/**
 * @typedef {object} PoolCallOptions
 * @property {import('./params.js').PoolingParams} [poolingParams]
 * @property {number} [truncatePromptTokens] shorthand for poolingParams.truncatePromptTokens
 * @property {string|null} [model]
 * @property {number|null} [timeout] seconds
 * @property {string} [requestId]
 * @property {string|null} [encoding] embed and token_embed: how the values travel: "float32",
 *   "float16", "bfloat16", "binary", "ubinary", "int8" or "uint8" (see encodings.js); unset:
 *   repeated floats (embed_multi: float32 bytes)
 * @property {string|null} [promptName] embed, token_embed and embed_multi: one of the model's
 *   prompts (ModelInfo.prompts) to prepend; on embed_multi "query" encodes queries, anything
 *   else documents. Unset: the model's default prompt.
 * @property {string|null} [prompt] embed, token_embed and embed_multi: a text to prepend
 *   instead ("" sends none). Not with promptName.
 * @property {boolean} [validate] false sends the params unchecked (the server still checks)
 * @property {import('./requests.js').LateChunking|null} [lateChunking] embed only: one vector
 *   per chunk of each text ({spans: [[start, end], ...]} of the one text, or {rule: "sentences"}
 *   or {rule: "tokens", window, overlap}); each output is then {spans, embeddings}
 */

/**
 * One gRPC target for one address, a DNS name, or several IP replicas.
 * @param {string|string[]} target
 * @returns {string}
 */
export function channelTarget(target) {
  if (typeof target === 'string') return target;
  const targets = [...target];
  if (targets.length === 1) return targets[0];
  const families = new Set(targets.map(ipFamily));
  if (families.size !== 1 || families.has(null)) {
    throw new TypeError(
      'several targets must all be IPv4 or all IPv6 addresses with ports; for host names use one DNS name that resolves to every replica',
    );
  }
  return `${[...families][0]}:${targets.join(',')}`;
}

/** @param {string} address */
function ipFamily(address) {
  const host = address.slice(0, address.lastIndexOf(':')).replace(/^\[|\]$/g, '');
  const version = isIP(host);
  return version === 0 ? null : `ipv${version}`;
}

/**
 * @param {ClientOptions} options
 * @returns {grpc.ChannelCredentials}
 */
function channelCredentials(options) {
  const pem = [options.rootCertificates, options.privateKey, options.certificateChain];
  const hasPem = pem.some((part) => part !== undefined && part !== null);
  if (options.credentials) {
    if (hasPem) throw new TypeError('Pass either credentials or rootCertificates/privateKey/certificateChain');
    return options.credentials;
  }
  if (!hasPem) return grpc.credentials.createInsecure();
  return grpc.credentials.createSsl(options.rootCertificates ?? null, options.privateKey ?? null, options.certificateChain ?? null);
}

/**
 * Add `source` to `metadata`.
 * @param {grpc.Metadata} metadata
 * @param {MetadataPairs|null|undefined} source
 */
function addMetadata(metadata, source) {
  if (source === null || source === undefined) return;
  if (source instanceof grpc.Metadata) {
    metadata.merge(source);
    return;
  }
  const entries = Array.isArray(source) ? source : Object.entries(source);
  for (const [key, value] of entries) {
    for (const item of Array.isArray(value) ? value : [value]) metadata.add(key, item);
  }
}

/** Promise-based client for a pooling server. Every failed call rejects with PoolingError. */
export class PoolingClient {
  /**
   * @param {string|string[]} target "host:port", a DNS name resolving to every replica, or a
   *   list of "ip:port" replicas; calls are spread round-robin and retried on UNAVAILABLE
   *   or CANCELLED.
   * @param {ClientOptions} [options]
   */
  constructor(target, options = {}) {
    const { Service, RepositoryService } = loadPoolingService({ protoPath: options.protoPath, includeDirs: options.includeDirs });
    const channelOptions = { ...DEFAULT_CHANNEL_OPTIONS, ...(options.channelOptions ?? {}) };
    /** The raw grpc-js PoolingService client, for requests this client would refuse to send. */
    this.stub = new Service(channelTarget(target), channelCredentials(options), channelOptions);
    this.model = options.model ?? null;
    this.timeout = options.timeout ?? null;
    this.apiKey = options.apiKey ?? null;
    this.adminKey = options.adminKey ?? null;
    /** The raw ModelRepositoryService client, on the same channel. */
    this.repository = new RepositoryService(channelTarget(target), channelCredentials(options), {
      ...channelOptions,
      channelOverride: this.stub.getChannel(),
    });
    this.metadata = options.metadata ?? null;
    this.batchSize = checkBatchSize(options.batchSize);
    /** @type {import('./chunking.js').StreamLimits|null} */
    this.limits = null;
  }

  /**
   * One embedding per text, in input order; with lateChunking, one {spans, embeddings} per
   * text (ChunkedEmbeddingOutput): each chunk's span and its embedding, in chunk order. On an
   * image-text model (CLIP, SigLIP) an input may be an image: a Buffer of its PNG, JPEG, WebP
   * or GIF bytes; on an audio-text model (CLAP) an audio clip: a Buffer of its WAV, FLAC or
   * OGG bytes.
   * @param {string|Buffer|Array<string|Buffer>} texts
   * @param {PoolCallOptions} [options]
   * @returns {Promise<import('./outputs.js').EmbeddingRequestOutput[]>}
   */
  embed(texts, options = {}) {
    return this.#run('embed', () => asInputs(texts), options);
  }

  /**
   * One classification per text, in input order. On an image-text model (CLIP, SigLIP)
   * inputs may be images (Buffers of PNG, JPEG, WebP or GIF bytes) and the classes are
   * candidateLabels (zero-shot), each put in labelTemplate ("{label}" replaced; unset: the
   * server's "a photo of a {label}."). On an audio-text model (CLAP) inputs may be audio
   * clips (Buffers of WAV, FLAC or OGG bytes), zero-shot alike (the server's template: "This
   * is a sound of {label}.").
   * @param {string|Buffer|Array<string|Buffer>} texts
   * @param {PoolCallOptions & {candidateLabels?: string[], labelTemplate?: string}} [options]
   * @returns {Promise<import('./outputs.js').ClassificationRequestOutput[]>}
   */
  classify(texts, options = {}) {
    /** @type {Record<string, unknown>} */
    const zeroShot = {};
    if (options.candidateLabels !== undefined) zeroShot.candidate_labels = asTexts(options.candidateLabels, 'candidateLabels');
    if (options.labelTemplate !== undefined) zeroShot.label_template = options.labelTemplate;
    return this.#run('classify', () => asInputs(texts), options, zeroShot);
  }

  /**
   * One relevance score per pair. With text2: 1:1, 1:N or N:N. Without it: text1 is an array
   * of [query, document] pairs or "query [SEP] document" strings, scored pairwise.
   * @param {string|string[]|Array<[string, string]>} text1
   * @param {string|string[]|PoolCallOptions|null} [text2]
   * @param {PoolCallOptions} [options]
   * @returns {Promise<import('./outputs.js').ScoringRequestOutput[]>}
   */
  score(text1, text2, options = {}) {
    if (text2 !== null && typeof text2 === 'object' && !Array.isArray(text2) && !(Symbol.iterator in text2)) {
      options = /** @type {PoolCallOptions} */ (text2); // score(pairs, options)
      text2 = undefined;
    }
    return this.#run('score', () => scoreTexts(text1, /** @type {any} */ (text2)), options);
  }

  /**
   * Per-token outputs for poolingTask "token_embed" (default) or "token_classify"; "embed" and
   * "classify" are forwarded to embed() and classify(). "embed_multi" (ColBERT models) gives
   * one matrix per text, { data: Float32Array, rows, cols, encoding }, as queries with
   * promptName "query" and as documents otherwise.
   * @param {string|string[]} texts
   * @param {PoolCallOptions & {poolingTask?: string}} [options]
   * @returns {Promise<any[]>}
   */
  async encode(texts, options = {}) {
    const { poolingTask = 'token_embed', ...rest } = options;
    checkEncodeTask(poolingTask);
    if (poolingTask === 'embed') return this.embed(texts, rest);
    if (poolingTask === 'classify') return this.classify(texts, rest);
    return this.#run(poolingTask, () => asTexts(texts), rest);
  }

  /**
   * A multi-output (bge-m3) model's outputs per text from one forward pass on the server:
   * { dense: number[], sparse: {indices, values, tokens}, multi: {data, rows, cols, encoding} },
   * each null unless asked for (all three by default). encoding (e.g. "float16") packs the
   * dense vector and the matrix on the wire.
   * @param {string|string[]} texts
   * @param {PoolCallOptions & {dense?: boolean, sparse?: boolean, multi?: boolean, sparseTopK?: number|null, returnTokens?: boolean}} [options]
   * @returns {Promise<Array<{requestId: string, outputs: import('./outputs.js').TextOutputs}>>}
   */
  async embedOutputs(texts, options = {}) {
    return this.#run('embed_outputs', () => asTexts(texts), options, outputsOptions(options));
  }

  /**
   * The documents ranked by relevance to the query, most relevant first: a cross-encoder scores
   * each (query, document) pair, an embedding model ranks by cosine similarity (as score()).
   * One Rerank call: at most the server's max_client_batch_size documents.
   * @param {string} query
   * @param {string|string[]} documents
   * @param {PoolCallOptions & {topN?: number|null, returnDocuments?: boolean, instruction?: string|null}} [options]
   *   topN keeps the best few (unset or 0: every document); returnDocuments adds each text;
   *   instruction is an LLM reranker's instruction (unset: its template's default)
   * @returns {Promise<import('./outputs.js').RerankOutput>}
   */
  async rerank(query, documents, options = {}) {
    const request = rerankRequest(query, documents, {
      ...options,
      model: this.#modelFor(options.model),
      validate: options.validate !== false,
    });
    const response = await this.rawCall('Rerank', request, options);
    const count = (request.documents ?? request.items ?? []).length;
    return rerankOutput(response, count, request.top_n);
  }

  /**
   * Every served model and what it can do, the default model first.
   * @param {{timeout?: number|null}} [options]
   * @returns {Promise<import('./outputs.js').ModelInfo[]>}
   */
  async models(options = {}) {
    const response = await this.rawCall('ListModels', {}, options);
    this.limits = streamLimits(response);
    return modelInfos(response);
  }

  /**
   * Every model the server knows, with its state: the served ones ("loaded", each with its
   * info), then its repository's others ("available", "loading", "failed"). Needs only the
   * API key.
   * @param {{timeout?: number|null}} [options]
   * @returns {Promise<import('./outputs.js').RepositoryModel[]>}
   */
  async listModels(options = {}) {
    return repositoryModels(await this.rawCall('ListModels', {}, options));
  }

  /**
   * Load a model at run time (adminKey): from `source` (a folder or hub id) with `options`
   * (per-model flags by name: {"pooling-type": "mean", dtype: "float32"}), or from the
   * server's repository by name. Resolves once every engine has loaded it.
   * @param {string} name
   * @param {{source?: string, options?: Record<string, string|number|boolean>, timeout?: number|null}} [call]
   * @returns {Promise<import('./outputs.js').RepositoryModel>}
   */
  async loadModel(name, call = {}) {
    /** @type {Record<string, string>} */
    const options = {};
    for (const [key, value] of Object.entries(call.options ?? {})) {
      options[key] = typeof value === 'object' ? JSON.stringify(value) : String(value);
    }
    const response = await this.#adminCall('Load', { name, source: call.source ?? '', options }, call);
    return repositoryModel(response.model, response.card ? modelInfos({ models: [response.card] })[0] : null);
  }

  /**
   * Load a LoRA adapter at run time (adminKey): the PEFT folder `path` (on the server's
   * disk) onto the served `call.model` (unset: the default model), served as `name`;
   * requests pick it by `model: name` or `poolingParams.adapter`. Resolves once it is
   * routed; unload it with unloadModel.
   * @param {string} name
   * @param {string} path
   * @param {{model?: string, timeout?: number|null}} [call]
   * @returns {Promise<import('./outputs.js').RepositoryModel>}
   */
  async loadAdapter(name, path, call = {}) {
    const options = { 'base-model': call.model ?? '' };
    return this.loadModel(name, { source: path, options, timeout: call.timeout });
  }

  /**
   * Unload a model (adminKey): out of routing first, its accepted calls finished, then its
   * memory freed.
   * @param {string} name
   * @param {{timeout?: number|null}} [call]
   * @returns {Promise<import('./outputs.js').RepositoryModel>}
   */
  async unloadModel(name, call = {}) {
    return repositoryModel((await this.#adminCall('Unload', { name }, call)).model, null);
  }

  /**
   * @param {'Load'|'Unload'|'List'} method
   * @param {Record<string, unknown>} request
   * @param {{timeout?: number|null}} options
   * @returns {Promise<any>}
   */
  #adminCall(method, request, options) {
    const metadata = new grpc.Metadata();
    addMetadata(metadata, typeof this.metadata === 'function' ? this.metadata() : this.metadata);
    if (this.adminKey !== null) metadata.add('authorization', `Bearer ${this.adminKey}`);
    return new Promise((resolve, reject) => {
      this.repository[method](request, metadata, this.#callOptions(options.timeout), (/** @type {any} */ error, /** @type {any} */ response) => {
        if (error) reject(PoolingError.fromServiceError(error));
        else resolve(response);
      });
    });
  }

  /**
   * The tokens the model would see for each text (special tokens added by default).
   * @param {string|string[]} texts
   * @param {{model?: string|null, addSpecialTokens?: boolean, timeout?: number|null}} [options]
   * @returns {Promise<import('./outputs.js').TokenizeOutput[]>}
   */
  async tokenize(texts, options = {}) {
    /** @type {Record<string, unknown>} */
    const request = { model: this.#modelFor(options.model), texts: asTexts(texts) };
    if (options.addSpecialTokens !== undefined && options.addSpecialTokens !== null) {
      if (typeof options.addSpecialTokens !== 'boolean') throw new TypeError('addSpecialTokens must be a boolean');
      request.add_special_tokens = options.addSpecialTokens;
    }
    return tokenizeOutputs(await this.rawCall('Tokenize', request, options));
  }

  /**
   * Invoke a unary method ("Pool", "Rerank", "ListModels", "Tokenize") with a wire-shaped request
   * (snake_case fields, enum names as strings) and this client's metadata and deadline; returns
   * the wire response. Nothing is validated locally.
   * @param {'Pool'|'Rerank'|'ListModels'|'Tokenize'} method
   * @param {Record<string, unknown>} request
   * @param {{timeout?: number|null}} [options]
   * @returns {Promise<any>}
   */
  rawCall(method, request, options = {}) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.#callMetadata(), this.#callOptions(options.timeout), (/** @type {any} */ error, /** @type {any} */ response) => {
        if (error) reject(PoolingError.fromServiceError(error));
        else resolve(response);
      });
    });
  }

  /** Close the channel; calls in flight are cancelled. */
  close() {
    this.stub.close(); // the repository client shares its channel
  }

  /**
   * @param {string} task
   * @param {() => import('./requests.js').Inputs} getInputs
   * @param {PoolCallOptions} options
   * @param {Record<string, unknown>} [inputOptions] the input case's other fields
   */
  async #run(task, getInputs, options, inputOptions) {
    const inputs = getInputs();
    const template = requestTemplate(task, {
      poolingParams: options.poolingParams,
      truncatePromptTokens: options.truncatePromptTokens,
      model: this.#modelFor(options.model),
      requestId: options.requestId,
      encoding: options.encoding,
      promptName: options.promptName,
      prompt: options.prompt,
      validate: options.validate !== false,
      inputOptions,
    });
    const chunking = lateChunkingToWire(task, options.lateChunking, options.validate !== false);
    if (chunking !== undefined) template.late_chunking = chunking;
    const count = inputCount(task, inputs);
    if (count !== null && needsLimits(count, this.batchSize)) {
      const limits = await this.#streamLimits(options.timeout);
      const size = chunkSize(this.batchSize, limits);
      if (count > size) {
        const job = new ChunkedJob(task, inputs, template, size, chunksInFlight(size, limits));
        return this.#poolStream(job, options.timeout);
      }
    }
    const request = withInputs(template, task, inputs);
    const response = await this.rawCall('Pool', request, options);
    return convertOutputs(task, response, expectedOutputs(task, inputs));
  }

  /**
   * Run a chunked job over one PoolStream, never more than job.window chunks unanswered.
   * @param {ChunkedJob} job
   * @param {number|null|undefined} timeout
   * @returns {Promise<any[]>}
   */
  #poolStream(job, timeout) {
    return new Promise((resolve, reject) => {
      const call = this.stub.PoolStream(this.#callMetadata(), this.#callOptions(timeout));
      let settled = false;
      let halfClosed = false;
      /** @param {unknown} error */
      const fail = (error) => {
        if (settled) return;
        settled = true;
        call.cancel();
        reject(error);
      };
      const send = () => {
        for (const request of job.fill()) call.write(request);
        if (job.exhausted && !halfClosed) {
          halfClosed = true;
          call.end();
        }
      };
      call.on('data', (/** @type {any} */ response) => {
        if (settled) return;
        try {
          job.accept(response);
          send();
        } catch (error) {
          fail(error);
        }
      });
      call.on('error', (/** @type {any} */ error) => fail(PoolingError.fromServiceError(error)));
      call.on('end', () => {
        if (settled) return;
        try {
          const outputs = job.outputs();
          settled = true;
          resolve(outputs);
        } catch (error) {
          fail(error);
        }
      });
      try {
        send();
      } catch (error) {
        fail(error);
      }
    });
  }

  /** @param {number|null|undefined} timeout */
  async #streamLimits(timeout) {
    if (this.limits === null) {
      this.limits = streamLimits(await this.rawCall('ListModels', {}, { timeout }));
    }
    return this.limits;
  }

  /** @param {string|null|undefined} model */
  #modelFor(model) {
    return (model === undefined || model === null ? this.model : model) ?? '';
  }

  /** @param {number|null|undefined} timeout seconds */
  #callOptions(timeout) {
    const seconds = timeout === undefined || timeout === null ? this.timeout : timeout;
    return seconds === null ? {} : { deadline: new Date(Date.now() + seconds * 1000) };
  }

  #callMetadata() {
    const metadata = new grpc.Metadata();
    addMetadata(metadata, typeof this.metadata === 'function' ? this.metadata() : this.metadata);
    if (this.apiKey !== null) metadata.add('authorization', `Bearer ${this.apiKey}`);
    return metadata;
  }
}

/**
 * @param {any} response a ListModelsResponse
 * @returns {import('./chunking.js').StreamLimits}
 */
function streamLimits(response) {
  return {
    maxClientBatchSize: Math.max(response.max_client_batch_size ?? 0, 0),
    maxStreamInflight: Math.max(response.max_stream_inflight ?? 0, 0),
  };
}
