"""`sync:` keys added for the transports load with defaults and reject bad values by name."""

from __future__ import annotations

import pytest

from rlslurm.configfile import load_mapping
from rlslurm.errors import ConfigError
from rlslurm.sync.config import SyncConfig


def test_defaults_and_values():
    cfg = load_mapping(SyncConfig, {"method": "disk", "weights_dir": "/shared/w", "keep_versions": 3})
    assert (cfg.weights_dir, cfg.keep_versions, cfg.store_port) == ("/shared/w", 3, 0)


@pytest.mark.parametrize("key,value,words", [
    ("keep_versions", 0, "sync.keep_versions = 0 must be >= 1"),
    ("store_port", 70000, "sync.store_port = 70000 must be a TCP port"),
    ("timeout_s", 0, "sync.timeout_s = 0.0 must be > 0"),
])
def test_bad_values_name_the_key(key, value, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_mapping(SyncConfig, {key: value}, source="job.yaml", key="sync")
