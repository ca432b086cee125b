"""When the fast path fails (ssl/fallback.py), injected on the CPU: compile=auto and
dino.cuda_graphs=auto fall back to the next path from the same state, in one `path:` line;
compile=true and dino.cuda_graphs=true stop in one line, exit 2, the checkpoint as it was.

How a CPU takes the GPU's paths here: `core.compiling.measured_here` (where compile=auto
compiles) and `ssl.graphed_step.capturable` (where a step is captured) are replaced, not a user
key; a compiler that fails is torch._inductor.compile_fx.compile_fx raising (Dynamo wraps it
as on a GPU, and nothing is compiled for real); a capture is torch.cuda's graph, streams and
memory counters faked (`FakeCuda`): the faked capture runs the whole update before it fails,
as no real capture does, so that a fallback that did not put the state back would apply the
update twice. The torchrun faults (different layouts, different seeds, a rank that fails)
are in tests/test_ddp_graphs.py.

What "the same weights" means: the trainer on the CPU is deterministic, so an eager run
against an eager run from the same seed is bitwise equal, and so must a run that fell back
be against the run it fell back to: a compile fallback (at the first call) against the eager
run, a failed capture against a fallback that never tried the capture (the graph's memory
would not fit), both having run the graph's body uncaptured for the warm-up."""
import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from resmlp.core import compiling
from resmlp.core.cli import main
from resmlp.core.errors import UserError
from resmlp.ssl import fallback, graphed_step

from test_dino import TINY, needs_fmnist

GIB = 2 ** 30
EAGER = ["compile=false", "dino.cuda_graphs=false"]
CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.99 GiB"
INJECTED = "RuntimeError: injected: Inductor could not compile this graph"
# the first compilation of a run: the device augmentation's, at the first batch (data/gpu_augment.py)
AUGMENTATION = f"path: compiling the device augmentation failed: {INJECTED}; continuing with it eager"


def failing_compiler(*args, **kwargs):
    raise RuntimeError("injected: Inductor could not compile this graph\nits second line")


@pytest.fixture
def compiles_here(monkeypatch):
    """compile=auto compiles on this CPU as on a GPU, and Inductor fails whatever it is given."""
    import torch._inductor.compile_fx as compile_fx
    monkeypatch.setattr(compiling, "measured_here", lambda device: True)
    monkeypatch.setattr(compile_fx, "compile_fx", failing_compiler)
    yield
    torch._dynamo.reset()


class FakeCuda:
    """torch.cuda's streams, graph and memory counters for a CPU step that is 'captured'.
    `capture`: "error" (capture_end fails), "oom" (an out of memory inside the capture, then
    capture_end's own error raised from it); the body runs before either. `usable`: whether
    a synchronize works after it. `peak`, `held`, `free` (GiB): the memory counters."""

    def __init__(self, monkeypatch, capture="error", usable=True, peak=3.0, held=1.0, free=10.0):
        self.capture, self.usable, self.captures = capture, usable, 0
        self.peak, self.held, self.free = peak * GIB, held * GIB, free * GIB
        cuda = torch.cuda
        stream = SimpleNamespace(wait_stream=lambda other: None)
        fake = {"Stream": lambda device=None: stream, "current_stream": lambda device=None: stream,
                "stream": lambda s: _nothing(), "set_stream": lambda s: None,
                "CUDAGraph": lambda: SimpleNamespace(replay=lambda: None), "graph": self.graph,
                "synchronize": self.synchronize, "is_initialized": lambda: True, "empty_cache": lambda: None,
                "max_memory_allocated": lambda device=None: self.peak,
                "memory_allocated": lambda device=None: self.held, "memory_reserved": lambda device=None: self.held,
                "mem_get_info": lambda device=None: (self.free, 16 * GIB)}
        for name, value in fake.items():
            monkeypatch.setattr(cuda, name, value)
        monkeypatch.setattr(graphed_step, "capturable", lambda device: True)

    @contextmanager
    def graph(self, graph, capture_error_mode="global"):
        self.captures += 1
        yield
        if self.capture == "oom":
            try:
                raise torch.OutOfMemoryError(OOM)
            except torch.OutOfMemoryError:   # as capture_end fails after it, its error raised from the OOM
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None
        raise RuntimeError(CAPTURE_ERROR + "\nCUDA kernel errors might be asynchronously reported")

    def synchronize(self, device=None):
        if not self.usable:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@contextmanager
def _nothing():
    yield


