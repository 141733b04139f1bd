// The charts page: the latest load-test report (its PNG charts and its markdown tables) and the pair's
// acceptance by category, from /playground/charts/data.
"use strict";

const $ = (id) => document.getElementById(id);

function element(tag, text, className) {
  const el = document.createElement(tag);
  if (text !== undefined) el.textContent = text;
  if (className) el.className = className;
  return el;
}

function note(text) { return element("p", text, "note"); }

// Markdown as the report writes it: headings, pipe tables, paragraphs (as text: nothing is interpreted as HTML).
function renderMarkdown(markdown) {
  const out = document.createDocumentFragment();
  let table = null;
  for (const line of markdown.split("\n")) {
    if (line.startsWith("|")) {
      const cells = line.split("|").slice(1, -1).map((c) => c.trim());
      if (cells.every((c) => /^:?-+:?$/.test(c))) continue;
      if (!table) { table = element("table"); out.append(table); }
      const row = element("tr");
      for (const cell of cells) row.append(element(table.rows.length ? "td" : "th", cell.replaceAll("**", "")));
      table.append(row);
      continue;
    }
    table = null;
    const heading = line.match(/^(#+)\s+(.*)/);
    if (heading) out.append(element(`h${Math.min(heading[1].length + 2, 6)}`, heading[2]));
    else if (line.trim() && !line.startsWith("![")) out.append(element("p", line));
  }
  return out;
}

function renderPair(pair) {
  const body = $("pair-body");
  if (!pair) {
    body.append(note("No measurement yet: run specserve measure-pair --json <reports_dir>/measure-pair.json"));
    return;
  }
  const table = element("table");
  table.id = "pair-table";
  const head = element("tr");
  for (const name of ["category", "alpha", "greedy match", "positions"]) head.append(element("th", name));
  table.append(head);
  for (const [category, row] of Object.entries(pair.agreement)) {
    const tr = element("tr");
    tr.append(element("td", category), element("td", row.alpha.toFixed(3)), element("td", row.greedy_match.toFixed(3)),
              element("td", String(row.positions)));
    table.append(tr);
  }
  body.append(table);
  body.append(note(`c = ${pair.c} (target decode step ${pair.target_vllm_step_ms} ms / draft forward ` +
    `${pair.draft_torch_forward_ms} ms); optimal K ${pair.optimal_k}, predicted speed-up ${pair.predicted_speedup}x`));
}

function renderReport(report) {
  if (!report) {
    $("report-charts").append(note("No load-test report yet: run specserve loadtest --out <reports_dir>/<name>"));
    return;
  }
  $("report-name").textContent = report.name;
  for (const chart of report.charts) {
    const img = element("img");
    img.src = `/playground/charts/image/${encodeURIComponent(chart)}`;
    img.alt = chart;
    $("report-charts").append(img);
  }
  $("report-table").append(renderMarkdown(report.markdown));
}

fetch("/playground/charts/data").then((r) => r.json()).then((data) => {
  $("reports-dir").textContent = data.reports_dir;
  renderPair(data.measure_pair);
  renderReport(data.report);
  document.body.dataset.ready = "true";
}, (error) => { $("report-charts").append(note(`Could not load the charts: ${error.message}`)); });
