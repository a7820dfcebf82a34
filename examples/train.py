"""Train a small Llama-architecture decoder with DeepSpeed AutoTP, its tensor-parallel all-reduces via Echo.

The model is transformers' ``LlamaForCausalLM`` with random weights (by default 4 layers, hidden 256, 8
heads, 4 key-value heads, MLP 688: about 3.2M parameters), trained character by character on a text
file (by default ``examples/data/shakespeare_sample.txt``, Hamlet and The Comedy of Errors). The
``"echo"`` section of the DeepSpeed config decides whether and how the all-reduces go through Echo;
everything else is plain DeepSpeed, and the training loop is DeepSpeed's own.

Two CPU ranks, tensor parallelism 2, Echo 4-bit (gloo; this is the README's main job)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tp2_cpu_echo4.json

The same run without Echo (the 16-bit baseline)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tp2_cpu_16bit.json

One process (no tensor parallelism, so Echo has nothing to do: a smoke test of the script)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 1 examples/train.py --deepspeed_config ds_configs/tp2_cpu_echo4.json --tp 1

A GPU node with 4 GPUs (bf16, NCCL)::

    deepspeed --num_gpus 4 examples/train.py --deepspeed_config ds_configs/tp4_gpu_echo4.json --steps 2000

Logging comes from rank 0 only: a tqdm progress bar with the training loss, DeepSpeed's own lines, and
Echo's counters every ``steps_per_print`` steps. The last line on stdout is one JSON object::

    {"final_loss": 2.41, "steps": 200, "tp": 2,
     "echo": {"forward_calls": 1600, "backward_calls": 1600, "bytes_sent": ..., "bytes_16bit": ...}}

``final_loss`` is the mean cross-entropy (nats per character) over ``--eval_batches`` fixed batches of the
held-out last 10% of the text, measured in eval mode under ``torch.no_grad`` (through Echo's forward sites
when Echo is on) after the last step. The ``echo`` counters are zero without Echo.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # run from a checkout without installing

import echo_ds.deepspeed as echo  # noqa: E402
from echo_ds.deepspeed import shutdown  # noqa: E402

DEFAULT_DATA = os.path.join(REPO, "examples", "data", "shakespeare_sample.txt")


def parse_args(argv=None):
    """The command line (``argv``: a list instead of sys.argv, e.g. from benchmarks/deepspeed_gpu.py)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA, help="any UTF-8 text file (character-level model)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--n_kv_head", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--tp", type=int, default=None, help="override tensor_parallel.autotp_size of the config")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def load_ds_config(args) -> dict:
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.tp is not None:
        config.setdefault("tensor_parallel", {})["autotp_size"] = args.tp
    return config


class CharData:
    """Character-level encoding of a text file: 90% training, the last 10% held out."""

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(ids))
        self.train, self.val = ids[:n], ids[n:]

    @property
    def vocab_size(self) -> int:
        # Padded to a multiple of 64, like nanoGPT's 50304, so AutoTP splits the head evenly.
        return 64 * math.ceil(len(self.chars) / 64)

    def batch(self, split: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
        starts = torch.randint(0, len(split) - seq_len - 1, (batch_size, ), generator=gen)
        rows = torch.stack([split[s:s + seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def build_model(args, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.n_embd, intermediate_size=args.intermediate,
                      num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                      num_key_value_heads=args.n_kv_head, max_position_embeddings=max(args.seq_len, 128),
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)  # identical initial weights on every rank before AutoTP shards them
    return LlamaForCausalLM(cfg)


def loss_of(engine, x, y):
    logits = engine(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def main():
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ and get_accelerator().device_name() == "cpu":
        # CPU ranks share the machine's cores. Left at torch's default (all cores per rank) they
        # oversubscribe them, and a rank that waits in a collective spins against one that computes:
        # on 2 cores the 16-bit run of 2 ranks then takes 20x longer per step.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    config = load_ds_config(args)
    data = CharData(args.data)
    model = build_model(args, data.vocab_size)

    engine, _, _, _ = echo.initialize(model=model, model_parameters=model.parameters(), config=config)
    runtime = echo.get_runtime(engine)

    from deepspeed.utils import groups

    rank = torch.distributed.get_rank()
    if engine.autotp_size() > 1:
        tp, dp_rank = groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_rank()
    else:
        tp, dp_rank = 1, rank
    device = engine.device
    # The ranks of one tensor-parallel group must see the same batches; data-parallel replicas differ.
    gen = torch.Generator().manual_seed(args.seed + 1000 * dp_rank)
    micro_batch, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    from tqdm import tqdm

    engine.train()
    bar = tqdm(range(args.steps), disable=rank != 0, desc="train", dynamic_ncols=True)
    for _ in bar:
        for _ in range(gas):
            x, y = data.batch(data.train, micro_batch, args.seq_len, gen)
            loss = loss_of(engine, x.to(device), y.to(device))
            engine.backward(loss)
            engine.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")

    engine.eval()
    eval_gen = torch.Generator().manual_seed(args.seed + 7)
    with torch.no_grad():
        losses = []
        for _ in range(args.eval_batches):
            x, y = data.batch(data.val, micro_batch, args.seq_len, eval_gen)
            losses.append(loss_of(engine, x.to(device), y.to(device)).item())
    final_loss = sum(losses) / len(losses)

    if runtime is not None:
        runtime.check_site_order()  # the passes since the last forward's check
        runtime.log(engine.global_steps)
        counters = runtime.stats.summary()
    else:
        counters = {"forward_calls": 0, "backward_calls": 0, "bytes_sent": 0, "bytes_16bit": 0}
    if rank == 0:
        print(json.dumps({"final_loss": final_loss, "steps": args.steps, "tp": tp, "echo": counters}), flush=True)


if __name__ == "__main__":
    main()
    # The engine is gone with main()'s frame; end every process group and its C++ threads now, while the
    # interpreter runs (a gloo group that DeepSpeed still references otherwise stops its threads inside
    # the interpreter's own teardown, which aborted about one run in ten to thirty: docs/errors.md).
    shutdown()
