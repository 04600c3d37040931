"""Builds AOTInductor's wrapper in two parts, and the part every op shares once.

Most of what a CPU signature takes to compile goes to the generated
``*.wrapper.cpp``, and little of that is the op: the file opens with
the C interface of the model container (``extern "C" { ... }``), whose code
and the ``AOTInductorModelBase<AOTInductorModel>`` it instantiates are the same
text for every signature. So while a compile runs, Inductor's build of that
file is replaced by:

- the shared part, compiled with the base explicitly instantiated, once per
  environment and text (kept in the user's private directory, so that every
  cache root uses it). It also holds the model's constructor, which
  constructs the base (see ``_MODEL_PARTS``);
- the op's part, compiled with ``extern template`` for the base and without
  the interface's headers, so that it only generates its own code (the
  base's constructor and those headers were over half of its compile). It
  runs while Inductor compiles the kernel file;
- a relocatable link of the two into the object Inductor expects, before
  Inductor links the library as usual.

The op's part compiles with a precompiled header of its own where that has
been built (:class:`_OpPartHeader`): Inductor's, with the regex templates its
inline functions instantiate declared ``extern`` ahead of it.

The library is linked to export only AOTInductor's C interface and the hook
below: the C++ code it instantiates otherwise exports some 400 symbols, about
a quarter of a stripped library's size, that nothing outside it looks up.

The op's part also allocates its outputs and buffers through a hook that the
runtime fills when it loads the library (``aoti_eager_empty_strided_hook``,
see ``csrc/compiled_kernel.cpp``): on CUDA, straight from the caching
allocator instead of through the dispatcher. Until it is filled, and in a
library built whole, allocation is AOTInductor's own. It reads a runtime
number (a 0-d CPU tensor) in place instead of through the dispatcher. The
shared part adds the runtime's entry point, ``aoti_eager_run``: AOTInductor's
less its per-call thread-local work.

On CPU, where every use of an input in the generated ``run_impl`` only reads
it, the op's part borrows its inputs (``_borrow_inputs``): the caller keeps
them alive for the call, instead of handing over a new ``at::Tensor`` per input
for the library to delete, and the library says so with
``aoti_eager_borrows_inputs``.

On CUDA, a float that the kernel reads at run time (``.item()`` of a 0-d CPU
tensor, :mod:`aoti_eager.kernels.signature`'s runtime numbers) reaches each
Triton launch through a generated ``call_triton_*`` helper whose parameter
Inductor types ``int64_t`` (as for every symbol), so 3.7 arrived as 3
(torch 2.11 on the H100; 2.13's code types it alike). :func:`_float_parameters_as_double` retypes the
parameters that a helper converts to a floating-point kernel argument, in the
whole wrapper as in the split one.

Both parts are compiled with Inductor's own command line. A wrapper that does
not have the expected shape, or a part that fails to compile, gets Inductor's
own build instead: the split can change how long a compile takes, not what it
produces. ``AOTI_EAGER_SPLIT_WRAPPER=0`` turns it off.

Torch internals it touches (:data:`INTERNALS`), checked with torch 2.11, 2.13
and 2.14.1: ``torch._inductor.cpp_builder.CppBuilder.build``, replaced within
:func:`split_wrapper_builds`; ``torch._inductor.cpp_builder.CppBuilder.get_command_line``,
read and extended; the builder's ``_name`` and ``_output_dir``, which
``torch._inductor.cpp_builder.CppBuilder.__init__`` sets, and
``torch._inductor.cpp_builder._BUILD_TEMP_DIR``, where Inductor runs its
command; besides, the text AOTInductor generates (the model container's C
interface, the model's constructor, ``run_impl``'s inputs, the launch helpers),
each matched where it is rewritten. Where one of the internals has moved
(``missing(INTERNALS)``), nothing is replaced: Inductor builds as it does without this
package (no split, no stage times, no version script, no other linker), and
the checks against eager stand between a launch helper's parameter types and
a wrong result. Text of another shape is left as Inductor wrote it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from aoti_eager import settings
from aoti_eager.cache import layout
from aoti_eager.kernels.inductor.internals import missing

try:
    from torch._inductor import cpp_builder
except ImportError:  # missing(INTERNALS) names it, and the builds are Inductor's own
    cpp_builder = None


log = logging.getLogger("aoti_eager")

INTERNALS = (
    "torch._inductor.cpp_builder.CppBuilder.build(self)",
    "torch._inductor.cpp_builder.CppBuilder.get_command_line(self)",
    "torch._inductor.cpp_builder.CppBuilder.__init__(name, sources, BuildOption, output_dir)",
    "torch._inductor.cpp_builder._BUILD_TEMP_DIR",
)


_INTERFACE_END = '\n} // extern "C"\n'
_BASE = "torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>"
_OWN_HELPERS = """
extern "C" __attribute__((visibility("default"))) AOTITorchError (*aoti_eager_empty_strided_hook)(
    int64_t, const int64_t*, const int64_t*, int32_t, int32_t, int32_t, AtenTensorHandle*) = nullptr;
