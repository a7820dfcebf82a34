"""Echo inside DeepSpeed AutoTP's real layer classes, on 2 gloo ranks (one spawn, many checks).

The model is built from DeepSpeed's own ``LinearLayer`` (column-parallel) and ``LinearAllreduce``
(row-parallel) with a real tensor-parallel group, so the patching, the sites, the passes and the states
are exercised exactly as under ``deepspeed.initialize``; the engine itself is covered by
``test_deepspeed_engine.py``. Each worker returns plain numbers and flags; the tests assert on them.
"""

from __future__ import annotations

import pytest

from utils import (deepspeed_env, deepspeed_shm_segments, free_port, run_distributed, same_states, state_moved,
                   state_tensors)

HIDDEN = 64
BATCH, SEQ = 2, 16


# ----------------------------------------------------------------------------------------------------
# Models built from DeepSpeed's TP layers (module level so that the spawned ranks can import them)
# ----------------------------------------------------------------------------------------------------

def _make_block_class():
    import torch
    import torch.nn.functional as F
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        """norm -> q, k, v (column) -> mix -> o (row) -> residual; norm -> gate, up (column) -> down (row).

        Five column-parallel layers (five backward all-reduces in DeepSpeed, two coalesced) and two
        row-parallel ones per block, like a Llama decoder layer. ``integer`` makes the block linear (no
        norms, nonlinearities or products) so that small-integer data stays exact in fp32.
        """

        def __init__(self, hidden, group, name, integer=False):
            super().__init__()
            self.integer = integer
            self.ckpt = None  # None, "reentrant" or "non_reentrant"
            self.gradient_checkpointing = False  # the Hugging Face flag Echo's recompute policy reads
            self.ln1 = torch.nn.RMSNorm(hidden)
            self.ln2 = torch.nn.RMSNorm(hidden)

            def lin(cls, i, o, n):
                return cls(torch.nn.Linear(i, o, bias=False), mp_group=group, name=f"{name}.{n}")

            self.q, self.k, self.v = (lin(LinearLayer, hidden, hidden, n) for n in "qkv")
            self.o = lin(LinearAllreduce, hidden, hidden, "o")
            self.gate = lin(LinearLayer, hidden, 2 * hidden, "gate")
            self.up = lin(LinearLayer, hidden, 2 * hidden, "up")
            self.down = lin(LinearAllreduce, 2 * hidden, hidden, "down")

        def _forward(self, x):
            if self.integer:
                x = x + self.o(self.q(x) + self.k(x) - self.v(x))
                return x + self.down(self.gate(x) - self.up(x))
            n = self.ln1(x)
            x = x + self.o(self.q(n) * torch.sigmoid(self.k(n)) + self.v(n))
            n = self.ln2(x)
            return x + self.down(F.silu(self.gate(n)) * self.up(n))

        def forward(self, x):
            if self.ckpt is None:
                return self._forward(x)
            return checkpoint(self._forward, x, use_reentrant=self.ckpt == "reentrant")

    class MLPBlock(torch.nn.Module):
        """x + down(silu(gate(x)) * up(x)): one forward site, one (coalesced) backward site."""

        def __init__(self, hidden, group):
            super().__init__()
            self.gate = LinearLayer(torch.nn.Linear(hidden, 2 * hidden, bias=False), mp_group=group, name="gate")
            self.up = LinearLayer(torch.nn.Linear(hidden, 2 * hidden, bias=False), mp_group=group, name="up")
            self.down = LinearAllreduce(torch.nn.Linear(2 * hidden, hidden, bias=False), mp_group=group, name="down")

        def forward(self, x):
            return x + self.down(F.silu(self.gate(x)) * self.up(x))

    class Net(torch.nn.Module):
        def __init__(self, hidden, group, num_blocks=2, integer=False):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(hidden, group, f"blocks.{i}", integer) for i in range(num_blocks))
            self.swap_on_rank = None  # rank that runs the blocks in reverse order (site-order test)

        def forward(self, x):
            import torch.distributed as dist

            order = list(self.blocks)
            if self.swap_on_rank is not None and dist.get_rank() == self.swap_on_rank:
                order = order[::-1]
            for block in order:
                x = block(x)
            return x

    return Net, MLPBlock


def _build(integer=False, num_blocks=2, seed=0, hidden=HIDDEN):
    import torch
    import torch.distributed as dist

    Net, _ = _make_block_class()
    torch.manual_seed(seed)
    net = Net(hidden, dist.group.WORLD, num_blocks, integer)
    if integer:
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return net


