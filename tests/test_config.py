"""Configuration: one validated object; bad values and unknown keys name the key."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from sglang_tierstore.config import SETTINGS, TierStoreConfig, markdown_table
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
        ({"read_timeout_s": -0.5}, "read_timeout_s"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s"),
        ({"read_timeout_s": "1s"}, "read_timeout_s"),
        ({"capcity_gb": 1}, "capcity_gb"),
    ],
)
def test_bad_values_name_the_key(bad: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=repr(key)):
        TierStoreConfig.from_dict({"path": "/tmp/x", **bad})


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
    from pools import storage_config

    from sglang_tierstore import TierStoreBackend

    with pytest.raises(ConfigError, match="'lease_s'"):
        TierStoreBackend(storage_config({"path": "/tmp/x", "redis_url": "redis://127.0.0.1:1/0", "lease_s": 0}), {})


def test_deploy_example_config_is_valid() -> None:
    import json

    with open(os.path.join(ROOT, "deploy", "tierstore.json")) as f:
        cfg = TierStoreConfig.from_dict(json.load(f))
    assert cfg.redis_url and len(cfg.path) == 2
