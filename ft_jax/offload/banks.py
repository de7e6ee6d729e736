"""The expert banks of a checkpoint as one bundle (ExpertBanks): every HostBank of the routed experts by name."""

from __future__ import annotations

import dataclasses

import numpy as np

from ft_jax import weight_formats
from ft_jax.kernels.host_bank import HostBank
from ft_jax.weight_formats import WeightFormat


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertBanks:
    """Every host bank of the routed experts, as one named collection (flat row id = moe_layer * E + expert).

    Attributes:
        gate_up: HostBank [L*E, 2I, H] (rows: gate_proj then up_proj).
        down: HostBank [L*E, H, I].
        gate_up_bias: HostBank [L*E, 2I] (gate bias then up bias) and down_bias: HostBank [L*E, H], both or
            neither (gpt-oss's expert biases; float32 / bfloat16 whatever the weight format).
        gate_up_scale, down_scale: the block scales of a quantized ``format``, both or neither (present iff
            format.quantized): gate_up_scale [L*E, 2 * format.scale_rows(I), ceil(H / bc)] (the gate matrix's scale
            grid then the up matrix's, ft_jax.weight_formats module docstring), down_scale [L*E,
            *format.scale_shape(H, I)], in format.scale_dtype.
        format: the WeightFormat of gate_up and down (ft_jax.weight_formats); default: the float format of the
            gate_up bank's dtype (F32 or BF16). gate_up then holds format.data_shape(2I, H) per row in
            format.data_dtype (e.g. q4_0: u8 [2I, H / 2]), down format.data_shape(H, I).
    The order of :attr:`names` (gate_up, down, then the optional banks that are present) is the order of the slot
    pools and of the slot_fill operands. A new kind of bank is one more optional field here plus its name in
    ``_OPTIONAL``; :attr:`expert_bytes` and :meth:`pool_shapes` then count it everywhere.
    Raises:
        ValueError: only one of the two bias or scale banks, scale banks for a float format (or none for a
            quantized one), a data or scale bank whose dtype or row shape does not match the format, or banks with
            different row counts (each message names the bank, expected vs got).
    """

    gate_up: HostBank
    down: HostBank
    gate_up_bias: HostBank | None = None
    down_bias: HostBank | None = None
    gate_up_scale: HostBank | None = None
    down_scale: HostBank | None = None
    format: WeightFormat | None = None

    _REQUIRED = ("gate_up", "down")
    _OPTIONAL = ("gate_up_bias", "down_bias", "gate_up_scale", "down_scale")

    def __post_init__(self):
        if self.format is None:
            object.__setattr__(self, "format", weight_formats.float_format(self.gate_up.dtype))
        if (self.gate_up_bias is None) != (self.down_bias is None):
            raise ValueError("ExpertBanks: pass both expert bias banks (gate_up_bias and down_bias) or neither")
        if (self.gate_up_scale is None) != (self.down_scale is None):
            raise ValueError("ExpertBanks: pass both expert scale banks (gate_up_scale and down_scale) or neither")
        fmt = self.format
        if fmt.quantized != (self.gate_up_scale is not None):
            raise ValueError(f"ExpertBanks: format {fmt.name} {'needs' if fmt.quantized else 'has no'} scale banks "
                             f"(gate_up_scale, down_scale), got {'none' if self.gate_up_scale is None else 'them'}")
        rows = {name: bank.num_rows for name, bank in self.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"ExpertBanks: every bank needs the same number of rows (L*E), got {rows}")
        I, H = self.gate_up.row_shape[0] // 2, self.down.row_shape[0]
        for name, (shape, dtype) in weight_formats.expert_rows(fmt, H, I).items():
            bank = getattr(self, name)
            if bank.row_shape != tuple(shape) or bank.dtype != dtype:
                raise ValueError(f"ExpertBanks: {name} rows of format {fmt.name} (H={H}, I={I}) must be "
                                 f"{list(shape)} {np.dtype(dtype).name}, got {list(bank.row_shape)} {bank.dtype.name}")

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the banks present, in pool order: ("gate_up", "down"[, "gate_up_bias", "down_bias"][,
        "gate_up_scale", "down_scale"])."""
        return self._REQUIRED + tuple(n for n in self._OPTIONAL if getattr(self, n) is not None)

    @property
    def banks(self) -> tuple[HostBank, ...]:
        """The banks present, in the order of :attr:`names`."""
        return tuple(getattr(self, n) for n in self.names)

    def items(self) -> tuple[tuple[str, HostBank], ...]:
        """(name, bank) pairs in the order of :attr:`names`."""
        return tuple((n, getattr(self, n)) for n in self.names)

    @property
    def has_bias(self) -> bool:
        """True when the experts have bias banks."""
        return self.gate_up_bias is not None

    @property
    def quantized(self) -> bool:
        """True when the weights are in a block format (with scale banks)."""
        return self.format.quantized

    @property
    def num_rows(self) -> int:
        """L*E, rows of every bank."""
        return self.gate_up.num_rows

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in host memory: one row of every bank (weights as stored, their scales and biases when
        present). The one definition of "bytes per expert" (slot budgets, cost model, profile, plan, statistics);
        before loading, ft_jax.memory.planned_expert_bytes gives the same figure from the config."""
        return sum(bank.row_bytes for bank in self.banks)

    def pool_shapes(self, num_slots: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{name: ((num_slots, *row_shape), dtype)} of the device slot pool of every bank, in pool order."""
        return {n: ((int(num_slots), *bank.row_shape), bank.dtype) for n, bank in self.items()}

    def freeze(self) -> None:
        """HostBank.freeze every bank."""
        for bank in self.banks:
            bank.freeze()

    def release(self) -> None:
        """HostBank.release every bank that is still alive."""
        for bank in self.banks:
            if bank.alive:
                bank.release()