def train(tmp_path, name, *extra, capsys=None, argv_extra=()):
    """The trainer through the CLI, as a user runs it: (exit code, stdout, stderr, run dir)."""
    out = tmp_path / name
    code = main(["dino", "resmlp_s12", *TINY, "data.subset=96", f"out={out}", *extra])
    said = capsys.readouterr() if capsys else None
    return code, said.out if said else "", said.err if said else "", out


def weights(run_dir) -> dict:
    ckpt = torch.load(run_dir / "checkpoint.pth", weights_only=False)
    return {f"{k}.{n}": v for k in ("student", "teacher") for n, v in ckpt[k].items()} | \
        {"center": ckpt["center"], **{f"optimizer.{i}.{k}": v for i, s in ckpt["optimizer"]["state"].items()
                                      for k, v in s.items()}}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def path_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("path:")]


# ---- the pieces --------------------------------------------------------------------------------
def test_what_a_fallback_answers_and_its_first_line(compiles_here):
    """A compiler's error (Dynamo's BackendCompilerFailed around Inductor's) is a compile
    failure named by the backend's own first line; in a capture any error is the graph's, an
    out of memory there too (also found under capture_end's error raised from it); an out of
    memory elsewhere, a user error or a bug of the step are left as they are."""
    net = torch.nn.Linear(3, 2)
    net.compile(dynamic=False)
    with pytest.raises(Exception) as caught:
        net(torch.randn(2, 3))
    compiled = fallback.classify(caught.value, capturing=False)
    assert compiled == fallback.Failure("compile", "compiling the step failed", INJECTED)
    try:
        try:
            raise torch.OutOfMemoryError(OOM)
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as e:
        chained = e
    assert fallback.classify(chained, capturing=True) == fallback.Failure(
        "graph", "the CUDA graph's capture ran out of memory", OOM, oom=True)
    assert fallback.classify(chained, capturing=False) is None   # the OOM line's, core/run.py
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert fallback.classify(bug, capturing=False) is None
    assert fallback.classify(bug, capturing=True).text == "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    assert fallback.classify(UserError("no images"), capturing=True) is None


def test_the_graph_is_tried_only_where_its_pool_fits(monkeypatch):
    """capture_room: the uncaptured steps' need above what the run holds, against the free
    memory and the cache the capture empties, with room to spare."""
    fake = FakeCuda(monkeypatch, peak=9.0, held=5.0, free=6.0)
    assert graphed_step.capture_room(torch.device("cuda", 0)) is None
    fake.free = 4.5 * GIB
    assert graphed_step.capture_room(torch.device("cuda", 0)) == (
        "the uncaptured steps peaked at 9.0 GiB, 4.0 GiB above what the run holds between steps, and the device "
        "has 4.5 GiB left for the graph's own pool")


def test_the_out_of_memory_line_names_every_way_out_with_the_peak(tmp_path, monkeypatch):
    """In any phase, also a failed capture's CUDA error raised from the OOM: batch_size, the
    graph's own pool, grad checkpointing, and the peak the run reached."""
    from resmlp.core.config import load_config
    from resmlp.core.run import command
    FakeCuda(monkeypatch, peak=15.2)
    cfg = load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path}"])

    def capture_end(cfg):
        try:
            raise torch.OutOfMemoryError(OOM)
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    with pytest.raises(UserError) as caught:
        command(capture_end)(cfg)
    line = str(caught.value)
    assert line.startswith("CUDA out of memory with 32 images per GPU (batch_size=32 over 1 process; peak 15.2 GiB "
                           "allocated of the GPU's 16.0 GiB): lower batch_size, set dino.cuda_graphs=false"), line
    assert "model.grad_checkpointing=true" in line and "\n" not in line


# ---- compile ---------------------------------------------------------------------------------
@needs_fmnist
def test_a_compile_error_under_auto_falls_back_to_eager_from_the_same_state(tmp_path, compiles_here, capsys,
                                                                             short_knn):
    """compile=auto compiles (whole networks: the ungraphed form; and the device augmentation),
    Inductor fails at the first call of each: one line each, the run goes on eager, its
    weights bitwise those of an eager run, the step's fallback in results.json's path and in
    log.jsonl; exit 0."""
    code, out, err, fell = train(tmp_path, "auto", *short_knn, capsys=capsys)
    assert code == 0, err
    line = f"path: compiling the step failed: {INJECTED}; continuing eager, not graphed"
    assert path_lines(out) == ["path: networks compiled whole, not graphed", AUGMENTATION, line]
    results = json.loads((fell / "results.json").read_text())
    assert results["path"] == {"compile": False, "cuda_graphs": False, "fell_back": [line]}
    records = [json.loads(r) for r in (fell / "log.jsonl").read_text().splitlines()]
    assert {"iteration": 1, "path": results["path"]} in records
    code, _, _, eager = train(tmp_path, "eager", *short_knn, *EAGER, capsys=capsys)
    assert code == 0
    assert_same(weights(fell), weights(eager))


