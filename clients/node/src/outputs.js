// Conversion of wire messages into plain result objects shaped like the Python client's (and
// vLLM's) pooling outputs, with camelCase keys.
//
// Every converter turns one PoolResponse into one request output per input text (or text
// pair), in input order; request ids are "<request id>-<input index>".

import { decodeRows, encodingName } from './encodings.js';

/**
 * @typedef {object} EmbeddingOutput
 * @property {number[]} embedding the values; with encoding "int8"/"uint8" one integer level
 *   per value, with "binary"/"ubinary" one integer per 8 values (the packed bits, as
 *   sentence-transformers' quantize_embeddings returns them)
 * @property {string|null} [encoding] the encoding it travelled in; absent for repeated floats
 * @property {number} [dimensions] values in the vector (before any bit packing)
 * @property {Uint8Array} [data] the packed bytes as they came (see decodeValues)
 *
 * @typedef {object} EmbeddingRequestOutput
 * @property {string} requestId
 * @property {EmbeddingOutput} outputs
 *
 * @typedef {object} ClassificationRequestOutput
 * @property {string} requestId
 * @property {{probs: number[], labelId: number, label: string}} outputs
 *
 * @typedef {object} ScoringRequestOutput
 * @property {string} requestId
 * @property {{score: number}} outputs
 *
 * @typedef {object} PoolingOutput One text's per-token output.
 * @property {number[][]} data one row per token
 * @property {number[]} tokenIds
 * @property {Array<[number, number]>} offsets [start, end) code-point spans
 * @property {boolean[]} specialTokensMask
 * @property {number[]} labelIds token_classify only
 * @property {string[]} labels token_classify only
 * @property {string|null} [encoding] token_embed with an encoding: data holds its decoded values
 *   (the packed bits of each row for "binary"/"ubinary")
 *
 * @typedef {object} PoolingRequestOutput
 * @property {string} requestId
 * @property {PoolingOutput} outputs
 *
 * @typedef {object} ModelInfo One served model (a ModelCard).
 * @property {string} name
 * @property {string[]} tasks short names such as "embed"
 * @property {number} hiddenSize
 * @property {number} maxInputTokens
 * @property {boolean} isMatryoshka
 * @property {number[]} matryoshkaDimensions
 * @property {string[]} labels
 * @property {string|null} poolingType "mean", "cls", "last", "all", or null when unreported
 * @property {boolean} defaultUseActivation
 * @property {boolean} isDefault
 * @property {string} architecture
 * @property {string} truncationSide
 * @property {string} longInput
 * @property {boolean} hasCalibrationRanges whether the "int8" and "uint8" encodings are available
 *
 * @typedef {object} RerankResult One document's place in a ranking.
 * @property {number} index its position in the documents sent
 * @property {number} relevanceScore higher is more relevant
 * @property {string|null} document its text, when returnDocuments was set
 *
 * @typedef {object} RerankOutput A rerank's results, most relevant first.
 * @property {string} requestId
 * @property {string} model
 * @property {RerankResult[]} results
 * @property {{promptTokens: number, totalTokens: number}} usage
 *
 * @typedef {object} TokenizeOutput
 * @property {number[]} tokenIds
 * @property {string[]} tokens
 * @property {Array<[number, number]>} offsets
 */

/**
 * Short lower-case name of an enum value ("POOLING_TASK_EMBED" -> "embed"); numbers a newer
 * server might send come back as their decimal string.
 * @param {string|number} value
 * @param {string} prefix
 */
function enumSuffix(value, prefix) {
  const name = String(value);
  return name.startsWith(prefix) ? name.slice(prefix.length).toLowerCase() : name;
}

/** @param {Array<{start: number, end: number}>} spans */
const spans = (spans) => (spans ?? []).map((span) => /** @type {[number, number]} */ ([span.start, span.end]));

/**
 * The response's output message, checking its case is one of `cases`.
 * @param {any} response
 * @param {string[]} cases
 */
function outputOf(response, cases) {
  const which = response.output;
  if (!cases.includes(which)) {
    throw new Error(`PoolResponse carries output ${JSON.stringify(which)}, expected ${cases.join(' or ')}`);
  }
  return response[which];
}

/**
 * Reshape a row-major TokenMatrix into rows.
 * @param {{rows: number, cols: number, values: number[], data?: Uint8Array, encoding?: string}} matrix
 * @returns {number[][]}
 */
export function matrixRows(matrix) {
  const { rows, cols } = matrix;
  const encoding = encodingName(matrix.encoding);
  if (encoding !== null) return decodeRows(matrix.data, encoding, cols, rows);
  const values = matrix.values ?? [];
  if (rows < 0 || cols < 0 || values.length !== rows * cols) {
    throw new Error(`TokenMatrix has ${values.length} values, expected rows*cols = ${rows}*${cols}`);
  }
  return Array.from({ length: rows }, (_, r) => values.slice(r * cols, (r + 1) * cols));
}

