"""The time budget: per-run costs from the calibration, and the step count and schedule that fit the budget."""

from __future__ import annotations

from dataclasses import dataclass

from echo_ds.eval.pretrain.runs import BASELINE_NAME, parse_floats
from echo_ds.eval.pretrain.train import grad_check_variants


@dataclass
class RunCost:
    """Measured cost of one run: seconds per training step and per validation batch, plus the fixed
    seconds of its final evaluations and (the baseline's) gradient checks."""

    step_seconds: float
    eval_batch_seconds: float
    fixed_seconds: float = 0.0


def plan_steps(budget: float, worker_costs: list, num_val_batches: int, num_evals: int | None = None,
               eval_interval: int | None = None, round_to: int = 10) -> int:
    """The largest step count (a multiple of ``round_to``, at least ``round_to``) whose estimated time
    fits ``budget`` seconds on every worker (``worker_costs``: per worker, the RunCosts of its runs, run
    one after the other). Evaluations: ``num_evals + 1`` per run, or one every ``eval_interval`` steps.
    """
    best = None
    for costs in worker_costs:
        per_step = fixed = 0.0
        for c in costs:
            per_step += c.step_seconds
            fixed += c.fixed_seconds + c.eval_batch_seconds * num_val_batches
            if eval_interval:
                per_step += c.eval_batch_seconds * num_val_batches / eval_interval
            else:
                fixed += c.eval_batch_seconds * num_val_batches * num_evals
        if per_step > 0:
            n = (budget - fixed) / per_step
            best = n if best is None else min(best, n)
    if best is None:
        raise ValueError("no runs to plan")
    return max(round_to, int(best // round_to) * round_to)


def run_costs(timings: dict, runs: list, num_final_batches: int, num_checks: int) -> dict:
    """{run name: RunCost} from the calibration ``timings`` ({name: Trainer.time_run's dict})."""
    variants = grad_check_variants(runs)
    quantized = [timings[r.name]["step_seconds"] for r in runs if r.config is not None and r.name in timings]
    base = timings.get(BASELINE_NAME, {}).get("step_seconds", 0.0)
    check = base + len(variants) * (max(quantized) if quantized else base)
    out = {}
    for r in runs:
        if r.name not in timings:
            continue
        t = timings[r.name]
        fixed = t["eval_batch_seconds"] * num_final_batches * (2 if r.config is not None else 1)
        if r.name == BASELINE_NAME:
            fixed += num_checks * check
        out[r.name] = RunCost(t["step_seconds"], t["eval_batch_seconds"], fixed)
    return out


def plan_schedule(args, runs: list, assignment: list, solo: dict, contended: dict | None, num_val: int,
                  num_final: int) -> dict:
    """Steps and schedule: ``parallel`` (every worker at once, timed together: ``contended``) or
    ``sequential`` (the workers one after the other, timed alone: ``solo``), whichever fits more steps into
    ``args.time_budget`` (``args.schedule`` when it names one of them)."""
    num_checks = len(parse_floats(args.grad_check))
    kw = dict(num_val_batches=num_val, num_evals=args.num_evals, eval_interval=args.eval_interval)
    solo_costs = run_costs(solo, runs, num_final, num_checks)
    options = {"sequential": plan_steps(args.time_budget, [[solo_costs[r.name] for r in runs]], **kw)}
    if contended is not None:
        par_costs = run_costs(contended, runs, num_final, num_checks)
        options["parallel"] = plan_steps(args.time_budget, [[par_costs[r.name] for r in a] for a in assignment], **kw)
    if args.schedule in options:
        schedule = args.schedule
    else:
        schedule = max(options, key=lambda k: (options[k], k == "parallel"))
    return {"schedule": schedule, "steps": options[schedule], "steps_by_schedule": options}
