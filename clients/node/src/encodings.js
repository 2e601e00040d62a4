// Decoding the packed embedding encodings (Embedding.data / TokenMatrix.data), as the schema's
// EmbeddingEncoding defines them:
//
// - float32 / float16: little-endian IEEE values, 4 / 2 bytes each.
// - bfloat16: the top 16 bits of a float32, 2 bytes each; decoded by shifting them back.
// - binary / ubinary: sentence-transformers' quantize_embeddings precisions: one bit per value
//   (1 where the value is > 0), packed most significant bit first, as int8 (binary: the byte
//   minus 128) or uint8 (ubinary); ceil(dimensions / 8) bytes per vector.
// - int8 / uint8: one calibrated level per value (quantize_embeddings with the model's ranges).

/** Encoding names accepted by embed/encode's `encoding` option, with their wire enum names. */
export const ENCODINGS = Object.freeze({
  float32: 'EMBEDDING_ENCODING_FLOAT32',
  float16: 'EMBEDDING_ENCODING_FLOAT16',
  bfloat16: 'EMBEDDING_ENCODING_BFLOAT16',
  binary: 'EMBEDDING_ENCODING_BINARY',
  ubinary: 'EMBEDDING_ENCODING_UBINARY',
  int8: 'EMBEDDING_ENCODING_INT8',
  uint8: 'EMBEDDING_ENCODING_UINT8',
});

/** Tasks whose outputs take an encoding. */
export const ENCODING_TASKS = Object.freeze(['embed', 'token_embed', 'embed_multi', 'embed_outputs']);

const WIRE_PREFIX = 'EMBEDDING_ENCODING_';
const BITS = new Set(['binary', 'ubinary']);
/** @type {Record<string, number>} */
const WIDTH = { float32: 4, float16: 2, bfloat16: 2, int8: 1, uint8: 1 };

/**
 * Throw unless `encoding` is undefined/null or a known name usable for `task`.
 * @param {unknown} encoding
 * @param {string} task
 */
export function checkEncoding(encoding, task) {
  if (encoding === undefined || encoding === null) return;
  if (typeof encoding !== 'string' || !Object.hasOwn(ENCODINGS, encoding)) {
    throw new TypeError(`Unknown encoding ${JSON.stringify(encoding)}; expected one of ${Object.keys(ENCODINGS).join(', ')}`);
  }
  if (!ENCODING_TASKS.includes(task)) {
    throw new TypeError(`encoding is only for embed and token_embed (and embed_multi, embed_outputs), not ${task}`);
  }
}

/**
 * The short name of a wire encoding ("EMBEDDING_ENCODING_FLOAT16" -> "float16"); null for
 * unspecified (repeated float values). An encoding this client does not know throws.
 * @param {string|number|undefined|null} wire
 * @returns {string|null}
 */
export function encodingName(wire) {
  if (wire === undefined || wire === null || wire === 'EMBEDDING_ENCODING_UNSPECIFIED' || wire === 0) return null;
  const name = String(wire).startsWith(WIRE_PREFIX) ? String(wire).slice(WIRE_PREFIX.length).toLowerCase() : '';
  if (!Object.hasOwn(ENCODINGS, name)) {
    throw new Error(`unknown embedding encoding ${JSON.stringify(wire)}: upgrade the pooling client`);
  }
  return name;
}

/**
 * Bytes one vector of `dimensions` values takes in `encoding`.
 * @param {string} encoding
 * @param {number} dimensions
 */
export function rowBytes(encoding, dimensions) {
  return BITS.has(encoding) ? Math.ceil(dimensions / 8) : WIDTH[encoding] * dimensions;
}

/**
 * Decoded values per vector: `dimensions`, or its packed bytes for the bit encodings.
 * @param {string} encoding
 * @param {number} dimensions
 */
export function rowWidth(encoding, dimensions) {
  return BITS.has(encoding) ? Math.ceil(dimensions / 8) : dimensions;
}

/**
 * An IEEE half-precision bit pattern as a number.
 * @param {number} half
 */
export function float16ToNumber(half) {
  const sign = half & 0x8000 ? -1 : 1;
  const exponent = (half >> 10) & 0x1f;
  const fraction = half & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24; // zero and subnormals
  if (exponent === 0x1f) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

const scratch = new DataView(new ArrayBuffer(4));

/**
 * A bfloat16 bit pattern as a number: the top half of a float32.
 * @param {number} bits
 */
export function bfloat16ToNumber(bits) {
  scratch.setUint32(0, (bits << 16) >>> 0, true);
  return scratch.getFloat32(0, true);
}

/**
 * Decode `rows` vectors of `dimensions` values into one typed array, row-major: Float32Array
 * for float32, float16 and bfloat16 (each widens exactly), Int8Array for binary and int8,
 * Uint8Array for ubinary and uint8 (the bit encodings hold ceil(dimensions / 8) packed bytes
 * per row, as quantize_embeddings returns them).
 * @param {Uint8Array} data
 * @param {string} encoding
 * @param {number} dimensions
 * @param {number} [rows]
 * @returns {Float32Array|Int8Array|Uint8Array}
 */
export function decodeValues(data, encoding, dimensions, rows = 1) {
  const bytes = data ?? new Uint8Array(0);
  const expected = rows * rowBytes(encoding, dimensions);
  if (bytes.length !== expected) {
    throw new Error(`${encoding} data of ${rows} x ${dimensions} values should hold ${expected} bytes, got ${bytes.length}`);
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const count = rows * rowWidth(encoding, dimensions);
  switch (encoding) {
    case 'float32': {
      const out = new Float32Array(count);
      for (let i = 0; i < count; i++) out[i] = view.getFloat32(4 * i, true);
      return out;
    }
    case 'float16': {
      const out = new Float32Array(count);
      for (let i = 0; i < count; i++) out[i] = float16ToNumber(view.getUint16(2 * i, true));
      return out;
    }
    case 'bfloat16': {
      const out = new Float32Array(count);
      for (let i = 0; i < count; i++) out[i] = bfloat16ToNumber(view.getUint16(2 * i, true));
      return out;
    }
    case 'binary':
    case 'int8':
      return new Int8Array(bytes.buffer, bytes.byteOffset, count).slice();
    case 'ubinary':
    case 'uint8':
      return new Uint8Array(bytes.buffer, bytes.byteOffset, count).slice();
    default:
      throw new Error(`unknown embedding encoding ${JSON.stringify(encoding)}`);
  }
}

/**
 * Decode a vector or a token matrix into row arrays of plain numbers.
 * @param {Uint8Array} data
 * @param {string} encoding
 * @param {number} dimensions
 * @param {number} rows
 * @returns {number[][]}
 */
export function decodeRows(data, encoding, dimensions, rows) {
  const values = decodeValues(data, encoding, dimensions, rows);
  const width = rowWidth(encoding, dimensions);
  return Array.from({ length: rows }, (_, r) => Array.from(values.subarray(r * width, (r + 1) * width)));
}
