// The Conveyor dashboard: polls dashboard/data once a second (web/dashboard.py, pipeline/live_view.py) and draws
// the stage graph, the current figures and the history with uPlot. The page keeps at most the server's history
// (ten minutes) of points; each poll brings only the points after the last one it has.
"use strict";

const POLL_MS = 1000;
const RETRY_MS = 3000;
const STAGE_COLORS = {
  intake: "#4e79a7", prefill: "#f28e2b", decode: "#e15759", verify: "#76b7b2", detokenize: "#59a14f",
  stream: "#b07aa1",
};
const SERIES_COLORS = ["#2f6fde", "#e8590c", "#2b8a3e", "#ae3ec9", "#c92a2a", "#868e96"];

// What tests and people poking at the page can read: how many polls came back, and the plots.
const dashboard = window.conveyorDashboard = { polls: 0, failures: 0, lastError: null, plots: {} };

const state = { seq: 0, started: null, info: null, history: null, steps: null, stagesBuilt: false };

// ---- formatting ---------------------------------------------------------------------------------------------------
function fmt(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 10000) return Math.round(value).toLocaleString("en-US");
  return value.toFixed(digits);
}
function fmtMs(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? value.toFixed(3) : value < 100 ? value.toFixed(1) : Math.round(value).toLocaleString("en-US");
}
const clock = (seconds) => new Date(seconds * 1000).toLocaleTimeString("en-GB", { hour12: false });
const fmtPct = (value) => (value === null || value === undefined ? "–" : (value * 100).toFixed(1) + "%");

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- the history --------------------------------------------------------------------------------------------------
// Columns as the server sends them: {t: [...], tokens_per_s: [...], ..., stages: {decode: {inbox: [...]}}}.
function appendColumns(into, from) {
  for (const [key, value] of Object.entries(from)) {
    if (Array.isArray(value)) {
      if (!into[key]) into[key] = [];
      for (const item of value) into[key].push(item);
    } else if (value && typeof value === "object") {
      if (!into[key]) into[key] = {};
      appendColumns(into[key], value);
    }
  }
}

function dropFirst(columns, count) {
  for (const value of Object.values(columns)) {
    if (Array.isArray(value)) value.splice(0, count);
    else if (value && typeof value === "object") dropFirst(value, count);
  }
}

function keepHistory(historySeconds) {
  const times = state.history.t || [];
  if (!times.length) return;
  const oldest = times[times.length - 1] - historySeconds;
  let drop = 0;
  while (drop < times.length && times[drop] < oldest) drop++;
  if (drop) dropFirst(state.history, drop);
}

function column(path) {
  let value = state.history;
  for (const key of path) value = value ? value[key] : undefined;
  return value || [];
}

// ---- plots --------------------------------------------------------------------------------------------------------
// Each plot: a title, its series (a label, where its column is, an optional scale "right" and a factor), which
// source it reads ("history" or "steps"), and whether a line joins points across nulls (spanGaps: for figures that
// are null when nothing was measured in a point, such as a hit rate in a second without prompts).
function plotDefinitions(info) {
  const stageSeries = (field) => info.stages.map((name) => ({
    label: name, path: ["stages", name, field], color: STAGE_COLORS[name],
  }));
  const definitions = [
    { id: "throughput", title: "Tokens per second", left: "tokens/s", series: [
      { label: "generated", path: ["tokens_per_s"] },
      { label: "prompt", path: ["prompt_tokens_per_s"] },
    ] },
    { id: "composition", title: "Device step composition (mean per step)", left: "rows", right: "prompt tokens",
      series: [
        { label: "decode rows", path: ["decode_rows"] },
        { label: "verify rows", path: ["verify_rows"] },
        { label: "prompt tokens", path: ["prompt_tokens"], scale: "right" },
      ] },
    { id: "step-time", title: "Device step time", left: "ms", right: "busy %", series: [
      { label: "mean ms", path: ["step_ms"] },
      { label: "longest ms", path: ["step_ms_max"] },
      { label: "device busy %", path: ["device_busy"], scale: "right", factor: 100 },
    ] },
    { id: "recent-steps", title: "Last device steps, one by one", source: "steps", left: "ms", right: "rows / tokens",
      series: [
        { label: "ms", path: ["ms"] },
        { label: "decode rows", path: ["decode_rows"], scale: "right" },
        { label: "verify rows", path: ["verify_rows"], scale: "right" },
        { label: "prompt tokens", path: ["prompt_tokens"], scale: "right" },
      ] },
    { id: "requests", title: "Requests", left: "requests", series: [
      { label: "running", path: ["running"] },
      { label: "waiting", path: ["waiting"] },
      { label: "prefilling", path: ["prefilling"] },
    ] },
    { id: "memory", title: `Memory in use (KV blocks of ${info.kv_blocks_total})`, left: "KV blocks",
      right: "slots / snapshots", series: [
        { label: "KV blocks", path: ["kv_blocks_used"] },
        ...(info.state_slots_total ? [{ label: `state slots of ${info.state_slots_total}`,
                                        path: ["state_slots_used"], scale: "right" }] : []),
        ...(info.snapshots_total ? [{ label: `snapshots of ${info.snapshots_total}`, path: ["snapshots_held"],
                                      scale: "right" }] : []),
      ] },
    { id: "caches", title: "Prefix-cache hits and draft acceptance", left: "%", spanGaps: true, series: [
      { label: "prefix-cache hit %", path: ["prefix_hit_rate"], factor: 100 },
      { label: "drafts accepted %", path: ["spec_acceptance"], factor: 100 },
    ] },
    { id: "inbox", title: "Inbox depth per stage", left: "messages", series: stageSeries("inbox") },
    { id: "queue-wait", title: "Queue wait p99 per stage", left: "ms", spanGaps: true,
      series: stageSeries("queue_wait_p99_ms") },
    { id: "service", title: "Service time p99 per stage", left: "ms", spanGaps: true,
      series: stageSeries("service_p99_ms") },
  ];
  return definitions;
}

