// The dashboard's charts, drawn by hand: time series on a <canvas> (lines over the last minutes, vertical markers
// where a policy changed) and a stacked bar in SVG. No library; nothing here fetches or logs.
"use strict";

const Charts = (() => {
  const PALETTE = ["#2f6fdf", "#e0672b", "#2a9d5c", "#b5399b", "#c9a227", "#3fa7bd", "#7a5cd6", "#c94040",
                   "#6b8e23", "#8c6d46"];
  const MIN_SPAN_S = 30;  // the x axis covers at least this much time, so the first samples do not fill it
  const PAD = {left: 58, right: 12, top: 12, bottom: 22};
  const SVG = "http://www.w3.org/2000/svg";

  // One line's samples, oldest first: [t (s, client clock), value or null]; at most `limit` kept.
  class Series {
    constructor(name, color, limit) {
      this.name = name;
      this.color = color;
      this.limit = limit;
      this.points = [];
    }

    push(t, value) {
      this.points.push([t, typeof value === "number" && Number.isFinite(value) ? value : null]);
      if (this.points.length > this.limit) this.points.shift();
    }
  }

  // Colours that stay with a name across refreshes (a shadow pair keeps its colour when others come and go).
  class ColorBook {
    constructor() {
      this.given = new Map();
    }

    of(name) {
      if (!this.given.has(name)) this.given.set(name, PALETTE[this.given.size % PALETTE.length]);
      return this.given.get(name);
    }
  }

  // The canvas's backing store sized to its CSS box times the pixel ratio; a context drawing in CSS pixels.
  function fit(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 600;
    const height = canvas.clientHeight || 200;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return {ctx, width, height};
  }

  // The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `value` (a round top for the y axis).
  function roundUp(value) {
    if (!(value > 0)) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    return [1, 2, 2.5, 5, 10].map((m) => m * power).find((top) => top >= value * (1 - 1e-9));
  }

  // Lines of `series` over time. opts: now (s), yMax (fixed top, or null: from the data), yFormat (label of a
  // value), markers ([{t, label}]: vertical lines).
  function lines(canvas, series, opts) {
    const {ctx, width, height} = fit(canvas);
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;
    const values = series.flatMap((s) => s.points.filter((p) => p[1] !== null));
    const oldest = Math.min(opts.now, ...series.filter((s) => s.points.length).map((s) => s.points[0][0]));
    const start = Math.min(oldest, opts.now - MIN_SPAN_S);
    const span = opts.now - start;
    const top = opts.yMax ?? roundUp(Math.max(0, ...values.map((p) => p[1])));
    const x = (t) => PAD.left + ((t - start) / span) * plotW;
    const y = (v) => PAD.top + plotH - (Math.min(v, top) / top) * plotH;

    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.strokeStyle = "#e3e6eb";
    ctx.fillStyle = "#5b6573";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {  // horizontal grid, labelled
      const v = (top * i) / 4;
      ctx.beginPath();
      ctx.moveTo(PAD.left, y(v));
      ctx.lineTo(PAD.left + plotW, y(v));
      ctx.stroke();
      ctx.fillText(opts.yFormat(v), PAD.left - 6, y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let i = 0; i <= 4; i++) {  // time axis: seconds before now
      const t = start + (span * i) / 4;
      ctx.fillText(i === 4 ? "now" : `-${Math.round(opts.now - t)}s`, x(t), PAD.top + plotH + 6);
    }
    ctx.textAlign = "left";
    for (const m of opts.markers || []) {
      if (m.t < start) continue;
      ctx.strokeStyle = "#9aa3ae";
      ctx.setLineDash([4, 3]);
      ctx.beginPath();
      ctx.moveTo(x(m.t), PAD.top);
      ctx.lineTo(x(m.t), PAD.top + plotH);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillText(m.label, x(m.t) + 3, PAD.top);
    }
    if (!values.length) {
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillText("no data yet", PAD.left + plotW / 2, PAD.top + plotH / 2);
      return;
    }
    ctx.lineWidth = 2;
    for (const s of series) {  // a null sample breaks the line
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let drawing = false;
      for (const [t, v] of s.points) {
        if (v === null) {
          drawing = false;
        } else if (drawing) {
          ctx.lineTo(x(t), y(v));
        } else {
          ctx.moveTo(x(t), y(v));
          drawing = true;
        }
      }
      ctx.stroke();
    }
  }

  // One horizontal bar split into `parts` ([{name, value, color}]) in proportion to `total`.
  function stackedBar(svg, parts, total) {
    svg.replaceChildren();
    let offset = 0;
    for (const part of parts) {
      const share = total > 0 ? (part.value / total) * 100 : 0;
      const rect = document.createElementNS(SVG, "rect");
      rect.setAttribute("x", `${offset}%`);
      rect.setAttribute("y", "0");
      rect.setAttribute("width", `${share}%`);
      rect.setAttribute("height", "100%");
      rect.setAttribute("fill", part.color);
      const title = document.createElementNS(SVG, "title");
      title.textContent = `${part.name}: ${part.value}`;
      rect.appendChild(title);
      svg.appendChild(rect);
      offset += share;
    }
  }

  // A legend under a chart: a swatch and the name of each series.
  function legend(el, series) {
    el.replaceChildren(...series.map((s) => {
      const item = document.createElement("span");
      item.className = "legend-item";
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = s.color;
      item.append(swatch, s.name);
      return item;
    }));
  }

  return {Series, ColorBook, lines, stackedBar, legend, PALETTE};
})();
