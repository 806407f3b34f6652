// Placing sends and receives around the compute actions of every rank.
#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "schedule/dataflow.hpp"
#include "schedule/schedule.hpp"

namespace megart::schedule {

namespace {

// Key of a message within the stream of one sender to one receiver.
struct MessageKey {
  bool gradient;
  int microbatch;
  int dst_chunk;
  bool operator<(const MessageKey& o) const {
    return std::tie(gradient, microbatch, dst_chunk) <
           std::tie(o.gradient, o.microbatch, o.dst_chunk);
  }
};

struct PendingRecv {
  Action action;
  int slot;        // emitted just before compute `slot`
  int send_index;  // position in the sender's stream to this rank
};

}  // namespace

Schedule with_communication(Kind kind, int stages, int microbatches, int chunks,
                            const std::vector<std::vector<Action>>& compute) {
  check_arguments(kind, stages, microbatches, chunks);
  if (static_cast<int>(compute.size()) != stages) {
    throw ConfigError("expected compute orders for " + std::to_string(stages) + " ranks, got " +
                      std::to_string(compute.size()));
  }
  Schedule s{kind, stages, microbatches, chunks, {}};

  // The order in which each sender emits messages to each receiver: sends follow computes.
  std::map<std::pair<int, int>, std::map<MessageKey, int>> stream_position;
  for (int rank = 0; rank < stages; ++rank) {
    for (const Action& a : compute[rank]) {
      if (!is_compute(a.op)) {
        throw ConfigError("compute orders hold only F, B, I and W actions; got " + to_string(a));
      }
      if (auto send = output_of(s, rank, a)) {
        const Message m = *message_of(s, rank, *send);
        auto& stream = stream_position[{m.src, m.dst}];
        stream.emplace(MessageKey{m.gradient, m.microbatch, m.dst_chunk}, stream.size());
      }
    }
  }

  for (int rank = 0; rank < stages; ++rank) {
    const auto& order = compute[rank];
    const int n = static_cast<int>(order.size());
    // Each receive is wanted one compute ahead of its consumer.
    std::map<int, std::vector<PendingRecv>> by_peer;
    for (int k = 0; k < n; ++k) {
      if (auto recv = input_of(s, rank, order[k])) {
        const Message m = *message_of(s, rank, *recv);
        const auto& stream = stream_position[{m.src, m.dst}];
        const auto it = stream.find({m.gradient, m.microbatch, m.dst_chunk});
        // A receive whose send never comes keeps its place; validation reports it.
        const int index = it == stream.end() ? static_cast<int>(stream.size()) + k : it->second;
        by_peer[recv->peer].push_back({*recv, std::max(k - 1, 0), index});
      }
    }
    // Receives from one peer must be posted in the order that peer sends: a message wanted
    // later but sent earlier is posted no later than the ones behind it.
    std::vector<PendingRecv> recvs;
    for (auto& [peer, list] : by_peer) {
      std::sort(list.begin(), list.end(), [](const PendingRecv& a, const PendingRecv& b) {
        return a.send_index < b.send_index;
      });
      for (int j = static_cast<int>(list.size()) - 2; j >= 0; --j) {
        list[j].slot = std::min(list[j].slot, list[j + 1].slot);
      }
      recvs.insert(recvs.end(), list.begin(), list.end());
    }
    std::stable_sort(recvs.begin(), recvs.end(), [](const PendingRecv& a, const PendingRecv& b) {
      return std::tie(a.slot, a.action.peer, a.send_index) <
             std::tie(b.slot, b.action.peer, b.send_index);
    });

    std::vector<Action> actions;
    auto next_recv = recvs.begin();
    for (int k = 0; k < n; ++k) {
      for (; next_recv != recvs.end() && next_recv->slot == k; ++next_recv) {
        actions.push_back(next_recv->action);
      }
      actions.push_back(order[k]);
      if (auto send = output_of(s, rank, order[k])) actions.push_back(*send);
    }
    s.ranks.push_back(std::move(actions));
  }
  return s;
}

}  // namespace megart::schedule
