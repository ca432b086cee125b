"""The command line behind run.sh: `resmlp <command> [model | checkpoint] [key=value ...]`.

Each command is a module with `run(cfg)`; this file only picks the module, builds the
config and turns a UserError into one line on stderr with exit code 2.
"""
from __future__ import annotations

import errno
import importlib
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from resmlp.core import dist, preempt
from resmlp.core.checkpoint import TRUST_KEY, check_writable, trusting
from resmlp.core.errors import PREEMPTED_EXIT, Finished, Preempted, RunFailed, UserError, out_of_memory
from resmlp.core.outdir import check_cache_dir, check_out_dir, shown
from resmlp.core.weights import FORMS, WeightsSpec


@dataclass(frozen=True)
class Command:
    target: str            # "module:function"
    help: str
    positional: str = ""   # "model", "checkpoint" or "" (what the word after the command is)
    aliases: dict = field(default_factory=dict)  # short override names, e.g. T -> knn.temperature
    # "module:function": cfg -> the directory the command writes into (None: nothing to write),
    # tried before the command runs so that an unwritable one fails before any work
    writes: str = ""
    # config sections or keys the command does not read, and why (an evaluator's model comes
    # from its checkpoint): naming one on the command line is an error, not a silent no-op
    ignores: dict = field(default_factory=dict)
    # the YAML of its keys when it is not configs/method/<name>.yaml (a tool's, e.g. tools/bench)
    method: str = ""


RUN_DIR = "resmlp.core.run_folder:run_dir"
# What the evaluators take from their checkpoint rather than from these keys.
FROM_CHECKPOINT = {"model": "its network is the checkpoint's, built from the weights"}
NO_KNN = {"knn": "it runs no k-NN"}
# What the supervised trainers never read: they report top-1 on the test split.
NO_FEATURES = {**NO_KNN, "features": "it extracts no frozen features"}
NO_FEATURE_FILES = {f"features.{k}": "it writes no feature cache and takes the network from training"
                    for k in ("key", "cache", "cache_dir", "pretrained")}
# What the commands that read no weights file never read.
NO_WEIGHTS = {**NO_FEATURES, TRUST_KEY: "it reads no weights file"}
# What no command reads when it runs here (launcher=local): the job it would submit.
RUNS_HERE = {"slurm": "launcher=local runs it here, not as a SLURM job: add launcher=slurm to submit one"}

COMMANDS = {
    "dino": Command("resmlp.ssl.train:run", "DINO self-supervised pretraining", "model", writes=RUN_DIR,
                    ignores=NO_FEATURE_FILES),
    "knn": Command("resmlp.eval.knn:run", "k-NN accuracy of frozen features", "checkpoint",
                   {"k": "knn.k", "T": "knn.temperature", "key": "features.key",
                    "few_labels": "knn.few_labels", "tries": "knn.tries"},
                   writes="resmlp.eval.command:results_dir", ignores=FROM_CHECKPOINT),
    "linear": Command("resmlp.eval.linear:run", "linear probe on frozen features", "checkpoint",
                      {"key": "features.key", "few_labels": "linear.few_labels", "tries": "linear.tries"},
                      writes="resmlp.eval.command:results_dir",
                      ignores={**FROM_CHECKPOINT, **NO_KNN}),
    "viz": Command("resmlp.eval.viz:run", "figures: cross-patch weights, sparsity, curves, neighbours, "
                   "patch PCA", "checkpoint", {"key": "features.key", "k": "viz.k"},
                   writes="resmlp.eval.viz:results_dir", ignores={**FROM_CHECKPOINT, "knn.k": "its k is viz.k (k=)",
                            "knn.temperature": "the neighbours grid has no votes to weigh"}),
    "embed": Command("resmlp.eval.embed:run", "the features of every image: safetensors rows, an index, a card",
                     "checkpoint", {"key": "features.key"}, writes="resmlp.eval.embed:results_dir",
                     ignores={**FROM_CHECKPOINT, **NO_KNN, **{f"features.{k}": "it writes embeddings, no feature cache"
                                                              for k in ("cache", "cache_dir", "memory_gb")}}),
    "supervised": Command("resmlp.supervised.train:run", "supervised training from scratch", "model",
                          writes=RUN_DIR, ignores=NO_FEATURES),
    "distill": Command("resmlp.supervised.train:run", "DeiT hard (or soft) distillation from a teacher",
                       "model", {"teacher": "distill.teacher"}, writes=RUN_DIR, ignores=NO_FEATURES),
    "finetune": Command("resmlp.supervised.train:run", "supervised fine-tuning of a DINO checkpoint",
                        "checkpoint", writes=RUN_DIR, ignores=NO_FEATURES),
    "compare": Command("resmlp.supervised.compare:run", "all training paths in one table", "model",
                       writes="resmlp.supervised.compare:compare_dir", ignores=NO_FEATURES),
    "export": Command("resmlp.eval.export:run", "a backbone for timm / the Hub / ONNX / the official code",
                      "checkpoint", {"format": "export.format", "key": "features.key", "opset": "export.opset"},
                      writes="resmlp.eval.export:results_dir",
                      ignores={**FROM_CHECKPOINT, **NO_KNN, **{f"features.{k}": "it extracts no features"
                                                               for k in ("batch_size", "cache", "cache_dir")}}),
    "data": Command("resmlp.data.inspect:run", "what a dataset holds (data=..., data.check=true, data.preview=N)",
                    writes="resmlp.data.inspect:results_dir", ignores=NO_WEIGHTS),
}


