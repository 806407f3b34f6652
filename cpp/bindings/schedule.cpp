#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "schedule/post_plan.hpp"
#include "schedule/simulate.hpp"
#include "schedule/state_machine.hpp"
#include "schedule/validate.hpp"

namespace py = pybind11;

namespace megart::bindings {

using namespace megart::schedule;

namespace {

void bind_types(py::module_& m) {
  py::class_<Action>(m, "Action", "One step of one rank: a compute or a communication.")
      .def(py::init([](const std::string& op, int microbatch, int chunk, int peer) {
             return Action{op_from_name(op), microbatch, chunk, peer};
           }),
           py::arg("op"), py::arg("mb"), py::arg("chunk") = 0, py::arg("peer") = -1)
      .def_property_readonly("op", [](const Action& a) { return op_name(a.op); })
      .def_readonly("mb", &Action::microbatch)
      .def_readonly("chunk", &Action::chunk)
      .def_readonly("peer", &Action::peer)
      .def_property_readonly("is_compute", [](const Action& a) { return is_compute(a.op); })
      .def(py::self == py::self)
      .def("__hash__",
           [](const Action& a) {
             return py::hash(py::make_tuple(static_cast<int>(a.op), a.microbatch, a.chunk, a.peer));
           })
      .def("__repr__", [](const Action& a) { return to_string(a); });

  py::class_<Schedule>(m, "Schedule", "Every rank's ordered actions for one iteration.")
      .def(py::init([](const std::string& kind, int stages, int microbatches, int chunks,
                       std::vector<std::vector<Action>> ranks) {
             return Schedule{kind_from_name(kind), stages, microbatches, chunks, std::move(ranks)};
           }),
           py::arg("kind"), py::arg("stages"), py::arg("microbatches"), py::arg("chunks"),
           py::arg("ranks"))
      .def_property_readonly("kind", [](const Schedule& s) { return kind_name(s.kind); })
      .def_readonly("stages", &Schedule::stages)
      .def_readonly("microbatches", &Schedule::microbatches)
      .def_readonly("chunks", &Schedule::chunks)
      .def_readonly("ranks", &Schedule::ranks)
      .def_readonly("forward_only", &Schedule::forward_only)
      .def("virtual_stage", &Schedule::virtual_stage, py::arg("rank"), py::arg("chunk"))
      .def("__repr__", [](const Schedule& s) {
        return "Schedule(kind='" + std::string(kind_name(s.kind)) +
               "', stages=" + std::to_string(s.stages) +
               ", microbatches=" + std::to_string(s.microbatches) +
               ", chunks=" + std::to_string(s.chunks) +
               (s.forward_only ? ", forward_only=True)" : ")");
      });

  py::class_<Costs>(m, "Costs", "Costs of a simulated iteration, in any one unit of time.")
      .def(py::init([](double forward, double backward, double weight_fraction, double latency,
                       double bandwidth, double message_bytes, std::vector<double> stage_forward,
                       std::vector<double> stage_backward) {
             return Costs{forward,   backward,      weight_fraction, latency,
                          bandwidth, message_bytes, stage_forward,   stage_backward};
           }),
           py::arg("forward") = 1.0, py::arg("backward") = 2.0, py::arg("weight_fraction") = 0.5,
           py::arg("latency") = 0.0, py::arg("bandwidth") = 0.0, py::arg("message_bytes") = 0.0,
           py::arg("stage_forward") = std::vector<double>{},
           py::arg("stage_backward") = std::vector<double>{})
      .def_readwrite("forward", &Costs::forward)
      .def_readwrite("backward", &Costs::backward)
      .def_readwrite("weight_fraction", &Costs::weight_fraction)
      .def_readwrite("latency", &Costs::latency)
      .def_readwrite("bandwidth", &Costs::bandwidth)
      .def_readwrite("message_bytes", &Costs::message_bytes)
      .def_readwrite("stage_forward", &Costs::stage_forward)
      .def_readwrite("stage_backward", &Costs::stage_backward);

  py::class_<Span>(m, "Span", "An action on a timeline.")
      .def_readonly("action", &Span::action)
      .def_readonly("issued", &Span::issued)
      .def_readonly("start", &Span::start)
      .def_readonly("end", &Span::end)
      .def("__repr__", [](const Span& s) {
        return to_string(s.action) + " [" + std::to_string(s.start) + ", " + std::to_string(s.end) +
               "]";
      });

  py::class_<RankTimeline>(m, "RankTimeline")
      .def_readonly("compute", &RankTimeline::compute)
      .def_readonly("communication", &RankTimeline::communication)
      .def_readonly("busy", &RankTimeline::busy)
      .def_readonly("peak_stashed", &RankTimeline::peak_stashed);

  py::class_<Simulation>(m, "Simulation")
      .def_readonly("ranks", &Simulation::ranks)
      .def_readonly("makespan", &Simulation::makespan)
      .def_readonly("ideal", &Simulation::ideal)
      .def_readonly("bubble_fraction", &Simulation::bubble_fraction);

  py::class_<Step>(m, "Step",
                   "One thing a rank does, in its order: run a compute, or post communication "
                   "actions as one group.")
      .def(py::init([](std::optional<Action> compute, std::vector<Action> post) {
             return Step{std::move(compute), std::move(post)};
           }),
           py::arg("compute") = py::none(), py::arg("post") = std::vector<Action>{})
      .def_readonly("compute", &Step::compute)
      .def_readonly("post", &Step::post)
      .def("__repr__", [](const Step& st) {
        if (st.compute) return "Step(compute=" + to_string(*st.compute) + ")";
        std::string out = "Step(post=[";
        for (size_t i = 0; i < st.post.size(); ++i) out += (i ? ", " : "") + to_string(st.post[i]);
        return out + "])";
      });
}

void bind_state_machine(py::module_& m) {
  py::class_<RankStateMachine>(
      m, "RankStateMachine",
      "One rank's schedule, driven step by step: issue() the next action when ready(), "
      "complete() it when it has finished.")
      .def(py::init<const Schedule&, int>(), py::arg("schedule"), py::arg("rank"))
      .def_property_readonly("rank", &RankStateMachine::rank)
      .def("done", &RankStateMachine::done)
      .def("has_next", &RankStateMachine::has_next)
      .def("next", &RankStateMachine::next)
      .def("blocker", &RankStateMachine::blocker)
      .def("ready", &RankStateMachine::ready)
      .def("issue", &RankStateMachine::issue)
      .def("complete", &RankStateMachine::complete, py::arg("action"))
      .def("pending", &RankStateMachine::pending)
      .def_property_readonly("stashed", &RankStateMachine::stashed)
      .def_property_readonly("peak_stashed", &RankStateMachine::peak_stashed);
}

Kind parse_kind(const std::string& kind) { return kind_from_name(kind); }

}  // namespace

void bind_schedule(py::module_& m) {
  bind_types(m);
  bind_state_machine(m);
  m.def(
      "build",
      [](const std::string& kind, int stages, int microbatches, int chunks) {
        return build(parse_kind(kind), stages, microbatches, chunks);
      },
      py::arg("kind"), py::arg("stages"), py::arg("microbatches"), py::arg("chunks") = 1);
  m.def(
      "compute_orders",
      [](const std::string& kind, int stages, int microbatches, int chunks) {
        return compute_orders(parse_kind(kind), stages, microbatches, chunks);
      },
      py::arg("kind"), py::arg("stages"), py::arg("microbatches"), py::arg("chunks") = 1);
  m.def(
      "with_communication",
      [](const std::vector<std::vector<Action>>& compute, int microbatches, int chunks,
         const std::string& kind) {
        return with_communication(parse_kind(kind), static_cast<int>(compute.size()), microbatches,
                                  chunks, compute);
      },
      py::arg("compute_orders"), py::arg("microbatches"), py::arg("chunks") = 1,
      py::arg("kind") = "custom");
  m.def("forward_only", &forward_only, py::arg("schedule"));
  m.def("problems", &problems, py::arg("schedule"));
  m.def("validate", &validate, py::arg("schedule"));
  m.def("post_plan", &post_plan, py::arg("schedule"), py::arg("costs") = Costs{},
        py::call_guard<py::gil_scoped_release>());
  m.def("simulate", &simulate, py::arg("schedule"), py::arg("costs") = Costs{},
        py::call_guard<py::gil_scoped_release>());
  m.def("simulate_plan", &simulate_plan, py::arg("schedule"), py::arg("costs") = Costs{},
        py::arg("planned_for") = std::nullopt, py::call_guard<py::gil_scoped_release>());
  m.def(
      "theoretical_bubble",
      [](const std::string& kind, int stages, int microbatches, int chunks) {
        return theoretical_bubble(parse_kind(kind), stages, microbatches, chunks);
      },
      py::arg("kind"), py::arg("stages"), py::arg("microbatches"), py::arg("chunks") = 1);
}

}  // namespace megart::bindings
