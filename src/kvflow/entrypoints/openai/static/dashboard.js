// The live engine page: polls dashboard/state and draws it. No libraries, no build step.
// Rates and percentiles over time are computed here, from the counters and histograms each poll
// brings, so the server keeps no history for the page.

const FREE = 0, CACHED_FREE = 1, HELD = 2, SHARED = 3;
const COLOURS = { free: "#262c38", cached: "#4d6184", shared: "#f2c14e", decode: "#4e9af1", prefill: "#f08c3a",
                  accepted: "#3cb371", rejected: "#e05252", budget: "#d8dde8", text: "#8a93a6", line: "#2c3240" };
const SERIES_COLOURS = ["#4e9af1", "#f2c14e", "#e05252"];
const HISTORY_S = 300;  // time series keep this much
const RATE_WINDOW_S = 3;  // output tok/s over this window
const RATIO_WINDOW_S = 30;  // hit and acceptance rates, TTFT and ITL percentiles over this window
const KEY_STORE = "kvflow-dashboard-key";

const $ = (id) => document.getElementById(id);
const page = { key: "", rateHz: 4, history: [], view: null, timer: null, lastSeq: -1 };

function readFragment() {
  // The key may come in the fragment (#key=...), which the browser never sends to any server;
  // it is moved to this tab's session storage and taken out of the address bar.
  const params = new URLSearchParams(location.hash.slice(1));
  const query = new URLSearchParams(location.search);
  const hz = params.get("hz") ?? query.get("hz");
  if (hz !== null && !Number.isNaN(Number(hz))) page.rateHz = Number(hz);
  if (params.has("key")) {
    sessionStorage.setItem(KEY_STORE, params.get("key"));
    params.delete("key");
    history.replaceState(null, "", location.pathname + location.search + (params.size ? "#" + params : ""));
  }
  page.key = sessionStorage.getItem(KEY_STORE) ?? "";
}

function setUpControls() {
  const rate = $("rate");
  if (![...rate.options].some((o) => Number(o.value) === page.rateHz)) rate.add(new Option(`${page.rateHz} Hz`, page.rateHz));
  rate.value = String(page.rateHz);
  rate.addEventListener("change", () => { page.rateHz = Number(rate.value); schedule(0); });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    page.key = $("key").value;
    sessionStorage.setItem(KEY_STORE, page.key);
    $("key").value = "";
    schedule(0);
  });
  for (const id of ["grid", "bars"]) {
    $(id).addEventListener("mousemove", (event) => hover(id, event));
    $(id).addEventListener("mouseleave", () => { $("tip").hidden = true; });
  }
  window.addEventListener("resize", () => page.view && draw(page.view));
}

function schedule(delayMs) {
  clearTimeout(page.timer);
  if (page.rateHz > 0) page.timer = setTimeout(poll, delayMs);
}

async function poll() {
  const started = performance.now();
  try {
    const headers = page.key ? { Authorization: `Bearer ${page.key}` } : {};
    const response = await fetch("dashboard/state", { headers, cache: "no-store" });
    const body = await response.json().catch(() => null);
    if (response.status === 401) {
      banner("This server needs its API key: enter it above (it stays in this tab only).");
    } else if (!response.ok) {
      banner(body?.error?.message ?? `the server answered ${response.status}`);
    } else {
      banner(null);
      receive(body);
    }
  } catch (error) {
    banner(`cannot reach the server: ${error}`);
  }
  schedule(Math.max(0, 1000 / page.rateHz - (performance.now() - started)));
}

function banner(text) {
  $("banner").hidden = text === null;
  $("banner").textContent = text ?? "";
  if (text !== null) $("status").textContent = "no data";
}

function receive(state) {
  $("model").textContent = state.model;
  const engine = state.engine;
  if (engine === null) {
    $("status").textContent = "waiting for the engine's first snapshot…";
    return;
  }
  const view = { state, engine, grid: decodeGrid(engine) };
  page.view = view;
  if (engine.seq !== page.lastSeq) remember(view);
  page.lastSeq = engine.seq;
  draw(view);
}

function decodeGrid(engine) {
  // Per block: a byte (its state, plus 4 when hashed) and its first holder's index.
  const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const g = engine.grid;
  const packed = bytes(g.state);
  const owner = bytes(g.owner).buffer;
  const grid = {
    state: packed.map((s) => s & 3), hashed: packed.map((s) => s >> 2),
    owner: g.owner_type === "u2" ? new Uint16Array(owner) : new Int32Array(owner),
    none: g.owner_type === "u2" ? 0xffff : -1, shared: g.shared, counts: [0, 0, 0, 0],
  };
  for (const s of grid.state) grid.counts[s] += 1;  // counted from what is drawn, not taken from the server
  return grid;
}

