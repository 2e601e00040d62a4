// The gRPC door's HTTP/2 half in Node.js (--grpc-door node): service/grpc/node_door.py starts it.
//
// grpcio's asyncio server spends about 0.3 ms of the Python GIL on every call (its callbacks
// and reads), more than the whole call costs elsewhere. Here Node's HTTP/2 server (nghttp2,
// in C) holds the connections, frames and unframes gRPC messages, inflates them, enforces
// the transport's limits and deadlines, and hands each call to Python over one Unix stream
// socket (the "link") as a few binary frames, many calls per read. Python runs the same
// method handlers as on grpcio and answers with one frame per response message or status.
//
// Frames, both ways: u32 length of what follows, u8 type, u32 call id, payload. Calls of a
// unary-request method are sent whole, once the client has ended its stream; a streaming
// call's messages are sent one at a time, each when Python pulls it.
//
// Started with: node node_door.mjs '<json settings>'; the settings name two inherited file
// descriptors: the listening socket (bound by Python, so --frontends processes share the port
// with SO_REUSEPORT) and the link.

import crypto from 'node:crypto';
import http2 from 'node:http2';
import net from 'node:net';
import fs from 'node:fs';
import zlib from 'node:zlib';

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

const STATUS = { OK: 0, CANCELLED: 1, UNKNOWN: 2, INVALID_ARGUMENT: 3, DEADLINE_EXCEEDED: 4,
  RESOURCE_EXHAUSTED: 8, INTERNAL: 13, UNIMPLEMENTED: 12, UNAVAILABLE: 14, UNAUTHENTICATED: 16 };
// Request headers that are HTTP/2's or gRPC's own, not the call's metadata.
const RESERVED = new Set(['content-type', 'te', 'grpc-timeout', 'grpc-encoding',
  'grpc-accept-encoding', 'content-length', 'user-agent']);
const unary = new Set(settings.unary_paths);

// ---- the link ----------------------------------------------------------------------------

const link = new net.Socket({ fd: settings.link_fd, readable: true, writable: true });
let corked = false;

function send(frame) {
  if (!corked) {
    corked = true;
    link.cork();
    process.nextTick(() => { corked = false; link.uncork(); });
  }
  link.write(frame);
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
// messages outpaces (three clients grew this process by ~150 MB). Once a large message has
// been written to the link, collect (started with --expose-gc), as service/ops/memory.py trims.
const collect = globalThis.gc ?? (() => {});
let collecting = false;

function sendLarge(message, call) {
  // A large message keeps its call's read turn until it is on the link: the next large one
  // is not read while this one still waits here.
  if (message.length < settings.large_message_bytes) { send(message); return; }
  link.write(message, () => {
    release(call);
    if (collecting) return;
    collecting = true;
    setImmediate(() => { collecting = false; collect(); });
  });
}

// What Python sent that is not yet a whole frame, as received: joined once a frame is whole
// (a large response would otherwise be copied once per read).
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
  for (const call of calls.values()) answer(call, STATUS.UNAVAILABLE, 'the server stopped');
  const exit = () => { if (sessions.size === 0) process.exit(0); };
  setInterval(exit, 20);
  setTimeout(() => process.exit(0), 2000);
  exit();
}

// ---- calls -------------------------------------------------------------------------------

const calls = new Map(); // id -> Call
let nextId = 1;

class Call {
  constructor(stream, session, path, timeoutMs, metadata, encoding, acceptsGzip) {
    this.id = nextId++;
    if (nextId > 0xfffffff0) nextId = 1;
    this.stream = stream;
    this.session = session;
    this.path = path;
    this.timeoutMs = timeoutMs;
    this.metadata = metadata;
    this.encoding = encoding; // the client's grpc-encoding
    this.gzipOut = settings.gzip_responses && acceptsGzip;
    this.whole = unary.has(path);
    this.messages = []; // unframed, inflated messages not yet sent to Python
    this.credits = 0; // messages Python asked for (streaming calls)
    this.ended = false; // the client's END_STREAM came
    this.opened = false; // OPEN sent
    this.done = false;
    this.headersSent = false;
    this.chunks = []; // bytes of a message not yet complete, as received
    this.buffered = 0;
    this.block = null; // where tiny frames are copied (append)
    this.target = null; // a large message's own buffer, filled as its bytes come
    this.targetFlag = 0;
    this.filled = 0;
    this.halfClosed = false;
    this.turn = null;
    this.timer = null;
  }
}

