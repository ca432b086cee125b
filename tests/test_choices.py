"""The words a key may hold are written once, in its `limits:` entry (issue 37, part 3): no
module of the package repeats them as a literal, and code that needs them reads
core/config.py's `choices`.

What counts as a repeat: a list, tuple or set literal of two or more strings whose set is
a key's words, or its words but `auto` (the concrete choices, e.g. bf16, fp16, fp32). A
smaller group of them (`fmt in ("timm", "official")`: the formats that write a .pth) is a
branch on the value, and a dict (a table from each word to what it does) is a dispatch;
both stay in code."""
import ast
from pathlib import Path

import pytest

from resmlp.core.config import Choice, all_choices, check_choice, choices, load_config
from resmlp.core.errors import UserError

from kit import PRODUCT

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = PRODUCT


def repeated_words(source: str, lists: dict) -> list[tuple[int, str]]:
    """(line, key) for each literal in `source` that repeats one of `lists` ({key: words})."""
    sets = {}
    for key, words in lists.items():
        # a flag among the words counts as the word YAML reads as it (true, false)
        strings = frozenset(w if isinstance(w, str) else str(w).lower() for w in words if isinstance(w, (str, bool)))
        for s in (strings, strings - {"auto"}):
            if len(s) >= 2:
                sets[s] = f"{sets[s]} / {key}" if s in sets and key not in sets[s] else key
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and len(node.elts) >= 2 and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            key = sets.get(frozenset(e.value for e in node.elts))
            if key:
                found.append((node.lineno, key))
    return found


def test_the_finder_sees_a_repeat_and_lets_a_branch_be():
    lists = {"precision": ("auto", "bf16", "fp16", "fp32"), "export.format": ("timm", "official", "safetensors"),
             "dino.cuda_graphs": ("auto", True, False)}
    src = ('A = ("bf16", "fp16", "fp32")\n'
           'B = ["safetensors", "official", "timm"]\n'
           'if fmt in ("timm", "official"): pass\n'
           'T = {"bf16": 1, "fp16": 2, "fp32": 3}\n'
           'if text not in ("true", "false", "auto"): pass\n'   # what ssl/graphed_step.py held before its limit
           'if value == "auto": pass\n')
    assert repeated_words(src, lists) == [(1, "precision"), (2, "export.format"), (5, "dino.cuda_graphs")]


def test_no_module_repeats_a_keys_words():
    lists = all_choices()
    assert {"device", "precision", "launcher", "slurm.cluster", "data.decode", "knn.backend", "features.key",
            "export.format", "linear.mode", "distill.type", "eval.data", "dino.local_crops",
            "dino.augment", "dino.bottleneck_norm", "demo", "dino.cuda_graphs", "compile"} <= lists.keys()
    found = [f"{path.relative_to(ROOT)}:{line} repeats {key}'s words ({choices(key)})"
             for folder in PACKAGE for path in sorted((ROOT / folder).rglob("*.py"))
             for line, key in repeated_words(path.read_text(), lists)]
    assert not found, "read them with resmlp.core.config.choices(key):\n" + "\n".join(found)


def test_the_labeled_sets_are_the_registrys():
    """eval.data's words (but null) are the data sets that have labels."""
    from resmlp.data.datasets import DATASETS, LABELED
    assert set(LABELED) == {name for name, info in DATASETS.items() if info.labeled}
    assert set(LABELED) == set(choices("eval.data")) - {None}


def test_a_value_handed_to_code_is_checked_against_the_limits():
    check_choice("knn.backend", "torch")
    with pytest.raises(UserError, match="^knn.backend=annoy is not allowed: knn.backend must be one of auto, faiss, "
                                        "torch$"):
        check_choice("knn.backend", "annoy")
    assert Choice(choices("eval.data")).allows(None)


# ---- words or flags: demo and dino.cuda_graphs (auto | true | false) ------------------------

FLAG_OR_WORD = ("demo", "dino.cuda_graphs")


def test_a_flag_or_word_key_is_its_limits_words_as_yaml_reads_them():
    """[auto, true, false] in a `limits:` list: the word auto and the flags true and false,
    which is how OmegaConf reads `key=true` on the command line too."""
    for key in FLAG_OR_WORD:
        assert set(choices(key)) == {"auto", True, False}
        assert all(type(w) in (str, bool) for w in choices(key))
    cfg = load_config("dino", "resmlp_s12", ["demo=false", "dino.cuda_graphs=false"])
    assert cfg.dino.cuda_graphs is False   # a flag, not the text
    assert set(choices("compile")) == {"auto", True, False, "regions", "whole"}


