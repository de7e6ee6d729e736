#!/usr/bin/env python3
"""Train the small bundled Mixtral-architecture MoE on a byte-level text corpus (tinyshakespeare) and export it as a
Hugging Face ``MixtralForCausalLM`` folder (config.json, generation_config.json, model.safetensors, README.md).

Model math (the forward of transformers' ``MixtralForCausalLM``, eager attention):
  x = embed_tokens[ids]
  per layer:  h = x + o_proj(attn(RoPE(q_proj(n1)), RoPE(k_proj(n1)), v_proj(n1))),   n1 = RMSNorm(x)
              x = h + MoE(n2),                                                        n2 = RMSNorm(h)
  RMSNorm(x) = w * x / sqrt(mean(x^2) + eps) (in float32)
  RoPE: inv_freq[j] = theta^(-2j/head_dim), angle = pos * inv_freq, cos/sin = cat(angle, angle),
        x' = x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x[d/2:], x[:d/2])
  attention: causal softmax(q k^T / sqrt(head_dim)) v in float32, GQA: query head h uses KV head h // (heads/kv_heads)
  MoE: p = softmax(gate(x)) over E experts (float32); top-k of p; weights renormalised to sum 1;
       out = sum_j w_j * w2_e(silu(w1_e x) * w3_e x)   (w1 = gate projection, w3 = up, w2 = down)
  logits = lm_head(RMSNorm(x))  (lm_head not tied to embed_tokens)

Training loss: cross entropy (nats/byte) + router_aux_loss_coef * load-balancing loss (Switch Transformer / Mixtral:
E * sum_e f_e * P_e, f_e = share of top-k assignments to expert e, P_e = mean router probability of e), computed per
MoE layer and averaged over layers (transformers concatenates the layers' router logits instead; per layer keeps
every layer balanced).

Training speed on CPU: with --capacity-factor > 0 the training step dispatches tokens to experts with a fixed
per-expert capacity C = ceil(capacity_factor * tokens * top_k / E) (Switch Transformer dispatch): each expert runs
one [C, H] GEMM batch instead of all tokens, and an assignment beyond an expert's capacity contributes zero for that
step (the share of such dropped assignments is printed). --capacity-factor 0 computes all experts densely and weights
them by the top-k gates (exactly the Mixtral output). Evaluation, expert-usage histograms, samples and the export
check always use the exact dense form.

Tokenizer: token id = UTF-8 byte value (vocab 256), no BOS, no EOS; config.json carries the marker
"ft_jax_tokenizer": "bytes" that ft_jax.tokenizer.load_tokenizer recognises.

Example:
  nice -n 10 python scripts/train_tiny_moe.py ../shared/text/tinyshakespeare.txt \
      --out ft_jax/bundled/tiny_shakespeare --steps 2000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TinyMoEConfig:
    """Model hyperparameters (the Mixtral config.json fields they become are named in ``hf_config``)."""

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 256
    router_aux_loss_coef: float = 0.02
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def hf_config(cfg: TinyMoEConfig, torch_dtype: str) -> dict:
    """config.json contents of a Hub-style ``MixtralForCausalLM`` checkpoint (rope_theta / torch_dtype spelling)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "ft_jax_tokenizer": "bytes",
    }


# ----------------------------------------------------------------------------------------------------------------
# Parameters: a flat dict keyed by the Hugging Face tensor names, except that each layer's experts are stacked
# ("model.layers.N.block_sparse_moe.experts.w1" [E, I, H]) for batched compute; ``export_tensors`` splits them.


def _pfx(layer: int) -> str:
    return f"model.layers.{layer}."


def init_params(cfg: TinyMoEConfig, seed: int) -> dict:
    """Random init: N(0, initializer_range) for matrices (output projections o_proj / w2 scaled by
    1/sqrt(2 * num_layers), GPT-2 style), ones for RMSNorm weights. Returns dict name -> float32 jnp array."""
    import jax
    import jax.numpy as jnp

    H, I, E, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "lm_head.weight": (cfg.vocab_size, H)}
    for n in range(cfg.num_layers):
        p = _pfx(n)
        shapes.update({
            p + "self_attn.q_proj.weight": (cfg.num_heads * D, H),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * D, H),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * D, H),
            p + "self_attn.o_proj.weight": (H, cfg.num_heads * D),
            p + "block_sparse_moe.gate.weight": (E, H),
            p + "block_sparse_moe.experts.w1": (E, I, H),
            p + "block_sparse_moe.experts.w3": (E, I, H),
            p + "block_sparse_moe.experts.w2": (E, H, I),
        })
    params = {}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        std = cfg.initializer_range * (out_scale if name.endswith(("o_proj.weight", "experts.w2")) else 1.0)
        params[name] = std * jax.random.normal(key, shape, jnp.float32)
    for n in range(cfg.num_layers):
        params[_pfx(n) + "input_layernorm.weight"] = jnp.ones((H,), jnp.float32)
        params[_pfx(n) + "post_attention_layernorm.weight"] = jnp.ones((H,), jnp.float32)
    params["model.norm.weight"] = jnp.ones((H,), jnp.float32)
    return params


