"""Weights specs (core/weights.py): every form a command takes, parsed in one place, with
its one-line errors; and no other module of the package spells a timm spec itself."""
import ast
from pathlib import Path

import pytest
import torch

from resmlp.core.errors import UserError
from resmlp.core.weights import ANY, FORMS, WeightsSpec, names_timm, timm_spec

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "models", "data", "ssl", "eval", "supervised", "bench")


def test_timm_specs_name_the_model_and_the_flag():
    s = WeightsSpec.parse("timm:resmlp_12_224.fb_dino")
    assert (s.text, s.timm_name, s.flag, s.is_timm, s.path) == ("timm:resmlp_12_224.fb_dino", "resmlp_12_224.fb_dino",
                                                                "", True, None)
    assert s.pretrained(True) and not s.pretrained(False)          # no flag: the command's default
    r = WeightsSpec.parse("timm:resmlp_12_224?random")
    assert (r.timm_name, r.flag, r.plain, str(r)) == ("resmlp_12_224", "random", "timm:resmlp_12_224",
                                                      "timm:resmlp_12_224?random")
    assert not r.pretrained(True)
    assert WeightsSpec.parse("timm:resmlp_12_224?pretrained").pretrained(False)
    assert r.key == "timm:resmlp_12_224?random" and r.saved_config() is None   # kept as given; no config
    assert WeightsSpec.parse("timm:").timm_name == ""   # no name: the loader names what timm lacks


def test_timm_spec_spells_what_parse_reads():
    for name, flag in (("resmlp_12_224", ""), ("vit_tiny_patch16_224.augreg_in21k", "random")):
        s = WeightsSpec.parse(timm_spec(name, flag))
        assert (s.timm_name, s.flag) == (name, flag)
    assert names_timm(timm_spec("x")) and not names_timm("runs/x") and not names_timm(None)
    assert timm_spec("<name>") in FORMS and timm_spec("<name>") in ANY


def test_an_unknown_flag_or_nothing_is_one_line():
    with pytest.raises(UserError, match=r"^timm:resmlp_12_224\?randm: unknown flag \?randm; use timm:<name> or "
                                        r"timm:<name>\?random$"):
        WeightsSpec.parse("timm:resmlp_12_224?randm")
    for empty in (None, "", "  "):
        with pytest.raises(UserError, match="no weights given: pass a checkpoint file, a run dir or timm:<name>"):
            WeightsSpec.parse(empty)


def test_paths_resolve_to_the_checkpoint_file_when_asked(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"format": "resmlp-ssl", "config": {"model": {"name": "resmlp_s12"}}}, run / "checkpoint.pth")
    for given in (run, str(run)):          # a Path or its text
        s = WeightsSpec.parse(given)
        assert (s.text, s.is_timm, s.timm_name) == (str(run), False, None)
        assert s.file == run / "checkpoint.pth" and s.key == str(run.resolve() / "checkpoint.pth")
        assert s.saved_config() == {"model": {"name": "resmlp_s12"}}
    assert WeightsSpec.parse(s) is s        # a parsed spec passes through
    monkeypatch.chdir(tmp_path)
    assert WeightsSpec.parse("run").key == str(run.resolve() / "checkpoint.pth")   # relative: made absolute
    # the key is the file's whether or not it exists (a resumed run compares it with config.yaml's)
    gone = WeightsSpec.parse(tmp_path / "gone.pth")
    assert gone.key == str((tmp_path / "gone.pth").resolve())
    with pytest.raises(UserError, match=r"checkpoint .*gone.pth does not exist; pass a checkpoint file, a run dir "
                                        r"or timm:<name>$"):
        gone.file
    with pytest.raises(UserError, match=r"gone.pth does not exist; pass a checkpoint file, a run dir or timm:<name>$"):
        gone.saved_config()     # what the command line reads first
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is a directory without checkpoint.pth"):
        WeightsSpec.parse(tmp_path / "empty").file
    with pytest.raises(UserError, match="names timm's weights, not a checkpoint file"):
        WeightsSpec.parse("timm:resmlp_12_224").file


def _string_literals(tree: ast.AST):
    """Every string constant of a module, f-strings' pieces included, docstrings left out
    (they document what a user types)."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.value


def test_only_core_weights_spells_a_timm_spec():
    spelled = sorted(str(path.relative_to(REPO)) for package in PACKAGES for path in (REPO / package).glob("*.py")
                     if any("timm:" in s for s in _string_literals(ast.parse(path.read_text(), str(path)))))
    assert spelled == ["core/weights.py"]


def test_the_literal_scan_sees_f_strings_and_skips_docstrings():
    code = '"""timm:<name> in a docstring"""\ndef f(n):\n    """timm:x"""\n    return f"timm:{n}"\n'
    assert [s for s in _string_literals(ast.parse(code)) if "timm:" in s] == ["timm:"]
