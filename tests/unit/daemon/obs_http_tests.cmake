# Unit tests for daemon/obs and daemon/http; included by tests/unit/daemon/CMakeLists.txt.
rd_add_gtest(NAME daemon_log_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/obs/log_test.cpp
  LIBS rolloutd_obs)
rd_add_gtest(NAME daemon_metrics_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/obs/metrics_test.cpp
  LIBS rolloutd_obs)
# Loopback sockets only; every wait in it has a deadline of a few seconds.
rd_add_gtest(NAME daemon_http_server_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/http/http_server_test.cpp
  LIBS rolloutd_http Boost::headers
  TIMEOUT 120)
