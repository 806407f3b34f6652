"""Every C++/CUDA file under cpp/ and cuda/ includes the standard header of each std facility it
uses, so that the build does not depend on which standard headers happen to include which others.

Why: GCC 12's libstdc++ (our CI) reaches <system_error> through <optional>; a newer libstdc++ does
not, so cpp/comm/shm/progress.cpp, which used std::system_error without including <system_error>,
built here and failed to build on a GPU machine's newer GCC. The compiler here cannot show such a
gap, so this test reads the sources instead.

What it checks: the files git tracks under cpp/ (*.cpp, *.hpp, *.h, *.cc) and cuda/ (*.cpp, *.hpp,
*.cu, *.cuh), or the same globs without build/ where git is unavailable. Comments, string literals
and character literals are blanked first; each use of a name in FACILITIES (written std::name)
then needs one of the name's headers among the file's own #include <...> lines. Where the C++17
standard declares a name in several headers (std::size_t, std::swap, std::initializer_list...),
any of them will do; FACILITIES lists only what the standard guarantees.

The rule: each file includes what it uses itself; a header does not cover the files that include
it, with one exception. A source file (.cpp, .cc, .cu) may rely on the standard headers that its
own matching header includes directly: the project header it includes whose file name has the
same stem (foo.cpp and "foo.hpp" or "dir/foo.hpp"), as Google's style guide lets foo.cc rely on
foo.h. That header's own includes count; what they include in turn does not.

Not checked: names outside FACILITIES, unqualified C names (size_t, memcpy, uint64_t from the C
headers) and names reached through `using namespace std`.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = {"cpp": (".cpp", ".hpp", ".h", ".cc"), "cuda": (".cpp", ".hpp", ".cu", ".cuh")}
SOURCE_SUFFIXES = (".cpp", ".cc", ".cu")

# Header(s): names after std:: that any one of the headers declares, per the C++17 standard; an
# indented line goes on with the line above; # starts a comment.
_TABLE = """
<system_error>: system_error error_code error_condition error_category system_category
    generic_category errc make_error_code
<stdexcept>: runtime_error invalid_argument logic_error out_of_range length_error domain_error
    range_error overflow_error underflow_error
<exception>: exception exception_ptr current_exception rethrow_exception make_exception_ptr
    terminate nested_exception throw_with_nested uncaught_exceptions
<string>: string to_string stoi stol stoll stoul stoull stof stod getline
<string_view>: string_view
<vector>: vector
<deque>: deque
<list>: list
<array>: array
<map>: map multimap
<set>: set multiset
<unordered_map>: unordered_map unordered_multimap
<unordered_set>: unordered_set unordered_multiset
<queue>: queue priority_queue
<memory>: unique_ptr shared_ptr weak_ptr make_unique make_shared enable_shared_from_this
    dynamic_pointer_cast static_pointer_cast
<functional>: function ref cref bind greater less plus
<thread>: thread this_thread
<mutex>: mutex recursive_mutex timed_mutex lock_guard unique_lock scoped_lock once_flag
    call_once try_to_lock defer_lock adopt_lock
<condition_variable>: condition_variable condition_variable_any cv_status
<future>: future promise async packaged_task
<atomic>: atomic atomic_thread_fence memory_order memory_order_relaxed memory_order_acquire
    memory_order_release memory_order_acq_rel memory_order_seq_cst
<chrono>: chrono
<optional>: optional nullopt nullopt_t make_optional
<variant>: variant monostate holds_alternative visit
<utility>: pair make_pair move forward exchange declval index_sequence make_index_sequence
    integer_sequence  # move: the one-argument cast (<algorithm>'s range move is not told apart)
<utility> <string_view>: swap  # <algorithm> declared it only until C++11
<tuple>: tuple make_tuple tie forward_as_tuple apply
<algorithm>: min max minmax clamp sort stable_sort partial_sort nth_element find find_if
    find_if_not fill fill_n copy copy_n copy_if any_of all_of none_of count_if remove_if
    is_sorted lower_bound upper_bound binary_search reverse max_element min_element transform
    for_each
