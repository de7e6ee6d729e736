#!/usr/bin/env python3
"""Train the small bundled Mixtral-architecture MoE on a byte-level text corpus (tinyshakespeare) and export it as a
Hugging Face ``MixtralForCausalLM`` folder (config.json, generation_config.json, model.safetensors, README.md).

The model trained is ft_jax's own: ``ft_jax.models.decoder.MoETransformer`` built from the config.json this script
writes (``hf_config``), called over full windows (positions 0..T-1, a fresh KV cache) with ``collect=True`` for the
router logits. Its dense parameters (embedding, fused q/k/v and o projections, routers, RMSNorms, lm_head) are the
model's nnx.Params; the routed experts come from ``TrainExperts``, an expert backend (ft_jax.models.moe.ExpertBackend) holding
the trainable expert weights gate/up [L, E, 2I, H] and down [L, E, H, I]. jax differentiates all of it as long as
every projection has more than ft_jax.models.layers.FFI_MAX_ROWS rows (then ``linear`` is XLA's dot, not the FFI
GEMV): a training step needs batch x seq-len > FFI_MAX_ROWS tokens (8 x 256 by default); evaluation has no limit.

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

Examples:
  nice -n 10 python scripts/train_tiny_moe.py ../shared/text/tinyshakespeare.txt \
      --out ft_jax/bundled/tiny_shakespeare --steps 2000
  python scripts/train_tiny_moe.py ../shared/text/tinyshakespeare.txt --evaluate-only ft_jax/bundled/tiny_shakespeare
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.config import MoEConfig, config_from_dict
from ft_jax.models.decoder import MoETransformer
from ft_jax.models.layers import FFI_MAX_ROWS

HIGHEST = jax.lax.Precision.HIGHEST


def hf_config(args, torch_dtype: str) -> dict:
    """config.json contents of a Hub-style ``MixtralForCausalLM`` checkpoint (rope_theta / torch_dtype spelling) for
    the model flags of ``args`` (parse_args); ft_jax.config.config_from_dict of it is the MoEConfig trained."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 256,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden_size // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.seq_len,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": args.rope_theta,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": args.aux_coef,
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
# Parameters. On disk and at the edges of training: a dict of Hub tensor names -> float32 numpy arrays (what
# model.safetensors holds). In training: {"dense": the model's nnx.Param state, "gate_up": f32[L, E, 2I, H],
# "down": f32[L, E, H, I]} (gate_up rows 0..I-1 = w1, the gate projection; I..2I-1 = w3, the up projection).


def _pfx(layer: int) -> str:
    return f"model.layers.{layer}."


def _expert(layer: int, e: int, w: str) -> str:
    return f"{_pfx(layer)}block_sparse_moe.experts.{e}.{w}.weight"


def init_tensors(cfg: MoEConfig, seed: int) -> dict[str, np.ndarray]:
    """Random init: N(0, initializer_range) for matrices (output projections o_proj / w2 scaled by
    1/sqrt(2 * num_layers), GPT-2 style), ones for RMSNorm weights. Returns Hub name -> f32 numpy array.

    The draws are the script's since its first version: one jax.random key per tensor, in sorted order of the names
    with each layer's experts stacked ("...block_sparse_moe.experts.w1" [E, I, H]), so seed 0 gives the initial
    weights of the bundled model's first run."""
    H, I, E, D = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.head_dim
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
    tensors = {}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        std = cfg.initializer_range * (out_scale if name.endswith(("o_proj.weight", "experts.w2")) else 1.0)
        value = np.asarray(std * jax.random.normal(key, shape, jnp.float32))
        if ".experts." in name:  # [E, ...] -> one tensor per expert
            layer, w = int(name.split(".")[2]), name.rsplit(".", 1)[1]
            tensors.update({_expert(layer, e, w): value[e] for e in range(E)})
        else:
            tensors[name] = value
    for n in range(cfg.num_layers):
        tensors[_pfx(n) + "input_layernorm.weight"] = np.ones((H,), np.float32)
        tensors[_pfx(n) + "post_attention_layernorm.weight"] = np.ones((H,), np.float32)
    tensors["model.norm.weight"] = np.ones((H,), np.float32)
    return tensors