static inline AOTITorchError aoti_eager_empty_strided(
    int64_t ndim, const int64_t* sizes, const int64_t* strides, int32_t dtype,
    int32_t device_type, int32_t device_index, AtenTensorHandle* result) {
  auto* allocate = aoti_eager_empty_strided_hook ? aoti_eager_empty_strided_hook : aoti_torch_empty_strided;
  return allocate(ndim, sizes, strides, dtype, device_type, device_index, result);
}

// A runtime number (csrc/op_override.cpp) is a 0-d CPU tensor that the runtime
// made: read in place, instead of through the dispatcher's item(), a
// dispatcher call on every call (BENCHMARKS.md, "Per-call dispatch"). Any
// other tensor is the shim's.
template <class T>
static inline AOTITorchError aoti_eager_item(
    AtenTensorHandle tensor, int32_t dtype, T* value, AOTITorchError (*item)(AtenTensorHandle, T*)) {
  int32_t device_type = -1, tensor_dtype = -1;
  int64_t numel = 0;
  void* data = nullptr;
  if (aoti_torch_get_device_type(tensor, &device_type) == AOTI_TORCH_SUCCESS &&
      device_type == aoti_torch_device_type_cpu() &&
      aoti_torch_get_dtype(tensor, &tensor_dtype) == AOTI_TORCH_SUCCESS && tensor_dtype == dtype &&
      aoti_torch_get_numel(tensor, &numel) == AOTI_TORCH_SUCCESS && numel == 1 &&
      aoti_torch_get_data_ptr(tensor, &data) == AOTI_TORCH_SUCCESS) {
    *value = *static_cast<const T*>(data);
    return AOTI_TORCH_SUCCESS;
  }
  return item(tensor, value);
}
static inline AOTITorchError aoti_eager_item_float64(AtenTensorHandle tensor, double* value) {
  return aoti_eager_item(tensor, aoti_torch_dtype_float64(), value, aoti_torch_item_float64);
}
static inline AOTITorchError aoti_eager_item_int64(AtenTensorHandle tensor, int64_t* value) {
  return aoti_eager_item(tensor, aoti_torch_dtype_int64(), value, aoti_torch_item_int64);
}
"""
_OWN_CALLS = {
    "aoti_torch_empty_strided(": "aoti_eager_empty_strided(",
    "aoti_torch_item_float64(": "aoti_eager_item_float64(",
    "aoti_torch_item_int64(": "aoti_eager_item_int64(",
}


# Inputs as the caller lent them (csrc/compiled_kernel.cpp): read, never owned.
_BORROWED_HANDLES = """
namespace torch::aot_inductor {
class AOTIEagerBorrowedHandle {
 public:
  explicit AOTIEagerBorrowedHandle(AtenTensorHandle handle) : handle_(handle) {}
  operator AtenTensorHandle() const { return handle_; }
  AtenTensorHandle get() const { return handle_; }
  void reset() { handle_ = nullptr; }
  void* data_ptr() const {
    void* result = nullptr;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(handle_, &result));
    return result;
  }
 private:
  AtenTensorHandle handle_;
};
struct AOTIEagerBorrowedHandles {
  AOTIEagerBorrowedHandle operator[](size_t i) const { return AOTIEagerBorrowedHandle(handles[i]); }
  void clear() {}
  AtenTensorHandle* handles;
};
} // namespace torch::aot_inductor
"""
# The entry point csrc/compiled_kernel.cpp calls, in the shared part: AOTInductor's
# AOTInductorModelContainerRunSingleThreaded less two thread-local writes per
# call that a call from inside the dispatcher does not need (the last error's
# string, kept for AOTInductorGetLastError, and a grad-mode guard of three shim
# calls, which the runtime replaces with one thread-local read).
_ENTRY_POINT = """
extern "C" __attribute__((visibility("default"))) AOTIRuntimeError aoti_eager_run(
    AOTInductorModelContainerHandle container, AtenTensorHandle* inputs, AtenTensorHandle* outputs,
    AOTInductorStreamHandle stream, AOTIProxyExecutorHandle proxy_executor) {
  try {
    reinterpret_cast<torch::aot_inductor::AOTInductorModelContainer*>(container)->run_single_threaded(
        inputs, outputs, reinterpret_cast<torch::aot_inductor::DeviceStreamType>(stream), proxy_executor);
  } catch (const std::exception& e) {
    std::cerr << "Error: " << e.what() << '\\n';
    return AOTI_RUNTIME_FAILURE;
  } catch (...) {
    std::cerr << "Unknown exception occurred.\\n";
    return AOTI_RUNTIME_FAILURE;
  }
  return AOTI_RUNTIME_SUCCESS;
}
"""
# The model's constructor, split in two. Its base class's constructor (the
# same for every op) is most of what the op's part took to compile, the
# device-string regex it parses with included. So the
# shared part constructs the base, from numbers the op's part defines, and calls
# the op's part for the rest. The op's part is reached through an explicit
# specialization of a member template that AOTInductorModel declares (the
# only way to add a member to it: the rest of the constructor writes
# protected fields).
_MODEL_PARTS = """
namespace torch::aot_inductor {
struct AOTIEagerModelParts {
  size_t num_inputs;
  size_t num_outputs;
  size_t num_constants;
  bool include_weights;
};
struct AOTIEagerModelInit {
  std::shared_ptr<ConstantMap> constants_map;
  std::shared_ptr<std::vector<ConstantHandle>> constants_array;
};
template <>
int AOTInductorModel::run_impl_minimal_arrayref_interface<AOTIEagerModelInit, int>(
    const AOTIEagerModelInit& init, DeviceStreamType, AOTIProxyExecutorHandle);
extern const AOTIEagerModelParts aoti_eager_model_parts;
} // namespace torch::aot_inductor
"""
_SHARED_CONSTRUCTOR = """
namespace torch::aot_inductor {
AOTInductorModel::AOTInductorModel(
    std::shared_ptr<ConstantMap> constants_map,
    std::shared_ptr<std::vector<ConstantHandle>> constants_array,
    const std::string& device_str,
    std::optional<std::string> cubin_dir)
    : AOTInductorModelBase(
          aoti_eager_model_parts.num_inputs,
          aoti_eager_model_parts.num_outputs,
          aoti_eager_model_parts.num_constants,
          device_str,
          std::move(cubin_dir),
          aoti_eager_model_parts.include_weights) {
  run_impl_minimal_arrayref_interface<AOTIEagerModelInit, int>(
      AOTIEagerModelInit{std::move(constants_map), std::move(constants_array)}, nullptr, nullptr);
}
} // namespace torch::aot_inductor
"""
_OWN_CONSTRUCTOR = """extern const AOTIEagerModelParts aoti_eager_model_parts = {{{parts}}};
template <>
int AOTInductorModel::run_impl_minimal_arrayref_interface<AOTIEagerModelInit, int>(
    const AOTIEagerModelInit& init, DeviceStreamType, AOTIProxyExecutorHandle) {{
    std::shared_ptr<ConstantMap> constants_map = init.constants_map;
    std::shared_ptr<std::vector<ConstantHandle>> constants_array = init.constants_array;
{body}
    return 0;
}}
"""
_CONSTRUCTOR = re.compile(
    r"AOTInductorModel::AOTInductorModel\(std::shared_ptr<ConstantMap> constants_map,\s*"
    r"std::shared_ptr<std::vector<ConstantHandle>> constants_array,\s*"
    r"const std::string& device_str,\s*"
    r"std::optional<std::string> cubin_dir\)\s*"
    r": AOTInductorModelBase\((\d+),\s*(\d+),\s*(\d+),\s*device_str,\s*std::move\(cubin_dir\),\s*(true|false)\) \{\n"
)
# What only the shared part uses: the op's part compiles faster without them.
_INTERFACE_HEADERS = ("<torch/csrc/inductor/aoti_runtime/interface.h>", "<torch/csrc/inductor/aoti_runtime/model_container.h>")
_DEVICE_HEADER = "#include <torch/csrc/inductor/aoti_include/"


# The regex parts of libstdc++ that the model's header instantiates for
# parse_device_str(), an inline function of every wrapper. GCC leaves what a
# precompiled header would instantiate to each file that includes it, so every
# op's part instantiated them again, over a third of its compile. The op's
# part never calls the function; the shared part does, and holds them. They
# are declared ahead of the header in a precompiled header of the op's part's
# own (see _OpPartHeader); where these names are not the compiler's library
# (another libstdc++, libc++), that header fails to build, and the op's part
# uses Inductor's.
_SUB_MATCH = "std::__cxx11::sub_match<std::string::const_iterator>"
_REGEX_TRAITS = "std::__cxx11::regex_traits<char>"
_ELSEWHERE = "".join(f"extern template class {name};\n" for name in (
    "std::__cxx11::basic_regex<char>",
    _REGEX_TRAITS,
    _SUB_MATCH,
    "std::__cxx11::match_results<std::string::const_iterator>",
    f"std::vector<{_SUB_MATCH}>",
    f"std::vector<std::pair<long, std::vector<{_SUB_MATCH}>>>",
    f"std::__detail::_Compiler<{_REGEX_TRAITS}>",
    "std::__detail::_Scanner<char>",
    f"std::__detail::_NFA<{_REGEX_TRAITS}>",
    f"std::__detail::_StateSeq<{_REGEX_TRAITS}>",
    *(f"std::__detail::_Executor<std::string::const_iterator, std::allocator<{_SUB_MATCH}>, {_REGEX_TRAITS}, {dfs}>"
      for dfs in ("true", "false")),
))


class _OpPartHeader:
    """The op's part's own precompiled header (see :data:`_ELSEWHERE`), keyed
    by its text and the command without a compile's file names. Built beside
    a compile's parts by one process at a time; until it is there, op's parts
    use Inductor's header. A build that fails is recorded and not tried again,
    unless its compiler was killed or the disk was full (that may go better
    next time)."""

    def __init__(self, tokens: list[str], device_header: str, shared_dir: Path):
        self.tokens = tokens
        self._build: subprocess.Popen | None = None
        self._lock: FileLock | None = None
        self.header: Path | None = None
        self.built = False
        if "-include" not in tokens or not device_header.startswith(_DEVICE_HEADER):
            return
        self._at = tokens.index("-include")
        rest = tokens[:self._at] + tokens[self._at + 2:]
        source = next(i for i, t in enumerate(rest) if t.endswith(".cpp"))
        self._text = "#include <regex>\n" + _ELSEWHERE + device_header + "\n"
        flags = ["_" if i == source or rest[i - 1] == "-o" else t for i, t in enumerate(rest)]
        self.header = shared_dir / f"op-part-{hashlib.sha256((self._text + shlex.join(flags)).encode()).hexdigest()[:24]}.h"
        self.built = Path(f"{self.header}.gch").exists()
        self._building = self.header.with_name(f".{self.header.name}.gch.{os.getpid()}.tmp")
        self._build_command = [
            *rest[:source], "-x", "c++-header", str(self.header),
            *(str(self._building) if rest[i - 1] == "-o" else t for i, t in enumerate(rest) if i > source and t != "-c"),
        ]

    def own_command(self) -> list[str]:
        """The op's part's command: with this header where it is built."""
        if not self.built:
            return self.tokens
        return self.tokens[:self._at + 1] + [str(self.header)] + self.tokens[self._at + 2:]

    def start(self, cwd: Path) -> None:
        """Starts building the header where it is neither built, nor failed, nor being built."""
        if self.header is None or self.built or self.header.with_suffix(".failed").exists():
            return
        lock = FileLock(f"{self.header}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return
        self._lock = lock
        # Under the lock, another process's unfinished build is one that was killed (135 MB).
        for stale in self.header.parent.glob(f".{self.header.name}.gch.*.tmp"):
            stale.unlink(missing_ok=True)
        layout.atomic_write_text(self.header, self._text)
        self._build = subprocess.Popen(self._build_command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def finish(self) -> None:
        """Waits for a build this process started, and puts it in place or records its failure."""
        if self._build is None:
            return
        try:
            output = self._build.communicate()[0].decode(errors="replace")
            if self._build.returncode == 0:
                os.replace(self._building, f"{self.header}.gch")
                return
            self._building.unlink(missing_ok=True)
            # A full disk may have room next time, as a killed compiler may.
            if self._build.returncode > 0 and "No space left on device" not in output:
                self.header.with_suffix(".failed").write_text(output[-4000:])
            log.debug("aoti_eager: the op's part's precompiled header failed to build: %s", output[-2000:])
        finally:
            self._build = None
            self._lock.release()


def _shared_head(head: str) -> str:
    """The wrapper's text up to the interface's end, as the shared part takes it:
    with the first device header only. A CUDA wrapper that reads a runtime
    number also includes the CPU header (for the number's 0-d tensor), which
    the interface does not use; kept, it made a second shared part, built
    by a compile of ``mul(x, 0.5)`` on CUDA."""
    lines = head.split("\n")
    device = [i for i, line in enumerate(lines) if line.startswith(_DEVICE_HEADER)]
    return "\n".join(line for i, line in enumerate(lines) if i not in device[1:])


def _split_constructor(own_body: str) -> str | None:
    """``own_body`` with the model's constructor replaced by its own part (see
    _MODEL_PARTS), or None where the constructor is not as expected."""
    head = _CONSTRUCTOR.search(own_body)
    end = own_body.find("\n}\n", head.end()) if head else -1
    if end < 0 or re.search(r"\b(device_str|cubin_dir)\b", own_body[head.end():end]):
        return None
    parts = ", ".join(head.groups())
    own = _OWN_CONSTRUCTOR.format(parts=parts, body=own_body[head.end():end])
    return own_body[:head.start()] + own + own_body[end + len("\n}\n"):]


_STEAL = "auto inputs = steal_from_raw_handles_to_raii_handles(input_handles, "
_BORROW = "auto inputs = AOTIEagerBorrowedHandles{input_handles}; // of "
_BORROWS = 'extern "C" __attribute__((visibility("default"))) const int aoti_eager_borrows_inputs = 1;\n'


def _borrow_inputs(own_text: str) -> str:
    """``own_text`` with run_impl borrowing its inputs, where each use of one
    only reads it: its data pointer, a size or stride check, a call of the
    shim or of the helpers above (neither takes ownership of an argument),
    dropping it. Any other use (a move into an owner, a handle handed back as
    an output) keeps it as it is: the library steals its inputs, as
    AOTInductor's do."""
    if own_text.count(_STEAL) != 1 or "CACHE_TORCH_DEVICE(cpu)" not in own_text or "CACHE_TORCH_DEVICE(cuda)" in own_text:
        return own_text
    start = own_text.index(_STEAL)
    body = own_text[start:own_text.index("} // AOTInductorModel::run_impl", start)]
    names = re.findall(r"auto (\w+) = std::move\(inputs\[\d+\]\);", body)
    for line in body.splitlines()[1:]:
        for name in names:
            for use in re.finditer(rf"(?<![\w&]){name}(?!\w)", line):
                rest, stripped = line[use.end():], line.strip()
                if not (
                    rest.startswith((".data_ptr()", ".reset();", " = std::move(inputs["))
                    or "assert_size_stride(" in stripped
                    or stripped.startswith(("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_", "AOTI_TORCH_ERROR_CODE_CHECK(aoti_eager_"))
                ):
                    return own_text
    return own_text.replace(_STEAL, _BORROW) + _BORROWS


