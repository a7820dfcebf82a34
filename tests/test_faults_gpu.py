"""Faults in the middle of a long run (issue 35, item 5): a rank stopped (SIGSTOP) or killed (SIGKILL) after
hundreds of mixed calls (p2p_suite.MixedCalls: 4 and 8 bits, compensated with both residuals or not, one
element to a million, the three dtypes), every checked call bit-identical to the emulator up to the fault.

Every rank is a spawned process that ends through the interpreter's own exit (its atexit hooks, the process
groups' destructors), not through ``os._exit`` as tests/utils.py's dying-rank harness ends them, and the
parent gives each rank that has sent its last report ``kExitS`` seconds to be gone: a hang at exit fails.

Runs, on the GPU (CUDA transport, P = 2 and 4 ranks sharing one device; skipped without CUDA) and on the
CPU (host transport, P = 2, and P = 4 with ECHO_SLOW_TESTS=1: the same bodies and harness, so that they run
where no GPU is). Rank P - 1 is the one lost; the others are the survivors.

* kill: once every rank has made ``fault_after`` calls, the parent SIGKILLs rank P - 1. Every survivor raises
  EchoP2PTimeout naming itself and the lost rank within ``timeout_s + kSlackS`` of the signal. Then, as a
  user who asked to go on with the reference path would, every survivor makes a reference call on the
  group: rank 0 after closing its buffer (close() hands the group's calls back to the reference), the
  others inside ``collective.reference_only()`` with their buffers left to the interpreter-exit hook. The
  group has lost a member, so that call raises EchoPeerError (or its subclass EchoTimeout) within the
  reference's bound. Every survivor exits 0.
* stop: the same with SIGSTOP, the survivors exiting right after the error (rank 0 closes its buffer, the
  others leave theirs to the exit hook); the parent kills the stopped rank at the end. With a reference
  call before the exit (CPU only: it is the reference path over gloo, with or without a GPU), the call
  raises EchoTimeout in time and the survivor still exits promptly
  (``test_stopped_rank_survivor_exits_after_a_reference_call``; it hung at exit until gloo's own timeout
  before echo_ds.reference._gloo_op_timeout).
* resume: rank P - 1 stops itself before call ``fault_after``; once every survivor has raised, the parent
  resumes it (SIGCONT). The resumed rank raises as well; then every rank closes its buffer together (the
  barrier: no rank frees memory a peer still maps) and goes on with the reference path on the same group,
  with fresh compensators (a failed call leaves its state undefined), bit-identical to the emulator, and
  exits 0: what a user can do by hand with EchoBuffer.close(). Whether the resumed rank returned a wrong
  result before it raised: ``test_resumed_rank_returns_no_wrong_result``.
* resume with ``on_fault="reference"`` (the library's setting for the same, EchoBuffer's ``on_fault`` and the
  config key ``echo.on_fault``): every rank builds its buffer with it, and after the named error, raised once,
  keeps calling ``buf.all_reduce`` on the buffer the error left open (no close, no collective in between):
  the calls run the reference path (counted by echo_ds.reference.call_count), with fresh compensators,
  bit-identical to the emulator; ``check()`` and ``synchronize()`` raise no more; then every rank closes
  its buffer together and exits 0.

The setting on its own (host transport, two CPU ranks, a rank that sleeps past the timeout instead of a
signal): ``test_on_fault_*``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback

import pytest
import torch

from host_transport import HostTransport, transport_arg
import p2p_suite
from utils import free_port

kExitS = 20.0  # a rank that has sent its last report must have exited by then
kSlackS = 5.0  # beyond timeout_s: the host's next check after the failed wait (as tests/test_p2p_gpu.py)
kGlooTimeoutS = 60  # the process group's own bound: no collective waits longer
kMaxNumel = 1 << 21

GPU_CFG = {"transport": "cuda", "timeout_s": 2.0, "sizes": (1, 127, 4097, 65_537, 1_000_003), "comp_numel": 65_537,
           "fault_after": 1000, "check_every": 4, "max_calls": 200_000, "reference_calls": 8, "wall_s": 120.0}
HOST_CFG = {"transport": "host", "timeout_s": 1.5, "sizes": (1, 127, 1000), "comp_numel": 1000, "fault_after": 40,
            "check_every": 2, "max_calls": 20_000, "reference_calls": 6, "wall_s": 150.0}

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SLOW = [pytest.mark.slow, pytest.mark.skipif(not os.environ.get("ECHO_SLOW_TESTS"), reason="four CPU ranks take "
                                             "about 12 s a run on a small machine; ECHO_SLOW_TESTS=1 runs them")]
SETUPS = [pytest.param("host", 2, id="host-P2"), pytest.param("host", 4, marks=SLOW, id="host-P4"),
          pytest.param("cuda", 2, marks=GPU, id="cuda-P2"), pytest.param("cuda", 4, marks=GPU, id="cuda-P4")]


# ------------------------------------------------------------------------------------------------------
# Inside a rank
# ------------------------------------------------------------------------------------------------------

def _device(rank, cfg) -> torch.device:
    if cfg["transport"] != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _calls_until_failure(buf, mix, rank, cfg, shared):
    """Mixed calls until the transport raises; returns (the failure, the calls whose output differed from
    the emulator). In the "resume" run the lost rank stops itself before call ``fault_after``."""
    from echo_ds.p2p import EchoP2PError

    stop_before = cfg["fault_after"] if cfg["how"] == "resume" and rank == cfg["victim"] else None
    # The resume run checks (and so synchronises) every call: each survivor issues exactly one call past the
    # stopped rank, whose flags are then what that rank meets when it resumes.
    check_every = 1 if cfg["how"] == "resume" else cfg["check_every"]

    def reduce(x, spec, comp, pow2):
        return buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)

    mismatches, call = [], 0
    try:
        for call in range(cfg["max_calls"]):
            if call == stop_before:
                shared["stamp"][rank] = time.time()
                os.kill(os.getpid(), signal.SIGSTOP)
            y, expected = mix.run(reduce, call, check=call % check_every == 0)
            if expected is not None:
                buf.synchronize()  # the named error first: a failed call's output is undefined
                if not p2p_suite.same_bits(y, expected):
                    mismatches.append(call)
                shared["progress"][rank] = call + 1
    except EchoP2PError as e:
        return {"at": time.time(), "call": call, "type": type(e).__name__, "message": str(e)}, mismatches
    raise AssertionError(f"rank {rank}: {cfg['max_calls']} calls and no error")


def _reference_attempt(rank, device, cfg):
    """One reference call on the group that lost a member (the named error is expected)."""
    from echo_ds import collective
    from echo_ds.reference import EchoPeerError, echo_all_reduce

    x = p2p_suite.parts_for(1, 4097, torch.float32, 99 + rank, device)[0]
    t0 = time.monotonic()
    try:
        with collective.reference_only():
            echo_all_reduce(x, p2p_suite.MIX_CONFIGS[0][0], timeout_s=cfg["timeout_s"])
    except EchoPeerError as e:
        return {"type": type(e).__name__, "message": str(e), "waited_s": time.monotonic() - t0}
    return {"type": None, "message": "the call returned", "waited_s": time.monotonic() - t0}


def _reference_calls(world_size, rank, device, cfg, buf=None):
    """The group's calls after the fault, compared with the emulator (fresh compensators: MixedCalls of a new
    seed): ``echo_all_reduce`` after every rank closed its buffer, or ``buf.all_reduce`` on the buffer that
    on_fault="reference" moved to the reference path. Also how long the first call took: it waits for the
    slowest rank to have raised."""
    from echo_ds.reference import call_count, echo_all_reduce

    mix = p2p_suite.MixedCalls(world_size, rank, device, cfg["sizes"], cfg["comp_numel"], seed=23)

    def reduce(x, spec, comp, pow2):
        if buf is not None:
            return buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)
        return echo_all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)

    before = call_count()
    mismatches = []
    t0 = time.monotonic()
    first_call_s = None
    for call in range(cfg["reference_calls"]):
        y, expected = mix.run(reduce, call, check=True)
        if buf is not None:
            buf.synchronize()  # raises nothing once the buffer is on the reference path
        if first_call_s is None:
            first_call_s = time.monotonic() - t0
        if not p2p_suite.same_bits(y, expected):
            mismatches.append(call)
    return {"mismatches": mismatches, "reference_calls": call_count() - before, "first_call_s": first_call_s}


def _plain_sum_is_exact(buf, world_size, rank, device) -> bool:
    """buf.plain_all_reduce of small integers (exact in fp32 in any order) is their sum over the ranks."""
    x = torch.arange(1000, dtype=torch.float32, device=device) % 97 * (rank + 1)
    want = torch.arange(1000, dtype=torch.float32, device=device) % 97 * (world_size * (world_size + 1) // 2)
    return torch.equal(buf.plain_all_reduce(x), want)


def _faulted_rank(rank, world_size, cfg, report, shared):
    from echo_ds.p2p import EchoBuffer

    device = _device(rank, cfg)
    on_fault = "reference" if cfg["then"] == "on_fault" else "raise"
    buf = EchoBuffer(max_numel=kMaxNumel, timeout_s=cfg["timeout_s"], transport=transport_arg(cfg["transport"]), on_fault=on_fault)
    assert buf.active, buf.reason
    mix = p2p_suite.MixedCalls(world_size, rank, device, cfg["sizes"], cfg["comp_numel"], seed=11)
    failure, mismatches = _calls_until_failure(buf, mix, rank, cfg, shared)
    report("raised", failure)
    out = {"failure": failure, "mismatches": mismatches, "after": None}
    if on_fault == "reference":  # the buffer stays open: the setting moved it to the reference path
        out["active"], out["reason"] = buf.active, buf.reason
        out["after"] = _reference_calls(world_size, rank, device, cfg, buf=buf)
        out["plain_exact"] = _plain_sum_is_exact(buf, world_size, rank, device)
        buf.close()  # collective (its barrier): every rank is here
        return out
    if cfg["how"] == "resume":
        buf.close(abort=True)  # collective (its barrier): the resumed rank closes too
        out["after"] = _reference_calls(world_size, rank, device, cfg)
        return out
    if rank == 0:  # the others leave their buffers to the interpreter-exit hook
        buf.close(abort=True, barrier=False)  # a peer is gone: no barrier
    if cfg["then"] == "reference":
        out["after"] = _reference_attempt(rank, device, cfg)
    return out


def _rank_main(rank, world_size, port, cfg, reports, shared):
    """One rank: its reports go to ``reports`` ("raised", then "done" or "error"); it returns (or raises) so
    that the process ends through the interpreter's exit."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=kGlooTimeoutS))
        result = _faulted_rank(rank, world_size, cfg, lambda kind, payload: reports.put((kind, payload)), shared)
        reports.put(("done", result))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        raise


