"""The expert banks of a checkpoint as one bundle (ExpertBanks): every HostBank of the routed experts by name."""

from __future__ import annotations

import dataclasses

import numpy as np

from ft_jax.kernels.host_bank import HostBank


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertBanks:
    """Every host bank of the routed experts, as one named collection (flat row id = moe_layer * E + expert).

    Attributes:
        gate_up: HostBank [L*E, 2I, H] (rows: gate_proj then up_proj).
        down: HostBank [L*E, H, I].
        gate_up_bias: HostBank [L*E, 2I] (gate bias then up bias) and down_bias: HostBank [L*E, H], both or
            neither (gpt-oss's expert biases).
    The order of :attr:`names` (gate_up, down, then the optional banks that are present) is the order of the slot
    pools and of the slot_fill operands. A new kind of bank (e.g. quantization scales) is one more optional field
    here plus its name in ``_OPTIONAL``; :attr:`expert_bytes` and :meth:`pool_shapes` then count it everywhere.
    Raises:
        ValueError: only one of the two bias banks, or banks with different row counts.
    """

    gate_up: HostBank
    down: HostBank
    gate_up_bias: HostBank | None = None
    down_bias: HostBank | None = None

    _REQUIRED = ("gate_up", "down")
    _OPTIONAL = ("gate_up_bias", "down_bias")

    def __post_init__(self):
        if (self.gate_up_bias is None) != (self.down_bias is None):
            raise ValueError("ExpertBanks: pass both expert bias banks (gate_up_bias and down_bias) or neither")
        rows = {name: bank.num_rows for name, bank in self.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"ExpertBanks: every bank needs the same number of rows (L*E), got {rows}")

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the banks present, in pool order: ("gate_up", "down"[, "gate_up_bias", "down_bias"])."""
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
    def num_rows(self) -> int:
        """L*E, rows of every bank."""
        return self.gate_up.num_rows

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in host memory: one row of every bank (weights and, when present, biases). The one
        definition of "bytes per expert" (slot budgets, cost model, profile, statistics)."""
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
