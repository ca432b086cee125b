"""pyproject.toml declares what the package needs (compatible ranges, so that `pip install .`
gives a package that imports); requirements.txt pins what CI and run.sh install. The two
must agree: every package of one is in the other, and every exact pin lies in the range
declared for it (for the same platforms)."""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kit import PRODUCT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parent.parent


def pinned() -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def declared() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found: dict[str, list[Requirement]] = {}
    for spec in [*project["dependencies"], *(s for extra in project.get("optional-dependencies", {}).values()
                                             for s in extra)]:
        req = Requirement(spec)
        found.setdefault(canonicalize_name(req.name), []).append(req)
    return found


def exact_version(req: Requirement) -> str | None:
    pins = [s.version for s in req.specifier if s.operator == "=="]
    return pins[0] if len(pins) == 1 else None


def test_every_pinned_package_is_declared_in_a_range_that_holds_its_pin():
    ranges = declared()
    for req in pinned():
        name = canonicalize_name(req.name)
        assert name in ranges, f"requirements.txt installs {req.name}, which pyproject.toml does not declare"
        # the declarations that apply where this pin does: no marker, or the same marker
        fitting = [d for d in ranges[name] if d.marker is None or str(d.marker) == str(req.marker)]
        assert fitting, f"{req}: pyproject.toml declares {req.name} only for other platforms"
        version = exact_version(req)
        if version is not None:
            for d in fitting:
                assert d.specifier.contains(version, prereleases=True), \
                    f"requirements.txt pins {req.name}=={version} outside pyproject.toml's {d}"


def test_every_declared_package_is_installed_by_requirements():
    installed = {canonicalize_name(r.name) for r in pinned()}
    missing = sorted(set(declared()) - installed)
    assert not missing, f"pyproject.toml declares {missing}, which requirements.txt does not install (CI would not test it)"


def test_the_check_sees_a_pin_outside_its_range():
    assert not Requirement("torch>=2.9,<3").specifier.contains(exact_version(Requirement("torch==3.0.0")))
    assert Requirement("torch>=2.9,<3").specifier.contains(exact_version(Requirement("torch==2.9.1")))


def test_every_config_yaml_is_package_data_of_a_declared_package():
    """An installed copy finds its YAMLs (core/config.py reads them at resmlp/configs), and
    setuptools warns about no folder of them: each folder under configs/ is a package named
    in `packages`, and its package-data patterns take every YAML in it."""
    from fnmatch import fnmatch
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = {pkg: REPO / folder for pkg, folder in tool["package-dir"].items()}
    configs = package_dir["resmlp.configs"]
    yamls = sorted(configs.rglob("*.yaml"))
    assert yamls
    for path in yamls:
        package = ".".join(["resmlp.configs", *path.parent.relative_to(configs).parts])
        assert package in tool["packages"], f"{path.relative_to(REPO)}: add {package!r} to pyproject's packages"
        patterns = tool["package-data"].get(package, [])
        assert any(fnmatch(path.name, p) for p in patterns), \
            f"{path.relative_to(REPO)}: no package-data pattern of {package!r} takes it"


def test_the_measurement_harness_is_not_in_the_package():
    """tools/ (the bench and the campaign, their YAML and notes) holds tools of this repository:
    no package's folder holds it, and no YAML the wheel carries (configs/) configures it. The
    package's folders are the tests' PRODUCT."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tools = (REPO / "tools").resolve()
    assert (tools / "campaign" / "campaign.yaml").is_file() and (tools / "bench" / "bench.yaml").is_file()
    assert {f for f in tool["package-dir"].values() if f != "configs"} == set(PRODUCT) | {"models/kernels"}
    for folder in tool["package-dir"].values():
        d = (REPO / folder).resolve()
        assert d != tools and d not in tools.parents and tools not in d.parents, folder
    carried = sorted((REPO / "configs").rglob("*.yaml"))
    assert carried and not [p for p in carried if {"campaign", "bench", "profile"} & yaml_keys(p)], \
        "a configs/ YAML holds a tool's keys"


def yaml_keys(path: Path) -> set:
    import yaml
    return set(yaml.safe_load(path.read_text()) or {})


def test_a_built_wheel_holds_the_package_and_no_tool(tmp_path):
    """The wheel `pip install .` installs, built from a copy of the repository's package folders,
    configs and tools: every file is under resmlp/<a package folder> or its metadata, no module
    of the bench or the campaign, and every YAML of configs/ is in it."""
    import shutil
    import subprocess
    import sys
    import zipfile
    pytest.importorskip("setuptools", minversion="70.1")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in (*PRODUCT, "configs", "tools"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[1] for n in names if n.startswith("resmlp/")}
    assert tops == {*PRODUCT, "configs"}, tops
    assert all(n.startswith("resmlp/") or ".dist-info/" in n for n in names), names
    assert not [n for n in names if "bench" in n.split("/") or "campaign" in n.split("/")
                or n.rsplit("/", 1)[-1] in ("bench.yaml", "profile.yaml", "campaign.yaml")]
    yamls = {f"resmlp/configs/{p.relative_to(REPO / 'configs')}" for p in (REPO / "configs").rglob("*.yaml")}
    assert yamls <= set(names)
