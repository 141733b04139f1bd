// The playground: one prompt streamed by the speculative model (with its per-step trace) and by the
// baseline, over the application's OpenAI route; then the speculative text coloured per step and the
// figures. The trace arrives on the stream's final chunk, under "specserve_trace" (see the README).
"use strict";

const KEY_STORE = "specserve-api-key";
const $ = (id) => document.getElementById(id);
let config = null;

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
  return h;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function showKeyBox(reason) {
  $("key-box").hidden = false;
  $("key-state").textContent = reason || (apiKey() ? "a key is kept in this browser" : "no key kept yet");
}

async function loadConfig() {
  const reply = await fetch("/playground/config");
  config = await reply.json();
  lane("speculative").querySelector(".model").textContent = config.speculative_model;
  lane("baseline").querySelector(".model").textContent = config.baseline_model;
  $("race-note").textContent = config.race === "one_after_the_other"
    ? "Both models share this machine's cores, so the race runs them one after the other (speculative first): " +
      "each has the machine to itself while it runs, and the speed-up compares the two runs."
    : "Each model has its own accelerator, so both stream at the same time.";
  if (config.api_key_required) showKeyBox();
}

function lane(name) { return $(`lane-${name}`); }

function setLive(name, fields) {
  const el = lane(name);
  for (const [cls, value] of Object.entries(fields)) el.querySelector(`.${cls}`).textContent = value;
}

// POST a streaming completion; calls onText(text, tokens, seconds, chunks) as chunks arrive (chunks: those
// that carried tokens; the engine sends one per step unless the reader falls behind, when it merges
// them). Resolves to { text, tokens, seconds, trace }; rejects with ApiError carrying the API's message.
async function streamCompletion(model, request, onText, signal) {
  const started = performance.now();
  const reply = await fetch("/v1/completions", {
    method: "POST", headers: headers(), signal,
    body: JSON.stringify({ ...request, model, stream: true, return_token_ids: true,
                           stream_options: { include_usage: true } }),
  });
  if (!reply.ok) {
    let message = `${reply.status} ${reply.statusText}`;
    try {
      const body = await reply.json();
      message = (body.error && body.error.message) || body.message || body.detail || JSON.stringify(body);
    } catch (e) { /* not JSON: keep the status line */ }
    throw new ApiError(reply.status, message);
  }
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "", tokens = 0, chunks = 0, trace = null, usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        reader.cancel();
        throw new ApiError(chunk.error.code || 500, chunk.error.message);
      }
      for (const choice of chunk.choices || []) {
        text += choice.text || "";
        tokens += (choice.token_ids || []).length;
        if ((choice.token_ids || []).length) chunks += 1;
      }
      if (chunk.usage) usage = chunk.usage;
      if (chunk.specserve_trace) trace = chunk.specserve_trace;
      onText(text, tokens, (performance.now() - started) / 1000, chunks);
    }
  }
  if (usage) tokens = usage.completion_tokens;
  return { text, tokens, seconds: (performance.now() - started) / 1000, trace };
}

// Live figures while streaming: each lane's tokens per second; for the speculative lane tokens per
// step (from the chunks, until the trace gives the exact figures); the speed-up once both have rates.
const live = { speculative: null, baseline: null };

function showLiveFigures() {
  const spec = live.speculative, base = live.baseline;
  if (spec && spec.chunks) setFigure("fig-tokens-per-step", `${(spec.tokens / spec.chunks).toFixed(2)} (live)`);
  if (spec && base && base.tokens && spec.seconds && base.seconds) {
    setFigure("fig-measured", `${((spec.tokens / spec.seconds) / (base.tokens / base.seconds)).toFixed(2)}x (live)`);
  }
}

async function runLane(name, model, request, extra, signal) {
  const el = lane(name);
  setLive(name, { state: "streaming", rate: "–", tokens: 0 });
  const out = el.querySelector(".text");
  const result = await streamCompletion(model, { ...request, ...extra }, (text, tokens, seconds, chunks) => {
    if (signal.aborted) return;
    out.textContent = text;
    setLive(name, { rate: (tokens / seconds).toFixed(1), tokens });
    live[name] = { tokens, seconds, chunks };
    showLiveFigures();
  }, signal);
  el.dataset.streamedText = result.text;  // the text as streamed, before the trace colours it
  live[name] = { tokens: result.tokens, seconds: result.seconds, chunks: live[name] ? live[name].chunks : 0 };
  setLive(name, { state: `done in ${result.seconds.toFixed(2)} s`, rate: (result.tokens / result.seconds).toFixed(1),
                  tokens: result.tokens });
  return result;
}

function tokenSpan(text, kind, title) {
  const span = document.createElement("span");
  span.className = `tok ${kind}`;
  span.textContent = text;
  span.title = title;
  return span;
}

