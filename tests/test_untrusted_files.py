"""A run folder or weights file from someone else is data, never code (issue 50): each file
below is built here as a crafted one would be, and each is one line, exit 2, before any
work, with nothing anywhere changed (the test's whole folder compared before and after).

- numpy through the loader's allowlist: an object array over a pointer the file chose
  (`np.ndarray((1,), np.dtype('O8'), b'AAAAAAAA')`, a segfault when freed), a None-filled
  object array of 10**8 elements from a few bytes, numbers laid over a buffer;
- a plain pickle whose payload torch would not name (its first refusal is a tensor's
  storage; protocol 4 it does not read at all);
- memory the file does not hold: bytearray(10**9), a zip bomb, a tensor whose stride 0
  repeats four bytes 3*10**8 times, a state dict naming block 9999, a config naming a
  depth its weights do not fill;
- a FIFO or a device as weights (a hang, a read without end);
- a saved config nested 100,000 deep, or holding `${oc.env:...}`;
- a symbolic link where a command writes: a training run's log.jsonl, config.yaml,
  results.json, tb/; knn's and linear's report and history.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from resmlp.core.checkpoint import FORMAT, TRUST_KEY, atomic_write, load_checkpoint, save_checkpoint
from resmlp.core.cli import main
from resmlp.core.config import load_config, save_config
from resmlp.core.errors import UserError
from resmlp.core.files import open_nofollow, refuse_link

from test_inputs import TINY_ARCH, one_line_error
from test_safe_load import DINO, LAB, SYSTEM, RunsCode, tiny_teacher_sd, tree, world  # noqa: F401

try:
    from numpy._core import multiarray   # numpy >= 2
except ImportError:  # pragma: no cover - numpy 1
    from numpy.core import multiarray


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """A command that would block (a FIFO opened) fails the test instead of hanging it."""
    def stop(*_):
        raise AssertionError(f"blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def refused(argv: list, world: dict, capsys, *says: str) -> str:
    """The command exits 2 with one line holding each of `says`; nothing under the test's
    folder (the files outside the folder the command was given among them) changed."""
    before = tree(world["tmp"])
    with no_hang():
        assert main([str(a) for a in argv]) == 2, argv
    line = one_line_error(capsys)
    assert all(s in line for s in says), line
    assert tree(world["tmp"]) == before
    return line


def knn(file, world) -> list:
    return ["knn", file, *LAB, f"data.root={world['lab']}"]


# ---- numpy: only numbers, from the file's own bytes ---------------------------------------------------

class Pointer:
    """Unpickled by numpy, an object array whose one element is the pointer 0x4141414141414141."""
    def __reduce__(self):
        return np.ndarray, ((1,), np.dtype("O8"), b"AAAAAAAA")


class NoneFilled:
    """Unpickled by numpy, an object array of 10**8 Nones (760 MiB) from a few bytes."""
    def __reduce__(self):
        return np.ndarray, ((10**8,), np.dtype("O8"))


class Reconstructed:
    """The same through numpy's own _reconstruct, which a numpy pickle calls."""
    def __reduce__(self):
        return multiarray._reconstruct, (np.ndarray, (10**8,), b"O")


class OverBytes:
    """Numbers, but laid over bytes the file chooses by calling ndarray itself."""
    def __reduce__(self):
        return np.ndarray, ((2,), np.dtype("f8"), b"A" * 16)


class ShortState:
    """An array pickled as numpy pickles one, its state one byte short of its shape."""
    def __reduce__(self):
        return multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), np.dtype("f8"), False, b"A" * 7)


NUMPY = {Pointer: "numpy.dtype('O8')", NoneFilled: "numpy.dtype('O8')",
         Reconstructed: "numpy's multiarray._reconstruct((100000000,), b'O')", OverBytes: "numpy.ndarray(...)",
         ShortState: "numpy.ndarray's state (shape (1,), 7 bytes"}


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("payload", NUMPY, ids=lambda c: c.__name__)
def test_numpy_values_are_numbers_from_the_files_own_bytes(payload, how, world, capsys):
    """Each is refused as not weights only, naming what it asks numpy for, before any of it
    is built: no pointer freed (the process would die), no 760 MiB filled."""
    path = world["tmp"] / "weights.pth"
    if how == "pickle":   # a plain pickle (protocol 2, which torch reads), not torch's format
        path.write_bytes(pickle.dumps({"x": payload()}, protocol=2))
    else:
        torch.save({"teacher": tiny_teacher_sd(), "x": payload()}, path)
    refused(knn(path, world), world, capsys, f"{path} is not a file of weights only: loading it would call "
            f"{NUMPY[payload]}", f"pass {TRUST_KEY}=true")


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_plain_pickle_is_refused_naming_its_payloads_global(protocol, world, capsys):
    """torch's own message names the first global it refuses (a tensor's storage, as a
    plain pickle saves it), and of protocol 4 none: the line names every one, the payload's
    among them, and the payload did not run."""
    path = world["tmp"] / "plain.pkl"
    path.write_bytes(pickle.dumps({"w": torch.zeros(2), "x": RunsCode(f"touch {world['marker']}")},
                                  protocol=protocol))
    line = refused(knn(path, world), world, capsys, "is not a file of weights only", SYSTEM)
    assert "torch.storage._load_from_bytes" in line and not world["marker"].exists()