def _inputs(seed, seq=SEQ, integer=False, hidden=HIDDEN):
    import torch

    gen = torch.Generator().manual_seed(seed)
    if integer:
        x = torch.randint(-1, 2, (BATCH, seq, hidden), generator=gen).float()
        g = torch.randint(-1, 2, (BATCH, seq, hidden), generator=gen).float()
    else:
        x = torch.randn(BATCH, seq, hidden, generator=gen)
        g = torch.randn(BATCH, seq, hidden, generator=gen)
    return x.requires_grad_(), g


def _step(net, x, g, zero=True):
    """One forward and backward of the linear loss <net(x), g>; returns (out, grads by name)."""
    if zero:
        net.zero_grad(set_to_none=True)
        if x.grad is not None:
            x.grad = None
    out = net(x)
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.clone()
    return out.detach().clone(), grads


def _equal(a, b) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _cfg(**over):
    from echo_ds.config import EchoConfig

    base = {"bits": 4, "backend": "reference"}
    base.update(over)
    return EchoConfig(**base)


kPlain = 2**40  # min_message_bytes above every message: the exact path, at every site


class _PlainRecorder:
    """A stand-in for a p2p EchoBuffer in front of the exact calls: records (site, direction) of each
    plain_all_reduce it serves and sums over torch.distributed."""

    active = True

    def __init__(self, serves: bool):
        self.serves, self.calls = serves, []

    def plain_serves(self, x) -> bool:
        return self.serves

    def plain_all_reduce(self, x, *, site=None, direction=None):
        import torch.distributed as dist

        self.calls.append((site, direction))
        y = x.detach().clone()
        dist.all_reduce(y)
        return y


# ----------------------------------------------------------------------------------------------------
# The worker: every scenario on the same two ranks
# ----------------------------------------------------------------------------------------------------