function gone(call) {
  // The client or the connection went away, or the deadline passed: Python stops the handler.
  if (call.done) return;
  finish(call);
  if (call.opened) sendEmpty(CANCEL, call.id);
}

function finish(call) {
  call.done = true;
  release(call);
  calls.delete(call.id);
  if (draining && calls.size === 0) drained();
}

let toldDrained = false;

function drained() {
  // Every call open when the drain began (and any begun since on those connections) is over.
  if (toldDrained) return;
  toldDrained = true;
  sendEmpty(DRAINED, 0);
}

function answer(call, code, details, trailers = {}) {
  // A status without a message from this side (a limit, a deadline, a bad frame).
  if (call.done) return;
  gone(call);
  respondStatus(call, code, details, trailers);
}

function statusOf(code, details, trailers) {
  const status = { 'grpc-status': String(code), ...trailers };
  if (details) status['grpc-message'] = encodeURIComponent(details);
  return status;
}

function respondStatus(call, code, details, trailers) {
  const stream = call.stream;
  if (stream.destroyed || stream.closed) return;
  const status = statusOf(code, details, trailers);
  try {
    if (!call.headersSent) { // trailers only
      call.headersSent = true;
      stream.respond({ ':status': 200, 'content-type': 'application/grpc', ...status },
        { endStream: true });
      // Answered before the client finished sending: RST_STREAM(NO_ERROR) tells it to stop,
      // as gRPC core does, rather than have the rest of its message read for nothing.
      if (!call.ended) stream.close(http2.constants.NGHTTP2_NO_ERROR);
    } else {
      endWith(stream, status);
    }
  } catch { stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR); }
}

function endWith(stream, status, last = undefined) {
  // After the response headers (sent with waitForTrailers): the last data, then the status.
  stream.once('wantTrailers', () => {
    try { stream.sendTrailers(status); } catch { /* the stream closed meanwhile */ }
  });
  stream.end(last);
}

function respondHeaders(call) {
  if (call.headersSent) return;
  call.headersSent = true;
  const headers = { ':status': 200, 'content-type': 'application/grpc' };
  if (call.gzipOut) headers['grpc-encoding'] = 'gzip';
  call.stream.respond(headers, { waitForTrailers: true });
}

function framed(call, message) {
  let flag = 0;
  if (call.gzipOut) { message = zlib.gzipSync(message); flag = 1; }
  const prefix = Buffer.allocUnsafe(5);
  prefix[0] = flag;
  prefix.writeUInt32BE(message.length, 1);
  return [prefix, message];
}

// ---- API keys ----------------------------------------------------------------------------

// The same rule as service/ops/auth.py's BearerKeys, checked here too so that a keyless call is
// refused from its headers, before a byte of its message is read or inflated: PoolingService
// only; the first authorization entry whose scheme is Bearer (in any case) decides; its token
// is compared in constant time with every key. Python checks again on every call it gets.
const PROTECTED_PREFIX = '/pooling.v1.PoolingService/';
let keys = [];

function readKeys(payload) {
  const found = [];
  let at = 2;
  for (let i = 0; i < payload.readUInt16BE(0); i++) {
    const length = payload.readUInt32BE(at);
    found.push(Buffer.from(payload.subarray(at + 4, at + 4 + length)));
    at += 4 + length;
  }
  keys = found;
}

function keyed(path, headers) {
  if (keys.length === 0 || !path.startsWith(PROTECTED_PREFIX)) return true;
  const values = headers.authorization === undefined ? [] : [].concat(headers.authorization);
  for (const value of values) {
    const raw = Buffer.from(value, 'latin1');
    const space = raw.indexOf(0x20);
    const scheme = (space < 0 ? raw : raw.subarray(0, space)).toString('latin1');
    if (scheme.toLowerCase() !== 'bearer') continue;
    const token = space < 0 ? Buffer.alloc(0) : raw.subarray(space + 1);
    let matched = false;
    for (const key of keys) {
      const same = key.length === token.length
        && crypto.timingSafeEqual(key, token);
      matched = matched || same;
    }
    return matched;
  }
  return false;
}

