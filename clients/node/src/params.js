// PoolingParams: how to pool, checked on the client before anything is sent.
//
// Mirrors vLLM's PoolingParams (and the Python client's). The server re-validates everything;
// checking here only turns an obvious mistake into a local TypeError/RangeError without a
// round trip.

/** The tasks a request can run, by the names vLLM uses. */
export const TASKS = Object.freeze([
  'embed',
  'classify',
  'score',
  'token_embed',
  'token_classify',
  'embed_multi',
  'embed_outputs',
]);

const EMBED_PARAMS = Object.freeze(['useActivation', 'dimensions', 'truncatePromptTokens']);
const CLASSIFY_PARAMS = Object.freeze(['useActivation', 'truncatePromptTokens']);
// A ColBERT matrix is always normalised and full width: only truncation is the caller's.
const MULTI_PARAMS = Object.freeze(['truncatePromptTokens']);

/** Which PoolingParams keys each task accepts (as in vLLM's `valid_parameters`). */
export const TASK_PARAMS = Object.freeze({
  embed: EMBED_PARAMS,
  token_embed: EMBED_PARAMS,
  classify: CLASSIFY_PARAMS,
  // outputWeights: a multi-output (bge-m3) model's weighted score (rerank too).
  score: Object.freeze([...CLASSIFY_PARAMS, 'outputWeights']),
  token_classify: CLASSIFY_PARAMS,
  embed_multi: MULTI_PARAMS,
  // bge-m3: useActivation normalises the dense vector (the matrix always is).
  embed_outputs: CLASSIFY_PARAMS,
});

/** Task name -> wire enum name. */
export const TASK_ENUM = Object.freeze({
  embed: 'POOLING_TASK_EMBED',
  classify: 'POOLING_TASK_CLASSIFY',
  score: 'POOLING_TASK_SCORE',
  token_embed: 'POOLING_TASK_TOKEN_EMBED',
  token_classify: 'POOLING_TASK_TOKEN_CLASSIFY',
  embed_multi: 'POOLING_TASK_EMBED_MULTI',
  embed_outputs: 'POOLING_TASK_EMBED_OUTPUTS',
});

/** camelCase key -> wire field name, for the optional fields. */
const WIRE_FIELDS = Object.freeze({
  useActivation: 'use_activation',
  dimensions: 'dimensions',
  truncatePromptTokens: 'truncate_prompt_tokens',
});

const KNOWN_KEYS = new Set([
  ...Object.keys(WIRE_FIELDS),
  'task',
  'outputWeights',
  'adapter',
  'bypassCache',
]);
const OUTPUT_NAMES = Object.freeze(['dense', 'sparse', 'multi']);

/**
 * @typedef {object} PoolingParams
 * @property {boolean} [useActivation] embed/token_embed: L2-normalise; classify/score/
 *   token_classify: apply the model's activation. Unset: the model's default.
 * @property {number} [dimensions] embed/token_embed on matryoshka models: keep this many
 *   leading dimensions.
 * @property {string} [task] optional; when set it must equal the task being run.
 * @property {number} [truncatePromptTokens] keep this many tokens per text (-1: the model's
 *   maximum).
 * @property {{dense?: number, sparse?: number, multi?: number}} [outputWeights] score and
 *   rerank on a multi-output (bge-m3) model: the weight of each output's score in the
 *   combined one, sum(w * s) / sum(w). Unset: the dense score alone.
 * @property {string} [adapter] a LoRA adapter of the model, by name, for any task. Unset:
 *   the one the model name names, if it names one, else the base weights.
 * @property {boolean} [bypassCache] true: the server's result cache neither answers nor
 *   keeps this call (any task).
 */

/**
 * Throw a TypeError unless `task` is one of TASKS.
 * @param {unknown} task
 */
export function checkTask(task) {
  if (!Object.hasOwn(TASK_PARAMS, /** @type {string} */ (task))) {
    throw new TypeError(`Unknown pooling task ${JSON.stringify(task)}; expected one of ${TASKS.join(', ')}`);
  }
}

/** @param {unknown} value */
const isSet = (value) => value !== undefined && value !== null;

/**
 * Throw if `params` cannot be used for `task` (like vLLM's PoolingParams.verify): a TypeError
 * for an unknown key, a wrong type, a task mismatch or a parameter the task does not take, a
 * RangeError for an out-of-range value.
 * @param {PoolingParams} params
 * @param {string} task
 */