@needs_fmnist
def test_compile_asked_for_stops_in_one_line_and_the_checkpoint_stays(tmp_path, compiles_here, capsys, short_knn):
    """compile=true with a compiler that fails, resuming a run: exit 2, one line naming the
    failure and compile=false, the checkpoint and results on disk as they were."""
    code, _, _, run = train(tmp_path, "run", *short_knn, *EAGER, "epochs=1", capsys=capsys)
    assert code == 0
    before = {f: (run / f).read_bytes() for f in ("checkpoint.pth", "results.json")}
    code, out, err, _ = train(tmp_path, "run", *short_knn, "compile=true", "epochs=2", capsys=capsys)
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"error: compiling the device augmentation failed: {INJECTED} (compile=true asks for it); compile=false "
        f"trains eager, compile=auto falls back by itself; the last good checkpoint {run / 'checkpoint.pth'} is "
        "intact: the same command again resumes from it"]
    assert {f: (run / f).read_bytes() for f in before} == before
    # the augmentation in the loader's workers (not compiled): the step's own compilation stops it
    code, out, err, _ = train(tmp_path, "workers", *short_knn, "compile=true", "dino.augment=workers", capsys=capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: compiling the step failed: {INJECTED} (compile=true asks for it); compile=false trains eager, "
        "compile=auto falls back by itself; no checkpoint was written before it stopped: the same command again "
        "starts over"]


@needs_fmnist
def test_every_log_line_checks_the_gradients_still_view_the_flat_buffer(tmp_path, monkeypatch, capsys, short_knn):
    """The trainer calls the step's check (ssl.graphed_step.FlatGradients.check under torchrun) at
    each log line, and a check that fails stops the run in one line, exit 1."""
    from resmlp.core.errors import RunFailed
    from resmlp.ssl.step import DinoStep
    calls = []

    def check(self):
        calls.append(1)
        if len(calls) == 2:
            raise RunFailed("the gradient of head.last_layer.weight no longer views the flat buffer")
    monkeypatch.setattr(DinoStep, "check", check)
    code, out, err, run = train(tmp_path, "run", *short_knn, *EAGER, capsys=capsys)
    assert code == 1 and len(calls) == 2
    assert err.strip().splitlines() == ["error: the gradient of head.last_layer.weight no longer views the flat buffer"]
    assert sum('"loss"' in line for line in (run / "log.jsonl").read_text().splitlines()) == 1


# ---- the capture -------------------------------------------------------------------------------
@needs_fmnist
def test_a_failed_capture_under_auto_goes_on_without_the_graph_from_the_same_state(tmp_path, monkeypatch, capsys,
                                                                                  short_knn):
    """dino.cuda_graphs=auto on a 'GPU': three uncaptured steps, then a capture that runs the
    update and fails. One line, the run goes on ungraphed, exit 0; its weights are bitwise
    those of a run whose graph would not fit in memory (no capture tried: graphs off at the
    same iteration with one line), so the failed capture's update was undone."""
    fake = FakeCuda(monkeypatch)
    code, out, err, failed = train(tmp_path, "failed", *short_knn, "compile=false", capsys=capsys)
    assert code == 0, err
    line = f"path: the CUDA graph's capture failed: RuntimeError: {CAPTURE_ERROR}; continuing eager, not graphed"
    assert path_lines(out) == ["path: eager, the step as one CUDA graph", line] and fake.captures == 1
    assert json.loads((failed / "results.json").read_text())["path"]["fell_back"] == [line]
    taken = {"compile": False, "cuda_graphs": False, "fell_back": [line]}
    records = [json.loads(r) for r in (failed / "log.jsonl").read_text().splitlines()]
    assert {"iteration": graphed_step.WARMUP + 1, "path": taken} in records
    fake.peak, fake.free = 9.0 * GIB, 2.0 * GIB
    code, out, _, full = train(tmp_path, "full", *short_knn, "compile=false", capsys=capsys)
    assert code == 0 and fake.captures == 1
    assert path_lines(out)[1] == ("path: the CUDA graph would not fit in memory: the uncaptured steps peaked at 9.0 "
                                  "GiB, 8.0 GiB above what the run holds between steps, and the device has 2.0 GiB "
                                  "left for the graph's own pool; continuing eager, not graphed")
    assert_same(weights(failed), weights(full))


