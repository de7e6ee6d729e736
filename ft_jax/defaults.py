"""The defaults ``ft_jax.load`` / ``Model.generate`` and ``ft-jax generate`` share (re-exported by ft_jax.api). A
module of their own, so the command line's parser is built without loading the model code (`ft-jax --help` fast)."""

import importlib.resources

BUNDLED_MODEL = "tiny_shakespeare"
DEFAULT_POLICY = "auto"
DEFAULT_CACHE_FRACTION = 0.5
DEFAULT_TEMPERATURE = 0.8
DEFAULT_NEW_TOKENS = 200
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill call (docs/DESIGN.md sec. 11, "Chunked prefill")


def bundled_model_path() -> str:
    """Folder of the small Mixtral-architecture model shipped in the package (ft_jax/bundled/tiny_shakespeare)."""
    return str(importlib.resources.files("ft_jax") / "bundled" / BUNDLED_MODEL)