function fromPython(type, id, payload) {
  if (type === DRAIN) { drain(); return; }
  if (type === KEYS) { readKeys(payload); return; }
  const call = calls.get(id);
  if (call === undefined) return; // already gone; its CANCEL is on its way to Python
  if (type === PULL) {
    call.credits += 1;
    flush(call);
  } else if (type === MESSAGE) {
    const stream = call.stream;
    if (stream.destroyed) return;
    respondHeaders(call);
    const [prefix, message] = framed(call, payload);
    stream.write(prefix);
    stream.write(message, () => { if (!call.done) sendEmpty(WRITTEN, id); });
  } else if (type === FINISH) {
    finishFromPython(call, payload);
  }
}

function finishFromPython(call, payload) {
  const code = payload[0];
  let at = 2;
  let message = null;
  if (payload[1]) {
    const length = payload.readUInt32BE(at);
    message = payload.subarray(at + 4, at + 4 + length);
    at += 4 + length;
  }
  const detailsLength = payload.readUInt32BE(at);
  const details = payload.toString('utf8', at + 4, at + 4 + detailsLength);
  at += 4 + detailsLength;
  const trailers = {};
  const count = payload.readUInt16BE(at);
  at += 2;
  for (let i = 0; i < count; i++) {
    const keyLength = payload.readUInt16BE(at);
    const key = payload.toString('latin1', at + 2, at + 2 + keyLength);
    at += 2 + keyLength;
    const valueLength = payload.readUInt32BE(at);
    const value = payload.subarray(at + 4, at + 4 + valueLength);
    at += 4 + valueLength;
    trailers[key] = key.endsWith('-bin') ? value.toString('base64') : value.toString('latin1');
  }
  const stream = call.stream;
  finish(call);
  if (stream.destroyed || stream.closed) return;
  if (message === null) { respondStatus(call, code, details, trailers); return; }
  respondHeaders(call);
  const [prefix, body] = framed(call, message);
  stream.write(prefix);
  endWith(stream, statusOf(code, details, trailers), body);
}

// ---- reading requests --------------------------------------------------------------------

// Large messages are read one at a time (settings.max_concurrent_reads turns), each turn held
// at most read_turn_s, as service/grpc/read_gate.py does on grpcio: a stream whose next message is
// declared large waits, paused, for a turn, its bytes left in the client's socket (HTTP/2
// flow control), so what a flood of large messages holds here is about one message.
const turns = { free: settings.max_concurrent_reads, waiting: [] };

function takeTurn(call) {
  if (settings.max_concurrent_reads === 0 || call.turn !== null) return true;
  if (turns.free > 0) {
    turns.free -= 1;
    call.turn = setTimeout(() => release(call), settings.read_turn_s * 1000);
    return true;
  }
  if (!turns.waiting.includes(call)) turns.waiting.push(call);
  call.stream.pause();
  return false;
}

function release(call) {
  // The turn ends with the message, the call or the hold time; a call takes one turn at
  // most, so a slow sender reads on without one.
  if (call.turn === null || call.turn === 'released') return;
  clearTimeout(call.turn);
  call.turn = 'released';
  turns.free += 1;
  while (turns.free > 0 && turns.waiting.length) {
    const next = turns.waiting.shift();
    if (next.done) continue;
    takeTurn(next);
    resume(next);
    onData(next, null); // what it holds already may be a whole message
  }
}

function resume(call) {
  // Paused for a turn, or (streaming) while Python has not pulled what is read: go on when
  // neither holds.
  if (call.done || turns.waiting.includes(call)) return;
  if (!call.whole && call.messages.length > 1) return;
  if (call.stream.isPaused()) call.stream.resume();
}

function inflate(call, compressed, body) {
  if (!compressed) return body;
  const options = { maxOutputLength: settings.max_message_bytes };
  if (call.encoding === 'gzip') return zlib.gunzipSync(body, options);
  if (call.encoding === 'deflate') return zlib.inflateSync(body, options);
  throw new Error(`a compressed message without a supported grpc-encoding (${call.encoding})`);
}

function joined(call) {
  // The bytes received so far as one buffer: copied once per message, not once per chunk.
  if (call.chunks.length > 1) call.chunks = [Buffer.concat(call.chunks, call.buffered)];
  return call.chunks[0];
}

// A client may send a message a byte a DATA frame, and each frame is a Buffer of ~160 bytes
// of heap: a 1 MB message sent so held 165 MB. Past a few chunks, tiny ones are copied into
// blocks instead.
const TINY_CHUNK = 1024;
const BLOCK_BYTES = 16 * 1024;

