// monarch_nb live dashboard (anywidget ESM; no build step).
//
// The kernel sends custom messages (see monarch_nb/ui/dashfeed.py):
//   {t: "snapshot", world, series: [[rank, name, steps, values]], tiles, events, names, flight, lost, group}
//   {t: "delta", series?, cuts?, tiles?, events?, names?, state?, flight?, lost?, group?}
// group: the torch group's size now when it went on without lost ranks, else ""
// lost: [{host, ranks, hint}]: the hosts lost with ranks on them, worded by
// the kernel as %monarch status words them (monarch_nb/ui/status.py).
// flight: {findings: [text], slow: {rank: ratio}}: the collectives badge
// (what mesh.collectives() finds) and the straggler marks on the tiles.
// Data lives per widget (shared by its views); views redraw
// at most once per animation frame, only when something changed.
// Series ordering rules match metricstore.py: append above the last step,
// replace an equal step, insert a lower one; a cut drops steps >= s.

const MAX_POINTS = 4000; // per rank and metric, older half thinned beyond
const BAND_MIN = 9; // from this many ranks: mean + min-max band, one rank on demand
const STATE_COLOURS = {
  starting: "#9e9e9e", ready: "#2e7d32", busy: "#1565c0", respawning: "#ef6c00",
  dead: "#c62828", waiting: "#c62828", failed: "#7f0000", lost: "#7f0000", stopped: "#616161",
};
const LINE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

const CSS = `
.mnb-dash { font: 12px/1.35 var(--jp-ui-font-family, system-ui, sans-serif);
  color: var(--jp-ui-font-color1, #222); border: 1px solid var(--jp-border-color2, #ddd);
  border-radius: 4px; padding: 8px; max-width: 1100px; }
.mnb-head { display: flex; gap: 12px; align-items: center; margin-bottom: 6px; }
.mnb-title { font-weight: 600; }
.mnb-tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 6px; }
.mnb-tiles.compact { grid-template-columns: repeat(auto-fill, minmax(70px, 1fr)); gap: 3px; }
.mnb-tile { border-left: 6px solid #9e9e9e; background: var(--jp-layout-color2, #f5f5f5);
  padding: 4px 6px; border-radius: 3px; cursor: pointer; overflow: hidden; }
.mnb-tile div { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.mnb-tile.sel { outline: 2px solid #ff9800; }
.mnb-tile .st { float: right; font-weight: 600; }
.mnb-chart { width: 100%; height: 260px; display: block; margin-top: 8px;
  background: var(--jp-layout-color0, #fff); }
.mnb-events { max-height: 110px; overflow-y: auto; margin-top: 6px; font-family: monospace; font-size: 11px; }
.mnb-ev-died, .mnb-ev-gave_up, .mnb-ev-failed_start { color: #c62828; }
.mnb-ev-busy_silent { color: #ef6c00; }
.mnb-ev-respawned, .mnb-ev-ready { color: #2e7d32; }
.mnb-badge { display: none; margin: 0 0 6px 0; padding: 4px 8px; border-radius: 3px;
  background: #fff3e0; border: 1px solid #ef6c00; color: #8a3b00; }
.mnb-badge.on { display: block; }
.mnb-badge b { color: #c62828; }
.mnb-badge div { font-family: monospace; font-size: 11px; white-space: pre-wrap; margin-top: 2px; }
.mnb-hosts { display: none; margin: 0 0 6px 0; padding: 4px 8px; border-radius: 3px;
  background: #fdecea; border: 1px solid #7f0000; color: #7f0000; }
.mnb-hosts.on { display: block; }
.mnb-hosts div { font-family: monospace; font-size: 11px; margin-top: 2px; }
.mnb-slow { margin-left: 6px; padding: 0 4px; border-radius: 3px; background: #ef6c00;
  color: #fff; font-size: 10px; font-weight: 600; }
`;

// Per widget (by its uid), shared by its views: anywidget hands each view
// and initialize() a different model wrapper, so data cannot hang off it.
const STORES = new Map();
function dataFor(model) {
  const id = model.get("uid");
  let data = STORES.get(id);
  if (!data) { data = newData(); STORES.set(id, data); }
  return data;
}

function newData() {
  return { world: 0, state: "running", series: new Map(), tiles: new Map(), events: [],
    names: [], flight: { findings: [], slow: {} }, lost: [], group: "", version: 0, listeners: new Set() };
}

function seriesOf(data, rank, name) {
  let byName = data.series.get(rank);
  if (!byName) { byName = new Map(); data.series.set(rank, byName); }
  let s = byName.get(name);
  if (!s) { s = { steps: [], values: [] }; byName.set(name, s); }
  return s;
}

