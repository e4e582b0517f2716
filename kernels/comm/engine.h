// What the engines that set up a Buffer's windows rank by rank (shm.h, cuda_ipc.h) give each of
// this process's ranks.
#pragma once
#include <cstdint>
#include <vector>

namespace jax_ep {

struct EngineMember {
  int device;                   // local device ordinal
  int group;                    // EP group (a coordinate of the mesh's other axes)
  int rank;                     // position along the Buffer's axis
  uint8_t* window = nullptr;    // this rank's window, zeroed
  std::vector<uint8_t*> peers;  // every rank's window of the group as this process maps it
};

}  // namespace jax_ep
