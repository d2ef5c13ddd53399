"""Graph surgery every backend uses: new initializers, typed ortlean nodes from the op schema, a
node taking over another's output, dropping weights (and their Transpose) nothing uses any more,
removing dead nodes."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from custom_ops import schema

_IR_ATTR = {"int": (ir.AttributeType.INT, int), "float": (ir.AttributeType.FLOAT, float),
            "string": (ir.AttributeType.STRING, str), "ints": (ir.AttributeType.INTS, lambda v: [int(x) for x in v]),
            "floats": (ir.AttributeType.FLOATS, lambda v: [float(x) for x in v])}


def safe_name(name: str) -> str:
    """A node name as a prefix for the names of the values a rewrite adds."""
    return name.strip("/").replace("/", ".") or "node"


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(array), name=name))
    graph.register_initializer(v)
    return v


def int64s(graph: ir.Graph, name: str, vals) -> ir.Value:
    """An int64 initializer (shapes, axes, indices)."""
    return initializer(graph, name, np.asarray(vals, np.int64))


class NodeBuilder:
    """Nodes of one (sub)graph in order, named ``prefix/name`` with outputs ``prefix/name_output_i``
    (named: they may go into an If branch, where unnamed values would collide)."""

    def __init__(self, prefix: str):
        self.nodes: list[ir.Node] = []
        self.prefix = prefix

    def __call__(self, op: str, inputs, name: str, attrs: dict | None = None, domain: str = "", n_out: int = 1):
        node = ir.Node(domain, op, inputs, attributes=[ir.convenience.convert_attribute(k, v)
                                                        for k, v in (attrs or {}).items()],
                       name=f"{self.prefix}/{name}", num_outputs=n_out)
        for i, o in enumerate(node.outputs):
            o.name = f"{self.prefix}/{name}_output_{i}"
        self.nodes.append(node)
        return node.outputs if n_out > 1 else node.outputs[0]


def op_attrs(op_type: str, values: dict) -> list[ir.Attr]:
    """Node attributes of an ortlean op, typed by its schema (a name the op does not have is a
    programming error: KeyError naming the op and its attributes)."""
    s = schema.get(op_type)
    out = []
    for k, v in values.items():
        t, cast = _IR_ATTR[s.attr(k).type]
        out.append(ir.Attr(k, t, cast(v)))
    return out


def op_node(op_type: str, inputs: list[ir.Value | None], attrs: dict, name: str, num_outputs: int = 1) -> ir.Node:
    """An ai.ortlean node (trailing absent optional inputs dropped)."""
    inputs = list(inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    return ir.Node(schema.DOMAIN, op_type, inputs, op_attrs(op_type, attrs), name=name, num_outputs=num_outputs)


def take_over(graph: ir.Graph, old: ir.Node, out_new: ir.Value) -> None:
    """`out_new` takes old's single output (name, type, shape, uses, graph-output slot); old is
    removed and its weight (input 1) dropped when nothing else uses it."""
    out_old = old.outputs[0]
    name = out_old.name
    out_new.type = out_old.type
    out_new.shape = out_old.shape
    out_old.replace_all_uses_with(out_new, replace_graph_outputs=True)
    weight_in = old.inputs[1]
    graph.remove(old, safe=True)
    out_new.name = name
    drop_if_unused(graph, weight_in)


def replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Put `new` where `old` was and give it old's output (see take_over)."""
    graph.insert_before(old, new)
    take_over(graph, old, new.outputs[0])


def drop_if_unused(graph: ir.Graph, v: ir.Value | None) -> None:
    """Remove the initializer `v` (or the node producing it, and so on upstream) when unused."""
    if v is None or v.uses() or v.is_graph_output():
        return
    prod = v.producer()
    if prod is not None:
        src = prod.inputs[0]
        graph.remove(prod, safe=True)
        drop_if_unused(graph, src)
    elif v.is_initializer() and v.name in graph.initializers and not v.is_graph_input():
        del graph.initializers[v.name]


def remove_dead(graph: ir.Graph) -> None:
    """Remove every node none of whose outputs is used or a graph output."""
    outs = set(id(o) for o in graph.outputs)
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph)):
            if all((not o.uses()) and id(o) not in outs for o in n.outputs):
                graph.remove(n, safe=True)
                changed = True