# ------------------------------------------------------------------------------------------------------
# The parent
# ------------------------------------------------------------------------------------------------------

def _stopped(pid: int) -> bool:
    """The process is stopped (state T in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


class _Ranks:
    """The spawned ranks, one report queue each (a rank stopped while it held a shared queue's lock would
    hold up every other rank's reports), and what the parent has heard from them."""

    def __init__(self, world_size, cfg):
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.queues = [ctx.Queue() for _ in range(world_size)]
        self.shared = {"progress": ctx.RawArray("q", world_size), "stamp": ctx.RawArray("d", world_size)}
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, cfg, self.queues[r], self.shared),
                                  daemon=True) for r in range(world_size)]
        self.reports = [{} for _ in range(world_size)]  # kind -> (payload, the parent's monotonic time)
        self.deadline = time.monotonic() + cfg["wall_s"]
        for p in self.procs:
            p.start()

    def wait_for(self, what: str, done) -> None:
        """Read reports until ``done()``; fail on a rank's error, a rank that died unasked, the deadline."""
        while not done():
            for r, q in enumerate(self.queues):
                try:
                    kind, payload = q.get_nowait()
                except queue_mod.Empty:
                    continue
                if kind == "error":
                    raise AssertionError(f"rank {r} failed:\n{payload}")
                self.reports[r][kind] = (payload, time.monotonic())
            for r, p in enumerate(self.procs):
                if r != self.cfg["victim"] and p.exitcode is not None and "done" not in self.reports[r]:
                    self._last_words(r)
            if time.monotonic() > self.deadline:
                raise AssertionError(f"timed out after {self.cfg['wall_s']:.0f} s waiting for {what}; calls made: "
                                     f"{list(self.shared['progress'])}; reports: {[sorted(r) for r in self.reports]}")
            time.sleep(0.02)

    def _last_words(self, rank: int) -> None:
        """Rank ``rank`` has exited: its reports are all in its queue's pipe (a queue flushes before its
        process ends); read them, and fail unless the last one came."""
        try:
            while True:
                kind, payload = self.queues[rank].get(timeout=1.0)
                if kind == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                self.reports[rank][kind] = (payload, time.monotonic())
        except queue_mod.Empty:
            pass
        if "done" not in self.reports[rank]:
            raise AssertionError(f"rank {rank} exited with {self.procs[rank].exitcode} before its last report")

    def exit_seconds(self, rank: int):
        """How long rank ``rank`` took to exit after its last report; None where it still ran kExitS later."""
        t_done = self.reports[rank]["done"][1]
        p = self.procs[rank]
        p.join(max(0.0, t_done + kExitS - time.monotonic()))
        return None if p.is_alive() else time.monotonic() - t_done

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


