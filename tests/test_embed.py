"""`run.sh embed` (eval/embed.py): the rows are the k-NN's features of the same images, the
files load with safetensors, a killed run resumes from its shards to the same files, two gloo
processes write what one does, and bad inputs are one line before any work."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from resmlp.core.cadence import KILL_AT_ENV
from resmlp.core.checkpoint import read_file
from resmlp.core.cli import main
from resmlp.eval import embed as E

from test_eval import dino_checkpoint, tiny_model
from test_folder import labeled, one_line_error

ROOT = Path(__file__).resolve().parent.parent
# 10 training images, shards of 4 (4, 4, 2), batches of 2: a shard ends every second batch
SHARDED = ["num_workers=0", "embed.shard_size=4", "features.batch_size=2"]
SMALL = [*SHARDED, "device=cpu"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A tiny DINO run dir and a labeled image folder (2 classes of 5 images, 16 px)."""
    tmp = tmp_path_factory.mktemp("embed")
    run = tmp / "run"
    run.mkdir()
    torch.save(dino_checkpoint(tiny_model(), {"backbone." + k: v for k, v in tiny_model(seed=1).state_dict().items()}),
               run / "checkpoint.pth")
    data = labeled(tmp / "data", per_class=5)
    return {"run": run, "data": data, "args": ["data=imagefolder", f"data.root={data}", "data.img_size=32"]}


def embed(world, out, *extra) -> int:
    return main(["embed", str(world["run"]), *world["args"], *SMALL, f"out={out}", *extra])


def rows(out: Path) -> torch.Tensor:
    return load_file(str(out / E.EMBEDDINGS))[E.TENSOR]


def knn_features(world, tmp_path, *extra, device="cpu") -> dict:
    """The train split's features as `knn` extracts and caches them."""
    cache = tmp_path / "cache"
    assert main(["knn", str(world["run"]), *world["args"], "num_workers=0", f"device={device}", "k=3",
                 f"features.cache_dir={cache}", f"out={tmp_path / 'knn'}", *extra]) == 0
    [train] = cache.glob("train-*.pt")
    return read_file(train)


def test_the_rows_are_the_knns_features_of_the_same_images(world, tmp_path, capsys):
    out = tmp_path / "emb"
    assert embed(world, out) == 0
    cached = knn_features(world, tmp_path)
    x = rows(out)
    assert x.shape == (10, 32) and x.dtype == torch.float32
    torch.testing.assert_close(x, cached["features"], rtol=1e-5, atol=1e-6)
    card = json.loads((out / E.CARD).read_text())
    assert card["features"] == cached["key"]                  # the same images, transform, weights, precision
    assert card["complete"] and card["count"] == 10 and card["dim"] == 32 and card["key"] == "teacher"
    assert len(card["weights"]["sha256"]) == 64 and card["shards"] == {"size": 4, "count": 3}
    assert not (out / E.SHARDS).exists()
    with open(out / "index.csv") as f:
        index = list(csv.DictReader(f))
    assert [int(r["row"]) for r in index] == list(range(10))
    assert [int(r["label"]) for r in index] == cached["labels"].tolist()
    assert index[0]["path"].endswith("train/bright/0.png") and {r["class"] for r in index} == {"bright", "dark"}
    with safe_open(str(out / E.EMBEDDINGS), "pt") as f:       # one slice, without reading the rest
        torch.testing.assert_close(f.get_slice(E.TENSOR)[3:5], x[3:5])
        assert f.metadata()["normalized"] == "false"

    # the student, L2-normalised, in fp16, a JSON-lines index
    out2 = tmp_path / "student"
    assert embed(world, out2, "key=student", "embed.dtype=fp16", "embed.normalize=true", "embed.index=jsonl") == 0
    student = knn_features(world, tmp_path / "s", "key=student")["features"]
    y = rows(out2)
    assert y.dtype == torch.float16 and not torch.allclose(student, cached["features"])
    torch.testing.assert_close(y.float(), F.normalize(student, dim=1), rtol=1e-3, atol=1e-3)
    lines = [json.loads(line) for line in (out2 / "index.jsonl").read_text().splitlines()]
    assert lines[9] == {"row": 9, "path": str(world["data"] / "train" / "dark" / "4.png"), "label": 1, "class": "dark"}
    assert json.loads((out2 / E.CARD).read_text())["key"] == "student"