# ---- memory the file does not hold ------------------------------------------------------------------

def rezip(path: Path, pickled: bytes, pad: int = 0) -> Path:
    """`path` (torch's zip format) with its pickle replaced by `pickled`, followed by `pad`
    zero bytes (which the unpickler never reaches), deflated (a few KB for many MiB)."""
    with zipfile.ZipFile(path) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    name = next(n for n in records if n.endswith("data.pkl"))
    with zipfile.ZipFile(path, "w") as z:
        for n, data in records.items():
            if n != name:
                z.writestr(n, data)
        with z.open(_deflated(name), "w", force_zip64=True) as f:
            f.write(pickled)
            for _ in range(pad >> 20):
                f.write(bytes(1 << 20))
    return path


def _deflated(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def test_a_zip_bomb_is_refused_before_it_is_inflated(world, capsys):
    """A file of about 100 KiB whose pickle record inflates to 96 MiB: the zip's own
    directory says so, and the line says how much from how little."""
    path = world["tmp"] / "bomb.pth"
    torch.save({"x": 1}, path)
    with zipfile.ZipFile(path) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    rezip(path, pickled, pad=96 << 20)
    assert path.stat().st_size < 1 << 20
    refused(knn(path, world), world, capsys, f"{path} is not a checkpoint: its zip records inflate to 96.0 MiB "
            "from a file of")


def test_a_pickle_or_tensors_asking_for_memory_the_file_does_not_hold_are_refused(world, capsys):
    """bytearray(10**9) from 30 bytes, and a tensor of 3*10**8 floats whose stride 0 repeats
    one (torch.save keeps the one)."""
    alloc = world["tmp"] / "alloc.pkl"
    alloc.write_bytes(b"\x80\x02cbuiltins\nbytearray\nJ\x00\xca\x9a\x3b\x85R.")
    refused(knn(alloc, world), world, capsys, f"{alloc} is not a checkpoint: its pickle asks for 953.7 MiB from a "
            "file of 30 bytes")
    stride = world["tmp"] / "stride.pth"
    torch.save({"teacher": {"backbone.w": torch.zeros(1).expand(300_000_000)}}, stride)
    refused(knn(stride, world), world, capsys, f"{stride} is not a checkpoint: its tensors span 1144.4 MiB")


def tiny_sd(**arch) -> dict:
    from resmlp.models import create_model
    torch.manual_seed(0)
    return create_model("resmlp_s12", **{**TINY_ARCH, **arch}, num_classes=0).state_dict()


def test_a_state_dict_claiming_a_model_it_does_not_fill_is_refused_before_it_is_built(world, capsys):
    """Block 9999 beside block 0 (a 10,000-deep model from a few KB); 64 blocks each holding
    one vector of a width-512 model (an 8 GiB model from 200 KB)."""
    sd = tiny_sd()
    far = {**sd, **{k.replace("blocks.1.", "blocks.9999."): v for k, v in sd.items() if k.startswith("blocks.1.")}}
    far = {k: v for k, v in far.items() if not k.startswith("blocks.1.")}
    deep = world["tmp"] / "deep.pth"
    torch.save(far, deep)
    assert deep.stat().st_size < 64 << 10
    refused(knn(deep, world), world, capsys, f"{deep}: not a ResMLP state_dict: its blocks are numbered up to 9999 "
            "but it holds 2 of them")
    hollow = {"patch_embed.proj.weight": torch.zeros(512, 3, 4, 4), "patch_embed.proj.bias": torch.zeros(512),
              **{f"blocks.{i}.norm1.alpha": torch.ones(512) for i in range(64)}}
    wide = world["tmp"] / "wide.pth"
    torch.save(hollow, wide)
    refused(knn(wide, world), world, capsys, f"{wide}: the weights imply a model of", "numbers but hold 57,856")


def test_a_saved_config_naming_a_depth_its_weights_do_not_fill_is_refused(tmp_path):
    """The distillation teacher's loader builds the model a checkpoint's config names: a
    depth of 1000 beside two blocks' weights is one line, not a thousand blocks built."""
    from resmlp.models import create_model
    from resmlp.models.load import load_classifier
    sup = create_model("resmlp_s12", **TINY_ARCH, num_classes=10).state_dict()
    path = tmp_path / "teacher.pth"
    config = {"model": {"name": "resmlp_s12", **TINY_ARCH, "depth": 1000}}
    torch.save({"format": FORMAT, "command": "supervised", "config": config, "model": sup}, path)
    with pytest.raises(UserError, match=f"{path}: its config names depth 1000 but its weights hold 2 blocks"):
        load_classifier(path)


# ---- files that are not files -----------------------------------------------------------------------

def test_a_fifo_or_a_device_as_weights_is_one_line_not_a_hang(world, capsys):
    fifo = world["tmp"] / "fifo.pth"
    os.mkfifo(fifo)
    refused(knn(fifo, world), world, capsys, f"{fifo} is a FIFO, not a file")
    run = world["tmp"] / "run"
    run.mkdir()
    os.mkfifo(run / "checkpoint.pth")
    refused(knn(run, world), world, capsys, f"{run / 'checkpoint.pth'} is a FIFO, not a file")
    refused(["dino", "resmlp_s12", *DINO, *LAB, f"data.root={world['lab']}", f"dino.init={fifo}"], world, capsys,
            f"{fifo} is a FIFO, not a file")
    if Path("/dev/zero").exists():
        refused(knn("/dev/zero", world), world, capsys, "/dev/zero is a device, not a file")


# ---- saved configs: plain data -----------------------------------------------------------------------

def nested(depth: int) -> bytes:
    """A pickle (protocol 2) of {"format": FORMAT, "config": {"a": {"a": ...}}} nested `depth`
    deep, written by hand: Python's pickler recurses and could not write it."""
    text = lambda s: b"X" + len(s).to_bytes(4, "little") + s  # noqa: E731
    return (b"\x80\x02}" + text(b"format") + text(FORMAT.encode()) + b"s" + text(b"config") +
            b"}" + (text(b"a") + b"}") * depth + b"s" * depth + b"s.")


@pytest.mark.parametrize("depth, says", [(100_000, "what it holds is nested more than 100 levels deep"),
                                         (20, "its saved config is nested deeper than 16 levels")])
def test_a_deeply_nested_checkpoint_is_one_line(depth, says, world, capsys):
    path = world["tmp"] / "deep_config.pth"
    torch.save({"x": 1}, path)
    rezip(path, nested(depth))
    refused(knn(path, world), world, capsys, f"{path}", says)


SECRET = "RESMLP_TEST_SECRET"


def test_an_interpolation_in_a_saved_config_is_refused_never_resolved(world, capsys, monkeypatch):
    """`${oc.env:...}` in a checkpoint's config or a run folder's config.yaml would read the
    reader's environment and write it into knn.json and evaluations.jsonl: refused, and the
    value is written nowhere."""
    monkeypatch.setenv(SECRET, "the-secret-value")
    run = world["tmp"] / "run"
    run.mkdir()
    config = {"command": "dino", "model": {"name": "resmlp_s12", "dim": 16, "depth": 2, "patch_size": 4},
              "data": {"name": "imagefolder", "img_size": 16, "root": f"${{oc.env:{SECRET}}}"}}
    torch.save({"format": FORMAT, "command": "dino", "config": config, "teacher": tiny_teacher_sd(),
                "epoch": 0, "iteration": 1}, run / "checkpoint.pth")
    refused(knn(run / "checkpoint.pth", world), world, capsys,
            "its saved config holds an interpolation at data.root ('${oc.env:RESMLP_TEST_SECRET}')")
    (run / "config.yaml").write_text(f"command: dino\nmodel:\n  name: ${{oc.env:{SECRET}}}\n")
    refused(knn(run, world), world, capsys, f"{run / 'config.yaml'}: its saved config holds an interpolation at "
            "model.name")
    written = [p for p in world["tmp"].rglob("*") if p.is_file() and b"the-secret-value" in p.read_bytes()]
    assert written == []


def test_a_run_folders_config_yaml_is_plain_data(world, capsys):
    """Resuming a folder whose config.yaml is nested deeper than a config, or not a mapping."""
    run = world["tmp"] / "run"
    argv = ["dino", "resmlp_s12", *DINO, *LAB, f"data.root={world['lab']}", f"out={run}"]
    save_checkpoint(run / "checkpoint.pth", {"iteration": 1, "epoch": 0, "rng": {}})
    for text, says in (("{a: " * 40 + "1" + "}" * 40 + "\n", "nested deeper than 16 levels"),
                       ("[" * 100_000 + "]" * 100_000 + "\n", "cannot be read as a saved config"),
                       ("- 1\n", "its saved config is a list")):
        (run / "config.yaml").write_text(text)
        refused(argv, world, capsys, f"{run / 'config.yaml'}", says)


# ---- links where a command writes --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["log.jsonl", "config.yaml", "results.json", "tb"])
def test_a_link_in_a_run_folder_is_refused_before_the_run_writes(name, world, capsys):
    """A folder holding a link where a training run writes (to a file or folder of the
    user's elsewhere, here another run's config.yaml or a notes file): the run starts
    nothing, names the link, and the file it points to is as it was."""
    run, other = world["tmp"] / "run", world["tmp"] / "other"
    argv = ["dino", "resmlp_s12", *DINO, *LAB, f"data.root={world['lab']}"]
    save_config(load_config("dino", "resmlp_s12", [*argv[2:], f"out={other}"]), other / "config.yaml")
    (world["tmp"] / "notes").mkdir()
    (world["tmp"] / "notes" / "mine.txt").write_text("mine\n")
    run.mkdir()
    if name != "config.yaml":
        save_config(load_config("dino", "resmlp_s12", [*argv[2:], f"out={run}"]), run / "config.yaml")
    target = {"config.yaml": other / "config.yaml", "tb": world["tmp"] / "notes"}.get(name, world["tmp"] / "notes" /
                                                                                       "mine.txt")
    (run / name).symlink_to(target)
    refused([*argv, f"out={run}"], world, capsys, f"{run / name} is a symbolic link (to {target})",
            "never through a link")


@pytest.mark.parametrize("command", ["knn", "linear"])
def test_knn_and_linear_refuse_a_link_where_they_write(command, world, capsys):
    """Into out= (its <command>.json a link) and into the checkpoint's own run folder (its
    evaluations.jsonl a link): refused once the backbone is read, before any feature."""
    mine = world["tmp"] / "mine.json"
    mine.write_text('{"top1": 1.0}\n')
    run = world["tmp"] / "run"
    run.mkdir()
    torch.save({"format": FORMAT, "command": "dino", "teacher": tiny_teacher_sd(), "epoch": 0,
                "config": {"model": {"name": "resmlp_s12", "dim": 16, "depth": 2, "patch_size": 4}}},
               run / "checkpoint.pth")
    out = world["tmp"] / "out"
    out.mkdir()
    (out / f"{command}.json").symlink_to(mine)
    argv = [command, run, *LAB, f"data.root={world['lab']}", "features.cache=false"]
    refused([*argv, f"out={out}"], world, capsys, f"{out / f'{command}.json'} is a symbolic link (to {mine})")
    (run / "evaluations.jsonl").symlink_to(mine)
    refused(argv, world, capsys, f"{run / 'evaluations.jsonl'} is a symbolic link (to {mine})")


def test_every_writer_refuses_a_link_and_leaves_its_target(tmp_path):
    """The shared pieces each writer goes through: an atomic write (config.yaml, results.json,
    a checkpoint, a feature cache, a figure) and an append (log.jsonl, evaluations.jsonl);
    a FIFO where a log goes is refused, not waited on."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("mine\n")
    link = tmp_path / "folder" / "file"
    link.parent.mkdir()
    link.symlink_to(target)
    for write in (lambda: atomic_write(link, "w").__enter__(), lambda: open_nofollow(link, "a"),
                  lambda: open_nofollow(link, "w"), lambda: save_checkpoint(tmp_path / "c.pth", {}, previous=link)):
        with pytest.raises(UserError, match=f"{link} is a symbolic link"):
            write()
    assert target.read_text() == "mine\n" and link.is_symlink()
    nested = tmp_path / "folder" / "sub"
    nested.symlink_to(tmp_path)
    with pytest.raises(UserError, match=f"{nested} is a symbolic link"):
        refuse_link(nested / "viz" / "viz.json", within=tmp_path / "folder")
    fifo = tmp_path / "folder" / "log.jsonl"
    os.mkfifo(fifo)
    with no_hang(), pytest.raises(UserError, match=f"{fifo} is not a regular file"):
        open_nofollow(fifo, "a")


def test_the_fixtures_numpy_values_come_back_as_numpy_numbers():
    """The older checkpoint loads without weights_trust: its RNG key a uint32 array, its
    learning rates float64 numbers, rebuilt by the stand-ins (no object left of them)."""
    from test_safe_load import FIXTURE
    for name in ("checkpoint.pth", "checkpoint_prev.pth"):
        old = load_checkpoint(FIXTURE / name)
        key = old["rng"]["numpy"][1]
        assert type(key) is np.ndarray and key.dtype == np.uint32 and key.shape == (624,)
        group = old["optimizer"]["param_groups"][0]
        assert type(group["lr"]) is np.float64 and json.dumps(float(group["lr"]))