_runs = {}  # (transport, world size, how, then) -> the run's outcome, or the message of its failure


def _outcome(transport: str, world_size: int, how: str, then: str = "exit") -> dict:
    """One run (module docstring), made once per session: every rank's results, exit codes and exit times,
    the fault's time. A run that failed fails every test that reads it, with its message."""
    key = (transport, world_size, how, then)
    if key not in _runs:
        try:
            _runs[key] = _run(*key)
        except AssertionError as e:
            _runs[key] = f"{e}"
    if isinstance(_runs[key], str):
        raise AssertionError(f"the run {key} failed: {_runs[key]}")
    return _runs[key]


def _run(transport: str, world_size: int, how: str, then: str) -> dict:
    cfg = dict(GPU_CFG if transport == "cuda" else HOST_CFG, how=how, then=then, victim=world_size - 1)
    victim = cfg["victim"]
    survivors = range(world_size - 1)
    ranks = _Ranks(world_size, cfg)
    try:
        pid = ranks.procs[victim].pid
        if how == "resume":
            ranks.wait_for("the last rank to stop itself", lambda: _stopped(pid))
            t_fault = ranks.shared["stamp"][victim]
        else:
            ranks.wait_for(f"{cfg['fault_after']} calls on every rank",
                           lambda: min(ranks.shared["progress"]) >= cfg["fault_after"])
            t_fault = time.time()
            os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        ranks.wait_for("every survivor's error", lambda: all("raised" in ranks.reports[r] for r in survivors))
        t_resume = None
        if how == "resume":
            t_resume = time.time()
            os.kill(pid, signal.SIGCONT)
        running = range(world_size) if how == "resume" else survivors
        ranks.wait_for("the last reports", lambda: all("done" in ranks.reports[r] for r in running))
        exit_s = {r: ranks.exit_seconds(r) for r in running}
        victim_alive = ranks.procs[victim].is_alive()
        if how == "kill":
            ranks.procs[victim].join(kExitS)
    finally:
        ranks.close()
    return {"cfg": cfg, "t_fault": t_fault, "t_resume": t_resume, "exit_s": exit_s, "victim_alive": victim_alive,
            "exitcodes": [p.exitcode for p in ranks.procs],
            "results": {r: ranks.reports[r]["done"][0] for r in running}}


