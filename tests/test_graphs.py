"""dino.cuda_graphs (ssl/graphed_step.py): the step with its schedules in device tensors, and the path
a run takes (compiled by region or whole, graphed or not) that `compile=auto` and
`dino.cuda_graphs=auto` choose. On the CPU the graph's arithmetic runs uncaptured against
DinoStep's own (also continuing from weights, across the head warm-up); the capture itself
needs CUDA. tests/test_ddp_graphs.py has the gradients' reduction against DDP's."""
import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from resmlp.core.compiling import compile_form
from resmlp.core.config import load_config, save_config, to_dict
from resmlp.core.errors import Finished, UserError
from resmlp.ssl.graphed_step import GraphedStep, use_cuda_graphs
from resmlp.ssl.step import StepValues, dino_path

import kit

needs_cuda = pytest.mark.cuda  # skipped without a GPU (conftest.py); the campaign runs them

TINY = ["demo=false", "model.dim=16", "model.depth=2", "batch_size=8", "dino.out_dim=64", "dino.hidden_dim=32",
        "dino.bottleneck_dim=16", "dino.n_local_crops=2", "model.drop_path_rate=0.0", "data=imagefolder",
        "data.img_size=32", "model.patch_size=8", "data.local_size=16", "dino.freeze_last_layer=1"]

def schedule(*points) -> list:
    """(StepValues, epoch) pairs from (lr, weight decay, momentum, teacher temperature, epoch) points."""
    return [(StepValues(*point[:4]), point[4]) for point in points]


# every value moves, the last layer unfreezes half-way, and the decay is large enough that a
# wrong one would show
SCHEDULE = schedule((1e-3, 0.2, 0.99, 0.04, 0), (2e-3, 0.3, 0.992, 0.05, 0), (3e-3, 0.4, 0.994, 0.06, 1),
                    (2.5e-3, 0.5, 0.996, 0.07, 1), (2e-3, 0.6, 0.998, 0.07, 1))


def tiny(*extra):
    from resmlp.data.crop_plan import crop_plan
    cfg = load_config("dino", "resmlp_s12", [*TINY, *extra])
    return cfg, crop_plan(cfg)


def twin_steps(device, precision="fp32", compile=False, graphed_kw=None, extra=()):
    """The same step twice, same weights: (DinoStep as it is, DinoStep with GraphedStep)."""
    cfg, plan = tiny(*extra)
    torch.manual_seed(0)
    plain = kit.dino_step(cfg, device, precision, compile=compile)
    graphed = kit.dino_step(cfg, device, precision, compile=compile)
    graphed.student.load_state_dict(plain.student.state_dict())
    graphed.teacher.load_state_dict(plain.teacher.state_dict())
    graphed.graphed = GraphedStep(graphed, **(graphed_kw or {}))
    return plain, graphed, plan


def last_layer(step):
    return step.raw_student.head.last_layer.weight_v


def assert_learned_alike(plain, graphed) -> None:
    """The same weights (student and teacher) and AdamW state. AdamW turns the rounding
    differences of tiny gradients into differences of a small fraction of lr (here up to
    3e-3): far below what a wrong lr, decay, scale or momentum would make. A parameter
    DinoStep never stepped (frozen to the end) has a step count of 0 in the graphed one."""
    for name, net in (("student", "raw_student"), ("teacher", "teacher")):
        for (n, p), q in zip(getattr(plain, net).named_parameters(), getattr(graphed, net).parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=f"{name} {n}")
    for p, q in zip(plain.raw_student.parameters(), graphed.raw_student.parameters()):
        if p in plain.optimizer.state:
            sp, sq = plain.optimizer.state[p], graphed.optimizer.state[q]
            assert float(sp["step"]) == float(sq["step"])
            assert (sq["exp_avg"] - sp["exp_avg"]).norm() <= 1e-3 * sp["exp_avg"].norm()
        elif q.requires_grad:
            assert float(graphed.optimizer.state[q]["step"]) == 0


