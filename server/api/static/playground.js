// Specula playground: chats with this server's /v1 API and colours every token by its origin.
//
// Replies stream with `stream_options: {include_speculation: true}`: each content chunk's choice carries
// `speculation: {tokens: [{text, origin, proposer, step}], draft_tokens, accepted_tokens, decode_steps}`
// (see docs/api.md). Each token becomes <span class="tok" data-origin data-proposer data-step>. The final
// chunk's `usage.speculation.fallbacks` names any proposer the server's fail-safe turned off for the reply
// (it then decoded without it): shown under the reply, so a method that did not run never looks like one
// that drafted nothing.
// The API key lives in the input field only: never stored.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), model: $("model"), method: $("method"), k: $("k"), temperature: $("temperature"),
  maxTokens: $("max-tokens"), race: $("race"), apiKey: $("api-key"), clear: $("clear"),
  legend: $("legend-items"), transcript: $("transcript"), composer: $("composer"), prompt: $("prompt"),
  send: $("send"),
};
const ORIGIN_COLOURS = { recovered: "--recovered", bonus: "--bonus" };
const KNOWN_PROPOSERS = ["ngram", "draft", "eagle", "suffix"];
const FIGURE_HELP = {
  tps: "tokens / seconds since the request was sent (prefill included)",
  acceptance: "accepted draft tokens / draft tokens",
  "per-pass": "tokens / target passes",
};
let history = [];  // [{role, content}] of the conversation so far
let busy = false;

// ---- server -------------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
}

// Fill the model and method controls from GET /v1/models (its `speculation` extension names the
// methods and the server's defaults). Retries while the model loads; waits for a key on 401.
async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    setStatus("error", `server unreachable (${err.message}); retrying…`);
    setTimeout(loadModels, 2000);
    return;
  }
  if (response.status === 401) {
    setStatus("error", "this server needs an API key: enter it on the left");
    return;
  }
  if (response.status === 503) {
    setStatus("loading", "the model is loading…");
    setTimeout(loadModels, 1500);
    return;
  }
  if (!response.ok) {
    setStatus("error", await errorText(response));
    return;
  }
  const models = (await response.json()).data;
  ui.model.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  const spec = models[0].speculation || { methods: ["none"], default_method: "none", default_num_tokens: 4 };
  ui.method.replaceChildren(...spec.methods.map((m) => new Option(m, m, false, m === spec.default_method)));
  ui.method.dataset.default = spec.default_method;
  ui.k.value = spec.default_num_tokens;
  renderLegend(spec.methods);
  ui.k.disabled = ui.method.value === "none";
  setStatus("ready", `${models[0].id} · default method ${spec.default_method}`);
  document.body.dataset.ready = "true";
}

function renderLegend(methods) {
  const proposers = methods.filter((m) => m !== "none" && m !== "auto");
  const items = proposers.map((p) => legendItem("accepted", p, `accepted draft (${p})`));
  items.push(legendItem("recovered", "", "recovered (at a rejection)"));
  items.push(legendItem("bonus", "", "bonus (all drafts accepted)"));
  items.push(legendItem("plain", "", "plain step (nothing drafted)"));
  ui.legend.replaceChildren(...items);
}

function legendItem(origin, proposer, label) {
  const li = document.createElement("li");
  const swatch = document.createElement("span");
  swatch.className = "swatch";  // styled like a token, but not one (tools read .tok)
  swatch.dataset.origin = origin;
  swatch.dataset.proposer = proposer;
  swatch.textContent = label;
  li.append(swatch);
  return li;
}

// The `data:` payloads of a server-sent event stream, parsed.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // pings are comments (":")
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ---- one streamed reply ---------------------------------------------------------------------------

class Reply {
  // `k`: the most drafts per pass, which sets the bar chart's scale (K + 1 tokens at most per pass)
  constructor(parent, label, k) {
    this.k = k;
    this.el = document.createElement("div");
    this.el.className = "reply";
    this.el.dataset.method = label;
    this.heading = document.createElement("h3");
    this.heading.textContent = label;
    this.text = document.createElement("div");
    this.text.className = "text";
    this.figures = document.createElement("div");
    this.figures.className = "figures";
    this.canvas = document.createElement("canvas");
    this.canvas.className = "steps";
    this.el.append(this.heading, this.text, this.figures, this.canvas);
    parent.append(this.el);
    this.tokens = 0;
    this.steps = [];  // per target pass: [{origin, proposer}] of the tokens it produced
    this.spec = { draft_tokens: 0, accepted_tokens: 0, decode_steps: 0 };
    this.content = "";
    this.started = 0;
    this.finished = 0;
    this.drawPending = false;
  }

