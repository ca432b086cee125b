"""A compile cache is code (core/cache_trust.py, core/compile_cache.py): only one its user
signed, in files and a folder no one else can write, with artifacts whose keys stay inside
torch's caches, reaches torch; and no save or load, whatever fails, ends a run.

Nothing here compiles: the caches are torch's own byte layout built from hand-made
artifacts (torch.compiler._cache's serializer), saved through a stand-in for
save_cache_artifacts and loaded by torch's real load_cache_artifacts into a throwaway
Inductor cache folder (torch._inductor.utils.fresh_cache).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.utils import fresh_cache

from resmlp.core import cache_trust, compile_cache
from resmlp.core.cache_trust import (SECRET_ENV, SecretRefused, artifact_keys, path_like, secret_path, signature,
                                     user_secret)
from resmlp.core.compile_cache import NOT_YOURS, CompileCache, open_compile_cache

REAL_LOAD = torch.compiler.load_cache_artifacts
KEY = {"device": "cpu: test", "torch": torch.__version__, "model": {"dim": 16}}
GRAPH = [("inductor", "fabcdefgh", b"a compiled graph"), ("aot_autograd", "aqrstuv", b"its backward")]


def torch_bytes(artifacts) -> bytes:
    """torch's Mega-Cache bytes holding (kind, key, content) artifacts, as
    save_cache_artifacts lays them out."""
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer
    kinds = defaultdict(list)
    for kind, key, content in artifacts:
        kinds[kind].append(SimpleNamespace(key=key, content=content))
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend(kinds.items())
    return out.to_bytes()


def torch_compiled(monkeypatch, artifacts=GRAPH, error: Exception | None = None):
    """save_cache_artifacts as after a compilation that recorded `artifacts` (or raising `error`)."""
    from torch.compiler._cache import CacheInfo

    def save():
        if error is not None:
            raise error
        info = CacheInfo()
        for kind, key, _ in artifacts:
            info.artifacts[kind].append(key)
        return torch_bytes(artifacts), info
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save)
    monkeypatch.setattr(compile_cache, "_new_compilations", lambda: True)


def torch_must_not_load(monkeypatch) -> list:
    """load_cache_artifacts, recording any call (a refused cache never reaches torch)."""
    calls = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: calls.append(data))
    return calls


def saved(folder, monkeypatch, artifacts=GRAPH) -> CompileCache:
    """A cache of KEY saved in `folder` with the session's secret, as rank 0 saves it."""
    lines = []
    torch_compiled(monkeypatch, artifacts)
    cache = CompileCache(folder, KEY, say=lines.append)
    assert cache.save(), lines
    return cache


def sign(record_path: Path, data: bytes, secret: bytes | None = None) -> None:
    """A record for `data` as this user's save writes it (signed), beside its bytes."""
    secret = user_secret(create=True) if secret is None else secret
    digest = hashlib.sha256(data).hexdigest()
    record_path.with_suffix(".bin").write_bytes(data)
    record_path.write_text(json.dumps({"key": KEY, "bytes": len(data), "sha256": digest,
                                       "signature": signature(secret, KEY, digest)}))


def load(folder, tmp_path, name="node") -> tuple[dict, list]:
    """A new start's load into a torch cache folder of its own: (what it loaded, its lines)."""
    lines = []
    (tmp_path / name).mkdir(exist_ok=True)
    with fresh_cache(dir=str(tmp_path / name)):
        loaded = CompileCache(folder, KEY, say=lines.append).load()
    return loaded, lines


def files_under(root: Path) -> set:
    return {p for p in root.rglob("*")}


