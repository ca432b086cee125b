"""Where a DINO iteration's time goes, on the device: `python -m bench.profile [key=value ...]`
(tools/ on the import path, as run.sh and the campaign put it).

The benchmark (bench.py) says how fast; this says why. For one DINO config (the
Fashion-MNIST preset by default; any `dino` command override works, e.g.
`data=imagefolder data.img_size=224 model.patch_size=16 data.local_size=96`) it times
each phase of the trainer's iteration alone, at the trainer's batch:

  loader      the trainer's DataLoader (workers decode and collate), no device work
  augment     GpuMultiCrop on a device batch (eager, and compiled when `compile` compiles: auto on a GPU)
  step        DinoStep on synthetic crops (eager, and compiled by region when `compile` compiles),
              not graphed: a graph's replay hides which op launched each kernel, and with
              it the kernel's bytes
  iteration   loader + augment + step, as the trainer chains them

then records a few steps with torch.profiler and keeps every kernel (`profile.top` of them,
null: all), each in its class (GEMM, elementwise, reduction, copy, other:
kernel_classes.py), and each class against its floor: the step's matmul FLOPs at the
matmul rate and the other classes' bytes at the device-to-device copy rate, both rates
measured in this process first (timing.py). It prints the classes, the busy fraction
(kernel time / wall time: well under 1 means the host, not the device, sets the pace) and
the longest kernels. On a CPU the "kernels" are the ops' own times.

Its own keys are profile.yaml's (beside this file) (`profile.steps`, `profile.top`,
`profile.shown`, `profile.out`, `profile.phases`, `profile.knn`), checked by their `limits:`
like every other key; `profile.phases=loader,augment` is the list [loader,augment] (without
loader: random uint8 images, for a data set that is not on the machine).

`profile.phases=knn` (alone or with the others) does the same for the k-NN of the bench's
knn row (its `torch-device` line: the bench profile's sizes, `profile.knn=gpu|cpu|tiny`,
auto: gpu on a GPU and cpu without one; the features already on the device): the whole
call timed (its first call at full size alone, then the median of `profile.steps`), then
one call profiled for its phases (eval/knn_search.py's spans: the inputs, the bank's and
the queries' unit rows, the float16 pass's matmuls and its block maxima and merges, the
float64 re-rank, the exactness check, each round's host sync, the copy back, the vote),
torch.profiler's device time of each on a GPU and the host's on a CPU, no host sync added
(knn.py's search_spans), with each search round's candidates and queries; on a GPU one
call profiled for its kernels.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from bench import kernel_classes as KC
from bench.config import bench_config, bench_profile, profile_config
from bench.knn import knn_features, search_spans
from bench.step import build_our_step, call_step, step_flops, synthetic_crops
from bench.timing import copy_rate, count_flops, matmul_rate, measure, peak_memory_gb, reset_memory, sync
from resmlp.core.config import as_list, load_config
from resmlp.core.errors import UserError

PROFILED_CALLS = 5   # step calls recorded by the profiler (the k-NN: one)


def main(argv: list[str] | None = None) -> int:
    """Exit 0, or 2 with one line on stderr for bad input (nothing written)."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"profile: {e}", file=sys.stderr)
        return 2


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(this tool's profile.* keys, the step's dino keys); `profile.phases=a,b` is the list [a,b]."""
    mine, rest = [], []
    for a in args:
        key, _, value = a.partition("=")
        if key.lstrip("+").startswith("profile."):
            if key.lstrip("+") == "profile.phases" and "," in value and not value.startswith("["):
                a = f"{key}=[{value}]"
            mine.append(a)
        else:
            rest.append(a)
    return mine, rest


def _main(args: list[str]) -> int:
    mine, rest = split_args(args)
    pc = profile_config(mine).profile
    phases = [str(p) for p in as_list(pc.phases)]
    steps, out = int(pc.steps), pc.out
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    knn_sizes = str(pc.knn) if pc.knn != "auto" else "gpu" if device.type == "cuda" else "cpu"
    from resmlp.data.crop_plan import crop_plan

    cfg = load_config("dino", "resmlp_s12", ["demo=false", *rest])
    precision = "bf16" if device.type == "cuda" else "fp32"
    from resmlp.ssl.step import dino_path
    compiled = dino_path(cfg, device, scaler_enabled=False).compile is not None   # compile=auto: on a GPU
    plan = crop_plan(cfg)
    batch = int(cfg.batch_size)
    step_phases = {"loader", "augment", "step"} & set(phases)
    compiles = sorted({False, compiled})
    report = {"config": {"model": cfg.model.name, "data": cfg.data.name, "batch": batch, "crops": plan.label(),
                         "compile": compiled, "precision": precision} if step_phases else None,
              "phases": {}}

    def record(name, seconds):
        report["phases"][name] = {"ms": 1e3 * seconds, "images_per_s": batch / seconds}
        print(f"{name:28s} {1e3 * seconds:9.2f} ms  {batch / seconds:10.0f} img/s", flush=True)

    profiled = "step" in phases or ("knn" in phases and device.type == "cuda")
    if profiled:
        report["rates"] = rates(device)
    kernels = {"keep": pc.top, "shown": int(pc.shown), "rates": report.get("rates")}
    if step_phases:
        sources = _time_loader(cfg, plan, device, steps, record) if "loader" in phases else _random_sources(cfg, batch)
        images, sizes, keys = (x.to(device) for x in sources)
    for comp in compiles if "augment" in phases else ():
        _time_augment(cfg, plan, device, precision, comp, (images, sizes, keys), steps, record)
    for comp in compiles if "step" in phases else ():
        report[f"kernels_{'compiled' if comp else 'eager'}"] = _time_step(cfg, plan, device, precision, comp, steps,
                                                                           record, kernels)
    if "knn" in phases:
        report["knn"], found = _time_knn(knn_sizes, device, steps, kernels)
        if found is not None:
            report["kernels_knn"] = found

    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "profile.json").write_text(json.dumps(report, indent=1))
    return 0


def rates(device) -> dict:
    """The two ceilings the kernel classes are held against, measured here (the bench's gpu or
    cpu profile's sizes): the dense matmul rate in the step's precision and the copy rate."""
    sizes = bench_config().bench["gpu" if device.type == "cuda" else "cpu"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {"matmul": matmul_rate(device, int(sizes.matmul_size), dtype), "copy": copy_rate(device, int(sizes.copy_mb))}
    print(f"measured: matmul {out['matmul']['tflops']:.4g} TFLOP/s ({out['matmul']['dtype']}, "
          f"{out['matmul']['size']}^3), copy {out['copy']['tb_per_s']:.4g} TB/s ({out['copy']['mbytes']} MiB, bytes "
          "read and written)", flush=True)
    reset_memory(device)
    return out


def _time_loader(cfg, plan, device, steps: int, record) -> tuple:
    """The trainer's DataLoader alone (workers decode and collate), no device work; a batch
    it made (images, sizes, keys) for the phases after it."""
    from resmlp.data import build_dataset, train_split_for_ssl
    from resmlp.data.crop_plan import build_views
    from resmlp.data.resumable import build_train_loader
    views = build_views(cfg, plan, device=device)
    dataset = build_dataset(cfg.data, train_split_for_ssl(cfg.data))
    loader, sampler = build_train_loader(dataset, views.transform, int(cfg.batch_size), cfg.seed, cfg.num_workers,
                                         pin_memory=device.type == "cuda", keyed=True, collate_fn=views.collate)
    sampler.set_epoch(0)
    it = iter(loader)
    first = [next(it) for _ in range(5)][0]
    t = time.perf_counter()
    n = 0
    for _ in range(steps):
        try:
            next(it)
        except StopIteration:
            break
        n += 1
    record("loader", (time.perf_counter() - t) / max(1, n))
    return first.decode_on(device), first.sizes, first.keys


def _random_sources(cfg, batch: int) -> tuple:
    """(images, sizes, keys) of random pixels at the largest source size: the augmentation's
    input without the data set."""
    from resmlp.data.decode import source_side
    side = source_side(cfg.data)
    return (torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8), torch.full((batch, 2), side),
            torch.arange(batch))


def _time_augment(cfg, plan, device, precision: str, comp: bool, sources: tuple, steps: int, record) -> None:
    """GpuMultiCrop alone on a device batch, eager or compiled."""
    from resmlp.data.gpu_augment import GpuMultiCrop
    images, sizes, keys = sources
    aug = GpuMultiCrop.from_plan(plan, cfg.data, compile=comp,
                                 out_dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    t = measure(lambda: aug(images, seed=0, keys=keys, sizes=sizes), device, 3, steps, 3)
    record(f"augment {'compiled' if comp else 'eager'}", t.seconds)


def _time_step(cfg, plan, device, precision: str, comp: bool, steps: int, record, kernels: dict) -> dict:
    """DinoStep alone on synthetic crops, eager or compiled (not graphed), timed, then
    profiled: its kernels by class against their floors (_profile)."""
    crops = [c.to(torch.bfloat16) if precision == "bf16" else c
             for c in synthetic_crops(plan, int(cfg.batch_size), device)]
    step = build_our_step(cfg, device, precision, comp, graphs=False)
    t = measure(lambda: call_step(step, crops), device, 3, steps, 3)
    record(f"step {'compiled' if comp else 'eager'}", t.seconds)
    flops = step_flops(cfg, device, precision, crops)  # the model's, on a plain eager step
    found = _profile(lambda: call_step(step, crops), device, kernels, flops)
    step = None
    torch._dynamo.reset()
    return found


def _time_knn(sizes: str, device, steps: int, kernels: dict) -> tuple[dict, dict | None]:
    """The bench's device k-NN (bench profile `sizes`' knn settings, its features already on
    the device, eval/knn.py's knn_classify as the bench's line calls it): timed whole, then one
    call profiled by phase (knn.py's search_spans; its votes checked equal to an unprofiled
    call's), then on a GPU one call profiled for its kernels. Returns (its figures, its
    kernels by class or None)."""
    from resmlp.eval import knn as K
    from resmlp.eval.knn_search import default_pass_dtype
    k = bench_profile(sizes).knn
    train, train_y, test, test_y, classes = knn_features(k)
    n = test.shape[0] if device.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    reset_memory(device)
    train, test = train.to(device), test[:n].to(device)
    scores = {}

    def run(bank=train, labels=train_y, queries=test, key="plain"):
        scores[key] = K.knn_classify(bank, labels, queries, classes, k=int(k.k), temperature=0.07,
                                     backend="torch", device=device)
    run(train[:4096], train_y[:4096], test[:8], "warm-up")   # the libraries, as the bench's line warms up
    t = measure(run, device, warmup=1, calls=1, repeats=max(1, steps))   # first_s: the first call at full size
    t0 = time.perf_counter()
    spans, rounds = search_spans(lambda: run(key="phased"), device)
    wall = time.perf_counter() - t0
    out = {"sizes": sizes, "n_train": int(k.n_train), "dim": int(k.dim), "queries": n, "k": int(k.k),
           "device": device.type,
           "pass_dtype": str(default_pass_dtype(device)).replace("torch.", ""),
           "first_s": t.first_s, "seconds": t.seconds, "repeats": t.repeats, "phased_s": wall,
           "same_votes": bool(torch.equal(scores["plain"], scores["phased"])),
           "top1": float((scores["plain"].argmax(1) == test_y[:n]).float().mean() * 100),
           "rounds": rounds, "phases": spans, "mem_gb": peak_memory_gb(device)}
    print(f"knn {out['n_train']} x {out['dim']}, {n} queries, k={out['k']}, {out['pass_dtype']} pass on "
          f"{device.type}: first call {t.first_s:.3f} s, then {t.seconds:.3f} s (median of {len(t.repeats)}), "
          f"profiled by phase {wall:.3f} s, top-1 {out['top1']:.1f}%", flush=True)
    print("  rounds: " + "; ".join(f"{r['queries']} queries at {r['candidates']} candidates" for r in rounds))
    print(f"  {'phase':30s} {'calls':>6s} {'device ms':>10s} {'host ms':>10s}")
    for name, v in spans.items():
        print(f"  {name:30s} {v['calls']:6d} {v['device_ms']:10.2f} {v['host_ms']:10.2f}")
    device_ms = sum(v["device_ms"] for v in spans.values())
    print(f"  {'sum':30s} {'':6s} {device_ms:10.2f}   (the call's wall {1e3 * wall:.2f} ms)", flush=True)
    found = None
    if device.type == "cuda":
        found = _profile(run, device, kernels, count_flops(run), calls=1)
    return out, found


def _profile(fn, device, kernels: dict, flops: int | None, calls: int = PROFILED_CALLS) -> dict:
    """`calls` calls of fn() under torch.profiler: the wall and busy time per call, the
    launches, every kernel's class (kernel_classes.py) and each class against its floor
    (`flops`: the matmul FLOPs of one call; kernels["rates"]: the measured ceilings), and the
    kernels themselves, the longest first (kernels["keep"] of them: None, all)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    sync(device)
    with profile(activities=activities, record_shapes=True) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        wall = time.perf_counter() - t
    found = KC.kernels_of(prof.events(), device.type, _dtypes_of(prof))
    busy = sum(k["us"] for k in found) / 1e6  # (overlapping streams counted twice)
    r = kernels["rates"]
    classes = KC.classes(found, calls, flops, r["matmul"]["tflops"], r["copy"]["tb_per_s"])
    ranked = KC.by_name(found, calls)
    print(f"  wall {1e3 * wall / calls:.2f} ms/call, {'device' if device.type == 'cuda' else 'op'} time "
          f"{1e3 * busy / calls:.2f} ms/call ({100 * busy / wall:.0f}%), {len(found) / calls:.0f} kernels/call",
          flush=True)
    print("\n".join(KC.table(classes)))
    for k in ranked[:kernels["shown"]]:
        print(f"  {k['ms_per_call']:8.3f} ms  {k['count']:7.1f}x  {k['class']:11s}  {k['name'][:100]}")
    keep = ranked if kernels["keep"] is None else ranked[:int(kernels["keep"])]
    return {"wall_ms": 1e3 * wall / calls, "busy_ms": 1e3 * busy / calls, "kernels_per_call": len(found) / calls,
            "flops_per_call": flops, "classes": classes, "kernel_names": len(ranked), "top": keep}


def _dtypes_of(prof):
    """The arguments' dtypes of an event, read from the profiler's own records, for a torch
    whose events do not carry them (kernel_classes.kernels_of asks only then)."""
    table: dict = {}

    def dtypes(event):
        if not table:
            table.update((k.correlation_id(), k.dtypes()) for k in prof.profiler.kineto_results.events())
        return table.get(event.id)
    return dtypes


if __name__ == "__main__":
    raise SystemExit(main())
