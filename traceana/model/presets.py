"""Model shapes and devices the estimate can be asked about by name, each with its source.

Tiny CPU models mirror the reference trainer's presets (collectors/trainer) so validation compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceana.core.errors import ConfigError
from traceana.core.manifest import ModelShape
from traceana.core.units import GIB

GiB = GIB

# The reference trainer's CPU models (collectors/trainer/config.py PRESETS; a test keeps the two in step).
TINY_MODELS: dict[str, ModelShape] = {
    "tiny-gpt": ModelShape(family="gpt", layers=8, hidden=64, heads=4, vocab=256, seq=64, name="tiny-gpt"),
    "tiny-llama": ModelShape(family="llama", layers=8, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, seq=64,
                             name="tiny-llama"),
    "small-gpt": ModelShape(family="gpt", layers=8, hidden=128, heads=4, vocab=512, seq=128, name="small-gpt"),
    "small-llama": ModelShape(family="llama", layers=8, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=512,
                              seq=128, name="small-llama"),
}

MODELS: dict[str, ModelShape] = {
    **TINY_MODELS,
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1.
    "gpt3-175b": ModelShape("gpt", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048, name="GPT-3 175B"),
    # Table 2.1 lists d_model 5140 with 40 heads of 128; 40 × 128 = 5120 is what Megatron-LM trains as "13B".
    "gpt3-13b": ModelShape("gpt", layers=40, hidden=5120, heads=40, vocab=50257, seq=2048, name="GPT-3 13B"),
    "gpt3-6.7b": ModelShape("gpt", layers=32, hidden=4096, heads=32, vocab=50257, seq=2048, name="GPT-3 6.7B"),
    # Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", Table 2; ffn from the released
    # checkpoints' params.json rule (multiple_of 256).
    "llama-65b": ModelShape("llama", layers=80, hidden=8192, heads=64, ffn=22016, vocab=32000, seq=2048,
                            name="LLaMA-65B"),
    "llama-13b": ModelShape("llama", layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, seq=2048,
                            name="LLaMA-13B"),
    "llama-7b": ModelShape("llama", layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq=2048,
                           name="LLaMA-7B"),
    # Touvron et al. 2023, "Llama 2", Table 1 (context 4096, GQA for 70B) and the released config.json files.
    "llama2-70b": ModelShape("llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=4096,
                             name="Llama-2-70B"),
    "llama2-13b": ModelShape("llama", layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, seq=4096,
                             name="Llama-2-13B"),
    "llama2-7b": ModelShape("llama", layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq=4096,
                            name="Llama-2-7B"),
}


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16 FLOP/s (no sparsity)
    source: str


DEVICES: dict[str, Device] = {
    # NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense tensor core; the 80GB part has 81,920 MiB.
    "a100-80gb": Device("A100-SXM4-80GB", 80 * GiB, 312e12, "NVIDIA A100 datasheet"),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense (1,979 with sparsity), 80 GB HBM3.
    "h100-sxm": Device("H100-SXM5-80GB", 80 * GiB, 989e12, "NVIDIA H100 datasheet"),
    # NVIDIA H200 datasheet: the H100's compute with 141 GB HBM3e.
    "h200": Device("H200-SXM-141GB", 141e9, 989e12, "NVIDIA H200 datasheet"),
}


def model_preset(name: str) -> ModelShape:
    key = name.lower()
    if key not in MODELS:
        raise ConfigError(f"unknown model preset {name!r}", fix=f"use one of {', '.join(sorted(MODELS))}")
    return MODELS[key]


def device_preset(name: str) -> Device:
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(f"unknown device {name!r}", fix=f"use one of {', '.join(sorted(DEVICES))}")
    return DEVICES[key]
