#!/usr/bin/env node
// Copy the .proto files the client loads into proto/, so that a packed package carries them:
// pooling/v1/pooling.proto from the repository and the google/rpc and google/protobuf files
// it imports from google-proto-files. Run by `npm pack` (prepack), and with --clean after it
// (postpack): a copy left in the repository would shadow protos/ as it changes.

import { copyFileSync, mkdirSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const require = createRequire(import.meta.url);
const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const TARGET = path.join(PACKAGE, 'proto');
const REPO_PROTOS = path.resolve(PACKAGE, '..', '..', 'protos');
const GOOGLE = path.dirname(require.resolve('google-proto-files/package.json'));

const files = [
  [REPO_PROTOS, 'pooling/v1/pooling.proto'],
  [GOOGLE, 'google/rpc/status.proto'],
  [GOOGLE, 'google/rpc/error_details.proto'],
  [GOOGLE, 'google/protobuf/any.proto'],
  [GOOGLE, 'google/protobuf/duration.proto'],
];

rmSync(TARGET, { recursive: true, force: true });
if (process.argv.includes('--clean')) {
  process.exit(0);
}
for (const [root, file] of files) {
  const destination = path.join(TARGET, file);
  mkdirSync(path.dirname(destination), { recursive: true });
  copyFileSync(path.join(root, file), destination);
}
console.log(`bundled ${files.length} .proto files into ${path.relative(process.cwd(), TARGET) || '.'}`);