def _scenarios(rank, world_size, shm_port):
    import torch
    import torch.distributed as dist
    from deepspeed.module_inject import layers as ds_layers

    import echo_ds.deepspeed as echo
    from echo_ds.compensator import make_compensator
    from echo_ds.quant import wire_bytes
    from echo_ds.reference import echo_all_reduce

    res = {"shm_released": deepspeed_env(rank, world_size, shm_port)}
    import deepspeed.comm as ds_comm

    untouched = (ds_comm.all_reduce, ds_comm.inference_all_reduce, dist.all_reduce, ds_layers.RowParallel.forward,
                 ds_layers.ColumnParallel.backward, ds_layers.LinearLayer.forward)

    # --- site table, order, counters -----------------------------------------------------------------
    net = _build()
    rt = echo.enable(net, _cfg())
    res["site_names"] = [(s.name, s.direction) for s in rt.sites]
    res["classes"] = sorted({type(m).__name__ for m in net.modules() if "Linear" in type(m).__name__})
    visits = []
    echo_fn = rt._echo

    def recording_echo(x, site, bits, compensator, pow2):
        y = echo_fn(x, site, bits, compensator, pow2)
        visits.append((site.direction, site.name, x.detach().clone(), bits, pow2, y.detach().clone()))
        return y

    rt._echo = recording_echo
    x, g = _inputs(1)
    out1, grads1 = _step(net, x, g)
    pass1 = list(visits)
    visits.clear()
    out2, grads2 = _step(net, x, g)  # same weights, same input: a fresh pass must give the same numbers
    pass2 = list(visits)
    res["visit_order"] = [(d, n) for d, n, *_ in pass1]
    res["second_pass_identical"] = torch.equal(out1, out2) and _equal(grads1, grads2)
    res["counters_after_two_passes"] = {k: v for k, v in rt.stats.as_dict().items() if k != "sites"}

    # Replay each pass's messages through echo_all_reduce with fresh compensators, one per direction:
    # equal bit for bit iff each direction used its own state, reset at its pass start, fed only by its
    # own sites in this order.
    replay_equal = []
    for visits_of_pass in (pass1, pass2):
        states = {"forward": make_compensator(rt.config.forward), "backward": make_compensator(rt.config.backward)}
        for direction, _, xin, bits, pow2, y in visits_of_pass:
            y_again = echo_all_reduce(xin, rt.config.quant_spec(bits), group=rt.group,
                                      compensator=states[direction], pow2_rescale=pow2)
            replay_equal.append(torch.equal(y, y_again))
    res["replay_equal"] = replay_equal
    # The forward state is not touched by the backward pass.
    rt._echo = echo_fn
    x, g = _inputs(2)
    net.zero_grad()
    out = net(x)
    fwd_state = state_tensors(rt.forward_state)
    fwd_calls = rt.forward_state.num_calls
    (out * g).sum().backward()
    res["forward_state_untouched_by_backward"] = (same_states(fwd_state, rt.forward_state)
                                                  and rt.forward_state.num_calls == fwd_calls
                                                  and state_moved(rt.forward_state))  # not a comparison of zeros
    res["state_calls"] = (rt.forward_state.num_calls, rt.backward_state.num_calls)
    res["states_distinct"] = rt.forward_state is not rt.backward_state

    # eval / no_grad: the same numbers as a training forward (fresh state), no backward site touched.
    x, g = _inputs(3)
    net.train()
    out_train = net(x).detach()
    before = rt.stats.as_dict()
    net.eval()
    with torch.no_grad():
        out_eval = net(x)
    after = rt.stats.as_dict()
    net.train()
    res["eval_equals_train_forward"] = torch.equal(out_train, out_eval)
    res["eval_deltas"] = {k: after[k] - before[k] for k in ("forward_calls", "backward_calls", "coalesced_layers")}

    # Varying sequence lengths: 16, 24, 16 -> the state is resized, and the third pass equals the first.
    x16, g16 = _inputs(4, seq=16)
    x24, g24 = _inputs(5, seq=24)
    a = _step(net, x16, g16)
    _step(net, x24, g24)
    b = _step(net, x16.detach().clone().requires_grad_(), g16)
    res["varying_seq_ok"] = torch.equal(a[0], b[0]) and _equal(a[1], b[1])

    # Gradient accumulation: two micro-batches accumulated == the sum of the two taken separately.
    x1, g1 = _inputs(6)
    x2, g2 = _inputs(7)
    _, ga = _step(net, x1, g1)
    _, gb = _step(net, x2, g2)
    net.zero_grad(set_to_none=True)
    (net(x1.detach().requires_grad_()) * g1).sum().backward()
    (net(x2.detach().requires_grad_()) * g2).sum().backward()
    res["accumulation_equal"] = all(torch.equal(p.grad, ga[n] + gb[n]) for n, p in net.named_parameters())
    res["accumulated_grads_differ_from_single"] = not any(torch.equal(p.grad, ga[n]) for n, p in net.named_parameters())

    # Telemetry and the monitor.
    class FakeMonitor:
        enabled = True

        def __init__(self):
            self.events = []

        def write_events(self, events):
            self.events.extend(events)

    monitor = FakeMonitor()
    rt.monitor = monitor
    rt.log(step=7)
    res["monitor_event_names"] = sorted({e[0] for e in monitor.events})
    res["monitor_steps"] = sorted({e[2] for e in monitor.events})
    echo.disable(net)
    res["disabled_classes"] = sorted({type(m).__name__ for m in net.modules() if "Linear" in type(m).__name__})

    for bits in (8, 4):
        net = _build()
        rt = echo.enable(net, _cfg(bits=bits, telemetry=True))
        _step(net, *_inputs(8))
        res[f"telemetry_{bits}"] = {n: t.relative_rms for n, t in rt.stats.sites.items()}
        echo.disable(net)

    # --- activation checkpointing --------------------------------------------------------------------
    x, g = _inputs(9)
    net = _build()
    rt = echo.enable(net, _cfg())
    ref_out, ref_grads = _step(net, x, g)
    ref_fwd_state = state_tensors(rt.forward_state)
    ref_counts = (rt.stats.forward_calls, rt.stats.backward_calls)
    echo.disable(net)
    for mode, flag in (("reentrant", False), ("non_reentrant", True), ("non_reentrant", False)):
        torch.manual_seed(0)
        net = _build()
        for block in net.blocks:
            block.ckpt, block.gradient_checkpointing = mode, flag
        rt = echo.enable(net, _cfg())
        out, grads = _step(net, x, g)
        res[f"ckpt_{mode}_{flag}"] = {
            "grads_equal": _equal(grads, ref_grads),
            "out_equal": torch.equal(out, ref_out),
            "counts": (rt.stats.forward_calls, rt.stats.backward_calls),
            "ref_counts": ref_counts,
            "recomputed": rt.stats.recomputed_calls,
            "forward_state_equal": same_states(rt.forward_state, ref_fwd_state),
            "fallbacks": rt.stats.recompute_fallbacks,
            "cache_left": sum(len(s.cache) for s in rt.sites),
        }
        echo.disable(net)

    # --- coalescing at exact arithmetic (integer data, every site uncompressed) ----------------------
    xi, gi = _inputs(10, integer=True)
    net = _build(integer=True)
    ds_out, ds_grads = _step(net, xi, gi)  # DeepSpeed's own layers
    coalesced = {}
    for co in (True, False):
        net = _build(integer=True)
        rt = echo.enable(net, _cfg(min_message_bytes=kPlain), coalesce=co)
        coalesced[co] = _step(net, xi, gi) + (rt.stats.backward_plain_calls, rt.stats.forward_plain_calls)
        echo.disable(net)
    # Exact iff every value is an integer below 2^24 (fp32's integer range).
    res["grads_are_integers"] = all(torch.equal(t, t.round()) and t.abs().max() < 2**24 for t in ds_grads.values())
    res["coalesced_equal_ds"] = torch.equal(coalesced[True][0], ds_out) and _equal(coalesced[True][1], ds_grads)
    res["uncoalesced_equal_ds"] = torch.equal(coalesced[False][0], ds_out) and _equal(coalesced[False][1], ds_grads)
    res["backward_calls_coalesced"] = coalesced[True][2]
    res["backward_calls_uncoalesced"] = coalesced[False][2]
    # The same at 4 bits: fewer calls, fewer bytes.
    for co in (True, False):
        net = _build()
        rt = echo.enable(net, _cfg(), coalesce=co)
        _step(net, *_inputs(11))
        res[f"echo4_backward_{co}"] = (rt.stats.backward_calls, rt.stats.bytes_sent)
        echo.disable(net)

    # tp_overlap_comm: DeepSpeed's AsyncColumnParallel vs Echo's overlapped path, exact.
    ds_layers.TensorParallel_Layer.tp_overlap_comm = True
    try:
        net = _build(integer=True)
        ov_out, ov_grads = _step(net, xi, gi)
        net = _build(integer=True)
        rt = echo.enable(net, _cfg(min_message_bytes=kPlain), coalesce=False)
        e_out, e_grads = _step(net, xi, gi)
        res["overlap_equal_ds"] = torch.equal(ov_out, e_out) and _equal(ov_grads, e_grads)
        res["overlap_backward_plain_calls"] = rt.stats.backward_plain_calls
        echo.disable(net)
        net = _build()
        rt = echo.enable(net, _cfg(), coalesce=False)
        _step(net, *_inputs(12))
        res["overlap_echo_backward_calls"] = rt.stats.backward_calls
        echo.disable(net)
    finally:
        ds_layers.TensorParallel_Layer.tp_overlap_comm = False

    # --- min_message_bytes and early sites -----------------------------------------------------------
    x, g = _inputs(13)
    net = _build()
    exact_out = net(x).detach()
    numel = x.numel()
    rt = echo.enable(net, _cfg(min_message_bytes=numel * 4 + 1))
    out = net(x).detach()
    res["min_message"] = (rt.stats.forward_calls, rt.stats.forward_plain_calls, torch.equal(out, exact_out))
    echo.disable(net)
    rt = echo.enable(net, _cfg(min_message_bytes=numel * 4))
    net(x)
    res["min_message_at_threshold"] = (rt.stats.forward_calls, rt.stats.forward_plain_calls)
    echo.disable(net)
    # Below min_message_bytes, a p2p buffer whose one-launch call serves the message takes the exact call
    # (EchoBuffer.plain_all_reduce, which carries the site's descriptor); one that does not, DeepSpeed's.
    for serves in (True, False):
        rt = echo.enable(net, _cfg(min_message_bytes=kPlain))
        rt.buffer = recorder = _PlainRecorder(serves)
        out = net(x).detach()
        rt.buffer = None  # the stand-in holds nothing to close
        res[f"plain_on_buffer_{serves}"] = (recorder.calls, rt.stats.forward_plain_calls, torch.equal(out, exact_out))
        echo.disable(net)
    rt = echo.enable(net, _cfg(early_sites={"bits": 8, "fraction": 0.5}))
    with torch.no_grad():
        net(x)
    res["early_sites_bytes"] = (rt.stats.bytes_sent, 2 * wire_bytes(numel, 8, 128) + 2 * wire_bytes(numel, 4, 128))
    echo.disable(net)

    # --- power-of-two rescaling: a loss scaled by 2^-24 scales every gradient exactly ------------------
    for pow2 in (True, False):
        net = _build()
        echo.enable(net, _cfg(backward={"pow2_rescale": pow2}))
        x, g = _inputs(14)
        _, grads = _step(net, x, g)
        _, grads_small = _step(net, x, g * 2.0**-24)
        res[f"pow2_{pow2}_exact"] = all(torch.equal(grads_small[k], grads[k] * 2.0**-24) for k in grads)
        echo.disable(net)

    # --- site order mismatch: rank 1 runs the two blocks in the other order --------------------------
    net = _build()
    rt = echo.enable(net, _cfg())
    net.swap_on_rank = 1
    try:
        with torch.no_grad():
            # The call descriptor catches it at the first call of the pass, before data from different
            # sites is combined (the per-pass site-order check would catch it at the next pass).
            net(_inputs(15)[0])
            net(_inputs(15)[0])
        res["mismatch_error"] = None
    except RuntimeError as e:
        res["mismatch_error"] = str(e)
    echo.disable(net)

    # --- rank 0 evaluates (eval mode, no_grad) while rank 1 trains: stopped at the first call ---------
    net = _build()
    echo.enable(net, _cfg())
    try:
        x = _inputs(17)[0]
        if rank == 0:
            net.eval()
            with torch.no_grad():
                net(x)
        else:
            net(x)  # a training forward: a backward would follow
        res["eval_train_error"] = None
    except RuntimeError as e:
        res["eval_train_error"] = str(e)
    echo.disable(net)

    # --- DeepCompile's deferred collectives are refused ----------------------------------------------
    net = _build()
    echo.enable(net, _cfg())
    net.blocks[0].o.defer_collectives_to_compiler = True
    try:
        net(_inputs(16)[0])
        res["deferred_error"] = None
    except RuntimeError as e:
        res["deferred_error"] = str(e)
    echo.disable(net)
    dist.barrier()

    # --- two tensor-parallel groups in one model are refused ----------------------------------------
    net = _build()
    net.blocks[1].o.mp_group = dist.new_group([0, 1])
    try:
        echo.enable(net, _cfg())
        res["two_groups_error"] = None
    except NotImplementedError as e:
        res["two_groups_error"] = str(e)
    res["nothing_global_patched"] = untouched == (
        ds_comm.all_reduce, ds_comm.inference_all_reduce, dist.all_reduce, ds_layers.RowParallel.forward,
        ds_layers.ColumnParallel.backward, ds_layers.LinearLayer.forward)

    # --- one TP block, Echo 8-bit vs exact: error within the quantizer's step ------------------------
    res["block_bound"] = _block_bound_case(rank)
    return res


