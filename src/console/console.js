// throttlehost console: polls /console/data once a second and draws what it answers.
// Every number that comes from the /status document is written by `number()`, which also
// keeps the raw value and its path in data-path / data-value, so the page can be checked
// against /status number by number.
"use strict";

const POLL_MS = 1000;
// The fleet changes at the instances' heartbeats (5 s by default): no need to ask faster.
const FLEET_POLL_MS = 5000;
const WINDOW_MS = 600 * 1000;
const SVG = "http://www.w3.org/2000/svg";
const DIRECTIONS = ["delivery", "publishing"];
const BYTES = new Set(["process_memory", "system_memory"]);

const view = {
  after: 0,
  instance: null,
  samples: [],
  paused: false,
};

// ---------- formatting ----------

function fixed(value, digits) {
  return Number(value).toFixed(digits);
}

function bytes(value) {
  const mib = value / (1024 * 1024);
  return mib >= 1024 ? `${fixed(mib / 1024, 2)} GiB` : `${fixed(mib, 1)} MiB`;
}

function seconds(value) {
  if (value === 0) return "0";
  return value < 1 ? `${fixed(value * 1000, 0)} ms` : `${fixed(value, 2)} s`;
}

function plain(value) {
  return Number.isInteger(value) ? String(value) : fixed(value, 1);
}

function conditionValue(condition, value) {
  return BYTES.has(condition) ? bytes(value) : plain(value);
}

// ---------- DOM helpers ----------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c);
  return node;
}

// A number from the status document: shown formatted, kept raw for checks.
function number(path, value, format) {
  const span = el("span", { "data-path": path });
  if (value === null || value === undefined) {
    span.textContent = "–";
    span.setAttribute("data-value", "null");
  } else {
    span.textContent = (format || plain)(value);
    span.setAttribute("data-value", String(value));
  }
  return span;
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.append(el("td", {}, c));
  return tr;
}

function severity(code) {
  if (code === 0) return "s-ok";
  if (code === 1 || code === 2) return "s-rate";
  if (code === 4 || code === 5) return "s-memory";
  if (code === 10 || code === 11) return "s-override";
  return "s-pressure";
}

// ---------- the current state ----------

// `resources` carries each sensor's resume line; the active conditions show it beside them.
function renderDirection(name, d, resources) {
  const card = document.getElementById(`dir-${name}`);
  const base = `throttling.${name}`;
  const state = card.querySelector("[data-role=state]");
  state.className = `state ${severity(d.state)}`;
  state.setAttribute("data-state", String(d.state));
  const code = card.querySelector("[data-role=code]");
  code.replaceChildren(number(`${base}.state`, d.state));
  card.querySelector("[data-role=name]").textContent =
    d.state_name + (d.recovering ? " (recovering)" : "");

  const numbers = card.querySelector("[data-role=numbers]");
  numbers.replaceChildren(
    el("dt", {}, "delay"), el("dd", {}, number(`${base}.delay_seconds`, d.delay_seconds, seconds)),
    el("dt", {}, "pace"), el("dd", {}, number(`${base}.pace_messages_per_second`, d.pace_messages_per_second, (v) => `${fixed(v, 1)} msg/s`)),
    el("dt", {}, "incoming"), el("dd", {}, number(`${base}.incoming_per_second`, d.incoming_per_second, (v) => `${fixed(v, 1)} msg/s`)),
    el("dt", {}, "outgoing"), el("dd", {}, number(`${base}.outgoing_per_second`, d.outgoing_per_second, (v) => `${fixed(v, 1)} msg/s`)),
    el("dt", {}, "in state for"), el("dd", {}, number(`${base}.state_duration_seconds`, d.state_duration_seconds, (v) => `${fixed(v, 0)} s`)),
    el("dt", {}, "override"), el("dd", { "data-path": `${base}.override`, "data-value": d.override },
      d.override + (d.override_scope && d.override_scope !== "configured" ? ` (${d.override_scope === "fleet" ? "fleet-wide" : "this instance"})` : "")),
  );

  const explanation = card.querySelector("[data-role=explanation]");
  if (d.explanation) {
    const actions = el("ul");
    for (const a of d.explanation.actions) actions.append(el("li", {}, a));
    explanation.replaceChildren(
      el("p", {}, el("strong", {}, "Cause: "), d.explanation.cause),
      actions,
      el("p", {}, el("strong", {}, "Ends when: "), d.explanation.clears_when),
    );
  } else {
    explanation.replaceChildren(el("p", { class: "muted" }, "Not throttling: no delay, no pacing, full concurrency limits."));
  }

  const body = card.querySelector("[data-role=conditions]");
  const rows = d.active_conditions.map((c, i) => {
    const at = `${base}.active_conditions.${i}`;
    const format = (v) => conditionValue(c.condition, v);
    return row([
      c.condition.replaceAll("_", " "),
      number(`${at}.state`, c.state),
      number(`${at}.value`, c.value, format),
      number(`${at}.threshold`, c.threshold, format),
      resumeLine(resources, c.condition, format),
    ]);
  });
  if (rows.length === 0) rows.push(el("tr", {}, el("td", { colspan: "5", class: "empty" }, "none")));
  body.replaceChildren(...rows);

  const select = card.querySelector("[data-role=override-mode]");
  if (document.activeElement !== select) select.value = d.override;
}