// The speculative text, one span per step: accepted drafts, rejected drafts (struck through), then
// the recovered or bonus token (or the target's own token in a step without drafts).
function renderTrace(trace) {
  const out = lane("speculative").querySelector(".text");
  out.textContent = "";
  const list = $("steps");
  list.textContent = "";
  trace.steps.forEach((step, i) => {
    const texts = step.emitted_text;
    const drafted = step.drafted_text || [];
    const title = `step ${i + 1}: K ${step.k}, drafted ${JSON.stringify(drafted.join(""))}, accepted ${step.accepted}` +
      (step.recovered !== null ? ", then recovered" : step.k ? ", all passed: bonus" : ", no drafts");
    const group = document.createElement("span");
    group.className = "step";
    group.dataset.step = i + 1;
    if (step.cut) group.dataset.cut = "true";
    const accepted = Math.min(step.accepted, texts.length);
    for (let j = 0; j < accepted; j++) group.append(tokenSpan(texts[j], "accepted", title));
    if (!step.cut) {
      for (const rejected of drafted.slice(step.accepted)) group.append(tokenSpan(rejected, "rejected", title));
    }
    if (texts.length > accepted) {
      const kind = step.recovered !== null ? "recovered" : step.k ? "bonus" : "target";
      group.append(tokenSpan(texts[accepted], kind, title));
    }
    out.append(group);
    const item = document.createElement("li");
    item.textContent = `K ${step.k}: drafted ${JSON.stringify(drafted)} → accepted ${step.accepted}` +
      (step.recovered !== null ? `, recovered ${JSON.stringify(texts[accepted] ?? "")}`
                               : `, ${step.k ? "bonus" : "target"} ${JSON.stringify(texts[accepted] ?? "")}`) +
      (step.cut ? " (cut by max tokens or a stop)" : "");
    list.append(item);
  });
}

function setFigure(id, value) { $(id).textContent = value === null || value === undefined ? "–" : value; }

function renderFigures(trace, spec, base) {
  const s = trace ? trace.summary : {};
  setFigure("fig-steps", s.steps);
  setFigure("fig-tokens-per-step", s.tokens_per_step);
  setFigure("fig-acceptance", s.acceptance_rate);
  setFigure("fig-alpha", s.alpha);
  setFigure("fig-mean-k", s.mean_k);
  const measured = spec && base && base.tokens && spec.seconds
    ? (spec.tokens / spec.seconds) / (base.tokens / base.seconds) : null;
  setFigure("fig-measured", measured === null ? null : `${measured.toFixed(2)}x`);
  setFigure("fig-c", s.cost_ratio);
  setFigure("fig-predicted", s.predicted_speedup ? `${s.predicted_speedup.toFixed(2)}x at K ${s.predicted_k}` : null);
  setFigure("fig-optimal", s.optimal_k ? `K ${s.optimal_k} (${s.optimal_speedup.toFixed(2)}x)` : null);
}

async function race(event) {
  event.preventDefault();
  showError("");
  const request = {
    prompt: $("prompt").value,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  const button = $("race");
  button.disabled = true;
  document.body.dataset.race = "running";
  for (const name of ["speculative", "baseline"]) {
    lane(name).querySelector(".text").textContent = "";
    setLive(name, { state: "waiting", rate: "–", tokens: 0 });
  }
  renderFigures(null, null, null);
  live.speculative = live.baseline = null;
  // One controller per race: a lane that fails stops the other, so no stream outlives its race.
  const controller = new AbortController();
  const signal = controller.signal;
  try {
    const traced = { vllm_xargs: { specserve_trace: 1 } };
    let spec, base;
    if (config.race === "one_after_the_other") {
      spec = await runLane("speculative", config.speculative_model, request, traced, signal);
      base = await runLane("baseline", config.baseline_model, request, {}, signal);
    } else {
      const runs = [runLane("speculative", config.speculative_model, request, traced, signal),
                    runLane("baseline", config.baseline_model, request, {}, signal)];
      runs.forEach((run) => run.catch(() => controller.abort()));  // the first failure stops the other lane
      const lanes = await Promise.allSettled(runs);
      const failed = lanes.filter((l) => l.status === "rejected").map((l) => l.reason);
      if (failed.length) throw failed.find((e) => e.name !== "AbortError") || failed[0];
      [spec, base] = lanes.map((l) => l.value);
    }
    if (spec.trace) renderTrace(spec.trace);
    renderFigures(spec.trace, spec, base);
    document.body.dataset.race = "done";
  } catch (error) {
    controller.abort();
    if (error.status === 401) showKeyBox("the application refused the key: enter it above");
    showError(error.status ? `Error ${error.status}: ${error.message}` : `Error: ${error.message}`);
    for (const name of ["speculative", "baseline"]) setLive(name, { state: "stopped" });
    document.body.dataset.race = "failed";
  } finally {
    button.disabled = false;
  }
}

$("race-form").addEventListener("submit", race);
$("save-key").addEventListener("click", () => {
  localStorage.setItem(KEY_STORE, $("api-key").value.trim());
  $("api-key").value = "";
  showKeyBox("kept in this browser");
});
$("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); showKeyBox("forgotten"); });
$("show-rejected").addEventListener("change", (e) => {
  lane("speculative").classList.toggle("hide-rejected", !e.target.checked);
});
loadConfig().then(() => { document.body.dataset.ready = "true"; },
                  (error) => showError(`Could not load the playground's settings: ${error.message}`));