def build(cfg: MoEConfig, tensors: dict[str, np.ndarray]):
    """Hub tensors (float32 numpy; shapes as ``init_tensors``) -> (graphdef, params) of ft_jax's model.

    The model's ParamFactory serves ``tensors`` by name; params = {"dense": nnx.State of the MoETransformer,
    "gate_up": f32[L, E, 2I, H] (cat(w1, w3) per expert), "down": f32[L, E, H, I] (w2)}.
    Raises ValueError: a tensor the model asks for is missing or has another shape."""

    def make(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"the model asks for tensor {name}, which the script does not have")
        if tensors[name].shape != tuple(shape):
            raise ValueError(f"tensor {name}: the model expects {tuple(shape)}, got {tensors[name].shape}")
        return np.asarray(tensors[name], np.float32)

    model = MoETransformer(cfg, make)
    graphdef, dense = nnx.split(model)
    L, E = cfg.num_layers, cfg.num_experts
    gate_up = np.stack([np.stack([np.concatenate([tensors[_expert(l, e, "w1")], tensors[_expert(l, e, "w3")]])
                                  for e in range(E)]) for l in range(L)])  # [L, E, 2I, H]
    down = np.stack([np.stack([tensors[_expert(l, e, "w2")] for e in range(E)]) for l in range(L)])  # [L, E, H, I]
    return graphdef, {"dense": dense, "gate_up": jnp.asarray(gate_up), "down": jnp.asarray(down)}


def export_tensors(graphdef, params: dict, cfg: MoEConfig, dtype) -> dict[str, np.ndarray]:
    """Inverse of ``build``: training params -> Hub tensor names -> contiguous numpy arrays of ``dtype``
    (the fused q/k/v rows and the stacked layers of ft_jax's model split back into the Hub tensors)."""
    model = nnx.merge(graphdef, params["dense"])
    if len(model.stacks) != 1:
        raise ValueError(f"expected one decoder stack (every layer MoE), got {len(model.stacks)}")
    stack = model.stacks[0]
    NHD, KVD, I = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.moe_intermediate_size
    qkv = np.asarray(stack.attn.qkv[...])  # [L, NHD + 2 KVD, H]
    gate_up, down = np.asarray(params["gate_up"]), np.asarray(params["down"])  # [L, E, 2I, H], [L, E, H, I]
    out = {"model.embed_tokens.weight": model.embed_tokens[...], "model.norm.weight": model.norm[...],
           "lm_head.weight": model.lm_head[...]}
    for l in range(cfg.num_layers):
        a, m = _pfx(l) + "self_attn.", _pfx(l) + "block_sparse_moe."
        out.update({a + "q_proj.weight": qkv[l, :NHD], a + "k_proj.weight": qkv[l, NHD:NHD + KVD],
                    a + "v_proj.weight": qkv[l, NHD + KVD:], a + "o_proj.weight": stack.attn.o[...][l],
                    m + "gate.weight": stack.ffn.router[...][l],
                    _pfx(l) + "input_layernorm.weight": stack.input_norm[...][l],
                    _pfx(l) + "post_attention_layernorm.weight": stack.post_norm[...][l]})
        for e in range(cfg.num_experts):
            out.update({_expert(l, e, "w1"): gate_up[l, e, :I], _expert(l, e, "w3"): gate_up[l, e, I:],
                        _expert(l, e, "w2"): down[l, e]})
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)).astype(dtype) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------------
# Forward: ft_jax's model with this script's expert backend. Shapes: B batch, T window, H hidden, E experts,
# I expert intermediate, k top-k, N = B*T tokens, L MoE layers.


