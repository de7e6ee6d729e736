"""The defaults ``ft_jax.load`` / ``Model.generate`` and ``ft-jax generate`` share (re-exported by ft_jax.api). A
module of their own, so the command line's parser is built without loading the model code (`ft-jax --help` fast)."""

import importlib.resources

BUNDLED_MODEL = "tiny_shakespeare"
DEFAULT_POLICY = "auto"  # with an accelerator: the slot cache on the device
CPU_POLICY = "host-all"  # the default on a CPU-only JAX backend (default_policy)
DEFAULT_CACHE_FRACTION = 0.5
DEFAULT_TEMPERATURE = 0.8
DEFAULT_NEW_TOKENS = 200
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill call (docs/DESIGN.md sec. 11, "Chunked prefill")
WEIGHT_CHECK = ("once", "always")  # load(weight_check=...): NaN/Inf check once per file version, or every load
BANK_MEMORY = ("map", "copy")  # load(bank_memory=...): the file's pages mapped, or copied onto huge pages (sec. 20.22)


def default_policy(backend: str) -> str:
    """The policy ``ft_jax.load`` and ``ft-jax generate`` use when none is given, on the JAX backend ``backend``
    (jax.default_backend()): DEFAULT_POLICY ("auto") with an accelerator; CPU_POLICY ("host-all") on "cpu", where the
    "device" slots are host memory too: a slot is a second copy of a bank row in the same RAM, filled by a copy, and a
    slot hit runs the same kernel on the same bytes as a host GEMV from the bank (measured: docs/DESIGN.md section
    15.9), so the cache only costs memory (1.5x the checkpoint at half of the experts) and loading time."""
    return CPU_POLICY if backend == "cpu" else DEFAULT_POLICY


def bundled_model_path() -> str:
    """Folder of the small Mixtral-architecture model shipped in the package (ft_jax/bundled/tiny_shakespeare)."""
    return str(importlib.resources.files("ft_jax") / "bundled" / BUNDLED_MODEL)