def test_tensor_schedules_give_the_steps_of_plain_numbers():
    """Five steps with every schedule moving and the frozen last layer thawing: the graph's
    arithmetic (uncaptured on the CPU) gives DinoStep's losses, weights, center and AdamW
    state, and the frozen layer and its state are bitwise untouched while frozen."""
    cpu = torch.device("cpu")
    plain, graphed, plan = twin_steps(cpu, graphed_kw={"capture": False})
    frozen_at_start = last_layer(graphed).detach().clone()
    for i, (values, epoch) in enumerate(SCHEDULE):
        crops = kit.synthetic_crops(plan, 8, cpu, seed=i)
        a = plain([c.clone() for c in crops], values, epoch)
        b = graphed([c.clone() for c in crops], values, epoch)
        torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)
        if epoch == 0:
            assert torch.equal(last_layer(graphed), frozen_at_start)
            state = graphed.optimizer.state[last_layer(graphed)]
            assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert not torch.equal(last_layer(graphed), frozen_at_start)
    assert graphed.graphed.captures == 0
    torch.testing.assert_close(graphed.loss_fn.center, plain.loss_fn.center, rtol=1e-6, atol=1e-7)
    assert_learned_alike(plain, graphed)
    values = [s.read() for s in (plain, graphed)]
    assert values[0]["steps"] == values[1]["steps"] == len(SCHEDULE)
    for key in ("loss", "teacher_entropy", "teacher_kl_mean"):
        assert values[1][key] == pytest.approx(values[0][key], rel=1e-5)


def continuing_twins(tmp_path):
    """A step continuing from timm weights (dino.init: a new head, 1 epoch of head warm-up on
    the frozen backbone, the backbone at 0.25 x the rate afterwards, the last layer frozen for
    2 epochs) twice with the same weights: (DinoStep as it is, DinoStep with GraphedStep
    uncaptured, the crop plan)."""
    from test_dino_init import start_for, timm_file

    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    path, _ = timm_file(tmp_path / "timm.pth")
    cfg, start = start_for(tmp_path, f"dino.init={path}", "dino.head_warmup_epochs=1", "dino.init_lr_scale=0.25",
                           "dino.freeze_last_layer=2", "data.local_size=16")
    plan = crop_plan(cfg)
    torch.manual_seed(0)
    plain = build_dino_step(cfg, plan, torch.device("cpu"), start=start)
    graphed = build_dino_step(cfg, plan, torch.device("cpu"), start=start)
    graphed.raw_student.load_state_dict(plain.raw_student.state_dict())
    graphed.teacher.load_state_dict(plain.teacher.state_dict())
    graphed.graphed = GraphedStep(graphed, capture=False)
    return plain, graphed, plan


def test_the_graphed_body_continues_from_weights_as_dinostep_does(tmp_path):
    """dino.init's head warm-up and the backbone's learning-rate scale as tensors the graph
    reads: over a run that crosses the end of the warm-up (epoch 0 frozen backbone, epoch 1 the
    backbone joins at 0.25 x the rate, epoch 2 the last layer thaws) the uncaptured graph body
    gives DinoStep's losses, weights and AdamW state; during the warm-up the backbone (student
    and teacher) stays bitwise as loaded and its AdamW state as if never stepped, as DinoStep's
    frozen backbone does."""
    plain, graphed, plan = continuing_twins(tmp_path)
    backbone_at_start = {k: v.clone() for k, v in graphed.raw_student.backbone.state_dict().items()}
    teacher_at_start = {k: v.clone() for k, v in graphed.teacher.backbone.state_dict().items()}
    points = schedule((1e-3, 0.2, 0.99, 0.04, 0), (2e-3, 0.3, 0.992, 0.05, 0), (3e-3, 0.4, 0.994, 0.06, 1),
                      (2.5e-3, 0.5, 0.996, 0.07, 1), (2e-3, 0.6, 0.998, 0.07, 2), (1.5e-3, 0.6, 0.998, 0.07, 2))
    for i, (values, epoch) in enumerate(points):
        crops = [c[:4] for c in kit.synthetic_crops(plan, 4, torch.device("cpu"), seed=i)]
        a = plain([c.clone() for c in crops], values, epoch)
        b = graphed([c.clone() for c in crops], values, epoch)
        torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-6)
        if epoch == 0:   # the warm-up: bitwise, as the eager step without gradients leaves it
            for net, start in ((graphed.raw_student, backbone_at_start), (graphed.teacher, teacher_at_start)):
                assert all(torch.equal(v, start[k]) for k, v in net.backbone.state_dict().items())
            for p in graphed.raw_student.backbone.parameters():
                state = graphed.optimizer.state[p]
                assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
            assert all(p not in plain.optimizer.state for p in plain.raw_student.backbone.parameters())
    moved = [not torch.equal(v, backbone_at_start[k]) for k, v in graphed.raw_student.backbone.state_dict().items()]
    assert any(moved)   # the backbone joined after the warm-up
    # a backbone at 1x instead of 0.25x the rate, or learning during the warm-up, would be off
    # by steps of the rate's size (1e-3)
    assert_learned_alike(plain, graphed)
    torch.testing.assert_close(graphed.loss_fn.center, plain.loss_fn.center, rtol=1e-6, atol=1e-7)


