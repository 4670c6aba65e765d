# The Python package (rolloutd.wire against protocol/golden/, rolloutd._native, rolloutd.Client
# against a pure-Python fake daemon). Included by tests/unit/protocol/CMakeLists.txt; needs the
# _native module, so it is registered only where pybind11 was found.
if(TARGET _native)
  rd_add_pytest(NAME py_protocol_unit PATH tests/unit/protocol/python LABELS unit)
endif()
