// The live dashboard: asks this server's JSON routes about once a second (GET /cache/stats, /policies,
// /dashboard/state, and /policies/shadow where the server has it), renders them, and keeps a short history
// client-side for the charts.
"use strict";

(() => {
  const {KEY_STORE, NONE, isNum, fmt, HttpError, api, col, fillTable, fillFigures} = Page;
  const REFRESH_MS = 1000;
  const HISTORY = 600;  // samples kept per series: ten minutes at one a second
  const SHOWN_EPOCHS = 20;  // the newest epochs in the tables
  const SHOWN_SWITCHES = 10;
  const SHOWN_PAIRS = 20;  // shadow pairs in the table ("all" pairs are dozens)
  const CHARTED_PAIRS = 8;  // and in the chart
  const SHADOW_OFF = "shadow policies off (start with --shadow-policies)";
  const $ = (id) => document.getElementById(id);
  const preview = (ids, total) => (ids.length ? ids.join(" ") + (total > ids.length ? " \u2026" : "") : NONE);

  function say(text, kind) {
    const box = $("message");
    box.textContent = text;
    box.className = `message ${kind}`;
    box.hidden = !text;
  }

  // -- panels --------------------------------------------------------------------------------------------
  const POOL_PARTS = [["free", "free", "#9fc9a5"], ["evictable", "evictable (cached, unused)", "#2f6fdf"],
                      ["protected", "protected (cached, in use)", "#e0672b"],
                      ["owned_by_requests", "owned by requests", "#7a5cd6"]];

  function renderPool(stats) {
    const pool = stats.pool || {};
    const capacity = pool.capacity || 0;
    Charts.stackedBar($("pool-bar"), POOL_PARTS.map(([key, name, color]) => ({name, color, value: pool[key] || 0})),
                      capacity);
    fillFigures($("pool"), [["capacity", "capacity (tokens)", capacity, fmt.int],
      ...POOL_PARTS.map(([key, name, color]) => [key, name, pool[key], (v) =>
        `${fmt.int(v)} (${fmt.pct(capacity ? v / capacity : null)})`])]);
    [...$("pool").querySelectorAll("dt")].slice(1).forEach((dt, i) => dt.classList.add(`part-${i}`));
    const t = stats.totals || {};
    fillFigures($("totals"), [
      ["hit_rate", "hit rate (all epochs)", t.hit_rate, fmt.pct],
      ["requests", "requests finished", t.requests_finished, fmt.int],
      ["received", "requests received", t.requests_received, fmt.int],
      ["prompt_tokens", "prompt tokens", t.prompt_tokens, fmt.int],
      ["cached_tokens", "cached tokens", t.cached_tokens, fmt.int],
      ["evicted_tokens", "evicted tokens", t.evicted_tokens, fmt.int],
      ["retractions", "retractions", t.retractions, fmt.int],
      ["failed", "failed / queue timeouts", t.requests_failed, (v) => `${fmt.int(v)} / ${fmt.int(t.queue_timeouts)}`],
    ]);
  }

  const TIER_PARTS = [["L1", "L1: the pool", "#2f6fdf"], ["L2", "L2: host memory", "#e0672b"],
                      ["L3", "L3: storage", "#7a5cd6"]];

  function renderTiers(stats) {
    const t = stats.tiers;
    $("tiers-panel").hidden = !t;
    document.querySelectorAll(".tier-only").forEach((el) => { el.hidden = !t; });
    if (!t) return;
    const rate = t.hit_rate || {};
    Charts.stackedBar($("tiers-bar"), TIER_PARTS.map(([key, name, color]) => ({name, color, value: rate[key] || 0})),
                      1);
    const r = t.runner || {};
    fillFigures($("tiers"), [
      ...TIER_PARTS.map(([key, name]) => [key, `hit rate, ${name}`, rate[key], fmt.pct]),
      ["policies", "write / prefetch", `${t.write_policy} / ${t.prefetch_policy}`, fmt.text],
      ["pages", "pages written / loaded back", t.pages_written, (v) => `${fmt.int(v)} / ${fmt.int(t.pages_loaded)}`],
      ["load", "read-back, mean", t.load_back_mean_s, fmt.secs],
      ["host", "host memory (L2)", r.l2_bytes, (v) => `${fmt.int(Math.round((v || 0) / 2 ** 20))} MiB`],
      ["storage", "storage read / written", r.l3_bytes_read, (v) =>
        `${fmt.int(Math.round((v || 0) / 2 ** 20))} / ${fmt.int(Math.round((r.l3_bytes_written || 0) / 2 ** 20))} MiB`],
      ["damaged", "damaged pages dropped", r.l3_pages_damaged || 0, fmt.int],
    ]);
  }

  const DRAFT_PARTS = [["accepted", "draft tokens kept", "#2a9d5c"], ["rejected", "draft tokens rejected", "#c44e52"]];

  function renderSpeculative(stats) {
    const s = stats.speculative;
    $("speculative-panel").hidden = !s;
    document.querySelectorAll(".draft-only").forEach((el) => { el.hidden = !s; });
    if (!s) return;
    const counts = {accepted: s.accepted, rejected: s.drafted - s.accepted};
    Charts.stackedBar($("speculative-bar"), DRAFT_PARTS.map(([key, name, color]) => ({name, color,
                                                                                      value: counts[key] || 0})),
                      s.drafted);
    const needed = Object.entries(s.cost || {}).map(([batch, c]) => `${fmt.pct(c.acceptance_needed)} at ${batch}`);
    fillFigures($("speculative"), [
      ["policy", "draft policy / most tokens", `${s.draft_policy} / ${s.draft_tokens}`, fmt.text],
      ["acceptance", "acceptance rate", s.acceptance_rate, fmt.pct],
      ["mean", "accepted per draft, mean", s.mean_accepted, (v) => (isNum(v) ? v.toFixed(2) : NONE)],
      ["tokens", "draft tokens kept / drafted", s.accepted, (v) => `${fmt.int(v)} / ${fmt.int(s.drafted)}`],
      ["steps", "verifying steps / drafts", s.steps, (v) => `${fmt.int(v)} / ${fmt.int(s.drafts)}`],
      ["skipped", "drafts skipped: back-off / not worth it (unchecked drafts judged)", s.backed_off, (v) =>
        `${fmt.int(v)} / ${fmt.int(s.not_worth)} (${fmt.int(s.watched)})`],
      ["needed", "acceptance a draft needs, by batch size", needed.length, () => needed.join(", ") || "measuring"],
    ]);
  }

  const POLICY_KINDS = ["eviction", "schedule", "write", "prefetch", "draft"];
  const OPTIONAL_KINDS = ["write", "prefetch", "draft"];  // with --enable-hierarchical-cache, --speculative-algorithm

  // touched: the user chose in a select (refreshes keep the choice); switches: answers to a switch so far (a
  // refresh that began before one may carry the policies from before it, and must not show them)
  const policies = {info: null, touched: false, switches: 0};

  function renderPolicies(info) {
    policies.info = info;
    for (const kind of POLICY_KINDS) {
      if (!info[kind] && OPTIONAL_KINDS.includes(kind)) continue;  // the KV tiers' and drafts' (when on)
      const part = info[kind] || {current: null, available: []};
      $(`current-${kind}`).textContent = fmt.text(part.current);
      const select = $(`${kind}-select`);
      const names = part.available || [];
      if ([...select.options].map((o) => o.value).join("\n") !== names.join("\n")) {
        select.replaceChildren(...names.map((n) => Object.assign(document.createElement("option"),
                                                                  {value: n, textContent: n})));
      }
      if (!policies.touched) select.value = part.current;
    }
    $("switch-button").disabled = false;
    const errors = info.errors || [];
    $("policy-errors").replaceChildren(...errors.slice(-5).map((e) =>
      Object.assign(document.createElement("li"), {textContent: e})));
  }

  async function switchPolicies(event) {
    event.preventDefault();
    const info = policies.info;
    if (!info) return;
    const body = {};
    for (const kind of POLICY_KINDS) {
      if (!info[kind]) continue;
      const chosen = $(`${kind}-select`).value;
      if (chosen && chosen !== info[kind].current) body[kind] = chosen;
    }
    const reply = $("policy-reply");
    if (!Object.keys(body).length) {
      reply.textContent = `nothing to switch: ${info.eviction.current} / ${info.schedule.current} already run`;
      reply.className = "reply";
      return;
    }
    $("switch-button").disabled = true;
    try {
      const answer = await api("policies", {method: "POST", headers: {"Content-Type": "application/json"},
                                            body: JSON.stringify(body)});
      policies.touched = false;
      policies.switches += 1;
      renderPolicies(answer);
      reply.textContent = `the server switched: eviction ${answer.eviction.current}, schedule ` +
                          `${answer.schedule.current}` + (answer.write ? `, write ${answer.write.current}, ` +
                          `prefetch ${answer.prefetch.current}` : "") +
                          (answer.draft ? `, draft ${answer.draft.current}` : "") +
                          (body.eviction || body.schedule ? " (a new epoch started)" : "");
      reply.className = "reply ok";
    } catch (err) {
      reply.textContent = `the server refused: ${err.message}`;
      reply.className = "reply error";
      if (err.status === 401) needKey();
    } finally {
      $("switch-button").disabled = false;
    }
    loop.now();
  }

  const colors = new Charts.ColorBook();
  const history = {
    total: new Charts.Series("total hit rate", Charts.PALETTE[0], HISTORY),
    epoch: new Charts.Series("current epoch's hit rate", Charts.PALETTE[1], HISTORY),
    p50: new Charts.Series("TTFT p50", Charts.PALETTE[2], HISTORY),
    p99: new Charts.Series("TTFT p99", Charts.PALETTE[3], HISTORY),
    markers: [],  // [{t, label}]: where the current epoch changed
    epoch_key: null,
    pairs: new Map(),  // shadow pair name -> Series of its hit rate
  };
  const pairName = (p) => `${p.eviction} / ${p.schedule}`;

  // One sample of every series at `now` (client clock: the server's epochs count from its own).
  function sample(now, stats, shadow) {
    const epochs = stats.epochs || [];
    const current = epochs.find((e) => e.current) || epochs[epochs.length - 1] || {};
    history.total.push(now, (stats.totals || {}).hit_rate);
    history.epoch.push(now, current.hit_rate);
    history.p50.push(now, current.ttft_p50_s);
    history.p99.push(now, current.ttft_p99_s);
    const key = `${current.eviction}|${current.schedule}|${current.started}`;
    if (history.epoch_key !== null && key !== history.epoch_key) {
      history.markers.push({t: now, label: pairName(current)});
    }
    history.epoch_key = key;
    const oldest = history.total.points[0][0];
    history.markers = history.markers.filter((m) => m.t >= oldest);
    for (const p of shadow && shadow.enabled ? shadow.pairs || [] : []) {
      const name = pairName(p);
      if (!history.pairs.has(name)) history.pairs.set(name, new Charts.Series(name, null, HISTORY));
      history.pairs.get(name).push(now, p.hit_rate);
    }
  }

  const EPOCH_COLUMNS = [
    col("index", "#"), col("eviction", "eviction"), col("schedule", "schedule"),
    col("started", "started", (v) => (isNum(v) ? `+${v.toFixed(1)} s` : NONE)),
    col("duration_s", "lasted", fmt.secs), col("requests", "requests", fmt.int),
    col("hit_rate", "hit rate", fmt.pct), col("ttft_p50_s", "TTFT p50", fmt.secs),
    col("ttft_p99_s", "TTFT p99", fmt.secs), col("ttft_mean_s", "TTFT mean", fmt.secs),
    col("throughput_tokens_per_s", "tokens/s", fmt.rate), col("evicted_tokens", "evicted", fmt.int),
  ];
  const STARVATION_COLUMNS = [
    col("index", "#"), col("pair", "policies", fmt.pair, (e) => e),
    col("cold_requests", "cold requests", fmt.int), col("cold_ttft_p99_s", "cold TTFT p99", fmt.secs),
    col("max_queue_wait_s", "longest queue wait", fmt.secs),
    col("slowest5_ttft_share", "slowest 5%'s share of TTFT", fmt.pct),
  ];

  function renderEpochs(stats, now) {
    const epochs = stats.epochs || [];
    const first = epochs.length ? epochs[0].started : 0;
    const rows = epochs.map((e, i) => ({...e, index: i + 1, started: e.started - first})).slice(-SHOWN_EPOCHS);
    const rowClass = (e) => (e.current ? "current" : "");
    fillTable($("epochs"), EPOCH_COLUMNS, rows, {rowClass});
    fillTable($("starvation"), STARVATION_COLUMNS, rows, {rowClass});
    const hits = [history.total, history.epoch];
    Charts.lines($("hit-chart"), hits, {now, yMax: 1, yFormat: fmt.pct, markers: history.markers});
    Charts.legend($("hit-legend"), hits);
    const ttft = [history.p50, history.p99];
    Charts.lines($("ttft-chart"), ttft, {now, yMax: null, yFormat: fmt.secs, markers: history.markers});
    Charts.legend($("ttft-legend"), ttft);
  }

  // The shadow body, {enabled: false} where the server has no such route or runs none.
  async function shadowState(state) {
    if (!(state.routes && state.routes.shadow)) return {enabled: false};
    try {
      return (await api("policies/shadow")) || {enabled: false};
    } catch (err) {
      if (err.status === 404) return {enabled: false};
      throw err;
    }
  }

  const PAIR_COLUMNS = [
    col("mark", "", fmt.text, (p) => [p.live ? "live" : "", p.leader ? "leader" : ""].filter(Boolean).join(", ")),
    col("eviction", "eviction"), col("schedule", "schedule"), col("requests", "requests", fmt.int),
    col("hit_rate", "hit rate", fmt.pct), col("evicted_tokens", "evicted", fmt.int),
    col("ttft_p50_s", "TTFT p50", fmt.secs), col("ttft_p99_s", "TTFT p99", fmt.secs),
    col("ttft_mean_s", "TTFT mean", fmt.secs), col("cold_ttft_p99_s", "cold TTFT p99", fmt.secs),
    col("max_queue_wait_s", "longest queue wait", fmt.secs), col("slowest5_ttft_share", "slowest 5%'s share", fmt.pct),
  ];
  const SWITCH_COLUMNS = [
    col("at", "at (server clock)", (v) => (isNum(v) ? `${v.toFixed(1)} s` : NONE)),
    col("from", "from", fmt.pair), col("to", "to", fmt.pair), col("reason", "why"),
  ];

  // The pairs by hit rate, best first: the first `n`, and the live and the leading pair wherever they rank.
  function best(pairs, n) {
    const rate = (p) => (isNum(p.hit_rate) ? p.hit_rate : -1);
    return [...pairs].sort((a, b) => rate(b) - rate(a)).filter((p, i) => i < n || p.live || p.leader);
  }

  function renderShadow(shadow, now) {
    const on = Boolean(shadow && shadow.enabled);
    $("shadow-body").hidden = !on;
    if (!on) {
      $("shadow-status").textContent = SHADOW_OFF;
      return;
    }
    const leader = shadow.leader ? pairName(shadow.leader) : null;
    $("shadow-status").textContent = `live ${fmt.pair(shadow.live)}, leader ${fmt.pair(shadow.leader)}; ` +
      `window ${fmt.secs(shadow.window_s)}, lag ${fmt.secs(shadow.lag_s)}; automatic switching ` +
      `${shadow.auto_policy ? "on" : "off"}`;
    const all = (shadow.pairs || []).map((p) => ({...p, leader: pairName(p) === leader}));
    const pairs = best(all, SHOWN_PAIRS);
    $("shadow-shown").textContent = pairs.length < all.length ? `${pairs.length} of ${all.length} pairs shown: ` +
      `the best ${SHOWN_PAIRS} by hit rate, and the live and the leading one` : "";
    fillTable($("shadow-pairs"), PAIR_COLUMNS, pairs,
              {rowClass: (p) => [p.live ? "current" : "", p.leader ? "leader" : ""].join(" ").trim()});
    fillTable($("shadow-switches"), SWITCH_COLUMNS, (shadow.switches || []).slice(-SHOWN_SWITCHES).reverse(),
              {empty: "no switches yet"});
    const series = best(all, CHARTED_PAIRS).map((p) => history.pairs.get(pairName(p))).filter(Boolean);
    for (const s of series) s.color = colors.of(s.name);  // only charted pairs take a colour: few, distinct
    Charts.lines($("shadow-chart"), series, {now, yMax: 1, yFormat: fmt.pct});
    Charts.legend($("shadow-legend"), series);
  }

  const SUBTREE_COLUMNS = [
    col("tokens", "tokens", fmt.int), col("nodes", "nodes", fmt.int), col("hits", "hits", fmt.int),
    col("locked_tokens", "locked", fmt.int), col("evictable_tokens", "evictable", fmt.int),
    col("depth", "depth (tokens)", fmt.int), col("max_depth", "deepest below", fmt.int),
    col("prefix", "path starts with", fmt.text, (s) => preview(s.prefix_ids, s.depth)),
    col("segment", "its segment starts with", fmt.text, (s) => preview(s.segment_ids, s.segment_tokens)),
  ];

  function renderTree(tree) {
    if (!tree) {
      $("tree-summary").textContent = "the radix cache is off (--disable-radix-cache): nothing is cached";
      fillTable($("tree-largest"), SUBTREE_COLUMNS, []);
      fillTable($("tree-hottest"), SUBTREE_COLUMNS, []);
      return;
    }
    $("tree-summary").textContent = `${fmt.int(tree.nodes)} nodes holding ${fmt.int(tree.tokens)} tokens: ` +
      `${fmt.int(tree.locked_tokens)} locked by running requests, ${fmt.int(tree.evictable_tokens)} evictable`;
    fillTable($("tree-largest"), SUBTREE_COLUMNS, tree.largest || [], {empty: "the tree is empty"});
    fillTable($("tree-hottest"), SUBTREE_COLUMNS, tree.hottest || [], {empty: "no cache hits yet"});
  }

  const REQUEST_COLUMNS = [
    col("rid", "request id"), col("state", "state"), col("prompt_tokens", "prompt tokens", fmt.int),
    col("cached_tokens", "cached tokens", fmt.int), col("output_tokens", "generated", fmt.int),
    col("wait_s", "since arrival", fmt.secs), col("priority", "priority", fmt.int),
  ];

  function renderQueues(queues) {
    for (const kind of ["running", "waiting"]) {
      const listed = queues[kind] || [];
      const count = queues[`${kind}_count`] || 0;
      $(`${kind}-title`).textContent = `${kind[0].toUpperCase()}${kind.slice(1)} (${count}` +
        `${count > listed.length ? `, ${listed.length} shown` : ""})`;
      fillTable($(kind), REQUEST_COLUMNS, listed, {empty: `no ${kind} requests`});
    }
  }

  // With --dp N the bodies are replica 0's, with every replica's under "replicas".
  function renderReplicas(stats) {
    const n = stats.replicas ? Object.keys(stats.replicas).length : 1;
    $("replicas").textContent = n > 1 ? `--dp ${n}: replica 0 shown` : "";
  }

  // -- the loop ------------------------------------------------------------------------------------------
  async function refresh() {
    const switches = policies.switches;
    const [stats, info, state] = await Promise.all([api("cache/stats"), api("policies"), api("dashboard/state")]);
    const shadow = await shadowState(state);
    const now = Date.now() / 1000;
    renderReplicas(stats);
    renderPool(stats);
    renderTiers(stats);
    renderSpeculative(stats);
    if (switches === policies.switches) renderPolicies(info);
    sample(now, stats, shadow);
    renderEpochs(stats, now);
    renderShadow(shadow, now);
    renderTree(state.tree);
    renderQueues(state.queues || {});
  }

  function needKey() {
    loop.paused = true;  // until a key is given: asking again would only be refused again
    const had = sessionStorage.getItem(KEY_STORE);
    say(had ? "The server refused the API key: enter the one it was started with (--api-key)."
            : "This server needs an API key (it was started with --api-key): enter it above.", "error");
    const conn = $("conn");
    conn.textContent = "API key needed";
    conn.className = "conn down";
    $("api-key").focus();
  }

  const loop = {
    timer: null,
    busy: false,  // a refresh is under way
    again: false,  // asked for while one was under way: another right after it
    paused: false,
    async tick() {
      clearTimeout(loop.timer);
      if (loop.busy) {
        loop.again = true;
        return;
      }
      loop.busy = true;
      loop.again = false;
      try {
        await refresh();
        say("", "");
        $("conn").textContent = `live, updated ${new Date().toLocaleTimeString()}`;
        $("conn").className = "conn live";
      } catch (err) {
        if (err instanceof HttpError && err.status === 401) {
          needKey();
        } else {
          $("conn").textContent = "not updating";
          $("conn").className = "conn down";
          say(err instanceof HttpError ? err.message : `the page could not show the server's answer: ${err}`,
              "error");
        }
      } finally {
        loop.busy = false;
      }
      if (loop.again) {
        loop.paused = false;
        loop.tick();
      } else if (!loop.paused) {
        loop.timer = setTimeout(loop.tick, REFRESH_MS);
      }
    },
    now() {
      loop.paused = false;
      loop.tick();
    },
  };

  function start() {
    const stored = sessionStorage.getItem(KEY_STORE);
    if (stored) $("api-key").value = stored;
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("api-key").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      else sessionStorage.removeItem(KEY_STORE);
      loop.now();
    });
    $("policy-form").addEventListener("submit", switchPolicies);
    for (const kind of POLICY_KINDS) {
      $(`${kind}-select`).addEventListener("change", () => { policies.touched = true; });
    }
    $("switch-button").disabled = true;  // until the policies are known
    loop.now();
  }

  start();
})();
