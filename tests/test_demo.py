"""``python -m echo_ds.demo`` at a small size (2 gloo ranks, 8 sites): its table and its explanation."""

from __future__ import annotations

import re

from echo_ds import demo


def test_demo_explains_why_one_compensated_call_is_further_off(capsys):
    demo.main(["--sites", "8", "--numel", "4096"])
    out = capsys.readouterr().out
    rows = {m.group(1).strip(): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(.{32}) +([\d.]+)% +([\d.]+)%$", out, re.M)}
    plain = rows.pop("no compensation")
    assert len(rows) == 3
    for name, (call, accumulated) in rows.items():
        assert accumulated < plain[1], name  # what compensation is for
    larger = any(call > plain[0] for call, _ in rows.values())
    assert larger  # the case the explanation is for: each compensated call also carries its correction
    assert (demo.WHY_ONE_CALL_IS_LARGER in out) == larger
    assert "correction" in demo.WHY_ONE_CALL_IS_LARGER and "accumulated" in demo.WHY_ONE_CALL_IS_LARGER
