// AstraFlow's wire contract in JavaScript: joining a run, decoding and encoding messages, dead-lettering.
// What every foreign node needs; see docs/rollout.md ("Nodes in other languages") and schemas/README.md.
"use strict";

const fs = require("fs");
const { connect } = require("nats");
const { encode, decode } = require("@msgpack/msgpack");

const RAW = 0x01; // flag byte: plain msgpack (0x02 = zstd-compressed msgpack, which Python uses for bodies over 16 KiB)
const SCHEMA_VERSION = 1;

// ---------------------------------------------------------------- options
function parseArgs(argv, defaults, usage) {
  const out = { ...defaults };
  for (let i = 2; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    if (!(key in out)) throw new Error(`unknown option ${argv[i]}\n${usage}`);
    if (typeof out[key] === "boolean") out[key] = true;
    else out[key] = typeof out[key] === "number" ? Number(argv[++i]) : argv[++i];
  }
  return out;
}

// ---------------------------------------------------------------- joining a run
// A secure run (the default of `astraflow up`) gives each rollout node its own credential file,
// RUN_DIR/credentials/nodes/NAME.json (`astraflow node add NAME --run-dir RUN_DIR`):
// {"user": "node-NAME", "password", "run", "url", "tls_ca_pem"}. The server lets the node subscribe only to its own
// inbox prefix, _INBOX_{user}: a client that keeps the default _INBOX prefix gets no replies (every request times out);
// and publish trajectories only under its own name, af.{run}.traj.{policy}.NAME (`node` below; null without one).
async function joinRun(opt, name) {
  let run = opt.run;
  let conn = { servers: opt.url, name, maxReconnectAttempts: 30 };
  if (opt.credential) {
    const cred = JSON.parse(fs.readFileSync(opt.credential, "utf8"));
    run = cred.run;
    conn = { ...conn, servers: opt.url || cred.url, user: cred.user, pass: cred.password, inboxPrefix: `_INBOX_${cred.user}` };
    if (cred.tls_ca_pem) conn.tls = { ca: cred.tls_ca_pem }; // TLS whenever the server listens beyond loopback
    opt.password = cred.password;
  }
  if (!conn.servers || !run) throw new Error("give --credential FILE, or --url URL and --run RUN");
  const nc = await connect(conn);
  const node = conn.user && conn.user.startsWith("node-") ? conn.user.slice("node-".length) : null;
  return { nc, js: nc.jetstream(), run, node };
}

// ---------------------------------------------------------------- messages
function decodeMessage(data, kind) {
  if (data[0] !== RAW) throw new Error(`flag 0x${data[0].toString(16)}: only raw msgpack is decoded here`);
  const env = decode(data.subarray(1));
  if (!env || env.k !== kind) throw new Error(`expected ${kind}, got ${env && env.k}`);
  if ((env.d.v ?? SCHEMA_VERSION) !== SCHEMA_VERSION) throw new Error(`schema version ${env.d.v} not supported`);
  return env.d;
}

function encodeMessage(kind, fields) {
  const body = encode({ k: kind, d: { v: SCHEMA_VERSION, ...fields } });
  const out = new Uint8Array(body.length + 1);
  out[0] = RAW;
  out.set(body, 1);
  return out;
}

// packed little-endian per-token arrays travel as msgpack bin (a Uint8Array)
function packI32(values) {
  const buf = new DataView(new ArrayBuffer(4 * values.length));
  values.forEach((x, i) => buf.setInt32(4 * i, x, true));
  return new Uint8Array(buf.buffer);
}
function packF32(values) {
  const buf = new DataView(new ArrayBuffer(4 * values.length));
  values.forEach((x, i) => buf.setFloat32(4 * i, x, true));
  return new Uint8Array(buf.buffer);
}
const packU8 = (values) => Uint8Array.from(values);

// A message a node will not serve goes to af.{run}.dlq.{family} (dlq.task for a task) as a Rejected message holding
// the original bytes, then is terminated so the server never redelivers it.
async function reject(js, run, msg, reason, workerId) {
  const headers = {};
  if (msg.headers) for (const [k, v] of msg.headers) headers[k] = v.join(",");
  const family = msg.subject.split(".")[2];
  const rejected = { subject: msg.subject, reason: String(reason).slice(0, 2000), worker_id: workerId, headers,
                     payload: msg.data, ts: Date.now() / 1000 };
  await js.publish(`af.${run}.dlq.${family}`, encodeMessage("rejected", rejected));
  msg.term();
}

module.exports = { parseArgs, joinRun, decodeMessage, encodeMessage, packI32, packF32, packU8, reject };
