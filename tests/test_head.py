"""The DINO head's prototype layer in TF32 or bf16 (dino.head_precision, ssl/head.py), DINO's
loss as lightly's (ssl/loss.py), and compile=true's head and loss: equal to the eager ones,
in the step and in the graphed step's arithmetic."""
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.ssl.head import build_head, head_forward, prototype_mm
from resmlp.ssl.loss import DinoLoss
from resmlp.ssl.step import StepValues

import kit


# ---- the precisions against fp32 and against DINO as published ---------------------------

def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to TF32 (fp32's range, a 10-bit mantissa: the 13 lower bits dropped,
    to nearest), as CUDA's TF32 matmuls take their fp32 operands."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def to(dtype):
    return lambda x: x.to(dtype).float()


def same(x):
    return x


class RoundedMM(torch.autograd.Function):
    """a @ b written out plainly with its operands rounded by `operands` and its results and
    incoming gradients by `results`, forward and backward: what a matmul in that precision
    computes (the products of the rounded operands summed in fp32)."""

    @staticmethod
    def forward(ctx, a, b, operands, results):
        ctx.save_for_backward(a, b)
        ctx.rounding = operands, results
        return results(operands(a) @ operands(b))

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        operands, results = ctx.rounding
        grad = results(grad)
        return results(operands(grad) @ operands(b).t()), results(operands(a).t() @ operands(grad)), None, None


# fp16 autocast, as DINO's main_dino.py runs the prototype layer: fp16 operands, fp16 logits
# and gradients
PUBLISHED = (to(torch.float16), to(torch.float16))


def prototype_case(seed: int, align: float, k: int = 4096, b: int = 32, d: int = 256, views: int = 10):
    """Bottleneck outputs (unit rows) of `views` views of b images and k unit prototypes; with
    align > 0 each image has 4 prototypes at that share of its own direction, so that the
    teacher's targets at T = 0.04 are sharp, as after training."""
    g = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(b, d, generator=g), dim=1)
    w = F.normalize(torch.randn(k, d, generator=g), dim=1)
    own = torch.randint(0, k, (b, 4), generator=g)
    for i in range(b):
        w[own[i]] = F.normalize(align * images[i] + (1 - align) * F.normalize(torch.randn(4, d, generator=g), dim=1),
                                dim=1)
    views = [F.normalize(images + 0.3 * torch.randn(b, d, generator=g) / d**0.5, dim=1) for _ in range(views)]
    return views, w


def departure(logits_of, cases) -> list[tuple[float, float, float]]:
    """For each case, how far the DINO loss (mean centering, T_t 0.04, T_s 0.1) and its
    gradients for the prototypes and the bottleneck outputs are from the fp32 layer's:
    relative differences of the loss and of the gradients' norms."""
    out = []
    cfg = OmegaConf.create({"out_dim": 4096, "student_temp": 0.1, "center_momentum": 0.9, "centering": "mean"})
    for views, w in cases:
        got = []
        for fn in (lambda z, W: z @ W.t(), logits_of):
            W = w.clone().requires_grad_(True)
            Z = [z.clone().requires_grad_(True) for z in views]
            logits = [fn(z, W) for z in Z]
            loss_fn = DinoLoss(cfg)
            teacher = torch.cat(logits[:2]).detach()
            loss_fn.center.copy_(teacher.mean(0).view_as(loss_fn.center))
            loss = loss_fn(list(teacher.chunk(2)), logits, 0.04)
            gw, *gz = torch.autograd.grad(loss, [W, *Z])
            got.append((loss.detach(), gw, torch.cat(gz)))
        (l0, gw0, gz0), (l1, gw1, gz1) = got
        out.append((float((l1 - l0).abs() / l0), float((gw1 - gw0).norm() / gw0.norm()),
                    float((gz1 - gz0).norm() / gz0.norm())))
    return out


CASES = [(seed, align) for align in (0.0, 0.8, 0.95) for seed in range(2)]


