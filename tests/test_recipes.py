"""Recipes: named sets of values in configs/recipe/ (issue 45, part 3). The CPU demo is the
recipe `demo` (configs/recipe/demo.yaml and its folder), merged when the demo applies; a
recipe can be named on the command line (recipe=<name>, recipe=none); `run.sh help` lists
them; config.yaml keeps the list of those applied."""
import functools

import pytest
from omegaconf import OmegaConf

from resmlp.core import cli
from resmlp.core.config import CONFIG_DIR, available, load_config, recipe_files, recipes
from resmlp.core.errors import UserError

# The CPU demo as it was before it became a recipe file: the `demo_overrides` lists of
# configs/method/{dino,supervised,finetune,compare}.yaml and the `demo_data_overrides` of
# configs/data/{folder,imagefolder}.yaml at c11c829 (`git show c11c829:configs/method/dino.yaml`),
# copied here unchanged. load_config merged a command's list (or that of the method it extends:
# data took dino's, distill supervised's) after what a checkpoint carries over, then the data
# file's where no saved run was given, then the command line; the lists below are given at
# that place, on the command line, to rebuild the old config.
OLD_DEMO = {
    "dino": ["model.dim=64", "model.depth=4", "model.drop_path_rate=0.0", "data.subset=5000",
             "epochs=8", "batch_size=64", "optim.lr=0.064", "dino.momentum_teacher=0.99",
             "dino.out_dim=2048", "dino.hidden_dim=256", "dino.bottleneck_dim=64",
             "dino.n_local_crops=4", "optim.warmup_epochs=1", "eval_every=0", "num_workers=0",
             "dino.centering=sinkhorn", "dino.koleo_weight=0.1", "dino.head_warmup_epochs=0",
             "dino.init_lr_scale=1"],
    "supervised": ["model.dim=64", "model.depth=4", "model.drop_path_rate=0.0", "data.subset=5000",
                   "epochs=5", "batch_size=64", "optim.warmup_epochs=1", "eval_every=0", "num_workers=2",
                   "optim.lr=2.0e-2", "optim.lr_batch=64", "optim.weight_decay=0.05", "aug.scale=[0.35,1.0]",
                   "aug.auto_augment=null", "aug.mixup=0.0", "aug.cutmix=0.0"],
    "finetune": ["epochs=5", "batch_size=64", "optim.warmup_epochs=1", "eval_every=0", "num_workers=2",
                 "optim.lr=2.0e-2", "optim.lr_batch=64", "aug.scale=[0.35,1.0]", "aug.auto_augment=null",
                 "aug.mixup=0.0", "aug.cutmix=0.0"],
    "compare": ["model.dim=64", "model.depth=4", "data.subset=5000", "batch_size=64", "num_workers=2",
                "compare.epochs.teacher=5", "compare.epochs.supervised=5", "compare.epochs.distill=5",
                "compare.epochs.dino=8", "compare.epochs.linear=100", "compare.epochs.finetune=5",
                "compare.linear_mode=cached"],
}
OLD_DEMO_INHERITED = {"data": "dino", "distill": "supervised", "knn": None}   # through `extends:`; knn had none
OLD_DATA = {d: ["data.img_size=32", "data.local_size=16", "model.patch_size=4", "data.crop_ratio=1.0"]
            for d in ("folder", "imagefolder")}

TRAINS = ("dino", "data", "supervised", "distill", "compare")   # the network starts here
READS = ("finetune", "knn")                                     # from a checkpoint (a saved run's config)


def _old_list(command: str) -> list[str]:
    name = OLD_DEMO_INHERITED.get(command, command)
    return OLD_DEMO.get(name, []) if name else []


def _plain(cfg) -> dict:
    out = OmegaConf.to_container(cfg)
    out.pop("recipe")
    out.pop("demo")
    return out


def _pairs():
    for data in available("data"):
        for command in TRAINS:
            yield command, data, "none"
            if command != "data" and command != "compare":
                yield command, data, "data"    # compare's paths: its data section as their saved run
        for command in READS:
            yield command, data, "saved"
            yield command, data, "none"


@functools.lru_cache(maxsize=None)
def _saved_run(data: str) -> dict:
    """The config a DINO run on `data` saves, as a checkpoint hands it to an evaluator."""
    return OmegaConf.to_container(load_config("dino", "resmlp_s24", [f"data={data}", "data.root=/x", "model.dim=96",
                                                                       "demo=false"]))


@pytest.mark.parametrize("command", [*TRAINS, *READS])
def test_the_demo_recipe_builds_the_config_the_old_lists_built(command):
    """For every data set and every way a command is started, demo=true gives the config the
    old demo_overrides (and demo_data_overrides) gave, every key of it."""
    checked = 0
    for cmd, data, how in _pairs():
        if cmd != command:
            continue
        base = {"none": None, "saved": _saved_run(data), "data": {"data": _saved_run(data)["data"]}}[how]
        model, given = ("resmlp_s12", []) if command in TRAINS else (None, ["checkpoint=x"])
        given += [f"data={data}", "data.root=/x"]
        new = load_config(command, model, [*given, "demo=true"], base=base)
        old = load_config(command, model, [*given, "demo=false", *_old_list(command),
                                           *(OLD_DATA.get(data, []) if base is None else [])], base=base)
        assert new.demo is True and old.demo is False
        assert _plain(new) == _plain(old), (command, data, how)
        assert list(new.recipe) == [*old.recipe, "demo"]
        checked += 1
    assert checked >= 7