function renderSensors(resources) {
  const body = document.querySelector("#sensors tbody");
  body.replaceChildren(
    ...resources.map((r, i) => {
      const at = `throttling.resources.${i}`;
      const format = (v) => conditionValue(r.condition, v);
      const tr = row([
        r.condition.replaceAll("_", " "),
        number(`${at}.value`, r.value, format),
        r.threshold === null ? "off" : number(`${at}.threshold`, r.threshold, format),
        r.resume_below === null ? "off" : number(`${at}.resume_below`, r.resume_below, format),
        r.percent_of_threshold === null ? "–" : number(`${at}.percent_of_threshold`, r.percent_of_threshold, (v) => `${fixed(v, 0)} %`),
        r.active ? "ACTIVE" : "no",
      ]);
      if (r.active) tr.className = "active";
      return tr;
    }),
  );
}

// A condition's resume line as /status gives it for its sensor ("–" for rate and override,
// which have no sensor).
function resumeLine(resources, condition, format) {
  const sensor = resources.find((r) => r.condition === condition);
  return sensor && sensor.resume_below !== null ? format(sensor.resume_below) : "–";
}

// A sample's queues by name, built once per sample: with a thousand queues, a search of the
// list for each queue of each row was a million comparisons a second.
const queueIndex = new WeakMap();
function queueOf(sample, name) {
  let index = queueIndex.get(sample);
  if (!index) {
    index = new Map(sample.queues.map((q) => [q.name, q]));
    queueIndex.set(sample, index);
  }
  return index.get(name);
}

function rate(queue, field) {
  const s = view.samples;
  if (s.length < 2) return null;
  const last = s[s.length - 1];
  const prev = s[s.length - 2];
  const a = queueOf(last, queue);
  const b = queueOf(prev, queue);
  const dt = (last.unix_ms - prev.unix_ms) / 1000;
  if (!a || !b || dt <= 0) return null;
  return Math.max(0, (a[field] - b[field]) / dt);
}

// A queue's downstream guards in words: outage mode (12), the latency-aware limit (13), or ok.
function downstream(d) {
  if (!d) return "–";
  if (d.outage) {
    return `12 outage: ${d.consecutive_failures} failing, pause ${fixed(d.pause, 1)} s`;
  }
  if (d.latency_limiting) {
    return `13 latency: limit ${d.latency_limit}, ${fixed(d.latency_recent * 1000, 0)} ms vs ${fixed(d.latency_mean * 1000, 0)} ms`;
  }
  if (d.latency_limit !== null && d.latency_limit !== undefined) {
    return `ok (latency limit ${d.latency_limit})`;
  }
  return d.consecutive_failures > 0 ? `ok (${d.consecutive_failures} failing)` : "ok";
}

