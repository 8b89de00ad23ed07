/* Internal to csrc/cuda: turn a CUDA error into an rs_error (never print, never exit). */
#ifndef RESHARD_CUDA_CHECK_H
#define RESHARD_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "reshard_cuda.h"

/* `what` names the call; the CUDA error string follows it. */
static inline rs_status rs_cuda_fail(rs_error *err, const char *what, cudaError_t e) {
  return rs_fail(err, RS_EDEVICE, -1, -1, "%s failed: %s", what, cudaGetErrorString(e));
}

/* what: a short description of the call, e.g. "stage_h2d: cudaMemcpyAsync (ring -> device)". */
#define RS_CUDA_TRY(what, call, err)                                     \
  do {                                                                   \
    cudaError_t rs_e_ = (call);                                          \
    if (rs_e_ != cudaSuccess) return rs_cuda_fail((err), (what), rs_e_); \
  } while (0)

#endif /* RESHARD_CUDA_CHECK_H */
