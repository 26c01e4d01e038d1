"""``proofplane attest eventlog`` and ``proofplane attest replay`` (offline, no server)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from typer.testing import CliRunner

from ci import SHARED, unavailable
from proofplane.attest import Evidence, Expected, Policy, make_record, verify
from proofplane.attest import eventlog as el
from proofplane.attest.simulate import SoftTpm
from proofplane.cli.main import app

LOGS = SHARED / "data" / "tcg-eventlogs"
T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
runner = CliRunner()


def _log() -> bytes:
    var = el.encode_efi_variable(el.EFI_GLOBAL_VARIABLE, "SecureBoot", b"\1")
    return el.build_eventlog([
        (0, el.EV_S_CRTM_VERSION, b"1.0"),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var),
        *[(i, el.EV_SEPARATOR, b"\0\0\0\0") for i in range(8)],
        (4, el.EV_EFI_BOOT_SERVICES_APPLICATION, b"\0" * 32,
         {"sha1": bytes(20), "sha256": b"\7" * 32}),
    ])  # fmt: skip


@pytest.fixture
def record_file(tmp_path: Path) -> Path:
    soft = SoftTpm(ec.derive_private_key(12345, ec.SECP256R1()))
    log = _log()
    for ev in el.parse_eventlog(log).events:
        if ev.extended:
            soft.extend(ev.pcr, ev.digests)
    nonce = b"\x42" * 32
    quote, sig, pcrs = soft.quote(nonce, list(range(10)))
    inv = {
        "gpus": [{"uuid": "GPU-1", "vbios_version": "96.00.5E.00.01", "driver_version": "550.1"}]
    }
    policy = Policy(id="sim", allowed_boot_apps=frozenset({b"\7" * 32}),
                    allowed_vbios=frozenset({"96.00.5E.00.01"}), min_driver="550")  # fmt: skip
    record, verdict = make_record(
        "node-7", Evidence(quote, sig, pcrs, log, inv), Expected(nonce, T0, soft.ak_public),
        policy, T0 + timedelta(seconds=3),
    )  # fmt: skip
    assert verdict.ok, verdict.messages
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record.to_json()))
    return path


def test_eventlog_json_matches_the_library(tmp_path: Path):
    path = tmp_path / "log.bin"
    path.write_bytes(_log())
    res = runner.invoke(app, ["attest", "eventlog", str(path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"sha1", "sha256"}
    want = el.replay(el.parse_eventlog(_log()))
    assert out["sha256"] == {str(i): v.hex() for i, v in want["sha256"].items()}


def test_eventlog_table_on_a_real_windows_log():
    path = LOGS / "p511.bin"
    if not path.exists():
        unavailable(f"shared event log {path} not present")
    res = runner.invoke(app, ["attest", "eventlog", str(path), "--events"])
    assert res.exit_code == 0, res.output
    assert "crypto-agile" in res.stdout and "EV_EFI_BOOT_SERVICES_APPLICATION" in res.stdout


def test_eventlog_bad_input(tmp_path: Path):
    res = runner.invoke(app, ["attest", "eventlog", str(tmp_path / "missing.bin")])
    assert res.exit_code == 2 and "no such file" in res.output
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\1\0\0\0\7\0\0\0" + b"\0" * 20 + b"\xff\xff\xff\x7f")
    res = runner.invoke(app, ["attest", "eventlog", str(junk)])
    assert (
        res.exit_code == 1
        and "not a valid event log" in res.output
        and "Traceback" not in res.output
    )


def test_replay_accepts_a_good_record(record_file: Path):
    res = runner.invoke(app, ["attest", "replay", str(record_file)])
    assert res.exit_code == 0, res.output
    assert "ACCEPTED" in res.stdout
    res = runner.invoke(app, ["attest", "replay", str(record_file), "--json"])
    out = json.loads(res.stdout)
    assert out["verdict"]["ok"] and out["matches_recorded_verdict"]


def test_replay_rejects_a_tampered_record(record_file: Path, tmp_path: Path):
    doc = json.loads(record_file.read_text())
    doc["evidence"]["inventory"]["gpus"][0]["vbios_version"] = "00.00.00.00.00"
    doc["verdict"] = None  # a forger would also drop the recorded verdict
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    res = runner.invoke(app, ["attest", "replay", str(bad)])
    assert res.exit_code == 1 and "REJECTED" in res.stdout and "vbios_not_allowed" in res.stdout
    # a changed PCR value under the signed digest
    doc = json.loads(record_file.read_text())
    doc["evidence"]["pcrs"]["sha256"]["4"] = "00" * 32
    bad.write_text(json.dumps(doc))
    res = runner.invoke(app, ["attest", "replay", str(bad), "--json"])
    out = json.loads(res.stdout)
    assert res.exit_code == 1 and out["verdict"]["reasons"] == ["pcr_digest_mismatch"]
    assert out["matches_recorded_verdict"] is False


def test_replay_bad_input(tmp_path: Path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    res = runner.invoke(app, ["attest", "replay", str(bad)])
    assert res.exit_code == 2 and "not an evidence record" in res.output
    bad.write_text(json.dumps({"version": 1, "evidence": {}, "expected": {}, "policy": {},
                               "verified_at": "2026-01-01T00:00:00+00:00"}))  # fmt: skip
    res = runner.invoke(app, ["attest", "replay", str(bad)])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_simulated_quote_verifies_and_fails_closed():
    soft = SoftTpm(ec.derive_private_key(7, ec.SECP256R1()))
    q, s, p = soft.quote(b"n" * 16, list(range(8)))
    empty = Policy(golden_pcrs={}, require_eventlog=False, require_secure_boot=False)
    exp = Expected(b"n" * 16, T0, soft.ak_public)
    assert verify(Evidence(q, s, p), exp, empty, T0).ok
    other = SoftTpm(ec.derive_private_key(8, ec.SECP256R1()))
    v = verify(Evidence(q, s, p), replace(exp, ak_public=other.ak_public), empty, T0)
    assert not v.ok and v.reasons == ("quote_signature_invalid",)
