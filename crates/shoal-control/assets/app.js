// Shoal dashboard: a plain ES module, no build step, no framework. Charts are uPlot (vendor/, global `uPlot`).
//
// Routes (in the URL fragment): `#/` overview, `#/jobs?state=a,b&team=T`, `#/jobs/ID`, `#/queues`, `#/cost`.
// The token comes from the fragment (`#token=TOKEN&/jobs/ID`, then kept in localStorage and removed from the
// address bar) or from localStorage; without one, or after a 401, a form asks for it. Fetches send
// `Authorization: Bearer TOKEN`; EventSource URLs carry `?access_token=TOKEN`.
//
// Every field may be missing (older servers, jobs that have not reported yet): what is unknown shows as "—",
// and an endpoint that is not there disables its panel instead of breaking the page.

const TOKEN_KEY = 'shoal.token';
const DASH = '\u2014';
const POLL_MS = 2000;
const MAX_POINTS = 200000; // per rank and series, kept in the page
const FINAL = new Set(['succeeded', 'failed', 'cancelled']);
const STATES = ['pending', 'running', 'preempted', 'succeeded', 'failed', 'cancelled'];
const PALETTE = ['#1d5fd6', '#d9480f', '#2b8a3e', '#862e9c', '#c2255c', '#0b7285', '#e67700', '#5c940d', '#364fc7',
  '#a61e4d', '#495057', '#087f5b'];
const PHASES = [
  ['data_s', 'data', '#f59f00'],
  ['compute_s', 'compute', '#1d5fd6'],
  ['comm_s', 'comm', '#e03131'],
  ['optimizer_s', 'optimizer', '#2b8a3e'],
  ['other_s', 'other', '#adb5bd'],
];
// What a rank holds for training (metrics rows' *_bytes), as the memory card stacks it.
const MEMORY = [
  ['params_bytes', 'parameters', '#1d5fd6'],
  ['grads_bytes', 'gradients', '#e03131'],
  ['optimizer_bytes', 'optimizer', '#2b8a3e'],
  ['activations_bytes', 'activations (peak)', '#f59f00'],
];

const $view = document.getElementById('view');
const $who = document.getElementById('who');

// ------------------------------------------------------------------------------------------------------------
// formatting (every formatter answers "—" for what is not a finite number)

const isNum = (v) => typeof v === 'number' && Number.isFinite(v);
const num = (v) => (isNum(v) ? v : typeof v === 'string' && v.trim() !== '' && Number.isFinite(+v) ? +v : null);

function fmtNum(v, digits = 3) {
  v = num(v);
  if (v === null) return DASH;
  const a = Math.abs(v);
  if (a === 0) return '0';
  if (a >= 1e6) return v.toExponential(2);
  if (a >= 1000) return Math.round(v).toLocaleString('en-US');
  if (a < 1e-3) return v.toExponential(2).replace(/\.?0+e/, 'e');
  return String(+v.toPrecision(digits));
}
// A fraction as a percentage.
function fmtPct01(v) {
  v = num(v);
  return v === null ? DASH : fmtPct(v * 100);
}
function fmtInt(v) {
  v = num(v);
  return v === null ? DASH : Math.round(v).toLocaleString('en-US');
}
function fmtPct(v) {
  v = num(v);
  if (v === null) return DASH;
  return v === 0 ? '0%' : `${Math.abs(v) >= 10 ? Math.round(v) : v.toFixed(1)}%`;
}
function fmtBytes(v) {
  v = num(v);
  if (v === null) return DASH;
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let i = 0;
  let a = Math.abs(v);
  while (a >= 1024 && i < units.length - 1) {
    a /= 1024;
    i++;
  }
  return `${v < 0 ? '-' : ''}${i === 0 ? Math.round(a) : a >= 100 ? a.toFixed(0) : a.toFixed(1)} ${units[i]}`;
}
const fmtRate = (v) => (num(v) === null ? DASH : `${fmtBytes(v)}/s`);
function fmtSecs(s) {
  s = num(s);
  if (s === null) return DASH;
  const a = Math.abs(s);
  if (a === 0) return '0 s';
  if (a < 1e-3) return `${+(s * 1e6).toPrecision(3)} µs`;
  if (a < 1) return `${+(s * 1e3).toPrecision(3)} ms`;
  if (a < 120) return `${+s.toPrecision(3)} s`;
  return fmtDuration(s * 1000);
}
function fmtDuration(ms) {
  ms = num(ms);
  if (ms === null || ms < 0) return DASH;
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, '0')}s`;
  const hr = Math.floor(m / 60);
  if (hr < 48) return `${hr}h ${String(m % 60).padStart(2, '0')}m`;
  return `${Math.floor(hr / 24)}d ${hr % 24}h`;
}
function fmtClock(ms) {
  ms = num(ms);
  if (ms === null || ms <= 0) return DASH;
  const d = new Date(ms);
  const time = d.toLocaleTimeString([], { hour12: false });
  return d.toDateString() === new Date().toDateString() ? time : `${d.toLocaleDateString()} ${time}`;
}
function fmtAgo(ms) {
  ms = num(ms);
  if (ms === null || ms <= 0) return DASH;
  const d = Date.now() - ms;
  return d < 5000 ? 'just now' : `${fmtDuration(d)} ago`;
}
function fmtMoney(v, currency) {
  v = num(v);
  if (v === null) return DASH;
  try {
    return new Intl.NumberFormat('en-US', { style: 'currency', currency: currency || 'USD', maximumFractionDigits: v < 1 ? 4 : 2 }).format(v);
  } catch {
    return `${v.toFixed(2)} ${currency || ''}`.trim();
  }
}
const str = (v) => (v === null || v === undefined || v === '' ? DASH : String(v));
const stateOf = (j) => (j && typeof j.state === 'string' ? j.state : 'unknown');
const at = (obj, ...path) => path.reduce((o, k) => (o !== null && typeof o === 'object' ? o[k] : undefined), obj);
const arr = (v) => (Array.isArray(v) ? v : []);

// ------------------------------------------------------------------------------------------------------------
// DOM

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k === 'text') el.textContent = v;
    else if (k === 'style' && typeof v === 'object') {
      for (const [sk, sv] of Object.entries(v)) {
        if (sk.startsWith('--')) el.style.setProperty(sk, sv);
        else el.style[sk] = sv;
      }
    }
    else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of kids.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}
// Replaces el's children; null, undefined and false are skipped, arrays flattened (unlike replaceChildren, which
// would write "null").
function fill(el, ...kids) {
  el.replaceChildren(...kids.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}
const badge = (state) => h('span', { class: `badge ${state}` }, state);
const stat = (k, v, s, attrs) => h(attrs && attrs.href ? 'a' : 'div', { class: 'stat', ...attrs }, h('div', { class: 'k' }, k),
  h('div', { class: 'v' }, v), s !== undefined ? h('div', { class: 's' }, s) : null);
function meter(frac, hot) {
  const f = isNum(frac) ? Math.max(0, Math.min(1, frac)) : 0;
  return h('div', { class: `meter${hot && f > 0.9 ? ' hot' : ''}` }, h('div', { style: { width: `${(f * 100).toFixed(1)}%` } }));
}
function table(cols, rows, empty = 'nothing here') {
  if (!rows.length) return h('div', { class: 'empty' }, empty);
  return h('div', { class: 'table-wrap' }, h('table', null,
    h('thead', null, h('tr', null, cols.map((c) => h('th', { class: c.num ? 'num' : null }, c.label)))),
    h('tbody', null, rows.map((r) => h('tr', null, cols.map((c) => {
      const v = c.get(r);
      return h('td', { class: c.num ? 'num' : c.cls || null, title: c.title ? c.title(r) : null }, v instanceof Node ? v : str(v));
    }))))));
}
const msg = (kind, text) => h('div', { class: `msg ${kind}` }, text);
const jobLink = (id) => h('a', { href: `#/jobs/${encodeURIComponent(id)}`, class: 'mono' }, id);

// ------------------------------------------------------------------------------------------------------------
// auth and the API

let token = null;
let me = null; // whoami: {user, team, admin}

function storedToken() {
  try {
    return localStorage.getItem(TOKEN_KEY);
  } catch {
    return null;
  }
}
function storeToken(t) {
  try {
    if (t) localStorage.setItem(TOKEN_KEY, t);
    else localStorage.removeItem(TOKEN_KEY);
  } catch {
    // private mode: the token lives for this page only
  }
}

// `#token=T&/jobs/ID` (or `#/jobs/ID&token=T`, or access_token=): take the token, keep the route.
function takeTokenFromHash() {
  const raw = location.hash.replace(/^#/, '');
  if (!/(^|&)(access_)?token=/.test(raw)) return;
  let t = null;
  const rest = [];
  for (const part of raw.split('&')) {
    const m = /^(?:access_)?token=(.*)$/.exec(part);
    if (m) {
      try {
        t = decodeURIComponent(m[1]);
      } catch {
        t = m[1];
      }
    } else if (part) {
      rest.push(part);
    }
  }
  if (t) {
    token = t.trim();
    storeToken(token);
  }
  let route = rest.join('&') || '/';
  if (!route.startsWith('/')) route = `/${route}`;
  history.replaceState(null, '', `${location.pathname}${location.search}#${route}`);
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}
const isAbort = (e) => e && (e.name === 'AbortError' || e.aborted === true);

// fetch with the token. `raw`: the Response (for text bodies and headers). A 401 asks for a token again.
async function api(path, { method = 'GET', body, signal, raw = false } = {}) {
  const headers = {};
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let res;
  try {
    res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal, cache: 'no-store' });
  } catch (e) {
    if (isAbort(e)) throw e;
    throw new HttpError(0, `cannot reach the server (${e && e.message ? e.message : e})`);
  }
  if (res.status === 401) {
    let why = '';
    try {
      why = (await res.json()).error || '';
    } catch {
      // not JSON
    }
    signOut(`The server refused the token${why ? `: ${why}` : ''}. Paste a valid token.`);
    throw new HttpError(401, why || 'unauthorized');
  }
  if (!res.ok) {
    let text = res.statusText;
    try {
      const j = await res.json();
      if (j && j.error) text = j.error;
    } catch {
      // not JSON
    }
    throw new HttpError(res.status, `${method} ${path.split('?')[0]}: ${res.status} ${text}`);
  }
  if (raw) return res;
  try {
    return await res.json();
  } catch {
    throw new HttpError(res.status, `${path.split('?')[0]}: the server did not answer JSON`);
  }
}