// A queue's delayed table when it is not moved, else nothing.
function delayedMoves(moves) {
  if (moves === "failing") return " · delayed moves fail";
  if (moves === "nobody") return " · delayed: nobody moves";
  return "";
}

// Past this many queues the table shows the busiest this many (unless "all" is ticked or a
// filter is typed), as `throttlehost status` does; up to it, every queue in the host's order.
const QUEUES_SHOWN = 20;
// Charts drawn for queues: the first this many the table shows.
const QUEUE_CHARTS = 6;

// Busy first: in flight, then depth, then a breaker not closed; the host's order otherwise.
function busier(a, b) {
  return (
    b.q.in_flight - a.q.in_flight ||
    b.q.depth - a.q.depth ||
    Number(b.q.circuit_breaker !== "closed") - Number(a.q.circuit_breaker !== "closed") ||
    a.i - b.i
  );
}

// The queues the table shows, each with its index in /status: filtered by the text typed
// (part of the name), the busy ones first and the rest counted when there are many.
function shownQueues(queues) {
  const filter = document.getElementById("queue-filter").value.trim().toLowerCase();
  const all = document.getElementById("queue-all").checked;
  let shown = queues.map((q, i) => ({ q, i }));
  if (filter) shown = shown.filter(({ q }) => q.name.toLowerCase().includes(filter));
  const matching = shown.length;
  if (queues.length > QUEUES_SHOWN) shown.sort(busier);
  if (!all && shown.length > QUEUES_SHOWN) shown = shown.slice(0, QUEUES_SHOWN);
  const hidden = matching - shown.length;
  document.getElementById("queue-note").textContent =
    `${queues.length} queues` +
    (filter ? `, ${matching} matching` : "") +
    (hidden > 0 ? `; ${hidden} quieter not shown (tick "all" or type a filter)` : "");
  return shown;
}

function renderQueues(queues) {
  const body = document.querySelector("#queues tbody");
  const shown = shownQueues(queues);
  view.chartedQueues = shown.slice(0, QUEUE_CHARTS).map(({ q }) => q.name);
  body.replaceChildren(
    ...shown.map(({ q, i }) => {
      const at = `queues.${i}`;
      const processed = rate(q.name, "succeeded_total");
      const failed = rate(q.name, "failed_total");
      return row([
        q.name,
        q.model,
        number(`${at}.max`, q.max),
        number(`${at}.limit`, q.limit),
        number(`${at}.in_flight`, q.in_flight),
        number(`${at}.depth`, q.depth),
        q.error_queue,
        number(`${at}.error_queue_depth`, q.error_queue_depth),
        processed === null ? "–" : fixed(processed, 1),
        failed === null ? "–" : fixed(failed, 1),
        q.circuit_breaker,
        downstream(q.downstream) + delayedMoves(q.delayed_moves),
      ]);
    }),
  );
}

function renderStatus(status) {
  document.getElementById("host-name").textContent = status.host;
  document.getElementById("host-facts").replaceChildren(
    `${status.transport} · ${status.transaction_mode} · instance ${status.instance} · up `,
    number("uptime_seconds", status.uptime_seconds, (v) => `${fixed(v, 0)} s`),
    " · in process ",
    number("in_process", status.in_process),
    status.receiving ? "" : " · shutting down",
  );
  const t = status.throttling;
  if (t) {
    document.body.setAttribute("data-sampled-at", String(t.sampled_at_seconds));
    renderSensors(t.resources);
    for (const name of DIRECTIONS) renderDirection(name, t[name], t.resources);
  }
  view.status = status;
  renderQueues(status.queues);
}

// ---------- charts ----------

