// Conversion of wire messages into plain result objects shaped like the Python client's (and
// vLLM's) pooling outputs, with camelCase keys.
//
// Every converter turns one PoolResponse into one request output per input text (or text
// pair), in input order; request ids are "<request id>-<input index>".

import { decodeRows, decodeValues, encodingName } from './encodings.js';

/**
 * @typedef {object} EmbeddingOutput
 * @property {number[]} embedding the values; with encoding "int8"/"uint8" one integer level
 *   per value, with "binary"/"ubinary" one integer per 8 values (the packed bits, as
 *   sentence-transformers' quantize_embeddings returns them)
 * @property {string|null} [encoding] the encoding it travelled in; absent for repeated floats
 * @property {number} [dimensions] values in the vector (before any bit packing)
 * @property {Uint8Array} [data] the packed bytes as they came (see decodeValues)
 * @property {string} [modality] "text", "image" or "audio", where a two-tower model answered
 *
 * @typedef {object} ChunkedEmbeddingOutput One text's late chunks (embed with lateChunking).
 * @property {Array<[number, number]>} spans each chunk's character span [start, end)
 * @property {EmbeddingOutput[]} embeddings each chunk's embedding, in chunk order
 *
 * @typedef {object} EmbeddingRequestOutput
 * @property {string} requestId
 * @property {EmbeddingOutput|ChunkedEmbeddingOutput} outputs
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
 * @typedef {object} MultiVectorOutput One text's ColBERT matrix (embed_multi).
 * @property {Float32Array|Int8Array|Uint8Array} data rows x cols values, row-major, decoded as
 *   decodeValues does: Float32Array for float32 (the default), float16 and bfloat16; the
 *   integer encodings as integers, the bit encodings as ceil(cols / 8) packed bytes per row
 * @property {number} rows tokens kept
 * @property {number} cols values per row (the projection's width)
 * @property {string} encoding the encoding it travelled in ("float32" unless one was asked)
 *
 * @typedef {object} MultiVectorRequestOutput
 * @property {string} requestId
 * @property {MultiVectorOutput} outputs
 *
 * @typedef {object} MultiVectorSettings A ColBERT model's modes (ModelCard.multi_vector).
 * @property {string} queryPrefix prepended to queries, e.g. "[Q] "
 * @property {string} documentPrefix prepended to documents, e.g. "[D] "
 * @property {number} queryLength tokens per query (0: none)
 * @property {number} documentLength most tokens of a document (0: the model's maximum)
 * @property {boolean} queryExpansion whether queries are filled with mask tokens
 * @property {boolean} attendToExpansionTokens whether the other tokens attend to them
 * @property {string[]} skiplistWords words left out of documents' matrices
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
 * @property {Record<string, string>} prompts prompts by name, for the promptName option
 * @property {string} defaultPromptName the prompt used when a call names none ("": none)
 * @property {string} dtype e.g. "float32"
 * @property {string} device e.g. "cpu" or "cuda:0"
 * @property {string} revision the hub revision ("" for a local folder)
 * @property {string} backend what runs the forward: "torch", "onnx" or "openvino"
 * @property {string} precision e.g. "float32" or "int8"
 * @property {string} backendFile the export file the backend runs ("" for torch)
 * @property {number} enginesPerDevice engine processes serving the model on each device
 * @property {string} calibrationSource where the int8/uint8 ranges came from: "folder",
 *   "computed" (from calibration texts at load), or "" when there are none
 * @property {string} scoreTemplateSource an LLM reranker's template origin
 *   ("--score-template", "score_template.json" or "chat_template"); "" for other models
 * @property {MultiVectorSettings|null} multiVector a ColBERT model's modes; null for others
 * @property {string} state "loaded" for a served model
 * @property {number} memoryBytes what its weights take in memory (per engine)
 * @property {string[]} modalities the inputs it takes: "text", and "image" for CLIP and
 *   SigLIP models, "audio" for CLAP models (["text"] from a server that does not say)
 * @property {number} imageSize an image model's input size in pixels; 0 for others
 * @property {string[]} outputs a multi-output (bge-m3) model's outputs ("dense", "sparse",
 *   "multi"); [] for others
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
 * @property {{promptTokens: number, totalTokens: number, cachedTokens: number}} usage
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
  embed: (response) => {
    const output = outputOf(response, ['embed']);
    if ((output.chunked ?? []).length > 0) {
      // late chunking: one list of chunks per text
      return output.chunked.map((/** @type {any} */ text, /** @type {number} */ i) => ({
        requestId: `${response.request_id}-${i}`,
        outputs: {
          spans: spans(text.chunks.map((/** @type {any} */ chunk) => chunk.span)),
          embeddings: text.chunks.map((/** @type {any} */ chunk) => embeddingOutput(chunk.embedding)),
        },
      }));
    }
    return output.embeddings.map((/** @type {any} */ e, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: embeddingOutput(e),
    }));
  },
  classify: (response) =>
    outputOf(response, ['classify']).classifications.map((/** @type {any} */ c, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: { probs: [...c.probs], labelId: c.label_id, label: c.label, ...modalityOf(c.modality) },
    })),
  score: (response) =>
    outputOf(response, ['score']).scores.map((/** @type {number} */ score, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: { score },
    })),
  token_embed: tokenOutputs,
  token_classify: tokenOutputs,
  embed_outputs: (response) =>
    outputOf(response, ['embed_outputs']).items.map((/** @type {any} */ item, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: textOutputs(item),
    })),
  embed_multi: (response) =>
    outputOf(response, ['embed_multi']).items.map((/** @type {any} */ matrix, /** @type {number} */ i) => ({
      requestId: `${response.request_id}-${i}`,
      outputs: multiVectorOutput(matrix),
    })),
};

