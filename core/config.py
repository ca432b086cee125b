"""Config: YAML defaults in configs/, merged, then `key=value` overrides (OmegaConf dotlist).

Merge order, later wins:
    configs/defaults.yaml
    configs/method/<command>.yaml      (dino, knn, supervised, ...); a method file that says
                                       `extends: <other method>` is merged over that one
    configs/data/<data>.yaml           (image size, patch size, normalization per dataset)
    the recipe: configs/recipe/<command>_<data>.yaml where it exists (e.g. the paper's
                ImageNet schedules), or the recipes `recipe=` names (none: no recipe)
    what a saved run carries over (an evaluator's checkpoint: its model and data)
    the recipe `demo` when the demo applies (demo=true, or demo=auto without a GPU)
    command-line overrides
The merged config is in struct mode: a misspelled key is an error that names it.
`data=<name>` on the command line picks the dataset file (it is short for data.name).

A recipe <name> is the file configs/recipe/<name>.yaml and, where it has a folder
configs/recipe/<name>/, that folder's method/<command>.yaml (or the file of the nearest
method the command extends) and data/<data>.yaml (only where the network starts here: a
command that reads a saved run keeps its model and data). Its keys are checked as the
command line's are; config.yaml keeps the list of the recipes applied (`recipe`).

Two sections of defaults.yaml and of each method file are not config keys but what the
file says about its keys; they are taken out before anything else reads the config:
    limits:   key -> the numbers it may hold (a `Limit` kind or fields, see LIMIT_KINDS)
    moved:    old key -> the key that replaced it (naming the old one is an error)
    paths:    key -> what file or folder it names; a relative value is made absolute against
              the folder the command was started in, so that the saved config.yaml means
              the same files from wherever the run is resumed or evaluated (timm's weights,
              core/weights.py, and null stay as they are)
A method file's sections add to those of the method it extends and of defaults.yaml.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from resmlp.core.errors import UserError
from resmlp.core.weights import names_timm

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# For what is read of a file before OmegaConf merges it (`extends:`, `limits:`): libyaml's
# loader, ten times the pure-Python one's speed.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# What of a run's data section describes its network's input: carried over to an evaluation
# of the run on another data set (data=<name> on the command line).
TRAINED_ON = ("img_size", "mean", "std")


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _load_yaml(path: Path) -> DictConfig:
    try:
        return OmegaConf.load(path)
    except OmegaConfBaseException as e:
        raise UserError(f"{path}: {e}".splitlines()[0]) from None


def _method_chain(command: str) -> list[str]:
    """The command's method and each method it `extends`, nearest first (finetune, supervised);
    none where the command has no file in configs/method/."""
    chain: list = []
    name = command
    while name is not None:
        path = CONFIG_DIR / "method" / f"{name}.yaml"
        if not path.exists():
            if not chain:
                return chain
            raise UserError(f"{CONFIG_DIR / 'method' / chain[-1]}.yaml: `extends: {name}` names no file "
                            f"configs/method/{name}.yaml")
        chain.append(name)
        with open(path) as f:
            name = (yaml.load(f, Loader=_YAML_LOADER) or {}).get("extends")
        if name in chain:
            raise UserError(f"{path}: `extends: {name}` makes a cycle ({' -> '.join([*chain, name])})")
    return chain


def method_config(command: str, path: Path | None = None) -> DictConfig:
    """configs/method/<command>.yaml over the method it `extends` (if any), recursively; or the
    file `path`, a tool's own outside the package (tools/campaign), over the methods it extends."""
    if path is not None:
        own = _load_yaml(path)
        base = own.pop("extends", None)
        return OmegaConf.merge(method_config(base) if base else OmegaConf.create({}), own)
    files = [_load_yaml(CONFIG_DIR / "method" / f"{name}.yaml") for name in reversed(_method_chain(command))]
    for cfg in files:
        cfg.pop("extends", None)
    return OmegaConf.merge(OmegaConf.create({}), *files)


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
    parent, _, leaf = key.rpartition(".")
    # a key given at the wrong level (n_per_class= for knn.n_per_class=): name where it lives
    nested = [path for path in _key_paths(OmegaConf.to_container(cfg, resolve=False))
              if path.rpartition(".")[2] == leaf and path != key]
    if nested:
        return f"; did you mean {' or '.join(nested)}?"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if isinstance(node, DictConfig):
        where = f"under {parent}" if parent else "at the top level"
        return f"; valid keys {where}: {', '.join(str(k) for k in node.keys())}"
    return ""