const W = 720;
const LEFT = 44;

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// The charts span the history held, from one minute up to ten, so a page on a young host
// is not a sliver at the right edge.
function span() {
  const s = view.samples;
  const held = s.length ? s[s.length - 1].unix_ms - s[0].unix_ms : 0;
  return Math.min(WINDOW_MS, Math.max(60 * 1000, held));
}

function xOf(ms, now) {
  const width = span();
  return LEFT + ((W - LEFT) * (ms - (now - width))) / width;
}

function ago(seconds) {
  return seconds >= 120 ? `-${fixed(seconds / 60, 0)} min` : `-${fixed(seconds, 0)} s`;
}

function timeAxis(svg, now, height) {
  const whole = span() / 1000;
  for (const [label, ago_s] of [[ago(whole), whole], [ago(whole / 2), whole / 2], ["now", 0]]) {
    const x = xOf(now - ago_s * 1000, now);
    const text = svgEl("text", { x: Math.min(x, W - 20), y: height - 2, class: "axis", "text-anchor": ago_s === 0 ? "end" : "start" });
    text.textContent = label;
    svg.append(text);
  }
}

function legend(id, entries) {
  document.getElementById(id).replaceChildren(
    ...entries.map(([cls, label]) => el("span", {}, el("span", { class: `swatch ${cls}` }), label)),
  );
}

// series: [{ label, values: [[ms, value|null]] }]; `limit` draws a dashed line at that value.
function lineChart(svg, series, now, { floor = 1, limit = null, format = plain } = {}) {
  const height = 140;
  const bottom = height - 14;
  let max = floor;
  for (const s of series) for (const [, v] of s.values) if (v !== null && v > max) max = v;
  if (limit !== null) max = Math.max(max, limit * 1.2);
  const yOf = (v) => bottom - ((bottom - 6) * v) / max;
  const nodes = [];
  for (const frac of [0, 0.5, 1]) {
    const y = yOf(max * frac);
    nodes.push(svgEl("line", { x1: LEFT, x2: W, y1: y, y2: y, class: "grid" }));
    const t = svgEl("text", { x: LEFT - 4, y: y + 3, class: "axis", "text-anchor": "end" });
    t.textContent = format(max * frac);
    nodes.push(t);
  }
  if (limit !== null) nodes.push(svgEl("line", { x1: LEFT, x2: W, y1: yOf(limit), y2: yOf(limit), class: "limit-line" }));
  series.forEach((s, i) => {
    const points = s.values
      .filter(([, v]) => v !== null)
      .map(([ms, v]) => `${xOf(ms, now).toFixed(1)},${yOf(v).toFixed(1)}`)
      .join(" ");
    if (points) nodes.push(svgEl("polyline", { points, class: `c${i % 8}` }));
  });
  svg.replaceChildren(...nodes);
  timeAxis(svg, now, height);
}

function drawStates(now) {
  const svg = document.getElementById("chart-states");
  const nodes = [];
  const width = Math.max(1, ((W - LEFT) * 1000) / span()) + 0.5;
  const seen = new Map();
  DIRECTIONS.forEach((name, row) => {
    const label = svgEl("text", { x: LEFT - 4, y: 20 + row * 28, class: "axis", "text-anchor": "end" });
    label.textContent = name === "delivery" ? "deliv." : "publ.";
    nodes.push(label);
    for (const s of view.samples) {
      const code = s[name].state;
      const cls = severity(code);
      seen.set(`${name} ${code}`, cls);
      nodes.push(svgEl("rect", { x: xOf(s.unix_ms, now).toFixed(1), y: 6 + row * 28, width: width.toFixed(1), height: 22, class: cls }));
    }
  });
  svg.replaceChildren(...nodes);
  timeAxis(svg, now, 80);
  legend("legend-states", [...seen.entries()].sort().map(([key, cls]) => [cls, `${key}`]));
}

function series(label, pick) {
  return { label, values: view.samples.map((s) => [s.unix_ms, pick(s)]) };
}