function draw(view) {
  const { state, engine, grid } = view;
  const age = Math.max(0, state.now - engine.taken_at);
  $("status").textContent = `${state.alive ? "engine running" : "ENGINE STOPPED"} · snapshot ${engine.seq}, ` +
    `${(age * 1000).toFixed(0)} ms old · polling at ${page.rateHz} Hz`;
  document.body.dataset.seq = engine.seq;
  drawSummary(state, engine, grid);
  drawGrid(engine, grid);
  drawBars(engine);
  drawSeries();
  drawRequests(engine, grid);
}

function setMetric(id, value, text) {
  const element = $(id);
  element.dataset.value = value;
  element.textContent = text ?? String(value);
}

function drawSummary(state, engine, grid) {
  const stats = engine.stats;
  for (const name of ["num_requests_running", "num_requests_waiting", "num_preemptions_total", "prompt_tokens_total",
                      "generation_tokens_total", "prefix_cache_hits_total", "prefix_cache_queries_total"]) {
    setMetric(`m-${name}`, stats[name], stats[name].toLocaleString("en"));
  }
  setMetric("m-kv_cache_usage_perc", stats.kv_cache_usage_perc, `${(100 * stats.kv_cache_usage_perc).toFixed(1)} %`);
  setMetric("m-shared-blocks", grid.counts[SHARED]);
  const ttft = state.latency.ttft.counts;
  setMetric("m-requests-finished", ttft.length ? ttft[ttft.length - 1] : 0);
  $("n-shared").textContent = grid.counts[SHARED];
  $("n-cached").textContent = grid.counts[CACHED_FREE];
  $("n-free").textContent = grid.counts[FREE];
  const used = grid.counts[HELD] + grid.counts[SHARED];
  const groups = engine.sliding_windows.length;
  $("kv-caption").textContent = `${engine.num_blocks} blocks of ${engine.block_size} tokens` +
    `${groups > 1 ? `, ${groups} KV groups` : ""} · ${used} in use` +
    (engine.blocks.unaccounted.length ? ` · ref counts that no table explains: blocks ${engine.blocks.unaccounted.join(", ")}` : "");
}

// -- the KV grid ---------------------------------------------------------------------------
function requestColour(id) {
  let hash = 2166136261;  // FNV-1a: a request keeps its colour from one snapshot to the next
  for (let i = 0; i < id.length; i++) hash = Math.imul(hash ^ id.charCodeAt(i), 16777619);
  hash = Math.imul(hash ^ (hash >>> 16), 0x85ebca6b);  // mixed, so that ids alike but for a digit differ in colour
  hash = Math.imul(hash ^ (hash >>> 13), 0xc2b2ae35);
  hash = (hash ^ (hash >>> 16)) >>> 0;
  const hue = (65 + (hash % 320)) % 360;  // never the shared blocks' gold (hues 25-65)
  return `hsl(${hue}, ${50 + ((hash >>> 9) % 25)}%, ${46 + ((hash >>> 17) % 18)}%)`;
}

function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(cssHeight * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, cssHeight);
  return { ctx, width, height: cssHeight };
}

function gridLayout(canvas, numBlocks) {
  const width = canvas.clientWidth;
  const cell = Math.max(3, Math.min(26, Math.floor(Math.sqrt((width * 360) / Math.max(1, numBlocks)))));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(numBlocks / cols) };
}

function drawGrid(engine, grid) {
  const canvas = $("grid");
  const layout = gridLayout(canvas, engine.num_blocks);
  const { ctx } = fitCanvas(canvas, layout.rows * layout.cell);
  const gap = layout.cell >= 6 ? 1 : 0;
  const size = layout.cell - gap;
  for (let b = 0; b < engine.num_blocks; b++) {
    const x = (b % layout.cols) * layout.cell, y = Math.floor(b / layout.cols) * layout.cell;
    ctx.fillStyle = blockColour(engine, grid, b);
    ctx.fillRect(x, y, size, size);
    if (grid.hashed[b] && grid.state[b] >= HELD && layout.cell >= 8) {
      ctx.fillStyle = "#ffffff";
      ctx.fillRect(x + 1, y + 1, Math.max(2, size / 4), Math.max(2, size / 4));
    }
  }
  page.gridLayout = layout;
}

