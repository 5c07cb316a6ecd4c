"""Every benchmark script compiles: the benchmarks run on a GPU, where a syntax error would first
show after a machine was started for them."""

import py_compile
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_benchmarks():
    assert len(BENCHMARKS) > 10


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)