function append(call, chunk) {
  call.buffered += chunk.length;
  if (chunk.length >= TINY_CHUNK || call.chunks.length < 8) {
    call.chunks.push(chunk);
    return;
  }
  // The block is written on while the last chunk is its filled start (chunks that were
  // joined or cut since are other buffers, or start further in).
  const last = call.chunks[call.chunks.length - 1];
  const block = call.block;
  const open = block !== null && last.buffer === block.buffer
    && last.byteOffset === block.byteOffset && last.length + chunk.length <= block.length;
  const used = open ? last.length : 0;
  if (!open) {
    call.block = Buffer.allocUnsafe(BLOCK_BYTES);
    call.chunks.push(null);
  }
  chunk.copy(call.block, used);
  call.chunks[call.chunks.length - 1] = call.block.subarray(0, used + chunk.length);
}

function onData(call, chunk) {
  if (call.done || (call.whole && call.opened)) return;
  if (chunk !== null) {
    if (call.target !== null) { fill(call, chunk); return; }
    append(call, chunk);
  }
  while (call.buffered >= 5) {
    const head = call.chunks[0].length >= 5 ? call.chunks[0] : joined(call);
    const length = head.readUInt32BE(1);
    if (length > settings.max_message_bytes) {
      answer(call, STATUS.RESOURCE_EXHAUSTED,
        `Received message larger than max (${length} vs. ${settings.max_message_bytes})`);
      return;
    }
    if (length >= settings.large_message_bytes) {
      if (!takeTurn(call)) return;
      // A large message is gathered straight into one buffer of its size: the chunks it
      // came in are let go as they come, rather than joined (a second copy) at the end.
      const all = joined(call);
      call.target = Buffer.allocUnsafe(length);
      call.targetFlag = all[0];
      call.filled = 0;
      call.chunks = [];
      call.buffered = 0;
      fill(call, all.subarray(5));
      return;
    }
    if (call.buffered < 5 + length) return;
    const all = joined(call);
    const rest = all.subarray(5 + length);
    call.chunks = rest.length ? [rest] : [];
    call.buffered = rest.length;
    if (!received(call, all[0] !== 0, all.subarray(5, 5 + length))) return;
  }
}

function fill(call, chunk) {
  const room = call.target.length - call.filled;
  const used = Math.min(room, chunk.length);
  chunk.copy(call.target, call.filled, 0, used);
  call.filled += used;
  if (call.filled < call.target.length) return;
  const message = call.target;
  call.target = null;
  if (used < chunk.length) {
    call.chunks = [chunk.subarray(used)];
    call.buffered = chunk.length - used;
  }
  if (received(call, call.targetFlag !== 0, message)) onData(call, null);
}

function received(call, compressed, body) {
  // A whole message: inflated, queued for Python; false when the call ended over it.
  let message;
  try {
    message = inflate(call, compressed, body);
  } catch (error) {
    const tooLarge = error.code === 'ERR_BUFFER_TOO_LARGE';
    answer(call, tooLarge ? STATUS.RESOURCE_EXHAUSTED : STATUS.INTERNAL,
      tooLarge ? `Received message larger than max (inflated past ${settings.max_message_bytes})`
        : `Failed to decompress the message: ${error.message}`);
    return false;
  }
  call.messages.push(message);
  if (body.length < settings.large_message_bytes) release(call); // a large one: once on the link
  if (call.whole) {
    // A second message breaks the one-message rule: Python refuses it now, whatever follows.
    if (call.messages.length > 1) { call.stream.pause(); open(call); return false; }
  } else {
    flush(call);
    if (call.messages.length > 1) call.stream.pause(); // Python pulls them in turn
  }
  return true;
}

function onEnd(call) {
  if (call.done || (call.whole && call.opened)) return;
  call.ended = true;
  release(call);
  if (call.buffered || call.target !== null) {
    answer(call, STATUS.INTERNAL, 'the stream ended inside a message');
    return;
  }
  if (call.whole) open(call);
  else flush(call);
}

function flush(call) {
  // A streaming call: hand Python the messages it asked for, then the end.
  if (!call.opened) { open(call); return; }
  while (call.credits > 0 && call.messages.length) {
    call.credits -= 1;
    const message = call.messages.shift();
    const frame = header(MESSAGE, call.id, 0);
    frame.writeUInt32BE(5 + message.length, 0);
    send(frame);
    sendLarge(message, call);
  }
  resume(call);
  if (call.credits > 0 && call.ended && call.messages.length === 0 && !call.halfClosed) {
    call.halfClosed = true;
    sendEmpty(HALF_CLOSE, call.id);
  }
}