def test_tf32_and_bf16_prototypes_against_fp32_and_dino_as_published():
    """The prototype layer's departure from fp32 (the default), in the DINO loss and its
    gradients, at random prototypes (the start) and at sharp targets (trained): with TF32
    operands (emulated: a CPU has no TF32) no larger than DINO's own fp16 autocast's in the
    gradients of every case and in the loss at the most; with bf16 operands (the op itself,
    ssl/head.py's prototype_mm) within 5x of it in the gradients and 1e-4 of the loss, and a
    bf16 layer that rounds its logits to bf16 (what autocast would do) well outside that."""
    cases = [prototype_case(seed, align) for seed, align in CASES]
    published = departure(lambda z, W: RoundedMM.apply(z, W.t(), *PUBLISHED), cases)
    emulated = departure(lambda z, W: RoundedMM.apply(z, W.t(), tf32, same), cases)
    bf16 = departure(lambda z, W: prototype_mm(z, W.t(), "bf16"), cases)
    bf16_logits = departure(lambda z, W: RoundedMM.apply(z, W.t(), to(torch.bfloat16), to(torch.bfloat16)), cases)
    assert all(p[2] > 0 for p in published)        # DINO's own departure is there to compare with
    for (case, pub, t, b, bl) in zip(CASES, published, emulated, bf16, bf16_logits):
        assert t[1] <= pub[1] and t[2] <= pub[2], (case, t, pub)
        assert b[1] <= 5 * pub[1] and b[2] <= 5 * pub[2] and b[0] <= 1e-4, (case, b, pub)
        assert bl[1] > 5 * pub[1] or bl[2] > 5 * pub[2] or bl[0] > 1e-4, (case, bl, pub)
    assert max(t[0] for t in emulated) <= max(p[0] for p in published)


def plain_head(head, x, operands):
    """lightly's DINO head written out: its MLP, the L2 normalization, the weight-normed
    prototypes g v / |v| (per row), the last matmul with its operands rounded."""
    z = F.normalize(head.layers(x), dim=-1)
    v, g = head.last_layer.weight_v, head.last_layer.weight_g
    w = g * v / v.norm(dim=1, keepdim=True)
    return RoundedMM.apply(z, w.t(), operands, same)


@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_the_heads_precisions_compute_the_plain_head(norm_last_layer):
    """head_forward in each precision on a CPU: fp32 and tf32 (no TF32 on a CPU: fp32) the
    plain head, bf16 the plain head with bf16 operands; their gradients for every head
    parameter (g included where it learns) the plain ones; torch's matmul precision
    untouched."""
    torch.manual_seed(0)
    cfg = OmegaConf.create({"hidden_dim": 32, "bottleneck_dim": 16, "out_dim": 64, "freeze_last_layer": 1,
                            "norm_last_layer": norm_last_layer, "bottleneck_norm": "none"})
    head = build_head(24, cfg)
    with torch.no_grad():
        head.last_layer.weight_g.mul_(torch.rand_like(head.last_layer.weight_g) + 0.5)
    x = torch.randn(12, 24)
    params = [p for p in head.parameters() if p.requires_grad]
    assert any(p is head.last_layer.weight_g for p in params) == (not norm_last_layer)
    # bf16: a last-bit difference of the plain weights (their own arithmetic) may round an
    # operand to the next bf16 value, so its gradients agree to bf16's rounding, not fp32's
    for precision, operands, tol in (("fp32", same, 1e-5), ("tf32", same, 1e-5), ("bf16", to(torch.bfloat16), 1e-2)):
        got = head_forward(head, x, precision)
        want = plain_head(head, x, operands)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
            assert (a - b).norm() <= tol * b.norm(), (precision, float((a - b).norm() / b.norm()))
        assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.equal(head_forward(head, x, "bf16"), head_forward(head, x, "fp32"))


def test_head_precision_is_a_config_key_with_its_words(tmp_path):
    cfg = load_config("dino", "resmlp_s12", ["demo=false", f"out={tmp_path}"])
    assert cfg.dino.head_precision == "fp32"   # DINO's fp32 default until a GPU line shows another faster
    assert load_config("dino", "resmlp_s12", ["dino.head_precision=bf16"]).dino.head_precision == "bf16"
    with pytest.raises(UserError, match="dino.head_precision=fp16 is not allowed: dino.head_precision must be "
                                        "one of fp32, tf32, bf16"):
        load_config("dino", "resmlp_s12", ["dino.head_precision=fp16"])
    step_cfg, plan = tiny()
    step_cfg.dino.head_precision = "fp8"        # a config built in code
    with pytest.raises(UserError, match="dino.head_precision"):
        kit.dino_step(step_cfg, torch.device("cpu"), "fp32", compile=False)


