// proofplane audit page: verify the log in this browser. Nothing the server says is taken on
// trust: the checkpoint's Ed25519 signature is checked (WebCrypto) against the verifier key
// pinned in this browser, the entry's RFC 9162 leaf hash is recomputed from its bytes
// (SHA-256 of 0x00 || entry), and the inclusion proof is folded up to the signed root. The
// checkpoint seen last is kept, and a consistency proof shows the log only grew since.
"use strict";

const SIG_PREFIX = "\u2014 ";
const PIN = "proofplane.pinnedVerifier";
const SEEN = "proofplane.seenCheckpoint";

class Failure extends Error {}

function b64decode(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) { out[i] = bin.charCodeAt(i); }
  return out;
}
function b64encode(bytes) { return btoa(String.fromCharCode(...bytes)); }
function hex(bytes) { return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join(""); }
function unhex(s) {
  if (!/^([0-9a-f]{2})*$/i.test(s)) { throw new Failure("not a hex string: " + s); }
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) { out[i] = parseInt(s.substr(i * 2, 2), 16); }
  return out;
}
function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) { out.set(p, at); at += p.length; }
  return out;
}
function equal(a, b) { return a.length === b.length && a.every((x, i) => x === b[i]); }
async function sha256(bytes) { return new Uint8Array(await crypto.subtle.digest("SHA-256", bytes)); }
const leafHash = (entry) => sha256(concat(new Uint8Array([0]), entry));
const nodeHash = (l, r) => sha256(concat(new Uint8Array([1]), l, r));

// --- C2SP signed notes and checkpoints -------------------------------------------------------

async function parseKey(text) {
  const m = text.trim().match(/^([^+\s]+)\+([0-9a-fA-F]{8})\+([A-Za-z0-9+/=]+)$/);
  if (!m) { throw new Failure("the verifier key is not <name>+<key id>+<base64>"); }
  const [, name, kid, b64] = m;
  const raw = b64decode(b64);
  if (raw.length !== 33 || raw[0] !== 1) { throw new Failure("the verifier key is not an Ed25519 key"); }
  const pub = raw.slice(1);
  const id = (await sha256(concat(new TextEncoder().encode(name + "\n"), new Uint8Array([1]), pub))).slice(0, 4);
  if (hex(id) !== kid.toLowerCase()) { throw new Failure("the verifier key's id does not match its key"); }
  return { name, id, pub, text: text.trim() };
}

async function openNote(note, key) {
  const sep = note.lastIndexOf("\n\n");
  if (sep < 0) { throw new Failure("the checkpoint is not a signed note"); }
  const text = note.slice(0, sep + 1);
  const sigs = note.slice(sep + 2).split("\n").filter((l) => l);
  const pub = await crypto.subtle.importKey("raw", key.pub, { name: "Ed25519" }, false, ["verify"]);
  for (const line of sigs) {
    if (!line.startsWith(SIG_PREFIX)) { throw new Failure("malformed signature line"); }
    const [name, blob] = line.slice(SIG_PREFIX.length).split(" ");
    const raw = b64decode(blob);
    if (name !== key.name || !equal(raw.slice(0, 4), key.id)) { continue; }
    const ok = await crypto.subtle.verify("Ed25519", pub, raw.slice(4), new TextEncoder().encode(text));
    if (!ok) { throw new Failure("the checkpoint's Ed25519 signature does not verify with the pinned key"); }
    return text;
  }
  throw new Failure("the checkpoint carries no signature by the pinned key " + key.name);
}

function parseCheckpoint(text) {
  const lines = text.slice(0, -1).split("\n");
  if (lines.length < 3 || !/^(0|[1-9][0-9]*)$/.test(lines[1])) { throw new Failure("malformed checkpoint"); }
  const root = b64decode(lines[2]);
  if (root.length !== 32) { throw new Failure("the checkpoint root is not a SHA-256 hash"); }
  return { origin: lines[0], size: Number(lines[1]), root };
}