function lowerBound(arr, x) {
  let lo = 0, hi = arr.length;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] < x) lo = mid + 1; else hi = mid; }
  return lo;
}

function addPoints(s, steps, values) {
  for (let i = 0; i < steps.length; i++) {
    const step = steps[i], v = values[i];
    const n = s.steps.length;
    if (n === 0 || step > s.steps[n - 1]) { s.steps.push(step); s.values.push(v); continue; }
    const j = lowerBound(s.steps, step);
    if (s.steps[j] === step) s.values[j] = v;
    else { s.steps.splice(j, 0, step); s.values.splice(j, 0, v); }
  }
  if (s.steps.length > MAX_POINTS) {
    const half = s.steps.length >> 1;
    const keepS = [], keepV = [];
    for (let i = 0; i < half; i += 2) { keepS.push(s.steps[i]); keepV.push(s.values[i]); }
    s.steps = keepS.concat(s.steps.slice(half));
    s.values = keepV.concat(s.values.slice(half));
  }
}

function apply(data, msg) {
  if (msg.t === "snapshot") {
    data.series = new Map(); data.tiles = new Map(); data.events = [];
    data.world = msg.world;
  }
  if (msg.state) data.state = msg.state;
  for (const [rank, name, step] of msg.cuts || []) {
    const s = seriesOf(data, rank, name);
    const j = lowerBound(s.steps, step);
    s.steps.length = j; s.values.length = j;
  }
  for (const [rank, name, steps, values] of msg.series || []) {
    addPoints(seriesOf(data, rank, name), steps, values);
  }
  for (const t of msg.tiles || []) data.tiles.set(t.rank, t);
  if (msg.events) data.events = data.events.concat(msg.events).slice(-200);
  if (msg.names) data.names = msg.names;
  if (msg.flight) data.flight = msg.flight;
  if (msg.lost) data.lost = msg.lost;
  if (msg.group !== undefined) data.group = msg.group;
  if (msg.world) data.world = msg.world;
  data.version++;
  for (const fn of data.listeners) fn();
}

// -- formatting ---------------------------------------------------------------
const na = "n/a";
const esc = (x) => String(x).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
function bytes(b) {
  if (b === null || b === undefined) return na;
  if (b >= 1e9) return (b / 1e9).toFixed(1) + " GB";
  return (b / 1e6).toFixed(0) + " MB";
}
function num(v, unit, digits = 0) {
  return v === null || v === undefined ? na : v.toFixed(digits) + unit;
}
function tileLines(t) {
  const gpu = t.gpu_mem_total == null ? "GPU n/a" :
    `GPU ${bytes(t.gpu_mem)}/${bytes(t.gpu_mem_total)} (peak ${bytes(t.gpu_mem_peak)}) ` +
    `${num(t.gpu_util, "%")} ${num(t.gpu_temp, "°C")} ${num(t.gpu_power, " W")}`;
  const last = Object.entries(t.last || {}).map(([k, v]) => `${k} ${v}`).join(" · ");
  return [
    `pid ${t.pid ?? "-"} · inc ${t.incarnation} · ${t.device || "-"}` +
      (t.hb ? ` · hb ${t.hb}s ago` : "") +
      // the torch group's number, where a shrink made it differ from the mesh's
      (t.torch_rank === null ? " · out of the group" :
        t.torch_rank !== undefined && t.torch_rank !== t.rank ? ` · torch rank ${t.torch_rank}` : ""),
    `CPU ${num(t.cpu, "%")} · RSS ${bytes(t.rss)}`,
    gpu,
    `${t.sps == null ? "-" : t.sps} steps/s`,
  ].concat(last ? [last] : [], t.exit ? [t.exit] : []);
}