function plotOptions(definition, width) {
  const axisStyle = { stroke: "#687385", grid: { stroke: "#eceef2" }, ticks: { stroke: "#dde1e7" } };
  const series = [{ value: (u, v) => (v === null ? "–" : clock(v)) }];
  definition.series.forEach((item, index) => {
    series.push({
      label: item.label, scale: item.scale === "right" ? "right" : "left", width: 1.5,
      spanGaps: Boolean(definition.spanGaps),
      stroke: item.color || SERIES_COLORS[index % SERIES_COLORS.length], points: { show: false },
      value: (u, v) => fmt(v, 2),
    });
  });
  const axes = [{ ...axisStyle, space: 80, values: (u, splits) => splits.map(clock) },
                { ...axisStyle, scale: "left", label: definition.left, size: 56 }];
  if (definition.right && definition.series.some((item) => item.scale === "right")) {
    axes.push({ ...axisStyle, scale: "right", side: 1, label: definition.right, size: 56, grid: { show: false } });
  }
  return {
    width, height: 200, series, axes,
    scales: { x: { time: true }, left: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
              right: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
    legend: { live: true }, cursor: { drag: { x: false, y: false } },
  };
}

function plotData(definition) {
  const source = definition.source === "steps" ? state.steps || {} : null;
  const read = (path) => (source ? source[path[0]] || [] : column(path));
  const data = [read(["t"])];
  for (const item of definition.series) {
    const values = read(item.path);
    data.push(item.factor ? values.map((v) => (v === null ? null : v * item.factor)) : values);
  }
  return data;
}

function buildPlots(info) {
  const container = document.getElementById("plots");
  container.textContent = "";
  dashboard.plots = {};
  for (const definition of plotDefinitions(info)) {
    const figure = element("figure");
    figure.appendChild(element("figcaption", null, definition.title));
    const holder = element("div", "plot");
    holder.id = "plot-" + definition.id;
    figure.appendChild(holder);
    container.appendChild(figure);
    const width = Math.max(300, holder.clientWidth || 500);
    dashboard.plots[definition.id] = { definition, holder, chart: new uPlot(plotOptions(definition, width),
                                                                            plotData(definition), holder) };
  }
  new ResizeObserver(() => {
    for (const plot of Object.values(dashboard.plots)) {
      const width = Math.max(300, plot.holder.clientWidth);
      if (Math.abs(width - plot.chart.width) > 2) plot.chart.setSize({ width, height: 200 });
    }
  }).observe(container);
}

function drawPlots() {
  for (const plot of Object.values(dashboard.plots)) plot.chart.setData(plotData(plot.definition));
}

// ---- the stage graph and the figures ------------------------------------------------------------------------------
function buildStages(info) {
  const graph = document.getElementById("graph");
  graph.textContent = "";
  info.stages.forEach((name, index) => {
    if (index) graph.appendChild(element("div", "arrow", "→"));
    const box = element("div", "stage");
    box.id = "stage-" + name;
    box.style.setProperty("--stage-color", STAGE_COLORS[name] || "#2f6fde");
    box.appendChild(element("div", "name", name));
    const inbox = element("div", "inbox");
    inbox.appendChild(element("span", "depth", "–"));
    inbox.appendChild(element("small", null, " in inbox"));
    box.appendChild(inbox);
    const bar = element("div", "bar");
    bar.appendChild(element("div"));
    box.appendChild(bar);
    const table = element("table");
    for (const [key, label] of [["in", "in / s"], ["out", "out / s"], ["wait50", "queue wait p50 ms"],
                                ["wait99", "queue wait p99 ms"], ["service50", "service p50 ms"],
                                ["service99", "service p99 ms"]]) {
      const row = element("tr");
      row.appendChild(element("td", null, label));
      const cell = element("td");
      cell.dataset.field = key;
      row.appendChild(cell);
      table.appendChild(row);
    }
    box.appendChild(table);
    graph.appendChild(box);
  });
}

function drawStages(now) {
  const depths = Object.values(now.stages).map((s) => s.inbox);
  const scale = Math.max(8, ...depths);
  for (const [name, stage] of Object.entries(now.stages)) {
    const box = document.getElementById("stage-" + name);
    if (!box) continue;
    box.querySelector(".depth").textContent = String(stage.inbox);
    box.querySelector(".bar > div").style.width = `${Math.min(100, (100 * stage.inbox) / scale)}%`;
    const cells = Object.fromEntries([...box.querySelectorAll("td[data-field]")].map((c) => [c.dataset.field, c]));
    cells.in.textContent = fmt(stage.in_per_s);
    cells.out.textContent = fmt(stage.out_per_s);
    cells.wait50.textContent = fmtMs(stage.queue_wait_ms.p50);
    cells.wait99.textContent = fmtMs(stage.queue_wait_ms.p99);
    cells.service50.textContent = fmtMs(stage.service_ms.p50);
    cells.service99.textContent = fmtMs(stage.service_ms.p99);
  }
  document.getElementById("graph-note").textContent =
    `decode ⇄ verify: drafts scored in decode's steps · decode → prefill: ${now.preemptions} preemptions · ` +
    `latencies over the last ${fmt(now.window_s, 0)} s · ${now.device_steps.toLocaleString("en-US")} device steps`;
}

function drawCards(now, info) {
  const kvShare = info.kv_blocks_total ? now.kv_blocks_used / info.kv_blocks_total : null;
  const cards = [
    ["tokens / s", fmt(now.tokens_per_s), `prompt ${fmt(now.prompt_tokens_per_s)} / s`],
    ["device steps / s", fmt(now.steps_per_s), `${fmtMs(now.step_ms)} ms each, busy ${fmtPct(now.device_busy)}`],
    ["step rows", fmt(now.decode_rows), `verify ${fmt(now.verify_rows)} · prompt tokens ${fmt(now.prompt_tokens, 0)}`],
    ["running", String(now.running), `${now.seats_held} of ${info.seats_total} seats`],
    ["waiting", String(now.waiting), `${now.waiting_tokens.toLocaleString("en-US")} prompt tokens · ` +
                                     `${now.prefilling} prefilling`],
    ["KV blocks", fmtPct(kvShare), `${now.kv_blocks_used} of ${info.kv_blocks_total}`],
    ["state slots · snapshots", info.state_slots_total || info.snapshots_total
      ? `${now.state_slots_used} · ${now.snapshots_held}` : "–",
     `of ${info.state_slots_total} · ${info.snapshots_total}`],
    ["prefix-cache hits", info.prefix_caching ? fmtPct(now.prefix_hit_rate) : "off", "of prompt tokens looked up"],
    ["drafts accepted", info.speculation ? fmtPct(now.spec_acceptance) : "off", info.speculation || "no drafter"],
  ];
  const container = document.getElementById("cards");
  container.textContent = "";
  for (const [label, value, detail] of cards) {
    const card = element("div", "card");
    card.appendChild(element("div", "label", label));
    card.appendChild(element("div", "value", value));
    card.appendChild(element("div", "detail", detail));
    container.appendChild(card);
  }
}

// ---- polling ------------------------------------------------------------------------------------------------------
function setStatus(text, bad) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("bad", Boolean(bad));
}