# A launch helper's head (AOTInductor writes one per Triton kernel, its
# parameters on one line or one a line), and a floating-point kernel argument
# made from a name (Triton signature fp32 or fp64).
_HELPER = re.compile(r"\bvoid call_triton_\w+\(([^()]*)\)\s*\{")
_FLOAT_ARGUMENT = re.compile(r"\b(?:double|float) var_\d+ = (\w+);")


def _float_parameters_as_double(text: str) -> str:
    """``text`` with each launch helper's ``int64_t`` parameter that the helper
    hands to its kernel as a float typed ``double`` instead. Only runtime
    floats are such parameters: an int goes to its kernel as i32 or i64.

        >>> helper = "static void call_triton_k(\\n    int64_t zuf0,\\n    int64_t xnumel\\n){\\n    double var_1 = zuf0;\\n    int64_t var_2 = xnumel;\\n}\\n"
        >>> print(_float_parameters_as_double(helper).splitlines()[1:3])
        ['    double zuf0,', '    int64_t xnumel']
    """
    pieces, done = [], 0
    for head in _HELPER.finditer(text):
        # Helpers are top-level functions: the body ends at the first brace in
        # column 0 (the kernel's Triton source, in a comment in it, is indented).
        body_end = text.find("\n}", head.end())
        floats = set(_FLOAT_ARGUMENT.findall(text, head.end(), body_end if body_end >= 0 else len(text)))
        if floats:
            parameters = re.sub(r"\bint64_t (\w+)\b", lambda p: f"double {p.group(1)}" if p.group(1) in floats else p.group(0), head.group(1))
            pieces += [text[done:head.start(1)], parameters]
            done = head.end(1)
    return "".join(pieces) + text[done:]