@dataclass(frozen=True)
class TrainExperts:
    """Expert backend (ft_jax.models.moe.ExpertBackend) over trainable expert weights, built inside the traced
    function so that jax differentiates through them.

    gate_up: f32[L, E, 2I, H]; down: f32[L, E, H, I]; capacity: 0 = exact dense form (every expert on every token,
    weighted by its combine weight, 0 outside the top-k: the same sum as running only the top-k experts), else the
    Switch-style fixed capacity C per expert: assignment (n, j) to expert e gets queue position = number of earlier
    assignments (token-major order) to e, and positions >= C contribute 0. The expert state is f32[]: the sum over
    the layers run so far of the share of top-k assignments dropped (0 for the dense form).
    """

    gate_up: jax.Array
    down: jax.Array
    capacity: int = 0

    def __call__(self, moe_layer, x, topk_ids, topk_weights, dropped):
        """x f32[N, H]; topk_ids i32[N, k]; topk_weights f32[N, k] -> (y f32[N, H], dropped + this layer's share)."""
        gate_up, down = self.gate_up[moe_layer], self.down[moe_layer]  # [E, 2I, H], [E, H, I]
        N, H = x.shape
        E, I, k, C = gate_up.shape[0], down.shape[-1], topk_ids.shape[-1], self.capacity
        if not C:
            combine = jnp.sum(jax.nn.one_hot(topk_ids, E, dtype=x.dtype) * topk_weights[..., None], axis=1)  # [N, E]
            gu = jnp.einsum("nh,eoh->neo", x, gate_up, precision=HIGHEST)  # [N, E, 2I]
            h = jax.nn.silu(gu[..., :I]) * gu[..., I:] * combine[:, :, None]  # [N, E, I]
            return jnp.einsum("nei,ehi->nh", h, down, precision=HIGHEST), dropped
        onehot = jax.nn.one_hot(topk_ids.reshape(N * k), E, dtype=jnp.int32)  # [N*k, E]
        pos = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=-1).reshape(N, k)  # queue position
        keep = pos < C  # [N, k]
        slot = jnp.where(keep, topk_ids * C + pos, E * C)  # [N, k]; E*C = trash slot
        token_of_slot = jnp.full((E * C + 1,), N, jnp.int32).at[slot.reshape(-1)].set(
            jnp.repeat(jnp.arange(N, dtype=jnp.int32), k))[: E * C]  # [E*C]; N = empty (zero row)
        xs = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])[token_of_slot].reshape(E, C, H)
        gu = jnp.einsum("ech,eoh->eco", xs, gate_up, precision=HIGHEST)  # [E, C, 2I]
        out = jnp.einsum("eci,ehi->ech", jax.nn.silu(gu[..., :I]) * gu[..., I:], down, precision=HIGHEST)
        out = jnp.concatenate([out.reshape(E * C, H), jnp.zeros((1, H), out.dtype)])  # [E*C + 1, H]
        y = jnp.sum(out[slot] * (topk_weights * keep)[..., None], axis=1)  # [N, H]
        return y, dropped + 1.0 - jnp.mean(keep.astype(jnp.float32))


def forward(graphdef, params: dict, tokens, capacity: int = 0):
    """tokens i32[B, T] (positions 0..T-1, a fresh KV cache) -> (logits f32[B, T, V], router_logits f32[L, N, E],
    topk_ids i32[L, N, k], dropped f32[] mean share of dropped assignments per layer; 0 for capacity 0)."""
    model = nnx.merge(graphdef, params["dense"])
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    experts = TrainExperts(params["gate_up"], params["down"], capacity)
    logits, _, dropped, inter = model(tokens, positions, model.init_kv_cache(B, T), jnp.zeros((), jnp.float32),
                                      experts, collect=True)
    L, E = inter.router_logits.shape[0], inter.router_logits.shape[-1]
    return (logits, inter.router_logits.reshape(L, B * T, E), inter.topk_ids.reshape(L, B * T, -1),
            dropped / L)


def load_balancing_loss(router_logits, ids, num_experts: int):
    """router_logits f32[L, N, E], ids i32[L, N, k] -> mean over layers of E * sum_e f_e * P_e (Switch/Mixtral);
    1.0 when routing is perfectly uniform."""
    probs = jax.nn.softmax(router_logits, axis=-1)  # [L, N, E]
    f = jnp.mean(jax.nn.one_hot(ids, num_experts), axis=(1, 2))  # [L, E] share of assignments
    P = jnp.mean(probs, axis=1)  # [L, E]
    return jnp.mean(num_experts * jnp.sum(f * P, axis=-1))


