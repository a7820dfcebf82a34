// The one error header of csrc/: every failure raises (with file:line), nothing calls exit().
//
// ECHO_CHECK(cudaCall)        raises when a CUDA runtime call does not return cudaSuccess.
// ECHO_HOST_ASSERT(cond, msg) raises when a host-side precondition does not hold.
//
// Both throw echo::EchoError, a std::runtime_error, which pybind11 turns into a Python RuntimeError at
// the binding layer.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace echo {

class EchoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void raise_error(const char* file, int line, const std::string& what) {
  throw EchoError(std::string(file) + ":" + std::to_string(line) + ": " + what);
}

}  // namespace echo

#define ECHO_HOST_ASSERT(cond, msg)                                                        \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      ::echo::raise_error(__FILE__, __LINE__, std::string(msg) + " (" #cond ")");          \
    }                                                                                      \
  } while (0)

#define ECHO_CHECK(call)                                                                   \
  do {                                                                                     \
    const cudaError_t echo_err_ = (call);                                                  \
    if (echo_err_ != cudaSuccess) {                                                        \
      ::echo::raise_error(__FILE__, __LINE__,                                              \
                          std::string(#call " failed: ") + cudaGetErrorString(echo_err_)); \
    }                                                                                      \
  } while (0)
