"""The bench's configs: bench.yaml (`bash run.sh bench`'s keys, a profile of sizes each) and
profile.yaml (`python -m bench.profile`'s own keys) beside this file, over the package's
configs/defaults.yaml, merged and checked by the package's loader (core/config.py) as the
command line does it. The YAML lives here, not in configs/: the bench measures the package
and is not part of what it installs."""
from __future__ import annotations

from pathlib import Path

from resmlp.core.config import load_config

BENCH_YAML = Path(__file__).with_name("bench.yaml")
PROFILE_YAML = Path(__file__).with_name("profile.yaml")


def bench_config(overrides=(), model: str | None = "resmlp_s12"):
    """The bench's config from `key=value` overrides, as `bash run.sh bench` builds it."""
    return load_config("bench", model, list(overrides), method=BENCH_YAML)


def bench_profile(name: str, overrides=()):
    """The settings of bench profile `name` (gpu, cpu, tiny), with `overrides` (bench.<name>.* keys)."""
    return bench_config([f"bench.profile={name}", *overrides]).bench[name]


def profile_config(overrides=()):
    """profile.py's own keys (profile.*) from `key=value` overrides."""
    return load_config("profile", None, list(overrides), method=PROFILE_YAML)
