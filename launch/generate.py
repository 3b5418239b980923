"""python -m launch.generate --model=DIR --prompt="..." [--chat] [sampling flags]

Loads an HF or Orbax model directory, encodes the prompt (or takes --prompt_ids), generates with
`cope_jax.rollout.sampler.Sampler` and prints one JSON line per sample: ids, text, finish reason, token
count and the summed policy logprob.

The tokenizer is --tokenizer ('qwen2.5' / 'qwen3' built-in BPE, an HF tokenizer directory or a
SentencePiece .model file) or, by default, the one stored in the model directory. --chat wraps the
prompt as a user turn of the Qwen chat format and ends generation at <|im_end|>.
"""
from __future__ import annotations

import json
import os

from absl import flags

from launch import cli
from models.config import ConfigError

flags.DEFINE_string("model", None, "Model directory: HF (config.json + safetensors) or Orbax (params/).")
flags.DEFINE_string("prompt", None, "Prompt text.")
flags.DEFINE_list("prompt_ids", None, "Prompt as comma-separated token ids (instead of --prompt).")
flags.DEFINE_bool("chat", False, "Render the prompt as a user turn of the chat format, plus the assistant header.")
flags.DEFINE_string("system", None, "System message for --chat (default: the chat style's).")
flags.DEFINE_string("chat_style", None, "Chat style (qwen2.5, qwen3, qwen3_no_think, plain); default from the model family.")
flags.DEFINE_string("tokenizer", None, "Tokenizer spec; default: the model directory's tokenizer files.")
flags.DEFINE_integer("max_new_tokens", 128, "Most tokens generated per sample.", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1] (1 = off).")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).", lower_bound=0)
flags.DEFINE_bool("greedy", False, "Greedy decoding (ignores temperature, top_p, top_k).")
flags.DEFINE_integer("num_samples", 1, "Samples of the same prompt, generated as one batch.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
flags.DEFINE_list("stop", [], "Stop strings; each is encoded to a stop token sequence.")
flags.DEFINE_string("dtype", None, "Compute/storage dtype (default: the checkpoint's).")
flags.register_validator("top_p", lambda v: 0.0 < v <= 1.0, message="--top_p must be in (0, 1]")
flags.register_validator("model", lambda v: v is None or os.path.isdir(v),
                         message="--model must be an existing model directory")
flags.mark_flag_as_required("model")
flags.mark_flags_as_mutual_exclusive(["prompt", "prompt_ids"], required=True)
FLAGS = flags.FLAGS

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_STYLE_BY_FAMILY = {"qwen2": "qwen2.5", "qwen3": "qwen3"}


def _tokenizer(spec: str | None, model_dir: str):
    from cope_jax.rollout.tokenizer import load_tokenizer

    if spec is None and any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        spec = model_dir
    return None if spec is None else load_tokenizer(spec)


def _prompt_ids(tok, cfg) -> list[int]:
    if FLAGS.prompt_ids is not None:
        try:
            ids = [int(x) for x in FLAGS.prompt_ids]
        except ValueError:
            raise ConfigError(f"--prompt_ids must be comma-separated integers, got {','.join(FLAGS.prompt_ids)!r}")
        if FLAGS.chat:
            raise ConfigError("--chat needs a text --prompt, not --prompt_ids")
        return ids
    if tok is None:
        raise ConfigError(f"--prompt is text but {FLAGS.model} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                         "pass --tokenizer (e.g. qwen2.5) or --prompt_ids")
    if not FLAGS.chat:
        return tok.encode(FLAGS.prompt)
    from cope_jax.rollout.chat import ChatFormat

    chat = ChatFormat(tok, FLAGS.chat_style or _STYLE_BY_FAMILY[cfg.family])
    messages = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system is not None else [])
    return chat.render(messages + [{"role": "user", "content": FLAGS.prompt}], add_generation_prompt=True)


def generate() -> list[dict]:
    import models
    from cope_jax.rollout.sampler import Sampler

    # everything about the request is checked before the (slow) weight loading
    cfg = models.QwenConfig.from_hf_dir(FLAGS.model)
    tok = _tokenizer(FLAGS.tokenizer, FLAGS.model)
    prompt = _prompt_ids(tok, cfg)
    if not prompt:
        raise ConfigError("the prompt encodes to no tokens")
    if FLAGS.stop and tok is None:
        raise ConfigError("--stop strings need a tokenizer")
    context = cfg.max_position_embeddings
    if len(prompt) + FLAGS.max_new_tokens > context:
        raise ConfigError(f"the prompt ({len(prompt)} tokens) plus --max_new_tokens={FLAGS.max_new_tokens} exceeds "
                         f"the model's context of {context} tokens"
                         + (f"; use --max_new_tokens<={context - len(prompt)}" if len(prompt) < context else ""))
    stops = [tok.encode(s) for s in FLAGS.stop]
    eos = set(tok.eos_ids if tok is not None else ())
    cfg_eos = cfg.eos_token_id
    eos |= set([] if cfg_eos is None else [cfg_eos] if isinstance(cfg_eos, int) else cfg_eos)
    model, cfg = models.load_model(FLAGS.model, dtype=FLAGS.dtype)
    n = FLAGS.num_samples
    sampler = Sampler(model, batch_size=n, max_len=len(prompt) + FLAGS.max_new_tokens, eos_ids=sorted(eos))
    state = sampler.start([prompt] * n)
    out = sampler.generate(state, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                           top_p=FLAGS.top_p, top_k=FLAGS.top_k, greedy=FLAGS.greedy, stop_sequences=stops,
                           key=FLAGS.seed)
    return [dict(sample=i, prompt_tokens=len(prompt), ids=out.tokens[i].tolist(),
                 text=None if tok is None else tok.decode(out.tokens[i].tolist()),
                 finish_reason=out.finish_reasons[i], num_tokens=len(out.tokens[i]),
                 logprob=round(float(out.logprobs[i].sum()), 4)) for i in range(n)]


def main(argv):
    cli.start(argv)
    for line in generate():
        print(json.dumps(line, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    cli.run(main)
