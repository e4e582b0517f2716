// The Python module jax_ep._native: the custom-call targets, the limits, the window's layout
// and the native side of a Buffer (built in steps by jax_ep/bootstrap.py).
#include <algorithm>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ffi/backends.h"
#include "ffi/ended.h"
#include "transport/fd_socket.h"
#include "kernels/limits.h"
#ifdef JAX_EP_WITH_CUDA
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"
#endif

namespace nb = nanobind;
using namespace jax_ep;

namespace {

nb::capsule capsule(const void* p) { return nb::capsule(const_cast<void*>(p)); }

nb::dict as_handlers(const Targets& targets) {
  nb::dict out;
  for (const auto& [name, t] : targets) {
    if (!t.instantiate) {
      out[name.c_str()] = capsule(reinterpret_cast<void*>(t.execute));
      continue;
    }
    nb::dict stages;
    stages["instantiate"] = capsule(reinterpret_cast<void*>(t.instantiate));
    stages["execute"] = capsule(reinterpret_cast<void*>(t.execute));
    out[name.c_str()] = stages;
  }
  return out;
}

nb::dict state_type(XLA_FFI_TypeId* id, const XLA_FFI_TypeInfo* info) {
  nb::dict d;
  d["type_id"] = capsule(id);
  d["type_info"] = capsule(info);
  return d;
}

std::vector<LocalRank> local_ranks(const std::vector<std::tuple<int, int, int>>& local) {
  std::vector<LocalRank> out;
  for (auto [device, group, rank] : local) out.push_back({device, group, rank});
  return out;
}

std::vector<EnginePeer> engine_peers(
    const std::vector<std::tuple<int, int, std::string, int>>& peers) {
  std::vector<EnginePeer> out;
  for (const auto& [group, rank, socket, pid] : peers) out.push_back({group, rank, socket, pid});
  return out;
}

std::string as_string(const nb::bytes& b) {
  return std::string(static_cast<const char*>(b.data()), b.size());
}

using Peers = std::vector<std::tuple<int, int, std::string, int>>;  // (group, rank, socket, pid)

}  // namespace