// --- RFC 9162 proofs (section 2.1.3.2 and 2.1.4.2) -------------------------------------------

async function rootFromInclusion(leaf, index, size, proof) {
  if (index >= size) { throw new Failure("entry " + index + " is newer than the newest signed checkpoint (" + size + " entries): verify it after the next checkpoint"); }
  let fn = index, sn = size - 1, r = leaf;
  for (const p of proof) {
    if (sn === 0) { throw new Failure("the inclusion proof is too long"); }
    if (fn % 2 === 1 || fn === sn) {
      r = await nodeHash(p, r);
      while (fn % 2 === 0 && fn !== 0) { fn = Math.floor(fn / 2); sn = Math.floor(sn / 2); }
    } else {
      r = await nodeHash(r, p);
    }
    fn = Math.floor(fn / 2); sn = Math.floor(sn / 2);
  }
  if (sn !== 0) { throw new Failure("the inclusion proof is too short"); }
  return r;
}

async function verifyConsistency(oldSize, newSize, oldRoot, newRoot, proof) {
  if (oldSize > newSize) { throw new Failure("the log shrank: the new checkpoint is smaller"); }
  if (oldSize === newSize) {
    if (proof.length || !equal(oldRoot, newRoot)) { throw new Failure("same size, different roots: the log was rewritten"); }
    return;
  }
  let path = proof.slice();
  if ((oldSize & (oldSize - 1)) === 0) { path = [oldRoot, ...path]; }
  if (!path.length) { throw new Failure("empty consistency proof"); }
  let fn = oldSize - 1, sn = newSize - 1;
  while (fn % 2 === 1) { fn = Math.floor(fn / 2); sn = Math.floor(sn / 2); }
  let fr = path[0], sr = path[0];
  for (const c of path.slice(1)) {
    if (sn === 0) { throw new Failure("the consistency proof is too long"); }
    if (fn % 2 === 1 || fn === sn) {
      fr = await nodeHash(c, fr); sr = await nodeHash(c, sr);
      while (fn % 2 === 0 && fn !== 0) { fn = Math.floor(fn / 2); sn = Math.floor(sn / 2); }
    } else {
      sr = await nodeHash(sr, c);
    }
    fn = Math.floor(fn / 2); sn = Math.floor(sn / 2);
  }
  if (sn !== 0 || !equal(fr, oldRoot)) { throw new Failure("the consistency proof does not lead to the old checkpoint's root: the log was rewritten"); }
  if (!equal(sr, newRoot)) { throw new Failure("the consistency proof does not lead to the new checkpoint's root"); }
}

// --- the page ----------------------------------------------------------------------------------

async function get(path, asText) {
  const res = await fetch(path, { credentials: "same-origin" });
  if (!res.ok) { throw new Failure("the server answered " + res.status + " for " + path.split("?")[0]); }
  return asText ? res.text() : res.json();
}

function pinnedKeyText() { return localStorage.getItem(PIN); }

function showPinned() {
  const el = document.getElementById("pinned-key");
  if (el) { el.textContent = pinnedKeyText() || "none"; }
  const seen = JSON.parse(localStorage.getItem(SEEN) || "null");
  const s = document.getElementById("seen-checkpoint");
  if (s) { s.textContent = seen ? "This browser last saw a verified checkpoint of size " + seen.size + "." : "This browser has not verified a checkpoint yet."; }
}

function report(ok, lines) {
  const out = document.getElementById("verify-result");
  out.replaceChildren();
  const head = document.createElement("p");
  head.className = ok ? "good verdict" : "bad verdict";
  head.textContent = ok ? "verified" : "NOT verified";
  out.appendChild(head);
  for (const line of lines) {
    const p = document.createElement("p");
    p.textContent = line;
    out.appendChild(p);
  }
  out.scrollIntoView({ block: "nearest" });
}