def _check_survivors(out, world_size):
    """Every survivor raised the named error within the timeout of the fault, naming itself and the lost
    rank, and no call before it differed from the emulator."""
    cfg, victim = out["cfg"], out["cfg"]["victim"]
    for rank in range(world_size - 1):
        r = out["results"][rank]
        f = r["failure"]
        assert f["type"] == "EchoP2PTimeout", (rank, f)
        assert f"rank {rank} of {world_size}" in f["message"] and f"waiting for rank {victim}" in f["message"], f
        assert 0.0 < f["at"] - out["t_fault"] < cfg["timeout_s"] + kSlackS, (rank, f["at"] - out["t_fault"], f)
        assert f["call"] >= cfg["fault_after"] - 1 and r["mismatches"] == [], (rank, f["call"], r["mismatches"])
    first = out["results"][0]["failure"]
    p2p_suite.log(0, f"{cfg['transport']} P={world_size} {cfg['how']}: rank {victim} lost after {cfg['fault_after']} "
                     f"calls; rank 0 raised {first['at'] - out['t_fault']:.2f} s later: {first['message']}; "
                     f"exits (s after the last report): "
                     f"{ {r: None if s is None else round(s, 1) for r, s in out['exit_s'].items()} }")


def _check_exits(out, ranks):
    for rank in ranks:
        assert out["exit_s"][rank] is not None, f"rank {rank} hung at exit ({kExitS:.0f} s after its last report)"
        assert out["exitcodes"][rank] == 0, (rank, out["exitcodes"])


