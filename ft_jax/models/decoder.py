"""Flax NNX decoder of the supported MoE families: decoder layer, scanned layer stacks and the model.

Forward (functional over the KV cache and the expert backend, jit-able with ``nnx.split`` / ``nnx.merge``)::

    logits, kv_cache, expert_state = model(tokens, positions, kv_cache, expert_state, experts)

Shapes: tokens, positions i32[B, T]; hidden states [B, T, H] in the model dtype; logits f32[B, T, V]. Consecutive
layers of one kind (MoE or dense) form a DecoderStack: parameters [n, ...], one ``lax.scan`` over the n layers.

Positions rule: ``positions[b, t]`` is the token's 0-based position in its own sequence and also its KV-cache index;
a query sees cache indices 0 .. positions[b, t] of its row (within the sliding window, if any); callers write the
positions of a sequence in order without gaps and below ``kv_cache.max_len``; ``positions[b, t] = -1`` marks a
padding slot (nothing cached, no expert routed, finite but meaningless logits). Design notes and numerics:
docs/DESIGN.md (models).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.config import MoEConfig
from ft_jax.kernels.host_bank import host_array, huge_page_buffer
from ft_jax.models.attention import GroupedQueryAttention
from ft_jax.models.layers import (AttentionInputs, ParamFactory, Stacked, as_float, attention_inputs, gated_mlp, linear,
                                  rms_norm, sequence_dots, take_rows)
from ft_jax.models.mla import MultiHeadLatentAttention
from ft_jax.models.moe import DeepseekMoEBlock, ExpertBackend, MoEBlock
from ft_jax.weight_formats import QuantizedTensor, in_storage_format


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static-size KV cache: one tuple of arrays per DecoderStack, each array [n, B, max_len, ...] (n = layers of the
    stack; the attention module decides what is cached, e.g. (k, v) [n, B, S, KVH, D] for grouped-query attention,
    (latent [n, B, S, C], rope_key [n, B, S, dr]) for DeepSeek's latent attention, ft_jax/models/mla.py).
    Index s of row b holds what the sequence's token at position s left behind.
    """

    stacks: tuple[tuple[jax.Array, ...], ...]

    @property
    def batch_size(self) -> int:
        return self.stacks[0][0].shape[1]

    @property
    def max_len(self) -> int:
        return self.stacks[0][0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return sum(a.nbytes for stack in self.stacks for a in stack)


class Intermediates(NamedTuple):
    """Per-layer values returned with ``collect=True`` (parity checks against transformers, routing traces).

    hidden_states: [num_layers + 1, B, T, H]: embeddings, output of layers 0..L-2, and the final-norm output of the
        last layer (the transformers ``output_hidden_states`` convention).
    router_logits: f32[num_moe_layers, B, T, E]; topk_ids: i32[num_moe_layers, B, T, k] (-1 for padding);
    topk_weights: f32[num_moe_layers, B, T, k] (the combine weights applied).
    """

    hidden_states: jax.Array
    router_logits: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array



class DenseMLP(nnx.Module):
    """The gated MLP of dense decoder layers (Qwen2/3-MoE mlp_only_layers, DeepSeek first_k_dense_replace),
    gate/up fused [n, 2I, H], down [n, H, I]."""

    def __init__(self, cfg: MoEConfig, p: Stacked):
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_up = p.projection([("mlp.gate_proj.weight", (I, H)), ("mlp.up_proj.weight", (I, H))])  # [n, 2I, H]
        self.down = p.projection([("mlp.down_proj.weight", (H, I))])  # [n, H, I]

    def __call__(self, i, x, valid, expert_state, experts: ExpertBackend):
        """x: [B, T, H]. Returns (y [B, T, H], expert_state unchanged, None: no routing)."""
        return gated_mlp(x, self.gate_up[...], self.down[...], i, self.activation), expert_state, None



def _on_device(t):
    """A factory's numpy array or QuantizedTensor (data and scales) as jax arrays, copied at most once
    (host_bank.host_array: a file view the CPU backend can use in place is not copied at all)."""
    if isinstance(t, QuantizedTensor):
        t = in_storage_format(t, huge_page_buffer)  # q4_0 on the CPU: Q4_0_X16 where its rows are groups of 16
        return QuantizedTensor(host_array(t.data), host_array(t.scales), t.fmt)
    return host_array(t)


def _layer_kind(cfg: MoEConfig, layer: int) -> str:
    return "dense" if cfg.moe_layer_index(layer) is None else "moe"


class DecoderStack(nnx.Module):
    """n consecutive decoder layers of one kind, parameters stacked on a leading axis, run as one ``lax.scan``.

    Each layer is pre-norm: h = x + attn(norm(x)); out = h + ffn(norm(h)), with the family's attention module and
    a DenseMLP or an MoEBlock as the ffn. Every module of a stack takes the traced layer index i first and reads
    its stacked parameters at i; caches are tuples of [n, B, S, ...] arrays updated in place at i.

    Args:
        cfg: model config. make: ParamFactory. layers: the decoder layer indices of the stack (consecutive, one kind).
    """

    def __init__(self, cfg: MoEConfig, make: ParamFactory, layers: tuple[int, ...]):
        H = cfg.hidden_size
        self.cfg, self.layers = cfg, layers
        p = Stacked(make, layers)
        self.input_norm = p("input_layernorm.weight", (H,), "norm")  # [n, H]
        self.post_norm = p("post_attention_layernorm.weight", (H,), "norm")  # [n, H]
        self.attn = MultiHeadLatentAttention(cfg, p) if cfg.kv_lora_rank else GroupedQueryAttention(cfg, p)
        moe_base = cfg.moe_layer_index(layers[0])
        if moe_base is None:
            self.ffn = DenseMLP(cfg, p)
        elif cfg.family in ("deepseek_v2", "deepseek_v3"):
            self.ffn = DeepseekMoEBlock(cfg, p, moe_base)
        else:
            self.ffn = MoEBlock(cfg, p, moe_base)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def init_cache(self, batch_size: int, max_len: int, dtype) -> tuple[jax.Array, ...]:
        """This stack's zero KV cache (arrays [n, B, max_len, ...]; the attention module defines them)."""
        return self.attn.init_cache(self.num_layers, batch_size, max_len, dtype)

    def layer(self, i, h, cache, ctx: AttentionInputs, valid, expert_state, experts: ExpertBackend):
        """Decoder layer i of the stack (the scan body). h: [B, T, H]; valid: bool[B, T].
        Returns (h, cache, expert_state, routing (router logits [N, E], topk ids [N, k], weights [N, k]) or None)."""
        eps = self.cfg.rms_norm_eps
        with jax.named_scope("attention"):  # named scopes: the parts of a profile (scripts/profile_prefill.py)
            a, cache = self.attn(i, rms_norm(h, self.input_norm[...][i], eps), ctx, cache)
        h = h + a
        with jax.named_scope("ffn"):
            y, expert_state, routing = self.ffn(i, rms_norm(h, self.post_norm[...][i], eps), valid, expert_state,
                                                experts)
        return h + y, cache, expert_state, routing

    def __call__(self, h, cache, ctx: AttentionInputs, valid, expert_state, experts: ExpertBackend,
                 collect: bool = False):
        """All n layers as one lax.scan. Returns (h, cache, expert_state, per-layer outputs or None): with collect,
        the output of every layer [n, B, T, H] and, for MoE stacks, the routing [n, N, ...]."""

        def body(carry, i):
            h, cache, expert_state = carry
            h, cache, expert_state, routing = self.layer(i, h, cache, ctx, valid, expert_state, experts)
            return (h, cache, expert_state), ((h, routing) if collect else None)

        (h, cache, expert_state), ys = jax.lax.scan(body, (h, cache, expert_state),
                                                    jnp.arange(self.num_layers, dtype=jnp.int32))
        return h, cache, expert_state, ys


class MoETransformer(nnx.Module):
    """Decoder-only MoE language model (dense parameters only; routed experts live in an expert backend).

    Construct with a :data:`ParamFactory` (``ft_jax.checkpoint.load_checkpoint`` passes one that reads the
    checkpoint; ft_jax.models.layers.random_param_factory gives an untrained model). Parameters are in the
    factory's dtype.
    """

    def __init__(self, cfg: MoEConfig, make: ParamFactory):
        self.cfg = cfg
        V, H = cfg.vocab_size, cfg.hidden_size
        norm = make("model.norm.weight", (H,), "norm")  # [H] in the model dtype
        host = getattr(make, "host_weights", None)  # the factory's host banks, where it keeps the weights there
        # [V, H]: HostWeights where the factory keeps it in a host bank, else an array in cache_store's form (a bf16
        # table as its uint16 bits: XLA:CPU would convert the whole table to float32 for every gather, a 250 MiB copy
        # per step for a 32000 x 2048 vocabulary). take_rows and linear read either. The table is gathered (and read
        # by the tied lm_head), so a quantized one is dequantized here.
        table = host([[("model.embed_tokens.weight", (V, H))]], stacked=False) if host else None
        if table is None:
            embed = as_float(make("model.embed_tokens.weight", (V, H), "weight"), norm.dtype)
            table = host_array(embed.view(np.uint16) if embed.dtype == jnp.bfloat16 else embed)
        self.embed_tokens = nnx.Param(table)
        runs = itertools.groupby(range(cfg.num_layers), key=lambda l: _layer_kind(cfg, l))
        self.stacks = nnx.List([DecoderStack(cfg, make, tuple(layers)) for _, layers in runs])
        self.norm = nnx.Param(jax.device_put(np.array(norm)))  # a copy of the file view, no XLA program
        head = None
        if not cfg.tie_word_embeddings:  # [V, H]
            head = host([[("lm_head.weight", (V, H))]], stacked=False) if host else None
            head = nnx.Param(head if head is not None else _on_device(make("lm_head.weight", (V, H), "weight")))
        self.lm_head = head

    @property
    def dtype(self):
        """Parameter (and activation) dtype."""
        return self.norm[...].dtype

    def init_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """Zero KV cache in the model dtype for batch_size sequences of up to max_len tokens."""
        return KVCache(tuple(s.init_cache(batch_size, max_len, self.dtype) for s in self.stacks))

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, expert_state: Any,
                 experts: ExpertBackend, *, rows: jax.Array | None = None, last_logits_only: bool = False,
                 collect: bool = False):
        """Run T tokens of B sequences through the model, updating the KV cache.

        Args:
            tokens: i32[B, T] token ids (any valid id in padding slots).
            positions: i32[B, T] per-sequence positions, -1 = padding (see the module docstring).
            kv_cache: :class:`KVCache` with batch size B, or more with ``rows``.
            expert_state: pytree threaded through ``experts``.
            rows: i32[B] the KV-cache row of each sequence, when the cache has more rows than B (a decode step over
                the live rows of a larger batch, ft_jax/engine/batch.py); None: sequence b is row b.
            experts: :class:`ExpertBackend`, called once per MoE layer in layer order with N = B*T tokens.
            last_logits_only: compute logits for t = T-1 only (shape [B, 1, V]): the next-token logits of every
                row of a left-padded batch.
            collect: also return :class:`Intermediates` (static: a separate executable).
        Returns:
            (logits f32[B, T, V] (or [B, 1, V]), kv_cache, expert_state) and, with collect, Intermediates.
        """
        cfg = self.cfg
        B, T = tokens.shape
        if (rows is None) != (kv_cache.batch_size == B):
            raise ValueError(f"{B} sequences and a KV cache of {kv_cache.batch_size} rows: give rows (i32[{B}], the "
                             f"cache row of each) exactly when the cache has more rows than sequences")
        ctx = attention_inputs(positions, kv_cache.max_len, rows)
        valid = positions >= 0  # [B, T]
        h = take_rows(self.embed_tokens[...], tokens, self.dtype)  # [B, T, H]
        hidden, routing, caches = [h[None]], [], []
        for stack, cache in zip(self.stacks, kv_cache.stacks):
            h, cache, expert_state, ys = stack(h, cache, ctx, valid, expert_state, experts, collect)
            caches.append(cache)
            if collect:
                hidden.append(ys[0])
                if ys[1] is not None:
                    routing.append(ys[1])
        with jax.named_scope("lm_head"):
            h = rms_norm(h, self.norm[...], cfg.rms_norm_eps)
            head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
            if last_logits_only:  # one row per sequence: the decode step's GEMV (layers.sequence_dots)
                with sequence_dots():
                    logits = linear(h[:, -1:], head)  # f32[B, 1, V]
            else:
                logits = linear(h, head)  # f32[B, T, V]
        kv_cache = KVCache(tuple(caches))
        if not collect:
            return logits, kv_cache, expert_state
        hidden_states = jnp.concatenate(hidden)[:cfg.num_layers + 1]  # [L + 1, B, T, H]
        hidden_states = hidden_states.at[-1].set(h)
        E, k = cfg.num_experts, cfg.top_k
        logits_l = jnp.concatenate([r[0] for r in routing]).reshape(-1, B, T, E)
        aux = Intermediates(hidden_states=hidden_states, router_logits=logits_l,
                            topk_ids=jnp.concatenate([r[1] for r in routing]).reshape(-1, B, T, k),
                            topk_weights=jnp.concatenate([r[2] for r in routing]).reshape(-1, B, T, k))
        return logits, kv_cache, expert_state, aux
