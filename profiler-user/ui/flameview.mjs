// The canvas flame graph: drawing, hover tooltip, click to zoom, search highlighting. It also
// keeps a hidden list of the frames it drew (for screen readers and the browser tests).
import {
  describeChange,
  diffColor,
  findPath,
  formatPercent,
  formatValue,
  hitTest,
  layout,
  nameColor,
  pathOf,
  relativeChange,
  rowCount,
  search,
  shareChange,
} from './flamegraph.mjs';

const ROW_HEIGHT = 18;
const FONT = '12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace';
const TEXT_PADDING = 4;

export class FlameView {
  /**
   * @param {HTMLElement} container holds the canvas; `tooltip` and `frameList` are its helpers.
   * @param {(state: object) => void} onChange called after every redraw with what is shown.
   */
  constructor(container, tooltip, frameList, onChange) {
    this.container = container;
    this.tooltip = tooltip;
    this.frameList = frameList;
    this.onChange = onChange;
    this.canvas = document.createElement('canvas');
    this.canvas.setAttribute('role', 'img');
    this.canvas.setAttribute('aria-label', 'Flame graph');
    this.canvas.tabIndex = 0;
    container.appendChild(this.canvas);
    this.tree = null;
    this.focus = null;
    this.query = '';
    this.rects = [];
    this.searchResult = null;
    this.unit = '';
    this.canvas.addEventListener('mousemove', (e) => this.hover(e));
    this.canvas.addEventListener('mouseleave', () => this.hideTooltip());
    this.canvas.addEventListener('click', (e) => this.click(e));
    this.canvas.addEventListener('keydown', (e) => {
      if (e.key === 'Escape') this.reset();
    });
    new ResizeObserver(() => this.draw()).observe(container);
  }

  /** Shows a new tree; keeps the zoom on the same path of names when `keepZoom`. */
  setTree(tree, unit, keepZoom = false) {
    const path = keepZoom && this.focus ? pathOf(this.focus) : [];
    this.tree = tree;
    this.unit = unit;
    this.focus = tree ? findPath(tree, path) : null;
    this.draw();
  }

  zoom(node) {
    if (!this.tree || !node) return;
    this.focus = node;
    this.draw();
  }

  reset() {
    if (!this.tree) return;
    this.focus = this.tree.root;
    this.draw();
  }

  setSearch(query) {
    this.query = query ?? '';
    this.draw();
  }

  /** The value `node` stands for, as shown in tooltips and the table. */
  describe(node) {
    const tree = this.tree;
    const fmt = (v) => formatValue(v, this.unit);
    const lines = [];
    if (tree.diff) {
      const change = relativeChange(node, tree.leftTicks, tree.rightTicks);
      const changeText = describeChange(change);
      lines.push(['Baseline', `${fmt(node.left.total)} (${formatPercent(node.left.total, tree.leftTicks)})`]);
      lines.push(['Comparison', `${fmt(node.right.total)} (${formatPercent(node.right.total, tree.rightTicks)})`]);
      lines.push(['Self (base → comp)', `${fmt(node.left.self)} → ${fmt(node.right.self)}`]);
      lines.push(['Change of share', changeText]);
    } else {
      lines.push(['Total', `${fmt(node.total)} (${formatPercent(node.total, tree.total)})`]);
      lines.push(['Self', `${fmt(node.self)} (${formatPercent(node.self, tree.total)})`]);
      if (this.focus && this.focus !== tree.root) {
        lines.push(['Of zoomed frame', formatPercent(node.total, this.focus.total)]);
      }
    }
    return lines;
  }

