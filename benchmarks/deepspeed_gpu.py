"""DeepSpeed AutoTP with Echo on one GPU: training and inference at P = 2 and 4, every rank on cuda:0.

The model and data are examples/train.py's (a 3.2M-parameter Llama, character level, on
examples/data/shakespeare_sample.txt; its ``build_model``, ``CharData`` and ``loss_of``, and its loop).

* **Training**, at each tensor-parallel size P, three runs from the same initial weights on the same
  batches: ``16bit`` (DeepSpeed's own all-reduces, Echo off), ``reference`` (Echo 4-bit over
  torch.distributed) and ``p2p`` (Echo 4-bit over the CUDA IPC transport). Configs: ds_configs/
  tp4_gpu_16bit.json and tp4_gpu_echo4.json with ``autotp_size`` and ``echo.backend`` overridden. Per run:
  the final validation loss (examples/train.py's: mean cross-entropy over its fixed held-out batches after
  the last step), steps per second (wall time of the training loop only, and again after the first
  ``--warmup-steps``), Echo's counters, and the backend that really ran ("p2p" falls back to "reference",
  with one warning, where the transport cannot serve the group).
* **Inference.** The first P's 16-bit run is gathered (AutoTP's shards into one state dict) and saved. At
  each P, ``echo_ds.deepspeed.init_inference`` of those weights (ds_configs/inference_tp4_echo4.json,
  ``tp_size`` P): 16-bit, then Echo 4-bit over each backend. Against the 16-bit TP logits of the same P on
  ``--infer-windows`` held-out windows: greedy (top-1) agreement and ||l_echo - l_16|| / ||l_16||, plus
  the held-out loss and a greedy generation of ``--gen-chars`` characters from ``--prompt``. The same
  weights in one process without tensor parallelism (rank 0, same dtype) give the noise floor: how far
  16-bit TP already is from no TP (bf16 sums in another order).

Several ranks on one GPU: NCCL refuses two ranks on one device, so every rank initialises torch.distributed
with gloo before DeepSpeed (which then reuses the group) and sees LOCAL_RANK=0. The ranks are started here
(multiprocessing "spawn"), not by the ``deepspeed`` launcher. So the 16-bit runs' all-reduces go through
gloo (device-host copies): the steps/s compare Echo with DeepSpeed over gloo on a shared GPU, not with
NCCL, and not NVLink. Start MPS first (benchmarks/gpu_deepspeed.sh does) so the ranks' kernels run side by
side.

    OUT=/some/dir bash benchmarks/gpu_deepspeed.sh                   # the GPU session: MPS, builds, this
    python benchmarks/deepspeed_gpu.py --json out.json               # P = 2 and 4 on cuda:0
    DS_ACCELERATOR=cpu python benchmarks/deepspeed_gpu.py --device cpu --tp-sizes 2 --steps 3 \\
        --infer-windows 2 --gen-chars 16 --json /tmp/ds_cpu.json    # CPU smoke run (p2p falls back)
    python benchmarks/deepspeed_gpu.py --tables-from out.json        # the tables of a (partial) report

``--json`` is rewritten after every result, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # run from a checkout without installing

# Variant -> the "echo.backend" it asks for (None: Echo off, DeepSpeed's own all-reduces).
VARIANTS = {"16bit": None, "reference": "reference", "p2p": "p2p"}
# Config templates per device: 16-bit training, Echo training, inference.
TEMPLATES = {
    "cuda": ("tp4_gpu_16bit.json", "tp4_gpu_echo4.json", "inference_tp4_echo4.json"),
    "cpu": ("tp2_cpu_16bit.json", "tp2_cpu_echo4.json", "inference_tp4_echo4.json"),
}
NOISE_FLOOR = "16bit-1proc"  # the inference row of the unsharded model on rank 0
kWeightsFile = "weights_16bit.pt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: every rank on cuda:0 (bf16 GPU configs); cpu: the CPU configs (fp32)")
    p.add_argument("--tp-sizes", default="2,4", help="tensor-parallel sizes P, one set of P ranks each")
    p.add_argument("--variants", default="16bit,reference,p2p", help=f"training runs, of {list(VARIANTS)}")
    p.add_argument("--infer-variants", default="16bit,reference,p2p",
                   help="inference runs (16bit is the baseline, always run first); '' skips inference")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per training run")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the steady-state steps/s")
    p.add_argument("--model-args", default="",
                   help="extra arguments for examples/train.py's parser (model size, --seq_len, --eval_batches)")
    p.add_argument("--torch-adam", action="store_true",
                   help="torch.optim.AdamW instead of DeepSpeed's fused AdamW (no FusedAdam JIT build)")
    p.add_argument("--infer-windows", type=int, default=32, help="held-out windows of seq_len characters")
    p.add_argument("--gen-chars", type=int, default=200, help="characters of each greedy generation")
    p.add_argument("--prompt", default="DROMIO OF SYRACUSE.\n", help="prompt of the greedy generations")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one P's set of ranks at most")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the whole driver (0: none); each P's set of ranks gets an even share of "
                        "what is left and is stopped at its end")
    p.add_argument("--workdir", default=None, help="where the trained weights go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--tables-from", default=None, help="only print the tables of this report and exit")
    return p.parse_args(argv)


def _names(text: str, allowed) -> list:
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in allowed]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}: choose from {list(allowed)}")
    return sorted(set(names), key=list(allowed).index)  # 16bit first: the baseline of the others


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------

def _load_config(name: str) -> dict:
    with open(os.path.join(REPO, "ds_configs", name)) as f:
        return json.load(f)


def train_config(opts: dict, P: int, variant: str) -> dict:
    """The shipped training config of the device, for P ranks and the variant's backend."""
    name16, name4, _ = TEMPLATES[opts["device"]]
    cfg = _load_config(name16 if VARIANTS[variant] is None else name4)
    cfg.setdefault("tensor_parallel", {})["autotp_size"] = P
    if VARIANTS[variant] is not None:
        cfg["echo"]["backend"] = VARIANTS[variant]
    if opts["torch_adam"]:
        cfg["optimizer"].setdefault("params", {})["torch_adam"] = True
    return cfg