def export_tensors(params: dict, cfg: TinyMoEConfig, dtype) -> dict[str, np.ndarray]:
    """Hub tensor names -> numpy arrays (contiguous, ``dtype``): experts split into
    model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight."""
    out = {}
    for name, value in params.items():
        arr = np.asarray(value, dtype=np.float32)
        if ".block_sparse_moe.experts." in name:
            base, w = name.rsplit(".", 1)
            for e in range(cfg.num_experts):
                out[f"{base}.{e}.{w}.weight"] = np.ascontiguousarray(arr[e]).astype(dtype)
        else:
            out[name] = np.ascontiguousarray(arr).astype(dtype)
    return out


def import_tensors(tensors: dict[str, np.ndarray], cfg: TinyMoEConfig) -> dict:
    """Inverse of ``export_tensors``: Hub tensor names -> training params (experts stacked, float32)."""
    import jax.numpy as jnp

    params = {}
    expert_names = {}
    for name, arr in tensors.items():
        if ".block_sparse_moe.experts." in name:
            base, e, w, _ = name.rsplit(".", 3)
            expert_names.setdefault(f"{base}.{w}", {})[int(e)] = arr
        else:
            params[name] = jnp.asarray(arr, jnp.float32)
    for name, per_expert in expert_names.items():
        if sorted(per_expert) != list(range(cfg.num_experts)):
            raise ValueError(f"{name}: expected experts 0..{cfg.num_experts - 1}, got {sorted(per_expert)}")
        params[name] = jnp.asarray(np.stack([per_expert[e] for e in range(cfg.num_experts)]), jnp.float32)
    return params


# ----------------------------------------------------------------------------------------------------------------
# Forward (jax). All shapes: B batch, T sequence, H hidden, D head_dim, E experts, I expert intermediate, N = B*T.


def rms_norm(x, w, eps: float):
    """x [..., H] f32, w [H] -> [..., H]: w * x / sqrt(mean(x^2) + eps) (MixtralRMSNorm)."""
    import jax.numpy as jnp

    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return w * (x * jnp.reciprocal(jnp.sqrt(var + eps)))


def rope_cos_sin(positions, head_dim: int, theta: float):
    """positions i32[T] -> cos, sin f32[T, D] (default RoPE, cat(angle, angle) layout)."""
    import jax.numpy as jnp

    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))  # [D/2]
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([angle, angle], axis=-1)  # [T, D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, heads, D]; cos/sin [T, D] -> x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1)."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def attention(params, layer: int, x, cos, sin, cfg: TinyMoEConfig):
    """x [B, T, H] (normalised) -> [B, T, H]: causal GQA self-attention with RoPE, eager softmax in f32."""
    import jax
    import jax.numpy as jnp

    B, T, _ = x.shape
    D, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rep = nh // nkv
    p = _pfx(layer) + "self_attn."
    q = (x @ params[p + "q_proj.weight"].T).reshape(B, T, nh, D)
    k = (x @ params[p + "k_proj.weight"].T).reshape(B, T, nkv, D)
    v = (x @ params[p + "v_proj.weight"].T).reshape(B, T, nkv, D)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = q.reshape(B, T, nkv, rep, D)  # query head h = kv * rep + r (transformers repeat_kv order)
    scores = jnp.einsum("btgrd,bsgd->bgrts", q, k) * (1.0 / math.sqrt(D))  # [B, nkv, rep, T, T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(B, T, nh * D)
    return out @ params[p + "o_proj.weight"].T


