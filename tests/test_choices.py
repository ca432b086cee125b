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

from resmlp.core.config import Choice, all_choices, check_choice, choices
from resmlp.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ("core", "models", "data", "ssl", "eval", "supervised", "bench")


def repeated_words(source: str, lists: dict) -> list[tuple[int, str]]:
    """(line, key) for each literal in `source` that repeats one of `lists` ({key: words})."""
    sets = {}
    for key, words in lists.items():
        strings = frozenset(w for w in words if isinstance(w, str))
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
    lists = {"precision": ("auto", "bf16", "fp16", "fp32"), "export.format": ("timm", "official", "safetensors")}
    src = ('A = ("bf16", "fp16", "fp32")\n'
           'B = ["safetensors", "official", "timm"]\n'
           'if fmt in ("timm", "official"): pass\n'
           'T = {"bf16": 1, "fp16": 2, "fp32": 3}\n')
    assert repeated_words(src, lists) == [(1, "precision"), (2, "export.format")]


def test_no_module_repeats_a_keys_words():
    lists = all_choices()
    assert {"device", "precision", "launcher", "slurm.cluster", "data.decode", "knn.backend", "features.key",
            "export.format", "linear.mode", "distill.type", "eval.data", "campaign.stages", "dino.local_crops",
            "dino.augment", "dino.bottleneck_norm", "bench.profile"} <= lists.keys()
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