@pytest.mark.cuda
def test_on_a_gpu_the_rows_are_the_knns_features_too(world, tmp_path):
    """bf16 autocast there (precision=auto), both commands alike."""
    out = tmp_path / "gpu"
    assert main(["embed", str(world["run"]), *world["args"], *SHARDED, "device=cuda", f"out={out}"]) == 0
    cached = knn_features(world, tmp_path, device="cuda")
    assert json.loads((out / E.CARD).read_text())["features"] == cached["key"]
    torch.testing.assert_close(rows(out), cached["features"], rtol=1e-2, atol=1e-2)


def test_a_folder_without_labels_a_file_list_and_a_set_in_memory(world, tmp_path):
    photos = [world["data"] / "val" / c / f"{i}.png" for c in ("dark", "bright") for i in range(3)]
    listed = tmp_path / "list.txt"
    listed.write_text("\n".join(map(str, photos)) + "\n")
    out = tmp_path / "list"
    assert main(["embed", str(world["run"]), "data=folder", f"data.files={listed}", "data.img_size=32", *SMALL,
                 f"out={out}"]) == 0
    with open(out / "index.csv") as f:
        index = list(csv.DictReader(f))
    assert list(index[0]) == ["row", "path"] and [r["path"] for r in index] == sorted(map(str, photos))
    assert rows(out).shape == (6, 32)

    # an image set held in memory: its rows named by their index in the split, through data.subset's pick
    from resmlp.data import build_dataset
    from resmlp.core.config import load_config
    from test_eval import FMNIST, write_idx
    if not os.path.isdir(FMNIST):
        pytest.skip("Fashion-MNIST files are not installed")
    from resmlp.data.fashion_mnist import FILES, _file, read_idx
    root = tmp_path / "fmnist"
    root.mkdir()
    for split in ("train", "test"):
        for stem in FILES[split]:
            write_idx(root / stem, read_idx(_file(FMNIST, stem))[:100])
    args = ["data=fashion_mnist", f"data.root={root}", "data.img_size=32", "data.subset=20"]
    assert main(["embed", str(world["run"]), *args, *SMALL, f"out={tmp_path / 'fm'}"]) == 0
    with open(tmp_path / "fm" / "index.csv") as f:
        index = list(csv.DictReader(f))
    picked = build_dataset(load_config("embed", None, args).data, "train")
    assert [int(r["index"]) for r in index] == picked.indices.tolist() and len(index) == 20
    assert [int(r["label"]) for r in index] == picked.targets.tolist()


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_shard_to_the_same_files(world, tmp_path, capsys):
    whole = tmp_path / "whole"
    assert embed(world, whole) == 0
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "resmlp.core.cli", "embed", str(world["run"]), *world["args"], *SMALL, f"out={cut}"]
    env = {**os.environ, KILL_AT_ENV: "3"}      # in the second shard, one batch past the first's write
    killed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(p.name for p in (cut / E.SHARDS).glob("*.safetensors")) == ["00000.safetensors"]
    assert not (cut / E.EMBEDDINGS).exists() and not json.loads((cut / E.CARD).read_text())["complete"]
    capsys.readouterr()
    assert embed(world, cut, "embed.shard_size=3") == 0            # the shards on disk keep their size
    assert "1 of 3 shards were done" in capsys.readouterr().out
    for name in (E.EMBEDDINGS, "index.csv"):
        assert (cut / name).read_bytes() == (whole / name).read_bytes(), name
    # the same command again: nothing to do, nothing touched
    before = {p.name: p.stat().st_mtime_ns for p in cut.iterdir()}
    assert embed(world, cut) == 0
    assert "holds these embeddings already" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in cut.iterdir()} == before


def _rank(rank: int, tmp: str, argv: list[str]) -> None:
    tdist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=2)
    write = E.write_shard

    def noted(path, *args):   # which process wrote which shard
        with open(os.path.join(tmp, f"rank{rank}.txt"), "a") as f:
            f.write(f"{Path(path).stem}\n")
        write(path, *args)
    E.write_shard = noted
    Path(tmp, f"rc{rank}").write_text(str(main(argv)))