def _check_reference_attempts(out, world_size):
    """The survivors' reference call on the group without its lost member: EchoPeerError or EchoTimeout,
    within the reference's bound (it waits timeout_s per stage, and its first stage fails)."""
    for rank in range(world_size - 1):
        a = out["results"][rank]["after"]
        assert a["type"] in ("EchoPeerError", "EchoTimeout"), (rank, a)
        assert a["waited_s"] < out["cfg"]["timeout_s"] + kSlackS, (rank, a)


@pytest.mark.parametrize("transport,world_size", SETUPS)
def test_killed_rank_every_survivor_raises_the_named_error_and_exits(transport, world_size):
    out = _outcome(transport, world_size, "kill", "reference")
    _check_survivors(out, world_size)
    _check_reference_attempts(out, world_size)
    _check_exits(out, range(world_size - 1))
    assert out["exitcodes"][-1] == -signal.SIGKILL, out["exitcodes"]


@pytest.mark.parametrize("transport,world_size", SETUPS)
def test_stopped_rank_every_survivor_raises_the_named_error_and_exits(transport, world_size):
    out = _outcome(transport, world_size, "stop")
    _check_survivors(out, world_size)
    _check_exits(out, range(world_size - 1))
    assert out["victim_alive"], "the stopped rank ended before the parent killed it"


def test_stopped_rank_survivor_reference_call_raises_the_named_error():
    out = _outcome("host", 2, "stop", "reference")
    _check_survivors(out, 2)
    _check_reference_attempts(out, 2)
    assert out["results"][0]["after"]["type"] == "EchoTimeout", out["results"][0]["after"]


def test_stopped_rank_survivor_exits_after_a_reference_call():
    """After an EchoTimeout of the reference path whose peer still holds its connections (stopped, not dead),
    the survivor must still exit promptly. Before the fix (seen on the CPU, 2026-12-06): exit 59 s after the
    last report with the group's timeout at 60 s; gdb: the main thread in ~ProcessGroupGloo (module teardown)
    joining pt_gloo_runloop, which waited in gloo::allgather for the stopped peer (the descriptor all-gather
    that echo_all_reduce abandoned at its timeout). Now Echo's collectives on a gloo group carry gloo's own
    timeout at Echo's bound plus a margin (echo_ds.reference._gloo_op_timeout), so the abandoned one ends
    by itself."""
    out = _outcome("host", 2, "stop", "reference")
    _check_exits(out, [0])


def _check_resumed(out, world_size):
    """The survivors' checks, and the resumed rank's named error within the timeout of its resumption;
    returns the run's configuration."""
    _check_survivors(out, world_size)
    cfg, victim = out["cfg"], out["cfg"]["victim"]
    f = out["results"][victim]["failure"]
    assert f["type"] == "EchoP2PTimeout" and f"rank {victim} of {world_size}" in f["message"], f
    assert 0.0 < f["at"] - out["t_resume"] < cfg["timeout_s"] + kSlackS, (f["at"] - out["t_resume"], f)
    return cfg


