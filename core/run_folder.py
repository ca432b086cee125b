"""A training run's folder: its default name, the run it holds and whether a command may
continue it (the resume policy).

A run folder belongs to its inputs. A checkpoint is continued only by a config whose
RESUME_MUST_MATCH sections are its own (RESUME_MAY_CHANGE aside) and which starts from the
same weights (INPUT_KEYS: the path, and the file's identity kept in INPUTS_NAME); a finished
run is the run asked for when only RUNTIME_KEYS differ. Its own file because more than the
trainers' `Run` (core/run.py) asks these rules: compare (a path's folder), the evaluators
(a feature cache named by settings_of), the compile cache and the SLURM launcher (run_dir).
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from resmlp.core.files import read_regular
from resmlp.core.outdir import beside, input_key, input_name
from resmlp.core.report import write_json
from resmlp.core.weights import WeightsSpec

# Sections whose change makes a saved checkpoint unusable for this run, and the keys in
# them that may change on resume (memory settings: the weights do not depend on them).
RESUME_MUST_MATCH = ("command", "model", "data")
# data.decode: where JPEGs are decoded (the same pixels up to a rounding step); data.preview:
# only `run.sh data` reads it; model.fused, model.token_major, model.kernels: the same
# parameters and function (models/fused.py); model.residual_dtype: the same parameters, the
# function to bf16 rounding.
RESUME_MAY_CHANGE = ("model.grad_checkpointing", "model.fused", "model.token_major", "model.kernels",
                     "model.residual_dtype", "data.decode", "data.preview")
# What a command starts from: the key naming the weights it reads (run dir, checkpoint file
# or timm:<name>). Its default run dir names them, and a run dir holding a run that started
# from other weights is neither continued nor taken for this one. null (dino.init left out):
# the run's own start, whatever it was.
INPUT_KEYS = {"finetune": "checkpoint", "distill": "distill.teacher", "dino": "dino.init"}
# What a run dir keeps of the weights it started from: the identity of each input
# (core.weights: WeightsSpec.identity, the sha256 of a file), written when the run starts.
# The path alone would take a checkpoint retrained or replaced in place for the one the run
# read.
INPUTS_NAME = "inputs.json"
# Keys that do not change what a run computes: a finished run with other values of these is
# still the run asked for ("nothing to do"; compare reuses it). demo and recipe name where the
# values came from, not what they are; demo_overrides and demo_data_overrides are what run
# dirs saved before the demo became a recipe file hold in their place. model.residual_dtype
# may change on resume but changes what a run computes (bf16 rounding of the stream).
# embed.shard_size cuts embed's work, not its rows (a resumed folder keeps its own size);
# embed.index is another file in the folder, so it stays: a folder per index format.
RUNTIME_KEYS = ("out", "name", "resume", "out_ok", "num_workers", "log_every", "log_every_s", "ckpt_every",
                "ckpt_epochs", "eval_every", "eval_batch_size", "device", "compile", "compile_cache_dir",
                "dino.cuda_graphs", "demo", "recipe", "demo_overrides", "demo_data_overrides", "launcher", "slurm",
                "save_rank_weights", "features.batch_size", "features.cache", "features.cache_dir", "data.download",
                "weights_trust", "embed.shard_size", *(k for k in RESUME_MAY_CHANGE if k != "model.residual_dtype"))


def default_run_name(cfg: DictConfig, start=None) -> str:
    """<command>_<model>_<data>, and _from_<its weights' name> (core.outdir.input_name) for a
    command that starts from weights (`start`; default: its INPUT_KEYS entry): two runs of
    one command from two checkpoints never share a default folder."""
    if start is None and cfg.command in INPUT_KEYS:
        start = OmegaConf.select(cfg, INPUT_KEYS[cfg.command], default=None)
    name = f"{cfg.command}_{cfg.model.name}_{cfg.data.name}"
    return f"{name}_from_{input_name(start)}" if start else name


def run_dir(cfg: DictConfig) -> Path:
    if cfg.out:
        return Path(cfg.out).expanduser()
    return Path("runs") / (cfg.name or default_run_name(cfg))


def config_differences(saved: dict, current: dict, keys=RESUME_MUST_MATCH, skip=RESUME_MAY_CHANGE) -> list[str]:
    """Human-readable 'key: old -> new' lines for the sections that must not change (the
    dotted keys in `skip` aside)."""
    diffs = []

    def walk(a, b, prefix):
        if prefix in skip:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k, "<unset>"), b.get(k, "<unset>"), f"{prefix}.{k}" if prefix else k)
        elif a != b:
            diffs.append(f"{prefix}: {a} -> {b}")

    for k in keys:
        walk(saved.get(k, "<unset>"), current.get(k, "<unset>"), k)
    return diffs


def started_from(saved: dict, current: dict) -> tuple[str, str | None, str | None]:
    """(the command's input key, the weights the saved run started from, those asked for
    now), as input_key gives them; the key is "" for a command that reads none."""
    key = INPUT_KEYS.get(str(current.get("command")), "")
    if not key:
        return "", None, None
    pick = lambda c: OmegaConf.select(OmegaConf.create(c), key, default=None)  # noqa: E731
    return key, input_key(pick(saved)), input_key(pick(current))


def _named_input(cfg, key: str | None = None) -> tuple[str, str | None]:
    """(the input key: `key`, else the command's INPUT_KEYS entry; the weights it names now,
    or None). cfg: a config or its dict."""
    cfg = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    key = key or INPUT_KEYS.get(str(OmegaConf.select(cfg, "command", default="")), "")
    return key, (OmegaConf.select(cfg, key, default=None) if key else None)


def record_inputs(directory, cfg, key: str | None = None) -> None:
    """Write INPUTS_NAME into the run dir: the identity of the weights cfg starts from (its
    `key`, default the command's INPUT_KEYS entry; a stale record of an earlier start is
    removed when it names none)."""
    key, spec = _named_input(cfg, key)
    path = Path(directory) / INPUTS_NAME
    identity = WeightsSpec.parse(spec).identity() if spec is not None else None
    if identity is None:
        path.unlink(missing_ok=True)
        return
    write_json(path, {key: identity})


def input_changed(directory, cfg, key: str | None = None) -> tuple[str, str] | None:
    """(input key, why) when the run in `directory` started from a file that holds other
    weights now than then: the path is the same (started_from compares paths), the bytes
    are not. None when they are the same, when cfg names no input (the run's own start),
    or when either side is unknown: a run dir written before runs kept INPUTS_NAME is taken
    as started from the weights there now (refusing it would strand every older run, and
    nothing tells), and a file missing now is the loader's to name. `key`: as record_inputs."""
    key, spec = _named_input(cfg, key)
    if spec is None:
        return None
    try:
        was = json.loads(read_regular(Path(directory) / INPUTS_NAME)).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(was, dict) or was.get("sha256") is None:   # nothing to compare: no file hashed
        return None
    now = WeightsSpec.parse(spec).identity()
    if now is None or was["sha256"] == now.get("sha256"):
        return None
    return key, (f"{now['file']} as it was then (its weights changed since: sha256 {str(was['sha256'])[:12]} "
                 f"then, {now['sha256'][:12]} now)")


def settings_of(config: dict) -> dict:
    """A copy of a resolved config without its RUNTIME_KEYS: what the results depend on."""
    out = OmegaConf.to_container(OmegaConf.create(config))
    for key in RUNTIME_KEYS:
        head, _, last = key.rpartition(".")
        section = out.get(head) if head else out
        if isinstance(section, dict):
            section.pop(last, None)
    return out


def settings_differences(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every key that changes what a run computes: RUNTIME_KEYS aside,
    the input compared as the weights it names (a null one: the run's own start), and a
    key asked as `auto` taking whatever the run chose."""
    key, was, now = started_from(saved, current)
    saved, current = settings_of(saved), settings_of(current)
    if key:  # the input: compared as the weights it names
        head, _, last = key.rpartition(".")
        for c, v in ((saved, was), (current, now if now is not None else was)):
            (c.setdefault(head, {}) if head else c)[last] = v
    diffs = config_differences(saved, current, keys=sorted({*saved, *current}), skip=())
    return [d for d in diffs if not d.endswith("-> auto")]


def other_run(directory, what: str, fix: str = "") -> str:
    """The one line that refuses a run dir holding another run: `what` it holds, and where
    this one can go instead."""
    return f"{directory} holds {what}; {fix + ', or ' if fix else ''}pass out={beside(directory)} to start this one " \
           "beside it"