def route(router_logits, top_k: int):
    """router_logits f32[N, E] -> (probs f32[N, E], topk_weights f32[N, k] renormalised, topk_ids i32[N, k])."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    w, ids = jax.lax.top_k(probs, top_k)
    return probs, w / jnp.sum(w, axis=-1, keepdims=True), ids


def moe_dense(params, layer: int, x, cfg: TinyMoEConfig):
    """Exact Mixtral sparse MoE block, computed densely. x [N, H] -> (y [N, H], router_logits [N, E], ids [N, k]).

    Every expert is evaluated on every token and weighted by the combine weight (0 for experts outside the top-k):
    the same sum as evaluating only the top-k experts.
    """
    import jax
    import jax.numpy as jnp

    p = _pfx(layer) + "block_sparse_moe."
    N, H = x.shape
    E, I = cfg.num_experts, cfg.intermediate_size
    logits = x @ params[p + "gate.weight"].T  # [N, E]
    _, w, ids = route(logits, cfg.top_k)
    combine = jnp.sum(jax.nn.one_hot(ids, E, dtype=x.dtype) * w[..., None], axis=1)  # [N, E]
    gate = (x @ params[p + "experts.w1"].reshape(E * I, H).T).reshape(N, E, I)
    up = (x @ params[p + "experts.w3"].reshape(E * I, H).T).reshape(N, E, I)
    h = (jax.nn.silu(gate) * up * combine[:, :, None]).reshape(N, E * I)
    w2 = jnp.transpose(params[p + "experts.w2"], (1, 0, 2)).reshape(H, E * I)  # [H, E*I]
    return h @ w2.T, logits, ids


def moe_capacity(params, layer: int, x, cfg: TinyMoEConfig, capacity: int):
    """Switch-style dispatch with a fixed capacity per expert (training speed). x [N, H] ->
    (y [N, H], router_logits [N, E], ids [N, k], dropped f32[] = share of top-k assignments over capacity).

    Assignment (t, j) to expert e gets queue position = number of earlier assignments (token-major order) to e;
    positions >= capacity are dropped (contribute 0). Otherwise identical to ``moe_dense``.
    """
    import jax
    import jax.numpy as jnp

    p = _pfx(layer) + "block_sparse_moe."
    N, H = x.shape
    E, k, C = cfg.num_experts, cfg.top_k, capacity
    logits = x @ params[p + "gate.weight"].T  # [N, E]
    _, w, ids = route(logits, k)
    onehot = jax.nn.one_hot(ids.reshape(N * k), E, dtype=jnp.int32)  # [N*k, E]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=-1).reshape(N, k)  # queue position
    keep = pos < C  # [N, k]
    slot = jnp.where(keep, ids * C + pos, E * C)  # [N, k]; E*C = trash slot
    token_of_slot = jnp.full((E * C + 1,), N, jnp.int32).at[slot.reshape(-1)].set(
        jnp.repeat(jnp.arange(N, dtype=jnp.int32), k))[: E * C]  # [E*C]; N = empty (zero row)
    x_pad = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])
    xs = x_pad[token_of_slot].reshape(E, C, H)
    gate = jnp.einsum("ech,eih->eci", xs, params[p + "experts.w1"])
    up = jnp.einsum("ech,eih->eci", xs, params[p + "experts.w3"])
    out = jnp.einsum("eci,ehi->ech", jax.nn.silu(gate) * up, params[p + "experts.w2"]).reshape(E * C, H)
    out = jnp.concatenate([out, jnp.zeros((1, H), out.dtype)])
    y = jnp.sum(out[slot] * (w * keep)[..., None], axis=1)  # [N, H]
    return y, logits, ids, 1.0 - jnp.mean(keep.astype(jnp.float32))


def forward(params, tokens, cfg: TinyMoEConfig, capacity: int = 0):
    """tokens i32[B, T] (positions 0..T-1) -> (logits f32[B, T, V], router_logits f32[L, N, E], ids i32[L, N, k],
    dropped f32[] share of dropped assignments; 0 for the exact dense MoE, ``capacity`` = 0)."""
    import jax.numpy as jnp

    B, T = tokens.shape
    cos, sin = rope_cos_sin(jnp.arange(T), cfg.head_dim, cfg.rope_theta)
    x = params["model.embed_tokens.weight"][tokens]  # [B, T, H]
    all_logits, all_ids, dropped = [], [], []
    for n in range(cfg.num_layers):
        p = _pfx(n)
        x = x + attention(params, n, rms_norm(x, params[p + "input_layernorm.weight"], cfg.rms_norm_eps), cos, sin,
                          cfg)
        h = rms_norm(x, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps).reshape(B * T, -1)
        if capacity:
            y, lg, ids, drop = moe_capacity(params, n, h, cfg, capacity)
            dropped.append(drop)
        else:
            y, lg, ids = moe_dense(params, n, h, cfg)
        x = x + y.reshape(B, T, -1)
        all_logits.append(lg)
        all_ids.append(ids)
    x = rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
    logits = x @ params["lm_head.weight"].T
    drop = jnp.mean(jnp.stack(dropped)) if dropped else jnp.zeros(())
    return logits, jnp.stack(all_logits), jnp.stack(all_ids), drop


def load_balancing_loss(router_logits, ids, num_experts: int):
    """router_logits f32[L, N, E], ids i32[L, N, k] -> mean over layers of E * sum_e f_e * P_e (Switch/Mixtral);
    1.0 when routing is perfectly uniform."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(router_logits, axis=-1)  # [L, N, E]
    f = jnp.mean(jax.nn.one_hot(ids, num_experts), axis=(1, 2))  # [L, E] share of assignments
    P = jnp.mean(probs, axis=1)  # [L, E]
    return jnp.mean(num_experts * jnp.sum(f * P, axis=-1))


