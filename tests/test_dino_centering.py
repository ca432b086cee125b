"""DINOv2's answers as options of the DINO trainer: Sinkhorn-Knopp centering of the
teacher's targets against a plain implementation (one process and two gloo processes),
KoLeo on the student's pooled global features, and their config checks."""
import math
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf

from resmlp.core import cli
from resmlp.core.config import load_config
from resmlp.ssl.loss import DinoLoss
from resmlp.ssl.step import StepValues

TEMP = 0.04
VALUES = StepValues(lr=0.0, wd=0.04, momentum=0.996, teacher_temp=TEMP)   # lr 0: the weights stay


def loss_cfg(centering: str, out_dim: int = 40):
    return OmegaConf.create({"out_dim": out_dim, "student_temp": 0.1, "center_momentum": 0.9,
                             "centering": centering})


def plain_sinkhorn(t: torch.Tensor, temp: float, iterations: int = 3) -> torch.Tensor:
    """DINOv2's sinkhorn_knopp_teacher as its paper describes it, on one process, in float64:
    alternate normalizing each prototype's mass over the batch and each image's row."""
    q = torch.exp(t.double() / temp)
    q = q / q.sum()
    n, k = q.shape
    for _ in range(iterations):
        q = q / q.sum(0, keepdim=True) / k   # every prototype gets 1/K of the mass
        q = q / q.sum(1, keepdim=True) / n   # every image 1/N
    return q * n                             # rows: each image's target distribution


def test_sinkhorn_targets_match_a_plain_implementation():
    torch.manual_seed(0)
    t = torch.randn(24, 40)
    small = t * 0.3  # within [-1, 1] as with the normalized last layer
    got = DinoLoss(loss_cfg("sinkhorn")).targets(small, TEMP)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), plain_sinkhorn(small, TEMP), atol=1e-6)
    assert torch.allclose(got.sum(1), torch.ones(24), atol=1e-5)  # a distribution per image
    # logits whose exp overflows in fp32 (a last layer whose norm is trained): still finite, the same
    assert not torch.isfinite(torch.exp(t / TEMP)).all()
    got = DinoLoss(loss_cfg("sinkhorn")).targets(t, TEMP)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), plain_sinkhorn(t, TEMP), atol=1e-4)


def test_mean_targets_are_dinos_and_sinkhorn_uses_no_center():
    torch.manual_seed(0)
    t = torch.randn(8, 40)
    loss = DinoLoss(loss_cfg("mean"))
    loss.center.normal_()
    want = F.softmax((t - loss.center.reshape(1, -1)) / TEMP, dim=-1)
    assert torch.allclose(loss.targets(t, TEMP), want, atol=1e-6)
    sk = DinoLoss(loss_cfg("sinkhorn"))
    sk(list(t.chunk(2)), list(torch.randn(12, 40).chunk(3)), teacher_temp=TEMP)
    assert not sk.center.any()  # the center stays at zero: checkpoints keep the key


def test_sinkhorn_loss_is_the_cross_entropy_to_its_targets():
    torch.manual_seed(0)
    teacher = [torch.randn(6, 40) for _ in range(2)]
    student = [torch.randn(6, 40) for _ in range(5)]
    q = plain_sinkhorn(torch.cat(teacher), TEMP).float().chunk(2)
    total, n = 0.0, 0
    for i, qi in enumerate(q):
        for v, s in enumerate(student):
            if v != i:
                total += torch.sum(-qi * F.log_softmax(s / 0.1, dim=-1), dim=-1).mean()
                n += 1
    got = DinoLoss(loss_cfg("sinkhorn"))(teacher, student, teacher_temp=TEMP)
    assert torch.allclose(got, total / n, atol=1e-5)


