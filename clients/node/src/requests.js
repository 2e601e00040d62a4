// Request building shared by the unary and streaming paths. Pure functions, no I/O.

import { randomUUID } from 'node:crypto';

import { ENCODINGS, checkEncoding } from './encodings.js';
import { checkTask, paramsToWire, verifyParams } from './params.js';

/** How the "[SEP]" form of score input separates query from document. */
export const SEP_TOKEN = '[SEP]';

/** Tasks encode() accepts; "embed" and "classify" delegate to embed()/classify(). */
export const ENCODE_TASKS = Object.freeze(['token_embed', 'token_classify', 'embed', 'classify', 'embed_multi']);

/**
 * Tasks a prompt can be prepended for (as sentence-transformers' encode does); on embed_multi
 * the prompt name picks the ColBERT mode: "query", anything else a document.
 */
export const PROMPT_TASKS = Object.freeze(['embed', 'token_embed', 'embed_multi']);

/** A fresh request id for calls that do not name one. */
export function newRequestId() {
  return randomUUID().replaceAll('-', '');
}

/**
 * Normalise one text or an iterable of texts to an array, rejecting non-strings.
 * @param {string|Iterable<string>} prompts
 * @param {string} [name]
 * @returns {string[]}
 */
export function asTexts(prompts, name = 'prompts') {
  if (typeof prompts === 'string') return [prompts];
  if (prompts === null || prompts === undefined || typeof prompts[Symbol.iterator] !== 'function') {
    throw new TypeError(`${name} must be a string or an array of strings`);
  }
  const texts = [...prompts];
  texts.forEach((text, i) => {
    if (typeof text !== 'string') throw new TypeError(`${name}[${i}] must be a string, got ${typeof text}`);
  });
  return texts;
}

/**
 * Whether `value` is an image or audio input: a Buffer (or another Uint8Array) of an encoded
 * image or audio clip.
 * @param {unknown} value
 */
export function isImage(value) {
  return value instanceof Uint8Array;
}

/**
 * Whether the bytes begin as a WAV, FLAC or OGG file: an audio clip (a CLAP model's input),
 * told apart from an image as the server tells them, by their signature.
 * @param {Uint8Array} data
 */
export function isAudio(data) {
  const tag = (/** @type {number} */ at) => Buffer.from(data.subarray(at, at + 4)).toString('latin1');
  return ((tag(0) === 'RIFF' || tag(0) === 'RIFX') && tag(8) === 'WAVE') || tag(0) === 'fLaC' || tag(0) === 'OggS';
}

/**
 * Normalise inputs that may hold images or audio clips (a two-tower model's: CLIP, SigLIP,
 * CLAP): strings stay strings, unless one input is a Buffer (PNG, JPEG, WebP or GIF bytes;
 * WAV, FLAC or OGG bytes), when every input becomes a wire Item ({text}, {image: {data}} or
 * {audio: {data}}) and the request sends items.
 * @param {string|Uint8Array|Iterable<string|Uint8Array>} prompts
 * @param {string} [name]
 * @returns {Array<string|{text?: string, image?: {data: Uint8Array}, audio?: {data: Uint8Array}}>}
 */
export function asInputs(prompts, name = 'prompts') {
  if (isImage(prompts)) return [toItem(prompts, name)];
  if (typeof prompts === 'string' || ![...asIterable(prompts, name)].some(isImage)) {
    return asTexts(/** @type {any} */ (prompts), name);
  }
  return [.../** @type {Iterable<unknown>} */ (prompts)].map((value, i) => toItem(value, `${name}[${i}]`));
}

/**
 * One input as a wire Item.
 * @param {unknown} value
 * @param {string} name
 */