def cross_entropy(logits, targets):
    """logits f32[B, T, V], targets i32[B, T] -> mean negative log-likelihood (nats)."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ----------------------------------------------------------------------------------------------------------------
# Data


def load_bytes(path: str) -> np.ndarray:
    """File -> uint8[n] bytes (the byte-level token ids). Raises FileNotFoundError / ValueError (too short)."""
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if data.size < 10_000:
        raise ValueError(f"{path}: {data.size} bytes is too little text to train on (need >= 10000)")
    return data


def random_windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """uint8[n] -> i32[batch, length + 1] windows starting at uniform random offsets."""
    starts = rng.integers(0, data.size - length - 1, size=batch)
    return np.stack([data[s: s + length + 1] for s in starts]).astype(np.int32)


def fixed_windows(data: np.ndarray, count: int, length: int) -> np.ndarray:
    """uint8[n] -> i32[count, length + 1] windows at evenly spaced offsets (deterministic evaluation set)."""
    starts = np.linspace(0, data.size - length - 1, count).astype(np.int64)
    return np.stack([data[s: s + length + 1] for s in starts]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------


def learning_rate(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over the first ``warmup`` steps, then cosine decay from ``peak`` to 0.1 * ``peak`` as
    ``progress`` (fraction of the step count or of the wall-time budget, in [0, 1]) goes from 0 to 1."""
    if step <= warmup:
        return peak * step / warmup
    c = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak * (0.1 + 0.9 * c)


def evaluate(eval_fn, params, windows: np.ndarray, batch: int, cfg: TinyMoEConfig):
    """Exact (dense) forward over windows i32[M, T+1] -> (mean loss nats/byte, usage f64[L, E] share of top-k
    assignments per expert)."""
    losses, counts = [], np.zeros((cfg.num_layers, cfg.num_experts))
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        loss, ids = eval_fn(params, chunk)
        losses.append(float(loss) * len(chunk))
        ids = np.asarray(ids).reshape(cfg.num_layers, -1)  # [L, N*k]
        for n in range(cfg.num_layers):
            counts[n] += np.bincount(ids[n], minlength=cfg.num_experts)
    return sum(losses) / len(windows), counts / counts.sum(axis=1, keepdims=True)


def sample(params, cfg: TinyMoEConfig, prompt: str, new_tokens: int, temperature: float, seed: int) -> str:
    """Generate bytes with the exact dense forward (no KV cache: the whole window is recomputed each step).
    temperature 0 = greedy. Returns prompt + continuation decoded as UTF-8 (errors replaced)."""
    import jax
    import jax.numpy as jnp

    T = cfg.max_position_embeddings
    ids = list(prompt.encode("utf-8"))
    step = jax.jit(lambda p, toks: forward(p, toks, cfg)[0][0])  # [bucket, V]; one compile per bucket (multiple of 32)
    rng = np.random.default_rng(seed)
    for _ in range(new_tokens):
        window = ids[-T:]
        bucket = min(T, 32 * math.ceil(len(window) / 32))
        buf = np.zeros((1, bucket), np.int32)
        buf[0, : len(window)] = window  # causal: padding after the last token does not change its logits
        logits = np.asarray(step(params, jnp.asarray(buf))[len(window) - 1], np.float64)
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits / temperature
            prob = np.exp(z - z.max())
            nxt = int(rng.choice(len(prob), p=prob / prob.sum()))
        ids.append(nxt)
    return bytes(ids).decode("utf-8", errors="replace")


