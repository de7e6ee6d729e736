"""Expert parallelism: every MoE layer's experts split over the ``expert`` axis of a jax.sharding.Mesh.

The N devices of the axis each own E / N consecutive experts of every MoE layer (shard s: experts [s * E/N,
(s + 1) * E/N)), with their own slot pool and cache tables (ft_jax.offload.cache over L x E/N experts) and their own
policy. A process holds in its host banks only the experts its devices own (ExpertPartition.process_experts; the
loader reads only those tensors). `ShardedExperts` is the ExpertBackend of such a mesh: one jax.shard_map per MoE
layer call inside the layer scan, with the tokens, router ids and combine weights replicated, in which every shard
keeps the routes to its own experts (ids remapped to its local ids, the others -1), runs OffloadedExperts' plan,
slot fill, slot experts and host experts on them (the FFI calls run once per shard, on its own operands: nothing
of the banks or pools is gathered) and the partial outputs are summed by one psum. Dense weights, the KV cache and
everything outside the MoE layers' routed experts are replicated (replicate). Design, HLO and measurements:
docs/DESIGN.md section 18.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ft_jax.kernels import ffi_ops
from ft_jax.offload import cache as expert_cache
from ft_jax.offload.banks import ExpertBanks
from ft_jax.offload.experts import OffloadedExperts, OffloadState
from ft_jax.offload.policy import Policy, PolicyKind

EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class ExpertPartition:
    """Which experts of every MoE layer each shard of the ``expert`` axis and this process own.

    Attributes:
        num_experts: E, routed experts per MoE layer.
        num_shards: N, devices on the expert axis (E % N == 0).
        first_local_shard: the shard index of this process's first device on the axis.
        local_shards: devices of this process on the axis (every process has the same number, in one contiguous
            block of the axis: first_local_shard = process position * local_shards).
    """

    num_experts: int
    num_shards: int
    first_local_shard: int = 0
    local_shards: int = 1

    def __post_init__(self):
        E, N = self.num_experts, self.num_shards
        if N < 1 or E % N:
            raise ValueError(f"expert parallelism: the {E} experts of each MoE layer cannot be split evenly over the "
                             f"{N} devices of the mesh's '{EXPERT_AXIS}' axis; use a device count that divides {E} "
                             f"({', '.join(str(d) for d in range(1, E + 1) if E % d == 0)})")
        if not (1 <= self.local_shards <= N and 0 <= self.first_local_shard <= N - self.local_shards
                and N % self.local_shards == 0 and self.first_local_shard % self.local_shards == 0):
            raise ValueError(f"expert parallelism: shards [{self.first_local_shard}, "
                             f"{self.first_local_shard + self.local_shards}) of {N} are not one of the equal, aligned "
                             f"blocks every process must own")

    @property
    def experts_per_shard(self) -> int:
        """E / N."""
        return self.num_experts // self.num_shards

    @property
    def process_experts(self) -> range:
        """The experts (ids in [0, E), the same in every MoE layer) whose weights this process's banks hold."""
        Es = self.experts_per_shard
        return range(self.first_local_shard * Es, (self.first_local_shard + self.local_shards) * Es)

    def shard_experts(self, shard: int) -> range:
        """The experts of shard ``shard`` in [0, N)."""
        Es = self.experts_per_shard
        return range(shard * Es, (shard + 1) * Es)

    @classmethod
    def from_mesh(cls, mesh: Mesh, num_experts: int) -> "ExpertPartition":
        """The partition of a mesh for this process (jax.process_index()).

        Raises:
            ValueError: the mesh has no ``expert`` axis or another axis of size > 1 (only expert parallelism is
                implemented), E not divisible by the axis, or a mesh that does not match the processes: this process
                has no device on it, a process of the run is missing from it, the processes own unequal numbers of
                devices, or a process's devices are not one contiguous block of the axis in process order (each
                message names the devices / processes).
        """
        check_mesh(mesh)
        devices = list(mesh.devices.reshape(-1))  # the other axes have size 1: the expert axis in order
        owners = [d.process_index for d in devices]
        me, count = jax.process_index(), jax.process_count()
        mine = [i for i, p in enumerate(owners) if p == me]
        if not mine:
            raise ValueError(f"the mesh does not match the processes: process {me} has none of its devices "
                             f"({', '.join(map(str, jax.local_devices()))}) on it (mesh devices: "
                             f"{', '.join(map(str, devices))})")
        missing = sorted(set(range(count)) - set(owners))
        if missing:
            raise ValueError(f"the mesh does not match the processes: processes {missing} of the {count} have no "
                             f"device on it; every process of the run must own the same number of the mesh's devices")
        per = {p: owners.count(p) for p in set(owners)}
        if len(set(per.values())) != 1:
            raise ValueError(f"the mesh does not match the processes: they own unequal numbers of its devices "
                             f"({', '.join(f'process {p}: {n}' for p, n in sorted(per.items()))})")
        local = len(mine)
        blocks = [owners[b:b + local] for b in range(0, len(owners), local)]
        if any(len(set(b)) != 1 for b in blocks) or [b[0] for b in blocks] != sorted(b[0] for b in blocks):
            raise ValueError(f"the mesh does not match the processes: each process's devices must form one "
                             f"contiguous block of the '{EXPERT_AXIS}' axis, in process order; got owners {owners}")
        return cls(num_experts, len(devices), mine[0], local)


