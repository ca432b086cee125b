"""The bench's linear row: the linear probe on cached features as the `linear` command runs
it (eval/linear.py's probe_cached, with configs/method/linear.yaml's settings: the L2 grid,
the held-out part, max_iter, DINO's lrs and epochs), on synthetic features of the profile's
size, a line per protocol of `linear.protocols`:

  lbfgs   the default, whole: every L2 of the grid fitted on all but the held-out part and
          scored there, the chosen one refitted on the whole train split, the test split
          scored once. Its time, split at the last L2's line into the selection and the
          refit; its L-BFGS iterations and loss-and-gradient passes; the L2 chosen; top-1.
  dino    DINO's protocol beside it (every lr of its grid trained side by side, batch 256):
          `dino_epochs` of its epochs timed, the others counted at the last one's time (an
          epoch is the same work each time; its schedule changes only the learning rate).

The features (linear_features): knn.py's clustered ones at the profile's `noise`, each
dimension then scaled by a seeded factor between 0.1 and 10, since frozen features differ
in scale between dimensions and the probe standardizes them.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time

import torch

from bench.knn import clustered
from bench.timing import peak_memory_gb, sync

EPOCH_LINE = re.compile(r"^linear: epoch (\d+)/")   # eval/linear.py's line at an epoch's end


def linear_family(ctx) -> None:
    p = ctx.p.linear
    data = functools.cache(lambda: linear_features(p))   # made once, by the first line measured here
    for protocol in p.protocols:
        ident = {"protocol": str(protocol), "n_train": int(p.n_train), "dim": int(p.dim), "classes": int(p.classes)}
        ctx.attempt("linear", ident, lambda: LINES[str(protocol)](ctx, data()))


def linear_features(p) -> tuple:
    """(train, train labels, test, test labels, classes) on the CPU for a profile's `linear`
    settings, seeded."""
    train, train_y, test, test_y, classes = clustered(int(p.n_train), int(p.n_test), int(p.dim), int(p.classes),
                                                      float(p.noise))
    scale = 10.0 ** (2 * torch.rand(int(p.dim), generator=torch.Generator().manual_seed(1)) - 1)
    return train.mul_(scale), train_y, test.mul_(scale), test_y, classes


def timed_probe(ctx, data, probe) -> tuple[dict, float, list]:
    """(probe_cached's result, its seconds, [(seconds since its start, line)] of what it logged)."""
    from resmlp.eval.linear import probe_cached
    train, train_y, test, test_y, classes = data
    stamps = []

    def log(line):
        stamps.append((time.perf_counter() - t0, line))
        print(f"  {stamps[-1][0]:7.1f} s  {line}", flush=True)
    sync(ctx.device)
    t0 = time.perf_counter()
    res = probe_cached(train, train_y, test, test_y, classes, probe, ctx.seed, ctx.device, log=log)
    sync(ctx.device)
    return res, time.perf_counter() - t0, stamps


def _lbfgs(ctx, data) -> dict:
    from resmlp.eval.linear import default_probe
    probe = default_probe()
    res, sec, stamps = timed_probe(ctx, data, probe)
    tried = [r for r in res["per_l2"] if "skipped" not in r]
    selection = max(t for t, line in stamps if line.startswith("linear: l2 "))
    refit = res["refit"]
    # every fit ends with one more pass for its loss and gradient (eval/logreg.py's fit)
    passes = sum(r["evaluations"] + 1 for r in tried) + refit["evaluations"] + 1
    converged = all(r["converged"] for r in tried) and refit["converged"]
    return {"device": ctx.device.type, "seconds": sec, "selection_s": selection, "refit_s": sec - selection,
            "l2s": len(tried), "iterations": sum(r["iterations"] for r in tried) + refit["iterations"],
            "passes": passes, "refit_iterations": refit["iterations"], "l2": res["l2"], "converged": converged,
            "top1": res["top1"], "top5": res["top5"], "mem_gb": peak_memory_gb(ctx.device),
            "per_l2": [{k: r[k] for k in ("l2", "iterations", "evaluations", "holdout_top1", "converged", "skipped")
                        if k in r} for r in res["per_l2"]],
            "note": f"{len(tried)} of {len(probe.l2)} L2s fitted on {res['n_fit']} images, scored on "
                    f"{res['n_holdout']}; L2 {res['l2']:g} refitted on all; {passes} passes over the features "
                    f"(loss and gradient){'' if converged else '; a fit stopped at max_iter'}"}


def _dino(ctx, data) -> dict:
    from resmlp.eval.linear import default_probe
    full = default_probe()
    epochs = int(ctx.p.linear.dino_epochs)
    probe = dataclasses.replace(full, protocol="dino", epochs=epochs)
    res, sec, stamps = timed_probe(ctx, data, probe)
    ends = [(int(m.group(1)), t) for t, line in stamps if (m := EPOCH_LINE.match(line))]
    (e0, t0), (e1, t1) = ends[-2:]
    epoch_s = (t1 - t0) / (e1 - e0)
    return {"device": ctx.device.type, "seconds": sec, "seconds_full": sec + (full.epochs - epochs) * epoch_s,
            "epoch_s": epoch_s, "epochs": epochs, "epochs_full": full.epochs, "lrs": len(probe.lrs),
            "mem_gb": peak_memory_gb(ctx.device),
            "note": f"{epochs} of {full.epochs} epochs timed, {len(probe.lrs)} lrs side by side, batch "
                    f"{probe.batch_size}; the rest at {epoch_s:.2f} s an epoch (top-1 after {epochs} epochs "
                    f"{res['top1']:.1f}, not the protocol's)"}


LINES = {"lbfgs": _lbfgs, "dino": _dino}