function open(call) {
  // OPEN: timeout, whole, path, peer, metadata and (for a whole call) its messages, which
  // follow the frame's head as they are (a large message is not copied into it).
  call.opened = true;
  const path = Buffer.from(call.path, 'latin1');
  const peer = Buffer.from(call.session.peer, 'latin1');
  let size = 4 + 1 + 2 + path.length + 2 + peer.length + 2;
  for (const [key, value] of call.metadata) size += 2 + key.length + 4 + value.length;
  const messages = call.whole ? call.messages : [];
  size += 2;
  let total = size;
  for (const message of messages) total += 4 + message.length;
  const frame = header(OPEN, call.id, size);
  frame.writeUInt32BE(5 + total, 0);
  let at = 9;
  frame.writeUInt32BE(call.timeoutMs, at); at += 4;
  frame[at] = call.whole ? 1 : 0; at += 1;
  frame.writeUInt16BE(path.length, at); at += 2;
  path.copy(frame, at); at += path.length;
  frame.writeUInt16BE(peer.length, at); at += 2;
  peer.copy(frame, at); at += peer.length;
  frame.writeUInt16BE(call.metadata.length, at); at += 2;
  for (const [key, value] of call.metadata) {
    frame.writeUInt16BE(key.length, at); at += 2;
    frame.write(key, at, 'latin1'); at += key.length;
    frame.writeUInt32BE(value.length, at); at += 4;
    value.copy(frame, at); at += value.length;
  }
  frame.writeUInt16BE(messages.length, at);
  send(frame);
  for (const message of messages) {
    const length = Buffer.allocUnsafe(4);
    length.writeUInt32BE(message.length, 0);
    send(length);
    sendLarge(message, call);
  }
  if (call.whole) call.messages = [];
}

const TIMEOUT_UNITS = { H: 3600e3, M: 60e3, S: 1e3, m: 1, u: 1e-3, n: 1e-6 };

// setTimeout's range: a longer delay fires at once (a 30-day deadline would end the call).
const MAX_TIMER_MS = 2 ** 31 - 1;

function timeoutMs(value) {
  // grpc-timeout: up to 8 digits and a unit; null where it is malformed (gRPC core and
  // grpc-go answer INTERNAL). Past the timer's range (24.8 days) it is as good as none.
  if (value === undefined) return NO_TIMEOUT;
  const match = /^(\d{1,8})([HMSmun])$/.exec(String(value));
  if (!match) return null;
  const ms = Math.ceil(Number(match[1]) * TIMEOUT_UNITS[match[2]]);
  return ms > MAX_TIMER_MS ? NO_TIMEOUT : ms;
}

function metadataOf(headers) {
  const metadata = [];
  for (const [key, value] of Object.entries(headers)) {
    if (key.startsWith(':') || RESERVED.has(key)) continue;
    const values = Array.isArray(value) ? value : [value];
    for (const one of values) {
      const bytes = key.endsWith('-bin') ? Buffer.from(one, 'base64') : Buffer.from(one, 'latin1');
      metadata.push([key, bytes]);
    }
  }
  return metadata;
}

// ---- the server --------------------------------------------------------------------------

const options = {
  settings: {
    maxConcurrentStreams: settings.max_concurrent_streams || 0xffffffff,
    maxHeaderListSize: 16384,
  },
  maxSessionMemory: 64,
  maxSessionInvalidFrames: 100,
  maxSessionRejectedStreams: 100,
};
let server;
if (settings.tls) {
  server = http2.createSecureServer({
    ...options,
    key: fs.readFileSync(settings.tls.key_file),
    cert: fs.readFileSync(settings.tls.cert_file),
    ...(settings.tls.client_ca_file ? {
      ca: fs.readFileSync(settings.tls.client_ca_file), requestCert: true, rejectUnauthorized: true,
    } : {}),
  });
} else {
  server = http2.createServer(options);
}

let connections = 0;
let draining = false;
const sessions = new Set();

server.on('connection', (socket) => {
  if (connections >= settings.max_connections || draining) { socket.destroy(); return; }
  connections += 1;
  socket.once('close', () => { connections -= 1; });
});

function peerOf(socket) {
  let address = socket.remoteAddress ?? '';
  if (address.startsWith('::ffff:')) address = address.slice(7);
  return net.isIPv6(address) ? `ipv6:[${address}]:${socket.remotePort}`
    : `ipv4:${address}:${socket.remotePort}`;
}