  async run(body) {
    this.started = performance.now();
    this.el.dataset.state = "running";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body),
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) this.add(choice);
        if (chunk.usage && chunk.usage.speculation) this.showFallbacks(chunk.usage.speculation.fallbacks || []);
      }
      this.finished = performance.now();
      this.el.dataset.state = "done";
      this.heading.insertAdjacentHTML("beforeend", ' <span class="done">✓ done</span>');
    } catch (err) {
      this.finished = performance.now();
      this.el.dataset.state = "error";
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = err.message;
      this.el.append(p);
    }
    this.update();
    return this;
  }

  add(choice) {
    if (choice.delta && choice.delta.content) this.content += choice.delta.content;
    if (!choice.speculation) return;
    const frag = document.createDocumentFragment();
    for (const t of choice.speculation.tokens) {
      const span = document.createElement("span");
      span.className = "tok";
      span.dataset.origin = t.origin;
      span.dataset.proposer = t.proposer || "";
      span.dataset.step = t.step;
      span.title = `${t.origin}${t.proposer ? ` · ${t.proposer}` : ""} · pass ${t.step + 1}`;
      span.textContent = t.text;
      frag.append(span);
      (this.steps[t.step] ||= []).push({ origin: t.origin, proposer: t.proposer });
      this.tokens += 1;
    }
    this.text.append(frag);
    this.spec = choice.speculation;
    this.update();
  }

  // One line per proposer the fail-safe turned off for this reply: which, why, and where to look.
  showFallbacks(fallbacks) {
    for (const f of fallbacks) {
      const p = document.createElement("p");
      p.className = "fallback";
      p.dataset.role = "fallback";
      p.dataset.proposer = f.proposer;
      p.dataset.reason = f.reason;
      const why = f.reason === "switched_off"
        ? "it had failed too often and is switched off until the server restarts"
        : `it failed while drafting (${f.error || "an error"})`;
      p.textContent = `⚠ ${f.proposer} was turned off for this reply: ${why}; the reply decoded without it ` +
        "(same text, no drafts from it). /health lists it under degraded; the server's log has the error.";
      this.el.append(p);
    }
  }

  get seconds() {
    return ((this.finished || performance.now()) - this.started) / 1000;
  }

  get tokensPerSecond() {
    return this.seconds > 0 ? this.tokens / this.seconds : 0;
  }

  // Figures under the reply, redrawn at most once per frame while tokens stream in.
  update() {
    if (this.drawPending) return;
    this.drawPending = true;
    requestAnimationFrame(() => {
      this.drawPending = false;
      const s = this.spec;
      const rate = s.draft_tokens ? `${((100 * s.accepted_tokens) / s.draft_tokens).toFixed(0)}%` : "–";
      const perPass = s.decode_steps ? (this.tokens / s.decode_steps).toFixed(2) : "–";
      this.figures.replaceChildren(
        figure("tokens/s", this.tokensPerSecond.toFixed(1), "tps"),
        figure("acceptance", rate, "acceptance"),
        figure("tokens per target pass", perPass, "per-pass"),
        figure("tokens", String(this.tokens), "tokens"),
        figure("target passes", String(s.decode_steps), "passes"),
      );
      drawSteps(this.canvas, this.steps, this.k);
    });
  }
}

function figure(label, value, name) {
  const span = document.createElement("span");
  span.dataset.figure = name;
  if (FIGURE_HELP[name]) span.title = FIGURE_HELP[name];
  const b = document.createElement("b");
  b.textContent = value;
  span.append(b, ` ${label}`);
  return span;
}

