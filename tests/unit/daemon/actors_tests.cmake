# Unit tests for daemon/actors; included by tests/unit/daemon/CMakeLists.txt. The tsan
# preset builds and runs them too (the mailbox hand-off between actor threads).
rd_add_gtest(NAME daemon_mailbox_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/actors/mailbox_test.cpp
  LIBS rolloutd_daemon
  TIMEOUT 120)
rd_add_gtest(NAME daemon_connection_flush_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/actors/connection_flush_test.cpp
  LIBS rolloutd_daemon
  TIMEOUT 60)
