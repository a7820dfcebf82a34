"""Where the one-launch runtime's host time goes, part by part, timed in C++ (issue 31: <= 10 us a call).

    python benchmarks/runtime_parts.py                  # one process on the visible GPU, 64 KiB of bf16

RESULTS.md ("One transport", 23:39 UTC) has the runtime's call (P2PRuntime.call, from Python) at 10-11 us,
and a bare launch of an empty kernel with the plan's 1176 bytes of parameters at about 3 us (launch_params.cu).
This times, each alone in a C++ loop, what the call does besides the launch: y's allocation (at::empty_like, and
at::empty from sizes and options), the current stream (as the runtime looks it up, and through c10::cuda), the
launch with its error check, and the three together; then, from Python, the price of crossing into C++ with a
tensor and of bringing one back (the pybind conversions). Every row: the median over ``--batches`` batches of
one batch's host time divided by its ``--batch`` operations (the GPU drained between batches, the allocations
of a batch freed after it).

It builds a small extension with torch.utils.cpp_extension.load_inline (about a minute, once): a CUDA build of
torch and nvcc are needed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

CPP = r"""
#include <torch/extension.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <vector>

struct Plan { unsigned char bytes[1176]; };  // sizeof(echo::P2PAllReduceArgs), nvcc 13.0

__global__ void empty_kernel(const Plan p, int* never) {
  if (p.bytes[0] == 255 && threadIdx.x == 0) *never = 1;  // reads its parameters; never true
}

static cudaStream_t runtime_stream(const at::Tensor& x) {  // as P2PRuntime::call looks it up
  const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x.device());
  return static_cast<cudaStream_t>(s.native_handle());
}

// part: 0 empty_like, 1 empty(sizes, options), 2 the runtime's stream lookup, 3 getCurrentCUDAStream,
// 4 launch + cudaGetLastError, 5 empty_like + stream + launch (the call's C++ side without its checks),
// 6 at::detail::empty_cuda (the CUDA allocation without the dispatcher), 7 as 5 with 6's allocation.
double part_us(const at::Tensor& x, int64_t part, int64_t blocks, int64_t batch, int64_t batches) {
  Plan plan{};
  int* never = static_cast<int*>(x.data_ptr());  // never written (the kernel's condition is false)
  std::vector<at::Tensor> keep;
  keep.reserve(batch);
  std::vector<double> us;
  volatile uintptr_t sink = 0;
  const auto launch = [&] {
    empty_kernel<<<blocks, 256, 0, runtime_stream(x)>>>(plan, never);
    C10_CUDA_CHECK(cudaGetLastError());
  };
  const auto empty_direct = [&] {
    return at::Tensor(at::detail::empty_cuda(x.sizes(), x.scalar_type(), x.device(), std::nullopt));
  };
  for (int64_t b = 0; b <= batches; ++b) {
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    keep.clear();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < batch; ++i) {
      switch (part) {
        case 0: keep.push_back(at::empty_like(x)); break;
        case 1: keep.push_back(at::empty(x.sizes(), x.options())); break;
        case 2: sink = sink + reinterpret_cast<uintptr_t>(runtime_stream(x)); break;
        case 3: sink = sink + reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream().stream()); break;
        case 4: launch(); break;
        case 5: keep.push_back(at::empty_like(x)); launch(); break;
        case 6: keep.push_back(empty_direct()); break;
        default: keep.push_back(empty_direct()); launch();
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (b > 0) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / batch);  // b 0: warm-up
  }
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// For the pybind rows, timed from Python: a tensor in, nothing out; a tensor in, the same tensor out; a tensor
// in, a new one out (the runtime's shape: y allocated in C++ and wrapped for Python).
void take(const at::Tensor& x) {}
at::Tensor echo(const at::Tensor& x) { return x; }
at::Tensor fresh(const at::Tensor& x) { return at::empty_like(x); }
void take_optionals(const at::Tensor& x, const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                    const c10::optional<at::Tensor>& c) {}
"""

# load_inline binds these from its C++ source (it prepends torch/extension.h); the CUDA source defines them.
DECLARATIONS = r"""
double part_us(const at::Tensor& x, int64_t part, int64_t blocks, int64_t batch, int64_t batches);
void take(const at::Tensor& x);
at::Tensor echo(const at::Tensor& x);
at::Tensor fresh(const at::Tensor& x);
void take_optionals(const at::Tensor& x, const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                    const c10::optional<at::Tensor>& c);
"""

PARTS = ("at::empty_like(x)", "at::empty(x.sizes(), x.options())", "the runtime's stream lookup",
         "c10::cuda::getCurrentCUDAStream()", "launch (1176 B of parameters) + cudaGetLastError",
         "empty_like + stream + launch", "at::detail::empty_cuda (no dispatcher)",
         "empty_cuda + stream + launch")


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("echo_runtime_parts", cpp_sources=DECLARATIONS, cuda_sources=CPP,
                       functions=["part_us", "take", "echo", "fresh", "take_optionals"], verbose=False)


def python_us(fn, batch, batches, dev) -> float:
    secs = []
    for _ in range(batches + 1):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        secs.append((time.perf_counter() - t) / batch * 1e6)
    return statistics.median(secs[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 15, help="elements of x (bf16); default 64 KiB")
    ap.add_argument("--blocks", type=int, default=66, help="the launch's grid (66: the one launch's at P = 2 on one GPU)")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--batches", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("runtime_parts.py times CUDA host paths: it needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    t = time.perf_counter()
    ext = build()
    print(f"built in {time.perf_counter() - t:.1f} s")
    x = torch.zeros(args.numel, dtype=torch.bfloat16, device=dev)
    b, n = args.batch, args.batches
    print(f"host time per operation ({torch.cuda.get_device_name(dev)}; {args.numel} bf16 elements, "
          f"{args.blocks} blocks; median of {n} batches of {b})")
    print("| part | host time |\n|---|---:|")
    for i, name in enumerate(PARTS):
        print(f"| {name} (C++) | {ext.part_us(x, i, args.blocks, b, n):.2f} us |")
    rows = [("pybind: a tensor in, None out", lambda: ext.take(x)),
            ("pybind: a tensor in, the same tensor out", lambda: ext.echo(x)),
            ("pybind: a tensor in, a new tensor out (empty_like in C++)", lambda: ext.fresh(x)),
            ("pybind: a tensor and three None optionals in", lambda: ext.take_optionals(x, None, None, None)),
            ("pybind: a tensor and three tensor optionals in", lambda: ext.take_optionals(x, x, x, x)),
            ("torch.empty_like(x) (Python)", lambda: torch.empty_like(x))]
    for name, fn in rows:
        print(f"| {name} | {python_us(fn, b, n, dev):.2f} us |")


if __name__ == "__main__":
    main()