def test_the_switch():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)   # a device object: no GPU needed to ask
    assert use_cuda_graphs(False, gpu, False) == (False, "graphs off: dino.cuda_graphs=false")
    assert use_cuda_graphs("auto", gpu, False) == (True, None) and use_cuda_graphs(True, gpu, False) == (True, None)
    assert use_cuda_graphs("auto", cpu, False) == (False, "graphs off: CUDA graphs need a CUDA GPU")
    assert use_cuda_graphs("auto", gpu, True)[1].startswith("graphs off: fp16 needs GradScaler")
    assert use_cuda_graphs("auto", gpu, False, grad_checkpointing=True)[0] is False
    assert use_cuda_graphs(True, gpu, False, grad_checkpointing=True) == (True, None)   # asked for: tried
    for args, why in (((cpu, False), "CUDA GPU"), ((gpu, True), "GradScaler")):
        with pytest.raises(UserError, match=why):
            use_cuda_graphs(True, *args)
    with pytest.raises(UserError, match="^dino.cuda_graphs=sometimes is not allowed: dino.cuda_graphs must be one "
                                        "of auto, true, false$"):
        use_cuda_graphs("sometimes", gpu, False)
    with pytest.raises(UserError, match="is text, not the flag true"):   # no second reading of the words
        use_cuda_graphs("true", gpu, False)
    assert tiny()[0].dino.cuda_graphs == "auto"   # the default: on where it can be
    with pytest.raises(UserError, match="dino.cuda_graphs=true needs a CUDA GPU"):
        kit.dino_step(tiny()[0], cpu, "fp32", compile=False, graphs=True)
    from resmlp.ssl.step import build_dino_step
    cfg, plan = tiny("dino.cuda_graphs=auto")
    assert build_dino_step(cfg, plan, cpu).graphed is None


def path_of(device, *extra, scaler=False):
    cfg = load_config("dino", "resmlp_s12", ["demo=false", *extra])
    return dino_path(cfg, torch.device(device), scaler)


