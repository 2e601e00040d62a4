// Runs gRPC calls through @grpc/grpc-js's client for tests/service/grpc/test_conformance.py,
// so that every door is also seen through the official Node.js client, not only grpcio's.
//
// Messages travel as raw bytes (identity serializers): the test builds and reads the protobuf
// in Python, and this script exercises only grpc-js's transport (framing, compression,
// deadlines, cancellation, metadata and status). Reads one JSON object on stdin:
//   {"address": "127.0.0.1:port", "calls": [{
//     "kind": "unary" | "server" | "bidi", "path": "/pkg.Service/Method",
//     "requests": [base64 message, ...], "metadata": [[key, value], ...] (base64 for -bin keys),
//     "timeout_ms": number | null, "gzip": bool, "cancel_after_ms": number | null (unary),
//     "cancel_after_answers": number | null (streams)}]}
// and prints one JSON array, an outcome per call, in order:
//   {"code": number, "details": string, "messages": [base64], "headers": [[key, value]],
//    "trailers": [[key, value]]}, -bin values again in base64.

import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = path.dirname(fileURLToPath(import.meta.url));
// grpc-js comes from the Node client's pinned dependencies (clients/node/package-lock.json).
const require = createRequire(path.resolve(HERE, '..', '..', '..', 'clients', 'node', 'package.json'));
const grpc = require('@grpc/grpc-js');

const identity = (value) => value;
const clients = new Map();

function client(address, gzip) {
  const key = `${address} ${gzip}`;
  if (!clients.has(key)) {
    const options = { 'grpc.max_receive_message_length': -1, 'grpc.max_send_message_length': -1 };
    if (gzip) {
      options['grpc.default_compression_algorithm'] = 2; // gzip
    }
    clients.set(key, new grpc.Client(address, grpc.credentials.createInsecure(), options));
  }
  return clients.get(key);
}

function toMetadata(pairs) {
  const metadata = new grpc.Metadata();
  for (const [key, value] of pairs) {
    metadata.add(key, key.endsWith('-bin') ? Buffer.from(value, 'base64') : value);
  }
  return metadata;
}

function fromMetadata(metadata) {
  const pairs = [];
  if (!metadata) {
    return pairs;
  }
  for (const [key, values] of Object.entries(metadata.toJSON())) {
    for (const value of values) {
      pairs.push([key, Buffer.isBuffer(value) ? value.toString('base64') : value]);
    }
  }
  return pairs;
}

function run(address, spec) {
  return new Promise((resolve) => {
    const stub = client(address, spec.gzip);
    const requests = spec.requests.map((message) => Buffer.from(message, 'base64'));
    const options = spec.timeout_ms == null ? {} : { deadline: Date.now() + spec.timeout_ms };
    const metadata = toMetadata(spec.metadata);
    const outcome = { code: -1, details: '', messages: [], headers: [], trailers: [] };
    let call;
    if (spec.kind === 'unary') {
      call = stub.makeUnaryRequest(spec.path, identity, identity, requests[0], metadata, options,
        (error, value) => {
          if (!error && value !== undefined) {
            outcome.messages.push(value.toString('base64'));
          }
        });
    } else if (spec.kind === 'server') {
      call = stub.makeServerStreamRequest(spec.path, identity, identity, requests[0], metadata,
        options);
    } else {
      call = stub.makeBidiStreamRequest(spec.path, identity, identity, metadata, options);
      for (const message of requests) {
        call.write(message);
      }
      if (spec.cancel_after_answers == null) {
        call.end();
      }
    }
    if (spec.kind !== 'unary') {
      call.on('data', (message) => {
        outcome.messages.push(message.toString('base64'));
        if (outcome.messages.length === spec.cancel_after_answers) {
          call.cancel();
        }
      });
      call.on('error', () => {}); // the status says it
    }
    call.on('metadata', (headers) => {
      outcome.headers = fromMetadata(headers);
    });
    call.on('status', (status) => {
      outcome.code = status.code;
      outcome.details = status.details;
      outcome.trailers = fromMetadata(status.metadata);
      setImmediate(() => resolve(outcome)); // after the unary callback, whichever comes first
    });
    if (spec.cancel_after_ms != null) {
      setTimeout(() => call.cancel(), spec.cancel_after_ms);
    }
  });
}

async function main() {
  const chunks = [];
  for await (const chunk of process.stdin) {
    chunks.push(chunk);
  }
  const { address, calls } = JSON.parse(Buffer.concat(chunks).toString('utf8'));
  const outcomes = [];
  for (const spec of calls) {
    outcomes.push(await run(address, spec));
  }
  for (const stub of clients.values()) {
    stub.close();
  }
  process.stdout.write(JSON.stringify(outcomes));
}

await main();