def cross_entropy(logits, targets):
    """logits f32[B, T, V], targets i32[B, T] -> mean negative log-likelihood (nats)."""
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


def evaluate(eval_fn, params, windows: np.ndarray, batch: int, cfg: MoEConfig):
    """Exact (dense) forward over windows i32[M, T+1] -> (mean loss nats/byte, mean load-balancing loss over the
    batches, usage f64[L, E] share of top-k assignments per expert)."""
    losses, auxes, counts = [], [], np.zeros((cfg.num_layers, cfg.num_experts))
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        loss, aux, ids = eval_fn(params, jnp.asarray(chunk))
        losses.append(float(loss) * len(chunk))
        auxes.append(float(aux))
        ids = np.asarray(ids).reshape(cfg.num_layers, -1)  # [L, N*k]
        for n in range(cfg.num_layers):
            counts[n] += np.bincount(ids[n], minlength=cfg.num_experts)
    return sum(losses) / len(windows), float(np.mean(auxes)), counts / counts.sum(axis=1, keepdims=True)


def sample(logits_fn, params, cfg: MoEConfig, prompt: str, new_tokens: int, temperature: float, seed: int):
    """Generate bytes with the exact dense forward over a [1, max_position_embeddings] window (no KV cache: the
    window is recomputed each step, and slides once it is full). logits_fn(params, tokens i32[1, T]) -> f32[T, V].
    temperature 0 = greedy. Returns (prompt + continuation decoded as UTF-8 (errors replaced), new ids)."""
    T = cfg.max_position_embeddings
    ids = list(prompt.encode("utf-8"))
    rng = np.random.default_rng(seed)
    for _ in range(new_tokens):
        window = ids[-T:]
        buf = np.zeros((1, T), np.int32)
        buf[0, : len(window)] = window  # causal: padding after the last token does not change its logits
        logits = np.asarray(logits_fn(params, jnp.asarray(buf))[len(window) - 1], np.float64)
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits / temperature
            prob = np.exp(z - z.max())
            nxt = int(rng.choice(len(prob), p=prob / prob.sum()))
        ids.append(nxt)
    return bytes(ids).decode("utf-8", errors="replace"), ids[len(prompt.encode("utf-8")):]


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