NB_MODULE(_native, m) {
  m.def("limits", [] {
    nb::dict d;
    d["max_gpu_ranks"] = kMaxGpuRanks;
    d["max_cpu_ranks"] = kMaxCpuRanks;
    d["max_in_block_tokens"] = kMaxInBlockTokens;
    d["max_rank_rows"] = kMaxRankRows;
    d["max_timeout_s"] = kMaxTimeoutSeconds;
    d["max_scales_per_row"] = kMaxScalesPerRow;
    d["expert_chunk_rows"] = kExpertChunkRows;
    d["max_grouped_matmul_groups"] = kMaxGroupedMatmulGroups;
    d["grouped_matmul_alignment"] = kGroupedMatmulAlignment;
    d["deep_gemm_rows"] = kDeepGemmRows;
    d["deep_gemm_alignment"] = kDeepGemmAlignment;
    d["deep_gemm_sms"] = kDeepGemmSms;
    d["deep_gemm_max_rows"] = kDeepGemmMaxRows;
    d["deep_gemm_max_fp8_k"] = kDeepGemmMaxFp8K;
    d["deep_gemm_tgmm_k"] = kDeepGemmTgmmK;
    d["deep_gemm_max_groups"] = kDeepGemmMaxGroups;
    return d;
  });

  nb::class_<Window>(m, "Window")
      .def(
          "__init__",
          [](Window* w, int num_ranks, int experts_per_rank, int hidden, int num_topk,
             int rows_per_source, int element_bytes) {
            new (w) Window{num_ranks, experts_per_rank, hidden,
                           num_topk,  rows_per_source,  element_bytes};
          },
          nb::arg("num_ranks"), nb::arg("experts_per_rank"), nb::arg("hidden"), nb::arg("num_topk"),
          nb::arg("rows_per_source"), nb::arg("element_bytes"))
      .def("total_bytes", &Window::total_bytes)
      .def("row_bytes", &Window::row_bytes)
      .def("rows_at", &Window::rows_at);  // the control words' bytes: the rows start there

  nb::class_<NativeBuffer>(m, "NativeBuffer").def("status", &NativeBuffer::status);
  m.def("register_buffer", &register_buffer, nb::arg("key"), nb::arg("buffer"));
  m.def("forget_buffer", &forget_buffer, nb::arg("key"));
  m.def("forget_all_buffers", &forget_all_buffers);
  m.def("watch_buffer", &watch_buffer, nb::arg("buffer"), nb::arg("rank_processes"));
  m.def("watch_process", &watch_process, nb::arg("process"), nb::arg("fd"), nb::arg("message"));
  m.def("ended_processes", &ended_processes);
  m.def("stop_watching", &stop_watching, nb::call_guard<nb::gil_scoped_release>());
  // Nodes of a tuple axis ran different ops (jax_ep/node_check.py): stops this process's ranks of
  // Buffer `key` (if it is still here) with both ops' signatures.
  m.def(
      "nodes_differ",
      [](int64_t key, int node, int other, const std::vector<uint64_t>& mine,
         const std::vector<uint64_t>& theirs) {
        auto buffer = find_buffer(key);
        if (!buffer || mine.size() != kSignatureWords || theirs.size() != kSignatureWords) return;
        AbortRecord a{};
        a.code = kNodesDiffer;
        a.giver = uint64_t(node);
        a.peer = uint64_t(other);
        std::copy(mine.begin(), mine.end(), a.mine);
        std::copy(theirs.begin(), theirs.end(), a.theirs);
        buffer->stop(a);
      },
      nb::arg("key"), nb::arg("node"), nb::arg("other"), nb::arg("mine"), nb::arg("theirs"));

  m.def("cpu_targets", [] { return as_handlers(cpu_targets()); });
  m.def("cpu_state_type", [] { return state_type(cpu_state_type_id(), cpu_state_type_info()); });
  // Built in steps by jax_ep/bootstrap.py: the constructor, connect(peers, slice_s) until it
  // returns no missing (group, rank), stop_serving().
  nb::class_<CpuBuffer, NativeBuffer>(m, "CpuBuffer")
      .def(nb::new_([](const Window& w, const std::string& socket, const nb::bytes& secret,
                       const std::vector<int>& pids, double timeout_s,
                       const std::vector<std::tuple<int, int, int>>& local, uint64_t first_op) {
        const std::string key = as_string(secret);
        nb::gil_scoped_release release;
        return std::make_shared<CpuBuffer>(w, socket, key, pids, timeout_s, local_ranks(local),
                                           first_op);
      }))
      .def_prop_ro("socket", &CpuBuffer::socket)
      .def_prop_ro("notes", &CpuBuffer::notes)
      .def(
          "connect",
          [](CpuBuffer& b, const Peers& peers, double slice_s) {
            auto p = engine_peers(peers);
            nb::gil_scoped_release release;
            return b.connect(p, slice_s);
          },
          nb::arg("peers"), nb::arg("slice_s"))
      .def("stop_serving", &CpuBuffer::stop_serving, nb::call_guard<nb::gil_scoped_release>());

  // The descriptor passing of both engines, on any descriptor (tests run it on their own files).
  nb::class_<fd_socket::Server>(m, "FdServer")
      .def(
          "__init__",
          [](fd_socket::Server* s, const std::string& name, const nb::bytes& secret,
             const std::map<std::pair<int, int>, std::pair<int, uint64_t>>& descriptors,
             const std::vector<int>& pids) {
            std::map<std::pair<int, int>, fd_socket::Descriptor> served;
            for (const auto& [where, d] : descriptors) served[where] = {d.first, d.second};
            new (s) fd_socket::Server(name, as_string(secret), pids, std::move(served));
          },
          nb::arg("name"), nb::arg("secret"), nb::arg("descriptors"),
          nb::arg("pids") = std::vector<int>())
      .def("stop", &fd_socket::Server::stop)
      .def_prop_ro("name", &fd_socket::Server::name)
      .def_prop_ro("notes", &fd_socket::Server::notes)
      .def_prop_ro("served", &fd_socket::Server::served)
      .def_prop_ro("refused", &fd_socket::Server::refused);
  m.def(
      "receive_fd",
      [](const std::string& name, int group, int rank, const nb::bytes& secret, double timeout_s,
         int pid) {
        const std::string key = as_string(secret), who = rank_name(group, rank);
        uint64_t bytes = 0;
        int fd;
        {
          nb::gil_scoped_release release;
          fd = fd_socket::receive(name, group, rank, key, pid, timeout_s, who, &bytes);
        }
        if (fd == -2 && PyErr_CheckSignals() != 0) throw nb::python_error();
        if (fd < 0)
          throw std::runtime_error("jax_ep: " + who + " did not serve its window within " +
                                   std::to_string(timeout_s) + " s (socket '@" + name + "')");
        return std::make_tuple(fd, bytes);
      },
      nb::arg("name"), nb::arg("group"), nb::arg("rank"), nb::arg("secret"), nb::arg("timeout_s"),
      nb::arg("pid") = 0);
  m.def("socket_owner", &fd_socket::owner, nb::arg("name"));

#ifdef JAX_EP_WITH_CUDA
  m.attr("has_cuda") = true;
#ifdef JAX_EP_WITH_GROUPED_GEMM
  m.attr("has_grouped_gemm") = true;  // CUTLASS's grouped matmuls (kernels/cuda/grouped_gemm.h)
#else
  m.attr("has_grouped_gemm") = false;
#endif
#ifdef JAX_EP_WITH_DEEP_GEMM
  m.attr("has_deep_gemm") = true;  // and DeepGEMM's (kernels/cuda/deep_gemm.h)
#else
  m.attr("has_deep_gemm") = false;
#endif
  m.def("cuda_targets", [] { return as_handlers(cuda_targets()); });
  m.def("cuda_state_type", [] { return state_type(cuda_state_type_id(), cuda_state_type_info()); });
  m.def("cuda_handler_calls", &cuda_handler_calls);
  m.def("nccl_unique_id", [](const std::string& library) {
    std::string id = nccl::unique_id(library);
    return nb::bytes(id.data(), id.size());
  });
  nb::class_<CudaBuffer, NativeBuffer>(m, "CudaBuffer")
      .def(nb::new_([](const Window& w, const std::string& library, double timeout_s, int num_sms,
                       const std::vector<std::tuple<int, int, int>>& local,
                       const std::map<int, nb::bytes>& ids, bool direct_local, uint64_t first_op) {
        std::map<int, std::string> unique_ids;
        for (const auto& [group, id] : ids)
          unique_ids[group] = std::string(static_cast<const char*>(id.data()), id.size());
        // Ctrl-C while the processes meet: Python's signal handlers run every 100 ms (in the
        // main thread), and a KeyboardInterrupt they raise ends the wait.
        auto interrupted = [] {
          nb::gil_scoped_acquire acquire;
          return PyErr_CheckSignals() != 0;
        };
        std::shared_ptr<CudaBuffer> made;
        std::string error;
        {
          nb::gil_scoped_release release;  // collective: other threads may join it
          try {
            made = std::make_shared<CudaBuffer>(w, library, timeout_s, num_sms, local_ranks(local),
                                                unique_ids, direct_local, first_op, interrupted);
          } catch (const std::exception& e) {
            error = e.what();
          }
        }
        if (PyErr_Occurred()) throw nb::python_error();  // the KeyboardInterrupt
        if (!error.empty()) throw std::runtime_error(error);
        return made;
      }));
  m.def("nccl_built_version", &nccl::built_version);
  m.def("nccl_library_version", &nccl::library_version, nb::arg("path"));
  m.def("cuda_device_uuid", &cuda_ipc::device_uuid, nb::arg("device"));
  nb::class_<CudaIpcBuffer, NativeBuffer>(m, "CudaIpcBuffer")
      .def(nb::new_([](const Window& w, const std::string& socket, const nb::bytes& secret,
                       const std::vector<int>& pids, double timeout_s, int num_sms,
                       const std::vector<std::tuple<int, int, int>>& local, bool direct_local,
                       uint64_t first_op) {
        const std::string key = as_string(secret);
        nb::gil_scoped_release release;
        return std::make_shared<CudaIpcBuffer>(w, socket, key, pids, timeout_s, num_sms,
                                               local_ranks(local), direct_local, first_op);
      }))
      .def_prop_ro("socket", &CudaIpcBuffer::socket)
      .def_prop_ro("notes", &CudaIpcBuffer::notes)
      .def(
          "connect",
          [](CudaIpcBuffer& b, const Peers& peers, double slice_s) {
            auto p = engine_peers(peers);
            nb::gil_scoped_release release;
            return b.connect(p, slice_s);
          },
          nb::arg("peers"), nb::arg("slice_s"))
      .def("stop_serving", &CudaIpcBuffer::stop_serving, nb::call_guard<nb::gil_scoped_release>());
#else
  m.attr("has_cuda") = false;
  m.attr("has_grouped_gemm") = false;
  m.attr("has_deep_gemm") = false;
#endif
}
