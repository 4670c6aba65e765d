# Third-party dependencies, all from Debian 12 packages (deploy/install-deps.sh) or,
# on the GPU host, from the staged folder (.deps/gpu/env.sh sets the search paths).
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)

pkg_check_modules(ZMQ REQUIRED IMPORTED_TARGET libzmq)
# cppzmq is header-only; its pkg-config file exists on Debian, the header is all we need.
find_path(CPPZMQ_INCLUDE_DIR zmq.hpp REQUIRED)
add_library(rolloutd_zmq INTERFACE)
target_include_directories(rolloutd_zmq SYSTEM INTERFACE ${CPPZMQ_INCLUDE_DIR})
target_link_libraries(rolloutd_zmq INTERFACE PkgConfig::ZMQ)

find_package(msgpack-cxx CONFIG QUIET)
if(TARGET msgpack-cxx)
  set(ROLLOUTD_MSGPACK_TARGET msgpack-cxx)
else()
  find_package(msgpack CONFIG REQUIRED)   # msgpack-c 4.x names its target msgpackc-cxx
  set(ROLLOUTD_MSGPACK_TARGET msgpackc-cxx)
endif()
add_library(rolloutd_msgpack INTERFACE)
target_link_libraries(rolloutd_msgpack INTERFACE ${ROLLOUTD_MSGPACK_TARGET})
# Header-only use; no Boost dependency from msgpack itself.
target_compile_definitions(rolloutd_msgpack INTERFACE MSGPACK_NO_BOOST)

find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(Boost 1.74 REQUIRED)

# prometheus-cpp core only (its CMake config also demands civetweb/zlib/curl for pull/push).
pkg_check_modules(PROMCORE REQUIRED IMPORTED_TARGET prometheus-cpp-core)

# libsystemd is optional: sd_notify is used when present (deploy/systemd).
pkg_check_modules(SYSTEMD IMPORTED_TARGET libsystemd)

if(ROLLOUTD_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(ROLLOUTD_BUILD_PYTHON)
  # Scripts pass Python3_EXECUTABLE=/usr/bin/python3 (Debian's, which has python3-msgpack,
  # python3-numpy and python3-pytest); the GPU host passes its own python3.
  find_package(Python3 COMPONENTS Interpreter Development.Module)
  find_package(pybind11 CONFIG QUIET)
  if(NOT pybind11_FOUND AND Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import pybind11; print(pybind11.get_cmake_dir())"
                    OUTPUT_VARIABLE _pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_pybind11_dir)
      find_package(pybind11 CONFIG QUIET PATHS ${_pybind11_dir} NO_DEFAULT_PATH)
    endif()
  endif()
  if(NOT pybind11_FOUND)
    message(WARNING "pybind11 not found: the Python client extension will not be built")
  endif()
endif()

if(ROLLOUTD_ENABLE_CUDA)
  set(ROLLOUTD_CUDA_ENABLED_01 true)
else()
  set(ROLLOUTD_CUDA_ENABLED_01 false)
endif()