def check_mesh(mesh) -> None:
    """Raises TypeError / ValueError unless ``mesh`` is a jax.sharding.Mesh with an ``expert`` axis and no other axis
    of size > 1."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. ft_jax.expert_mesh()), got {type(mesh).__name__}")
    if EXPERT_AXIS not in mesh.shape:
        raise ValueError(f"the mesh has axes {dict(mesh.shape)}: expert parallelism needs an axis named "
                         f"'{EXPERT_AXIS}'")
    others = {k: v for k, v in mesh.shape.items() if k != EXPERT_AXIS and v > 1}
    if others:
        raise ValueError(f"the mesh has axes {dict(mesh.shape)}: only the '{EXPERT_AXIS}' axis may have more than "
                         f"one device (dense weights are replicated; there is no tensor parallelism)")


def expert_mesh(num_devices: int | None = None) -> Mesh:
    """A mesh with one ``expert`` axis over the first ``num_devices`` devices of JAX's default backend (all of them,
    over every process of a jax.distributed run, when None).

    On a CPU-only machine JAX has one CPU device unless jax_num_cpu_devices is set before JAX starts its backend,
    which importing ft_jax does: ``jax.config.update("jax_num_cpu_devices", N)`` first (`ft-jax generate --devices
    N` does it).

    Raises:
        ValueError: num_devices < 1 or more than JAX has (the message says how many and how to get more).
    """
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"expert_mesh: num_devices must be an integer >= 1, got {num_devices!r}")
    if n > len(devices):
        how = (" (set jax.config.update('jax_num_cpu_devices', N) before importing ft_jax, or `ft-jax generate "
               "--devices N`)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"asked for {n} devices but JAX has {len(devices)} {devices[0].platform} device(s){how}")
    return Mesh(np.array(devices[:n]), (EXPERT_AXIS,))


def replicate(tree, mesh: Mesh):
    """Every array leaf of ``tree`` replicated on every device of ``mesh`` (a global jax.Array with sharding
    P()): on a CPU device the copies alias the leaf's own host buffer (one copy in host memory whatever the device
    count); other devices get a copy each. Leaves already replicated on the mesh are kept.

    Raises:
        ValueError: a leaf that is neither a numpy nor a jax array.
    """
    sharding = NamedSharding(mesh, PartitionSpec())
    local = [d for d in mesh.devices.reshape(-1) if d.process_index == jax.process_index()]

    def one(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise ValueError(f"replicate: a leaf of type {type(leaf).__name__} is not an array")
        host = np.asarray(leaf)  # a CPU jax array: a view of its buffer, no copy
        parts = [jax.device_put(host, d, may_alias=True) for d in local]
        return jax.make_array_from_single_device_arrays(host.shape, sharding, parts)

    return jax.tree_util.tree_map(one, tree)


def replicated_zeros(shapes, mesh: Mesh):
    """Zero arrays of the jax.ShapeDtypeStruct leaves of ``shapes`` replicated on every device of ``mesh``, each
    device with a buffer of its own (for state a step donates and updates in place, such as the KV cache). One
    compiled zeros step per (shapes, mesh), kept; works under jax.eval_shape."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    return _zeros_step(treedef, tuple((tuple(s.shape), np.dtype(s.dtype)) for s in leaves), mesh)()