def _block_bound_case(rank):
    """The MLP block of ``hidden`` 256 under Echo 8-bit (symmetric, compensated, pow2) vs exact.

    With the linear loss <out, g>, the weight gradients use only exact local values, so they must be
    equal bit for bit; the output carries one forward call's error and the input gradient one backward
    call's. Bound of one call from a fresh state (the block has one site per direction, so the
    compensator's correction is zero): a non-owner's copy is rounded once (|err| <= s_j / 2) and the
    owner's sum once more (<= s_S / 2), with a symmetric 8-bit scale s = fp16_round_up(amax / 127)
    <= amax / 127 * (1 + 2^-10). Taking every rank's amax over the whole message and the sum's amax
    grown by the first rounding gives, per element,

        bound = (1 + 2^-10) / 254 * (sum_j A_j + A_sum + sum_j A_j (1 + 2^-10) / 254) + 2^-20 A_sum

    (the last term for fp32 rounding of the sums), with A_j = max|x_j| of rank j's contribution.
    """
    import torch
    import torch.distributed as dist

    import echo_ds.deepspeed as echo

    _, MLPBlock = _make_block_class()
    hidden = 256

    def build():
        torch.manual_seed(21)
        return MLPBlock(hidden, dist.group.WORLD)

    gen = torch.Generator().manual_seed(22)
    x0 = torch.randn(4, 32, hidden, generator=gen)
    g = torch.randn(4, 32, hidden, generator=gen)

    def run(block):
        x = x0.clone().requires_grad_()
        out = block(x)
        (out * g).sum().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        return out.detach(), x.grad.clone(), grads

    exact_out, exact_gx, exact_grads = run(build())
    block = build()
    rt = echo.enable(block, _cfg(bits=8, quantizer="symmetric"))
    messages = {}
    echo_fn = rt._echo

    def recording(x, site, bits, compensator, pow2):
        messages[site.direction] = x.detach().clone()
        return echo_fn(x, site, bits, compensator, pow2)

    rt._echo = recording
    out, gx, grads = run(block)

    def bound(msg):
        amax = torch.tensor([msg.abs().max().item()])
        per_rank = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, amax)
        total = msg.clone()
        dist.all_reduce(total)
        a_sum = total.abs().max().item()
        a = [t.item() for t in per_rank]
        c = 1 + 2.0**-10
        return c / 254 * (sum(a) + a_sum + sum(a) * c / 254) + 2.0**-20 * a_sum

    return {
        "weight_grads_equal": _equal(grads, exact_grads),
        "forward_error": (out - exact_out).abs().max().item(),
        "forward_bound": bound(messages["forward"]),
        "backward_error": (gx - exact_gx).abs().max().item(),
        "backward_bound": bound(messages["backward"]),
        "calls": (rt.stats.forward_calls, rt.stats.backward_calls),
    }