def test_the_demo_is_files_in_configs_recipe_and_no_list_of_overrides():
    for path in [CONFIG_DIR / "defaults.yaml", *CONFIG_DIR.glob("*/*.yaml")]:
        assert "demo_overrides" not in path.read_text(), path
    with pytest.raises(UserError, match="unknown config key 'demo_overrides'"):
        load_config("dino", "resmlp_s12", ["demo_overrides=[epochs=1]"])
    files = recipe_files("demo", "distill", "folder")   # distill extends supervised
    assert [str(p.relative_to(CONFIG_DIR)) for p in files] == [
        "recipe/demo.yaml", "recipe/demo/method/supervised.yaml", "recipe/demo/data/folder.yaml"]
    # a command that reads a saved run keeps its model and data: no data layer
    assert [p.name for p in recipe_files("demo", "finetune", "folder", network_here=False)] == ["demo.yaml",
                                                                                                 "finetune.yaml"]


def test_the_automatic_recipe_a_named_one_and_none(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # demo=auto: no demo on a GPU
    cfg = load_config("dino", "resmlp_s12", [])
    assert list(cfg.recipe) == ["dino_fashion_mnist"] and cfg.demo is False and cfg.optim.lr == 0.002
    cfg = load_config("dino", "resmlp_s12", ["recipe=none"])                  # dino.yaml's own values
    assert list(cfg.recipe) == [] and cfg.optim.lr == 0.0005 and cfg.epochs == 100
    cfg = load_config("dino", "resmlp_s12", ["recipe=demo"])                  # the demo on a GPU machine
    assert list(cfg.recipe) == ["demo"] and cfg.demo is True and cfg.model.dim == 64 and cfg.optim.lr == 0.064
    cfg = load_config("dino", "resmlp_s12", ["recipe=dino_imagenet", "epochs=2"])  # another's, the command line wins
    assert list(cfg.recipe) == ["dino_imagenet"] and cfg.dino.teacher_temp == 0.07 and cfg.epochs == 2
    cfg = load_config("dino", "resmlp_s12", ["recipe=[dino_imagenet,demo]"])    # a list, in its order
    assert list(cfg.recipe) == ["dino_imagenet", "demo"] and cfg.dino.teacher_temp == 0.07 and cfg.epochs == 8
    # config.yaml keeps the list applied; given again, it builds the same config
    again = load_config("dino", "resmlp_s12", [f"recipe=[{','.join(cfg.recipe)}]"])
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
    cfg = load_config("dino", "resmlp_s12", ["data=imagenet", "data.root=/x", "demo=true"])
    assert list(cfg.recipe) == ["dino_imagenet", "demo"] and cfg.dino.teacher_temp == 0.07 and cfg.epochs == 8


def test_a_recipe_value_the_default_or_the_command_line_is_named_in_messages():
    with pytest.raises(UserError, match=r"^optim.lr='abc' should be a number \(the recipe dino_fashion_mnist "
                                        r"sets optim.lr=0.002 in configs/recipe/dino_fashion_mnist.yaml\)$"):
        load_config("dino", "resmlp_s12", ["demo=false", "optim.lr=abc"])
    with pytest.raises(UserError, match=r"^optim.lr='abc' should be a number \(the default is 0.0005\)$"):
        load_config("dino", "resmlp_s12", ["demo=false", "recipe=none", "optim.lr=abc"])


@pytest.mark.parametrize("given, line", [
    ("recipe=nope", "recipe=nope: no such recipe; choose auto, none, or one (or a list) of: {} (the files in "
                    "configs/recipe/)"),
    ("recipe=[demo,nope]", "recipe=['demo', 'nope']: no such recipe; choose auto, none, or one (or a list) of: {} "
                           "(the files in configs/recipe/)"),
    ("recipe=supervised_imagenet", "recipe supervised_imagenet (configs/recipe/supervised_imagenet.yaml) for dino: "
                                   "unknown config key 'aug.repeats'"),
])
def test_a_bad_recipe_is_one_line_exit_2_and_nothing_is_made(given, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["dino", "resmlp_s12", given]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: " + line.format(", ".join(available("recipe")))]
    assert list(tmp_path.iterdir()) == []


def test_help_lists_every_recipe_with_its_first_comment_line(capsys):
    assert cli.main(["help"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line.split(None, 1)[1] for line in out
              if line.startswith("  ") and line.split()[0] in available("recipe")}
    assert set(listed) == set(available("recipe")) >= {"demo", "dino_fashion_mnist", "dino_imagenet"}
    for name, what in listed.items():
        first = (CONFIG_DIR / "recipe" / f"{name}.yaml").read_text().splitlines()[0]
        assert first == f"# {what}" and what == recipes()[name]


@pytest.mark.parametrize("name", sorted(set(available("recipe")) - {"demo"}))
def test_every_recipe_loads_for_its_command_and_data(name):
    """<command>_<data>: every key it sets is one its command has, and it applies by itself."""
    command, data = next((c, name[len(c) + 1:]) for c in cli.COMMANDS if name.startswith(c + "_"))
    given = [f"data={data}", "data.root=/x", "demo=false", *([] if command in TRAINS else ["checkpoint=x"])]
    assert list(load_config(command, None, given).recipe) == [name]
