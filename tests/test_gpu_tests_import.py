"""The GPU tests import on a machine without a GPU (where they are not collected): a renamed helper
otherwise breaks them unseen until the next GPU run, as it once did."""

import importlib.util
from pathlib import Path

import pytest

GPU_TESTS = sorted((Path(__file__).parent / "gpu").glob("test_*.py")) + sorted(
    (Path(__file__).parent / "gpu_multi").glob("test_*.py"))


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.stem)
def test_gpu_test_module_imports(path):
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert any(name.startswith("test_") for name in vars(module))
