"""Continuing DINO from weights: `dino.init=<checkpoint | run dir | timm:name>`.

The student's and the teacher's backbones start from those weights (models.load.init_weights:
the fit checked, the patch grid adapted). The head comes from the same checkpoint when it
is this project's DINO checkpoint (`dino.init_head=auto|true|false`), else it is new; a new
head first learns alone for `dino.head_warmup_epochs` on the frozen backbone (ssl/step.py:
the backbone's parameters get no gradient and no update, the teacher follows the student's
head only; the graphed step, ssl/graphed_step.py, does the same with values its graph reads), then
the backbone joins at `dino.init_lr_scale` times the schedule's learning rate. Why the
defaults are what they are: configs/method/dino.yaml.

`continuing(cfg, run)` runs before any work. dino.init on a run dir that holds the state of
a run started otherwise (resume and dino.init would mean two different starts) is refused
by `Run(cfg)` before it (core.run_folder.INPUT_KEYS); this refuses, in one line each: weights
that do not fit the model, timm weights that cannot be had offline, a head that does not
fit dino's head sizes, and a warm-up that leaves the backbone no epoch. A run started from
dino.init and resumed (a requeue, the same command again) continues from its own
checkpoint; the init keys are then the ones it started with.
config.yaml keeps where the run started (dino.init resolved to the file, dino.init_head
to true or false); results.json too, with the k-NN at the start, after the warm-up and at
the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resmlp.core.checkpoint import saved_config
from resmlp.core.errors import UserError
from resmlp.core.weights import WeightsSpec

INIT_KEYS = ("init", "init_head", "head_warmup_epochs", "init_lr_scale")


@dataclass
class Start:
    """Where a run started and how it continues. `backbone`, `head` and `center` are the
    state to load (None on resume: the run's checkpoint holds every weight)."""
    spec: str
    head_loaded: bool
    warmup_epochs: int            # epochs of the head alone on the frozen backbone (0: none)
    lr_scale: float               # the backbone's learning rate, times the schedule's
    info: dict | None = None      # what models.load.init_weights loaded
    backbone: dict | None = None
    head: dict | None = None
    center: torch.Tensor | None = None

    def record(self) -> dict:
        """results.json's `init_from`."""
        out = {"spec": self.spec, "head": "loaded" if self.head_loaded else "new",
               "head_warmup_epochs": self.warmup_epochs, "lr_scale": self.lr_scale}
        if self.info:
            out.update({k: self.info.get(k) for k in ("source", "path", "model", "epoch", "weights_hash", "grid")})
        return out

    def describe(self) -> str:
        """One line: where the weights came from and how the run continues them."""
        info = self.info or {}
        grid = info.get("grid")
        where = f"{info.get('source')}" + (f", epoch {info['epoch']}" if info.get("epoch") is not None else "") + \
            (f", patch grid {grid[0][0]}x{grid[0][1]} adapted to {grid[1][0]}x{grid[1][1]}" if grid else "")
        head = ("its DINO head" if self.head_loaded else
                f"a new head, first {self.warmup_epochs} epoch(s) alone on the frozen backbone" if self.warmup_epochs
                else "a new head (no warm-up)")
        return (f"continuing from {self.spec} ({where}; weights {info.get('weights_hash')}): {head}; the backbone "
                f"at {self.lr_scale:g} x the learning rate")


def record_start(start: Start | None, run, results: dict, start_it: int) -> None:
    """A run that starts from weights (not resumed) keeps where they came from in its
    results (`init_from`, results.json) and says it in one line."""
    if start is not None and not start_it:
        results["init_from"] = start.record()
        run.print(start.describe())


def _saved_dino(run) -> dict | None:
    """The dino section the run dir's state was saved with; None when it holds no state."""
    if not (run.ckpt_path.exists() or run.prev_path.exists()):
        return None
    source = run.dir if (run.dir / "config.yaml").exists() else \
        run.ckpt_path if run.ckpt_path.exists() else run.prev_path
    return dict((saved_config(str(source)) or {}).get("dino") or {})


def continuing(cfg, run, hooks=None) -> Start | None:
    """The start of a DINO run (None: from scratch), checked before any work; see the
    module docstring. Sets dino.init and dino.init_head in `cfg` to what config.yaml keeps."""
    d = cfg.dino
    saved = _saved_dino(run)
    if saved is not None:  # Run() has refused another dino.init (core.run_folder.INPUT_KEYS)
        was = saved.get("init")
        if was is None:
            return None
        for key in INIT_KEYS:   # the resumed run continues as it started
            d[key] = saved.get(key, d[key])
        return Start(was, bool(d.init_head), _warmup(cfg, bool(d.init_head)), float(d.init_lr_scale))
    if d.init is None:
        return None
    return _load(cfg, hooks)


def _warmup(cfg, head_loaded: bool) -> int:
    return 0 if head_loaded else int(cfg.dino.head_warmup_epochs)


def _load(cfg, hooks) -> Start:
    """Load dino.init into a backbone built as the student's (its fit and grid checked) and
    pick the head, without touching the run's random numbers."""
    from resmlp.models.from_config import build_model
    from resmlp.models.load import init_weights
    from resmlp.ssl.head import build_head
    d = cfg.dino
    build = (hooks.backbone if hooks is not None and hooks.backbone else
             (lambda model_cfg: build_model(model_cfg, num_classes=0)))
    spec = WeightsSpec.parse(d.init)
    with torch.random.fork_rng(devices=[]):
        backbone = build(cfg.model)
        info = init_weights(spec, backbone)
        head = build_head(backbone.num_features, d) if info["head"] is not None else None
    ask = d.init_head
    if ask is True and info["head"] is None:
        raise UserError(f"dino.init_head=true: dino.init={d.init} is {_what(info)}, which has no DINO head of this "
                        "project; set dino.init_head=auto (or false) to start a new head")
    head_loaded = info["head"] is not None and ask is not False
    if head_loaded:
        _check_head(head, info, d)
    warmup = _warmup(cfg, head_loaded)
    if warmup >= int(cfg.epochs):
        raise UserError(f"dino.head_warmup_epochs={warmup} leaves the backbone no epoch of epochs={cfg.epochs}: "
                        f"set dino.head_warmup_epochs below {cfg.epochs}")
    d.init, d.init_head = spec.key, head_loaded
    return Start(spec.key, head_loaded, warmup, float(d.init_lr_scale), info, backbone.state_dict(),
                 info["head"] if head_loaded else None, info["center"] if head_loaded else None)


def _what(info: dict) -> str:
    return {"timm": "timm's weights", "dino-official": "an official DINO checkpoint"}.get(
        info["source"], f"a {info['source']} checkpoint")


def _check_head(head, info: dict, d) -> None:
    """The checkpoint's head must have this run's head sizes: one line naming them."""
    own = head.state_dict()
    theirs = info["head"]
    if set(own) == set(theirs) and all(own[k].shape == theirs[k].shape for k in own):
        return
    saved = (info.get("config") or {}).get("dino") or {}
    sizes = "; ".join(f"dino.{k} {saved.get(k, '?')} vs {d[k]}" for k in ("out_dim", "hidden_dim", "bottleneck_dim")
                      if saved.get(k) != d[k]) or "its keys or shapes differ"
    fix = " ".join(f"dino.{k}={saved[k]}" for k in ("out_dim", "hidden_dim", "bottleneck_dim")
                   if k in saved and saved[k] != d[k])
    raise UserError(f"dino.init={d.init}: its DINO head does not fit this run's ({sizes}); set "
                    f"{fix or 'the head sizes it was trained with'} to continue its head, or dino.init_head=false "
                    "for a new one")
