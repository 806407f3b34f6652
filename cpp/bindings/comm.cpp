#include <pybind11/stl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "comm/communicator.hpp"
#include "comm/nccl_library.hpp"
#include "comm/shm/communicator.hpp"

namespace py = pybind11;

namespace megart::bindings {

namespace {

using comm::Buffer;
using comm::Communicator;
using comm::WorkPtr;

// Tensors arrive as (address, element count, dtype name): the core never sees torch.
Buffer buffer(std::uintptr_t data, std::size_t count, const std::string& dtype) {
  return Buffer{reinterpret_cast<void*>(data), count, comm::dtype_from_name(dtype)};
}

void bind_communicator(py::module_& m) {
  py::class_<comm::Work, WorkPtr>(m, "Work", "One op in flight.")
      .def("wait", &comm::Work::wait, py::call_guard<py::gil_scoped_release>(),
           "Blocks until the op finishes; raises its CommError if it failed.")
      .def("is_completed", &comm::Work::is_completed, py::call_guard<py::gil_scoped_release>())
      .def("wait_stream", &comm::Work::wait_stream, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Orders the device stream (a cudaStream_t as an integer, 0 the default stream) after "
           "the op without blocking the host (nccl); host transports wait() instead.");

  using Ptr = std::uintptr_t;
  using Str = const std::string&;
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "A group of ranks; buffers are (address, count, dtype name). `stream` (a cudaStream_t as "
      "an integer, 0 the default stream) is the caller's stream: the nccl transport orders each "
      "op after the work queued on it; the shm transport ignores it.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def(
          "all_reduce",
          [](Communicator& c, Ptr data, std::size_t count, Str dtype, Str op, Ptr stream) {
            return c.all_reduce(buffer(data, count, dtype), comm::reduce_op_from_name(op), stream);
          },
          py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather",
          [](Communicator& c, Ptr in, Ptr out, std::size_t count, Str dtype, Ptr stream) {
            return c.all_gather(buffer(in, count, dtype), buffer(out, count * c.size(), dtype),
                                stream);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"),
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](Communicator& c, Ptr in, Ptr out, std::size_t count, Str dtype, Str op, Ptr stream) {
            return c.reduce_scatter(buffer(in, count * c.size(), dtype), buffer(out, count, dtype),
                                    comm::reduce_op_from_name(op), stream);
          },
          py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "broadcast",
          [](Communicator& c, Ptr data, std::size_t count, Str dtype, int root, Ptr stream) {
            return c.broadcast(buffer(data, count, dtype), root, stream);
          },
          py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("root"),
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_p2p",
          [](Communicator& c,
             const std::vector<std::tuple<bool, Ptr, std::size_t, std::string, int>>& ops,
             Ptr stream) {
            std::vector<comm::P2POp> batch;
            for (const auto& [send, data, count, dtype, peer] : ops) {
              batch.push_back(comm::P2POp{send, buffer(data, count, dtype), peer});
            }
            py::gil_scoped_release release;
            return c.batch_p2p(batch, stream);
          },
          py::arg("ops"), py::arg("stream") = 0,
          "ops: (is_send, address, count, dtype, peer group rank) each")
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::call_guard<py::gil_scoped_release>())
      .def("bytes_sent", &Communicator::bytes_sent)
      .def("reset_bytes_sent", &Communicator::reset_bytes_sent);

  m.def(
      "create_shm",
      [](Str shm_name, Str group_name, int rank, int size, double timeout_s,
         std::size_t staging_bytes, std::size_t channel_bytes, std::vector<std::int32_t> pids,
         std::vector<int> global_ranks, std::vector<std::string> labels,
         std::shared_ptr<Communicator> board) -> std::shared_ptr<Communicator> {
        comm::shm::Options options;
        options.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
        options.staging_bytes = staging_bytes;
        options.channel_bytes = channel_bytes;
        options.pids = std::move(pids);
        options.global_ranks = std::move(global_ranks);
        options.labels = std::move(labels);
        return comm::shm::ShmCommunicator::create(
            shm_name, group_name, rank, size, options,
            std::dynamic_pointer_cast<comm::shm::ShmCommunicator>(board));
      },
      py::arg("shm_name"), py::arg("group_name"), py::arg("rank"), py::arg("size"),
      py::arg("timeout_s") = 600.0, py::arg("staging_bytes") = std::size_t{4} << 20,
      py::arg("channel_bytes") = std::size_t{2} << 20,
      py::arg("pids") = std::vector<std::int32_t>{}, py::arg("global_ranks") = std::vector<int>{},
      py::arg("labels") = std::vector<std::string>{}, py::arg("board") = nullptr,
      py::call_guard<py::gil_scoped_release>(),
      "Joins a shared-memory group: collective over its ranks, which attach within the timeout. "
      "pids, global_ranks, labels: per group rank (see megart::comm::shm::Options); board: the "
      "world group, which records the first rank to fail.");
}

}  // namespace

void bind_comm(py::module_& m) {
  bind_communicator(m);
  bind_p2p_batch(m);
  m.def(
      "load_nccl",
      [](const std::vector<std::string>& candidates) {
        const auto lib = comm::NcclLibrary::load(candidates);
        return py::make_tuple(lib.path(), lib.version());
      },
      py::arg("candidates"),
      "Opens the first of `candidates` that is NCCL; returns (path, version). Raises MegartError "
      "listing every place it looked when none is.");
  m.def("nccl_version_string", &comm::nccl_version_string, py::arg("code"));
}

}  // namespace megart::bindings
