# kernels/quant/: MXFP4, MXFP8 and UE8M0 blockwise FP8 (quantize, dequantize, kernel layouts),
# part of rolloutd_kernels. Included from kernels/CMakeLists.txt after the target exists.
target_sources(rolloutd_kernels PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/quant_checks.cpp
  ${CMAKE_CURRENT_LIST_DIR}/quant_ops.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cpu_quant.cpp
)
if(ROLLOUTD_ENABLE_CUDA)
  # One translation unit for every quantization kernel: CI compiles it for sm_90a on 2 cores.
  # No fast-math: the kernels rely on IEEE division (__fdiv_rn) and unflushed subnormals.
  target_sources(rolloutd_kernels PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda_quant.cu)
endif()