/**
 * One MultiVectorMatrix as a MultiVectorOutput: its bytes decoded into one typed array, so a
 * long document's matrix costs no array of arrays. The bytes are float32 when the request
 * named no encoding.
 * @param {any} matrix
 * @returns {MultiVectorOutput}
 */
export function multiVectorOutput(matrix) {
  const encoding = encodingName(matrix.encoding) ?? 'float32';
  const { rows, cols } = matrix;
  return { data: decodeValues(matrix.data, encoding, cols, rows), rows, cols, encoding };
}

/**
 * @typedef {object} TextOutputs One text's outputs of a multi-output (bge-m3) model: those
 *   asked for, the others null.
 * @property {number[]|null} dense the dense vector
 * @property {{indices: number[], values: number[], tokens: string[]}|null} sparse the lexical
 *   weights, by decreasing weight (tokens when asked for)
 * @property {MultiVectorOutput|null} multi the ColBERT matrix
 */

/**
 * @param {any} item a TextOutputs message
 * @returns {TextOutputs}
 */
function textOutputs(item) {
  const { dense, sparse, multi } = item;
  return {
    dense: dense ? embeddingOutput(dense).embedding : null,
    sparse: sparse ? { indices: [...sparse.indices], values: [...sparse.values], tokens: [...sparse.tokens] } : null,
    multi: multi ? multiVectorOutput(multi) : null,
  };
}

/**
 * One Embedding message as an EmbeddingOutput, decoding packed data.
 * @param {any} embedding
 * @returns {EmbeddingOutput}
 */
function embeddingOutput(embedding) {
  const encoding = encodingName(embedding.encoding);
  const kind = modalityOf(embedding.modality);
  if (encoding === null) return { embedding: [...embedding.values], ...kind };
  const { data, dimensions } = embedding;
  return { embedding: decodeRows(data, encoding, dimensions, 1)[0], encoding, dimensions, data, ...kind };
}

/**
 * {modality: "text"|"image"|"audio"} where a two-tower model answered (it sets each result's
 * Modality); {} for a text model's answer, which leaves it unset.
 * @param {unknown} value
 * @returns {{modality?: string}}
 */