def test_auto_takes_the_measured_path_for_each_case():
    """compile=auto and dino.cuda_graphs=auto, asked through the decision function with a
    faked CUDA device (no GPU here): DINO on a GPU compiled by region and graphed; where the
    step cannot be graphed (fp16's GradScaler, grad checkpointing, graphs turned off) compiled
    whole; on a CPU eager; each part that is off says why in one line. The process count and
    dino.init no longer enter the decision (they once refused graphs)."""
    lines = lambda p: p.lines()  # noqa: E731
    gpu = path_of("cuda:0")
    assert gpu.record() == {"compile": "regions", "cuda_graphs": True}
    assert lines(gpu) == ["path: blocks compiled by region, the step as one CUDA graph"]
    fp16 = path_of("cuda:0", "precision=fp16", scaler=True)
    assert fp16.record() == {"compile": "whole", "cuda_graphs": False}
    assert lines(fp16) == ["path: networks compiled whole, not graphed",
                           "graphs off: fp16 needs GradScaler, which reads its scale on the host (precision=bf16 is "
                           "graphed, on a GPU that has bf16: sm 8.0 or later)"]
    assert path_of("cuda:0", "model.grad_checkpointing=true").record() == {"compile": "whole", "cuda_graphs": False}
    assert path_of("cuda:0", "dino.cuda_graphs=false").lines() == ["path: networks compiled whole, not graphed",
                                                                  "graphs off: dino.cuda_graphs=false"]
    cpu = path_of("cpu")
    assert cpu.record() == {"compile": False, "cuda_graphs": False}
    assert lines(cpu) == ["path: eager, not graphed",
                          "compile off: auto compiles on a CUDA GPU (compile=true compiles here too)",
                          "graphs off: CUDA graphs need a CUDA GPU"]
    # the other words keep what users expect: true is on (by region here), false off, a form as asked
    assert path_of("cpu", "compile=true").record()["compile"] == "regions"
    assert path_of("cuda:0", "compile=true", "dino.cuda_graphs=false").record()["compile"] == "whole"
    assert path_of("cuda:0", "compile=regions", "dino.cuda_graphs=false").record()["compile"] == "regions"
    assert path_of("cpu", "compile=whole").record()["compile"] == "whole"
    assert path_of("cuda:0", "compile=false").lines() == ["path: eager, the step as one CUDA graph",
                                                         "compile off: compile=false"]
    assert path_of("cuda:0", "dino.init=/nowhere/weights.pth").record() == gpu.record()
    # a trainer no GPU bench has timed compiled stays eager under auto, and says so
    assert compile_form("auto", torch.device("cuda", 0), "supervised") == (
        None, "compile off: no GPU bench has timed the supervised step compiled, so auto leaves it eager "
              "(compile=true compiles it)")
    assert compile_form(True, torch.device("cuda", 0), "finetune") == ("regions", None)
    assert compile_form(True, torch.device("cpu"), "dino") == ("regions", None)   # compile=true as before
    with pytest.raises(UserError, match="^compile=fast is not allowed: compile must be one of auto, true, false, "
                                        "regions, whole$"):
        compile_form("fast", torch.device("cpu"), "dino")


def test_a_run_asked_auto_resumed_or_finished_with_false_is_the_same_run(tmp_path):
    """compile and dino.cuda_graphs are runtime keys (core.run_folder.RUNTIME_KEYS): a finished
    run started with false is the run asked for by auto (nothing to do), and one with another
    setting is not."""
    from resmlp.core.run import Run
    from resmlp.core.run_folder import settings_differences
    old = load_config("dino", "resmlp_s12", [*TINY, "compile=false", "dino.cuda_graphs=false", f"out={tmp_path}"])
    now = load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path}"])
    assert (now.compile, now.dino.cuda_graphs) == ("auto", "auto")
    assert settings_differences(to_dict(old), to_dict(now)) == []
    other = OmegaConf.merge(now, {"dino": {"teacher_temp": 0.05}})
    assert settings_differences(to_dict(old), to_dict(other)) == ["dino.teacher_temp: 0.04 -> 0.05"]
    save_config(old, tmp_path / "config.yaml")   # as Run.open writes it
    (tmp_path / "checkpoint.pth").write_bytes(b"")   # Run looks for it; a finished run is not loaded
    (tmp_path / "results.json").write_text(json.dumps({"epochs": int(old.epochs)}))
    with pytest.raises(Finished, match="holds a finished run"):
        Run(now)
    with pytest.raises(UserError, match=r"a finished run with other settings \(dino.teacher_temp"):
        Run(other)


