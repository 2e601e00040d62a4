// Node.js client for the pooling gRPC service (pooling.v1.PoolingService).
//
//   import { PoolingClient } from 'pooling-client';
//   const client = new PoolingClient('127.0.0.1:50051');
//   const [out] = await client.embed(['Hello world']);
//   out.outputs.embedding; // number[]

export { PoolingClient, channelTarget, DEFAULT_CHANNEL_OPTIONS, SERVICE_CONFIG } from './client.js';
export {
  ENCODINGS,
  bfloat16ToNumber,
  decodeRows,
  decodeValues,
  encodingName,
  float16ToNumber,
} from './encodings.js';
export { PoolingError, CODE_NAMES, STATUS_DETAILS_KEY, decodeStatus } from './errors.js';
export { TASKS, TASK_PARAMS, verifyParams, paramsToWire } from './params.js';
export { CHUNK_RULES, lateChunkingToWire } from './requests.js';
export { DEFAULT_PROTO_PATH, LOADER_OPTIONS, loadPoolingService, googleProtosDir } from './proto.js';
