// PoolingError: a failed call with the server's rich error details decoded.
//
// The server attaches a google.rpc.Status to every failure: an ErrorInfo (a stable `reason`
// such as "DIMENSIONS_NOT_SUPPORTED"), for bad input a BadRequest naming the offending fields,
// and for overload a RetryInfo. Unary calls carry it in the `grpc-status-details-bin` trailer,
// streams in-band (PoolStreamResponse.error). Both become one PoolingError.

import { status as grpcStatus } from '@grpc/grpc-js';

import { errorTypes } from './proto.js';

/** The trailing-metadata key that carries a serialized google.rpc.Status. */
export const STATUS_DETAILS_KEY = 'grpc-status-details-bin';

/** @type {Record<number, string>} numeric gRPC status code -> name, e.g. 5 -> "NOT_FOUND". */
export const CODE_NAMES = Object.freeze(
  Object.fromEntries(
    Object.entries(grpcStatus)
      .filter(([, value]) => typeof value === 'number')
      .map(([name, value]) => [value, name]),
  ),
);

/**
 * @typedef {object} FieldViolation
 * @property {string} field e.g. "params.dimensions"
 * @property {string} description
 * @property {string} reason
 */

/**
 * @typedef {object} RpcStatus A google.rpc.Status as plain data.
 * @property {number} code
 * @property {string} [message]
 * @property {Array<{type_url: string, value: Uint8Array}>} [details]
 */

/** A call that failed on the server (or on the way to it). */
export class PoolingError extends Error {
  /**
   * @param {number} code numeric gRPC status code
   * @param {string} message the server's message
   * @param {object} [extra]
   * @param {string|null} [extra.reason] ErrorInfo.reason
   * @param {string|null} [extra.domain] ErrorInfo.domain ("pooling.v1")
   * @param {Record<string, string>} [extra.metadata] ErrorInfo.metadata
   * @param {FieldViolation[]} [extra.fieldViolations] BadRequest.field_violations
   * @param {number|null} [extra.retryDelayMs] RetryInfo.retry_delay in milliseconds
   * @param {unknown} [extra.cause] the underlying gRPC error
   */
  constructor(code, message, extra = {}) {
    super(message, extra.cause === undefined ? undefined : { cause: extra.cause });
    this.name = 'PoolingError';
    /** @type {number} */
    this.code = code;
    /** @type {string} e.g. "INVALID_ARGUMENT" */
    this.codeName = CODE_NAMES[code] ?? 'UNKNOWN';
    /** @type {string} the server's message, without the decorations of `message` */
    this.details = message;
    /** @type {string|null} */
    this.reason = extra.reason ?? null;
    /** @type {string|null} */
    this.domain = extra.domain ?? null;
    /** @type {Record<string, string>} */
    this.metadata = { ...(extra.metadata ?? {}) };
    /** @type {FieldViolation[]} */
    this.fieldViolations = [...(extra.fieldViolations ?? [])];
    /** @type {number|null} */
    this.retryDelayMs = extra.retryDelayMs ?? null;
    this.#describe();
  }

  /** Rebuild `message` ("CODE: details [reason=...] ...") from the fields. */
  #describe() {
    this.message = this.toString().slice(`${this.name}: `.length);
  }

  /** A one-line description with the reason, field violations and retry delay. */
  toString() {
    let text = `${this.name}: ${this.codeName}: ${this.details}`;
    if (this.reason) text += ` [reason=${this.reason}]`;
    if (this.fieldViolations.length > 0) {
      const violations = this.fieldViolations.map((v) => `${v.field}: ${v.description}`).join('; ');
      text += ` (field violations: ${violations})`;
    }
    if (this.retryDelayMs !== null) text += ` (retry after ${this.retryDelayMs}ms)`;
    return text;
  }

  /**
   * Build from a google.rpc.Status given as plain data (e.g. an in-band
   * PoolStreamResponse.error) or as its serialized bytes.
   * @param {RpcStatus|Uint8Array} status
   * @returns {PoolingError}
   */
  static fromStatus(status) {
    const decoded = status instanceof Uint8Array ? decodeStatus(status) : status;
    if (decoded === null) return new PoolingError(grpcStatus.UNKNOWN, 'malformed google.rpc.Status');
    const error = new PoolingError(decoded.code ?? grpcStatus.UNKNOWN, decoded.message ?? '');
    error.addDetails(decoded.details ?? []);
    return error;
  }

  /**
   * Build from a failed grpc-js call (a ServiceError), decoding the status details trailer.
   * Anything else (e.g. a local bug) is wrapped as UNKNOWN.
   * @param {any} serviceError
   * @returns {PoolingError}
   */
  static fromServiceError(serviceError) {
    if (serviceError instanceof PoolingError) return serviceError;
    const code = typeof serviceError?.code === 'number' ? serviceError.code : grpcStatus.UNKNOWN;
    let status = null;
    const metadata = serviceError?.metadata;
    if (metadata && typeof metadata.get === 'function') {
      const [raw] = metadata.get(STATUS_DETAILS_KEY);
      if (raw instanceof Uint8Array) status = decodeStatus(raw);
    }
    // The call's own code and message win; the trailer adds the details.
    const message =
      (typeof serviceError?.details === 'string' && serviceError.details) ||
      status?.message ||
      String(serviceError?.message ?? serviceError);
    const error = new PoolingError(code, message, { cause: serviceError });
    if (status !== null) error.addDetails(status.details ?? []);
    return error;
  }

  /**
   * Unpack the ErrorInfo, BadRequest and RetryInfo details; other detail types are ignored.
   * @param {Array<{type_url: string, value: Uint8Array}>} details google.protobuf.Any values
   */
  addDetails(details) {
    const root = errorTypes();
    for (const detail of details) {
      const typeName = String(detail.type_url ?? '').split('/').pop();
      let message;
      try {
        const type = root.lookupType(typeName);
        message = type.toObject(type.decode(detail.value), { longs: Number, defaults: true });
      } catch {
        continue; // an unknown or malformed detail must not hide the error itself
      }
      if (typeName === 'google.rpc.ErrorInfo') {
        this.reason = message.reason || null;
        this.domain = message.domain || null;
        this.metadata = { ...(message.metadata ?? {}) };
      } else if (typeName === 'google.rpc.BadRequest') {
        for (const violation of message.field_violations ?? []) {
          this.fieldViolations.push({
            field: violation.field,
            description: violation.description,
            reason: violation.reason ?? '',
          });
        }
      } else if (typeName === 'google.rpc.RetryInfo' && message.retry_delay) {
        const { seconds = 0, nanos = 0 } = message.retry_delay;
        this.retryDelayMs = Number(seconds) * 1000 + Number(nanos) / 1e6;
      }
    }
    this.#describe();
  }
}

/**
 * Parse serialized google.rpc.Status bytes; null when malformed.
 * @param {Uint8Array} bytes
 * @returns {RpcStatus|null}
 */
export function decodeStatus(bytes) {
  try {
    const type = errorTypes().lookupType('google.rpc.Status');
    return /** @type {RpcStatus} */ (type.toObject(type.decode(bytes), { defaults: true }));
  } catch {
    return null;
  }
}
