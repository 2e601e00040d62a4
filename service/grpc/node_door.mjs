// The gRPC door's Node.js half (--grpc-door node): service/grpc/node_door.py starts it.
//
// grpcio's asyncio server spends about 0.3 ms of the Python GIL on every call, more than the
// whole call costs elsewhere. Here @grpc/grpc-js (the official gRPC for Node.js, pinned in
// package.json) serves gRPC: framing, compression, deadlines, status and trailers, metadata,
// keepalive, connection age and idle limits, message-size limits and TLS are its. This file
// adds what grpc-js has no option for (the open-call caps, the client ping policy, bounds on
// what is held in memory) and carries each call to Python over one Unix stream socket (the
// "link"), as raw bytes: Node never parses protobuf.
//
// Link frames, both ways: u32 length of what follows, u8 type, u32 call id, payload. A call
// of a one-request method is sent whole once the client has ended its stream; a streaming
// call's messages are sent one at a time, each when Python pulls it.
//
// Started with: node node_door.mjs '<json settings>'; the settings name two inherited file
// descriptors: the listening socket (bound by Python, so --frontends processes share the port
// with SO_REUSEPORT) and the link.

import crypto from 'node:crypto';
import { EventEmitter } from 'node:events';
import fs from 'node:fs';
import http2 from 'node:http2';
import { createRequire } from 'node:module';
import net from 'node:net';
import { promisify } from 'node:util';
import zlib from 'node:zlib';

const require = createRequire(import.meta.url);
const gunzip = promisify(zlib.gunzip);
const inflate = promisify(zlib.inflate);
const gzip = promisify(zlib.gzip);
const grpc = require('@grpc/grpc-js');
const { BaseServerInterceptingCall } = require('@grpc/grpc-js/build/src/server-interceptors.js');
const grpcJsVersion = require('@grpc/grpc-js/package.json').version;

// ---- the grpc-js internals the door relies on ----------------------------------------------
//
// Private members of grpc-js that the door wraps, replaces or reads (docs/grpc-door.md says
// why each), with the shape it relies on. The pinned version was read for them; this check
// names the member that changed rather than letting a call misbehave. The door runs it
// before it starts; `node node_door.mjs --check-internals` runs only it and prints what it
// found (tests/service/grpc/test_grpc_js_internals.py).
function internalsProblems() {
  const problems = [];
  const want = (name, ok, shape) => { if (!ok) problems.push(`${name}: expected ${shape}`); };
  const method = (owner, ownerName, name, arity) => {
    const value = owner?.[name];
    want(`${ownerName}.${name}`, typeof value === 'function' && value.length === arity,
      `a method taking ${arity} argument${arity === 1 ? '' : 's'}`);
  };
  const callName = 'BaseServerInterceptingCall.prototype';
  want('server-interceptors.js BaseServerInterceptingCall',
    typeof BaseServerInterceptingCall === 'function', 'a class');
  const proto = BaseServerInterceptingCall?.prototype;
  // Wrapped or replaced.
  method(proto, callName, 'handleTimeoutHeader', 1);
  method(proto, callName, 'handleEndEvent', 0);
  method(proto, callName, 'serializeMessage', 1);
  method(proto, callName, 'handleDataFrame', 1);
  method(proto, callName, 'decompressMessage', 2);
  // The caller of decompressMessage: it awaits it and sends what it throws as the status.
  method(proto, callName, 'decompressAndMaybePush', 1);
  const serverName = 'Server.prototype';
  method(grpc.Server.prototype, serverName, 'createHttp2Server', 1);
  method(grpc.Server.prototype, serverName, 'createConnectionInjector', 1);
  if (problems.length) return problems;
  // The fields read, on a call built as grpc-js builds one (a stream with no socket).
  const stream = Object.assign(new EventEmitter(), { pause() {}, resume() {} });
  let call;
  try {
    call = new BaseServerInterceptingCall(stream, { 'grpc-timeout': '5S' }, null,
      { path: '/check/Internals' }, {});
  } catch (error) {
    return [`BaseServerInterceptingCall's constructor: ${error?.message}`];
  }
  const field = (name, ok, shape) => want(`BaseServerInterceptingCall#${name}`, ok, shape);
  field('stream', call.stream === stream, 'the HTTP/2 stream it was built on');
  field('incomingEncoding', call.incomingEncoding === 'identity', "'identity' by default");
  field('cancelled', call.cancelled === false, 'a boolean, false while the call is open');
  field('metadataSent', call.metadataSent === false, 'a boolean, false until headers are sent');
  field('deadline', Number.isFinite(call.deadline),
    'the grpc-timeout header read through handleTimeoutHeader');
  clearTimeout(call.deadlineTimer);
  const decoder = call.decoder;
  field('decoder', typeof decoder?.write === 'function', 'a StreamDecoder with write(data)');
  if (typeof decoder?.write !== 'function') return problems;
  field('decoder.readState', decoder.readState === 0, '0 (NO_DATA) before any byte');
  decoder.write(Buffer.from([1, 0, 0, 0, 9, 7])); // a compressed 9-byte message's first byte
  field('decoder.readState', decoder.readState === 2, '2 (READING_MESSAGE) inside a message');
  field('decoder.readMessageSize', decoder.readMessageSize === 9,
    "the length from the message's prefix");
  field('decoder.readCompressFlag', decoder.readCompressFlag?.[0] === 1,
    "a Buffer holding the message's Compressed-Flag");
  let server;
  try {
    server = new grpc.Server({ 'grpc.enable_channelz': 0,
      'grpc-node.max_session_memory': 7, 'grpc.max_concurrent_streams': 5 });
  } catch (error) {
    return [...problems, `Server's constructor: ${error?.message}`];
  }
  const common = server.commonServerOptions;
  want('Server#commonServerOptions', common?.maxSessionMemory === 7
    && common?.settings?.maxConcurrentStreams === 5,
    "the options its HTTP/2 servers are created with, their SETTINGS in 'settings'");
  const injector = server.createConnectionInjector(grpc.ServerCredentials.createInsecure());
  method(injector, 'ConnectionInjector', 'injectConnection', 1);
  method(injector, 'ConnectionInjector', 'drain', 1);
  return problems;
}