function toItem(value, name) {
  if (typeof value === 'string') return { text: value };
  if (isImage(value)) {
    const data = Buffer.from(/** @type {Uint8Array} */ (value));
    return isAudio(data) ? { audio: { data } } : { image: { data } };
  }
  if (value !== null && typeof value === 'object' && ('text' in value || 'image' in value || 'audio' in value)) {
    return value;
  }
  throw new TypeError(`${name} must be a string or a Buffer of an image or audio clip, got ${typeof value}`);
}

/**
 * Whether a list of inputs is items (it held an image or audio clip).
 * @param {unknown[]} inputs
 */
export function hasItems(inputs) {
  return inputs.length > 0 && typeof inputs[0] !== 'string';
}

/**
 * Split "query [SEP] doc" on the first [SEP], dropping the whitespace around it.
 * @param {string} text
 * @returns {[string, string]}
 */
export function splitSep(text) {
  const at = text.indexOf(SEP_TOKEN);
  if (at < 0) throw new TypeError(`Score input ${JSON.stringify(text)} has no ${SEP_TOKEN} separator`);
  return [text.slice(0, at).trimEnd(), text.slice(at + SEP_TOKEN.length).trimStart()];
}

/**
 * Split [text1, text2] pairs or "q [SEP] d" strings into equal-length N:N lists.
 * @param {string|Iterable<unknown>} data
 * @returns {[string[], string[]]}
 */
export function splitPairs(data) {
  const items = typeof data === 'string' ? [data] : [...asIterable(data, 'text1')];
  /** @type {string[]} */
  const text1 = [];
  /** @type {string[]} */
  const text2 = [];
  items.forEach((item, i) => {
    let query;
    let doc;
    if (typeof item === 'string') {
      [query, doc] = splitSep(item);
    } else if (Array.isArray(item)) {
      if (item.length !== 2) throw new TypeError(`text1[${i}] must be a [text1, text2] pair, got ${item.length} items`);
      [query, doc] = item;
      if (typeof query !== 'string' || typeof doc !== 'string') {
        throw new TypeError(`text1[${i}] must hold two strings`);
      }
    } else {
      throw new TypeError(`text1[${i}] must be a [text1, text2] pair or a '${SEP_TOKEN}' string`);
    }
    text1.push(query);
    text2.push(doc);
  });
  return [text1, text2];
}

/**
 * @param {unknown} value
 * @param {string} name
 * @returns {Iterable<unknown>}
 */
function asIterable(value, name) {
  if (value === null || value === undefined || typeof (/** @type {any} */ (value))[Symbol.iterator] !== 'function') {
    throw new TypeError(`${name} must be a string or an array`);
  }
  return /** @type {Iterable<unknown>} */ (value);
}

/**
 * Resolve score()'s arguments into text_1/text_2 lists (shapes are checked by the server).
 * @param {string|Iterable<unknown>} data1
 * @param {string|Iterable<string>|null|undefined} data2
 * @returns {[string[], string[]]}
 */
export function scoreTexts(data1, data2) {
  if (data2 === null || data2 === undefined) return splitPairs(data1);
  const one = asInputs(/** @type {any} */ (data1), 'text1');
  const two = asInputs(/** @type {any} */ (data2), 'text2');
  if (hasItems(one) || hasItems(two)) {
    return /** @type {any} */ ([one.map((v) => toItem(v, 'text1')), two.map((v) => toItem(v, 'text2'))]);
  }
  return /** @type {[string[], string[]]} */ ([one, two]);
}

/**
 * @typedef {string[] | [string[], string[]]} Inputs texts, or for score [text_1, text_2]
 */

/**
 * How many outputs a job produces, or null when it cannot be chunked (score shapes other than
 * 1:N and N:N are left to the server to reject).
 * @param {string} task
 * @param {Inputs} inputs
 * @returns {number|null}
 */
export function inputCount(task, inputs) {
  if (task !== 'score') return inputs.length;
  const [text1, text2] = /** @type {[string[], string[]]} */ (inputs);
  if (text1.length === 1) return text2.length;
  if (text1.length === text2.length) return text1.length;
  return null;
}