def write_model_card(out: str, args, cfg: MoEConfig, results: dict) -> None:
    """README.md model card with training details, losses, expert-usage histograms and samples (``results``: the
    dict main() builds)."""
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
tinyshakespeare (karpathy/char-rnn, MIT; {r['data_bytes']:,} bytes); the forward it trains is ft_jax's own model
(`ft_jax.models.decoder.MoETransformer` with the script's expert backend). It ships inside the package so that
`ft-jax generate` works with no download. It is a toy: it writes Shakespeare-like text, not sense.

## Architecture (config.json)
| field | value |
|---|---|
| architecture | MixtralForCausalLM (model_type mixtral) |
| vocab_size | {cfg.vocab_size} (token id = UTF-8 byte value) |
| hidden_size / head_dim | {cfg.hidden_size} / {cfg.head_dim} |
| layers, heads, KV heads | {cfg.num_layers}, {cfg.num_heads}, {cfg.num_kv_heads} (GQA) |
| experts (num_local_experts), top-k | {cfg.num_experts}, {cfg.top_k} (softmax router, renormalised top-k) |
| expert intermediate_size | {cfg.moe_intermediate_size} (SwiGLU: w1 gate, w3 up, w2 down) |
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
{continued}- loss: cross entropy + {args.aux_coef} x load-balancing loss (Switch/Mixtral \
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

## Samples (this checkpoint, the training script's exact forward, {args.sample_tokens} new bytes)
Greedy (temperature 0), prompt `{r['sample_prompt']!r}`:
```
{r['sample_greedy']}
```
Temperature {args.sample_temperature}, seed {args.seed}:
```
{r['sample_temp']}
```

## Export check
After writing the folder the script loads it with `ft_jax.load` (float32, host-all policy): its dense parameters and
expert banks differ from the trained ones (in the stored dtype) by at most {r['export_max_abs_diff']:.2e}, and its
greedy decode of the prompt (offloaded experts, KV cache) gives the same {r['export_greedy_tokens']} bytes as the
training forward.
"""
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def read_checkpoint(folder: str, expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """folder/model.safetensors -> Hub name -> f32 numpy array. Raises ValueError naming the first tensor whose name
    or shape differs from ``expected`` (init_tensors of the model flags); FileNotFoundError without the file."""
    from safetensors.numpy import load_file

    path = os.path.join(folder, "model.safetensors")
    tensors = {k: np.asarray(v, np.float32) for k, v in load_file(path).items()}
    for name in sorted(set(tensors) | set(expected)):
        got = tensors[name].shape if name in tensors else "missing"
        want = expected[name].shape if name in expected else "not in the model"
        if got != want:
            raise ValueError(f"{path} does not match the model flags: tensor {name}: expected {want}, got {got}")
    return tensors


def final_evaluation(eval_fn, params, train_windows: np.ndarray, val_windows: np.ndarray, batch: int,
                     cfg: MoEConfig) -> dict:
    """Exact forward over the fixed evaluation windows of both splits; prints the losses (nats and bits per byte,
    the card's Results), the validation load-balancing loss and expert usage. Returns train_loss, val_loss, val_aux,
    val_usage (f64[L, E])."""
    train_loss, _, _ = evaluate(eval_fn, params, train_windows, batch, cfg)
    val_loss, val_aux, val_usage = evaluate(eval_fn, params, val_windows, batch, cfg)
    bits = 1 / math.log(2)
    print(f"final train loss {train_loss:.4f} nats/byte ({train_loss * bits:.3f} bits/byte), validation loss "
          f"{val_loss:.4f} nats/byte ({val_loss * bits:.3f} bits/byte); {len(val_windows)} windows of "
          f"{val_windows.shape[1] - 1} bytes per split, exact forward")
    print(f"load-balancing loss on validation {val_aux:.4f} (1.0 = uniform)")
    print("expert usage on validation (share of top-k assignments):")
    print(usage_table(val_usage))
    print(usage_bars(val_usage))
    return {"train_loss": train_loss, "val_loss": val_loss, "val_aux": val_aux, "val_usage": val_usage}


def export_check(out: str, stored: dict, cfg: MoEConfig, prompt_ids: list[int], greedy_ids: list[int]):
    """Loads the exported folder with ft_jax.load (float32, host-all policy) and compares it with the training side.

    stored: the trained params rounded to the stored dtype; greedy_ids: the training
    forward's greedy continuation of prompt_ids. Returns (max |difference| of the dense parameters and expert banks,
    number of greedy bytes compared: the continuation, capped by the context). Exits with an error when a parameter
    differs or the greedy decode of the loaded model differs."""
    import ft_jax

    loaded = ft_jax.load(out, dtype="float32", policy="host-all", measure=False)
    ckpt = loaded.checkpoint
    got = jax.tree.leaves(nnx.split(ckpt.model)[1]) + [ckpt.banks.gate_up.numpy(), ckpt.banks.down.numpy()]
    want = jax.tree.leaves(stored["dense"]) + [np.reshape(stored[k], ckpt.banks.gate_up.shape if k == "gate_up" else
                                                          ckpt.banks.down.shape) for k in ("gate_up", "down")]
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in zip(got, want))
    if diff or len(got) != len(want):
        sys.exit(f"error: the parameters ft_jax.load reads from {out} differ from the trained ones by {diff:.3e}")
    n = min(len(greedy_ids), cfg.max_position_embeddings - len(prompt_ids))
    decoded = loaded.generate(prompt_ids, max_new_tokens=n, temperature=0.0).token_ids[0]
    if decoded != greedy_ids[:n]:
        first = next(i for i, (a, b) in enumerate(zip(decoded + [-1] * n, greedy_ids)) if a != b)
        sys.exit(f"error: ft_jax.load({out}) decodes greedy byte {first} as {decoded[first: first + 1]}, the training "
                 f"forward as {greedy_ids[first]}")
    return diff, n


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train the small byte-level Mixtral-architecture MoE on a text file and export it as a Hugging "
                    "Face MixtralForCausalLM folder (config.json, model.safetensors, generation_config.json, "
                    "README.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("text", help="training text file (e.g. ../shared/text/tinyshakespeare.txt); read as bytes")
    ap.add_argument("--out", help="output folder (created); required unless --evaluate-only")
    ap.add_argument("--evaluate-only", default="", metavar="FOLDER",
                    help="only evaluate the checkpoint FOLDER (it must match the model flags) on the final "
                         "evaluation windows of the text, print the losses and expert usage, and exit")
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
    args = ap.parse_args(argv)
    if not args.out and not args.evaluate_only:
        ap.error("--out is required (unless --evaluate-only)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import ml_dtypes
    import optax
    from safetensors.numpy import save_file
    from tqdm import tqdm

    if args.hidden_size % args.heads or args.heads % args.kv_heads or (args.hidden_size // args.heads) % 2:
        sys.exit(f"error: hidden {args.hidden_size}, heads {args.heads}, kv heads {args.kv_heads}: need "
                 "hidden % heads == 0, heads % kv_heads == 0 and an even head_dim")
    cfg = config_from_dict(hf_config(args, "float32"), source="the model flags")
    data = load_bytes(args.text)
    split = int(data.size * (1 - args.val_fraction))
    train, val = data[:split], data[split:]
    print(f"data: {data.size:,} bytes, train {train.size:,}, validation {val.size:,}", flush=True)

    tensors = init_tensors(cfg, args.seed)
    source = args.evaluate_only or args.init_from
    if source:
        try:
            tensors = read_checkpoint(source, tensors)
        except ValueError as e:
            sys.exit(f"error: {e}")
        print(f"weights from {source}/model.safetensors" + ("" if args.evaluate_only else
                                                            " (optimizer state starts fresh)"), flush=True)
    graphdef, params = build(cfg, tensors)
    num_params = sum(v.size for v in tensors.values())

    @jax.jit
    def eval_fn(p, batch):
        logits, router_logits, ids, _ = forward(graphdef, p, batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:]), load_balancing_loss(router_logits, ids, cfg.num_experts), ids

    val_windows = fixed_windows(val, args.eval_windows, args.seq_len)
    train_windows = fixed_windows(train, args.eval_windows, args.seq_len)
    if args.evaluate_only:
        final_evaluation(eval_fn, params, train_windows, val_windows, args.batch_size, cfg)
        return 0

    tokens_per_step = args.batch_size * args.seq_len
    if tokens_per_step <= FFI_MAX_ROWS:
        sys.exit(f"error: --batch-size x --seq-len = {tokens_per_step} bytes per step; training needs more than "
                 f"{FFI_MAX_ROWS}: below that ft_jax.models.layers.linear runs the FFI GEMV, which jax cannot "
                 "differentiate")
    capacity = (math.ceil(args.capacity_factor * tokens_per_step * cfg.top_k / cfg.num_experts)
                if args.capacity_factor > 0 else 0)
    print(f"model: {num_params:,} parameters; {tokens_per_step} bytes per step; expert capacity "
          f"{capacity or 'dense'}", flush=True)

    # AdamW at learning rate 1; the step scales the update by the scheduled rate (see learning_rate()), so the
    # schedule can follow wall time (--time-budget) as well as the step count. Weight decay on the matrices: every
    # parameter but the embedding and the RMSNorm weights.
    def decays(path, _):
        return not {"embed_tokens", "norm", "input_norm", "post_norm"} & {getattr(k, "key", None) for k in path}

    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                                  mask=lambda p: jax.tree_util.tree_map_with_path(decays, p)))
    opt_state = opt.init(params)

    def loss_fn(p, batch):
        logits, router_logits, ids, drop = forward(graphdef, p, batch[:, :-1], capacity)
        ce = cross_entropy(logits, batch[:, 1:])
        aux = load_balancing_loss(router_logits, ids, cfg.num_experts)
        return ce + args.aux_coef * aux, (ce, aux, drop)

    @jax.jit
    def train_step(p, s, batch, lr):
        (_, (ce, aux, drop)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        updates, s = opt.update(grads, s, p)
        updates = jax.tree.map(lambda u: lr * u, updates)
        return optax.apply_updates(p, updates), s, ce, aux, drop

    rng = np.random.default_rng(args.seed)
    quick_val = val_windows[:: max(1, len(val_windows) // args.batch_size)][: args.batch_size]
    drops = []
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
            vl = float(eval_fn(params, jnp.asarray(quick_val))[0])
            post["val"] = f"{vl:.3f}"
            tqdm.write(f"step {step}: train (EMA) {ema:.4f}  val {vl:.4f}  aux {aux:.4f}  "
                       f"dropped {100 * drop:.2f}%  {time.time() - t0:.0f} s")
        bar.set_postfix(post)
    bar.close()
    train_seconds = time.time() - t0
    steps = step
    if not steps:
        sys.exit("error: no training step ran (--steps 0 or --time-budget spent); nothing to export")

    final = final_evaluation(eval_fn, params, train_windows, val_windows, args.batch_size, cfg)

    # Export.
    os.makedirs(args.out, exist_ok=True)
    np_dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    out_tensors = export_tensors(graphdef, params, cfg, np_dtype)
    st_path = os.path.join(args.out, "model.safetensors")
    save_file(out_tensors, st_path, metadata={"format": "pt"})
    file_bytes = os.path.getsize(st_path)
    if file_bytes > args.max_file_mb * 2**20:
        sys.exit(f"error: {st_path} is {file_bytes / 2**20:.2f} MiB > --max-file-mb {args.max_file_mb}")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_config(args, args.dtype), f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, f, indent=2)
        f.write("\n")

    # Samples from the trained model in the stored dtype, then the export check against ft_jax.load.
    stored = jax.tree.map(lambda v: jnp.asarray(np.asarray(v).astype(np_dtype).astype(np.float32)), params)
    logits_fn = jax.jit(lambda p, toks: forward(graphdef, p, toks)[0][0])  # [T, V]
    sample_greedy, greedy_ids = sample(logits_fn, stored, cfg, args.sample_prompt, args.sample_tokens, 0.0, args.seed)
    sample_temp, _ = sample(logits_fn, stored, cfg, args.sample_prompt, args.sample_tokens, args.sample_temperature,
                            args.seed)
    print("--- greedy sample ---\n" + sample_greedy)
    print(f"--- temperature {args.sample_temperature} sample ---\n" + sample_temp)
    export_diff, greedy_n = export_check(args.out, stored, cfg, list(args.sample_prompt.encode("utf-8")), greedy_ids)
    print(f"export check: ft_jax.load({args.out}): max |parameter difference| = {export_diff:.3e}; its greedy "
          f"decode of {greedy_n} bytes equals the training forward's")

    niceness = os.nice(0)  # this process's scheduling niceness, written into the card's command
    expert_row_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * np.dtype(np_dtype).itemsize
    results = {
        "data_bytes": int(data.size), "train_bytes": int(train.size), "steps": steps,
        "train_seconds": train_seconds, "step_ms": 1000 * train_seconds / steps, "cores": os.cpu_count(),
        "niceness": niceness,
        "command": f"nice -n {niceness} python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:] if argv is None
                                                           else [os.path.relpath(__file__)] + list(argv)),
        **final, "drop_tail": float(np.mean(drops[-100:])), "eval_windows": len(val_windows),
        "num_params": num_params, "file_bytes": file_bytes, "dtype": args.dtype,
        "expert_row_bytes": expert_row_bytes, "expert_total_bytes": expert_row_bytes * cfg.num_layers * cfg.num_experts,
        "sample_prompt": args.sample_prompt, "sample_greedy": sample_greedy, "sample_temp": sample_temp,
        "export_max_abs_diff": export_diff, "export_greedy_tokens": greedy_n,
    }
    write_model_card(args.out, args, cfg, results)
    print(f"wrote {args.out}: model.safetensors {file_bytes / 2**20:.2f} MiB, config.json, generation_config.json, "
          "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
