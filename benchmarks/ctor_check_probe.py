"""Probe: does an argument check that throws inside an echo_ds.ops constructor reach Python as a
RuntimeError, or kill the process? (docs/errors.md, "Known gaps"; on the H200 image of 2026-12-04 it
killed the process.)

Each case runs in its own Python process, so a crash ends only that case; the table gives the exit status
(negative: the signal), and the last lines of the case's output. Where gdb exists, a crashing case is run
again under it for a native backtrace. A control case builds a minimal torch extension with the same
pattern (a class whose pybind11 constructor calls TORCH_CHECK), so the answer separates "this image" from
"this extension".

    python3 benchmarks/ctor_check_probe.py [--out probe.txt]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import textwrap

PRELUDE = """
import faulthandler, torch
faulthandler.enable()
torch.cuda.init()
"""

ECHO = PRELUDE + """
import echo_ds.ops as E
ext = E.load()
ctl = torch.zeros(64, dtype=torch.int32, device="cuda")
flags = torch.zeros(64, dtype=torch.int32, device="cuda")
"""

CASES = {
    "echo: function check (pow2_amax, world size 1)": ECHO + """
x = torch.zeros(256, device="cuda"); a = torch.zeros(1, device="cuda")
ext.pow2_amax(x, a, None, None, 1, 64, [], 1.0, [], 0)
""",
    "echo: P2PSignal with 8 flags": ECHO + """
ext.P2PSignal([flags.data_ptr()] * 8, ctl.data_ptr(), flags.data_ptr(), 0, None)
""",
    "echo: P2PPut with lane 8": ECHO + """
ext.P2PPut([], [], ctl.data_ptr(), flags.data_ptr(), 0, 8)
""",
    "echo: P2PRuntime with world size 3": ECHO + """
p = flags.data_ptr()
ext.P2PRuntime(0, 3, [p] * 3, [p] * 3, [p] * 3, 1024, 1024, p, 10**9, 8)
""",
}

# The control: a minimal extension whose function and constructor fail a check. Variants separate the
# image's C++ runtime (what it throws) from CUDA and from echo_ds.
CONTROL = textwrap.dedent('''
from torch.utils.cpp_extension import load_inline
src = r"""
#include <torch/extension.h>
#include <stdexcept>
struct Obj { explicit Obj(int64_t n) { if (n > 7) THROW("Obj: at most 7, got " + std::to_string(n)); } };
void fn(int64_t n) { if (n > 7) THROW("fn: at most 7, got " + std::to_string(n)); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Obj>(m, "Obj").def(pybind11::init<int64_t>());
  m.def("fn", &fn);
}
"""
mod = load_inline(NAME, cpp_sources=["#define THROW(msg) " + THROW + "\\n" + src], extra_cflags=["-O3"])
import os
os.system("ldd " + mod.__file__ + " | grep -E 'libstdc|libgcc_s|libc10'")
for call in (lambda: mod.fn(8), lambda: mod.Obj(8)):
    try:
        call()
    except RuntimeError as e:
        print("RuntimeError:", str(e).splitlines()[0])
''')


def control(name: str, throw: str, cuda: bool = True) -> str:
    head = PRELUDE if cuda else "import faulthandler, torch\nfaulthandler.enable()\n"
    return head + f"NAME, THROW = {name!r}, {throw!r}\n" + CONTROL


TORCH_CHECK = 'TORCH_CHECK(false, msg)'
CASES.update({
    "control: TORCH_CHECK": control("echo_probe_check", TORCH_CHECK),
    "control: TORCH_CHECK, no CUDA context": control("echo_probe_nocuda", TORCH_CHECK, cuda=False),
    "control: throw std::runtime_error": control("echo_probe_std", "throw std::runtime_error(msg)"),
})

# The image's C++ runtime: the compiler that builds extensions, the one torch was built with, and the
# libstdc++ and libgcc_s a Python process with torch and CUDA has mapped.
FACTS = ("g++ --version | head -1",
         "python3 -c \"import torch; print([l for l in torch.__config__.show().splitlines() if 'GCC' in l or 'C++' in l])\"",
         "python3 -c \"import torch; torch.cuda.init(); print(sorted({l.split()[-1] for l in open('/proc/self/maps') "
         "if 'libstdc++' in l or 'libgcc_s' in l}))\"",
         "ldconfig -p | grep -E 'libstdc\\+\\+|libgcc_s'")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = ["| case | exit status | last output |", "|---|---:|---|"]
    details = []
    facts = [f"$ {c}\n" + subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip() for c in FACTS]
    # The cases run side by side (the controls' builds dominate), each in its own process.
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, code in CASES.items()}
    for name, code in CASES.items():
        out = procs[name].communicate(timeout=600)[0]
        rc = procs[name].returncode
        tail = [ln for ln in out.splitlines() if ln.strip() and "WARNING" not in ln][-3:]
        lines.append(f"| {name} | {rc} | {' / '.join(t.strip()[:120] for t in tail)} |")
        details.append(f"### {name}: exit status {rc}\n{out[-4000:]}")
        if rc < 0 and shutil.which("gdb"):
            p = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c", code],
                               capture_output=True, text=True, timeout=600)
            details.append(f"#### gdb backtrace\n{(p.stdout + p.stderr)[-6000:]}")
    text = "\n".join(lines) + "\n\n" + "\n\n".join(facts) + "\n\n" + "\n\n".join(details)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