@pytest.fixture(scope="module")
def results():
    port = free_port()
    res = run_distributed(_scenarios, 2, port, timeout=300)
    left = deepspeed_shm_segments(port)
    for r in res:
        r["shm_left"] = left
    return res


# ----------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------

def test_ranks_agree(results):
    r0, r1 = results
    for key in ("visit_order", "counters_after_two_passes", "replay_equal", "early_sites_bytes"):
        assert r0[key] == r1[key], key


def test_deepspeed_shm_workspaces_released(results):
    """DeepSpeed's CPU all-reduce workspace existed on each rank and no name of it outlives the run
    (tests/utils.deepspeed_env: DeepSpeed never unlinks them, and a suite's worth filled /dev/shm)."""
    assert [r["shm_released"] for r in results] == [True, True]
    assert results[0]["shm_left"] == []


def test_site_table_and_patched_classes(results):
    r = results[0]
    expected = []
    for b in range(2):
        expected += [(f"blocks.{b}.{n}", "backward") for n in "qkv"] + [(f"blocks.{b}.o", "forward")]
        expected += [(f"blocks.{b}.gate", "backward"), (f"blocks.{b}.up", "backward"), (f"blocks.{b}.down", "forward")]
    assert r["site_names"] == expected
    assert r["classes"] == ["EchoLinearAllreduce", "EchoLinearLayer"]
    assert r["disabled_classes"] == ["LinearAllreduce", "LinearLayer"]