function signOut(why) {
  token = null;
  me = null;
  storeToken(null);
  showLogin(why);
}

// An EventSource with the token in the query. Events are JSON; `onFallback(why)` runs once if the stream cannot
// be used (the endpoint is missing, refused, or nothing arrives within `watchdogMs`), after which the caller polls.
function openStream(ctx, path, handlers, onFallback, watchdogMs = 8000) {
  let done = false;
  let got = false;
  let errors = 0;
  const status = { live: false, close() {} };
  if (typeof EventSource === 'undefined') {
    setTimeout(() => onFallback('this browser has no EventSource'), 0);
    return status;
  }
  const url = `${path}${path.includes('?') ? '&' : '?'}access_token=${encodeURIComponent(token || '')}`;
  const es = new EventSource(url);
  let watchdog = null;
  const close = () => {
    done = true;
    status.live = false;
    clearTimeout(watchdog);
    es.close();
  };
  const fallback = (why) => {
    if (done) return;
    close();
    if (!ctx.stopped) onFallback(why);
  };
  watchdog = setTimeout(() => {
    if (!got) fallback(`no events within ${watchdogMs / 1000} s`);
  }, watchdogMs);
  for (const [name, fn] of Object.entries(handlers)) {
    es.addEventListener(name, (ev) => {
      if (done || ctx.stopped) return;
      got = true;
      errors = 0;
      status.live = true;
      let data;
      try {
        data = JSON.parse(ev.data);
      } catch {
        return;
      }
      try {
        fn(data);
      } catch (e) {
        ctx.report(e);
      }
    });
  }
  es.addEventListener('error', () => {
    if (done) return;
    errors += 1;
    status.live = false;
    // CLOSED: an HTTP error or a wrong content type; never got anything: the endpoint is not usable;
    // else the browser reconnects by itself, a few times.
    if (es.readyState === EventSource.CLOSED || !got || errors >= 3) fallback('the stream failed');
  });
  status.close = close;
  ctx.onStop(close);
  return status;
}

// ------------------------------------------------------------------------------------------------------------
// views: each runs in a context that stops its timers, streams, charts and fetches when the route changes

class Ctx {
  constructor() {
    this.stopped = false;
    this.stops = [];
    this.abort = new AbortController();
    this.signal = this.abort.signal;
    this.errorBox = null;
  }
  onStop(fn) {
    this.stops.push(fn);
  }
  stop() {
    if (this.stopped) return;
    this.stopped = true;
    try {
      this.abort.abort();
    } catch {
      // nothing to abort
    }
    for (const fn of this.stops.splice(0)) {
      try {
        fn();
      } catch {
        // best effort
      }
    }
  }
  api(path, opts = {}) {
    return api(path, { ...opts, signal: this.signal });
  }
  // Shows a failure in the view's message box (not the console); aborted fetches are not failures.
  report(e) {
    if (this.stopped || isAbort(e) || (e && e.status === 401)) return;
    if (this.errorBox) {
      fill(this.errorBox, msg('error', e && e.message ? e.message : String(e)));
    }
  }
  clearError() {
    if (this.errorBox) fill(this.errorBox);
  }
  // Runs fn now (unless `later`) and then every `ms` after each run finishes; returns {stop()}.
  every(ms, fn, later = false) {
    let timer = null;
    let stopped = false;
    const tick = async () => {
      if (stopped || this.stopped) return;
      try {
        await fn();
      } catch (e) {
        this.report(e);
      }
      if (!stopped && !this.stopped) timer = setTimeout(tick, ms);
    };
    if (later) timer = setTimeout(tick, ms);
    else tick();
    const handle = {
      stop() {
        stopped = true;
        clearTimeout(timer);
      },
    };
    this.onStop(() => handle.stop());
    return handle;
  }
  // fn at most once per `ms` (the trailing call is kept).
  throttle(ms, fn) {
    let timer = null;
    let last = 0;
    const run = () => {
      timer = null;
      last = Date.now();
      if (this.stopped) return;
      try {
        fn();
      } catch (e) {
        this.report(e);
      }
    };
    this.onStop(() => clearTimeout(timer));
    return () => {
      if (timer || this.stopped) return;
      timer = setTimeout(run, Math.max(0, ms - (Date.now() - last)));
    };
  }
}

// ------------------------------------------------------------------------------------------------------------
// charts

// Merges series sorted by x into uPlot's aligned columns: [xs, ys0, ys1, ...] with null where a series has no
// point at an x.
function align(list) {
  const idx = list.map(() => 0);
  const xs = [];
  const ys = list.map(() => []);
  for (;;) {
    let min = Infinity;
    for (let k = 0; k < list.length; k++) {
      const s = list[k];
      if (idx[k] < s.x.length && s.x[idx[k]] < min) min = s.x[idx[k]];
    }
    if (min === Infinity) break;
    xs.push(min);
    for (let k = 0; k < list.length; k++) {
      const s = list[k];
      if (idx[k] < s.x.length && s.x[idx[k]] === min) {
        const y = s.y[idx[k]];
        ys[k].push(isNum(y) ? y : null);
        idx[k]++;
      } else {
        ys[k].push(null);
      }
    }
  }
  return [xs, ...ys];
}

// Axis steps for byte quantities: powers of two (1, 2, 4 … 512 KiB, 1 MiB …).
const BINARY_INCRS = Array.from({ length: 60 }, (_, i) => 2 ** i);
// Time axis steps in seconds: whole seconds and up (labels are HH:MM:SS at the finest).
const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800,
  604800, 2592000, 31536000];
// Axis steps for counts: whole numbers only.
const INTEGER_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 1e6, 1e7];

