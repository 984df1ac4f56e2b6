// gpuorch dashboard: refresh the live parts of a page, follow a job's logs, show events as they arrive.
// Every page works without this script; it only keeps the numbers current without a reload.
"use strict";

function every(ms, fn) {
  const tick = async () => {
    if (!document.hidden) {
      try { await fn(); } catch (e) { /* the next tick tries again */ }
    }
    setTimeout(tick, ms);
  };
  setTimeout(tick, ms);
}

// <div data-live="URL" data-every="MS">: its content is replaced by URL's answer (the same template, server-side)
for (const el of document.querySelectorAll("[data-live]")) {
  every(+el.dataset.every || 3000, async () => {
    const r = await fetch(el.dataset.live, { credentials: "same-origin", cache: "no-store" });
    if (r.status === 401) { location.reload(); return; }
    if (!r.ok) return;
    const html = await r.text();
    if (el.querySelector(":hover") && el.id === "cluster") return; // keep a tooltip steady while it is read
    el.innerHTML = html;
    el.dataset.updated = String(Date.now());
  });
}

// <pre data-follow="URL" data-offset="N">: appends the task's output from N on
const logs = document.querySelector("[data-follow]");
if (logs && logs.dataset.active === "true") {
  every(1500, async () => {
    const r = await fetch(`${logs.dataset.follow}&offset=${logs.dataset.offset}`, { credentials: "same-origin" });
    if (!r.ok) return;
    const chunk = await r.json();
    if (chunk.data) {
      const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
      logs.append(document.createTextNode(chunk.data));
      if (atBottom) logs.scrollTop = logs.scrollHeight;
    }
    if (chunk.next_offset !== undefined) logs.dataset.offset = chunk.next_offset;
  });
}

// <table data-stream="URL" data-after="SEQ">: server-sent events, newest on top
const table = document.querySelector("[data-stream]");
if (table && window.EventSource) {
  const body = table.tBodies[0];
  const status = document.getElementById("stream-status");
  const sep = table.dataset.stream.includes("?") ? "&" : "?";
  const source = new EventSource(`${table.dataset.stream}${sep}after=${table.dataset.after}`);
  source.onopen = () => { if (status) status.textContent = "live: new events appear on top"; };
  source.onerror = () => { if (status) status.textContent = "reconnecting…"; };
  source.onmessage = (msg) => {
    const e = JSON.parse(msg.data);
    const tr = document.createElement("tr");
    tr.className = "fresh";
    for (const [key, cls] of [["seq", "num"], ["time", "when"], ["type", ""], ["subject", ""], ["summary", ""]]) {
      const td = document.createElement("td");
      if (cls) td.className = cls;
      if (key === "subject" && e.link) {
        const a = document.createElement("a");
        a.href = e.link;
        a.textContent = e.subject;
        td.append(a);
      } else {
        td.textContent = e[key] ?? "";
      }
      tr.append(td);
    }
    body.prepend(tr);
    while (body.rows.length > 500) body.deleteRow(-1);
  };
}
