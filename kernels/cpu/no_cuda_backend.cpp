// Built instead of kernels/cuda/ when ROLLOUTD_ENABLE_CUDA is off: the seam still links,
// and callers learn at run time that there is no CUDA backend.
#include "kernels/backend.hpp"

namespace rolloutd {

const Backend* cuda_backend() { return nullptr; }
int cuda_device_count() { return 0; }

}  // namespace rolloutd