class _Unsplittable(Exception):
    pass


def _stage(tokens: list[str]) -> str:
    """What a compiler run builds, for the breakdown of a compile's time."""
    if "-shared" in tokens:
        return "link"
    for suffix, name in ((".wrapper.cpp", "wrapper"), (".kernel.cpp", "kernel"), (".S", "constants"), (".hpp", "header")):
        if any(t.endswith(suffix) for t in tokens):
            return name
    return "other"


@contextlib.contextmanager
def split_wrapper_builds(shared_dir: Path | None, seconds: dict[str, float], linker: str | None = None) -> Iterator[None]:
    """Within the block, Inductor's compiler runs are timed into ``seconds`` (by
    stage), libraries are linked with ``linker`` (see
    :func:`aoti_eager.kernels.toolchain.linker`) and, with a ``shared_dir``,
    wrappers are built in two parts. Not thread-safe: a process compiles one
    call at a time (Inductor is not thread-safe either). Where an internal
    has moved (``missing(INTERNALS)``), Inductor builds as it is."""
    moved = missing(INTERNALS)
    if moved:
        log.debug("aoti_eager: Inductor's own builds: %s", "; ".join(moved))
        yield
        return
    original = cpp_builder.CppBuilder.build
    pending: list[Callable[[], None]] = []

    def finish_pending() -> None:
        while pending:
            pending.pop()()

    def build(builder: cpp_builder.CppBuilder) -> None:
        tokens = shlex.split(builder.get_command_line())
        stage = _stage(tokens)
        if stage == "wrapper":
            _retype_float_parameters(builder, tokens)
        if stage == "link":
            finish_pending()
            if shared_dir is not None:
                _export_only_the_interface(builder)
        if stage == "wrapper" and shared_dir is not None and settings.split_wrapper.get():
            try:
                pending.append(_start_split(tokens, shared_dir, builder, original, seconds))
                return
            except Exception as e:  # noqa: BLE001 - any surprise: Inductor's own build
                log.debug("aoti_eager: building the wrapper whole: %s", e)
        start = time.perf_counter()
        if stage == "link" and linker is not None:
            _link_with(linker, builder, original)
        else:
            original(builder)
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start

    cpp_builder.CppBuilder.build = build
    try:
        yield
    finally:
        cpp_builder.CppBuilder.build = original
        # Reached early only by an error: the parts' compilers are not left running.
        with contextlib.suppress(Exception):
            finish_pending()