@pytest.mark.cuda
def test_tf32_and_bf16_prototypes_on_the_gpu():
    """On the GPU, TF32 and bf16 prototype layers through head_forward's op (cuBLAS) and DINO's
    own fp16 autocast: TF32 departs from fp32 no more than fp16 autocast in every gradient
    and it is TF32 (it departs at all); bf16 within 5x; torch's matmul precision put back."""
    cases = [([z.cuda() for z in views], w.cuda()) for views, w in (prototype_case(seed, a) for seed, a in CASES)]

    def autocast_fp16(z, W):
        with torch.autocast("cuda", dtype=torch.float16):
            return F.linear(z, W).float()
    published = departure(autocast_fp16, cases)
    tf = departure(lambda z, W: prototype_mm(z, W.t(), "tf32"), cases)
    bf = departure(lambda z, W: prototype_mm(z, W.t(), "bf16"), cases)
    assert torch.get_float32_matmul_precision() == "highest"
    for case, pub, t, b in zip(CASES, published, tf, bf):
        assert 0 < t[1] <= pub[1] and t[2] <= pub[2], (case, t, pub)
        assert b[1] <= 5 * pub[1] and b[2] <= 5 * pub[2] and b[0] <= 1e-4, (case, b, pub)


# ---- the loss -------------------------------------------------------------------------------

def test_the_mean_centered_loss_is_lightlys():
    """DinoLoss with the mean centering (its cross-entropy and lightly's center update):
    lightly's DINOLoss.forward's loss and center, with targets computed inside or passed."""
    from lightly.loss import DINOLoss
    from test_dino import plain_dino_loss
    torch.manual_seed(0)
    K, B = 50, 6
    cfg = OmegaConf.create({"out_dim": K, "student_temp": 0.1, "center_momentum": 0.9, "centering": "mean"})
    teacher = [torch.randn(B, K) for _ in range(2)]
    student = [torch.randn(B, K) for _ in range(5)]
    start = torch.randn(1, 1, K)
    lightly = DINOLoss(K, warmup_teacher_temp_epochs=0)
    lightly.center.copy_(start)
    want = lightly(teacher, student, teacher_temp=0.05)
    plain, plain_center = plain_dino_loss(teacher, student, start.reshape(1, K), 0.05)
    torch.testing.assert_close(want, plain, rtol=1e-5, atol=1e-6)
    for passed in (False, True):
        ours = DinoLoss(cfg)
        ours.center.copy_(start)
        targets = ours.targets(torch.cat(teacher), 0.05) if passed else None
        got = ours(teacher, student, 0.05, targets=targets)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.center, lightly.center, rtol=0, atol=1e-7)
        torch.testing.assert_close(ours.center.reshape(1, K), plain_center, rtol=0, atol=1e-6)


# ---- compiled head and loss -------------------------------------------------------------------

TINY = ["demo=false", "model.dim=16", "model.depth=2", "batch_size=8", "dino.out_dim=64", "dino.hidden_dim=32",
        "dino.bottleneck_dim=16", "dino.n_local_crops=2", "model.drop_path_rate=0.0", "data=imagefolder",
        "data.img_size=32", "model.patch_size=8", "data.local_size=16", "dino.freeze_last_layer=0"]
SCHEDULE = [StepValues(1e-3, 0.04, 0.99, 0.04), StepValues(2e-3, 0.05, 0.992, 0.05),
            StepValues(3e-3, 0.06, 0.994, 0.06)]


def tiny(*extra):
    from resmlp.data.crop_plan import crop_plan
    cfg = load_config("dino", "resmlp_s12", [*TINY, *extra])
    return cfg, crop_plan(cfg)


