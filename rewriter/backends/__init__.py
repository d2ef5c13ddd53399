"""The backends of `ortlean rewrite`, one module each holding only its face: its flags (a
``Config`` dataclass of ``kit.options.flag`` fields), its planner and its emitter. The contract
they implement is ``kit.backend`` (``WeightBackend`` / ``GraphPass``); the offline math they build
from is in ``builders/``; their ops' interfaces are ``custom_ops/schema.py``.

The registry is the two lists below. Weight backends are tried in list order per layer and the
first whose plan is not "dense" takes it, so a backend that only makes sense on a layer another
left dense (gating) comes later. Graph passes run at their ``stage``: "pre" passes before the
candidates are searched, "post" passes after the weight backends emitted, in list order.

Adding a weight backend "foo" with op FooMatMul (DEVELOPERS.md, "Adding a backend", lists the
C++ side too):
1. ``custom_ops/schema.py``: an ``OpSchema("FooMatMul", …)`` (ports, attributes, defaults, valid
   values, ``reference="custom_ops.reference.foo:op"``);
2. ``custom_ops/reference/foo.py``: the numpy reference ``op(x, …, **attrs)`` (the op's meaning);
3. ``rewriter/builders/foo.py``: the offline math (weights + Gram → stored layer);
4. ``rewriter/backends/foo.py``: ``FooConfig`` (flag fields, validate) and ``FooBackend(WeightBackendBase)``
   with name, op_type, title, ``plan`` and ``emit`` (``kit.surgery.op_node`` types the attributes
   from the schema; ``kit.timing`` times the op against dense);
5. here: append ``FooBackend`` to ``WEIGHT_BACKENDS``.
The CLI flags, calibration, the quality guard, the report, the reference backend
(``custom_ops.session(..., backend="reference")``) and `ortlean inspect` need nothing more.
"""
from __future__ import annotations

from .fuse import FusePass
from .gating import GatingBackend
from .head import CheapHeadPass
from .packed_attention import ExactAttentionPass, PackedAttentionPass
from .procsparse import ProcBackend
from .tt import TTBackend
from .weights import WeightsBackend, WeightsGluPass, WeightsPackPass

# WeightsBackend (--weights int8|int4) stays last: it takes exactly the layers the others left dense
WEIGHT_BACKENDS: list = [TTBackend, ProcBackend, GatingBackend, WeightsBackend]
# ExactAttentionPass last: it changes the KV-cache state (past_key_values.N.kv / .key_bits), and the passes
# before it calibrate on the model's original cache I/O (CheapHeadPass)
GRAPH_PASSES: list = [FusePass, PackedAttentionPass, CheapHeadPass, WeightsPackPass, WeightsGluPass, ExactAttentionPass]


def all_backends() -> list:
    """Every registered backend class, in flag order."""
    return WEIGHT_BACKENDS + GRAPH_PASSES