FULL_OR_READ_ONLY = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def usage() -> str:
    from resmlp.core.config import recipes
    lines = ["usage: bash run.sh <command> [model | checkpoint] [key=value ...]", "", "commands:"]
    for name, c in COMMANDS.items():
        arg = f" <{c.positional}>" if c.positional else ""
        lines.append(f"  {name + arg:<24} {c.help}")
    lines += [f"  {'test':<24} run the test suite (pytest)",
              f"  {'help':<24} this text", "",
              "models: " + ", ".join(model_names()), "",
              "recipes (configs/recipe/; <command>_<data> applies by itself, recipe=<name> | none in its "
              "place, demo=true adds demo):",
              *(f"  {name:<24} {what}" for name, what in recipes().items()), "",
              "examples:",
              "  bash run.sh dino resmlp_s12                       # Fashion-MNIST, the default data",
              "  bash run.sh dino resmlp_s12 recipe=demo           # the CPU demo, on a machine with a GPU too",
              "  bash run.sh dino resmlp_s24 data=imagenet data.root=/data/imagenet",
              "  bash run.sh knn runs/dino_resmlp_s12_fashion_mnist k=10,20 T=0.07",
              "  NPROC_PER_NODE=8 bash run.sh dino resmlp_s12 data=imagenet data.root=...",
              "  bash run.sh dino resmlp_s12 launcher=slurm slurm.nodes=2 slurm.partition=gpu   # a SLURM job",
              "config files: configs/ (defaults.yaml, method/, data/, recipe/)"]
    return "\n".join(lines)


def model_names() -> list[str]:
    from resmlp.models import list_models
    return list_models()


def check_model(name: str, command: str) -> None:
    if name in model_names():
        return
    import timm
    if command in ("supervised", "distill", "compare") and timm.is_model(name):
        return  # any timm architecture can be trained with the supervised recipe
    raise UserError(f"unknown model {name!r}; choose one of: {', '.join(model_names())}"
                    + (" (or any timm model name)" if command in ("supervised", "distill") else ""))


def expand_aliases(args: list[str], aliases: dict) -> list[str]:
    out = []
    for a in args:
        k, sep, v = a.partition("=")
        if sep and k in aliases:
            if aliases[k] == "knn.k" and "," in v and not v.startswith("["):
                v = "[" + v + "]"
            a = f"{aliases[k]}={v}"
        out.append(a)
    return out