def test_site_visit_order(results):
    # Forward: the row-parallel sites in model order. Backward: reverse order, each coalesced group once
    # under its first layer (gate+up, then q+k+v).
    assert results[0]["visit_order"] == [
        ("forward", "blocks.0.o"), ("forward", "blocks.0.down"), ("forward", "blocks.1.o"),
        ("forward", "blocks.1.down"), ("backward", "blocks.1.gate"), ("backward", "blocks.1.q"),
        ("backward", "blocks.0.gate"), ("backward", "blocks.0.q")]


def test_states_separate_reset_per_pass_and_in_order(results):
    r = results[0]
    # 2 passes x 8 calls, each reproduced bit for bit by fresh per-direction states.
    assert r["replay_equal"] == [True] * 16
    assert r["second_pass_identical"]
    assert r["forward_state_untouched_by_backward"]
    assert r["states_distinct"]
    assert r["state_calls"] == (4, 4)
    c = r["counters_after_two_passes"]
    assert (c["forward_calls"], c["backward_calls"], c["forward_passes"], c["backward_passes"]) == (8, 8, 2, 2)
    assert c["coalesced_layers"] == 2 * 2 * 3  # per pass and block: k, v join q; up joins gate


def test_eval_no_grad_and_varying_lengths_and_accumulation(results):
    r = results[0]
    assert r["eval_equals_train_forward"]
    assert r["eval_deltas"] == {"forward_calls": 4, "backward_calls": 0, "coalesced_layers": 0}
    assert r["varying_seq_ok"]
    assert r["accumulation_equal"] and r["accumulated_grads_differ_from_single"]


def test_telemetry_and_monitor(results):
    r = results[0]
    t8, t4 = r["telemetry_8"], r["telemetry_4"]
    assert set(t8) == set(t4) and len(t8) == 8
    assert all(0 < t8[k] < t4[k] for k in t8), (t8, t4)
    # 8-bit: a step of about 1/127 of the range per group; its rms error is well under 2% of the output.
    assert max(t8.values()) < 0.02, t8
    assert "Echo/forward_calls" in r["monitor_event_names"] and "Echo/bytes_ratio" in r["monitor_event_names"]
    assert not any(n.startswith("Echo/relative_rms_error/") for n in r["monitor_event_names"])  # telemetry off
    assert r["monitor_steps"] == [7]


@pytest.mark.parametrize("mode,flag,recomputed", [("reentrant", False, 4), ("non_reentrant", True, 2)])
def test_activation_checkpointing_replays_forward(results, mode, flag, recomputed):
    # Reentrant checkpoints recompute the whole block; non-reentrant ones stop as soon as the tensors the
    # backward needs are back, which is before the down sites (their outputs feed only a residual add).
    c = results[0][f"ckpt_{mode}_{flag}"]
    assert c["grads_equal"] and c["out_equal"]
    assert c["counts"] == c["ref_counts"] == (4, 4)  # the recompute neither calls Echo nor counts as forward
    assert c["recomputed"] == recomputed
    assert c["forward_state_equal"]  # ... nor touches the forward state
    assert c["cache_left"] == 4 - recomputed  # kept outputs nobody asked for; dropped at the next pass


def test_activation_checkpointing_without_cache_falls_back(results):
    # Non-reentrant checkpoint that Echo cannot see: the recompute takes the exact all-reduce (one
    # warning), the forward state stays as the forward left it, the gradients are close but not equal.
    c = results[0]["ckpt_non_reentrant_False"]
    assert c["out_equal"] and not c["grads_equal"]
    assert c["counts"] == (4, 4) and c["recomputed"] == c["fallbacks"] == 2 and c["cache_left"] == 0
    assert c["forward_state_equal"]


