// The live view: engine state, the memory plan as one bar, plots of the last minutes, the expert cache as a heat
// map (MoE layers x time, colour = hit rate), OOM recoveries. Fed by GET /v1/live (see live.py for the fields).

import { escapeHtml } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const GiB = 1024 ** 3, MiB = 1024 ** 2;

/** Bytes as the boot plan's table writes them: "1.23 GiB", or "512.0 MiB" below 1 GiB. */
export function gib(n) { return Math.abs(n) >= GiB ? `${fixedEven(n / GiB, 2)} GiB` : `${fixedEven(n / MiB, 1)} MiB`; }

/** x with d decimals, an exact tie rounded to even as Python's format does (toFixed rounds it up). */
function fixedEven(x, d) {
  const m = x * 10 ** d, lo = Math.floor(m);
  if (m - lo !== 0.5) return x.toFixed(d);
  return ((lo % 2 === 0 ? lo : lo + 1) / 10 ** d).toFixed(d);
}

// the bar's parts, left to right: [data-part, label, plan field, shown when 0]
const PARTS = [
  ["reserve", "reserve", "reserve_bytes", true],
  ["weights", "weights", "weights_bytes", true],
  ["workspace", "workspace", "workspace_bytes", true],
  ["graphs", "CUDA graphs", "graph_bytes", false],
  ["state", "recurrent state", "state_bytes", false],
  ["kv", "KV pool", "kv_bytes", true],
  ["experts", "expert slots", "expert_bytes", true],
  ["headroom", "headroom", "headroom_bytes", true],
];

function fmt(v, digits = 1) { return v == null ? "–" : Number(v).toFixed(digits); }

/** A small SVG line plot of `series` ([{values: [[t, v|null]], color, dots}]) over [t0, t1]. */
function svgPlot(series, t0, t1, yMax) {
  const W = 300, H = 44;
  const x = (t) => ((t - t0) / Math.max(1e-9, t1 - t0)) * W;
  const y = (v) => H - 2 - (v / yMax) * (H - 6);
  let out = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">`;
  for (const s of series) {
    let run = [];
    const flush = () => {
      if (run.length > 1) {
        out += `<polyline fill="none" stroke="${s.color}" stroke-width="1.5" vector-effect="non-scaling-stroke" ` +
               `points="${run.join(" ")}"/>`;
      }
      run = [];
    };
    for (const [t, v] of s.values) {
      if (v == null) { flush(); continue; }
      run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      if (s.dots) out += `<circle cx="${x(t).toFixed(1)}" cy="${y(v).toFixed(1)}" r="1.8" fill="${s.color}"/>`;
    }
    flush();
  }
  return `${out}</svg>`;
}

function hitColor(r) {
  // red (0) -> yellow (0.5) -> green (1)
  const lerp = (a, b, f) => Math.round(a + (b - a) * f);
  const [c0, c1, f] = r < 0.5 ? [[200, 55, 45], [242, 201, 76], r * 2] : [[242, 201, 76], [31, 157, 85], (r - 0.5) * 2];
  return `rgb(${lerp(c0[0], c1[0], f)},${lerp(c0[1], c1[1], f)},${lerp(c0[2], c1[2], f)})`;
}

export class LiveView {
  constructor() {
    this.samples = [];
    this.lastSeq = 0;
    this.snap = null;
  }

  /** The query for the next poll: only the samples not yet seen. */
  get query() { return this.lastSeq ? `?since=${this.lastSeq}` : ""; }

  update(snap) {
    if (snap.last_seq < this.lastSeq) { this.samples = []; this.lastSeq = 0; }   // a new server process
    this.samples.push(...snap.samples);
    if (this.samples.length > snap.window) this.samples.splice(0, this.samples.length - snap.window);
    if (this.samples.length) this.lastSeq = this.samples[this.samples.length - 1].seq;
    this.snap = snap;
    this.renderState(snap.state);
    this.renderPlan(snap.memory);
    this.renderPlots(snap);
    this.renderExperts(snap);
    this.renderOom(snap);
  }