if (process.argv[2] === '--check-internals') {
  const problems = internalsProblems();
  process.stdout.write(`${JSON.stringify({ version: grpcJsVersion, problems })}\n`);
  process.exit(problems.length ? 1 : 0);
}

const settings = JSON.parse(process.argv[2]);
// A signal to the server's process group (systemd, `timeout`, Ctrl-C) reaches this process
// too: Python drains the door (DRAIN, then closing the link), so the signal is not ours.
for (const signal of ['SIGTERM', 'SIGINT', 'SIGHUP']) process.on(signal, () => {});

// Link frame types.
const OPEN = 1; // N->P: a call; u32 timeout ms (0xffffffff: none), u8 whole, path, peer, metadata, messages
const MESSAGE = 2; // both: one request message (after PULL) or one response message (acked by WRITTEN)
const HALF_CLOSE = 3; // N->P: the client sent its last message (after PULL)
const CANCEL = 4; // N->P: the call is gone (reset, deadline, connection closed)
const WRITTEN = 5; // N->P: a streamed response message was handed to HTTP/2
const FINISH = 6; // P->N: u8 code, u8 has message, [u32 len, message], u32 len, details, metadata
const DRAIN = 7; // P->N: stop accepting, GOAWAY every connection
const PULL = 8; // P->N: send the call's next request message (or HALF_CLOSE)
const READY = 9; // N->P: listening
const DRAINED = 10; // N->P: draining, and no call is open any more
const KEYS = 11; // P->N, first: the API keys (u16 count, then u32 length and bytes each)
const NO_TIMEOUT = 0xffffffff;
const MAX_TIMER_MS = 2 ** 31 - 1; // setTimeout's range: a longer delay fires at once

// The door's own refusals, by reason: each reason's gRPC code is the errors table's
// (service/errors.py), sent by Python at start, so no status is written here.
function refusal(reason, details) {
  const code = settings.refusals[reason];
  if (code === undefined) throw new Error(`grpc door (node): no code for ${reason}`);
  return { code, details };
}
// Request headers that are HTTP/2's or gRPC's own, not the call's metadata.
const RESERVED = new Set(['content-type', 'te', 'grpc-timeout', 'grpc-encoding',
  'grpc-accept-encoding', 'accept-encoding', 'content-length', 'user-agent']);
const whole = new Set(settings.unary_paths);

// ---- where grpc-js is wrapped ------------------------------------------------------------
//
// The rule is that client input never gets INTERNAL, and that what requests hold in
// memory is bounded over the whole process. grpc-js answers a malformed grpc-timeout and
// corrupt compression with INTERNAL, reads a timeout such as "1.5S" or nine digits as a
// shorter one, ignores a message cut short by the end of the stream, and inflates as many
// messages at once as clients send. No interceptor sees these (they happen inside the call
// object, before any listener), so four methods of BaseServerInterceptingCall are wrapped
// or replaced here, for the pinned version only: its code was read for this. A fifth lets
// --gzip-responses work: grpc-js's server never compresses what it sends, so the door gzips
// a response itself (off the loop, in zlib's threads) and has the frame's flag set.
const PINNED = '1.14.7';
if (grpcJsVersion !== PINNED) {
  const folder = new URL('.', import.meta.url).pathname;
  process.stderr.write(`grpc door (node): @grpc/grpc-js ${grpcJsVersion} is installed, the `
    + `door is written for ${PINNED}: run \`npm ci --omit=dev\` in ${folder}\n`);
  process.exit(1);
}
const changed = internalsProblems();
if (changed.length) {
  process.stderr.write(`grpc door (node): grpc-js ${grpcJsVersion} is not as the door `
    + `expects: ${changed.join('; ')}\n`);
  process.exit(1);
}
const Base = BaseServerInterceptingCall.prototype;
const TIMEOUT_UNITS = { H: 3600e3, M: 60e3, S: 1e3, m: 1, u: 1e-3, n: 1e-6 };
const originalTimeout = Base.handleTimeoutHeader;
// grpc-timeout: 1 to 8 digits and a unit, nothing else. A malformed one is marked for the
// door to answer INVALID_ARGUMENT; one past the timer's range (24.8 days) is as good as none.
Base.handleTimeoutHeader = function handleTimeoutHeader(value) {
  const text = String(value);
  const match = /^(\d{1,8})([HMSmun])$/.exec(text);
  if (match === null) { this.malformedTimeout = text.slice(0, 40); return; }
  if (Number(match[1]) * TIMEOUT_UNITS[match[2]] > MAX_TIMER_MS) return;
  originalTimeout.call(this, text);
};
const originalEnd = Base.handleEndEvent;
// The stream ended inside a message (grpc-js's decoder holds part of one): INVALID_ARGUMENT.
Base.handleEndEvent = function handleEndEvent() {
  flushTiny(this);
  if (this.decoder.readState !== 0) {
    this.sendStatus(refusal('MESSAGE_CUT_SHORT', 'the stream ended inside a message'));
    return;
  }
  originalEnd.call(this);
};
const originalSerialize = Base.serializeMessage;
Base.serializeMessage = function serializeMessage(value) {
  const framed = originalSerialize.call(this, value);
  if (this.doorCall?.gzipOut) framed[0] = 1; // the message is gzip's already
  return framed;
};
const originalData = Base.handleDataFrame;
// A client may send a message a byte a DATA frame, and grpc-js's decoder keeps each frame as
// a Buffer of its own (~160 bytes of heap a byte: 300 KB so sent grew Node by 50 MB). Tiny
// frames in the middle of a message are copied into 16 KB blocks as they come, and a block
// goes to the decoder when full or at the end of the event loop's turn.
Base.handleDataFrame = function handleDataFrame(data) {
  const tiny = data.length < TINY_FRAME && this.decoder.readState !== 0;
  if (!tiny) {
    flushTiny(this); // what came before it first
    originalData.call(this, data);
    awaitTurn(this);
    return;
  }
  if (this.tiny === undefined) {
    this.tiny = Buffer.allocUnsafe(TINY_BLOCK);
    this.tinyUsed = 0;
    if (!this.tinyScheduled) {
      this.tinyScheduled = true;
      setImmediate(() => { this.tinyScheduled = false; flushTiny(this); });
    }
  }
  data.copy(this.tiny, this.tinyUsed);
  this.tinyUsed += data.length;
  if (this.tinyUsed > TINY_BLOCK - TINY_FRAME) flushTiny(this);
};
const TINY_FRAME = 1024;
const TINY_BLOCK = 16 * 1024;

