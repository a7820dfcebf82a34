"""Where the runs of an invocation train: in the calling process, or spread over worker processes.

``--workers 1`` (:func:`run_in_process`): one Trainer in the calling process trains every run, one after
the other, so whatever the caller set in this process holds for the runs; benchmarks/gpu_pretrain_state.sh
relies on it (it sets ``echo_ds.compensator.kStateDtype``, then calls :func:`main` with ``--workers 1``).

``--workers N`` (:func:`run_in_workers`): N worker processes, each a ``ProcessPoolExecutor`` of one
spawned process (one pool of N would hand a task to whichever process is free), so that a worker keeps
its set-up (data, model, emulator, initial weights) from one task to the next and trains exactly its share
of the runs (round robin: the baseline on worker 0). The parent submits tasks and waits on their futures:

1. set-up, on every worker at once;
2. with ``--time-budget``, the calibration: every worker times its runs alone, one worker after the
   other, then (unless ``--schedule sequential``) all workers at once; :func:`plan_schedule` picks the
   schedule and the step count from the two timings;
3. training, one task per run: ``parallel`` keeps one run going on every worker (a worker's next run is
   submitted when its previous one returns), ``sequential`` one run at a time, worker after worker.

Every finished run goes to ``on_result`` as it returns (the CLI rewrites its JSON). A run that raises, or
a worker process that dies, ends that worker's share (its remaining runs are not started; the worker is
listed in ``failed_workers``). A failure during set-up or calibration, or no answer within
``--setup-timeout`` (set-up, each calibration phase) or ``--run-timeout`` (from one finished run to the
next), ends the invocation and terminates the worker processes. Runs still going at the deadline stop by
themselves (:meth:`Trainer.run`), in either mode.
"""

from __future__ import annotations

import multiprocessing
import traceback
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ProcessPoolExecutor, wait

import torch

from echo_ds.eval.pretrain.corpus import Corpus, load_corpus, parse_plays
from echo_ds.eval.pretrain.plan import plan_schedule
from echo_ds.eval.pretrain.report import log
from echo_ds.eval.pretrain.runs import BASELINE_NAME
from echo_ds.eval.pretrain.train import Trainer, device_defaults, grad_check_variants, make_settings, tp_info


def run_in_process(args, runs: list, corpus: Corpus, on_result, deadline=None) -> dict:
    """Every run in this process, one after the other (``--workers 1``); returns the invocation's info."""
    trainer = Trainer(args, corpus)
    variants = grad_check_variants(runs)
    info = {"workers": 1, "schedule": "sequential", "num_params": trainer.num_params, "tp": tp_info(trainer)}
    steps = args.steps
    if args.time_budget:
        s0 = make_settings(args, 100)
        timings = {}
        for r in runs:
            timings[r.name] = trainer.time_run(r, s0, args.calib_seconds / len(runs))
            log(f"calibration [{r.name}]: {1e3 * timings[r.name]['step_seconds']:.1f} ms/step, "
                f"{1e3 * timings[r.name]['eval_batch_seconds']:.1f} ms/val batch")
        plan = plan_schedule(args, runs, [runs], timings, None, len(trainer.val), len(trainer.final_val))
        steps = plan["steps"]
        info["calibration"] = {"solo": timings, "budget_seconds": args.time_budget, **plan}
        log(f"time budget {args.time_budget:.0f} s: {steps} steps per run")
    settings = make_settings(args, steps, deadline)
    info.update(steps=steps, settings=settings)
    on_result(("info", info))
    for r in runs:
        result = trainer.run(r, settings, progress=not args.no_progress, position=0,
                             grad_variants=variants if r.name == BASELINE_NAME else (), log=log)
        on_result(("result", result))
    trainer.tp.close()
    return info


# -- tasks, run in a worker process ------------------------------------------------------------------

_trainer = None     # this worker process's Trainer, built by _set_up


def _set_up(args) -> dict:
    """Build this worker's Trainer; what the parent needs of it."""
    global _trainer
    torch.set_num_threads(max(1, args.threads))
    device_defaults(args)
    _trainer = Trainer(args, load_corpus(args.data, parse_plays(args.val_plays)))
    return {"num_params": _trainer.num_params, "tp": tp_info(_trainer), "num_val_batches": len(_trainer.val),
            "num_final_batches": len(_trainer.final_val)}


def _time_runs(specs: list, settings, seconds_per_run: float) -> dict:
    """{run name: Trainer.time_run's dict} of ``specs``."""
    return {r.name: _trainer.time_run(r, settings, seconds_per_run) for r in specs}


def _train(spec, settings, progress: bool, position: int, grad_variants) -> dict:
    """One run's result dict."""
    return _trainer.run(spec, settings, progress=progress, position=position, grad_variants=grad_variants,
                        log=log)


# -- the parent ------------------------------------------------------------------------------------------

class _Workers:
    """``n`` worker processes: one single-process pool each, so that a task runs on the worker it names."""

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")
        self.pools = [ProcessPoolExecutor(max_workers=1, mp_context=ctx) for _ in range(n)]
        self.processes = []

    def set_up(self, args) -> dict:
        """Start every worker's process on its set-up task; {future: worker}."""
        before = set(multiprocessing.active_children())
        futures = {pool.submit(_set_up, args): w for w, pool in enumerate(self.pools)}
        self.processes = [p for p in multiprocessing.active_children() if p not in before]
        return futures

    def submit(self, worker: int, fn, *fn_args):
        return self.pools[worker].submit(fn, *fn_args)

    def close(self, terminate: bool) -> None:
        """Shut the pools down; with ``terminate``, end their processes first (tasks still running)."""
        if terminate:
            for p in self.processes:
                if p.is_alive():
                    p.terminate()
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)


