"""The host key file (``kvxfer.hostkey``) and calls signed with it (``kvxfer.auth``)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from kvxfer import hostkey
from kvxfer.auth import CALL_S, CallBook, sign_call
from kvxfer.errors import ConfigError

KEY = b"k" * 64


def test_a_signed_call_counts_once_for_its_method_its_key_and_briefly() -> None:
    book = CallBook()
    aud = {"tcp:5701", "unix:/run/kvxfer/c.sock"}
    value = sign_call(KEY, "Drain", "tcp:5701", now=1000.0)
    assert book.check(KEY, "Drain", value, {"tcp:5711"}, now=1000.0) is not None  # another listener
    assert book.check(KEY, "Resume", value, aud, now=1000.0) is not None  # another method
    assert book.check(b"x" * 64, "Drain", value, aud, now=1000.0) is not None  # another key
    assert book.check(KEY, "Drain", value, aud, now=1000.0 + CALL_S + 1) is not None  # too late
    assert book.check(KEY, "Drain", value, aud, now=1000.0 - CALL_S - 1) is not None  # from the future
    assert book.check(KEY, "Drain", value, aud, now=1001.0) is None
    assert "already used" in (book.check(KEY, "Drain", value, aud, now=1001.0) or "")  # replayed
    for bad in ("", "v1", "v2.1.2.n.m", "v1.x.y.n.m", "v1.1.2.n", value.replace("v1", "v0", 1)):
        assert book.check(KEY, "Drain", bad, aud, now=1000.0) is not None, bad
    assert book.check(KEY, "Drain", sign_call(KEY, "Drain", "unix:/run/kvxfer/c.sock", now=1000.0), aud,
                      now=1000.0) is None  # a fresh nonce, for the other listener


def test_the_key_is_made_once_private_and_shared(tmp_path: Path) -> None:
    path = str(tmp_path / "kv" / "host.key")
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(hostkey.load(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1  # sidecars starting at once agree on one key
    assert len(keys[0]) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert hostkey.load(path) == keys[0]
    assert hostkey.read_if_allowed(path) == keys[0]
    assert hostkey.read_if_allowed(str(tmp_path / "none")) is None
    assert [n for n in os.listdir(os.path.dirname(path)) if n != "host.key"] == []  # no temp left


def test_a_key_others_could_read_or_replace_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "kv"
    path = str(d / "host.key")
    hostkey.load(path)
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match="readable or writable by others"):
        hostkey.load(path)
    os.chmod(path, 0o600)
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        hostkey.load(path)
    os.chmod(d, 0o700)
    os.unlink(path)
    (tmp_path / "elsewhere").write_bytes(KEY)
    os.chmod(tmp_path / "elsewhere", 0o600)
    os.symlink(tmp_path / "elsewhere", path)  # a planted link is never followed
    with pytest.raises(ConfigError, match="Too many levels of symbolic links"):
        hostkey.load(path)
    os.unlink(path)
    (d / "host.key").write_bytes(b"short")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="too short"):
        hostkey.load(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_default_paths(tmp_path: Path) -> None:
    assert hostkey.default_path({hostkey.ENV: "/x/k"}, euid=5) == "/x/k"
    assert hostkey.default_path({}, euid=0) == "/run/kvxfer/host.key"
    assert hostkey.default_path({"XDG_RUNTIME_DIR": "/run/user/4242"}, euid=4242) == \
        "/run/user/4242/kvxfer/host.key"  # (no uid 4242 owns /run/kvxfer here)
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 4242, 4242)
    assert hostkey.default_path({"HOME": str(home)}, euid=4242) == f"{home}/.local/state/kvxfer/host.key"
    assert hostkey.default_path({"HOME": "/"}, euid=4242) == "/tmp/kvxfer-4242/host.key"
    assert hostkey.default_path({}, euid=4242) == "/tmp/kvxfer-4242/host.key"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_directory_another_user_made_first_is_refused(tmp_path: Path) -> None:
    """The /tmp fallback can be squatted: whoever made the directory could swap the key."""
    d = tmp_path / "squat"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        hostkey.load(str(d / "host.key"))