function blockColour(engine, grid, b) {
  switch (grid.state[b]) {
    case SHARED: return COLOURS.shared;
    case HELD: return requestColour(engine.holders[grid.owner[b]]);
    case CACHED_FREE: return COLOURS.cached;
    default: return COLOURS.free;
  }
}

function describeBlock(engine, grid, b) {
  const kind = ["free", "cached, free (a prefix hit can take it back)", "held", "shared"][grid.state[b]];
  const shared = grid.shared[b];
  const holders = shared ? shared.holders : grid.owner[b] !== grid.none ? [grid.owner[b]] : [];
  const ref = shared ? shared.ref : grid.state[b] === HELD ? 1 : 0;
  const lines = [`block ${b}: ${kind}`, `ref count ${ref} · ${grid.hashed[b] ? "hashed" : "not hashed"}`];
  if (holders.length) lines.push(`held by: ${holders.map((i) => engine.holders[i]).join(", ")}`);
  return lines.join("\n");
}

// -- the step bars -------------------------------------------------------------------------
const BAR_PARTS = [["decode_tokens", "decode"], ["prefill_tokens", "prefill"], ["spec_accepted", "accepted"],
                   ["spec_rejected", "rejected"]];

function drawBars(engine) {
  const steps = engine.steps;
  const n = steps.seconds.length;
  const { ctx, width, height } = fitCanvas($("bars"), 170);
  const top = 14, plot = height - top - 2;
  const slots = Math.max(n, 64);
  const barWidth = width / slots;
  // Scaled to the tokens the steps used: a budget far above them would flatten every bar.
  const used = Math.max(1, ...steps.seconds.map((_, i) => totalTokens(steps, i)));
  const budget = Math.max(0, ...steps.budget);
  const most = budget <= used * 1.5 ? Math.max(used, budget) : used * 1.15;
  const y = (tokens) => top + plot - (plot * tokens) / most;
  for (let i = 0; i < n; i++) {
    const x = width - (n - i) * barWidth;
    let stacked = 0;
    for (const [field, colour] of BAR_PARTS) {
      const tokens = steps[field][i];
      if (!tokens) continue;
      ctx.fillStyle = COLOURS[colour];
      ctx.fillRect(x, y(stacked + tokens), Math.max(1, barWidth - 1), y(stacked) - y(stacked + tokens));
      stacked += tokens;
    }
    if (steps.num_preempted[i]) drawPreemption(ctx, x + barWidth / 2, top - 2);
  }
  if (budget <= most) drawBudget(ctx, steps, n, width, barWidth, y);
  ctx.fillStyle = COLOURS.text;
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(`${Math.round(most)} tokens${budget > most ? ` (budget ${budget}, above)` : ""}`, 2, 10);
  page.barLayout = { n, barWidth, width };
  $("steps-caption").textContent = n ? stepsCaption(steps) : "(recorded while this page watches; none yet)";
}

function totalTokens(steps, i) {
  return BAR_PARTS.reduce((sum, [field]) => sum + steps[field][i], 0);
}

function drawPreemption(ctx, x, y) {
  ctx.fillStyle = COLOURS.rejected;
  ctx.beginPath();
  ctx.moveTo(x - 5, y - 9);
  ctx.lineTo(x + 5, y - 9);
  ctx.lineTo(x, y);
  ctx.fill();
}

function drawBudget(ctx, steps, n, width, barWidth, y) {
  ctx.strokeStyle = COLOURS.budget;
  ctx.lineWidth = 1;
  ctx.beginPath();
  for (let i = 0; i < n; i++) {
    const x = width - (n - i) * barWidth;
    ctx.moveTo(x, y(steps.budget[i]));
    ctx.lineTo(x + barWidth, y(steps.budget[i]));
  }
  ctx.stroke();
}

function stepsCaption(steps) {
  const times = [...steps.seconds].sort((a, b) => a - b);
  const pick = (q) => times[Math.min(times.length - 1, Math.floor(q * times.length))] * 1000;
  const preempted = steps.num_preempted.reduce((a, b) => a + b, 0);
  return `last ${times.length} steps · step time p50 ${pick(0.5).toFixed(1)} ms, p90 ${pick(0.9).toFixed(1)} ms` +
    ` · ${preempted} preempted`;
}

function describeStep(steps, i) {
  return [`step ${(steps.ago_s[i] * 1000).toFixed(0)} ms before the snapshot: ${(steps.seconds[i] * 1000).toFixed(2)} ms`,
          `${steps.num_requests[i]} requests, ${totalTokens(steps, i)} of ${steps.budget[i]} budget tokens`,
          `decode ${steps.decode_tokens[i]} · prompt chunks ${steps.prefill_tokens[i]}`,
          `speculative accepted ${steps.spec_accepted[i]} · rejected ${steps.spec_rejected[i]}`,
          `preempted ${steps.num_preempted[i]}`].join("\n");
}

