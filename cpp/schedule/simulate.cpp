#include "schedule/simulate.hpp"

#include <algorithm>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "schedule/dataflow.hpp"
#include "schedule/state_machine.hpp"
#include "schedule/validate.hpp"

namespace megart::schedule {

namespace {

struct Posted {
  int rank;
  size_t span;  // index into that rank's communication spans
  double time;
};

// A directed link between two ranks: messages leave in order, one at a time.
struct Link {
  std::deque<Posted> sends, recvs;
  double free_at = 0;
};

struct Event {
  double time;
  long order;  // ties resolve in creation order, so runs are deterministic
  int rank;    // compute done on `rank`, or a transfer done between `rank` and `peer`
  int peer;
  size_t span;
  size_t peer_span;
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : order > o.order; }
};

class Simulator {
 public:
  Simulator(const Schedule& s, const Costs& c) : s_(s), costs_(c) {
    for (int r = 0; r < s.stages; ++r) machines_.emplace_back(s, r);
    computing_.assign(s.stages, false);
    out_.ranks.resize(s.stages);
  }

  Simulation run() {
    for (int r = 0; r < s_.stages; ++r) pump(r, 0);
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      if (e.peer < 0) {
        computing_[e.rank] = false;
        machines_[e.rank].complete(out_.ranks[e.rank].compute[e.span].action);
        pump(e.rank, e.time);
      } else {
        machines_[e.rank].complete(out_.ranks[e.rank].communication[e.span].action);
        machines_[e.peer].complete(out_.ranks[e.peer].communication[e.peer_span].action);
        pump(e.rank, e.time);
        pump(e.peer, e.time);
      }
    }
    report_deadlock();
    return summarise();
  }

 private:
  double cost(const Action& a, int rank) const { return costs_.of(a, s_.chunks, rank); }

  void push(double time, int rank, int peer, size_t span, size_t peer_span) {
    events_.push(Event{time, next_order_++, rank, peer, span, peer_span});
  }

  // Issues everything this rank can issue now. A rank computes one action at a time; posting
  // a send or a receive takes no time.
  void pump(int rank, double now) {
    RankStateMachine& sm = machines_[rank];
    RankTimeline& tl = out_.ranks[rank];
    while (!computing_[rank] && sm.ready()) {
      const Action a = sm.issue();
      if (is_compute(a.op)) {
        const double end = now + cost(a, rank);
        tl.compute.push_back(Span{a, now, now, end});
        computing_[rank] = true;
        push(end, rank, -1, tl.compute.size() - 1, 0);
        continue;
      }
      const Message m = *message_of(s_, rank, a);  // validated: every action has a message
      tl.communication.push_back(Span{a, now, -1, -1});
      Link& link = links_[{m.src, m.dst}];
      (is_send(a.op) ? link.sends : link.recvs)
          .push_back(Posted{rank, tl.communication.size() - 1, now});
      start_transfers(link);
    }
  }

  void start_transfers(Link& link) {
    while (!link.sends.empty() && !link.recvs.empty()) {
      const Posted tx = link.sends.front(), rx = link.recvs.front();
      link.sends.pop_front();
      link.recvs.pop_front();
      const double start = std::max({tx.time, rx.time, link.free_at});
      const double end = start + costs_.transfer();
      link.free_at = end;
      for (const Posted& p : {tx, rx}) {
        Span& span = out_.ranks[p.rank].communication[p.span];
        span.start = start;
        span.end = end;
      }
      push(end, tx.rank, rx.rank, tx.span, rx.span);
    }
  }

  void report_deadlock() const {
    std::ostringstream msg;
    int blocked = 0;
    for (const RankStateMachine& sm : machines_) {
      if (sm.done()) continue;
      msg << (blocked++ ? "; " : "") << "rank " << sm.rank();
      if (sm.has_next()) {
        msg << " is blocked at " << to_string(sm.next());
        if (auto dep = sm.blocker()) msg << ", waiting for " << to_string(*dep);
      } else {
        msg << " has issued everything but waits for";
        for (const Action& a : sm.pending()) msg << ' ' << to_string(a);
      }
    }
    if (blocked == 0) return;
    throw DeadlockError("deadlock in the " + std::string(kind_name(s_.kind)) +
                        " schedule: no rank can progress; " + msg.str());
  }

  Simulation summarise() {
    for (int r = 0; r < s_.stages; ++r) out_.ranks[r].peak_stashed = machines_[r].peak_stashed();
    sum_up(out_, costs_, s_.chunks);
    return out_;
  }

  const Schedule& s_;
  Costs costs_;
  std::vector<RankStateMachine> machines_;
  std::vector<bool> computing_;
  std::map<std::pair<int, int>, Link> links_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  long next_order_ = 0;
  Simulation out_;
};

}  // namespace

double Costs::of(const Action& a, int chunks, int rank) const {
  const double v = chunks;
  const bool staged = rank >= 0 && static_cast<size_t>(rank) < stage_forward.size();
  const double forward = staged ? stage_forward[rank] : this->forward;
  const double backward = staged ? stage_backward[rank] : this->backward;
  switch (a.op) {
    case Op::Forward:
      return forward / v;
    case Op::Backward:
      return backward / v;
    case Op::BackwardInput:
      return backward * (1 - weight_fraction) / v;
    case Op::BackwardWeight:
      return backward * weight_fraction / v;
    default:
      return 0;
  }
}

void sum_up(Simulation& sim, const Costs& costs, int chunks) {
  sim.makespan = sim.ideal = 0;
  for (size_t r = 0; r < sim.ranks.size(); ++r) {
    RankTimeline& tl = sim.ranks[r];
    tl.busy = 0;
    for (const Span& span : tl.compute) {
      // Not end - start: exact, whatever the rounding.
      tl.busy += costs.of(span.action, chunks, static_cast<int>(r));
      sim.makespan = std::max(sim.makespan, span.end);
    }
    for (const Span& span : tl.communication) sim.makespan = std::max(sim.makespan, span.end);
    sim.ideal = std::max(sim.ideal, tl.busy);
  }
  sim.bubble_fraction = sim.ideal > 0 ? (sim.makespan - sim.ideal) / sim.ideal : 0;
}

double Costs::transfer() const {
  const double wire = bandwidth > 0 ? message_bytes / bandwidth : 0;
  return latency + wire;
}

void check_costs(const Costs& c, int stages) {
  auto bad = [](double x) { return !(x >= 0) || x == std::numeric_limits<double>::infinity(); };
  bool any_bad = bad(c.forward) || bad(c.backward) || bad(c.latency) || bad(c.bandwidth) ||
                 bad(c.message_bytes);
  for (const std::vector<double>* list : {&c.stage_forward, &c.stage_backward}) {
    for (double x : *list) any_bad = any_bad || bad(x);
  }
  if (any_bad) throw ConfigError("simulation costs must be finite and non-negative");
  const size_t n = c.stage_forward.size();
  if (c.stage_backward.size() != n || (stages >= 0 && n != 0 && n != size_t(stages))) {
    throw ConfigError("stage_forward and stage_backward must both be empty or give one cost per " +
                      std::string("pipeline rank (") + std::to_string(stages) + "), not " +
                      std::to_string(n) + " and " + std::to_string(c.stage_backward.size()));
  }
  if (!(c.weight_fraction >= 0 && c.weight_fraction <= 1)) {
    throw ConfigError("weight_fraction must lie in [0, 1]");
  }
}

Simulation simulate(const Schedule& s, const Costs& costs) {
  check_costs(costs, s.stages);
  validate(s);
  return Simulator(s, costs).run();
}

}  // namespace megart::schedule