function flushTiny(call) {
  const block = call.tiny;
  if (block === undefined) return;
  call.tiny = undefined;
  originalData.call(call, block.subarray(0, call.tinyUsed));
  awaitTurn(call);
}

function awaitTurn(call) {
  // A large message takes its reading share once its length is known, before its bytes are
  // read: without a turn its stream is paused, the rest left in the client's socket (HTTP/2
  // flow control), so three clients sending 16 MB messages cost about one here, not three.
  const decoder = call.decoder;
  if (reading.total === 0 || decoder.readState !== 2 || call.turnTaken || call.turnPending) return;
  if (decoder.readMessageSize < settings.large_message_bytes) return;
  const encoding = decoder.readCompressFlag[0] ? call.incomingEncoding : 'identity';
  const granted = reading.take(call, readCost(decoder.readMessageSize, encoding));
  call.turnTaken = true; // decompressMessage takes no second share for this message
  if (granted === true) return;
  call.turnPending = true;
  call.doorCall?.arrived(true);
  call.stream.pause();
  granted.then((ok) => {
    call.turnPending = false;
    if (ok && !call.cancelled) call.stream.resume();
  });
}
// Each message waits for its share of the process's reading budget before it is inflated;
// corrupt compression is the client's INVALID_ARGUMENT. grpc-js's own inflation is replaced
// (not wrapped) for one more reason: it gathers the output in 16 KB chunks, which glibc keeps
// in the heap once freed (200 gzip bombs so left Node 700 MB larger); here a message that
// inflates a lot does so in chunks of up to 1 MB, which are mapped and unmapped on their own.
Base.decompressMessage = async function decompressMessage(framed, encoding) {
  const body = framed.subarray(5);
  const cost = this.turnTaken ? 0 : readCost(body.length, encoding);
  this.turnTaken = false;
  if (cost > 0) {
    this.doorCall?.arrived(true);
    if (!(await reading.take(this, cost))) throw refusal('CANCELLED', 'Cancelled');
  }
  if (encoding === 'identity') {
    // gRPC's compression spec (test case 6): a Compressed-Flag with no grpc-encoding, or
    // identity, MUST fail INTERNAL, the one INTERNAL it names for a client's mistake.
    if (framed[0] === 0) return body;
    reading.give(this);
    throw refusal('COMPRESSED_WITHOUT_ENCODING',
      'Compressed-Flag set on a message without a grpc-encoding to decompress it');
  }
  if (encoding !== 'gzip' && encoding !== 'deflate') {
    reading.give(this);
    throw refusal('ENCODING_UNSUPPORTED',
      `Received message compressed with unsupported encoding "${encoding}"`);
  }
  const options = {
    maxOutputLength: settings.max_message_bytes,
    chunkSize: Math.min(1 << 20, Math.max(16 << 10, body.length * 64)),
  };
  this.inflating = true;
  try {
    return await (encoding === 'gzip' ? gunzip : inflate)(body, options);
  } catch (error) {
    reading.give(this);
    if (error?.code === 'ERR_BUFFER_TOO_LARGE') {
      throw refusal('REQUEST_ENTITY_TOO_LARGE', 'Received message that decompresses '
        + `to a size larger than ${settings.max_message_bytes}`);
    }
    throw refusal('COMPRESSION_CORRUPT',
      `Failed to decompress the message (${encoding}): ${error?.message}`);
  } finally {
    this.inflating = false;
    if (this.giveWhenInflated) {
      this.giveWhenInflated = false;
      giveTurn(this.doorCall ?? { base: this });
    }
  }
};

// ---- the reading budget --------------------------------------------------------------------

// Bytes of request messages being inflated or held here, over every call: a message takes
// its share before it is inflated and gives it back once it is on the link (or its call
// ends). A compressed message's share is what it could inflate to (deflate's ratio is at
// most 1032, capped at the message limit); an identity message below LARGE bytes takes none.
// Past the budget, messages wait their turn, paused in the client's socket.
const DEFLATE_RATIO = 1032;
const reading = {
  total: settings.read_budget_bytes, // 0: no limit
  free: settings.read_budget_bytes,
  waiting: [],
  take(call, cost) {
    if (this.total === 0) return true;
    if (cost <= this.free || this.free === this.total) {
      this.free -= cost;
      call.readHeld = (call.readHeld ?? 0) + cost;
      return true;
    }
    return new Promise((resolve) => this.waiting.push({ call, cost, resolve }));
  },
  give(call) {
    const held = call.readHeld ?? 0;
    if (held === 0) return;
    // A call ended while its message inflates keeps its share until the inflation is done:
    // the output is in memory until then (73 calls refused at once so inflated side by side).
    if (call.inflating) { call.giveWhenInflated = true; return; }
    call.readHeld = 0;
    this.free += held;
    while (this.waiting.length) {
      const next = this.waiting[0];
      if (next.call.cancelled) { this.waiting.shift(); next.resolve(false); continue; }
      if (next.cost > this.free && this.free !== this.total) break;
      this.waiting.shift();
      this.free -= next.cost;
      next.call.readHeld = (next.call.readHeld ?? 0) + next.cost;
      next.resolve(true);
    }
  },
};