  renderState(st) {
    const pid = st.engine_pid ? `engine pid ${st.engine_pid}` : "";
    $("live-state").innerHTML =
      `<span class="state" data-state="${escapeHtml(st.status)}" data-testid="live-state">${escapeHtml(st.status)}</span>` +
      `<span>${pid}</span><span>restarts: ${st.restarts || 0}</span>` +
      (st.detail ? `<span class="detail">${escapeHtml(st.detail)}</span>` : "");
  }

  renderPlan(mem) {
    if (!mem) {
      $("plan-bar").innerHTML = "";
      $("plan-legend").innerHTML = "";
      $("plan-live").textContent = "The engine has not reported its memory plan yet.";
      return;
    }
    const p = mem.plan;
    const parts = PARTS.filter(([, , key, always]) => always || p[key] > 0);
    const total = parts.reduce((a, [, , key]) => a + Math.max(0, p[key] || 0), 0) || 1;
    const used = mem.kv_pages_total ? (mem.kv_pages_used || 0) / mem.kv_pages_total : 0;
    $("plan-bar").innerHTML = parts.map(([part, label, key]) => {
      const b = Math.max(0, p[key] || 0);
      const fill = part === "kv" ? `<div class="fill" style="width:${(used * 100).toFixed(2)}%"></div>` : "";
      return `<div class="seg" data-part="${part}" data-bytes="${b}" title="${label}: ${gib(b)}" ` +
             `style="flex:${b / total} 0 0; background:var(--${part})">${fill}</div>`;
    }).join("");
    $("plan-legend").innerHTML = parts.map(([part, label, key]) =>
      `<li data-part="${part}" data-bytes="${p[key] || 0}"><span class="sw" style="background:var(--${part})"></span>` +
      `${label}<span class="v">${gib(p[key] || 0)}</span></li>`).join("");
    const where = p.kind === "cuda" ? "device memory" : "host memory (no GPU)";
    // without a GPU the expert copies stay in host memory: no PCIe to name
    $("plot-pcie").querySelector("figcaption span").textContent = p.kind === "cuda" ? "PCIe, experts"
                                                                                   : "expert copies";
    $("plan-kind").textContent = `${where}, ${gib(p.reserve_bytes + p.budget_bytes)} for ferrylm of ${gib(p.total_bytes)}`;
    const live = mem.live || {};
    const kv = `KV: ${mem.kv_pages_used ?? "–"} of ${p.kv_pages} pages in use (${(used * 100).toFixed(1)}%), ` +
               `${p.kv_pages} × ${p.page_size} = ${p.kv_tokens} tokens`;
    const slotsNow = live.expert_slots ?? p.expert_slots;
    const ex = p.expert_total ? `; expert slots: ${slotsNow} of ${p.expert_total} experts × ${gib(p.expert_slot_bytes)}` +
               (live.expert_slots_shrunk ? ` (${live.expert_slots_shrunk} given up under memory pressure)` : "")
               : "; experts resident or a dense model";
    $("plan-live").innerHTML = `<span data-testid="kv-live">${kv}</span>${ex}`;
  }

  series(key) { return this.samples.map((s) => [s.t, s[key]]); }

