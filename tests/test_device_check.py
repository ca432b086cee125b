"""The device is checked before work (issue 49 part 3), on the CPU with a faked GPU: a GPU
the installed torch has no kernels for is refused in one line, exit 2, before any file is
made; precision=auto is bf16 where the GPU has it (sm 8.0 on), else fp16 with GradScaler and
the step not graphed, said in the path lines; the run's first lines name the device, its
memory and the precision. The last test runs on a real GPU only (the campaign's)."""
import re
import types
import warnings

import pytest
import torch

from resmlp.core import device as gpu
from resmlp.core import dist
from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.core.run import Run
from resmlp.ssl.step import dino_path

GiB = 2**30
# the pinned wheel's list (torch 2.14.1+cu130, x86_64): sm 7.5 to 12.0, no PTX
ARCH = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
V100 = ("Tesla V100-SXM2-16GB", (7, 0), 16)
T4 = ("Tesla T4", (7, 5), 16)
A10 = ("NVIDIA A10", (8, 6), 24)
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0), 80)
H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 80)


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu((name, (major, minor), GiB), arch=ARCH): one GPU as torch.cuda reports it,
    half a GiB of it in use; nothing on it can run (no kernel is launched before the checks)."""
    def install(card, arch=ARCH):
        name, cap, total = card
        c = torch.cuda
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(c, "is_available", lambda: True)
        monkeypatch.setattr(c, "device_count", lambda: 1)
        monkeypatch.setattr(c, "set_device", lambda index: None)
        monkeypatch.setattr(c, "get_arch_list", lambda: list(arch))
        monkeypatch.setattr(c, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(c, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(c, "get_device_properties", lambda device=None: types.SimpleNamespace(
            name=name, major=cap[0], minor=cap[1], total_memory=total * GiB))
        monkeypatch.setattr(c, "mem_get_info", lambda device=None: (total * GiB - GiB // 2, total * GiB))
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # Run sets it
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    return install


def first_lines(tmp_path, *overrides) -> tuple[Run, list[str]]:
    """The DINO run's device and precision, and the first lines it prints (ssl/train.py)."""
    cfg = load_config("dino", "resmlp_s12", [f"out={tmp_path / 'run'}", *overrides])
    run = Run(cfg)
    return run, run.start_lines(dino_path(cfg, run.device, run.scaler.is_enabled()))