  draw() {
    const width = this.container.clientWidth;
    const tree = this.tree;
    const ctx = this.canvas.getContext('2d');
    const dpr = window.devicePixelRatio || 1;
    if (!tree || !this.focus || width <= 0) {
      this.rects = [];
      this.canvas.width = Math.max(1, width * dpr);
      this.canvas.height = ROW_HEIGHT * dpr;
      this.canvas.style.height = `${ROW_HEIGHT}px`;
      this.publish();
      return;
    }
    this.rects = layout(tree, this.focus, width);
    this.searchResult = search(tree, this.query, this.focus);
    const rows = Math.max(1, rowCount(this.rects));
    const height = rows * ROW_HEIGHT;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(height * dpr);
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = FONT;
    ctx.textBaseline = 'middle';
    const charWidth = ctx.measureText('m').width || 7;
    const searching = this.query.trim() !== '';
    const matched = this.searchResult.matched;
    for (const rect of this.rects) {
      const { node } = rect;
      const y = rect.row * ROW_HEIGHT;
      const isAncestor = rect.row < this.focus.depth;
      let fill;
      if (searching && !matched.has(node)) fill = 'hsl(0, 0%, 86%)';
      else if (searching) fill = 'hsl(285, 70%, 62%)';
      else if (tree.diff) fill = diffColor(shareChange(node, tree.leftTicks, tree.rightTicks));
      else fill = nameColor(node.name);
      ctx.globalAlpha = isAncestor ? 0.55 : 1;
      ctx.fillStyle = fill;
      ctx.fillRect(rect.x, y, Math.max(rect.width - 0.5, 0.5), ROW_HEIGHT - 1);
      ctx.globalAlpha = 1;
      const room = Math.floor((rect.width - 2 * TEXT_PADDING) / charWidth);
      if (room >= 3) {
        const label = node.name.length > room ? `${node.name.slice(0, room - 1)}…` : node.name;
        ctx.fillStyle = '#111';
        ctx.fillText(label, rect.x + TEXT_PADDING, y + ROW_HEIGHT / 2);
      }
    }
    this.publish();
  }

  /** Updates the hidden frame list and the canvas's data attributes, then tells the app. */
  publish() {
    const list = this.frameList;
    list.textContent = '';
    const fragment = document.createDocumentFragment();
    const matched = this.searchResult?.matched ?? new Set();
    for (const rect of this.rects) {
      const li = document.createElement('li');
      li.textContent = rect.node.name;
      li.dataset.name = rect.node.name;
      li.dataset.depth = String(rect.node.depth);
      li.dataset.total = String(rect.node.total);
      li.dataset.self = String(rect.node.self);
      // Where it is drawn, in CSS pixels of the canvas.
      li.dataset.x = rect.x.toFixed(1);
      li.dataset.width = rect.width.toFixed(1);
      li.dataset.y = String(rect.row * ROW_HEIGHT);
      if (matched.has(rect.node)) li.dataset.matched = 'true';
      fragment.appendChild(li);
    }
    list.appendChild(fragment);
    const canvas = this.canvas;
    canvas.dataset.frames = String(this.rects.length);
    canvas.dataset.focus = this.focus && this.tree && this.focus !== this.tree.root ? this.focus.name : '';
    canvas.dataset.matches = String(matched.size);
    canvas.dataset.mode = this.tree?.diff ? 'diff' : 'single';
    canvas.dataset.total = String(this.tree?.total ?? 0);
    canvas.dataset.leftTicks = String(this.tree?.leftTicks ?? 0);
    canvas.dataset.rightTicks = String(this.tree?.rightTicks ?? 0);
    this.onChange?.({
      tree: this.tree,
      focus: this.focus,
      search: this.searchResult,
      frames: this.rects.length,
    });
  }

  rectAt(event) {
    const bounds = this.canvas.getBoundingClientRect();
    const px = event.clientX - bounds.left;
    const row = Math.floor((event.clientY - bounds.top) / ROW_HEIGHT);
    return hitTest(this.rects, px, row);
  }

  click(event) {
    const rect = this.rectAt(event);
    if (rect) this.zoom(rect.node);
  }

  hover(event) {
    const rect = this.rectAt(event);
    if (!rect) {
      this.hideTooltip();
      this.canvas.style.cursor = 'default';
      return;
    }
    this.canvas.style.cursor = 'pointer';
    const tip = this.tooltip;
    tip.textContent = '';
    const title = document.createElement('div');
    title.className = 'tip-title';
    title.textContent = rect.node.name;
    tip.appendChild(title);
    const table = document.createElement('table');
    for (const [key, value] of this.describe(rect.node)) {
      const tr = table.insertRow();
      tr.insertCell().textContent = key;
      tr.insertCell().textContent = value;
    }
    tip.appendChild(table);
    tip.hidden = false;
    // Keep the tooltip inside the window.
    const margin = 12;
    const { innerWidth, innerHeight } = window;
    const box = tip.getBoundingClientRect();
    let left = event.clientX + margin;
    let top = event.clientY + margin;
    if (left + box.width > innerWidth) left = Math.max(0, event.clientX - box.width - margin);
    if (top + box.height > innerHeight) top = Math.max(0, event.clientY - box.height - margin);
    tip.style.left = `${left}px`;
    tip.style.top = `${top}px`;
  }

  hideTooltip() {
    this.tooltip.hidden = true;
  }
}