<numeric>: accumulate iota inner_product partial_sum reduce gcd lcm
<iterator>: back_inserter distance next prev advance
<sstream>: ostringstream istringstream stringstream
<fstream>: ifstream ofstream fstream
<iostream>: cout cerr clog cin
<cstring>: memcpy memmove memset memcmp strerror strlen strcmp strncmp strncpy strchr strstr
<cstdio>: printf fprintf snprintf sprintf fflush fopen fclose fputs puts
<cstdlib>: getenv abort exit _Exit quick_exit atexit atoi atol atof strtol strtoll strtoul
    strtoull strtod strtof malloc calloc free
<cmath>: fabs sqrt pow exp log log2 tanh erf isnan isfinite isinf fmax fmin fma floor ceil round
<cstdint> <cinttypes>: uint64_t int64_t uint32_t int32_t uint16_t int16_t uint8_t int8_t
    uintptr_t intptr_t uintmax_t intmax_t  # <cinttypes> includes <cstdint>
<cstddef> <cstring> <cstdlib> <cstdio> <ctime> <cwchar> <cuchar>: size_t
<cstddef>: ptrdiff_t nullptr_t max_align_t byte
<limits>: numeric_limits
<random>: mt19937 mt19937_64 random_device normal_distribution uniform_int_distribution
    uniform_real_distribution bernoulli_distribution
<type_traits>: is_same is_same_v enable_if enable_if_t conditional_t decay_t remove_reference_t
    remove_cv_t integral_constant true_type false_type is_integral_v is_floating_point_v
    is_trivially_copyable_v underlying_type_t
<initializer_list> <utility> <string> <array> <deque> <forward_list> <list> <vector> <map> <set>
    <unordered_map> <unordered_set> <queue> <stack> <algorithm> <random> <regex> <valarray>:
    initializer_list  # each of these headers' synopses includes <initializer_list>
"""


def _facilities(table):
    entries = []
    for line in table.splitlines():
        line = line.split("#")[0].rstrip()
        if line[:1].isspace():
            entries[-1] += line
        elif line:
            entries.append(line)
    facilities = {}
    for entry in entries:
        headers, names = entry.split(":")
        for name in names.split():
            assert name not in facilities, f"std::{name} is twice in the table"
            facilities[name] = tuple(headers.split())
    return facilities


FACILITIES = _facilities(_TABLE)

_USE = re.compile(r"\bstd::(" + "|".join(sorted(FACILITIES, key=len, reverse=True)) + r")\b")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)
_RAW_PREFIXES = {"R", "uR", "UR", "LR", "u8R"}


def strip(text):
    """Returns (text without comments, text without comments and literals); line breaks stay."""
    no_comments, code = [], []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            no_comments.append(" " * (end - i))
            code.append(" " * (end - i))
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            blank = re.sub(r"[^\n]", " ", text[i:end])
            no_comments.append(blank)
            code.append(blank)
            i = end
            continue
        prefix = re.search(r"\w*$", text[max(0, i - 3) : i]).group()
        if c == '"' and prefix in _RAW_PREFIXES:
            close = text.find("(", i)
            delim = ")" + text[i + 1 : close] + '"'
            end = text.find(delim, close)
            end = n if end < 0 else end + len(delim)
        elif c == '"' or (c == "'" and not (i and (text[i - 1].isalnum() or text[i - 1] == "_"))):
            end = i + 1  # a literal; a ' after a word character is a digit separator
            while end < n and text[end] not in (c, "\n"):
                end += 2 if text[end] == "\\" else 1
            end = min(end + 1, n)
        else:
            no_comments.append(c)
            code.append(c)
            i += 1
            continue
        no_comments.append(text[i:end])
        code.append(re.sub(r"[^\n]", " ", text[i:end]))
        i = end
    return "".join(no_comments), "".join(code)


def parse(text):
    """Returns (the <...> headers, the "..." includes, {name: first line}) of one file's text."""
    no_comments, code = strip(text)
    system, project = set(), []
    for bracket, name in _INCLUDE.findall(no_comments):
        if bracket == "<":
            system.add(f"<{name.strip()}>")
        else:
            project.append(name.strip())
    uses = {}
    for match in _USE.finditer(code):
        uses.setdefault(match.group(1), code.count("\n", 0, match.start()) + 1)
    return system, project, uses