/**
 * The wire input case for `task`.
 * @param {string} task
 * @param {Inputs} inputs
 */
export function inputMessage(task, inputs) {
  if (task === 'score') {
    const [text1, text2] = /** @type {[string[], string[]]} */ (inputs);
    if (hasItems(text1) || hasItems(text2)) return { items_1: text1, items_2: text2 };
    return { text_1: text1, text_2: text2 };
  }
  return hasItems(inputs) ? { items: inputs } : { texts: inputs };
}

/**
 * How many outputs a PoolRequest should produce.
 * @param {string} task
 * @param {Inputs} inputs
 */
export function expectedOutputs(task, inputs) {
  if (task !== 'score') return inputs.length;
  const [text1, text2] = /** @type {[string[], string[]]} */ (inputs);
  return text1.length === 1 ? text2.length : text1.length;
}

/**
 * A PoolRequest template (no inputs) for `task`, its params verified unless `validate` is
 * false.
 * @param {string} task
 * @param {object} options
 * @param {import('./params.js').PoolingParams} [options.poolingParams]
 * @param {number} [options.truncatePromptTokens] merged into the params (it wins)
 * @param {string|null} [options.model]
 * @param {string} [options.requestId]
 * @param {string|null} [options.encoding] embed, token_embed and embed_multi: how the values
 *   travel (see encodings.js); unset: repeated floats (float32 bytes for embed_multi)
 * @param {string|null} [options.promptName] one of the model's prompts (ModelInfo.prompts) to
 *   prepend; on embed_multi "query" or "document"
 * @param {string|null} [options.prompt] a text to prepend ("" sends none, overriding the
 *   model's default prompt)
 * @param {boolean} [options.validate]
 * @param {Record<string, unknown>} [options.inputOptions] fields of the input case besides its
 *   texts (embed_outputs: the outputs asked for, sparse_top_k, return_tokens), kept in every
 *   request made from the template
 */
export function requestTemplate(
  task,
  { poolingParams, truncatePromptTokens, model, requestId, encoding, promptName, prompt, validate = true, inputOptions },
) {
  checkTask(task);
  const params = { ...(poolingParams ?? {}) };
  if (truncatePromptTokens !== undefined && truncatePromptTokens !== null) {
    params.truncatePromptTokens = truncatePromptTokens;
  }
  const hasPromptName = promptName !== undefined && promptName !== null;
  const hasPrompt = prompt !== undefined && prompt !== null;
  if (validate) {
    verifyParams(params, task);
    checkEncoding(encoding, task);
    checkPrompts(task, promptName, prompt);
  }
  /** @type {Record<string, unknown>} */
  const template = {
    request_id: requestId ?? newRequestId(),
    model: model ?? '',
    params: paramsToWire(params, task),
  };
  if (encoding !== undefined && encoding !== null) {
    template.encoding = /** @type {Record<string, string>} */ (ENCODINGS)[encoding] ?? encoding;
  }
  if (hasPromptName) template.prompt_name = promptName;
  if (hasPrompt) template.prompt = prompt;
  if (inputOptions !== undefined) template[task] = { ...inputOptions };
  return template;
}

/** Late chunking's rules by name, as the wire's ChunkRule names them. */
export const CHUNK_RULES = Object.freeze({ sentences: 'CHUNK_RULE_SENTENCES', tokens: 'CHUNK_RULE_TOKENS' });
const LATE_CHUNKING_KEYS = Object.freeze(['spans', 'rule', 'window', 'overlap']);

/**
 * @typedef {object} LateChunking embed only: one vector per chunk of each text, each the mean
 *   of the chunk's token states from one pass over the whole text (see the README).
 * @property {Array<[number, number]>} [spans] character spans [start, end) of the call's one
 *   text (code points, as token offsets are); any order, overlap allowed
 * @property {string} [rule] or a rule for every text: "sentences", or "tokens" (window tokens
 *   per chunk, overlap of them shared by neighbours)
 * @property {number} [window] rule "tokens": tokens per chunk
 * @property {number} [overlap] rule "tokens": tokens shared by consecutive chunks
 */