def _key_paths(tree: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a nested dict, sections and leaves."""
    paths = []
    for k, v in tree.items():
        paths.append(f"{prefix}{k}")
        if isinstance(v, dict):
            paths.extend(_key_paths(v, f"{prefix}{k}."))
    return paths


def load_config(command: str, model: str | None = None, overrides: Iterable[str] = (),
                base: dict | None = None, method: Path | None = None) -> DictConfig:
    """Build the config of one command.

    `base` (a saved run config, e.g. from a checkpoint) is merged right after the
    recipe, so evaluators default to the model and data a checkpoint was trained
    with while the command line still wins. `method`: the command's method file when it
    is not configs/method/<command>.yaml (a tool of the repository, e.g. tools/campaign).
    """
    model, data, rest = _names(split_overrides(overrides), model, base)
    cfg, rules, data = _layers(command, data, method)
    settings = _Settings(cfg, *rules)
    names, rest = _recipes_wanted(cfg, rest, command, data)
    for name in names:
        settings.recipe(name, command, data, base is None)
    if base is not None:
        _carry_over(cfg, OmegaConf.create(base), data)
        settings.carried()
    cfg.command = command
    if model:
        cfg.model.name = model
    cfg.data.name = data
    cfg.demo, rest = _demo_wanted(cfg, rest, settings.limits["demo"])
    if cfg.demo:  # after what a saved run carries over, as the command line
        settings.recipe(DEMO, command, data, base is None)
    cfg.recipe = [*names, *([DEMO] if cfg.demo and DEMO not in names else [])]
    for o in rest:  # the command line, last: it wins
        settings.set(_key_of(o), o, lambda: cfg.merge_with_dotlist([o]), f"{o} came earlier on the command line")
    _finish(cfg, settings.limits, settings.paths)
    return cfg


class _Settings:
    """Sets keys of the merged config one at a time, from a recipe's files or the command
    line, each checked as it comes (a moved or unknown key, a value of the wrong kind or
    outside its words), and keeps where each value came from for the messages."""

    def __init__(self, cfg: DictConfig, limits: dict, moved: dict, paths: list):
        self.cfg, self.limits, self.moved, self.paths = cfg, limits, moved, paths
        self.origin: dict = {}   # key -> where the value it holds now came from
        self.saved = False       # model and data keys came from a saved run

    def recipe(self, name: str, command: str, data: str, network_here: bool) -> None:
        """Merge the files of recipe `name` (recipe_files), key by key."""
        for path in recipe_files(name, command, data, network_here):
            where = _shown_path(path)
            tree = OmegaConf.to_container(_load_yaml(path), resolve=False) or {}
            for key, value in _leaves(tree):
                shown = f"{key}={_show(value)}"
                self.set(key, shown, lambda: OmegaConf.update(self.cfg, key, value, merge=False),
                         f"the recipe {name} sets {shown} in {where}", f"recipe {name} ({where}) for {command}: ")

    def carried(self) -> None:
        """The model and data keys are the saved run's now."""
        self.saved = True
        self.origin = {k: v for k, v in self.origin.items() if k.split(".")[0] not in ("model", "data")}

    def set(self, key: str, shown: str, merge, came: str, where: str = "") -> None:
        """`merge()` sets `key` as `shown` (key=value) says; `came`: the origin a later setting
        of the key is told; `where`: the file it is in, for the messages."""
        cfg = self.cfg
        if key in self.moved:
            raise UserError(f"{where}{key} is now {self.moved[key]}: pass {self.moved[key]}={shown.split('=', 1)[1]}")
        before = OmegaConf.select(cfg, key, default=None)
        try:
            merge()
        except yaml.YAMLError as e:  # the value is read as YAML: a list typo such as [10, or [10,,20]
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"bad value in {shown!r}: not a value ({problem}); a list is written "
                            f"{key}=[10,20]") from None
        except OmegaConfBaseException as e:
            if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
                raise UserError(f"{where}unknown config key {key!r}{_valid_keys_hint(cfg, key)}") from None
            raise UserError(f"{where}bad value in {shown!r}: {str(e).splitlines()[0]}") from None
        try:
            after = OmegaConf.select(cfg, key)  # resolves an interpolation the value holds
        except OmegaConfBaseException as e:  # e.g. ${nosuch}
            raise UserError(f"{where}bad value in {shown!r}: {str(e).splitlines()[0]}") from None
        saved = self.saved and key.split(".")[0] in ("model", "data")  # carried over from the run
        try:
            _check_type(key, before, after, self.origin.get(
                key, f"the checkpoint's config has {before}" if saved else f"the default is {before}"),
                self.limits.get(key))
        except UserError as e:
            raise UserError(f"{where}{e}") from None
        self.origin[key] = came