@pytest.mark.parametrize("given, value", [("true", True), ("false", False), ("auto", "auto"), ("regions", "regions"),
                                          ("whole", "whole")])
def test_every_word_of_compile_is_taken_and_auto_is_the_default(given, value):
    assert load_config("dino", "resmlp_s12", ["demo=false", f"compile={given}"]).compile == value
    for command in ("dino", "supervised"):
        assert load_config(command, "resmlp_s12", ["demo=false"]).compile == "auto"
    assert load_config("dino", "resmlp_s12", ["demo=false"]).dino.cuda_graphs == "auto"


@pytest.mark.parametrize("given, graphs", [("true", True), ("True", True), ("false", False), ("auto", "auto")])
def test_every_word_of_dino_cuda_graphs_is_taken(given, graphs):
    assert load_config("dino", "resmlp_s12", ["demo=false", f"dino.cuda_graphs={given}"]).dino.cuda_graphs == graphs


def test_every_word_of_demo_is_taken_and_the_config_keeps_the_decision():
    import torch
    no_gpu = not torch.cuda.is_available()
    for given, demo in (("true", True), ("True", True), ("false", False), ("auto", no_gpu)):
        cfg = load_config("dino", "resmlp_s12", [f"demo={given}"])
        assert cfg.demo is demo, given
        assert (cfg.model.dim == 64) is demo   # the recipe demo applied, or not
    assert load_config("dino", "resmlp_s12", []).demo is no_gpu   # dino.yaml's default is auto
    # a submission decides on the GPU nodes: auto is no demo here
    assert load_config("dino", "resmlp_s12", ["demo=auto", "launcher=slurm"]).demo is False
    assert load_config("knn", "resmlp_s12", ["checkpoint=x"]).demo is False   # defaults.yaml's false