// Time ticks (uPlot passes seconds): 24-hour clock, seconds only on short spans, the date on long ones.
function timeTicks(u, splits) {
  const span = (u.scales.x.max ?? 0) - (u.scales.x.min ?? 0);
  const p = (n) => String(n).padStart(2, '0');
  return splits.map((t) => {
    const d = new Date(t * 1000);
    if (span > 2 * 86400) return `${d.getMonth() + 1}/${d.getDate()} ${p(d.getHours())}h`;
    return span > 900 ? `${p(d.getHours())}:${p(d.getMinutes())}` : `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
  });
}

// Log axis ticks: decades (every other one or more on wide ranges; 1-2-5 within two decades).
function logSplits(u, axisIdx, min, max) {
  if (!(min > 0) || !(max > 0)) return [];
  const lo = Math.floor(Math.log10(min));
  const hi = Math.ceil(Math.log10(max));
  const span = hi - lo;
  const mults = span <= 2 ? [1, 2, 5] : [1];
  const step = span > 6 ? Math.ceil(span / 6) : 1;
  const out = [];
  for (let e = lo; e <= hi; e += step) {
    for (const m of mults) {
      const v = m * 10 ** e;
      if (v >= min * 0.999 && v <= max * 1.001) out.push(+v.toPrecision(12));
    }
  }
  return out.length ? out : [min, max];
}

// A uPlot line chart that follows its container's width and rebuilds itself when its series change.
class LineChart {
  constructor(ctx, el, opts = {}) {
    this.el = el;
    this.opts = opts;
    this.u = null;
    this.key = null;
    this.placeholder = h('div', { class: 'placeholder' }, opts.empty || 'waiting for data…');
    el.append(this.placeholder);
    if (typeof ResizeObserver !== 'undefined') {
      let last = 0;
      this.ro = new ResizeObserver(() => {
        const w = this.width();
        if (this.u && Math.abs(w - last) > 2) {
          last = w;
          this.u.setSize({ width: w, height: this.opts.height || 220 });
        }
      });
      this.ro.observe(el);
    }
    ctx.onStop(() => this.destroy());
  }
  width() {
    return Math.max(200, Math.floor(this.el.clientWidth || this.el.getBoundingClientRect().width || 400));
  }
  destroy() {
    if (this.ro) this.ro.disconnect();
    if (this.u) this.u.destroy();
    this.u = null;
  }
  // series: [{label, color?, width?, dash?, points?, scale?}], data: [xs, ys...]
  set(series, data) {
    this.last = [series, data];
    const hasData = data[0].length > 0;
    this.placeholder.style.display = hasData ? 'none' : '';
    if (typeof uPlot === 'undefined') {
      this.placeholder.textContent = 'charts unavailable (uPlot did not load)';
      this.placeholder.style.display = '';
      return;
    }
    const log = !!this.opts.log;
    if (log) data = [data[0], ...data.slice(1).map((ys) => ys.map((v) => (v > 0 ? v : null)))];
    const key = JSON.stringify([series, log]);
    if (this.u && key === this.key) {
      this.u.setData(data);
      return;
    }
    if (this.u) this.u.destroy();
    this.key = key;
    const o = this.opts;
    const yFmt = o.yFmt || fmtNum;
    const xTime = !!o.xTime;
    const scales = { x: { time: xTime } };
    if (log) scales.y = { distr: 3 };
    else if (o.yMin !== undefined) scales.y = { range: (u, min, max) => [o.yMin, max > o.yMin ? max * 1.05 : o.yMin + 1] };
    const opts = {
      width: this.width(),
      height: o.height || 220,
      scales,
      cursor: { sync: o.sync ? { key: o.sync } : undefined, drag: { x: true, y: false } },
      legend: { show: true, live: true },
      series: [
        { label: xTime ? 'time' : o.xLabel || 'step', value: (u, v) => (v === null || v === undefined ? DASH : xTime ? fmtClock(v * 1000) : fmtInt(v)) },
        ...series.map((s, i) => ({
          label: s.label,
          stroke: s.color || PALETTE[i % PALETTE.length],
          width: s.width || 1.5,
          dash: s.dash,
          spanGaps: true,
          points: { show: !!s.points, size: 5, fill: s.color || PALETTE[i % PALETTE.length] },
          value: (u, v) => (v === null || v === undefined ? DASH : yFmt(v)),
        })),
      ],
      axes: [
        { grid: { stroke: '#eef1f4' }, ticks: { stroke: '#dde3ea' }, stroke: '#5d6b7a', values: xTime ? timeTicks : undefined, incrs: xTime ? TIME_INCRS : undefined, space: xTime ? 80 : 50 },
        {
          grid: { stroke: '#eef1f4' },
          ticks: { stroke: '#dde3ea' },
          stroke: '#5d6b7a',
          incrs: log ? undefined : o.binary ? BINARY_INCRS : o.integer ? INTEGER_INCRS : undefined,
          splits: log ? logSplits : undefined,
          // uPlot passes null for the splits it leaves unlabelled
          values: (u, vals) => vals.map((v) => (v === null || v === undefined ? null : yFmt(v))),
          // wide enough for the longest label
          size: (u, vals) => {
            const widths = (vals || []).filter((v) => v !== null && v !== undefined).map((v) => String(v).length);
            return widths.length ? Math.max(...widths) * 8 + 22 : 50;
          },
        },
      ],
      hooks: o.onDraw ? { draw: [(u) => o.onDraw(u)] } : {},
    };
    this.u = new uPlot(opts, data, this.el);
  }
  // Logarithmic y or not (redraws with the last data).
  setLog(on) {
    this.opts.log = !!on;
    if (this.last) this.set(this.last[0], this.last[1]);
  }
}

// ------------------------------------------------------------------------------------------------------------
// columnar series keyed by an increasing x (a step, or a time)

class Cols {
  constructor() {
    this.x = [];
    this.c = {};
  }
  get length() {
    return this.x.length;
  }
  get lastX() {
    return this.x.length ? this.x[this.x.length - 1] : -Infinity;
  }
  col(k) {
    if (!this.c[k]) this.c[k] = new Array(this.x.length).fill(null);
    return this.c[k];
  }
  // A point at or before the last x rewinds the series to it (a restart from a checkpoint reports those steps
  // again; a reconnected stream starts over).
  push(x, values) {
    if (x <= this.lastX) this.truncate(x);
    for (const k of Object.keys(values)) this.col(k); // (new columns: null for the points before this one)
    this.x.push(x);
    for (const [k, col] of Object.entries(this.c)) {
      const v = values[k];
      col.push(isNum(v) ? v : null);
    }
  }
  truncate(x) {
    let lo = 0;
    let hi = this.x.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.x[mid] < x) lo = mid + 1;
      else hi = mid;
    }
    this.x.length = lo;
    for (const col of Object.values(this.c)) col.length = lo;
  }
  // Past `max` points, keeps every other one (the newest always): a page left open on a long job stays light.
  decimate(max) {
    if (this.x.length <= max) return;
    const keep = (a) => a.filter((_, i) => i % 2 === 0 || i === a.length - 1);
    this.x = keep(this.x);
    for (const k of Object.keys(this.c)) this.c[k] = keep(this.c[k]);
  }
  last(k) {
    const col = this.c[k];
    if (!col) return null;
    for (let i = col.length - 1; i >= 0; i--) if (col[i] !== null) return col[i];
    return null;
  }
  // Median of the last n non-null values of column k.
  median(k, n) {
    const col = this.c[k];
    if (!col) return null;
    const v = [];
    for (let i = col.length - 1; i >= 0 && v.length < n; i--) if (col[i] !== null) v.push(col[i]);
    if (!v.length) return null;
    v.sort((a, b) => a - b);
    const m = v.length >> 1;
    return v.length % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
  }
}

// ------------------------------------------------------------------------------------------------------------
// the router

let current = null;
let routeGen = 0;

function parseRoute() {
  let r = location.hash.replace(/^#/, '') || '/';
  if (!r.startsWith('/')) r = `/${r}`;
  const q = r.indexOf('?');
  const path = q >= 0 ? r.slice(0, q) : r;
  const params = new URLSearchParams(q >= 0 ? r.slice(q + 1) : '');
  const seg = path.split('/').filter(Boolean).map((s) => {
    try {
      return decodeURIComponent(s);
    } catch {
      return s;
    }
  });
  return { seg, params };
}

function setNav(name) {
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.dataset.nav === name);
}

function renderWho() {
  fill($who);
  if (!token) return;
  if (me) {
    $who.append(h('span', { title: 'signed in as' }, `${str(me.user)} · team ${str(me.team)}`));
    if (me.admin) $who.append(badge('admin'));
  }
  $who.append(h('button', { class: 'link', onclick: () => signOut('Signed out. Paste a token to sign in again.') }, 'sign out'));
}

function stopCurrent() {
  if (current) current.stop();
  current = null;
}

function showLogin(why) {
  routeGen++;
  stopCurrent();
  renderWho();
  setNav(null);
  const input = h('input', { type: 'password', placeholder: 'token', autocomplete: 'off', spellcheck: 'false', 'aria-label': 'token' });
  const form = h('form', {
    class: 'card login',
    onsubmit: (e) => {
      e.preventDefault();
      const t = input.value.trim();
      if (!t) return;
      token = t;
      storeToken(t);
      me = null;
      route();
    },
  },
  h('h1', null, 'Sign in to Shoal'),
  why ? msg('error', why) : null,
  h('p', { class: 'muted' }, 'Paste an API token. A local server keeps its admin token in DATA_DIR/admin.token; ',
    'an admin makes more with POST /api/v1/tokens. The token stays in this browser (localStorage).'),
  input,
  h('div', null, h('button', { type: 'submit' }, 'Sign in')));
  fill($view, form);
  input.focus();
}

async function route() {
  const gen = ++routeGen;
  stopCurrent();
  if (!token) {
    showLogin(null);
    return;
  }
  const ctx = new Ctx();
  current = ctx;
  const { seg, params } = parseRoute();
  const name = seg.length === 0 ? 'overview' : seg[0];
  setNav(name);
  fill($view);
  if (!me) {
    try {
      me = await ctx.api('api/v1/whoami');
    } catch (e) {
      if (gen !== routeGen || e.status === 401 || isAbort(e)) return;
      me = null; // unknown identity: the pages still work, the team filter stays hidden
    }
    if (gen !== routeGen) return;
  }
  renderWho();
  const views = { overview: overviewView, jobs: seg.length > 1 ? jobView : jobsView, queues: queuesView, cost: costView };
  const view = views[name];
  ctx.errorBox = h('div');
  $view.append(ctx.errorBox);
  if (!view) {
    $view.append(h('div', { class: 'card' }, h('h1', null, 'Not found'), h('p', null, 'No page ', h('code', null, location.hash), '. ', h('a', { href: '#/' }, 'Go to the overview'), '.')));
    return;
  }
  try {
    await view(ctx, $view, seg, params);
  } catch (e) {
    ctx.report(e);
  }
}

// ------------------------------------------------------------------------------------------------------------
// #/ overview

async function overviewView(ctx, root) {
  const live = h('span', { class: 'live' }, 'connecting…');
  const capacity = h('div', { class: 'stats big' });
  const counts = h('div', { class: 'stats' });
  const cpuEl = h('div', { class: 'chart' });
  const memEl = h('div', { class: 'chart' });
  const gpuCard = h('section', { class: 'card', style: { display: 'none' } }, h('header', null, h('h2', null, 'GPUs: capacity and allocation')));
  const gpuEl = h('div', { class: 'chart' });
  gpuCard.append(gpuEl);
  const queueEl = h('div', { class: 'chart' });
  const queuesBox = h('div');
  const jobsBox = h('div');
  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Cluster'), live),
    capacity,
    counts,
    h('div', { class: 'grid' },
      h('section', { class: 'card' }, h('header', null, h('h2', null, 'CPUs: capacity and allocation')), cpuEl),
      h('section', { class: 'card' }, h('header', null, h('h2', null, 'Memory: capacity and allocation')), memEl),
      gpuCard,
      h('section', { class: 'card' }, h('header', null, h('h2', null, 'Jobs waiting and running')), queueEl),
      h('section', { class: 'card' }, h('header', null, h('h2', null, 'Queues'), h('span', { class: 'hint' }, 'allocated / guaranteed'), h('a', { href: '#/queues', class: 'hint' }, 'quotas →')), queuesBox),
      h('section', { class: 'card wide' }, h('header', null, h('h2', null, 'Active jobs'), h('a', { href: '#/jobs', class: 'hint' }, 'all jobs →')), jobsBox)));

  const cpuChart = new LineChart(ctx, cpuEl, { xTime: true, yMin: 0, sync: 'overview', empty: 'no history yet' });
  const memChart = new LineChart(ctx, memEl, { xTime: true, yMin: 0, yFmt: fmtBytes, binary: true, sync: 'overview', empty: 'no history yet' });
  const gpuChart = new LineChart(ctx, gpuEl, { xTime: true, yMin: 0, sync: 'overview', empty: 'no history yet' });
  const queueChart = new LineChart(ctx, queueEl, { xTime: true, yMin: 0, yFmt: fmtInt, integer: true, sync: 'overview', empty: 'no history yet' });

  // Without GET /overview: the same picture from /nodes, /queues and /jobs, with history kept in this page.
  const localHistory = [];
  let jobsActive = [];
  async function synthesize() {
    const [nodes, queues, jobs] = await Promise.all([
      ctx.api('api/v1/nodes').catch(() => null),
      ctx.api('api/v1/queues').catch(() => null),
      ctx.api('api/v1/jobs?limit=1000').catch(() => null),
    ]);
    const ns = arr(nodes && nodes.nodes);
    const sum = (f) => ns.reduce((a, n) => a + (num(f(n)) || 0), 0);
    const js = arr(jobs && jobs.jobs);
    const count = Object.fromEntries(STATES.map((s) => [s, js.filter((j) => j.state === s).length]));
    const point = {
      time_ms: Date.now(),
      cpus_allocated: sum((n) => at(n, 'allocated', 'cpus')),
      memory_allocated_bytes: sum((n) => at(n, 'allocated', 'memory_bytes')),
      gpus_allocated: sum((n) => at(n, 'allocated', 'gpus')),
      pending: count.pending,
      running: count.running,
    };
    localHistory.push(point);
    if (localHistory.length > 2000) localHistory.shift();
    return {
      cluster: {
        cpus: nodes ? sum((n) => n.cpus) : null,
        memory_bytes: nodes ? sum((n) => n.memory_bytes) : null,
        gpus: nodes ? sum((n) => arr(n.gpus).length) : null,
        allocated: { cpus: point.cpus_allocated, memory_bytes: point.memory_allocated_bytes, gpus: point.gpus_allocated },
      },
      jobs: jobs ? count : null,
      queues: arr(queues && queues.queues),
      history: localHistory.slice(),
    };
  }

  function render(ov) {
    ov = ov && typeof ov === 'object' ? ov : {};
    const c = ov.cluster || {};
    const a = c.allocated || {};
    const hist = arr(ov.history).filter((p) => p && isNum(p.time_ms));
    const frac = (x, y) => (isNum(num(x)) && num(y) > 0 ? num(x) / num(y) : null);
    fill(capacity, 
      stat('CPUs allocated', `${fmtNum(a.cpus)} / ${fmtNum(c.cpus)}`, fmtPct(frac(a.cpus, c.cpus) === null ? null : 100 * frac(a.cpus, c.cpus))),
      stat('Memory allocated', `${fmtBytes(a.memory_bytes)} / ${fmtBytes(c.memory_bytes)}`, fmtPct(frac(a.memory_bytes, c.memory_bytes) === null ? null : 100 * frac(a.memory_bytes, c.memory_bytes))),
      stat('GPUs allocated', `${fmtNum(a.gpus)} / ${fmtNum(c.gpus)}`, num(c.gpus) ? fmtPct(100 * frac(a.gpus, c.gpus)) : 'no GPUs'),
    );
    capacity.children[0].append(meter(frac(a.cpus, c.cpus), true));
    capacity.children[1].append(meter(frac(a.memory_bytes, c.memory_bytes), true));
    capacity.children[2].append(meter(frac(a.gpus, c.gpus), true));
    const jc = ov.jobs || {};
    fill(counts, ...STATES.map((s) => stat(s, fmtInt(jc[s]), undefined, { href: `#/jobs?state=${s}` })));

    const xs = hist.map((p) => p.time_ms / 1000);
    const col = (k) => hist.map((p) => (isNum(num(p[k])) ? num(p[k]) : null));
    const flat = (v) => hist.map(() => (isNum(num(v)) ? num(v) : null));
    cpuChart.set([{ label: 'capacity', color: '#868e96', dash: [6, 4] }, { label: 'allocated', color: PALETTE[0], width: 2 }], [xs, flat(c.cpus), col('cpus_allocated')]);
    memChart.set([{ label: 'capacity', color: '#868e96', dash: [6, 4] }, { label: 'allocated', color: PALETTE[2], width: 2 }], [xs, flat(c.memory_bytes), col('memory_allocated_bytes')]);
    if (num(c.gpus) > 0) {
      gpuCard.style.display = '';
      gpuChart.set([{ label: 'capacity', color: '#868e96', dash: [6, 4] }, { label: 'allocated', color: PALETTE[3], width: 2 }], [xs, flat(c.gpus), col('gpus_allocated')]);
    }
    // pending drawn last and dashed, so that it shows where the two lines meet
    queueChart.set([{ label: 'running', color: PALETTE[0], width: 2 }, { label: 'pending', color: '#e67700', width: 2, dash: [6, 4] }], [xs, col('running'), col('pending')]);
    fill(queuesBox, queuesTable(arr(ov.queues)));
  }

  async function loadJobs() {
    const r = await ctx.api('api/v1/jobs?state=running,pending,preempted');
    jobsActive = arr(r && r.jobs);
    fill(jobsBox, jobsTable(jobsActive, 'no pending or running jobs'));
  }
  ctx.every(5000, loadJobs);

  let synthetic = false;
  async function poll() {
    let ov = null;
    if (!synthetic) {
      try {
        ov = await ctx.api('api/v1/overview');
      } catch (e) {
        if (e.status !== 404 && e.status !== 405) throw e;
        synthetic = true;
      }
    }
    if (synthetic) {
      ov = await synthesize();
      live.textContent = 'polling (no /overview on this server)';
    }
    ctx.clearError();
    render(ov);
  }
  const startPolling = (why) => {
    live.className = 'live poll';
    live.textContent = `polling every ${POLL_MS / 1000} s`;
    live.title = why || '';
    ctx.every(POLL_MS, poll);
  };
  openStream(ctx, 'api/v1/overview/stream', {
    overview: (ov) => {
      live.className = 'live on';
      live.textContent = 'live';
      ctx.clearError();
      render(ov);
    },
  }, startPolling);
}

function queuesTable(queues) {
  return table([
    { label: 'queue', get: (q) => h('b', null, str(q.name)) },
    { label: 'pending', num: true, get: (q) => fmtInt(q.pending) },
    { label: 'running', num: true, get: (q) => fmtInt(q.running) },
    { label: 'preempted', num: true, get: (q) => fmtInt(q.preempted) },
    { label: 'CPUs', num: true, get: (q) => `${fmtNum(at(q, 'allocated', 'cpus'))} / ${fmtNum(at(q, 'guaranteed', 'cpus'))}` },
    { label: 'memory', num: true, get: (q) => `${fmtBytes(at(q, 'allocated', 'memory_bytes'))} / ${fmtBytes(at(q, 'guaranteed', 'memory_bytes'))}` },
  ], queues, 'no queues');
}

function jobsTable(jobs, empty) {
  return table([
    { label: 'job', get: (j) => jobLink(str(j.id)) },
    { label: 'name', get: (j) => str(j.name) },
    { label: 'state', get: (j) => h('span', null, badge(stateOf(j)), j.cancel_requested && !FINAL.has(j.state) ? h('span', { class: 'faint' }, ' cancelling') : null) },
    { label: 'user', get: (j) => str(j.user) },
    { label: 'team', get: (j) => str(j.team) },
    { label: 'queue', get: (j) => str(j.queue) },
    { label: 'prio', num: true, get: (j) => fmtInt(j.priority) },
    { label: 'workers', num: true, get: (j) => fmtInt(j.worker_count) },
    { label: 'restarts', num: true, get: (j) => fmtInt(j.restarts) },
    { label: 'submitted', get: (j) => fmtAgo(j.created_ms), title: (j) => fmtClock(j.created_ms) },
    { label: 'ran', num: true, get: (j) => (num(j.started_ms) ? fmtDuration((num(j.finished_ms) || Date.now()) - j.started_ms) : DASH) },
    { label: 'reason', cls: 'reason', get: (j) => str(j.reason) },
  ], jobs, empty);
}

// ------------------------------------------------------------------------------------------------------------
// #/jobs

async function jobsView(ctx, root, seg, params) {
  const states = new Set((params.get('state') || '').split(',').filter((s) => STATES.includes(s)));
  let team = params.get('team') || '';
  const isAdmin = !!(me && me.admin);
  const box = h('div', { class: 'card' });
  const countEl = h('span', { class: 'sub' });
  const chips = h('div', { class: 'chips' });
  const teamInput = h('input', { type: 'text', placeholder: 'all teams', value: team, size: 14, 'aria-label': 'team' });
  const syncHash = () => {
    const q = new URLSearchParams();
    if (states.size) q.set('state', [...states].join(','));
    if (team) q.set('team', team);
    const qs = q.toString().replace(/%2C/g, ',');
    history.replaceState(null, '', `#/jobs${qs ? `?${qs}` : ''}`);
  };
  function drawChips() {
    fill(chips, 
      h('button', { class: `chip${states.size === 0 ? ' on' : ''}`, onclick: () => { states.clear(); changed(); } }, 'all'),
      ...STATES.map((s) => h('button', {
        class: `chip${states.has(s) ? ' on' : ''}`,
        onclick: () => {
          if (states.has(s)) states.delete(s);
          else states.add(s);
          changed();
        },
      }, s)));
  }
  let poller = null;
  function changed() {
    syncHash();
    drawChips();
    if (poller) poller.stop();
    poller = ctx.every(3000, load);
  }
  teamInput.addEventListener('change', () => {
    team = teamInput.value.trim();
    changed();
  });
  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Jobs'), countEl),
    h('div', { class: 'filters' },
      h('span', { class: 'muted' }, 'state'), chips,
      h('span', { class: 'muted' }, 'team'),
      isAdmin ? teamInput : h('span', { title: 'only admins see other teams' }, h('b', null, str(me && me.team)), h('span', { class: 'faint' }, ' (your team)'))),
    box);
  drawChips();
  async function load() {
    const q = new URLSearchParams();
    if (states.size) q.set('state', [...states].join(','));
    if (team && isAdmin) q.set('team', team);
    const qs = q.toString().replace(/%2C/g, ',');
    const r = await ctx.api(`api/v1/jobs${qs ? `?${qs}` : ''}`);
    const jobs = arr(r && r.jobs);
    ctx.clearError();
    countEl.textContent = `${jobs.length} job${jobs.length === 1 ? '' : 's'}`;
    fill(box, jobsTable(jobs, states.size || team ? 'no jobs match the filters' : 'no jobs yet: submit one with `shoal submit JOB.toml`'));
  }
  poller = ctx.every(3000, load);
}