@functools.lru_cache(maxsize=16)
def _zeros_step(treedef, leaves: tuple, mesh: Mesh):
    """jit () -> the pytree treedef of zero arrays leaves ((shape, dtype), ...), each replicated over mesh."""
    return jax.jit(lambda: treedef.unflatten([jnp.zeros(shape, dtype) for shape, dtype in leaves]),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


def host_value(x) -> np.ndarray:
    """A replicated jax.Array as numpy (its copy on this process's first device: a global array of a multi-process
    run is not fully addressable, np.asarray would fail); a numpy array as it is."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


@dataclasses.dataclass(frozen=True, eq=False)
class _ShardExperts(OffloadedExperts):
    """OffloadedExperts of one shard (run inside ShardedExperts' shard_map): a cache over its L x E/N experts
    (num_experts = E/N) whose host bank rows are those of the process's banks (L x process_experts).

    Attributes (besides OffloadedExperts'): bank_experts: experts per MoE layer in the process's banks
    (len(partition.process_experts)); local_shards: the process's shards on the axis.
    """

    bank_experts: int = 0
    local_shards: int = 1

    @property
    def num_layers(self) -> int:
        return self.banks.num_rows // self.bank_experts

    def bank_rows(self, flat_ids: jax.Array) -> jax.Array:
        """Shard flat ids (layer * E/N + local expert; -1 = padding, kept) -> rows of the process's banks (layer *
        E_p + this shard's offset in the process + local expert). The shard's position in its process is the axis
        index modulo the process's shard count (ExpertPartition's aligned blocks), so every process traces the same
        program."""
        Es = self.num_experts
        offset = (jax.lax.axis_index(EXPERT_AXIS) % self.local_shards) * Es  # i32[]
        return jnp.where(flat_ids >= 0, (flat_ids // Es) * self.bank_experts + offset + flat_ids % Es, -1)

    def resident_pools(self, local_shard: int) -> dict[str, np.ndarray]:
        """The resident policy's pools of the process's local shard ``local_shard``: its experts' bank rows in the
        cache's flat order (layer * E/N + local expert): {name: [L * E/N, *row_shape]} numpy arrays gathered once."""
        L, Es = self.num_layers, self.num_experts
        rows = (np.arange(L)[:, None] * self.bank_experts + local_shard * Es + np.arange(Es)[None, :]).reshape(-1)
        return {name: bank.take(rows) for name, bank in self.banks.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedExperts:
    """ExpertBackend of an expert-parallel mesh (module docstring).

    Attributes:
        banks: this process's ExpertBanks: rows L * E_p, row (moe_layer * E_p + j) = expert process_experts[j] of
            that layer (checkpoint.load_checkpoint(experts=partition.process_experts)).
        partition: ExpertPartition of the mesh for this process.
        mesh: the jax.sharding.Mesh (check_mesh).
        policies: one Policy per local shard (bound: qstar with its fraction, auto with its costs), each from the
            profile of its device's links; shards of one process whose policies differ select theirs with
            lax.switch on the shard index. Every policy must be of one kind.
        activation, swiglu_alpha, swiglu_limit, fetch_min_tokens: as OffloadedExperts (each shard's).
    Raises:
        ValueError: banks that do not hold L x E_p rows, policies of the wrong count or of different kinds.
        NotImplementedError: several GPUs in one process (the CUDA host_experts staging is one per call site, and
            every shard runs the same call site: run one process per GPU).
    """

    banks: ExpertBanks
    partition: ExpertPartition
    mesh: Mesh
    policies: tuple[Policy, ...]
    activation: str = "silu"
    swiglu_alpha: float = ffi_ops.SWIGLU_ALPHA
    swiglu_limit: float = ffi_ops.SWIGLU_LIMIT
    fetch_min_tokens: int | None = None

    def __post_init__(self):
        check_mesh(self.mesh)
        part = self.partition
        if self.mesh.shape[EXPERT_AXIS] != part.num_shards:
            raise ValueError(f"ShardedExperts: the mesh's '{EXPERT_AXIS}' axis has {self.mesh.shape[EXPERT_AXIS]} "
                             f"devices, the partition {part.num_shards}")
        platform = self.mesh.devices.flat[0].platform
        if part.local_shards > 1 and platform != "cpu":
            raise NotImplementedError(f"expert parallelism over {part.local_shards} {platform} devices in one process: "
                                      f"the GPU host_experts path keeps one pinned staging channel per call site, "
                                      f"which every shard would share; run one process per GPU (--coordinator, "
                                      f"--num-processes, --process-id)")
        Ep = len(part.process_experts)
        if self.banks.num_rows % Ep:
            raise ValueError(f"ShardedExperts: the banks hold {self.banks.num_rows} rows, not a multiple of the "
                             f"process's {Ep} experts per MoE layer")
        policies = tuple(self.policies)
        if len(policies) != part.local_shards:
            raise ValueError(f"ShardedExperts: {len(policies)} policies for {part.local_shards} local devices")
        if len({p.kind for p in policies}) != 1:
            raise ValueError(f"ShardedExperts: the devices' policies must be of one kind, got "
                             f"{', '.join(str(p) for p in policies)}")
        distinct = tuple(dict.fromkeys(policies))
        shard = dict(banks=self.banks, num_experts=part.experts_per_shard, activation=self.activation,
                     swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit,
                     fetch_min_tokens=self.fetch_min_tokens, bank_experts=Ep,
                     local_shards=part.local_shards)
        object.__setattr__(self, "policies", policies)
        object.__setattr__(self, "_shards", tuple(_ShardExperts(policy=p, **shard) for p in distinct))
        object.__setattr__(self, "_branch", tuple(distinct.index(p) for p in policies))  # local shard -> _shards

    @property
    def num_layers(self) -> int:
        """L, MoE layers."""
        return self._shards[0].num_layers

    def _scalars(self, with_lanes: bool):
        """The OffloadState pytree of one shard with True at its scalar leaves (step, error counters; with_lanes: the
        auto policy's lanes, expert_cache.LaneState, whose leader and window start are scalars: the decode state of
        auto, which the prefill backend's fetch-all passes through)."""
        template = dataclasses.replace(self._shards[0], policy=Policy(PolicyKind.FETCH_ALL))
        scalars = jax.tree_util.tree_map(lambda s: s.ndim == 0, jax.eval_shape(lambda: template.init_state(1)))
        if with_lanes:
            lanes = jax.eval_shape(lambda: expert_cache.init_cache_state(1, 1, 1, auto=True).lanes)
            scalars = scalars._replace(cache=scalars.cache._replace(
                lanes=jax.tree_util.tree_map(lambda s: s.ndim == 0, lanes)))
        return scalars

    def init_state(self, num_slots: int) -> OffloadState:
        """Cold slot pools of ``num_slots`` slots per device (resident: every expert of the device's shard), as an
        OffloadState sharded over the mesh's expert axis: each leaf is the N shards' own leaves concatenated on
        their leading axis (a scalar leaf: stacked to [N]), so that inside the shard_map a shard's block is its
        leaf as it is (a slot pool [S, *row] stays one buffer, updated in place by slot_fill: no reshape that XLA
        would copy around the aliased call).

        Raises:
            ValueError: num_slots < 1 for an offloading policy.
        """
        sharding = NamedSharding(self.mesh, PartitionSpec(EXPERT_AXIS))
        local = [d for d in self.mesh.devices.reshape(-1) if d.process_index == jax.process_index()]
        states = []
        for j, device in enumerate(local):
            shard = self._shards[self._branch[j]]
            with jax.default_device(device):
                if shard.policy.kind is PolicyKind.RESIDENT:
                    L, Es = shard.num_layers, shard.num_experts
                    state = OffloadState(expert_cache.init_cache_state_resident(L, Es),
                                         {k: jnp.asarray(v) for k, v in shard.resident_pools(j).items()},
                                         jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
                else:
                    state = shard.init_state(num_slots)
                states.append(jax.tree_util.tree_map(lambda a: jax.device_put(a[None] if a.ndim == 0 else a, device),
                                                     state))
        N = self.partition.num_shards

        def assemble(*parts):
            return jax.make_array_from_single_device_arrays((N * parts[0].shape[0], *parts[0].shape[1:]), sharding,
                                                            list(parts))

        return jax.tree_util.tree_map(assemble, *states)

    def read_stats(self, state: OffloadState) -> np.ndarray:
        """The per-device, per-layer statistics of every shard (from every process: a collective in a
        multi-process run, so every process must call it at the same point).

        Returns:
            numpy i32[N, L, 6] (columns expert_cache.STAT_FIELDS); summed over axis 0 it is the single-device form.
        Raises:
            RuntimeError: as OffloadedExperts.read_stats (the GPU error counters, summed over the devices).
        """
        from jax.experimental import multihost_utils

        leaves = (state.cache.stats, state.fill_errors, state.host_route_errors)
        if all(x.is_fully_addressable for x in leaves):
            stats, fill, route = jax.device_get(leaves)
        else:
            stats, fill, route = multihost_utils.process_allgather(leaves, tiled=True)
        self._shards[0].check_error_counts(int(np.sum(fill)), int(np.sum(route)))
        return np.asarray(stats).reshape(self.partition.num_shards, self.num_layers, -1)

    def __call__(self, moe_layer, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                 state: OffloadState) -> tuple[jax.Array, OffloadState]:
        """Routed-experts output of one MoE layer, computed by the shards of its experts and summed (one psum).

        Args:
            moe_layer: i32[] MoE layer index (traced inside the layer scan) or a Python int.
            x: f32|bf16[T, H] tokens (replicated). topk_ids: i32[T, k] global expert ids in [0, E), -1 = none.
            topk_weights: f32[T, k]. state: the sharded OffloadState of init_state.
        Returns:
            (y f32[T, H] replicated, new state).
        """
        Es = self.partition.experts_per_shard
        shards, branch, scalars = self._shards, self._branch, self._scalars(state.cache.lanes is not None)

        def body(layer, x, ids, weights, state):  # one shard: its own leaves (a scalar as [1])
            state = jax.tree_util.tree_map(lambda a, scalar: a[0] if scalar else a, state, scalars)
            shard = jax.lax.axis_index(EXPERT_AXIS)
            local = ids - shard * Es  # i32[T, k]
            mine = (ids >= 0) & (local >= 0) & (local < Es)
            local = jnp.where(mine, local, -1)  # the other shards' routes: -1, no expert here
            if len(shards) == 1:
                y, state = shards[0](layer, x, local, weights, state)
            else:
                index = jnp.asarray(branch, jnp.int32)[shard % len(branch)]
                y, state = jax.lax.switch(index, [s.__call__ for s in shards], layer, x, local, weights, state)
            y = jax.lax.psum(y, EXPERT_AXIS)  # f32[T, H]: the one collective of the layer
            return y, jax.tree_util.tree_map(lambda a, scalar: a[None] if scalar else a, state, scalars)

        rep = PartitionSpec()
        spec = jax.tree_util.tree_map(lambda _: PartitionSpec(EXPERT_AXIS), state)
        call = jax.shard_map(body, mesh=self.mesh, in_specs=(rep, rep, rep, rep, spec), out_specs=(rep, spec),
                             check_vma=True)
        return call(jnp.asarray(moe_layer, jnp.int32), x, topk_ids.astype(jnp.int32),
                    topk_weights.astype(jnp.float32), state)
