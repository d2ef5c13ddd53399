"""``--fuse=auto|on|off``: the "pre" graph pass that rewrites an optimum decoder export (Llama,
Qwen2, Mistral, Phi-3, Gemma 2, Gemma 3 …) into ONNX Runtime's fused contrib ops (``rewriter.fuse``:
GroupQueryAttention with rotary inside, its sliding window and soft-cap, packed QKV,
SkipSimplifiedLayerNormalization, the shape subgraphs gone) before anything else.

``auto`` (the default) fuses every decoder the pass can fuse; on any other input (an encoder, a
decoder whose attention does not match, a graph already fused) the report says why in one line
and the rewrite goes on unfused. ``on`` asks for the fusion: an input it cannot fuse is an error
naming the node and the reason. ``off`` skips it. The rotary caches keep ``max_position_embeddings``
rows when a ``config.json`` sits next to the model (as the genai builder does; 131072 otherwise)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OrtleanError
from ..kit import modelfile
from ..kit.backend import GraphPassBase
from ..kit.options import Options, flag, from_args

FUSE_MODES = ("auto", "on", "off")


@dataclass
class FuseConfig(Options):
    mode: str = flag("--fuse", "auto", "fuse an optimum decoder into ONNX Runtime's GroupQueryAttention / "
                     "SkipSimplifiedLayerNormalization graph first: auto (default: when it can, else a report line) | "
                     "on (an input it cannot fuse is an error) | off", choices=FUSE_MODES)
    enabled: bool = True
    targets: tuple = ()

    @property
    def explicit(self) -> bool:
        """The user asked for the fusion (--fuse=on)."""
        return self.mode == "on"


class FusePass(GraphPassBase):
    name = "fuse"
    stage = "pre"
    Config = FuseConfig
    title = "fusion into ONNX Runtime's fast ops (decoders)"

    @classmethod
    def config(cls, args, state_pack) -> FuseConfig:
        cfg = from_args(FuseConfig, args)
        cfg.enabled = cfg.mode != "off"
        return cfg

    def _skip(self, why: str) -> list[dict]:
        if self.cfg.explicit:
            raise OrtleanError(f"--fuse=on: {why}")
        return [{"layer": "decoder", "backend": "dense", "decision": f"kept unfused: {why}"}]

    def run(self, model, ctx) -> list[dict]:
        from ..fuse import FuseError, fuse_decoder, is_fused

        if ctx.io is None or ctx.io.kind != "causal-lm" or not ctx.io.has_past:
            return self._skip("not a decoder with a KV cache (the fusion is for text-generation-with-past exports)")
        if is_fused(model):
            return self._skip("already fused (GroupQueryAttention present)")
        pa = ctx.opts.backends.get("packed_attention")
        if pa is not None and getattr(pa, "enabled", False) and getattr(pa, "needs_unfused", False):
            # eps-mode key bits calibrate eps per head on the unfused core's keys (apply_gqa has no per-head eps)
            return self._skip("--state-pack eps-mode key bits without --state-pack-eps calibrate eps per head on the "
                              "unfused attention core (give --state-pack-eps E to fuse)")
        try:
            fused, rep = fuse_decoder(model, max_positions=modelfile.max_positions(ctx.model_path))
        except FuseError as e:
            return self._skip(str(e).removeprefix("fuse: "))
        # the pipeline holds `model` (ctx.model is the same object): take over the fused graph in place
        model.graph = fused.graph
        model._functions = fused._functions
        return [{"layer": "decoder", "backend": "fuse", "decision": rep.summary()}]
