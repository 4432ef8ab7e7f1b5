"""The part of a config a model class is built from."""

from __future__ import annotations

from transformers import PretrainedConfig


def config_taken_by(config: PretrainedConfig, cls: type) -> PretrainedConfig:
    """``config`` itself where ``cls`` takes its class, else its one sub-config that is of the class ``cls``
    takes (a composite config's text part for a text-only class, as ``AutoModelForCausalLM.from_config``
    does: Llama 4's, Qwen 3.5's; MusicGen's decoder), else ``config`` whole: a class built on another type's
    config class (GLM-GA's model is GLM-4.6V's, over its own composite config) takes the whole config."""
    taken = getattr(cls, "config_class", None)
    if taken is None or isinstance(config, taken):
        return config
    parts = [part for part in vars(config).values() if isinstance(part, taken)]
    return parts[0] if len(parts) == 1 else config
