"""ortlean rewriter: finds weight MatMuls in an ONNX model, plans a backend per layer from
calibration data, emits ortlean custom ops (domain ai.ortlean) and reports every decision."""
from custom_ops.schema import DOMAIN

from .errors import OrtleanError

__version__ = "0.1.0"
__all__ = ["OrtleanError", "DOMAIN", "__version__"]