@pytest.mark.parametrize("transport,world_size", SETUPS)
def test_resumed_rank_raises_and_every_rank_goes_on_with_the_reference(transport, world_size):
    out = _outcome(transport, world_size, "resume")
    cfg = _check_resumed(out, world_size)
    for rank in range(world_size):
        after = out["results"][rank]["after"]
        assert (after["mismatches"], after["reference_calls"]) == ([], cfg["reference_calls"]), (rank, after)
    _check_exits(out, range(world_size))


@pytest.mark.parametrize("transport,world_size", SETUPS)
def test_on_fault_reference_every_rank_raises_once_and_goes_on_with_its_buffer(transport, world_size):
    """With on_fault="reference" the survivors and the resumed rank raise the named error once, within the
    timeout, and then go on calling the same buffer: reference calls, bit-identical to the emulator, until
    they close it together and exit."""
    out = _outcome(transport, world_size, "resume", "on_fault")
    cfg = _check_resumed(out, world_size)
    for rank in range(world_size):
        r = out["results"][rank]
        assert r["mismatches"] == [], (rank, r["mismatches"])
        assert r["active"] is False, (rank, r["reason"])
        assert "moved the group to the reference path" in r["reason"] and "EchoP2PTimeout" in r["reason"] \
            and f"rank {rank} of {world_size}" in r["reason"], (rank, r["reason"])
        after = r["after"]
        assert (after["mismatches"], after["reference_calls"]) == ([], cfg["reference_calls"]), (rank, after)
        assert r["plain_exact"], rank
    first_s = {r: round(res["after"]["first_call_s"], 2) for r, res in out["results"].items()}
    p2p_suite.log(0, f"{transport} P={world_size} on_fault='reference': first reference call after the error "
                     f"(s, per rank): {first_s}")
    _check_exits(out, range(world_size))


@pytest.mark.parametrize("transport,world_size", SETUPS)
def test_resumed_rank_returns_no_wrong_result(transport, world_size):
    """Every call of every rank, the resumed one included, is bit-identical to the emulator or raises. Before
    the fix (seen on the CPU, host transport, 2026-12-06) the resumed rank's first call after SIGCONT returned
    without an error and differed from the emulator: the survivors, whose waits had failed, still published
    their flags. Now a rank whose wait failed publishes none (csrc/p2p_all_reduce.cuh rank_failed, the
    staged put and signal kernels, HostTransport), so the late rank times out instead."""
    out = _outcome(transport, world_size, "resume")
    assert {r: out["results"][r]["mismatches"] for r in range(world_size)} == {r: [] for r in range(world_size)}


# ------------------------------------------------------------------------------------------------------
# The setting on its own: on_fault (host transport, two CPU ranks)
# ------------------------------------------------------------------------------------------------------

kSwitchCall = 3  # the call at which rank 1 arrives late


