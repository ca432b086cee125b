"""What makes the DINO path lean on a GPU, checked where it can be: no host-device sync in
the steady state, fused optimizer and clipping with unchanged results, the head's last
layer in fp32, memory knobs and their error, one GPU per process, offline run.sh."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.ssl.step import StepValues

import kit

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")
needs_cuda = pytest.mark.cuda  # skipped without a GPU (conftest.py)

TINY = ["demo=false", "model.dim=16", "model.depth=2", "batch_size=32", "epochs=1",
        "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local_crops=2",
        "optim.warmup_epochs=1", "num_workers=0", "eval_every=0", "dino.final_linear=false",
        "model.drop_path_rate=0.0", "dino.freeze_last_layer=0"]
SYNCS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy")
# Code that runs on the training device's stream. The loader side (decode, collate)
# runs in host workers and may read its own CPU tensors freely.
# core/: the trainers' run, its log, the loop's cadence and tallies, the run folder's rules.
DEVICE_CODE = (f"{os.sep}ssl{os.sep}", "gpu_augment", f"{os.sep}lightly{os.sep}",
               *(f"core{os.sep}{name}.py" for name in ("run", "log", "cadence", "run_folder")))


def tiny_step(device="cpu", extra=()):
    cfg = load_config("dino", "resmlp_s12", [*TINY, "data=imagefolder", "data.img_size=32", "model.patch_size=8",
                                             "data.local_size=16", *extra])
    from resmlp.data.crop_plan import crop_plan
    return cfg, crop_plan(cfg)


# ---- 1. no host-device sync per iteration -------------------------------------------------
class SyncCounter:
    """Counts the tensor reads that would make the host wait for the device
    (.item(), float(), int(), bool(), .tolist(), .numpy()) made from DEVICE_CODE."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in SYNCS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        counter = self

        def wrapper(t, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if any(part in caller for part in DEVICE_CODE):
                counter.count += 1
            return real(t, *a, **k)
        return wrapper


@needs_fmnist
def test_host_syncs_do_not_grow_with_iterations(tmp_path, monkeypatch, short_knn):
    """The trainer reads device values only at log lines, checkpoints and epoch ends: a run
    of 8 iterations makes exactly as many host reads as a run of 4."""
    from resmlp.ssl import train as dino_train
    counts = {}
    for n in (4, 8):
        counter = SyncCounter(monkeypatch)
        cfg = load_config("dino", "resmlp_s12", [*TINY, f"data.subset={32 * n}", "log_every=1000", *short_knn,
                                                 f"out={tmp_path / str(n)}"])
        dino_train.train(cfg)
        counts[n] = counter.count
        monkeypatch.undo()
    assert counts[4] == counts[8], counts
    assert counts[8] <= 6, counts  # the end-of-run reads only


class FreshHostTensors(TorchDispatchMode):
    """Records tensors made from Python data (torch.tensor(list), a list used as an index):
    on a GPU each is a copy from pageable host memory, after which the host waits for the
    stream. 0-dim ones are exempt: they enter CUDA kernels as scalars, uncopied."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default and out.dim() > 0:
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("graphed", [False, True])
def test_step_and_augmentation_make_no_host_reads(monkeypatch, graphed):
    """Three DINO steps with the batched augmentation: not a single read of a device value,
    and no fresh host tensor to copy to the device. graphed: the body dino.cuda_graphs
    captures, run uncaptured."""
    from resmlp.data.gpu_augment import GpuMultiCrop
    from resmlp.ssl.graphed_step import GraphedStep
    cfg, plan = tiny_step()
    step = kit.dino_step(cfg, torch.device("cpu"), "fp32", compile=False)
    if graphed:
        step.graphed = GraphedStep(step, capture=False)
    aug = GpuMultiCrop.from_plan(plan, cfg.data)
    images = torch.randint(0, 256, (8, 3, 36, 36), dtype=torch.uint8)
    sizes = torch.stack([torch.arange(8) + 20, 36 - torch.arange(8)], dim=1)  # what the loader sends
    step(aug(images, seed=0, keys=torch.arange(8) + 80, sizes=sizes), kit.VALUES, kit.EPOCH)  # warm-up
    counter = SyncCounter(monkeypatch)
    with FreshHostTensors() as fresh:
        for i in range(3):
            step(aug(images, seed=0, keys=torch.arange(8) + 8 * i, sizes=sizes), kit.VALUES, kit.EPOCH)
    assert counter.count == 0
    assert fresh.shapes == []
    monkeypatch.undo()
    values = step.read()  # the one read, on demand
    assert values["steps"] == 4 and values["nonfinite"] == 0 and values["loss"] > 0
    assert {"teacher_entropy", "teacher_kl_mean", "last_loss"} <= set(values)
    assert step.read()["steps"] == 0  # read() resets the tally


@needs_cuda
def test_cuda_steady_state_never_synchronizes():
    """On a GPU, torch's sync debug mode raises at any synchronizing call inside three
    steady-state iterations (augmentation + step)."""
    from resmlp.data.gpu_augment import GpuMultiCrop
    cfg, plan = tiny_step()
    dev = torch.device("cuda")
    step = kit.dino_step(cfg, dev, "bf16", compile=False)
    aug = GpuMultiCrop.from_plan(plan, cfg.data, out_dtype=torch.bfloat16)
    images = torch.randint(0, 256, (8, 3, 36, 36), dtype=torch.uint8, device=dev)
    keys = torch.arange(8, device=dev)
    sizes = torch.stack([torch.arange(8) + 20, 36 - torch.arange(8)], dim=1).to(dev)
    step(aug(images, seed=0, keys=keys, sizes=sizes), kit.VALUES, kit.EPOCH)  # warm-up: allocations, handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3):
            step(aug(images, seed=0, keys=keys + 8 * (i + 1), sizes=sizes), kit.VALUES, kit.EPOCH)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.read()["nonfinite"] == 0


# ---- 3. the head's last layer and the loss in fp32 ---------------------------------------
@pytest.mark.parametrize("norm", ["none", "batchnorm"])
def test_head_last_layer_runs_in_fp32_under_bf16_autocast(norm):
    from resmlp.ssl.head import build_head, head_forward
    cfg, _ = tiny_step()
    cfg.dino.bottleneck_norm = norm
    torch.manual_seed(0)
    head = build_head(16, cfg.dino)
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_forward(head, x)
        z = head.layers(x)  # the MLP in bf16; the bottleneck norm, when on, hands on fp32
    assert got.dtype == torch.float32 and z.dtype == (torch.bfloat16 if norm == "none" else torch.float32)
    want = head.last_layer(torch.nn.functional.normalize(z.float(), dim=-1))
    assert torch.equal(got, want)
    exact = head.double()(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):     # what lightly's forward does under autocast
        old = head.float()(x).float()
    assert (got.double() - exact).abs().max() < (old.double() - exact).abs().max()


# ---- 4. fused AdamW, same results ---------------------------------------------------------
def test_fused_adamw_gives_the_same_steps():
    from resmlp.ssl.step import build_optimizer
    cfg, plan = tiny_step()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    steps = [kit.dino_step(cfg, cpu, "fp32", compile=False) for _ in range(2)]
    steps[1].student.load_state_dict(steps[0].student.state_dict())
    steps[1].teacher.load_state_dict(steps[0].teacher.state_dict())
    steps[1].optimizer = build_optimizer(steps[1].student, torch.device("cuda"))  # fused=True, on CPU tensors
    assert steps[1].optimizer.defaults["fused"] and not steps[0].optimizer.defaults["fused"]
    for seed in range(3):
        crops = kit.synthetic_crops(plan, 4, cpu, seed=seed)
        losses = [kit.call_step(s, [c.clone() for c in crops]) for s in steps]
        assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    assert torch.allclose(steps[0].loss_fn.center, steps[1].loss_fn.center, atol=1e-7)
    for a, b in zip(steps[0].student.parameters(), steps[1].student.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


# ---- 2. the trainer's augmentation: compiled with compile=true, in the step's dtype ---------
@needs_fmnist
def test_trainer_builds_the_augmentation_compiled_and_in_the_step_dtype(tmp_path, monkeypatch, short_knn):
    from resmlp.data import gpu_augment
    from resmlp.ssl import train as dino_train
    seen = {}
    real = gpu_augment.GpuMultiCrop.from_plan.__func__

    def spy(cls, plan, data_cfg, **kw):
        seen.update(kw)
        kw["compile"] = False  # the wiring is what this test checks; compiling costs minutes on 2 cores
        return real(cls, plan, data_cfg, **kw)
    monkeypatch.setattr(gpu_augment.GpuMultiCrop, "from_plan", classmethod(spy))
    monkeypatch.setattr(dino_train, "build_dino_step", _eager_step_builder())
    cfg = load_config("dino", "resmlp_s12", [*TINY, "data.subset=64", "compile=true", "precision=bf16",
                                             *short_knn, f"out={tmp_path}"])
    dino_train.train(cfg)
    on_compile_error = seen.pop("on_compile_error")   # the trainer's fallback (ssl/fallback.py, test_fallback.py)
    assert seen == {"compile": True, "out_dtype": torch.bfloat16} and callable(on_compile_error)


def _eager_step_builder():
    from omegaconf import OmegaConf

    from resmlp.ssl.step import build_dino_step

    def build(cfg, *a, **k):
        return build_dino_step(OmegaConf.merge(cfg, {"compile": False}), *a, **k)
    return build


def test_compiled_augmentation_equals_eager_in_bf16():
    from resmlp.data.gpu_augment import GpuMultiCrop
    images = torch.randint(0, 256, (4, 3, 36, 40), dtype=torch.uint8)
    eager = GpuMultiCrop(32, 16, 2, out_dtype=torch.bfloat16)(images, seed=1)
    try:
        compiled = GpuMultiCrop(32, 16, 2, out_dtype=torch.bfloat16, compile=True)(images, seed=1)
    finally:
        torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a.float() - b.float()).abs().max() < 0.05  # a bf16 step of the normalized values


# ---- 5. one GPU per process -----------------------------------------------------------------
def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    from resmlp.core import dist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserError, match="one process per GPU"):
        dist.pick_device("auto")


# ---- 6. memory: activation checkpointing and a clear out-of-memory error --------------------
def test_grad_checkpointing_is_passed_to_the_model_and_keeps_gradients():
    from resmlp.models.from_config import build_model
    base = ["model.dim=16", "model.depth=2", "data.img_size=32", "model.patch_size=8"]
    models = [build_model(load_config("dino", "resmlp_s12", [*base, f"model.grad_checkpointing={g}"]).model)
              for g in ("false", "true")]
    assert [m.grad_checkpointing for m in models] == [False, True]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(2, 3, 32, 32)
    grads = []
    for m in models:
        m(x).square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


@needs_fmnist
def test_out_of_memory_is_one_line_exit_2_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys, short_knn):
    from resmlp.core.cli import main
    from resmlp.ssl import step as step_module
    calls = {"n": 0}
    real = step_module.DinoStep.__call__

    def oom_at_third(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, *a, **k)
    monkeypatch.setattr(step_module.DinoStep, "__call__", oom_at_third)
    code = main(["dino", "resmlp_s12", *TINY, "data.subset=128", "ckpt_every=1", *short_knn, f"out={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "32 images per GPU" in err[0] and "batch_size" in err[0] and "model.grad_checkpointing=true" in err[0]
    assert "Traceback" not in err[0]
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=False)["iteration"] == 2


def test_grad_checkpointing_may_change_on_resume():
    from resmlp.core.run_folder import config_differences
    saved = {"command": "dino", "model": {"name": "resmlp_s12", "grad_checkpointing": False}, "data": {}}
    now = {"command": "dino", "model": {"name": "resmlp_s12", "grad_checkpointing": True}, "data": {}}
    assert config_differences(saved, now) == []
    now["model"]["dim"] = 8
    assert config_differences(saved, now) == ["model.dim: <unset> -> 8"]


# ---- 7. fp32 feature extraction, memory logging ----------------------------------------------
@needs_fmnist
def test_dino_knn_extracts_in_fp32_when_asked(tmp_path, monkeypatch, short_knn):
    from resmlp.eval import knn
    from resmlp.ssl import train as dino_train
    seen = []
    real = knn.online_knn
    monkeypatch.setattr(knn, "online_knn", lambda *a, **k: seen.append(k["amp_dtype"]) or real(*a, **k))
    cfg = load_config("dino", "resmlp_s12", [*TINY, "data.subset=64", "precision=fp32", *short_knn,
                                             f"out={tmp_path}"])
    dino_train.train(cfg)
    assert seen == [torch.float32]


# ---- 8. run.sh installs nothing on a machine with its own environment ----------------------
def test_run_sh_never_calls_apt_get_with_its_own_python(tmp_path):
    """RESMLP_PYTHON set and no Fashion-MNIST anywhere: run.sh must not try apt-get (an
    offline GPU node), and the command itself says where the data is missing."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "apt.log"
    for tool in ("apt-get", "sudo"):
        (fake / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {log}\nexit 1\n")
        (fake / tool).chmod(0o755)
    (fake / "id").write_text("#!/bin/sh\necho 0\n")  # pretend to be root, as on the GPU box
    (fake / "id").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "RESMLP_PYTHON": sys.executable,
           "HOME": str(tmp_path), "RESMLP_DATA_DIR": str(tmp_path / "data"),
           "RESMLP_FMNIST_SEARCH": str(tmp_path / "nowhere")}
    out = subprocess.run(["bash", "run.sh", "data", "data.download=false"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert not log.exists(), log.read_text()
    assert out.returncode == 2 and "Fashion-MNIST" in out.stderr and "Traceback" not in out.stderr


# ---- 6. the graphed step under a process group and continuing from weights (ssl/graphed_step.py) ---
# Run by the GPU campaign: on the CPU tests/test_ddp_graphs.py and tests/test_graphs.py run the
# same bodies uncaptured (gloo against DDP, and against DinoStep across dino.init's warm-up).
def twin_graphed_steps(cfg, plan, dev, start=None):
    """(DinoStep eager, DinoStep graphed) of `cfg` in bf16, with the same weights."""
    from omegaconf import OmegaConf

    from resmlp.ssl.step import build_dino_step
    autocast = kit.autocast_for(dev, "bf16")
    torch.manual_seed(0)
    plain = build_dino_step(OmegaConf.merge(cfg, {"compile": False, "dino": {"cuda_graphs": False}}), plan, dev,
                            autocast=autocast, start=start)
    graphed = build_dino_step(OmegaConf.merge(cfg, {"compile": False, "dino": {"cuda_graphs": True}}), plan, dev,
                              autocast=autocast, start=start)
    graphed.raw_student.load_state_dict(plain.raw_student.state_dict())
    graphed.teacher.load_state_dict(plain.teacher.state_dict())
    return plain, graphed


@needs_cuda
def test_graphed_step_in_a_one_process_nccl_group_reduces_in_its_graph(tmp_path):
    """torchrun's one-process line: in an NCCL group of one the graphed step takes its flat
    all-reduce, captured once with the rest, and gives the eager step's losses and weights
    (to bf16 rounding, as tests/test_graphs.py's graphed-against-eager test)."""
    import torch.distributed as tdist

    from test_graphs import SCHEDULE, schedule
    dev = torch.device("cuda", torch.cuda.current_device())
    tdist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=dev)
    try:
        cfg, plan = tiny_step()
        plain, graphed = twin_graphed_steps(cfg, plan, dev)
        g = graphed.graphed
        assert g.reduce and g.flat is not None and graphed.ddp is None
        for i, (values, epoch) in enumerate(SCHEDULE + schedule((1.5e-3, 0.1, 0.998, 0.07, 1)) * 4):
            crops = kit.synthetic_crops(plan, 8, dev, seed=i)
            a = plain([c.clone() for c in crops], values, epoch)[0].float()
            b = graphed([c.clone() for c in crops], values, epoch)[0].float()
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
        assert g.captures == 1 and g.calls == len(SCHEDULE) + 4
        for p, q in zip(plain.raw_student.parameters(), graphed.raw_student.parameters()):
            torch.testing.assert_close(q, p, rtol=2e-2, atol=2e-3)
        assert graphed.read()["nonfinite"] == 0
    finally:
        tdist.destroy_process_group()


@needs_cuda
def test_graphed_step_continues_from_weights_across_the_head_warmup(tmp_path):
    """dino.init in the graph: captured once during the head warm-up, the backbone (student and
    teacher) bitwise as loaded through the warm-up's replays, learning after it at its scale;
    the eager step's losses and weights to bf16 rounding."""
    from test_dino_init import start_for, timm_file

    from resmlp.data.crop_plan import crop_plan
    dev = torch.device("cuda")
    path, _ = timm_file(tmp_path / "timm.pth")
    cfg, start = start_for(tmp_path, f"dino.init={path}", "dino.head_warmup_epochs=1", "dino.init_lr_scale=0.25",
                           "data.local_size=16")
    plan = crop_plan(cfg)
    plain, graphed = twin_graphed_steps(cfg, plan, dev, start)
    at_start = {k: v.clone() for k, v in graphed.raw_student.backbone.state_dict().items()}
    teacher_at_start = {k: v.clone() for k, v in graphed.teacher.backbone.state_dict().items()}
    warm = graphed.graphed.calls_to_steady_state + 2   # the warm-up calls, the capture and two replays
    for i in range(warm + 4):
        epoch = 0 if i < warm else 1
        crops = [c[:4] for c in kit.synthetic_crops(plan, 4, dev, seed=i)]
        values = StepValues(lr=1e-3, wd=0.04, momentum=0.996, teacher_temp=0.04)
        a = plain([c.clone() for c in crops], values, epoch)[0].float()
        b = graphed([c.clone() for c in crops], values, epoch)[0].float()
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
        if epoch == 0:
            for net, was in ((graphed.raw_student, at_start), (graphed.teacher, teacher_at_start)):
                assert all(torch.equal(v, was[k]) for k, v in net.backbone.state_dict().items())
    assert graphed.graphed.captures == 1
    assert any(not torch.equal(v, at_start[k]) for k, v in graphed.raw_student.backbone.state_dict().items())
    for p, q in zip(plain.raw_student.parameters(), graphed.raw_student.parameters()):
        torch.testing.assert_close(q, p, rtol=2e-2, atol=2e-3)
    assert graphed.read()["nonfinite"] == 0
