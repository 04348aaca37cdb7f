#!/usr/bin/env node
// Opens the Shoal dashboard in headless Chromium and checks that the loss chart draws and grows, without console
// errors, page errors or failed requests; saves a full-page screenshot.
//
//   node scripts/dashboard-check.mjs URL SCREENSHOT.png [timeout_s]
//
// URL includes the token and the job route, e.g. http://127.0.0.1:7733/#token=TOKEN&/jobs/j-0123abcd.
// playwright-core is found through NODE_PATH, or SHOAL_PLAYWRIGHT_NODE_MODULES (the line that
// scripts/test-browser.sh prints); the browser is SHOAL_CHROMIUM (default /usr/bin/chromium).
//
// Prints one JSON report on stdout:
//   {"points": n, "points_later": m, "grew": bool|null, "job_state": "...", "console_errors": [...],
//    "page_errors": [...], "failed_requests": [...], "screenshot": "...", "elapsed_s": x, "memory_ranks": n,
//    "rounds": {"shown": bool, "points": n, "rows": n}}
// and exits 1 when there were console errors, page errors or failed requests, or no point was drawn within
// timeout_s (default 60), or the points did not grow while the job was running; 2 on bad usage or when the
// browser cannot start. Progress goes to stderr.

import { createRequire } from 'node:module';
import { mkdtempSync, rmSync, mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';

const log = (...a) => console.error('dashboard-check:', ...a);
const [url, shotArg, timeoutArg] = process.argv.slice(2);
if (!url || !shotArg) {
  log('usage: node scripts/dashboard-check.mjs URL SCREENSHOT.png [timeout_s]');
  process.exit(2);
}
const timeoutS = timeoutArg === undefined ? 60 : Number(timeoutArg);
if (!Number.isFinite(timeoutS) || timeoutS <= 0) {
  log(`timeout_s must be a positive number of seconds, not ${JSON.stringify(timeoutArg)}`);
  process.exit(2);
}
const shot = resolve(shotArg);
const started = Date.now();
const left = () => Math.max(1000, started + timeoutS * 1000 - Date.now());

function loadPlaywright() {
  const require = createRequire(import.meta.url);
  const dirs = [process.env.SHOAL_PLAYWRIGHT_NODE_MODULES, ...(process.env.NODE_PATH || '').split(':')].filter(Boolean);
  for (const d of dirs) {
    try {
      return require(join(d, 'playwright-core'));
    } catch {
      // next
    }
  }
  try {
    return require('playwright-core');
  } catch {
    log('cannot find playwright-core: run scripts/test-browser.sh and pass the directory it prints as NODE_PATH or SHOAL_PLAYWRIGHT_NODE_MODULES');
    process.exit(2);
  }
}

const { chromium } = loadPlaywright();
const profile = mkdtempSync(join(tmpdir(), 'shoal-chromium-'));
const consoleErrors = [];
const pageErrors = [];
const failedRequests = [];
const report = { points: 0, points_later: 0, grew: null, job_state: null, console_errors: consoleErrors, page_errors: pageErrors, failed_requests: failedRequests, screenshot: shot, elapsed_s: 0 };
let context = null;
let failure = null;
let closing = false;

const points = (page) => page.evaluate(() => {
  const el = document.getElementById('loss-chart');
  const v = el ? Number(el.getAttribute('data-points')) : NaN;
  return Number.isFinite(v) ? v : 0;
});
const jobState = (page) => page.evaluate(() => {
  const b = document.querySelector('.job-head .title .badge');
  return b ? b.textContent : null;
});

try {
  try {
    context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.SHOAL_CHROMIUM || '/usr/bin/chromium',
      headless: true,
      chromiumSandbox: false,
      viewport: { width: 1440, height: 900 },
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
        '--disable-component-update', '--disable-sync'],
      timeout: 60000,
    });
  } catch (e) {
    log(`cannot start Chromium: ${e.message}`);
    rmSync(profile, { recursive: true, force: true });
    process.exit(2);
  }
  const page = context.pages()[0] || (await context.newPage());
  page.on('console', (m) => {
    if (m.type() === 'error') {
      const loc = m.location();
      consoleErrors.push(`${m.text()}${loc && loc.url ? ` (${loc.url}:${loc.lineNumber})` : ''}`);
    }
  });
  page.on('pageerror', (e) => pageErrors.push(String(e && e.stack ? e.stack : e)));
  page.on('requestfailed', (r) => {
    const why = r.failure() ? r.failure().errorText : 'failed';
    // Leaving the page aborts its open EventSource and fetches: not a failure of the page.
    if (why === 'net::ERR_ABORTED' && closing) return;
    failedRequests.push(`${r.method()} ${r.url().replace(/access_token=[^&]+/, 'access_token=…')}: ${why}`);
  });
  page.on('response', (r) => {
    if (r.status() >= 400) failedRequests.push(`${r.request().method()} ${r.url().replace(/access_token=[^&]+/, 'access_token=…')}: HTTP ${r.status()}`);
  });

  log(`opening ${url.replace(/token=[^&]+/, 'token=…')}`);
  await page.goto(url, { waitUntil: 'load', timeout: left() });
  try {
    await page.waitForFunction(() => {
      const el = document.getElementById('loss-chart');
      return el && Number(el.getAttribute('data-points')) >= 1;
    }, null, { timeout: left(), polling: 250 });
  } catch {
    const body = await page.evaluate(() => document.body.innerText.slice(0, 600)).catch(() => '');
    failure = `the loss chart (#loss-chart[data-points]) drew no point within ${timeoutS} s; the page says: ${JSON.stringify(body)}`;
  }
  report.points = await points(page);
  report.job_state = await jobState(page);
  // The memory card: one bar per rank whose metrics say what it holds.
  report.memory_ranks = await page.evaluate(() => document.querySelectorAll('#memory-bars .bar-row').length).catch(() => -1);
  // The federated rounds card: shown only for a federated job; its chart's points and its table's rows.
  const rounds = () => page.evaluate(() => {
    const el = document.getElementById('rounds-chart');
    const card = el && el.closest('section');
    return {
      shown: Boolean(card && !card.hidden),
      points: el ? Number(el.getAttribute('data-points')) || 0 : 0,
      rows: document.querySelectorAll('#rounds-table tbody tr').length,
    };
  }).catch(() => null);
  log(`loss chart has ${report.points} point(s); job ${report.job_state}`);
  if (!failure) {
    // Live updates: while the job runs, more points should arrive without a reload.
    const wait = Math.min(15000, Math.max(0, left() - 5000));
    if (report.job_state === 'running' && wait > 0) {
      const t0 = Date.now();
      while (Date.now() - t0 < wait) {
        await page.waitForTimeout(500);
        if ((await points(page)) > report.points) break;
      }
      report.points_later = await points(page);
      report.grew = report.points_later > report.points;
      if (!report.grew && (await jobState(page)) === 'running') {
        failure = `the loss chart stayed at ${report.points} point(s) for ${(wait / 1000).toFixed(0)} s while the job was running`;
      }
    } else {
      await page.waitForTimeout(1500);
      report.points_later = await points(page);
    }
    // Let charts that came with the same events settle before the picture.
    await page.waitForTimeout(2500);
    report.rounds = await rounds();
  }
  mkdirSync(dirname(shot), { recursive: true });
  await page.screenshot({ path: shot, fullPage: true });
  closing = true;
} catch (e) {
  failure = `browser check failed: ${e && e.message ? e.message : e}`;
} finally {
  if (context) await context.close().catch(() => {});
  rmSync(profile, { recursive: true, force: true });
}

report.elapsed_s = Math.round((Date.now() - started) / 100) / 10;
// At most 20 of each kind in the report (a dead server makes hundreds).
const cap = (a) => (a.length > 20 ? [...a.slice(0, 20), `… and ${a.length - 20} more`] : a);
report.console_errors = cap(consoleErrors);
report.page_errors = cap(pageErrors);
report.failed_requests = cap(failedRequests);
console.log(JSON.stringify(report));
const problems = [];
if (failure) problems.push(failure);
if (report.points < 1 && !failure) problems.push('no point on the loss chart');
if (consoleErrors.length) problems.push(`${consoleErrors.length} console error(s): ${report.console_errors.join(' | ')}`);
if (pageErrors.length) problems.push(`${pageErrors.length} page error(s): ${report.page_errors.join(' | ')}`);
if (failedRequests.length) problems.push(`${failedRequests.length} failed request(s): ${report.failed_requests.join(' | ')}`);
for (const p of problems) log(p);
process.exit(problems.length ? 1 : 0);
