# MPS for ranks that share one GPU (their spinning waits and kernels must run side by side); source it
# from a benchmarks/ GPU script, then `start_mps` (sets MPS=1 when the daemon answers a CUDA context,
# else goes on with time-slicing, MPS=0) and `stop_mps` at the end. Its own pipe and log directories.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/echo_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/echo_mps_log
MPS=0
start_mps() {
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d 2>/dev/null; then
    if timeout 60 python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" 2>/dev/null; then
      MPS=1
    else
      echo quit | nvidia-cuda-mps-control; sleep 1
    fi
  fi
}
stop_mps() {
  if [ "$MPS" = 1 ]; then echo quit | nvidia-cuda-mps-control; MPS=0; fi
}