// -- views ----------------------------------------------------------------------
function render({ model, el }) {
  const data = dataFor(model);
  const root = document.createElement("div");
  root.className = "mnb-dash";
  root.innerHTML = `<style>${CSS}</style>
    <div class="mnb-head"><span class="mnb-title"></span>
      <label>metric <select class="mnb-metric"></select></label>
      <span class="mnb-hint"></span></div>
    <div class="mnb-hosts"></div>
    <div class="mnb-badge"></div>
    <div class="mnb-tiles"></div>
    <canvas class="mnb-chart"></canvas>
    <div class="mnb-events"></div>`;
  el.appendChild(root);
  const title = root.querySelector(".mnb-title");
  const select = root.querySelector(".mnb-metric");
  const hint = root.querySelector(".mnb-hint");
  const tilesEl = root.querySelector(".mnb-tiles");
  const badgeEl = root.querySelector(".mnb-badge");
  const hostsEl = root.querySelector(".mnb-hosts");
  const canvas = root.querySelector(".mnb-chart");
  const eventsEl = root.querySelector(".mnb-events");
  let metric = null, chosen = null, drawn = -1, frame = 0;
  const tileEls = new Map();

  select.addEventListener("change", () => { metric = select.value; schedule(); });

  function drawTiles() {
    const compact = data.world > 16;
    tilesEl.classList.toggle("compact", compact);
    for (const [rank, t] of [...data.tiles.entries()].sort((a, b) => a[0] - b[0])) {
      let div = tileEls.get(rank);
      if (!div) {
        div = document.createElement("div");
        div.className = "mnb-tile";
        div.dataset.rank = rank;
        div.addEventListener("click", () => { chosen = chosen === rank ? null : rank; schedule(); });
        tilesEl.appendChild(div);
        tileEls.set(rank, div);
      }
      div.dataset.state = t.state;
      div.style.borderLeftColor = STATE_COLOURS[t.state] || "#9e9e9e";
      div.classList.toggle("sel", chosen === rank);
      const lines = tileLines(t);
      const swatch = data.world < BAND_MIN ?
        `<span style="color:${LINE_COLOURS[rank % LINE_COLOURS.length]}">■</span> ` : "";
      const ratio = data.flight.slow[String(rank)];
      div.dataset.slow = ratio === undefined ? "" : String(ratio);
      const slow = ratio === undefined ? "" :
        `<span class="mnb-slow" title="a straggler: ${ratio}x the others' median compute time between collectives (mesh.stragglers())">slow ${Number(ratio).toFixed(1)}x</span>`;
      const head = `${swatch}<b>rank ${rank}</b>${slow}<span class="st" style="color:${STATE_COLOURS[t.state]}">${esc(t.state)}</span>`;
      if (compact) {
        const v = metric && t.last && t.last[metric] !== undefined ? t.last[metric] : "";
        div.innerHTML = `${head}<div>${esc(v)}</div>`;
        div.title = lines.join("\n");
      } else {
        div.innerHTML = head + lines.map((l) => `<div>${esc(l)}</div>`).join("");
      }
    }
  }

  function drawHosts() {
    const lost = data.lost;
    hostsEl.classList.toggle("on", lost.length > 0 || data.group !== "");
    hostsEl.dataset.hosts = lost.map((l) => l.host).join(",");
    hostsEl.dataset.group = data.group;
    hostsEl.innerHTML = (data.group ? `<div class="mnb-group">${esc(data.group)}</div>` : "") +
      lost.map((l) =>
        `<b>host ${esc(l.host)} lost</b> with rank ${esc(l.ranks)}<div>${esc(l.hint)}</div>`
      ).join("");
  }

  function drawBadge() {
    const found = data.flight.findings;
    badgeEl.classList.toggle("on", found.length > 0);
    badgeEl.dataset.count = String(found.length);
    badgeEl.innerHTML = found.length ? `<b>⚠ collectives: ${found.length} ${found.length === 1 ? "finding" : "findings"}</b>` +
      found.map((f) => `<div>${esc(f)}</div>`).join("") +
      "<div>(%monarch collectives, %monarch stacks)</div>" : "";
  }

  function drawEvents() {
    const rows = data.events.slice(-50).reverse().map((e) => {
      const time = new Date(e.time * 1000).toLocaleTimeString();
      const who = e.rank >= 0 ? `rank ${e.rank} (inc ${e.inc})` : "mesh";
      return `<div class="mnb-ev-${esc(e.kind)}">${time} ${who} ${esc(e.kind)}` +
        (e.detail ? `: ${esc(e.detail)}` : "") + "</div>";
    });
    eventsEl.innerHTML = rows.join("") || "<div>no deaths, respawns or re-formations</div>";
  }

  function drawChart() {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 600, h = canvas.clientHeight || 260;
    canvas.width = w * dpr; canvas.height = h * dpr;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const lines = [];
    for (const [rank, byName] of data.series) {
      const s = metric && byName.get(metric);
      if (s && s.steps.length) lines.push([rank, s]);
    }
    lines.sort((a, b) => a[0] - b[0]);
    const band = data.world >= BAND_MIN;
    let drawnPoints = 0;
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const [, s] of lines) {
      x0 = Math.min(x0, s.steps[0]); x1 = Math.max(x1, s.steps[s.steps.length - 1]);
      for (const v of s.values) if (v !== null) { if (v < y0) y0 = v; if (v > y1) y1 = v; }
    }
    const padL = 56, padB = 20, padT = 8, padR = 10;
    ctx.fillStyle = "#888"; ctx.font = "11px sans-serif";
    if (!lines.length || !isFinite(y0)) {
      ctx.fillText(metric ? `no points for ${metric} yet` : "no metrics yet: call mnb.log(loss=...) on the ranks", padL, h / 2);
      canvas.dataset.points = "0"; canvas.dataset.lines = "0";
      return;
    }
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y1 += Math.abs(y0) * 0.05 + 1e-9; y0 -= Math.abs(y0) * 0.05 + 1e-9; }
    const X = (x) => padL + (x - x0) / (x1 - x0) * (w - padL - padR);
    const Y = (y) => padT + (1 - (y - y0) / (y1 - y0)) * (h - padT - padB);
    ctx.strokeStyle = "#ccc"; ctx.beginPath();
    ctx.moveTo(padL, padT); ctx.lineTo(padL, h - padB); ctx.lineTo(w - padR, h - padB); ctx.stroke();
    ctx.fillText(Number(y1.toPrecision(3)).toString(), 2, padT + 8);
    ctx.fillText(Number(y0.toPrecision(3)).toString(), 2, h - padB);
    ctx.fillText(`step ${x0}`, padL, h - 5);
    const right = `step ${x1}`;
    ctx.fillText(right, w - padR - ctx.measureText(right).width, h - 5);
    const path = (s, colour, width) => {
      ctx.strokeStyle = colour; ctx.lineWidth = width; ctx.beginPath();
      let pen = false;
      for (let i = 0; i < s.steps.length; i++) {
        const v = s.values[i];
        if (v === null) { pen = false; continue; }
        if (pen) ctx.lineTo(X(s.steps[i]), Y(v)); else { ctx.moveTo(X(s.steps[i]), Y(v)); pen = true; }
        drawnPoints++;
      }
      ctx.stroke();
    };
    if (band) {
      const agg = new Map(); // step -> [sum, n, min, max]
      for (const [, s] of lines) {
        for (let i = 0; i < s.steps.length; i++) {
          const v = s.values[i];
          if (v === null) continue;
          const a = agg.get(s.steps[i]);
          if (a) { a[0] += v; a[1]++; if (v < a[2]) a[2] = v; if (v > a[3]) a[3] = v; }
          else agg.set(s.steps[i], [v, 1, v, v]);
        }
      }
      const steps = [...agg.keys()].sort((a, b) => a - b);
      ctx.fillStyle = "rgba(31,119,180,0.18)"; ctx.beginPath();
      steps.forEach((st, i) => { const a = agg.get(st); i ? ctx.lineTo(X(st), Y(a[3])) : ctx.moveTo(X(st), Y(a[3])); });
      for (let i = steps.length - 1; i >= 0; i--) ctx.lineTo(X(steps[i]), Y(agg.get(steps[i])[2]));
      ctx.closePath(); ctx.fill();
      path({ steps, values: steps.map((st) => agg.get(st)[0] / agg.get(st)[1]) }, "#1f77b4", 1.5);
      hint.textContent = `mean and min-max of ${lines.length} ranks; click a tile to show one rank`;
    } else {
      for (const [rank, s] of lines) {
        path(s, LINE_COLOURS[rank % LINE_COLOURS.length], chosen === rank ? 2.5 : 1.2);
      }
      hint.textContent = lines.length > 1 ? "one line per rank; click a tile to highlight" : "";
    }
    if (chosen !== null) {
      const s = data.series.get(chosen) && data.series.get(chosen).get(metric);
      if (s) path(s, "#ff9800", 2.5);
    }
    canvas.dataset.points = String(drawnPoints);
    canvas.dataset.lines = String(band ? 1 : lines.length);
  }

  function draw() {
    frame = 0;
    if (drawn === data.version && !draw.force) return;
    draw.force = false;
    drawn = data.version;
    const stopped = data.state === "stopped" ? " (stopped)" : "";
    title.textContent = `monarch_nb · ${data.world} ranks${stopped}`;
    if (data.names.length && (metric === null || !data.names.includes(metric))) {
      metric = data.names.includes("loss") ? "loss" : data.names[0];
    }
    if (select.options.length !== data.names.length) {
      select.innerHTML = data.names.map((n) => `<option>${esc(n)}</option>`).join("");
    }
    if (metric !== null) select.value = metric;
    select.parentElement.style.display = data.names.length > 1 ? "" : "none";
    drawHosts();
    drawBadge();
    drawTiles();
    drawChart();
    drawEvents();
  }
  function schedule() {
    draw.force = true;
    if (!frame) frame = requestAnimationFrame(draw);
  }
  const listener = () => { if (!frame) frame = requestAnimationFrame(draw); };
  data.listeners.add(listener);
  schedule();
  return () => { data.listeners.delete(listener); if (frame) cancelAnimationFrame(frame); };
}

function initialize({ model }) {
  const data = dataFor(model);
  model.on("msg:custom", (msg) => apply(data, msg));
  model.send({ t: "hello" }); // a fresh model: ask for everything so far
}

export default { initialize, render };
