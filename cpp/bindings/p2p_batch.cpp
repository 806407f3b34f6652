// The hot path of megart.distributed.batch_isend_irecv on host tensors, in one call: read each
// P2POp, check its tensor, map its peer to a group rank and post the batch. Done in Python it
// cost about twice what the transport itself takes for a small exchange.
//
// It only ever accepts what the Python path accepts, and declines (returns None, having posted
// nothing) on anything else: an op of another group, a tensor that is not a contiguous CPU
// tensor of a supported dtype, a peer outside the group. The Python path then raises its
// error, or handles the batch (ops spread over several groups), so every error message stays
// where it is written once.
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "comm/communicator.hpp"

namespace py = pybind11;

namespace megart::bindings {

namespace {

using comm::Communicator;

// An interned attribute name, made once and kept for the life of the process (a Python string
// must not be released after the interpreter is gone, so it never is).
py::handle name(const char* s) { return py::str(s).release(); }

// A Work of the batch that keeps its tensor referenced until the op has completed (the transport
// holds only its address), as megart.distributed.Work does for every other op; made in C++ so
// that a small exchange does not pay for a Python object per op.
class HostWork {
 public:
  HostWork(comm::WorkPtr work, py::object tensor)
      : work_(std::move(work)), tensor_(std::move(tensor)) {}

  bool wait() {
    {
      py::gil_scoped_release release;
      work_->wait();
    }
    tensor_ = py::none();
    return true;
  }
  bool is_completed() {
    bool done;
    {
      py::gil_scoped_release release;
      done = work_->is_completed();
    }
    if (done) tensor_ = py::none();
    return done;
  }

 private:
  comm::WorkPtr work_;
  py::object tensor_;
};

class P2PBatcher {
 public:
  // `ranks`: the group's global ranks in group order; `dtypes`: {torch.dtype: name} of the
  // dtypes that can be communicated; `isend`/`irecv`: the functions a P2POp's `op` names;
  // `is_world`: an op whose group is None belongs to this group. An op's group is recognised
  // by its communicator, so the batcher holds no reference to the ProcessGroup that keeps it.
  P2PBatcher(std::shared_ptr<Communicator> comm, const std::vector<int>& ranks,
             const py::dict& dtypes, py::object isend, py::object irecv, bool is_world)
      : comm_(std::move(comm)),
        isend_(std::move(isend)),
        irecv_(std::move(irecv)),
        is_world_(is_world) {
    for (std::size_t q = 0; q < ranks.size(); ++q) group_rank_[ranks[q]] = static_cast<int>(q);
    for (const auto& [torch_dtype, dtype_name] : dtypes) {
      dtypes_.emplace(torch_dtype.ptr(), comm::dtype_from_name(dtype_name.cast<std::string>()));
      keep_.push_back(py::reinterpret_borrow<py::object>(torch_dtype));
    }
  }

  // Posts `ops` and returns one HostWork per op, or None (nothing posted) to decline.
  py::object post(const py::list& ops) {
    static const py::handle kOp = name("op"), kTensor = name("tensor"), kPeer = name("peer"),
                            kGroup = name("group"), kComm = name("comm"), kDtype = name("dtype"),
                            kIsCpu = name("is_cpu"), kIsContiguous = name("is_contiguous"),
                            kDataPtr = name("data_ptr"), kNumel = name("numel");
    std::vector<comm::P2POp> batch;
    std::vector<py::object> tensors;
    batch.reserve(ops.size());
    tensors.reserve(ops.size());
    try {
      for (const py::handle p : ops) {
        const py::object group = p.attr(kGroup);
        if (group.is_none() ? !is_world_ : !ours(group.attr(kComm))) return py::none();
        const py::object fn = p.attr(kOp);
        const bool send = fn.is(isend_);
        if (!send && !fn.is(irecv_)) return py::none();
        const py::object peer_obj = p.attr(kPeer);
        if (!PyLong_CheckExact(peer_obj.ptr())) return py::none();
        const auto peer = group_rank_.find(peer_obj.cast<int>());
        if (peer == group_rank_.end()) return py::none();
        const py::object t = p.attr(kTensor);
        const auto dtype = dtypes_.find(py::object(t.attr(kDtype)).ptr());
        if (dtype == dtypes_.end()) return py::none();
        if (py::object(t.attr(kIsCpu)).ptr() != Py_True) return py::none();
        if (t.attr(kIsContiguous)().ptr() != Py_True) return py::none();
        const auto data = t.attr(kDataPtr)().cast<std::uintptr_t>();
        const auto count = t.attr(kNumel)().cast<std::size_t>();
        tensors.push_back(t);
        batch.push_back(comm::P2POp{
            send, comm::Buffer{reinterpret_cast<void*>(data), count, dtype->second}, peer->second});
      }
    } catch (const py::error_already_set&) {
      return py::none();  // not a P2POp of tensors: the checked path says what is wrong
    } catch (const py::cast_error&) {
      return py::none();
    }
    std::vector<comm::WorkPtr> works;
    {
      py::gil_scoped_release release;
      works = comm_->batch_p2p(batch, 0);
    }
    py::list out(works.size());
    for (std::size_t i = 0; i < works.size(); ++i) {
      out[i] = py::cast(HostWork(std::move(works[i]), std::move(tensors[i])));
    }
    return out;
  }

 private:
  bool ours(const py::object& comm) const {
    return py::isinstance<Communicator>(comm) && comm.cast<Communicator*>() == comm_.get();
  }

  std::shared_ptr<Communicator> comm_;
  py::object isend_, irecv_;
  bool is_world_;
  std::unordered_map<int, int> group_rank_;            // global rank -> group rank
  std::unordered_map<PyObject*, comm::DType> dtypes_;  // torch dtypes are singletons
  std::vector<py::object> keep_;                       // the torch dtypes, alive while keyed
};

}  // namespace

void bind_p2p_batch(py::module_& m) {
  py::class_<HostWork>(m, "HostWork",
                       "A point-to-point op on host memory; holds its tensor until it completes.")
      .def("wait", &HostWork::wait,
           "Blocks until the op finishes; raises its CommError if it failed.")
      .def("is_completed", &HostWork::is_completed)
      .def(
          "wait_stream", [](HostWork& w, const py::object&) { w.wait(); },
          py::arg("stream") = py::none(),
          "Host memory has no device stream to order: waits, as Work.wait_stream does on shm.");
  py::class_<P2PBatcher>(m, "P2PBatcher",
                         "Posts batch_isend_irecv's ops of one host-memory group in one call.")
      .def(py::init<std::shared_ptr<Communicator>, const std::vector<int>&, const py::dict&,
                    py::object, py::object, bool>(),
           py::arg("comm"), py::arg("ranks"), py::arg("dtypes"), py::arg("isend"), py::arg("irecv"),
           py::arg("is_world"))
      .def("post", &P2PBatcher::post, py::arg("ops"),
           "One Work per op, or None (nothing posted) when an op needs the checked Python path.");
}

}  // namespace megart::bindings
