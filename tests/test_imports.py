"""Every module of the project imports: a benchmark or tool run only by hand (`python -m
loadtests.bench_epp`, ...) is not exercised by the other tests, and a name removed elsewhere broke
one unseen (bench_epp imported a helper bench_gateway_overhead no longer had, 2026-12-06)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

from tests.conftest import REPO

PACKAGES = ("gateway", "replica_agent", "hashing", "policies", "loadtests")


def _modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        for info in pkgutil.walk_packages([str(REPO / pkg)], prefix=pkg + "."):
            names.append(info.name)
    return sorted(names)


def test_the_walk_finds_the_benchmarks():
    names = _modules()
    assert "loadtests.bench_epp" in names and "gateway.epp.picker" in names and len(names) > 100


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name):
    importlib.import_module(name)