// ------------------------------------------------------------------------------------------------------------
// #/queues

async function queuesView(ctx, root) {
  const qBox = h('div');
  const nBox = h('div');
  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Queues and quotas'), h('span', { class: 'sub' }, 'guarantees, borrowing, and what each queue holds')),
    h('section', { class: 'card section' }, h('header', null, h('h2', null, 'Queues')), qBox),
    h('section', { class: 'card section' }, h('header', null, h('h2', null, 'Nodes')), nBox));
  const use = (used, total, fmt) => h('div', null, `${fmt(used)} / ${fmt(total)}`, meter(num(total) > 0 && isNum(num(used)) ? num(used) / num(total) : 0, true));
  ctx.every(5000, async () => {
    const [q, n] = await Promise.all([ctx.api('api/v1/queues'), ctx.api('api/v1/nodes').catch((e) => (e.status === 404 ? null : Promise.reject(e)))]);
    ctx.clearError();
    fill(qBox, table([
      { label: 'queue', get: (x) => h('b', null, str(x.name)) },
      { label: 'can borrow', get: (x) => (x.can_borrow === true ? 'yes' : x.can_borrow === false ? 'no' : DASH) },
      { label: 'pending', num: true, get: (x) => fmtInt(x.pending) },
      { label: 'running', num: true, get: (x) => fmtInt(x.running) },
      { label: 'preempted', num: true, get: (x) => fmtInt(x.preempted) },
      { label: 'CPUs allocated / guaranteed', get: (x) => use(at(x, 'allocated', 'cpus'), at(x, 'guaranteed', 'cpus'), fmtNum) },
      { label: 'memory allocated / guaranteed', get: (x) => use(at(x, 'allocated', 'memory_bytes'), at(x, 'guaranteed', 'memory_bytes'), fmtBytes) },
      { label: 'GPUs allocated / guaranteed', get: (x) => use(at(x, 'allocated', 'gpus'), at(x, 'guaranteed', 'gpus'), fmtNum) },
    ], arr(q && q.queues), 'no queues'));
    fill(nBox, n ? table([
      { label: 'node', get: (x) => h('b', null, str(x.id)) },
      { label: 'host', get: (x) => str(x.host) },
      { label: 'CPUs allocated / total', get: (x) => use(at(x, 'allocated', 'cpus'), x.cpus, fmtNum) },
      { label: 'memory allocated / total', get: (x) => use(at(x, 'allocated', 'memory_bytes'), x.memory_bytes, fmtBytes) },
      { label: 'GPUs allocated / total', get: (x) => use(at(x, 'allocated', 'gpus'), arr(x.gpus).length, fmtNum) },
      { label: 'GPU kinds', get: (x) => (arr(x.gpus).length ? [...new Set(arr(x.gpus).map((g) => `${str(g.kind)} ${fmtBytes(g.memory_bytes)}`))].join(', ') : DASH) },
    ], arr(n.nodes), 'no nodes') : h('div', { class: 'empty' }, DASH));
  });
}

