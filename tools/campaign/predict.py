"""How long a training stage of the campaign (the preset, compare) will take, known before it
starts: call.py starts one under a window only when this fits what is left of the
call. No torch import (except for Fashion-MNIST's size).

    need = launch + start-up + epochs x images per epoch / rate + evaluations x eval_s + end_s

- launch: the process's own start before the trainer's clock (python, torch, CUDA) and its
  exit, which no log holds;
- start-up: from the trainer's clock to its first log line (data, the k-NN at init,
  compilation; the first log line's iterations are in it too);
- images per epoch: what the trainer's loader gives, whole batches of the train split (or of
  data.subset);
- evaluations: the k-NN every eval_every epochs before the last epoch, each with the
  epoch-end work around it (its checkpoint, the loader's restart);
- end: the last epoch's k-NN and the linear probe (dino.final_linear).

Each term comes from the stage's own earlier attempt in this campaign where its log measured
it (a resumed run, or one a fresh machine starts again), else from the profile's constants
(`campaign.<profile>.predict`, measured on a GPU: tools/campaign/campaign.yaml says where);
the launch always from the constants.
"""
from __future__ import annotations

import json
import statistics


def train_images(dino_cfg, synthetic: int | None) -> int | None:
    """The stage's train split: data.subset, the campaign's synthetic folder, Fashion-MNIST's
    train split; None for another data set (no prediction)."""
    if dino_cfg.data.get("subset"):
        return int(dino_cfg.data.subset)
    if synthetic:
        return int(synthetic)
    if dino_cfg.data.name == "fashion_mnist":
        from resmlp.data.fashion_mnist import SIZES
        return SIZES["train"]
    return None


def schedule(dino_cfg, images: int) -> dict:
    """What the config asks for: epochs, images per epoch (whole batches), evaluations."""
    epochs, batch, every = int(dino_cfg.epochs), int(dino_cfg.batch_size), int(dino_cfg.eval_every)
    return {"epochs": epochs, "images_per_epoch": (images // batch) * batch, "eval_every": every,
            "batch_size": batch}


def measured(log: bytes | None, images_per_epoch: int, eval_every: int) -> dict:
    """The terms the last attempt in a stage's log.jsonl that trained measured (attempts are
    split by {"restart": n} lines): startup_s, images_per_s (the median of its log lines after
    the first, which holds the compilation), eval_s (between its first and last k-NN after
    init); "attempt": which one (1-based). Empty when none trained."""
    attempts: list = [[]]
    for line in (log or b"").decode(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if "restart" in r:
            attempts.append([])
        else:
            attempts[-1].append(r)
    out: dict = {}
    for i, records in reversed(list(enumerate(attempts))):
        trained = [r for r in records if "loss" in r and "elapsed_s" in r]
        if trained:
            out.update(attempt=i + 1, startup_s=float(trained[0]["elapsed_s"]))
            break
    else:
        return out
    rates = [r["images_per_s"] for r in trained[1:] if r.get("images_per_s")]
    if len(rates) >= 2:
        out["images_per_s"] = float(statistics.median(rates))
    knn = [r for r in records if "knn_top1" in r and r.get("epoch", 0) > 0 and "elapsed_s" in r]
    if "images_per_s" in out and eval_every > 0 and len(knn) >= 2:
        epochs = knn[-1]["epoch"] - knn[0]["epoch"]
        training = epochs * images_per_epoch / out["images_per_s"]
        out["eval_s"] = max(0.0, (knn[-1]["elapsed_s"] - knn[0]["elapsed_s"] - training) / (epochs / eval_every))
    return out


def predict(sched: dict, constants: dict, seen: dict, constants_name: str, from_epoch: float = 0.0) -> dict:
    """The need in seconds and every term of it, each with where it came from: `seen`
    (measured()) before `constants` (named constants_name). from_epoch: a run that resumes there."""
    terms, source = {}, {}
    for k in ("launch_s", "startup_s", "images_per_s", "eval_s", "end_s"):
        terms[k] = float(seen[k] if k in seen else constants[k])
        source[k] = f"measured by its attempt {seen['attempt']}" if k in seen else constants_name
    epochs = max(0.0, sched["epochs"] - from_epoch)
    every = sched["eval_every"]
    evals = 0 if not every else max(0, (sched["epochs"] - 1) // every - int(from_epoch) // every)
    train_s = epochs * sched["images_per_epoch"] / terms["images_per_s"]
    need = terms["launch_s"] + terms["startup_s"] + train_s + evals * terms["eval_s"] + terms["end_s"]
    text = (f"launch {terms['launch_s']:.0f} s + start-up {terms['startup_s']:.0f} s + {epochs:g} epochs x "
            f"{sched['images_per_epoch']} images / {terms['images_per_s']:.0f} img/s ({train_s:.0f} s) + {evals} "
            f"k-NN x {terms['eval_s']:.1f} s + the end {terms['end_s']:.0f} s")
    return {"need_s": round(need, 1), **sched, "from_epoch": round(from_epoch, 2), "evaluations": evals,
            **{k: round(v, 2) for k, v in terms.items()}, "train_s": round(train_s, 1), "from": source,
            "text": text}
