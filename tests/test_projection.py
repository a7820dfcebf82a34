"""benchmarks/projection.py on the CPU: it runs, prints both machines' tables (NCCL beside Echo, 1 MiB to
1 GiB), and its figures are the bytes model's at the measured efficiency, checked by hand at 1 GiB."""

from __future__ import annotations

import pytest

from utils import load_benchmark

PJ = load_benchmark("projection")
GIB = 1 << 30


def test_prints_both_machines(capsys, tmp_path):
    assert PJ.main(["--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    for machine in ("8 x H100", "8 x H200"):
        assert machine in out
    assert out.count("| size | NCCL ring 16-bit | Echo 4-bit | Echo 4-bit compensated | Echo 8-bit |") == 4
    # 1 MiB is also a row of the measured-efficiency table (64 KiB to 256 MiB).
    assert out.count("\n| 1 MiB | ") == 5 and out.count("\n| 1 GiB | ") == 4
    assert out.count("Echo against NCCL: ") == 4
    assert (tmp_path / "p.json").stat().st_size > 0


def test_nccl_and_echo_by_hand():
    # NCCL: 10.18 us (3.6 + 14 x 0.47) + 2 x 7/8 x 1 GiB at 370 GB/s.
    assert PJ.nccl_seconds(GIB) == pytest.approx(10.18e-6 + 1.75 * GIB / 370e9)
    # The measured efficiency at its largest point (256 MiB, P = 2, uncompensated, the staged path's 704.7 us):
    # both ranks' 5.59375 bytes per element (g = 128 zero_aware: 68 bytes a group) of 128 Mi elements.
    eff = 2 * 5.59375 * (128 << 20) / 4.260e12 / 704.7e-6
    e = PJ.echo_seconds(GIB, "H200", 4, False)
    assert e["efficiency"] == pytest.approx(eff)  # held beyond the measured range
    # 8 ranks, zero_aware_int at g = 64: 2 x (2 + 34/64 x 15/8) bytes per element of 512 Mi elements.
    hbm = 2 * (2 + 34 / 64 * 15 / 8) * (512 << 20)
    assert e["hbm_s"] == pytest.approx(hbm / (4.260e12 * eff))
    # Sent: 2 (P - 1) segments of 512 Mi / (8 x 64) groups of 34 bytes, at 370 GB/s.
    assert e["wire_s"] == pytest.approx(14 * (512 << 20) // 512 * 34 / 370e9)
    assert e["seconds"] == max(e["hbm_s"], e["wire_s"])
    # The H100's copy: 3.35 TB/s x 4.260 / 4.8.
    h100 = PJ.echo_seconds(GIB, "H100", 4, False)
    assert h100["hbm_s"] == pytest.approx(hbm / (3.35e12 * 4.260 / 4.8 * eff))


def test_goal_efficiency_and_crossover():
    measured = PJ.echo_seconds(64 << 20, "H200", 4, True)
    goal = PJ.echo_seconds(64 << 20, "H200", 4, True, target=True)
    assert goal["efficiency"] == max(measured["efficiency"], 0.70)
    assert goal["seconds"] <= measured["seconds"]
    # Below the goal's bytes the measured efficiency stands.
    small = PJ.echo_seconds(1 << 20, "H200", 4, True, target=True)
    assert small["efficiency"] == PJ.echo_seconds(1 << 20, "H200", 4, True)["efficiency"]
    assert PJ.crossover([1, 2, 3], [5, 1, 1], [2, 2, 2]) == 2
    assert PJ.crossover([1, 2, 3], [1, 5, 1], [2, 2, 2]) == 3
    assert PJ.crossover([1, 2, 3], [5, 5, 5], [2, 2, 2]) is None
    # Interpolation in log-log between measured points, held at the ends.
    pts = [(1.0, 0.1), (100.0, 0.4)]
    assert PJ.interpolate(pts, 10.0) == pytest.approx(0.2)
    assert PJ.interpolate(pts, 0.5) == 0.1 and PJ.interpolate(pts, 1e6) == 0.4


def test_compensated_projection_uses_the_default_state_format():
    """The projected compensated call stores the compensator's default state format (int4 since issue 34); the
    efficiency comes from the measured calls, whose state was bf16."""
    from echo_ds import compensator as C
    from echo_ds.config import ForwardConfig

    assert PJ.PROJECTED["state_dtype"] == ForwardConfig().state_dtype
    n = (64 << 20) // 2
    e = PJ.echo_seconds(64 << 20, "H200", 4, True)
    c = PJ.BM.call_bytes(PJ.WORLD_SIZE, n, "bfloat16", 4, 64, "zero_aware_int", "local", False,
                         state_bytes_per_element=C.state_bytes_per_element(ForwardConfig().state_dtype, 64))
    assert e["hbm_bytes"] == c.hbm_bytes
    bf16 = PJ.BM.call_bytes(PJ.WORLD_SIZE, n, "bfloat16", 4, 64, "zero_aware_int", "local", False)
    assert c.hbm_bytes < bf16.hbm_bytes, "the narrow state moves fewer bytes than the bf16 one"
