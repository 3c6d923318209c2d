#!/usr/bin/env node
// A rollout node that is not Python: it speaks AstraFlow's wire contract (schemas/*.json) directly.
//
//   node raas.js --url nats://127.0.0.1:4222 --run RUN [--pool raas] [--version 0] [--max-tasks N] [--idle-ms 5000]
//
// It binds the pool's shared durable pull consumer on the run's task stream, decodes each Task
// (flag byte 0x01 + msgpack {"k": "task", "d": {...}}), "generates" group_size completions,
// publishes one Trajectory per sample on af.{run}.traj.{policy} with Nats-Msg-Id = traj_id,
// and acks the task only after every trajectory is stored. A task whose min_versions asks for
// newer weights than this node holds is nak'ed back to the pool with a delay, like the Python node.
//
// The "engine" below is a STAND-IN, clearly not a model: for the arithmetic recipe's prompts
// ("a+b=") it answers the true sum or the sum plus one with probability 1/2 each, over ByT5 byte
// tokens (id = byte + 3, EOS = 1). The first token's logprob is ln(1/2) and the rest 0: the exact
// probability of the sequence it sampled. Replace generate() with calls to your own runtime.
"use strict";

const { connect } = require("nats");
const { encode, decode } = require("@msgpack/msgpack");

const RAW = 0x01; // flag byte: plain msgpack (0x02 = zstd, used by Python for bodies over 16 KiB)
const SCHEMA_VERSION = 1;
const EOS = 1;

function args(argv) {
  const out = { pool: "raas", version: 0, maxTasks: Infinity, idleMs: 5000, nodeId: `node-js-${process.pid}` };
  for (let i = 2; i < argv.length; i += 2) {
    const [k, v] = [argv[i], argv[i + 1]];
    if (k === "--url") out.url = v;
    else if (k === "--run") out.run = v;
    else if (k === "--pool") out.pool = v;
    else if (k === "--version") out.version = Number(v);
    else if (k === "--max-tasks") out.maxTasks = Number(v);
    else if (k === "--idle-ms") out.idleMs = Number(v);
    else if (k === "--node-id") out.nodeId = v;
    else throw new Error(`unknown option ${k}`);
  }
  if (!out.url || !out.run) throw new Error("usage: node raas.js --url URL --run RUN [...]");
  return out;
}

// ---------------------------------------------------------------- the wire format
function decodeMessage(data, kind) {
  if (data[0] !== RAW) throw new Error(`flag 0x${data[0].toString(16)}: only raw msgpack is decoded here`);
  const env = decode(data.subarray(1));
  if (env.k !== kind) throw new Error(`expected ${kind}, got ${env.k}`);
  if ((env.d.v ?? SCHEMA_VERSION) !== SCHEMA_VERSION) throw new Error(`schema version ${env.d.v}`);
  return env.d;
}

function encodeMessage(kind, fields) {
  const body = encode({ k: kind, d: { v: SCHEMA_VERSION, ...fields } });
  const out = new Uint8Array(body.length + 1);
  out[0] = RAW;
  out.set(body, 1);
  return out;
}

// packed little-endian arrays travel as msgpack bin (Uint8Array)
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

// ---------------------------------------------------------------- stand-in engine + verifier
const byt5 = (text) => Array.from(Buffer.from(text, "utf8"), (b) => b + 3);
const unbyt5 = (ids) => Buffer.from(ids.filter((t) => t >= 3).map((t) => t - 3)).toString("utf8");

function generate(prompt, version) {
  const m = /^\s*(-?\d+)\s*\+\s*(-?\d+)\s*=\s*$/.exec(prompt);
  const truth = m ? Number(m[1]) + Number(m[2]) : 0;
  const answer = Math.random() < 0.5 ? truth : truth + 1;
  const ids = [...byt5(String(answer)), EOS];
  const logprobs = ids.map((_, i) => (i === 0 ? Math.log(0.5) : 0));
  return { ids, logprobs, versions: ids.map(() => version), finish: "stop" };
}

function reward(text, meta) {
  const m = /^\s*(-?\d+)\s*$/.exec(text);
  return m && Number(m[1]) === Number(meta.answer) ? 1.0 : 0.0;
}

// ---------------------------------------------------------------- the node
async function main() {
  const opt = args(process.argv);
  const nc = await connect({ servers: opt.url, name: `astraflow:${opt.run}:${opt.nodeId}` });
  const js = nc.jetstream();
  const consumer = await js.consumers.get(`AF_${opt.run}_TASK`, opt.pool); // the shared durable: joining the pool
  const stats = { tasks: 0, trajectories: 0, naks: 0, rejected: 0 };
  let idleSince = Date.now();
  while (stats.tasks < opt.maxTasks && Date.now() - idleSince < opt.idleMs) {
    const batch = await consumer.fetch({ max_messages: 4, expires: 1000 });
    for await (const m of batch) {
      idleSince = Date.now();
      let task;
      try {
        task = decodeMessage(m.data, "task");
      } catch (e) {
        console.error(`undecodable task: ${e.message}`);
        m.term();
        stats.rejected += 1;
        continue;
      }
      const needs = (task.min_versions || {})[task.policy] ?? 0;
      if (needs > opt.version) {
        m.nak(1000); // weights too old for this task: back to the pool
        stats.naks += 1;
        continue;
      }
      const prompt = byt5(task.prompt);
      const acks = [];
      for (let i = 0; i < task.group_size; i++) {
        const g = generate(task.prompt, opt.version);
        const trajId = `${task.task_id}.${task.policy}.${i}`;
        const traj = {
          traj_id: trajId, task_id: task.task_id, prompt_id: task.prompt_id, policy: task.policy, index: i,
          group_size: task.group_size, prompt_ids: packI32(prompt), completion_ids: packI32(g.ids),
          logprobs: packF32(g.logprobs), versions: packI32(g.versions), loss_mask: packU8(g.ids.map(() => 1)),
          reward: reward(unbyt5(g.ids), task.meta || {}), finish_reason: g.finish, node_id: opt.nodeId,
          created_at: Date.now() / 1000, meta: { runtime: "node" },
        };
        acks.push(js.publish(`af.${opt.run}.traj.${task.policy}`, encodeMessage("trajectory", traj), { msgID: trajId }));
      }
      await Promise.all(acks); // stored by the server ...
      m.ack(); // ... and only then the task is done
      stats.tasks += 1;
      stats.trajectories += task.group_size;
      if (stats.tasks >= opt.maxTasks) break;
    }
  }
  await nc.drain();
  console.log(JSON.stringify(stats));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