function drawCharts() {
  if (view.samples.length === 0) return;
  const now = view.samples[view.samples.length - 1].unix_ms;
  drawStates(now);

  const delays = DIRECTIONS.map((d) => series(`${d} delay`, (s) => s[d].delay_seconds));
  lineChart(document.getElementById("chart-delay"), delays, now, { floor: 0.1, format: seconds });
  legend("legend-delay", delays.map((s, i) => [`c${i}`, s.label]));

  const names = [];
  for (const s of view.samples) for (const c of s.conditions) if (!names.includes(c.condition)) names.push(c.condition);
  const conditions = names.map((n) =>
    series(n.replaceAll("_", " "), (s) => {
      const c = s.conditions.find((x) => x.condition === n);
      return c ? c.percent : null;
    }),
  );
  lineChart(document.getElementById("chart-conditions"), conditions, now, { floor: 100, limit: 100, format: (v) => `${fixed(v, 0)}%` });
  legend("legend-conditions", conditions.map((s, i) => [`c${i % 8}`, s.label]));

  const rates = [];
  for (const d of DIRECTIONS) {
    rates.push(series(`${d} in`, (s) => s[d].incoming_per_second));
    rates.push(series(`${d} out`, (s) => s[d].outgoing_per_second));
  }
  lineChart(document.getElementById("chart-rates"), rates, now, { format: (v) => fixed(v, 0) });
  legend("legend-rates", rates.map((s, i) => [`c${i}`, s.label]));

  drawQueueCharts(now);
}

// The id of a queue's chart element: its name with what an id cannot hold replaced.
function chartId(name) {
  return `chart-queue-${name.replace(/[^A-Za-z0-9_-]/g, "_")}`;
}

// Charts of the queues the table shows first (the busiest, with many queues); the charts of
// queues that left that set go.
function drawQueueCharts(now) {
  const container = document.getElementById("queue-charts");
  const names = view.chartedQueues || [];
  const ids = new Set(names.map(chartId));
  for (const figure of [...container.children]) {
    const svg = figure.querySelector("svg");
    if (!svg || !ids.has(svg.id)) figure.remove();
  }
  for (const name of names) {
    const id = chartId(name);
    let svg = document.getElementById(id);
    if (!svg) {
      svg = svgEl("svg", { id, viewBox: "0 0 720 140", role: "img", "aria-label": `queue ${name}` });
      const figure = el("figure", {}, el("figcaption", {}, `Queue ${name}: limit, in flight, depth`), svg, el("div", { class: "legend", id: `${id}-legend` }));
      container.append(figure);
    }
    const pick = (field) => (s) => {
      const x = queueOf(s, name);
      return x ? x[field] : null;
    };
    const lines = [series("limit", pick("limit")), series("in flight", pick("in_flight")), series("depth", pick("depth"))];
    lineChart(svg, lines, now, { format: (v) => fixed(v, 0) });
    legend(`${id}-legend`, lines.map((s, i) => [`c${i}`, s.label]));
  }
}

// ---------- polling and connection ----------

function setConnection(kind, text) {
  const node = document.getElementById("connection");
  node.className = `connection ${kind}`;
  node.textContent = text;
  document.body.setAttribute("data-connection", kind);
}

async function poll() {
  if (view.paused) return;
  try {
    // A host that accepts but does not answer counts as disconnected after 3 s.
    const response = await fetch(`/console/data?after=${view.after}`, { cache: "no-store", signal: AbortSignal.timeout(3000) });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    if (view.instance !== null && data.status.instance !== view.instance) {
      // A new host on this address: its history replaces the old one's.
      view.instance = data.status.instance;
      view.samples = [];
      view.after = 0;
      return poll();
    }
    view.instance = data.status.instance;
    for (const s of data.samples) view.samples.push(s);
    const cutoff = (view.samples.length ? view.samples[view.samples.length - 1].unix_ms : 0) - WINDOW_MS;
    while (view.samples.length && view.samples[0].unix_ms < cutoff) view.samples.shift();
    if (view.samples.length) view.after = view.samples[view.samples.length - 1].seq;
    renderStatus(data.status);
    drawCharts();
    setConnection("live", "live");
  } catch (error) {
    setConnection("disconnected", `disconnected (${error.message}); retrying every second`);
  }
}