/**
 * The wire LateChunking of `lateChunking` on `task`, its shape checked unless `validate` is
 * false (the server checks its values against the texts); undefined when none is given.
 * @param {string} task
 * @param {LateChunking|null|undefined} lateChunking
 * @param {boolean} [validate]
 * @returns {Record<string, unknown>|undefined}
 */
export function lateChunkingToWire(task, lateChunking, validate = true) {
  if (lateChunking === undefined || lateChunking === null) return undefined;
  if (validate) checkLateChunking(task, lateChunking);
  const { spans = [], rule, window = 0, overlap = 0 } = lateChunking;
  /** @type {Record<string, unknown>} */
  const message = {
    spans: spans.map(([start, end]) => ({ start, end })),
    window_tokens: window,
    overlap_tokens: overlap,
  };
  if (rule !== undefined && rule !== null) {
    message.rule = /** @type {Record<string, string>} */ (CHUNK_RULES)[rule] ?? rule;
  }
  return message;
}

/**
 * Throw unless `lateChunking` is on embed and of LateChunking's shape.
 * @param {string} task
 * @param {unknown} lateChunking
 */
function checkLateChunking(task, lateChunking) {
  if (task !== 'embed') throw new TypeError(`lateChunking applies to embed, not ${task}`);
  if (typeof lateChunking !== 'object' || lateChunking === null || Array.isArray(lateChunking)) {
    throw new TypeError('lateChunking must be an object: {spans} or {rule, window, overlap}');
  }
  const given = /** @type {Record<string, unknown>} */ (lateChunking);
  const unknown = Object.keys(given).filter((key) => !LATE_CHUNKING_KEYS.includes(key));
  if (unknown.length > 0) throw new TypeError(`Unknown lateChunking keys ${unknown.join(', ')}`);
  const { spans, rule, window, overlap } = given;
  const isPair = (/** @type {unknown} */ span) =>
    Array.isArray(span) && span.length === 2 && span.every((value) => Number.isInteger(value));
  if (spans !== undefined && spans !== null && !(Array.isArray(spans) && spans.every(isPair))) {
    throw new TypeError('lateChunking.spans must be an array of [start, end] integer pairs');
  }
  if (rule !== undefined && rule !== null && !Object.hasOwn(CHUNK_RULES, /** @type {string} */ (rule))) {
    throw new TypeError(`lateChunking.rule must be one of ${Object.keys(CHUNK_RULES).join(', ')}, got ${JSON.stringify(rule)}`);
  }
  for (const [name, value] of [
    ['window', window],
    ['overlap', overlap],
  ]) {
    if (value !== undefined && value !== null && !Number.isInteger(value)) {
      throw new TypeError(`lateChunking.${name} must be an integer, got ${JSON.stringify(value)}`);
    }
  }
}

/**
 * Throw unless the prompt options fit `task`: strings, not both, and only on PROMPT_TASKS.
 * @param {string} task
 * @param {unknown} promptName
 * @param {unknown} prompt
 */
export function checkPrompts(task, promptName, prompt) {
  const given = [
    ['promptName', promptName],
    ['prompt', prompt],
  ].filter(([, value]) => value !== undefined && value !== null);
  for (const [name, value] of given) {
    if (typeof value !== 'string') throw new TypeError(`${name} must be a string, got ${typeof value}`);
  }
  if (given.length === 2) throw new TypeError('pass promptName or prompt, not both');
  if (given.length > 0 && !PROMPT_TASKS.includes(task)) {
    throw new TypeError(`prompts apply to ${PROMPT_TASKS.join(', ')}, not ${task}`);
  }
}