function take(data) {
  if (state.started === null) {  // the first poll (or the first after a restart): build the page
    state.started = data.started;
    state.history = {};
    state.info = data.info;
    document.getElementById("model").textContent = data.info.model;
    buildStages(data.info);
    buildPlots(data.info);
  }
  appendColumns(state.history, data.series);
  keepHistory(data.info.history_s);
  state.steps = data.steps;
  state.seq = data.seq;
  if (data.now) {
    drawCards(data.now, data.info);
    drawStages(data.now);
  }
  drawPlots();
}

async function poll() {
  const windowSeconds = document.getElementById("window").value;
  let delay = POLL_MS;
  try {
    const since = state.started === null ? 0 : state.seq;
    const response = await fetch(`dashboard/data?since=${since}&window=${windowSeconds}`, { cache: "no-store" });
    const body = await response.json().catch(() => null);
    if (!response.ok) {
      throw new Error(body && body.error ? body.error.message : `HTTP ${response.status}`);
    }
    if (state.started !== null && body.started !== state.started) {
      state.started = null;  // another server answers now: ask again for its whole history
      delay = 0;
    } else {
      take(body);
    }
    dashboard.polls += 1;
    setStatus(`updated ${new Date().toLocaleTimeString()}`, false);
  } catch (error) {
    dashboard.failures += 1;
    dashboard.lastError = String(error.message || error);
    setStatus(`no data: ${dashboard.lastError}`, true);
    delay = RETRY_MS;
  }
  setTimeout(poll, delay);
}

poll();