def _join(rank: int, out_dir: str) -> None:
    """The two processes meet through a file in the test's folder: no port to pick (one picked
    free here and closed could be taken by another process before rank 0 binds it)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=2)


def _sinkhorn_on_rank(rank, t, out_dir):
    from resmlp.core.dist import leaving
    _join(rank, out_dir)
    with leaving():  # the trainers' teardown: a barrier before the group goes
        mine = t.chunk(2)[rank]
        torch.save(DinoLoss(loss_cfg("sinkhorn")).targets(mine, TEMP), os.path.join(out_dir, f"q{rank}.pt"))


@pytest.mark.parametrize("end,together", [(None, True), ("Preempted", True), ("RuntimeError", False)])
def test_the_group_is_left_at_a_barrier_only_when_every_rank_is_leaving(end, together, tmp_path, monkeypatch):
    """core.dist.leaving, the one teardown of trainers, evaluators and these tests: a normal end
    or an agreed stop meets at a barrier before the group goes (gloo's teardown raced a peer's
    last messages without one); any other error leaves at once, since peers may never come."""
    import torch.distributed as dist

    from resmlp.core import dist as rdist
    from resmlp.core.errors import Preempted
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append("barrier"))
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (calls.append("destroy"), destroy()))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    errors = {"Preempted": Preempted, "RuntimeError": RuntimeError}
    raised = None
    try:
        with rdist.leaving():
            if end is not None:
                raise errors[end]("stop")
    except (Preempted, RuntimeError) as e:
        raised = type(e).__name__
    assert raised == end  # the error still reaches the caller
    assert calls == (["barrier", "destroy"] if together else ["destroy"])
    assert not rdist.is_dist()


def test_sinkhorn_over_two_gloo_processes_is_over_the_global_batch(tmp_path):
    """Each process holds half the images; together they give the targets one process
    computes from all of them (DINOv2 normalizes over every process's rows)."""
    torch.manual_seed(0)
    t = torch.randn(16, 40) * 0.3
    mp.spawn(_sinkhorn_on_rank, args=(t, str(tmp_path)), nprocs=2, join=True)
    together = torch.cat([torch.load(tmp_path / f"q{r}.pt") for r in (0, 1)])
    assert torch.allclose(together.double(), plain_sinkhorn(t, TEMP), atol=1e-6)
    alone = DinoLoss(loss_cfg("sinkhorn")).targets(t.chunk(2)[0], TEMP)
    assert not torch.allclose(alone, together[:8], atol=1e-3)  # so the processes did talk


def test_teacher_stats_read_the_targets_the_loss_uses():
    from resmlp.ssl.health import teacher_stats
    K = 40
    uniform = teacher_stats(torch.full((16, K), 1 / K))
    assert uniform["teacher_entropy"] == pytest.approx(math.log(K), abs=1e-5)
    assert uniform["teacher_kl_mean"] == pytest.approx(0.0, abs=1e-5)
    sharp = teacher_stats(F.one_hot(torch.arange(16) % K, K).float())  # zeros in the targets: no NaN
    assert sharp["teacher_entropy"] == pytest.approx(0.0, abs=1e-6)
    assert sharp["teacher_kl_mean"] == pytest.approx(math.log(16), abs=1e-5)
    torch.manual_seed(0)
    # under Sinkhorn-Knopp too: high while the targets depend on the image, 0 once they do not
    q = DinoLoss(loss_cfg("sinkhorn", K)).targets(torch.randn(16, K) * 0.3, TEMP)
    assert teacher_stats(q)["teacher_kl_mean"] > 1.0
    same = DinoLoss(loss_cfg("sinkhorn", K)).targets(torch.randn(1, K).repeat(16, 1), TEMP)
    assert teacher_stats(same)["teacher_kl_mean"] == pytest.approx(0.0, abs=1e-5)


TINY = ["demo=false", "model.dim=16", "model.depth=2", "batch_size=8", "dino.out_dim=64", "dino.hidden_dim=32",
        "dino.bottleneck_dim=16", "dino.n_local_crops=2", "data=imagefolder", "data.img_size=32",
        "model.patch_size=8", "data.local_size=16", "model.drop_path_rate=0.0", "dino.freeze_last_layer=0"]


def test_koleo_is_lightlys_on_the_students_pooled_global_features():
    from lightly.loss import KoLeoLoss

    import kit
    from resmlp.ssl.step import build_dino_step
    from resmlp.data.crop_plan import crop_plan
    cfg = load_config("dino", "resmlp_s12", [*TINY, "dino.koleo_weight=0.5", "dino.centering=sinkhorn"])
    plan = crop_plan(cfg)
    crops = kit.synthetic_crops(plan, 8, torch.device("cpu"), seed=0)
    torch.manual_seed(0)
    step = build_dino_step(cfg, plan, torch.device("cpu"))
    student = step.raw_student
    with torch.no_grad():
        want = sum(KoLeoLoss()(student.backbone(c)) for c in crops[:2])
    step(crops, VALUES, 1)
    stats = step.read()
    assert stats["koleo"] == pytest.approx(want.item(), rel=1e-4)
    torch.manual_seed(0)
    plain = build_dino_step(load_config("dino", "resmlp_s12", [*TINY, "dino.centering=sinkhorn"]), plan,
                            torch.device("cpu"))
    plain(crops, VALUES, 1)
    base = plain.read()
    assert "koleo" not in base
    assert stats["loss"] == pytest.approx(base["loss"] + 0.5 * want.item(), rel=1e-4)  # the weighted term is in


KOLEO = [*TINY, "dino.koleo_weight=0.5", "dino.centering=sinkhorn"]


def _koleo_step_on_rank(rank, out_dir):
    """One step of the trainer's DINO step (DDP over gloo) on this process's half of the batch."""
    import kit
    from resmlp.core.dist import leaving
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    _join(rank, out_dir)
    with leaving():
        cfg = load_config("dino", "resmlp_s12", KOLEO)
        plan = crop_plan(cfg)
        crops = kit.synthetic_crops(plan, 8, torch.device("cpu"), seed=0)  # the global batch
        torch.manual_seed(0)
        step = build_dino_step(cfg, plan, torch.device("cpu"), world_size=2)
        step([c.chunk(2)[rank] for c in crops], VALUES, 1)
        grads = {n: p.grad.clone() for n, p in step.raw_student.named_parameters() if p.grad is not None}
        torch.save({"stats": step.read(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_koleo_over_two_gloo_processes_is_per_process_as_in_dinov2(tmp_path):
    """DINOv2 (and lightly) take KoLeo's nearest neighbours among each process's own images,
    not the global batch: two processes on a batch give the DINO part of one process on it,
    plus the mean of their two KoLeo terms, each over its half (DDP averages the gradients).
    Checked on the gradients every rank applies and on the logged loss and KoLeo."""
    from lightly.loss import KoLeoLoss

    import kit
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    mp.spawn(_koleo_step_on_rank, args=(str(tmp_path),), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    cfg = load_config("dino", "resmlp_s12", KOLEO)
    plan = crop_plan(cfg)
    crops = kit.synthetic_crops(plan, 8, torch.device("cpu"), seed=0)
    torch.manual_seed(0)
    one = build_dino_step(cfg, plan, torch.device("cpu"))
    koleo = KoLeoLoss()

    def per_process(features):  # rows view by view; each process holds one half of each view
        return sum(torch.stack([koleo(half) for half in view.chunk(2)]).mean() for view in features.float().chunk(2))

    one.loss_fn.koleo = per_process
    one(crops, VALUES, 1)
    want = one.read()
    for got in ranks:
        assert got["stats"]["koleo"] == pytest.approx(want["koleo"], rel=1e-5)
        assert got["stats"]["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grads"].keys() == {n for n, p in one.raw_student.named_parameters() if p.grad is not None}
        for name, p in one.raw_student.named_parameters():
            if p.grad is not None:
                assert torch.allclose(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6), name
    # and that is not KoLeo over the whole batch: the test tells the two apart
    with torch.no_grad():
        whole = sum(koleo(view) for view in one.raw_student.backbone(torch.cat(crops[:2])).chunk(2))
    assert abs(whole.item() - want["koleo"]) > 1e-2


@pytest.mark.parametrize("override,says", [("dino.centering=median", "dino.centering"),
                                           ("dino.koleo_weight=-0.1", "dino.koleo_weight")])
def test_bad_centering_or_koleo_weight_is_one_line_exit_2(tmp_path, capsys, override, says):
    assert cli.main(["dino", "resmlp_s12", *TINY, "data=fashion_mnist", "data.subset=16", "epochs=1",
                     f"out={tmp_path / 'run'}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "run").exists()  # refused before the run dir was made