@pytest.mark.parametrize("override, line", [
    ("demo=maybe", "demo=maybe is not allowed: demo must be one of auto, true, false"),
    ("demo=0", "demo=0 is not allowed: demo must be one of auto, true, false"),
    ("demo=null", "demo=null is not allowed: demo must be one of auto, true, false"),
    ("demo=[auto]", "demo=['auto'] is not allowed: demo must be one of auto, true, false, not a list"),
    ("dino.cuda_graphs=maybe", "dino.cuda_graphs=maybe is not allowed: dino.cuda_graphs must be one of auto, true, "
                               "false"),
    ("dino.cuda_graphs=0", "dino.cuda_graphs=0 is not allowed: dino.cuda_graphs must be one of auto, true, false"),
    ("dino.cuda_graphs=[true]", "dino.cuda_graphs=[True] is not allowed: dino.cuda_graphs must be one of auto, true, "
                                "false, not a list"),
    ("dino.cuda_graphs='true'", "dino.cuda_graphs='true' is text, not the flag true: write dino.cuda_graphs=true "
                                "without quotes"),
    ("compile=always", "compile=always is not allowed: compile must be one of auto, true, false, regions, whole"),
])
def test_a_bad_word_is_one_line_exit_2_and_nothing_is_made(override, line, tmp_path, monkeypatch, capsys):
    from resmlp.core import cli
    monkeypatch.chdir(tmp_path)   # runs/ would appear here if the command went on
    assert cli.main(["dino", "resmlp_s12", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {line}"]
    assert list(tmp_path.iterdir()) == []


def test_the_words_are_read_from_the_limits(tmp_path, monkeypatch):
    """With auto struck from both limits: lists, auto is refused everywhere, naming the words
    that are left: in load_config (demo before the merge, dino.cuda_graphs after it) and in
    the code handed a value (ssl.graphed_step.use_cuda_graphs)."""
    import shutil

    import torch

    from resmlp.core import config
    from resmlp.ssl.graphed_step import use_cuda_graphs
    configs = shutil.copytree(config.CONFIG_DIR, tmp_path / "configs")
    for name, key in (("defaults.yaml", "demo"), ("method/dino.yaml", "dino.cuda_graphs")):
        text = (configs / name).read_text()
        assert f"  {key}: [auto, true, false]" in text
        (configs / name).write_text(text.replace(f"  {key}: [auto, true, false]", f"  {key}: [true, false]"))
    monkeypatch.setattr(config, "CONFIG_DIR", configs)
    config.all_choices.cache_clear()
    try:
        with pytest.raises(UserError, match="^demo=auto is not allowed: demo must be one of true, false$"):
            load_config("dino", "resmlp_s12", [])   # dino.yaml's own default
        with pytest.raises(UserError, match="^dino.cuda_graphs=auto is not allowed: dino.cuda_graphs must be one of "
                                            "true, false$"):
            load_config("dino", "resmlp_s12", ["demo=false", "dino.cuda_graphs=auto"])
        with pytest.raises(UserError, match="must be one of true, false$"):
            use_cuda_graphs("auto", torch.device("cpu"), False)
    finally:
        config.all_choices.cache_clear()


# ---- the defaults: YAML their one home (issue 52 part 5) ----------------------------------------

# cfg.get("key", <literal>) calls that stay, each where the key may be absent: (file, key): why
MAY_BE_ABSENT = {
    ("data/datasets.py", "data.files"): "only data=folder's file has data.files",
    ("data/folder.py", "data.files"): "only data=folder's file has data.files",
}


def config_key_paths() -> set[str]:
    """Every key path of the merged configs ("data.root", "seed"): every command's, and DINO's
    on every data set (a data file sets data and model keys, the same for any command)."""
    from omegaconf import OmegaConf

    from resmlp.core.config import CONFIG_DIR, available

    def paths(tree: dict, prefix: str = "") -> set[str]:
        found = set()
        for k, v in tree.items():
            found.add(prefix + str(k))
            if isinstance(v, dict):
                found |= paths(v, f"{prefix}{k}.")
        return found
    commands = [p.stem for p in sorted((CONFIG_DIR / "method").glob("*.yaml"))]
    found = set()
    for command, data in [(c, None) for c in commands] + [("dino", d) for d in available("data")]:
        cfg = load_config(command, None, ["demo=false", *([f"data={data}"] if data else [])])
        found |= paths(OmegaConf.to_container(cfg, resolve=False))
    return found


def config_gets(source: str) -> list[tuple[int, str]]:
    """(line, key path) of each `<config>.get("key", <literal>)` in `source`, where <config>
    is `cfg` or a section of it (`cfg.dino`, `run.cfg.data`) or a name `<section>_cfg`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and _is_literal(node.args[1])):
            continue
        chain, value = [], node.func.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name):
            chain.insert(0, value.id)
        if "cfg" in chain:
            section = chain[chain.index("cfg") + 1:]
        elif chain and chain[0].endswith("_cfg"):
            section = [chain[0][:-len("_cfg")], *chain[1:]]
        else:
            continue
        found.append((node.lineno, ".".join([*section, node.args[0].value])))
    return found


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


def test_the_finder_sees_a_restated_default():
    src = ('a = cfg.get("seed", 0)\n'
           'b = cfg.dino.get("cuda_graphs", False)\n'
           'c = data_cfg.get("root", None)\n'
           'd = run.cfg.data.get("decode", "cpu")\n'
           'e = results.get("pixels", {})\n'          # not a config
           'f = cfg.get("eval", None) or {}\n'
           'g = cfg.data.get("subset")\n'              # no default restated
           'h = cfg.get("epochs", cfg.other)\n')       # not a literal
    assert config_gets(src) == [(1, "seed"), (2, "dino.cuda_graphs"), (3, "data.root"), (4, "data.decode"),
                                (6, "eval")]


def test_no_module_restates_a_default_of_the_yaml():
    """A key every command's merged config holds is read as an attribute: a default written
    again in code (`cfg.dino.get("cuda_graphs", False)`) is a second home, and may contradict
    YAML's (dino.yaml says auto). The few keys that may be absent are listed with the reason."""
    keys = config_key_paths()
    assert {"dino.cuda_graphs", "data.decode", "model.fused", "log_every_s"} <= keys
    found = [f"{path.relative_to(ROOT)}:{line} {key}" for folder in PACKAGE
             for path in sorted((ROOT / folder).rglob("*.py")) for line, key in config_gets(path.read_text())
             if key in keys and (str(path.relative_to(ROOT)), key) not in MAY_BE_ABSENT]
    assert not found, "read these keys as attributes (their default is YAML's):\n" + "\n".join(found)
    listed = {(str(path.relative_to(ROOT)), key) for folder in PACKAGE for path in sorted((ROOT / folder).rglob("*.py"))
              for _, key in config_gets(path.read_text())}
    assert set(MAY_BE_ABSENT) <= listed, "an entry of MAY_BE_ABSENT no longer stands in its file"