def _failure(worker: int, exc: BaseException) -> None:
    log(f"worker {worker} failed:\n" + "".join(traceback.format_exception(exc)))


def _results(futures: dict, timeout: float, phase: str) -> dict:
    """{worker: result} of ``futures`` ({future: worker}), all within ``timeout`` seconds; a failure ends
    the invocation."""
    done, not_done = wait(futures, timeout=timeout, return_when=FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            _failure(futures[future], future.exception())
            raise RuntimeError(f"worker {futures[future]} failed during {phase}")
    if not_done:
        raise RuntimeError("the workers stopped answering")
    return {w: future.result() for future, w in futures.items()}


def _calibrate(workers: _Workers, args, assignment: list) -> tuple:
    """(solo, contended): {run name: Trainer.time_run's dict}, each worker timed alone, then all at once
    (contended is None with ``--schedule sequential``). Every worker times its runs for --calib-seconds."""
    settings = make_settings(args, 100)

    def time_runs(ws) -> dict:
        futures = {workers.submit(w, _time_runs, assignment[w], settings,
                                  args.calib_seconds / len(assignment[w])): w for w in ws}
        timed = _results(futures, args.setup_timeout, "the calibration")
        return {name: t for w in ws for name, t in timed[w].items()}

    solo = {}
    for w in range(len(assignment)):
        solo.update(time_runs([w]))
    contended = time_runs(range(len(assignment))) if args.schedule != "sequential" else None
    return solo, contended


def _train_runs(workers: _Workers, args, assignment: list, schedule: str, settings, variants,
                on_result) -> set:
    """Train every worker's share in ``schedule``, each result to ``on_result`` as it returns; the workers
    that failed."""
    pending = [list(a) for a in assignment]     # per worker, its runs not yet started
    running, failed = {}, set()

    def start_next(candidates) -> None:
        """The next run of the first of the ``candidates`` (workers) with runs left, if any."""
        for w in candidates:
            if pending[w]:
                r = pending[w].pop(0)
                future = workers.submit(w, _train, r, settings, not args.no_progress, w,
                                        variants if r.name == BASELINE_NAME else ())
                running[future] = w
                return

    sequential, everyone = schedule == "sequential", range(len(pending))
    if sequential:                  # one run at a time
        start_next(everyone)
    else:                           # one run on every worker
        for w in everyone:
            start_next([w])
    while running:
        done, _ = wait(running, timeout=args.run_timeout, return_when=FIRST_COMPLETED)
        if not done:
            raise RuntimeError("the workers stopped answering")
        for future in done:
            w = running.pop(future)
            if future.exception() is not None:
                _failure(w, future.exception())
                failed.add(w)
                pending[w].clear()
            else:
                on_result(("result", future.result()))
            start_next(everyone if sequential else [w])
    return failed


def run_in_workers(args, runs: list, corpus: Corpus, on_result, deadline=None) -> dict:
    """The runs in ``args.workers`` spawned processes (round robin: the baseline in worker 0), as the module
    docstring says; returns the invocation's info."""
    num_workers = min(args.workers, len(runs))
    assignment = [runs[w::num_workers] for w in range(num_workers)]
    workers = _Workers(num_workers)
    finished = False
    try:
        set_up = workers.set_up(args)
        log(f"{num_workers} workers: " + "; ".join(f"{w}: {', '.join(r.name for r in a)}"
                                                    for w, a in enumerate(assignment)))
        ready = _results(set_up, args.setup_timeout, "set-up")
        info = {"steps": args.steps, "workers": num_workers, "schedule": "parallel",
                "assignment": [[r.name for r in a] for a in assignment],
                "num_params": ready[0]["num_params"], "tp": ready[0]["tp"]}
        if args.time_budget:
            solo, contended = _calibrate(workers, args, assignment)
            plan = plan_schedule(args, runs, assignment, solo, contended, ready[0]["num_val_batches"],
                                 ready[0]["num_final_batches"])
            for name in solo:
                par = f", {1e3 * contended[name]['step_seconds']:.1f} with all {num_workers} at once" if contended else ""
                log(f"calibration [{name}]: {1e3 * solo[name]['step_seconds']:.1f} ms/step alone{par}")
            log(f"time budget {args.time_budget:.0f} s: {plan['steps_by_schedule']} steps by schedule; "
                f"{plan['schedule']}, {plan['steps']} steps per run")
            info.update(steps=plan["steps"], schedule=plan["schedule"],
                        calibration={"solo": solo, "contended": contended, "budget_seconds": args.time_budget,
                                     **plan})
        elif args.schedule == "sequential":
            info["schedule"] = "sequential"
        info["settings"] = make_settings(args, info["steps"], deadline)
        on_result(("info", info))
        failed = _train_runs(workers, args, assignment, info["schedule"], info["settings"],
                             grad_check_variants(runs), on_result)
        finished = True
    finally:
        workers.close(terminate=not finished)
    if failed:
        info["failed_workers"] = sorted(failed)
    return info
