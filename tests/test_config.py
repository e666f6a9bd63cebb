"""Configuration: one validated object; bad values and unknown keys name the key."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from sglang_tierstore.config import SETTINGS, ClusterSeeds, SentinelGroup, TierStoreConfig, markdown_table
from sglang_tierstore.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "bad,key",
    [
        ({"capacity_gb": -1}, "capacity_gb"),
        ({"capacity_gb": "big"}, "capacity_gb"),
        ({"capacity_gb": float("nan")}, "capacity_gb"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": 2.5}, "io_threads"),
        ({"io_threads": True}, "io_threads"),
        ({"o_direct": "yes"}, "o_direct"),
        ({"fsync": "always"}, "fsync"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"path": []}, "path"),
        ({"path": ["/a", "/a"]}, "path"),
        ({"path": 3}, "path"),
        ({"free_target": 0.9}, "free_target"),
        ({"file_size_mb": 4096}, "file_size_mb"),
        ({"redis_prefix": "a{b}"}, "redis_prefix"),
        ({"index_shards": 0}, "index_shards"),
        ({"index_shards": 1025}, "index_shards"),
        ({"redis_cluster": []}, "redis_cluster"),
        ({"redis_cluster": ["h"]}, "redis_cluster"),
        ({"redis_cluster": "h:1"}, "redis_cluster"),
        ({"redis_cluster": ["h:70000"]}, "redis_cluster"),
        ({"redis_cluster": ["http://h:1"]}, "redis_cluster"),
        ({"redis_cluster": ["redis://h:1/3"]}, "redis_cluster"),
        ({"redis_cluster": ["rediss://h:1", "redis://h:2"]}, "redis_cluster"),
        ({"redis_sentinel": {"nodes": ["h:1"]}}, "redis_sentinel"),
        ({"redis_sentinel": {"nodes": [], "master": "m"}}, "redis_sentinel"),
        ({"redis_sentinel": {"nodes": ["h:1"], "master": ""}}, "redis_sentinel"),
        ({"redis_sentinel": {"nodes": ["h:1"], "master": "m", "tsl": True}}, "redis_sentinel"),
        ({"redis_sentinel": {"nodes": ["h:1"], "master": "m", "tls": "yes"}}, "redis_sentinel"),
        ({"redis_sentinel": ["h:1"]}, "redis_sentinel"),
        ({"read_timeout_s": -0.5}, "read_timeout_s"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s"),
        ({"read_timeout_s": "1s"}, "read_timeout_s"),
        ({"capcity_gb": 1}, "capcity_gb"),
        ({"capacity_gb": 1e-4}, "capacity_gb"),  # 100 KiB: stored 0 of 24 pages
        ({"capacity_gb": 1e9}, "capacity_gb"),
        ({"lease_s": 0.001}, "lease_s"),  # stored 16 of 80 pages
        ({"housekeeping_s": 1e-6}, "housekeeping_s"),  # half a core and a quarter of Redis, idle
        ({"redis_prefix": "p" * 300}, "redis_prefix"),  # OSError: File name too long
        ({"redis_prefix": "../../etc"}, "redis_prefix"),
        ({"redis_prefix": "a/b"}, "redis_prefix"),
        ({"redis_prefix": ".hidden"}, "redis_prefix"),
        ({"io_threads": 100000}, "io_threads"),
        ({"redis_timeout_s": 0}, "redis_timeout_s"),
        ({"redis_retry_s": 1e-9}, "redis_retry_s"),
        ({"log_interval_s": 0}, "log_interval_s"),
    ],
)
def test_bad_values_name_the_key(bad: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=repr(key)):
        TierStoreConfig.from_dict({"path": "/tmp/x", **bad})


def test_limits_are_stated_and_enforced_at_both_ends() -> None:
    """Every number's limits are in the settings table, and a value just inside each
    limit is taken while one just outside is refused, naming the key and the limits."""
    numeric = {k: st for k, st in SETTINGS.items() if isinstance(st.default, (int, float)) and not isinstance(st.default, bool)}
    numeric["index_shards"] = SETTINGS["index_shards"]  # unset by default: chosen from the index
    assert set(numeric) >= {"capacity_gb", "lease_s", "housekeeping_s", "io_threads", "index_shards", "redis_timeout_s"}
    for key, st in numeric.items():
        assert st.limits, f"{key} states no limits"
        assert f"| {st.limits} |" in markdown_table()
    assert TierStoreConfig.from_dict({"path": "/x", "capacity_gb": 1 / 1024}).capacity_bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"'capacity_gb': expected .*got 0\.0009.*1 MiB"):
        TierStoreConfig.from_dict({"path": "/x", "capacity_gb": 0.999 / 1024})
    assert TierStoreConfig.from_dict({"path": "/x", "lease_s": 1, "housekeeping_s": 0.25}).lease_s == 1.0
    assert TierStoreConfig.from_dict({"path": "/x", "redis_prefix": "p" * 100}).redis_prefix == "p" * 100
    assert TierStoreConfig.from_dict({"path": "/x", "read_timeout_s": 0}).read_timeout_s == 0


@pytest.mark.parametrize("given", [("redis_url", "redis_cluster"), ("redis_url", "redis_sentinel"),
                                   ("redis_cluster", "redis_sentinel")])
def test_one_way_to_the_index_at_most(given: tuple[str, str]) -> None:
    values = {"redis_url": "redis://h:1/0", "redis_cluster": ["h:1", "h:2"],
              "redis_sentinel": {"nodes": ["h:1"], "master": "m"}}
    with pytest.raises(ConfigError, match=f"keys {given[0]!r}, {given[1]!r}: give one of them"):
        TierStoreConfig.from_dict({"path": "/x", **{k: values[k] for k in given}})


def test_a_cluster_or_a_sentinel_group_is_where_the_index_is() -> None:
    c = TierStoreConfig.from_dict({"path": "/x", "redis_cluster": ["127.0.0.1:7000", "redis://svc@h:7001"]})
    assert c.index_target == ClusterSeeds(("127.0.0.1:7000", "redis://svc@h:7001"))
    s = TierStoreConfig.from_dict({"path": "/x", "redis_sentinel": {"nodes": ["h:26379"], "master": "ts", "tls": True},
                                   "redis_tls_ca_file": "/ca.pem"})
    assert s.index_target == SentinelGroup(("h:26379",), "ts", True, False)
    assert TierStoreConfig.from_dict({"path": "/x"}).index_target is None  # the embedded index
    with pytest.raises(ConfigError, match=r"'redis_cluster': a seed carries no password.*redis://:\*\*\*@h:1"):
        TierStoreConfig.from_dict({"path": "/x", "redis_cluster": [f"redis://:{SECRET}@h:1"]})


def test_a_lease_must_outlive_the_housekeeping_passes_that_renew_it() -> None:
    with pytest.raises(ConfigError, match=r"'lease_s' and 'housekeeping_s': lease_s \(2\) must be at least 4 x "
                                          r"housekeeping_s \(1\)"):
        TierStoreConfig.from_dict({"path": "/x", "lease_s": 2, "housekeeping_s": 1})
    assert TierStoreConfig.from_dict({"path": "/x", "lease_s": 4, "housekeeping_s": 1}).lease_s == 4


def test_a_write_must_give_up_within_its_lease() -> None:
    with pytest.raises(ConfigError, match=r"'write_timeout_s' and 'lease_s': write_timeout_s \(60\) must be below "
                                          r"lease_s \(60\)"):
        TierStoreConfig.from_dict({"path": "/x", "write_timeout_s": 60})
    assert TierStoreConfig.from_dict({"path": "/x"}).write_timeout_s == 10.0
    assert TierStoreConfig.from_dict({"path": "/x", "write_timeout_s": 0}).write_timeout_s == 0  # wait for the disk
    with pytest.raises(ConfigError, match="'write_timeout_s'"):
        TierStoreConfig.from_dict({"path": "/x", "write_timeout_s": 0.0001})


SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize("url", [
    f"redis//:{SECRET}@host:6379/0",  # the two
    f"redis:/:{SECRET}@h:1/0",
    f"redis:{SECRET}@h:1/0",
    f"redis:///:{SECRET}@h:1/0",
    f"://:{SECRET}@h:1/0",
    f"redis://:{SECRET}",  # no '@': the password reads as a port
    f"redis://h:{SECRET}/0",
    f"redis://:{SECRET}@h:1/99x",
    f"redis://:{SECRET}@:1/0",
    f"redis://:pa#{SECRET}@h:1/0",  # characters that end the user part early
    f"redis://:pa?{SECRET}@h:1/0",
    f"redis://:pa/{SECRET}@h:1/0",
    f"redis://:{SECRET}@[::1:1/0",
    f"http://:{SECRET}@h:1/0",
    f"redis://h:1/0&password={SECRET}",
    f"redis://h:1/0?db=0&pass%77ord={SECRET}",
    f"unix:///run/r.sock?password={SECRET}&db=1&ssl_cert_reqs=none",
    f"rediss//user:{SECRET}@h",
    f"redis://user:{SECRET}@h:1/0?ssl_check_hostname=false",
])
def test_a_malformed_url_never_shows_its_password(url: str) -> None:
    from sglang_tierstore.config import redact_url

    assert SECRET not in redact_url(url)
    try:
        TierStoreConfig.from_dict({"path": "/x", "redis_url": url})
    except ConfigError as e:
        assert "'redis_url'" in str(e) and SECRET not in str(e)
    else:
        assert "pass%77ord" in url  # the one well-formed URL here (redis-py reads the option as the password)


def test_path_is_required_or_taken_from_file_storage_path() -> None:
    with pytest.raises(ConfigError, match="'path'"):
        TierStoreConfig.from_dict({"capacity_gb": 1})
    assert TierStoreConfig.from_dict({"file_storage_path": "/data/hicache"}).path == ("/data/hicache",)


def test_sglang_keys_are_accepted_and_values_typed() -> None:
    cfg = TierStoreConfig.from_dict(
        {
            "backend_name": "tierstore", "module_path": "sglang_tierstore", "class_name": "TierStoreBackend",
            "interface_v1": 1, "prefetch_threshold": 16, "tp_lcm_size": 2, "hicache_storage_pass_prefix_keys": True,
            "path": ["/nvme0/ts", "/nvme1/ts"], "capacity_gb": 2, "io_threads": 16, "fsync": "commit",
        }
    )
    assert cfg.path == ("/nvme0/ts", "/nvme1/ts")
    assert cfg.capacity_bytes == 2 << 30 and cfg.io_threads == 16 and cfg.fsync == "commit"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.capacity_gb = 3  # type: ignore[misc]


def test_the_configuration_doc_lists_every_key_with_its_default() -> None:
    doc = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    assert markdown_table() in doc, "docs/configuration.md's table is stale: python -m sglang_tierstore.config"
    assert set(SETTINGS) >= {"redis_url", "path", "capacity_gb"}


def test_adapter_rejects_a_bad_config_naming_the_key() -> None:
    from tierstore_kit.pools import storage_config

    from sglang_tierstore import TierStoreBackend

    with pytest.raises(ConfigError, match="'lease_s'"):
        TierStoreBackend(storage_config({"path": "/tmp/x", "redis_url": "redis://127.0.0.1:1/0", "lease_s": 0}), {})


def test_deploy_example_config_is_valid() -> None:
    import json

    with open(os.path.join(ROOT, "deploy", "tierstore.json")) as f:
        cfg = TierStoreConfig.from_dict(json.load(f))
    assert cfg.redis_url and len(cfg.path) == 2