// ------------------------------------------------------------------------------------------------------------
// #/cost

async function costView(ctx, root, seg, params) {
  const isAdmin = !!(me && me.admin);
  let since = params.get('since') || '';
  let team = params.get('team') || '';
  const head = h('div', { class: 'stats' });
  const teamsBox = h('div');
  const jobsBox = h('div');
  const sinceSel = h('select', { 'aria-label': 'since' },
    [['', 'all time'], ['1', 'last 24 hours'], ['7', 'last 7 days'], ['30', 'last 30 days']].map(([v, l]) => h('option', { value: v, selected: v === since ? true : null }, l)));
  const teamInput = h('input', { type: 'text', placeholder: 'all teams', value: team, size: 14, 'aria-label': 'team' });
  root.append(
    h('div', { class: 'page-head' }, h('h1', null, 'Cost'), h('span', { class: 'sub' }, 'what jobs allocated and used, priced')),
    h('div', { class: 'filters' }, h('span', { class: 'muted' }, 'since'), sinceSel,
      isAdmin ? [h('span', { class: 'muted' }, 'team'), teamInput] : null),
    head,
    h('section', { class: 'card section' }, h('header', null, h('h2', null, 'By team')), teamsBox),
    h('section', { class: 'card section' }, h('header', null, h('h2', null, 'By job')), jobsBox));
  let poller = null;
  const changed = () => {
    since = sinceSel.value;
    team = teamInput.value.trim();
    const q = new URLSearchParams();
    if (since) q.set('since', since);
    if (team) q.set('team', team);
    history.replaceState(null, '', `#/cost${q.toString() ? `?${q}` : ''}`);
    if (poller) poller.stop();
    poller = ctx.every(10000, load);
  };
  sinceSel.addEventListener('change', changed);
  teamInput.addEventListener('change', changed);
  const hours = (o) => `${fmtNum(at(o, 'cpu_hours'))} CPU·h, ${fmtNum(at(o, 'gib_hours'))} GiB·h${num(at(o, 'gpu_hours')) ? `, ${fmtNum(at(o, 'gpu_hours'))} GPU·h` : ''}`;
  async function load() {
    const q = new URLSearchParams();
    if (since) q.set('since', String(Date.now() - Number(since) * 86400000));
    if (team && isAdmin) q.set('team', team);
    let r;
    try {
      r = await ctx.api(`api/v1/cost${q.toString() ? `?${q}` : ''}`);
    } catch (e) {
      if (e.status === 404 || e.status === 405) {
        fill(head);
        fill(teamsBox, h('div', { class: 'empty' }, `${DASH} this server does not report cost (no /api/v1/cost)`));
        fill(jobsBox);
        if (poller) poller.stop();
        return;
      }
      throw e;
    }
    ctx.clearError();
    const cur = (r && r.currency) || 'USD';
    const p = (r && r.prices) || {};
    const jobs = arr(r && r.jobs).slice().sort((a, b) => (num(b.cost) || 0) - (num(a.cost) || 0));
    const teams = arr(r && r.teams).slice().sort((a, b) => (num(b.cost) || 0) - (num(a.cost) || 0));
    const energy = jobs.some((j) => isNum(num(j.energy_kwh))) ? jobs.reduce((s, j) => s + (num(j.energy_kwh) || 0), 0) : null;
    fill(head, 
      stat('Total cost', fmtMoney(r && r.total_cost, cur), `${jobs.length} job${jobs.length === 1 ? '' : 's'}`),
      stat('CPU hour', fmtMoney(p.cpu_hour, cur)),
      stat('GiB hour', fmtMoney(p.gib_hour, cur)),
      stat('GPU hour', fmtMoney(p.gpu_hour, cur)),
      stat('Energy', energy === null ? DASH : `${fmtNum(energy)} kWh`, 'where measured'));
    fill(teamsBox, table([
      { label: 'team', get: (t) => h('b', null, str(t.team)) },
      { label: 'jobs', num: true, get: (t) => fmtInt(t.jobs) },
      { label: 'allocated', get: (t) => hours(t.allocated) },
      { label: 'used', get: (t) => hours(t.used) },
      { label: 'waited', num: true, get: (t) => fmtDuration(num(t.queue_s) === null ? null : t.queue_s * 1000) },
      { label: 'cost', num: true, get: (t) => h('b', null, fmtMoney(t.cost, cur)) },
    ], teams, 'no teams with jobs'));
    fill(jobsBox, table([
      { label: 'job', get: (j) => jobLink(str(j.id)) },
      { label: 'name', get: (j) => str(j.name) },
      { label: 'team', get: (j) => str(j.team) },
      { label: 'state', get: (j) => badge(stateOf(j)) },
      { label: 'waited', num: true, get: (j) => fmtDuration(num(j.queue_s) === null ? null : j.queue_s * 1000) },
      { label: 'allocated', get: (j) => hours(j.allocated) },
      { label: 'used', get: (j) => hours(j.used) },
      { label: 'energy', num: true, get: (j) => (isNum(num(j.energy_kwh)) ? `${fmtNum(j.energy_kwh)} kWh` : DASH) },
      { label: 'cost', num: true, get: (j) => h('b', null, fmtMoney(j.cost, cur)) },
    ], jobs, 'no jobs in this period'));
  }
  poller = ctx.every(10000, load);
}

// ------------------------------------------------------------------------------------------------------------
// #/jobs/ID