function loop() {
  poll().finally(() => setTimeout(loop, POLL_MS));
}

// ---------- the fleet ----------

// An admin address another machine can open: one bound to every interface says which port,
// not where; it is shown, not linked.
function consoleLink(address) {
  if (!address) return "–";
  if (/^(0\.0\.0\.0|\[::\]):/.test(address)) return address;
  return el("a", { href: `http://${address}/` }, address);
}

function directionCell(d) {
  if (!d) return "–";
  const text = `${d.state} ${d.state_name}${d.recovering ? " (recovering)" : ""}`;
  return el("span", { class: `state-text ${severity(d.state)}`, "data-state": String(d.state) }, text);
}

function renderFleet(fleet) {
  const note = document.getElementById("fleet-note");
  note.textContent = fleet.heartbeat_error
    ? `this host's heartbeat is failing: ${fleet.heartbeat_error}`
    : `${fleet.instances.length} instance(s); gone after ${fixed(fleet.gone_after_seconds, 0)} s without a heartbeat`;
  const body = document.querySelector("#fleet tbody");
  body.replaceChildren(
    ...fleet.instances.map((m) => {
      const t = (m.summary && m.summary.throttling) || {};
      const delivery = t.delivery;
      const seen = m.gone ? `gone (${fixed(m.seen_seconds_ago, 0)} s ago)` : `${fixed(m.seen_seconds_ago, 1)} s ago`;
      const tr = row([
        `${m.instance_id}${m.this ? " (this)" : ""}`,
        m.host_name,
        m.version,
        directionCell(delivery),
        directionCell(t.publishing),
        m.summary && m.summary.in_process !== undefined ? plain(m.summary.in_process) : "–",
        delivery ? fixed(delivery.outgoing_per_second, 1) : "–",
        seen,
        m.this ? "this page" : consoleLink(m.admin_address),
      ]);
      tr.setAttribute("data-process", m.process_id);
      if (m.gone) tr.className = "gone";
      return tr;
    }),
  );
}

async function pollFleet() {
  if (view.paused) return;
  const note = document.getElementById("fleet-note");
  try {
    const response = await fetch("/fleet", { cache: "no-store", signal: AbortSignal.timeout(3000) });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      note.textContent = body.error || `no fleet view (HTTP ${response.status})`;
      document.querySelector("#fleet tbody").replaceChildren();
      return;
    }
    renderFleet(body);
  } catch (error) {
    note.textContent = `no fleet view (${error.message})`;
  }
}

function fleetLoop() {
  pollFleet().finally(() => setTimeout(fleetLoop, FLEET_POLL_MS));
}

// ---------- controls ----------

async function applyOverride(direction, mode, fleet) {
  const message = document.getElementById("override-message");
  const token = document.getElementById("token").value.trim();
  sessionStorage.setItem("throttlehost-token", token);
  const headers = { "Content-Type": "text/plain" };
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const scope = fleet ? "?scope=fleet" : "";
    const response = await fetch(`/throttling/${direction}/override${scope}`, { method: "PUT", headers, body: mode });
    const body = await response.json().catch(() => ({}));
    if (response.ok) {
      message.className = "accepted";
      const where = body.scope === "fleet" ? " on every instance (the others at their next heartbeat)" : "";
      message.textContent = `${direction} override set to ${body.override || mode}${where}`;
    } else {
      message.className = "refused";
      const hint = response.status === 401 || response.status === 403 ? " Enter the admin token above." : "";
      message.textContent = `Refused (${response.status}): ${body.error || "no reason given"}.${hint}`;
    }
  } catch (error) {
    message.className = "refused";
    message.textContent = `The host did not answer: ${error.message}`;
  }
  poll();
}