def twins(compile_second: bool, *extra, graphed=False):
    """Two steps of the same weights: eager, and compiled (or not) and graphed (or not)."""
    from resmlp.ssl.graphed_step import GraphedStep
    cfg, plan = tiny(*extra)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    a = kit.dino_step(cfg, cpu, "fp32", compile=False)
    b = kit.dino_step(cfg, cpu, "fp32", compile=compile_second)
    b.student.load_state_dict(a.student.state_dict())
    b.teacher.load_state_dict(a.teacher.state_dict())
    if graphed:
        b.graphed = GraphedStep(b, capture=False)
    return a, b, plan


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("dino.head_precision=bf16",), ("dino.centering=sinkhorn",)])
def test_the_compiled_head_and_loss_equal_the_eager_ones(extra):
    """compile=true compiles the heads and the loss's functions besides the blocks, each a
    region of its own with no graph break: three DINO steps with every schedule moving give
    the eager steps' losses, gradients, center and weights (aot_eager: the autograd split
    as Inductor gets it, without its code generation)."""
    from torch._dynamo.utils import counters

    from resmlp.ssl.head import head_forward as eager_head
    torch._dynamo.reset()
    counters.clear()
    with torch.compiler.set_stance("default", force_backend="aot_eager"):
        eager, compiled, plan = twins(True, *extra)
        assert compiled.raw_student.head_forward is not eager_head and compiled.loss_fn.cross_entropy is not \
            eager.loss_fn.cross_entropy
        for i, values in enumerate(SCHEDULE):
            crops = kit.synthetic_crops(plan, 8, torch.device("cpu"), seed=i)
            a = eager([c.clone() for c in crops], values, 1)
            b = compiled([c.clone() for c in crops], values, 1)
            torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(eager.raw_student.named_parameters(), compiled.raw_student.parameters()):
                if p.grad is not None:
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(compiled.loss_fn.center, eager.loss_fn.center, rtol=1e-5, atol=1e-7)
        for p, q in zip(eager.raw_student.parameters(), compiled.raw_student.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # blocks: student's two crop sizes and teacher; head: student, teacher; the loss's functions
    mean = "dino.centering=sinkhorn" not in extra
    assert counters["stats"]["unique_graphs"] == 3 + 2 + 1 + mean
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_graphed_steps_arithmetic_with_compiled_head_and_loss_equals_eager_steps():
    """GraphedStep's body (uncaptured on a CPU) with compile=true: the eager step's losses
    and center, step after step; the center stays in the one buffer a capture would read."""
    torch._dynamo.reset()
    with torch.compiler.set_stance("default", force_backend="aot_eager"):
        eager, graphed, plan = twins(True, graphed=True)
        buffer = graphed.loss_fn.center.data_ptr()
        for i, values in enumerate(SCHEDULE):
            crops = kit.synthetic_crops(plan, 8, torch.device("cpu"), seed=i)
            a = eager([c.clone() for c in crops], values, 1)
            b = graphed([c.clone() for c in crops], values, 1)
            torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b[2], a[2], rtol=1e-5, atol=1e-7)        # the center each step used
        assert graphed.loss_fn.center.data_ptr() == buffer
        torch.testing.assert_close(graphed.loss_fn.center, eager.loss_fn.center, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()


def test_head_cost_times_each_precision_side_by_side(tmp_path, capsys):
    """tools/bench/head_cost.py's plumbing on a CPU (eager: compiling costs minutes here): a line per
    precision from the same weights and drop-path draws (tf32 is fp32 on a CPU: the same first
    loss; bf16 another), and its one-line refusal of a precision the key does not take."""
    import json

    from bench import head_cost
    tiny = ["model.dim=16", "model.depth=2", "batch_size=2", "dino.out_dim=64", "dino.hidden_dim=32",
            "dino.bottleneck_dim=16", "device=cpu"]
    out = tmp_path / "head.json"
    assert head_cost.main([*tiny, "--mode", "eager", "--steps", "1", "--repeats", "2", "--json", str(out)]) == 0
    fp32, tf32, bf16 = json.loads(out.read_text())
    assert [r["head_precision"] for r in (fp32, tf32, bf16)] == ["fp32", "tf32", "bf16"]
    assert fp32["vs_fp32"] == 1 and all(r["images_per_s"] > 0 and len(r["repeats"]) == 2 for r in (fp32, tf32, bf16))
    assert tf32["first_loss"] == fp32["first_loss"] != bf16["first_loss"]
    assert "bf16" in capsys.readouterr().out
    assert head_cost.main(["--precisions", "fp32,fp16"]) == 2
    assert capsys.readouterr().err.strip() == "head_cost: --precisions fp16 is not one of fp32, tf32, bf16"
