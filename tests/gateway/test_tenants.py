"""Whose fair share a request counts against (the gateway's --tenant-from): its API key's tenant
from the keys file, or its end-user field."""

from __future__ import annotations

from gateway_service.main import tenant_resolver
from servicekit.auth import KeyStore, key_digest


def test_auto_takes_the_key_s_tenant_when_keys_are_configured(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("alpha-key tenant=team-a weight=2\nbeta-key\n")
    store = KeyStore((), str(keys_file))
    tenant_of = tenant_resolver(store, "auto")
    assert tenant_of(key_digest("alpha-key"), "someone") == ("team-a", 2.0)  # the user field does not choose
    assert tenant_of(key_digest("beta-key"), "someone") == (key_digest("beta-key"), 1.0)
    assert tenant_resolver(store, "user")(key_digest("alpha-key"), "someone") == ("someone", 0.0)


def test_auto_takes_the_user_field_without_keys():
    assert tenant_resolver(KeyStore(), "auto")("", "team-b") == ("team-b", 0.0)
    assert tenant_resolver(KeyStore(), "key")("", "team-b") == ("", 1.0)  # all one tenant
