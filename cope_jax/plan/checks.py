"""Silent waste in a run's layout, said out loud: work computed on several chips that could have
been split, and weights kept whole where a mesh axis was meant to split them."""
from __future__ import annotations

import ml_collections

from cope_jax.run import run_config
from cope_jax.plan.programs import Layout
from models import qwen
from models import sharding as shd
from models.config import QwenConfig


def layout_warnings(c: ml_collections.ConfigDict, model_cfg: QwenConfig, layout: Layout) -> list[str]:
    out = []
    out += _rows("train.rows_per_micro", layout.rows_per_micro, layout.mesh)
    out += _rows("rollout.sampler_rows (per host)", run_config.sampler_rows(c, layout.hosts), layout.host_mesh)
    out += _unsplit_params(model_cfg, layout.mesh)
    return out


def _rows(what: str, rows: int, mesh) -> list[str]:
    """Rows on the batch axes (data x fsdp): a width that does not divide them is dropped, and the
    rows are computed on every chip of the dropped axes."""
    if mesh is None:
        return []
    width = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    spec = shd.logical_to_spec(("batch",), (rows,), mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    split = 1
    for a in axes:
        split *= mesh.shape[a]
    if split == width:
        return []
    return [f"{what}={rows} is not a multiple of data x fsdp = {width}: the rows are split over {split} of "
            f"{width} chips, each computed on {width // split} (use a multiple of {width})"]


def _unsplit_params(cfg: QwenConfig, mesh) -> list[str]:
    """Parameter dimensions a mesh axis was meant to split but does not divide (kept whole)."""
    if mesh is None:
        return []
    out = []
    for name, shape in qwen.param_shapes(cfg).items():
        axes = qwen.PARAM_AXES[name]
        spec = shd.logical_to_spec(axes, shape, mesh)
        used = {a for s in spec if s for a in ((s,) if isinstance(s, str) else s)}
        for logical, dim in zip(axes, shape):
            missed = [a for a in shd.LOGICAL_RULES[logical] if mesh.shape.get(a, 1) > 1 and a not in used]
            if missed:
                sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in missed)
                out.append(f"{name}: {logical} ({dim}) is not split over {sizes} (it does not divide): "
                           "each chip of that axis holds it whole")
    return out
