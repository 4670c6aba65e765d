// rolloutd._native: the C++ client's raw transport (Client::send_raw / recv_raw) for
// the Python package, which speaks msgpack itself (rolloutd/wire.py). This is what
// lets the package run where pyzmq cannot be installed (the GPU host).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/client.hpp"
#include "protocol/curve.hpp"

namespace py = pybind11;
using rolloutd::ErrorCode;
using rolloutd::Status;
using rolloutd::protocol::Client;
using rolloutd::protocol::ClientOptions;

namespace {

// Blocking calls wait in slices this long, without the GIL, and check for
// signals in between, so Ctrl-C interrupts a long recv.
constexpr int kSliceMs = 100;

// rolloutd._native.TransportError, with .code/.message/.field. This reference is
// never released: the translator may run during interpreter shutdown.
PyObject* g_transport_error = nullptr;

struct TransportError {
  Status status;
};

[[noreturn]] void throw_status(Status s) { throw TransportError{std::move(s)}; }

// A read-only view of one frame's bytes, valid while this object lives: it holds a
// reference to the Python object and, for buffers, the buffer export (which pins the
// memory), so send() can release the GIL without copying a weight bucket first.
class FrameView {
 public:
  explicit FrameView(const py::handle& item) : owner_(py::reinterpret_borrow<py::object>(item)) {
    if (PyBytes_Check(item.ptr())) {
      bytes_ = std::string_view(PyBytes_AS_STRING(item.ptr()),
                                static_cast<size_t>(PyBytes_GET_SIZE(item.ptr())));
      return;
    }
    if (!PyObject_CheckBuffer(item.ptr()) || PyUnicode_Check(item.ptr()))
      throw py::type_error("frames must be bytes-like, got " +
                           std::string(py::str(py::type::of(item).attr("__name__"))));
    info_ = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(item).request());
    if (!PyBuffer_IsContiguous(info_->view(), 'C')) throw py::value_error("frames must be contiguous");
    bytes_ = std::string_view(static_cast<const char*>(info_->ptr),
                              static_cast<size_t>(info_->size * info_->itemsize));
  }
  std::string_view bytes() const { return bytes_; }

 private:
  py::object owner_;
  std::unique_ptr<py::buffer_info> info_;  // released (PyBuffer_Release) with the GIL held
  std::string_view bytes_;
};

class Transport {
 public:
  Transport(std::string endpoint, int send_hwm, int recv_hwm, std::string curve_server_key,
            std::string curve_public_key, std::string curve_secret_key)
      : endpoint_(std::move(endpoint)) {
    ClientOptions options;
    options.endpoint = endpoint_;
    options.send_hwm = send_hwm;
    options.recv_hwm = recv_hwm;
    options.curve.server_public_key = std::move(curve_server_key);
    options.curve.client = {std::move(curve_public_key), std::move(curve_secret_key)};
    auto client = Client::connect(options);
    if (!client.ok()) throw_status(client.status());
    client_ = std::move(client).value();
  }

  void send(const py::sequence& frames, int timeout_ms) {
    if (timeout_ms < 0) throw py::value_error("timeout_ms must be >= 0");
    std::vector<FrameView> views;
    views.reserve(py::len(frames));
    for (const auto& item : frames) views.emplace_back(item);
    if (views.empty()) throw py::value_error("a message needs at least one frame");
    std::vector<std::string_view> parts;
    parts.reserve(views.size());
    for (const auto& v : views) parts.push_back(v.bytes());
    const auto started = Clock::now();
    const auto deadline = started + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const int slice = slice_ms(deadline);
      Status s = [&] {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(mu_);
        return live().send_raw_views(parts, slice);
      }();
      if (s.ok()) return;
      // kUnavailable: no daemon took the message in this slice; nothing was sent. Retry while
      // the queue is merely full or the first connection is still being made; a daemon that
      // is down is reported at once.
      if (s.code() != ErrorCode::kUnavailable || Clock::now() >= deadline) throw_status(std::move(s));
      const bool down = [&] {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(mu_);
        return live().unreachable();
      }();
      if (down && Clock::now() >= started + std::chrono::milliseconds(Client::kReconnectWaitMs))
        throw_status(std::move(s));
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  py::object recv(int timeout_ms, std::optional<uint64_t> lost_since) {
    if (timeout_ms < 0) throw py::value_error("timeout_ms must be >= 0");
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const int slice = slice_ms(deadline);
      auto got = [&] {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(mu_);
        return live().recv_raw(slice, lost_since);
      }();
      if (!got.ok()) throw_status(got.status());
      if (*got) {
        py::list out;
        for (const auto& f : **got) out.append(py::bytes(f));
        return out;
      }
      if (Clock::now() >= deadline) return py::none();
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  uint64_t disconnects() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    return live().disconnects();
  }

  void close() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    client_.reset();
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return client_ == nullptr;
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  using Clock = std::chrono::steady_clock;

  static int slice_ms(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(left, 0, kSliceMs));
  }

