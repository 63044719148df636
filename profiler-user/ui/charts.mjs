// Small line charts on canvas (the timeline of the selected profile and the GPU panel).

/**
 * Draws `lines` (`[{points: [{t, v}], color, dashed}]`) over [from, until] on `canvas`, y from 0
 * to `max` (default: the largest value). `fill` shades the area under the first line.
 */
export function drawLineChart(
  canvas,
  lines,
  { from, until, max, fill = false, height = 60, axis = false } = {},
) {
  const width = canvas.parentElement?.clientWidth || canvas.clientWidth || 300;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = '#e3e3e3';
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(0, height - 0.5);
  ctx.lineTo(width, height - 0.5);
  ctx.moveTo(0, 0.5);
  ctx.lineTo(width, 0.5);
  ctx.stroke();
  const top =
    max ?? Math.max(1e-9, ...lines.flatMap((line) => line.points.map((p) => p.v)));
  const span = Math.max(1, until - from);
  const px = (t) => ((t - from) / span) * width;
  // With an axis, the bottom 14 px hold time labels.
  const plot = axis ? height - 14 : height;
  const py = (v) => plot - 2 - (Math.min(v, top) / top) * (plot - 4);
  if (axis) drawTimeAxis(ctx, from, until, width, height);
  lines.forEach((line, index) => {
    const points = [...line.points].sort((a, b) => a.t - b.t);
    if (!points.length) return;
    ctx.strokeStyle = line.color;
    ctx.lineWidth = 1.5;
    ctx.setLineDash(line.dashed ? [4, 3] : []);
    ctx.beginPath();
    points.forEach((p, i) => (i ? ctx.lineTo(px(p.t), py(p.v)) : ctx.moveTo(px(p.t), py(p.v))));
    if (points.length === 1) ctx.lineTo(px(points[0].t) + 2, py(points[0].v));
    ctx.stroke();
    if (fill && index === 0) {
      ctx.lineTo(px(points[points.length - 1].t), height);
      ctx.lineTo(px(points[0].t), height);
      ctx.closePath();
      ctx.globalAlpha = 0.15;
      ctx.fillStyle = line.color;
      ctx.fill();
      ctx.globalAlpha = 1;
    }
  });
  ctx.setLineDash([]);
}

/** Four time labels along the bottom edge. */
function drawTimeAxis(ctx, from, until, width, height) {
  const span = until - from;
  const withDate = span > 20 * 3600e3;
  ctx.font = '10px system-ui, sans-serif';
  ctx.fillStyle = '#6b6b70';
  ctx.textBaseline = 'bottom';
  for (let i = 0; i <= 3; i++) {
    const t = from + (span * i) / 3;
    const d = new Date(t);
    const time = d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' });
    const label = withDate ? `${d.toLocaleDateString([], { month: 'short', day: 'numeric' })} ${time}` : time;
    const textWidth = ctx.measureText(label).width;
    const x = Math.min(Math.max(0, (width * i) / 3 - textWidth / 2), width - textWidth);
    ctx.fillText(label, x, height);
  }
}

/**
 * Draws `points` (`[{t, v}]`, `t` the right edge of a `stepMs` bucket) as bars over
 * [from, until], with a time axis.
 */
export function drawBarChart(canvas, points, { from, until, stepMs, color, height = 48 } = {}) {
  const width = canvas.parentElement?.clientWidth || canvas.clientWidth || 300;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const plot = height - 14;
  ctx.strokeStyle = '#e3e3e3';
  ctx.beginPath();
  ctx.moveTo(0, plot - 0.5);
  ctx.lineTo(width, plot - 0.5);
  ctx.stroke();
  drawTimeAxis(ctx, from, until, width, height);
  const top = Math.max(1e-9, ...points.map((p) => p.v));
  const span = Math.max(1, until - from);
  const barWidth = Math.max(2, (stepMs / span) * width - 1);
  ctx.fillStyle = color;
  for (const p of points) {
    const right = ((p.t - from) / span) * width;
    const h = Math.max(1, (p.v / top) * (plot - 3));
    ctx.fillRect(Math.max(0, right - barWidth), plot - 1 - h, barWidth, h);
  }
}