async function jobView(ctx, root, seg) {
  const id = seg[1];
  const base = `api/v1/jobs/${encodeURIComponent(id)}`;
  let job = null;

  // what has arrived: training rows per rank (by step), evaluation rows, resource samples per rank (by time)
  const train = new Map();
  const evals = new Cols();
  const samples = new Map();
  const rankCols = (m, r) => {
    if (!m.has(r)) m.set(r, new Cols());
    return m.get(r);
  };
  const ranksOf = (m) => [...m.keys()].sort((a, b) => a - b);

  // ---- skeleton
  const live = h('span', { class: 'live' }, 'connecting…');
  const titleEl = h('div', { class: 'title' }, h('h1', null, id));
  const cancelBtn = h('button', { class: 'danger', disabled: true }, 'Cancel job');
  const factsEl = h('dl', { class: 'facts' });
  const reasonEl = h('div', { class: 'reason' });
  const progressEl = h('div', { class: 'progress' });
  const statsEl = h('div', { class: 'stats' });
  const lossEl = h('div', { id: 'loss-chart', class: 'chart' });
  const logLoss = h('input', { type: 'checkbox', checked: true });
  const tputEl = h('div', { class: 'chart' });
  const barsEl = h('div', { class: 'bars' }, h('div', { class: 'empty' }, 'waiting for data…'));
  const computeEl = h('div', { class: 'chart' });
  const shareEl = h('div', { class: 'chart' });
  const roundsEl = h('div', { id: 'rounds-chart', class: 'chart' });
  const roundsBox = h('div', { id: 'rounds-table' });
  const memoryEl = h('div', { class: 'bars', id: 'memory-bars' }, h('div', { class: 'empty' }, 'waiting for data…'));
  const cpuEl = h('div', { class: 'chart' });
  const rssEl = h('div', { class: 'chart' });
  const netEl = h('div', { class: 'chart' });
  const gpuBox = h('div', { class: 'empty' }, `${DASH} no GPU samples (a CPU-only job, or none reported yet)`);
  const diagBox = h('div', { class: 'findings' }, h('div', { class: 'empty' }, 'loading…'));
  const stripEl = h('div');
  const eventsBox = h('div', { class: 'events' });
  const workersBox = h('div');
  const logRank = h('select', { 'aria-label': 'rank' }, h('option', { value: '0' }, 'rank 0'));
  const logPre = h('pre', { class: 'log' });
  const logNote = h('span', { class: 'hint' });
  const card = (title, hint, ...body) => h('section', { class: 'card' }, h('header', null, h('h2', null, title), hint ? h('span', { class: 'hint' }, hint) : null), ...body);
  const samplesCards = [
    card('CPU per worker', '% of one core', cpuEl),
    card('Memory per worker', 'resident set size', rssEl),
    card('Network', "bytes/s in and out, per host (the host's interfaces)", netEl),
    card('GPU', 'utilisation, memory, temperature', gpuBox),
  ];
  root.append(
    h('div', { class: 'page-head' }, h('a', { href: '#/jobs' }, '← jobs'), h('span', { class: 'spacer' }), live),
    h('section', { class: 'card job-head' }, titleEl, h('div', { class: 'actions' }, cancelBtn), factsEl, progressEl, reasonEl),
    statsEl,
    h('div', { class: 'grid' },
      h('section', { class: 'card' }, h('header', null, h('h2', null, 'Loss'), h('span', { class: 'hint' }, 'training (rank 0) and evaluation, by step'),
        h('label', { class: 'hint toggle' }, logLoss, 'log scale')), lossEl),
      card('Throughput', 'samples/s (global batch ÷ step time, rank 0)', tputEl),
      card('Step time breakdown', 'median of the last 50 logged steps, per rank',
        h('div', { class: 'legend' }, PHASES.map(([, label, color]) => h('span', { style: { '--c': color } }, label))), barsEl),
      card('Compute time per rank', 'seconds per step', computeEl),
      card('Batch share per rank', 'each rank\'s part of the global batch (train.balance = "dynamic")', shareEl),
      card('Federated rounds', 'clients sampled, combined, dropped and late each round; the last rounds below', roundsEl, roundsBox),
      card('Memory per rank', 'what each rank holds for training, from its buffers (last step)',
        h('div', { class: 'legend' }, MEMORY.map(([, label, color]) => h('span', { style: { '--c': color } }, label))), memoryEl),
      ...samplesCards,
      card('Diagnosis', 'what slows this job down', diagBox),
      h('section', { class: 'card' }, h('header', null, h('h2', null, 'Timeline'), h('span', { class: 'hint' }, 'states, restarts (red marks) and events')), stripEl, eventsBox),
      h('section', { class: 'card wide' }, h('header', null, h('h2', null, 'Workers')), workersBox),
      h('section', { class: 'card wide' }, h('header', null, h('h2', null, 'Logs'), logRank, logNote), logPre)));

  // ---- charts
  // What a chart drew, on its element (`data-points`): what a browser test reads.
  const countPoints = (el) => (u) => {
    let n = 0;
    for (let s = 1; s < u.data.length; s++) for (const v of u.data[s]) if (v !== null && v !== undefined) n++;
    if (n >= 1) el.dataset.points = String(n);
  };
  const lossChart = new LineChart(ctx, lossEl, {
    sync: 'steps',
    log: logLoss.checked,
    height: 240,
    empty: 'waiting for the first logged step…',
    onDraw: countPoints(lossEl),
  });
  logLoss.addEventListener('change', () => lossChart.setLog(logLoss.checked));
  const tputChart = new LineChart(ctx, tputEl, { sync: 'steps', yMin: 0 });
  const computeChart = new LineChart(ctx, computeEl, { sync: 'steps', yMin: 0, yFmt: fmtSecs });
  const shareChart = new LineChart(ctx, shareEl, { sync: 'steps', yMin: 0, yFmt: fmtPct01 });
  const roundsChart = new LineChart(ctx, roundsEl, { sync: 'steps', yMin: 0, onDraw: countPoints(roundsEl) });
  const cpuChart = new LineChart(ctx, cpuEl, { xTime: true, yMin: 0, yFmt: fmtPct, sync: 'time', empty: 'no resource samples yet' });
  const rssChart = new LineChart(ctx, rssEl, { xTime: true, yMin: 0, yFmt: fmtBytes, binary: true, sync: 'time', empty: 'no resource samples yet' });
  const netChart = new LineChart(ctx, netEl, { xTime: true, yMin: 0, yFmt: fmtRate, binary: true, sync: 'time', empty: 'no resource samples yet' });
  let gpuCharts = null;
  let armed = null; // the cancel button's confirmation timer

  // ---- ingest
  function addMetrics(rows) {
    for (const r of arr(rows)) {
      if (!r || typeof r !== 'object') continue;
      const d = r.data && typeof r.data === 'object' ? r.data : {};
      const step = num(r.step) ?? num(d.step);
      const rank = num(r.rank) ?? 0;
      if (step === null) continue;
      const values = { ...d, time_ms: num(r.time_ms) };
      if (rank < 0 || (d.loss === undefined && d.eval_loss !== undefined)) evals.push(step, values);
      else rankCols(train, rank).push(step, values);
    }
    for (const c of train.values()) c.decimate(MAX_POINTS);
  }
  function addSamples(rows) {
    for (const r of arr(rows)) {
      if (!r || typeof r !== 'object') continue;
      const t = num(r.time_ms);
      if (t === null) continue;
      const s = rankCols(samples, num(r.rank) ?? 0);
      if (t <= s.lastX) continue;
      s.push(t, r);
    }
    for (const c of samples.values()) c.decimate(MAX_POINTS);
  }

  // ---- rendering
  // A federated job's steps are its rounds.
  const trainSteps = () => at(job, 'spec', 'federated', 'rounds') ?? at(job, 'spec', 'train', 'steps');
  function renderHead() {
    if (!job) return;
    const st = stateOf(job);
    fill(titleEl, h('h1', null, str(job.name)), h('span', { class: 'mono muted' }, str(job.id)), badge(st),
      job.cancel_requested && !FINAL.has(st) ? h('span', { class: 'badge cancelled' }, 'cancel requested') : null);
    document.title = `${str(job.name)} (${st}) · Shoal`;
    const end = num(job.finished_ms) || Date.now();
    const facts = [
      ['state', st],
      ['attempt', fmtInt(job.attempt)],
      ['restarts', `${fmtInt(job.restarts)}${isNum(num(at(job, 'spec', 'fault_tolerance', 'max_restarts'))) ? ` of ${job.spec.fault_tolerance.max_restarts}` : ''}`],
      ['workers', fmtInt(job.worker_count)],
      ['queue · priority', `${str(job.queue)} · ${fmtInt(job.priority)}`],
      ['user · team', `${str(job.user)} · ${str(job.team)}`],
      ['submitted', fmtClock(job.created_ms)],
      ['started', fmtClock(job.started_ms)],
      [FINAL.has(st) ? 'finished' : 'running for', FINAL.has(st) ? fmtClock(job.finished_ms) : num(job.started_ms) ? fmtDuration(end - job.started_ms) : DASH],
      ['model · dataset', `${str(at(job, 'spec', 'train', 'model', 'kind') ?? at(job, 'spec', 'train', 'model'))} · ${str(at(job, 'spec', 'train', 'dataset'))}`],
    ];
    fill(factsEl, ...facts.map(([k, v]) => h('div', null, h('dt', null, k), h('dd', { title: typeof v === 'string' ? v : null }, v))));
    reasonEl.textContent = job.reason ? job.reason : '';
    cancelBtn.disabled = FINAL.has(st) || !!job.cancel_requested;
    if (!armed || cancelBtn.disabled) {
      cancelBtn.textContent = job.cancel_requested && !FINAL.has(st) ? 'Cancelling…' : 'Cancel job';
      cancelBtn.classList.remove('confirm');
    }
    renderProgress();
    renderTimeline();
    renderWorkers();
    const n = Math.max(1, num(job.worker_count) || 1, ...ranksOf(train).map((r) => r + 1));
    if (logRank.options.length !== n) {
      const sel = logRank.value;
      fill(logRank, ...Array.from({ length: n }, (_, r) => h('option', { value: String(r) }, `rank ${r}`)));
      logRank.value = Number(sel) < n ? sel : '0';
    }
  }
  function renderProgress() {
    const r0 = train.get(0);
    const step = r0 && r0.length ? r0.lastX : num(at(job, 'last_metrics', 'step'));
    const total = num(trainSteps());
    if (step === null && total === null) {
      fill(progressEl);
      return;
    }
    const f = step !== null && total ? step / total : null;
    fill(progressEl, h('span', null, `step ${fmtInt(step)} of ${fmtInt(total)}`), meter(f), h('span', null, f === null ? DASH : fmtPct(100 * f)));
  }
  function renderStats() {
    const r0 = train.get(0) || train.get(ranksOf(train)[0]);
    const sum = (job && job.summary) || {};
    const lm = (job && job.last_metrics) || {};
    const lossNow = (r0 && r0.last('loss')) ?? num(lm.loss) ?? num(sum.final_loss);
    const evalNow = evals.last('eval_loss') ?? num(sum.eval_loss);
    // A federated round's line carries its held-out accuracy beside the round's loss.
    const acc = evals.last('eval_accuracy') ?? (r0 && r0.last('eval_accuracy')) ?? num(sum.eval_accuracy);
    const ppl = evals.last('eval_perplexity') ?? num(sum.eval_perplexity);
    let tput = null;
    let stepS = null;
    if (r0 && r0.length) {
      stepS = r0.median('step_s', 50);
      const smp = r0.median('samples', 50);
      tput = stepS > 0 && smp !== null ? smp / stepS : null;
    }
    if (FINAL.has(stateOf(job)) || tput === null) tput = num(sum.samples_per_s) ?? tput;
    stepS = stepS ?? num(at(sum, 'step_time', 'step_s')) ?? num(lm.step_s);
    const lr = (r0 && r0.last('lr')) ?? num(lm.lr);
    const commB = (r0 && r0.last('comm_bytes')) ?? num(lm.comm_bytes) ?? num(sum.comm_bytes);
    fill(statsEl, 
      stat('training loss', fmtNum(lossNow, 4), isNum(num(sum.baseline_loss)) ? `baseline ${fmtNum(sum.baseline_loss, 4)}` : 'rank 0, last step'),
      stat('eval loss', fmtNum(evalNow, 4), evals.length ? `at step ${fmtInt(evals.lastX)}` : 'last evaluation'),
      stat(ppl !== null && acc === null ? 'eval perplexity' : 'eval accuracy', ppl !== null && acc === null ? fmtNum(ppl, 4) : acc === null ? DASH : fmtPct(100 * acc)),
      stat('throughput', tput === null ? DASH : `${fmtNum(tput)}/s`, 'samples/s, median'),
      stat('step time', fmtSecs(stepS), 'median, rank 0'),
      stat('learning rate', fmtNum(lr)),
      stat('sent in collectives', fmtBytes(commB), 'rank 0, so far'));
  }
  function renderCharts() {
    const ranks = ranksOf(train);
    const r0 = train.get(0) || train.get(ranks[0]) || new Cols();
    const ev = { x: evals.x, y: evals.col('eval_loss') };
    lossChart.set([
      { label: 'training loss (rank 0)', color: PALETTE[0], width: 1.5 },
      { label: 'eval loss', color: PALETTE[1], width: 2, points: true },
    ], align([{ x: r0.x, y: r0.col('loss') }, ev]));

    const smp = r0.col('samples');
    const sst = r0.col('step_s');
    const tp = r0.x.map((_, i) => (smp[i] !== null && sst[i] > 0 ? smp[i] / sst[i] : null));
    let ema = null;
    const smooth = tp.map((v) => {
      if (v === null) return null;
      ema = ema === null ? v : ema + 0.1 * (v - ema);
      return ema;
    });
    tputChart.set([
      { label: 'samples/s', color: '#a5c0ef', width: 1 },
      { label: 'smoothed', color: PALETTE[0], width: 2 },
    ], [r0.x.slice(), tp, smooth]);

    computeChart.set(ranks.map((r, i) => ({ label: `rank ${r}`, color: PALETTE[i % PALETTE.length] })),
      align(ranks.map((r) => ({ x: train.get(r).x, y: train.get(r).col('compute_s') }))));
    const balanced = ranks.some((r) => train.get(r).last('share') !== null);
    shareEl.closest('section').hidden = !balanced;
    if (balanced) {
      shareChart.set(ranks.map((r, i) => ({ label: `rank ${r}`, color: PALETTE[i % PALETTE.length] })),
        align(ranks.map((r) => ({ x: train.get(r).x, y: train.get(r).col('share') }))));
    }
    renderRounds(r0);
    renderBars(ranks);
    renderMemory(ranks);
  }
  // Federated learning: rank 0's line a round (`sampled`, `clients`, `dropped`, `late`, `round_bytes`, `epsilon`).
  function renderRounds(r0) {
    const fed = r0.last('sampled') !== null;
    roundsEl.closest('section').hidden = !fed;
    if (!fed) return;
    roundsChart.set([
      { label: 'sampled', color: PALETTE[0], width: 1.5 },
      { label: 'combined', color: PALETTE[1], width: 2 },
      { label: 'dropped', color: PALETTE[3], width: 1.5, points: true },
      { label: 'late', color: PALETTE[4], width: 1.5, points: true },
    ], [r0.x.slice(), r0.col('sampled'), r0.col('clients'), r0.col('dropped'), r0.col('late')]);
    const col = (k) => r0.col(k);
    const rows = r0.x.map((round, i) => ({ round, i })).slice(-10).reverse();
    const cell = (k, fmt) => ({ label: k, num: true, get: (r) => fmt(col(k)[r.i]) });
    fill(roundsBox, table([
      { label: 'round', num: true, get: (r) => fmtInt(r.round) },
      { label: 'accuracy', num: true, get: (r) => (isNum(col('eval_accuracy')[r.i]) ? fmtPct(100 * col('eval_accuracy')[r.i]) : DASH) },
      cell('sampled', fmtInt), cell('clients', fmtInt), cell('dropped', fmtInt), cell('late', fmtInt),
      { label: 'bytes', num: true, get: (r) => fmtBytes(col('round_bytes')[r.i]) },
      { label: 'ε spent', num: true, get: (r) => (isNum(col('epsilon')[r.i]) ? fmtNum(col('epsilon')[r.i], 3) : DASH) },
      { label: 'seconds', num: true, get: (r) => fmtSecs(col('step_s')[r.i]) },
    ], rows));
  }
  function renderMemory(ranks) {
    stackedBars(memoryEl, MEMORY, fmtBytes, 'total', ranks.map((r) => {
      const c = train.get(r);
      const parts = {};
      for (const [k] of MEMORY) parts[k] = c.last(k);
      return { r, parts, total: Object.values(parts).reduce((a, v) => a + (v || 0), 0) };
    }));
  }
  function renderBars(ranks) {
    stackedBars(barsEl, PHASES, fmtSecs, 'step', ranks.map((r) => {
      const c = train.get(r);
      const parts = {};
      for (const [k] of PHASES) if (k !== 'other_s') parts[k] = c.median(k, 50);
      const step = c.median('step_s', 50);
      const known = Object.values(parts).reduce((a, v) => a + (v || 0), 0);
      parts.other_s = step !== null && step > known ? step - known : 0;
      return { r, parts, total: step ?? known };
    }));
  }
  // One bar per rank, stacked from `kinds` ([key, label, color]), with the numbers in a table below.
  function stackedBars(el, kinds, fmt, totalLabel, all) {
    const rows = all.filter((x) => x.total > 0);
    if (!rows.length) {
      fill(el, h('div', { class: 'empty' }, 'waiting for data…'));
      return;
    }
    const max = Math.max(...rows.map((x) => x.total));
    const numbers = table([
      { label: 'rank', num: true, get: (x) => fmtInt(x.r) },
      ...kinds.map(([k, label]) => ({ label, num: true, get: (x) => fmt(x.parts[k]) })),
      { label: totalLabel, num: true, get: (x) => h('b', null, fmt(x.total)) },
    ], rows);
    numbers.style.marginTop = '12px';
    fill(el, rows.map(({ r, parts, total }) => {
      const title = kinds.map(([k, label]) => `${label} ${fmt(parts[k])}`).join(' · ');
      return h('div', { class: 'bar-row', title },
        h('span', { class: 'label' }, `rank ${r}`),
        h('div', { class: 'stack', style: { width: `${Math.max(2, (100 * total) / max)}%` } },
          kinds.map(([k, , color]) => (parts[k] > 0 ? h('div', { style: { width: `${(100 * parts[k]) / total}%`, background: color } }) : null))),
        h('span', { class: 'total' }, fmt(total)));
    }), numbers);
  }
  function renderSamples() {
    const ranks = ranksOf(samples);
    if (!ranks.length) return;
    const per = (k) => align(ranks.map((r) => ({ x: samples.get(r).x, y: samples.get(r).col(k) })));
    const secs = (d) => {
      d[0] = d[0].map((t) => t / 1000);
      return d;
    };
    const rankSeries = ranks.map((r, i) => ({ label: `rank ${r}`, color: PALETTE[i % PALETTE.length] }));
    cpuChart.set(rankSeries, secs(per('cpu_percent')));
    rssChart.set(rankSeries, secs(per('rss_bytes')));
    // One rank per host: net_* are the host's interfaces, the same for every rank on it.
    const hostOf = new Map(arr(job && job.workers).map((w) => [num(w.rank), w.host]));
    const seen = new Set();
    const hostRanks = ranks.filter((r) => {
      const host = hostOf.get(r) ?? `rank ${r}`;
      if (seen.has(host)) return false;
      seen.add(host);
      return true;
    });
    const multi = hostRanks.length > 1;
    const netSeries = [];
    const netData = [];
    hostRanks.forEach((r, i) => {
      const host = hostOf.get(r);
      const tag = multi ? ` ${host || `rank ${r}`}` : '';
      netSeries.push({ label: `in${tag}`, color: PALETTE[(2 * i) % PALETTE.length] }, { label: `out${tag}`, color: PALETTE[(2 * i + 1) % PALETTE.length] });
      const s = samples.get(r);
      netData.push({ x: s.x, y: s.col('net_rx_bytes_per_s') }, { x: s.x, y: s.col('net_tx_bytes_per_s') });
    });
    netChart.set(netSeries, secs(align(netData)));
    const hasGpu = ranks.some((r) => samples.get(r).last('gpu_util_percent') !== null || samples.get(r).last('gpu_memory_bytes') !== null);
    if (hasGpu) {
      if (!gpuCharts) {
        const u = h('div', { class: 'chart' });
        const m = h('div', { class: 'chart' });
        const t = h('div', { class: 'chart' });
        gpuBox.className = '';
        fill(gpuBox, h('h3', null, 'utilisation'), u, h('h3', null, 'memory'), m, h('h3', null, 'temperature'), t);
        gpuCharts = {
          util: new LineChart(ctx, u, { xTime: true, yMin: 0, yFmt: fmtPct, sync: 'time', height: 160 }),
          mem: new LineChart(ctx, m, { xTime: true, yMin: 0, yFmt: fmtBytes, binary: true, sync: 'time', height: 160 }),
          temp: new LineChart(ctx, t, { xTime: true, yFmt: (v) => `${fmtNum(v)} °C`, sync: 'time', height: 160, empty: `${DASH} not reported` }),
        };
      }
      gpuCharts.util.set(rankSeries, secs(per('gpu_util_percent')));
      gpuCharts.mem.set(rankSeries, secs(per('gpu_memory_bytes')));
      gpuCharts.temp.set(rankSeries, secs(per('gpu_temperature_c')));
    }
  }
  function renderTimeline() {
    const events = arr(job && job.events).filter((e) => e && typeof e === 'object');
    const t0 = num(job.created_ms) ?? (events.length ? num(events[0].time_ms) : null);
    const t1 = num(job.finished_ms) ?? Date.now();
    if (t0 !== null && t1 > t0) {
      const span = t1 - t0;
      const segs = [];
      let state = 'pending';
      let from = t0;
      for (const e of events) {
        const t = num(e.time_ms);
        if (t === null || typeof e.state !== 'string' || e.state === state) continue;
        segs.push([state, from, t]);
        state = e.state;
        from = t;
      }
      segs.push([state, from, t1]);
      const colors = { pending: '#fcd34d', running: '#93c5fd', preempted: '#c4b5fd', succeeded: '#86efac', failed: '#fca5a5', cancelled: '#d1d5db' };
      const strip = h('div', { class: 'strip' },
        segs.map(([s, a, b]) => h('div', { title: `${s} ${fmtClock(a)} – ${fmtClock(b)} (${fmtDuration(b - a)})`, style: { left: `${(100 * (a - t0)) / span}%`, width: `${(100 * Math.max(0, b - a)) / span}%`, background: colors[s] || '#e5e7eb' } })),
        events.filter((e) => /restart|lost|requeue|preempt/.test(`${e.kind}`)).map((e) => h('div', { class: 'mark', title: `${e.kind} ${fmtClock(e.time_ms)}: ${str(e.message)}`, style: { left: `${(100 * ((num(e.time_ms) ?? t0) - t0)) / span}%` } })));
      fill(stripEl, strip, h('div', { class: 'strip-axis' }, h('span', null, fmtClock(t0)), h('span', null, fmtDuration(span)), h('span', null, FINAL.has(stateOf(job)) ? fmtClock(t1) : 'now')));
    }
    fill(eventsBox, table([
      { label: 'time', get: (e) => fmtClock(e.time_ms) },
      { label: '+', num: true, get: (e) => (t0 !== null && num(e.time_ms) !== null ? fmtDuration(e.time_ms - t0) : DASH) },
      { label: 'event', get: (e) => h('b', null, str(e.kind)) },
      { label: 'state', get: (e) => (e.state ? badge(String(e.state)) : DASH) },
      { label: 'message', cls: 'msg-cell', get: (e) => str(e.message) },
    ], events.slice().reverse(), 'no events yet'));
  }
  function renderWorkers() {
    const ws = arr(job && job.workers);
    const lastSample = (r, k) => {
      const s = samples.get(r);
      return s ? s.last(k) : null;
    };
    fill(workersBox, table([
      { label: 'rank', num: true, get: (w) => fmtInt(w.rank) },
      { label: 'role', get: (w) => str(w.role || 'worker') },
      { label: 'state', get: (w) => str(w.state) },
      { label: 'attempt', num: true, get: (w) => fmtInt(w.attempt) },
      { label: 'node', get: (w) => str(w.node) },
      { label: 'host', get: (w) => str(w.host) },
      { label: 'pid', num: true, get: (w) => str(w.pid) },
      { label: 'CPUs', get: (w) => str(w.cpus) },
      { label: 'GPUs', get: (w) => str(w.gpus) },
      { label: 'CPU', num: true, get: (w) => fmtPct(lastSample(num(w.rank), 'cpu_percent')) },
      { label: 'memory', num: true, get: (w) => fmtBytes(lastSample(num(w.rank), 'rss_bytes')) },
      { label: 'last step', num: true, get: (w) => (train.has(num(w.rank)) ? fmtInt(train.get(num(w.rank)).lastX) : DASH) },
      { label: 'exit', num: true, get: (w) => str(w.exit_code) },
      { label: 'reason', cls: 'reason', get: (w) => str(w.reason) },
    ], ws, 'no workers (not placed yet)'));
  }
  const redraw = ctx.throttle(400, () => {
    renderCharts();
    renderStats();
    renderProgress();
    renderWorkers();
  });
  const redrawSamples = ctx.throttle(1000, () => {
    renderSamples();
    renderWorkers();
  });

  // ---- diagnosis
  let diagMissing = false;
  async function loadDiagnosis() {
    if (diagMissing) return;
    let r;
    try {
      r = await ctx.api(`${base}/diagnosis`);
    } catch (e) {
      if (e.status === 404 || e.status === 405) {
        diagMissing = e.status === 405 || !/no job/.test(e.message);
        fill(diagBox, h('div', { class: 'empty' }, `${DASH} no diagnosis available`));
        return;
      }
      throw e;
    }
    const fs = arr(r && r.findings);
    fill(diagBox, ...(fs.length ? fs.map((f) => h('div', { class: `finding ${f.kind === 'healthy' ? 'healthy' : ''}` },
      h('div', { class: 'what' }, str(f.kind).replace(/_/g, ' '), num(f.rank) !== null ? h('span', { class: 'badge' }, `rank ${f.rank}`) : null),
      h('div', { class: 'evidence' }, str(f.evidence)),
      f.action ? h('div', { class: 'action' }, String(f.action)) : null)) : [h('div', { class: 'empty' }, 'no findings yet (needs a few logged steps)')]));
  }

  // ---- logs: the tail of the chosen rank, then what is appended (offsets in bytes, from x-log-size)
  const LOG_TAIL = 64 * 1024;
  const LOG_KEEP = 256 * 1024;
  const log = { rank: 0, offset: null, busy: false, gen: 0 };
  const setLog = (text, append) => {
    const atBottom = logPre.scrollHeight - logPre.scrollTop - logPre.clientHeight < 40;
    let t = append ? logPre.textContent + text : text;
    if (t.length > LOG_KEEP) t = t.slice(t.length - LOG_KEEP);
    logPre.textContent = t;
    if (atBottom || !append) logPre.scrollTop = logPre.scrollHeight;
  };
  async function loadLog() {
    if (log.busy) return;
    log.busy = true;
    const gen = log.gen;
    try {
      const rank = log.rank;
      if (log.offset === null) {
        // ask for the size first (an offset past the end answers nothing but the header)
        const probe = await ctx.api(`${base}/logs?rank=${rank}&offset=1000000000000`, { raw: true });
        const size = num(probe.headers.get('x-log-size'));
        await probe.arrayBuffer();
        const from = size === null ? 0 : Math.max(0, size - LOG_TAIL);
        const res = await ctx.api(`${base}/logs?rank=${rank}&offset=${from}`, { raw: true });
        const buf = await res.arrayBuffer();
        if (gen !== log.gen) return;
        let text = new TextDecoder().decode(buf);
        if (from > 0) text = `… (${fmtBytes(from)} earlier)\n${text.slice(text.indexOf('\n') + 1)}`;
        else if (text.length > LOG_TAIL) text = `…\n${text.slice(text.length - LOG_TAIL)}`;
        log.offset = from + buf.byteLength;
        setLog(text || '', false);
        logNote.textContent = size === null ? '' : `${fmtBytes(size)} in all`;
      } else {
        const res = await ctx.api(`${base}/logs?rank=${rank}&offset=${log.offset}`, { raw: true });
        const buf = await res.arrayBuffer();
        if (gen !== log.gen) return;
        const size = num(res.headers.get('x-log-size'));
        if (size !== null && size < log.offset) {
          log.offset = null; // a new attempt's log: start over
          return;
        }
        if (buf.byteLength) {
          log.offset += buf.byteLength;
          setLog(new TextDecoder().decode(buf), true);
        }
        if (size !== null) logNote.textContent = `${fmtBytes(size)} in all`;
      }
    } catch (e) {
      if (e.status === 400 || e.status === 404) {
        if (!logPre.textContent) logPre.textContent = `${DASH} no log (${e.message})`;
      } else {
        throw e;
      }
    } finally {
      log.busy = false;
    }
  }
  logRank.addEventListener('change', () => {
    log.rank = Number(logRank.value) || 0;
    log.offset = null;
    log.gen++;
    logPre.textContent = '';
    loadLog().catch((e) => ctx.report(e));
  });
  let lastAttempt = null;
  const logSoon = ctx.throttle(500, () => loadLog().catch((e) => ctx.report(e)));

  // ---- cancel (two clicks)
  cancelBtn.addEventListener('click', async () => {
    if (!armed) {
      cancelBtn.classList.add('confirm');
      cancelBtn.textContent = 'Click again to cancel';
      armed = setTimeout(() => {
        armed = null;
        if (job) renderHead();
      }, 4000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    cancelBtn.disabled = true;
    cancelBtn.textContent = 'Cancelling…';
    try {
      await ctx.api(`${base}/cancel`, { method: 'POST' });
      await refreshJob();
    } catch (e) {
      ctx.report(e);
      renderHead();
    }
  });
  ctx.onStop(() => clearTimeout(armed));

  // ---- job state
  function setJob(j) {
    if (!j || typeof j !== 'object') return;
    job = j;
    if (lastAttempt !== null && num(j.attempt) !== lastAttempt) {
      log.offset = null;
      log.gen++;
    }
    lastAttempt = num(j.attempt);
    renderHead();
    renderStats();
    if (FINAL.has(stateOf(j))) finish();
  }
  async function refreshJob() {
    setJob(await ctx.api(base));
  }

  // ---- fetching: the stream when it works, else polling
  let metricsParam = 'max_points=2000';
  let samplesMissing = false;
  async function fetchMetrics(after, rank) {
    const q = [];
    if (rank !== undefined) q.push(`rank=${rank}`);
    if (after !== null) q.push(`after=${after}`);
    else if (metricsParam) q.push(metricsParam);
    try {
      const r = await ctx.api(`${base}/metrics${q.length ? `?${q.join('&')}` : ''}`);
      return arr(r && r.metrics);
    } catch (e) {
      if (e.status === 400 && after === null && metricsParam === 'max_points=2000') {
        metricsParam = 'limit=100000'; // a server without max_points
        return fetchMetrics(after, rank);
      }
      throw e;
    }
  }
  // A server that answers rank=-1 with every rank (treating it as "all") makes the evaluation query a window.
  let evalRankIgnored = false;
  async function pollMetrics() {
    const ranks = ranksOf(train);
    const after = ranks.length ? Math.min(...ranks.map((r) => train.get(r).lastX)) : null;
    const rows = await fetchMetrics(after);
    // Evaluation rows come sparse and may be stored after later training steps: ask for them apart.
    let evRows = [];
    if (after !== null) {
      const evAfter = evals.length ? evals.lastX : -1;
      evRows = await fetchMetrics(evalRankIgnored ? Math.max(evAfter, after - 2000) : evAfter, -1).catch(() => []);
      if (evRows.some((r) => r && num(r.rank) !== null && r.rank >= 0)) evalRankIgnored = true;
      evRows = evRows.filter((r) => r && num(r.rank) !== null && r.rank < 0);
    }
    addMetrics(rows.concat(evRows));
    if (rows.length || evRows.length) redraw();
  }
  async function pollSamples() {
    if (samplesMissing) return;
    const times = ranksOf(samples).map((r) => samples.get(r).lastX);
    const after = times.length ? Math.min(...times) : null;
    try {
      const r = await ctx.api(`${base}/samples${after === null ? '?max_points=2000' : `?after=${after}`}`);
      const rows = arr(r && r.samples);
      addSamples(rows);
      if (rows.length) redrawSamples();
    } catch (e) {
      if (e.status === 404 || e.status === 405 || e.status === 400) {
        samplesMissing = true;
        for (const c of samplesCards.slice(0, 3)) c.querySelector('.placeholder').textContent = `${DASH} no resource samples from this server`;
        return;
      }
      throw e;
    }
  }
  let polling = null;
  let stream = null;
  let finished = false;
  function startPolling(why) {
    if (polling || ctx.stopped) return;
    live.className = 'live poll';
    live.textContent = finished ? 'finished' : `polling every ${POLL_MS / 1000} s`;
    live.title = why || '';
    polling = ctx.every(POLL_MS, async () => {
      await refreshJob();
      await Promise.all([pollMetrics(), pollSamples(), loadLog()]);
      ctx.clearError();
      if (finished) polling.stop();
    });
  }
  // The job is over: one last catch-up, then no more stream or polling.
  function finish() {
    if (finished) return;
    finished = true;
    live.className = 'live';
    live.textContent = 'finished';
    if (stream) {
      stream.close();
      stream = null;
      Promise.all([pollMetrics(), pollSamples(), loadLog(), loadDiagnosis()]).catch((e) => ctx.report(e));
    }
  }

  try {
    job = await ctx.api(base);
  } catch (e) {
    if (e.status === 404) {
      fill(root, ctx.errorBox, h('div', { class: 'card' }, h('h1', null, `No job ${id}`), h('p', null, str(e.message), '. ', h('a', { href: '#/jobs' }, 'All jobs'), '.')));
      return;
    }
    throw e;
  }
  lastAttempt = num(job.attempt);
  renderHead();
  renderStats();
  loadLog().catch((e) => ctx.report(e));
  ctx.every(15000, async () => {
    if (!finished || diagBox.querySelector('.empty')) await loadDiagnosis();
  });

  if (FINAL.has(stateOf(job))) {
    finished = true;
    live.textContent = 'finished';
    await Promise.all([pollMetrics(), pollSamples()]);
    return;
  }
  stream = openStream(ctx, `${base}/stream`, {
    job: (j) => {
      live.className = 'live on';
      live.textContent = 'live';
      setJob(j);
    },
    metrics: (d) => {
      addMetrics(d && d.metrics);
      redraw();
    },
    samples: (d) => {
      addSamples(d && d.samples);
      redrawSamples();
    },
    log: (d) => {
      // new output: fetch it by offset (exact bytes, whatever rank is shown)
      if (!d || num(d.rank) === null || num(d.rank) === log.rank) logSoon();
    },
  }, (why) => {
    stream = null;
    startPolling(why);
  });
  // log events come for rank 0 only (and may not come at all): poll the shown rank's log as well
  ctx.every(POLL_MS, async () => {
    if (!polling && !finished) await loadLog();
  }, true);
}

// ------------------------------------------------------------------------------------------------------------
// start

window.addEventListener('hashchange', () => {
  takeTokenFromHash();
  route();
});
takeTokenFromHash();
if (!token) token = storedToken();
route();