  // Called with mu_ held.
  Client& live() {
    if (!client_) throw_status(Status(ErrorCode::kFailedPrecondition, "transport is closed"));
    return *client_;
  }

  std::string endpoint_;
  // Python threads may share a Transport; a ZeroMQ socket must not be used by two at once.
  mutable std::mutex mu_;
  std::unique_ptr<Client> client_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "rolloutd's C++ ZeroMQ transport (a DEALER on the daemon's control socket)";

  g_transport_error = PyErr_NewExceptionWithDoc(
      "rolloutd._native.TransportError",
      "A transport failure; .code is the stable error name, .message and .field explain it.",
      PyExc_RuntimeError, nullptr);
  if (g_transport_error == nullptr) throw py::error_already_set();
  m.add_object("TransportError", py::handle(g_transport_error));

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TransportError& e) {
      py::object err = py::reinterpret_borrow<py::object>(g_transport_error)(e.status.to_string());
      err.attr("code") = py::str(std::string(rolloutd::error_code_name(e.status.code())));
      err.attr("message") = py::str(e.status.message());
      err.attr("field") = py::str(e.status.field());
      PyErr_SetObject(g_transport_error, err.ptr());
    }
  });

  py::class_<Transport>(m, "Transport",
                        "One DEALER socket connected to `endpoint`. Frames are bytes; "
                        "every call is bounded by its timeout.")
      .def(py::init<std::string, int, int, std::string, std::string, std::string>(), py::arg("endpoint"),
           py::arg("send_hwm") = 1000, py::arg("recv_hwm") = 100000, py::kw_only(),
           py::arg("curve_server_key") = "", py::arg("curve_public_key") = "", py::arg("curve_secret_key") = "",
           "CURVE (SPEC 1.2): the daemon's public key and this client's key pair, Z85 text; all empty for a "
           "plain connection. A refused handshake raises TransportError 'unauthenticated'.")
      .def("send", &Transport::send, py::arg("frames"), py::arg("timeout_ms") = 30000,
           "Sends one message (envelope frame, then payload frames). Raises TransportError "
           "'unavailable' if no daemon takes it within timeout_ms.")
      .def("recv", &Transport::recv, py::arg("timeout_ms"), py::arg("lost_since") = py::none(),
           "The frames of the next message, or None if none arrives within timeout_ms. lost_since: a "
           "`disconnects` value read before sending what is awaited; the wait then raises TransportError "
           "'unavailable' once the connection drops after it and does not come back within 300 ms.")
      .def_property_readonly("disconnects", &Transport::disconnects,
                             "How many times the connection to the daemon dropped so far.")
      .def("close", &Transport::close, "Closes the socket (pending sends linger at most 100 ms).")
      .def_property_readonly("closed", &Transport::closed)
      .def_property_readonly("endpoint", &Transport::endpoint)
      .def("__enter__", [](Transport& t) -> Transport& { return t; }, py::return_value_policy::reference)
      .def("__exit__", [](Transport& t, const py::args&) { t.close(); });

  // CURVE keys (protocol/curve.hpp), for rolloutd.security. Errors raise TransportError.
  auto value = [](auto result) {
    if (!result.ok()) throw_status(result.status());
    return std::move(result).value();
  };
  m.def("curve_available", &rolloutd::protocol::curve_available,
        "Whether this libzmq supports CURVE (zmq_has(\"curve\")).");
  m.def("curve_keypair", [value] {
    auto k = value(rolloutd::protocol::generate_curve_keypair());
    return py::make_tuple(k.public_key, k.secret_key);
  }, "A new key pair (public, secret), Z85 text.");
  m.def("curve_keypair_from_secret", [value](const std::string& secret) {
    auto k = value(rolloutd::protocol::curve_keypair_from_secret(secret));
    return py::make_tuple(k.public_key, k.secret_key);
  }, py::arg("secret_key"), "(public, secret) from a Z85 secret key.");
  m.def("load_curve_keypair", [value](const std::string& path) {
    auto k = value(rolloutd::protocol::load_curve_keypair_file(path));
    return py::make_tuple(k.public_key, k.secret_key);
  }, py::arg("path"), "(public, secret) from a secret certificate (<name>.key_secret).");
  m.def("load_curve_public_key", [value](const std::string& key_or_path) {
    return value(rolloutd::protocol::load_curve_public_key(key_or_path));
  }, py::arg("key_or_path"), "A public key given as Z85 text or as a certificate path.");
  m.def("write_curve_keypair", [value](const std::string& base, bool overwrite) {
    auto k = value(rolloutd::protocol::generate_curve_keypair());
    auto f = value(rolloutd::protocol::write_curve_keypair_files(base, k, overwrite));
    return py::make_tuple(k.public_key, f.public_path, f.secret_path);
  }, py::arg("base"), py::arg("overwrite") = false,
     "Writes a new key pair to <base>.key and <base>.key_secret (mode 0600); returns (public_key, public_path, "
     "secret_path).");
}
