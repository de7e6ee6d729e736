"""Model configuration: parse a Hugging Face MoE ``config.json`` into one flat :class:`MoEConfig`.

Modules: record.py (MoEConfig, RopeScaling, the supported architectures), files.py (file access with named
errors, ConfigError), fields.py (typed readers, the fields every family shares), rope.py (RoPE keys of both
styles), quantization.py (quantization_config), families.py (one builder per family), load.py (load_config,
config_from_dict, read_special_ids). The supported architectures, key styles and family notes: docs/DESIGN.md
section 6 and docs/DESIGN.md sec. 10 (models, config).
"""

from ft_jax.config.files import (CONFIG_FILE, GENERATION_CONFIG_FILE, ConfigError, check_model_dir,
                                 check_regular_file, file_present, os_error_cause, read_json_file)
from ft_jax.config.quantization import QUANT_METHODS, Quantization
from ft_jax.config.load import config_from_dict, load_config, read_special_ids
from ft_jax.config.record import ACTIVATIONS, LAYER_TYPES, SUPPORTED_ARCHITECTURES, MoEConfig, RopeScaling

__all__ = [
    "ACTIVATIONS", "CONFIG_FILE", "GENERATION_CONFIG_FILE", "LAYER_TYPES", "SUPPORTED_ARCHITECTURES", "ConfigError",
    "MoEConfig", "QUANT_METHODS", "Quantization", "RopeScaling", "check_model_dir", "check_regular_file", "config_from_dict", "file_present",
    "load_config", "os_error_cause", "read_json_file", "read_special_ids",
]
