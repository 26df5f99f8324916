"""The dependency versions CI tested (`mmvsd/constraints.txt`, shipped with the package) against those in use.

`constraints.txt` is the one record of what was tested: the README's install command installs through it,
`mmvsd --version` compares the environment with it, and docs/development.md says how to refresh it.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, metadata, requires, version
from pathlib import Path

from packaging.requirements import Requirement

import mmvsd

CONSTRAINTS = Path(__file__).with_name("constraints.txt")
KEY_PACKAGES = ("torch", "transformers", "accelerate")  # the ones whose behaviour mmvsd's results depend on


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503: case and runs of -_. do not matter)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def tested_versions(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, _, pinned = line.partition("==")
            pins[canonical(name.split("[", 1)[0])] = pinned.strip()
    return pins


def installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def public(text: str) -> str:
    """A version without its local label: torch 2.14.1+cpu is the release 2.14.1 as CI tested it."""
    return text.split("+", 1)[0]


def untested(packages: tuple[str, ...] = KEY_PACKAGES, pins: dict[str, str] | None = None) -> list[str]:
    """'torch 2.15.0 (tested: 2.14.1)' for each of `packages` installed at a version CI did not test."""
    pins = tested_versions() if pins is None else pins
    found = []
    for name in packages:
        have, tested = installed_version(name), pins.get(canonical(name))
        if have is not None and tested is not None and public(have) != public(tested):
            found.append(f"{name} {have} (tested: {tested})")
    return found


def version_report(pins: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(`mmvsd --version`'s lines, one warning line or None): mmvsd and the key packages in use, and which of
    them differ from what CI tested."""
    lines = [f"mmvsd {mmvsd.__version__}"]
    lines += [f"{name} {installed_version(name) or 'not installed'}" for name in KEY_PACKAGES]
    differ = untested(KEY_PACKAGES, pins)
    warning = None
    if differ:
        warning = (f"mmvsd: warning: untested versions: {', '.join(differ)}; the tested set is "
                   f"{CONSTRAINTS} (pip install -c it)")
    return "\n".join(lines), warning


MODULE_OF_DISTRIBUTION = {"scikit-image": "skimage"}  # where a distribution's import name is not its own name


def module_of(distribution: str) -> str:
    """The top-level import name of a distribution (canonical name)."""
    return MODULE_OF_DISTRIBUTION.get(distribution, distribution.replace("-", "_"))


def declared_requirements(distribution: str = "mmvsd") -> list[tuple[str, str | None]]:
    """(canonical name, the extra that asks for it or None for an unconditional one) per requirement of an
    installed distribution that applies to this Python and platform (markers evaluated: `cffi; os_name == "nt"`
    is no requirement on Linux); [] when it is not installed."""
    try:
        lines = requires(distribution) or []
        extras = metadata(distribution).get_all("Provides-Extra") or []
    except PackageNotFoundError:
        return []
    return [found for found in (requirement_of(line, extras) for line in lines) if found is not None]


def requirement_of(line: str, extras: list[str]) -> tuple[str, str | None] | None:
    """(canonical name, the first of `extras` that asks for it or None) of one requirement line of a
    distribution's metadata, or None where its marker holds for none of them on this Python and platform."""
    requirement = Requirement(line)
    marker = requirement.marker
    if marker is None or marker.evaluate({"extra": ""}):
        return canonical(requirement.name), None
    return next(((canonical(requirement.name), extra) for extra in extras if marker.evaluate({"extra": extra})), None)


def extra_providing(module: str) -> str | None:
    """The extra of mmvsd (`pip install 'mmvsd[EXTRA]'`) whose packages provide the top-level `module`, read
    from the installed mmvsd's metadata (so pyproject.toml is the one list), or None."""
    return next((extra for name, extra in declared_requirements() if extra and module_of(name) == module), None)


def missing_package_message(err: ModuleNotFoundError) -> str | None:
    """One line for a command that needs a package of an extra that is not installed (None for other errors)."""
    module = (err.name or "").split(".", 1)[0]
    extra = extra_providing(module)
    if extra is None:
        return None
    return f"this needs the `{module}` package, which is not installed: pip install 'mmvsd[{extra}]'"