function modalityOf(value) {
  if (value === undefined || value === null || value === 'MODALITY_UNSPECIFIED' || value === 0) return {};
  return { modality: enumSuffix(value, 'MODALITY_') };
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
    prompts: { ...(card.prompts ?? {}) },
    defaultPromptName: card.default_prompt_name ?? '',
    dtype: card.dtype ?? '',
    device: card.device ?? '',
    revision: card.revision ?? '',
    backend: card.backend ?? '',
    precision: card.precision ?? '',
    backendFile: card.backend_file ?? '',
    enginesPerDevice: card.engines_per_device || 1,
    calibrationSource: card.calibration_source ?? '',
    scoreTemplateSource: card.score_template_source ?? '',
    multiVector: multiVectorSettings(card.multi_vector),
    modalities: modalities(card.modalities),
    imageSize: card.image_size ?? 0,
    outputs: [...(card.outputs ?? [])],
    state: modelState(card.state) || 'loaded',
    memoryBytes: Number(card.memory_bytes ?? 0),
  }));
}

/**
 * @typedef {object} RepositoryModel One model the server's repository knows.
 * @property {string} name
 * @property {string} state "loaded", "loading", "available", "failed" or "unloading"
 * @property {string} source the folder or hub id it loads from
 * @property {number} memoryBytes what its weights take (per engine) while loaded
 * @property {string} reason why its last load failed
 * @property {number} retryAfterS seconds until a failed model may be tried again
 * @property {number} loadSeconds
 * @property {number} inFlight calls in flight on it
 * @property {boolean} pinned given with --model: never evicted
 * @property {ModelInfo|null} info the served model's card, where the answer carried it
 * @property {string} parent a LoRA adapter: the model it runs on ('' for a model)
 */

/**
 * @param {string|undefined} state a ModelState name
 * @returns {string}
 */
function modelState(state) {
  return !state || state === 'MODEL_STATE_UNSPECIFIED' ? '' : enumSuffix(state, 'MODEL_STATE_');
}

/**
 * @param {any} model a RepositoryModel message
 * @param {ModelInfo|null} info
 * @returns {RepositoryModel}
 */
export function repositoryModel(model, info) {
  return {
    name: model.name,
    state: modelState(model.state),
    source: model.source ?? '',
    memoryBytes: Number(model.memory_bytes ?? 0),
    reason: model.reason ?? '',
    retryAfterS: model.retry_after_s ?? 0,
    loadSeconds: model.load_seconds ?? 0,
    inFlight: model.in_flight ?? 0,
    pinned: model.pinned ?? false,
    info,
    parent: model.parent ?? '',
  };
}

/**
 * Every model a ListModelsResponse names: the served ones (loaded, with their info), then
 * the repository's others.
 * @param {any} response
 * @returns {RepositoryModel[]}
 */
export function repositoryModels(response) {
  const cards = response.models ?? [];
  const served = modelInfos(response).map((info, k) => ({
    ...repositoryModel({ name: info.name, state: 'MODEL_STATE_LOADED', parent: cards[k]?.parent }, info),
    memoryBytes: info.memoryBytes,
  }));
  return [...served, ...(response.repository ?? []).map((model) => repositoryModel(model, null))];
}

/**
 * A ModelCard's modalities as short names ("text", "image"); none (a server from before
 * images): text.
 * @param {Array<string|number>|undefined} values
 * @returns {string[]}
 */
function modalities(values) {
  const names = (values ?? [])
    .filter((value) => value !== 'MODALITY_UNSPECIFIED' && value !== 0)
    .map((value) => enumSuffix(value, 'MODALITY_'));
  return names.length > 0 ? names : ['text'];
}

/**
 * A ModelCard's multi_vector message in camelCase; null when the card has none.
 * @param {any} settings
 * @returns {MultiVectorSettings|null}
 */
function multiVectorSettings(settings) {
  if (settings === undefined || settings === null) return null;
  return {
    queryPrefix: settings.query_prefix,
    documentPrefix: settings.document_prefix,
    queryLength: settings.query_length,
    documentLength: settings.document_length,
    queryExpansion: settings.query_expansion,
    attendToExpansionTokens: settings.attend_to_expansion_tokens,
    skiplistWords: [...settings.skiplist_words],
  };
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
    usage: {
      promptTokens: response.usage?.prompt_tokens ?? 0,
      totalTokens: response.usage?.total_tokens ?? 0,
      cachedTokens: response.usage?.cached_tokens ?? 0,
    },
  };
}
