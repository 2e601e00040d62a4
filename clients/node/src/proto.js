// Loading the service contract (pooling.proto) and the google.rpc error detail types.
//
// An installed package carries its .proto files in proto/ (bundled by `npm pack`, see
// scripts/bundle-protos.js). In the repository, where proto/ is not committed, pooling.proto
// is read from protos/ and the google/rpc and google/protobuf files from the pinned
// `google-proto-files` dev dependency, so no copy lives in the repository.

import { existsSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const require = createRequire(import.meta.url);
const HERE = path.dirname(fileURLToPath(import.meta.url));

const BUNDLED = path.resolve(HERE, '..', 'proto');

/** The packaged pooling.proto, or else the repository's, resolved relative to this module. */
export const DEFAULT_PROTO_PATH = existsSync(path.join(BUNDLED, 'pooling', 'v1', 'pooling.proto'))
  ? path.join(BUNDLED, 'pooling', 'v1', 'pooling.proto')
  : path.resolve(HERE, '..', '..', '..', 'protos', 'pooling', 'v1', 'pooling.proto');

/** proto-loader options; keep them in sync with the README. */
export const LOADER_OPTIONS = Object.freeze({
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});

/**
 * The folder holding google/rpc/*.proto and google/protobuf/*.proto: the packaged proto/,
 * or else the google-proto-files package.
 * @returns {string}
 */
export function googleProtosDir() {
  if (existsSync(path.join(BUNDLED, 'google', 'rpc', 'status.proto'))) {
    return BUNDLED;
  }
  const dir = path.dirname(require.resolve('google-proto-files/package.json'));
  if (!existsSync(path.join(dir, 'google', 'rpc', 'status.proto'))) {
    throw new Error(`google-proto-files at ${dir} has no google/rpc/status.proto`);
  }
  return dir;
}

/** @type {Map<string, any>} */
const serviceCache = new Map();

/**
 * The PoolingService client constructor generated from pooling.proto.
 *
 * @param {{protoPath?: string, includeDirs?: string[]}} [options]
 *   protoPath: the pooling.proto to load (default: the repository's copy).
 *   includeDirs: import roots; default: the folder two levels above the proto's own folder
 *   (the one holding pooling/v1/) plus google-proto-files.
 * @returns {{Service: grpc.ServiceClientConstructor, RepositoryService: grpc.ServiceClientConstructor, packageDefinition: protoLoader.PackageDefinition}}
 */
export function loadPoolingService(options = {}) {
  const protoPath = path.resolve(options.protoPath ?? DEFAULT_PROTO_PATH);
  const includeDirs = options.includeDirs ?? [
    path.resolve(path.dirname(protoPath), '..', '..'),
    googleProtosDir(),
  ];
  const key = JSON.stringify([protoPath, includeDirs]);
  let loaded = serviceCache.get(key);
  if (loaded === undefined) {
    const packageDefinition = protoLoader.loadSync(protoPath, { ...LOADER_OPTIONS, includeDirs });
    const grpcObject = grpc.loadPackageDefinition(packageDefinition);
    const Service = /** @type {any} */ (grpcObject).pooling.v1.PoolingService;
    // Models at run time (served with --admin-key): Load, Unload, List.
    const RepositoryService = /** @type {any} */ (grpcObject).pooling.v1.ModelRepositoryService;
    loaded = { Service, RepositoryService, packageDefinition };
    serviceCache.set(key, loaded);
  }
  return loaded;
}

/** @type {protobuf.Root | undefined} */
let errorRoot;

/**
 * A protobufjs Root with google.rpc.Status, ErrorInfo, BadRequest, RetryInfo (and the rest of
 * error_details.proto), read from google-proto-files.
 * @returns {protobuf.Root}
 */
export function errorTypes() {
  if (errorRoot === undefined) {
    const dir = googleProtosDir();
    const root = new protobuf.Root();
    root.resolvePath = (origin, target) => {
      const candidate = path.join(dir, target);
      return existsSync(candidate) ? candidate : protobuf.util.path.resolve(origin, target);
    };
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
    root.resolveAll();
    errorRoot = root;
  }
  return errorRoot;
}