  renderPlots(snap) {
    const n = this.samples.length;
    const t1 = n ? this.samples[n - 1].t : Date.now() / 1000;
    const t0 = t1 - snap.window * snap.interval_s;
    const draw = (id, series, valueId, text, { min = 0 } = {}) => {
      const vals = series.flatMap((s) => s.values.map(([, v]) => v)).filter((v) => v != null);
      const yMax = Math.max(min, ...vals) * 1.1 || 1;
      $(id).querySelector(".svg").innerHTML = svgPlot(series, t0, t1, yMax);
      $(valueId).textContent = text;
    };
    const last = (key) => (n ? this.samples[n - 1][key] : null);
    const peak = (key) => Math.max(0, ...this.samples.map((s) => s[key] || 0));
    const tok = this.series("gen_tok_s");
    draw("plot-tok", [{ values: tok, color: "var(--accent)" }], "tok-s-value",
         `${fmt(last("gen_tok_s"))} · peak ${fmt(peak("gen_tok_s"))}`, { min: 1 });
    $("tok-s-value").dataset.peak = String(peak("gen_tok_s"));
    const ttfts = this.samples.filter((s) => s.ttft_s != null);
    draw("plot-ttft", [{ values: this.series("ttft_s"), color: "var(--workspace)", dots: true }], "ttft-value",
         ttfts.length ? `${fmt(ttfts[ttfts.length - 1].ttft_s, 2)} s` : "–", { min: 0.01 });
    draw("plot-queue", [{ values: this.series("running"), color: "var(--kv)" },
                        { values: this.series("waiting"), color: "var(--warn)" }], "queue-value",
         `${last("running") ?? "–"} / ${last("waiting") ?? "–"}`, { min: 1 });
    draw("plot-kv", [{ values: this.samples.map((s) => [s.t, s.kv_used == null ? null : s.kv_used * 100]),
                       color: "var(--kv)" }], "kv-value",
         last("kv_used") == null ? "–" : `${fmt(last("kv_used") * 100)}%`, { min: 1 });
    draw("plot-pcie", [{ values: this.series("pcie_gb_s"), color: "var(--experts)" }], "pcie-value",
         `${fmt(last("pcie_gb_s"), 2)} GB/s`, { min: 0.01 });
    draw("plot-dram", [{ values: this.series("host_dram_gb_s"), color: "var(--weights)" }], "dram-value",
         `${fmt(last("host_dram_gb_s"), 2)} GB/s`, { min: 0.01 });
  }

  renderExperts(snap) {
    const e = snap.experts;
    const box = $("heatmap");
    if (!e) {
      $("experts-summary").textContent = "";
      box.innerHTML = `<div class="note">${snap.state.status === "ready" ? "A dense model: no routed experts."
                                                                         : "Waiting for the engine."}</div>`;
      return;
    }
    const rate = e.hit_rate == null ? "–" : `${(e.hit_rate * 100).toFixed(1)}%`;
    const plan = snap.memory ? snap.memory.plan : {};
    $("experts-summary").textContent = e.backend === "resident"
      ? "resident: every expert on the device"
      : `${e.backend}, ${e.num_slots} of ${plan.expert_total || "?"} slots, hit rate ${rate} since the engine started`;
    const layers = e.layers || [];
    if (e.backend === "resident" || !layers.length) {
      box.innerHTML = '<div class="note">Every expert stays on the device, so every lookup hits: no cache to show.</div>';
      return;
    }
    const cols = snap.window;
    let canvas = box.querySelector("canvas");
    if (!canvas || canvas.height !== layers.length) {
      box.innerHTML = `<canvas width="${cols}" height="${layers.length}" title="MoE layers (rows, first on top) x ` +
        `time (columns); colour: hit rate in that second (grey: no lookup)"></canvas>` +
        `<div class="axis"><span>layer ${layers[0]} at the top, ${layers[layers.length - 1]} at the bottom</span>` +
        `<span>${Math.round((cols * snap.interval_s) / 60)} min ago → now</span></div>` +
        '<div class="scale"></div><div class="axis"><span>hit rate 0%</span><span>100%</span></div>';
      canvas = box.querySelector("canvas");
    }
    const g = canvas.getContext("2d");
    g.fillStyle = "#eef0f3";
    g.fillRect(0, 0, cols, layers.length);
    const off = cols - this.samples.length;
    this.samples.forEach((s, i) => {
      (s.layer_hit_rate || []).forEach((r, li) => {
        if (r == null) return;
        g.fillStyle = hitColor(r);
        g.fillRect(off + i, li, 1, 1);
      });
    });
  }

  renderOom(snap) {
    const recent = {};
    const since = (this.samples.length ? this.samples[this.samples.length - 1].t : 0) - 60;
    for (const s of this.samples) {
      if (s.t < since) continue;
      for (const [a, k] of Object.entries(s.oom || {})) recent[a] = (recent[a] || 0) + k;
    }
    const rows = Object.entries(snap.oom_recoveries || {}).filter(([, v]) => v > 0);
    $("oom").innerHTML = rows.length
      ? rows.map(([a, v]) => `<li class="${recent[a] ? "recent" : ""}" data-action="${escapeHtml(a)}">` +
          `<span>${escapeHtml(a)}</span><span>${v}${recent[a] ? ` (+${recent[a]} in the last minute)` : ""}</span></li>`).join("")
      : '<li class="note">None since the server started.</li>';
  }
}
