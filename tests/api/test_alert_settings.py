"""PROOFPLANE_ALERT* settings (issue 15, §8): checked when the server starts; a malformed one
is an error, never a default."""

from __future__ import annotations

import pytest

from proofplane.config import AlertSettings, alert_settings_from_env, from_env
from proofplane.errors import ValidationFailed


def test_defaults() -> None:
    s = alert_settings_from_env({})
    assert s == AlertSettings(interval_s=60.0)
    assert from_env({}).alerts == s


def test_receivers_and_files() -> None:
    s = alert_settings_from_env({
        "PROOFPLANE_ALERTMANAGER_URLS": "http://127.0.0.1:9093/, https://am.example:9093",
        "PROOFPLANE_ALERT_WEBHOOKS": "https://hooks.example/proofplane",
        "PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE": "/etc/proofplane/hook.token",
        "PROOFPLANE_ALERT_RULES": "/etc/proofplane/alert-rules.yaml",
        "PROOFPLANE_ALERT_INTERVAL_SECONDS": "0",
        "PROOFPLANE_EXTERNAL_URL": "https://pp.example",
    })  # fmt: skip
    assert s.alertmanagers == ("http://127.0.0.1:9093", "https://am.example:9093")
    assert s.webhooks == ("https://hooks.example/proofplane",)
    assert s.interval_s == 0 and s.external_url == "https://pp.example"


@pytest.mark.parametrize(
    "env",
    [
        {"PROOFPLANE_ALERTMANAGER_URLS": "ftp://am:21"},
        {"PROOFPLANE_ALERTMANAGER_URLS": "am.example:9093"},
        {"PROOFPLANE_ALERTMANAGER_URLS": "http://:9093"},
        {"PROOFPLANE_ALERTMANAGER_URLS": "http://am:99999"},
        {"PROOFPLANE_ALERT_WEBHOOKS": "https://user:secret@hooks.example/x"},
        {"PROOFPLANE_ALERT_WEBHOOK_TOKEN_FILE": "relative/token"},
        {"PROOFPLANE_ALERT_RULES": "rules.yaml"},
        {"PROOFPLANE_ALERT_INTERVAL_SECONDS": "-1"},
        {"PROOFPLANE_ALERT_INTERVAL_SECONDS": "soon"},
        {"PROOFPLANE_ALERT_INTERVAL_SECONDS": "nan"},
        {"PROOFPLANE_EXTERNAL_URL": "pp.example"},
    ],
)
def test_malformed_settings_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValidationFailed) as err:
        alert_settings_from_env(env)
    assert err.value.code == "invalid_setting"
    assert "secret" not in err.value.message