def test_coalescing_exact_equals_deepspeed(results):
    r = results[0]
    assert r["grads_are_integers"]
    assert r["coalesced_equal_ds"] and r["uncoalesced_equal_ds"]
    assert r["backward_calls_coalesced"] == 2 * 2 and r["backward_calls_uncoalesced"] == 2 * 5
    (calls_co, bytes_co), (calls_un, bytes_un) = r["echo4_backward_True"], r["echo4_backward_False"]
    assert (calls_co, calls_un) == (4, 10) and bytes_co < bytes_un


def test_overlap_comm_path(results):
    r = results[0]
    assert r["overlap_equal_ds"]
    assert r["overlap_backward_plain_calls"] == 10
    assert r["overlap_echo_backward_calls"] == 10


def test_min_message_bytes_and_early_sites(results):
    r = results[0]
    assert r["min_message"] == (0, 4, True)
    assert r["min_message_at_threshold"] == (4, 0)
    # the four forward sites (two blocks, two row-parallel layers each) of a training forward, on the buffer
    calls, plain, equal = r["plain_on_buffer_True"]
    assert [d for _, d in calls] == ["forward"] * 4 and len({s for s, _ in calls}) == 4, calls
    assert plain == 4 and equal
    assert r["plain_on_buffer_False"] == ([], 4, True)
    sent, expected = r["early_sites_bytes"]
    assert sent == expected


def test_pow2_rescaling_round_trips_exactly(results):
    assert results[0]["pow2_True_exact"]
    # Without the rescaling the 2^-24-scaled gradients underflow the fp16 group scales: not equivariant.
    assert not results[0]["pow2_False_exact"]


def test_site_mismatch_is_detected(results):
    for r in results:
        msg = r["mismatch_error"]
        assert msg is not None and "ranks disagree on site" in msg and "different Echo sites" in msg, msg
        assert "rank 0: blocks.0.o" in msg and "rank 1: blocks.1.o" in msg, msg


def test_a_rank_evaluating_while_its_peer_trains_is_stopped_at_the_first_call(results):
    for r in results:
        msg = r["eval_train_error"]
        assert msg is not None and "ranks disagree on direction" in msg, msg
        assert "rank 0: eval" in msg and "rank 1: forward" in msg and "same pass" in msg, msg
        assert "no data was exchanged" in msg, msg


def test_unsupported_group_layout_refused_and_nothing_patched_globally(results):
    msg = results[0]["two_groups_error"]
    assert msg is not None and "2 different process groups" in msg
    # deepspeed.comm, torch.distributed and DeepSpeed's layer classes are as DeepSpeed left them.
    assert results[0]["nothing_global_patched"]


def test_deepcompile_deferred_collectives_refused(results):
    msg = results[0]["deferred_error"]
    assert msg is not None and "autotp" in msg and "passes" in msg


def test_one_block_gradients_within_quantizer_bound(results):
    for r in results:
        b = r["block_bound"]
        assert b["calls"] == (1, 1)
        assert b["weight_grads_equal"]
        assert 0 < b["forward_error"] <= b["forward_bound"], b
        assert 0 < b["backward_error"] <= b["backward_bound"], b



# ----------------------------------------------------------------------------------------------------
# Outputs the model may modify in place: Falcon's new decoder (fp32), and the wrappers in every dtype
# ----------------------------------------------------------------------------------------------------

DTYPES = ("float32", "float16", "bfloat16")
FALCON_VOCAB, FALCON_LAYERS = 256, 2


def _falcon(seed=0):
    """A tiny Falcon with the new decoder architecture (about 0.4 M parameters), whose decoder layer adds
    the attention output into the MLP's row-parallel output in place (``mlp_output += attention_output``)."""
    import torch
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=FALCON_VOCAB, hidden_size=128, num_hidden_layers=FALCON_LAYERS,
                       num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True, bias=False,
                       max_position_embeddings=64, use_cache=False)
    torch.manual_seed(seed)
    return FalconForCausalLM(cfg)