function readCost(length, encoding) {
  if (reading.total === 0) return 0;
  if (encoding === 'identity') return length >= settings.large_message_bytes ? length : 0;
  return Math.min(settings.max_message_bytes, Math.max(length, 1) * DEFLATE_RATIO);
}

// ---- the link ------------------------------------------------------------------------------

const link = new net.Socket({ fd: settings.link_fd, readable: true, writable: true });
let corked = false;

// Frames written in one turn of the event loop leave in one write (one read for Python):
// uncorked at setImmediate, not nextTick, since grpc-js hands each stream's message on in a
// promise's continuation, which runs after nextTick's queue.
function send(frame) {
  if (!corked) {
    corked = true;
    link.cork();
    setImmediate(uncork);
  }
  link.write(frame);
}

function uncork() {
  corked = false;
  link.uncork();
}

function header(type, id, payloadLength) {
  const frame = Buffer.allocUnsafe(9 + payloadLength);
  frame.writeUInt32BE(5 + payloadLength, 0);
  frame[4] = type;
  frame.writeUInt32BE(id, 5);
  return frame;
}

function sendEmpty(type, id) { send(header(type, id, 0)); }

// V8 frees a large message's buffers only at its next collection, which a flood of 16 MB
// messages outpaces: once a large one has left, collect (started with --expose-gc).
const collect = globalThis.gc ?? (() => {});
let collecting = false;

let settling = null;

function collectSoon() {
  // Now, and once more a second after the last large message: what the calls still held
  // at the first (a write not yet flushed, a refused call not yet closed) goes then.
  clearTimeout(settling);
  settling = setTimeout(collect, 1000);
  settling.unref();
  if (collecting) return;
  collecting = true;
  setImmediate(() => { collecting = false; collect(); });
}

function sendMessage(message, call) {
  // A message keeps its share of the reading budget until it is on the link; a large
  // request of a one-request method keeps it until Python has answered, so that Python
  // too holds one large request at a time, not every one Node can inflate.
  const held = call.base.readHeld ?? 0;
  if (held === 0 || (call.whole && held >= settings.large_message_bytes)) {
    send(message);
    return;
  }
  link.write(message, () => {
    reading.give(call.base);
    if (message.length >= settings.large_message_bytes) collectSoon();
  });
}

function giveTurn(call) {
  // The call's share of the reading budget, back (a large one: then collect).
  const held = call.base.readHeld ?? 0;
  if (held === 0) return;
  reading.give(call.base);
  if (held >= settings.large_message_bytes) collectSoon();
}

// What Python sent that is not yet a whole frame, as received: joined once a frame is whole.
let pending = [];
let pendingBytes = 0;

link.on('data', (chunk) => {
  pending.push(chunk);
  pendingBytes += chunk.length;
  while (pendingBytes >= 4) {
    if (pending[0].length < 4) pending = [Buffer.concat(pending, pendingBytes)];
    const length = pending[0].readUInt32BE(0);
    if (pendingBytes < 4 + length) return;
    const all = pending.length > 1 ? Buffer.concat(pending, pendingBytes) : pending[0];
    let at = 0;
    while (all.length - at >= 4) {
      const size = all.readUInt32BE(at);
      if (all.length - at - 4 < size) break;
      fromPython(all[at + 4], all.readUInt32BE(at + 5), all.subarray(at + 9, at + 4 + size));
      at += 4 + size;
    }
    pending = at === all.length ? [] : [all.subarray(at)];
    pendingBytes = all.length - at;
  }
});
// Python is done (or gone): let what was answered reach the clients, then exit.
link.on('close', quit);
link.on('error', quit);

function quit() {
  drain();
  for (const call of calls.values()) refuse(call, 'SERVER_STOPPED', 'the server stopped');
  const exit = () => { if (sessions.size === 0) process.exit(0); };
  setInterval(exit, 20);
  setTimeout(() => process.exit(0), 2000);
  exit();
}

function fromPython(type, id, payload) {
  if (type === DRAIN) { drain(); return; }
  if (type === KEYS) { readKeys(payload); return; }
  const call = calls.get(id);
  if (call === undefined) return; // already gone; its CANCEL is on its way to Python
  if (type === PULL) {
    pull(call);
  } else if (type === MESSAGE) {
    deliver(call, Buffer.from(payload), () => sendEmpty(WRITTEN, id), null);
  } else if (type === FINISH) {
    finishFromPython(call, payload);
  }
}

// ---- calls ---------------------------------------------------------------------------------

const calls = new Map(); // id -> Call
let nextId = 1;
const clients = new Map(); // peer address -> calls open
let draining = false;

class Call {
  constructor(base, session, path) {
    this.id = nextId++;
    if (nextId > 0xfffffff0) nextId = 1;
    this.base = base; // grpc-js's call
    this.session = session;
    this.path = path;
    this.whole = whole.has(path);
    this.messages = []; // a whole call's request messages
    this.opened = false; // OPEN sent
    this.done = false; // answered, or gone
    this.reading = false; // a startRead is outstanding
    this.halfClosed = false;
    this.unsent = 0; // response bytes handed to HTTP/2 and not yet sent
    this.timer = null; // the request's arrival (whole calls)
    this.waitingTurn = false; // the request has arrived and waits for its reading turn
    this.gzipOut = false; // responses are gzipped (--gzip-responses, and the client takes it)
    this.chain = null; // responses being gzipped, in order
    base.doorCall = this;
  }

