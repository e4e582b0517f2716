// The Python module jax_ep._native: custom-call targets and the native side of Buffer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ffi/registry.h"
#include "ffi/targets.h"

namespace nb = nanobind;
using namespace jax_ep;

namespace {

nb::dict as_capsules(const Targets& targets) {
  nb::dict out;
  for (const auto& [name, fn] : targets) out[name.c_str()] = nb::capsule(reinterpret_cast<void*>(fn));
  return out;
}

int64_t create_buffer(const std::string& platform, const std::vector<std::vector<int>>& groups,
                      int num_experts, double timeout_s, int num_sms, int hidden, int num_topk,
                      int low_latency_tokens) {
  auto state = std::make_shared<BufferState>();
  state->num_ranks = int(groups.at(0).size());
  state->num_experts = num_experts;
  for (int g = 0; g < int(groups.size()); ++g)
    for (int r = 0; r < int(groups[g].size()); ++r) state->places[groups[g][r]] = Place{g, r};
  if (platform == "cpu") {
    for (size_t g = 0; g < groups.size(); ++g)
      state->cpu_groups.push_back(std::make_unique<cpu::Group>(state->num_ranks, timeout_s));
  } else if (platform == "cuda") {
#ifdef JAX_EP_WITH_CUDA
    state->cuda = cuda_connect(groups, num_experts / state->num_ranks, hidden, num_topk,
                               low_latency_tokens, num_sms, timeout_s);
#else
    throw std::runtime_error("jax_ep was built without its CUDA backend (set JAX_EP_CUDA=ON)");
#endif
  } else {
    throw std::invalid_argument("jax_ep: no backend for platform " + platform);
  }
  return register_buffer(std::move(state));
}

}  // namespace

NB_MODULE(_native, m) {
  m.def("cpu_targets", [] { return as_capsules(cpu_targets()); });
#ifdef JAX_EP_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("cuda_targets", [] { return as_capsules(cuda_targets()); });
  m.def("cuda_handler_calls", &cuda_handler_calls);
  m.def("peer_gbps", &cuda_peer_gbps, nb::arg("src"), nb::arg("dst"), nb::arg("bytes"),
        nb::arg("blocks"), nb::arg("mode"), nb::arg("iters"), nb::arg("both_ways"),
        nb::arg("dst_buffer") = 0, nb::call_guard<nb::gil_scoped_release>());
#else
  m.attr("has_cuda") = false;
#endif
  m.def("create_buffer", &create_buffer, nb::arg("platform"), nb::arg("groups"),
        nb::arg("num_experts"), nb::arg("timeout_s"), nb::arg("num_sms"), nb::arg("hidden"),
        nb::arg("num_topk"), nb::arg("low_latency_tokens"));
  m.def("destroy_buffer", &unregister_buffer, nb::arg("buffer_id"));
}