def check_read(name: str, cmd: Command, overrides: list[str]) -> None:
    """An override the command would not read is refused: it would be saved into the
    command's config and reports as if it had taken effect."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        for section, why in cmd.ignores.items():
            if key == section or key.startswith(section + "."):
                raise UserError(f"`{name}` does not read {key} ({why}); drop {o}")


def build(argv: list[str], commands: dict = COMMANDS):
    """(command spec, config) from argv, a command of `commands`; raises UserError on bad input."""
    from resmlp.core.config import load_config
    if not argv or argv[0] in ("help", "-h", "--help"):
        return None, None
    name, rest = argv[0], argv[1:]
    if name not in commands:
        raise UserError(f"unknown command {name!r}; choose one of: {', '.join([*commands, 'test', 'help'])}")
    cmd = commands[name]
    positional = None
    if cmd.positional and rest and "=" not in rest[0]:
        positional, rest = rest[0], rest[1:]
    rest = expand_aliases(rest, cmd.aliases)
    check_read(name, cmd, rest)
    model, base, extra = None, None, []
    if cmd.positional == "model":
        model = positional or next((a.split("=", 1)[1] for a in rest if a.startswith("model=")), "resmlp_s12")
        check_model(model, name)
    elif cmd.positional == "checkpoint":
        if positional is None:
            raise UserError(f"`{name}` needs a checkpoint: bash run.sh {name} {FORMS}")
        with trusting(trusted(rest)):  # read before the config exists: its saved config is the base
            base = WeightsSpec.parse(positional).saved_config()
        extra = [f"checkpoint={positional}"]
    elif positional is not None:
        raise UserError(f"`{name}` takes only key=value arguments, not {positional!r}")
    cfg = load_config(name, model, [*extra, *rest], base=base, method=Path(cmd.method) if cmd.method else None)
    if cfg.launcher == "local":
        check_read(name, replace(cmd, ignores=RUNS_HERE), rest)
    return cmd, cfg


def trusted(overrides: list[str]) -> bool:
    """Whether the command line says weights_trust=true, for the checkpoint read before the
    config is built (load_config checks the value itself)."""
    from resmlp.core.config import _given
    return _given(overrides, TRUST_KEY, False) is True


def check_writes(name: str, cmd: Command, cfg, commands: dict = COMMANDS) -> None:
    """The directory the command writes into may take its outputs (core/outdir.py: not a
    folder of something else, not inside data.root, a path the file system takes) and can
    be written, before the command does any work (one process tries: under torchrun the
    others would race its clean-up). An explicit feature cache stays out of the data too."""
    if not cmd.writes or dist.launch_rank() != 0:
        return
    module, func = cmd.writes.split(":")
    directory = getattr(importlib.import_module(module), func)(cfg)
    what = f"the outputs of `{name}`"
    if directory is not None:
        check_out_dir(directory, cfg, commands, what)
        check_writable(directory, what, "choose another out=" if cfg.out else "pass out=<a directory you can write>")
    check_cache_dir(cfg)


def launch(cfg, argv: list[str]) -> int:
    """launcher=slurm: submit the command line as a job instead of running it here."""
    from resmlp.core.slurm import submit
    submit(cfg, argv, main)
    return 0


def unwrap_user_error(e: BaseException) -> UserError | None:
    """A UserError raised in a DataLoader worker arrives re-raised as another type."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        text = str(e)
        if "UserError: " in text:
            return UserError(text.rsplit("UserError: ", 1)[1].strip().splitlines()[0])
        e = e.__cause__ or e.__context__
    return None


def main(argv: list[str] | None = None, run=None, commands: dict | None = None) -> int:
    """The CLI. `run`: an entry `run(cfg)` to use in place of the command's own (a study's
    trainer with its extension points, studies/); the config, errors and exit codes stay
    the command's. `commands`: more commands beside the package's ({name: Command}), for a
    tool of the repository that borrows the command line (tools/bench, tools/campaign); the
    package's help lists only its own."""
    argv = sys.argv[1:] if argv is None else argv
    table = {**COMMANDS, **(commands or {})}
    try:
        cmd, cfg = build(argv, table)
        if cmd is None:
            print(usage())
            return 0
        check_writes(argv[0], cmd, cfg, table)
        if cfg.launcher != "local":
            return launch(cfg, argv)
        if run is None:
            module, func = cmd.target.split(":")
            try:
                run = getattr(importlib.import_module(module), func)
            except ModuleNotFoundError as e:
                if e.name and e.name.startswith("resmlp"):
                    raise UserError(f"command {argv[0]!r} is not available in this version") from None
                raise
        with trusting(bool(cfg[TRUST_KEY])):  # core.checkpoint: which files load as they are
            return int(run(cfg) or 0)
    except Finished as e:
        print(e, flush=True)
        return 0
    except Preempted as e:
        if str(e):  # rank 0's; the other ranks stop quietly
            print(e, file=sys.stderr)
        return preempt.CTRL_C_EXIT if preempt.received() == "SIGINT" else PREEMPTED_EXIT
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a write outside atomic_write (a figure, a log line) the disk refused
        if e.errno == errno.ENAMETOOLONG:  # a path named on the command line, met before check_writes saw it
            print(f"error: {shown(e.filename or 'a path')}: {e.strerror} (a name in it, or the whole path, is "
                  "longer than the file system takes); choose a shorter one", file=sys.stderr)
            return 2
        if e.errno not in FULL_OR_READ_ONLY:
            raise
        print(f"error: cannot write {e.filename or 'a file'}: {e.strerror}; free some space or choose another "
              "out=, then run again", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C outside a training loop, or a trainer's second one
        print(str(e) or "interrupted", file=sys.stderr)
        return preempt.CTRL_C_EXIT
    except Exception as e:  # noqa: BLE001 - only user errors and memory are turned into one line
        user = unwrap_user_error(e)
        if user is None and (oom := out_of_memory(e)) is not None:
            # a training run's last checkpoint is untouched: the same command resumes it
            print(f"error: out of memory ({oom}); lower batch_size (or data.img_size, dino.out_dim, the "
                  "model), or run on a device with more memory, then run the same command again",
                  file=sys.stderr)
            return 1
        if user is None:
            raise
        print(f"error: {user}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
