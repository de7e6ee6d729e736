"""Building blocks shared by the model families: parameter stacks, attention inputs, dense projection, RMSNorm,
activations, rotary embeddings.

Weights keep Hugging Face layouts ([out, in]); a stack of like layers adds a leading axis ([n, out, in]) and is
indexed with a traced layer index inside the scanned decoder (ft_jax/models/decoder.py). Activations are
[B, T, H] (batch, tokens, hidden) or [N, H] with N = B * T. Design notes: docs/DESIGN.md (models).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import weakref
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.config import RopeScaling
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank, host_array, stack_on_huge_pages, stacked_buffer
from ft_jax.weight_formats import (QuantizedTensor, dequantize, dequantize_jnp, fp8_rowwise, interleave_rows,
                                   storage_format)

HIGHEST = jax.lax.Precision.HIGHEST


# Rows (tokens) up to which the CPU backend uses the FFI GEMV (weight-read bound below, compute bound above, where
# XLA's own dot is faster; measurements: docs/DESIGN.md, models).
FFI_MAX_ROWS = 128

ParamFactory = Callable[[str, tuple[int, ...], str], "np.ndarray | QuantizedTensor"]
"""make(hf_name, shape, kind) -> host (numpy) array of that shape in the model dtype (float32 or ml_dtypes.bfloat16).
kind: "weight" | "norm" | "bias", or "weight_f32" | "bias_f32": the same, kept in float32 whatever the model dtype
(transformers' _keep_in_fp32_modules_strict: DeepSeek's router weight and e_score_correction_bias). ``hf_name`` is
the Hugging Face (Hub) tensor name, e.g. "model.layers.0.self_attn.q_proj.weight".

A factory may also have ``host_weights(layers, stacked) -> HostWeights | None``: layers is, per layer of a stack (or
the one entry of a weight outside the layers, stacked False), the (hf_name, [rows, cols]) tensors concatenated along
their rows into that layer's matrix; it returns them in a host bank where every read of them takes the FFI
(:class:`HostWeights`), or None (the weights are then read through the factory as usual). Stacked.projection and the
embedding / lm_head ask it.

