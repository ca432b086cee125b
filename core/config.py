"""Config: YAML defaults in configs/, merged, then `key=value` overrides (OmegaConf dotlist).

Merge order, later wins:
    configs/defaults.yaml
    configs/method/<command>.yaml      (dino, knn, supervised, ...); a method file that says
                                       `extends: <other method>` is merged over that one
    configs/data/<data>.yaml           (image size, patch size, normalization per dataset)
    configs/recipe/<command>_<data>.yaml   (e.g. the paper's ImageNet schedules)
    command-line overrides
The merged config is in struct mode: a misspelled key is an error that names it.
`data=<name>` on the command line picks the dataset file (it is short for data.name).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from resmlp.core.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _load_yaml(path: Path) -> DictConfig:
    try:
        return OmegaConf.load(path)
    except OmegaConfBaseException as e:
        raise UserError(f"{path}: {e}".splitlines()[0]) from None


def method_config(command: str, _seen: tuple = ()) -> DictConfig:
    """configs/method/<command>.yaml over the method it `extends` (if any), recursively."""
    path = CONFIG_DIR / "method" / f"{command}.yaml"
    if not path.exists():
        return OmegaConf.create({})
    cfg = _load_yaml(path)
    base = cfg.pop("extends", None)
    if base is None:
        return cfg
    if base in _seen or base == command:
        raise UserError(f"{path}: `extends: {base}` makes a cycle ({' -> '.join((*_seen, command, base))})")
    if not (CONFIG_DIR / "method" / f"{base}.yaml").exists():
        raise UserError(f"{path}: `extends: {base}` names no file configs/method/{base}.yaml")
    return OmegaConf.merge(method_config(base, (*_seen, command)), cfg)


def split_overrides(args: Iterable[str]) -> list[str]:
    """Check that every argument is key=value; return them."""
    out = []
    for a in args:
        if "=" not in a or a.startswith("="):
            raise UserError(f"argument {a!r} is not key=value (e.g. epochs=10 data=cifar10)")
        out.append(a)
    return out


def _key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def _valid_keys_hint(cfg: DictConfig, key: str) -> str:
    parent, _, _ = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if isinstance(node, DictConfig):
        where = f"under {parent}" if parent else "at the top level"
        return f"; valid keys {where}: {', '.join(str(k) for k in node.keys())}"
    return ""


def load_config(command: str, model: str | None = None, overrides: Iterable[str] = (),
                base: dict | None = None) -> DictConfig:
    """Build the config of one command.

    `base` (a saved run config, e.g. from a checkpoint) is merged right after the
    yaml files, so evaluators default to the model and data a checkpoint was trained
    with while the command line still wins.
    """
    overrides = split_overrides(overrides)
    data = None
    rest = []
    for o in overrides:
        k, v = o.split("=", 1)
        if k == "data":
            data = v
        elif k == "model":
            model = v
        else:
            rest.append(o)
    if base is not None:
        model = model or OmegaConf.select(OmegaConf.create(base), "model.name")
        data = data or OmegaConf.select(OmegaConf.create(base), "data.name")

    # New keys may come from method files (their own sections); struct mode starts once
    # every file is in.
    cfg = OmegaConf.merge(_load_yaml(CONFIG_DIR / "defaults.yaml"), method_config(command))
    data = data or cfg.data.name
    data_file = CONFIG_DIR / "data" / f"{data}.yaml"
    if not data_file.exists():
        raise UserError(f"unknown dataset {data!r}; choose one of: {', '.join(available('data'))}")
    for path in (data_file, CONFIG_DIR / "recipe" / f"{command}_{data}.yaml"):
        if path.exists():
            cfg = OmegaConf.merge(cfg, _load_yaml(path))
    if base is not None:
        saved = OmegaConf.create(base)
        # Only what describes the network and its data carries over from a saved run.
        for section in ("model", "data"):
            if section in saved:
                OmegaConf.set_struct(cfg, True)
                cfg[section] = OmegaConf.merge(cfg[section], _known(saved[section], cfg[section]))
                OmegaConf.set_struct(cfg, False)
    cfg.command = command
    if model:
        cfg.model.name = model
    cfg.data.name = data

    OmegaConf.set_struct(cfg, True)
    cfg.demo = _demo_wanted(cfg, rest)
    if cfg.demo:
        rest = [*cfg.demo_overrides, *rest]  # the command line still wins
    for o in rest:
        key = _key_of(o)
        before = OmegaConf.select(cfg, key, default=None)
        try:
            cfg.merge_with_dotlist([o])
        except OmegaConfBaseException as e:
            if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
                raise UserError(f"unknown config key {key!r}{_valid_keys_hint(cfg, key)}") from None
            raise UserError(f"bad value in {o!r}: {str(e).splitlines()[0]}") from None
        _check_type(key, before, OmegaConf.select(cfg, key))
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise UserError(f"config error: {str(e).splitlines()[0]}") from None
    _check_missing(cfg)
    return cfg


def _check_type(key: str, before, after) -> None:
    """Untyped YAML accepts anything: keep numbers numbers and flags flags."""
    def kind(v):
        if isinstance(v, bool):
            return "true/false"
        if isinstance(v, (int, float)):
            return "a number"
        if isinstance(v, (list, ListConfig)):
            return "a list"
        return None
    want = kind(before)
    if want and kind(after) != want and not (want == "a list" and after is not None):
        raise UserError(f"{key}={after!r} should be {want} (the default is {before})")


def _demo_wanted(cfg: DictConfig, overrides: list[str]) -> bool:
    """demo=auto means: the short CPU demo when this machine has no GPU."""
    value = cfg.demo
    for o in overrides:
        if _key_of(o) == "demo":
            value = o.split("=", 1)[1]
    value = str(value).lower()
    if value not in ("auto", "true", "false"):
        raise UserError(f"demo={value!r} is not one of auto, true, false")
    if value == "auto":
        import torch
        return not torch.cuda.is_available()
    return value == "true"


def _known(saved: DictConfig, current: DictConfig) -> DictConfig:
    """The part of a saved section whose keys the current code still knows."""
    return OmegaConf.create({k: saved[k] for k in saved.keys() if k in current})


def _check_missing(cfg: DictConfig, prefix: str = "") -> None:
    for k in cfg.keys():
        key = f"{prefix}{k}"
        if OmegaConf.is_missing(cfg, k):
            raise UserError(f"config key {key!r} must be set (e.g. {key}=...)")
        v = cfg._get_node(k)
        if isinstance(v, DictConfig):
            _check_missing(v, key + ".")


def to_dict(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def save_config(cfg: DictConfig, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path, resolve=True)


def as_list(value) -> list:
    """A list from a list, a ListConfig, a scalar or a comma-separated string ("10,20")."""
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]