  arrived(waiting) {
    this.waitingTurn = waiting;
  }
}

// The interceptor answers every call itself, through grpc-js's call object (the interface
// interceptors are given), and never starts the registered handlers: those only tell grpc-js
// each method's path and kind. So a call costs no Node stream objects.
function interceptor(method, base) {
  const stream = base.stream;
  const session = stream.session;
  const call = new Call(base, session, method.path);
  const refusal = admit(call, stream);
  if (refusal !== null) {
    base.sendStatus(refusal);
  } else {
    call.gzipOut = settings.gzip_responses && acceptsGzip(stream.rawHeaders);
    calls.set(call.id, call);
    session.calls += 1;
    session.strikes = 0;
    const address = session.address;
    clients.set(address, (clients.get(address) ?? 0) + 1);
    base.start({
      onReceiveMetadata: () => {},
      onReceiveMessage: (message) => received(call, message),
      onReceiveHalfClose: () => halfClosed(call),
      onCancel: () => ended(call),
    });
    if (base.cancelled) {
      // Reset before it began: grpc-js kept no listener, so it will not say the call ended.
      ended(call);
    } else if (call.whole) {
      // A call must bring its request within the handshake time, so that streams opened
      // and never sent on cannot hold the caps' slots.
      call.timer = setTimeout(() => arrivalTimeout(call), settings.handshake_timeout_s * 1000);
      call.timer.unref();
      call.reading = true;
      base.startRead();
    } else {
      open(call);
    }
  }
  return INERT;
}

// What the registered handler is given instead of the call: it starts nothing.
const INERT = { start() {} };

function arrivalTimeout(call) {
  // The request has not reached Python within the handshake time: never sent (a stream
  // opened and left), or waiting for a turn behind other large requests.
  const limit = settings.handshake_timeout_s;
  if (call.waitingTurn) {
    refuse(call, 'READ_TURN_TIMEOUT', `the request waited ${limit} s for its turn to be `
      + 'read: the server is reading other large requests; retry later');
  } else {
    refuse(call, 'BODY_TIMEOUT', `the request did not arrive within ${limit} s`);
  }
}

function admit(call, stream) {
  // The refusal a new call gets before a byte of its message is read, or null.
  const base = call.base;
  const session = call.session;
  if (base.malformedTimeout !== undefined) {
    return refusal('TIMEOUT_MALFORMED', `malformed grpc-timeout: ${base.malformedTimeout}`);
  }
  const caps = settings.open_calls;
  if (caps.total && calls.size >= caps.total) {
    return refusal('TOO_MANY_CALLS', `too many calls open (${caps.total})`);
  }
  if (caps.per_connection && session.calls >= caps.per_connection) {
    return refusal('TOO_MANY_CALLS',
      `too many calls open on this connection (${caps.per_connection})`);
  }
  if (caps.per_client && (clients.get(session.address) ?? 0) >= caps.per_client) {
    return refusal('TOO_MANY_CALLS', `too many calls open from this client (${caps.per_client})`);
  }
  if (!keyed(call.path, stream.rawHeaders)) {
    return refusal('UNAUTHENTICATED', 'missing or invalid credentials');
  }
  return null;
}

function received(call, message) {
  call.reading = false;
  if (call.done) return;
  if (call.whole) {
    call.messages.push(message);
    // A second message breaks the one-message rule: Python refuses it now.
    if (call.messages.length > 1) { open(call); return; }
    call.reading = true;
    call.base.startRead();
    return;
  }
  const frame = header(MESSAGE, call.id, 0);
  frame.writeUInt32BE(5 + message.length, 0);
  send(frame);
  sendMessage(message, call);
}

function halfClosed(call) {
  call.reading = false;
  if (call.done) return;
  if (call.whole) { open(call); return; }
  call.halfClosed = true;
  sendEmpty(HALF_CLOSE, call.id);
}

function pull(call) {
  // Python wants a streaming call's next message (or its end).
  if (call.reading || call.halfClosed) return;
  call.reading = true;
  call.base.startRead();
}

function ended(call) {
  // grpc-js says the call is over: answered, reset, past its deadline, connection gone.
  if (!calls.delete(call.id)) return;
  clearTimeout(call.timer);
  const session = call.session;
  session.calls -= 1;
  session.unsent -= call.unsent;
  unsentTotal -= call.unsent;
  call.unsent = 0;
  const left = clients.get(session.address) - 1;
  if (left > 0) clients.set(session.address, left);
  else clients.delete(session.address);
  giveTurn(call);
  if (!call.done) {
    call.done = true;
    if (call.opened) sendEmpty(CANCEL, call.id);
  }
  if (draining && calls.size === 0) drained();
}

function refuse(call, reason, details) {
  // A status from this side (a limit, a timeout, the server stopping).
  if (call.done) return;
  call.done = true;
  giveTurn(call);
  if (call.opened) sendEmpty(CANCEL, call.id);
  call.base.sendStatus(refusal(reason, details));
}

// Response bytes handed to HTTP/2 and not yet sent, over every connection.
let unsentTotal = 0;

