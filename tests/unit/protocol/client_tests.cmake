# protocol/client.cpp against a scripted fake daemon (ROUTER on an ephemeral loopback port).
# Included by tests/unit/protocol/CMakeLists.txt.
rd_add_gtest(NAME client_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/client_test.cpp
             LIBS rolloutd_client rolloutd_zmq)
# protocol/curve.cpp: keys, certificates, key files (temporary directories only).
rd_add_gtest(NAME curve_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/curve_test.cpp LIBS rolloutd_client)
