"""``kv_connector_extra_config`` as an operator writes it (kvxfer.connector.settings): a typo
is said, not silently ignored; a value kvxfer cannot take names its key; a sidecar that is not
there says so (found by a new-user trial: ``"sidcar"`` fell back to the default socket and the
engine waited 60 s for "no ping answer")."""

from __future__ import annotations

import pytest

from kvxfer.client import SidecarClient
from kvxfer.connector.settings import DEFAULT_SIDECAR, ConnectorSettings
from kvxfer.errors import SidecarUnavailable


def test_a_key_kvxfer_does_not_know_is_warned_of_with_the_nearest_one(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="kvxfer.connector.settings"):
        s = ConnectorSettings.from_extra({"sidcar": "ipc:///x", "lease_secs": 5, "shared_storage_path": "/s"})
    assert s.sidecar == DEFAULT_SIDECAR  # (ignored, as before: another connector's keys may be there)
    assert "'sidcar'" in caplog.text
    assert "did you mean 'sidecar'?" in caplog.text
    assert "did you mean 'lease_s'?" in caplog.text
    assert "'shared_storage_path'" in caplog.text  # (no near one: kvxfer's keys listed)
    assert "transfer_timeout_s" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvxfer.connector.settings"):
        ConnectorSettings.from_extra({"sidecar": "ipc:///x", "kv_lease_duration": 10, "mode": "push"})
    assert caplog.text == ""


@pytest.mark.parametrize(("extra", "message"), [
    ({"lease_s": "abc"}, "lease_s must be a number, not 'abc'"),
    ({"send_queue": "1.5"}, "send_queue must be a whole number"),
    ({"lease_s": -1}, "lease_s must be above 0"),
    ({"heartbeat_s": 0}, "heartbeat_s must be above 0"),
    ({"grace_s": -0.5}, "grace_s must be 0 or more"),
    ({"sidecar": "/run/kvxfer/engine.sock"}, "sidecar must be an ipc:// or tcp:// endpoint"),
])
def test_a_value_kvxfer_cannot_take_names_its_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorSettings.from_extra(extra)


def test_a_sidecar_socket_that_is_not_there_is_named_in_the_error(tmp_path: object) -> None:
    client = SidecarClient(f"ipc://{tmp_path}/nothing.sock")
    try:
        with pytest.raises(SidecarUnavailable, match="no socket at .*nothing.sock: is a sidecar running"):
            client.ping(timeout=0.2)
    finally:
        client.close()