# ---- CUDA (run by the GPU campaign) ---------------------------------------------------------
# Drop path draws from the default CUDA generator, which torch registers with every capture:
# a replay reads the generator's seed and offset from device tensors filled just before it
# and moves the offset on by the whole graph's draw. So each replay draws new masks, the
# ones an eager step would draw from the same generator state.
@needs_cuda
@pytest.mark.parametrize("compile,precision", [(False, "bf16"), (True, "bf16"), (False, "fp32")])
def test_graphed_steps_equal_eager_steps_and_capture_once(compile, precision):
    """N graphed steps (warm-up, one capture, replays) against N steps of DinoStep with
    drop path 0.1 (the preset's), each twin's step from the same generator state: the same
    losses and weights to bf16 rounding (fp32: to what AdamW makes of rounding); one capture,
    and no recompilation after it. Twins drawing other masks end about 2e-2 apart in the
    weights and 2e-3 in a loss (the uncaptured body on the CPU; the same masks: 1e-7),
    10x the weight tolerance here."""
    dev = torch.device("cuda")
    plain, graphed, plan = twin_steps(dev, precision, compile=compile, extra=["model.drop_path_rate=0.1"])
    loss_tol, weight_tol = (2e-2, 2e-3) if precision == "bf16" else (1e-4, 1e-3)
    g = graphed.graphed
    points = SCHEDULE + schedule((1.5e-3, 0.1, 0.998, 0.07, 1)) * 4
    compiled_graphs = None
    try:
        for i, (values, epoch) in enumerate(points):
            crops = kit.synthetic_crops(plan, 8, dev, seed=i)
            state = torch.cuda.get_rng_state()
            a = plain([c.clone() for c in crops], values, epoch)[0].float()
            torch.cuda.set_rng_state(state)
            b = graphed([c.clone() for c in crops], values, epoch)[0].float()
            torch.testing.assert_close(b, a, rtol=loss_tol, atol=loss_tol)
            if i + 1 == g.calls_to_steady_state:
                compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert g.captures == 1 and g.calls == len(points)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_graphs
        for p, q in zip(plain.raw_student.parameters(), graphed.raw_student.parameters()):
            torch.testing.assert_close(q, p, rtol=loss_tol, atol=weight_tol)
        torch.testing.assert_close(graphed.loss_fn.center, plain.loss_fn.center, rtol=loss_tol, atol=weight_tol)
        assert graphed.read()["nonfinite"] == 0
    finally:
        torch._dynamo.reset()


@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
def test_graphed_replays_draw_new_drop_path_masks(compile):
    """Replays on the same crops with nothing learning (lr 0, no decay, the teacher and the
    center held): with drop path 0.1 every replay's loss differs and the generator moves on;
    without drop path the losses are equal, so the masks alone made the difference."""
    dev = torch.device("cuda")
    held = (StepValues(lr=0.0, wd=0.0, momentum=1.0, teacher_temp=0.04), 1)  # momentum 1: EMA weight 0
    try:
        for rate in (0.1, 0.0):
            cfg, plan = tiny(f"model.drop_path_rate={rate}", "dino.center_momentum=1.0")
            torch.manual_seed(0)
            step = kit.dino_step(cfg, dev, "bf16", compile=compile, graphs=True)
            crops = kit.synthetic_crops(plan, 8, dev, seed=0)
            for _ in range(step.graphed.calls_to_steady_state):
                step(crops, *held)
            losses, states = [], []
            for _ in range(3):
                states.append(torch.cuda.get_rng_state())
                losses.append(step(crops, *held)[0].item())  # the graph's output buffer: read before the next
            assert step.graphed.captures == 1 and step.read()["nonfinite"] == 0
            moved = [not torch.equal(a, b) for a, b in zip(states, states[1:])]
            if rate:
                assert len(set(losses)) == 3 and moved == [True, True], (losses, moved)
            else:  # nothing drawn: the generator stays, the losses are one
                assert len(set(losses)) == 1 and moved == [False, False], (losses, moved)
            torch._dynamo.reset()
    finally:
        torch._dynamo.reset()