def _on_fault_body(rank, world_size, cfg):
    """Rank 1 sleeps past the timeout before call ``kSwitchCall``: rank 0 times out waiting for it, and rank 1,
    which then waits for flags rank 0 no longer publishes, too. What each rank's buffer does next."""
    import logging

    from echo_ds import collective
    from echo_ds.p2p import EchoBuffer, EchoP2PError

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("echo_ds.p2p").addHandler(handler)
    device = torch.device("cpu")
    buf = EchoBuffer(max_numel=1 << 16, timeout_s=cfg["timeout_s"], transport=HostTransport, on_fault=cfg["on_fault"])
    assert buf.active, buf.reason
    name = collective.group_name(None)
    out = {"registered_before": collective.backend_for(name) is buf, "first": None, "mismatches": []}
    mix = p2p_suite.MixedCalls(world_size, rank, device, (127, 1000), 1000, seed=5)

    def reduce(x, spec, comp, pow2):
        return buf.all_reduce(x, spec, compensator=comp, pow2_rescale=pow2)

    for call in range(kSwitchCall + 1):
        if call == kSwitchCall and rank == 1:
            time.sleep(1.5 * cfg["timeout_s"])
        try:
            y, expected = mix.run(reduce, call, check=True)
            buf.synchronize()
        except EchoP2PError as e:
            out["first"] = (call, type(e).__name__, str(e))
            break
        if not p2p_suite.same_bits(y, expected):
            out["mismatches"].append(call)
    out["raised_again"] = []
    for what in (buf.check, buf.synchronize):
        try:
            what()
        except EchoP2PError as e:
            out["raised_again"].append(type(e).__name__)
    out["active"], out["reason"] = buf.active, buf.reason
    out["registered_after"] = collective.backend_for(name) is buf
    out["switch_warnings"] = [w for w in warnings if "moved the group to the reference path" in w]
    x, spec = p2p_suite.parts_for(world_size, 1000, torch.float32, 77, device)[rank], p2p_suite.MIX_CONFIGS[0][0]
    if cfg["on_fault"] == "reference":
        out["after"] = _reference_calls(world_size, rank, device, {**cfg, "sizes": (127, 1000), "comp_numel": 1000},
                                        buf=buf)
        out["plain_exact"] = _plain_sum_is_exact(buf, world_size, rank, device)
        buf.close()  # collective: both ranks are here
    else:
        try:
            buf.all_reduce(x, spec)
            out["later_call"] = "returned"
        except EchoP2PError as e:
            out["later_call"] = type(e).__name__
        buf.close(abort=True)
    return out


def test_on_fault_is_validated():
    from echo_ds.config import ON_FAULT, EchoConfig, EchoConfigError
    from echo_ds.p2p import EchoBuffer
    from echo_ds.p2p.buffer import kOnFault

    for bad in ("ignore", "Reference", None, True):
        with pytest.raises(ValueError, match=r"on_fault=.* must be one of 'raise', 'reference'"):
            EchoBuffer(on_fault=bad)  # refused before any collective: no process group needed
    assert kOnFault == ON_FAULT == ("raise", "reference")
    assert EchoConfig().on_fault == "raise" and EchoConfig(on_fault="reference").on_fault == "reference"
    with pytest.raises(EchoConfigError, match=r"echo.on_fault='ignore': .*'raise' or 'reference'"):
        EchoConfig(on_fault="ignore")


@pytest.mark.parametrize("on_fault", ["reference", "raise"])
def test_on_fault_after_the_first_error(on_fault):
    """"reference": the first failed wait raises once on each rank, then the same buffer is off (active
    false, the reason naming the failure, its custom-op registration dropped, one warning), check() and
    synchronize() raise no more, and its calls are reference calls, bit-identical to the emulator. "raise"
    (the default): every later check, synchronize and call raises the named error again."""
    from utils import run_distributed

    cfg = {"timeout_s": 1.0, "on_fault": on_fault, "reference_calls": 4}
    results = run_distributed(_on_fault_body, 2, cfg, timeout=120)
    for rank, r in enumerate(results):
        call, kind, message = r["first"]
        assert (call, kind) == (kSwitchCall, "EchoP2PTimeout") and f"rank {rank} of 2" in message, (rank, r["first"])
        assert r["mismatches"] == [] and r["registered_before"], (rank, r)
        if on_fault == "reference":
            assert r["raised_again"] == [] and r["active"] is False and not r["registered_after"], (rank, r)
            named = f"EchoP2PTimeout: rank {rank} of 2 timed out waiting for rank {1 - rank}"
            assert r["reason"].startswith("a failed wait moved the group to the reference path") \
                and named in r["reason"], r["reason"]
            assert len(r["switch_warnings"]) == 1, (rank, r["switch_warnings"])
            assert (r["after"]["mismatches"], r["after"]["reference_calls"]) == ([], cfg["reference_calls"]), r
            assert r["plain_exact"], rank
        else:
            assert r["raised_again"] == ["EchoP2PTimeout", "EchoP2PTimeout"], (rank, r["raised_again"])
            assert r["active"] is True and r["registered_after"] and r["switch_warnings"] == [], (rank, r)
            assert r["later_call"] == "EchoP2PTimeout", (rank, r["later_call"])