/**
 * embed_outputs' input options (OutputsInput's fields besides texts), checked: at least one
 * output asked for, sparseTopK a count.
 * @param {{dense?: boolean, sparse?: boolean, multi?: boolean, sparseTopK?: number|null, returnTokens?: boolean}} options
 * @returns {Record<string, unknown>}
 */
export function outputsOptions({ dense = true, sparse = true, multi = true, sparseTopK = null, returnTokens = false }) {
  for (const [name, value] of Object.entries({ dense, sparse, multi, returnTokens })) {
    if (typeof value !== 'boolean') throw new TypeError(`${name} must be a boolean`);
  }
  if (!dense && !sparse && !multi) throw new TypeError('ask for at least one output: dense, sparse or multi');
  const topK = sparseTopK ?? 0;
  if (!Number.isInteger(topK) || topK < 0) throw new RangeError(`sparseTopK must be an integer >= 0, got ${sparseTopK}`);
  return { dense, sparse, multi, sparse_top_k: topK, return_tokens: returnTokens };
}

/**
 * The template plus inputs: a complete PoolRequest.
 * @param {ReturnType<typeof requestTemplate>} template
 * @param {string} task
 * @param {Inputs} inputs
 * @param {string} [requestId]
 */
export function withInputs(template, task, inputs, requestId) {
  const options = /** @type {Record<string, unknown>|undefined} */ (template[task]);
  return { ...template, request_id: requestId ?? template.request_id, [task]: { ...options, ...inputMessage(task, inputs) } };
}

/**
 * A RerankRequest: the documents to rank against the query. Its params are score's (rerank
 * runs score 1:N), verified unless `validate` is false.
 * @param {string} query
 * @param {string|Iterable<string|Uint8Array>} documents texts, or on an image-text model
 *   also images (Buffers), sent as items
 * @param {object} [options]
 * @param {number|null} [options.topN] keep the best topN; unset or 0: every document
 * @param {boolean} [options.returnDocuments] add each document's text to its result
 * @param {import('./params.js').PoolingParams} [options.poolingParams]
 * @param {number} [options.truncatePromptTokens]
 * @param {string|null} [options.model]
 * @param {string} [options.requestId]
 * @param {string|null} [options.instruction] an LLM reranker's instruction (its score
 *   template's {instruction}, e.g. Qwen3-Reranker's <Instruct>); unset: the template's
 *   default. Other models refuse it.
 * @param {boolean} [options.validate]
 */
export function rerankRequest(query, documents, options = {}) {
  if (typeof query !== 'string') throw new TypeError(`query must be a string, got ${typeof query}`);
  const texts = asInputs(documents, 'documents');
  const topN = options.topN ?? 0;
  if (!Number.isInteger(topN) || topN < 0) {
    throw new RangeError(`topN must be a non-negative integer (0 or unset: every document), got ${topN}`);
  }
  const { request_id: requestId, model, params } = requestTemplate('score', {
    poolingParams: options.poolingParams,
    truncatePromptTokens: options.truncatePromptTokens,
    model: options.model,
    requestId: options.requestId,
    validate: options.validate,
  });
  const instruction = options.instruction ?? null;
  if (instruction !== null && typeof instruction !== 'string') {
    throw new TypeError(`instruction must be a string, got ${typeof instruction}`);
  }
  return {
    request_id: requestId,
    model,
    query,
    ...(hasItems(texts) ? { items: texts } : { documents: texts }),
    top_n: topN,
    return_documents: Boolean(options.returnDocuments),
    params,
    ...(instruction === null ? {} : { instruction }),
  };
}

/**
 * Throw unless encode() can run `poolingTask`.
 * @param {unknown} poolingTask
 */
export function checkEncodeTask(poolingTask) {
  if (!ENCODE_TASKS.includes(/** @type {string} */ (poolingTask))) {
    throw new TypeError(
      `encode() does not support poolingTask=${JSON.stringify(poolingTask)}; expected one of ${ENCODE_TASKS.join(', ')} (use score() for scoring)`,
    );
  }
}