function respond(call, message, written) {
  // A response message to HTTP/2, counted against its connection and the process until it
  // is sent: clients that do not read their answers get RESOURCE_EXHAUSTED rather than this
  // process's memory. A small answer may use a reserve beyond the total, so that stalled
  // readers of large answers cannot starve everyone's small calls.
  const session = call.session;
  const size = message.length;
  if (session.unsent > 0 && session.unsent + size > settings.max_unsent_bytes) {
    refuse(call, 'ANSWERS_UNREAD', `the client has not read ${session.unsent} bytes `
      + 'of earlier answers on this connection');
    if (size >= settings.large_message_bytes) collectSoon();
    return;
  }
  const total = settings.max_unsent_total_bytes;
  const room = size < settings.large_message_bytes ? total + (total >> 2) : total;
  if (unsentTotal > 0 && unsentTotal + size > room) {
    refuse(call, 'ANSWERS_UNREAD', `clients have not read ${unsentTotal} bytes of `
      + 'earlier answers from this server; retry later');
    if (size >= settings.large_message_bytes) collectSoon();
    return;
  }
  if (size >= settings.large_message_bytes) {
    session.largeAnswers = true;
    // The link's copy of it is garbage once grpc-js has framed it: collected now, not
    // when (if ever) the client reads and the write's callback runs.
    collectSoon();
  }
  call.unsent += size;
  session.unsent += size;
  unsentTotal += size;
  session.strikes = 0;
  call.base.sendMessage(message, () => {
    if (call.unsent >= size) { call.unsent -= size; session.unsent -= size; unsentTotal -= size; }
    if (size >= settings.large_message_bytes) collectSoon();
    if (written !== undefined && !call.done) written();
  });
}

function finishFromPython(call, payload) {
  giveTurn(call);
  const code = payload[0];
  let at = 2;
  let message = null;
  if (payload[1]) {
    const length = payload.readUInt32BE(at);
    message = Buffer.from(payload.subarray(at + 4, at + 4 + length));
    at += 4 + length;
  }
  const detailsLength = payload.readUInt32BE(at);
  const details = payload.toString('utf8', at + 4, at + 4 + detailsLength);
  at += 4 + detailsLength;
  const trailers = new grpc.Metadata();
  const count = payload.readUInt16BE(at);
  at += 2;
  for (let i = 0; i < count; i++) {
    const keyLength = payload.readUInt16BE(at);
    const key = payload.toString('latin1', at + 2, at + 2 + keyLength);
    at += 2 + keyLength;
    const valueLength = payload.readUInt32BE(at);
    const value = payload.subarray(at + 4, at + 4 + valueLength);
    at += 4 + valueLength;
    try {
      trailers.add(key, key.endsWith('-bin') ? Buffer.from(value) : value.toString('latin1'));
    } catch { /* a key or value HTTP/2 cannot carry */ }
  }
  const status = () => {
    call.done = true;
    call.base.sendStatus({ code, details, metadata: trailers }); // after any message
  };
  if (message !== null) deliver(call, message, undefined, status);
  else if (call.chain !== null) call.chain = call.chain.then(() => { if (!call.done) status(); });
  else status();
}

function deliver(call, message, written, then) {
  // A response message, gzipped first where the call's responses are, then `then` (the
  // status). Gzipping happens in zlib's threads; a call's messages keep their order.
  if (!call.gzipOut) {
    respond(call, message, written);
    if (then !== null && !call.done) then();
    return;
  }
  call.chain = (call.chain ?? Promise.resolve()).then(async () => {
    if (call.done) return;
    const zipped = await gzip(message);
    if (call.done) return;
    if (!call.base.metadataSent) call.base.sendMetadata(GZIPPED);
    respond(call, zipped, written);
    if (then !== null && !call.done) then();
  });
}

const GZIPPED = new grpc.Metadata();
GZIPPED.set('grpc-encoding', 'gzip');

function acceptsGzip(raw) {
  for (let i = 0; i < raw.length; i += 2) {
    if (raw[i] === 'grpc-accept-encoding'
      && raw[i + 1].split(',').some((name) => name.trim() === 'gzip')) return true;
  }
  return false;
}

function open(call) {
  // OPEN: timeout, whole, path, peer, metadata and (for a whole call) its messages, which
  // follow the frame's head as they are (a large message is not copied into it).
  clearTimeout(call.timer);
  call.opened = true;
  const deadline = call.base.getDeadline();
  const timeout = deadline === Infinity ? NO_TIMEOUT
    : Math.max(0, Math.min(NO_TIMEOUT - 1, Math.ceil(deadline - Date.now())));
  const metadata = metadataOf(call.base.stream.rawHeaders);
  const path = call.path;
  const peer = call.session.peer;
  let size = 4 + 1 + 2 + path.length + 2 + peer.length + 2;
  for (const [key, value] of metadata) size += 2 + key.length + 4 + value.length;
  const messages = call.messages;
  call.messages = [];
  size += 2;
  // A small request rides in the frame itself: one buffer on the link for the whole call.
  const inline = messages.length === 1 && messages[0].length <= INLINE_BYTES;
  if (inline) size += 4 + messages[0].length;
  let total = size;
  if (!inline) for (const message of messages) total += 4 + message.length;
  const frame = header(OPEN, call.id, size);
  frame.writeUInt32BE(5 + total, 0);
  let at = 9;
  frame.writeUInt32BE(timeout, at); at += 4;
  frame[at] = call.whole ? 1 : 0; at += 1;
  frame.writeUInt16BE(path.length, at); at += 2;
  at += frame.write(path, at, 'latin1');
  frame.writeUInt16BE(peer.length, at); at += 2;
  at += frame.write(peer, at, 'latin1');
  frame.writeUInt16BE(metadata.length, at); at += 2;
  for (const [key, value] of metadata) {
    frame.writeUInt16BE(key.length, at); at += 2;
    at += frame.write(key, at, 'latin1');
    frame.writeUInt32BE(value.length, at); at += 4;
    if (typeof value === 'string') frame.write(value, at, 'latin1');
    else value.copy(frame, at);
    at += value.length;
  }
  frame.writeUInt16BE(messages.length, at); at += 2;
  if (inline) {
    frame.writeUInt32BE(messages[0].length, at);
    messages[0].copy(frame, at + 4);
    send(frame);
    giveTurn(call); // nothing held: the message is in the frame
    return;
  }
  send(frame);
  for (const message of messages) {
    const length = Buffer.allocUnsafe(4);
    length.writeUInt32BE(message.length, 0);
    send(length);
    sendMessage(message, call);
  }
}

