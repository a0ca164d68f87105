"""API keys at the gateway: the keys file, authentication, per-key rate limits and streams, reloads, tenant
cache salts. `tandem keys add` as a command, and a real gateway in front of a real worker, are in
tests/e2e/test_auth_stack.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import grpc
import pytest
import yaml

from gateway.auth import AuthError, KeyRing, KeysFileError, hash_key, parse_keys, presented_key
from gateway.server import add_args, check_args

KEY_A, KEY_B, KEY_C = "tdm_alpha-secret-0123456789", "tdm_beta-secret-0123456789", "tdm_gamma-secret-0123456789"


def entry(name: str, key: str, **extra) -> dict:
    return {"name": name, "sha256": hash_key(key), **extra}


def write(path: Path, *entries: dict) -> Path:
    path.write_text(yaml.safe_dump({"keys": list(entries)}))
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


# ---- the keys file ----------------------------------------------------------------------------------------------


def test_yaml_and_json_files_load(tmp_path):
    write(tmp_path / "keys.yaml", entry("a", KEY_A, requests_per_minute=60, max_concurrent_streams=2))
    (tmp_path / "keys.json").write_text(json.dumps([entry("b", KEY_B, share_cache=True)]))
    [a] = KeyRing.load(tmp_path / "keys.yaml").keys
    [b] = KeyRing.load(tmp_path / "keys.json").keys
    assert (a.name, a.requests_per_minute, a.max_concurrent_streams, a.share_cache) == ("a", 60, 2, False)
    assert (b.name, b.share_cache) == ("b", True)


@pytest.mark.parametrize(("doc", "match"), [
    ({"keys": [{"name": "a"}]}, r"keys\[0\] \(a\): sha256 must be"),
    ({"keys": [{"name": "a b", "sha256": "0" * 64}]}, "name must be"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "rpm": 3}]}, "unknown fields"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "requests_per_minute": 0}]}, "requests_per_minute"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "max_concurrent_streams": 1.5}]}, "max_concurrent_streams"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "cache_salt": "x\x00"}]}, "cache_salt"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "cache_salt": "x", "share_cache": True}]}, "not both"),
    ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "a", "sha256": "1" * 64}]}, "used twice"),
    ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "b", "sha256": "0" * 64}]}, "same key hash"),
    ({"keys": "a"}, "expected a list"),
])
def test_bad_entries_are_refused_with_where(doc, match):
    with pytest.raises(KeysFileError, match=match):
        parse_keys(doc)


def test_unreadable_or_invalid_file_stops_the_gateway_at_start(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyRing.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("keys: [\n")
    with pytest.raises(KeysFileError, match="not valid YAML"):
        KeyRing.load(tmp_path / "bad.yaml")
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--tokenizer", "x:1", "--decode-workers", "x:2", "--mode", "aggregated",
                              "--api-keys-file", str(tmp_path / "bad.yaml")])
    with pytest.raises(SystemExit, match="not valid YAML"):
        check_args(args)


# ---- authentication ---------------------------------------------------------------------------------------------


def test_metadata_forms():
    assert presented_key(bearer(KEY_A)) == KEY_A
    assert presented_key([("authorization", f"bearer   {KEY_A} ")]) == KEY_A
    assert presented_key([("x-api-key", KEY_B)]) == KEY_B
    assert presented_key([("authorization", f"Basic {KEY_A}")]) is None
    assert presented_key([("authorization", "Bearer ")]) is None
    assert presented_key([("x-api-key-bin", b"\x00")]) is None
    assert presented_key(None) is None


def test_authenticate_finds_the_key_and_never_echoes_it(tmp_path):
    ring = KeyRing.load(write(tmp_path / "k.yaml", entry("a", KEY_A), entry("b", KEY_B)))
    assert ring.authenticate(bearer(KEY_B)).name == "b"
    assert ring.authenticate([("x-api-key", KEY_A)]).name == "a"
    for metadata, match in ((bearer(KEY_C), "not valid"), ([], "needs an API key"), (bearer(KEY_A + "x"), "not valid")):
        with pytest.raises(AuthError, match=match) as err:
            ring.authenticate(metadata)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "secret" not in err.value.message


def test_rate_limit_is_a_token_bucket(tmp_path):
    clock = Clock()
    ring = KeyRing.load(write(tmp_path / "k.yaml", entry("a", KEY_A, requests_per_minute=2), entry("b", KEY_B)),
                        clock=clock)
    a = ring.authenticate(bearer(KEY_A))
    ring.admit(a).release()
    ring.admit(a).release()
    with pytest.raises(AuthError, match=r"'a' is over its rate limit of 2 requests per minute; retry in 30.0 s") as e:
        ring.admit(a)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(50):  # other keys are not limited by it
        ring.admit(ring.authenticate(bearer(KEY_B))).release()
    clock.now += 30  # one token back
    ring.admit(a).release()
    with pytest.raises(AuthError, match="rate limit"):
        ring.admit(a)


def test_concurrent_streams_limit(tmp_path):
    ring = KeyRing.load(write(tmp_path / "k.yaml", entry("a", KEY_A, max_concurrent_streams=2)))
    a = ring.authenticate(bearer(KEY_A))
    first, second = ring.admit(a), ring.admit(a)
    with pytest.raises(AuthError, match="'a' has 2 streams open, its limit of concurrent streams is 2") as e:
        ring.admit(a)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.release()
    first.release()  # idempotent
    third = ring.admit(a)
    second.release()
    third.release()
    assert ring.usage["a"].streams == 0


def test_the_file_is_read_again_when_it_changes(tmp_path, caplog):
    clock = Clock()
    path = write(tmp_path / "k.yaml", entry("a", KEY_A))
    ring = KeyRing.load(path, reload_interval_s=1.0, clock=clock)
    write(path, entry("a", KEY_A), entry("b", KEY_B, max_concurrent_streams=1))
    os.utime(path, ns=(1, 1))  # a new mtime even within the filesystem's timestamp granularity
    with pytest.raises(AuthError):  # not yet: at most once a second
        ring.authenticate(bearer(KEY_B))
    clock.now += 1.5
    assert ring.authenticate(bearer(KEY_B)).max_concurrent_streams == 1
    # A broken update keeps the keys loaded before (and says so once, without the file's content).
    path.write_text("keys: [ {name: a, sha256: nothex} ]")
    clock.now += 1.5
    with caplog.at_level(logging.ERROR, "tandem.gateway.auth"):
        assert ring.authenticate(bearer(KEY_B)).name == "b"
    assert "cannot be used" in caplog.text and "keeping the 2 keys" in caplog.text
    # A key removed from the file stops working.
    write(path, entry("b", KEY_B))
    clock.now += 1.5
    with pytest.raises(AuthError):
        ring.authenticate(bearer(KEY_A))


def test_a_kubernetes_secret_update_swaps_a_symlink(tmp_path):
    """Secret volumes hold keys.yaml -> ..data/keys.yaml, ..data -> ..<timestamp>; an update swaps ..data."""
    clock = Clock()
    (tmp_path / "..v1").mkdir()
    write(tmp_path / "..v1" / "keys.yaml", entry("a", KEY_A))
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "keys.yaml").symlink_to("..data/keys.yaml")
    ring = KeyRing.load(tmp_path / "keys.yaml", clock=clock)
    (tmp_path / "..v2").mkdir()
    write(tmp_path / "..v2" / "keys.yaml", entry("b", KEY_B))
    (tmp_path / "..tmp").symlink_to("..v2")
    os.replace(tmp_path / "..tmp", tmp_path / "..data")
    clock.now += 2
    assert ring.authenticate(bearer(KEY_B)).name == "b"


def test_tenant_salts():
    a, shared, team = parse_keys([entry("a", KEY_A), entry("s", KEY_B, share_cache=True),
                                  entry("t", KEY_C, cache_salt="team")])
    assert a.salt("") != a.salt("x") != shared.salt("x")
    assert shared.salt("x") == "x" and shared.salt("") == ""
    assert a.salt("x") == a.salt("x") and "\x00" in a.salt("")  # no client salt can be a tenant's (validation)
    assert team.salt("x") != a.salt("x")
    b_named_team = parse_keys([entry("team", KEY_A)])[0]
    assert b_named_team.salt("x") == team.salt("x")  # a cache_salt names a namespace keys may share
