import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory) -> Path:
    import toy

    return toy.build(tmp_path_factory.mktemp("toy") / "model.onnx")


@pytest.fixture(scope="session")
def toy_text(tmp_path_factory) -> Path:
    import toy

    p = tmp_path_factory.mktemp("text") / "calib.txt"
    p.write_text(toy.text(3000))
    return p


def native_available() -> bool:
    try:
        import custom_ops

        custom_ops.load_library()
        return True
    except Exception:
        return False


requires_native = pytest.mark.skipif(not native_available() and not os.environ.get("CI"),
                                     reason="ortlean library not built (pip install -e .)")