const INLINE_BYTES = 8192;

function metadataOf(raw) {
  // The call's metadata from the raw header list, each entry as sent (Node's header object
  // joins repeated ones with ", "); -bin values as bytes, each comma-separated piece its own,
  // the others as the latin-1 strings Node gives.
  const metadata = [];
  for (let i = 0; i < raw.length; i += 2) {
    const key = raw[i];
    if (key.charCodeAt(0) === 58 || RESERVED.has(key)) continue; // ':'
    if (key.endsWith('-bin')) {
      for (const piece of raw[i + 1].split(',')) {
        metadata.push([key, Buffer.from(piece.trim(), 'base64')]);
      }
    } else {
      metadata.push([key, raw[i + 1]]);
    }
  }
  return metadata;
}

// ---- API keys ------------------------------------------------------------------------------

// The same rule as service/ops/auth.py's BearerKeys, checked here too so that a keyless call
// is refused from its headers, before a byte of its message is read or inflated:
// PoolingService only; the first authorization entry whose scheme is Bearer (in any case)
// decides; its token is compared in constant time with every key. Python checks again.
const PROTECTED_PREFIX = '/pooling.v1.PoolingService/';
let keys = [];

function readKeys(payload) {
  const read = [];
  let at = 2;
  for (let i = 0; i < payload.readUInt16BE(0); i++) {
    const length = payload.readUInt32BE(at);
    read.push(Buffer.from(payload.subarray(at + 4, at + 4 + length)));
    at += 4 + length;
  }
  keys = read;
}

function keyed(path, raw) {
  if (keys.length === 0 || !path.startsWith(PROTECTED_PREFIX)) return true;
  for (let i = 0; i < raw.length; i += 2) {
    if (raw[i] !== 'authorization') continue;
    const value = Buffer.from(raw[i + 1], 'latin1');
    const space = value.indexOf(0x20);
    const scheme = (space < 0 ? value : value.subarray(0, space)).toString('latin1');
    if (scheme.toLowerCase() !== 'bearer') continue;
    const token = space < 0 ? Buffer.alloc(0) : value.subarray(space + 1);
    let matched = false;
    for (const key of keys) {
      matched = (key.length === token.length && crypto.timingSafeEqual(key, token)) || matched;
    }
    return matched;
  }
  return false;
}

// ---- the client ping policy ----------------------------------------------------------------

// gRPC's rule, which grpc-js does not enforce: a client may ping at most once per
// --min-client-ping-interval-s, and (with --no-keepalive-permit-without-calls) not at all
// on a connection with no call open; past two strikes, GOAWAY ENHANCE_YOUR_CALM with
// "too_many_pings". A response the server sends clears the strikes.
const MAX_PING_STRIKES = 2;
const NO_CALLS_PING_MS = 2 * 3600e3; // gRPC core's interval with no calls, when not permitted

function onPing(session) {
  const now = Date.now();
  const interval = session.calls === 0 && !settings.keepalive_permit_without_calls
    ? NO_CALLS_PING_MS : settings.min_client_ping_interval_s * 1000;
  if (now - session.lastPing < interval) session.strikes += 1;
  session.lastPing = now;
  if (session.strikes <= MAX_PING_STRIKES) return;
  try {
    session.goaway(http2.constants.NGHTTP2_ENHANCE_YOUR_CALM, session.lastStreamId ?? 0,
      Buffer.from('too_many_pings'));
  } catch { /* already closed */ }
  setTimeout(() => session.destroy(), 1000).unref();
}

// ---- connections ---------------------------------------------------------------------------

const sessions = new Set();
const greeting = new Map(); // "address:port" -> the handshake timer of a connection accepted

function peerOf(address, port) {
  if (address.startsWith('::ffff:')) address = address.slice(7);
  return net.isIPv6(address) ? `ipv6:[${address}]:${port}` : `ipv4:${address}:${port}`;
}

function onSession(session) {
  const socket = session.socket;
  const address = socket.remoteAddress ?? '';
  const where = `${address}:${socket.remotePort}`;
  session.address = address;
  session.peer = peerOf(address, socket.remotePort);
  session.calls = 0;
  session.unsent = 0;
  session.strikes = 0;
  session.lastPing = -Infinity;
  sessions.add(session);
  session.once('remoteSettings', () => {
    clearTimeout(greeting.get(where));
    greeting.delete(where);
    // HTTP/2 has begun: the connection has the handshake time again to open its first
    // call, so that sockets which sent the preface and nothing else hold no slot for long.
    if (session.lastStreamId === undefined && !session.destroyed) {
      session.firstCall = setTimeout(() => noCall(session), settings.handshake_timeout_s * 1000);
      session.firstCall.unref();
    }
  });
  if (settings.min_client_ping_interval_s > 0 || !settings.keepalive_permit_without_calls) {
    session.on('ping', () => onPing(session));
  }
  session.on('close', () => {
    clearTimeout(session.firstCall);
    sessions.delete(session);
    // What a connection's calls held (answers it never read, streams it opened by the
    // thousand) goes back now, not at V8's leisure.
    if (session.largeAnswers || (session.lastStreamId ?? 0) > 2000) collectSoon();
  });
  session.on('error', () => {});
  if (draining) session.close();
}

