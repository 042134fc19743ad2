// The dashboard's building blocks: number formats, the fetch that sends the API key, and tables and figure
// lists filled as text only (request ids come from clients, policy names from plugins: never markup).
"use strict";

const Page = (() => {
  const KEY_STORE = "radixserve.apiKey";  // sessionStorage: asked once per browser session
  const NONE = "\u2013";

  // -- formatting ----------------------------------------------------------------------------------------
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const fmt = {
    text: (v) => (v === null || v === undefined ? NONE : String(v)),
    int: (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : NONE),
    pct: (v) => (isNum(v) ? `${(100 * v).toFixed(1)}%` : NONE),
    secs: (v) => (!isNum(v) ? NONE : v < 1 ? `${(1000 * v).toFixed(1)} ms` : `${v.toFixed(2)} s`),
    rate: (v) => (isNum(v) ? v.toFixed(1) : NONE),
    pair: (p) => (p ? `${p.eviction} / ${p.schedule}` : NONE),
  };

  // -- talking to the server -----------------------------------------------------------------------------
  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // The JSON answer of `path` (relative: the page may sit behind a prefix), with the API key if one was given;
  // HttpError with the server's own message otherwise (status 0: no answer at all).
  async function api(path, init = {}) {
    const headers = {...(init.headers || {})};
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = `Bearer ${key}`;
    let resp;
    try {
      resp = await fetch(path, {...init, headers, cache: "no-store"});
    } catch (err) {
      throw new HttpError(0, `the server does not answer (${err.message})`);
    }
    const text = await resp.text();
    let body = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch (_) {
      body = null;
    }
    if (!resp.ok) {
      const said = body && body.error && body.error.message;
      throw new HttpError(resp.status, said || `${resp.status} ${resp.statusText}`);
    }
    return body;
  }

  // -- building blocks -----------------------------------------------------------------------------------
  const col = (key, label, format = fmt.text, value = (row) => row[key]) => ({key, label, format, value});

  // `table` gets a header row of the columns' labels and one row per item; each cell carries its column's key
  // (data-col) and, for numbers, the raw value (data-value).
  function fillTable(table, columns, rows, {empty = "none", rowClass = null} = {}) {
    const header = document.createElement("tr");
    header.append(...columns.map((c) => Object.assign(document.createElement("th"), {textContent: c.label})));
    const body = document.createElement("tbody");
    for (const row of rows) {
      const tr = document.createElement("tr");
      if (rowClass) tr.className = rowClass(row);
      for (const c of columns) {
        const td = document.createElement("td");
        const value = c.value(row);
        td.dataset.col = c.key;
        if (isNum(value)) td.dataset.value = String(value);
        td.textContent = c.format(value);
        tr.append(td);
      }
      body.append(tr);
    }
    if (!rows.length) {
      const td = Object.assign(document.createElement("td"), {textContent: empty, className: "empty"});
      td.colSpan = columns.length;
      const tr = document.createElement("tr");
      tr.append(td);
      body.append(tr);
    }
    const head = document.createElement("thead");
    head.append(header);
    table.replaceChildren(head, body);
  }

  // `dl` gets one term and value per item: [key, label, value, format]; the value's element is #<dl id>-<key>.
  function fillFigures(dl, items) {
    dl.replaceChildren(...items.flatMap(([key, label, value, format]) => {
      const dd = Object.assign(document.createElement("dd"), {id: `${dl.id}-${key}`, textContent: format(value)});
      if (isNum(value)) dd.dataset.value = String(value);
      return [Object.assign(document.createElement("dt"), {textContent: label}), dd];
    }));
  }

  return {KEY_STORE, NONE, isNum, fmt, HttpError, api, col, fillTable, fillFigures};
})();
