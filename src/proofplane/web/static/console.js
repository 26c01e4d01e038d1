// proofplane console: sign in, TOTP enrollment, sign out. Calls the JSON API with the
// session cookie; every state-changing call echoes the CSRF cookie in x-csrf-token.
"use strict";

function csrf() {
  const m = document.cookie.match(/(?:^|;\s*)proofplane_csrf=([^;]+)/);
  return m ? decodeURIComponent(m[1]) : "";
}

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    credentials: "same-origin",
    headers: { "content-type": "application/json", "x-csrf-token": csrf() },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
  if (!res.ok) {
    const err = (data && data.error) || { code: String(res.status), message: res.statusText };
    throw new Error(err.message + " (" + err.code + ")");
  }
  return data;
}

function show(id, text) {
  const el = document.getElementById(id);
  if (el) { el.textContent = text; }
}

function setupLogin() {
  const form = document.getElementById("login");
  if (!form) { return; }
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    show("login-error", "");
    const totp = form.totp.value.trim();
    try {
      const out = await api("POST", "/api/v1/auth/login", {
        username: form.username.value,
        password: form.password.value,
        totp: totp || null,
        cookie: true,
      });
      window.location.assign(out.mfa_enrollment_required ? "/enroll" : form.dataset.next || "/");
    } catch (e) {
      show("login-error", "Sign-in failed: " + e.message);
    }
  });
}

function setupEnroll() {
  const start = document.getElementById("enroll-start");
  if (!start) { return; }
  start.addEventListener("click", async () => {
    show("enroll-error", "");
    try {
      const out = await api("POST", "/api/v1/auth/mfa/enroll");
      const qr = await api("POST", "/console/qr", { uri: out.otpauth_uri });
      document.getElementById("qr").src = qr.qr;
      show("secret", out.secret);
      document.getElementById("enroll-qr").hidden = false;
      start.hidden = true;
      document.getElementById("code").focus();
    } catch (e) {
      show("enroll-error", "Enrollment failed: " + e.message);
    }
  });
  document.getElementById("enroll-confirm").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    show("enroll-error", "");
    try {
      const out = await api("POST", "/api/v1/auth/mfa/confirm", { totp: ev.target.code.value.trim() });
      const list = document.getElementById("recovery");
      for (const code of out.recovery_codes) {
        const li = document.createElement("li");
        li.textContent = code;
        list.appendChild(li);
      }
      document.getElementById("enroll-qr").hidden = true;
      document.getElementById("enroll-done").hidden = false;
    } catch (e) {
      show("enroll-error", "That code did not work: " + e.message);
    }
  });
}

function setupSignout() {
  const button = document.getElementById("signout");
  if (!button) { return; }
  button.addEventListener("click", async () => {
    try { await api("POST", "/api/v1/auth/logout"); } catch (e) { /* gone already */ }
    window.location.assign("/login");
  });
}

document.addEventListener("DOMContentLoaded", () => {
  setupLogin();
  setupEnroll();
  setupSignout();
});
