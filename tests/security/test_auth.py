"""The pieces under the gateway's and the internal servers' guards, without a stack: the key
store (digests, file format, reload, fail-closed start-up), Bearer parsing, secrets kept out of
--help and logs, JSON log lines, how start-up lines name a link's protection."""

from __future__ import annotations

import json
import logging
import os

import pytest

from servicekit.auth import ConcurrencyLimits, KeyStore, bearer_token, key_digest
from servicekit.contract.errors import ResourceExhaustedError, UnauthenticatedError
from servicekit.tls import TlsFiles
from servicekit.tls import describe as describe_link


def test_keys_are_checked_by_digest_and_a_file_may_hold_digests(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# comment\n\n  plain-key  \nsha256:{key_digest('hashed-key').upper()}\n")
    store = KeyStore(["env-key"], str(keys_file))
    assert len(store) == 3
    for key in ("env-key", "plain-key", "hashed-key"):
        assert store.check(f"Bearer {key}") == key_digest(key)
    assert store.check("bearer   plain-key ") == key_digest("plain-key")  # scheme case-insensitive
    for header in (None, "", "Bearer", "Bearer ", "plain-key", "Basic plain-key", "Bearer other",
                   f"Bearer sha256:{key_digest('hashed-key')}"):  # a digest is not a key
        with pytest.raises(UnauthenticatedError):
            store.check(header)


def test_no_keys_means_open_and_a_bad_key_file_fails_at_start_up(tmp_path):
    assert KeyStore().check(None) == "" and not KeyStore().enabled
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeyStore((), str(empty))
    with pytest.raises(OSError):
        KeyStore((), str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text("sha256:not-hex\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        KeyStore((), str(bad))


def test_a_key_file_line_names_the_key_s_tenant_and_weight(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"alpha-key tenant=team-a weight=2.5\nsha256:{key_digest('beta-key')} tenant=team-b\n"
                         "gamma-key\n")
    store = KeyStore(["env-key weight=3"], str(keys_file))
    assert store.tenant(store.check("Bearer alpha-key")) == ("team-a", 2.5)
    assert store.tenant(store.check("Bearer beta-key")) == ("team-b", 1.0)
    assert store.tenant(store.check("Bearer gamma-key")) == (key_digest("gamma-key"), 1.0)  # unnamed: the digest
    assert store.tenant(store.check("Bearer env-key")) == (key_digest("env-key"), 3.0)
    assert KeyStore().tenant("") == ("", 1.0)
    with pytest.raises(UnauthenticatedError):
        store.check("Bearer alpha-key tenant=team-a")  # the options are not part of the key


@pytest.mark.parametrize("line, match", [
    ("secret-key tenant=", "entry 2: field 2 is not tenant=NAME"),
    ("secret-key color=red", "entry 2: field 2 is not tenant=NAME"),
    ("secret key", "entry 2: field 2 is not tenant=NAME"),  # a key with a space: refused, not half-read
    ("secret-key weight=0", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=-1", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=inf", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=nan", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=1e-300", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=1001", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=heavy", "weight must be a number from 0.001 to 1000"),
    ("secret-key weight=2 weight=3", "entry 2: field 3 gives weight a second time"),
    ("secret-key tenant=a tenant=b", "entry 2: field 3 gives tenant a second time"),
])
def test_a_bad_tenant_option_fails_at_start_up_without_showing_the_key(tmp_path, line, match):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"good-key\n{line}\n")
    with pytest.raises(ValueError, match=match) as caught:
        KeyStore((), str(keys_file))
    assert "secret" not in str(caught.value)


def test_the_key_file_reloads_and_a_broken_rewrite_keeps_the_old_keys(tmp_path, monkeypatch, caplog):
    import servicekit.auth as auth

    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)
    keys_file = tmp_path / "keys"
    keys_file.write_text("old-key\n")
    store = KeyStore((), str(keys_file))

    def rewrite(text: str) -> None:
        keys_file.write_text(text)
        st = os.stat(keys_file)
        os.utime(keys_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    rewrite("new-key\n")
    assert store.check("Bearer new-key")
    with pytest.raises(UnauthenticatedError):
        store.check("Bearer old-key")
    rewrite("sha256:broken\n")
    assert store.check("Bearer new-key")  # not reloaded: the file does not parse
    rewrite("")  # emptied on purpose: every key revoked, the store stays closed
    with pytest.raises(UnauthenticatedError):
        store.check("Bearer new-key")
    assert "new-key" not in caplog.text and "old-key" not in caplog.text


def test_a_secret_store_takes_the_token_literally():
    token = "sha256:" + "0" * 64  # looks like a digest; it is the token itself
    store = KeyStore.for_secret(token)
    assert store.check(f"Bearer {token}")
    assert not KeyStore.for_secret("").enabled


def test_start_up_lines_say_how_a_link_is_protected():
    assert describe_link(None) == describe_link(TlsFiles()) == "plaintext"
    assert describe_link(TlsFiles(), token=True) == "plaintext + internal token"
    assert describe_link(TlsFiles("c.pem", "k.pem")) == "TLS"  # a server without client certificates
    assert describe_link(TlsFiles(ca_file="ca.pem")) == "TLS"  # a client that only verifies its server
    assert describe_link(TlsFiles("c.pem", "k.pem", "ca.pem")) == "mutual TLS"


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER  abc  ") == "abc"
    assert bearer_token("Token abc") is None and bearer_token(None) is None


def test_per_key_concurrency_limits():
    limits = ConcurrencyLimits(2)
    limits.acquire("a")
    limits.acquire("a")
    limits.acquire("b")
    with pytest.raises(ResourceExhaustedError):
        limits.acquire("a")
    limits.release("a")
    limits.acquire("a")
    unlimited = ConcurrencyLimits(0)
    for _ in range(100):
        unlimited.acquire("a")


def test_secrets_do_not_show_in_help(capsys):
    from gateway_service.main import build_parser as gateway_parser
    from worker_service.main import build_parser as worker_parser

    env = {"PAGEDSERVE_API_KEYS": "key-one,key-two", "PAGEDSERVE_INTERNAL_TOKEN": "token-three"}
    text = gateway_parser(env).format_help() + worker_parser(env).format_help()
    assert "(set, not shown)" in text
    for secret in ("key-one", "key-two", "token-three"):
        assert secret not in text


def test_json_log_lines(capsys):
    from servicekit.serving import JsonFormatter

    record = logging.LogRecord("pagedserve.gateway", logging.INFO, __file__, 1, "request %s admitted", ("r1",), None)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "INFO" and entry["message"] == "request r1 admitted"
    assert entry["logger"] == "pagedserve.gateway" and "time" in entry


def test_a_setting_can_come_from_a_secret_file_and_is_then_never_shown(tmp_path):
    from gateway_service.main import build_parser, settings_from_args

    secret = tmp_path / "redis_url"
    secret.write_text("redis://gateway:pw-from-file@redis:6379/0\n")
    env = {"PAGEDSERVE_REDIS_URL_FILE": str(secret), "PAGEDSERVE_REDIS_URL": "redis://ignored:6379/0"}
    parser = build_parser(env)
    assert settings_from_args(parser.parse_args([])).redis_url == "redis://gateway:pw-from-file@redis:6379/0"
    assert "pw-from-file" not in parser.format_help()
    assert settings_from_args(parser.parse_args(["--redis-url", "redis://flag:6379/0"])).redis_url == \
        "redis://flag:6379/0"  # a flag still wins


def test_token_rate_limits_count_a_sliding_minute_per_key():
    from servicekit.auth import TokenRateLimits

    now = [1000.0]
    limits = TokenRateLimits(100, clock=lambda: now[0])
    limits.check("a")
    limits.charge("a", 60)
    now[0] += 30
    limits.charge("a", 40)
    with pytest.raises(ResourceExhaustedError):
        limits.check("a")
    limits.check("b")  # other keys have their own budget
    now[0] += 30.5  # the first 60 tokens left the window
    limits.check("a")
    limits.charge("a", 60)
    with pytest.raises(ResourceExhaustedError):
        limits.check("a")
    unlimited = TokenRateLimits(0)
    unlimited.charge("a", 10**9)
    unlimited.check("a")
