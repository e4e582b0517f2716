// The Python module jax_ep._native: the custom-call targets, the limits, the window's layout
// and the native side of a Buffer (built in steps by jax_ep/bootstrap.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ffi/backends.h"
#include "kernels/comm/fd_socket.h"
#include "kernels/limits.h"
#ifdef JAX_EP_WITH_CUDA
#include "kernels/comm/cuda_ipc.h"
#include "kernels/comm/nccl.h"
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
      .def("row_bytes", &Window::row_bytes);

  nb::class_<NativeBuffer>(m, "NativeBuffer").def("status", &NativeBuffer::status);
  m.def("register_buffer", &register_buffer, nb::arg("key"), nb::arg("buffer"));
  m.def("forget_buffer", &forget_buffer, nb::arg("key"));
  m.def("forget_all_buffers", &forget_all_buffers);

  m.def("cpu_targets", [] { return as_handlers(cpu_targets()); });
  m.def("cpu_state_type", [] { return state_type(cpu_state_type_id(), cpu_state_type_info()); });
  nb::class_<CpuBuffer, NativeBuffer>(m, "CpuBuffer")
      .def(nb::new_([](const Window& w, const std::string& prefix, double timeout_s,
                       const std::vector<std::tuple<int, int, int>>& local, uint64_t first_op) {
        return std::make_shared<CpuBuffer>(w, prefix, timeout_s, local_ranks(local), first_op);
      }))
      .def("connect", &CpuBuffer::connect)
      .def("unlink", &CpuBuffer::unlink);

  // The descriptor passing of the CUDA-IPC engine, on any descriptor (tests run it without GPUs).
  nb::class_<fd_socket::Server>(m, "FdServer")
      .def(
          "__init__",
          [](fd_socket::Server* s, const std::string& name, int fd, uint64_t bytes, uint64_t tag) {
            new (s) fd_socket::Server(name, fd, {fd_socket::kMagic, bytes, tag});
          },
          nb::arg("name"), nb::arg("fd"), nb::arg("bytes"), nb::arg("tag"))
      .def("stop", &fd_socket::Server::stop)
      .def_prop_ro("served", &fd_socket::Server::served);
  m.def(
      "receive_fd",
      [](const std::string& name, uint64_t tag, double timeout_s, const std::string& who) {
        fd_socket::Header h{};
        int fd;
        {
          nb::gil_scoped_release release;
          fd = fd_socket::receive(name, tag, timeout_s, who, &h);
        }
        return std::make_tuple(fd, h.bytes);
      },
      nb::arg("name"), nb::arg("tag"), nb::arg("timeout_s"), nb::arg("who"));

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
        nb::gil_scoped_release release;  // collective: other threads may join it
        return std::make_shared<CudaBuffer>(w, library, timeout_s, num_sms, local_ranks(local),
                                            unique_ids, direct_local, first_op);
      }));
  m.def("nccl_built_version", &nccl::built_version);
  m.def("nccl_library_version", &nccl::library_version, nb::arg("path"));
  m.def("cuda_device_uuid", &cuda_ipc::device_uuid, nb::arg("device"));
  nb::class_<CudaIpcBuffer, NativeBuffer>(m, "CudaIpcBuffer")
      .def(nb::new_([](const Window& w, const std::string& prefix, uint64_t tag, double timeout_s,
                       int num_sms, const std::vector<std::tuple<int, int, int>>& local,
                       bool direct_local, uint64_t first_op) {
        nb::gil_scoped_release release;
        return std::make_shared<CudaIpcBuffer>(w, prefix, tag, timeout_s, num_sms,
                                               local_ranks(local), direct_local, first_op);
      }))
      .def("connect", &CudaIpcBuffer::connect, nb::call_guard<nb::gil_scoped_release>())
      .def("stop_serving", &CudaIpcBuffer::stop_serving, nb::call_guard<nb::gil_scoped_release>());
#else
  m.attr("has_cuda") = false;
  m.attr("has_grouped_gemm") = false;
  m.attr("has_deep_gemm") = false;
#endif
}