def _retype_float_parameters(builder: cpp_builder.CppBuilder, tokens: list[str]) -> None:
    """Applies :func:`_float_parameters_as_double` to the wrapper's source file."""
    source = _build_directory(builder) / next(t for t in tokens if t.endswith(".wrapper.cpp"))
    text = source.read_text()
    if "call_triton_" in text and (fixed := _float_parameters_as_double(text)) != text:
        source.write_text(fixed)


def _build_directory(builder: cpp_builder.CppBuilder) -> Path:
    """Where Inductor runs the builder's command: its paths may be relative to it."""
    return Path(builder._output_dir) / f"{builder._name}_{cpp_builder._BUILD_TEMP_DIR}"


def _link_with(linker: str, builder: cpp_builder.CppBuilder, original: Callable[[cpp_builder.CppBuilder], None]) -> None:
    """Links with ``-fuse-ld=linker``; where that fails, with Inductor's command as it is."""
    command = builder.get_command_line()
    builder.get_command_line = lambda: f"{command} -fuse-ld={linker}"
    try:
        original(builder)
    except Exception as e:  # noqa: BLE001 - the compiler's default linker decides
        log.debug("aoti_eager: linking with %s failed, linking as Inductor does: %s", linker, e)
        builder.get_command_line = lambda: command
        original(builder)