# ---- a GPU the build cannot run: one line, before any work ----------------------------------
def test_a_gpu_the_torch_build_lacks_is_refused_in_one_line_before_any_file(tmp_path, fake_gpu, capsys):
    fake_gpu(V100)
    code = main(["dino", "resmlp_s12", f"out={tmp_path / 'run'}"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    line = err[0]
    assert "Tesla V100-SXM2-16GB is sm_70 (compute capability 7.0)" in line
    assert "built for sm_75, sm_80, sm_86, sm_90, sm_100, sm_120 only" in line
    assert "install a torch build for sm_70" in line and "device=cpu" in line
    if getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", None):  # torch's table of its releases names the wheel
        assert re.search(r"pip install torch==[\d.]+ .*--index-url https://download.pytorch.org/whl/cu126", line)
    assert "device:" not in captured.out and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("entry, cap, runs", [
    ("sm_80", (8, 6), True), ("sm_86", (8, 9), True), ("sm_80", (9, 0), False), ("sm_75", (7, 0), False),
    ("sm_90a", (9, 0), True), ("sm_90a", (9, 1), False), ("sm_100", (10, 3), True), ("sm_120", (12, 1), True),
    ("compute_70", (9, 0), True), ("compute_80", (7, 5), False), ("compute_90a", (10, 0), False),
    ("gfx90a", (9, 0), False)])
def test_which_entry_of_the_arch_list_runs_on_which_gpu(entry, cap, runs):
    """Machine code within its major version from its minor up; PTX on its capability or later."""
    assert gpu.runs_on(entry, cap) is runs


def test_ptx_a_build_carries_runs_on_later_gpus_and_a_build_without_a_list_is_not_judged(fake_gpu):
    fake_gpu(V100, arch=["sm_75", "compute_70"])   # PTX for 7.0: the driver compiles it there
    assert gpu.arch_problem(0) is None
    fake_gpu(H100, arch=["sm_80", "compute_80"])   # 9.0 from 8.0's PTX
    assert gpu.arch_problem(0) is None
    fake_gpu(H100, arch=["sm_80", "sm_86"])
    assert "sm_90" in gpu.arch_problem(0)
    fake_gpu(V100, arch=[])                        # a build that does not say: torch's own errors stand
    assert gpu.arch_problem(0) is None


def test_torchs_own_warning_of_several_lines_gives_way_to_the_one_line(monkeypatch):
    said = "\nTesla K80 with CUDA capability sm_37 is not compatible with the current PyTorch installation.\n..."

    def capability(device=None):
        warnings.warn(said, UserWarning)
        warnings.warn("something else", UserWarning)
        return (3, 7)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert gpu.capability(0) == (3, 7)
    assert [str(w.message) for w in seen] == ["something else"]


# ---- precision=auto, and the first lines ------------------------------------------------------
def test_auto_on_a_gpu_before_sm_80_is_fp16_with_gradscaler_and_not_graphed(tmp_path, fake_gpu):
    fake_gpu(T4)
    run, lines = first_lines(tmp_path)
    assert run.amp_dtype == torch.float16 and run.use_scaler and run.scaler.is_enabled()
    assert lines[0] == ("device: Tesla T4 (sm 7.5, 16.0 GiB, 15.5 GiB free); precision fp16 with GradScaler "
                        "(auto: bf16 needs sm 8.0 or later)")
    assert lines[1] == "path: networks compiled whole, not graphed"
    assert lines[2].startswith("graphs off: fp16 needs GradScaler") and len(lines) == 3
    assert not list(tmp_path.iterdir())   # Run made nothing yet: restore() opens the run dir


@pytest.mark.parametrize("card, memory", [(A10, "24.0 GiB, 23.5 GiB free"), (A100, "80.0 GiB, 79.5 GiB free"),
                                          (H100, "80.0 GiB, 79.5 GiB free")])
def test_auto_on_sm_80_and_later_is_bf16_graphed(tmp_path, fake_gpu, card, memory):
    fake_gpu(card)
    run, lines = first_lines(tmp_path)
    name, (major, minor), _ = card
    assert run.amp_dtype == torch.bfloat16 and not run.use_scaler
    assert lines == [f"device: {name} (sm {major}.{minor}, {memory}); precision bf16 (auto: this GPU has bf16)",
                     "path: blocks compiled by region, the step as one CUDA graph"]
    assert dist.amp_dtype("auto", run.device) == torch.bfloat16   # the evaluators' precision: the same decision


def test_precision_asked_for_is_kept_and_bf16_without_the_hardware_is_warned(tmp_path, fake_gpu):
    fake_gpu(T4)
    run, lines = first_lines(tmp_path, "precision=bf16")
    assert run.amp_dtype == torch.bfloat16 and not run.use_scaler
    assert lines[0].endswith("; precision bf16")
    assert lines[1] == ("warning: precision=bf16 on a GPU before sm 8.0 runs emulated, slowly; precision=auto takes "
                        "fp16 with GradScaler there")
    run, lines = first_lines(tmp_path, "precision=fp32")
    assert run.amp_dtype is None and lines[0].endswith("; precision fp32")
    assert dist.amp_dtype("auto", torch.device("cuda", 0)) == torch.float16   # the evaluators' precision


def test_the_cpu_names_its_cores_and_fp32(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "cpu_cores", lambda: 2)
    run, lines = first_lines(tmp_path, "demo=false", "num_workers=0")
    assert lines[:2] == ["device: cpu (2 cores); precision fp32 (auto: no autocast on the CPU)",
                         "path: eager, not graphed"]


# ---- on a real GPU (the campaign's tests stage) ---------------------------------------------
@pytest.mark.cuda
def test_this_gpu_passes_the_check_and_auto_follows_its_capability(tmp_path):
    assert gpu.arch_problem(0) is None
    device = dist.pick_device("auto")
    major, minor = torch.cuda.get_device_capability(device)
    want = torch.bfloat16 if (major, minor) >= (8, 0) else torch.float16
    assert dist.amp_dtype("auto", device) == want
    (line,) = [x for x in first_lines(tmp_path)[1] if x.startswith("device:")]
    assert re.fullmatch(rf"device: {re.escape(torch.cuda.get_device_name(device))} \(sm {major}\.{minor}, "
                        rf"[\d.]+ GiB, [\d.]+ GiB free\); precision {dist.PRECISIONS[want]}.*", line)
