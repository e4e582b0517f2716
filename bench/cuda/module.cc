// The Python module bench._probe (built with -DJAX_EP_PROBES=ON; see bench/probe.py).
#include <nanobind/nanobind.h>

#include "bench/cuda/probe.h"

namespace nb = nanobind;

NB_MODULE(_probe, m) {
  m.def(
      "peer_gbps",
      [](int src, int dst, int64_t bytes, int blocks, int mode, int iters, bool both_ways,
         uintptr_t dst_buffer) {
        return jax_ep::probe::peer_gbps(src, dst, bytes, blocks, mode, iters, both_ways,
                                        reinterpret_cast<void*>(dst_buffer));
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("bytes"), nb::arg("blocks"), nb::arg("mode"),
      nb::arg("iters"), nb::arg("both_ways"), nb::arg("dst_buffer") = 0,
      nb::call_guard<nb::gil_scoped_release>());
}
