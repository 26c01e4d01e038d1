// proofplane console: ask for an evidence package (a job), follow it, offer the download.
"use strict";

function evidenceCsrf() {
  const m = document.cookie.match(/(?:^|;\s*)proofplane_csrf=([^;]+)/);
  return m ? decodeURIComponent(m[1]) : "";
}

function say(text, cls) {
  const out = document.getElementById("evidence-status");
  out.replaceChildren();
  const p = document.createElement("p");
  p.textContent = text;
  if (cls) { p.className = cls; }
  out.appendChild(p);
  return out;
}

// A datetime-local value (minutes, or seconds with step=1) read as UTC.
function utc(value) { return value + (value.length === 16 ? ":00Z" : "Z"); }

async function follow(job) {
  while (job.status === "running") {
    say("Making the package (job " + job.id + ")…");
    await new Promise((r) => setTimeout(r, 1000));
    const res = await fetch("/api/v1/evidence/packages/" + job.id, { credentials: "same-origin" });
    job = await res.json();
  }
  if (job.status !== "done") {
    say("The package failed: " + (job.error ? job.error.message + " (" + job.error.code + ")" : "unknown error"), "bad");
    return;
  }
  const out = say("Package " + job.package + ": " + job.controls + " controls, " + job.exceptions + " with exceptions.", "good");
  const a = document.createElement("a");
  a.href = "/api/v1/evidence/packages/" + job.id + "/download";
  a.className = "button";
  a.textContent = "Download " + job.package + ".tar.gz";
  a.id = "evidence-download";
  out.appendChild(a);
}

document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("evidence-form");
  if (!form) { return; }
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = {
      framework: form.framework.value,
      from: utc(form.from.value),
      to: utc(form.to.value),
      tenant: form.tenant.value.trim() || null,
    };
    const res = await fetch("/api/v1/evidence/packages", {
      method: "POST",
      credentials: "same-origin",
      headers: { "content-type": "application/json", "x-csrf-token": evidenceCsrf() },
      body: JSON.stringify(body),
    });
    const data = await res.json();
    if (!res.ok) {
      say("Refused: " + data.error.message + " (" + data.error.code + ")", "bad");
      return;
    }
    await follow(data);
  });
});
