// powerd's live page: reads the admin API with a bearer token, redraws every tick.
// No library, no build step; every string from the API goes into the page as text
// (textContent), never as HTML: node and GPU names come from the fleet.
'use strict';

(() => {
  const BASE = location.pathname.replace(/\/ui\/?$/, '');
  const KEY = 'powerd.token';
  const HISTORY_EVERY_MS = 10000;
  const STRUCTURE_EVERY_MS = 60000;
  const PAGE = 1000;
  // Up to this many nodes every rack starts open; above, racks open on a click, and only
  // the open racks' nodes are read each tick (a large site's page stays light on the
  // controller). `#racks=open` or `#racks=closed` in the link decides instead.
  const SMALL_SITE_NODES = 64;
  const state = {
    token: null,
    timer: null,
    open: new Set(), // nodes whose GPUs are shown
    history: null,
    historyAt: 0,
    tickS: 1,
    lastTick: null,
    inflight: false,
    again: false,
    structure: null, // {key, at, nodes}: where each node sits (changes with the policy)
    racksMode: null, // 'open' | 'closed' from the link, else by the site's size
    racksToggled: new Set(),
  };

  class AuthError extends Error {}

  const $ = (id) => document.getElementById(id);

  // h('div', {class: 'x', 'data-a': 1}, child, 'text', ...): an element; strings become text.
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'style') Object.assign(el.style, v);
      else el.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function fmtW(w) {
    if (w === null || w === undefined || !Number.isFinite(w)) return '-';
    const a = Math.abs(w);
    if (a < 10000) return `${Math.round(w)} W`;
    if (a < 1e6) return `${(w / 1e3).toFixed(1)} kW`;
    return `${(w / 1e6).toFixed(2)} MW`;
  }

  function fmtNum(x, digits = 1) {
    return x === null || x === undefined || !Number.isFinite(x) ? '-' : x.toFixed(digits);
  }

  // Headroom under the budget, by measured draw: what an operator needs to see first.
  function headroomClass(budget, committed, draw, over) {
    if (over) return 'h-over';
    if (budget === null || budget === undefined || budget <= 0) return 'h-ok';
    const left = (budget - draw) / budget;
    if (left < 0) return 'h-over';
    if (left < 0.05) return 'h-tight';
    if (left < 0.15) return 'h-warn';
    return 'h-ok';
  }

  function bar(budget, committed, draw, over, gpuMax) {
    // A GPU's bar spans its range up to its maximum cap, the mark at its cap: a GPU drawing
    // its cap is normal (the cap is doing its work), so it is not coloured as a warning.
    const scale = Math.max(gpuMax || budget || 0, committed || 0, draw || 0, 1);
    const pct = (x) => `${Math.max(0, Math.min(100, (100 * (x || 0)) / scale)).toFixed(2)}%`;
    const cls = gpuMax ? 'gpu' : headroomClass(budget, committed, draw, over);
    return h('div', { class: `bar ${cls}` },
      h('div', { class: 'fill', style: { width: pct(draw) } }),
      committed === null || committed === undefined ? null
        : h('div', { class: 'mark', style: { left: pct(committed) } }));
  }

  // ---- the token ----

  function takeFragmentToken() {
    const racks = /(?:^#|&)racks=(open|closed)(?:&|$)/.exec(location.hash);
    if (racks) state.racksMode = racks[1];
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (!m) return;
    // Out of the address bar: not bookmarked by accident, not in a screenshot; first, so a
    // token that cannot be decoded (a link cut short) does not stay there either.
    history.replaceState(null, '', location.pathname + location.search);
    let token;
    try {
      token = decodeURIComponent(m[1]);
    } catch (e) {
      token = m[1];  // a broken escape: sent as it is, and refused like any wrong token
    }
    try {
      sessionStorage.setItem(KEY, token);
    } catch (e) {
      state.token = token;
    }
  }

  function storedToken() {
    try {
      return sessionStorage.getItem(KEY) || state.token;
    } catch (e) {
      return state.token;
    }
  }

  function forget() {
    state.token = null;
    try { sessionStorage.removeItem(KEY); } catch (e) { /* private mode */ }
  }

  async function api(path) {
    const r = await fetch(BASE + path, {
      headers: { Authorization: `Bearer ${state.token}`, Accept: 'application/json' },
      cache: 'no-store',
      credentials: 'omit',
    });
    if (r.status === 401 || r.status === 403) {
      let detail = `HTTP ${r.status}`;
      try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
      throw new AuthError(detail);
    }
    if (!r.ok) {
      let detail = `HTTP ${r.status}`;
      try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
      throw new Error(`${path}: ${detail}`);
    }
    return r.json();
  }

  async function all(path) {
    const sep = path.includes('?') ? '&' : '?';
    let items = [];
    for (let offset = 0; offset < 100 * PAGE; offset += PAGE) {
      const page = await api(`${path}${sep}limit=${PAGE}&offset=${offset}`);
      items = items.concat(page.items);
      if (items.length >= page.total || page.items.length === 0) break;
    }
    return items;
  }

  function showSignIn(message) {
    clearTimeout(state.timer);
    $('app').hidden = true;
    $('sign-out').hidden = true;
    $('signin').hidden = false;
    $('signin-error').textContent = message || '';
    $('status-line').textContent = '';
    $('token').focus();
  }

  function showApp() {
    $('signin').hidden = true;
    $('app').hidden = false;
    $('sign-out').hidden = false;
  }

  // ---- one refresh ----

  async function refresh() {
    clearTimeout(state.timer);
    if (state.inflight) { state.again = true; return; }
    state.inflight = true;
    try {
      await refreshOnce();
    } finally {
      state.inflight = false;
    }
    if (state.again) { state.again = false; refresh(); }
  }

  async function refreshOnce() {
    try {
      const now = Date.now();
      const wantHistory = now - state.historyAt > HISTORY_EVERY_MS;
      const [fleet, levels, alarms, history] = await Promise.all([
        api('/api/v1/fleet'),
        Promise.all(['facility', 'row', 'rack'].map((l) => all(`/api/v1/groups?level=${l}`))),
        api('/api/v1/alarms'),
        wantHistory ? api('/api/v1/history/facility?window_s=3600&points=360').catch((e) => {
          if (e instanceof AuthError) throw e;
          return null; // no store, or it is down: the rest of the page still works
        }) : Promise.resolve(state.history),
      ]);
      const groups = levels.flat();
      const nodes = await readNodes(fleet, now);
      const visible = new Set(nodes.filter((n) => !n.rack || rackOpen(n.rack, nodes.length))
        .map((n) => n.name));
      const open = [...state.open].filter((n) => visible.has(n));
      const gpuLists = await Promise.all(
        open.map((n) => all(`/api/v1/gpus?node=${encodeURIComponent(n)}`)));
      const gpus = new Map(open.map((n, i) => [n, gpuLists[i]]));
      if (wantHistory) { state.history = history; state.historyAt = now; }
      showApp();
      render(fleet, groups, nodes, alarms, gpus);
      if (state.history) renderChart(state.history, fleet);
      state.tickS = fleet.tick_s || 1;
    } catch (e) {
      if (e instanceof AuthError) {
        forget();
        showSignIn(`The controller refused the token: ${e.message}`);
        return;
      }
      const line = $('status-line');
      line.className = 'error';
      line.textContent = `cannot reach the controller: ${e.message}; retrying`;
    }
    // Every tick, but not faster than twice a second nor slower than every 10 s.
    const ms = Math.min(10000, Math.max(500, 1000 * state.tickS));
    clearTimeout(state.timer);
    state.timer = setTimeout(refresh, ms);
  }

  function rackOpen(rack, total) {
    const base = state.racksMode ? state.racksMode === 'open' : total <= SMALL_SITE_NODES;
    return state.racksToggled.has(rack) ? !base : base;
  }

  // The nodes with this tick's numbers: all of them while every rack is open (or where
  // the tree must be learnt again), else those of the open racks, read rack by rack.
  async function readNodes(fleet, now) {
    const key = `${fleet.policy_version}/${fleet.policy_source}/${fleet.nodes}`;
    const known = state.structure;
    const fresh = known && known.key === key && now - known.at < STRUCTURE_EVERY_MS;
    const racks = fresh ? [...new Set(known.nodes.map((n) => n.rack))] : [];
    const total = fresh ? known.nodes.length : 0;
    if (!fresh || racks.some((r) => !r) || racks.every((r) => rackOpen(r, total))) {
      const nodes = await all('/api/v1/nodes');
      state.structure = { key, at: fresh ? known.at : now, nodes };
      return nodes;
    }
    const open = racks.filter((r) => r && rackOpen(r, total));
    const lists = await Promise.all(
      open.map((r) => all(`/api/v1/nodes?rack=${encodeURIComponent(r)}`)));
    const byName = new Map(lists.flat().map((n) => [n.name, n]));
    return known.nodes.map((n) => byName.get(n.name) || n);
  }

  function render(fleet, groups, nodes, alarms, gpus) {
    const f = fleet.facility || {};
    document.title = `powerd ${f.name || ''}`;
    $('facility-name').textContent = f.name ? `· ${f.name}` : '';
    $('facility-budget').textContent = fmtW(f.budget_w);
    $('facility-committed').textContent = fmtW(f.committed_w);
    $('facility-draw').textContent = fmtW(f.draw_w);
    $('facility-headroom').textContent =
      f.budget_w === null || f.budget_w === undefined ? '-' : fmtW(f.budget_w - f.draw_w);
    $('facility-headroom').className = `big ${headroomClass(f.budget_w, f.committed_w, f.draw_w, f.over)}`;
    $('gpus-count').textContent = String(fleet.gpus);
    $('gpus-stale').textContent = `${fleet.gpus_stale} stale`;
    $('nodes-count').textContent = String(fleet.nodes);
    $('nodes-states').textContent = Object.entries(fleet.nodes_by_state || {})
      .map(([k, v]) => `${v} ${k}`).join(', ');
    $('throughput').textContent = fmtNum(fleet.throughput, 2);
    $('throughput-classes').textContent = Object.entries(fleet.throughput_by_class || {})
      .map(([k, v]) => `${k} ${fmtNum(v, 2)}`).join(', ');

    const stale = state.lastTick !== null && fleet.tick === state.lastTick.tick
      && Date.now() - state.lastTick.at > 3000 * Math.max(1, fleet.tick_s || 1);
    if (state.lastTick === null || fleet.tick !== state.lastTick.tick) {
      state.lastTick = { tick: fleet.tick, at: Date.now() };
    }
    const line = $('status-line');
    line.className = stale ? 'stale' : '';
    line.textContent = [
      `tick ${fleet.tick ?? '-'}`,
      fleet.status || 'no tick yet',
      fleet.solver ? `${fleet.solver} ${fmtNum(fleet.solve_ms, 1)} ms` : null,
      fleet.policy_version === null ? `policy ${fleet.policy_source}` : `policy v${fleet.policy_version}`,
      stale ? 'no new tick' : null,
      `updated ${new Date().toLocaleTimeString()}`,
    ].filter(Boolean).join(' · ');

    renderAlarms(alarms);
    renderTree(groups, nodes, gpus);
    renderLeadership(fleet.leadership);
  }

  function renderAlarms(alarms) {
    $('alarms-count').textContent = alarms.length ? String(alarms.length) : '';
    $('alarms').replaceChildren(...(alarms.length
      ? alarms.map((a) => h('li', { 'data-kind': a.kind },
        h('span', { class: 'kind' }, a.kind), a.message))
      : [h('li', { class: 'none' }, 'none')]));
  }

  function groupLine(g, extra, badges) {
    return h('div', { class: 'line' },
      h('span', { class: 'name' }, g.name, badges),
      bar(g.budget_w, g.committed_w, g.draw_w, g.over),
      h('span', { class: 'nums' },
        h('b', { class: 'draw' }, fmtW(g.draw_w)), ' drawn · ',
        h('b', { class: 'committed' }, fmtW(g.committed_w)), ' committed · ',
        h('b', { class: 'budget' }, fmtW(g.budget_w)), ' budget', extra));
  }

  function groupEl(level, g, children, badges) {
    return h('div', {
      class: `group level-${level}`,
      'data-group': g.name,
      'data-level': level,
      'data-budget-w': g.budget_w,
      'data-committed-w': g.committed_w,
      'data-draw-w': g.draw_w,
      'data-over': g.over ? 'true' : 'false',
    }, groupLine(g, null, badges), children && children.length
      ? h('div', { class: 'children' }, children) : null);
  }

  function renderTree(groups, nodes, gpus) {
    const at = {};
    for (const g of groups) at[`${g.level}/${g.name}`] = g;
    const none = (name) => ({ name, budget_w: null, committed_w: null, draw_w: null, over: false });
    const get = (level, name) => at[`${level}/${name}`] || none(name);
    // rows and racks in the policy's order of their nodes
    const rows = new Map();
    for (const n of nodes) {
      const row = n.row ?? '';
      const rack = n.rack ?? '';
      if (!rows.has(row)) rows.set(row, new Map());
      const racks = rows.get(row);
      if (!racks.has(rack)) racks.set(rack, []);
      racks.get(rack).push(n);
    }
    const nodeEls = (list) => list.map((n) => nodeEl(n, gpus.get(n.name)));
    const rackEls = (racks) => [...racks].flatMap(([rack, list]) => (rack
      ? [rackEl(get('rack', rack), nodeEls, list, nodes.length)] : nodeEls(list)));
    const rowEls = [...rows].flatMap(([row, racks]) => (row
      ? [groupEl('row', get('row', row), rackEls(racks))] : rackEls(racks)));
    const facility = groups.find((g) => g.level === 'facility');
    $('tree').replaceChildren(facility ? groupEl('facility', facility, rowEls) : h('div', {}, rowEls));
  }

  function rackEl(g, nodeEls, list, total) {
    const open = rackOpen(g.name, total);
    const el = groupEl('rack', g, open ? nodeEls(list) : null,
      [h('span', { class: 'badge' }, `${open ? '▾' : '▸'} ${list.length} node${list.length === 1 ? '' : 's'}`)]);
    el.setAttribute('aria-expanded', open ? 'true' : 'false');
    el.firstChild.addEventListener('click', () => {
      if (state.racksToggled.has(g.name)) state.racksToggled.delete(g.name);
      else state.racksToggled.add(g.name);
      refresh();
    });
    return el;
  }

  function nodeEl(n, gpus) {
    const g = {
      name: n.name, budget_w: n.budget_w, committed_w: n.committed_w, draw_w: n.draw_w,
      over: n.budget_w !== null && n.committed_w !== null && n.committed_w > n.budget_w,
    };
    const badges = [
      h('span', { class: `badge ${n.state}` }, n.state),
      n.drained ? h('span', { class: 'badge drained' }, 'drained') : null,
      h('span', { class: 'badge' }, `${n.gpus} GPU${n.gpus === 1 ? '' : 's'}`),
      n.classes.length ? h('span', { class: 'badge' }, n.classes.join(', ')) : null,
    ];
    const el = groupEl('node', g, null, badges);
    el.setAttribute('data-state', n.state);
    el.setAttribute('aria-expanded', state.open.has(n.name) ? 'true' : 'false');
    el.firstChild.addEventListener('click', () => {
      if (state.open.has(n.name)) state.open.delete(n.name); else state.open.add(n.name);
      refresh();
    });
    if (state.open.has(n.name)) {
      el.append(h('div', { class: 'children' }, gpus ? gpuTable(gpus) : 'loading…'));
    }
    return el;
  }

  function gpuTable(gpus) {
    const head = ['GPU', 'UUID', 'class', 'job', 'state', 'cap', 'committed', 'target', 'draw', '', 'temp']
      .map((t) => h('th', {}, t));
    const rows = gpus.map((g) => {
      const states = [h('span', { class: `badge ${g.state}` }, g.state)];
      if (g.pinned_w !== null && g.pinned_w !== undefined) {
        states.push(h('span', { class: 'badge pinned' }, `pinned ${fmtW(g.pinned_w)}`));
      }
      if (g.drained) states.push(h('span', { class: 'badge drained' }, 'drained'));
      return h('tr', { 'data-uuid': g.uuid, 'data-cap-w': g.cap_w, 'data-power-w': g.power_w },
        h('td', {}, `${g.index} ${g.name}`),
        h('td', { class: 'uuid' }, g.uuid),
        h('td', { class: 'class' }, g.class ?? '-'),
        h('td', { class: 'job' }, g.job ?? '-'),
        h('td', { class: 'state' }, states),
        h('td', { class: 'w cap' }, fmtW(g.cap_w)),
        h('td', { class: 'w committed' }, fmtW(g.committed_w)),
        h('td', { class: 'w target' }, fmtW(g.target_w)),
        h('td', { class: 'w power' }, fmtW(g.power_w)),
        h('td', {}, bar(g.cap_w, g.cap_w, g.power_w, false, g.max_cap_w)),
        h('td', { class: 'w' }, `${fmtNum(g.temp_c, 0)} °C`));
    });
    return h('table', { class: 'gpus' }, h('thead', {}, h('tr', {}, head)), h('tbody', {}, rows));
  }

  function renderLeadership(lead) {
    if (!lead) {
      $('leadership').replaceChildren(h('p', { class: 'muted' },
        'This controller runs without leadership (an embedded loop): no scope, no standbys.'));
      return;
    }
    const dl = h('dl', {});
    const add = (k, v) => dl.append(h('dt', {}, k), h('dd', { 'data-field': k }, v));
    add('scope', lead.scope);
    add('this controller', `${lead.controller} (${lead.role})`);
    add('leader', lead.leader ?? '-');
    add('epoch', String(lead.epoch));
    add('lease left', lead.lease_left_s === null ? '-' : `${fmtNum(lead.lease_left_s, 1)} s`);
    add('standbys', lead.standbys.length ? lead.standbys.join(', ') : 'none');
    add('mode', lead.mode);
    add('takeovers', String(lead.takeovers));
    add('fenced commands', String(lead.fenced));
    add('withheld commands', String(lead.withheld));
    if (lead.last_error) add('last error', lead.last_error);
    const members = h('table', { class: 'gpus' },
      h('thead', {}, h('tr', {}, ['controller', 'role', 'epoch', 'seen'].map((t) => h('th', {}, t)))),
      h('tbody', {}, lead.members.map((m) => h('tr', {},
        h('td', {}, m.controller), h('td', {}, m.role), h('td', {}, String(m.epoch)),
        h('td', {}, `${fmtNum(m.age_s, 1)} s ago`)))));
    $('leadership').replaceChildren(dl, members);
  }

  // ---- the chart: last hour of facility draw against the budget ----

  function renderChart(hist, fleet) {
    const svg = $('chart');
    const NS = 'http://www.w3.org/2000/svg';
    const el = (tag, attrs) => {
      const e = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
      return e;
    };
    // Drawn at the element's own size: no stretched text.
    const W = Math.max(300, Math.round(svg.clientWidth || 900)); const H = 220;
    const L = 64; const R = 8; const T = 10; const B = 20;
    svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
    const pts = hist.points;
    $('chart-source').textContent = `(from the ${hist.source === 'store' ? 'store' : "controller's memory"}`
      + `, ${Math.round(hist.step_s)} s intervals)`;
    // The hour, or as much of it as there is: a young store's few minutes fill the width.
    const t1 = hist.until;
    const t0 = pts.length ? Math.max(hist.since, pts[0].ts - hist.step_s) : hist.since;
    // The scale follows the budget, not a spike far above it: at a start every GPU counts
    // at its maximum until its first ack, so committed sits far above the budget for a tick
    // or two, and a scale stretched to that flattens the hour after it. Values above
    // SPIKE_ROOM × the highest budget leave the scale alone: drawn at its top edge, marked
    // (▲) with their value.
    const SPIKE_ROOM = 1.2;
    let budgetTop = 0;
    for (const p of pts) budgetTop = Math.max(budgetTop, p.budget_w || 0);
    if (fleet.facility && fleet.facility.budget_w) budgetTop = Math.max(budgetTop, fleet.facility.budget_w);
    const room = budgetTop > 0 ? SPIKE_ROOM * budgetTop : Infinity;
    const peak = (p) => Math.max(p.committed_w || 0, p.draw_max_w || 0);
    let top = Math.max(1, budgetTop);
    for (const p of pts) if (peak(p) <= room) top = Math.max(top, peak(p));
    // Four grid lines at round numbers above the highest value.
    const unit = 10 ** Math.floor(Math.log10((top * 1.05) / 4));
    top = 4 * unit * [1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 7.5, 8, 10].find((m) => 4 * unit * m >= top * 1.05);
    const x = (t) => L + ((W - L - R) * (t - t0)) / Math.max(1, t1 - t0);
    const y = (w) => T + (H - T - B) * (1 - Math.min(w, top) / top);
    const kids = [];
    for (let i = 0; i <= 4; i += 1) {
      const w = (top * i) / 4;
      kids.push(el('line', { class: 'grid', x1: L, x2: W - R, y1: y(w), y2: y(w) }));
      const label = el('text', { x: L - 4, y: y(w) + 4, 'text-anchor': 'end' });
      label.textContent = fmtW(w);
      kids.push(label);
    }
    const ago = (s) => {
      if (s >= 600) return `-${Math.round(s / 60)} min`;
      return s >= 60 ? `-${(s / 60).toFixed(1)} min` : `-${Math.round(s)} s`;
    };
    for (let i = 0; i <= 4; i += 1) {
      const t = t0 + ((t1 - t0) * i) / 4;
      const anchor = i === 0 ? 'start' : i === 4 ? 'end' : 'middle';
      const label = el('text', { x: x(t), y: H - 4, 'text-anchor': anchor });
      label.textContent = i === 4 ? 'now' : ago(t1 - t);
      kids.push(label);
    }
    const line = (key) => pts.filter((p) => p[key] !== null)
      .map((p) => `${x(p.ts).toFixed(1)},${y(p[key]).toFixed(1)}`).join(' ');
    if (pts.length) {
      const drawn = pts.filter((p) => p.draw_w !== null);
      if (drawn.length) {
        const area = `${x(drawn[0].ts).toFixed(1)},${y(0)} ${line('draw_w')} `
          + `${x(drawn[drawn.length - 1].ts).toFixed(1)},${y(0)}`;
        kids.push(el('polygon', { class: 'draw', points: area }));
      }
      kids.push(el('polyline', { class: 'committed', points: line('committed_w') }));
      kids.push(el('polyline', { class: 'budget', points: line('budget_w') }));
    }
    const above = pts.filter((p) => peak(p) > top);
    for (const p of above) {
      const px = x(p.ts);
      const mark = el('polygon', {
        class: 'off-scale',
        points: `${(px - 5).toFixed(1)},${T + 8} ${(px + 5).toFixed(1)},${T + 8} ${px.toFixed(1)},${T}`,
      });
      const title = document.createElementNS(NS, 'title');
      title.textContent = `above the scale: committed ${fmtW(p.committed_w)}, draw up to ${fmtW(p.draw_max_w)}`;
      mark.append(title);
      kids.push(mark);
    }
    if (above.length) {
      const high = above.reduce((a, b) => (peak(b) > peak(a) ? b : a));
      const right = x(high.ts) > W / 2;
      const label = el('text', {
        class: 'off-scale', x: x(high.ts) + (right ? -8 : 8), y: T + 8, 'text-anchor': right ? 'end' : 'start',
      });
      label.textContent = fmtW(peak(high));
      kids.push(label);
    }
    $('chart-off-scale').hidden = !above.length;
    svg.replaceChildren(...kids);
    svg.setAttribute('data-points', String(pts.length));
    svg.setAttribute('data-top-w', String(top));
    svg.setAttribute('data-off-scale', String(above.length));
  }

  // ---- start ----

  function start() {
    takeFragmentToken();
    $('signin-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const t = $('token').value.trim();
      $('token').value = '';
      if (!t) return;
      try { sessionStorage.setItem(KEY, t); } catch (e) { /* private mode */ }
      state.token = t;
      refresh();
    });
    $('sign-out').addEventListener('click', () => { forget(); showSignIn('Signed out.'); });
    window.addEventListener('hashchange', () => {
      if (/token=/.test(location.hash)) { takeFragmentToken(); state.token = storedToken(); refresh(); }
    });
    state.token = storedToken();
    if (state.token) refresh(); else showSignIn('');
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