server.on('session', (session) => {
  session.peer = peerOf(session.socket);
  session.active = 0;
  session.timers = [];
  sessions.add(session);
  const later = (s, fn) => { const t = setTimeout(fn, s * 1000); t.unref(); session.timers.push(t); return t; };
  let greeted = false;
  session.once('remoteSettings', () => { greeted = true; });
  later(settings.handshake_timeout_s, () => { if (!greeted) session.destroy(); });
  if (settings.max_connection_age_s) {
    const age = settings.max_connection_age_s * (0.9 + 0.2 * Math.random());
    later(age, () => {
      session.close();
      later(settings.max_connection_age_grace_s, () => session.destroy());
    });
  }
  if (settings.keepalive_time_s) {
    const ping = () => {
      if (session.destroyed || session.closed) return;
      const timeout = later(settings.keepalive_timeout_s, () => session.destroy());
      session.ping((error) => {
        clearTimeout(timeout);
        if (!error) later(settings.keepalive_time_s, ping);
      });
    };
    later(settings.keepalive_time_s, ping);
  }
  session_quiet(session);
  session.on('close', () => {
    sessions.delete(session);
    for (const timer of session.timers) clearTimeout(timer);
  });
  session.on('error', () => {});
  if (draining) session.close();
});

function session_quiet(session) {
  // No call open: a connection idle for --max-connection-idle-s gets GOAWAY.
  if (!settings.max_connection_idle_s || session.active > 0 || session.closed) return;
  clearTimeout(session.idle);
  session.idle = setTimeout(() => {
    if (session.active === 0) session.close();
  }, settings.max_connection_idle_s * 1000);
  session.idle.unref();
}

server.on('stream', (stream, headers) => {
  const session = stream.session;
  const path = headers[':path'] ?? '';
  const contentType = headers['content-type'] ?? '';
  stream.on('error', () => {});
  if (headers[':method'] !== 'POST' || !contentType.startsWith('application/grpc')) {
    stream.respond({ ':status': 415, 'content-type': 'text/plain' });
    stream.end('gRPC requests are POSTs of application/grpc\n');
    return;
  }
  const encoding = headers['grpc-encoding'] ?? 'identity';
  const accepts = String(headers['grpc-accept-encoding'] ?? '').split(',').map((e) => e.trim());
  const timeout = timeoutMs(headers['grpc-timeout']);
  const call = new Call(stream, session, path, timeout ?? NO_TIMEOUT, metadataOf(headers),
    encoding, accepts.includes('gzip'));
  calls.set(call.id, call);
  session.active += 1;
  clearTimeout(session.idle);
  if (settings.max_open_calls && calls.size > settings.max_open_calls) {
    answer(call, STATUS.RESOURCE_EXHAUSTED, `too many calls open (${settings.max_open_calls})`);
  } else if (!keyed(path, headers)) {
    answer(call, STATUS.UNAUTHENTICATED, 'missing or invalid credentials');
  } else if (timeout === null) {
    const said = String(headers['grpc-timeout']).slice(0, 40);
    answer(call, STATUS.INTERNAL, `malformed grpc-timeout: ${said}`);
  } else if (encoding !== 'identity' && encoding !== 'gzip' && encoding !== 'deflate') {
    answer(call, STATUS.UNIMPLEMENTED, `Compression algorithm '${encoding}' is not supported`,
      { 'grpc-accept-encoding': 'identity,deflate,gzip' });
  }
  if (call.timeoutMs !== NO_TIMEOUT) {
    call.timer = setTimeout(() => {
      answer(call, STATUS.DEADLINE_EXCEEDED, 'Deadline Exceeded');
    }, call.timeoutMs);
  }
  stream.on('data', (chunk) => onData(call, chunk));
  stream.on('end', () => onEnd(call));
  stream.on('close', () => {
    clearTimeout(call.timer);
    session.active -= 1;
    gone(call);
    session_quiet(session);
  });
  if (!call.whole && !call.done) open(call);
});

function drain() {
  // The server drains: no new connection, GOAWAY on each open one; calls already open go on.
  if (draining) return;
  draining = true;
  server.close();
  for (const session of sessions) session.close();
  if (calls.size === 0) drained();
}

server.on('error', (error) => {
  process.stderr.write(`grpc door (node): ${error.message}\n`);
  process.exit(1);
});
// A handle listens again with the backlog given beside it (an options object's is not read).
server.listen({ fd: settings.listen_fd }, settings.backlog, () => sendEmpty(READY, 0));