def test_a_saved_cache_is_signed_and_a_requeued_job_on_another_node_loads_it(tmp_path, monkeypatch):
    """Two nodes, each with its own torch caches, one run dir on a shared disk and one secret
    file (RESMLP_CACHE_SECRET): the second start is warm."""
    monkeypatch.setenv(SECRET_ENV, str(tmp_path / "home" / "secret"))
    cache = saved(tmp_path / "run" / "compile_cache", monkeypatch)
    record = json.loads(cache.record.read_text())
    assert record["signature"] == signature(user_secret(create=False), KEY, record["sha256"])
    assert oct(os.stat(secret_path()).st_mode & 0o777) == "0o600"
    assert oct(os.stat(cache.folder).st_mode & 0o777) == "0o700"
    loaded, lines = load(cache.folder, tmp_path, "node2")
    assert loaded == {"aot_autograd": 1, "inductor": 1}
    assert lines == [f"compile cache: loaded 2 compiled artifacts (aot_autograd 1, inductor 1) from {cache.bin}"]


def test_a_cache_not_signed_with_your_secret_is_not_loaded_and_the_run_goes_on(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    cache = saved(folder, monkeypatch)
    calls = torch_must_not_load(monkeypatch)
    good = cache.record.read_text()
    record = json.loads(good)
    ours = os.environ[SECRET_ENV]
    others = {"no signature": lambda: cache.record.write_text(json.dumps({k: v for k, v in record.items()
                                                                          if k != "signature"})),
              "a signature of other bytes": lambda: sign(cache.record, b"other bytes", bytes(32)),
              "another user's secret": lambda: monkeypatch.setenv(SECRET_ENV, str(tmp_path / "other" / "secret"))
              or user_secret(create=True),
              "no secret at all": lambda: monkeypatch.setenv(SECRET_ENV, str(tmp_path / "none" / "secret"))}
    for why, make in others.items():
        cache.record.write_text(good)
        make()
        assert load(folder, tmp_path) == ({}, [NOT_YOURS]), why
        monkeypatch.setenv(SECRET_ENV, ours)
    assert calls == [] and not (tmp_path / "none").exists()   # loading makes no secret
    # the run goes on: its save signs a cache of its own, which its next start loads
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", REAL_LOAD)
    cache.record.write_text(json.dumps({**record, "signature": "0" * 64}))
    assert load(folder, tmp_path) == ({}, [NOT_YOURS])
    assert CompileCache(folder, KEY, say=print).save()
    assert load(folder, tmp_path)[0] == {"aot_autograd": 1, "inductor": 1}


@pytest.mark.parametrize("kind, key", [("autotune", "{outside}/evil.py"), ("inductor", "../../../evil.py"),
                                       ("aot_autograd", "sub/evil.py"), ("autotune", "ab/../../evil.py"),
                                       ("pgo", "..")])
def test_an_artifact_whose_key_is_a_path_is_refused_and_nothing_is_written(tmp_path, monkeypatch, kind, key):
    key = key.format(outside=tmp_path / "outside")
    data = torch_bytes([*GRAPH, (kind, key, b"import os; os.system('touch pwned')\n")])
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    record = folder / f"{compile_cache.key_id(KEY)}.json"
    sign(record, data)   # signed by the user's own secret: the keys are checked anyway
    before = files_under(tmp_path)
    calls = torch_must_not_load(monkeypatch)
    assert load(folder, tmp_path) == ({}, [
        f"compile cache: {record.with_suffix('.bin')} holds an artifact whose key is a path ({kind}: {key!r}): "
        "refused (a compile cache is code), compiling afresh; this run saves its own in its place"])
    assert calls == [] and files_under(tmp_path) == before | {tmp_path / "node"}
    # the same bytes unsigned: not yours, before their keys are read
    record.write_text(json.dumps({**json.loads(record.read_text()), "signature": "0" * 64}))
    assert load(folder, tmp_path) == ({}, [NOT_YOURS])


def test_torch_itself_would_write_where_such_a_key_points(tmp_path):
    """What the refusal above prevents: torch's loader follows an autotune key out of its folder."""
    target = tmp_path / "outside" / "evil.py"
    (tmp_path / "node").mkdir()
    with fresh_cache(dir=str(tmp_path / "node")):
        torch.compiler.load_cache_artifacts(torch_bytes([("autotune", str(target), b"print('ran')\n")]))
    assert target.read_bytes() == b"print('ran')\n"


def test_the_index_is_read_without_loading_and_torchs_own_key_shapes_pass():
    data = torch_bytes([*GRAPH, ("autotune", "cx/cxyz.best_config", b"{}")])
    assert artifact_keys(data) == [("inductor", "fabcdefgh"), ("aot_autograd", "aqrstuv"),
                                   ("autotune", "cx/cxyz.best_config")]
    assert not any(path_like(kind, key) for kind, key in artifact_keys(data))
    for kind, key in (("autotune", "a/b/c"), ("autotune", "/a"), ("autotune", "a/"), ("inductor", "a\\b"),
                      ("inductor", "."), ("inductor", ""), ("aot_autograd", "a\0b"), ("pgo", "x..y")):
        assert path_like(kind, key), (kind, key)
    for cut in (data[:-3], data[:20], data[:4] + (2).to_bytes(8, "big") + data[12:]):
        with pytest.raises(ValueError):
            artifact_keys(cut)
    # a count far above what the bytes could hold is refused before any loop over it
    huge = data[:12] + torch_bytes([])[12:] + (8).to_bytes(8, "big") + b"aW5kdWN0b3I=" + (2**60).to_bytes(8, "big")
    with pytest.raises(ValueError):
        artifact_keys(huge)


def test_a_folder_or_file_others_can_write_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    cache = saved(folder, monkeypatch)
    calls = torch_must_not_load(monkeypatch)
    os.chmod(folder, 0o777)
    assert load(folder, tmp_path) == ({}, [
        f"compile cache: {folder} is writable by others (mode 777): nothing read or saved there, compiling afresh; "
        "a compile cache is code: set compile_cache_dir to a folder of yours that only you can write to"])
    lines = []
    refusing = CompileCache(folder, KEY, say=lines.append)
    refusing.load()
    written = cache.bin.stat().st_mtime_ns
    assert not refusing.save() and cache.bin.stat().st_mtime_ns == written and len(lines) == 1
    os.chmod(folder, 0o700)
    refused = "refused (a compile cache is code), compiling afresh; this run saves its own in its place"
    os.chmod(cache.bin, 0o664)
    assert load(folder, tmp_path)[1] == [f"compile cache: {cache.bin} is writable by others (mode 664): {refused}"]
    os.chmod(cache.bin, 0o600)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    assert load(folder, tmp_path)[1][0].startswith(f"compile cache: {folder} belongs to another user (uid ")
    monkeypatch.setattr(os, "geteuid", os.getuid)
    # a record that is a link to a signed one elsewhere is not followed
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(cache.record, elsewhere)
    cache.record.symlink_to(elsewhere)
    assert load(folder, tmp_path)[1] == [f"compile cache: {cache.record} is a link: {refused}"]
    assert calls == []
    # ... and the run's save puts a file of its own in the link's place, leaving its target be
    target = elsewhere.read_bytes()
    torch_compiled(monkeypatch, [("inductor", "fnew", b"another graph")])
    assert CompileCache(folder, KEY, say=print).save()
    assert not cache.record.is_symlink() and elsewhere.read_bytes() == target


def test_the_secret_is_made_once_private_even_by_processes_racing(tmp_path):
    """Four processes make the secret at the same moment: all sign with the one that won."""
    path, go = tmp_path / "home" / "secret", tmp_path / "go"
    code = ("import os, sys, time\nfrom resmlp.core.cache_trust import user_secret\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\nprint(user_secret(create=True).hex())")
    env = {**os.environ, SECRET_ENV: str(path), "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    go.touch()
    found = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 4
    assert found == {path.read_text().strip()} and len(found.pop()) == 64
    assert oct(path.stat().st_mode & 0o777) == "0o600" and os.listdir(path.parent) == ["secret"]


def test_the_secret_is_made_race_free_where_hard_links_are_not_supported(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setenv(SECRET_ENV, str(tmp_path / "secret"))
    start = threading.Barrier(6)
    found = []

    def make():
        start.wait()
        found.append(user_secret(create=True))
    threads = [threading.Thread(target=make) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 6 and len(set(found)) == 1 and os.listdir(tmp_path) == ["secret"]


def test_the_secret_lives_in_the_users_cache_folder_unless_named(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert secret_path() == tmp_path / "xdg" / "resmlp" / "compile_cache.secret"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert secret_path() == tmp_path / "home" / ".cache" / "resmlp" / "compile_cache.secret"


def test_a_secret_others_could_read_or_replace_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, str(tmp_path / "home" / "secret"))
    folder = tmp_path / "cache"
    saved(folder, monkeypatch)
    path = secret_path()
    calls = torch_must_not_load(monkeypatch)
    fix = f"make it yours alone (chmod 600), remove it to get a new one, or name another file in {SECRET_ENV}"
    os.chmod(path, 0o644)
    with pytest.raises(SecretRefused):
        user_secret(create=False)
    assert load(folder, tmp_path)[1] == [f"compile cache: the secret {path} is readable or writable by others (mode "
                                         f"644): nothing loaded or saved, compiling afresh; {fix}"]
    lines = []
    torch_compiled(monkeypatch)
    assert not CompileCache(tmp_path / "other", KEY, say=lines.append).save()
    assert lines == [f"warning: compile cache: not saved: the secret {path} is readable or writable by others (mode "
                     f"644); {fix} (the run goes on; its next start compiles again)"]
    # a secret that cannot be made (a read-only home folder)
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(cache_trust.tempfile, "mkstemp", read_only)
    monkeypatch.setenv(SECRET_ENV, str(tmp_path / "ro" / "secret"))
    lines.clear()
    assert not CompileCache(tmp_path / "other", KEY, say=lines.append).save()
    assert lines == [f"warning: compile cache: not saved: the secret {tmp_path / 'ro' / 'secret'} cannot be made "
                     f"(Read-only file system); {fix} (the run goes on; its next start compiles again)"]
    os.chmod(path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    monkeypatch.setenv(SECRET_ENV, str(link))
    assert load(folder, tmp_path)[1] == [f"compile cache: the secret {link} is a link: nothing loaded or saved, "
                                         f"compiling afresh; {fix}"]
    assert calls == []


@pytest.mark.parametrize("fault", ["torch raises", "not a folder", "disk full"])
def test_a_save_that_fails_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, fault):
    folder = tmp_path / "cache"
    torch_compiled(monkeypatch, error=RuntimeError("inductor broke\nits traceback") if fault == "torch raises" else None)
    if fault == "not a folder":
        (tmp_path / "file").write_text("x")
        folder = tmp_path / "file" / "cache"
    if fault == "disk full":
        from resmlp.core import checkpoint

        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(checkpoint.os, "fsync", full)
    lines = []
    cache = CompileCache(folder, KEY, say=lines.append)
    assert not cache.save() and not cache.save()   # the run goes on; one line, not one per log line
    expected = {"torch raises": "warning: compile cache: not saved (RuntimeError: inductor broke): the run goes on; "
                                "its next start compiles again",
                "not a folder": "warning: compile cache: not saved (Not a directory): the run goes on; its next "
                                "start compiles again",
                "disk full": f"warning: cannot write the compile cache {cache.bin}: No space left on device; nothing "
                             "was written: free some space or set compile_cache_dir to another folder (the run goes "
                             "on; its next start compiles again)"}
    assert lines == [expected[fault]]
    assert not cache.bin.exists() and not cache.record.exists()


def test_a_load_that_fails_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    cache = saved(folder, monkeypatch)
    then = "ignored; the first iteration compiles and replaces it"

    def broken(data):
        raise RuntimeError("cannot unpickle")
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", broken)
    assert load(folder, tmp_path) == ({}, [f"warning: compile cache: torch could not load {cache.bin} "
                                           f"(RuntimeError: cannot unpickle): {then}"])
    monkeypatch.undo()
    # torch's own refusal of what it cannot read (an artifact of a kind it does not know)
    sign(cache.record, torch_bytes([("no such kind", "k", b"x")]))
    assert load(folder, tmp_path) == ({}, [f"warning: compile cache: torch could not load {cache.bin} (torch could "
                                           f"not read its artifacts): {then}"])
    # a folder that cannot even be looked at
    (tmp_path / "file").write_text("x")
    assert load(tmp_path / "file" / "cache", tmp_path) == ({}, [
        f"warning: compile cache: {tmp_path / 'file' / 'cache'} cannot be read (Not a directory): compiling afresh"])


def test_a_damaged_cache_is_one_warning(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    cache = saved(folder, monkeypatch)
    good, data = cache.record.read_text(), cache.bin.read_bytes()
    calls = torch_must_not_load(monkeypatch)
    damages = {"cut short": lambda: cache.bin.write_bytes(data[: len(data) // 2]),
               "other bytes": lambda: cache.bin.write_bytes(data[:-8] + bytes(8)),
               "no bytes": lambda: cache.bin.unlink(),
               "a record that is no JSON": lambda: cache.record.write_text('{"key": '),
               "signed bytes that are not torch's": lambda: sign(cache.record, b"not torch's artifacts")}
    for why, damage in damages.items():
        cache.record.write_text(good)
        cache.bin.write_bytes(data)
        os.chmod(cache.bin, 0o600)
        damage()
        loaded, lines = load(folder, tmp_path)
        assert loaded == {} and len(lines) == 1, (why, lines)
        assert lines[0].startswith(f"warning: compile cache: {cache.record} is unreadable or damaged (") \
            and lines[0].endswith("): ignored; the first iteration compiles and replaces it"), (why, lines)
    assert calls == []


def rank(is_main: bool, tmp_path, lines):
    return SimpleNamespace(amp_dtype=None, device=torch.device("cpu"), batch_per_rank=8, world_size=2,
                           dir=tmp_path / "run", print=lines.append, is_main=is_main, rank=0 if is_main else 1)


def test_a_rank_whose_key_is_not_rank_0s_says_once_it_compiles_without_a_cache(tmp_path, monkeypatch, capsys):
    from resmlp.core import dist
    from resmlp.core.config import load_config
    from resmlp.models.resmlp import ResMLP
    cfg = load_config("dino", "resmlp_s12", ["demo=false", "device=cpu", f"out={tmp_path / 'run'}"])
    net = ResMLP(img_size=16, patch_size=4, dim=16, depth=1, num_classes=0)
    net.compile()
    leader = {}
    monkeypatch.setattr(dist, "broadcast_object", lambda key: leader.setdefault("key", key))
    lines = []
    assert open_compile_cache(cfg, rank(True, tmp_path, lines), (net,)).loaded == {}
    assert lines[0].startswith("compile cache: none in ")
    leader["key"] = {**leader["key"], "device": "NVIDIA H100 80GB HBM3"}
    capsys.readouterr()
    other = open_compile_cache(cfg, rank(False, tmp_path, lines), (net,))
    assert other.loaded == {} and len(lines) == 1 and not other.writer
    assert capsys.readouterr().out.splitlines() == [
        f"rank 1: compile cache: this process's key is not rank 0's (device: NVIDIA H100 80GB HBM3 -> "
        f"{compile_cache.device_model(torch.device('cpu'))}), and rank 0 alone saves: this process compiles "
        "without a cache"]