@pytest.mark.slow
def test_two_gloo_processes_share_the_shards_and_write_what_one_does(world, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert embed(world, one, "features.batch_size=4") == 0
    argv = ["embed", str(world["run"]), *world["args"], *SMALL, "features.batch_size=4", f"out={two}"]
    mp.spawn(_rank, args=(str(tmp_path), argv), nprocs=2, join=True)
    assert [(tmp_path / f"rc{r}").read_text() for r in (0, 1)] == ["0", "0"]
    assert (tmp_path / "rank0.txt").read_text().split() == ["00000", "00002"]
    assert (tmp_path / "rank1.txt").read_text().split() == ["00001"]
    torch.testing.assert_close(rows(two), rows(one), rtol=1e-5, atol=1e-6)
    assert (two / "index.csv").read_bytes() == (one / "index.csv").read_bytes()


def test_the_shard_size_is_not_the_folders_identity_the_index_format_is(world, tmp_path, capsys):
    """Without out=, embed writes to embed/<result name> beside the checkpoint, named by the
    settings that change what it computes: another embed.shard_size (how the work is cut)
    finds the same folder and its finished embeddings; another embed.index (another file)
    gets a folder of its own."""
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)

    def cards():
        return sorted(p.parent for p in (run / "embed").rglob(E.CARD))
    assert main(["embed", str(run), *world["args"], *SMALL]) == 0
    [folder] = cards()
    capsys.readouterr()
    assert main(["embed", str(run), *world["args"], *SMALL, "embed.shard_size=3"]) == 0
    assert f"{folder} holds these embeddings already" in capsys.readouterr().out and cards() == [folder]
    assert main(["embed", str(run), *world["args"], *SMALL, "embed.index=jsonl"]) == 0
    [other] = [f for f in cards() if f != folder]
    assert (other / "index.jsonl").is_file() and not (folder / "index.jsonl").exists()
    assert rows(other).equal(rows(folder))


def test_bad_inputs_are_one_line_before_any_work(world, tmp_path, capsys):
    out = tmp_path / "emb"
    assert embed(world, out) == 0
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # an output of other inputs: named, untouched; out_ok=true replaces it
    assert embed(world, out, "embed.dtype=fp16") == 2
    assert "dtype: fp32 -> fp16" in one_line_error(capsys)
    assert embed(world, out, "key=student") == 2
    assert "weights: " in one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert embed(world, out, "embed.dtype=fp16", "out_ok=true") == 0
    assert rows(out).dtype == torch.float16

    empty, bad = tmp_path / "empty", tmp_path / "bad"
    empty.mkdir()
    bad.mkdir()
    Image.new("RGB", (16, 16)).save(bad / "good.png")
    (bad / "broken.png").write_bytes(b"not an image at all")
    folder = ["embed", str(world["run"]), "data=folder", "data.img_size=32", *SMALL]
    refused = {
        "no images under": [*folder, f"data.root={empty}"],
        f"1 image file(s) do not open as images, the first {bad / 'broken.png'}": [*folder, f"data.root={bad}"],
        "has the split(s) train, not embed.split=test": [*folder, f"data.root={bad}", "embed.split=test"],
        "embed.dtype": ["embed", str(world["run"]), *world["args"], "embed.dtype=bf16"],
        "does not read features.cache_dir": ["embed", str(world["run"]), "features.cache_dir=/tmp/x"],
        "cannot take the data's 16x16 px": ["embed", str(world["run"]), *world["args"][:2], "data.img_size=16",
                                            *SMALL],
    }
    for said, argv in refused.items():
        assert main([*argv, f"out={tmp_path / 'no'}"]) == 2, said
        assert said in one_line_error(capsys)
        assert not (tmp_path / "no").exists(), said
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    assert embed(world, tmp_path / "foreign") == 2
    assert "holds files this project did not write (notes.txt)" in one_line_error(capsys)


def test_an_image_that_fails_to_decode_stops_with_the_finished_shards_kept(world, tmp_path, capsys):
    data = tmp_path / "photos"
    data.mkdir()
    noise = torch.Generator().manual_seed(0)
    for i in range(6):
        pixels = torch.randint(0, 256, (64, 64, 3), generator=noise, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(data / f"{i}.jpg", quality=90)
    whole = (data / "5.jpg").read_bytes()
    (data / "5.jpg").write_bytes(whole[:len(whole) // 2])            # the header opens, the pixels do not
    argv = ["embed", str(world["run"]), "data=folder", f"data.root={data}", "data.img_size=32", *SMALL,
            f"out={tmp_path / 'out'}"]
    assert main(argv) == 2
    assert f"cannot read image {data / '5.jpg'}" in one_line_error(capsys)
    assert sorted(p.name for p in (tmp_path / "out" / E.SHARDS).iterdir()) == ["00000.safetensors"]
    (data / "5.jpg").write_bytes(whole)
    assert main(argv) == 0
    assert "1 of 2 shards were done" in capsys.readouterr().out and rows(tmp_path / "out").shape == (6, 32)


def test_a_terminal_shows_a_bar_of_the_images_and_their_rate(world, tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert embed(world, tmp_path / "bar") == 0
    shown = term.getvalue()
    assert "embed: 100%" in shown and "10/10" in shown and "img/s" in shown