def inference_config(opts: dict, P: int, variant: str) -> dict:
    """ds_configs/inference_tp4_echo4.json for P ranks: without its "echo" section for 16bit."""
    cfg = _load_config(TEMPLATES[opts["device"]][2])
    cfg["tensor_parallel"]["tp_size"] = P
    if opts["device"] == "cpu":
        cfg["dtype"] = "fp32"  # as the CPU training configs
    if VARIANTS[variant] is None:
        del cfg["echo"]
    else:
        cfg["echo"]["backend"] = VARIANTS[variant]
    return cfg


def _load_train_module():
    """examples/train.py as a module (its model, data and loss; it has no package)."""
    spec = importlib.util.spec_from_file_location("echo_example_train", os.path.join(REPO, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------------

class Rank:
    """What one rank does for one P: the training runs, the saved weights, the inference runs.

    Results go to the parent as they finish (rank 0's; every rank reports its own errors), so a set of
    ranks stopped midway still leaves the runs it finished.
    """

    def __init__(self, rank: int, P: int, opts: dict, queue):
        import torch

        self.rank, self.P, self.opts, self.queue = rank, P, opts, queue
        self.T = _load_train_module()
        self.args = self.T.parse_args(opts["model_args"])  # train.py's defaults plus --model-args
        self.data = self.T.CharData(self.args.data)
        self.device = torch.device("cuda", 0) if opts["device"] == "cuda" else torch.device("cpu")
        self.dtype = torch.bfloat16 if opts["device"] == "cuda" else torch.float32  # inference configs' dtype
        self.weights_path = os.path.join(opts["workdir"], kWeightsFile)
        self.weights = None  # the trained state dict, loaded for the inference runs
        self.ref = None  # rank 0: (logits, generation) of the 16-bit TP inference of this P

    def put(self, kind: str, key, payload) -> None:
        self.queue.put((kind, self.rank, key, payload))

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def guarded(self, key, fn, *args) -> None:
        """Run one training or inference run; report its result (rank 0) or its error (any rank)."""
        try:
            result = fn(*args)
            if self.rank == 0:
                self.put("result", key, result)
        except Exception:  # noqa: BLE001 - one failed run must not cost the others
            self.put("result", key, {"error": traceback.format_exc()})
        finally:
            gc.collect()
            if self.device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

    def run(self) -> None:
        import deepspeed
        import torch
        import transformers

        if self.rank == 0:
            env = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                   "transformers": transformers.__version__, "python": sys.version.split()[0],
                   "mps": os.environ.get("ECHO_DS_MPS"), "cpu_count": os.cpu_count()}
            if self.device.type == "cuda":
                env["gpu"] = torch.cuda.get_device_name(0)
                env["cuda"] = torch.version.cuda
            self.put("info", "env", env)
        for variant in self.opts["variants"]:
            self.guarded(("train", self.P, variant), self.train, variant)
        if self.opts["infer_variants"]:
            import torch.distributed as dist

            dist.barrier()  # the first P's rank 0 wrote the weights before reaching this
            if not os.path.exists(self.weights_path):
                if self.rank == 0:
                    self.put("result", ("infer", self.P, "16bit"),
                             {"error": f"no trained weights at {self.weights_path}: the 16-bit training run of "
                                       f"the first P failed or was not asked for"})
                return
            self.weights = torch.load(self.weights_path, map_location="cpu")
            for variant in self.opts["infer_variants"]:
                self.guarded(("infer", self.P, variant), self.infer, variant)
                if variant == "16bit":
                    self.guarded(("infer", self.P, NOISE_FLOOR), self.noise_floor)

    # -------------------------------------------------------------------------------------------- training

    def train(self, variant: str) -> dict:
        import torch
        import torch.distributed as dist
        from deepspeed.utils import groups

        import echo_ds.deepspeed as echo

        T, data, args = self.T, self.data, self.args
        model = T.build_model(args, data.vocab_size)  # seeded: the same initial weights in every run
        engine, *_ = echo.initialize(model=model, model_parameters=model.parameters(),
                                     config=train_config(self.opts, self.P, variant))
        runtime = echo.get_runtime(engine)
        try:
            tp = groups.get_tensor_model_parallel_world_size()
            if tp != self.P:
                raise RuntimeError(f"AutoTP built a tensor-parallel group of {tp} ranks, expected {self.P}")
            device = engine.device
            # As examples/train.py: the ranks of one tensor-parallel group see the same batches.
            gen = torch.Generator().manual_seed(args.seed + 1000 * groups.get_data_parallel_rank())
            micro_batch, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
            steps, warmup = self.opts["steps"], self.opts["warmup_steps"]

            engine.train()
            losses = []
            self.sync()
            start = time.perf_counter()
            warm = None
            for step in range(steps):
                for _ in range(gas):
                    x, y = data.batch(data.train, micro_batch, args.seq_len, gen)
                    loss = T.loss_of(engine, x.to(device), y.to(device))
                    engine.backward(loss)
                    engine.step()
                losses.append(loss.detach())
                if step + 1 == warmup:
                    self.sync()
                    warm = time.perf_counter()
            self.sync()
            seconds = time.perf_counter() - start
            steady = (steps - warmup) / (time.perf_counter() - warm) if warm is not None and steps > warmup else None
            curve = torch.stack(losses).float().cpu().tolist() if losses else []

            # examples/train.py's final loss: fixed held-out batches, eval mode, no grad.
            engine.eval()
            eval_gen = torch.Generator().manual_seed(args.seed + 7)
            val = []
            with torch.no_grad():
                for _ in range(args.eval_batches):
                    x, y = data.batch(data.val, micro_batch, args.seq_len, eval_gen)
                    val.append(T.loss_of(engine, x.to(device), y.to(device)).item())
            result = {"P": self.P, "variant": variant, "backend_requested": VARIANTS[variant],
                      "backend": runtime.backend if runtime is not None else None,
                      "backend_reason": runtime.backend_reason if runtime is not None else None,
                      "final_loss": sum(val) / len(val), "steps": steps, "micro_batch": micro_batch,
                      "seq_len": args.seq_len, "seconds": seconds, "steps_per_s": steps / seconds,
                      "steps_per_s_steady": steady, "train_loss_every_10": curve[::10] + curve[-1:],
                      "dtype": str(next(engine.module.parameters()).dtype)}
            if runtime is not None:
                runtime.check_site_order()
                stats = runtime.stats.as_dict()
                stats.pop("sites", None)
                result["echo"] = stats
            if variant == "16bit" and self.opts["save_weights_p"] == self.P:
                # AutoTP's shards gathered into one state dict (a collective; rank 0 gets it).
                state = engine._consolidated_16bit_state_dict()
                try:
                    if self.rank == 0:
                        torch.save({k: v.detach().float().cpu() for k, v in state.items()}, self.weights_path)
                        result["saved_weights"] = self.weights_path
                finally:
                    dist.barrier()  # also when rank 0 failed: the others wait here
            return result
        finally:
            if runtime is not None:
                echo.disable(engine)  # closes the p2p transport (collective)
            del engine, model

    # ------------------------------------------------------------------------------------------- inference

    def heldout(self):
        """--infer-windows consecutive windows of the held-out text: inputs and next-character targets."""
        import torch

        L = self.args.seq_len
        val = self.data.val
        n = max(1, min(self.opts["infer_windows"], (len(val) - 1) // L))
        rows = torch.stack([val[i * L:i * L + L + 1] for i in range(n)])
        return rows[:, :-1], rows[:, 1:]

    def generate(self, forward) -> str:
        """Greedy: each next character the argmax of the last position, over the last seq_len characters (among
        the text's characters: the model's vocabulary may be padded beyond them, and a barely trained model,
        Echo's quantized logits above all, can put its largest logit on a padding id)."""
        import torch

        index = {c: i for i, c in enumerate(self.data.chars)}
        ids = [index[c] for c in self.opts["prompt"] if c in index]  # characters the text lacks are dropped
        if not ids:
            raise ValueError(f"--prompt {self.opts['prompt']!r} has no character of the training text")
        out = []
        with torch.no_grad():
            for _ in range(self.opts["gen_chars"]):
                x = torch.tensor([ids[-self.args.seq_len:]], device=self.device)
                ids.append(int(forward(x)[0, -1, :len(self.data.chars)].argmax()))
                out.append(self.data.chars[ids[-1]])
        return "".join(out)

    def measure(self, forward, variant: str, extra: dict) -> dict:
        """Logits, held-out loss and generation of one model; compared with the 16-bit TP ones on rank 0."""
        import torch
        import torch.nn.functional as F

        x, y = self.heldout()
        with torch.no_grad():
            logits = forward(x.to(self.device)).float().cpu()
        text = self.generate(forward)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
        result = {"P": self.P, "variant": variant, "positions": y.numel(), "heldout_loss": loss,
                  "prompt": self.opts["prompt"], "generation": text, **extra}
        if variant == "16bit":
            self.ref = (logits, text) if self.rank == 0 else None
        elif self.ref is not None:
            ref, ref_text = self.ref
            same = 0
            while same < min(len(text), len(ref_text)) and text[same] == ref_text[same]:
                same += 1
            result.update(top1_agreement=(logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                          rel_logit_error=((logits - ref).norm() / ref.norm()).item(),
                          generation_same_prefix=same)
        return result

    def infer(self, variant: str) -> dict:
        from deepspeed.module_inject.layers import set_autotp_mode

        import echo_ds.deepspeed as echo

        model = self.T.build_model(self.args, self.data.vocab_size)
        model.load_state_dict(self.weights)
        model.eval()
        set_autotp_mode(training=False)  # AutoTP's inference layers (the training runs set it to True)
        engine = echo.init_inference(model, config=inference_config(self.opts, self.P, variant))
        runtime = echo.get_runtime(engine)
        try:
            result = self.measure(lambda x: engine(input_ids=x).logits, variant,
                                  {"backend_requested": VARIANTS[variant],
                                   "backend": runtime.backend if runtime is not None else None})
            if runtime is not None:
                stats = runtime.stats.as_dict()
                result["echo"] = {k: stats[k] for k in ("forward_calls", "forward_plain_calls", "forward_passes",
                                                         "bytes_sent", "bytes_16bit")}
            return result
        finally:
            if runtime is not None:
                echo.disable(engine)
            del engine, model

    def noise_floor(self) -> dict:
        """The saved weights without tensor parallelism on rank 0 (the other ranks wait)."""
        import torch.distributed as dist

        try:
            if self.rank != 0:
                return None
            model = self.T.build_model(self.args, self.data.vocab_size)
            model.load_state_dict(self.weights)
            model = model.to(self.device, self.dtype).eval()
            return self.measure(lambda x: model(input_ids=x).logits, NOISE_FLOOR,
                                {"backend_requested": None, "backend": None})
        finally:
            dist.barrier()  # also when rank 0 failed: the others wait here


def _worker(rank: int, P: int, port: int, opts: dict, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK="0", LOCAL_SIZE=str(P),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", opts["device"])
    status = 0
    try:
        import torch
        import torch.distributed as dist

        # The ranks share the machine's cores (examples/train.py's reasoning for CPU ranks).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
        if opts["device"] == "cuda":
            torch.cuda.set_device(0)  # every rank on the one GPU
        # gloo first: NCCL refuses two ranks on one GPU; DeepSpeed reuses an initialised group.
        dist.init_process_group("gloo", rank=rank, world_size=P)
        import deepspeed

        deepspeed.init_distributed("gloo")
        Rank(rank, P, opts, queue).run()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put(("error", rank, None, traceback.format_exc()))
        status = 1
    queue.put(("exit", rank, None, status))
    queue.close()
    queue.join_thread()  # flush the reports before exiting
    sys.stdout.flush()
    if status:
        os._exit(status)  # a peer may be stuck in a collective: no orderly teardown


# ----------------------------------------------------------------------------------------------------
# The parent: one set of ranks per P, the report, the tables
# ----------------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[driver] {msg}", flush=True)


class Report:
    """The JSON report, rewritten after every result."""

    def __init__(self, path, opts):
        self.path = path
        self.data = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "options": opts,
                     "env": None, "train": [], "inference": [], "errors": []}

    def add(self, key, rank: int, payload: dict) -> dict:
        """One run's result (rank 0's) or a rank's error, into its row: a failed run's row has "error"; an
        error of another rank in a run that rank 0 finished goes to "other_rank_errors"."""
        section, P, variant = key
        rows = self.data["train" if section == "train" else "inference"]
        row = next((r for r in rows if r.get("P") == P and r.get("variant") == variant), None)
        if "error" in payload:
            text = f"rank {rank}: " + payload["error"]
            if row is None:
                rows.append({"P": P, "variant": variant, "error": text})
            else:
                row["error" if "error" in row else "other_rank_errors"] = (
                    row.get("error", row.get("other_rank_errors", "")) + "\n" + text).lstrip("\n")
        else:
            if row is not None:  # errors of other ranks came first
                rows.remove(row)
                payload["other_rank_errors"] = row["error"]
            rows.append(payload)
        return next(r for r in rows if r.get("P") == P and r.get("variant") == variant)

    def write(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def _summary(section: str, r: dict) -> str:
    if "error" in r:
        return f"{section} P={r['P']} {r['variant']}: FAILED ({r['error'].strip().splitlines()[-1]})"
    if section == "train":
        return (f"train P={r['P']} {r['variant']} (backend {r['backend']}): final loss {r['final_loss']:.4f}, "
                f"{r['steps_per_s']:.2f} steps/s, {r['seconds']:.1f} s")
    agree = "" if "top1_agreement" not in r else (f", top-1 agreement {r['top1_agreement']:.4f}, "
                                                  f"rel. logit error {r['rel_logit_error']:.4f}")
    return f"inference P={r['P']} {r['variant']} (backend {r['backend']}): held-out loss {r['heldout_loss']:.4f}{agree}"


def run_world(P: int, opts: dict, report: Report, deadline: float) -> None:
    """P ranks through every run of one tensor-parallel size; stopped at the deadline."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, P, port, opts, queue), daemon=True) for r in range(P)]
    for p in procs:
        p.start()
    exited = set()
    while len(exited) < P:
        left = deadline - time.monotonic()
        if left <= 0:
            report.data["errors"].append({"P": P, "error": f"stopped at the time limit; ranks done: {sorted(exited)}"})
            log(f"P={P}: stopped at the time limit (ranks done: {sorted(exited)})")
            break
        try:
            kind, rank, key, payload = queue.get(timeout=min(left, 5.0))
        except queue_mod.Empty:
            for r, p in enumerate(procs):  # a rank that died without reporting (a crash, a kill)
                if r not in exited and not p.is_alive():
                    exited.add(r)
                    report.data["errors"].append({"P": P, "rank": r, "error": f"exited with {p.exitcode}"})
                    log(f"P={P}: rank {r} died with exit code {p.exitcode}")
            continue
        except (EOFError, OSError) as e:
            report.data["errors"].append({"P": P, "error": f"lost contact with the ranks: {e}"})
            break
        if kind == "info":
            report.data["env"] = payload
        elif kind == "result":
            row = report.add(key, rank, payload)
            log(_summary(key[0], row) if "error" not in payload or "error" in row
                else f"{key[0]} P={P} {key[2]}: rank {rank} failed after rank 0 finished")
        elif kind == "error":
            report.data["errors"].append({"P": P, "rank": rank, "error": payload})
            log(f"P={P}: rank {rank} failed:\n{payload}")
        elif kind == "exit":
            exited.add(rank)
        report.write()
    for p in procs:
        p.join(timeout=10 if len(exited) == P else 0.5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
    report.write()


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def tables(data: dict) -> str:
    """The two markdown tables, the generations, and the failures of a report."""
    out = ["## Training (all ranks on one GPU)", "",
           "| P | variant | backend | final loss | steps/s | steps/s after warm-up | Echo calls (fwd/bwd) "
           "| bytes vs 16-bit |",
           "|---:|---|---|---:|---:|---:|---:|---:|"]
    order = list(VARIANTS) + [NOISE_FLOOR]
    for r in sorted(data["train"], key=lambda r: (r["P"], order.index(r["variant"]))):
        if "error" in r:
            out.append(f"| {r['P']} | {r['variant']} | - | failed | - | - | - | - |")
            continue
        e = r.get("echo")
        calls = f"{e['forward_calls']}/{e['backward_calls']}" if e else "-"
        ratio = f"{e['bytes_sent'] / e['bytes_16bit']:.3f}" if e and e["bytes_16bit"] else "-"
        backend = r["backend"] or "DeepSpeed (gloo)"
        if r["backend_requested"] and r["backend"] != r["backend_requested"]:
            backend += f" (asked {r['backend_requested']})"
        out.append(f"| {r['P']} | {r['variant']} | {backend} | {r['final_loss']:.4f} | {r['steps_per_s']:.2f} | "
                   f"{_fmt(r['steps_per_s_steady'], '.2f')} | {calls} | {ratio} |")
    out += ["", "## Inference (against the 16-bit TP logits of the same P)", "",
            "| P | variant | backend | top-1 agreement | rel. logit error | held-out loss | same generated prefix |",
            "|---:|---|---|---:|---:|---:|---:|"]
    rows = sorted(data["inference"], key=lambda r: (r["P"], order.index(r["variant"])))
    for r in rows:
        if "error" in r:
            out.append(f"| {r['P']} | {r['variant']} | - | failed | - | - | - |")
            continue
        backend = r["backend"] or ("none (1 process)" if r["variant"] == NOISE_FLOOR else "DeepSpeed (gloo)")
        if r["backend_requested"] and r["backend"] != r["backend_requested"]:
            backend += f" (asked {r['backend_requested']})"
        prefix = r.get("generation_same_prefix")
        prefix = "-" if prefix is None else f"{prefix}/{len(r['generation'])}"
        out.append(f"| {r['P']} | {r['variant']} | {backend} | {_fmt(r.get('top1_agreement'), '.4f')} | "
                   f"{_fmt(r.get('rel_logit_error'), '.4f')} | {r['heldout_loss']:.4f} | {prefix} |")
    gens = [r for r in rows if "generation" in r]
    if gens:
        out += ["", f"## Greedy generations from {gens[0]['prompt']!r}", ""]
        for r in gens:
            out += [f"P={r['P']} {r['variant']}:", "```", r["generation"], "```"]
    failures = [(r, field) for r in data["train"] + data["inference"] + data.get("errors", [])
                for field in ("error", "other_rank_errors") if field in r]
    if failures:
        out += ["", "## Failures", ""]
        for r, field in failures:
            where = f"P={r.get('P')} {r.get('variant', '')}" + (f" rank {r['rank']}" if "rank" in r else "")
            out += [where + ":", "```", str(r[field]).strip()[-3000:], "```"]
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tables_from:
        with open(args.tables_from) as f:
            print(tables(json.load(f)))
        return 0
    t0 = time.monotonic()
    tp_sizes = [int(v) for v in args.tp_sizes.split(",") if v]
    variants = _names(args.variants, VARIANTS)
    infer_variants = _names(args.infer_variants, VARIANTS)
    if infer_variants and "16bit" not in variants:
        raise SystemExit("inference needs the weights of a 16-bit training run: put 16bit in --variants "
                         "(or --infer-variants '')")
    if infer_variants and "16bit" not in infer_variants:
        infer_variants.insert(0, "16bit")  # the baseline of the comparison
    workdir = args.workdir or tempfile.mkdtemp(prefix="echo_ds_gpu_")
    os.makedirs(workdir, exist_ok=True)
    opts = {"device": args.device, "tp_sizes": tp_sizes, "variants": variants, "infer_variants": infer_variants,
            "steps": args.steps, "warmup_steps": args.warmup_steps, "model_args": args.model_args.split(),
            "torch_adam": args.torch_adam, "infer_windows": args.infer_windows, "gen_chars": args.gen_chars,
            "prompt": args.prompt, "workdir": workdir, "save_weights_p": tp_sizes[0] if infer_variants else None}
    report = Report(args.json, opts)
    report.write()
    log(f"tp sizes {tp_sizes}, training {variants}, inference {infer_variants}, {args.steps} steps, "
        f"device {args.device}, weights in {workdir}")
    for i, P in enumerate(tp_sizes):
        deadline = time.monotonic() + args.timeout
        if args.time_budget:
            # An even share of what is left, so that a set of ranks that hangs leaves time to the next ones
            # (a set that finishes early leaves its rest to them too).
            left = t0 + args.time_budget - time.monotonic()
            deadline = min(deadline, time.monotonic() + left / (len(tp_sizes) - i))
        if deadline <= time.monotonic():
            report.data["errors"].append({"P": P, "error": "not run: no time left"})
            log(f"P={P}: not run, no time left")
            continue
        started = time.monotonic()
        run_world(P, opts, report, deadline)
        log(f"P={P}: {time.monotonic() - started:.0f} s")
    report.data["seconds"] = time.monotonic() - t0
    report.write()
    print()
    print(tables(report.data), flush=True)
    failed = report.data["errors"] or any("error" in r for r in report.data["train"] + report.data["inference"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