# The runner looks up AOTInductor* functions (torch/csrc/inductor/aoti_runner);
# csrc/compiled_kernel.cpp looks up the allocation hook.
_EXPORTS = "{ global: AOTInductor*; aoti_eager_*; local: *; };\n"


def _export_only_the_interface(builder: cpp_builder.CppBuilder) -> None:
    exports = Path(builder._output_dir) / "aoti_eager_exports.map"
    exports.write_text(_EXPORTS)
    command = builder.get_command_line() + f" -Wl,--version-script={shlex.quote(str(exports))}"
    builder.get_command_line = lambda: command


def _start_split(
    tokens: list[str],
    shared_dir: Path,
    builder: cpp_builder.CppBuilder,
    original: Callable[[cpp_builder.CppBuilder], None],
    seconds: dict[str, float],
) -> Callable[[], None]:
    """Starts the compiles of a wrapper's parts; the returned function waits for
    them and links them (or falls back to ``original(builder)``)."""
    start = time.perf_counter()
    source_index = next(i for i, t in enumerate(tokens) if t.endswith(".wrapper.cpp"))
    if "-c" not in tokens or "-o" not in tokens:
        raise _Unsplittable("not the compile of one wrapper")
    cwd = _build_directory(builder)
    cwd.mkdir(parents=True, exist_ok=True)
    source, output = cwd / tokens[source_index], cwd / tokens[tokens.index("-o") + 1]
    text = source.read_text()
    end = text.find(_INTERFACE_END)
    if end < 0 or "AOTInductorModel::run_impl" not in text[end:]:
        raise _Unsplittable("the wrapper has no model container interface to split off")
    end += len(_INTERFACE_END)
    includes = "".join(
        line + "\n" for line in text[:end].splitlines() if line.startswith("#include") and not line.endswith(_INTERFACE_HEADERS)
    )
    shared_text = _shared_head(text[:end]) + f"\ntemplate class {_BASE};\n" + _ENTRY_POINT
    own_body = text[end:]
    for call, replacement in _OWN_CALLS.items():
        own_body = own_body.replace(call, replacement)
    if (split := _split_constructor(own_body)) is not None:
        own_body = _MODEL_PARTS + split
        shared_text += _MODEL_PARTS + _SHARED_CONSTRUCTOR
    own_text = _borrow_inputs(
        includes
        + f"extern template class {_BASE};\n"
        + _OWN_HELPERS
        + _BORROWED_HANDLES
        + own_body
    )

    def command(part: Path, obj: Path) -> list[str]:
        return [str(part) if i == source_index else str(obj) if tokens[i - 1] == "-o" else t for i, t in enumerate(tokens)]

    # The key names everything that shapes the shared object: its text and the
    # command line without this compile's own file names.
    key = hashlib.sha256((shared_text + shlex.join(command(Path("_"), Path("_")))).encode()).hexdigest()[:24]
    shared_obj = shared_dir / f"wrapper-interface-{key}.o"
    parts = {"own": (source.with_name(source.stem + ".own.cpp"), source.with_name(source.stem + ".own.o"))}
    parts["own"][0].write_text(own_text)
    commands = {}
    device_header = next((line for line in includes.splitlines() if line.startswith(_DEVICE_HEADER)), "")
    op_part_header = _OpPartHeader(command(*parts["own"]), device_header, shared_dir)
    commands["own"] = op_part_header.own_command()
    if not shared_obj.exists():
        parts["shared"] = (source.with_name(source.stem + ".shared.cpp"), shared_obj.with_name(f".{shared_obj.name}.{os.getpid()}.tmp"))
        parts["shared"][0].write_text(shared_text)
        commands["shared"] = command(*parts["shared"])
    running = {
        name: subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for name, argv in commands.items()
    }
    op_part_header.start(cwd)

    started = time.perf_counter() - start

    def finish() -> None:
        start = time.perf_counter()
        failed = None
        try:
            for name, process in running.items():
                out = process.communicate()[0].decode(errors="replace")
                if process.returncode != 0:
                    failed = failed or f"the {name} part failed to compile: {out[-2000:]}"
            shared = parts["shared"][1] if "shared" in running else shared_obj
            link = [tokens[0], "-r", "-nostdlib", str(shared), str(parts["own"][1]), "-o", str(output)]
            if failed is None and subprocess.run(link, cwd=cwd, capture_output=True).returncode != 0:
                failed = "the relocatable link failed"
                if "shared" not in running:
                    shared_obj.unlink(missing_ok=True)  # damaged: the next compile builds it again
            if "shared" in running:
                with contextlib.suppress(OSError):  # e.g. the cache was cleared meanwhile
                    if running["shared"].returncode == 0:
                        os.chmod(shared, 0o600)
                        os.replace(shared, shared_obj)
                    shared.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001
            failed = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):  # e.g. the cache was cleared meanwhile
            op_part_header.finish()
        shutil.rmtree(cwd, ignore_errors=True)
        if failed is not None:
            log.debug("aoti_eager: building the wrapper whole: %s", failed)
            original(builder)
        # What the wrapper cost beyond the kernel's compile, which it ran beside.
        seconds["wrapper"] = seconds.get("wrapper", 0.0) + started + time.perf_counter() - start

    return finish