function noCall(session) {
  // A connection that began HTTP/2 and opened no call within the handshake time: GOAWAY,
  // then closed (a client that meant to call reconnects, as after an idle GOAWAY).
  if (session.lastStreamId !== undefined || session.destroyed) return;
  try { session.close(); } catch { /* already closing */ }
  setTimeout(() => session.destroy(), 1000).unref();
}

function onStream(stream, headers, flags, rawHeaders) {
  // Before grpc-js's own listener: keep the header list as sent, for the metadata.
  stream.rawHeaders = rawHeaders;
  const session = stream.session;
  if (session.lastStreamId === undefined) clearTimeout(session.firstCall);
  session.lastStreamId = stream.id;
}

const serverOptions = {
  'grpc.enable_channelz': 0,
  'grpc.max_receive_message_length': settings.max_message_bytes,
  'grpc.max_send_message_length': settings.max_message_bytes,
  'grpc-node.max_session_memory': settings.max_session_memory_mb,
  interceptors: [interceptor],
};
// A connection is told it may open no more streams than its share of the open calls:
// clients queue the rest, and nghttp2 refuses (and past 100, closes) a client that does not.
const perConnection = settings.open_calls.per_connection;
const streamLimit = Math.min(settings.max_concurrent_streams || Infinity,
  perConnection || Infinity);
if (streamLimit !== Infinity) serverOptions['grpc.max_concurrent_streams'] = streamLimit;
if (settings.keepalive_time_s) {
  serverOptions['grpc.keepalive_time_ms'] = Math.round(settings.keepalive_time_s * 1000);
  serverOptions['grpc.keepalive_timeout_ms'] = Math.round(settings.keepalive_timeout_s * 1000);
}
if (settings.max_connection_age_s) {
  serverOptions['grpc.max_connection_age_ms'] = Math.round(settings.max_connection_age_s * 1000);
  serverOptions['grpc.max_connection_age_grace_ms'] = Math.round(
    settings.max_connection_age_grace_s * 1000);
}
if (settings.max_connection_idle_s) {
  serverOptions['grpc.max_connection_idle_ms'] = Math.round(settings.max_connection_idle_s * 1000);
}
const server = new grpc.Server(serverOptions);
// Node's HTTP/2 limits that grpc-js has no option for: a header list of at most 16 KiB, and
// a session that sends 100 invalid frames or has 100 streams refused is closed.
server.commonServerOptions.settings = {
  ...server.commonServerOptions.settings, maxHeaderListSize: 16384,
};
server.commonServerOptions.maxSessionInvalidFrames = 100;
server.commonServerOptions.maxSessionRejectedStreams = 100;
// The HTTP/2 server grpc-js makes for the injector, reached for its sessions (the ping
// policy, the caps) and the raw header lists.
const createHttp2Server = server.createHttp2Server.bind(server);
server.createHttp2Server = (credentials) => {
  const http2Server = createHttp2Server(credentials);
  http2Server.on('session', onSession);
  http2Server.prependListener('stream', onStream);
  return http2Server;
};

const identity = (value) => value;
const never = () => { throw new Error('the door answers every call in its interceptor'); };
for (const [path, kind] of Object.entries(settings.methods)) {
  server.register(path, never, identity, identity, kind);
}

function credentials() {
  const tls = settings.tls;
  if (!tls) return grpc.ServerCredentials.createInsecure();
  const pair = {
    private_key: fs.readFileSync(tls.key_file), cert_chain: fs.readFileSync(tls.cert_file),
  };
  const clientCa = tls.client_ca_file ? fs.readFileSync(tls.client_ca_file) : null;
  return grpc.ServerCredentials.createSsl(clientCa, [pair], clientCa !== null);
}

const injector = server.createConnectionInjector(credentials());
let connections = 0;
const perAddress = new Map(); // client address -> connections open

function addressOf(socket) {
  const address = socket.remoteAddress ?? '';
  return address.startsWith('::ffff:') ? address.slice(7) : address;
}

const listener = net.createServer({ pauseOnConnect: false }, (socket) => {
  if (connections >= settings.max_connections || draining) { socket.destroy(); return; }
  // One address may hold its share of the connections, no more: sockets from one client
  // (idle, or slow to begin HTTP/2) then lock no other client out.
  const address = addressOf(socket);
  const held = perAddress.get(address) ?? 0;
  if (held >= settings.max_connections_per_address) { socket.destroy(); return; }
  perAddress.set(address, held + 1);
  connections += 1;
  socket.once('close', () => {
    connections -= 1;
    const left = perAddress.get(address) - 1;
    if (left > 0) perAddress.set(address, left);
    else perAddress.delete(address);
  });
  socket.on('error', () => {});
  // A connection that has not begun HTTP/2 (and TLS) within the handshake time is closed.
  const where = `${socket.remoteAddress}:${socket.remotePort}`;
  const timer = setTimeout(() => { greeting.delete(where); socket.destroy(); },
    settings.handshake_timeout_s * 1000);
  timer.unref();
  greeting.set(where, timer);
  socket.once('close', () => { clearTimeout(timer); greeting.delete(where); });
  injector.injectConnection(socket);
});

let toldDrained = false;

function drained() {
  // Every call open when the drain began (and any begun since on those connections) is over.
  if (toldDrained) return;
  toldDrained = true;
  sendEmpty(DRAINED, 0);
}

function drain() {
  // No new connection, GOAWAY on each open one; calls already open go on.
  if (draining) return;
  draining = true;
  listener.close();
  injector.drain(MAX_TIMER_MS);
  if (calls.size === 0) drained();
}

listener.on('error', (error) => {
  process.stderr.write(`grpc door (node): ${error.message}\n`);
  process.exit(1);
});
// A handle listens again with the backlog given beside it (an options object's is not read).
listener.listen({ fd: settings.listen_fd }, settings.backlog, () => sendEmpty(READY, 0));