def usage_table(usage: np.ndarray) -> str:
    """usage f64[L, E] -> markdown table with percentages and a bar per expert."""
    L, E = usage.shape
    lines = ["| layer | " + " | ".join(f"e{e}" for e in range(E)) + " | min/max |",
             "|---|" + "---|" * E + "---|"]
    for n in range(L):
        cells = " | ".join(f"{100 * u:.1f}%" for u in usage[n])
        lines.append(f"| {n} | {cells} | {usage[n].min() / usage[n].max():.2f} |")
    return "\n".join(lines)


def usage_bars(usage: np.ndarray) -> str:
    """usage f64[L, E] -> text histogram (one line per expert, '#' per 1% of assignments)."""
    out = []
    for n in range(usage.shape[0]):
        out.append(f"layer {n}:")
        for e, u in enumerate(usage[n]):
            out.append(f"  e{e} {100 * u:5.1f}% " + "#" * int(round(100 * u)))
    return "\n".join(out)


def write_model_card(out: str, args, cfg: TinyMoEConfig, results: dict) -> None:
    """README.md model card with training details, losses, expert-usage histograms and samples."""
    r = results
    mib = 2**20
    step_bytes = args.batch_size * args.seq_len
    schedule = f"a wall-time budget of {args.time_budget:g} min" if args.time_budget else "the steps"
    continued = (f"- continued from the weights of `{args.init_from}` (optimizer state started fresh); the steps and "
                 "time above are this run's only.\n" if args.init_from else "")
    if args.capacity_factor:
        dispatch = (f"fixed capacity {args.capacity_factor:g} x the uniform load per expert (Switch style); an "
                    "assignment over capacity contributes 0 for that step; dropped share over the last 100 steps: "
                    f"{100 * r['drop_tail']:.2f}%")
    else:
        dispatch = "dense (every expert on every token, weighted by the top-k gates)"
    text = f"""# tiny_shakespeare: a small Mixtral-architecture MoE bundled with ft_jax

A byte-level `MixtralForCausalLM` checkpoint trained from scratch by `scripts/train_tiny_moe.py` on
tinyshakespeare (karpathy/char-rnn, MIT; {r['data_bytes']:,} bytes). It ships inside the package so that
`ft-jax generate` works with no download. It is a toy: it writes Shakespeare-like text, not sense.

## Architecture (config.json)
| field | value |
|---|---|
| architecture | MixtralForCausalLM (model_type mixtral) |
| vocab_size | {cfg.vocab_size} (token id = UTF-8 byte value) |
| hidden_size / head_dim | {cfg.hidden_size} / {cfg.head_dim} |
| layers, heads, KV heads | {cfg.num_layers}, {cfg.num_heads}, {cfg.num_kv_heads} (GQA) |
| experts (num_local_experts), top-k | {cfg.num_experts}, {cfg.top_k} (softmax router, renormalised top-k) |
| expert intermediate_size | {cfg.intermediate_size} (SwiGLU: w1 gate, w3 up, w2 down) |
| rope_theta, rms_norm_eps | {cfg.rope_theta:g}, {cfg.rms_norm_eps:g} |
| max_position_embeddings | {cfg.max_position_embeddings} (the training context) |
| lm_head | untied |
| storage | {r['dtype']}, {r['num_params']:,} parameters, model.safetensors {r['file_bytes'] / mib:.2f} MiB |
| expert bytes | {r['expert_row_bytes']:,} bytes per expert ({r['dtype']}), \
{cfg.num_layers * cfg.num_experts} experts = {r['expert_total_bytes'] / mib:.2f} MiB of \
{r['file_bytes'] / mib:.2f} MiB |

Tensor names are the Hub ones: `model.embed_tokens.weight`, `model.layers.N.self_attn.{{q,k,v,o}}_proj.weight`,
`model.layers.N.block_sparse_moe.gate.weight`, `model.layers.N.block_sparse_moe.experts.E.{{w1,w2,w3}}.weight`,
`model.layers.N.{{input,post_attention}}_layernorm.weight`, `model.norm.weight`, `lm_head.weight`.

## Tokenizer
Byte level: `encode(text)` = the UTF-8 bytes of the text, token id = byte value, vocab 256. There is no
tokenizer.json; config.json carries `"ft_jax_tokenizer": "bytes"`, which `ft_jax.tokenizer.load_tokenizer`
recognises. **No BOS and no EOS token** (`bos_token_id` and `eos_token_id` are null): the model was trained on
random windows of raw text, so a prompt is fed as its bytes alone and generation stops at the token limit.
A streamed byte may be part of a multi-byte UTF-8 character; the stream decoder buffers it (the corpus is ASCII).

## Training
Command (wall time {r['train_seconds'] / 60:.1f} min for {r['steps']} steps on {r['cores']} CPU cores, shared with \
other work, under `nice -n {r['niceness']}`; {r['step_ms']:.0f} ms per step on average):

```
{r['command']}
```

- data: the first {100 * (1 - args.val_fraction):.0f}% of the file for training, the last \
{100 * args.val_fraction:.0f}% held out for
  validation; random windows of {args.seq_len + 1} bytes, batch {args.batch_size} x {args.seq_len} = \
{step_bytes:,} predicted bytes per
  step, {r['steps'] * step_bytes / 1e6:.1f} M bytes seen (~{r['steps'] * step_bytes / r['train_bytes']:.1f} epochs).
- optimiser: optax AdamW (b1 0.9, b2 0.95, weight decay {args.weight_decay} on matrices only), peak learning rate
  {args.lr:g}, {args.warmup} warm-up steps, cosine decay to {args.lr * 0.1:g} over {schedule},
  gradient clipping at global norm 1.0, seed {args.seed}.
{continued}- loss: cross entropy + {cfg.router_aux_loss_coef} x load-balancing loss (Switch/Mixtral \
`E * sum_e f_e P_e`, per MoE
  layer, averaged over layers; 1.0 = uniform).
- expert dispatch while training: {dispatch}.
  Evaluation, histograms and samples below use the exact Mixtral forward (only the top-k experts, nothing dropped).

## Results (exact forward, {r['eval_windows']} windows of {args.seq_len} bytes from each split)
| | loss (nats/byte) | bits/byte |
|---|---|---|
| train | {r['train_loss']:.4f} | {r['train_loss'] / math.log(2):.3f} |
| validation | {r['val_loss']:.4f} | {r['val_loss'] / math.log(2):.3f} |

Load-balancing loss on validation: {r['val_aux']:.4f} (1.0 = uniform routing).

### Expert usage on validation text
Share of the top-{cfg.top_k} assignments that went to each expert (each byte counts once for each of its \
{cfg.top_k} experts;
uniform = {100 / cfg.num_experts:.1f}%):

{usage_table(np.asarray(r['val_usage']))}

```
{usage_bars(np.asarray(r['val_usage']))}
```

## Samples (this checkpoint, exact forward, {args.sample_tokens} new bytes)
Greedy (temperature 0), prompt `{r['sample_prompt']!r}`:
```
{r['sample_greedy']}
```
Temperature {args.sample_temperature}, seed {args.seed}:
```
{r['sample_temp']}
```

## Export check
After writing model.safetensors the script reloads it and compares the logits of the reloaded tensors with the
training forward on validation text: max |difference| = {r['export_max_abs_diff']:.2e}.
"""
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train the small byte-level Mixtral-architecture MoE on a text file and export it as a Hugging "
                    "Face MixtralForCausalLM folder (config.json, model.safetensors, generation_config.json, "
                    "README.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("text", help="training text file (e.g. ../shared/text/tinyshakespeare.txt); read as bytes")
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--steps", type=int, default=2000, help="optimiser steps (the cap, with --time-budget)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="minutes of training wall time: stop when spent, and run the cosine schedule over wall time "
                         "instead of steps (for a shared machine; 0 = train exactly --steps steps)")
    ap.add_argument("--seed", type=int, default=0, help="seed for init, batches and the temperature sample")
    ap.add_argument("--init-from", default="", help="start from the weights of an exported folder (continue training)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="bytes per sequence; also max_position_embeddings")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=256, help="expert intermediate size")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--aux-coef", type=float, default=0.02, help="router_aux_loss_coef (load-balancing loss weight)")
    ap.add_argument("--capacity-factor", type=float, default=1.25,
                    help="training dispatch capacity per expert in units of the uniform load; 0 = dense exact MoE")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="tail of the file held out for validation")
    ap.add_argument("--eval-every", type=int, default=250, help="validation loss every N steps (0 = only at the end)")
    ap.add_argument("--eval-windows", type=int, default=64, help="windows per split for the final evaluation")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="storage dtype of the export")
    ap.add_argument("--sample-prompt", default="ROMEO:\n")
    ap.add_argument("--sample-tokens", type=int, default=200)
    ap.add_argument("--sample-temperature", type=float, default=0.8)
    ap.add_argument("--max-file-mb", type=float, default=16.0, help="refuse to export a larger model.safetensors")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import optax
    from safetensors.numpy import load_file, save_file
    from tqdm import tqdm

    cfg = TinyMoEConfig(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, num_experts=args.experts, top_k=args.top_k,
                        intermediate_size=args.intermediate_size, rope_theta=args.rope_theta,
                        max_position_embeddings=args.seq_len, router_aux_loss_coef=args.aux_coef)
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
        sys.exit(f"error: hidden {cfg.hidden_size}, heads {cfg.num_heads}, kv heads {cfg.num_kv_heads}: need "
                 "hidden % heads == 0, heads % kv_heads == 0 and an even head_dim")
    data = load_bytes(args.text)
    split = int(data.size * (1 - args.val_fraction))
    train, val = data[:split], data[split:]
    print(f"data: {data.size:,} bytes, train {train.size:,}, validation {val.size:,}", flush=True)

    params = init_params(cfg, args.seed)
    if args.init_from:
        init_tensors = load_file(os.path.join(args.init_from, "model.safetensors"))
        loaded = import_tensors(init_tensors, cfg)
        bad = sorted(k for k in params if k not in loaded or loaded[k].shape != params[k].shape)
        if bad or len(loaded) != len(params):
            sys.exit(f"error: {args.init_from}/model.safetensors does not match the model flags (first mismatching "
                     f"tensor: {(bad or sorted(set(loaded) - set(params)))[0]})")
        params = loaded
        print(f"initialised from {args.init_from}/model.safetensors (optimizer state starts fresh)", flush=True)
    num_params = sum(int(np.prod(v.shape)) for v in params.values())
    tokens_per_step = args.batch_size * args.seq_len
    capacity = (math.ceil(args.capacity_factor * tokens_per_step * cfg.top_k / cfg.num_experts)
                if args.capacity_factor > 0 else 0)
    print(f"model: {num_params:,} parameters; {tokens_per_step} bytes per step; expert capacity "
          f"{capacity or 'dense'}", flush=True)

    # AdamW at learning rate 1; the step scales the update by the scheduled rate (see learning_rate()), so the
    # schedule can follow wall time (--time-budget) as well as the step count.
    decay_mask = {k: v.ndim >= 2 and "embed_tokens" not in k for k, v in params.items()}
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask))
    opt_state = opt.init(params)

    def loss_fn(p, batch):
        logits, router_logits, ids, drop = forward(p, batch[:, :-1], cfg, capacity)
        ce = cross_entropy(logits, batch[:, 1:])
        aux = load_balancing_loss(router_logits, ids, cfg.num_experts)
        return ce + cfg.router_aux_loss_coef * aux, (ce, aux, drop)

    @jax.jit
    def train_step(p, s, batch, lr):
        (_, (ce, aux, drop)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        updates, s = opt.update(grads, s, p)
        updates = jax.tree.map(lambda u: lr * u, updates)
        return optax.apply_updates(p, updates), s, ce, aux, drop

    @jax.jit
    def eval_fn(p, batch):
        logits, router_logits, ids, _ = forward(p, batch[:, :-1], cfg)
        return cross_entropy(logits, batch[:, 1:]), ids

    @jax.jit
    def eval_aux(p, batch):
        _, router_logits, ids, _ = forward(p, batch[:, :-1], cfg)
        return load_balancing_loss(router_logits, ids, cfg.num_experts)

    rng = np.random.default_rng(args.seed)
    val_windows = fixed_windows(val, args.eval_windows, args.seq_len)
    train_windows = fixed_windows(train, args.eval_windows, args.seq_len)
    quick_val = val_windows[:: max(1, len(val_windows) // args.batch_size)][: args.batch_size]
    history, drops = [], []
    budget_s = 60.0 * args.time_budget
    t0 = time.time()
    bar = tqdm(total=None if budget_s else args.steps, desc="train", unit="step", dynamic_ncols=True)
    ema, step = None, 0
    while step < args.steps and not (budget_s and time.time() - t0 >= budget_s):
        step += 1
        progress = (time.time() - t0) / budget_s if budget_s else (step - 1) / args.steps
        lr = learning_rate(step, progress, args.lr, args.warmup)
        batch = jnp.asarray(random_windows(train, rng, args.batch_size, args.seq_len))
        params, opt_state, ce, aux, drop = train_step(params, opt_state, batch, jnp.float32(lr))
        bar.update(1)
        ce, aux, drop = float(ce), float(aux), float(drop)
        drops.append(drop)
        ema = ce if ema is None else 0.98 * ema + 0.02 * ce
        post = {"loss": f"{ema:.3f}", "aux": f"{aux:.3f}", "drop": f"{100 * drop:.1f}%"}
        if args.eval_every and step % args.eval_every == 0:
            vl, _ = eval_fn(params, jnp.asarray(quick_val))
            history.append((step, ema, float(vl)))
            post["val"] = f"{float(vl):.3f}"
            tqdm.write(f"step {step}: train (EMA) {ema:.4f}  val {float(vl):.4f}  aux {aux:.4f}  "
                       f"dropped {100 * drop:.2f}%  {time.time() - t0:.0f} s")
        bar.set_postfix(post)
    bar.close()
    train_seconds = time.time() - t0
    steps = step

    eval_batch = args.batch_size
    train_loss, _ = evaluate(eval_fn, params, train_windows, eval_batch, cfg)
    val_loss, val_usage = evaluate(eval_fn, params, val_windows, eval_batch, cfg)
    val_aux = float(np.mean([float(eval_aux(params, jnp.asarray(val_windows[i: i + eval_batch])))
                             for i in range(0, len(val_windows), eval_batch)]))
    print(f"final train loss {train_loss:.4f} nats/byte, validation loss {val_loss:.4f} nats/byte "
          f"(load-balancing {val_aux:.4f})")
    print("expert usage on validation (share of top-k assignments):")
    print(usage_bars(val_usage))

    # Export.
    os.makedirs(args.out, exist_ok=True)
    np_dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    tensors = export_tensors(params, cfg, np_dtype)
    st_path = os.path.join(args.out, "model.safetensors")
    save_file(tensors, st_path, metadata={"format": "pt"})
    file_bytes = os.path.getsize(st_path)
    if file_bytes > args.max_file_mb * 2**20:
        sys.exit(f"error: {st_path} is {file_bytes / 2**20:.2f} MiB > --max-file-mb {args.max_file_mb}")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_config(cfg, args.dtype), f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, f, indent=2)
        f.write("\n")

    # Export check: the reloaded tensors (in the stored dtype) give the training forward's logits.
    reloaded = import_tensors(load_file(st_path), cfg)
    stored = {k: jnp.asarray(np.asarray(v).astype(np_dtype).astype(np.float32)) for k, v in params.items()}
    chk = jnp.asarray(val_windows[:2, :-1])
    export_diff = float(jnp.max(jnp.abs(forward(reloaded, chk, cfg)[0] - forward(stored, chk, cfg)[0])))
    print(f"export check: max |logits(reloaded) - logits(trained)| = {export_diff:.3e}")
    if export_diff > 1e-4:
        sys.exit("error: the exported checkpoint does not reproduce the trained model")

    sample_greedy = sample(reloaded, cfg, args.sample_prompt, args.sample_tokens, 0.0, args.seed)
    sample_temp = sample(reloaded, cfg, args.sample_prompt, args.sample_tokens, args.sample_temperature, args.seed)
    print("--- greedy sample ---\n" + sample_greedy)
    print(f"--- temperature {args.sample_temperature} sample ---\n" + sample_temp)

    niceness = os.nice(0)  # this process's scheduling niceness, written into the card's command
    expert_row_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * np.dtype(np_dtype).itemsize
    results = {
        "data_bytes": int(data.size), "train_bytes": int(train.size), "steps": steps,
        "train_seconds": train_seconds, "step_ms": 1000 * train_seconds / steps, "cores": os.cpu_count(),
        "niceness": niceness,
        "command": f"nice -n {niceness} python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:] if argv is None
                                                           else [os.path.relpath(__file__)] + list(argv)),
        "train_loss": train_loss, "val_loss": val_loss, "val_aux": val_aux, "val_usage": val_usage.tolist(),
        "drop_tail": float(np.mean(drops[-100:])), "eval_windows": len(val_windows),
        "num_params": num_params, "file_bytes": file_bytes, "dtype": args.dtype,
        "expert_row_bytes": expert_row_bytes, "expert_total_bytes": expert_row_bytes * cfg.num_layers * cfg.num_experts,
        "sample_prompt": args.sample_prompt, "sample_greedy": sample_greedy, "sample_temp": sample_temp,
        "export_max_abs_diff": export_diff, "history": history, "config": asdict(cfg),
    }
    write_model_card(args.out, args, cfg, results)
    print(f"wrote {args.out}: model.safetensors {file_bytes / 2**20:.2f} MiB, config.json, generation_config.json, "
          "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