export function verifyParams(params, task) {
  checkTask(task);
  if (typeof params !== 'object' || params === null || Array.isArray(params)) {
    throw new TypeError('poolingParams must be an object');
  }
  const unknown = Object.keys(params).filter((key) => !KNOWN_KEYS.has(key));
  if (unknown.length > 0) {
    throw new TypeError(
      `Unknown PoolingParams keys ${unknown.join(', ')}; expected some of ${[...KNOWN_KEYS].join(', ')}`,
    );
  }
  if (isSet(params.task)) {
    checkTask(params.task);
    if (params.task !== task) {
      throw new TypeError(`You cannot overwrite task=${params.task} with task=${task}`);
    }
  }
  const allowed = TASK_PARAMS[/** @type {keyof TASK_PARAMS} */ (task)];
  const invalid = [...Object.keys(WIRE_FIELDS), 'outputWeights'].filter(
    (key) => isSet(params[/** @type {keyof PoolingParams} */ (key)]) && !allowed.includes(key),
  );
  if (invalid.length > 0) {
    throw new TypeError(
      `Task ${task} only supports [${allowed.join(', ')}] parameters, does not support [${invalid.join(', ')}] parameters`,
    );
  }
  if (isSet(params.useActivation) && typeof params.useActivation !== 'boolean') {
    throw new TypeError(`useActivation must be a boolean, got ${typeof params.useActivation}`);
  }
  for (const key of /** @type {const} */ (['dimensions', 'truncatePromptTokens'])) {
    if (isSet(params[key]) && !Number.isInteger(params[key])) {
      throw new TypeError(`${key} must be an integer, got ${params[key]}`);
    }
  }
  if (isSet(params.dimensions) && /** @type {number} */ (params.dimensions) < 1) {
    throw new RangeError(`dimensions must be >= 1, got ${params.dimensions}`);
  }
  if (isSet(params.outputWeights)) verifyOutputWeights(params.outputWeights);
  const tpt = params.truncatePromptTokens;
  if (isSet(tpt) && (/** @type {number} */ (tpt) < -1 || tpt === 0)) {
    throw new RangeError(`truncatePromptTokens must be -1 or >= 1, got ${tpt}`);
  }
}

/**
 * Throw unless `weights` is {dense?, sparse?, multi?} of finite numbers >= 0, one of them > 0.
 * @param {unknown} weights
 */
function verifyOutputWeights(weights) {
  if (typeof weights !== 'object' || weights === null || Array.isArray(weights)) {
    throw new TypeError('outputWeights must be an object {dense, sparse, multi}');
  }
  const given = /** @type {Record<string, unknown>} */ (weights);
  const unknown = Object.keys(given).filter((key) => !OUTPUT_NAMES.includes(key));
  if (unknown.length > 0) throw new TypeError(`Unknown outputWeights keys ${unknown.join(', ')}`);
  const values = OUTPUT_NAMES.map((name) => given[name] ?? 0);
  if (values.some((value) => typeof value !== 'number')) throw new TypeError('outputWeights values must be numbers');
  const numbers = /** @type {number[]} */ (values);
  if (numbers.some((value) => !Number.isFinite(value) || value < 0) || !numbers.some((value) => value > 0)) {
    throw new RangeError(`outputWeights must be finite and >= 0, at least one > 0; got ${numbers.join(', ')}`);
  }
}

/**
 * The wire PoolingParams for `task`; only keys that are set are sent. The wire task is
 * `params.task` when set, else `task`. This does not verify, so params the server should
 * reject can still be sent as given (see the `validate: false` call option).
 * @param {PoolingParams} params
 * @param {string} task
 * @returns {Record<string, unknown>}
 */
export function paramsToWire(params, task) {
  checkTask(task);
  const wireTask = isSet(params.task) ? params.task : task;
  checkTask(wireTask);
  /** @type {Record<string, unknown>} */
  const message = { task: TASK_ENUM[/** @type {keyof TASK_ENUM} */ (wireTask)] };
  for (const [key, field] of Object.entries(WIRE_FIELDS)) {
    const value = params[/** @type {keyof PoolingParams} */ (key)];
    if (isSet(value)) message[field] = value;
  }
  if (isSet(params.adapter) && params.adapter !== '') message.adapter = params.adapter;
  if (params.bypassCache === true) message.bypass_cache = true;
  const weights = params.outputWeights;
  if (isSet(weights)) {
    message.output_weights = Object.fromEntries(
      OUTPUT_NAMES.map((name) => [name, /** @type {Record<string, number>} */ (weights)[name] ?? 0]),
    );
  }
  return message;
}
