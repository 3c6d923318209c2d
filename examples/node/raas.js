#!/usr/bin/env node
// A rollout node that is not Python: it speaks AstraFlow's wire contract (schemas/*.json) directly.
//
//   node raas.js (--credential RUN_DIR/credentials/nodes/NAME.json | --url nats://HOST:4222 --run RUN)
//                [--pool raas] [--version 0] [--max-tasks N] [--idle-ms 5000] [--node-id ID]
//
// It binds the pool's shared durable pull consumer on the run's task stream, decodes each Task
// (flag byte 0x01 + msgpack {"k": "task", "d": {...}}), "generates" group_size completions,
// publishes one Trajectory per sample on af.{run}.traj.{policy}.NAME (its own name; .{policy} alone without a
// node credential) with Nats-Msg-Id = traj_id,
// and acks the task only after every trajectory is stored. A task whose min_versions asks for
// newer weights than this node holds is nak'ed back to the pool with a delay, like the Python node;
// one it cannot decode is dead-lettered on dlq.task with its original bytes.
//
// The "engine" below is a STAND-IN, clearly not a model: for the arithmetic recipe's prompts
// ("a+b=") it answers the true sum or the sum plus one with probability 1/2 each, over ByT5 byte
// tokens (id = byte + 3, EOS = 1). The first token's logprob is ln(1/2) and the rest 0: the exact
// probability of the sequence it sampled. To generate with the run's own policy instead, see agent.js.
"use strict";

const { parseArgs, joinRun, decodeMessage, encodeMessage, packI32, packF32, packU8, reject } = require("./wire");

const EOS = 1;
const USAGE = "usage: node raas.js (--credential FILE | --url URL --run RUN) [--pool raas] [--version 0] [--max-tasks N] [--idle-ms 5000]";

// ---------------------------------------------------------------- stand-in engine + verifier
// ByT5 byte tokens: a prompt is its UTF-8 bytes + 3, with no EOS; a completion ends with EOS (id 1), which is trained.
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

function reward(text, meta) { // the arithmetic recipe's rule: the whole completion, whitespace aside, is the answer
  const m = /^\s*(-?\d+)\s*$/.exec(text);
  return m && Number(m[1]) === Number(meta.answer) ? 1.0 : 0.0;
}

// ---------------------------------------------------------------- liveness
// Every 2 s on core NATS, af.{run}.hb.rollout.{node_id}: the dataflow counts live nodes of the pool from these (a node
// silent for 3 beats is gone), the launcher and `astraflow status` show them. stats is a RolloutStats (role "rollout").
function heartbeat(opt, stats, state) {
  return encodeMessage("heartbeat", {
    worker_id: opt.nodeId, pool: opt.pool, region: "", hardware: "js-stand-in", policy: "solver", version: opt.version, state,
    stats: { role: "rollout", tasks: stats.tasks, trajectories: stats.trajectories, held: 0, joined: true,
             counters: { stale_naks: stats.naks, rejected: stats.rejected } },
    ts: Date.now() / 1000,
  });
}

// ---------------------------------------------------------------- the node
async function main() {
  const opt = parseArgs(process.argv, { credential: "", url: "", run: "", pool: "raas", version: 0, maxTasks: Infinity,
                                        idleMs: 5000, nodeId: `node-js-${process.pid}` }, USAGE);
  const { nc, js, run, node } = await joinRun(opt, `astraflow:${opt.nodeId}`);
  const trajSubject = (policy) => `af.${run}.traj.${policy}` + (node ? `.${node}` : "");
  const consumer = await js.consumers.get(`AF_${run}_TASK`, opt.pool); // the shared durable: joining the pool
  const stats = { tasks: 0, trajectories: 0, naks: 0, rejected: 0 };
  const beat = (state) => nc.publish(`af.${run}.hb.rollout.${opt.nodeId}`, heartbeat(opt, stats, state));
  beat("running");
  const beats = setInterval(() => beat("running"), 2000);
  let idleSince = Date.now();
  while (stats.tasks < opt.maxTasks && Date.now() - idleSince < opt.idleMs) {
    const batch = await consumer.fetch({ max_messages: 4, expires: 1000 });
    for await (const m of batch) {
      idleSince = Date.now();
      let task;
      try {
        task = decodeMessage(m.data, "task");
      } catch (e) {
        await reject(js, run, m, `undecodable task: ${e.message}`, opt.nodeId);
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
        acks.push(js.publish(trajSubject(task.policy), encodeMessage("trajectory", traj), { msgID: trajId }));
      }
      await Promise.all(acks); // stored by the server ...
      m.ack(); // ... and only then the task is done
      stats.tasks += 1;
      stats.trajectories += task.group_size;
      if (stats.tasks >= opt.maxTasks) break;
    }
  }
  clearInterval(beats);
  beat("stopped");
  await nc.drain();
  console.log(JSON.stringify(stats));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