function hover(id, event) {
  const view = page.view;
  if (!view) return;
  const rect = $(id).getBoundingClientRect();
  const x = event.clientX - rect.left, y = event.clientY - rect.top;
  let text = null;
  if (id === "grid" && page.gridLayout) {
    const { cell, cols } = page.gridLayout;
    const b = Math.floor(y / cell) * cols + Math.floor(x / cell);
    if (x < cols * cell && b >= 0 && b < view.engine.num_blocks) text = describeBlock(view.engine, view.grid, b);
  } else if (id === "bars" && page.barLayout) {
    const { n, barWidth, width } = page.barLayout;
    const i = n - Math.ceil((width - x) / barWidth);
    if (i >= 0 && i < n) text = describeStep(view.engine.steps, i);
  }
  const tip = $("tip");
  tip.hidden = text === null;
  tip.textContent = text ?? "";
  tip.style.left = `${Math.min(event.clientX + 14, window.innerWidth - 430)}px`;
  tip.style.top = `${event.clientY + 14}px`;
}

// -- time series ---------------------------------------------------------------------------
function remember(view) {
  const { state, engine } = view;
  const stats = engine.stats;
  page.history.push({
    t: engine.taken_at, now: state.now, generated: stats.generation_tokens_total,
    hits: stats.prefix_cache_hits_total, queries: stats.prefix_cache_queries_total,
    drafts: stats.spec_decode_num_draft_tokens_total, accepted: stats.spec_decode_num_accepted_tokens_total,
    kv: stats.kv_cache_usage_perc, adapters: engine.adapters_in_use, ttft: state.latency.ttft, itl: state.latency.itl,
  });
  while (page.history.length && page.history[0].t < engine.taken_at - HISTORY_S) page.history.shift();
  document.body.dataset.samples = page.history.length;
}

function before(i, seconds) {
  // The earliest sample within `seconds` before sample i (the oldest one, early on).
  const h = page.history;
  let j = i;
  while (j > 0 && h[j - 1].t >= h[i].t - seconds) j -= 1;
  return j === i && i > 0 ? i - 1 : j;
}

function ratio(numerator, denominator) {
  return denominator > 0 ? numerator / denominator : null;
}

function percentile(now, then, q) {
  // histogram_quantile over the increase of cumulative buckets, linear within a bucket.
  const counts = now.counts.map((c, k) => c - (then.counts[k] ?? 0));
  const total = counts[counts.length - 1];
  if (!(total > 0)) return null;
  const rank = q * total;
  for (let k = 0; k < counts.length; k++) {
    if (counts[k] >= rank) {
      if (k >= now.le.length) return now.le[now.le.length - 1];  // in +Inf: the largest finite bound
      const lower = k ? now.le[k - 1] : 0, below = k ? counts[k - 1] : 0;
      return lower + ((now.le[k] - lower) * (rank - below)) / Math.max(1e-12, counts[k] - below);
    }
  }
  return null;
}

function seriesAt(i) {
  const h = page.history, s = h[i];
  const r = h[before(i, RATE_WINDOW_S)], w = h[before(i, RATIO_WINDOW_S)];
  const ms = (v) => (v === null ? null : v * 1000);
  return {
    tps: s.t > r.t ? (s.generated - r.generated) / (s.t - r.t) : null,
    ttft: [0.5, 0.9, 0.99].map((q) => ms(percentile(s.ttft, w.ttft, q))),
    itl: [0.5, 0.9, 0.99].map((q) => ms(percentile(s.itl, w.itl, q))),
    kv: 100 * s.kv,
    hit: ratio(s.hits - w.hits, s.queries - w.queries),
    accept: s.drafts === null ? null : ratio(s.accepted - w.accepted, s.drafts - w.drafts),
    adapters: s.adapters.length,
  };
}