async function signedCheckpoint() {
  const pinned = pinnedKeyText();
  if (!pinned) { throw new Failure("no verifier key is pinned in this browser: pin one first"); }
  const key = await parseKey(pinned);
  const note = await get("/api/v1/audit/checkpoint", true);
  const cp = parseCheckpoint(await openNote(note, key));
  return { cp, key };
}

function remember(cp) {
  localStorage.setItem(SEEN, JSON.stringify({ origin: cp.origin, size: cp.size, root: b64encode(cp.root) }));
  showPinned();
}

async function run(task) {
  try {
    report(true, await task());
  } catch (e) {
    report(false, [e instanceof Failure ? e.message : "error: " + e.message]);
  }
}

async function verifyEntry(index) {
  const { cp, key } = await signedCheckpoint();
  const data = await get("/api/v1/audit/entries?start=" + index + "&end=" + (index + 1));
  if (!data.entries.length) { throw new Failure("the server returned no entry " + index); }
  const entry = b64decode(data.entries[0].entry);
  const leaf = await leafHash(entry);
  if (hex(leaf) !== data.entries[0].leaf_hash) { throw new Failure("entry " + index + ": its leaf hash does not match its bytes"); }
  const proof = await get("/api/v1/audit/proof/inclusion?index=" + index + "&tree_size=" + cp.size);
  const root = await rootFromInclusion(leaf, index, cp.size, proof.proof.map(unhex));
  if (!equal(root, cp.root)) { throw new Failure("entry " + index + ": the inclusion proof does not lead to the signed checkpoint's root"); }
  remember(cp);
  const event = JSON.parse(new TextDecoder().decode(entry));
  return [
    "Entry " + index + " (" + event.action + " on " + event.target_type + " " + event.target_id + " by " + event.actor + ") is in the log " + cp.origin + " of " + cp.size + " entries.",
    "Leaf hash " + hex(leaf) + " recomputed here; root " + hex(cp.root) + " signed by " + key.name + " (Ed25519, checked here).",
  ];
}

async function verifyCheckpointOnly() {
  const { cp, key } = await signedCheckpoint();
  remember(cp);
  return ["Checkpoint of " + cp.size + " entries, root " + hex(cp.root) + ", signed by " + key.name + " (Ed25519, checked here)."];
}

async function checkConsistency() {
  const seen = JSON.parse(localStorage.getItem(SEEN) || "null");
  if (!seen) { throw new Failure("this browser has not verified a checkpoint before: verify one first"); }
  const { cp } = await signedCheckpoint();
  const oldRoot = b64decode(seen.root);
  let proof = [];
  if (seen.size !== cp.size) {
    const data = await get("/api/v1/audit/proof/consistency?old_size=" + seen.size + "&new_size=" + cp.size);
    proof = data.proof.map(unhex);
  }
  await verifyConsistency(seen.size, cp.size, oldRoot, cp.root, proof);
  remember(cp);
  return ["The log of " + cp.size + " entries extends the one of " + seen.size + " entries this browser saw: nothing was rewritten."];
}

document.addEventListener("DOMContentLoaded", () => {
  const section = document.getElementById("checkpoint");
  if (!section) { return; }
  showPinned();
  document.getElementById("pin-server-key").addEventListener("click", () => {
    const key = section.dataset.verifier;
    if (key) { localStorage.setItem(PIN, key); showPinned(); }
  });
  document.getElementById("pin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = ev.target.key.value.trim();
    await run(async () => { await parseKey(text); localStorage.setItem(PIN, text); showPinned(); return ["pinned " + text]; });
  });
  document.getElementById("verify-checkpoint").addEventListener("click", () => run(verifyCheckpointOnly));
  document.getElementById("check-consistency").addEventListener("click", () => run(checkConsistency));
  for (const button of document.querySelectorAll(".verify-entry")) {
    button.addEventListener("click", () => run(() => verifyEntry(Number(button.dataset.index))));
  }
});
