// infergate live dashboard: polls dashboard/state.json (gateway/README.md,
// "Dashboards") and renders it with plain DOM and SVG. Every value from the
// state is inserted as text (textContent), never as markup.
(function () {
  'use strict';

  var STATE_URL = new URL('dashboard/state.json', location.href).href;
  var POLL_MS = 2000;
  var HISTORY_MS = 10 * 60 * 1000; // what the charts keep
  var KEY_STORE = 'infergate.dashboard.key';
  var COLORS = ['#58a6ff', '#f0883e', '#3fb950', '#f778ba', '#a371f7', '#e3b341', '#39c5cf', '#ff7b72',
    '#7ee787', '#d2a8ff', '#ffa657', '#79c0ff'];
  var SVGNS = 'http://www.w3.org/2000/svg';

  var history = []; // {t, ttft: {p50,p90,p99}|null, inflight: {ep: n}, hit: {ep: rate}}
  var colorOf = {}; // endpoint → color, stable for the page's life
  var timer = null;

  // --- DOM helpers -------------------------------------------------------

  function el(tag, attrs) {
    var e = document.createElement(tag);
    setAttrs(e, attrs);
    for (var i = 2; i < arguments.length; i++) append(e, arguments[i]);
    return e;
  }
  function svg(tag, attrs) {
    var e = document.createElementNS(SVGNS, tag);
    setAttrs(e, attrs);
    for (var i = 2; i < arguments.length; i++) append(e, arguments[i]);
    return e;
  }
  function setAttrs(e, attrs) {
    if (!attrs) return;
    Object.keys(attrs).forEach(function (k) {
      if (attrs[k] === null || attrs[k] === undefined) return;
      if (k === 'text') e.textContent = String(attrs[k]);
      else e.setAttribute(k, String(attrs[k]));
    });
  }
  function append(e, c) {
    if (c === null || c === undefined || c === false) return;
    if (Array.isArray(c)) { c.forEach(function (x) { append(e, x); }); return; }
    e.appendChild(typeof c === 'object' ? c : document.createTextNode(String(c)));
  }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); }
  function $(id) { return document.getElementById(id); }

  // --- formatting --------------------------------------------------------

  var intFmt = new Intl.NumberFormat('en-US', { maximumFractionDigits: 0 });
  function fmtInt(v) { return intFmt.format(Math.round(v || 0)); }
  function fmtCompact(v) {
    v = v || 0;
    var a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + 'G';
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + 'M';
    if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + 'k';
    return fmtInt(v);
  }
  function fmtDur(s) {
    if (s === null || s === undefined) return '–';
    if (s === 0) return '0';
    if (s < 0.001) return (s * 1e6).toFixed(0) + ' µs';
    if (s < 0.01) return (s * 1e3).toFixed(2) + ' ms';
    if (s < 1) return (s * 1e3).toFixed(s < 0.1 ? 1 : 0) + ' ms';
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + ' s';
    return (s / 60).toFixed(1) + ' min';
  }
  // fmtTail is "p90 47.3 · p99 83.9 ms": the unit once when both share it.
  function fmtTail(x) {
    var a = fmtDur(q(x, 'p90')), b = fmtDur(q(x, 'p99'));
    var ua = a.split(' ')[1], ub = b.split(' ')[1];
    if (ua && ua === ub) a = a.split(' ')[0];
    return 'p90 ' + a + ' · p99 ' + b;
  }
  function fmtPct(r) { return r === null || r === undefined ? '–' : (r * 100).toFixed(1) + '%'; }
  function fmtRate(v) { return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2); }
  function q(x, k) { return x ? x[k] : null; }

  function color(ep) {
    if (!colorOf[ep]) colorOf[ep] = COLORS[Object.keys(colorOf).length % COLORS.length];
    return colorOf[ep];
  }

  function bar(frac, cls) {
    var inner = el('span');
    inner.style.width = Math.max(0, Math.min(1, frac || 0)) * 100 + '%';
    return el('span', { class: 'bar' + (cls ? ' ' + cls : '') }, inner);
  }

  // --- fetching ----------------------------------------------------------

  function poll() {
    var headers = { Accept: 'application/json' };
    var key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = 'Bearer ' + key;
    fetch(STATE_URL, { headers: headers, cache: 'no-store', credentials: 'omit' }).then(function (r) {
      if (r.status === 401) { needKey(key ? 'That key was refused.' : ''); return null; }
      if (!r.ok) throw new Error('HTTP ' + r.status);
      return r.json();
    }).then(function (st) {
      if (!st) return;
      $('auth').hidden = true;
      render(st);
    }).catch(function (err) {
      status('pill-bad', 'disconnected');
      $('meta').textContent = 'cannot read ' + STATE_URL + ': ' + err.message + ' (retrying)';
    }).then(schedule, schedule);
  }
  function schedule() {
    if (timer) clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }
  function needKey(msg) {
    $('auth').hidden = false;
    $('auth-error').textContent = msg;
    status('pill-warn', 'key required');
  }
  $('auth-form').addEventListener('submit', function (ev) {
    ev.preventDefault();
    var k = $('auth-key').value.trim();
    if (k) sessionStorage.setItem(KEY_STORE, k);
    else sessionStorage.removeItem(KEY_STORE);
    poll();
  });
  function status(cls, text) {
    var s = $('status');
    s.className = 'pill ' + cls;
    s.textContent = text;
  }

  // --- rendering ---------------------------------------------------------

  function render(st) {
    var f = st.fleet;
    if (st.draining) status('pill-warn', 'draining');
    else if (f.ready === 0) status('pill-bad', 'no endpoint ready');
    else if (f.ready < f.endpoints) status('pill-warn', 'degraded');
    else status('pill-ok', 'serving');
    var meta = $('meta');
    clear(meta);
    append(meta, ['policy ', el('b', { text: st.policy }), ' · up ', el('b', { text: fmtUptime(st) }),
      ' · window ', el('b', { text: Math.round(st.window_seconds) + ' s' }),
      ' · updated ', el('b', { text: new Date(st.time).toLocaleTimeString('en-GB') })]);

    record(st);
    renderCards(st);
    renderCharts();
    renderPools(st);
  }

  function fmtUptime(st) {
    var s = Math.max(0, (Date.parse(st.time) - Date.parse(st.started)) / 1000);
    if (s < 120) return Math.round(s) + ' s';
    if (s < 7200) return Math.round(s / 60) + ' min';
    if (s < 172800) return (s / 3600).toFixed(1) + ' h';
    return (s / 86400).toFixed(1) + ' d';
  }

  function card(label, value, unit, sub, cls, field) {
    return el('div', { class: 'card' + (cls ? ' ' + cls : ''), 'data-card': field },
      el('div', { class: 'label', text: label }),
      el('div', { class: 'value' }, el('span', { 'data-field': field, text: value }), unit ? el('small', { text: ' ' + unit }) : null),
      el('div', { class: 'sub', text: sub || '\u00a0' }));
  }

  function renderCards(st) {
    var f = st.fleet, r = f.recent, t = f.total;
    var cards = $('cards');
    clear(cards);
    var readyCls = f.ready === f.endpoints ? 'ok' : f.ready === 0 ? 'bad' : 'warn';
    var errRate = r.requests > 0 ? r.errors / r.requests : 0;
    append(cards, [
      card('Endpoints ready', f.ready + ' / ' + f.endpoints, '', (f.ejected ? f.ejected + ' ejected' : 'none ejected') + ' · ' + fmtInt(f.ejections) + ' ejections', readyCls, 'fleet-ready'),
      card('In flight', fmtInt(f.in_flight), 'req', fmtInt(f.queue_length) + ' queued', f.queue_length > 0 ? 'warn' : '', 'fleet-in-flight'),
      card('Requests', fmtRate(r.requests_per_second), '/s', fmtInt(t.requests) + ' total', '', 'fleet-rps'),
      card('Errors (5xx)', fmtPct(errRate), '', fmtInt(r.errors) + ' recent · ' + fmtInt(r.client_errors || 0) + ' client (4xx) · ' + fmtInt(t.retries) + ' retries', errRate > 0.05 ? 'bad' : errRate > 0 ? 'warn' : '', 'fleet-errors'),
      card('Cache hit rate', fmtPct(r.cache_hit_rate), '', fmtPct(t.cache_hit_rate) + ' total', '', 'fleet-hit'),
      card('TTFT p50', fmtDur(q(r.ttft_seconds, 'p50')), '', fmtTail(r.ttft_seconds), '', 'fleet-ttft-p50'),
      card('ITL p50', fmtDur(q(r.itl_seconds, 'p50')), '', fmtTail(r.itl_seconds), '', 'fleet-itl-p50')
    ]);
  }

  function record(st) {
    var now = Date.now(); // the page's clock: the charts' axis is the page's own
    var h = { t: now, ttft: st.fleet.recent.ttft_seconds, inflight: {}, hit: {} };
    st.pools.forEach(function (p) {
      p.endpoints.forEach(function (e) {
        h.inflight[e.endpoint] = e.in_flight; // engine-wide: the same in every pool
        var rr = e.recent;
        if (rr.cache_hit_rate !== null) {
          var prev = h.hit[e.endpoint];
          // Several pools on one engine: weight by prompt tokens.
          h.hit[e.endpoint] = prev ? { c: prev.c + rr.cached_tokens, p: prev.p + rr.prompt_tokens }
            : { c: rr.cached_tokens, p: rr.prompt_tokens };
        }
        color(e.endpoint);
      });
    });
    Object.keys(h.hit).forEach(function (k) { h.hit[k] = h.hit[k].p > 0 ? h.hit[k].c / h.hit[k].p : null; });
    history.push(h);
    while (history.length && history[0].t < now - HISTORY_MS) history.shift();
  }

  function renderCharts() {
    var ttft = [['p50', '#3fb950'], ['p90', '#e3b341'], ['p99', '#f85149']].map(function (s) {
      return { name: s[0], color: s[1], points: history.map(function (h) { return [h.t, h.ttft ? h.ttft[s[0]] : null]; }) };
    });
    chart($('chart-ttft'), $('legend-ttft'), ttft, fmtDur, null);
    var eps = Object.keys(colorOf);
    chart($('chart-inflight'), $('legend-inflight'), eps.map(function (ep) {
      return { name: ep, color: color(ep), points: history.map(function (h) { return [h.t, ep in h.inflight ? h.inflight[ep] : null]; }) };
    }), function (v) { return fmtCompact(v); }, null, true);
    chart($('chart-hit'), $('legend-hit'), eps.map(function (ep) {
      return { name: ep, color: color(ep), points: history.map(function (h) { return [h.t, ep in h.hit ? h.hit[ep] : null]; }) };
    }), function (v) { return Math.round(v * 100) + '%'; }, 1);
  }

  // chart draws line series [{name, color, points: [[t, v|null]]}] into an
  // SVG sized by CSS, with a y axis from 0 to yMax (null: the data's max;
  // integer: whole-number ticks).
  function chart(node, legend, series, yFmt, yMax, integer) {
    var W = Math.max(node.clientWidth || 0, 300), H = Math.max(node.clientHeight || 0, 120);
    node.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
    clear(node);
    var L = 54, R = 10, T = 8, B = 20;
    var t1 = history.length ? history[history.length - 1].t : Date.now();
    var t0 = Math.min(history.length ? history[0].t : t1, t1 - 60000);
    var top = 0;
    series.forEach(function (s) { s.points.forEach(function (p) { if (p[1] !== null && p[1] > top) top = p[1]; }); });
    if (yMax !== null) top = yMax;
    var empty = top === 0 && !series.some(function (s) { return s.points.some(function (p) { return p[1] !== null; }); });
    top = niceCeil(top || 1);
    if (integer) top = Math.max(4, Math.ceil(top / 4) * 4); // whole-number ticks
    function x(t) { return L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0); }
    function y(v) { return T + (H - T - B) * (1 - v / top); }
    for (var i = 0; i <= 4; i++) {
      var v = top * i / 4, yy = y(v);
      append(node, svg('line', { class: 'grid', x1: L, x2: W - R, y1: yy, y2: yy }));
      append(node, svg('text', { x: L - 6, y: yy + 3, 'text-anchor': 'end', text: yFmt(v) }));
    }
    append(node, svg('text', { x: L, y: H - 5, text: '−' + Math.round((t1 - t0) / 60000 * 10) / 10 + ' min' }));
    append(node, svg('text', { x: W - R, y: H - 5, 'text-anchor': 'end', text: 'now' }));
    if (empty) append(node, svg('text', { class: 'empty', x: (L + W - R) / 2, y: H / 2, 'text-anchor': 'middle', text: 'no data yet' }));
    series.forEach(function (s) {
      var d = '', pen = false, last = null;
      s.points.forEach(function (p) {
        if (p[1] === null || p[1] === undefined) { pen = false; return; }
        d += (pen ? 'L' : 'M') + x(p[0]).toFixed(1) + ' ' + y(Math.min(p[1], top)).toFixed(1);
        pen = true;
        last = p;
      });
      if (d) append(node, svg('path', { d: d, fill: 'none', stroke: s.color, 'stroke-width': 2, 'stroke-linejoin': 'round' }));
      if (last) append(node, svg('circle', { cx: x(last[0]), cy: y(Math.min(last[1], top)), r: 3, fill: s.color }));
    });
    clear(legend);
    series.forEach(function (s) {
      var sw = el('i');
      sw.style.background = s.color;
      var lastV = null;
      for (var i = s.points.length - 1; i >= 0; i--) if (s.points[i][1] !== null && s.points[i][1] !== undefined) { lastV = s.points[i][1]; break; }
      append(legend, el('span', null, sw, s.name + (lastV !== null ? ' ' + yFmt(lastV) : '')));
    });
  }
  function niceCeil(v) {
    var p = Math.pow(10, Math.floor(Math.log10(v))), m = v / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
  }

  var COLUMNS = ['Endpoint', 'State', 'In flight', 'Tokens in flight', 'Prefill backlog', 'Engine run / wait',
    'KV used', 'Hit rate 1 min · total', 'TTFT p50 · p90', 'Requests', 'Errors (5xx)', 'Ejections'];

  function renderPools(st) {
    var root = $('pools');
    clear(root);
    st.pools.forEach(function (p) {
      var maxIn = 1;
      p.endpoints.forEach(function (e) { maxIn = Math.max(maxIn, e.in_flight); });
      var rej = 0;
      Object.keys(p.rejections || {}).forEach(function (k) { rej += p.rejections[k]; });
      var head = el('div', { class: 'pool-head' },
        el('h2', { 'data-field': 'model', text: p.model }),
        chip('admitted', fmtInt(p.admitted) + ' / ' + fmtCompact(p.max_in_flight)),
        chip('queue', fmtInt(p.queue_length) + (p.max_queue >= 0 ? ' / ' + fmtCompact(p.max_queue) : ' (no queue)')),
        chip('queue wait p90', fmtDur(q(p.queue_wait_seconds, 'p90'))),
        chip('rejected', fmtInt(rej)),
        chip('requests', fmtRate(p.recent.requests_per_second) + '/s'),
        chip('hit rate', fmtPct(p.recent.cache_hit_rate)),
        chip('TTFT p90', fmtDur(q(p.recent.ttft_seconds, 'p90'))),
        chip('e2e p90', fmtDur(q(p.recent.e2e_seconds, 'p90'))));
      var thead = el('thead', null, el('tr', null, COLUMNS.map(function (c) { return el('th', { text: c }); })));
      var tbody = el('tbody');
      p.endpoints.forEach(function (e) { append(tbody, row(e, maxIn)); });
      append(root, el('section', { class: 'panel pool', 'data-model': p.model }, head,
        el('div', { class: 'table-wrap' }, el('table', null, thead, tbody))));
    });
  }
  function chip(label, value) { return el('span', { class: 'chip' }, label + ' ', el('b', { text: value })); }

  function row(e, maxIn) {
    var stateCls = e.state === 'ready' ? 'pill-ok' : e.state === 'ejected' ? 'pill-bad' : 'pill-warn';
    var stateText = e.state;
    if (e.ejected_until) stateText += ' until ' + new Date(e.ejected_until).toLocaleTimeString('en-GB');
    var dot = el('i');
    dot.style.background = color(e.endpoint);
    var eng = e.engine;
    var kv = eng && eng.kv_utilization !== null ? eng.kv_utilization : null;
    function td(field, content, cls) { return el('td', { 'data-field': field, class: cls || null }, content); }
    return el('tr', { 'data-endpoint': e.endpoint },
      td('endpoint', [dot, e.endpoint, el('span', { class: 'muted', text: ' ' + e.kind })], 'ep'),
      td('state', el('span', { class: 'pill ' + stateCls, text: stateText })),
      td('in-flight', [fmtInt(e.in_flight), bar(e.in_flight / maxIn)]),
      td('in-flight-tokens', fmtCompact(e.in_flight_tokens)),
      td('prefill-backlog', fmtCompact(e.prefill_backlog_tokens)),
      td('engine-queue', eng ? fmtInt(eng.running) + ' / ' + fmtInt(eng.waiting) : el('span', { class: 'muted', text: 'not scraped' })),
      td('kv', kv === null ? el('span', { class: 'muted', text: '–' }) : [fmtPct(kv), bar(kv, 'kv')]),
      el('td', null, el('span', { 'data-field': 'hit-recent', text: fmtPct(e.recent.cache_hit_rate) }),
        bar(e.recent.cache_hit_rate, 'hit'), el('span', { class: 'muted', 'data-field': 'hit-total', text: ' ' + fmtPct(e.total.cache_hit_rate) })),
      el('td', null, el('span', { 'data-field': 'ttft-p50', text: fmtDur(q(e.recent.ttft_seconds, 'p50')) }),
        el('span', { class: 'muted', text: ' · ' }), el('span', { 'data-field': 'ttft-p90', text: fmtDur(q(e.recent.ttft_seconds, 'p90')) })),
      td('requests', fmtInt(e.total.requests)),
      td('errors', e.total.errors > 0 ? el('span', { class: 'bad-text', text: fmtInt(e.total.errors) }) : '0'),
      td('ejections', e.ejections > 0 ? el('span', { class: 'bad-text', text: fmtInt(e.ejections) }) : '0'));
  }

  window.addEventListener('resize', function () { if (history.length) renderCharts(); });
  poll();
})();
