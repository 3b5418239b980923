"""webshop with the paper's settings: `--config=configs/webshop.py:<method>` (default cope).

The policy is Qwen2.5-7B-Instruct (HF or converted Orbax directory): pass `--config.model.path=DIR`.
Methods: grpo, cope, cope_k0, sft_success, echo, rft, progpo, cope+progpo.
"""
from configs._paper import paper_config


def get_config(method: str = "cope"):
    return paper_config("webshop", method)