@needs_fmnist
def test_an_out_of_memory_in_the_capture_falls_back_under_auto_and_asked_for_is_the_oom_line(
        tmp_path, monkeypatch, capsys, short_knn):
    """The capture runs out of memory (capture_end's error raised from it): auto goes on
    without the graph; dino.cuda_graphs=true stops with the out-of-memory line (exit 2)."""
    FakeCuda(monkeypatch, capture="oom")
    code, out, err, _ = train(tmp_path, "auto", *short_knn, "compile=false", capsys=capsys)
    assert code == 0, err
    assert path_lines(out)[1] == f"path: the CUDA graph's capture ran out of memory: {OOM}; continuing eager, " \
                                 "not graphed"
    code, out, err, run = train(tmp_path, "asked", *short_knn, "compile=false", "dino.cuda_graphs=true", capsys=capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("error: CUDA out of memory with 32 images per GPU (batch_size=32 over 1 process; peak 3.0 "
                           "GiB allocated of the GPU's 16.0 GiB): lower batch_size, set dino.cuda_graphs=false"), line
    # the capture is the second epoch's first iteration: the first epoch's checkpoint stays the last
    assert "model.grad_checkpointing=true" in line and f"{run / 'checkpoint.pth'} is intact" in line
    assert torch.load(run / "checkpoint.pth", weights_only=False)["iteration"] == graphed_step.WARMUP


@needs_fmnist
def test_a_capture_asked_for_that_fails_stops_in_one_line(tmp_path, monkeypatch, capsys, short_knn):
    FakeCuda(monkeypatch)
    code, _, err, run = train(tmp_path, "asked", *short_knn, "compile=false", "dino.cuda_graphs=true", capsys=capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: the CUDA graph's capture failed: RuntimeError: {CAPTURE_ERROR} (dino.cuda_graphs=true asks for it); "
        "dino.cuda_graphs=false trains without the graph, dino.cuda_graphs=auto falls back by itself; the last good "
        f"checkpoint {run / 'checkpoint.pth'} is intact: the same command again resumes from it"]


@needs_fmnist
def test_a_capture_that_leaves_the_gpu_unusable_stops_with_the_command_that_continues(tmp_path, monkeypatch, capsys,
                                                                                      short_knn):
    """A failed capture after which the GPU fails every call: the run cannot even save its
    state. One line with the command that continues it without the graph (the user's own,
    dino.cuda_graphs=false in place of their value); exit 2."""
    import sys
    FakeCuda(monkeypatch, usable=False)
    out = tmp_path / "run"
    argv = ["dino", "resmlp_s12", *TINY, "data.subset=96", f"out={out}", *short_knn, "compile=false",
            "dino.cuda_graphs=auto"]
    monkeypatch.setattr(sys, "argv", ["cli.py", *argv])
    monkeypatch.setenv("NPROC_PER_NODE", "1")
    assert main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    kept = [a for a in argv if a != "dino.cuda_graphs=auto"]
    assert line == (f"error: path: the CUDA graph's capture failed: RuntimeError: {CAPTURE_ERROR}; it left the GPU "
                    "unusable to the process, so the run cannot go on or save its state: `NPROC_PER_NODE=1 bash "
                    f"run.sh {' '.join(kept)} dino.cuda_graphs=false` continues it (the last good checkpoint "
                    f"{out / 'checkpoint.pth'} is intact: the same command again resumes from it)")


@needs_fmnist
def test_both_fallbacks_in_one_run_compiled_graph_then_eager_graph_then_eager(tmp_path, compiles_here, monkeypatch,
                                                                              capsys, short_knn):
    """The default path of a GPU, blocks compiled by region and graphed, with a compiler and a
    capture that both fail: compile off first (the graph kept: its warm-up again), then the
    graph off; two lines, exit 0."""
    FakeCuda(monkeypatch)
    code, out, err, run = train(tmp_path, "run", *short_knn, "data.subset=128", capsys=capsys)
    assert code == 0, err
    assert path_lines(out) == [
        "path: blocks compiled by region, the step as one CUDA graph", AUGMENTATION,
        f"path: compiling the step failed: {INJECTED}; continuing eager, the step as one CUDA graph",
        f"path: the CUDA graph's capture failed: RuntimeError: {CAPTURE_ERROR}; continuing eager, not graphed"]
    path = json.loads((run / "results.json").read_text())["path"]
    assert path["compile"] is False and path["cuda_graphs"] is False and len(path["fell_back"]) == 2
