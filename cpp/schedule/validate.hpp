// The rules every schedule keeps, checked without running it.
#pragma once

#include <string>
#include <vector>

#include "schedule/schedule.hpp"

namespace megart::schedule {

// Every problem found (empty when the schedule is valid):
// - each (microbatch, chunk) of each rank has one F and one backward (B, or I then W), F first;
// - each compute that needs data has one receive from the right peer before it, and each
//   compute whose result leaves the rank has one send to the right peer after it;
// - between any two ranks, the sends of one and the receives of the other match one to one and
//   in the same order.
std::vector<std::string> problems(const Schedule& s);

// Throws ScheduleError listing the first problems when there are any.
void validate(const Schedule& s);

}  // namespace megart::schedule
