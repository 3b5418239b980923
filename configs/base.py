"""The paper's settings (Tables 9-11, method §2-5), shared by every environment config.

A config file `configs/<env>.py` exposes `get_config(method)`, so each (environment, method) pair is
one addressable config: `--config=configs/sciworld.py:cope`. Fields can be overridden on the command
line (`--config.train.learning_rate=3e-6`).
"""
from __future__ import annotations

import ml_collections
from ml_collections import config_dict

METHODS = ("grpo", "cope", "cope_k0", "sft_success", "echo", "rft", "progpo", "cope+progpo")


def base_config(method: str = "cope") -> ml_collections.ConfigDict:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    c = ml_collections.ConfigDict()
    c.method = method
    c.seed = 0

    # the policy: an HF or Orbax directory, or `init='random'` with the architecture below
    c.model = ml_collections.ConfigDict(dict(
        path="",  # HF or Orbax directory (e.g. a converted Qwen2.5-7B-Instruct)
        init="pretrained",  # 'pretrained' (load `path`) | 'random'
        # init='random': a named architecture (models/presets.py) instead of the fields below;
        # `launch.plan` also plans it when `path` is empty
        preset="",
        dtype="bfloat16", param_dtype="float32", scan_layers=True, remat="dots",
        # models/attention.py: 'auto' (dense for short rows and decode steps, blockwise otherwise),
        # 'dense' or 'blockwise'; attention_block: tokens per block
        attention="auto", attention_block=512,
        # architecture, used only when init='random'
        family="qwen3", vocab_size=0, hidden_size=0, intermediate_size=0, num_layers=0,
        num_heads=0, num_kv_heads=0, head_dim=0, tie_word_embeddings=True, rope_theta=1e6,
    ))
    c.tokenizer = "qwen2.5"  # 'qwen2.5' | 'qwen3' | an HF tokenizer dir | a SentencePiece .model | 'model'
    c.chat_style = "qwen2.5"  # cope_jax/rollout/chat.py STYLES
    c.mesh = (1, -1, 1)  # (data, fsdp, tp) over every host's devices; -1 = all remaining devices

    c.env = ml_collections.ConfigDict(dict(
        family="", workers=8, train_split="train", eval_split="test",  # workers: per host
        # environment instances per worker process; 0 = enough for every sampler row to hold a live
        # episode (ceil(sampler_rows / workers)). Each ScienceWorld instance is its own JVM (~0.3 GB)
        envs_per_worker=0,
        max_rounds_train=20, max_rounds_eval=30, call_timeout=0.0,  # 0: the family's default
        # an episode lost to its worker (the process died or hung) is played again from its start
        # up to this many times before it counts as a fault (cope_jax/rollout/runner.py)
        max_replays=2,
        # tau2's simulated customer (envs/tau2_users.py); '' for families without one. 'llm': tau2's
        # user simulator generating at `base_url` (any OpenAI-compatible /v1 endpoint) with `model`
        # at `temperature`, the key read from the variable `api_key_env` ('' = none), each call
        # given up after `timeout` s and within the step's deadline (env.call_timeout); 'gold': the
        # task's scripted gold customer (tests: it ends retail / airline episodes early)
        user=ml_collections.ConfigDict(dict(kind="", base_url="", model="", temperature=0.7,
                                            api_key_env="", timeout=60.0)),
    ))
    c.rollout = ml_collections.ConfigDict(dict(
        tasks_per_step=16, group_size=8,  # train batch (all hosts together): 16 tasks x 8 rollouts
        max_turn_tokens=512, temperature=1.0, top_p=1.0, top_k=0,
        max_len=16384,  # tokens per episode (Table 9 "maximum model length")
        # Tables 9-11's maximum prompt / response length (0: off); an episode past either ends as
        # context_full, a failure (cope_jax/rollout/runner.py)
        max_prompt_len=0, max_response_len=0,
        # concurrent episodes in each host's sampler; 0: the host's share of a step's episodes
        # (tasks_per_step x group_size / hosts): more rows than that hold KV cache no step fills
        sampler_rows=0,
        sync=False,  # lockstep rounds: bit-reproducible rollouts, no env/decode overlap
        stream_every=16,  # decode steps between hand-offs of finished turns to their environments
        prefetch_resets=True,  # reset the next step's environments during this step's rollout and update
        # episodes ended by environment faults (crash, hang, exception) leave the batch; a step or an
        # evaluation where more than this fraction of its episodes faulted stops the run instead
        max_fault_fraction=0.25,
        # partial rollouts (docs/training.md): `groups_in_flight` groups play at once (0: twice
        # tasks_per_step), a step's rollout ends once tasks_per_step of them are complete and parks
        # the others' episodes for the next step; an episode more than `max_staleness` policy versions
        # behind is dropped with its group. Needs train.rollout_correction ('tis' or 'mis')
        partial=False, groups_in_flight=0, max_staleness=4,
    ))
    c.train = ml_collections.ConfigDict(dict(
        steps=100, learning_rate=1e-6, weight_decay=0.01, clip_norm=1.0, b1=0.9, b2=0.999,
        lr_warmup_steps=0,  # optimizer steps of linear warm-up (0: the paper's constant rate)
        minibatch_tasks=2,  # PPO mini-batch in tasks (Table 9: 2 or 8 tasks' worth)
        # packing: [rows, row_len] per micro-batch; rows_per_micro 0 = one row per device of the
        # mesh's batch axes (data x fsdp): fewer rows are computed on every device of a group
        row_len=16384, rows_per_micro=0,
        clip_low=0.2, clip_high=0.2, dual_clip=0.0,  # dual clip c (0 = off; method §2.2: 3.0 when on)
        kl_coef=1e-3, entropy_coef=1e-3, agg_mode="seq-mean-token-mean",
        af_coef=0.01, af_mode="joint", af_norm="success_groups", horizon=-1,  # -1: the method's K
        # skip_invalid: forecasting targets the environment rejected are refilled with the episode's
        # next valid action (the paper's filter, section 8; cope_jax/batch/forecasting.py)
        # af_group_norm: forecasting weight 1/max(1,|S_x|) (False: 1, the paper's ablation)
        echo_coef=0.01, rft_coef=1.0, skip_invalid=False, skip_no_call=False, af_group_norm=True,
        progpo_scale=0.3, logprob_chunk=2048,
        # the sampler / trainer log-prob mismatch corrected per token in the policy term
        # (docs/training.md): 'none', 'tis' (importance weights capped at high) or 'mis' (tokens whose
        # weight leaves [low, high] masked)
        rollout_correction="none", rollout_correction_low=0.5, rollout_correction_high=2.0,
        # groups whose advantages are all zero (every episode of the task succeeded, or every one
        # failed): 'keep' them, 'mask' them out of the policy terms, or 'filter' them out of the
        # batch, which more rollout rounds of new tasks then refill (at most refill_rounds rounds)
        zero_variance="keep", refill_rounds=2,
        norm_length=0,  # agg_mode seq-mean-token-sum-norm's constant horizon; 0: rollout.max_len
        # loss terms whose own gradient norm every step reports (grad_norm_<term>): one more forward
        # and backward pass each (one fewer when they are all the loss's terms: the last is the total
        # minus the others), e.g. ("pg", "af") for the policy and forecasting terms' balance; it
        # raises the train step's memory (docs/training.md: +5 GiB per chip for a 7B model on v4-32)
        grad_norm_terms=(),
        # low-rank adapters (models/lora.py): rank unset = full fine-tuning. rank >= 1 freezes the base
        # weights in model.dtype and trains only adapters on `targets` (alpha 0: alpha = rank, so the
        # update's scale alpha / rank is 1) in RL; a warm start, when configured, trains every weight
        # of the base first. The KL reference is the base (the adapters off). LoRA usually wants a
        # learning rate ~10x full fine-tuning's
        lora=ml_collections.ConfigDict(dict(
            rank=config_dict.placeholder(int), alpha=0.0, dropout=0.0,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
    ))
    # optional supervised warm start on expert demonstrations (the demo uses it); af_examples:
    # forecasting examples (method §3.1 format, from the demonstrations) joining each step, 0 = off;
    # lr_schedule: 'constant' or 'cosine' (short warm-up, then decay to 5% over the steps); mistakes:
    # probability of a broken action (context only) before each expert action; dawdle: of the
    # family's idle action (trained) before each expert action (cope_jax/run/demos.py)
    c.warmstart = ml_collections.ConfigDict(dict(steps=0, learning_rate=1e-4, batch_episodes=16, tasks=0,
                                                 af_examples=0, lr_schedule="constant", mistakes=0.0,
                                                 dawdle=0.0))
    c.eval = ml_collections.ConfigDict(dict(every=10, tasks=0, samples=1, temperature=1.0, greedy=False))
    c.checkpoint = ml_collections.ConfigDict(dict(every=10, keep=3))
    return c