@needs_cuda
def test_graphed_step_never_reads_the_device():
    """After the capture: augmentation + replay under torch's sync debug mode (raises at any
    synchronizing call)."""
    from resmlp.data.gpu_augment import GpuMultiCrop
    dev = torch.device("cuda")
    cfg, plan = tiny()
    step = kit.dino_step(cfg, dev, "bf16", compile=False, graphs=True)
    aug = GpuMultiCrop.from_plan(plan, cfg.data, out_dtype=torch.bfloat16)
    images = torch.randint(0, 256, (8, 3, 36, 36), dtype=torch.uint8, device=dev)
    keys = torch.arange(8, device=dev)
    sizes = torch.stack([torch.arange(8) + 20, 36 - torch.arange(8)], dim=1).to(dev)
    for i in range(step.graphed.calls_to_steady_state):
        step(aug(images, seed=0, keys=keys + 8 * i, sizes=sizes), kit.VALUES, 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3):
            step(aug(images, seed=0, keys=keys + 100 + 8 * i, sizes=sizes), kit.VALUES, 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.graphed.captures == 1
    assert step.read()["nonfinite"] == 0


def fashion_mnist_found() -> bool:
    """Where the trainer looks (data/fashion_mnist.py; run.sh campaign adds the carried .fmnist/)."""
    from resmlp.data.fashion_mnist import find_idx_dir, search_dirs
    return any(find_idx_dir(d) for d in search_dirs())


needs_fmnist = pytest.mark.skipif(not fashion_mnist_found(), reason="Fashion-MNIST is not in any folder "
                                  "data/fashion_mnist.py searches (RESMLP_FMNIST_SEARCH, the download cache, Debian's "
                                  "package)")


def two_epochs(tmp_path, monkeypatch, short_knn, graphs):
    """Two epochs of the trainer on 256 Fashion-MNIST images (loader workers, pinned memory on
    a GPU, the last layer thawing after epoch 1), judged by its own k-NN on a small labeled
    folder: (the steps it built, results.json's fields, what it printed)."""
    from resmlp.ssl import step as step_module
    from resmlp.ssl import train as dino_train
    built = []
    real = step_module.build_dino_step
    monkeypatch.setattr(dino_train, "build_dino_step", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    cfg = load_config("dino", "resmlp_s12", ["demo=false", "model.dim=16", "model.depth=2", "data.subset=256",
                                             "batch_size=32", "epochs=2", "dino.out_dim=64", "dino.hidden_dim=32",
                                             "dino.bottleneck_dim=16", "dino.n_local_crops=2", "num_workers=2",
                                             "eval_every=0", "dino.final_linear=false", f"dino.cuda_graphs={graphs}",
                                             f"compile={'auto' if graphs == 'auto' else False}",
                                             *short_knn, f"out={tmp_path}"])
    summary = dino_train.train(cfg)[3]
    losses = [json.loads(line).get("loss") for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for v in losses if v is not None) and any(v is not None for v in losses)
    # the final k-NN, as summarize prints it and results.json keeps it
    assert summary["knn_k"] == 20 and summary["knn_T"] == 0.07 and 0 <= summary["knn_top1"] <= 100
    assert json.loads((tmp_path / "results.json").read_text())["knn_k"] == 20
    return built


@needs_cuda
@needs_fmnist
def test_the_trainer_runs_graphed(tmp_path, monkeypatch, short_knn, capsys):
    """dino.cuda_graphs=true in the trainer: finite, one capture, its k-NN reported."""
    built = two_epochs(tmp_path, monkeypatch, short_knn, graphs=True)
    assert built[0].graphed.captures == 1 and built[0].graphed.calls == 16
    assert "(k=20, T=0.07)" in capsys.readouterr().out


@needs_fmnist
def test_the_trainer_runs_to_its_summary_without_graphs(tmp_path, monkeypatch, short_knn, capsys):
    """The graphed run's path from the loop to its summary, without the capture: on the CPU it
    runs in CI (the graphed one only where a GPU is). Asked auto for both (the defaults), the
    run says which path it took in its first lines; config.yaml keeps what was asked,
    results.json what was chosen. The path is decided once, before the views, and the views
    and the step are handed that one."""
    from resmlp.ssl import train as dino_train
    decided, given = [], []
    real_path, real_views = dino_train.dino_path, dino_train.build_views
    monkeypatch.setattr(dino_train, "dino_path", lambda *a, **k: decided.append(real_path(*a, **k)) or decided[-1])
    monkeypatch.setattr(dino_train, "build_views", lambda *a, **k: given.append(k["path"]) or real_views(*a, **k))
    built = two_epochs(tmp_path, monkeypatch, short_knn, graphs="auto")
    assert built[0].graphed is None
    assert len(decided) == 1 and given == decided and built[0].path is decided[0]
    out = capsys.readouterr().out
    assert "(k=20, T=0.07)" in out
    lines = out.splitlines()
    first = lines.index("path: eager, not graphed")
    assert lines[first + 1:first + 3] == ["compile off: auto compiles on a CUDA GPU (compile=true compiles here too)",
                                          "graphs off: CUDA graphs need a CUDA GPU"]
    assert first < min(i for i, line in enumerate(lines) if line.startswith("DINO "))   # before the run's own line
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.compile == "auto" and saved.dino.cuda_graphs == "auto"
    assert json.loads((tmp_path / "results.json").read_text())["path"] == {"compile": False, "cuda_graphs": False}
