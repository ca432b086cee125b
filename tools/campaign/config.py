"""The campaign's config: tools/campaign/campaign.yaml (its keys and their `limits:`) over
the package's configs/defaults.yaml, merged and checked by the package's loader
(core/config.py) as the command line does it. The YAML lives here, not in configs/: the
campaign measures the package and is not part of what it installs. No torch import."""
from __future__ import annotations

from pathlib import Path

from resmlp.core.config import load_config

YAML = Path(__file__).with_name("campaign.yaml")


def load(overrides=()):
    """The campaign's config from `key=value` overrides, as `bash run.sh campaign` builds it."""
    return load_config("campaign", None, list(overrides), method=YAML)