/** @type {Record<string, (response: any) => any[]>} */
const CONVERTERS = {
  embed: (response) =>
    outputOf(response, ['embed']).embeddings.map((/** @type {any} */ e, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: embeddingOutput(e),
    })),
  classify: (response) =>
    outputOf(response, ['classify']).classifications.map((/** @type {any} */ c, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: { probs: [...c.probs], labelId: c.label_id, label: c.label },
    })),
  score: (response) =>
    outputOf(response, ['score']).scores.map((/** @type {number} */ score, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: { score },
    })),
  token_embed: tokenOutputs,
  token_classify: tokenOutputs,
};

/**
 * One Embedding message as an EmbeddingOutput, decoding packed data.
 * @param {any} embedding
 * @returns {EmbeddingOutput}
 */
function embeddingOutput(embedding) {
  const encoding = encodingName(embedding.encoding);
  if (encoding === null) return { embedding: [...embedding.values] };
  const { data, dimensions } = embedding;
  return { embedding: decodeRows(data, encoding, dimensions, 1)[0], encoding, dimensions, data };
}

/**
 * @param {any} response
 * @returns {PoolingRequestOutput[]}
 */
function tokenOutputs(response) {
  return outputOf(response, ['token_embed', 'token_classify']).items.map(
    (/** @type {any} */ matrix, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: {
        data: matrixRows(matrix),
        tokenIds: [...matrix.token_ids],
        offsets: spans(matrix.offsets),
        specialTokensMask: [...matrix.special_tokens_mask],
        labelIds: [...matrix.label_ids],
        labels: [...matrix.labels],
        ...(encodingName(matrix.encoding) === null ? {} : { encoding: encodingName(matrix.encoding) }),
      },
    }),
  );
}

/**
 * Convert a PoolResponse into `task`'s request outputs, checking there are `expected` of them.
 * @param {string} task
 * @param {any} response
 * @param {number} expected
 * @returns {any[]}
 */
export function convertOutputs(task, response, expected) {
  const outputs = CONVERTERS[task](response);
  if (outputs.length !== expected) {
    throw new Error(`PoolResponse ${JSON.stringify(response.request_id)} has ${outputs.length} outputs, expected ${expected}`);
  }
  return outputs;
}

/**
 * One ModelInfo per served model, the default first (server order).
 * @param {any} response a ListModelsResponse
 * @returns {ModelInfo[]}
 */
export function modelInfos(response) {
  return response.models.map((/** @type {any} */ card) => ({
    name: card.name,
    tasks: card.tasks
      .filter((/** @type {string} */ task) => task !== 'POOLING_TASK_UNSPECIFIED')
      .map((/** @type {string} */ task) => enumSuffix(task, 'POOLING_TASK_')),
    hiddenSize: card.hidden_size,
    maxInputTokens: card.max_input_tokens,
    isMatryoshka: card.is_matryoshka,
    matryoshkaDimensions: [...card.matryoshka_dimensions],
    labels: [...card.labels],
    poolingType:
      card.pooling_type === 'POOLING_TYPE_UNSPECIFIED' ? null : enumSuffix(card.pooling_type, 'POOLING_TYPE_'),
    defaultUseActivation: card.default_use_activation,
    isDefault: card.is_default,
    architecture: card.architecture,
    truncationSide: card.truncation_side,
    longInput: card.long_input,
    hasCalibrationRanges: card.has_calibration_ranges,
  }));
}

/**
 * One TokenizeOutput per input text.
 * @param {any} response a TokenizeResponse
 * @returns {TokenizeOutput[]}
 */
export function tokenizeOutputs(response) {
  return response.items.map((/** @type {any} */ item) => ({
    tokenIds: [...item.token_ids],
    tokens: [...item.tokens],
    offsets: spans(item.offsets),
  }));
}

/**
 * Convert a RerankResponse to a request of `documents` documents, checking it holds
 * min(topN, documents) distinct indices in range (topN 0: every document).
 * @param {any} response a RerankResponse
 * @param {number} documents
 * @param {number} topN
 * @returns {RerankOutput}
 */
export function rerankOutput(response, documents, topN) {
  const expected = topN > 0 ? Math.min(topN, documents) : documents;
  const results = response.results.map((/** @type {any} */ item) => ({
    index: item.index,
    relevanceScore: item.relevance_score,
    document: item.document ?? null,
  }));
  const indices = new Set(results.map((/** @type {RerankResult} */ r) => r.index));
  const inRange = [...indices].every((i) => Number.isInteger(i) && i >= 0 && i < documents);
  if (results.length !== expected || indices.size !== expected || !inRange) {
    throw new Error(
      `RerankResponse ${JSON.stringify(response.request_id)} does not rank ${expected} distinct documents of ${documents}: indices ${JSON.stringify(results.map((/** @type {RerankResult} */ r) => r.index))}`,
    );
  }
  return {
    requestId: response.request_id,
    model: response.model,
    results,
    usage: { promptTokens: response.usage?.prompt_tokens ?? 0, totalTokens: response.usage?.total_tokens ?? 0 },
  };
}