function cssColour(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function tokenColour(token) {
  if (token.origin === "accepted") {
    const p = KNOWN_PROPOSERS.includes(token.proposer) ? token.proposer : "other";
    return cssColour(`--accepted-${p}`);
  }
  return ORIGIN_COLOURS[token.origin] ? cssColour(ORIGIN_COLOURS[token.origin]) : "#c4cad4";
}

// One bar per target pass, as tall as the tokens it produced, stacked in their origin colours.
function drawSteps(canvas, steps, k) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, width, height);
  if (!steps.length) return;
  const most = Math.max(k + 1, ...steps.map((s) => (s ? s.length : 0)));
  const slot = width / Math.max(steps.length, 24);
  const unit = (height - 2) / most;
  steps.forEach((tokens, i) => {
    (tokens || []).forEach((token, j) => {
      ctx.fillStyle = tokenColour(token);
      ctx.fillRect(i * slot + 0.5, height - (j + 1) * unit, Math.max(slot - 1, 1), unit - (unit > 4 ? 1 : 0));
    });
  });
}

// ---- a turn: one reply, or a race of `none` against the chosen method ---------------------------------

function requestBody(messages, method) {
  const body = {
    model: ui.model.value,
    messages,
    max_tokens: Number(ui.maxTokens.value),
    temperature: Number(ui.temperature.value),
    stream: true,
    stream_options: { include_usage: true, include_speculation: true },
    speculation: { method },
  };
  if (method !== "none") body.speculation.num_tokens = Number(ui.k.value);
  return body;
}

function showSpeedup(turn, plain, spec, how) {
  const div = document.createElement("div");
  div.className = "speedup";
  div.dataset.role = "speedup";
  if (plain.el.dataset.state !== "done" || spec.el.dataset.state !== "done") {
    div.textContent = "no speedup figure: a reply failed";
  } else {
    const speedup = spec.tokensPerSecond / plain.tokensPerSecond;
    const same = plain.content === spec.content ? " Same text, token for token." : "";
    div.innerHTML = `<b data-speedup="${speedup.toFixed(3)}">${speedup.toFixed(2)}×</b> ` +
      `speedup for <code>${spec.el.dataset.method}</code>: ${spec.tokensPerSecond.toFixed(1)} tok/s ` +
      `against ${plain.tokensPerSecond.toFixed(1)} tok/s for <code>none</code> (${how}).${same}`;
  }
  turn.append(div);
}

async function send() {
  const prompt = ui.prompt.value;
  if (busy || !prompt.trim()) return;
  if (document.body.dataset.ready !== "true") {
    ui.status.animate([{ opacity: 0.2 }, { opacity: 1 }], 600);  // the status line says what is missing
    return;
  }
  busy = true;
  ui.send.disabled = true;
  ui.prompt.value = "";
  const messages = [...history, { role: "user", content: prompt }];
  const turn = document.createElement("div");
  turn.className = "turn";
  const user = document.createElement("div");
  user.className = "user";
  user.textContent = prompt;
  const replies = document.createElement("div");
  replies.className = "replies";
  turn.append(user, replies);
  ui.transcript.append(turn);
  turn.scrollIntoView({ block: "end" });

  const method = ui.method.value;
  const k = method === "none" ? 0 : Number(ui.k.value);
  const race = ui.race.value;
  let answer;
  if (race === "off") {
    answer = await new Reply(replies, method, k).run(requestBody(messages, method));
  } else {
    replies.classList.add("race");
    turn.dataset.race = race;
    const plain = new Reply(replies, "none", k);  // same chart scale as its rival
    const spec = new Reply(replies, method, k);
    if (race === "together") {
      await Promise.all([plain.run(requestBody(messages, "none")), spec.run(requestBody(messages, method))]);
      showSpeedup(turn, plain, spec, "both at once, sharing the batch");
    } else {
      await plain.run(requestBody(messages, "none"));
      await spec.run(requestBody(messages, method));
      showSpeedup(turn, plain, spec, "one after the other");
    }
    answer = spec;
  }
  if (answer.el.dataset.state === "done") {
    history = [...messages, { role: "assistant", content: answer.content }];
  }
  turn.dataset.state = "done";
  turn.scrollIntoView({ block: "end" });
  busy = false;
  ui.send.disabled = false;
  ui.prompt.focus();
}

// ---- wiring -----------------------------------------------------------------------------------------

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
ui.clear.addEventListener("click", () => {
  history = [];
  ui.transcript.replaceChildren();
});
ui.apiKey.addEventListener("change", () => {
  if (document.body.dataset.ready !== "true") loadModels();
});
ui.method.addEventListener("change", () => {
  ui.k.disabled = ui.method.value === "none";
});
loadModels();