def _outputs_and_falcon(rank, world_size, shm_port):
    import torch

    import echo_ds.deepspeed as echo
    from echo_ds.deepspeed.mappings import overlapped_column_parallel_linear, reduce_from_tensor_parallel_region
    from test_deepspeed_engine import _ds_config

    deepspeed_env(rank, world_size, shm_port)
    res = {}

    # The wrappers at P = 2: each output owns its memory, takes an in-place update and back-propagates.
    net = _build()
    rt = echo.enable(net, _cfg())
    row = next(s for s in rt.sites if s.direction == "forward")
    column = next(s for s in rt.sites if s.direction == "backward")
    gen = torch.Generator().manual_seed(40 + rank)
    for name in DTYPES:
        dtype = getattr(torch, name)
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(HIDDEN, HIDDEN, generator=gen).to(dtype).requires_grad_()
        rt.begin_forward_pass(True)
        y_row = reduce_from_tensor_parallel_region(x, row)
        y_col = overlapped_column_parallel_linear(x, w, None, column)
        owned = {k: (y._base is None, y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), y.dtype == dtype)
                 for k, y in (("row", y_row), ("column", y_col))}
        y_row += 1  # what Falcon does to its MLP output
        y_col.mul_(2)
        (y_row.float().sum() + y_col.float().sum()).backward()
        res[f"owned_{name}"] = owned
        res[f"inplace_backward_{name}"] = x.grad is not None and bool(torch.isfinite(x.grad.float()).all())
    echo.disable(net)

    # Falcon (new decoder) under AutoTP 2 through Echo, fp32: forward, backward, optimizer step.
    tokens = torch.randint(0, FALCON_VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    model = _falcon()
    engine, *_ = echo.initialize(model=model, model_parameters=model.parameters(),
                                 config=_ds_config({"bits": 4, "backend": "reference"}))
    rt = echo.get_runtime(engine)
    res["falcon_dtype"] = str(next(engine.module.parameters()).dtype)
    res["falcon_classes"] = {n.split(".")[-1]: type(m).__name__ for n, m in engine.module.named_modules()
                             if n.startswith("transformer.h.0.") or n == "lm_head"}
    losses = []
    for step in range(2):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        if step == 0:
            params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
            res["falcon_grads"] = {
                "missing": [n for n, p in params if p.grad is None],
                "finite": all(bool(torch.isfinite(p.grad).all()) for _, p in params if p.grad is not None),
                "nonzero": sum(bool(p.grad.abs().sum() > 0) for _, p in params if p.grad is not None),
                "count": len(params),
            }
            before = {n: p.detach().clone() for n, p in params}
        engine.step()
        if step == 0:
            res["falcon_updated"] = sum(not torch.equal(before[n], p.detach()) for n, p in params)
        losses.append(out.loss.item())
    res["falcon_losses"] = losses
    res["falcon_counts"] = (rt.stats.forward_calls, rt.stats.backward_calls)
    return res


@pytest.fixture(scope="module")
def falcon_results():
    pytest.importorskip("transformers")
    return run_distributed(_outputs_and_falcon, 2, free_port(), timeout=300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrapper_output_is_not_a_view_at_world_size_1(dtype):
    # No process group: a one-rank site. The reduction is the identity, and still a tensor of its own.
    import types

    import torch

    from echo_ds.deepspeed.mappings import reduce_from_tensor_parallel_region

    site = types.SimpleNamespace(world_size=1)
    x = torch.randn(3, 5, dtype=getattr(torch, dtype), requires_grad=True)
    y = reduce_from_tensor_parallel_region(x, site)
    assert y._base is None and y.data_ptr() != x.data_ptr() and y.dtype == x.dtype and torch.equal(y, x)
    y += 1  # an autograd Function's output that is its input (or a view) would raise here
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrapper_outputs_are_not_views_at_world_size_2(falcon_results, dtype):
    for r in falcon_results:
        # (not a view, not x's memory, x's dtype) for the row-parallel reduction and the overlapped column.
        assert r[f"owned_{dtype}"] == {"row": (True, True, True), "column": (True, True, True)}
        assert r[f"inplace_backward_{dtype}"]


def test_falcon_new_decoder_trains_in_fp32(falcon_results):
    import math

    r0, r1 = falcon_results
    for r in falcon_results:
        assert r["falcon_dtype"] == "torch.float32"
        classes = r["falcon_classes"]
        # Row-parallel outputs through Echo (dense_4h_to_h's is the one the decoder adds into in place);
        # column-parallel input gradients through Echo (the fused qkv too); the output head left to DeepSpeed.
        assert classes["dense"] == classes["dense_4h_to_h"] == "EchoLinearAllreduce", classes
        assert classes["dense_h_to_4h"] == "EchoLinearLayer", classes
        assert classes["query_key_value"].startswith("Echo"), classes
        assert not classes["lm_head"].startswith("Echo"), classes
        g = r["falcon_grads"]
        assert g["missing"] == [] and g["finite"] and g["nonzero"] == g["count"] > 0, g
        assert r["falcon_updated"] == g["count"]
        assert all(math.isfinite(v) for v in r["falcon_losses"]), r["falcon_losses"]
        # Per layer: dense and dense_4h_to_h forward; query_key_value and dense_h_to_4h backward.
        assert r["falcon_counts"] == (2 * 2 * FALCON_LAYERS, 2 * 2 * FALCON_LAYERS)
    assert r0["falcon_losses"] == r1["falcon_losses"]  # every rank sees the same all-reduced outputs
    assert r0["falcon_losses"][0] < math.log(FALCON_VOCAB) + 1