function drawSeries() {
  const h = page.history;
  if (h.length < 2) return;
  const points = h.map((s, i) => ({ t: s.t, v: seriesAt(i) }));
  const last = points[points.length - 1].v;
  const pct = (v) => (v === null ? null : 100 * v);
  const fmt = (v, unit, digits = 1) => (v === null || v === undefined ? "–" : `${v.toFixed(digits)}${unit}`);
  chart("s-tps", points, [(v) => v.tps], "c-tps", `output tok/s: ${fmt(last.tps, "", 1)}`);
  chart("s-ttft", points, [0, 1, 2].map((k) => (v) => v.ttft[k]), "c-ttft",
        `TTFT p50 / p90 / p99: ${last.ttft.map((v) => fmt(v, " ms", 0)).join(" / ")}`);
  chart("s-itl", points, [0, 1, 2].map((k) => (v) => v.itl[k]), "c-itl",
        `ITL p50 / p90 / p99: ${last.itl.map((v) => fmt(v, " ms", 1)).join(" / ")}`);
  chart("s-kv", points, [(v) => v.kv], "c-kv", `KV usage: ${fmt(last.kv, " %")}`, 100);
  chart("s-hit", points, [(v) => pct(v.hit)], "c-hit", `prefix hit rate: ${fmt(pct(last.hit), " %")}`, 100);
  chart("s-accept", points, [(v) => pct(v.accept)], "c-accept",
        `speculative acceptance rate: ${h[h.length - 1].drafts === null ? "off" : fmt(pct(last.accept), " %")}`, 100);
  const names = h[h.length - 1].adapters;
  chart("s-adapters", points, [(v) => v.adapters], "c-adapters",
        `adapters in use: ${names.length}${names.length ? ` (${names.join(", ")})` : ""}`);
}

function chart(canvasId, points, readers, captionId, caption, fixedMax = null) {
  $(captionId).textContent = caption;
  const { ctx, width, height } = fitCanvas($(canvasId), 110);
  const t1 = points[points.length - 1].t, t0 = Math.min(t1 - 10, Math.max(points[0].t, t1 - HISTORY_S));
  const values = points.flatMap((p) => readers.map((read) => read(p.v))).filter((v) => v !== null && Number.isFinite(v));
  const most = fixedMax ?? Math.max(1, ...values) * 1.1;
  const x = (t) => ((t - t0) / (t1 - t0)) * width, y = (v) => height - 12 - ((height - 16) * v) / most;
  ctx.fillStyle = COLOURS.text;
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(most >= 100 ? most.toFixed(0) : most.toPrecision(2), 2, 10);
  ctx.fillText(`${Math.round(t1 - t0)} s ago`, 2, height - 1);
  readers.forEach((read, k) => {
    ctx.strokeStyle = SERIES_COLOURS[k];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    for (const p of points) {
      const v = read(p.v);
      if (v === null || !Number.isFinite(v)) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(p.t), y(v)); else ctx.moveTo(x(p.t), y(v));
      drawing = true;
    }
    ctx.stroke();
  });
}

// -- the request table ---------------------------------------------------------------------
function drawRequests(engine, grid) {
  const body = document.createElement("tbody");
  for (const request of [...engine.running, ...engine.queued]) body.append(requestRow(request));
  const hidden = engine.num_queued - engine.queued.length;
  if (hidden > 0) {
    const row = body.insertRow();
    const cell = row.insertCell();
    cell.colSpan = 10;
    cell.textContent = `and ${hidden} more waiting`;
  }
  $("requests").tBodies[0].replaceWith(body);
  $("req-caption").textContent = `${engine.running.length} running, ${engine.num_queued} waiting` +
    (engine.adapters_in_use.length ? ` · adapters: ${engine.adapters_in_use.join(", ")}` : "");
}

function requestRow(request) {
  const row = document.createElement("tr");
  const cells = [request.id, request.status, `${request.age_s.toFixed(1)} s`, request.prompt_tokens,
                 request.cached_tokens, request.computed_tokens, `${request.output_tokens} / ${request.max_tokens}`,
                 request.adapter ?? "–", `${request.blocks} (${request.shared_blocks})`, tableText(request.tables)];
  cells.forEach((value, k) => {
    const cell = row.insertCell();
    cell.textContent = String(value);  // text only: ids come from clients
    if (k === 9) cell.className = "table-runs";
  });
  const chip = document.createElement("span");
  chip.className = "chip";
  chip.style.background = requestColour(request.id);
  row.cells[0].prepend(chip);
  return row;
}

function tableText(tables) {
  return tables.map((table, g) => {
    const runs = table.runs.map(([first, length]) => {
      if (first < 0) return `∅×${length}`;  // given back: out of the sliding window
      return length > 1 ? `${first}–${first + length - 1}` : `${first}`;
    }).join(" ");
    return (tables.length > 1 ? `g${g}: ` : "") + runs + (table.more ? ` (+${table.more} runs)` : "");
  }).join("\n");
}

readFragment();
setUpControls();
schedule(0);
