# kernels/moe/: routers, SwiGLU variants and the routed-expert GEMMs (CPU reference + CUDA),
# part of rolloutd_kernels. Included from kernels/CMakeLists.txt after the target exists.
set(_rd_moe_cpu
  ${CMAKE_CURRENT_LIST_DIR}/moe_checks.cpp
  ${CMAKE_CURRENT_LIST_DIR}/moe_ops.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cpu_moe_router.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cpu_moe_experts.cpp
)
target_sources(rolloutd_kernels PRIVATE ${_rd_moe_cpu})
# Routing must pick the same experts on CPU and CUDA: no FMA contraction in the reference
# (moe_math.hpp writes every fma it wants explicitly).
set_source_files_properties(${_rd_moe_cpu} PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
if(ROLLOUTD_ENABLE_CUDA)
  # Two translation units (CI compiles them for sm_90a on 2 cores). No fast-math: the routers
  # rely on IEEE rounding (moe_math.hpp).
  target_sources(rolloutd_kernels PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/cuda_moe_router.cu
    ${CMAKE_CURRENT_LIST_DIR}/cuda_moe_experts.cu
  )
endif()