// ---------- failed messages ----------
// Everything from the error queue is put in the page as text (textContent), never as
// markup: a body or header with script in it shows as the characters it is.

const FAILED_POLL_MS = 5000;

function authorized(json) {
  const token = document.getElementById("token").value.trim();
  const headers = json ? { "Content-Type": "application/json" } : {};
  if (token) headers.Authorization = `Bearer ${token}`;
  return headers;
}

function say(id, ok, text) {
  const message = document.getElementById(id);
  message.className = ok ? "accepted" : "refused";
  message.textContent = text;
}

// POSTs a selection to /errors/retry or /errors/delete and says what happened.
async function actOnFailed(action, selection) {
  try {
    const response = await fetch(`/errors/${action}`, {
      method: "POST", headers: authorized(true), body: JSON.stringify(selection),
    });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      const hint = response.status === 401 ? " Enter the admin token above." : "";
      say("failed-message", false, `Refused (${response.status}): ${body.error || "no reason given"}.${hint}`);
      return;
    }
    say("failed-message", true, action === "delete"
      ? `deleted ${body.deleted} failed message(s)`
      : "retry started: each message goes back through the publishing throttle");
  } catch (error) {
    say("failed-message", false, `The host did not answer: ${error.message}`);
  }
  setTimeout(pollFailed, 500);
}

function button(text, role, onClick) {
  const b = el("button", { type: "button", "data-role": role });
  b.textContent = text;
  b.addEventListener("click", onClick);
  return b;
}

function text(value) {
  const span = el("span");
  span.textContent = value === null || value === undefined ? "–" : String(value);
  return span;
}

function renderFailedGroups(answer) {
  const body = document.querySelector("#failed-groups tbody");
  body.replaceChildren();
  document.getElementById("failed-note").textContent = `(${answer.queue})`;
  for (const g of answer.groups) {
    const tr = row([
      text(g.id), text(g.count), text(g.first), text(g.last), text(g.cause.source),
      text(`${g.cause.exception_type}: ${g.cause.message}`),
    ]);
    tr.setAttribute("data-group", g.id);
    tr.setAttribute("data-count", String(g.count));
    const actions = el("td");
    actions.append(
      button("Show", "show", () => showGroup(g.id)),
      button("Retry", "retry", () => actOnFailed("retry", { filter: { group: g.id } })),
      button("Delete", "delete", () => actOnFailed("delete", { filter: { group: g.id } })),
    );
    tr.append(actions);
    body.append(tr);
  }
  if (answer.groups.length === 0) body.append(row([text("no failed messages")]));
}

async function pollFailed() {
  try {
    const response = await fetch("/errors/groups", { cache: "no-store", signal: AbortSignal.timeout(10000) });
    const answer = await response.json();
    if (response.ok) {
      document.body.setAttribute("data-failed-groups", String(answer.groups.length));
      renderFailedGroups(answer);
    } else {
      document.getElementById("failed-note").textContent = answer.error || "";
    }
  } catch (error) {
    document.getElementById("failed-note").textContent = `not read: ${error.message}`;
  }
}

function failedLoop() {
  pollFailed().finally(() => setTimeout(failedLoop, FAILED_POLL_MS));
}

async function showGroup(group) {
  const list = document.getElementById("failed-list");
  list.hidden = false;
  document.getElementById("failed-list-group").textContent = group;
  const body = document.querySelector("#failed-messages tbody");
  body.replaceChildren();
  const response = await fetch(`/errors/messages?group=${encodeURIComponent(group)}&limit=100`, { cache: "no-store" });
  const answer = await response.json().catch(() => ({ messages: [] }));
  for (const m of answer.messages || []) {
    const box = el("input", { type: "checkbox", "data-id": m.id, "aria-label": `select ${m.id}` });
    const id = button(m.id, "view", () => showMessage(m.id));
    const tr = row([box, id, text(m.message_id), text(m.failed_at)]);
    body.append(tr);
  }
}