def _leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) of every value a YAML file sets; a list is one value."""
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        elif not isinstance(v, dict):
            yield f"{prefix}{k}", v


def _shown_path(path: Path) -> str:
    """A file of configs/ as the messages name it: configs/recipe/demo.yaml."""
    try:
        return str(Path("configs") / path.relative_to(CONFIG_DIR))
    except ValueError:
        return str(path)


# ---- recipes: named sets of values in configs/recipe/ ----------------------------------------

DEMO = "demo"   # the recipe demo=true (or demo=auto on a machine without a GPU) layers


def recipes() -> dict[str, str]:
    """{name: what it is (its file's first comment line)} of every recipe (configs/recipe/<name>.yaml)."""
    found = {}
    for name in available("recipe"):
        with open(CONFIG_DIR / "recipe" / f"{name}.yaml") as f:
            first = next((line for line in f if line.startswith("#")), "")
        found[name] = first.lstrip("#").strip()
    return found


def recipe_files(name: str, command: str, data: str, network_here: bool = True) -> list[Path]:
    """The files recipe `name` merges, in their order: configs/recipe/<name>.yaml, then of its
    folder configs/recipe/<name>/ (where it has one) method/<command>.yaml, or that of the
    nearest method the command extends, and, where the network starts here (no saved run
    carries its model and data over), data/<data>.yaml."""
    root = CONFIG_DIR / "recipe"
    files = [root / f"{name}.yaml"]
    methods = [root / name / "method" / f"{m}.yaml" for m in _method_chain(command)]
    files += [p for p in methods if p.exists()][:1]
    if network_here and (root / name / "data" / f"{data}.yaml").exists():
        files.append(root / name / "data" / f"{data}.yaml")
    return files


def recipe_setting(cfg: DictConfig, key: str) -> str | None:
    """The recipe of cfg.recipe that gave `key` the value it holds (the last whose files set
    it), or None: what a message may name as asking for a value the user did not give."""
    value = OmegaConf.select(cfg, key, default=None)
    for name in reversed(list(cfg.get("recipe") or [])):
        for path in reversed(recipe_files(name, cfg.command, cfg.data.name)):
            given = dict(_leaves(OmegaConf.to_container(_load_yaml(path), resolve=False) or {}))
            if key in given:
                return name if given[key] == value else None
    return None


def _recipes_wanted(cfg: DictConfig, overrides: list[str], command: str, data: str) -> tuple[list[str], list[str]]:
    """(the recipes to merge, the overrides but recipe=): auto (the default) is the file
    <command>_<data> where it exists, none is no recipe; else a recipe's name or a list of them."""
    value = _given(overrides, "recipe", cfg.recipe)
    rest = [o for o in overrides if _key_of(o) != "recipe"]
    known = available("recipe")
    if value == "auto":
        return [n for n in (f"{command}_{data}",) if n in known], rest
    if value == "none":
        return [], rest
    names = list(value) if isinstance(value, (list, ListConfig)) else [value]
    if not names or not all(isinstance(n, str) and n in known for n in names):
        raise UserError(f"recipe={_show(value)}: no such recipe; choose auto, none, or one (or a list) of: "
                        f"{', '.join(known)} (the files in configs/recipe/)")
    return names, rest


def _names(overrides: list[str], model: str | None, base: dict | None) -> tuple[str | None, str | None, list[str]]:
    """(model, data, the other overrides): `model=` and `data=` pick files, so they are taken
    out first; a saved run's names stand in for those the command line does not give."""
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
    return model, data, rest


def _layers(command: str, data: str | None, method: Path | None = None) -> tuple[DictConfig, tuple, str]:
    """(defaults.yaml, the method's files and the data file merged in their order, with the
    rules (`_take_rules`) taken out of them; the rules; the data set's name). New keys may
    come from method files (their own sections); struct mode starts once every file is in."""
    cfg = OmegaConf.merge(_load_yaml(CONFIG_DIR / "defaults.yaml"), method_config(command, method))
    rules = _take_rules(cfg, command, method)
    data = data or cfg.data.name
    data_file = CONFIG_DIR / "data" / f"{data}.yaml"
    if not data_file.exists():
        raise UserError(f"unknown dataset {data!r}; choose one of: {', '.join(available('data'))}")
    cfg = OmegaConf.merge(cfg, _load_yaml(data_file))
    OmegaConf.set_struct(cfg, True)
    return cfg, rules, data


def _carry_over(cfg: DictConfig, saved: DictConfig, data: str) -> None:
    """Only what describes the network and its data carries over from a saved run; on
    another data set than the run's, only what the network was trained on (its image
    size and normalization), not where the run's files were or how they were read."""
    for section in ("model", "data"):
        if section in saved:
            part = saved[section]
            if section == "data" and part.get("name") != data:
                part = OmegaConf.create({k: part[k] for k in TRAINED_ON if k in part})
            cfg[section] = OmegaConf.merge(cfg[section], _known(part, cfg[section]))


def _finish(cfg: DictConfig, limits: dict, paths: list) -> None:
    """Interpolations resolved, nothing missing, every value within its limits, paths absolute."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise UserError(f"config error: {str(e).splitlines()[0]}") from None
    _check_missing(cfg)
    check_values(cfg, limits)
    _absolute_paths(cfg, paths)


def _absolute_paths(cfg: DictConfig, paths: Iterable[str]) -> None:
    for key in paths:
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value and not names_timm(value):
            full = os.path.abspath(os.path.expanduser(value))
            if full != value:
                OmegaConf.update(cfg, key, full)


# The largest whole number torch and numpy hold (int64): no count may go beyond it, whatever
# its limit says. A key whose code holds less (a seed, a count of processes or of arrays'
# entries) says so with its own `max`.
WHOLE_MAX = 2**63 - 1


def _holds(v) -> bool:
    """A number the code can hold: a finite one, and a whole one within int64."""
    return math.isfinite(v) if isinstance(v, float) else -WHOLE_MAX - 1 <= v <= WHOLE_MAX


@dataclass(frozen=True)
class Limit:
    """The numbers a key may hold: low..high, ends included unless marked open; never a
    non-finite one (inf, nan), and a whole number never above WHOLE_MAX."""
    low: float
    high: float | None = None
    whole: bool = False
    open_low: bool = False
    open_high: bool = False
    null: bool = False  # null (the key's "off" or "automatic") is allowed

    def allows(self, v) -> bool:
        if v is None:
            return self.null
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.whole and not isinstance(v, int)):
            return False
        if not _holds(v):
            return False
        above = v > self.low if self.open_low else v >= self.low
        below = self.high is None or (v < self.high if self.open_high else v <= self.high)
        return above and below

    def describe(self, value=None) -> str:
        """What the key may hold; the bound the code can hold is named when `value` is past it."""
        infinite = isinstance(value, float) and not math.isfinite(value)
        kind = "a whole number" if self.whole else "a finite number" if infinite else "a number"
        low = f"{'>' if self.open_low else '>='} {_number(self.low)}"
        if self.high is None:
            text = f"{kind} {low}"
            if isinstance(value, int) and not isinstance(value, bool) and value > WHOLE_MAX:
                text += f" and at most {WHOLE_MAX} (2**63 - 1, the largest torch holds)"
        else:
            text = (f"{kind} in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.open_high else ']'}")
        return text + (" (or null)" if self.null else "")

    @classmethod
    def from_spec(cls, spec, where: str) -> "Limit | Choice":
        """A limit as the YAML files write it: a kind's name (LIMIT_KINDS) or its fields,
        e.g. {min: 0, max: 1}, {above: 0, nullable: true}, {min: 1, whole: true}; or the
        list of the words a key may hold, e.g. [auto, never]."""
        if isinstance(spec, str) and spec in LIMIT_KINDS:
            return LIMIT_KINDS[spec]
        if isinstance(spec, (list, ListConfig)) and spec:
            return Choice(tuple(spec))
        fields = dict(spec) if isinstance(spec, (dict, DictConfig)) else None
        if fields is None or not fields.keys() <= {"min", "above", "max", "below", "whole", "nullable"} \
                or ("min" in fields) == ("above" in fields) or ("max" in fields and "below" in fields) \
                or not all(isinstance(fields.get(k, 0), (int, float)) and math.isfinite(fields.get(k, 0))
                           for k in ("min", "above", "max", "below")):
            raise UserError(f"{where}: {spec!r} is not a limit; use one of {', '.join(LIMIT_KINDS)}, fields "
                            "{min | above: n, max | below: n, whole: true, nullable: true} or a list of words")
        high = fields.get("max", fields.get("below"))
        # Whole bounds stay ints: a float cannot tell 2**63 - 1 from 2**63.
        return cls(fields.get("min", fields.get("above")), high,
                   whole=bool(fields.get("whole", False)), open_low="above" in fields, open_high="below" in fields,
                   null=bool(fields.get("nullable", False)))


def _number(x) -> str:
    """A bound as written: whole numbers in full (4294967295, not 4.29497e+09)."""
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Choice:
    """The words a key may hold (a list in a `limits:` section; null among them if allowed)."""
    words: tuple

    def allows(self, v) -> bool:
        return any(v == w and type(v) is type(w) or v is w for w in self.words)

    def describe(self, value=None) -> str:
        return "one of " + ", ".join("null" if w is None else str(w).lower() if isinstance(w, bool) else str(w)
                                     for w in self.words)


# The kinds of number the `limits:` sections name most often.
LIMIT_KINDS = {
    "count": Limit(0, whole=True),                # 0, 1, 2, ...
    "some": Limit(1, whole=True),                 # 1, 2, ...
    # a number of epochs: the schedules hold a value per iteration, made before the first step
    # (far beyond any published schedule; past it they would not fit in memory)
    "epochs": Limit(1, 10_000, whole=True),
    # what seeds numpy's generator too (it takes 32 bits; torch's overflowed at 2**63 - 1)
    "seed": Limit(0, 2**32 - 1, whole=True),
    "size": Limit(1, whole=True, null=True),      # 1, 2, ... or null (all / automatic)
    "positive": Limit(0, open_low=True),
    "nonnegative": Limit(0),
    "fraction": Limit(0, 1),
    "below_one": Limit(0, 1, open_high=True),
}


def _take_rules(cfg: DictConfig, command: str, method: Path | None = None) -> tuple[dict, dict, list]:
    """Take the `limits:`, `moved:` and `paths:` sections out of the merged files:
    ({key: Limit}, {old key: new key}, [path keys]). Limits are checked once the config is built, so that a bad value
    is one line before anything runs (not a traceback deep inside torch); a list (knn.k) is
    checked element by element, and a key the command does not have is skipped."""
    where = f"configs/defaults.yaml or {method or f'configs/method/{command}.yaml'}"
    limits = {str(k): Limit.from_spec(v, f"{where}, limits.{k}") for k, v in (cfg.pop("limits", None) or {}).items()}
    moved = {str(k): str(v) for k, v in (cfg.pop("moved", None) or {}).items()}
    paths = [str(k) for k in (cfg.pop("paths", None) or {})]
    return limits, moved, paths


def check_values(cfg: DictConfig, limits: dict) -> None:
    """Values within their `limits` ({key: Limit or Choice}); UserError otherwise."""
    for key, limit in limits.items():
        value = OmegaConf.select(cfg, key, default="<missing>")
        if isinstance(value, str) and value == "<missing>":
            continue
        _check_value(key, value, limit)


def _check_value(key: str, value, limit: "Limit | Choice") -> None:
    many = isinstance(value, (list, ListConfig))
    for v in (list(value) if many else [value]):
        if not limit.allows(v):
            raise UserError(f"{key}={_show(value)} is not allowed: {'each of ' if many else ''}{key} must be "
                            f"{limit.describe(v)}")


@functools.lru_cache(maxsize=None)
def all_choices() -> dict:
    """{key: the words it may hold} for every key whose `limits:` entry (defaults.yaml or a
    method file) is a list of words. Those entries are the one place the words are written:
    code that checks, shows or walks a key's words reads them here."""
    found: dict = {}
    for path in [CONFIG_DIR / "defaults.yaml", *sorted((CONFIG_DIR / "method").glob("*.yaml"))]:
        with open(path) as f:
            limits = (yaml.load(f, Loader=_YAML_LOADER) or {}).get("limits") or {}
        for key, spec in limits.items():
            if not isinstance(spec, list):
                continue
            words = Limit.from_spec(spec, f"{path}, limits.{key}").words
            # a key two method files share (knn.* in dino.yaml and knn.yaml) must say the same there
            if found.setdefault(key, words) != words:
                raise ValueError(f"limits.{key} lists other words in {path.name} than elsewhere in configs/")
    return found


def choices(key: str) -> tuple:
    """The words `key` may hold (its `limits:` list), e.g. choices("device")."""
    return all_choices()[key]


def check_choice(key: str, value) -> None:
    """UserError unless `value` is one of `key`'s words: for code handed a value directly
    (a library call) rather than through a config load_config checked."""
    _check_word(key, value, Choice(choices(key)), listed=True)


def _show(value) -> str:
    """A value as the command line writes it (null, true)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(list(value)) if isinstance(value, ListConfig) else str(value)


def _check_type(key: str, before, after, origin: str, limit=None) -> None:
    """Untyped YAML accepts anything: keep numbers numbers and flags flags (null too where
    the key's limit allows it), and no number the code cannot hold (inf, nan, past int64),
    also where no limit is written (a limit says so itself, with its range); a key with a
    list of words holds one of them (_check_word). `origin` says where `before` came from."""
    if isinstance(limit, Choice):
        return _check_word(key, after, limit, listed=isinstance(before, (list, ListConfig)))
    if after is None and limit is not None and limit.allows(None):
        return
    past = [v for v in (after if isinstance(after, (list, ListConfig)) else [after])
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not _holds(v)]
    if limit is None and past:
        need = "finite (no inf or nan)" if isinstance(past[0], float) else f"at most {WHOLE_MAX} (2**63 - 1) in size"
        raise UserError(f"{key}={_show(after)} is not allowed: {key} must be {need}")
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
        raise UserError(f"{key}={after!r} should be {want} ({origin})")


def _check_word(key: str, value, limit: Choice, listed: bool) -> None:
    """`value` is one of the key's words, of whichever kind they are (auto | true | false:
    a word or a flag, as YAML reads them in the list and on the command line); a list of
    them only where the key holds lists (`listed`)."""
    if isinstance(value, (list, ListConfig)) and not listed:
        raise UserError(f"{key}={_show(value)} is not allowed: {key} must be {limit.describe()}, not a list")
    # text that spells a flag: quoted on the command line, or handed in by code
    flag = [_show(w) for w in limit.words if isinstance(w, bool) and _show(w) == str(value).lower()]
    if isinstance(value, str) and flag:
        raise UserError(f"{key}={value!r} is text, not the flag {flag[0]}: write {key}={flag[0]} without quotes")
    _check_value(key, value, limit)


def _demo_wanted(cfg: DictConfig, overrides: list[str], limit: Choice) -> tuple[bool, list[str]]:
    """(whether this is the CPU demo, the overrides but demo=): demo decides whether the
    recipe demo is merged, so its value is read and checked against its limit before any
    override is.
    demo=auto means: the short CPU demo when this machine has no GPU and runs the command
    itself (launcher=slurm submits it to GPU nodes, which decide there)."""
    value = _given(overrides, "demo", cfg.demo)
    _check_word("demo", value, limit, listed=False)
    if value == "auto":
        import torch
        value = _given(overrides, "launcher", cfg.get("launcher")) == "local" and not torch.cuda.is_available()
    return value, [o for o in overrides if _key_of(o) != "demo"]


def _given(overrides: list[str], key: str, default):
    """The value the last `key=` override gives, read as merging it would (true: a flag),
    else `default`; a value that is no YAML stays text (the checks refuse it in one line)."""
    for o in reversed(overrides):
        if _key_of(o) == key:
            try:
                return OmegaConf.from_dotlist([f"value={o.split('=', 1)[1]}"]).value
            except (OmegaConfBaseException, yaml.YAMLError):
                return o.split("=", 1)[1]
    return default


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
    """The resolved config as YAML, written atomically (never through a link at `path`)."""
    from resmlp.core.checkpoint import atomic_write
    with atomic_write(path, "w", what="the run's config") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))


def as_list(value) -> list:
    """A list from a list, a ListConfig, a scalar or a comma-separated string ("10,20")."""
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]
