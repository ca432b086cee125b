"""pyproject.toml declares what the package needs (compatible ranges, so that `pip install .`
gives a package that imports); requirements.txt pins what CI and run.sh install. The two
must agree: every package of one is in the other, and every exact pin lies in the range
declared for it (for the same platforms)."""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
