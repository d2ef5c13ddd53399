"""The rewriter's bottom layer: what the pipeline and every backend share. It imports no backend
and not the pipeline.

- ``backend``: the backend contract (``WeightBackend`` / ``GraphPass`` protocols with their base
  classes), ``Plan``, the typed per-rewrite ``Context``;
- ``options``: flags declared once as config fields (``flag``), ``onoff``, ``parse_targets``, the
  shared ``StatePack`` group, ``RewriteConfig``;
- ``modelfile``: loading, atomic saving, sidecars, ``ModelIO`` of a loaded model;
- ``candidates``: the weight MatMuls a backend may take (classified mlp | attn | head), groups;
- ``surgery``: graph edits (replace a node, drop dead weights, typed op nodes from the op schema);
- ``gaps``: the relative output errors every planner measures on calibration inputs;
- ``calib``: the calibration text (tokenized once) and the Gram matrices XᵀX;
- ``quality``: the end-to-end quality probe and in-memory trial models (one per rewrite);
- ``timing``: one-op timing models against dense MatMul, cached per CPU and library build.
"""