For kind "weight" of a 2-D matrix [rows, cols] the factory may instead return a numpy
ft_jax.weight_formats.QuantizedTensor (one matrix: data [rows, cols / values_per_item], scales
fmt.scale_shape(rows, cols); logical shape == shape): the model keeps it as stored and every projection read through
:func:`linear` dequantizes it per call. Weights read any other way (embeddings, the tied lm_head through
embed_tokens) are dequantized to the model dtype at construction; MLA's kv_b_proj, split per head into W_uk^T /
W_uv, keeps fp8 as stored (ft_jax/models/mla.py). Norms and biases are always arrays."""


def random_param_factory(seed: int = 0, dtype=np.float32, std: float = 0.02) -> ParamFactory:
    """Param factory for an untrained model: weights ~ N(0, std^2), norms 1, biases 0, drawn with numpy
    (deterministic in seed and parameter creation order) and cast to ``dtype`` (float32 or bfloat16)."""
    rng = np.random.default_rng(seed)
    model_dtype = np.dtype(jnp.dtype(dtype))

    def make(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        np_dtype = np.dtype(np.float32) if kind.endswith("_f32") else model_dtype
        kind = kind.removesuffix("_f32")
        if kind == "norm":
            return np.ones(shape, np_dtype)
        if kind == "bias":
            return np.zeros(shape, np_dtype)
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np_dtype)

    return make


def as_float(t, dtype) -> np.ndarray:
    """A factory's tensor as a numpy array in ``dtype``: a QuantizedTensor dequantized (float32, then one rounding to
    ``dtype``), an array unchanged."""
    if isinstance(t, QuantizedTensor):
        return dequantize(np.asarray(t.data), np.asarray(t.scales), t.fmt).astype(dtype)
    return t


def _one_format(ts: list, what: str) -> list:
    """Tensors (numpy arrays or QuantizedTensors) that become one parameter, brought to one storage format: all
    arrays stay; arrays mixed with quantized tensors: the quantized ones dequantized to the arrays' dtype; fp8 of
    different block rows (one column block width): all with one scale row per matrix row (fp8_rowwise).
    Raises ValueError naming ``what`` for other mixes (e.g. q8_0 with q4_0)."""
    quantized = [t for t in ts if isinstance(t, QuantizedTensor)]
    if not quantized:
        return ts
    plain = [t for t in ts if not isinstance(t, QuantizedTensor)]
    if plain:
        return [as_float(t, plain[0].dtype) for t in ts]
    fmts = {t.fmt for t in quantized}
    if len(fmts) == 1:
        return ts
    if {f.name for f in fmts} == {"fp8"} and len({f.block[1] for f in fmts}) == 1:
        return [fp8_rowwise(t) for t in ts]
    raise ValueError(f"{what}: its tensors come in different formats "
                     f"({', '.join(sorted(f'{f.name} {list(f.block)}' for f in fmts))}); one parameter needs one")


def stack(ts: list, what: str):
    """One tensor per layer (numpy arrays or QuantizedTensors; ``what`` names them in errors) -> [n, ...] on the
    device: a jax array, or a QuantizedTensor of stacked data / scales (written once onto huge pages,
    host_bank.stack_on_huge_pages)."""
    return _stack_parts([[t] for t in _one_format(ts, what)])


def _stack_parts(layers: list[list]):
    """Per layer its row parts (numpy arrays or QuantizedTensors, one storage format) -> [n, rows summed, ...]: each
    part written once, straight into its place in the stacked buffer (no per-layer concatenation first)."""
    if isinstance(layers[0][0], QuantizedTensor):
        fmt = layers[0][0].fmt
        data = stacked_buffer([[t.data for t in parts] for parts in layers])  # [n, rows, ...]
        scales = stacked_buffer([[t.scales for t in parts] for parts in layers])  # [n, rows, ...]
        # q4_0 on the CPU in its storage format (Q4_0_X16) when every part is whole groups of 16 rows, interleaved in
        # the stacked buffer: each group is one part's own
        stored = storage_format(fmt, *(t.data.shape[-2] for parts in layers for t in parts))
        if stored != fmt:
            interleave_rows(data.reshape(-1, data.shape[-1]), scales.reshape(-1, scales.shape[-1]))
        return QuantizedTensor(host_array(data), host_array(scales), stored)
    return stack_on_huge_pages(layers)


def _row_parts(layers: list[list], what: str) -> list[list]:
    """Every layer's matrices that are concatenated along their rows (fused q/k/v, gate/up), brought to one storage
    format (_one_format over all of them). fp8 parts whose row counts (all but the last) are not multiples of the
    block rows get one scale row per matrix row (fp8_rowwise): a scale block must not span two parts."""
    n = len(layers[0])
    flat = _one_format([t for parts in layers for t in parts], what)
    if isinstance(flat[0], QuantizedTensor):
        br = flat[0].fmt.block[0]
        if br > 1 and any(t.data.shape[0] % br for t in flat[:n - 1]):
            flat = [fp8_rowwise(t) for t in flat]
    return [flat[i:i + n] for i in range(0, len(flat), n)]


class HostWeights:
    """Dense weights read where the loader put them, in the rows of a host bank: a stack [n, O, K] (row l: layer
    l's matrix) or one matrix [O, K] (a bank of one row). Loaded from a checkpoint with mapped pages, the rows are the
    file's own page-cache pages, so the load copies nothing and touches no fresh memory (ft_jax.checkpoint,
    docs/DESIGN.md sec. 20.27). The CPU backend's FFI calls read the bank by id: :func:`linear` through
    ffi_ops.bank_linear at every row count, :func:`take_rows` through ffi_ops.bank_take. A pytree node without leaves
    (jit passes no buffer for it) whose static part is only (bank id, stacked), so that JAX's caches keyed on a tree
    structure (jit's donation cache among them) never keep the bank alive once the model is dropped; held in an
    nnx.Param like an array, ``param[...]`` gives it back.

    Args:
        bank: HostBank of float32 or bfloat16 rows [O, K].
        stacked: the logical shape is [n, O, K] (read with a layer index); False: [O, K], a bank of one row.
    Raises:
        ValueError: a bank of more than one row with stacked False, or rows that are not matrices.
    """

    def __init__(self, bank: HostBank, stacked: bool):
        if len(bank.row_shape) != 2 or (not stacked and bank.num_rows != 1):
            raise ValueError(f"HostWeights: bank {bank.id} of {bank.num_rows} rows {list(bank.row_shape)} is not "
                             f"{'a stack of matrices' if stacked else 'one matrix'}")
        self.bank, self.stacked = bank, stacked
        _LIVE_HOST_WEIGHTS[(bank.id, stacked)] = self

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape: (n, O, K) or (O, K)."""
        return ((self.bank.num_rows,) if self.stacked else ()) + tuple(self.bank.row_shape)

    @property
    def dtype(self) -> np.dtype:
        return self.bank.dtype

    @property
    def nbytes(self) -> int:
        return self.bank.nbytes

    def __getitem__(self, key):  # nnx.Param's value access, param[...]
        if key is not Ellipsis:
            raise TypeError("HostWeights supports only [...] (its rows are read by the FFI calls)")
        return self


# HostWeights by their static part (bank id, stacked): unflattening a tree finds the object its model holds.
_LIVE_HOST_WEIGHTS: "weakref.WeakValueDictionary[tuple[int, bool], HostWeights]" = weakref.WeakValueDictionary()


def _unflatten_host_weights(key: tuple[int, bool], children) -> HostWeights:
    w = _LIVE_HOST_WEIGHTS.get(key)
    if w is None:
        raise ValueError(f"HostWeights of host bank {key[0]} no longer exist (the model that held them was dropped)")
    return w


jax.tree_util.register_pytree_node(HostWeights, lambda w: ((), (w.bank.id, w.stacked)), _unflatten_host_weights)


class Stacked:
    """Reads one parameter of every layer of a stack and stacks them: nnx.Param [n, *shape] on the device (a jax
    array, or a QuantizedTensor with data [n, ...] and scales [n, ...] where the factory returns quantized tensors).

    Args: make: ParamFactory; layers: decoder layer indices of the stack (names "model.layers.{l}.{suffix}").
    """

    def __init__(self, make: ParamFactory, layers: tuple[int, ...]):
        self.make, self.layers = make, layers

    def _read(self, suffix: str, shape: tuple[int, ...], kind: str, layer: int):
        name = f"model.layers.{layer}.{suffix}"
        t = self.make(name, shape, kind)
        if isinstance(t, QuantizedTensor) and t.shape != tuple(shape):
            raise ValueError(f"{name}: the parameter factory returned a {t.fmt.name} tensor of shape {list(t.shape)}, "
                             f"expected {list(shape)}")
        return t

    def __call__(self, suffix: str, shape: tuple[int, ...], kind: str = "weight") -> nnx.Param:
        return nnx.Param(stack([self._read(suffix, shape, kind, l) for l in self.layers], suffix))

    def rows(self, parts: list[tuple[str, tuple[int, ...]]], kind: str = "weight") -> nnx.Param:
        """Concatenates several tensors of each layer along their first axis (fused q/k/v or gate/up)."""
        what = " + ".join(s for s, _ in parts)
        return nnx.Param(_stack_parts(_row_parts([[self._read(s, shape, kind, l) for s, shape in parts]
                                                  for l in self.layers], what)))

    def projection(self, parts: list[tuple[str, tuple[int, int]]]) -> nnx.Param:
        """A weight read only by :func:`linear`: one tensor [O, K] per layer, or several concatenated along their rows
        (fused q/k/v or gate/up) -> [n, O summed, K]. HostWeights where the factory keeps such weights in a host bank
        (its optional ``host_weights``: ParamFactory), else the stacked array or QuantizedTensor of :meth:`rows`."""
        host = getattr(self.make, "host_weights", None)
        if host is not None:
            w = host([[(f"model.layers.{l}.{s}", shape) for s, shape in parts] for l in self.layers], stacked=True)
            if w is not None:
                return nnx.Param(w)
        return self.rows(parts)

    def each(self, suffix: str, shape: tuple[int, ...], kind: str = "weight") -> list:
        """The factory's tensor of every layer (numpy arrays or QuantizedTensors of ``shape``) in one storage format,
        for a parameter the model rearranges before stacking it (:func:`stack`; MLA's kv_b_proj split per head)."""
        return _one_format([self._read(suffix, shape, kind, l) for l in self.layers], suffix)


class AttentionInputs(NamedTuple):
    """What every layer's attention needs from the step's positions (computed once per forward).

    positions: i32[B, T] (-1 = padding; a query sees the cache indices 0 .. its position); write_idx: i32[B, T]
    cache index per token (max_len = dropped: padding); rows: i32[B, T] the KV-cache row of each token (its batch row,
    or, where the step runs B of a larger cache's rows, the row it was given: attention_inputs).
    """

    positions: jax.Array
    write_idx: jax.Array
    rows: jax.Array


def attention_inputs(positions: jax.Array, max_len: int, rows: jax.Array | None = None) -> AttentionInputs:
    """Cache write indices and cache rows for positions i32[B, T] and a KV cache of max_len entries. rows: i32[B] the
    cache row of each sequence when the step runs B rows of a larger cache (attend_live_blocks then reads those rows
    only); None: row b is sequence b."""
    B, T = positions.shape
    write_idx = jnp.where(positions >= 0, positions, max_len)  # [B, T]; max_len is out of range: dropped
    rows = jnp.arange(B) if rows is None else rows.astype(jnp.int32)
    return AttentionInputs(positions, write_idx, jnp.broadcast_to(rows[:, None], (B, T)))


# Keys per block of the decode/prefill attention loop over the live part of the KV cache (measured: docs/DESIGN.md
# sec. 11, "Attention over the live KV blocks").
KV_BLOCK = 128
# Queries per block of a prefill chunk's attention (query_blocks; docs/DESIGN.md sec. 16).
QUERY_BLOCK = 128


def query_blocks(ctx: AttentionInputs, block: int | None = None) -> list[tuple[slice, AttentionInputs]]:
    """The queries of a step in consecutive blocks of ``block`` (default QUERY_BLOCK) tokens: [(static slice of the
    T axis, the AttentionInputs of those queries)]. Attending block by block, each block reads the keys up to its own
    last position (attend_live_blocks' trip count), so a prefill chunk's first queries skip the key blocks above the
    causal diagonal (the chunk's later keys). A step of at most one block (decode) is one block."""
    T = ctx.positions.shape[1]
    qb = QUERY_BLOCK if block is None else block
    if T <= qb:
        return [(slice(0, T), ctx)]
    return [(slice(q0, min(T, q0 + qb)), AttentionInputs(*(a[:, q0:q0 + qb] for a in ctx)))
            for q0 in range(0, T, qb)]


def attend_live_blocks(ctx: AttentionInputs, caches: tuple[jax.Array, ...], layer, dtype,
                       scores_fn: Callable[..., jax.Array], values_fn: Callable[..., jax.Array], out_shape,
                       sink: jax.Array | None = None, window=None, block: int | None = None) -> jax.Array:
    """Softmax attention over the live KV blocks of layer ``layer``: keys 0 .. max(positions) of the cache only.

    Two loops over the key blocks from the first one a query can see to ceil((max(positions) + 1) / block) (traced
    trip counts: one executable for any live length; with a sliding window the loops start at the block of the
    earliest position a query's window reaches, so a window layer reads the blocks inside the windows only): the
    first reads the keys block by block and keeps each query's running max m and normaliser l (online
    softmax, with the sink logit as one more key when given); the second reads keys and values again and adds
    (exp(s - m) / l rounded to ``dtype``) @ values per block in float32. The weights are the ones a full softmax
    over the visible keys gives (normalised before the rounding to ``dtype``, as transformers does). A block that
    would run past S is moved back to end at S, its keys already counted masked out. A cache of at most one block
    is one plain softmax.

    Args:
        ctx: AttentionInputs (positions i32[B, T], -1 = padding). caches: arrays [n, Bc, S, ...] of the stack
            (cache_store form); Bc = B, or more: the step's rows are ctx.rows' (one block of each gathered per load).
            layer: i32[] layer index. dtype: the activation dtype the blocks are loaded in.
        scores_fn(blocks) -> f32[B, *heads, T, blk]: scaled scores of one block (blocks: the caches' slices
            [B, blk, ...] in dtype). values_fn(probs [B, *heads, T, blk] in dtype, blocks) -> f32 out_shape.
        out_shape: the shape values_fn returns. sink: f32 broadcastable to [B, *heads, T, 1], or None.
        window: int or i32[] sliding window (keys at positions > p - window), or None. block: keys per block
            (default KV_BLOCK, read at trace time).
    Returns:
        f32 out_shape: the attention output. A query that sees no key gets finite, meaningless values.
    """
    S = caches[0].shape[2]
    blk = min(KV_BLOCK if block is None else block, S)
    subset = caches[0].shape[1] != ctx.positions.shape[0]  # B of the cache's rows: read those rows only
    live = jnp.max(ctx.positions) + 1
    num_blocks = jnp.maximum(1, (live + blk - 1) // blk)
    first_block = jnp.int32(0)
    if window is not None:  # the block of the earliest key any query's window reaches (padding queries see none)
        earliest = jnp.min(jnp.where(ctx.positions >= 0, ctx.positions, jnp.iinfo(jnp.int32).max // 2)) - window + 1
        first_block = jnp.minimum(jnp.maximum(earliest, 0) // blk, num_blocks).astype(jnp.int32)
    fmin = jnp.finfo(jnp.float32).min

    def block_of(c, start):  # [B, blk, ...]: keys start .. start + blk - 1 of the step's rows
        layer_i = jnp.asarray(layer, jnp.int32)
        if not subset:
            return jax.lax.dynamic_slice(c, (layer_i, 0, start) + (0,) * (c.ndim - 3),
                                         (1, c.shape[1], blk) + c.shape[3:])[0]
        return jax.vmap(lambda r: jax.lax.dynamic_slice(c, (layer_i, r, start) + (0,) * (c.ndim - 3),
                                                        (1, 1, blk) + c.shape[3:])[0, 0])(ctx.rows[:, 0])

    def load(j):
        start = jnp.minimum(j * blk, S - blk)
        blocks = tuple(cache_load(block_of(c, start), dtype) for c in caches)
        key_pos = start + jnp.arange(blk)  # [blk]
        pos = ctx.positions[:, :, None]  # [B, T, 1]
        visible = (key_pos <= pos) & (key_pos >= j * blk)  # [B, T, blk]
        if window is not None:
            visible &= key_pos > pos - window
        s = scores_fn(blocks)  # f32[B, *heads, T, blk]
        visible = visible.reshape(visible.shape[:1] + (1,) * (s.ndim - 3) + visible.shape[1:])
        # finfo.min (not -inf): a query that sees no key gets finite (uniform) weights instead of NaN.
        return blocks, jnp.where(visible, s, fmin)

    def stats(j, ml):
        m, l = ml
        s = load(j)[1]
        m_new = jnp.maximum(m, s.max(-1, keepdims=True))
        return m_new, l * jnp.exp(m - m_new) + jnp.exp(s - m_new).sum(-1, keepdims=True)

    if blk == S:  # one block: a plain softmax over the cache (a loop here makes XLA copy the cache to update it)
        blocks, s = load(0)
        if sink is not None:
            s = jnp.concatenate([s, jnp.broadcast_to(sink, s.shape[:-1] + (1,)).astype(jnp.float32)], axis=-1)
        probs = jax.nn.softmax(s, axis=-1)[..., :S]
        return values_fn(probs.astype(dtype), blocks)

    probe = jax.eval_shape(lambda: load(0)[1])
    stat_shape = probe.shape[:-1] + (1,)
    if sink is None:
        ml0 = (jnp.full(stat_shape, fmin), jnp.zeros(stat_shape, jnp.float32))
    else:
        ml0 = (jnp.broadcast_to(sink, stat_shape).astype(jnp.float32), jnp.ones(stat_shape, jnp.float32))
    m, l = jax.lax.fori_loop(first_block, num_blocks, stats, ml0)

    def accumulate(j, acc):
        blocks, s = load(j)
        return acc + values_fn((jnp.exp(s - m) / l).astype(dtype), blocks)

    return jax.lax.fori_loop(first_block, num_blocks, accumulate, jnp.zeros(out_shape, jnp.float32))


_PREFILL_DOTS = contextvars.ContextVar("ft_jax_prefill_dots", default=False)


@contextlib.contextmanager
def prefill_dots() -> Iterator[None]:
    """While a prefill step is traced inside this context, ``linear`` gives plain float weights XLA's dot at every row
    count (where the FFI has no register tiles: _bf16_tiles), not the FFI GEMV up to FFI_MAX_ROWS rows and XLA's dot
    above: the two sum in different orders, so a prompt token's projections (and KV cache, and first token) would
    depend on the prefill chunk and on the other prompts of its call (measured on an AVX2 CPU: a 300-token prompt's
    KV cache in chunks of 16 against one call of 512 differed at 14 of 19200 values). XLA's dot gives a row the same
    bits at any row count from 2 (a prefill call has at least MIN_PREFILL_BUCKET rows). The decode step keeps the
    GEMV, which reads the weights at memory bandwidth."""
    token = _PREFILL_DOTS.set(True)
    try:
        yield
    finally:
        _PREFILL_DOTS.reset(token)


@contextlib.contextmanager
def sequence_dots() -> Iterator[None]:
    """Inside a prefill step's prefill_dots, for a projection with one row per sequence (the lm_head of the last
    token of each prompt): ``linear`` takes the path the decode step takes, the FFI GEMV up to FFI_MAX_ROWS rows. Its
    rows are the batch's sequences whatever the chunk, and the GEMV gives a row the same bits at any row count, so
    prefill_dots' reason does not apply; XLA's dot would convert a bf16 [V, H] weight to float32 as a whole on every
    call (262 MB of fresh memory for a 32000 x 2048 lm_head: docs/DESIGN.md sec. 20.18)."""
    token = _PREFILL_DOTS.set(False)
    try:
        yield
    finally:
        _PREFILL_DOTS.reset(token)


def _bf16_tiles(x2: jax.Array, w: jax.Array) -> bool:
    """Whether the FFI call takes a bf16 x bf16 product at any row count: where the kernels have the AVX-512 BF16 dot,
    its register tiles run at XLA's dot's rate (xla_ffi/gemm_bf16.h; docs/DESIGN.md sec. 15) and give each row the
    bits of the one-row GEMV, so a token's projection never depends on the rows it shares a call with (the chunk
    size, the other prompts of a batch). XLA's dot sums in another order."""
    bf16 = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))
    return x2.dtype == jnp.bfloat16 and w.dtype in bf16 and ffi_ops.kernel_isa() == "avx512bf16"


def host_weights_apply(dtype) -> bool:
    """Whether dense projections of ``dtype`` (the model dtype) may live in host banks (:class:`HostWeights`): where
    :func:`linear` takes the FFI call at every row count for them, so no read needs them as a jax array. That is the
    CPU backend with bf16 weights and activations and the AVX-512 BF16 dot (_bf16_tiles: XLA's dot is never faster
    there); elsewhere long prefills take XLA's dot, and other backends read device arrays."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"
            and ffi_ops.kernel_isa() == "avx512bf16")


def linear(x: jax.Array, w: "jax.Array | QuantizedTensor | HostWeights", layer=None) -> jax.Array:
    """y[..., o] = sum_k x[..., k] * w[layer, o, k] with float32 accumulation.

    Up to FFI_MAX_ROWS rows on the CPU backend this is the ``ft_jax_linear`` FFI call (ffi_ops.linear), which reads
    the weight in place at memory bandwidth whatever the shapes; XLA:CPU's own bf16 matrix-vector products reach that
    only for a fused vector of < 16 KiB or a YNNPACK dot with >= 2 rows, and it converts a dynamically sliced bf16
    weight stack to float32 as a whole (measured: docs/DESIGN.md sec. 5). bf16 x bf16 takes the FFI call at any row
    count where the CPU has the AVX-512 BF16 dot (_bf16_tiles: the same bits per row whatever the rows). Other larger
    calls (long prefills, training), every call of a prefill step elsewhere (prefill_dots) and other backends use
    XLA's dot on ``w[layer]``, which is also the only path jax can differentiate.

    A QuantizedTensor weight (any block format of ft_jax.weight_formats) is read as stored: the FFI call reads its
    data and scales (ffi_ops.linear with scales and weight_format; dequantized in registers, xla_ffi/quant_dot.h);
    XLA's path slices the layer's data and scales, dequantizes them to x's dtype (weight_formats.dequantize_jnp:
    exact in float32, one rounding in bfloat16) and takes the same dot.

    HostWeights (the loader makes them only where every call takes the FFI: the CPU backend, bf16 with the AVX-512
    BF16 dot) are read from their host bank by ffi_ops.bank_linear at every row count: the same kernel, the same bits.

    Args:
        x: f32 | bf16 [..., K] activations.
        w: f32 | bf16 (or uint16 holding bf16 bits: cache_store) [n, O, K] stack of weights with ``layer`` an i32[]
            index (traced or int), or [O, K] with layer None; or a QuantizedTensor of logical shape [n, O, K] /
            [O, K] (data [n, *fmt.data_shape(O, K)], scales [n, *fmt.scale_shape(O, K)], or without the n axis); or
            HostWeights of either logical shape.
        layer: index into the stack, or None for a single [O, K] weight.
    Returns:
        f32[..., O].
    Raises:
        ValueError: K of x and w differ, or ``layer`` is missing for a stack / given for a single weight.
    """
    wshape = tuple(w.shape)  # logical [n, O, K] or [O, K]
    if (layer is None) != (len(wshape) == 2):
        raise ValueError(f"linear: a [n, O, K] stack needs a layer index and an [O, K] weight none; got w "
                         f"{wshape} with layer {layer!r}")
    K, O = wshape[-1], wshape[-2]
    if x.shape[-1] != K:
        raise ValueError(f"linear: x {x.shape} does not end in K = {K} of w {wshape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)  # [N, K]
    index = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)

    if isinstance(w, HostWeights):  # the CPU backend's bank, at every row count (the same bits per row at any)
        return ffi_ops.bank_linear(x2, w.bank, index).reshape(*lead, O)

    if isinstance(w, QuantizedTensor):
        xla_q = functools.partial(_quantized_dot, w.fmt)
        operands = (x2, w.data, w.scales, index)
        if x2.shape[0] > FFI_MAX_ROWS:
            return xla_q(*operands).reshape(*lead, O)
        def cpu_q(x2, data, scales, index):  # the GEMV reading the stored bytes (xla_ffi/quant_dot.h)
            return ffi_ops.linear(x2, data, index, scales=scales, weight_format=w.fmt)

        return jax.lax.platform_dependent(*operands, cpu=cpu_q, default=xla_q).reshape(*lead, O)

    def xla_dot(x2, w, index):
        if w.ndim == 3 and w.dtype == jnp.bfloat16:  # slice the bits: XLA:CPU converts a bf16 stack that it
            w, index = jax.lax.optimization_barrier((w, index))  # slices to float32 as a whole; the barrier keeps
            w = jax.lax.bitcast_convert_type(w, jnp.uint16)  # the bitcast in the loop, fused into the slice (20.11)
        wl = w if w.ndim == 2 else jax.lax.dynamic_index_in_dim(w, index, keepdims=False)  # [O, K]
        wl = _unbits(wl, jnp.bfloat16) if wl.dtype == jnp.uint16 else wl
        return jax.lax.dot_general(x2.astype(wl.dtype), wl, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                   preferred_element_type=jnp.float32)

    if (x2.shape[0] > FFI_MAX_ROWS or _PREFILL_DOTS.get()) and not _bf16_tiles(x2, w):
        return xla_dot(x2, w, index).reshape(*lead, O)
    y = jax.lax.platform_dependent(x2, w, index, cpu=ffi_ops.linear, default=xla_dot)  # f32[N, O]
    return y.reshape(*lead, O)


def _quantized_dot(fmt, x2: jax.Array, data: jax.Array, scales: jax.Array, index: jax.Array) -> jax.Array:
    """x2 [N, K] @ (weight ``index`` of the stack (data, scales) of ``fmt``, dequantized to x2's dtype)^T -> f32[N, O]
    (XLA's dot, float32 accumulation)."""
    if data.ndim == 3:  # a stack: this layer's data and scales only
        data = jax.lax.dynamic_index_in_dim(data, index, keepdims=False)  # [O, Kd]
        scales = jax.lax.dynamic_index_in_dim(scales, index, keepdims=False)  # [O or ceil(O / br), Ks]
    wl = dequantize_jnp(QuantizedTensor(data, scales, fmt), x2.dtype)  # [O, K]
    return jax.lax.dot_general(x2, wl, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def _bits(x: jax.Array) -> jax.Array:
    """bf16 data as uint16 bits (other dtypes unchanged): XLA:CPU moves bf16 gathers, slices and dynamic updates to
    float32 and then converts the whole operand (a full float32 copy of an embedding table or a KV-cache stack per
    step); on the integer view they stay plain data movement."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _unbits(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if dtype == jnp.bfloat16 else x


def cache_store(x: jax.Array) -> jax.Array:
    """The form a KV cache (or the embedding table) keeps values in: uint16 bits for bf16 (see _bits), else x."""
    return _bits(x)


def cache_zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    """A zero KV cache of ``shape`` for values of ``dtype`` in cache_store's form (bf16 as uint16 bits: zero bits
    are +0.0), made directly: jnp.zeros then cache_store would be two XLA programs per shape to compile or look up."""
    return jnp.zeros(shape, jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else dtype)


def cache_load(x: jax.Array, dtype) -> jax.Array:
    """Values of a KV cache slice in ``dtype`` (the inverse of cache_store)."""
    return _unbits(x, dtype)


def take_rows(table: "jax.Array | HostWeights", ids: jax.Array, dtype) -> jax.Array:
    """The embedding lookup: rows ``ids`` (i32[...] in [0, V)) of ``table`` [V, H] -> [..., H] in ``dtype``. table:
    an array in cache_store's form (XLA's gather), or HostWeights of one matrix (ffi_ops.bank_take, which raises at run
    time for an id outside [0, V))."""
    if isinstance(table, HostWeights):
        rows = ffi_ops.bank_take(ids.reshape(-1).astype(jnp.int32), table.bank)  # [N, H]
        return rows.reshape(*ids.shape, rows.shape[-1]).astype(dtype)
    return cache_load(jnp.take(table, ids, axis=0), dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * (x / sqrt(mean(x^2, -1) + eps)), computed in float32 and cast back to x.dtype before the scale
    (transformers' LlamaRMSNorm / MixtralRMSNorm / Qwen*RMSNorm / OlmoeRMSNorm). x: [..., D]; weight: [D].

    A vector whose sum of squares overflows float32 (the mean is that sum over D, as in transformers: an RMS beyond
    sqrt(3.4e38 / D), 2.9e17 at D = 4096; weights of 1e30 and the like) comes out NaN, where transformers' formula
    gives 0 (x * rsqrt(inf)): a 0 would pass the model on as finite numbers and end in logits that are all equal,
    decoded into token 0 without a word; NaN ends in the step's non-finite logits check
    (engine.sampling.NonFiniteLogitsError)."""
    xf = x.astype(jnp.float32)
    mean_square = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = jnp.where(mean_square < jnp.inf, xf * jax.lax.rsqrt(mean_square + eps), jnp.nan)
    return weight * xf.astype(x.dtype)


def activation_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    """Activation by expert-kernel name: "silu" (x * sigmoid(x)) or "gelu_tanh" (tanh-approximated GELU).

    Raises:
        NotImplementedError: another name.
    """
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise NotImplementedError(f"activation {name!r} (supported: silu, gelu_tanh)")


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, layer, activation: str) -> jax.Array:
    """down(act(gate(x)) * up(x)) of the dense MLPs and shared experts, from stacked weights.

    Args:
        x: [..., H] in the model dtype.
        gate_up: [n, 2I, H] (rows 0..I-1 gate_proj, I..2I-1 up_proj: one read of both); down: [n, H, I].
        layer: i32[] index into the stacks.
        activation: "silu" | "gelu_tanh".
    Returns:
        [..., H] in x.dtype (each projection rounded to x.dtype, as transformers does).
    """
    inter = down.shape[-1]
    gu = linear(x, gate_up, layer).astype(x.dtype)  # [..., 2I]
    a = activation_fn(activation)(gu[..., :inter]) * gu[..., inter:]  # [..., I]
    return linear(a, down, layer).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies f64[head_dim / 2] and the cos/sin scale (attention factor), computed on the host.

    Default (Su et al. 2021, RoFormer): inv_freq[i] = theta^(-2i/D), scale 1. YaRN (Peng et al. 2023; transformers'
    ``_compute_yarn_parameters``): frequencies interpolated by the factor s below a ramp between the dimensions
    that turn beta_fast and beta_slow times over the original context, kept (extrapolated) above it; scale
    0.1 ln s + 1, or DeepSeek's get_mscale(s, mscale) / get_mscale(s, mscale_all_dim), or attention_factor.
    """
    D = head_dim
    pos_freqs = theta ** (np.arange(0, D, 2, dtype=np.float64) / D)  # [D/2]
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    s = scaling.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if scaling.attention_factor is not None:
        attention_factor = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention_factor = get_mscale(s, scaling.mscale) / get_mscale(s, scaling.mscale_all_dim)
    else:
        attention_factor = get_mscale(s)

    def correction_dim(rotations: float) -> float:
        return D * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: divide it by s
    inv_freq = (1.0 / (s * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for positions i32[B, T]: angle = position * inv_freq (rope_frequencies), duplicated to D (the
    rotate-half layout), times the attention factor. Returns (cos, sin) f32[B, T, D]."""
    inv_freq, scale = rope_frequencies(head_dim, theta, scaling)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, D]
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = concat(-x2, x1). x: [B, T, heads, D];
    cos, sin: f32[B, T, D] (cast to x.dtype, as transformers does).

    rotate_half is the two halves reversed along an axis of 2 and the first negated (exact): XLA fuses a reverse into
    the loop that uses it, where a concatenate stays an op of its own with its own inputs' ops (docs/DESIGN.md
    sec. 20); the values are the formula's. bf16 heads with float32 tables of their own [B, T, D] on the CPU: one FFI
    call with the same roundings and values (ffi_ops.rope), as XLA:CPU does not vectorize that loop (sec. 20.33);
    tables that broadcast, or bf16 ones, take XLA's ops."""
    B, T, _, D = x.shape
    if x.dtype == jnp.bfloat16 and all(t.dtype == jnp.float32 and t.shape == (B, T, D) for t in (cos, sin)):
        return jax.lax.platform_dependent(x, cos, sin, cpu=ffi_ops.rope, default=_apply_rope_xla)
    return _apply_rope_xla(x, cos, sin)


def _apply_rope_xla(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """apply_rope in XLA's ops."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)  # [..., 2, D/2]: (x1, x2)
    sign = jnp.asarray([-1, 1], x.dtype)[:, None]
    rot = (halves[..., ::-1, :] * sign).reshape(x.shape)  # (-x2, x1)
    return x * cos + rot * sin
