#!/usr/bin/env node
// An agent in JavaScript that pulls AstraFlow tasks itself and generates with the run's own policy.
//
//   node agent.js --credential RUN_DIR/credentials/nodes/NAME.json --facade http://HOST:PORT [--stream] [--agent-id js-1]
//                 [--pool raas] [--policy solver] [--tasks-at-once 4] [--max-tasks N]
//   (an unauthenticated server: --url nats://HOST:4222 --run RUN instead of --credential)
//
// The run's rollout nodes are started with `workflow: {type: openai_agent, agent: external}`: they pull no task
// and serve an OpenAI-compatible endpoint from their engines (its address is in their heartbeats and logs).
// This agent, per task it pulls from the pool's durable consumer:
//   1. POST {facade}/v1/sessions {task, agent}  -> one OpenAI base URL per sample of the group
//      (409 stale_weights or 503: nak the task; 400: the task is invalid, dead-letter it);
//   2. plays every sample through the official `openai` client (completions, streamed with --stream); the node
//      records the token ids, logprobs and weight versions of every call;
//   3. POST {facade}/v1/sessions/{id}/finish {samples: [{index, reward} | {index, error}]} -> the node assembles and
//      publishes the trajectories; then the agent acks the task. Any failure of the agent is reported as a sample
//      error: a scored failure (reward 0), never a lost or dead-lettered task.
// It keeps a task alive with in_progress() every ack_wait/3, and leaves when the run-state key done.{policy} appears
// (the trainer's last step).
"use strict";

const { OpenAI } = require("openai");
const { parseArgs, joinRun, decodeMessage, reject } = require("./wire");

const USAGE = "usage: node agent.js (--credential FILE | --url URL --run RUN) --facade URL [--stream] [...]";

// The arithmetic recipe's reward (astraflow/rollout/rewards: `arithmetic`): 1 when the whole completion, whitespace
// aside, is the integer answer; else 0.
function arithmeticReward(text, meta) {
  const m = /^\s*(-?\d+)\s*$/.exec(text);
  return m && Number(m[1]) === Number(meta.answer) ? 1.0 : 0.0;
}

async function api(opt, method, path, body) {
  const res = await fetch(`${opt.facade}/v1${path}`, {
    method, headers: { "Content-Type": "application/json", Authorization: `Bearer ${opt.key || opt.password || "none"}` },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return { status: res.status, body: await res.json() };
}

// One sample: "existing agent code" pointed at the sample's base URL. Whatever goes wrong is the sample's error.
async function play(opt, task, sample) {
  try {
    const client = new OpenAI({ baseURL: sample.base_url, apiKey: "session", maxRetries: 0 });
    let text = "";
    if (opt.stream) {
      const stream = await client.completions.create({ model: task.policy, prompt: task.prompt, stream: true });
      for await (const chunk of stream) text += chunk.choices.map((c) => c.text).join("");
    } else {
      text = (await client.completions.create({ model: task.policy, prompt: task.prompt })).choices[0].text;
    }
    return { index: sample.index, reward: arithmeticReward(text, task.meta || {}), meta: { runtime: "node" } };
  } catch (e) {
    return { index: sample.index, error: `${e.name}: ${e.message}`, meta: { runtime: "node" } };
  }
}

async function serve(opt, ctx, m, stats, ackWaitMs) {
  let task;
  try {
    task = decodeMessage(m.data, "task");
  } catch (e) {
    await reject(ctx.js, ctx.run, m, `undecodable task: ${e.message}`, opt.agentId);
    stats.rejected += 1;
    return;
  }
  const alive = setInterval(() => m.working(), Math.max(1000, ackWaitMs / 3));
  try {
    const opened = await api(opt, "POST", "/sessions", { task, agent: opt.agentId });
    if (opened.status === 400) {
      await reject(ctx.js, ctx.run, m, opened.body.error.message, opt.agentId);
      stats.rejected += 1;
      return;
    }
    if (opened.status !== 200) { // 409: weights older than the task allows; 503: the node is leaving
      m.nak(1000);
      stats.naks += 1;
      return;
    }
    const session = opened.body;
    const samples = await Promise.all(session.samples.map((s) => play(opt, task, s)));
    let done = await api(opt, "POST", `/sessions/${session.session}/finish`, { samples });
    if (done.status === 400) { // our report was malformed: report every sample as failed instead
      const failed = samples.map((s) => ({ index: s.index, error: `bad report: ${done.body.error.message}`.slice(0, 300) }));
      done = await api(opt, "POST", `/sessions/${session.session}/finish`, { samples: failed });
    }
    if (done.status !== 200) {
      m.nak(2000);
      stats.naks += 1;
      return;
    }
    await m.ackAck(); // the trajectories are stored: now the task is done
    stats.tasks += 1;
    stats.trajectories += done.body.published.length;
    stats.agentErrors += samples.filter((s) => s.error).length;
    stats.rewardSum += done.body.rewards.reduce((a, b) => a + b, 0);
  } catch (e) { // the node is unreachable: give the task back
    console.error(`task ${task.task_id}: ${e.message}`);
    m.nak(2000);
    stats.naks += 1;
  } finally {
    clearInterval(alive);
  }
}

async function main() {
  const opt = parseArgs(process.argv, { credential: "", url: "", run: "", facade: "", key: "", pool: "raas", policy: "solver",
                                        agentId: `agent-js-${process.pid}`, tasksAtOnce: 4, maxTasks: Infinity, stream: false }, USAGE);
  if (!opt.facade) throw new Error(USAGE);
  const ctx = await joinRun(opt, `astraflow-agent:${opt.agentId}`);
  const consumer = await ctx.js.consumers.get(`AF_${ctx.run}_TASK`, opt.pool); // the pool's shared durable
  const ackWaitMs = (await consumer.info()).config.ack_wait / 1e6; // the server's, in nanoseconds
  const state = await ctx.js.views.kv(`af_${ctx.run}_state`, { bindOnly: true });
  const stats = { tasks: 0, trajectories: 0, naks: 0, rejected: 0, agentErrors: 0, rewardSum: 0 };
  const held = new Set(); // tasks in hand: up to --tasks-at-once, topped up as each one finishes
  let checked = 0;
  while (stats.tasks + held.size < opt.maxTasks && !ctx.nc.isClosed()) {
    if (Date.now() - checked > 2000) { // the trainer wrote done.{policy}: the run is over for this policy
      checked = Date.now();
      const done = await state.get(`done.${opt.policy}`).catch(() => null);
      if (done && done.operation === "PUT") break;
    }
    if (held.size >= opt.tasksAtOnce) {
      await Promise.race(held);
      continue;
    }
    try {
      const batch = await consumer.fetch({ max_messages: opt.tasksAtOnce - held.size, expires: 1000 });
      for await (const m of batch) {
        const work = serve(opt, ctx, m, stats, ackWaitMs).finally(() => held.delete(work));
        held.add(work);
      }
    } catch (e) {
      if (ctx.nc.isClosed()) break; // the server is gone for good (the run ended): what we hold is redelivered
      throw e;
    }
  }
  await Promise.all(held);
  await ctx.nc.drain().catch(() => {});
  console.log(JSON.stringify(stats));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
