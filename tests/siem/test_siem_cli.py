"""``proofplane sinks add`` configures what the sink API accepts, HEC acknowledgement included,
and a refused configuration is a message and a non-zero exit with nothing stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from live_server import serve
from proofplane.cli.main import app
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate

TOKEN = "ppt_sinks-cli-admin-token-0123456789"
CHANNEL = "0F3C2A8E-1B2D-4C5E-8F90-A1B2C3D4E5F6"
runner = CliRunner()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    store = Store(f"sqlite:///{tmp_path / 'cli.db'}")
    migrate.upgrade(store.engine)
    assert bootstrap_admin(store, TOKEN)
    with serve(store) as url:
        yield url
    store.dispose()


def cli(server: str, *args: str) -> Any:
    return runner.invoke(app, ["--server", server, "--token", TOKEN, *args])


def test_add_a_hec_sink_with_indexer_acknowledgement(server: str) -> None:
    added = cli(server, "sinks", "add", "splunk", "--type", "splunk-hec",
                "--url", "https://127.0.0.1:8088", "--hec-token", "t0k3n", "--hec-ack",
                "--hec-channel", CHANNEL, "--ack-timeout", "5", "--json")  # fmt: skip
    assert added.exit_code == 0, added.output
    config = json.loads(added.stdout)["config"]
    assert config["ack"] is True and config["channel"] == CHANNEL.lower()
    assert config["ack_timeout_s"] == 5 and config["token"] != "t0k3n"  # redacted
    plain = cli(server, "sinks", "add", "plain", "--type", "splunk-hec",
                "--url", "https://127.0.0.1:8088", "--hec-token", "t0k3n", "--json")  # fmt: skip
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["config"]["ack"] is False


@pytest.mark.parametrize(
    "bad",
    [
        ["--hec-channel", "not-a-uuid"],
        ["--hec-ack", "--ack-timeout", "0"],
        ["--hec-ack", "--ack-timeout", "601"],
    ],
)
def test_a_refused_hec_configuration_exits_non_zero_and_stores_nothing(
    server: str, bad: list[str]
) -> None:
    result = cli(server, "sinks", "add", "splunk", "--type", "splunk-hec",
                 "--url", "https://127.0.0.1:8088", "--hec-token", "t", *bad)  # fmt: skip
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "invalid_sink_config" in result.output or "422" in result.output, result.output
    listed = cli(server, "sinks", "list", "--json")
    assert listed.exit_code == 0 and json.loads(listed.stdout)["items"] == []