async function showMessage(id) {
  const view = document.getElementById("failed-view");
  view.hidden = false;
  const response = await fetch(`/errors/messages/${encodeURIComponent(id)}`, { cache: "no-store" });
  const m = await response.json().catch(() => ({}));
  if (!response.ok) {
    view.textContent = m.error || `not found (${response.status})`;
    return;
  }
  const headers = m.headers
    ? Object.entries(m.headers).map(([k, v]) => `  ${k}: ${v}`).join("\n")
    : `  (not a JSON object) ${m.raw_headers}`;
  view.textContent = [
    `id ${m.id}   group ${m.group}`,
    `failed in ${m.cause.source || "–"} at ${m.cause.failed_at || "–"}`,
    `${m.cause.exception_type}: ${m.cause.message}`,
    `headers\n${headers}`,
    `body (${m.body.size} bytes, ${m.body.kind}${m.body.cut ? ", cut" : ""})\n${m.body.shown}`,
    m.stack_trace ? `stack trace\n${m.stack_trace}` : "",
  ].join("\n\n");
}

function selectedIds() {
  return [...document.querySelectorAll("#failed-messages tbody input:checked")].map((b) => b.dataset.id);
}

function startFailedPanel() {
  document.getElementById("failed-select-all").addEventListener("change", (event) => {
    for (const box of document.querySelectorAll("#failed-messages tbody input")) box.checked = event.target.checked;
  });
  document.getElementById("failed-retry-selected").addEventListener("click", () =>
    actOnFailed("retry", { filter: { ids: selectedIds() } }));
  document.getElementById("failed-delete-selected").addEventListener("click", () =>
    actOnFailed("delete", { filter: { ids: selectedIds() } }));
  failedLoop();
}

// The two direction cards, from one template.
const DIRECTION_TITLES = {
  delivery: ["Delivery", "(receiving and handling)"],
  publishing: ["Publishing", "(sending and ingest)"],
};

function buildDirectionCards() {
  const template = document.getElementById("direction-card");
  const container = document.getElementById("directions");
  for (const name of DIRECTIONS) {
    const card = template.content.firstElementChild.cloneNode(true);
    card.id = `dir-${name}`;
    card.setAttribute("data-direction", name);
    card.querySelector("[data-role=title]").textContent = DIRECTION_TITLES[name][0];
    card.querySelector("[data-role=subtitle]").textContent = DIRECTION_TITLES[name][1];
    container.append(card);
  }
}

function start() {
  buildDirectionCards();
  document.getElementById("token").value = sessionStorage.getItem("throttlehost-token") || "";
  for (const name of DIRECTIONS) {
    const card = document.getElementById(`dir-${name}`);
    card.querySelector("[data-role=override]").addEventListener("submit", (event) => {
      event.preventDefault();
      applyOverride(
        name,
        card.querySelector("[data-role=override-mode]").value,
        card.querySelector("[data-role=override-fleet]").checked,
      );
    });
  }
  // The queue table follows the filter at once, not at the next poll.
  const redrawQueues = () => {
    if (view.status) renderQueues(view.status.queues);
  };
  document.getElementById("queue-filter").addEventListener("input", redrawQueues);
  document.getElementById("queue-all").addEventListener("change", redrawQueues);
  const pause = document.getElementById("pause");
  pause.addEventListener("click", () => {
    view.paused = !view.paused;
    pause.textContent = view.paused ? "Resume" : "Pause";
    pause.setAttribute("aria-pressed", String(view.paused));
    document.body.setAttribute("data-paused", String(view.paused));
  });
  loop();
  fleetLoop();
  startFailedPanel();
}

document.addEventListener("DOMContentLoaded", start);