def tracked_files(root=ROOT):
    git = shutil.which("git")
    listed = None
    if git is not None:
        done = subprocess.run(
            [git, "ls-files", "-z", "--", *SCANNED],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode == 0:
            listed = [Path(p) for p in done.stdout.split("\0") if p]
    if listed is None:
        listed = [p.relative_to(root) for top in SCANNED for p in (root / top).rglob("*")]
    return sorted(
        p
        for p in listed
        if p.parts[0] in SCANNED
        and p.suffix in SCANNED[p.parts[0]]
        and "build" not in p.parts
        and (root / p).is_file()
    )


def matching_header(root, path, project_includes):
    """The file of the project header `path` includes whose name has the same stem, or None."""
    if path.suffix not in SOURCE_SUFFIXES:
        return None
    for name in project_includes:
        if Path(name).stem != path.stem:
            continue
        for base in (root / path.parent, *(root / top for top in SCANNED)):
            if (base / name).is_file():
                return base / name
    return None


def violations(root=ROOT, files=None):
    """Lines "file:line: std::name: add #include <header>", one per header a file lacks."""
    found = []
    for path in tracked_files(root) if files is None else files:
        system, project, uses = parse((root / path).read_text(errors="replace"))
        header = matching_header(root, path, project)
        if header is not None:
            system |= parse(header.read_text(errors="replace"))[0]
        missing = {}
        for name, line in uses.items():
            headers = FACILITIES[name]
            if not system.intersection(headers):
                missing.setdefault(headers, []).append((line, name))
        for headers, names in missing.items():
            line, name = min(names)
            others = sorted({n for _, n in names} - {name})
            also = f" (also std::{', std::'.join(others)})" if others else ""
            instead = f" (or any of {', '.join(headers[1:])})" if len(headers) > 1 else ""
            message = f"{path}:{line}: std::{name}{also}: add #include {headers[0]}{instead}"
            found.append((path, line, message))
    return [message for _, _, message in sorted(found)]


def test_cpp_and_cuda_include_what_they_use():
    found = violations()
    if found:
        pytest.fail(
            f"{len(found)} missing standard include(s) (the rule is in this test's docstring):\n"
            + "\n".join(found),
            pytrace=False,
        )


def test_scan_covers_the_sources():
    files = tracked_files()
    assert Path("cpp/comm/shm/progress.cpp") in files
    assert any(p.suffix == ".cu" for p in files) and any(p.suffix == ".cuh" for p in files)


def test_without_git_the_scan_globs_and_skips_build(tmp_path):
    for name in ("cpp/a/x.cpp", "cpp/build/y.cpp", "cuda/k/z.cuh", "cuda/k/notes.txt", "doc/w.cpp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert tracked_files(tmp_path) == [Path("cpp/a/x.cpp"), Path("cuda/k/z.cuh")]


def test_comments_and_literals_are_ignored_and_matching_headers_count(tmp_path):
    (tmp_path / "cpp" / "a").mkdir(parents=True)
    (tmp_path / "cpp" / "a" / "foo.hpp").write_text("#pragma once\n#include <string>\n")
    (tmp_path / "cpp" / "a" / "foo.cpp").write_text(
        '#include "a/foo.hpp"\n'
        "// std::vector<int> in a comment\n"
        "/* std::thread\n   std::mutex */\n"
        'const char* s = "std::map // not a comment";\n'
        "char q = '\"'; int big = 1'000;\n"
        'auto r = R"x(std::deque )" )x";\n'
        "std::string name;\n"
        "std::size_t n = std::move(name).size();\n"
    )
    (tmp_path / "cpp" / "a" / "bar.cpp").write_text('#include "a/foo.hpp"\nstd::string s;\n')
    found = violations(tmp_path, [Path("cpp/a/foo.cpp"), Path("cpp/a/bar.cpp")])
    assert found == [
        "cpp/a/bar.cpp:2: std::string: add #include <string>",
        "cpp/a/foo.cpp:9: std::move: add #include <utility>",
        "cpp/a/foo.cpp:9: std::size_t: add #include <cstddef>"
        " (or any of <cstring>, <cstdlib>, <cstdio>, <ctime>, <cwchar>, <cuchar>)",
    ]
