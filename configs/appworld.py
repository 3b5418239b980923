"""appworld with the paper's settings: `--config=configs/appworld.py:<method>` (default cope).

The policy is Qwen2.5-14B-Instruct (HF or converted Orbax directory): pass `--config.model.path=DIR`.
Methods: grpo, cope, cope_k0, sft_success, echo, rft, progpo, cope+progpo.
"""
from configs._paper import paper_config


def get_config(method: str = "cope"):
    return paper_config("appworld", method)
